"""The SB3 HER bit-flipping example resumes after a SIGKILL, even one that lands while
it writes its checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import verify_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "sb3_her_bitflip.py")

# runs the example, SIGKILLing it once SB3 has written the first entry of the second
# checkpoint's model.zip: the moment a kill leaves a part-written file
KILL_IN_SAVE = textwrap.dedent(
    """
    import os, runpy, signal, sys, zipfile
    writestr, saves = zipfile.ZipFile.writestr, []
    def killing_writestr(self, name, *args, **kwargs):
        writestr(self, name, *args, **kwargs)
        if name == "data":
            saves.append(name)
            if len(saves) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
    zipfile.ZipFile.writestr = killing_writestr
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def test_a_kill_while_the_checkpoint_is_written_resumes_from_the_previous_one(tmp_path):
    pytest.importorskip("stable_baselines3")
    run, wrapper = tmp_path / "run", tmp_path / "kill_in_save.py"
    wrapper.write_text(KILL_IN_SAVE)
    args = [SCRIPT, "--run", str(run), "--steps", "150", "--every", "50", "--bits", "4", "--eval-episodes", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a small network: a second thread only spins
    killed = subprocess.run([sys.executable, str(wrapper), *args], capture_output=True, text=True, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = re.search(r"start: step (\d+), buffer (\d+) steps", resumed.stdout)
    assert start and int(start[1]) == 50 <= int(start[2]), resumed.stdout  # the first checkpoint's model
    assert "checkpoint: step 150" in resumed.stdout
    assert verify_cli(run / "buffer")[0] == 0
