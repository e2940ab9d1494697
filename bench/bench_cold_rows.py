"""Random rows of several pages from an uncompressed store, with its pages out of memory and in.

The data: obs and next_obs uint8[84, 84, 4] (28,224 bytes a row, 7 pages), action and
reward, 8 envs, ``--steps`` steps, in an uncompressed zarr store, an uncompressed hdf5
store and ``.npy`` files of ``[steps * envs, ...]`` rows. Each store is opened once as a
reader and once as a writer (``populate=False``), the ``.npy`` files once with
``np.load(mmap_mode="r")``; every system gathers the same rows (``rng=i`` for batch
``i``, which draws ``integers(0, steps * envs, 256)``; numpy ``take(mode="wrap")`` of the
same draw), allocating its batch. The stores run in several page-cache modes, set with
``mmreplay.read.set_prefetch``:

- ``default``: what a store does when nobody sets anything;
- ``no prefetch``: ``set_prefetch(store, False)``: no ``MADV_WILLNEED`` (readers advise
  ``MADV_RANDOM`` and fault a row in page by page, writers keep the kernel's readahead);
- ``prefetch``: ``set_prefetch(store, True)``, ``MADV_WILLNEED`` before every batch;
- ``readahead``: readers only, ``set_prefetch(store, False, advise=False)``, the kernel's
  readahead as numpy's mapping gets it.

1. Cold: before every batch the pages of every system are dropped, from their mappings
   (``MADV_DONTNEED``) and from the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` on
   every file), none of it timed; the stores stay open, as a long-running process's do;
   systems and modes take turns batch by batch. Median rows/s over ``--cold-batches``
   batches.
2. Warm: every page cached and mapped; blocks of ``--warm-batches`` batches per system
   and mode, interleaved, median rows/s over ``--repeats`` blocks. Also on small rows
   (a float32[17] observation, 20,000 steps, blocks 20 times longer), where the per-batch
   decision's ``getrusage`` weighs most, and that decision alone (``timeit``, no gather).

Ratios are computed from the numbers shown. Usage:
``python -m bench.bench_cold_rows [--steps 2000] [--cold-batches 20] [--warm-batches 100]
[--repeats 7] [--skip-cold] [--skip-vector] [--dir D] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

import mmreplay as mr
from mmreplay import read

from .bench_sampling import conditions, data_files, drop_cache, finish

NUM_ENVS = 8
BATCH = 256
PIXELS = {
    "action": mr.ArraySpec((), "int64"),
    "next_obs": mr.ArraySpec((84, 84, 4), "uint8"),
    "obs": mr.ArraySpec((84, 84, 4), "uint8"),
    "reward": mr.ArraySpec((), "float32"),
}
VECTOR = {
    "action": mr.ArraySpec((6,), "float32"),
    "obs": mr.ArraySpec((17,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
}
VECTOR_BLOCK = 20  # small rows: blocks of this many times --warm-batches batches
MODES: dict[str, tuple[Any, Any]] = {  # set_prefetch(enabled, advise); None: left as opened
    "default": (None, None),
    "no prefetch": (False, None),
    "prefetch": (True, None),
    "readahead": (False, False),
}


def make_data(spec: dict, steps: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for key, leaf in spec.items():
        shape = (steps, NUM_ENVS, *leaf.shape)
        if np.dtype(leaf.dtype) == np.uint8:
            out[key] = rng.integers(0, 256, shape, np.uint8)
        else:
            out[key] = rng.standard_normal(shape).astype(leaf.dtype)
    return out


def write_systems(root: str, spec: dict, data: dict[str, np.ndarray]) -> dict[str, str]:
    steps = len(next(iter(data.values())))
    paths = {}
    for backend in ("zarr", "hdf5"):
        path = paths[backend] = os.path.join(root, backend)
        with mr.create(path, spec, steps, NUM_ENVS, backend=backend, commit_every=1 << 40) as store:
            for a in range(0, steps, 250):
                store.extend({k: v[a : a + 250] for k, v in data.items()})
    folder = paths["numpy"] = os.path.join(root, "npy")
    os.makedirs(folder)
    for key, value in data.items():
        np.save(os.path.join(folder, f"{key}.npy"), value.reshape(-1, *value.shape[2:]), allow_pickle=False)
    return paths


class System:
    """One opened system: a batch function of the batch's seed, its mappings and files."""

    def __init__(
        self,
        name: str,
        batch: Callable[[int], Any],
        maps: list[mmap.mmap],
        files: list[str],
        store: Any = None,
    ):
        self.name, self.batch, self.maps, self.files, self.store = name, batch, maps, files, store
        self.mode: str | None = None
        self.decisions: dict[str | None, Any] = {}  # each mode's per-batch decision state

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def evict(self) -> None:
        """Drop the system's pages from its mapping and from the page cache."""
        for mm in self.maps:
            mm.madvise(mmap.MADV_DONTNEED)
        drop_cache(self.files)


