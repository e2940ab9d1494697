"""TF-Agents' own tests of ``TFUniformReplayBuffer`` pass against ``UniformReplayBuffer``.

``tf_agents/replay_buffers/tf_uniform_replay_buffer_test.py`` of the installed TF-Agents
(its wheel ships it; else it is taken from the wheel ``pip download`` fetches) is run
with one change, the import of ``tf_uniform_replay_buffer``, which gives the test
``UniformReplayBuffer`` as ``TFUniformReplayBuffer``. Where TensorFlow and TF-Agents are
not installed it skips, as the other TensorFlow tests (test_tf_agents_install.py builds
their venv). The tests left failing are the layer's documented limits (docs/tf-agents.md).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import run_their_tests

pytest.importorskip("tensorflow")
tf_agents = pytest.importorskip("tf_agents")

TEST_FILE = "tf_agents/replay_buffers/tf_uniform_replay_buffer_test.py"
IMPORT = "from tf_agents.replay_buffers import tf_uniform_replay_buffer\n"
SUBSTITUTE = (
    "import types\n"
    "from mmreplay.compat.tf_agents import UniformReplayBuffer\n"
    "tf_uniform_replay_buffer = types.SimpleNamespace(TFUniformReplayBuffer=UniformReplayBuffer)\n"
)
#: tests that read TF-Agents' table internals: ``_capacity`` as a tensor (no TF table holds the data)
LIMITS = {"testNumFramesBatchSizeOne", "testNumFramesBatchSizeFive"}


def their_test_file(tmp_path: Path) -> str:
    installed = Path(tf_agents.__file__).parent.parent / TEST_FILE
    if installed.is_file():
        return installed.read_text()
    version = importlib.metadata.version("tf-agents")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(wheels),
         f"tf-agents=={version}"], check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(TEST_FILE).decode()


def test_tf_agents_uniform_replay_buffer_tests_pass_against_ours(tmp_path):
    source = their_test_file(tmp_path)
    assert source.count(IMPORT) == 1, "the test no longer imports tf_uniform_replay_buffer as expected"
    test = tmp_path / "tf_uniform_replay_buffer_test.py"
    test.write_text(source.replace(IMPORT, SUBSTITUTE))
    failed, passed, output = run_their_tests(test, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert failed == LIMITS, output
    assert len(passed) == 33, output
