"""Data specs: the nest of array leaves a buffer stores, with no I/O.

A spec is a nest of ``dict`` / ``tuple`` / ``list`` / namedtuple whose leaves are
:class:`ArraySpec`. It is flattened in a fixed order, the one ``tf.nest`` uses: dict keys
sorted, sequences in order. Each leaf has a path, the nest keys joined with ``/``
(tuple items by their index), e.g. ``observation/pixels`` or ``policy_info/0``.

Anything spec-like converts with :func:`to_spec` without importing its framework:
objects with ``.shape`` and ``.dtype`` (TF-Agents ``ArraySpec`` / ``BoundedArraySpec`` /
``TensorSpec``, gymnasium ``Box`` / ``Discrete`` / ``MultiDiscrete`` / ``MultiBinary``,
numpy arrays and torch tensors as example values), gymnasium ``Dict`` / ``Tuple`` spaces,
and Python scalars.
"""

from __future__ import annotations

import collections
import keyword
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import BadInputError, SpecError

__all__ = [
    "ArraySpec",
    "SUPPORTED_DTYPES",
    "to_spec",
    "flatten",
    "leaf_paths",
    "unflatten",
    "map_structure",
    "spec_to_json",
    "spec_from_json",
    "validate_leaf_path",
    "is_namedtuple",
    "frame_layout",
    "Layout",
    "is_image",
]

#: dtypes a leaf may have; stored little-endian on disk.
SUPPORTED_DTYPES = tuple(
    np.dtype(t)
    for t in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)
_SUPPORTED = {d.name: d for d in SUPPORTED_DTYPES}
_KNOWN = {d: d for d in SUPPORTED_DTYPES}

MAX_NDIM = 32
MAX_LEAF_PATH_PARTS = 32
_FORBIDDEN_PATH_CHARS = ("/", "\\", "\x00")


def _as_dtype(dtype: Any, where: str) -> np.dtype:
    """A numpy dtype from numpy / TF / torch / string dtypes, refusing the unstorable."""
    known = _SUPPORTED.get(dtype) if type(dtype) is str else _KNOWN.get(dtype) if isinstance(dtype, np.dtype) else None
    if known is not None:  # a name from JSON, or a dtype already checked: one lookup
        return known
    if hasattr(dtype, "as_numpy_dtype"):  # tf.DType
        dtype = dtype.as_numpy_dtype
    elif type(dtype).__module__ == "torch":  # torch.dtype prints as "torch.float32"
        dtype = str(dtype).rsplit(".", 1)[-1]
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise SpecError(f"{where}: dtype {dtype!r} is not a numpy dtype") from exc
    if dt.name not in _SUPPORTED:
        raise SpecError(
            f"{where}: dtype {dt} cannot be stored; expected one of "
            + ", ".join(_SUPPORTED)
        )
    return _SUPPORTED[dt.name]


def _as_shape(shape: Any, where: str) -> tuple[int, ...]:
    if shape is None:
        raise SpecError(f"{where}: shape is unknown (None); a stored leaf needs a fixed shape")
    try:
        dims = tuple(shape)
    except TypeError:
        dims = (shape,)
    out = []
    for d in dims:
        if d is None or not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d < 0:
            raise SpecError(f"{where}: shape {tuple(dims)!r} must be non-negative ints")
        out.append(int(d))
    if len(out) > MAX_NDIM:
        raise SpecError(f"{where}: shape {tuple(out)} has more than {MAX_NDIM} dimensions")
    return tuple(out)


@dataclass(frozen=True)
class ArraySpec:
    """The shape and dtype of one stored leaf (per env, per step).

    Example:
        >>> ArraySpec((84, 84, 4), "uint8")
        ArraySpec(shape=(84, 84, 4), dtype=uint8)
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    name: str | None = None

    def __init__(self, shape: Any, dtype: Any = "float32", name: str | None = None):
        object.__setattr__(self, "shape", _as_shape(shape, "ArraySpec"))
        object.__setattr__(self, "dtype", _as_dtype(dtype, "ArraySpec"))
        object.__setattr__(self, "name", None if name is None else str(name))

    @property
    def nbytes(self) -> int:
        """Bytes of one item (one env, one step)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def __repr__(self) -> str:
        name = "" if self.name is None else f", name={self.name!r}"
        return f"ArraySpec(shape={self.shape}, dtype={self.dtype}{name})"


