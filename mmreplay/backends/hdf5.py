"""HDF5 backend: ``data.h5``, one dataset per leaf path.

An uncompressed leaf is a contiguous dataset allocated at creation, so it sits at a fixed
file offset and is memory-mapped; h5py is not involved after creation. A compressed leaf
is a chunked dataset in a file the writer holds in SWMR mode: HDF5 then orders its own
metadata writes so the file stays readable if the writer dies, and readers open it with
``swmr=True``. Its chunks are encoded by mmreplay and rewritten in place behind a redo
journal (:mod:`.h5chunks`), so the file does not grow as the ring turns. A writer killed
in SWMR mode leaves the superblock's "open for write" flag set; the next writer (which
holds the buffer's lock, so the old one is gone) clears it, as ``h5clear -s`` would,
and writes the journal back. A chunk write refused for want of space can leave the file
shorter than the end HDF5 recorded; the next writer extends it when nothing the file
references lies in the missing bytes (:func:`restore_recorded_end`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

import h5py
import numpy as np

from ..errors import CorruptBufferError, DiskFullError, Error, SpecError
from ..io import ByteSource
from ..io.local import checked_inside
from ..lock import holder_pid
from ..metadata import LeafInfo, Metadata
from .base import ChunkedLeaf, Leaf, MappedLeaf, disk_full_as, fsync_path, parse_compression, preallocate
from .checks import Repairs, chunks_of, leaf_nbytes, leaf_shape
from .h5chunks import (
    JOURNAL_SUFFIX,
    ChunkGroup,
    Codec,
    H5Chunks,
    Journal,
    UnreadableMetadataError,
    check_filters,
    file_access,
    journal_limits,
    journal_path,
    leaf_dataset,
    open_swmr_reader,
    replay,
    require_file_filters,
    require_filters,
)
from .row_codec import is_row_compression

DATA_FILE = "data.h5"


def _compression(text: str) -> dict[str, Any]:
    if is_row_compression(text):
        raise SpecError(
            f"compression {text!r} (one compressed frame per row) exists in the zarr backend only; "
            "the hdf5 backend takes gzip (or zstd / blosc with hdf5plugin), or none"
        )
    c = parse_compression(text)
    if c.codec == "gzip":
        return {"compression": "gzip", "compression_opts": 4 if c.level is None else c.level}
    if c.codec == "lzf":
        raise SpecError(
            f"compression {text!r}: the hdf5 backend rewrites chunks in place, padded to "
            "their slot, and an lzf stream cannot be padded; use 'gzip' (or zstd / blosc "
            "with hdf5plugin)"
        )
    try:
        import hdf5plugin
    except ImportError:
        raise ImportError(
            f"compression {text!r} in the hdf5 backend needs hdf5plugin: "
            "pip install 'mmreplay[hdf5plugin]' (gzip needs nothing)"
        ) from None
    if c.codec == "zstd":
        return dict(hdf5plugin.Zstd(clevel=3 if c.level is None else c.level))
    return dict(
        hdf5plugin.Blosc(
            cname=c.cname or "zstd",
            clevel=5 if c.level is None else c.level,
            shuffle=hdf5plugin.Blosc.SHUFFLE,
        )
    )


def check_compression(text: str) -> None:
    _compression(text)


def create(folder: str, leaves: list[LeafInfo], capacity: int, num_envs: int) -> list[LeafInfo]:
    path = os.path.join(folder, DATA_FILE)
    out = _write_file(path, leaves, capacity, num_envs)
    fd = os.open(path, os.O_RDWR)
    try:
        preallocate(fd, os.fstat(fd).st_size, path)
    finally:
        os.close(fd)
    return out


def planned_bytes(
    leaves: list[LeafInfo], capacity: int, num_envs: int
) -> tuple[list[LeafInfo], dict[str, int], int]:
    """What :func:`create` makes, without allocating it: the leaves as it places them,
    the data bytes of each uncompressed leaf, and the rest of the file (HDF5's own
    metadata). The file is made in a temporary folder without preallocation: its
    contiguous datasets are never written (``FILL_TIME_NEVER``), so it is sparse and
    takes no disk blocks."""
    with tempfile.TemporaryDirectory(prefix="mmreplay-plan-") as tmp:
        path = os.path.join(tmp, DATA_FILE)
        try:
            placed = _write_file(path, leaves, capacity, num_envs)
        except DiskFullError as exc:  # past a file size limit: the temporary file means nothing to the user
            raise DiskFullError(str(exc).replace(path, DATA_FILE)) from None
        total = os.path.getsize(path)
    data = {leaf.path: capacity * num_envs * leaf.spec.nbytes for leaf in leaves if leaf.compression is None}
    return placed, data, total - sum(data.values())


def _write_file(path: str, leaves: list[LeafInfo], capacity: int, num_envs: int) -> list[LeafInfo]:
    """``data.h5`` with one dataset per leaf (contiguous ones allocated, not written)."""
    out = []
    need = sum(capacity * num_envs * leaf.spec.nbytes for leaf in leaves if leaf.compression is None)
    with disk_full_as(f"{path}: needs {need} bytes for the uncompressed leaves, and found no room"), h5py.File(
        path, "w-", libver="latest"
    ) as f:  # early allocation extends the file at close
        for leaf in leaves:
            dtype = leaf.spec.dtype.newbyteorder("<")
            shape = (capacity, num_envs, *leaf.spec.shape)
            if leaf.compression is not None:
                f.create_dataset(
                    leaf.path,
                    shape=shape,
                    dtype=dtype,
                    chunks=(leaf.chunk_steps, num_envs, *leaf.spec.shape),
                    fillvalue=np.zeros((), dtype)[()],
                    fletcher32=True,  # a checksum per chunk: a damaged chunk is an error, never other rows
                    **_compression(leaf.compression),
                )
                out.append(replace(leaf, file=DATA_FILE, offset=None))
                continue
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_layout(h5py.h5d.CONTIGUOUS)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
            dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
            parent, _, name = leaf.path.rpartition("/")
            group = f.require_group(parent) if parent else f
            dsid = h5py.h5d.create(
                group.id,
                name.encode(),
                h5py.h5t.py_create(dtype),
                h5py.h5s.create_simple(shape),
                dcpl=dcpl,
            )
            offset = dsid.get_offset()
            out.append(replace(leaf, file=DATA_FILE, offset=0 if offset is None else int(offset)))
    return out


def _mapped_end(meta: Metadata) -> int:
    """The byte of ``data.h5`` where the last mapped leaf ends (0: none is mapped)."""
    ends = ((leaf.offset or 0) + leaf_nbytes(meta, leaf) for leaf in meta.leaves if leaf.mapped)
    return max(ends, default=0)


class _SwmrFile:
    """The h5py handle of the compressed leaves, shared by them, and their chunk group.

    The store calls :meth:`flush` after every leaf's: the group then writes the journal
    and the chunks the leaves handed over, and flushes the file."""

    def __init__(self, path: str, meta: Metadata, writable: bool):
        self.path = path
        self.group = ChunkGroup(Journal(path, journal_limits(meta)), self.flush_file)
        try:
            if writable:
                clear_status_flags(path)
                restore_recorded_end(path, meta.durability == "power")
                # open straight into SWMR-write mode: File("r+") then swmr_mode = True
                # leaves a moment where a killed writer's flags lock readers out
                flags = h5py.h5f.ACC_RDWR | h5py.h5f.ACC_SWMR_WRITE
            else:
                flags = h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ
            fapl = file_access()
            # no HDF5 chunk cache: chunks are rewritten in place, and the leaves keep their own
            fapl.set_cache(0, 0, 0, 0.0)
            self.file = h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=fapl))
        except Error:
            raise  # says what it is (a truncated file, no room to extend it)
        except OSError as exc:
            raise CorruptBufferError(f"{path}: cannot open HDF5 file: {exc}") from None
        if writable:
            try:
                self.group.carried = replay(self.file, self.group.journal)  # chunks a killed writer may have torn
                if self.group.carried:
                    self.flush_file(meta.durability == "power")
            except BaseException:
                self.close()
                raise

    def flush(self, fsync: bool) -> None:
        self.group.flush(fsync)

    def flush_file(self, fsync: bool) -> None:
        self.file.flush()
        if fsync:
            fsync_path(self.path)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.file.close()


def open_leaves(source: ByteSource, meta: Metadata, writable: bool) -> list[Leaf]:
    if not source.local:
        from ..io.remote import HDF5_REFUSED

        raise CorruptBufferError(f"{source.url}: {HDF5_REFUSED}")
    folder = source.path
    path = os.path.join(folder, DATA_FILE)
    mapped = [leaf for leaf in meta.leaves if leaf.mapped]
    mm = source.map(DATA_FILE, writable, _mapped_end(meta)) if mapped else None
    if len(mapped) < len(meta.leaves):
        try:
            path = checked_inside(folder, DATA_FILE)  # h5py opens it by name
        except FileNotFoundError:
            raise CorruptBufferError(f"{path}: data file is missing") from None
        handle = _SwmrFile(path, meta, writable)
    else:
        handle = None
    out: list[Leaf] = []
    try:
        for leaf in meta.leaves:
            if leaf.mapped:  # one mapping of data.h5 for all of them: the first one syncs it
                out.append(MappedLeaf(leaf, meta.capacity, meta.num_envs, mm, syncs_map=leaf is mapped[0]))
                continue
            assert handle is not None
            dset = leaf_dataset(handle.file, leaf.path, path)
            expected = leaf_shape(meta, leaf)
            chunks = (leaf.chunk_steps, *expected[1:])
            if (
                not isinstance(dset, h5py.Dataset)
                or dset.shape != expected
                or dset.dtype != leaf.spec.dtype
                or dset.chunks != chunks
            ):
                found = "nothing" if dset is None else f"{getattr(dset, 'shape', '?')} {getattr(dset, 'dtype', '?')} in chunks of {getattr(dset, 'chunks', '?')}"
                raise CorruptBufferError(f"{path}: leaf {leaf.path!r} expected {expected} {leaf.spec.dtype} in chunks of {chunks}, found {found}")
            check_filters(dset, f"{path}: leaf {leaf.path!r}", writable)
            out.append(ChunkedLeaf(leaf, meta.capacity, H5Chunks(dset, leaf.path, handle.group, writable)))
    except BaseException:
        for entry in out:
            entry.close()
        if handle is not None:
            handle.close()
        raise
    if handle is not None:
        out.append(handle)  # type: ignore[arg-type]  # closed after the leaves, flushed after them
    return out


def data_paths(folder: str, meta: Metadata) -> list[str]:
    return [os.path.join(folder, DATA_FILE)]


# --- superblock status flags (what h5clear -s does) -------------------------------------

_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def clear_status_flags(path: str) -> bool:
    """Clear the "open for write" flags a dead SWMR writer left; True if it did.

    Only version 2 and 3 superblocks (``libver="latest"``) carry the flags and a
    checksum; the checksum is verified first, so a damaged superblock is never blessed.
    The end-of-file address is raised to the file's size too (``h5clear -s
    --increment``): a dead writer's flushed chunk index may point past the address its
    superblock recorded, and HDF5 would cut those chunks off at the next flush.
    """
    with open(path, "r+b") as f:
        head = f.read(48)
        if len(head) < 12 or head[:8] != _SIGNATURE or head[8] not in (2, 3):
            return False
        size = 12 + 4 * head[9] + 4
        f.seek(0)
        block = f.read(size)
        if len(block) < size or head[11] == 0:
            return False
        (stored,) = struct.unpack("<I", block[-4:])
        if lookup3(block[:-4]) != stored:
            raise CorruptBufferError(f"{path}: HDF5 superblock checksum mismatch")
        fixed = block[:11] + b"\x00" + block[12:-4]
        if head[9] == 8:  # 8-byte addresses: base, extension, end of file at byte 28
            (eof,) = struct.unpack("<Q", block[28:36])
            size = os.fstat(f.fileno()).st_size
            if size > eof:
                fixed = fixed[:28] + struct.pack("<Q", size) + fixed[36:]
        f.seek(0)
        f.write(fixed + struct.pack("<I", lookup3(fixed)))
        f.flush()
        os.fsync(f.fileno())
    return True


def tail_in_use(path: str, size: int) -> str | None:
    """What of ``data.h5`` lies at or past byte ``size`` (None: nothing it references).

    The file is opened read-only in SWMR mode, which skips HDF5's end-of-file check, and
    every dataset's object header and whole chunk index are read: they are checksummed,
    and a part of them past the end reads as zeros and fails its checksum. Then every
    chunk and every contiguous dataset must end at or before ``size``.
    """
    where: list[str] = []

    def check(name: str, obj: Any) -> None:
        if not isinstance(obj, h5py.Dataset):
            return
        if obj.chunks is None:
            offset = obj.id.get_offset()
            if offset is not None and int(offset) + obj.id.get_storage_size() > size:
                where.append(f"dataset {name!r} ends at byte {int(offset) + obj.id.get_storage_size()}")
            return
        ends: list[int] = []
        obj.id.chunk_iter(lambda info: ends.append(info.byte_offset + info.size))
        past = [end for end in ends if end > size]
        if past:
            where.append(f"{len(past)} chunks of {name!r} end past it, the last at byte {max(past)}")

    try:
        with open_swmr_reader(path) as f:
            f.visititems(check)
    except Exception as exc:
        return f"its metadata does not read ({type(exc).__name__}: {exc})"
    return "; ".join(where) or None


def restore_recorded_end(path: str, fsync: bool) -> tuple[int, int] | None:
    """Extend ``data.h5`` to the end of file its superblock records, when it is shorter
    and nothing it references lies in the missing bytes (:func:`tail_in_use`); returns
    (old size, new size), or None when the file is not short.

    HDF5 gives a new chunk the space at the end of the file, then writes it, and only
    once written enters it into the chunk index. When that write is refused for want of
    space, the chunk never enters the index, but the recorded end already covers it; at
    close HDF5 extends the file to that end (``ftruncate``). A full disk lets that
    through (a hole needs no blocks); a file size limit (``ulimit -f``) refuses it too,
    and leaves a file that HDF5 will not open for writing ("truncated file"). Extending
    it is what HDF5's close would have done. A file cut short for any other reason has
    chunks or metadata in the missing bytes: it is refused and left as it is.
    """
    status = hdf5_status(path)
    size = os.path.getsize(path)
    if status is None or size >= status[1]:
        return None
    eof = status[1]
    why = tail_in_use(path, size)
    if why is not None:
        raise CorruptBufferError(
            f"{path}: data file is truncated: {size} bytes, HDF5 expects {eof}, and {why}; "
            "run `mmreplay recover`"
        )
    with disk_full_as(f"{path}: no room to extend the file to the {eof} bytes HDF5 recorded"):
        with open(path, "r+b") as f:
            f.truncate(eof)
            if fsync:
                os.fsync(f.fileno())
    return size, eof


def lookup3(data: bytes, initval: int = 0) -> int:
    """Bob Jenkins' lookup3 ``hashlittle``, the checksum of HDF5 metadata."""
    m = 0xFFFFFFFF

    def rot(x: int, k: int) -> int:
        return ((x << k) | (x >> (32 - k))) & m

    length = len(data)
    a = b = c = (0xDEADBEEF + length + initval) & m
    i = 0
    while length > 12:
        a = (a + int.from_bytes(data[i : i + 4], "little")) & m
        b = (b + int.from_bytes(data[i + 4 : i + 8], "little")) & m
        c = (c + int.from_bytes(data[i + 8 : i + 12], "little")) & m
        a = (a - c) & m; a ^= rot(c, 4); c = (c + b) & m  # noqa: E702
        b = (b - a) & m; b ^= rot(a, 6); a = (a + c) & m  # noqa: E702
        c = (c - b) & m; c ^= rot(b, 8); b = (b + a) & m  # noqa: E702
        a = (a - c) & m; a ^= rot(c, 16); c = (c + b) & m  # noqa: E702
        b = (b - a) & m; b ^= rot(a, 19); a = (a + c) & m  # noqa: E702
        c = (c - b) & m; c ^= rot(b, 4); b = (b + a) & m  # noqa: E702
        length -= 12
        i += 12
    if length == 0:
        return c
    tail = data[i:] + b"\x00" * (12 - length)
    a = (a + int.from_bytes(tail[0:4], "little")) & m
    b = (b + int.from_bytes(tail[4:8], "little")) & m
    c = (c + int.from_bytes(tail[8:12], "little")) & m
    c ^= b; c = (c - rot(b, 14)) & m  # noqa: E702
    a ^= c; a = (a - rot(c, 11)) & m  # noqa: E702
    b ^= a; b = (b - rot(a, 25)) & m  # noqa: E702
    c ^= b; c = (c - rot(b, 16)) & m  # noqa: E702
    a ^= c; a = (a - rot(c, 4)) & m  # noqa: E702
    b ^= a; b = (b - rot(a, 14)) & m  # noqa: E702
    c ^= b; c = (c - rot(b, 24)) & m  # noqa: E702
    return c


