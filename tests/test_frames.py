"""Each frame stored once: every read path returns what a store that kept everything does.

The same random episodes (many envs, terminations, timeouts, frame stacks, ring wrap,
commits at random points) go to a store that keeps every leaf and to one created with
``frames=Frames(...)``; every way of reading them is compared.
"""

from __future__ import annotations

import glob
import json
import os

import h5py
import numpy as np
import pytest
from conftest import run_cli
from frames_episodes import Episodes, spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmreplay as mr
from mmreplay.read import read_rows

FRAME = (5, 6)


def _stores(
    tmp_path, num_envs, k, axis, pad, capacity, final_slots=None, backend="zarr", commit_every=1000, **kw
):
    sp = spec(FRAME, k, axis)
    full = mr.create(
        tmp_path / "full", sp, capacity, num_envs=num_envs, backend=backend, commit_every=commit_every
    )
    frames = mr.Frames(frame_stack=k, pad=pad, final_slots=final_slots)
    once = mr.create(
        tmp_path / "once",
        sp,
        capacity,
        num_envs=num_envs,
        backend=backend,
        frames=frames,
        commit_every=commit_every,
        **kw,
    )
    return full, once


def _same(a, b, what):
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), what
        for key in a:
            _same(a[key], b[key], f"{what}/{key}")
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    assert np.array_equal(a, b), f"{what}: values differ"


def _compare_window(full, once, what=""):
    """Rows, samples and sequences of ``once``'s readable window, read from both."""
    first, end = once.window[:2]
    assert full.window.first <= first and end == full.window.end, (full.window, once.window)
    if end == first:
        return
    steps = np.arange(first, end)
    for p, a, b in zip(full.leaf_paths, full.read_steps(steps), once.read_steps(steps)):
        _same(a, b, f"{what} read_steps {p}")
    _same(full.sample(40, rng=3, window=(first, end)), once.sample(40, rng=3), f"{what} sample")
    nstep = mr.NStep(3, gamma=0.9)  # its bootstrap observations too
    _same(
        full.sample(40, rng=3, window=(first, end), transform=nstep),
        once.sample(40, rng=3, transform=nstep),
        f"{what} n-step sample",
    )
    n = min(4, end - first)
    _same(
        full.sample(9, num_steps=n, rng=4, window=(first, end)),
        once.sample(9, num_steps=n, rng=4),
        f"{what} sample(num_steps={n})",
    )
    rng = np.random.default_rng(5)
    s, e = rng.integers(first, end, 7), rng.integers(0, once.num_envs, 7)
    _same(read_rows(full, s, e), read_rows(once, s, e), f"{what} read_rows")


def _compare_all(full, once):
    """Every read path, for stores whose windows are the same."""
    assert full.window[:2] == once.window[:2]
    _compare_window(full, once)
    _same(full.get(slice(None)), once.get(slice(None)), "get")
    for kw in ({}, {"batch_size": 3}, {"num_steps": 3, "batch_size": 2}, {"num_steps": 2, "window_shift": 1}):
        for i, (a, b) in enumerate(zip(full.iterate(**kw), once.iterate(**kw), strict=True)):
            _same(a, b, f"iterate({kw}) batch {i}")
    for a, b in zip(full.episodes(), once.episodes(), strict=True):
        assert (a.env, a.first_step, a.last_step, a.status) == (b.env, b.first_step, b.last_step, b.status)
        _same(a.data, b.data, f"episode {a.env} {a.first_step}")
    _same(full.to_arrays(), once.to_arrays(), "to_arrays")


_RANDOM = dict(
    num_envs=st.integers(1, 3),
    k=st.sampled_from([1, 2, 4]),
    axis=st.sampled_from([-1, 0]),
    pad=st.sampled_from(["repeat", "zeros"]),
    end=st.sampled_from([0.0, 0.1, 0.5]),
    capacity=st.integers(4, 24),
    steps=st.integers(1, 50),
    commits=st.sets(st.integers(0, 49), max_size=6),
    small_side=st.booleans(),
    seed=st.integers(0, 2**16),
)
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=12, **_SETTINGS)
@given(**_RANDOM)
def test_random_episodes_read_the_same_as_a_store_that_keeps_everything(tmp_path_factory, **case):
    _random_case(tmp_path_factory, **case)


@pytest.mark.long
@settings(max_examples=400, **_SETTINGS)
@given(**_RANDOM)
def test_many_random_episodes_read_the_same_as_a_store_that_keeps_everything(tmp_path_factory, **case):
    _random_case(tmp_path_factory, **case)


def _random_case(tmp_path_factory, num_envs, k, axis, pad, end, capacity, steps, commits, small_side, seed):
    tmp_path = tmp_path_factory.mktemp("frames")
    slots = 2 * num_envs if small_side else 10_000
    full, once = _stores(tmp_path, num_envs, k, axis, pad, capacity, final_slots=slots)
    episodes = Episodes(num_envs, FRAME, k, axis, pad, end, seed)
    for t in range(steps):
        step = episodes.step()
        full.add(step)
        once.add(step)
        if t in commits:
            once.commit()
            full.commit()
            with mr.open(tmp_path / "once") as reader:  # a reader sees the committed prefix
                assert reader.window.end == t + 1
                _compare_window(full, reader, "reader")
    _compare_window(full, once, "writer")
    if not small_side and (k == 1 or steps <= capacity):  # nothing dropped: the same window
        _compare_all(full, once)
    once.close()
    with mr.open(tmp_path / "once", "a", continue_episodes=True) as again:  # a writer reopened takes up the episodes
        _compare_window(full, again, "reopened")
        for _ in range(5):
            step = episodes.step()
            full.add(step)
            again.add(step)
        _compare_window(full, again, "resumed")
    full.close()


