"""Row frames decoded in one native call per leaf (the C extension) and in Python.

Both paths must return the same bytes for every codec, dtype, a trained dictionary and the
ring's wrap; a damaged frame is a CorruptBufferError on both; the extension refuses frames
outside their buffer; and ``pip install`` still works where the compiler fails, with the
Python path used.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

import mmreplay as mr
from mmreplay.backends import native_rows, row_frames, row_reads

pytest.importorskip("zstandard")
pytest.importorskip("cramjam")

ROOT = Path(__file__).resolve().parents[1]
CODECS = ["rows:lz4", "rows:zstd:1", "rows:zstd:3:dict"]


def open_with(path: Path, way: str, mode: str = "r") -> mr.Store:
    """Open ``path`` decoding row frames natively or in Python (the choice is made when a
    leaf is opened)."""
    if way == "native":
        return mr.open(path, mode)
    os.environ[native_rows.ENV] = "0"
    try:
        return mr.open(path, mode)
    finally:
        del os.environ[native_rows.ENV]


def need_native(codec: str) -> None:
    name = codec.split(":")[1]
    if native_rows.decoder(name) is None:
        pytest.skip(f"no native decoding of {name} here: {native_rows.status(name)}")


def screens(n: int, envs: int, rng: np.random.Generator) -> np.ndarray:
    """Frames with walls and moving blocks: they compress, and a dictionary trains on them."""
    base = (rng.integers(0, 4, (20, 20)) * 60).astype(np.uint8)
    out = np.empty((n, envs, 20, 20, 2), np.uint8)
    for t in range(n):
        for e in range(envs):
            frame = np.roll(base, t + 3 * e, axis=1)
            frame[rng.integers(0, 16) :][:4, :4] = 255
            out[t, e] = np.stack([frame, np.roll(frame, 1, axis=0)], -1)
    return out


@pytest.mark.parametrize("codec", CODECS)
def test_native_and_python_decoding_return_the_same_bytes(tmp_path, codec):
    need_native(codec)
    rng = np.random.default_rng(3)
    n, envs, capacity = 70, 3, 48  # wraps: the first 22 steps are overwritten
    pixels = screens(n, envs, rng)
    vectors = rng.standard_normal((n, envs, 7)).astype(">f4")  # stored little-endian
    spec = {"pixels": mr.ArraySpec(pixels.shape[2:], "uint8"), "vec": mr.ArraySpec((7,), ">f4")}
    path = tmp_path / "b"
    with mr.create(path, spec, capacity, num_envs=envs, compression=codec, chunk_steps=8) as store:
        store.extend({"pixels": pixels[:65], "vec": vectors[:65]})
        store.commit()
        # a reader of each kind while steps are still staged raw in the open segment
        live = {way: open_with(path, way) for way in ("native", "python")}
        got = {way: s.get(slice(None)) for way, s in live.items()}
        for leaf, want in (("pixels", pixels), ("vec", vectors)):
            kept = len(got["native"][leaf])  # readers leave out the segment the writer overwrites next
            assert kept >= capacity - 8
            np.testing.assert_array_equal(got["native"][leaf], want[65 - kept : 65])
            assert got["native"][leaf].tobytes() == got["python"][leaf].tobytes()
        store.extend({"pixels": pixels[65:], "vec": vectors[65:]})
        for s in live.values():
            s.close()
    if codec.endswith(":dict"):  # frames sealed after the first segment use the trained dictionary
        assert (path / "data.zarr" / "pixels" / "rows.dictionary").is_file()
    ways = {way: open_with(path, way) for way in ("native", "python")}
    ids = rng.integers(0, 4 * capacity * envs, 600)  # repeats, and ids past the ring's end wrap
    flat = {leaf: v[n - capacity :].reshape(capacity * envs, *v.shape[2:]) for leaf, v in (("pixels", pixels), ("vec", vectors))}
    ring = {leaf: np.roll(v, (n % capacity) * envs, axis=0) for leaf, v in flat.items()}  # slot order
    for way, store in ways.items():
        for leaf, want in ring.items():
            (stored,) = [x for x in store.leaves if x.info.path == leaf]
            rows = stored.take(ids)
            np.testing.assert_array_equal(rows, want[ids % (capacity * envs)], err_msg=f"{way} {leaf}")
    one = ways["native"].sample(64, num_steps=5, rng=7)
    other = ways["python"].sample(64, num_steps=5, rng=7)
    for leaf in ("pixels", "vec"):
        assert one[leaf].tobytes() == other[leaf].tobytes()
    for store in ways.values():
        store.close()


@pytest.mark.parametrize("way", ["native", "python"])
def test_a_damaged_zstd_frame_is_a_corrupt_buffer_error_on_both_paths(tmp_path, way):
    if way == "native":
        need_native("rows:zstd")
    path = tmp_path / "b"
    with mr.create(path, {"obs": mr.ArraySpec((8,), "uint8")}, 24, compression="rows:zstd", chunk_steps=4) as store:
        store.extend({"obs": np.arange(20 * 8, dtype=np.uint8).reshape(20, 1, 8)})
    shard = path / "data.zarr" / "obs" / "c" / "1" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 0xFF  # inside row 4's frame: its checksum no longer matches
    shard.write_bytes(bytes(raw))
    with open_with(path, way) as reader:
        np.testing.assert_array_equal(reader.get([8])["obs"][0, 0], np.arange(64, 72, dtype=np.uint8))
        with pytest.raises(mr.CorruptBufferError, match="leaf 'obs'.*does not decode"):
            reader.get([4])


def hostile_frames() -> list[tuple[str, str, bytes]]:
    """Frames of a 16-byte row a shard with a valid index may hold that are not the row:
    (name, codec, frame)."""
    import cramjam
    import zstandard

    row = bytes(range(16))
    block = lambda data: bytes(cramjam.lz4.compress_block(data, store_size=False))  # noqa: E731
    zstd = zstandard.ZstdCompressor(level=1, write_checksum=True).compress
    return [
        ("lz4 block of half a row", "lz4", (16).to_bytes(4, "little") + block(row[:8])),
        ("lz4 size field not the row's", "lz4", (8).to_bytes(4, "little") + block(row)),
        ("zstd frame of half a row", "zstd", zstd(row[:8])),
        ("zstd frame of two rows", "zstd", zstd(row * 2)),
    ]


@pytest.mark.parametrize("way", ["native", "python"])
@pytest.mark.parametrize("case", range(4))
def test_a_frame_that_is_not_its_row_is_a_corrupt_buffer_error_on_both_paths(tmp_path, way, case):
    """A hostile shard (its index and CRC valid) whose frame decodes to another size than
    the row's: both paths refuse it, naming the shard. The Python path used to return the
    row half undecoded (whatever the batch's memory held) or the next rows shifted by one;
    neither path said which store or file."""
    name, codec, frame = hostile_frames()[case]
    if way == "native":
        need_native(f"rows:{codec}")
    path = tmp_path / "b"
    rows = np.arange(8 * 16, dtype=np.uint8).reshape(8, 1, 16)
    with mr.create(path, {"obs": mr.ArraySpec((16,), "uint8")}, 8, compression=f"rows:{codec}", chunk_steps=4) as store:
        store.extend({"obs": rows})
    shard = path / "data.zarr" / "obs" / "c" / "0" / "0" / "0"  # steps 0-3
    raw = shard.read_bytes()
    offsets, lengths = row_reads.read_shard_index(raw, 4, str(shard))
    frames = [raw[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist())]
    frames[1] = frame
    shard.write_bytes(row_frames.shard_bytes(frames))
    with open_with(path, way) as reader:
        np.testing.assert_array_equal(reader.get([0, 2])["obs"][:, 0], rows[[0, 2], 0])
        for batch in ([1], [0, 1, 2, 3], [1, 5]):  # the damaged shard's message names its file
            with pytest.raises(mr.CorruptBufferError, match="leaf 'obs'.*(does not decode|not the row)") as caught:
                reader.get(batch)
            assert str(shard) in str(caught.value)


def test_the_extension_refuses_frames_outside_their_buffer_and_writes_nothing():
    need_native("rows:lz4")
    ext = sys.modules["mmreplay._rowdecode"]
    out = np.full((2, 16), 7, np.uint8)
    import cramjam

    frame = bytes(cramjam.lz4.compress_block(bytes(16), store_size=True))  # numcodecs' layout

    def decode(offsets, where):
        ext.decode_rows(
            "lz4", [frame], np.zeros(2, np.int32), np.array(where, np.int64), np.array(offsets, np.int64),
            np.full(2, len(frame), np.int64), out, 16, 2,
        )

    for offsets, where in (((0, 1), (0, 1)), ((0, 0), (0, 2)), ((0, -1), (0, 1))):
        with pytest.raises(ValueError, match="outside its buffer or the output"):
            decode(offsets, where)
        assert (out == 7).all()
    with pytest.raises(ValueError, match="decodes to"):  # a size that is not the row's
        ext.decode_rows(
            "lz4", [frame], np.zeros(1, np.int32), np.zeros(1, np.int64), np.zeros(1, np.int64),
            np.array([len(frame)], np.int64), out, 8, 1,
        )
    decode((0, 0), (0, 1))
    assert (out == 0).all()


def frames_of(codec: str, rows: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The rows as frames of ``codec`` one after the other: the bytes, offsets, lengths."""
    if codec == "zstd":
        import zstandard

        encode = zstandard.ZstdCompressor(level=1, write_checksum=True).compress
    else:
        import cramjam

        def encode(row: np.ndarray) -> bytes:
            return bytes(cramjam.lz4.compress_block(row.tobytes(), store_size=True))

    frames = [encode(r) for r in rows]
    lengths = np.array([len(f) for f in frames], np.int64)
    return b"".join(frames), np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), lengths


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_many_batches_through_the_decoding_threads_from_two_callers(codec):
    """The pool's threads serve batch after batch, and a second caller decoding while the
    pool serves the first decodes its own batch alone; every row lands where it should."""
    need_native(f"rows:{codec}")
    ext = sys.modules["mmreplay._rowdecode"]
    rows = screens(64, 1, np.random.default_rng(5)).reshape(64, -1)
    data, offsets, lengths = frames_of(codec, rows)
    buffers = [b"", data]  # frames in the second buffer, the first one unused

    def run(seed: int, errors: list[str]) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            ids = rng.integers(0, 64, int(rng.integers(1, 300)))
            out = np.zeros((len(ids), rows.shape[1]), np.uint8)
            ext.decode_rows(codec, buffers, np.ones(len(ids), np.int32), np.arange(len(ids), dtype=np.int64),
                            offsets[ids], lengths[ids], out, rows.shape[1], 4, None, False)
            if not (out == rows[ids]).all():
                errors.append(f"caller {seed}: wrong rows")

    errors: list[str] = []
    import threading

    callers = [threading.Thread(target=run, args=(seed, errors)) for seed in (1, 2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert errors == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_forked_child_decodes_on_threads_of_its_own(codec):
    """After the parent decoded on its pool, a forked child (multiprocessing, DataLoader
    workers) has none of the parent's threads: it must start its own, not wait on theirs."""
    need_native(f"rows:{codec}")
    ext = sys.modules["mmreplay._rowdecode"]
    rows = screens(64, 1, np.random.default_rng(6)).reshape(64, -1)
    data, offsets, lengths = frames_of(codec, rows)
    ids = np.random.default_rng(7).integers(0, 64, 256)

    def decode() -> bool:
        out = np.zeros((len(ids), rows.shape[1]), np.uint8)
        ext.decode_rows(codec, [data], np.zeros(len(ids), np.int32), np.arange(len(ids), dtype=np.int64),
                        offsets[ids], lengths[ids], out, rows.shape[1], 4)
        return bool((out == rows[ids]).all())

    assert decode()  # the parent's pool is running now
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when its rows are right, without pytest's cleanup
        code = 1
        try:
            right = all(decode() for _ in range(20))
            # on threads of its own (the parent's are not there): the caller alone would be right too
            own = not os.path.isdir("/proc/self/task") or len(os.listdir("/proc/self/task")) > 1
            code = 0 if right and own else 2 if right else 1
        finally:
            os._exit(code)
    import time

    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung decoding (waiting for the parent's threads?)")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) != 1, "the child decoded wrong rows"
    assert os.waitstatus_to_exitcode(status) == 0, "the child decoded on no thread of its own"
    assert decode()  # and the parent's pool still serves the parent


#: run in a fresh process: decode on the pool's threads, fork, decode in the child; prints
#: the pool's threads still running in the parent right after the fork and the warnings seen
_FORK_AFTER_DECODING = r"""
import json, os, sys, warnings
import cramjam
import numpy as np
import mmreplay._rowdecode as ext
from mmreplay.backends import native_rows

assert native_rows.decoder("lz4") is not None, native_rows.status("lz4")
rows = np.random.default_rng(0).integers(0, 4, (64, 900), dtype=np.uint8)
frames = [bytes(cramjam.lz4.compress_block(r.tobytes(), store_size=True)) for r in rows]
lengths = np.array([len(f) for f in frames], np.int64)
offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
data = b"".join(frames)
ids = np.random.default_rng(1).integers(0, 64, 256)

def decode():
    out = np.zeros((len(ids), 900), np.uint8)
    ext.decode_rows("lz4", [data], np.zeros(len(ids), np.int32), np.arange(len(ids), dtype=np.int64),
                    offsets[ids], lengths[ids], out, 900, 4)
    return bool((out == rows[ids]).all())

def tids():
    return set(os.listdir("/proc/self/task"))

before = tids()
right = [decode() for _ in range(5)]
pool = tids() - before  # the decoding threads (nothing else starts threads here)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always", DeprecationWarning)
    pid = os.fork()
    if pid == 0:
        os._exit(0 if all(decode() for _ in range(5)) else 1)
    left = sorted(pool & tids())
_, status = os.waitpid(pid, 0)
right.append(decode())  # the pool starts again in the parent
print(json.dumps({"pool": len(pool), "left": left, "warnings": [str(w.message) for w in seen],
                  "child": os.waitstatus_to_exitcode(status), "right": all(right)}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc/self/task")
def test_the_decoding_threads_end_before_a_fork_so_python_does_not_warn():
    """A process that decoded on the pool's threads and then forks (DataLoader workers,
    multiprocessing) has none of them left when ``fork()`` returns: Python 3.12+ counts
    the process's threads there and warns "This process ... is multi-threaded, use of
    fork() may lead to deadlocks in the child". The pool starts again on the next batch,
    in the child and in the parent. A fresh process, so that no other test's threads count.

    The warnings are recorded rather than turned into errors: on Python 3.12, CPython
    clears an error raised by that warning (the fork just goes on), so ``-W error`` would
    hide it. On 3.11, which never warns, the thread ids still show whether the pool's
    threads were left running across the fork."""
    need_native("rows:lz4")
    run = subprocess.run([sys.executable, "-c", _FORK_AFTER_DECODING], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    import json

    got = json.loads(run.stdout.strip().splitlines()[-1])
    if got["pool"] == 0:
        pytest.skip("no decoding thread could be started here")
    assert got["child"] == 0, "the forked child decoded wrong rows"
    assert got["right"], "the parent decoded wrong rows"
    assert got["left"] == [], f"decoding threads {got['left']} still ran when fork() returned"
    assert not [w for w in got["warnings"] if "multi-threaded" in w], got["warnings"]


def test_sampling_skips_zstd_checksums_and_verifying_checks_them():
    need_native("rows:zstd")
    ext = sys.modules["mmreplay._rowdecode"]
    if not ext.zstd_skips_checksums():
        pytest.skip(f"this zstd library cannot skip checksums: {native_rows.status('zstd')}")
    rows = screens(4, 1, np.random.default_rng(8)).reshape(4, -1)
    data, offsets, lengths = frames_of("zstd", rows)
    damaged = bytearray(data)
    damaged[offsets[2] + lengths[2] - 1] ^= 0x01  # the last byte of frame 2's checksum

    def decode(verify: bool) -> np.ndarray:
        out = np.zeros_like(rows)
        ext.decode_rows("zstd", [bytes(damaged)], np.zeros(4, np.int32), np.arange(4, dtype=np.int64), offsets,
                        lengths, out, rows.shape[1], 2, None, verify)
        return out

    np.testing.assert_array_equal(decode(False), rows)  # the frames themselves are whole
    with pytest.raises(ValueError, match="zstd frame 2 .*checksum"):
        decode(True)
    np.testing.assert_array_equal(decode(False), rows)  # each thread's context switched back
def need_native_encoding(codec: str) -> None:
    if native_rows.encoder(codec, 1) is None:
        pytest.skip(f"no native encoding of {codec} here: {native_rows.encoding_status(codec)}")


def encoding_rows() -> np.ndarray:
    """Rows that compress (screens), that do not (noise), and blank ones, of an odd size."""
    rng = np.random.default_rng(5)
    rows = screens(30, 2, rng).reshape(60, -1)[:, :799]
    rows[10:14] = rng.integers(0, 256, (4, 799), np.uint8)
    rows[20:22] = 0
    return np.ascontiguousarray(rows)


def _zstd_version(library: str) -> tuple[int, int, int]:
    n = ctypes.CDLL(library).ZSTD_versionNumber()
    return (n // 10000, n // 100 % 100, n % 100)


def test_native_encoding_writes_the_python_encoders_bytes_and_zarr_decodes_them():
    import zstandard
    from numcodecs import LZ4, Zstd

    rows = encoding_rows()
    need_native_encoding("lz4")
    frames = native_rows.encoder("lz4", 1).encode(rows)
    assert frames == [bytes(LZ4(acceleration=1).encode(r)) for r in rows]
    assert [bytes(LZ4().decode(f)) for f in frames] == [r.tobytes() for r in rows]

    need_native_encoding("zstd")
    library = native_rows.encoder("zstd", 1).library
    # The same zstd version writes the same frame; level 1 is the same from 1.5.4 to 1.5.7
    # (other levels changed between them, so a system library older than zstandard's writes
    # other, equally valid, frames there).
    same_version = _zstd_version(library) == zstandard.ZSTD_VERSION
    dictionary = zstandard.train_dictionary(4096, [r.tobytes() for r in rows[:40]] * 4, level=3)
    for level in (1, 3, 19):
        for d in (None, dictionary):
            frames = native_rows.encoder("zstd", level, None if d is None else d.as_bytes()).encode(rows)
            python = zstandard.ZstdCompressor(level=level, write_checksum=True, dict_data=d)
            if level == 1 or same_version:
                assert frames == [python.compress(r) for r in rows], (level, d is not None)
            if d is None:
                assert [bytes(Zstd().decode(f)) for f in frames] == [r.tobytes() for r in rows]
            decompressor = zstandard.ZstdDecompressor(dict_data=d)
            for f, r in zip(frames, rows):
                params = zstandard.get_frame_parameters(f)
                assert params.has_checksum and params.content_size == r.nbytes
                assert decompressor.decompress(f) == r.tobytes()


def test_the_native_encoder_refuses_what_is_not_whole_rows():
    need_native_encoding("lz4")
    ext = sys.modules["mmreplay._rowdecode"]
    with pytest.raises(ValueError, match="not a whole number of rows"):
        ext.encode_rows(ext.new_encoder("lz4", 1), np.zeros(10, np.uint8), 3)
    with pytest.raises(ValueError, match="row_nbytes must be"):
        ext.encode_rows(ext.new_encoder("lz4", 1), np.zeros(10, np.uint8), 0)
    assert ext.encode_rows(ext.new_encoder("lz4", 1), np.zeros(0, np.uint8), 8) == []
    with pytest.raises(ValueError, match="dictionary is for zstd only"):
        ext.new_encoder("lz4", 1, b"dict")


def test_the_native_shard_thread_writes_the_shard_python_writes_and_says_why_not(tmp_path):
    """A segment's shard stored on a native thread: frames given as bytes, the frames of
    encoding jobs on other threads in their place once encoded (they win over the bytes),
    missing rows; its folders made. The bytes are :func:`shard_bytes`'. A link on the way
    or a file in the way is refused, and no file is left behind or taken away."""
    from mmreplay.backends.row_frames import SHARD_THREAD, shard_bytes

    need_native_encoding("lz4")
    encoder, rows = native_rows.encoder("lz4", 1), encoding_rows()[:20]
    first, second, shards = encoder.worker(), encoder.worker(), encoder.worker(SHARD_THREAD)
    jobs = [(0, encoder.submit(first, rows[0:8])), (8, encoder.submit(second, rows[8:16]))]
    frames = [None] * 24
    frames[16:20] = encoder.encode(rows[16:20])
    frames[3] = b"an older frame of row 3"

    def store(folders: str, tmp: str, name: str, frames: list, jobs: list) -> bool:
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            job = native_rows.store_shard(shards, fd, folders, tmp, name, frames, jobs)
        finally:
            os.close(fd)  # the thread keeps a descriptor of its own
        return native_rows.shard_stored(job, True)

    assert store("c/0/0", "0.x.partial", "0", frames, jobs)
    assert (tmp_path / "c/0/0/0").read_bytes() == shard_bytes(encoder.encode(rows[:16]) + frames[16:20] + [None] * 4)
    assert os.listdir(tmp_path / "c/0/0") == ["0"]
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "c/1")
    with pytest.raises(OSError, match="open folder"):
        store("c/1/0", "0.x.partial", "0", frames, [])
    assert os.listdir(tmp_path / "elsewhere") == []
    (tmp_path / "c/0/0/0.y.partial").write_bytes(b"not ours")
    with pytest.raises(FileExistsError):
        store("c/0/0", "0.y.partial", "0", frames, [])
    assert (tmp_path / "c/0/0/0.y.partial").read_bytes() == b"not ours"


@pytest.mark.parametrize("codec", CODECS[:2] + ["rows:zstd:1:dict"])
def test_native_and_python_encoding_write_the_same_files(tmp_path, codec):
    """The whole write path (staging, the background encoder, sealing, a trained
    dictionary) writes the same shard files either way."""
    need_native_encoding(codec.split(":")[1])
    data = screens(40, 3, np.random.default_rng(8))
    spec = {"pixels": mr.ArraySpec(data.shape[2:], "uint8")}
    for way in ("native", "python"):
        if way == "python":
            os.environ[native_rows.ENV] = "0"
        try:
            store = mr.create(tmp_path / way, spec, 32, num_envs=3, compression=codec, chunk_steps=8)
        finally:
            os.environ.pop(native_rows.ENV, None)
        with store:
            (leaf,) = store.stored_leaves
            assert (leaf.frames._native_encodes, way) in ((True, "native"), (False, "python"))
            for t in range(40):  # wraps: segments sealed twice
                store.add({"pixels": data[t]})
    native = sorted(p.relative_to(tmp_path / "native") for p in (tmp_path / "native").rglob("c/*/*/*/*/*"))
    assert len(native) == 4
    for rel in native:
        assert (tmp_path / "native" / rel).read_bytes() == (tmp_path / "python" / rel).read_bytes(), rel


def _loadable(soname: str) -> bool:
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


@pytest.mark.skipif(native_rows.disabled(), reason=f"{native_rows.ENV}=0 forces the Python path")
def test_the_extension_is_built_and_used_where_a_compiler_and_the_libraries_are():
    """Where pip could compile, the install built the extension (so CI tests both paths)."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"], "Python.h")
    if not (shutil.which(cc) and headers.is_file()):
        pytest.skip(f"no compiler ({cc}) or no Python headers ({headers}): the Python path is the one there is")
    assert native_rows.extension() is not None, "mmreplay._rowdecode is missing: reinstall with `pip install -e .`"
    for codec, soname in (("lz4", "liblz4.so.1"), ("zstd", "libzstd.so.1")):
        if _loadable(soname):
            assert native_rows.status(codec).startswith("native"), native_rows.status(codec)
            assert native_rows.encoding_status(codec).startswith("native"), native_rows.encoding_status(codec)


