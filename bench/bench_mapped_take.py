"""The same gather from a mapped file and from RAM: what a memory-mapped store starts from.

``np.take(out=, mode="wrap")`` of 256 random rows of 28,224 bytes (an 84×84×4 stack) out of
40,000, into a pool of 4 batches, from an ``np.memmap`` of a file whose pages are all in
the page cache and mapped, and from a copy of the same array in RAM; blocks alternate,
medians of 7. The stores' ``sample(256, out=)`` is this gather from their mapped files,
so its ratio to numpy's ``take(out=)`` from RAM cannot exceed the one printed here.

    python -m bench.bench_mapped_take
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

ROWS, ROW_BYTES, BATCH, BATCHES = 40_000, 28_224, 256, 40


def rate(source: np.ndarray, ids: np.ndarray, outs: list[np.ndarray]) -> float:
    t = time.perf_counter()
    for i, rows in enumerate(ids):
        np.take(source, rows, axis=0, out=outs[i % len(outs)], mode="wrap")
    return len(ids) * BATCH / (time.perf_counter() - t)


def main() -> None:
    data = np.random.default_rng(0).integers(0, 255, (ROWS, ROW_BYTES), dtype=np.uint8)
    ids = np.random.default_rng(1).integers(0, ROWS, (BATCHES, BATCH))
    outs = [np.empty((BATCH, ROW_BYTES), np.uint8) for _ in range(4)]
    fd, path = tempfile.mkstemp(suffix=".bin")
    os.close(fd)
    try:
        data.tofile(path)
        mapped = np.memmap(path, np.uint8, "r", shape=(ROWS, ROW_BYTES))
        mapped.sum(dtype=np.uint64)  # every page in the page cache and mapped
        times: dict[str, list[float]] = {"RAM": [], "mapped file": []}
        for _ in range(7):
            times["RAM"].append(rate(data, ids, outs))
            times["mapped file"].append(rate(mapped, ids, outs))
        ram, mapped_rate = statistics.median(times["RAM"]), statistics.median(times["mapped file"])
        print(f"np.take(out=) of {BATCH} rows of {ROW_BYTES} bytes out of {ROWS:,}; load average "
              f"{os.getloadavg()[0]:.2f}")
        print(f"from RAM          {ram:>12,.0f} rows/s  1.00×")
        print(f"from a mapped file {mapped_rate:>11,.0f} rows/s  {mapped_rate / ram:.2f}×")
        del mapped
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
