"""Episodes: where each env's episodes end, kept up to date at every commit.

Episode ends come from the role leaves (:mod:`mmreplay.roles`): ``terminated`` /
``truncated``; else TF-Agents ``next_step_type == LAST`` (terminated when ``discount`` is
0, truncated otherwise); else ``step_type == LAST`` when only ``step_type`` exists. With
both ``step_type`` and ``next_step_type``, a row with ``step_type == LAST`` is the
boundary row TF-Agents drivers write between episodes and belongs to no episode. Without
end roles each env's retained stream is one open episode.

The index is a list of end records ``(step, env, code)`` in step order. The writer scans
only the steps each commit adds (the role leaves are one byte or so per row) and appends
their records to ``episodes.idx`` before the state that commits them is written, so the
file always covers every committed step. The file is plain binary, never pickled:

- a 32-byte header: magic ``b"MMREPIX1"``, ``origin`` (int64 LE: records are complete
  for steps ``>= origin``), a random int64 generation (changes when the file is
  rewritten), 8 zero bytes;
- 16-byte records: step int64 LE, env int32 LE, code uint8 (1 terminated, 2 truncated,
  3 boundary), 3 zero bytes.

Appending keeps a commit cheap and the file survives reopen; records past the committed
end (a writer killed between the append and the state write) and a torn last record are
ignored by readers and cut off by the next writer. The file is rewritten (atomically,
temp file + rename) only to drop records the ring has overwritten, when they are more
than half of it, and after ``set`` changes an end. A buffer without the file (written by
another tool, or the file deleted) rebuilds it by scanning the role leaves of the
retained steps once. Readers load the records below their committed end, so the episodes
they see always match their committed window.

A writer that reopens a store resumes collection: the episodes the last writer left
open cannot go on (its environments are gone), so before the first step it writes, the
last committed step of each env whose episode is still open is marked truncated
(:func:`open_ends`), whether the last writer was killed or closed cleanly. The mark is
the ``truncated`` leaf set, or for TF-Agents trajectories ``next_step_type`` set to
``LAST`` (with a non-zero ``discount``: a time limit). A store without such a leaf
(only ``terminated`` / ``done``, only ``step_type``, or no end roles) cannot say
"cut short" without inventing a terminal state, so nothing is marked there and the
resumed env's first episode continues the open one.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .backends.base import disk_full_as
from .errors import CorruptBufferError
from .hooks import WriteHook
from .io import ByteSource
from .io.local import open_inside
from .metadata import Metadata, State, atomic_write
from .read.gather import check_retained
from .read.readable import Readable
from .roles import subtree
from .spec import leaf_paths, unflatten

__all__ = [
    "Episode",
    "EpisodeSpan",
    "EpisodeIndex",
    "INDEX_FILE",
    "index_for",
    "episode_bounds",
    "complete_spans",
    "episode_index",
    "episodes",
    "to_arrays",
    "continue_index",
    "fresh_envs",
    "open_ends",
]

log = logging.getLogger(__name__)

INDEX_FILE = "episodes.idx"
MAGIC = b"MMREPIX1"
HEADER_BYTES = 32
RECORD = np.dtype(
    {"names": ["step", "env", "code"], "formats": ["<i8", "<i4", "u1"], "offsets": [0, 8, 12], "itemsize": 16}
)
TERMINATED, TRUNCATED, BOUNDARY = 1, 2, 3
STATUS = {TERMINATED: "terminated", TRUNCATED: "truncated"}
LAST = 2  # TF-Agents StepType.LAST
SCAN_STEPS = 1 << 16  # steps per block when rebuilding from the role leaves
COMPACT_MIN_RECORDS = 1 << 16


class EpisodeSource(Readable, Protocol):
    """A store as the episode index reads it: the read path's view, the committed state
    and the roles that say where episodes end."""

    state: State  # the committed state (for a writer, its own newest commit)
    first_step: int
    roles: dict[str, str]
    leaf_paths: list[str]
    metadata: Metadata
    source: ByteSource  # where the episode index is read from


@dataclass(frozen=True)
class EpisodeSpan:
    """Where one episode lies: its env, first and last global step id (inclusive) and how
    it ended: ``"terminated"``, ``"truncated"`` or ``"open"`` (still running at the
    cursor, or its start was overwritten by the ring). ``ended`` is how its last step
    ended whether or not its start is retained: ``"terminated"``, ``"truncated"`` or
    ``"running"``."""

    env: int
    first_step: int
    last_step: int
    status: str
    ended: str = field(default="", compare=False)

    @property
    def length(self) -> int:
        return self.last_step - self.first_step + 1


@dataclass(frozen=True, eq=False)
class Episode:
    """One episode of one env with its data: a nest shaped like ``store.spec`` whose
    leaves are ``[length, *shape]`` arrays. ``ended`` is how its last step ended
    (``"terminated"``, ``"truncated"`` or ``"running"``), also when the ring overwrote its
    start (``status`` is then ``"open"``)."""

    env: int
    first_step: int
    last_step: int
    status: str
    data: Any = field(repr=False)
    ended: str = ""

    @property
    def length(self) -> int:
        return self.last_step - self.first_step + 1

    @property
    def span(self) -> EpisodeSpan:
        return EpisodeSpan(self.env, self.first_step, self.last_step, self.status, self.ended)

    def __repr__(self) -> str:
        return (
            f"Episode(env={self.env}, first_step={self.first_step}, last_step={self.last_step}, "
            f"length={self.length}, status={self.status!r})"
        )


# --- end detection ----------------------------------------------------------------


class EndRule:
    """Turns the role leaves' rows into end codes ``[n, num_envs]`` (0 where no end)."""

    def __init__(self, store: EpisodeSource):
        roles = store.roles
        index = {p: i for i, p in enumerate(store.leaf_paths)}
        self.leaves: dict[str, Any] = {}
        if "terminated" in roles or "truncated" in roles:
            wanted = ("terminated", "truncated")
            self.kind = "flags"
        elif "next_step_type" in roles:
            wanted = ("next_step_type", "discount", "step_type")
            self.kind = "next_step_type"
        elif "step_type" in roles:
            wanted = ("step_type", "discount")
            self.kind = "step_type"
        else:
            self.kind = None
            return
        for role in wanted:
            if role in roles and roles[role] in index:
                self.leaves[role] = store.leaves[index[roles[role]]]

    def codes(self, slots: np.ndarray, num_envs: int) -> np.ndarray:
        v = {role: leaf.read(slots).reshape(len(slots), num_envs) for role, leaf in self.leaves.items()}
        out = np.zeros((len(slots), num_envs), np.uint8)
        if self.kind == "flags":
            if "truncated" in v:
                out[v["truncated"] != 0] = TRUNCATED
            if "terminated" in v:
                out[v["terminated"] != 0] = TERMINATED  # terminated wins over truncated
            return out
        last = v["next_step_type" if self.kind == "next_step_type" else "step_type"] == LAST
        if "discount" in v:
            out[last] = np.where(v["discount"][last] == 0, TERMINATED, TRUNCATED)
        else:
            out[last] = TERMINATED
        if self.kind == "next_step_type" and "step_type" in v:
            out[v["step_type"] == LAST] = BOUNDARY
        return out


