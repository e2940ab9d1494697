"""Import offline datasets into a new store: Minari, D4RL-style HDF5, npz, and the
step-major exports (npz, hdf5, zarr) mmreplay writes.

- Minari (a dataset folder ``<root>/<id>`` or its ``data`` folder, HDF5 format): one env,
  episodes one after another, leaves ``observation``, ``action``, ``reward``,
  ``terminated``, ``truncated`` and ``next_observation`` (the observation after each
  step). Spaces come from ``metadata.json`` (read as JSON; gymnasium is not needed), dtypes
  from the arrays themselves.
- D4RL-style HDF5: one env, every top-level dataset of length T as a leaf under its own
  name (``observations``, ``actions``, ``rewards``, ``terminals``, ``timeouts``,
  ``next_observations``, ``infos/...``), so the roles are inferred from the names.
- npz: arrays keyed by leaf path (``/`` nests them). An npz written by ``mmreplay
  export`` carries its spec, roles and env count, and comes back exactly; any other npz
  is read as ``[T, *shape]`` arrays of one env, or ``[T, num_envs, *shape]`` when
  ``num_envs`` is given.

Data is read and written in blocks, so a dataset larger than RAM imports in bounded
memory. A failed import removes the store it was creating. Nothing is unpickled.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import BadInputError, CorruptBufferError, NotABufferError, UnsupportedFormatError
from .files import check_target
from .spec import ArraySpec, flatten, leaf_paths, spec_from_json, unflatten
from .store import create

__all__ = ["ImportResult", "import_dataset", "detect_format", "FORMATS"]

log = logging.getLogger(__name__)

FORMATS = ("minari", "d4rl", "npz", "hdf5", "zarr")
BLOCK_BYTES = 32 << 20
ARRAYS_FORMAT = "mmreplay-arrays/1"


@dataclass(frozen=True)
class ImportResult:
    """What an import created: the store's path, the source format, the steps and envs."""

    path: str
    format: str
    steps: int
    num_envs: int
    episodes: int | None = None


# --- detection ---------------------------------------------------------------------------


def _minari_data_dir(src: str) -> str | None:
    for cand in (os.path.join(src, "data"), src):
        if os.path.isfile(os.path.join(cand, "metadata.json")) and os.path.isfile(
            os.path.join(cand, "main_data.hdf5")
        ):
            return cand
    return None


def detect_format(src: str) -> str:
    """The format of ``src`` from its contents: one of :data:`FORMATS`."""
    if not os.path.exists(src):
        raise NotABufferError(f"{src}: no such file or folder")
    if os.path.isdir(src):
        if _minari_data_dir(src) is not None:
            return "minari"
        if os.path.isfile(os.path.join(src, "zarr.json")):
            return "zarr"
        raise UnsupportedFormatError(
            f"{src}: a folder that is neither a Minari dataset (data/metadata.json + main_data.hdf5) "
            "nor a zarr export of mmreplay"
        )
    with open(src, "rb") as f:
        head = f.read(8)
    if head[:4] == b"PK\x03\x04":
        return "npz"
    if head == b"\x89HDF\r\n\x1a\n":
        import h5py

        with h5py.File(src, "r") as f:
            if "mmreplay" in f.attrs:
                return "hdf5"
            if "observations" in f:
                return "d4rl"
        raise UnsupportedFormatError(f"{src}: an HDF5 file with no 'observations' (not D4RL-style)")
    raise UnsupportedFormatError(f"{src}: not a Minari dataset, an HDF5 file or an npz file")


# --- sources: a spec, roles, env count, step count, and blocks of steps ----------------------


@dataclass
class Source:
    spec: Any
    num_envs: int
    steps: int
    blocks: Callable[[], Iterator[list[np.ndarray]]]  # leaves [k, num_envs, *shape], flatten order
    roles: dict[str, str] | None = None
    episodes: int | None = None


