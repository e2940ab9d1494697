"""Backends, imported lazily by the name recorded in the metadata."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import SpecError

_MODULES = {"zarr": "zarr_v3", "hdf5": "hdf5"}


def get(name: str) -> ModuleType:
    """The backend module for ``name`` ("zarr" or "hdf5")."""
    try:
        module = _MODULES[name]
    except KeyError:
        raise SpecError(f"unknown backend {name!r}; expected one of {', '.join(_MODULES)}") from None
    return importlib.import_module(f"{__name__}.{module}")
