"""What every format shares: the target path, the role view of episodes, step blocks,
and the source an import reads (a spec, roles, and blocks of steps).

Exports are written under a temporary name beside the target and renamed into place when
complete (:class:`mmreplay.files.AtomicOutput`), so an interrupted export leaves nothing
half-made. An existing
target is replaced only with ``force``, and only when it is an earlier export of the same
format (:data:`RECOGNISERS` tell one by what mmreplay writes into it); the source store,
and anything inside it, is never a target. Nothing is written outside the target's
folder: names that come from the store (leaf paths, dataset ids) are validated first.
"""

from __future__ import annotations

import gzip
import importlib
import json
import os
import re
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..codecs import LEVELS, parse
from ..episodes import fresh_envs
from ..errors import BadInputError, CorruptBufferError, OverwrittenError, SpecError, UnsupportedFormatError
from ..files import AtomicOutput, check_target, disk_usage
from ..io import is_url
from ..roles import subtree
from ..spec import ArraySpec, flatten, leaf_paths, spec_from_json, spec_to_json

__all__ = [
    "Exportable",
    "ExportOptions",
    "ExportResult",
    "Episodes",
    "Roles",
    "StepBlocks",
    "RECOGNISERS",
    "Target",
    "check_compression",
    "episode_flags",
    "source_name",
]

#: bytes of store data read per block by the step-major exporters
BLOCK_BYTES = 32 << 20
#: what a step-major export records in its ``mmreplay`` metadata (:func:`spec_json`)
ARRAYS_FORMAT = "mmreplay-arrays/1"

Progress = Callable[[int], Any]


class Exportable(Protocol):
    """What a writer reads: an open :class:`mmreplay.Store`, or a group's shards joined
    as one (:class:`mmreplay.joined.JoinedShards`)."""

    path: str
    spec: Any
    roles: dict[str, str]
    attrs: dict[str, Any]
    num_envs: int
    leaf_paths: list[str]
    first_step: int
    committed_steps: int

    def __len__(self) -> int: ...
    def read_steps(self, steps: Any, leaves: list[int] | None = None) -> list[np.ndarray]: ...
    def episodes(self, env: int | None = None, complete_only: bool = False) -> Iterator[Any]: ...
    def episode_index(self, env: int | None = None, complete_only: bool = False) -> list[Any]: ...


class Joinable(Protocol):
    """A group of stores, exported as its shards joined one after another."""

    def joined(self) -> Exportable: ...


@dataclass(frozen=True)
class ExportOptions:
    """What every writer takes (as :func:`mmreplay.formats.export` says); a format's own
    options are keywords of its ``write``."""

    compression: str | None = None
    complete_only: bool = False
    force: bool = False
    progress: Progress = lambda rows: None


def need(module: str, what: str, extra: str) -> Any:
    """An optional dependency, imported when used, or an ImportError naming the extra
    that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        name = module.split(".")[0]
        raise ImportError(f"{what} needs {name}: pip install 'mmreplay[{extra}]' ({exc})") from exc


def pyarrow(what: str, extra: str) -> tuple[Any, Any]:
    """``pyarrow`` and ``pyarrow.parquet`` (:func:`need`)."""
    return need("pyarrow", what, extra), need("pyarrow.parquet", what, extra)


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        format: the format name.
        path: the file or folder a loader opens (for Minari, the dataset's ``data`` folder).
        episodes: episodes written (0 for the step-major formats).
        steps: rows written (steps x envs for the step-major formats).
        nbytes: bytes on disk of what was written.
        info: format-specific facts (the Minari dataset id, the parquet files...).
    """

    format: str
    path: str
    episodes: int
    steps: int
    nbytes: int
    info: dict[str, Any] = field(default_factory=dict)


#: where a format's writer takes other levels than ``LEVELS`` gives (None: no level)
FORMAT_LEVELS: dict[str, dict[str, tuple[int, int] | None]] = {
    "csv": {"gzip": None},
    "parquet": {"gzip": (1, 9), "lz4": (1, 12)},  # pyarrow's ranges
}


