"""Indices for sampling and deterministic passes: sizes, a window and an rng in, ids out.

Nothing here touches a file. The store hands in its committed window (the oldest
retained global step id ``first`` and the committed end ``end``), ``num_envs``,
``capacity`` and, for episode-aware sampling, the episode spans; these functions return
global step ids, env ids and the flat row ids ``slot * num_envs + env`` that the leaves
gather with one ``take`` each.

Sampling is uniform over the valid *starts*: a start is a (step, env) pair whose
``num_steps`` window stays inside the window (and, with episodes, inside one span), so
every valid sequence is equally likely and, for ``num_steps=1``, every row is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import NotEnoughDataError

__all__ = [
    "Draw",
    "as_generator",
    "check_sizes",
    "draw_uniform",
    "draw_in_spans",
    "rows_of",
    "pass_windows",
    "pass_batches",
]


@dataclass(frozen=True)
class Draw:
    """Where sampled items start: global step id, env, and the probability of each draw."""

    step: np.ndarray
    env: np.ndarray
    probability: np.ndarray

    def __len__(self) -> int:
        return len(self.step)


def as_generator(rng: Any) -> np.random.Generator:
    """A numpy Generator from an int seed, a Generator, or None (fresh OS entropy)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, (int, np.integer)) and not isinstance(rng, bool)):
        return np.random.default_rng(rng)
    raise TypeError(f"rng must be an int seed, None or a numpy.random.Generator, got {type(rng).__name__}")


def _positive(name: str, value: Any, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def check_sizes(batch_size: Any, num_steps: Any, window_shift: Any = None) -> tuple[Any, Any, Any]:
    """Validated ``(batch_size, num_steps, window_shift)``; only batch_size may not be None
    when sampling, which the caller checks."""
    return (
        _positive("batch_size", batch_size),
        _positive("num_steps", num_steps),
        _positive("window_shift", window_shift),
    )


def _pick(n: int, batch_size: int, replacement: bool, gen: np.random.Generator) -> np.ndarray:
    if replacement:
        return gen.integers(0, n, size=batch_size, dtype=np.int64)
    return gen.choice(n, size=min(batch_size, n), replace=False).astype(np.int64, copy=False)


def draw_uniform(
    first: int,
    end: int,
    num_envs: int,
    batch_size: int,
    num_steps: int,
    replacement: bool,
    gen: np.random.Generator,
) -> Draw:
    """Starts drawn uniformly over every (step, env) whose window fits in ``[first, end)``.

    Raises:
        NotEnoughDataError: the window is empty or shorter than ``num_steps``.
    """
    stored = end - first
    if stored <= 0:
        raise NotEnoughDataError("cannot sample: the store holds no committed steps (it is empty)")
    if num_steps > stored:
        raise NotEnoughDataError(
            f"cannot sample sequences of num_steps={num_steps}: only {stored} committed steps are "
            f"retained, too short (each env's stream is at most {stored} steps long)"
        )
    n = (stored - num_steps + 1) * num_envs
    k = _pick(n, batch_size, replacement, gen)
    flat = first * num_envs + k  # (step, env) pairs in step-major order
    step = flat // num_envs
    return Draw(step, flat - step * num_envs, np.full(len(k), 1.0 / n))


def draw_in_spans(
    span_env: np.ndarray,
    span_first: np.ndarray,
    span_length: np.ndarray,
    batch_size: int,
    num_steps: int,
    replacement: bool,
    gen: np.random.Generator,
) -> Draw:
    """Starts drawn uniformly over every window of ``num_steps`` that fits inside one span.

    Raises:
        NotEnoughDataError: no span exists, or none is ``num_steps`` long.
    """
    if len(span_length) == 0:
        raise NotEnoughDataError("cannot sample within episodes: the store holds no committed steps (it is empty)")
    starts = np.maximum(np.asarray(span_length, np.int64) - (num_steps - 1), 0)
    cum = np.cumsum(starts)
    total = int(cum[-1])
    if total == 0:
        raise NotEnoughDataError(
            f"cannot sample sequences of num_steps={num_steps} within episodes: the longest retained "
            f"episode has {int(np.max(span_length))} steps, too short"
        )
    k = _pick(total, batch_size, replacement, gen)
    span = np.searchsorted(cum, k, side="right")
    offset = k - (cum[span] - starts[span])
    return Draw(
        np.asarray(span_first, np.int64)[span] + offset,
        np.asarray(span_env, np.int64)[span],
        np.full(len(k), 1.0 / total),
    )


def rows_of(step: np.ndarray, env: np.ndarray, num_steps: int | None, capacity: int, num_envs: int) -> np.ndarray:
    """Flat row ids ``slot * num_envs + env``: ``[B]``, or ``[B, T]`` for sequences."""
    if num_steps is None:
        return (step % capacity) * num_envs + env
    steps = step[:, None] + np.arange(num_steps, dtype=np.int64)
    return (steps % capacity) * num_envs + env[:, None]


# --- deterministic passes -----------------------------------------------------------


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
