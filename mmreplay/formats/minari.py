"""``minari``: a Minari 0.5 HDF5 dataset, written with h5py and json alone.

``out`` is a Minari datasets root (what ``MINARI_DATASETS_PATH`` points at); the dataset
goes to ``out/<namespace>/<name>-v<N>/data/`` with ``metadata.json`` and
``main_data.hdf5``. Each episode is a group ``episode_<i>`` holding ``observations``
(N + 1 rows: the first observation and every next observation), ``actions``,
``rewards``, ``terminations`` and ``truncations`` (N rows). Nested observations and
actions become subgroups (dict keys; tuple items as ``_index_<i>``), as Minari writes.

Observations are stored raw with ``"jpeg_encoding": false``, so uint8 images come back
bit-exact. ``minari_version`` is the oldest release that reads the file correctly:
"0.5.3" in general, "0.5.4" when some observation or action looks like an image to
Minari (0.5.3 would try to JPEG-decode it).

Leaves with no role (log-probs, goals, policy info...) go under each episode's
``infos`` group by their leaf path (one already under ``infos``, as an import
makes, keeps its path), one row per step. The flags follow how each
episode's last step ended, also when the ring overwrote its start; a step that both
terminated and was truncated keeps both flags.

``observation_space`` / ``action_space`` are the gymnasium spaces the store was made
from when it records them (:func:`mmreplay.compat.gymnasium.record_spaces`, which the
recorders call), with the env spec as ``env_spec``; otherwise each leaf gets the
tightest Box its dtype allows (integers their dtype's range, booleans 0..1, floats
unbounded).

The final observation of an episode is its last step's next observation (role
``next_observation``); a TF-Agents trajectory store has it in the boundary row
(``step_type`` LAST) after each episode. A store with neither derives each step's next
observation from the next step of the same episode; there, and for an episode with no
boundary row after it, the last step's outcome is not stored: a terminated episode
keeps its last step with its own observation as the final one (a terminal step's next
observation never enters a TD target), any other is written without its last step,
ending truncated at its last observation.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadInputError, CorruptBufferError, NotEnoughDataError, UnsupportedFormatError
from ..files import disk_usage
from ..joined import JoinedShards
from ..roles import subtree
from ..spaces import SPACES_ATTR, spec_from_space_json, spec_to_space_json
from ..spec import ArraySpec, flatten, is_namedtuple, map_structure, unflatten
from .base import (
    FIELD_ROLES,
    Episodes,
    Roles,
    Source,
    Target,
    episode_flags,
    episodes_source,
    info_key,
    nest,
    source_name,
)
from .hdf5 import RESERVE_AHEAD, datasets, hdf5_output, put_array, reserve

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult

log = logging.getLogger(__name__)

COMPRESSIONS = ("gzip", "lzf")
#: Minari's dataset id, ``[namespace/]name-v<N>`` (minari.dataset.minari_dataset's
#: DATASET_ID_RE; nested namespaces are folders), with the version required: an id
#: without one breaks ``minari.list_local_datasets()`` for the whole root
DATASET_ID = re.compile(r"(?:(?P<namespace>[-_\w][-_\w/]*[-_\w]+)/)?(?P<name>[-_\w]+?)-v(?P<version>\d+)")
#: every role a Minari episode holds in its own arrays; other leaves go to ``infos``
ROLE_NAMES = (*FIELD_ROLES, "step_type", "next_step_type", "discount")


def default_dataset_id(store: Exportable) -> str:
    base = os.path.basename(os.path.normpath(store.path)) or "buffer"
    name = re.sub(r"[^-_\w]+", "_", base).strip("_-") or "buffer"
    return f"mmreplay/{name}-v0"


def check_dataset_id(dataset_id: Any) -> tuple[str, ...]:
    """The folder parts of a dataset id, as Minari parses it; refuses anything else."""
    text = dataset_id if isinstance(dataset_id, str) else ""
    parts = tuple(text.split("/"))
    if not DATASET_ID.fullmatch(text) or any(p in ("", ".", "..") for p in parts):
        raise BadInputError(
            f"minari export: dataset id {dataset_id!r} is not of the form [namespace/]name-v<N> "
            "(letters, digits, '-', '_'; namespaces separated by '/'; e.g. 'mmreplay/pointmass-v0')"
        )
    return parts


def looks_like_image(spec: Any) -> bool:
    """What Minari 0.5 treats as an image (and JPEG-decodes unless told not to)."""
    return any(
        s.dtype == np.uint8 and len(s.shape) in (2, 3) and s.shape[0] >= 32 and s.shape[1] >= 32
        for s in flatten(spec)
    )


# --- writing ---------------------------------------------------------------------------


def _write_nest(group: Any, name: str, spec: Any, value: Any, compression: str | None) -> None:
    """One leaf as a dataset, or a nest as subgroups (dict keys, tuple ``_index_i``)."""
    if isinstance(spec, ArraySpec):
        put_array(group, name, value, compression)
        return
    sub = group.create_group(name)
    if isinstance(spec, Mapping):
        for key in spec:
            _write_nest(sub, key, spec[key], value[key], compression)
    elif is_namedtuple(spec):
        for key, s, v in zip(spec._fields, spec, value):
            _write_nest(sub, key, s, v, compression)
    else:
        for i, (s, v) in enumerate(zip(spec, value)):
            _write_nest(sub, f"_index_{i}", s, v, compression)


class _FinalObservation:
    """The final observation of an episode of a TF-Agents trajectory store.

    Such a store has no next-observation leaf: a driver writes, after each episode, a
    boundary row whose ``step_type`` is LAST and whose observation is the episode's final
    one. An episode with no boundary row after it (still open at the cursor) has none.
    """

    LAST = 2  # TF-Agents StepType.LAST

    def __init__(self, store: Exportable, roles: Roles, obs_path: str, step_type: str):
        self.store = store
        index = {p: i for i, p in enumerate(roles.paths)}
        self.obs = [index[p] for p in roles.leaves_of(obs_path)]
        self.step_type = index[step_type]
        self.spec = roles.spec_of(obs_path)

    def after(self, ep: Any) -> Any:
        g = ep.last_step + 1
        # in a group's joined shards the step after a shard's last is another shard's
        end = (
            self.store.shard_end(ep.last_step)
            if isinstance(self.store, JoinedShards)
            else self.store.committed_steps
        )
        if g >= end:
            return None
        row = self.store.read_steps(np.array([g]))
        if int(np.asarray(row[self.step_type])[0, ep.env]) != self.LAST:
            return None
        return unflatten(self.spec, [row[i][:, ep.env] for i in self.obs])


def _observations(obs_spec: Any, obs: Any, last_next: Any) -> Any:
    """N observations and the final next observation, as N + 1 rows per leaf."""
    rows = [np.concatenate([o, n[-1:]], axis=0) for o, n in zip(flatten(obs), flatten(last_next))]
    return unflatten(obs_spec, rows)


def _spaces(store: Exportable, obs_spec: Any, act_spec: Any) -> dict[str, str]:
    """Minari's ``observation_space`` / ``action_space`` (and ``env_spec``) metadata.

    The spaces a store was made from (kept in its attrs by
    :func:`mmreplay.compat.gymnasium.record_spaces`) win; otherwise each leaf gets the
    tightest Box its dtype allows.
    """
    try:
        out = {
            "observation_space": json.dumps(spec_to_space_json(obs_spec)),
            "action_space": json.dumps(spec_to_space_json(act_spec)),
        }
    except BadInputError as exc:
        raise BadInputError(f"minari export: {exc}") from None
    recorded = store.attrs.get(SPACES_ATTR)
    if not isinstance(recorded, dict):
        return out
    for key, spec in (("observation_space", obs_spec), ("action_space", act_spec)):
        text = recorded.get(key)
        if not isinstance(text, str):
            continue
        try:
            shapes = [s.shape for s in flatten(spec_from_space_json(text, key))]
        except (ValueError, KeyError, TypeError, UnsupportedFormatError):
            shapes = None
        if shapes != [s.shape for s in flatten(spec)]:
            log.warning("%s: the recorded %s does not match the leaves; writing a Box", store.path, key)
            continue
        out[key] = text
    if isinstance(recorded.get("env_spec"), str):
        out["env_spec"] = recorded["env_spec"]
    return out


def _final_observation(obs: Any, act: Any, rew: np.ndarray, term: np.ndarray, trunc: np.ndarray) -> Any:
    """The episode's arrays when its final observation is not stored.

    A terminated episode keeps its last step, with its own observation standing in for
    the final one (the next observation of a terminal step never enters a TD target);
    any other loses its last step, whose outcome is unknown, and ends truncated one
    step earlier. None when nothing is left.
    """
    if term[-1]:
        return map_structure(lambda x: x[-1:], obs), obs, act, rew, term, trunc
    n = len(rew) - 1
    if n < 1:
        return None
    last = map_structure(lambda x: x[-1:], obs)
    obs, act = (map_structure(lambda x: x[:-1], v) for v in (obs, act))
    trunc = np.zeros(n, bool)
    trunc[-1] = True
    return last, obs, act, rew[:-1], np.zeros(n, bool), trunc


def write(store: Exportable, out: str, options: ExportOptions, dataset_id: str | None = None) -> ExportResult:
    roles = Roles.of(store)
    obs_path, act_path, rew_path = roles.need("minari", "observation", "action", "reward")
    next_path = roles.get("next_observation")
    step_type = roles.get("step_type")
    obs_spec, act_spec = roles.spec_of(obs_path), roles.spec_of(act_path)
    final = _FinalObservation(store, roles, obs_path, step_type) if next_path is None and step_type else None
    if next_path is not None and roles.spec_of(next_path) != obs_spec:
        raise BadInputError(
            f"minari export: next_observation {roles.spec_of(next_path)} does not match observation {obs_spec}"
        )
    extras = roles.extras(ROLE_NAMES)
    dataset_id = dataset_id or default_dataset_id(store)
    parts = check_dataset_id(dataset_id)
    spaces = _spaces(store, obs_spec, act_spec)

    root = os.path.abspath(out)
    if os.path.exists(root) and not os.path.isdir(root):
        raise FileExistsError(
            f"{root}: is not a folder; the minari export writes into a datasets root folder"
        )
    if os.path.islink(root):
        raise BadInputError(
            f"minari export: the datasets root {root} is a symbolic link; give the folder it names"
        )
    _check_inside(root, parts)
    episodes = Episodes(store, options)

    dataset = os.path.join(root, *parts)
    with Target(dataset, "folder", "minari", store, options) as target:
        _check_inside(root, parts)
        folder = target.path("data")
        os.mkdir(folder)
        count = steps = claimed = 0
        with hdf5_output(os.path.join(folder, "main_data.hdf5"), track_order=True) as f:
            for ep in episodes:
                n = ep.length
                obs, act = subtree(ep.data, obs_path), subtree(ep.data, act_path)
                rew = np.asarray(subtree(ep.data, rew_path)).reshape(n)
                term, trunc = episode_flags(ep, roles.get("truncated"))
                if next_path is not None:
                    last = map_structure(lambda x: x[-1:], subtree(ep.data, next_path))
                else:
                    last = final.after(ep) if final is not None else None
                    if last is None:
                        cut = _final_observation(obs, act, rew, term, trunc)
                        if cut is None:
                            continue
                        last, obs, act, rew, term, trunc = cut
                        n = len(rew)
                g = f.create_group(f"episode_{count}")
                g.attrs["id"] = count
                g.attrs["total_steps"] = n
                observations = _observations(obs_spec, obs, last)
                _write_nest(g, "observations", obs_spec, observations, options.compression)
                _write_nest(g, "actions", act_spec, act, options.compression)
                g.create_dataset("rewards", data=rew)
                g.create_dataset("terminations", data=term)
                g.create_dataset("truncations", data=trunc)
                for p in extras:
                    _write_leaf(g, info_key(p), np.asarray(subtree(ep.data, p))[:n], options.compression)
                count += 1
                steps += n
                claimed = reserve(f, RESERVE_AHEAD, claimed)
        if count == 0:  # (minari.load_dataset takes it; nothing can be read back from it)
            complete = "complete " if options.complete_only else ""
            raise NotEnoughDataError(
                f"{store.path}: no {complete}episodes to export; a Minari dataset needs at least one "
                "(without a next observation, an episode needs two steps: its last is the final observation)"
            )
        image = looks_like_image(obs_spec) or looks_like_image(act_spec)
        metadata = {
            "dataset_id": dataset_id,
            "minari_version": "0.5.4" if image else "0.5.3",
            "data_format": "hdf5",
            "total_episodes": count,
            "total_steps": steps,
            **spaces,
            "jpeg_encoding": False,
            "algorithm_name": "mmreplay export",
            "description": f"Exported by mmreplay from {source_name(store)}",
            "dataset_size": round(disk_usage(folder) / 2**20, 1),
        }
        with open(os.path.join(folder, "metadata.json"), "w") as fm:
            json.dump(metadata, fm, indent=1)
        info = {"dataset_id": dataset_id, "root": root, "planned": episodes.count}
        return target.finish(count, steps, info, inside="data")


def _write_leaf(group: Any, path: str, values: np.ndarray, compression: str | None) -> None:
    """A leaf under ``group`` at its path (``a/b`` as subgroup ``a``, dataset ``b``)."""
    *folders, name = path.split("/")
    for folder in folders:
        group = group.require_group(folder)
    put_array(group, name, values, compression)


def _check_inside(root: str, parts: tuple[str, ...]) -> None:
    """Refuse a namespace folder that is a link leading out of the datasets root."""
    real_root = os.path.realpath(root)
    where = os.path.realpath(os.path.join(root, *parts))
    if os.path.commonpath([where, real_root]) != real_root:
        raise BadInputError(
            f"minari export: {os.path.join(root, *parts)} resolves to {where}, "
            f"outside the datasets root {root}"
        )


# --- the import ------------------------------------------------------------------------


def _is_data_dir(folder: str) -> bool:
    """Whether ``folder`` is a Minari dataset's ``data`` folder, in any of its data formats
    (the import then names one it does not read)."""
    meta = os.path.join(folder, "metadata.json")
    if not os.path.isfile(meta):
        return False
    if os.path.isfile(os.path.join(folder, "main_data.hdf5")):
        return True
    try:
        with open(meta) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and "data_format" in found and "dataset_id" in found


def data_dir(src: str) -> str | None:
    """The ``data`` folder of the Minari dataset at ``src``: the data folder itself, a
    dataset folder, or a datasets root holding exactly one dataset (an ``export -f
    minari`` target). A root with several datasets is refused with their ids."""
    for cand in (os.path.join(src, "data"), src):
        if _is_data_dir(cand):
            return cand
    found = []
    for folder, dirs, _ in os.walk(src):
        dirs.sort()
        if os.path.basename(folder) == "data" and _is_data_dir(folder):
            found.append(folder)
            dirs.clear()
        elif len(found) > 1:
            break
    if len(found) > 1:
        ids = ", ".join(os.path.relpath(os.path.dirname(f), src) for f in found[:5])
        raise BadInputError(
            f"{src}: a Minari datasets root holding several datasets ({ids}); give the dataset's folder"
        )
    return found[0] if found else None


def _read_nest(node: Any, spec: Any, jpeg: bool, where: str) -> Any:
    if isinstance(spec, dict):
        return {k: _read_nest(node[k], s, jpeg, f"{where}/{k}") for k, s in spec.items()}
    if isinstance(spec, tuple):
        return tuple(_read_nest(node[f"_index_{i}"], s, jpeg, f"{where}/{i}") for i, s in enumerate(spec))
    arr = node[()]
    if jpeg and (arr.dtype == object or arr.ndim != len(spec.shape) + 1):
        arr = _decode_jpeg(arr, where)
    return arr


def _decode_jpeg(frames: Any, where: str) -> np.ndarray:
    try:
        import io

        from PIL import Image
    except ImportError as exc:
        raise ImportError(
            f"{where}: JPEG-encoded Minari images need Pillow: pip install 'mmreplay[export]'"
        ) from exc
    return np.stack([np.array(Image.open(io.BytesIO(bytes(np.asarray(b))))) for b in frames])


def read(src: str, files: ExitStack) -> Source:
    import h5py

    data = data_dir(src)
    if data is None:
        raise UnsupportedFormatError(f"{src}: not a Minari dataset folder")
    with open(os.path.join(data, "metadata.json")) as fm:
        meta = json.load(fm)
    if meta.get("data_format", "hdf5") != "hdf5":
        raise UnsupportedFormatError(
            f"{src}: Minari data_format {meta.get('data_format')!r}; only 'hdf5' imports"
        )
    for key in ("observation_space", "action_space"):
        if key not in meta:
            raise UnsupportedFormatError(
                f"{src}: metadata.json has no {key} (datasets that need gym.make are not read)"
            )
    obs_spec = spec_from_space_json(meta["observation_space"], "observation")
    act_spec = spec_from_space_json(meta["action_space"], "action")
    jpeg = bool(meta.get("jpeg_encoding", True))
    f = files.enter_context(h5py.File(os.path.join(data, "main_data.hdf5"), "r"))
    names = sorted((k for k in f if k.startswith("episode_")), key=lambda k: int(k.split("_", 1)[1]))
    if not names:
        raise BadInputError(f"{src}: the dataset holds no episodes")
    first = f[names[0]]
    # the arrays' own dtypes win over the spaces' (rewards are often float64)
    obs0 = _read_nest(first["observations"], obs_spec, jpeg, "observations")
    act0 = _read_nest(first["actions"], act_spec, jpeg, "actions")
    obs_spec = unflatten(obs_spec, [ArraySpec(a.shape[1:], a.dtype) for a in flatten(obs0)])
    act_spec = unflatten(act_spec, [ArraySpec(a.shape[1:], a.dtype) for a in flatten(act0)])
    rew_dtype = first["rewards"].dtype
    n0 = int(first["rewards"].shape[0])
    info_paths = [
        p
        for p, d in datasets(first["infos"]).items()
        if d.ndim >= 1 and d.shape[0] in (n0, n0 + 1) and d.dtype.kind in "biuf"
    ] if "infos" in first else []
    spec = {
        "observation": obs_spec,
        "action": act_spec,
        "reward": ArraySpec((), rew_dtype),
        "terminated": ArraySpec((), "bool"),
        "truncated": ArraySpec((), "bool"),
        "next_observation": obs_spec,
    }
    if info_paths:
        infos = first["infos"]
        specs_of = [ArraySpec(infos[p].shape[1:], infos[p].dtype) for p in info_paths]
        spec["infos"] = nest(info_paths, specs_of)
    specs = flatten(spec)

    def episode_steps(name: str) -> list[np.ndarray]:
        g = f[name]
        obs = _read_nest(g["observations"], obs_spec, jpeg, f"{name}/observations")
        act = _read_nest(g["actions"], act_spec, jpeg, f"{name}/actions")
        rew = np.asarray(g["rewards"][()]).reshape(-1)
        n = len(rew)
        term = np.asarray(g["terminations"][()], bool).reshape(n)
        trunc = np.asarray(g["truncations"][()], bool).reshape(n)
        for a in flatten(obs):
            if len(a) != n + 1:
                raise CorruptBufferError(
                    f"{src}: {name} has {len(a)} observations for {n} steps, expected {n + 1}"
                )
        if n and not (term[-1] or trunc[-1]):
            log.warning("%s: %s ends with neither flag; imported as truncated", src, name)
            trunc = trunc.copy()
            trunc[-1] = True
        step = {
            "observation": unflatten(obs_spec, [a[:n] for a in flatten(obs)]),
            "action": act,
            "reward": rew,
            "terminated": term,
            "truncated": trunc,
            "next_observation": unflatten(obs_spec, [a[1:] for a in flatten(obs)]),
        }
        if info_paths:
            # one row per step: Minari's DataCollector adds the reset's info in front,
            # so row i is the info that came with observation i
            step["infos"] = nest(info_paths, [_info_rows(g, p, n, name) for p in info_paths])
        return [np.asarray(a).reshape(n, *s.shape) for a, s in zip(flatten(step), specs)]

    attrs = {
        SPACES_ATTR: {
            key: meta[key] if isinstance(meta[key], str) else json.dumps(meta[key])
            for key in ("observation_space", "action_space", "env_spec")
            if meta.get(key) is not None
        }
    }
    episodes = [(name, int(f[name]["rewards"].shape[0])) for name in names]
    return episodes_source(spec, episodes, episode_steps, attrs=attrs)


def _info_rows(group: Any, path: str, n: int, where: str) -> np.ndarray:
    if "infos" not in group or path not in group["infos"]:
        raise CorruptBufferError(f"{where}: infos/{path} is missing (the first episode has it)")
    values = np.asarray(group["infos"][path][()])
    if values.shape[0] not in (n, n + 1):
        raise CorruptBufferError(f"{where}: infos/{path} has {values.shape[0]} rows for {n} steps")
    return values[:n]