def open_ends(store: EpisodeSource) -> tuple[Any, int, np.ndarray] | None:
    """How a resuming writer ends the episodes left open (see the module docstring):
    ``(leaf, step, row)``, the end leaf, the last committed step and that leaf's new
    row ``[1, num_envs, *shape]``; None when no episode is open there or the store has
    no leaf that marks a truncation."""
    end = store.state.end
    if end == 0 or end - 1 < store.first_step:
        return None
    rule = EndRule(store)
    slot = np.array([(end - 1) % store.capacity])
    open_ = rule.codes(slot, store.num_envs)[0] == 0 if rule.kind is not None else None
    if open_ is None or not open_.any():
        return None
    if rule.kind == "flags" and "truncated" in rule.leaves:
        leaf, value = rule.leaves["truncated"], 1
    elif rule.kind == "next_step_type" and "discount" in rule.leaves:
        leaf, value = rule.leaves["next_step_type"], LAST
        open_ &= rule.leaves["discount"].read(slot).reshape(store.num_envs) != 0
    else:
        leaf = None
    if leaf is None or not open_.any():
        log.info(
            "%s: envs %s end in an open episode that this store cannot mark truncated; the steps written "
            "next continue it", store.path, np.flatnonzero(open_).tolist(),
        )
        return None
    row = np.array(leaf.read(slot))
    row.reshape(1, store.num_envs, -1)[0, open_] = value
    return leaf, end - 1, row


# --- the index --------------------------------------------------------------------


