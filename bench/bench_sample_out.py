"""Uncompressed ``sample(256, out=batch)`` against numpy ``take(out=)`` on Atari-like frames.

The data: obs and next_obs uint8[84, 84, 4] frame stacks (:mod:`bench.atari_like`),
action, reward, terminated and truncated, 8 envs, 5,000 steps (2.26 GB of frames), in
an uncompressed zarr store, an uncompressed hdf5 store, and numpy arrays in RAM.

1. Page-cached. Every system gathers the same rows: the store draws
   ``rng.integers(0, steps * envs, 256)`` from a generator seeded alike for each system,
   and the numpy baseline draws the same and gathers with ``take(mode="wrap")`` over the
   ``[steps * envs, ...]`` rows of each leaf, which is numpy's fastest gather and the one
   the store does (no modulo pass on either side). Three ways to get a batch, each the
   same for every system:

   - into a caller's batch: ``sample(256, out=b)`` / ``take(out=b)``, ``b`` cycling
     through a pool of 4 batches made once;
   - allocating, batches dropped: each batch is released before the next is drawn;
   - allocating, batches kept alive: each batch is held until 4 more were drawn (a
     loader's queue), so freed memory is not reused at once.

   Every store is opened with ``populate=True`` and waits for it, so that its pages are
   mapped as the numpy arrays' are. Systems run in interleaved blocks; each cell is the
   median over the same number of blocks for every system (``--clock cpu`` times the
   calling thread's CPU time instead of the wall clock, which a loaded machine disturbs
   less).
2. First batches after open. Before each repeat every file is closed and its page cache
   either dropped (``posix_fadvise(DONTNEED)``: cold) or kept (warm); then the clock
   starts, the store is opened as a reader (with and without ``populate``, whose thread
   races the first batches) or the ``.npy`` files are mapped with ``np.load(mmap_mode="r")``
   (or loaded into RAM), and 50 batches of 256 are gathered into a pool of batches (10
   when the page cache was dropped: each cold batch reads its rows from the disk, and
   ``--cold-batches 50`` runs the whole count). Cells: median ms until the first, the
   tenth and the fiftieth batch are done, over the same number of repeats and batches
   for every system.

Ratios in the printed tables are computed from the numbers shown in their cells.
Usage: ``python -m bench.bench_sample_out [--steps 5000] [--clock wall|cpu] [--quick] [--dir D]
[--json OUT] [--skip-cached] [--skip-cold] [--cold-batches 50]``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mmreplay as mr

from . import atari_like, bench_sampling
from .bench_sampling import conditions, data_files, drop_cache, finish, timed_blocks, warm

NUM_ENVS = 8
BATCH = 256
POOL = 4
FIRST_BATCHES = (1, 10, 50)  # the batch counts after open whose time is reported
COLD_BATCHES = 10  # batches gathered after open when the page cache was dropped (default)

SPEC = {
    "action": mr.ArraySpec((), "int64"),
    "next_obs": mr.ArraySpec((84, 84, 4), "uint8"),
    "obs": mr.ArraySpec((84, 84, 4), "uint8"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}
KEYS = sorted(SPEC)


def make_data(steps: int) -> dict[str, np.ndarray]:
    """Leaf -> ``[steps, envs, *shape]``: each env its own screens, next_obs the next stack."""
    rng = np.random.default_rng(0)
    obs = np.empty((steps, NUM_ENVS, 84, 84, 4), np.uint8)
    next_obs = np.empty_like(obs)
    for env in range(NUM_ENVS):
        stacks = atari_like.stacked(atari_like.frames(steps + 1, seed=env))
        obs[:, env] = stacks[:steps]
        next_obs[:, env] = stacks[1:]
    shape = (steps, NUM_ENVS)
    return {
        "action": rng.integers(0, 18, shape),
        "next_obs": next_obs,
        "obs": obs,
        "reward": rng.standard_normal(shape, dtype=np.float32),
        "terminated": rng.random(shape) < 0.01,
        "truncated": rng.random(shape) < 0.001,
    }


def write_store(path: str, data: dict[str, np.ndarray], backend: str) -> None:
    steps = len(data["obs"])
    with mr.create(path, SPEC, steps, NUM_ENVS, backend=backend, commit_every=1 << 40) as store:
        for a in range(0, steps, 250):
            store.extend({k: v[a : a + 250] for k, v in data.items()})


def write_npy(folder: str, data: dict[str, np.ndarray]) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    files = []
    for key, value in data.items():
        files.append(os.path.join(folder, f"{key}.npy"))
        np.save(files[-1], value, allow_pickle=False)
    return files


def flat_rows(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each leaf as ``[steps * envs, *shape]`` rows, in the store's (sorted) leaf order."""
    return [arrays[k].reshape(-1, *arrays[k].shape[2:]) for k in KEYS]


