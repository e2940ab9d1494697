"""Reading a store: random batches, deterministic passes, and the page-cache advice.

:mod:`mmreplay.sampling` turns the committed window and an rng into flat row ids
``slot * num_envs + env``; here each leaf gathers those rows with one ``take`` (a numpy
``take`` on the memory map, or a chunk-grouped read through the LRU for compressed
leaves), and the rows are packed into the spec's nest.

Readers (mode ``"r"``) check after reading that the rows were still retained (the
seqlock of DESIGN.md): ``sample`` moves the reader's window forward with ``refresh()``
and re-samples the items the writer overwrote meanwhile; a deterministic pass cannot
re-sample and raises :class:`~mmreplay.NotEnoughDataError` instead.

Pages not in memory: random rows are read with ``MADV_RANDOM`` (no readahead, so a row
costs its own pages, not the 128 KiB or more read around each fault by default), and
sequences and passes with the normal readahead. Readers always advise; a writer advises
only when its ring outgrows memory, and then keeps the slots ahead of its cursor on
readahead, so that rewriting evicted pages does not fault page by page. When the mapped
leaves exceed half the memory available to the process, each batch also issues
``MADV_WILLNEED`` for exactly its pages before reading them, which lets the disk serve
them in parallel instead of one page fault at a time, and when the next batch is known
(``rng=None``, a shuffled pass) a background thread issues it while the caller works on
the current one. Below that line, a reader populates its mapping at open instead, in a
background thread (:func:`populate_at_open`), and each random batch decides for itself
(:class:`DiskReads`): it prefetches its pages when the process read from the disk since
the previous check (major page faults and block reads: one ``getrusage``, every batch
while they read from the disk, every fourth while they do not) and the first batch always
does, so pages the kernel dropped (another process's memory, a reboot, a drop of the page
cache) are read in parallel again while page-cached batches pay no per-row syscall.
``set_prefetch`` overrides these choices.

``sample(..., out=batch)`` gathers each leaf into the caller's array with one
``take(out=)``, checked first against the spec (:meth:`Reader.out_leaves`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from . import sampling
from .errors import BadInputError, NotEnoughDataError
from .io.local import DiskReads
from .spec import ArraySpec, leaf_paths, unflatten
from .statefile import slot_ranges
from .values import flatten_value

__all__ = ["SampleInfo", "sample", "empty_batch", "iterate", "read_rows", "set_prefetch", "set_rng"]

MAX_RESAMPLES = 16
POPULATE_PIECE_BYTES = 16 << 20  # a closing store waits for at most one piece
WRITE_WINDOW_BYTES = 16 << 20  # a writer's slots ahead of its cursor kept on readahead


@dataclass(frozen=True)
class SampleInfo:
    """Where each sampled item came from.

    Attributes:
        step: global step id of the item's first step, ``[B]``.
        env: env index, ``[B]``.
        slot: ring slot of the item's first step (``step % capacity``), ``[B]``.
        probability: probability of drawing this item in one draw, ``[B]`` (uniform:
            one over the number of valid starts).
        weight: importance-sampling weight of each item, ``[B]``, from samplers that
            give one (prioritized); None otherwise.
    """

    step: np.ndarray
    env: np.ndarray
    slot: np.ndarray
    probability: np.ndarray
    weight: np.ndarray | None = None


def _flat_keys(spec: Any) -> list[str] | None:
    """The sorted keys of a spec that is a flat dict of leaves (the fast paths), else None."""
    if (
        isinstance(spec, Mapping)
        and type(spec) is dict
        and all(isinstance(v, ArraySpec) for v in spec.values())
    ):
        return sorted(spec)
    return None


def _packer(spec: Any) -> Any:
    """A fast ``unflatten`` for the spec: a flat dict of leaves is packed with one zip."""
    keys = _flat_keys(spec)
    if keys is not None:
        return lambda arrays: dict(zip(keys, arrays))
    return lambda arrays: unflatten(spec, arrays)


class Reader:
    """Per-store read state: the leaves' gathers, the packer, the store's own rng and the
    prefetch thread. Made on first read, dropped when the store closes."""

    def __init__(self, store: Any):
        self.leaves = store.leaves
        # One gather per leaf: ``take`` on the mapping's flat rows, bound once.
        self.takes = [
            partial(leaf.flat.take, axis=0, mode="wrap") if leaf.mappable else leaf.take for leaf in self.leaves
        ]
        self.pack = _packer(store.spec)
        self.spec = store.spec
        self.keys = _flat_keys(store.spec)
        self.paths = leaf_paths(store.spec)
        self.dtypes = [np.dtype(leaf.info.spec.dtype) for leaf in self.leaves]
        self.shapes = [tuple(leaf.info.spec.shape) for leaf in self.leaves]
        # One gather per leaf into a caller's array: ``take(out=)`` on the mapping, a copy
        # of the decoded rows for the other leaves.
        self.takes_into = [
            take if leaf.mappable else partial(_copy_into, leaf.take) for take, leaf in zip(self.takes, self.leaves)
        ]
        self.capacity = store.capacity
        self.num_envs = store.num_envs
        self.is_reader = store.mode == "r"
        self.gen: np.random.Generator | None = None
        self.mapped = [leaf for leaf in store.stored_leaves if leaf.mappable]  # the stored leaves
        mapped_bytes = sum(leaf.flat.nbytes for leaf in self.mapped)
        self.prefetch = bool(self.mapped) and mapped_bytes > memory_available() // 2
        # Below that line each random batch decides from the disk reads since the last one.
        self.disk_reads = DiskReads.for_leaves(self.mapped, self.prefetch)
        # Readers advise always; a writer only when its ring outgrows memory (its own
        # recent rows are in the page cache otherwise, and readahead helps its writes).
        self.advising = bool(self.mapped) and (self.is_reader or self.prefetch)
        step_bytes = max(1, sum(leaf.num_envs * leaf.row_bytes for leaf in self.mapped))
        self.window_slots = max(64, min(self.capacity, WRITE_WINDOW_BYTES // step_bytes))
        self.write_window: tuple[int, int] | None = None
        self.current_advice: tuple[str, Any] | None = None
        self.pattern: str | None = None  # the advice in force (readers: the whole of it)
        self.pending: tuple[Any, sampling.Draw] | None = None
        self.thread: _Prefetcher | None = None
        location = store.location
        if location is not None:  # object storage: every leaf's range requests in flight together
            self.take = partial(location.take_leaves, self.leaves)  # type: ignore[method-assign]

    def live_first(self, store: Any) -> int:
        """The oldest step the writer retains now: the readers' seqlock check, one
        ``pread`` of the state file (no JSON is opened)."""
        return store.live_first()

    def own_gen(self) -> np.random.Generator:
        if self.gen is None:
            self.gen = np.random.default_rng()
        return self.gen

    def advise(self, pattern: str, store: Any) -> None:
        """Page advice for the next read (see the module docstring); in a writer the slots
        ahead of its cursor stay on normal readahead, so that a ring larger than RAM does
        not make the write head fault page by page."""
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

    def take(self, rows: np.ndarray) -> list[np.ndarray]:
        return [take(rows) for take in self.takes]

    def out_leaves(self, out: Any, items: tuple[int, ...]) -> list[np.ndarray]:
        """The leaf arrays of a caller's batch ``out``, in flatten order, each checked to be
        a writeable numpy array ``[*items, *leaf shape]`` of the leaf's dtype.

        Raises:
            BadInputError: naming the leaf, what was expected and what came.
        """
        keys = self.keys
        if keys is not None and type(out) is dict and len(out) == len(keys):
            try:
                arrays = [out[k] for k in keys]
            except KeyError:
                arrays = flatten_value(self.spec, out, "out")
        else:
            arrays = flatten_value(self.spec, out, "out")
        for arr, path, dtype, shape in zip(arrays, self.paths, self.dtypes, self.shapes):
            if type(arr) is not np.ndarray or arr.dtype != dtype or arr.shape != items + shape:
                _refuse_out(arr, path, dtype, items + shape)
            if not arr.flags.writeable:
                raise BadInputError(f"out leaf {path!r}: the array is read-only; pass a writeable array")
        return arrays

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread = None
        self.leaves = []
        self.takes = []
        self.mapped = []


def _copy_into(take: Any, rows: np.ndarray, out: np.ndarray) -> None:
    np.copyto(out, take(rows))


def _refuse_out(arr: Any, path: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    got = (
        f"shape {arr.shape} and dtype {arr.dtype}"
        if isinstance(arr, np.ndarray)
        else f"{type(arr).__name__} (not a numpy array)"
    )
    raise BadInputError(
        f"out leaf {path!r}: expected a numpy array of shape {shape} and dtype {dtype}, got {got} "
        "(make one with store.empty_batch(batch_size, num_steps))"
    )


def empty_batch(store: Any, batch_size: int, num_steps: int | None = None) -> Any:
    """See :meth:`mmreplay.Store.empty_batch`."""
    store._check_open()
    sampling.check_sizes(batch_size, num_steps)
    if batch_size is None:
        raise ValueError("batch_size must be a positive int, got None")
    if num_steps is None:
        num_steps = store.sampler.num_steps
    items = (int(batch_size),) if num_steps is None else (int(batch_size), int(num_steps))
    reader = reader_for(store)
    return reader.pack([np.empty(items + shape, dtype) for shape, dtype in zip(reader.shapes, reader.dtypes)])


class _Prefetcher:
    """A daemon thread that issues ``MADV_WILLNEED`` for the rows it is handed (the latest
    request replaces one not started yet)."""

    def __init__(self, reader: Reader):
        self.reader = reader
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
                leaves = list(self.reader.mapped)
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


def populate_at_open(store: Any, populate: bool | None) -> Populator | None:
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


def reader_for(store: Any) -> Reader:
    """The store's read path, made on first read."""
    return store.part("reads", Reader)


