"""``sample(256)`` of a compressed leaf with more segments than the process keeps mapped.

A row-frame leaf maps each sealed segment's shard file when first read and keeps at most
``MAPPED_SHARDS`` mapped (a quarter of ``vm.max_map_count``, 16,382 by default); it reads
the frames of the other shards with ``pread``, from files it keeps open up to
``OPEN_SHARDS`` (a quarter of ``ulimit -n``), else opened for the batch (see
docs/pixels.md#how-it-works). At the default segment size a leaf needs more than ~64 GiB
raw to pass the first budget, which this machine cannot hold, so the benchmark lowers the
budgets instead: one leaf ``obs`` of Atari-like stacks (uint8[84, 84, 4], ``--envs``
envs, ``--steps`` steps, the default segment of 4 MiB raw, every segment a shard file),
sampled with every segment mapped, with a quarter of them mapped (as 16,382 are of
55,000) and the rest kept open, and with a quarter mapped and none kept open (as with
``ulimit -n`` 1,024 at 55,000 segments). The settings take turns in one process
(``--repeats`` blocks of ``--batches`` batches each, one untimed batch after each
switch); rows/s are medians over the blocks. The shard files are in the page cache
throughout.

    python -m bench.bench_mapping_budget                    # rows:lz4, 7,200 steps x 8 envs
    python -m bench.bench_mapping_budget --codec rows:zstd:1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import mmreplay as mr
from mmreplay.backends import native_rows

try:  # where the budgets are read
    from mmreplay.backends import row_reads as row_frames
except ImportError:  # a checkout from before the reads had a module of their own
    from mmreplay.backends import row_frames  # type: ignore[no-redef]

from .atari_like import frames, stacked

#: distinct steps of frames generated per env; the steps after repeat them (each row is
#: its own compressed frame, so a repeated row compresses as the first did)
DISTINCT_STEPS = 600


def rate(store: mr.Store, batches: int) -> float:
    store.sample(256)  # untimed: the mappings of the setting before are let go here
    t = time.perf_counter()
    for _ in range(batches):
        store.sample(256)
    return 256 * batches / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codec", default="rows:lz4")
    p.add_argument("--steps", type=int, default=7_200)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--batches", type=int, default=40)
    args = p.parse_args(argv)
    n, envs = args.steps, args.envs
    obs = np.stack([stacked(frames(min(n, DISTINCT_STEPS), seed=e)) for e in range(envs)], 1)
    root = tempfile.mkdtemp(prefix="bench_mapping_budget-")
    # getattr: the same script runs against a checkout from before OPEN_SHARDS, to compare
    default_budgets = row_frames.MAPPED_SHARDS, getattr(row_frames, "OPEN_SHARDS", 0)
    try:
        path = os.path.join(root, "b")
        spec = {"obs": mr.ArraySpec(obs.shape[2:], "uint8")}
        with mr.create(path, spec, capacity=n, num_envs=envs, compression=args.codec, commit_every=64) as store:
            for step in range(n):
                store.add({"obs": obs[step % len(obs)]})
        with mr.open(path) as store:
            leaf = store.leaves[0]
            segments = leaf.nseg
            quarter = segments // 4
            settings = {
                "all mapped": (segments, segments),
                f"{quarter:,} mapped, the rest kept open": (quarter, segments),
                f"{quarter:,} mapped, none kept open": (quarter, 0),
            }
            times: dict[str, list[float]] = {name: [] for name in settings}
            for _ in range(args.repeats):
                for name, (mapped, kept_open) in settings.items():
                    row_frames.MAPPED_SHARDS, row_frames.OPEN_SHARDS = mapped, kept_open
                    times[name].append(rate(store, args.batches))
        print(f"{args.codec} sample(256), {n:,} steps x {envs} envs of uint8[84, 84, 4], {segments:,} segments "
              f"of {leaf.seg} steps; decode {native_rows.status(args.codec.split(':')[1])}; medians of "
              f"{args.repeats} x {args.batches} batches, alternating; load average {os.getloadavg()[0]:.2f}")
        first = statistics.median(next(iter(times.values())))
        for name, got in times.items():
            median = statistics.median(got)
            print(f"{name:<36} {median:>10,.0f} rows/s  {median / first:.2f}×")
    finally:
        row_frames.MAPPED_SHARDS, row_frames.OPEN_SHARDS = default_budgets
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
