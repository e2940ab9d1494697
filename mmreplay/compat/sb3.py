"""Stable-Baselines3 (and CleanRL): SB3's replay buffers over a persistent store.

One argument turns an SB3 off-policy model's buffer into a folder on disk::

    from mmreplay.compat.sb3 import ReplayBuffer
    model = DQN("MlpPolicy", env, replay_buffer_class=ReplayBuffer,
                replay_buffer_kwargs={"path": "runs/buf"})

CleanRL's scripts construct SB3's buffer by hand; only their import changes
(``from mmreplay.compat.sb3 import ReplayBuffer``).

:class:`ReplayBuffer` and :class:`DictReplayBuffer` are subclasses of SB3's own classes
(SB3's ``load_replay_buffer`` checks ``isinstance``) and translate SB3's API to the
store's: ``add`` writes one store step of ``n_envs`` rows, ``sample`` draws through
:meth:`mmreplay.Store.sample`, ``_get_samples(batch_inds)`` reads the rows SB3's indices
name. They keep no rows, cursor or draw logic of their own: ``pos`` and ``full`` are
derived from the store's step count, and SB3 index ``i`` is store slot
``(origin + i) % buffer_size`` (the origin moves on :meth:`ReplayBuffer.reset`).

The store's leaves are ``observation``, ``next_observation`` (dicts of the keys for a
``Dict`` space), ``action`` ``(action_dim,)``, ``reward``, ``terminated`` and
``truncated``, with those roles, so ``episodes()`` and every export read what SB3
collected. A step's ``done`` is stored as ``terminated = done and not timeout`` and
``truncated = done and timeout``, the timeout coming from
``infos[i]["TimeLimit.truncated"]``; SB3's ``dones`` is their union, and its
``timeouts`` is ``truncated`` when ``handle_timeout_termination`` (else zeros), so the
``dones`` a batch carries are SB3's exactly.

Persistence: the buffer is the folder. Steps are committed every ``commit_every`` adds,
by ``model.save_replay_buffer`` and when the process exits normally (a batch draws from
every step added, committed or not). A folder that already
holds a buffer of the same spaces, size and number of envs is resumed. Pickling (what
``save_replay_buffer`` does) writes a manifest naming the folder, not the arrays.

``optimize_memory_usage=True`` stores each observation once (:class:`mmreplay.Frames`):
a row's next observation is read from the next step of its env, and the terminal
observation of an episode that ended, which SB3's own memory-saving buffer loses, is
kept in the store's side ring, so it combines with ``handle_timeout_termination`` (SB3
refuses that pair). With ``frame_stack=4`` (frame-stacked pixels, as ``VecFrameStack``
makes them) only the newest frame of each stack is stored.
"""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

import numpy as np

try:
    import torch as th
    from gymnasium import spaces
    from stable_baselines3.common import buffers as sb3_buffers
    from stable_baselines3.common.preprocessing import get_action_dim, get_obs_shape
    from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
    from stable_baselines3.common.utils import get_device
except ImportError as exc:  # pragma: no cover - stable-baselines3 is an install extra
    raise ImportError("mmreplay.compat.sb3 needs stable-baselines3: pip install 'mmreplay[sb3]'") from exc

from ..errors import BadInputError, SpecMismatchError
from ..frames import Frames
from ..spec import ArraySpec, unflatten
from ..store import DEFAULT_COMMIT_EVERY, Store, create
from ._shared import StoreShell, read_origin, read_rows, temporary, write_origin

__all__ = ["ReplayBuffer", "DictReplayBuffer", "MANIFEST_KIND"]

#: the store attribute recording the spaces a buffer was made for
SPACES_ATTR = "sb3_spaces"

#: ``kind`` of the manifest that pickling a buffer writes
MANIFEST_KIND = "mmreplay.compat.sb3"

# the open buffer of each folder in this process, so a manifest loaded in the process
# that saved it takes the folder (and its writer lock) over from that buffer
_open_buffers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _leaf(space: Any, shape: tuple[int, ...]) -> ArraySpec:
    return ArraySpec(tuple(int(n) for n in shape), np.dtype(space.dtype).name)


