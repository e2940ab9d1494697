"""Small timing helpers: every figure is a median over repeats measured in one run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["repeat_seconds", "per_call_ns", "summary"]


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
