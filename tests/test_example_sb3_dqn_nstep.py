"""The SB3 DQN + n-step returns example learns CartPole in a short run and leaves its
transitions in the folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import mmreplay as mr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_n_step_dqn_example_learns_cartpole(tmp_path):
    pytest.importorskip("stable_baselines3")
    buffer = tmp_path / "cartpole"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "sb3_dqn_nstep.py"), "--steps", "1000", "--episodes", "5",
         "--buffer", str(buffer)],
        capture_output=True, text=True, timeout=600,
        # a small network: a second OpenMP thread only spins, and costs a busy machine dearly
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"greedy return over 5 episodes: ([\d.]+) before, ([\d.]+) after 1000 steps", proc.stdout)
    assert found, proc.stdout
    before, after = float(found[1]), float(found[2])
    assert after >= 100 > before, (before, after)  # CartPole's random-ish start lasts ~10-30 steps
    with mr.open(buffer) as store:
        assert store.committed_steps >= 1000  # SB3 collects in rollouts of train_freq steps
        discount = store.sample(256, rng=0, transform=mr.NStep(3, gamma=0.99))["discount"]
        assert set(np.rint(np.log(discount) / np.log(0.99)).tolist()) == {1, 2, 3}