@dataclass(frozen=True)
class Spans:
    """Episode spans as arrays, env by env, each env's in time order.

    ``code`` is how the span really ended (0 still running); ``cut`` marks a first span
    whose beginning the ring overwrote. Both make the status ``"open"`` when set/zero.
    """

    env: np.ndarray
    first: np.ndarray
    last: np.ndarray
    code: np.ndarray
    cut: np.ndarray

    def __len__(self) -> int:
        return len(self.env)

    @property
    def length(self) -> np.ndarray:
        return self.last - self.first + 1

    @property
    def complete(self) -> np.ndarray:
        return (self.code > 0) & ~self.cut

    def status(self, i: int) -> str:
        return STATUS[int(self.code[i])] if self.code[i] and not self.cut[i] else "open"

    def ended(self, i: int) -> str:
        return STATUS[int(self.code[i])] if self.code[i] else "running"

    def select(self, mask: np.ndarray) -> Spans:
        return Spans(self.env[mask], self.first[mask], self.last[mask], self.code[mask], self.cut[mask])


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate record arrays keeping the padded 16-byte layout (np.concatenate packs it)."""
    out = np.zeros(sum(len(p) for p in parts), RECORD)
    i = 0
    for p in parts:
        out[i : i + len(p)] = p
        i += len(p)
    return out


def _empty_spans() -> Spans:
    z = np.zeros(0, np.int64)
    return Spans(z, z, z, np.zeros(0, np.uint8), np.zeros(0, bool))


def _from(spans: Spans, was: int, first: int, heads: np.ndarray | None = None) -> Spans:
    """The spans of a window that starts at ``first`` instead of ``was`` (later): those that
    ended before it are gone, and the one each env is in at ``first`` lost its start (cut),
    unless it starts there. ``heads``: where each env's first span is, if known."""
    if first == was or not len(spans):
        return spans
    if heads is None:
        heads = np.flatnonzero(np.concatenate(([True], spans.env[1:] != spans.env[:-1])))
    if (spans.last[heads] < first).any():  # some are gone: a prefix of each env's spans
        ends = np.append(heads[1:], len(spans))
        kept = [(h + int(np.searchsorted(spans.last[h:e], first)), e) for h, e in zip(heads.tolist(), ends.tolist())]
        kept = [(a, e) for a, e in kept if a < e]
        if len(kept) == 1:
            a, e = kept[0]
            spans = Spans(spans.env[a:e], spans.first[a:e], spans.last[a:e], spans.code[a:e], spans.cut[a:e])
        else:
            spans = spans.select(np.concatenate([np.arange(a, e) for a, e in kept] or [np.zeros(0, np.int64)]))
        heads = np.cumsum([0] + [e - a for a, e in kept[:-1]])
    starts, cut = spans.first.copy(), spans.cut.copy()
    cut[heads] |= starts[heads] < first
    starts[heads] = np.maximum(starts[heads], first)
    return Spans(spans.env, starts, spans.last, spans.code, cut)


