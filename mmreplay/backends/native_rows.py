"""Decoding a batch of row frames in one native call per leaf, off the GIL.

Decoding row by row from Python hands the GIL over once per row, so a second core barely
helps. The optional C extension ``mmreplay._rowdecode`` decodes a whole batch in one call on
up to ``os.cpu_count()`` threads, each frame straight into its row of the output batch. It
compiles no codec of its own: it opens the codec library at run time, the system's
(``liblz4.so.1``, ``libzstd.so.1``) or else the copy inside an installed package that
exports the functions (python-lz4, zstandard).

Where the extension did not compile (``pip install`` without a compiler), no library is
found, or ``MMREPLAY_NATIVE=0`` is set, :func:`decoder` returns None and row frames decode
in Python (cramjam / zstandard) to the same bytes, more slowly.
"""

from __future__ import annotations

import ctypes.util
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ENV",
    "DecodeThreads",
    "FrameBatch",
    "NativeDecoder",
    "NativeEncoder",
    "decoder",
    "encoder",
    "encoding_status",
    "extension",
    "shard_stored",
    "status",
    "store_shard",
]

log = logging.getLogger(__name__)

#: ``MMREPLAY_NATIVE=0`` forces the pure-Python decoding
ENV = "MMREPLAY_NATIVE"
#: where each codec's library is looked for, in order: dlopen names, then the extension
#: module of a package that exports the same functions
SYSTEM_NAMES = {
    "lz4": ["liblz4.so.1", "liblz4.1.dylib", "lz4"],
    "zstd": ["libzstd.so.1", "libzstd.1.dylib", "zstd"],
}
PACKAGE_MODULES = {"lz4": ["lz4.block._block"], "zstd": ["zstandard.backend_c"]}

#: seconds between reads of the load average
LOAD_EVERY = 1.0
#: threads a batch may decode on (the C extension's pool)
MAX_THREADS = 256

_lock = threading.Lock()
_load_seen = [-LOAD_EVERY, 0.0, 0.0]  # [when, cores that were idle, load average]
_loaded: dict[str, str | None] = {}  # codec -> the library used (None: none found)
_why: dict[str, str] = {}  # codec -> why there is no native decoding


def extension() -> ModuleType | None:
    """The C extension ``mmreplay._rowdecode``, or None where it was not built."""
    try:
        return importlib.import_module("mmreplay._rowdecode")
    except ImportError:
        return None


def _candidates(codec: str) -> Iterator[str]:
    """The libraries to try, in order. ``find_library`` runs a subprocess (``ldconfig``),
    so it is asked only when the usual file names did not load."""
    for name in SYSTEM_NAMES[codec]:
        if "." in name:
            yield name
        else:
            found = ctypes.util.find_library(name)
            if found:
                yield found
    for module in PACKAGE_MODULES[codec]:
        try:
            path = importlib.import_module(module).__file__
        except ImportError:
            continue
        if path:
            yield path


def _load(codec: str) -> str | None:
    """Open ``codec``'s library once per process; the library's name, or None."""
    with _lock:
        if codec in _loaded:
            return _loaded[codec]
        ext = extension()
        used = None
        if ext is None:
            _why[codec] = "the C extension mmreplay._rowdecode is not built (no compiler at install time?)"
        else:
            errors = []
            for name in _candidates(codec):
                try:
                    ext.load(codec, name)
                except OSError as exc:
                    errors.append(str(exc))
                    continue
                used = name
                break
            if used is None:
                _why[codec] = f"no {codec} library found: " + ("; ".join(errors) or "nothing to try")
                log.info("row frames decode %s in Python: %s", codec, _why[codec])
        _loaded[codec] = used
        return used


class FrameBatch(NamedTuple):
    """Frames to decode: frame ``i`` is ``lengths[i]`` bytes at ``offsets[i]`` of
    ``buffers[which[i]]`` and goes to row ``where[i]`` of the output."""

    buffers: list[Any]
    which: np.ndarray
    where: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray


