"""Backends, imported lazily by the name recorded in the metadata."""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from types import ModuleType

from ..errors import SpecError

_MODULES = {"zarr": "zarr_v3", "hdf5": "hdf5"}

ZARR_MISSING = (
    "the zarr backend needs zarr-python 3 (pip install 'mmreplay[zarr]'); "
    "environments pinned below it (TF-Agents 0.19 pins typing-extensions 4.5) can use backend='hdf5'"
)


def get(name: str) -> ModuleType:
    """The backend module for ``name`` ("zarr" or "hdf5")."""
    try:
        module = _MODULES[name]
    except KeyError:
        raise SpecError(f"unknown backend {name!r}; expected one of {', '.join(_MODULES)}") from None
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        if name != "zarr":
            raise
        raise ImportError(f"{ZARR_MISSING} ({exc})") from exc


def importable() -> list[str]:
    """The backend names whose libraries import here."""
    out = []
    for name in _MODULES:
        try:
            get(name)
        except ImportError:
            continue
        out.append(name)
    return out


def for_new_buffer(name: str | None) -> str:
    """The backend a new buffer gets: ``name`` when given (an ImportError naming the extra
    where its library does not import); by default ``"zarr"``, or ``"hdf5"`` (with a
    warning) where zarr-python 3 does not import. Both memory-map uncompressed leaves."""
    if name is not None:
        get(name)
        return name
    try:
        get("zarr")
    except ImportError as exc:
        warnings.warn(
            f"zarr-python 3 does not import here ({exc.__cause__}): the buffer is created with the "
            "hdf5 backend, memory-mapped the same way; pip install 'mmreplay[zarr]' for zarr",
            RuntimeWarning,
            stacklevel=outside_mmreplay(),
        )
        return "hdf5"
    return "zarr"


def outside_mmreplay() -> int:
    """The ``stacklevel`` that names the first caller outside the mmreplay package, so a
    warning points at the user's ``create`` call, whatever layer made it."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level
