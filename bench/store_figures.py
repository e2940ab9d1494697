"""The store's own costs: per-step add against numpy, commit, and open by size.

- ``add``: one step of 8 envs for the 5-leaf vector spec, against the same five numpy
  assignments into in-RAM arrays with the same ring logic, in the same run. Both rings
  are written once before timing, so neither pays first-touch page faults.
- ``commit``: one step added, then ``commit()`` timed alone, ``durability="process"``.
- ``state check``: a reader's look at the committed state (``live_state()``), which it
  makes after every batch it reads from a ring a writer is overwriting.
- ``open``: ``mmreplay.open`` (then ``close``) of a filled buffer of 10^5 and 10^7 rows.

Run: ``python -m bench.store_figures [--json out.json] [--small]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
from typing import Any

import numpy as np

import mmreplay as mr

from .systems import du
from .timing import per_call_ns, repeat_seconds, summary
from .workloads import Workload, vector_spec

BACKENDS = ("zarr", "hdf5")


class NumpyRing:
    """The baseline: one in-RAM array per leaf, a step written at ``slot = step % capacity``."""

    def __init__(self, spec: dict[str, mr.ArraySpec], capacity: int, num_envs: int):
        self.capacity = capacity
        self.arrays = [
            (k, np.zeros((capacity, num_envs, *s.shape), s.dtype)) for k, s in sorted(spec.items())
        ]
        self.count = 0

    def add(self, step: dict[str, np.ndarray]) -> None:
        slot = self.count % self.capacity
        for key, array in self.arrays:
            array[slot] = step[key]
        self.count += 1


def _step_pool(workload: Workload, n: int) -> list[dict[str, np.ndarray]]:
    data = workload.steps(n, seed=1)
    return [{k: np.ascontiguousarray(v[t]) for k, v in data.items()} for t in range(n)]


def _add_loop(add: Any, pool: list[dict[str, np.ndarray]], steps: int) -> Any:
    def run() -> None:
        n = len(pool)
        for t in range(steps):
            add(pool[t % n])

    return run


def measure_add(root: str, repeats: int, steps: int, capacity: int) -> dict[str, Any]:
    """Seconds per ``add`` of mmreplay (each backend) and of the numpy ring, interleaved."""
    spec = vector_spec(next_obs=False)
    workload = Workload("vector5", spec, 8)
    pool = _step_pool(workload, 256)
    ring = NumpyRing(spec, capacity, 8)
    stores = {b: mr.create(os.path.join(root, f"add-{b}"), spec, capacity, 8, backend=b) for b in BACKENDS}
    # the add alone: commits (measured below) only when the reservation runs out
    stores.update(
        {
            f"{b} no auto-commit": mr.create(
                os.path.join(root, f"add-{b}-nc"), spec, capacity, 8, backend=b, commit_every=10**9
            )
            for b in BACKENDS
        }
    )
    runs = {"numpy": _add_loop(ring.add, pool, steps)}
    runs.update({b: _add_loop(s.add, pool, steps) for b, s in stores.items()})
    for name in runs:  # a full pass over each ring: pages touched, files extended
        _add_loop(ring.add if name == "numpy" else stores[name].add, pool, capacity)()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved, so a noisy neighbour hits every system alike
        for name, run in runs.items():
            times[name].extend(t / steps for t in repeat_seconds(run, 1))
    for s in stores.values():
        s.close()
    out: dict[str, Any] = {"steps_per_repeat": steps, "repeats": repeats, "capacity": capacity}
    base = summary(times["numpy"])["median"]
    for name, ts in times.items():
        out[name] = {
            "us_per_add": summary([t * 1e6 for t in ts]),
            "ratio_to_numpy": summary(ts)["median"] / base,
        }
    return out


def measure_commit(root: str, commits: int) -> dict[str, Any]:
    """Nanoseconds of ``commit()`` after one added step, small buffer, durability="process"."""
    spec = vector_spec(next_obs=False)
    pool = _step_pool(Workload("vector5", spec, 8), 16)
    out: dict[str, Any] = {"commits": commits, "capacity": 1000, "durability": "process"}
    for backend in BACKENDS:
        with mr.create(os.path.join(root, f"commit-{backend}"), spec, 1000, 8, backend=backend) as store:
            counter = itertools.count()

            def add_one(store: mr.Store = store, counter: Any = counter) -> None:
                store.add(pool[next(counter) % len(pool)])

            ns = per_call_ns(store.commit, commits, before=add_one)
        out[backend] = {"us": summary([x / 1e3 for x in ns])}
    return out


def measure_state_check(root: str, calls: int) -> dict[str, Any]:
    """Nanoseconds of a reader's ``live_state()`` while a writer holds the buffer."""
    spec = vector_spec(next_obs=False)
    pool = _step_pool(Workload("vector5", spec, 8), 4)
    out: dict[str, Any] = {"calls": calls}
    for backend in BACKENDS:
        with mr.create(os.path.join(root, f"state-{backend}"), spec, 1000, 8, backend=backend) as writer:
            writer.add(pool[0])
            writer.commit()
            with mr.open(writer.path) as reader:
                ns = per_call_ns(reader.live_state, calls)
        out[backend] = {"us": summary([x / 1e3 for x in ns])}
    return out


