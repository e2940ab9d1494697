"""Small timing helpers: every figure is a median over repeats measured in one run."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["repeat_seconds", "per_call_ns", "summary", "shown", "ratio", "markdown_table"]


def repeat_seconds(
    fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None
) -> list[float]:
    """Wall seconds of ``fn()`` per repeat (``setup()`` runs before each, untimed)."""
    out = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def per_call_ns(fn: Callable[[], Any], calls: int, before: Callable[[], Any] | None = None) -> list[int]:
    """Nanoseconds of each of ``calls`` calls to ``fn`` (``before()`` runs untimed first)."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        if before is not None:
            before()
        t = clock()
        fn()
        out.append(clock() - t)
    return out


def summary(values: list[float]) -> dict[str, float]:
    """Median, p99, min and count of a sample."""
    s = sorted(values)
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    return {"median": statistics.median(s), "p99": p99, "min": s[0], "n": len(s)}


def shown(value: float, digits: int = 3) -> float:
    """``value`` rounded to ``digits`` significant digits: the number a table prints, and
    the one its ratios are computed from (so a reader can check them)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def ratio(a: float, b: float) -> str:
    """``a / b`` of the numbers as shown, to three significant digits."""
    a, b = shown(a), shown(b)
    if not b:
        return "-"
    r = shown(a / b)
    return f"{int(r):,}" if r.is_integer() and abs(r) >= 1000 else f"{r:g}"


def markdown_table(head: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats are printed as :func:`shown` rounds them."""

    def cell(x: Any) -> str:
        if not isinstance(x, float):
            return str(x)
        v = shown(x)
        return f"{int(v):,}" if v.is_integer() else f"{v:,g}"

    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
