"""Row-frame decoding, native against Python, alternating in one process.

One leaf of Atari-like frame stacks (uint8[84, 84, 4]) per codec, ``--steps`` steps x 8
envs, opened four ways: the mapped (uncompressed) store, row frames decoded in Python
(``MMREPLAY_NATIVE=0``), natively on one thread, and natively with the default threads.
Each repeat times ``leaf.take(256)`` and ``sample(256)`` of every way in turn, the order
reversed every other repeat, so a change of load hits every way alike; the figures are
medians. Batches are dropped after each call, alike for all.

    python -m bench.bench_row_decode                  # 600 steps, 15 repeats
    python -m bench.bench_row_decode --steps 5000     # a buffer larger than the CPU caches
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

from .atari_like import frames, stacked


def open_way(path: str, way: str) -> mr.Store:
    if way == "python":
        os.environ[native_rows.ENV] = "0"
    try:
        store = mr.open(path)
    finally:
        os.environ.pop(native_rows.ENV, None)
    if way == "native, 1 thread":
        store.leaves[0].frames.threads = 1
    return store


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--codecs", default="rows:lz4,rows:zstd:1")
    args = p.parse_args(argv)
    n, envs = args.steps, 8
    obs = np.stack([stacked(frames(n, seed=e)) for e in range(envs)], 1)
    spec = {"obs": mr.ArraySpec(obs.shape[2:], "uint8")}
    ids = np.random.default_rng(0).integers(0, n * envs, (args.batches, 256))
    root = tempfile.mkdtemp(prefix="bench_row_decode-")
    print(f"lz4: {native_rows.status('lz4')}; zstd: {native_rows.status('zstd')}; {os.cpu_count()} CPUs; "
          f"{n} steps x {envs} envs = {obs.nbytes / 2**20:.0f} MiB raw; load average {os.getloadavg()[0]:.2f} at the start")
    try:
        for codec in [None, *args.codecs.split(",")]:
            path = os.path.join(root, (codec or "mapped").replace(":", "-"))
            with mr.create(path, spec, capacity=n, num_envs=envs, compression=codec, commit_every=64) as store:
                for t in range(n):
                    store.add({"obs": obs[t]})
        mapped = mr.open(os.path.join(root, "mapped"))
        for codec in args.codecs.split(","):
            path = os.path.join(root, codec.replace(":", "-"))
            ways = {"mapped": mapped} | {w: open_way(path, w) for w in ("python", "native, 1 thread", "native")}
            times: dict[tuple[str, str], list[float]] = {(w, op): [] for w in ways for op in ("take", "sample")}
            for r in range(args.repeats + 1):
                for w in list(ways) if r % 2 else list(ways)[::-1]:
                    store = ways[w]
                    for op in ("take", "sample"):
                        t = time.perf_counter()
                        for i in range(args.batches):
                            if op == "take":
                                store.leaves[0].take(ids[i])
                            else:
                                store.sample(256)
                        if r:  # the first round warms up
                            times[(w, op)].append(256 * args.batches / (time.perf_counter() - t))
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"\n{codec} (load average {os.getloadavg()[0]:.2f} at the end)")
            print("| way | take(256) rows/s | vs mapped | sample(256) rows/s | vs mapped |")
            print("|---|---|---|---|---|")
            for w in ways:
                print(f"| {w} | {med[(w, 'take')]:,.0f} | {med[(w, 'take')] / med[('mapped', 'take')]:.2f}× | "
                      f"{med[(w, 'sample')]:,.0f} | {med[(w, 'sample')] / med[('mapped', 'sample')]:.2f}× |")
            for w, store in ways.items():
                if w != "mapped":
                    store.close()
        mapped.close()
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
