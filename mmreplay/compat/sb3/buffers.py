"""SB3's ``ReplayBuffer`` and ``DictReplayBuffer`` over a store (see the package docstring)."""

from __future__ import annotations

import os
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

from ...creation import create
from ...errors import BadInputError, NotEnoughDataError, SpecMismatchError
from ...frames_layout import Frames, commit_slots
from ...metadata import METADATA_FILE, read_static
from ...read import SampleRequest
from ...read import sample as sample_store
from ...spec import ArraySpec, unflatten
from ...store import DEFAULT_COMMIT_EVERY, Store
from .._shared import StoreShell, read_origin, temporary, write_origin
from .manifest import Manifested

__all__ = ["ReplayBuffer", "DictReplayBuffer"]

#: the store attribute recording the spaces a buffer was made for
SPACES_ATTR = "sb3_spaces"

_BOOL, _FLOAT32, _FLOAT64 = np.dtype(bool), np.dtype(np.float32), np.dtype(np.float64)


def _as_leaf(value: Any, dtype: np.dtype, shape: tuple[int, ...], also: np.dtype | None = None) -> np.ndarray:
    """``value`` as an array of ``dtype`` and ``shape``: itself when it already is one, or
    one of dtype ``also`` (which the store casts as it writes). Dtypes compare by
    identity here (numpy's built-in dtypes are singletons); a miss only costs a copy."""
    if type(value) is np.ndarray and value.shape == shape and (value.dtype is dtype or value.dtype is also):
        return value
    return np.asarray(value, dtype).reshape(shape)


