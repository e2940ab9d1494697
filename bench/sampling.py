"""Page-cached sample(256) of uncompressed stores against numpy's gather of the same rows.

The data (``--workload``): Atari-like ``pixels`` (obs and next_obs uint8[84, 84, 4]
stacks, action, reward, terminated, truncated) or the ``vector`` step (obs float32[17]
and the same small leaves), 8 envs, in an uncompressed zarr store, an uncompressed hdf5
store and numpy arrays. Every page of every store is read once through the store (a full
``iterate`` pass), so its pages are cached and mapped as numpy's are.

Every system gathers the same rows: the stores draw from a generator seeded alike, and
numpy draws the same ids and gathers them with ``take(mode="wrap")`` over the
``[steps * envs]`` rows of each leaf, its fastest gather and the store's (no modulo pass
on either side). The ways to get a batch are the same for every system (``--ways``):
``out``, into a caller's batch (a pool of 4 made once); ``dropped``, allocating, each
batch released before the next; ``kept``, allocating, each batch held until 4 more were
made (a loader's queue); ``seq``, ``sample(32, num_steps=64)``, allocating, dropped.

Systems: the writer (mode "a") and the reader (mode "r", which also re-reads the
committed state after each batch and advises ``MADV_RANDOM``) of each store, in each
page-cache mode of ``--modes`` (``mmreplay.read.set_prefetch``); numpy from RAM, and
with ``--numpy`` also from RAM in 4 KiB pages (no transparent huge pages) and from
``.npy`` files mapped with ``np.load(mmap_mode="r")``: a store's gather from its mapped
file can at best match the last. Each row gives the minor page faults per batch and the
share of its resident bytes mapped by huge pages (``/proc/self/smaps``).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import mmap
import os
import re
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay import read

from .data import NUM_ENVS, pixel_spec, steps, vector_spec
from .timing import Timed, cell, interleaved, ratio, table

SMOKE = {"steps": 100, "calls": 2, "repeats": 1, "seq": [4, 16]}
BATCH = 256
POOL = 4
#: page-cache modes: name -> set_prefetch(enabled, advise); "default" sets nothing
MODES: dict[str, tuple[Any, Any]] = {
    "default": (None, None),
    "no-prefetch": (False, None),
    "prefetch": (True, None),
    "readahead": (False, False),
    "advise": (False, True),
}
WAYS = ("out", "dropped", "kept", "seq")


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=("pixels", "vector"), default="pixels")
    p.add_argument(
        "--steps", type=int, help="steps of 8 envs (default: 5000 pixels, 2.26 GB of frames; 200000 vector)"
    )
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["default"])
    p.add_argument("--numpy", nargs="+", choices=("ram", "4k-pages", "npy-mapped"), default=["ram"])
    p.add_argument(
        "--seq", nargs=2, type=int, default=[32, 64], metavar=("BATCH", "STEPS"),
        help="the sequence way: sample(BATCH, num_steps=STEPS)",
    )  # fmt: skip
    p.add_argument("--calls", type=int, default=40, help="batches per timed block")
    p.add_argument("--repeats", type=int, default=7, help="timed blocks per system and way")
    p.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall", help="or the calling thread's CPU time"
    )


def spec_of(workload: str) -> dict[str, mr.ArraySpec]:
    return pixel_spec() if workload == "pixels" else vector_spec()


def write_store(path: str, spec: dict[str, Any], data: dict[str, np.ndarray], **layout: Any) -> None:
    n = len(data["obs"])
    with mr.create(path, spec, n, NUM_ENVS, commit_every=1 << 40, **layout) as store:
        for a in range(0, n, 250):
            store.extend({k: v[a : a + 250] for k, v in data.items()})


def set_mode(store: Any, mode: str) -> None:
    read.set_prefetch(store, *MODES[mode])


def numpy_sources(root: str, data: dict[str, np.ndarray], kinds: list[str]) -> dict[str, list[np.ndarray]]:
    """Each leaf's ``[steps * envs]`` rows in the store's (sorted) leaf order, per source."""
    rows = [data[k].reshape(-1, *data[k].shape[2:]) for k in sorted(data)]
    out = {"numpy in RAM": rows} if "ram" in kinds else {}
    if "4k-pages" in kinds:
        copies = []
        for a in rows:
            buf = mmap.mmap(-1, a.nbytes)
            buf.madvise(mmap.MADV_NOHUGEPAGE)
            copy = np.frombuffer(buf, a.dtype).reshape(a.shape)
            copy[:] = a
            copies.append(copy)
        out["numpy in RAM, 4 KiB pages"] = copies
    if "npy-mapped" in kinds:
        mapped = []
        for i, a in enumerate(rows):
            np.save(os.path.join(root, f"{i}.npy"), a, allow_pickle=False)
            mapped.append(np.load(os.path.join(root, f"{i}.npy"), mmap_mode="r"))
            mapped[-1].sum(dtype=np.uint64)  # every page cached and mapped
        out['numpy np.load(mmap_mode="r")'] = mapped
    return out


def numpy_gathers(
    rows: list[np.ndarray], keys: list[str], seq: tuple[int, int]
) -> dict[str, Callable[[np.random.Generator, Any], Any]]:
    """numpy's gathers of rows drawn as the store draws them, one per way."""
    n = len(rows[0])

    def out(g: np.random.Generator, batch: dict[str, np.ndarray]) -> Any:
        ids = g.integers(0, n, BATCH)
        for a, k in zip(rows, keys):
            a.take(ids, 0, out=batch[k], mode="wrap")
        return batch

    def alloc(g: np.random.Generator) -> Any:
        ids = g.integers(0, n, BATCH)
        return [a.take(ids, 0, mode="wrap") for a in rows]

    def windows(g: np.random.Generator) -> Any:
        size, length = seq
        ids = g.integers(0, n - (length - 1) * NUM_ENVS, size)[:, None] + np.arange(length) * NUM_ENVS
        return [a.take(ids, 0, mode="wrap") for a in rows]

    return {"out": out, "alloc": alloc, "seq": windows}


