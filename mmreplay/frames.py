"""Each frame stored once: next observations derived from the next step, frame stacks
rebuilt from single frames.

A pixel buffer that keeps ``obs`` and ``next_obs`` as ``[84, 84, 4]`` stacks stores
every frame eight times. With :class:`Frames` the store keeps one frame per row:

- **Derived next observations.** A row's next observation is the observation of the
  next step of the same env. Where it is not (the final observation of an episode that
  ended, whose slot holds the next episode's reset frame), the next frame goes to a
  small side ring, and the row holds its sequence number (``_frames/next``, 0: none).
  The newest step of a writer has no next step yet: the writer keeps its next frames in
  memory and writes them to the side ring at each commit, so a reader of the committed
  prefix never reads the slot the writer is about to fill.
- **Frame stacks.** Only the newest frame of each stack is stored; ``_frames/depth``
  holds how many earlier frames of the same episode the stack shows (at most ``k - 1``);
  slots before the episode's first frame repeat it (``pad="repeat"``, as the Atari
  wrappers do) or are zeros (``pad="zeros"``, as SB3's ``VecFrameStack``). Stacks are
  checked as they are added: one that is not the previous stack shifted by one frame,
  nor an episode's first stack, is refused.

Reads go through :class:`FrameLeaf` objects that stand in the logical leaves' place
(:attr:`mmreplay.Store.leaves`), so sampling, passes, episodes, exports and every compat
layer see the spec's shapes. A gather reads the ``k`` frames of each observation and the
one next frame once, and returns both as views of that one array (the next stack is the
observation stack shifted by one frame): stacks whose frame axis is the last one (HWC)
are strided views, no copy is made.

The side ring holds ``final_slots`` frames. Overwriting a side slot that a retained row
still needs drops the steps up to that row from the retained window (committed before
the slot is overwritten, so readers never read a torn frame). With frame stacks, once
steps have been dropped the oldest ``k - 1`` retained steps are not readable (their
earlier frames may be gone): the readable window starts ``k - 1`` steps later."""

from __future__ import annotations

import math
import sys
from typing import Any, Protocol

import numpy as np

from .errors import BadInputError, CorruptBufferError
from .frames_layout import DEPTH_LEAF, NEXT_LEAF, PREFIX, SIDE_DIR, Frames, FramesLayout, Pair
from .read.layout import gather_rows
from .roles import subtree
from .spec import ArraySpec, flatten, leaf_paths
from .statefile import State

__all__ = ["Frames", "FramesLayout", "FrameLeaf", "FrameWriter", "SIDE_DIR", "PREFIX"]

# --- reads --------------------------------------------------------------------------


