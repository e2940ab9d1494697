"""The store: a folder holding one ring array per leaf and the committed state.

The store is a :class:`mmreplay.ring.Ring` (its cursor, writes and commit protocol) with
its open modes, the writer lock, its description, reads and life cycle;
:mod:`mmreplay.opening` opens what it is made of.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from . import episodes as _episodes
from . import exits, opening
from . import frames as _frames
from .backends import native_rows
from .errors import BufferExistsError, ClosedError
from .hooks import WriteHook, overrides
from .io import ByteSource, LocalFolder
from .lock import WriterLock
from .metadata import Metadata
from .read import advice as _advice
from .read import gather as _gather
from .read import passes as _passes
from .read.request import SampleRequest
from .ring import Ring
from .samplers.base import Sampler
from .values import StepValidator

__all__ = ["Store", "open", "BufferExistsError"]

DEFAULT_COMMIT_EVERY = 1000


class Store(Ring):
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
        with exits.opening(path, lock) if mode == "a" else contextlib.nullcontext():
            self.path = path
            # where the state and the leaves are read from: the folder ``path``, or an
            # object-store prefix (:mod:`mmreplay.io`)
            self._source = source = source if source is not None else LocalFolder(path)
            self.mode = mode
            self._meta = meta
            self._lock = lock
            self._capacity = meta.capacity
            self._num_envs = meta.num_envs
            self._validator = StepValidator(meta.spec, meta.num_envs)
            self._decode_setting: int | None = None  # set_decode_threads
            self._closed = False
            self._close_lock = threading.RLock()  # one close at a time: a thread's and the exit hooks'
            self._plain_requests: dict[int, SampleRequest] = {}  # (see sample)
            # one check on the hot path: False once closed, and in a writer that reopened
            # the store until its first step (see _before_write)
            self._writable = mode == "a"
            contents = opening.open_contents(source, meta, mode == "a", lock, sampler)
            self._state_file = contents.state_file
            self._closers = contents.closers
            self._leaves = contents.leaves
            self._storage = contents.storage
            self._file_flushes = contents.file_flushes
            self._read_leaves = contents.read_leaves
            self._setters = contents.setters
            self._all_mapped = all(leaf.mappable for leaf in self._storage)
            # With every leaf mapped, `add` stores into the arrays directly: `a[i] = v` is
            # cheaper than calling a bound `__setitem__`.
            self._arrays = [leaf.array for leaf in self._leaves] if self._all_mapped else None
            self._frames: Any = None  # mmreplay.frames.FrameWriter of a writer of a frames-once store
            self._shrink = meta.frames.shrink if meta.frames is not None else 0
            self._start_cursor(meta.state)
            self._parts: dict[str, Any] = {}  # see part(): the read path, the episode index...
            self._populator: Any = None  # mmreplay.read.advice.Populator, started by open()
            self._hooks: list[WriteHook] = []
            self._on_add: list[Any] = []  # bound on_add of the hooks that override it
            self._sampler = contents.sampler
            try:
                # hooks, the sampler and the parts keep this view, no reference to the store itself
                me = self._view = opening.attribute_view(self)
                self.add_write_hook(_episodes.EpisodeHook(me))
                self._sampler.attach(me)
                self.add_write_hook(self._sampler)
                if contents.frame_parts is not None and mode == "a":
                    self._frames = _frames.FrameWriter(me, meta, contents.frame_parts)
                    self._frames.restore()
            except BaseException:
                self._closed = True
                contents.close()
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
        """User attributes kept in the metadata (JSON values), as of open, the last
        :meth:`set_attrs` or (readers) the last :meth:`refresh` that found new ones."""
        return json.loads(json.dumps(self._meta.attrs))

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
    def sampler(self) -> Sampler:
        """The sampler :meth:`sample` draws through (chosen at :func:`create`, recorded
        in the metadata)."""
        return self._sampler

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
        if self._forked:  # the parent's writer: its files and commits are the parent's
            self._closed = True
            return
        self._busy = True  # a close under way is a write: the exit hooks wait for it (exits._stop_writes)
        try:
            with self._close_lock:  # a thread's close as the exit hooks close the store: theirs first
                if self._closed:
                    return
                with exits.closing(self._finalizer):  # a stop signal waits for the last commit
                    self._close()
        finally:
            self._busy = False

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
        self.check_open()  # (a closed store calls no hook again)
        self._hooks.append(hook)
        if overrides(hook, "on_add"):
            self._on_add.append(hook.on_add)

    def check_open(self) -> None:
        """Raise :class:`~mmreplay.ClosedError` once the store is closed."""
        if self._closed:
            raise ClosedError(f"{self.path}: store is closed")

    # --- read settings ---------------------------------------------------------------

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
        if (
            type(batch_size) is int
            and num_steps is None
            and not options
            and replacement is True
            and within_episodes is None
            and not return_info
            and window is None
            and out is None
            and layout is None
            and transform is None
        ):  # the common call: its request is a value, built once per batch size and generator
            request = self._plain_requests.get(batch_size)
            if request is None or request.rng is not rng:  # (an int seed makes a new generator)
                request = SampleRequest.build(batch_size, rng=rng)
                if len(self._plain_requests) < 64:
                    self._plain_requests[batch_size] = request
        else:
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
    read_steps = _gather.read_steps
    get = _gather.get_steps
    episodes = _episodes.episodes
    episode_index = _episodes.episode_index
    to_arrays = _episodes.to_arrays

    def episode_bounds(self, steps: Any, envs: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first, last, complete)`` of the episode each row ``(steps[i], envs[i])`` of the
        window lies in, from the episode index (:func:`mmreplay.episodes.episode_bounds`)."""
        self.check_open()
        return _episodes.episode_bounds(self, steps, envs)


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
    source, meta, lock = opening.open_folder(os.fspath(path), mode, populate, storage_options)
    store = Store(source.url, meta, mode, lock, source=source)
    if not continue_episodes:  # the writer's first step ends the open episodes (_before_write)
        store._writable = False
    store._populator = _advice.populate_at_open(store, populate)
    return store
