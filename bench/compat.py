"""What the TF-Agents and skrl layers cost over the store and over an in-RAM buffer.

On the vector step (observation float32[17], action float32[6], reward float32), rings
full before timing, medians over interleaved blocks:

- TF-Agents ``UniformReplayBuffer.add_batch`` (batch_size 4) committing every add (the
  layer's default) and every 1000 adds, next to ``store.add`` of the same step and a
  numpy ring in RAM; ``get_next(sample_batch_size=256)`` next to numpy fancy indexing of
  the same arrays in RAM;
- skrl ``RandomMemory.add_samples`` (64 envs) committing every step and every 1000, and
  ``sample(names, 256)``, next to the same in a torch ring in RAM (``copy_`` into a
  preallocated tensor; indexing of random flat rows).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

import mmreplay as mr

from .timing import Timed, fill, interleaved, ratio, table

SMOKE = {"calls": 50, "repeats": 1, "capacity": 200}
SPEC = {
    "observation": mr.ArraySpec((17,), "float32"),
    "action": mr.ArraySpec((6,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=2000, help="adds per timed block (1/20 as many samples)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--capacity", type=int, default=20_000, help="steps of each ring (skrl: 1/10)")


def compare(
    title: str, variants: dict[str, Callable[[], Any]], baseline: str, calls: int, repeats: int
) -> None:
    got = interleaved({k: Timed(f, calls) for k, f in variants.items()}, repeats)
    base = got[baseline].median * 1e6
    table(
        title,
        ["call", "µs per call", f"× {baseline}'s time"],
        [[k, v.median * 1e6, ratio(v.median * 1e6, base)] for k, v in got.items()],
        [f"medians of {repeats} interleaved blocks of {calls} calls"],
    )


def numpy_ring(
    shapes: dict[str, tuple[int, ...]], capacity: int, item: dict[str, Any], zeros: Callable = np.zeros
) -> tuple[Any, Callable[[], None]]:
    ring = {k: zeros((capacity, *s)) for k, s in shapes.items()}
    slots = itertools.cycle(range(capacity))

    def add() -> None:
        slot = next(slots)
        for k, a in ring.items():
            a[slot] = item[k]

    return ring, add


def tf_agents(root: str, args: argparse.Namespace) -> None:
    from mmreplay.compat.tf_agents import UniformReplayBuffer

    B, L = 4, args.capacity
    rng = np.random.default_rng(0)
    items = {k: rng.standard_normal((B, *s.shape)).astype(s.dtype) for k, s in SPEC.items()}
    rb1 = UniformReplayBuffer(SPEC, B, L, path=f"{root}/rb1", commit_every=1)
    rb1000 = UniformReplayBuffer(SPEC, B, L, path=f"{root}/rb1000", commit_every=1000)
    store = mr.create(f"{root}/store", SPEC, L, B)
    ram, numpy_add = numpy_ring(
        {k: (B, *s.shape) for k, s in SPEC.items()}, L, items, lambda shape: np.zeros(shape, np.float32)
    )
    adds = {
        "add_batch, commit every add": lambda: rb1.add_batch(items),
        "add_batch, commit every 1000": lambda: rb1000.add_batch(items),
        "store.add, commit every 1000": lambda: store.add(items),
        "numpy ring in RAM": numpy_add,
    }
    fill(adds, L, 100)
    compare(
        "TF-Agents add_batch (batch_size 4), rings full", adds, "numpy ring in RAM", args.calls, args.repeats
    )
    full = {k: np.ascontiguousarray(np.swapaxes(v, 0, 1)) for k, v in ram.items()}

    def numpy_sample() -> None:
        t, b = rng.integers(0, L, 256), rng.integers(0, B, 256)
        for a in full.values():
            a[b, t]

    samples = {
        "get_next(sample_batch_size=256)": lambda: rb1000.get_next(sample_batch_size=256),
        "numpy fancy indexing": numpy_sample,
    }
    compare(
        "TF-Agents get_next(sample_batch_size=256)",
        samples,
        "numpy fancy indexing",
        max(1, args.calls // 20),
        args.repeats,
    )
    for x in (rb1, rb1000, store):
        x.close()


def skrl(root: str, args: argparse.Namespace) -> None:
    import torch

    from mmreplay.compat.skrl import RandomMemory

    torch.set_num_threads(1)  # both variants alike, and no thread contention on a shared machine
    M, E = max(10, args.capacity // 10), 64
    mem = RandomMemory(M, E, device="cpu", path=f"{root}/skrl")
    mem1 = RandomMemory(M, E, device="cpu", path=f"{root}/skrl1", commit_every=1)
    for m in (mem, mem1):
        for name, s in SPEC.items():
            m.create_tensor(name, s.shape[0] if s.shape else 1)
    data = {k: torch.randn(E, s.shape[0] if s.shape else 1) for k, s in SPEC.items()}
    ram, torch_add = numpy_ring(
        {k: (E, v.shape[1]) for k, v in data.items()}, M, data, lambda shape: torch.zeros(shape)
    )
    adds = {
        "add_samples, commit every step": lambda: mem1.add_samples(**data),
        "add_samples, commit every 1000": lambda: mem.add_samples(**data),
        "torch ring in RAM": torch_add,
    }
    fill(adds, M, 10)
    compare(
        "skrl add_samples (64 envs), rings full",
        adds,
        "torch ring in RAM",
        max(1, args.calls // 4),
        args.repeats,
    )
    names, views = list(SPEC), {k: v.view(-1, v.shape[-1]) for k, v in ram.items()}

    def torch_sample() -> None:
        idx = torch.randint(0, M * E, (256,))
        [views[n][idx] for n in names]

    samples = {"sample(names, 256)": lambda: mem.sample(names, 256), "torch ring in RAM": torch_sample}
    compare(
        "skrl RandomMemory.sample(names, 256)",
        samples,
        "torch ring in RAM",
        max(1, args.calls // 20),
        args.repeats,
    )
    mem.close()
    mem1.close()


def run(args: argparse.Namespace) -> None:
    tf_agents(args.root, args)
    skrl(args.root, args)
