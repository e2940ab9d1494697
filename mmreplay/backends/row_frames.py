"""Compressed leaves whose rows decode one at a time: one compressed frame per row.

A random batch of a chunk-compressed leaf decodes every chunk it touches, ~100× the bytes
it returns. Here each row (one step of one env) is its own lz4 or zstd frame, so a batch
decodes exactly its rows, in one call into native code per leaf, off the GIL.

Layout (zarr v3, readable by ``zarr.open`` and dask): the leaf is an array sharded along
the step axis, one shard per *segment* of ``chunk_steps`` steps, with inner chunks of one
row ``(1, 1, *shape)``. A shard file is the rows' frames one after the other, then the
shard index (an offset and a length per row, in (step, env) order) and its CRC-32C. A
segment is written once, when the write head leaves it, to a temporary file renamed over
the old one: a shard is never torn, and a reader that holds the old one keeps reading it.

The segment the head is in lives raw in ``rows.staging`` beside the shards (a memory-mapped
file: a header, then one segment of rows) so the writer reads everything it added, and
readers and a writer reopening after a crash find the committed rows there. Its header
says which segment it holds, which of its steps (``[base, filled)``), and a sequence
number that changes whenever it starts another segment; a reader checks the sequence
number after reading, seqlock style. zarr readers see sealed segments only: a writer
seals the one it is in when it closes.

A segment the head leaves is sealed on a background thread. Until its shard is renamed
into place, staging keeps its rows and its header names it, and the writer keeps the
next segment's rows in memory; only then do those rows move into staging and the header
to the next segment. Commits wait for that first, so a committed row is always raw in
staging or in a shard that is in place, whenever the writer is killed.

The codecs are :mod:`.row_codec`'s; reading a batch is :mod:`.row_reads`' (one gather
over the leaf's byte source, a local folder or an object store); here is the writing.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..errors import CorruptBufferError, Error
from ..io import ByteSource
from ..io.local import open_folder, partial_name
from ..metadata import LeafInfo
from . import native_rows
from .base import disk_full_as, fsync_files, preallocate
from .row_codec import DICTIONARY_FILE, FrameCodec, parse_row_compression
from .row_reads import (
    MISSING,
    STAGING_MAGIC,
    RowFrameReads,
    read_shard_index,
    shard_limit,
    staging_bytes,
)

__all__ = ["RowFrameLeaf", "create_staging", "shard_bytes", "share_encoder", "wait_background"]

#: rows handed to the background encoder at a time (waking it per step costs more)
ENCODE_BATCH_ROWS = 64
#: the native thread that stores shards, as the OS names it (the encoding ones: mmreplay-encode)
SHARD_THREAD = "mmreplay-shards"


class _EncodeFailed(Exception):
    """What the encoder thread raised, and for which leaf."""

    def __init__(self, where: str, cause: BaseException):
        super().__init__(where, cause)
        self.where = where
        self.cause = cause


class _NativeJob:
    """Rows of one leaf handed to the native encoding thread."""

    __slots__ = ("leaves", "frames", "lo", "hi", "encoder", "where", "job")

    def __init__(self, leaf: Any, frames: list[bytes | None], lo: int, hi: int, encoder: Any, worker: Any, rows: Any):
        self.leaves, self.frames, self.lo, self.hi, self.encoder, self.where = (leaf,), frames, lo, hi, encoder, leaf.where
        self.job = encoder.submit(worker, rows)

    def finish(self, wait: bool) -> bool:
        """Put the frames in place if they are done (with ``wait``, once they are)."""
        try:
            got = self.encoder.frames(self.job, wait)
        except Exception as exc:
            raise _EncodeFailed(self.where, exc) from exc
        if got is None:
            return False
        self.frames[self.lo : self.hi] = got
        return True


class _PythonJob:
    """Rows of some leaves handed to the Python encoding thread, which puts their frames
    in place."""

    __slots__ = ("future", "leaves")

    def __init__(self, future: Future[None], leaves: list[Any]):
        self.future = future
        self.leaves = leaves  # whose rows these are

    def finish(self, wait: bool) -> bool:
        if not wait and not self.future.done():
            return False
        self.future.result()  # raises _EncodeFailed
        return True


class _NativeSeal:
    """A segment's shard stored by the native shard thread (:func:`.native_rows.store_shard`),
    looked at as a future is."""

    __slots__ = ("job", "where", "full")

    def __init__(self, job: Any, where: str, full: str):
        self.job, self.where, self.full = job, where, full  # full: what a full disk means here

    def done(self) -> bool:
        try:
            return native_rows.shard_stored(self.job, False)
        except Exception:  # done, and failed: result() says how
            return True

    def result(self) -> None:
        with disk_full_as(self.full):
            try:
                native_rows.shard_stored(self.job, True)
            except ValueError as exc:  # a row did not encode
                raise _EncodeFailed(self.where, exc) from exc


class _Encoder:
    """The background encoding of a writer's row-frame leaves (every leaf of a store, the
    side ring's included: :func:`share_encoder`), in the order rows were added. Rows are
    handed over ``ENCODE_BATCH_ROWS`` at a time over all leaves, so a step's rows of every
    leaf go together.

    Leaves with a native encoder hand their rows to native threads (the C extension's: one
    per core, at most 8, each batch to the next in turn, each with its own encoder of each
    leaf), which never take the GIL; the frames are put in place by the writer's thread when it
    checks (each batch handed over) or waits (a seal in the writer's thread, ``set``, close).
    Their segments' shards are stored by one more native thread, which waits for the frames
    it needs (:meth:`store_shard`). A Python thread waiting for the GIL gets it
    only when the writer lets go, up to the interpreter's switch interval (5 ms) later,
    before and after each batch: it falls behind a writer that runs Python code. Leaves
    that encode in Python (no extension or library, ``MMREPLAY_NATIVE=0``) use one daemon
    Python thread. Not a ThreadPoolExecutor: the interpreter stops those before the exit
    hooks that close writers left open, and their non-daemon thread would keep the early
    hook from running; a writer closed at exit must still hand its last rows over and wait
    for them. Used from the writer's thread only."""

    def __init__(self) -> None:
        #: native threads, started as batches come, up to one per core: jobs go to them in
        #: turn, each thread with its own encoder of each leaf
        self.workers: list[Any] = []
        self.size = native_rows.encode_threads()
        self.turn = 0
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the Python thread's
        self.thread: threading.Thread | None = None
        self.parts: list[list[Any]] = []  # [leaf, frames, lo, hi, source]: rows not handed over yet
        self.rows = 0  # rows in ``parts``
        self.handed: deque[_NativeJob | _PythonJob] = deque()  # in the order handed over
        self.failed: _EncodeFailed | None = None
        self.users = 0  # leaves that encode here; the threads stop when the last one leaves
        self.shard_writer: Any = None  # the native thread that stores shards, once needed

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args, future = job
            try:
                fn(*args)
            except BaseException as exc:  # raised in the caller by the future
                future.set_exception(exc)
            else:
                future.set_result(None)

    @staticmethod
    def _encode_parts(parts: list[tuple[Any, ...]]) -> None:
        for leaf, frames, lo, hi, source in parts:
            try:
                leaf._encode_rows(frames, lo, hi, source)
            except BaseException as exc:
                raise _EncodeFailed(leaf.where, exc) from exc

    def run_later(self, fn: Any, *args: Any) -> Future[None]:
        """Run ``fn(*args)`` on the Python thread, after what was given to it before."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="mmreplay-encode", daemon=True)
            self.thread.start()
        future: Future[None] = Future()
        self.jobs.put((fn, args, future))
        return future

    def add(self, leaf: RowFrameLeaf, frames: list[bytes | None], lo: int, hi: int, source: np.ndarray) -> None:
        """Encode rows ``[lo, hi)`` of ``source`` (``leaf``'s staging rows, or the rows it
        writes ahead) into ``frames[lo:hi]`` later."""
        if self.rows + hi - lo >= ENCODE_BATCH_ROWS:
            self.check()  # what failed is raised here, once a batch, before the rows are taken
        for part in self.parts:
            if part[0] is leaf and part[1] is frames and part[3] == lo and part[4] is source:
                part[3] = hi
                break
        else:
            self.parts.append([leaf, frames, lo, hi, source])
        self.rows += hi - lo
        if self.rows >= ENCODE_BATCH_ROWS:
            self.hand_over()

    def holds(self, leaf: RowFrameLeaf) -> bool:
        """Does the encoder hold rows of ``leaf`` not put in place yet?"""
        return any(part[0] is leaf for part in self.parts) or any(leaf in job.leaves for job in self.handed)

    def hand_over(self) -> None:
        """Give the rows not handed over yet to the threads. They leave :attr:`parts` only
        once all are handed over: a call cut short (Ctrl-C) hands some over twice, which
        encodes them twice, never not at all."""
        in_python = []
        for leaf, frames, lo, hi, source in list(self.parts):
            slot = self.turn % self.size
            native = leaf.frames.native_encoder(slot)
            if native is None:
                in_python.append((leaf, frames, lo, hi, source))
                continue
            if slot == len(self.workers):
                self.workers.append(native.worker())
            self.turn = slot + 1
            self.handed.append(_NativeJob(leaf, frames, lo, hi, native, self.workers[slot], source[lo:hi]))
        if in_python:
            self.handed.append(_PythonJob(self.run_later(self._encode_parts, in_python), [p[0] for p in in_python]))
        self.parts, self.rows = [], 0

    def store_shard(self, leaf: RowFrameLeaf, k: int, frames: list[bytes | None], jobs: list[_NativeJob]) -> _NativeSeal:
        """Store segment ``k``'s shard on the native shard thread: ``frames``, and the
        frames of ``jobs`` once they are encoded."""
        if self.shard_writer is None:
            self.shard_writer = native_rows.NativeEncoder.worker(SHARD_THREAD)
        folders, _, name = leaf.chunk_key(k).rpartition("/")  # inside the leaf's folder, made if missing
        job = native_rows.store_shard(
            self.shard_writer, leaf.array_folder(), folders, partial_name(name), name, frames, [(j.lo, j.job) for j in jobs]
        )
        return _NativeSeal(job, leaf.where, leaf._disk_full(k))

    def check(self, wait: bool = False) -> None:
        """Put the frames of the batches done in place; raise what the encoding raised
        (here, in the caller); with ``wait``, once every row handed over is encoded.
        After a failure every later call raises it again: the frames of the rows it was
        encoding are missing."""
        if wait:
            self.hand_over()
        handed = self.handed
        try:
            while handed and handed[0].finish(wait):
                handed.popleft()
        except _EncodeFailed as exc:
            self.failed = exc
            handed.clear()
        if self.failed is not None:
            where, cause = self.failed.where, self.failed.cause
            lost = "the rows since the last commit are lost (reopen the store to continue from it)"
            # what happened, by its own class (a full disk is no damage); else the rows are not sound
            if isinstance(cause, Error):
                raise type(cause)(f"{where}: {cause}; {lost}") from cause
            raise CorruptBufferError(f"{where}: encoding rows in the background failed: {cause!r}; {lost}") from cause

    def leave(self) -> None:
        """A leaf closed; the last one stops the threads."""
        self.users -= 1
        if self.users > 0:
            return
        self.handed.clear()
        self.workers = []  # each thread ends once its last job is dropped
        self.shard_writer = None
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None


def share_encoder(leaves: Iterable[Any]) -> None:
    """Make the writable row-frame leaves among ``leaves`` (a writer's) encode on one
    background thread."""
    encoder = _Encoder()
    for leaf in leaves:
        if isinstance(leaf, RowFrameLeaf) and leaf.writable and leaf.encoder is None:
            leaf.encoder = encoder
            encoder.users += 1


def wait_background(leaves: Iterable[Any]) -> None:
    """Wait for the background work on the rows of the writable row-frame leaves among
    ``leaves`` (a writer's :attr:`~mmreplay.Store.stored_leaves`): every row handed over
    encoded, every segment being sealed in place. A commit does not wait for it (see
    :meth:`RowFrameLeaf.flush`); a writer that pauses, or a benchmark that times a block
    of adds with the work they leave behind, does."""
    for leaf in leaves:
        if isinstance(leaf, RowFrameLeaf) and leaf.writable:
            leaf.wait_background()


def shard_bytes(frames: list[bytes | None]) -> bytes:
    """A zarr v3 shard: the frames one after the other, then the index (offset, length per
    row, MISSING for rows never written) and the CRC-32C of the index."""
    import google_crc32c

    index = np.empty((len(frames), 2), "<u8")
    pos = 0
    for i, f in enumerate(frames):
        if f is None:
            index[i] = MISSING
        else:
            index[i] = (pos, len(f))
            pos += len(f)
    raw = index.tobytes()
    crc = np.uint32(google_crc32c.value(raw)).astype("<u4").tobytes()
    return b"".join(f for f in frames if f is not None) + raw + crc


def create_staging(path: str, segment_steps: int, num_envs: int, row_bytes: int) -> None:
    """An empty staging file: no segment (-1), preallocated."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        preallocate(fd, staging_bytes(segment_steps, num_envs, row_bytes), path)
        os.pwrite(fd, STAGING_MAGIC + np.array([0, -1, 0, 0], "<i8").tobytes(), 0)
    finally:
        os.close(fd)


class RowFrameLeaf(RowFrameReads):
    """A leaf of one compressed frame per row (see the module's docstring): the reads of
    :class:`.row_reads.RowFrameReads`, and the writes of a local writer."""

    mappable = False
    in_place = True  # the staging segment is written where it is (sealed shards: by rename)
    atomic_replace = True
    ranged_read = True

    def __init__(
        self,
        info: LeafInfo,
        capacity: int,
        num_envs: int,
        source: ByteSource,
        rel: str,
        chunk_key: Callable[[int], str],
        writable: bool,
    ):
        self.info = info
        self.codec = parse_row_compression(info.compression or "")
        self.capacity = capacity
        self.num_envs = num_envs
        self.seg = info.chunk_steps
        self.nseg = -(-capacity // self.seg)
        self.writable = writable
        self.dtype = info.spec.dtype.newbyteorder("<")
        self.tail = tuple(info.spec.shape)
        self.row_bytes = info.spec.nbytes
        self.seg_rows = self.seg * num_envs
        self.where = f"leaf {info.path!r}"
        self.frames = FrameCodec(self.codec, self.row_bytes, None, source, f"{rel}/{DICTIONARY_FILE}")
        self.ahead_segment = -1
        self.ahead_filled = 0  # steps of ahead_segment written ahead
        self.ahead: np.ndarray | None = None
        self._open_reads(source, rel, chunk_key, writable)
        self.folder = source.where(rel)  # the zarr array folder (a writer's: local)
        self._folder_fd = -1  # its descriptor, for the native shard thread (opened once needed)
        self.sealed_since_flush: set[int] = set()
        # the writer's frames of the staging segment's rows (None: not written this lap)
        self.pending: list[bytes | None] | None = None
        # Rows are encoded on a background thread as they are added, one per writer shared
        # by its row-frame leaves (share_encoder; else this leaf's own, made when first
        # needed); the native encoder releases the GIL, so it runs on another core. A
        # segment is sealed once its rows are.
        self.encoder: _Encoder | None = None
        # A segment the head leaves is sealed in the background (its shard written and
        # renamed) while the head goes on in the next one, whose rows are kept in memory
        # meanwhile ("ahead") and moved into staging once the seal is done.
        self.sealing: tuple[int, Future[None] | _NativeSeal] | None = None
        self.ahead_buffers: list[np.ndarray | None] = [None, None]
        # the step that :meth:`write` writes the short way if it comes next (-1: none), whether
        # it goes ahead, and its segment's first slot
        self.next_start, self.next_ahead, self.next_base = -1, False, 0
        self.ahead_frames: list[bytes | None] | None = None

    # --- writes -----------------------------------------------------------------------------

    def _raw(self, values: np.ndarray) -> np.ndarray:
        """``values`` as rows of raw little-endian bytes."""
        return np.ascontiguousarray(values, self.dtype).view(np.uint8).reshape(-1, self.row_bytes)

    def _encode_step(self, values: np.ndarray) -> list[bytes]:
        return self.frames.encode_rows(self._raw(values))

    # --- the background encoder ---------------------------------------------------------

    def _encode_later(self, frames: list[bytes | None], lo: int, hi: int, source: np.ndarray | None = None) -> None:
        """Encode rows ``[lo, hi)`` of ``source`` (staging by default) into
        ``frames[lo:hi]`` in the background (the rows stay where they are until their
        segment is sealed, which waits)."""
        self._background().add(self, frames, lo, hi, self.staged if source is None else source)

    def _background(self) -> _Encoder:
        if self.encoder is None:
            self.encoder = _Encoder()
            self.encoder.users += 1
        return self.encoder

    def _encode_rows(self, frames: list[bytes | None], lo: int, hi: int, source: np.ndarray) -> None:
        """On the Python encoding thread."""
        frames[lo:hi] = self.frames.encode_rows(source[lo:hi])

    def _check_encoder(self, wait: bool = False) -> None:
        """Raise what the encoder raised; with ``wait``, once every row handed to it (of
        every leaf sharing it) is encoded."""
        if self.encoder is not None:
            self.encoder.check(wait)

    def _start(self, k: int, step: int) -> None:
        """Make segment ``k`` the staging segment, its rows from ``step`` on written next."""
        self.next_start = -1
        seq, segment, base, filled = self._header()
        if segment == k and self.pending is None and base <= step <= filled:
            # a writer reopening: the rows before ``step`` in staging are this lap's
            self.pending = [None] * self.seg_rows
            self._encode_later(self.pending, base * self.num_envs, step * self.num_envs)
            self.header[3] = step
            return
        if segment == k and self.pending is not None and base <= step <= filled:
            if step < filled:
                # rows staged this lap are written again: the head of a one-segment ring
                # came round (the segment was sealed as it left), or a write cut short is
                # done again. A reader holding the header, or the shard index, of before
                # must read again: as below, the sequence number moves on.
                self.header[1] = -1
                self.header[0] = seq + 1
                self.header[3] = step
                self.header[1] = k
            return
        if segment >= 0 and filled > base:
            if self.pending is None:  # rows a dead writer left in staging
                self.pending = [None] * self.seg_rows
                self._encode_later(self.pending, base * self.num_envs, filled * self.num_envs)
            self._seal(segment)
        # In this order, so a reader never pairs the new sequence number with the old
        # segment: it reads the sequence number first and checks it again at the end.
        self.header[1] = -1
        self.header[0] = seq + 1
        self.header[2] = step
        self.header[3] = step
        self.header[1] = k
        self.pending = [None] * self.seg_rows

    def write(self, start: int, values: np.ndarray) -> None:
        if start == self.next_start and len(values) == 1:
            self._write_next(values)
            return
        self.next_start = -1
        pos, end = start, start + len(values)
        while pos < end:
            k = pos // self.seg
            a = k * self.seg
            b = min(a + self.seg, self.capacity)
            n = min(end, b) - pos
            lo = (pos - a) * self.num_envs
            hi = lo + n * self.num_envs
            part = values[pos - start : pos - start + n]
            if self.sealing is not None:
                self._promote(wait=False)
            ahead = self.sealing is not None and k == self.ahead_segment and pos - a == self.ahead_filled
            if ahead:
                # the segment before is still being sealed from staging: write ahead
                assert self.ahead is not None and self.ahead_frames is not None
                self.ahead[lo:hi] = self._raw(part)
                self._encode_later(self.ahead_frames, lo, hi, self.ahead)
                self.ahead_filled = pos - a + n
            else:
                self._promote(wait=True)
                self._start(k, pos - a)
                frames = self.pending
                assert frames is not None
                self.staged[lo:hi] = self._raw(part)
                self._encode_later(frames, lo, hi)
                self.header[3] = pos - a + n
            pos += n
            if pos == b:  # the write head leaves segment k: store it
                self._promote(wait=True)  # segment k is the staging segment now
                self._seal_later(k)
            elif pos + 1 < b:  # the next step, if it comes next, takes the short way
                self.next_start, self.next_ahead, self.next_base = pos, ahead, a

    def _write_next(self, values: np.ndarray) -> None:
        """One step (``values[0]``) right after the one written last, in the same segment
        and not its last step: :meth:`write` without its bookkeeping (staging already
        says this segment, filled up to this step; or the rows go on ahead)."""
        step = self.next_start
        lo = (step - self.next_base) * self.num_envs
        hi = lo + self.num_envs
        if self.next_ahead and self.sealing is not None:
            self._promote(wait=False)  # the segment written ahead may become the staging segment
        self.next_start = -1  # until this step is written
        if self.next_ahead and self.sealing is not None:
            self.ahead[lo:hi] = self._raw(values)  # type: ignore[index]
            self._encode_later(self.ahead_frames, lo, hi, self.ahead)  # type: ignore[arg-type]
            self.ahead_filled += 1
        else:
            self.staged[lo:hi] = self._raw(values)
            self._encode_later(self.pending, lo, hi)  # type: ignore[arg-type]
            self.header[3] = step - self.next_base + 1
            self.next_ahead = False
        if step + 2 < min(self.next_base + self.seg, self.capacity):
            self.next_start = step + 1

    def _seal_later(self, k: int) -> None:
        """Seal the staging segment ``k`` in the background; the rows after it are written
        ahead, in memory, until it is sealed (:meth:`_promote`). Staging keeps ``k``'s rows
        meanwhile, and its header says ``k``: readers, and a writer reopening after a
        crash, find them there until the shard is in place. Sealed here instead (waiting)
        when there is no other segment to write ahead into, or a dictionary is still to
        be trained."""
        if self.nseg == 1 or (self.codec.dictionary and not self.frames.load_dictionary()):
            self._seal(k)
            return
        encoder = self._background()
        encoder.check()  # what failed is raised here
        encoder.hand_over()
        frames = self.pending
        assert frames is not None
        # k's frames still being encoded: the sealing thread waits for them, not the writer
        jobs = [job for job in encoder.handed if isinstance(job, _NativeJob) and job.frames is frames]
        # two buffers in turn: the rows written ahead of the segment before may still be
        # being encoded (its sealing waits for them) while these are written
        self.ahead_buffers.reverse()
        if self.ahead_buffers[0] is None:
            self.ahead_buffers[0] = np.empty_like(self.staged)
        self.ahead = self.ahead_buffers[0]
        self.ahead_filled = 0
        self.ahead_frames = [None] * self.seg_rows
        self.ahead_segment = (k + 1) % self.nseg
        # last: rows go ahead only once all of the above is ready (a call cut short by
        # Ctrl-C before it leaves staging as it was, to seal again)
        self.sealing = (k, self._store_later(k, frames, jobs))

    def _store_later(self, k: int, frames: list[bytes | None], jobs: list[_NativeJob]) -> Future[None] | _NativeSeal:
        """Store the staging segment ``k``'s shard in the background: ``frames``, and those
        of ``jobs`` once encoded. Where every row of it was written this lap (staging from
        its first step) and encodes natively, on the native shard thread, without the GIL;
        else on the Python thread, which reads the old shard for the rows not written."""
        encoder = self._background()
        if self._header()[2] == 0 and self.frames.native_encoder() is not None:
            return encoder.store_shard(self, k, frames, jobs)
        return encoder.run_later(self._store_when_encoded, k, frames, jobs)

    def _promote(self, wait: bool) -> None:
        """Once the segment sealed in the background is in place (with ``wait``, waiting
        for it), make the segment written ahead the staging segment: its rows move into
        staging. A failed seal is raised here, and by every later write and commit (the
        rows since the last commit are lost; staging still holds the segment)."""
        if self.sealing is None:
            return
        k, future = self.sealing
        if not wait and not future.done():
            return
        try:
            future.result()  # (Ctrl-C while waiting leaves the seal to wait for again)
        except Exception as exc:
            self.sealing = None
            self.ahead_segment, self.ahead_frames, self.next_start = -1, None, -1
            if not isinstance(exc, _EncodeFailed):  # the shard was not stored
                self._background().failed = _EncodeFailed(f"{self.where}: sealing segment {k}", exc)
                raise
            self._background().failed = exc  # a row of segment k did not encode
            self._background().check()  # raises it
        self._drop(k)
        self.sealed_since_flush.add(k)
        seq = int(self.header[0])
        filled = self.ahead_filled
        # From here no call (where Ctrl-C could cut in) until `sealing` is cleared: a
        # promotion cut short before it is done again whole.
        # As in _start: a reader that read the old segment sees the sequence number change.
        self.header[1] = -1
        self.header[0] = seq + 1
        self.staged[: filled * self.num_envs] = self.ahead[: filled * self.num_envs]  # type: ignore[index]
        self.header[2] = 0
        self.header[3] = filled
        self.header[1] = self.ahead_segment
        self.pending = self.ahead_frames
        self.ahead_segment, self.ahead_frames, self.ahead_filled = -1, None, 0
        self.sealing = None

    def write_slots(self, slots: np.ndarray, values: np.ndarray) -> None:
        self.next_start = -1
        self._promote(wait=True)
        # one thread encodes at a time with this leaf's codec: wait for the rows of this leaf
        # the encoder holds (none for the side ring of next frames, which is written here
        # only), not for every leaf's
        self._check_encoder(wait=self.encoder is not None and self.encoder.holds(self))
        slots = np.asarray(slots, np.int64) % self.capacity
        seg_of = slots // self.seg
        _, segment, base, filled = self._header()
        for k in np.unique(seg_of):
            k = int(k)
            sel = np.flatnonzero(seg_of == k)
            steps = slots[sel] - k * self.seg
            changed = {}
            for i, t in zip(sel.tolist(), steps.tolist()):
                for e, frame in enumerate(self._encode_step(values[i])):
                    changed[t * self.num_envs + e] = frame
                if k == segment and base <= t < filled:
                    lo = t * self.num_envs
                    self.staged[lo : lo + self.num_envs] = self._raw(values[i])
            if k == segment and self.pending is not None:
                for i, frame in changed.items():
                    self.pending[i] = frame
            if os.path.exists(self.shard_path(k)):
                frames = self._stored_frames(k)
                for i, frame in changed.items():
                    frames[i] = frame
                self._write_shard(k, frames)
            elif k != segment:
                self._write_shard(k, [changed.get(i) for i in range(self.seg_rows)])

    def _stored_frames(self, k: int) -> list[bytes | None]:
        """The frames of sealed segment ``k`` (None for rows never written)."""
        try:
            data = self.source.read(self.shard_key(k), shard_limit(self.seg_rows, self.row_bytes), f"a shard of {self.where}")
        except FileNotFoundError:
            return [None] * self.seg_rows
        offsets, lengths = read_shard_index(data, self.seg_rows, f"{self.where}: {self.shard_path(k)}")
        return [None if o < 0 else data[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]

    def _seal(self, k: int) -> None:
        """Store the staging segment ``k`` as its shard: this lap's frames, and the old
        shard's for rows not written this lap."""
        self._check_encoder(wait=True)
        frames = self.pending
        assert frames is not None
        if self.codec.dictionary and not self.frames.load_dictionary():
            _, _, base, filled = self._header()
            lo, hi = base * self.num_envs, filled * self.num_envs
            if self.frames.train(self.staged[lo:hi]):  # this segment's frames, once more with it
                frames[lo:hi] = self.frames.encode_rows(self.staged[lo:hi])
        self._drop(k)  # first: a seal cut short leaves no stale index of the shard behind
        self.sealed_since_flush.add(k)
        self._store_shard(k, frames)

    def _store_when_encoded(self, k: int, frames: list[bytes | None], jobs: list[_NativeJob]) -> None:
        """On the Python encoding thread: once the native ``jobs`` of segment ``k`` are
        done, put their frames in place and store its shard. (The writer's thread puts the
        same frames in place again when it takes the jobs; rows encoded in Python were
        encoded before this runs, by the same thread.)"""
        for job in jobs:
            job.finish(wait=True)
        self._store_shard(k, frames)

    def _store_shard(self, k: int, frames: list[bytes | None]) -> None:
        """Write segment ``k``'s shard: ``frames``, and the old shard's for rows not
        written this lap (on the writer's thread or the Python background thread)."""
        if any(f is None for f in frames):
            old = self._stored_frames(k)
            frames = [f if f is not None else o for f, o in zip(frames, old)]
        self._write_shard_file(k, frames)

    def _write_shard(self, k: int, frames: list[bytes | None]) -> None:
        self._write_shard_file(k, frames)
        self._drop(k)
        self.sealed_since_flush.add(k)

    def _write_shard_file(self, k: int, frames: list[bytes | None]) -> None:
        """Write then rename: a shard file is never torn."""
        with disk_full_as(self._disk_full(k)):
            self.source.replace(self.shard_key(k), shard_bytes(frames))

    def array_folder(self) -> int:
        """A descriptor of the leaf's zarr array folder (kept until the leaf closes): where
        the native shard thread enters its shards' folders."""
        if self._folder_fd < 0:
            self._folder_fd = open_folder(self.source.path, self.rel)
        return self._folder_fd

    def _disk_full(self, k: int) -> str:
        """What a full disk while storing segment ``k``'s shard means."""
        return (
            f"{self.where}: no space left on the file system for segment {k} "
            f"(slots {k * self.seg}..{min((k + 1) * self.seg, self.capacity) - 1}); the last commit is intact"
        )

    def flush(self, fsync: bool) -> None:
        # A commit waits only for what it makes durable. The rows of the staging segment
        # are durable raw in staging, encoded or not (a writer reopening after a crash
        # encodes them again), so their encoding goes on; the rows written ahead are in
        # memory: they move into staging once the segment before is sealed, which waits
        # for that segment's encoding and shard. A writer whose encoding failed before
        # commits no more (it raised that failure once already).
        self._promote(wait=True)
        if self.encoder is not None and self.encoder.failed is not None:
            self.encoder.check()
        if fsync:
            self.mm.flush()
            fsync_files([self.shard_path(k) for k in self.sealed_since_flush])
        self.sealed_since_flush = set()

    def wait_background(self) -> None:
        """:func:`wait_background` of this leaf (and the rows of the leaves it shares its
        encoder with)."""
        self._promote(wait=True)
        self._check_encoder(wait=True)

    def seal_open_segment(self) -> None:
        """Store the rows of the staging segment as its shard too, so zarr readers see them
        (a writer's close); staging keeps them for the next writer."""
        self._promote(wait=True)
        self.next_start = -1
        _, segment, base, filled = self._header()
        if self.writable and self.pending is not None and segment >= 0 and filled > base:
            self._seal(segment)

    def close(self) -> None:
        if self.frames is None:
            return
        try:
            if self.mm is not None and (self.encoder is None or self.encoder.failed is None):  # else the rows
                self.seal_open_segment()  # since the last commit are lost, as said
        finally:
            self.close_reads()
            if self.encoder is not None:
                self.encoder.leave()
                self.encoder = None
            if self._folder_fd >= 0:  # (the shard thread has a copy of its own)
                os.close(self._folder_fd)
                self._folder_fd = -1
            self.frames = None  # type: ignore[assignment]
            self.header = None
            self.staged = None
            if self.mm is not None:
                with contextlib.suppress(BufferError):
                    self.mm.close()
                self.mm = None
