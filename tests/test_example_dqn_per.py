"""The DQN + prioritized replay example runs end to end and leaves learned priorities."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import folder_digest

import mmreplay as mr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dqn_per_example_trains_and_stores_priorities(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    buffer = tmp_path / "cartpole"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "dqn_per.py"),
            "--steps",
            "150",  # learning starts at step 64 (a batch): 86 updates write TD-error priorities
            "--buffer",
            str(buffer),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        # a tiny network: a second OpenMP thread only spins, and costs a busy machine dearly
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "done: 150 steps" in proc.stdout
    with mr.open(buffer, "r") as store:
        assert store.committed_steps == 150
        step = np.arange(store.first_step, store.committed_steps)
        p = store.sampler.priorities(step, np.zeros_like(step))
        assert (p > 0).all()
        assert (p != p[0]).any()  # the learner's TD errors replaced the initial maximum


def test_a_restart_with_another_capacity_is_refused_and_changes_nothing(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    buffer = tmp_path / "cartpole"
    script = os.path.join(ROOT, "examples", "dqn_per.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def run(capacity: int) -> subprocess.CompletedProcess:
        command = [sys.executable, script, "--steps", "20", "--buffer", str(buffer), "--capacity", str(capacity)]
        return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)

    assert run(100).returncode == 0
    before = folder_digest(buffer)
    refused = run(200)
    assert refused.returncode != 0
    assert "capacity: existing 100 vs new 200" in refused.stderr.strip().splitlines()[-1]
    assert folder_digest(buffer) == before
