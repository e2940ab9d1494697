"""Compressed pixels side by side: row frames (lz4, zstd-1) vs the mapped store vs numpy.

One leaf ``obs`` of Atari-like frame stacks (uint8[84, 84, 4], from
:mod:`bench.atari_like`), ``--envs`` envs, ``--steps`` steps. Every system samples the
same row ids; batches are dropped after each call, alike for all. Rows/s are medians over
``--repeats`` timings of ``--batches`` batches each; each ratio is computed from the
numbers shown in its row.

Caches, honestly: row frames keep no decoded rows, so every batch decodes every row it
returns; the chunk-compressed leaf's decoded-chunk cache is set to ``--chunk-cache``
(32 MiB), less than the buffer, as it is for any buffer worth compressing; the files and
the mapped store are in the page cache (a buffer larger than the page cache cannot be
made on this machine), so the mapped store's figure is the page-cached one, its best case.

    python -m bench.bench_pixels                  # 600 steps x 8 envs, 5 repeats
    python -m bench.bench_pixels --steps 200 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial

import numpy as np

import mmreplay as mr

from .atari_like import frames, stacked

CODECS = {
    "mapped": None,
    "rows:lz4": "rows:lz4",
    "rows:zstd:1": "rows:zstd:1",
    "rows:zstd:1:dict": "rows:zstd:1:dict",
    "zstd (chunks)": "zstd",
}


def rate(fn: Callable[[], object], rows: int, batches: int, repeats: int) -> float:
    """Median rows/s of ``batches`` calls of ``fn`` (each returning ``rows`` rows)."""
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(batches):
            fn()
        out.append(rows * batches / (time.perf_counter() - t))
    return statistics.median(out)


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument(
        "--chunk-cache", type=int, default=32 << 20, help="decoded-chunk cache of the chunk-compressed leaf, bytes"
    )
    args = p.parse_args(argv)
    n, envs = args.steps, args.envs
    obs = np.stack([stacked(frames(n, seed=e)) for e in range(envs)], 1)  # [n, envs, 84, 84, 4]
    ids = np.random.default_rng(0).integers(0, n * envs, (args.batches, 256))
    rows_ram = obs.reshape(n * envs, *obs.shape[2:])
    results: dict[str, dict[str, float]] = {}
    root = tempfile.mkdtemp(prefix="bench_pixels-")
    ring = np.empty_like(obs)

    def numpy_add() -> None:
        for t in range(n):
            ring[t] = obs[t]

    t = time.perf_counter()
    numpy_add()
    numpy_add_rate = n * envs / (time.perf_counter() - t)
    k = iter(range(1 << 30))
    numpy_take = rate(lambda: rows_ram.take(ids[next(k) % args.batches], axis=0), 256, args.batches, args.repeats)
    for name, codec in CODECS.items():
        path = os.path.join(root, name.replace(":", "-"))
        spec = {"obs": mr.ArraySpec(obs.shape[2:], "uint8")}
        store = mr.create(path, spec, capacity=n, num_envs=envs, compression=codec, commit_every=64)
        t = time.perf_counter()
        for step in range(n):
            store.add({"obs": obs[step]})
        store.close()
        add = n * envs / (time.perf_counter() - t)
        store = mr.open(path)
        store.set_chunk_cache(args.chunk_cache)  # smaller than the buffer, as for any buffer worth compressing
        take_rows, sample, seqs = store.leaves[0].take, store.sample, partial(store.sample, 32, num_steps=64)
        it = iter(range(1 << 30))
        take = rate(lambda: take_rows(ids[next(it) % args.batches]), 256, args.batches, args.repeats)  # noqa: B023
        sample = rate(partial(sample, 256), 256, args.batches, args.repeats)
        seq = rate(seqs, 32 * 64, max(1, args.batches // 5), args.repeats)
        store.close()
        results[name] = {"take": take, "sample": sample, "seq": seq, "add": add, "bytes": folder_bytes(path)}
    torchrl = torchrl_rate(rows_ram, ids, args)
    mapped = results["mapped"]
    print(f"buffer: {n} steps x {envs} envs of uint8[84, 84, 4] = {obs.nbytes / 2**20:.0f} MiB raw; "
          f"sample(256) rows/s, medians of {args.repeats} x {args.batches} batches")
    print("| system | leaf.take(256) rows/s | sample(256) rows/s | vs mapped | vs numpy take | "
          "sample(32, num_steps=64) rows/s | vs mapped | add rows/s | vs numpy | bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| numpy in RAM, `take` | {numpy_take:,.0f} | | | 1.00× | | | {numpy_add_rate:,.0f} | 1.00× | {obs.nbytes:,} |")
    for name, r in results.items():
        print(
            f"| mmreplay {name} | {r['take']:,.0f} | {r['sample']:,.0f} | {r['sample'] / mapped['sample']:.2f}× | "
            f"{r['take'] / numpy_take:.2f}× | {r['seq']:,.0f} | {r['seq'] / mapped['seq']:.2f}× | "
            f"{r['add']:,.0f} | {r['add'] / numpy_add_rate:.2f}× | {r['bytes']:,} |"
        )
    print(f"| TorchRL CompressedListStorage (zstd, RAM) | {torchrl} | | | | | | | | |")


def torchrl_rate(rows_ram: np.ndarray, ids: np.ndarray, args: argparse.Namespace) -> str:
    """TorchRL's CompressedListStorage gathering the same rows, or why it could not run."""
    try:
        import torch
        from torchrl.data import CompressedListStorage

        storage = CompressedListStorage(max_size=len(rows_ram))
        storage.set(torch.arange(len(rows_ram)), torch.from_numpy(rows_ram))
        it = iter(range(1 << 30))
        got = rate(lambda: storage.get(torch.from_numpy(ids[next(it) % args.batches])), 256, args.batches, args.repeats)
        return f"{got:,.0f}"
    except Exception as exc:  # its C++ extension may not load with this torch
        return f"did not run: {type(exc).__name__}: {str(exc)[:80]}"


if __name__ == "__main__":
    main()
