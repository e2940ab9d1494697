"""The state file: two checksummed slots written in place, alternately; format-1 migration;
attributes paired with the state that committed them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import folder_digest
from v1format import to_v1

import mmreplay as mr
from mmreplay.metadata import METADATA_FILE, STATE_FILE, read_metadata
from mmreplay.statefile import FILE_BYTES, SLOT_BYTES, State, StateFile, decode_slot, encode_slot, fresh_bytes
from mmreplay.verify import recover, verify

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = {"x": mr.ArraySpec((3,), "int64"), "terminated": mr.ArraySpec((), "bool")}


def rows(lo: int, hi: int) -> dict:
    ids = np.arange(lo, hi)
    return {"x": np.repeat(ids, 3).reshape(-1, 1, 3), "terminated": (ids % 7 == 6).reshape(-1, 1)}


def make(path, n: int = 10, **kw) -> str:
    path = str(path)
    with mr.create(path, SPEC, capacity=kw.pop("capacity", 16), **kw) as store:
        store.extend(rows(0, n))
    return path


def slots(path) -> list:
    with open(os.path.join(path, STATE_FILE), "rb") as f:
        raw = f.read()
    assert len(raw) == FILE_BYTES
    return [decode_slot(raw, 0), decode_slot(raw, 1)]


def put_slot(path, index: int, data: bytes) -> None:
    with open(os.path.join(path, STATE_FILE), "r+b") as f:
        f.seek(index * SLOT_BYTES)
        f.write(data)


def digest(folder) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def test_commits_alternate_slots_and_keep_the_previous_state(tmp_path, layout):
    path = str(tmp_path / "b")
    json_before = None
    with mr.create(path, SPEC, capacity=16, commit_every=10**6, **layout) as store:
        json_before = open(os.path.join(path, METADATA_FILE), "rb").read()
        for t in range(6):
            previous = store.state
            store.extend(rows(t, t + 1))
            store.commit()
            now = store.state
            assert now.generation > previous.generation and now.end == t + 1
            found = slots(path)
            assert found[now.generation % 2] == now
            older = found[(now.generation + 1) % 2]  # the state write before, intact
            assert older.generation == now.generation - 1 and older.end <= now.end
            if now.generation == previous.generation + 1:  # one write: the previous state is kept
                assert older == previous
    assert open(os.path.join(path, METADATA_FILE), "rb").read() == json_before  # commits never rewrite it


def test_slot_bytes_round_trip_and_refuse_every_damage():
    state = State(3, 9, 12, 5, 1.5, 7, 4)
    data = encode_slot(state).ljust(SLOT_BYTES, b"\0")
    raw = b"\0" * SLOT_BYTES + data
    assert decode_slot(raw, 1) == state
    assert isinstance(decode_slot(raw, 0), str)  # zeros are no slot
    assert "generation 7 in slot 0" in decode_slot(data + b"\0" * SLOT_BYTES, 0)
    for i in range(len(encode_slot(state))):  # any flipped byte is found
        bad = bytearray(raw)
        bad[SLOT_BYTES + i] ^= 0x40
        found = decode_slot(bytes(bad), 1)
        if i < 68:  # the slot proper: refused
            assert isinstance(found, str), i
        else:  # its rewrites count: unknown, so a reader forgets every cached row
            assert found == replace(state, rewrites=None), i
    assert decode_slot(raw[: SLOT_BYTES + 20], 1) == "cut short"
    for absurd in (State(9, 1, 9, generation=1), State(0, 5, 3, generation=1), State(0, 1, 2**63, generation=1)):
        raw = b"\0" * SLOT_BYTES + encode_slot(absurd)  # checksummed, but impossible
        assert "impossible numbers" in decode_slot(raw, 1), absurd
    both = fresh_bytes(State(0, 0, 0, generation=1))
    assert [decode_slot(both, i).generation for i in (0, 1)] == [0, 1]


DAMAGE = {
    "zeroed": lambda old: bytes(len(old)),
    "garbage": lambda old: bytes(np.random.default_rng(0).integers(0, 256, len(old), dtype=np.uint8)),
    "torn": lambda old: old[:24] + bytes(len(old) - 24),  # a write cut after its first bytes
    "bit flip": lambda old: old[:30] + bytes([old[30] ^ 1]) + old[31:],
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_slot_falls_back_to_the_other(tmp_path, damage):
    path = make(tmp_path / "b", 10)
    with mr.open(path, "a") as store:
        store.extend(rows(10, 12))
        store.commit()
        newest, older = store.state, slots(path)[(store.state.generation + 1) % 2]
        store._closed = True  # leave without the closing commit, as a killed writer does
        for entry in store._closers:
            entry.close()
        store._state_file.close()
        store._lock.release()
    index = newest.generation % 2
    old = encode_slot(newest)
    put_slot(path, index, DAMAGE[damage](old))
    with mr.open(path) as reader:  # the previous commit is the committed state
        assert reader.state == older and reader.committed_steps == older.end
        ids = np.arange(reader.first_step, reader.committed_steps)
        x = reader.read_steps(ids)[reader.leaf_paths.index("x")]
        assert x[:, 0, 0].tolist() == ids.tolist()
    problems = verify(path)
    assert problems and all(f"state slot {index} is damaged" in p for p in problems), problems
    report = recover(path)
    assert report.ok and report.lost is None, str(report)
    assert any("rewrote the damaged slot" in a for a in report.actions)
    assert all(isinstance(s, State) for s in slots(path))
    assert verify(path) == []
    with mr.open(path, "a") as store:  # and the next writer goes on from the committed state
        assert store.total_steps == older.end
        store.extend(rows(older.end, older.end + 3))
    with mr.open(path) as reader:
        assert reader.committed_steps == older.end + 3


def test_both_slots_damaged_is_refused_then_rebuilt_empty(tmp_path):
    path = make(tmp_path / "b", 10)
    put_slot(path, 0, b"\xff" * 64)
    put_slot(path, 1, bytes(64))
    for mode in ("r", "a"):
        with pytest.raises(mr.CorruptBufferError, match="neither state slot is valid"):
            mr.open(path, mode)
    assert any("neither state slot" in p for p in verify(path))
    report = recover(path)
    assert report.ok, str(report)
    assert "lost committed steps" in str(report) and "unknown" in str(report)
    assert any(f"rebuilt {STATE_FILE}" in a for a in report.actions)
    assert verify(path) == []
    with mr.open(path, "a") as store:
        assert len(store) == 0
        g = store.total_steps
        store.extend(rows(g, g + 4))
    with mr.open(path) as reader:
        assert len(reader) == 4


@pytest.mark.parametrize("size", [SLOT_BYTES, SLOT_BYTES + 100, FILE_BYTES + 76])
def test_a_state_file_cut_short_or_grown_is_recovered_whole_losing_nothing(tmp_path, size):
    path = make(tmp_path / "b", 10)
    with open(os.path.join(path, STATE_FILE), "r+b") as f:
        f.truncate(size)  # zeros past the end when it grows
    with mr.open(path) as reader:
        committed = reader.committed_steps
    assert any(f"a state file has {FILE_BYTES}" in p for p in verify(path))
    report = recover(path)
    assert report.ok and report.lost is None, str(report)
    assert os.path.getsize(os.path.join(path, STATE_FILE)) == FILE_BYTES
    assert all(isinstance(s, State) for s in slots(path)) and verify(path) == []
    with mr.open(path) as reader:
        assert reader.committed_steps == committed  # (cut at one slot: the other slot's commit)


def test_a_missing_state_file_is_refused_and_rebuilt(tmp_path):
    path = make(tmp_path / "b", 10)
    os.remove(os.path.join(path, STATE_FILE))
    with pytest.raises(mr.CorruptBufferError, match="state file is missing"):
        mr.open(path)
    report = recover(path)
    assert report.ok and report.lost is not None, str(report)
    assert verify(path) == []


def test_a_reader_takes_the_newest_slot_per_check(tmp_path):
    path = str(tmp_path / "b")
    writer = mr.create(path, SPEC, capacity=8, commit_every=10**6)
    writer.extend(rows(0, 4))
    writer.commit()
    reader = mr.open(path)
    assert reader.committed_steps == 4
    for t in range(4, 20):
        writer.extend(rows(t, t + 1))
        writer.commit()
        assert reader.live_state() == writer.state  # one pread, the newest slot
    assert reader.refresh() and reader.committed_steps == 19 + 1
    assert reader.get(-1)["x"].tolist() == [[19, 19, 19]]
    writer.close()
    reader.close()


# --- format 1 --------------------------------------------------------------------------


def test_a_v1_buffer_is_read_without_writing_and_migrated_by_a_writer(tmp_path, layout):
    path = make(tmp_path / "b", 20, **layout)
    with mr.open(path, "a") as store:
        store.set_attrs(run="x", epoch=3)
    want = read_metadata(path)
    to_v1(path)
    before = digest(path)
    with mr.open(path) as reader:
        assert reader.metadata.format_version == 1
        assert (reader.first_step, reader.committed_steps) == (want.state.first(16), want.state.end)
        assert reader.attrs == {"run": "x", "epoch": 3}
        first = reader.first_step
        assert reader.get(slice(None))["x"][:, 0, 0].tolist() == list(range(first, 20))
        reader.sample(4, rng=0)
    assert verify(path) == []
    assert digest(path) == before  # readers and verify write nothing
    with mr.open(path, "a") as store:  # a writer migrates
        assert store.metadata.format_version == 2
        assert (store.first_step, store.committed_steps) == (want.state.first(16), 20)
        store.extend(rows(20, 22))
    meta = json.loads(open(os.path.join(path, METADATA_FILE)).read())
    assert meta["format"] == "mmreplay/2" and "state" not in meta
    with mr.open(path) as reader:
        assert reader.committed_steps == 22 and reader.attrs == {"run": "x", "epoch": 3}
        assert reader.get(slice(None))["x"][:, 0, 0].tolist() == list(range(reader.first_step, 22))
    assert verify(path) == []


@pytest.mark.parametrize("name", ["pointchase-zarr", "pointchase-pixels-hdf5", "pointchase-wrapped"])
def test_the_v1_reference_stores_open_and_migrate(tmp_path, name):
    """The stores in datasets/ were written by format 1's own code."""
    source = os.path.join(ROOT, "datasets", name)
    assert json.loads(open(os.path.join(source, METADATA_FILE)).read())["format"] == "mmreplay/1"
    path = str(tmp_path / name)
    shutil.copytree(source, path)
    with mr.open(path) as reader:
        want = reader.get(slice(None))
        window = (reader.first_step, reader.committed_steps)
        episodes = reader.episode_index()
    with mr.open(path, "a") as store:
        assert (store.first_step, store.committed_steps) == window
    assert os.path.exists(os.path.join(path, STATE_FILE))
    with mr.open(path) as reader:
        assert (reader.first_step, reader.committed_steps) == window
        assert reader.episode_index() == episodes
        got = reader.get(slice(None))
        for a, b in zip(mr.spec.flatten(want), mr.spec.flatten(got)):
            assert np.array_equal(a, b)
    assert verify(path) == []


