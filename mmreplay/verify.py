"""Checking a buffer's files against its metadata, and bringing a damaged one back.

:func:`verify` lists every problem it finds (an empty list means healthy): metadata that
does not parse, data files missing or of the wrong size, arrays whose shape, dtype,
chunking or compression differ from the metadata, a zarr shard index that no longer
points at the mapped block, chunks of committed steps that are missing or do not decode (an HDF5 chunk that a
killed writer tore is fine while the chunk journal holds it: the next writer writes it
back), a damaged chunk journal, an HDF5 file left marked open by a writer that died, an
episode index that disagrees with the data.

:func:`recover` brings a damaged buffer back to its last consistent commit where that
is possible. Rows cannot be rebuilt, so the recovered buffer keeps the newest committed
steps whose rows are all intact and drops the older ones (a buffer's committed steps are
one contiguous window); it says which steps it dropped and why. The side ring of next
frames of a store that keeps each frame once is checked and repaired as leaves are: the
steps whose next frames were in its damaged part are dropped. Its ``ref`` leaf (each
slot's sequence number and step) is rebuilt from the rows that point into the ring, so
damage to it alone loses no step. Damaged files are moved aside (``*.damaged-<time>``),
never deleted.

Both read the buffer as untrusted input: the metadata is validated before any file is
opened, and no code in the folder is ever executed.

Each backend checks and repairs its own data files (``verify_leaves`` and ``repair`` in
:mod:`mmreplay.backends.zarr_v3` and :mod:`mmreplay.backends.hdf5`); this module holds
what is common: the metadata and the state file, the episode index, leftovers, the
report, and the order of the work.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from . import backends
from .backends.checks import Repairs
from .backends.hdf5 import hdf5_status
from .errors import CorruptBufferError, Error, NotABufferError, UnsupportedFormatError
from .io.local import LocalFolder, read_inside, unsafe_entries
from .lock import WriterLock, holder_pid
from .metadata import (
    METADATA_FILE,
    STATE_FILE,
    Metadata,
    State,
    migrate,
    parse_metadata,
    read_metadata,
    read_static,
    write_buffer,
    write_metadata,
)
from .priorities import check_priority_file, reset_priority_file
from .statefile import FILE_BYTES, StateFile, decode_slot, salvage

__all__ = ["verify", "checked", "recover", "Recovery", "leftovers", "hdf5_status"]

BLOCK_STEPS = 1 << 16  # steps read at a time where a check reads a leaf over the committed window


# --- verify -------------------------------------------------------------------------


def verify(path: str | os.PathLike, deep: bool = True) -> list[str]:
    """Problems found in the buffer at ``path``; an empty list means it is healthy.

    Args:
        path: the buffer folder.
        deep: also decode every stored chunk of the committed steps (reads the
            compressed data once); without it only structure and sizes are checked.

    Raises:
        ImportError: a codec the data needs is missing (chunks that cannot be decoded
            for that reason are not damage), naming the extra to install.

    Example:
        >>> import mmreplay as mr, tempfile
        >>> from mmreplay.verify import verify
        >>> p = tempfile.mkdtemp() + "/b"
        >>> mr.create(p, {"x": mr.ArraySpec((), "int64")}, 10).close()
        >>> verify(p)
        []
    """
    folder = os.fspath(path)
    unsafe = unsafe_entries(folder)
    if unsafe:  # nothing is opened in a folder holding what mmreplay must not open
        return unsafe
    try:
        meta = read_metadata(folder)
    except NotABufferError as exc:
        return [str(exc)]
    except Error as exc:
        return [str(exc)]
    problems: list[str] = []
    _check_state_file(folder, meta, problems)
    backends.get(meta.backend).verify_leaves(folder, meta, deep, problems)
    _check_side_ring(folder, meta, deep, problems)
    _check_episodes(folder, meta, deep, problems)
    problems.extend(check_priority_file(folder, meta))
    if not problems:
        problems.extend(_check_opens(folder))
    return problems


def checked(path: str | os.PathLike, deep: bool = True) -> list[str]:
    """What :func:`verify` checks of the buffer at ``path``, per kind of leaf, and what no
    check can find there: a row that holds another step's bytes is found only where the
    layout records something of it (a chunk or row that was never stored, a checksum, the
    side ring's step numbers); [] when the metadata does not read."""
    from .backends.row_codec import is_row_compression

    try:
        meta = read_metadata(os.fspath(path))
    except Error:
        return []

    def names(leaves: list[Any]) -> str:
        return ", ".join(repr(leaf.path) for leaf in leaves)

    mapped = [leaf for leaf in meta.leaves if leaf.mapped]
    rows = [leaf for leaf in meta.leaves if is_row_compression(leaf.compression)]
    chunked = [leaf for leaf in meta.leaves if not leaf.mapped and leaf not in rows]
    out = ["the metadata, both state slots, and every data file: there, a regular file, of its size"]
    if chunked:
        out.append(
            f"chunk-compressed leaves {names(chunked)}: every chunk holding committed steps was stored"
            + (", decodes and passes its checksum" if deep else " (--quick: not decoded)")
            + "; a chunk that still holds an earlier lap's rows decodes as well, and is not found"
        )
    if rows:
        out.append(
            f"row-frame leaves {names(rows)}: every committed row is in the staging segment or in its "
            "segment's shard index (CRC-32C)"
            + (", and its frame decodes (zstd: with its checksum)" if deep else " (--quick: frames not decoded)")
            + "; a frame of an earlier lap is not found"
        )
    if mapped:
        out.append(
            f"memory-mapped leaves {names(mapped)}: size and place only: their rows carry no checksum or step, "
            "so a row holding another step's bytes is not found"
        )
    if meta.frames is not None and meta.frames.side:
        out.append("the side ring of next frames: its files, and (deep) its step numbers against the committed rows")
    if deep:
        out.append("the episode index against the role leaves of the committed steps")
    if meta.sampler and meta.sampler.get("name") == "prioritized":
        out.append("the priority file: its header and size")
    return out


def _check_state_file(folder: str, meta: Metadata, problems: list[str]) -> None:
    """Both slots of a format-2 state file must be valid (one may be torn only by a crash
    of the machine mid-commit: the other then holds the committed state)."""
    if meta.format_version < 2:
        return
    path = os.path.join(folder, STATE_FILE)
    with open(path, "rb") as f:
        raw = f.read(FILE_BYTES + 1)
    if len(raw) != FILE_BYTES:
        problems.append(f"{path}: {len(raw)} bytes, a state file has {FILE_BYTES}")
    for index in (0, 1):
        slot = decode_slot(raw, index)
        if isinstance(slot, str):
            problems.append(
                f"{path}: state slot {index} is damaged ({slot}); the other slot holds the committed "
                "state, and the next commit or `mmreplay recover` rewrites this one"
            )


def _check_side_ring(folder: str, meta: Metadata, deep: bool, problems: list[str]) -> None:
    """The side ring of next frames of a store that keeps each frame once
    (:mod:`mmreplay.frames`), checked as the backend checks leaves: its sequence numbers
    (``ref``) first, then every leaf over the slots written so far (``deep``: their frames
    decode, and ``ref`` holds what the rows of the committed steps say it must)."""
    from . import frames_layout as frames

    if meta.frames is None or not meta.frames.side:
        return
    side_folder = os.path.join(folder, frames.SIDE_DIR)
    where = f"the side ring of next frames ({side_folder})"
    if not os.path.isdir(side_folder):
        problems.append(f"{where}: the folder is missing")
        return
    side = frames.side_metadata(meta)
    module = backends.get(meta.backend)
    found: list[str] = []
    ref = _side_ref(module, side_folder, side, found)
    written = 0 if ref is None else int(ref[:, 0].max(initial=0))
    if not found and written:
        module.verify_leaves(side_folder, side.with_state(_side_state(meta, written)), deep, found)
    # (the rows must read, and no live writer may change them or ``ref`` while they are compared)
    if ref is not None and deep and not found and not problems and holder_pid(folder) in (None, os.getpid()):
        state = meta.state
        want = _ref_from_rows(folder, meta, state.first(meta.capacity), state.end)
        found.extend(_ref_problems(ref, want, meta.capacity))
    problems.extend(f"{where}: {text}" for text in found)


def _side_ref(module: Any, side_folder: str, side: Metadata, found: list[str]) -> np.ndarray | None:
    """The side ring's ``ref`` leaf ``[slots, 2]`` once the side ring's files pass the
    structural checks; None when they do not (what is wrong goes to ``found``)."""
    module.verify_leaves(side_folder, side.with_state(State()), False, found)
    if found:
        return None
    try:
        (leaf,) = module.open_leaves(LocalFolder(side_folder), _only_ref(side), False)
    except Error as exc:
        found.append(f"does not open: {exc}")
        return None
    try:
        return np.array(leaf.read(slice(None))).reshape(-1, 2)
    finally:
        leaf.close()


def _only_ref(side: Metadata) -> Metadata:
    """The side ring's metadata with its ``ref`` leaf alone (always uncompressed, mapped)."""
    return replace(side, leaves=tuple(leaf for leaf in side.leaves if leaf.path == "ref"))


def _write_ref(module: Any, side_folder: str, side: Metadata, ref: np.ndarray) -> None:
    (leaf,) = module.open_leaves(LocalFolder(side_folder), _only_ref(side), True)
    try:
        leaf.write_slots(np.arange(len(ref)), ref[:, None])
        leaf.flush(True)
    finally:
        leaf.close()


def _side_state(meta: Metadata, written: int) -> State:
    """The side ring's slots written so far, as a committed window of the side ring."""
    slots = meta.frames.final_slots
    return State(start=max(0, written - slots), end=written, reserved=written)


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


def _check_opens(folder: str) -> list[str]:
    """Whatever the structural checks missed, the store itself must open for reading."""
    from .store import open as open_store

    try:
        open_store(folder, "r").close()
    except Error as exc:
        return [f"the buffer does not open: {exc}"]
    return []


def newest_in_slots(first: int, end: int, capacity: int, a: int, b: int) -> int | None:
    """The newest step of ``[first, end)`` whose slot is in ``[a, b)``, or None."""
    if end <= first or a >= b:
        return None
    top = (end - 1 - a) // capacity
    for lap in (top, top - 1):
        lo, hi = max(first, lap * capacity + a), min(end, lap * capacity + b)
        if lap >= 0 and lo < hi:
            return hi - 1
    return None


# --- episodes ------------------------------------------------------------------------------


def _check_episodes(folder: str, meta: Metadata, deep: bool, problems: list[str]) -> None:
    """The episode index file, where there is one, must be well formed and (``deep``)
    hold exactly the episode ends the role leaves give for the committed steps it covers.

    Records at or past the committed cursor are a killed writer's and are ignored (the
    next writer cuts them off); a damaged index is rebuilt from the role leaves once it
    is removed, which :func:`recover` does.
    """
    from .episodes import HEADER_BYTES, INDEX_FILE, MAGIC, RECORD, index_limit

    path = os.path.join(folder, INDEX_FILE)
    try:
        raw = read_inside(folder, INDEX_FILE, index_limit(meta.capacity, meta.num_envs), "an episode index")
    except FileNotFoundError:
        return
    except CorruptBufferError as exc:
        problems.append(str(exc))
        return
    where = f"episode index {path}"
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        problems.append(f"{where}: not an episode index (bad header)")
        return
    origin = int(np.frombuffer(raw, "<i8", 1, 8)[0])
    rec = np.frombuffer(raw, RECORD, (len(raw) - HEADER_BYTES) // RECORD.itemsize, HEADER_BYTES)
    rec = rec[rec["step"] < meta.state.end]
    steps = rec["step"]
    bad = []
    if origin < 0:
        bad.append(f"origin {origin} is negative")
    if len(rec) and (np.any(steps[1:] < steps[:-1]) or steps[0] < origin - 1):
        bad.append("records are out of step order")
    if np.any((rec["env"] < 0) | (rec["env"] >= meta.num_envs)):
        bad.append(f"records name envs outside [0, {meta.num_envs})")
    if np.any((rec["code"] < 1) | (rec["code"] > 3)):
        bad.append("records hold unknown end codes")
    if bad:
        problems.append(f"{where}: " + "; ".join(bad))
        return
    if not deep or problems or holder_pid(folder) not in (None, os.getpid()):
        return  # (a live writer may overwrite the rows being compared)
    from .episodes import EndRule
    from .store import open as open_store

    try:
        store = open_store(folder, "r")
    except Error:
        return  # the other checks say why
    try:
        rule = EndRule(store)
        lo = max(origin, store.first_step)
        hi = min(store.committed_steps, meta.state.end)
        if rule.kind is None or hi <= lo:
            return
        mine = rec[(rec["step"] >= lo) & (rec["step"] < hi)]
        mine = mine[np.lexsort((mine["env"], mine["step"]))]
        done = 0  # records of mine compared so far
        for a in range(lo, hi, BLOCK_STEPS):  # bounded memory however long the window
            ids = np.arange(a, min(hi, a + BLOCK_STEPS), dtype=np.int64)
            codes = rule.codes(ids % store.capacity, store.num_envs)
            t, e = np.nonzero(codes)
            part = mine[done : done + len(t)]
            done += len(t)
            if not (
                len(part) == len(t)
                and np.array_equal(part["step"], ids[t])
                and np.array_equal(part["env"], e)
                and np.array_equal(part["code"], codes[t, e])
            ):
                problems.append(
                    f"{where}: its episode ends for steps [{lo}, {hi}) disagree with the role leaves"
                )
                return
        if done != len(mine):
            problems.append(f"{where}: it holds episode ends the role leaves do not give in [{lo}, {hi})")
    except Error as exc:
        problems.append(f"{where}: the role leaves cannot be read to check it: {exc}")
    finally:
        store.close()


# --- leftovers -----------------------------------------------------------------------------


def leftovers(path: str | os.PathLike) -> list[str]:
    """Files a killed writer may leave behind, harmless but untidy (temp state, zarr partials)."""
    folder = os.fspath(path)
    out = glob.glob(os.path.join(glob.escape(folder), METADATA_FILE + ".*.tmp"))
    out += glob.glob(os.path.join(glob.escape(folder), STATE_FILE + ".*.tmp"))
    out += glob.glob(os.path.join(glob.escape(folder), "episodes.idx.*.tmp"))
    for name in backends.importable():
        out += backends.get(name).leftover_files(folder)
    return sorted(out)


# --- recover -------------------------------------------------------------------------------


@dataclass
class Recovery:
    """What :func:`recover` did.

    ``lost`` is the committed window it dropped ``(first, end)`` (None when nothing was
    lost); ``kept`` the committed window the buffer holds now; ``actions`` each change
    made, in order; ``problems`` what :func:`verify` still finds afterwards.
    """

    path: str
    actions: list[str] = field(default_factory=list)
    lost: tuple[int, int] | None = None
    kept: tuple[int, int] | None = None
    reasons: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = []
        if self.lost is not None:
            a, b = self.lost
            lines.append(f"lost committed steps [{a}, {b}) ({b - a} steps): " + "; ".join(self.reasons))
        else:
            lines.append("no committed step was lost")
        if self.kept is not None:
            a, b = self.kept
            lines.append(f"kept committed steps [{a}, {b}) ({b - a} steps)")
        lines.extend(f"- {a}" for a in self.actions)
        if self.problems:
            lines.append("still damaged:")
            lines.extend(f"- {p}" for p in self.problems)
        return "\n".join(lines)


def recover(path: str | os.PathLike) -> Recovery:
    """Bring a damaged buffer back to its last consistent commit, where that is possible.

    Holds the writer lock while it works, so it refuses a buffer a live writer holds.
    It clears the HDF5 "open for writing" flags a dead writer left, rewrites a damaged
    zarr shard index, restores missing or truncated data files and undecodable chunks
    (as zeros), drops from the committed window every step whose rows were damaged (and
    the older ones, so the window stays contiguous), repairs the side ring of next frames
    of a store that keeps each frame once the same way (dropping the steps whose next
    frames were in its damaged part; its sequence numbers are rebuilt from the rows),
    removes a killed writer's temporary
    files, and rebuilds damaged metadata from a killed commit's complete temporary copy,
    else from the damaged file itself when it still parses and agrees with the data
    files; the committed window of either cannot be trusted, so all its steps are
    dropped and the buffer goes on empty with the same layout.

    Raises:
        NotABufferError: nothing at ``path`` looks like a buffer.
        LockedError: a live writer holds the buffer.
        ReadOnlyError: the buffer is on a read-only file system.
        UnsupportedFormatError: a newer mmreplay wrote it (it is left alone).
        CorruptBufferError: the metadata is damaged and nothing trustworthy is left to
            rebuild it from (the files are left as they are).
        ImportError: a codec the data needs is missing (``pip install
            'mmreplay[hdf5plugin]'``); nothing was changed.

    Example:
        >>> import mmreplay as mr, tempfile
        >>> from mmreplay.verify import recover
        >>> p = tempfile.mkdtemp() + "/b"
        >>> mr.create(p, {"x": mr.ArraySpec((), "int64")}, 10).close()
        >>> print(recover(p))
        no committed step was lost
        kept committed steps [0, 0) (0 steps)
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise NotABufferError(f"{folder}: no such folder")
    if not os.path.exists(os.path.join(folder, METADATA_FILE)) and not _tmp_copies(folder):
        raise NotABufferError(f"{folder}: not an mmreplay buffer (no {METADATA_FILE})")
    unsafe = unsafe_entries(folder)
    if unsafe:
        more = f" (and {len(unsafe) - 1} more)" if len(unsafe) > 1 else ""
        raise CorruptBufferError(f"{unsafe[0]}{more}; recover changes nothing in a folder holding such files")
    lock = WriterLock(folder)
    lock.acquire()
    try:
        return _recover(folder)
    finally:
        lock.release()


def _tmp_copies(folder: str) -> list[str]:
    return glob.glob(os.path.join(glob.escape(folder), METADATA_FILE + ".*.tmp"))


def _recover(folder: str) -> Recovery:
    from .frames_layout import SIDE_DIR

    out = Recovery(folder)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in backends.importable():  # (the metadata may be the damage: ask every backend)
        # chunks that do not decode for want of a codec are no damage: stop before any change
        for where in (folder, os.path.join(folder, SIDE_DIR)):
            backends.get(name).require_codecs(where)
    repairs = Repairs(folder, stamp, out.actions)
    meta: Metadata | None = None
    try:
        meta = read_metadata(folder)
    except UnsupportedFormatError:
        raise  # a newer mmreplay wrote it: leave it alone
    except NotABufferError:
        why = f"{METADATA_FILE} is missing"
    except Error as exc:
        why = str(exc)
        try:
            static = read_static(folder)
        except Error:
            static = None
        if static is not None and static.format_version >= 2:  # the JSON is sound: the state is not
            meta = _rebuild_state(folder, static, out, why, repairs)
    if meta is None:
        meta = _rebuild_metadata(folder, out, why, stamp)
    _check_room(folder, meta)
    if meta.format_version == 1:  # recover writes as a writer does: in format 2
        meta = migrate(folder, meta, fsync=True)
        out.actions.append(f"upgraded the buffer to format 2 (the committed state moved to {STATE_FILE})")
    else:
        meta = _rewrite_damaged_slot(folder, meta, out)
    first, end = meta.state.first(meta.capacity), meta.state.end
    drop_before = first  # every step before this is dropped
    # slot ranges [a, b) whose rows are gone
    placed = meta.leaves
    meta, damaged_slots = backends.get(meta.backend).repair(folder, meta, repairs)
    if meta.leaves != placed:
        write_metadata(folder, meta, fsync=True)
    for a, b, why in damaged_slots:
        hit = newest_in_slots(first, end, meta.capacity, a, b)
        if hit is not None:
            drop_before = max(drop_before, hit + 1)
            out.reasons.append(why)
    meta, side_hits = _repair_side_ring(folder, meta, drop_before, end, stamp, out.actions)
    for hit, why in side_hits:
        drop_before = max(drop_before, hit + 1)
        out.reasons.append(why)
    if drop_before > first:
        out.lost = (first, drop_before)
        state = meta.state
        meta = meta.with_state(
            state.next(start=max(state.start, drop_before), commits=state.commits + 1, commit_time=time.time())
        )
        _write_state(folder, meta.state)
        out.actions.append(f"committed state now starts at step {drop_before}")
    out.kept = (meta.state.first(meta.capacity), meta.state.end)
    episode_problems: list[str] = []
    _check_episodes(folder, meta, True, episode_problems)
    if episode_problems:
        from .episodes import INDEX_FILE

        repairs.move_aside(os.path.join(folder, INDEX_FILE))
        out.actions.append("the episode index is rebuilt from the role leaves when the buffer is next opened")
    reset = reset_priority_file(folder, meta)
    if reset is not None:
        out.actions.append(reset)
    for extra in leftovers(folder):
        os.unlink(extra)
        out.actions.append(f"removed {os.path.relpath(extra, folder)} (left by a killed writer)")
    out.problems = verify(folder)
    return out


def _check_room(folder: str, meta: Metadata) -> None:
    """Refuse metadata whose uncompressed leaves take more bytes than the data files hold
    and the file system has free: restoring them would allocate whatever a damaged (or
    crafted) capacity or shape asks for."""
    from .frames_layout import SIDE_DIR, side_metadata

    parts = [(folder, meta)]
    if meta.frames is not None and meta.frames.side:
        parts.append((os.path.join(folder, SIDE_DIR), side_metadata(meta)))
    need = have = 0
    for where, part in parts:
        need += sum(part.capacity * part.num_envs * leaf.spec.nbytes for leaf in part.leaves if leaf.compression is None)
        have += sum(os.path.getsize(p) for p in set(backends.get(part.backend).data_paths(where, part)) if os.path.isfile(p))
    free = shutil.disk_usage(folder).free
    if need > have + free:
        raise CorruptBufferError(
            f"{os.path.join(folder, METADATA_FILE)}: its uncompressed leaves take {need} bytes "
            f"({meta.capacity} steps x {meta.num_envs} envs), more than the {have} its data files hold and the "
            f"{free} free on the file system together: the metadata is not this buffer's (or the disk is too "
            "full to restore it); recover changes nothing"
        )


def _repair_side_ring(
    folder: str, meta: Metadata, first: int, end: int, stamp: str, actions: list[str]
) -> tuple[Metadata, list[tuple[int, str]]]:
    """Restore the side ring of next frames as the backend restores leaves (missing,
    truncated or undecodable files become zeros); returns the metadata (the side ring's
    leaves as placed now) and, for each damaged part that retained rows of steps
    ``[first, end)`` point into, the newest such step and why."""
    from . import frames_layout as frames

    if meta.frames is None or not meta.frames.side:
        return meta, []
    module = backends.get(meta.backend)
    side_folder = os.path.join(folder, frames.SIDE_DIR)
    side = frames.side_metadata(meta)
    repairs = Repairs(folder, stamp)
    if not os.path.isdir(side_folder):
        repairs.move_aside(side_folder)  # (a file in its place)
        bare = [replace(leaf, file=None, offset=None) for leaf in side.leaves]
        side = replace(side, leaves=tuple(frames.create_side(module, folder, meta, bare)))
        repairs.actions.append("recreated its missing folder, empty")
        damaged = [(0, side.capacity, "its folder was missing")]
    else:
        # the slots to check: every one written so far, by the sequence numbers when they
        # read, and at least up to the newest entry a retained row holds
        entries = _side_entries(folder, meta, first, end)
        in_rows = max((int(seqs.max(initial=0)) for _, seqs in entries), default=0)
        ref = _side_ref(module, side_folder, side, [])
        written = max(in_rows, 0 if ref is None else int(ref[:, 0].max(initial=0)))
        side, damaged = module.repair(side_folder, side.with_state(_side_state(meta, written)), repairs)
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


def _side_entries(folder: str, meta: Metadata, first: int, end: int) -> Any:
    """``(steps, side entries [n, num_envs])`` of steps ``[first, end)``, in blocks, from
    the rows' ``_frames/next`` leaf (sequence number + 1 of each row's entry, 0: none)."""
    from .frames_layout import NEXT_LEAF

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


def _write_state(folder: str, state: State) -> None:
    """Commit ``state`` as a writer does (its slot, then to the disk)."""
    state_file = StateFile(folder, True)
    try:
        state_file.write(state, fsync=True)
    finally:
        state_file.close()


def _rewrite_damaged_slot(folder: str, meta: Metadata, out: Recovery) -> Metadata:
    """A state slot that fails its check while the other holds the committed state gets
    that state again, one generation on: nothing is lost."""
    with open(os.path.join(folder, STATE_FILE), "rb") as f:
        raw = f.read(FILE_BYTES)
    bad = [i for i in (0, 1) if isinstance(decode_slot(raw, i), str)]
    if not bad:
        return meta
    meta = meta.with_state(meta.state.next())
    _write_state(folder, meta.state)
    out.actions.append(f"rewrote the damaged slot {bad[0]} of {STATE_FILE} with the committed state")
    return meta


def _rebuild_state(folder: str, static: Metadata, out: Recovery, why: str, repairs: Repairs) -> Metadata:
    """A state file that cannot be read next to sound metadata: a fresh one with an empty
    committed window (the window cannot be trusted), or, when the state reads and only
    the attributes disagree with it, the same state with the metadata's attributes."""
    try:
        state_file = StateFile(folder, False)
        try:
            state = state_file.read()
        finally:
            state_file.close()
    except Error:
        state = None
    if state is not None:
        meta = write_buffer(folder, static.with_state(state), fsync=True)
        out.actions.append(f"paired the attributes in {METADATA_FILE} with the committed state ({why})")
        return meta
    first, end = salvage(os.path.join(folder, STATE_FILE))
    repairs.move_aside(os.path.join(folder, STATE_FILE))
    meta = write_buffer(folder, static.with_state(State(end, end, end)), fsync=True)
    out.actions.append(f"rebuilt {STATE_FILE} with no committed step")
    out.lost = (first, end)
    out.reasons.append(
        f"the committed state could not be read ({why})"
        + ("" if end else "; how many steps were committed is unknown")
    )
    return meta


def _ignoring_checksum(raw: bytes, where: str) -> Metadata:
    """Parse metadata whose checksum failed: the JSON without its checksum member."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise CorruptBufferError(f"{where}: metadata is nested too deeply to be a buffer's") from None
    if not isinstance(obj, dict):
        raise CorruptBufferError(f"{where}: metadata must be a JSON object")
    obj.pop("checksum", None)
    return parse_metadata(json.dumps(obj).encode(), where)


def _rebuild_metadata(folder: str, out: Recovery, why: str, stamp: str) -> Metadata:
    """Metadata with an empty committed window, from the best description left.

    That is a killed commit's complete temporary copy, else the damaged file itself when
    it still parses once its checksum is ignored (the data files' structure is checked
    against it afterwards). Either way its committed window cannot be trusted (a later
    writer may have reused the copy's slots; the damaged file's numbers may be the
    damage), so every step is dropped; the buffer keeps its layout and its step count.
    """
    main = os.path.join(folder, METADATA_FILE)
    found: list[tuple[Metadata, str]] = []
    for tmp in _tmp_copies(folder):
        try:
            with open(tmp, "rb") as f:
                found.append((parse_metadata(f.read(), tmp), tmp))
        except (OSError, ValueError, Error):
            continue
    if found:
        meta, source = max(found, key=lambda c: (c[0].state.commits, c[0].state.end, c[0].attrs_generation))
        what = f"a killed commit's copy {os.path.basename(source)}"
    else:
        try:
            with open(main, "rb") as f:
                meta = _ignoring_checksum(f.read(), main)
        except (OSError, ValueError, Error):
            raise CorruptBufferError(
                f"{folder}: {why}; no readable copy of the metadata is left to rebuild it from, "
                f"so it is not rebuilt: restore {METADATA_FILE} from a backup (the data files are untouched)"
            ) from None
        source, what = main, f"the damaged {METADATA_FILE} itself (checksum ignored)"
        disagree = _structure_problems(folder, meta)
        if disagree:
            raise CorruptBufferError(
                f"{folder}: {why}; what it still says disagrees with the data files ({disagree[0]}), "
                f"so it is not rebuilt: restore {METADATA_FILE} from a backup, or correct it by hand "
                'and delete its "checksum" line'
            )
    if meta.format_version >= 2:  # the window is in the state file (read if it still reads)
        try:
            state_file = StateFile(folder, False)
            try:
                meta = meta.with_state(state_file.read())
            finally:
                state_file.close()
        except Error:
            first, end = salvage(os.path.join(folder, STATE_FILE))
            meta = meta.with_state(State(first, end, end))
    if os.path.exists(main):
        os.replace(main, f"{main}.damaged-{stamp}")
        out.actions.append(f"moved the damaged {METADATA_FILE} aside to {METADATA_FILE}.damaged-{stamp}")
    end = max(meta.state.reserved, meta.state.end)
    first = meta.state.first(meta.capacity)
    state = State(end, end, end, meta.state.commits + 1, time.time(), meta.state.generation + 1)
    meta = write_buffer(folder, meta.with_state(state), fsync=True)
    if source != main:
        os.unlink(source)
    out.actions.append(f"rebuilt {METADATA_FILE} from {what}, with no committed step")
    out.lost = (first, end)
    out.reasons.append(f"the committed state could not be trusted ({why})")
    return meta


def _structure_problems(folder: str, meta: Metadata) -> list[str]:
    """Where the data files disagree with ``meta``'s description (its state aside)."""
    problems: list[str] = []
    backends.get(meta.backend).verify_leaves(folder, meta.with_state(State()), False, problems)
    return [p for p in problems if "status flags" not in p]
