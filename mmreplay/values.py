"""Turning user values into leaf arrays, or refusing them before anything is written.

Casts allowed: any safe numpy cast; integer to integer and float to a narrower float
(float64 rewards into a float32 leaf, as RL code does everywhere) when every value fits
the leaf's range; integer to float. One rule for both: a finite value past the leaf's
range is refused, never stored as something else (an integer wrapped around, a float
as infinity); infinities and NaN are data and are stored as given. Refused too: anything
to bool (but bool), float to integer, complex to real, strings, objects and ``None``.
Shapes must match exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import BadInputError
from .spec import ArraySpec, flatten, is_namedtuple, join_path, leaf_paths

__all__ = ["StepValidator", "cast_needs_no_values", "cast_refusal", "float_overflow", "flatten_value"]


def cast_refusal(a: np.ndarray, dst: np.dtype) -> str | None:
    """Why ``a`` may not be stored as ``dst``, or None when it may."""
    src = a.dtype
    if cast_needs_no_values(src, dst):
        return None
    if src.kind in "iu" and dst.kind in "iu":
        if a.size == 0:
            return None
        info = np.iinfo(dst)
        lo, hi = a.min(), a.max()
        if lo >= info.min and hi <= info.max:
            return None
        return f"values {lo}..{hi} do not fit {dst}"
    if (src.kind in "iuf" and dst.kind in "fc") or (src.kind == "c" and dst.kind == "c"):
        return float_overflow(a, dst)
    return f"casting {src} to {dst} is not safe"


def float_overflow(a: np.ndarray, dst: np.dtype) -> str | None:
    """Why ``a`` does not fit the float (or complex) ``dst``: a finite value past its
    range, which the cast would make infinite; None when every value fits."""
    big = float(np.finfo(dst).max)
    with np.errstate(over="ignore", invalid="ignore"):
        bad = np.isinf(a.astype(dst)) & np.isfinite(a)
    if not bad.any():
        return None
    value = a[bad].flat[0]
    return f"value {value!r} is past the range of {dst} (largest {big:g}); it would be stored as infinity"


def cast_needs_no_values(src: np.dtype, dst: np.dtype) -> bool:
    """Whether :func:`cast_refusal` accepts every array of ``src`` for ``dst`` whatever
    its values: safe casts, and integers into float32 or wider (every integer fits)."""
    if src == dst or np.can_cast(src, dst, "safe"):
        return True
    return src.kind in "iu" and dst.kind in "fc" and float(np.finfo(dst).max) >= 2.0**64


def _squares_limit(src: np.dtype, dst: np.dtype) -> float | None:
    """For real floats into a narrower float leaf: the sum of squares below which no value
    of an array is past the leaf's range (what the per-step check compares a dot product
    with); None for other casts."""
    if src.kind != "f" or dst.kind != "f":
        return None
    limit = float(np.finfo(dst).max) ** 2
    return limit if limit < np.inf else None


def flatten_value(spec: Any, value: Any, root: str = "the step") -> list[Any]:
    """``value``'s leaves along ``spec``'s nest, in flatten order; a
    :class:`BadInputError` names the first place they differ (``root``: what the value is)."""
    out: list[Any] = []
    _structure(spec, value, "", out, root)
    return out


def _structure(spec: Any, value: Any, path: str, out: list[Any], root: str) -> None:
    where = path or root
    if isinstance(spec, Mapping):
        if not isinstance(value, Mapping):
            raise BadInputError(f"{where}: expected a dict with keys {sorted(spec)}, got {type(value).__name__}")
        missing = [k for k in spec if k not in value]
        extra = [k for k in value if k not in spec]
        if missing or extra:
            parts = []
            if missing:
                parts.append("missing " + ", ".join(repr(join_path(path, k)) for k in sorted(missing)))
            if extra:
                parts.append("unexpected " + ", ".join(repr(join_path(path, str(k))) for k in extra))
            raise BadInputError(f"{where}: {'; '.join(parts)} (expected keys {sorted(spec)})")
        for key in sorted(spec):
            _structure(spec[key], value[key], join_path(path, key), out, root)
    elif is_namedtuple(spec):
        if isinstance(value, Mapping):
            value = tuple(_pick(value, spec._fields, where))
        if not isinstance(value, (tuple, list)) or len(value) != len(spec):
            raise BadInputError(
                f"{where}: expected {type(spec).__name__} with fields {spec._fields}, got {type(value).__name__}"
            )
        for field, s, v in zip(spec._fields, spec, value):
            _structure(s, v, join_path(path, field), out, root)
    elif isinstance(spec, (tuple, list)):
        if not isinstance(value, (tuple, list)) or is_namedtuple(value) or len(value) != len(spec):
            got = f"{type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) else type(value).__name__
            raise BadInputError(f"{where}: expected a {type(spec).__name__} of {len(spec)} items, got {got}")
        for i, (s, v) in enumerate(zip(spec, value)):
            _structure(s, v, join_path(path, str(i)), out, root)
    else:
        out.append(value)


def _pick(value: Mapping, fields: tuple[str, ...], where: str) -> list[Any]:
    missing = [f for f in fields if f not in value]
    extra = [k for k in value if k not in fields]
    if missing or extra:
        raise BadInputError(f"{where}: expected fields {fields}, missing {missing}, unexpected {extra}")
    return [value[f] for f in fields]


def _dict_plan(spec: Any, num_envs: int) -> tuple | None:
    """For a nest of plain dicts down to array leaves, per key in flatten order (sorted):
    ``(key, dtype, step shape, None)`` for a leaf or ``(key, None, None, sub-plan)``."""
    if type(spec) is not dict or not spec:
        return None
    plan = []
    for key in sorted(spec):
        sub = spec[key]
        if isinstance(sub, ArraySpec):
            plan.append((key, sub.dtype, (num_envs, *sub.shape), None))
            continue
        inner = _dict_plan(sub, num_envs)
        if inner is None:
            return None
        plan.append((key, None, None, inner))
    return tuple(plan)


def _collect(plan: tuple, value: Any, out: list[np.ndarray]) -> bool:
    """Append ``value``'s leaves if every dict has exactly the plan's keys and every leaf
    is already an array of the leaf's dtype and step shape (what coerce passes as is)."""
    if type(value) is not dict or len(value) != len(plan):
        return False
    ndarray = np.ndarray
    for key, dtype, shape, sub in plan:
        v = value.get(key)
        if sub is not None:
            if not _collect(sub, v, out):
                return False
        elif type(v) is not ndarray or v.shape != shape or (v.dtype is not dtype and v.dtype != dtype):
            return False
        else:
            out.append(v)
    return True


