"""Stores in S3-compatible object storage, against a real S3 API: moto's server, started
once per session on 127.0.0.1, reached over HTTP by obstore (no mock of the client)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest
from conftest import S3_BUCKET, one_line_error, run_cli

import mmreplay as mr

pytest.importorskip("obstore")
pytest.importorskip("moto")

BUCKET = S3_BUCKET
CAPACITY = 40
NUM_ENVS = 2


@pytest.fixture
def url(s3_server):
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}/buffer"


SPEC = {
    "obs": mr.ArraySpec((3,), "float32"),  # [global step, env, 1]
    "action": mr.ArraySpec((2,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "pixels": mr.ArraySpec((4, 4), "uint8"),  # compressed: step % 256
}


def steps(first: int, n: int) -> dict[str, np.ndarray]:
    g = np.arange(first, first + n, dtype=np.float32)[:, None] * np.ones((1, NUM_ENVS), np.float32)
    env = np.broadcast_to(np.arange(NUM_ENVS, dtype=np.float32), g.shape)
    return {
        "obs": np.stack([g, env, np.ones_like(g)], axis=-1),
        "action": np.stack([g, -g], axis=-1),
        "reward": g,
        "terminated": (g.astype(int) % 5 == 4),
        "pixels": np.broadcast_to(
            (g.astype(int) % 256).astype(np.uint8)[..., None, None], (n, NUM_ENVS, 4, 4)
        ),
    }


def make(path, n: int) -> str:
    with mr.create(
        path, SPEC, capacity=CAPACITY, num_envs=NUM_ENVS, chunk_steps=4, compression={"pixels": "zstd"}
    ) as s:
        s.extend(steps(0, n))
    return str(path)


def check_rows(batch: dict[str, np.ndarray]) -> np.ndarray:
    """Every leaf of each row belongs to the same step: the rows are whole."""
    g = batch["obs"][..., 0]
    np.testing.assert_array_equal(batch["reward"], g)
    np.testing.assert_array_equal(batch["action"][..., 0], g)
    np.testing.assert_array_equal(batch["pixels"][..., 0, 0], (g.astype(int) % 256).astype(np.uint8))
    return g


def test_read_in_place_equals_the_local_store(tmp_path, url):
    local = make(tmp_path / "buf", 55)  # wrapped: steps 15..54 retained
    with mr.open(local) as src:
        report = mr.push(src, url)
        assert report.steps == CAPACITY
        with mr.open(url, mode="r") as remote:
            assert (len(remote), remote.total_steps, remote.first_step) == (len(src), 55, 15)
            for a, b in zip(
                (remote.sample(64, rng=3), remote.sample(8, num_steps=5, rng=4)),
                (src.sample(64, rng=3), src.sample(8, num_steps=5, rng=4)),
            ):
                for key in SPEC:
                    np.testing.assert_array_equal(a[key], b[key])
                check_rows(a)
            got = [b["obs"] for b in remote.iterate(batch_size=16)]
            want = [b["obs"] for b in src.iterate(batch_size=16)]
            np.testing.assert_array_equal(np.concatenate(got), np.concatenate(want))
            ra, la = remote.to_arrays(), src.to_arrays()
            assert sorted(ra) == sorted(la)
            for key in la:
                np.testing.assert_array_equal(ra[key], la[key])
            assert [e.status for e in remote.episode_index()] == [e.status for e in src.episode_index()]


def test_push_sends_only_what_changed(tmp_path, url):
    local = make(tmp_path / "buf", 12)
    first = mr.push(local, url)
    assert first.uploaded == first.objects
    again = mr.push(local, url)
    assert again.uploaded == 0  # nothing changed
    with mr.open(local, mode="a") as s:
        s.extend(steps(12, 2))  # two steps: one chunk of the compressed leaf, one shard per leaf
    third = mr.push(local, url)
    assert 0 < third.uploaded < third.objects
    with mr.open(url) as remote, mr.open(local) as src:
        assert remote.total_steps == 14
        np.testing.assert_array_equal(remote.to_arrays()["observations"], src.to_arrays()["observations"])


def test_a_reader_sees_a_new_push_after_refresh(tmp_path, url):
    local = make(tmp_path / "buf", 10)
    mr.push(local, url)
    with mr.open(url) as remote:
        assert remote.total_steps == 10
        with mr.open(local, mode="a") as s:
            s.extend(steps(10, 50))  # past a full ring: every slot rewritten
        mr.push(local, url)
        assert remote.refresh()
        assert (remote.first_step, remote.total_steps) == (20, 60)
        g = check_rows(remote.sample(128, rng=0))
        assert g.min() >= 20 and g.max() < 60


KILLED_PUSH = textwrap.dedent(
    """
    import logging, os, signal, sys
    import mmreplay as mr

    class KillAtFirstUpload(logging.Handler):
        def emit(self, record):
            if "uploaded" in record.getMessage():
                os.kill(os.getpid(), signal.SIGKILL)

    log = logging.getLogger("mmreplay.snapshots")
    log.setLevel(logging.INFO)
    log.addHandler(KillAtFirstUpload())
    mr.push(sys.argv[1], sys.argv[2])
    """
)


def test_a_push_killed_mid_way_leaves_the_previous_snapshot_readable(tmp_path, url, writers):
    local = make(tmp_path / "buf", 30)
    mr.push(local, url)
    with mr.open(local, mode="a") as s:
        s.extend(steps(30, 25))  # overwrites the slots of steps 0..14
    writers.run_killed(KILLED_PUSH, local, url)
    with mr.open(url) as remote:
        # the previous snapshot, less the steps the push had begun to overwrite
        assert remote.total_steps == 30
        assert remote.first_step == 55 - CAPACITY
        arrays = remote.to_arrays()
        np.testing.assert_array_equal(np.unique(arrays["rewards"]), np.arange(15, 30))
        check_rows(remote.sample(64, rng=1))
    mr.push(local, url)  # the next push completes it
    with mr.open(url) as remote:
        assert (remote.first_step, remote.total_steps) == (15, 55)
        check_rows(remote.sample(64, rng=2))


WRITER = textwrap.dedent(
    """
    import sys
    import time
    sys.path.insert(0, sys.argv[2])
    import mmreplay as mr
    from test_object_store import steps

    with mr.open(sys.argv[1], mode="a") as s:
        g = s.total_steps
        while True:
            s.extend(steps(g, 3))
            s.commit()
            g += 3
            time.sleep(0.05)  # a lap of the ring (40 steps) takes longer than a push, mostly
    """
)


def test_readers_see_whole_rows_while_a_running_writer_is_pushed(tmp_path, url, writers):
    local = make(tmp_path / "buf", 30)
    mr.push(local, url)
    writers.start(WRITER, local, os.path.dirname(__file__))  # ended by the fixture
    with mr.open(local) as mine:  # push while the writer writes
        deadline = time.monotonic() + 60
        while mine.live_state().end <= 30 and time.monotonic() < deadline:
            time.sleep(0.01)
    with mr.open(url) as remote:
        ends, sampled = [], 0
        for i in range(4):
            report = mr.push(local, url)
            ends.append(report.state.end)
            remote.refresh()
            state = remote.state
            if remote.window.first == remote.window.end:
                # the writer went round the ring while the push copied it: none of the
                # rows copied can be trusted, and the snapshot says so
                assert state.reserved - CAPACITY >= state.end
                continue
            sampled += 1
            for k in range(3):
                g = check_rows(remote.sample(32, rng=i * 3 + k))
                assert g.max() < remote.total_steps  # committed steps only
                if remote.window.end - remote.window.first >= 3:  # (a push slower than most of a lap keeps fewer)
                    check_rows(remote.sample(4, num_steps=3, rng=k))
    assert ends == sorted(ends)
    assert sampled  # at this pace most pushes take less than a lap of the ring


def test_pull_brings_back_a_store_to_write(tmp_path, url):
    local = make(tmp_path / "buf", 47)
    mr.push(local, url)
    back = mr.pull(url, tmp_path / "back")
    with mr.open(back, mode="a") as s, mr.open(local) as src:
        assert (s.first_step, s.total_steps) == (src.first_step, src.total_steps)
        for key, value in src.to_arrays().items():
            np.testing.assert_array_equal(s.to_arrays()[key], value)
        s.extend(steps(47, 3))
    from mmreplay.verify import verify

    assert verify(str(back), deep=True) == []
    with pytest.raises(mr.TargetError):
        mr.pull(url, back)  # never into an existing store


def test_a_store_in_object_storage_is_read_only(tmp_path, url):
    mr.push(make(tmp_path / "buf", 5), url)
    with pytest.raises(mr.ReadOnlyError, match="pull"):
        mr.open(url, mode="a")
    with mr.open(url) as remote, pytest.raises(mr.ReadOnlyError):
        remote.add(steps(5, 1))


def test_a_missing_store_and_another_store_are_clear_errors(tmp_path, url):
    with pytest.raises(mr.NotABufferError, match="mmreplay.json"):
        mr.open(url)
    mr.push(make(tmp_path / "a", 5), url)
    with mr.create(tmp_path / "b", {"x": mr.ArraySpec((), "int32")}, capacity=8) as other:
        other.add({"x": np.zeros(1, "int32")})
    with pytest.raises(mr.SpecMismatchError, match="another store"):
        mr.push(tmp_path / "b", url)


def test_exports_target_object_storage(tmp_path, s3_server, url):
    local = make(tmp_path / "buf", 20)
    with mr.open(local) as s:
        npz = mr.export(s, url + "/steps.npz", format="npz")
        zarr_out = mr.export(s, url + "/steps.zarr", format="zarr")
        with pytest.raises(mr.TargetError):
            mr.export(s, url + "/steps.npz", format="npz")
        mr.export(s, url + "/steps.npz", format="npz", force=True)
    assert npz.path == url + "/steps.npz"
    from mmreplay.io.remote import ObjectPrefix as Location

    raw = Location(url).get("steps.npz")
    import io

    with np.load(io.BytesIO(raw)) as f:
        assert f["reward"].shape == (20, NUM_ENVS)
    import zarr

    group = zarr.open_group(store=zarr.storage.ObjectStore(Location(zarr_out.path).store, read_only=True), mode="r")
    assert group["obs"].shape == (20, NUM_ENVS, 3)


def test_an_export_to_a_bare_bucket_is_one_line_naming_the_url(tmp_path, s3_server):
    local = make(tmp_path / "buf", 5)
    with mr.open(local) as s, pytest.raises(mr.BadInputError, match="s3://replays"):
        mr.export(s, f"s3://{BUCKET}", format="npz")
    out = run_cli("export", local, f"s3://{BUCKET}/", "-f", "npz", "-q")
    one_line_error(out, 2, f"s3://{BUCKET}/", "below the bucket")


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mmreplay.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen) -> tuple[int, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out + err


def test_cli_push_inspect_verify_stats_export_pull(tmp_path, s3_server, url):
    local = make(tmp_path / "buf", 33)
    code, out = finished(cli("--endpoint-url", s3_server, "push", local, url))
    assert code == 0 and "33 steps" in out, out
    # the reading commands are independent: run them side by side
    runs = {
        "inspect": cli("inspect", url, "--json"),
        "verify": cli("verify", url),
        "stats": cli("stats", url),
        "export": cli("export", url, url + "-export.parquet", "-f", "parquet", "-q"),
        "pull": cli("pull", url, str(tmp_path / "back")),
    }
    results = {name: finished(proc) for name, proc in runs.items()}
    assert all(code == 0 for code, _ in results.values()), results
    assert '"total_steps": 33' in results["inspect"][1]
    assert "ok" in results["verify"][1]
    assert "33 steps" in results["pull"][1]
    from mmreplay.io.remote import ObjectPrefix as Location

    assert Location(url + "-export.parquet").list()  # the parquet files were uploaded


def test_verify_finds_missing_and_damaged_objects(tmp_path, url):
    from mmreplay.io.remote import ObjectPrefix as Location
    from mmreplay.objstore import verify_url

    mr.push(make(tmp_path / "buf", 33), url)
    assert verify_url(url) == []
    location = Location(url)
    location.delete(["data.zarr/reward/c/0/0"])
    location.put("data.zarr/pixels/c/1/0/0/0", b"not zstd")
    problems = verify_url(url)
    assert len(problems) == 2, problems
    assert any("reward" in p and "missing" in p for p in problems), problems
    assert any("pixels" in p and "does not decode" in p for p in problems), problems


def test_verify_finds_a_damaged_episode_index_and_group_metadata_that_readers_and_pull_use(tmp_path, url):
    """A pushed episode index that lost its last records still parses: readers in place and
    a pulled copy list fewer episodes, so verify compares it with the role leaves, as it
    does locally; zarr readers need the group metadata."""
    from mmreplay.io.remote import ObjectPrefix as Location
    from mmreplay.objstore import verify_url

    mr.push(make(tmp_path / "buf", 33), url)
    location = Location(url)
    index = location.get("episodes.idx")
    location.put("episodes.idx", index[: len(index) - 32])
    with mr.open(url) as s, mr.open(tmp_path / "buf") as local:
        assert len(list(s.episodes())) < len(list(local.episodes()))
    code, out = finished(cli("verify", url))
    assert code == 1 and f"problem: episode index {url}/episodes.idx: its episode ends" in out, out
    location.put("episodes.idx", index)
    location.delete(["data.zarr/zarr.json"])
    assert verify_url(url) == [f"{url}/data.zarr/zarr.json: zarr group metadata is missing or damaged"]


def test_a_push_to_a_prefix_of_other_objects_is_refused_and_sends_nothing(tmp_path, url):
    """An export there (or any other data): the store's objects would mix with them, and a
    pull bring them all back into the store's folder. The objects a first push cut short
    left are the store's own: the next push completes it."""
    from mmreplay.io.remote import ObjectPrefix as Location

    local = make(tmp_path / "buf", 12)
    with mr.open(local) as s:
        mr.export(s, url, format="parquet")
    before = Location(url).list()
    with pytest.raises(mr.TargetError, match="part-00000.parquet"):
        mr.push(local, url)
    out = run_cli("push", local, url)
    one_line_error(out, 2, url, "no mmreplay store", "new prefix")
    assert Location(url).list() == before
    cut = url + "-cut"
    mr.push(local, cut)
    Location(cut).delete(["mmreplay.json", "mmreplay.state", "mmreplay.push.json"])
    assert mr.push(local, cut).steps == 12