def test_the_v1_fixture_script_writes_what_format_1_wrote(tmp_path):
    """Migrated and written back by tests/v1format.py, a reference store's metadata is
    byte for byte the file format 1's own code wrote (which had no checksum line yet)."""
    source = os.path.join(ROOT, "datasets", "pointchase-zarr")
    path = str(tmp_path / "b")
    shutil.copytree(source, path)
    mr.open(path, "a").close()  # migrates; the closing commit has nothing to write
    to_v1(path)
    with open(os.path.join(source, METADATA_FILE), "rb") as a, open(os.path.join(path, METADATA_FILE), "rb") as b:
        assert a.read() == re.sub(rb',\n "checksum": "crc32:[0-9a-f]{8}"', b"", b.read())


def test_a_v1_reader_follows_a_writer_that_migrates_the_buffer(tmp_path):
    path = make(tmp_path / "b", 10)
    to_v1(path)
    reader = mr.open(path)
    assert reader.committed_steps == 10
    with mr.open(path, "a") as store:
        store.extend(rows(10, 14))
        store.commit()
        assert reader.refresh() and reader.committed_steps == 14
    reader.refresh()
    assert reader.get(-1)["x"].tolist() == [[13, 13, 13]]
    reader.close()


def test_every_point_of_an_interrupted_migration_reads(tmp_path):
    """Migration writes the state file, then the format-2 JSON (each a rename); a crash
    leaves one of these folders, each of which reads as before and migrates again."""
    from mmreplay.metadata import atomic_write, render, write_fresh

    path = make(tmp_path / "b", 12)
    v2_meta = read_metadata(path)
    to_v1(path)
    v1_json = open(os.path.join(path, METADATA_FILE), "rb").read()
    state_tmp = os.path.join(path, f"{STATE_FILE}.999.tmp")
    json_tmp = os.path.join(path, f"{METADATA_FILE}.999.tmp")
    points = {
        "state file half written": lambda: open(state_tmp, "wb").write(b"\0" * 100),
        "state file renamed": lambda: write_fresh(path, v2_meta.state, False),
        "json half written": lambda: (
            write_fresh(path, v2_meta.state, False),
            open(json_tmp, "wb").write(render(v2_meta)[:50]),
        ),
    }
    for what, crash in points.items():
        for extra in (state_tmp, json_tmp, os.path.join(path, STATE_FILE)):
            if os.path.exists(extra):
                os.remove(extra)
        atomic_write(os.path.join(path, METADATA_FILE), v1_json)
        crash()
        with mr.open(path) as reader:
            assert reader.metadata.format_version == 1, what
            assert reader.committed_steps == 12, what
        with mr.open(path, "a") as store:
            assert store.committed_steps == 12 and store.metadata.format_version == 2, what
        assert [p for p in verify(path) if "temporary" not in p] == [], what
        with mr.open(path) as reader:
            assert reader.get(-1)["x"].tolist() == [[11, 11, 11]], what
        recover(path)  # removes the leftovers
        assert not os.path.exists(state_tmp) and not os.path.exists(json_tmp)


