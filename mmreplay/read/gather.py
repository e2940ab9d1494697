"""Random batches: one request in, the spec's nest of rows out.

:func:`sample` is the one fetch path under every sampler and entry layer. For a
:class:`~mmreplay.read.request.SampleRequest` it (1) checks the caller's ``out`` batch
(before drawing, so a refused batch is left as it was), (2) draws through the sampler,
or takes the draw made ahead for an equal request, (3) advises the page cache
(:mod:`mmreplay.read.advice`), (4) gathers each leaf's rows with one ``take`` (on the
memory map, into ``out``, or chunk-grouped through the LRU of compressed leaves),
(5) in readers, checks that the rows were still retained after reading them (the
seqlock of DESIGN.md) and draws and reads again the items the writer overwrote,
(6) runs the request's transform over the final draw and its rows
(:mod:`mmreplay.read.transform`: n-step returns, goal relabelling), and (7) packs the
nest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..errors import BadInputError, NotEnoughDataError, OverwrittenError
from ..spec import ArraySpec, leaf_paths, unflatten
from ..values import flatten_value
from .advice import PageCache
from .draws import Draw, Window, check_steps, rows_of
from .layout import LeafPlan, plans
from .readable import Drawing, Readable
from .request import SampleRequest, as_generator
from .transform import DrawnBatch, Transform

__all__ = [
    "Reader",
    "SampleInfo",
    "empty_batch",
    "read_rows",
    "reader_for",
    "sample",
    "set_prefetch",
    "set_rng",
]

MAX_RESAMPLES = 16
#: transforms whose batch packers a reader keeps (a transform made per batch, with a new
#: reward_map each time, is a new one)
MAX_PACKERS = 8


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
    weight: np.ndarray | None


def _flat_keys(spec: Any) -> list[str] | None:
    """The sorted keys of a spec that is a flat dict of leaves (the fast paths), else None."""
    if type(spec) is dict and all(isinstance(v, ArraySpec) for v in spec.values()):
        return sorted(spec)
    return None


class Reader(PageCache):
    """Per-store read state: the leaves' gathers, the packer, the store's own rng and
    its page-cache state. Made on first read (:func:`reader_for`), closed with the store."""

    def __init__(self, store: Readable):
        super().__init__(store)
        self.leaves = leaves = store.leaves
        # One gather per leaf: ``take`` on the mapping's flat rows, bound once.
        self.takes = [
            partial(leaf.flat.take, axis=0, mode="wrap") if leaf.mappable else leaf.take for leaf in leaves
        ]
        # One gather per leaf into a caller's array: ``take(out=)`` on the mapping, a copy
        # of the decoded rows for the other leaves.
        self.takes_into = [
            take if leaf.mappable else partial(_copy_into, leaf.take)
            for take, leaf in zip(self.takes, leaves)
        ]
        self.spec = spec = store.spec
        self.keys = keys = _flat_keys(spec)
        # A flat dict of leaves is packed with one zip.
        self.pack = (lambda arrays: dict(zip(keys, arrays))) if keys is not None else partial(unflatten, spec)
        self.paths = leaf_paths(spec)
        self.dtypes = [np.dtype(leaf.info.spec.dtype) for leaf in leaves]
        self.shapes = [tuple(leaf.info.spec.shape) for leaf in leaves]
        self.gen: np.random.Generator | None = None
        self.layouts: dict[str, list[LeafPlan]] = {}  # layout -> each leaf's gather in it
        self.packers: dict[Any, Callable[[dict[str, np.ndarray]], Any]] = {}
        if store.location is not None:  # object storage: every leaf's range requests in flight together
            self.take = partial(store.location.take_leaves, leaves)  # type: ignore[method-assign]

    def packer(self, transform: Transform, store: Readable) -> Callable[[dict[str, np.ndarray]], Any]:
        """What packs ``transform``'s leaves (by path) into its batch spec's nest, made once
        per transform (its ``batch_spec`` refuses a store it cannot serve)."""
        pack = self.packers.get(transform)
        if pack is None:
            spec = transform.batch_spec(store.spec, store.roles)
            keys, paths = _flat_keys(spec), leaf_paths(spec)
            if keys is not None:  # a flat dict of leaves: its keys are its paths
                pack = lambda leaves: {k: leaves[k] for k in keys}  # noqa: E731
            else:
                pack = lambda leaves: unflatten(spec, [leaves[p] for p in paths])  # noqa: E731
            if len(self.packers) >= MAX_PACKERS:  # transforms made afresh per batch must not pile up
                del self.packers[next(iter(self.packers))]
            self.packers[transform] = pack
        return pack

    def own_gen(self) -> np.random.Generator:
        if self.gen is None:
            self.gen = np.random.default_rng()
        return self.gen

    def take(self, rows: np.ndarray) -> list[np.ndarray]:
        return [take(rows) for take in self.takes]

    def plans(self, layout: str) -> list[LeafPlan]:
        """Each leaf's gather in ``layout`` (:mod:`mmreplay.read.layout`), made once."""
        found = self.layouts.get(layout)
        if found is None:
            found = self.layouts[layout] = plans(self.leaves, layout)
        return found

    def out_leaves(
        self, out: Any, items: tuple[int, ...], shapes: list[tuple[int, ...]] | None = None
    ) -> list[np.ndarray]:
        """The leaf arrays of a caller's batch ``out``, in flatten order, each checked to be
        a writeable numpy array (or CPU torch tensor, as a view) ``[*items, *leaf shape]``
        (``shapes``: the shapes of a layout, in C-contiguous memory) of the leaf's dtype.

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
        arrays = [_torch_as_numpy(arr, path) for arr, path in zip(arrays, self.paths)]
        for arr, path, dtype, shape in zip(arrays, self.paths, self.dtypes, shapes or self.shapes):
            if type(arr) is not np.ndarray or arr.dtype != dtype or arr.shape != items + shape:
                _refuse_out(arr, path, dtype, items + shape)
            if not arr.flags.writeable:
                raise BadInputError(f"out leaf {path!r}: the array is read-only; pass a writeable array")
            if shapes is not None and not arr.flags.c_contiguous:
                raise BadInputError(
                    f"out leaf {path!r}: a batch in a layout is written in contiguous memory; the array "
                    "is a strided view (make one with store.empty_batch(batch_size, layout=...))"
                )
        return arrays

    def close(self) -> None:
        super().close()
        self.takes = []
        self.leaves, self.layouts = [], {}


def _torch_as_numpy(arr: Any, path: str) -> Any:
    """A CPU torch tensor (pinned or not) as a numpy view of its memory, else ``arr``."""
    if type(arr).__module__.split(".")[0] != "torch":
        return arr
    if arr.device.type != "cpu":
        raise BadInputError(
            f"out leaf {path!r}: a tensor on {arr.device} cannot be written in place; pass a CPU tensor "
            "(pinned with .pin_memory() to copy it to the GPU without blocking)"
        )
    return arr.detach().numpy()


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


def reader_for(store: Readable) -> Reader:
    """The store's read state, made on first read."""
    return store.part("reads", Reader)


