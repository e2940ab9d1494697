"""Gymnasium spaces as JSON, and specs from and to that JSON: the one converter.

The JSON is what ``minari.serialization.serialize_space`` writes (and Minari reads back
with ``deserialize_space``; no pickle is involved). A space object becomes a spec with
:func:`mmreplay.spec.to_spec`, which knows spaces without importing gymnasium; only
:func:`space_to_json` imports it, when handed a space.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import BadInputError, UnsupportedFormatError
from .spec import ArraySpec, is_namedtuple

__all__ = ["SPACES_ATTR", "space_to_json", "spec_from_space_json", "spec_to_space_json"]

#: the store attribute that keeps the spaces a store's transitions come from
#: (:func:`mmreplay.compat.gymnasium.record_spaces`), as JSON text
SPACES_ATTR = "gymnasium"


def space_to_json(space: Any) -> dict[str, Any]:
    """A space as the JSON object ``minari.serialization.serialize_space`` writes."""
    from gymnasium import spaces

    if isinstance(space, spaces.Box):
        return {
            "type": "Box",
            "dtype": str(space.dtype),
            "shape": list(space.shape),
            "low": space.low.tolist(),
            "high": space.high.tolist(),
        }
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "dtype": str(space.dtype), "start": int(space.start), "n": int(space.n)}
    if isinstance(space, spaces.MultiDiscrete):
        return {
            "type": "MultiDiscrete",
            "dtype": str(space.dtype),
            "nvec": space.nvec.tolist(),
            "start": space.start.tolist(),
        }
    if isinstance(space, spaces.MultiBinary):
        n = space.n
        shaped = isinstance(n, (tuple, list, np.ndarray))
        return {"type": "MultiBinary", "n": [int(k) for k in n] if shaped else int(n)}
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "subspaces": {k: space_to_json(v) for k, v in space.spaces.items()}}
    if isinstance(space, spaces.Tuple):
        return {"type": "Tuple", "subspaces": [space_to_json(v) for v in space.spaces]}
    raise TypeError(f"cannot describe {type(space).__name__} as JSON (Box, Discrete, MultiDiscrete, "
                    "MultiBinary, Dict and Tuple can)")


def _box(spec: ArraySpec) -> dict[str, Any]:
    dtype = spec.dtype
    if dtype.kind == "f":
        low, high = float("-inf"), float("inf")
    elif dtype.kind == "b":
        low, high = 0, 1
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = int(info.min), int(info.max)
    else:
        raise BadInputError(f"dtype {dtype} has no gymnasium space")
    # full arrays: gymnasium's Box refuses a 0-d low / high for a shaped space
    return {
        "type": "Box",
        "dtype": dtype.name,
        "shape": list(spec.shape),
        "low": np.full(spec.shape, low, dtype=object).tolist(),
        "high": np.full(spec.shape, high, dtype=object).tolist(),
    }


def spec_to_space_json(spec: Any) -> dict[str, Any]:
    """The space of a spec nest with no space recorded: each leaf the tightest Box its
    dtype allows (integers their dtype's range, booleans 0..1, floats unbounded)."""
    if isinstance(spec, ArraySpec):
        return _box(spec)
    if isinstance(spec, Mapping):
        return {"type": "Dict", "subspaces": {k: spec_to_space_json(v) for k, v in spec.items()}}
    if is_namedtuple(spec):
        return {"type": "Dict", "subspaces": {k: spec_to_space_json(v) for k, v in zip(spec._fields, spec)}}
    if isinstance(spec, (tuple, list)):
        return {"type": "Tuple", "subspaces": [spec_to_space_json(v) for v in spec]}
    raise BadInputError(f"cannot describe {spec!r:.80} as a gymnasium space")


def spec_from_space_json(space: Any, where: str) -> Any:
    """The ArraySpec nest of a space's JSON (or its text), for leaves its arrays fill."""
    if isinstance(space, str):
        space = json.loads(space)
    kind = space.get("type") if isinstance(space, dict) else None
    if kind == "Box":
        return ArraySpec(tuple(space["shape"]), space["dtype"])
    if kind == "Discrete":
        return ArraySpec((), space.get("dtype", "int64"))
    if kind == "MultiDiscrete":
        return ArraySpec(np.shape(space["nvec"]), space.get("dtype", "int64"))
    if kind == "MultiBinary":
        n = space["n"]
        return ArraySpec(tuple(n) if isinstance(n, list) else (n,), "int8")
    if kind == "Dict":
        return {k: spec_from_space_json(v, f"{where}/{k}") for k, v in space["subspaces"].items()}
    if kind == "Tuple":
        return tuple(spec_from_space_json(v, f"{where}/{i}") for i, v in enumerate(space["subspaces"]))
    raise UnsupportedFormatError(f"{where}: space type {kind!r} cannot be stored")
