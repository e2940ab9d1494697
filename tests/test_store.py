"""The store on every backend layout: writes, ring, get/set, reopen, kill -9, readers, lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import zarr
from conftest import LAYOUT_KWARGS, folder_digest, make_step, spread

import mmreplay as mr
from mmreplay.metadata import read_metadata
from mmreplay.spec import flatten

ALL_DTYPES = ["bool", "uint8", "int32", "int64", "float16", "float32", "float64"]


def assert_step_equal(got, want):
    for a, b in zip(flatten(got), flatten(want)):
        np.testing.assert_array_equal(a, b)




def test_add_extend_and_read_back(tmp_path, layout, nested_spec):
    with mr.create(tmp_path / "b", nested_spec, capacity=16, num_envs=3, chunk_steps=4, **layout) as store:
        for t in range(5):
            store.add(make_step(nested_spec, 3, t))
        batch = [make_step(nested_spec, 3, t) for t in range(5, 9)]
        store.extend({k: (np.stack([b[k] for b in batch]) if not isinstance(v, dict) else {kk: np.stack([b[k][kk] for b in batch]) for kk in v}) for k, v in nested_spec.items()})
        store.commit()
        assert len(store) == 9 and store.total_steps == 9 and store.committed_steps == 9
        for t in range(9):
            assert_step_equal(store.get(t), make_step(nested_spec, 3, t))
        got = store.get(slice(2, 5))
        assert got["obs"]["pixels"].shape == (3, 3, 4, 4, 3)
        np.testing.assert_array_equal(got["reward"], np.stack([make_step(nested_spec, 3, t)["reward"] for t in range(2, 5)]))
    with mr.open(tmp_path / "b") as reader:
        assert len(reader) == 9
        assert_step_equal(reader.get(-1), make_step(nested_spec, 3, 8))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_common_dtype_round_trips(tmp_path, layout, dtype):
    spec = {"x": mr.ArraySpec((3,), dtype), "s": mr.ArraySpec((), dtype)}
    rng = np.random.default_rng(0)
    rows = [
        {k: (rng.integers(0, 2, (2, *s.shape)).astype(dtype) if dtype == "bool" else (rng.random((2, *s.shape)) * 100).astype(dtype)) for k, s in spec.items()}
        for _ in range(7)
    ]
    with mr.create(tmp_path / "b", spec, capacity=5, num_envs=2, chunk_steps=2, **layout) as store:
        for r in rows:
            store.add(r)
    with mr.open(tmp_path / "b") as store:
        assert len(store) == 5 and store.first_step == 2
        for i in range(5):
            got = store.get(i)
            assert got["x"].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(got["x"], rows[2 + i]["x"])
            np.testing.assert_array_equal(got["s"], rows[2 + i]["s"])


def test_nan_is_data(tmp_path, layout):
    spec = {"x": mr.ArraySpec((2,), "float32")}
    with mr.create(tmp_path / "b", spec, capacity=4, **layout) as store:
        store.add({"x": np.array([[np.nan, np.inf]], "float32")})
    with mr.open(tmp_path / "b") as store:
        x = store.get(0)["x"]
        assert np.isnan(x[0, 0]) and np.isinf(x[0, 1])


def test_ring_wrap_keeps_the_newest_capacity_steps(tmp_path, layout, nested_spec):
    with mr.create(tmp_path / "b", nested_spec, capacity=5, num_envs=2, chunk_steps=2, commit_every=3, **layout) as store:
        for t in range(13):
            store.add(make_step(nested_spec, 2, t))
    with mr.open(tmp_path / "b", "a") as store:
        assert len(store) == 5 and store.total_steps == 13 and store.first_step == 8 and store.cursor == 3
        for i in range(5):
            assert_step_equal(store.get(i), make_step(nested_spec, 2, 8 + i))
        # extend across the physical end of the ring, and more than a ring at once
        ext = [make_step(nested_spec, 2, t) for t in range(13, 25)]
        store.extend(stack(nested_spec, ext))
        store.commit()
        assert store.total_steps == 25 and len(store) == 5
        for i in range(5):
            assert_step_equal(store.get(i), make_step(nested_spec, 2, 20 + i))


def stack_like(value, steps):
    """Stack steps along their own structure (extra and missing keys included)."""
    if isinstance(value, dict):
        return {k: stack_like(v, [s[k] for s in steps]) for k, v in value.items()}
    return np.stack([np.asarray(s) for s in steps]) if value is not None else None


def stack(spec, steps):
    return {k: stack(v, [s[k] for s in steps]) if isinstance(v, dict) else np.stack([s[k] for s in steps]) for k, v in spec.items()}


def test_an_index_out_of_range_in_a_writer_counts_the_steps_it_holds(tmp_path):
    """A writer reads every step it added, committed or not: the refusal counts those
    (it said "for 3 committed steps" with none committed)."""
    with mr.create(tmp_path / "b", {"x": mr.ArraySpec((), "int64")}, capacity=8, commit_every=100) as store:
        store.extend({"x": np.zeros((3, 1), "int64")})
        assert store.committed_steps == 0
        with pytest.raises(IndexError, match="index 5 out of range for 3 retained steps"):
            store.get(5)
        with pytest.raises(IndexError, match="index out of range for 3 retained steps"):
            store.set([0, 7], {"x": np.zeros((2, 1), "int64")})


def test_get_and_set_follow_numpy_storage_indexing(tmp_path, layout):
    spec = {"a": mr.ArraySpec((2,), "int64"), "b": mr.ArraySpec((), "float32")}
    with mr.create(tmp_path / "b", spec, capacity=4, commit_every=1, **layout) as store:
        for t in range(6):
            store.add({"a": np.full((1, 2), t), "b": np.full((1,), t, "float32")})
        assert store.get(0)["a"].tolist() == [[2, 2]]
        assert store.get(-1)["a"].tolist() == [[5, 5]]
        assert store.get([0, 3])["b"].tolist() == [[2.0], [5.0]]
        assert store.get(np.array([-1]))["b"].tolist() == [[5.0]]
        assert store.get([])["a"].shape == (0, 1, 2)  # an empty list: no steps, as numpy reads it
        store.set([], {"a": np.zeros((0, 1, 2), "int64"), "b": np.zeros((0, 1), "float32")})
        with pytest.raises(IndexError):
            store.get(4)
        with pytest.raises(IndexError):
            store.get(-5)
        store.set(1, {"a": np.array([[30, 31]]), "b": np.array([3.5], "float32")})
        store.set(slice(2, 4), {"a": np.full((2, 1, 2), 9), "b": np.zeros((2, 1), "float32")})
        returned = store.get(1)
        returned["a"][:] = -1  # a copy: changing it changes nothing stored
    with mr.open(tmp_path / "b") as store:
        assert store.get(1)["a"].tolist() == [[30, 31]] and store.get(1)["b"].tolist() == [3.5]
        assert store.get(slice(None))["a"][:, 0, 0].tolist() == [2, 30, 9, 9]


def test_a_bare_leaf_spec_stores_plain_arrays(tmp_path, layout):
    with mr.create(tmp_path / "b", mr.ArraySpec((2,), "int32"), capacity=4, num_envs=3, **layout) as store:
        store.add(np.ones((3, 2), "int32"))
        store.extend(np.full((2, 3, 2), 5, "int32"))
        with pytest.raises(mr.BadInputError, match="leaf 'value'"):
            store.add(np.ones((2, 2), "int32"))
    with mr.open(tmp_path / "b") as store:
        assert store.leaf_paths == ["value"]
        assert store.get(0).tolist() == [[1, 1]] * 3 and store.get(slice(None)).shape == (3, 3, 2)


def test_clear_drops_retained_steps_and_keeps_counting(tmp_path, layout):
    spec = {"x": mr.ArraySpec((), "int32")}
    with mr.create(tmp_path / "b", spec, capacity=4, **layout) as store:
        for t in range(3):
            store.add({"x": np.array([t], "int32")})
        store.clear()
        assert len(store) == 0 and store.total_steps == 3
        store.add({"x": np.array([7], "int32")})
    with mr.open(tmp_path / "b") as store:
        assert len(store) == 1 and store.get(0)["x"].tolist() == [7] and store.total_steps == 4


def test_clear_to_a_slot_moves_the_cursor_there(tmp_path, layout):
    spec = {"x": mr.ArraySpec((), "int32")}
    with mr.create(tmp_path / "b", spec, capacity=4, chunk_steps=2, **layout) as store:
        store.extend({"x": np.arange(3, dtype="int32")[:, None]})
        for bad in (4, True, -1):
            with pytest.raises(mr.BadInputError, match=rf"next_slot must be a slot in \[0, 4\), got {bad}"):
                store.clear(next_slot=bad)
        assert len(store) == 3
        store.clear(next_slot=0)
        assert (len(store), store.total_steps, store.cursor) == (0, 4, 0)
        store.extend({"x": np.array([[7], [8]], "int32")})
        store.clear(next_slot=1)  # the next slot past the cursor: one step on
        assert (len(store), store.total_steps, store.cursor) == (0, 9, 1)
        store.add({"x": np.array([9], "int32")})
    with mr.open(tmp_path / "b") as store:
        assert (len(store), store.total_steps, store.cursor) == (1, 10, 2)
        assert store.get(0)["x"].tolist() == [9]
        assert store.read_steps([9])[0].tolist() == [[9]]


def test_files_are_plain_zarr_and_hdf5(tmp_path, layout, nested_spec):
    path = tmp_path / "b"
    with mr.create(path, nested_spec, capacity=6, num_envs=2, chunk_steps=4, **layout) as store:
        for t in range(6):
            store.add(make_step(nested_spec, 2, t))
    want = np.stack([make_step(nested_spec, 2, t)["obs"]["pixels"] for t in range(6)])
    if layout["backend"] == "zarr":
        arr = zarr.open_array(str(path / "data.zarr" / "obs" / "pixels"), mode="r")
        np.testing.assert_array_equal(arr[:], want)
    else:
        with h5py.File(path / "data.h5", "r") as f:
            np.testing.assert_array_equal(f["obs/pixels"][:], want)


def test_metadata_is_versioned_json(tmp_path, nested_spec):
    with mr.create(tmp_path / "b", nested_spec, capacity=8, num_envs=2, roles={"truncated": "truncated"}) as store:
        store.add(make_step(nested_spec, 2, 0))
    meta = json.loads((tmp_path / "b" / "mmreplay.json").read_text())
    assert meta["format"] == "mmreplay/2" and meta["capacity"] == 8 and meta["num_envs"] == 2
    assert "state" not in meta  # the committed state is in the state file
    assert read_metadata(str(tmp_path / "b")).state.end == 1
    assert meta["roles"]["observation"] == "obs" and meta["roles"]["reward"] == "reward"
    assert [leaf["path"] for leaf in meta["leaves"]] == ["action", "obs/pixels", "obs/state", "reward", "terminated", "truncated"]


def test_state_on_disk_always_covers_the_slots_being_overwritten(tmp_path, layout):
    """Ring overwrite never exposes torn rows: before a slot of a committed step is
    written, the state on disk already excludes that step (reserved > written id)."""
    spec = {"x": mr.ArraySpec((3,), "int64")}
    path = tmp_path / "b"
    with mr.create(path, spec, capacity=8, commit_every=5, chunk_steps=2, **layout) as store:
        for t in range(40):
            store.add({"x": np.full((1, 3), t)})
            on_disk = read_metadata(str(path)).state
            assert on_disk.reserved >= store.total_steps
            lo = on_disk.first(8)
            # every step the disk state calls committed is intact
            for g in range(lo, on_disk.end):
                assert store._leaves[0].read(g % 8).tolist() == [[g, g, g]]
        store.extend({"x": np.arange(40, 60).repeat(3).reshape(20, 1, 3)})
        on_disk = read_metadata(str(path)).state
        assert on_disk.reserved >= 60


def test_reader_window_excludes_reserved_slots_until_close(tmp_path):
    spec = {"x": mr.ArraySpec((), "int64")}
    path = tmp_path / "b"
    store = mr.create(path, spec, capacity=16, commit_every=4)
    for t in range(20):
        store.add({"x": np.array([t])})
    reader = mr.open(path)
    assert len(reader) < 16  # the writer reserved slots ahead of the cursor
    first = reader.first_step
    assert reader.get(0)["x"].tolist() == [first]
    store.close()
    reader.refresh()
    assert len(reader) == 16 and reader.get(0)["x"].tolist() == [4]
    reader.close()


def test_power_durability_commits(tmp_path, layout):
    spec = {"x": mr.ArraySpec((2,), "float32")}
    with mr.create(tmp_path / "b", spec, capacity=10, durability="power", commit_every=2, **layout) as store:
        for t in range(5):
            store.add({"x": np.full((1, 2), t, "float32")})
        assert store.committed_steps == 4
    with mr.open(tmp_path / "b") as store:
        assert len(store) == 5


def test_per_leaf_compression_and_chunking(tmp_path):
    spec = {"pix": mr.ArraySpec((8, 8), "uint8"), "r": mr.ArraySpec((), "float32")}
    with mr.create(tmp_path / "b", spec, capacity=32, compression={"pix": "blosc:lz4:5"}, chunk_steps={"pix": 4}) as store:
        for t in range(10):
            store.add({"pix": np.full((1, 8, 8), t, "uint8"), "r": np.array([t], "float32")})
        leaves = {leaf.path: leaf for leaf in store.metadata.leaves}
        assert leaves["pix"].compression == "blosc:lz4:5" and leaves["pix"].chunk_steps == 4 and not leaves["pix"].mapped
        assert leaves["r"].compression is None and leaves["r"].mapped
    with mr.open(tmp_path / "b") as store:
        assert store.get(-1)["pix"][0, 0, 0] == 9


def test_automatic_chunking_is_a_few_mib(tmp_path):
    spec = {"pix": mr.ArraySpec((84, 84, 4), "uint8"), "r": mr.ArraySpec((), "float32")}
    with mr.create(tmp_path / "b", spec, capacity=10_000, num_envs=8) as store:
        leaves = {leaf.path: leaf for leaf in store.metadata.leaves}
        pix_chunk = leaves["pix"].chunk_steps * 8 * 84 * 84 * 4
        assert 1 << 20 <= pix_chunk <= 8 << 20
        assert leaves["r"].chunk_steps == 10_000  # a whole small leaf is one chunk


# --- creation and opening ---------------------------------------------------------


def test_create_refuses_an_existing_path_unless_exist_ok(tmp_path):
    spec = {"x": mr.ArraySpec(())}
    mr.create(tmp_path / "b", spec, capacity=4).close()
    with pytest.raises(mr.BufferExistsError, match="exist_ok"):
        mr.create(tmp_path / "b", spec, capacity=4)
    with mr.create(tmp_path / "b", spec, capacity=4, exist_ok=True) as store:
        store.add({"x": np.zeros(1, "float32")})
    with pytest.raises(mr.SpecMismatchError, match="capacity: existing 4 vs new 5"):
        mr.create(tmp_path / "b", spec, capacity=5, exist_ok=True)
    with pytest.raises(mr.SpecMismatchError, match="spec"):
        mr.create(tmp_path / "b", {"y": mr.ArraySpec(())}, capacity=4, exist_ok=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(mr.BufferExistsError):
        mr.create(tmp_path / "file", spec, capacity=4)


def test_exist_ok_refuses_what_is_not_a_buffer_and_says_so(tmp_path):
    spec = {"x": mr.ArraySpec(())}
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "notes.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "folder", tmp_path / "file"):
        with pytest.raises(mr.BufferExistsError, match="not a buffer") as err:
            mr.create(path, spec, capacity=4, exist_ok=True)
        assert "pass exist_ok=True" not in str(err.value)  # it was passed
    assert sorted(os.listdir(tmp_path / "folder")) == ["notes.txt"]


def test_exist_ok_reopens_with_the_backend_left_out(tmp_path):
    """A backend not named takes the one there, whatever the default is here."""
    spec = {"obs": mr.ArraySpec((2,))}
    path = tmp_path / "b"
    mr.create(path, spec, capacity=4, backend="hdf5").close()
    with mr.create(path, spec, capacity=4, exist_ok=True) as store:
        assert store.backend == "hdf5"
    before = folder_digest(path)
    with pytest.raises(mr.SpecMismatchError, match="backend: existing hdf5 vs new zarr"):
        mr.create(path, spec, capacity=4, backend="zarr", exist_ok=True)
    assert folder_digest(path) == before


def test_exist_ok_refuses_a_setting_named_that_differs_from_the_buffers(tmp_path):
    """A setting left out takes the buffer's; one named must match it, since a reopen
    that ignored it (a prioritized sampler, power durability) would mislead."""
    spec = {"obs": mr.ArraySpec((2,)), "reward": mr.ArraySpec(()), "bonus": mr.ArraySpec(())}
    made = dict(
        backend="zarr", chunk_steps=4, compression="zstd", commit_every=5, durability="power",
        roles={"reward": "bonus"}, sampler="prioritized", alpha=0.5,
    )
    path = tmp_path / "b"
    mr.create(path, spec, capacity=8, **made).close()
    with mr.create(path, spec, capacity=8, exist_ok=True) as store:  # nothing named
        assert (store.metadata.durability, store.metadata.commit_every, store.sampler.alpha) == ("power", 5, 0.5)
    with mr.create(path, spec, capacity=8, exist_ok=True, **made) as store:  # all named alike
        assert store.metadata.leaves[0].compression == "zstd"
    before = folder_digest(path)
    for name, other, match in [
        ("chunk_steps", 2, "chunk_steps: existing {'bonus': 4"),
        ("compression", None, None),  # None is "not named": the buffer's
        ("compression", {"obs": "zstd"}, "compression: existing {'bonus': 'zstd', 'obs': 'zstd', 'reward': 'zstd'"),
        ("commit_every", 6, "commit_every: existing 5 vs new 6"),
        ("durability", "process", "durability: existing power vs new process"),
        ("roles", {"reward": "reward"}, "'reward': 'bonus'} vs new {'observation': 'obs', 'reward': 'reward'}"),
        ("sampler", "uniform", "sampler: existing {'name': 'prioritized'"),
        ("alpha", 0.6, "'alpha': 0.5.* vs new .*'alpha': 0.6"),
    ]:
        kwargs = {**made, name: other}
        if kwargs["sampler"] == "uniform":
            del kwargs["alpha"]
        if match is None:
            mr.create(path, spec, capacity=8, exist_ok=True, **kwargs).close()
            continue
        with pytest.raises(mr.SpecMismatchError, match=match):
            mr.create(path, spec, capacity=8, exist_ok=True, **kwargs)
    assert folder_digest(path) == before


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_exist_ok_refused_after_a_kill_changes_nothing_on_disk(tmp_path, writers, backend):
    """A writer killed mid-run leaves its reservation in the state file; a reopen refused
    for a different layout must not commit over it (as opening a writer, then closing it,
    would): the folder is as the dead writer left it."""
    path = tmp_path / "b"
    code = textwrap.dedent(f"""
        import sys, numpy as np, mmreplay as mr
        store = mr.create(sys.argv[1], {{"x": mr.ArraySpec((), "int64")}}, 10, backend={backend!r}, commit_every=3)
        for i in range(5):
            store.add({{"x": np.array([i])}})
        print("added", flush=True)
        sys.stdin.read()
    """)
    writers.kill_when(writers.start(code, path, stdin=subprocess.PIPE), lambda line: line == "added\n")
    before = folder_digest(path)
    with pytest.raises(mr.SpecMismatchError, match="capacity: existing 10 vs new 11"):
        mr.create(path, {"x": mr.ArraySpec((), "int64")}, 11, exist_ok=True)
    assert folder_digest(path) == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 4, "num_envs": 0}, "num_envs"),
        ({"capacity": 4, "backend": "sqlite"}, "backend"),
        ({"capacity": 4, "durability": "maybe"}, "durability"),
        ({"capacity": 4, "compression": "snappy"}, "compression"),
        ({"capacity": 4, "compression": {"nope": "zstd"}}, "not in the spec"),
        ({"capacity": 4, "chunk_steps": 0}, "chunk_steps"),
        ({"capacity": 4, "roles": {"reward": "missing"}}, "not in the spec"),
        ({"capacity": 4, "roles": {"colour": "x"}}, "unknown role"),
        ({"capacity": 4, "roles": {"reward": 3}}, "role 'reward' must name a leaf path"),
        ({"capacity": 4, "roles": ["reward"]}, "roles must map a role to a leaf path"),
        ({"capacity": 2**62}, "leaf 'x': 4611686018427387904 steps .* past the"),
        ({"capacity": 2**62, "backend": "hdf5"}, "leaf 'x': 4611686018427387904 steps .* past the"),
        # a misspelt keyword is a sampler option: named as such, not as the sampler's TypeError
        ({"capacity": 4, "num_env": 2}, r"\['num_env'\]: not create's, nor options of the 'uniform' sampler"),
        ({"capacity": 4, "sampler": "prioritized", "alfa": 0.5}, r"\['alfa'\]: .*\(alpha, beta, eps,"),
    ],
)
def test_create_validates_arguments_before_touching_disk(tmp_path, kwargs, match):
    with pytest.raises(mr.Error, match=match):
        mr.create(tmp_path / "b", {"x": mr.ArraySpec(())}, **kwargs)
    assert os.listdir(tmp_path) == []


def test_an_inferred_role_that_does_not_fit_says_how_to_keep_the_leaf(tmp_path):
    """A vector reward (multi-objective RL) named "reward" is no reward role: the refusal
    says how to store it anyway."""
    spec = {"obs": mr.ArraySpec((3,)), "reward": mr.ArraySpec((2,))}
    with pytest.raises(mr.SpecError, match=r"roles=\{'reward': None\}"):
        mr.create(tmp_path / "b", spec, 4)
    with mr.create(tmp_path / "b", spec, 4, roles={"reward": None}) as store:
        assert store.roles == {"observation": "obs"}


def test_disk_too_small_is_reported_at_creation(tmp_path):
    spec = {"pix": mr.ArraySpec((1024, 1024), "uint8")}
    with pytest.raises(mr.DiskFullError, match="needs .* bytes"):
        mr.create(tmp_path / "b", spec, capacity=10_000_000, num_envs=8)
    assert os.listdir(tmp_path) == []


def test_open_errors(tmp_path):
    with pytest.raises(mr.NotABufferError, match="no such folder"):
        mr.open(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(mr.NotABufferError, match="not an mmreplay buffer"):
        mr.open(tmp_path / "empty")
    with pytest.raises(ValueError, match="mode"):
        mr.open(tmp_path / "empty", mode="w")


def test_readers_cannot_write_and_closed_stores_say_so(tmp_path):
    spec = {"x": mr.ArraySpec(())}
    mr.create(tmp_path / "b", spec, capacity=4).close()
    store = mr.open(tmp_path / "b")
    with pytest.raises(mr.ReadOnlyError, match="mode='a'"):
        store.add({"x": np.zeros(1, "float32")})
    assert "mode='r'" in repr(store)
    store.close()
    store.close()  # safe twice
    assert repr(store).startswith("<closed mmreplay.Store")
    with pytest.raises(mr.ClosedError):
        store.get(0)
    for method in (store.live_state, store.live_first, store.refresh):  # not the closed file's error
        with pytest.raises(mr.ClosedError, match="store is closed"):
            method()


# --- bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s.pop("reward"), "missing 'reward'"),
        (lambda s: s.update(extra=np.zeros(2)), "unexpected 'extra'"),
        (lambda s: s["obs"].pop("state"), "missing 'obs/state'"),
        (lambda s: s.update(action=np.zeros((2, 3), "int64")), "leaf 'action': expected .*\\(2, 2\\), got shape \\(2, 3\\)"),
        (lambda s: s.update(reward=np.zeros(3, "float32")), "leaf 'reward'.*got shape \\(3,\\)"),
        (lambda s: s.update(action=np.zeros((2, 2), "float32")), "leaf 'action'.*float32 to int64 is not safe"),
        (lambda s: s["obs"].update(pixels=np.full((2, 4, 4, 3), 300)), "leaf 'obs/pixels'.*do not fit uint8"),
        (lambda s: s.update(terminated=np.zeros(2, "int64")), "leaf 'terminated'.*not safe"),
        (lambda s: s.update(reward=None), "leaf 'reward'.*got None"),
        (lambda s: s.update(reward=["a", "b"]), "leaf 'reward'.*<U1"),
        (lambda s: s.update(reward=np.array([object(), 1], dtype=object)), "leaf 'reward'.*object"),
        (lambda s: s.update(obs=np.zeros(3)), "obs: expected a dict"),
    ],
)
def test_bad_steps_raise_named_errors_and_change_nothing(tmp_path, layout, nested_spec, mutate, match):
    path = tmp_path / "b"
    store = mr.create(path, nested_spec, capacity=4, num_envs=2, **layout)
    store.add(make_step(nested_spec, 2, 0))
    store.commit()
    before = folder_digest(path)
    step = make_step(nested_spec, 2, 1)
    mutate(step)
    with pytest.raises(mr.BadInputError, match=match):
        store.add(step)
    with pytest.raises(mr.BadInputError):
        store.extend(stack_like(step, [step, step]))
    assert store.total_steps == 1
    store.commit()
    assert folder_digest(path) == before
    store.close()


def test_safe_casts_are_accepted(tmp_path):
    spec = {"f": mr.ArraySpec((), "float32"), "i": mr.ArraySpec((), "uint8"), "b": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "b", spec, capacity=4, num_envs=2) as store:
        store.add({"f": np.array([1.5, 2.5]), "i": [3, 255], "b": [True, False]})  # float64, Python ints, list
        store.commit()
        got = store.get(0)
        assert got["f"].dtype == np.float32 and got["i"].tolist() == [3, 255] and got["b"].tolist() == [True, False]


# --- other processes: kill -9, readers, the lock ----------------------------------

WRITER = textwrap.dedent(
    """
    import sys, numpy as np, mmreplay as mr
    path, backend, compression = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = {"x": mr.ArraySpec((6,), "float32"), "t": mr.ArraySpec((), "int64")}
    store = mr.create(path, spec, capacity=50, num_envs=4, backend=backend,
                      compression=None if compression == "none" else compression,
                      chunk_steps=8, commit_every=10_000, exist_ok=True)
    t = store.total_steps
    while True:
        for _ in range(7):
            rows = np.arange(4)[:, None] * 1000.0 + t
            store.add({"x": np.repeat(rows, 6, axis=1).astype("float32"), "t": np.full(4, t)})
            t += 1
        store.commit()
        print(store.committed_steps, flush=True)
    """
)


def check_rows(store):
    assert len(store) > 0
    steps = np.arange(store.first_step, store.committed_steps)
    t, x = store.read_steps(steps)
    np.testing.assert_array_equal(t, np.repeat(steps[:, None], 4, axis=1))
    want = (np.arange(4)[None, :] * 1000.0 + steps[:, None]).astype("float32")
    np.testing.assert_array_equal(x, np.repeat(want[:, :, None], 6, axis=2))


# every layout is killed and resumed in test_crash.py's torture, and read beside a writer
# process in test_concurrency.py
@pytest.mark.parametrize("layout", spread(LAYOUT_KWARGS, normal=["zarr-zstd", "hdf5-mapped"]))
def test_committed_rows_survive_kill_9_and_collection_resumes(tmp_path, layout, writers):
    path = str(tmp_path / "b")
    compression = layout["compression"] or "none"
    for round_ in range(2):
        proc = writers.start(WRITER, path, layout["backend"], compression)
        reported = 0
        for _ in range(12 + round_ * 5):  # past the ring's end on the second round
            reported = int(proc.stdout.readline())
        writers.kill(proc)
        with mr.open(path) as store:
            assert store.committed_steps >= reported
            check_rows(store)
    with mr.open(path, "a") as store:
        assert store.total_steps == store.committed_steps
        check_rows(store)


READER = textwrap.dedent(
    """
    import sys, numpy as np, mmreplay as mr
    store = mr.open(sys.argv[1])
    seen = 0
    while seen < int(sys.argv[2]):
        store.refresh()
        if len(store) == 0:
            continue
        steps = np.arange(store.first_step, store.committed_steps)
        try:
            t, x = store.read_steps(steps)
        except mr.NotEnoughDataError:
            continue  # overwritten by the ring while being read: read again
        assert (t == steps[:, None]).all(), "stale or torn row"
        want = (np.arange(4)[None, :] * 1000.0 + steps[:, None]).astype("float32")
        assert (x == want[:, :, None]).all(), "torn row"
        seen = max(seen, store.committed_steps)
    print(seen)
    """
)


@pytest.mark.parametrize("layout", spread(LAYOUT_KWARGS, normal=["zarr-mapped", "hdf5-gzip"]))
def test_reader_process_sees_only_committed_bit_exact_rows(tmp_path, layout, writers):
    path = str(tmp_path / "b")
    compression = layout["compression"] or "none"
    writers.start(WRITER, path, layout["backend"], compression).stdout.readline()
    out = subprocess.run([sys.executable, "-c", READER, path, "150"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) >= 150


def test_second_writer_is_refused_with_the_holders_pid(tmp_path):
    path = str(tmp_path / "b")
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, path, "zarr", "none"], stdout=subprocess.PIPE, text=True
    )
    proc.stdout.readline()
    try:
        with pytest.raises(mr.LockedError, match=f"process {proc.pid}"):
            mr.open(path, "a")
        with pytest.raises(mr.LockedError):
            mr.create(path, {"x": mr.ArraySpec((6,), "float32"), "t": mr.ArraySpec((), "int64")}, capacity=50, num_envs=4, exist_ok=True)
        with mr.open(path) as reader:  # readers need no lock
            assert len(reader) > 0
    finally:
        proc.kill()
        proc.wait()
    with mr.open(path, "a") as store:  # the dead holder's lock went with its process
        assert store.mode == "a"



FORKED_WORKER = """
import multiprocessing, os, signal, sys, time, numpy as np, mmreplay as mr
def work():  # an env worker, a data loader...: outlives the writer by a while
    time.sleep(60)