def test_every_read_path_and_export_matches_over_many_envs_timeouts_and_commits(tmp_path):
    full, once = _stores(tmp_path, 3, 4, -1, "repeat", 64, final_slots=1000, commit_every=7)
    episodes = Episodes(3, FRAME, 4, -1, "repeat", 0.15, 11)
    for _ in range(60):
        step = episodes.step()
        full.add(step)
        once.add(step)
    ends = once.get(slice(None))
    assert ends["terminated"].any() and ends["truncated"].any()
    _compare_all(full, once)
    for fmt in ("npz", "hdf5", "d4rl", "zarr", "csv", "parquet", "pt", "minari", "d3rlpy"):
        try:
            a = mr.export(full, tmp_path / f"full-{fmt}", format=fmt)
            b = mr.export(once, tmp_path / f"once-{fmt}", format=fmt)
        except ImportError:
            continue
        _same_export(a.path, b.path, fmt)
    full.close()
    once.close()


def _same_export(a: str, b: str, fmt: str) -> None:
    """The exported files hold the same arrays (files that name their own path aside)."""

    def files(root: str) -> list[str]:
        """The files under a folder export, relative to it; [""] for a one-file export."""
        if not os.path.isdir(root):
            return [""]
        found = glob.glob(os.path.join(root, "**"), recursive=True)
        return sorted(os.path.relpath(p, root) for p in found if os.path.isfile(p))

    files_a, files_b = files(a), files(b)
    assert files_a == files_b, fmt
    for rel in files_a:
        pa, pb = os.path.join(a, rel) if rel else a, os.path.join(b, rel) if rel else b
        if pa.endswith(".npz"):
            with np.load(pa) as x, np.load(pb) as y:
                assert sorted(x) == sorted(y)
                for key in x:
                    if key != "metadata":
                        _same(x[key], y[key], f"{fmt} {key}")
        elif h5py.is_hdf5(pa):
            _same(_h5_arrays(pa), _h5_arrays(pb), f"{fmt} {rel}")
        elif pa.endswith(".json"):
            continue  # names the source buffer and the time
        elif fmt == "pt":
            import torch

            x, y = torch.load(pa, weights_only=True), torch.load(pb, weights_only=True)
            _same(_numpy(x), _numpy(y), f"{fmt} {rel}")
        elif pa.endswith(".parquet"):
            import pyarrow.parquet as pq

            assert pq.read_table(pa).equals(pq.read_table(pb)), f"{fmt} {rel}"
        elif pa.endswith(".csv"):
            with open(pa) as x, open(pb) as y:
                assert x.read() == y.read(), f"{fmt} {rel}"
        elif "/zarr.json" in "/" + rel or rel.endswith("zarr.json"):
            continue
        else:
            with open(pa, "rb") as x, open(pb, "rb") as y:
                assert x.read() == y.read(), f"{fmt} {rel}"


def _numpy(x):
    if isinstance(x, dict):
        return {k: _numpy(v) for k, v in x.items() if k != "metadata"}
    return x.numpy() if hasattr(x, "numpy") else x


def _h5_arrays(path: str) -> dict:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
        )
    return {k: v for k, v in out.items() if not (isinstance(v, bytes) and b"/" in v)}


def test_frames_once_keeps_one_frame_per_row_and_records_the_layout(tmp_path):
    sp = spec((84, 84), 4, -1)
    with mr.create(tmp_path / "b", sp, 100, num_envs=2, frames=mr.Frames(frame_stack=4)) as store:
        assert store.spec["obs"].shape == (84, 84, 4)
        stored = {leaf.path: leaf.spec.shape for leaf in store.metadata.leaves}
        assert stored["obs"] == (84, 84) and "next_obs" not in stored
    with open(tmp_path / "b" / "mmreplay.json") as f:
        recorded = json.load(f)["frames"]
    assert recorded["frame_stack"] == 4 and recorded["next_observation"] == "derived"
    assert recorded["pairs"] == [{"observation": "obs", "next_observation": "next_obs", "stack_axis": 2}]
    with mr.create(tmp_path / "plain", sp, 10):  # stores without frames are as before
        pass
    with open(tmp_path / "plain" / "mmreplay.json") as f:
        assert "frames" not in json.load(f)


