"""A TorchRL storage whose rows live in a store.

:class:`MMReplayStorage` is a ``TensorStorage`` whose tensors are zero-copy views over
the store's memory-mapped leaves: TorchRL's own writers and samplers (random,
``SliceSampler``, ``ndim=2`` for ``[steps, envs]``) read it as they read a
``LazyMemmapStorage``, and every write goes through the store (appends with ``extend``,
overwrites with ``set``), so the store's commit protocol keeps the cursor and the rows
durable. :class:`StoreSampler` draws through the store's own sampler: with
``sampler="prioritized"``, prioritized replay whose priorities live in the folder.
Reopening the same folder resumes: length, the writer's cursor, the rows committed and
the priorities. There is no ``dumps``/``loads`` step.

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import TensorDictReplayBuffer
    >>> from mmreplay.compat.torchrl import MMReplayStorage
    >>> path = tempfile.mkdtemp() + "/buf"
    >>> rb = TensorDictReplayBuffer(storage=MMReplayStorage(path, max_size=100), batch_size=4)
    >>> _ = rb.extend(TensorDict({"obs": torch.ones(10, 3)}, batch_size=[10]))
    >>> rb.sample()["obs"].shape
    torch.Size([4, 3])
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

try:
    import torch
    from tensordict import TensorDict, TensorDictBase, is_tensor_collection
    from torchrl.data.replay_buffers.samplers import Sampler
    from torchrl.data.replay_buffers.storages import TensorStorage
except ImportError as exc:  # torchrl is an install extra
    raise ImportError("mmreplay.compat.torchrl needs torchrl: pip install 'mmreplay[torchrl]'") from exc

from ..backends.base import MappedLeaf
from ..errors import BadInputError
from ..spec import ArraySpec, leaf_paths, unflatten
from ..store import Store, create
from ..store import open as open_store
from ._shared import lenient_roles, read_origin, write_origin

__all__ = ["MMReplayStorage", "StoreSampler"]


def _key_path(key: Any) -> str:
    return "/".join(key) if isinstance(key, tuple) else key


def _spec_of(data: TensorDictBase, batch_dims: int) -> dict[str, Any]:
    """The store's spec from one written TensorDict: nested keys become leaf paths."""
    spec: dict[str, Any] = {}
    for key, value in data.items(include_nested=True, leaves_only=True):
        if not isinstance(value, torch.Tensor):
            raise BadInputError(
                f"MMReplayStorage: entry {_key_path(key)!r} is {type(value).__name__}, expected a tensor"
            )
        node = spec
        parts = key if isinstance(key, tuple) else (key,)
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = ArraySpec(tuple(value.shape[batch_dims:]), str(value.dtype).removeprefix("torch."))
    return spec