if __name__ == "__main__":
    store = mr.create(sys.argv[1], {"x": mr.ArraySpec((), "int64")}, capacity=10)
    store.add({"x": np.arange(1)})
    store.commit()
    worker = multiprocessing.get_context("fork").Process(target=work)
    worker.start()
    print(worker.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_worker_of_a_killed_writer_does_not_hold_its_lock(tmp_path, writers):
    """A process forked from the writer shares its lock file: its copy must not keep the
    buffer locked (and blame the dead writer) once the writer is gone."""
    path = str(tmp_path / "b")
    proc = writers.start(FORKED_WORKER, path)
    worker = int(proc.stdout.readline())
    assert proc.wait() == -signal.SIGKILL
    try:
        with mr.open(path, "a") as store:
            store.add({"x": np.arange(1)})
        with mr.open(path) as store:
            assert store.committed_steps == 2
    finally:
        os.kill(worker, signal.SIGKILL)



HDF5_READER = """
import sys, mmreplay as mr
store = mr.open(sys.argv[1])  # a learner, opened while no writer had the file open
print(len(store), flush=True)
sys.stdin.readline()
store.refresh()
print(len(store), store.get(-1)["x"].tolist(), flush=True)
"""


def test_an_hdf5_writer_resumes_while_a_reader_process_holds_the_file(tmp_path, writers):
    """HDF5's own file lock, taken by a reader that opened a compressed hdf5 store while
    no writer had it, kept every writer out (said as a damaged file)."""
    path = str(tmp_path / "b")
    spec = {"x": mr.ArraySpec((4,), "float32")}
    with mr.create(path, spec, capacity=32, backend="hdf5", compression="gzip") as store:
        store.extend({"x": np.zeros((5, 1, 4), "float32")})
    reader = writers.start(HDF5_READER, path, stdin=subprocess.PIPE)
    assert reader.stdout.readline().split() == ["5"]
    with mr.open(path, "a") as store:
        store.add({"x": np.ones((1, 4), "float32")})
    reader.stdin.write("\n")
    reader.stdin.flush()
    assert reader.stdout.readline().split() == ["6", "[[1.0,", "1.0,", "1.0,", "1.0]]"]


PROBE = """
import sys, time
from mmreplay.lock import holder_pid
print("probing", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    holder_pid(sys.argv[1])
"""


def test_a_writer_opens_while_another_process_asks_who_holds_the_lock(tmp_path):
    """``holder_pid`` (verify, an HDF5 open) takes the lock shared for an instant; a writer
    opening in that instant is not refused as if another process wrote."""
    path = str(tmp_path / "b")
    mr.create(path, {"x": mr.ArraySpec((), "int64")}, capacity=10).close()
    probe = subprocess.Popen([sys.executable, "-c", PROBE, path, "60"], stdout=subprocess.PIPE, text=True)
    try:
        probe.stdout.readline()
        for _ in range(300):
            mr.open(path, "a").close()
    finally:
        probe.kill()
        probe.wait()


def test_same_process_second_writer_is_refused(tmp_path):
    spec = {"x": mr.ArraySpec(())}
    with mr.create(tmp_path / "b", spec, capacity=4):
        with pytest.raises(mr.LockedError, match=f"process {os.getpid()}"):
            mr.open(tmp_path / "b", "a")


def test_create_makes_missing_parent_folders(tmp_path):
    path = tmp_path / "run" / "seed-0" / "buffer"
    with mr.create(path, {"x": mr.ArraySpec((), "int64")}, capacity=10) as store:
        store.add({"x": np.ones(1, "int64")})
    with mr.open(path) as store:
        assert len(store) == 1
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="found a file"):
        mr.create(tmp_path / "file" / "deeper" / "buffer", {"x": mr.ArraySpec((), "int64")}, capacity=10)
    assert sorted(os.listdir(tmp_path)) == ["file", "run"]