def test_a_stack_that_does_not_follow_is_refused_and_changes_nothing(tmp_path):
    sp = spec(FRAME, 3, 0)
    with mr.create(tmp_path / "b", sp, 10, frames=mr.Frames(frame_stack=3)) as store:
        episodes = Episodes(1, FRAME, 3, 0, "repeat", 0.0, 0)
        store.add(episodes.step())
        step = episodes.step()
        bad = dict(step, obs=step["obs"].copy())
        bad["obs"][0, 0] += 1  # the oldest frame is not the previous stack's second
        with pytest.raises(mr.BadInputError, match="shifted by one frame"):
            store.add(bad)
        bad = dict(step, next_obs=step["next_obs"].copy())
        bad["next_obs"][0, 0] += 1
        with pytest.raises(mr.BadInputError, match="next observation stack"):
            store.add(bad)
        assert store.total_steps == 1
        store.add(step)
        _same(store.get(-1)["obs"], step["obs"], "obs after refused adds")
        with pytest.raises(mr.BadInputError, match="each frame once"):
            store.set(0, dict(store.get(0), obs=store.get(1)["obs"]))
        store.set(0, dict(store.get(0), truncated=np.array([True])))  # the other leaves can be set
        assert store.get(0)["truncated"].all() and not store.get(1)["truncated"].any()


@pytest.mark.parametrize("next_observation", ["derived", "stored"])
@pytest.mark.parametrize("axis", [0, -1])
def test_an_extend_whose_later_stack_does_not_follow_adds_none_of_its_steps(tmp_path, next_observation, axis):
    """extend wrote the steps before the one refused, though a refused batch changes nothing."""
    sp = spec(FRAME, 3, axis)
    if next_observation == "stored":
        del sp["next_obs"]
    frames = mr.Frames(frame_stack=3, next_observation=next_observation)
    with mr.create(tmp_path / "b", sp, 20, num_envs=2, frames=frames) as store:
        episodes = Episodes(2, FRAME, 3, axis, "repeat", 0.0, 0)
        steps = [{k: v for k, v in episodes.step().items() if k in sp} for _ in range(6)]
        store.add(steps[0])
        batch = {k: np.stack([s[k] for s in steps[1:]]) for k in sp}
        bad = dict(batch, obs=batch["obs"].copy())
        bad["obs"][3, 1].flat[0] += 1  # env 1's stack of the batch's step 3 follows nothing
        with pytest.raises(mr.BadInputError, match=r"step 3 of the 5.*env 1: a frame stack must be"):
            store.extend(bad)
        assert store.total_steps == 1
        store.extend(batch)
        _same(store.read_steps(np.arange(6))[store.leaf_paths.index("obs")], np.stack([s["obs"] for s in steps]), "obs")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_depth_stacks_with_nan_pixels_are_taken_and_read_back_bit_for_bit(tmp_path, dtype):
    """A depth camera's missing returns are NaN: a repeated first frame, a stack that
    follows and an unchanged row given to set() compare their NaN pixels equal."""
    sp = spec((6, 8), 4, -1)
    sp["obs"] = sp["next_obs"] = mr.ArraySpec((6, 8, 4), dtype)
    full = mr.create(tmp_path / "full", sp, 12, num_envs=2)
    once = mr.create(tmp_path / "once", sp, 12, num_envs=2, frames=mr.Frames(frame_stack=4))
    rng = np.random.default_rng(0)

    def frame() -> np.ndarray:
        f = rng.uniform(0.2, 5.0, (2, 6, 8)).astype(dtype)
        f[:, 0, :3] = np.nan
        f[:, 1, 0] = -0.0
        return f

    obs = np.repeat(frame()[..., None], 4, axis=-1)
    for t in range(30):
        nxt = np.concatenate([obs[..., 1:], frame()[..., None]], axis=-1)
        ends = np.array([t % 7 == 6, t % 5 == 4])
        step = {"obs": obs, "next_obs": nxt, "action": np.zeros((2, 2), "float32"),
                "reward": np.zeros(2, "float32"), "terminated": ends, "truncated": np.zeros(2, bool)}  # fmt: skip
        full.add(step)
        once.add(step)
        obs = np.where(ends[:, None, None, None], np.repeat(frame()[..., None], 4, axis=-1), nxt)
    first, end = once.window[:2]
    steps = np.arange(first, end)
    bits = f"u{np.dtype(dtype).itemsize}"
    for p, a, b in zip(full.leaf_paths, full.read_steps(steps), once.read_steps(steps)):
        assert np.array_equal(a.view(bits) if a.dtype == dtype else a, b.view(bits) if b.dtype == dtype else b), p
    once.set(0, dict(once.get(0), truncated=np.array([True, False])))  # frames unchanged, NaN and all
    assert once.get(0)["truncated"].tolist() == [True, False]
    full.close()
    once.close()


def test_a_full_side_ring_drops_the_oldest_steps_never_a_wrong_frame(tmp_path):
    full, once = _stores(tmp_path, 2, 1, -1, "repeat", 50, final_slots=4)
    episodes = Episodes(2, FRAME, 1, -1, "repeat", 0.5, 3)
    for _ in range(30):
        step = episodes.step()
        full.add(step)
        once.add(step)
    assert once.window.first > full.window.first  # the ends' frames pushed the oldest steps out
    _compare_window(full, once)
    once.commit()
    with mr.open(tmp_path / "once") as reader:
        assert reader.window.first == once.window.first
        _compare_window(full, reader, "reader")


