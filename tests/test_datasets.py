"""The reference stores in ``datasets/``: what each holds, and that the script remakes them."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.demo import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASETS = os.path.join(ROOT, "datasets")
NAMES = ["pointchase-zarr", "pointchase-pixels-hdf5", "pointchase-pixels-zstd", "pointchase-wrapped"]


def open_ref(name):
    return mr.open(os.path.join(DATASETS, name), mode="r")


def test_each_reference_store_is_what_it_says_and_small():
    with open_ref("pointchase-zarr") as s:
        assert (s.backend, s.num_envs, s.capacity, len(s), s.first_step) == ("zarr", 8, 2000, 1500, 0)
        assert isinstance(s.spec["observation"], mr.ArraySpec)
    with open_ref("pointchase-pixels-hdf5") as s:
        assert s.backend == "hdf5" and s.spec["observation"]["pixels"] == mr.ArraySpec((32, 32, 3), "uint8")
    with open_ref("pointchase-pixels-zstd") as s:
        assert all(leaf.compression == "zstd" for leaf in s.metadata.leaves)
    with open_ref("pointchase-wrapped") as s:
        assert s.committed_steps == 1000 and s.first_step == 700 and len(s) == s.capacity == 300
        assert s.episode_index()[0].status == "open"  # its start was overwritten by the ring
    for name in NAMES:
        size = sum(
            os.path.getsize(os.path.join(r, f))
            for r, _, fs in os.walk(os.path.join(DATASETS, name))
            for f in fs
        )
        assert size < 4 << 20, name
        with open_ref(name) as s:
            spans = s.episode_index()
            assert {"terminated", "truncated", "open"} <= {x.status for x in spans}


@pytest.mark.parametrize(
    "name, steps, envs, seed, pixels",
    [
        ("pointchase-zarr", 1500, 8, 1, False),
        ("pointchase-pixels-hdf5", 100, 4, 7, True),
        ("pointchase-wrapped", 1000, 4, 4, False),
    ],
)
def test_reference_stores_hold_the_environment_steps(name, steps, envs, seed, pixels):
    want = reference(steps, num_envs=envs, seed=seed, pixels=pixels)
    with open_ref(name) as s:
        got = s.get(slice(None))
        first = s.first_step
    for key in want:
        for g, w in zip(mr.spec.flatten(got[key]), mr.spec.flatten(want[key])):
            assert np.array_equal(g, w[first:]), key


def test_the_script_remakes_identical_stores(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(DATASETS, "make_datasets.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    for name in NAMES:
        with open_ref(name) as a, mr.open(tmp_path / name) as b:
            assert mr.spec.spec_to_json(a.spec) == mr.spec.spec_to_json(b.spec)
            assert (a.first_step, a.committed_steps, a.roles) == (b.first_step, b.committed_steps, b.roles)
            assert [leaf.to_json() for leaf in a.metadata.leaves] == [
                leaf.to_json() for leaf in b.metadata.leaves
            ]
            for p, x, y in zip(a.leaf_paths, a.get(slice(None)).values(), b.get(slice(None)).values()):
                for u, v in zip(mr.spec.flatten(x), mr.spec.flatten(y)):
                    assert np.array_equal(u, v), (name, p)
            assert a.episode_index() == b.episode_index()
    again = subprocess.run(
        [sys.executable, os.path.join(DATASETS, "make_datasets.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert again.returncode != 0 and "--force" in again.stderr


def test_the_script_creates_its_out_folder_and_refuses_what_is_no_store(tmp_path):
    out = tmp_path / "new" / "deeper"
    script = os.path.join(DATASETS, "make_datasets.py")
    done = subprocess.run(
        [sys.executable, script, "--out", str(out), "--only", "pointchase-zarr"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    with mr.open(out / "pointchase-zarr") as store:
        assert len(store) > 0
    (tmp_path / "mine" / "pointchase-zarr").mkdir(parents=True)
    (tmp_path / "mine" / "pointchase-zarr" / "notes.txt").write_text("mine")
    again = subprocess.run(
        [sys.executable, script, "--out", str(tmp_path / "mine"), "--only", "pointchase-zarr", "--force"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2 and again.stderr.startswith("Error: ") and "not an mmreplay store" in again.stderr
    assert "Traceback" not in again.stderr
    assert (tmp_path / "mine" / "pointchase-zarr" / "notes.txt").read_text() == "mine"
