"""Offline datasets: one module per format, holding its writer and its reader, imported
only when used.

Episode formats (``minari``, ``d4rl``, ``d3rlpy``, ``parquet``, ``lerobot``) walk the store episode by
episode; an episode still running at the end of an env's stream is written as
truncated, or left out with ``complete_only`` (as is an episode whose start the ring
overwrote); an episode's last step keeps its terminal flag either way. Step-major
formats (``npz``, ``csv``, ``pt``, ``zarr``, ``hdf5``) write every retained committed step
as ``[steps, num_envs, *shape]`` arrays keyed by leaf path, in time order (the layout
skrl's ``Memory.save`` uses). Both kinds read the store in bounded blocks, so a store
larger than RAM exports in bounded memory.

Imports make a new store from any export mmreplay writes (npz, hdf5 and zarr come back
exactly: step ids, episode statuses) and from Minari, D4RL-style HDF5, d3rlpy, LeRobot
v3.0 and plain npz datasets, in bounded blocks (pt and csv are read whole); a failed
import removes the store it was making, and nothing is unpickled. What each format
keeps and how it comes back: docs/offline-datasets.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import os
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..codecs import describe
from ..convert import begin_at
from ..creation import create
from ..errors import BadInputError, CorruptBufferError, Error, NotABufferError, UnsupportedFormatError
from ..files import AtomicOutput, check_target
from ..metadata import METADATA_FILE
from ..spec import unflatten
from .base import (
    ExportOptions,
    ExportResult,
    Progress,
    accepted_codecs,
    check_compression,
)

if TYPE_CHECKING:
    from .base import Exportable, Joinable

__all__ = [
    "FORMATS",
    "FormatInfo",
    "ExportResult",
    "ImportResult",
    "compressions",
    "detect_format",
    "export",
    "format_of",
    "get",
    "import_dataset",
]


@dataclass(frozen=True)
class FormatInfo:
    """A registered format (its module in this package has its name): what OUT names,
    and whether it is written episode by episode or step-major."""

    target: str  # "file" or "folder"
    kind: str  # "episodes" or "steps"


FORMATS: dict[str, FormatInfo] = {
    "minari": FormatInfo("folder", "episodes"),
    "d4rl": FormatInfo("file", "episodes"),
    "d3rlpy": FormatInfo("file", "episodes"),
    "parquet": FormatInfo("folder", "episodes"),
    "npz": FormatInfo("file", "steps"),
    "csv": FormatInfo("file", "steps"),
    "pt": FormatInfo("file", "steps"),
    "zarr": FormatInfo("folder", "steps"),
    "hdf5": FormatInfo("file", "steps"),
    "lerobot": FormatInfo("folder", "episodes"),
}


#: file name endings that name one format, longest first (``.csv.gz`` before ``.csv``)
SUFFIXES = {".csv.gz": "csv", ".npz": "npz", ".parquet": "parquet", ".csv": "csv", ".pt": "pt", ".pth": "pt",
            ".zarr": "zarr"}
#: endings several formats write: the format must be given
AMBIGUOUS = {".h5": ("d4rl", "d3rlpy", "hdf5"), ".hdf5": ("d4rl", "d3rlpy", "hdf5")}


def format_of(out: str | os.PathLike) -> str:
    """The format an export to ``out`` writes when none is given: the one its name ends
    with (``.npz``, ``.parquet``, ``.csv``, ``.csv.gz``, ``.pt``, ``.zarr``), else
    ``minari`` (``out`` is then the datasets root). A ``.h5`` / ``.hdf5`` name is refused:
    d4rl, d3rlpy and hdf5 all write one."""
    name = os.fspath(out).rstrip("/").lower()
    for suffix, fmt in SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    for suffix, choices in AMBIGUOUS.items():
        if name.endswith(suffix):
            raise UnsupportedFormatError(
                f"{os.fspath(out)}: a {suffix} file is written by {', '.join(choices)}; name the format "
                f"(format=... in Python, --format on the command line)"
            )
    return "minari"


def get(fmt: str, what: str = "export") -> ModuleType:
    """The module of a format name (its writer and its reader)."""
    name = str(fmt).lower()
    if name not in FORMATS:
        expected = ", ".join(["auto", *FORMATS] if what == "import" else FORMATS)
        raise UnsupportedFormatError(f"unknown {what} format {fmt!r}; expected one of {expected}")
    return importlib.import_module(f"{__name__}.{name}")


def compressions() -> dict[str, str]:
    """The ``--compression`` settings each format takes, as a user writes them."""
    return {name: describe(accepted_codecs(name, get(name).COMPRESSIONS)) for name in FORMATS}


def export(
    store: Exportable | Joinable,
    out: str | os.PathLike,
    format: str | None = None,  # noqa: A002 - the CLI option's name
    compression: str | None = None,
    complete_only: bool = False,
    force: bool = False,
    progress: Progress | None = None,
    storage_options: dict[str, Any] | None = None,
    **format_options: Any,
) -> ExportResult:
    """Export a store's retained committed data to an offline format.

    Args:
        store: an open store (readers are fine, also while a writer runs; a writer
            commits first, so the export holds what is durable), or an open
            :class:`mmreplay.Group`: every shard's steps, one shard after another, as one
            dataset (episodes stay within their shard; step-major formats record where
            each shard begins, see :class:`mmreplay.joined.JoinedShards`).
        out: the file or folder to write (see :data:`FORMATS`; for ``minari`` the
            datasets root, the dataset goes to ``out/<dataset_id>/data``).
        format: one of :data:`FORMATS`; None: from ``out``'s name (see :func:`format_of`:
            ``buf.npz`` writes npz), else minari.
        compression: ``CODEC[:LEVEL]``, a codec the format supports (see
            :func:`compressions`: ``gzip``/``lzf`` for the HDF5 formats, ``snappy``/``zstd``/
            ``gzip``/``brotli``/``lz4`` for parquet, ``zstd``/``blosc``/``gzip`` for zarr,
            ``deflate`` for npz, ``gzip`` for csv).
        complete_only: leave out episodes still open at the end of an env's stream
            (episode formats).
        force: replace an existing target (an earlier export of the same format).
        progress: called with the number of rows (steps x envs) written at each block.
        storage_options: how to reach object storage when ``out`` is an ``s3://`` URL
            (else the ``AWS_*`` environment variables). Such an export is written to a
            local temporary folder first, then uploaded under the URL.
        **format_options: a format's own (``dataset_id`` for minari; ``fps``, ``task``, ``codec``...
            for lerobot; see each format module's ``write``).

    Returns:
        An :class:`ExportResult`.

    Example:
        >>> import mmreplay as mr, numpy as np, tempfile
        >>> d = tempfile.mkdtemp()
        >>> spec = {"obs": mr.ArraySpec((2,), "float32"), "reward": mr.ArraySpec((), "float32")}
        >>> with mr.create(d + "/buf", spec, capacity=10) as s:
        ...     s.extend({"obs": np.ones((3, 1, 2), "float32"), "reward": np.zeros((3, 1), "float32")})
        ...     s.commit()
        ...     export(s, d + "/buf.npz", format="npz").steps
        3
    """
    if format is None:
        format = format_of(out)  # noqa: A001
    if getattr(store, "closed", False):  # (a closed store's leaves are gone: a pt export saw none)
        store.check_open()
    joined = getattr(store, "joined", None)
    if callable(joined):  # a group: its shards' steps one after another, as one dataset
        store = joined()
    elif getattr(store, "mode", "r") == "a" and not store.closed:  # a writer commits first: what it exports is durable
        store.commit()
    module = get(format)
    name = str(format).lower()
    accepted = [p for p in inspect.signature(module.write).parameters if p not in ("store", "out", "options")]
    unknown = sorted(set(format_options) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) or "no options"
        raise TypeError(f"{name} export: unexpected options {unknown}; it takes {takes}")
    if complete_only and FORMATS[name].kind == "steps":
        *rest, last = [f for f, info in FORMATS.items() if info.kind == "episodes"]
        raise BadInputError(
            f"{name} export writes every retained step as [steps, num_envs, ...] arrays, so it cannot "
            f"leave out open episodes; --complete-only applies to {', '.join(rest)} and {last}"
        )
    compression = check_compression(name, compression, module.COMPRESSIONS)
    options = ExportOptions(compression, complete_only, force, progress or (lambda rows: None))
    if isinstance(out, str) and out.startswith("s3://"):
        from ..objstore import export_to_url

        local = dataclasses.replace(options, force=False)  # the upload decides about replacing
        return export_to_url(lambda path: module.write(store, path, local, **format_options), out, force, storage_options)
    return module.write(store, os.fspath(out), options, **format_options)


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

#: what a reader library raises on a file cut short or holding a bad value (zipfile,
#: numpy, json, gzip, h5py, pyarrow, float())
DAMAGE = (ValueError, KeyError, TypeError, EOFError, OSError, zipfile.BadZipFile)
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


@contextlib.contextmanager
def damaged(src: str, what: str) -> Iterator[None]:
    """A reader library's error about a damaged ``src`` as one error naming it."""
    try:
        yield
    except (Error, FileNotFoundError, PermissionError):
        raise
    except DAMAGE as exc:
        detail = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise CorruptBufferError(f"{src}: damaged; {what}: {detail}") from exc


