"""The demo: its environment, deterministic resume, and ``mmreplay demo`` end to end."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.demo import PointChase, collect, reference, rollout, spec

MMREPLAY = shutil.which("mmreplay") or os.path.join(os.path.dirname(sys.executable), "mmreplay")


def test_pointchase_episodes_terminate_and_truncate_at_the_time_limit():
    steps = reference(2_000, num_envs=8, seed=0)
    term, trunc = steps["terminated"], steps["truncated"]
    assert term.sum() > 50 and trunc.sum() > 20 and not np.any(term & trunc)
    obs, nxt = steps["observation"], steps["next_observation"]
    # inside an episode the next observation is the following observation
    cont = ~(term | trunc)[:-1]
    assert np.array_equal(nxt[:-1][cont], obs[1:][cont])
    # a truncation happens exactly when the step counter reaches the limit
    assert np.allclose(nxt[trunc][:, 6], 1.0)
    # after an end the env resets: a fresh step counter
    ended = (term | trunc)[:-1]
    assert np.all(obs[1:][ended][:, 6] == 0)
    dist = np.linalg.norm(nxt[..., 4:6] - nxt[..., 0:2], axis=-1)
    assert np.all(dist[term] < 0.05) and np.all(dist[~term] >= 0.05)
    assert steps["observation"].dtype == np.float32 and steps["action"].dtype == np.float32


def test_the_same_seed_gives_the_same_steps_and_another_seed_does_not():
    a, b, c = reference(300, seed=3), reference(300, seed=3), reference(300, seed=4)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["observation"], c["observation"])


@pytest.mark.parametrize("pixels", [False, True])
def test_collection_resumed_from_the_store_equals_an_uninterrupted_run(tmp_path, pixels):
    path = tmp_path / "b"
    with mr.create(path, spec(pixels), capacity=500, num_envs=4, commit_every=37) as store:
        collect(store, 123, seed=9)
    # a new process would do the same; collect restores the envs, so the episodes go on
    with mr.open(path, mode="a", continue_episodes=True) as store:
        collect(store, 250, seed=9)
    want = reference(250, num_envs=4, seed=9, pixels=pixels)
    with mr.open(path) as store:
        got = store.get(slice(None))
    for key in want:
        for g, w in zip(mr.spec.flatten(got[key]), mr.spec.flatten(want[key])):
            assert np.array_equal(g, w), key


def test_rollout_renders_frames_with_the_point_and_the_target():
    env = PointChase(2, seed=1)
    env.reset(0)
    steps = rollout(env, 0, 3, pixels=True)
    frames = steps["observation"]["pixels"]
    assert frames.shape == (3, 2, 32, 32, 3) and frames.dtype == np.uint8
    assert (frames[..., 0] == 255).sum(axis=(2, 3)).min() == 1  # one point centre per frame
    assert (frames[..., 1] == 255).sum(axis=(2, 3)).min() == 1  # one target centre per frame


def demo(folder, *extra, env=None):
    return subprocess.run(
        [MMREPLAY, "demo", str(folder), "--steps", "2000", *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_mmreplay_demo_runs_the_whole_job_and_leaves_an_exact_store(tmp_path):
    out = demo(tmp_path / "run")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for needle in (
        "8 envs",
        "SIGKILL after it reported the commit at step 800",
        "committed steps",
        "bit for bit",
        "resumed from step",
        "equals an uninterrupted run",
        "sampled 256 transitions",
        "exported to Minari",
        "MB",
    ):
        assert needle in text, needle
    if "minari is not installed" not in text:
        assert "minari.load_dataset('mmreplay/pointchase-v0')" in text and "every episode equal" in text
    want = reference(2000, num_envs=8, seed=0)
    with mr.open(tmp_path / "run" / "buffer") as store:
        assert store.committed_steps == 2000 and store.num_envs == 8
        got = store.get(slice(None))
        assert all(np.array_equal(got[k], want[k]) for k in want)
    assert (tmp_path / "run" / "minari" / "mmreplay" / "pointchase-v0" / "data" / "main_data.hdf5").exists()
    again = demo(tmp_path / "run")
    assert again.returncode != 0 and "already exists" in again.stderr and "Traceback" not in again.stderr


def test_demo_without_minari_says_it_skipped_the_check(tmp_path):
    """After ``pip install -e .`` alone: none of the optional packages can be imported."""
    for name in ("minari", "torch", "gymnasium", "pyarrow", "d3rlpy", "datasets", "PIL", "matplotlib", "yaml"):
        blocker = tmp_path / "block" / name
        blocker.mkdir(parents=True)
        (blocker / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "block"))
    out = demo(tmp_path / "run", "--backend", "hdf5", env=env)
    assert out.returncode == 0, out.stderr
    assert "minari is not installed: skipped loading the export back" in out.stdout
    assert "exported to Minari" in out.stdout  # the export itself needs only h5py
    with mr.open(tmp_path / "run" / "buffer") as store:
        assert store.backend == "hdf5" and store.committed_steps == 2000
