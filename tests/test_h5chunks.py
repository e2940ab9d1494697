"""Compressed HDF5 leaves: chunks rewritten in place behind a redo journal.

The file must stop growing once every chunk has its slot, a chunk torn by a killed
writer must be read from the journal (and written back by the next writer), and the
chunks mmreplay encodes must be plain HDF5 that h5py decodes and checks by itself.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import folder_digest, recover_cli, verify_cli

import mmreplay as mr
from mmreplay.backends.h5chunks import fletcher32, parse_journal, render_journal

SPEC = {"obs": mr.ArraySpec((32,), "float32"), "reward": mr.ArraySpec((), "float32")}
ENVS = 4
LAPS = 40


def rows(first: int, end: int) -> dict[str, np.ndarray]:
    """Steps [first, end): each row a function of its step, compressible, not constant."""
    ids = np.arange(first, end)
    obs = (ids[:, None, None] * 7 + np.arange(ENVS)[None, :, None] * 3 + np.arange(32)[None, None, :] // 5) % 97
    return {"obs": obs.astype(np.float32), "reward": np.repeat(ids[:, None], ENVS, 1).astype(np.float32)}


def check_exact(store, first: int, end: int) -> None:
    got = store.read_steps(np.arange(first, end))
    want = rows(first, end)
    assert np.array_equal(got[0], want["obs"]) and np.array_equal(got[1], want["reward"])


def codecs() -> list[str]:
    out = ["gzip"]
    try:
        import hdf5plugin  # noqa: F401

        out += ["zstd", "blosc"]
    except ImportError:
        pass
    return out


def chunk_where(path: str, leaf: str, k: int) -> tuple[int, int]:
    """(byte offset, stored length) of chunk ``k`` of a leaf in data.h5."""
    with h5py.File(os.path.join(path, "data.h5"), "r", libver="latest", swmr=True, locking=False) as f:
        dset = f[leaf]
        info = dset.id.get_chunk_info_by_coord((k * dset.chunks[0],) + (0,) * (dset.ndim - 1))
        return int(info.byte_offset), int(info.size)


def tear(path: str, leaf: str, k: int) -> None:
    """What a writer killed half way through rewriting chunk ``k`` in place leaves."""
    offset, size = chunk_where(path, leaf, k)
    with open(os.path.join(path, "data.h5"), "r+b") as f:
        f.seek(offset + size // 2)
        f.write(os.urandom(size - size // 2))


@pytest.mark.parametrize("length", [1, 2, 3, 4, 719, 720, 721, 4096, 100_001])
@pytest.mark.parametrize("fill", ["random", "zeros", "ones"])
def test_fletcher32_is_hdf5s(tmp_path, length, fill):
    data = {
        "random": np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8),
        "zeros": np.zeros(length, np.uint8),
        "ones": np.full(length, 255, np.uint8),
    }[fill]
    with h5py.File(tmp_path / "f.h5", "w") as f:
        dset = f.create_dataset("x", data=data, chunks=(length,), fletcher32=True)
        _, stored = dset.id.read_direct_chunk((0,))
    assert int.from_bytes(stored[-4:], "little") == fletcher32(stored[:-4])


@pytest.mark.parametrize("codec", codecs())
def test_file_stops_growing_as_the_ring_turns(tmp_path, codec):
    """A commit after every step re-encodes the head chunk each time and every chunk
    once a lap: before chunks were rewritten in place, each of those grew data.h5."""
    path = str(tmp_path / "b")
    data = os.path.join(path, "data.h5")
    sizes = []
    with mr.create(path, SPEC, capacity=64, num_envs=ENVS, backend="hdf5", compression=codec, chunk_steps=8) as store:
        for lap in range(LAPS):
            for g in range(lap * 64, (lap + 1) * 64):
                store.extend(rows(g, g + 1))
                store.commit()
            sizes.append(os.path.getsize(data))
        check_exact(store, LAPS * 64 - len(store), LAPS * 64)
    # a chunk moves to a larger slot (half as large again) only when it encodes longer
    # than its slot: after a few laps, a thousand more commits add not a byte
    assert len(set(sizes[LAPS // 2 :])) == 1, sizes
    raw = 64 * ENVS * 33 * 4
    assert sizes[-1] < 2 * raw + 64 * 1024, sizes  # slots are at most the raw chunk
    with h5py.File(data, "r") as f:  # plain h5py decodes (and checks) the padded chunks
        first = LAPS * 64 - 64
        order = np.argsort(np.arange(first, first + 64) % 64)
        assert np.array_equal(f["obs"][:], rows(first, first + 64)["obs"][order])


@pytest.mark.parametrize("codec", codecs())
def test_torn_chunk_is_read_from_the_journal_and_written_back(tmp_path, codec):
    path = str(tmp_path / "b")
    with mr.create(path, SPEC, capacity=64, num_envs=ENVS, backend="hdf5", compression=codec, chunk_steps=8) as store:
        store.extend(rows(0, 20))
        store.commit()
        store.extend(rows(20, 22))  # the head chunk, 16..23, is rewritten in place by this commit
        store.commit()
        tear(path, "obs", 2)
    with h5py.File(os.path.join(path, "data.h5"), "r") as f, pytest.raises(OSError):
        f["obs"][16:24]  # HDF5's own Fletcher-32 check sees the tear
    with mr.open(path) as reader:  # a reader falls back to the journal's copy
        check_exact(reader, 0, 22)
    assert verify_cli(path) == (0, [])  # the journal holds it: nothing is lost
    with mr.open(path, "a") as writer:  # the next writer writes it back
        check_exact(writer, 0, 22)
        writer.extend(rows(22, 30))
    with h5py.File(os.path.join(path, "data.h5"), "r") as f:
        assert np.array_equal(f["obs"][:30], rows(0, 30)["obs"])
    with mr.open(path) as reader:
        check_exact(reader, 0, 30)


def journaled(path: str) -> dict[str, set[int]]:
    from mmreplay.backends.h5chunks import Journal, journal_limits
    from mmreplay.metadata import read_metadata

    records = Journal(os.path.join(path, "data.h5"), journal_limits(read_metadata(path))).load()
    return {leaf: set(chunks) for leaf, chunks in records.items()}


def test_head_chunk_stays_journaled_across_writers(tmp_path):
    """The next writer stores the head chunk in place when its head leaves it, with no
    commit before: so every commit's journal must hold it, even one of a writer that
    never wrote to it (here one that only changed an old step with ``set``)."""
    path = str(tmp_path / "b")
    with mr.create(path, SPEC, capacity=64, num_envs=ENVS, backend="hdf5", compression="gzip", chunk_steps=8) as store:
        store.extend(rows(0, 20))  # the head is in chunk 2 (slots 16..23)
    assert journaled(path)["obs"] == {2}
    with mr.open(path, "a") as store:
        store.set(0, {key: value[0] for key, value in rows(0, 1).items()})  # chunk 0 only
    assert journaled(path)["obs"] == {0, 2}
    with mr.open(path, "a") as store:
        store.extend(rows(20, 26))  # chunk 2 is stored when the head leaves it, then committed
    # the head is in chunk 3 now; chunk 0, found in the journal, stays until it is rewritten
    assert journaled(path)["obs"] == {0, 3}
    with mr.open(path) as reader:
        check_exact(reader, 0, 26)


def test_tear_outside_the_journal_is_an_error_not_other_rows(tmp_path):
    path = str(tmp_path / "b")
    with mr.create(path, SPEC, capacity=64, num_envs=ENVS, backend="hdf5", compression="gzip", chunk_steps=8) as store:
        store.extend(rows(0, 20))
        store.commit()
        store.extend(rows(20, 22))
    tear(path, "obs", 0)  # chunk 0 was last written two commits ago: no journal copy
    with mr.open(path) as reader, pytest.raises(mr.CorruptBufferError, match="chunk 0"):
        reader.read_steps(np.arange(0, 8))
    code, problems = verify_cli(path)
    assert code == 1 and any("chunk 0" in p for p in problems), problems
    report = recover_cli(path)
    assert report.ok, str(report)


def test_damaged_journal_is_found_and_set_aside(tmp_path):
    path = str(tmp_path / "b")
    with mr.create(path, SPEC, capacity=64, num_envs=ENVS, backend="hdf5", compression="gzip", chunk_steps=8) as store:
        store.extend(rows(0, 20))
    journal = os.path.join(path, "data.h5.journal")
    with open(journal, "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0x10]))
    assert any("journal" in p and "checksum" in p for p in verify_cli(path)[1])
    before = folder_digest(path)
    with pytest.raises(mr.CorruptBufferError, match="journal"):
        mr.open(path, "a")
    assert folder_digest(path) == before  # a refused open changes nothing
    with mr.open(path) as reader:  # readers need the journal only for a torn chunk
        check_exact(reader, 0, 20)
    report = recover_cli(path)
    assert report.ok and report.lost is None, str(report)
    assert not os.path.exists(journal)
    with mr.open(path, "a") as writer:
        writer.extend(rows(20, 24))
        check_exact(writer, 0, 24)


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ({"../etc": {0: (0, b"x" * 10)}}, "not a compressed leaf"),
        ({"obs": {10**6: (0, b"x" * 10)}}, "chunk 1000000"),
        ({"obs": {0: (0, b"x" * (1 << 22))}}, "at most"),
    ],
)
def test_hostile_journal_is_refused_before_anything_is_written(tmp_path, records, message):
    path = str(tmp_path / "b")
    with mr.create(path, SPEC, capacity=64, num_envs=ENVS, backend="hdf5", compression="gzip", chunk_steps=8) as store:
        store.extend(rows(0, 20))
    with open(os.path.join(path, "data.h5.journal"), "wb") as f:
        f.write(render_journal(records))
    before = folder_digest(path)
    with pytest.raises(mr.CorruptBufferError, match=message):
        mr.open(path, "a")
    assert folder_digest(path) == before


def test_journal_format_round_trips():
    records = {"a/b": {0: (0, b"abcdef"), 7: (1, b"\x00" * 9)}, "c": {3: (0, b"xyzw!")}}
    limits = {"a/b": (8, 100), "c": (4, 100)}
    assert parse_journal(render_journal(records), "j", limits) == records
    raw = render_journal(records)
    with pytest.raises(mr.CorruptBufferError, match="checksum"):
        parse_journal(raw[:20] + bytes([raw[20] ^ 1]) + raw[21:], "j", limits)


def test_lzf_is_refused_in_the_hdf5_backend(tmp_path):
    with pytest.raises(mr.SpecError, match="lzf"):
        mr.create(str(tmp_path / "b"), SPEC, capacity=64, backend="hdf5", compression="lzf")
    assert not os.path.exists(tmp_path / "b")


def test_reader_process_during_in_place_rewrites(tmp_path):
    """Readers read the chunks a writer rewrites in place at every commit; each read is
    exact (a read that meets a chunk mid-rewrite is retried or served by the journal)."""
    path = str(tmp_path / "b")
    with mr.create(path, SPEC, capacity=256, num_envs=ENVS, backend="hdf5", compression="gzip", chunk_steps=16) as store:
        store.extend(rows(0, 16))
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import time, numpy as np, mmreplay as mr
ENVS = {ENVS}
{inspect.getsource(rows)}
store = mr.open({path!r})
# two seconds, and on until 11 reads (a loaded machine may give this process little time)
deadline, limit, reads = time.monotonic() + 2, time.monotonic() + 120, 0
while (time.monotonic() < deadline or reads <= 10) and time.monotonic() < limit:
    store.refresh()
    first, end = store.first_step, store.committed_steps
    ids = np.arange(max(first, end - 24), end)
    try:
        got = store.read_steps(ids)
    except mr.NotEnoughDataError:
        continue
    want = rows(ids[0], ids[-1] + 1)
    assert np.array_equal(got[0], want["obs"]) and np.array_equal(got[1], want["reward"]), ids
    reads += 1
print(reads)
""",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with mr.open(path, "a") as writer:
        g = 16
        while reader.poll() is None:
            writer.extend(rows(g, g + 1))
            writer.commit()
            g += 1
    out, err = reader.communicate()
    assert reader.returncode == 0, err
    assert int(out) > 10, out