def numpy_gathers(flat: list[np.ndarray], rows: int) -> tuple[Callable, Callable]:
    """numpy's fastest gathers of ``BATCH`` rows drawn as the store draws them: into a
    batch, and allocating."""

    def into(g: np.random.Generator, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        k = g.integers(0, rows, BATCH)
        for a, key in zip(flat, KEYS):
            a.take(k, 0, out=out[key], mode="wrap")
        return out

    def allocating(g: np.random.Generator) -> dict[str, np.ndarray]:
        k = g.integers(0, rows, BATCH)
        return dict(zip(KEYS, (a.take(k, 0, mode="wrap") for a in flat)))

    return into, allocating


def empty_batch() -> dict[str, np.ndarray]:
    return {k: np.empty((BATCH, *SPEC[k].shape), SPEC[k].dtype) for k in KEYS}


# --- 1. page-cached --------------------------------------------------------------------


def cached(stores: dict[str, Any], flat: list[np.ndarray], rows: int, calls: int, repeats: int) -> dict:
    into, allocating = numpy_gathers(flat, rows)
    systems: dict[str, tuple[Callable, Callable]] = {"numpy take": (into, allocating)}
    for name, store in stores.items():
        systems[name] = (
            lambda g, out, s=store: s.sample(BATCH, rng=g, out=out),
            lambda g, s=store: s.sample(BATCH, rng=g),
        )
    fns: dict[str, Callable] = {}
    for name, (into_fn, alloc_fn) in systems.items():
        pool = [empty_batch() for _ in range(POOL)]
        turn = iter(range(1 << 62))
        kept: collections.deque = collections.deque(maxlen=POOL)
        fns[f"{name}|into a batch (pool of {POOL})"] = lambda g, f=into_fn, p=pool, t=turn: f(g, p[next(t) % POOL])
        fns[f"{name}|allocating, dropped"] = lambda g, f=alloc_fn: f(g) and None
        fns[f"{name}|allocating, kept alive ({POOL})"] = lambda g, f=alloc_fn, k=kept: k.append(f(g))
    return timed_blocks(fns, calls, repeats)


# --- 2. first batches after open --------------------------------------------------------


class NpyMapped:
    """The ``.npy`` files mapped with ``np.load(mmap_mode="r")`` (or loaded into RAM)."""

    def __init__(self, folder: str, in_ram: bool):
        self.arrays = {k: np.load(os.path.join(folder, f"{k}.npy"), mmap_mode=None if in_ram else "r") for k in KEYS}
        self.into, _ = numpy_gathers(flat_rows(self.arrays), len(self.arrays["obs"]) * NUM_ENVS)

    def sample(self, g: np.random.Generator, out: dict[str, np.ndarray]) -> Any:
        return self.into(g, out)

    def close(self) -> None:
        self.arrays = {}
        self.into = None


class StoreReader:
    def __init__(self, path: str, populate: bool):
        self.store = mr.open(path, populate=populate)

    def sample(self, g: np.random.Generator, out: dict[str, np.ndarray]) -> Any:
        return self.store.sample(BATCH, rng=g, out=out)

    def close(self) -> None:
        self.store.close()


def batch_counts(batches: int) -> tuple[int, ...]:
    """The counts of :data:`FIRST_BATCHES` up to ``batches``, and ``batches`` itself."""
    return tuple(sorted({n for n in FIRST_BATCHES if n <= batches} | {batches}))


def first_batches(
    openers: dict[str, tuple[Callable[[], Any], list[str]]], repeats: int, cold: bool, batches: int
) -> dict:
    """ms from the start of open until each count of :func:`batch_counts` is gathered
    (``batches`` in all, the same for every system)."""
    counts = batch_counts(batches)
    pool = [empty_batch() for _ in range(POOL)]
    out: dict[str, dict[str, list[float]]] = {name: {str(n): [] for n in counts} for name in openers}
    for r in range(repeats):
        for name, (open_fn, files) in openers.items():
            if cold:
                drop_cache(files)
            else:
                warm(files)
            g = np.random.default_rng(r)
            t0 = time.perf_counter()
            system = open_fn()
            for i in range(1, batches + 1):
                system.sample(g, pool[i % POOL])
                if i in counts:
                    out[name][str(i)].append((time.perf_counter() - t0) * 1e3)
            system.close()
    return {name: {"ms": v, "median_ms": {n: statistics.median(x) for n, x in v.items()}} for name, v in out.items()}


# --- report ---------------------------------------------------------------------------


def _shown(x: float) -> float:
    """``x`` rounded to the three significant digits the tables show."""
    return float(f"{x:.3g}")


def _cell(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def cached_table(res: dict, stores: list[str]) -> list[str]:
    ways = list(dict.fromkeys(k.split("|", 1)[1] for k in res))
    head = ["batch", "numpy take (k rows/s)"] + [f"{s} (k rows/s, × numpy)" for s in stores]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for way in ways:
        base = _shown(BATCH / res[f"numpy take|{way}"] / 1e3)
        cells = [way, _cell(base)]
        for s in stores:
            v = _shown(BATCH / res[f"{s}|{way}"] / 1e3)
            cells.append(f"{_cell(v)} ({v / base:.2f}×)")
        lines.append("| " + " | ".join(cells) + " |")
    into = ways[0]
    lines.append("")
    for s in stores:
        for way in ways[1:]:
            a = _shown(BATCH / res[f"{s}|{into}"] / 1e3)
            b = _shown(BATCH / res[f"numpy take|{way}"] / 1e3)
            lines.append(f"- {s} into a batch / numpy take {way}: {a / b:.2f}×")
    return lines


def first_table(res: dict, title: str) -> list[str]:
    counts = [int(n) for n in next(iter(res.values()))["median_ms"]]
    head = [title] + [f"{n} batch{'es' if n > 1 else ''} (ms)" for n in counts]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in res.items():
        lines.append("| " + " | ".join([name] + [_cell(_shown(v["median_ms"][str(n)])) for n in counts]) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5_000, help="steps of 8 envs (default 5000: 2.26 GB of frames)")
    parser.add_argument("--quick", action="store_true", help="200 steps and few repeats (a smoke run)")
    parser.add_argument("--calls", type=int, default=40, help="batches per timed block")
    parser.add_argument("--repeats", type=int, default=7, help="timed blocks per system (page-cached)")
    parser.add_argument("--open-repeats", type=int, default=3, help="repeats per system (first batches)")
    parser.add_argument("--skip-cached", action="store_true", help="only the first batches after open")
    parser.add_argument("--skip-cold", action="store_true", help="no first batches with the page cache dropped")
    parser.add_argument(
        "--cold-batches",
        type=int,
        default=COLD_BATCHES,
        help=f"batches after open with the page cache dropped (default {COLD_BATCHES}; 50 is the warm count)",
    )
    parser.add_argument("--dir", default=None, help="folder for the stores (default: a temp folder)")
    parser.add_argument("--json", default=None, help="write every raw figure to this file")
    bench_sampling.add_clock_option(parser)
    args = parser.parse_args(argv)
    if args.cold_batches < 1:
        parser.error(f"--cold-batches must be at least 1, got {args.cold_batches}")
    bench_sampling.set_clock(args.clock)
    steps = 200 if args.quick else args.steps
    calls, repeats, open_repeats = (4, 2, 2) if args.quick else (args.calls, args.repeats, args.open_repeats)
    root = tempfile.mkdtemp(prefix="mmreplay-bench-out-", dir=args.dir)
    results: dict[str, Any] = {
        "conditions_before": conditions(),
        "steps": steps,
        "num_envs": NUM_ENVS,
        "clock": args.clock,
    }
    print(f"conditions: {results['conditions_before']}", flush=True)
    try:
        data = make_data(steps)
        rows = steps * NUM_ENVS
        paths = {f"mmreplay {b}": os.path.join(root, b) for b in ("zarr", "hdf5")}
        for name, path in paths.items():
            write_store(path, data, name.split()[1])
        npy = os.path.join(root, "npy")
        npy_files = write_npy(npy, data)
        flat = flat_rows(data)

        if not args.skip_cached:
            stores = {}
            for name, path in paths.items():  # populated, as the numpy arrays are: every page mapped
                for mode in ("a", "r"):
                    store = stores[f"{name} {'writer' if mode == 'a' else 'reader'}"] = mr.open(path, mode, populate=True)
                    store._populator.wait()
            try:
                res = cached(stores, flat, rows, calls, repeats)
            finally:
                for store in stores.values():
                    store.close()
            results["cached"] = res
            print(f"\n## sample({BATCH}) page-cached, {steps} steps x {NUM_ENVS} envs\n")
            print("\n".join(cached_table(res, list(stores))), flush=True)
        del data, flat

        openers: dict[str, tuple[Callable[[], Any], list[str]]] = {}
        for name, path in paths.items():
            files = data_files(path)
            openers[f"{name} reader, populate"] = (lambda p=path: StoreReader(p, True), files)
            openers[f"{name} reader, no populate"] = (lambda p=path: StoreReader(p, False), files)
        openers['numpy np.load(mmap_mode="r")'] = (lambda: NpyMapped(npy, in_ram=False), npy_files)
        openers["numpy np.load into RAM"] = (lambda: NpyMapped(npy, in_ram=True), npy_files)
        for cold in (False,) if args.skip_cold else (False, True):
            key = "cold" if cold else "warm"
            batches = args.cold_batches if cold else max(FIRST_BATCHES)
            res = first_batches(openers, open_repeats, cold, batches)
            results[f"first_batches_{key}"] = res
            what = "page cache dropped" if cold else "page cache warm"
            print(f"\n## first batches after open ({what}; from the start of open)\n")
            print("\n".join(first_table(res, "system")), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    finish(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
