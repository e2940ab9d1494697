"""zarr v3 backend: ``data.zarr/``, one array per leaf, groups mirroring the nest.

An uncompressed leaf is one shard covering the whole leaf, with inner chunks along the
step axis and no compression. Its shard file then starts with the leaf as one C-order
block, followed by the shard index, which is written here once at creation. The block is
memory-mapped; zarr readers and dask read the same bytes through the index. Such a leaf
must never be written through zarr-python, which replaces files by rename.

A compressed leaf is a plain chunked array, read and written whole chunk at a time.

A ``rows:`` leaf (``rows:lz4``, ``rows:zstd[:LEVEL]``) is one shard per segment of
``chunk_steps`` steps, with one compressed frame per row; see :mod:`.row_frames`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zarr
from zarr.codecs import BloscCodec, BloscShuffle, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec, ZstdCodec

from ..errors import CorruptBufferError, RemoteError, SpecError
from ..files import interrupts_deferred
from ..io import ByteSource, LocalFolder
from ..io.local import read_inside
from ..metadata import LeafInfo, Metadata, little_endian
from .base import (
    ChunkedLeaf,
    Leaf,
    MappedLeaf,
    fsync_files,
    parse_compression,
    preallocate,
    shutdown_error,
)
from .checks import Repairs, chunks_of, leaf_nbytes, leaf_shape, retained_ranges
from .row_codec import check_frames, is_row_compression, parse_row_compression, require_row_codecs
from .row_frames import RowFrameLeaf, create_staging
from .row_reads import STAGING_FILE, STAGING_MAGIC, read_shard_index, shard_limit, staging_bytes
from .zarr_source import RangedLeaf, chunk_key, open_array, open_arrays

DATA_DIR = "data.zarr"

#: the longest file name (in bytes) common file systems take: each part of a leaf path is a folder
NAME_MAX_BYTES = 255


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
    if is_row_compression(text):
        parse_row_compression(text)
    else:
        _compressor(text)


def _row_serializer(leaf: LeafInfo) -> ShardingCodec:
    """Shards of one segment, inner chunks of one row, each its own compressed frame."""
    codec = parse_row_compression(leaf.compression or "").zarr_codec
    if codec["name"] == "zstd":
        inner: Any = ZstdCodec(**codec["configuration"])
    else:
        from numcodecs.zarr3 import LZ4

        inner = LZ4(**codec["configuration"])
    return ShardingCodec(
        chunk_shape=(1, 1, *leaf.spec.shape),
        codecs=[BytesCodec(), inner],
        index_codecs=[BytesCodec(), Crc32cCodec()],
    )


def _create_array(
    root: Any, leaf: LeafInfo, capacity: int, num_envs: int, shard_chunks: int | None = None
) -> Any:
    """The leaf's array in ``root`` (metadata only). ``shard_chunks``: an uncompressed leaf
    in shards of that many chunks instead of one shard of the whole leaf."""
    dtype = leaf.spec.dtype.newbyteorder("<")
    inner = (leaf.chunk_steps, num_envs, *leaf.spec.shape)
    layout: dict[str, Any]
    with warnings.catch_warnings():
        if is_row_compression(leaf.compression):
            warnings.simplefilter("ignore")  # numcodecs.lz4 is "not in the zarr v3 spec": zarr reads it
            serializer = _row_serializer(leaf)
            layout = {"chunks": inner, "serializer": serializer, "compressors": None, "filters": None}
        elif leaf.compression is not None:
            # a CRC-32C per chunk: a damaged chunk is an error, never other rows
            layout = {"chunks": inner, "compressors": [_compressor(leaf.compression), Crc32cCodec()]}
        else:
            shard_steps = (shard_chunks or -(-capacity // leaf.chunk_steps)) * leaf.chunk_steps
            sharding = ShardingCodec(chunk_shape=inner, codecs=[BytesCodec()], index_codecs=[BytesCodec()])
            layout = {
                "chunks": (shard_steps, *inner[1:]),
                "serializer": sharding,
                "compressors": None,
                "filters": None,
            }
        return root.create_array(
            leaf.path, shape=(capacity, *inner[1:]), dtype=dtype, fill_value=np.zeros((), dtype)[()], **layout
        )


def _placed(leaf: LeafInfo, arr: Any) -> LeafInfo:
    """The leaf as :func:`create` places it (an uncompressed leaf: at the start of its shard)."""
    if leaf.compression is not None:
        return replace(leaf, file=f"{DATA_DIR}/{leaf.path}", offset=None)
    return replace(leaf, file=f"{DATA_DIR}/{leaf.path}/{chunk_key(arr)}", offset=0)


def _check_names(leaves: list[LeafInfo]) -> None:
    """Refuse leaf paths zarr cannot lay out as folders: a part named like the metadata file
    beside it, or longer than a file name may be."""
    for leaf in leaves:
        for part in leaf.path.split("/"):
            if part == "zarr.json" or len(os.fsencode(part)) > NAME_MAX_BYTES:
                raise SpecError(
                    f"leaf {leaf.path!r}: the zarr backend stores {part[:40]!r} as a folder, and it cannot be "
                    f"'zarr.json' nor longer than {NAME_MAX_BYTES} bytes; rename the leaf or use backend='hdf5'"
                )


def create(folder: str, leaves: list[LeafInfo], capacity: int, num_envs: int) -> list[LeafInfo]:
    root = zarr.open_group(os.path.join(folder, DATA_DIR), mode="w-", zarr_format=3)
    out = []
    for leaf in leaves:
        placed = _placed(leaf, _create_array(root, leaf, capacity, num_envs))
        path = os.path.join(folder, placed.file or "")
        if placed.mapped:
            _write_shard(path, leaf, capacity, num_envs)
        elif is_row_compression(leaf.compression):
            create_staging(os.path.join(path, STAGING_FILE), leaf.chunk_steps, num_envs, leaf.spec.nbytes)
        out.append(placed)
    return out


def _in_memory(
    leaves: list[LeafInfo], capacity: int, num_envs: int, shard_chunks: int | None = None
) -> tuple[dict[str, Any], list[Any]]:
    """The files and arrays :func:`create` makes for ``leaves``, made in memory."""
    files: dict[str, Any] = {}
    with interrupts_deferred():  # zarr-python runs it on its own thread: Ctrl-C would leave it pending
        root = zarr.open_group(zarr.storage.MemoryStore(files), mode="w-", zarr_format=3)
        arrays = [_create_array(root, leaf, capacity, num_envs, shard_chunks) for leaf in leaves]
    return files, arrays


def planned_bytes(
    leaves: list[LeafInfo], capacity: int, num_envs: int
) -> tuple[list[LeafInfo], dict[str, int], int]:
    """What :func:`create` makes, without writing it: the leaves as it places them, the
    shard file bytes of each uncompressed leaf, and the bytes of the zarr metadata files
    (made in memory)."""
    _check_names(leaves)
    files, arrays = _in_memory(leaves, capacity, num_envs)
    shards = {}
    for leaf in leaves:
        if leaf.compression is None:
            shards[leaf.path] = _shard_layout(leaf, capacity, num_envs)[1]
        elif is_row_compression(leaf.compression):
            shards[leaf.path] = staging_bytes(leaf.chunk_steps, num_envs, leaf.spec.nbytes)
    placed = [_placed(leaf, arr) for leaf, arr in zip(leaves, arrays)]
    return placed, shards, sum(len(buf) for buf in files.values())


def array_metadata(leaf: LeafInfo, capacity: int, num_envs: int, shard_chunks: int | None = None) -> bytes:
    """The ``zarr.json`` of a leaf's array as :func:`create` writes it (``shard_chunks``:
    a mapped leaf cut into shards of that many chunks, as object storage holds it)."""
    files, _ = _in_memory([leaf], capacity, num_envs, shard_chunks)
    return files[f"{leaf.path}/zarr.json"].to_bytes()


def shard_index(nchunks: int, chunk_bytes: int) -> np.ndarray:
    """The index of a shard whose inner chunks lie one after the other from its start."""
    index = np.empty((nchunks, 2), "<u8")
    index[:, 0] = np.arange(nchunks, dtype="<u8") * chunk_bytes
    index[:, 1] = chunk_bytes
    return index


def _shard_layout(leaf: LeafInfo, capacity: int, num_envs: int) -> tuple[int, int, np.ndarray]:
    """(data bytes, file bytes, index) of an uncompressed leaf's shard file: the raw
    chunks, then an index of two uint64 per chunk."""
    nchunks = -(-capacity // leaf.chunk_steps)
    chunk_bytes = leaf.chunk_steps * num_envs * leaf.spec.nbytes
    index = shard_index(nchunks, chunk_bytes)
    return nchunks * chunk_bytes, nchunks * chunk_bytes + index.nbytes, index


def _write_shard(path: str, leaf: LeafInfo, capacity: int, num_envs: int) -> None:
    """An all-zero shard: the data block (preallocated, never written) and its index."""
    data_bytes, file_bytes, index = _shard_layout(leaf, capacity, num_envs)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        preallocate(fd, file_bytes, path)
        os.pwrite(fd, index.tobytes(), data_bytes)
    finally:
        os.close(fd)


def open_leaves(source: ByteSource, meta: Metadata, writable: bool) -> list[Leaf]:
    out: list[Leaf] = []
    # the arrays' metadata, read together (the array of a mapped leaf's file is its shard)
    arrays = [(f"{DATA_DIR}/{leaf.path}", leaf) for leaf in meta.leaves if not (leaf.mapped and source.local)]
    opened = dict(zip((rel for rel, _ in arrays), open_arrays(source, arrays, meta.num_envs, meta.capacity, writable)))
    for leaf in meta.leaves:
        if leaf.mapped and source.local:
            mm = source.map(leaf.file or "", writable, (leaf.offset or 0) + leaf_nbytes(meta, leaf))
            out.append(MappedLeaf(leaf, meta.capacity, meta.num_envs, mm))
            continue
        rel = f"{DATA_DIR}/{leaf.path}"
        try:
            arr = opened[rel]
            if isinstance(arr, Exception):
                raise arr
        except CorruptBufferError:
            raise
        except Exception as exc:
            where = f"{source.where(rel)}: cannot open zarr array for leaf {leaf.path!r}"
            raise shutdown_error(exc, where) or CorruptBufferError(f"{where}: {exc}") from None
        if leaf.mapped:  # object storage: rows by byte range
            out.append(RangedLeaf(source, leaf, meta.capacity, meta.num_envs, rel, arr))
        elif is_row_compression(leaf.compression):
            out.append(_row_leaf(source, rel, arr, leaf, meta, writable))
        else:
            expected = leaf_shape(meta, leaf)
            chunks = (leaf.chunk_steps, *expected[1:])
            if arr.shape != expected or arr.dtype != leaf.spec.dtype or arr.chunks != chunks or arr.shards is not None:
                raise CorruptBufferError(
                    f"{source.where(rel)}: leaf {leaf.path!r} expected {expected} {leaf.spec.dtype} in chunks of "
                    f"{chunks}, found {arr.shape} {arr.dtype} in chunks of {arr.chunks}"
                )
            out.append(ChunkedLeaf(leaf, meta.capacity, ZarrChunks(source, rel, arr)))
    return out


def _open_local(folder: str, meta: Metadata, leaf: LeafInfo, writable: bool = False) -> Any:
    rel = f"{DATA_DIR}/{leaf.path}"
    return open_array(LocalFolder(folder), rel, leaf, meta.num_envs, meta.capacity, writable)


def _row_leaf(source: ByteSource, rel: str, arr: Any, leaf: LeafInfo, meta: Metadata, writable: bool) -> RowFrameLeaf:
    expected = leaf_shape(meta, leaf)
    if arr.shape != expected or arr.dtype != leaf.spec.dtype or arr.shards != (leaf.chunk_steps, *expected[1:]):
        raise CorruptBufferError(
            f"{source.where(rel)}: leaf {leaf.path!r} expected {expected} {leaf.spec.dtype} in shards of "
            f"{leaf.chunk_steps} steps, found {arr.shape} {arr.dtype} shards {arr.shards}"
        )
    return RowFrameLeaf(leaf, meta.capacity, meta.num_envs, source, rel, functools.partial(chunk_key, arr), writable)


class ZarrChunks:
    """Chunk I/O of a compressed zarr leaf: zarr-python writes each chunk file by
    rename, so a chunk is never torn and its old bytes are freed at once."""

    in_place = False

    def __init__(self, source: ByteSource, rel: str, arr: Any):
        # store all-zero chunks too, so a missing chunk is always damage (verify)
        self.arr = arr.with_config({"write_empty_chunks": True})
        self.source, self.rel = source, rel
        self.shape = arr.shape
        self.written: set[int] = set()  # chunks stored since the last flush

    def _key(self, k: int) -> str:
        return f"{self.rel}/{chunk_key(self.arr, k)}"

    def read(self, k: int, a: int, b: int) -> np.ndarray:
        return np.asarray(self.arr[a:b])

    def write(self, k: int, a: int, b: int, chunk: np.ndarray) -> None:
        self.written.add(k)  # first: a write cut short is synced at the next flush too
        self.arr[a:b] = chunk

    def flush(self, fsync: bool, staged: dict[int, np.ndarray]) -> None:
        for k, chunk in staged.items():
            a = k * self.arr.chunks[0]
            self.write(k, a, a + len(chunk), chunk)
        if fsync:
            fsync_files([self.source.where(self._key(k)) for k in self.written])
        self.written = set()

    def exists(self, k: int) -> bool:
        return self.source.exists(self._key(k))

    def file(self, k: int) -> str:
        return self.source.where(self._key(k))

    def refresh(self) -> None:
        pass  # every read goes to the chunk objects

    def close(self) -> None:
        pass  # zarr holds no open files


def data_paths(folder: str, meta: Metadata) -> list[str]:
    return [os.path.join(folder, leaf.file or "") for leaf in meta.leaves]


def require_codecs(folder: str) -> None:
    """Row-frame leaves need the ``pixels`` extra (an ImportError naming it, before any
    change); zarr's own codecs (numcodecs) come with zarr itself."""
    for _, _, files in _walk_data(folder):
        if STAGING_FILE in files:
            require_row_codecs()
            return


