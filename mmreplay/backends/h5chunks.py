"""Compressed HDF5 chunks that are rewritten in place, with a redo journal.

A ring rewrites every chunk again and again, and the head chunk at every commit. Left to
itself, HDF5 in SWMR mode gives a chunk whose compressed size changed a new place in the
file and never frees the old one (a SWMR reader may still be reading it), so the file
grows with every rewrite; and a chunk whose size did not change is overwritten in place,
where a writer killed mid-write tears rows that were already committed.

So mmreplay encodes chunks itself and writes them with ``write_direct_chunk``:

- Each chunk keeps one *slot*: its stored length. A new encoding shorter than the slot is
  padded to it, so it is written in place and the file does not grow. The padding is
  what each codec's decoder skips: bytes after the end of a deflate or blosc stream, a
  zstd skippable frame. Only an encoding longer than the slot gets a new, larger slot
  (half as large again, at most the raw chunk), so each chunk moves a bounded number of
  times in the life of the file. lzf streams cannot be padded, so lzf is refused.
- Before a commit overwrites chunks in place, their new bytes go to ``data.h5.journal``
  (replaced atomically). Those are the chunks the write head is in (and those ``set``
  changed), so the journal always holds the one chunk with committed rows that may be
  overwritten before the next commit: the head's, when the head leaves it. A chunk a
  killed writer tore is therefore in the journal: the next writer writes the journal
  back (redo) when it opens the buffer, and a reader that finds a chunk that does not
  decode reads the journal's copy instead.
- The Fletcher-32 checksum the dataset declares is computed here, over the padded
  bytes, so ``h5py`` and any HDF5 reader verify and decode the chunks as usual.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import time
import zlib
from typing import Any

import h5py
import numpy as np
from h5py._objects import phil

from ..errors import CorruptBufferError, SpecError
from ..io.local import read_inside
from ..metadata import atomic_write
from .base import disk_full_as

JOURNAL_SUFFIX = ".journal"
_MAGIC = b"MMRJRNL1"
_RECORD = struct.Struct("<HQIQ")  # path length, chunk number, filter mask, payload length

_DEFLATE, _LZF, _BLOSC, _ZSTD = 1, 32000, 32001, 32015
_PLUGIN_FILTERS = {_BLOSC, _ZSTD}
_ZSTD_SKIPPABLE = 0x184D2A50
_FILTER_NAMES = {_DEFLATE: "gzip", _LZF: "lzf", _BLOSC: "blosc", _ZSTD: "zstd", 3: "Fletcher-32"}
PLUGIN_INSTALL = "pip install 'mmreplay[hdf5plugin]'"


#: reads of a piece of HDF5 metadata before its checksum counts as wrong. A SWMR reader
#: reads a piece again while its checksum fails (a writer may be writing it), sleeping
#: twice as long each time from 1 ns: HDF5's 100 tries keep a reader of a damaged file
#: waiting for ever, 30 give up after half a second.
METADATA_READ_ATTEMPTS = 30


@functools.cache
def _set_metadata_read_attempts() -> Any:
    """HDF5's ``H5Pset_metadata_read_attempts``, which h5py does not wrap, looked up through
    an h5py extension: its dependencies hold the HDF5 library h5py itself calls. None
    where a build hides it (HDF5's own count then stands)."""
    try:
        function = ctypes.CDLL(h5py.h5p.__file__).H5Pset_metadata_read_attempts
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int64, ctypes.c_uint]
    return function


def file_access() -> Any:
    """The file access property list of ``data.h5``: the latest format, no HDF5 file lock,
    and metadata read at most :data:`METADATA_READ_ATTEMPTS` times."""
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    # no HDF5 file lock: the buffer's own lock keeps writers apart, and HDF5's, held by a
    # reader that opened the file while no writer had it, refused every writer after
    fapl.set_file_locking(False, True)
    set_attempts = _set_metadata_read_attempts()
    if set_attempts is not None:
        with phil:  # (h5py's lock: no other thread is inside HDF5 meanwhile)
            set_attempts(fapl.id, METADATA_READ_ATTEMPTS)
    return fapl


