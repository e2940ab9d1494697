"""What skrl's arguments mean in a store's terms: tensors, adds, indexes, devices, values, defaults."""

from __future__ import annotations

import importlib.metadata
import logging
import math
import re
from typing import Any

import numpy as np
import torch

from ..errors import SpecError
from ..spec import ArraySpec
from ..values import cast_refusal

log = logging.getLogger("mmreplay.compat.skrl")


def skrl_replacement_default() -> bool:
    """The default of skrl's ``RandomMemory(replacement=...)`` for the installed skrl:
    with replacement up to skrl 2.0, without since 2.1 (and with no skrl installed)."""
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("skrl"))
    except importlib.metadata.PackageNotFoundError:
        return False
    return found is not None and (int(found[1]), int(found[2])) < (2, 1)


def parse_device(device: str | torch.device | None) -> torch.device:
    """skrl's rule: ``None``, or a device torch cannot use here, is the default one
    (``cuda:0`` if available, else ``cpu``), the latter with a warning."""
    default = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device is None:
        return default
    try:
        parsed = torch.device(device)
        torch.zeros((1,), device=parsed)
    except Exception as exc:  # an unknown name, no CUDA, an index past the devices
        log.warning("Invalid device specification (%s): %s; using %s", device, exc, default)
        return default
    return parsed


def space_size(space: Any, keep_dimensions: bool) -> tuple[int, ...]:
    """The per-row shape of a size given as an int, a sequence or a gymnasium space."""
    if isinstance(space, (int, float, np.integer)) and not isinstance(space, bool):
        return (int(space),)
    if isinstance(space, (tuple, list)):
        dims = tuple(int(d) for d in space)
    elif type(space).__module__.startswith("gymnasium"):
        from gymnasium import spaces  # only when a space is given

        if isinstance(space, spaces.Discrete):
            dims = (1,)
        elif isinstance(space, spaces.Box):
            dims = tuple(space.shape)
        elif isinstance(space, spaces.MultiDiscrete):
            dims = tuple(space.nvec.shape)
        elif isinstance(space, (spaces.Dict, spaces.Tuple)):
            if keep_dimensions:
                raise ValueError(f"keep_dimensions=True cannot be used with {type(space).__name__} spaces")
            subs = space.spaces.values() if isinstance(space, spaces.Dict) else space.spaces
            dims = (sum(math.prod(space_size(s, False)) for s in subs),)
        else:
            dims = (spaces.flatdim(space),)
    else:
        raise ValueError(f"Space type {type(space)} not supported")
    return dims if keep_dimensions else (math.prod(dims),)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def tensor_spec(
    name: str, size: Any, dtype: torch.dtype | None, keep_dimensions: bool, existing: ArraySpec | None
) -> ArraySpec | None:
    """The leaf of ``create_tensor(name, size, dtype, keep_dimensions)``; None if the
    tensor exists alike (``existing``), ValueError if it exists otherwise."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"tensor name {name!r} cannot name a leaf (no empty, '.', '..', '/', '\\' or NUL)")
    shape = space_size(size, keep_dimensions)
    if any(d < 1 for d in shape):
        raise ValueError(f"tensor {name!r}: size {size!r} holds no elements")
    if existing is not None:
        if math.prod(existing.shape) != math.prod(shape) or (keep_dimensions and existing.shape != shape):
            raise ValueError(f"Size of tensor {name} ({shape}) doesn't match the existing one ({existing.shape})")
        if dtype is not None and torch_dtype(existing.dtype) != dtype:
            had = torch_dtype(existing.dtype)
            raise ValueError(f"Dtype of tensor {name} ({dtype}) doesn't match the existing one ({had})")
        return None
    wanted = torch.get_default_dtype() if dtype is None else dtype
    try:
        return ArraySpec(shape, torch.empty((), dtype=wanted).numpy().dtype)
    except TypeError as exc:
        raise SpecError(f"tensor {name!r}: dtype {wanted} has no numpy equivalent") from exc


def envs_added(shape: tuple[int, ...], ndim: int, num_envs: int, env_index: int) -> int:
    """How many envs an add of a tensor of ``shape`` (size of ``ndim`` dims) holds: a step
    of all envs, the next ``n`` envs or one; more than ``num_envs``: steps of one env."""
    lead, E, ei = len(shape) - ndim, num_envs, env_index
    n = shape[0] if lead == 1 else 1
    if lead not in (0, 1) or n > E > 1:
        raise ValueError(f"Expected shape (number of environments = {E}, data size), got {shape}")
    if lead == 1 and n == E and ei:
        raise RuntimeError(f"a step of all {E} envs was added while envs 0..{ei - 1} of a step are staged")
    if n <= E and ei + n > E:
        raise RuntimeError(f"{n} envs added at env index {ei} overflow num_envs={E}; nothing was added")
    return n


def flat_indexes(indexes: Any, rows: int) -> np.ndarray:
    """skrl's flat physical indexes (negative ones count from the end) as int64 in ``[0, rows)``."""
    idx = np.asarray(indexes.detach().cpu() if isinstance(indexes, torch.Tensor) else indexes)
    if idx.size and (idx.dtype.kind not in "iu" or idx.min() < -rows or idx.max() >= rows):
        raise IndexError(f"indexes must be integers in [-{rows}, {rows}) for a memory of {rows} rows")
    return np.mod(idx.astype(np.int64), rows)


def file_format(fmt: str, refusal: str) -> str:
    """skrl's ``save`` / export formats (``"np"`` is npz)."""
    fmt = "npz" if fmt == "np" else fmt
    if fmt not in ("pt", "npz", "csv"):
        raise ValueError(f"{refusal}; expected one of pt, npz, csv")
    return fmt


def index_arg(name: str, value: Any, bound: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < bound:
        raise ValueError(f"{name} must be an int in [0, {bound}), got {value!r}")
    return int(value)


def as_values(name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``value`` as a numpy array of ``shape`` in tensor ``name``'s ``dtype``, or ValueError.

    Floats go into integer tensors truncated toward zero, as torch's ``copy_`` stores
    them (NaN, infinities and values out of range, platform-dependent there, are
    refused); only 0 / 1 numbers go into bool tensors."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        value = (value.float() if value.dtype == torch.bfloat16 else value).cpu().numpy()
    a = np.asarray(value)
    if a.dtype == dtype and a.shape == shape:
        return a
    if a.dtype.kind not in "biufc":
        raise ValueError(f"tensor {name!r}: expected numbers, got {a.dtype} values")
    if dtype == np.bool_ and a.dtype.kind in "iuf" and np.isin(a, (0, 1)).all():
        a = a.astype(bool)  # 0 / 1 flags (uint8 dones, float masks) into a bool tensor
    elif dtype.kind in "iu" and a.dtype.kind == "f":
        whole, info = np.trunc(a), np.iinfo(dtype)
        bad = ~np.isfinite(whole) | (whole < info.min) | (whole > info.max)
        if bad.any():
            raise ValueError(
                f"tensor {name!r}: {a[bad].flat[0]!r} cannot be stored in a {dtype} tensor "
                f"(integer tensors take finite values in [{info.min}, {info.max}], truncated)"
            )
        a = whole.astype(dtype)
    why = cast_refusal(a, dtype)
    if why is not None:
        raise ValueError(f"tensor {name!r}: {why} (tensor dtype {dtype}, got {a.dtype})")
    try:
        return np.broadcast_to(a, shape).astype(dtype, copy=False)
    except ValueError:
        raise ValueError(f"tensor {name!r}: expected shape {shape}, got {a.shape}") from None
