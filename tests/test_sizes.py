"""Size before and after: ``mr.estimate``, ``create --dry-run``, ``inspect``'s projection."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from frames_episodes import Episodes
from frames_episodes import spec as frames_spec

import mmreplay as mr
from mmreplay.files import disk_usage

MMREPLAY = shutil.which("mmreplay") or os.path.join(os.path.dirname(sys.executable), "mmreplay")

SPEC = {
    "obs": {"pixels": mr.ArraySpec((84, 84, 3), "uint8"), "state": mr.ArraySpec((7,), "float32")},
    "action": mr.ArraySpec((), "int64"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
}


def shell(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([MMREPLAY, *map(str, args)], capture_output=True, text=True, timeout=300)


def data_bytes(path) -> int:
    return disk_usage(
        os.path.join(path, "data.zarr" if os.path.isdir(os.path.join(path, "data.zarr")) else "data.h5")
    )


def frames(n: int, rng: np.random.Generator) -> np.ndarray:
    """Game-like frames: a noisy dark field with a few moving blocks."""
    x = rng.integers(0, 4, (n, 84, 84, 3), dtype=np.uint8)
    x[:, ::12, :, 2] = 60
    pos = rng.integers(0, 70, (n, 3, 2))
    for i in range(n):
        for k, (r, c) in enumerate(pos[i]):
            x[i, r : r + 8, c : c + 8, k] = 220
    return x


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
@pytest.mark.parametrize("capacity, num_envs", [(1000, 3), (37, 1)])
def test_uncompressed_estimate_is_exact_against_the_created_store(tmp_path, backend, capacity, num_envs):
    size = mr.estimate(SPEC, capacity, num_envs, backend=backend)
    assert size.exact and size.total is not None
    with mr.create(tmp_path / "b", SPEC, capacity, num_envs, backend=backend) as store:
        made = data_bytes(store.path)
        per_leaf = {leaf.path: leaf.bytes for leaf in size.leaves}
        if backend == "zarr":  # one shard file per leaf
            for leaf in store.metadata.leaves:
                assert os.path.getsize(os.path.join(store.path, leaf.file)) == per_leaf[leaf.path], leaf.path
        metadata_file = sum(os.path.getsize(os.path.join(store.path, f)) for f in ("mmreplay.json", "mmreplay.state"))
        # fill it: mapped leaves do not grow
        rng = np.random.default_rng(0)
        store.extend(
            {
                "obs": {
                    "pixels": rng.integers(0, 255, (capacity, num_envs, 84, 84, 3), dtype=np.uint8),
                    "state": np.ones((capacity, num_envs, 7), "float32"),
                },
                "action": np.ones((capacity, num_envs), "int64"),
                "reward": np.ones((capacity, num_envs), "float32"),
                "terminated": np.zeros((capacity, num_envs), bool),
            }
        )
    assert size.data_bytes == made  # exact, created and filled
    assert data_bytes(tmp_path / "b") == made
    assert abs(size.metadata_file - metadata_file) < 16  # the timestamps' digits
    assert size.preallocated == size.total


def test_compressed_estimate_from_a_sample_is_close_to_the_filled_store(tmp_path):
    rng = np.random.default_rng(1)
    capacity, num_envs = 400, 2
    pixels = frames(capacity * num_envs, rng).reshape(capacity, num_envs, 84, 84, 3)
    sample = {"obs": {"pixels": pixels[:100]}}  # a quarter of what the store will hold
    size = mr.estimate(SPEC, capacity, num_envs, compression={"obs/pixels": "zstd"}, sample=sample)
    leaf = next(s for s in size.leaves if s.path == "obs/pixels")
    assert not size.exact and leaf.ratio > 2 and leaf.bytes is not None
    with mr.create(tmp_path / "b", SPEC, capacity, num_envs, compression={"obs/pixels": "zstd"}) as store:
        store.extend(
            {
                "obs": {"pixels": pixels, "state": np.zeros((capacity, num_envs, 7), "float32")},
                "action": np.zeros((capacity, num_envs), "int64"),
                "reward": np.zeros((capacity, num_envs), "float32"),
                "terminated": np.zeros((capacity, num_envs), bool),
            }
        )
    real = disk_usage(os.path.join(tmp_path, "b", "data.zarr", "obs", "pixels"))
    assert abs(leaf.bytes - real) / real < 0.25, (leaf.bytes, real)
    assert abs(size.total - disk_usage(tmp_path / "b")) / disk_usage(tmp_path / "b") < 0.1


def test_compressed_leaves_without_a_sample_are_unknown_with_an_upper_bound():
    size = mr.estimate(SPEC, 1000, 2, compression="zstd")
    assert size.total is None and size.preallocated == size.overhead
    assert size.upper_bound >= size.overhead + sum(leaf.raw_bytes for leaf in size.leaves)
    assert json.loads(json.dumps(size.to_json()))["total_bytes"] is None


@pytest.mark.parametrize("frames", [None, mr.Frames(frame_stack=4)])
def test_preallocated_counts_the_staging_segments_of_row_frame_leaves(tmp_path, frames):
    """create allocates each row-frame leaf's raw staging segment (and the side ring's) at
    once: preallocated left them out, and said 19 KiB of a store that took 4 MiB empty."""
    pytest.importorskip("cramjam")
    spec = frames_spec((84, 84), 4, -1)
    options = {"compression": {"obs": "rows:lz4"}, "frames": frames}
    size = mr.estimate(spec, 1000, 2, **options)
    mr.create(tmp_path / "b", spec, 1000, 2, **options).close()
    assert abs(size.preallocated - disk_usage(tmp_path / "b")) < 64  # the json's timestamps' digits
    assert size.upper_bound >= size.preallocated


@pytest.mark.parametrize(
    "backend, compression",
    [("zarr", "rows:lz4"), ("zarr", "rows:zstd"), ("zarr", "rows:zstd:3:dict"), ("zarr", "zstd"), ("zarr", "blosc"),
     ("zarr", "gzip"), ("hdf5", "zstd"), ("hdf5", "gzip")],
)
def test_the_upper_bound_without_a_sample_holds_for_a_full_store_of_noise(tmp_path, backend, compression):
    """Noise does not compress: the bound must hold all the same. Row frames used to be
    bounded by their raw rows, without their staging segment, frames' size fields and
    shard index (a store of 84x84 frames twice its 'at most', of bytes 13 times)."""
    if compression.startswith("rows:"):
        pytest.importorskip("cramjam")
    spec = {"pixels": mr.ArraySpec((84, 84), "uint8"), "byte": mr.ArraySpec((), "uint8"), "odd": mr.ArraySpec((3, 7), "uint8")}
    capacity, num_envs = 150, 2
    size = mr.estimate(spec, capacity, num_envs, backend=backend, compression=compression)
    rng = np.random.default_rng(0)
    noise = {path: rng.integers(0, 256, (capacity + 7, num_envs, *leaf.shape), dtype=np.uint8) for path, leaf in spec.items()}
    with mr.create(tmp_path / "b", spec, capacity, num_envs, backend=backend, compression=compression) as store:
        store.extend(noise)  # past a full ring: every chunk and segment written
    assert disk_usage(tmp_path / "b") <= size.upper_bound


@pytest.mark.parametrize(
    "sample, error",
    [
        ({"obs": {"pixels": np.zeros((4, 84, 84), np.uint8)}}, r"expected rows shaped \(n, 84, 84, 3\)"),
        ({"nope": np.zeros(3)}, "not in the spec"),
        ({"obs": {"pixels": np.zeros((4, 84, 84, 3), np.complex64)}}, "does not cast"),
    ],
)
def test_a_bad_sample_says_what_was_expected(sample, error):
    with pytest.raises(mr.BadInputError, match=error):
        mr.estimate(SPEC, 100, 2, compression="zstd", sample=sample)


def spec_file(tmp_path, capacity: int) -> str:
    path = tmp_path / "spec.json"
    path.write_text(
        json.dumps(
            {
                "spec": {
                    "pixels": {"shape": [84, 84], "dtype": "uint8"},
                    "reward": {"shape": [], "dtype": "float32"},
                },
                "capacity": capacity,
                "num_envs": 4,
            }
        )
    )
    return str(path)


def test_create_dry_run_reports_the_size_and_creates_nothing(tmp_path):
    spec = spec_file(tmp_path, 500)
    r = shell("create", tmp_path / "b", "--spec", spec, "--dry-run")
    assert r.returncode == 0, r.stderr
    want = mr.estimate(
        {"pixels": mr.ArraySpec((84, 84), "uint8"), "reward": mr.ArraySpec((), "float32")}, 500, 4
    )
    printed = int(re.search(r"\(([\d,]+) bytes, exact\)", r.stdout).group(1).replace(",", ""))
    assert abs(printed - want.total) < 64  # mmreplay.json's timestamps' digits
    assert "pixels" in r.stdout and "free space" in r.stdout
    assert not (tmp_path / "b").exists()
    made = shell("create", tmp_path / "b", "--spec", spec)
    assert made.returncode == 0 and "preallocated" in made.stdout
    # the estimate's data and metadata files against the store on disk (the json's digits may vary)
    assert abs(disk_usage(tmp_path / "b") - want.total) < 64


def test_create_dry_run_with_a_sample_estimates_compressed_leaves(tmp_path):
    spec = spec_file(tmp_path, 500)
    np.savez(tmp_path / "s.npz", pixels=frames(16, np.random.default_rng(2))[..., 0])
    r = shell(
        "create",
        tmp_path / "b",
        "--spec",
        spec,
        "--dry-run",
        "--compression",
        "zstd",
        "--compression",
        "reward=zstd",
        "--sample",
        tmp_path / "s.npz",
    )
    assert r.returncode == 0, r.stderr
    assert "estimated" not in r.stdout.splitlines()[0]  # reward has no sample: the total is a bound
    assert "at most" in r.stdout and "(est.," in r.stdout and "? (pass --sample)" in r.stdout
    bad = shell("create", tmp_path / "b", "--spec", spec, "--sample", tmp_path / "s.npz")
    assert bad.returncode == 2 and "--dry-run" in bad.stderr


@pytest.mark.parametrize("kind", ["npy", "text"])
def test_create_dry_run_with_a_sample_that_is_no_npz_says_what_it_got(tmp_path, kind):
    """An .npy ended in a traceback (np.load gives one array, no archive); a text file
    was refused as "pickled (object) data"."""
    spec = spec_file(tmp_path, 500)
    sample = tmp_path / f"s.{kind}"
    np.save(sample, np.zeros(3)) if kind == "npy" else sample.write_text("obs: 1\n")
    r = shell("create", tmp_path / "b", "--spec", spec, "--dry-run", "--sample", sample)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"{sample}: expected an .npz of arrays keyed by leaf path, or a store; got " in r.stderr
    assert ("an .npy of one array" if kind == "npy" else "b'obs:'") in r.stderr and "pickle" not in r.stderr


def test_create_refuses_a_buffer_the_disk_cannot_hold(tmp_path):
    spec = spec_file(tmp_path, 10**9)  # 28 TB of frames
    r = shell("create", tmp_path / "b", "--spec", spec)
    assert r.returncode == 2 and "free" in r.stderr and "bytes" in r.stderr
    assert not (tmp_path / "b").exists()
    dry = shell("create", tmp_path / "b", "--spec", spec, "--dry-run")
    assert dry.returncode == 0 and "create would refuse" in dry.stdout


def test_create_logs_what_it_preallocates(tmp_path, caplog):
    caplog.set_level("INFO", logger="mmreplay")
    with mr.create(tmp_path / "b", SPEC, 100, 2):
        pass
    size = mr.estimate(SPEC, 100, 2)
    logged = [r.getMessage() for r in caplog.records if "preallocating" in r.getMessage()]
    assert logged and f"preallocating {size.data_bytes} bytes" in logged[0]


def test_inspect_projects_the_size_when_full(tmp_path):
    rng = np.random.default_rng(3)
    capacity, num_envs = 400, 2
    spec = {"pixels": mr.ArraySpec((84, 84), "uint8"), "reward": mr.ArraySpec((), "float32")}
    pixels = frames(capacity * num_envs, rng)[..., 0].reshape(capacity, num_envs, 84, 84)
    with mr.create(
        tmp_path / "b", spec, capacity, num_envs, compression={"pixels": "zstd"}, chunk_steps=50
    ) as store:
        store.extend({"pixels": pixels[:100], "reward": np.zeros((100, num_envs), "float32")})
    r = shell("inspect", tmp_path / "b", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    leaves = {leaf["path"]: leaf for leaf in info["leaves"]}
    px, rw = leaves["pixels"], leaves["reward"]
    assert rw["bytes_per_step"] == rw["bytes_on_disk"] / capacity  # mapped: allocated whole
    assert rw["projected_bytes_when_full"] == rw["bytes_on_disk"]
    assert 0 < px["bytes_per_step"] < px["bytes_on_disk"] / 100
    projected = px["projected_bytes_when_full"]
    with mr.open(tmp_path / "b", mode="a") as store:
        store.extend({"pixels": pixels[100:], "reward": np.zeros((300, num_envs), "float32")})
    full = disk_usage(tmp_path / "b" / "data.zarr" / "pixels")
    assert abs(projected - full) / full < 0.15, (projected, full)
    assert info["projected_bytes_when_full"] == pytest.approx(
        info["bytes_on_disk"] - px["bytes_on_disk"] + projected, abs=1
    )
    table = shell("inspect", tmp_path / "b").stdout
    assert "per step" in table and "when full" in table


def test_inspect_projects_a_frames_store_from_the_rows_written_not_those_retained(tmp_path):
    """A frames store whose side ring dropped steps keeps fewer steps than its leaves hold
    rows: inspect divided the rows' bytes by the retained steps, and said a full store
    would take several times what it takes once full."""
    pytest.importorskip("cramjam")
    spec = frames_spec((84, 84), 4, -1)
    options = {"compression": {"obs": "rows:lz4"}, "frames": mr.Frames(frame_stack=4, final_slots=6)}
    with mr.create(tmp_path / "b", spec, 200, 2, **options) as store:
        episodes = Episodes(2, (84, 84), 4, -1, "repeat", 0.2, 0)  # short episodes: steps dropped
        for _ in range(200):
            store.add(episodes.step())
        assert len(store) < 100
    r = shell("inspect", tmp_path / "b", "--json")
    assert r.returncode == 0, r.stderr
    obs = next(leaf for leaf in json.loads(r.stdout)["leaves"] if leaf["path"] == "obs")
    assert obs["bytes_stored"] == 200 * 2 * 84 * 84  # every slot holds a frame
    assert obs["projected_bytes_when_full"] == pytest.approx(obs["bytes_on_disk"], rel=0.01)
    # a copy that keeps the step ids holds rows of its retained steps only
    r = shell("convert", tmp_path / "b", tmp_path / "c", "-q")
    assert r.returncode == 0, r.stderr
    r = shell("inspect", tmp_path / "c", "--json")
    copy = json.loads(r.stdout)
    obs = next(leaf for leaf in copy["leaves"] if leaf["path"] == "obs")
    assert copy["first_step"] > 0 and obs["bytes_stored"] == copy["steps"] * 2 * 84 * 84 * 4


def test_create_dry_run_takes_its_sample_from_a_store(tmp_path):
    zstd = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets", "pointchase-pixels-zstd"
    )
    with mr.open(zstd) as store:
        spec = store.spec
        real = disk_usage(os.path.join(zstd, "data.zarr", "observation", "pixels"))
    (tmp_path / "spec.json").write_text(json.dumps({"spec": mr.spec.spec_to_json(spec)}))
    args = ["--capacity", 400, "--num-envs", 8, "--compression", "zstd", "--dry-run", "--sample", zstd]
    r = shell("create", tmp_path / "b", "--spec", tmp_path / "spec.json", *args)
    assert r.returncode == 0, r.stderr
    assert "estimated" in r.stdout.splitlines()[0] and "?" not in r.stdout
    line = next(x for x in r.stdout.splitlines() if x.strip().startswith("observation/pixels"))
    assert "(est.," in line
    size = mr.estimate(spec, 400, 8, compression="zstd", sample=mr.open(zstd).get(slice(-400, None)))
    px = next(s for s in size.leaves if s.path == "observation/pixels")
    assert abs(px.bytes - real) / real < 0.25, (px.bytes, real)


def test_dry_run_compresses_the_image_leaves_and_is_within_a_fifth_of_the_filled_store(tmp_path):
    """`create --dry-run --compression rows:lz4 --sample STORE` compressed every leaf (the
    scalar ones grew 24x) and estimated 2.5x the size of the store it describes."""
    pytest.importorskip("cramjam")
    rng = np.random.default_rng(4)
    capacity, num_envs = 600, 2
    spec = {"pixels": mr.ArraySpec((84, 84, 3), "uint8"), "reward": mr.ArraySpec((), "float32"),
            "terminated": mr.ArraySpec((), "bool")}  # fmt: skip
    values = {
        "pixels": frames(capacity * num_envs, rng).reshape(capacity, num_envs, 84, 84, 3),
        "reward": rng.standard_normal((capacity, num_envs)).astype("float32"),
        "terminated": rng.random((capacity, num_envs)) < 0.01,
    }
    with mr.create(tmp_path / "sample", spec, capacity, num_envs) as store:
        store.extend(values)
    (tmp_path / "spec.json").write_text(json.dumps({"spec": mr.spec.spec_to_json(spec)}))
    args = ["--spec", tmp_path / "spec.json", "--capacity", capacity, "--num-envs", num_envs]
    dry = shell("create", tmp_path / "b", *args, "--compression", "rows:lz4", "--dry-run", "--sample", tmp_path / "sample")
    assert dry.returncode == 0, dry.stderr
    table = {line.split()[0]: line for line in dry.stdout.splitlines()[2:]}
    assert "rows:lz4" in table["pixels"]
    assert "none (mapped)" in table["reward"] and "none (mapped)" in table["terminated"]
    estimated = int(re.search(r"\(([\d,]+) bytes, estimated\)", dry.stdout).group(1).replace(",", ""))
    made = shell("create", tmp_path / "b", *args, "--compression", "rows:lz4")
    assert made.returncode == 0, made.stderr
    with mr.open(tmp_path / "b", mode="a") as store:
        store.extend(values)
    real = disk_usage(tmp_path / "b")
    assert abs(estimated - real) / real < 0.2, (estimated, real)


def fill_frames_store(store, steps: int, seed: int) -> None:
    episodes = Episodes(store.num_envs, (84, 84), 4, -1, "repeat", 0.05, seed)
    for _ in range(steps):
        store.add(episodes.step())


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_a_frames_store_estimate_counts_its_side_ring_and_is_exact(tmp_path, backend):
    """A frames store keeps next frames in a side ring of its own folder: estimate did
    not take frames=, nor count that ring."""
    spec = frames_spec((84, 84), 4, -1)
    options = {"backend": backend, "commit_every": 10, "frames": mr.Frames(frame_stack=4)}
    size = mr.estimate(spec, 60, 2, **options)
    assert size.exact and {"obs", "_frames/next", "frames/frame0", "frames/ref"} <= {s.path for s in size.leaves}
    with mr.create(tmp_path / "b", spec, 60, 2, **options) as store:
        fill_frames_store(store, 90, 0)  # past a full ring, with episode ends
    index = os.path.getsize(tmp_path / "b" / "episodes.idx")  # 16 bytes an episode end: not counted
    assert abs(disk_usage(tmp_path / "b") - index - size.total) < 16  # the json's timestamps' digits
    assert size.preallocated == size.total


def test_a_frames_store_estimate_takes_a_sample_of_stacks(tmp_path):
    """A sample gives the observation stacks the spec names (as a frames store reads
    them): only their newest frames are stored, in the store's leaf and its side ring."""
    pytest.importorskip("cramjam")
    spec = frames_spec((84, 84), 4, -1)
    options = {"compression": {"obs": "rows:lz4"}, "frames": mr.Frames(frame_stack=4)}
    with mr.create(tmp_path / "sample", spec, 100, 2, **options) as store:
        fill_frames_store(store, 100, 1)
        sample = dict(zip(store.leaf_paths, store.read_steps(store.first_step + np.arange(len(store)))))
    size = mr.estimate(spec, 300, 2, **options, sample=sample)
    assert size.total is not None and not size.exact
    with mr.create(tmp_path / "b", spec, 300, 2, **options) as store:
        fill_frames_store(store, 300, 2)
    real = disk_usage(tmp_path / "b")
    assert abs(size.total - real) / real < 0.2, (size.total, real)


