"""Prioritized replay speed: mmreplay next to TorchRL's and cpprb's prioritized buffers.

On the same data (``--rows`` rows of the vector workload: obs float32[17], action
float32[6], reward, terminated; mmreplay stores them as ``rows / 8`` steps of 8 envs,
page-cached), in one run and interleaved:

- ``sample(256)`` with importance weights (beta 0.4), data gathered;
- ``update_priorities(256)`` of the rows just sampled, each update timed alone right after
  its sample (a difference of two medians would carry the noise of both);
- the first prioritized sample after reopening the buffer (mmreplay builds its sum tree
  from the mapped priority file then), and after that the reopen itself;
- ``add`` of one step of 8 envs with the prioritized sampler and with the uniform one.

TorchRL: ``TensorDictReplayBuffer(LazyMemmapStorage, PrioritizedSampler)``; cpprb:
``PrioritizedReplayBuffer``. A peer that is not installed is reported as skipped.
``--tree-from COMMIT`` adds mmreplay with the sum tree of another commit
(``mmreplay/sumtree.py`` taken with ``git show``; the rest of the code is this one), to
compare two trees in one run. Figures are medians in microseconds. Usage:
``python -m bench.bench_prioritized [--rows N] [--repeats R] [--tree-from COMMIT] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mmreplay as mr

NUM_ENVS = 8
BATCH = 256
ALPHA, BETA = 0.6, 0.4
SPEC = {
    "obs": mr.ArraySpec((17,), "float32"),
    "action": mr.ArraySpec((6,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
}


def data(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((rows, 17), np.float32),
        "action": rng.standard_normal((rows, 6), np.float32),
        "reward": rng.standard_normal(rows, np.float32),
        "terminated": rng.random(rows) < 0.01,
    }


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e6


def update_us(system: Any, repeats: int) -> float:
    """Median microseconds of ``update`` of the rows of a fresh ``sample``."""
    out = []
    for _ in range(repeats):
        system.sample()
        t = time.perf_counter()
        system.update()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e6


class MmreplayPER:
    name = "mmreplay"

    def __init__(self, folder: str, arrays: dict[str, np.ndarray]):
        rows = len(arrays["reward"])
        self.path = os.path.join(folder, "per")
        steps = rows // NUM_ENVS
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

    def first_sample_after_reopen(self) -> tuple[float, float]:
        self.store.close()
        t = time.perf_counter()
        self.store = mr.open(self.path, "a")
        opened = time.perf_counter() - t
        t = time.perf_counter()
        self.sample()
        return opened * 1e6, (time.perf_counter() - t) * 1e6


def tree_from(commit: str, folder: str) -> type:
    """The ``SumTree`` class of ``mmreplay/sumtree.py`` at ``commit``, taking the
    ``ascending`` hint of today's callers (an older tree's ``distinct``, or nothing)."""
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
    hint = next((h for h in ("ascending", "distinct") if h in inspect.signature(module.SumTree.set).parameters), None)

    class Tree(module.SumTree):  # type: ignore[name-defined, misc]
        def set(self, index: Any, weights: Any, ascending: bool = False) -> None:
            super().set(index, weights, **({hint: ascending} if hint else {}))

    return Tree


class MmreplayOtherTree(MmreplayPER):
    """mmreplay whose prioritized sampler uses the sum tree of another commit."""

    def __init__(self, folder: str, arrays: dict[str, np.ndarray], commit: str):
        from mmreplay.samplers import prioritized

        self.name = f"mmreplay@{commit}"
        here = os.path.join(folder, "other-tree")
        os.makedirs(here)
        ours = prioritized.SumTree
        prioritized.SumTree = tree_from(commit, here)
        try:
            super().__init__(here, arrays)
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
        td = TensorDict({k: torch.as_tensor(v) for k, v in arrays.items()}, batch_size=[rows])
        self.rb.extend(td)
        self.batch: Any = None

    def sample(self) -> None:
        self.batch = self.rb.sample()

    def update(self) -> None:
        self.rb.update_priority(self.batch["index"], self.torch.rand(BATCH) + 0.01)


class CpprbPER:
    name = "cpprb"

    def __init__(self, folder: str, arrays: dict[str, np.ndarray]):
        from cpprb import PrioritizedReplayBuffer

        rows = len(arrays["reward"])
        self.rb = PrioritizedReplayBuffer(
            rows,
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


def add_figures(folder: str, steps: int, repeats: int) -> dict[str, float]:
    """Median microseconds of ``add`` (one step of 8 envs), uniform vs prioritized."""
    step = {k: v[:NUM_ENVS] for k, v in data(NUM_ENVS, 1).items()}
    out = {}
    stores = {
        name: mr.create(os.path.join(folder, f"add-{name}"), SPEC, steps, NUM_ENVS, sampler=name)
        for name in ("uniform", "prioritized")
    }
    try:
        samples: dict[str, list[float]] = {name: [] for name in stores}
        for _ in range(repeats):  # interleaved blocks of 1000 adds
            for name, store in stores.items():
                t = time.perf_counter()
                for _ in range(1000):
                    store.add(step)
                samples[name].append((time.perf_counter() - t) / 1000 * 1e6)
        for name in stores:
            out[f"add_{name}_us"] = statistics.median(samples[name])
    finally:
        for store in stores.values():
            store.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tree-from", default=None, metavar="COMMIT")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="bench-per-")
    arrays = data(args.rows)
    report: dict[str, Any] = {"rows": args.rows, "batch": BATCH, "systems": {}, "skipped": {}}
    try:
        systems = []
        for cls in (MmreplayPER, TorchRLPER, CpprbPER):
            try:
                systems.append(cls(folder, arrays))
            except (ImportError, RuntimeError) as exc:  # not installed, or its C++ tree not built
                report["skipped"][cls.name] = f"{type(exc).__name__}: {exc}"[:200]
        if args.tree_from:
            systems.append(MmreplayOtherTree(folder, arrays, args.tree_from))
        for s in systems:
            s.sample()
        figures: dict[str, dict[str, list[float]]] = {s.name: {"sample": [], "update": []} for s in systems}
        block = max(1, args.repeats // 10)
        for _ in range(10):  # interleaved, so that noise hits every system alike
            for s in systems:
                figures[s.name]["sample"].append(median_us(s.sample, block))
                figures[s.name]["update"].append(update_us(s, block))
        for s in systems:
            report["systems"][s.name] = {
                "sample_us": statistics.median(figures[s.name]["sample"]),
                "update_us": statistics.median(figures[s.name]["update"]),
            }
        opened, first = systems[0].first_sample_after_reopen()
        report["systems"]["mmreplay"].update({"reopen_us": opened, "first_sample_after_reopen_us": first})
        for s in systems:
            if isinstance(s, MmreplayPER):
                s.store.close()
        report.update(add_figures(folder, max(64, args.rows // NUM_ENVS), max(3, args.repeats // 20)))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for name, fig in report["systems"].items():
        extra = "".join(f", {k} {v:.0f}" for k, v in fig.items() if k not in ("sample_us", "update_us"))
        print(
            f"{name:9s} sample({BATCH}) {fig['sample_us']:8.1f} us  update_priorities({BATCH}) {fig['update_us']:8.1f} us{extra}"
        )
    for name, why in report["skipped"].items():
        print(f"{name:9s} skipped: {why}")
    print(
        f"add (8 envs): uniform {report['add_uniform_us']:.2f} us, prioritized {report['add_prioritized_us']:.2f} us "
        f"({report['add_prioritized_us'] / report['add_uniform_us']:.2f}x)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
