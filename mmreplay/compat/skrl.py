"""skrl / rofunc memories over a persistent store: ``Memory`` and ``RandomMemory``.

Change the import, add ``path=``, and the memory survives crashes and outgrows RAM::

    # from skrl.memories.torch import RandomMemory
    from mmreplay.compat.skrl import RandomMemory
    memory = RandomMemory(memory_size=100_000, num_envs=env.num_envs, device=device,
                          path="run/memory")

Each tensor is a leaf and a step of ``num_envs`` rows one store step, added when its last
env is in (the envs of a partial step are written ahead, :meth:`mmreplay.Store.write_next`).
skrl's physical rows map onto global steps by :class:`~mmreplay.samplers.torch_rule.PhysicalRows`
(counting from the origin ``reset`` moves, the store attribute ``compat_origin``); batches
are drawn by skrl's torch calls (:class:`~mmreplay.samplers.torch_rule.TorchDrawRule`) or
the store's sampler and read through the store's fetch path. A tensor declared after data
rebuilds the store with :func:`mmreplay.convert.convert`; ``save`` / ``load`` are
:func:`mmreplay.export.export` / :func:`mmreplay.importers.import_dataset`. What differs
from skrl, and why: docs/skrl.md.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is an install extra
    raise ImportError("mmreplay.compat.skrl needs torch: pip install 'mmreplay[torch]'") from exc

from ..convert import convert
from ..errors import SpecError, SpecMismatchError
from ..export import export
from ..importers import import_dataset
from ..metadata import METADATA_FILE
from ..read import SampleRequest
from ..read import sample as sample_store
from ..samplers.torch_rule import MemoryEmptyError, PhysicalRows, TorchDrawRule
from ..spec import ArraySpec
from ..store import DEFAULT_COMMIT_EVERY, Store, create
from ..store import open as open_store
from ._shared import (
    StoreShell,
    lenient_roles,
    read_origin,
    read_rows,
    ring_capacity,
    temporary,
    window_of,
    write_origin,
)
from ._skrl_args import (
    as_values,
    index_arg,
    parse_device,
    skrl_replacement_default,
    space_size,
    torch_dtype,
    unwritten,
)

__all__ = ["Memory", "RandomMemory", "MemoryEmptyError"]

log = logging.getLogger(__name__)

FORMATS = ("pt", "npz", "csv")


class Memory(StoreShell):
    """skrl's ``Memory``: a circular buffer of named tensors ``(memory_size, num_envs, size)``.

    Args:
        memory_size: rows (steps) per env.
        num_envs: parallel environments.
        device: where outputs go (:func:`parse_device`, skrl's rule).
        export, export_format, export_directory: save the memory each time it fills,
            as ``"pt"``, ``"npz"`` (``"np"`` accepted) or ``"csv"``, under ``<dir>/memories/``.
        path: the buffer folder, reopened (tensors, data and cursor) if it exists;
            ``None``: a temporary folder removed on ``close()`` or garbage collection.
        backend, compression, durability: as :func:`mmreplay.create`.
        commit_every: complete steps per commit (1: each is durable when written); a
            reopened memory keeps the value it was created with.
        sampler, alpha: ``sampler="prioritized"`` makes :meth:`RandomMemory.sample` draw
            by priority (``sampling_info.weight`` holds the importance weights; new
            priorities go in with :meth:`update_priorities`). Recorded in the store.

    Raises:
        ValueError: an unsupported ``export_format``.
        mmreplay.SpecMismatchError: a memory of another size or number of envs exists at ``path``.

    Example:
        >>> import torch, tempfile
        >>> memory = RandomMemory(memory_size=4, num_envs=2, device="cpu", path=tempfile.mkdtemp() + "/m")
        >>> memory.create_tensor("observations", 3)
        True
        >>> for t in range(5):
        ...     memory.add_samples(observations=torch.full((2, 3), float(t)))
        >>> len(memory), memory.memory_index, memory.filled
        (8, 1, True)
        >>> [[obs]] = memory.sample(["observations"], batch_size=6)
        >>> obs.shape
        torch.Size([6, 3])
        >>> memory.close()
    """

    def __init__(
        self,
        memory_size: int,
        num_envs: int = 1,
        device: str | torch.device | None = None,
        export: bool = False,
        export_format: str = "pt",
        export_directory: str = "",
        path: str | os.PathLike | None = None,
        *,
        backend: str | None = None,
        compression: Any = None,
        commit_every: int = DEFAULT_COMMIT_EVERY,
        durability: str = "process",
        sampler: str | None = None,
        alpha: float | None = None,
    ):
        for name, value in (("memory_size", memory_size), ("num_envs", num_envs)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        fmt = "npz" if export_format == "np" else export_format
        if fmt not in FORMATS:
            raise ValueError(f"Export format not supported ({export_format}); expected one of pt, npz, csv")
        self.memory_size, self.num_envs = M, E = int(memory_size), int(num_envs)
        self.device = parse_device(device)
        self.export, self.export_format, self.export_directory = bool(export), fmt, export_directory
        self.sampling_indexes: torch.Tensor | None = None
        self.sampling_info: Any = None  # the store's SampleInfo of the last sample (weights...)
        self.all_sequence_indexes = np.concatenate([np.arange(i, M * E + i, E) for i in range(E)])
        self._options = {"backend": backend, "compression": compression, "commit_every": commit_every,
                         "durability": durability, "sampler": sampler, **({} if alpha is None else {"alpha": alpha})}  # fmt: skip
        self._tensors: dict[str, ArraySpec] = {}
        self._rows = PhysicalRows(M, E)  # the cursor, and physical rows <-> global steps
        self._path = None if path is None else os.fspath(path)
        self._temp = temporary(self) if path is None else None
        if self._path is not None:
            _finish_swap(self._path)
            if os.path.exists(os.path.join(self._path, METADATA_FILE)):
                self._attach(open_store(self._path, "a"))

    # --- the store ------------------------------------------------------------------

    @property
    def store(self) -> Store | None:
        """The store holding the memory (None until it holds data)."""
        return self._rows.store

    @store.setter
    def store(self, store: Store | None) -> None:
        self._rows.store = store

    def _attach(self, store: Store) -> None:
        """Adopt an opened store: check its size, take its tensors, cursor and sampler."""
        problems = []
        if store.num_envs != self.num_envs:
            problems.append(f"num_envs: existing {store.num_envs} vs new {self.num_envs}")
        if store.capacity != ring_capacity(self.memory_size, store.metadata.commit_every):
            problems.append(f"memory_size: existing {window_of(store)} vs new {self.memory_size}")
        if not isinstance(store.spec, dict) or not all(isinstance(v, ArraySpec) for v in store.spec.values()):
            problems.append("its spec is not a flat dict of tensors")
        if problems:
            store.close()
            raise SpecMismatchError(f"{store.path}: a different memory exists there ({'; '.join(problems)})")
        self.store = store
        if self._temp is not None:
            self._temp.store = store
        self._rows.origin = read_origin(store)
        self._tensors = dict(store.spec)

    def _store_path(self) -> str:
        return self._path if self._path is not None else os.path.join(self._temp.folder, "buffer")  # type: ignore[union-attr]

    def _ensure_store(self) -> Store:
        if self.store is None:
            if not self._tensors:
                raise RuntimeError("the memory has no tensors: call create_tensor() before add_samples()")
            o = self._options
            capacity = ring_capacity(self.memory_size, o["commit_every"])
            self._attach(create(self._store_path(), self._tensors, capacity, self.num_envs,
                                roles=lenient_roles(self._tensors), **o))  # fmt: skip
        return self.store  # type: ignore[return-value]

    def _rebuild(self, src: str, new: dict[str, ArraySpec]) -> None:
        """Make a copy of the store at ``src``, with the tensors ``new`` added, the
        memory's store (:func:`mmreplay.convert.convert`, keeping the sampler). The copy
        is complete before the old store is touched; a crash at any point leaves one
        whole memory at the path (:func:`_finish_swap` completes it on reopen)."""
        path = self._store_path()
        building, replaced = _swap_names(path)
        shutil.rmtree(building, ignore_errors=True)
        o, store = self._options, self.store
        sampler = {"name": o["sampler"] or "uniform", **({"alpha": o["alpha"]} if "alpha" in o else {})}
        every = o["commit_every"] if store is None else store.metadata.commit_every
        convert(src, building, capacity=ring_capacity(self.memory_size, every), commit_every=every,
                new_leaves=new, sampler=sampler if store is None else store.sampler.state_json())  # fmt: skip
        if store is not None:
            store.close()
        if os.path.exists(path):
            os.rename(path, replaced)
        os.rename(building, path)
        shutil.rmtree(replaced, ignore_errors=True)
        self.store, self._rows.env_index = None, 0
        self._attach(open_store(path, "a"))

    # --- cursor ---------------------------------------------------------------------

    @property
    def memory_index(self) -> int:
        """The row the next step goes to. Settable, as in skrl: see :meth:`_move_cursor`."""
        return self._rows.memory_index

    @memory_index.setter
    def memory_index(self, value: int) -> None:
        self._move_cursor(index_arg("memory_index", value, self.memory_size), self.filled)

    @property
    def env_index(self) -> int:
        """The env the next partial add goes to. Settable, as in skrl: envs before it
        (their values in the row now) count as added, written ahead."""
        return self._rows.env_index

    @env_index.setter
    def env_index(self, value: int) -> None:
        index = index_arg("env_index", value, self.num_envs)
        if index:
            row = self._physical(self.get_tensor_names())
            self._write_ahead({name: a[self.memory_index] for name, a in row.items()}, index)
        self._rows.env_index = index

    @property
    def filled(self) -> bool:
        """Whether every row holds a step. Settable, as in skrl: see :meth:`_move_cursor`."""
        return self._rows.filled

    @filled.setter
    def filled(self, value: bool) -> None:
        self._move_cursor(self.memory_index, bool(value))

    def _move_cursor(self, index: int, filled: bool) -> None:
        """Make ``memory_index`` / ``filled`` what skrl's assignments make them, every row
        keeping what it reads now: filled, rows ``index, ..., M - 1, 0, ..., index - 1``
        become the steps, oldest first; not filled, rows ``0, ..., index - 1`` (the rows
        from ``index`` on then read unwritten). Committed at once."""
        if (index, filled) == (self.memory_index, self.filled):
            return
        names = self.get_tensor_names()
        if not names:
            raise RuntimeError("the memory has no tensors: call create_tensor() before moving its cursor")
        M, env_index = self.memory_size, self._rows.env_index
        full = self._physical(names)
        order = np.r_[index:M, 0:index] if filled else np.arange(index)
        self.reset()
        store = self._ensure_store()
        if len(order):
            store.extend(self._complete({name: full[name][order] for name in names}, lead=(len(order),)))
        store.commit()
        if filled and index:
            self._rows.origin = store.total_steps - M - index  # M + index steps since the origin
            write_origin(store, self._rows.origin)
        if env_index:
            self._write_ahead({name: full[name][index] for name in names}, env_index)

    def __len__(self) -> int:
        """``memory_size * num_envs`` once filled, else ``memory_index * num_envs + env_index``."""
        return len(self._rows)

    # --- tensors --------------------------------------------------------------------

    def get_tensor_names(self) -> list[str]:
        """Names of the tensors, sorted."""
        return sorted(self._tensors)

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Each tensor ``(memory_size, num_envs, *size)`` by name, read as a copy."""
        return _TensorCopies(self, keepdim=True)

    @property
    def tensors_view(self) -> Mapping[str, torch.Tensor]:
        """Each tensor ``(memory_size * num_envs, *size)`` by name, read as a copy."""
        return _TensorCopies(self, keepdim=False)

    def create_tensor(
        self, name: str, size: Any, dtype: torch.dtype | None = None, keep_dimensions: bool = False
    ) -> bool:
        """Declare a tensor ``(memory_size, num_envs, size)`` (``(..., *size)`` with
        ``keep_dimensions``). ``size``: an int, a sequence (its product), or a gymnasium
        space (Box: its shape's product; Discrete: 1; MultiDiscrete: ``len(nvec)``; Dict /
        Tuple: the sum of their parts). Declared after data, the store is rebuilt with it.

        Returns:
            True if created; False if ``size`` is None or the tensor exists alike.

        Raises:
            ValueError: the tensor exists with another size or dtype, or the name cannot
                name a leaf (empty, ``.``, ``..``, or holding ``/``, ``\\`` or NUL).
        """
        if size is None:
            return False
        if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
            raise ValueError(
                f"tensor name {name!r} cannot name a leaf (no empty, '.', '..', '/', '\\' or NUL)"
            )
        shape = space_size(size, keep_dimensions)
        if any(d < 1 for d in shape):
            raise ValueError(f"tensor {name!r}: size {size!r} holds no elements")
        existing = self._tensors.get(name)
        if existing is not None:
            if math.prod(existing.shape) != math.prod(shape) or (keep_dimensions and existing.shape != shape):
                raise ValueError(
                    f"Size of tensor {name} ({shape}) doesn't match the existing one ({existing.shape})"
                )
            if dtype is not None and torch_dtype(existing.dtype) != dtype:
                raise ValueError(
                    f"Dtype of tensor {name} ({dtype}) doesn't match the existing one ({torch_dtype(existing.dtype)})"
                )
            return False
        wanted = torch.get_default_dtype() if dtype is None else dtype
        try:
            spec = ArraySpec(shape, torch.empty((), dtype=wanted).numpy().dtype)
        except TypeError as exc:
            raise SpecError(f"tensor {name!r}: dtype {wanted} has no numpy equivalent") from exc
        if self.store is None:
            self._tensors[name] = spec
            return True
        env_index = self._rows.env_index
        ahead = self._ahead() if env_index else None
        self.store.commit()
        self._rebuild(self.store.path, {name: spec})
        if ahead is not None:
            self._write_ahead({**ahead, name: unwritten((self.num_envs, *shape), spec.dtype)}, env_index)
        return True

    def get_tensor_by_name(self, name: str, keepdim: bool = True) -> torch.Tensor:
        """A copy of the tensor: ``(memory_size, num_envs, *size)``, or
        ``(memory_size * num_envs, *size)`` without ``keepdim``. KeyError if unknown."""
        full = self._physical([name])[name]
        return self._out(full if keepdim else full.reshape(-1, *self._tensors[name].shape))

    def set_tensor_by_name(self, name: str, tensor: Any) -> None:
        """Overwrite the tensor (broadcast to ``(memory_size, num_envs, *size)``) in the
        rows that hold steps (committed here) or a partial step; rows holding none stay
        unwritten. KeyError if unknown."""
        M, E = self.memory_size, self.num_envs
        value = as_values(name, tensor, (M, E, *self._tensors[name].shape), self._tensors[name].dtype)
        store = self.store
        if store is None:
            return
        if self._rows.env_index:
            ahead = self._ahead()
            ahead[name][: self._rows.env_index] = value[self.memory_index, : self._rows.env_index]
            self._write_ahead(ahead, self._rows.env_index)
        store.commit()
        steps, valid = self._rows.steps_of_rows(np.arange(M))
        if valid.any():
            leaves = dict(zip(store.leaf_paths, store.read_steps(steps[valid])))
            leaves[name] = value[valid]
            store.set(steps[valid] - store.first_step, leaves)
            store.commit()

    # --- writes ---------------------------------------------------------------------

    def reset(self) -> None:
        """Empty the memory: cursor to 0, not filled; stored steps are dropped."""
        self._rows.env_index = 0
        if self.store is not None:
            self.store.commit()
            self._rows.origin = self.store.total_steps
            write_origin(
                self.store, self._rows.origin
            )  # first: a crash before the clear shows an empty memory
            self.store.clear()

    def add_samples(self, **tensors: Any) -> None:
        """Record samples: each tensor ``(num_envs, *size)`` (one step of all envs),
        ``(n, *size)`` with ``n < num_envs`` (the next ``n`` envs of the step), ``(*size)``
        (the next env), or with one env ``(n, *size)`` (``n`` steps). Unknown names and
        ``None`` values are skipped; the kind of add is read from ``observations`` (or
        ``states``, else the first tensor).

        Raises:
            ValueError: no tensors, shapes that fit none of the kinds, unstorable values.
            RuntimeError: envs beyond ``num_envs`` in a step, or a step of all envs
                while a partial one is staged.
        """
        if not tensors:
            raise ValueError(
                "No samples to be recorded in memory. Pass samples as key-value arguments (where key is the tensor name)"
            )
        given = {k: v for k, v in tensors.items() if v is not None}
        if not given:
            raise ValueError("every sample given to add_samples is None")
        ref_name = next((k for k in ("observations", "states") if k in given), next(iter(given)))
        ref_shape, ref = tuple(given[ref_name].shape), self._tensors.get(ref_name)
        lead = len(ref_shape) - (len(ref.shape) if ref is not None else 1)
        E, ei = self.num_envs, self._rows.env_index
        if lead == 1 and ref_shape[0] == E:
            if ei:
                raise RuntimeError(
                    f"a step of all {E} envs was added while envs 0..{ei - 1} of the current step are staged; "
                    f"add the remaining {E - ei} envs first"
                )
            kind, n = "step", E
        elif lead == 1 and (ref_shape[0] < E or E == 1):
            kind, n = ("envs" if ref_shape[0] < E else "rows"), ref_shape[0]
        elif lead == 0:
            kind, n = "envs", 1
        else:
            raise ValueError(f"Expected shape (number of environments = {E}, data size), got {ref_shape}")
        if kind == "envs" and ei + n > E:
            raise RuntimeError(f"{n} envs added at env index {ei} overflow num_envs={E}; nothing was added")
        arrays = {name: as_values(name, v, (n, *s.shape) if lead else s.shape, s.dtype)
                  for name, v in given.items() if (s := self._tensors.get(name)) is not None}  # fmt: skip
        store = self._ensure_store()
        before = self._rows.steps
        if kind == "step":
            store.add(self._complete(arrays))
        elif kind == "rows":
            store.extend(self._complete({name: a[:, None] for name, a in arrays.items()}, lead=(n,)))
        else:
            step = self._ahead()
            for name, a in arrays.items():
                step[name][ei : ei + n] = a
            if ei + n == E:
                store.add(step)
                self._rows.env_index = 0
            else:
                self._write_ahead(step, ei + n)
        if self.export and self._rows.steps // self.memory_size > before // self.memory_size:
            self.save(self.export_directory, self.export_format)

    def _complete(self, arrays: dict[str, np.ndarray], lead: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
        """A whole step (or steps): tensors not given read unwritten (NaN / zero)."""
        return {name: arrays[name] if name in arrays else unwritten((*lead, self.num_envs, *s.shape), s.dtype)
                for name, s in self._tensors.items()}  # fmt: skip

    # --- reads ----------------------------------------------------------------------

    def _ahead(self) -> dict[str, np.ndarray]:
        """The next step's rows as written ahead (envs from ``env_index`` on read unwritten)."""
        store = self.store
        if not self._rows.env_index or store is None:
            return self._complete({})
        return {name: a[0] for name, a in zip(store.leaf_paths, store.read_steps([store.total_steps]))}

    def _write_ahead(self, step: dict[str, np.ndarray], env_index: int) -> None:
        """Keep envs ``0..env_index-1`` of the next step in the store's next slot."""
        self._ensure_store().write_next(step)
        self._rows.env_index = env_index

    def _gather(self, names: Sequence[str], flat: np.ndarray) -> dict[str, np.ndarray]:
        """Rows at flat physical indexes ``row * num_envs + env``, per name."""
        steps, envs, holds = self._rows.locate(flat)
        store = self.store
        ahead = holds & (steps == store.total_steps) if self._rows.env_index else np.zeros(flat.shape, bool)  # type: ignore[union-attr]
        stored = holds & ~ahead
        if stored.all() and names and store is not None:  # the common case: every row is a stored one
            by_name = dict(zip(store.leaf_paths, read_rows(store, steps, envs)))  # type: ignore[union-attr,arg-type]
            return {name: by_name[name] for name in names}
        out = {n: unwritten((*flat.shape, *self._tensors[n].shape), self._tensors[n].dtype) for n in names}
        if stored.any():
            by_name = dict(zip(store.leaf_paths, read_rows(store, steps[stored], envs[stored])))  # type: ignore[union-attr,arg-type]
            for name in names:
                out[name][stored] = by_name[name]
        if ahead.any():
            row = self._ahead()
            for name in names:
                out[name][ahead] = row[name][envs[ahead]]
        return out

    def _physical(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Whole tensors ``(memory_size, num_envs, *size)`` in physical row order."""
        return self._gather(names, np.arange(self.memory_size * self.num_envs).reshape(self.memory_size, -1))

    def _out(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _flat_indexes(self, indexes: Any) -> np.ndarray:
        if isinstance(indexes, torch.Tensor):
            indexes = indexes.detach().cpu().numpy()
        idx, n = np.asarray(indexes), self.memory_size * self.num_envs
        if idx.size == 0:
            return idx.astype(np.int64).reshape(-1)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"indexes must be integers, got {idx.dtype}")
        if idx.min() < -n or idx.max() >= n:
            raise IndexError(f"index out of range for a memory of {n} rows")
        return np.mod(idx.astype(np.int64), n)

    def _batches(
        self, names: Sequence[str], flat: dict[str, np.ndarray], mini_batches: int
    ) -> list[list[Any]]:
        """Rows ``[count, *size]`` per name as skrl's ``[[tensor or None per name] per mini-batch]``,
        split into exactly ``mini_batches`` batches (:func:`numpy.array_split`)."""
        count = next(iter(flat.values())).shape[0] if flat else 0
        parts = np.array_split(np.arange(count), mini_batches) if mini_batches > 1 else [slice(None)]
        return [[self._out(flat[n][p]) if n in flat else None for n in names] for p in parts]

    def sample(
        self, names: Sequence[str], batch_size: int, mini_batches: int = 1, sequence_length: int = 1
    ) -> list[list[torch.Tensor | None]]:
        """Implemented by :class:`RandomMemory`."""
        raise NotImplementedError("The sampling method (.sample()) is not implemented")

    def sample_by_index(self, names: Sequence[str], indexes: Any, mini_batches: int = 1) -> list[list[Any]]:
        """Rows at flat physical indexes, in ``mini_batches`` batches; ``None`` for an unknown name."""
        flat = self._flat_indexes(indexes)
        return self._batches(
            names, self._gather([n for n in names if n in self._tensors], flat), mini_batches
        )

    def sample_all(
        self, names: Sequence[str], mini_batches: int = 1, sequence_length: int = 1
    ) -> list[list[Any]]:
        """Every row in physical order, or env by env with ``sequence_length > 1``."""
        flat = (
            self.all_sequence_indexes if sequence_length > 1 else np.arange(self.memory_size * self.num_envs)
        )
        return self.sample_by_index(names, flat, mini_batches)

    def update_priorities(self, indexes: Any, priorities: Any) -> int:
        """New priorities for rows at flat physical indexes (for sequences, each one's
        first), for a memory created with ``sampler="prioritized"``. Rows overwritten
        since they were sampled are skipped; returns how many were applied."""
        flat = self._flat_indexes(indexes)
        rows, envs = np.divmod(flat, self.num_envs)
        steps, valid = self._rows.steps_of_rows(rows)
        if not valid.all():
            raise IndexError(f"{self._store_path()}: indexes {flat[~valid].tolist()} hold no stored row")
        if isinstance(priorities, torch.Tensor):
            priorities = priorities.detach().cpu().numpy()
        return self._ensure_store().update_priorities(steps, envs, np.asarray(priorities).reshape(-1))

    def get_sampling_indexes(self) -> torch.Tensor | None:
        """The flat indexes of the last :meth:`sample` (None before the first)."""
        return self.sampling_indexes

    def share_memory(self) -> None:
        """Nothing to do: the data is already in files other processes can open."""

    # --- files ----------------------------------------------------------------------

    def save(self, directory: str = "", format: str = "pt") -> str:  # noqa: A002 - skrl's name
        """Export the complete steps the memory holds, oldest first, to
        ``<directory>/memories/<time>_memory_<id>.<format>`` (:func:`mmreplay.export.export`:
        ``[steps, num_envs, *size]`` per tensor). Returns the file's path."""
        fmt = "npz" if format == "np" else format
        if fmt not in FORMATS:
            raise ValueError(f"Unsupported format: {format}. Available formats: pt, csv, npz")
        stamp = datetime.datetime.now().strftime("%y-%m-%d_%H-%M-%S-%f")
        path = os.path.join(
            directory or self.export_directory, "memories", f"{stamp}_memory_{hex(id(self))}.{fmt}"
        )
        os.makedirs(os.path.dirname(path), exist_ok=True)
        store = self._ensure_store()
        store.commit()
        return export(_Shown(store, *self._rows.window()), path, format=fmt).path

    def load(self, path: str) -> None:
        """Replace the memory with a file :meth:`save` (or ``mmreplay export``) wrote, read by
        :func:`mmreplay.importers.import_dataset`: its steps become the memory's, oldest
        first, its tensors (dtypes as the file keeps them) the memory's; tensors declared
        and not in the file read unwritten.

        Raises:
            ValueError: another extension, or a file of another number of envs.
        """
        fmt = os.fspath(path).rpartition(".")[2]
        if fmt not in FORMATS:
            raise ValueError(f"Unsupported format: {path}")
        scratch = tempfile.mkdtemp(prefix=".load-", dir=os.path.dirname(os.path.abspath(self._store_path())))
        try:
            imported = import_dataset(path, os.path.join(scratch, "store"), format=fmt,
                                      backend=self._options["backend"], compression=self._options["compression"])  # fmt: skip
            if imported.num_envs != self.num_envs:
                raise ValueError(f"{path}: holds {imported.num_envs} envs, the memory has {self.num_envs}")
            with open_store(imported.path) as found:
                missing = {n: s for n, s in self._tensors.items() if n not in found.spec}
            if self.store is not None:
                self.store.commit()
            self._rebuild(imported.path, missing)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        store = self._ensure_store()
        self._rows.origin = store.first_step
        write_origin(store, store.first_step)

    # --- life cycle -----------------------------------------------------------------

    def close(self) -> None:
        """Commit and release the store (a temporary one is deleted); a partial step is
        not committed. Safe twice."""
        if self._rows.env_index and self.store is not None and not self.store.closed:
            log.warning("%s: closing with envs 0..%d of a step staged; they are not written",
                        self.store.path, self._rows.env_index - 1)  # fmt: skip
        super().close()

    def __repr__(self) -> str:
        n = len(self) if self.store is None or not self.store.closed else "?"
        return (
            f"<mmreplay.compat.skrl.{type(self).__name__} memory_size={self.memory_size} num_envs={self.num_envs} "
            f"len={n} tensors={self.get_tensor_names()} path={self._store_path()!r}>"
        )


class RandomMemory(Memory):
    """skrl's ``RandomMemory``: uniform random batches, with or without replacement.

    Args:
        replacement: draw with replacement (the batch size is always met); without, at
            most ``len(memory)`` distinct rows (or sequence starts). None: the installed
            skrl's default (:func:`skrl_replacement_default`), with replacement for
            ``sampler="prioritized"``, which draws only so.
        others: as :class:`Memory`.
    """

    def __init__(
        self,
        memory_size: int,
        num_envs: int = 1,
        device: str | torch.device | None = None,
        export: bool = False,
        export_format: str = "pt",
        export_directory: str = "",
        replacement: bool | None = None,
        path: str | os.PathLike | None = None,
        **options: Any,
    ):
        super().__init__(
            memory_size, num_envs, device, export, export_format, export_directory, path, **options
        )
        if replacement is None:  # a prioritized (or other store) sampler draws with replacement
            uniform = (self.store.sampler.name if self.store else self._options.get("sampler")) in (
                None,
                "uniform",
            )
            replacement = skrl_replacement_default() if uniform else True
        self._replacement = bool(replacement)
        self._rule = TorchDrawRule(self._rows)

    def sample(
        self, names: Sequence[str], batch_size: int, mini_batches: int = 1, sequence_length: int = 1
    ) -> list[list[torch.Tensor | None]]:
        """A random batch: ``[[tensor per name] per mini-batch]``, each ``(batch_size *
        sequence_length, *size)``; a sequence is one env's consecutive rows. Drawn with
        skrl's torch calls (skrl's indexes under ``torch.manual_seed``), or by priority
        (complete steps only), then read through the store's fetch path.

        Raises:
            MemoryEmptyError: with replacement, nothing (or no whole sequence) to draw.
        """
        if self.store is None:  # nothing added yet: skrl's draw raises or gives no rows
            draw = self._rows.draw(batch_size, sequence_length, self._replacement)
            self.sampling_indexes, self.sampling_info = draw, None
            return self.sample_by_index(names, draw, mini_batches)
        uniform = self.store.sampler.name == "uniform"  # else the store's own (prioritized...)
        request = SampleRequest.build(
            batch_size, None if sequence_length == 1 else sequence_length, self._replacement,
            return_info=True, window=self._rows.window(), sampler=self._rule if uniform else None,
        )  # fmt: skip
        nest, info = sample_store(self.store, request)
        if uniform:
            self.sampling_indexes = self._rule.last_indexes
        else:
            rows = (info.step - self._rows.origin)[:, None] + np.arange(sequence_length)
            flat = (rows % self.memory_size) * self.num_envs + info.env[:, None]
            self.sampling_indexes = torch.from_numpy(flat.reshape(-1))
        self.sampling_info = info
        rows = {n: a.reshape(-1, *self._tensors[n].shape) for n, a in nest.items() if n in self._tensors}
        return self._batches(names, rows, mini_batches)


class _TensorCopies(Mapping):
    """``memory.tensors`` / ``memory.tensors_view``: the tensors by name, each read as a copy."""

    def __init__(self, memory: Memory, keepdim: bool):
        self._memory, self._keepdim = memory, keepdim

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._memory.get_tensor_by_name(name, self._keepdim)

    def __iter__(self) -> Iterator[str]:
        return iter(self._memory.get_tensor_names())

    def __len__(self) -> int:
        return len(self._memory.get_tensor_names())


class _Shown:
    """The memory's store as an export reads it: narrowed to the steps the memory shows."""

    def __init__(self, store: Store, first: int, end: int):
        self._store, self.first_step, self.committed_steps = store, first, end

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __len__(self) -> int:
        return self.committed_steps - self.first_step


def _swap_names(path: str) -> tuple[str, str]:
    """Sibling folders of a rebuild: the new memory being built, the old one set aside."""
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.migrating"), os.path.join(parent, f".{base}.replaced")


def _finish_swap(path: str) -> None:
    """Complete or undo a rebuild a crash interrupted, so one whole memory is at ``path``."""
    building, replaced = _swap_names(path)
    if os.path.exists(replaced):
        if not os.path.exists(path):  # the new memory is complete if present
            os.rename(building if os.path.exists(building) else replaced, path)
        shutil.rmtree(replaced, ignore_errors=True)
    if os.path.exists(building):
        shutil.rmtree(building, ignore_errors=True)  # an unfinished copy; the old memory is intact
