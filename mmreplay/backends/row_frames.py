"""Compressed leaves whose rows decode one at a time: one compressed frame per row.

A random batch of a chunk-compressed leaf decodes every chunk it touches, ~100× the bytes
it returns. Here each row (one step of one env) is its own lz4 or zstd frame, so a batch
decodes exactly its rows, in one call into native code per leaf, off the GIL.

Layout (zarr v3, readable by ``zarr.open`` and dask): the leaf is an array sharded along
the step axis, one shard per *segment* of ``chunk_steps`` steps, with inner chunks of one
row ``(1, 1, *shape)``. A shard file is the rows' frames one after the other, then the
shard index (an offset and a length per row, in (step, env) order) and its CRC-32C. A
segment is written once, when the write head leaves it, to a temporary file renamed over
the old one: a shard is never torn, and a reader that holds the old one keeps reading it.

The segment the head is in lives raw in ``rows.staging`` beside the shards (a memory-mapped
file: a header, then one segment of rows) so the writer reads everything it added, and
readers and a writer reopening after a crash find the committed rows there. Its header
says which segment it holds, which of its steps (``[base, filled)``), and a sequence
number that changes whenever it starts another segment; a reader checks the sequence
number after reading, seqlock style. zarr readers see sealed segments only: a writer
seals the one it is in when it closes.

A segment the head leaves is sealed on a background thread. Until its shard is renamed
into place, staging keeps its rows and its header names it, and the writer keeps the
next segment's rows in memory; only then do those rows move into staging and the header
to the next segment. Commits wait for that first, so a committed row is always raw in
staging or in a shard that is in place, whenever the writer is killed.

Codecs: ``rows:lz4`` (frames as numcodecs' LZ4 writes them: a 4-byte little-endian size,
then an LZ4 block) and ``rows:zstd[:LEVEL][:dict]`` (zstd frames with a content checksum).
They need the ``pixels`` extra (``zstandard``, ``cramjam``); zarr reads them with numcodecs.
A batch decodes in one call per leaf into the optional C extension where it was built and
the codec library is found (:mod:`.native_rows`), else in Python, to the same bytes.
With ``:dict`` a zstd dictionary is trained on the first segment's rows when it is sealed
(small frames compress better and decode faster with one) and kept in ``rows.dictionary``
beside the shards; the frames before it are plain zstd frames. zarr's zstd codec takes no
dictionary, so zarr-python cannot decode such a leaf's rows (mmreplay can).
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
import warnings
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codecs import parse
from ..errors import CorruptBufferError, SpecError
from ..io.local import open_inside, read_inside, replace_inside
from ..metadata import LeafInfo
from ..spec import is_image
from . import native_rows
from .base import disk_full_as, fsync_files, preallocate

__all__ = [
    "PREFIX",
    "RowCodec",
    "RowFrameLeaf",
    "is_row_compression",
    "parse_row_compression",
    "staging_bytes",
    "create_staging",
    "read_shard_index",
    "shard_bytes",
    "share_encoder",
]

PREFIX = "rows:"
#: what ``rows:CODEC[:LEVEL]`` accepts
ROW_CODECS: dict[str, tuple[int, int] | None] = {"lz4": None, "zstd": (1, 22)}
STAGING_FILE = "rows.staging"
DICTIONARY_FILE = "rows.dictionary"
#: bytes of a trained dictionary (zstd's default size)
DICTIONARY_BYTES = 112_640
STAGING_MAGIC = b"MMRROWS1"
#: header: magic, then int64 seq, segment, base, filled
HEADER_BYTES = 4096
#: shard index entry of a row that was never written (zarr reads it as the fill value)
MISSING = np.uint64(2**64 - 1)
#: rows handed to the background encoder at a time (waking it per step costs more)
ENCODE_BATCH_ROWS = 64


#: ``MMREPLAY_MAPPED_SHARDS=N`` sets :data:`MAPPED_SHARDS`, ``MMREPLAY_OPEN_SHARDS=N``
#: :data:`OPEN_SHARDS` (tests and benchmarks lower them)
MAPPED_SHARDS_ENV = "MMREPLAY_MAPPED_SHARDS"
OPEN_SHARDS_ENV = "MMREPLAY_OPEN_SHARDS"


def _budget(env: str, limit: int) -> int:
    """``env``'s number if set, else a quarter of ``limit`` (a per-process limit of
    Linux that the rest of the process shares), between 256 and 65,536."""
    given = os.environ.get(env, "").strip()
    if given:
        try:
            return max(0, int(given))
        except ValueError:
            warnings.warn(f"{env} must be a number of shards, not {given!r}: ignored", stacklevel=2)
    return max(256, min(limit // 4, 1 << 16))


def _max_map_count() -> int:
    """The mappings Linux allows a process (``vm.max_map_count``, 65,530 by default)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65_530


def _max_open_files() -> int:
    """The file descriptors the process may hold (the soft ``RLIMIT_NOFILE``)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1024
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


#: Sealed shards kept mapped by all row-frame leaves of the process together (read at
#: use): a quarter of ``vm.max_map_count`` (16,382 by default), which malloc and every
#: mapped file share. A shard is mapped when first read while the mappings are fewer, and
#: stays mapped until its file is replaced. Past it, a batch reads its frames of the other
#: shards with ``pread`` (:meth:`RowFrameLeaf._read_unmapped`), from files kept open up to
#: :data:`OPEN_SHARDS`, else opened for the batch: mapping and unmapping shards at every
#: batch cost several times the batch itself.
MAPPED_SHARDS = _budget(MAPPED_SHARDS_ENV, _max_map_count())
#: shard files past :data:`MAPPED_SHARDS` kept open by all leaves together (read at use):
#: a quarter of the process's file descriptors (``ulimit -n``)
OPEN_SHARDS = _budget(OPEN_SHARDS_ENV, _max_open_files())
_mapped = [0]  # shards mapped now, all leaves together
_kept_open = [0]  # shard files kept open now, all leaves together
#: frames of one unmapped shard fewer bytes apart than this are read in one ``pread``,
#: with the bytes between (copying a few pages from the page cache costs less than a call)
PREAD_GAP_BYTES = 16 << 10


def is_row_compression(text: str | None) -> bool:
    return text is not None and text.lower().startswith(PREFIX)


@dataclass(frozen=True)
class RowCodec:
    """A parsed ``rows:`` setting."""

    codec: str  # "lz4" or "zstd"
    level: int
    dictionary: bool = False  # zstd with a dictionary trained on the first segment

    @property
    def zarr_codec(self) -> dict[str, Any]:
        """The codec in the zarr metadata of the shard's inner chunks."""
        if self.codec == "lz4":
            return {"name": "numcodecs.lz4", "configuration": {"acceleration": 1}}
        return {"name": "zstd", "configuration": {"level": self.level, "checksum": True}}


def parse_row_compression(text: str) -> RowCodec:
    body = text[len(PREFIX) :]
    dictionary = body.lower().endswith(":dict")
    if dictionary:
        body = body[: -len(":dict")]
    c = parse(body, ROW_CODECS, f"row frames ({text!r})")
    if dictionary and c.codec != "zstd":
        raise SpecError(f"row frames ({text!r}): a trained dictionary is for zstd only (rows:zstd[:LEVEL]:dict)")
    return RowCodec(c.codec, 1 if c.level is None else c.level, dictionary)