def open_swmr_reader(path: str) -> h5py.File:
    """``path`` opened read-only in SWMR mode, as a writer may be writing it."""
    flags = h5py.h5f.ACC_RDONLY | h5py.h5f.ACC_SWMR_READ
    return h5py.File(h5py.h5f.open(os.fsencode(path), flags, fapl=file_access()))


def fletcher32(data: bytes | memoryview) -> int:
    """HDF5's Fletcher-32 (``H5_checksum_fletcher32``): big-endian 16-bit words, sums
    folded modulo 65535 with 0xFFFF, not 0, for a non-zero multiple."""
    buf = np.frombuffer(data, np.uint8)
    if len(buf) % 2:
        buf = np.append(buf, np.uint8(0))
    words = buf.view(">u2").astype(np.int64)
    n = len(words)
    s1 = int(words.sum())
    s2 = 0
    for lo in range(0, n, 1 << 24):  # weights n - i, reduced mod 65535, keep int64 sums exact
        part = words[lo : lo + (1 << 24)]
        weights = (n - lo - np.arange(len(part), dtype=np.int64)) % 65535
        s2 += int((part * weights).sum())

    def fold(s: int) -> int:
        return 0 if s == 0 else (s - 1) % 65535 + 1

    return (fold(s2) << 16) | fold(s1)


def filters_of(dset: h5py.Dataset) -> list[tuple[int, int, tuple]]:
    dcpl = dset.id.get_create_plist()
    return [dcpl.get_filter(i)[:3] for i in range(dcpl.get_nfilters())]


def check_filters(dset: h5py.Dataset, where: str, writable: bool) -> None:
    """Load the filter plugins a dataset needs; refuse to write one that cannot be padded."""
    codes = require_filters(dset, where)
    if writable and not (len(codes) >= 2 and codes[-1] == h5py.h5z.FILTER_FLETCHER32 and codes[-2] in (_DEFLATE, _BLOSC, _ZSTD)):
        raise SpecError(
            f"{where}: expected gzip, zstd or blosc chunks with Fletcher-32 to write in place, "
            f"found filters {codes} (lzf cannot be padded); open it read-only, or make a "
            "writable copy with `mmreplay convert SRC DST --compression gzip`"
        )


def _pad(filter_id: int | None, body: bytes, length: int) -> bytes | None:
    """``body`` grown to ``length`` bytes that the decoder of ``filter_id`` ignores."""
    gap = length - len(body)
    if gap == 0:
        return body
    if gap < 0:
        return None
    if filter_id in (_DEFLATE, _BLOSC):
        return body + bytes(gap)
    if filter_id == _ZSTD and gap >= 8:
        return body + struct.pack("<II", _ZSTD_SKIPPABLE, gap - 8) + bytes(gap - 8)
    return None


