"""Reading a leaf of row frames: one gather over the leaf's byte source.

A batch's rows of the segment the writer is in are copied raw from staging; the others
are decoded from their segments' shards, each shard's index read once (the last bytes of
the shard). Where they come from is the byte source's business: from a local folder,
shards are memory-mapped while the mappings are fewer than :data:`MAPPED_SHARDS`, else
read with ``pread``, and staging is the writer's own mapping, checked seqlock style; from
an object store, the staging header is fetched per batch, then the batch's frames (and
staged rows) by ranged GETs all in flight together, each conditional on the ETag the
shard's index came with, so a segment a push replaced is indexed again rather than read
at stale offsets (see :mod:`mmreplay.io`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import numpy as np

from ..errors import CorruptBufferError
from ..io import ByteSource, Handle, ObjectChanged, coalesce
from ..read.advice import DiskReads
from ..read.layout import gather_rows
from . import native_rows
from .base import TakenLeaf
from .row_codec import DICTIONARY_LIMIT, is_row_compression

__all__ = [
    "HEADER_BYTES",
    "MAPPED_SHARDS",
    "OPEN_SHARDS",
    "STAGING_FILE",
    "RowFrameReads",
    "index_bytes",
    "is_row_compression",
    "read_shard_index",
    "shard_limit",
    "staging_bytes",
]

STAGING_FILE = "rows.staging"
STAGING_MAGIC = b"MMRROWS1"
#: header: magic, then int64 seq, segment, base, filled
HEADER_BYTES = 4096
#: shard index entry of a row that was never written (zarr reads it as the fill value)
MISSING = np.uint64(2**64 - 1)
#: a batch read again while staging or a shard changes under it, at most
READ_TRIES = 100


#: ``MMREPLAY_MAPPED_SHARDS=N`` sets :data:`MAPPED_SHARDS`, ``MMREPLAY_OPEN_SHARDS=N``
#: :data:`OPEN_SHARDS` (tests and benchmarks lower them)
MAPPED_SHARDS_ENV = "MMREPLAY_MAPPED_SHARDS"
OPEN_SHARDS_ENV = "MMREPLAY_OPEN_SHARDS"


def _budget(env: str, limit: int) -> int:
    """``env``'s number if set, else a quarter of ``limit`` (a per-process limit of
    Linux that the rest of the process shares), between 256 and 65,536."""
    given = os.environ.get(env, "").strip()
    if given:
        try:
            return max(0, int(given))
        except ValueError:
            warnings.warn(f"{env} must be a number of shards, not {given!r}: ignored", stacklevel=2)
    return max(256, min(limit // 4, 1 << 16))


def _max_map_count() -> int:
    """The mappings Linux allows a process (``vm.max_map_count``, 65,530 by default)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65_530


def _max_open_files() -> int:
    """The file descriptors the process may hold (the soft ``RLIMIT_NOFILE``)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1024
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


#: Sealed shards kept mapped by all row-frame leaves of the process together (read at
#: use): a quarter of ``vm.max_map_count`` (16,382 by default), which malloc and every
#: mapped file share. A shard is mapped when first read while the mappings are fewer, and
#: stays mapped until its file is replaced. Past it, a batch reads its frames of the other
#: shards with ``pread`` (:meth:`RowFrameReads._gather`), from files kept open up to
#: :data:`OPEN_SHARDS`, else opened for the batch: mapping and unmapping shards at every
#: batch cost several times the batch itself.
MAPPED_SHARDS = _budget(MAPPED_SHARDS_ENV, _max_map_count())
#: shard files past :data:`MAPPED_SHARDS` kept open by all leaves together (read at use):
#: a quarter of the process's file descriptors (``ulimit -n``)
OPEN_SHARDS = _budget(OPEN_SHARDS_ENV, _max_open_files())
_mapped = [0]  # shards mapped now, all leaves together
_kept_open = [0]  # shard files kept open now, all leaves together


def read_shard_index(data: Any, rows: int, where: str, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths (int64; -1 for a missing row) from a shard's index, checked.
    ``data``: the shard's bytes, or its last ones when ``size`` says the shard's size (a
    reader that fetches only the index)."""
    import google_crc32c

    need = index_bytes(rows)
    size = len(data) if size is None else size
    if size < need:
        raise CorruptBufferError(f"{where}: shard has {size} bytes, less than its index ({need})")
    tail = data[len(data) - need :]
    if len(tail) != need:
        raise CorruptBufferError(f"{where}: a shard index of {need} bytes expected, got {len(tail)}")
    raw = bytes(tail[: need - 4])
    crc = np.frombuffer(bytes(tail[need - 4 :]), "<u4")[0]
    if np.uint32(google_crc32c.value(raw)) != crc:
        raise CorruptBufferError(f"{where}: the shard index fails its CRC-32C check")
    index = np.frombuffer(raw, "<u8").reshape(rows, 2)
    missing = index[:, 0] == MISSING
    offsets = np.where(missing, -1, index[:, 0].astype(np.int64))
    lengths = np.where(missing, 0, index[:, 1].astype(np.int64))
    if np.any((offsets + lengths > size - need) & ~missing):
        raise CorruptBufferError(f"{where}: the shard index points past the frames")
    return offsets, lengths