def test_without_obstore_the_error_names_the_extra(tmp_path):
    code = "import sys; sys.modules['obstore'] = None\nimport mmreplay as mr\nmr.open('s3://bucket/x')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0
    assert "mmreplay[s3]" in out.stderr


def test_a_prioritized_store_samples_uniformly_from_object_storage_and_by_priority_once_pulled(tmp_path, url):
    with mr.create(tmp_path / "buf", SPEC, capacity=CAPACITY, num_envs=NUM_ENVS, sampler="prioritized") as s:
        s.extend(steps(0, 10))
        s.commit()
        s.update_priorities(np.arange(10), np.zeros(10, np.int64), np.full(10, 5.0))
        mr.push(s, url)
    with pytest.warns(UserWarning, match="uniform"), mr.open(url) as remote:
        check_rows(remote.sample(16, rng=0))
    with mr.open(mr.pull(url, tmp_path / "back"), mode="a") as back:
        assert back.sampler.name == "prioritized"
        check_rows(back.sample(16, rng=0))


def test_compressed_rows_fetch_only_the_frames_a_batch_needs(tmp_path, url):
    """A rows:zstd leaf: the shard indexes are fetched once, then a batch of k rows
    fetches about k frames' bytes (not whole segments), staged rows included."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (300, 1, 64, 64), dtype=np.uint8)  # incompressible: 4 KiB a frame
    spec = {"frame": mr.ArraySpec((64, 64), "uint8"), "step": mr.ArraySpec((), "int64")}
    writer = mr.create(
        tmp_path / "s", spec, capacity=256, num_envs=1, chunk_steps=64, compression={"frame": "rows:zstd"}
    )
    writer.extend({"frame": frames, "step": np.arange(300)[:, None]})
    writer.commit()
    mr.push(writer, url)  # the writer is in segment 0 of its second lap: those rows are staged
    with mr.open(url) as reader:
        traffic = reader.location.traffic
        # slots 0..43 hold the staged steps 256..299; 30 slots apart is more than the gap merged
        steps = np.array([256, 286, 90, 140, 200, 250])
        frame = reader.leaf_paths.index("frame")
        got = reader.read_steps(steps, leaves=[frame])[0]
        np.testing.assert_array_equal(got, frames[steps])
        first = (traffic.requests, traffic.bytes)
        # the staging header and the 4 segments' indexes together (segment 0's shard is from
        # the first lap), then the staged rows' span and the 4 sealed frames
        assert first[0] == 1 + 4 + 1 + 4
        got = reader.read_steps(steps[2:], leaves=[frame])[0]
        np.testing.assert_array_equal(got, frames[steps[2:]])
        requests, nbytes = traffic.requests - first[0], traffic.bytes - first[1]
        assert requests == 1 + 4  # the header again, then only the frames: indexes are cached
        frame_bytes = 64 * 64
        assert 4 * frame_bytes < nbytes < 4096 + 4 * frame_bytes * 1.01  # the header and 4 frames, not 256 KiB segments
        batch, info = reader.sample(32, return_info=True, rng=1)
        np.testing.assert_array_equal(batch["frame"], frames[info.step, info.env])
        np.testing.assert_array_equal(batch["step"][:, 0] if batch["step"].ndim > 1 else batch["step"], info.step)
    writer.close()


def test_compressed_rows_of_a_segment_pushed_again_are_indexed_again(tmp_path, url):
    """A cached shard index is tied to its object's ETag: after a push replaces a sealed
    segment (here by ``set``, which moves no cursor, so ``refresh`` drops nothing), the
    reader fetches the new index rather than reading frames at stale offsets."""
    frames = np.random.default_rng(1).integers(0, 256, (130, 1, 8, 8), dtype=np.uint8)
    spec = {"frame": mr.ArraySpec((8, 8), "uint8")}
    path = tmp_path / "s"
    with mr.create(path, spec, capacity=256, num_envs=1, chunk_steps=64, compression={"frame": "rows:lz4"}) as w:
        w.extend({"frame": frames})
    mr.push(path, url)
    with mr.open(url) as reader:
        steps = np.array([5, 10, 70])
        np.testing.assert_array_equal(reader.read_steps(steps)[0], frames[steps])
        with mr.open(path, mode="a") as w:
            w.set(5, {"frame": np.zeros((1, 8, 8), np.uint8)})  # a shorter frame: later offsets move
        mr.push(path, url)
        before = reader.location.traffic.requests
        expected = frames[steps].copy()
        expected[0] = 0
        np.testing.assert_array_equal(reader.read_steps(steps)[0], expected)
        # the header and segment 1's frame; segment 0's frames are refused by the ETag (not
        # counted); then the header, segment 0's new index and both segments' frames again
        assert reader.location.traffic.requests - before == 2 + 1 + 1 + 2


@pytest.mark.parametrize("codec", [None, "rows:lz4"])
def test_a_store_keeping_each_frame_once_reads_and_verifies_in_object_storage(tmp_path, s3_server, url, codec):
    """The side ring of final frames lives in a subfolder: read and checked under the
    store's URL like its leaves."""
    from frames_episodes import Episodes, spec

    if codec:
        pytest.importorskip("cramjam")
    episodes = Episodes(2, (6, 6), 4, -1, "repeat", 0.15, 7)
    frames = mr.Frames(frame_stack=4, final_slots=16)
    compression = {"obs": codec} if codec else None
    with mr.create(tmp_path / "buf", spec((6, 6), 4, -1), 30, num_envs=2, frames=frames, compression=compression) as s:
        for _ in range(50):
            s.add(episodes.step())
    mr.push(tmp_path / "buf", url)
    with mr.open(tmp_path / "buf") as local, mr.open(url) as remote:
        assert remote.window == local.window
        for got, want in [
            (remote.sample(64, rng=1), local.sample(64, rng=1)),
            (remote.sample(3, num_steps=8, rng=2), local.sample(3, num_steps=8, rng=2)),
            (remote.get(slice(None)), local.get(slice(None))),
        ]:
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        assert (remote.get(slice(None))["terminated"] | remote.get(slice(None))["truncated"]).any()
    code, out = finished(cli("verify", url))
    assert code == 0 and "ok" in out and "Warning" not in out, out
    from mmreplay.io.remote import ObjectPrefix as Location

    side = Location(url).child("frames")
    side.delete([key for key in side.list() if "ref" in key][:1])
    code, out = finished(cli("verify", url))
    assert code == 1 and "side ring" in out and "ref" in out, out


