"""The data every benchmark stores: vector, pixel and nested steps, made one way.

Pixel observations are Atari-like frame stacks (:mod:`bench.atari_like`), so codecs meet
the redundancy of real screens rather than noise, which no codec can shrink, or zeros,
which every codec shrinks without limit. Other leaves are seeded random numbers; done
flags are rare, as in training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

import mmreplay as mr

from .atari_like import STACK, rollout

__all__ = [
    "NUM_ENVS",
    "Workload",
    "WORKLOADS",
    "vector_spec",
    "pixel_spec",
    "steps",
    "flat_items",
    "nest_from_flat",
    "du",
    "contiguous",
]

NUM_ENVS = 8
FRAME_HWC, FRAME_CHW = (84, 84, STACK), (STACK, 84, 84)


def vector_spec(next_obs: bool = False, truncated: bool = True) -> dict[str, mr.ArraySpec]:
    """The MuJoCo-like vector step: obs float32[17], action float32[6], reward, done flags."""
    spec = {
        "obs": mr.ArraySpec((17,), "float32"),
        "action": mr.ArraySpec((6,), "float32"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
    }
    if truncated:
        spec["truncated"] = mr.ArraySpec((), "bool")
    if next_obs:
        spec["next_obs"] = mr.ArraySpec((17,), "float32")
    return spec


def pixel_spec(chw: bool = False, small_leaves: bool = True) -> dict[str, mr.ArraySpec]:
    """An Atari step: obs and next_obs uint8 stacks (HWC, or CHW as SB3's
    ``VecTransposeImage`` gives them), terminated, and action, reward, truncated."""
    frame = FRAME_CHW if chw else FRAME_HWC
    spec = {
        "obs": mr.ArraySpec(frame, "uint8"),
        "next_obs": mr.ArraySpec(frame, "uint8"),
        "terminated": mr.ArraySpec((), "bool"),
    }
    if small_leaves:
        spec |= {
            "action": mr.ArraySpec((), "int64"),
            "reward": mr.ArraySpec((), "float32"),
            "truncated": mr.ArraySpec((), "bool"),
        }
    return spec


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


def steps(spec: dict[str, Any], count: int, num_envs: int = NUM_ENVS, seed: int = 0) -> dict[str, np.ndarray]:
    """``count`` steps as leaf path -> ``[count, num_envs, *shape]``. Frame-stack leaves
    named ``obs`` / ``next_obs`` hold Atari-like stacks (``next_obs`` the following
    stack, ``terminated`` where their episodes end); the next observation of other leaves
    is the following step's observation, as a collector stores it."""
    rng = np.random.default_rng(seed)
    leaves = flat_items(spec)
    out: dict[str, np.ndarray] = {}
    shape = (count, num_envs)
    for path, s in leaves:
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
    stacks = [p for p, s in leaves if p in ("obs", "next_obs") and s.shape in (FRAME_HWC, FRAME_CHW)]
    if stacks:
        frames = rollout(count, num_envs, seed=seed)
        for path in stacks:
            hwc = frames[path]
            out[path] = (
                hwc if spec[path].shape == FRAME_HWC else np.ascontiguousarray(np.moveaxis(hwc, -1, 2))
            )
        if "terminated" in out:
            out["terminated"] = frames["terminated"]
    for path, _ in leaves:
        if path.startswith("next_obs") and path not in stacks:
            out[path][:-1] = out["obs" + path[len("next_obs") :]][1:]
    return out


@dataclass(frozen=True)
class Workload:
    """A spec and its number of envs."""

    name: str
    spec: dict[str, Any]
    num_envs: int = NUM_ENVS

    @property
    def leaves(self) -> list[tuple[str, mr.ArraySpec]]:
        return flat_items(self.spec)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one env of one step)."""
        return sum(s.nbytes for _, s in self.leaves)

    def steps(self, count: int, seed: int = 0) -> dict[str, np.ndarray]:
        return steps(self.spec, count, self.num_envs, seed)


WORKLOADS = {
    "vector": Workload("vector", vector_spec(next_obs=True)),
    "pixels": Workload("pixels", pixel_spec()),
    "nested": Workload("nested", _nested_spec()),
}


def du(path: str) -> int:
    """Bytes the files under ``path`` take on disk (allocated blocks, not apparent size)."""
    if os.path.isfile(path):
        return os.stat(path).st_blocks * 512
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)


def contiguous(batch: Any) -> Any:
    """``batch`` with every array, tensor or TensorDict in it made contiguous, as a model
    needs it (a copy only where it is not already): every system pays for its own layout."""
    if isinstance(batch, np.ndarray):
        return np.ascontiguousarray(batch)
    if hasattr(batch, "contiguous"):  # torch tensors and TensorDicts
        return batch.contiguous()
    if isinstance(batch, dict):
        return {k: contiguous(v) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return [contiguous(v) for v in batch]
    return batch