def shard_limit(rows: int, row_bytes: int) -> int:
    """The largest a shard of ``rows`` frames can be: a frame is at most a little larger
    than its row (the lz4 and zstd bounds), then the index."""
    return rows * (row_bytes + row_bytes // 128 + 64) + index_bytes(rows)


def index_bytes(rows: int) -> int:
    """Bytes of a shard's index and its CRC: the last bytes of the shard."""
    return rows * 16 + 4


def staging_bytes(segment_steps: int, num_envs: int, row_bytes: int) -> int:
    return HEADER_BYTES + segment_steps * num_envs * row_bytes


class RowFrameReads(TakenLeaf):
    """The read side of a row-frame leaf (:class:`.row_frames.RowFrameLeaf`, which sets
    its shape, codec and frames, and a writer's rows written ahead of staging): its shard
    index in memory, its shards mapped or open, and :meth:`take`."""

    def _open_reads(self, source: ByteSource, rel: str, chunk_key: Callable[[int], str], writable: bool) -> None:
        """Where the leaf's objects are (``rel``: its array, ``chunk_key``: a segment's
        shard in it), and the staging segment, mapped from a local folder."""
        self.source, self.rel, self.chunk_key = source, rel, chunk_key
        self.staging_key = f"{rel}/{STAGING_FILE}"
        # the in-memory shard index: offset and length of every row's frame (-1: unknown)
        self.offsets = np.full(self.capacity * self.num_envs, -1, np.int64)
        self.lengths = np.zeros(self.capacity * self.num_envs, np.int64)
        self.mapped = np.zeros(self.nseg, bool)
        #: segment -> version of the shard its index in memory came from (a file's inode,
        #: size and mtime; an object's ETag): a shard read again is indexed again only if
        #: it was replaced since
        self.indexed: dict[int, Hashable] = {}
        self.shards: OrderedDict[int, mmap.mmap | bytes] = OrderedDict()
        #: the mapped shards by segment (None: not mapped), then a batch's frames read by
        #: range; handed whole to the decoder, which reads only those a batch's frames are in
        self.buffers: list[Any] = [None] * (self.nseg + 1)
        self.keys: dict[int, str] = {}  # segment -> its shard's key, worked out when first read
        #: segment -> handle of a shard read by range, kept (local files: up to OPEN_SHARDS)
        self.files: dict[int, Handle] = {}
        #: segments without a shard yet, until staging moves on or a refresh
        self.absent: set[int] = set()
        #: whether a batch's frames are likely out of memory (a cold batch reads a page
        #: per frame at least): then their pages are asked for together before decoding
        self.disk_reads = DiskReads(mmap.PAGESIZE)
        self.seen = (-1, -1)  # the staging (seq, segment) of the last read
        self.mm: mmap.mmap | None = None
        self.header: np.ndarray | None = None
        self.staged: np.ndarray | None = None
        if not source.local:  # fetched per batch: a store in object storage is read-only
            return
        staging = source.where(self.staging_key)
        what = f"the staging file of {self.where}"
        self.mm = source.map(self.staging_key, writable, staging_bytes(self.seg, self.num_envs, self.row_bytes), what)
        if self.mm is None or self.mm[: len(STAGING_MAGIC)] != STAGING_MAGIC:
            raise CorruptBufferError(f"{staging}: not a staging file of {self.where} (bad magic)")
        self.header = np.ndarray(4, "<i8", buffer=self.mm, offset=len(STAGING_MAGIC))
        self.staged = np.ndarray((self.seg_rows, self.row_bytes), np.uint8, buffer=self.mm, offset=HEADER_BYTES)

    def _header(self) -> tuple[int, int, int, int]:
        seq, segment, base, filled = (int(x) for x in self.header)
        return seq, segment, base, filled

    def shard_key(self, k: int) -> str:
        """Segment ``k``'s shard (zarr's chunk key, worked out once)."""
        key = self.keys.get(k)
        if key is None:
            key = self.keys[k] = f"{self.rel}/{self.chunk_key(k)}"
        return key

    def shard_path(self, k: int) -> str:
        return self.source.where(self.shard_key(k))

    # --- reading a batch ------------------------------------------------------------

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows by flat id ``slot * num_envs + env`` (ids past the ring's end wrap), as a
        new array: rows of the staging segment are copied raw, the others decoded."""
        return self.source.run(self.take_async(rows))

    def take_into(self, rows: np.ndarray, out: np.ndarray, permute: tuple[int, int, int] | None = None) -> None:
        """:meth:`take` into ``out`` (uint8 ``[rows.size, row_bytes]``, C-contiguous), each
        row written transposed as ``permute`` says (:func:`mmreplay.read.layout.gather_rows`)."""
        self.source.run(self._take_into(rows, out, permute))

    async def take_async(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        out = np.empty((rows.size, self.row_bytes), np.uint8)
        await self._take_into(rows, out)
        return out.view(self.dtype).reshape(rows.shape + self.tail)

    async def _take_into(self, rows: np.ndarray, out: np.ndarray, permute: tuple[int, int, int] | None = None) -> None:
        flat = np.asarray(rows, np.int64).reshape(-1) % (self.capacity * self.num_envs)
        if flat.size:
            for _ in range(READ_TRIES):
                try:
                    seq = await self._gather(flat, out, permute)
                except ObjectChanged as exc:  # a push replaced a shard while it was read
                    self._forget(exc.handle)
                    continue
                if self.header is None or seq == int(self.header[0]):  # staging did not move on while read
                    break
            else:
                raise CorruptBufferError(f"{self.where}: its staging segment or shards kept changing while read")

    def _put_raw(self, out: np.ndarray, mask: np.ndarray, source: np.ndarray, permute: tuple[int, int, int] | None) -> None:
        """Rows ``mask`` of ``out`` from raw rows ``source`` (staged or written ahead)."""
        if permute is None or permute[0] == 1:
            out[mask] = source
            return
        laid_out = np.empty_like(source)
        gather_rows(source, self.row_bytes, 0, np.arange(len(source)), laid_out, *permute)
        out[mask] = laid_out

    async def _gather(self, flat: np.ndarray, out: np.ndarray, permute: tuple[int, int, int] | None = None) -> int:
        await self._dictionary()
        seq, segment, base, filled, staging = await self._staging_header()
        if (seq, segment) != self.seen:
            # the segment staged before may have been sealed since: its shard is new
            if self.seen[1] >= 0:
                self._drop(self.seen[1])
            self.absent.clear()
            self.seen = (seq, segment)
        wanted = np.unique(flat // self.seg_rows).tolist()
        where = None  # rows of ``out`` the frames go to: all of them, unless some are raw
        raw = None  # rows copied raw: staged, or a writer's rows written ahead
        staged_at = None  # rows of a staging object to fetch with the frames
        if segment >= 0 and filled > base:
            first = segment * self.seg_rows
            staged = (flat >= first + base * self.num_envs) & (flat < first + filled * self.num_envs)
            if staged.any():
                if self.staged is not None:
                    self._put_raw(out, staged, self.staged[flat[staged] - first], permute)
                else:
                    staged_at = (staged, flat[staged] - first)
                raw = staged
        if self.ahead_segment >= 0:
            first = self.ahead_segment * self.seg_rows
            ahead = (flat >= first) & (flat < first + self.ahead_filled * self.num_envs)
            if ahead.any():
                self._put_raw(out, ahead, self.ahead[flat[ahead] - first], permute)  # type: ignore[index]
                raw = ahead if raw is None else raw | ahead
        if raw is not None:
            where = np.flatnonzero(~raw)
            flat = flat[where]
        segments = flat // self.seg_rows
        opened: dict[int, Handle] = {}  # shards read by range in this batch only
        try:
            # every segment of the batch, its staged one too: an object store fetches the
            # indexes with no round trip more
            await self._index(wanted, set(np.unique(segments).tolist()), opened)
            offsets = self.offsets[flat]
            if (offsets < 0).any():
                i = int(np.flatnonzero(offsets < 0)[0])
                bad, k = int(flat[i]), int(segments[i])
                raise CorruptBufferError(
                    f"{self.where}: row {bad} (slot {bad // self.num_envs}, env {bad % self.num_envs}) "
                    f"is not in shard {self.shard_path(k)}: it holds committed steps; see `mmreplay verify`"
                )
            lengths = self.lengths[flat]
            which = segments.astype(np.int32)
            cold = self.disk_reads.cold(flat.size)
            if cold:
                self._willneed(segments, offsets, lengths)
            read = ~self.mapped[segments]
            if read.any() or staged_at is not None:
                which[read] = self.nseg  # the batch's buffer of frames read by range
                offsets[read] = await self._read_frames(
                    segments[read], offsets[read], lengths[read], opened, staging, staged_at, out, cold, permute
                )
        finally:
            for handle in opened.values():
                handle.close()
        if flat.size == 0:
            self.buffers[self.nseg] = None
            return seq
        if where is None:
            where = np.arange(flat.size)
        batch = native_rows.FrameBatch(self.buffers, which, where, offsets, lengths)
        try:
            self.frames.decode(batch, out, permute)
        except CorruptBufferError:
            raise
        except Exception as exc:
            k = self._undecodable(batch, segments, out)
            raise CorruptBufferError(
                f"{self.where}: a row frame of shard {self.shard_path(k)} (segment {k}) does not decode: {exc}; "
                "see `mmreplay verify`"
            ) from exc
        finally:
            self.buffers[self.nseg] = None
            while self.shards and _mapped[0] > MAPPED_SHARDS:  # the budget was lowered
                self._unmap(next(iter(self.shards)))
            while self.files and _kept_open[0] > OPEN_SHARDS:
                self._close_file(next(iter(self.files)))
        return seq

    def _undecodable(self, batch: native_rows.FrameBatch, segments: np.ndarray, out: np.ndarray) -> int:
        """The segment of a batch that did not decode whose frames do not (for the error:
        the batch's frames are decoded again, a shard at a time)."""
        for k in np.unique(segments).tolist():
            mine = segments == k
            try:
                self.frames.decode(native_rows.FrameBatch(batch.buffers, *(a[mine] for a in batch[1:])), out)
            except Exception:
                return k
        return int(segments[0])

    async def _staging_header(self) -> tuple[int, int, int, int, Handle | None]:
        """(seq, segment, base, filled) of staging, and the handle of a staging object."""
        if self.header is not None:
            return (*self._header(), None)
        handle = self.source.handle(self.staging_key)
        head = np.empty(HEADER_BYTES, np.uint8)
        (got,) = await self.source.read_ranges([(handle, 0, HEADER_BYTES)], head)
        where = self.source.where(self.staging_key)
        if got is None:
            raise CorruptBufferError(f"{where}: the staging file of {self.where} is missing")
        if got < HEADER_BYTES or head[: len(STAGING_MAGIC)].tobytes() != STAGING_MAGIC:
            raise CorruptBufferError(f"{where}: not a staging file of {self.where} (bad magic)")
        seq, segment, base, filled = np.frombuffer(head, "<i8", 4, len(STAGING_MAGIC)).tolist()
        return seq, segment, base, filled, handle

    async def _dictionary(self) -> None:
        """Load the trained zstd dictionary once it is there (the writer may have trained
        it since; frames before it decode without it)."""
        if not self.codec.dictionary or self.frames.dictionary is not None:
            return
        try:
            handle = self.source.handle(self.frames.dictionary_key)
        except FileNotFoundError:
            return
        try:
            raw = np.empty(DICTIONARY_LIMIT + 1, np.uint8)
            (got,) = await self.source.read_ranges([(handle, 0, len(raw))], raw)
        finally:
            handle.close()
        if got is not None:
            if got > DICTIONARY_LIMIT:
                where = self.source.where(handle.key)
                raise CorruptBufferError(f"{where}: more than the {DICTIONARY_LIMIT} bytes a zstd dictionary can be")
            self.frames.use_dictionary(raw[:got].tobytes())

    async def _index(self, wanted: list[int], needed: set[int], opened: dict[int, Handle]) -> None:
        """Have the shard index of each segment of ``wanted`` in memory (from the shard it
        is read from), in segment order: a mapped shard's is; a shard kept open or opened
        now is indexed again if it is not the one indexed. Shards opened now are mapped
        while the mappings are fewer than the budget, else kept (local files: while they
        are fewer than theirs) or read for this batch only (``opened``). A missing shard
        of ``needed`` (a segment with rows outside staging) is damage."""
        fresh: list[tuple[int, Handle]] = []
        to_map = []
        for k in wanted:
            if self.mapped[k] or k in self.absent:
                continue
            handle = self.files.get(k)
            if handle is None:
                try:
                    handle = self.source.handle(self.shard_key(k))
                except FileNotFoundError:
                    self._missing(k, needed)
                    continue
                if handle.mappable and _mapped[0] + len(to_map) < MAPPED_SHARDS:
                    to_map.append(k)
                    opened[k] = handle
                elif not handle.scarce or _kept_open[0] < OPEN_SHARDS:
                    self.files[k] = handle
                    _kept_open[0] += handle.scarce
                else:
                    opened[k] = handle
            if handle.version is None or self.indexed.get(k) != handle.version:
                fresh.append((k, handle))
        if fresh:
            need = index_bytes(self.seg_rows)
            tails = np.empty((len(fresh), need), np.uint8)
            got = await self.source.read_ranges([(h, -need, 0) for _, h in fresh], tails, advise=True)
            for (k, handle), size, tail in zip(fresh, got, tails):
                if size is None:  # an object found missing at its first read
                    self._close_file(k)
                    self._missing(k, needed)
                    continue
                assert handle.size is not None
                where = f"{self.where}: {self.shard_path(k)}"
                offsets, lengths = read_shard_index(tail[:size], self.seg_rows, where, handle.size)
                lo = k * self.seg_rows
                n = min(self.seg_rows, len(self.offsets) - lo)
                self.offsets[lo : lo + n] = offsets[:n]
                self.lengths[lo : lo + n] = lengths[:n]
                self.indexed[k] = handle.version
        for k in to_map:
            handle = opened.pop(k)
            try:
                buf = handle.map()
            finally:
                handle.close()
            self.mapped[k] = True
            self.shards[k] = self.buffers[k] = buf
            _mapped[0] += 1

    def _missing(self, k: int, needed: set[int]) -> None:
        if k in needed:
            raise CorruptBufferError(
                f"{self.where}: shard {self.shard_path(k)} (segment {k}) holds committed steps but is missing; "
                "see `mmreplay verify`"
            )
        self.absent.add(k)

    async def _read_frames(
        self,
        segments: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        opened: dict[int, Handle],
        staging: Handle | None,
        staged_at: tuple[np.ndarray, np.ndarray] | None,
        out: np.ndarray,
        cold: bool,
        permute: tuple[int, int, int] | None,
    ) -> np.ndarray:
        """Read the frames at ``offsets`` of the unmapped shards ``segments`` into one
        buffer, the slot after the shards' in :attr:`buffers`: one range per run of frames
        fewer than the source's ``gap_bytes`` apart in a shard; rows of a staging object
        (``staged_at``: which rows of ``out``, and where in staging) in the same requests.
        The frames' offsets in that buffer."""
        order = np.lexsort((offsets, segments))
        seg, start = segments[order], offsets[order]
        end = start + lengths[order]
        # frames of a shard do not overlap (a row twice in a batch: the same frame twice),
        # so in this order each frame's end is the largest of its shard so far
        firsts, run_start, run_end, run = coalesce(seg, start, end, self.source.gap_bytes)
        ranges = [
            (self.files.get(k) or opened[k], a, b)
            for k, a, b in zip(seg[firsts].tolist(), run_start.tolist(), run_end.tolist())
        ]
        raw_bytes = 0
        if staged_at is not None:
            assert staging is not None
            positions = staged_at[1]
            lo, hi = int(positions.min()), int(positions.max()) + 1
            raw_bytes = (hi - lo) * self.row_bytes
            ranges.insert(0, (staging, HEADER_BYTES + lo * self.row_bytes, HEADER_BYTES + hi * self.row_bytes))
        run_at = np.concatenate(([raw_bytes], raw_bytes + np.cumsum(run_end - run_start)))
        buf = np.empty(int(run_at[-1]), np.uint8)
        got = await self.source.read_ranges(ranges, buf, advise=cold)
        if staged_at is not None:
            if got[0] != raw_bytes:
                raise CorruptBufferError(f"{self.source.where(self.staging_key)}: staging ends before its rows")
            self._put_raw(out, staged_at[0], buf[:raw_bytes].reshape(-1, self.row_bytes)[positions - lo], permute)
            got = got[1:]
        for k, a, b, n in zip(seg[firsts].tolist(), run_start.tolist(), run_end.tolist(), got):
            if n != b - a:
                at = "is missing" if n is None else f"ended at byte {a + n}"
                raise CorruptBufferError(
                    f"{self.where}: shard {self.shard_path(k)} (segment {k}) {at}, "
                    f"before the frames its index gives (up to byte {b}); see `mmreplay verify`"
                )
        self.buffers[self.nseg] = buf
        placed = np.empty_like(offsets)
        placed[order] = start - run_start[run] + run_at[run]
        return placed

    def _willneed(self, segments: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Ask the kernel for the pages of a batch's frames in mapped shards, all at once
        (``MADV_WILLNEED``), one call per run of touching pages: from the disk, the
        decoder would otherwise fault them in one synchronous read at a time. (Frames
        read by range are asked for by the byte source.)"""
        mapped = self.mapped[segments]
        segments, offsets, lengths = segments[mapped], offsets[mapped], lengths[mapped]
        if not len(segments):
            return
        page = mmap.PAGESIZE
        order = np.lexsort((offsets, segments))
        seg = segments[order]
        first = offsets[order] // page
        end = (offsets[order] + lengths[order] - 1) // page + 1
        firsts, run_start, run_end, _ = coalesce(seg, first, end, 1)  # pages that touch: one run
        for k, a, b in zip(seg[firsts].tolist(), run_start.tolist(), run_end.tolist()):
            shard = self.shards.get(k)
            try:
                if isinstance(shard, mmap.mmap):
                    shard.madvise(mmap.MADV_WILLNEED, a * page, min((b - a) * page, len(shard) - a * page))
            except (OSError, ValueError, AttributeError):
                return  # no such advice here, or the mapping went: the decoder faults them in

    # --- what is kept ------------------------------------------------------------------

    def _drop(self, k: int) -> None:
        """Forget segment ``k``'s shard: it was replaced, or may have been."""
        self.indexed.pop(k, None)
        self.absent.discard(k)
        self._unmap(k)
        self._close_file(k)

    def _forget(self, handle: Handle) -> None:
        """A shard read through ``handle`` was replaced: read it again."""
        for k, kept in list(self.files.items()):
            if kept is handle:
                self._drop(k)

    def _unmap(self, k: int) -> None:
        if k not in self.shards:
            return
        buf = self.shards.pop(k)
        _mapped[0] -= 1
        self.mapped[k] = False
        self.buffers[k] = None
        if isinstance(buf, mmap.mmap):
            with contextlib.suppress(BufferError):  # a decode still holds a view; the mapping closes with it
                buf.close()

    def _close_file(self, k: int) -> None:
        handle = self.files.pop(k, None)
        if handle is not None:
            _kept_open[0] -= handle.scarce
            handle.close()

    def invalidate(self, slots: Iterable[tuple[int, int]]) -> None:
        """A reader's refresh: shards of the segments with new rows were replaced."""
        for a, b in slots:
            for k in range(a // self.seg, (b - 1) // self.seg + 1):
                self._drop(k)

    def close_reads(self) -> None:
        """Let go of every shard mapped or open."""
        for k in [*self.shards, *self.files]:
            self._drop(k)
        self.frames.close()