# --- attributes and crashes ------------------------------------------------------------

KILLED_IN_SET_ATTRS = """
import os, signal, numpy as np, mmreplay as mr
import mmreplay.statefile as sf
store = mr.open({path!r}, "a")
store.set_attrs(checkpoint=1)
real = sf.StateFile.write
def die(self, state, fsync):
    os.kill(os.getpid(), signal.SIGKILL)
sf.StateFile.write = die
store.set_attrs(checkpoint=2)
"""


def test_a_reader_sees_new_attrs_after_refresh(tmp_path, layout):
    """Attributes are committed with a state: a reader that picks the state up has them."""
    path = make(tmp_path / "b", 6, **layout)
    with mr.open(path, "a") as writer, mr.open(path) as reader:
        writer.set_attrs(step=1, run="a")
        assert reader.attrs == {}
        assert reader.refresh() and reader.attrs == {"step": 1, "run": "a"}
        writer.set_attrs(step=2, run=None)
        writer.extend(rows(6, 7))
        writer.commit()
        assert reader.refresh() and reader.attrs == {"step": 2}
        assert reader.committed_steps == writer.committed_steps == 7


def test_attrs_that_would_make_the_metadata_unreadable_are_refused(tmp_path):
    """The metadata file holds the new and the previous attributes; one past what a reader
    reads (64 MiB) left a buffer that no longer opened ("larger than a buffer's metadata
    can be"): it is refused, the buffer as it was."""
    path = make(tmp_path / "b", 3)
    with mr.open(path, "a") as writer:
        writer.set_attrs(a="x" * (22 << 20))
        before = folder_digest(path)
        with pytest.raises(mr.BadInputError, match="past the 67108864 a buffer's metadata may take"):
            writer.set_attrs(b="y" * (22 << 20))
        assert folder_digest(path) == before
        writer.set_attrs(c=1)  # (the previous attributes are 22 MiB, the new ones too)
    with mr.open(path) as reader:
        assert sorted(reader.attrs) == ["a", "c"] and len(reader.attrs["a"]) == 22 << 20