class MMReplayStorage(TensorStorage):
    """A TorchRL storage over the store at ``path``, created from the first TensorDict written.

    Args:
        path: the store's folder; if it holds a store, it is reopened and resumed.
        max_size: elements the storage holds, as for ``LazyMemmapStorage`` (with
            ``ndim=2``, ``max_size // num_envs`` steps of ``num_envs`` rows).
        ndim: 1 (one env, ``[steps]``) or 2 (``[steps, envs]``, the data's second dim).
        commit_every, durability, backend: passed to :func:`mmreplay.create`.
        sampler, sampler_options: the store's own sampler, passed to
            :func:`mmreplay.create` (``sampler="prioritized", alpha=0.6, beta=0.4``); a
            :class:`StoreSampler` in the buffer draws through it.

    Writes are durable at the store's commits (every ``commit_every`` steps, at
    :meth:`commit`, at :meth:`close` and when the process exits normally).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        max_size: int | None = None,
        *,
        ndim: int = 1,
        commit_every: int | None = None,
        durability: str = "process",
        backend: str | None = None,
        sampler: str | None = None,
        **sampler_options: Any,
    ) -> None:
        if ndim not in (1, 2):
            raise ValueError(f"MMReplayStorage: ndim must be 1 or 2, got {ndim}")
        self.path = os.fspath(path)
        self._create_options: dict[str, Any] = {"durability": durability, "backend": backend}
        if commit_every is not None:
            self._create_options["commit_every"] = commit_every
        if sampler is not None:
            self._create_options.update(sampler=sampler, **sampler_options)
        self.store: Store | None = None
        self._origin = 0  # global step id of TorchRL's slot 0 (moved by an empty)
        exists = os.path.exists(os.path.join(self.path, "mmreplay.json"))
        if exists:
            store = open_store(self.path, mode="a")
            size = store.capacity * (store.num_envs if ndim == 2 else 1)
            if max_size is not None and int(max_size) != size:
                store.close()
                raise BadInputError(f"{self.path}: holds a store of max_size {size}, asked for {max_size}")
            max_size = size
        elif max_size is None:
            raise BadInputError(f"{self.path}: no store there; give max_size to create one")
        super().__init__(storage=None, max_size=int(max_size), device="cpu", ndim=ndim)
        if exists:
            self._attach_store(store)

    # --- the store -------------------------------------------------------------------

    def _attach_store(self, store: Store) -> None:
        if self.ndim == 1 and store.num_envs != 1:
            store.close()
            raise BadInputError(f"{self.path}: a store of {store.num_envs} envs needs ndim=2")
        # The views are the mapped leaf arrays themselves: reads by TorchRL's samplers
        # (and SliceSampler's trajectory column) touch the pages, never a copy.
        leaves = store.leaves
        if not all(isinstance(leaf, MappedLeaf) for leaf in leaves):
            store.close()
            raise BadInputError(f"{self.path}: MMReplayStorage needs uncompressed, memory-mapped leaves")
        views = [torch.from_numpy(leaf.array if self.ndim == 2 else leaf.array[:, 0]) for leaf in leaves]
        batch = [store.capacity, store.num_envs][: self.ndim]
        self._storage = TensorDict(unflatten(store.spec, views), batch_size=batch)
        self.store = store
        self._origin = read_origin(store)
        self.initialized = True
        if store.total_steps:
            self._set_last_cursor((store.total_steps - 1) % store.capacity)

    def _create_store(self, data: TensorDictBase, batched: bool) -> None:
        lead = 1 if batched else 0
        num_envs = int(data.shape[lead]) if self.ndim == 2 else 1
        capacity = self.max_size // num_envs
        if capacity < 1 or capacity * num_envs != self.max_size:
            raise BadInputError(f"{self.path}: max_size {self.max_size} is not a multiple of {num_envs} envs")
        spec = _spec_of(data, lead + self.ndim - 1)
        store = create(self.path, spec, capacity, num_envs, roles=lenient_roles(spec), **self._create_options)
        self._attach_store(store)

    def commit(self) -> None:
        """Make every row written so far durable."""
        if self.store is not None:
            self.store.commit()

    def close(self) -> None:
        """Commit and release the store; the storage holds no rows after this."""
        if self.store is not None:
            self.store.close()
            self._storage = None  # the mapping closes once no tensor views it
            self.initialized = False

    # --- TorchRL's storage interface ---------------------------------------------------

    @property
    def _len(self) -> int:
        store = self.__dict__.get("store")
        if store is None:
            return 0
        steps = min(store.total_steps - max(store.window.first, self._origin), store.capacity)
        return steps * (store.num_envs if self.ndim == 2 else 1)

    @_len.setter
    def _len(self, value: int) -> None:
        """The length follows the store; TorchRL's own bookkeeping is ignored."""

    @property
    def _len_along_dim0(self) -> int:
        """Slots written since the start (or the last empty): what ``get``, ``shape`` and
        ``storage[:]`` index, physically."""
        store = self.__dict__.get("store")
        return 0 if store is None else min(store.total_steps - self._origin, store.capacity)

    @property
    def _is_full(self) -> bool:
        store = self.__dict__.get("store")
        return store is not None and store.total_steps - self._origin >= store.capacity

    def _rand_given_ndim(self, batch_size: int) -> Any:
        """TorchRL's draw, or, right after a crash, one over the retained steps alone.

        A writer killed between commits may have written into the few slots past its
        last commit; on reopen the store no longer counts the steps those slots held, and
        ``len`` does not either. Until the writer has written over them again, a random
        draw picks among the other slots.
        """
        store = self.store
        if store is None or self._len == self._len_along_dim0 * (store.num_envs if self.ndim == 2 else 1):
            return super()._rand_given_ndim(batch_size)
        retained = self._len if self.ndim == 1 else self._len // store.num_envs
        offsets = torch.randint(retained, (batch_size,), generator=self._rng)
        slots = (store.window.first + offsets) % store.capacity
        if self.ndim == 1:
            return slots
        return slots, torch.randint(store.num_envs, (batch_size,), generator=self._rng)

    @property
    def _rng(self) -> torch.Generator | None:
        return self.__dict__.get("_rng_value")

    @_rng.setter
    def _rng(self, generator: torch.Generator | None) -> None:
        # ReplayBuffer sets the rng once its writer is registered: the moment to start
        # that writer at the store's cursor.
        self.__dict__["_rng_value"] = generator
        self._align_writers()

    def _align_writers(self) -> None:
        store = self.__dict__.get("store")
        for entity in self._attached_entities:
            writer = getattr(entity, "_writer", None)
            if store is not None and getattr(writer, "_storage", None) is self and hasattr(writer, "_cursor"):
                writer._cursor = store.cursor

    def attach(self, buffer: Any) -> None:
        super().attach(buffer)
        self._align_writers()

    def _slots(self, cursor: Any) -> tuple[np.ndarray, bool]:
        if isinstance(cursor, (int, np.integer)):
            return np.array([int(cursor)]), True
        if isinstance(cursor, slice):
            return np.arange(self._max_size_along_dim0())[cursor], False
        if isinstance(cursor, tuple):
            raise BadInputError(f"{self.path}: MMReplayStorage writes whole steps; got a tuple index")
        slots = torch.as_tensor(cursor).cpu().numpy().astype(np.int64)
        return slots.reshape(-1), slots.ndim == 0

    def _values(self, data: Any, single: bool, slots: np.ndarray | None = None) -> dict[str, Any]:
        """The store's nest of ``[T, num_envs, *shape]`` arrays for ``data``.

        Leaves absent from ``data`` keep their stored rows at ``slots`` (an overwrite, as
        a TensorDict assignment does); for appends (``slots`` None) every leaf is needed.
        """
        if single:
            data = data.unsqueeze(0)
        if self.ndim == 1:
            data = data.unsqueeze(1)
        paths = leaf_paths(self.store.spec)
        given = {_key_path(k) for k in data.keys(include_nested=True, leaves_only=True)}
        if given - set(paths):
            raise BadInputError(
                f"{self.path}: entries {sorted(given - set(paths))} are not in the store's {paths}"
            )
        leaves = []
        for path in paths:
            key = tuple(path.split("/"))
            if path in given:
                leaves.append(data.get(key).detach().cpu().numpy())
            elif slots is not None:
                stored = self._storage.get(key)[torch.from_numpy(slots)]
                leaves.append(stored.numpy() if self.ndim == 2 else stored.unsqueeze(1).numpy())
            else:
                raise BadInputError(f"{self.path}: entry {path!r} is missing from the data written")
        return unflatten(self.store.spec, leaves)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        if isinstance(data, list):
            data = torch.stack(data)
        if not is_tensor_collection(data):
            raise BadInputError(f"{self.path}: MMReplayStorage stores TensorDicts, got {type(data).__name__}")
        slots, single = self._slots(cursor)
        if self.store is None:
            self._create_store(data, batched=not single)
        store = self.store
        values = self._values(data, single, None if set_cursor else slots)
        if set_cursor:
            expected = (store.cursor + np.arange(len(slots))) % store.capacity
            if not np.array_equal(slots, expected):
                raise BadInputError(
                    f"{self.path}: writes with the cursor must continue at slot {store.cursor}, got slots "
                    f"starting at {slots[:1].tolist()}; is the writer a round-robin writer of this buffer?"
                )
            store.extend(values)
            self._set_last_cursor(cursor)
        else:
            written = store.total_steps
            if slots.size and (slots.min() < 0 or slots.max() >= self._len_along_dim0):
                raise IndexError(
                    f"{self.path}: slots {slots.tolist()} are not all written ({len(self)} rows)"
                )
            store.commit()
            steps = written - 1 - ((written - 1 - slots) % store.capacity)
            if slots.size and steps.min() < store.first_step:
                raise IndexError(f"{self.path}: slot {int(slots[steps.argmin()])} holds no committed row")
            store.set(steps - store.first_step, values)
        self._bump_mutation_revision()

    def get(self, index: Any) -> Any:
        if self.store is None:
            raise RuntimeError(f"{self.path}: nothing written yet")
        return super().get(index)

    def _empty(self) -> None:
        """Drop every row. TorchRL's writer starts again at slot 0, so this is possible
        only where the store's cursor is at slot 0 too (a whole number of rings written)."""
        store = self.store
        if store is not None and store.total_steps > self._origin:
            if store.total_steps % store.capacity:
                self._align_writers()  # the buffer reset its writer first: undo that
                raise BadInputError(
                    f"{self.path}: MMReplayStorage empties only at slot 0 of the ring "
                    f"({store.total_steps} steps written, capacity {store.capacity})"
                )
            store.clear()
            write_origin(store, store.total_steps)
            self._origin = store.total_steps
        self._bump_mutation_revision()

    def state_dict(self) -> dict[str, Any]:
        """A reference to the store, not its rows: they are in the folder already."""
        self.commit()
        return {"path": self.path, "total_steps": 0 if self.store is None else self.store.total_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if os.path.abspath(state_dict["path"]) != os.path.abspath(self.path):
            raise BadInputError(
                f"{self.path}: a state of the store at {state_dict['path']} cannot be loaded here"
            )

    def dumps(self, path: Any) -> None:
        """Commit: the store is its own checkpoint, nothing is copied to ``path``."""
        self.commit()

    def loads(self, path: Any) -> None:
        """Nothing to load: the storage resumes from its folder when it is made."""

    def __repr__(self) -> str:
        return f"MMReplayStorage({self.path!r}, max_size={self.max_size}, ndim={self.ndim}, len={len(self)})"


class StoreSampler(Sampler):
    """A TorchRL sampler that draws through the store's own sampler (``store.sampler``).

    Over a storage made with ``sampler="prioritized"`` this is prioritized replay: the
    batch's ``info`` holds ``"priority_weight"`` (importance weights, with ``beta`` or the
    store's default), ``rb.update_priority(index, priority)`` writes the store's priority
    file, and the priorities are committed with the rows, so a reopened storage draws by
    them again. Randomness comes from the buffer's generator, or torch's global one.
    """

    def __init__(self, beta: float | None = None) -> None:
        self.beta = beta

    @staticmethod
    def _store(storage: Any) -> Store:
        if not isinstance(storage, MMReplayStorage):
            raise TypeError(f"StoreSampler draws from an MMReplayStorage, got {type(storage).__name__}")
        if storage.store is None:
            raise RuntimeError(f"{storage.path}: nothing written yet")
        return storage.store

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict[str, Any]]:
        store = self._store(storage)
        seed = int(torch.randint(0, 2**62, (), generator=self._rng))
        options = {} if self.beta is None else {"beta": self.beta}
        draw = store.sampler.draw(batch_size, store.window, np.random.default_rng(seed), **options)
        slots = torch.from_numpy(draw.step % store.capacity)
        index = slots if storage.ndim == 1 else (slots, torch.from_numpy(draw.env))
        info = {} if draw.weight is None else {"priority_weight": torch.from_numpy(draw.weight)}
        return index, info

    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> None:
        """Priorities for the rows at ``index`` (slots, or ``[N, 2]`` slot and env pairs),
        given to the rows those slots hold now."""
        store = self._store(storage)
        index = torch.as_tensor(index).cpu().numpy().astype(np.int64)
        slots, envs = (index[..., 0], index[..., 1]) if storage.ndim == 2 else (index, np.zeros_like(index))
        end = store.total_steps
        steps = end - 1 - ((end - 1 - slots.reshape(-1)) % store.capacity)
        store.update_priorities(steps, envs.reshape(-1), torch.as_tensor(priority).reshape(-1).cpu().numpy())

    def _empty(self) -> None:
        """The store's sampler follows the store's own clear."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the priorities live in the store's folder."""

    def dumps(self, path: Any) -> None:
        """Nothing to write: the priorities are committed with the rows."""

    def loads(self, path: Any) -> None:
        """Nothing to read: the priorities live in the store's folder."""
