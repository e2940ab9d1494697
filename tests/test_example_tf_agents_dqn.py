"""The TF-Agents DQN example trains, is killed with SIGKILL, resumes from its checkpoint
and its replay buffer, and finishes (runs where TF-Agents is installed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tf_agents_dqn_example_survives_sigkill(tmp_path):
    pytest.importorskip("tf_agents")
    pytest.importorskip("gym")
    run = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable, os.path.join(ROOT, "examples", "tf_agents_dqn.py"),
            "--steps", "300", "--checkpoint-every", "100", "--initial-steps", "100",
            "--eval-episodes", "2", "--dir", str(run),
        ],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"return before the kill: [\d.]+ at step 150; SIGKILL", out), out
    assert "killed with SIGKILL at step 150" in out
    resumed = re.search(r"resumed at step 100 with (\d+) frames", out)
    assert resumed and int(resumed.group(1)) >= 200, out  # at least the checkpoint's 100 random + 100 collected
    assert re.search(r"return after the resume: [\d.]+", out)
    assert re.search(r"return at the end: [\d.]+ at step 300", out)
    assert "adds made after the checkpoint" in proc.stderr  # the buffer kept what the kill did not lose
