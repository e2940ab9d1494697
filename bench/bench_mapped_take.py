"""The same gather from a mapped file and from RAM: what a memory-mapped store starts from.

``np.take(out=, mode="wrap")`` of 256 random rows of 28,224 bytes (an 84×84×4 stack) out of
40,000, into a pool of 4 batches, from an ``np.memmap`` of a file whose pages are all in
the page cache and mapped, from a numpy array in RAM, and from the same bytes in anonymous
memory advised ``MADV_NOHUGEPAGE``; blocks alternate, medians of 7. The stores'
``sample(256, out=)`` is this gather from their mapped files, so its ratio to numpy's
``take(out=)`` from RAM cannot exceed the one printed here.

numpy advises transparent huge pages on its large allocations, so its gather walks 2 MiB
pages when the kernel finds free 2 MiB blocks; a mapped file gets them only where the page
cache holds 2 MiB folios (ext4 and xfs on recent kernels). Each row prints the share of
its bytes mapped by huge pages (``/proc/self/smaps``), and the 4 KiB row shows what the
page size alone is worth.

    python -m bench.bench_mapped_take
"""

from __future__ import annotations

import mmap
import os
import re
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


def huge_share(source: np.ndarray) -> float:
    """Share of ``source``'s bytes in mappings by huge pages (anonymous or file-backed)."""
    start = source.__array_interface__["data"][0]
    huge = 0
    with open("/proc/self/smaps") as f:
        blocks = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read())
    for block in blocks:
        low, high = (int(x, 16) for x in block.split(" ", 1)[0].split("-"))
        if high > start and low < start + source.nbytes:
            kb = dict(re.findall(r"^(\w+):\s+(\d+) kB", block, re.M))
            huge += (int(kb.get("AnonHugePages", 0)) + int(kb.get("FilePmdMapped", 0))) << 10
    return min(1.0, huge / source.nbytes)


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
        small = mmap.mmap(-1, data.nbytes)
        small.madvise(mmap.MADV_NOHUGEPAGE)
        small_pages = np.frombuffer(small, np.uint8).reshape(ROWS, ROW_BYTES)
        small_pages[:] = data
        sources = {"from RAM (numpy array)": data, "from RAM, 4 KiB pages": small_pages,
                   "from a mapped file": mapped}
        times: dict[str, list[float]] = {name: [] for name in sources}
        for _ in range(7):
            for name, source in sources.items():
                times[name].append(rate(source, ids, outs))
        ram = statistics.median(times["from RAM (numpy array)"])
        print(f"np.take(out=) of {BATCH} rows of {ROW_BYTES} bytes out of {ROWS:,}; load average "
              f"{os.getloadavg()[0]:.2f}")
        for name, rates in times.items():
            median = statistics.median(rates)
            print(f"{name:<24}{median:>10,.0f} rows/s  {median / ram:.2f}×  "
                  f"huge pages {huge_share(sources[name]):.0%}")
        del mapped, small_pages, sources
        small.close()
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
