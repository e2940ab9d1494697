"""The ring of a store: its write cursor, the writes, and the commit protocol that makes
them durable and visible (docs/format.md, "Commits"). :class:`mmreplay.Store` is a
:class:`Ring`; the fields stay on the store itself, read per step by ``add``.

Global step ids count every step ever added; step ``g`` lives in slot ``g % capacity``
of every leaf. A commit flushes the rows written since the last commit to the files
(and the disk with ``durability="power"``), then writes the new state into the older
slot of the state file (:mod:`mmreplay.statefile`; one ``pwrite``, and ``fdatasync``
with ``durability="power"``), and only then counts the rows committed. Before the
writer overwrites slots whose steps are still committed, a commit raises ``reserved``
past them, so a crash or a reader never sees a torn row as committed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from . import episodes as _episodes
from .errors import BadInputError, ClosedError, ReadOnlyError
from .metadata import State, read_metadata, write_metadata
from .read.gather import steps_of
from .samplers.base import Window
from .statefile import oldest_retained, reserved_ahead, slot_ranges

__all__ = ["Ring"]

log = logging.getLogger("mmreplay.store")

_new_window = tuple.__new__  # a Window without NamedTuple's keyword handling: read per batch


class Ring:
    """The cursor, writes and committed state of a store (see the module's docstring).
    Its fields are the store's: the cursor's, set by :meth:`_start_cursor`; the leaves,
    setters, state file and write hooks, by ``Store.__init__``."""

    def _start_cursor(self, state: State) -> None:
        self._set_state(state)
        # Steps before `_floor` are gone: cleared, or their slots may hold a dead
        # writer's uncommitted rows (its reservation).
        self._floor = state.first(self._capacity)
        self._written = state.end
        # One past the newest step whose rows this writer began to write (add, write_next):
        # steps before `_touched - capacity` have a slot it may have overwritten in part,
        # so no window or commit holds them.
        self._touched = self._written
        self._busy = False  # a write is under way (see exits._stop_writes)
        self._exiting = False  # the program ends: the exit hooks close this writer
        self._forked = False  # a copy in a forked child: the parent writes (exits._forget_writers_in_child)
        self._ahead = reserved_ahead(self._capacity, self._meta.commit_every)
        self._dirty = False
        self._dropped_early = False  # the side ring of next frames dropped steps (warned once)

    # --- the cursor -------------------------------------------------------------------

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

    def __len__(self) -> int:
        """Steps retained (each holds ``num_envs`` rows): in a writer every step it
        added, in a reader the committed ones."""
        return self._written - self.first_step

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
            self._frames.check_batch(values, n)
            for t in range(n):
                self.add_leaves([v[t] for v in values])  # (validated above, with the batch)
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

    def set(self, index: Any, value: Any) -> None:
        """Overwrite stored steps by logical index, with values shaped as :meth:`get` returns.

        The change is durable at the next commit. It is not atomic under a crash: a
        process killed during ``set`` may leave those steps partly updated.
        """
        self._check_writable()
        steps, scalar = steps_of(self, index)
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
            reads = self._parts.get("reads")
            if reads is not None:  # a batch drawn ahead may cross an episode end set here
                reads.pending = None

    # --- the commit protocol ------------------------------------------------------

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

    def _check_writable(self) -> None:
        if self._forked:
            raise ClosedError(
                f"{self.path}: the store was opened for writing by the process this one was forked from, "
                "which writes it; open the store here to read it (mode='r')"
            )
        if self._exiting:
            raise ClosedError(
                f"{self.path}: the program is ending, and the store was closed for it; a thread that "
                "writes must be joined (or the store closed) before the program ends"
            )
        if self._closed:
            raise ClosedError(f"{self.path}: store is closed")
        if self.mode != "a":
            raise ReadOnlyError(f"{self.path}: store is open read-only (mode='r'); open it with mode='a' to write")

    def end_episodes(self, envs: Any = None) -> np.ndarray:
        """End the episodes of ``envs`` (None: every env) that are still open at the newest
        step, as a reset or a restart cut them short: that step is marked truncated
        (TF-Agents: ``LAST`` with its discount) and committed, with every step before it.
        Returns the envs whose episode ended here; where none did (an env already at an
        episode end, a store without a leaf that marks a truncation) nothing is written or
        committed (:mod:`mmreplay.episodes`)."""
        with self._writing():
            if not self._writable:  # a reopened writer: every env's open episode ends, as at its first step
                return self._before_write()
            return self._end_episodes(self._written - 1, envs)

    def _before_write(self) -> np.ndarray:
        """The first step written by a writer that reopened the store: it resumes
        collection, so the episodes the last writer left open end first (the envs returned)."""
        self._check_writable()
        ended = self._end_episodes(self._state.end - 1)
        self._writable = True
        return ended

    def _end_episodes(self, step: int, envs: Any = None) -> np.ndarray:
        """Mark ``step`` truncated in the envs whose episode is open there: in place, then
        committed, and a step committed before recorded in the episode index. A crash
        before the commit leaves the mark to be made again; one after it, the index to be
        mended when it is next loaded."""
        mark = _episodes.open_ends(self, step, envs)
        if mark is None:
            return np.zeros(0, np.int64)
        leaf, row, ended = mark
        leaf.write_slots(np.array([step % self._capacity]), row)
        rewritten = step < self._state.end  # (a step not committed yet is indexed by the commit)
        self._dirty |= rewritten
        self._commit()
        if rewritten:
            _episodes.index_for(self).rescan(self._view, np.array([step]))
        return ended

    def commit(self) -> None:
        """Make every step added so far durable; cheap when nothing is new."""
        self._busy = True  # what _writing does, inlined: a commit may follow every add
        try:
            self._check_writable()
            self._commit()
        finally:
            self._busy = False

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
            rewrites=(self._state.rewrites or 0) + int(self._dirty),
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
                isinstance(next_slot, (int, np.integer))
                and not isinstance(next_slot, bool)
                and 0 <= next_slot < self.capacity
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

    # --- readers ----------------------------------------------------------------------

    def live_first(self) -> int:
        """The oldest step readable now (for a reader, after the writer's latest commit):
        one ``pread`` of the state file."""
        return self._first_of(self.live_state())

    def live_state(self) -> State:
        """The committed state on disk now (for a writer, its own): one ``pread`` of the
        state file, the newest valid slot."""
        self.check_open()
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
        if new.attrs_generation != self._meta.attrs_generation:  # set_attrs committed new ones
            paired = read_metadata(self._source)  # (the attributes with the state that names them)
            new = paired.state
            self._meta = replace(self._meta, attrs=paired.attrs, attrs_generation=paired.attrs_generation)
        if new.rewrites is not None and new.rewrites == old.rewrites:
            changed = slot_ranges(old.end, new.end, self.capacity)
        else:  # committed rows were rewritten (set()), which the state does not locate
            changed = [(0, self.capacity)]
        for leaf in self._leaves:
            leaf.invalidate(changed)
        for leaf in self._storage[len(self._leaves) :]:  # the side ring: any slot may have changed
            leaf.invalidate([(0, self._meta.frames.final_slots)])
        self._set_state(new)
        self._written = self._touched = new.end
        self._floor = new.first(self.capacity)
        return True