def guarded(blocks: Iterator[Any], src: str, what: str) -> Iterator[Any]:
    """``blocks`` with the errors of reading them as :func:`damaged` says."""
    with damaged(src, what):
        yield from blocks


def detect_format(src: str) -> str:
    """The format of ``src`` from its contents: one of :data:`FORMATS`."""
    with damaged(src, "its format cannot be told"):
        return _detect_format(src)


def _detect_format(src: str) -> str:
    from .minari import data_dir
    from .parquet import parquet_files

    if not os.path.exists(src):
        raise NotABufferError(f"{src}: no such file or folder")
    if os.path.isdir(src):
        if os.path.isfile(os.path.join(src, "zarr.json")):
            return "zarr"
        if os.path.isfile(os.path.join(src, "meta", "info.json")):
            return "lerobot"
        if parquet_files(src):
            return "parquet"
        if data_dir(src) is not None:
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
    if head == HDF5_MAGIC:
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
    spec: Mapping[str, Any] | None = None,
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
        spec: for a csv, which keeps no dtype or shape: the ``ArraySpec`` of leaves it
            holds, by path (the others' are inferred).

    Returns:
        An :class:`ImportResult`.
    """
    src = os.fspath(src)
    if os.path.isfile(os.path.join(src, METADATA_FILE)):
        raise UnsupportedFormatError(
            f"{src}: an mmreplay store, not a dataset to import; to copy it to another backend, chunking, "
            f"compression or capacity: mmreplay convert {src} {os.fspath(path)}"
        )
    fmt = detect_format(src) if format in (None, "auto") else str(format).lower()
    path = check_target(path, [src], what="imported store")
    module = get(fmt, "import")
    reads = FORMATS[fmt].target
    if os.path.exists(src) and os.path.isdir(src) != (reads == "folder"):
        found = "a folder" if reads == "file" else "not a folder"
        raise UnsupportedFormatError(f"{src}: {found}; the {fmt} import reads a {reads}")
    given = {"num_envs": num_envs, "spec": spec}
    for name, only in (("num_envs", "npz"), ("spec", "csv")):
        if given[name] is not None and fmt != only:
            raise BadInputError(f"{name} applies to the {only} import, not to {fmt}")
    with contextlib.ExitStack() as files:  # what the reader opened, closed whatever happens
        what = f"the {fmt} import cannot read it"
        with damaged(src, what):
            source = module.read(src, files, **{k: v for k, v in given.items() if v is not None})
        cap = capacity if capacity is not None else max(1, source.steps)
        every = commit_every if commit_every is not None else max(1, min(cap, 1 << 30))
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
                commit_every=every,
            )
            try:
                if source.attrs:
                    store.set_attrs(**source.attrs)
                if source.first_step:
                    fresh = range(source.num_envs) if source.fresh is None else source.fresh
                    store = begin_at(store, source.first_step, fresh)
                done = 0
                for leaves in guarded(source.blocks(), src, what):
                    n = len(leaves[0])
                    cuts = sorted({b - done for b in source.breaks if done < b < done + n})
                    for a, b in zip([0, *cuts], [*cuts, n]):
                        store.extend(unflatten(source.spec, [v[a:b] for v in leaves]))
                        if done + b in source.breaks:
                            store.end_episodes()  # (commits)
                    store.commit()
                    done += n
                    if progress is not None:
                        progress(n * source.num_envs)
            finally:
                store.close()
            path = scratch.commit()
    return ImportResult(os.path.abspath(path), fmt, source.steps, source.num_envs, source.episodes, store.backend)
