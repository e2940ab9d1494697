"""mmreplay beside the replay buffers people would use instead, on every workload.

Every installed system (peers come from ``pip install -e '.[bench]'``; one that is not
installed is named as skipped) stores the same data on this machine in this run: the
vector, pixel (Atari-like frame stacks) and nested workloads, 8 envs (bench/data.py,
bench/systems.py). Figures, medians of interleaved blocks:

- per-step ``add``, bulk ``extend``, ``sample(256)`` and ``sample(32, num_steps=64)``
  rates, on full rings (each ring is written once first), each system's blocks taking
  turns with a numpy-in-RAM baseline of its own, whose median the cell shows ("numpy's N
  beside it"); every sampled batch is made contiguous and dropped at once, alike;
- checkpoint (commit) of the full buffer after 100 added steps, bytes on disk, reopen;
- reopen by size (vector buffers of 10^5 to 10^7 rows).

An mmreplay cell gives how many times better it is than numpy and than the best peer of
the row (above 1×: better), computed from the numbers shown.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .data import WORKLOADS, Workload, contiguous
from .systems import SYSTEMS, NumpyRAM, System, Unsupported, available, version
from .timing import Timed, cell, interleaved, progress, ratio, table

SMOKE = {"size": "smoke"}
BATCH, SEQ_BATCH = 256, 32


@dataclass(frozen=True)
class Sizes:
    """Capacities and counts in steps (``num_envs`` rows each), per workload."""

    capacity: dict[str, int]
    extend_block: dict[str, int]  # steps per extend call
    calls: int  # most calls per timed block of a rate (fewer once ``budget_s`` is spent)
    num_steps: int
    repeats: int  # timed blocks of each rate, and repeats of checkpoint and reopen
    budget_s: float
    reopen_rows: tuple[int, ...]


SIZES = {
    "full": Sizes(
        capacity={"vector": 100_000, "pixels": 2_000, "nested": 20_000},
        extend_block={"vector": 1_000, "pixels": 32, "nested": 250},
        calls=1000,
        num_steps=64,
        repeats=5,
        budget_s=0.08,
        reopen_rows=(10**5, 10**6, 10**7),
    ),
    "smoke": Sizes(
        capacity={"vector": 400, "pixels": 40, "nested": 200},
        extend_block={"vector": 50, "pixels": 8, "nested": 25},
        calls=4,
        num_steps=16,
        repeats=1,
        budget_s=0.02,
        reopen_rows=(1600,),
    ),
}

#: key -> (label, unit shown, higher is better, scale from the measured unit)
FIGURES = {
    "add": ("per-step `add`, 8 envs", "k rows/s", True, 1e-3),
    "extend": ("bulk `extend`", "k rows/s", True, 1e-3),
    "checkpoint": ("commit / checkpoint, full buffer", "ms", False, 1e3),
    "sample": (f"`sample({BATCH})`", "k rows/s", True, 1e-3),
    "sample_seq": (f"`sample({SEQ_BATCH}, num_steps=N)`", "k rows/s", True, 1e-3),
    "disk_bytes": ("bytes on disk", "MB", False, 1e-6),
    "reopen": ("reopen / load", "ms", False, 1e3),
}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--only", action="append", help="only systems whose name contains this (repeatable)")
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--skip-reopen-sizes", action="store_true", help="no reopen-by-size table")


@dataclass
class Figure:
    value: float | None = None  # in the unit measured: rows/s, seconds, bytes
    base: float | None = None  # the numpy baseline measured beside it
    na: str | None = None


def _rates(system: System, base: System | None, make: Callable[[System], Timed], s: Sizes) -> Figure:
    """A rate in blocks taking turns with the numpy baseline's, so both see the same load."""
    try:
        pair = {"s": make(system)} | ({"b": make(base)} if base is not None else {})
    except Unsupported as exc:
        return Figure(na=str(exc))
    got = interleaved(pair, s.repeats, budget=s.budget_s)
    return Figure(got["s"].rate, got["b"].rate if base is not None else None)


