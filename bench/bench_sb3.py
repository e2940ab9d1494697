"""What Stable-Baselines3's buffer costs on a store, next to SB3's own buffer in RAM.

Measured in one process as medians over many short blocks, SB3's and the drop-in's
alternating (noise from other processes hits both alike), for a CartPole-sized step
(observation float32[4], a discrete action) and an Atari-sized one (observation
uint8[84, 84, 4]), one env:

- ``add`` per step: ``mmreplay.compat.sb3.ReplayBuffer`` (committing every 1000 adds,
  its default) vs ``stable_baselines3.common.buffers.ReplayBuffer``, in blocks of 1000
  adds, so that each block pays one commit (shorter blocks would leave the commits out
  of the median);
- ``sample(256)`` from a full buffer (torch tensors on the CPU), blocks of 10 calls;
- ``model.save_replay_buffer`` (what ``save_to_pkl`` does: pickle the buffer) at
  ``--steps`` CartPole steps: seconds and bytes written.

It ends with a table whose ratios are computed from the figures it shows, and prints the
load average at the start and at the end.

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
from mmreplay.store import DEFAULT_COMMIT_EVERY  # noqa: E402

SHAPES = {
    "CartPole (float32[4])": gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
    "pixels (uint8[84,84,4])": gym.spaces.Box(0, 255, (84, 84, 4), np.uint8),
}
ACTIONS = gym.spaces.Discrete(4)
SB3, OURS = "SB3 ReplayBuffer (RAM)", "mmreplay"

#: rows of the closing table: (call, SB3's figure, the drop-in's figure, ratio), as shown
TABLE: list[tuple[str, str, str, str]] = []


def _step(space: gym.spaces.Box, rng: np.random.Generator) -> tuple:
    obs = rng.integers(0, 255, (1, *space.shape)).astype(space.dtype)
    return obs, obs, np.array([1]), np.array([0.5]), np.array([False]), [{}]


def _shown(seconds: float) -> str:
    """A time as the table shows it (µs below 10 ms, else ms; one decimal)."""
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def _ratio(mine: str, theirs: str) -> str:
    """The ratio of two figures as shown (so a reader gets the same from the table)."""
    value = {"µs": 1e-6, "ms": 1e-3}
    a, b = (float(x.split()[0]) * value[x.split()[1]] for x in (mine, theirs))
    return _times(a / b)


def _times(ratio: float) -> str:
    return f"{ratio:.2f}×" if ratio >= 0.1 else f"1/{1 / ratio:,.0f}"


def tabulate(call: str, medians: dict[str, float]) -> None:
    mine, theirs = _shown(medians[OURS]), _shown(medians[SB3])
    TABLE.append((call, theirs, mine, _ratio(mine, theirs)))


def per_step(folder: str, size: int, calls: int, blocks: int) -> None:
    rng = np.random.default_rng(0)
    for name, space in SHAPES.items():
        one_shape(name, space, _step(space, rng), f"{folder}/{name.split()[0]}", size, calls, blocks)


def one_shape(
    name: str, space: gym.spaces.Box, step: tuple, path: str, size: int, calls: int, blocks: int
) -> None:
    theirs = sb3_buffers.ReplayBuffer(size, space, ACTIONS, "cpu")
    ours = ReplayBuffer(size, space, ACTIONS, "cpu", path=path)
    adds = interleaved({SB3: lambda: theirs.add(*step), OURS: lambda: ours.add(*step)}, calls, blocks)
    report(f"add, {name}", adds, SB3, "us/call", 1e6)
    tabulate(f"`add`, {name}", adds)
    while not theirs.full:
        theirs.add(*step)
    while not ours.full:
        ours.add(*step)
    samples = interleaved(
        {SB3: lambda: theirs.sample(256), OURS: lambda: ours.sample(256)}, max(1, calls // 100), blocks
    )
    report(f"sample(256), {name}", samples, SB3, "us/call", 1e6)
    tabulate(f"`sample(256)`, {name}", samples)
    ours.close()


def saving(folder: str, steps: int) -> None:
    space = SHAPES["CartPole (float32[4])"]
    step = _step(space, np.random.default_rng(0))
    print(f"\nsave_replay_buffer at {steps} CartPole steps")
    shown = []
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
        nbytes = os.path.getsize(target)
        print(f"  {name:32s} {took * 1e3:9.1f} ms   {nbytes:>12,d} bytes")
        shown.append((_shown(took), nbytes))
        if hasattr(buffer, "close"):
            buffer.close()
        os.remove(target)
    (theirs, their_bytes), (mine, my_bytes) = shown
    TABLE.append(
        (
            f"`save_replay_buffer`, {steps:,d} CartPole steps",
            f"{theirs}, {their_bytes:,d} B",
            f"{mine}, {my_bytes:,d} B",
            f"{_ratio(mine, theirs)} of the time, {_times(my_bytes / their_bytes)} of the bytes",
        )
    )


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, smaller buffers (a smoke run)")
    parser.add_argument(
        "--steps", type=int, nargs="+", default=None, help="buffer sizes for save_replay_buffer"
    )
    args = parser.parse_args()
    calls = DEFAULT_COMMIT_EVERY  # adds per block: one commit in each
    blocks, size = (3, 2_000) if args.quick else (41, 20_000)
    steps = args.steps or ([10_000] if args.quick else [100_000, 1_000_000])
    print(f"start: {load()}")
    with tempfile.TemporaryDirectory() as folder:
        per_step(folder, size, calls, blocks)
        for n in steps:
            saving(folder, n)
    print(f"\nend: {load()}\n")
    print(f"| call | {SB3} | {OURS} | ratio |\n|---|---:|---:|---:|")
    for row in TABLE:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