def accepted_codecs(fmt: str, allowed: Sequence[str]) -> dict[str, tuple[int, int] | None]:
    """codec -> level range, for the codec names a format's writer takes."""
    levels = {**LEVELS, **FORMAT_LEVELS.get(fmt, {})}
    return {c: levels.get(c) for c in allowed if c != "none"}


def check_compression(fmt: str, compression: str | None, allowed: Sequence[str]) -> str | None:
    """The compression a format accepts, lower-cased, or a one-line error naming what it takes."""
    if compression is None:
        return None
    text = str(compression).lower()
    if text in ("none", "off", ""):
        return None
    parse(text, accepted_codecs(fmt, allowed), f"{fmt} export", BadInputError)
    return text


#: HDF5 root attribute (or zip member) naming the format an export was written as
EXPORT_MARK = "mmreplay_export"


def _hdf5_attrs(path: str) -> dict[str, Any]:
    """The root attributes of an HDF5 file ({} for anything else), opened read-only."""
    import h5py

    if not (os.path.isfile(path) and h5py.is_hdf5(path)):
        return {}
    with h5py.File(path, "r") as f:
        return {k: f.attrs[k] for k in f.attrs} | {"/": set(f)}


def _hdf5_marked(fmt: str, *legacy: Callable[[dict[str, Any]], bool]) -> Callable[[str], bool]:
    def recognise(path: str) -> bool:
        attrs = _hdf5_attrs(path)
        mark = attrs.get(EXPORT_MARK)
        if isinstance(mark, bytes):
            mark = mark.decode()
        return mark == fmt or (bool(attrs) and any(test(attrs) for test in legacy))

    return recognise


def _zip_members(path: str) -> list[str]:
    if not (os.path.isfile(path) and zipfile.is_zipfile(path)):
        return []
    with zipfile.ZipFile(path) as zf:
        return zf.namelist()


