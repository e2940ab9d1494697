"""The data every system in the benchmark stores: vector, pixel and nested-dict steps.

Pixel frames come from a small renderer of moving shapes (with a 4-frame stack, as
Atari agents see them), so compression meets the redundancy of real frames rather than
noise, which no codec can shrink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import mmreplay as mr

__all__ = ["Workload", "WORKLOADS", "vector_spec", "flat_items", "nest_from_flat"]


def vector_spec(next_obs: bool = True) -> dict[str, mr.ArraySpec]:
    """The MuJoCo-like vector spec: obs float32[17], action float32[6], reward, done flags."""
    spec = {
        "obs": mr.ArraySpec((17,), "float32"),
        "action": mr.ArraySpec((6,), "float32"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }
    if next_obs:
        spec["next_obs"] = mr.ArraySpec((17,), "float32")
    return spec


def _pixel_spec() -> dict[str, mr.ArraySpec]:
    return {
        "obs": mr.ArraySpec((84, 84, 4), "uint8"),
        "next_obs": mr.ArraySpec((84, 84, 4), "uint8"),
        "action": mr.ArraySpec((), "int64"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }


def _nested_spec() -> dict[str, Any]:
    obs = {
        "camera": mr.ArraySpec((16, 16, 3), "uint8"),
        "joints": mr.ArraySpec((12,), "float32"),
        "goal": mr.ArraySpec((3,), "float32"),
    }
    return {
        "obs": dict(obs),
        "next_obs": dict(obs),
        "action": mr.ArraySpec((4,), "float32"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }


def flat_items(nest: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``(leaf path, leaf)`` pairs of a dict nest, keys sorted (mmreplay's flatten order)."""
    out = []
    for key in sorted(nest):
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(nest[key], dict):
            out.extend(flat_items(nest[key], path))
        else:
            out.append((path, nest[key]))
    return out


def nest_from_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`flat_items` for a dict of leaf paths."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


class ShapeRenderer:
    """Grey 84x84 frames of a few shapes moving and bouncing over a striped floor."""

    def __init__(self, num_envs: int, rng: np.random.Generator, size: int = 84, shapes: int = 3):
        self.size = size
        self.rng = rng
        yy, xx = np.mgrid[:size, :size]
        self.yy, self.xx = yy, xx
        floor = (40 + 20 * ((yy // 12) % 2)).astype(np.uint8)
        floor[size - 10 :] = 90
        self.floor = floor
        self.pos = rng.uniform(8, size - 8, (num_envs, shapes, 2))
        self.vel = rng.uniform(-3, 3, (num_envs, shapes, 2))
        self.radius = rng.integers(4, 10, (num_envs, shapes))
        self.shade = rng.integers(120, 255, (num_envs, shapes)).astype(np.uint8)
        self.kind = rng.integers(0, 2, (num_envs, shapes))

    def frame(self, env: int) -> np.ndarray:
        img = self.floor.copy()
        for j in range(self.pos.shape[1]):
            y, x = self.pos[env, j]
            r = int(self.radius[env, j])
            y0, y1 = max(0, int(y) - r), min(self.size, int(y) + r + 1)
            x0, x1 = max(0, int(x) - r), min(self.size, int(x) + r + 1)
            if self.kind[env, j]:
                img[y0:y1, x0:x1] = self.shade[env, j]
            else:
                box = (self.yy[y0:y1, x0:x1] - y) ** 2 + (self.xx[y0:y1, x0:x1] - x) ** 2 <= r * r
                img[y0:y1, x0:x1][box] = self.shade[env, j]
        return img

    def advance(self) -> None:
        self.pos += self.vel
        for axis in range(2):
            low, high = self.pos[..., axis] < 4, self.pos[..., axis] > self.size - 4
            self.vel[..., axis][low | high] *= -1
            np.clip(self.pos[..., axis], 4, self.size - 4, out=self.pos[..., axis])


@dataclass(frozen=True)
class Workload:
    """A spec, its number of envs and a deterministic generator of steps."""

    name: str
    spec: dict[str, Any]
    num_envs: int

    @property
    def leaves(self) -> list[tuple[str, mr.ArraySpec]]:
        return flat_items(self.spec)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one env of one step)."""
        return sum(s.nbytes for _, s in self.leaves)

    def steps(self, count: int, seed: int = 0) -> dict[str, np.ndarray]:
        """``count`` steps as leaf path -> ``[count, num_envs, *shape]``."""
        rng = np.random.default_rng(seed)
        if self.name == "pixels":
            return self._pixel_steps(count, rng)
        out: dict[str, np.ndarray] = {}
        shape = (count, self.num_envs)
        for path, s in self.leaves:
            if path.endswith("terminated"):
                out[path] = rng.random(shape) < 0.01
            elif path.endswith("truncated"):
                out[path] = rng.random(shape) < 0.001
            elif s.dtype == np.uint8:
                out[path] = rng.integers(0, 256, (*shape, *s.shape), dtype=np.uint8)
            elif s.dtype.kind == "f":
                out[path] = rng.standard_normal((*shape, *s.shape), dtype=np.float32).astype(s.dtype)
            else:
                out[path] = rng.integers(0, 18, (*shape, *s.shape)).astype(s.dtype)
        # next observation is the following step's observation, as a collector stores it
        for path, _ in self.leaves:
            if path.startswith("next_obs"):
                src = out["obs" + path[len("next_obs") :]]
                out[path][:-1] = src[1:]
        return out

    def _pixel_steps(self, count: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        e = self.num_envs
        render = ShapeRenderer(e, rng)
        frames = np.empty((count + 4, e, 84, 84), np.uint8)
        for t in range(count + 4):
            for env in range(e):
                frames[t, env] = render.frame(env)
            render.advance()
        # observation t stacks frames t..t+3 (channels last); next observation t+1..t+4
        stack = np.lib.stride_tricks.sliding_window_view(frames, 4, axis=0)  # [count+1, e, 84, 84, 4]
        return {
            "action": rng.integers(0, 18, (count, e)).astype(np.int64),
            "next_obs": np.ascontiguousarray(stack[1 : count + 1]),
            "obs": np.ascontiguousarray(stack[:count]),
            "reward": rng.standard_normal((count, e), dtype=np.float32),
            "terminated": rng.random((count, e)) < 0.01,
            "truncated": rng.random((count, e)) < 0.001,
        }


WORKLOADS = {
    "vector": Workload("vector", vector_spec(), 8),
    "pixels": Workload("pixels", _pixel_spec(), 8),
    "nested": Workload("nested", _nested_spec(), 8),
}
