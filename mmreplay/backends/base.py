"""The leaf-array contract shared by the backends.

A leaf is one ``[capacity, num_envs, *shape]`` array used as a ring of slots. The store
talks to leaves only through :class:`Leaf`; the backends decide how the bytes are laid
out and hand back either a :class:`MappedLeaf` (uncompressed, local: a numpy view of a
memory map, so reads and writes are plain numpy) or a :class:`ChunkedLeaf` (compressed:
whole chunks decoded and encoded through zarr / h5py, with writes staged in RAM).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, Protocol

import numpy as np

from ..codecs import LEVELS, Compression, parse
from ..errors import CorruptBufferError, DiskFullError, RemoteError, ShutdownError
from ..metadata import LeafInfo

__all__ = [
    "Leaf",
    "MappedLeaf",
    "ChunkedLeaf",
    "ChunkIO",
    "TakenLeaf",
    "Compression",
    "parse_compression",
    "preallocate",
]

#: decoded chunks a chunk-compressed leaf keeps by default (``Store.set_chunk_cache``)
CHUNK_CACHE_BYTES = 256 << 20

# Page advice, where the OS has it (Linux, macOS); without it reads are just not advised.
_MADV_RANDOM = getattr(mmap, "MADV_RANDOM", None)
_MADV_NORMAL = getattr(mmap, "MADV_NORMAL", None)
_MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)
_MADV_POPULATE_READ = 22  # Linux >= 5.14: fault a range into the page tables, reading it


@functools.cache
def _madvise_call() -> Any:
    """libc's ``madvise`` through ctypes (Linux), which drops the GIL while it runs, unlike
    ``mmap.madvise``; None where it cannot be loaded."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


#: what the store backends accept (the zarr and hdf5 backends refine it)
STORE_CODECS = {c: LEVELS[c] for c in ("zstd", "blosc", "gzip", "lzf")}


def parse_compression(text: str) -> Compression:
    return parse(text, STORE_CODECS, "store")


