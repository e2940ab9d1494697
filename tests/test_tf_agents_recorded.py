"""mmreplay's ``UniformReplayBuffer`` against what the real ``TFUniformReplayBuffer``
answered on the same operation sequences (recorded by ``tools/record_tf_agents.py`` in a
TF-Agents venv; no TensorFlow needed here): the same frames, ``num_frames``,
``gather_all``, the same ids, probabilities and valid starts of ``get_next`` (as the
sets of many draws), the same deterministic passes where TF-Agents reads the right rows
(their ids are raw table rows, so they are compared with one segment only), and the
same errors.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import mmreplay as mr
from mmreplay.compat.tf_agents import UniformReplayBuffer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.tf_agents_cases import cases, run_case  # noqa: E402

RECORDED = os.path.join(ROOT, "tests", "data", "tf_agents_recorded.json")
SPEC = {"value": mr.ArraySpec((), "int64"), "half": mr.ArraySpec((), "float32")}


def error_kind(exc: BaseException) -> str | None:
    if isinstance(exc, ValueError) and "ALL data will be dropped" in str(exc):
        return "all_dropped"
    tf = sys.modules.get("tensorflow")  # where installed, a tf.data pass raises TF's error
    empty = (mr.NotEnoughDataError,) + (() if tf is None else (tf.errors.InvalidArgumentError,))
    if isinstance(exc, empty) and "is empty" in str(exc):
        return "empty"
    return None


with open(RECORDED) as _f:
    DATA = json.load(_f)


def test_recording_covers_the_cases_the_tool_makes():
    recorded = [{k: v for k, v in c.items() if k != "results"} for c in DATA["cases"]]
    assert recorded == cases()  # the recording is of these sequences, not older ones
    kinds = {r and next(iter(r)) for c in DATA["cases"] for r in c["results"]}
    assert {"items", "values", "error", "num_frames"} <= kinds  # draws, passes, errors, adds


@pytest.mark.parametrize("case", DATA["cases"], ids=[c["name"] for c in DATA["cases"]])
def test_same_answers_as_tf_agents(case, tmp_path):
    rb = UniformReplayBuffer(
        SPEC,
        case["batch_size"],
        case["max_length"],
        path=tmp_path / "rb",
        dataset_window_shift=case["dataset_window_shift"],
        dataset_drop_remainder=case["dataset_drop_remainder"],
        seed=0,
    )
    with rb:
        ours = run_case(case, rb, error_kind)
    for i, (op, want, got) in enumerate(zip(case["ops"], case["results"], ours)):
        where = f"{case['name']} op {i} {op}"
        if op["op"] == "pass" and want is not None and case["batch_size"] > 1 and "ids" in want:
            want, got = want["values"], got["values"]  # TF-Agents' pass ids are raw table rows
        assert got == want, where
