"""A group's shards read one after another as one store: what exports and statistics of a
whole group read.

The joined store's steps are shard 0's retained committed steps, then shard 1's, and
so on, numbered from 0 (a shard's step ``g`` is joined step ``offset + g - first``, with
``offset`` the steps of the shards before it and ``first`` the shard's oldest retained
step). Its envs are the shards' envs. Episodes never cross a shard: each is one shard's
episode of one env, with its step ids moved the same way. :attr:`JoinedShards.shards`
says where each shard's steps begin, and step-major exports record it.

The view holds no lock and copies nothing: it reads through the shards' own read paths
(readers' checks included), at the commits they had when the group was opened or last
refreshed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from .episodes import fresh_envs

__all__ = ["JoinedShards"]


class JoinedShards:
    """The shards of an open :class:`mmreplay.Group`, joined step-wise (see the module's
    docstring). Make one with :meth:`mmreplay.Group.joined`; it is valid while the group
    is open."""

    mode = "r"

    def __init__(self, group: Any):
        self.group = group
        self.path = group.path
        self._stores = group.shards
        self._firsts = np.array([store.first_step for store in self._stores], np.int64)
        self._ends = np.array([store.committed_steps for store in self._stores], np.int64)
        sizes = self._ends - self._firsts
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def shard_end(self, step: int) -> int:
        """The joined step after the last one of the shard holding ``step``: the step that
        follows it is another shard's, never the same env's next step."""
        k = int(np.searchsorted(self._offsets, step, side="right")) - 1
        return int(self._offsets[min(k + 1, len(self._offsets) - 1)])

    # --- what a store describes itself with ------------------------------------------

    @property
    def spec(self) -> Any:
        return self._stores[0].spec

    @property
    def roles(self) -> dict[str, str]:
        return self._stores[0].roles

    @property
    def attrs(self) -> dict[str, Any]:
        return self._stores[0].attrs

    @property
    def num_envs(self) -> int:
        return self._stores[0].num_envs

    @property
    def leaf_paths(self) -> list[str]:
        return self._stores[0].leaf_paths

    @property
    def leaves(self) -> list[Any]:
        """Shard 0's leaves, for what they describe (``info``); rows come from
        :meth:`read_steps`."""
        return self._stores[0].leaves

    @property
    def first_step(self) -> int:
        return 0

    @property
    def committed_steps(self) -> int:
        return int(self._offsets[-1])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def shards(self) -> list[dict[str, int]]:
        """Where each shard's steps are: ``shard``, ``first_step`` (joined id of its first
        step), ``steps``, and ``source_first_step`` (that step's id in the shard)."""
        return [
            {
                "shard": index,
                "first_step": int(self._offsets[index]),
                "steps": int(self._offsets[index + 1] - self._offsets[index]),
                "source_first_step": int(self._firsts[index]),
            }
            for index in range(len(self._stores))
        ]

    @property
    def export_info(self) -> dict[str, Any]:
        """What a step-major export records beyond one store's description: the shards'
        places, and the envs whose first episode starts whole (shard 0's)."""
        return {"shards": self.shards, "fresh_envs": fresh_envs(self._stores[0], int(self._firsts[0]))}

    # --- rows and episodes -----------------------------------------------------------

    def read_steps(self, steps: Any, leaves: list[int] | None = None) -> list[np.ndarray]:
        """Leaf arrays for joined step ids, as :meth:`mmreplay.Store.read_steps` gives them."""
        steps = np.asarray(steps, np.int64)
        flat = steps.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self._offsets[-1]):
            raise IndexError(
                f"{self.path}: joined steps are 0..{int(self._offsets[-1]) - 1}, got {int(flat.min())}..{int(flat.max())}"
            )
        shard = np.searchsorted(self._offsets, flat, side="right") - 1
        out: list[np.ndarray] | None = None
        for index in np.unique(shard).tolist():
            mine = np.flatnonzero(shard == index)
            local = flat[mine] - self._offsets[index] + self._firsts[index]
            part = self._stores[index].read_steps(local, leaves)
            if out is None:
                out = [np.empty((flat.size, *p.shape[1:]), p.dtype) for p in part]
            for o, p in zip(out, part):
                o[mine] = p
        if out is None:  # no steps: empty arrays of the right shape
            out = self._stores[0].read_steps(flat, leaves)
        return [o.reshape(steps.shape + o.shape[1:]) for o in out]

    def _moved(self, index: int, item: Any) -> Any:
        shift = int(self._offsets[index] - self._firsts[index])
        return dataclasses.replace(item, first_step=item.first_step + shift, last_step=item.last_step + shift)

    def episodes(self, env: int | None = None, complete_only: bool = False) -> Iterator[Any]:
        """Every shard's episodes in turn (env by env within a shard), step ids joined."""
        for index, store in enumerate(self._stores):
            for episode in store.episodes(env=env, complete_only=complete_only):
                yield self._moved(index, episode)

    def episode_index(self, env: int | None = None, complete_only: bool = False) -> list[Any]:
        """The spans of :meth:`episodes`, from the shards' episode indexes alone."""
        return [
            self._moved(index, span)
            for index, store in enumerate(self._stores)
            for span in store.episode_index(env=env, complete_only=complete_only)
        ]
