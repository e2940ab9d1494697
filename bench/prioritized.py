"""Prioritized replay: mmreplay beside TorchRL's and cpprb's prioritized buffers.

On the same data (``--rows`` rows of the vector step: obs float32[17], action
float32[6], reward, terminated; mmreplay holds them as ``rows / 8`` steps of 8 envs,
page-cached), in one run, interleaved:

- ``sample(256)`` with importance weights (beta 0.4), the data gathered;
- ``update_priorities(256)`` of the rows just sampled, each update timed alone right
  after its (untimed) sample;
- mmreplay's reopen, and its first prioritized sample after it (the sum tree is built
  from the mapped priority file then);
- ``add`` of one step of 8 envs with the prioritized sampler and with the uniform one.

TorchRL: ``TensorDictReplayBuffer(LazyMemmapStorage, PrioritizedSampler)``; cpprb:
``PrioritizedReplayBuffer``; one that is not installed (or whose C++ tree is not built)
is named as skipped. ``--tree-from COMMIT`` adds mmreplay with the sum tree of another
commit (``mmreplay/sumtree.py`` taken with ``git show``), to compare two trees in one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import subprocess
from typing import Any

import numpy as np

import mmreplay as mr

from .data import NUM_ENVS, vector_spec
from .timing import Timed, interleaved, ratio, table

SMOKE = {"rows": 4096, "repeats": 20}
BATCH = 256
ALPHA, BETA = 0.6, 0.4
SPEC = vector_spec(truncated=False)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=200, help="timed calls of each figure per system")
    p.add_argument("--tree-from", metavar="COMMIT", help="also mmreplay with the sum tree of this commit")


def data(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((rows, 17), np.float32),
        "action": rng.standard_normal((rows, 6), np.float32),
        "reward": rng.standard_normal(rows, np.float32),
        "terminated": rng.random(rows) < 0.01,
    }


class MmreplayPER:
    name = "mmreplay"

    def __init__(self, folder: str, arrays: dict[str, np.ndarray]):
        steps = len(arrays["reward"]) // NUM_ENVS
        self.path = os.path.join(folder, self.name.replace("@", "-"))
        self.store = mr.create(self.path, SPEC, steps, NUM_ENVS, sampler="prioritized", alpha=ALPHA)
        self.store.extend(
            {k: v[: steps * NUM_ENVS].reshape(steps, NUM_ENVS, *v.shape[1:]) for k, v in arrays.items()}
        )
        self.store.commit()
        self.rng = np.random.default_rng(0)
        self.info: Any = None

    def sample(self) -> None:
        _, self.info = self.store.sample(BATCH, beta=BETA, return_info=True, rng=self.rng)

    def update(self) -> None:
        self.store.update_priorities(self.info.step, self.info.env, self.rng.random(BATCH) + 0.01)

    def reopen(self) -> None:
        self.store = mr.open(self.path, "a")

    def close(self) -> None:
        self.store.close()


def tree_from(commit: str, folder: str) -> type:
    """The ``SumTree`` of ``mmreplay/sumtree.py`` at ``commit``, taking today's callers'
    ``ascending`` hint (an older tree's ``distinct``, or nothing)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(
        ["git", "show", f"{commit}:mmreplay/sumtree.py"], cwd=root, capture_output=True, text=True, check=True
    ).stdout
    path = os.path.join(folder, "sumtree_other.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("sumtree_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    hint = next(
        (h for h in ("ascending", "distinct") if h in inspect.signature(module.SumTree.set).parameters), None
    )

    class Tree(module.SumTree):  # type: ignore[name-defined, misc]
        def set(self, index: Any, weights: Any, ascending: bool = False) -> None:
            super().set(index, weights, **({hint: ascending} if hint else {}))

    return Tree


class MmreplayOtherTree(MmreplayPER):
    """mmreplay whose prioritized sampler uses the sum tree of another commit."""

    def __init__(self, folder: str, arrays: dict[str, np.ndarray], commit: str):
        from mmreplay.samplers import prioritized

        self.name = f"mmreplay@{commit}"
        ours = prioritized.SumTree
        prioritized.SumTree = tree_from(commit, folder)
        try:
            super().__init__(folder, arrays)
            self.sample()  # the tree is made at the first draw
        finally:
            prioritized.SumTree = ours


class TorchRLPER:
    name = "torchrl"

    def __init__(self, folder: str, arrays: dict[str, np.ndarray]):
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyMemmapStorage, PrioritizedSampler, TensorDictReplayBuffer

        rows = len(arrays["reward"])
        self.torch = torch
        self.rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(rows, scratch_dir=os.path.join(folder, "torchrl")),
            sampler=PrioritizedSampler(rows, alpha=ALPHA, beta=BETA),
            batch_size=BATCH,
        )
        self.rb.extend(TensorDict({k: torch.as_tensor(v) for k, v in arrays.items()}, batch_size=[rows]))
        self.batch: Any = None

    def sample(self) -> None:
        self.batch = self.rb.sample()

    def update(self) -> None:
        self.rb.update_priority(self.batch["index"], self.torch.rand(BATCH) + 0.01)


