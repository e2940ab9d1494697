"""Sampling speed: store.sample against numpy fancy indexing of the same data in RAM.

Two parts:

1. Page-cached buffers (the data files are read once before timing). For the vector
   workload (5 leaves: obs float32[17], action float32[6], reward, terminated,
   truncated; 8 envs) and the pixel workload (obs uint8[84, 84, 4] plus the same four
   small leaves; 8 envs), ``sample(256)`` and ``sample(32, num_steps=64)`` are timed in
   the writer (mode "a") and in a reader (mode "r", which also re-reads the committed
   state after each batch: the seqlock), on each mapped backend and on zarr+zstd. The
   baselines, on copies of the same arrays in RAM with the same index draws, are
   ``arr[t, e]`` on ``[steps, envs, ...]`` arrays (what a numpy ring buffer does) and
   ``arr.reshape(steps * envs, ...).take(rows)`` (the fastest numpy gather).
2. Data larger than memory: before each batch the store is closed, the page cache of its
   data files is dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` and the store is
   reopened (none of that timed), so every batch starts with none of its rows in memory.
   ``sample(256)`` is timed in a reader with the kernel's default readahead, with
   ``MADV_RANDOM``, and with ``MADV_RANDOM`` plus ``MADV_WILLNEED`` of the batch's pages,
   next to ``os.pread`` of the same rows, one call per row and leaf, after the same drop
   (the disk's raw random-read rate at queue depth 1).

Figures are medians over repeated blocks, interleaved so that noise from other processes
hits every variant alike. Usage:
``python bench/bench_sampling.py [--quick] [--clock wall|cpu] [--skip-cold] [--json OUT]``.
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
from collections.abc import Callable
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay import read

NUM_ENVS = 8


def small_leaves() -> dict[str, mr.ArraySpec]:
    return {
        "action": mr.ArraySpec((6,), "float32"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }


WORKLOADS = {
    "vector": {"obs": mr.ArraySpec((17,), "float32"), **small_leaves()},
    "pixels": {"obs": mr.ArraySpec((84, 84, 4), "uint8"), **small_leaves()},
}


def block_of(spec: dict, n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for key, s in spec.items():
        shape = (n, NUM_ENVS, *s.shape)
        if s.dtype == np.uint8:
            out[key] = rng.integers(0, 256, shape, dtype=np.uint8)
        elif s.dtype == np.bool_:
            out[key] = rng.random(shape) < 0.01
        else:
            out[key] = rng.standard_normal(shape).astype(s.dtype)
    return out


def fill(path: str, spec: dict, steps: int, **layout: Any) -> None:
    block = max(1, min(steps, (64 << 20) // (NUM_ENVS * sum(s.nbytes for s in spec.values()))))
    data = block_of(spec, block, 0)
    with mr.create(path, spec, steps, num_envs=NUM_ENVS, commit_every=1 << 40, **layout) as store:
        done = 0
        while done < steps:
            k = min(block, steps - done)
            store.extend({key: v[:k] for key, v in data.items()})
            done += k


def data_files(path: str) -> list[str]:
    with mr.open(path, populate=False) as store:
        leaves = store.metadata.leaves
    out = set()
    for leaf in leaves:
        f = os.path.join(path, leaf.file or "")
        if os.path.isdir(f):
            out.update(os.path.join(d, x) for d, _, xs in os.walk(f) for x in xs)
        else:
            out.add(f)
    return sorted(out)


def drop_cache(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(files: list[str]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


# --- page-cached ---------------------------------------------------------------------------


CLOCK = time.perf_counter


def timed_blocks(
    fns: dict[str, Callable[[np.random.Generator], Any]], calls: int, repeats: int
) -> dict[str, float]:
    """Median seconds per call of each function, blocks interleaved."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm up: page tables, caches, the prefetch decision
        g = np.random.default_rng(0)
        for _ in range(max(3, calls // 4)):
            fn(g)
    for r in range(repeats):
        for name, fn in fns.items():
            g = np.random.default_rng(r)
            t0 = CLOCK()
            for _ in range(calls):
                fn(g)
            times[name].append((CLOCK() - t0) / calls)
    return {name: float(np.median(ts)) for name, ts in times.items()}


def variants(
    writer: Any, reader: Any, ram: list, flat: list, steps: int, batch: int, num_steps: int | None
) -> dict:
    """The timed calls: two numpy baselines on RAM copies, the store's writer and a reader."""
    T = 1 if num_steps is None else num_steps
    ar = np.arange(T)

    def numpy_te(g: np.random.Generator) -> list:
        t = g.integers(0, steps - T + 1, batch)
        e = g.integers(0, NUM_ENVS, batch)
        if num_steps is None:
            return [a[t, e] for a in ram]
        return [a[t[:, None] + ar, e[:, None]] for a in ram]

    def numpy_take(g: np.random.Generator) -> list:
        k = g.integers(0, (steps - T + 1) * NUM_ENVS, batch)
        if num_steps is not None:
            k = k[:, None] + ar * NUM_ENVS
        return [a.take(k, 0) for a in flat]

    return {
        "numpy arr[t, e]": numpy_te,
        "numpy take": numpy_take,
        "mmreplay writer": lambda g: writer.sample(batch, num_steps, rng=g),
        "mmreplay reader": lambda g: reader.sample(batch, num_steps, rng=g),
    }


def cached(
    workload: str, steps: int, layouts: list[tuple[str, str | None]], quick: bool, root: str
) -> list[dict]:
    spec = WORKLOADS[workload]
    rows_out = []
    for backend, compression in layouts:
        path = os.path.join(root, f"{workload}-{backend}-{compression or 'mapped'}")
        fill(path, spec, steps, backend=backend, compression=compression)
        warm(data_files(path))
        writer = mr.open(path, "a")
        reader = mr.open(path, "r")
        try:
            ram = [
                np.array(leaf.array if hasattr(leaf, "flat") else leaf.read(slice(None)))
                for leaf in writer._leaves
            ]
            flat = [a.reshape(steps * NUM_ENVS, *a.shape[2:]) for a in ram]
            first, end = writer.first_step, writer.state.end
            assert (first, end) == (0, steps)
            for batch, num_steps in ((256, None), (32, 64)):
                T = 1 if num_steps is None else num_steps
                fns = variants(writer, reader, ram, flat, steps, batch, num_steps)
                rows = batch * T
                row_bytes = sum(s.nbytes for s in spec.values())
                calls = max(5, int((2e6 if quick else 2e7) // (rows * row_bytes + 20000)))
                secs = timed_blocks(fns, calls, 5 if quick else 11)
                rates = {name: rows / s for name, s in secs.items()}
                entry = {
                    "workload": workload,
                    "layout": f"{backend}{'+' + compression if compression else ''}",
                    "call": f"sample({batch}" + (f", num_steps={num_steps})" if num_steps else ")"),
                    "rows_per_s": rates,
                    "us_per_call": {name: s * 1e6 for name, s in secs.items()},
                    "writer_vs_take": rates["mmreplay writer"] / rates["numpy take"],
                    "writer_vs_te": rates["mmreplay writer"] / rates["numpy arr[t, e]"],
                    "reader_vs_take": rates["mmreplay reader"] / rates["numpy take"],
                    "reader_vs_te": rates["mmreplay reader"] / rates["numpy arr[t, e]"],
                }
                rows_out.append(entry)
                print(
                    f"{workload:6s} {entry['layout']:10s} {entry['call']:24s} "
                    + "  ".join(f"{n}: {r / 1e6:7.3f}M rows/s" for n, r in rates.items())
                    + f"  | writer/take {entry['writer_vs_take']:.2f}  reader/take {entry['reader_vs_take']:.2f}"
                    f"  writer/[t,e] {entry['writer_vs_te']:.2f}  reader/[t,e] {entry['reader_vs_te']:.2f}",
                    flush=True,
                )
        finally:
            writer.close()
            reader.close()
            shutil.rmtree(path, ignore_errors=True)
    return rows_out


# --- larger than memory --------------------------------------------------------------------


def pread_rows(path: str, slots: np.ndarray, envs: np.ndarray) -> float:
    """Seconds to read the rows of every leaf with one os.pread per row and leaf."""
    with mr.open(path) as store:
        leaves = store.metadata.leaves
    fds: dict[str, int] = {}
    plan = []
    for leaf in leaves:
        f = os.path.join(path, leaf.file or "")
        if f not in fds:
            fds[f] = os.open(f, os.O_RDONLY)
        plan.append((fds[f], leaf.offset or 0, leaf.spec.nbytes))
    try:
        rows = (slots * NUM_ENVS + envs).tolist()
        t0 = time.perf_counter()
        for fd, offset, nbytes in plan:
            for r in rows:
                os.pread(fd, nbytes, offset + r * nbytes)
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


def cold(workload: str, steps: int, batches: int, root: str) -> dict:
    spec = WORKLOADS[workload]
    path = os.path.join(root, f"cold-{workload}")
    fill(path, spec, steps)
    files = data_files(path)
    size = sum(os.path.getsize(f) for f in files)
    out: dict[str, Any] = {"workload": workload, "data_bytes": size, "rows": steps * NUM_ENVS, "batch": 256}
    modes = {  # (prefetch, advise)
        "kernel readahead": (False, False),
        "MADV_RANDOM": (False, True),
        "MADV_RANDOM+WILLNEED": (True, True),
    }
    times: dict[str, list[float]] = {name: [] for name in modes} | {"pread": []}
    try:
        for i in range(batches):
            slots = envs = None
            for mode, (prefetch, advise) in modes.items():
                drop_cache(files)
                with mr.open(path, populate=False) as store:  # the data as if larger than memory
                    read.set_prefetch(store, prefetch, advise=advise)
                    t0 = time.perf_counter()
                    _, info = store.sample(256, rng=i, return_info=True)
                    times[mode].append(time.perf_counter() - t0)
                slots, envs = info.slot, info.env
            drop_cache(files)
            times["pread"].append(pread_rows(path, slots, envs))
    finally:
        shutil.rmtree(path, ignore_errors=True)
    out["rows_per_s"] = {k: 256 / float(np.median(v)) for k, v in times.items()}
    print(
        f"cold {workload:6s} {size / 2**30:.2f} GiB: "
        + "  ".join(f"{k}: {v:8.0f} rows/s" for k, v in out["rows_per_s"].items()),
        flush=True,
    )
    return out


def conditions() -> dict:
    return {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg": os.getloadavg(),
    }


def add_clock_option(parser: argparse.ArgumentParser) -> None:
    """``--clock wall|cpu`` for the page-cached part; :func:`set_clock` applies it."""
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="page-cached part: wall time, or the calling thread's CPU time (steadier on a busy machine)",
    )


def set_clock(name: str) -> None:
    global CLOCK
    CLOCK = time.perf_counter if name == "wall" else time.thread_time


def finish(results: dict, json_path: str | None) -> None:
    """Record the conditions after the run, print them, write ``results`` as JSON if asked."""
    results["conditions_after"] = conditions()
    print(f"conditions after: {results['conditions_after']}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (a smoke run)")
    parser.add_argument("--dir", default=None, help="folder for the buffers (default: a temp folder)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--skip-cold", action="store_true", help="only the page-cached part")
    add_clock_option(parser)
    args = parser.parse_args(argv)
    set_clock(args.clock)
    root = tempfile.mkdtemp(prefix="mmreplay-bench-sampling-", dir=args.dir)
    q = args.quick
    results: dict[str, Any] = {"conditions_before": conditions(), "clock": args.clock}
    print(f"conditions: {results['conditions_before']}", flush=True)
    try:
        layouts = [("zarr", None), ("hdf5", None), ("zarr", "zstd")]
        results["cached"] = cached("vector", 20_000 if q else 200_000, layouts, q, root)
        results["cached"] += cached("pixels", 300 if q else 2_000, layouts[:2] if q else layouts, q, root)
        if not args.skip_cold:
            results["cold"] = [
                cold("vector", 200_000 if q else 2_000_000, 3 if q else 15, root),
                cold("pixels", 1_000 if q else 5_000, 3 if q else 15, root),
            ]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    finish(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
