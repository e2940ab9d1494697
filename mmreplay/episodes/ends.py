"""Where episodes end, read from the role leaves, and the ends a resuming writer marks.

Episode ends come from the role leaves (:mod:`mmreplay.roles`): ``terminated`` /
``truncated``; else TF-Agents ``next_step_type == LAST`` (terminated when ``discount`` is
0, truncated otherwise); else ``step_type == LAST`` when only ``step_type`` exists. With
both ``step_type`` and ``next_step_type``, a row with ``step_type == LAST`` is the
boundary row TF-Agents drivers write between episodes and belongs to no episode. Without
end roles each env's retained stream is one open episode.

A writer that reopens a store resumes collection: the episodes the last writer left
open cannot go on (its environments are gone), so before the first step it writes, the
last committed step of each env whose episode is still open is marked truncated
(:func:`open_ends`), whether the last writer was killed or closed cleanly; a writer ends
them on demand at its newest step with ``Store.end_episodes``. The mark is
the ``truncated`` leaf set, or for TF-Agents trajectories ``next_step_type`` set to
``LAST`` (with a non-zero ``discount``: a time limit). A store without such a leaf
(only ``terminated`` / ``done``, only ``step_type``, or no end roles) cannot say
"cut short" without inventing a terminal state, so nothing is marked there and the
resumed env's first episode continues the open one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from ..io import ByteSource
from ..metadata import Metadata, State
from ..read.readable import Readable
from .index_file import BOUNDARY, RECORD, TERMINATED, TRUNCATED

log = logging.getLogger(__name__)

LAST = 2  # TF-Agents StepType.LAST
SCAN_STEPS = 1 << 16  # steps read at a time when scanning the role leaves


class EpisodeSource(Readable, Protocol):
    """A store as the episode index reads it: the read path's view, the committed state
    and the roles that say where episodes end."""

    state: State  # the committed state (for a writer, its own newest commit)
    first_step: int
    roles: dict[str, str]
    leaf_paths: list[str]
    metadata: Metadata
    source: ByteSource  # where the episode index is read from


class EndRule:
    """Turns the role leaves' rows into end codes ``[n, num_envs]`` (0 where no end)."""

    def __init__(self, store: EpisodeSource):
        roles = store.roles
        index = {p: i for i, p in enumerate(store.leaf_paths)}
        self.capacity, self.num_envs = store.capacity, store.num_envs
        self.leaves: dict[str, Any] = {}
        if "terminated" in roles or "truncated" in roles:
            wanted = ("terminated", "truncated")
            self.kind = "flags"
        elif "next_step_type" in roles:
            wanted = ("next_step_type", "discount", "step_type")
            self.kind = "next_step_type"
        elif "step_type" in roles:
            wanted = ("step_type", "discount")
            self.kind = "step_type"
        else:
            self.kind = None
            return
        for role in wanted:
            if role in roles and roles[role] in index:
                self.leaves[role] = store.leaves[index[roles[role]]]

    def codes(self, slots: np.ndarray) -> np.ndarray:
        num_envs = self.num_envs
        v = {role: leaf.read(slots).reshape(len(slots), num_envs) for role, leaf in self.leaves.items()}
        out = np.zeros((len(slots), num_envs), np.uint8)
        if self.kind == "flags":
            if "truncated" in v:
                out[v["truncated"] != 0] = TRUNCATED
            if "terminated" in v:
                out[v["terminated"] != 0] = TERMINATED  # terminated wins over truncated
            return out
        last = v["next_step_type" if self.kind == "next_step_type" else "step_type"] == LAST
        if "discount" in v:
            out[last] = np.where(v["discount"][last] == 0, TERMINATED, TRUNCATED)
        else:
            out[last] = TERMINATED
        if self.kind == "next_step_type" and "step_type" in v:
            out[v["step_type"] == LAST] = BOUNDARY
        return out

    def records(self, steps: np.ndarray) -> np.ndarray:
        """End records of these (ascending) steps."""
        codes = self.codes(steps % self.capacity)
        t, e = np.nonzero(codes)
        rec = np.zeros(len(t), RECORD)
        rec["step"], rec["env"], rec["code"] = steps[t], e, codes[t, e]
        return rec

    def scan(self, lo: int, hi: int) -> Iterator[np.ndarray]:
        """End records of steps ``[lo, hi)``, a block of steps at a time so memory stays small."""
        for a in range(lo, hi, SCAN_STEPS):
            yield self.records(np.arange(a, min(hi, a + SCAN_STEPS), dtype=np.int64))


def open_ends(store: EpisodeSource, step: int, envs: Any = None) -> tuple[Any, np.ndarray, np.ndarray] | None:
    """How the episodes of ``envs`` (None: every env) open at ``step`` end (see the module
    docstring): ``(leaf, row, ended)``, the end leaf, its new row at ``step``
    ``[1, num_envs, *shape]`` and the envs it ends; None when none of them is open there,
    ``step`` is not retained, or the store has no leaf that marks a truncation."""
    if step < max(0, store.first_step):
        return None
    rule = EndRule(store)
    if rule.kind is None:
        return None
    slot = np.array([step % store.capacity])
    open_ = rule.codes(slot)[0] == 0
    if envs is not None:
        open_ &= np.isin(np.arange(store.num_envs), envs)
    if not open_.any():
        return None
    if rule.kind == "flags" and "truncated" in rule.leaves:
        leaf, value = rule.leaves["truncated"], 1
    elif rule.kind == "next_step_type" and "discount" in rule.leaves:
        leaf, value = rule.leaves["next_step_type"], LAST
        open_ &= rule.leaves["discount"].read(slot).reshape(store.num_envs) != 0
    else:
        leaf = None
    if leaf is None or not open_.any():
        log.info(
            "%s: envs %s end in an open episode that this store cannot mark truncated; the steps written "
            "next continue it", store.path, np.flatnonzero(open_).tolist(),
        )
        return None
    row = np.array(leaf.read(slot))
    row.reshape(1, store.num_envs, -1)[0, open_] = value
    return leaf, row, np.flatnonzero(open_)