def test_side_entries_of_steps_the_ring_already_overwrote_are_reused_without_a_warning(tmp_path, caplog):
    """Many more episode ends over a run than ``final_slots``, but few within one ring's
    worth of steps: reusing a side slot whose step the ring has overwritten loses nothing."""
    full, once = _stores(tmp_path, 2, 1, -1, "repeat", 20)
    episodes = Episodes(2, FRAME, 1, -1, "repeat", 0.1, 5)
    with caplog.at_level("WARNING", logger="mmreplay"):
        for _ in range(300):
            step = episodes.step()
            full.add(step)
            once.add(step)
    assert once.metadata.frames.final_slots < once._frames.seq  # the side ring went round
    assert not [r for r in caplog.records if "side ring" in r.getMessage()]
    assert once.window.first == full.window.first
    _compare_window(full, once)


def test_wrong_layouts_are_refused_at_creation(tmp_path):
    sp = spec(FRAME, 4, -1)
    with pytest.raises(mr.SpecError, match="no axis of frame_stack=3"):
        mr.create(tmp_path / "a", sp, 10, frames=mr.Frames(frame_stack=3))
    with pytest.raises(mr.SpecError, match="final_slots"):
        mr.create(tmp_path / "b", sp, 10, num_envs=4, frames=mr.Frames(frame_stack=4, final_slots=3))
    no_next = {k: v for k, v in sp.items() if k != "next_obs"}
    with pytest.raises(mr.SpecError, match="next_observation role"):
        mr.create(tmp_path / "c", no_next, 10, frames=mr.Frames())
    assert not os.path.exists(tmp_path / "a")


def test_a_damaged_frames_record_is_refused(tmp_path):
    with mr.create(tmp_path / "b", spec(FRAME, 2, 0), 10, frames=mr.Frames(frame_stack=2)):
        pass
    path = tmp_path / "b" / "mmreplay.json"
    obj = json.loads(path.read_text())
    obj.pop("checksum")
    obj["frames"]["frame_stack"] = 3
    path.write_text(json.dumps(obj))
    with pytest.raises(mr.CorruptBufferError, match="frames"):
        mr.open(tmp_path / "b")


def test_hdf5_and_compressed_leaves_store_frames_once_too(tmp_path):
    for backend, compression in (("hdf5", None), ("zarr", "zstd")):
        full, once = _stores(
            tmp_path / f"{backend}-{compression}",
            2,
            2,
            0,
            "repeat",
            12,
            backend=backend,
            compression=compression,
            commit_every=5,
            final_slots=100,
        )
        episodes = Episodes(2, FRAME, 2, 0, "repeat", 0.2, 7)
        for _ in range(20):
            step = episodes.step()
            full.add(step)
            once.add(step)
        _compare_window(full, once, backend)
        once.commit()
        with mr.open(once.path) as reader:
            _compare_window(full, reader, f"{backend} reader")
        full.close()
        once.close()


def test_gymnasium_recorders_and_torch_datasets_read_the_same(tmp_path):
    """A vector env recorded into both kinds of store at once; the torch datasets over
    them, and the gymnasium recorders' own stores, hold the same values."""
    gymnasium = pytest.importorskip("gymnasium")
    torch = pytest.importorskip("torch")
    from mmreplay.compat.gymnasium import RecordVectorTransitions
    from mmreplay.compat.torch import StoreDataset

    envs = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1", max_episode_steps=15)] * 3)
    inner = RecordVectorTransitions(envs, tmp_path / "full", capacity=200)
    outer = RecordVectorTransitions(inner, tmp_path / "once", capacity=200, frames=mr.Frames(final_slots=300))
    outer.reset(seed=0)
    for _ in range(60):
        outer.step(outer.action_space.sample())
    outer.close()
    inner.close()
    with mr.open(tmp_path / "full") as full, mr.open(tmp_path / "once") as once:
        assert once.frames is not None and full.frames is None
        assert once.episode_index(complete_only=True)  # episodes ended (by time limit or falling)
        _compare_all(full, once)
    for num_steps in (None, 4):
        a, b = StoreDataset(tmp_path / "full", num_steps), StoreDataset(tmp_path / "once", num_steps)
        assert len(a) == len(b)
        for i in range(0, len(a), 7):
            x, y = a[i], b[i]
            for key in x:
                assert torch.equal(x[key], y[key]), (num_steps, i, key)


def test_convert_copies_a_frames_store_into_one_that_keeps_every_leaf(tmp_path):
    from mmreplay.convert import convert

    with mr.create(
        tmp_path / "a", spec(FRAME, 4, -1), 30, num_envs=2, frames=mr.Frames(frame_stack=4)
    ) as store:
        episodes = Episodes(2, FRAME, 4, -1, "repeat", 0.05, 0)
        for _ in range(40):
            store.add(episodes.step())
    convert(tmp_path / "a", tmp_path / "b", backend="hdf5")
    with mr.open(tmp_path / "a") as src, mr.open(tmp_path / "b") as copy:
        assert copy.frames is None and copy.window[:2] == src.window[:2]
        _compare_window(copy, src)


