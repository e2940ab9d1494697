"""n-step returns: sampling them, and SB3's DQN trained with them, next to SB3's own buffer.

The same CartPole-sized one-step transitions (observation float32[4], a discrete action,
episodes of 20 to 200 steps, one in four cut by a time limit) fill, in one process:

- SB3's ``NStepReplayBuffer`` (RAM) and ``mmreplay.compat.sb3.NStepReplayBuffer``:
  ``sample(256)`` with ``n_steps=3``, torch tensors on the CPU;
- the store itself: ``store.sample(256, transform=mr.NStep(3, 0.99))``, numpy arrays;
- cpprb's ``ReplayBuffer(Nstep=...)`` (if installed): it sums the rewards as steps are
  added and stores n-step transitions, so its ``sample(256)`` only gathers them.

The variants take turns block by block. Then SB3's ``DQN`` on CartPole learns
``--train-steps`` steps with each buffer class (``n_steps=3``), in turns, seeded alike:
wall seconds of ``learn`` (model construction outside the clock).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from .timing import Timed, fill, interleaved, ratio, table

SMOKE = {"size": 2000, "calls": 5, "repeats": 1, "train_steps": 300, "train_repeats": 1}
N, GAMMA = 3, 0.99
SB3, OURS, STORE, CPPRB = (
    "SB3 NStepReplayBuffer (RAM)",
    "mmreplay drop-in",
    "mmreplay store.sample",
    "cpprb Nstep",
)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", type=int, default=100_000, help="steps in each buffer")
    p.add_argument("--calls", type=int, default=50, help="sample(256) calls per timed block")
    p.add_argument("--repeats", type=int, default=21, help="timed blocks per variant")
    p.add_argument("--train-steps", type=int, default=20_000, help="DQN learn() steps per run")
    p.add_argument("--train-repeats", type=int, default=3, help="DQN runs per buffer class")


def transitions(size: int, seed: int = 0) -> list[tuple]:
    """SB3 ``add`` arguments of one env: random observations, rewards and episode ends."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((size + 1, 1, 4)).astype(np.float32)
    ends = np.zeros(size, bool)
    at = np.cumsum(rng.integers(20, 200, size // 20 + 1))
    ends[at[at < size]] = True
    limits = ends & (rng.random(size) < 0.25)
    return [
        (obs[t], obs[t + 1], np.array([t % 2]), np.array([rng.random()], np.float32), ends[t : t + 1],
         [{"TimeLimit.truncated": bool(limits[t])}])
        for t in range(size)
    ]  # fmt: skip


def run(args: argparse.Namespace) -> None:
    import gymnasium as gym
    from stable_baselines3.common import buffers

    import mmreplay as mr
    from mmreplay.compat.sb3 import NStepReplayBuffer

    box, actions = gym.spaces.Box(-1.0, 1.0, (4,), np.float32), gym.spaces.Discrete(2)
    data = transitions(args.size)
    theirs = buffers.NStepReplayBuffer(args.size, box, actions, "cpu", n_steps=N, gamma=GAMMA)
    ours = NStepReplayBuffer(
        args.size, box, actions, "cpu", n_steps=N, gamma=GAMMA, path=os.path.join(args.root, "b")
    )
    feeds = {SB3: iter(data), OURS: iter(data)}
    fill(
        {k: lambda b=b, f=feeds[k]: b.add(*next(f)) for k, b in ((SB3, theirs), (OURS, ours))},
        args.size,
        1000,
    )
    nstep = mr.NStep(N, GAMMA)
    variants: dict[str, Any] = {
        SB3: lambda: theirs.sample(256),
        OURS: lambda: ours.sample(256),
        STORE: lambda: ours.store.sample(256, transform=nstep),
    }
    notes = [
        f"medians of {args.repeats} blocks of {args.calls} calls, taking turns; {args.size:,} steps, n = {N}"
    ]
    try:
        variants[CPPRB] = cpprb_sample(data)
    except ImportError:
        notes.append("cpprb is not installed (pip install 'mmreplay[bench]'): not measured")
    got = interleaved({k: Timed(f, args.calls) for k, f in variants.items()}, args.repeats)
    base = got[SB3].median * 1e6
    body = [[name, s.median * 1e6, ratio(s.median * 1e6, base)] for name, s in got.items()]
    table(
        "n-step `sample(256)`, CartPole-sized transitions (µs, median)",
        ["buffer", "µs", "× SB3's time"],
        body,
        notes,
    )
    ours.close()
    train(args)


def cpprb_sample(data: list[tuple]) -> Any:
    """cpprb's n-step buffer holding ``data``: its ``sample(256)``."""
    from cpprb import ReplayBuffer

    rb = ReplayBuffer(
        len(data),
        {
            "obs": {"shape": 4},
            "act": {"shape": 1, "dtype": np.int64},
            "rew": {},
            "next_obs": {"shape": 4},
            "done": {},
        },
        Nstep={"size": N, "gamma": GAMMA, "rew": "rew", "next": "next_obs"},
    )
    for obs, nxt, act, rew, done, _ in data:
        rb.add(obs=obs[0], act=act, rew=rew, next_obs=nxt[0], done=float(done[0]))
        if done[0]:
            rb.on_episode_end()
    return lambda: rb.sample(256)


def train(args: argparse.Namespace) -> None:
    """DQN on CartPole through each buffer class, ``learn`` timed in turns."""
    import gymnasium as gym
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common import buffers
    from stable_baselines3.common.logger import Logger

    from mmreplay.compat.sb3 import NStepReplayBuffer

    torch.set_num_threads(1)  # both runs alike, and no thread contention on a shared machine
    classes = {SB3: (buffers.NStepReplayBuffer, {}), OURS: (NStepReplayBuffer, {"path": None})}
    models: dict[str, Any] = {}

    def make(name: str) -> None:
        cls, extra = classes[name]
        if name in models and hasattr(models[name].replay_buffer, "close"):
            models[name].replay_buffer.close()
        model = DQN(
            "MlpPolicy", gym.make("CartPole-v1"), buffer_size=50_000, learning_starts=min(1000, args.train_steps // 4),
            train_freq=4, target_update_interval=500, policy_kwargs={"net_arch": [64, 64]}, seed=0,
            replay_buffer_class=cls, replay_buffer_kwargs={"n_steps": N, "gamma": GAMMA, **extra},
        )  # fmt: skip
        model.set_logger(Logger(None, []))
        models[name] = model

    runs = {
        name: Timed(
            lambda name=name: models[name].learn(args.train_steps), before=lambda name=name: make(name)
        )
        for name in classes
    }
    got = interleaved(runs, args.train_repeats, warmup=0)
    for model in models.values():
        if hasattr(model.replay_buffer, "close"):
            model.replay_buffer.close()
    base = got[SB3].median
    table(
        f"SB3 DQN on CartPole with 3-step returns: `learn({args.train_steps:,})` wall time (s, median)",
        ["replay buffer class", "s", "× SB3's time"],
        [[name, s.median, ratio(s.median, base)] for name, s in got.items()],
        [f"medians of {args.train_repeats} runs each, taking turns; train_freq 4, one thread"],
    )
