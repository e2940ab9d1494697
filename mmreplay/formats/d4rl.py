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
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadInputError
from ..roles import subtree
from ..spec import ArraySpec, flatten
from .base import (
    BLOCK_BYTES,
    EXPORT_MARK,
    Episodes,
    Roles,
    Source,
    Target,
    arrays_source,
    episode_flags,
    info_key,
    nest_leaves,
    source_name,
)
from .hdf5 import dataset_options, datasets, hdf5_output, open_hdf5

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult

log = logging.getLogger(__name__)

COMPRESSIONS = ("gzip", "lzf")
#: rows per HDF5 chunk aimed at, in bytes
CHUNK_BYTES = 1 << 20
#: top-level D4RL keys that are no per-step leaves (mmreplay's d4rl export writes the last two)
D4RL_BOOKKEEPING = ("metadata", "episode_starts", "episode_envs")
#: the per-step fields of a D4RL file: one of another length is a damaged file, not a leaf to skip
D4RL_FIELDS = ("observations", "actions", "rewards", "terminals", "timeouts", "next_observations")


class Appender:
    """Resizable HDF5 datasets, one per leaf of each nest named in ``nests`` (a nest's as
    ``name/<leaf path>``), appended to in blocks of about :data:`BLOCK_BYTES`. Each
    exists after :meth:`close`, empty when no row came (an export with no episodes)."""

    def __init__(self, group: Any, compression: str | None, rows: int, nests: dict[str, Any]):
        self.group, self.compression, self.nests = group, compression, nests
        self.rows = max(1, rows)  # rows the datasets will hold: no chunk needs to be larger
        self.dsets: dict[str, Any] = {}
        self.pending: dict[str, list[np.ndarray]] = {}
        self.pending_bytes = 0

    def add(self, name: str, values: Any) -> None:
        for key, _, leaf in nest_leaves(name, self.nests[name], values):
            leaf = np.asarray(leaf)
            self.pending.setdefault(key, []).append(leaf)
            self.pending_bytes += leaf.nbytes
        if self.pending_bytes >= BLOCK_BYTES:
            self.flush()

    def flush(self) -> None:
        for name, parts in self.pending.items():
            self._append(name, np.concatenate(parts) if len(parts) > 1 else parts[0])
        self.pending = {}
        self.pending_bytes = 0

    def close(self) -> None:
        self.flush()
        for name, spec in self.nests.items():
            for key, leaf, _ in nest_leaves(name, spec, spec):
                if key not in self.dsets:
                    self._append(key, np.zeros((0, *leaf.shape), leaf.dtype))

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


def write(store: Exportable, out: str, options: ExportOptions) -> ExportResult:
    roles = Roles.of(store)
    obs_path, act_path, rew_path = roles.need("d4rl", "observation", "action", "reward")
    next_path = roles.get("next_observation")
    specs = dict(zip(roles.paths, flatten(store.spec)))
    extras = {info_key(p): p for p in roles.extras()}
    paths = {"observations": obs_path, "actions": act_path, "next_observations": next_path, **extras}
    nests = {name: roles.spec_of(p) for name, p in paths.items() if p is not None}
    nests |= {"rewards": ArraySpec((), specs[roles.leaves_of(rew_path)[0]].dtype)}
    nests |= {"terminals": ArraySpec((), "bool"), "timeouts": ArraySpec((), "bool")}
    episodes = Episodes(store, options)
    with Target(out, "file", "d4rl", store, options) as target:
        count = steps = 0
        starts, envs = [], []
        with hdf5_output(target.path()) as f:
            app = Appender(f, options.compression, episodes.steps, nests)
            for ep in episodes:
                for name, path in paths.items():
                    if path is not None:
                        app.add(name, subtree(ep.data, path))
                app.add("rewards", np.asarray(subtree(ep.data, rew_path)).reshape(ep.length))
                term, trunc = episode_flags(ep)
                app.add("terminals", term)
                app.add("timeouts", trunc)
                starts.append(steps)
                envs.append(ep.env)
                count += 1
                steps += ep.length
            app.close()
            f.create_dataset("episode_starts", data=np.asarray(starts, np.int64))
            f.create_dataset("episode_envs", data=np.asarray(envs, np.int64))
            f.attrs["source"] = source_name(store)
            f.attrs[EXPORT_MARK] = "d4rl"
        return target.finish(count, steps)


# --- the import ------------------------------------------------------------------------


def read(src: str, files: ExitStack) -> Source:
    import h5py

    f = open_hdf5(src, files, "d4rl", "observations", "a D4RL-style file")
    obs = f["observations"]
    steps = len(obs) if isinstance(obs, h5py.Dataset) else len(next(iter(datasets(obs).values())))
    arrays: dict[str, Any] = {}
    for name, dset in datasets(f).items():
        top = name.split("/")[0]
        rows = dset.shape[0] if dset.ndim else None
        if top in D4RL_FIELDS and rows != steps:
            raise BadInputError(f"{src}: {name!r} has {rows} rows, 'observations' {steps}; expected one per step")
        if top in D4RL_BOOKKEEPING or rows != steps:
            log.info("%s: skipping %r (not one row per step)", src, name)
            continue
        arrays[name] = dset
    return arrays_source(arrays, None, None, src)