@pytest.mark.parametrize("codec", codecs())
def test_chunk_switching_between_compressed_and_stored_raw_reads_back(tmp_path, codec):
    """Random bytes do not compress: HDF5 skips the filter and stores the chunk raw (a
    filter mask), and a rewrite of the same size keeps the old mask. A chunk that was
    compressed (its first rows, the rest zero) then full of random bytes, or the other
    way round, read back as a filter failure or as other bytes."""
    path = str(tmp_path / "b")
    rng = np.random.default_rng(0)
    spec = {"obs": mr.ArraySpec((20,), "uint8")}
    laps = [rng.integers(0, 256, (16, 3, 20), dtype=np.uint8), np.zeros((16, 3, 20), np.uint8)]
    laps += [rng.integers(0, 256, (16, 3, 20), dtype=np.uint8)]
    with mr.create(path, spec, capacity=16, num_envs=3, backend="hdf5", compression=codec, chunk_steps=4) as store:
        for lap, values in enumerate(laps):
            for t in range(16):
                store.add({"obs": values[t]})
                if t % 4 == 1:
                    store.commit()  # the head chunk half written: its rest is zero
            with mr.open(path) as reader:
                got = reader.read_steps(np.arange(16 * lap, 16 * (lap + 1)))[0]
            assert np.array_equal(got, values), f"lap {lap}"
            with h5py.File(os.path.join(path, "data.h5"), "r", libver="latest", swmr=True, locking=False) as f:
                assert np.array_equal(f["obs"][:], values), f"lap {lap}"
