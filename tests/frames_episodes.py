"""Random episodes with frame stacks that follow one another, as the Atari wrappers make
them, for the frames-once tests: each step's stack is the previous one shifted by one
new frame; an episode's first stack repeats its first frame (or pads with zeros)."""

from __future__ import annotations

import numpy as np

import mmreplay as mr


def spec(frame: tuple[int, ...], k: int, axis: int) -> dict:
    shape = list(frame)
    if k > 1:
        shape.insert(axis if axis >= 0 else len(shape) + 1 + axis, k)
    obs = mr.ArraySpec(tuple(shape), "uint8")
    return {
        "obs": obs,
        "next_obs": obs,
        "action": mr.ArraySpec((2,), "float32"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }


class Episodes:
    """Steps of ``num_envs`` envs; ``end`` is the chance that a step ends its episode."""

    def __init__(
        self, num_envs: int, frame: tuple[int, ...], k: int, axis: int, pad: str, end: float, seed: int
    ):
        self.rng = np.random.default_rng(seed)
        self.num_envs, self.frame, self.k, self.pad, self.end = num_envs, frame, k, pad, end
        self.axis = (axis if axis >= 0 else len(frame) + 1 + axis) + 1  # in [num_envs, *stack]
        self.stack = np.stack([self._start(self._frame()) for _ in range(num_envs)])

    def _frame(self) -> np.ndarray:
        return self.rng.integers(0, 4, self.frame, dtype=np.uint8)  # few values: repeats happen

    def _start(self, first: np.ndarray) -> np.ndarray:
        frames = [np.zeros_like(first) if self.pad == "zeros" else first] * (self.k - 1) + [first]
        return np.stack(frames, axis=self.axis - 1) if self.k > 1 else first

    def _push(self, stack: np.ndarray, frame: np.ndarray) -> np.ndarray:
        if self.k == 1:
            return frame
        a = self.axis - 1
        return np.concatenate([np.take(stack, range(1, self.k), axis=a), np.expand_dims(frame, a)], axis=a)

    def step(self) -> dict:
        ne = self.num_envs
        obs = self.stack.copy()
        nxt = np.stack([self._push(obs[e], self._frame()) for e in range(ne)])
        ends = self.rng.random(ne) < self.end
        terminated = ends & (self.rng.random(ne) < 0.5)
        truncated = ends & ~terminated
        for e in range(ne):
            self.stack[e] = self._start(self._frame()) if ends[e] else nxt[e]
        return {
            "obs": obs,
            "next_obs": nxt,
            "action": self.rng.standard_normal((ne, 2)).astype(np.float32),
            "reward": self.rng.standard_normal(ne).astype(np.float32),
            "terminated": terminated,
            "truncated": truncated,
        }