def set_prefetch(store: Any, enabled: bool | None, advise: bool | None = None) -> None:
    """Set the page-cache behaviour of a store's reads.

    Args:
        store: an open store.
        enabled: ``MADV_WILLNEED`` prefetch of each batch's pages (and, when the next
            batch is known, of its pages from a background thread): True, False, or None
            for the default: on when the mapped leaves exceed half the memory available
            to the process, else decided batch by batch for random rows (on when the
            process read from the disk since the previous batch, see
            :class:`DiskReads`).
        advise: ``MADV_RANDOM`` for random rows and ``MADV_NORMAL`` for sequences: True,
            False (leave the kernel's readahead as it is), or None for the default (on
            in readers, on in a writer only with the prefetch).
    """
    reader = reader_for(store)
    per_batch = enabled is None
    if enabled is None:
        mapped_bytes = sum(leaf.flat.nbytes for leaf in reader.mapped)
        enabled = mapped_bytes > memory_available() // 2
    reader.prefetch = bool(enabled) and bool(reader.mapped)
    reader.disk_reads = DiskReads.for_leaves(reader.mapped, reader.prefetch) if per_batch else None
    if advise is None:
        advise = reader.is_reader or reader.prefetch
    if not advise and reader.advising:
        for leaf in reader.mapped:
            leaf.advise("normal")
        reader.current_advice = reader.pattern = None
    reader.advising = bool(advise) and bool(reader.mapped)
    if not reader.prefetch:
        reader.pending = None


