"""The group benchmark keeps working: at a small size it measures the add rate of actor
processes and the learner's sample from a group and from one store. No timing is
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_group_runs_at_a_small_size(tmp_path):
    out = tmp_path / "group.json"
    args = ["--steps", "200", "--rows", "8192", "--repeats", "10", "--actors", "1", "2", "--no-ray"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.bench_group", *args, "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report["add"]) == {"1", "2"} and all(f["rows_per_s"] > 0 for f in report["add"].values())
    assert set(report["sample"]) == {
        "one_store_sample_us",
        "group4_sample_us",
        "one_store_seq8_us",
        "group4_seq8_us",
    }
    assert report["skipped"] == {"ray": "--no-ray"}