#: what ReplayBuffer._step_layout() sets: not pickled, rebuilt when a manifest is loaded
_STEP_LAYOUT = (
    "_obs_step_shape",
    "_obs_keys",
    "_action_shape",
    "_reward_shape",
    "_no_ends",
    "_no_ends_bytes",
)

_BOOL, _FLOAT32, _FLOAT64 = np.dtype(bool), np.dtype(np.float32), np.dtype(np.float64)


def _as_leaf(value: Any, dtype: np.dtype, shape: tuple[int, ...], also: np.dtype | None = None) -> np.ndarray:
    """``value`` as an array of ``dtype`` and ``shape``: itself when it already is one, or
    one of dtype ``also`` (which the store casts as it writes). Dtypes compare by
    identity here (numpy's built-in dtypes are singletons); a miss only costs a copy."""
    if type(value) is np.ndarray and value.shape == shape and (value.dtype is dtype or value.dtype is also):
        return value
    return np.asarray(value, dtype).reshape(shape)


class ReplayBuffer(StoreShell, sb3_buffers.ReplayBuffer):
    """SB3's ``ReplayBuffer`` over a store in the folder ``path``; ``close()`` commits and
    releases it (it is also a context manager).

    Args:
        buffer_size, observation_space, action_space, device, n_envs,
        optimize_memory_usage, handle_timeout_termination: as SB3's (``buffer_size`` is
            the total over envs: the store keeps ``buffer_size // n_envs`` steps).
        path: the buffer's folder; a buffer of the same spaces there is resumed.
            None keeps it in a temporary folder removed with the buffer.
        commit_every: adds between automatic commits.
        backend, compression, durability: how the store is created (see
            :func:`mmreplay.create`).
        env: accepted for SB3's HER, unused.
        sampler, sampler_options: the store's sampler for :meth:`sample`, such as
            ``sampler="prioritized", alpha=0.6`` (see :func:`mmreplay.create`); a
            resumed buffer keeps the one it was created with.
        frame_stack, frame_pad: with ``optimize_memory_usage``, observations that are
            stacks of this many frames (``VecFrameStack``'s, padded with zeros at an
            episode's start: ``frame_pad="zeros"``) are stored one frame per step.
        final_slots: with ``optimize_memory_usage``, the terminal observations kept
            (see :class:`mmreplay.Frames`); None: one per 16 rows. When more episodes
            end within the buffer, its oldest steps are dropped early.

    Raises:
        SpecMismatchError: ``path`` holds a different buffer (left untouched).
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        path: str | os.PathLike | None = None,
        commit_every: int = DEFAULT_COMMIT_EVERY,
        backend: str = "zarr",
        compression: Any = None,
        durability: str = "process",
        env: Any = None,
        sampler: str | None = None,
        frame_stack: int = 1,
        frame_pad: str = "zeros",
        final_slots: int | None = None,
        **sampler_options: Any,
    ):
        if frame_stack != 1 and not optimize_memory_usage:
            raise ValueError("frame_stack needs optimize_memory_usage=True (frames stored once)")
        # SB3's BaseBuffer.__init__ minus pos/full, which the store's step count gives
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape = get_obs_shape(observation_space)
        self.action_dim = get_action_dim(action_space)
        self.device = get_device(device)
        self.n_envs = n_envs
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = bool(optimize_memory_usage)
        self._frame_stack = frame_stack
        self._frame_pad = frame_pad
        self._final_slots = final_slots
        self.handle_timeout_termination = handle_timeout_termination
        self._action_dtype = np.dtype(self._maybe_cast_dtype(action_space.dtype))
        self._step_layout()
        self.store: Store | None = None
        #: where the rows of the last :meth:`sample` came from (``step``, ``env``,
        #: ``probability`` and, from a prioritized sampler, ``weight``)
        self.last_info: Any = None
        if sampler is not None:
            sampler_options["sampler"] = sampler
        self._open(path, commit_every, backend, compression, durability, sampler_options)

    # --- the store ---------------------------------------------------------------------

    def _step_layout(self) -> None:
        """What :meth:`add` converts to, worked out once: the leaf shapes of one step."""
        self._obs_step_shape = (self.n_envs, *self.obs_shape) if isinstance(self.obs_shape, tuple) else None
        # a Dict space's keys in the order of the store's leaves
        self._obs_keys = sorted(self.obs_shape) if isinstance(self.obs_shape, dict) else None
        self._action_shape = (self.n_envs, self.action_dim)
        self._reward_shape = (self.n_envs,)
        self._no_ends = np.zeros(self.n_envs, bool)  # only ever copied into the store
        self._no_ends_bytes = self._no_ends.tobytes()

    def _observation_spec(self) -> Any:
        return _leaf(self.observation_space, self.obs_shape)

    def _spec(self) -> dict[str, Any]:
        obs = self._observation_spec()
        return {
            "observation": obs,
            "next_observation": obs,
            "action": ArraySpec((self.action_dim,), np.dtype(self._action_dtype).name),
            "reward": ArraySpec((), "float32"),
            "terminated": ArraySpec((), "bool"),
            "truncated": ArraySpec((), "bool"),
        }

    def _frames(self) -> Frames | None:
        """The store's frames-once layout for ``optimize_memory_usage``."""
        if not self.optimize_memory_usage:
            return None
        slots = self._final_slots
        if slots is None:
            slots = max(4 * self.n_envs, self.buffer_size * self.n_envs // 16)
        return Frames(frame_stack=self._frame_stack, pad=self._frame_pad, final_slots=slots)

    def _open(
        self,
        path: Any,
        commit_every: int,
        backend: str,
        compression: Any,
        durability: str,
        sampling: dict[str, Any],
    ) -> None:
        options = {"commit_every": commit_every, "backend": backend, "compression": compression, **sampling}
        self._backend = backend
        if path is None:
            folder = os.path.join(temporary(self).folder, "buffer")
        else:
            folder = os.path.abspath(os.fspath(path))
        self._take_over(folder)
        store = create(
            folder,
            self._spec(),
            self.buffer_size,
            self.n_envs,
            durability=durability,
            exist_ok=True,
            frames=self._frames(),
            **options,
        )
        if path is None:
            self._temp.store = store
        self._attach(store)
        self._check_spaces(store)

    def _check_spaces(self, store: Store) -> None:
        """Record the spaces in a new store; refuse (closing it) a store of other spaces.

        The leaves alone do not tell ``Discrete(3)`` from ``Discrete(4)``.
        """
        spaces_now = {
            "observation_space": repr(self.observation_space),
            "action_space": repr(self.action_space),
        }
        recorded = store.attrs.get(SPACES_ATTR)
        if recorded is None:
            store.set_attrs(**{SPACES_ATTR: spaces_now})
        elif recorded != spaces_now:
            store.close()
            self.store = None
            diffs = "; ".join(
                f"{k}: existing {recorded.get(k)} vs new {v}"
                for k, v in spaces_now.items()
                if recorded.get(k) != v
            )
            raise SpecMismatchError(f"{store.path}: a replay buffer of other spaces exists there ({diffs})")

    def _take_over(self, folder: str) -> None:
        """Close the buffer of this process that holds ``folder`` (committing it)."""
        other = _open_buffers.get(folder)
        if other is not None and other is not self and other.store is not None:
            other.store.close()
            other.store = None

    def _attach(self, store: Store) -> None:
        self.store = store
        self._origin = read_origin(store)
        self._leaves = store.leaf_paths
        _open_buffers[store.path] = self

    def _live(self) -> Store:
        if self.store is None:
            raise BadInputError(
                "this replay buffer's store was closed (another buffer in this process opened its folder)"
            )
        return self.store

    # --- SB3's cursor, derived from the store ----------------------------------------

    @property
    def pos(self) -> int:  # type: ignore[override]
        return (self._live().total_steps - self._origin) % self.buffer_size

    @property
    def full(self) -> bool:  # type: ignore[override]
        return self._live().total_steps - self._origin >= self.buffer_size

    def size(self) -> int:
        n = self._live().total_steps - self._origin
        return min(n, self.buffer_size)

    def reset(self) -> None:
        """Forget every step (``pos`` 0, not full), as SB3's; the store is cleared."""
        store = self._live()
        store.clear()
        self._origin = store.total_steps
        write_origin(store, self._origin)

    def _steps_of(self, batch_inds: np.ndarray) -> np.ndarray:
        """Global step ids of SB3 indices: the newest step written at each index."""
        n = self._live().total_steps - self._origin
        inds = np.asarray(batch_inds, np.int64)
        if inds.size and (inds.min() < 0 or inds.max() >= min(n, self.buffer_size)):
            raise IndexError(
                f"{self.store.path}: indices must be in [0, {self.size()}), got {inds.min()}..{inds.max()}"
            )
        return self._origin + inds + self.buffer_size * ((n - 1 - inds) // self.buffer_size)

    # --- writes ------------------------------------------------------------------------

    def _timeouts(self, infos: Any) -> np.ndarray:
        if isinstance(infos, (list, tuple)):
            return np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos], bool)
        return np.zeros(self.n_envs, bool)  # CleanRL passes gymnasium's dict of infos

    def _observation_leaves(self, obs: Any) -> list[np.ndarray]:
        """``obs`` as SB3 stores it, ``[n_envs, *obs_shape]`` in the space's dtype, as the
        store's leaves of an observation."""
        return [_as_leaf(obs, self.observation_space.dtype, self._obs_step_shape)]

    def add(
        self,
        obs: Any,
        next_obs: Any,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: Any,
    ) -> None:
        store = self.store if self.store is not None else self._live()
        done = _as_leaf(done, _BOOL, self._reward_shape)
        if done.tobytes() == self._no_ends_bytes:  # most steps end nothing: no infos to read
            terminated = truncated = self._no_ends
        else:
            truncated = self._timeouts(infos) & done
            terminated = done & ~truncated
        # Every leaf is now of its dtype (or float64 rewards, cast as they are written) and
        # step shape, so the step goes to the store's writer without a second check; the
        # leaves in the store's order (keys sorted, see _spec).
        store.add_leaves(
            [
                _as_leaf(action, self._action_dtype, self._action_shape),
                *self._observation_leaves(next_obs),
                *self._observation_leaves(obs),
                _as_leaf(reward, _FLOAT32, self._reward_shape, also=_FLOAT64),
                terminated,
                truncated,
            ]
        )

    # --- reads -------------------------------------------------------------------------

    def sample(self, batch_size: int, env: Any = None, **options: Any) -> Any:
        """A batch drawn through the store's sampler (uniform over every (step, env)
        added, by default); :attr:`last_info` says where its rows came from.

        ``options`` go to the sampler (``beta=0.4`` for the prioritized one).
        """
        batch, self.last_info = self._live().sample(batch_size, return_info=True, **options)
        return self._to_samples(batch, env)

    def update_priorities(self, priorities: Any, info: Any = None) -> int:
        """New priorities (such as ``|TD error|``) for the rows of a prioritized
        :meth:`sample` (by default the last one); returns how many were applied."""
        info = self.last_info if info is None else info
        if info is None:
            raise BadInputError("update_priorities needs the info of a sample(); none was drawn yet")
        return self._live().update_priorities(
            info.step, info.env, np.asarray(priorities, np.float64).reshape(-1)
        )

    def _get_samples(self, batch_inds: np.ndarray, env: Any = None) -> Any:
        """SB3's rows ``batch_inds``, each from an env drawn with ``np.random`` as SB3 does."""
        env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        store = self._live()
        rows = read_rows(store, self._steps_of(batch_inds), env_indices)
        return self._to_samples(unflatten(store.spec, rows), env)

    def _dones(self, terminated: np.ndarray, truncated: np.ndarray) -> np.ndarray:
        """SB3's ``dones * (1 - timeouts)``."""
        ends = terminated if self.handle_timeout_termination else terminated | truncated
        return ends.astype(np.float32).reshape(-1, 1)

    def _to_samples(self, batch: dict[str, Any], env: Any) -> Any:
        return ReplayBufferSamples(
            *map(
                self.to_torch,
                (
                    self._normalize_obs(batch["observation"], env),
                    batch["action"],
                    self._normalize_obs(batch["next_observation"], env),
                    self._dones(batch["terminated"], batch["truncated"]),
                    self._normalize_reward(batch["reward"].reshape(-1, 1), env),
                ),
            )
        )

    def _column(self, leaf: str) -> np.ndarray:
        """A leaf laid out as SB3's array ``[buffer_size, n_envs, ...]`` (zeros where unwritten)."""
        store = self._live()
        index = self._leaves.index(leaf)
        spec = store.leaves[index].info.spec
        out = np.zeros((self.buffer_size, self.n_envs, *spec.shape), spec.dtype)
        filled = np.arange(self.size())
        if filled.size:
            out[filled] = store.read_steps(self._steps_of(filled), leaves=[index])[0]
        return out

    @property
    def dones(self) -> np.ndarray:  # type: ignore[override]
        """SB3's ``dones`` (a copy): 1.0 where an episode ended."""
        return (self._column("terminated") | self._column("truncated")).astype(np.float32)

    @property
    def timeouts(self) -> np.ndarray:  # type: ignore[override]
        """SB3's ``timeouts`` (a copy): 1.0 where it ended by a time limit, if handled."""
        if not self.handle_timeout_termination:
            return np.zeros((self.buffer_size, self.n_envs), np.float32)
        return self._column("truncated").astype(np.float32)

    @property
    def rewards(self) -> np.ndarray:  # type: ignore[override]
        """SB3's ``rewards`` (a copy)."""
        return self._column("reward")

    @property
    def actions(self) -> np.ndarray:  # type: ignore[override]
        """SB3's ``actions`` (a copy)."""
        return self._column("action")

    # --- pickling: a manifest naming the folder -----------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """Commit, then describe the buffer without its rows: what ``save_replay_buffer`` writes."""
        store = self._live()
        store.commit()
        if getattr(self, "_temp", None) is not None:
            warnings.warn(
                f"{store.path}: this replay buffer lives in a temporary folder removed with it, so the saved "
                "manifest names a folder that will be gone; pass replay_buffer_kwargs={'path': ...} to keep it",
                stacklevel=2,
            )
        skip = ("store", "_temp", "_cleanup", "_leaves", "last_info", *_STEP_LAYOUT)
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        state["kind"] = MANIFEST_KIND
        state["path"] = store.path
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Reopen the folder a manifest names (taking it over from this process's buffer).

        The buffer is the folder's as it is now, not a snapshot of when it was saved.
        """
        if state.get("kind") != MANIFEST_KIND:
            raise BadInputError(f"expected a manifest of kind {MANIFEST_KIND!r}, got {state.get('kind')!r}")
        state = dict(state)
        path = state.pop("path")
        del state["kind"]
        self.__dict__.update(state)
        self._step_layout()
        self.store = None
        self.last_info = None
        self._take_over(path)
        self._attach(
            create(
                path,
                self._spec(),
                self.buffer_size,
                self.n_envs,
                backend=self._backend,
                exist_ok=True,
                frames=self._frames(),
            )
        )


class DictReplayBuffer(ReplayBuffer, sb3_buffers.DictReplayBuffer):
    """SB3's ``DictReplayBuffer`` (``Dict`` observation spaces) over a store; see :class:`ReplayBuffer`."""

    def _observation_spec(self) -> Any:
        if not isinstance(self.obs_shape, dict):
            raise BadInputError(
                f"DictReplayBuffer needs a Dict observation space, got {self.observation_space}"
            )
        return {k: _leaf(self.observation_space[k], shape) for k, shape in self.obs_shape.items()}

    def _observation_leaves(self, obs: Any) -> list[np.ndarray]:
        space = self.observation_space
        shapes = self.obs_shape
        return [_as_leaf(obs[k], space[k].dtype, (self.n_envs, *shapes[k])) for k in self._obs_keys]

    def sample(self, batch_size: int, env: Any = None, **options: Any) -> Any:
        return ReplayBuffer.sample(self, batch_size, env, **options)

    def _to_samples(self, batch: dict[str, Any], env: Any) -> Any:
        obs = self._normalize_obs(batch["observation"], env)
        next_obs = self._normalize_obs(batch["next_observation"], env)
        return DictReplayBufferSamples(
            observations={k: self.to_torch(v) for k, v in obs.items()},
            actions=self.to_torch(batch["action"]),
            next_observations={k: self.to_torch(v) for k, v in next_obs.items()},
            dones=self.to_torch(self._dones(batch["terminated"], batch["truncated"])),
            rewards=self.to_torch(self._normalize_reward(batch["reward"].reshape(-1, 1), env)),
        )