def open_systems(
    paths: dict[str, str], steps: int, readers_only: bool = False
) -> list[tuple[System, str | None]]:
    """(system, mode) pairs; a store is switched to its mode before each of its batches."""
    out: list[tuple[System, str | None]] = []
    for backend in ("zarr", "hdf5"):
        files = data_files(paths[backend])
        for mode in ("r",) if readers_only else ("r", "a"):
            store = mr.open(paths[backend], mode, populate=False)
            maps = list({id(leaf.mm): leaf.mm for leaf in store._leaves if leaf.mappable}.values())
            role = "reader" if mode == "r" else "writer"
            system = System(
                f"mmreplay {backend} {role}",
                lambda i, s=store: s.sample(BATCH, rng=i),
                maps,
                files,
                store,
            )
            for name in MODES:
                if name != "readahead" or mode == "r":
                    out.append((system, name))
    folder = paths["numpy"]
    names = sorted(os.listdir(folder))
    arrays = [np.load(os.path.join(folder, n), mmap_mode="r") for n in names]
    rows = steps * NUM_ENVS

    def numpy_batch(i: int) -> list[np.ndarray]:
        ids = np.random.default_rng(i).integers(0, rows, BATCH)
        return [a.take(ids, axis=0, mode="wrap") for a in arrays]

    system = System(
        'numpy np.load(mmap_mode="r")',
        numpy_batch,
        [a._mmap for a in arrays],
        [os.path.join(folder, n) for n in names],
    )
    out.append((system, None))
    return out


def set_mode(system: System, mode: str | None) -> None:
    """Switch a store to ``mode``, keeping the default mode's per-batch decision state
    across the switches (the batches of one mode then see what one store in that mode
    would have seen)."""
    if mode is None or mode == system.mode:
        return
    reader = read.gather.reader_for(system.store)
    system.decisions[system.mode] = reader.disk_reads
    enabled, advise = MODES[mode]
    read.set_prefetch(system.store, enabled, advise=advise)
    if mode in system.decisions:
        reader.disk_reads = system.decisions[mode]
    system.mode = mode


def label(system: System, mode: str | None) -> str:
    return system.name if mode is None else f"{system.name}, {mode}"


def prefetched(system: System) -> int:
    """Batches the store's per-batch decision has sent to the prefetch so far (0 when
    it has none: a mode other than the default)."""
    decide = read.gather.reader_for(system.store).disk_reads if system.store is not None else None
    return 0 if decide is None else decide.prefetched


def cold(pairs: list[tuple[System, str | None]], batches: int) -> Result:
    times: dict[str, list[float]] = {label(s, m): [] for s, m in pairs}
    sent = dict.fromkeys(times, 0)
    systems = list({id(s): s for s, _ in pairs}.values())
    for i in range(batches):
        for system, mode in pairs:
            set_mode(system, mode)
            for other in systems:  # a reader and a writer of one store map the same pages
                other.evict()
            before = prefetched(system)
            t = time.perf_counter()
            system.batch(i)
            times[label(system, mode)].append(time.perf_counter() - t)
            sent[label(system, mode)] += prefetched(system) - before
    return Result({k: BATCH / statistics.median(v) for k, v in times.items()}, sent, batches)


