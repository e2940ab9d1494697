"""The LeRobot v3.0 export and import: the layout LeRobot 0.6 reads, checked with pyarrow,
``datasets`` and PyAV (every column, type, offset and video frame), and the round trip
store -> LeRobot -> store. ``--long`` also loads an export with LeRobot's own
``LeRobotDataset`` in a separate environment (test_lerobot_install.py)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess

import numpy as np
import pytest
from conftest import one_line_error, run_cli

import mmreplay as mr
from mmreplay.formats import export, import_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
av = pytest.importorskip("av")
datasets = pytest.importorskip("datasets")

FPS = 10
SIDE = 64
STATS = ["min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"]


def rgb(t: int, env: int) -> np.ndarray:
    """Smooth camera-like frames (what LeRobot's lossy defaults are made for)."""
    y, x = np.mgrid[:SIDE, :SIDE].astype(np.float64)
    r = 128 + 90 * np.sin((x + 2 * t + 9 * env) / 11)
    g = 128 + 90 * np.cos((y - t) / 13)
    b = 128 + 60 * np.sin((x + y + t) / 17)
    return np.stack([r, g, b], -1).astype(np.uint8)


def gray(t: int) -> np.ndarray:
    y, x = np.mgrid[:SIDE, :SIDE].astype(np.float64)
    return (128 + 100 * np.sin((x + 3 * t) / 9) * np.cos(y / 15)).astype(np.uint8)


SPEC = {
    "obs": {
        "camera": mr.ArraySpec((SIDE, SIDE, 3), "uint8"),
        "stack": mr.ArraySpec((4, SIDE, SIDE), "uint8"),  # KHW: the Atari stack
        "state": mr.ArraySpec((3,), "float32"),
    },
    "action": mr.ArraySpec((2,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
    "logp": mr.ArraySpec((), "float64"),
}


def fill(path, steps: int = 60, num_envs: int = 2) -> mr.Store:
    """Episodes of 11..17 steps per env; a stack repeats an episode's first frame (Atari wrappers)."""
    rng = np.random.default_rng(0)
    store = mr.create(path, SPEC, capacity=200, num_envs=num_envs)
    t_ep = [0] * num_envs
    history: list[list[np.ndarray]] = [[] for _ in range(num_envs)]
    for t in range(steps):
        stacks, term, trunc = [], [], []
        for e in range(num_envs):
            history[e] = (history[e] + [gray(t + 40 * e)])[-4:]
            frames = [history[e][0]] * (4 - len(history[e])) + history[e]
            stacks.append(np.stack(frames))
            end = t_ep[e] == 11 + 3 * e + (t // 20)
            term.append(end and e == 0)
            trunc.append(end and e == 1)
            t_ep[e] = 0 if end else t_ep[e] + 1
            if end:
                history[e] = []
        store.add(
            {
                "obs": {
                    "camera": np.stack([rgb(t, e) for e in range(num_envs)]),
                    "stack": np.stack(stacks),
                    "state": rng.normal(size=(num_envs, 3)).astype("float32"),
                },
                "action": rng.normal(size=(num_envs, 2)).astype("float32"),
                "reward": rng.normal(size=num_envs).astype("float32"),
                "terminated": np.array(term),
                "truncated": np.array(trunc),
                "logp": rng.normal(size=num_envs),
            }
        )
    store.commit()
    return store


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    store = fill(tmp_path_factory.mktemp("lerobot") / "store")
    yield store
    store.close()


def hf_features(features: dict) -> datasets.Features:
    """LeRobot's get_hf_features_from_features, for the dtypes an export writes."""
    out = {}
    for key, ft in features.items():
        if ft["dtype"] == "video":
            continue
        value = datasets.Value(ft["dtype"])
        out[key] = value if ft["shape"] == [1] else datasets.Sequence(value, length=ft["shape"][0])
    return datasets.Features(out)


def decode(path: str) -> tuple[list[float], np.ndarray]:
    with av.open(path) as f:
        stream = f.streams.video[0]
        decoded = [
            (float(fr.pts * stream.time_base), fr.to_ndarray(format="rgb24")) for fr in f.decode(stream)
        ]
    return [t for t, _ in decoded], np.stack([x for _, x in decoded])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def check_layout(store: mr.Store, out, min_psnr: float) -> None:
    """Every file of the export against the store, as LeRobot's reader finds them."""
    info = json.load(open(out / "meta" / "info.json"))
    spans = store.episode_index()
    assert info["codebase_version"] == "v3.0" and info["fps"] == FPS
    assert info["total_episodes"] == len(spans) and info["total_tasks"] == 1
    assert info["total_frames"] == sum(s.length for s in spans) == len(store) * store.num_envs
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert info["splits"] == {"train": f"0:{len(spans)}"}
    features = info["features"]
    assert list(features)[-5:] == ["timestamp", "frame_index", "episode_index", "index", "task_index"]
    assert features["observation.state"]["shape"] == [3] and features["action"]["shape"] == [2]
    assert features["next.reward"] == {"dtype": "float32", "shape": [1], "names": None}
    assert features["next.done"]["dtype"] == features["next.truncated"]["dtype"] == "bool"
    for key in ("observation.images.camera", "observation.images.stack"):
        ft = features[key]
        assert ft["dtype"] == "video" and ft["shape"] == [SIDE, SIDE, 3]
        assert ft["names"] == ["height", "width", "channels"]
        assert {"video.codec", "video.pix_fmt", "video.fps", "video.g", "video.crf", "is_depth_map"} <= set(
            ft["info"]
        )
    # the data files load as LeRobot loads them: Dataset.from_parquet with the features
    files = sorted(glob.glob(str(out / "data" / "*" / "*.parquet")))
    hf = hf_features(features)
    for f in files:
        assert pq.read_schema(f).remove_metadata() == hf.arrow_schema.remove_metadata(), f
    data = datasets.Dataset.from_parquet(files, features=hf).with_format("numpy")[:]
    assert len(data["index"]) == info["total_frames"]
    assert np.array_equal(data["index"], np.arange(info["total_frames"]))
    assert np.allclose(data["timestamp"], data["frame_index"] / FPS)
    # episodes: contiguous ranges, file indices that hold them, video time ranges
    episodes = pq.read_table(
        sorted(glob.glob(str(out / "meta" / "episodes" / "*" / "*.parquet")))
    ).to_pylist()
    assert [e["episode_index"] for e in episodes] == list(range(len(spans)))
    stats = json.load(open(out / "meta" / "stats.json"))
    for ep, span, from_ in zip(episodes, spans, np.cumsum([0] + [s.length for s in spans])):
        assert (ep["length"], ep["dataset_from_index"], ep["dataset_to_index"]) == (
            span.length,
            from_,
            from_ + span.length,
        )
        assert ep["tasks"] == ["play"]
        rel = info["data_path"].format(chunk_index=ep["data/chunk_index"], file_index=ep["data/file_index"])
        rows = pq.read_table(out / rel, columns=["index", "episode_index", "next.done", "next.truncated"])
        mine = rows.filter(pa.compute.equal(rows.column("episode_index"), ep["episode_index"]))
        assert mine.column("index").to_pylist() == list(range(from_, from_ + span.length))
        done, trunc = mine.column("next.done").to_pylist(), mine.column("next.truncated").to_pylist()
        assert done[-1] == (span.ended == "terminated") and trunc[-1] == (span.ended != "terminated")
        assert not any(done[:-1] + trunc[:-1])
        for key in features:
            assert set(ep) >= {f"stats/{key}/{s}" for s in STATS}
    for key, s in stats.items():
        assert list(s) == STATS, key
    assert np.array(stats["observation.images.camera"]["mean"]).shape == (3, 1, 1)
    assert stats["observation.state"]["count"] == [info["total_frames"]]
    assert np.array(stats["observation.state"]["q50"]).shape == (3,)
    # every video frame, decoded with PyAV, against the store's
    for key, leaf in (("camera", "camera"), ("stack", "stack")):
        name = f"observation.images.{key}"
        decoded = {}
        for ep, real in zip(episodes, store.episodes()):
            where = (ep[f"videos/{name}/chunk_index"], ep[f"videos/{name}/file_index"])
            if where not in decoded:
                decoded[where] = decode(
                    str(
                        out
                        / info["video_path"].format(video_key=name, chunk_index=where[0], file_index=where[1])
                    )
                )
            times, frames = decoded[where]
            first = times.index(min(times, key=lambda t: abs(t - ep[f"videos/{name}/from_timestamp"])))
            assert abs(times[first] - ep[f"videos/{name}/from_timestamp"]) < 1e-4
            got = frames[first : first + ep["length"]]
            want = real.data["obs"][leaf]
            want = np.repeat(want[:, -1, :, :, None], 3, -1) if key == "stack" else want
            assert len(got) == ep["length"] and psnr(got, want) >= min_psnr, (name, psnr(got, want))
            assert np.isclose(
                ep[f"videos/{name}/to_timestamp"] - ep[f"videos/{name}/from_timestamp"], ep["length"] / FPS
            )
    tasks = __import__("pandas").read_parquet(out / "meta" / "tasks.parquet")
    assert tasks.index.name == "task" and list(tasks.index) == ["play"] and list(tasks["task_index"]) == [0]


def test_default_export_is_lerobots_v3_layout_with_lossy_av1(source, tmp_path):
    result = export(source, tmp_path / "out", "lerobot", fps=FPS, task="play")
    assert result.episodes == len(source.episode_index())
    info = json.load(open(tmp_path / "out" / "meta" / "info.json"))
    video = info["features"]["observation.images.camera"]["info"]
    assert (video["video.codec"], video["video.pix_fmt"], video["video.g"], video["video.crf"]) == (
        "av1",
        "yuv420p",
        2,
        30,
    )
    check_layout(source, tmp_path / "out", min_psnr=35.0)


def test_lossless_export_is_bit_exact_over_many_files_and_imports_back(source, tmp_path):
    out = tmp_path / "out"
    export(
        source,
        out,
        "lerobot",
        fps=FPS,
        task="play",
        lossless=True,
        chunks_size=2,
        data_files_size_in_mb=0.002,
        video_files_size_in_mb=0.02,
    )
    assert len(glob.glob(str(out / "data" / "chunk-*"))) > 1  # files rolled over, into several chunks
    assert len(glob.glob(str(out / "videos" / "observation.images.camera" / "*" / "*.mp4"))) > 1
    info = json.load(open(out / "meta" / "info.json"))
    assert info["features"]["observation.images.camera"]["info"]["video.codec"] == "h264"
    check_layout(source, out, min_psnr=float("inf"))
    import_dataset(out, tmp_path / "back")
    with mr.open(tmp_path / "back") as back:
        assert mr.ArraySpec((4, SIDE, SIDE), "uint8") == back.spec["obs"]["stack"]
        assert back.roles == {k: v for k, v in source.roles.items() if k != "next_observation"}
        assert back.attrs["lerobot"]["tasks"] == ["play"] and back.attrs["lerobot"]["fps"] == FPS
        for a, b in zip(source.episodes(), back.episodes(), strict=True):
            assert b.length == a.length and b.ended == ("truncated" if a.ended == "running" else a.ended)
            if a.ended == "running":  # an episode still open is written truncated
                a.data["truncated"][-1] = True
            for x, y in zip(mr.spec.flatten(a.data), mr.spec.flatten(b.data)):
                assert x.dtype == y.dtype and np.array_equal(x, y)


def test_a_dataset_lerobot_wrote_imports_with_lerobots_names(source, tmp_path):
    """Without mmreplay's record the features' names make the store; tasks are kept."""
    out = tmp_path / "out"
    export(source, out, "lerobot", fps=FPS, task="play", lossless=True)
    os.unlink(out / "meta" / "mmreplay.json")
    import_dataset(out, tmp_path / "back")
    with mr.open(tmp_path / "back") as back:
        assert back.spec["observation"]["images"]["camera"] == mr.ArraySpec((SIDE, SIDE, 3), "uint8")
        assert back.spec["observation"]["state"] == mr.ArraySpec((3,), "float32")
        assert back.roles["reward"] == "reward" and back.roles["terminated"] == "terminated"
        assert back.attrs["lerobot"]["tasks"] == ["play"]
        a, b = next(source.episodes()), next(back.episodes())
        assert np.array_equal(a.data["obs"]["camera"], b.data["observation"]["images"]["camera"])
        assert (
            np.array_equal(a.data["reward"], b.data["reward"])
            and b.data["task_index"].tolist() == [0] * b.length
        )


def test_a_stack_that_is_no_sliding_window_is_refused_and_nothing_is_written(tmp_path):
    with mr.create(tmp_path / "s", {"obs": mr.ArraySpec((4, 32, 32), "uint8")}, 10) as store:
        store.extend({"obs": np.random.default_rng(0).integers(0, 255, (5, 1, 4, 32, 32), dtype=np.uint8)})
    out = run_cli("export", tmp_path / "s", tmp_path / "out", "-f", "lerobot", "-q")
    one_line_error(out, 2, "'obs'", "frame stacks", "newest frames")
    assert sorted(os.listdir(tmp_path)) == ["s"]


def test_frames_the_av1_encoder_crashes_on_are_refused_in_one_line_and_export_with_another_codec(tmp_path):
    """SVT-AV1 killed the export with SIGFPE on frames 8 to 24 px wide (16x16 images)."""
    spec = {"obs": mr.ArraySpec((16, 16, 3), "uint8"), "terminated": mr.ArraySpec((), "bool")}
    frames = np.random.default_rng(0).integers(0, 255, (6, 1, 16, 16, 3), dtype=np.uint8)
    with mr.create(tmp_path / "s", spec, 10) as store:
        store.extend({"obs": frames, "terminated": (np.arange(6) == 2)[:, None]})
    out = run_cli("export", tmp_path / "s", tmp_path / "out", "-f", "lerobot", "-q")
    one_line_error(out, 2, "'obs'", "16 px wide", "--codec libx264")
    assert sorted(os.listdir(tmp_path)) == ["s"]
    ok = run_cli("export", tmp_path / "s", tmp_path / "out", "-f", "lerobot", "--lossless", "-q")
    assert ok.returncode == 0, ok.stderr
    import_dataset(tmp_path / "out", tmp_path / "back")
    with mr.open(tmp_path / "back") as back:
        np.testing.assert_array_equal(back.get(slice(None))["obs"], frames)


def test_cli_options_and_one_line_errors(source, tmp_path):
    ok = run_cli(
        "export",
        source.path,
        tmp_path / "out",
        "-f",
        "lerobot",
        "--fps",
        5,
        "--task",
        "pick",
        "--lossless",
        "-q",
    )
    assert ok.returncode == 0, ok.stderr
    info = json.load(open(tmp_path / "out" / "meta" / "info.json"))
    assert (
        info["fps"] == 5 and info["features"]["observation.images.camera"]["info"]["video.pix_fmt"] == "gbrp"
    )
    back = run_cli("import", tmp_path / "out", tmp_path / "back", "-q")
    assert back.returncode == 0 and "lerobot" in back.stdout, back.stderr
    one_line_error(
        run_cli("export", source.path, tmp_path / "x", "-f", "lerobot", "--crf", 99), 2, "crf", "99"
    )
    one_line_error(
        run_cli("export", source.path, tmp_path / "x", "-f", "lerobot", "--codec", "nope"), 2, "'nope'"
    )
    one_line_error(run_cli("export", source.path, tmp_path / "x", "-f", "lerobot", "--preset", 99), 2, "preset")
    one_line_error(run_cli("export", source.path, tmp_path / "x.npz", "--fps", 5), 2, "--fps", "lerobot")
    assert not (tmp_path / "x").exists()


def test_a_v21_dataset_is_refused_with_what_to_do(tmp_path):
    (tmp_path / "old" / "meta").mkdir(parents=True)
    (tmp_path / "old" / "meta" / "info.json").write_text(json.dumps({"codebase_version": "v2.1", "fps": 30}))
    one_line_error(
        run_cli("import", tmp_path / "old", tmp_path / "back"), 4, "v2.1", "convert_dataset_v21_to_v30"
    )
    assert not (tmp_path / "back").exists()


#: ``mmreplay ARGS...`` as ``python -m mmreplay.cli`` runs it, but the third episode's video
#: waits: the export says "midway" on stdout (two episodes written into the partial
#: folder) and reads a line from stdin, where Ctrl-C finds it
HELD_EXPORT = """
import runpy, sys
from mmreplay.formats.lerobot import VideoFiles
add, calls = VideoFiles.add, []
def held(self, frames):
    calls.append(frames)
    if len(calls) == 3:
        print("midway", flush=True)
        sys.stdin.readline()
    return add(self, frames)
VideoFiles.add = held
sys.argv[0] = "mmreplay"
runpy.run_module("mmreplay.cli", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_leaves_nothing_half_written(tmp_path, writers):
    with fill(tmp_path / "s", steps=150, num_envs=2):
        pass
    args = ["export", tmp_path / "s", tmp_path / "out", "-f", "lerobot", "--lossless", "-q"]
    proc = writers.start(HELD_EXPORT, *args, stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline() == "midway\n", proc.communicate(timeout=120)
    assert glob.glob(str(tmp_path / ".out.partial-*" / "videos" / "*" / "*" / "*.mp4"))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Aborted!" in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["s"]