def set_rng(store: Any, rng: Any) -> None:
    """Seed the generator ``sample(rng=None)`` uses (an int seed, a Generator, or None).

    Sampling with the store's own generator lets the next batch be drawn ahead and its
    pages prefetched in the background; with a seeded one the batches stay reproducible
    as long as the committed window does not change between them.
    """
    reader = reader_for(store)
    reader.gen = sampling.as_generator(rng)
    reader.pending = None


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
        try:
            best = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            pass
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


# --- sampling -----------------------------------------------------------------------


def _draw(
    store: Any,
    batch_size: int,
    num_steps: int,
    replacement: bool,
    gen: np.random.Generator,
    options: dict,
    within: tuple[int, int] | None,
    sampler: Any = None,
) -> sampling.Draw:
    window = store.window
    if within is not None:  # a caller's narrower window (framework layers' own views)
        window = window._replace(first=max(window.first, within[0]), end=min(window.end, within[1]))
    sampler = store.sampler if sampler is None else sampler
    return sampler.draw(batch_size, window, gen, num_steps=num_steps, replacement=replacement, **options)


def sample(
    store: Any,
    batch_size: int,
    num_steps: int | None = None,
    replacement: bool = True,
    rng: Any = None,
    return_info: bool = False,
    options: dict | None = None,
    window: tuple[int, int] | None = None,
    sampler: Any = None,
    out: Any = None,
) -> Any:
    """See :meth:`mmreplay.Store.sample`: draws through ``store.sampler``, then one fetch
    path for every sampler (gather, page-cache advice, prefetch, readers' re-draw).
    ``sampler``: a sampler to draw through instead of the store's (framework layers
    that keep their framework's draw rule). ``out``: a batch to gather into."""
    if store.closed:
        store._check_open()
    if type(batch_size) is not int or batch_size < 1:
        sampling.check_sizes(batch_size, None)
        if batch_size is None:
            raise ValueError("batch_size must be a positive int, got None")
        batch_size = int(batch_size)
    if num_steps is not None:
        sampling.check_sizes(batch_size, num_steps)
    reader = reader_for(store)
    own = sampler
    sampler = store.sampler if own is None else own
    if num_steps is None:
        num_steps = sampler.num_steps
    steps = 1 if num_steps is None else num_steps
    if out is not None:  # checked before anything is drawn: a refused batch is left as it was
        arrays = reader.out_leaves(out, (batch_size,) if num_steps is None else (batch_size, num_steps))
    options = options or {}
    draw = None
    key = None
    if rng is None:
        gen = reader.own_gen()
        if reader.prefetch and getattr(sampler, "draws_ahead", False):
            key = (batch_size, steps, replacement, tuple(sorted(options.items())), window, store.window)
            if reader.pending is not None and reader.pending[0] == key:
                draw = reader.pending[1]
            reader.pending = None
    elif type(rng) is np.random.Generator:
        gen = rng
    else:
        gen = sampling.as_generator(rng)
    prefetched = draw is not None
    if draw is None:
        if window is None and not options:  # the common call, without keyword handling
            draw = sampler.draw(batch_size, store.window, gen, steps, replacement)
        else:
            draw = _draw(store, batch_size, steps, replacement, gen, options, window, own)
    rows = draw.start if num_steps is None else sampling.rows_of(draw.start, num_steps, reader.num_envs)
    if reader.advising:
        pattern = "random" if num_steps is None else "normal"
        if pattern is not reader.pattern or not reader.is_reader:
            reader.advise(pattern, store)
    if reader.prefetch:
        if not prefetched:
            reader.willneed(rows)
    elif num_steps is None and reader.disk_reads is not None:
        reader.willneed_if_cold(rows)
    if out is None:
        got = [take(rows) for take in reader.takes]
    else:
        if len(rows) < batch_size:  # without replacement, fewer items than asked
            arrays = [arr[: len(rows)] for arr in arrays]
        for take, arr in zip(reader.takes_into, arrays):
            take(rows, out=arr)
        got = arrays
    if reader.is_reader and reader.live_first(store) > store.first_step:  # some may be overwritten
        draw = _resample_overwritten(
            store, reader, draw, got, steps, num_steps, replacement, gen, options, window, own
        )
    if key is not None:  # the next batch with the same request: draw it now, prefetch it
        nxt = _draw(store, batch_size, steps, replacement, gen, options, window, own)
        reader.pending = (key, nxt)
        reader.prefetch_later(sampling.rows_of(nxt.start, num_steps, reader.num_envs))
    nest = out if out is not None and len(rows) == batch_size else reader.pack(got)
    if return_info:
        step = draw.step
        return nest, SampleInfo(step, draw.env, step % reader.capacity, draw.probability, draw.weight)
    return nest