class Codec:
    """Encodes and decodes one dataset's chunks through HDF5's own filters, in an
    in-memory file holding one chunk, so the bytes are exactly what HDF5 would write."""

    def __init__(self, dset: h5py.Dataset, where: str):
        filters = filters_of(dset)
        if not filters or filters[-1][0] != h5py.h5z.FILTER_FLETCHER32:
            raise CorruptBufferError(f"{where}: expected a compressed dataset ending in Fletcher-32, found filters {filters}")
        self.filters = filters[:-1]
        if any(code in _PLUGIN_FILTERS for code, _, _ in self.filters):
            import_plugins(where)
        self.compressor = self.filters[-1][0] if self.filters else None
        self.shape = dset.chunks
        self.dtype = dset.dtype
        self.origin = (0,) * len(self.shape)
        self.raw_len = int(np.prod(self.shape)) * self.dtype.itemsize + 4
        fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
        fapl.set_fapl_core(block_size=1 << 16, backing_store=False)
        fapl.set_cache(0, 0, 0, 0.0)  # no chunk cache: every write reaches the filters at once
        name = f"mmreplay-codec-{id(self)}".encode()
        self.file = h5py.File(h5py.h5f.create(name, h5py.h5f.ACC_TRUNC, fapl=fapl))
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        dcpl.set_chunk(self.shape)
        for code, flags, values in self.filters:
            dcpl.set_filter(code, flags, values)
        space = h5py.h5s.create_simple(self.shape)
        self.scratch = h5py.Dataset(
            h5py.h5d.create(self.file.id, b"chunk", h5py.h5t.py_create(self.dtype), space, dcpl=dcpl)
        )

    def encode(self, chunk: np.ndarray) -> tuple[int, bytes]:
        if chunk.shape != self.shape:  # the ring's last chunk is short: pad with the fill value
            full = np.zeros(self.shape, self.dtype)
            full[: len(chunk)] = chunk
            chunk = full
        self.scratch[...] = chunk
        mask, data = self.scratch.id.read_direct_chunk(self.origin)
        return int(mask), bytes(data)

    def decode(self, mask: int, payload: bytes) -> np.ndarray:
        """A chunk from its stored bytes (Fletcher-32 included)."""
        body = payload[:-4]
        (stored,) = struct.unpack("<I", payload[-4:])
        if fletcher32(body) != stored:
            raise CorruptBufferError("Fletcher-32 checksum mismatch")
        self.scratch.id.write_direct_chunk(self.origin, body, mask)
        return self.scratch[...]

    def close(self) -> None:
        self.file.close()


def import_plugins(where: str) -> None:
    try:
        import hdf5plugin  # noqa: F401  (registers the zstd / blosc filters with HDF5)
    except Exception as exc:  # not installed, or installed but its filters fail to load
        raise ImportError(
            f"{where}: its compression needs hdf5plugin ({type(exc).__name__}: {exc}): "
            f"{PLUGIN_INSTALL}"
        ) from None


def require_filters(dset: h5py.Dataset, where: str) -> list[int]:
    """The filter codes of a dataset, once every one of them can decode here.

    Loads the plugins the dataset declares first. A filter HDF5 still cannot use is a
    missing dependency (an :class:`ImportError` naming the extra), never damage: chunks
    that cannot be decoded for that reason must not be taken for torn ones.
    """
    codes = [code for code, _, _ in filters_of(dset)]
    if any(code in _PLUGIN_FILTERS for code in codes):
        import_plugins(where)
    missing = [code for code in codes if not h5py.h5z.filter_avail(code)]
    if missing:
        names = ", ".join(_FILTER_NAMES.get(code, f"filter {code}") for code in missing)
        raise ImportError(f"{where}: HDF5 has no {names} filter here to decode its chunks: {PLUGIN_INSTALL}")
    return codes


def require_file_filters(h5_path: str) -> None:
    """:func:`require_filters` for every chunked dataset of an HDF5 file; a file that does
    not open is left to the checks that report damage."""
    try:
        f = open_swmr_reader(h5_path)
    except Exception:
        return
    chunked: list[str] = []

    def collect(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset) and obj.chunks is not None:
            chunked.append(name)

    with f:
        try:
            f.visititems(collect)
        except (RuntimeError, OSError):
            return
        for name in chunked:
            require_filters(f[name], f"{h5_path}: leaf {name!r}")


# --- the journal --------------------------------------------------------------------------

Records = dict[str, dict[int, tuple[int, bytes]]]  # leaf path -> chunk -> (filter mask, bytes)


def render_journal(records: Records) -> bytes:
    parts = [_MAGIC, struct.pack("<I", sum(len(r) for r in records.values()))]
    for path, chunks in sorted(records.items()):
        name = path.encode()
        for k, (mask, payload) in sorted(chunks.items()):
            parts += [_RECORD.pack(len(name), k, mask, len(payload)), name, payload]
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


