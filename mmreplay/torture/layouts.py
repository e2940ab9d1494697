"""What a torture trial draws: the buffer's layout, its shape and the writer's pace, the
endings of its writer runs and the moments their signals aim at."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..spec import flatten
from ..statefile import reserved_ahead
from .rows import FRAMES_SPEC, SPEC, frame_values, step_values

#: codec used for compressed layouts, per backend (both need no plugin)
CODECS = {"zarr": "zstd", "hdf5": "gzip"}

#: the moments a signal is aimed at: a random time, an add, a commit, a compressed
#: chunk's write, the ring's wrap, the store's close (``end``), just after a commit
KILL_TARGETS = ("time", "op", "commit", "chunk", "wrap", "end", "committed")
#: how a writer run ends (the package's docstring says each)
ENDINGS = ("kill", "sigint", "sigterm", "enospc", "thread")


@dataclass(frozen=True)
class Layout:
    """Backend, whether leaves are compressed (with ``codec``, else the backend's default
    in :data:`CODECS`; ``"rows"``: row frames, lz4 or zstd by trial), the number of envs,
    whether the store keeps each frame once (:data:`FRAMES_SPEC`, ``Frames(frame_stack=4)``),
    and its sampler (``"prioritized"`` keeps a priority file)."""

    backend: str
    compressed: bool
    num_envs: int
    codec: str | None = None
    frames: bool = False
    sampler: str | None = None

    def __str__(self) -> str:
        kind = (self.codec or "compressed") if self.compressed else "mapped"
        extra = ("-frames" if self.frames else "") + (f"-{self.sampler}" if self.sampler else "")
        return f"{self.backend}-{kind}-{self.num_envs}env{extra}"

    @property
    def spec(self) -> dict:
        return FRAMES_SPEC if self.frames else SPEC


LAYOUTS = tuple(Layout(b, c, n) for b in ("zarr", "hdf5") for c in (False, True) for n in (1, 8)) + (
    Layout("zarr", True, 3, "rows"),
    Layout("zarr", True, 2, "rows", frames=True),
    Layout("hdf5", False, 2, frames=True),
    Layout("zarr", False, 2, sampler="prioritized"),
)


@dataclass(frozen=True)
class TrialConfig:
    """One buffer's shape and the writer's pace, drawn at random per trial; ``endings``:
    how the ``kills`` writer runs before the last, clean one may end; ``moments``: when
    their signals may land (:data:`KILL_TARGETS`)."""

    layout: Layout
    capacity: int
    chunk_steps: int
    commit_every: int
    durability: str
    compression: Any  # None, a codec, or {leaf path: codec} (only pixels compressed)
    kills: int
    seed: int
    endings: tuple[str, ...] = ("kill",)
    moments: tuple[str, ...] = KILL_TARGETS

    @property
    def ahead(self) -> int:
        """How far past the steps it writes a writer may reserve slots (see Store)."""
        return reserved_ahead(self.capacity, self.commit_every)

    def describe(self) -> str:
        return (
            f"{self.layout} capacity={self.capacity} chunk_steps={self.chunk_steps} "
            f"commit_every={self.commit_every} compression={self.compression} "
            f"durability={self.durability} seed={self.seed}"
        )


def rows_of(layout: Layout, num_envs: int, steps: Any) -> list[np.ndarray]:
    """The rows of ``steps`` in ``layout``'s spec, flatten order."""
    if layout.frames:
        return frame_values(num_envs, steps)
    return step_values(flatten(SPEC), num_envs, steps)


def draw_config(
    rng: np.random.Generator,
    layout: Layout,
    kills: int,
    endings: Sequence[str] = ("kill",),
    moments: Sequence[str] = KILL_TARGETS,
) -> TrialConfig:
    """A trial of ``layout`` with a random capacity, chunking, commit cadence, durability
    and compression of all leaves or only the pixels."""
    capacity = int(rng.integers(8, 160))
    compression = None
    if layout.compressed:
        codec = layout.codec or CODECS[layout.backend]
        if codec == "rows":  # row frames: either codec
            codec = "rows:lz4" if rng.random() < 0.5 else "rows:zstd:1"
        pixels = "obs" if layout.frames else "obs/pixels"
        compression = codec if rng.random() < 0.6 else {pixels: codec}
    return TrialConfig(
        layout=layout,
        capacity=capacity,
        chunk_steps=int(rng.integers(1, max(2, capacity // 3))),
        commit_every=int(rng.choice([1, 2, 5, 16, 64, 1000])),
        durability="power" if rng.random() < 0.15 else "process",
        compression=compression,
        kills=kills,
        seed=int(rng.integers(1 << 62)),
        endings=tuple(endings),
        moments=tuple(moments),
    )