def _resample_overwritten(
    store: Any,
    reader: Reader,
    draw: sampling.Draw,
    out: list[np.ndarray],
    steps: int,
    num_steps: int | None,
    replacement: bool,
    gen: np.random.Generator,
    options: dict,
    within: tuple[int, int] | None,
    sampler: Any = None,
) -> sampling.Draw:
    """Seqlock for readers: redraw (and read again) the items the writer overwrote while
    they were read, from the reader's window moved forward to the writer's."""
    num_envs = reader.num_envs
    for _ in range(MAX_RESAMPLES):
        lowest = reader.live_first(store)
        bad = draw.flat < lowest * num_envs  # the item's first step is older than the oldest retained
        if not bad.any():
            return draw
        store.refresh()
        if not replacement:  # redraw all, so the batch stays free of repeats
            bad[:] = True
        fresh = _draw(store, int(bad.sum()), steps, replacement, gen, options, within, sampler)
        if not replacement and len(fresh) != len(draw):
            raise NotEnoughDataError(
                f"{store.path}: fewer rows are retained now than were sampled; sample again"
            )
        fresh_rows = sampling.rows_of(fresh.start, num_steps, num_envs)
        for arr, take in zip(out, reader.takes):
            arr[bad] = take(fresh_rows)
        flat, start, prob = draw.flat.copy(), draw.start.copy(), np.array(draw.probability)
        flat[bad], start[bad], prob[bad] = fresh.flat, fresh.start, fresh.probability
        weight = None
        if draw.weight is not None and fresh.weight is not None:
            weight = np.array(draw.weight)
            weight[bad] = fresh.weight
        draw = sampling.Draw(start, num_envs, prob, flat=flat, weight=weight)
    raise NotEnoughDataError(
        f"{store.path}: the writer overwrote the sampled rows {MAX_RESAMPLES} times in a row; "
        "the ring is too small for this reader"
    )