def chunked_picture_advice(leaf: LeafInfo, num_envs: int, backend: str) -> str | None:
    """What to write instead for a picture leaf (:func:`mmreplay.spec.is_image`) compressed
    in chunks of several rows, which random batches read at a fraction of the speed of an
    uncompressed leaf; None for any other leaf."""
    if leaf.compression is None or is_row_compression(leaf.compression) or not is_image(leaf.spec):
        return None
    rows = leaf.chunk_steps * num_envs
    if rows == 1:
        return None
    instead = "rows:zstd" if leaf.compression.startswith(("zstd", "blosc")) else "rows:lz4"
    zarr = "" if backend == "zarr" else " with backend='zarr'"
    return (
        f"leaf {leaf.path!r}: compression {leaf.compression!r} compresses chunks of {rows} rows "
        f"({leaf.chunk_steps} steps x {num_envs} envs), and a random batch decodes a whole chunk for "
        f"nearly every row it returns; to sample it, give it {instead!r}{zarr} (each row its own frame, "
        f"pip install 'mmreplay[pixels]'); chunks suit a leaf read in long passes (exports, iterate)"
    )


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(
            f"compressed row frames need {module!r}: pip install 'mmreplay[pixels]'"
        ) from None


def require_row_codecs() -> None:
    """Import what row frames decode with, or raise an ImportError naming the extra."""
    _require("zstandard")
    _require("cramjam")


class _EncodeFailed(Exception):
    """What the encoder thread raised, and for which leaf."""

    def __init__(self, where: str, cause: BaseException):
        super().__init__(where, cause)
        self.where = where
        self.cause = cause


class _NativeJob:
    """Rows of one leaf handed to the native encoding thread."""

    __slots__ = ("leaves", "frames", "lo", "hi", "encoder", "where", "job")

    def __init__(self, leaf: Any, frames: list[bytes | None], lo: int, hi: int, encoder: Any, worker: Any, rows: Any):
        self.leaves, self.frames, self.lo, self.hi, self.encoder, self.where = (leaf,), frames, lo, hi, encoder, leaf.where
        self.job = encoder.submit(worker, rows)

    def finish(self, wait: bool) -> bool:
        """Put the frames in place if they are done (with ``wait``, once they are)."""
        try:
            got = self.encoder.frames(self.job, wait)
        except Exception as exc:
            raise _EncodeFailed(self.where, exc) from exc
        if got is None:
            return False
        self.frames[self.lo : self.hi] = got
        return True


class _PythonJob:
    """Rows of some leaves handed to the Python encoding thread, which puts their frames
    in place."""

    __slots__ = ("future", "leaves")

    def __init__(self, future: Future[None], leaves: list[Any]):
        self.future = future
        self.leaves = leaves  # whose rows these are

    def finish(self, wait: bool) -> bool:
        if not wait and not self.future.done():
            return False
        self.future.result()  # raises _EncodeFailed
        return True