def empty_batch(
    store: Readable, batch_size: int, num_steps: int | None = None, layout: str | None = None
) -> Any:
    """A batch for ``sample(batch_size, num_steps, out=..., layout=...)`` to gather into:
    the spec's nest of uninitialised arrays ``[batch_size, *shape]`` (or
    ``[batch_size, num_steps, *shape]``; None: the sampler's ``num_steps``), pictures in
    ``layout`` (:mod:`mmreplay.read.layout`).

    Reusing a few batches spares allocating, and faulting in, fresh memory for every
    batch: pixel batches of several MB are returned to the OS when dropped.
    """
    store.check_open()
    request = SampleRequest.build(batch_size, num_steps, layout=layout)
    num_steps = store.sampler.num_steps if request.num_steps is None else request.num_steps
    items = (request.batch_size,) if num_steps is None else (request.batch_size, num_steps)
    reader = reader_for(store)
    shapes = reader.shapes if layout is None else [plan.shape for plan in reader.plans(layout)]
    return reader.pack([np.empty(items + shape, dtype) for shape, dtype in zip(shapes, reader.dtypes)])


def set_prefetch(store: Readable, enabled: bool | None, advise: bool | None = None) -> None:
    """Set the page-cache behaviour of a store's reads (:mod:`mmreplay.read.advice`).

    ``enabled``: ``MADV_WILLNEED`` prefetch of each batch's pages (and of the next
    batch's, when known, from a background thread); None: on when the mapped leaves
    exceed half the memory available, else decided batch by batch from the disk reads.
    ``advise``: ``MADV_RANDOM`` for random rows, ``MADV_NORMAL`` for sequences; None: on
    in readers, in a writer only with the prefetch.
    """
    reader_for(store).configure(enabled, advise)