FRAME_SPEC = {"frame": mr.ArraySpec((8, 8), "uint8"), "step": mr.ArraySpec((), "int64")}


def frame_steps(first: int, n: int) -> dict[str, np.ndarray]:
    step = np.arange(first, first + n)[:, None]
    return {"frame": np.broadcast_to((step % 256).astype(np.uint8)[..., None, None], (n, 1, 8, 8)), "step": step}


@contextlib.contextmanager
def on_upload(monkeypatch, act):
    """Runs ``act(key)`` as a push reports each object it uploaded, one upload at a time
    in the order the push lists them."""
    import logging

    import mmreplay.snapshots

    class Hook(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if ": uploaded " in text:
                act(text.split(": uploaded ", 1)[1].rsplit(" (", 1)[0])

    monkeypatch.setattr(mmreplay.snapshots, "UPLOADS_IN_FLIGHT", 1)
    log = logging.getLogger("mmreplay.snapshots")
    level, hook = log.level, Hook()
    log.setLevel(logging.INFO)
    log.addHandler(hook)
    try:
        yield
    finally:
        log.removeHandler(hook)
        log.setLevel(level)


def test_a_push_keeps_the_rows_a_writer_seals_while_it_runs(tmp_path, url, monkeypatch):
    """A row-frame leaf's staging segment is sealed into a shard while a push runs: the
    snapshot holds its committed rows (raw in the staging object the push lists with the
    shards), not a staging object that points at a shard the push never saw."""
    writer = mr.create(tmp_path / "s", FRAME_SPEC, capacity=16, chunk_steps=4, compression={"frame": "rows:lz4"})
    writer.extend(frame_steps(0, 6))  # segment 0 sealed; steps 4, 5 staged in segment 1
    writer.commit()

    def writer_moves_on(key):
        if writer.total_steps == 6:  # at the first upload
            writer.extend(frame_steps(6, 3))  # segment 1 sealed, staging in segment 2
            writer.commit()

    with on_upload(monkeypatch, writer_moves_on):
        report = mr.push(writer, url)
    assert writer.total_steps == 9 and report.state.end == 6
    with mr.open(url) as remote:
        got = remote.get(slice(None))
    np.testing.assert_array_equal(got["step"], np.arange(6)[:, None])
    np.testing.assert_array_equal(got["frame"], frame_steps(0, 6)["frame"])
    writer.close()


READ_WHOLE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import mmreplay as mr

    with mr.open(sys.argv[1]) as remote:
        got = remote.get(slice(None))
    step = got["step"][:, 0]
    assert (got["frame"] == (step % 256).astype(np.uint8)[:, None, None, None]).all(), step
    print(step.min(), step.max())
    """
)


def test_a_reader_during_a_push_never_sees_staging_ahead_of_its_shards(tmp_path, url, monkeypatch):
    """A push sends a row-frame leaf's staging object after the shards it sealed: a reader
    of the previous snapshot finds the rows that left staging in their new shard."""
    path = tmp_path / "s"
    with mr.create(path, FRAME_SPEC, capacity=16, chunk_steps=4, compression={"frame": "rows:lz4"}) as writer:
        writer.extend(frame_steps(0, 6))
        writer.commit()
        mr.push(writer, url)  # steps 4, 5 staged in segment 1
        writer.extend(frame_steps(6, 3))  # segment 1 sealed, staging in segment 2
        writer.commit()
        reads = []

        def read_the_url(key):
            if key.endswith("rows.staging"):  # the moment readers see the new staging
                reads.append(subprocess.run([sys.executable, "-c", READ_WHOLE, url], capture_output=True, text=True))

        with on_upload(monkeypatch, read_the_url):
            mr.push(writer, url)
    assert len(reads) == 1
    assert reads[0].returncode == 0 and reads[0].stdout.split() == ["0", "5"], reads[0].stderr[-2000:]


PUSH_LOOP = textwrap.dedent(
    """
    import sys
    import mmreplay as mr

    while True:
        mr.push(sys.argv[1], sys.argv[2])
    """
)


@pytest.mark.parametrize("compression", [None, "rows:lz4"])
def test_a_pull_while_a_running_writer_is_pushed_brings_back_its_committed_rows(tmp_path, url, writers, compression):
    """Pushes of a running writer move the ring's oldest step on: a pull they overlap is
    of the same history, and brings back whole rows of one committed prefix."""
    from mmreplay.verify import verify

    local = str(tmp_path / "buf")  # wrapped: every push of the writer moves its oldest step on
    with mr.create(local, SPEC, CAPACITY, num_envs=NUM_ENVS, chunk_steps=4, compression={"pixels": compression}) as s:
        s.extend(steps(0, 55))
    mr.push(local, url)
    writers.start(WRITER, local, os.path.dirname(__file__))
    writers.start(PUSH_LOOP, local, url)
    with mr.open(url) as remote:  # pushes of the running writer have begun
        deadline = time.monotonic() + 60
        while remote.total_steps < 70 and time.monotonic() < deadline:
            time.sleep(0.05)
            remote.refresh()
    for i in range(4):
        back = mr.pull(url, tmp_path / f"back{i}")
        with mr.open(back) as s:
            if s.window.first == s.window.end:  # the writer went round the ring while it was pulled
                continue
            g = check_rows(s.get(slice(None)))
            assert (np.diff(g[:, 0]) == 1).all() and g[-1, 0] == s.total_steps - 1
        assert verify(str(back), deep=True) == []


def test_an_export_of_a_store_in_object_storage_names_its_url_as_the_source(tmp_path, url):
    import json

    import h5py

    mr.push(make(tmp_path / "buf", 20), url)
    with mr.open(url) as remote:
        mr.export(remote, tmp_path / "d4rl.h5", format="d4rl")
        minari = mr.export(remote, tmp_path / "minari", format="minari", dataset_id="pointchase/remote-v0")
    with h5py.File(tmp_path / "d4rl.h5") as f:
        assert f.attrs["source"] == url
    with open(os.path.join(minari.path, "metadata.json")) as f:
        assert json.load(f)["description"].endswith(f"from {url}")


def test_an_hdf5_store_copied_to_object_storage_is_refused_with_what_works(tmp_path, url):
    """push refuses an hdf5 store; one copied there by other means is refused by open and
    pull alike, each saying to convert it (neither sends the user to the other)."""
    from mmreplay.io.remote import ObjectPrefix as Location

    path = tmp_path / "h5"
    with mr.create(path, {"x": mr.ArraySpec((2,), "float32")}, capacity=8, backend="hdf5") as s:
        s.add({"x": np.ones((1, 2), "float32")})
    with pytest.raises(mr.CorruptBufferError, match="convert --backend zarr"):
        mr.push(path, url)
    location = Location(url)
    for name in os.listdir(path):
        location.put(name, (path / name).read_bytes())
    for attempt in (lambda: mr.open(url), lambda: mr.pull(url, tmp_path / "back")):
        with pytest.raises(mr.CorruptBufferError, match="convert --backend zarr") as refused:
            attempt()
        assert "pull" not in str(refused.value)


def test_verify_checks_a_row_frame_leaf_as_readers_read_it(tmp_path, url):
    """Rows a live writer still stages have no shard object: that is health. The staging
    object readers need is checked, as is each committed row's frame."""
    from mmreplay.io.remote import ObjectPrefix as Location
    from mmreplay.objstore import verify_url

    with mr.create(tmp_path / "s", FRAME_SPEC, capacity=16, chunk_steps=4, compression={"frame": "rows:lz4"}) as w:
        w.extend(frame_steps(0, 6))  # segment 1 staged: no shard of it yet
        mr.push(w, url)
    assert verify_url(url) == [] and verify_url(url, deep=False) == []
    location = Location(url)
    staging = "data.zarr/frame/rows.staging"
    location.put(staging, location.get(staging)[:100])
    problems = verify_url(url, deep=False)
    assert len(problems) == 1 and "staging" in problems[0] and "100 bytes" in problems[0], problems
    location.delete([staging])
    problems = verify_url(url)
    assert len(problems) == 1 and "staging" in problems[0] and "missing" in problems[0], problems


def test_verify_finds_a_mapped_leafs_array_metadata_changed(tmp_path, url):
    """A mapped leaf is read by byte range whatever its zarr.json says; zarr readers
    follow it, so a changed shape or dtype is damage."""
    import json

    from mmreplay.io.remote import ObjectPrefix as Location
    from mmreplay.objstore import verify_url

    mr.push(make(tmp_path / "buf", 33), url)
    location = Location(url)
    doc = json.loads(location.get("data.zarr/reward/zarr.json"))
    location.put("data.zarr/reward/zarr.json", json.dumps({**doc, "data_type": "float64"}).encode())
    problems = verify_url(url)
    assert len(problems) == 1 and "reward" in problems[0] and "float64" in problems[0], problems


def test_a_missing_array_metadata_names_the_object_not_a_local_path(tmp_path, url):
    from mmreplay.io.remote import ObjectPrefix as Location

    mr.push(make(tmp_path / "buf", 5), url)
    Location(url).delete(["data.zarr/reward/zarr.json"])
    with pytest.raises(mr.CorruptBufferError, match="reward") as refused:
        mr.open(url)
    assert "file://" not in str(refused.value) and "s3:/" + BUCKET not in str(refused.value), refused.value


def test_push_of_an_open_group_names_what_it_takes(tmp_path):
    folder = str(tmp_path / "g")
    mr.create_group(folder, {"x": mr.ArraySpec((), "int64")}, 2, capacity=8).close()
    with mr.open_group(folder) as group:
        with pytest.raises(mr.BadInputError, match="push takes a store or its folder, got a Group"):
            mr.push(group, "s3://bucket/x")


def test_verify_reports_a_row_frame_leafs_damaged_array_metadata(tmp_path, url):
    """A row-frame leaf's zarr.json gone or cut short is a problem verify lists (exit 1),
    not a raw zarr error or a traceback."""
    from conftest import run_cli

    from mmreplay.io.remote import ObjectPrefix as Location

    with mr.create(tmp_path / "s", FRAME_SPEC, capacity=16, chunk_steps=4, compression={"frame": "rows:lz4"}) as w:
        w.extend(frame_steps(0, 6))
        mr.push(w, url)
    location = Location(url)
    key = "data.zarr/frame/zarr.json"
    for damage in (lambda raw: location.put(key, raw[:100]), lambda raw: location.delete([key])):
        damage(location.get(key) or b"")
        out = run_cli("verify", url)
        assert out.returncode == 1, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert "'frame'" in out.stdout and "data.zarr/frame" in out.stdout, out.stdout


def test_a_shard_object_cut_before_the_rows_read_is_a_corrupt_store(tmp_path, url):
    """A range past the end of a cut shard object (the server's InvalidRange) says the
    object ends before its rows, as a range that ends past it does (exit 4, not 2)."""
    from conftest import one_line_error, run_cli

    from mmreplay.io.remote import ObjectPrefix as Location

    mr.push(make(tmp_path / "buf", 33), url)
    key = "data.zarr/reward/c/0/0"
    Location(url).put(key, Location(url).get(key)[:8])
    with mr.open(url) as remote, pytest.raises(mr.CorruptBufferError, match=key):
        remote.get(32)
    one_line_error(run_cli("stats", url), 4, key)


def test_a_pull_whose_copy_does_not_open_leaves_no_folder(tmp_path, url):
    """What a pull brought back is checked before it is renamed into place: a failed pull
    leaves no store behind (the next pull may go to the same folder), and names the URL."""
    from mmreplay.io.remote import ObjectPrefix as Location

    with mr.create(tmp_path / "s", FRAME_SPEC, capacity=16, chunk_steps=4, compression={"frame": "rows:lz4"}) as w:
        w.extend(frame_steps(0, 6))
        mr.push(w, url)
    Location(url).delete(["data.zarr/frame/rows.staging"])
    back = tmp_path / "back"
    with pytest.raises(mr.CorruptBufferError, match="staging") as refused:
        mr.pull(url, back)
    assert url in str(refused.value) and str(tmp_path) not in str(refused.value), refused.value
    assert not back.exists() and os.listdir(tmp_path) == ["s"]


def test_a_damaged_state_object_points_at_pushing_again_not_at_recover(tmp_path, url):
    """recover repairs local folders only: the advice for a store in object storage whose
    state object is damaged is to push it again."""
    from conftest import one_line_error, run_cli

    from mmreplay.io.remote import ObjectPrefix as Location
    from mmreplay.statefile import STATE_FILE

    mr.push(make(tmp_path / "buf", 5), url)
    Location(url).put(STATE_FILE, b"\0" * len(Location(url).get(STATE_FILE)))
    line = one_line_error(run_cli("inspect", url), 4, "neither state slot is valid", "push the store there again")
    assert "recover" not in line, line