def parse_journal(raw: bytes, where: str, limits: dict[str, tuple[int, int]]) -> Records:
    """The records of a journal file; ``limits`` maps each compressed leaf path to
    (number of chunks, largest chunk in bytes). Anything else is damage."""
    if len(raw) < 16 or raw[:8] != _MAGIC:
        raise CorruptBufferError(f"{where}: not a chunk journal (bad header)")
    if zlib.crc32(raw[:-4]) != struct.unpack("<I", raw[-4:])[0]:
        raise CorruptBufferError(f"{where}: checksum mismatch: the journal is damaged")
    (count,) = struct.unpack("<I", raw[8:12])
    out: Records = {}
    pos, end = 12, len(raw) - 4
    for _ in range(count):
        if pos + _RECORD.size > end:
            raise CorruptBufferError(f"{where}: truncated record")
        n, k, mask, length = _RECORD.unpack_from(raw, pos)
        pos += _RECORD.size
        path = raw[pos : pos + n].decode("utf-8", "replace")
        pos += n
        if path not in limits:
            raise CorruptBufferError(f"{where}: a record for {path!r}, which is not a compressed leaf")
        nchunks, largest = limits[path]
        if not (0 <= k < nchunks and 4 < length <= largest and pos + length <= end):
            raise CorruptBufferError(
                f"{where}: leaf {path!r}: record of chunk {k} with {length} bytes; "
                f"expected a chunk below {nchunks} of at most {largest} bytes inside the file"
            )
        out.setdefault(path, {})[k] = (mask, raw[pos : pos + length])
        pos += length
    if pos != end:
        raise CorruptBufferError(f"{where}: {end - pos} unexpected bytes after the records")
    return out


class Journal:
    """``data.h5.journal``: the chunks a writer rewrites in place, written before it does."""

    def __init__(self, h5_path: str, limits: dict[str, tuple[int, int]]):
        self.h5_path = h5_path
        self.path = journal_path(h5_path)
        self.limits = limits

    def load(self) -> Records:
        # at most every chunk of every leaf, each a record of its path and bytes
        limit = 16 + sum(n * (_RECORD.size + len(path.encode()) + largest) for path, (n, largest) in self.limits.items())
        try:
            raw = read_inside(*os.path.split(self.path), limit, "a chunk journal")
        except FileNotFoundError:
            return {}
        return parse_journal(raw, self.path, self.limits)

    def write(self, records: Records, fsync: bool) -> None:
        atomic_write(self.path, render_journal(records), fsync)


class ChunkGroup:
    """The compressed leaves of one HDF5 file: at a commit each leaf hands over its
    encoded chunks, then the group writes the journal once, stores the chunks in place
    and flushes the file once."""

    def __init__(self, journal: Journal, flush_file: Any):
        self.journal = journal
        self.flush_file = flush_file
        self.members: list[H5Chunks] = []
        # the journal this writer found: a chunk the last writer's head was in stays
        # journaled until this writer encodes it again (it is not staged here until then)
        self.carried: Records = {}

    def flush(self, fsync: bool) -> None:
        if not any(m.ready or m.stored for m in self.members):
            return
        records = {path: dict(chunks) for path, chunks in self.carried.items()}
        for m in self.members:
            records.setdefault(m.path, {}).update(m.ready)
        with disk_full_as(
            f"{self.journal.h5_path}: no space left on the file system to store the "
            "compressed chunks; the last commit is intact"
        ):
            if fsync and any(m.stored for m in self.members):
                # chunks stored as the head left them are covered by the journal being
                # replaced: they must be on the disk first
                self.flush_file(True)
            self.journal.write({path: chunks for path, chunks in records.items() if chunks}, fsync)
            for m in self.members:
                for k, (mask, payload) in m.ready.items():
                    m.store(k, mask, payload)
            self.flush_file(fsync)
        for m in self.members:
            m.ready, m.stored = {}, False


