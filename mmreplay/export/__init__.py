"""Offline dataset exports, one module per format, imported only when used.

Episode formats (``minari``, ``d4rl``, ``d3rlpy``, ``parquet``) walk the store episode by
episode; an episode still running at the end of an env's stream is written as
truncated, or left out with ``complete_only`` (as is an episode whose start the ring
overwrote); an episode's last step keeps its terminal flag either way. Step-major
formats (``npz``, ``csv``, ``pt``, ``zarr``, ``hdf5``) write every retained committed step
as ``[steps, num_envs, *shape]`` arrays keyed by leaf path, in time order (the layout
skrl's ``Memory.save`` uses). Both kinds read the store in bounded blocks, so a store
larger than RAM exports in bounded memory.
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..codecs import describe
from ..errors import UnsupportedFormatError
from ._base import ExportResult, Progress, accepted_codecs, check_compression, reject_complete_only

__all__ = ["FORMATS", "FormatInfo", "ExportResult", "compressions", "export", "format_of", "get"]


@dataclass(frozen=True)
class FormatInfo:
    """A registered format: its module, what OUT names, and what loads it."""

    module: str
    target: str  # "file" or "folder"
    kind: str  # "episodes" or "steps"
    loads_with: str


FORMATS: dict[str, FormatInfo] = {
    "minari": FormatInfo("minari", "folder", "episodes", "minari.load_dataset (OUT is the datasets root)"),
    "d4rl": FormatInfo("d4rl", "file", "episodes", "h5py; d3rlpy.dataset.MDPDataset from its arrays"),
    "d3rlpy": FormatInfo(
        "d3rlpy", "file", "episodes", "d3rlpy.dataset.ReplayBuffer.load(f, InfiniteBuffer())"
    ),
    "parquet": FormatInfo(
        "parquet", "folder", "episodes", 'pyarrow.parquet, datasets.load_dataset("parquet")'
    ),
    "npz": FormatInfo("npz", "file", "steps", "numpy.load (skrl Memory layout)"),
    "csv": FormatInfo("csv", "file", "steps", "pandas.read_csv, any CSV reader (step, env, leaf / leaf.i)"),
    "pt": FormatInfo("pt", "file", "steps", "torch.load(weights_only=True) (skrl Memory layout)"),
    "zarr": FormatInfo("zarr", "folder", "steps", "zarr.open_group, dask.array.from_zarr"),
    "hdf5": FormatInfo("hdf5", "file", "steps", "h5py.File"),
    "lerobot": FormatInfo("lerobot", "folder", "episodes", "lerobot LeRobotDataset(repo_id, root=OUT)"),
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


def get(fmt: str) -> ModuleType:
    """The exporter module for a format name."""
    info = FORMATS.get(str(fmt).lower())
    if info is None:
        raise UnsupportedFormatError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")
    return importlib.import_module(f"{__name__}.{info.module}")


def compressions() -> dict[str, str]:
    """The ``--compression`` settings each format takes, as a user writes them."""
    return {name: describe(accepted_codecs(name, get(name).COMPRESSIONS)) for name in FORMATS}


def export(
    store: Any,
    out: str | os.PathLike,
    format: str | None = None,  # noqa: A002 - the CLI option's name
    compression: str | None = None,
    complete_only: bool = False,
    force: bool = False,
    progress: Progress | None = None,
    storage_options: dict[str, Any] | None = None,
    **options: Any,
) -> ExportResult:
    """Export a store's retained committed data to an offline format.

    Args:
        store: an open store (readers are fine, also while a writer runs), or an open
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
        **options: format options (``dataset_id`` for minari, ``rows_per_file`` for parquet).

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
    from ..group import Group

    if format is None:
        format = format_of(out)  # noqa: A001
    if isinstance(store, Group):  # its shards' steps one after another, as one dataset
        store = store.joined()
    module = get(format)
    name = str(format).lower()
    accepted = [p for p in inspect.signature(module.write).parameters if p not in ("store", "out")]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"{name} export: unexpected options {unknown}; it takes {', '.join(accepted)}")
    if FORMATS[name].kind == "steps":
        reject_complete_only(name, complete_only)
    compression = check_compression(name, compression, module.COMPRESSIONS)
    if isinstance(out, str) and out.startswith("s3://"):
        from ..objstore import export_to_url

        return export_to_url(
            lambda local: module.write(
                store,
                local,
                compression=compression,
                complete_only=complete_only,
                force=False,
                progress=progress or (lambda n: None),
                **options,
            ),
            out,
            force,
            storage_options,
        )
    return module.write(
        store,
        os.fspath(out),
        compression=compression,
        complete_only=complete_only,
        force=force,
        progress=progress or (lambda n: None),
        **options,
    )
