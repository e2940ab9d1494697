"""SB3's ``HerReplayBuffer`` over a store: the episode bookkeeping is the store's episode
index, the relabelling :mod:`mmreplay.read.hindsight`'s (docs/sb3.md).

SB3 keeps ``ep_start`` / ``ep_length`` arrays that a crash loses; here they follow from the
episode index on disk, so a resumed buffer samples the episodes it had, the one each env
was in ending (truncated) where the last writer stopped. Draws are SB3's, call for call
with ``np.random``, so the same data and seed give SB3's batch.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.type_aliases import DictReplayBufferSamples
from stable_baselines3.her import her_replay_buffer as sb3_her
from stable_baselines3.her.goal_selection_strategy import KEY_TO_GOAL_STRATEGY

from ...episodes import complete_spans, index_for
from ...errors import BadInputError, NotEnoughDataError
from ...read.hindsight import check_strategy, goal_paths, goal_steps, relabel, reward_function
from ...spec import unflatten
from .buffers import DictReplayBuffer

if TYPE_CHECKING:
    from ...store import Store

__all__ = ["HerReplayBuffer"]


class HerReplayBuffer(DictReplayBuffer, sb3_her.HerReplayBuffer):
    """SB3's ``HerReplayBuffer`` over a store in the folder ``path``, taking what SB3 passes
    (``replay_buffer_class=HerReplayBuffer, replay_buffer_kwargs=dict(n_sampled_goal=4,
    goal_selection_strategy="future", path=...)``).

    Args:
        buffer_size ... goal_selection_strategy: as SB3's.
        copy_info_dict: must stay False: infos are Python objects, and the store keeps
            arrays only (``compute_reward`` gets an empty dict per transition, as SB3's
            default).
        path, **store_options: as :class:`mmreplay.compat.sb3.ReplayBuffer`'s.

    Raises:
        BadInputError: an unknown strategy, a negative ``n_sampled_goal``, an env without
            ``compute_reward``, observations without goals, ``copy_info_dict=True``;
            nothing is created.
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        env: Any = None,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        n_sampled_goal: int = 4,
        goal_selection_strategy: Any = "future",
        copy_info_dict: bool = False,
        path: str | os.PathLike | None = None,
        **store_options: Any,
    ):
        strategy = check_strategy(goal_selection_strategy)
        if (
            not isinstance(n_sampled_goal, (int, np.integer))
            or isinstance(n_sampled_goal, bool)
            or n_sampled_goal < 0
        ):
            raise BadInputError(f"n_sampled_goal must be an int >= 0, got {n_sampled_goal!r}")
        if copy_info_dict:
            raise BadInputError(
                "copy_info_dict=True: infos are Python objects and the store keeps arrays only; "
                "pass copy_info_dict=False (compute_reward then gets an empty info dict, as by default in SB3)"
            )
        if not isinstance(observation_space, spaces.Dict) or not {"achieved_goal", "desired_goal"} <= set(
            observation_space.spaces
        ):
            raise BadInputError(
                "HerReplayBuffer needs a Dict observation space with 'achieved_goal' and 'desired_goal' keys "
                f"(a goal env's); got {observation_space}"
            )
        self._reward_fn = None if env is None else reward_function(env)
        super().__init__(
            buffer_size,
            observation_space,
            action_space,
            device=device,
            n_envs=n_envs,
            optimize_memory_usage=optimize_memory_usage,
            handle_timeout_termination=handle_timeout_termination,
            path=path,
            **store_options,
        )
        self.env = env
        self._live().end_episodes()  # a resumed folder's, as SB3's load_replay_buffer ends them: drawn at once
        self.copy_info_dict = False
        self.goal_selection_strategy = KEY_TO_GOAL_STRATEGY[strategy]
        self.n_sampled_goal = int(n_sampled_goal)
        self.her_ratio = 1 - (1.0 / (self.n_sampled_goal + 1))

    def set_env(self, env: Any) -> None:
        """As SB3's (after a manifest is loaded), checking that ``env`` computes rewards."""
        if self.env is not None:
            raise ValueError("Trying to set env of already initialized environment.")
        self._reward_fn = reward_function(env)
        self.env = env

    # --- SB3's episode arrays, from the episode index ------------------------------------

    def _episode_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """SB3's ``ep_start`` and ``ep_length`` ``[buffer_size, n_envs]``: set on every step
        of an episode that ended and whose start is retained (SB3 forgets an episode
        once the ring overwrites its first step), zero elsewhere."""
        store = self._live()
        spans = index_for(store).spans(store)
        spans = spans.select(spans.complete)
        bs, length = self.buffer_size, spans.length
        offsets = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
        index = (np.repeat(spans.first, length) + offsets - self._origin) % bs
        env = np.repeat(spans.env, length)
        ep_start = np.zeros((bs, self.n_envs), np.int64)
        ep_length = np.zeros((bs, self.n_envs), np.int64)
        ep_start[index, env] = np.repeat((spans.first - self._origin) % bs, length)
        ep_length[index, env] = np.repeat(length, length)
        return ep_start, ep_length

    ep_start = property(lambda self: self._episode_arrays()[0])  # type: ignore[assignment]
    ep_length = property(lambda self: self._episode_arrays()[1])  # type: ignore[assignment]

    def _draw(self, batch_size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """SB3's draw, ``np.random.choice(np.flatnonzero(ep_length > 0), batch_size)``
        unravelled to (index, env), without an array the size of the buffer: ``choice``
        is ``valid[np.random.randint(0, len(valid), batch_size)]``, and SB3's sorted
        ``valid`` is read off each env's one or two ranges of indices (its finished
        episodes, :func:`mmreplay.episodes.complete_spans`). None before any episode ends."""
        bs = self.buffer_size
        envs, first, last = complete_spans(self._live())
        start, stop = (first - self._origin) % bs, (first - self._origin) % bs + last - first + 1
        lo = np.concatenate((start, np.zeros_like(start)))
        hi = np.concatenate((np.minimum(stop, bs), np.maximum(stop - bs, 0)))
        env = np.concatenate((envs, envs))
        lo, hi, env = lo[hi > lo], hi[hi > lo], env[hi > lo]
        if not len(env):
            return None
        # between consecutive cuts the same envs are valid at every index: segments of
        # `width` envs each, `count` (index, env) pairs in all before each
        cuts = np.unique(np.concatenate((lo, hi)))
        seg, k = np.nonzero((lo <= cuts[:-1, None]) & (cuts[:-1, None] < hi))
        valid = np.zeros((len(cuts) - 1, self.n_envs), bool)
        valid[seg, env[k]] = True
        width = valid.sum(1)
        count = np.concatenate(([0], np.cumsum((cuts[1:] - cuts[:-1]) * width)))
        ordinal = np.random.randint(0, count[-1], size=batch_size)  # what np.random.choice draws
        j = np.searchsorted(count, ordinal, side="right") - 1
        offset = ordinal - count[j]
        ranked = np.argsort(~valid, axis=1, kind="stable")  # each segment's valid envs first, in order
        return cuts[j] + offset // width[j], ranked[j, offset % width[j]]

    def truncate_last_trajectory(self) -> None:
        """As SB3's: the episode each env is in ends at the newest step (marked truncated)."""
        if len(self._live().end_episodes()):
            warnings.warn(
                "The last trajectory in the replay buffer will be truncated.\n"
                "If you are in the same episode as when the replay buffer was saved,\n"
                "you should use `truncate_last_trajectory=False` to avoid that issue.",
                stacklevel=2,
            )

    # --- reads ---------------------------------------------------------------------------

    def sample(self, batch_size: int, env: Any = None) -> DictReplayBufferSamples:  # type: ignore[override]
        """SB3's batch: real transitions, then ``int(her_ratio * batch_size)`` relabelled
        ones, drawn with ``np.random`` as SB3 draws them, from finished episodes only."""
        store = self._live()
        self._count_retained()
        if self._reward_fn is None:
            raise BadInputError("HerReplayBuffer has no env to compute rewards: call set_env(env) first")
        drawn = self._draw(batch_size)
        if drawn is None:
            raise NotEnoughDataError(
                f"{store.path}: unable to sample before the end of the first episode. We recommend choosing "
                "a value for learning_starts that is greater than the maximum number of timesteps in the environment."
            )
        nb_virtual = int(self.her_ratio * batch_size)
        # SB3 relabels the first nb_virtual drawn and returns the others first
        order = np.concatenate((np.arange(nb_virtual, batch_size), np.arange(nb_virtual)))
        inds, envs = drawn[0][order], drawn[1][order]
        steps = self._steps_of(inds)
        leaves = [leaf.take((steps % self.buffer_size) * self.n_envs + envs) for leaf in store.leaves]
        virtual = np.arange(batch_size - nb_virtual, batch_size)
        self._relabel(store, dict(zip(store.leaf_paths, leaves)), virtual, steps[virtual], envs[virtual])
        return self._to_samples(unflatten(store.spec, leaves), env)

    def _relabel(
        self,
        store: Store,
        leaves: dict[str, np.ndarray],
        items: np.ndarray,
        steps: np.ndarray,
        envs: np.ndarray,
    ) -> None:
        """Relabel the batch's ``items`` as SB3 does (its draws even when there are none)."""
        first, last, _ = store.episode_bounds(steps, envs)
        goal = goal_paths(store.roles)  # the leaves this class creates
        goal_at = goal_steps(self.goal_selection_strategy.name.lower(), steps, first, last, np.random.randint)
        goals = store.leaves[store.leaf_paths.index(goal.next_achieved)].take(
            (goal_at % self.buffer_size) * self.n_envs + envs
        )
        relabel(leaves, goal, items, goals, self._reward_fn)

    # --- pickling: the manifest leaves the env out, as SB3's does ------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("env", None)
        state.pop("_reward_fn", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.env, self._reward_fn = None, None