def _json_file(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return json.loads(f.read(1 << 20))


def _recognise_npz(path: str) -> bool:
    return "__mmreplay__.npy" in _zip_members(path)


def _recognise_pt(path: str) -> bool:
    return any(name.rsplit("/", 1)[-1] == EXPORT_MARK for name in _zip_members(path))


def _recognise_zarr(path: str) -> bool:
    meta = _json_file(os.path.join(path, "zarr.json"))
    attrs = meta.get("attributes", {}) if isinstance(meta, dict) else {}
    info = attrs.get("mmreplay") if isinstance(attrs, dict) else None
    return isinstance(info, dict) and info.get("format") == ARRAYS_FORMAT


def _recognise_parquet(path: str) -> bool:
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if not names or not all(re.fullmatch(r"part-\d{5}\.parquet", n) for n in names):
        return False
    import pyarrow.parquet as pq

    return b"mmreplay" in (pq.read_schema(os.path.join(path, names[0])).metadata or {})


def _recognise_minari(path: str) -> bool:
    meta = _json_file(os.path.join(path, "data", "metadata.json"))
    return isinstance(meta, dict) and meta.get("algorithm_name") == "mmreplay export"


def is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _recognise_csv(path: str) -> bool:
    """A csv export, gzipped or not: its first line starts with the step and env columns."""
    if not os.path.isfile(path):
        return False
    with (gzip.open if is_gzip(path) else open)(path, "rb") as f:
        return f.readline(16).startswith(b"step,env,")


#: format -> how an earlier export of it is recognised (by what mmreplay writes into it)
RECOGNISERS: dict[str, Callable[[str], bool]] = {
    "npz": _recognise_npz,
    "pt": _recognise_pt,
    "zarr": _recognise_zarr,
    "parquet": _recognise_parquet,
    "minari": _recognise_minari,
    "csv": _recognise_csv,
    "hdf5": _hdf5_marked("hdf5", lambda a: "mmreplay" in a),
    "d4rl": _hdf5_marked("d4rl", lambda a: "source" in a and {"episode_starts", "episode_envs"} <= a["/"]),
    "d3rlpy": _hdf5_marked("d3rlpy"),
}


class Target(AtomicOutput):
    """An export's output (:class:`mmreplay.files.AtomicOutput`), checked first: an existing
    target is replaced only with ``force``, and only when it is an earlier export of this
    format (``recognise`` tells one, default ``RECOGNISERS[fmt]``) or an empty folder, for
    a folder format; never the source store's folder, one inside it or one holding it.
    """

    def __init__(
        self,
        out: str,
        kind: str,
        fmt: str,
        store: Exportable,
        options: ExportOptions,
        *,
        recognise: Callable[[str], bool] | None = None,
    ):
        self.fmt = fmt
        known = recognise or RECOGNISERS.get(fmt)

        def replaceable(path: str) -> bool:
            if kind == "folder" and os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
                return True
            return known is not None and known(path)

        what = f"{fmt} export"
        out = check_target(out, [store.path], what=what, force=options.force, recognise=replaceable)
        super().__init__(out, kind, what)

    def finish(
        self, episodes: int, steps: int, info: dict[str, Any] | None = None, inside: str = ""
    ) -> ExportResult:
        """Renames the complete export into place (:meth:`commit`) and says what it wrote;
        ``inside`` names what a loader opens within a folder target."""
        path = os.path.join(self.commit(), inside) if inside else self.commit()
        nbytes = os.path.getsize(path) if self.kind == "file" else disk_usage(path)
        return ExportResult(self.fmt, path, episodes, steps, nbytes, info or {})

    def path(self, *parts: str) -> str:
        """A path inside the temporary target (a folder target), checked to stay inside."""
        if self.kind == "file":
            if parts:
                raise ValueError("a file target has no inner paths")
            return self.tmp
        joined = os.path.normpath(os.path.join(self.tmp, *parts))
        if os.path.commonpath([joined, self.tmp]) != self.tmp:
            raise BadInputError(f"export path {os.path.join(*parts)!r} leaves the target folder {self.out}")
        return joined


# --- roles -----------------------------------------------------------------------------

#: the roles the episode formats write as fields of their own; other leaves are extras
FIELD_ROLES = ("observation", "next_observation", "action", "reward", "terminated", "truncated")


@dataclass(frozen=True)
class Roles:
    """The store's roles resolved against its spec.

    ``observation`` etc. are role paths (None when the store has no such role); ``spec_of``
    gives the sub-spec (a leaf or a nest) at a role path.
    """

    spec: Any
    paths: tuple[str, ...]
    roles: dict[str, str]

    @classmethod
    def of(cls, store: Exportable) -> Roles:
        return cls(store.spec, tuple(leaf_paths(store.spec)), dict(store.roles))

    def get(self, role: str) -> str | None:
        return self.roles.get(role)

    def need(self, fmt: str, *roles: str) -> list[str]:
        """The paths of roles a format cannot do without."""
        for role in roles:
            if role not in self.roles:
                known = ", ".join(f"{r}={p}" for r, p in sorted(self.roles.items())) or "none"
                a = "an" if role[0] in "aeiou" else "a"
                raise BadInputError(
                    f"{fmt} export needs {a} {role} leaf, and the store has none (its roles: {known}); "
                    "give roles= when creating the store"
                )
        return [self.roles[role] for role in roles]

    def spec_of(self, path: str) -> Any:
        return subtree(self.spec, path)

    def leaves_of(self, path: str) -> list[str]:
        """Leaf paths under a role path, in flatten order."""
        return [p for p in self.paths if p == path or p.startswith(path + "/")]

    def extras(self, used: Sequence[str] = FIELD_ROLES) -> list[str]:
        """Leaf paths not under any of the given role names."""
        taken = {leaf for role in used if role in self.roles for leaf in self.leaves_of(self.roles[role])}
        return [p for p in self.paths if p not in taken]


def source_name(store: Exportable) -> str:
    """Where an export came from, as its metadata records it: the store's URL, or its
    folder's absolute path."""
    return store.path if is_url(store.path) else os.path.abspath(store.path)


def nest_leaves(name: str, spec: Any, value: Any) -> Iterator[tuple[str, ArraySpec, Any]]:
    """``(name/<leaf path>, leaf spec, leaf value)`` for each leaf of a nest; ``name``
    alone for a leaf."""
    if isinstance(spec, ArraySpec):
        return iter([(name, spec, value)])
    return zip([f"{name}/{p}" for p in leaf_paths(spec)], flatten(spec), flatten(value))


def info_key(path: str) -> str:
    """Where a leaf with no role goes: ``infos/<leaf path>``; a leaf already under
    ``infos`` (a D4RL or Minari dataset imported earlier) keeps its path, so nothing nests twice."""
    return path if path.startswith("infos/") else f"infos/{path}"


def episode_flags(episode: Any, truncated: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``terminations`` and ``truncations`` of length N: only the last step may be set.

    They follow how the last step ended (``episode.ended``), also for an episode whose
    start the ring overwrote: a real terminal stays terminal. An episode still running
    at the end of the stream is marked truncated. A step that both terminated and was
    truncated counts as terminated (terminals and timeouts are never both set, as d3rlpy
    and D4RL require), unless ``truncated`` names the truncated leaf (Minari, parquet):
    then its value on the last step is kept beside the terminal.
    """
    n = episode.length
    term = np.zeros(n, bool)
    trunc = np.zeros(n, bool)
    if n:
        ended = episode.ended or episode.status
        term[-1] = ended == "terminated"
        trunc[-1] = not term[-1]
        if term[-1] and truncated is not None:
            trunc[-1] = bool(np.asarray(subtree(episode.data, truncated))[-1])
    return term, trunc


class Episodes:
    """The episodes an episode format writes, env by env in time order (``complete_only``
    as asked, empty ones left out), with their count and steps from the episode index.
    Iterating reports progress as each episode is done."""

    def __init__(self, store: Exportable, options: ExportOptions):
        self.store, self.options = store, options
        spans = store.episode_index(complete_only=options.complete_only)
        self.count, self.steps = len(spans), sum(int(s.length) for s in spans)

    def __iter__(self) -> Iterator[Any]:
        store = self.store
        ticker = Ticker(self.options.progress, len(store) * store.num_envs, max(1, self.steps))
        for ep in store.episodes(complete_only=self.options.complete_only):
            if ep.length:
                yield ep
            ticker.advance(ep.length)


# --- step-major reading --------------------------------------------------------------


class StepBlocks:
    """The retained committed steps in time order, read in blocks of bounded size.

    Yields ``(first_global_step, leaves)`` with each leaf ``[k, num_envs, *shape]`` in
    flatten order (only those indexed by ``leaves`` when given). A block is about
    ``block_bytes``; ``progress`` is told a block's rows once the caller is done with it.
    """

    def __init__(
        self,
        store: Exportable,
        progress: Progress | None = None,
        block_bytes: int = BLOCK_BYTES,
        leaves: list[int] | None = None,
    ):
        self.store, self.progress, self.leaves = store, progress, leaves
        self.first = int(store.first_step)
        self.end = int(store.committed_steps)
        self.steps = max(0, self.end - self.first)
        self.rows = self.steps * store.num_envs
        specs: list[ArraySpec] = flatten(store.spec)
        if leaves is not None:
            specs = [specs[i] for i in leaves]
        self.block = block_steps(store.num_envs * sum(s.nbytes for s in specs), block_bytes)

    def __iter__(self) -> Iterator[tuple[int, list[np.ndarray]]]:
        for a in range(self.first, self.end, self.block):
            b = min(self.end, a + self.block)
            try:
                leaves = self.store.read_steps(np.arange(a, b), leaves=self.leaves)
            except OverwrittenError as exc:
                raise exc.by("the export") from None
            yield a, leaves
            if self.progress is not None:
                self.progress((b - a) * self.store.num_envs)

    def fill(self, arrays: Sequence[Any]) -> None:
        """Copies every block into ``arrays``, one ``[steps, num_envs, *shape]`` per leaf."""
        for a, leaves in self:
            for arr, values in zip(arrays, leaves):
                arr[a - self.first : a - self.first + len(values)] = values


def spec_json(store: Exportable) -> dict[str, Any]:
    """What a step-major export records about its source, enough to import it back."""
    return {
        "format": ARRAYS_FORMAT,
        "spec": spec_to_json(store.spec),
        "roles": dict(store.roles),
        "num_envs": int(store.num_envs),
        "first_step": int(store.first_step),
        # envs whose first retained episode starts whole at first_step (see convert.begin_at)
        "fresh_envs": fresh_envs(store, int(store.first_step)),
        "steps": int(len(store)),
        "leaves": list(leaf_paths(store.spec)),
        # a group's joined shards: where each shard's steps begin
        **getattr(store, "export_info", {}),
    }


class Ticker:
    """Turns work done in any unit into the row counts ``progress`` expects."""

    def __init__(self, progress: Progress, rows: int, work: int):
        self.progress = progress
        self.rows = rows
        self.work = max(1, work)
        self.done = 0
        self.reported = 0

    def advance(self, work: int) -> None:
        self.done += work
        rows = min(self.rows, self.rows * self.done // self.work)
        if rows > self.reported:
            self.progress(rows - self.reported)
            self.reported = rows


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
    # steps (from the first) after which every env's open episode ends: a group's shards
    breaks: tuple[int, ...] = ()


def nest(paths: list[str], specs: list[ArraySpec]) -> dict[str, Any]:
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


def block_steps(step_bytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Steps of ``step_bytes`` each in a block of about ``block_bytes``."""
    return max(1, block_bytes // max(1, step_bytes))


def arrays_source(
    arrays: Mapping[str, Any], meta: dict[str, Any] | None, num_envs: int | None, where: str
) -> Source:
    """A source over arrays ``[T, (num_envs,) *shape]`` keyed by leaf path (an HDF5 file or a
    zarr group is such a mapping)."""
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
        if num_envs is not None and num_envs != envs:
            raise BadInputError(
                f"{where}: an mmreplay export of {envs} envs, which it records; num_envs={num_envs} "
                "applies to a plain npz only (leave it out)"
            )
        roles = meta.get("roles")
        first_step = int(meta.get("first_step", 0))
        # older exports do not say which episodes start whole: only from step 0 on
        fresh = meta.get("fresh_envs", None if first_step == 0 else [])
        # a group's export: no episode runs on from one shard into the next
        breaks = tuple(int(shard["first_step"]) for shard in meta.get("shards", [])[1:])
    else:
        paths = sorted(arrays)
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
            try:
                specs.append(ArraySpec(a.shape[lead:], a.dtype))
            except SpecError as exc:
                raise SpecError(f"{where}: array {p!r}: {exc}") from None
        spec = nest(paths, specs)
        paths = leaf_paths(spec)
        roles = None
        first_step, fresh, breaks = 0, None, ()
    lengths = {p: int(arrays[p].shape[0]) for p in paths}
    if len(set(lengths.values())) > 1:
        raise BadInputError(f"{where}: arrays differ in length: {lengths}")
    steps = next(iter(lengths.values()))
    specs = flatten(spec)
    k = block_steps(envs * sum(s.nbytes for s in specs))

    def blocks() -> Iterator[list[np.ndarray]]:
        for a in range(0, steps, k):
            b = min(steps, a + k)
            out = []
            for p, s in zip(paths, specs):
                v = np.asarray(arrays[p][a:b])
                out.append(v.reshape(b - a, envs, *s.shape))
            yield out

    return Source(spec, envs, steps, blocks, roles, first_step=first_step, fresh=fresh, breaks=breaks)


def episodes_source(
    spec: Any,
    episodes: list[Any],
    load: Callable[[Any], list[np.ndarray]],
    roles: dict[str, str] | None = None,
    attrs: dict[str, Any] | None = None,
) -> Source:
    """One env, episodes one after another, joined into blocks of about :data:`BLOCK_BYTES`;
    ``episodes`` are ``(episode, steps)`` pairs and ``load(episode)`` gives its leaves
    ``[n, *shape]``."""
    specs = flatten(spec)
    k = block_steps(sum(s.nbytes for s in specs))

    def blocks() -> Iterator[list[np.ndarray]]:
        pending: list[list[np.ndarray]] = []
        count = 0
        for episode, _ in episodes:
            pending.append([np.asarray(a).reshape(-1, 1, *s.shape) for a, s in zip(load(episode), specs)])
            count += len(pending[-1][0])
            if count >= k:
                yield [np.concatenate(parts) for parts in zip(*pending)]
                pending, count = [], 0
        if pending:
            yield [np.concatenate(parts) for parts in zip(*pending)]

    steps = sum(int(n) for _, n in episodes)
    return Source(spec, 1, steps, blocks, roles, len(episodes), attrs=attrs)
