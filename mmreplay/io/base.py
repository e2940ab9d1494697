"""The byte-source contract: the objects of one store, by key, wherever they are.

A key is a path inside the store with ``/`` between names (``mmreplay.json``,
``data.zarr/obs/c/0/0/0``). Everything a store reads goes through a :class:`ByteSource`:
whole objects with a size limit, and the ranged reads of a batch through :class:`Handle`s,
many at once (:meth:`ByteSource.read_ranges`). A local folder maps and writes its files
too; an object-store prefix is read-only to a store (``mmreplay.push`` publishes it).

The ranged reads are coroutines, so that an object store keeps every request of a batch
in flight together. A local folder never waits inside them: its reads run to the end in
place (:func:`run_now`), without an event loop.
"""

from __future__ import annotations

import mmap
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Hashable, Sequence
from typing import Any

import numpy as np

__all__ = ["SCHEME", "ByteSource", "Handle", "ObjectChanged", "Range", "coalesce", "run_now"]

SCHEME = "s3://"


class ObjectChanged(Exception):
    """A handle's object was replaced since the handle first read it (a push): what was
    read before may not match it. The reader forgets the handle and reads again."""

    def __init__(self, handle: Handle):
        super().__init__(handle.key)
        self.handle = handle


def run_now(coro: Coroutine[Any, Any, Any]) -> Any:
    """The result of a coroutine that never waits (a local folder's reads), run in place."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a local read waited for an event loop")


class Handle:
    """One object opened for ranged reads, of one version: a local file's descriptor
    holds its inode; an object's first ranged read pins its ETag, and a later one of a
    replaced object raises :class:`ObjectChanged`."""

    key: str
    #: the object's bytes and version (what changes when it is replaced), once known
    size: int | None = None
    version: Hashable | None = None
    #: it holds a file descriptor, of which a process has few
    scarce = False
    #: :meth:`map` maps it
    mappable = False

    def map(self) -> mmap.mmap | bytes:
        """The object memory-mapped read-only (``b""`` when empty)."""
        raise NotImplementedError(f"{self.key}: not a file to map")

    def read_at(self, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` bytes from ``offset``, as the object is now."""
        raise NotImplementedError

    def write_at(self, offset: int, data: bytes, sync: bool = False) -> None:
        """Write ``data`` at ``offset`` (``sync``: to the disk before returning)."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the handle holds."""


#: one ranged read: (handle, start, end); ``start < 0`` reads the last ``-start`` bytes
Range = tuple[Handle, int, int]


def coalesce(
    objects: np.ndarray, starts: np.ndarray, ends: np.ndarray, gap: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Byte spans, sorted by object then start (none overlapping another but its own
    copies), merged into the ranges one read each fetches: spans of an object fewer than
    ``gap`` bytes apart share one. (The first span of each range, the ranges' starts and
    ends, and each span's range.)"""
    new = np.ones(len(starts), bool)
    new[1:] = (objects[1:] != objects[:-1]) | (starts[1:] - ends[:-1] >= gap)
    firsts = np.flatnonzero(new)
    run_start = starts[firsts]
    run_end = np.maximum.reduceat(ends, firsts) if len(firsts) else run_start
    return firsts, run_start, run_end, np.cumsum(new) - 1


class ByteSource(ABC):
    """The objects of one store. ``local``: a folder on this machine, whose files are
    mapped and written in place (else an object-store prefix, read-only to a store)."""

    local: bool
    #: the folder's path or the prefix's URL, as messages name the store
    url: str
    #: ranges of one object fewer bytes apart than this are read as one, with the bytes between
    gap_bytes: int

    def where(self, key: str) -> str:
        """How a message names the object ``key``."""
        return f"{self.url}/{key}" if key else self.url

    @abstractmethod
    def child(self, folder: str) -> ByteSource:
        """The objects under ``folder`` (a store's subfolder)."""

    @abstractmethod
    def no_store(self) -> Exception:
        """The error that says no store is here (its metadata is missing)."""

    @abstractmethod
    def read(self, key: str, limit: int, what: str = "the object", start: int = 0, end: int | None = None) -> bytes:
        """The bytes ``[start, end)`` of ``key`` (``start < 0``: its last ``-start``
        bytes), refusing more than ``limit`` with a :class:`CorruptBufferError` before
        reading them (``what`` names the object). FileNotFoundError when there is none."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def replace(self, key: str, data: bytes | memoryview, exclusive: bool = False) -> None:
        """Write ``key`` whole, atomically: a reader finds the old object or the new one
        (``exclusive``: only where there is none yet)."""

    @abstractmethod
    def handle(self, key: str, writable: bool = False) -> Handle:
        """A handle of ``key`` (``writable``: a local file opened for writing too). A
        local file is opened now (FileNotFoundError when there is none); an object is
        found at its first read."""

    def map(self, key: str, writable: bool, need: int = 0, what: str = "data file") -> mmap.mmap | None:
        """The whole file ``key`` memory-mapped (None when it is empty), checked to hold
        at least ``need`` bytes (``what`` names it): a local folder's only."""
        raise NotImplementedError(f"{self.url}: objects here cannot be memory-mapped")

    @abstractmethod
    async def read_ranges(self, ranges: Sequence[Range], into: np.ndarray, advise: bool = False) -> list[int | None]:
        """Read every range into ``into``, one after the other, each in as many bytes as
        it asks for, together (an object store sends every request at once, and returns
        once each has ended). The bytes each range got; None for an object found missing.
        ``advise``: ask a local disk for every range before reading any."""

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine of this source's reads to its end."""
        return run_now(coro)
