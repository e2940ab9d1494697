"""What every backend's ``verify_leaves`` and ``repair`` share: a leaf's shape and bytes,
the committed window in slots and chunks, and the record of what a repair did (damaged
files are moved aside, never deleted)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..metadata import LeafInfo, Metadata
from ..statefile import slot_ranges

__all__ = ["Repairs", "retained_ranges", "chunks_of", "leaf_shape", "leaf_nbytes"]


def retained_ranges(meta: Metadata) -> list[tuple[int, int]]:
    """Slot ranges ``[a, b)`` holding the retained committed steps (at most two)."""
    return slot_ranges(meta.state.first(meta.capacity), meta.state.end, meta.capacity)


def chunks_of(meta: Metadata, leaf: LeafInfo) -> list[int]:
    """Chunk numbers along the step axis that hold retained committed steps."""
    cs = leaf.chunk_steps
    return sorted({k for a, b in retained_ranges(meta) for k in range(a // cs, (b - 1) // cs + 1)})


def leaf_shape(meta: Metadata, leaf: LeafInfo) -> tuple[int, ...]:
    return (meta.capacity, meta.num_envs, *leaf.spec.shape)


def leaf_nbytes(meta: Metadata, leaf: LeafInfo) -> int:
    return meta.capacity * meta.num_envs * leaf.spec.nbytes


@dataclass
class Repairs:
    """Where a repair works, the stamp of the files it moves aside, and what it did."""

    folder: str
    stamp: str
    actions: list[str] = field(default_factory=list)

    def move_aside(self, path: str) -> None:
        """Rename ``path`` (if it exists) to ``path.damaged-<stamp>``."""
        if os.path.lexists(path):
            dest = f"{path}.damaged-{self.stamp}"
            os.replace(path, dest)
            self.actions.append(
                f"moved {os.path.relpath(path, self.folder)} aside to {os.path.relpath(dest, self.folder)}"
            )

    def fresh_layout(self, meta: Metadata, create: Callable[..., list[LeafInfo]]) -> tuple[str, list[LeafInfo]]:
        """A fresh, empty copy of the data files (made by the backend's ``create``) in a
        temporary folder inside the buffer; the caller removes it."""
        tmp = os.path.join(self.folder, f".recover-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        bare = [replace(leaf, file=None, offset=None) for leaf in meta.leaves]
        return tmp, create(tmp, bare, meta.capacity, meta.num_envs)