class StepValidator:
    """Validates and converts values for one spec and ``num_envs``."""

    def __init__(self, spec: Any, num_envs: int):
        self.spec = spec
        self.num_envs = num_envs
        self.paths = leaf_paths(spec)
        self.leaves: list[ArraySpec] = flatten(spec)
        self.dtypes = [s.dtype for s in self.leaves]
        self.step_shapes = [(num_envs, *s.shape) for s in self.leaves]
        flat = isinstance(spec, dict) and all(isinstance(v, ArraySpec) for v in spec.values())
        self.flat_keys = tuple(self.paths) if flat else None
        # per leaf, the dtypes already found castable to it: judged once, then passed as
        # they are (None), or once a dot product shows no value past the leaf's range
        # (float64 rewards for a float32 leaf: the sum of squares they must stay below)
        self._castable: list[dict[np.dtype, float | None]] = [{d: None} for d in self.dtypes]
        # (key, dtype, shape, castable) per leaf of a flat dict spec: the per-step fast path
        self._nfast = len(self.paths)
        self._fast = tuple(zip(self.paths, self.dtypes, self.step_shapes, self._castable)) if flat else None
        # the same for a nest of dicts: (key, dtype, shape, sub-plan or None) per key
        self._fast_nest = None if flat else _dict_plan(spec, num_envs)
        self._step_what = f"[num_envs={num_envs}, *shape] ="

    def leaf_values(self, value: Any) -> list[Any]:
        """The values of ``value``'s leaves in flatten order (a structure mismatch named)."""
        keys = self.flat_keys
        if keys is not None and type(value) is dict and len(value) == len(keys):
            try:
                return [value[k] for k in keys]
            except KeyError:
                pass
        return flatten_value(self.spec, value)

    def coerce(self, i: int, v: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
        dtype = self.dtypes[i]
        if type(v) is np.ndarray and v.dtype == dtype and v.shape == shape:
            return v
        path = self.paths[i]
        if v is None:
            raise BadInputError(f"leaf {path!r}: expected {what} {shape} {dtype}, got None")
        try:
            a = np.asarray(v)
        except Exception as exc:
            raise BadInputError(f"leaf {path!r}: cannot read {type(v).__name__} as an array: {exc}") from None
        if a.dtype.kind not in "biufc":
            raise BadInputError(
                f"leaf {path!r}: expected {what} {shape} {dtype}, got {a.dtype} values "
                f"({type(v).__name__})"
            )
        if a.shape != shape:
            hint = ""
            if a.shape == shape[1:]:
                hint = " (the leading axis is missing)"
            raise BadInputError(f"leaf {path!r}: expected {what} {shape}, got shape {a.shape}{hint}")
        why = cast_refusal(a, dtype)
        if why is not None:
            raise BadInputError(f"leaf {path!r}: {why} (expected {dtype}, got {a.dtype})")
        if a.dtype not in self._castable[i]:
            if cast_needs_no_values(a.dtype, dtype):
                self._castable[i][a.dtype] = None
            elif (limit := _squares_limit(a.dtype, dtype)) is not None:
                self._castable[i][a.dtype] = limit
        return a

    def step(self, value: Any) -> list[np.ndarray]:
        """Leaves of one step, each ``[num_envs, *shape]``."""
        fast = self._fast
        if fast is not None and type(value) is dict and len(value) == self._nfast:
            # Arrays already of the right dtype and shape pass as they are, as in coerce.
            out = []
            ndarray = np.ndarray
            for key, dtype, shape, castable in fast:
                v = value.get(key)
                if type(v) is not ndarray or v.shape != shape:
                    break
                if v.dtype is not dtype:
                    limit = castable.get(v.dtype, False)  # False: not judged yet
                    if limit is not None:
                        if limit is False:
                            break
                        flat = v if v.ndim == 1 else v.ravel()  # one BLAS call, no temporary
                        if not flat.dot(flat) <= limit:  # (NaN fails it too)
                            break  # coerce judges it (and names the value past the range)
                out.append(v)
            else:
                return out
        elif self._fast_nest is not None:
            out = []
            if _collect(self._fast_nest, value, out):
                return out
        return self.step_leaves(self.leaf_values(value))

    def step_leaves(self, vals: list[Any]) -> list[np.ndarray]:
        """One step's leaf values (in leaf order) checked as :meth:`step` checks them."""
        what = self._step_what
        return [self.coerce(i, v, self.step_shapes[i], what) for i, v in enumerate(vals)]

    def batch(self, value: Any, lead: tuple[int, ...] | None = None) -> tuple[int, list[np.ndarray]]:
        """Leaves of ``T`` steps, each ``[T, num_envs, *shape]``; T from the first leaf
        unless ``lead`` fixes the leading axes."""
        vals = self.leaf_values(value)
        if lead is None:
            first = vals[0]
            n = getattr(first, "shape", None)
            if n is None:
                first = np.asarray(first)
                n = first.shape
            if len(n) < 1:
                raise BadInputError(f"leaf {self.paths[0]!r}: expected [T, num_envs, *shape], got a scalar")
            lead = (int(n[0]),)
        out = [
            self.coerce(i, v, (*lead, *self.step_shapes[i]), "[T, num_envs, *shape] =")
            for i, v in enumerate(vals)
        ]
        return int(np.prod(lead)), out
