"""The store's own costs: per-step add, sample(256), commit, a reader's state check, open.

On the 5-leaf vector step (obs float32[17], action float32[6], reward, terminated,
truncated; 8 envs), page-cached, against a numpy ring in RAM timed in the same run:

- ``add`` of one step into full rings (every ring is written once first, so nobody pays
  first-touch faults), with the default commit every 1000 steps and with no auto-commit;
- ``sample(256)`` of a writer against numpy's ``take(mode="wrap")`` of rows drawn alike;
- ``commit()`` right after one added step (``durability="process"``), each timed alone;
- a reader's ``live_state()``, the state check it makes after each batch;
- ``open()`` + ``close()`` of a filled buffer by size, as a reader and as a writer.

Meant also for before/after comparisons of two checkouts: run it with each, interleaved.
"""

from __future__ import annotations

import argparse
import itertools
import os
from typing import Any

import numpy as np

import mmreplay as mr

from .data import NUM_ENVS, vector_spec
from .data import steps as make_steps
from .timing import Timed, fill, interleaved, ratio, table

SMOKE = {"capacity": 500, "block": 100, "repeats": 2, "calls": 1000, "open_rows": [1000], "open_repeats": 2}
BACKENDS = ("zarr", "hdf5")
BATCH = 256


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--capacity", type=int, default=100_000, help="steps in each ring")
    p.add_argument("--block", type=int, default=1000, help="adds (and 1/10 as many batches) per timed block")
    p.add_argument("--repeats", type=int, default=15, help="timed blocks per system")
    p.add_argument("--calls", type=int, default=5000, help="commits and state checks timed, one at a time")
    p.add_argument("--open-rows", type=int, nargs="+", default=[10**5, 10**7], help="buffer sizes for open")
    p.add_argument("--open-repeats", type=int, default=50)


def pool_of(n: int) -> list[dict[str, np.ndarray]]:
    data = make_steps(vector_spec(), n, seed=1)
    return [{k: np.ascontiguousarray(v[t]) for k, v in data.items()} for t in range(n)]


def cycling(add: Any, pool: list) -> Any:
    steps = itertools.cycle(pool)
    return lambda: add(next(steps))


def add_and_sample(root: str, args: argparse.Namespace) -> None:
    spec, cap, pool = vector_spec(), args.capacity, pool_of(64)
    ring = {k: np.zeros((cap, NUM_ENVS, *s.shape), s.dtype) for k, s in spec.items()}
    steps, slots = itertools.cycle(pool), itertools.cycle(range(cap))

    def numpy_add() -> None:
        step, slot = next(steps), next(slots)
        for k, a in ring.items():
            a[slot] = step[k]

    stores = {b: mr.create(os.path.join(root, b), spec, cap, NUM_ENVS, backend=b) for b in BACKENDS}
    stores |= {
        f"{b}, no auto-commit": mr.create(
            os.path.join(root, f"{b}-nc"), spec, cap, NUM_ENVS, backend=b, commit_every=10**9
        )
        for b in BACKENDS
    }
    adds = {"numpy": numpy_add} | {name: cycling(s.add, pool) for name, s in stores.items()}
    fill(adds, cap)
    for s in stores.values():
        s.commit()
    added = interleaved({k: Timed(f, args.block) for k, f in adds.items()}, args.repeats)
    rows = {k: a.reshape(cap * NUM_ENVS, *a.shape[2:]) for k, a in ring.items()}
    rng = np.random.default_rng(0)

    def numpy_take() -> None:
        ids = rng.integers(0, cap * NUM_ENVS, BATCH)
        for a in rows.values():
            a.take(ids, axis=0, mode="wrap")

    draws = {"numpy": numpy_take} | {b: (lambda s=stores[b]: s.sample(BATCH, rng=rng)) for b in BACKENDS}
    sampled = interleaved({k: Timed(f, max(1, args.block // 10)) for k, f in draws.items()}, args.repeats)
    for s in stores.values():
        s.close()
    add0, take0 = added["numpy"].median * 1e6, sampled["numpy"].median * 1e6
    body = []
    for name, sample in added.items():
        row = [name, sample.median * 1e6, sample.spread(1e6), ratio(sample.median * 1e6, add0)]
        got = sampled.get(name)
        body.append(
            row + ([got.median * 1e6, got.spread(1e6), ratio(got.median * 1e6, take0)] if got else ["–"] * 3)
        )
    table(
        f"per-step add and sample({BATCH}), {cap:,} steps x {NUM_ENVS} envs, 5 leaves, rings full",
        [
            "system",
            "add µs/step",
            "min–max",
            "× numpy's time",
            f"sample({BATCH}) µs",
            "min–max",
            "× numpy take's time",
        ],
        body,
        [
            f"medians of {args.repeats} interleaved blocks of {args.block} adds / {max(1, args.block // 10)} batches"
        ],
    )


def commit_and_state_check(root: str, calls: int) -> None:
    spec, pool = vector_spec(), pool_of(16)
    body = []
    for backend in BACKENDS:
        with mr.create(
            os.path.join(root, f"commit-{backend}"), spec, 1000, NUM_ENVS, backend=backend
        ) as store:
            commit = interleaved({"c": Timed(store.commit, before=cycling(store.add, pool))}, calls)["c"]
            with mr.open(store.path) as reader:
                check = interleaved({"s": reader.live_state}, calls)["s"]
        body.append(
            [
                backend,
                commit.median * 1e6,
                commit.quantile(0.99) * 1e6,
                check.median * 1e6,
                check.quantile(0.99) * 1e6,
            ]
        )
    table(
        f'commit() after one added step (durability="process") and a reader\'s live_state(), {calls:,} calls each',
        ["backend", "commit µs (median)", "commit µs (p99)", "live_state µs (median)", "live_state µs (p99)"],
        body,
    )


def open_by_size(root: str, sizes: list[int], repeats: int) -> None:
    spec = vector_spec()
    body = []
    for rows in sizes:
        cells: list[Any] = [f"{rows:.0e} rows"]
        for backend in BACKENDS:
            path, steps = os.path.join(root, f"open-{backend}-{rows}"), rows // NUM_ENVS
            block = make_steps(spec, min(steps, 50_000), seed=2)
            with mr.create(path, spec, steps, NUM_ENVS, backend=backend, commit_every=10**9) as store:
                for done in range(0, steps, len(block["obs"])):
                    store.extend({k: v[: min(len(v), steps - done)] for k, v in block.items()})
            opened = interleaved({m: (lambda m=m, p=path: mr.open(p, m).close()) for m in "ra"}, repeats)
            cells += [opened["r"].median * 1e3, opened["a"].median * 1e3]
        body.append(cells)
    table(
        "open() + close() of a filled buffer (ms, median)",
        ["size"] + [f"{b} {role}" for b in BACKENDS for role in ("reader", "writer")],
        body,
    )


def run(args: argparse.Namespace) -> None:
    add_and_sample(args.root, args)
    commit_and_state_check(args.root, args.calls)
    open_by_size(args.root, args.open_rows, args.open_repeats)