def measure(
    root: str, cls: type[System], workload: Workload, data: dict[str, np.ndarray], s: Sizes
) -> dict[str, Figure]:
    name, cap, block = workload.name, s.capacity[workload.name], s.extend_block[workload.name]
    e, rng = workload.num_envs, np.random.default_rng(7)
    system = cls(_folder(root, f"{name}-{cls.name}"), workload, cap)
    base = None if cls is NumpyRAM else NumpyRAM(_folder(root, f"{name}-numpy"), workload, cap)
    out: dict[str, Figure] = {}
    try:
        for x in filter(None, (system, base)):  # every page touched, every file grown: steady state
            for a in range(0, cap, block):
                x.extend(x.native_block(data, a, min(cap, a + block)))
            x.checkpoint()

        def adds(x: System) -> Timed:
            pool = itertools.cycle([x.native_step(data, t) for t in range(min(cap, 64))])
            return Timed(lambda: x.add(next(pool)), s.calls, e)

        def extends(x: System) -> Timed:
            blocks = itertools.cycle(
                [x.native_block(data, a, a + block) for a in range(0, min(cap, 2 * block) - block + 1, block)]
            )
            return Timed(lambda: x.extend(next(blocks)), max(1, s.calls // 10), block * e)

        def samples(x: System) -> Timed:
            return Timed(lambda: contiguous(x.sample(BATCH, rng)), max(1, s.calls // 4), BATCH)

        def sequences(x: System) -> Timed:
            x.sample_sequences(1, s.num_steps, rng)  # Unsupported here, not inside the timing
            return Timed(
                lambda: contiguous(x.sample_sequences(SEQ_BATCH, s.num_steps, rng)),
                max(1, s.calls // 10),
                SEQ_BATCH * s.num_steps,
            )

        for key, make in (("add", adds), ("extend", extends), ("sample", samples), ("sample_seq", sequences)):
            out[key] = _rates(system, base, make, s)
        if base is not None:
            _discard(base)
            base = None
        pool = itertools.cycle([system.native_step(data, t) for t in range(min(cap, 64))])

        def some_adds() -> None:
            for _ in range(min(100, cap)):
                system.add(next(pool))

        out["checkpoint"] = Figure(
            interleaved({"c": Timed(system.checkpoint, before=some_adds)}, s.repeats, warmup=0)["c"].median
        )
        system.checkpoint()
        out["disk_bytes"] = Figure(system.disk_bytes())
        out["reopen"] = Figure(
            interleaved({"r": Timed(system.reopen, before=system.drop)}, s.repeats, warmup=0)["r"].median
        )
        if system.rows() != cap * e:
            raise RuntimeError(f"{cls.name} holds {system.rows()} rows after a reopen, not {cap * e}")
    finally:
        for x in filter(None, (system, base)):
            _discard(x)
    return out


def _discard(system: System) -> None:
    system.close()
    shutil.rmtree(system.folder, ignore_errors=True)


def _folder(root: str, name: str) -> str:
    path = os.path.join(root, name.replace(" ", "_").replace("/", "_").replace("+", "_"))
    os.makedirs(path)
    return path


def _advantage(mine: float, other: float | None, higher_better: bool) -> str:
    """How many times better ``mine`` is than ``other``, from the numbers shown."""
    return ratio(mine, other) if higher_better else ratio(other, mine)


def workload_table(title: str, per: dict[str, dict[str, Figure]], notes: list[str]) -> None:
    names = list(per)
    peers = [n for n in names if not n.startswith("mmreplay") and n != NumpyRAM.name]
    body = []
    for key, (label, unit, hb, scale) in FIGURES.items():
        if not any(key in figs for figs in per.values()):
            continue
        values = {
            n: per[n][key].value * scale for n in names if key in per[n] and per[n][key].value is not None
        }
        ranked = sorted((v, n) for n, v in values.items() if n in peers)
        best = (ranked[-1] if hb else ranked[0])[0] if ranked else None
        row: list[Any] = [f"{label} ({unit}, {'higher' if hb else 'lower'} is better)"]
        for n in names:
            fig = per[n].get(key)
            if fig is None or fig.value is None:
                row.append("n/a" if fig is not None and fig.na else "–")
                continue
            v, text = values[n], cell(values[n])
            if n.startswith("mmreplay"):
                base = fig.base * scale if fig.base is not None else values.get(NumpyRAM.name)
                parts = [
                    f"{_advantage(v, base, hb)} numpy" + (f"'s {cell(base)} beside it" if fig.base else "")
                ]
                if best is not None:
                    parts.append(f"{_advantage(v, best, hb)} best peer")
                text += f" ({'; '.join(parts)})"
            row.append(text)
        body.append(row)
    table(title, ["figure"] + names, body, notes)


def reopen_by_size(root: str, systems: list[type[System]], s: Sizes) -> None:
    """Checkpoint then reopen of vector buffers of each size; a system whose checkpoint and
    reopen already took more than 5 s skips the larger sizes."""
    workload = WORKLOADS["vector"]
    block = workload.steps(min(20_000, max(s.reopen_rows) // workload.num_envs), seed=3)
    per: dict[str, dict[str, Figure]] = {}
    for cls in systems:
        per[cls.name], skip = {}, None
        for rows in s.reopen_rows:
            if skip:
                per[cls.name][str(rows)] = Figure(na=skip)
                continue
            steps = rows // workload.num_envs
            system = cls(_folder(root, f"reopen-{cls.name}-{rows}"), workload, steps)
            try:
                n = len(block["obs"])
                for a in range(0, steps, n):
                    system.extend(system.native_block(block, 0, min(n, steps - a)))
                ckpt = interleaved({"c": system.checkpoint}, 1, warmup=0)["c"].median
                got = interleaved({"r": Timed(system.reopen, before=system.drop)}, s.repeats, warmup=0)[
                    "r"
                ].median
                per[cls.name][str(rows)] = Figure(got)
                if ckpt + got > 5.0:
                    skip = f"skipped: checkpoint + reopen at {rows:.0e} rows took {ckpt + got:.0f} s"
            finally:
                _discard(system)
    body = [
        [f"{rows:.0e} rows"]
        + [per[n][str(rows)].value * 1e3 if per[n][str(rows)].value else "n/a" for n in per]
        for rows in s.reopen_rows
    ]
    notes = sorted({f"{n}: {f.na}" for n in per for f in per[n].values() if f.na})
    table("reopen by size (vector, ms, lower is better)", ["size"] + list(per), body, notes)


def machine() -> list[list[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    packages = sorted({"mmreplay", "numpy", "zarr", "h5py"} | {p for cls in SYSTEMS for p in cls.packages})
    return [
        ["CPU", f"{cpu} ({os.cpu_count()} cores)"],
        ["Python", platform.python_version()],
        ["versions", ", ".join(f"{p} {version(p)}" for p in packages if version(p))],
    ]


def run(args: argparse.Namespace) -> None:
    s = SIZES[args.size]
    chosen, skipped = [], []
    for cls in SYSTEMS:
        if args.only and cls is not NumpyRAM and not any(o.lower() in cls.name.lower() for o in args.only):
            continue
        missing = available(cls)
        if missing:
            skipped.append(
                f"{cls.name} skipped: not installed: {', '.join(missing)} (pip install -e '.[bench]')"
            )
        else:
            chosen.append(cls)
    table("machine", ["", ""], machine(), skipped)
    for wname in args.workloads:
        workload = WORKLOADS[wname]
        data = workload.steps(s.capacity[wname], seed=0)
        per = {}
        for cls in chosen:
            progress(f"{wname}: {cls.name}")
            per[cls.name] = measure(args.root, cls, workload, data, s)
        notes = [f"{cls.name}: {k} n/a ({f.na})" for cls in chosen for k, f in per[cls.name].items() if f.na]
        notes += [f"{cls.name}: extend: {cls.notes['extend']}" for cls in chosen if "extend" in cls.notes]
        notes.append(f"N = {s.num_steps}; medians of {s.repeats} blocks")
        workload_table(f"{wname} ({s.capacity[wname]:,} steps x {workload.num_envs} envs)", per, notes)
    if not args.skip_reopen_sizes:
        progress("reopen by size")
        reopen_by_size(args.root, chosen, s)