def set_rng(store: Readable, rng: Any) -> None:
    """Seed the generator ``sample(rng=None)`` uses (an int seed, a Generator, or None).

    Sampling with the store's own generator lets the next batch be drawn ahead and its
    pages prefetched in the background; with a seeded one the batches stay reproducible
    as long as the committed window does not change between them.
    """
    reader = reader_for(store)
    reader.gen = as_generator(rng)
    reader.pending = None


# --- one batch ----------------------------------------------------------------------


def sample(store: Readable, request: SampleRequest) -> Any:
    """The batch ``request`` asks of ``store`` (see :meth:`mmreplay.Store.sample`), drawn
    through ``request.sampler`` or the store's."""
    if store.closed:
        store.check_open()
    reader = reader_for(store)
    sampler = store.sampler if request.sampler is None else request.sampler
    if request.options:  # refused before anything is drawn
        request.check_options(sampler, store.path)
    batch_size = request.batch_size
    num_steps = sampler.num_steps if request.num_steps is None else request.num_steps
    steps = 1 if num_steps is None else num_steps
    out = request.out
    items = (batch_size,) if num_steps is None else (batch_size, num_steps)
    plans = None if request.layout is None else reader.plans(request.layout)
    transform = request.transform
    if transform is not None:  # checked before anything is drawn
        if out is not None or plans is not None:
            raise BadInputError(
                "sample: a transform cannot be combined with out= or layout=; sample without them"
            )
        pack = reader.packer(transform, store)
    if out is not None:  # checked before anything is drawn: a refused batch is left as it was
        arrays = reader.out_leaves(out, items, None if plans is None else [plan.shape for plan in plans])
    gen = request.rng
    draw = key = None
    if gen is None:
        gen = reader.own_gen()
        if reader.prefetch and getattr(sampler, "draws_ahead", False):
            # what a draw is made from: the window, and the episode ends of the committed
            # state, which a reader's refresh may move without the window (a writer's own
            # set() drops the draw made ahead)
            key = (request, store.window, store.state)
            if reader.pending is not None and reader.pending[0] == key:
                draw = reader.pending[1]
            reader.pending = None
    prefetched = draw is not None
    if not prefetched:
        try:
            if request.window is None:  # the common call
                draw = sampler.draw(store.window, request, batch_size, steps, gen)
            else:
                draw = _draw(store, sampler, request, batch_size, steps, gen)
        except NotEnoughDataError as exc:  # the draws know the window, not the store: say which
            if exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith(store.path):
                exc.args = (f"{store.path}: {exc.args[0]}", *exc.args[1:])
            raise
    rows = draw.start if num_steps is None else rows_of(draw.start, num_steps, reader.num_envs)
    if reader.advising:
        pattern = "random" if num_steps is None else "normal"
        if pattern is not reader.pattern or not reader.is_reader:
            reader.advise(pattern, store)
    if reader.prefetch:
        if not prefetched:
            reader.willneed(rows)
    elif num_steps is None and reader.disk_reads is not None:
        reader.willneed_if_cold(rows)
    if plans is not None:  # each leaf written in the layout as it is gathered
        got = [np.empty(rows.shape + plan.shape, plan.dtype) for plan in plans] if out is None else arrays
        if out is not None and len(rows) < batch_size:
            got = [arr[: len(rows)] for arr in got]
        for plan, arr in zip(plans, got):
            plan.fill(rows, arr)
    elif out is None:
        got = [take(rows) for take in reader.takes]
    else:
        if len(rows) < batch_size:  # without replacement, fewer items than asked
            arrays = [arr[: len(rows)] for arr in arrays]
        for take, arr in zip(reader.takes_into, arrays):
            take(rows, out=arr)
        got = arrays
    if reader.is_reader and store.live_first() > store.window.first:  # some may be overwritten
        takes = reader.takes if plans is None else [plan.take for plan in plans]
        draw = _redraw_overwritten(store, reader, sampler, request, draw, got, steps, num_steps, gen, takes)
    if transform is not None:
        got, draw = _transformed(store, reader, sampler, request, draw, got, steps, num_steps, gen)
        nest = pack(got)
    if key is not None:  # the next batch of an equal request: draw it now, prefetch its pages
        ahead = _draw(store, sampler, request, batch_size, steps, gen)
        reader.pending = (key, ahead)
        reader.prefetch_later(rows_of(ahead.start, num_steps, reader.num_envs))
    if transform is None:
        nest = out if out is not None and len(rows) == batch_size else reader.pack(got)
    if request.return_info:
        step = draw.step
        return nest, SampleInfo(step, draw.env, step % reader.capacity, draw.probability, draw.weight)
    return nest