class _Encoder:
    """The background encoding of a writer's row-frame leaves (every leaf of a store, the
    side ring's included: :func:`share_encoder`), in the order rows were added. Rows are
    handed over ``ENCODE_BATCH_ROWS`` at a time over all leaves, so a step's rows of every
    leaf go together.

    Leaves with a native encoder hand their rows to one native thread (the C extension's),
    which never takes the GIL; the frames are put in place by the writer's thread when it
    checks (each add) or waits (seal, commit). A Python thread waiting for the GIL gets it
    only when the writer lets go, up to the interpreter's switch interval (5 ms) later,
    before and after each batch: it falls behind a writer that runs Python code. Leaves
    that encode in Python (no extension or library, ``MMREPLAY_NATIVE=0``) use one daemon
    Python thread. Not a ThreadPoolExecutor: the interpreter stops those before the exit
    hooks that close writers left open, and their non-daemon thread would keep the early
    hook from running; a writer closed at exit must still hand its last rows over and wait
    for them. Used from the writer's thread only."""

    def __init__(self) -> None:
        self.worker: Any = None  # the native thread, made at the first native batch
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the Python thread's
        self.thread: threading.Thread | None = None
        self.parts: list[list[Any]] = []  # [leaf, frames, lo, hi, source]: rows not handed over yet
        self.rows = 0  # rows in ``parts``
        self.handed: deque[_NativeJob | _PythonJob] = deque()  # in the order handed over
        self.failed: _EncodeFailed | None = None
        self.users = 0  # leaves that encode here; the threads stop when the last one leaves

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args, future = job
            try:
                fn(*args)
            except BaseException as exc:  # raised in the caller by the future
                future.set_exception(exc)
            else:
                future.set_result(None)

    @staticmethod
    def _encode_parts(parts: list[tuple[Any, ...]]) -> None:
        for leaf, frames, lo, hi, source in parts:
            try:
                leaf._encode_rows(frames, lo, hi, source)
            except BaseException as exc:
                raise _EncodeFailed(leaf.where, exc) from exc

    def run_later(self, fn: Any, *args: Any) -> Future[None]:
        """Run ``fn(*args)`` on the Python thread, after what was given to it before."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name="mmreplay-encode", daemon=True)
            self.thread.start()
        future: Future[None] = Future()
        self.jobs.put((fn, args, future))
        return future

    def add(self, leaf: RowFrameLeaf, frames: list[bytes | None], lo: int, hi: int, source: np.ndarray) -> None:
        """Encode rows ``[lo, hi)`` of ``source`` (``leaf``'s staging rows, or the rows it
        writes ahead) into ``frames[lo:hi]`` later."""
        for part in self.parts:
            if part[0] is leaf and part[1] is frames and part[3] == lo and part[4] is source:
                part[3] = hi
                break
        else:
            self.parts.append([leaf, frames, lo, hi, source])
        self.rows += hi - lo
        if self.rows >= ENCODE_BATCH_ROWS:
            self.hand_over()

    def holds(self, leaf: RowFrameLeaf) -> bool:
        """Does the encoder hold rows of ``leaf`` not put in place yet?"""
        return any(part[0] is leaf for part in self.parts) or any(leaf in job.leaves for job in self.handed)

    def hand_over(self) -> None:
        """Give the rows not handed over yet to the threads."""
        parts, self.parts, self.rows = self.parts, [], 0
        in_python = []
        for leaf, frames, lo, hi, source in parts:
            native = leaf.frames.native_encoder()
            if native is None:
                in_python.append((leaf, frames, lo, hi, source))
                continue
            if self.worker is None:
                self.worker = native.worker()
            self.handed.append(_NativeJob(leaf, frames, lo, hi, native, self.worker, source[lo:hi]))
        if in_python:
            self.handed.append(_PythonJob(self.run_later(self._encode_parts, in_python), [p[0] for p in in_python]))

    def check(self, wait: bool = False) -> None:
        """Put the frames of the batches done in place; raise what the encoding raised
        (here, in the caller); with ``wait``, once every row handed over is encoded.
        After a failure every later call raises it again: the frames of the rows it was
        encoding are missing."""
        if wait:
            self.hand_over()
        handed = self.handed
        try:
            while handed and handed[0].finish(wait):
                handed.popleft()
        except _EncodeFailed as exc:
            self.failed = exc
            handed.clear()
        if self.failed is not None:
            raise CorruptBufferError(
                f"{self.failed.where}: encoding rows in the background failed: {self.failed.cause!r}; the rows "
                "since the last commit are lost (reopen the store to continue from it)"
            ) from self.failed.cause

    def leave(self) -> None:
        """A leaf closed; the last one stops the threads."""
        self.users -= 1
        if self.users > 0:
            return
        self.handed.clear()
        self.worker = None  # its thread ends once its last job is dropped
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join()
            self.thread = None


def share_encoder(leaves: Iterable[Any]) -> None:
    """Make the writable row-frame leaves among ``leaves`` (a writer's) encode on one
    background thread."""
    encoder = _Encoder()
    for leaf in leaves:
        if isinstance(leaf, RowFrameLeaf) and leaf.writable and leaf.encoder is None:
            leaf.encoder = encoder
            encoder.users += 1


def _lz4_encoder() -> Any:
    """numcodecs' LZ4 codec (zarr's own dependency), or None: it writes the same bytes as
    cramjam's ``compress_block(store_size=True)`` with less overhead per call, and with
    the GIL released, which lets the background encoder run beside the caller."""
    try:
        from numcodecs import LZ4
    except ImportError:
        return None
    return LZ4(acceleration=1)


class _Frames:
    """Encode one row, decode a batch of rows into an output array."""

    def __init__(self, codec: RowCodec, row_bytes: int, threads: int, dictionary_path: str = ""):
        self.codec = codec
        self.row_bytes = row_bytes
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self.dictionary_path = dictionary_path
        self.dictionary: Any = None
        #: check each zstd frame's content checksum when decoding natively; sampling does
        #: not (it costs a fifth of zstd's decoding), ``mmreplay verify`` does
        self.verify = False
        # one native call per batch where the C extension and a codec library are there
        self.native = native_rows.decoder(codec.codec)
        self._native_dictionary: Any = None
        self._native_encoder: Any = None  # made at the first encode (readers never encode)
        self._native_encodes = not native_rows.disabled()
        if codec.codec == "zstd":
            zstd = _require("zstandard")
            self._zstd = zstd
            self._compressor = zstd.ZstdCompressor(level=codec.level, write_checksum=True)
            self._decompressor = zstd.ZstdDecompressor()
            self.load_dictionary()
        else:
            self._cramjam = _require("cramjam")
            self._lz4 = _lz4_encoder()

    def load_dictionary(self) -> bool:
        """Use the leaf's trained dictionary if there is one yet; True if there is."""
        if self.dictionary is not None or not self.codec.dictionary:
            return self.dictionary is not None
        try:
            folder, name = os.path.split(self.dictionary_path)
            raw = read_inside(folder, name, 2 * DICTIONARY_BYTES, "a zstd dictionary")
        except FileNotFoundError:
            return False
        self._use(self._zstd.ZstdCompressionDict(raw))
        return True

    def _use(self, dictionary: Any) -> None:
        zstd = self._zstd
        self.dictionary = dictionary
        self._compressor = zstd.ZstdCompressor(level=self.codec.level, write_checksum=True, dict_data=dictionary)
        # frames written before the dictionary decode with it too: they never refer to it
        self._decompressor = zstd.ZstdDecompressor(dict_data=dictionary)
        if self.native is not None:
            self._native_dictionary = self.native.dictionary(dictionary.as_bytes())
        self._native_encoder = None  # made again with the dictionary

    def train(self, rows: np.ndarray) -> bool:
        """Train the dictionary on ``rows`` and store it (write then rename); False when
        the rows are too few or too alike to train on (the next segment tries again)."""
        zstd = self._zstd
        try:
            dictionary = zstd.train_dictionary(DICTIONARY_BYTES, [r.tobytes() for r in rows], level=self.codec.level)
        except zstd.ZstdError:
            return False
        replace_inside(*os.path.split(self.dictionary_path), dictionary.as_bytes())
        self._use(dictionary)
        return True

    def encode_rows(self, rows: np.ndarray) -> list[bytes]:
        """One frame per row of ``rows`` (uint8 ``[n, row_bytes]``): in one native call
        without the GIL where the C extension and the codec library are there, else one
        Python codec call per row; the same bytes either way (zstd: from the same zstd
        version; level 1 agrees across 1.5.4..1.5.7)."""
        native = self.native_encoder()
        if native is not None:
            return native.encode(np.ascontiguousarray(rows, np.uint8))
        return [self.encode(r) for r in rows]

    def native_encoder(self) -> native_rows.NativeEncoder | None:
        """The native encoder of these frames (with the dictionary once there is one), or
        None where rows encode in Python."""
        if self._native_encodes and self._native_encoder is None:
            dictionary = None if self.dictionary is None else self.dictionary.as_bytes()
            self._native_encoder = native_rows.encoder(self.codec.codec, self.codec.level, dictionary)
            self._native_encodes = self._native_encoder is not None
        return self._native_encoder

    def encode(self, row: np.ndarray) -> bytes:
        """One row's frame, in Python."""
        if self.codec.codec == "zstd":
            return self._compressor.compress(row)
        # numcodecs' LZ4 layout: a little-endian uint32 size, then the block
        if self._lz4 is not None:
            return self._lz4.encode(row)
        return bytes(self._cramjam.lz4.compress_block(row, store_size=True))

    def decode(self, batch: native_rows.FrameBatch, out: np.ndarray) -> None:
        """Decode ``batch`` into ``out`` (rows of ``row_bytes``, uint8)."""
        self.load_dictionary()  # a reader: the writer may have trained it since
        if self.native is not None:
            self.native.decode(batch, out, self.row_bytes, self.threads, self._native_dictionary, self.verify)
            return
        # the Python decoders take the frames grouped by buffer
        order = np.argsort(batch.which, kind="stable")
        cuts = np.flatnonzero(np.diff(batch.which[order])) + 1
        sources = [
            (batch.buffers[batch.which[g[0]]], batch.where[g], batch.offsets[g], batch.lengths[g])
            for g in np.split(order, cuts)
        ]
        if self.codec.codec == "zstd":
            self._decode_zstd(sources, out)
        else:
            self._decode_lz4(sources, out)

    def _decode_zstd(self, sources: list[tuple[Any, np.ndarray, np.ndarray, np.ndarray]], out: np.ndarray) -> None:
        zstd = self._zstd
        buffers = []
        for buf, _, offsets, lengths in sources:
            segments = np.empty((len(offsets), 2), "<u8")
            segments[:, 0] = offsets
            segments[:, 1] = lengths
            buffers.append(zstd.BufferWithSegments(buf, segments.tobytes()))
        # One native call: the frames are decoded on ``threads`` threads without the GIL.
        # (Each frame records its size; zstandard 0.25 refuses ``decompressed_sizes`` with
        # more than one buffer.)
        decoded = self._decompressor.multi_decompress_to_buffer(
            zstd.BufferWithSegmentsCollection(*buffers), threads=self.threads
        )
        where = np.concatenate([s[1] for s in sources])
        pos = 0
        for i in range(len(decoded)):
            part = np.frombuffer(decoded[i], np.uint8).reshape(-1, self.row_bytes)
            out[where[pos : pos + len(part)]] = part
            pos += len(part)

    def _decode_lz4(self, sources: list[tuple[Any, np.ndarray, np.ndarray, np.ndarray]], out: np.ndarray) -> None:
        rb = self.row_bytes
        jobs = [
            (memoryview(buf), (where * rb).tolist(), (offsets + 4).tolist(), (offsets + lengths).tolist())
            for buf, where, offsets, lengths in sources
        ]
        total = sum(len(j[1]) for j in jobs)
        decode_into = self._cramjam.lz4.decompress_block_into
        target = memoryview(out.reshape(-1))  # slices of a memoryview cost less than numpy views

        def run(part: list[tuple[memoryview, list[int], list[int], list[int]]]) -> None:
            for view, places, starts, stops in part:
                for w, a, b in zip(places, starts, stops):
                    decode_into(view[a:b], target[w : w + rb])

        if self.threads == 1 or total < 64 or len(jobs) < 2:
            run(jobs)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="mmreplay-lz4")
        parts = [jobs[i :: self.threads] for i in range(self.threads)]
        for f in [self._pool.submit(run, p) for p in parts if p]:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# --- files --------------------------------------------------------------------------------