class _Gather:
    """The frames of one observation leaf for a set of rows: its stack and its next frame,
    gathered together once (the observation and the next observation are views of it)."""

    def __init__(self, parts: _Parts, pair_index: int, pair: Pair, obs_spec: ArraySpec):
        self.parts = parts
        self.i = pair_index
        self.pair = pair
        self.obs_spec = obs_spec
        self.frames = parts.stored[pair.obs]
        self.cached: tuple[Any, np.ndarray] | None = None  # (rows and writer's step count, gather)
        # [n, k, *frame] -> the observation's layout: the stack axis moved into place (a view)
        nd = 1 + len(obs_spec.shape)
        self.order = None
        if pair.axis not in (None, 0):
            rest = [d for d in range(nd) if d != 1]
            self.order = tuple(rest[: pair.axis + 1] + [1] + rest[pair.axis + 1 :])

    def _sources(self, r: np.ndarray, with_next: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Frame rows ``[n, k (+1)]`` and a mask of the stack positions that are padding."""
        parts = self.parts
        k, ne, total = parts.layout.frame_stack, parts.num_envs, parts.rows
        width = k + (1 if with_next else 0)
        src = np.empty((len(r), width), np.int64)
        zero = None
        if k > 1:
            depth = parts.depth.take(r).astype(np.int64)
            back = np.arange(k - 1, -1, -1, dtype=np.int64)  # frames back of each position
            use = np.minimum(back[None, :], depth[:, None])
            src[:, :k] = r[:, None] - use * ne
            if parts.layout.pad == "zeros":
                zero = np.zeros((len(r), width), bool)
                zero[:, :k] = back[None, :] > depth[:, None]
        else:
            src[:, 0] = r
        if with_next:
            src[:, k] = r + ne
        np.remainder(src, total, out=src)
        return src, zero

    def gather(self, rows: np.ndarray, with_next: bool) -> np.ndarray:
        """``[n, k (+1), *frame]`` for flat rows ``rows``."""
        parts = self.parts
        r = np.remainder(np.asarray(rows, np.int64).reshape(-1), parts.rows)
        src, zero = self._sources(r, with_next)
        k = parts.layout.frame_stack
        side = newest = None
        if with_next:
            seq = parts.next.take(r)
            side = seq > 0
            writer = parts.writer
            if writer is not None and writer.has_pending:
                newest = (r // parts.num_envs == (writer.written - 1) % parts.capacity) & ~side
            # rows whose next frame is not the next row's read their own row there instead:
            # the next row may never have been written (a row-frame leaf refuses it)
            elsewhere = side if newest is None else side | newest
            src[elsewhere, k] = src[elsewhere, k - 1]
        out = self.frames.take(src)
        if zero is not None and zero.any():
            out[zero] = 0
        if side is not None and side.any():
            slots = (seq[side] - 1) % parts.layout.final_slots
            out[side, k] = parts.side_frames[self.i].take(slots)
        if newest is not None and newest.any():
            out[newest, k] = writer.pending[self.i][r[newest] % parts.num_envs]
        return out

    def arrange(self, g: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
        """``[n, k, *frame]`` as the observation's layout (a view), shaped ``lead``."""
        if self.pair.axis is None:
            g = g[:, 0]
        elif self.order is not None:
            g = g.transpose(self.order)
        return g if lead == g.shape[:1] else g.reshape(lead + self.obs_spec.shape)

    def _frames_of(self, rows: np.ndarray, is_next: bool) -> tuple[np.ndarray, int]:
        """The gather of ``rows`` and where its observation's (or next observation's)
        ``k`` frames start in it. The first of the two asked for the same rows gathers
        both and keeps the gather for the other."""
        writer = self.parts.writer
        written = None if writer is None else writer.written
        cached, self.cached = self.cached, None
        if cached is not None and cached[0][1] == written and np.array_equal(cached[0][0], rows):
            g = cached[1]
        else:
            paired = self.pair.next is not None and self.parts.layout.derived
            g = self.gather(rows, paired)
            if paired:  # a copy of the ids: a caller may reuse its index array
                self.cached = ((np.array(rows), written), g)
        return g, 1 if is_next else 0

    def read(self, rows: Any, is_next: bool) -> np.ndarray:
        """The observation (or next observation) of ``rows``."""
        rows = np.asarray(rows)
        g, lo = self._frames_of(rows, is_next)
        return self.arrange(g[:, lo : lo + self.parts.layout.frame_stack], rows.shape)

    def read_into(self, rows: np.ndarray, is_next: bool, out: np.ndarray, permute: tuple[int, int, int]) -> None:
        """:meth:`read` into ``out`` (uint8 ``[rows.size, row bytes]``), each observation
        (in the spec's layout) written transposed as ``permute`` says
        (:func:`.read.layout.gather_rows`): straight from the gathered frames."""
        g, lo = self._frames_of(rows, is_next)
        k, n = self.parts.layout.frame_stack, len(g)
        a, b, item = permute
        frame = g[0, 0].size if n else 0
        axis, last = self.pair.axis, len(self.obs_spec.shape) - 1
        if axis == last and last > 0:  # the spec's stack is [*frame, k]: the frames' transpose
            a, b = (1, a * b) if (a, b) == (frame, k) else (k, frame) if a == 1 else (0, 0)
        elif axis not in (None, 0):
            a = b = 0
        if not a:  # a stack axis in the middle: through the spec's layout
            stacks = np.ascontiguousarray(self.arrange(g[:, lo : lo + k], (n,)))
            gather_rows(stacks, out.shape[1], 0, np.arange(n), out, *permute)
            return
        stride = g.shape[1] * frame * item
        gather_rows(g, stride, lo * frame * item, np.arange(n), out, a, b, item)


class _Parts:
    """What the frame leaves of one store share: its stored leaves by path, the side ring
    and (in a writer) the writer's next frames of its newest step."""

    def __init__(
        self, layout: FramesLayout, stored: dict[str, Any], side: list[Any], capacity: int, num_envs: int
    ):
        self.layout = layout
        self.stored = stored
        self.capacity = capacity
        self.num_envs = num_envs
        self.rows = capacity * num_envs
        self.next = stored.get(NEXT_LEAF)
        self.depth = stored.get(DEPTH_LEAF)
        self.side_frames = side[:-1]
        self.side_ref = side[-1] if side else None
        self.writer: FrameWriter | None = None


class FrameLeaf:
    """A logical observation or next-observation leaf rebuilt from stored frames; it has
    the read side of :class:`mmreplay.backends.base.Leaf` (writes go through the store)."""

    mappable = False
    in_place = False
    atomic_replace = False
    ranged_read = False

    def __init__(self, info: Any, gather: _Gather, is_next: bool, num_envs: int):
        self.info = info
        self.num_envs = num_envs
        self.row_bytes = info.spec.nbytes
        self._gather = gather
        self._is_next = is_next

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self._gather.read(rows, self._is_next)

    def take_into(self, rows: np.ndarray, out: np.ndarray, permute: tuple[int, int, int]) -> None:
        self._gather.read_into(np.asarray(rows), self._is_next, out, permute)

    def read(self, slots: Any) -> np.ndarray:
        ne = self.num_envs
        if isinstance(slots, slice):
            slots = np.arange(self._gather.parts.capacity)[slots]
        slots = np.asarray(slots, np.int64)
        return self.take(slots[..., None] * ne + np.arange(ne))

    def read_rows(self, slots: Any, envs: Any) -> np.ndarray:
        slots, envs = np.broadcast_arrays(np.asarray(slots, np.int64), np.asarray(envs, np.int64))
        return self.take(slots * self.num_envs + envs)

    def advise(self, pattern: str, keep: tuple[int, int] | None = None) -> None:
        """The stored frames leaf is advised with the other stored leaves."""

    def willneed(self, rows: np.ndarray) -> None:
        """The stored frames leaf is prefetched with the other stored leaves."""

    def write(self, start: int, values: np.ndarray) -> None:
        raise BadInputError(f"leaf {self.info.path!r} is rebuilt from stored frames; write through the store")

    write_slots = write

    def flush(self, fsync: bool) -> None:
        """Nothing of its own to flush."""

    def invalidate(self, slots: Any) -> None:
        """The stored leaves are invalidated by the store."""

    def close(self) -> None:
        self._gather.cached = None


def read_leaves(meta: Any, stored: list[Any], side: list[Any]) -> tuple[list[Any], _Parts]:
    """The logical leaves (flatten order of the spec) over the stored ones."""
    from .metadata import LeafInfo

    layout: FramesLayout = meta.frames
    by_path = {leaf.info.path: leaf for leaf in stored}
    parts = _Parts(layout, by_path, side, meta.capacity, meta.num_envs)
    gathers: dict[str, _Gather] = {}
    for i, pair in enumerate(layout.pairs):
        gathers[pair.obs] = _Gather(parts, i, pair, subtree(meta.spec, pair.obs))
        if layout.derived and pair.next is not None:
            gathers[pair.next] = gathers[pair.obs]
    out = []
    for path, s in zip(leaf_paths(meta.spec), flatten(meta.spec)):
        gather = gathers.get(path)
        if gather is None:
            out.append(by_path[path])
            continue
        frames = by_path[gather.pair.obs].info
        info = LeafInfo(path, s, frames.chunk_steps, frames.compression)
        out.append(FrameLeaf(info, gather, path != gather.pair.obs, meta.num_envs))
    return out, parts


# --- writes --------------------------------------------------------------------------


class FrameHost(Protocol):
    """What a frame writer reads of its store (a view sharing the store's attributes)."""

    total_steps: int
    state: State  # the committed state

    def read_steps(self, steps: Any, leaves: list[int] | None = None) -> list[np.ndarray]: ...
    def _drop_through(self, step: int) -> None: ...  # the ring drops its steps up to ``step``


class FrameWriter:
    """The writer's side of the layout: turns each added step into the stored leaves,
    checks the stacks, and feeds the side ring.

    It keeps, per env, the newest step's stacks (to check the next ones) and its next
    frames (until the next step shows whether they are that step's frames). With derived
    next observations the stacks are checked in one pass per pair (:func:`check_pair`),
    which copies the next stacks into a spare buffer as it reads them: the buffers swap
    when the step is written, so a refused step changes nothing."""

    def __init__(self, store: FrameHost, meta: Any, parts: _Parts):
        self.store = store
        self.layout: FramesLayout = meta.frames
        self.parts = parts
        parts.writer = self
        self.capacity, self.num_envs = meta.capacity, meta.num_envs
        paths = leaf_paths(meta.spec)
        self.obs_index = [paths.index(p.obs) for p in self.layout.pairs]
        self.next_index = [paths.index(p.next) for p in self.layout.pairs if p.next is not None]
        nexts = {p.next for p in self.layout.pairs} if self.layout.derived else set()
        self.keep_index = [i for i, p in enumerate(paths) if p not in nexts]
        by_obs = {paths.index(p.obs): p for p in self.layout.pairs}
        self.axes = [by_obs[i].axis for i in self.obs_index]
        specs = flatten(meta.spec)
        self.dtypes = [specs[i].dtype for i in self.obs_index]
        self.native = native_check()
        self.written = store.total_steps
        ne = self.num_envs
        self.pending: list[np.ndarray] = []  # next frames of the newest step, per pair
        self.has_pending = False
        self.pending_in_side = np.zeros(ne, bool)  # the newest step's row already has a side entry
        # the newest step's stacks, per pair: its next observation stacks when those are
        # derived (the next step's stacks are these unless an episode ended), else its
        # observation stacks
        self.stacks: list[np.ndarray] | None = None
        # per pair, derived stacks: the next stacks of the step being added (they become
        # ``stacks`` when it is written), its frames to store, and its check's flags
        self.spare: list[np.ndarray | None] = [None] * len(self.obs_index)
        self.scratch: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.depth = np.zeros(ne, np.uint8)
        self.deeper = np.minimum(np.arange(256) + 1, max(0, self.layout.frame_stack - 1)).astype(np.uint8)
        # the common step, per pair: every env's stacks follow and equal the previous next stacks
        self.passed = bytes([FOLLOWS | NEWEST_SAME | NEXT_FOLLOWS]) * ne
        self.every_env = np.ones(ne, bool)
        self.no_side = np.zeros(ne, np.int64)  # a step's rows have no side entries when written
        for constant in (self.every_env, self.no_side):
            constant.setflags(write=False)
        self.seq: int | None = None  # side entries ever written (read on first need)
        # the buffers apply() writes the next step's kept stacks / pending frames into
        # (swapped in when it is written), and what it changed, for undo_step()
        self.spare_stacks: list[np.ndarray] | None = None
        self.spare_pending: list[np.ndarray] | None = None
        self.before: tuple[Any, ...] | None = None
        # the common step's plan (:meth:`_prepare_common`), where it applies: per pair, its
        # index, its leaves' indices, dtype and stack layout (positions before and bytes
        # after the stack axis); and where each stored frame goes among the stored leaves
        self.common: list[tuple[int, int, int, np.dtype, int, int]] | None = None
        self.frame_at = [(self.keep_index.index(i), j) for j, i in enumerate(self.obs_index)]
        if (
            self.native is not None
            and self.layout.derived
            and self.layout.stacked
            and all(axis is not None for axis in self.axes)
            and all(dtype.kind in "uib" for dtype in self.dtypes)
        ):
            self.common = []
            for j, (i, ni, axis, dtype) in enumerate(zip(self.obs_index, self.next_index, self.axes, self.dtypes)):
                shape = specs[i].shape
                inner = math.prod(shape[axis + 1 :]) * dtype.itemsize
                self.common.append((j, i, ni, dtype, math.prod(shape[:axis]), inner))

    # --- reopening ------------------------------------------------------------------

    def restore(self) -> None:
        """Take up where the last writer's committed steps end."""
        store = self.store
        end = store.total_steps
        # rows a dead writer may have overwritten are those its reservation covered
        first = max(0, max(end, store.state.reserved) - self.capacity)
        if end <= first:
            return
        last = np.array([end - 1])
        try:
            values = store.read_steps(last, leaves=self.obs_index + self.next_index)
            depth = None
            if self.layout.stacked:
                depth = self.parts.depth.read(last % self.capacity)[0].astype(np.uint8)
        except CorruptBufferError:
            if store.state.first(self.capacity) < end:
                raise  # a retained step's rows are damaged
            # every step was dropped (by recover) and its rows are gone: the next stacks
            # must start episodes
            return
        k = self.layout.frame_stack
        n = len(self.obs_index)
        if depth is not None:
            if end - 1 - int(depth.max()) >= first:  # else the next stacks must start episodes
                self.stacks = [np.ascontiguousarray(v[0]) for v in values[n:] if self.layout.derived] or [
                    np.ascontiguousarray(v[0]) for v in values[:n]
                ]
                self.depth = depth
        if self.layout.derived:
            self.pending = [_newest(v[0], axis, k) for v, axis in zip(values[n:], self.axes)]
            self.has_pending = True
            self.pending_in_side[:] = True

    def settable(
        self, slots: np.ndarray, values: list[np.ndarray], leaves: list[Any], where: str
    ) -> list[Any]:
        """For ``set``: the stored leaf each value is written to, None for the observation
        leaves, whose values must be those stored (a row's frames are its neighbours' too)."""
        out = []
        for leaf, value in zip(leaves, values):
            if isinstance(leaf, FrameLeaf):
                if not np.array_equal(leaf.read(slots), value, equal_nan=True):
                    raise BadInputError(
                        f"{where}: set() cannot change leaf {leaf.info.path!r} of a store that keeps each frame "
                        "once (a row's frames are its neighbours' too); only the other leaves can be set"
                    )
                out.append(None)
            else:
                out.append(leaf)
        return out

    # --- one step ---------------------------------------------------------------------

    def prepare(self, values: list[np.ndarray]) -> tuple[list[np.ndarray], Any]:
        """The stored leaves' values of one validated step, and what :meth:`apply` needs;
        raises :class:`~mmreplay.BadInputError` (nothing changed) on stacks that do not
        follow from the previous ones. Per pair one pass (:func:`check_pair`) compares the
        observation stacks with the previous step's next stacks (equal unless an episode
        ended: then they follow, and their newest frame is the pending next frame) and the
        next stacks with the observation stacks shifted by one frame; envs whose stacks do
        not follow are looked at one by one."""
        if self.common is not None and self.stacks is not None:
            got = self._prepare_common(values)
            if got is not None:
                return got
        k = self.layout.frame_stack
        derived = self.layout.derived
        frames, nexts, depth = [], [], self.depth
        continued = None  # per env: every pair's stacks are the previous step's next stacks
        newest_same: list[np.ndarray | None] = []  # per pair: the newest frame is the pending one
        for j, (i, axis) in enumerate(zip(self.obs_index, self.axes)):
            obs = values[i]
            same = None
            if axis is None:
                frames.append(obs)
            elif derived:
                a = axis + 1  # the env axis leads
                flags = self._check(j, obs, values[self.next_index[j]], a, k)
                if self.stacks is not None and flags.tobytes() == self.passed:
                    # the common step: every env's stacks are the previous next stacks
                    depth = self.deeper[self.depth]
                    same = both = self.every_env
                else:
                    depth = self._depths(obs, a, j, k, (flags & FOLLOWS) > 0)
                    if not (flags & NEXT_FOLLOWS).all():
                        raise BadInputError(
                            f"leaf {self.layout.pairs[j].next!r}, env {int(np.flatnonzero(~flags & NEXT_FOLLOWS)[0])}"
                            ": a next observation stack must be the observation stack shifted by one frame "
                            f"(leaf {self.layout.pairs[j].obs!r})"
                        )
                    both = None
                    if self.stacks is not None:
                        same = (flags & NEWEST_SAME) > 0
                        both = same & ((flags & FOLLOWS) > 0)
                if both is not None:
                    continued = both if continued is None else continued & both
                frames.append(self.scratch[j][0])
            else:  # observation stacks only: each follows the one before
                a = axis + 1
                frames.append(_part(obs, a, k - 1))
                follows = np.zeros(self.num_envs, bool) if self.stacks is None else _follows(obs, self.stacks[j], a, k)
                depth = self._depths(obs, a, j, k, follows)
            newest_same.append(same)
            if derived:
                nexts.append(values[self.next_index[j]])
        out = [values[i] for i in self.keep_index]
        for at, j in self.frame_at:
            out[at] = frames[j]
        if derived:
            out.append(self.no_side)
        if self.layout.stacked:
            out.append(depth)
        return out, (frames, nexts, depth, values, continued, newest_same)

    def check_batch(self, values: list[np.ndarray], n: int) -> None:
        """Each step of a batch after the first through :meth:`prepare` against the one
        before it, before any is written (the first is checked by its add)."""
        kept, index = self.stacks, self.next_index if self.layout.derived else self.obs_index
        try:
            for t in range(1, n if self.layout.stacked else 0):
                self.stacks = [np.ascontiguousarray(values[i][t - 1], d) for i, d in zip(index, self.dtypes)]
                self.prepare([v[t] for v in values])
        except BadInputError as exc:
            raise BadInputError(f"step {t} of the {n} given: {exc}") from None
        finally:
            self.stacks = kept

    def _prepare_common(self, values: list[np.ndarray]) -> tuple[list[np.ndarray], Any] | None:
        """:meth:`prepare` of the common step, in a few calls: derived next observations,
        every observation leaf stacked, the native check, stacks of the leaves' dtypes in
        C-contiguous memory, and every env's stacks the previous next stacks (else None:
        :meth:`prepare` looks again, from the start)."""
        native, k, passed, stacks, spare, scratch = (
            self.native, self.layout.frame_stack, self.passed, self.stacks, self.spare, self.scratch
        )
        assert stacks is not None
        for j, i, ni, dtype, outer, inner in self.common:
            obs, nxt, kept, kept_out, got = values[i], values[ni], stacks[j], spare[j], scratch.get(j)
            if (
                kept_out is None
                or got is None
                or obs.dtype != dtype
                or nxt.dtype != dtype
                or kept.dtype != dtype  # bytes are compared and copied: the same byte order too
                or kept_out.dtype != dtype
                or not (obs.flags.c_contiguous and nxt.flags.c_contiguous)
            ):
                return None
            native(obs, nxt, kept, kept_out, got[0], got[1], outer, k, inner)
            if got[1].tobytes() != passed:
                return None
        out = [values[i] for i in self.keep_index]
        frames = []
        for at, j in self.frame_at:
            out[at] = scratch[j][0]
            frames.append(scratch[j][0])
        depth = self.deeper[self.depth]
        out.append(self.no_side)
        out.append(depth)
        return out, (frames, None, depth, values, self.every_env, None)

    def _check(self, j: int, obs: np.ndarray, nxt: np.ndarray, a: int, k: int) -> np.ndarray:
        """Pair ``j``'s :func:`check_pair` flags of this step, in native code where it can."""
        spare = self.spare[j]
        if spare is None or spare.shape != nxt.shape:
            spare = self.spare[j] = np.empty(nxt.shape, self.dtypes[j])
        frame_shape = obs.shape[:a] + obs.shape[a + 1 :]
        got = self.scratch.get(j)
        if got is None or got[0].shape != frame_shape:
            words = np.empty((len(obs), obs.nbytes // len(obs) // 8), np.uint64)
            got = self.scratch[j] = (np.empty(frame_shape, self.dtypes[j]), np.empty(len(obs), np.uint8), words)
        newest, flags, words = got
        kept = None if self.stacks is None else self.stacks[j]
        check_pair(obs, nxt, kept, spare, newest, flags, a, k, self.native, words)
        return flags

    def _depths(self, obs: np.ndarray, a: int, j: int, k: int, follows: np.ndarray) -> np.ndarray:
        """Frames of the episode each env's stack shows before its newest one; refuses
        stacks that neither follow the previous ones nor start an episode."""
        if not follows.all():
            envs = np.flatnonzero(~follows)
            stacks = obs[envs]
            newest = _part(stacks, a, k - 1)
            is_start = np.ones(len(envs), bool)
            for pos in range(k - 1):
                before = _part(stacks, a, pos)
                zeros = self.layout.pad == "zeros"
                is_start &= (before == 0).reshape(len(envs), -1).all(axis=1) if zeros else _rows_equal(before, newest)
            if not is_start.all():
                raise BadInputError(
                    f"leaf {self.layout.pairs[j].obs!r}, env {int(envs[~is_start][0])}: a frame stack must be "
                    "the previous step's stack shifted by one frame, or an episode's first stack "
                    f"({self.layout.pad} padding); pass frames=Frames(frame_stack=1) to store stacks as they are"
                )
        return np.where(follows, self.deeper[self.depth], 0).astype(np.uint8)

    def apply(self, prepared: Any, step: int) -> None:
        """Before the step's rows are written: the previous step's rows whose next frame is
        not this step's frame get a side entry; then this step's frames become pending.
        What it changes in memory is kept until the next step, for :meth:`undo_step`."""
        frames, nexts, depth, values, continued, newest_same = prepared
        k = self.layout.frame_stack
        self.before = (
            self.written, self.stacks, self.spare, self.depth, self.pending, self.has_pending,
            self.pending_in_side.copy(), self.spare_stacks, self.spare_pending,
        )
        if self.layout.derived and self.has_pending and step > 0 and continued is not self.every_env:
            check = ~self.pending_in_side
            if continued is not None:  # a stack equal to the next stack has its newest frame
                check &= ~continued
            if check.any():
                envs = np.flatnonzero(check)
                differs = np.zeros(len(envs), bool)
                for p, f, same in zip(self.pending, frames, newest_same):
                    # the pending frames are the newest frames of the stacks checked against
                    differs |= ~same[envs] if same is not None else ~_rows_equal(f[envs], p[envs])
                if differs.any():
                    envs = envs[differs]
                    self._to_side(step - 1, envs, [p[envs] for p in self.pending])
        if self.layout.stacked:
            # kept as copies: the caller may reuse its arrays (VecFrameStack does)
            if self.layout.derived:  # the check copied them: swap the buffers
                old = self.stacks or [None] * len(self.spare)
                self.stacks, self.spare = list(self.spare), old
            else:  # copies of their own, in two sets of buffers used in turn
                kept = [values[i] for i in self.obs_index]
                spare = self.spare_stacks
                if spare is None:
                    spare = [np.empty_like(v) for v in kept]
                for mine, v in zip(spare, kept):
                    np.copyto(mine, v)
                self.spare_stacks, self.stacks = self.stacks, spare
            self.depth = depth
        if self.layout.derived:
            if self.layout.stacked:
                self.pending = [_part(s, axis + 1, k - 1) for s, axis in zip(self.stacks, self.axes)]
            else:  # copies of their own, in two sets of buffers used in turn
                spare = self.spare_pending
                if spare is None or len(spare) != len(nexts) or any(p.shape != n.shape for p, n in zip(spare, nexts)):
                    spare = [np.empty_like(n) for n in nexts]
                for mine, n in zip(spare, nexts):
                    np.copyto(mine, n)
                self.spare_pending, self.pending = self.pending or None, spare
            self.has_pending = True
            self.pending_in_side[:] = False
        self.written = step + 1

    def undo_step(self) -> None:
        """The step :meth:`apply` took in was not written (its add was cut short): back to
        the frames of the step before. The side entries it wrote stay: they are that
        step's, and right."""
        if self.before is None:
            return
        (
            self.written, self.stacks, self.spare, self.depth, self.pending, self.has_pending,
            self.pending_in_side, self.spare_stacks, self.spare_pending,
        ) = self.before
        self.before = None

    def before_commit(self, end: int) -> None:
        """The newest step's next frames into the side ring, so that readers of the
        committed prefix never need the slot after it."""
        if self.written == end + 1:  # the add of step `end` was cut short
            self.undo_step()
        if not (self.layout.derived and self.has_pending) or end != self.written:
            return
        need = ~self.pending_in_side
        if need.any():
            envs = np.flatnonzero(need)
            self._to_side(end - 1, envs, [p[envs] for p in self.pending])
            self.pending_in_side[envs] = True

    def _to_side(self, step: int, envs: np.ndarray, frames: list[np.ndarray]) -> None:
        parts = self.parts
        slots_total = self.layout.final_slots
        if self.seq is None:
            refs = parts.side_ref.read(slice(None)).reshape(-1, 2)
            self.seq = int(refs[:, 0].max()) if len(refs) else 0
        seqs = self.seq + np.arange(len(envs), dtype=np.int64)  # 0-based sequence numbers
        slots = seqs % slots_total
        old = parts.side_ref.read(slots).reshape(-1, 2)
        live = old[:, 0] > 0
        if live.any():
            self.store._drop_through(int(old[live, 1].max()))
        # the ring is written in order: as a ring leaf's rows, so that a compressed side
        # ring encodes them in the background and stores each segment once it is full,
        # rather than storing its segment again at every commit
        first = int(slots[0])
        head = min(len(envs), slots_total - first)  # the slots up to the ring's end, then from its start
        for leaf, f in zip(parts.side_frames, frames):
            leaf.write(first, f[:head, None])
            if head < len(f):
                leaf.write(0, f[head:, None])
        ref = np.stack([seqs + 1, np.full(len(envs), step, np.int64)], axis=1)
        parts.side_ref.write_slots(slots, ref[:, None])
        # In this order, should Ctrl-C cut in: entries are counted once written (a call cut
        # short before writes them again), and rows name them once counted (never two rows
        # one entry).
        self.seq += len(envs)
        self._write_next(step, envs, seqs + 1)

    def _write_next(self, step: int, envs: np.ndarray, values: np.ndarray) -> None:
        """Set the side-ring entries of some envs' rows of one step."""
        leaf = self.parts.next
        slot = np.array([step % self.capacity])
        row = np.array(leaf.read(slot))
        row[0, envs] = values
        leaf.write_slots(slot, row)


#: :func:`check_pair` flags, per env: the observation stack's first ``k - 1`` frames are the
#: kept stack's, its newest frame is the kept stack's newest, and the next stack's first
#: ``k - 1`` frames are the observation stack's last ``k - 1``
FOLLOWS, NEWEST_SAME, NEXT_FOLLOWS = 1, 2, 4


def native_check() -> Any:
    """The C extension's ``check_stacks``, or None where it is not built or
    ``MMREPLAY_NATIVE=0`` is set (then :func:`check_pair` runs in numpy)."""
    from .backends.native_rows import disabled, extension

    ext = None if disabled() else extension()
    return getattr(ext, "check_stacks", None)


def check_pair(
    obs: np.ndarray,
    nxt: np.ndarray,
    kept: np.ndarray | None,
    kept_out: np.ndarray,
    newest: np.ndarray,
    flags: np.ndarray,
    a: int,
    k: int,
    native: Any = None,
    words: np.ndarray | None = None,
) -> None:
    """One step's observation and next-observation stacks ``[num_envs, *stack]`` (the
    stack axis ``a``, ``k`` frames) against ``kept`` (the previous step's next stacks, or
    None): sets ``flags`` (uint8 per env, :data:`FOLLOWS` | :data:`NEWEST_SAME` |
    :data:`NEXT_FOLLOWS`), copies each observation stack's newest frame (the frame to
    store) into ``newest`` and ``nxt`` into ``kept_out``.

    With ``native`` (:func:`native_check`) and integer stacks of the buffers' dtype in
    C-contiguous memory, this is one pass over memory in C (bytes compared); else numpy
    does the same (``words``: scratch for :func:`_follows`).
    """
    if (
        native is not None
        and obs.dtype.kind in "uib"
        and obs.dtype == nxt.dtype == kept_out.dtype == newest.dtype
        and obs.flags.c_contiguous
        and nxt.flags.c_contiguous
        and (kept is None or (kept.dtype == obs.dtype and kept.flags.c_contiguous))
    ):
        outer = math.prod(obs.shape[1:a])
        inner = math.prod(obs.shape[a + 1 :]) * obs.dtype.itemsize
        native(obs, nxt, kept, kept_out, newest, flags, outer, k, inner)
        return
    flags[:] = 0
    if kept is not None:
        same = _rows_equal(obs, kept)
        prefix, last = same.copy(), same.copy()
        if not same.all():
            envs = np.flatnonzero(~same)
            prefix[envs] = _follows(obs[envs], kept[envs], a, k, shifted=False)
            last[envs] = _rows_equal(_part(obs[envs], a, k - 1), _part(kept[envs], a, k - 1))
        flags[prefix] |= FOLLOWS
        flags[last] |= NEWEST_SAME
    flags[_follows(nxt, obs, a, k, scratch=words)] |= NEXT_FOLLOWS
    # the step validator let through only values that cast to the leaf's dtype without loss
    np.copyto(newest, _part(obs, a, k - 1), casting="unsafe")
    np.copyto(kept_out, nxt, casting="unsafe")


def _newest(stack: np.ndarray, axis: int | None, k: int) -> np.ndarray:
    """The newest frame of ``[num_envs, *stack]`` values."""
    return np.array(stack) if axis is None else np.take(stack, k - 1, axis=axis + 1)


def _part(stack: np.ndarray, axis: int, pos: int | slice) -> np.ndarray:
    """Frame ``pos`` (or frames) of each stack along ``axis`` (a view)."""
    index: list[Any] = [slice(None)] * stack.ndim
    index[axis] = pos
    return stack[tuple(index)]


def _follows(
    stack: np.ndarray, prev: np.ndarray, axis: int, k: int, shifted: bool = True, scratch: np.ndarray | None = None
) -> np.ndarray:
    """Per env: are ``stack``'s first ``k - 1`` frames ``prev``'s last ``k - 1`` (or, with
    ``shifted=False``, ``prev``'s first ``k - 1``)?

    Compared as 64-bit words where the layout allows: stacks first (CHW) are runs of whole
    frames; with the stack on the last axis (HWC) and ``k`` frames of a pixel in 2, 4 or 8
    bytes, a word holds whole pixels, and shifting ``prev``'s words by one frame lines its
    frames up with ``stack``'s (a mask leaves each pixel's newest frame out).
    """
    ne = len(stack)
    if not shifted:
        return _rows_equal(_part(stack, axis, slice(0, k - 1)), _part(prev, axis, slice(0, k - 1)))
    words = _words(stack), _words(prev)
    item = stack.dtype.itemsize
    if words[0] is not None and words[1] is not None and stack.dtype == prev.dtype:
        mine, theirs = words
        if axis == 1 and (stack.nbytes // ne // k) % 8 == 0:  # whole frames: [ne, k, words of a frame]
            mine = mine.reshape(ne, k, -1)
            theirs = theirs.reshape(ne, k, -1)
            return (mine[:, : k - 1] == theirs[:, 1:]).reshape(ne, -1).all(axis=1)
        pixel = k * item
        if axis == stack.ndim - 1 and pixel in (2, 4, 8) and sys.byteorder == "little":
            keep = (1 << (8 * (pixel - item))) - 1
            mask = np.uint64(sum(keep << (8 * pixel * p) for p in range(8 // pixel)))
            # in place, in the caller's scratch words: temporaries of this size make the
            # allocator map and unmap pages at every call
            if scratch is None or scratch.shape != theirs.shape:
                scratch = np.empty_like(theirs)
            differ = np.right_shift(theirs, np.uint64(8 * item), out=scratch)
            differ ^= mine
            differ &= mask
            return ~differ.any(axis=1)
    return _rows_equal(_part(stack, axis, slice(0, k - 1)), _part(prev, axis, slice(1, k)))


def _words(a: np.ndarray) -> np.ndarray | None:
    """``[ne, ...]`` values as ``[ne, words]`` of uint64 (a view), or None if they are not
    contiguous whole words."""
    if not a.flags.c_contiguous or not len(a) or (a.nbytes // len(a)) % 8:
        return None
    return a.reshape(len(a), -1).view(np.uint8).view(np.uint64)


def _rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per env (leading axis): are ``a`` and ``b`` equal? Compared as 64-bit words when
    both are contiguous; floats bit for bit (a NaN pixel, a depth camera's missing return,
    equals itself)."""
    ne = len(a)
    if a.dtype == b.dtype and a.dtype.kind == "f" and a.dtype.itemsize in (2, 4, 8):
        a, b = a.view(f"u{a.dtype.itemsize}"), b.view(f"u{a.dtype.itemsize}")
    wa, wb = _words(a), _words(b)
    if wa is not None and wb is not None and a.dtype == b.dtype and a.shape == b.shape:
        return (wa == wb).all(axis=1)
    same = a == b
    if "f" in (a.dtype.kind, b.dtype.kind):
        same |= np.isnan(a) & np.isnan(b)
    return same.reshape(ne, -1).all(axis=1)
