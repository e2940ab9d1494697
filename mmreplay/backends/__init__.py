"""Backends, imported lazily by the name recorded in the metadata."""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
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


#: seconds the exit waits for zarr's event-loop thread to end
ZARR_LOOP_EXIT_SECONDS = 60.0


def _end_zarr_loop() -> None:
    """At exit, after the stores' exit hooks (which may still write through zarr): stop
    zarr's event loop and wait for its thread, then let zarr release the rest. zarr's own
    exit hook waits 0.2 s for that thread; on a busy machine it then closes the loop while
    the thread still runs it, and the exit prints "Cannot close a running event loop"."""
    sync = sys.modules.get("zarr.core.sync")
    if sync is None:
        return
    loop, thread = sync.loop[0], sync.iothread[0]
    if loop is not None and thread is not None and thread.is_alive() and not loop.is_closed():
        loop.call_soon_threadsafe(loop.stop)
        thread.join(ZARR_LOOP_EXIT_SECONDS)
    sync.cleanup_resources()


def _replace_zarr_exit_hook() -> None:
    """zarr's exit hook gives way to :func:`_end_zarr_loop`. Run as the threads end, before
    any ``atexit`` hook: zarr registers its own whenever it is first imported, which may
    be after this module (its hook would then run first)."""
    sync = sys.modules.get("zarr.core.sync")
    if sync is not None:
        atexit.unregister(sync.cleanup_resources)


atexit.register(_end_zarr_loop)  # before any store registers its exit hooks: runs after them
threading._register_atexit(_replace_zarr_exit_hook)  # type: ignore[attr-defined]