def test_a_copy_compresses_the_derived_next_observations_as_their_frames_were(tmp_path):
    """compression="same" (the default): next_obs, kept as its observation's frames, gets
    that leaf's codec and chunking, not uncompressed stacks of four."""
    pytest.importorskip("zstandard")
    pytest.importorskip("cramjam")
    from mmreplay.convert import convert

    with mr.create(
        tmp_path / "a", spec(FRAME, 4, -1), 30, num_envs=2, chunk_steps=6,
        compression={"obs": "rows:zstd:3"}, frames=mr.Frames(frame_stack=4),
    ) as store:  # fmt: skip
        episodes = Episodes(2, FRAME, 4, -1, "repeat", 0.05, 0)
        for _ in range(40):
            store.add(episodes.step())
    convert(tmp_path / "a", tmp_path / "b")
    with mr.open(tmp_path / "a") as src, mr.open(tmp_path / "b") as copy:
        kept = {leaf.path: (leaf.compression, leaf.chunk_steps) for leaf in copy.metadata.leaves}
        assert kept["obs"] == kept["next_obs"] == ("rows:zstd:3", 6), kept
        _compare_window(copy, src)


@pytest.mark.parametrize("codec", ["rows:lz4", "rows:zstd:1"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_row_frame_leaves_store_frames_once_across_seals_wraps_and_reopening(tmp_path, codec, axis):
    """Frames once over compressed row-frame leaves: segments of 3 steps sealed as the
    head leaves them, a ring of 10 steps wrapped, the writer closed and reopened."""
    pytest.importorskip("zstandard")
    pytest.importorskip("cramjam")
    sp = spec(FRAME, 4, axis)
    full = mr.create(tmp_path / "full", sp, 10, num_envs=2, backend="zarr", commit_every=7)
    once = mr.create(
        tmp_path / "once", sp, 10, num_envs=2, backend="zarr", commit_every=7, chunk_steps=3,
        compression={"obs": codec}, frames=mr.Frames(frame_stack=4, final_slots=64),
    )
    assert [leaf.compression for leaf in once.metadata.leaves if leaf.path == "obs"] == [codec]
    episodes = Episodes(2, FRAME, 4, axis, "repeat", 0.15, 11)
    for t in range(27):
        step = episodes.step()
        full.add(step)
        once.add(step)
        if t in (4, 13):
            _compare_window(full, once, f"step {t}")
    _compare_window(full, once, "wrapped")
    once.close()
    with mr.open(tmp_path / "once") as reader:
        _compare_window(full, reader, "reader")
    once = mr.open(tmp_path / "once", mode="a")
    for _ in range(8):
        step = episodes.step()
        full.add(step)
        once.add(step)
    once.commit()
    _compare_window(full, once, "reopened")
    with mr.open(tmp_path / "once") as reader:
        _compare_window(full, reader, "reader after reopening")
    full.close()
    once.close()


def test_inspect_says_how_a_frames_store_keeps_its_observations(tmp_path):
    """inspect listed obs as one (5, 6) frame, without a word of the stack of 3 the
    store returns, nor of the next observations it derives."""
    frames = mr.Frames(frame_stack=3, pad="zeros", final_slots=40)
    mr.create(tmp_path / "b", spec(FRAME, 3, 0), 20, num_envs=2, frames=frames).close()
    r = run_cli("inspect", tmp_path / "b")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("  frames once"))
    assert line.split(None, 2)[2] == (
        "obs (3, 5, 6): a stack of 3 frames (axis 0, zeros padding) of which each row stores the newest; "
        "next_obs derived from the next step, final ones in a side ring of 40 frames"
    )
    info = json.loads(run_cli("inspect", tmp_path / "b", "--json").stdout)
    assert info["frames"]["frame_stack"] == 3 and info["frames"]["final_slots"] == 40


@pytest.mark.parametrize("compression", [None, "rows:zstd:1"])
def test_verify_from_the_cli_checks_the_side_ring_of_next_frames(tmp_path, compression):
    """A damaged side ring is found by ``mmreplay verify`` in a fresh process (the store
    itself still opens: only the next frames of ended episodes are wrong)."""
    import subprocess
    import sys

    if compression is not None:
        pytest.importorskip("zstandard")
    path = tmp_path / "once"
    sp = spec(FRAME, 2, -1)
    kw = {} if compression is None else {"compression": {"obs": compression}}
    with mr.create(path, sp, 12, num_envs=2, backend="zarr", frames=mr.Frames(frame_stack=2), **kw) as store:
        episodes = Episodes(2, FRAME, 2, -1, "repeat", 0.3, 5)
        for _ in range(30):  # the side ring goes round: its shard alone holds rows of the lap before
            store.add(episodes.step())
        slots = store.frames.final_slots
    cli = [sys.executable, "-m", "mmreplay.cli"]
    healthy = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    side = path / "frames" / "data.zarr" / "frame0"
    (shard,) = [p for p in side.rglob("*") if p.is_file() and p.name not in ("zarr.json", "rows.staging")][:1]
    raw = bytearray(shard.read_bytes())
    if compression is None:  # the shard index of the mapped block points elsewhere
        raw[-16] ^= 0xFF
    else:  # a flipped byte inside a compressed frame
        raw[_past_staging(side, raw, slots) + 6] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with mr.open(path) as reader:  # the store opens: only verify can tell
        assert reader.total_steps == 30
    damaged = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True)
    assert damaged.returncode != 0
    out = damaged.stdout + damaged.stderr
    assert "side ring of next frames" in out and "frame0" in out, out