def idle_cores() -> int:
    """Cores not busy with other work, by the 1-minute load average (this process counted
    as idle), read at most once a second; at least 1. A thread more than there are idle
    cores only queues behind other processes: measured on 2 cores at load 12, a second
    thread made lz4 batches 2-3x slower."""
    now = time.monotonic()
    if now - _load_seen[0] >= LOAD_EVERY:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
        cpus = os.cpu_count() or 1
        _load_seen[:] = [now, max(1.0, min(cpus, cpus - load + 1.5)), load]  # rounded down: + 1 + 0.5
    return int(_load_seen[1])


class DecodeThreads(NamedTuple):
    """The threads a batch of row frames decodes on, and why (``Store.decode_threads``)."""

    threads: int  # what the next batch decodes on
    setting: int | None  # ``Store.set_decode_threads``; None: one per idle core
    cpus: int
    load: float | None  # the 1-minute load average the automatic choice read

    def __str__(self) -> str:
        if self.setting is not None:
            return f"{self.threads} thread(s), as set (store.set_decode_threads)"
        return (
            f"{self.threads} thread(s) of {self.cpus} CPUs: automatic, one per idle core at load average "
            f"{self.load:.2f} (store.set_decode_threads(n) fixes the number)"
        )


def decode_threads(setting: int | None) -> DecodeThreads:
    """The threads a batch decodes on for ``setting``: that many if set, else one per idle
    core (:func:`idle_cores`)."""
    cpus = os.cpu_count() or 1
    if setting is not None:
        return DecodeThreads(setting, setting, cpus, None)
    threads = idle_cores()
    return DecodeThreads(threads, None, cpus, _load_seen[2])


