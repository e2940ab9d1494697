"""Prioritized replay (Schaul et al., 2016) whose priorities live in the buffer's folder.

Each row has a priority in ``priorities.bin`` (:mod:`mmreplay.priorities`); a sum tree
over ``priority ** alpha`` (:mod:`mmreplay.sumtree`) draws rows with probability
``P(i) = p_i^alpha / sum_k p_k^alpha`` and gives the importance weights
``w_i = (N * P(i)) ** -beta / max_j w_j``. The tree is process memory, built from the
mapped file at the first draw (never at open) and then kept in step with the window:
rows the writer commits are loaded from the file, rows that leave the window are
zeroed. Each process's tree sees its own updates and the rows committed by the writer;
another process's updates reach it when it reopens the store.

New steps get the running maximum priority when they are committed (the writer does
not touch the file per add). A learner, in any process, calls
``store.update_priorities(info.step, info.env, priorities)``; updates for steps the ring
has since dropped are ignored, never applied to the rows that replaced them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.random import Generator

from ..errors import BadInputError, NotEnoughDataError, ReadOnlyError
from ..priorities import PRIORITY_FILE, PriorityFile
from ..read.draws import too_short
from ..read.request import SampleRequest, number, positive
from ..statefile import slot_ranges
from ..sumtree import SumTree
from .base import Draw, Host, Mass, Sampler, Window

__all__ = ["PrioritizedSampler", "priority_refusal"]

REDUCTIONS = ("start", "max", "mean")
# the priorities are stored as float32: a larger one would be stored as inf
LARGEST = float(np.finfo(np.float32).max)


def priority_refusal(where: str, p: np.ndarray, bad: np.ndarray, bound: str = "") -> BadInputError:
    """The error of priorities ``p`` where ``bad`` marks those refused (negative, NaN...)."""
    return BadInputError(
        f"{where}: priorities must be finite and >= 0{bound}; {int(bad.sum())} are not "
        f"(the first is {float(p[bad][0])!r} at position {np.argwhere(bad)[0].tolist()})"
    )


def _check_envs(store: Host, env: np.ndarray) -> None:
    # one reduction for both bounds: a negative env reads as a huge unsigned number
    if env.size and env.view(np.uint64).max() >= store.num_envs:
        raise BadInputError(f"{store.path}: env index out of range for {store.num_envs} envs")


def _across_episodes(within_episodes: bool | None) -> None:
    if within_episodes:
        raise ValueError(
            "the prioritized sampler draws sequences across episode ends; within_episodes=True is not "
            "supported (leave it unset or False)"
        )


class PrioritizedSampler(Sampler):
    """Rows (or the starts of ``num_steps`` sequences) drawn in proportion to
    ``priority ** alpha``, with importance weights in ``SampleInfo.weight``.

    Args:
        alpha: how much the priorities count (0: uniform).
        beta: the default importance-weight exponent; ``sample(..., beta=...)`` overrides it.
        eps: added to every priority given to :meth:`update_priorities`, so no row's
            probability is zero (TorchRL's ``eps``).
        num_steps: the sequence length ``sample`` returns by default (None: single steps).
        sequence_priority: how ``[B, T]`` priorities (one per step of each sampled
            sequence) become the sequence's priority, kept on its first row: ``"start"``,
            ``"max"``, ``"mean"``, or a number ``eta`` in [0, 1] for R2D2's
            ``eta * max + (1 - eta) * mean``.
    """

    name = "prioritized"
    options = frozenset({"beta"})

    def __init__(
        self,
        alpha: float = 0.6,
        beta: float = 0.4,
        eps: float = 1e-8,
        num_steps: int | None = None,
        sequence_priority: str | float = 0.9,
    ) -> None:
        self.alpha = number("alpha", alpha, 0.0)
        self.beta = number("beta", beta, 0.0)
        self.eps = number("eps", eps, 0.0)
        self.num_steps = positive("num_steps", num_steps, allow_none=True)
        if isinstance(sequence_priority, str):
            if sequence_priority not in REDUCTIONS:
                raise ValueError(
                    f"sequence_priority must be one of {REDUCTIONS} or a number in [0, 1], got {sequence_priority!r}"
                )
        else:
            sequence_priority = number("sequence_priority", sequence_priority, 0.0, 1.0)
        self.sequence_priority = sequence_priority
        self.file: PriorityFile | None = None
        self.tree: SumTree | None = None
        self.tree_first = self.tree_end = 0  # the steps whose rows the tree holds
        self.filled = 0  # writer: steps before this have their priority in the file

    def state_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "alpha": self.alpha,
            "beta": self.beta,
            "eps": self.eps,
            "num_steps": self.num_steps,
            "sequence_priority": self.sequence_priority,
        }

    # --- life cycle ---------------------------------------------------------------------

    def attach(self, store: Host) -> None:
        self.store = store
        if store.mode == "a":
            if not os.path.exists(os.path.join(store.path, PRIORITY_FILE)):
                PriorityFile.create(store.path, store.capacity, store.num_envs, self.alpha)
            self.file = PriorityFile(store.path, store.capacity, store.num_envs, writable=True)
            self.filled = store.committed_steps

    def _file(self) -> PriorityFile:
        """The mapped priorities; a reader maps them at first use, writable if it may."""
        if self.file is None:
            store = self.store
            try:
                self.file = PriorityFile(store.path, store.capacity, store.num_envs, writable=True)
            except ReadOnlyError:
                self.file = PriorityFile(store.path, store.capacity, store.num_envs, writable=False)
        return self.file

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        self.file = self.tree = None
        self.store = None

    # --- write hooks (writer only) -----------------------------------------------------

    def _fill(self, upto: int) -> None:
        """Give steps ``[filled, upto)`` the running maximum, under the lock."""
        if upto <= self.filled:
            return
        file = self.file
        with file:
            top = np.float32(file.max_priority)
            for x, y in slot_ranges(self.filled, upto, self.store.capacity):
                file.values[x:y] = top
        self.filled = upto

    def on_commit(self, old_end: int, new_end: int, fsync: bool) -> None:
        self._fill(new_end)
        if fsync:
            self.file.sync()

    def on_set(self, steps: np.ndarray) -> None:
        steps = np.asarray(steps, np.int64).reshape(-1)
        self._fill(self.store.total_steps)
        file = self.file
        with file:
            file.values[steps % self.store.capacity] = np.float32(file.max_priority)
        if self.tree is not None:
            self._load(steps[(steps >= self.tree_first) & (steps < self.tree_end)])

    def on_clear(self, end: int) -> None:
        self.filled = max(self.filled, end)
        if self.tree is not None:
            self.tree.build(np.zeros(self.tree.n))
            self.tree_first = self.tree_end = end

    # --- the tree -----------------------------------------------------------------------

    def _weights(self, priorities: np.ndarray) -> np.ndarray:
        return np.power(priorities, self.alpha, dtype=np.float64)

    def _load(self, steps: np.ndarray) -> None:
        """Reload the tree leaves of whole steps from the file."""
        capacity, num_envs = self.store.capacity, self.store.num_envs
        slots = np.unique(steps % capacity)
        rows = (slots[:, None] * num_envs + np.arange(num_envs)).reshape(-1)
        self.tree.set(rows, self._weights(self.file.values[slots].reshape(-1)), ascending=True)

    def _set_steps(self, a: int, b: int, load: bool) -> None:
        num_envs = self.store.num_envs
        for x, y in slot_ranges(a, b, self.store.capacity):
            values = self._weights(self.file.values[x:y].reshape(-1)) if load else 0.0
            self.tree.set_range(x * num_envs, y * num_envs, values)

    def sync(self, window: Window) -> None:
        """Make the tree hold exactly the rows of the window's steps."""
        if self.store.mode == "a":
            self._fill(max(window.end, self.store.total_steps))
        file = self._file()
        f, e = window.first, window.end
        if (
            self.tree is None
            or e - self.tree_end >= window.capacity
            or f >= self.tree_end
            or f < self.tree_first
        ):
            if self.tree is None:
                self.tree = SumTree(window.capacity * window.num_envs)
            weights = self._weights(file.values.reshape(-1))
            if e - f < window.capacity:
                keep = np.zeros(window.capacity, bool)
                for x, y in slot_ranges(f, e, window.capacity):
                    keep[x:y] = True
                weights[~np.repeat(keep, window.num_envs)] = 0.0
            self.tree.build(weights)
        else:
            self._set_steps(self.tree_first, min(f, self.tree_end), load=False)
            if e < self.tree_end:  # a narrower window= than the last draw's: its newer steps leave
                self._set_steps(e, self.tree_end, load=False)
            self._set_steps(max(self.tree_end, f), e, load=True)
        self.tree_first, self.tree_end = f, e

    # --- draws --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _starts(self, window: Window, num_steps: int) -> Iterator[SumTree]:
        """The tree in step with the window, holding only the rows a ``num_steps``
        sequence may start at: a sequence must end inside the window, so the last
        ``num_steps - 1`` steps start none."""
        self.sync(window)
        tree, num_envs = self.tree, window.num_envs
        tail = slot_ranges(window.end - num_steps + 1, window.end, window.capacity)
        saved = [tree.leaves()[x * num_envs : y * num_envs].copy() for x, y in tail]
        for x, y in tail:
            tree.set_range(x * num_envs, y * num_envs, 0.0)
        try:
            yield tree
        finally:
            for (x, y), values in zip(tail, saved):
                tree.set_range(x * num_envs, y * num_envs, values)

    def mass(self, window: Window, request: SampleRequest, steps: int) -> Mass:
        """The sum and the smallest of ``priority ** alpha`` over the valid starts."""
        _across_episodes(request.within_episodes)
        if window.steps < steps:
            return Mass(0.0, np.inf)
        with self._starts(window, steps) as tree:
            return Mass(tree.total, tree.min)

    def draw(self, window: Window, request: SampleRequest, size: int, steps: int, rng: Generator) -> Draw:
        if not request.replacement:
            raise ValueError("the prioritized sampler draws with replacement; pass replacement=True")
        _across_episodes(request.within_episodes)
        beta = request.options.get("beta")
        beta = self.beta if beta is None else number("beta", beta, 0.0)
        f, e, capacity, num_envs = window.first, window.end, window.capacity, window.num_envs
        if e - f < steps:
            raise too_short(e - f, steps)
        with self._starts(window, steps) as tree:
            total, smallest = tree.total, tree.min
            if not total > 0:
                raise NotEnoughDataError("cannot sample: every retained row has priority zero")
            rows = tree.find(rng.random(size) * total)
            mass = tree.get(rows)
        p = mass / total
        # (N * P_i)^-beta / (N * P_min)^-beta: N and the total cancel
        weight = np.power(mass / smallest, -beta).astype(np.float32)
        slot = rows // num_envs
        step = f + (slot - f) % capacity
        flat = step * num_envs + rows % num_envs
        return Draw(rows, num_envs, p, flat=flat, weight=weight)

    # --- priorities ---------------------------------------------------------------------

    def check_update(self, step: Any, env: Any, priorities: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(step, env, priorities)`` of :meth:`update_priorities` checked, as flat arrays
        (``[items]``, ``[items]``, ``[items]`` or ``[items, num_steps]``); raises
        :class:`BadInputError` for what it would refuse, writing nothing."""
        store = self.store
        step, env = np.asarray(step), np.asarray(env)
        if step.shape != env.shape:
            step, env = np.broadcast_arrays(step, env)
        if step.size and (step.dtype.kind not in "iu" or env.dtype.kind not in "iu"):
            raise BadInputError(
                f"{store.path}: step and env must be integer arrays, got {step.dtype} and {env.dtype}"
            )
        step = step.reshape(-1).astype(np.int64, copy=False)
        env = env.reshape(-1).astype(np.int64, copy=False)
        p = np.asarray(priorities, np.float64)
        if p.shape[:1] != step.shape or p.ndim > 2:
            raise BadInputError(
                f"{store.path}: expected {step.size} priorities (one per item, or [items, num_steps]), "
                f"got shape {np.shape(priorities)}"
            )
        if p.size and not (0.0 <= p.min() and p.max() + self.eps <= LARGEST):  # NaN fails both
            bad = ~(p >= 0) | ~(p + self.eps <= LARGEST)
            raise priority_refusal(store.path, p, bad, f" (at most {LARGEST:.4g}, stored as float32)")
        _check_envs(store, env)
        end = store.total_steps if store.mode == "a" else store.committed_steps
        if step.size and step.max() >= end:
            raise BadInputError(
                f"{store.path}: step {int(step.max())} is not committed yet (committed steps end at {end})"
            )
        return step, env, p

    def update_priorities(self, step: Any, env: Any, priorities: Any) -> int:
        """Set the priorities of sampled items (global step ids and envs, as in
        ``SampleInfo``); returns how many were applied. Items whose step the ring has
        dropped since it was sampled are skipped."""
        store = self.store
        step, env, p = self.check_update(step, env, priorities)
        if p.ndim == 2:
            p = self._reduce(p)
        p = (p + self.eps).astype(np.float32)
        file = self._file()
        if not file.writable:
            raise ReadOnlyError(f"{file.path}: the priorities are read-only for this process")
        writer = store.mode == "a"
        if writer:
            self._fill(store.total_steps)
        with file:
            if writer:
                first, end = store.first_step, store.total_steps
            else:
                # the writer's oldest retained step now (a stat when the state is
                # unchanged); no step this reader sampled is past its own committed end
                first, end = store.live_first(), store.committed_steps
            if step.size and step.min() < first:
                keep = step >= first
                step, env, p = step[keep], env[keep], p[keep]
            applied = int(step.size)
            rows = (step % store.capacity) * store.num_envs + env
            if rows.size:
                # the last update of a row wins: keep the last occurrence of each row
                order = rows.argsort(kind="stable")
                rows = rows[order]
                repeated = rows[1:] == rows[:-1]
                if repeated.any():
                    last = np.append(~repeated, True)
                    order, rows = order[last], rows[last]
                p = p[order]
                file.values.reshape(-1)[rows] = p
                file.raise_max(float(p.max()))
        if self.tree is not None and rows.size:
            # every step left is in [first, end); the tree usually holds all of them
            if not (self.tree_first <= first and end <= self.tree_end):
                step = step[order]
                inside = (step >= self.tree_first) & (step < self.tree_end)
                rows, p = rows[inside], p[inside]
            self.tree.set(rows, self._weights(p), ascending=True)
        return applied

    def priorities(self, step: Any, env: Any) -> np.ndarray:
        """The stored priorities of rows ``(step, env)`` (retained steps; the writer's
        own uncommitted steps included), as float32."""
        store = self.store
        step, env = np.broadcast_arrays(np.asarray(step, np.int64), np.asarray(env, np.int64))
        _check_envs(store, env)
        if store.mode == "a":
            self._fill(store.total_steps)
            first, end = store.first_step, store.total_steps
        else:
            first, end = store.first_step, store.committed_steps
        if step.size and (step.min() < first or step.max() >= end):
            raise NotEnoughDataError(f"{store.path}: steps asked outside the retained steps [{first}, {end})")
        return self._file().values[step % store.capacity, env].copy()

    def _reduce(self, p: np.ndarray) -> np.ndarray:
        how = self.sequence_priority
        if how == "start":
            return p[:, 0]
        if how == "max":
            return p.max(axis=1)
        if how == "mean":
            return p.mean(axis=1)
        return how * p.max(axis=1) + (1.0 - how) * p.mean(axis=1)