def _nest(paths: list[str], specs: list[ArraySpec]) -> dict[str, Any]:
    """A dict nest from ``/``-joined leaf paths."""
    root: dict[str, Any] = {}
    for path, spec in zip(paths, specs):
        node = root
        parts = path.split("/")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise BadInputError(f"leaf {path!r} nests under {part!r}, which is itself a leaf")
            node = nxt
        if parts[-1] in node:
            raise BadInputError(f"leaf {path!r} appears twice")
        node[parts[-1]] = spec
    return root


def _block_steps(step_bytes: int) -> int:
    return max(1, BLOCK_BYTES // max(1, step_bytes))


def _arrays_source(
    arrays: Mapping[str, Any], meta: dict[str, Any] | None, num_envs: int | None, where: str
) -> Source:
    """A source over arrays ``[T, (num_envs,) *shape]`` keyed by leaf path."""
    if meta is not None:
        if meta.get("format") != ARRAYS_FORMAT:
            raise UnsupportedFormatError(
                f"{where}: written as {meta.get('format')!r}, expected {ARRAYS_FORMAT!r}"
            )
        spec = spec_from_json(meta["spec"])
        paths = leaf_paths(spec)
        missing = [p for p in paths if p not in arrays]
        if missing:
            raise CorruptBufferError(f"{where}: arrays missing for leaves {missing}")
        envs = int(meta["num_envs"])
        roles = meta.get("roles")
    else:
        paths = sorted(k for k in arrays if not k.startswith("__"))
        if not paths:
            raise BadInputError(f"{where}: holds no arrays")
        envs = num_envs or 1
        lead = 2 if num_envs else 1
        specs = []
        for p in paths:
            a = arrays[p]
            if len(a.shape) < lead or (num_envs and a.shape[1] != num_envs):
                want = "[T, num_envs, ...]" if num_envs else "[T, ...]"
                raise BadInputError(f"{where}: array {p!r} has shape {tuple(a.shape)}, expected {want}")
            specs.append(ArraySpec(a.shape[lead:], a.dtype))
        spec = _nest(paths, specs)
        paths = leaf_paths(spec)
        roles = None
    lengths = {p: int(arrays[p].shape[0]) for p in paths}
    if len(set(lengths.values())) > 1:
        raise BadInputError(f"{where}: arrays differ in length: {lengths}")
    steps = next(iter(lengths.values()))
    specs = flatten(spec)
    k = _block_steps(envs * sum(s.nbytes for s in specs))

    def blocks() -> Iterator[list[np.ndarray]]:
        for a in range(0, steps, k):
            b = min(steps, a + k)
            out = []
            for p, s in zip(paths, specs):
                v = np.asarray(arrays[p][a:b])
                out.append(v.reshape(b - a, envs, *s.shape))
            yield out

    return Source(spec, envs, steps, blocks, roles)


class _NpyMember:
    """One ``.npy`` member of an npz, sliced along its first axis by streaming reads."""

    def __init__(self, zf: zipfile.ZipFile, name: str):
        self.zf, self.name = zf, name
        with zf.open(name) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            self.offset = f.tell()
        if dtype.hasobject:
            raise BadInputError(f"npz member {name!r} holds Python objects; refusing to unpickle")
        if fortran and len(shape) > 1:
            raise UnsupportedFormatError(f"npz member {name!r} is Fortran-ordered")
        self.shape, self.dtype = tuple(shape), dtype
        self.row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self._f: Any = None
        self._pos = 0

    def __getitem__(self, sl: slice) -> np.ndarray:
        a, b, _ = sl.indices(self.shape[0])
        if self._f is None or a < self._pos:
            if self._f is not None:
                self._f.close()
            self._f = self.zf.open(self.name)
            self._f.read(self.offset)
            self._pos = 0
        if a > self._pos:
            self._f.read((a - self._pos) * self.row)
        data = self._f.read((b - a) * self.row)
        self._pos = b
        return np.frombuffer(data, self.dtype).reshape(b - a, *self.shape[1:])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def _npz_source(src: str, num_envs: int | None) -> tuple[Source, Callable[[], None]]:
    zf = zipfile.ZipFile(src)
    members = {}
    meta = None
    for name in zf.namelist():
        if not name.endswith(".npy"):
            continue
        key = name[:-4]
        if key == "__mmreplay__":
            arr = np.load(zf.open(name), allow_pickle=False)
            meta = json.loads(str(arr))
            continue
        members[key] = _NpyMember(zf, name)

    def close() -> None:
        for m in members.values():
            m.close()
        zf.close()

    try:
        return _arrays_source(members, meta, num_envs, src), close
    except BaseException:
        close()
        raise


def _hdf5_source(src: str) -> tuple[Source, Callable[[], None]]:
    import h5py

    f = h5py.File(src, "r")
    try:
        meta = json.loads(f.attrs["mmreplay"])
        arrays = {p: f[p] for p in leaf_paths(spec_from_json(meta["spec"])) if p in f}
        return _arrays_source(arrays, meta, None, src), f.close
    except BaseException:
        f.close()
        raise


def _zarr_source(src: str) -> tuple[Source, Callable[[], None]]:
    import zarr

    g = zarr.open_group(src, mode="r")
    meta = dict(g.attrs).get("mmreplay")
    if not isinstance(meta, dict):
        raise UnsupportedFormatError(
            f"{src}: a zarr group that is not an mmreplay export (no 'mmreplay' attribute)"
        )
    arrays = {p: g[p] for p in leaf_paths(spec_from_json(meta["spec"])) if p in g}
    return _arrays_source(arrays, meta, None, src), lambda: None


def _d4rl_source(src: str) -> tuple[Source, Callable[[], None]]:
    import h5py

    f = h5py.File(src, "r")
    try:
        if "observations" not in f:
            raise UnsupportedFormatError(f"{src}: no 'observations' dataset; not a D4RL-style file")
        obs = f["observations"]
        steps = len(obs) if isinstance(obs, h5py.Dataset) else len(next(iter(_datasets(obs).values())))
        arrays: dict[str, Any] = {}
        for name, dset in _datasets(f).items():
            top = name.split("/")[0]
            if top == "metadata" or dset.ndim == 0 or dset.shape[0] != steps:
                log.info("%s: skipping %r (not one row per step)", src, name)
                continue
            arrays[name] = dset
        return _arrays_source(arrays, None, None, src), f.close
    except BaseException:
        f.close()
        raise


def _datasets(group: Any, prefix: str = "") -> dict[str, Any]:
    import h5py

    out = {}
    for key in group:
        item = group[key]
        name = f"{prefix}{key}"
        if isinstance(item, h5py.Dataset):
            out[name] = item
        elif isinstance(item, h5py.Group):
            out.update(_datasets(item, name + "/"))
    return out


# --- Minari ------------------------------------------------------------------------------


def space_spec(space: Any, where: str) -> Any:
    """An ArraySpec nest from a serialized gymnasium space (minari.serialization's JSON)."""
    if isinstance(space, str):
        space = json.loads(space)
    kind = space.get("type") if isinstance(space, dict) else None
    if kind == "Box":
        return ArraySpec(tuple(space["shape"]), space["dtype"])
    if kind == "Discrete":
        return ArraySpec((), space.get("dtype", "int64"))
    if kind == "MultiDiscrete":
        return ArraySpec((len(space["nvec"]),), space.get("dtype", "int64"))
    if kind == "MultiBinary":
        n = space["n"]
        return ArraySpec(tuple(n) if isinstance(n, list) else (n,), "int8")
    if kind == "Dict":
        return {k: space_spec(v, f"{where}/{k}") for k, v in space["subspaces"].items()}
    if kind == "Tuple":
        return tuple(space_spec(v, f"{where}/{i}") for i, v in enumerate(space["subspaces"]))
    raise UnsupportedFormatError(f"{where}: space type {kind!r} cannot be stored")


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


def _minari_source(src: str) -> tuple[Source, Callable[[], None]]:
    import h5py

    data = _minari_data_dir(src)
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
    obs_spec = space_spec(meta["observation_space"], "observation")
    act_spec = space_spec(meta["action_space"], "action")
    jpeg = bool(meta.get("jpeg_encoding", True))
    f = h5py.File(os.path.join(data, "main_data.hdf5"), "r")
    try:
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
        spec = {
            "observation": obs_spec,
            "action": act_spec,
            "reward": ArraySpec((), rew_dtype),
            "terminated": ArraySpec((), "bool"),
            "truncated": ArraySpec((), "bool"),
            "next_observation": obs_spec,
        }
        steps = sum(int(f[n]["rewards"].shape[0]) for n in names)
        specs = flatten(spec)
        k = _block_steps(sum(s.nbytes for s in specs))

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
            return [np.asarray(a).reshape(n, 1, *s.shape) for a, s in zip(flatten(step), specs)]

        def blocks() -> Iterator[list[np.ndarray]]:
            pending: list[list[np.ndarray]] = []
            count = 0
            for name in names:
                leaves = episode_steps(name)
                pending.append(leaves)
                count += len(leaves[0])
                if count >= k:
                    yield [np.concatenate(parts) for parts in zip(*pending)]
                    pending, count = [], 0
            if pending:
                yield [np.concatenate(parts) for parts in zip(*pending)]

        return Source(spec, 1, steps, blocks, None, len(names)), f.close
    except BaseException:
        f.close()
        raise


# --- the import ---------------------------------------------------------------------------------


def import_dataset(
    src: str | os.PathLike,
    path: str | os.PathLike,
    format: str = "auto",  # noqa: A002 - the CLI option's name
    backend: str = "zarr",
    compression: Any = None,
    chunk_steps: Any = None,
    capacity: int | None = None,
    num_envs: int | None = None,
    commit_every: int | None = None,
    progress: Callable[[int], Any] | None = None,
) -> ImportResult:
    """Create a store at ``path`` holding the dataset at ``src``.

    Args:
        src: a Minari dataset folder, a D4RL-style HDF5 file, an npz file, or an hdf5 /
            zarr step-major export of mmreplay.
        path: the new store: it must not exist, and may not lie inside ``src``.
        format: ``"auto"`` (from the contents) or one of :data:`FORMATS`.
        backend, compression, chunk_steps: as :func:`mmreplay.create`.
        capacity: steps the store holds; default exactly the dataset's steps.
        num_envs: for a plain npz, read arrays as ``[T, num_envs, *shape]``.
        commit_every: as :func:`mmreplay.create`; default one commit per block.
        progress: called with the rows written after each block.

    Returns:
        An :class:`ImportResult`.
    """
    src = os.fspath(src)
    fmt = detect_format(src) if format in (None, "auto") else str(format).lower()
    path = check_target(path, [src], what="imported store")
    if fmt not in FORMATS:
        raise UnsupportedFormatError(
            f"unknown import format {format!r}; expected one of auto, {', '.join(FORMATS)}"
        )
    if num_envs is not None and fmt != "npz":
        raise BadInputError(f"num_envs applies to a plain npz import, not to {fmt}")
    if fmt == "npz":
        source, close = _npz_source(src, num_envs)
    elif fmt == "hdf5":
        source, close = _hdf5_source(src)
    elif fmt == "zarr":
        source, close = _zarr_source(src)
    elif fmt == "d4rl":
        source, close = _d4rl_source(src)
    else:
        source, close = _minari_source(src)
    try:
        cap = capacity if capacity is not None else max(1, source.steps)
        kwargs: dict[str, Any] = {}
        if commit_every is not None:
            kwargs["commit_every"] = commit_every
        else:
            kwargs["commit_every"] = max(1, min(cap, 1 << 30))
        store = create(
            path,
            source.spec,
            capacity=cap,
            num_envs=source.num_envs,
            backend=backend,
            compression=compression,
            chunk_steps=chunk_steps,
            roles=source.roles,
            **kwargs,
        )
        try:
            for leaves in source.blocks():
                store.extend(unflatten(source.spec, leaves))
                store.commit()
                if progress is not None:
                    progress(len(leaves[0]) * source.num_envs)
            store.close()
        except BaseException:
            store.close()
            shutil.rmtree(path, ignore_errors=True)
            raise
    finally:
        close()
    return ImportResult(os.path.abspath(path), fmt, source.steps, source.num_envs, source.episodes)