def frame_layout(shape: tuple[int, ...]) -> str | None:
    """The axes a picture, or a stack of pictures, of this shape most likely has in RL
    code, as letters (``H`` height, ``W`` width, ``C`` channels, ``K`` frames of a stack,
    ``(KC)`` stacked RGB frames on one axis); None for a shape that is no picture.

    ``HW`` (84, 84); ``HWC`` (84, 84, 3); ``CHW`` (3, 84, 84); ``KHW`` (4, 84, 84);
    ``HWK`` (84, 84, 4); ``HW(KC)`` (84, 84, 12); ``KHWC`` (4, 84, 84, 3); ``KCHW``
    (4, 3, 84, 84); height and width at least 8.
    """
    big = [n >= 8 for n in shape]
    if len(shape) == 2 and all(big):
        return "HW"
    if len(shape) == 3:
        a, b, c = shape
        if big[0] and big[1] and c <= 16:
            return "HWC" if c in (1, 3) else ("HW(KC)" if c % 3 == 0 else "HWK")
        if big[1] and big[2] and a <= 16:
            return "CHW" if a in (1, 3) else ("(KC)HW" if a % 3 == 0 else "KHW")
    if len(shape) == 4:
        if big[1] and big[2] and shape[3] in (1, 3, 4):
            return "KHWC"
        if big[2] and big[3] and shape[1] in (1, 3, 4):
            return "KCHW"
    return None


_AXIS = re.compile(r"\(([HWCK]+)\)|([HWCK])")