def test_attrs_written_but_not_committed_are_not_read(tmp_path, writers):
    path = make(tmp_path / "b", 5)
    code = textwrap.dedent(KILLED_IN_SET_ATTRS.format(path=path))
    writers.run_killed(code)
    on_disk = json.loads(open(os.path.join(path, METADATA_FILE)).read())
    assert on_disk["attrs"] == {"checkpoint": 2}  # written, never committed by a state
    with mr.open(path) as reader:
        assert reader.attrs == {"checkpoint": 1}
    with mr.open(path, "a") as store:
        assert store.attrs == {"checkpoint": 1}
        store.set_attrs(checkpoint=3)
    with mr.open(path) as reader:
        assert reader.attrs == {"checkpoint": 3}
    assert verify(path) == []


SET_ATTRS_LOOP = """
import os, sys, numpy as np, mmreplay as mr
store = mr.open({path!r}, "a")
for k in range(10**6):
    g = store.total_steps
    store.add({{"x": np.full((1, 3), g), "terminated": np.zeros(1, bool)}})
    store.commit()
    store.set_attrs(steps=g + 1, tag="k" * (k % 50))
    os.write(1, b"%d\\n" % (g + 1))
"""


@pytest.mark.parametrize("trials", [6, pytest.param(60, marks=pytest.mark.long)])
def test_attrs_under_random_kills_always_describe_a_commit(tmp_path, writers, trials):
    """Each round commits one step, then records the step count in the attributes; a
    kill anywhere leaves attributes that one commit (this or the one before) made."""
    path = make(tmp_path / "b", 1, commit_every=10**6)
    rng = np.random.default_rng(0)
    code = textwrap.dedent(SET_ATTRS_LOOP.format(path=path))
    for trial in range(trials):
        proc = writers.start(code)
        proc.stdout.readline()  # running
        time.sleep(float(rng.uniform(0, 0.05)))
        writers.kill(proc)
        with mr.open(path) as reader:
            end = reader.committed_steps
            steps = reader.attrs.get("steps")
            assert steps in (end, end - 1), (trial, steps, end)
            assert reader.get(-1)["x"].tolist() == [[end - 1] * 3]
        assert verify(path) == [], trial


