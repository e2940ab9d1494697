"""Compressed pixels side by side: row frames (lz4, zstd-1) vs the mapped store vs numpy.

One leaf ``obs`` of Atari-like frame stacks (uint8[84, 84, 4], from
:mod:`bench.atari_like`), ``--envs`` envs, ``--steps`` steps. Every system samples the
same row ids; batches are dropped after each call, alike for all. Rows/s are medians over
``--repeats`` timings of ``--batches`` batches each, taken round-robin (each repeat times
every system once, in turn) so that a change of load hits all systems alike; each ratio is
computed from the numbers shown in its row. Row-frame leaves are measured twice, decoding
in one native call per leaf (the C extension) and in Python (``MMREPLAY_NATIVE=0``); the
first line printed says which library the native path uses.

Caches, honestly: row frames keep no decoded rows, so every batch decodes every row it
returns; the chunk-compressed leaf's decoded-chunk cache is set to ``--chunk-cache``
(32 MiB), less than the buffer, as it is for any buffer worth compressing; the files and
the mapped store are in the page cache, so the mapped store's figure is the page-cached
one, its best case. ``--cold`` adds what a buffer larger than the page cache sees (one
that does not fit in RAM cannot be made on this machine): before each batch the store is
closed, the page cache of its files is dropped with ``posix_fadvise(DONTNEED)`` and the
store is reopened (none of that timed), so every batch reads its rows from the disk; the
stores take turns batch by batch, with the same row ids (``sample(256, rng=i)``).

    python -m bench.bench_pixels                  # 600 steps x 8 envs, 5 repeats
    python -m bench.bench_pixels --steps 5000     # the 2.26 GB (obs + next_obs) setup: 1.1 GB a leaf
    python -m bench.bench_pixels --steps 200 --repeats 1
    python -m bench.bench_pixels --steps 5000 --cold 40   # also 40 batches from disk per store
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from itertools import cycle

import numpy as np

import mmreplay as mr
from mmreplay.backends import native_rows

from .atari_like import frames, stacked
from .bench_row_decode import open_way
from .bench_sampling import drop_cache

CODECS = {
    "mapped": None,
    "rows:lz4": "rows:lz4",
    "rows:zstd:1": "rows:zstd:1",
    "rows:zstd:1:dict": "rows:zstd:1:dict",
    "zstd (chunks)": "zstd",
}


def rates(systems: dict[str, tuple[Callable[[], object], int, int]], repeats: int) -> dict[str, float]:
    """Median rows/s of each system: ``(fn, rows per call, calls per timing)``; the repeats
    go round-robin over the systems."""
    for fn, _, _ in systems.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, (fn, rows, batches) in systems.items():
            t = time.perf_counter()
            for _ in range(batches):
                fn()
            times[name].append(rows * batches / (time.perf_counter() - t))
    return {name: statistics.median(v) for name, v in times.items()}


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
    p.add_argument(
        "--cold", type=int, default=0, metavar="N", help="also N batches per store read from disk (page cache dropped)"
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
    batch = cycle(ids)
    timed = {"numpy take": (lambda: rows_ram.take(next(batch), axis=0), 256, args.batches)}
    stores = []
    for name, codec in CODECS.items():
        path = os.path.join(root, name.replace(":", "-"))
        spec = {"obs": mr.ArraySpec(obs.shape[2:], "uint8")}
        store = mr.create(path, spec, capacity=n, num_envs=envs, compression=codec, commit_every=64)
        t = time.perf_counter()
        for step in range(n):
            store.add({"obs": obs[step]})
        store.close()
        add = n * envs / (time.perf_counter() - t)
        paths = ["native", "python"] if codec and codec.startswith("rows:") else [""]
        for way in paths:
            label = f"{name} ({way})" if way else name
            store = open_way(path, way or "native")
            stores.append(store)
            store.set_chunk_cache(args.chunk_cache)  # smaller than the buffer, as for any buffer worth compressing
            timed[f"{label} take"] = (partial(take_next, store.leaves[0].take, cycle(ids)), 256, args.batches)
            timed[f"{label} sample"] = (partial(store.sample, 256), 256, args.batches)
            timed[f"{label} seq"] = (partial(store.sample, 32, num_steps=64), 32 * 64, max(1, args.batches // 5))
            results[label] = {"add": add, "bytes": folder_bytes(path)}
    torchrl = torchrl_system(rows_ram, ids, args)
    if isinstance(torchrl, tuple):
        timed["torchrl"] = torchrl
    got = rates(timed, args.repeats)
    for store in stores:
        store.close()
    cold = cold_rates({name: os.path.join(root, name.replace(":", "-")) for name in COLD}, args.cold)
    shutil.rmtree(root)
    for label, r in results.items():
        r.update(take=got[f"{label} take"], sample=got[f"{label} sample"], seq=got[f"{label} seq"])
    numpy_take = got["numpy take"]
    mapped = results["mapped"]
    print(f"row frames decode with: lz4 {native_rows.status('lz4')}, zstd {native_rows.status('zstd')}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end")
    print(f"buffer: {n} steps x {envs} envs of uint8[84, 84, 4] = {obs.nbytes / 2**20:.0f} MiB raw; "
          f"sample(256) rows/s, medians of {args.repeats} x {args.batches} batches, round-robin")
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
    trl = f"{got['torchrl']:,.0f}" if "torchrl" in got else torchrl
    print(f"| TorchRL CompressedListStorage (zstd, RAM) | {trl} | | | | | | | | |")
    if "torchrl" in got:
        for name, r in results.items():
            if name.startswith("rows:"):
                print(f"mmreplay {name} sample(256) / TorchRL get(256): {r['sample'] / got['torchrl']:.2f}×")
    if cold:
        print(f"\nfrom disk (page cache dropped before each batch), sample(256) rows/s, medians of {args.cold} batches")
        print("| system | sample(256) rows/s | vs mapped |")
        print("|---|---|---|")
        for name, rate in cold.items():
            print(f"| mmreplay {name} | {rate:,.0f} | {rate / cold['mapped']:.2f}× |")


#: the stores timed with ``--cold``
COLD = ["mapped", "rows:lz4", "rows:zstd:1", "rows:zstd:1:dict"]


def cold_rates(paths: dict[str, str], batches: int) -> dict[str, float]:
    """Median rows/s of ``sample(256)`` per store, each batch read from disk: the store is
    closed, its files dropped from the page cache and the store reopened before each one
    (untimed); the stores take turns, batch ``i`` drawing the same rows in each."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(batches):
        for name, path in paths.items():
            drop_cache([os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs])
            with open_way(path, "native") as store:
                t = time.perf_counter()
                store.sample(256, rng=i)
                times[name].append(256 / (time.perf_counter() - t))
    return {name: statistics.median(v) for name, v in times.items() if v}


def take_next(take: Callable[[np.ndarray], object], batches: Iterator[np.ndarray]) -> object:
    return take(next(batches))


def torchrl_system(
    rows_ram: np.ndarray, ids: np.ndarray, args: argparse.Namespace
) -> tuple[Callable[[], object], int, int] | str:
    """TorchRL's CompressedListStorage gathering the same rows, or why it could not run."""
    try:
        import torch
        from torchrl.data import CompressedListStorage

        storage = CompressedListStorage(max_size=len(rows_ram))
        storage.set(torch.arange(len(rows_ram)), torch.from_numpy(rows_ram))
        batches = cycle([torch.from_numpy(i) for i in ids])
        fn = lambda: storage.get(next(batches))  # noqa: E731
        fn()
        return fn, 256, args.batches
    except Exception as exc:  # its C++ extension may not load with this torch
        return f"did not run: {type(exc).__name__}: {str(exc)[:80]}"


if __name__ == "__main__":
    main()
