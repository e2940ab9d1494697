"""Bringing a damaged buffer back to its last consistent commit (:func:`recover`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field

from .. import backends
from ..backends.checks import Repairs
from ..episodes.index_file import INDEX_FILE
from ..errors import CorruptBufferError, Error, NotABufferError, UnsupportedFormatError
from ..frames_layout import SIDE_DIR, side_metadata
from ..io.local import LocalFolder, require_readable, unsafe_entries
from ..lock import WriterLock
from ..metadata import (
    METADATA_FILE,
    STATE_FILE,
    Metadata,
    State,
    json_object,
    migrate,
    parse_metadata,
    read_metadata,
    read_static,
    write_buffer,
    write_metadata,
)
from ..priorities import reset_priority_file
from ..statefile import FILE_BYTES, StateFile, decode_slot, salvage
from .checks import check_episode_index, leftovers, temporary_copies, verify
from .side_ring import repair_side_ring


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
        PermissionError: a file this process may not read; nothing was changed.

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
    if not os.path.exists(os.path.join(folder, METADATA_FILE)) and not temporary_copies(folder, METADATA_FILE):
        raise LocalFolder(folder).no_store()
    unsafe = unsafe_entries(folder)
    if unsafe:
        more = f" (and {len(unsafe) - 1} more)" if len(unsafe) > 1 else ""
        raise CorruptBufferError(f"{unsafe[0]}{more}; recover changes nothing in a folder holding such files")
    require_readable(folder)
    lock = WriterLock(folder)
    lock.acquire(instead="verify checks it without writing")
    try:
        return _recover(folder)
    finally:
        lock.release()


def _recover(folder: str) -> Recovery:
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
    meta, side_hits = repair_side_ring(folder, meta, drop_before, end, stamp, out.actions)
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
    check_episode_index(folder, meta, True, episode_problems)
    if episode_problems:
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


def _read_state_file(folder: str) -> State | None:
    """The committed state in the state file, None when it does not read."""
    try:
        with contextlib.closing(StateFile(folder, False)) as state_file:
            return state_file.read()
    except Error:
        return None


def _write_state(folder: str, state: State) -> None:
    """Commit ``state`` as a writer does (its slot, then to the disk)."""
    with contextlib.closing(StateFile(folder, True)) as state_file:
        state_file.write(state, fsync=True)


def _rewrite_damaged_slot(folder: str, meta: Metadata, out: Recovery) -> Metadata:
    """A state slot that fails its check while the other holds the committed state gets
    that state again, one generation on: nothing is lost. A file cut short or grown gets
    its size back first (in place: a reader's descriptor keeps naming it)."""
    path = os.path.join(folder, STATE_FILE)
    with open(path, "rb") as f:
        size = len(f.read(FILE_BYTES + 1))
    if size != FILE_BYTES:
        os.truncate(path, FILE_BYTES)
        out.actions.append(f"brought {STATE_FILE} back to its {FILE_BYTES} bytes (it had {size})")
    with open(path, "rb") as f:
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
    state = _read_state_file(folder)
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
    obj = json_object(raw, where)
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
    for tmp in temporary_copies(folder, METADATA_FILE):
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
        state = _read_state_file(folder)
        if state is None:
            first, end = salvage(os.path.join(folder, STATE_FILE))
            state = State(first, end, end)
        meta = meta.with_state(state)
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
