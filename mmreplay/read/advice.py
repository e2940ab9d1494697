"""Page-cache advice for the read path: what to tell the kernel about the pages a read
is about to touch, and when to read them ahead.

Random rows are read with ``MADV_RANDOM`` (no readahead, so a row costs its own pages,
not the 128 KiB or more read around each fault by default), and sequences and passes
with the normal readahead. Readers always advise; a writer advises only when its ring
outgrows memory, and then keeps the slots ahead of its cursor on readahead, so that
rewriting evicted pages does not fault page by page. When the mapped leaves exceed half
the memory available to the process, each batch also issues ``MADV_WILLNEED`` for
exactly its pages before reading them, which lets the disk serve them in parallel
instead of one page fault at a time, and when the next batch is known (``rng=None``, a
shuffled pass) a background thread issues it while the caller works on the current one.
Below that line, a reader populates its mapping at open instead, in a background thread
(:func:`populate_at_open`), and each random batch prefetches only when the process has
been reading from the disk (:class:`DiskReads`), so pages the kernel dropped are read in
parallel again while page-cached batches pay no per-row syscall.
:meth:`PageCache.configure` (``mmreplay.read.set_prefetch``) overrides these choices.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import Any

import numpy as np

from ..statefile import slot_ranges
from .readable import Readable

try:
    import resource
except ImportError:  # Windows: no rusage, no per-batch decision
    resource = None  # type: ignore[assignment]

__all__ = ["DiskReads", "PageCache", "Populator", "memory_available", "populate_at_open"]

POPULATE_PIECE_BYTES = 16 << 20  # a closing store waits for at most one piece
WRITE_WINDOW_BYTES = 16 << 20  # a writer's slots ahead of its cursor kept on readahead
# A batch prefetches when the process read from the disk, since the last check, at least
# this share of what the batch reads when cold (below it: other files, a stray page).
COLD_SHARE = 8
WARM_CHECK = 4  # after a batch found warm, the next check is this many batches later


class PageCache:
    """A store's page-cache state: which leaves are mapped, whether batches prefetch,
    the advice in force, the prefetch thread and the next batch drawn ahead for it."""

    def __init__(self, store: Readable):
        self.capacity = store.capacity
        self.num_envs = store.num_envs
        self.is_reader = store.mode == "r"
        self.mapped = [leaf for leaf in store.stored_leaves if leaf.mappable]  # the stored leaves
        step_bytes = max(1, sum(leaf.num_envs * leaf.row_bytes for leaf in self.mapped))
        self.window_slots = max(64, min(self.capacity, WRITE_WINDOW_BYTES // step_bytes))
        self.write_window: tuple[int, int] | None = None
        self.current_advice: tuple[str, Any] | None = None
        self.pattern: str | None = None  # the advice in force (readers: the whole of it)
        self.pending: tuple[Any, Any] | None = None  # (request, draw) of the next batch, drawn ahead
        self.thread: _Prefetcher | None = None
        self.advising = False
        self.configure(None, None)

    def configure(self, enabled: bool | None, advise: bool | None) -> None:
        """See :func:`mmreplay.read.set_prefetch`."""
        per_batch = enabled is None
        if enabled is None:
            mapped_bytes = sum(leaf.flat.nbytes for leaf in self.mapped)
            enabled = mapped_bytes > memory_available() // 2
        self.prefetch = bool(enabled) and bool(self.mapped)
        # Below that line each random batch decides from the disk reads since the last one.
        self.disk_reads = DiskReads.for_leaves(self.mapped, self.prefetch) if per_batch else None
        if advise is None:
            # Readers advise always; a writer only when its ring outgrows memory (its own
            # recent rows are in the page cache otherwise, and readahead helps its writes).
            advise = self.is_reader or self.prefetch
        if not advise and self.advising:
            for leaf in self.mapped:
                leaf.advise("normal")
            self.current_advice = self.pattern = None
        self.advising = bool(advise) and bool(self.mapped)
        if not self.prefetch:
            self.pending = None

    def advise(self, pattern: str, store: Readable) -> None:
        """Page advice for the next read; in a writer the slots ahead of its cursor stay
        on normal readahead, so that a ring larger than RAM does not make the write head
        fault page by page."""
        keep = None
        if not self.is_reader and pattern == "random":
            keep = self.write_window
            cursor = store.total_steps % self.capacity
            if keep is None or (cursor - keep[0]) % self.capacity > keep[1] // 2:
                keep = self.write_window = (cursor, self.window_slots)
        if (pattern, keep) == self.current_advice:
            return
        for leaf in self.mapped:
            leaf.advise(pattern, keep)
        self.current_advice = (pattern, keep)
        self.pattern = pattern

    def willneed(self, rows: np.ndarray) -> None:
        for leaf in self.mapped:
            leaf.willneed(rows)

    def willneed_if_cold(self, rows: np.ndarray) -> None:
        """Prefetch the pages of random ``rows`` when the process has been reading from
        the disk (see :class:`DiskReads`); a page-cached batch pays at most one ``getrusage``."""
        disk_reads = self.disk_reads
        if disk_reads is not None and disk_reads.cold(rows.size):
            self.willneed(rows)

    def prefetch_later(self, rows: np.ndarray) -> None:
        if self.thread is None:
            self.thread = _Prefetcher(self)
        self.thread.submit(rows)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread = None
        self.mapped = []


class DiskReads:
    """Whether the pages of the next random batch are likely out of memory, judged from
    what the process read from the disk since the previous batch: its major page faults
    (a page faulted in from the file) and block reads (``ru_inblock``, which counts the
    reads a ``MADV_WILLNEED`` started too, where a prefetched page then faults as a minor
    one). A batch prefetches its pages (``MADV_WILLNEED`` per run of pages, about a
    microsecond per call) only then, and the first batch always: a cold batch of rows of
    several pages is read in parallel instead of one synchronous page fault at a time
    under ``MADV_RANDOM``. A cold batch checks again at the next batch; a page-cached one
    only every ``WARM_CHECK`` batches (one ``getrusage`` each, about a microsecond, which
    weighs on batches of small rows), so pages evicted meanwhile fault one by one for at
    most that many batches.

    ``prefetched`` counts the batches it sent to the prefetch."""

    def __init__(self, row_bytes: int):
        # What a cold batch reads per row, so that a few pages of code or of other files
        # read meanwhile do not pass for one.
        self.row_bytes = max(1, row_bytes)
        self.mark: int | None = None  # bytes read from the disk so far, at the last check
        self.skip = 0  # batches left until the next check
        self.prefetched = 0

    @classmethod
    def for_leaves(cls, mapped: list[Any], prefetch: bool) -> DiskReads | None:
        """The decision for a store's mapped leaves, or None where every batch prefetches
        anyway, nothing is mapped, or the OS keeps no rusage (Windows)."""
        if not mapped or prefetch or resource is None:
            return None
        # a page of each leaf at least per row: random rows of small leaves share no page
        return cls(sum(max(leaf.row_bytes, mmap.PAGESIZE) for leaf in mapped))

    def cold(self, rows: int) -> bool:
        """True when this batch of ``rows`` rows should prefetch its pages."""
        if self.skip:
            self.skip -= 1
            return False
        now = disk_bytes_read()
        last, self.mark = self.mark, now
        if last is not None and (now - last) * COLD_SHARE < rows * self.row_bytes:
            self.skip = WARM_CHECK - 1
            return False
        self.prefetched += 1
        return True


def disk_bytes_read() -> int:
    """Bytes the process has read from the disk so far, by page faults and block reads
    (counted twice where both saw them: it only needs to grow with the reads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_majflt * mmap.PAGESIZE + usage.ru_inblock * 512


class _Prefetcher:
    """A daemon thread that issues ``MADV_WILLNEED`` for the rows it is handed (the latest
    request replaces one not started yet)."""

    def __init__(self, cache: PageCache):
        self.cache = cache
        self.cond = threading.Condition()
        self.job: np.ndarray | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="mmreplay-prefetch", daemon=True)
        self.thread.start()

    def submit(self, rows: np.ndarray) -> None:
        with self.cond:
            self.job = rows
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while self.job is None and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                rows, self.job = self.job, None
                leaves = list(self.cache.mapped)
            for leaf in leaves:
                leaf.willneed(rows)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join()


