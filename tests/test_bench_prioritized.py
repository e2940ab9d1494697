"""The prioritized-replay benchmark keeps working: at a small size it measures every
installed peer or names it as skipped with the reason, and mmreplay with the sum tree of
a given commit beside today's. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_prioritized_runs_at_a_small_size(tmp_path):
    out = tmp_path / "per.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_prioritized",
            "--rows",
            "4096",
            "--repeats",
            "20",
            "--tree-from",
            "HEAD",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RL_WARNINGS": "0"},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report["systems"]) | set(report["skipped"]) == {"mmreplay", "torchrl", "cpprb", "mmreplay@HEAD"}
    for name, fig in report["systems"].items():
        assert fig["sample_us"] > 0 and fig["update_us"] >= 0, name
    assert report["systems"]["mmreplay"]["first_sample_after_reopen_us"] > 0
    assert all(why for why in report["skipped"].values())
    assert report["add_uniform_us"] > 0 and report["add_prioritized_us"] > 0