# --- durability and the cost of a commit ------------------------------------------------

TRACED = """
import os, numpy as np, mmreplay as mr
store = mr.create({path!r}, {{"x": mr.ArraySpec((3,), "int64")}}, 64, backend={backend!r},
                  compression={compression!r}, chunk_steps=8, durability={durability!r}, commit_every=10**6)
store.add({{"x": np.ones((1, 3), "int64")}})
store.commit()
for t in range(3):
    store.add({{"x": np.full((1, 3), t)}})
    os.path.exists("/MARK-commit-start")
    store.commit()
    os.path.exists("/MARK-commit-end")
store._closed = True
"""


def _trace(tmp_path, backend, compression, durability) -> list[list[str]]:
    """The syscalls of three commits, one list per commit (``strace -y``)."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    path = str(tmp_path / f"{backend}-{compression}-{durability}")
    code = textwrap.dedent(TRACED.format(path=path, backend=backend, compression=compression, durability=durability))
    log = str(tmp_path / "trace.log")
    calls = "fsync,fdatasync,msync,pwrite64,write,rename,renameat,renameat2,stat,newfstatat,statx"
    done = subprocess.run(
        ["strace", "-f", "-y", "-o", log, "-e", f"trace={calls}", sys.executable, "-c", code], capture_output=True
    )
    if done.returncode != 0 and b"ptrace" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.decode()[-200:]}")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    commits, current = [], None
    for line in open(log):
        if "MARK-commit-start" in line:
            current = []
        elif "MARK-commit-end" in line:
            commits.append(current)
            current = None
        elif current is not None and "resumed" not in line and "stat" not in line.split("(")[0]:
            current.append(re.sub(r"^\d+\s+", "", line.strip()))
    assert len(commits) == 3
    return commits


@pytest.mark.parametrize(("backend", "compression"), [("zarr", None), ("hdf5", None), ("zarr", "zstd"), ("hdf5", "gzip")])
def test_a_process_durable_commit_is_one_pwrite_of_the_state_file(tmp_path, backend, compression):
    for calls in _trace(tmp_path, backend, compression, "process"):
        state_writes = [c for c in calls if STATE_FILE in c]
        assert len(state_writes) == 1 and state_writes[0].startswith("pwrite64("), calls
        assert not [c for c in calls if c.startswith(("fsync", "fdatasync", "msync"))], calls
        assert not [c for c in calls if METADATA_FILE in c], calls  # the JSON is never touched
        if compression is None:
            assert calls == state_writes, calls  # mapped rows: nothing else at all


@pytest.mark.parametrize(("backend", "compression"), [("zarr", None), ("hdf5", None), ("zarr", "zstd"), ("hdf5", "gzip")])
def test_a_power_durable_commit_syncs_the_data_then_the_state(tmp_path, backend, compression):
    for calls in _trace(tmp_path, backend, compression, "power"):
        state_write = next(i for i, c in enumerate(calls) if c.startswith("pwrite64(") and STATE_FILE in c)
        data_syncs = [i for i, c in enumerate(calls) if c.startswith(("fsync", "msync", "fdatasync")) and STATE_FILE not in c]
        assert data_syncs and max(data_syncs) < state_write, calls  # the rows reach the disk first
        after = calls[state_write + 1 :]
        assert after and after[0].startswith("fdatasync(") and STATE_FILE in after[0], calls
        assert not [c for c in calls if METADATA_FILE in c], calls


def test_rewrites_count_the_commits_that_rewrote_committed_rows_and_an_older_slot_reads_unknown(tmp_path):
    path = str(tmp_path / "b")
    with mr.create(path, {"x": mr.ArraySpec((), "int64")}, capacity=8) as store:
        store.extend({"x": np.arange(4).reshape(4, 1)})
        store.commit()
        assert StateFile(path, False).read().rewrites == 0
        store.set(1, {"x": np.array([9])})
        store.commit()
        assert StateFile(path, False).read().rewrites == 1
        store.add({"x": np.array([5])})
        store.commit()
        state = StateFile(path, False).read()
        assert state.rewrites == 1 and state.end == 5
    # a version without the count writes the slot alone, in place, over a slot whose
    # count belongs to an older generation
    raw = bytearray(open(os.path.join(path, STATE_FILE), "rb").read())
    newer = replace(state, generation=state.generation + 2, end=6, reserved=max(state.reserved, 6))
    at = (newer.generation % 2) * SLOT_BYTES
    raw[at : at + 68] = encode_slot(newer)[:68]
    assert decode_slot(bytes(raw), newer.generation % 2) == replace(newer, rewrites=None)