class H5Chunks:
    """The chunk I/O of one compressed HDF5 leaf, for :class:`~.base.ChunkedLeaf`."""

    in_place = True  # chunks are rewritten inside data.h5, behind the chunk journal

    def __init__(self, dset: h5py.Dataset, leaf_path: str, group: ChunkGroup, writable: bool):
        self.dset = dset
        self.path = leaf_path
        self.group = group
        self.writable = writable
        group.members.append(self)
        self.shape = dset.shape
        self.cs = dset.chunks[0]
        self.tail = (0,) * (dset.ndim - 1)
        self.where = f"{group.journal.h5_path}: leaf {leaf_path!r}"
        self._codec: Codec | None = None
        self.slots: dict[int, int | None] = {}
        self.ready: dict[int, tuple[int, bytes]] = {}  # encoded, stored by the group's flush
        self.stored = False  # a chunk was stored since the last commit
        # HDF5 shares one open file among a process's handles of it: a reader opened
        # after another starts from that one's chunk index, which may be older than
        # the commits it reads (a chunk that grew was since moved)
        self.refresh()

    @property
    def codec(self) -> Codec:
        if self._codec is None:
            self._codec = Codec(self.dset, self.where)
        return self._codec

    def slot(self, k: int) -> int | None:
        """Stored length of chunk ``k`` (None: never written)."""
        if k in self.slots:
            return self.slots[k]
        try:
            info = self.dset.id.get_chunk_info_by_coord((k * self.cs, *self.tail))
        except RuntimeError as exc:  # the chunk index's checksum fails
            raise CorruptBufferError(f"{self.where}: the HDF5 chunk index does not read ({exc})") from None
        size = None if info.byte_offset is None else int(info.size)
        if self.writable:  # only this process changes them
            self.slots[k] = size
        return size

    def exists(self, k: int) -> bool:
        return self.slot(k) is not None

    def file(self, k: int) -> str:
        return self.group.journal.h5_path

    def read(self, k: int, a: int, b: int) -> np.ndarray:
        error: Exception | None = None
        for attempt in range(4):
            try:
                return np.asarray(self.dset[a:b])
            except Exception as exc:
                error = exc
            try:  # torn by a killed writer, or being rewritten right now: the journal has it
                record = self.group.journal.load().get(self.path, {}).get(k)
            except CorruptBufferError:
                record = None
            if record is not None:
                return self.codec.decode(*record)[: b - a]
            if self.writable:
                break
            time.sleep(0.01 * (attempt + 1))
            self.refresh()
        assert error is not None
        raise error

    def _encode(self, k: int, chunk: np.ndarray) -> tuple[int, bytes]:
        self.group.carried.get(self.path, {}).pop(k, None)  # superseded
        mask, body = self.codec.encode(chunk)
        old = self.slot(k)
        compressor, raw = self.codec.compressor, self.codec.raw_len
        # HDF5 rewrites a chunk of unchanged size in place and keeps its old filter mask,
        # and a chunk whose filter was skipped is stored raw (``raw`` bytes): so a
        # compressed chunk's slot never has that size, or a chunk switching between the
        # two would be decoded the other way
        padded = _pad(compressor, body, old - 4) if old not in (None, raw) and mask == 0 else None
        if padded is None and mask == 0:  # a new, larger slot (a skipped filter: exact size)
            # room to spare, so later encodings of this chunk fit: as large as the
            # previous chunk's slot, or half again the old slot, up to the raw chunk
            need = len(body) + 4
            before = self.slot(k - 1) if k > 0 else None
            want = max(need + need // 8, (old or 0) * 3 // 2, before or 0)
            size = max(need, min(want, raw - 1))
            padded = _pad(compressor, body, size - 4) if size != raw else None
            if padded is None:  # zstd cannot pad fewer than 8 bytes
                padded = _pad(compressor, body, len(body) + (9 if need + 8 == raw else 8))
        if padded is None:
            padded = body
        payload = padded + struct.pack("<I", fletcher32(padded))
        self.slots[k] = len(payload)
        return mask, payload

    def store(self, k: int, mask: int, payload: bytes) -> None:
        self.dset.id.write_direct_chunk((k * self.cs, *self.tail), payload, mask)

    def write(self, k: int, a: int, b: int, chunk: np.ndarray) -> None:
        """The write head left chunk ``k``: store it now. If it holds committed rows, the
        head was in it at the last commit, so the journal on disk holds it."""
        mask, payload = self._encode(k, chunk)
        self.stored = True  # first: a store cut short is flushed at the next commit too
        self.store(k, mask, payload)

    def flush(self, fsync: bool, staged: dict[int, np.ndarray]) -> None:
        """Encode the chunks the head is still in; :meth:`ChunkGroup.flush` stores them."""
        self.ready = {k: self._encode(k, chunk) for k, chunk in staged.items()}

    def refresh(self) -> None:
        if not self.writable:
            self.dset.refresh()

    def close(self) -> None:
        if self._codec is not None:
            self._codec.close()
            self._codec = None


class UnreadableMetadataError(CorruptBufferError):
    """Metadata of an HDF5 file that fails its checksum or does not parse."""


def leaf_dataset(f: h5py.File, path: str, where: str, unreadable: dict[str, str] | None = None) -> Any:
    """The object at ``path`` in the open file (None: nothing there), reached through hard
    links only; a dataset must hold its data in the file itself.

    HDF5 can link a name to another file (an external link), to another name (a soft
    link, which can loop), and can keep a dataset's data in other files (external
    storage, virtual datasets): following any of them reads, or writes, outside the
    buffer, so each is refused. Metadata that does not read (its checksum fails) is a
    corrupt buffer too.

    ``unreadable`` (group path -> why), shared by the calls for one file's leaves: a
    group whose links do not read is read once, not once per leaf below it (each read
    of damaged metadata takes HDF5's re-reads, about a second).
    """
    def unread(why: object) -> UnreadableMetadataError:
        return UnreadableMetadataError(f"{where}: the HDF5 metadata of {path!r} does not read ({why})")

    node, group = f, ""
    for part in path.split("/"):
        if not isinstance(node, h5py.Group):
            return None
        if unreadable is not None and group in unreadable:
            raise unread(unreadable[group])
        try:
            link = node.get(part, getlink=True)
        except (RuntimeError, OSError, KeyError) as exc:
            if unreadable is not None:
                unreadable[group] = str(exc)
            raise unread(exc) from None
        try:
            if isinstance(link, h5py.HardLink):
                node = node[part]  # h5py says KeyError when the object's header does not read
        except (RuntimeError, OSError, KeyError) as exc:
            raise unread(exc) from None
        group = f"{group}/{part}"
        if link is None:
            return None
        if not isinstance(link, h5py.HardLink):
            kind = "an external link to another file" if isinstance(link, h5py.ExternalLink) else "a soft link"
            raise CorruptBufferError(f"{where}: {path!r} is {kind}; a buffer's datasets must be stored in its own file")
    if isinstance(node, h5py.Dataset) and (node.is_virtual or node.external):
        kind = "a virtual dataset" if node.is_virtual else "a dataset with external storage"
        raise CorruptBufferError(f"{where}: {path!r} is {kind}, whose data lies in other files; a buffer's datasets must be stored in its own file")
    return node


def replay(f: h5py.File, journal: Journal) -> Records:
    """Write the journal's chunks back into the file (after a writer died); returns them."""
    records = journal.load()
    for path, chunks in records.items():
        dset = leaf_dataset(f, path, journal.h5_path)
        if not isinstance(dset, h5py.Dataset) or dset.chunks is None:
            raise CorruptBufferError(f"{journal.path}: holds chunks of {path!r}, which is no chunked dataset in the file")
        tail = (0,) * (dset.ndim - 1)
        cs = dset.chunks[0]
        for k, (mask, payload) in chunks.items():
            dset.id.write_direct_chunk((k * cs, *tail), payload, mask)
    return records


def journal_limits(meta: Any) -> dict[str, tuple[int, int]]:
    """For each compressed leaf: (number of chunks, largest stored chunk allowed)."""
    out = {}
    for leaf in meta.leaves:
        if leaf.compression is None:
            continue
        raw = leaf.chunk_steps * meta.num_envs * max(1, leaf.spec.nbytes) + 4
        out[leaf.path] = (-(-meta.capacity // leaf.chunk_steps), 2 * raw + 1024)
    return out


def journal_path(h5_path: str) -> str:
    return os.fspath(h5_path) + JOURNAL_SUFFIX
