"""Import offline datasets into a new store: Minari, D4RL-style HDF5, npz, and every
export mmreplay writes (npz, hdf5, zarr, parquet, d3rlpy, pt, csv).

- Minari (a datasets root holding one dataset, a dataset folder ``<root>/<id>`` or its
  ``data`` folder, HDF5 format): one env, episodes one after another, leaves
  ``observation``, ``action``, ``reward``, ``terminated``, ``truncated`` and
  ``next_observation`` (the observation after each step), plus the episodes' ``infos``
  under ``infos/``. Spaces come from ``metadata.json`` (read as JSON; gymnasium is not
  needed) and are kept in the store's attrs, dtypes from the arrays themselves.
- D4RL-style HDF5: one env, every top-level dataset of length T as a leaf under its own
  name (``observations``, ``actions``, ``rewards``, ``terminals``, ``timeouts``,
  ``next_observations``, ``infos/...``), so the roles are inferred from the names.
- d3rlpy (``ReplayBuffer.dump`` HDF5): one env, leaves ``observation`` (a tuple for
  tuple observations), ``action``, ``reward``, ``terminated``, ``truncated``.
- parquet exports of mmreplay: one env, episodes one after another, every leaf of the
  source spec with its dtype and shape (from the schema's metadata).
- npz: arrays keyed by leaf path (``/`` nests them). An npz written by ``mmreplay
  export`` carries its spec, roles and env count, and comes back exactly, as do its
  hdf5 and zarr exports: the same global step ids and each episode's status (an episode
  whose start the ring had overwritten stays ``"open"``). Any other npz is read as
  ``[T, *shape]`` arrays of one env, or ``[T, num_envs, *shape]`` when ``num_envs`` is
  given.
- pt (``torch.load(weights_only=True)``, which loads tensors and never arbitrary
  objects): ``[T, num_envs, *shape]`` tensors keyed by leaf path.
- csv exports: ``step`` and ``env`` give the layout; columns ``<leaf>`` / ``<leaf>.<i>``
  become scalar / vector leaves. CSV keeps no dtypes: integer columns come back int64,
  others float64, and leaves of two or more dimensions come back flat.

Data is read and written in blocks, so a dataset larger than RAM imports in bounded
memory (except pt and csv, which are read whole). A failed import removes the store it
was creating. Nothing is unpickled.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .convert import begin_at
from .errors import BadInputError, CorruptBufferError, NotABufferError, UnsupportedFormatError
from .export.minari import SPACES_ATTR
from .files import AtomicOutput, check_target
from .spec import ArraySpec, flatten, leaf_paths, spec_from_json, unflatten
from .store import create

__all__ = ["ImportResult", "import_dataset", "detect_format", "FORMATS"]

log = logging.getLogger(__name__)

FORMATS = ("minari", "d4rl", "d3rlpy", "npz", "hdf5", "zarr", "parquet", "pt", "csv", "lerobot")
BLOCK_BYTES = 32 << 20
#: top-level D4RL keys that are no per-step leaves (mmreplay's d4rl export writes the last two)
D4RL_BOOKKEEPING = ("metadata", "episode_starts", "episode_envs")
ARRAYS_FORMAT = "mmreplay-arrays/1"


@dataclass(frozen=True)
class ImportResult:
    """What an import created: the store's path, the source format, the steps and envs."""

    path: str
    format: str
    steps: int
    num_envs: int
    episodes: int | None = None
    backend: str = "zarr"


# --- detection ---------------------------------------------------------------------------


def _is_minari_data(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "metadata.json")) and os.path.isfile(
        os.path.join(folder, "main_data.hdf5")
    )


def _minari_data_dir(src: str) -> str | None:
    """The ``data`` folder of the Minari dataset at ``src``: the data folder itself, a
    dataset folder, or a datasets root holding exactly one dataset (an ``export -f
    minari`` target). A root with several datasets is refused with their ids."""
    for cand in (os.path.join(src, "data"), src):
        if _is_minari_data(cand):
            return cand
    found = []
    for folder, dirs, _ in os.walk(src):
        dirs.sort()
        if os.path.basename(folder) == "data" and _is_minari_data(folder):
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


def _parquet_files(src: str) -> list[str]:
    return sorted(
        os.path.join(src, n) for n in os.listdir(src) if n.endswith(".parquet") and not n.startswith(".")
    )


