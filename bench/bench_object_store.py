"""Object storage figures: ``sample(256)`` from a store in S3 against the same store on
local disk, and push / pull throughput.

The S3 API is a moto server on 127.0.0.1 (bench/s3_server.py), so the figures are the
client's work plus HTTP round trips on the loopback and the server's own cost, not a
network's latency or bandwidth. Workloads (8 envs): ``vector`` (obs float32[17], action
float32[6], reward, terminated, truncated) and ``pixels`` (obs uint8[84, 84, 4], mapped,
plus the same small leaves). For each:

- ``sample(256)`` rows/s in a reader on local disk (page-cached) and from S3 (each batch:
  one state GET, the ranged GETs of every leaf in flight together, one state GET after);
- a full push (every object sent), in MB/s of the bytes sent, and an incremental push
  after 1% more steps: the objects it sent and its seconds;
- a pull into a new folder, MB/s.

Medians over repeated batches. Usage: ``python -m bench.bench_object_store [--quick] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay.files import disk_usage

from .s3_server import local_s3_server

NUM_ENVS = 8
BATCH = 256
BUCKET = "bench"

SMALL = {
    "action": mr.ArraySpec((6,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}
WORKLOADS = {
    "vector": ({"obs": mr.ArraySpec((17,), "float32"), **SMALL}, 50_000, 2_000),
    "pixels": ({"obs": mr.ArraySpec((84, 84, 4), "uint8"), **SMALL}, 1_000, 200),
}


def random_steps(spec: dict[str, mr.ArraySpec], n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    out = {}
    for key, leaf in spec.items():
        shape = (n, NUM_ENVS, *leaf.shape)
        if leaf.dtype == np.bool_:
            out[key] = rng.random(shape) < 0.01
        elif leaf.dtype == np.uint8:
            out[key] = rng.integers(0, 256, shape, dtype=np.uint8)
        else:
            out[key] = rng.standard_normal(shape).astype(leaf.dtype)
    return out


def fill(
    path: str, spec: dict[str, mr.ArraySpec], steps: int, seed: int = 0, capacity: int | None = None
) -> None:
    """Add ``steps`` random steps (to a new store when ``capacity`` is given)."""
    rng = np.random.default_rng(seed)
    if capacity is not None:
        store = mr.create(path, spec, capacity=capacity, num_envs=NUM_ENVS)
    else:
        store = mr.open(path, mode="a")
    with store:
        for a in range(0, steps, 100):
            store.extend(random_steps(spec, min(100, steps - a), rng))


def rows_per_second(store: mr.Store, batches: int) -> dict[str, float]:
    store.sample(BATCH, rng=0)  # warm: the reader, the connection pool, the page cache
    times = []
    for i in range(batches):
        t = time.perf_counter()
        store.sample(BATCH, rng=i + 1)
        times.append(time.perf_counter() - t)
    median = float(np.median(times))
    return {"rows_per_s": BATCH / median, "ms_per_batch": median * 1e3, "batches": batches}


def timed_push(local: str, url: str) -> dict[str, Any]:
    """One push: seconds, objects and bytes sent, and MB/s of the bytes sent."""
    t = time.perf_counter()
    report = mr.push(local, url)
    seconds = time.perf_counter() - t
    return {
        "seconds": seconds,
        "objects_sent": report.uploaded,
        "objects": report.objects,
        "bytes_sent": report.uploaded_bytes,
        "MB_per_s": report.uploaded_bytes / seconds / 1e6,
    }


def run(quick: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "machine": {
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "workloads": {},
    }
    root = tempfile.mkdtemp(prefix="mmreplay-bench-s3-")
    try:
        with local_s3_server(BUCKET):
            for name, (spec, capacity, batches) in WORKLOADS.items():
                if quick:
                    capacity, batches = max(200, capacity // 50), 20
                else:
                    batches = 200 if name == "vector" else 50
                local = os.path.join(root, name)
                url = f"s3://{BUCKET}/{name}"
                fill(local, spec, capacity, capacity=capacity)
                nbytes = disk_usage(local)
                fig: dict[str, Any] = {"steps": capacity, "num_envs": NUM_ENVS, "store_bytes": nbytes}
                fig["push_full"] = timed_push(local, url)
                fill(local, spec, max(1, capacity // 100), seed=1)
                fig["push_incremental"] = timed_push(local, url)
                with mr.open(local) as store:
                    fig["sample_local"] = rows_per_second(store, batches * 5)
                with mr.open(url) as store:
                    fig["sample_s3"] = rows_per_second(store, batches)
                fig["s3_vs_local"] = fig["sample_s3"]["rows_per_s"] / fig["sample_local"]["rows_per_s"]
                back = os.path.join(root, name + "-pulled")
                t = time.perf_counter()
                mr.pull(url, back)
                seconds = time.perf_counter() - t
                fig["pull"] = {"seconds": seconds, "MB_per_s": nbytes / seconds / 1e6}
                out["workloads"][name] = fig
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "| workload | steps x envs | store MB | sample(256) local rows/s | sample(256) S3 rows/s (ms/batch) | S3 / local | full push MB/s | +1% push: objects sent, s | pull MB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, f in result["workloads"].items():
        inc = f["push_incremental"]
        lines.append(
            f"| {name} | {f['steps']:,} x {f['num_envs']} | {f['store_bytes'] / 1e6:.1f} "
            f"| {f['sample_local']['rows_per_s']:,.0f} "
            f"| {f['sample_s3']['rows_per_s']:,.0f} ({f['sample_s3']['ms_per_batch']:.1f}) "
            f"| {f['s3_vs_local']:.3f} | {f['push_full']['MB_per_s']:.1f} "
            f"| {inc['objects_sent']} of {inc['objects']}, {inc['seconds']:.2f} | {f['pull']['MB_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small stores, few batches (a smoke run)")
    parser.add_argument("--json", default=None, help="also write the figures as JSON to this file")
    args = parser.parse_args(argv)
    result = run(args.quick)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
