"""The skrl DQN example trains, is killed with SIGKILL halfway, and resumes from disk."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_skrl_dqn_example_survives_sigkill_and_resumes(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    pytest.importorskip("skrl")
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "skrl_dqn.py"), "--demo", "--steps", "300",
         "--checkpoint-every", "50", "--run", str(run)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    before = re.search(r"killed at step 150: return before: ([\d.]+)", out)
    assert before, out
    assert "first run ended by SIGKILL" in out
    # the second process found the first one's memory (committed at its last checkpoint) and agent
    resumed = re.search(r"resumed at step 150: the memory holds 150 rows .*return before: ([\d.]+)", out)
    assert resumed and resumed[1] == before[1], out
    assert re.search(r"return after: [\d.]+", out), out
    assert "done: 300 steps" in out and "the memory holds 300 rows" in out, out
    # the checkpoint is a pair, the agent named by the progress file of its timestep
    progress = json.loads((run / "progress.json").read_text())
    assert (progress["timestep"], progress["agent"]) == (300, "agent-300.pt")
    assert sorted(f for f in os.listdir(run) if f.startswith("agent")) == ["agent-300.pt"]

    from mmreplay.compat.skrl import RandomMemory

    with RandomMemory(memory_size=50_000, device="cpu", path=run / "memory", commit_every=50) as memory:
        assert (len(memory), memory.memory_index, memory.filled) == (300, 300, False)
        assert set(memory.get_tensor_names()) >= {"observations", "actions", "rewards", "terminated"}
        actions = memory.get_tensor_by_name("actions")[:300].flatten()
        assert set(actions.tolist()) == {0, 1}  # random actions vary (see the example's random_act)


def test_skrl_dqn_demo_in_a_folder_that_holds_a_run_says_so(tmp_path):
    # a second --demo with the same --run (the command of docs/skrl.md, run again) would resume the
    # finished run in its first child, which then is not killed: say what is in the way instead
    run = tmp_path / "run"
    run.mkdir()
    (run / "progress.json").write_text(json.dumps({"timestep": 300, "returns": [], "agent": "agent-300.pt"}))
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "skrl_dqn.py"), "--demo", "--steps", "300", "--run", str(run)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{run} holds one (progress.json)" in proc.stderr and "leave out --demo" in proc.stderr, proc.stderr
    assert sorted(os.listdir(run)) == ["progress.json"]  # nothing started, nothing written
