"""Export throughput and peak memory, next to a plain ``cp`` of the same store.

A pixel store (observation and next observation uint8[84, 84, 4], action, reward,
terminated, truncated; 8 envs; episodes of about 100 steps) of ``--gb`` gigabytes is
written, then:

- ``cp -r`` of the store folder is timed (the bytes the OS moves for a copy, no format);
- each format is exported by a fresh child process (``mmreplay.export``), timed
  from the call to its return; the child reports its peak memory from
  ``/proc/self/status``: ``VmHWM`` (peak resident set, which also counts the pages of the
  memory-mapped store it read: page cache, shared and reclaimable) and the peak of
  ``RssAnon`` (the process's own memory, sampled every 5 ms), which is what a buffer
  larger than RAM must keep bounded.

Throughput is the store's data bytes (retained rows x row bytes) over wall seconds, so
every format and ``cp`` are divided by the same number. The store has just been written,
so its pages are in the page cache for every run (as for ``cp``), and nothing is fsynced
(neither does ``cp``). Medians over ``--repeats`` runs, interleaved by format. The
machine is shared (2 cores, other jobs running), so figures are noisy: compare them
within one run, not across runs.

    python bench/bench_export.py --gb 2            # the figure for the README
    python bench/bench_export.py --gb 0.05         # a quick check that it all runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ["npz", "hdf5", "zarr", "pt", "d4rl", "d3rlpy", "minari", "parquet", "csv"]
NUM_ENVS = 8
FRAME = (84, 84, 4)


def spec() -> dict[str, Any]:
    import mmreplay as mr

    return {
        "obs": mr.ArraySpec(FRAME, "uint8"),
        "next_obs": mr.ArraySpec(FRAME, "uint8"),
        "action": mr.ArraySpec((), "int64"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }


def row_bytes() -> int:
    return sum(s.nbytes for s in spec().values())


def frames(steps: np.ndarray) -> np.ndarray:
    """Moving gradients, ``[len(steps), NUM_ENVS, 84, 84, 4]`` uint8 (cheap to make)."""
    ramp = (np.add.outer(np.arange(84), 2 * np.arange(84)) % 256).astype(np.uint8)
    base = (steps[:, None] * 3 + np.arange(NUM_ENVS)[None, :] * 17).astype(np.uint8)
    chan = np.arange(4, dtype=np.uint8) * 40
    return ramp[None, None, :, :, None] + base[:, :, None, None, None] + chan


def build(path: str, gb: float) -> int:
    """Write a full store of about ``gb`` GB; returns its steps."""
    import mmreplay as mr

    steps = max(200, int(gb * 2**30 / (row_bytes() * NUM_ENVS)))
    block = 256
    with mr.create(path, spec(), capacity=steps, num_envs=NUM_ENVS, commit_every=block) as store:
        for a in range(0, steps, block):
            t = np.arange(a, min(steps, a + block))
            phase = (t[:, None] + 13 * np.arange(NUM_ENVS)) % 100
            store.extend(
                {
                    "obs": frames(t),
                    "next_obs": frames(t + 1),
                    "action": (t[:, None] + np.arange(NUM_ENVS)) % 6,
                    "reward": np.sin(t[:, None] * 0.1 + np.arange(NUM_ENVS)).astype(np.float32),
                    "terminated": phase == 99,
                    "truncated": np.zeros((len(t), NUM_ENVS), bool),
                }
            )
    return steps


def vector_store(path: str, steps: int) -> None:
    """A small vector store for the CSV export (a CSV of frames is not a thing people do)."""
    import mmreplay as mr

    s = {
        "obs": mr.ArraySpec((17,), "float32"),
        "next_obs": mr.ArraySpec((17,), "float32"),
        "action": mr.ArraySpec((6,), "float32"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }
    rng = np.random.default_rng(0)
    with mr.create(path, s, capacity=steps, num_envs=NUM_ENVS) as store:
        for a in range(0, steps, 4096):
            n = min(4096, steps - a)
            store.extend(
                {
                    "obs": rng.standard_normal((n, NUM_ENVS, 17), np.float32),
                    "next_obs": rng.standard_normal((n, NUM_ENVS, 17), np.float32),
                    "action": rng.standard_normal((n, NUM_ENVS, 6), np.float32),
                    "reward": rng.standard_normal((n, NUM_ENVS), np.float32),
                    "terminated": rng.random((n, NUM_ENVS)) < 0.01,
                    "truncated": np.zeros((n, NUM_ENVS), bool),
                }
            )


# --- the child that exports ----------------------------------------------------------------


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def child(fmt: str, store_path: str, out: str) -> None:
    # libraries are imported before timing: their import is a constant, not throughput
    import h5py  # noqa: F401
    import zarr  # noqa: F401

    import mmreplay as mr
    from mmreplay.formats import export

    if fmt == "pt":
        import torch  # noqa: F401
    if fmt == "parquet":
        import pyarrow.parquet  # noqa: F401
    peak_anon = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak_anon[0] = max(peak_anon[0], _status()["RssAnon"])
            time.sleep(0.005)

    with mr.open(store_path) as store:
        base = _status()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        export(store, out, format=fmt)
        seconds = time.perf_counter() - t
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        stop.set()
        thread.join()
    end = _status()
    sys.stdout.write(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_seconds": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
                "vm_hwm": end["VmHWM"],
                "peak_anon": max(peak_anon[0], end["RssAnon"]),
                "anon_before": base["RssAnon"],
            }
        )
        + "\n"
    )


# --- the parent ----------------------------------------------------------------------------------


def run_child(fmt: str, store: str, out: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", fmt, store, out],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{fmt} export failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="mmreplay export throughput and peak memory")
    parser.add_argument("--gb", type=float, default=2.0, help="size of the pixel store [2]")
    parser.add_argument("--dir", default=None, help="work folder (needs about 3x --gb free) [a temp folder]")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated formats")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument("--child", nargs=3, metavar=("FORMAT", "STORE", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    sys.path.insert(0, ROOT)
    formats = [f for f in args.formats.split(",") if f]
    work = tempfile.mkdtemp(prefix="mmreplay-bench-export-", dir=args.dir)
    try:
        return _bench(work, args.gb, formats, args.repeats, args.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bench(work: str, gb: float, formats: list[str], repeats: int, json_out: str | None) -> int:
    from mmreplay.files import disk_usage

    store = os.path.join(work, "store")
    t = time.perf_counter()
    steps = build(store, gb)
    data_bytes = steps * NUM_ENVS * row_bytes()
    write_s = time.perf_counter() - t
    vec = os.path.join(work, "vector")
    vec_steps = max(100, int(min(gb, 0.25) * 2**30 / (NUM_ENVS * (17 * 2 + 6 + 1) * 4 * 4)))
    if "csv" in formats:
        vector_store(vec, vec_steps)
    vec_bytes = vec_steps * NUM_ENVS * (17 * 2 + 6 + 1 + 0.5) * 4
    print(
        f"pixel store: {steps:,} steps x {NUM_ENVS} envs, {data_bytes / 2**30:.2f} GiB of data "
        f"({disk_usage(store) / 2**30:.2f} GiB on disk), written in {write_s:.1f} s; "
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    raw: dict[str, Any] = {
        "gb": gb,
        "steps": steps,
        "num_envs": NUM_ENVS,
        "data_bytes": data_bytes,
        "runs": {},
    }

    def cp_once(src: str) -> tuple[float, float]:
        """Wall and CPU seconds of ``cp -r``."""
        dst = os.path.join(work, "cp-copy")
        remove(dst)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        subprocess.run(["cp", "-r", src, dst], check=True)
        seconds = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        remove(dst)
        return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)

    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in formats}
    cps: list[tuple[float, float]] = []
    cps_vec: list[tuple[float, float]] = []
    sizes: dict[str, int] = {}
    for _ in range(repeats):
        cps.append(cp_once(store))
        if "csv" in formats:
            cps_vec.append(cp_once(vec))
        for fmt in formats:
            src = vec if fmt == "csv" else store
            out = os.path.join(work, f"out-{fmt}")
            r = run_child(fmt, src, out)
            sizes[fmt] = disk_usage(out)
            remove(out)
            runs[fmt].append(r)
    raw["cp_seconds"] = cps
    raw["runs"] = runs

    def rate(nbytes: float, seconds: list[float]) -> float:
        return nbytes / 2**20 / max(1e-9, statistics.median(seconds))

    cp_wall = rate(data_bytes, [w for w, _ in cps])
    cp_cpu = rate(data_bytes, [c for _, c in cps])
    if cps_vec:
        cpv_wall = rate(vec_bytes, [w for w, _ in cps_vec])
        cpv_cpu = rate(vec_bytes, [c for _, c in cps_vec])
    print()
    print(
        "| export | store data | MB/s | x cp | MB per CPU-s | x cp (CPU) | output "
        "| peak RSS (VmHWM) | peak own memory (RssAnon, + during the export) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| `cp -r` (baseline) | {data_bytes / 2**30:.2f} GiB | {cp_wall:,.0f} | 1.00 | {cp_cpu:,.0f} | 1.00 "
        "| - | - | - |"
    )
    for fmt in formats:
        rs = runs[fmt]
        csv = fmt == "csv"
        nbytes = vec_bytes if csv else data_bytes
        wall = rate(nbytes, [r["seconds"] for r in rs])
        cpu = rate(nbytes, [r["cpu_seconds"] for r in rs])
        hwm = statistics.median(r["vm_hwm"] for r in rs) / 2**20
        anon = statistics.median(r["peak_anon"] for r in rs) / 2**20
        grew = statistics.median(r["peak_anon"] - r["anon_before"] for r in rs) / 2**20
        name = f"{fmt} (vector store)" if csv else fmt
        print(
            f"| {name} | {nbytes / 2**30:.2f} GiB | {wall:,.0f} | {wall / (cpv_wall if csv else cp_wall):.2f} "
            f"| {cpu:,.0f} | {cpu / (cpv_cpu if csv else cp_cpu):.2f} "
            f"| {sizes[fmt] / 2**20:,.0f} MiB | {hwm:,.0f} MiB | {anon:,.0f} MiB (+{grew:,.0f}) |"
        )
    load = os.getloadavg()
    print(
        f"\nmedians of {repeats} runs; page cache warm; 'x cp' is the ratio to cp -r of the same store "
        f"(csv: of the {vec_steps:,}-step vector store) in this run; CPU-s counts user + system time, "
        f"which other jobs on the machine disturb less than wall time; load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores at the end."
    )
    if json_out:
        with open(json_out, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