def store_gathers(store: mr.Store, seq: tuple[int, int]) -> dict[str, Callable[..., Any]]:
    return {
        "out": lambda g, batch: store.sample(BATCH, rng=g, out=batch),
        "alloc": lambda g: store.sample(BATCH, rng=g),
        "seq": lambda g: store.sample(seq[0], num_steps=seq[1], rng=g),
    }


def timed_ways(
    gathers: dict[str, Callable[..., Any]],
    spec: dict[str, Any],
    ways: list[str],
    calls: int,
    seq_rows: int,
    before: Any,
) -> dict[str, Timed]:
    """One :class:`Timed` per way; each block draws from a generator seeded by its turn."""
    seeds = itertools.count()
    pool = [{k: np.empty((BATCH, *s.shape), s.dtype) for k, s in spec.items()} for _ in range(POOL)]
    gen = [np.random.default_rng(0)]

    def reseed() -> None:
        gen[0] = np.random.default_rng(next(seeds))
        before()

    turn = itertools.cycle(pool)
    kept: collections.deque = collections.deque(maxlen=POOL)
    calls_of = {
        "out": lambda: gathers["out"](gen[0], next(turn)),
        "dropped": lambda: gathers["alloc"](gen[0]),
        "kept": lambda: kept.append(gathers["alloc"](gen[0])),
        "seq": lambda: gathers["seq"](gen[0]),
    }
    return {
        w: Timed(calls_of[w], calls, BATCH, before=reseed)
        if w != "seq"
        else Timed(calls_of[w], max(1, calls // 4), seq_rows, before=reseed)
        for w in ways
    }


def smaps() -> list[tuple[int, int, str, int, int]]:
    """(start, end, path, resident kB, huge-page kB) of every mapping of this process."""
    with open("/proc/self/smaps") as f:
        blocks = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read())
    out = []
    for block in blocks:
        head = block.split("\n", 1)[0].split()
        low, high = (int(x, 16) for x in head[0].split("-"))
        kb = dict(re.findall(r"^(\w+):\s+(\d+) kB", block, re.M))
        huge = int(kb.get("AnonHugePages", 0)) + int(kb.get("FilePmdMapped", 0))
        out.append((low, high, head[-1] if len(head) >= 6 else "", int(kb.get("Rss", 0)), huge))
    return out


def huge_share(arrays: list[np.ndarray] = (), folder: str | None = None) -> str:
    """Share of the resident bytes of ``arrays`` (or of the files under ``folder``) that
    huge pages map."""
    spans = [(a.__array_interface__["data"][0], a.nbytes) for a in arrays]
    rss = huge = 0
    for low, high, path, r, h in smaps():
        if (folder and path.startswith(folder)) or any(high > s and low < s + n for s, n in spans):
            rss, huge = rss + r, huge + h
    return f"{huge / rss:.0%}" if rss else "–"


def run(args: argparse.Namespace) -> None:
    spec = spec_of(args.workload)
    n = args.steps or (5_000 if args.workload == "pixels" else 200_000)
    data = steps(spec, n)
    keys, seq_rows = sorted(spec), args.seq[0] * args.seq[1]
    variants: dict[str, dict[str, Timed]] = {}
    shares: dict[str, str] = {}
    for name, rows in numpy_sources(args.root, data, args.numpy).items():
        variants[name] = timed_ways(
            numpy_gathers(rows, keys, args.seq), spec, args.ways, args.calls, seq_rows, lambda: None
        )
        shares[name] = huge_share(rows)
    stores = []
    for backend in ("zarr", "hdf5"):
        path = os.path.join(args.root, backend)
        write_store(path, spec, data, backend=backend)
        for role, mode in (("writer", "a"), ("reader", "r")):
            store = mr.open(path, mode, populate=False)
            stores.append(store)
            for _ in store.iterate(batch_size=4096):  # every page read once through the mapping
                pass
            for m in args.modes:  # one store takes turns in each mode; a single mode is left as opened
                switch = (lambda s=store, m=m: set_mode(s, m)) if len(args.modes) > 1 else (lambda: None)
                name = f"mmreplay {backend} {role}" + ("" if m == "default" else f", {m}")
                variants[name] = timed_ways(
                    store_gathers(store, args.seq), spec, args.ways, args.calls, seq_rows, switch
                )
                shares[name] = huge_share(folder=path)
    del data
    flat = {f"{name}|{way}": t for name, ways in variants.items() for way, t in ways.items()}
    got = interleaved(flat, args.repeats)
    base_name = next(iter(variants))
    head = (
        ["system"]
        + [f"{w} (k rows/s, × {base_name})" for w in args.ways]
        + ["faults per batch", "huge pages"]
    )
    body = []
    for name in variants:
        rates = {w: 1e-3 / statistics.median(getattr(got[f"{name}|{w}"], args.clock)) for w in args.ways}
        base = {w: 1e-3 / statistics.median(getattr(got[f"{base_name}|{w}"], args.clock)) for w in args.ways}
        row: list[Any] = [name] + [f"{cell(rates[w])} ({ratio(rates[w], base[w])})" for w in args.ways]
        first = got[f"{name}|{args.ways[0]}"]
        body.append(row + [statistics.median(first.faults), shares[name]])
    for store in stores:
        store.close()
    table(
        f"sample({BATCH}) page-cached, {args.workload}, {n:,} steps x {NUM_ENVS} envs ({args.clock} clock)",
        head,
        body,
        [
            f"medians of {args.repeats} interleaved blocks of {args.calls} batches ({max(1, args.calls // 4)} for seq)",
            "faults: minor page faults per call of the first way",
        ],
    )
