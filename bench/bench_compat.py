"""What the compatibility layers cost over the store and over an in-RAM buffer.

Measured, as medians over interleaved blocks (so noise from other processes hits every
variant alike), on the vector workload (observation float32[17], action float32[6],
reward float32):

- TF-Agents ``UniformReplayBuffer.add_batch`` (batch_size 4) committing every add
  (the layer's default) and every 1000 adds, next to ``store.add`` of the same step and
  a numpy ring in RAM (``arr[i % L] = x`` per leaf);
- ``UniformReplayBuffer.get_next(sample_batch_size=256)`` next to numpy fancy indexing
  of the same arrays in RAM;
- skrl ``RandomMemory.add_samples`` (64 envs, committing every step and every 1000) and
  ``sample(names, 256)``, next to the same in a torch ring in RAM (``copy_`` into a
  preallocated tensor; indexing of random flat rows).

Usage: ``python bench/bench_compat.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

import mmreplay as mr
from mmreplay.compat.tf_agents import UniformReplayBuffer

SPEC = {
    "observation": mr.ArraySpec((17,), "float32"),
    "action": mr.ArraySpec((6,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
}


def per_call(fn: Callable[[], None], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def interleaved(variants: dict[str, Callable[[], None]], calls: int, blocks: int) -> dict[str, float]:
    """Median seconds per call of each variant, blocks interleaved (in reverse order every
    other round, so no variant always runs first or after the same neighbour)."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants.items())
    for block in range(blocks):
        for name, fn in order if block % 2 == 0 else order[::-1]:
            times[name].append(per_call(fn, calls))
    return {k: statistics.median(v) for k, v in times.items()}


def tf_agents(folder: str, calls: int, blocks: int) -> None:
    B, L = 4, 20_000
    rng = np.random.default_rng(0)
    items = {k: rng.standard_normal((B, *s.shape)).astype(s.dtype) for k, s in SPEC.items()}
    rb1 = UniformReplayBuffer(SPEC, B, L, path=f"{folder}/rb1", commit_every=1)
    rb1000 = UniformReplayBuffer(SPEC, B, L, path=f"{folder}/rb1000", commit_every=1000)
    store = mr.create(f"{folder}/store", SPEC, L, B)
    ram = {k: np.zeros((L, B, *s.shape), s.dtype) for k, s in SPEC.items()}
    cursor = [0]

    def numpy_add() -> None:
        i = cursor[0] % L
        for k, a in ram.items():
            a[i] = items[k]
        cursor[0] += 1

    adds = interleaved(
        {
            "add_batch, commit every add": lambda: rb1.add_batch(items),
            "add_batch, commit every 1000": lambda: rb1000.add_batch(items),
            "store.add, commit every 1000": lambda: store.add(items),
            "numpy ring in RAM": numpy_add,
        },
        calls,
        blocks,
    )
    report("TF-Agents add_batch (batch_size 4)", adds, "numpy ring in RAM", "us/call", 1e6)
    for _ in range(L):
        rb1000.add_batch(items)
    full = {k: np.ascontiguousarray(np.swapaxes(v, 0, 1)) for k, v in ram.items()}

    def numpy_sample() -> None:
        t = rng.integers(0, L, 256)
        b = rng.integers(0, B, 256)
        for a in full.values():
            a[b, t]

    samples = interleaved(
        {
            "get_next(256)": lambda: rb1000.get_next(sample_batch_size=256),
            "numpy fancy indexing": numpy_sample,
        },
        max(1, calls // 20),
        blocks,
    )
    report("TF-Agents get_next(sample_batch_size=256)", samples, "numpy fancy indexing", "us/call", 1e6)
    for x in (rb1, rb1000):
        x.close()
    store.close()


def skrl(folder: str, calls: int, blocks: int) -> None:
    import torch

    from mmreplay.compat.skrl import RandomMemory

    torch.set_num_threads(1)  # both variants alike, and no thread contention on a shared box
    M, E = 2_000, 64
    mem = RandomMemory(M, E, device="cpu", path=f"{folder}/skrl")
    mem1 = RandomMemory(M, E, device="cpu", path=f"{folder}/skrl1", commit_every=1)
    for m in (mem, mem1):
        for name, s in SPEC.items():
            m.create_tensor(name, s.shape[0] if s.shape else 1)
    data = {k: torch.randn(E, s.shape[0] if s.shape else 1) for k, s in SPEC.items()}
    ram = {k: torch.zeros(M, E, v.shape[1]) for k, v in data.items()}
    views = {k: v.view(-1, v.shape[-1]) for k, v in ram.items()}
    cursor = [0]

    def torch_add() -> None:
        i = cursor[0] % M
        for k, t in ram.items():
            t[i].copy_(data[k])
        cursor[0] += 1

    adds = interleaved(
        {
            "add_samples, commit every step": lambda: mem1.add_samples(**data),
            "add_samples, commit every 1000": lambda: mem.add_samples(**data),
            "torch ring in RAM": torch_add,
        },
        max(1, calls // 4),
        blocks,
    )
    report("skrl add_samples (64 envs)", adds, "torch ring in RAM", "us/call", 1e6)
    while not mem.filled:
        mem.add_samples(**data)
    names = list(SPEC)

    def torch_sample() -> None:
        idx = torch.randint(0, M * E, (256,))
        [views[n][idx] for n in names]

    samples = interleaved(
        {"sample(256)": lambda: mem.sample(names, 256), "torch ring in RAM": torch_sample},
        max(1, calls // 20),
        blocks,
    )
    report("skrl RandomMemory.sample(names, 256)", samples, "torch ring in RAM", "us/call", 1e6)
    mem.close()
    mem1.close()


def report(title: str, medians: dict[str, float], baseline: str, unit: str, scale: float) -> None:
    print(f"\n{title}")
    base = medians[baseline]
    for name, value in medians.items():
        print(f"  {name:32s} {value * scale:9.1f} {unit}   x{value / base:7.1f} of {baseline}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    args = parser.parse_args()
    calls, blocks = (200, 3) if args.quick else (2000, 7)
    with tempfile.TemporaryDirectory() as folder:
        tf_agents(folder, calls, blocks)
        skrl(folder, calls, blocks)


if __name__ == "__main__":
    main()