def _filled(root: str, backend: str, rows: int) -> str:
    """A buffer of ``rows`` rows (8 envs), every step written."""
    spec = vector_spec(next_obs=False)
    steps = rows // 8
    path = os.path.join(root, f"open-{backend}-{rows}")
    block = Workload("vector5", spec, 8).steps(min(steps, 50_000), seed=2)
    with mr.create(path, spec, steps, 8, backend=backend, commit_every=10**9) as store:
        done = 0
        while done < steps:
            n = min(steps - done, len(block["obs"]))
            store.extend({k: v[:n] for k, v in block.items()})
            done += n
    return path


def measure_open(root: str, sizes: list[int], repeats: int) -> dict[str, Any]:
    """Seconds of ``open`` + ``close`` per size, readers (mode "r") and writers (mode "a")."""
    out: dict[str, Any] = {"repeats": repeats, "sizes_rows": sizes}
    for backend in BACKENDS:
        for rows in sizes:
            path = _filled(root, backend, rows)
            entry = {}
            for mode in ("r", "a"):

                def once(mode: str = mode, path: str = path) -> None:
                    mr.open(path, mode).close()

                once()
                entry[mode] = {"ms": summary([t * 1e3 for t in repeat_seconds(once, repeats)])}
            entry["bytes_on_disk"] = du(path)
            out[f"{backend}/{rows}"] = entry
            shutil.rmtree(path)
    return out


def run(root: str, small: bool = False) -> dict[str, Any]:
    if small:
        return {
            "add": measure_add(root, repeats=2, steps=200, capacity=500),
            "commit": measure_commit(root, commits=50),
            "state_check": measure_state_check(root, calls=50),
            "open": measure_open(root, [10**3, 10**4], repeats=3),
        }
    return {
        "add": measure_add(root, repeats=15, steps=20_000, capacity=100_000),
        "commit": measure_commit(root, commits=5000),
        "state_check": measure_state_check(root, calls=5000),
        "open": measure_open(root, [10**5, 10**7], repeats=50),
    }


def markdown(fig: dict[str, Any]) -> str:
    add, com, opn = fig["add"], fig["commit"], fig["open"]
    lines = [
        "| figure | zarr | hdf5 | numpy in RAM |",
        "|---|---|---|---|",
        "| `add` of one step, 8 envs, 5 leaves, commit every 1000 steps (µs, median) | "
        + " | ".join(
            f"{add[b]['us_per_add']['median']:.2f} ({add[b]['ratio_to_numpy']:.2f}x numpy's time)"
            for b in BACKENDS
        )
        + f" | {add['numpy']['us_per_add']['median']:.2f} |",
        "| `add` alone, no auto-commit (µs, median) | "
        + " | ".join(
            f"{add[k]['us_per_add']['median']:.2f} ({add[k]['ratio_to_numpy']:.2f}x numpy's time)"
            for k in (f"{b} no auto-commit" for b in BACKENDS)
        )
        + f" | {add['numpy']['us_per_add']['median']:.2f} |",
        '| `commit()` of a small buffer, durability="process" (µs, median / p99) | '
        + " | ".join(f"{com[b]['us']['median']:.0f} / {com[b]['us']['p99']:.0f}" for b in BACKENDS)
        + " | |",
    ]
    if "state_check" in fig:
        lines.append(
            "| reader's state check per batch, `live_state()` (µs, median / p99) | "
            + " | ".join(
                f"{fig['state_check'][b]['us']['median']:.1f} / {fig['state_check'][b]['us']['p99']:.1f}"
                for b in BACKENDS
            )
            + " | |"
        )
    for rows in opn["sizes_rows"]:
        lines.append(
            f"| `open()` + `close()` at {rows:.0e} rows (ms, median; reader / writer) | "
            + " | ".join(
                f"{opn[f'{b}/{rows}']['r']['ms']['median']:.2f} / {opn[f'{b}/{rows}']['a']['ms']['median']:.2f}"
                for b in BACKENDS
            )
            + " | |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="folder for the buffers (default: a temporary folder)")
    parser.add_argument("--json", help="write the raw figures here")
    parser.add_argument("--small", action="store_true", help="tiny sizes (checks the script works)")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="mmreplay-bench-", dir=args.dir)
    try:
        fig = run(root, args.small)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=1)
    sys.stdout.write(markdown(fig) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
