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


class Draw:
    """Where sampled items start, and the probability of each draw.

    ``start`` holds the row ids ``slot * num_envs + env`` of each item's first step, not
    yet folded into the ring: they lie in ``[0, 2 * capacity * num_envs)`` and the
    gathers wrap them (``take(mode="wrap")``), which spares a modulo pass on the hot
    path. The global flat ids ``step * num_envs + env``, and from them ``step`` and
    ``env``, are derived only when asked. ``weight`` holds importance-sampling weights
    from samplers that give them (None otherwise).
    """

    __slots__ = ("start", "num_envs", "p", "_shift", "_flat", "weight")

    def __init__(
        self,
        start: np.ndarray,
        num_envs: int,
        p: float | np.ndarray,
        shift: int | None = None,
        flat: np.ndarray | None = None,
        weight: np.ndarray | None = None,
    ):
        self.start = start
        self.num_envs = num_envs
        self.p = p
        self._shift = shift
        self._flat = flat
        self.weight = weight  # importance-sampling weights, from samplers that give them

    @property
    def flat(self) -> np.ndarray:
        """Global flat ids ``step * num_envs + env`` of each item's first step."""
        return self._flat if self._flat is not None else self.start + self._shift

    @property
    def step(self) -> np.ndarray:
        return self.flat // self.num_envs

    @property
    def env(self) -> np.ndarray:
        return self.flat % self.num_envs

    @property
    def probability(self) -> np.ndarray:
        if np.ndim(self.p):
            return self.p
        return np.full(len(self.start), self.p)

    def __len__(self) -> int:
        return len(self.start)


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
    capacity: int,
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
    if num_steps > stored:
        if stored <= 0:
            raise NotEnoughDataError("cannot sample: the store holds no committed steps (it is empty)")
        raise NotEnoughDataError(
            f"cannot sample sequences of num_steps={num_steps}: only {stored} committed steps are "
            f"retained, too short (each env's stream is at most {stored} steps long)"
        )
    n = (stored - num_steps + 1) * num_envs
    # The valid starts are n consecutive rows from the first step's slot, running past
    # the ring's end (the gathers wrap them).
    offset = (first % capacity) * num_envs
    if replacement:
        k = gen.integers(offset, offset + n, batch_size)
    else:
        k = _pick(n, batch_size, False, gen)
        k += offset
    return Draw(k, num_envs, 1.0 / n, first * num_envs - offset)


def draw_in_spans(
    span_env: np.ndarray,
    span_first: np.ndarray,
    span_length: np.ndarray,
    num_envs: int,
    capacity: int,
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
        raise NotEnoughDataError(
            "cannot sample within episodes: the store holds no committed steps (it is empty)"
        )
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
    step = np.asarray(span_first, np.int64)[span] + offset
    flat = step * num_envs + np.asarray(span_env, np.int64)[span]
    return Draw(flat % (capacity * num_envs), num_envs, 1.0 / total, flat=flat)


def rows_of(start: np.ndarray, num_steps: int | None, num_envs: int) -> np.ndarray:
    """Row ids of items starting at rows ``start``: ``[B]``, or ``[B, T]`` for sequences
    (the next step of the same env is ``num_envs`` rows on). Not folded into the ring:
    gather them with ``take(mode="wrap")`` or reduce them modulo ``capacity * num_envs``."""
    if num_steps is None:
        return start
    return start[:, None] + np.arange(0, num_steps * num_envs, num_envs, dtype=np.int64)


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


def env_group_batches(num_envs: int, per_env: int, group_size: int | None, drop_remainder: bool) -> Iterator[np.ndarray]:
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