def encode_threads() -> int:
    """Native threads a writer's row frames encode on: one per core this process may run
    on, at most 8 (a writer that adds faster than they encode waits at the segment's end)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def check_decode_threads(threads: Any) -> int | None:
    """``threads`` as an int >= 1 (at most the extension's pool) or None; ValueError else."""
    if threads is None:
        return None
    if not isinstance(threads, (int, np.integer)) or isinstance(threads, bool) or not 1 <= threads <= MAX_THREADS:
        raise ValueError(
            f"set_decode_threads: expected an int in [1, {MAX_THREADS}] or None (one per idle core), got {threads!r}"
        )
    return int(threads)


def disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off")


class NativeDecoder:
    """Decodes frames of one codec with the C extension (see the module's docstring)."""

    def __init__(self, codec: str, library: str):
        self.codec = codec
        self.library = library
        self._ext = sys.modules["mmreplay._rowdecode"]

    def dictionary(self, data: bytes) -> Any:
        """A digested zstd dictionary for :meth:`decode`."""
        return self._ext.zstd_dictionary(data)

    def decode(
        self,
        batch: FrameBatch,
        out: np.ndarray,
        row_bytes: int,
        threads: int,
        dictionary: Any = None,
        verify: bool = True,
        permute: tuple[int, int, int] | None = None,
    ) -> None:
        """Decode ``batch`` into ``out`` (rows of ``row_bytes`` bytes) on up to ``threads``
        threads (:func:`decode_threads`), each row written transposed as ``permute`` says
        (:func:`mmreplay.read.layout.gather_rows`). ``verify=False`` skips zstd's content
        checksums where the library takes ``ZSTD_d_forceIgnoreChecksum`` (zstd 1.4.7 and
        later; lz4 blocks have none). ValueError naming the first frame that does not decode."""
        self._ext.decode_rows(
            self.codec,
            batch.buffers,
            np.ascontiguousarray(batch.which, np.int32),
            np.ascontiguousarray(batch.where, np.int64),
            np.ascontiguousarray(batch.offsets, np.int64),
            np.ascontiguousarray(batch.lengths, np.int64),
            out,
            row_bytes,
            threads,
            dictionary,
            verify,
            *(permute or ()),
        )


def decoder(codec: str) -> NativeDecoder | None:
    """The native decoder of ``codec`` ("lz4" or "zstd"), or None to decode in Python."""
    if disabled():
        return None
    library = _load(codec)
    return None if library is None else NativeDecoder(codec, library)


def status(codec: str) -> str:
    """How ``codec``'s row frames decode here, in words (for logs, benchmarks and tests)."""
    if disabled():
        return f"python ({ENV}=0)"
    library = _load(codec)
    return f"native ({library})" if library else f"python ({_why[codec]})"


# --- encoding -------------------------------------------------------------------------------

def _encoding_library(codec: str) -> tuple[str | None, str]:
    """The library ``codec``'s rows are encoded with (the decoder's), or None and why not."""
    library = _load(codec)
    if library is None:
        return None, _why[codec]
    try:
        if extension().can_encode(codec):  # type: ignore[union-attr]
            return library, ""
    except AttributeError:  # an extension built before it could encode
        pass
    return None, f"{library} has no encoding functions (or the extension predates them)"


class NativeEncoder:
    """Encodes rows as frames of one codec in one call per batch, off the GIL: the bytes the
    Python encoders write (numcodecs' LZ4 layout; zstd frames with a content checksum)."""

    def __init__(self, codec: str, level: int, library: str, dictionary: bytes | None = None):
        self.codec = codec
        self.library = library
        self._ext = sys.modules["mmreplay._rowdecode"]
        # lz4: acceleration 1, as numcodecs' LZ4 codec in the zarr metadata says
        self._encoder = self._ext.new_encoder(codec, level if codec == "zstd" else 1, dictionary)

    def encode(self, rows: np.ndarray) -> list[bytes]:
        """One frame per row of ``rows`` (uint8, ``[n, row_bytes]``, C-contiguous)."""
        return self._ext.encode_rows(self._encoder, rows, rows.shape[1])

    @staticmethod
    def worker(name: str = "mmreplay-encode") -> Any:
        """A native thread (``name``: as the OS shows it) that runs submitted jobs in order,
        never taking the GIL (a Python thread waits up to the switch interval for it, before
        and after each batch, while the writer runs Python code)."""
        return sys.modules["mmreplay._rowdecode"].new_worker(name)

    def submit(self, worker: Any, rows: np.ndarray) -> Any:
        """Hand ``rows`` (uint8 ``[n, row_bytes]``, C-contiguous, left unchanged until
        their frames are taken) to ``worker``; a job for :meth:`frames`."""
        return self._ext.submit_rows(worker, self._encoder, rows, rows.shape[1])

    def frames(self, job: Any, wait: bool) -> list[bytes] | None:
        """The frames of a submitted job, or None if it is not done and not ``wait``."""
        return self._ext.job_frames(job, wait)


def store_shard(
    worker: Any, folder: int, folders: str, tmp: str, name: str, frames: list[bytes | None], jobs: list[tuple[int, Any]]
) -> Any:
    """Hand a segment's shard to ``worker`` (:meth:`NativeEncoder.worker`): ``frames`` (bytes,
    or None for a missing row), each job's frames (``(row, job)`` of :meth:`NativeEncoder.submit`)
    in their place from that row on once encoded, written to ``tmp`` in the folder
    ``folders`` ("a/b") of the open folder ``folder`` (made where missing, entered without
    following links) and renamed over ``name``, without the GIL; a job for :func:`shard_stored`."""
    return sys.modules["mmreplay._rowdecode"].submit_shard(worker, folder, folders, tmp, name, frames, jobs)


def shard_stored(job: Any, wait: bool) -> bool:
    """Whether the shard of :func:`store_shard` is in place (with ``wait``, once it is);
    OSError if writing it failed, ValueError if encoding one of its rows did."""
    return sys.modules["mmreplay._rowdecode"].shard_done(job, wait)


def encoder(codec: str, level: int, dictionary: bytes | None = None) -> NativeEncoder | None:
    """The native encoder of ``codec`` at ``level`` (zstd), or None to encode in Python."""
    if disabled():
        return None
    library, _ = _encoding_library(codec)
    return None if library is None else NativeEncoder(codec, level, library, dictionary)


def encoding_status(codec: str) -> str:
    """How ``codec``'s row frames are encoded here, in words."""
    if disabled():
        return f"python ({ENV}=0)"
    library, why = _encoding_library(codec)
    return f"native ({library})" if library else f"python ({why})"
