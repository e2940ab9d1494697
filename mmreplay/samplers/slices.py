"""Sequences: windows of ``num_steps`` consecutive steps of one env, optionally never
crossing an episode's end (spans from the store's episode index)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..sampling import Draw, draw_in_spans
from .base import Mass, Window, register_sampler
from .uniform import UniformSampler

__all__ = ["SliceSampler", "draw_within_episodes"]


def draw_within_episodes(
    store: Any, batch_size: int, window: Window, rng: np.random.Generator, num_steps: int, replacement: bool
) -> Draw:
    """Starts drawn uniformly over every ``num_steps`` window inside one episode span of
    the store's window (the episode index's spans cover the same ``window``)."""
    from ..episodes import index_for

    spans = index_for(store).spans(store)
    return draw_in_spans(
        spans.env,
        spans.first,
        spans.length,
        window.num_envs,
        window.capacity,
        batch_size,
        num_steps,
        replacement,
        rng,
    )


@register_sampler
class SliceSampler(UniformSampler):
    """Sequences of ``num_steps`` steps by default (``sample(n)`` returns ``[n,
    num_steps, ...]``), inside one episode when ``within_episodes`` (the default); every
    valid start is equally likely. A ``num_steps`` or ``within_episodes`` given to
    ``sample`` overrides these for that call."""

    name = "slices"

    def __init__(self, num_steps: int | None = None, within_episodes: bool = True) -> None:
        super().__init__()
        if num_steps is not None and (
            not isinstance(num_steps, (int, np.integer)) or isinstance(num_steps, bool) or num_steps < 1
        ):
            raise ValueError(f"num_steps must be a positive int or None, got {num_steps!r}")
        if not isinstance(within_episodes, bool):
            raise ValueError(f"within_episodes must be a bool, got {within_episodes!r}")
        self.num_steps = None if num_steps is None else int(num_steps)
        self.within_episodes = within_episodes

    def state_json(self) -> dict[str, Any]:
        return {"name": self.name, "num_steps": self.num_steps, "within_episodes": self.within_episodes}

    def draw(
        self,
        batch_size: int,
        window: Window,
        rng: np.random.Generator,
        num_steps: int = 1,
        replacement: bool = True,
        within_episodes: bool | None = None,
    ) -> Draw:
        within = self.within_episodes if within_episodes is None else within_episodes
        return super().draw(batch_size, window, rng, num_steps, replacement, within_episodes=within)

    def mass(
        self, window: Window, num_steps: int = 1, within_episodes: bool | None = None, **options: Any
    ) -> Mass:
        within = self.within_episodes if within_episodes is None else within_episodes
        return super().mass(window, num_steps, within_episodes=within)
