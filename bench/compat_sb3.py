"""What Stable-Baselines3's buffer costs on a store, next to SB3's own buffer in RAM.

In one process, SB3's ``ReplayBuffer`` and ``mmreplay.compat.sb3.ReplayBuffer``
(committing every 1000 adds, its default) taking turns block by block, for a
CartPole-sized step (observation float32[4], a discrete action) and an Atari-sized one
(observation uint8[84, 84, 4]), one env, buffers full before timing:

- ``add`` per step, in blocks of 1000 adds, so that each block pays one commit;
- ``sample(256)`` (torch tensors on the CPU), blocks of 10 calls;
- ``model.save_replay_buffer`` (what ``save_to_pkl`` does: pickle the buffer) at
  ``--save-steps`` CartPole steps: seconds and bytes written.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from .atari_like import rollout
from .timing import Timed, fill, interleaved, ratio, table

SMOKE = {"repeats": 1, "size": 1200, "save_steps": [2000]}
SB3, OURS = "SB3 ReplayBuffer (RAM)", "mmreplay"


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=41, help="timed blocks per buffer")
    p.add_argument("--size", type=int, default=20_000, help="steps of the buffers timed")
    p.add_argument(
        "--save-steps", type=int, nargs="+", default=[100_000, 1_000_000], help="buffer sizes saved"
    )


def run(args: argparse.Namespace) -> None:
    import gymnasium as gym
    from stable_baselines3.common import buffers
    from stable_baselines3.common.save_util import save_to_pkl

    from mmreplay.compat.sb3 import ReplayBuffer

    actions = gym.spaces.Discrete(4)
    rng = np.random.default_rng(0)
    cartpole = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    pixels = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)

    def step(obs: np.ndarray) -> tuple:
        return obs, obs, np.array([1]), np.array([0.5]), np.array([False]), [{}]

    steps = {
        "CartPole float32[4]": (cartpole, step(rng.standard_normal((1, 4)).astype(np.float32))),
        "pixels uint8[84, 84, 4]": (pixels, step(rollout(1, 1)["obs"][0])),
    }
    body: list[list[Any]] = []
    for name, (space, one) in steps.items():
        theirs = buffers.ReplayBuffer(args.size, space, actions, "cpu")
        ours = ReplayBuffer(args.size, space, actions, "cpu", path=os.path.join(args.root, name.split()[0]))
        adds = {SB3: lambda b=theirs, s=one: b.add(*s), OURS: lambda b=ours, s=one: b.add(*s)}
        fill(adds, args.size, 1000)
        for call, variants, calls in (
            (f"`add`, {name}", adds, 1000),
            (
                f"`sample(256)`, {name}",
                {SB3: lambda b=theirs: b.sample(256), OURS: lambda b=ours: b.sample(256)},
                10,
            ),
        ):
            got = interleaved({k: Timed(f, calls) for k, f in variants.items()}, args.repeats)
            body.append(
                [
                    call,
                    got[SB3].median * 1e6,
                    got[OURS].median * 1e6,
                    ratio(got[OURS].median, got[SB3].median),
                ]
            )
        ours.close()
    for n in args.save_steps:
        saved = {}
        made = {
            SB3: buffers.ReplayBuffer(n, cartpole, actions, "cpu"),
            OURS: ReplayBuffer(n, cartpole, actions, "cpu", path=os.path.join(args.root, f"save-{n}")),
        }
        for label, buffer in made.items():
            target = os.path.join(args.root, f"{label[:5]}-{n}.pkl")
            fill({label: lambda b=buffer: b.add(*steps["CartPole float32[4]"][1])}, n, 1000)
            saved[label] = (
                interleaved({"s": lambda b=buffer, t=target: save_to_pkl(t, b)}, 1, warmup=0)["s"].median,
                os.path.getsize(target),
            )
            if hasattr(buffer, "close"):
                buffer.close()
            os.remove(target)
        (t_sb3, b_sb3), (t_ours, b_ours) = saved[SB3], saved[OURS]
        body.append([f"`save_replay_buffer`, {n:,} CartPole steps (µs; bytes)", f"{t_sb3 * 1e6:,.0f}; {b_sb3:,}", f"{t_ours * 1e6:,.0f}; {b_ours:,}",
                     f"{ratio(t_ours, t_sb3)} the time, {ratio(b_ours, b_sb3)} the bytes"])  # fmt: skip
    table(
        "Stable-Baselines3's ReplayBuffer: SB3's in RAM and mmreplay's drop-in (µs, median)",
        ["call", SB3, OURS, "ratio"],
        body,
        [
            f"add: medians of {args.repeats} blocks of 1000 adds; sample: of {args.repeats} blocks of 10 calls, taking turns"
        ],
    )