def _draw(
    store: Readable, sampler: Drawing, request: SampleRequest, n: int, steps: int, gen: np.random.Generator
) -> Draw:
    """``n`` items drawn from the store's window (narrowed to ``request.window``)."""
    return sampler.draw(_window(store, request), request, n, steps, gen)


def _window(store: Readable, request: SampleRequest) -> Window:
    """The store's window, narrowed to ``request.window``."""
    window = store.window
    if request.window is not None:  # a caller's narrower window (framework layers' own views)
        first, end = request.window
        narrowed = window._replace(first=max(window.first, first), end=min(window.end, end))
        if narrowed.end <= narrowed.first and window.end > window.first:
            raise NotEnoughDataError(
                f"{store.path}: cannot sample: window={request.window} holds none of the steps retained, "
                f"[{window.first}, {window.end}): it is empty"
            )
        window = narrowed
    return window


def _transformed(
    store: Readable,
    reader: Reader,
    sampler: Drawing,
    request: SampleRequest,
    draw: Draw,
    got: list[np.ndarray],
    steps: int,
    num_steps: int | None,
    gen: np.random.Generator,
) -> tuple[dict[str, np.ndarray], Draw]:
    """The batch's leaves by path after ``request.transform``, and the final draw.

    In readers the transform's reads are checked as the drawn rows are: when the writer
    has since dropped a step it read, the reader moves to the writer's window, redraws
    the items that start before it and runs the transform again.
    """
    for _ in range(MAX_RESAMPLES):
        batch = DrawnBatch(store, _window(store, request), draw, num_steps, reader.paths, got, reader.takes, gen)
        leaves = {**batch.rows, **request.transform(batch)}
        if not reader.is_reader or store.live_first() <= batch.lowest:
            return leaves, draw
        store.refresh()
        draw = _redraw_overwritten(store, reader, sampler, request, draw, got, steps, num_steps, gen, reader.takes)
    raise NotEnoughDataError(
        f"{store.path}: the writer overwrote the rows a transform read {MAX_RESAMPLES} times in a row; "
        "the ring is too small for this reader"
    )


def _redraw_overwritten(
    store: Readable,
    reader: Reader,
    sampler: Drawing,
    request: SampleRequest,
    draw: Draw,
    out: list[np.ndarray],
    steps: int,
    num_steps: int | None,
    gen: np.random.Generator,
    takes: list[Any],
) -> Draw:
    """Seqlock for readers: redraw (and read again, with ``takes``) the items the writer
    overwrote while they were read, from the reader's window moved forward to the writer's."""
    num_envs = reader.num_envs
    replacement = request.replacement
    for _ in range(MAX_RESAMPLES):
        lowest = store.live_first()
        bad = draw.flat < lowest * num_envs  # the item's first step is older than the oldest retained
        if not bad.any():
            return draw
        store.refresh()
        if not replacement:  # redraw all, so the batch stays free of repeats
            bad[:] = True
        fresh = _draw(store, sampler, request, int(bad.sum()), steps, gen)
        if not replacement and len(fresh) != len(draw):
            raise NotEnoughDataError(
                f"{store.path}: fewer rows are retained now than were sampled; sample again"
            )
        fresh_rows = rows_of(fresh.start, num_steps, num_envs)
        for arr, take in zip(out, takes):
            arr[bad] = take(fresh_rows)
        flat, start, prob = draw.flat.copy(), draw.start.copy(), np.array(draw.probability)
        flat[bad], start[bad], prob[bad] = fresh.flat, fresh.start, fresh.probability
        weight = None
        if draw.weight is not None and fresh.weight is not None:
            weight = np.array(draw.weight)
            weight[bad] = fresh.weight
        draw = Draw(start, num_envs, prob, flat=flat, weight=weight)
    raise NotEnoughDataError(
        f"{store.path}: the writer overwrote the sampled rows {MAX_RESAMPLES} times in a row; "
        "the ring is too small for this reader"
    )


