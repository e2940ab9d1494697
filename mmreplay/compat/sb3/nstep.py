"""SB3's ``NStepReplayBuffer`` over a store (docs/sb3.md, "n-step returns").

The rows are the one-step transitions :class:`~mmreplay.compat.sb3.ReplayBuffer` writes;
the returns are computed when a batch is drawn, by the store's
:class:`mmreplay.NStep` transform over the rows SB3's indices name. SB3's window rules
follow from the store's: a window stops at a terminated or truncated step and at the
newest step (SB3 marks ``pos - 1`` a timeout for that), so it never crosses the write
cursor of a full ring nor, after a crash and resume, the episode the killed process left
open (the store marks it truncated when the next writer starts).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from stable_baselines3.common import buffers as sb3_buffers

from ...read import NStep, SampleRequest
from ...read import sample as sample_store
from ...read.draws import Draw, Window
from .buffers import ReplayBuffer

__all__ = ["NStepReplayBuffer"]


class NStepReplayBuffer(ReplayBuffer, sb3_buffers.NStepReplayBuffer):
    """SB3's ``NStepReplayBuffer`` over a store in the folder ``path``: take it with
    ``replay_buffer_class=NStepReplayBuffer, replay_buffer_kwargs=dict(n_steps=3,
    gamma=0.99, path=...)``.

    Args:
        n_steps, gamma: as SB3's (checked before anything is written).
        The others: :class:`mmreplay.compat.sb3.ReplayBuffer`'s. Unlike SB3's, it takes
        ``optimize_memory_usage=True`` (frames stored once) and the store's samplers
        (``sampler="prioritized"``: the priority is the window's first row's).
    """

    def __init__(self, *args: Any, n_steps: int = 3, gamma: float = 0.99, **kwargs: Any):
        self._nstep = NStep(n_steps, gamma)  # a bad n_steps or gamma is refused before the store is made
        self.n_steps, self.gamma = n_steps, gamma
        super().__init__(*args, **kwargs)

    def _transform(self, env: Any) -> NStep:
        """The returns, each reward normalized as SB3 does (before the sum) under ``VecNormalize``."""
        if env is None:
            return self._nstep
        return NStep(self.n_steps, self.gamma, reward_map=env.normalize_reward)

    @staticmethod
    def _normalize_reward(reward: np.ndarray, env: Any = None) -> np.ndarray:
        """The returns come normalized: :meth:`_transform` normalized each reward."""
        return reward

    def _get_samples(self, batch_inds: np.ndarray, env: Any = None) -> Any:
        """SB3's windows from ``batch_inds``, each in an env drawn with ``np.random`` as SB3 does."""
        env_indices = np.random.randint(0, self.n_envs, size=batch_inds.shape)
        steps = self._steps_of(batch_inds)
        request = SampleRequest.build(
            len(steps), sampler=_Given(steps, env_indices), transform=self._transform(env)
        )
        return self._to_samples(sample_store(self._live(), request), env)

    def _to_samples(self, batch: dict[str, Any], env: Any) -> Any:
        samples = super()._to_samples(batch, env)
        return samples._replace(discounts=self.to_torch(batch["discount"].reshape(-1, 1)))


class _Given:
    """The rows SB3's indices name, as the draw the store's read path gathers."""

    num_steps = None
    options: frozenset[str] = frozenset()

    def __init__(self, steps: np.ndarray, envs: np.ndarray):
        self.steps, self.envs = steps, envs

    def draw(self, window: Window, request: SampleRequest, size: int, steps: int, rng: Any) -> Draw:
        num_envs = window.num_envs
        start = (self.steps % window.capacity) * num_envs + self.envs
        return Draw(start, num_envs, 1.0, flat=self.steps * num_envs + self.envs)
