"""TorchRL's ReplayBuffer over the store (``MMReplayStorage``) next to ``LazyMemmapStorage``.

Both buffers hold the same rows of the vector step (observation float32[17], action
float32[6], ``("next", "reward")`` float32, ``("next", "done")`` bool), written by the same
``extend`` calls, and take turns block by block:

- ``ReplayBuffer.sample(256)`` with TorchRL's ``RandomSampler`` (``ndim=1``);
- ``ReplayBuffer.sample(256)`` with ``SliceSampler(slice_len=8)`` on ``[steps, envs]``
  (``ndim=2``, 8 envs, episodes of 50 steps);
- ``extend`` of one step of 8 envs (``ndim=2``), the store committing every 1000 steps.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .timing import Timed, interleaved, ratio, table

SMOKE = {"rows": 4000, "calls": 20, "repeats": 1}
BASELINE = "LazyMemmapStorage"


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=200_000, help="rows in each buffer")
    p.add_argument("--calls", type=int, default=500, help="calls per timed block")
    p.add_argument("--repeats", type=int, default=7)


def rows(shape: tuple[int, ...], seed: int = 0) -> Any:
    """Vector rows of batch ``shape``; episodes of 50 steps along the last dim."""
    import torch
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


def run(args: argparse.Namespace) -> None:
    import torch
    import torchrl  # noqa: F401 - configures its logger on import; quiet it after
    from torchrl.data import LazyMemmapStorage, RandomSampler, ReplayBuffer, SliceSampler

    from mmreplay.compat.torchrl import MMReplayStorage

    logging.getLogger("torchrl").setLevel(logging.WARNING)
    torch.set_num_threads(1)  # both storages alike, and no thread contention on a shared machine
    n, envs = args.rows, 8

    def buffers(name: str, ndim: int, sampler: Any) -> dict[str, Any]:
        storages = {
            "MMReplayStorage": MMReplayStorage(f"{args.root}/{name}", max_size=n, ndim=ndim),
            BASELINE: LazyMemmapStorage(n, ndim=ndim, scratch_dir=f"{args.root}/{name}-memmap"),
        }
        return {k: ReplayBuffer(storage=s, sampler=sampler(), batch_size=256) for k, s in storages.items()}

    flat = buffers("flat", 1, RandomSampler)
    data = rows((n,))
    for rb in flat.values():
        for lo in range(0, n, 10_000):
            rb.extend(data[lo : lo + 10_000])
    sliced = buffers("sliced", 2, lambda: SliceSampler(slice_len=8, traj_key="episode"))
    for rb in sliced.values():
        rb.extend(rows((envs, n // envs)))  # [envs, time], as collectors give
    step = rows((envs, 1))
    body = []
    for call, variants in (
        ("`sample(256)`, RandomSampler", {k: rb.sample for k, rb in flat.items()}),
        (
            f"`sample(256)`, SliceSampler(slice_len=8), {envs} envs",
            {k: rb.sample for k, rb in sliced.items()},
        ),
        (
            f"`extend` of one step of {envs} envs",
            {k: (lambda rb=rb: rb.extend(step)) for k, rb in sliced.items()},
        ),
    ):
        got = interleaved({k: Timed(f, args.calls) for k, f in variants.items()}, args.repeats)
        ours, theirs = got["MMReplayStorage"].median * 1e6, got[BASELINE].median * 1e6
        body.append([call, ours, theirs, ratio(ours, theirs)])
    for group in (flat, sliced):
        group["MMReplayStorage"].storage.close()
    table(
        f"TorchRL ReplayBuffer, {n:,} rows (µs per call, median)",
        ["call", "MMReplayStorage", BASELINE, "× LazyMemmapStorage's time"],
        body,
        [f"medians of {args.repeats} interleaved blocks of {args.calls} calls"],
    )