class Leaf(Protocol):
    """What the store needs of a leaf. Slots are step indices into the ring; rows are
    flat ids ``slot * num_envs + env``.

    Capability flags, which the store and the read path consult instead of the leaf's
    type:

    - ``mappable``: the bytes are a local memory map; ``array`` (``[capacity, num_envs,
      *shape]``) and ``flat`` (rows) are numpy views of it, written and read in place,
      and page-cache advice applies.
    - ``in_place``: a write changes the stored bytes where they are (a memory map, or an
      HDF5 chunk behind its journal), so a crash can tear what is being rewritten.
    - ``atomic_replace``: stored units (chunk files) are replaced whole by rename, so
      none is ever torn.
    - ``ranged_read``: one row is read without decoding anything else.
    """

    info: LeafInfo
    mappable: bool
    in_place: bool
    atomic_replace: bool
    ranged_read: bool

    def read(self, slots: Any) -> np.ndarray:
        """Rows at ``slots`` (an int, a slice or an index array), as a new array."""

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows by flat id (any index shape; ids past the ring's end wrap), as a new array."""

    def read_rows(self, slots: Any, envs: Any) -> np.ndarray:
        """Rows of the (slot, env) pairs, broadcast together, as a new array."""

    def advise(self, pattern: str, keep: tuple[int, int] | None = None) -> None:
        """Page-cache advice for the coming reads (``"random"`` or ``"normal"``); a no-op
        unless ``mappable``."""

    def willneed(self, rows: np.ndarray) -> None:
        """Ask for the pages of ``rows`` ahead of reading them; a no-op unless ``mappable``."""

    def write(self, start: int, values: np.ndarray) -> None:
        """Write ``values[i]`` to slot ``start + i`` (no wrap: the store splits)."""

    def write_slots(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Write ``values[i]`` to ``slots[i]`` (for ``set``)."""

    def flush(self, fsync: bool) -> None:
        """Make every write so far reach the file (and the disk with ``fsync``)."""

    def invalidate(self, slots: Iterable[tuple[int, int]]) -> None:
        """Forget cached copies of the slot ranges ``[a, b)`` (a reader's refresh)."""

    def close(self) -> None: ...


def preallocate(fd: int, length: int, where: str) -> None:
    """Reserve the file's blocks now, so a full disk is an error here, not a SIGBUS later.

    ``posix_fallocate`` where the OS and the file system have it (Linux); elsewhere
    (macOS) every block is written once, its bytes read and written back, which
    allocates the holes and keeps what the file holds.
    """
    if length <= 0:
        return
    try:
        try:
            os.posix_fallocate(fd, 0, length)
        except AttributeError:  # no posix_fallocate in this OS
            _write_every_block(fd, length)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # else: not on this file system
                raise
            _write_every_block(fd, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            free = os.fstatvfs(fd)
            raise DiskFullError(
                f"{where}: needs {length} bytes, the file system has "
                f"{free.f_bavail * free.f_frsize} free"
            ) from None
        if exc.errno == errno.EFBIG:
            raise DiskFullError(
                f"{where}: needs {length} bytes, more than the largest file this process may write "
                "(ulimit -f) or the file system allows"
            ) from None
        raise


_ALLOCATE_STEP = 1 << 20


def _write_every_block(fd: int, length: int) -> None:
    """Extend the file to ``length`` and write each of its blocks, so none stays a hole."""
    if os.fstat(fd).st_size < length:
        os.ftruncate(fd, length)
    for offset in range(0, length, _ALLOCATE_STEP):
        data = os.pread(fd, min(_ALLOCATE_STEP, length - offset), offset)
        if os.pwrite(fd, data, offset) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


#: errnos of a write refused for want of room: a full file system, a quota, a file
#: size limit (``ulimit -f``, or the file system's largest file)
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _no_room_errno(exc: BaseException) -> int | None:
    """The errno when an error from the OS, zarr or h5py (whose messages carry the
    errno) means there is no room for the write."""
    if isinstance(exc, OSError) and exc.errno in _NO_ROOM:
        return exc.errno
    text = str(exc)
    return next((e for e in _NO_ROOM if f"errno = {e}," in text), None)


def shutdown_error(exc: BaseException, where: str) -> ShutdownError | None:
    """The error to raise when ``exc`` is zarr refusing I/O because the program is ending
    (the interpreter stopped the thread pools it reads and writes with, after the main
    thread returned); None for any other error."""
    ending = getattr(threading, "_SHUTTING_DOWN", False) or not threading.main_thread().is_alive()
    if not (isinstance(exc, RuntimeError) and (ending or "after shutdown" in str(exc))):
        return None
    return ShutdownError(
        f"{where}: the program is ending (its main thread has returned) and zarr cannot read or write "
        "chunks any more; join the thread that writes, or close the store, before the main thread returns"
    )


@contextmanager
def disk_full_as(message: str) -> Iterator[None]:
    """Turn a full file system (however zarr, h5py or the OS report it) into a
    :class:`DiskFullError` with ``message``."""
    try:
        yield
    except Exception as exc:
        code = _no_room_errno(exc)
        if code is None:
            raise
        if code == errno.EFBIG:
            message += " (a file reached the size limit: ulimit -f, or the file system's largest file)"
        raise DiskFullError(message) from exc


def fsync_files(paths: Iterable[str]) -> None:
    """fsync each file that exists, then each of their folders (so renames into them last)."""
    folders = set()
    for path in paths:
        if os.path.exists(path):
            fsync_path(path)
        folders.add(os.path.dirname(path))
    for folder in folders:
        if os.path.isdir(folder):
            fsync_path(folder)


def fsync_path(path: str) -> None:
    """fsync one file or folder by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MappedLeaf:
    """A leaf whose bytes are one C-order block of a memory-mapped file."""

    in_place = True
    atomic_replace = False
    ranged_read = True

    def __init__(
        self, info: LeafInfo, capacity: int, num_envs: int, mm: mmap.mmap | None, syncs_map: bool = True
    ):
        self.info = info
        self.mm = mm
        self.mappable = mm is not None  # a leaf of zero bytes maps nothing
        # False where leaves share one file's mapping: one of them syncs it, once per commit
        self.syncs_map = syncs_map
        shape = (capacity, num_envs, *info.spec.shape)
        dtype = info.spec.dtype.newbyteorder("<")
        if mm is None:  # zero-byte leaf
            self.array = np.zeros(shape, dtype)
        else:
            # frombuffer holds an export of ``mm`` (np.ndarray(buffer=mm) does not): while an
            # array viewing the rows lives, ``mm.close()`` refuses rather than unmap them.
            count = int(np.prod(shape, dtype=np.int64))
            self.array = np.frombuffer(mm, dtype, count, info.offset or 0).reshape(shape)
        self.num_envs = num_envs
        # Rows in (slot, env) order: one ``take`` gathers any (step, env) pairs.
        self.flat = self.array.reshape(capacity * num_envs, *info.spec.shape)
        self.advice: str | None = None
        self.advice_keep: tuple[int, int] | None = None
        self.row_bytes = max(1, info.spec.nbytes)

    def read(self, slots: Any) -> np.ndarray:
        return self.array[slots]

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.flat.take(rows, axis=0, mode="wrap")

    def read_rows(self, slots: Any, envs: Any) -> np.ndarray:
        return self.flat.take(np.asarray(slots, np.int64) * self.num_envs + envs, axis=0)

    def advise(self, pattern: str, keep: tuple[int, int] | None = None) -> None:
        """Tell the kernel how the leaf is read next: ``"random"`` (no readahead: random
        rows from a buffer larger than RAM read only their own pages) or ``"normal"``
        (readahead, for sequences and passes). ``keep`` = ``(slot, count)`` leaves those
        slots (wrapping) on normal readahead: a writer's next slots, which it fills in
        order. Costs a few syscalls, only when the advice changes."""
        if (pattern, keep) == (self.advice, self.advice_keep) or self.mm is None or _MADV_NORMAL is None:
            return
        base = self.info.offset or 0
        option = _MADV_RANDOM if pattern == "random" and _MADV_RANDOM is not None else _MADV_NORMAL
        ranges = [(base, base + self.flat.nbytes, option)]
        if keep is not None and pattern == "random":
            capacity = len(self.flat) // self.num_envs
            slot_bytes = self.num_envs * self.row_bytes
            a, n = keep[0] % capacity, min(keep[1], capacity)
            for x, y in ((a, min(a + n, capacity)), (0, max(0, a + n - capacity))):
                if y > x:
                    ranges.append((base + x * slot_bytes, base + y * slot_bytes, _MADV_NORMAL))
        try:
            for lo, hi, opt in ranges:
                start = lo // mmap.PAGESIZE * mmap.PAGESIZE
                self.mm.madvise(opt, start, hi - start)
        except (OSError, ValueError):
            return  # advice only; a closed or unusual mapping reads correctly without it
        self.advice, self.advice_keep = pattern, keep

    def willneed(self, rows: np.ndarray) -> None:
        """Start reading the pages of these rows from disk, without waiting (MADV_WILLNEED)."""
        mm = self.mm
        if mm is None or self.flat is None or _MADV_WILLNEED is None:
            return
        base = self.info.offset or 0
        lo = np.unique(np.asarray(rows, np.int64).reshape(-1) % len(self.flat)) * self.row_bytes + base
        page = mmap.PAGESIZE
        first = lo // page
        last = (lo + self.row_bytes - 1) // page
        # Merge rows whose pages touch into one call per run of pages.
        brk = np.flatnonzero(first[1:] > last[:-1] + 1) + 1
        starts = first[np.r_[0, brk]] if len(first) else first
        stops = last[np.r_[brk - 1, len(last) - 1]] + 1 if len(last) else last
        advise = mm.madvise
        willneed = _MADV_WILLNEED
        try:
            for a, b in zip((starts * page).tolist(), ((stops - starts) * page).tolist()):
                advise(willneed, a, b)
        except (OSError, ValueError):
            pass  # the mapping was closed meanwhile: nothing left to prefetch

    def populate(self, a: int, b: int) -> str | None:
        """Read slots ``[a, b)`` into memory and into the mapping's page tables now, so
        the first batches do not fault page by page: ``MADV_WILLNEED`` (start reading
        them), then ``MADV_POPULATE_READ`` (wait and map them; Linux >= 5.14). Returns the
        advice that took effect last (``"populate_read"`` or ``"willneed"``), None if
        none could be given. Runs without the GIL where libc is at hand."""
        array, mm = self.array, self.mm
        if mm is None or array is None or b <= a:
            return None
        base = self.info.offset or 0
        lo, hi = base + a * array.strides[0], base + b * array.strides[0]
        start = lo // mmap.PAGESIZE * mmap.PAGESIZE
        madvise = _madvise_call()
        if madvise is None:
            if _MADV_WILLNEED is None:
                return None
            try:
                mm.madvise(_MADV_WILLNEED, start, hi - start)
            except (OSError, ValueError):
                return None
            return "willneed"
        address = array.ctypes.data - base + start  # the mapping's first byte + start
        if madvise(address, hi - start, _MADV_WILLNEED) != 0:
            return None
        if madvise(address, hi - start, _MADV_POPULATE_READ) != 0:
            return "willneed"  # EINVAL: a kernel before 5.14, where only the read-ahead helps
        return "populate_read"

    def write(self, start: int, values: np.ndarray) -> None:
        self.array[start : start + len(values)] = values

    def write_slots(self, slots: np.ndarray, values: np.ndarray) -> None:
        self.array[slots] = values

    def flush(self, fsync: bool) -> None:
        if fsync and self.syncs_map and self.mm is not None:
            self.mm.flush()

    def invalidate(self, slots: Iterable[tuple[int, int]]) -> None:
        pass  # a shared mapping is never stale

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        self.flat = None  # type: ignore[assignment]
        if self.mm is not None:
            with suppress(BufferError):  # a caller still holds a view; the mapping closes with it
                self.mm.close()
            self.mm = None


class TakenLeaf:
    """``read``, ``read_rows`` and the page-cache calls of a leaf read only through
    ``take`` (chunks or frames decoded, rows fetched by range): there is no mapping of
    rows to advise."""

    capacity: int
    num_envs: int

    def take(self, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def read(self, slots: Any) -> np.ndarray:
        if isinstance(slots, slice):
            slots = np.arange(self.capacity)[slots]
        idx = np.asarray(slots, np.int64)
        return self.take((idx % self.capacity)[..., None] * self.num_envs + np.arange(self.num_envs))

    def read_rows(self, slots: Any, envs: Any) -> np.ndarray:
        return self.take(np.asarray(slots, np.int64) * self.num_envs + envs)

    def advise(self, pattern: str, keep: tuple[int, int] | None = None) -> None:
        """No mapping: nothing to advise."""

    def willneed(self, rows: np.ndarray) -> None:
        """Rows are read on demand: nothing to prefetch."""


class ChunkIO(Protocol):
    """Whole-chunk storage of one compressed leaf (zarr chunk files, HDF5 chunks).
    ``in_place``: a chunk is rewritten where it is stored (else replaced whole by rename)."""

    in_place: bool
    shape: tuple[int, ...]

    def read(self, k: int, a: int, b: int) -> np.ndarray:
        """Chunk ``k`` (slots ``a..b-1``) decoded."""

    def write(self, k: int, a: int, b: int, chunk: np.ndarray) -> None:
        """Store chunk ``k``: the write head has left it."""

    def flush(self, fsync: bool, staged: dict[int, np.ndarray]) -> None:
        """Store the chunks the head is still in and make every chunk stored so far
        reach the file (and the disk with ``fsync``)."""

    def exists(self, k: int) -> bool:
        """Whether chunk ``k`` was ever stored (a committed chunk that is not is damage)."""

    def file(self, k: int) -> str:
        """The file or object that holds chunk ``k``, as a message names it."""

    def refresh(self) -> None:
        """See the writer's latest chunks (a reader)."""

    def close(self) -> None: ...


class ChunkedLeaf(TakenLeaf):
    """A compressed leaf, read and written as whole chunks along the step axis.

    Writes go to decoded chunks staged in RAM; a chunk is encoded once, when the write
    head leaves it or at flush. Reads keep an LRU of decoded chunks.
    """

    mappable = False
    ranged_read = False

    def __init__(self, info: LeafInfo, capacity: int, io: ChunkIO):
        self.info = info
        self.in_place = io.in_place
        self.atomic_replace = not io.in_place
        self.capacity = capacity
        self.cs = info.chunk_steps
        self.nchunks = -(-capacity // self.cs)
        self.io = io
        self.shape = tuple(io.shape)
        self.num_envs = self.shape[1]
        self.staged: dict[int, np.ndarray] = {}
        self.cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self.set_cache_bytes(CHUNK_CACHE_BYTES)  # until Store.set_chunk_cache says otherwise

    def set_cache_bytes(self, nbytes: int) -> None:
        """Keep about ``nbytes`` of decoded chunks (at least two; 0: none), oldest out first."""
        chunk_bytes = self.cs * max(1, int(np.prod(self.shape[1:]))) * self.info.spec.dtype.itemsize
        self.cache_chunks = max(2, int(nbytes) // max(1, chunk_bytes)) if nbytes > 0 else 0
        while len(self.cache) > self.cache_chunks:
            self.cache.popitem(last=False)

    def _keep(self, k: int, chunk: np.ndarray) -> None:
        if self.cache_chunks:
            self.cache[k] = chunk
            if len(self.cache) > self.cache_chunks:
                self.cache.popitem(last=False)

    def _bounds(self, k: int) -> tuple[int, int]:
        return k * self.cs, min((k + 1) * self.cs, self.capacity)

    def _where(self, k: int) -> str:
        """Chunk ``k`` as an error names it (made only for one: it is not free)."""
        a, b = self._bounds(k)
        return f"{self.io.file(k)}: leaf {self.info.path!r}: chunk {k} (slots {a}..{b - 1})"

    def _decoded(self, k: int, committed: bool = True) -> np.ndarray:
        """Chunk ``k`` decoded; ``committed``: it holds committed rows, so it must be stored."""
        staged = self.staged.get(k)
        if staged is not None:
            return staged
        chunk = self.cache.get(k)
        if chunk is None:
            a, b = self._bounds(k)
            if committed and not self.io.exists(k):
                raise CorruptBufferError(f"{self._where(k)} holds committed steps but is missing; see `mmreplay verify`")
            try:
                chunk = self.io.read(k, a, b)
            except RemoteError:
                raise  # object storage failed to answer: the chunk may be fine
            except Exception as exc:
                where = self._where(k)
                raise shutdown_error(exc, where) or CorruptBufferError(f"{where} cannot be read: {exc}") from exc
            self._keep(k, chunk)
        else:
            self.cache.move_to_end(k)
        return chunk

    def read(self, slots: Any) -> np.ndarray:
        if isinstance(slots, slice):
            slots = np.arange(self.capacity)[slots]
        idx = np.asarray(slots, dtype=np.int64)
        scalar = idx.ndim == 0
        flat = idx.reshape(-1) % self.capacity
        out = np.empty((flat.size, *self.shape[1:]), self.info.spec.dtype)
        chunk_of = flat // self.cs
        for k in np.unique(chunk_of):
            sel = chunk_of == k
            out[sel] = self._decoded(int(k))[flat[sel] - k * self.cs]
        out = out.reshape(idx.shape + out.shape[1:])
        return out[()] if scalar else out

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The rows are grouped by chunk, so each chunk a batch needs is decoded (or found
        in the LRU) once, however many rows of the batch it holds."""
        rows = np.asarray(rows, np.int64)
        num_envs = self.num_envs
        flat = rows.reshape(-1) % (self.capacity * num_envs)  # rows past the ring end wrap
        tail = self.shape[2:]
        slots = flat // num_envs
        envs = flat - slots * num_envs
        chunk_of = slots // self.cs
        out = np.empty((flat.size, *tail), self.info.spec.dtype)
        if flat.size:
            order = np.argsort(chunk_of, kind="stable")
            sorted_chunks = chunk_of[order]
            cuts = np.flatnonzero(sorted_chunks[1:] != sorted_chunks[:-1]) + 1
            for sel in np.split(order, cuts):
                k = int(chunk_of[sel[0]])
                out[sel] = self._decoded(k)[slots[sel] - k * self.cs, envs[sel]]
        return out.reshape(rows.shape + tail)

    def _stage(self, k: int) -> np.ndarray:
        chunk = self.staged.get(k)
        if chunk is None:
            chunk = np.array(self._decoded(k, committed=False))  # a private copy
            self.cache.pop(k, None)
            self.staged[k] = chunk
        return chunk

    def write(self, start: int, values: np.ndarray) -> None:
        pos, end = start, start + len(values)
        while pos < end:
            k = pos // self.cs
            a, b = self._bounds(k)
            n = min(end, b) - pos
            self._stage(k)[pos - a : pos - a + n] = values[pos - start : pos - start + n]
            pos += n
            if pos == b:  # the write head leaves chunk k: encode it now
                self._encode(k)

    def write_slots(self, slots: np.ndarray, values: np.ndarray) -> None:
        chunk_of = slots // self.cs
        for k in np.unique(chunk_of):
            sel = chunk_of == k
            self._stage(int(k))[slots[sel] - k * self.cs] = values[sel]

    def _encode(self, k: int) -> None:
        """Store chunk ``k``; it stays staged until it is stored (a failed or interrupted
        write leaves it for the next flush, never rows that reached no file)."""
        chunk = self.staged[k]
        a, b = self._bounds(k)
        with self._write_errors(f"chunk {k} (slots {a}..{b - 1})"):
            self.io.write(k, a, b, chunk)
        del self.staged[k]
        self._keep(k, chunk)

    def flush(self, fsync: bool) -> None:
        with self._write_errors("a flush"):  # the staged chunks stay staged: the head is still inside them
            self.io.flush(fsync, dict(self.staged))

    @contextmanager
    def _write_errors(self, what: str) -> Iterator[None]:
        """A full disk and the program's end, named as such (the last commit is intact)."""
        where = f"leaf {self.info.path!r}"
        try:
            with disk_full_as(f"{where}: no space left on the file system for {what}; the last commit is intact"):
                yield
        except Exception as exc:
            error = shutdown_error(exc, f"{where}, {what}")
            if error is None:
                raise
            raise error from exc

    def invalidate(self, slots: Iterable[tuple[int, int]]) -> None:
        for a, b in slots:
            for k in range(a // self.cs, (b - 1) // self.cs + 1):
                self.cache.pop(k, None)
        self.io.refresh()

    def close(self) -> None:
        self.staged.clear()
        self.cache.clear()
        self.io.close()