class Populator:
    """A daemon thread that populates the retained slots of a store's mapped leaves, in
    pieces (see :func:`populate_at_open`); ``stop()`` ends it between two pieces."""

    def __init__(self, leaves: list[Any], ranges: list[tuple[int, int]]):
        self.leaves = leaves
        self.ranges = ranges
        self.advice: set[str] = set()  # the advice that took effect
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mmreplay-populate", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for leaf in self.leaves:
            piece = max(1, POPULATE_PIECE_BYTES // max(1, leaf.array.strides[0]))
            for a, b in self.ranges:
                for x in range(a, b, piece):
                    if self.stopping.is_set():
                        return
                    used = leaf.populate(x, min(b, x + piece))
                    if used is None:
                        return  # no advice here (or the mapping is gone)
                    self.advice.add(used)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every piece is populated; True when done."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


def populate_at_open(store: Readable, populate: bool | None) -> Populator | None:
    """Start populating the mapping of a store just opened, or None.

    ``populate``: True always, False never, None in a reader (mode ``"r"``) whose
    retained rows of the mapped leaves take at most half the memory available to the
    process (the rule that turns the per-batch prefetch off: a store that fits is read
    from memory, one that does not is prefetched batch by batch instead); a writer
    resuming mostly writes, so it populates only when asked. The work runs in a background thread without
    the GIL, so opening stays as fast as before and the first batches find their pages
    mapped (or, still racing the thread, fault them as they would have anyway).
    """
    if populate is False:
        return None
    mapped = [leaf for leaf in store.leaves if leaf.mappable]
    first, end = store.window[:2]
    ranges = slot_ranges(first, end, store.capacity)
    if not mapped or not ranges:
        return None
    if populate is None:
        if store.mode != "r":
            return None
        retained = sum(b - a for a, b in ranges) * sum(leaf.array.strides[0] for leaf in mapped)
        if retained > memory_available() // 2:
            return None
    return Populator(mapped, ranges)


def memory_available() -> int:
    """Bytes of memory this process may use: MemAvailable, capped by its cgroup's limit."""
    best = 1 << 62
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):  # no /proc (macOS): the physical memory
        with contextlib.suppress(OSError, ValueError):
            best = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            candidates = [
                f"/sys/fs/cgroup{parts[2]}/memory.max",
                f"/sys/fs/cgroup/unified{parts[2]}/memory.max",
            ]
        elif "memory" in parts[1].split(","):
            candidates = [f"/sys/fs/cgroup/memory{parts[2]}/memory.limit_in_bytes"]
        else:
            continue
        for path in candidates:
            try:
                with open(path) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit():
                best = min(best, int(text))
    return best
