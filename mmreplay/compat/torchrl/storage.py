"""TorchRL's storage protocol over a store: :class:`MMReplayStorage`, whose tensors are
views of the store's mapped leaves and whose writes, empties and loads go through the
store; the data TorchRL storages hold (TensorDicts, tensorclasses, tensors, pytrees)
maps to the store's leaves by key path, and back by the layout kept in its attributes."""

from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, is_tensor_collection, is_tensorclass
from torch.utils import _pytree as pytree
from torchrl.data.replay_buffers.storages import TensorStorage

from ...backends.base import MappedLeaf
from ...creation import create
from ...errors import BadInputError, CorruptBufferError, ReadOnlyError
from ...formats.base import nest
from ...metadata import METADATA_FILE
from ...spec import ArraySpec, unflatten
from ...store import Store
from ...store import open as open_store
from .._shared import lenient_roles, read_origin, write_origin
from .checkpoint import Checkpoints, first_leaf

__all__ = ["MMReplayStorage"]

#: store attribute saying how rows fold back into what was written: ``{"tree": <a torch
#: pytree spec's JSON>}`` or ``{"batch_dims": <TensorDict batch dims past the storage's>}``
LAYOUT_ATTR = "torchrl_layout"


def _part(key: Any) -> str:
    """A leaf path's part for a pytree key: a dict key, a sequence index or a field."""
    return str(next(getattr(key, n) for n in ("key", "idx", "name") if hasattr(key, n)))


def _is_leaf(cls: type) -> bool:
    """TensorDict leaves, non-tensor ones included (so that they are seen, and refused)."""
    return not is_tensor_collection(cls) or issubclass(cls, (NonTensorData, NonTensorStack))


def _entries(data: Any) -> dict[str, Any]:
    """Written data's leaves by leaf path: nested TensorDict keys, pytree key paths, or
    ``value`` for a plain tensor (the store's name for a spec's one unnamed leaf)."""
    if is_tensor_collection(data):
        td = data._tensordict if is_tensorclass(data) else data
        pairs = td.items(True, True, is_leaf=_is_leaf)
        items = {_path(k if isinstance(k, tuple) else (k,)): v for k, v in pairs}
        if others := sorted(k for k, v in items.items() if not isinstance(v, torch.Tensor)):
            raise BadInputError(f"MMReplayStorage: entries {others} are not tensors; only tensors are stored")
        return items
    flat = pytree.tree_flatten_with_path(data)[0]
    return {_path(tuple(map(_part, path))) or "value": leaf for path, leaf in flat}


def _path(parts: tuple[str, ...]) -> str:
    """The leaf path of a key's parts. A part holding "/" is refused: it would name the
    leaf of another key (``"a/b"`` is the path of ``("a", "b")``), one overwriting the other."""
    for part in parts:
        if "/" in part:
            raise BadInputError(
                f"MMReplayStorage: key {part!r} holds '/', which joins a leaf path's names; rename it"
            )
    return "/".join(parts)


def _stack(items: list[Any]) -> Any:
    """A list of single elements as one batch, as TorchRL's storages take it."""
    try:
        if all(is_tensor_collection(item) for item in items):
            return torch.stack(items)
        return pytree.tree_map(lambda *leaves: torch.stack(leaves), *items)
    except (RuntimeError, ValueError) as exc:  # what TorchRL's storages raise
        raise RuntimeError(f"Stacking the elements of the list resulted in an error: {exc}") from None


def steps_of(store: Store, slots: np.ndarray) -> np.ndarray:
    """Global step ids of the newest steps written into ring ``slots``."""
    end = store.total_steps
    return end - 1 - ((end - 1 - slots) % store.capacity)


