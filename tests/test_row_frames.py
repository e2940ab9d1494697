"""Row-frame leaves (``rows:lz4``, ``rows:zstd``): one compressed frame per row.

Round trips of every dtype and shape, the ring's wrap, reopening, a writer killed in the
middle of a segment, verify / recover from the CLI in a fresh process, and zarr-python
reading what was written.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import run_cli, spread, verify_cli

import mmreplay as mr
from mmreplay.backends import native_rows, row_frames

pytest.importorskip("zstandard")
pytest.importorskip("cramjam")

CODECS = ["rows:lz4", "rows:zstd:1"]
DTYPES = ["uint8", "int16", "float32", "float64", "bool", "int64", ">i4"]
SHAPES = [(), (3,), (4, 5, 2)]


def values(rng: np.random.Generator, n: int, envs: int, shape: tuple, dtype: str) -> np.ndarray:
    raw = rng.integers(0, 200, (n, envs, *shape))
    return (raw % 2 == 0) if dtype == "bool" else raw.astype(dtype)


def zarr_array(path, leaf: str):
    return zarr.open_array(os.path.join(path, "data.zarr", leaf), mode="r")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_shape_round_trips_through_the_ring(tmp_path, codec, dtype):
    rng = np.random.default_rng(1)
    spec = {f"x{i}": mr.ArraySpec(shape, dtype) for i, shape in enumerate(SHAPES)}
    data = {k: values(rng, 23, 3, s.shape, dtype) for k, s in spec.items()}
    with mr.create(tmp_path / "b", spec, capacity=10, num_envs=3, compression=codec, chunk_steps=4) as store:
        for t in range(23):
            store.add({k: v[t] for k, v in data.items()})
            got = store.get(slice(None))  # the writer sees every step it added, sealed or not
            for k, v in data.items():
                np.testing.assert_array_equal(got[k], v[max(0, t - 9) : t + 1])
    with mr.open(tmp_path / "b") as reader:
        got = reader.get(slice(None))
        for k, v in data.items():
            np.testing.assert_array_equal(got[k], v[13:])
            assert got[k].dtype == np.dtype(dtype).newbyteorder("<")  # as a mapped leaf returns it
        batch = reader.sample(64, rng=0)
        for k, v in data.items():  # each sampled row is one of the rows kept
            flat = v[13:].reshape(-1, *v.shape[2:])
            assert all((flat == row).reshape(len(flat), -1).all(1).any() for row in batch[k])
        # zarr-python reads the same rows through the shard index (the store sealed them at close)
        for k, v in data.items():
            want = np.empty((10, 3, *v.shape[2:]), v.dtype)
            want[np.arange(13, 23) % 10] = v[13:]
            np.testing.assert_array_equal(np.asarray(zarr_array(tmp_path / "b", k)[:]), want)


def test_a_reopened_writer_goes_on_inside_the_segment_it_left(tmp_path):
    rng = np.random.default_rng(2)
    data = values(rng, 30, 2, (6, 6), "uint8")
    spec = {"obs": mr.ArraySpec((6, 6), "uint8")}
    path = tmp_path / "b"
    with mr.create(path, spec, capacity=16, num_envs=2, compression="rows:lz4", chunk_steps=5) as store:
        store.extend({"obs": data[:7]})
    for a, b in ((7, 9), (9, 21), (21, 30)):
        with mr.open(path, "a") as store:
            store.extend({"obs": data[a:b]})
            np.testing.assert_array_equal(store.get(slice(None))["obs"], data[max(0, b - 16) : b])
    with mr.open(path) as reader:
        np.testing.assert_array_equal(reader.get(slice(None))["obs"], data[14:30])
        seq = reader.sample(3, num_steps=4, rng=0)["obs"]
        for s in seq:  # sequences are consecutive rows of one env
            starts = [t for t in range(14, 27) for e in range(2) if (data[t : t + 4, e] == s).all()]
            assert starts


def test_a_reader_sees_the_committed_rows_of_the_segment_being_written(tmp_path):
    data = values(np.random.default_rng(3), 12, 2, (4,), "int32")
    path = tmp_path / "b"
    with mr.create(path, {"x": mr.ArraySpec((4,), "int32")}, 32, num_envs=2, compression="rows:zstd") as store:
        store.extend({"x": data[:3]})  # inside the first segment: staged, not sealed
        store.commit()
        with mr.open(path) as reader:
            np.testing.assert_array_equal(reader.get(slice(None))["x"], data[:3])
            store.extend({"x": data[3:12]})
            store.commit()
            reader.refresh()
            np.testing.assert_array_equal(reader.get(slice(None))["x"], data[:12])


@pytest.mark.parametrize("codec", CODECS)
def test_a_reader_of_a_one_segment_ring_reads_the_new_lap_once_the_writer_wraps(tmp_path, codec):
    # The whole ring is one segment: when the writer wraps, the segment is sealed and
    # staging starts over in it. A reader that had indexed the shard of the lap before
    # must not read the rows that left staging from that old shard.
    spec = {"obs": mr.ArraySpec((8, 8), "uint8"), "step": mr.ArraySpec((), "int64")}
    path = tmp_path / "b"

    def step(t: int) -> dict[str, np.ndarray]:
        return {"obs": np.full((1, 8, 8), t, np.uint8), "step": np.array([t])}

    with mr.create(path, spec, capacity=8, compression={"obs": codec}) as store:
        for t in range(13):  # one lap sealed (steps 0-7), steps 8-12 staged
            store.add(step(t))
        store.commit()
        with mr.open(path) as reader:
            assert reader.window[:2] == (6, 13)
            reader.get(slice(None))  # indexes the shard of steps 0-7
            for t in range(13, 17):  # step 15 ends the lap (sealed), step 16 starts the next
                store.add(step(t))
            batch, info = reader.sample(64, return_info=True, rng=0)
            assert info.step.min() >= 9  # (the reader's window moved past the overwritten step 8)
            np.testing.assert_array_equal(batch["obs"][:, 0, 0], info.step)


def test_a_reader_reads_a_one_segment_ring_its_writer_came_round_and_sealed_again(tmp_path):
    """With one segment (``chunk_steps`` = capacity) the write head leaves the segment and
    comes back into it: a reader that read the shard before must read the new one, not be
    told the buffer is damaged nor given the last lap's rows."""
    path = tmp_path / "b"
    with mr.create(path, {"x": mr.ArraySpec((), "int64")}, capacity=8, compression="rows:lz4", commit_every=10**6) as store:
        store.extend({"x": np.arange(10).reshape(10, 1)})  # wrapped: steps 8 and 9 staged
        store.commit()
        with mr.open(path) as reader:
            np.testing.assert_array_equal(reader.get(slice(None))["x"][:, 0], np.arange(3, 10))
            for t in range(10, 17):  # round again: the segment is sealed, step 16 staged
                store.add({"x": np.array([t])})
            assert reader.live_first() <= 9  # step 9 is still retained
            np.testing.assert_array_equal(reader.read_steps([9])[0][:, 0], [9])