def _past_staging(leaf, shard, rows):
    """Where the frame of the first row that staging does not hold (a row of the lap
    before) starts in the shard of a side-ring leaf of one segment (folder ``leaf``)."""
    from mmreplay.backends.row_reads import read_shard_index

    base, filled = np.frombuffer((leaf / "rows.staging").read_bytes()[24:40], "<i8").tolist()
    offsets, _ = read_shard_index(bytes(shard), rows, str(leaf))
    assert base == 0 and filled < rows and offsets[filled] >= 0
    return int(offsets[filled])


def _flip(file, at):
    raw = bytearray(file.read_bytes())
    raw[at] ^= 0xFF
    file.write_bytes(bytes(raw))


def _damage_side(path, how):
    """Damage the side ring of next frames of the store at ``path`` one way."""
    import shutil

    import zarr

    side = path / "frames"
    if how == "folder deleted":
        shutil.rmtree(side)
        return
    if side.joinpath("data.h5").exists():
        h5 = side / "data.h5"
        if how == "file deleted":
            h5.unlink()
        elif how == "truncated":
            os.truncate(h5, h5.stat().st_size // 3)
        elif how == "chunk flipped":  # fletcher32 finds it; the journal's copy goes too
            with h5py.File(h5, "r") as f:
                offset = f["frame0"].id.get_chunk_info(0).byte_offset
            _flip(h5, offset + 5)
            side.joinpath("data.h5.journal").unlink(missing_ok=True)
        return
    leaf = side / "data.zarr" / "frame0"
    (shard,) = [p for p in leaf.rglob("*") if p.is_file() and p.name not in ("zarr.json", "rows.staging")]
    if how == "file deleted":
        shard.unlink()
    elif how == "truncated":  # keep the slots up to the newest entry: older entries are lost
        ref = np.asarray(zarr.open_array(str(side / "data.zarr" / "ref"), mode="r")[:]).reshape(-1, 2)
        newest = (int(ref[:, 0].max()) - 1) % len(ref)
        os.truncate(shard, (newest + 1) * int(np.prod(FRAME)))
    elif how == "index flipped":  # the shard index of the mapped block points elsewhere
        _flip(shard, -16)
    elif how == "frame flipped":  # a byte inside a compressed frame
        rows = json.loads((path / "mmreplay.json").read_text())["frames"]["final_slots"]
        _flip(shard, _past_staging(leaf, shard.read_bytes(), rows) + 6)
    elif how == "staging truncated":
        os.truncate(leaf / "rows.staging", 10)


def _filled_side_ring_stores(tmp_path, backend, compression):
    """A store that keeps each frame once (a side ring of 40 slots, ``compression`` for
    its frames) and one that keeps everything, given the same 30 steps and closed; the
    episodes, to go on with."""
    kw = {} if compression is None else {"compression": {"obs": compression}}
    full, once = _stores(tmp_path, 2, 2, -1, "repeat", 12, final_slots=40, backend=backend, **kw)
    episodes = Episodes(2, FRAME, 2, -1, "repeat", 0.3, 5)
    for _ in range(30):
        step = episodes.step()
        full.add(step)
        once.add(step)
    full.close()
    once.close()
    return episodes


@pytest.mark.parametrize(
    "backend, compression, how",
    [
        ("zarr", None, "truncated"),
        ("zarr", None, "index flipped"),
        ("zarr", None, "folder deleted"),
        ("zarr", "rows:zstd:1", "frame flipped"),
        ("hdf5", "gzip", "chunk flipped"),
        pytest.param("zarr", None, "file deleted", marks=pytest.mark.long),
        pytest.param("zarr", "rows:zstd:1", "staging truncated", marks=pytest.mark.long),
        pytest.param("hdf5", None, "file deleted", marks=pytest.mark.long),
        pytest.param("hdf5", None, "truncated", marks=pytest.mark.long),
    ],
)
def test_recover_from_the_cli_repairs_the_side_ring_of_next_frames(tmp_path, backend, compression, how):
    """``mmreplay recover`` (a fresh process) restores a damaged side ring and drops the
    steps whose next frames were in the damaged part (and the older ones): afterwards
    ``verify`` passes and every step left reads as it was added."""
    import re
    import subprocess
    import sys

    if compression and compression.startswith("rows:zstd"):
        pytest.importorskip("zstandard")
    episodes = _filled_side_ring_stores(tmp_path, backend, compression)
    path = tmp_path / "once"
    _damage_side(path, how)
    cli = [sys.executable, "-m", "mmreplay.cli"]
    damaged = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True)
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert "side ring of next frames" in damaged.stdout, damaged.stdout
    fixed = subprocess.run([*cli, "recover", str(path)], capture_output=True, text=True)
    said = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0, said
    assert "the side ring of next frames: " in said, said
    lost = re.search(r"lost committed steps \[(\d+), (\d+)\)", said)
    kept = re.search(r"kept committed steps \[(\d+), (\d+)\)", said)
    assert kept and int(kept[2]) == 30, said
    if how == "index flipped":  # the frames are intact: nothing is lost
        assert lost is None and int(kept[1]) == 18, said
    else:
        assert lost and int(lost[2]) == int(kept[1]), said
        assert "side ring of next frames" in said.split("\n")[0], said
    if how == "truncated" and backend == "zarr":  # only older entries were in the lost part
        assert 18 < int(kept[1]) < 30, said
    healthy = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    with mr.open(tmp_path / "full") as full, mr.open(path) as once:
        assert once.window.end == 30
        _compare_window(full, once, how)
    if int(kept[1]) == 30:  # every step was dropped: the writer cannot know the stacks before
        episodes = Episodes(2, FRAME, 2, -1, "repeat", 0.3, 6)  # so they start episodes
    with mr.open(path, mode="a") as writer:  # a writer goes on from the repaired ring
        for _ in range(3):
            writer.add(episodes.step())
    healthy = subprocess.run([*cli, "verify", str(path)], capture_output=True, text=True)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr


def _side_leaf_file(path, leaf):
    """The file of a side-ring leaf of the store at ``path`` and where the leaf starts in it."""
    (info,) = [x for x in json.loads((path / "mmreplay.json").read_text())["frames"]["side"] if x["path"] == leaf]
    return path / "frames" / info["file"], info["offset"]


def _damage_ref(path, how):
    """Damage only the side ring's ``ref`` leaf (sequence numbers and steps) one way."""
    file, offset = _side_leaf_file(path, "ref")
    if how == "deleted":
        file.unlink()
    elif how == "truncated":  # five entries are left
        os.truncate(file, offset + 5 * 16)
    elif how == "flipped":  # every entry: a byte of its sequence number and of its step
        raw = bytearray(file.read_bytes())
        for at in range(offset, offset + 40 * 16, 16):
            raw[at + 1] ^= 0x5A
            raw[at + 8] ^= 0x21
        file.write_bytes(bytes(raw))


def _run(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "mmreplay.cli", *args], capture_output=True, text=True)


def _write_on_and_compare(full, path, episodes, what):
    """A writer reopens the recovered store and goes on; it reads as the store that kept
    everything, and verify passes."""
    with mr.open(full, mode="a") as full_writer, mr.open(path, mode="a") as writer:
        for _ in range(3):
            step = episodes.step()
            full_writer.add(step)
            writer.add(step)
    healthy = _run("verify", str(path))
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    with mr.open(full) as a, mr.open(path) as b:
        assert b.window.end == 33
        _compare_window(a, b, what)


@pytest.mark.parametrize(
    "backend, compression, how",
    [
        ("zarr", None, "deleted"),
        ("zarr", "rows:lz4", "flipped"),
        ("hdf5", None, "truncated"),
        pytest.param("hdf5", "gzip", "flipped", marks=pytest.mark.long),
        pytest.param("zarr", None, "truncated", marks=pytest.mark.long),
        pytest.param("zarr", None, "flipped", marks=pytest.mark.long),
        pytest.param("zarr", "rows:lz4", "deleted", marks=pytest.mark.long),
        pytest.param("hdf5", None, "flipped", marks=pytest.mark.long),
    ],
)
def test_recover_rebuilds_a_damaged_side_ring_ref_from_the_rows_and_drops_nothing(tmp_path, backend, compression, how):
    """Only ``ref`` (sequence numbers and steps of the side ring) is damaged: ``verify``
    (a fresh process) finds it, ``recover`` rebuilds it from the rows' ``_frames/next``
    and loses no step; every step reads as added, and a writer goes on."""
    import re

    if compression == "rows:lz4":
        pytest.importorskip("cramjam")
    episodes = _filled_side_ring_stores(tmp_path, backend, compression)
    path = tmp_path / "once"
    with mr.open(path) as reader:
        window = reader.window[:2]
    _damage_ref(path, how)
    damaged = _run("verify", str(path))
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    assert "side ring of next frames" in damaged.stdout and "ref" in damaged.stdout, damaged.stdout
    fixed = _run("recover", str(path))
    said = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0, said
    assert said.startswith("no committed step was lost\nkept committed steps ["), said
    assert re.search(r"kept committed steps \[\d+, 30\)", said), said
    assert "rebuilt its ref leaf" in said and "from the rows of committed steps" in said, said
    healthy = _run("verify", str(path))
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    with mr.open(tmp_path / "full") as a, mr.open(path) as b:
        assert b.window[:2] == window
        _compare_window(a, b, how)
    _write_on_and_compare(tmp_path / "full", path, episodes, f"{how}, written on")


def _next_leaf(path, backend):
    """The rows' ``_frames/next`` (sequence number + 1 of each row's side entry), read with
    zarr or h5py."""
    if backend == "zarr":
        import zarr

        return np.asarray(zarr.open_array(str(path / "data.zarr" / "_frames" / "next"), mode="r")[:])
    with h5py.File(path / "data.h5", "r") as f:
        return f["_frames/next"][:]