def _running_tails(spans: Spans, num_envs: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Where each env's first and last span are, if every env has spans and its last one
    is still running at ``end - 1``."""
    if not len(spans):
        return None
    change = spans.env[1:] != spans.env[:-1]
    tails = np.flatnonzero(np.append(change, True))
    if len(tails) != num_envs or (spans.code[tails] != 0).any() or (spans.last[tails] != end - 1).any():
        return None
    return np.flatnonzero(np.concatenate(([True], change))), tails


def _advanced(spans: Spans, was: tuple[int, int], now: tuple[int, int], ends: tuple[np.ndarray, np.ndarray]) -> Spans:
    """The spans of window ``now`` from those of the earlier window ``was``, when no step
    added since ended an episode and each env's last episode was running (``ends``: each
    env's first and last span): the running ones reach the newest step."""
    heads, tails = ends
    if now[1] != was[1]:
        last = spans.last.copy()
        last[tails] = now[1] - 1
        spans = Spans(spans.env, spans.first, last, spans.code, spans.cut)
    return _from(spans, was[0], now[0], heads)


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

    def _scan_steps(self, steps: np.ndarray) -> np.ndarray:
        """End records of these (ascending) steps, read from the role leaves."""
        codes = self.rule.codes(steps % self.capacity, self.num_envs)
        t, e = np.nonzero(codes)
        rec = np.zeros(len(t), RECORD)
        rec["step"], rec["env"], rec["code"] = steps[t], e, codes[t, e]
        return rec

    def _scan(self, lo: int, hi: int) -> np.ndarray:
        """End records of steps ``[lo, hi)``, in blocks so memory stays small."""
        parts = [
            self._scan_steps(np.arange(a, min(hi, a + SCAN_STEPS), dtype=np.int64))
            for a in range(lo, hi, SCAN_STEPS)
        ]
        return _cat(parts)

    # --- file ---------------------------------------------------------------------

    def _read_file(self) -> tuple[int, bytes, np.ndarray, int] | None:
        """``(origin, generation, records, bytes parsed)`` of the file, None if absent or bad."""
        try:
            raw = self.source.read(INDEX_FILE, index_limit(self.capacity, self.num_envs), "an episode index")
        except FileNotFoundError:
            return None
        except CorruptBufferError as exc:  # a link, a FIFO, a file too large: never read
            log.warning("%s; rebuilding the episode index from the role leaves", exc)
            return None
        if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
            log.warning(
                "%s: not an episode index (bad header); rebuilding it from the role leaves", self.path
            )
            return None
        origin = int(np.frombuffer(raw, "<i8", 1, 8)[0])
        count = (len(raw) - HEADER_BYTES) // RECORD.itemsize
        rec = np.frombuffer(raw, RECORD, count, HEADER_BYTES).copy()
        if not self._valid(rec, origin):
            log.warning("%s: episode index is inconsistent; rebuilding it from the role leaves", self.path)
            return None
        return origin, raw[16:24], rec, HEADER_BYTES + count * RECORD.itemsize

    def _valid(self, rec: np.ndarray, origin: int) -> bool:
        steps = rec["step"]
        return bool(
            origin >= 0
            and (len(rec) == 0 or (steps[0] >= origin - 1 and np.all(steps[1:] >= steps[:-1])))
            and np.all((rec["env"] >= 0) & (rec["env"] < self.num_envs))
            and np.all((rec["code"] >= TERMINATED) & (rec["code"] <= BOUNDARY))
        )

    def _write_file(self, origin: int, rec: np.ndarray) -> None:
        """Replace the file atomically with these records, and reopen the append handle."""
        self._close_fd()
        generation = _write_index(self.path, origin, rec, self.fsync)
        self.origin, self.generation = origin, generation
        self.file_records = len(rec)
        self.compact_at = max(COMPACT_MIN_RECORDS, 2 * len(rec))
        self.fd = open_inside(self.folder, INDEX_FILE, os.O_WRONLY | os.O_APPEND)

    def _close_fd(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self._close_fd()

    # --- writer -------------------------------------------------------------------

    def _open_writer(self, end: int, first: int) -> None:
        """Load the file for the committed window ``[first, end)``, or rebuild it.

        Records past ``end`` (a writer killed between its append and its state write)
        are dropped by rewriting the file, so readers that parsed them notice (the
        generation changes); a torn last record is cut off in place.
        """
        found = self._read_file()
        if found is not None and found[0] > first:
            found = None  # made for a commit that failed before its state (a full disk): rebuild
        if found is None:
            rec = self._scan(first, end)
            self._write_file(first, rec)
        else:
            origin, generation, rec, parsed = found
            keep = int(np.searchsorted(rec["step"], end, side="left"))
            if keep < len(rec):
                rec = rec[:keep]
                self._write_file(origin, rec)
            else:
                self.fd = open_inside(self.folder, INDEX_FILE, os.O_WRONLY | os.O_APPEND)
                if parsed != os.fstat(self.fd).st_size:
                    os.ftruncate(self.fd, parsed)
                self.origin, self.generation = origin, generation
                self.file_records = len(rec)
                self.compact_at = max(COMPACT_MIN_RECORDS, 2 * len(rec))
        self._set_memory(rec)
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
            self._write_file(self.origin or 0, keep)
            self._set_memory(keep)
        rec = self._scan(lo, new_end)
        if len(rec):
            try:
                _append(self.fd, rec.tobytes(), self.path)
            except BaseException:
                # cut a partial append, so a retried commit does not append it twice
                os.ftruncate(self.fd, HEADER_BYTES + RECORD.itemsize * self.file_records)
                raise
            self._append_memory(rec)
            self.file_records += len(rec)
        if fsync and len(rec):
            os.fsync(self.fd)
        if self.file_records > self.compact_at:
            self._compact(max(first, new_end - self.capacity))

    def _compact(self, first: int) -> None:
        rec = self.records
        keep = rec[rec["step"] >= first - 1]
        if len(keep) * 2 <= len(rec):
            self._write_file(max(self.origin or 0, first - 1), keep)
            self._set_memory(keep)
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
        fresh = self._scan_steps(steps)
        lo, hi = np.searchsorted(rec["step"], [steps[0], steps[-1] + 1])
        old = rec[lo:hi][np.isin(rec["step"][lo:hi], steps)]
        if len(old) == len(fresh) and all(np.array_equal(old[k], fresh[k]) for k in RECORD.names):
            return  # no end changed: the common case, and it costs no file write
        kept = rec[~np.isin(rec["step"], steps)]
        merged = _cat([kept, fresh])
        merged = merged[np.lexsort((merged["env"], merged["step"]))]
        self._write_file(self.origin if self.origin is not None else first, merged)
        self._set_memory(merged)

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
        if self.scan_mode:
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
        origin, generation, rec, parsed = found
        self.origin, self.generation, self.parsed = origin, generation, parsed
        self._set_memory(rec)

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
        ends, the last window's spans moved to the new one (:func:`_advanced`)."""
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
                out = _advanced(cached[1], was, (first, end), cached[3])
                if len(out) == len(cached[1]):  # none gone: each env's first and last span stay
                    self._cache = (key, out, state, cached[3])
                    return out
            else:
                out = self._base(first, lo)
                if end > lo:
                    out = self._with_tail(out, lo, end, pending)
        # each env's first and last span, when every env's last one runs up to the newest step
        ends = _running_tails(out, self.num_envs, end) if state is not None else None
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
            pending = pending[0], end, _cat([pending[2], self._scan(pending[1], end)])
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
        spans = _from(cached[2], cached[1], first)
        self._base_cache = (key, first, spans)  # the next window starts from here
        return spans

    def _with_tail(self, spans: Spans, lo: int, end: int, rec: np.ndarray) -> Spans:
        """``spans`` (of the steps before ``lo``) with the steps ``[lo, end)`` not
        committed yet, whose end records are ``rec``: their spans joined to each env's last."""
        steps = self.records["step"]
        a, b = np.searchsorted(steps, [lo - 1, lo])  # the ends at lo - 1 tell which envs start afresh at lo
        tail = self._compute(lo, end, _cat([self.records[a:b], rec]))
        # each env's first tail span that continues an episode running at lo - 1
        starts = np.r_[True, tail.env[1:] != tail.env[:-1]] & tail.cut if len(tail) else np.zeros(0, bool)
        last_of = np.searchsorted(spans.env, tail.env, side="right") - 1  # that env's last span before lo
        joins = starts & (last_of >= 0)
        joins[joins] = (spans.env[last_of[joins]] == tail.env[joins]) & (spans.code[last_of[joins]] == 0)
        code, last = spans.code.copy(), spans.last.copy()
        code[last_of[joins]], last[last_of[joins]] = tail.code[joins], tail.last[joins]
        # a boundary row at lo ends the episode running at lo - 1 and belongs to none
        closed = rec["env"][(rec["step"] == lo) & (rec["code"] == BOUNDARY)].astype(np.int64)
        at_lo = np.searchsorted(spans.env, closed, side="right") - 1
        closed, at_lo = closed[at_lo >= 0], at_lo[at_lo >= 0]
        at_lo = at_lo[spans.env[at_lo] == closed]
        code[at_lo[code[at_lo] == 0]] = TRUNCATED
        rest = tail.select(~joins)
        if not len(rest):
            return Spans(spans.env, spans.first, last, code, spans.cut)
        # the new spans go after their env's last one: one placement for every field
        new = np.searchsorted(spans.env, rest.env, side="right") + np.arange(len(rest))
        old = np.ones(len(spans) + len(rest), bool)
        old[new] = False

        def placed(kept: np.ndarray, added: np.ndarray) -> np.ndarray:
            out = np.empty(len(old), kept.dtype)
            out[old], out[new] = kept, added
            return out

        return Spans(
            placed(spans.env, rest.env),
            placed(spans.first, rest.first),
            placed(last, rest.last),
            placed(code, rest.code),
            placed(spans.cut, rest.cut),
        )

    def _compute(self, first: int, end: int, rec: np.ndarray) -> Spans:
        E = self.num_envs
        if end <= first:
            return _empty_spans()
        envs_all = np.arange(E, dtype=np.int64)
        if not self.has_ends:
            zeros = np.zeros(E, np.int64)
            return Spans(envs_all, zeros + first, zeros + end - 1, np.zeros(E, np.uint8), np.zeros(E, bool))
        steps = rec["step"]
        lo, mid, hi = np.searchsorted(steps, [first - 1, first, end], side="left")
        # Did the step before the window end an episode? Then the window starts a fresh one.
        fresh = np.zeros(E, bool)
        if first == 0:
            fresh[:] = True
        elif self.origin is not None and self.origin <= first - 1:
            fresh[rec["env"][lo:mid]] = True
        inside = rec[mid:hi]
        order = np.lexsort((inside["step"], inside["env"]))
        st = inside["step"][order].astype(np.int64)
        ev = inside["env"][order].astype(np.int64)
        cd = inside["code"][order]
        new_env = np.ones(len(st), bool)
        new_env[1:] = ev[1:] != ev[:-1]
        prev = np.empty(len(st), np.int64)
        prev[0:1] = first
        prev[1:] = st[:-1] + 1
        starts = np.where(new_env, first, prev)
        cut = new_env & ~fresh[ev]
        # The open tail of each env: after its last end, or the whole stream without ends.
        last_end = np.full(E, first - 1, np.int64)
        has_end = np.zeros(E, bool)
        if len(st):
            tails_idx = np.r_[np.flatnonzero(new_env)[1:] - 1, len(st) - 1]
            last_end[ev[tails_idx]] = st[tails_idx]
            has_end[ev[tails_idx]] = True
        tail = last_end + 1 <= end - 1
        t_env = envs_all[tail]
        env = np.r_[ev, t_env]
        first_a = np.r_[starts, last_end[tail] + 1]
        last_a = np.r_[st, np.full(len(t_env), end - 1, np.int64)]
        code = np.r_[cd, np.zeros(len(t_env), np.uint8)].astype(np.uint8)
        cut_a = np.r_[cut, ~has_end[tail] & ~fresh[tail]]
        # Boundary rows belong to no episode: drop them from the span they close.
        boundary = code == BOUNDARY
        if boundary.any():
            last_a = np.where(boundary, last_a - 1, last_a)
            code = np.where(boundary, TRUNCATED, code).astype(np.uint8)
            keep = last_a >= first_a
            env, first_a, last_a, code, cut_a = (
                env[keep],
                first_a[keep],
                last_a[keep],
                code[keep],
                cut_a[keep],
            )
        order = np.lexsort((first_a, env))
        return Spans(env[order], first_a[order], last_a[order], code[order], cut_a[order])


def index_limit(capacity: int, num_envs: int) -> int:
    """The largest an episode index file can be: a writer compacts it once it holds twice
    the records of a full ring, and a commit appends at most a ring's worth."""
    return HEADER_BYTES + RECORD.itemsize * (COMPACT_MIN_RECORDS + 4 * capacity * num_envs)


def _write_index(path: str, origin: int, rec: np.ndarray, fsync: bool) -> bytes:
    """Replace the index file atomically; returns its new generation."""
    generation = secrets.token_bytes(8)
    header = MAGIC + np.int64(origin).astype("<i8").tobytes() + generation + bytes(8)
    atomic_write(path, header + _cat([rec]).tobytes(), fsync)
    return generation


def _append(fd: int, data: bytes, path: str) -> None:
    """Append every byte (a torn last record is cut by the next writer)."""
    view = memoryview(data)
    with disk_full_as(f"{path}: no space left to record episode ends; nothing was committed"):
        while view:
            view = view[os.write(fd, view) :]


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


# --- queries ----------------------------------------------------------------------


def _select(store: EpisodeSource, env: int | None, complete_only: bool) -> Spans:
    store.check_open()
    spans = index_for(store).spans(store)
    if env is not None:
        if not isinstance(env, (int, np.integer)) or isinstance(env, bool) or not 0 <= env < store.num_envs:
            raise ValueError(f"env must be an int in [0, {store.num_envs}), got {env!r}")
        spans = spans.select(spans.env == env)
    if complete_only:
        spans = spans.select(spans.complete)
    return spans


def episode_index(store: EpisodeSource, env: int | None = None, complete_only: bool = False) -> list[EpisodeSpan]:
    """The :class:`EpisodeSpan` of each episode, as :func:`episodes` orders them, from
    the episode index alone (no data is read)."""
    spans = _select(store, env, complete_only)
    return [
        EpisodeSpan(
            int(spans.env[i]), int(spans.first[i]), int(spans.last[i]), spans.status(i), spans.ended(i)
        )
        for i in range(len(spans))
    ]


def episode_bounds(store: EpisodeSource, steps: np.ndarray, envs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first, last, complete)`` of the episode each row ``(steps[i], envs[i])`` of the
    window lies in: its first and last retained step, and whether it ended and its start
    is retained. A row in no episode (a TF-Agents boundary row) is its own one-step
    episode, not complete."""
    spans = index_for(store).spans(store)
    steps = np.asarray(steps, np.int64)
    envs = np.asarray(envs, np.int64)
    if not len(spans):
        return steps.copy(), steps.copy(), np.zeros(steps.shape, bool)
    blocks = np.searchsorted(spans.env, np.arange(store.num_envs + 1))  # env e's spans: blocks[e]:blocks[e + 1]
    i = np.full(steps.shape, -1, np.int64)
    for env in np.unique(envs).tolist():
        rows = envs == env
        a, b = blocks[env], blocks[env + 1]
        found = np.searchsorted(spans.first[a:b], steps[rows], side="right") - 1
        i[rows] = np.where(found >= 0, a + found, -1)
    j = np.maximum(i, 0)
    inside = (i >= 0) & (spans.last[j] >= steps)
    first = np.where(inside, spans.first[j], steps)
    last = np.where(inside, spans.last[j], steps)
    return first, last, inside & (spans.code[j] > 0) & ~spans.cut[j]


def complete_spans(store: EpisodeSource) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(envs, first, last)``: for each env with complete episodes, the first step of its
    first complete one and the last step of its last. They are consecutive: only an env's
    first episode may have lost its start, only its last be still running (TF-Agents
    boundary rows between them belong to none)."""
    spans = index_for(store).spans(store)
    blocks = np.searchsorted(spans.env, np.arange(store.num_envs + 1))
    a, b = blocks[:-1], blocks[1:] - 1  # each env's first and last span (a > b: none)
    has = a <= b
    a, b = np.where(has, a, 0), np.where(has, b, 0)
    if len(spans):
        a = a + ~((spans.code[a] > 0) & ~spans.cut[a])  # its first span, unless cut or running
        b = b - (spans.code[b] == 0)  # its last, unless running
    has &= a <= b
    envs = np.flatnonzero(has)
    return envs, spans.first[a[has]], spans.last[b[has]]


def _rows(first: np.ndarray, last: np.ndarray, env: np.ndarray, capacity: int, num_envs: int) -> np.ndarray:
    """Flat row ids of every step of the spans, concatenated."""
    lengths = last - first + 1
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    steps = np.repeat(first, lengths) + offsets
    return (steps % capacity) * num_envs + np.repeat(env, lengths)


def episodes(store: EpisodeSource, env: int | None = None, complete_only: bool = False) -> Iterator[Episode]:
    """Each episode of the committed window with its data, env by env, in time order.

    Yields :class:`mmreplay.episodes.Episode` (env, first and last global step id,
    status ``"terminated"``, ``"truncated"`` or ``"open"``, and ``data``: the spec's
    nest of ``[length, *shape]`` arrays). ``complete_only`` skips open episodes.

    Example:
        >>> import mmreplay as mr, numpy as np, tempfile
        >>> spec = {"x": mr.ArraySpec((), "int64"), "terminated": mr.ArraySpec((), "bool")}
        >>> store = mr.create(tempfile.mkdtemp() + "/b", spec, 10)
        >>> store.extend({"x": np.arange(5)[:, None], "terminated": np.array([[0], [1], [0], [0], [0]], bool)})
        >>> store.commit()
        >>> [(ep.first_step, ep.last_step, ep.status) for ep in store.episodes()]
        [(0, 1, 'terminated'), (2, 4, 'open')]
    """
    spans = _select(store, env, complete_only)
    capacity, num_envs = store.capacity, store.num_envs

    def gen() -> Iterator[Episode]:
        for i in range(len(spans)):
            a, b, e = int(spans.first[i]), int(spans.last[i]), int(spans.env[i])
            rows = (np.arange(a, b + 1, dtype=np.int64) % capacity) * num_envs + e
            store.check_open()
            data = [leaf.take(rows) for leaf in store.leaves]
            check_retained(store, a)
            yield Episode(e, a, b, spans.status(i), unflatten(store.spec, data), spans.ended(i))

    return gen()


# --- offline arrays ---------------------------------------------------------------

_ROLE_KEYS = {"observation": "observations", "action": "actions", "reward": "rewards"}
_END_ROLES = ("terminated", "truncated", "step_type", "next_step_type", "discount")


def _role_leaves(store: EpisodeSource, role: str) -> tuple[Any, list[int]] | None:
    """The spec node and leaf numbers of a role (a leaf or a subtree)."""
    path = store.roles.get(role)
    if path is None:
        return None
    paths = store.leaf_paths
    idx = [i for i, p in enumerate(paths) if p == path or p.startswith(path + "/")]
    return subtree(store.spec, path), idx


def to_arrays(store: EpisodeSource) -> dict[str, Any]:
    """Every committed episode as flat D4RL-style arrays, env by env, episode by episode.

    Keys: ``observations``, ``actions``, ``rewards`` (from the roles present),
    ``terminals`` and ``timeouts`` (bool, never both set: a terminated episode ends
    with ``terminals``, a truncated or still open one with ``timeouts``),
    ``next_observations``, and ``infos/<leaf path>`` for leaves with no role. With a
    ``next_observation`` leaf every step is kept; otherwise a step's next observation
    is the next step's observation in the episode, and the last step of an episode
    that did not terminate is dropped (its next observation is not stored; the step
    before it carries the episode's ``timeouts``). A terminal step's
    ``next_observations`` row repeats its own observation (no TD target uses it).
    """
    spans = _select(store, None, False)
    capacity, num_envs = store.capacity, store.num_envs
    length = spans.length
    terminated = (spans.code == TERMINATED) & (length > 0)
    obs_role = _role_leaves(store, "observation")
    next_role = _role_leaves(store, "next_observation")
    # Without a next_observation leaf, a step's next observation is the next step's
    # observation; the last step of an episode has none stored, so it is dropped unless
    # the episode terminated (its next observation never enters a TD target).
    keep_len = (
        length if next_role is not None or obs_role is None else np.where(terminated, length, length - 1)
    )
    keep = keep_len > 0
    first, env, keep_len, term = spans.first[keep], spans.env[keep], keep_len[keep], terminated[keep]
    rows = _rows(first, first + keep_len - 1, env, capacity, num_envs)
    ends = np.cumsum(keep_len) - 1
    n = len(rows)
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    terminals[ends[term]] = True
    timeouts[ends[~term]] = True
    out: dict[str, Any] = {}
    used: set[int] = set()
    leaves = store.leaves

    def gather(role_info: tuple[Any, list[int]], r: np.ndarray) -> Any:
        node, idx = role_info
        return unflatten(node, [leaves[i].take(r) for i in idx])

    for role, key in _ROLE_KEYS.items():
        info = _role_leaves(store, role)
        if info is None:
            continue
        used.update(info[1])
        value = gather(info, rows)
        if role == "reward" and isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[1] == 1:
            value = value.reshape(-1)
        out[key] = value
    out["terminals"] = terminals
    out["timeouts"] = timeouts
    if next_role is not None:
        used.update(next_role[1])
        out["next_observations"] = gather(next_role, rows)
    elif obs_role is not None:
        steps_next = rows // num_envs + 1  # slot of the next step (mod capacity below)
        next_rows = (steps_next % capacity) * num_envs + rows % num_envs
        next_rows[ends[term]] = rows[ends[term]]  # a terminal step's own observation, never used
        out["next_observations"] = gather(obs_role, next_rows)
    for role in _END_ROLES:
        info = _role_leaves(store, role)
        if info is not None:
            used.update(info[1])
    for i, path in enumerate(leaf_paths(store.spec)):
        if i not in used:
            out[f"infos/{path}"] = leaves[i].take(rows)
    if len(first):
        check_retained(store, int(first.min()))
    return out


# --- copies that continue a store's history ------------------------------------------


def fresh_envs(store: EpisodeSource, step: int) -> list[int]:
    """The envs whose episode at global step ``step`` starts there, whole.

    A copy that begins at ``step`` passes these to :func:`continue_index`; in every
    other env the copy's first episode began earlier, so it stays ``"open"``.
    """
    if step <= 0:
        return list(range(store.num_envs))
    spans = _select(store, None, False)
    whole = (spans.first == step) & ~spans.cut
    return sorted({int(e) for e in spans.env[whole]})


def continue_index(folder: str, first_step: int, fresh: Any, fsync: bool = False) -> None:
    """Start the episode index of an empty store whose steps begin at ``first_step``.

    The index records a boundary at ``first_step - 1`` for each env in ``fresh`` (that
    step is not in the store), so those envs' first episodes are whole; the others'
    began before ``first_step`` and are ``"open"``, as in the store they were copied from.
    """
    envs = np.unique(np.asarray(list(fresh), np.int64))
    if first_step <= 0:
        _write_index(os.path.join(folder, INDEX_FILE), 0, np.zeros(0, RECORD), fsync)
        return
    rec = np.zeros(len(envs), RECORD)
    rec["step"], rec["env"], rec["code"] = first_step - 1, envs, BOUNDARY
    _write_index(os.path.join(folder, INDEX_FILE), first_step - 1, rec, fsync)
