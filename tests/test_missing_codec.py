"""Chunks that need a codec this process lacks are a missing dependency, never damage.

Every verdict here comes from the ``mmreplay`` CLI in a fresh process, as a user runs it:
a filter plugin loaded by an earlier test in this process would hide the bug.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

import mmreplay as mr

pytest.importorskip("hdf5plugin")

#: run the CLI with hdf5plugin made unimportable (as if it were not installed)
NO_PLUGIN = (
    "import sys; sys.modules['hdf5plugin'] = None; from mmreplay.cli import main; "
    "main(sys.argv[1:], prog_name='mmreplay')"
)


#: the installed ``mmreplay`` script of this interpreter
MMREPLAY = os.path.join(os.path.dirname(sys.executable), "mmreplay")


def cli(*args: str, plugin: bool = True) -> subprocess.CompletedProcess:
    command = [MMREPLAY] if plugin else [sys.executable, "-c", NO_PLUGIN]
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300)


def digest(folder) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(params=["zstd", "blosc"])
def plugin_store(request, tmp_path):
    path = str(tmp_path / f"h5-{request.param}")
    spec = {"obs": mr.ArraySpec((8, 8), "uint8"), "reward": mr.ArraySpec((), "float32")}
    rng = np.random.default_rng(0)
    with mr.create(path, spec, capacity=50, num_envs=2, backend="hdf5", compression=request.param, chunk_steps=8) as s:
        s.extend({"obs": rng.integers(0, 4, (40, 2, 8, 8), dtype=np.uint8), "reward": rng.random((40, 2), "float32")})
    return path


def test_a_healthy_plugin_compressed_hdf5_store_verifies_and_recovers_intact(plugin_store):
    before = digest(plugin_store)
    done = cli("verify", plugin_store)
    assert done.returncode == 0, done.stdout + done.stderr
    done = cli("recover", plugin_store)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no committed step was lost" in done.stdout
    assert digest(plugin_store) == before
    with mr.open(plugin_store) as store:
        assert len(store) == 40


def test_without_the_plugin_verify_and_recover_name_the_extra_and_change_nothing(plugin_store):
    before = digest(plugin_store)
    for command in ("verify", "recover"):
        done = cli(command, plugin_store, plugin=False)
        assert done.returncode == 7, (command, done.stdout, done.stderr)
        assert "pip install 'mmreplay[hdf5plugin]'" in done.stderr, done.stderr
        assert "problem" not in done.stdout and "lost" not in done.stdout
        assert digest(plugin_store) == before, command
    assert cli("verify", plugin_store).returncode == 0


def test_converted_dataset_with_zstd_verifies_in_a_fresh_process(tmp_path):
    source = os.path.join(os.path.dirname(__file__), "..", "datasets", "pointchase-pixels-hdf5")
    out = str(tmp_path / "h5z")
    done = cli("convert", source, out, "--compression", "zstd", "-q")
    assert done.returncode == 0, done.stderr
    before = digest(out)
    done = cli("verify", out)
    assert done.returncode == 0, done.stdout + done.stderr
    done = cli("recover", out)
    assert done.returncode == 0 and "no committed step was lost" in done.stdout, done.stdout
    assert digest(out) == before
