"""A store as a Rerun recording: read back with rerun-sdk's own reader, every frame and
scalar equals the store's, and episode starts and ends are where the episode index says."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import one_line_error, run_cli

import mmreplay as mr

rr = pytest.importorskip("rerun")
RrdReader = pytest.importorskip("rerun.chunk").RrdReader

SPEC = {
    "obs": mr.ArraySpec((4, 16, 16), "uint8"),  # KHW: logged as its newest frame
    "camera": mr.ArraySpec((16, 16, 3), "uint8"),
    "state": mr.ArraySpec((3,), "float32"),
    "action": mr.ArraySpec((), "int64"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(3)
    path = tmp_path_factory.mktemp("rerun") / "store"
    with mr.create(path, SPEC, capacity=64, num_envs=2) as s:
        s.extend(
            {
                "obs": rng.integers(0, 255, (40, 2, 4, 16, 16), dtype=np.uint8),
                "camera": rng.integers(0, 255, (40, 2, 16, 16, 3), dtype=np.uint8),
                "state": rng.normal(size=(40, 2, 3)).astype("float32"),
                "action": rng.integers(0, 5, (40, 2)),
                "reward": rng.normal(size=(40, 2)).astype("float32"),
                "terminated": rng.random((40, 2)) < 0.1,
            }
        )
    s = mr.open(path)
    yield s
    s.close()


def read(path) -> dict[str, dict[str, dict[int, object]]]:
    """entity -> component -> step -> value, from the recording alone."""
    out: dict = {}
    for chunk in RrdReader(path).store().stream():
        batch = chunk.to_record_batch()
        if "step" not in batch.schema.names:
            continue
        steps = batch.column("step").to_pylist()
        for name in batch.schema.names:
            if ":" in name:
                values = batch.column(name).to_pylist()
                out.setdefault(chunk.entity_path, {}).setdefault(name, {}).update(zip(steps, values))
    return out


def image(buffer: list, fmt: list) -> np.ndarray:
    f = fmt[0]
    return np.asarray(buffer[0], np.uint8).reshape(f["height"], f["width"], -1)


def test_frames_scalars_and_episode_marks_read_back_equal(store, tmp_path):
    out = mr.view(store, out=tmp_path / "all.rrd", fps=10)
    got = read(out)
    steps = np.arange(store.first_step, store.first_step + len(store))
    for env in range(store.num_envs):
        root = f"/env/{env}"
        data = dict(zip(store.leaf_paths, store.read_steps(steps)))
        buffers, formats = got[f"{root}/obs"]["Image:buffer"], got[f"{root}/obs"]["Image:format"]
        cams = got[f"{root}/camera"]
        for i, t in enumerate(steps.tolist()):
            assert np.array_equal(image(buffers[t], formats[t])[..., 0], data["obs"][i, env, -1])
            assert np.array_equal(image(cams["Image:buffer"][t], cams["Image:format"][t]), data["camera"][i, env])
            assert got[f"{root}/state"]["Scalars:scalars"][t] == pytest.approx(data["state"][i, env].tolist())
            assert got[f"{root}/reward"]["Scalars:scalars"][t] == pytest.approx([float(data["reward"][i, env])])
            assert got[f"{root}/action"]["Scalars:scalars"][t] == [float(data["action"][i, env])]
        spans = store.episode_index(env=env)
        texts = got[f"{root}/episodes"]["TextLog:text"]
        for k, span in enumerate(spans):
            assert f"episode {k} starts" in texts[span.first_step][0]
            if span.status == "terminated":
                assert texts[span.last_step][-1].startswith(f"episode {k} terminated (length {span.length}")
            assert got[f"{root}/episode"]["Scalars:scalars"][span.last_step] == [float(k)]
        assert len(texts) >= len(spans) > 1


def test_cli_logs_one_episode_of_one_env_and_refuses_what_it_cannot_do(store, tmp_path):
    ok = run_cli("view", store.path, "--rerun", tmp_path / "one.rrd", "--env", 1, "--episode", 0, "-q")
    assert ok.returncode == 0 and "one.rrd" in ok.stdout, ok.stderr
    span = store.episode_index(env=1)[0]
    got = read(tmp_path / "one.rrd")
    assert set(got["/env/1/reward"]["Scalars:scalars"]) == set(range(span.first_step, span.last_step + 1))
    assert not any(e.startswith("/env/0") for e in got)
    one_line_error(run_cli("view", store.path), 2, "--rerun")
    one_line_error(run_cli("view", store.path, "--rerun", tmp_path / "one.rrd"), 2, "already exists")
    one_line_error(run_cli("view", store.path, "--rerun", tmp_path / "x.gif"), 2, ".rrd")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.rrd"]


def test_a_wrapped_ring_marks_the_end_of_an_episode_whose_start_it_overwrote(tmp_path):
    """Steady state: each env's oldest retained episode lost its start, and its end is
    still an end in the recording."""
    spec = {"reward": mr.ArraySpec((), "float32"), "terminated": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "s", spec, capacity=10, num_envs=1) as s:
        for t in range(25):  # episodes end at steps 7, 17; the ring keeps 15..24
            s.add({"reward": np.ones(1, np.float32), "terminated": np.array([t % 10 == 7])})
    with mr.open(tmp_path / "s") as s:
        spans = s.episode_index()
        assert [(x.first_step, x.last_step, x.status) for x in spans] == [(15, 17, "open"), (18, 24, "open")]
        texts = read(mr.view(s, out=tmp_path / "w.rrd"))["/env/0/episodes"]["TextLog:text"]
    assert texts[17] == ["episode 0 terminated (its last 3 steps, return 3)"]
    assert texts[15] == ["episode 0 starts"] and texts[18] == ["episode 1 starts"]


def test_a_folder_in_the_recordings_place_is_refused_in_one_line_even_with_force(store, tmp_path):
    (tmp_path / "x.rrd").mkdir()
    (tmp_path / "x.rrd" / "mine").write_text("x")
    out = run_cli("view", store.path, "--rerun", tmp_path / "x.rrd", "--force", "-q")
    one_line_error(out, 2, f"{tmp_path / 'x.rrd'}: is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.rrd"]
    assert [p.name for p in (tmp_path / "x.rrd").iterdir()] == ["mine"]
