"""Operation sequences run against TF-Agents' ``TFUniformReplayBuffer`` and mmreplay's
``UniformReplayBuffer`` alike: :mod:`tools.record_tf_agents` records what the real
buffer answers, ``tests/test_tf_agents_recorded.py`` replays them against mmreplay.

Only what both buffers define the same way is recorded and compared: frames, ids,
probabilities and valid starts of ``get_next`` (as the sets many draws cover),
``num_frames``, ``gather_all`` and the deterministic passes where TF-Agents reads the
right rows (one segment, or no wrap, and windows that do not span segment groups).
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: draws per get_next: with at most 4 segments and 9 starts, every (segment, start)
#: pair shows up with probability above 1 - 1e-9
DRAWS = 1024


def cases(seed: int = 2026, count: int = 60) -> list[dict[str, Any]]:
    """Buffer shapes and operation sequences, the same for a given seed."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        batch_size = int(rng.integers(1, 5))
        max_length = int(rng.integers(2, 10))
        shift = None if rng.random() < 0.5 else int(rng.integers(1, 4))
        drop = bool(rng.random() < 0.3)
        ops: list[dict[str, Any]] = [{"op": "get_next", "num_steps": None}] if i == 0 else []  # empty
        for j in range(int(rng.integers(3, 9))):
            kind = "add" if j == 0 else rng.choice(["add", "get_next", "pass", "clear"], p=[0.35, 0.3, 0.3, 0.05])
            if kind == "add":
                ops.append({"op": "add", "n": int(rng.integers(1, 2 * max_length))})
            elif kind == "get_next":
                ops.append(
                    {
                        "op": "get_next",
                        "num_steps": None if rng.random() < 0.3 else int(rng.integers(1, max_length + 2)),
                    }
                )
            elif kind == "pass":
                ops.append(
                    {
                        "op": "pass",
                        "sample_batch_size": None if rng.random() < 0.5 else int(rng.integers(1, batch_size + 1)),
                        "num_steps": None if rng.random() < 0.4 else int(rng.integers(1, max_length + 1)),
                    }
                )
            else:
                ops.append({"op": "clear"})
        out.append(
            {
                "name": f"case{i:02d}",
                "batch_size": batch_size,
                "max_length": max_length,
                "dataset_window_shift": shift,
                "dataset_drop_remainder": drop,
                "ops": ops,
            }
        )
    return out


def frame(t: int, batch_size: int) -> dict[str, np.ndarray]:
    """The ``t``-th add (counted over the whole sequence, clears included): segment ``b``
    holds ``1000 * b + t``, and a float leaf holds its half."""
    value = 1000 * np.arange(batch_size, dtype=np.int64) + t
    return {"value": value, "half": (value / 2).astype(np.float32)}


def pass_is_comparable(case: dict[str, Any], op: dict[str, Any], adds_since_clear: int) -> bool:
    """Whether TF-Agents' deterministic pass is right here. Its known bugs: after the
    ring wraps with several segments it reads the next segment's rows; with
    ``sample_batch_size`` and ``num_steps`` it windows the stream of all segment groups
    together (windows span groups unless ``num_steps`` divides the frames and is the
    shift), and a group smaller than ``sample_batch_size`` is an error there."""
    batch_size, max_length = case["batch_size"], case["max_length"]
    s, t = op["sample_batch_size"], op["num_steps"]
    if adds_since_clear == 0:
        return True  # both raise
    if batch_size > 1 and adds_since_clear > max_length:
        return False
    if s is not None and t is not None:
        frames = min(adds_since_clear, max_length)
        if frames % t or batch_size % s or case["dataset_window_shift"] not in (None, t):
            return False
    if case["dataset_drop_remainder"] and ((s is not None and s > batch_size) or (t is not None and t > max_length)):
        return False  # both raise "ALL data will be dropped" when the dataset is made
    return True


def summarize_draws(values: np.ndarray, ids: np.ndarray, probabilities: np.ndarray) -> dict[str, Any]:
    """What many draws of ``get_next`` show: each distinct item (its values, which name
    segment and frames) with its ids, and the distinct probabilities."""
    items = sorted({(tuple(np.atleast_1d(v).tolist()), tuple(np.atleast_1d(i).tolist())) for v, i in zip(values, ids)})
    return {
        "items": [[list(v), list(i)] for v, i in items],
        "probabilities": sorted({round(float(p), 7) for p in probabilities}),
    }


def run_case(case: dict[str, Any], rb: Any, error_kind: Any) -> list[Any]:
    """Run ``case["ops"]`` on ``rb`` (either buffer: mmreplay's mirrors TF-Agents' API)
    and return one JSON-able result per op. ``error_kind(exc)`` names an expected error
    (``"empty"``, ``"all_dropped"``) or returns None to let it through."""
    batch_size = case["batch_size"]
    t = 0
    adds_since_clear = 0
    results: list[Any] = []
    for op in case["ops"]:
        if op["op"] == "add":
            for _ in range(op["n"]):
                rb.add_batch(frame(t, batch_size))
                t += 1
            adds_since_clear += op["n"]
            gathered = np.asarray(rb.gather_all()["value"])
            results.append({"num_frames": int(rb.num_frames()), "gather_all": gathered.tolist()})
        elif op["op"] == "clear":
            rb.clear()
            adds_since_clear = 0
            results.append({"num_frames": int(rb.num_frames())})
        elif op["op"] == "get_next":
            try:
                items, info = rb.get_next(sample_batch_size=DRAWS, num_steps=op["num_steps"])
            except Exception as exc:  # noqa: BLE001 - error_kind decides which are expected
                results.append({"error": _expected(error_kind, exc)})
                continue
            values = np.asarray(items["value"])
            if not np.allclose(np.asarray(items["half"]), values / 2):
                raise AssertionError(f"{case['name']}: leaves of one item disagree")
            results.append(summarize_draws(values, np.asarray(info.ids), np.asarray(info.probabilities)))
        else:
            if not pass_is_comparable(case, op, adds_since_clear):
                results.append(None)
                continue
            try:
                dataset = rb.as_dataset(
                    sample_batch_size=op["sample_batch_size"],
                    num_steps=op["num_steps"],
                    single_deterministic_pass=True,
                )
                passed = [(np.asarray(items["value"]).tolist(), np.asarray(info.ids).tolist()) for items, info in dataset]
            except Exception as exc:  # noqa: BLE001
                results.append({"error": _expected(error_kind, exc)})
                continue
            results.append({"values": [v for v, _ in passed], "ids": [i for _, i in passed]})
    return results


def _expected(error_kind: Any, exc: BaseException) -> str:
    kind = error_kind(exc)
    if kind is None:
        raise exc
    return kind
