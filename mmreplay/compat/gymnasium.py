"""gymnasium: the transition spec of an env's spaces, and recorders that fill a store.

``RecordTransitions(env, "run/buffer", capacity=100_000)`` (or ``RecordVectorTransitions``)
writes every transition (``observation, action, reward, terminated, truncated,
next_observation``, with those roles) as one store row per env and step, so the store's
episodes, samplers and exports understand it. Each env's rows are its own transitions in
time order, the final observation of an episode the ``next_observation`` of its last row
under any autoreset mode; a ``reset()`` that cuts an episode marks its last row
truncated. How each mode is handled and what a crash loses: docs/gymnasium.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

try:
    import gymnasium
except ImportError as exc:  # pragma: no cover - gymnasium is an install extra
    raise ImportError("mmreplay.compat.gymnasium needs gymnasium: pip install 'mmreplay[gymnasium]'") from exc

from ..creation import create, named_differences
from ..errors import SpecMismatchError
from ..metadata import METADATA_FILE
from ..spaces import SPACES_ATTR, space_to_json
from ..spec import ArraySpec, flatten, leaf_paths, to_spec, unflatten
from ..store import Store
from ..store import open as open_store
from ..values import StepValidator, flatten_value
from ._shared import describe

__all__ = [
    "spec_from_spaces",
    "space_to_json",
    "record_spaces",
    "RecordTransitions",
    "RecordVectorTransitions",
    "TRANSITION_ROLES",
    "SPACES_ATTR",
]

log = logging.getLogger(__name__)

#: role -> leaf of the transition spec (each leaf is named after its role)
TRANSITION_ROLES = {
    role: role for role in ("observation", "action", "reward", "terminated", "truncated", "next_observation")
}


def spec_from_spaces(
    observation_space: Any, action_space: Any, reward_dtype: Any = "float32"
) -> tuple[dict[str, Any], dict[str, str]]:
    """The transition spec of an env's (single-env) spaces, and its roles.

    Example:
        >>> import gymnasium
        >>> spec, roles = spec_from_spaces(gymnasium.spaces.Box(-1, 1, (3,)), gymnasium.spaces.Discrete(2))
        >>> sorted(spec), spec["action"]
        (['action', 'next_observation', 'observation', 'reward', 'terminated', 'truncated'], ArraySpec(shape=(), dtype=int64))
    """
    obs = to_spec(observation_space, "observation")
    spec = {
        "observation": obs,
        "action": to_spec(action_space, "action"),
        "reward": ArraySpec((), reward_dtype),
        "terminated": ArraySpec((), "bool"),
        "truncated": ArraySpec((), "bool"),
        "next_observation": obs,
    }
    return spec, dict(TRANSITION_ROLES)


def record_spaces(store: Store, observation_space: Any, action_space: Any, env_spec: Any = None) -> None:
    """Keep the spaces (and the env spec) a store's transitions come from in its attrs.

    They are stored as JSON text under ``store.attrs["gymnasium"]``: ``observation_space``
    and ``action_space`` as ``minari.serialization`` writes them, ``env_spec`` as
    ``EnvSpec.to_json()`` (left out when the env has no spec, or one that cannot be
    written as JSON). The Minari export writes them into the dataset's metadata, so
    ``dataset.observation_space`` is the env's own and ``recover_environment()`` works.
    """
    value = {
        "observation_space": json.dumps(space_to_json(observation_space)),
        "action_space": json.dumps(space_to_json(action_space)),
    }
    if env_spec is not None:
        try:
            value["env_spec"] = env_spec.to_json()
        except (ValueError, TypeError) as exc:  # e.g. a callable entry point or kwargs
            log.warning("the env spec cannot be written as JSON and is not recorded: %s", exc)
    if store.attrs.get(SPACES_ATTR) != value:
        store.set_attrs(**{SPACES_ATTR: value})


def _attach(target: str | os.PathLike | Store, spec: dict[str, Any], roles: dict[str, str], num_envs: int,
            capacity: int | None, options: Mapping[str, Any]) -> Store:  # fmt: skip
    """The store to record into: given (the caller closes it), reopened (checked) or created."""
    owned = not isinstance(target, Store)
    path = os.fspath(target) if owned else target.path  # type: ignore[union-attr]
    if owned and not os.path.exists(os.path.join(path, METADATA_FILE)):
        if capacity is None:
            raise ValueError(f"{path}: no buffer there; give capacity= to create one")
        return create(path, spec, capacity, num_envs, roles=roles, **options)
    store = open_store(path, "a") if owned else target
    problems = [] if describe(store.spec) == describe(spec) else [f"spec: existing {store.spec} vs new {spec}"]
    if owned and capacity is not None and store.capacity != capacity:
        problems.append(f"capacity: existing {store.capacity} vs new {capacity}")
    if owned:
        problems += named_differences(store, options)
    if store.num_envs != num_envs:
        problems.append(f"num_envs: existing {store.num_envs} vs new {num_envs}")
    if store.mode != "a":
        problems.append("it is open read-only")
    if problems:
        if owned:
            store.close()
        raise SpecMismatchError(f"{path}: cannot record into this buffer ({'; '.join(problems)})")
    return store


class _Writer:
    """A recorder's store and the transitions of envs ahead of the others: a store step
    holds one transition of every env, so those wait here until every env has one."""

    def __init__(self, target: Any, observation_space: Any, action_space: Any, num_envs: int, env_spec: Any,
                 capacity: int | None, reward_dtype: Any, options: dict[str, Any]):  # fmt: skip
        self.spec, roles = spec_from_spaces(observation_space, action_space, reward_dtype)
        for space in (observation_space, action_space):  # a space record_spaces refuses makes no folder
            space_to_json(space)
        self.owns_store = not isinstance(target, Store)
        self.store = _attach(target, self.spec, roles, num_envs, capacity, options)
        record_spaces(self.store, observation_space, action_space, env_spec)
        self.leaf_specs: list[ArraySpec] = flatten(self.spec)
        self.validator = StepValidator(self.spec, num_envs)
        self.truncated = leaf_paths(self.spec).index("truncated")
        self.queues: list[deque[list[Any]]] = [deque() for _ in range(num_envs)]

    def leaves(self, transition: dict[str, Any]) -> list[np.ndarray]:
        """Leaves of a batched transition ``[num_envs, ...]`` in spec order."""
        values = flatten_value(self.spec, transition, "the transition")
        # the store's checks, before a cast: an observation past a uint8 Box, or a float
        # action for a Discrete one, is refused, never wrapped or truncated
        return [np.asarray(v, s.dtype) for v, s in zip(self.validator.step_leaves(values), self.leaf_specs)]

    def push(self, leaves: list[np.ndarray], envs: Any = None) -> None:
        """Write the transitions of ``envs`` (None: all), or queue them while other envs lag."""
        if envs is None and not any(self.queues):
            self.store.add(unflatten(self.spec, leaves))
            return
        for i in range(len(self.queues)) if envs is None else envs:
            self.queues[i].append([np.array(leaf[i]) for leaf in leaves])
        while all(self.queues):
            rows = [q.popleft() for q in self.queues]
            self.store.add(unflatten(self.spec, [np.stack(col) for col in zip(*rows)]))

    def end_open_episodes(self, envs: Any, open_: np.ndarray) -> None:
        """A reset cuts the open episodes of ``envs`` short: their last transition is truncated."""
        written = []
        for i in envs:
            if open_[i] and self.queues[i]:
                self.queues[i][-1][self.truncated] = np.True_
            elif open_[i]:
                written.append(i)
        if written:
            self.store.end_episodes(written)

    def waiting(self) -> int:
        return sum(len(q) for q in self.queues)

    def release(self) -> None:
        """Commit the store, closing it if the recorder opened it (safe twice)."""
        if self.waiting() and not self.store.closed:
            log.warning("%s: %d transitions of envs ahead of the others were not written (next-step autoreset)",
                        self.store.path, self.waiting())  # fmt: skip
        if self.store.closed:
            return
        if self.owns_store:
            self.store.close()
        else:
            self.store.commit()


class RecordTransitions(gymnasium.Wrapper):
    """Write every transition of a (single) gymnasium env into a store (docs/gymnasium.md).

    ``target`` is a buffer folder (resumed if it holds one; another spec raises
    :class:`mmreplay.SpecMismatchError`) or an open writable :class:`mmreplay.Store` that
    the caller closes; ``capacity`` creates one; ``store_options`` go to :func:`mmreplay.create`.
    """

    def __init__(self, env: gymnasium.Env, target: str | os.PathLike | Store, capacity: int | None = None,
                 reward_dtype: Any = "float32", **store_options: Any):  # fmt: skip
        super().__init__(env)
        self._writer = _Writer(target, env.observation_space, env.action_space, 1, env.spec, capacity,
                               reward_dtype, store_options)  # fmt: skip
        self.store = self._writer.store
        self._obs: Any = None
        self._open = np.zeros(1, bool)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._writer.end_open_episodes([0], self._open)
        self._obs, self._open[0] = obs, False
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        if self._obs is None:
            raise gymnasium.error.ResetNeeded("call reset() before step(): the recorder needs the first observation")
        obs, reward, terminated, truncated, info = self.env.step(action)
        one = lambda x: np.asarray(x)[None]  # noqa: E731 - the env axis of one env
        transition = {
            "observation": _map(one, _as_nest(self.observation_space, self._obs)),
            "action": _map(one, _as_nest(self.action_space, action)),
            "reward": one(reward),
            "terminated": one(terminated),
            "truncated": one(truncated),
            "next_observation": _map(one, _as_nest(self.observation_space, obs)),
        }
        try:
            self._writer.push(self._writer.leaves(transition))
        except Exception:
            # the env stepped all the same: follow it, ending the episode recorded so far,
            # so that no transition joins across the one refused
            self._writer.end_open_episodes([0], self._open)
            self._obs, self._open[0] = obs, False
            raise
        self._obs, self._open[0] = obs, not (terminated or truncated)
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        """Close the env, then commit the store (closing it if the recorder opened it)."""
        try:
            super().close()
        finally:
            if hasattr(self, "_writer"):
                self._writer.release()


class RecordVectorTransitions(gymnasium.vector.VectorWrapper):
    """Write every transition of a gymnasium vector env into a store, one env per store
    env, under any autoreset mode; arguments as :class:`RecordTransitions`."""

    def __init__(self, env: gymnasium.vector.VectorEnv, target: str | os.PathLike | Store,
                 capacity: int | None = None, reward_dtype: Any = "float32", **store_options: Any):  # fmt: skip
        super().__init__(env)
        self._writer = _Writer(target, env.single_observation_space, env.single_action_space, env.num_envs,
                               _single_spec(env), capacity, reward_dtype, store_options)  # fmt: skip
        self.store = self._writer.store
        self.autoreset_mode = _autoreset_mode(env)
        self._obs: Any = None
        self._open = np.zeros(env.num_envs, bool)
        self._autoreset = np.zeros(env.num_envs, bool)

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        mask = None if options is None else options.get("reset_mask")  # gymnasium's vector envs pop it
        obs, info = self.env.reset(seed=seed, options=options)
        if mask is None or self._obs is None:
            envs = np.arange(self.num_envs)
            self._obs = _map(np.array, obs)
        else:
            envs = np.flatnonzero(mask)
            for old, fresh in zip(flatten(self._obs), flatten(obs)):
                old[envs] = np.asarray(fresh)[envs]
        self._writer.end_open_episodes(envs, self._open)
        self._open[envs] = self._autoreset[envs] = False
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict]:
        if self._obs is None:
            raise gymnasium.error.ResetNeeded("call reset() before step(): the recorder needs the first observations")
        obs, rewards, terminations, truncations, infos = self.env.step(actions)
        done = np.logical_or(terminations, truncations)
        next_obs = obs
        if self.autoreset_mode == "samestep" and done.any():
            next_obs = _with_final_obs(obs, infos, done)
        transition = {
            "observation": self._obs,
            "action": actions,
            "reward": rewards,
            "terminated": terminations,
            "truncated": truncations,
            "next_observation": next_obs,
        }
        refused = None
        try:
            leaves = self._writer.leaves(transition)
            if self.autoreset_mode == "nextstep" and self._autoreset.any():
                self._writer.push(leaves, np.flatnonzero(~self._autoreset))  # resetting envs made no transition
            else:
                self._writer.push(leaves)
        except Exception as exc:  # the envs stepped all the same: as RecordTransitions.step
            self._writer.end_open_episodes(range(self.num_envs), self._open)
            refused = exc
        self._obs = _map(np.array, obs)
        self._open = ~done if refused is None else np.zeros_like(done)
        if self.autoreset_mode == "nextstep":
            self._open &= ~self._autoreset
            self._autoreset = done
        if refused is not None:
            raise refused
        return obs, rewards, terminations, truncations, infos

    @property
    def waiting(self) -> int:
        """Transitions held in RAM until every env has one (next-step autoreset)."""
        return self._writer.waiting()

    def close(self, **kwargs: Any) -> None:
        """Close the env, then commit the store (closing it if the recorder opened it); the
        transitions still waiting are dropped, with a warning."""
        try:
            super().close(**kwargs)
        finally:
            if hasattr(self, "_writer"):
                self._writer.release()


#: keys ``gymnasium.make_vec`` adds to the spec's kwargs; ``gymnasium.make`` takes none
_VECTOR_KWARGS = ("num_envs", "vectorization_mode", "vector_kwargs", "wrappers")


def _single_spec(env: Any) -> Any:
    """The spec of one env of a vector env (what ``gymnasium.make`` rebuilds), if known."""
    spec = getattr(env, "spec", None)
    if spec is None or spec.entry_point is None:
        return None
    kwargs = {k: v for k, v in (spec.kwargs or {}).items() if k not in _VECTOR_KWARGS}
    if kwargs.get("max_episode_steps") == spec.max_episode_steps:
        kwargs.pop("max_episode_steps", None)
    return dataclasses.replace(spec, kwargs=kwargs)


def _autoreset_mode(env: Any) -> str:
    """``"nextstep"``, ``"samestep"`` or ``"disabled"`` (gymnasium 1.0 has only next-step)."""
    mode = env.metadata.get("autoreset_mode", "nextstep")
    name = str(getattr(mode, "value", mode)).lower().replace("_", "").replace("-", "")
    if name not in ("nextstep", "samestep", "disabled"):
        raise ValueError(f"unknown autoreset mode {mode!r} in the env's metadata")
    return name


def _with_final_obs(obs: Any, infos: dict, done: np.ndarray) -> Any:
    """Observations with the final ones (same-step autoreset) where an episode ended."""
    final = infos.get("final_obs")
    if final is None:
        raise ValueError("same-step autoreset: infos lacks 'final_obs'")
    mask = np.asarray(infos.get("_final_obs", done), bool)
    out = _map(np.array, obs)
    for i in np.flatnonzero(mask):
        for leaf, value in zip(flatten(out), flatten(final[i])):
            leaf[i] = value
    return out


def _as_nest(space: Any, value: Any) -> Any:
    """``value`` with the lists that gymnasium's ``Tuple`` spaces accept (``contains``) as tuples."""
    if isinstance(space, gymnasium.spaces.Tuple) and isinstance(value, list):
        value = tuple(value)
    if isinstance(space, gymnasium.spaces.Tuple) and isinstance(value, tuple):
        return tuple(_as_nest(s, v) for s, v in zip(space.spaces, value))
    if isinstance(space, gymnasium.spaces.Dict) and isinstance(value, Mapping):
        return {k: _as_nest(space.spaces.get(k), v) for k, v in value.items()}
    return value


def _map(fn: Any, nest: Any) -> Any:
    """``fn`` over the leaves of an observation / action nest (dicts and tuples)."""
    if isinstance(nest, Mapping):
        return {k: _map(fn, v) for k, v in nest.items()}
    if isinstance(nest, tuple):
        return tuple(_map(fn, v) for v in nest)
    return fn(nest)
