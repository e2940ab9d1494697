"""``d4rl``: one flat HDF5 file in the D4RL key style.

Top-level datasets of length T (every exported step, episode after episode):
``observations``, ``actions``, ``rewards``, ``terminals``, ``timeouts`` and, when the
store has a next observation, ``next_observations``. An episode ends where
``terminals | timeouts``; the two are never both set (termination wins), and they
follow how each episode's last step ended, also when the ring overwrote its start.
Leaves outside the roles go under ``infos/<leaf path>`` (a leaf already under ``infos``
keeps its path). Nested observations or actions are written as
groups (``observations/<key>``). Datasets are resizable and filled episode by episode,
so memory stays bounded. ``episode_starts`` / ``episode_envs`` record where each episode
began and which env it came from.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import UnsupportedFormatError
from ..spec import ArraySpec, flatten, is_namedtuple
from .base import (
    BLOCK_BYTES,
    EXPORT_MARK,
    ExportResult,
    Reading,
    Roles,
    Target,
    Ticker,
    arrays_source,
    episode_flags,
    episode_total,
    episodes,
    part,
)
from .hdf5 import dataset_options, datasets, hdf5_output

log = logging.getLogger(__name__)

COMPRESSIONS = ("gzip", "lzf")
#: rows per HDF5 chunk aimed at, in bytes
CHUNK_BYTES = 1 << 20
#: top-level D4RL keys that are no per-step leaves (mmreplay's d4rl export writes the last two)
D4RL_BOOKKEEPING = ("metadata", "episode_starts", "episode_envs")


class Appender:
    """Resizable HDF5 datasets, appended to in blocks of about :data:`BLOCK_BYTES`."""

    def __init__(self, group: Any, compression: str | None, rows: int):
        self.group = group
        self.rows = max(1, rows)  # rows the datasets will hold: no chunk needs to be larger
        self.compression = compression
        self.dsets: dict[str, Any] = {}
        self.pending: dict[str, list[np.ndarray]] = {}
        self.pending_bytes = 0

    def add(self, name: str, values: np.ndarray) -> None:
        values = np.asarray(values)
        self.pending.setdefault(name, []).append(values)
        self.pending_bytes += values.nbytes
        if self.pending_bytes >= BLOCK_BYTES:
            self.flush()

    def flush(self) -> None:
        for name, parts in self.pending.items():
            self._append(name, np.concatenate(parts) if len(parts) > 1 else parts[0])
        self.pending = {}
        self.pending_bytes = 0

    def _append(self, name: str, values: np.ndarray) -> None:
        dset = self.dsets.get(name)
        if dset is None:
            row = max(1, values.dtype.itemsize * int(np.prod(values.shape[1:], dtype=np.int64)))
            chunk = (max(1, min(self.rows, CHUNK_BYTES // row)), *values.shape[1:])
            opts = dataset_options(self.compression, chunk) or {"chunks": chunk}
            dset = self.group.create_dataset(
                name,
                shape=(0, *values.shape[1:]),
                maxshape=(None, *values.shape[1:]),
                dtype=values.dtype,
                **opts,
            )
            self.dsets[name] = dset
        n = dset.shape[0]
        if len(values):
            dset.resize(n + len(values), axis=0)
            dset[n:] = values

    def add_nest(self, name: str, spec: Any, value: Any) -> None:
        if isinstance(spec, ArraySpec):
            self.add(name, value)
        elif isinstance(spec, Mapping):
            for key in spec:
                self.add_nest(f"{name}/{key}", spec[key], value[key])
        elif is_namedtuple(spec):
            for key, s, v in zip(spec._fields, spec, value):
                self.add_nest(f"{name}/{key}", s, v)
        else:
            for i, (s, v) in enumerate(zip(spec, value)):
                self.add_nest(f"{name}/{i}", s, v)

    def ensure(self, name: str, spec: Any) -> None:
        """Create empty datasets for a nest (an export with no episodes still has every key)."""
        if isinstance(spec, ArraySpec):
            if name not in self.dsets:
                self._append(name, np.zeros((0, *spec.shape), spec.dtype))
            return
        items = (
            spec.items()
            if isinstance(spec, Mapping)
            else zip(spec._fields, spec)
            if is_namedtuple(spec)
            else ((str(i), s) for i, s in enumerate(spec))
        )
        for key, s in items:
            self.ensure(f"{name}/{key}", s)


def info_key(path: str) -> str:
    """Where a leaf with no role goes: ``infos/<leaf path>``; a leaf already under
    ``infos`` (a D4RL file imported earlier) keeps its path, so nothing nests twice."""
    return path if path.startswith("infos/") else f"infos/{path}"


def write(
    store: Any,
    out: str,
    *,
    compression: str | None,
    complete_only: bool,
    force: bool,
    progress: Any,
) -> ExportResult:
    comp = compression
    roles = Roles.of(store)
    obs_path = roles.need("observation", "d4rl")
    act_path = roles.need("action", "d4rl")
    rew_path = roles.need("reward", "d4rl")
    next_path = roles.get("next_observation")
    obs_spec, act_spec = roles.spec_of(obs_path), roles.spec_of(act_path)
    used = ("observation", "action", "reward", "next_observation", "terminated", "truncated")
    extras = roles.extras(used)
    paths = list(roles.paths)
    specs = dict(zip(paths, flatten(store.spec)))
    _, n_steps = episode_total(store, complete_only)
    ticker = Ticker(progress, len(store) * store.num_envs, max(1, n_steps))
    with Target(out, "file", force, fmt="d4rl", source=store.path) as target:
        count = steps = 0
        starts, envs = [], []
        with hdf5_output(target.path()) as f:
            app = Appender(f, comp, n_steps)
            for ep in episodes(store, complete_only):
                n = ep.length
                if n == 0:
                    continue
                term, trunc = episode_flags(ep)
                app.add_nest("observations", obs_spec, part(ep.data, obs_path))
                app.add_nest("actions", act_spec, part(ep.data, act_path))
                app.add("rewards", np.asarray(part(ep.data, rew_path)).reshape(n))
                app.add("terminals", term)
                app.add("timeouts", trunc)
                if next_path is not None:
                    app.add_nest("next_observations", obs_spec, part(ep.data, next_path))
                for p in extras:
                    app.add(info_key(p), part(ep.data, p))
                starts.append(steps)
                envs.append(ep.env)
                count += 1
                steps += n
                ticker.advance(n)
            app.flush()
            app.ensure("observations", obs_spec)
            app.ensure("actions", act_spec)
            app.ensure("rewards", ArraySpec((), specs[roles.leaves_of(rew_path)[0]].dtype))
            app.ensure("terminals", ArraySpec((), "bool"))
            app.ensure("timeouts", ArraySpec((), "bool"))
            if next_path is not None:
                app.ensure("next_observations", obs_spec)
            for p in extras:
                app.ensure(info_key(p), specs[p])
            f.create_dataset("episode_starts", data=np.asarray(starts, np.int64))
            f.create_dataset("episode_envs", data=np.asarray(envs, np.int64))
            f.attrs["source"] = os.path.abspath(store.path)
            f.attrs[EXPORT_MARK] = "d4rl"
        path = target.commit()
    return ExportResult("d4rl", path, count, steps, os.path.getsize(path))


# --- the import ------------------------------------------------------------------------


def read(src: str) -> Reading:
    import h5py

    f = h5py.File(src, "r")
    try:
        if "observations" not in f:
            raise UnsupportedFormatError(f"{src}: no 'observations' dataset; not a D4RL-style file")
        obs = f["observations"]
        steps = len(obs) if isinstance(obs, h5py.Dataset) else len(next(iter(datasets(obs).values())))
        arrays: dict[str, Any] = {}
        for name, dset in datasets(f).items():
            top = name.split("/")[0]
            if top in D4RL_BOOKKEEPING or dset.ndim == 0 or dset.shape[0] != steps:
                log.info("%s: skipping %r (not one row per step)", src, name)
                continue
            arrays[name] = dset
        return arrays_source(arrays, None, None, src), f.close
    except BaseException:
        f.close()
        raise