class MMReplayStorage(Checkpoints, TensorStorage):
    """A TorchRL storage over the store at ``path``, created from the first data written:
    TensorDicts, tensorclasses, plain tensors or pytrees of tensors, as TorchRL's hold.

    Args:
        path: the store's folder; if it holds a store, it is reopened and resumed.
        max_size: elements the storage holds, as for ``LazyMemmapStorage`` (with
            ``ndim=2``, ``max_size // num_envs`` steps of ``num_envs`` rows).
        ndim: 1 (one env, ``[steps]``) or 2 (``[steps, envs]``, the data's second dim).
        mode: ``"a"`` to write (one writer per folder); ``"r"`` to read what the
            folder's writer commits, as a storage sent to another process does.
        create_options: passed to :func:`mmreplay.create` (``commit_every``,
            ``durability``, ``backend``, ``sampler="prioritized", alpha=0.6``...; a
            :class:`StoreSampler` draws through the store's sampler).

    Rows are durable at the store's commits (every ``commit_every`` steps, at
    :meth:`commit`, at :meth:`close` and when the process exits normally).
    """

    def __init__(
        self, path: str | os.PathLike, max_size: int | None = None, *, ndim: int = 1, mode: str = "a", **create_options: Any
    ) -> None:
        if ndim not in (1, 2) or mode not in ("a", "r"):
            raise ValueError(f"MMReplayStorage: ndim must be 1 or 2 and mode 'a' or 'r', got {ndim}, {mode!r}")
        self.path = os.fspath(path)
        self._create_options = create_options
        self.store: Store | None = None
        self._origin = 0  # global step id of TorchRL's slot 0 (moved by an empty)
        self._tensorclass: type | None = None  # the written tensorclass, while this object lives
        exists = os.path.exists(os.path.join(self.path, METADATA_FILE))
        if exists:
            store = open_store(self.path, mode=mode)
            size = store.capacity * (store.num_envs if ndim == 2 else 1)
            if max_size is not None and int(max_size) != size:
                store.close()
                raise BadInputError(f"{self.path}: holds a store of max_size {size}, asked for {max_size}")
            max_size = size
        elif max_size is None or mode == "r":
            raise BadInputError(f"{self.path}: no store there; give max_size (and mode 'a') to create one")
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
        if not all(isinstance(leaf, MappedLeaf) for leaf in store.leaves):
            store.close()
            raise BadInputError(f"{self.path}: MMReplayStorage needs uncompressed, memory-mapped leaves")
        self._arrays = {path: leaf.array for path, leaf in zip(store.leaf_paths, store.leaves)}
        with warnings.catch_warnings():  # a reader's mapping is read-only, and so are its views
            warnings.simplefilter("ignore", UserWarning)
            views = {p: torch.from_numpy(a if self.ndim == 2 else a[:, 0]) for p, a in self._arrays.items()}
        layout = store.attrs.get(LAYOUT_ATTR, {})
        try:  # the attribute comes from the folder: a wrong one is a damaged buffer, never code
            if "tree" in layout:
                treespec = pytree.treespec_loads(layout["tree"])
                paths = _entries(pytree.tree_unflatten([0] * treespec.num_leaves, treespec))
                self._storage = pytree.tree_unflatten([views[p] for p in paths], treespec)
            elif isinstance(store.spec, ArraySpec):
                self._storage = views["value"]
            else:
                batch = [store.capacity, store.num_envs][: self.ndim]
                batch += next(iter(views.values())).shape[len(batch) : len(batch) + layout.get("batch_dims", 0)]
                self._storage = TensorDict(unflatten(store.spec, [views[p] for p in store.leaf_paths]), batch)
                if self._tensorclass is not None:
                    self._storage = self._tensorclass.from_tensordict(self._storage)
        except Exception as exc:
            store.close()
            raise CorruptBufferError(f"{self.path}: attribute {LAYOUT_ATTR!r} does not fit the leaves: {exc}") from None
        self.store, self._pid, self._origin = store, os.getpid(), read_origin(store)
        self.initialized = True
        if store.total_steps:
            self._set_last_cursor((store.total_steps - 1) % store.capacity)

    def _create_store(self, data: Any, batched: bool) -> None:
        lead = 1 if batched else 0
        num_envs = int(first_leaf(data).shape[lead]) if self.ndim == 2 else 1
        capacity = self.max_size // num_envs
        if capacity < 1 or capacity * num_envs != self.max_size:
            raise BadInputError(f"{self.path}: max_size {self.max_size} is not a multiple of {num_envs} envs")
        row_dims = lead + self.ndim - 1  # the data's leading dims that are not a row's
        entries = _entries(data)
        spec: Any = nest(list(entries), [ArraySpec(v.shape[row_dims:], v.dtype) for v in entries.values()])
        if isinstance(data, torch.Tensor):
            spec, layout = spec["value"], {}
        elif is_tensor_collection(data):
            layout = {"batch_dims": data.batch_dims - row_dims} if data.batch_dims > row_dims else {}
            self._tensorclass = type(data) if is_tensorclass(data) else None
        else:
            layout = {"tree": pytree.treespec_dumps(pytree.tree_structure(data))}
        store = create(self.path, spec, capacity, num_envs, roles=lenient_roles(spec), **self._create_options)
        if layout:
            store.set_attrs(**{LAYOUT_ATTR: layout})
        self._attach_store(store)

    def _init(self, data: Any) -> None:
        """Create the store from one element, as TorchRL's lazy storages do."""
        self._create_store(data, batched=False)

    def _writes_here(self) -> bool:
        return self.store is not None and self.store.mode == "a" and self._pid == os.getpid()

    def _check_writer(self) -> None:
        if self.store is None:
            return
        self.store.check_open()
        if not self._writes_here():
            raise ReadOnlyError(f"{self.path}: this storage reads only: the folder's one writer is the "
                                "process that opened it with mode 'a', not one it was sent to")

    def commit(self) -> None:
        """Make every row written so far durable."""
        if self._writes_here():
            self.store.commit()

    def close(self) -> None:
        """Commit and release the store; the storage holds no rows after this."""
        if self.store is not None:
            self.store.close()
            self._storage = self._arrays = None  # the mapping closes once no tensor views it
            self.initialized = False

    def __getstate__(self) -> dict[str, Any]:
        """What another process needs to reopen the folder, to read: never the rows."""
        if self.store is None:
            raise RuntimeError(f"{self.path}: cannot share this storage: it has not been initialized yet")
        self.commit()
        return {"path": self.path, "max_size": self.max_size, "ndim": self.ndim}

    def __setstate__(self, state: dict[str, Any]) -> None:
        MMReplayStorage.__init__(self, state["path"], state["max_size"], ndim=state["ndim"], mode="r")

    # --- TorchRL's storage interface ---------------------------------------------------

    def _open_store(self) -> Store | None:
        """The store while it holds rows: None before the first write and after close."""
        store = self.__dict__.get("store")
        return None if store is None or store.closed else store

    def get(self, index: Any) -> Any:
        """TorchRL's read, over what the writer committed last (for a reader); after
        :meth:`close`, a ClosedError naming the folder."""
        if self.store is not None:
            self.store.check_open()
            if self.store.mode == "r":
                self.store.refresh()
        return super().get(index)

    @property
    def _len(self) -> int:
        store = self._open_store()
        if store is None:
            return 0
        if store.mode == "r":
            store.refresh()
        steps = min(store.total_steps - max(store.window.first, self._origin), store.capacity)
        return steps * (store.num_envs if self.ndim == 2 else 1)

    @_len.setter
    def _len(self, value: int) -> None:
        """The length follows the store; TorchRL's own bookkeeping is ignored."""

    @property
    def _len_along_dim0(self) -> int:
        """Slots written since the start (or the last empty): what ``get`` and ``shape`` index."""
        store = self._open_store()
        return 0 if store is None else min(store.total_steps - self._origin, store.capacity)

    @property
    def _is_full(self) -> bool:
        store = self._open_store()
        return store is not None and store.total_steps - self._origin >= store.capacity

    def _rand_given_ndim(self, batch_size: int) -> Any:
        """TorchRL's draw, or, right after a crash, one over the retained steps alone:
        the few slots a killed writer had reserved past its last commit hold no counted
        step until they are written again."""
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
        """The slots an index names; negative ones count from the storage's end, as in
        TorchRL's storages (those before its start stay negative: refused)."""
        if isinstance(cursor, (int, np.integer)) and cursor >= 0:
            return np.array([int(cursor)]), True
        if isinstance(cursor, slice):
            return np.arange(self._max_size_along_dim0())[cursor], False
        if isinstance(cursor, tuple):
            raise BadInputError(f"{self.path}: MMReplayStorage writes whole steps; got a tuple index")
        slots = torch.as_tensor(cursor).cpu().numpy().astype(np.int64)
        if self.store is not None and slots.size and slots.min() < 0:
            size = self.store.capacity
            slots = np.where(slots >= -size, slots % size, slots)
        return slots.reshape(-1), slots.ndim == 0

    def _values(self, data: Any, single: bool, slots: np.ndarray | None = None) -> Any:
        """The store's nest of ``[T, num_envs, *shape]`` arrays for ``data``. Entries a
        TensorDict leaves out keep their rows at ``slots`` (as a TensorDict assignment
        does); appends (``slots`` None) need every entry."""
        entries, paths = _entries(data), self.store.leaf_paths
        if set(entries) - set(paths):
            raise BadInputError(f"{self.path}: entries {sorted(set(entries) - set(paths))} are not in the store's {paths}")
        leaves = []
        for path in paths:
            if path in entries:
                value = entries[path].detach().cpu().numpy()
                value = value[None] if single else value
                leaves.append(value[:, None] if self.ndim == 1 else value)
            elif slots is not None and is_tensor_collection(data):
                leaves.append(self._arrays[path][slots])
            else:
                raise BadInputError(f"{self.path}: entry {path!r} is missing from the data written")
        return unflatten(self.store.spec, leaves)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        self._check_writer()
        if isinstance(data, list):
            data = _stack(data)
        slots, single = self._slots(cursor)
        if self.store is None:
            self._create_store(data, batched=not single)
        store = self.store
        values = self._values(data, single, None if set_cursor else slots)
        if set_cursor:
            if self.__dict__.pop("_rephase", False) and slots.size and slots[0] != store.cursor:
                # a full ring loaded from a checkpoint meets its writer's saved cursor:
                # the rows from the store's cursor up to it are written again, as the newest
                again = (store.cursor + np.arange((slots[0] - store.cursor) % store.capacity)) % store.capacity
                store.extend(unflatten(store.spec, [self._arrays[p][again] for p in store.leaf_paths]))
            expected = (store.cursor + np.arange(len(slots))) % store.capacity
            if not np.array_equal(slots, expected):
                raise BadInputError(
                    f"{self.path}: writes with the cursor must continue at slot {store.cursor}, got slots "
                    f"starting at {slots[:1].tolist()}; is the writer a round-robin writer of this buffer?"
                )
            store.extend(values)
            self._set_last_cursor(cursor)
        else:
            if slots.size and (slots.min() < 0 or slots.max() >= self._len_along_dim0):
                raise IndexError(f"{self.path}: slots {slots.tolist()} are not all written ({len(self)} rows)")
            store.commit()
            steps = steps_of(store, slots)
            if slots.size and steps.min() < store.first_step:
                raise IndexError(f"{self.path}: slot {int(slots[steps.argmin()])} holds no committed row")
            store.set(steps - store.first_step, values)
        self._bump_mutation_revision()

    def _empty(self) -> None:
        """Drop every row; the store's cursor moves on to slot 0, where TorchRL's writer restarts."""
        self._check_writer()
        if self.store is not None:
            self.store.clear(next_slot=0)
            self._origin = self.store.total_steps
            write_origin(self.store, self._origin)
        self.__dict__.pop("_rephase", None)
        self._bump_mutation_revision()

    def __repr__(self) -> str:
        return f"MMReplayStorage({self.path!r}, max_size={self.max_size}, ndim={self.ndim}, len={len(self)})"
