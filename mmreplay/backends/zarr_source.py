"""zarr arrays over a store's byte source: the zarr store of a leaf's array, and the
uncompressed leaf of a source that cannot be mapped, read row by row in byte ranges.

Every object zarr reads or writes goes through the byte source (:mod:`mmreplay.io`): a
local folder's files under its rules for a folder from anyone, an object store's
requests with their errors. No object larger than the array's largest can be is read,
and a chunk whose codec header declares more bytes than a chunk holds is refused before
it is decoded (zstd and blosc declare them; zstd would allocate whatever it declares).
"""

from __future__ import annotations

import asyncio
import struct
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.codecs import ShardingCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from ..errors import CorruptBufferError, ReadOnlyError
from ..io import ByteSource, coalesce
from ..metadata import LeafInfo
from .base import TakenLeaf
from .row_reads import is_row_compression, shard_limit

__all__ = ["BufferStore", "RangedLeaf", "chunk_key", "open_array", "open_arrays"]

#: the largest ``zarr.json`` read (mmreplay writes a few kB)
ZARR_JSON_BYTES = 1 << 20
#: codecs a leaf's array may name: what mmreplay writes (anything else is refused, so a
#: crafted ``zarr.json`` cannot make zarr decode what mmreplay never bounded)
KNOWN_CODECS = {"bytes", "zstd", "blosc", "gzip", "crc32c", "sharding_indexed", "numcodecs.lz4"}
#: rows of an unmapped leaf closer than this are fetched by one request (obstore's
#: default; 64 KiB made sample(256) of 84x84x4 frames 5x slower against a local server)
COALESCE_BYTES = 1 << 20


