"""The rows torture writers collect: each a hash of its global step id and env, so a row
of another step, a stale row of the ring's previous lap, or a torn row differs from the
one expected, and a checker recomputes any step without keeping a copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..spec import ArraySpec

#: the data each torture writer collects: pixels, a state vector, actions and scalars
SPEC = {
    "obs": {"pixels": ArraySpec((6, 6, 3), "uint8"), "state": ArraySpec((5,), "float32")},
    "action": ArraySpec((2,), "int64"),
    "reward": ArraySpec((), "float32"),
    "terminated": ArraySpec((), "bool"),
}

#: frame stacks of 4 and their next stacks, as the Atari wrappers make them, for the
#: layouts that keep each frame once (:func:`frame_values`)
FRAME_STACK = 4
FRAMES_SPEC = {
    "obs": ArraySpec((FRAME_STACK, 6, 6), "uint8"),
    "next_obs": ArraySpec((FRAME_STACK, 6, 6), "uint8"),
    "action": ArraySpec((2,), "int64"),
    "reward": ArraySpec((), "float32"),
    "terminated": ArraySpec((), "bool"),
    "truncated": ArraySpec((), "bool"),
}


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64: a different 64-bit word for every key."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def step_values(leaves: Sequence[ArraySpec], num_envs: int, steps: Any) -> list[np.ndarray]:
    """The rows of ``steps`` (global ids), per leaf ``[*steps.shape, num_envs, *shape]``.

    Every element is a hash of (step, env, leaf, element), so a row of another step, a
    stale row from the previous lap of the ring, or a torn row differs from it.
    """
    steps = np.asarray(steps, dtype=np.int64)
    out = []
    envs = np.arange(num_envs, dtype=np.uint64)
    for i, spec in enumerate(leaves):
        size = int(np.prod(spec.shape))
        elems = np.arange(size, dtype=np.uint64)
        key = (steps.astype(np.uint64)[..., None, None] * np.uint64(num_envs) + envs[:, None]) * np.uint64(
            size
        )
        key = (key + elems) * np.uint64(len(leaves)) + np.uint64(i)
        h = _mix(key)
        kind = spec.dtype.kind
        if kind == "b":
            v = (h & np.uint64(1)).astype(bool)
        elif kind in "iu":
            v = h.astype(spec.dtype)
        else:  # floats and complex: 24-bit integers are exact in every float type but float16
            v = (h >> np.uint64(40)).astype(spec.dtype)
        out.append(v.reshape(*steps.shape, num_envs, *spec.shape))
    return out


def frame_values(num_envs: int, steps: Any) -> list[np.ndarray]:
    """The rows of ``steps`` for :data:`FRAMES_SPEC` (flatten order), as
    :func:`step_values`: each step's observation is a stack of the last
    :data:`FRAME_STACK` frames of its env's episode (an episode's first frame repeated
    before it), its next observation the stack one frame on (an ended episode's final frame
    is a frame of its own, which a store keeping each frame once puts in its side ring).
    Episodes end at about one step in eleven, terminated or truncated."""
    steps = np.asarray(steps, dtype=np.int64)
    k = FRAME_STACK
    envs = np.arange(num_envs, dtype=np.int64)
    t = steps[..., None]  # [..., num_envs] by broadcasting

    def word(at: np.ndarray, salt: int) -> np.ndarray:
        key = (at.astype(np.uint64) * np.uint64(num_envs) + envs.astype(np.uint64)) * np.uint64(7)
        return _mix(key + np.uint64(salt))

    def ends(at: np.ndarray) -> np.ndarray:
        return (at >= 0) & (word(np.maximum(at, 0), 1) % np.uint64(11) == 0)

    def frame(at: np.ndarray, salt: int = 2) -> np.ndarray:
        cells = np.arange(36, dtype=np.uint64)
        h = _mix((word(at, salt)[..., None] << np.uint64(6)) + cells)
        return (h & np.uint64(0xFF)).astype(np.uint8).reshape(*h.shape[:-1], 6, 6)

    # the first step of each env's episode, when it is one of the k - 1 steps before t (or t)
    start = np.full(t.shape[:-1] + (num_envs,), -1, np.int64)
    for back in range(k - 1, -1, -1):
        at = t - back
        begins = (at == 0) | ((at > 0) & ends(at - 1))
        start = np.where(begins & (at >= 0), at, start)
    first = np.where(start >= 0, start, t - (k - 1))

    def stack(frames_at: list[np.ndarray]) -> np.ndarray:
        return np.stack(frames_at, axis=-3)

    obs = stack([frame(np.maximum(t - (k - 1) + i, first)) for i in range(k)])
    final = np.where(ends(t)[..., None, None], frame(t + 1, 3), frame(t + 1))
    nxt = stack([frame(np.maximum(t - (k - 2) + i, first)) for i in range(k - 1)] + [final])
    ended = ends(t)
    terminated = ended & (word(t, 4) % np.uint64(2) == 0)
    action, reward = step_values([FRAMES_SPEC["action"], FRAMES_SPEC["reward"]], num_envs, steps)
    return [action, nxt, obs, reward, terminated, ended & ~terminated]
