"""gymnasium: the transition spec of an env's spaces, and recorders that fill a store.

Wrap an env (or a vector env) and every transition it makes lands in a store::

    env = RecordTransitions(gymnasium.make("CartPole-v1"), "run/cartpole", capacity=100_000)
    venv = RecordVectorTransitions(gymnasium.make_vec("CartPole-v1", num_envs=8), "run/vec",
                                   capacity=100_000)

A transition is ``observation, action, reward, terminated, truncated,
next_observation`` (:func:`spec_from_spaces`), one store row per env and step, with
those roles recorded, so the store's episodes, samplers and exports understand it.
Reopening the same path resumes it (a different spec is refused). Each env's rows are
its own transitions in time order, and the final observation of an episode is the
``next_observation`` of its last row, whatever the vector env's autoreset mode:

- next-step (gymnasium's default, and the only mode of 1.0): the step after an episode
  ends only resets that env (its action is ignored); it is not a transition and is
  not written. A store step holds one transition per env, so an env that skipped a
  step lags the others: transitions of the envs ahead wait in RAM (as many as the
  difference in episodes ended) and are written when every env has one. They are
  not durable until then; at ``close()`` the ones still waiting are dropped (a
  warning says how many).
- same-step: the final observation comes from ``info["final_obs"]``.
- disabled: envs are reset by ``reset(options={"reset_mask": ...})``; every step is
  a transition.

A ``reset()`` that cuts an episode short marks that episode's last transition
``truncated``, so episodes never run into each other; on resume, the store itself ends
the episodes the previous process left open (see :mod:`mmreplay.episodes`).
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

from ..errors import SpecMismatchError
from ..metadata import METADATA_FILE
from ..spaces import SPACES_ATTR, space_to_json
from ..spec import ArraySpec, flatten, leaf_paths, to_spec, unflatten
from ..store import DEFAULT_COMMIT_EVERY, Store, create
from ..store import open as open_store
from ._shared import describe, flatten_like

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

#: role -> leaf of the transition spec
TRANSITION_ROLES = {
    "observation": "observation",
    "action": "action",
    "reward": "reward",
    "terminated": "terminated",
    "truncated": "truncated",
    "next_observation": "next_observation",
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


def _attach(
    target: str | os.PathLike | Store,
    spec: dict[str, Any],
    roles: dict[str, str],
    num_envs: int,
    capacity: int | None,
    options: Mapping[str, Any],
) -> Store:
    """The store to record into: given, reopened (checked) or created."""
    if isinstance(target, Store):
        store = target
    else:
        path = os.fspath(target)
        if os.path.exists(os.path.join(path, METADATA_FILE)):
            store = open_store(path, "a")
            if capacity is not None and store.capacity != capacity:
                store.close()
                raise SpecMismatchError(f"{path}: capacity: existing {store.capacity} vs new {capacity}")
        else:
            if capacity is None:
                raise ValueError(f"{path}: no buffer there; give capacity= to create one")
            return create(path, spec, capacity, num_envs, roles=roles, **options)
    problems = []
    if describe(store.spec) != describe(spec):
        problems.append(f"spec: existing {store.spec} vs new {spec}")
    if store.num_envs != num_envs:
        problems.append(f"num_envs: existing {store.num_envs} vs new {num_envs}")
    if store.mode != "a":
        problems.append("it is open read-only")
    if problems:
        where = store.path
        if not isinstance(target, Store):
            store.close()
        raise SpecMismatchError(f"{where}: cannot record into this buffer ({'; '.join(problems)})")
    return store


class _Writer:
    """Per-env transition queues over a store: rows are written a whole step at a time."""

    def __init__(self, store: Store, spec: dict[str, Any], num_envs: int):
        self.store = store
        self.spec = spec
        self.num_envs = num_envs
        self.leaf_specs: list[ArraySpec] = flatten(spec)
        self.truncated = leaf_paths(spec).index("truncated")
        self.queues: list[deque[list[Any]]] = [deque() for _ in range(num_envs)]

    def leaves(self, transition: dict[str, Any]) -> list[np.ndarray]:
        """Leaves of a batched transition ``[num_envs, ...]`` in spec order."""
        values = flatten_like(self.spec, transition)
        if values is None:
            raise ValueError(f"the transition does not match the spec {self.spec}")
        return [np.asarray(v, s.dtype) for v, s in zip(values, self.leaf_specs)]

    def write_all(self, leaves: list[np.ndarray]) -> None:
        """Every env made a transition and none is waiting: one store step, no queue."""
        if any(self.queues):
            self.push(leaves, range(self.num_envs))
        else:
            self.store.add(unflatten(self.spec, leaves))

    def push(self, leaves: list[np.ndarray], envs: Any) -> None:
        """Queue the transitions of ``envs``, then write every step all envs have."""
        for i in envs:
            self.queues[i].append([np.array(leaf[i]) for leaf in leaves])
        while all(self.queues):
            rows = [q.popleft() for q in self.queues]
            self.store.add(unflatten(self.spec, [np.stack(col) for col in zip(*rows)]))

    def end_open_episodes(self, envs: Any, open_: np.ndarray) -> None:
        """Mark the last transition of each env in ``envs`` whose episode is open truncated."""
        written = []
        for i in envs:
            if not open_[i]:
                continue
            if self.queues[i]:
                self.queues[i][-1][self.truncated] = np.True_
            else:
                written.append(i)
        if written:
            self._truncate_written(np.array(written))

    def _truncate_written(self, envs: np.ndarray) -> None:
        store = self.store
        if store.total_steps == 0:
            return
        store.commit()
        index = store.total_steps - 1 - store.first_step
        if index < 0:
            return
        step = flatten(store.get(index))
        step[self.truncated][envs] = True
        store.set(index, unflatten(self.spec, step))
        store.commit()

    def waiting(self) -> int:
        return sum(len(q) for q in self.queues)


class RecordTransitions(gymnasium.Wrapper):
    """Write every transition of a (single) gymnasium env into a store.

    Args:
        env: the env to record.
        target: a buffer folder (reopened and resumed if it exists) or an open
            writable :class:`mmreplay.Store` (the caller closes it).
        capacity: steps the store holds (needed to create it).
        reward_dtype: dtype of the reward leaf.
        store_options: passed to :func:`mmreplay.create` (``backend``,
            ``compression``, ``commit_every``, ``durability``...).

    Raises:
        mmreplay.SpecMismatchError: the buffer at ``target`` holds other transitions.

    Example:
        >>> import gymnasium, tempfile
        >>> env = RecordTransitions(gymnasium.make("CartPole-v1"), tempfile.mkdtemp() + "/b", capacity=100)
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step(0)
        >>> env.store.total_steps
        1
        >>> env.close()
    """

    def __init__(
        self,
        env: gymnasium.Env,
        target: str | os.PathLike | Store,
        capacity: int | None = None,
        reward_dtype: Any = "float32",
        **store_options: Any,
    ):
        super().__init__(env)
        spec, roles = spec_from_spaces(env.observation_space, env.action_space, reward_dtype)
        store_options.setdefault("commit_every", DEFAULT_COMMIT_EVERY)
        self._owns_store = not isinstance(target, Store)
        self.store = _attach(target, spec, roles, 1, capacity, store_options)
        record_spaces(self.store, env.observation_space, env.action_space, env.spec)
        self._writer = _Writer(self.store, spec, 1)
        self._obs: Any = None
        self._open = np.zeros(1, bool)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._writer.end_open_episodes([0], self._open)
        self._obs = obs
        self._open[0] = False
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        if self._obs is None:
            raise gymnasium.error.ResetNeeded(
                "call reset() before step(): the recorder needs the first observation"
            )
        obs, reward, terminated, truncated, info = self.env.step(action)
        one = lambda x: np.asarray(x)[None]  # noqa: E731 - the env axis of one env
        transition = {
            "observation": _map(one, self._obs),
            "action": _map(one, action),
            "reward": one(reward),
            "terminated": one(terminated),
            "truncated": one(truncated),
            "next_observation": _map(one, obs),
        }
        self._writer.write_all(self._writer.leaves(transition))
        self._obs = obs
        self._open[0] = not (terminated or truncated)
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        """Close the env, then commit and close the store (if the recorder opened it)."""
        try:
            super().close()
        finally:
            _release(self)


class RecordVectorTransitions(gymnasium.vector.VectorWrapper):
    """Write every transition of a gymnasium vector env into a store (one env per store env).

    Args:
        env: the vector env to record.
        target, capacity, reward_dtype, store_options: as :class:`RecordTransitions`.

    Example:
        >>> import gymnasium, tempfile
        >>> venv = gymnasium.make_vec("CartPole-v1", num_envs=2)
        >>> venv = RecordVectorTransitions(venv, tempfile.mkdtemp() + "/b", capacity=100)
        >>> obs, info = venv.reset(seed=0)
        >>> obs, rewards, terminations, truncations, infos = venv.step(venv.action_space.sample())
        >>> venv.store.total_steps, venv.store.num_envs
        (1, 2)
        >>> venv.close()
    """

    def __init__(
        self,
        env: gymnasium.vector.VectorEnv,
        target: str | os.PathLike | Store,
        capacity: int | None = None,
        reward_dtype: Any = "float32",
        **store_options: Any,
    ):
        super().__init__(env)
        spec, roles = spec_from_spaces(env.single_observation_space, env.single_action_space, reward_dtype)
        store_options.setdefault("commit_every", DEFAULT_COMMIT_EVERY)
        self._owns_store = not isinstance(target, Store)
        self.store = _attach(target, spec, roles, env.num_envs, capacity, store_options)
        record_spaces(self.store, env.single_observation_space, env.single_action_space, _single_spec(env))
        self._spec = spec
        self._writer = _Writer(self.store, spec, env.num_envs)
        self.autoreset_mode = _autoreset_mode(env)
        self._obs: Any = None
        self._open = np.zeros(env.num_envs, bool)
        self._autoreset = np.zeros(env.num_envs, bool)

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        obs, info = self.env.reset(seed=seed, options=options)
        mask = None if options is None else options.get("reset_mask")
        if mask is None or self._obs is None:
            envs = np.arange(self.num_envs)
            self._obs = _map(np.array, obs)
        else:
            envs = np.flatnonzero(mask)
            obs_leaves, new = flatten(self._obs), flatten(obs)
            for old, fresh in zip(obs_leaves, new):
                old[envs] = np.asarray(fresh)[envs]
        self._writer.end_open_episodes(envs, self._open)
        self._open[envs] = False
        self._autoreset[envs] = False
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict]:
        if self._obs is None:
            raise gymnasium.error.ResetNeeded(
                "call reset() before step(): the recorder needs the first observations"
            )
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
        leaves = self._writer.leaves(transition)
        if self.autoreset_mode == "nextstep" and self._autoreset.any():
            self._writer.push(leaves, np.flatnonzero(~self._autoreset))  # resetting envs made no transition
        else:
            self._writer.write_all(leaves)
        self._obs = _map(np.array, obs)
        self._open = ~done
        if self.autoreset_mode == "nextstep":
            self._open &= ~self._autoreset
            self._autoreset = done
        return obs, rewards, terminations, truncations, infos

    @property
    def waiting(self) -> int:
        """Transitions held in RAM until every env has one (next-step autoreset)."""
        return self._writer.waiting()

    def close(self, **kwargs: Any) -> None:
        """Close the env, then commit and close the store (if the recorder opened it)."""
        writer = getattr(self, "_writer", None)
        if writer is not None and writer.waiting() and not writer.store.closed:
            log.warning(
                "%s: %d transitions of envs ahead of the others were not written (next-step autoreset)",
                writer.store.path,
                writer.waiting(),
            )
        try:
            super().close(**kwargs)
        finally:
            _release(self)


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


def _release(recorder: Any) -> None:
    """Commit the recorder's store, closing it if the recorder opened it (safe twice, and
    on a recorder whose constructor failed)."""
    store = getattr(recorder, "store", None)
    if store is None or store.closed:
        return
    if recorder._owns_store:
        store.close()
    else:
        store.commit()


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


def _map(fn: Any, nest: Any) -> Any:
    """``fn`` over the leaves of an observation / action nest (dicts and tuples)."""
    if isinstance(nest, Mapping):
        return {k: _map(fn, v) for k, v in nest.items()}
    if isinstance(nest, tuple):
        return tuple(_map(fn, v) for v in nest)
    return fn(nest)