#: checks, in an interpreter that imports mmreplay from the installed target only, that
#: row frames decode in Python there. The test's own environment may hold an editable
#: install of mmreplay, whose import hook would find the source tree's extension: drop it.
CHECK_FALLBACK = """
import sys
sys.meta_path = [f for f in sys.meta_path if "editable" not in str(getattr(f, "__module__", "")).lower()]
import numpy as np
import mmreplay as mr
from mmreplay.backends import native_rows
assert mr.__file__.startswith(sys.argv[1]), mr.__file__
print(native_rows.status("lz4"))
with mr.create(sys.argv[2], {"x": mr.ArraySpec((32,), "uint8")}, 16, compression="rows:lz4", chunk_steps=4) as s:
    s.extend({"x": np.arange(20 * 32).reshape(20, 1, 32).astype(np.uint8)})
with mr.open(sys.argv[2]) as r:
    assert (r.get(slice(None))["x"] == np.arange(4 * 32, 20 * 32).reshape(16, 1, 32).astype(np.uint8)).all()
print("ok")
"""


@pytest.mark.long
def test_pip_install_works_where_the_compiler_fails_and_decodes_in_python(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".pytest_cache")
    shutil.copytree(ROOT, src, ignore=ignore)  # no build left over from another install
    target = tmp_path / "target"
    env = {**os.environ, "CC": "false", "CXX": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--target",
         str(target), str(src)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(target.glob("mmreplay/_rowdecode*.so")), "the extension was built although the compiler fails"
    check = subprocess.run(
        [sys.executable, "-c", CHECK_FALLBACK, str(target), str(tmp_path / "b")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(target)}, cwd=tmp_path, timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.splitlines() == [
        "python (the C extension mmreplay._rowdecode is not built (no compiler at install time?))", "ok"
    ]


def _lz4_store(path: Path) -> Path:
    spec = {"obs": mr.ArraySpec((20, 20, 2), "uint8")}
    with mr.create(path, spec, 64, 4, compression={"obs": "rows:lz4"}, chunk_steps=8) as s:  # sealed but the last
        s.extend({"obs": screens(64, 4, np.random.default_rng(0))})
    return path


#: in a fresh process: the decoding threads the process runs after a batch at each setting
THREADS_AFTER = """
import os, sys, mmreplay as mr
store = mr.open(sys.argv[1], "r")
got = []
for setting in sys.argv[2:]:
    store.set_decode_threads(int(setting))
    before = len(os.listdir("/proc/self/task"))
    store.sample(256, rng=0)
    got.append(len(os.listdir("/proc/self/task")) - before)
print(got, store.decode_threads.threads, store.decode_threads.setting)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_set_number_of_decode_threads_is_used_whatever_the_load(tmp_path):
    """set_decode_threads(n) decodes a batch on n threads (the caller and n - 1 pool
    threads, started once), even on a machine loaded past its cores."""
    need_native("rows:lz4")
    path = _lz4_store(tmp_path / "b")
    out = subprocess.run([sys.executable, "-c", THREADS_AFTER, path, "1", "3", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[0,", "2,", "0]", "2", "2"]


def test_set_decode_threads_refuses_what_is_not_a_number_of_threads(tmp_path):
    with mr.open(_lz4_store(tmp_path / "b"), "r") as store:
        for bad in (0, -1, 1.5, True, "2"):
            with pytest.raises(ValueError, match="set_decode_threads: expected an int in"):
                store.set_decode_threads(bad)
        assert store.decode_threads.setting is None  # the automatic choice: one per idle core
        store.set_decode_threads(3)
        assert store.decode_threads[:2] == (3, 3) and "as set" in str(store.decode_threads)


def test_inspect_says_how_many_threads_decode_and_why(tmp_path):
    path = _lz4_store(tmp_path / "b")
    text = run_cli("inspect", path, "--no-images")
    assert text.returncode == 0, text.stderr
    line = next(x for x in text.stdout.splitlines() if x.startswith("  decoding "))
    assert "one per idle core at load average" in line and "store.set_decode_threads(n)" in line
    got = json.loads(run_cli("inspect", path, "--json").stdout)["decode_threads"]
    assert got["setting"] is None and 1 <= got["threads"] <= got["cpus"] == os.cpu_count()
    with mr.create(tmp_path / "plain", {"obs": mr.ArraySpec((2,), "uint8")}, 8) as s:
        s.add({"obs": np.zeros((1, 2), np.uint8)})
    plain = run_cli("inspect", tmp_path / "plain", "--no-images")
    assert "decoding" not in plain.stdout
    assert json.loads(run_cli("inspect", tmp_path / "plain", "--json").stdout)["decode_threads"] is None


LOAD_WITHOUT_SUBPROCESS = """
import subprocess
from mmreplay.backends import native_rows
started = []
real = subprocess.Popen.__init__
def record(self, *args, **kwargs):
    started.append(args[0] if args else kwargs.get("args"))
    return real(self, *args, **kwargs)
subprocess.Popen.__init__ = record
print(native_rows._load("lz4"), started)
"""


def test_loading_the_codec_library_by_its_usual_name_starts_no_process():
    """``ctypes.util.find_library`` runs ``ldconfig``; a writer that forks it holds the
    store's lock in the child until the child execs, so it is asked only as a fallback."""
    if native_rows.extension() is None:
        pytest.skip("the C extension is not built")
    done = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_SUBPROCESS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    used, started = done.stdout.split(" ", 1)
    if used != "liblz4.so.1":
        pytest.skip(f"lz4 loads here as {used}, not by its usual Linux name")
    assert started.strip() == "[]"