def test_create_asks_for_frames_and_its_dry_run_counts_them(tmp_path):
    spec = frames_spec((84, 84), 4, -1)
    (tmp_path / "spec.json").write_text(json.dumps({"spec": mr.spec.spec_to_json(spec), "capacity": 60}))
    args = ["create", tmp_path / "b", "--spec", tmp_path / "spec.json", "--num-envs", 2]
    dry = shell(*args, "--frames", "frame_stack=4", "--frames", "pad=zeros", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    want = mr.estimate(spec, 60, 2, frames=mr.Frames(frame_stack=4, pad="zeros"))
    printed = int(re.search(r"\(([\d,]+) bytes, exact\)", dry.stdout).group(1).replace(",", ""))
    assert abs(printed - want.total) < 64 and "frames/frame0" in dry.stdout
    made = shell(*args, "--frames", "frame_stack=4", "--frames", "pad=zeros")
    assert made.returncode == 0, made.stderr
    with mr.open(tmp_path / "b") as store:
        assert (store.metadata.frames.frame_stack, store.metadata.frames.pad) == (4, "zeros")
    assert abs(disk_usage(tmp_path / "b") - printed) < 64
    # the spec file's "frames", and a setting Frames does not have
    (tmp_path / "spec.json").write_text(
        json.dumps({"spec": mr.spec.spec_to_json(spec), "capacity": 60, "frames": {"frame_stack": 4}})
    )
    from_file = shell("create", tmp_path / "c", "--spec", tmp_path / "spec.json")
    assert from_file.returncode == 0, from_file.stderr
    with mr.open(tmp_path / "c") as store:
        assert store.metadata.frames.frame_stack == 4
    bad = shell("create", tmp_path / "b2", "--spec", tmp_path / "spec.json", "--frames", "stack=4")
    assert bad.returncode == 2 and "'stack'" in bad.stderr and "frame_stack" in bad.stderr
    assert not (tmp_path / "b2").exists()


def test_create_frames_on_the_command_line_add_to_the_spec_files(tmp_path):
    """--frames pad=zeros beside a file's {"frame_stack": 4} replaced the file's mapping:
    the store kept whole stacks (frame_stack 1) without a word."""
    spec = frames_spec((84, 84), 4, -1)
    obj = {"spec": mr.spec.spec_to_json(spec), "capacity": 60, "frames": {"frame_stack": 4, "pad": "zeros"}}
    (tmp_path / "spec.json").write_text(json.dumps(obj))
    args = ["create", tmp_path / "b", "--spec", tmp_path / "spec.json"]
    made = shell(*args, "--frames", "final_slots=50", "--frames", "pad=repeat")
    assert made.returncode == 0, made.stderr
    with mr.open(tmp_path / "b") as store:
        layout = store.metadata.frames
        assert (layout.frame_stack, layout.pad, layout.final_slots) == (4, "repeat", 50)
    bad = shell("create", tmp_path / "c", "--spec", tmp_path / "spec.json", "--frames", "final_slots")
    assert bad.returncode == 2 and "--frames 'final_slots': expected KEY=VALUE" in bad.stderr, bad.stderr
    assert not (tmp_path / "c").exists()


def test_a_dry_run_of_a_frames_store_takes_the_roles_of_the_spec_file(tmp_path):
    """Leaves named other than obs / next_obs need roles=, which the estimate did not take."""
    spec = {"pixels": mr.ArraySpec((84, 84, 4), "uint8"), "after": mr.ArraySpec((84, 84, 4), "uint8"),
            "done": mr.ArraySpec((), "bool")}  # fmt: skip
    roles = {"observation": "pixels", "next_observation": "after", "terminated": "done"}
    obj = {"spec": mr.spec.spec_to_json(spec), "capacity": 50, "roles": roles, "frames": {"frame_stack": 4}}
    (tmp_path / "spec.json").write_text(json.dumps(obj))
    dry = shell("create", tmp_path / "b", "--spec", tmp_path / "spec.json", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    printed = int(re.search(r"\(([\d,]+) bytes, exact\)", dry.stdout).group(1).replace(",", ""))
    made = shell("create", tmp_path / "b", "--spec", tmp_path / "spec.json")
    assert made.returncode == 0, made.stderr
    assert abs(disk_usage(tmp_path / "b") - printed) < 64
