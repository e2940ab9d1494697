"""zarr v3 backend: ``data.zarr/``, one array per leaf, groups mirroring the nest.

An uncompressed leaf is one shard covering the whole leaf, with inner chunks along the
step axis and no compression. Its shard file then starts with the leaf as one C-order
block, followed by the shard index, which is written here once at creation. The block is
memory-mapped; zarr readers and dask read the same bytes through the index. Such a leaf
must never be written through zarr-python, which replaces files by rename.

A compressed leaf is a plain chunked array, read and written whole chunk at a time.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BloscShuffle, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec, ZstdCodec

from ..errors import CorruptBufferError, SpecError
from ..metadata import LeafInfo, Metadata
from .base import ChunkedLeaf, Leaf, MappedLeaf, map_file, parse_compression, preallocate

DATA_DIR = "data.zarr"


def _compressor(text: str) -> Any:
    c = parse_compression(text)
    if c.codec == "zstd":
        return ZstdCodec(level=3 if c.level is None else c.level)
    if c.codec == "blosc":
        return BloscCodec(
            cname=c.cname or "zstd",
            clevel=5 if c.level is None else c.level,
            shuffle=BloscShuffle.shuffle,
        )
    if c.codec == "gzip":
        return GzipCodec(level=5 if c.level is None else c.level)
    raise SpecError(f"compression {text!r} is not available in the zarr backend (use zstd, blosc or gzip)")


def check_compression(text: str) -> None:
    _compressor(text)


def _fill(dtype: np.dtype) -> Any:
    return np.zeros((), dtype)[()]


def create(folder: str, leaves: list[LeafInfo], capacity: int, num_envs: int) -> list[LeafInfo]:
    root = zarr.open_group(os.path.join(folder, DATA_DIR), mode="w-", zarr_format=3)
    out = []
    for leaf in leaves:
        dtype = leaf.spec.dtype.newbyteorder("<")
        shape = (capacity, num_envs, *leaf.spec.shape)
        inner = (leaf.chunk_steps, num_envs, *leaf.spec.shape)
        if leaf.compression is not None:
            root.create_array(
                leaf.path,
                shape=shape,
                dtype=dtype,
                chunks=inner,
                # a CRC-32C per chunk: a damaged chunk is an error, never other rows
                compressors=[_compressor(leaf.compression), Crc32cCodec()],
                fill_value=_fill(dtype),
            )
            out.append(replace(leaf, file=f"{DATA_DIR}/{leaf.path}", offset=None))
            continue
        nchunks = -(-capacity // leaf.chunk_steps)
        arr = root.create_array(
            leaf.path,
            shape=shape,
            dtype=dtype,
            chunks=(nchunks * leaf.chunk_steps, *inner[1:]),
            serializer=ShardingCodec(
                chunk_shape=inner, codecs=[BytesCodec()], index_codecs=[BytesCodec()]
            ),
            compressors=None,
            filters=None,
            fill_value=_fill(dtype),
        )
        rel = f"{DATA_DIR}/{leaf.path}/{arr.metadata.encode_chunk_key((0,) * len(shape))}"
        _write_shard(os.path.join(folder, rel), nchunks, math.prod(inner) * dtype.itemsize)
        out.append(replace(leaf, file=rel, offset=0))
    return out


def _write_shard(path: str, nchunks: int, chunk_bytes: int) -> None:
    """An all-zero shard: the data block (preallocated, never written) and its index."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    index = np.empty((nchunks, 2), "<u8")
    index[:, 0] = np.arange(nchunks, dtype="<u8") * chunk_bytes
    index[:, 1] = chunk_bytes
    data_bytes = nchunks * chunk_bytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        preallocate(fd, data_bytes + index.nbytes, path)
        os.pwrite(fd, index.tobytes(), data_bytes)
    finally:
        os.close(fd)


def leaf_nbytes(meta: Metadata, leaf: LeafInfo) -> int:
    return meta.capacity * meta.num_envs * leaf.spec.nbytes


def open_leaves(folder: str, meta: Metadata, writable: bool) -> list[Leaf]:
    out: list[Leaf] = []
    for leaf in meta.leaves:
        path = os.path.join(folder, leaf.file or "")
        if leaf.mapped:
            mm = map_file(path, writable, (leaf.offset or 0) + leaf_nbytes(meta, leaf))
            out.append(MappedLeaf(leaf, meta.capacity, meta.num_envs, mm))
            continue
        try:
            arr = zarr.open_array(
                store=zarr.storage.LocalStore(path, read_only=not writable), mode="r+" if writable else "r"
            )
        except Exception as exc:
            raise CorruptBufferError(f"{path}: cannot open zarr array for leaf {leaf.path!r}: {exc}") from None
        # store all-zero chunks too, so a missing chunk file is always damage (verify)
        arr = arr.with_config({"write_empty_chunks": True})
        expected = (meta.capacity, meta.num_envs, *leaf.spec.shape)
        if arr.shape != expected or arr.dtype != leaf.spec.dtype:
            raise CorruptBufferError(
                f"{path}: leaf {leaf.path!r} expected {expected} {leaf.spec.dtype}, "
                f"found {arr.shape} {arr.dtype}"
            )
        out.append(ChunkedLeaf(leaf, meta.capacity, ZarrChunks(path, arr)))
    return out


class ZarrChunks:
    """Chunk I/O of a compressed zarr leaf: zarr-python writes each chunk file by
    rename, so a chunk is never torn and its old bytes are freed at once."""

    in_place = False

    def __init__(self, path: str, arr: Any):
        self.path = path
        self.arr = arr
        self.shape = arr.shape
        self.written: set[int] = set()  # chunks stored since the last flush

    def _file(self, k: int) -> str:
        return os.path.join(self.path, self.arr.metadata.encode_chunk_key((k,) + (0,) * (self.arr.ndim - 1)))

    def read(self, k: int, a: int, b: int) -> np.ndarray:
        return np.asarray(self.arr[a:b])

    def write(self, k: int, a: int, b: int, chunk: np.ndarray) -> None:
        self.arr[a:b] = chunk
        self.written.add(k)

    def flush(self, fsync: bool, staged: dict[int, np.ndarray]) -> None:
        for k, chunk in staged.items():
            a = k * self.arr.chunks[0]
            self.write(k, a, a + len(chunk), chunk)
        if fsync:
            folders = set()
            for k in self.written:
                chunk_file = self._file(k)
                if os.path.exists(chunk_file):
                    _fsync_path(chunk_file)
                folders.add(os.path.dirname(chunk_file))
            for d in folders:
                if os.path.isdir(d):
                    _fsync_path(d)
        self.written = set()

    def exists(self, k: int) -> bool:
        return os.path.exists(self._file(k))

    def refresh(self) -> None:
        pass  # every read goes to the chunk files

    def close(self) -> None:
        pass  # zarr holds no open files


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def data_paths(folder: str, meta: Metadata) -> list[str]:
    return [os.path.join(folder, leaf.file or "") for leaf in meta.leaves]
