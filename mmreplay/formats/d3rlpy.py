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

from typing import TYPE_CHECKING

import numpy as np

from ..errors import BadInputError, CorruptBufferError, NotEnoughDataError
from ..roles import subtree
from ..spec import ArraySpec, flatten
from .base import EXPORT_MARK, Episodes, Roles, Source, Target, episode_flags, episodes_source
from .hdf5 import hdf5_output, open_hdf5, put_array

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult

COMPRESSIONS = ("gzip", "lzf")
DATASET_VERSION = "2.1"
COLUMNS = ("observations", "actions", "rewards", "terminated")


def _rows(values: np.ndarray, n: int) -> np.ndarray:
    """At least two dimensions, as d3rlpy's transition pickers expect."""
    values = np.asarray(values)
    return values.reshape(n, 1) if values.ndim == 1 else values


def write(store: Exportable, out: str, options: ExportOptions) -> ExportResult:
    import h5py

    roles = Roles.of(store)
    obs_path, act_path, rew_path = roles.need("d3rlpy", "observation", "action", "reward")
    obs_spec, act_spec = roles.spec_of(obs_path), roles.spec_of(act_path)
    if not isinstance(act_spec, ArraySpec):
        raise BadInputError(
            f"d3rlpy export: d3rlpy needs one action array; {act_path!r} is a nest {act_spec}"
        )
    nested = not isinstance(obs_spec, ArraySpec)
    episodes = Episodes(store, options)
    if episodes.count == 0:
        complete = "complete " if options.complete_only else ""
        raise NotEnoughDataError(f"{store.path}: no {complete}episodes to export; d3rlpy needs at least one")

    comp = options.compression
    with Target(out, "file", "d3rlpy", store, options) as target:
        count = steps = 0
        with hdf5_output(target.path()) as f:
            f.create_dataset("columns", data=list(COLUMNS), dtype=h5py.string_dtype())
            for ep in episodes:
                n = ep.length
                obs = subtree(ep.data, obs_path)
                rew = np.asarray(subtree(ep.data, rew_path), np.float32).reshape(n, 1)
                if nested:
                    for j, leaf in enumerate(flatten(obs)):
                        put_array(f, f"observations_{count}_{j}", _rows(leaf, n), comp)
                else:
                    put_array(f, f"observations_{count}", _rows(obs, n), comp)
                put_array(f, f"actions_{count}", _rows(subtree(ep.data, act_path), n), comp)
                put_array(f, f"rewards_{count}", rew, comp)
                f.create_dataset(f"terminated_{count}", data=bool(episode_flags(ep)[0][-1]))
                count += 1
                steps += n
            f.create_dataset("num_episodes", data=count)
            f.create_dataset("version", data=DATASET_VERSION)
            f.attrs[EXPORT_MARK] = "d3rlpy"
        return target.finish(count, steps)


# --- the import ------------------------------------------------------------------------


def read(src: str, files: ExitStack) -> Source:
    f = open_hdf5(src, files, "d3rlpy", "num_episodes", "a d3rlpy file")
    count = int(f["num_episodes"][()])
    if count < 1:
        raise BadInputError(f"{src}: the d3rlpy file holds no episodes")

    def obs_names(i: int) -> list[str]:
        if f"observations_{i}" in f:
            return [f"observations_{i}"]
        names, j = [], 0
        while f"observations_{i}_{j}" in f:
            names.append(f"observations_{i}_{j}")
            j += 1
        if not names:
            raise CorruptBufferError(f"{src}: episode {i} has no observations")
        return names

    obs_specs = [ArraySpec(f[n].shape[1:], f[n].dtype) for n in obs_names(0)]
    act = f["actions_0"]
    spec = {
        "observation": obs_specs[0] if "observations_0" in f else tuple(obs_specs),
        "action": ArraySpec(act.shape[1:], act.dtype),
        "reward": ArraySpec((), f["rewards_0"].dtype),
        "terminated": ArraySpec((), "bool"),
        "truncated": ArraySpec((), "bool"),
    }

    def load(i: int) -> list[np.ndarray]:
        obs = [f[n][()] for n in obs_names(i)]
        n = len(obs[0])
        rew = np.asarray(f[f"rewards_{i}"][()]).reshape(n)
        term = np.zeros(n, bool)
        trunc = np.zeros(n, bool)
        if n:
            ended = bool(f[f"terminated_{i}"][()])
            term[-1], trunc[-1] = ended, not ended
        return [f[f"actions_{i}"][()], *obs, rew, term, trunc]

    # flatten order of the spec: action, observation..., reward, terminated, truncated
    episodes = [(i, len(f[obs_names(i)[0]])) for i in range(count)]
    return episodes_source(spec, episodes, load)
