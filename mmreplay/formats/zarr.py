"""``zarr``: a zarr v3 group, one ``[steps, num_envs, *shape]`` array per leaf path.

Groups mirror the nest, the steps are in time order, chunks run along the step axis,
and the group's ``mmreplay`` attribute holds the spec and roles. Read it with
``zarr.open_group(path)`` or ``dask.array.from_zarr``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import UnsupportedFormatError
from ..files import interrupts_deferred
from ..spec import flatten
from .base import Source, StepBlocks, Target, arrays_source, need, spec_json

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult

COMPRESSIONS = ("zstd", "blosc", "gzip")
#: bytes per chunk aimed at (along the step axis)
CHUNK_BYTES = 4 << 20


def _codec(compression: str | None) -> Any:
    from zarr.codecs import BloscCodec, BloscShuffle, GzipCodec, ZstdCodec

    if compression is None:
        return None
    codec, _, rest = compression.partition(":")
    parts = [p for p in rest.split(":") if p]
    if codec == "zstd":
        return ZstdCodec(level=int(parts[0]) if parts else 3)
    if codec == "gzip":
        return GzipCodec(level=int(parts[0]) if parts else 5)
    cname = parts.pop(0) if parts and not parts[0].isdigit() else "zstd"
    return BloscCodec(cname=cname, clevel=int(parts[0]) if parts else 5, shuffle=BloscShuffle.shuffle)


class _LeafWriter:
    """Appends rows to one array and writes them a whole chunk at a time.

    Uncompressed chunks are written as files of raw little-endian C-order bytes (what
    zarr's ``bytes`` codec stores), which avoids zarr-python's per-chunk machinery; with a
    compressor each whole chunk goes through zarr. The last chunk is padded with zeros,
    the arrays' fill value, as zarr stores edge chunks.

    zarr-python writes on its own event loop's thread, which a Ctrl-C in the calling
    thread does not stop: each call to it holds Ctrl-C back until it returns, so no write
    lands in the export after it was removed.
    """

    def __init__(self, arr: Any, folder: str, chunk_steps: int, raw: bool):
        self.arr = arr
        self.folder = folder
        self.cs = chunk_steps
        self.raw = raw
        self.pending: list[np.ndarray] = []
        self.rows = 0
        self.k = 0

    def add(self, values: np.ndarray) -> None:
        self.pending.append(values)
        self.rows += len(values)
        if self.rows >= self.cs:
            data = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
            full = len(data) // self.cs * self.cs
            for a in range(0, full, self.cs):
                self._chunk(data[a : a + self.cs])
            rest = data[full:]
            self.pending = [rest] if len(rest) else []
            self.rows = len(rest)

    def finish(self) -> None:
        if self.rows:
            data = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
            pad = np.zeros((self.cs, *data.shape[1:]), data.dtype)
            pad[: len(data)] = data
            self._chunk(pad, len(data))
        self.pending, self.rows = [], 0

    def _chunk(self, data: np.ndarray, rows: int | None = None) -> None:
        if self.raw:
            key = self.arr.metadata.encode_chunk_key((self.k,) + (0,) * (data.ndim - 1))
            path = os.path.join(self.folder, *key.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            dtype = data.dtype.newbyteorder("<") if data.dtype.itemsize > 1 else data.dtype
            with open(path, "wb") as f:
                f.write(np.ascontiguousarray(data, dtype=dtype).reshape(-1).view(np.uint8))
        else:
            a = self.k * self.cs
            n = len(data) if rows is None else rows
            with interrupts_deferred():
                self.arr[a : a + n] = data[:n]
        self.k += 1


def write(store: Exportable, out: str, options: ExportOptions) -> ExportResult:
    zarr = need("zarr", "the zarr format", "zarr")
    with Target(out, "folder", "zarr", store, options) as target:
        specs = flatten(store.spec)
        blocks = StepBlocks(store, options.progress)
        codec = _codec(options.compression)
        writers = []
        with interrupts_deferred():  # (zarr-python writes on its own thread, see _LeafWriter)
            root = zarr.open_group(target.path(), mode="w", zarr_format=3)
            root.attrs["mmreplay"] = spec_json(store)
            for path, spec in zip(store.leaf_paths, specs):
                shape = (blocks.steps, store.num_envs, *spec.shape)
                cs = max(1, min(max(1, blocks.steps), CHUNK_BYTES // max(1, store.num_envs * spec.nbytes)))
                arr = root.create_array(
                    path,
                    shape=shape,
                    dtype=spec.dtype.newbyteorder("<") if spec.dtype.itemsize > 1 else spec.dtype,
                    chunks=(cs, store.num_envs, *spec.shape),
                    compressors=[codec] if codec is not None else None,
                    fill_value=0,
                )
                writers.append(_LeafWriter(arr, target.path(*path.split("/")), cs, raw=codec is None))
        for _, leaves in blocks:
            for w, values in zip(writers, leaves):
                w.add(values)
        for w in writers:
            w.finish()
        return target.finish(0, blocks.rows)


# --- the import ------------------------------------------------------------------------


def read(src: str, files: ExitStack) -> Source:
    if not os.path.isfile(os.path.join(src, "zarr.json")):
        raise UnsupportedFormatError(f"{src}: no zarr.json; not a zarr export of mmreplay")
    g = need("zarr", "the zarr format", "zarr").open_group(src, mode="r")
    meta = dict(g.attrs).get("mmreplay")
    if not isinstance(meta, dict):
        raise UnsupportedFormatError(
            f"{src}: a zarr group that is not an mmreplay export (no 'mmreplay' attribute)"
        )
    return arrays_source(g, meta, None, src)