def warm(pairs: list[tuple[System, str | None]], batches: int, repeats: int) -> Result:
    for system, _ in pairs:  # every page cached and mapped
        for mm in system.maps:
            np.frombuffer(mm, np.uint8)[:: mmap.PAGESIZE].sum()
    times: dict[str, list[float]] = {label(s, m): [] for s, m in pairs}
    sent = dict.fromkeys(times, 0)
    for r in range(repeats + 1):
        for system, mode in pairs:
            set_mode(system, mode)
            system.batch(0)  # the first batch after the switch decides alone: not timed
            before = prefetched(system)
            t = time.perf_counter()
            for i in range(batches):
                system.batch(i)
            if r:  # the first round warms up
                times[label(system, mode)].append((time.perf_counter() - t) / batches)
                sent[label(system, mode)] += prefetched(system) - before
    return Result({k: BATCH / statistics.median(v) for k, v in times.items()}, sent, batches * repeats)


class Result(NamedTuple):
    rates: dict[str, float]  # rows/s
    sent: dict[str, int]  # timed batches the per-batch decision sent to the prefetch
    batches: int  # timed batches per system and mode


def decision_cost(pairs: list[tuple[System, str | None]]) -> float:
    """Microseconds per batch the per-batch decision costs on cached pages (the calls a
    batch makes besides its gather, timed alone: min of 5 runs of 100,000)."""
    system = pairs[0][0]
    set_mode(system, "default")
    reader = read.gather.reader_for(system.store)
    rows = np.arange(BATCH)
    runs = timeit.repeat(lambda: reader.willneed_if_cold(rows), number=100_000, repeat=5)
    if reader.disk_reads.prefetched > 1:
        print("(the decision prefetched while timed: the figure includes prefetches)")
    return min(runs) / 100_000 * 1e6


def table(title: str, result: Result, base: str) -> None:
    print(f"\n{title}\n\n| system | sample(256) rows/s | × numpy | batches prefetched by the default |")
    print("|---|---|---|---|")
    for k, v in result.rates.items():
        sent = f"{result.sent[k]} of {result.batches}" if k.endswith(", default") else ""
        print(f"| {k} | {v:,.0f} | {v / result.rates[base]:.2f}× | {sent} |")


def run(spec: dict, steps: int, root: str, parts: dict[str, Any], results: dict, key: str) -> None:
    data = make_data(spec, steps)
    paths = write_systems(root, spec, data)
    del data
    for folder in paths.values():  # dirty pages would stay in the page cache through POSIX_FADV_DONTNEED
        for d, _, names in os.walk(folder):
            for name in names:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
    pairs = open_systems(paths, steps, readers_only=key == "vector")
    base = pairs[-1][0].name
    first = pairs[0][0].batch(3)["obs"]
    second = pairs[-1][0].batch(3)[sorted(spec).index("obs")]
    if not np.array_equal(first, second):
        raise RuntimeError("the store and numpy gather different rows: the comparison would not be fair")
    try:
        for part, args in parts.items():
            t0 = time.time()
            result = cold(pairs, *args) if part == "cold" else warm(pairs, *args)
            results[f"{key} {part}"] = result._asdict()
            table(f"{key}, {part} ({os.getloadavg()[0]:.2f} load, {time.time() - t0:.0f} s)", result, base)
        if key == "vector":
            cost = results["decision us per batch"] = decision_cost(pairs)
            print(f"\nper-batch decision on cached pages, alone: {cost:.3f} us per batch")
    finally:
        for system in {id(s): s for s, _ in pairs}.values():
            system.close()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps of 8 envs (2000: 0.9 GB of pixels)")
    parser.add_argument("--cold-batches", type=int, default=20)
    parser.add_argument("--warm-batches", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-vector", action="store_true", help="no warm run on small rows")
    parser.add_argument("--skip-cold", action="store_true", help="only the page-cached runs")
    parser.add_argument("--dir", default=None, help="folder for the stores (default: a temp folder)")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"conditions": conditions(), "steps": args.steps}
    print(f"conditions: {results['conditions']}", flush=True)
    parts = {"cold": (args.cold_batches,), "warm": (args.warm_batches, args.repeats)}
    if args.skip_cold:
        del parts["cold"]
    run(PIXELS, args.steps, tempfile.mkdtemp(prefix="mmreplay-cold-", dir=args.dir), parts, results, "pixels")
    if not args.skip_vector:
        warm_only = {"warm": (VECTOR_BLOCK * args.warm_batches, args.repeats)}
        run(
            VECTOR,
            20_000,
            tempfile.mkdtemp(prefix="mmreplay-cold-", dir=args.dir),
            warm_only,
            results,
            "vector",
        )
    finish(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
