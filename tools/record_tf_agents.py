"""Record what TF-Agents' ``TFUniformReplayBuffer`` answers on the operation sequences of
:mod:`tools.tf_agents_cases`, into ``tests/data/tf_agents_recorded.json``.

Run it in a venv with TF-Agents (docs/tf-agents.md, "Installing beside TF-Agents")::

    python -m tools.record_tf_agents

``tests/test_tf_agents_recorded.py`` replays the same sequences against mmreplay's
``UniformReplayBuffer`` and compares, without TensorFlow.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import tensorflow as tf
import tf_agents
from tf_agents.replay_buffers.tf_uniform_replay_buffer import TFUniformReplayBuffer

from tools.tf_agents_cases import cases, run_case

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "tf_agents_recorded.json")

SPEC = {"value": tf.TensorSpec((), tf.int64), "half": tf.TensorSpec((), tf.float32)}


def error_kind(exc: BaseException) -> str | None:
    if isinstance(exc, ValueError) and "ALL data will be dropped" in str(exc):
        return "all_dropped"
    if isinstance(exc, tf.errors.InvalidArgumentError) and "is empty" in str(exc):
        return "empty"
    return None


def record() -> dict[str, Any]:
    tf.random.set_seed(0)
    out = []
    for case in cases():
        rb = TFUniformReplayBuffer(
            SPEC,
            batch_size=case["batch_size"],
            max_length=case["max_length"],
            dataset_window_shift=case["dataset_window_shift"],
            dataset_drop_remainder=case["dataset_drop_remainder"],
        )
        out.append({**case, "results": run_case(case, rb, error_kind)})
    return {
        "recorded_with": {"tf_agents": tf_agents.__version__, "tensorflow": tf.__version__, "numpy": np.__version__},
        "cases": out,
    }


def main() -> int:
    data = record()
    with open(OUT, "w") as f:
        json.dump(data, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT}: {len(data['cases'])} cases, {os.path.getsize(OUT)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
