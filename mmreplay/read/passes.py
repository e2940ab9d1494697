"""Deterministic passes: every retained row once, env by env in time order.

A pass cuts each env's stream into windows of ``num_steps`` (:func:`pass_windows`),
groups them into batches (:func:`pass_batches`, or :func:`env_group_batches` for
TF-Agents' order) and reads each batch with one ``take`` per leaf. A pass cannot draw
again, so one the writer (another process's, or the store's own adds) overtakes raises
:class:`~mmreplay.NotEnoughDataError` instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import NotEnoughDataError, OverwrittenError
from .gather import reader_for
from .readable import Readable
from .request import as_generator, positive, step_range

__all__ = ["env_group_batches", "iterate", "pass_batches", "pass_windows"]


def iterate(
    store: Readable,
    batch_size: int | None = None,
    num_steps: int | None = None,
    window_shift: int | None = None,
    drop_remainder: bool = False,
    shuffle: bool = False,
    rng: Any = None,
    *,
    window: tuple[int, int] | None = None,
    group_envs: bool = False,
    return_steps: bool = False,
) -> Iterator[Any]:
    """One deterministic pass over every retained row (a writer's uncommitted ones too), env by env in time order.

    The window is read when this is called. Items are windows of ``num_steps``
    starting every ``window_shift`` steps (default ``num_steps``) within one env's
    stream; the shorter windows at the end of a stream are kept unless
    ``drop_remainder``. With ``batch_size``, windows are stacked: full windows
    first, then the shorter ones grouped by length; a last smaller batch is kept
    unless ``drop_remainder``. ``shuffle`` permutes the windows with ``rng``.
    ``window=(first, end)`` limits the pass to those global step ids (within
    the store's ``window``). ``group_envs`` makes each batch the same window of
    ``batch_size`` consecutive envs, env group by env group, each in time order
    (TF-Agents' order; a last smaller group is kept unless ``drop_remainder``, and
    a pass that drops everything yields nothing instead of raising).
    ``return_steps`` yields ``(batch, steps, envs)``: the global step id and env of
    each of the batch's rows, shaped as its outer axes.

    Yields:
        Nests of ``[*shape]`` (no sizes), ``[n, *shape]`` (``num_steps`` or
        ``batch_size``), or ``[batch, n, *shape]`` (both).

    Example:
        >>> import mmreplay as mr, numpy as np, tempfile
        >>> store = mr.create(tempfile.mkdtemp() + "/b", {"x": mr.ArraySpec((), "int64")}, 5)
        >>> store.extend({"x": np.arange(5).reshape(5, 1)}); store.commit()
        >>> [b["x"].tolist() for b in store.iterate(num_steps=2)]
        [[0, 1], [2, 3], [4]]
    """
    store.check_open()
    batch_size = positive("batch_size", batch_size, allow_none=True)
    num_steps = positive("num_steps", num_steps, allow_none=True)
    window_shift = positive("window_shift", window_shift, allow_none=True)
    if window_shift is not None and num_steps is None:
        raise ValueError("window_shift needs num_steps: it is the step between the starts of two windows")
    if group_envs and shuffle:
        raise ValueError("group_envs keeps the pass order: it cannot be shuffled")
    first, end = store.window[:2]
    if window is not None:  # a caller's narrower window (framework layers' own views)
        lo, hi = step_range("window", window)
        first, end = max(first, lo), min(end, hi)
    env, start, length = pass_windows(first, end, store.num_envs, num_steps, window_shift, drop_remainder)
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
        groups = env_group_batches(store.num_envs, len(env) // store.num_envs, batch_size, drop_remainder)
    else:
        groups = pass_batches(length, batch_size, drop_remainder, as_generator(rng) if shuffle else None)
    reader = reader_for(store)
    capacity, num_envs = reader.capacity, reader.num_envs

    def ids_for(group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global step ids and envs of the group's rows, in the shape of the batch's outer axes."""
        n = int(length[group[0]])
        steps = start[group][:, None] + np.arange(n, dtype=np.int64)
        envs = np.broadcast_to(env[group][:, None], steps.shape)
        if num_steps is None:
            steps, envs = steps[:, 0], envs[:, 0]
        return (steps, envs) if batch_size is not None else (steps[0], envs[0])

    def rows_for(group: np.ndarray) -> np.ndarray:
        steps, envs = ids_for(group)
        return (steps % capacity) * num_envs + envs

    def batches() -> Iterator[Any]:
        pattern = "random" if shuffle and num_steps is None else "normal"
        group = next(groups, None)
        while group is not None:
            store.check_open()
            rows = rows_for(group)
            nxt = next(groups, None)
            if reader.advising:
                reader.advise(pattern, store)
            if reader.prefetch and shuffle and nxt is not None:
                reader.prefetch_later(rows_for(nxt))
            elif pattern == "random" and reader.disk_reads is not None:
                reader.willneed_if_cold(rows)
            out = reader.take(rows)
            # a reader sees the writer's commits; a writer's own adds (committed or not) reuse slots too
            oldest = store.live_first() if store.mode == "r" else store.total_steps - capacity
            lowest = int(start[group].min())
            if lowest < oldest:
                raise OverwrittenError(
                    f"{store.path}: step {lowest} was overwritten by the writer during the pass; "
                    "a pass over a ring being written must keep ahead of the writer",
                    store.path, lowest, oldest,
                )
            yield (reader.pack(out), *ids_for(group)) if return_steps else reader.pack(out)
            group = nxt

    return batches()


def pass_windows(
    first: int,
    end: int,
    num_envs: int,
    num_steps: int | None,
    window_shift: int | None,
    drop_remainder: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Windows ``(env, start, length)`` of one pass, env by env, each env in time order.

    Windows of ``num_steps`` start every ``window_shift`` steps (default ``num_steps``);
    the shorter windows at the end of each env's stream are kept unless
    ``drop_remainder``. Without ``num_steps`` every row is a window of one step.
    """
    stored = max(0, end - first)
    size = 1 if num_steps is None else num_steps
    shift = size if window_shift is None else window_shift
    offsets = np.arange(0, stored, shift, dtype=np.int64)
    lengths = np.minimum(size, stored - offsets)
    if drop_remainder:
        keep = lengths == size
        offsets, lengths = offsets[keep], lengths[keep]
    per_env = len(offsets)
    env = np.repeat(np.arange(num_envs, dtype=np.int64), per_env)
    return env, np.tile(first + offsets, num_envs), np.tile(lengths, num_envs)


def pass_batches(
    lengths: np.ndarray,
    batch_size: int | None,
    drop_remainder: bool,
    gen: np.random.Generator | None,
) -> Iterator[np.ndarray]:
    """Groups of window indices, one group per yielded batch.

    Windows of equal length are batched together: first the full windows in pass order
    (or shuffled with ``gen``), then the shorter end-of-stream windows grouped by length,
    longest first. A last smaller batch of each group is kept unless ``drop_remainder``.
    Without ``batch_size`` each window is its own group, in pass order or shuffled.
    """
    n = len(lengths)
    if batch_size is None:
        order = gen.permutation(n) if gen is not None else np.arange(n)
        for i in order:
            yield np.array([i])
        return
    if n == 0:
        return
    for length in np.unique(lengths)[::-1]:
        group = np.flatnonzero(lengths == length)
        if gen is not None:
            group = gen.permutation(group)
        stop = len(group) - len(group) % batch_size if drop_remainder else len(group)
        for i in range(0, stop, batch_size):
            yield group[i : i + batch_size]


def env_group_batches(
    num_envs: int, per_env: int, group_size: int | None, drop_remainder: bool
) -> Iterator[np.ndarray]:
    """Groups of window indices (as :func:`pass_windows` orders them) for a pass that
    stacks the same window of ``group_size`` consecutive envs: env group by env group,
    each in time order (TF-Agents' deterministic pass). A last smaller env group is kept
    unless ``drop_remainder``; without ``group_size`` each env is its own group.
    """
    size = 1 if group_size is None else group_size
    for lo in range(0, num_envs, size):
        envs = np.arange(lo, min(lo + size, num_envs), dtype=np.int64)
        if drop_remainder and len(envs) < size:
            continue
        for w in range(per_env):
            yield envs * per_env + w
