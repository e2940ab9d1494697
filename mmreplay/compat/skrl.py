"""skrl / rofunc's ``Memory`` and ``RandomMemory`` over a persistent store (docs/skrl.md).

The layer keeps only skrl's cursor, mapped onto the store's steps by
:class:`~mmreplay.samplers.torch_rule.PhysicalRows`; rows, commits, draws (skrl's torch
calls as a sampler, or the store's), a tensor declared after data (``convert``) and
``save`` / ``load`` (export / import) are the store's.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is an install extra
    raise ImportError("mmreplay.compat.skrl needs torch: pip install 'mmreplay[torch]'") from exc

from ..convert import convert, unwritten
from ..files import remove_dead_scratch, scratch_path
from ..formats import export, import_dataset
from ..metadata import METADATA_FILE
from ..read import SampleRequest, read_rows
from ..read import sample as sample_store
from ..read.request import positive
from ..samplers.torch_rule import MemoryEmptyError, PhysicalRows, TorchDrawRule
from ..spec import ArraySpec
from ..store import DEFAULT_COMMIT_EVERY, Store
from ..store import open as open_store
from . import _skrl_args as skrl_args
from ._shared import (
    StoreOptions,
    StoreShell,
    check_same,
    clear_steps,
    create_store,
    read_origin,
    ring_capacity,
    temporary,
    write_origin,
)
from ._skrl_args import skrl_replacement_default

__all__ = ["Memory", "RandomMemory", "MemoryEmptyError"]

log = logging.getLogger(__name__)


class Memory(StoreShell):
    """skrl's ``Memory``. Args are skrl's, plus ``path`` (the buffer folder, resumed if it
    exists; None: a temporary one removed at ``close()``), :func:`mmreplay.create`'s
    options, and ``sampler`` / ``alpha`` (``"prioritized"``: sample by priority)."""

    def __init__(self, memory_size: int, num_envs: int = 1, device: str | torch.device | None = None,
                 export: bool = False, export_format: str = "pt", export_directory: str = "",
                 path: str | os.PathLike | None = None, *, commit_every: int = DEFAULT_COMMIT_EVERY,
                 alpha: float | None = None, **store_options: Any):  # fmt: skip
        self.memory_size, self.num_envs = M, E = positive("memory_size", memory_size), positive("num_envs", num_envs)
        self.device = skrl_args.parse_device(device)
        self.export, self.export_directory = bool(export), export_directory
        self.export_format = skrl_args.file_format(export_format, f"Export format not supported ({export_format})")
        self.sampling_indexes: torch.Tensor | None = None
        self.sampling_info: Any = None  # the store's SampleInfo of the last sample (weights...)
        self.all_sequence_indexes = np.arange(M * E).reshape(M, E).T.reshape(-1)
        alpha_option = {} if alpha is None else {"alpha": alpha}  # the prioritized sampler's
        self._options = StoreOptions(commit_every=commit_every, sampler_options=alpha_option, **store_options)
        self._tensors: dict[str, ArraySpec] = {}
        self._rows = PhysicalRows(M, E)  # the cursor: physical rows <-> the store's global steps
        self._path = None if path is None else os.fspath(path)
        self._temp = temporary(self) if path is None else None
        if self._path is not None:
            _finish_swap(self._path)
            if os.path.exists(os.path.join(self._path, METADATA_FILE)):
                self._attach(open_store(self._path, "a"), self._options)

    @property
    def store(self) -> Store | None:
        """The store holding the memory (None until it holds data)."""
        return self._rows.store

    def _attach(self, store: Store, options: StoreOptions | None = None) -> None:
        flat = isinstance(store.spec, dict) and all(isinstance(s, ArraySpec) for s in store.spec.values())
        check_same(store, None if flat else {}, self.memory_size, self.num_envs, "memory", "memory_size", options)
        self._rows.store, self._rows.origin, self._tensors = store, read_origin(store), dict(store.spec)
        if self._temp is not None:
            self._temp.store = store

    def _store_path(self) -> str:
        return self._path or os.path.join(self._temp.folder, "buffer")  # type: ignore[union-attr]

    def _ensure_store(self) -> Store:
        if self.store is None:
            if not self._tensors:
                raise RuntimeError("the memory has no tensors: call create_tensor() first")
            self._attach(create_store(self._store_path(), self._tensors, self.memory_size, self.num_envs, self._options))
        return self.store  # type: ignore[return-value]

    def _rebuild(self, src: str, new: dict[str, ArraySpec]) -> None:
        """Make a copy of the store at ``src`` plus the tensors ``new`` the memory's store,
        built beside it and swapped in: a crash leaves one whole memory (:func:`_finish_swap`)."""
        path, store, o = self._store_path(), self.store, self._options
        building, replaced = _swap_names(path)
        shutil.rmtree(building, ignore_errors=True)
        every = o.commit_every if store is None else store.metadata.commit_every
        sampler = {"name": o.sampler or "uniform", **o.sampler_options} if store is None else store.sampler.state_json()
        convert(src, building, capacity=ring_capacity(self.memory_size, every), commit_every=every,
                new_leaves=new, sampler=sampler)  # fmt: skip
        if store is not None:
            store.close()
        if os.path.exists(path):
            os.rename(path, replaced)
        os.rename(building, path)
        shutil.rmtree(replaced, ignore_errors=True)
        self._rows.env_index = 0
        self._attach(open_store(path, "a"))

    # skrl's cursor, settable as in skrl: every row keeps what it reads (docs/skrl.md)
    def _set_memory_index(self, value: int) -> None:
        self._move_cursor(skrl_args.index_arg("memory_index", value, self.memory_size), self.filled)

    def _set_env_index(self, value: int) -> None:
        index = skrl_args.index_arg("env_index", value, self.num_envs)
        if index:  # the envs before it count as added, with what their rows read now
            row = self.memory_index * self.num_envs + np.arange(self.num_envs)
            self._write_ahead(self._gather(self.get_tensor_names(), row), index)
        self._rows.env_index = index

    memory_index = property(lambda self: self._rows.memory_index, _set_memory_index)
    env_index = property(lambda self: self._rows.env_index, _set_env_index)
    filled = property(lambda self: self._rows.filled, lambda self, v: self._move_cursor(self.memory_index, bool(v)))

    def _move_cursor(self, index: int, filled: bool) -> None:
        """Rewrite the store with rows ``index..M-1, 0..index-1`` (filled) or ``0..index-1``
        as its steps, oldest first, and commit: skrl's cursor, every row as it reads."""
        if (index, filled) == (self.memory_index, self.filled):
            return
        names = self.get_tensor_names()
        if not names:
            raise RuntimeError("the memory has no tensors: call create_tensor() first")
        M, env_index = self.memory_size, self._rows.env_index
        full = self._physical(names)
        order = np.r_[index:M, 0:index] if filled else np.arange(index)
        self.reset()
        store = self._ensure_store()
        store.extend({name: full[name][order] for name in names})
        store.commit()
        if filled and index:
            self._rows.origin = store.total_steps - M - index  # M + index steps since the origin
            write_origin(store, self._rows.origin)
        if env_index:
            self._write_ahead({name: full[name][index] for name in names}, env_index)

    def __len__(self) -> int:
        return len(self._rows)

    def get_tensor_names(self) -> list[str]:
        return sorted(self._tensors)

    # each tensor by name, (memory_size, num_envs, *size) / (memory_size * num_envs, *size), read when asked
    tensors = property(lambda self: _TensorCopies(self, keepdim=True))
    tensors_view = property(lambda self: _TensorCopies(self, keepdim=False))

    def create_tensor(self, name: str, size: Any, dtype: torch.dtype | None = None,
                      keep_dimensions: bool = False) -> bool:  # fmt: skip
        """skrl's ``create_tensor``; declared after data, the store is rebuilt with it."""
        spec = None if size is None else skrl_args.tensor_spec(name, size, dtype, keep_dimensions, self._tensors.get(name))
        if spec is None:
            return False
        if self.store is None:
            self._tensors[name] = spec
            return True
        env_index, ahead = self._rows.env_index, self._ahead()
        self.store.commit()
        self._rebuild(self.store.path, {name: spec})
        if env_index:
            self._write_ahead({**ahead, name: unwritten((self.num_envs, *spec.shape), spec.dtype)}, env_index)
        return True

    def get_tensor_by_name(self, name: str, keepdim: bool = True) -> torch.Tensor:
        full = self._physical([name])[name]
        return self._out(full if keepdim else full.reshape(-1, *self._tensors[name].shape))

    def set_tensor_by_name(self, name: str, tensor: Any) -> None:
        """Overwrite the tensor in the rows that hold a step (committed here) or a partial
        one; rows holding none are not storage and stay unwritten (docs/skrl.md)."""
        spec = self._tensors[name]
        value = skrl_args.as_values(name, tensor, (self.memory_size, self.num_envs, *spec.shape), spec.dtype)
        store, env_index = self.store, self._rows.env_index
        if store is None:
            return
        if env_index:
            ahead = self._ahead()
            ahead[name][:env_index] = value[self.memory_index, :env_index]
            self._write_ahead(ahead, env_index)
        store.commit()
        steps, valid = self._rows.steps_of_rows(np.arange(self.memory_size))
        if valid.any():
            leaves = dict(zip(store.leaf_paths, store.read_steps(steps[valid])))
            leaves[name] = value[valid]
            store.set(steps[valid] - store.first_step, leaves)
            store.commit()

    def reset(self) -> None:
        """Empty the memory: cursor to 0, not filled; the stored steps are dropped, durably."""
        self._rows.env_index = 0
        if self.store is not None:
            self._rows.origin = clear_steps(self.store)

    def add_samples(self, **tensors: Any) -> None:
        """skrl's ``add_samples``, the kind of add read from ``observations``, ``states`` or the
        first tensor (:func:`~._skrl_args.envs_added`); a refused add changes nothing."""
        given = {k: v for k, v in tensors.items() if v is not None}
        if not given:
            raise ValueError("No samples to be recorded in memory. Pass samples as key-value arguments (where key is the tensor name)")
        ref_name = next((k for k in ("observations", "states") if k in given), next(iter(given)))
        ref, shape = self._tensors.get(ref_name), tuple(given[ref_name].shape)
        ndim, E, ei = 1 if ref is None else len(ref.shape), self.num_envs, self._rows.env_index
        n = skrl_args.envs_added(shape, ndim, E, ei)
        single = len(shape) == ndim  # the next env, without an env axis
        arrays = {name: skrl_args.as_values(name, v, s.shape if single else (n, *s.shape), s.dtype)
                  for name, v in given.items() if (s := self._tensors.get(name)) is not None}  # fmt: skip
        store = self._ensure_store()
        before = self._rows.steps
        if n > E:  # steps of one env
            store.extend(self._complete({name: a[:, None] for name, a in arrays.items()}, lead=(n,)))
        elif n == E and not single:
            store.add(self._complete(arrays))
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

    def _write_ahead(self, step: dict[str, np.ndarray], env_index: int) -> None:
        """Keep envs ``0..env_index-1`` of the next step in the store's next slot."""
        self._ensure_store().write_next(step)
        self._rows.env_index = env_index

    def _ahead(self) -> dict[str, np.ndarray]:
        """The next step as written ahead (envs from ``env_index`` on read unwritten)."""
        store = self.store
        if not self._rows.env_index or store is None:
            return self._complete({})
        return {name: a[0] for name, a in zip(store.leaf_paths, store.read_steps([store.total_steps]))}

    def _gather(self, names: Sequence[str], flat: np.ndarray) -> dict[str, np.ndarray]:
        """Rows at flat physical indexes ``row * num_envs + env``, per name."""
        steps, envs, holds = self._rows.locate(flat)
        store = self.store
        ahead = holds & (steps == store.total_steps) if self._rows.env_index else np.zeros(flat.shape, bool)  # type: ignore[union-attr]
        stored = holds & ~ahead
        if stored.all() and names and store is not None:  # the common case: every row is a stored one
            return read_rows(store, steps, envs)  # the store is a flat dict: arrays by tensor name
        out = {n: unwritten((*flat.shape, *self._tensors[n].shape), self._tensors[n].dtype) for n in names}
        if stored.any():
            by_name = read_rows(store, steps[stored], envs[stored])  # type: ignore[arg-type]
            for name in names:
                out[name][stored] = by_name[name]
        if ahead.any():
            row = self._ahead()
            for name in names:
                out[name][ahead] = row[name][envs[ahead]]
        return out

    def _physical(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        return self._gather(names, np.arange(self.memory_size * self.num_envs).reshape(self.memory_size, -1))

    def _out(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _batches(self, names: Sequence[str], flat: dict[str, np.ndarray], mini_batches: int) -> list[list[Any]]:
        """skrl's ``[[tensor or None per name] per mini-batch]``, split by :func:`numpy.array_split`."""
        count = next(iter(flat.values())).shape[0] if flat else 0
        parts = np.array_split(np.arange(count), mini_batches) if mini_batches > 1 else [slice(None)]
        return [[self._out(flat[n][p]) if n in flat else None for n in names] for p in parts]

    def sample(self, names: Sequence[str], batch_size: int, mini_batches: int = 1,
               sequence_length: int = 1) -> list[list[torch.Tensor | None]]:  # fmt: skip
        raise NotImplementedError("The sampling method (.sample()) is not implemented")

    def sample_by_index(self, names: Sequence[str], indexes: Any, mini_batches: int = 1) -> list[list[Any]]:
        flat = skrl_args.flat_indexes(indexes, self.memory_size * self.num_envs)
        return self._batches(names, self._gather([n for n in names if n in self._tensors], flat), mini_batches)

    def sample_all(self, names: Sequence[str], mini_batches: int = 1, sequence_length: int = 1) -> list[list[Any]]:
        every = self.all_sequence_indexes if sequence_length > 1 else np.arange(self.memory_size * self.num_envs)
        return self.sample_by_index(names, every, mini_batches)

    def update_priorities(self, indexes: Any, priorities: Any) -> int:
        """New priorities for rows at flat physical indexes (of a sequence, its first), for
        ``sampler="prioritized"``; returns how many were applied (:meth:`Store.update_priorities`)."""
        rows, envs = np.divmod(skrl_args.flat_indexes(indexes, self.memory_size * self.num_envs), self.num_envs)
        steps, valid = self._rows.steps_of_rows(rows)
        if not valid.all():
            raise IndexError(f"{self._store_path()}: indexes {(rows * self.num_envs + envs)[~valid].tolist()} hold no step")
        priorities = np.asarray(priorities.detach().cpu() if isinstance(priorities, torch.Tensor) else priorities)
        return self._ensure_store().update_priorities(steps, envs, priorities.reshape(-1))

    def get_sampling_indexes(self) -> torch.Tensor | None:
        return self.sampling_indexes

    def share_memory(self) -> None:
        """Nothing to do: the data is already in files other processes can open."""

    def save(self, directory: str = "", format: str = "pt") -> str:  # noqa: A002 - skrl's name
        """Export the complete steps the memory shows, oldest first (``[steps, num_envs,
        *size]`` per tensor), to skrl's file name; returns its path."""
        fmt = skrl_args.file_format(format, f"Unsupported format: {format}")
        stamp = datetime.datetime.now().strftime("%y-%m-%d_%H-%M-%S-%f")
        path = os.path.join(directory or self.export_directory, "memories", f"{stamp}_memory_{hex(id(self))}.{fmt}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        store = self._ensure_store()
        store.commit()
        return export(_Shown(store, *self._rows.window()), path, format=fmt).path

    def load(self, path: str) -> None:
        """Replace the memory with the steps and tensors of a file :meth:`save` (or
        ``mmreplay export``) wrote; declared tensors the file lacks read unwritten."""
        fmt = skrl_args.file_format(os.fspath(path).rpartition(".")[2], f"Unsupported format: {path}")
        scratch = scratch_path(self._store_path(), "partial")  # removed at reopen if killed (_finish_swap)
        os.makedirs(scratch, exist_ok=True)
        try:
            imported = import_dataset(path, os.path.join(scratch, "store"), format=fmt, backend=self._options.backend,
                                      compression=self._options.compression,
                                      spec=self._tensors if fmt == "csv" else None)  # fmt: skip
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

    def close(self) -> None:
        """Commit and release the store (a temporary one is deleted); a partial step is lost."""
        if self._rows.env_index and self.store is not None and not self.store.closed:
            log.warning("%s: closing with envs 0..%d of a step staged; they are not written",
                        self.store.path, self._rows.env_index - 1)  # fmt: skip
        super().close()

    def __repr__(self) -> str:
        n = len(self) if self.store is None or not self.store.closed else "?"
        return (f"<mmreplay.compat.skrl.{type(self).__name__} memory_size={self.memory_size} num_envs={self.num_envs}"
                f" len={n} tensors={self.get_tensor_names()} path={self._store_path()!r}>")  # fmt: skip


class RandomMemory(Memory):
    """skrl's ``RandomMemory``. ``replacement=None``: the installed skrl's default, or with
    replacement for a store sampler such as ``"prioritized"``, which draws only so."""

    def __init__(self, memory_size: int, num_envs: int = 1, device: str | torch.device | None = None,
                 export: bool = False, export_format: str = "pt", export_directory: str = "",
                 replacement: bool | None = None, path: str | os.PathLike | None = None, **options: Any):  # fmt: skip
        super().__init__(memory_size, num_envs, device, export, export_format, export_directory, path, **options)
        if replacement is None:
            sampler = self.store.sampler.name if self.store else self._options.sampler
            replacement = skrl_replacement_default() if sampler in (None, "uniform") else True
        self._replacement = bool(replacement)
        self._rule = TorchDrawRule(self._rows)

    def sample(self, names: Sequence[str], batch_size: int, mini_batches: int = 1,
               sequence_length: int = 1) -> list[list[torch.Tensor | None]]:  # fmt: skip
        """skrl's batch, drawn by skrl's torch calls (its indexes under ``torch.manual_seed``)
        or by the store's sampler, and read through the store's fetch path."""
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
        rows = (info.step - self._rows.origin)[:, None] + np.arange(sequence_length)  # skrl's physical rows
        flat = (rows % self.memory_size) * self.num_envs + info.env[:, None]
        self.sampling_indexes, self.sampling_info = torch.from_numpy(flat.reshape(-1)), info
        batch = {n: a.reshape(-1, *self._tensors[n].shape) for n, a in nest.items() if n in self._tensors}
        return self._batches(names, batch, mini_batches)


class _TensorCopies(Mapping):
    def __init__(self, memory: Memory, keepdim: bool):
        self._memory, self._keepdim = memory, keepdim

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._memory.get_tensor_by_name(name, self._keepdim)

    def __iter__(self) -> Iterator[str]:
        return iter(self._memory.get_tensor_names())

    def __len__(self) -> int:
        return len(self._memory.get_tensor_names())


class _Shown:
    """The store as an export reads it, narrowed to the steps the memory shows."""

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
    for scratch_of in (building, path):  # a copy, or a load's import, killed unfinished
        remove_dead_scratch(scratch_of)