def read_rows(store: Readable, steps: Any, envs: Any) -> Any:
    """The spec's nest of the rows ``(steps, envs)`` (global step ids and env indices,
    broadcast together): each leaf ``[*shape_of_the_ids, *leaf_shape]``.

    Raises:
        NotEnoughDataError: a step is not committed and retained, or (readers) the
            writer overwrote it while it was read.
    """
    store.check_open()
    steps, envs = np.broadcast_arrays(np.asarray(steps, np.int64), np.asarray(envs, np.int64))
    if steps.size:
        check_steps(steps, *store.window[:2], store.path, "the steps retained are")
        if envs.min() < 0 or envs.max() >= store.num_envs:
            raise IndexError(f"{store.path}: env index out of range for {store.num_envs} envs")
    reader = reader_for(store)
    out = reader.take((steps % reader.capacity) * reader.num_envs + envs)
    if steps.size:
        check_retained(store, int(steps.min()))
    return reader.pack(out)


def check_retained(store: Readable, lowest: int, own_adds: bool = False) -> None:
    """The seqlock check of a reader: were the rows read, from step ``lowest`` on, still
    retained after the read? ``own_adds``: a writer's too, for reads made lazily (an
    episode of :func:`~mmreplay.episodes.episodes`), between which it may have added."""
    if store.mode != "r":
        if own_adds and lowest < store.first_step:
            raise OverwrittenError(
                f"{store.path}: step {lowest} was overwritten by this writer's own adds before it was "
                f"read (the oldest retained is now {store.first_step}); read it before adding more",
                store.path, lowest, store.first_step,
            )
        return
    first = store.live_first()
    if lowest < first:
        raise OverwrittenError(
            f"{store.path}: step {lowest} was overwritten by the writer while it was read "
            f"(the oldest retained is now {first}); call refresh() and read again",
            store.path, lowest, first,
        )


def steps_of(store: Readable, index: Any) -> tuple[np.ndarray | int, bool]:
    """Global step ids of a logical index over the retained steps, and whether it is one."""
    first, end = store.window[:2]
    n = end - first
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"{store.path}: index {i} out of range for {n} retained steps")
        return first + (i % n), True
    if isinstance(index, slice):
        return first + np.arange(n)[index], False
    idx = np.asarray(index)
    if idx.size == 0 and idx.dtype.kind == "f":  # [] reads as float64: no steps
        idx = idx.astype(np.int64)
    if idx.dtype.kind not in "iu":
        raise IndexError(f"{store.path}: expected an int, a slice or an integer array, got {idx.dtype}")
    if idx.size and (idx.min() < -n or idx.max() >= n):
        raise IndexError(f"{store.path}: index out of range for {n} retained steps")
    return first + (idx % max(n, 1)), False


def read_steps(store: Readable, steps: Any, leaves: list[int] | None = None) -> list[np.ndarray]:
    """Leaf arrays (flatten order) for global step ids, each ``[*steps.shape, num_envs, *shape]``.

    ``leaves`` picks leaves by their flatten-order index (default: all), for callers
    that handle one leaf at a time. Raises :class:`~mmreplay.NotEnoughDataError` when
    a step is not retained or was overwritten by the writer while it was read.
    """
    store.check_open()
    slots = np.asarray(steps, dtype=np.int64) % store.capacity
    read = store.leaves
    out = [np.array(leaf.read(slots)) for leaf in (read if leaves is None else [read[i] for i in leaves])]
    if np.size(steps):
        check_retained(store, int(np.min(steps)))
    return out


def get_steps(store: Readable, index: Any) -> Any:
    """Stored steps by logical index (0 = oldest retained, -1 = newest committed).

    An int gives the nest of ``[num_envs, *shape]`` arrays; a slice or an index array
    gives ``[k, num_envs, *shape]``. The arrays are copies.
    """
    store.check_open()
    steps, _ = steps_of(store, index)
    return unflatten(store.spec, read_steps(store, steps))