@dataclass(frozen=True)
class Layout:
    """How a frame's axes are laid out, as letters: ``H`` height, ``W`` width, ``C``
    channels (1 gray, 3 RGB, 4 RGBA), ``K`` a frame stack; ``(KC)`` is a stack of RGB
    frames concatenated along one axis (k*3 channels, oldest first).

    Recognised from the shape by :func:`frame_layout` (``KHW`` (4, 84, 84)
    is the Atari stack). A stack's newest frame is its last.
    """

    axes: tuple[str, ...]

    @classmethod
    def parse(cls, text: str, shape: tuple[int, ...], leaf: str = "") -> Layout:
        spec = text.upper().replace(" ", "")
        parts = [m.group(1) or m.group(2) for m in _AXIS.finditer(spec)]
        where = f"leaf {leaf!r}: " if leaf else ""
        if "".join(m.group(0) for m in _AXIS.finditer(spec)) != spec or not parts:
            raise BadInputError(
                f"{where}layout {text!r}: expected letters H, W, C, K, e.g. 'HWC', 'CHW', 'KHW', 'HW(KC)'"
            )
        letters = "".join(parts)  # only H, W, C and K: the pattern matched the whole text
        if len(set(letters)) != len(letters) or not {"H", "W"} <= set(letters):
            raise BadInputError(f"{where}layout {text!r}: needs H and W once each, and C, K at most once")
        if any(len(p) > 1 and sorted(p) != ["C", "K"] for p in parts):
            raise BadInputError(f"{where}layout {text!r}: only K and C can share an axis, as '(KC)'")
        if len(parts) != len(shape):
            raise BadInputError(
                f"{where}layout {text!r} has {len(parts)} axes, the leaf's shape {shape} has {len(shape)}"
            )
        layout = cls(tuple(parts))
        channels = layout.channels(shape)
        if channels not in (1, 3, 4):
            raise BadInputError(
                f"{where}layout {layout}: {channels} channels; expected 1 (gray), 3 (RGB) or 4 (RGBA)"
            )
        return layout

    @classmethod
    def infer(cls, shape: tuple[int, ...], leaf: str = "") -> Layout:
        """The layout a shape most likely has in RL code (:func:`frame_layout`)."""
        guess = frame_layout(shape)
        if guess is None:
            raise BadInputError(
                f"leaf {leaf!r}: shape {shape} is not a frame layout mmreplay recognises "
                "(HW, HWC, CHW, KHW, HWK, KHWC, KCHW with H, W >= 8); name it with layout=/--layout"
            )
        return cls.parse(guess, shape, leaf)

    def channels(self, shape: tuple[int, ...]) -> int:
        for part, n in zip(self.axes, shape):
            if part == "C":
                return n
            if len(part) == 2:
                if n % 3:
                    raise BadInputError(
                        f"layout {self}: a ({part}) axis of {n} is no whole number of RGB frames"
                    )
                return 3
        return 1

    def __str__(self) -> str:
        return "".join(p if len(p) == 1 else f"({p})" for p in self.axes)

    def _split(self, shape: tuple[int, ...]) -> tuple[list[int], list[str]]:
        """The shape with a ``(KC)`` axis split in two, and each axis' letter (``T`` first)."""
        sizes: list[int] = [shape[0]]
        names: list[str] = ["T"]
        for part, n in zip(self.axes, shape[1:]):
            if len(part) == 2:
                split = {"K": n // 3, "C": 3}
                sizes += [split[p] for p in part]
                names += list(part)
            else:
                sizes.append(n)
                names.append(part)
        return sizes, names + [letter for letter in "KC" if letter not in names]

    def normalise(self, x: np.ndarray) -> np.ndarray:
        """``[T, *shape]`` to ``[T, K, H, W, C]`` (K = 1 without a stack)."""
        sizes, names = self._split(x.shape)
        x = x.reshape(sizes + [1] * (len(names) - len(sizes)))
        return x.transpose([names.index(a) for a in "TKHWC"])

    def denormalise(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``[T, K, H, W, C]`` back to ``[T, *shape]``: the inverse of :meth:`normalise`."""
        _, names = self._split((len(x), *shape))
        order = np.argsort([names.index(a) for a in "TKHWC"])
        return x.transpose(order).reshape(len(x), *shape)


def is_image(spec: ArraySpec) -> bool:
    """Whether a leaf holds pictures (:func:`frame_layout` knows its shape): the leaves
    whose rows are large and compress well, which ``mmreplay view`` draws and which the
    command line compresses by default."""
    return frame_layout(spec.shape) is not None


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _is_space_container(x: Any) -> bool:
    """gymnasium ``Dict`` / ``Tuple`` spaces, recognised without importing gymnasium
    (``OneOf`` has ``spaces`` too, but its samples are ``(index, value)``)."""
    return hasattr(x, "spaces") and getattr(x, "shape", None) is None and not _is_unshaped_space(x)


def _is_unshaped_space(x: Any) -> bool:
    """A gymnasium space whose samples have no fixed shape (``OneOf``, ``Text``, ``Sequence``, ``Graph``)."""
    return hasattr(x, "sample") and hasattr(x, "contains") and getattr(x, "shape", None) is None and (
        not hasattr(x, "spaces") or any(c.__name__ == "OneOf" for c in type(x).__mro__)
    )


def to_spec(obj: Any, _path: str = "") -> Any:
    """Convert anything spec-like into a nest of :class:`ArraySpec`.

    Example:
        >>> to_spec({"obs": np.zeros(3, "float32"), "done": False})
        {'done': ArraySpec(shape=(), dtype=bool), 'obs': ArraySpec(shape=(3,), dtype=float32)}
    """
    where = _path or "spec"
    if isinstance(obj, ArraySpec):
        return obj
    if isinstance(obj, Mapping):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise SpecError(f"{where}: dict keys must be strings, got {bad[0]!r}")
        out = {}
        for key in sorted(obj):
            _check_key(key, where)
            out[key] = to_spec(obj[key], join_path(_path, key))
        return out
    if is_namedtuple(obj):
        return type(obj)(*(to_spec(v, join_path(_path, f)) for f, v in zip(obj._fields, obj)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_spec(v, join_path(_path, str(i))) for i, v in enumerate(obj))
    if _is_space_container(obj):
        return to_spec(obj.spaces, _path)
    if _is_unshaped_space(obj):
        raise SpecError(
            f"{where}: a gymnasium {type(obj).__name__} space has no fixed shape; expected Box, Discrete, "
            "MultiDiscrete, MultiBinary, or a Dict / Tuple of them"
        )
    if isinstance(obj, (bool, np.bool_)):
        return ArraySpec((), "bool")
    if isinstance(obj, (int, float, complex, np.generic)):
        return ArraySpec((), np.asarray(obj).dtype)
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        name = getattr(obj, "name", None)
        return ArraySpec(
            _as_shape(obj.shape, where),
            _as_dtype(obj.dtype, where),
            name if isinstance(name, str) else None,
        )
    raise SpecError(
        f"{where}: expected an array spec, a gymnasium space, an array or a nest of them, "
        f"got {type(obj).__name__}: {obj!r:.80}"
    )


def _bad_name(name: str) -> bool:
    """Whether ``name`` cannot be one name of a leaf path (it could leave the folder)."""
    return name in ("", ".", "..") or any(c in name for c in _FORBIDDEN_PATH_CHARS)


def _check_key(key: str, where: str) -> None:
    if _bad_name(key):
        raise SpecError(f"{where}: key {key!r} cannot name a leaf (no empty, '.', '..', '/', '\\\\' or NUL)")


def join_path(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


def validate_leaf_path(path: str) -> str:
    """Refuse leaf paths that could point outside the buffer's folder."""
    if not isinstance(path, str) or not path:
        raise SpecError(f"leaf path must be a non-empty string, got {path!r}")
    parts = path.split("/")
    if len(parts) > MAX_LEAF_PATH_PARTS:
        raise SpecError(f"leaf path {path!r} is nested deeper than {MAX_LEAF_PATH_PARTS}")
    if any(map(_bad_name, parts)):
        raise SpecError(f"leaf path {path!r}: expected '/'-joined names, none empty, '.' or '..'")
    return path


def _items(nest: Any) -> Iterator[tuple[str, Any]]:
    """Children of a nest node with their path keys, in flatten order."""
    if isinstance(nest, Mapping):
        for key in sorted(nest):
            yield key, nest[key]
    elif is_namedtuple(nest):
        yield from zip(nest._fields, nest)
    else:
        for i, v in enumerate(nest):
            yield str(i), v


def _is_node(x: Any) -> bool:
    return isinstance(x, (Mapping, tuple, list))


def flatten(nest: Any) -> list[Any]:
    """Leaves of a nest in the documented order (dict keys sorted)."""
    if not _is_node(nest):
        return [nest]
    out: list[Any] = []
    for _, child in _items(nest):
        out.extend(flatten(child))
    return out


#: the path of the one leaf of a spec that is a bare leaf rather than a nest
BARE_LEAF_PATH = "value"


def leaf_paths(nest: Any, _prefix: str = "") -> list[str]:
    """``/``-joined paths of the leaves, in :func:`flatten` order.

    A spec that is a single leaf has one leaf, named :data:`BARE_LEAF_PATH`.
    """
    if not _is_node(nest):
        return [_prefix or BARE_LEAF_PATH]
    out: list[str] = []
    for key, child in _items(nest):
        out.extend(leaf_paths(child, join_path(_prefix, key)))
    return out


def unflatten(structure: Any, leaves: Sequence[Any]) -> Any:
    """Pack ``leaves`` (in flatten order) into the nest shape of ``structure``."""
    it = iter(leaves)
    out = _pack(structure, it)
    if next(it, _END) is not _END:
        raise ValueError("more leaves than the structure has")
    return out


_END = object()


def _pack(structure: Any, it: Iterator[Any]) -> Any:
    if isinstance(structure, Mapping):
        return {k: _pack(structure[k], it) for k in sorted(structure)}
    if is_namedtuple(structure):
        return type(structure)(*(_pack(v, it) for v in structure))
    if isinstance(structure, (tuple, list)):
        return type(structure)(_pack(v, it) for v in structure)
    return next(it)


def map_structure(fn: Callable[[Any], Any], nest: Any) -> Any:
    return unflatten(nest, [fn(x) for x in flatten(nest)])


# --- JSON ---------------------------------------------------------------------------


def spec_to_json(nest: Any) -> Any:
    """A JSON-able description of a spec nest (namedtuples keep their type and fields)."""
    if isinstance(nest, ArraySpec):
        out: dict[str, Any] = {"shape": list(nest.shape), "dtype": nest.dtype.name}
        if nest.name is not None:
            out["name"] = nest.name
        return out
    if isinstance(nest, Mapping):
        return {"dict": {k: spec_to_json(v) for k, v in sorted(nest.items())}}
    if is_namedtuple(nest):
        return {
            "namedtuple": type(nest).__name__,
            "fields": {f: spec_to_json(v) for f, v in zip(nest._fields, nest)},
        }
    if isinstance(nest, (tuple, list)):
        return {type(nest).__name__: [spec_to_json(v) for v in nest]}
    raise SpecError(f"not a spec nest: {nest!r:.80}")


_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


def _namedtuple(name: str, fields: tuple[str, ...]) -> type:
    """A namedtuple class rebuilt from its name and fields, never imported from the file."""
    for ident in (name, *fields):
        if not ident.isidentifier() or keyword.iskeyword(ident) or ident.startswith("_"):
            raise SpecError(f"namedtuple name or field {ident!r} is not a valid identifier")
    key = (name, fields)
    if key not in _NAMEDTUPLES:
        cls = collections.namedtuple(name, fields)  # type: ignore[misc]
        # no module holds the class, so a value pickles as its name, fields and items (a
        # DataLoader worker's batch goes back to the main process that way)
        cls.__reduce__ = lambda self: (_namedtuple_value, (name, fields, tuple(self)))  # type: ignore[method-assign]
        _NAMEDTUPLES[key] = cls
    return _NAMEDTUPLES[key]


def _namedtuple_value(name: str, fields: tuple[str, ...], values: tuple) -> Any:
    return _namedtuple(name, fields)(*values)


def spec_from_json(obj: Any, _path: str = "") -> Any:
    """Rebuild a spec from :func:`spec_to_json` output, validating untrusted input."""
    where = _path or "spec"
    if not isinstance(obj, dict) or not obj:
        raise SpecError(f"{where}: expected a JSON object describing a spec, got {obj!r:.80}")
    if "dtype" in obj:
        name = obj.get("name")
        if name is not None and not isinstance(name, str):
            raise SpecError(f"{where}: name must be a string, got {name!r:.80}")
        if not isinstance(obj.get("shape"), list) or not isinstance(obj["dtype"], str):
            raise SpecError(f"{where}: expected shape list and dtype string, got {obj!r:.80}")
        return ArraySpec(_as_shape(obj["shape"], where), _as_dtype(obj["dtype"], where), name)
    if len(obj) == 1 and isinstance(obj.get("dict"), dict):
        out = {}
        for key, value in obj["dict"].items():
            _check_key(key, where)
            out[key] = spec_from_json(value, join_path(_path, key))
        return out
    if len(obj) == 1 and isinstance(obj.get("tuple", obj.get("list")), list):
        kind = "tuple" if "tuple" in obj else "list"
        items = [spec_from_json(v, join_path(_path, str(i))) for i, v in enumerate(obj[kind])]
        return tuple(items) if kind == "tuple" else items
    if isinstance(obj.get("namedtuple"), str) and isinstance(obj.get("fields"), dict):
        fields = obj["fields"]
        cls = _namedtuple(obj["namedtuple"], tuple(fields))
        return cls(*(spec_from_json(v, join_path(_path, f)) for f, v in fields.items()))
    raise SpecError(f"{where}: unrecognised spec description {obj!r:.80}")
