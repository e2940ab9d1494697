"""Two views of one store: the writer reads every step it added, readers in other
processes read the committed prefix, and a crash keeps exactly the committed steps."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import WITH_ROWS, WITH_ROWS_IDS

import mmreplay as mr

SPEC = {"x": mr.ArraySpec((), "int64"), "terminated": mr.ArraySpec((), "bool")}


def step(t: int, num_envs: int = 2) -> dict:
    """Step ``t``: ``x = 100 * t + env``; episodes end every 4th step."""
    return {"x": 100 * t + np.arange(num_envs), "terminated": np.full(num_envs, t % 4 == 3)}


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("layout", WITH_ROWS, ids=WITH_ROWS_IDS)
def test_writer_reads_its_first_step_before_any_commit(tmp_path, layout):
    backend, compression = layout
    path = tmp_path / "b"
    with mr.create(path, SPEC, 100, num_envs=2, backend=backend, compression=compression) as store:
        store.add(step(0))
        assert store.committed_steps == 0 and len(store) == 1
        batch, info = store.sample(64, rng=0, return_info=True)
        assert set(batch["x"].tolist()) == {0, 1} and (info.step == 0).all()
        assert store.get(0)["x"].tolist() == [0, 1]
        assert [b["x"].tolist() for b in store.iterate()] == [0, 1]
        assert [(ep.env, ep.first_step, ep.last_step, ep.status) for ep in store.episodes()] == [
            (0, 0, 0, "open"),
            (1, 0, 0, "open"),
        ]
        for t in range(1, 6):
            store.add(step(t))
        spans = [(ep.env, ep.first_step, ep.last_step, ep.status) for ep in store.episodes()]
        assert spans == [(0, 0, 3, "terminated"), (0, 4, 5, "open"), (1, 0, 3, "terminated"), (1, 4, 5, "open")]
        seq = store.sample(50, num_steps=2, within_episodes=True, rng=1)["x"]
        assert ((seq[:, 1] - seq[:, 0]) == 100).all() and not np.isin(seq[:, 0] // 100, [3]).any()
        assert store.to_arrays()["infos/x"].tolist() == [0, 100, 200, 300, 400, 500, 1, 101, 201, 301, 401, 501]
        assert store.committed_steps == 0  # nothing above committed anything


@pytest.mark.parametrize("layout", WITH_ROWS, ids=WITH_ROWS_IDS)
def test_a_second_reader_in_one_process_sees_the_commits_made_since_the_first_opened(tmp_path, layout):
    """Two readers of one store in one process (HDF5 shares the open file between them):
    the one opened later reads the steps committed since, not the older one's view,
    also where a rewritten chunk moved in the file (rows that compress worse)."""
    backend, compression = layout
    path = tmp_path / "b"
    with mr.create(path, SPEC, 20, num_envs=2, backend=backend, compression=compression) as store:
        for t in range(7):
            store.add(step(t))
    late = np.random.default_rng(0).integers(1 << 62, size=(6, 2))
    with mr.open(path) as first:
        assert first.get(-1)["x"].tolist() == [600, 601]
        run_python(f"""
            import numpy as np, mmreplay as mr
            with mr.open({str(path)!r}, "a") as store:
                store.extend({{"x": np.array({late.tolist()}), "terminated": np.zeros((6, 2), bool)}})
            """)
        with mr.open(path) as second:
            assert second.get(slice(7, None))["x"].tolist() == late.tolist()
        assert first.refresh() and first.get(slice(7, None))["x"].tolist() == late.tolist()


def test_reader_process_sees_only_the_committed_prefix(tmp_path):
    path = tmp_path / "b"
    with mr.create(path, SPEC, 100, num_envs=2) as store:
        for t in range(5):
            store.add(step(t))
        store.commit()
        for t in range(5, 8):
            store.add(step(t))
        assert len(store) == 8
        out = run_python(f"""
            import mmreplay as mr
            with mr.open({str(path)!r}) as r:
                steps = set((r.sample(500, rng=0)["x"] // 100).tolist())
                print(len(r), sorted(steps), len(list(r.iterate())), [e.last_step for e in r.episodes()])
        """)
        assert out.split() == ["5", "[0,", "1,", "2,", "3,", "4]", "10", "[3,", "4,", "3,", "4]"]
        assert len(store) == 8  # the writer's view is unchanged


@pytest.mark.parametrize("layout", WITH_ROWS, ids=WITH_ROWS_IDS)
def test_writer_view_after_a_wrap_with_uncommitted_steps(tmp_path, layout):
    backend, compression = layout
    with mr.create(tmp_path / "b", SPEC, 10, num_envs=2, backend=backend, compression=compression) as store:
        for t in range(25):  # 2.5 rings, commits only to reserve slots ahead
            store.add(step(t))
            batch, info = store.sample(32, rng=t, return_info=True)
            assert (batch["x"] == 100 * info.step + info.env).all()  # never a torn or older row
            assert info.step.min() >= max(0, t + 1 - 10) and info.step.max() <= t
        assert store.committed_steps < 25
        assert store.window[:2] == (15, 25)
        assert (store.get(slice(None))["x"][:, 0] // 100).tolist() == list(range(15, 25))
        seq, info = store.sample(200, num_steps=3, rng=0, return_info=True)
        assert (seq["x"] == 100 * (info.step[:, None] + np.arange(3)) + info.env[:, None]).all()


def test_kill_keeps_exactly_the_committed_steps(tmp_path, writers):
    path = tmp_path / "b"
    proc = writers.start(
        textwrap.dedent(f"""
                import sys, time, numpy as np, mmreplay as mr
                store = mr.create({str(path)!r}, {{"x": mr.ArraySpec((), "int64")}}, 100, commit_every=1000)
                for t in range(30):
                    store.add({{"x": np.array([t])}})
                store.commit()
                for t in range(30, 70):
                    store.add({{"x": np.array([t])}})
                assert len(store) == 70 and store.sample(8)["x"].max() < 70
                print(store.committed_steps, flush=True)
                time.sleep(60)
            """)
    )
    committed = int(proc.stdout.readline())
    writers.kill(proc)
    assert 30 <= committed < 70  # the writer saw 70 steps, fewer were committed
    with mr.open(path, "a") as store:
        assert len(store) == committed and store.committed_steps == committed
        assert store.get(slice(None))["x"][:, 0].tolist() == list(range(committed))


def test_export_from_a_writer_commits_first(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 100, num_envs=2) as store:
        for t in range(5):
            store.add(step(t))
        assert store.committed_steps == 0
        mr.export(store, tmp_path / "out.npz", format="npz")
        assert store.committed_steps == 5
    with np.load(tmp_path / "out.npz") as data:
        x = [data[k] for k in data.files if k.endswith("x")]
    assert x and sorted(x[0].reshape(-1).tolist()) == sorted(100 * t + e for t in range(5) for e in range(2))


READ_AROUND_A_COMMIT = """
import sys, numpy as np, mmreplay as mr
reader = mr.open(sys.argv[1])
def show():
    rows = reader.get(slice(None))["x"]
    print((rows[:, 0] // 100).tolist(), sorted(set((reader.sample(200, rng=0)["x"] // 100).tolist())), flush=True)
show()  # every chunk, shard and the draw ahead are now cached
sys.stdin.readline()
reader.refresh()
show()
"""


@pytest.mark.parametrize(
    "layout, frames",
    [(layout, None) for layout in WITH_ROWS] + [(("zarr", {"obs": "rows:lz4", "x": "zstd"}), mr.Frames())],
    ids=WITH_ROWS_IDS + ["zarr-frames-zstd"],
)
def test_reader_sees_rows_set_by_the_writer_after_refresh(tmp_path, writers, layout, frames):
    """A reader's refresh picks up committed rows the writer rewrote with set(), as a
    mapped leaf shows them, not only the steps committed since (one commit with both)."""
    backend, compression = layout
    spec, extra = SPEC, {}
    if frames is not None:
        obs = mr.ArraySpec((3, 3), "uint8")
        spec = {**SPEC, "obs": obs, "next_obs": obs}
        extra = {"frames": frames, "roles": {"observation": "obs", "next_observation": "next_obs"}}

    def full(t: int) -> dict:
        frame = {"obs": np.full((2, 3, 3), t, np.uint8), "next_obs": np.full((2, 3, 3), t + 1, np.uint8)}
        return {**step(t), **(frame if frames is not None else {})}

    path = tmp_path / "b"
    with mr.create(path, spec, 40, num_envs=2, backend=backend, compression=compression, chunk_steps=4, **extra) as store:
        for t in range(10):
            store.add(full(t))
        store.commit()
        reader = writers.start(READ_AROUND_A_COMMIT, path, stdin=subprocess.PIPE)
        assert reader.stdout.readline().strip() == f"{list(range(10))} {list(range(10))}"
        rewritten = store.get(slice(0, 10))  # (a frames-once store's frames stay as they are)
        rewritten.update(x=step(50)["x"] + np.zeros((10, 1), np.int64), terminated=np.zeros((10, 2), bool))
        store.set(slice(0, 10), rewritten)  # every committed step: step 50's x
        store.add(full(10))
        store.commit()
        reader.stdin.write("\n")
        reader.stdin.close()
        assert reader.stdout.readline().strip() == f"{[50] * 10 + [10]} [10, 50]"
        assert reader.wait() == 0
