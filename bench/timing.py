"""How bench/ times things and prints what it measured: the one place for both.

Every figure is a median over repeated blocks of calls. The variants of a comparison
take turns block by block (the order reversed every other round), so a change of the
machine's load hits each alike, and a ratio is always to a baseline timed in the same
run, computed from the numbers as printed. Every table is printed with the command that
made it, the date and the machine's load average.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "Timed",
    "Sample",
    "interleaved",
    "fill",
    "shown",
    "ratio",
    "table",
    "progress",
    "write_json",
]


@dataclass
class Timed:
    """One variant of a comparison: ``call`` timed in blocks of ``calls`` calls.

    ``before`` runs untimed ahead of each block (drop the page cache, reopen a store);
    ``after`` ends each block inside the clock (a commit, or a wait for background
    encoding, so that a block pays for its own work rather than leave it to the next
    variant). Figures are per unit: ``units`` per call (rows, steps, bytes).
    """

    call: Callable[[], Any]
    calls: int = 1
    units: float = 1.0
    before: Callable[[], Any] | None = None
    after: Callable[[], Any] | None = None


@dataclass
class Sample:
    """Per unit, for each timed block: wall seconds, this thread's CPU seconds, the other
    threads' CPU seconds (background encoders, decoder pools), and minor page faults."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    other_cpu: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def rate(self) -> float:
        """Units per second, from the median block."""
        return 1.0 / self.median

    def add(self, wall: float, cpu: float, other_cpu: float, faults: float) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)
        self.other_cpu.append(other_cpu)
        self.faults.append(faults)

    def quantile(self, q: float) -> float:
        s = sorted(self.wall)
        return s[min(len(s) - 1, round(q * (len(s) - 1)))]

    def spread(self, scale: float = 1.0) -> str:
        """``min–max`` of the blocks, scaled as the table's unit."""
        return f"{cell(min(self.wall) * scale)}–{cell(max(self.wall) * scale)}"


def _block(t: Timed, budget: float | None) -> tuple[float, float, float, float]:
    if t.before is not None:
        t.before()
    call, clock = t.call, time.perf_counter
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    cpu, process = time.thread_time(), time.process_time()
    start = clock()
    done = 0
    if budget is None:
        for _ in range(t.calls):
            call()
        done = t.calls
    else:  # a slow variant is measured on fewer calls, not for longer
        while done < t.calls:
            call()
            done += 1
            if not done & 15 and clock() - start > budget:
                break
    if t.after is not None:
        t.after()
    wall = clock() - start
    cpu, process = time.thread_time() - cpu, time.process_time() - process
    faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
    units = done * t.units
    return wall / units, cpu / units, (process - cpu) / units, faults / done


def interleaved(
    variants: Mapping[str, Timed | Callable[[], Any]],
    repeats: int = 7,
    calls: int = 1,
    warmup: int = 1,
    budget: float | None = None,
) -> dict[str, Sample]:
    """Time every variant in ``repeats`` blocks each, taking turns, after ``warmup``
    untimed blocks each (first touches, caches, lazy imports). A bare callable is
    ``Timed(fn, calls)``; ``budget`` (seconds) ends a block early."""
    timed = {k: v if isinstance(v, Timed) else Timed(v, calls) for k, v in variants.items()}
    for _ in range(warmup):
        for t in timed.values():
            _block(t, budget)
    samples = {k: Sample() for k in timed}
    order = list(timed.items())
    for r in range(repeats):
        for name, t in order if r % 2 == 0 else order[::-1]:
            samples[name].add(*_block(t, budget))
    return samples


def fill(adds: Mapping[str, Timed | Callable[[], Any]], steps: int, block: int = 50) -> dict[str, Sample]:
    """Add ``steps`` steps to every ring from empty, the systems taking turns block by
    block (a bare callable is ``Timed(add, block)``), and return the timings of this fill
    phase (page faults, files grown, segments opened). A collector feeding a learner
    runs at the steady state that follows: time the adds after this, on full rings."""
    timed = {k: v if isinstance(v, Timed) else Timed(v, block) for k, v in adds.items()}
    samples = interleaved(timed, repeats=steps // block, warmup=0)
    for t in timed.values():
        for _ in range(steps % block):
            t.call()
    return samples


# --- printing ---------------------------------------------------------------------------

PRINTED: list[dict[str, Any]] = []


def shown(value: float, digits: int = 3) -> float:
    """``value`` rounded to ``digits`` significant digits: the number a table prints, and
    the one its ratios are computed from (so that a reader can check them)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def cell(x: Any) -> str:
    if isinstance(x, float):
        v = shown(x)
        return f"{int(v):,}" if v.is_integer() else f"{v:,g}"
    if isinstance(x, int) and not isinstance(x, bool):
        return f"{x:,}"
    return "–" if x is None else str(x)


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` of the numbers as printed, to two significant digits, as ``0.52×``."""
    if a is None or b is None or not shown(b):
        return "–"
    r = shown(shown(a) / shown(b), 2)
    return f"{r:,.0f}×" if r >= 100 else f"{r:g}×"


def command() -> str:
    return shlex.join(["python", "-m", "bench", *sys.argv[1:]])


def conditions() -> str:
    """The command, the date and the machine's load, as printed with every table."""
    one, five, fifteen = os.getloadavg()
    return (
        f"`{command()}` · {datetime.now(UTC):%Y-%m-%d %H:%M} UTC · load average "
        f"{one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min) on {os.cpu_count()} CPUs"
    )


def table(title: str, head: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str] = ()) -> None:
    """Print a markdown table with its title, the command, the date and the load."""
    printed = [[cell(x) for x in row] for row in rows]
    lines = [f"### {title}", "", conditions(), "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in printed]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    sys.stdout.write("\n".join(lines) + "\n\n")
    sys.stdout.flush()
    PRINTED.append(
        {"title": title, "conditions": lines[2], "head": list(head), "rows": printed, "notes": list(notes)}
    )


def progress(message: str) -> None:
    """A line on stderr while a long benchmark runs (not part of the figures)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def write_json(path: str) -> None:
    """The tables printed so far, as printed."""
    with open(path, "w") as f:
        json.dump(PRINTED, f, indent=1)
