"""Hindsight relabelling (HER): SB3's HerReplayBuffer over a store next to SB3's own in RAM.

In one process, the same goal-env steps (bit flipping, ``--bits`` bits, episodes of at
most ``--bits`` steps) go into SB3's ``HerReplayBuffer`` and into
``mmreplay.compat.sb3.HerReplayBuffer`` (its defaults: a commit every 1000 adds), ``--size``
steps of ``--envs`` envs, ``n_sampled_goal=4``, the ``future`` strategy:

- ``sample(256)`` on the filled buffers, blocks of 10 calls taking turns;
- one ``add`` then ``sample(256)``, what an off-policy step with ``train_freq=1`` does (the
  store's episode bounds then change between samples);
- the store's own ``Store.sample(256, transform=mr.Hindsight(env))`` and, as its base,
  ``Store.sample(256)``;
- the wall time of SB3's ``DQN`` learning ``--train-steps`` steps of ``BitFlippingEnv``
  with each buffer (the same seed, a fresh model each run, the runs taking turns; torch
  on one thread, as on a loaded machine its threads only slow a small net down).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from .timing import Timed, interleaved, ratio, table

SMOKE = {"repeats": 1, "size": 2000, "train_steps": 200, "train_repeats": 1}
SB3, OURS = "SB3 HerReplayBuffer (RAM)", "mmreplay"


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=21, help="timed blocks per call")
    p.add_argument("--size", type=int, default=100_000, help="steps each buffer holds (all envs)")
    p.add_argument("--envs", type=int, default=1, help="parallel envs of each step")
    p.add_argument("--bits", type=int, default=10, help="bits of the bit-flipping goals")
    p.add_argument("--train-steps", type=int, default=5_000, help="DQN steps timed per run")
    p.add_argument("--train-repeats", type=int, default=3, help="DQN runs per buffer")


def goal_steps(n_envs: int, bits: int, seed: int = 0) -> Any:
    """An endless stream of random bit-flipping steps as SB3's ``add`` takes them."""
    rng = np.random.default_rng(seed)
    length = np.zeros(n_envs, np.int64)
    while True:
        obs = [
            {
                k: rng.integers(0, 2, (n_envs, bits), dtype=np.int8)
                for k in ("achieved_goal", "desired_goal", "observation")
            }
            for _ in range(2)
        ]
        length += 1
        done = (rng.random(n_envs) < 0.1) | (length >= bits)
        infos = [{"TimeLimit.truncated": bool(d and n >= bits)} for d, n in zip(done, length)]
        length[done] = 0
        yield obs[0], obs[1], rng.integers(0, bits, (n_envs, 1)), -np.ones(n_envs, np.float32), done, infos


def run(args: argparse.Namespace) -> None:
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.envs import BitFlippingEnv
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import DummyVecEnv
    from stable_baselines3.her.her_replay_buffer import HerReplayBuffer as SB3HerReplayBuffer

    import mmreplay as mr
    from mmreplay.compat.sb3 import HerReplayBuffer

    torch.set_num_threads(1)
    env = DummyVecEnv([lambda: BitFlippingEnv(n_bits=args.bits)] * args.envs)
    spaces = (env.observation_space, env.action_space, env)
    kw = dict(device="cpu", n_envs=args.envs)
    theirs = SB3HerReplayBuffer(args.size, *spaces, **kw)
    ours = HerReplayBuffer(args.size, *spaces, **kw, path=os.path.join(args.root, "her"))
    stream = goal_steps(args.envs, args.bits)
    for _ in range(args.size // args.envs):
        step = next(stream)
        theirs.add(*step)
        ours.add(*step)

    def add_and_sample(buffer: Any) -> None:
        buffer.add(*next(stream))
        buffer.sample(256)

    store, hindsight = ours.store, mr.Hindsight(env, "future", 0.8)
    got = interleaved(
        {
            SB3: Timed(lambda: theirs.sample(256), 10),
            OURS: Timed(lambda: ours.sample(256), 10),
            "add+sample SB3": Timed(lambda: add_and_sample(theirs), 10),
            "add+sample ours": Timed(lambda: add_and_sample(ours), 10),
            "store": Timed(lambda: store.sample(256), 10),
            "store hindsight": Timed(lambda: store.sample(256, transform=hindsight), 10),
        },
        args.repeats,
    )
    us = {k: v.median * 1e6 for k, v in got.items()}
    body = [
        ["`sample(256)`", us[SB3], us[OURS], ratio(us[OURS], us[SB3])],
        ["`add` then `sample(256)`", us["add+sample SB3"], us["add+sample ours"], ratio(us["add+sample ours"], us["add+sample SB3"])],
        ["`Store.sample(256, transform=mr.Hindsight(env))`", us[SB3], us["store hindsight"], ratio(us["store hindsight"], us[SB3])],
        ["`Store.sample(256)` (no relabelling)", "–", us["store"], "–"],
    ]  # fmt: skip
    ours.close()
    table(
        f"HER sample(256): SB3's HerReplayBuffer and mmreplay's ({args.size:,} steps, {args.envs} env(s), {args.bits} bits; µs, median)",
        ["call", SB3, OURS, "ratio"],
        body,
        [f"medians of {args.repeats} blocks of 10 calls, taking turns"],
    )

    def model(buffer_class: type, name: str) -> Any:
        kwargs: dict[str, Any] = {"n_sampled_goal": 4, "goal_selection_strategy": "future"}
        if buffer_class is HerReplayBuffer:
            kwargs["path"] = os.path.join(args.root, f"train-{name}-{len(made)}")
        m = DQN("MultiInputPolicy", BitFlippingEnv(n_bits=args.bits), replay_buffer_class=buffer_class,
                replay_buffer_kwargs=kwargs, learning_starts=2 * args.bits, buffer_size=100_000, seed=0)  # fmt: skip
        m.set_logger(Logger(None, []))
        made.append(m)
        return m

    made: list[Any] = []
    learn = {}
    for name, cls in ((SB3, SB3HerReplayBuffer), (OURS, HerReplayBuffer)):
        slot: dict[str, Any] = {}
        learn[name] = Timed(
            lambda s=slot: s["m"].learn(args.train_steps),
            before=lambda s=slot, c=cls, n=name: s.update(m=model(c, n[:4])),
        )
    trained = interleaved(learn, args.train_repeats, warmup=0)
    for m in made:
        if hasattr(m.replay_buffer, "close"):
            m.replay_buffer.close()
    seconds = {k: v.median for k, v in trained.items()}
    table(
        f"SB3 DQN + HER on BitFlippingEnv({args.bits} bits), {args.train_steps:,} steps: wall time (s, median)",
        ["run", SB3, OURS, "ratio"],
        [["`model.learn`", seconds[SB3], seconds[OURS], ratio(seconds[OURS], seconds[SB3])]],
        [f"medians of {args.train_repeats} runs each, taking turns; torch on one thread"],
    )