WRITER = textwrap.dedent(
    """
    import sys, numpy as np, mmreplay as mr
    path, codec = sys.argv[1], sys.argv[2]
    spec = {"obs": mr.ArraySpec((8, 8), "uint8"), "step": mr.ArraySpec((), "int64")}
    store = mr.create(path, spec, capacity=40, num_envs=2, compression={"obs": codec}, chunk_steps=6)
    t = 0
    while True:
        store.add({"obs": np.full((2, 8, 8), t % 251, np.uint8), "step": np.full(2, t)})
        t += 1
        if t % 5 == 0:
            store.commit()
        if t == 57:  # mid-segment (57 = 9 * 6 + 3), after a wrap, commits up to step 55
            print("ready", flush=True)
            sys.stdin.readline()
    """
)


def killed_writer(path: str, codec: str) -> None:
    """Run WRITER until it is mid-segment, then kill -9 it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, path, codec], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("codec", ["rows:lz4", "rows:zstd:1"])
def test_kill_9_mid_segment_keeps_every_committed_row_and_the_cli_agrees(tmp_path, codec):
    path = str(tmp_path / "b")
    killed_writer(path, codec)
    cli = [sys.executable, "-m", "mmreplay.cli"]
    check = subprocess.run([*cli, "verify", path], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    with mr.open(path) as reader:
        assert reader.total_steps == 55
        got = reader.get(slice(None))
        steps = got["step"][:, 0]
        # the oldest steps may be cut off by the dead writer's reservation, never the newest
        assert steps.tolist() == list(range(reader.first_step, 55)) and reader.first_step <= 25
        np.testing.assert_array_equal(got["obs"], (steps % 251).astype(np.uint8)[:, None, None, None] + np.zeros((1, 2, 8, 8), np.uint8))
    with mr.open(path, "a") as store:  # a new writer goes on from the committed end
        store.add({"obs": np.full((2, 8, 8), 7, np.uint8), "step": np.full(2, 55)})
        assert store.get(slice(-2, None))["step"][:, 0].tolist() == [54, 55]


def test_verify_finds_a_damaged_shard_and_recover_drops_its_rows(tmp_path):
    path = tmp_path / "b"
    with mr.create(path, {"obs": mr.ArraySpec((8,), "uint8")}, 24, compression="rows:zstd", chunk_steps=4) as store:
        store.extend({"obs": np.arange(20 * 8, dtype=np.uint8).reshape(20, 1, 8)})
    shard = path / "data.zarr" / "obs" / "c" / "1" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 0xFF  # a flipped byte inside row 4's frame
    shard.write_bytes(bytes(raw))
    cli = [sys.executable, "-m", "mmreplay.cli"]
    check = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True)
    assert check.returncode != 0
    assert "c/1/0/0" in check.stdout + check.stderr
    fixed = subprocess.run([*cli, "recover", str(path)], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    again = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True)
    assert again.returncode == 0, again.stdout + again.stderr
    with mr.open(path) as reader:  # the steps after the damaged segment are kept
        kept = reader.get(slice(None))["obs"][:, 0, 0]
        assert kept.tolist() == [t * 8 % 256 for t in range(8, 20)]


@pytest.mark.parametrize("flip", [5, 9], ids=["frame header", "row content"])
def test_verify_checks_every_zstd_frame_and_its_checksum(tmp_path, flip):
    """Sampling skips zstd's content checksums (natively); ``mmreplay verify`` checks them:
    a flipped byte the decoder alone does not notice (in a raw block's content) is found
    too, naming the leaf and the segment."""
    path = tmp_path / "b"
    with mr.create(path, {"obs": mr.ArraySpec((8,), "uint8")}, 24, compression="rows:zstd", chunk_steps=4) as store:
        store.extend({"obs": np.arange(20 * 8, dtype=np.uint8).reshape(20, 1, 8)})
    shard = path / "data.zarr" / "obs" / "c" / "1" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    assert raw[4:9] == bytes([0x24, 8, 0x41, 0, 0])  # row 4: checksum flag, 8 bytes, one raw block
    raw[flip] ^= 0xFF  # its frame content size, or its first byte
    shard.write_bytes(bytes(raw))
    cli = [sys.executable, "-m", "mmreplay.cli"]
    check = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "leaf 'obs'" in check.stdout and "(segment 1, slots 4..7) does not decode" in check.stdout, check.stdout
    problems = "\n".join(line for line in check.stdout.splitlines() if line.startswith("problem: "))
    assert ("checksum" in problems) == (flip == 9), check.stdout


def test_a_batch_over_more_segments_than_are_kept_mapped(tmp_path, monkeypatch):
    """The decoder gets the shards of every segment a batch needs, however many; the
    oldest mappings are let go after the batch."""
    from mmreplay.backends import row_reads as row_frames

    monkeypatch.setattr(row_frames, "MAPPED_SHARDS", 3)
    path = tmp_path / "b"
    values = np.arange(40 * 2 * 8, dtype=np.uint8).reshape(40, 2, 8)
    with mr.create(path, {"obs": mr.ArraySpec((8,), "uint8")}, 40, num_envs=2, compression="rows:lz4", chunk_steps=2) as store:
        store.extend({"obs": values})
    with mr.open(path) as reader:
        (leaf,) = reader.leaves
        ids = np.random.default_rng(0).permutation(80)  # all 20 segments, in no order
        np.testing.assert_array_equal(leaf.take(ids), values.reshape(80, 8)[ids])
        assert len(leaf.shards) <= 3 and sum(b is not None for b in leaf.buffers) == len(leaf.shards)
        np.testing.assert_array_equal(leaf.take(ids[:5]), values.reshape(80, 8)[ids[:5]])


@pytest.mark.parametrize("way", ["read with pread", "mapped again"])
def test_a_shard_replaced_while_unmapped_is_indexed_again(tmp_path, monkeypatch, way):
    """A reader keeps the index of a shard it does not hold mapped or open, but only for
    that very file: one the writer replaced since (``set``: a longer frame, which moves
    the frames after it) is indexed again when read, never read at the old offsets."""
    from mmreplay.backends import row_reads as row_frames

    monkeypatch.setattr(row_frames, "MAPPED_SHARDS", row_frames._mapped[0] + 1)
    monkeypatch.setattr(row_frames, "OPEN_SHARDS", 0)
    path = tmp_path / "b"
    spec = {"obs": mr.ArraySpec((64,), "uint8")}
    store = mr.create(path, spec, 6, compression="rows:lz4", chunk_steps=2)
    store.extend({"obs": np.zeros((6, 1, 64), np.uint8)})
    store.commit()
    with mr.open(path) as reader:
        (leaf,) = reader.leaves
        if way == "mapped again":
            assert (leaf.take([2, 3]) == 0).all()  # segment 1 mapped
            monkeypatch.setattr(row_frames, "MAPPED_SHARDS", row_frames._mapped[0] - 1)
            assert (leaf.take([0]) == 0).all()  # read with pread; segment 1 unmapped after
            monkeypatch.setattr(row_frames, "MAPPED_SHARDS", row_frames._mapped[0] + 1)
        else:
            assert (leaf.take([0]) == 0).all()  # segment 0 takes the one mapping
            assert (leaf.take([2, 3]) == 0).all()  # segment 1 read with pread
        assert not leaf.mapped[1] and 1 not in leaf.files and 1 in leaf.indexed
        noisy = np.random.default_rng(0).integers(0, 255, (1, 1, 64), np.uint8)
        store.set([2], {"obs": noisy})
        store.commit()
        np.testing.assert_array_equal(leaf.take([2, 3]), np.stack([noisy[0, 0], np.zeros(64, np.uint8)]))
        assert leaf.mapped[1] == (way == "mapped again")
    store.close()


@pytest.mark.parametrize("kept_open", [0, 100], ids=["opened per batch", "kept open"])
def test_past_the_mapping_budget_a_reader_reads_a_lapped_ring_with_pread(tmp_path, monkeypatch, kept_open):
    """With no mapping to spare, a reader reads every frame with pread, from shard files
    kept open or opened per batch; once the writer laps the ring (each segment sealed
    again, other frames at other offsets) and the reader refreshes, it reads the new
    shards, not the files it held."""
    from mmreplay.backends import row_reads as row_frames

    monkeypatch.setattr(row_frames, "MAPPED_SHARDS", 0)
    monkeypatch.setattr(row_frames, "OPEN_SHARDS", kept_open)
    rng = np.random.default_rng(5)
    path = tmp_path / "b"
    spec = {"obs": mr.ArraySpec((6, 4), "int16")}
    first = np.zeros((24, 3, 6, 4), np.int16)
    second = rng.integers(-300, 300, (24, 3, 6, 4)).astype(np.int16)
    ids = rng.integers(0, 24 * 3, 200)
    with mr.create(path, spec, 24, num_envs=3, compression="rows:zstd:1", chunk_steps=2) as store:
        store.extend({"obs": first})
        store.commit()
        with mr.open(path) as reader:
            (leaf,) = reader.leaves
            np.testing.assert_array_equal(leaf.take(ids), first.reshape(72, 6, 4)[ids])
            assert not leaf.shards and len(leaf.files) == min(kept_open, 12)  # every segment is sealed
            store.extend({"obs": second})
            store.commit()
            reader.refresh()
            np.testing.assert_array_equal(leaf.take(ids), second.reshape(72, 6, 4)[ids])
            assert not leaf.shards and len(leaf.files) == min(kept_open, 12)
        assert row_frames._kept_open[0] == 0  # closed with the reader


@pytest.mark.parametrize("way", ["native", "python"])
@pytest.mark.parametrize("codec", CODECS)
def test_frames_read_with_pread_are_the_mapped_ones_byte_for_byte(tmp_path, monkeypatch, codec, way):
    """The same rows read from mapped shards, with pread from shards opened per batch or
    kept open, and all mixed in one batch with rows still raw in staging, in either
    decoder; duplicates and rows of one shard close together and far apart included."""
    from mmreplay.backends import native_rows
    from mmreplay.backends import row_reads as row_frames

    rng = np.random.default_rng(11)
    path = tmp_path / "b"
    data = values(rng, 37, 3, (4, 5, 2), "float32")
    truth = data.reshape(-1, 4, 5, 2)
    ids = np.concatenate([rng.integers(0, truth.shape[0], 300), [7, 7, 8, 60, 61, 62, 110, 110]])
    with mr.create(path, {"x": mr.ArraySpec((4, 5, 2), "float32")}, 40, num_envs=3, compression=codec, chunk_steps=2) as store:
        store.extend({"x": data})  # 18 segments sealed, the 19th staged
        store.commit()
        if way == "python":
            monkeypatch.setenv(native_rows.ENV, "0")
        reader = mr.open(path)
        monkeypatch.delenv(native_rows.ENV, raising=False)
        with reader:
            (leaf,) = reader.leaves
            got = {}
            for name, mapped, kept_open in [
                ("mapped", 1 << 20, 0),
                ("pread, opened per batch", 0, 0),
                ("pread, kept open", 0, 1 << 20),
                ("mixed", 6, 5),
            ]:
                monkeypatch.setattr(row_frames, "MAPPED_SHARDS", row_frames._mapped[0] - len(leaf.shards) + mapped)
                monkeypatch.setattr(row_frames, "OPEN_SHARDS", row_frames._kept_open[0] - len(leaf.files) + kept_open)
                leaf.take([0])  # the mappings and files of the setting before are let go after it
                got[name] = leaf.take(ids)
                assert len(leaf.shards) == min(mapped, 18) and len(leaf.files) == min(kept_open, 18 - len(leaf.shards))
            for name, rows in got.items():
                assert rows.tobytes() == truth[ids].tobytes(), name
    check = subprocess.run([sys.executable, "-m", "mmreplay.cli", "verify", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize("kept_open", [0, 100], ids=["opened per batch", "kept open"])
def test_a_missing_shard_read_with_pread_is_named_and_no_file_is_left_open(tmp_path, monkeypatch, kept_open):
    from mmreplay.backends import row_reads as row_frames
    from mmreplay.errors import CorruptBufferError

    monkeypatch.setattr(row_frames, "MAPPED_SHARDS", 0)
    monkeypatch.setattr(row_frames, "OPEN_SHARDS", kept_open)
    path = tmp_path / "b"
    with mr.create(path, {"x": mr.ArraySpec((8,), "uint8")}, 12, compression="rows:lz4", chunk_steps=2) as store:
        store.extend({"x": np.ones((12, 1, 8), np.uint8)})
    with mr.open(path) as reader:
        (leaf,) = reader.leaves
        gone = leaf.shard_path(3)
        os.remove(gone)
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(CorruptBufferError, match="segment 3") as err:
            leaf.take(np.arange(12))  # segments 0-2 opened first
        assert gone in str(err.value)
        assert len(os.listdir("/proc/self/fd")) == before + len(leaf.files)
        assert len(leaf.files) == (3 if kept_open else 0)
    assert row_frames._kept_open[0] == 0


def test_the_budgets_are_set_from_the_environment_of_a_fresh_process(tmp_path):
    """``MMREPLAY_MAPPED_SHARDS`` / ``MMREPLAY_OPEN_SHARDS``: a process that may map and
    keep open no shard reads every row with pread, the same values."""
    path = tmp_path / "b"
    data = values(np.random.default_rng(2), 30, 2, (16,), "uint8")
    with mr.create(path, {"x": mr.ArraySpec((16,), "uint8")}, 30, num_envs=2, compression="rows:lz4", chunk_steps=3) as store:
        store.extend({"x": data})
    script = textwrap.dedent(
        """
        import sys, numpy as np, mmreplay as mr
        from mmreplay.backends import row_reads as row_frames
        with mr.open(sys.argv[1]) as reader:
            x = reader.get(slice(None))["x"]
            print(row_frames.MAPPED_SHARDS, row_frames.OPEN_SHARDS, len(reader.leaves[0].shards))
        np.save(sys.argv[2], x)
        """
    )
    env = {**os.environ, "MMREPLAY_MAPPED_SHARDS": "0", "MMREPLAY_OPEN_SHARDS": "0"}
    run = subprocess.run(
        [sys.executable, "-c", script, str(path), str(tmp_path / "x.npy")], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", "0", "0"]
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), data)


def test_a_missing_staging_file_is_found_and_recovered(tmp_path):
    path = str(tmp_path / "b")
    killed_writer(path, "rows:lz4")  # committed steps 54 and 55 are in staging only
    os.remove(os.path.join(path, "data.zarr", "obs", "rows.staging"))
    cli = [sys.executable, "-m", "mmreplay.cli"]
    check = subprocess.run([*cli, "verify", path], capture_output=True, text=True)
    assert check.returncode != 0 and "rows.staging" in check.stdout + check.stderr
    fixed = subprocess.run([*cli, "recover", path], capture_output=True, text=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert subprocess.run([*cli, "verify", path], capture_output=True, text=True).returncode == 0
    with mr.open(path) as reader:
        # the shard of the staged segment holds the lap before: its committed steps (52..54)
        # are gone, and recover keeps only the steps after the damage (none)
        assert reader.total_steps == 55 and len(reader) == 0


def test_bad_row_settings_are_refused_before_anything_is_written(tmp_path):
    spec = {"x": mr.ArraySpec((2,), "uint8")}
    for bad in ("rows:lz4:3", "rows:zstd:40", "rows:brotli"):
        with pytest.raises(mr.SpecError, match="row frames"):
            mr.create(tmp_path / "b", spec, 8, compression=bad)
        assert not (tmp_path / "b").exists()
    with pytest.raises(mr.SpecError):
        mr.create(tmp_path / "h", spec, 8, backend="hdf5", compression="rows:lz4")


def test_a_picture_leaf_compressed_in_chunks_is_told_the_row_setting_at_creation(tmp_path):
    """compression="zstd" on an image leaf sampled at 0.005x an uncompressed store, silently."""
    import warnings

    spec = {"obs": mr.ArraySpec((84, 84, 4), "uint8"), "reward": mr.ArraySpec((), "float32")}

    def advice(path, **options) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mr.create(tmp_path / path, spec, 100, 2, **options).close()
        return [str(w.message) for w in caught]

    told = advice("zstd", compression="zstd")
    assert len(told) == 1 and "leaf 'obs'" in told[0] and "give it 'rows:zstd'" in told[0], told
    assert "give it 'rows:lz4' with backend='zarr'" in advice("gzip", backend="hdf5", compression="gzip")[0]
    assert advice("rows", compression={"obs": "rows:zstd"}) == []
    assert advice("scalars", compression={"reward": "zstd"}) == []
    assert advice("zstd", compression="zstd", exist_ok=True) == []  # reopened: said when it was made
    (tmp_path / "spec.json").write_text('{"obs": {"shape": [84, 84, 4], "dtype": "uint8"}}')
    cli = run_cli("create", tmp_path / "c", "--spec", tmp_path / "spec.json", "--capacity", "100", "--compression", "zstd")
    assert cli.returncode == 0, cli.stderr
    assert cli.stderr.startswith("Warning: leaf 'obs'") and cli.stderr.count("\n") == 1, cli.stderr


def test_creating_an_lz4_row_leaf_warns_nothing_from_python_or_the_cli(tmp_path):
    """zarr's "numcodecs codecs are not in the v3 spec" is no news to a user: zarr reads them."""
    import warnings

    spec = {"obs": mr.ArraySpec((16, 16, 3), "uint8")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mr.create(tmp_path / "b", spec, 10, compression="rows:lz4") as store:
            store.extend({"obs": np.ones((12, 1, 16, 16, 3), "uint8")})
        with mr.open(tmp_path / "b") as reader:
            assert reader.sample(4, rng=0)["obs"].min() == 1
    (tmp_path / "spec.json").write_text('{"obs": {"shape": [16, 16, 3], "dtype": "uint8"}}')
    cli = run_cli("create", tmp_path / "c", "--spec", tmp_path / "spec.json", "--capacity", "10", "--compression", "rows:lz4")
    assert cli.returncode == 0 and cli.stderr == "", cli.stderr


def test_without_the_pixels_extra_the_error_names_it(tmp_path):
    path = tmp_path / "b"
    mr.create(path, {"x": mr.ArraySpec((2,), "uint8")}, 8, compression="rows:zstd").close()
    code = "import sys; sys.modules['zstandard'] = None; import mmreplay as mr; mr.open(sys.argv[1])"
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert out.returncode != 0
    assert "mmreplay[pixels]" in out.stderr


def test_the_decoded_chunk_cache_of_chunked_leaves_is_a_parameter(tmp_path):
    spec = {"obs": mr.ArraySpec((16,), "uint8")}
    with mr.create(tmp_path / "b", spec, 64, compression="zstd", chunk_steps=4) as store:
        store.extend({"obs": np.ones((64, 1, 16), np.uint8)})
    with mr.open(tmp_path / "b") as reader:
        (leaf,) = reader.leaves
        every = np.arange(64)
        reader.get(every)
        assert len(leaf.cache) == 16  # the default holds all 16 chunks of 64 bytes
        reader.set_chunk_cache(3 * 4 * 16)
        assert len(leaf.cache) == 3
        reader.get(every)
        assert len(leaf.cache) == 3
        reader.set_chunk_cache(0)
        reader.get(every)
        assert len(leaf.cache) == 0
        np.testing.assert_array_equal(reader.get(every)["obs"], np.ones((64, 1, 16), np.uint8))
        with pytest.raises(ValueError, match="byte count"):
            reader.set_chunk_cache(-1)


def test_a_trained_zstd_dictionary_serves_the_writer_and_a_reader_opened_before_it(tmp_path):
    path = tmp_path / "b"
    rng = np.random.default_rng(5)
    base = rng.integers(0, 4, (16, 16)).astype(np.uint8) * 60
    data = np.stack([np.roll(base, t, axis=1) for t in range(80)])[:, None].repeat(2, 1)  # [80, 2, 16, 16]
    data[:, 1] += 1
    spec = {"obs": mr.ArraySpec((16, 16), "uint8")}
    with mr.create(path, spec, 64, num_envs=2, compression="rows:zstd:3:dict", chunk_steps=16) as store:
        store.extend({"obs": data[:8]})
        store.commit()
        reader = mr.open(path)  # before any dictionary exists
        store.extend({"obs": data[8:80]})  # seals segments: the first one trains the dictionary
        assert (path / "data.zarr" / "obs" / "rows.dictionary").is_file()
        np.testing.assert_array_equal(store.get(slice(None))["obs"], data[16:80])
    with reader:
        reader.refresh()
        np.testing.assert_array_equal(reader.get(slice(None))["obs"], data[16:80])
    done = subprocess.run([sys.executable, "-m", "mmreplay.cli", "verify", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


class FailingEncoder:
    """A native encoder whose thread fails, as a full disk or a codec bug makes it."""

    @staticmethod
    def worker():
        return None

    def submit(self, worker, rows):
        return None

    def frames(self, job, wait):
        raise OSError("the codec failed")


@pytest.mark.parametrize("way", ["native", "python"])
@pytest.mark.parametrize("codec", CODECS)
def test_an_error_in_the_background_encoder_surfaces_in_the_caller_and_the_committed_rows_hold(tmp_path, codec, way):
    spec = {"x": mr.ArraySpec((6, 7), "uint8")}
    rows = np.arange(5 * 2 * 42, dtype=np.uint8).reshape(5, 2, 6, 7)
    store = mr.create(tmp_path / "b", spec, capacity=8, num_envs=2, compression=codec, chunk_steps=4)
    store.add({"x": rows[0]})
    store.commit()
    (leaf,) = store.stored_leaves

    def fails(rows):
        raise OSError("the codec failed")

    if way == "native":
        leaf.frames._native_encoders = {slot: FailingEncoder() for slot in range(8)}  # every encoding thread's
    else:
        leaf.frames._native_encodes, leaf.frames._native_encoders = False, {}
        leaf.frames.encode_rows = fails  # the Python encoding thread's codec
    store.add({"x": rows[1]})  # inside the segment: its rows are encoded in the background
    store.commit()  # the row is durable raw in staging: the commit does not wait for its encoding
    with pytest.raises(mr.CorruptBufferError, match="encoding rows in the background failed.*the codec failed"):
        store.close()  # sealing the open segment waits for its frames
    with mr.open(tmp_path / "b", mode="a") as store:  # closed all the same: the lock is free
        assert store.total_steps == 2
        np.testing.assert_array_equal(store.get(slice(None))["x"], rows[:2])
        for t in range(2, 5):  # step 3 ends the segment: sealed with every frame, encoded again
            store.add({"x": rows[t]})
    with mr.open(tmp_path / "b") as reader:
        np.testing.assert_array_equal(reader.get(slice(None))["x"], rows)
    assert zarr_array(tmp_path / "b", "x")[:4].tolist() == rows[:4].tolist()


@pytest.mark.parametrize("codec", CODECS)
def test_a_writer_left_open_at_exit_hands_its_last_rows_to_the_encoder_and_keeps_them(tmp_path, codec):
    """The encoder thread outlives the interpreter's thread pools: the exit hook's close
    still encodes and seals the rows added since the last hand-over."""
    path = str(tmp_path / "b")
    script = textwrap.dedent(
        f"""
        import numpy as np, mmreplay as mr
        store = mr.create({path!r}, {{"x": mr.ArraySpec((6, 7), "uint8")}}, 100, num_envs=2,
                          compression={codec!r}, chunk_steps=50)
        for t in range(45):  # 90 rows: one hand-over to the encoder, 26 rows left with the caller
            store.add({{"x": np.full((2, 6, 7), t, np.uint8)}})
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and "failed" not in done.stderr, done.stderr
    with mr.open(path) as reader:
        assert reader.total_steps == 45
        assert reader.get(slice(None))["x"][:, :, 0, 0].tolist() == [[t, t] for t in range(45)]
    assert zarr_array(path, "x")[:45, 0, 0, 0].tolist() == list(range(45))  # sealed at exit


def _background_threads() -> tuple[int, int, int]:
    """Threads of this process that encode or seal row frames: (native encoding, native
    storing shards, Python); native ones are found by their OS name."""
    import threading

    native = {"mmreplay-encode": 0, row_frames.SHARD_THREAD: 0}
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/comm"):
        try:
            name = task.read_text().strip()
        except OSError:  # the thread ended
            continue
        if name in native:
            native[name] += 1
    return *native.values(), sum(t.name == "mmreplay-encode" for t in threading.enumerate())


def test_a_writer_encodes_every_row_leaf_on_one_pool_the_frames_side_ring_included(tmp_path):
    spec = {"obs": mr.ArraySpec((6, 7), "uint8"), "next_obs": mr.ArraySpec((6, 7), "uint8"),
            "depth": mr.ArraySpec((6, 7), "uint16"), "terminated": mr.ArraySpec((), "bool")}
    compression = {"obs": "rows:lz4", "depth": "rows:zstd:1"}
    rng = np.random.default_rng(2)
    frames = rng.integers(0, 255, (41, 2, 6, 7), np.uint8)
    depth = rng.integers(0, 999, (40, 2, 6, 7)).astype(np.uint16)
    ended = np.zeros((40, 2), bool)
    ended[[9, 25], [0, 1]] = True  # their next observation goes to the side ring
    before = _background_threads()
    with mr.create(tmp_path / "b", spec, 32, num_envs=2, compression=compression, chunk_steps=8,
                   frames=mr.Frames()) as store:
        leaves = [leaf for leaf in store.stored_leaves if leaf.info.compression]
        assert len(leaves) == 3  # obs, depth, and the side ring's next frames
        obs = frames[0]
        for t in range(40):
            nxt = np.where(ended[t][:, None, None], rng.integers(0, 255, (2, 6, 7), np.uint8), frames[t + 1])
            store.add({"obs": obs, "next_obs": nxt, "depth": depth[t], "terminated": ended[t]})
            obs = frames[t + 1]
            if t == 20:
                assert len({id(leaf.encoder) for leaf in leaves}) == 1
                # native threads encode (where the extension is), up to one per core, and
                # one stores the shards of segments; else one Python thread does both
                workers = len(leaves[0].encoder.workers)
                if leaves[0].frames.native_encoder() is not None:
                    assert 1 <= workers <= native_rows.encode_threads()
                    assert _background_threads() == (before[0] + workers, before[1] + 1, before[2])
                else:
                    assert _background_threads() == (before[0], before[1], before[2] + 1)
        got = store.get(slice(None))
    assert _background_threads() == before  # stopped when the last leaf closed
    np.testing.assert_array_equal(got["depth"], depth[8:])
    with mr.open(tmp_path / "b") as reader:
        again = reader.get(slice(None))
    for name in spec:
        np.testing.assert_array_equal(again[name], got[name])


SEALING_WRITER = textwrap.dedent(
    """
    import sys, threading, numpy as np, mmreplay as mr
    from concurrent.futures import Future
    from mmreplay.backends import row_frames
    path, codec, when = sys.argv[1:4]
    store_later = row_frames.RowFrameLeaf._store_later
    seals, sealing = [], threading.Event()

    def held(self, k, frames, jobs):  # the background seal of segment 3 on the second lap never ends
        seals.append(k)
        if seals.count(3) == 2:
            if when == "after the rename":
                store_later(self, k, frames, jobs).result()
            sealing.set()
            return Future()
        return store_later(self, k, frames, jobs)

    row_frames.RowFrameLeaf._store_later = held
    spec = {"obs": mr.ArraySpec((8, 8), "uint8"), "step": mr.ArraySpec((), "int64")}
    store = mr.create(path, spec, capacity=40, num_envs=2, compression={"obs": codec}, chunk_steps=6)
    for t in range(67):
        store.add({"obs": np.full((2, 8, 8), t % 251, np.uint8), "step": np.full(2, t)})
        if t < 63:
            store.commit()  # up to step 62: segment 3 (steps 58..63) has committed rows in staging
        # step 63 leaves segment 3; steps 64..66 are written ahead, uncommitted
    assert sealing.wait(60) and store.stored_leaves[0].sealing is not None
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.parametrize(("codec", "when"), spread(CODECS, ["before the rename", "after the rename"]))
def test_kill_9_while_a_segment_is_sealed_in_the_background_keeps_every_committed_row(tmp_path, codec, when):
    path = str(tmp_path / "b")
    proc = subprocess.Popen(
        [sys.executable, "-c", SEALING_WRITER, path, codec, when],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line == "ready", line + (proc.stderr.read() if proc.poll() is not None else "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    check = subprocess.run([sys.executable, "-m", "mmreplay.cli", "verify", path], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    def expect(store, end):
        got = store.get(slice(None))
        steps = got["step"][:, 0]
        assert steps.tolist() == list(range(store.first_step, end))
        want = (steps % 251).astype(np.uint8)[:, None, None, None] + np.zeros((1, 2, 8, 8), np.uint8)
        np.testing.assert_array_equal(got["obs"], want)

    with mr.open(path) as reader:
        assert reader.total_steps == 63
        assert reader.first_step <= 63 - 40 + 6  # the newest steps are all there, segment 3's included
        expect(reader, 63)
    with mr.open(path, "a") as store:  # a new writer seals segment 3 from staging and goes on
        for t in range(63, 70):
            store.add({"obs": np.full((2, 8, 8), t % 251, np.uint8), "step": np.full(2, t)})
        expect(store, 70)
    with mr.open(path) as reader:
        expect(reader, 70)
    assert zarr_array(path, "obs")[18:24, 0, 0, 0].tolist() == list(range(58, 64))  # segment 3's shard, resealed


GATED_WRITER = textwrap.dedent(
    """
    import sys, threading, numpy as np, mmreplay as mr
    from mmreplay.backends import row_frames
    path, codec = sys.argv[1:3]
    row_frames.ENCODE_BATCH_ROWS = 1  # each step's rows go to the encoding thread as it is added
    spec = {"obs": mr.ArraySpec((8, 8), "uint8"), "step": mr.ArraySpec((), "int64")}
    store = mr.create(path, spec, capacity=24, num_envs=2, compression={"obs": codec}, chunk_steps=8)
    (leaf,) = [leaf for leaf in store.stored_leaves if leaf.info.path == "obs"]
    encode, entered, gate = leaf.frames.encode_rows, threading.Event(), threading.Event()

    def gated(rows):  # the encoding thread's codec: the rows of step 13 wait at the gate
        if rows[0, 0] == 13:
            entered.set()
            gate.wait()
        return encode(rows)

    leaf.frames.encode_rows = gated
    for t in range(14):  # steps 0..7 fill segment 0 (sealed), 8..13 are in staging
        store.add({"obs": np.full((2, 8, 8), t, np.uint8), "step": np.full(2, t)})
    assert entered.wait(60)
    threading.Timer(60, gate.set).start()  # what a commit that waited for step 13 would need
    store.commit()
    print("committed", store.committed_steps, "gate", "open" if gate.is_set() else "shut", flush=True)
    sys.stdin.readline()
    """
)


@pytest.mark.parametrize("codec", CODECS)
def test_a_commit_returns_while_a_step_it_made_durable_is_still_encoding_and_kill_9_keeps_it(tmp_path, writers, codec):
    """A commit waits only for what it makes durable: the rows of the segment the head is
    in are durable raw in staging, so it returns while their encoding is held (the
    encoding thread's codec waits at a gate for step 13); kill -9 then loses none of them,
    and the next writer encodes them again."""
    path = str(tmp_path / "b")
    env = {**os.environ, native_rows.ENV: "0"}  # rows encoded on the Python thread, where the gate is
    proc = writers.start(GATED_WRITER, path, codec, stdin=subprocess.PIPE, env=env)
    line = writers.kill_when(proc, lambda line: line.startswith("committed"))
    assert line.split() == ["committed", "14", "gate", "shut"], line
    assert verify_cli(path) == (0, [])
    with mr.open(path) as reader:
        got = reader.get(slice(None))
        assert reader.total_steps == 14 and got["step"][:, 0].tolist() == list(range(14))
        np.testing.assert_array_equal(got["obs"], np.arange(14, dtype=np.uint8)[:, None, None, None] + np.zeros((1, 2, 8, 8), np.uint8))
    with mr.open(path, "a") as store:  # encodes steps 8..13 again, and seals segment 1 with them
        for t in range(14, 16):
            store.add({"obs": np.full((2, 8, 8), t, np.uint8), "step": np.full(2, t)})
    assert zarr_array(path, "obs")[:16, 0, 0, 0].tolist() == list(range(16))


ASYNC_WRITER = textwrap.dedent(
    """
    import sys, numpy as np, mmreplay as mr
    path, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    store = mr.open(path, "a")
    t = store.total_steps
    pattern = np.arange(4 * 48 * 48, dtype=np.int64).reshape(4, 48, 48)
    while True:
        store.add({"obs": ((pattern * (t + 1)) % 251).astype(np.uint8), "step": np.full(4, t)})
        t += 1
        if rng.random() < 0.3:
            store.commit()
            print("committed", store.committed_steps, flush=True)
    """
)


def _nth_commit(n: int):
    """A writer's line is the ``n``-th it prints of its commits."""
    left = [n]

    def ready(line: str) -> bool:
        left[0] -= line.startswith("committed")
        return left[0] == 0

    return ready


@pytest.mark.parametrize("codec", CODECS)
def test_kill_9_just_after_commits_while_rows_encode_in_the_background_loses_no_committed_step(tmp_path, writers, codec):
    """Writers killed right after a commit, when the encoding of the rows it made durable,
    and a segment's shard, are in flight on the native threads: every committed step is
    there, bit-exact, and verify agrees, kill after kill."""
    path = str(tmp_path / "b")
    spec = {"obs": mr.ArraySpec((48, 48), "uint8"), "step": mr.ArraySpec((), "int64")}
    mr.create(path, spec, capacity=50, num_envs=4, compression={"obs": codec}, chunk_steps=4).close()
    pattern = np.arange(4 * 48 * 48, dtype=np.int64).reshape(4, 48, 48)
    rng = np.random.default_rng(7)
    for run in range(4):
        proc = writers.start(ASYNC_WRITER, path, run)
        line = writers.kill_when(proc, _nth_commit(int(rng.integers(2, 12))))
        assert verify_cli(path) == (0, [])
        with mr.open(path) as reader:
            assert reader.total_steps >= int(line.split()[1])  # (a commit may come between)
            got = reader.get(slice(None))
            steps = got["step"][:, 0]
            assert steps.tolist() == list(range(reader.first_step, reader.total_steps))
            want = ((pattern[None] * (steps[:, None, None, None] + 1)) % 251).astype(np.uint8)
            np.testing.assert_array_equal(got["obs"], want)


def test_a_reader_reads_a_segment_being_sealed_from_staging_and_the_writer_its_rows_written_ahead(tmp_path, monkeypatch):
    from mmreplay.backends.row_frames import RowFrameLeaf

    started, release = threading.Event(), threading.Event()
    store_later = RowFrameLeaf._store_later

    class Held:
        """Segment 1's seal, begun once released (by the writer's thread, which looks at it)."""

        def __init__(self, leaf, *args):
            self.leaf, self.args, self.seal = leaf, args, None

        def _begun(self):
            if self.seal is None:
                self.seal = store_later(self.leaf, *self.args)
            return self.seal

        def done(self):
            return release.is_set() and self._begun().done()

        def result(self, timeout=None):
            assert release.wait(timeout)
            return self._begun().result()

    def held(self, k, frames, jobs):
        if k != 1:
            return store_later(self, k, frames, jobs)
        started.set()
        return Held(self, k, frames, jobs)

    monkeypatch.setattr(RowFrameLeaf, "_store_later", held)
    data = values(np.random.default_rng(4), 13, 2, (4,), "int32")
    path = tmp_path / "b"
    # 64 steps: the store's own commits that reserve slots ahead come every 8 steps
    store = mr.create(path, {"x": mr.ArraySpec((4,), "int32")}, 64, num_envs=2, compression="rows:lz4", chunk_steps=4)
    try:
        store.extend({"x": data[:7]})
        store.commit()  # steps 4..6 of segment 1 are in staging
        store.extend({"x": data[7:8]})  # step 7 ends segment 1: sealed in the background, held
        assert started.wait(30)
        store.extend({"x": data[8:11]})  # written ahead into segment 2
        assert not (path / "data.zarr" / "x" / "c" / "1" / "0" / "0").exists()
        np.testing.assert_array_equal(store.get(slice(None))["x"], data[:11])
        with mr.open(path) as reader:
            np.testing.assert_array_equal(reader.get(slice(None))["x"], data[:7])
            release.set()
            (leaf,) = store.stored_leaves
            leaf.sealing[1].result(timeout=30)
            # the next add moves the rows written ahead into staging and goes on there
            # (their frames, not encoded yet, come from where each row was written)
            store.extend({"x": data[11:12]})
            store.commit()
            reader.refresh()
            np.testing.assert_array_equal(reader.get(slice(None))["x"], data[:12])
            store.extend({"x": data[12:13]})  # ends segment 2: sealed
            store.commit()
            reader.refresh()
            np.testing.assert_array_equal(reader.get(slice(None))["x"], data[:13])
        np.testing.assert_array_equal(store.get(slice(None))["x"], data[:13])
    finally:
        release.set()
        store.close()
    with mr.open(path) as reader:
        np.testing.assert_array_equal(reader.get(slice(None))["x"], data[:13])
    assert zarr_array(path, "x")[:13].tolist() == data[:13].tolist()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("codec", CODECS)
def test_steps_added_one_by_one_while_segments_seal_slowly_read_back_after_commits_and_reopening(
    tmp_path, monkeypatch, codec, native
):
    """Per-step adds take a short way inside a segment, into staging or, while the segment
    before is still being sealed, ahead of it; sealing is slowed here so that the steps go
    ahead, through the ring's wrap, commits and a reopened writer, with the native encoder
    and the Python one."""
    from mmreplay.backends import native_rows, row_frames

    monkeypatch.setenv(native_rows.ENV, "1" if native else "0")
    store_later = row_frames.RowFrameLeaf._store_later

    class Slow:
        """A seal seen done 20 ms after it began at the soonest."""

        def __init__(self, seal):
            self.seal, self.at = seal, time.monotonic() + 0.02

        def done(self):
            return time.monotonic() >= self.at and self.seal.done()

        def result(self):
            threading.Event().wait(max(0.0, self.at - time.monotonic()))
            return self.seal.result()

    monkeypatch.setattr(row_frames.RowFrameLeaf, "_store_later", lambda self, *args: Slow(store_later(self, *args)))
    rng = np.random.default_rng(4)
    data = values(rng, 61, 2, (3, 5), "uint8")
    spec = {"x": mr.ArraySpec((3, 5), "uint8"), "y": mr.ArraySpec((), "float32")}
    ys = rng.random((61, 2)).astype(np.float32)
    path = tmp_path / "b"
    went_ahead = 0
    for a, b in ((0, 23), (23, 61)):
        opener = mr.create(path, spec, 13, num_envs=2, compression={"x": codec}, chunk_steps=4) if a == 0 else (
            mr.open(path, "a")
        )
        with opener as store:
            (leaf,) = [leaf for leaf in store.stored_leaves if leaf.info.path == "x"]
            for t in range(a, b):
                store.add({"x": data[t], "y": ys[t]})
                went_ahead += leaf.sealing is not None
                if t % 7 == 3:
                    store.commit()
                got = store.get(slice(None))
                np.testing.assert_array_equal(got["x"], data[max(0, t - 12) : t + 1])
                np.testing.assert_array_equal(got["y"], ys[max(0, t - 12) : t + 1])
            with mr.open(path) as reader:  # the committed steps, from another reader
                first, end = reader.window[:2]
                assert end == store.state.end
                np.testing.assert_array_equal(reader.get(slice(None))["x"], data[first:end])
    assert went_ahead > 5
    with mr.open(path) as reader:
        np.testing.assert_array_equal(reader.get(slice(None))["x"], data[48:])
    want = np.empty((13, 2, 3, 5), np.uint8)
    want[np.arange(48, 61) % 13] = data[48:]
    np.testing.assert_array_equal(np.asarray(zarr_array(path, "x")[:]), want)


def _drop_page_cache(folder: Path) -> None:
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@pytest.mark.parametrize("mapped", [True, False])
def test_a_cold_batch_asks_for_its_frames_and_indexes_together(tmp_path, monkeypatch, mapped):
    """A batch read from the disk asks for every frame's and shard index's pages before
    decoding (mapped shards, and shards read with pread past the budget): same values,
    counted as prefetched, no file descriptor left open."""
    from mmreplay.backends import row_reads as row_frames

    if not mapped:
        monkeypatch.setattr(row_frames, "MAPPED_SHARDS", 0)
        monkeypatch.setattr(row_frames, "OPEN_SHARDS", 0)
    path = tmp_path / "b"
    values = np.random.default_rng(1).integers(0, 3, (60, 2, 32, 32), dtype=np.uint8)
    spec = {"obs": mr.ArraySpec((32, 32), "uint8")}
    with mr.create(path, spec, 60, num_envs=2, compression="rows:lz4", chunk_steps=3) as store:
        store.extend({"obs": values})
    _drop_page_cache(path)
    fds = len(os.listdir("/proc/self/fd"))
    with mr.open(path) as reader:
        (leaf,) = reader.leaves
        ids = np.random.default_rng(0).permutation(120)  # every one of the 20 segments
        np.testing.assert_array_equal(leaf.take(ids), values.reshape(120, 32, 32)[ids])
        assert leaf.disk_reads.prefetched == 1  # the first batch counts as cold
        assert len(leaf.indexed) == 20 and leaf.mapped.all() == mapped
        np.testing.assert_array_equal(leaf.take(ids[::-1]), values.reshape(120, 32, 32)[ids[::-1]])
    assert len(os.listdir("/proc/self/fd")) == fds