class CpprbPER:
    name = "cpprb"

    def __init__(self, folder: str, arrays: dict[str, np.ndarray]):
        from cpprb import PrioritizedReplayBuffer

        self.rb = PrioritizedReplayBuffer(
            len(arrays["reward"]),
            {"obs": {"shape": 17}, "action": {"shape": 6}, "reward": {}, "terminated": {}},
            alpha=ALPHA,
        )
        self.rb.add(**arrays)
        self.rng = np.random.default_rng(0)
        self.batch: Any = None

    def sample(self) -> None:
        self.batch = self.rb.sample(BATCH, beta=BETA)

    def update(self) -> None:
        self.rb.update_priorities(self.batch["indexes"], self.rng.random(BATCH) + 0.01)


def add_figures(folder: str, steps: int, repeats: int) -> None:
    step = {k: v.reshape(1, NUM_ENVS, *v.shape[1:])[0] for k, v in data(NUM_ENVS, 1).items()}
    stores = {
        n: mr.create(os.path.join(folder, f"add-{n}"), SPEC, steps, NUM_ENVS, sampler=n)
        for n in ("uniform", "prioritized")
    }
    got = interleaved({n: Timed(lambda s=s: s.add(step), 1000) for n, s in stores.items()}, repeats)
    for s in stores.values():
        s.close()
    uniform = got["uniform"].median * 1e6
    table(
        "add of one step of 8 envs, by sampler",
        ["sampler", "add µs", "× uniform's time"],
        [[n, s.median * 1e6, ratio(s.median * 1e6, uniform)] for n, s in got.items()],
        [f"medians of {repeats} interleaved blocks of 1000 adds"],
    )


def run(args: argparse.Namespace) -> None:
    arrays = data(args.rows)
    systems, skipped = [], []
    for cls in (MmreplayPER, TorchRLPER, CpprbPER):
        try:
            systems.append(cls(args.root, arrays))
        except (ImportError, RuntimeError) as exc:  # not installed, or its C++ tree not built
            skipped.append(f"{cls.name} skipped: {type(exc).__name__}: {exc}"[:200])
    if args.tree_from:
        systems.append(MmreplayOtherTree(args.root, arrays, args.tree_from))
    variants: dict[str, Timed] = {}
    for s in systems:
        variants[f"{s.name}|sample"] = Timed(s.sample)
        variants[f"{s.name}|update"] = Timed(s.update, before=s.sample)
    got = interleaved(variants, args.repeats)
    us = {k: v.median * 1e6 for k, v in got.items()}
    base = next((n for n in ("cpprb", "torchrl") if f"{n}|sample" in us), "mmreplay")
    ours = systems[0]
    ours.close()
    reopened = interleaved({"reopen": ours.reopen}, 1, warmup=0)["reopen"].median * 1e6
    first = interleaved({"first": ours.sample}, 1, warmup=0)["first"].median * 1e6
    for s in systems:
        if isinstance(s, MmreplayPER):
            s.close()
    body = [
        [s.name, us[f"{s.name}|sample"], ratio(us[f"{s.name}|sample"], us[f"{base}|sample"]),
         us[f"{s.name}|update"], ratio(us[f"{s.name}|update"], us[f"{base}|update"])]
        for s in systems
    ]  # fmt: skip
    table(
        f"prioritized sample({BATCH}) and update_priorities({BATCH}) on {args.rows:,} rows (µs, median)",
        ["system", f"sample({BATCH})", f"× {base}'s time", f"update_priorities({BATCH})", f"× {base}'s time"],
        body,
        skipped + [f"mmreplay reopen {reopened:,.0f} µs, then its first sample {first:,.0f} µs (the sum tree is built)",
                   f"medians of {args.repeats} calls each, the systems taking turns call by call"],
    )  # fmt: skip
    add_figures(args.root, max(64, args.rows // NUM_ENVS), max(3, args.repeats // 20))