def read_rows(store: Any, steps: Any, envs: Any) -> Any:
    """The spec's nest of the rows ``(steps, envs)`` (global step ids and env indices,
    broadcast together): each leaf ``[*shape_of_the_ids, *leaf_shape]``.

    Raises:
        NotEnoughDataError: a step is not committed and retained, or (readers) the
            writer overwrote it while it was read.
    """
    store._check_open()
    steps, envs = np.broadcast_arrays(np.asarray(steps, np.int64), np.asarray(envs, np.int64))
    if steps.size:
        lo, hi = int(steps.min()), int(steps.max())
        first, end = store.window[:2]
        if lo < first or hi >= end:
            raise NotEnoughDataError(
                f"{store.path}: steps [{lo}, {hi}] asked, the steps retained are [{first}, {end})"
            )
        if envs.min() < 0 or envs.max() >= store.num_envs:
            raise IndexError(f"{store.path}: env index out of range for {store.num_envs} envs")
    reader = reader_for(store)
    out = reader.take((steps % reader.capacity) * reader.num_envs + envs)
    if store.mode == "r" and steps.size:
        lowest = int(steps.min())
        if lowest < reader.live_first(store):
            raise NotEnoughDataError(
                f"{store.path}: step {lowest} was overwritten by the writer while it was read; "
                "call refresh() and read again"
            )
    return reader.pack(out)