def detect_format(src: str) -> str:
    """The format of ``src`` from its contents: one of :data:`FORMATS`."""
    if not os.path.exists(src):
        raise NotABufferError(f"{src}: no such file or folder")
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, "zarr.json")):
            return "zarr"
        if os.path.isfile(os.path.join(src, "meta", "info.json")):
            return "lerobot"
        if _parquet_files(src):
            return "parquet"
        if _minari_data_dir(src) is not None:
            return "minari"
        raise UnsupportedFormatError(
            f"{src}: a folder that is neither a Minari dataset (data/metadata.json + main_data.hdf5), "
            "a zarr export of mmreplay nor a folder of parquet files"
        )
    with open(src, "rb") as f:
        head = f.read(8)
    if head[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(src) as zf:
            names = zf.namelist()
        if any(n.endswith("/data.pkl") for n in names) and not any(n.endswith(".npy") for n in names):
            return "pt"
        return "npz"
    if head == b"\x89HDF\r\n\x1a\n":
        import h5py

        with h5py.File(src, "r") as f:
            if "mmreplay" in f.attrs:
                return "hdf5"
            if "observations" in f:
                return "d4rl"
            if "num_episodes" in f and "columns" in f:
                return "d3rlpy"
        raise UnsupportedFormatError(f"{src}: an HDF5 file with no 'observations' (not D4RL-style or d3rlpy)")
    if head[:2] == b"\x1f\x8b" or src.endswith((".csv", ".csv.gz")):
        return "csv"
    raise UnsupportedFormatError(f"{src}: not a Minari dataset, an HDF5, npz, pt, parquet or csv file")


# --- sources: a spec, roles, env count, step count, and blocks of steps ----------------------


@dataclass
class Source:
    spec: Any
    num_envs: int
    steps: int
    blocks: Callable[[], Iterator[list[np.ndarray]]]  # leaves [k, num_envs, *shape], flatten order
    roles: dict[str, str] | None = None
    episodes: int | None = None
    first_step: int = 0  # the global step id of the first step (continues the source's)
    fresh: list[int] | None = None  # envs whose first episode starts whole (None: all)
    attrs: dict[str, Any] | None = None


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
        first_step = int(meta.get("first_step", 0))
        # older exports do not say which episodes start whole: only from step 0 on
        fresh = meta.get("fresh_envs", None if first_step == 0 else [])
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
        first_step, fresh = 0, None
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

    return Source(spec, envs, steps, blocks, roles, first_step=first_step, fresh=fresh)


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
    try:
        import zarr
    except ImportError as exc:
        raise ImportError(f"importing a zarr export needs zarr-python 3: pip install 'mmreplay[zarr]' ({exc})") from exc

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
            if top in D4RL_BOOKKEEPING or dset.ndim == 0 or dset.shape[0] != steps:
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


# --- episode exports: d3rlpy, parquet --------------------------------------------------------


def _episodes_source(spec: Any, episodes: list[Any], load: Callable[[Any], list[np.ndarray]]) -> Source:
    """One env, episodes one after another; ``load(episode)`` gives its leaves ``[n, *shape]``."""
    specs = flatten(spec)
    k = _block_steps(sum(s.nbytes for s in specs))
    steps = sum(int(n) for _, n in episodes)

    def blocks() -> Iterator[list[np.ndarray]]:
        rows = ([np.asarray(a).reshape(-1, 1, *s.shape) for a, s in zip(load(e), specs)] for e, _ in episodes)
        return _grouped(rows, k)

    return Source(spec, 1, steps, blocks, None, len(episodes))


def _grouped(episodes: Iterator[list[np.ndarray]], k: int) -> Iterator[list[np.ndarray]]:
    """Episodes' leaves ``[n, 1, *shape]`` joined into blocks of about ``k`` steps."""
    pending: list[list[np.ndarray]] = []
    count = 0
    for leaves in episodes:
        pending.append(leaves)
        count += len(leaves[0])
        if count >= k:
            yield [np.concatenate(parts) for parts in zip(*pending)]
            pending, count = [], 0
    if pending:
        yield [np.concatenate(parts) for parts in zip(*pending)]


def _d3rlpy_source(src: str) -> tuple[Source, Callable[[], None]]:
    import h5py

    f = h5py.File(src, "r")
    try:
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

        first = [f[n] for n in obs_names(0)]
        obs_specs = [ArraySpec(d.shape[1:], d.dtype) for d in first]
        act = f["actions_0"]
        act_shape = act.shape[1:]
        spec = {
            "observation": obs_specs[0] if "observations_0" in f else tuple(obs_specs),
            "action": ArraySpec(act_shape, act.dtype),
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
        return _episodes_source(spec, episodes, load), f.close
    except BaseException:
        f.close()
        raise


def _parquet_source(src: str) -> tuple[Source, Callable[[], None]]:
    from .export.parquet import _pyarrow, decode_image, is_image

    pa, pq = _pyarrow()
    files = _parquet_files(src)
    schema = pq.read_schema(files[0])
    raw = (schema.metadata or {}).get(b"mmreplay")
    if raw is None:
        raise UnsupportedFormatError(f"{src}: parquet files without mmreplay's metadata (not its export)")
    meta = json.loads(raw)
    spec = spec_from_json(meta["spec"])
    roles = meta.get("roles") or {}
    columns = {p: c for c, p in meta["columns"].items()}
    flags = {roles.get("terminated"): "terminated", roles.get("truncated"): "truncated"}
    paths = leaf_paths(spec)
    specs = flatten(spec)
    missing = [p for p in paths if p not in columns and p not in flags]
    if missing:
        raise UnsupportedFormatError(f"{src}: no column holds the leaves {missing}")
    table = pq.read_table(files, columns=["episode_index"])
    ep_index = table.column("episode_index").to_numpy()
    bounds = np.flatnonzero(np.r_[True, ep_index[1:] != ep_index[:-1], True])
    episodes = [((int(a), int(b)), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]
    dataset = pq.ParquetFile(files[0]) if len(files) == 1 else None
    whole = pq.read_table(files) if dataset is None else dataset.read()

    def load(rows: tuple[int, int]) -> list[np.ndarray]:
        part = whole.slice(rows[0], rows[1] - rows[0])
        out = []
        for p, s in zip(paths, specs):
            column = part.column(columns[p] if p in columns else flags[p])
            if p in columns and is_image(s):
                values = decode_image(column, s.shape, s.dtype)
            elif s.shape:
                values = np.asarray(column.combine_chunks().flatten().to_numpy(zero_copy_only=False))
            else:
                values = column.to_numpy()
            out.append(np.asarray(values).astype(s.dtype, copy=False).reshape(-1, *s.shape))
        return out

    source = _episodes_source(spec, episodes, load)
    source.roles = roles
    return source, lambda: None


# --- pt, csv: read whole -------------------------------------------------------------------


def _pt_source(src: str) -> tuple[Source, Callable[[], None]]:
    try:
        import torch
    except ImportError as exc:
        raise ImportError("importing a pt file needs PyTorch: pip install 'mmreplay[torch]'") from exc
    try:
        data = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch's restricted loader refuses anything but tensors
        raise BadInputError(f"{src}: not tensors that torch.load(weights_only=True) reads: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise BadInputError(f"{src}: expected a dict of leaf path -> [steps, num_envs, ...] tensors")
    arrays = {k: v.numpy() for k, v in data.items()}
    shapes = {k: a.shape for k, a in arrays.items()}
    if not arrays or any(len(s) < 2 for s in shapes.values()):
        raise BadInputError(f"{src}: expected [steps, num_envs, ...] tensors, got shapes {shapes}")
    envs = {s[1] for s in shapes.values()}
    if len(envs) != 1:
        raise BadInputError(f"{src}: tensors differ in num_envs: {shapes}")
    return _arrays_source(arrays, None, envs.pop(), src), lambda: None


def _csv_source(src: str) -> tuple[Source, Callable[[], None]]:
    import csv
    import gzip

    opener = gzip.open if _is_gzip(src) else open
    with opener(src, "rt", newline="") as f:
        reader = csv.reader(f)
        head = next(reader, None)
        rows = np.array([[float(x) for x in r] for r in reader], np.float64).reshape(-1, len(head or []))
    if not head or head[:2] != ["step", "env"]:
        raise UnsupportedFormatError(f"{src}: a csv without the step and env columns mmreplay writes")
    envs = int(rows[:, 1].max()) + 1 if len(rows) else 1
    steps = len(rows) // envs
    if steps * envs != len(rows) or not np.array_equal(rows[:, 1], np.tile(np.arange(envs), steps)):
        raise BadInputError(f"{src}: rows are not one per (step, env), step-major")
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(head[2:], start=2):
        leaf, dot, idx = name.rpartition(".")
        key = leaf if dot and idx.isdigit() else name
        groups.setdefault(key, []).append(i)
    arrays = {}
    for name, cols in groups.items():
        values = rows[:, cols]
        if np.all(np.isfinite(values)) and np.all(values == np.round(values)) and len(values):
            values = values.astype(np.int64)
        vector = len(cols) > 1 or head[cols[0]] != name
        arrays[name] = values.reshape(steps, envs, *((len(cols),) if vector else ()))
    source = _arrays_source(arrays, None, envs, src)
    first = int(rows[0, 0]) if len(rows) else 0
    fresh = None if first == 0 else []  # csv does not say which episodes start whole
    return Source(source.spec, envs, steps, source.blocks, None, first_step=first, fresh=fresh), lambda: None


def _is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


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
        n0 = int(first["rewards"].shape[0])
        info_paths = [
            p
            for p, d in _datasets(first["infos"]).items()
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
            spec["infos"] = _nest(info_paths, specs_of)
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
            if info_paths:
                # one row per step: Minari's DataCollector adds the reset's info in front,
                # so row i is the info that came with observation i
                step["infos"] = _nest(info_paths, [_info_rows(g, p, n, name) for p in info_paths])
            return [np.asarray(a).reshape(n, 1, *s.shape) for a, s in zip(flatten(step), specs)]

        def blocks() -> Iterator[list[np.ndarray]]:
            return _grouped((episode_steps(name) for name in names), k)

        attrs = {
            SPACES_ATTR: {
                key: meta[key] if isinstance(meta[key], str) else json.dumps(meta[key])
                for key in ("observation_space", "action_space", "env_spec")
                if meta.get(key) is not None
            }
        }
        return Source(spec, 1, steps, blocks, None, len(names), attrs=attrs), f.close
    except BaseException:
        f.close()
        raise


def _info_rows(group: Any, path: str, n: int, where: str) -> np.ndarray:
    if "infos" not in group or path not in group["infos"]:
        raise CorruptBufferError(f"{where}: infos/{path} is missing (the first episode has it)")
    values = np.asarray(group["infos"][path][()])
    if values.shape[0] not in (n, n + 1):
        raise CorruptBufferError(f"{where}: infos/{path} has {values.shape[0]} rows for {n} steps")
    return values[:n]


_SOURCES: dict[str, Callable[[str], tuple[Source, Callable[[], None]]]] = {
    "minari": _minari_source,
    "d4rl": _d4rl_source,
    "d3rlpy": _d3rlpy_source,
    "hdf5": _hdf5_source,
    "zarr": _zarr_source,
    "parquet": _parquet_source,
    "pt": _pt_source,
    "csv": _csv_source,
    "lerobot": lambda src: importlib.import_module(".export.lerobot", __package__).read_source(src),
}


# --- the import ---------------------------------------------------------------------------------


def import_dataset(
    src: str | os.PathLike,
    path: str | os.PathLike,
    format: str = "auto",  # noqa: A002 - the CLI option's name
    backend: str | None = None,
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
        backend, compression, chunk_steps: as :func:`mmreplay.create`; ``compression``
            may also be a function of the dataset's spec that returns it.
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
    else:
        source, close = _SOURCES[fmt](src)
    try:
        cap = capacity if capacity is not None else max(1, source.steps)
        kwargs: dict[str, Any] = {}
        if commit_every is not None:
            kwargs["commit_every"] = commit_every
        else:
            kwargs["commit_every"] = max(1, min(cap, 1 << 30))
        with AtomicOutput(path, "folder", "imported store") as scratch:
            store = create(
                scratch.tmp,
                source.spec,
                capacity=cap,
                num_envs=source.num_envs,
                backend=backend,
                compression=compression(source.spec) if callable(compression) else compression,
                chunk_steps=chunk_steps,
                roles=source.roles,
                **kwargs,
            )
            try:
                if source.attrs:
                    store.set_attrs(**source.attrs)
                if source.first_step:
                    fresh = range(source.num_envs) if source.fresh is None else source.fresh
                    store = begin_at(store, source.first_step, fresh)
                for leaves in source.blocks():
                    store.extend(unflatten(source.spec, leaves))
                    store.commit()
                    if progress is not None:
                        progress(len(leaves[0]) * source.num_envs)
            finally:
                store.close()
            path = scratch.commit()
            made = store.backend
    finally:
        close()
    return ImportResult(os.path.abspath(path), fmt, source.steps, source.num_envs, source.episodes, made)
