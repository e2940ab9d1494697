"""TorchRL ``ReplayBuffer`` over the store (``MMReplayStorage``) next to ``LazyMemmapStorage``.

Both buffers hold the same rows of the vector workload (observation float32[17], action
float32[6], ``("next", "reward")`` float32, ``("next", "done")`` bool), written by the same
``extend`` calls, and are measured in the same run, as medians over interleaved blocks:

- ``ReplayBuffer.sample(256)`` with TorchRL's ``RandomSampler`` (``ndim=1``), and
- ``ReplayBuffer.sample(256)`` with ``SliceSampler(slice_len=8)`` on ``[steps, envs]``
  (``ndim=2``, 8 envs, episodes of 50 steps),
- ``extend`` of one step of 8 envs (``ndim=2``), the store committing every 1000 steps.

Usage: ``python bench/bench_torchrl.py [--quick] [--rows N]`` (default 200,000 rows).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_compat import interleaved, report  # noqa: E402

BASELINE = "LazyMemmapStorage"


def rows(shape: tuple[int, ...], seed: int = 0) -> Any:
    """Vector-workload rows of batch ``shape``; episodes of 50 steps along the last dim."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    t = torch.arange(shape[-1]).expand(shape)
    envs = torch.arange(shape[0])[:, None].expand(shape) if len(shape) == 2 else 0
    return TensorDict(
        {
            "observation": torch.randn(*shape, 17, generator=g),
            "action": torch.randn(*shape, 6, generator=g),
            "episode": envs * 1_000_000 + t // 50,
            ("next", "reward"): torch.randn(*shape, generator=g),
            ("next", "done"): (t % 50 == 49)[..., None],
        },
        list(shape),
    )


def buffers(folder: str, name: str, size: int, ndim: int, sampler: Any) -> dict[str, Any]:
    """The same buffer over each storage: ours first, then TorchRL's own."""
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    from mmreplay.compat.torchrl import MMReplayStorage

    storages = {
        "MMReplayStorage": MMReplayStorage(f"{folder}/{name}", max_size=size, ndim=ndim),
        BASELINE: LazyMemmapStorage(size, ndim=ndim, scratch_dir=f"{folder}/{name}-memmap"),
    }
    return {k: ReplayBuffer(storage=s, sampler=sampler(), batch_size=256) for k, s in storages.items()}


def run(folder: str, steps: int, calls: int, blocks: int) -> None:
    from torchrl.data import RandomSampler, SliceSampler

    torch.set_num_threads(1)  # both storages alike, and no thread contention on a shared box
    flat = buffers(folder, "flat", steps, 1, RandomSampler)
    data = rows((steps,))
    for rb in flat.values():
        for lo in range(0, steps, 10_000):
            rb.extend(data[lo : lo + 10_000])
    medians = interleaved({k: rb.sample for k, rb in flat.items()}, calls, blocks)
    report(f"ReplayBuffer.sample(256), RandomSampler, {steps} rows", medians, BASELINE, "us/call", 1e6)

    envs = 8
    sliced = buffers(folder, "sliced", steps, 2, lambda: SliceSampler(slice_len=8, traj_key="episode"))
    data = rows((envs, steps // envs))  # [envs, time], as collectors give
    for rb in sliced.values():
        rb.extend(data)
    medians = interleaved({k: rb.sample for k, rb in sliced.items()}, calls, blocks)
    report(
        f"ReplayBuffer.sample(256), SliceSampler(8), {steps} rows of {envs} envs",
        medians,
        BASELINE,
        "us/call",
        1e6,
    )

    step = rows((envs, 1))
    medians = interleaved({k: (lambda rb=rb: rb.extend(step)) for k, rb in sliced.items()}, calls, blocks)
    report(f"ReplayBuffer.extend of one step of {envs} envs", medians, BASELINE, "us/call", 1e6)
    for group in (flat, sliced):
        group["MMReplayStorage"].storage.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small buffer and fewer calls (a smoke run)")
    parser.add_argument("--rows", type=int, default=None, help="rows in each buffer (default 200000)")
    args = parser.parse_args(argv)
    import torchrl  # noqa: F401 - configures its logger on import; quiet it after

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    steps, calls, blocks = (4_000, 50, 3) if args.quick else (200_000, 500, 7)
    steps = args.rows or steps
    with tempfile.TemporaryDirectory() as folder:
        run(folder, steps, calls, blocks)


if __name__ == "__main__":
    main()
