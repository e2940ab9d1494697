"""``hdf5``: one HDF5 file, one ``[steps, num_envs, *shape]`` dataset per leaf path.

Groups mirror the nest (``obs/pixels``), the steps are in time order, and the root's
``mmreplay`` attribute holds the spec and roles as JSON, enough for ``mmreplay import``
to rebuild the store. Read it with plain ``h5py.File(path)``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UnsupportedFormatError
from ..spec import flatten
from .base import EXPORT_MARK, Source, StepBlocks, Target, arrays_source, spec_json

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult

COMPRESSIONS = ("gzip", "lzf")


@contextlib.contextmanager
def hdf5_output(path: str, **options: Any) -> Iterator[Any]:
    """``h5py.File(path, "w")`` (an export's scratch file) that ends cleanly when a write
    fails. On a full disk libhdf5's close fails too, writing the chunks and metadata it
    holds (``Can't decrement id ref count``), and the process dies of a segmentation fault
    when the file's objects are released later. The export is abandoned then, so the
    file's descriptor is pointed at /dev/null first: the close writes there and ends."""
    import h5py

    f = h5py.File(path, "w", **options)
    try:
        yield f
        reserve(f)
        f.flush()
        f.close()
    except BaseException:
        with contextlib.suppress(Exception):
            null = os.open(os.devnull, os.O_RDWR)
            try:
                os.dup2(null, f.id.get_vfd_handle())
            finally:
                os.close(null)
        with contextlib.suppress(Exception):
            f.close()
        raise


#: disk space :func:`reserve` claims beyond what the file has allocated
RESERVE_AHEAD = 4 << 20


def reserve(f: Any, ahead: int = 0, claimed: int = 0) -> int:
    """Claims the disk space of every byte the HDF5 file ``f`` has allocated (and ``ahead``
    more): a full disk is then an ``OSError`` here, not a failed write inside libhdf5.
    libhdf5 writes metadata it holds when an object is released (an error Python only
    prints) and on flush, and after such a failure on a full disk it dies of a
    segmentation fault. A writer of many small objects calls this as it goes, with
    room ``ahead`` for what it allocates before the next call, and passes back the end
    of what is ``claimed`` (the return value): only what lies past it is claimed, once
    half the room is used. The close gives back what was claimed beyond the end."""
    claim = getattr(os, "posix_fallocate", None)  # (not on macOS)
    end = int(f.id.get_filesize()) + ahead
    if claim is None or end - ahead // 2 <= claimed:
        return claimed
    try:
        claim(f.id.get_vfd_handle(), claimed, end - claimed)
    except OSError as exc:  # a file system that cannot claim space ahead writes as before
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
    return end


def dataset_options(compression: str | None, chunks: tuple[int, ...] | None) -> dict[str, Any]:
    """h5py ``create_dataset`` keywords for a compression setting such as ``gzip:4``."""
    if compression is None:
        return {}
    codec, _, level = compression.partition(":")
    opts: dict[str, Any] = {"compression": codec, "chunks": chunks or True}
    if codec == "gzip":
        opts["compression_opts"] = int(level) if level else 4
        opts["shuffle"] = True
    elif level:
        raise ValueError(f"compression {compression!r}: lzf takes no level")
    return opts


def put_array(group: Any, name: str, values: Any, compression: str | None) -> None:
    """A dataset made from ``values``, compressed unless it is a scalar or empty (HDF5
    filters need a chunked dataset, and those have no chunks)."""
    arr = np.ascontiguousarray(values)
    options = dataset_options(compression, None) if arr.ndim and arr.size else {}
    group.create_dataset(name, data=arr, **options)


def write(store: Exportable, out: str, options: ExportOptions) -> ExportResult:
    with Target(out, "file", "hdf5", store, options) as target:
        blocks = StepBlocks(store, options.progress)
        with hdf5_output(target.path()) as f:
            f.attrs["mmreplay"] = json.dumps(spec_json(store))
            f.attrs[EXPORT_MARK] = "hdf5"
            dsets = []
            for path, spec in zip(store.leaf_paths, flatten(store.spec)):
                shape = (blocks.steps, store.num_envs, *spec.shape)
                chunk = (max(1, min(blocks.block, blocks.steps)), *shape[1:])
                # (HDF5 filters need chunks, and no chunk fits in an empty dataset)
                opts = dataset_options(options.compression, chunk) if blocks.steps else {}
                dsets.append(f.create_dataset(path, shape=shape, dtype=spec.dtype, **opts))
            blocks.fill(dsets)
        return target.finish(0, blocks.rows)


# --- the import ------------------------------------------------------------------------


def open_hdf5(src: str, files: ExitStack, fmt: str, dataset: str | None = None, kind: str = "") -> Any:
    """``src`` opened read-only (closed with ``files``); a file that is no HDF5, or holds
    no ``dataset`` (the one a file of ``kind`` always has), is one error naming it, not h5py's."""
    import h5py

    if not h5py.is_hdf5(src):
        raise UnsupportedFormatError(f"{src}: not an HDF5 file, which the {fmt} import reads")
    f = files.enter_context(h5py.File(src, "r"))
    if dataset is not None and dataset not in f:
        raise UnsupportedFormatError(f"{src}: no {dataset!r} dataset; not {kind}")
    return f


def read(src: str, files: ExitStack) -> Source:
    f = open_hdf5(src, files, "hdf5")
    if "mmreplay" not in f.attrs:
        raise UnsupportedFormatError(f"{src}: no 'mmreplay' attribute; not an hdf5 export of mmreplay")
    return arrays_source(f, json.loads(f.attrs["mmreplay"]), None, src)


def datasets(group: Any, prefix: str = "") -> dict[str, Any]:
    import h5py

    out = {}
    for key in group:
        item = group[key]
        name = f"{prefix}{key}"
        if isinstance(item, h5py.Dataset):
            out[name] = item
        elif isinstance(item, h5py.Group):
            out.update(datasets(item, name + "/"))
    return out
