"""The index math of a draw: a window, sizes and an rng in, row ids out.

Nothing here touches a file. A sampler is handed the store's committed :class:`Window`
(the oldest retained global step id ``first``, the end ``end``, ``num_envs``,
``capacity``) and, to stay inside episodes, the episode spans; it returns a
:class:`Draw`, from which the gather takes the flat row ids ``slot * num_envs + env``
that every leaf reads with one ``take``.

Uniform draws are uniform over the valid *starts*: a start is a (step, env) pair whose
``num_steps`` window stays inside the window (and, with episodes, inside one span), so
every valid sequence is equally likely and, for ``num_steps=1``, every row is.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import NotEnoughDataError

__all__ = ["Draw", "Window", "check_steps", "draw_in_spans", "draw_uniform", "rows_of", "too_short"]


class Window(NamedTuple):
    """The steps a draw may use: global ids ``[first, end)`` of ``num_envs`` envs each,
    stored in a ring of ``capacity`` slots."""

    first: int
    end: int
    num_envs: int
    capacity: int

    @property
    def steps(self) -> int:
        """Steps in the window."""
        return max(0, self.end - self.first)


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


def _pick(n: int, batch_size: int, replacement: bool, gen: np.random.Generator) -> np.ndarray:
    if replacement:
        return gen.integers(0, n, size=batch_size, dtype=np.int64)
    return gen.choice(n, size=min(batch_size, n), replace=False).astype(np.int64, copy=False)


def draw_uniform(
    window: Window, batch_size: int, num_steps: int, replacement: bool, gen: np.random.Generator
) -> Draw:
    """Starts drawn uniformly over every (step, env) whose ``num_steps`` steps lie in the
    window (narrow it with ``window._replace(first=...)``).

    Raises:
        NotEnoughDataError: the window is empty or shorter than ``num_steps``.
    """
    first, end, num_envs, capacity = window
    stored = end - first
    if num_steps > stored:
        raise too_short(stored, num_steps)
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


def too_short(stored: int, num_steps: int) -> NotEnoughDataError:
    """The error of a draw of ``num_steps`` steps from a window of ``stored`` (fewer) steps."""
    if stored <= 0:
        return NotEnoughDataError("cannot sample: the store holds no committed steps (it is empty)")
    return NotEnoughDataError(
        f"cannot sample sequences of num_steps={num_steps}: only {stored} committed steps are "
        f"retained, too short (each env's stream is at most {stored} steps long)"
    )


def draw_in_spans(
    span_env: np.ndarray,
    span_first: np.ndarray,
    span_length: np.ndarray,
    window: Window,
    batch_size: int,
    num_steps: int,
    replacement: bool,
    gen: np.random.Generator,
) -> Draw:
    """Starts drawn uniformly over every window of ``num_steps`` that fits inside one span
    (of the ring ``window`` describes).

    Raises:
        NotEnoughDataError: no span exists, or none is ``num_steps`` long.
    """
    num_envs, capacity = window.num_envs, window.capacity
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


def check_steps(steps: np.ndarray, first: int, end: int, where: str, what: str) -> int:
    """The oldest of ``steps`` (global ids; ``end`` if there are none), checked to lie in
    ``[first, end)``.

    Raises:
        NotEnoughDataError: ``"{where}: steps [lo, hi] asked, {what} [first, end)"``.
    """
    if not steps.size:
        return end
    lo, hi = int(steps.min()), int(steps.max())
    if lo < first or hi >= end:
        raise NotEnoughDataError(f"{where}: steps [{lo}, {hi}] asked, {what} [{first}, {end})")
    return lo
