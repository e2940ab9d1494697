"""The replay buffers compared, each behind the same small adapter.

Every adapter stores the same data (a workload's leaves, ``[T, num_envs, *shape]``) the
way that library's users store it: data is converted to the library's native objects
outside the timed region (a collector hands TorchRL TensorDicts, SB3 numpy arrays), so
the figures measure the buffer, not the conversion. A step holds ``num_envs`` rows.

Checkpoint and reopen use each library's own way to persist: mmreplay commits and
reopens its folder; TorchRL ``dumps`` / ``loads`` with the storage's ``scratch_dir``
inside the checkpoint folder (no copy); cpprb ``save_transitions`` / ``load_transitions``
(its ``mmap_prefix`` files are recreated empty on construction, so they cannot be
reopened); SB3 pickles the buffer (``save_to_pkl`` / ``load_from_pkl``); the numpy
baseline saves one ``.npy`` per leaf and loads them back into RAM.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from typing import Any

import numpy as np

import mmreplay as mr

from .data import Workload, du, nest_from_flat

__all__ = ["System", "SYSTEMS", "Unsupported", "available", "version"]


class Unsupported(Exception):
    """The library has no way to do this (the figure is reported as n/a, with the reason)."""


class System:
    """One replay buffer under test; ``folder`` is its own empty folder."""

    name = ""
    modules: tuple[str, ...] = ()  # import names it needs
    packages: tuple[str, ...] = ()  # distribution names whose versions are reported
    persistent = True
    notes: dict[str, str] = {}

    def __init__(self, folder: str, workload: Workload, capacity: int):
        self.folder = folder
        self.workload = workload
        self.capacity = capacity  # steps
        self.num_envs = workload.num_envs

    # native data, built outside the timed regions
    def native_step(self, data: dict[str, np.ndarray], t: int) -> Any:
        return {p: np.ascontiguousarray(v[t]) for p, v in data.items()}

    def native_block(self, data: dict[str, np.ndarray], a: int, b: int) -> Any:
        return {p: v[a:b] for p, v in data.items()}

    def add(self, step: Any) -> None:
        raise NotImplementedError

    def extend(self, block: Any) -> None:
        raise NotImplementedError

    def checkpoint(self) -> None:
        raise NotImplementedError

    def drop(self) -> None:
        """Release the in-memory buffer (before a reopen; not timed)."""
        raise NotImplementedError

    def reopen(self) -> None:
        """Load the checkpoint back into a usable buffer (timed)."""
        raise NotImplementedError

    def sample(self, batch_size: int, rng: np.random.Generator) -> Any:
        raise NotImplementedError

    def sample_sequences(self, batch_size: int, num_steps: int, rng: np.random.Generator) -> Any:
        raise Unsupported("no sequence sampling")

    def disk_bytes(self) -> int:
        return du(self.folder)

    def rows(self) -> int:
        """Rows the buffer holds now (checks that a reopen brought the data back)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def available(system: type[System]) -> list[str]:
    """Import names the system needs that are not installed."""
    return [m for m in system.modules if importlib.util.find_spec(m) is None]


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- numpy in RAM: the limit when the data is cached ------------------------------------


