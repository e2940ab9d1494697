"""Object storage figures: ``sample(256)`` from a store in S3 against the same store on
local disk, and push / pull throughput.

The S3 API is a moto server on 127.0.0.1 (bench/s3_server.py), so the figures are the
client's work plus HTTP round trips on the loopback and the server's own cost, not a
network's latency or bandwidth. Workloads (8 envs): ``vector`` (obs float32[17], action
float32[6], reward, terminated, truncated), ``pixels`` (obs uint8[84, 84, 4], mapped,
plus the same small leaves) and ``pixels-rows`` (the same obs as ``rows:zstd`` frames,
random so incompressible). For each:

- ``sample(256)`` rows/s in a reader on local disk (page-cached) and from S3 (each batch:
  one state GET, the ranged GETs of every leaf in flight together, one state GET after);
- a full push (every object sent), in MB/s of the bytes sent, and an incremental push
  after 1% more steps: the objects it sent and its seconds;
- a pull into a new folder, MB/s;
- for the compressed row leaf: the bytes a ``sample(256)`` fetches from S3 (range GETs
  counted by ``Store.location.traffic``), against its 256 frames' bytes; and the leaf's
  rows of a batch fetched as frames by range against whole chunks through zarr, on the
  same rows, alternating.

Medians over repeated batches; prints a markdown table whose ratios are computed from
the numbers shown. The defaults run in about a minute and a half on a quiet 2-core
machine. Usage: ``python -m bench.bench_object_store [--quick] [--json OUT]``.
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
from .timing import markdown_table, ratio

NUM_ENVS = 8
BATCH = 256
BUCKET = "bench"

SMALL = {
    "action": mr.ArraySpec((6,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}
#: name -> (spec, steps, S3 batches, compression)
WORKLOADS: dict[str, tuple[dict[str, mr.ArraySpec], int, int, dict[str, str] | None]] = {
    "vector": ({"obs": mr.ArraySpec((17,), "float32"), **SMALL}, 20_000, 20, None),
    "pixels": ({"obs": mr.ArraySpec((84, 84, 4), "uint8"), **SMALL}, 400, 10, None),
    "pixels-rows": ({"obs": mr.ArraySpec((84, 84, 4), "uint8"), **SMALL}, 400, 6, {"obs": "rows:zstd"}),
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
    path: str,
    spec: dict[str, mr.ArraySpec],
    steps: int,
    seed: int = 0,
    capacity: int | None = None,
    compression: dict[str, str] | None = None,
) -> None:
    """Add ``steps`` random steps (to a new store when ``capacity`` is given)."""
    rng = np.random.default_rng(seed)
    if capacity is not None:
        store = mr.create(path, spec, capacity=capacity, num_envs=NUM_ENVS, compression=compression)
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


def frame_bytes(folder: str, leaf: str) -> float:
    """The mean bytes of one compressed row's frame: the leaf's sealed shard files (all
    rows written) less their indexes, per row."""
    from mmreplay.backends.row_reads import index_bytes

    with mr.open(folder) as store:
        info = store.leaves[store.leaf_paths.index(leaf)].info
        rows = info.chunk_steps * store.num_envs
    shards = [
        os.path.join(d, f)
        for d, _, names in os.walk(os.path.join(folder, "data.zarr", leaf, "c"))
        for f in names
        if not f.endswith(".partial")
    ]
    total = sum(os.path.getsize(p) - index_bytes(rows) for p in shards)
    return total / (len(shards) * rows)


def row_leaf_ab(url: str, leaf: str, batches: int) -> dict[str, float]:
    """The compressed row leaf's rows of a batch (256 random committed rows) fetched two
    ways on the same rows, alternating: its frames by range (how it is read), and whole
    chunks through zarr's ``ObjectStore`` (how another compressed leaf is read, with no
    decoded chunk kept between batches). Median ms per batch and bytes per batch."""
    from mmreplay.backends.base import ChunkedLeaf
    from mmreplay.backends.zarr_source import open_array
    from mmreplay.backends.zarr_v3 import ZarrChunks

    with mr.open(url) as store:
        frames = store.leaves[store.leaf_paths.index(leaf)]
        rel = f"data.zarr/{leaf}"
        arr = open_array(store.source, rel, frames.info, store.num_envs, store.capacity, False)
        chunks = ChunkedLeaf(frames.info, store.capacity, ZarrChunks(store.source, rel, arr), 0)
        first, end = store.first_step, store.committed_steps
        rng = np.random.default_rng(0)
        times: dict[str, list[float]] = {"frames": [], "chunks": []}
        fetched = 0
        for i in range(batches + 1):
            steps = rng.integers(first, end, BATCH)
            rows = (steps % store.capacity) * store.num_envs + rng.integers(0, store.num_envs, BATCH)
            for name, way in (("frames", frames), ("chunks", chunks))[:: 1 if i % 2 else -1]:
                before = store.location.traffic.bytes
                t = time.perf_counter()
                got = way.take(rows)
                if i:  # the first round warms both
                    times[name].append(time.perf_counter() - t)
                fetched += store.location.traffic.bytes - before if name == "frames" and i else 0
            np.testing.assert_array_equal(got, frames.take(rows))
        chunk_bytes = frames.info.chunk_steps * store.num_envs
    return {
        "frames_ms": float(np.median(times["frames"])) * 1e3,
        "chunks_ms": float(np.median(times["chunks"])) * 1e3,
        "frames_MB_per_batch": fetched / batches / 1e6,
        "rows_per_chunk": chunk_bytes,
    }


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
            for name, (spec, capacity, batches, compression) in WORKLOADS.items():
                if quick:
                    capacity, batches = max(200, capacity // 50), 5
                local = os.path.join(root, name)
                url = f"s3://{BUCKET}/{name}"
                fill(local, spec, capacity, capacity=capacity, compression=compression)
                nbytes = disk_usage(local)
                fig: dict[str, Any] = {"steps": capacity, "num_envs": NUM_ENVS, "store_bytes": nbytes}
                fig["push_full"] = timed_push(local, url)
                fill(local, spec, max(1, capacity // 100), seed=1)
                fig["push_incremental"] = timed_push(local, url)
                with mr.open(local) as store:
                    fig["sample_local"] = rows_per_second(store, batches * 5)
                with mr.open(url) as store:
                    before = store.location.traffic.bytes
                    fig["sample_s3"] = rows_per_second(store, batches)
                    fetched = store.location.traffic.bytes - before
                if compression:
                    frames = frame_bytes(local, "obs")
                    fig["row_leaf"] = {
                        "MB_fetched_per_batch": fetched / (batches + 1) / 1e6,
                        "MB_of_the_batch_frames": frames * BATCH / 1e6,
                        **row_leaf_ab(url, "obs", batches),
                    }
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
    """The figures as a markdown table; every ratio is of the numbers as shown."""
    rows = []
    for name, f in result["workloads"].items():
        inc = f["push_incremental"]
        local, s3 = f["sample_local"]["rows_per_s"], f["sample_s3"]["rows_per_s"]
        leaf = f.get("row_leaf")
        rows.append(
            [
                name,
                f"{f['steps']:,} x {f['num_envs']}",
                f["store_bytes"] / 1e6,
                local,
                s3,
                f["sample_s3"]["ms_per_batch"],
                ratio(s3, local),
                f["push_full"]["MB_per_s"],
                f"{inc['objects_sent']} of {inc['objects']}, {inc['seconds']:.2f}",
                f["pull"]["MB_per_s"],
                "-" if leaf is None else leaf["MB_fetched_per_batch"],
                "-" if leaf is None else leaf["MB_of_the_batch_frames"],
                "-" if leaf is None else ratio(leaf["MB_fetched_per_batch"], leaf["MB_of_the_batch_frames"]),
            ]
        )
    head = [
        "workload",
        "steps x envs",
        "store MB",
        "sample(256) local rows/s",
        "sample(256) S3 rows/s",
        "S3 ms/batch",
        "S3 / local",
        "full push MB/s",
        "+1% push: objects sent, s",
        "pull MB/s",
        "row leaf: MB fetched per batch",
        "its 256 frames MB",
        "fetched / frames",
    ]
    out = markdown_table(head, rows)
    ab = [
        [name, f["row_leaf"]["frames_ms"], f["row_leaf"]["chunks_ms"], ratio(f["row_leaf"]["chunks_ms"], f["row_leaf"]["frames_ms"])]
        for name, f in result["workloads"].items()
        if "row_leaf" in f
    ]
    if ab:
        out += "\n\n" + markdown_table(
            ["workload", "row leaf from S3: frames by range ms/batch", "whole chunks via zarr ms/batch", "chunks / frames"],
            ab,
        )
    return out


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
