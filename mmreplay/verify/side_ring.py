"""The side ring of next frames of a store that keeps each frame once, checked and
repaired as leaves are (:mod:`mmreplay.frames`).

Its ``ref`` leaf holds each slot's sequence number and step; the rows of the committed
steps say what it must hold (their ``_frames/next`` leaf names each row's entry), so a
damaged ``ref`` is rebuilt from them and loses no step.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .. import backends
from ..backends.checks import Repairs
from ..errors import Error
from ..frames_layout import NEXT_LEAF, SIDE_DIR, create_side, only_ref, side_metadata, side_state
from ..io.local import LocalFolder
from ..lock import holder_pid
from ..metadata import Metadata, State, write_metadata

BLOCK_STEPS = 1 << 16  # steps of rows read at a time


def check_side_ring(folder: str, meta: Metadata, deep: bool, problems: list[str]) -> None:
    """The side ring of next frames of a store that keeps each frame once
    (:mod:`mmreplay.frames`), checked as the backend checks leaves: its sequence numbers
    (``ref``) first, then every leaf over the slots written so far (``deep``: their frames
    decode, and ``ref`` holds what the rows of the committed steps say it must)."""
    if meta.frames is None or not meta.frames.side:
        return
    side_folder = os.path.join(folder, SIDE_DIR)
    where = f"the side ring of next frames ({side_folder})"
    if not os.path.isdir(side_folder):
        problems.append(f"{where}: the folder is missing")
        return
    side = side_metadata(meta)
    module = backends.get(meta.backend)
    found: list[str] = []
    ref = _side_ref(module, side_folder, side, found)
    written = 0 if ref is None else int(ref[:, 0].max(initial=0))
    if not found and written:
        module.verify_leaves(side_folder, side.with_state(side_state(meta, written)), deep, found)
    # (the rows must read, and no live writer may change them or ``ref`` while they are compared)
    if ref is not None and deep and not found and not problems and holder_pid(folder) in (None, os.getpid()):
        state = meta.state
        want = _ref_from_rows(folder, meta, state.first(meta.capacity), state.end)
        found.extend(_ref_problems(ref, want, meta.capacity))
    problems.extend(f"{where}: {text}" for text in found)


def repair_side_ring(
    folder: str, meta: Metadata, first: int, end: int, stamp: str, actions: list[str]
) -> tuple[Metadata, list[tuple[int, str]]]:
    """Restore the side ring of next frames as the backend restores leaves (missing,
    truncated or undecodable files become zeros); returns the metadata (the side ring's
    leaves as placed now) and, for each damaged part that retained rows of steps
    ``[first, end)`` point into, the newest such step and why."""
    if meta.frames is None or not meta.frames.side:
        return meta, []
    module = backends.get(meta.backend)
    side_folder = os.path.join(folder, SIDE_DIR)
    side = side_metadata(meta)
    repairs = Repairs(folder, stamp)
    if not os.path.isdir(side_folder):
        repairs.move_aside(side_folder)  # (a file in its place)
        bare = [replace(leaf, file=None, offset=None) for leaf in side.leaves]
        side = replace(side, leaves=tuple(create_side(module, folder, meta, bare)))
        repairs.actions.append("recreated its missing folder, empty")
        damaged = [(0, side.capacity, "its folder was missing")]
    else:
        # the slots to check: every one written so far, by the sequence numbers when they
        # read, and at least up to the newest entry a retained row holds
        entries = _side_entries(folder, meta, first, end)
        in_rows = max((int(seqs.max(initial=0)) for _, seqs in entries), default=0)
        ref = _side_ref(module, side_folder, side, [])
        written = max(in_rows, 0 if ref is None else int(ref[:, 0].max(initial=0)))
        side, damaged = module.repair(side_folder, side.with_state(side_state(meta, written)), repairs)
    actions.extend(f"the side ring of next frames: {text}" for text in repairs.actions)
    if side.leaves != meta.frames.side:
        meta = replace(meta, frames=replace(meta.frames, side=side.leaves))
        write_metadata(folder, meta, fsync=True)
    # A damaged ``ref`` loses no frame: it is rebuilt below from the rows that point into
    # the ring (the backends name the leaf a damaged range is in: "leaf 'ref': ...").
    ref_damaged = any(why.startswith("leaf 'ref':") for _, _, why in damaged)
    damaged = [(a, b, why) for a, b, why in damaged if not why.startswith("leaf 'ref':")]
    newest = [-1] * len(damaged)
    for steps, seqs in _side_entries(folder, meta, first, end):
        slots = (seqs - 1) % side.capacity
        for i, (a, b, _) in enumerate(damaged):
            hit = np.flatnonzero(((seqs > 0) & (slots >= a) & (slots < b)).any(axis=1))
            if len(hit):
                newest[i] = max(newest[i], int(steps[hit[-1]]))
    why_lost = [f"the side ring of next frames: {why}" for _, _, why in damaged]
    hits = [(step, why) for step, why in zip(newest, why_lost) if step >= 0]
    want = _ref_from_rows(folder, meta, first, end)
    if want.lost >= 0:
        hits.append((want.lost, f"the side ring of next frames: {want.why_lost}"))
    kept = max([first] + [step + 1 for step, _ in hits])
    if kept > first:  # the entries of the steps dropped are needed no more
        want = _ref_from_rows(folder, meta, kept, end)
    ref = _side_ref(module, side_folder, side, [])
    if ref_damaged or ref is None or _ref_problems(ref, want, meta.capacity):
        _write_ref(module, side_folder, side, want.ref)
        actions.append(
            f"the side ring of next frames: rebuilt its ref leaf (sequence numbers and steps) from the rows of "
            f"committed steps [{kept}, {end}): {int(want.needed.sum())} entries"
        )
    return meta, hits


def _side_ref(module: Any, side_folder: str, side: Metadata, found: list[str]) -> np.ndarray | None:
    """The side ring's ``ref`` leaf ``[slots, 2]`` once the side ring's files pass the
    structural checks; None when they do not (what is wrong goes to ``found``)."""
    module.verify_leaves(side_folder, side.with_state(State()), False, found)
    if found:
        return None
    try:
        (leaf,) = module.open_leaves(LocalFolder(side_folder), only_ref(side), False)
    except Error as exc:
        found.append(f"does not open: {exc}")
        return None
    with contextlib.closing(leaf):
        return np.array(leaf.read(slice(None))).reshape(-1, 2)


def _write_ref(module: Any, side_folder: str, side: Metadata, ref: np.ndarray) -> None:
    (leaf,) = module.open_leaves(LocalFolder(side_folder), only_ref(side), True)
    with contextlib.closing(leaf):
        leaf.write_slots(np.arange(len(ref)), ref[:, None])
        leaf.flush(True)


@dataclass
class _RefFromRows:
    """The side ring's ``ref`` as the rows of steps ``[first, end)`` give it.

    A row's ``_frames/next`` holds ``n``, its entry's sequence number + 1 (0: none); the
    entry is in slot ``(n - 1) % final_slots``, where ``ref`` holds ``(n, step)``. Two rows that name the same slot cannot both have their frame in it: only
    the newest entry written there can, so the older ones are ``lost`` (the newest step
    among them, -1: none), as are both of two rows that name the same entry.
    """

    first: int
    end: int
    ref: np.ndarray  # [slots, 2]: the entries the rows need, zeros in the slots none needs
    needed: np.ndarray  # [slots] bool: a row needs the slot
    lost: int

    @property
    def why_lost(self) -> str:
        return f"rows of committed steps up to {self.lost} name side entries that other rows' entries replaced"


def _ref_from_rows(folder: str, meta: Metadata, first: int, end: int) -> _RefFromRows:
    slots = meta.frames.final_slots
    seqs, steps = [], []
    for block_steps, block in _side_entries(folder, meta, first, end):
        t, e = np.nonzero(block > 0)
        seqs.append(block[t, e])
        steps.append(block_steps[t])
    seq = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
    step = np.concatenate(steps) if steps else np.zeros(0, np.int64)
    slot = (seq - 1) % slots
    order = np.lexsort((seq, slot))  # by slot, the newest entry last
    seq, step, slot = seq[order], step[order], slot[order]
    newest = np.ones(len(seq), bool)
    newest[:-1] = slot[1:] != slot[:-1]
    lost = ~newest
    lost[1:] |= newest[1:] & ~newest[:-1] & (seq[1:] == seq[:-1])  # one entry named by two rows
    ref = np.zeros((slots, 2), np.int64)
    keep = newest & ~lost
    ref[slot[keep], 0] = seq[keep]
    ref[slot[keep], 1] = step[keep]
    needed = np.zeros(slots, bool)
    needed[slot[keep]] = True
    return _RefFromRows(first, end, ref, needed, int(step[lost].max(initial=-1)))


def _ref_problems(ref: np.ndarray, want: _RefFromRows, capacity: int) -> list[str]:
    """Where the side ring's ``ref`` disagrees with the rows of the committed steps: an
    entry a row needs that it does not hold, or an entry no row needs that no writer
    can have written (its slot is not its sequence number's, it is older than a lap of
    the ring, or its step is one no writer reached: a writer writes a step only once a
    commit reserved it, at most a ring's ``capacity`` past that commit's end, and ends
    only grow)."""
    slots = len(ref)
    seq, step = ref[:, 0], ref[:, 1]
    newest = int(seq.max(initial=0))
    sound = np.where(
        seq > 0,
        ((seq - 1) % slots == np.arange(slots)) & (seq > newest - slots) & (step >= 0)
        & (step <= want.end + capacity),
        (seq == 0) & (step == 0),
    )
    bad = ~sound & ~want.needed
    differ = want.needed & (ref != want.ref).any(axis=1)
    out = []
    if differ.any():
        i = int(np.flatnonzero(differ)[0])
        out.append(
            f"ref: {int(differ.sum())} entries disagree with the rows of committed steps [{want.first}, {want.end}) "
            f"(slot {i} holds (sequence {int(seq[i])}, step {int(step[i])}), the row of step "
            f"{int(want.ref[i, 1])} needs (sequence {int(want.ref[i, 0])}, step {int(want.ref[i, 1])})); "
            "`mmreplay recover` rebuilds it from the rows"
        )
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        out.append(
            f"ref: {int(bad.sum())} entries no writer can have written (slot {i} holds "
            f"(sequence {int(seq[i])}, step {int(step[i])})); `mmreplay recover` rebuilds it from the rows"
        )
    if want.lost >= 0:
        out.append(want.why_lost)
    return out


def _side_entries(folder: str, meta: Metadata, first: int, end: int) -> Any:
    """``(steps, side entries [n, num_envs])`` of steps ``[first, end)``, in blocks, from
    the rows' ``_frames/next`` leaf (sequence number + 1 of each row's entry, 0: none)."""
    if end <= first:
        return
    leaves = backends.get(meta.backend).open_leaves(LocalFolder(folder), meta, False)
    try:
        leaf = next(leaf for leaf in leaves if getattr(leaf, "info", None) and leaf.info.path == NEXT_LEAF)
        for a in range(first, end, BLOCK_STEPS):
            steps = np.arange(a, min(end, a + BLOCK_STEPS), dtype=np.int64)
            yield steps, np.asarray(leaf.read(steps % meta.capacity)).reshape(len(steps), -1)
    finally:
        for leaf in leaves:
            leaf.close()