def shard_bytes(frames: list[bytes | None]) -> bytes:
    """A zarr v3 shard: the frames one after the other, then the index (offset, length per
    row, MISSING for rows never written) and the CRC-32C of the index."""
    import google_crc32c

    index = np.empty((len(frames), 2), "<u8")
    pos = 0
    for i, f in enumerate(frames):
        if f is None:
            index[i] = MISSING
        else:
            index[i] = (pos, len(f))
            pos += len(f)
    raw = index.tobytes()
    crc = np.uint32(google_crc32c.value(raw)).astype("<u4").tobytes()
    return b"".join(f for f in frames if f is not None) + raw + crc


def read_shard_index(data: Any, rows: int, where: str, size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and lengths (int64; -1 for a missing row) from a shard's index, checked.
    ``data``: the shard's bytes, or its last ones when ``size`` says the shard's size."""
    need = index_bytes(rows)
    size = len(data) if size is None else size
    if size < need:
        raise CorruptBufferError(f"{where}: shard has {size} bytes, less than its index ({need})")
    return parse_shard_index(data[len(data) - need :], rows, size - need, where)


def shard_limit(rows: int, row_bytes: int) -> int:
    """The largest a shard of ``rows`` frames can be: a frame is at most a little larger
    than its row (the lz4 and zstd bounds), then the index."""
    return rows * (row_bytes + row_bytes // 128 + 64) + index_bytes(rows)


def index_bytes(rows: int) -> int:
    """Bytes of a shard's index and its CRC: the last bytes of the shard."""
    return rows * 16 + 4


def parse_shard_index(tail: Any, rows: int, body: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`read_shard_index` from the index bytes alone (``tail``, the shard's last
    :func:`index_bytes`) and the size of the frames before it (``body``): what a reader
    that fetches only the index needs."""
    import google_crc32c

    need = index_bytes(rows)
    if len(tail) != need:
        raise CorruptBufferError(f"{where}: a shard index of {need} bytes expected, got {len(tail)}")
    raw = bytes(tail[: need - 4])
    crc = np.frombuffer(bytes(tail[need - 4 :]), "<u4")[0]
    if np.uint32(google_crc32c.value(raw)) != crc:
        raise CorruptBufferError(f"{where}: the shard index fails its CRC-32C check")
    index = np.frombuffer(raw, "<u8").reshape(rows, 2)
    missing = index[:, 0] == MISSING
    offsets = np.where(missing, -1, index[:, 0].astype(np.int64))
    lengths = np.where(missing, 0, index[:, 1].astype(np.int64))
    if np.any((offsets + lengths > body) & ~missing):
        raise CorruptBufferError(f"{where}: the shard index points past the frames")
    return offsets, lengths


def check_frames(info: LeafInfo, folder: str, data: bytes, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """Decode the frames at ``offsets`` of a shard's bytes (verify); raises if one does not."""
    frames = _Frames(parse_row_compression(info.compression or ""), info.spec.nbytes, 1, os.path.join(folder, DICTIONARY_FILE))
    frames.verify = True  # every zstd frame's content checksum too
    out = np.empty((len(offsets), info.spec.nbytes), np.uint8)
    rows = np.arange(len(offsets))
    frames.decode(native_rows.FrameBatch([data], np.zeros(len(offsets), np.int32), rows, offsets, lengths), out)
    if frames.codec.codec == "lz4":  # lz4 blocks carry no checksum: at least the sizes must agree
        sizes = np.frombuffer(b"".join(data[o : o + 4] for o in offsets.tolist()), "<u4")
        if (sizes != info.spec.nbytes).any():
            raise ValueError(f"a frame's size is not the row's {info.spec.nbytes} bytes")


def staging_bytes(segment_steps: int, num_envs: int, row_bytes: int) -> int:
    return HEADER_BYTES + segment_steps * num_envs * row_bytes


def create_staging(path: str, segment_steps: int, num_envs: int, row_bytes: int) -> None:
    """An empty staging file: no segment (-1), preallocated."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        preallocate(fd, staging_bytes(segment_steps, num_envs, row_bytes), path)
        os.pwrite(fd, STAGING_MAGIC + np.array([0, -1, 0, 0], "<i8").tobytes(), 0)
    finally:
        os.close(fd)


class RowFrameLeaf:
    """A leaf of one compressed frame per row (see the module's docstring)."""

    mappable = False
    in_place = True  # the staging segment is written where it is (sealed shards: by rename)
    atomic_replace = True
    ranged_read = True

    def __init__(
        self,
        info: LeafInfo,
        capacity: int,
        num_envs: int,
        folder: str,
        shard_path: Any,
        writable: bool,
        threads: int | None = None,
    ):
        self.info = info
        self.codec = parse_row_compression(info.compression or "")
        self.capacity = capacity
        self.num_envs = num_envs
        self.seg = info.chunk_steps
        self.nseg = -(-capacity // self.seg)
        self.folder = folder  # the zarr array folder
        self.shard_path = shard_path  # segment -> shard file path
        self.writable = writable
        self.dtype = info.spec.dtype.newbyteorder("<")
        self.tail = tuple(info.spec.shape)
        self.row_bytes = info.spec.nbytes
        self.seg_rows = self.seg * num_envs
        self.frames = _Frames(
            self.codec, self.row_bytes, threads or os.cpu_count() or 1, os.path.join(folder, DICTIONARY_FILE)
        )
        self.where = f"leaf {info.path!r}"
        # the in-memory shard index: offset and length of every row's frame (-1: unknown)
        self.offsets = np.full(capacity * num_envs, -1, np.int64)
        self.lengths = np.zeros(capacity * num_envs, np.int64)
        self.mapped = np.zeros(self.nseg, bool)
        #: segment -> (inode, size, mtime) of the shard file its index in memory was read from:
        #: kept for shards neither mapped nor kept open (read with pread, each batch opening
        #: them again), so reading one again reads no index unless the file was replaced since
        self.indexed: dict[int, tuple[int, int, int]] = {}
        self.shards: OrderedDict[int, mmap.mmap | bytes] = OrderedDict()
        #: the mapped shards by segment (None: not mapped), then a batch's frames read with
        #: pread (:meth:`_read_unmapped`); handed whole to the decoder, which reads only
        #: those a batch's frames are in
        self.buffers: list[Any] = [None] * (self.nseg + 1)
        self.paths: dict[int, str] = {}  # segment -> shard file, worked out when first read
        #: segment -> file descriptor of shards read with pread, kept open (OPEN_SHARDS)
        self.files: dict[int, int] = {}
        from ..reads import DiskReads  # a later layer than the backends: imported at use

        #: whether a batch's frames are likely out of memory (a cold batch reads a page
        #: per frame at least): then their pages are asked for together before decoding
        self.disk_reads = DiskReads(mmap.PAGESIZE)
        self.sealed_since_flush: set[int] = set()
        staging = os.path.join(folder, STAGING_FILE)
        need = staging_bytes(self.seg, num_envs, self.row_bytes)
        try:
            fd = open_inside(folder, STAGING_FILE, os.O_RDWR if writable else os.O_RDONLY)
        except FileNotFoundError:
            raise CorruptBufferError(f"{staging}: the staging file of {self.where} is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size < need:
                raise CorruptBufferError(f"{staging}: {self.where} expects {need} bytes, found {size}")
            self.mm = mmap.mmap(fd, need, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        if self.mm[: len(STAGING_MAGIC)] != STAGING_MAGIC:
            raise CorruptBufferError(f"{staging}: not a staging file of {self.where} (bad magic)")
        self.header = np.ndarray(4, "<i8", buffer=self.mm, offset=len(STAGING_MAGIC))
        self.staged = np.ndarray((self.seg_rows, self.row_bytes), np.uint8, buffer=self.mm, offset=HEADER_BYTES)
        # the writer's frames of the staging segment's rows (None: not written this lap)
        self.pending: list[bytes | None] | None = None
        self.seen = (-1, -1)  # the staging (seq, segment) of the last read
        # Rows are encoded on a background thread as they are added, one per writer shared
        # by its row-frame leaves (share_encoder; else this leaf's own, made when first
        # needed); the native encoder releases the GIL, so it runs on another core. A
        # segment is sealed once its rows are.
        self.encoder: _Encoder | None = None
        # A segment the head leaves is sealed in the background (its shard written and
        # renamed) while the head goes on in the next one, whose rows are kept in memory
        # meanwhile ("ahead") and moved into staging once the seal is done.
        self.sealing: tuple[int, Future[None]] | None = None
        self.ahead: np.ndarray | None = None
        self.ahead_buffers: list[np.ndarray | None] = [None, None]
        # the step that :meth:`write` writes the short way if it comes next (-1: none), whether
        # it goes ahead, and its segment's first slot
        self.next_start, self.next_ahead, self.next_base = -1, False, 0
        self.ahead_segment = -1
        self.ahead_filled = 0  # steps of ahead_segment written ahead
        self.ahead_frames: list[bytes | None] | None = None

    # --- the staging header -------------------------------------------------------------

    def _header(self) -> tuple[int, int, int, int]:
        seq, segment, base, filled = (int(x) for x in self.header)
        return seq, segment, base, filled

    # --- reads ------------------------------------------------------------------------------

    def _path(self, k: int) -> str:
        """Segment ``k``'s shard file (zarr's chunk key, worked out once)."""
        path = self.paths.get(k)
        if path is None:
            path = self.paths[k] = self.shard_path(k)
        return path

    def _open_shard(self, k: int) -> int:
        """A read-only descriptor of segment ``k``'s shard file (a regular file of the leaf's
        folder, reached without links)."""
        return open_inside(self.folder, os.path.relpath(self._path(k), self.folder))

    def _open(self, k: int, fd: int | None = None) -> tuple[int, int]:
        """A file descriptor of segment ``k``'s shard (``fd`` if given) and the file's
        size, its index in memory from this very file (read again unless it is)."""
        path = self._path(k)
        try:
            if fd is None:
                fd = self._open_shard(k)
        except FileNotFoundError:
            raise CorruptBufferError(
                f"{self.where}: shard file {path} (segment {k}) holds committed steps but is missing; "
                "see `mmreplay verify`"
            ) from None
        try:
            st = os.fstat(fd)
            identity = (st.st_ino, st.st_size, st.st_mtime_ns)
            if self.indexed.get(k) != identity:
                need = index_bytes(self.seg_rows)
                tail = os.pread(fd, need, max(0, st.st_size - need))
                offsets, lengths = read_shard_index(tail, self.seg_rows, f"{self.where}: {path}", st.st_size)
                lo = k * self.seg_rows
                n = min(self.seg_rows, len(self.offsets) - lo)
                self.offsets[lo : lo + n] = offsets[:n]
                self.lengths[lo : lo + n] = lengths[:n]
                self.indexed[k] = identity
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def _map(self, k: int, fd: int | None = None) -> None:
        """Map sealed segment ``k``'s shard, and load its index into memory unless it is
        there from this very file."""
        fd, size = self._open(k, fd)
        try:
            buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
        finally:
            os.close(fd)
        self.mapped[k] = True
        self.shards[k] = self.buffers[k] = buf
        _mapped[0] += 1

    def _drop(self, k: int) -> None:
        """Forget segment ``k``'s shard: its file was replaced, or may have been."""
        self.indexed.pop(k, None)
        self._unmap(k)
        self._close_file(k)

    def _unmap(self, k: int) -> None:
        if k not in self.shards:
            return
        buf = self.shards.pop(k)
        _mapped[0] -= 1
        self.mapped[k] = False
        self.buffers[k] = None
        if isinstance(buf, mmap.mmap):
            try:
                buf.close()
            except BufferError:
                pass  # a decode still holds a view; the mapping closes with it

    def take(self, rows: np.ndarray) -> np.ndarray:
        """Rows by flat id ``slot * num_envs + env`` (ids past the ring's end wrap), as a
        new array: rows of the staging segment are copied raw, the others decoded."""
        rows = np.asarray(rows, np.int64)
        flat = rows.reshape(-1) % (self.capacity * self.num_envs)
        out = np.empty((flat.size, self.row_bytes), np.uint8)
        if flat.size:
            for _ in range(100):
                seq = self._gather(flat, out)
                if seq == int(self.header[0]):  # staging did not move on while read
                    break
            else:
                raise CorruptBufferError(f"{self.where}: the staging segment kept changing while read")
        return out.view(self.dtype).reshape(rows.shape + self.tail)

    def _gather(self, flat: np.ndarray, out: np.ndarray) -> int:
        seq, segment, base, filled = self._header()
        if (seq, segment) != self.seen:
            # the segment staged before may have been sealed since: its shard is new
            if self.seen[1] >= 0:
                self._drop(self.seen[1])
            self.seen = (seq, segment)
        where = None  # rows of ``out`` the frames go to: all of them, unless some are raw
        raw = None  # rows copied raw: staged, or a writer's rows written ahead
        if segment >= 0 and filled > base:
            first = segment * self.seg_rows
            staged = (flat >= first + base * self.num_envs) & (flat < first + filled * self.num_envs)
            if staged.any():
                out[staged] = self.staged[flat[staged] - first]
                raw = staged
        if self.ahead_segment >= 0:
            first = self.ahead_segment * self.seg_rows
            ahead = (flat >= first) & (flat < first + self.ahead_filled * self.num_envs)
            if ahead.any():
                out[ahead] = self.ahead[flat[ahead] - first]  # type: ignore[index]
                raw = ahead if raw is None else raw | ahead
        if raw is not None:
            where = np.flatnonzero(~raw)
            flat = flat[where]
        if flat.size == 0:
            return seq
        segments = flat // self.seg_rows
        unmapped = ~self.mapped[segments]
        opened: dict[int, int] = {}  # segment -> file descriptor: shards read with pread
        cold = self.disk_reads.cold(flat.size)
        try:
            if unmapped.any():
                self._unmapped_files(np.unique(segments[unmapped]).tolist(), opened, cold)
            offsets = self.offsets[flat]
            if (offsets < 0).any():
                i = int(np.flatnonzero(offsets < 0)[0])
                bad, k = int(flat[i]), int(segments[i])
                raise CorruptBufferError(
                    f"{self.where}: row {bad} (slot {bad // self.num_envs}, env {bad % self.num_envs}) "
                    f"is not in shard {self._path(k)}: it holds committed steps; see `mmreplay verify`"
                )
            lengths = self.lengths[flat]
            which = segments.astype(np.int32)
            if cold:
                self._willneed(segments, offsets, lengths, opened)
            if opened:
                read = ~self.mapped[segments]
                which[read] = self.nseg  # the batch's buffer of frames read with pread
                offsets[read] = self._read_unmapped(opened, segments[read], offsets[read], lengths[read])
        finally:
            for k, fd in opened.items():
                if k not in self.files:
                    os.close(fd)
        if where is None:
            where = np.arange(flat.size)
        try:
            self.frames.decode(native_rows.FrameBatch(self.buffers, which, where, offsets, lengths), out)
        except CorruptBufferError:
            raise
        except Exception as exc:
            raise CorruptBufferError(f"{self.where}: a row frame does not decode: {exc}") from exc
        finally:
            self.buffers[self.nseg] = None
            while self.shards and _mapped[0] > MAPPED_SHARDS:  # the budget was lowered
                self._unmap(next(iter(self.shards)))
            while self.files and _kept_open[0] > OPEN_SHARDS:
                self._close_file(next(iter(self.files)))
        return seq

    def _willneed(
        self, segments: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, opened: dict[int, int]
    ) -> None:
        """Ask the kernel for the pages of a batch's frames, all at once (``MADV_WILLNEED``
        on the mapped shards, ``POSIX_FADV_WILLNEED`` on the others), one call per run of
        touching pages: from the disk, the decoder would otherwise fault them in one
        synchronous read at a time."""
        page = mmap.PAGESIZE
        order = np.lexsort((offsets, segments))
        seg = segments[order]
        first = offsets[order] // page
        last = (offsets[order] + lengths[order] - 1) // page
        brk = np.flatnonzero((seg[1:] != seg[:-1]) | (first[1:] > last[:-1] + 1)) + 1
        starts = np.r_[0, brk]
        runs = zip(seg[starts].tolist(), first[starts].tolist(), np.maximum.reduceat(last, starts).tolist())
        for k, a, b in runs:
            try:
                fd = opened.get(k)
                if fd is not None:
                    os.posix_fadvise(fd, a * page, (b + 1 - a) * page, os.POSIX_FADV_WILLNEED)
                else:
                    shard = self.shards.get(k)
                    if isinstance(shard, mmap.mmap):
                        shard.madvise(mmap.MADV_WILLNEED, a * page, min((b + 1 - a) * page, len(shard) - a * page))
            except (OSError, ValueError, AttributeError):
                return  # no such advice here, or the mapping went: the decoder faults them in

    def _unmapped_files(self, wanted: list[int], opened: dict[int, int], cold: bool) -> None:
        """Map the segments ``wanted`` while the mappings are fewer than the budget; put
        the file descriptors of the others in ``opened``, to read with pread: kept open
        (:attr:`files`), opened and kept while those are fewer than theirs, else opened
        for this batch (the caller closes them). ``cold``: the pages of the shard indexes
        to read are asked for together first."""
        early = self._open_for_indexes(wanted) if cold and len(wanted) > 1 else {}
        try:
            for k in wanted:
                fd = self.files.get(k)
                if fd is not None:
                    opened[k] = fd
                elif _mapped[0] < MAPPED_SHARDS:
                    self._map(k, early.pop(k, None))
                else:
                    opened[k] = fd = self._open(k, early.pop(k, None))[0]
                    if _kept_open[0] < OPEN_SHARDS:
                        self.files[k] = fd
                        _kept_open[0] += 1
        finally:
            for fd in early.values():
                os.close(fd)

    def _open_for_indexes(self, wanted: list[int]) -> dict[int, int]:
        """File descriptors of the shards in ``wanted`` whose index is not in memory, each
        index's pages asked for (``POSIX_FADV_WILLNEED``) before any is read: from the
        disk, reading them one after another waits for each in turn."""
        need = index_bytes(self.seg_rows)
        early: dict[int, int] = {}
        for k in wanted:
            if k in self.indexed or k in self.files:
                continue
            try:
                fd = self._open_shard(k)
            except FileNotFoundError:
                continue  # reported when it is read
            early[k] = fd
            try:
                os.posix_fadvise(fd, max(0, os.fstat(fd).st_size - need), need, os.POSIX_FADV_WILLNEED)
            except (OSError, AttributeError):
                pass
        return early

    def _close_file(self, k: int) -> None:
        fd = self.files.pop(k, None)
        if fd is not None:
            _kept_open[0] -= 1
            os.close(fd)

    def _read_unmapped(
        self, opened: dict[int, int], segments: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
    ) -> np.ndarray:
        """Read the frames at ``offsets`` of the unmapped shards ``segments`` (open as
        ``opened``) into one buffer, the slot after the shards' in :attr:`buffers`: one
        ``pread`` per run of frames fewer than :data:`PREAD_GAP_BYTES` apart in a shard.
        The frames' offsets in that buffer."""
        order = np.lexsort((offsets, segments))
        seg, start = segments[order], offsets[order]
        end = start + lengths[order]
        # frames of a shard do not overlap (a row twice in a batch: the same frame twice),
        # so in this order each frame's end is the largest of its shard so far
        new_run = np.ones(len(order), bool)
        new_run[1:] = (seg[1:] != seg[:-1]) | (start[1:] - end[:-1] >= PREAD_GAP_BYTES)
        run = np.cumsum(new_run) - 1
        firsts = np.flatnonzero(new_run)
        run_start = start[firsts]
        run_end = np.maximum.reduceat(end, firsts)
        run_at = np.concatenate(([0], np.cumsum(run_end - run_start)))
        buf = np.empty(int(run_at[-1]), np.uint8)
        view = memoryview(buf)
        for k, a, b, at in zip(seg[firsts].tolist(), run_start.tolist(), run_end.tolist(), run_at.tolist()):
            got = os.preadv(opened[k], [view[at : at + b - a]], a)
            if got != b - a:
                raise CorruptBufferError(
                    f"{self.where}: shard file {self._path(k)} (segment {k}) ended at byte {a + got}, "
                    f"before the frames its index gives (up to byte {b}); see `mmreplay verify`"
                )
        self.buffers[self.nseg] = buf
        placed = np.empty_like(offsets)
        placed[order] = start - run_start[run] + run_at[run]
        return placed

    def read(self, slots: Any) -> np.ndarray:
        if isinstance(slots, slice):
            slots = np.arange(self.capacity)[slots]
        idx = np.asarray(slots, np.int64)
        rows = (idx % self.capacity)[..., None] * self.num_envs + np.arange(self.num_envs)
        return self.take(rows)

    def read_rows(self, slots: Any, envs: Any) -> np.ndarray:
        return self.take(np.asarray(slots, np.int64) * self.num_envs + envs)

    def advise(self, pattern: str, keep: tuple[int, int] | None = None) -> None:
        """Frames are read whole by offset: there is no mapping of rows to advise."""

    def willneed(self, rows: np.ndarray) -> None:
        """Frames are decoded on demand: nothing to prefetch."""

    # --- writes -----------------------------------------------------------------------------

    def _raw(self, values: np.ndarray) -> np.ndarray:
        """``values`` as rows of raw little-endian bytes."""
        return np.ascontiguousarray(values, self.dtype).view(np.uint8).reshape(-1, self.row_bytes)

    def _encode_step(self, values: np.ndarray) -> list[bytes]:
        return self.frames.encode_rows(self._raw(values))

    # --- the background encoder ---------------------------------------------------------

    def _encode_later(self, frames: list[bytes | None], lo: int, hi: int, source: np.ndarray | None = None) -> None:
        """Encode rows ``[lo, hi)`` of ``source`` (staging by default) into
        ``frames[lo:hi]`` in the background (the rows stay where they are until their
        segment is sealed, which waits)."""
        self._check_encoder()
        self._background().add(self, frames, lo, hi, self.staged if source is None else source)

    def _background(self) -> _Encoder:
        if self.encoder is None:
            self.encoder = _Encoder()
            self.encoder.users += 1
        return self.encoder

    def _encode_rows(self, frames: list[bytes | None], lo: int, hi: int, source: np.ndarray) -> None:
        """On the Python encoding thread."""
        frames[lo:hi] = self.frames.encode_rows(source[lo:hi])

    def _check_encoder(self, wait: bool = False) -> None:
        """Raise what the encoder raised; with ``wait``, once every row handed to it (of
        every leaf sharing it) is encoded."""
        if self.encoder is not None:
            self.encoder.check(wait)

    def _start(self, k: int, step: int) -> None:
        """Make segment ``k`` the staging segment, its rows from ``step`` on written next."""
        self.next_start = -1
        seq, segment, base, filled = self._header()
        if segment == k and self.pending is None and base <= step <= filled:
            # a writer reopening: the rows before ``step`` in staging are this lap's
            self.pending = [None] * self.seg_rows
            self._encode_later(self.pending, base * self.num_envs, step * self.num_envs)
            self.header[3] = step
            return
        if segment == k and self.pending is not None and base <= step <= filled:
            self.header[3] = step
            return
        if segment >= 0 and filled > base:
            if self.pending is None:  # rows a dead writer left in staging
                self.pending = [None] * self.seg_rows
                self._encode_later(self.pending, base * self.num_envs, filled * self.num_envs)
            self._seal(segment)
        # In this order, so a reader never pairs the new sequence number with the old
        # segment: it reads the sequence number first and checks it again at the end.
        self.header[1] = -1
        self.header[0] = seq + 1
        self.header[2] = step
        self.header[3] = step
        self.header[1] = k
        self.pending = [None] * self.seg_rows

    def write(self, start: int, values: np.ndarray) -> None:
        if start == self.next_start and len(values) == 1:
            self._write_next(values)
            return
        self.next_start = -1
        pos, end = start, start + len(values)
        while pos < end:
            k = pos // self.seg
            a = k * self.seg
            b = min(a + self.seg, self.capacity)
            n = min(end, b) - pos
            lo = (pos - a) * self.num_envs
            hi = lo + n * self.num_envs
            part = values[pos - start : pos - start + n]
            if self.sealing is not None:
                self._promote(wait=False)
            ahead = self.sealing is not None and k == self.ahead_segment and pos - a == self.ahead_filled
            if ahead:
                # the segment before is still being sealed from staging: write ahead
                assert self.ahead is not None and self.ahead_frames is not None
                self.ahead[lo:hi] = self._raw(part)
                self._encode_later(self.ahead_frames, lo, hi, self.ahead)
                self.ahead_filled = pos - a + n
            else:
                self._promote(wait=True)
                self._start(k, pos - a)
                frames = self.pending
                assert frames is not None
                self.staged[lo:hi] = self._raw(part)
                self._encode_later(frames, lo, hi)
                self.header[3] = pos - a + n
            pos += n
            if pos == b:  # the write head leaves segment k: store it
                self._promote(wait=True)  # segment k is the staging segment now
                self._seal_later(k)
            elif pos + 1 < b:  # the next step, if it comes next, takes the short way
                self.next_start, self.next_ahead, self.next_base = pos, ahead, a

    def _write_next(self, values: np.ndarray) -> None:
        """One step (``values[0]``) right after the one written last, in the same segment
        and not its last step: :meth:`write` without its bookkeeping (staging already
        says this segment, filled up to this step; or the rows go on ahead)."""
        step = self.next_start
        lo = (step - self.next_base) * self.num_envs
        hi = lo + self.num_envs
        if self.next_ahead and self.sealing is not None:
            self._promote(wait=False)  # the segment written ahead may become the staging segment
        self.next_start = -1  # until this step is written
        if self.next_ahead and self.sealing is not None:
            self.ahead[lo:hi] = self._raw(values)  # type: ignore[index]
            self._encode_later(self.ahead_frames, lo, hi, self.ahead)  # type: ignore[arg-type]
            self.ahead_filled += 1
        else:
            self.staged[lo:hi] = self._raw(values)
            self._encode_later(self.pending, lo, hi)  # type: ignore[arg-type]
            self.header[3] = step - self.next_base + 1
            self.next_ahead = False
        if step + 2 < min(self.next_base + self.seg, self.capacity):
            self.next_start = step + 1

    def _seal_later(self, k: int) -> None:
        """Seal the staging segment ``k`` in the background; the rows after it are written
        ahead, in memory, until it is sealed (:meth:`_promote`). Staging keeps ``k``'s rows
        meanwhile, and its header says ``k``: readers, and a writer reopening after a
        crash, find them there until the shard is in place. Sealed here instead (waiting)
        when there is no other segment to write ahead into, or a dictionary is still to
        be trained."""
        if self.nseg == 1 or (self.codec.dictionary and not self.frames.load_dictionary()):
            self._seal(k)
            return
        encoder = self._background()
        encoder.check()  # what failed is raised here
        encoder.hand_over()
        frames = self.pending
        assert frames is not None
        # k's frames still being encoded: the sealing thread waits for them, not the writer
        jobs = [job for job in encoder.handed if isinstance(job, _NativeJob) and job.frames is frames]
        self.sealing = (k, encoder.run_later(self._store_when_encoded, k, frames, jobs))
        # two buffers in turn: the rows written ahead of the segment before may still be
        # being encoded (its sealing waits for them) while these are written
        self.ahead_buffers.reverse()
        if self.ahead_buffers[0] is None:
            self.ahead_buffers[0] = np.empty_like(self.staged)
        self.ahead = self.ahead_buffers[0]
        self.ahead_segment = (k + 1) % self.nseg
        self.ahead_filled = 0
        self.ahead_frames = [None] * self.seg_rows

    def _promote(self, wait: bool) -> None:
        """Once the segment sealed in the background is in place (with ``wait``, waiting
        for it), make the segment written ahead the staging segment: its rows move into
        staging. A failed seal is raised here, and by every later write and commit (the
        rows since the last commit are lost; staging still holds the segment)."""
        if self.sealing is None:
            return
        k, future = self.sealing
        if not wait and not future.done():
            return
        self.sealing = None
        try:
            future.result()
        except _EncodeFailed as exc:  # a row of segment k did not encode
            self.ahead_segment, self.ahead_frames, self.next_start = -1, None, -1
            self._background().failed = exc
            self._background().check()  # raises it
        except BaseException as exc:
            self.ahead_segment, self.ahead_frames, self.next_start = -1, None, -1
            self._background().failed = _EncodeFailed(f"{self.where}: sealing segment {k}", exc)
            raise
        self._drop(k)
        self.sealed_since_flush.add(k)
        seq = int(self.header[0])
        filled = self.ahead_filled
        # as in _start: a reader that read the old segment sees the sequence number change
        self.header[1] = -1
        self.header[0] = seq + 1
        self.staged[: filled * self.num_envs] = self.ahead[: filled * self.num_envs]  # type: ignore[index]
        self.header[2] = 0
        self.header[3] = filled
        self.header[1] = self.ahead_segment
        self.pending = self.ahead_frames
        self.ahead_segment, self.ahead_frames, self.ahead_filled = -1, None, 0

    def write_slots(self, slots: np.ndarray, values: np.ndarray) -> None:
        self.next_start = -1
        self._promote(wait=True)
        # one thread encodes at a time with this leaf's codec: wait for the rows of this leaf
        # the encoder holds (none for the side ring of next frames, which is written here
        # only), not for every leaf's
        self._check_encoder(wait=self.encoder is not None and self.encoder.holds(self))
        slots = np.asarray(slots, np.int64) % self.capacity
        seg_of = slots // self.seg
        _, segment, base, filled = self._header()
        for k in np.unique(seg_of):
            k = int(k)
            sel = np.flatnonzero(seg_of == k)
            steps = slots[sel] - k * self.seg
            changed = {}
            for i, t in zip(sel.tolist(), steps.tolist()):
                for e, frame in enumerate(self._encode_step(values[i])):
                    changed[t * self.num_envs + e] = frame
                if k == segment and base <= t < filled:
                    lo = t * self.num_envs
                    self.staged[lo : lo + self.num_envs] = self._raw(values[i])
            if k == segment and self.pending is not None:
                for i, frame in changed.items():
                    self.pending[i] = frame
            if os.path.exists(self.shard_path(k)):
                frames = self._stored_frames(k)
                for i, frame in changed.items():
                    frames[i] = frame
                self._write_shard(k, frames)
            elif k != segment:
                self._write_shard(k, [changed.get(i) for i in range(self.seg_rows)])

    def _stored_frames(self, k: int) -> list[bytes | None]:
        """The frames of sealed segment ``k`` (None for rows never written)."""
        path = self.shard_path(k)
        try:
            fd = self._open_shard(k)
        except FileNotFoundError:
            return [None] * self.seg_rows
        try:
            size = os.fstat(fd).st_size
            limit = shard_limit(self.seg_rows, self.row_bytes)
            if size > limit:
                raise CorruptBufferError(f"{path}: {size} bytes, more than a shard of {self.where} can hold ({limit})")
            data = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        offsets, lengths = read_shard_index(data, self.seg_rows, f"{self.where}: {path}")
        return [None if o < 0 else data[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]

    def _seal(self, k: int) -> None:
        """Store the staging segment ``k`` as its shard: this lap's frames, and the old
        shard's for rows not written this lap."""
        self._check_encoder(wait=True)
        frames = self.pending
        assert frames is not None
        if self.codec.dictionary and not self.frames.load_dictionary():
            _, _, base, filled = self._header()
            lo, hi = base * self.num_envs, filled * self.num_envs
            if self.frames.train(self.staged[lo:hi]):  # this segment's frames, once more with it
                frames[lo:hi] = self.frames.encode_rows(self.staged[lo:hi])
        self._store_shard(k, frames)
        self._drop(k)
        self.sealed_since_flush.add(k)

    def _store_when_encoded(self, k: int, frames: list[bytes | None], jobs: list[_NativeJob]) -> None:
        """On the Python encoding thread: once the native ``jobs`` of segment ``k`` are
        done, put their frames in place and store its shard. (The writer's thread puts the
        same frames in place again when it takes the jobs; rows encoded in Python were
        encoded before this runs, by the same thread.)"""
        for job in jobs:
            job.finish(wait=True)
        self._store_shard(k, frames)

    def _store_shard(self, k: int, frames: list[bytes | None]) -> None:
        """Write segment ``k``'s shard: ``frames``, and the old shard's for rows not
        written this lap (on the writer's thread or the Python background thread)."""
        if any(f is None for f in frames):
            old = self._stored_frames(k)
            frames = [f if f is not None else o for f, o in zip(frames, old)]
        self._write_shard_file(k, frames)

    def _write_shard(self, k: int, frames: list[bytes | None]) -> None:
        self._write_shard_file(k, frames)
        self._drop(k)
        self.sealed_since_flush.add(k)

    def _write_shard_file(self, k: int, frames: list[bytes | None]) -> None:
        """Write then rename: a shard file is never torn."""
        path = self.shard_path(k)
        with disk_full_as(
            f"{self.where}: no space left on the file system for segment {k} "
            f"(slots {k * self.seg}..{min((k + 1) * self.seg, self.capacity) - 1}); the last commit is intact"
        ):
            replace_inside(self.folder, os.path.relpath(path, self.folder), shard_bytes(frames))

    def flush(self, fsync: bool) -> None:
        # committed rows of the staging segment are durable raw in staging, sealed ones in
        # their shards; a commit still waits for the encoder (what is queued: a step or
        # two when it keeps up), so that what it raised surfaces at this commit; the rows
        # written ahead move into staging
        self._promote(wait=True)
        self._check_encoder(wait=True)
        if fsync:
            self.mm.flush()
            fsync_files([self.shard_path(k) for k in self.sealed_since_flush])
        self.sealed_since_flush = set()

    def seal_open_segment(self) -> None:
        """Store the rows of the staging segment as its shard too, so zarr readers see them
        (a writer's close); staging keeps them for the next writer."""
        self._promote(wait=True)
        self.next_start = -1
        _, segment, base, filled = self._header()
        if self.writable and self.pending is not None and segment >= 0 and filled > base:
            self._seal(segment)

    def invalidate(self, slots: Iterable[tuple[int, int]]) -> None:
        """A reader's refresh: shards of the segments with new rows were replaced."""
        for a, b in slots:
            for k in range(a // self.seg, (b - 1) // self.seg + 1):
                self._drop(k)

    def close(self) -> None:
        if self.mm is None:
            return
        try:
            if self.encoder is None or self.encoder.failed is None:  # else the rows since the last
                self.seal_open_segment()  # commit are lost, as said
        finally:
            for k in [*self.shards, *self.files]:
                self._drop(k)
            if self.encoder is not None:
                self.encoder.leave()
                self.encoder = None
            self.frames.close()
            self.header = None  # type: ignore[assignment]
            self.staged = None  # type: ignore[assignment]
            try:
                self.mm.close()
            except BufferError:
                pass
            self.mm = None  # type: ignore[assignment]
