"""Every valid start equally likely: single rows or ``num_steps`` windows of one env,
optionally never crossing an episode's end (spans from the store's episode index)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.random import Generator

from ..read.draws import draw_in_spans, draw_uniform
from ..read.request import SampleRequest, positive
from .base import Draw, Mass, Sampler, Window

__all__ = ["SliceSampler", "UniformSampler"]


class UniformSampler(Sampler):
    """Items drawn uniformly over every start whose ``num_steps`` window lies in the
    store's window; ``within_episodes=True`` (per call) keeps sequences inside one
    episode, as :class:`SliceSampler` does by default."""

    name = "uniform"
    draws_ahead = True
    within_episodes = False

    def draw(self, window: Window, request: SampleRequest, size: int, steps: int, rng: Generator) -> Draw:
        if not self._within(request):
            return draw_uniform(window, size, steps, request.replacement, rng)
        return draw_in_spans(*self._spans(window), window, size, steps, request.replacement, rng)

    def mass(self, window: Window, request: SampleRequest, steps: int) -> Mass:
        if not self._within(request):
            return super().mass(window, request, steps)
        count = int(np.maximum(self._spans(window)[2] - steps + 1, 0).sum())
        return Mass(float(count), 1.0 if count else np.inf)

    def _within(self, request: SampleRequest) -> bool:
        return self.within_episodes if request.within_episodes is None else request.within_episodes

    def _spans(self, window: Window) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each episode's env, first step and length inside ``window``: the spans cover
        the store's window, a caller's may be narrower."""
        from ..episodes import index_for

        spans = index_for(self.store).spans(self.store)
        first = np.maximum(spans.first, window.first)
        return spans.env, first, np.maximum(np.minimum(spans.last, window.end - 1) - first + 1, 0)


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
