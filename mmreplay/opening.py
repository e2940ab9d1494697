"""Opening a buffer: its metadata, read under the writer lock by a writer, and what
a :class:`mmreplay.Store` is made of, opened all or none (a failure closes what was
opened and releases the lock)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from . import backends, frames_layout
from . import frames as _frames
from .errors import CorruptBufferError, ReadOnlyError
from .io import ByteSource, open_source
from .lock import WriterLock
from .metadata import METADATA_FILE, JsonState, Metadata, migrate, open_state, read_metadata
from .samplers.base import Sampler
from .samplers.registry import make_sampler, sampler_from_json
from .statefile import StateFile

__all__ = ["MODES", "Contents", "attribute_view", "open_folder", "open_contents"]

MODES = ("r", "a")

T = TypeVar("T")


def open_folder(
    path: str, mode: str, populate: bool | None, storage_options: dict[str, Any] | None
) -> tuple[ByteSource, Metadata, WriterLock | None]:
    """The byte source, the metadata and (``mode="a"``) the held writer lock of the buffer
    at ``path``; a writer reads the metadata again under the lock, as the last writer
    left it, and migrates an older format."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if populate is not None and not isinstance(populate, bool):
        raise TypeError(f"populate must be True, False or None, got {populate!r}")
    source = open_source(path, storage_options)
    if not source.local and mode != "r":
        raise ReadOnlyError(
            f"{source.url}: a store in object storage opens read-only (mode='r'); "
            "mmreplay.pull it to a folder to write, then push it back"
        )
    meta = read_metadata(source)
    lock = None
    if mode == "a":
        lock = WriterLock(path)
        lock.acquire()
        try:
            meta = read_metadata(path)  # as the last writer left it
            meta = migrate(path, meta, fsync=meta.durability == "power")  # format 1: now 2
        except BaseException:
            lock.release()
            raise
    return source, meta, lock


@dataclass
class Contents:
    """What a store is made of, as opened from its byte source."""

    state_file: StateFile | JsonState  # read by readers per batch, written by each commit
    closers: list[Any]  # every entry the backend opened, leaves and file handles
    leaves: list[Any]  # the stored leaves of the spec, in flatten order
    storage: list[Any]  # what is written and flushed: the leaves and the side ring of next frames
    file_flushes: list[Callable[[bool], None]]  # file-level work after the leaves' flush (hdf5's journal)
    read_leaves: list[Any]  # what is read: the spec's leaves (frames rebuilt from the stored ones)
    frame_parts: Any  # what a writer of a frames-once store writes through, else None
    setters: list[Callable[[int, np.ndarray], None]]  # write one step's rows into a slot
    sampler: Sampler
    undo: contextlib.ExitStack  # closes the above and releases the lock

    def close(self) -> None:
        self.undo.close()


def open_contents(
    source: ByteSource, meta: Metadata, writable: bool, lock: WriterLock | None, sampler: Sampler | None
) -> Contents:
    """Open the state file, the leaves (and the side ring of a frames-once store) and the
    sampler (``sampler``, or the one the metadata records)."""
    with contextlib.ExitStack() as undo:
        if lock is not None:
            undo.callback(lock.release)
        state_file = open_state(source, meta.format_version, writable)
        undo.callback(state_file.close)
        module = backends.get(meta.backend)
        closers = module.open_leaves(source, meta, writable)
        undo.callback(_close_all, closers)
        leaves = [e for e in closers if getattr(e, "info", None) is not None]
        side: list[Any] = []
        if meta.frames is not None and meta.frames.side:
            side_entries = module.open_leaves(
                frames_layout.side_source(source), frames_layout.side_metadata(meta), writable
            )
            closers = closers + side_entries
            undo.callback(_close_all, side_entries)
            side = [e for e in side_entries if getattr(e, "info", None) is not None]
        storage = leaves + side
        if writable:  # compressed row leaves encode on one background thread per writer
            from .backends.row_frames import share_encoder

            share_encoder(storage)
        read_leaves, frame_parts = leaves, None
        if meta.frames is not None:
            read_leaves, frame_parts = _frames.read_leaves(meta, leaves, side)
        contents = Contents(
            state_file=state_file,
            closers=closers,
            leaves=leaves,
            storage=storage,
            file_flushes=[e.flush for e in closers if getattr(e, "info", None) is None and hasattr(e, "flush")],
            read_leaves=read_leaves,
            frame_parts=frame_parts,
            setters=[leaf.array.__setitem__ if leaf.mappable else _step_writer(leaf) for leaf in leaves],
            sampler=sampler if sampler is not None else _recorded_sampler(meta, source),
            undo=undo.pop_all(),
        )
    return contents


def _close_all(entries: list[Any]) -> None:
    for entry in entries:
        entry.close()


def attribute_view(store: T) -> T:
    """An object of ``store``'s class sharing its attributes, for the parts that keep a
    store (the write hooks, the sampler): a reference to ``store`` itself among its
    attributes would keep it from being collected, and so from being closed when dropped."""
    view = type(store).__new__(type(store))
    view.__dict__ = store.__dict__
    return view


def _recorded_sampler(meta: Metadata, source: ByteSource) -> Sampler:
    """The sampler the metadata records; one it names wrongly is the metadata's damage. A
    store in object storage samples uniformly: its priorities stay in the pushed folder."""
    where = source.where(METADATA_FILE)
    if not source.local and isinstance(meta.sampler, dict) and meta.sampler.get("name") == "prioritized":
        warnings.warn(
            f"{source.url}: its priorities stay in the pushed folder; sampling from object storage "
            "is uniform (pull the store to sample by priority)",
            stacklevel=backends.outside_mmreplay(),
        )
        return make_sampler("uniform")
    try:
        return sampler_from_json(meta.sampler, where)
    except (ValueError, TypeError) as exc:
        name = meta.sampler.get("name") if isinstance(meta.sampler, dict) else None
        raise CorruptBufferError(f"{where}: the recorded sampler {name!r:.80} cannot be made: {exc}") from None


def _step_writer(leaf: Any) -> Callable[[int, np.ndarray], None]:
    def write(slot: int, value: np.ndarray) -> None:
        leaf.write(slot, value[None])

    return write
