"""``d3rlpy``: the HDF5 file ``d3rlpy.dataset.ReplayBuffer.dump`` writes (format "2.1").

Load it with ``ReplayBuffer.load(open(path, "rb"), InfiniteBuffer())``. Per episode
``i``: ``observations_i`` (N rows; a nested observation becomes the tuple
``observations_i_<j>`` in flatten order), ``actions_i`` (N rows, a scalar action as
``[N, 1]``), ``rewards_i`` (``[N, 1]`` float32) and ``terminated_i``, true when the
episode's last step terminated (also when the ring overwrote its start). Other episodes
are written with ``terminated`` false, as d3rlpy records timeouts. Episodes are
written one at a time. d3rlpy keeps N observations per episode, so no next observation
is needed.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import BadInputError, NotEnoughDataError
from ..spec import ArraySpec, flatten
from ._base import (
    EXPORT_MARK,
    ExportResult,
    Roles,
    Target,
    Ticker,
    episode_flags,
    episode_total,
    episodes,
    part,
)
from .hdf5 import dataset_options, h5py_module, hdf5_output

COMPRESSIONS = ("gzip", "lzf")
DATASET_VERSION = "2.1"
COLUMNS = ("observations", "actions", "rewards", "terminated")


def _rows(values: np.ndarray, n: int) -> np.ndarray:
    """At least two dimensions, as d3rlpy's transition pickers expect."""
    values = np.asarray(values)
    return values.reshape(n, 1) if values.ndim == 1 else values


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
    obs_path = roles.need("observation", "d3rlpy")
    act_path = roles.need("action", "d3rlpy")
    rew_path = roles.need("reward", "d3rlpy")
    obs_spec, act_spec = roles.spec_of(obs_path), roles.spec_of(act_path)
    if not isinstance(act_spec, ArraySpec):
        raise BadInputError(
            f"d3rlpy export: d3rlpy needs one action array; {act_path!r} is a nest {act_spec}"
        )
    nested = not isinstance(obs_spec, ArraySpec)
    h5py = h5py_module()
    n_episodes, n_steps = episode_total(store, complete_only)
    if n_episodes == 0:
        raise NotEnoughDataError(
            f"{store.path}: no {'complete ' if complete_only else ''}episodes to export; d3rlpy needs at least one"
        )
    ticker = Ticker(progress, len(store) * store.num_envs, max(1, n_steps))

    def put(f: Any, name: str, arr: np.ndarray) -> None:
        opts = dataset_options(comp, None) if comp and arr.ndim and arr.size else {}
        f.create_dataset(name, data=arr, **opts)

    with Target(out, "file", force, fmt="d3rlpy", source=store.path) as target:
        count = steps = 0
        with hdf5_output(target.path()) as f:
            f.create_dataset("columns", data=list(COLUMNS), dtype=h5py.string_dtype())
            for ep in episodes(store, complete_only):
                n = ep.length
                if n == 0:
                    continue
                obs = part(ep.data, obs_path)
                if nested:
                    for j, leaf in enumerate(flatten(obs)):
                        put(f, f"observations_{count}_{j}", _rows(leaf, n))
                else:
                    put(f, f"observations_{count}", _rows(obs, n))
                put(f, f"actions_{count}", _rows(part(ep.data, act_path), n))
                put(f, f"rewards_{count}", np.asarray(part(ep.data, rew_path), np.float32).reshape(n, 1))
                f.create_dataset(f"terminated_{count}", data=bool(episode_flags(ep)[0][-1]))
                count += 1
                steps += n
                ticker.advance(n)
            f.create_dataset("num_episodes", data=count)
            f.create_dataset("version", data=DATASET_VERSION)
            f.attrs[EXPORT_MARK] = "d3rlpy"
        path = target.commit()
    return ExportResult("d3rlpy", path, count, steps, os.path.getsize(path))
