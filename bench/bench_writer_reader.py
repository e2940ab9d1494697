"""Uncompressed ``sample(256, out=)`` of a writer against a reader of the same store, and
the things that differ between them, in one process with alternating blocks.

The data and the numpy baseline are those of :mod:`bench.bench_sample_out` (Atari-like
obs and next_obs uint8[84, 84, 4] and four small leaves, 8 envs). A writer and a reader
of the same store differ on the sampling path in three ways only: the reader re-reads the
committed state after each batch, advises its mapping ``MADV_RANDOM``, and maps the file
read-only (the writer read-write). So beside the writer and the reader of each backend it
times the hdf5 reader without the advice and the hdf5 writer with it, and prints for each
system the minor page faults per batch and, for each mapping, how much of it the kernel
maps with huge (PMD) entries, which sets how many TLB misses a random gather takes.

Every store is opened with ``populate=True`` and waited for. Blocks of 40 batches run in
turn, the order reversed every other repeat; cells are medians of the same number of
blocks for every system, by the wall clock and by the calling thread's CPU time.
Usage: ``python -m bench.bench_writer_reader [--steps 5000] [--repeats 15] [--dir D]``.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay import read

from .bench_sample_out import (
    BATCH,
    NUM_ENVS,
    POOL,
    empty_batch,
    flat_rows,
    make_data,
    numpy_gathers,
    write_store,
)

CALLS = 40
ADVISED = "hdf5 writer, MADV_RANDOM"


def mappings(root: str) -> list[str]:
    """Each mapping of a frames leaf under ``root``: its resident and its PMD-mapped MB
    (from ``/proc/self/smaps``; empty where there is none)."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        head = block.split("\n", 1)[0].split()
        if len(head) < 6 or not head[-1].startswith(root) or not re.search(r"obs|data\.h5", head[-1]):
            continue
        kb = dict(re.findall(r"^(\w+):\s+(\d+) kB", block, re.M))
        rss, pmd = int(kb.get("Rss", 0)) >> 10, int(kb.get("FilePmdMapped", 0)) >> 10
        if rss:
            where = os.path.relpath(head[-1], root)
            out.append(f"{head[1]} {where:38s} resident {rss:5d} MB, PMD-mapped {pmd:5d} MB")
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=5_000, help="steps of 8 envs (default 5000: 2.26 GB of frames)"
    )
    parser.add_argument("--repeats", type=int, default=15, help="blocks of 40 batches per system")
    parser.add_argument("--dir", default=None, help="folder for the stores (default: a temp folder)")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="mmreplay-bench-wr-", dir=args.dir)
    print(f"load average before: {os.getloadavg()}", flush=True)
    stores: dict[str, Any] = {}
    try:
        data = make_data(args.steps)
        into, _ = numpy_gathers(flat_rows(data), args.steps * NUM_ENVS)
        for backend in ("zarr", "hdf5"):
            write_store(os.path.join(root, backend), data, backend)
        for name, backend, mode in (
            ("zarr writer", "zarr", "a"),
            ("zarr reader", "zarr", "r"),
            ("hdf5 writer", "hdf5", "a"),
            ("hdf5 reader", "hdf5", "r"),
            ("hdf5 reader, no advice", "hdf5", "r"),
        ):
            store = stores[name] = mr.open(os.path.join(root, backend), mode, populate=True)
            store._populator.wait()
        read.set_prefetch(stores["hdf5 reader, no advice"], False, advise=False)
        writer = stores["hdf5 writer"]

        def sampling(store: Any) -> Callable[[np.random.Generator, Any], Any]:
            return lambda g, out: store.sample(BATCH, rng=g, out=out)

        fns: dict[str, Callable[[np.random.Generator, Any], Any]] = {"numpy take(out=)": into}
        fns.update({name: sampling(store) for name, store in stores.items()})
        fns[ADVISED] = sampling(writer)  # advised MADV_RANDOM for its blocks only
        pools = {name: [empty_batch() for _ in range(POOL)] for name in fns}
        wall: dict[str, list[float]] = {name: [] for name in fns}
        cpu: dict[str, list[float]] = {name: [] for name in fns}
        faults: dict[str, list[float]] = {name: [] for name in fns}
        for name, fn in fns.items():  # warm up
            g = np.random.default_rng(0)
            for i in range(10):
                fn(g, pools[name][i % POOL])
        for r in range(args.repeats):
            for name in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                fn, pool = fns[name], pools[name]
                if name == ADVISED:
                    read.set_prefetch(writer, False, advise=True)
                g = np.random.default_rng(r)
                f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                t0, c0 = time.perf_counter(), time.thread_time()
                for i in range(CALLS):
                    fn(g, pool[i % POOL])
                c1, t1 = time.thread_time(), time.perf_counter()
                faults[name].append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0) / CALLS)
                if name == ADVISED:
                    read.set_prefetch(writer, False, advise=False)
                wall[name].append((t1 - t0) / CALLS)
                cpu[name].append((c1 - c0) / CALLS)
        print(
            f"\nsample({BATCH}, out=), {args.steps} steps x {NUM_ENVS} envs, {args.repeats} blocks of {CALLS} "
            f"batches per system; load average after: {os.getloadavg()}\n"
        )
        base_wall = round(statistics.median(wall["numpy take(out=)"]) * 1e3, 3)
        base_cpu = round(statistics.median(cpu["numpy take(out=)"]) * 1e3, 3)
        print("| system | wall ms | × numpy | CPU ms | × numpy | minor faults per batch |")
        print("|---|---|---|---|---|---|")
        for name in fns:
            w = round(statistics.median(wall[name]) * 1e3, 3)
            c = round(statistics.median(cpu[name]) * 1e3, 3)
            f = statistics.median(faults[name])
            print(f"| {name} | {w:.3f} | {base_wall / w:.2f} | {c:.3f} | {base_cpu / c:.2f} | {f:.1f} |")
        print("\nmappings (perm, file, resident, huge-page mapped):")
        print("\n".join(f"- {line}" for line in mappings(root)))
    finally:
        for store in stores.values():
            store.close()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