def test_a_failed_create_leaves_no_new_parent_folders(tmp_path):
    """Preallocation fails (a 1 MiB file size limit), after the folders were made."""
    code = textwrap.dedent(
        f"""
        import resource, mmreplay as mr
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
        try:
            mr.create({str(tmp_path / "run" / "buffer")!r}, {{"x": mr.ArraySpec((1024,), "uint8")}}, capacity=4096)
        except mr.DiskFullError as exc:
            print(exc)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ulimit -f" in done.stdout, done.stdout + done.stderr
    assert os.listdir(tmp_path) == []


CREATE_RACE = """
import os, sys, time, mmreplay as mr
root, trials = sys.argv[1], int(sys.argv[2])
print("ready", flush=True)
for i in range(trials):
    while not os.path.exists(os.path.join(root, f"go{i}")):  # both processes start together
        time.sleep(0.0002)
    try:
        mr.create(os.path.join(root, f"b{i}"), {"x": mr.ArraySpec((3,), "float32")}, capacity=64,
                  exist_ok=i % 2 == 1).close()
        print("created or opened", flush=True)
    except mr.BufferExistsError:
        print("exists", flush=True)
    except mr.LockedError:
        print("locked", flush=True)  # exist_ok: the other process still writes the one it made
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}".replace("\\n", " "), flush=True)
"""


def _create_race(tmp_path, trials: int) -> None:
    """Two processes create the same buffers at the same moment: the loser is told the
    buffer exists (or, with exist_ok, opens it), never a raw file-system error."""
    procs = [
        subprocess.Popen([sys.executable, "-c", CREATE_RACE, str(tmp_path), str(trials)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        for p in procs:  # both imported mmreplay and wait
            assert p.stdout.readline() == "ready\n"
        pairs = []
        for i in range(trials):  # each round once both said how the last one went
            (tmp_path / f"go{i}").touch()
            pairs.append(tuple(p.stdout.readline().strip() for p in procs))
        for p in procs:
            p.communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, pair in enumerate(pairs):
        assert sorted(pair) in (["created or opened", "exists"], ["created or opened", "created or opened"],
                                ["created or opened", "locked"]), (i, pair)
        assert i % 2 == 1 or sorted(pair) == ["created or opened", "exists"], (i, pair)
        with mr.open(tmp_path / f"b{i}") as store:
            assert store.capacity == 64


def test_two_processes_creating_one_buffer_at_once(tmp_path):
    _create_race(tmp_path, 16)


@pytest.mark.long
def test_two_processes_creating_one_buffer_at_once_long(tmp_path):
    _create_race(tmp_path, 400)
