"""Random rows whose pages are out of memory: sample(256) cold, and the first batches after open.

The data and systems are those of ``sampling`` (``--workload``, default Atari-like
pixels: 7 pages a row), written to an uncompressed zarr store, an uncompressed hdf5 store
and ``.npy`` files of ``[steps * envs]`` rows; every dirty page is written back first, so
the page cache can drop it. Every system gathers the same rows (``rng=i`` for batch
``i``), allocating its batch.

1. ``evicted``: before every batch the pages of every system are dropped from its
   mapping (``MADV_DONTNEED``) and from the page cache (``posix_fadvise(DONTNEED)``),
   untimed; the stores stay open, as a long-running process's do; systems take turns
   batch by batch. The stores run in each page-cache mode of ``--modes``
   (``mmreplay.read.set_prefetch``: ``default`` sets nothing; ``no-prefetch`` no
   ``MADV_WILLNEED``; ``prefetch`` one before every batch; ``readahead``, readers only,
   the kernel's readahead as numpy's mapping gets it), beside numpy's
   ``np.load(mmap_mode="r")`` and ``os.pread`` of the same rows (one call per row and
   leaf: the disk's random reads at queue depth 1). The last column counts the timed
   batches the default's per-batch decision sent to the prefetch.
2. ``first-batches``: before each repeat every file is closed and its page cache kept
   (warm) or dropped (cold); the clock starts before the open (a reader, with and
   without ``populate``; ``np.load`` mapped or into RAM) and stops after ``--first`` N
   allocating batches, the last 4 kept alive.
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay import read

from .data import NUM_ENVS, steps
from .sampling import BATCH, MODES, spec_of
from .timing import Timed, interleaved, ratio, table

SMOKE = {"steps": 40, "cold_batches": 2, "first": [1, 2], "open_repeats": 1}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=("pixels", "vector"), default="pixels")
    p.add_argument("--steps", type=int, help="steps of 8 envs (default: 2000 pixels, 0.9 GB; 2000000 vector)")
    p.add_argument(
        "--parts", nargs="+", choices=("evicted", "first-batches"), default=["evicted", "first-batches"]
    )
    p.add_argument("--modes", nargs="+", choices=list(MODES)[:4], default=list(MODES)[:4])
    p.add_argument("--cold-batches", type=int, default=20, help="evicted batches per system and mode")
    p.add_argument("--first", type=int, nargs="+", default=[1, 10, 50], help="batches after open, timed")
    p.add_argument("--open-repeats", type=int, default=3)


def files_under(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def drop_cache(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # a dirty page cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(files: list[str]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


class Store:
    """A store open in one mode whose page-cache mode switches batch by batch; each
    mode keeps its own per-batch decision state across the switches."""

    def __init__(self, path: str, mode: str):
        self.store = mr.open(path, mode, populate=False)
        self.maps = [leaf.mm for leaf in self.store.leaves if leaf.mappable]
        self.mode: str | None = None
        self.decisions: dict[str | None, Any] = {}

    def switch(self, mode: str) -> None:
        if mode == self.mode:
            return
        reader = read.gather.reader_for(self.store)
        self.decisions[self.mode] = reader.disk_reads
        read.set_prefetch(self.store, *MODES[mode])
        if mode in self.decisions:
            reader.disk_reads = self.decisions[mode]
        self.mode = mode

    def prefetched(self, mode: str) -> int:
        """Batches the per-batch decision of ``mode`` has sent to the prefetch so far."""
        decide = read.gather.reader_for(self.store).disk_reads if mode == self.mode else self.decisions.get(mode)
        return 0 if decide is None else decide.prefetched


def evicted(paths: dict[str, str], rows: int, args: argparse.Namespace) -> None:
    opened = [
        (b, role, Store(paths[b], m))
        for b in ("zarr", "hdf5")
        for role, m in (("reader", "r"), ("writer", "a"))
    ]
    npy = [np.load(f, mmap_mode="r") for f in sorted(files_under(paths["npy"]))]
    maps = [m for _, _, s in opened for m in s.maps] + [a._mmap for a in npy]
    files = [f for p in paths.values() for f in files_under(p)]

    def evict() -> None:
        for m in maps:
            m.madvise(mmap.MADV_DONTNEED)
        drop_cache(files)

    def seeded(batch: Any) -> Any:
        seeds = itertools.count()
        return lambda: batch(next(seeds))

    variants: dict[str, Timed] = {}
    defaults: dict[str, Store] = {}
    for backend, role, s in opened:
        for mode in args.modes:
            if mode == "readahead" and role == "writer":
                continue
            name = f"mmreplay {backend} {role}, {mode}"
            if mode == "default":
                defaults[name] = s

            def before(s: Store = s, mode: str = mode) -> None:
                s.switch(mode)
                evict()

            variants[name] = Timed(seeded(lambda i, s=s: s.store.sample(BATCH, rng=i)), before=before)
    variants['numpy np.load(mmap_mode="r")'] = Timed(
        seeded(
            lambda i: [a.take(np.random.default_rng(i).integers(0, rows, BATCH), 0, mode="wrap") for a in npy]
        ),
        before=evict,
    )
    leaves = [
        (os.path.join(paths["zarr"], leaf.file), leaf.offset or 0, leaf.spec.nbytes)
        for leaf in opened[0][2].store.metadata.leaves
    ]
    fds = {f: os.open(f, os.O_RDONLY) for f, _, _ in leaves}

    def pread(i: int) -> None:
        ids = np.random.default_rng(i).integers(0, rows, BATCH).tolist()
        for f, offset, nbytes in leaves:
            for r in ids:
                os.pread(fds[f], nbytes, offset + r * nbytes)

    variants["os.pread, one call per row and leaf"] = Timed(seeded(pread), before=evict)
    got = interleaved(variants, args.cold_batches, warmup=0)
    base = BATCH * got['numpy np.load(mmap_mode="r")'].rate
    body = []
    for name, sample in got.items():
        prefetched = (
            f"{defaults[name].prefetched('default')} of {args.cold_batches}" if name in defaults else ""
        )
        body.append([name, BATCH * sample.rate, ratio(BATCH * sample.rate, base), prefetched])
    for fd in fds.values():
        os.close(fd)
    for _, _, s in opened:
        s.store.close()
    table(
        f"sample({BATCH}) with every page evicted before each batch, {rows:,} rows",
        ["system", "rows/s", "× numpy", "batches prefetched by the default"],
        body,
        [f"medians of {args.cold_batches} batches per system, taking turns"],
    )


def first_batches(paths: dict[str, str], args: argparse.Namespace) -> None:
    pool = [None] * 4
    openers = {}
    for backend in ("zarr", "hdf5"):
        for populate in (True, False):
            name = f"mmreplay {backend} reader, {'populate' if populate else 'no populate'}"
            openers[name] = (lambda p=paths[backend], pop=populate: mr.open(p, populate=pop), paths[backend])
    npy = sorted(files_under(paths["npy"]))
    openers['numpy np.load(mmap_mode="r")'] = (lambda: [np.load(f, mmap_mode="r") for f in npy], paths["npy"])
    openers["numpy np.load into RAM"] = (lambda: [np.load(f) for f in npy], paths["npy"])
    for cache in ("warm", "cold"):
        variants: dict[str, Timed] = {}
        held: list[Any] = []
        for name, (open_, folder) in openers.items():
            files = files_under(folder)
            for n in args.first:

                def run(open_: Any = open_, n: int = n, held: list[Any] = held) -> None:
                    system = open_()
                    held.append(system)
                    rows = None if isinstance(system, mr.Store) else len(system[0])
                    for i in range(n):
                        if rows is None:
                            pool[i % 4] = system.sample(BATCH, rng=i)
                        else:
                            ids = np.random.default_rng(i).integers(0, rows, BATCH)
                            pool[i % 4] = [a.take(ids, 0, mode="wrap") for a in system]

                def before(files: list[str] = files, held: list[Any] = held, cache: str = cache) -> None:
                    while held:
                        system = held.pop()
                        if isinstance(system, mr.Store):
                            system.close()
                    (warm_cache if cache == "warm" else drop_cache)(files)

                variants[f"{name}|{n}"] = Timed(run, before=before)
        got = interleaved(variants, args.open_repeats, warmup=0)
        for system in held:
            if isinstance(system, mr.Store):
                system.close()
        body = [[name] + [got[f"{name}|{n}"].median * 1e3 for n in args.first] for name in openers]
        table(
            f"the first batches after open, page cache {cache} (ms from the start of the open)",
            ["system"] + [f"{n} batch{'es' if n > 1 else ''}" for n in args.first],
            body,
            [f"medians of {args.open_repeats} repeats"],
        )


def write(paths: dict[str, str], spec: dict[str, Any], n: int) -> None:
    """The same ``n`` steps in each system, written in blocks (a large vector buffer need
    not fit in memory twice)."""
    stores = [
        mr.create(paths[b], spec, n, NUM_ENVS, backend=b, commit_every=1 << 40) for b in ("zarr", "hdf5")
    ]
    os.makedirs(paths["npy"])
    npy = {
        k: np.lib.format.open_memmap(
            os.path.join(paths["npy"], f"{k}.npy"), "w+", s.dtype, (n * NUM_ENVS, *s.shape)
        )
        for k, s in spec.items()
    }
    for a in range(0, n, 50_000):
        data = steps(spec, min(50_000, n - a), seed=a)
        for store in stores:
            store.extend(data)
        for k, v in data.items():
            npy[k][a * NUM_ENVS : (a + len(v)) * NUM_ENVS] = v.reshape(-1, *v.shape[2:])
    for store in stores:
        store.close()
    for a in npy.values():
        a.flush()


def run(args: argparse.Namespace) -> None:
    spec = spec_of(args.workload)
    n = args.steps or (2_000 if args.workload == "pixels" else 2_000_000)
    paths = {b: os.path.join(args.root, b) for b in ("zarr", "hdf5", "npy")}
    write(paths, spec, n)
    if "evicted" in args.parts:
        evicted(paths, n * NUM_ENVS, args)
    if "first-batches" in args.parts:
        first_batches(paths, args)