@pytest.mark.parametrize(
    "backend, compression, how",
    [
        ("zarr", None, "frame0 truncated, ref flipped"),
        ("hdf5", None, "data.h5 truncated inside frame0"),
        pytest.param("zarr", "rows:zstd:1", "frame flipped, ref deleted", marks=pytest.mark.long),
    ],
)
def test_recover_with_ref_and_frames_damaged_drops_only_the_steps_needing_lost_frames(
    tmp_path, backend, compression, how
):
    """``ref`` and part of the side ring's frames are damaged: ``recover`` rebuilds
    ``ref`` and drops only the steps whose next frames were lost (and the older ones)."""
    import re

    if compression == "rows:zstd:1":  # (a flipped byte in an lz4 frame may go unseen: lz4 has no checksum)
        pytest.importorskip("zstandard")
    episodes = _filled_side_ring_stores(tmp_path, backend, compression)
    path = tmp_path / "once"
    nxt = _next_leaf(path, backend)
    file, offset = _side_leaf_file(path, "frame0")
    if how == "frame flipped, ref deleted":
        lo = 0  # the side ring is one segment: it is rewritten as zeros
        _damage_side(path, "frame flipped")
        _damage_ref(path, "deleted")
    else:  # the frames of the slots after the newest entry's are lost: older entries
        lo = (int(nxt.max()) - 1) % 40 + 1
        os.truncate(file, offset + lo * int(np.prod(FRAME)))
        if how == "frame0 truncated, ref flipped":
            _damage_ref(path, "flipped")
    damaged = _run("verify", str(path))
    assert damaged.returncode == 1, damaged.stdout + damaged.stderr
    fixed = _run("recover", str(path))
    said = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0, said
    assert "rebuilt its ref leaf" in said, said
    lost = re.search(r"lost committed steps \[(\d+), (\d+)\)", said)
    assert lost and f"kept committed steps [{lost[2]}, 30)" in said, said
    # the newest committed step whose row names a lost slot, from the rows themselves
    first = int(lost[1])
    needs = [t for t in range(first, 30) if ((nxt[t % 12] > 0) & ((nxt[t % 12] - 1) % 40 >= lo)).any()]
    assert int(lost[2]) == needs[-1] + 1, (needs, said)
    if lo:
        assert int(lost[2]) < 30, said  # newer steps kept: their frames were intact
    healthy = _run("verify", str(path))
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    with mr.open(tmp_path / "full") as a, mr.open(path) as b:
        _compare_window(a, b, how)
    if int(lost[2]) == 30:  # every step was dropped: the writer cannot know the stacks before
        episodes = Episodes(2, FRAME, 2, -1, "repeat", 0.3, 6)  # so they start episodes
        with mr.open(path, mode="a") as writer:
            for _ in range(3):
                writer.add(episodes.step())
        assert _run("verify", str(path)).returncode == 0
    else:
        _write_on_and_compare(tmp_path / "full", path, episodes, f"{how}, written on")


def test_a_writer_reopens_after_recover_dropped_every_step_and_its_rows(tmp_path):
    """After ``mmreplay recover`` recreated a lost ``data.h5`` (every step dropped, the
    rows gone), a writer opens: its first stacks must start episodes, and others are
    refused with nothing written."""
    import subprocess
    import sys

    path = tmp_path / "once"
    sp = spec(FRAME, 2, -1)
    frames = mr.Frames(frame_stack=2)
    with mr.create(path, sp, 12, num_envs=2, backend="hdf5", compression={"obs": "gzip"}, frames=frames) as store:
        episodes = Episodes(2, FRAME, 2, -1, "repeat", 0.3, 5)
        for _ in range(10):
            store.add(episodes.step())
    (path / "data.h5").unlink()
    fixed = subprocess.run([sys.executable, "-m", "mmreplay.cli", "recover", str(path)], capture_output=True, text=True)
    assert fixed.returncode == 0 and "kept committed steps [10, 10)" in fixed.stdout, fixed.stdout + fixed.stderr
    with mr.open(path, mode="a") as writer:
        with pytest.raises(mr.BadInputError, match="episode's first stack"):
            writer.add(episodes.step())  # the stacks before it are gone
        assert writer.total_steps == 10
        fresh = Episodes(2, FRAME, 2, -1, "repeat", 0.3, 6)
        added = [fresh.step() for _ in range(3)]
        for step in added:
            writer.add(step)
    with mr.open(path) as reader:
        assert reader.window[:2] == (11, 13)  # the oldest stack's earlier frame is before it
        _same(reader.get(slice(None)), {k: np.stack([s[k] for s in added[1:]]) for k in added[0]}, "after")


def test_exist_ok_reopens_a_frames_store_with_frames_left_out(tmp_path):
    """``frames`` is a setting like the others: left out of ``create(exist_ok=True)`` it
    takes the buffer's (it was refused, "frames: existing {...} vs new None"); named, it
    must match, and a buffer without frames is not reopened as one."""
    sp = spec((6, 6), 4, -1)
    path = tmp_path / "b"
    mr.create(path, sp, 16, frames=mr.Frames(frame_stack=4)).close()
    with mr.create(path, sp, 16, exist_ok=True) as store:
        assert store.frames is not None and store.frames.frame_stack == 4
    with mr.create(path, sp, 16, exist_ok=True, frames=mr.Frames(frame_stack=4)) as store:
        assert store.frames.frame_stack == 4
    with pytest.raises(mr.SpecMismatchError, match="'final_slots': 12, .* vs new .*'final_slots': 5"):
        mr.create(path, sp, 16, exist_ok=True, frames=mr.Frames(frame_stack=4, final_slots=5))
    mr.create(tmp_path / "plain", sp, 16).close()
    with pytest.raises(mr.SpecMismatchError, match="frames: existing None vs new"):
        mr.create(tmp_path / "plain", sp, 16, exist_ok=True, frames=mr.Frames(frame_stack=4))