def _walk_data(folder: str) -> Any:
    """``os.walk`` of the data folder; nothing when it is a link (never followed)."""
    root = os.path.join(folder, DATA_DIR)
    return () if os.path.islink(root) else os.walk(root)


def leftover_files(folder: str) -> list[str]:
    """Files a killed writer may leave in the data folder (zarr's partial chunk writes)."""
    out = []
    for dirpath, _, files in _walk_data(folder):
        out.extend(os.path.join(dirpath, name) for name in files if name.endswith(".partial"))
    return out


# --- verify and repair (mmreplay.verify runs them) ------------------------------------------


@dataclass
class _ZarrLeafState:
    """What the zarr checks found wrong with one leaf (recover acts on it)."""

    unusable: str | None = None  # the array cannot be used at all
    meta_bad: bool = False  # because its zarr.json is missing or unreadable
    shard_short: int | None = None  # a mapped shard file shorter than this many bytes
    bad_index: bool = False
    bad_chunks: dict[int, str] = field(default_factory=dict)  # chunk -> why
    bad_staging: str | None = None  # a row-frames leaf's staging file, and why


def _zarr_leaf(
    folder: str, meta: Metadata, leaf: LeafInfo, deep: bool, problems: list[str]
) -> _ZarrLeafState:
    found = _ZarrLeafState()
    where = f"leaf {leaf.path!r}"
    arr_dir = os.path.join(folder, DATA_DIR, leaf.path)

    def problem(text: str) -> None:
        problems.append(f"{where}: {text}")

    def unusable(why: str, meta_bad: bool = False) -> _ZarrLeafState:
        found.unusable, found.meta_bad = why, meta_bad
        problem(why)
        return found

    if not os.path.isfile(os.path.join(arr_dir, "zarr.json")):
        return unusable(f"{arr_dir}/zarr.json is missing", meta_bad=True)
    try:
        arr = _open_local(folder, meta, leaf)
    except Exception as exc:
        return unusable(f"zarr cannot open {arr_dir}: {exc}", meta_bad=True)
    expected = leaf_shape(meta, leaf)
    if arr.shape != expected or arr.dtype != little_endian(leaf.spec.dtype):
        return unusable(
            f"{arr_dir}: expected {expected} {leaf.spec.dtype}, the array is {arr.shape} {arr.dtype}"
        )
    if is_row_compression(leaf.compression):
        _row_leaf_checks(arr_dir, arr, meta, leaf, deep, found, problem)
        return found
    if leaf.mapped:
        shard_steps = -(-meta.capacity // leaf.chunk_steps) * leaf.chunk_steps
        want_file = f"{DATA_DIR}/{leaf.path}/{chunk_key(arr)}"
        if arr.shards != (shard_steps, *expected[1:]) or arr.chunks != (leaf.chunk_steps, *expected[1:]):
            return unusable(
                f"{arr_dir}: expected one shard of chunks of {leaf.chunk_steps} steps, "
                f"found shards {arr.shards} chunks {arr.chunks}"
            )
        if arr.compressors:
            return unusable(f"{arr_dir}: a mapped leaf must be uncompressed, the array has {arr.compressors}")
        if leaf.file != want_file or leaf.offset != 0:
            return unusable(
                f"metadata says file {leaf.file!r} offset {leaf.offset}, "
                f"the array stores {want_file!r} offset 0"
            )
        shard = os.path.join(folder, want_file)
        data_bytes, file_bytes, index = _shard_layout(leaf, meta.capacity, meta.num_envs)
        if os.path.lexists(shard) and not os.path.isfile(shard):
            found.shard_short = 0
            problem(f"data file {shard} is not a regular file")
            return found
        try:
            size = os.path.getsize(shard)
        except FileNotFoundError:
            found.shard_short = 0
            problem(f"data file {shard} is missing")
            return found
        if size != file_bytes:
            problem(f"data file {shard} has {size} bytes, expected {file_bytes}")
            if size < file_bytes:
                found.shard_short = size
                return found
        with open(shard, "rb") as f:
            f.seek(data_bytes)
            raw = f.read(index.nbytes)
        if raw != index.tobytes():
            found.bad_index = True
            problem(
                f"{shard}: the shard index does not point at the mapped block (zarr readers would see other rows)"
            )
        elif deep and meta.state.end > meta.state.first(meta.capacity):
            try:
                np.asarray(arr[(meta.state.end - 1) % meta.capacity])
            except Exception as exc:
                found.bad_index = True
                problem(f"zarr cannot read {shard}: {exc}")
        return found
    if arr.chunks != (leaf.chunk_steps, *expected[1:]) or arr.shards is not None:
        return unusable(f"{arr_dir}: expected chunks of {leaf.chunk_steps} steps, the array has {arr.chunks}")
    if not arr.compressors:
        return unusable(f"{arr_dir}: metadata says compression {leaf.compression!r}, the array has none")
    for k in chunks_of(meta, leaf):
        chunk = os.path.join(arr_dir, chunk_key(arr, k))
        if not os.path.isfile(chunk):
            found.bad_chunks[k] = f"chunk file {chunk} is missing"
            continue
        if deep:
            a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
            try:
                np.asarray(arr[a:b])
            except Exception as exc:
                found.bad_chunks[k] = f"chunk file {chunk} does not decode ({type(exc).__name__}: {exc})"
    for why in found.bad_chunks.values():
        problem(f"{why} (it holds committed steps)")
    return found


#: bytes of a staging file's header that :func:`staging_segment` reads
STAGING_HEAD_BYTES = len(STAGING_MAGIC) + 32


def _staging_segment(arr_dir: str, meta: Metadata, leaf: LeafInfo) -> tuple[tuple[int, int, int] | None, str | None]:
    """(segment, base, filled) of a row-frames leaf's staging file, or why it is unusable."""
    path = os.path.join(arr_dir, STAGING_FILE)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(STAGING_HEAD_BYTES)
    except (FileNotFoundError, IsADirectoryError):
        return None, f"staging file {path} is missing"
    return staging_segment(head, size, path, meta, leaf)


def staging_segment(
    head: bytes, size: int, path: str, meta: Metadata, leaf: LeafInfo
) -> tuple[tuple[int, int, int] | None, str | None]:
    """(segment, base, filled) from the first bytes of a staging file of ``size`` bytes
    (at ``path``), or why it is unusable."""
    need = staging_bytes(leaf.chunk_steps, meta.num_envs, leaf.spec.nbytes)
    if size < need:
        return None, f"staging file {path} has {size} bytes, expected {need}"
    if not head.startswith(STAGING_MAGIC):
        return None, f"staging file {path} is damaged (bad magic)"
    _, segment, base, filled = np.frombuffer(head[len(STAGING_MAGIC) :], "<i8").tolist()
    if not (-1 <= segment < -(-meta.capacity // leaf.chunk_steps) and 0 <= base <= filled <= leaf.chunk_steps):
        return None, f"staging file {path} is damaged (header segment {segment} steps {base}..{filled})"
    return (segment, base, filled), None


def segments_outside_staging(
    meta: Metadata, leaf: LeafInfo, staged: tuple[int, int, int] | None
) -> list[tuple[int, list[int]]]:
    """(segment, its steps) of a row-frames leaf's retained committed steps that are not
    in staging (``staged``: its segment, base, filled), so in their segment's shard."""
    seg = leaf.chunk_steps
    segment, base, filled = staged or (-1, 0, 0)
    out = []
    for k in chunks_of(meta, leaf):
        steps = sorted(
            t - k * seg
            for a, b in retained_ranges(meta)
            for t in range(max(a, k * seg), min(b, (k + 1) * seg))
            if not (k == segment and base <= t - k * seg < filled)
        )
        if steps:
            out.append((k, steps))
    return out


def _row_leaf_checks(
    arr_dir: str, arr: Any, meta: Metadata, leaf: LeafInfo, deep: bool, found: _ZarrLeafState, problem: Any
) -> None:
    """A row-frames leaf: its shape, staging file, and the shard (index, frames) of every
    segment with retained committed steps outside staging."""
    seg, envs = leaf.chunk_steps, meta.num_envs
    if arr.shards != (seg, *leaf_shape(meta, leaf)[1:]) or arr.chunks != (1, 1, *leaf.spec.shape):
        found.unusable = f"{arr_dir}: expected shards of {seg} steps and one-row chunks, found shards {arr.shards} chunks {arr.chunks}"
        problem(found.unusable)
        return
    staged, why = _staging_segment(arr_dir, meta, leaf)
    if why:
        found.bad_staging = why
        problem(why)
    for k, steps in segments_outside_staging(meta, leaf, staged):
        shard = os.path.join(arr_dir, chunk_key(arr, k))
        named = f"shard file {shard} (segment {k}, slots {k * seg}..{min((k + 1) * seg, meta.capacity) - 1})"
        try:
            data = read_inside(arr_dir, os.path.relpath(shard, arr_dir), shard_limit(seg * envs, leaf.spec.nbytes), "a shard")
            offsets, lengths = read_shard_index(data, seg * envs, shard)
        except FileNotFoundError:
            found.bad_chunks[k] = f"{named} is missing"
            continue
        except CorruptBufferError as exc:
            found.bad_chunks[k] = f"segment {k}: {exc}"
            continue
        rows = (np.asarray(steps)[:, None] * envs + np.arange(envs)).reshape(-1)
        if (offsets[rows] < 0).any():
            found.bad_chunks[k] = f"{named} lacks committed rows"
        elif deep:  # every frame decoded, zstd's content checksums checked
            try:
                check_frames(leaf, arr_dir, data, offsets[rows], lengths[rows])
            except Exception as exc:
                found.bad_chunks[k] = f"{named} does not decode ({type(exc).__name__}: {exc})"
    for why in found.bad_chunks.values():
        problem(f"{why} (it holds committed steps)")


def _repair_rows(folder: str, meta: Metadata, leaf: LeafInfo, s: _ZarrLeafState, repairs: Repairs) -> list[tuple[int, int, str]]:
    """Damaged shards of a row-frames leaf become shards of zero rows; a damaged staging
    file an empty one. Returns the slot ranges whose rows are gone."""
    arr_dir = os.path.join(folder, DATA_DIR, leaf.path)
    damaged = []
    seg = leaf.chunk_steps
    if s.bad_staging:
        path = os.path.join(arr_dir, STAGING_FILE)
        repairs.move_aside(path)
        create_staging(path, seg, meta.num_envs, leaf.spec.nbytes)
        repairs.actions.append(f"leaf {leaf.path!r}: made a new, empty staging file")
        # The shard of the segment the head was in may hold an older lap: its rows are gone.
        end = meta.state.end
        if end > meta.state.first(meta.capacity):
            last = (end - 1) % meta.capacity
            damaged.append((last - last % seg, last + 1, f"leaf {leaf.path!r}: {s.bad_staging}"))
    if s.bad_chunks:
        zero = np.zeros((meta.num_envs, *leaf.spec.shape), leaf.spec.dtype)
        store = _open_row_leaf(folder, meta, leaf)
        try:
            for k, why in sorted(s.bad_chunks.items()):
                a, b = k * seg, min((k + 1) * seg, meta.capacity)
                repairs.move_aside(store.shard_path(k))
                frames = store._encode_step(zero) * (b - a)
                store._write_shard(k, frames + [None] * (seg * meta.num_envs - len(frames)))
                repairs.actions.append(f"leaf {leaf.path!r}: rewrote segment {k} (slots {a}..{b - 1}) as zeros")
                damaged.append((a, b, f"leaf {leaf.path!r}: {why}"))
        finally:
            store.mm.close()
    return damaged


def _open_row_leaf(folder: str, meta: Metadata, leaf: LeafInfo) -> RowFrameLeaf:
    """A row-frames leaf opened for writing, without its staging segment (for repair)."""
    arr = _open_local(folder, meta, leaf)
    return _row_leaf(LocalFolder(folder), f"{DATA_DIR}/{leaf.path}", arr, leaf, meta, True)


def _groups(meta: Metadata) -> list[str]:
    """The zarr groups of the nest, root first ("" is the root)."""
    paths = [leaf.path.split("/") for leaf in meta.leaves]
    groups = {""} | {"/".join(parts[:i]) for parts in paths for i in range(1, len(parts))}
    return sorted(groups, key=lambda g: (g.count("/"), g))


def bad_groups(where: str | ByteSource, meta: Metadata) -> list[str]:
    """Groups whose zarr.json is missing or not a zarr v3 group (zarr readers need them),
    in a folder or an object-store prefix."""
    source = where if isinstance(where, ByteSource) else LocalFolder(where)
    bad = []
    for group in _groups(meta):
        try:
            doc = json.loads(source.read("/".join(filter(None, (DATA_DIR, group, "zarr.json"))), 1 << 20))
            ok = isinstance(doc, dict) and doc.get("node_type") == "group" and doc.get("zarr_format") == 3
        except FileNotFoundError:
            ok = False
        except RemoteError:
            raise  # the object store failed, not the group
        except (OSError, ValueError, RecursionError):
            ok = False
        if not ok:
            bad.append(group)
    return bad


def verify_leaves(folder: str, meta: Metadata, deep: bool, problems: list[str]) -> dict[str, _ZarrLeafState]:
    """Check every leaf's files against ``meta``, adding what is wrong to ``problems``
    (``deep``: decode the chunks of the retained committed steps too); returns what
    :func:`repair` acts on."""
    root = os.path.join(folder, DATA_DIR)
    if not os.path.isdir(root):
        problems.append(f"{root}: the data folder is missing")
        return {leaf.path: _ZarrLeafState(unusable="data folder missing") for leaf in meta.leaves}
    for group in bad_groups(folder, meta):
        problems.append(
            f"{os.path.join(root, group, 'zarr.json')}: zarr group metadata is missing or damaged"
        )
    return {leaf.path: _zarr_leaf(folder, meta, leaf, deep, problems) for leaf in meta.leaves}


def repair(folder: str, meta: Metadata, repairs: Repairs) -> tuple[Metadata, list[tuple[int, int, str]]]:
    """Restore what :func:`verify_leaves` finds damaged; returns the metadata and the slot
    ranges ``[a, b)`` whose rows are gone, with why."""
    found = verify_leaves(folder, meta, True, [])
    damaged: list[tuple[int, int, str]] = []
    fresh: str | None = None
    try:
        if any(s.unusable for s in found.values()) and not os.path.isdir(os.path.join(folder, DATA_DIR)):
            fresh, _ = repairs.fresh_layout(meta, create)
            os.replace(os.path.join(fresh, DATA_DIR), os.path.join(folder, DATA_DIR))
            repairs.actions.append(f"recreated the missing {DATA_DIR} folder, empty")
            return meta, [(0, meta.capacity, f"{DATA_DIR} was missing")]
        missing_groups = bad_groups(folder, meta)
        if missing_groups or any(s.meta_bad for s in found.values()):
            fresh, _ = repairs.fresh_layout(meta, create)
        for group in missing_groups:  # the same layout makes the same group metadata
            target = os.path.join(folder, DATA_DIR, group, "zarr.json")
            repairs.move_aside(target)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(fresh, DATA_DIR, group, "zarr.json"), target)
            repairs.actions.append(f"rewrote {os.path.relpath(target, folder)}")
        for leaf in meta.leaves:
            s = found[leaf.path]
            arr_dir = os.path.join(folder, DATA_DIR, leaf.path)
            if s.meta_bad and os.path.isdir(arr_dir):  # the data may be intact: restore the array metadata
                target = os.path.join(arr_dir, "zarr.json")
                repairs.move_aside(target)
                shutil.copyfile(os.path.join(fresh, DATA_DIR, leaf.path, "zarr.json"), target)
                repairs.actions.append(f"leaf {leaf.path!r}: rewrote {os.path.relpath(target, folder)}")
                s = found[leaf.path] = _zarr_leaf(folder, meta, leaf, True, [])
            if s.unusable:
                if fresh is None:
                    fresh, _ = repairs.fresh_layout(meta, create)
                repairs.move_aside(arr_dir)
                os.makedirs(os.path.dirname(arr_dir), exist_ok=True)
                os.replace(os.path.join(fresh, DATA_DIR, leaf.path), arr_dir)
                repairs.actions.append(f"recreated leaf {leaf.path!r}, empty")
                damaged.append((0, meta.capacity, f"leaf {leaf.path!r}: {s.unusable}"))
                continue
            if leaf.mapped and (s.shard_short is not None or s.bad_index):
                shard = os.path.join(folder, leaf.file or "")
                data_bytes, file_bytes, index = _shard_layout(leaf, meta.capacity, meta.num_envs)
                short = s.shard_short
                if os.path.lexists(shard) and not os.path.isfile(shard):
                    repairs.move_aside(shard)
                os.makedirs(os.path.dirname(shard), exist_ok=True)
                fd = os.open(shard, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    if short is not None:
                        os.ftruncate(fd, file_bytes)
                    os.pwrite(fd, index.tobytes(), data_bytes)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if short is not None:
                    step_bytes = meta.num_envs * leaf.spec.nbytes
                    lo = min(meta.capacity, short // max(1, step_bytes))
                    what = "missing" if short == 0 else f"truncated to {short} bytes"
                    repairs.actions.append(
                        f"leaf {leaf.path!r}: restored its data file ({what}) to {file_bytes} bytes"
                    )
                    damaged.append((lo, meta.capacity, f"leaf {leaf.path!r}: its data file was {what}"))
                else:
                    repairs.actions.append(f"leaf {leaf.path!r}: rewrote the shard index")
            if is_row_compression(leaf.compression):
                damaged += _repair_rows(folder, meta, leaf, s, repairs)
                continue
            if s.bad_chunks:
                arr = _open_local(folder, meta, leaf, True).with_config({"write_empty_chunks": True})
                for k, why in sorted(s.bad_chunks.items()):
                    a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
                    chunk = os.path.join(arr_dir, chunk_key(arr, k))
                    repairs.move_aside(chunk)
                    arr[a:b] = np.zeros((b - a, *arr.shape[1:]), arr.dtype)
                    repairs.actions.append(f"leaf {leaf.path!r}: rewrote chunk {k} (slots {a}..{b - 1}) as zeros")
                    damaged.append((a, b, f"leaf {leaf.path!r}: {why}"))
    finally:
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
    return meta, damaged