class BufferStore(zarr.storage.LocalStore):
    """The zarr store of one leaf's array (the objects under ``rel``) of a byte source."""

    def __init__(
        self, source: ByteSource, rel: str, *, read_only: bool = False, limit: int = 0, chunk_bytes: int | None = None
    ):
        super().__init__(source.where(rel), read_only=read_only)
        self.source, self.rel = source, rel
        self.limit = max(limit, ZARR_JSON_BYTES)
        self.chunk_bytes = chunk_bytes  # a compressed chunk's decoded bytes (None: not chunk-compressed)

    @classmethod
    def for_leaf(cls, source: ByteSource, rel: str, leaf: LeafInfo, num_envs: int, capacity: int, read_only: bool) -> BufferStore:
        raw = leaf.chunk_steps * num_envs * leaf.spec.nbytes
        chunk_bytes = None
        if leaf.compression is None:  # one shard: the leaf and its index
            raw = -(-capacity // leaf.chunk_steps) * (raw + 16)
        elif is_row_compression(leaf.compression):  # a segment's frames and their index
            raw = shard_limit(leaf.chunk_steps * num_envs, leaf.spec.nbytes)
        else:
            chunk_bytes = raw
        # compressed data can be a little larger than the raw bytes it holds
        return cls(source, rel, read_only=read_only, limit=raw + raw // 128 + (1 << 16), chunk_bytes=chunk_bytes)

    def __str__(self) -> str:  # zarr's messages name the store: its objects' place, not a local path
        return self.source.where(self.rel)

    def with_read_only(self, read_only: bool = False) -> BufferStore:
        return type(self)(self.source, self.rel, read_only=read_only, limit=self.limit, chunk_bytes=self.chunk_bytes)

    async def _open(self, *, mode: Any = None) -> None:
        if self.source.local:
            await super()._open(mode=mode)
        else:  # no folder to find or make
            await Store._open(self)

    def _read(self, key: str, byte_range: Any) -> bytes | None:
        start, end = 0, None
        if isinstance(byte_range, RangeByteRequest):
            start, end = byte_range.start, byte_range.end
        elif isinstance(byte_range, OffsetByteRequest):
            start = byte_range.offset
        elif isinstance(byte_range, SuffixByteRequest):
            start = -byte_range.suffix
        limit = ZARR_JSON_BYTES if key.endswith("zarr.json") else self.limit
        rel = f"{self.rel}/{key}"
        try:
            data = self.source.read(rel, limit, "a file of this array", start, end)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if self.chunk_bytes is not None and byte_range is None and not key.endswith("zarr.json"):
            declared = _declared_bytes(data)
            if declared is not None and not 0 <= declared <= self.chunk_bytes:
                said = "no decoded size" if declared < 0 else f"{declared} bytes decoded"
                raise CorruptBufferError(
                    f"{self.source.where(rel)}: declares {said}, a chunk of this array holds {self.chunk_bytes}"
                )
        return data

    async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
        return await asyncio.to_thread(self.get_sync, key, prototype=prototype, byte_range=byte_range)

    def get_sync(self, key: str, *, prototype: Any = None, byte_range: Any = None) -> Any:
        data = self._read(key, byte_range)
        return None if data is None else (prototype or default_buffer_prototype()).buffer.from_bytes(data)

    async def get_partial_values(self, prototype: Any, key_ranges: Any) -> list[Any]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def _set(self, key: str, value: Any, exclusive: bool = False) -> None:
        self._check_writable()
        await asyncio.to_thread(self.source.replace, f"{self.rel}/{key}", value.as_buffer_like(), exclusive)

    def set_sync(self, key: str, value: Any) -> None:
        self._check_writable()
        self.source.replace(f"{self.rel}/{key}", value.as_buffer_like())


def _declared_bytes(data: bytes) -> int | None:
    """The decoded size a zstd frame or a blosc chunk declares in its header: None for
    other codecs, -1 for a zstd frame that declares none (zarr's always do)."""
    if data[:4] == b"\x28\xb5\x2f\xfd" and len(data) >= 6:  # zstd frame
        descriptor = data[4]
        single, fcs_flag = (descriptor >> 5) & 1, descriptor >> 6
        at = 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3]
        size = (1 if single else 0, 2, 4, 8)[fcs_flag]
        if size == 0 or len(data) < at + size:
            return -1
        value = int.from_bytes(data[at : at + size], "little")
        return value + 256 if size == 2 else value
    if len(data) >= 16 and struct.unpack_from("<I", data, 12)[0] in (len(data), len(data) - 4):
        return struct.unpack_from("<I", data, 4)[0]  # blosc: nbytes, then the frame's size (and a CRC-32C)
    return None


def chunk_key(arr: Any, k: int = 0) -> str:
    """The key of chunk (or shard) ``k`` along the step axis of ``arr``."""
    return arr.metadata.encode_chunk_key((k,) + (0,) * (arr.ndim - 1))


def open_array(source: ByteSource, rel: str, leaf: LeafInfo, num_envs: int, capacity: int, writable: bool) -> Any:
    """The zarr array of a leaf (the objects under ``rel``), read through :class:`BufferStore`."""
    got = open_arrays(source, [(rel, leaf)], num_envs, capacity, writable)[0]
    if isinstance(got, BaseException):
        raise got
    return got


def open_arrays(
    source: ByteSource, leaves: list[tuple[str, LeafInfo]], num_envs: int, capacity: int, writable: bool
) -> list[Any]:
    """:func:`open_array` of several leaves ``(rel, leaf)`` at once: their metadata is read
    together (from object storage, one round trip for all, not one per leaf). Each entry
    is the array, or the exception its opening raised."""

    if not leaves:  # (a store of mapped leaves only: no trip through zarr's event loop)
        return []

    async def one(rel: str, leaf: LeafInfo) -> Any:
        store = BufferStore.for_leaf(source, rel, leaf, num_envs, capacity, read_only=not writable)
        # zarr_format 3, what mmreplay writes: no requests for the objects of zarr v2 (.zarray, .zattrs)
        return await zarr.api.asynchronous.open_array(store=store, mode="r+" if writable else "r", zarr_format=3)

    async def every() -> list[Any]:
        return await asyncio.gather(*(one(rel, leaf) for rel, leaf in leaves), return_exceptions=True)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # numcodecs.lz4 is "not in the zarr v3 spec": zarr reads it
        opened = sync(every())
    out: list[Any] = []
    for (rel, _), got in zip(leaves, opened):
        if isinstance(got, BaseException):
            if not isinstance(got, Exception):
                raise got
            out.append(got)
            continue
        try:
            out.append(_checked(source, rel, zarr.Array(got)))
        except CorruptBufferError as exc:
            out.append(exc)
    return out


def _checked(source: ByteSource, rel: str, arr: Any) -> Any:
    names = _codec_names(arr.metadata.codecs)
    if not names <= KNOWN_CODECS:
        raise CorruptBufferError(
            f"{source.where(rel)}: the array names codecs {sorted(names - KNOWN_CODECS)}, which mmreplay never writes"
        )
    return arr


def _codec_names(codecs: Any) -> set[str]:
    out = set()
    for codec in codecs:
        out.add(codec.to_dict()["name"])
        if isinstance(codec, ShardingCodec):
            out |= _codec_names(codec.codecs) | _codec_names(codec.index_codecs)
    return out


class RangedLeaf(TakenLeaf):
    """An uncompressed leaf of a source that cannot be mapped (object storage): each row
    a byte range of a shard object (a C-order block of whole steps, then its index),
    rows closer than :data:`COALESCE_BYTES` fetched by one request, read-only."""

    mappable = False
    in_place = False
    atomic_replace = True  # objects are replaced whole
    ranged_read = True

    def __init__(self, source: ByteSource, info: LeafInfo, capacity: int, num_envs: int, rel: str, arr: Any):
        where = source.where(f"{rel}/zarr.json")
        shards, chunks = arr.shards, arr.chunks
        if shards is None or arr.compressors or chunks[0] != info.chunk_steps or shards[0] % chunks[0]:
            raise CorruptBufferError(
                f"{where}: leaf {info.path!r} expected uncompressed shards of chunks of {info.chunk_steps} steps, "
                f"found shards {shards} of chunks {chunks} and compressors {arr.compressors}"
            )
        self.source, self.info = source, info
        self.capacity, self.num_envs = capacity, num_envs
        self.dtype = info.spec.dtype.newbyteorder("<")
        self.row_bytes = info.spec.nbytes
        self.step_bytes = num_envs * self.row_bytes
        self.shard_steps = shards[0]
        self.array_key, self.arr = rel, arr

    def _key(self, k: int) -> str:
        return f"{self.array_key}/{chunk_key(self.arr, k)}"

    async def take_async(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        shape = rows.shape + tuple(self.info.spec.shape)
        flat = rows.reshape(-1) % (self.capacity * self.num_envs)
        if self.row_bytes == 0 or flat.size == 0:
            return np.zeros(shape, self.info.spec.dtype)
        unique, inverse = np.unique(flat, return_inverse=True)
        slots = unique // self.num_envs
        shard = slots // self.shard_steps
        offsets = (slots - shard * self.shard_steps) * self.step_bytes + (unique % self.num_envs) * self.row_bytes
        firsts, run_start, run_end, run = coalesce(shard, offsets, offsets + self.row_bytes, COALESCE_BYTES)
        run_at = np.concatenate(([0], np.cumsum(run_end - run_start)))
        handles = {k: self.source.handle(self._key(k)) for k in np.unique(shard).tolist()}
        ranges = [(handles[k], a, b) for k, a, b in zip(shard[firsts].tolist(), run_start.tolist(), run_end.tolist())]
        buf = np.empty(int(run_at[-1]), np.uint8)
        got = await self.source.read_ranges(ranges, buf)
        for (h, a, b), n in zip(ranges, got):
            if n is None:
                raise CorruptBufferError(f"leaf {self.info.path!r}: shard {self.source.where(h.key)} is missing")
            if n != b - a:
                raise CorruptBufferError(
                    f"leaf {self.info.path!r}: shard {self.source.where(h.key)} ends before its rows (byte {a + n} of {b})"
                )
        at = (offsets - run_start[run] + run_at[run]).tolist()
        out = np.empty((unique.size, self.row_bytes), np.uint8)
        for i, a in enumerate(at):
            out[i] = buf[a : a + self.row_bytes]
        got_rows = out.view(self.dtype).reshape(unique.size, *self.info.spec.shape)
        return got_rows[inverse.reshape(-1)].astype(self.info.spec.dtype, copy=False).reshape(shape)

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.source.run(self.take_async(rows))

    def write(self, start: int, values: np.ndarray) -> None:
        raise ReadOnlyError(f"{self.source.url}: a store in object storage is read-only")

    write_slots = write

    def flush(self, fsync: bool) -> None:
        pass

    def invalidate(self, slots: Iterable[tuple[int, int]]) -> None:
        pass  # nothing is cached

    def close(self) -> None:
        pass
