"""The benchmark keeps working: it runs at its small size and writes the expected report.

No timing is asserted: only that every figure is measured (a positive number) or marked
n/a with a reason, that peers which are not installed are named as skipped, and that the
ratios are computed the way the report says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import report, store_figures  # noqa: E402
from bench.systems import SYSTEMS  # noqa: E402
from bench.workloads import WORKLOADS  # noqa: E402

FIGURE_KEYS = {"add", "extend", "checkpoint", "sample", "sample_seq", "disk_bytes", "reopen"}


def _positive_or_na(fig: dict, where: str) -> None:
    if fig.get("median") is None:
        assert fig.get("na"), f"{where}: neither a figure nor a reason"
    else:
        assert fig["median"] > 0, f"{where}: {fig}"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    """The small benchmark in a subprocess, with cpprb hidden as if it were not installed."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "out"
    code = (
        "import sys; sys.modules['cpprb'] = None\n"  # find_spec('cpprb') is None: not installed
        "from bench.run import main\n"
        f"raise SystemExit(main(['--size', 'small', '--out', {str(out)!r}, '--dir', {str(tmp)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "bench-small.json") as f:
        results = json.load(f)
    with open(out / "bench-small.md") as f:
        md = f.read()
    assert proc.stdout == md
    assert not [p for p in os.listdir(tmp) if p.startswith("mmreplay-bench-")], "buffers left behind"
    return results, md, proc.stderr


def test_every_system_is_run_or_named_as_skipped(small_run: tuple[dict, str, str]) -> None:
    results, md, stderr = small_run
    names = {cls.name for cls in SYSTEMS}
    assert set(results["systems"]) | set(results["skipped"]) == names
    assert not set(results["systems"]) & set(results["skipped"])
    assert "not installed: cpprb" in results["skipped"]["cpprb mmap"]
    assert "skipping cpprb mmap: not installed" in stderr
    skipped_line = next(line for line in md.splitlines() if line.startswith("Skipped: "))
    assert "cpprb mmap (not installed: cpprb" in skipped_line
    for always in ("numpy (RAM)", "mmreplay zarr", "mmreplay hdf5", "mmreplay zarr+zstd"):
        assert always in results["systems"]


def test_every_workload_figure_is_measured_or_explained(small_run: tuple[dict, str, str]) -> None:
    results, md, _ = small_run
    assert set(results["workloads"]) == set(WORKLOADS)
    for wname, per in results["workloads"].items():
        assert set(per) == set(results["systems"])
        for name, figs in per.items():
            assert set(figs) >= FIGURE_KEYS, (wname, name)
            for key in FIGURE_KEYS:
                _positive_or_na(figs[key], f"{wname}/{name}/{key}")
            if name.startswith("mmreplay") or name == "numpy (RAM)":
                for key in FIGURE_KEYS:  # everything is supported here
                    assert figs[key]["median"] is not None, (wname, name, key)
            assert figs["reopen"]["rows_after"] == figs["reopen"]["rows"], (wname, name)  # data came back
        raw = per["mmreplay zarr"]["disk_bytes"]["raw_bytes"]
        workload = WORKLOADS[wname]
        assert raw == results["sizes"]["capacity"][wname] * workload.num_envs * workload.row_bytes
        assert f"## {wname} (" in md


def test_reopen_export_and_out_of_memory_sections(small_run: tuple[dict, str, str]) -> None:
    results, md, _ = small_run
    sizes = [str(r) for r in results["sizes"]["reopen_rows"]]
    for name in results["systems"]:
        assert list(results["reopen_sizes"][name]) == sizes
        for rows in sizes:
            fig = results["reopen_sizes"][name][rows]
            _positive_or_na(fig, f"reopen {name} {rows}")
            if fig["median"] is not None:
                assert fig["rows_after"] == int(rows), (name, rows)
    for wname in ("vector", "pixels"):
        figs = results["export"][wname]
        assert figs["numpy savez"]["median"] > 0
        for fmt in results["sizes"]["export_formats"]:
            _positive_or_na(figs[f"mmreplay {fmt}"], f"export {wname} {fmt}")
    ooc = results["out_of_memory"]
    assert "posix_fadvise" in ooc["method"]
    for label in ("mmreplay zarr", "mmreplay hdf5", "mmreplay zarr+zstd"):
        assert ooc[label]["sample"]["median"] > 0
    assert ooc["mmreplay zarr"]["pread"]["median"] > 0
    for section in (
        "## reopen by size",
        "## export",
        "## sample(256) with the data out of memory",
        "## targets",
    ):
        assert section in md


def test_machine_and_versions_are_recorded(small_run: tuple[dict, str, str]) -> None:
    results, md, _ = small_run
    assert results["machine"]["cpu"] and results["machine"]["cores"] >= 1
    assert results["disk"]["free_bytes"] > 0
    for pkg in ("mmreplay", "numpy", "zarr", "h5py"):
        assert results["versions"][pkg], pkg
    assert f"numpy {np.__version__}" in md


def test_mmreplay_cells_carry_both_ratios(small_run: tuple[dict, str, str]) -> None:
    results, md, _ = small_run
    row = next(line for line in md.splitlines() if line.startswith("| `sample(256)`"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    names = ["figure"] + list(results["workloads"]["vector"])
    zarr = cells[names.index("mmreplay zarr")]
    assert "× numpy" in zarr
    peers = [n for n in results["systems"] if not n.startswith("mmreplay") and n != "numpy (RAM)"]
    assert ("× best peer" in zarr) == bool(peers)


def test_advantage_reads_times_better() -> None:
    assert report.advantage(300.0, 100.0, higher_better=True) == 3.0  # three times the rate
    assert report.advantage(2.0, 10.0, higher_better=False) == 5.0  # a fifth of the time
    assert report.advantage(10.0, 2.0, higher_better=False) == 0.2
    assert report.advantage(None, 1.0, True) is None


def test_targets_are_judged_from_the_figures() -> None:
    def fig(v: float) -> dict:
        return {"median": v}

    vec = {
        "numpy (RAM)": {"add": fig(100.0), "sample": fig(100.0)},
        "mmreplay zarr": {"add": fig(60.0), "sample": fig(70.0)},
        "SB3": {"add": fig(50.0), "sample": fig(20.0)},
    }
    got = {t: ok for t, _, ok in report.targets({"workloads": {"vector": vec}})}
    assert got["vector per-step add ≥ 0.5× numpy and ahead of every peer (mmreplay zarr)"] is True
    assert got["vector sample(256) ≥ 0.8× numpy and ahead of every peer (mmreplay zarr)"] is False


def test_pixel_frames_are_deterministic_stacks_of_moving_shapes() -> None:
    w = WORKLOADS["pixels"]
    a, b = w.steps(6, seed=3), w.steps(6, seed=3)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    obs, nxt = a["obs"], a["next_obs"]
    assert obs.shape == (6, 8, 84, 84, 4) and obs.dtype == np.uint8
    np.testing.assert_array_equal(nxt[:-1], obs[1:])  # next observation is the next step's
    np.testing.assert_array_equal(obs[1, ..., :3], obs[0, ..., 1:])  # a stack of 4 frames
    assert (obs[0, ..., 0] != obs[0, ..., 3]).any()  # the shapes move


def test_store_figures_small(tmp_path: os.PathLike) -> None:
    out = os.path.join(tmp_path, "figures.json")
    assert store_figures.main(["--small", "--dir", str(tmp_path), "--json", out]) == 0
    with open(out) as f:
        fig = json.load(f)
    for backend in ("zarr", "hdf5"):
        assert fig["add"][backend]["us_per_add"]["median"] > 0
        assert fig["add"][backend]["ratio_to_numpy"] > 0
        com = fig["commit"][backend]["us"]
        assert com["n"] == 50 and 0 < com["median"] <= com["p99"]
        check = fig["state_check"][backend]["us"]
        assert check["n"] == 50 and 0 < check["median"] <= check["p99"]
        for rows in fig["open"]["sizes_rows"]:
            entry = fig["open"][f"{backend}/{rows}"]
            assert entry["r"]["ms"]["median"] > 0 and entry["a"]["ms"]["median"] > 0
    assert os.listdir(tmp_path) == ["figures.json"]
