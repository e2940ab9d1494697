"""The store: a folder holding one ring array per leaf and the committed state.

The store owns the write cursor, the commit protocol, the open modes and the writer
lock. Global step ids count every step ever added; step ``g`` lives in slot
``g % capacity`` of every leaf.

Commit protocol (docs/format.md, "Commits"): flush the rows written since the last commit to the files
(and the disk with ``durability="power"``), then write the new state into the older
slot of the state file (:mod:`mmreplay.statefile`; one ``pwrite``, and ``fdatasync``
with ``durability="power"``), and only then count the rows committed. Before the
writer overwrites slots whose steps are still committed, a commit raises ``reserved``
past them, so a crash or a reader never sees a torn row as committed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from . import backends, exits, frames_layout
from . import episodes as _episodes
from . import frames as _frames
from .backends import native_rows
from .errors import (
    BadInputError,
    ClosedError,
    CorruptBufferError,
    Error,
    NotEnoughDataError,
    ReadOnlyError,
)
from .hooks import WriteHook, overrides
from .io import ByteSource, LocalFolder, open_source
from .lock import WriterLock
from .metadata import (
    METADATA_FILE,
    Metadata,
    State,
    migrate,
    open_state,
    read_metadata,
    write_metadata,
)
from .read import advice as _advice
from .read import gather as _gather
from .read import passes as _passes
from .read.request import SampleRequest
from .samplers.base import Sampler, Window
from .samplers.registry import make_sampler, sampler_from_json
from .spec import unflatten
from .statefile import oldest_retained, slot_ranges
from .values import StepValidator

__all__ = ["Store", "open", "BufferExistsError"]

DEFAULT_COMMIT_EVERY = 1000
MODES = ("r", "a")

log = logging.getLogger(__name__)


class BufferExistsError(Error, FileExistsError):
    """``create`` found something at the path and ``exist_ok`` was not set."""


class Store:
    """A replay store on disk. Make one with :func:`create` or :func:`open`.

    Example:
        >>> import mmreplay as mr, numpy as np, tempfile
        >>> spec = {"obs": mr.ArraySpec((3,), "float32"), "reward": mr.ArraySpec((), "float32")}
        >>> with mr.create(tempfile.mkdtemp() + "/buf", spec, capacity=10, num_envs=2) as store:
        ...     store.add({"obs": np.ones((2, 3), "float32"), "reward": np.zeros(2, "float32")})
        >>> len(store)
        1
    """

    def __init__(
        self,
        path: str,
        meta: Metadata,
        mode: str,
        lock: WriterLock | None,
        sampler: Sampler | None = None,
        source: ByteSource | None = None,
    ):
        self.path = path
        # where the state and the leaves are read from: the folder ``path``, or an
        # object-store prefix (:mod:`mmreplay.io`)
        self._source = source = source if source is not None else LocalFolder(path)
        self.mode = mode
        self._meta = meta
        self._lock = lock
        self._capacity = meta.capacity
        self._num_envs = meta.num_envs
        self._set_state(meta.state)
        self._validator = StepValidator(meta.spec, meta.num_envs)
        self._leaves: list[Any] = []
        self._decode_setting: int | None = None  # set_decode_threads
        self._closers: list[Any] = []
        self._closed = False
        # one check on the hot path: False once closed, and in a writer that reopened
        # the store until its first step (see _before_write)
        self._writable = mode == "a"
        try:
            # the committed state: read by readers per batch, written by each commit
            self._state_file = open_state(source, meta.format_version, mode == "a")
            try:
                entries = backends.get(meta.backend).open_leaves(source, meta, mode == "a")
            except BaseException:
                self._state_file.close()
                raise
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        self._closers = entries
        self._leaves = [e for e in entries if getattr(e, "info", None) is not None]
        side: list[Any] = []
        if meta.frames is not None and meta.frames.side:
            try:
                side_entries = backends.get(meta.backend).open_leaves(
                    frames_layout.side_source(source), frames_layout.side_metadata(meta), mode == "a"
                )
            except BaseException:
                for entry in entries:
                    entry.close()
                self._state_file.close()
                if lock is not None:
                    lock.release()
                raise
            self._closers = entries = entries + side_entries
            side = [e for e in side_entries if getattr(e, "info", None) is not None]
        # what is written and flushed: the stored leaves and the side ring of next frames
        self._storage = self._leaves + side
        if mode == "a":  # compressed row leaves encode on one background thread per writer
            from .backends.row_frames import share_encoder

            share_encoder(self._storage)
        # file-level work after every leaf's flush (the hdf5 backend's chunk journal)
        self._file_flushes = [e.flush for e in entries if getattr(e, "info", None) is None and hasattr(e, "flush")]
        self._all_mapped = all(leaf.mappable for leaf in self._storage)
        # what is read: the spec's leaves (frames rebuilt from the stored ones, or those)
        self._read_leaves = self._leaves
        self._frames: Any = None  # mmreplay.frames.FrameWriter of a writer of a frames-once store
        self._shrink = 0
        self._dropped_early = False  # the side ring of next frames dropped steps (warned once)
        frame_parts = None
        if meta.frames is not None:
            self._read_leaves, frame_parts = _frames.read_leaves(meta, self._leaves, side)
            self._shrink = meta.frames.shrink
        self._setters = [
            leaf.array.__setitem__ if leaf.mappable else _step_writer(leaf) for leaf in self._leaves
        ]
        # With every leaf mapped, `add` stores into the arrays directly: `a[i] = v` is
        # cheaper than calling a bound `__setitem__`.
        self._arrays = [leaf.array for leaf in self._leaves] if self._all_mapped else None
        capacity = meta.capacity
        # Steps before `_floor` are gone: cleared, or their slots may hold a dead
        # writer's uncommitted rows (its reservation).
        self._floor = self._state.first(capacity)
        self._written = self._state.end
        # One past the newest step whose rows this writer began to write (add, write_next):
        # steps before `_touched - capacity` have a slot it may have overwritten in part,
        # so no window or commit holds them.
        self._touched = self._written
        self._busy = False  # a write is under way (see exits._stop_writes)
        self._exiting = False  # the program ends: the exit hooks close this writer
        self._ahead = max(1, min(meta.commit_every, capacity // 8))
        self._dirty = False
        self._parts: dict[str, Any] = {}  # see part(): the read path, the episode index...
        self._populator: Any = None  # mmreplay.read.advice.Populator, started by open()
        self._hooks: list[WriteHook] = []
        self._on_add: list[Any] = []  # bound on_add of the hooks that override it
        try:
            # hooks, the sampler and the parts keep this view, no reference to the store itself
            me = self._view = _attribute_view(self)
            self.add_write_hook(_episodes.EpisodeHook(me))
            self._sampler = sampler if sampler is not None else _recorded_sampler(meta, source)
            self._sampler.attach(me)
            self.add_write_hook(self._sampler)
            if frame_parts is not None and mode == "a":
                self._frames = _frames.FrameWriter(me, meta, frame_parts)
                self._frames.restore()
        except BaseException:
            self._closed = True
            for entry in self._closers:
                entry.close()
            self._state_file.close()
            if lock is not None:
                lock.release()
            raise
        self._finalizer = exits.close_when_dropped(self, at_exit=mode == "a")

    # --- description ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Time steps the ring holds (each step holds ``num_envs`` rows)."""
        return self._meta.capacity

    @property
    def num_envs(self) -> int:
        return self._meta.num_envs

    @property
    def spec(self) -> Any:
        return self._meta.spec

    @property
    def roles(self) -> dict[str, str]:
        return dict(self._meta.roles)

    @property
    def backend(self) -> str:
        return self._meta.backend

    @property
    def metadata(self) -> Metadata:
        """The static description and the committed state, as last read or written."""
        return self._meta.with_state(self._state)

    @property
    def attrs(self) -> dict[str, Any]:
        """User attributes kept in the metadata (JSON values), as of open or the last
        :meth:`set_attrs`."""
        return json.loads(json.dumps(self._meta.attrs))

    def set_attrs(self, **values: Any) -> None:
        """Set attributes in the metadata, committed atomically with the committed state.

        Values must be JSON-serialisable; ``None`` removes a key. Layers built on the store
        keep their small state here, so it lives and dies with the buffer's own: the new
        attributes are written to ``mmreplay.json`` beside the ones committed before,
        then a state write names them. A crash before that state write leaves the
        previous attributes with the previous state; after it, the new ones with it. No
        step is committed by this call (call :meth:`commit` first for that).
        """
        self._check_writable()
        attrs = dict(self._meta.attrs)
        for key, value in values.items():
            if value is None:
                attrs.pop(key, None)
            else:
                attrs[key] = value
        try:
            attrs = json.loads(json.dumps(attrs, allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise BadInputError(f"{self.path}: attrs must be JSON values: {exc}") from None
        fsync = self._meta.durability == "power"
        with self._writing():
            state = self._state.next(attrs_generation=self._state.generation + 1)
            new = replace(self._meta, attrs=attrs, attrs_generation=state.generation)
            write_metadata(self.path, new, fsync, previous=(self._meta.attrs_generation, self._meta.attrs))
            self._write_state(state, fsync)
            self._meta = new

    @property
    def leaves(self) -> list[Any]:
        """The leaf arrays in flatten order (:class:`mmreplay.backends.base.Leaf`), for
        the read path and what is derived from the rows; write through :meth:`add`. In a
        store that keeps each frame once (:class:`mmreplay.Frames`) the observation
        leaves are rebuilt from the stored frames (:class:`mmreplay.frames.FrameLeaf`)."""
        return list(self._read_leaves)

    @property
    def stored_leaves(self) -> list[Any]:
        """The leaf arrays as kept on disk: :attr:`leaves`' storage, with the frames and
        side ring of a store that keeps each frame once; for page-cache advice and checks."""
        return list(self._storage)

    @property
    def source(self) -> ByteSource:
        """Where the store's bytes are read from: its folder or its object-store prefix."""
        return self._source

    @property
    def location(self) -> Any:
        """The object-store prefix an ``s3://`` store is read from (its requests counted
        in ``location.traffic``); None for a local folder."""
        return None if self._source.local else self._source

    @property
    def leaf_paths(self) -> list[str]:
        return [leaf.info.path for leaf in self._read_leaves]

    @property
    def frames(self) -> Any:
        """The :class:`mmreplay.frames.FramesLayout` of a store that keeps each frame once,
        else None."""
        return self._meta.frames

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def total_steps(self) -> int:
        """Steps ever added (in a writer, also those not committed yet)."""
        return self._written

    @property
    def committed_steps(self) -> int:
        """The committed cursor: global id one past the newest committed step."""
        return self._state.end

    @property
    def first_step(self) -> int:
        """Global id of the oldest retained step (``window.first``)."""
        return self.window.first

    @property
    def cursor(self) -> int:
        """The slot the next step is written to."""
        return self._written % self.capacity

    @property
    def state(self) -> State:
        return self._state

    @property
    def window(self) -> Window:
        """The steps this store retains and reads, global ids ``[first, end)``: in a
        writer every step it added (committed or not), in a reader the committed ones."""
        written = self._written
        # rows of the next step, written ahead (write_next) or in part, take the oldest step's slot
        retained = oldest_retained(self._floor, written, self._capacity - (self._touched - written))
        first = self._readable_from(retained, written)
        return _new_window(Window, (first, written, self._num_envs, self._capacity))

    @property
    def sampler(self) -> Sampler:
        """The sampler :meth:`sample` draws through (chosen at :func:`create`, recorded
        in the metadata)."""
        return self._sampler

    def __len__(self) -> int:
        """Steps retained (each holds ``num_envs`` rows): in a writer every step it
        added, in a reader the committed ones."""
        return self._written - self.first_step

    def __repr__(self) -> str:
        if self._closed:
            return f"<closed mmreplay.Store {self.path!r}>"
        leaves = ", ".join(
            f"{leaf.info.path}: {leaf.info.spec.shape} {leaf.info.spec.dtype}"
            + (f" [{leaf.info.compression}]" if leaf.info.compression else "")
            for leaf in self._leaves
        )
        return (
            f"<mmreplay.Store {self.path!r} {self.backend} mode={self.mode!r} "
            f"steps={len(self)}/{self.capacity} num_envs={self.num_envs} "
            f"total_steps={self.total_steps} leaves={{{leaves}}}>"
        )

    # --- life cycle --------------------------------------------------------------

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Commit what was written (in a writer) and release files and lock. Safe twice.

        A writer that is never closed is closed the same way when it is garbage-collected
        or when the interpreter exits (normally, by an exception or by Ctrl-C).
        """
        if self._closed:
            return
        with exits.closing(self._finalizer):  # a stop signal waits for the last commit
            self._close()

    def _close(self) -> None:
        try:
            if self.mode == "a":
                self._commit(reserve_to=self._written)
        finally:
            self._closed = True
            self._writable = False
            self._arrays = None  # drop the views first, so the mappings can close
            if self._populator is not None:
                self._populator.stop()
                self._populator = None
            self._frames = None
            for leaf in self._read_leaves:
                if isinstance(leaf, _frames.FrameLeaf):
                    leaf.close()
            self._read_leaves = []
            self._storage = []
            for part in [*self._parts.values(), self._sampler]:
                part.close()
            self._parts.clear()
            failed = []  # every file is closed and the lock released all the same
            for entry in self._closers:
                try:
                    entry.close()  # (a row-frame leaf seals its open segment: it may fail)
                except Exception as exc:
                    failed.append(exc)
            self._state_file.close()
            self._leaves = []
            self._setters = []
            if self._lock is not None:
                self._lock.release()
            if failed:
                raise failed[0]

    def part(self, name: str, make: Callable[[Store], Any]) -> Any:
        """The part of this store called ``name`` (its read path, its episode index, a
        layer's own cache), made by ``make(store)`` at its first use and closed (its
        ``close()``) when the store closes, before the sampler.

        ``make`` is handed a store sharing this one's attributes, as the write hooks and
        the sampler are: a part that keeps it does not keep this store from being
        collected, and so from being closed when dropped.
        """
        part = self._parts.get(name)
        if part is None:
            part = self._parts[name] = make(self._view)
        return part

    def add_write_hook(self, hook: WriteHook) -> None:
        """Call ``hook`` as this store writes (see :mod:`mmreplay.hooks`): on add/extend,
        before each commit's state write, on set and clear. Hooks run in order of
        registration; the episode index and the sampler are the first two."""
        if not isinstance(hook, WriteHook):
            raise TypeError(f"a write hook must be a mmreplay.hooks.WriteHook, got {type(hook).__name__}")
        self._hooks.append(hook)
        if overrides(hook, "on_add"):
            self._on_add.append(hook.on_add)

    def check_open(self) -> None:
        """Raise :class:`~mmreplay.ClosedError` once the store is closed."""
        if self._closed:
            raise ClosedError(f"{self.path}: store is closed")

    def _check_writable(self) -> None:
        if self._exiting:
            raise ClosedError(
                f"{self.path}: the program is ending, and the store was closed for it; a thread that "
                "writes must be joined (or the store closed) before the program ends"
            )
        if self._closed:
            raise ClosedError(f"{self.path}: store is closed")
        if self.mode != "a":
            raise ReadOnlyError(f"{self.path}: store is open read-only (mode='r'); open it with mode='a' to write")

    def _before_write(self) -> None:
        """The first step written by a writer that reopened the store: it resumes
        collection, so the episodes the last writer left open end first."""
        self._check_writable()
        self._end_open_episodes()
        self._writable = True

    def _end_open_episodes(self) -> None:
        """Mark truncated each env's episode left open at the last committed step
        (:func:`mmreplay.episodes.open_ends`): in place, committed, then recorded in the
        episode index. A crash before the commit leaves the mark to be made again by
        the next writer; one after it, the index to be mended when it is next loaded."""
        mark = _episodes.open_ends(self)
        if mark is None:
            return
        leaf, step, row = mark
        leaf.write_slots(np.array([step % self._capacity]), row)
        self._dirty = True
        self._commit()
        _episodes.index_for(self).rescan(self._view, np.array([step]))

    # --- writes --------------------------------------------------------------------

    def add(self, step: Any) -> None:
        """Write one step: every leaf ``[num_envs, *shape]``.

        Every leaf is validated before anything is written; a bad step raises
        :class:`~mmreplay.BadInputError` naming the leaf and changes nothing.
        """
        if not self._writable:
            self._check_writable()
        self.add_leaves(self._validator.step(step))

    def add_leaves(self, values: list[np.ndarray]) -> None:
        """Write one step given as its leaves, already checked: :meth:`add` after its
        validation, and the per-step path of layers that convert their framework's
        values once (SB3's ``add``).

        ``values`` are numpy arrays in :attr:`leaf_paths` order, each
        ``[num_envs, *shape]`` of the leaf's dtype (or of one that casts to it without
        loss). Nothing is checked: a wrong shape may broadcast and a wrong dtype cast
        where :meth:`add` would refuse them.
        """
        self._busy = True  # before the check: see exits._stop_writes
        try:
            if not self._writable:
                self._before_write()
            g = self._written
            frames = self._frames
            if frames is not None:
                if frames.written != g:  # an add of step g was interrupted after it took the frames
                    frames.undo_step()
                values, prepared = frames.prepare(values)
                if g >= self._reserved:
                    self._commit(reserve_to=g + self._ahead)
                self._touched = g + 1
                frames.apply(prepared, g)
            else:
                if g >= self._reserved:
                    self._commit(reserve_to=g + self._ahead)
                # before the first row: until the step is added, a commit leaves out the
                # step whose slot it overwrites (an add interrupted here tears that slot)
                self._touched = g + 1
            slot = g % self._capacity
            arrays = self._arrays
            if arrays is not None:
                for array, value in zip(arrays, values):
                    array[slot] = value
            else:
                for set_row, value in zip(self._setters, values):
                    set_row(slot, value)
            g += 1
            self._written = g
            if self._on_add:
                for on_add in self._on_add:
                    on_add(g - 1, 1)
            if g >= self._commit_at:
                self._commit()
        finally:
            self._busy = False

    def extend(self, steps: Any) -> None:
        """Write ``T`` steps: every leaf ``[T, num_envs, *shape]``, validated first."""
        self._check_writable()
        n, values = self._validator.batch(steps)
        if n == 0:
            return
        if not self._writable:
            self._before_write()
        if self._frames is not None:  # each step's frames follow from the one before
            for t in range(n):
                self.add(unflatten(self.spec, [v[t] for v in values]))
            return
        with self._writing():
            g = self._written
            capacity = self._meta.capacity
            keep = min(n, capacity)  # of more than a ring's worth, only the newest survive
            first = g + n - keep
            if g + n > self._state.reserved:
                self._commit(reserve_to=g + n + self._ahead)
            # before the first row: the steps whose slots these overwrite are gone, as
            # they are once the steps are added (an extend interrupted here tears them)
            self._floor = max(self._floor, g + n - capacity)
            pos = first
            while pos < g + n:
                slot = pos % capacity
                count = min(g + n - pos, capacity - slot)
                lo = pos - g
                for leaf, value in zip(self._leaves, values):
                    leaf.write(slot, value[lo : lo + count])
                pos += count
            self._written = g + n
            for on_add in self._on_add:
                on_add(g, n)
            if self._written >= self._commit_at:
                self._commit()

    def set_chunk_cache(self, nbytes: int) -> None:
        """Bytes of decoded chunks each chunk-compressed leaf (``zstd``, ``blosc``, ``gzip``)
        keeps between reads (default 256 MiB; 0 keeps none). Mapped and row-frame leaves
        keep no decoded copies."""
        if not isinstance(nbytes, (int, np.integer)) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError(f"set_chunk_cache: expected a byte count >= 0, got {nbytes!r}")
        for leaf in self._leaves:
            if hasattr(leaf, "set_cache_bytes"):
                leaf.set_cache_bytes(int(nbytes))

    def set_decode_threads(self, threads: int | None) -> None:
        """Threads a batch of each row-frame leaf (``rows:...``) decodes on: an int uses
        that many whatever the machine's load; None (the default) one per idle core, by the
        1-minute load average (:attr:`decode_threads` says what it chose)."""
        setting = native_rows.check_decode_threads(threads)
        self._decode_setting = setting
        for leaf in self._storage:
            frames = getattr(leaf, "frames", None)
            if hasattr(frames, "threads"):
                frames.threads = setting

    @property
    def decode_threads(self) -> native_rows.DecodeThreads:
        """The threads the next batch of a row-frame leaf decodes on, the setting
        (:meth:`set_decode_threads`) and the load it was chosen by; ``str()`` says it."""
        return native_rows.decode_threads(self._decode_setting)

    def write_next(self, step: Any) -> None:
        """Write the rows of the next step ahead of its :meth:`add`: every leaf ``[num_envs, *shape]``.

        The rows go into the slot of global step ``total_steps``, where this writer can
        read them (``read_steps([total_steps])``, or a sampler that draws that step), but
        the step is not added: nothing counts, commits or hooks it, :meth:`add` or
        :meth:`extend` overwrites the slot, and a crash, :meth:`clear` or :meth:`close`
        drops it. Layers whose frameworks add a step env by env (skrl) keep the partial
        step here. While such rows are written, the window leaves out the oldest step
        if it shares their slot. Validated as :meth:`add`.
        """
        if not self._writable:
            self._check_writable()
        values = self._validator.step(step)
        with self._writing():
            if not self._writable:
                self._before_write()
            g = self._written
            if g >= self._reserved:  # the slot may hold a committed step: leave it out first
                self._commit(reserve_to=g + self._ahead)
            self._touched = g + 1
            slot = g % self._capacity
            for set_row, value in zip(self._setters, values):
                set_row(slot, value)

    def commit(self) -> None:
        """Make every step added so far durable; cheap when nothing is new."""
        with self._writing():
            self._commit()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A write under way (not on the per-step path, which inlines it): the exit hooks
        wait for it, and start none after (see exits._stop_writes)."""
        self._busy = True
        try:
            self._check_writable()
            yield
        finally:
            self._busy = False

    def _commit(self, reserve_to: int | None = None) -> None:
        fsync = self._meta.durability == "power"
        written = self._written
        # This writer has overwritten only slots of steps before `_touched - capacity`, and
        # `start` covers what earlier writers and interrupted extends may have, so
        # `reserved` may also shrink, to no less than `_touched`.
        reserved = max(self._touched, written + self._ahead if reserve_to is None else reserve_to)
        if written == self._state.end and reserved == self._state.reserved and not self._dirty:
            return
        if self._frames is not None and written > self._state.end:
            self._frames.before_commit(written)  # (takes back the frames of an add of `written` cut short)
        if written != self._state.end or self._dirty:
            if not self._all_mapped or fsync:
                for leaf in self._storage:
                    leaf.flush(fsync)
                for flush in self._file_flushes:
                    flush(fsync)
        state = self._state.next(
            start=min(self._floor, written),
            end=written,
            reserved=reserved,
            commits=self._state.commits + 1,
            commit_time=time.time(),
        )
        if written > self._state.end:  # hooks persist what they derive before the state commits it
            for hook in self._hooks:
                hook.on_commit(self._state.end, written, fsync)
        self._write_state(state, fsync)
        self._dirty = False

    def _drop_through(self, step: int) -> None:
        """Drop the retained steps up to ``step`` (its side-ring frame is about to be
        overwritten); committed at once when readers may still read them."""
        if step < oldest_retained(self._floor, self._written, self._capacity - (self._touched - self._written)):
            return  # gone already: the ring has overwritten it
        self._floor = min(self._written, step + 1)
        if not self._dropped_early:
            self._dropped_early = True
            log.warning(
                "%s: the side ring of next frames (Frames.final_slots=%d) is full: steps up to %d are dropped "
                "before the ring reaches them; a larger final_slots keeps them",
                self.path, self._meta.frames.final_slots, step,
            )
        if step >= self._state.first(self._capacity) and self._state.end > self._state.first(self._capacity):
            start = min(self._floor, self._state.end)
            self._write_state(self._state.next(start=start), self._meta.durability == "power")

    def _first_of(self, state: State) -> int:
        """The oldest readable step of a committed state."""
        return self._readable_from(state.first(self._capacity), state.end)

    def _readable_from(self, first: int, end: int) -> int:
        """The oldest readable step when ``first`` is the oldest retained: frame stacks
        need the frames before them."""
        if self._shrink and first > 0:
            return min(end, first + self._shrink)
        return first

    def live_first(self) -> int:
        """The oldest step readable now (for a reader, after the writer's latest commit):
        one ``pread`` of the state file."""
        return self._first_of(self.live_state())

    def _write_state(self, state: State, fsync: bool) -> None:
        self._state_file.write(state, fsync)
        self._set_state(state)

    def _set_state(self, state: State) -> None:
        """Take a new committed state, with the thresholds ``add`` compares against."""
        self._state = state
        self._reserved = state.reserved
        self._commit_at = state.end + self._meta.commit_every

    def clear(self, next_slot: int | None = None) -> None:
        """Drop every retained step (committed at once); ``total_steps`` keeps counting.

        With ``next_slot``, ``total_steps`` moves on to the next step id the ring writes
        at that slot (the ids skipped hold nothing), so a framework whose own cursor
        restarts at a slot after emptying (TorchRL's writers, at 0) writes where the store does.
        """
        with self._writing():
            if next_slot is not None and not (
                isinstance(next_slot, (int, np.integer)) and 0 <= next_slot < self.capacity
            ):
                raise BadInputError(f"{self.path}: next_slot must be a slot in [0, {self.capacity}), got {next_slot!r}")
            self._commit()
            if next_slot is not None:
                self._written += (int(next_slot) - self._written) % self.capacity
            state = self._state.next(
                start=self._written,
                end=self._written,
                reserved=max(self._state.reserved, self._written),
                commits=self._state.commits + 1,
                commit_time=time.time(),
            )
            self._write_state(state, self._meta.durability == "power")
            self._floor = self._touched = self._written  # rows written ahead are dropped too
            for hook in self._hooks:
                hook.on_clear(self._written)

    # --- reads ---------------------------------------------------------------------

    def _steps_for(self, index: Any) -> tuple[np.ndarray | int, bool]:
        """Global step ids for a logical index over the retained committed steps."""
        n = len(self)
        first = self.first_step
        if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
            i = int(index)
            if not -n <= i < n:
                raise IndexError(f"{self.path}: index {i} out of range for {n} committed steps")
            return first + (i % n), True
        if isinstance(index, slice):
            return first + np.arange(n)[index], False
        idx = np.asarray(index)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"{self.path}: expected an int, a slice or an integer array, got {idx.dtype}")
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"{self.path}: index out of range for {n} committed steps")
        return first + (idx % max(n, 1)), False

    def read_steps(self, steps: Any, leaves: list[int] | None = None) -> list[np.ndarray]:
        """Leaf arrays (flatten order) for global step ids, each ``[*steps.shape, num_envs, *shape]``.

        ``leaves`` picks leaves by their flatten-order index (default: all), for callers
        that handle one leaf at a time. Raises :class:`~mmreplay.NotEnoughDataError` when
        a step is not retained or was overwritten by the writer while it was read.
        """
        self.check_open()
        slots = np.asarray(steps, dtype=np.int64) % self.capacity
        chosen = self._read_leaves if leaves is None else [self._read_leaves[i] for i in leaves]
        out = [np.array(leaf.read(slots)) for leaf in chosen]
        if self.mode == "r":
            self._check_still_retained(steps)
        return out

    def _check_still_retained(self, steps: Any) -> None:
        """Seqlock check for readers: were the rows just read still retained after the read?"""
        live = self.live_state()
        lo = np.min(steps) if np.size(steps) else None
        if lo is not None and lo < self._first_of(live):
            raise NotEnoughDataError(
                f"{self.path}: step {int(lo)} was overwritten by the writer while it was read "
                f"(oldest retained is now {self._first_of(live)}); call refresh()"
            )

    def get(self, index: Any) -> Any:
        """Stored steps by logical index (0 = oldest retained, -1 = newest committed).

        An int gives the nest of ``[num_envs, *shape]`` arrays; a slice or an index array
        gives ``[k, num_envs, *shape]``. The arrays are copies.
        """
        self.check_open()
        steps, _ = self._steps_for(index)
        return unflatten(self.spec, self.read_steps(steps))

    def set(self, index: Any, value: Any) -> None:
        """Overwrite stored steps by logical index, with values shaped as :meth:`get` returns.

        The change is durable at the next commit. It is not atomic under a crash: a
        process killed during ``set`` may leave those steps partly updated.
        """
        self._check_writable()
        steps, scalar = self._steps_for(index)
        if scalar:
            values = self._validator.step(value)
            slots = np.array([steps % self.capacity])
            values = [v[None] for v in values]
        else:
            steps = np.asarray(steps)
            _, values = self._validator.batch(value, lead=steps.shape)
            slots = steps.reshape(-1) % self.capacity
            values = [v.reshape(-1, *v.shape[steps.ndim :]) for v in values]
        if self._frames is not None:  # frames are not rewritten: only the other leaves
            leaves = self._frames.settable(slots, values, self._read_leaves, self.path)
        else:
            leaves = self._leaves
        with self._writing():
            self._dirty = True  # first: a set cut short is committed as far as it went
            for leaf, v in zip(leaves, values):
                if leaf is not None:
                    leaf.write_slots(slots, v)
            changed = np.asarray(steps).reshape(-1)
            for hook in self._hooks:
                hook.on_set(changed)

    # --- sampling, passes, episodes (mmreplay.read, mmreplay.episodes) -----------------

    def sample(
        self,
        batch_size: int,
        num_steps: int | None = None,
        replacement: bool = True,
        rng: Any = None,
        within_episodes: bool | None = None,
        return_info: bool = False,
        window: tuple[int, int] | None = None,
        out: Any = None,
        layout: str | None = None,
        transform: Any = None,
        **options: Any,
    ) -> Any:
        """A random batch of rows, drawn through :attr:`sampler` (by default uniform over
        every (step, env) pair): in a writer from every step it added, in a reader from
        the committed ones.

        Args:
            batch_size: items in the batch (without replacement: at most the number of
                valid items).
            num_steps: if given, each item is a sequence of that many consecutive steps of
                one env, never crossing the write cursor or the oldest retained step.
            replacement: False gives distinct items.
            rng: an int seed, a ``numpy.random.Generator``, or None (the store's own).
            within_episodes: sequences also never cross an episode end (None: the
                sampler's default, off for the uniform sampler).
            return_info: also return a :class:`mmreplay.read.SampleInfo` (global step id
                and slot of each item's first step, its env, its probability, and the
                importance weight from a prioritized sampler).
            window: ``(first, end)`` global step ids: draw only from these steps (within
                the retained ones), as layers that show the newest part of the store do.
            out: a batch to gather into instead of allocating one: the spec's nest of
                arrays ``[batch_size, *shape]`` (``[batch_size, num_steps, *shape]``) of
                the leaves' dtypes, such as :meth:`empty_batch` makes or an earlier
                ``sample`` returned. Each leaf is gathered with one ``take(out=)``
                (compressed leaves decode, then copy). Returns ``out`` itself (without
                replacement and fewer items than asked: views of its first rows). A batch
                that does not fit raises :class:`~mmreplay.BadInputError` before anything
                is drawn or written into it. CPU torch tensors (pinned or not) are
                filled in place too.
            layout: ``"NCHW"`` or ``"NHWC"``: picture leaves (``[84, 84, 4]``,
                ``[3, 64, 64]``...) channels first or last, contiguous, each row written
                so as it is gathered (:mod:`mmreplay.read.layout`); None: as stored.
            transform: fields computed over the drawn batch, such as
                ``mr.NStep(3, gamma=0.99)`` returns (:mod:`mmreplay.read.nstep`).
            options: passed to the sampler's ``draw`` (such as ``beta`` for the
                prioritized sampler).

        Returns:
            The spec's nest of arrays ``[batch_size, *shape]``, or
            ``[batch_size, num_steps, *shape]``; with ``return_info``, ``(nest, info)``.

        Raises:
            NotEnoughDataError: the store is empty, or too short for ``num_steps``.

        Example:
            >>> import mmreplay as mr, numpy as np, tempfile
            >>> store = mr.create(tempfile.mkdtemp() + "/b", {"x": mr.ArraySpec((), "int64")}, 10)
            >>> store.extend({"x": np.arange(6).reshape(6, 1)}); store.commit()
            >>> store.sample(4, num_steps=3, rng=0)["x"].shape
            (4, 3)
        """
        if self._closed:  # before the arguments, as every method does
            self.check_open()
        request = SampleRequest.build(
            batch_size, num_steps, replacement, rng, within_episodes, return_info, window, out, options,
            layout=layout,
            transform=transform,
        )
        return _gather.sample(self, request)

    def update_priorities(self, step: Any, env: Any, priorities: Any) -> int:
        """New priorities for sampled items (``info.step``, ``info.env`` of
        :meth:`sample`), for a store created with ``sampler="prioritized"``.

        Allowed in readers too (it writes the priority file only), so a learner in
        another process can update them. Items whose step the ring has dropped since
        they were sampled are skipped; returns how many were applied.
        """
        self.check_open()
        return self._sampler.update_priorities(step, env, priorities)

    # the read path's own functions, with this store as their first argument
    empty_batch = _gather.empty_batch
    iterate = _passes.iterate

    def episodes(self, env: int | None = None, complete_only: bool = False) -> Iterator[Any]:
        """Each episode of the committed window with its data, env by env, in time order.

        Yields :class:`mmreplay.episodes.Episode` (env, first and last global step id,
        status ``"terminated"``, ``"truncated"`` or ``"open"``, and ``data``: the spec's
        nest of ``[length, *shape]`` arrays). ``complete_only`` skips open episodes.

        Example:
            >>> import mmreplay as mr, numpy as np, tempfile
            >>> spec = {"x": mr.ArraySpec((), "int64"), "terminated": mr.ArraySpec((), "bool")}
            >>> store = mr.create(tempfile.mkdtemp() + "/b", spec, 10)
            >>> store.extend({"x": np.arange(5)[:, None], "terminated": np.array([[0], [1], [0], [0], [0]], bool)})
            >>> store.commit()
            >>> [(ep.first_step, ep.last_step, ep.status) for ep in store.episodes()]
            [(0, 1, 'terminated'), (2, 4, 'open')]
        """
        return _episodes.episodes(self, env, complete_only)

    def episode_index(self, env: int | None = None, complete_only: bool = False) -> list[Any]:
        """The :class:`mmreplay.episodes.EpisodeSpan` of each episode, as :meth:`episodes`
        orders them, from the episode index alone (no data is read)."""
        return _episodes.episode_index(self, env, complete_only)

    def episode_bounds(self, steps: Any, envs: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first, last, complete)`` of the episode each row ``(steps[i], envs[i])`` of the
        window lies in, from the episode index (:func:`mmreplay.episodes.episode_bounds`)."""
        self.check_open()
        return _episodes.episode_bounds(self, steps, envs)

    def to_arrays(self) -> dict[str, Any]:
        """Every committed episode as flat D4RL-style arrays, env by env, episode by episode.

        Keys: ``observations``, ``actions``, ``rewards`` (from the roles present),
        ``terminals`` and ``timeouts`` (bool, never both set: a terminated episode ends
        with ``terminals``, a truncated or still open one with ``timeouts``),
        ``next_observations``, and ``infos/<leaf path>`` for leaves with no role. With a
        ``next_observation`` leaf every step is kept; otherwise a step's next observation
        is the next step's observation in the episode, and the last step of an episode
        that did not terminate is dropped (its next observation is not stored; the step
        before it carries the episode's ``timeouts``). A terminal step's
        ``next_observations`` row repeats its own observation (no TD target uses it).
        """
        return _episodes.to_arrays(self)

    # --- readers --------------------------------------------------------------------

    def live_state(self) -> State:
        """The committed state on disk now (for a writer, its own): one ``pread`` of the
        state file, the newest valid slot."""
        if self.mode == "a":
            return self._state
        return self._state_file.read()

    def refresh(self) -> bool:
        """Pick up the writer's newer commits (readers); True if the state changed."""
        self.check_open()
        if self.mode == "a":
            return False
        old = self._state
        new = self.live_state()
        if new == old:
            return False
        changed = slot_ranges(old.end, new.end, self.capacity)
        for leaf in self._leaves:
            leaf.invalidate(changed)
        for leaf in self._storage[len(self._leaves) :]:  # the side ring: any slot may have changed
            leaf.invalidate([(0, self._meta.frames.final_slots)])
        self._set_state(new)
        self._written = self._touched = new.end
        self._floor = new.first(self.capacity)
        return True


def _attribute_view(store: Store) -> Store:
    """A store object sharing ``store``'s attributes, for the parts that keep a store
    (the write hooks, the sampler): a reference to ``store`` itself among its attributes would keep it
    from being collected, and so from being closed when it is dropped."""
    view = type(store).__new__(type(store))
    view.__dict__ = store.__dict__
    return view


_new_window = tuple.__new__  # a Window without NamedTuple's keyword handling: read per batch


def _recorded_sampler(meta: Metadata, source: ByteSource) -> Sampler:
    """The sampler the metadata records; one it names wrongly is the metadata's damage. A
    store in object storage samples uniformly: its priorities stay in the pushed folder."""
    where = source.where(METADATA_FILE)
    if not source.local and isinstance(meta.sampler, dict) and meta.sampler.get("name") == "prioritized":
        warnings.warn(
            f"{source.url}: its priorities stay in the pushed folder; sampling from object storage "
            "is uniform (pull the store to sample by priority)",
            stacklevel=4,
        )
        return make_sampler("uniform")
    try:
        return sampler_from_json(meta.sampler, where)
    except (ValueError, TypeError) as exc:
        name = meta.sampler.get("name") if isinstance(meta.sampler, dict) else None
        raise CorruptBufferError(f"{where}: the recorded sampler {name!r:.80} cannot be made: {exc}") from None


def _step_writer(leaf: Any) -> Any:
    def write(slot: int, value: np.ndarray) -> None:
        leaf.write(slot, value[None])

    return write


# --- create / open ----------------------------------------------------------------


def open(  # noqa: A001 - mirrors h5py.File / zarr.open
    path: str | os.PathLike,
    mode: str = "r",
    populate: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    continue_episodes: bool = False,
) -> Store:
    """Open an existing buffer: ``mode="r"`` to read, ``"a"`` to resume writing.

    Opening reads the metadata file and maps the data files; its cost does not grow with
    the buffer's size. Nothing in the folder is ever executed or unpickled.

    ``populate``: read the retained rows of the memory-mapped leaves into memory and
    the mapping in a background thread (``MADV_POPULATE_READ``, Linux >= 5.14; elsewhere
    ``MADV_WILLNEED``), so the first batches do not fault page by page. None (the
    default) does it in a reader (``mode="r"``) when those rows take at most half the
    memory available to the process; True always, False never (local folders only).

    ``path`` may be an ``s3://bucket/prefix`` URL of a store in object storage (read-only;
    see :mod:`mmreplay.io.remote`), reached with ``storage_options`` or the ``AWS_*``
    environment variables.

    A writer resumes collection: before its first step, the episodes the last writer
    left open are marked truncated (:mod:`mmreplay.episodes`). ``continue_episodes=True``
    says that this writer continues them instead (its environments were restored from
    the stored state): nothing is marked.
    """
    path = os.fspath(path)
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
            meta = read_metadata(path)  # the state as the previous writer left it
            meta = migrate(path, meta, fsync=meta.durability == "power")  # format 1: now 2
        except BaseException:
            lock.release()
            raise
    store = Store(source.url, meta, mode, lock, source=source)
    if not continue_episodes:  # the writer's first step ends the open episodes (_before_write)
        store._writable = False
    store._populator = _advice.populate_at_open(store, populate)
    return store
