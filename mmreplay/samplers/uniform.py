"""Uniform sampling: every valid (step, env) start equally likely."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..sampling import Draw, draw_uniform
from .base import Mass, Sampler, Window, register_sampler

__all__ = ["UniformSampler"]


@register_sampler
class UniformSampler(Sampler):
    """Items drawn uniformly over every start whose ``num_steps`` window lies in the
    store's window; ``within_episodes=True`` (per call) keeps sequences inside one
    episode, as :class:`~mmreplay.samplers.slices.SliceSampler` does."""

    name = "uniform"
    draws_ahead = True

    def __init__(self) -> None:
        self.store: Any = None

    def attach(self, store: Any) -> None:
        self.store = store

    def close(self) -> None:
        self.store = None

    def draw(
        self,
        batch_size: int,
        window: Window,
        rng: np.random.Generator,
        num_steps: int = 1,
        replacement: bool = True,
        within_episodes: bool = False,
    ) -> Draw:
        if within_episodes:
            from .slices import draw_within_episodes

            return draw_within_episodes(self.store, batch_size, window, rng, num_steps, replacement)
        return draw_uniform(
            window.first, window.end, window.num_envs, window.capacity, batch_size, num_steps, replacement, rng
        )

    def mass(self, window: Window, num_steps: int = 1, within_episodes: bool = False, **options: Any) -> Mass:
        if not within_episodes:
            return super().mass(window, num_steps)
        from ..episodes import index_for

        spans = index_for(self.store).spans(self.store)
        count = int(np.maximum(spans.length - num_steps + 1, 0).sum())
        return Mass(float(count), 1.0 if count else np.inf)
