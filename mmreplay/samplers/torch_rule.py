"""skrl's ``RandomMemory`` over a store: its physical rows and its torch draw rule.

skrl keeps every tensor as ``(memory_size, num_envs, size)``, written row by row with a
cursor (``memory_index``, ``env_index``, ``filled``), and draws flat physical indexes
``row * num_envs + env`` with torch's global generator. :class:`PhysicalRows` maps that
layout onto a store's global steps, and :class:`TorchDrawRule` is the draw as a sampler,
so that a skrl batch is read through the store's one fetch path.

Torch is imported when a draw is made, not with this module.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import NotEnoughDataError
from ..read.request import SampleRequest
from .base import Draw, Host, Sampler, Window

__all__ = ["MemoryEmptyError", "PhysicalRows", "TorchDrawRule"]


class MemoryEmptyError(NotEnoughDataError, RuntimeError):
    """Sampling asked for more than the memory holds (a ``RuntimeError`` too, as in skrl)."""


class PhysicalRows:
    """skrl's rows over a store: physical row ``r`` holds the newest step whose count
    since ``origin`` is ``r`` modulo ``memory_size``.

    Complete steps are the store's steps from ``origin`` (the global step id the count
    starts at, moved by a reset); the next step's first ``env_index`` envs are written
    ahead in the store's next slot (:meth:`mmreplay.Store.write_next`). ``store`` is
    None until the memory has one.
    """

    def __init__(self, memory_size: int, num_envs: int):
        self.memory_size = memory_size
        self.num_envs = num_envs
        self.store: Host | None = None
        self.origin = 0
        self.env_index = 0

    @property
    def steps(self) -> int:
        """Complete steps since the origin."""
        return 0 if self.store is None else self.store.total_steps - self.origin

    @property
    def memory_index(self) -> int:
        return self.steps % self.memory_size

    @property
    def filled(self) -> bool:
        return self.steps >= self.memory_size

    def __len__(self) -> int:
        if self.filled:
            return self.memory_size * self.num_envs
        return self.memory_index * self.num_envs + self.env_index

    def window(self) -> tuple[int, int]:
        """Global step ids ``[lo, hi)`` of the complete steps the rows show."""
        if self.store is None:
            return 0, 0
        first, hi = self.store.window[:2]
        return max(first, self.origin, hi - self.memory_size), hi

    def steps_of_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global step id of the complete step each physical row holds, and whether it holds one."""
        T = self.steps
        offset = T - 1 - np.mod(T - 1 - rows, self.memory_size)
        steps = self.origin + offset
        lo, _ = self.window()
        return steps, (offset >= 0) & (steps >= lo)

    def locate(self, flat: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(step, env, holds)`` of flat physical indexes; the written-ahead envs of the
        current row are at step ``store.total_steps`` (the next step)."""
        rows, envs = np.divmod(flat, self.num_envs)
        steps, holds = self.steps_of_rows(rows)
        if self.env_index:
            ahead = (rows == self.memory_index) & (envs < self.env_index)
            steps = np.where(ahead, self.store.total_steps, steps)
            holds = holds | ahead
        return steps, envs, holds

    def draw(self, batch_size: int, sequence_length: int, replacement: bool) -> Any:
        """Flat physical indexes of a batch (``batch_size * sequence_length``, a torch
        tensor), drawn with skrl's calls: ``torch.randint(0, size, (batch_size,))``, or
        ``torch.randperm(size)[:batch_size]`` without replacement.

        Before a wrap a sequence is skrl's (the start's next rows). Once filled, start
        ``k`` counts along each env's stream from its oldest row, so a sequence never
        joins the newest row to the oldest [skrl's runs across the cursor].
        """
        import torch

        E = self.num_envs
        size = len(self) - (sequence_length - 1) * E
        if replacement:
            if size <= 0:
                raise MemoryEmptyError(
                    f"cannot sample: the memory holds {len(self)} rows"
                    + (f", no sequence of {sequence_length} steps" if sequence_length > 1 else "")
                )
            starts = torch.randint(0, size, (batch_size,))
        else:
            if size < 0:
                raise MemoryEmptyError(
                    f"cannot sample sequences of {sequence_length} steps from {len(self)} rows"
                )
            starts = torch.randperm(size, dtype=torch.long)[:batch_size]
        if sequence_length == 1:
            return starts
        k, envs = np.divmod(starts.numpy(), E)
        oldest = 0
        if self.filled:  # each env's stream starts after its newest row
            oldest = (self.memory_index + (envs < self.env_index)) % self.memory_size
        rows = (oldest + k)[:, None] + np.arange(sequence_length)
        return torch.from_numpy(((rows % self.memory_size) * E + envs[:, None]).reshape(-1))


class TorchDrawRule(Sampler):
    """skrl's ``RandomMemory`` draw as a sampler the store's fetch path draws through.

    The starts come from torch's global generator with skrl's calls, so
    ``torch.manual_seed`` gives skrl's indexes; ``rng`` and the window's bounds are not
    used (the rows are the memory's). Not recorded in a store: it lives with its memory.
    """

    name = "skrl-random"

    def __init__(self, rows: PhysicalRows):
        self.rows = rows

    def state_json(self) -> dict[str, Any]:
        raise TypeError("the skrl draw rule lives with its memory and is not recorded in a store")

    def draw(self, window: Window, request: SampleRequest, size: int, steps: int, rng: Any) -> Draw:
        rows = self.rows
        first = rows.draw(size, steps, request.replacement).numpy().reshape(-1, steps)[:, 0]
        step, envs, _ = rows.locate(first)
        flat = step * window.num_envs + envs
        start = (step % window.capacity) * window.num_envs + envs
        starts = len(rows) - (steps - 1) * rows.num_envs
        return Draw(start, window.num_envs, 1.0 / max(starts, 1), flat=flat)