def leftover_files(folder: str) -> list[str]:
    """Files a killed writer may leave: a chunk journal's temporary copy."""
    return glob.glob(os.path.join(glob.escape(folder), DATA_FILE + JOURNAL_SUFFIX + ".*.tmp"))


def require_codecs(folder: str) -> None:
    """Raise ImportError (naming the extra) when a chunk filter of ``data.h5`` cannot be
    loaded here: chunks that cannot be decoded for that reason are no damage."""
    path = os.path.join(folder, DATA_FILE)
    if os.path.isfile(path):
        require_file_filters(path)


# --- verify and repair (mmreplay.verify runs them) ------------------------------------------


def hdf5_status(path: str) -> tuple[int, int] | None:
    """(status flags, end-of-file address) of a version 2/3 superblock, or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(48)
    except OSError:
        return None
    if len(head) < 48 or head[:8] != _SIGNATURE or head[8] not in (2, 3) or head[9] != 8:
        return None
    (eof,) = struct.unpack("<Q", head[28:36])
    return head[11], eof


@dataclass
class _Hdf5State:
    unusable: str | None = None
    short: int | None = None  # the file is shorter than HDF5's end-of-file address
    unused_tail: bool = False  # ... and nothing it references lies in the missing bytes
    bad_chunks: dict[str, dict[int, str]] = field(default_factory=dict)
    missing_chunks: dict[str, dict[int, str]] = field(default_factory=dict)  # never stored
    journal: dict = field(default_factory=dict)  # leaf path -> chunk -> (mask, bytes)
    bad_journal: bool = False
    links_out: str | None = None  # a leaf's dataset is elsewhere: never repaired, never written


def verify_leaves(folder: str, meta: Metadata, deep: bool, problems: list[str]) -> _Hdf5State:
    """Check ``data.h5`` (and its chunk journal) against ``meta``, adding what is wrong to
    ``problems`` (``deep``: decode the chunks of the retained committed steps too);
    returns what :func:`repair` acts on."""
    found = _Hdf5State()
    path = os.path.join(folder, DATA_FILE)

    def unusable(why: str) -> _Hdf5State:
        found.unusable = why
        problems.append(why)
        return found

    if not os.path.isfile(path):
        return unusable(f"data file {path} is missing")
    size = os.path.getsize(path)
    status = hdf5_status(path)
    if status is None:
        return unusable(f"{path}: not an HDF5 file with a version 2/3 superblock")
    flags, eof = status
    if size < eof:
        why = tail_in_use(path, size)
        if why is None:
            found.unused_tail = True
            problems.append(
                f"data file {path} ends at byte {size}, before the end HDF5 recorded ({eof}): a chunk "
                "write was refused there (a full disk or a file size limit); no committed chunk lies "
                "in the missing bytes, and the next writer or `mmreplay recover` extends the file"
            )
        else:
            found.short = size
            problems.append(f"data file {path} is truncated: {size} bytes, HDF5 expects {eof}, and {why}")
    need = _mapped_end(meta)
    if size < need:
        found.short = size if found.short is None else min(found.short, size)
        problems.append(f"data file {path} has {size} bytes, the mapped leaves need {need}")
    if flags and holder_pid(folder) is None:
        problems.append(
            f"{path}: marked open for writing by a writer that died (HDF5 status flags); "
            "plain h5py cannot open it until `mmreplay recover` or the next writer clears them"
        )
    if found.short is not None:
        return found
    journal = Journal(path, journal_limits(meta))
    try:
        found.journal = journal.load()
    except CorruptBufferError as exc:
        found.bad_journal = True
        problems.append(f"{exc}; the chunks it protects are unprotected until the next commit")
    try:
        f = open_swmr_reader(path)
    except Exception as exc:
        return unusable(f"h5py cannot open {path}: {exc}")
    unreadable: dict[str, str] = {}  # groups whose links do not read
    with f:
        for leaf in meta.leaves:
            where = f"leaf {leaf.path!r}"
            try:
                dset = leaf_dataset(f, leaf.path, path, unreadable)
            except UnreadableMetadataError as exc:
                unusable(str(exc))
                continue
            except CorruptBufferError as exc:
                found.links_out = str(exc)
                unusable(found.links_out)
                continue
            expected = leaf_shape(meta, leaf)
            if not isinstance(dset, h5py.Dataset):
                unusable(f"{path}: {where}: no dataset {leaf.path!r}")
                continue
            if dset.shape != expected or dset.dtype != leaf.spec.dtype:
                unusable(
                    f"{path}: {where}: expected {expected} {leaf.spec.dtype}, found {dset.shape} {dset.dtype}"
                )
                continue
            if leaf.mapped:
                offset = dset.id.get_offset()
                if dset.chunks is not None or offset is None or int(offset) != leaf.offset:
                    unusable(
                        f"{path}: {where}: metadata maps offset {leaf.offset}, the dataset is "
                        f"{'chunked' if dset.chunks else 'at offset ' + str(offset)}"
                    )
                continue
            if (
                dset.chunks != (leaf.chunk_steps, *expected[1:])
                or dset.id.get_create_plist().get_nfilters() == 0
            ):
                unusable(
                    f"{path}: {where}: expected compressed chunks of {leaf.chunk_steps} steps, "
                    f"found {dset.chunks}"
                )
                continue
            journaled = found.journal.get(leaf.path, {})
            tail = (0,) * (dset.ndim - 1)
            for k in chunks_of(meta, leaf):  # stored at all (h5py reads one never stored as zeros)
                a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
                try:
                    stored = dset.id.get_chunk_info_by_coord((a, *tail)).byte_offset is not None
                except RuntimeError as exc:  # the chunk index's checksum fails: the file's metadata is
                    # damaged, and each further read of it takes HDF5's re-reads (about a second)
                    return unusable(f"{path}: {where}: its chunk index does not read ({exc})")
                if not stored:
                    why = f"{path}: {where}: chunk {k} (slots {a}..{b - 1}) holds committed steps but was never stored"
                    if k in journaled:
                        why += " (the chunk journal holds it: the next writer or `mmreplay recover` writes it back)"
                    found.missing_chunks.setdefault(leaf.path, {})[k] = why
                    problems.append(why)
            if not deep:
                continue
            require_filters(dset, f"{path}: {where}")  # a missing codec is no damage: ImportError
            for k in chunks_of(meta, leaf):
                a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
                if k in found.missing_chunks.get(leaf.path, {}):
                    continue
                try:
                    np.asarray(dset[a:b])
                except Exception as exc:
                    if _journal_decodes(dset, journaled.get(k), f"{path}: {where}"):
                        continue
                    found.bad_chunks.setdefault(leaf.path, {})[k] = str(exc)
                    problems.append(
                        f"{path}: {where}: chunk {k} (steps in slots {a}..{b - 1}) does not decode: {exc}"
                    )
    return found


def _journal_decodes(dset: h5py.Dataset, record: Any, where: str) -> bool:
    """Whether the journal's copy of a chunk decodes (then readers use it, and the next
    writer writes it back)."""
    if record is None:
        return False
    try:
        codec = Codec(dset, where)
        try:
            codec.decode(*record)
        finally:
            codec.close()
    except Exception:
        return False
    return True


def repair(folder: str, meta: Metadata, repairs: Repairs) -> tuple[Metadata, list[tuple[int, int, str]]]:
    """Restore what :func:`verify_leaves` finds damaged; returns the metadata (a recreated
    file places its leaves anew: the caller records them) and the slot ranges ``[a, b)``
    whose rows are gone, with why."""
    path = os.path.join(folder, DATA_FILE)
    found = verify_leaves(folder, meta, True, [])
    if found.links_out is not None:
        raise CorruptBufferError(f"{found.links_out}; recover changes nothing in such a buffer")
    damaged: list[tuple[int, int, str]] = []
    if found.short is not None and found.unusable is None:
        status = hdf5_status(path)
        need = max(status[1] if status else 0, _mapped_end(meta))
        short = found.short
        with open(path, "r+b") as f:
            f.truncate(need)
            os.fsync(f.fileno())
        repairs.actions.append(f"extended the truncated {DATA_FILE} from {short} to {need} bytes")
        for leaf in meta.leaves:
            why = f"leaf {leaf.path!r}: {DATA_FILE} was truncated"
            if not leaf.mapped:
                damaged.append((0, meta.capacity, f"{why} (its chunks may be gone)"))
            elif leaf.offset + leaf_nbytes(meta, leaf) > short:
                lo = max(0, (short - leaf.offset) // max(1, meta.num_envs * leaf.spec.nbytes))
                damaged.append((min(lo, meta.capacity), meta.capacity, why))
        found = verify_leaves(folder, meta, True, [])
    restored = restore_recorded_end(path, fsync=True) if found.unused_tail else None
    if restored is not None:
        repairs.actions.append(
            f"extended {DATA_FILE} from {restored[0]} to {restored[1]} bytes, the end HDF5 recorded "
            "(a refused chunk write left it short; no committed chunk was in the missing bytes)"
        )
    # verify_leaves sees recover's own lock as a live writer's: the flags are a dead one's
    if found.unusable is None and clear_status_flags(path):
        repairs.actions.append(f"cleared the HDF5 status flags a dead writer left in {DATA_FILE}")
    if found.bad_journal:
        repairs.move_aside(journal_path(path))
    elif found.journal and found.unusable is None:
        with h5py.File(path, "r+", libver="latest") as f:
            count = sum(len(c) for c in replay(f, Journal(path, journal_limits(meta))).values())
        repairs.actions.append(f"wrote {count} chunks back from the chunk journal into {DATA_FILE}")
        found = verify_leaves(folder, meta, True, [])
    if found.missing_chunks and found.unusable is None and not found.bad_chunks:
        with h5py.File(path, "r+", libver="latest") as f:  # zeros, checksummed; the steps are dropped
            for leaf_path, chunks in found.missing_chunks.items():
                dset = f[leaf_path]
                cs = dset.chunks[0]
                for k, why in sorted(chunks.items()):
                    a, b = k * cs, min((k + 1) * cs, meta.capacity)
                    dset[a:b] = np.zeros((b - a, *dset.shape[1:]), dset.dtype)
                    repairs.actions.append(f"leaf {leaf_path!r}: stored chunk {k} (slots {a}..{b - 1}) as zeros")
                    damaged.append((a, b, why))
    if found.unusable is not None or found.bad_chunks:
        why = found.unusable or "; ".join(
            f"leaf {p!r} chunks {sorted(c)} do not decode" for p, c in found.bad_chunks.items()
        )
        fresh, infos = repairs.fresh_layout(meta, create)
        try:
            repairs.move_aside(path)
            repairs.move_aside(journal_path(path))  # its chunks belong to the old file
            os.replace(os.path.join(fresh, DATA_FILE), path)
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
        meta = replace(
            meta,
            leaves=tuple(
                replace(old, file=new.file, offset=new.offset) for old, new in zip(meta.leaves, infos)
            ),
        )
        repairs.actions.append(f"recreated {DATA_FILE} with the same layout, empty")
        damaged.append((0, meta.capacity, f"{DATA_FILE}: {why}"))
    return meta, damaged