class NumpyRAM(System):
    name = "numpy (RAM)"
    packages = ("numpy",)
    persistent = False

    def __init__(self, folder: str, workload: Workload, capacity: int):
        super().__init__(folder, workload, capacity)
        self._alloc()
        self.count = 0

    def _alloc(self) -> None:
        e = self.num_envs
        self.arrays = {p: np.zeros((self.capacity, e, *s.shape), s.dtype) for p, s in self.workload.leaves}
        self.items = list(self.arrays.items())

    def add(self, step: dict[str, np.ndarray]) -> None:
        slot = self.count % self.capacity
        for path, array in self.items:
            array[slot] = step[path]
        self.count += 1

    def extend(self, block: dict[str, np.ndarray]) -> None:
        n = len(next(iter(block.values())))
        pos, done = self.count % self.capacity, 0
        while done < n:
            k = min(n - done, self.capacity - pos)
            for path, array in self.items:
                array[pos : pos + k] = block[path][done : done + k]
            done += k
            pos = (pos + k) % self.capacity
        self.count += n

    def _file(self, path: str) -> str:
        return os.path.join(self.folder, path.replace("/", "__") + ".npy")

    def checkpoint(self) -> None:
        for path, array in self.items:
            np.save(self._file(path), array, allow_pickle=False)
        with open(os.path.join(self.folder, "cursor.json"), "w") as f:
            json.dump({"count": self.count}, f)

    def drop(self) -> None:
        self.arrays, self.items = {}, []

    def reopen(self) -> None:
        with open(os.path.join(self.folder, "cursor.json")) as f:
            state = json.load(f)
        self.count = state["count"]
        self.arrays = {p: np.load(self._file(p), allow_pickle=False) for p, _ in self.workload.leaves}
        self.items = list(self.arrays.items())

    def _first(self) -> int:
        return max(0, self.count - self.capacity)

    @property
    def size(self) -> int:
        return min(self.count, self.capacity)

    def rows(self) -> int:
        return self.size * self.num_envs

    def _take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        # one take over the [capacity * num_envs] rows of each leaf, ids past the end
        # wrapped by the take itself: numpy's fastest gather, and the one mmreplay does
        return {p: np.take(a.reshape(-1, *a.shape[2:]), rows, axis=0, mode="wrap") for p, a in self.items}

    def _starts(self, num_steps: int, batch_size: int, rng: np.random.Generator) -> np.ndarray:
        """Row ids of uniform starts drawn as mmreplay draws them: consecutive ids from
        the oldest step's slot, left unfolded (the take wraps them), so neither side does
        a modulo pass the other does not."""
        offset = (self._first() % self.capacity) * self.num_envs
        return rng.integers(offset, offset + (self.size - num_steps + 1) * self.num_envs, batch_size)

    def sample(self, batch_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return self._take(self._starts(1, batch_size, rng))

    def sample_sequences(
        self, batch_size: int, num_steps: int, rng: np.random.Generator
    ) -> dict[str, np.ndarray]:
        start = self._starts(num_steps, batch_size, rng)
        return self._take(start[:, None] + np.arange(0, num_steps * self.num_envs, self.num_envs))

    def disk_bytes(self) -> int:
        return du(self.folder)


# --- mmreplay --------------------------------------------------------------------------


class Mmreplay(System):
    name = "mmreplay"
    packages = ("zarr", "h5py")
    backend = "zarr"
    compression: str | None = None
    chunk_steps: int | None = None

    def __init__(self, folder: str, workload: Workload, capacity: int):
        super().__init__(folder, workload, capacity)
        self.path = os.path.join(folder, "buffer")
        self.store = mr.create(
            self.path,
            workload.spec,
            capacity,
            workload.num_envs,
            backend=self.backend,
            compression=self.compression,
            chunk_steps=self.chunk_steps,
        )
        self.add = self.store.add  # no adapter layer on the hot path

    def native_step(self, data: dict[str, np.ndarray], t: int) -> Any:
        return nest_from_flat({p: np.ascontiguousarray(v[t]) for p, v in data.items()})

    def native_block(self, data: dict[str, np.ndarray], a: int, b: int) -> Any:
        return nest_from_flat({p: v[a:b] for p, v in data.items()})

    def extend(self, block: Any) -> None:
        self.store.extend(block)

    def checkpoint(self) -> None:
        self.store.commit()

    def drop(self) -> None:
        self.store.close()
        self.store = self.add = None  # type: ignore[assignment]  # freed here, not in reopen

    def reopen(self) -> None:
        self.store = mr.open(self.path, "a")
        self.add = self.store.add

    def sample(self, batch_size: int, rng: np.random.Generator) -> Any:
        return self.store.sample(batch_size, rng=rng)

    def sample_sequences(self, batch_size: int, num_steps: int, rng: np.random.Generator) -> Any:
        return self.store.sample(batch_size, num_steps=num_steps, rng=rng)

    def rows(self) -> int:
        return len(self.store) * self.num_envs

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class MmreplayZarr(Mmreplay):
    name = "mmreplay zarr"


class MmreplayHDF5(Mmreplay):
    name = "mmreplay hdf5"
    backend = "hdf5"


class MmreplayZstd(Mmreplay):
    """zarr, every leaf zstd-compressed (level 3), chunks of ``chunk_steps`` steps."""

    name = "mmreplay zarr+zstd"
    compression = "zstd"


# --- TorchRL -------------------------------------------------------------------------------


class TorchRL(System):
    """``ReplayBuffer`` over ``LazyMemmapStorage`` of ``capacity * num_envs`` rows (step-major);
    sequences through ``SliceSampler`` over the same storage seen as ``[steps, envs]``."""

    name = "TorchRL memmap"
    modules = ("torch", "tensordict", "torchrl")
    packages = ("torch", "tensordict", "torchrl")

    def __init__(self, folder: str, workload: Workload, capacity: int):
        super().__init__(folder, workload, capacity)
        import logging

        import torchrl  # noqa: F401 - configures its logger on import; quiet it after

        logging.getLogger("torchrl").setLevel(logging.WARNING)
        self.ckpt = os.path.join(folder, "checkpoint")
        self.rb = self._buffer(existsok=False)
        self.add = self.rb.extend  # one step of num_envs rows: no adapter layer on the hot path
        self.seq_rb: Any = None  # the sequence sampler's view of self.seq_of's storage
        self.seq_of: Any = None

    def _buffer(self, existsok: bool) -> Any:
        from torchrl.data import LazyMemmapStorage, ReplayBuffer

        storage = LazyMemmapStorage(
            self.capacity * self.num_envs, scratch_dir=os.path.join(self.ckpt, "storage"), existsok=existsok
        )
        return ReplayBuffer(storage=storage)

    def _td(self, flat: dict[str, np.ndarray], rows: int) -> Any:
        import torch
        from tensordict import TensorDict

        nest = nest_from_flat({p: torch.from_numpy(np.ascontiguousarray(v)) for p, v in flat.items()})
        return TensorDict(nest, batch_size=[rows])

    def native_step(self, data: dict[str, np.ndarray], t: int) -> Any:
        return self._td({p: v[t] for p, v in data.items()}, self.num_envs)

    def native_block(self, data: dict[str, np.ndarray], a: int, b: int) -> Any:
        rows = (b - a) * self.num_envs
        return self._td({p: v[a:b].reshape(rows, *v.shape[2:]) for p, v in data.items()}, rows)

    def extend(self, block: Any) -> None:
        self.rb.extend(block)

    def checkpoint(self) -> None:
        self.rb.dumps(self.ckpt)

    def drop(self) -> None:
        self.rb = None

    def reopen(self) -> None:
        rb = self._buffer(existsok=True)
        rb.loads(self.ckpt)
        self.rb = rb
        self.add = rb.extend

    def sample(self, batch_size: int, rng: np.random.Generator) -> Any:
        return self.rb.sample(batch_size)

    def rows(self) -> int:
        return len(self.rb)

    def sample_sequences(self, batch_size: int, num_steps: int, rng: np.random.Generator) -> Any:
        """``SliceSampler`` over a 2-D ``[steps, envs]`` view (``ndim=2``) of the same
        memmap storage: each env's steps form its trajectories, cut at terminated or
        truncated (TorchRL's sequences stay in one episode)."""
        if self.seq_rb is None or self.seq_of is not self.rb:
            from torchrl.data import ReplayBuffer, TensorStorage
            from torchrl.data.replay_buffers.samplers import SliceSampler

            if len(self.rb) < self.capacity * self.num_envs:
                raise Unsupported("the 2-D view needs the ring full")
            steps = self.rb.storage._storage.reshape(self.capacity, self.num_envs)
            sampler = SliceSampler(
                slice_len=num_steps, end_keys=["terminated", "truncated"], strict_length=True
            )
            self.seq_rb = ReplayBuffer(storage=TensorStorage(steps, ndim=2), sampler=sampler)
            self.seq_of = self.rb
        return self.seq_rb.sample(batch_size * num_steps)


# --- cpprb ---------------------------------------------------------------------------------


class Cpprb(System):
    """``cpprb.ReplayBuffer`` with ``mmap_prefix``; leaf paths become keys with ``__``."""

    name = "cpprb mmap"
    modules = ("cpprb",)
    packages = ("cpprb",)

    def __init__(self, folder: str, workload: Workload, capacity: int):
        super().__init__(folder, workload, capacity)
        self.env_dict = {
            self._key(p): {"shape": s.shape or 1, "dtype": s.dtype.type} for p, s in workload.leaves
        }
        self.ckpt = os.path.join(folder, "transitions.npz")
        self.rb = self._buffer()

    @staticmethod
    def _key(path: str) -> str:
        return path.replace("/", "__")

    def _buffer(self) -> Any:
        import cpprb

        return cpprb.ReplayBuffer(
            self.capacity * self.num_envs, self.env_dict, mmap_prefix=os.path.join(self.folder, "rb")
        )

    def native_step(self, data: dict[str, np.ndarray], t: int) -> Any:
        return {self._key(p): np.ascontiguousarray(v[t]) for p, v in data.items()}

    def native_block(self, data: dict[str, np.ndarray], a: int, b: int) -> Any:
        rows = (b - a) * self.num_envs
        return {self._key(p): v[a:b].reshape(rows, *v.shape[2:]) for p, v in data.items()}

    def add(self, step: Any) -> None:
        self.rb.add(**step)

    def extend(self, block: Any) -> None:
        self.rb.add(**block)

    def checkpoint(self) -> None:
        self.rb.save_transitions(self.ckpt, safe=True)

    def drop(self) -> None:
        self.rb = None

    def reopen(self) -> None:
        rb = self._buffer()
        rb.load_transitions(self.ckpt)
        self.rb = rb

    def rows(self) -> int:
        return int(self.rb.get_stored_size())

    def sample(self, batch_size: int, rng: np.random.Generator) -> Any:
        return self.rb.sample(batch_size)


# --- Stable-Baselines3 --------------------------------------------------------------------


class SB3(System):
    """``ReplayBuffer`` (``DictReplayBuffer`` for dict observations) with ``n_envs``.

    SB3 stores observation, next observation, action, reward, done (= terminated or
    truncated) and timeouts (= truncated), which is the workloads' content.
    """

    name = "SB3"
    modules = ("torch", "stable_baselines3", "gymnasium")
    packages = ("stable-baselines3", "gymnasium")
    notes = {"extend": "no bulk API: a loop of add()"}

    def __init__(self, folder: str, workload: Workload, capacity: int):
        super().__init__(folder, workload, capacity)
        self.ckpt = os.path.join(folder, "buffer.pkl")
        self.dict_obs = isinstance(workload.spec["obs"], dict)
        self.rb = self._buffer()

    def _space(self, spec: Any) -> Any:
        from gymnasium import spaces

        if isinstance(spec, dict):
            return spaces.Dict({k: self._space(v) for k, v in spec.items()})
        if spec.dtype == np.uint8:
            return spaces.Box(0, 255, spec.shape, np.uint8)
        if spec.dtype.kind in "iu" and spec.shape == ():
            return spaces.Discrete(18)
        return spaces.Box(-np.inf, np.inf, spec.shape, spec.dtype.type)

    def _buffer(self) -> Any:
        from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer

        cls = DictReplayBuffer if self.dict_obs else ReplayBuffer
        return cls(
            self.capacity * self.num_envs,
            self._space(self.workload.spec["obs"]),
            self._space(self.workload.spec["action"]),
            device="cpu",
            n_envs=self.num_envs,
            handle_timeout_termination=True,
        )

    def _args(self, flat: dict[str, np.ndarray]) -> tuple:
        def obs(prefix: str) -> Any:
            if not self.dict_obs:
                return flat[prefix]
            return {p.split("/", 1)[1]: v for p, v in flat.items() if p.startswith(prefix + "/")}

        done = flat["terminated"] | flat["truncated"]
        infos = [{"TimeLimit.truncated": bool(x)} for x in flat["truncated"]]
        return obs("obs"), obs("next_obs"), flat["action"], flat["reward"], done, infos

    def native_step(self, data: dict[str, np.ndarray], t: int) -> Any:
        return self._args({p: np.ascontiguousarray(v[t]) for p, v in data.items()})

    def native_block(self, data: dict[str, np.ndarray], a: int, b: int) -> Any:
        return [self.native_step(data, t) for t in range(a, b)]

    def add(self, step: Any) -> None:
        self.rb.add(*step)

    def extend(self, block: Any) -> None:
        for step in block:
            self.rb.add(*step)

    def checkpoint(self) -> None:
        from stable_baselines3.common.save_util import save_to_pkl

        save_to_pkl(self.ckpt, self.rb)

    def drop(self) -> None:
        self.rb = None

    def reopen(self) -> None:
        from stable_baselines3.common.save_util import load_from_pkl

        self.rb = load_from_pkl(self.ckpt)

    def rows(self) -> int:
        return int(self.rb.size()) * self.num_envs

    def sample(self, batch_size: int, rng: np.random.Generator) -> Any:
        return self.rb.sample(batch_size)


SYSTEMS: list[type[System]] = [NumpyRAM, MmreplayZarr, MmreplayHDF5, MmreplayZstd, TorchRL, Cpprb, SB3]
