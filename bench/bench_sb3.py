"""What Stable-Baselines3's buffer costs on a store, next to SB3's own buffer in RAM.

Measured as medians over interleaved blocks (noise from other processes hits every
variant alike), for a CartPole-sized step (observation float32[4], a discrete action)
and an Atari-sized one (observation uint8[84, 84, 4]), one env:

- ``add`` per step: ``mmreplay.compat.sb3.ReplayBuffer`` (committing every 1000 adds,
  its default) vs ``stable_baselines3.common.buffers.ReplayBuffer``;
- ``sample(256)`` from a full buffer (torch tensors on the CPU);
- ``model.save_replay_buffer`` (what ``save_to_pkl`` does: pickle the buffer) at
  ``--steps`` CartPole steps: seconds and bytes written.

Usage: ``python bench/bench_sb3.py [--quick] [--steps 100000 1000000]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_compat import interleaved, report  # noqa: E402

try:
    import gymnasium as gym
    from stable_baselines3.common import buffers as sb3_buffers
    from stable_baselines3.common.save_util import save_to_pkl
except ImportError as exc:  # pragma: no cover - the bench extra
    raise SystemExit(f"bench_sb3 needs stable-baselines3: pip install 'mmreplay[bench]' ({exc})") from None

from mmreplay.compat.sb3 import ReplayBuffer  # noqa: E402

SHAPES = {
    "CartPole (float32[4])": gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
    "pixels (uint8[84,84,4])": gym.spaces.Box(0, 255, (84, 84, 4), np.uint8),
}
ACTIONS = gym.spaces.Discrete(4)


def _step(space: gym.spaces.Box, rng: np.random.Generator) -> tuple:
    obs = rng.integers(0, 255, (1, *space.shape)).astype(space.dtype)
    return obs, obs, np.array([1]), np.array([0.5]), np.array([False]), [{}]


def per_step(folder: str, size: int, calls: int, blocks: int) -> None:
    rng = np.random.default_rng(0)
    for name, space in SHAPES.items():
        one_shape(name, space, _step(space, rng), f"{folder}/{name.split()[0]}", size, calls, blocks)


def one_shape(
    name: str, space: gym.spaces.Box, step: tuple, path: str, size: int, calls: int, blocks: int
) -> None:
    theirs = sb3_buffers.ReplayBuffer(size, space, ACTIONS, "cpu")
    ours = ReplayBuffer(size, space, ACTIONS, "cpu", path=path)
    adds = interleaved(
        {"SB3 ReplayBuffer (RAM)": lambda: theirs.add(*step), "mmreplay": lambda: ours.add(*step)},
        calls,
        blocks,
    )
    report(f"add, {name}", adds, "SB3 ReplayBuffer (RAM)", "us/call", 1e6)
    while not theirs.full:
        theirs.add(*step)
    while not ours.full:
        ours.add(*step)
    samples = interleaved(
        {"SB3 ReplayBuffer (RAM)": lambda: theirs.sample(256), "mmreplay": lambda: ours.sample(256)},
        max(1, calls // 20),
        blocks,
    )
    report(f"sample(256), {name}", samples, "SB3 ReplayBuffer (RAM)", "us/call", 1e6)
    ours.close()


def saving(folder: str, steps: int) -> None:
    space = SHAPES["CartPole (float32[4])"]
    step = _step(space, np.random.default_rng(0))
    print(f"\nsave_replay_buffer at {steps} CartPole steps")
    for name, cls, kwargs in (
        ("SB3 ReplayBuffer (pickle)", sb3_buffers.ReplayBuffer, {}),
        ("mmreplay (manifest)", ReplayBuffer, {"path": f"{folder}/save-{steps}"}),
    ):
        buffer = cls(steps, space, ACTIONS, "cpu", **kwargs)
        for _ in range(steps):
            buffer.add(*step)
        target = f"{folder}/{cls.__module__}-{steps}.pkl"
        t = time.perf_counter()
        save_to_pkl(target, buffer)
        took = time.perf_counter() - t
        print(f"  {name:32s} {took * 1e3:9.1f} ms   {os.path.getsize(target):>12,d} bytes")
        if hasattr(buffer, "close"):
            buffer.close()
        os.remove(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, smaller buffers (a smoke run)")
    parser.add_argument(
        "--steps", type=int, nargs="+", default=None, help="buffer sizes for save_replay_buffer"
    )
    args = parser.parse_args()
    calls, blocks, size = (200, 3, 2_000) if args.quick else (2000, 7, 20_000)
    steps = args.steps or ([10_000] if args.quick else [100_000, 1_000_000])
    with tempfile.TemporaryDirectory() as folder:
        per_step(folder, size, calls, blocks)
        for n in steps:
            saving(folder, n)


if __name__ == "__main__":
    main()
