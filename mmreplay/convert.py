"""Copy a store into a new one with another backend, chunking, compression or capacity.

The copy holds the source's retained committed steps in time order under the same
global step ids, with the same spec, roles, attrs and env count, and each episode keeps
its status: an episode whose start the ring overwrote is ``"open"`` in the copy too
(:func:`begin_at`, which imports share). It streams in bounded blocks, so a store larger
than RAM converts in bounded memory, and it reads the source as a reader, so a writer
may keep running (the copy is of the state when it started, less the oldest steps such
a writer overwrote before they were read: :func:`first_block`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .creation import create
from .episodes import continue_index, fresh_envs
from .errors import BadInputError, OverwrittenError, SpecError
from .files import AtomicOutput, check_target
from .spec import ArraySpec, flatten, to_spec, unflatten
from .statefile import StateFile
from .store import Store
from .store import open as open_store

__all__ = ["ConvertResult", "convert", "begin_at", "unwritten"]

BLOCK_BYTES = 32 << 20


@dataclass(frozen=True)
class ConvertResult:
    path: str
    steps: int
    backend: str
    capacity: int


def begin_at(store: Store, first_step: int, fresh: Any) -> Store:
    """Make a new, empty store continue another's history at global step ``first_step``.

    ``store`` is the writer :func:`mmreplay.create` returned; it is closed and the store
    reopened for writing with its cursor at ``first_step`` (``total_steps`` and step ids
    then match the source's) and its episode index told which envs' episodes start
    whole there (``fresh``, from :func:`mmreplay.episodes.fresh_envs`). The others'
    first episodes began before the copy and stay ``"open"``.
    """
    path, meta = store.path, store.metadata
    if store.total_steps:
        raise ValueError(f"{path}: begin_at needs an empty store, it holds {store.total_steps} steps")
    store.close()
    if first_step:
        fsync = meta.durability == "power"
        state_file = StateFile(path, writable=True)
        try:
            state = state_file.read()
            state_file.write(state.next(start=first_step, end=first_step, reserved=first_step), fsync)
        finally:
            state_file.close()
        continue_index(path, first_step, fresh, fsync)
    return open_store(path, mode="a")


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    backend: str | None = None,
    compression: Any = "same",
    chunk_steps: Any = None,
    capacity: int | None = None,
    commit_every: int | None = None,
    progress: Callable[[int], Any] | None = None,
    new_leaves: Mapping[str, ArraySpec] | None = None,
    sampler: Mapping[str, Any] | None = None,
) -> ConvertResult:
    """Write a copy of the store at ``src`` to the new path ``out``.

    Args:
        src: the source store.
        out: the new store's path: it must not exist, and may not lie inside ``src``.
        backend: ``"zarr"`` or ``"hdf5"``; default the source's.
        compression: as :func:`mmreplay.create`; ``"same"`` keeps each leaf's codec,
            ``None`` stores every leaf uncompressed (memory-mapped).
        chunk_steps: as :func:`mmreplay.create`; default the source's per-leaf chunking.
        capacity: steps the copy holds; default the source's. A smaller capacity keeps
            the newest steps.
        commit_every: default the source's.
        progress: called with the rows (steps x envs) copied after each block.
        new_leaves: leaves the copy adds to a dict spec, reading NaN (floating dtypes)
            or zero in every copied step.
        sampler: the copy's sampler as recorded (``Sampler.state_json()``: its name and
            options); default the source's. Priorities are not copied.
    """
    src = os.fspath(src)
    out = check_target(out, [src], what="converted store")
    with open_store(src, mode="r") as store:
        meta = store.metadata
        # the spec's leaves: a copy of a store that keeps each frame once keeps every leaf,
        # a derived next observation as its observation's frames are kept
        stored = {leaf.path: leaf for leaf in meta.leaves}
        pairs = meta.frames.pairs if meta.frames is not None else ()
        stored.update({p.next: stored[p.obs] for p in pairs if p.next is not None and p.next not in stored})
        leaves = [(path, stored[path]) for path in store.leaf_paths]
        kept = compression == "same"
        if kept:
            compression = {path: leaf.compression for path, leaf in leaves if leaf.compression}
        if chunk_steps is None and backend in (None, meta.backend) and capacity in (None, meta.capacity):
            chunk_steps = {path: leaf.chunk_steps for path, leaf in leaves}
        cap = meta.capacity if capacity is None else capacity  # 0 is create's to refuse
        first, end = store.first_step, store.committed_steps
        first = max(first, end - cap)
        spec, added = store.spec, to_spec(dict(new_leaves or {}), "new_leaves")
        nests = {p: new_leaves[p] for p, v in added.items() if not isinstance(v, ArraySpec)}
        if nests:
            raise SpecError(f"new_leaves {nests}: expected an array spec for each leaf, such as ArraySpec((), 'float32')")
        if added:
            if not isinstance(spec, dict) or set(spec) & set(added):
                raise ValueError(f"{src}: new leaves {sorted(added)} need a dict spec without them")
            spec = {**spec, **added}
        recorded = dict(store.sampler.state_json() if sampler is None else sampler)
        if "name" not in recorded:
            raise BadInputError(f"sampler {sampler!r}: expected its name and options, as Sampler.state_json() gives")
        with AtomicOutput(out, "folder", "converted store") as scratch:
            try:
                dst = create(
                    scratch.tmp,
                    spec,
                    capacity=cap,
                    num_envs=meta.num_envs,
                    backend=backend or meta.backend,
                    chunk_steps=chunk_steps,
                    compression=compression,
                    commit_every=meta.commit_every if commit_every is None else commit_every,
                    durability=meta.durability,
                    roles=meta.roles,
                    sampler=recorded.pop("name"),
                    **recorded,
                )
            except SpecError as exc:  # a codec the new backend cannot take, kept rather than asked for
                if not kept or "compression" not in str(exc):
                    raise
                raise SpecError(f"{exc} (kept from the source: choose one with compression=, --compression)") from None
            try:
                if meta.attrs:
                    dst.set_attrs(**meta.attrs)
                step_bytes = max(1, meta.num_envs * sum(s.nbytes for s in flatten(spec)))
                k = max(1, BLOCK_BYTES // step_bytes)
                first, values = first_block(store, first, end, k)
                dst = begin_at(dst, first, fresh_envs(store, first))
                for a in range(first, end, k):
                    b = min(end, a + k)
                    try:
                        values = values if a == first else store.read_steps(np.arange(a, b))
                    except OverwrittenError as exc:
                        raise exc.by("the copy") from None
                    steps = unflatten(store.spec, values)
                    if added:
                        steps.update(
                            {p: unwritten((b - a, meta.num_envs, *s.shape), s.dtype) for p, s in added.items()}
                        )
                    dst.extend(steps)
                    if progress is not None:
                        progress((b - a) * meta.num_envs)
            finally:
                dst.close()
            return ConvertResult(scratch.commit(), end - first, dst.backend, cap)


def first_block(store: Store, first: int, end: int, k: int) -> tuple[int, list[np.ndarray]]:
    """The copy's first step and its first block's values. A writer still running on a
    full ring overwrites its oldest steps first, those the copy reads first: the copy
    then starts past them, ahead by twice as many steps as were lost during the read."""
    for _ in range(5):
        try:
            return first, store.read_steps(np.arange(first, min(end, first + k)))
        except OverwrittenError as exc:
            error = exc.by("the copy")
            if exc.oldest >= end - 1:
                break
            first = min(end - 1, exc.oldest + 2 * (exc.oldest - first))
    raise error from None


def unwritten(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Values of rows never written: NaN for floating dtypes, zero otherwise."""
    return np.full(shape, np.nan if dtype.kind in "fc" else 0, dtype)