# --- deterministic passes -------------------------------------------------------------


def iterate(
    store: Any,
    batch_size: int | None = None,
    num_steps: int | None = None,
    window_shift: int | None = None,
    drop_remainder: bool = False,
    shuffle: bool = False,
    rng: Any = None,
    window: tuple[int, int] | None = None,
    group_envs: bool = False,
    return_steps: bool = False,
) -> Iterator[Any]:
    """See :meth:`mmreplay.Store.iterate`."""
    store._check_open()
    batch_size, num_steps, window_shift = sampling.check_sizes(batch_size, num_steps, window_shift)
    if window_shift is not None and num_steps is None:
        raise ValueError("window_shift needs num_steps: it is the step between the starts of two windows")
    if group_envs and shuffle:
        raise ValueError("group_envs keeps the pass order: it cannot be shuffled")
    first, end = store.window[:2]
    if window is not None:  # a caller's narrower window (framework layers' own views)
        first, end = max(first, int(window[0])), min(end, int(window[1]))
    env, start, length = sampling.pass_windows(
        first, end, store.num_envs, num_steps, window_shift, drop_remainder
    )
    if drop_remainder and end > first and not group_envs:  # (TF-Agents' order yields nothing then)
        if len(env) == 0:
            raise NotEnoughDataError(
                f"{store.path}: all data would be dropped: num_steps={num_steps} is longer than the "
                f"{end - first} committed steps retained"
            )
        if batch_size is not None and len(env) < batch_size:
            raise NotEnoughDataError(
                f"{store.path}: all data would be dropped: batch_size={batch_size} is larger than the "
                f"{len(env)} windows of one pass"
            )
    if group_envs:
        groups = sampling.env_group_batches(store.num_envs, len(env) // store.num_envs, batch_size, drop_remainder)
    else:
        gen = sampling.as_generator(rng) if shuffle else None
        groups = sampling.pass_batches(length, batch_size, drop_remainder, gen)
    reader = reader_for(store)
    return _pass(store, reader, groups, env, start, length, batch_size, num_steps, shuffle, return_steps)


def _pass(
    store: Any,
    reader: Reader,
    groups: Iterator[np.ndarray],
    env: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    batch_size: int | None,
    num_steps: int | None,
    shuffle: bool,
    return_steps: bool = False,
) -> Iterator[Any]:
    capacity, num_envs = reader.capacity, reader.num_envs

    def steps_for(group: np.ndarray) -> np.ndarray:
        """Global step ids of the group's rows, in the shape of the batch's outer axes."""
        n = int(length[group[0]])
        steps = start[group][:, None] + np.arange(n, dtype=np.int64)
        if num_steps is None:
            steps = steps[:, 0]
        return steps if batch_size is not None else steps[0]

    def rows_for(group: np.ndarray) -> np.ndarray:
        envs = env[group] if batch_size is not None else env[group[0]]
        if num_steps is not None:
            envs = np.expand_dims(envs, -1)
        return (steps_for(group) % capacity) * num_envs + envs

    pattern = "random" if shuffle and num_steps is None else "normal"
    group = next(groups, None)
    while group is not None:
        store._check_open()
        rows = rows_for(group)
        nxt = next(groups, None)
        if reader.advising:
            reader.advise(pattern, store)
        if reader.prefetch and shuffle and nxt is not None:
            reader.prefetch_later(rows_for(nxt))
        elif pattern == "random" and reader.disk_reads is not None:
            reader.willneed_if_cold(rows)
        out = reader.take(rows)
        if store.mode == "r":
            lowest = int(start[group].min())
            if lowest < reader.live_first(store):
                raise NotEnoughDataError(
                    f"{store.path}: step {lowest} was overwritten by the writer during the pass; "
                    "a pass over a ring being written must keep ahead of the writer"
                )
        yield (reader.pack(out), steps_for(group)) if return_steps else reader.pack(out)
        group = nxt
