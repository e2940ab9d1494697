"""The codecs of row frames: what a ``rows:`` setting means, and one row encoded or a
batch of rows decoded (see :mod:`.row_frames` for the layout).

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

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..codecs import parse
from ..errors import SpecError
from ..io import ByteSource, LocalFolder
from ..metadata import LeafInfo
from ..read.layout import gather_rows
from ..spec import is_image
from . import native_rows

__all__ = [
    "PREFIX",
    "FrameCodec",
    "RowCodec",
    "check_frames",
    "chunked_picture_advice",
    "is_row_compression",
    "parse_row_compression",
    "require_row_codecs",
]

PREFIX = "rows:"
#: what ``rows:CODEC[:LEVEL]`` accepts
ROW_CODECS: dict[str, tuple[int, int] | None] = {"lz4": None, "zstd": (1, 22)}
DICTIONARY_FILE = "rows.dictionary"
#: bytes of a trained dictionary (zstd's default size); a larger file is refused unread
DICTIONARY_BYTES = 112_640
DICTIONARY_LIMIT = 2 * DICTIONARY_BYTES


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


def _lz4_encoder() -> Any:
    """numcodecs' LZ4 codec (zarr's own dependency), or None: it writes the same bytes as
    cramjam's ``compress_block(store_size=True)`` with less overhead per call, and with
    the GIL released, which lets the background encoder run beside the caller."""
    try:
        from numcodecs import LZ4
    except ImportError:
        return None
    return LZ4(acceleration=1)


class FrameCodec:
    """A leaf's ``rows:`` codec: encode one row, decode a batch of rows into an output array."""

    def __init__(
        self, codec: RowCodec, row_bytes: int, threads: int | None, source: ByteSource, dictionary_key: str
    ):
        self.codec = codec
        self.row_bytes = row_bytes
        #: ``Store.set_decode_threads``: a number, or None for one per idle core
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self.source, self.dictionary_key = source, dictionary_key  # where the trained dictionary is kept
        self.dictionary: Any = None
        #: check each zstd frame's content checksum when decoding natively; sampling does
        #: not (it costs a fifth of zstd's decoding), ``mmreplay verify`` does
        self.verify = False
        # one native call per batch where the C extension and a codec library are there
        self.native = native_rows.decoder(codec.codec)
        self._native_dictionary: Any = None
        #: one per encoding thread (a zstd context serves one thread at a time), made at the
        #: first encode (readers never encode); slot 0 is the writer thread's too
        self._native_encoders: dict[int, native_rows.NativeEncoder] = {}
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
            raw = self.source.read(self.dictionary_key, DICTIONARY_LIMIT, "a zstd dictionary")
        except FileNotFoundError:
            return False
        self.use_dictionary(raw)
        return True

    def use_dictionary(self, raw: Any) -> None:
        """Encode and decode with the trained dictionary (its bytes, or zstandard's) from now on."""
        zstd = self._zstd
        dictionary = raw if isinstance(raw, zstd.ZstdCompressionDict) else zstd.ZstdCompressionDict(raw)
        self.dictionary = dictionary
        self._compressor = zstd.ZstdCompressor(level=self.codec.level, write_checksum=True, dict_data=dictionary)
        # frames written before the dictionary decode with it too: they never refer to it
        self._decompressor = zstd.ZstdDecompressor(dict_data=dictionary)
        if self.native is not None:
            self._native_dictionary = self.native.dictionary(dictionary.as_bytes())
        self._native_encoders = {}  # made again with the dictionary

    def train(self, rows: np.ndarray) -> bool:
        """Train the dictionary on ``rows`` and store it (write then rename); False when
        the rows are too few or too alike to train on (the next segment tries again)."""
        zstd = self._zstd
        try:
            dictionary = zstd.train_dictionary(DICTIONARY_BYTES, [r.tobytes() for r in rows], level=self.codec.level)
        except zstd.ZstdError:
            return False
        self.source.replace(self.dictionary_key, dictionary.as_bytes())
        self.use_dictionary(dictionary)
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

    def native_encoder(self, slot: int = 0) -> native_rows.NativeEncoder | None:
        """The native encoder of these frames for encoding thread ``slot`` (with the
        dictionary once there is one), or None where rows encode in Python."""
        found = self._native_encoders.get(slot)
        if found is None and self._native_encodes:
            dictionary = None if self.dictionary is None else self.dictionary.as_bytes()
            found = native_rows.encoder(self.codec.codec, self.codec.level, dictionary)
            self._native_encodes = found is not None
            if found is not None:
                self._native_encoders[slot] = found
        return found

    def encode(self, row: np.ndarray) -> bytes:
        """One row's frame, in Python."""
        if self.codec.codec == "zstd":
            return self._compressor.compress(row)
        # numcodecs' LZ4 layout: a little-endian uint32 size, then the block
        if self._lz4 is not None:
            return self._lz4.encode(row)
        return bytes(self._cramjam.lz4.compress_block(row, store_size=True))

    def decode(
        self, batch: native_rows.FrameBatch, out: np.ndarray, permute: tuple[int, int, int] | None = None
    ) -> None:
        """Decode ``batch`` into ``out`` (rows of ``row_bytes``, uint8), each row written
        transposed as ``permute`` says (:func:`mmreplay.read.layout.gather_rows`)."""
        threads = native_rows.decode_threads(self.threads).threads
        if self.native is not None:
            self.native.decode(batch, out, self.row_bytes, threads, self._native_dictionary, self.verify, permute)
            return
        if permute is not None and permute[0] > 1:  # decoded, then laid out
            decoded = np.empty_like(out)
            self.decode(batch, decoded)
            laid_out = np.empty((len(batch.where), self.row_bytes), np.uint8)
            gather_rows(decoded, self.row_bytes, 0, batch.where, laid_out, *permute)
            out[batch.where] = laid_out
            return
        # the Python decoders take the frames grouped by buffer
        order = np.argsort(batch.which, kind="stable")
        cuts = np.flatnonzero(np.diff(batch.which[order])) + 1
        sources = [
            (batch.buffers[batch.which[g[0]]], batch.where[g], batch.offsets[g], batch.lengths[g])
            for g in np.split(order, cuts)
        ]
        if self.codec.codec == "zstd":
            self._decode_zstd(sources, out, threads)
        else:
            self._decode_lz4(sources, out, threads)

    def _decode_zstd(
        self, sources: list[tuple[Any, np.ndarray, np.ndarray, np.ndarray]], out: np.ndarray, threads: int
    ) -> None:
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
            zstd.BufferWithSegmentsCollection(*buffers), threads=threads
        )
        where = np.concatenate([s[1] for s in sources])
        offsets = np.concatenate([s[2] for s in sources])
        for i in range(len(decoded)):  # one decoded frame each, in the order given
            if len(decoded[i]) != self.row_bytes:
                raise ValueError(
                    f"zstd frame (offset {offsets[i]}) decodes to {len(decoded[i])} bytes, not the row's {self.row_bytes}"
                )
            out[where[i]] = np.frombuffer(decoded[i], np.uint8)

    def _decode_lz4(
        self, sources: list[tuple[Any, np.ndarray, np.ndarray, np.ndarray]], out: np.ndarray, threads: int
    ) -> None:
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
                    # the size field and the block must both say a whole row, as natively
                    size = int.from_bytes(view[a - 4 : a], "little") if b >= a else -1
                    if size != rb or decode_into(view[a:b], target[w : w + rb]) != rb:
                        raise ValueError(f"lz4 frame (offset {a - 4}) does not decode to the row's {rb} bytes")

        if threads == 1 or total < 64 or len(jobs) < 2:
            run(jobs)
            return
        if self._pool is None or self._pool._max_workers < threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mmreplay-lz4")
        parts = [jobs[i::threads] for i in range(threads)]
        for f in [self._pool.submit(run, p) for p in parts if p]:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def check_frames(info: LeafInfo, folder: str, data: bytes, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """Decode the frames at ``offsets`` of a shard's bytes (verify); raises if one does not."""
    frames = FrameCodec(parse_row_compression(info.compression or ""), info.spec.nbytes, 1, LocalFolder(folder), DICTIONARY_FILE)
    frames.verify = True  # every zstd frame's content checksum too
    out = np.empty((len(offsets), info.spec.nbytes), np.uint8)
    rows = np.arange(len(offsets))
    frames.decode(native_rows.FrameBatch([data], np.zeros(len(offsets), np.int32), rows, offsets, lengths), out)
    if frames.codec.codec == "lz4":  # lz4 blocks carry no checksum: at least the sizes must agree
        sizes = np.frombuffer(b"".join(data[o : o + 4] for o in offsets.tolist()), "<u4")
        if (sizes != info.spec.nbytes).any():
            raise ValueError(f"a frame's size is not the row's {info.spec.nbytes} bytes")
