"""skrl / rofunc memories over a persistent store: ``Memory`` and ``RandomMemory``.

Change the import, add ``path=``, and the memory survives crashes and outgrows RAM::

    # from skrl.memories.torch import RandomMemory
    from mmreplay.compat.skrl import RandomMemory
    memory = RandomMemory(memory_size=100_000, num_envs=env.num_envs, device=device,
                          path="run/memory")

Outputs are torch tensors on ``device``. The original's data model is kept: every
tensor is ``(memory_size, num_envs, size)``, rows are indexed physically (``memory_index``,
``env_index``), flat indexes are ``row * num_envs + env``, and ``sample_all`` /
``get_tensor_by_name`` / ``save`` see rows in that physical order.

How it maps onto the store:

- Each tensor is a leaf; one step of ``num_envs`` rows is one store step. The store's
  ring is ``memory_size`` plus the writer's reservation, so the newest ``memory_size``
  steps survive a crash. Complete steps count from an origin kept in the store attribute ``compat_origin``
  (moved by ``reset``), so ``memory_index = steps % memory_size`` and ``filled`` survive
  a reopen; physical row ``r`` holds the newest step whose count is ``r`` modulo
  ``memory_size``.
- A step is added when all its envs are in: the envs of a partial step (adds of fewer
  than ``num_envs`` envs) are written ahead into the store's next slot
  (:meth:`mmreplay.Store.write_next`), where reads and ``sample`` see them at once,
  and the step is added when the last env arrives. The cursor arithmetic and the draw
  rule are :mod:`mmreplay.samplers.torch_rule`'s; every random batch is read through
  the store's fetch path. What is durable is every complete step as of the last commit
  (every ``commit_every`` steps, the store's default 1000; ``commit_every=1`` commits
  each complete step when it is written); a partial step is lost in a crash and at
  ``close``.
- The store's spec is fixed at creation. The store is created at the first
  ``add_samples`` with the tensors declared so far; a ``create_tensor`` after that
  rewrites the memory into a new store holding the new tensor too (NaN / zero for the
  rows already stored) and swaps the folders, keeping every stored row and the cursor.

Deliberate differences from skrl / rofunc (their behaviour in brackets):

- ``create_tensor`` never touches data already stored [it refills every floating tensor
  with NaN]. A tensor that exists with the same size and dtype returns False (skrl 2.0);
  another size or dtype raises ``ValueError``.
- A multi-row add (one env, ``n > 1`` rows) writes every tensor to the same rows, sets
  ``filled`` when it wraps, and takes any ``n`` [a second tensor lands on shifted rows,
  a wrap does not set ``filled``, ``n > 2 * memory_size - memory_index`` fails].
- A row's tensors not given to ``add_samples`` read NaN / zero [they keep stale data].
  Values are cast by :mod:`mmreplay.values`' rules, except that floats go into integer
  tensors truncated toward zero, as ``copy_`` stores them; NaN, infinities and values
  outside the integer range are refused [``copy_`` stores platform-dependent numbers].
  Only 0 / 1 numbers go into bool tensors [``copy_`` makes any nonzero True]. An add of
  all envs while a partial step is staged, or a partial add overflowing ``num_envs``,
  raises ``RuntimeError`` and changes nothing.
- ``tensors`` / ``tensors_view`` read each tensor as a copy [views of the storage]:
  write back with ``set_tensor_by_name``. Setting ``memory_index`` or ``filled``
  rewrites the memory so that every row keeps its data; with ``filled`` False the rows
  from ``memory_index`` on read unwritten, since a store holds only the steps before its
  cursor [they keep their data, out of reach of ``sample``].
- ``RandomMemory``'s ``replacement`` defaults to the installed skrl's default (without
  replacement since skrl 2.1, with it before).
- After a wrap, sequences (``sequence_length > 1``) follow each env's stream from its
  oldest row, across the physical end of the ring, and never join the newest and the
  oldest rows [they do]. The draws, the count of valid starts and, before a wrap, the
  indexes are the original's.
- ``sample_all`` / ``sample_by_index`` with ``mini_batches > 1`` split the indexes into
  exactly that many batches, dropping nothing (``numpy.array_split``) [``sample_all``
  drops the remainder]. An unknown name samples as ``None`` (skrl 2.0).
- ``get_tensor_by_name`` returns a copy; write back with ``set_tensor_by_name``, which
  sets the rows that hold steps (a row never written stays unwritten).
- ``reset`` also drops the retained data from the store (its rows read NaN / zero).
- ``save`` writes ``keep_dimensions`` tensors to csv as flat columns ``name.i`` [as
  list-valued cells under too few headers]; ``export_format="np"`` means npz [it fails
  at the first export]. ``load`` restores data *and* cursor for pt, npz and csv [pt and
  npz set unused attributes, csv does nothing or raises].
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import logging
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is an install extra
    raise ImportError("mmreplay.compat.skrl needs torch: pip install 'mmreplay[torch]'") from exc

from ..errors import SpecError, SpecMismatchError
from ..metadata import METADATA_FILE
from ..reads import sample as sample_store
from ..samplers.torch_rule import MemoryEmptyError, PhysicalRows, TorchDrawRule
from ..spec import ArraySpec
from ..store import DEFAULT_COMMIT_EVERY, Store, create
from ..store import open as open_store
from ..values import cast_refusal
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

__all__ = ["Memory", "RandomMemory", "MemoryEmptyError"]

log = logging.getLogger(__name__)

FORMATS = ("pt", "npz", "csv")


def skrl_replacement_default() -> bool:
    """The default of skrl's ``RandomMemory(replacement=...)`` for the installed skrl.

    skrl up to 2.0 samples with replacement by default, skrl 2.1 and later without; with
    no skrl installed the newest default (without) applies.
    """
    try:
        version = importlib.metadata.version("skrl")
    except importlib.metadata.PackageNotFoundError:
        return False
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and (int(found[1]), int(found[2])) < (2, 1)


def _numpy_dtype(dtype: torch.dtype, name: str) -> np.dtype:
    try:
        return torch.empty((), dtype=dtype).numpy().dtype
    except TypeError as exc:
        raise SpecError(
            f"tensor {name!r}: dtype {dtype} has no numpy equivalent and cannot be stored"
        ) from exc


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _fill_value(dtype: np.dtype) -> Any:
    """What an unwritten row reads as: NaN for floating tensors, zero / False otherwise."""
    return np.nan if dtype.kind in "fc" else 0


def _space_size(space: Any, keep_dimensions: bool) -> int | tuple[int, ...]:
    """Elements of a size given as an int, a sequence or a gymnasium space."""
    if isinstance(space, (int, float, np.integer)) and not isinstance(space, bool):
        return (int(space),) if keep_dimensions else int(space)
    if isinstance(space, (tuple, list)):
        dims = tuple(int(d) for d in space)
        return dims if keep_dimensions else math.prod(dims)
    if type(space).__module__.startswith("gymnasium"):
        from gymnasium import spaces  # only when a space is given

        if isinstance(space, spaces.Discrete):
            return (1,) if keep_dimensions else 1
        if isinstance(space, spaces.Box):
            return tuple(space.shape) if keep_dimensions else math.prod(space.shape)
        if isinstance(space, spaces.MultiDiscrete):
            return tuple(space.nvec.shape) if keep_dimensions else len(space.nvec)
        if isinstance(space, (spaces.Dict, spaces.Tuple)):
            if keep_dimensions:
                raise ValueError(f"keep_dimensions=True cannot be used with {type(space).__name__} spaces")
            subs = space.spaces.values() if isinstance(space, spaces.Dict) else space.spaces
            return sum(_space_size(s, False) for s in subs)  # type: ignore[misc]
        size = spaces.flatdim(space)
        return (size,) if keep_dimensions else size
    raise ValueError(f"Space type {type(space)} not supported")


class _Tensor:
    """A declared tensor: its per-row shape and dtypes."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype):
        self.shape = shape
        self.dtype = dtype
        self.torch_dtype = _torch_dtype(dtype)
        self.fill = _fill_value(dtype)

    @property
    def keep_dimensions(self) -> bool:
        return len(self.shape) != 1

    def spec(self) -> ArraySpec:
        return ArraySpec(self.shape, self.dtype)


