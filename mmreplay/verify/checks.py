"""What :func:`verify` checks: the metadata and the state file, each backend's data
files, the side ring, the episode index, the priority file; and the files a killed
writer leaves behind."""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from .. import backends
from ..backends.row_codec import is_row_compression
from ..episodes.ends import EndRule
from ..episodes.index_file import (
    INDEX_FILE,
    TRUNCATED,
    index_limit,
    index_problems,
    parse_index,
    same_records,
)
from ..errors import CorruptBufferError, Error, UnsupportedFormatError
from ..io import ByteSource, open_source
from ..io.local import require_readable, unsafe_entries
from ..lock import holder_pid
from ..metadata import METADATA_FILE, STATE_FILE, Metadata, read_metadata
from ..priorities import check_priority_file
from ..statefile import FILE_BYTES, decode_slot
from ..store import open as open_store
from .side_ring import check_side_ring


def verify(path: str | os.PathLike, deep: bool = True) -> list[str]:
    """Problems found in the buffer at ``path``; an empty list means it is healthy.

    Args:
        path: the buffer folder.
        deep: also decode every stored chunk of the committed steps (reads the
            compressed data once); without it only structure and sizes are checked.

    Raises:
        ImportError: a codec the data needs is missing (chunks that cannot be decoded
            for that reason are not damage), naming the extra to install.
        PermissionError: a file this process may not read (no damage either).
        UnsupportedFormatError: a newer mmreplay wrote it (no damage: upgrade to check it).

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
    require_readable(folder)
    try:
        meta = read_metadata(folder)
    except UnsupportedFormatError:
        raise
    except Error as exc:
        return [str(exc)]
    problems: list[str] = []
    _check_state_file(folder, meta, problems)
    backends.get(meta.backend).verify_leaves(folder, meta, deep, problems)
    check_side_ring(folder, meta, deep, problems)
    check_episode_index(folder, meta, deep, problems)
    problems.extend(check_priority_file(folder, meta))
    if not problems:
        problems.extend(_check_opens(folder))
    return problems


def checked(path: str | os.PathLike, deep: bool = True) -> list[str]:
    """What :func:`verify` checks of the buffer at ``path``, per kind of leaf, and what no
    check can find there: a row that holds another step's bytes is found only where the
    layout records something of it (a chunk or row that was never stored, a checksum, the
    side ring's step numbers); [] when the metadata does not read."""
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


def _check_opens(folder: str) -> list[str]:
    """Whatever the structural checks missed, the store itself must open for reading."""
    try:
        open_store(folder, "r").close()
    except Error as exc:
        return [f"the buffer does not open: {exc}"]
    return []


def check_episode_index(folder: str | ByteSource, meta: Metadata, deep: bool, problems: list[str]) -> None:
    """The episode index file, where there is one, must be well formed and (``deep``)
    hold exactly the episode ends the role leaves give for the committed steps it covers.
    ``folder`` may be an object-store prefix (a push sends the file, and readers and
    pulls there use it).

    Records at or past the committed cursor are a killed writer's and are ignored (the
    next writer cuts them off); a damaged index is rebuilt from the role leaves once it
    is removed, which :func:`~mmreplay.verify.recover` does.
    """
    source = open_source(folder)
    path = source.where(INDEX_FILE)
    try:
        raw = source.read(INDEX_FILE, index_limit(meta.capacity, meta.num_envs), "an episode index")
    except FileNotFoundError:
        return
    except CorruptBufferError as exc:
        problems.append(str(exc))
        return
    where = f"episode index {path}"
    found = parse_index(raw)
    if found is None:
        problems.append(f"{where}: not an episode index (bad header)")
        return
    rec = found.records[found.records["step"] < meta.state.end]
    bad = index_problems(found.origin, rec, meta.num_envs)
    if bad:
        problems.append(f"{where}: " + "; ".join(bad))
        return
    if not deep or problems or (source.local and holder_pid(folder) not in (None, os.getpid())):
        return  # (a live writer may overwrite the rows being compared)
    try:
        store = open_store(folder, "r") if source.local else open_store(source.url, "r", storage_options=source.storage_options)
    except Error:
        return  # the other checks say why
    try:
        rule = EndRule(store)
        lo = max(found.origin, store.first_step)
        hi = min(store.committed_steps, meta.state.end)
        if rule.kind is None or hi <= lo:
            return
        mine = rec[(rec["step"] >= lo) & (rec["step"] < hi)]
        mine = mine[np.lexsort((mine["env"], mine["step"]))]
        # The newest committed step may hold truncations the index lacks: a writer marks
        # the episodes left open there in place, then commits and indexes the mark
        # (Ring._end_episodes); killed in between, the next writer indexes it.
        last, marked = mine[mine["step"] == hi - 1], rule.records(np.array([hi - 1]))
        unindexed = marked[~np.isin(marked["env"], last["env"])]
        if same_records(last, marked[np.isin(marked["env"], last["env"])]) and (unindexed["code"] == TRUNCATED).all():
            mine, hi = mine[mine["step"] < hi - 1], hi - 1
        done = 0  # records of mine compared so far
        for fresh in rule.scan(lo, hi):  # bounded memory however long the window
            part = mine[done : done + len(fresh)]
            done += len(fresh)
            if not same_records(part, fresh):
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


def leftovers(path: str | os.PathLike) -> list[str]:
    """Files a killed writer may leave behind, harmless but untidy (temp state, zarr partials)."""
    folder = os.fspath(path)
    out = [p for name in (METADATA_FILE, STATE_FILE, INDEX_FILE) for p in temporary_copies(folder, name)]
    for name in backends.importable():
        out += backends.get(name).leftover_files(folder)
    return sorted(out)


def temporary_copies(folder: str, name: str) -> list[str]:
    """The temporary copies of the file ``name`` that a killed writer left in ``folder``."""
    return glob.glob(os.path.join(glob.escape(folder), name + ".*.tmp"))
