"""A store in S3: sample(256) against the same store on local disk, push and pull.

The S3 API is a moto server on 127.0.0.1 (bench/s3_server.py), so the figures are the
client's work plus HTTP round trips on the loopback and the server's own cost, not a
network's latency or bandwidth. Workloads (8 envs): ``vector`` (obs float32[17], action
float32[6], reward, terminated, truncated), ``pixels`` (Atari-like obs uint8[84, 84, 4]
stacks, mapped locally, action, reward, terminated, truncated) and ``pixels-rows`` (the same obs as
``rows:zstd`` frames). For each:

- ``sample(256)`` rows/s of a reader on local disk (page-cached) and from S3 (each
  batch: one state GET, the ranged GETs of every leaf in flight together, one state GET
  after), taking turns;
- a full push (every object sent) in MB/s of the bytes sent, and an incremental push
  after 1% more steps: the objects it sent and its seconds; a pull into a new folder;
- for the compressed row leaf: the bytes a ``sample(256)`` fetches from S3 against its
  256 frames' bytes, and the leaf's rows of a batch fetched as frames by range against
  whole chunks through zarr, on the same rows, taking turns.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

import numpy as np

import mmreplay as mr

from .data import NUM_ENVS, du, pixel_spec, steps, vector_spec
from .s3_server import local_s3_server
from .timing import Timed, interleaved, ratio, table

SMOKE = {"scale": 0.02, "batches": 2}
BATCH = 256
BUCKET = "bench"
PIXELS = {k: v for k, v in pixel_spec().items() if k != "next_obs"}
#: name -> (spec, steps, compression)
WORKLOADS: dict[str, tuple[dict[str, mr.ArraySpec], int, dict[str, str] | None]] = {
    "vector": (vector_spec(), 20_000, None),
    "pixels": (PIXELS, 400, None),
    "pixels-rows": (PIXELS, 400, {"obs": "rows:zstd"}),
}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", type=float, default=1.0, help="of each workload's steps")
    p.add_argument(
        "--batches", type=int, default=10, help="batches from S3 per figure (5 times as many locally)"
    )


def extend(path: str, spec: dict[str, Any], n: int, seed: int, **create: Any) -> None:
    """Add ``n`` steps (to a new store when ``create`` options are given)."""
    data = steps(spec, n, seed=seed)
    with mr.create(path, spec, num_envs=NUM_ENVS, **create) if create else mr.open(path, mode="a") as store:
        store.extend(data)


def frame_bytes(folder: str, leaf: str) -> float:
    """The mean bytes of one compressed row's frame: the leaf's sealed shard files less
    their indexes, per row."""
    from mmreplay.backends.row_reads import index_bytes

    with mr.open(folder) as store:
        rows = store.leaves[store.leaf_paths.index(leaf)].info.chunk_steps * store.num_envs
    shards = [
        os.path.join(d, f)
        for d, _, names in os.walk(os.path.join(folder, "data.zarr", leaf, "c"))
        for f in names
        if not f.endswith(".partial")
    ]
    return sum(os.path.getsize(p) - index_bytes(rows) for p in shards) / (len(shards) * rows)


def row_leaf_ab(url: str, leaf: str, batches: int) -> tuple[float, float, float]:
    """The compressed row leaf's rows of a batch fetched as its frames by range (how it is
    read) and as whole chunks through zarr over the same prefix (how another compressed leaf
    is read), the same rows each turn: ms per batch each, and MB fetched per batch."""
    from mmreplay.backends.base import ChunkedLeaf
    from mmreplay.backends.zarr_source import open_array
    from mmreplay.backends.zarr_v3 import ZarrChunks

    with mr.open(url) as store:
        frames = store.leaves[store.leaf_paths.index(leaf)]
        rel = f"data.zarr/{leaf}"
        arr = open_array(store.source, rel, frames.info, store.num_envs, store.capacity, False)
        chunks = ChunkedLeaf(frames.info, store.capacity, ZarrChunks(store.source, rel, arr))
        rng, rows = np.random.default_rng(0), [None]

        def draw() -> None:
            t = rng.integers(store.first_step, store.committed_steps, BATCH)
            rows[0] = (t % store.capacity) * store.num_envs + rng.integers(0, store.num_envs, BATCH)

        traffic, fetched = store.location.traffic, [0]

        def by_frames() -> None:
            before = traffic.bytes
            frames.take(rows[0])
            fetched[0] += traffic.bytes - before

        got = interleaved(
            {
                "frames": Timed(by_frames, before=draw),
                "chunks": Timed(lambda: chunks.take(rows[0]), before=draw),
            },
            batches,
        )
    return got["frames"].median * 1e3, got["chunks"].median * 1e3, fetched[0] / (batches + 1) / 1e6


def measure(
    root: str, name: str, spec: dict[str, Any], n: int, compression: Any, batches: int
) -> tuple[list[Any], list[Any] | None]:
    """One workload's row of the main table, and of the row-leaf table (or None)."""
    local, url, back = os.path.join(root, name), f"s3://{BUCKET}/{name}", os.path.join(root, name + "-pulled")
    extend(local, spec, n, 0, capacity=n, compression=compression)
    nbytes, pushed = du(local), []

    def push() -> None:
        pushed.append(mr.push(local, url))

    full = interleaved({"push": push}, 1, warmup=0)["push"]
    extend(local, spec, max(1, n // 100), 1)
    incremental = interleaved({"push": push}, 1, warmup=0)["push"]
    with mr.open(local) as near, mr.open(url) as far:
        traffic, before = far.location.traffic, far.location.traffic.bytes
        got = interleaved(
            {"local": Timed(lambda: near.sample(BATCH), 5), "s3": Timed(lambda: far.sample(BATCH))}, batches
        )
        fetched = (traffic.bytes - before) / (batches + 1) / 1e6
    pulled = interleaved(
        {"pull": Timed(lambda: mr.pull(url, back), before=lambda: shutil.rmtree(back, ignore_errors=True))},
        1,
        warmup=0,
    )
    local_rate, s3_rate = BATCH * got["local"].rate, BATCH * got["s3"].rate
    leaf: list[Any] = ["–", "–", "–"]
    ab = None
    if compression:
        frames_mb = frame_bytes(local, "obs") * BATCH / 1e6
        leaf = [fetched, frames_mb, ratio(fetched, frames_mb)]
        ab = [name, *row_leaf_ab(url, "obs", batches)]
    row = [name, f"{n:,} x {NUM_ENVS}", nbytes / 1e6, local_rate, s3_rate, got["s3"].median * 1e3, ratio(s3_rate, local_rate),
           pushed[0].uploaded_bytes / full.median / 1e6, f"{pushed[1].uploaded} of {pushed[1].objects}, {incremental.median:.2f}",
           nbytes / pulled["pull"].median / 1e6, *leaf]  # fmt: skip
    return row, ab


def run(args: argparse.Namespace) -> None:
    with local_s3_server(BUCKET):
        got = [
            measure(args.root, name, spec, max(50, int(n * args.scale)), c, args.batches)
            for name, (spec, n, c) in WORKLOADS.items()
        ]
    table(
        "a store in S3 (moto on 127.0.0.1) against the same store on local disk",
        ["workload", "steps x envs", "store MB", f"sample({BATCH}) local rows/s", f"sample({BATCH}) S3 rows/s", "S3 ms/batch",
         "S3 / local", "full push MB/s", "+1% push: objects sent, s", "pull MB/s", "row leaf: MB fetched per batch",
         f"its {BATCH} frames MB", "fetched / frames"],
        [row for row, _ in got],
        [f"medians of {args.batches} S3 batches and {args.batches} blocks of 5 local ones, taking turns"],
    )  # fmt: skip
    ab = [x for _, x in got if x]
    if ab:
        table(
            "the row leaf's rows of a batch from S3: frames by range against whole chunks via zarr",
            [
                "workload",
                "frames by range ms/batch",
                "whole chunks ms/batch",
                "chunks / frames",
                "frames: MB fetched per batch",
            ],
            [[name, f, c, ratio(c, f), mb] for name, f, c, mb in ab],
        )