class Memory(StoreShell):
    """skrl's ``Memory``: a circular buffer of named tensors ``(memory_size, num_envs, size)``.

    Args:
        memory_size: rows (steps) per env.
        num_envs: parallel environments.
        device: where outputs go (default ``cuda:0`` if available, else ``cpu``).
        export: save the memory each time it fills (wraps).
        export_format: ``"pt"``, ``"npz"`` (``"np"`` accepted for it) or ``"csv"``.
        export_directory: where exports go (``<dir>/memories/``).
        path: the buffer folder; reopened (tensors, data and cursor) if it exists.
            ``None`` keeps the data in a temporary folder removed on ``close()`` or
            when the memory is garbage-collected.
        backend, compression, durability: as :func:`mmreplay.create`.
        commit_every: complete steps per commit (1: each is durable when written); a
            reopened memory keeps the value it was created with.
        sampler, alpha: ``sampler="prioritized"`` (with its ``alpha``) makes
            :meth:`RandomMemory.sample` draw by priority through the store's sampler
            (``sampling_info`` then holds each item's importance weight); new priorities
            go in with :meth:`update_priorities`. Recorded in the store: a reopened memory
            keeps them. A ``create_tensor`` that rebuilds the store starts every priority
            at the maximum again.

    Raises:
        ValueError: an unsupported ``export_format``.
        mmreplay.SpecMismatchError: a memory of another size or number of envs exists
            at ``path``.

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
        self.memory_size = int(memory_size)
        self.num_envs = int(num_envs)
        if device is None:
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.export = bool(export)
        self.export_format = fmt
        self.export_directory = export_directory
        self.sampling_indexes: torch.Tensor | None = None
        self.sampling_info: Any = None  # the store's SampleInfo of the last sample (weights...)
        M, E = self.memory_size, self.num_envs
        self.all_sequence_indexes = np.concatenate([np.arange(i, M * E + i, E) for i in range(E)])
        self._options = {
            "backend": backend,
            "compression": compression,
            "commit_every": commit_every,
            "durability": durability,
            "sampler": sampler,
            **({} if alpha is None else {"alpha": alpha}),
        }
        self._tensors: dict[str, _Tensor] = {}
        self._rows = PhysicalRows(self.memory_size, self.num_envs)  # cursor and row <-> step
        self._path = None if path is None else os.fspath(path)
        self._temp = temporary(self) if path is None else None
        if self._path is not None:
            _finish_swap(self._path)
            if os.path.exists(os.path.join(self._path, METADATA_FILE)):
                self._attach(open_store(self._path, "a"))

    # --- the store ------------------------------------------------------------------

    @property
    def store(self) -> Store | None:
        """The store holding the memory (None until the first ``add_samples``)."""
        return self._rows.store

    @store.setter
    def store(self, store: Store | None) -> None:
        self._rows.store = store

    def _ahead(self) -> dict[str, np.ndarray]:
        """The next step's rows as written ahead (envs from ``env_index`` on read unwritten)."""
        store = self.store
        if not self._rows.env_index or store is None:
            return {
                name: np.full((self.num_envs, *t.shape), t.fill, t.dtype) for name, t in self._tensors.items()
            }
        return {name: a[0] for name, a in zip(store.leaf_paths, store.read_steps([store.total_steps]))}

    def _write_ahead(self, step: dict[str, np.ndarray], env_index: int) -> None:
        """Keep envs ``0..env_index-1`` of the next step in the store's next slot."""
        self._ensure_store().write_next(step)
        self._rows.env_index = env_index

    def _attach(self, store: Store) -> None:
        """Adopt an opened store: check its size, take its tensors and cursor."""
        problems = []
        if store.num_envs != self.num_envs:
            problems.append(f"num_envs: existing {store.num_envs} vs new {self.num_envs}")
        if store.capacity != ring_capacity(self.memory_size, store.metadata.commit_every):
            problems.append(f"memory_size: existing {window_of(store)} vs new {self.memory_size}")
        if not isinstance(store.spec, dict) or not all(isinstance(v, ArraySpec) for v in store.spec.values()):
            problems.append("its spec is not a flat dict of tensors")
        if problems:
            where = store.path
            store.close()
            raise SpecMismatchError(f"{where}: a different memory exists there ({'; '.join(problems)})")
        self.store = store
        if self._temp is not None:
            self._temp.store = store
        self._rows.origin = read_origin(store)
        recorded = store.sampler.state_json()  # a rebuilt store keeps the sampler it had
        self._options = {k: v for k, v in self._options.items() if k not in ("sampler", "alpha")}
        self._options["sampler"] = recorded.pop("name")
        self._options.update(recorded)
        for name, spec in store.spec.items():
            self._tensors[name] = _Tensor(spec.shape, spec.dtype)

    def _store_path(self) -> str:
        if self._path is not None:
            return self._path
        return os.path.join(self._temp.folder, "buffer")  # type: ignore[union-attr]

    def _create_store(self, path: str) -> Store:
        spec = {name: t.spec() for name, t in self._tensors.items()}
        capacity = ring_capacity(self.memory_size, self._options["commit_every"])
        store = create(path, spec, capacity, self.num_envs, roles=lenient_roles(spec), **self._options)
        return store

    def _ensure_store(self) -> Store:
        if self.store is None:
            if not self._tensors:
                raise RuntimeError("the memory has no tensors: call create_tensor() before add_samples()")
            self.store = self._create_store(self._store_path())
            if self._temp is not None:
                self._temp.store = self.store
        return self.store

    # --- cursor ---------------------------------------------------------------------

    @property
    def _steps(self) -> int:
        """Complete steps since the origin (the last reset)."""
        return self._rows.steps

    @property
    def memory_index(self) -> int:
        """The row the next step goes to. Settable, as in skrl: see :meth:`_move_cursor`."""
        return self._rows.memory_index

    @memory_index.setter
    def memory_index(self, value: int) -> None:
        self._move_cursor(_index("memory_index", value, self.memory_size), self.filled)

    @property
    def env_index(self) -> int:
        """The env of the current step the next partial add goes to. Settable, as in skrl:
        envs before it (their values in the row now) count as added, written ahead."""
        return self._rows.env_index

    @env_index.setter
    def env_index(self, value: int) -> None:
        index = _index("env_index", value, self.num_envs)
        if index == 0:
            self._rows.env_index = 0
            return
        names = self.get_tensor_names()
        row = self._physical(names)
        self._write_ahead({name: row[name][self.memory_index] for name in names}, index)

    @property
    def filled(self) -> bool:
        """Whether every row holds a step. Settable, as in skrl: see :meth:`_move_cursor`."""
        return self._rows.filled

    @filled.setter
    def filled(self, value: bool) -> None:
        self._move_cursor(self.memory_index, bool(value))

    def _move_cursor(self, index: int, filled: bool) -> None:
        """Make ``memory_index`` / ``filled`` what skrl's assignments make them: every row
        keeps what it reads now and the next step goes to row ``index``.

        The store holds the steps before its cursor, so the memory is rewritten: filled,
        rows ``index, ..., memory_size - 1, 0, ..., index - 1`` become its steps, oldest
        first (rows never written count, reading NaN / zero); not filled, rows ``0, ...,
        index - 1``, and the rows from ``index`` on read unwritten. ``env_index`` is kept,
        its envs written ahead from the new current row. Committed at once.
        """
        if (index, filled) == (self.memory_index, self.filled):
            return
        names = self.get_tensor_names()
        if not names:
            raise RuntimeError("the memory has no tensors: call create_tensor() before moving its cursor")
        M, env_index = self.memory_size, self._rows.env_index
        full = self._physical(names)
        order = np.r_[index:M, 0:index] if filled else np.arange(index)
        self._refill({name: full[name][order] for name in names}, len(order), None)
        if filled and index:
            store = self._ensure_store()
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
        """skrl's ``tensors``: each tensor ``(memory_size, num_envs, *size)`` by name, read
        as a copy (write back with :meth:`set_tensor_by_name`)."""
        return _TensorCopies(self, keepdim=True)

    @property
    def tensors_view(self) -> Mapping[str, torch.Tensor]:
        """skrl's ``tensors_view``: each tensor ``(memory_size * num_envs, *size)`` by
        name, read as a copy (write back with :meth:`set_tensor_by_name`)."""
        return _TensorCopies(self, keepdim=False)

    def create_tensor(
        self,
        name: str,
        size: Any,
        dtype: torch.dtype | None = None,
        keep_dimensions: bool = False,
    ) -> bool:
        """Declare a tensor ``(memory_size, num_envs, size)`` (or ``(..., *size)`` with
        ``keep_dimensions``). ``size``: an int, a sequence (its product), or a gymnasium
        space (Box: product of the shape; Discrete: 1; MultiDiscrete: ``len(nvec)``;
        Dict / Tuple: the sum of their parts).

        Returns:
            True if created; False if ``size`` is None or the tensor exists with the
            same size and dtype.

        Raises:
            ValueError: the tensor exists with another size or dtype.
        """
        if size is None:
            return False
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"tensor name must be a Python identifier, got {name!r}")
        dims = _space_size(size, keep_dimensions)
        shape = dims if isinstance(dims, tuple) else (int(dims),)
        if any(d < 1 for d in shape):
            raise ValueError(f"tensor {name!r}: size {size!r} holds no elements")
        existing = self._tensors.get(name)
        if existing is not None:
            if math.prod(existing.shape) != math.prod(shape) or (keep_dimensions and existing.shape != shape):
                raise ValueError(
                    f"Size of tensor {name} ({shape}) doesn't match the existing one ({existing.shape})"
                )
            if dtype is not None and existing.torch_dtype != dtype:
                raise ValueError(
                    f"Dtype of tensor {name} ({dtype}) doesn't match the existing one ({existing.torch_dtype})"
                )
            return False
        np_dtype = _numpy_dtype(torch.get_default_dtype() if dtype is None else dtype, name)
        tensor = _Tensor(shape, np_dtype)
        ArraySpec(shape, np_dtype)  # refuse an unstorable dtype before anything changes
        self._tensors[name] = tensor
        if self.store is not None:
            try:
                self._migrate(name)
            except BaseException:
                del self._tensors[name]
                raise
        return True

    def _migrate(self, added: str) -> None:
        """Rewrite the memory into a new store with the current tensors (``added`` is
        new), then swap folders; the rows written ahead go along.

        The new store is complete before the old one is touched; a crash at any point
        leaves one whole memory at the path (finished by :func:`_finish_swap` on reopen).
        """
        old = self.store
        assert old is not None
        old.commit()
        ahead, env_index = None, self._rows.env_index
        if env_index:
            ahead = {name: a[0] for name, a in zip(old.leaf_paths, old.read_steps([old.total_steps]))}
            t = self._tensors[added]
            ahead[added] = np.full((self.num_envs, *t.shape), t.fill, t.dtype)
        path = self._store_path()
        building, replaced = _swap_names(path)
        if os.path.exists(building):
            shutil.rmtree(building)
        lo, hi = self._window()
        steps = self._steps
        # Keep the cursor phase: the copy's step count is congruent to the old one.
        kept = steps if steps < self.memory_size else self.memory_size + steps % self.memory_size
        new = self._create_store(building)
        try:
            block = max(1, (32 << 20) // max(1, _step_bytes(self._tensors, self.num_envs)))
            for a in range(lo, hi, block):
                b = min(hi, a + block)
                leaves = dict(zip(old.leaf_paths, old.read_steps(np.arange(a, b))))
                new.extend(
                    {
                        name: leaves[name]
                        if name in leaves
                        else np.full((b - a, self.num_envs, *t.shape), t.fill, t.dtype)
                        for name, t in self._tensors.items()
                    }
                )
            write_origin(new, (hi - lo) - kept)
        finally:
            new.close()
        old.close()
        os.rename(path, replaced)
        os.rename(building, path)
        shutil.rmtree(replaced, ignore_errors=True)
        self.store = None
        self._rows.env_index = 0
        self._attach(open_store(path, "a"))
        if ahead is not None:
            self._write_ahead(ahead, env_index)

    def get_tensor_by_name(self, name: str, keepdim: bool = True) -> torch.Tensor:
        """A copy of the tensor: ``(memory_size, num_envs, *size)``, or
        ``(memory_size * num_envs, *size)`` without ``keepdim``.

        Raises:
            KeyError: no such tensor.
        """
        t = self._tensors[name]
        full = self._physical([name])[name]
        if not keepdim:
            full = full.reshape(-1, *t.shape)
        return self._out(full)

    def set_tensor_by_name(self, name: str, tensor: Any) -> None:
        """Overwrite the tensor (broadcast to ``(memory_size, num_envs, *size)``).

        Rows holding stored steps are rewritten (durable at the next commit, made here);
        rows of a partial step are written ahead again; rows never written stay so.

        Raises:
            KeyError: no such tensor.
        """
        t = self._tensors[name]
        M, E = self.memory_size, self.num_envs
        value = self._as_array(name, tensor, (M, E, *t.shape))
        if self.store is None:
            return
        if self._rows.env_index:
            ahead = self._ahead()
            ahead[name][: self._rows.env_index] = value[self.memory_index, : self._rows.env_index]
            self._write_ahead(ahead, self._rows.env_index)
        store = self.store
        store.commit()
        rows = np.arange(M)
        steps, valid = self._rows.steps_of_rows(rows)
        if not valid.any():
            return
        steps, rows = steps[valid], rows[valid]
        leaves = dict(zip(store.leaf_paths, store.read_steps(steps)))
        leaves[name] = value[rows]
        store.set(steps - store.first_step, leaves)
        store.commit()

    # --- writes ---------------------------------------------------------------------

    def reset(self) -> None:
        """Empty the memory: cursor to 0, not filled; stored steps are dropped."""
        self._rows.env_index = 0
        if self.store is not None:
            self.store.commit()
            origin = self.store.total_steps
            write_origin(self.store, origin)  # first: a crash before the clear shows an empty memory
            self._rows.origin = origin
            self.store.clear()

    def add_samples(self, **tensors: Any) -> None:
        """Record samples: each tensor ``(num_envs, *size)`` (one step of all envs),
        ``(n, *size)`` with ``n < num_envs`` (the next ``n`` envs of the step), ``(*size)``
        (the next env), or with one env ``(n, *size)`` (``n`` steps). Unknown names and
        ``None`` values are skipped; the kind of add is read from ``observations`` (or
        ``states``, else the first tensor).

        Raises:
            ValueError: no tensors, or shapes that fit none of the kinds above; a value
                that cannot be stored in its tensor.
            RuntimeError: envs beyond ``num_envs`` in a step.
        """
        if not tensors:
            raise ValueError(
                "No samples to be recorded in memory. Pass samples as key-value arguments (where key is the tensor name)"
            )
        given = {k: v for k, v in tensors.items() if v is not None}
        if not given:
            raise ValueError("every sample given to add_samples is None")
        ref_name = next((k for k in ("observations", "states") if k in given), next(iter(given)))
        ref_shape = tuple(given[ref_name].shape)
        ref = self._tensors.get(ref_name)
        lead = len(ref_shape) - (len(ref.shape) if ref is not None else 1)
        E, ei = self.num_envs, self._rows.env_index
        known = {k: v for k, v in given.items() if k in self._tensors}
        if lead == 1 and ref_shape[0] == E:
            if ei:
                raise RuntimeError(
                    f"a step of all {E} envs was added while envs 0..{ei - 1} of the current step are staged; "
                    f"add the remaining {E - ei} envs first"
                )
            kind, n = "step", E
        elif lead == 1 and ref_shape[0] < E:
            kind, n = "envs", ref_shape[0]
        elif lead == 1 and E == 1:
            kind, n = "rows", ref_shape[0]
        elif lead == 0:
            kind, n = "envs", 1
        else:
            raise ValueError(f"Expected shape (number of environments = {E}, data size), got {ref_shape}")
        if kind == "envs" and ei + n > E:
            raise RuntimeError(f"{n} envs added at env index {ei} overflow num_envs={E}; nothing was added")
        arrays = {
            name: self._as_array(name, value, (n, *self._tensors[name].shape)) if lead else
            self._as_array(name, value, self._tensors[name].shape)[None]
            for name, value in known.items()
        }  # fmt: skip
        store = self._ensure_store()
        before = self._steps
        if kind == "step":
            store.add(self._complete({name: a for name, a in arrays.items()}, E))
        elif kind == "rows":
            store.extend(self._complete({name: a[:, None] for name, a in arrays.items()}, E, lead=(n,)))
        else:
            step = self._ahead()
            for name, a in arrays.items():
                step[name][ei : ei + n] = a
            if ei + n == E:
                store.add(step)
                self._rows.env_index = 0
            else:
                self._write_ahead(step, ei + n)
        if self.export and self._steps // self.memory_size > before // self.memory_size:
            self.save(self.export_directory, self.export_format)

    def _complete(
        self, arrays: dict[str, np.ndarray], E: int, lead: tuple[int, ...] = ()
    ) -> dict[str, np.ndarray]:
        """A whole step (or steps): tensors not given read as unwritten (NaN / zero)."""
        out = {}
        for name, t in self._tensors.items():
            a = arrays.get(name)
            out[name] = a if a is not None else np.full((*lead, E, *t.shape), t.fill, t.dtype)
        return out

    def _as_array(self, name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
        """``value`` as a numpy array of ``shape`` in the tensor's dtype, or ValueError."""
        t = self._tensors[name]
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.dtype == torch.bfloat16:
                value = value.float()
            value = value.cpu().numpy()
        a = np.asarray(value)
        if a.dtype == t.dtype and a.shape == shape:
            return a
        if a.dtype.kind not in "biufc":
            raise ValueError(f"tensor {name!r}: expected numbers, got {a.dtype} values")
        if t.dtype == np.bool_ and a.dtype.kind in "iuf" and np.isin(a, (0, 1)).all():
            a = a.astype(bool)  # 0 / 1 flags (uint8 dones, float masks) into a bool tensor
        elif t.dtype.kind in "iu" and a.dtype.kind == "f":
            a = _truncated(name, a, t.dtype)
        why = cast_refusal(a, t.dtype)
        if why is not None:
            raise ValueError(f"tensor {name!r}: {why} (tensor dtype {t.dtype}, got {a.dtype})")
        try:
            return np.broadcast_to(a, shape).astype(t.dtype, copy=False)
        except ValueError:
            raise ValueError(f"tensor {name!r}: expected shape {shape}, got {a.shape}") from None

    # --- reads ----------------------------------------------------------------------

    def _window(self) -> tuple[int, int]:
        """Global step ids ``[lo, hi)`` of the complete steps the memory shows."""
        return self._rows.window()

    def _gather(self, names: Sequence[str], flat: np.ndarray) -> dict[str, np.ndarray]:
        """Rows at flat physical indexes ``row * num_envs + env``, per name."""
        steps, envs, holds = self._rows.locate(flat)
        store = self.store
        ahead = None
        if self._rows.env_index:
            ahead = holds & (steps == store.total_steps)  # type: ignore[union-attr]
            holds = holds & ~ahead
        if holds.size and holds.all() and names:  # the common case: every row is a stored one
            by_name = dict(zip(store.leaf_paths, read_rows(store, steps, envs)))  # type: ignore[union-attr,arg-type]
            return {name: by_name[name] for name in names}
        out = self._unwritten(names, flat.shape)
        if holds.any():
            by_name = dict(zip(store.leaf_paths, read_rows(store, steps[holds], envs[holds])))  # type: ignore[union-attr,arg-type]
            for name in names:
                out[name][holds] = by_name[name]
        if ahead is not None and ahead.any():
            row = self._ahead()
            for name in names:
                out[name][ahead] = row[name][envs[ahead]]
        return out

    def _unwritten(self, names: Sequence[str], lead: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {
            name: np.full(
                (*lead, *self._tensors[name].shape), self._tensors[name].fill, self._tensors[name].dtype
            )
            for name in names
        }

    def _physical(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """Whole tensors ``(memory_size, num_envs, *size)`` in physical row order."""
        out = self._unwritten(names, (self.memory_size, self.num_envs))
        rows = np.arange(self.memory_size)
        steps, valid = self._rows.steps_of_rows(rows)
        if valid.any():
            by_name = dict(zip(self.store.leaf_paths, self.store.read_steps(steps[valid])))  # type: ignore[union-attr]
            for name in names:
                out[name][rows[valid]] = by_name[name]
        if self._rows.env_index:
            row = self._ahead()
            for name in names:
                out[name][self.memory_index, : self._rows.env_index] = row[name][: self._rows.env_index]
        return out

    def _out(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _flat_indexes(self, indexes: Any) -> np.ndarray:
        if isinstance(indexes, torch.Tensor):
            indexes = indexes.detach().cpu().numpy()
        idx = np.asarray(indexes)
        if idx.size == 0:
            return idx.astype(np.int64).reshape(-1)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"indexes must be integers, got {idx.dtype}")
        n = self.memory_size * self.num_envs
        if idx.min() < -n or idx.max() >= n:
            raise IndexError(f"index out of range for a memory of {n} rows")
        return np.mod(idx.astype(np.int64), n)

    def sample(
        self, names: Sequence[str], batch_size: int, mini_batches: int = 1, sequence_length: int = 1
    ) -> list[list[torch.Tensor | None]]:
        """Implemented by :class:`RandomMemory`."""
        raise NotImplementedError("The sampling method (.sample()) is not implemented")

    def sample_by_index(
        self, names: Sequence[str], indexes: Any, mini_batches: int = 1
    ) -> list[list[torch.Tensor | None]]:
        """Rows at flat physical indexes, split into ``mini_batches`` batches; ``None`` for
        an unknown name."""
        flat = self._flat_indexes(indexes)
        batches = np.array_split(flat, mini_batches) if mini_batches > 1 else [flat]
        known = [n for n in names if n in self._tensors]
        out = []
        for batch in batches:
            got = self._gather(known, batch)
            out.append([self._out(got[n]) if n in got else None for n in names])
        return out

    def sample_all(
        self, names: Sequence[str], mini_batches: int = 1, sequence_length: int = 1
    ) -> list[list[torch.Tensor | None]]:
        """Every row (``memory_size * num_envs``) in physical order, or env by env with
        ``sequence_length > 1``; rows never written read NaN / zero."""
        M, E = self.memory_size, self.num_envs
        known = [n for n in names if n in self._tensors]
        full = self._physical(known)
        order = self.all_sequence_indexes if sequence_length > 1 else None
        views = {n: full[n].reshape(M * E, *self._tensors[n].shape) for n in known}
        if order is not None:
            views = {n: v[order] for n, v in views.items()}
        parts = np.array_split(np.arange(M * E), mini_batches) if mini_batches > 1 else [slice(None)]
        return [[self._out(views[n][p]) if n in views else None for n in names] for p in parts]

    def update_priorities(self, indexes: Any, priorities: Any) -> int:
        """New priorities for rows at flat physical indexes (such as
        :meth:`get_sampling_indexes`; for sequences, the index of each sequence's first
        row), for a memory created with ``sampler="prioritized"``. Rows the ring has
        overwritten since they were sampled are skipped; returns how many were applied."""
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
        """Write the memory to ``<directory>/memories/<time>_memory_<id>.<format>``.

        ``pt``: ``torch.save`` of ``{name: (memory_size, num_envs, *size)}``; ``npz``: the
        same arrays (no pickle); ``csv``: a header ``name.i`` (names sorted, ``i`` the
        flat element index) and the first ``len(memory)`` rows in physical order.

        Returns:
            The file's path.
        """
        fmt = "npz" if format == "np" else format
        if fmt not in FORMATS:
            raise ValueError(f"Unsupported format: {format}. Available formats: pt, csv, npz")
        directory = directory or self.export_directory
        os.makedirs(os.path.join(directory, "memories"), exist_ok=True)
        stamp = datetime.datetime.now().strftime("%y-%m-%d_%H-%M-%S-%f")
        path = os.path.join(directory, "memories", f"{stamp}_memory_{hex(id(self))}.{fmt}")
        names = self.get_tensor_names()
        full = self._physical(names)
        if fmt == "pt":
            torch.save({n: self._out(full[n]) for n in names}, path)
        elif fmt == "npz":
            np.savez(path, **full)
        else:
            M, E = self.memory_size, self.num_envs
            views = {n: full[n].reshape(M * E, -1) for n in names}
            with open(path, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow([f"{n}.{i}" for n in names for i in range(views[n].shape[1])])
                for i in range(len(self)):
                    writer.writerow([x for n in names for x in views[n][i].tolist()])
        return path

    def load(self, path: str) -> None:
        """Replace the memory's contents (and cursor) with a file :meth:`save` wrote.

        ``pt`` (``weights_only``) and ``npz`` (no pickle) hold whole tensors: rows up to
        the last one holding any non-NaN value are loaded as steps in physical order, so
        a memory saved before it filled resumes at its cursor and a full one resumes
        filled at row 0. ``csv`` holds ``len(memory)`` rows: complete steps are stored
        and a trailing partial step is written ahead. Tensors in the file that the memory
        lacks are created; tensors the file lacks read NaN / zero.

        Raises:
            ValueError: an unknown extension, or tensors of another memory size or
                number of envs.
        """
        path = os.fspath(path)
        if path.endswith(".pt"):
            data = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a dict of tensors, got {type(data).__name__}")
            arrays = {
                str(k): (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in data.items()
            }
            self._load_tensors(arrays, path)
        elif path.endswith(".npz"):
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in data.files}
            self._load_tensors(arrays, path)
        elif path.endswith(".csv"):
            self._load_csv(path)
        else:
            raise ValueError(f"Unsupported format: {path}")

    def _load_tensors(self, arrays: dict[str, np.ndarray], path: str) -> None:
        M, E = self.memory_size, self.num_envs
        for name, a in arrays.items():
            if a.ndim < 3 or a.shape[:2] != (M, E):
                raise ValueError(f"{path}: tensor {name!r} has shape {a.shape}, expected ({M}, {E}, ...)")
        self._declare({name: (a.shape[2:], a.dtype) for name, a in arrays.items()}, path)
        written = np.zeros(M, bool)
        floats = [a for a in arrays.values() if a.dtype.kind in "fc"]
        if floats:
            for a in floats:
                written |= ~np.isnan(a.reshape(M, -1)).all(axis=1)
        else:
            written[:] = True
        n = int(np.flatnonzero(written)[-1]) + 1 if written.any() else 0
        self._refill({name: a[:n] for name, a in arrays.items()}, n, None)

    def _load_csv(self, path: str) -> None:
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            rows = [row for row in reader if row]
        columns: dict[str, list[int]] = {}
        for i, head in enumerate(header):
            name, _, index = head.rpartition(".")
            if not name or not index.isdigit():
                raise ValueError(f"{path}: column {head!r} is not of the form name.i")
            columns.setdefault(name, []).append(i)
        M, E = self.memory_size, self.num_envs
        if len(rows) > M * E:
            raise ValueError(f"{path}: {len(rows)} rows, more than memory_size * num_envs = {M * E}")
        values = np.array([[_cell(c) for c in row] for row in rows], np.float64).reshape(
            len(rows), len(header)
        )
        shapes = {}
        for name, cols in columns.items():
            t = self._tensors.get(name)
            shapes[name] = (
                t.shape if t is not None and math.prod(t.shape) == len(cols) else (len(cols),),
                None,
            )
        self._declare(shapes, path)
        n_steps, partial = divmod(len(rows), E)
        arrays = {}
        for name, cols in columns.items():
            t = self._tensors[name]
            flat = values[:, cols].reshape(len(rows), *t.shape)
            arrays[name] = flat.astype(t.dtype)
        steps = {name: a[: n_steps * E].reshape(n_steps, E, *a.shape[1:]) for name, a in arrays.items()}
        tail = {name: a[n_steps * E :] for name, a in arrays.items()} if partial else None
        self._refill(steps, n_steps, tail)

    def _declare(self, found: dict[str, tuple[tuple[int, ...], Any]], path: str) -> None:
        """Create the tensors a file holds and the memory lacks (dtype None: the default)."""
        for name, (shape, dtype) in found.items():
            t = self._tensors.get(name)
            if t is not None:
                if math.prod(t.shape) != math.prod(shape):
                    raise ValueError(f"{path}: tensor {name!r} has size {shape}, the memory's is {t.shape}")
                continue
            torch_dtype = None if dtype is None else _torch_dtype(np.dtype(dtype))
            self.create_tensor(name, tuple(shape) or (1,), torch_dtype, keep_dimensions=True)

    def _refill(self, steps: dict[str, np.ndarray], n: int, tail: dict[str, np.ndarray] | None) -> None:
        """Empty the memory, then write ``n`` steps and stage a partial one."""
        self.reset()
        store = self._ensure_store()
        if n:
            store.extend(self._complete(
                {name: a.reshape(n, self.num_envs, *self._tensors[name].shape).astype(self._tensors[name].dtype)
                 for name, a in steps.items()}, self.num_envs, lead=(n,)))  # fmt: skip
        store.commit()
        if tail:
            k = len(next(iter(tail.values())))
            step = self._ahead()
            for name, a in tail.items():
                step[name][:k] = a.reshape(k, *self._tensors[name].shape)
            self._write_ahead(step, k)

    # --- life cycle -----------------------------------------------------------------

    def close(self) -> None:
        """Commit and release the store (a temporary one is deleted). Safe twice.

        A partial step (fewer than ``num_envs`` envs added) is not committed.
        """
        if self._rows.env_index and self.store is not None and not self.store.closed:
            log.warning(
                "%s: closing with envs 0..%d of a step staged; they are not written",
                self.store.path,
                self._rows.env_index - 1,
            )
        super().close()

    def __repr__(self) -> str:
        where = self._store_path()
        return (
            f"<mmreplay.compat.skrl.{type(self).__name__} memory_size={self.memory_size} "
            f"num_envs={self.num_envs} len={len(self) if self.store is None or not self.store.closed else '?'} "
            f"tensors={self.get_tensor_names()} path={where!r}>"
        )


class RandomMemory(Memory):
    """skrl's ``RandomMemory``: uniform random batches, with or without replacement.

    Args:
        replacement: draw with replacement (the batch size is always met); without,
            at most ``len(memory)`` distinct rows (or sequence starts) are returned.
            None: the installed skrl's default (:func:`skrl_replacement_default`:
            without replacement since skrl 2.1, with it before); with replacement
            for ``sampler="prioritized"``, which draws only so.
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
            uniform = self._options.get("sampler") in (None, "uniform")
            replacement = skrl_replacement_default() if uniform else True
        self._replacement = bool(replacement)
        self._rule = TorchDrawRule(self._rows)

    def sample(
        self, names: Sequence[str], batch_size: int, mini_batches: int = 1, sequence_length: int = 1
    ) -> list[list[torch.Tensor | None]]:
        """A random batch: ``[[tensor per name] per mini-batch]``, each ``(batch_size *
        sequence_length, *size)``; a sequence is one env's consecutive rows.

        Drawn with skrl's torch calls (the indexes of skrl under ``torch.manual_seed``),
        or by priority for a memory created with ``sampler="prioritized"`` (complete
        steps only: the envs of a partial step are not drawn); the rows are read
        through the store's fetch path.

        Raises:
            MemoryEmptyError: with replacement, nothing (or no whole sequence) to draw.
        """
        if self.store is None:  # nothing added yet: skrl's draw raises or gives no rows
            draw = self._rows.draw(batch_size, sequence_length, self._replacement)
            self.sampling_indexes, self.sampling_info = draw, None
            return self.sample_by_index(names, draw, mini_batches)
        lo, hi = self._window()
        uniform = self.store.sampler.name == "uniform"  # else the store's own (prioritized...)
        nest, info = sample_store(
            self.store,  # type: ignore[arg-type]
            batch_size,
            None if sequence_length == 1 else sequence_length,
            self._replacement,
            return_info=True,
            window=(lo, hi),
            sampler=self._rule if uniform else None,
        )
        if uniform:
            self.sampling_indexes = self._rule.last_indexes
        else:
            rows = (info.step - self._rows.origin)[:, None] + np.arange(sequence_length)
            flat = (rows % self.memory_size) * self.num_envs + info.env[:, None]
            self.sampling_indexes = torch.from_numpy(flat.reshape(-1))
        self.sampling_info = info
        return self._batches(names, nest, mini_batches)

    def _batches(
        self, names: Sequence[str], nest: dict[str, np.ndarray], mini_batches: int
    ) -> list[list[torch.Tensor | None]]:
        """Rows of a store batch as skrl's ``[[tensor per name] per mini-batch]``
        (sequences flattened into ``batch * sequence_length`` rows)."""
        flat = {n: a.reshape(-1, *self._tensors[n].shape) for n, a in nest.items() if n in self._tensors}
        count = next(iter(flat.values())).shape[0] if flat else 0
        parts = np.array_split(np.arange(count), mini_batches) if mini_batches > 1 else [slice(None)]
        return [[self._out(flat[n][p]) if n in flat else None for n in names] for p in parts]


class _TensorCopies(Mapping):
    """``memory.tensors`` / ``memory.tensors_view``: the tensors by name, each read as a copy."""

    def __init__(self, memory: Memory, keepdim: bool):
        self._memory = memory
        self._keepdim = keepdim

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._memory.get_tensor_by_name(name, self._keepdim)

    def __contains__(self, name: object) -> bool:
        return name in self._memory._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._memory.get_tensor_names())

    def __len__(self) -> int:
        return len(self._memory._tensors)


def _index(name: str, value: Any, bound: int) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < bound:
        raise ValueError(f"{name} must be an int in [0, {bound}), got {value!r}")
    return int(value)


def _truncated(name: str, a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Floats for an integer tensor, truncated toward zero as torch's ``copy_`` stores them.

    NaN, infinities and values outside the dtype's range have no defined result in torch
    (they depend on the platform) and are refused.
    """
    whole = np.trunc(a)
    info = np.iinfo(dtype)
    bad = ~np.isfinite(whole) | (whole < info.min) | (whole > info.max)
    if bad.any():
        raise ValueError(
            f"tensor {name!r}: {a[bad].flat[0]!r} cannot be stored in a {dtype} tensor "
            f"(integer tensors take finite values in [{info.min}, {info.max}], truncated)"
        )
    return whole.astype(dtype)


def _step_bytes(tensors: dict[str, _Tensor], num_envs: int) -> int:
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in tensors.values()) * num_envs


def _cell(text: str) -> float:
    if text == "True":
        return 1.0
    if text == "False":
        return 0.0
    return float(text)


def _swap_names(path: str) -> tuple[str, str]:
    """Sibling folders of a migration: the new memory being built, the old one set aside."""
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.migrating"), os.path.join(parent, f".{base}.replaced")


def _finish_swap(path: str) -> None:
    """Complete or undo a migration a crash interrupted, so one whole memory is at ``path``."""
    building, replaced = _swap_names(path)
    if os.path.exists(replaced):
        if not os.path.exists(path):
            # Both renames pending or the second one: the new memory is complete if present.
            os.rename(building if os.path.exists(building) else replaced, path)
        shutil.rmtree(replaced, ignore_errors=True)
    if os.path.exists(building):
        shutil.rmtree(building, ignore_errors=True)  # an unfinished copy; the old memory is intact
