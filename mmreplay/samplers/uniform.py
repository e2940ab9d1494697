"""Every valid start equally likely: single rows or ``num_steps`` windows of one env,
optionally never crossing an episode's end (spans from the store's episode index)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..read.draws import draw_in_spans, draw_uniform
from ..read.request import positive
from .base import Draw, Mass, Sampler, Window

__all__ = ["SliceSampler", "UniformSampler"]


class UniformSampler(Sampler):
    """Items drawn uniformly over every start whose ``num_steps`` window lies in the
    store's window; ``within_episodes=True`` (per call) keeps sequences inside one
    episode, as :class:`SliceSampler` does by default."""

    name = "uniform"
    draws_ahead = True
    within_episodes = False

    def draw(
        self,
        batch_size: int,
        window: Window,
        rng: np.random.Generator,
        num_steps: int = 1,
        replacement: bool = True,
        within_episodes: bool | None = None,
    ) -> Draw:
        if not (self.within_episodes if within_episodes is None else within_episodes):
            return draw_uniform(window, batch_size, num_steps, replacement, rng)
        s = self._spans()  # they cover the same window
        return draw_in_spans(s.env, s.first, s.length, window, batch_size, num_steps, replacement, rng)

    def mass(
        self, window: Window, num_steps: int = 1, within_episodes: bool | None = None, **options: Any
    ) -> Mass:
        if not (self.within_episodes if within_episodes is None else within_episodes):
            return super().mass(window, num_steps)
        count = int(np.maximum(self._spans().length - num_steps + 1, 0).sum())
        return Mass(float(count), 1.0 if count else np.inf)

    def _spans(self) -> Any:
        from ..episodes import index_for

        return index_for(self.store).spans(self.store)


class SliceSampler(UniformSampler):
    """Sequences of ``num_steps`` steps by default (``sample(n)`` returns ``[n,
    num_steps, ...]``), inside one episode when ``within_episodes`` (the default). A
    ``num_steps`` or ``within_episodes`` given to ``sample`` overrides these for that call."""

    name = "slices"

    def __init__(self, num_steps: int | None = None, within_episodes: bool = True) -> None:
        self.num_steps = positive("num_steps", num_steps, allow_none=True)
        if not isinstance(within_episodes, bool):
            raise ValueError(f"within_episodes must be a bool, got {within_episodes!r}")
        self.within_episodes = within_episodes

    def state_json(self) -> dict[str, Any]:
        return {"name": self.name, "num_steps": self.num_steps, "within_episodes": self.within_episodes}