class ReplayBuffer(Manifested, StoreShell, sb3_buffers.ReplayBuffer):
    """SB3's ``ReplayBuffer`` over a store in the folder ``path``; ``close()`` commits and
    releases it (it is also a context manager).

    Args:
        buffer_size ... handle_timeout_termination: as SB3's.
        path: the folder (a buffer of the same spaces there is resumed); None: a temporary
            folder removed with the buffer.
        commit_every, backend, compression, durability, sampler, sampler_options: the
            store's (:func:`mmreplay.create`; ``sampler="prioritized", alpha=0.6``); one
            left out (None) takes the resumed buffer's.
        env: accepted for SB3's HER, unused.
        frame_stack, frame_pad, final_slots: with ``optimize_memory_usage``, frame stacks
            stored one frame per step (:class:`mmreplay.Frames`).

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
        commit_every: int | None = None,
        backend: str | None = None,
        compression: Any = None,
        durability: str | None = None,
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
        self._frame_stack, self._frame_pad, self._final_slots = frame_stack, frame_pad, final_slots
        self.handle_timeout_termination = handle_timeout_termination
        self._action_dtype = np.dtype(self._maybe_cast_dtype(action_space.dtype))
        self._step_layout()
        self.store: Store | None = None
        self._filled = False  # SB3's ``full`` set by hand before the ring filled
        self._rng: np.random.Generator | None = None  # the store sampler's, seeded from np.random
        self.last_info: Any = None  # mmreplay.read.SampleInfo of the store sampler's last batch
        if sampler is not None:
            sampler_options["sampler"] = sampler
        sampler_options.update(durability=durability, commit_every=commit_every, compression=compression)
        self._backend = backend
        folder = os.path.join(temporary(self).folder, "buffer") if path is None else os.path.abspath(path)
        self._take_over(folder)
        store = self._create(folder, **sampler_options)
        if path is None:
            self._temp.store = store
        self._attach(store)
        self._check_spaces(store)

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
        space = self.observation_space
        if isinstance(space, spaces.Dict) != isinstance(self, DictReplayBuffer):
            need = "DictReplayBuffer" if isinstance(space, spaces.Dict) else "ReplayBuffer"
            raise BadInputError(f"{type(self).__name__}: {space} takes a {need}")
        if self._obs_keys is None:
            return ArraySpec(self.obs_shape, space.dtype)
        return {k: ArraySpec(shape, space[k].dtype) for k, shape in self.obs_shape.items()}

    def _create(self, folder: str, **options: Any) -> Store:
        """Create the store in ``folder``, or reopen the one of the same layout there."""
        obs = self._observation_spec()
        spec = {
            "observation": obs,
            "next_observation": obs,
            "action": ArraySpec((self.action_dim,), self._action_dtype.name),
            "reward": ArraySpec((), "float32"),
            "terminated": ArraySpec((), "bool"),
            "truncated": ArraySpec((), "bool"),
        }
        frames = None
        recorded = read_static(folder).frames if os.path.exists(os.path.join(folder, METADATA_FILE)) else None
        if recorded is not None and not self.optimize_memory_usage:  # create() would take the folder's frames
            raise SpecMismatchError(
                f"{folder}: a replay buffer made with optimize_memory_usage=True exists there "
                f"(frame_stack={recorded.frame_stack}), resumed with optimize_memory_usage=False"
            )
        if self.optimize_memory_usage:  # the store's frames-once layout
            slots = self._final_slots
            if slots is None and recorded is not None:  # (whatever default made it)
                slots = recorded.final_slots
            if slots is None:  # one per 16 rows for episode ends, plus what commits take
                every = options["commit_every"] or DEFAULT_COMMIT_EVERY
                ends = max(4 * self.n_envs, self.buffer_size * self.n_envs // 16)
                slots = commit_slots(self.buffer_size, self.n_envs, every) + ends
            frames = Frames(frame_stack=self._frame_stack, pad=self._frame_pad, final_slots=slots)
        options["backend"] = self._backend
        return create(folder, spec, self.buffer_size, self.n_envs, exist_ok=True, frames=frames, **options)

    def _check_spaces(self, store: Store) -> None:
        """Record the spaces in a new store (the leaves alone do not tell ``Discrete(3)`` from
        ``Discrete(4)``); refuse, closing it, a store of other spaces."""
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

    def _attach(self, store: Store) -> None:
        self.store = store
        self._origin = read_origin(store)
        self._leaves = store.leaf_paths
        self._register(store)
        self._count_retained()

    def _live(self) -> Store:
        if self.store is None:
            raise BadInputError("the store was closed: another replay buffer of this process took its folder")
        self.store.check_open()  # a closed store's leaves are gone: say so, not IndexError
        return self.store

    # --- SB3's cursor, derived from the store ----------------------------------------

    def _count_retained(self) -> None:
        """SB3's indices over the steps the store retains: after a crash lost the reserved
        slots, or the side ring of next frames dropped steps, from the oldest one kept."""
        store = self._live()
        total, first = store.total_steps, store.first_step
        if first > self._origin and total - first < min(total - self._origin, self.buffer_size):
            self._origin = first

    @property
    def pos(self) -> int:  # type: ignore[override]
        return (self._live().total_steps - self._origin) % self.buffer_size

    @pos.setter
    def pos(self, value: int) -> None:
        """SB3's index of the next ``add``: the rows keep their order (the newest at
        ``value - 1``), so only the indices they are read by move."""
        store = self._live()
        value = int(value)
        retained = store.total_steps - max(self._origin, store.first_step)
        if not 0 <= value < self.buffer_size or (value > retained and not self.full):
            raise ValueError(
                f"{store.path}: pos must be in [0, {min(retained, self.buffer_size - 1)}], got {value}"
            )
        self._move_origin(store.total_steps - value - (self.buffer_size if self.full else 0))

    @property
    def full(self) -> bool:  # type: ignore[override]
        return self._filled or self._live().total_steps - self._origin >= self.buffer_size

    @full.setter
    def full(self, value: bool) -> None:
        """As SB3's: True counts every index (their slots as they are), False those before ``pos``."""
        total = self._live().total_steps
        if not value and total - self._origin >= self.buffer_size:
            self._move_origin(total - self.pos)
        self._filled = bool(value)

    def _move_origin(self, origin: int) -> None:
        self._origin = origin
        write_origin(self._live(), origin)

    def reset(self) -> None:
        """Forget every step (``pos`` 0, not full), as SB3's; the store is cleared."""
        store = self._live()
        store.clear()
        self._filled = False
        self._move_origin(store.total_steps)

    def _steps_of(self, batch_inds: np.ndarray) -> np.ndarray:
        """Global step ids of SB3 indices: the newest step written at each index."""
        n, bs = self._live().total_steps - self._origin, self.buffer_size
        size = bs if self._filled or n >= bs else n
        inds = np.asarray(batch_inds, np.int64)
        if inds.size and (inds.min() < 0 or inds.max() >= size):
            raise IndexError(f"{self.store.path}: indices outside [0, {size}): {inds.min()}..{inds.max()}")
        pos = n % bs
        base = self._origin + n - pos  # the step at index 0 in the newest pass over the ring
        return np.where(inds < pos, inds + base, inds + (base - bs))

    def _observation_leaves(self, obs: Any) -> list[np.ndarray]:
        """``obs`` as the store's leaves, each ``[n_envs, *shape]`` in its space's dtype."""
        if self._obs_keys is None:
            return [_as_leaf(obs, self.observation_space.dtype, self._obs_step_shape)]
        space, shapes = self.observation_space, self.obs_shape
        return [_as_leaf(obs[k], space[k].dtype, (self.n_envs, *shapes[k])) for k in self._obs_keys]

    def add(
        self, obs: Any, next_obs: Any, action: np.ndarray, reward: np.ndarray, done: np.ndarray, infos: Any
    ) -> None:
        store = self.store if self.store is not None else self._live()
        done = _as_leaf(done, _BOOL, self._reward_shape)
        if done.tobytes() == self._no_ends_bytes:  # most steps end nothing: no infos to read
            terminated = truncated = self._no_ends
        else:
            listed = isinstance(infos, (list, tuple))  # CleanRL passes gymnasium's dict: no time limits
            limits = [i.get("TimeLimit.truncated", False) for i in infos] if listed else False
            truncated = done & np.array(limits, bool)
            terminated = done & ~truncated
        # Every leaf is now of its dtype (or float64 rewards, which the store casts) and
        # step shape, in the store's order (keys sorted): no second check.
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
        """A batch drawn as SB3 draws it, with ``np.random``; through the store's sampler when
        it is another (``sampler=`` at creation) or ``options`` are given (``beta=0.4`` for
        the prioritized one), with a generator seeded from ``np.random``."""
        store = self._live()
        self._count_retained()
        if not options and store.sampler.name == "uniform":
            return super().sample(batch_size, env)  # SB3's draw, then _get_samples
        if self._rng is None:
            self._rng = np.random.default_rng(np.random.randint(0, 2**32, size=4, dtype=np.uint64))
        request = SampleRequest.build(
            batch_size, rng=self._rng, return_info=True, options=options, transform=self._transform(env)
        )
        batch, self.last_info = sample_store(store, request)
        return self._to_samples(batch, env)

    def _transform(self, env: Any) -> Any:
        return None  # what a batch computes over its rows: n-step returns (nstep.py)

    def update_priorities(self, priorities: Any, info: Any = None) -> int:
        """New priorities (such as ``|TD error|``) for the rows of a prioritized
        :meth:`sample` (by default the last one); returns how many were applied."""
        info = self.last_info if info is None else info
        if info is None:
            raise BadInputError(
                "update_priorities needs the info of a prioritized sample(); none was drawn yet"
            )
        return self._live().update_priorities(
            info.step, info.env, np.asarray(priorities, np.float64).reshape(-1)
        )

    def _get_samples(self, batch_inds: np.ndarray, env: Any = None) -> Any:
        """SB3's rows ``batch_inds``, each from an env drawn with ``np.random`` as SB3 does."""
        env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        store = self._live()
        steps = self._steps_of(batch_inds)
        first = store.first_step
        if steps.size and steps.min() < first:  # only steps before the origin (``full`` set) are read
            lost = steps[(steps < first) & (steps >= self._origin)]
            if lost.size:
                raise NotEnoughDataError(
                    f"{store.path}: step {lost.min()} is no longer retained (the oldest is {first})"
                )
        # each index's slot as it is, as SB3 reads its arrays (zeros where never written)
        rows = (steps % self.buffer_size) * self.n_envs + env_indices
        return self._to_samples(unflatten(store.spec, [leaf.take(rows) for leaf in store.leaves]), env)

    def _to_samples(self, batch: dict[str, Any], env: Any) -> Any:
        """SB3's samples of a batch: normalized as VecNormalize does, tensors on ``device``."""

        def tensors(x: Any) -> Any:
            return {k: self.to_torch(v) for k, v in x.items()} if isinstance(x, dict) else self.to_torch(x)

        ends = (
            batch["terminated"]
            if self.handle_timeout_termination
            else batch["terminated"] | batch["truncated"]
        )
        return (ReplayBufferSamples if self._obs_keys is None else DictReplayBufferSamples)(
            observations=tensors(self._normalize_obs(batch["observation"], env)),
            actions=self.to_torch(batch["action"]),
            next_observations=tensors(self._normalize_obs(batch["next_observation"], env)),
            dones=self.to_torch(ends.astype(np.float32).reshape(-1, 1)),  # SB3's dones * (1 - timeouts)
            rewards=self.to_torch(self._normalize_reward(batch["reward"].reshape(-1, 1), env)),
        )

    # --- SB3's arrays ------------------------------------------------------------------

    def _column(self, leaf: str) -> np.ndarray:
        """A leaf laid out as SB3's array ``[buffer_size, n_envs, ...]`` (zeros where
        unwritten), read-only: a view of the memory-mapped leaf where its slots are SB3's
        indices, else a copy."""
        store = self._live()
        index = self._leaves.index(leaf)
        stored = store.leaves[index]
        if stored.mappable and self._origin % self.buffer_size == 0:
            out = stored.array.view()
        else:
            spec = stored.info.spec
            out = np.zeros((self.buffer_size, self.n_envs, *spec.shape), spec.dtype)
            filled = np.arange(self.size())
            if filled.size:
                out[filled] = store.read_steps(self._steps_of(filled), leaves=[index])[0]
        out.flags.writeable = False
        return out

    def _observations(self, leaf: str) -> Any:
        if self._obs_keys is None:
            return self._column(leaf)
        return {k: self._column(f"{leaf}/{k}") for k in self._obs_keys}

    # SB3's arrays of the stored leaves, read-only (a dict of arrays for a Dict space)
    observations = property(lambda self: self._observations("observation"))  # type: ignore[assignment]
    next_observations = property(lambda self: self._observations("next_observation"))  # type: ignore[assignment]
    rewards = property(lambda self: self._column("reward"))  # type: ignore[assignment]
    actions = property(lambda self: self._column("action"))  # type: ignore[assignment]

    @property
    def dones(self) -> np.ndarray:  # type: ignore[override]
        """SB3's ``dones``: 1.0 where an episode ended (a copy: writing into it changes nothing)."""
        return (self._column("terminated") | self._column("truncated")).astype(np.float32)

    @property
    def timeouts(self) -> np.ndarray:  # type: ignore[override]
        """SB3's ``timeouts``: 1.0 where it ended by a time limit, if handled (a copy)."""
        return self._column("truncated").astype(np.float32) * self.handle_timeout_termination

class DictReplayBuffer(ReplayBuffer, sb3_buffers.DictReplayBuffer):
    """SB3's ``DictReplayBuffer`` (``Dict`` observation spaces) over a store; see :class:`ReplayBuffer`."""
