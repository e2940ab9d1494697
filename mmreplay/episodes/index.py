"""The episode index of one store: its end records, in step with the committed window.

The writer scans only the steps each commit adds (the role leaves are one byte or so
per row) and appends their records to the index file
(:mod:`mmreplay.episodes.index_file`) before the state that commits them. A buffer
without the file (written by another tool, or the file deleted) rebuilds it by scanning
the role leaves of the retained steps once. Readers load the records below their
committed end, so the episodes they see always match their committed window.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from ..errors import CorruptBufferError
from ..hooks import WriteHook
from ..io.local import open_inside
from .ends import SCAN_STEPS, EndRule, EpisodeSource
from .index_file import (
    BOUNDARY,
    COMPACT_MIN_RECORDS,
    HEADER_BYTES,
    INDEX_FILE,
    MAGIC,
    RECORD,
    IndexFile,
    append_records,
    cat_records,
    index_limit,
    index_problems,
    parse_index,
    same_records,
    write_index,
)
from .spans import Spans, advanced, from_records, joined, moved_start, open_streams, running_tails

log = logging.getLogger(__name__)


class EpisodeIndex:
    """The end records of one store, in memory and (for stores with end roles) on disk."""

    def __init__(self, store: EpisodeSource):
        self.folder = store.path  # (a writer's: it writes the file in place)
        self.source = store.source
        self.path = self.source.where(INDEX_FILE)
        self.rule = EndRule(store)
        self.writable = store.mode == "a"
        self.capacity = store.capacity
        self.num_envs = store.num_envs
        self.fsync = store.metadata.durability == "power"
        self.buf = np.zeros(0, RECORD)
        self.n = 0
        self.origin: int | None = None  # None: nothing loaded yet
        self.generation: bytes | None = None
        self.parsed = HEADER_BYTES  # file bytes read into memory so far (readers)
        self.synced: Any = None  # the committed state the records were last synced to
        self.fd: int | None = None  # the writer's append handle
        self.file_records = 0
        self.appending = False  # from a commit's first append until its records are counted
        self.compact_at = COMPACT_MIN_RECORDS
        self.scan_mode = False  # no file: records come from scanning the role leaves
        self.covered = 0  # scan mode: steps below this were scanned
        self.version = 0
        # (window key, its spans, what they were derived from, each env's running last span)
        self._cache: tuple[Any, Spans, Any, Any] | None = None
        self._base_cache: tuple[Any, int, Spans] | None = None  # spans of the committed steps
        self._pending: tuple[Any, int, np.ndarray] | None = None  # records of uncommitted steps

    @property
    def has_ends(self) -> bool:
        return self.rule.kind is not None

    @property
    def records(self) -> np.ndarray:
        return self.buf[: self.n]

    # --- memory -------------------------------------------------------------------

    def _append_memory(self, rec: np.ndarray) -> None:
        need = self.n + len(rec)
        if need > len(self.buf):
            grown = np.zeros(max(need, 2 * len(self.buf), 1024), RECORD)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : need] = rec
        self.n = need
        self.version += 1

    def _set_memory(self, rec: np.ndarray) -> None:
        self.buf = np.array(rec, RECORD)
        self.n = len(rec)
        self.version += 1

    def _scan(self, lo: int, hi: int) -> np.ndarray:
        """End records of steps ``[lo, hi)``, read from the role leaves."""
        if hi - lo <= SCAN_STEPS:  # a commit's steps: one block
            return self.rule.records(np.arange(lo, hi, dtype=np.int64))
        return cat_records(self.rule.scan(lo, hi))

    # --- file ---------------------------------------------------------------------

    def _read_file(self) -> IndexFile | None:
        """The file as read, None if absent or bad."""
        try:
            raw = self.source.read(INDEX_FILE, index_limit(self.capacity, self.num_envs), "an episode index")
        except FileNotFoundError:
            return None
        except CorruptBufferError as exc:  # a link, a FIFO, a file too large: never read
            log.warning("%s; rebuilding the episode index from the role leaves", exc)
            return None
        found = parse_index(raw)
        if found is None:
            log.warning(
                "%s: not an episode index (bad header); rebuilding it from the role leaves", self.path
            )
            return None
        if index_problems(found.origin, found.records, self.num_envs):
            log.warning("%s: episode index is inconsistent; rebuilding it from the role leaves", self.path)
            return None
        return found

    def _rewrite(self, origin: int, rec: np.ndarray) -> None:
        """Replace the file atomically with these records, reopen the append handle, and
        hold the same records in memory."""
        self.close()
        generation = write_index(self.path, origin, rec, self.fsync)
        self._open_append(IndexFile(origin, generation, rec, HEADER_BYTES + RECORD.itemsize * len(rec)))
        self._set_memory(rec)

    def _open_append(self, file: IndexFile) -> None:
        """Open the file to append after its whole records (a torn last one is cut off)."""
        self.fd = open_inside(self.folder, INDEX_FILE, os.O_WRONLY | os.O_APPEND)
        if file.nbytes != os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, file.nbytes)
        self.origin, self.generation = file.origin, file.generation
        self.file_records = len(file.records)
        self.appending = False
        self.compact_at = max(COMPACT_MIN_RECORDS, 2 * len(file.records))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    # --- writer -------------------------------------------------------------------

    def _open_writer(self, end: int, first: int) -> None:
        """Load the file for the committed window ``[first, end)``, or rebuild it.

        Records past ``end`` (a writer killed between its append and its state write)
        are dropped by rewriting the file, so readers that parsed them notice (the
        generation changes); a torn last record is cut off in place.
        """
        found = self._read_file()
        if found is not None and found.origin > first:
            found = None  # made for a commit that failed before its state (a full disk): rebuild
        if found is None:
            self._rewrite(first, self._scan(first, end))
        else:
            keep = int(np.searchsorted(found.records["step"], end, side="left"))
            if keep < len(found.records):
                self._rewrite(found.origin, found.records[:keep])
            else:
                self._open_append(found)
                self._set_memory(found.records)
        if end > first:  # a writer killed after rewriting an end but before the index did
            self._rescan(np.array([end - 1]), first)

    def commit(self, old_end: int, new_end: int, first: int, fsync: bool) -> None:
        """Record the ends of the steps ``[old_end, new_end)`` about to be committed.

        Called by the writer before it writes the state that commits them.
        """
        if not self.has_ends:
            return
        if self.fd is None:
            self._open_writer(old_end, first)
        # steps before `first` are not retained (the ring or an extend cut short reused
        # their slots): their rows are another step's, so they have no ends to record
        lo = max(old_end, new_end - self.capacity, first)
        if self.n and self.buf["step"][self.n - 1] >= lo:
            # an earlier commit appended these steps, then failed before its state write
            keep = self.records[self.records["step"] < lo]
            self._rewrite(self.origin or 0, keep)
        elif self.appending:
            # an append cut short (a full disk) or interrupted before the records were
            # counted (Ctrl-C, SIGTERM): cut what it wrote, so it is not there twice
            size = HEADER_BYTES + RECORD.itemsize * self.file_records
            if os.fstat(self.fd).st_size != size:
                os.ftruncate(self.fd, size)
            self.appending = False
        rec = self._scan(lo, new_end)
        if len(rec):
            self.appending = True
            append_records(self.fd, rec, self.path)
            self._append_memory(rec)
            self.file_records += len(rec)
            self.appending = False
        if fsync and len(rec):
            os.fsync(self.fd)
        if self.file_records > self.compact_at:
            self._compact(max(first, new_end - self.capacity))

    def _compact(self, first: int) -> None:
        rec = self.records
        keep = rec[rec["step"] >= first - 1]
        if len(keep) * 2 <= len(rec):
            self._rewrite(max(self.origin or 0, first - 1), keep)
        else:
            self.compact_at = 2 * len(rec)

    def rescan(self, store: EpisodeSource, steps: np.ndarray) -> None:
        """After ``set`` rewrote committed steps: re-read their ends and rewrite the file."""
        if not self.has_ends:
            return
        self.sync(store)
        self._rescan(np.unique(np.asarray(steps, np.int64)), store.first_step)

    def _rescan(self, steps: np.ndarray, first: int) -> None:
        """Re-read the ends of ``steps`` (sorted, unique) and rewrite the file if they changed."""
        if not len(steps):
            return
        rec = self.records
        fresh = self.rule.records(steps)
        lo, hi = np.searchsorted(rec["step"], [steps[0], steps[-1] + 1])
        if same_records(rec[lo:hi][np.isin(rec["step"][lo:hi], steps)], fresh):
            return  # no end changed: the common case, and it costs no file write
        kept = rec[~np.isin(rec["step"], steps)]
        merged = cat_records([kept, fresh])
        merged = merged[np.lexsort((merged["env"], merged["step"]))]
        self._rewrite(self.origin if self.origin is not None else first, merged)

    # --- readers and queries --------------------------------------------------------

    def sync(self, store: EpisodeSource) -> None:
        """Bring the records up to the store's committed window."""
        if not self.has_ends:
            return
        state = store.state
        if state is self.synced:
            return
        if self.writable:
            if self.fd is None:
                self._open_writer(state.end, store.first_step)
            self.synced = state
            return
        if self.scan_mode and self.source.exists(INDEX_FILE):
            # a writer's first commit made the file since: it alone records the ends a
            # writer rewrites (set, a resume's marks), which scanning new steps misses
            self.scan_mode = False
            self._reload(store)
        elif self.scan_mode:
            self._scan_up_to(store)
        else:
            self._read_new(store)
        self.synced = state

    def _read_new(self, store: EpisodeSource) -> None:
        if not self.source.local:  # an object is replaced whole by each push: read it whole
            self._reload(store)
            return
        try:
            handle = self.source.handle(INDEX_FILE)
        except (FileNotFoundError, CorruptBufferError):
            self._start_scan_mode(store)
            return
        try:
            head = handle.read_at(0, HEADER_BYTES)
            if self.origin is None or head[16:24] != self.generation or head[:8] != MAGIC:
                self._reload(store)
                return
            count = (handle.size - self.parsed) // RECORD.itemsize
            if count > 0:
                raw = handle.read_at(self.parsed, count * RECORD.itemsize)
                rec = np.frombuffer(raw, RECORD, len(raw) // RECORD.itemsize).copy()
                if len(rec) and self.n and rec["step"][0] < self.records["step"][-1]:
                    self._reload(store)  # not an append of what we have: read it whole
                    return
                self._append_memory(rec)
                self.parsed += len(rec) * RECORD.itemsize
        finally:
            handle.close()

    def _reload(self, store: EpisodeSource) -> None:
        found = self._read_file()
        if found is None:
            self._start_scan_mode(store)
            return
        self.origin, self.generation, self.parsed = found.origin, found.generation, found.nbytes
        self._set_memory(found.records)

    def _start_scan_mode(self, store: EpisodeSource) -> None:
        self.scan_mode = True
        first = store.first_step
        self.origin = first
        self._set_memory(self._scan(first, store.state.end))
        self.covered = store.state.end

    def _scan_up_to(self, store: EpisodeSource) -> None:
        end = store.state.end
        lo = max(self.covered, store.first_step)
        if lo > self.covered:  # steps were overwritten before we saw them
            self.origin = max(self.origin or 0, lo)
        if end > lo:
            self._append_memory(self._scan(lo, end))
        self.covered = max(self.covered, end)

    def spans(self, store: EpisodeSource) -> Spans:
        """Every episode span of the store's window (cached per window). A writer's
        steps not committed yet are scanned here; the file records them at commit.

        A writer asks after every step it adds, so nothing is computed twice: the spans
        of the committed steps once per commit (:meth:`_base`), the steps added since
        then scanned once each and joined on (:meth:`_with_tail`), and while no episode
        ends, the last window's spans moved to the new one (:func:`advanced`)."""
        self.sync(store)
        first, end = store.window[:2]
        key = (first, end, self.version, self.origin)
        cached = self._cache
        if cached is not None and cached[0] == key:
            return cached[1]
        if not self.has_ends:
            out, state = self._compute(first, end, self.records), None
        else:
            lo = max(min(store.state.end, end), first)
            pending = self._pending_records(lo, end)
            state = (self.version, self.origin, lo, len(pending))
            was = cached[0][:2] if cached is not None else None
            if cached is not None and cached[2] == state and cached[3] is not None and first >= was[0] and end >= was[1]:
                out = advanced(cached[1], was, (first, end), cached[3])
                if len(out) == len(cached[1]):  # none gone: each env's first and last span stay
                    self._cache = (key, out, state, cached[3])
                    return out
            else:
                out = self._base(first, lo)
                if end > lo:
                    out = self._with_tail(out, lo, end, pending)
        # each env's first and last span, when every env's last one runs up to the newest step
        ends = running_tails(out, self.num_envs, end) if state is not None else None
        self._cache = (key, out, state, ends)
        return out

    def _pending_records(self, lo: int, end: int) -> np.ndarray:
        """The end records of the steps ``[lo, end)`` not committed yet, each step scanned once."""
        if end <= lo:
            return np.zeros(0, RECORD)
        pending = self._pending
        if pending is None or pending[0] != (lo, self.version) or pending[1] > end:
            pending = (lo, self.version), lo, np.zeros(0, RECORD)
        if pending[1] < end:
            pending = pending[0], end, cat_records([pending[2], self._scan(pending[1], end)])
        self._pending = pending
        return pending[2]

    def _base(self, first: int, lo: int) -> Spans:
        """The spans of the committed steps ``[first, lo)``, from those of an earlier
        window that started at or before ``first``."""
        key = (self.version, self.origin, lo)
        cached = self._base_cache
        if cached is None or cached[0] != key or cached[1] > first:
            rec = self.records
            if self.n and self.buf["step"][self.n - 1] >= lo:
                rec = rec[rec["step"] < lo]  # set() rescanned steps not committed yet
            cached = self._base_cache = (key, first, self._compute(first, lo, rec))
        spans = moved_start(cached[2], cached[1], first)
        self._base_cache = (key, first, spans)  # the next window starts from here
        return spans

    def _with_tail(self, spans: Spans, lo: int, end: int, rec: np.ndarray) -> Spans:
        """``spans`` (of the steps before ``lo``) with the steps ``[lo, end)`` not
        committed yet, whose end records are ``rec``: their spans joined to each env's last."""
        steps = self.records["step"]
        a, b = np.searchsorted(steps, [lo - 1, lo])  # the ends at lo - 1 tell which envs start afresh at lo
        tail = self._compute(lo, end, cat_records([self.records[a:b], rec]))
        closed = rec["env"][(rec["step"] == lo) & (rec["code"] == BOUNDARY)].astype(np.int64)
        return joined(spans, tail, closed)

    def _compute(self, first: int, end: int, rec: np.ndarray) -> Spans:
        if not self.has_ends:
            return open_streams(first, end, self.num_envs)
        return from_records(rec, first, end, self.num_envs, self.origin)


class EpisodeHook(WriteHook):
    """The episode index as a write hook: the ends of committed steps reach its file
    before the state that commits them; ``set`` rescans the steps it rewrote. The index
    itself is made on first use."""

    def __init__(self, store: EpisodeSource):
        self.store = store

    def on_commit(self, old_end: int, new_end: int, fsync: bool) -> None:
        index_for(self.store).commit(old_end, new_end, self.store.first_step, fsync)

    def on_set(self, steps: np.ndarray) -> None:
        index_for(self.store).rescan(self.store, steps)


def index_for(store: EpisodeSource) -> EpisodeIndex:
    """The store's episode index, made on first use."""
    return store.part("episodes", EpisodeIndex)
