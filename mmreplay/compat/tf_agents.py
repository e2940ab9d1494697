"""TF-Agents replay APIs over a persistent store: ``NumpyStorage`` and ``UniformReplayBuffer``.

Change the import, add ``path=``, and the buffer survives crashes and outgrows RAM::

    # from tf_agents.replay_buffers.tf_uniform_replay_buffer import TFUniformReplayBuffer
    from mmreplay.compat.tf_agents import UniformReplayBuffer
    rb = UniformReplayBuffer(agent.collect_data_spec, batch_size=env.batch_size,
                             max_length=100_000, path="run/replay")

Segments are the store's envs, one ``add_batch`` one store step; frame ids are global
step ids less the origin ``clear`` moves (store attribute ``compat_origin``). The ring is
``max_length`` plus the writer's reservation (the newest ``max_length`` frames survive a
crash). Draws go through the store's sampler, passes through ``Store.iterate``. Outputs
are numpy arrays, tensors once TensorFlow is imported. Differences: docs/tf-agents.md.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from ..errors import BadInputError, Error, NotEnoughDataError
from ..read import SampleInfo, SampleRequest
from ..read import sample as sample_store
from ..read.request import positive
from ..spec import ArraySpec, flatten, to_spec, unflatten
from ..store import DEFAULT_COMMIT_EVERY
from ._numpy_storage import NumpyStorage, broadcast_leaves
from ._shared import StoreOptions, StoreShell, attach_store, clear_steps, read_origin

__all__ = ["NumpyStorage", "UniformReplayBuffer", "BufferInfo", "BufferCheckpointError"]

_EMPTY = "TFUniformReplayBuffer is empty. Make sure to add items before sampling the buffer."


def _tensorflow() -> Any:
    """The layer's TensorFlow glue (:mod:`._tensorflow`) once TensorFlow is imported, else None."""
    if "tensorflow" in sys.modules:
        from . import _tensorflow

        return _tensorflow
    return None


def _as_returned(value: Any) -> Any:
    """``value`` as TF-Agents returns it: tensors once TensorFlow is imported."""
    tf_glue = _tensorflow()
    return value if tf_glue is None else tf_glue.as_tensors(value)


def _count(fn: Any) -> Any:
    """An int64 count ``fn()``, as TF-Agents returns it (inside a ``tf.function``, an op)."""
    tf_glue = _tensorflow()
    if tf_glue is None:
        return fn()
    if tf_glue.in_graph():
        return tf_glue.graph_call(lambda: [np.int64(fn())], [np.int64], [()])[0]
    return tf_glue.as_tensors(np.int64(fn()))


def _not_enough(message: str) -> NotEnoughDataError:
    """The error for a buffer too short to sample: also TF's ``InvalidArgumentError``,
    as TF-Agents raises, once TensorFlow is imported."""
    tf_glue = _tensorflow()
    return NotEnoughDataError(message) if tf_glue is None else tf_glue.EmptyBufferError(message)


class BufferCheckpointError(Error, ValueError):
    """A TF checkpoint restored over a buffer folder that does not hold the commit it
    recorded (another buffer, or a copy older than the checkpoint)."""


class BufferInfo(NamedTuple):
    """Where sampled items came from: their frame ids and sampling probabilities."""

    ids: Any
    probabilities: Any


class UniformReplayBuffer(StoreShell):
    """``TFUniformReplayBuffer`` on disk. Public methods call the hooks TF-Agents'
    ``ReplayBuffer`` subclasses implement (``_add_batch``, ``_get_next``, ``_gather_all``,
    ``_num_frames``, ``_clear``); ``_get_last_id()`` is there as TF-Agents' examples call it.

    Args:
        data_spec: the item spec (``TensorSpec`` / ``ArraySpec`` nest, e.g. a policy's
            ``collect_data_spec``); its roles are recorded, so episodes end where
            ``next_step_type`` is LAST.
        batch_size: items per ``add_batch`` (the leading dimension of every leaf).
        max_length: frames kept per batch segment.
        path: the buffer folder; reopened if it exists (ids, frames and cursor resume).
            ``None`` keeps the data in a temporary folder.
        dataset_drop_remainder, dataset_window_shift: as TF-Agents, for the
            deterministic pass of :meth:`as_dataset`.
        commit_every: ``add_batch`` calls per commit (1: each add is durable when it
            returns); a reopened buffer keeps the value it was created with.
        backend, compression, durability: as :func:`mmreplay.create`.
        seed: seed of the sampling rng (``None``: fresh entropy).
        sampler, alpha: ``sampler="prioritized"`` draws by priority (importance weights
            in ``last_sample.weight``; :meth:`update_priorities`). Recorded in the store.
        scope, device, table_fn, stateful_dataset: TF-Agents' keywords, accepted with no
            effect (no TF variables or tables hold the data).

    Example:
        >>> import numpy as np, mmreplay as mr, tempfile
        >>> rb = UniformReplayBuffer(mr.ArraySpec((), "int64"), batch_size=2, max_length=5,
        ...                          path=tempfile.mkdtemp() + "/rb", seed=0)
        >>> for t in range(7):
        ...     rb.add_batch(np.array([t, 100 + t]))
        >>> rb.num_frames()
        10
        >>> rb.gather_all().tolist()
        [[2, 3, 4, 5, 6], [102, 103, 104, 105, 106]]
        >>> items, info = rb.get_next(sample_batch_size=3, num_steps=2)
        >>> items.shape, info.ids.shape
        ((3, 2), (3, 2))
        >>> rb.close()
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        tf_glue = _tensorflow()
        if tf_glue is not None and cls is UniformReplayBuffer:  # trackable by tf.train.Checkpoint
            cls = tf_glue.trackable_class(cls)
        return super().__new__(cls)

    def __init__(
        self,
        data_spec: Any,
        batch_size: int,
        max_length: int = 1000,
        path: str | os.PathLike | None = None,
        dataset_drop_remainder: bool = False,
        dataset_window_shift: int | None = None,
        *,
        commit_every: int = DEFAULT_COMMIT_EVERY,
        backend: str | None = None,
        compression: Any = None,
        durability: str | None = None,
        seed: Any = None,
        sampler: str | None = None,
        alpha: float | None = None,
        scope: str = "TFUniformReplayBuffer",
        device: str = "cpu:*",
        table_fn: Any = None,
        stateful_dataset: bool = False,
    ):
        if table_fn is not None and getattr(table_fn, "__name__", None) != "Table":
            warnings.warn(
                f"table_fn={table_fn!r} is ignored: the store holds the data, not TF tables",
                RuntimeWarning,
                stacklevel=2,
            )
        self.scope = scope  # kept for code that reads it; no TF variables are made
        del device, stateful_dataset  # see the class docstring
        self._batch_size = positive("batch_size", batch_size)
        self._max_length = positive("max_length", max_length)
        self._window_shift = positive("dataset_window_shift", dataset_window_shift, allow_none=True)
        self._drop_remainder = bool(dataset_drop_remainder)
        self._data_spec = data_spec
        self._spec = to_spec(data_spec)
        self._leaf_specs: list[ArraySpec] = flatten(self._spec)
        self._rng = np.random.default_rng(seed)
        options = StoreOptions(
            backend=backend, compression=compression, commit_every=commit_every, durability=durability,
            sampler=sampler, sampler_options={} if alpha is None else {"alpha": alpha},
        )  # fmt: skip
        self.last_sample: SampleInfo | None = None  # the store's info of the last get_next
        self.store = attach_store(
            self, path, self._spec, self._max_length, self._batch_size, options,
            what="UniformReplayBuffer", window_name="max_length",
        )  # fmt: skip
        self._origin = read_origin(self.store)

    @property
    def data_spec(self) -> Any:
        return self._data_spec

    @property
    def capacity(self) -> int:
        """Frames the buffer holds: ``batch_size * max_length``."""
        return self._batch_size * self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def max_length(self) -> int:
        return self._max_length

    def _window(self) -> tuple[int, int]:
        """Global step ids ``[lo, hi)`` of the frames the buffer shows (newest ``max_length``)."""
        first, hi = self.store.window[:2]
        return max(first, self._origin, hi - self._max_length), hi

    @property
    def last_id(self) -> int:
        """Id of the newest frame (-1 when empty): adds since the last ``clear``, minus one."""
        return self.store.total_steps - self._origin - 1

    def _get_last_id(self) -> Any:
        """:attr:`last_id` as TF-Agents returns it (its examples log it)."""
        return _count(lambda: self.last_id)

    def num_frames(self) -> Any:
        """``min(adds * batch_size, batch_size * max_length)`` (int64 tensor once TF is imported)."""
        return self._num_frames()

    def _num_frames(self) -> Any:
        return _count(self._frames)

    def _frames(self) -> int:
        lo, hi = self._window()
        return (hi - lo) * self._batch_size

    def add_batch(self, items: Any) -> Any:
        """Add one item per segment: every leaf ``[batch_size, *shape]`` (a scalar leaf
        given as one scalar is broadcast). Works as a driver observer.

        Raises:
            mmreplay.BadInputError: wrong structure, batch size, shape or dtype; nothing
                is written and no id is used.
        """
        return self._add_batch(items)

    def _add_batch(self, items: Any) -> Any:
        try:
            self.store.add(items)
        except BadInputError:
            tf_glue = _tensorflow()
            if tf_glue is not None and tf_glue.in_graph():  # symbolic tensors: add when the graph runs
                return tf_glue.graph_add(self._add_batch, items)
            # A scalar for a leaf TF-Agents broadcasts to the batch; else the first error.
            broadcast = broadcast_leaves(self._spec, items, (self._batch_size,))
            if broadcast is items:
                raise
            self.store.add(broadcast)
        return None

    def clear(self) -> None:
        """Drop every frame; ids restart at 0 (the store keeps counting global steps)."""
        return self._clear()

    def _clear(self, clear_all_variables: bool = False) -> None:
        """``clear_all_variables`` (TF-Agents zeroes its tables too) changes nothing here."""
        self._origin = clear_steps(self.store)

    # --- reads ----------------------------------------------------------------------

    def get_next(
        self, sample_batch_size: int | None = None, num_steps: int | None = None, time_stacked: bool = True
    ) -> tuple[Any, BufferInfo]:
        """One uniform sample: ``(items, BufferInfo(ids, probabilities))``.

        Shapes: ``[D]``, ``[S, D]``, ``[T, D]``, ``[S, T, D]``; with ``time_stacked=False``
        and ``num_steps`` a tuple of ``T`` items (``[D]`` or ``[S, D]``), ids likewise.
        Start frame and segment are drawn independently and uniformly, with replacement;
        sequences never cross the cursor or the oldest frame. ``probabilities`` is
        ``1 / (valid starts * batch_size)`` (a prioritized buffer: the items'). Inside a
        ``tf.function`` the draw is an op that runs each time the function does.

        Raises:
            mmreplay.NotEnoughDataError: the buffer is empty or shorter than ``num_steps``
                (also ``tf.errors.InvalidArgumentError`` once TensorFlow is imported).
        """
        return self._get_next(sample_batch_size, num_steps, time_stacked)

    def _get_next(
        self, sample_batch_size: int | None = None, num_steps: int | None = None, time_stacked: bool = True
    ) -> tuple[Any, BufferInfo]:
        tf_glue = _tensorflow()
        if tf_glue is not None and tf_glue.in_graph():
            items, (ids, prob) = tf_glue.graph_get_next(self, sample_batch_size, num_steps)
        else:
            items, (ids, prob) = _as_returned(self._draw(sample_batch_size, num_steps))
        if num_steps is None or time_stacked:
            return items, BufferInfo(ids, prob)
        # one item (and id) per step: indexing splits numpy arrays and tensors alike
        at = (slice(None),) * (0 if sample_batch_size is None else 1)
        leaves = flatten(items)
        per_step = [at + (t,) for t in range(num_steps)]
        items = tuple(unflatten(self._spec, [x[i] for x in leaves]) for i in per_step)
        return items, BufferInfo(tuple(ids[i] for i in per_step), prob)

    def _draw(self, sample_batch_size: int | None, num_steps: int | None) -> tuple[Any, BufferInfo]:
        """:meth:`get_next` in numpy arrays, time stacked."""
        lo, hi = self._window()
        T = 1 if num_steps is None else positive("num_steps", num_steps)
        S = 1 if sample_batch_size is None else positive("sample_batch_size", sample_batch_size)
        if hi - lo - T + 1 <= 0:
            short = f" It holds {hi - lo} frames per segment, too short for num_steps={T}." if hi > lo else ""
            raise _not_enough(_EMPTY + short)
        request = SampleRequest.build(S, T, rng=self._rng, window=(lo, hi), return_info=True)
        nest, info = sample_store(self.store, request)
        self.last_sample = info
        leaves = flatten(nest)  # [S, T, ...], reshaped to the requested layout
        ids = info.step[:, None] + np.arange(T) - self._origin
        prob = info.probability.astype(np.float32)
        if num_steps is None:
            leaves, ids = [x[:, 0] for x in leaves], ids[:, 0]
        if sample_batch_size is None:
            leaves, ids, prob = [x[0] for x in leaves], ids[0], prob[0]
        return unflatten(self._spec, leaves), BufferInfo(ids, prob)

    def update_priorities(self, ids: Any, segments: Any, priorities: Any) -> int:
        """New priorities for sampled items, for a buffer created with
        ``sampler="prioritized"``: ``ids`` the frame id of each item's first frame
        (``info.ids``, or ``info.ids[:, 0]`` for sequences), ``segments`` its segment
        (``last_sample.env``), ``priorities`` ``[S]`` (or ``[S, T]``). Items the ring has
        dropped since they were sampled are skipped; returns how many were applied."""
        steps = np.asarray(ids, np.int64) + self._origin
        return self.store.update_priorities(steps, segments, np.asarray(priorities))

    def gather_all(self) -> Any:
        """Every frame: leaves ``[batch_size, n, *shape]``, each segment in time order
        (inside a ``tf.function``, as PPO's and REINFORCE's train steps call it, an op
        that reads when the function runs)."""
        return self._gather_all()

    def _gather_all(self) -> Any:
        tf_glue = _tensorflow()
        if tf_glue is not None and tf_glue.in_graph():
            shapes = [(self._batch_size, None, *s.shape) for s in self._leaf_specs]
            dtypes = [s.dtype for s in self._leaf_specs]
            return unflatten(self._spec, tf_glue.graph_call(self._gather_leaves, dtypes, shapes))
        return _as_returned(unflatten(self._spec, self._gather_leaves()))

    def _gather_leaves(self) -> list[np.ndarray]:
        lo, hi = self._window()
        return [np.swapaxes(x, 0, 1) for x in self.store.read_steps(np.arange(lo, hi))]

    def as_dataset(
        self,
        sample_batch_size: int | None = None,
        num_steps: int | None = None,
        num_parallel_calls: int | None = None,
        single_deterministic_pass: bool = False,
    ) -> Any:
        """Items as ``(items, BufferInfo)`` pairs: a ``tf.data.Dataset`` when TensorFlow
        is installed, else a Python iterator of numpy arrays.

        Random mode (the default) repeats :meth:`get_next` forever. With
        ``single_deterministic_pass=True`` every frame present when the iteration starts
        is visited once (as TF-Agents reads its range then): segment by segment (or, with
        ``sample_batch_size``, group of segments by group, each item stacking the group),
        each in time order, in windows of ``num_steps`` that step by
        ``dataset_window_shift`` (default ``num_steps``; ``max_length=5``, ``num_steps=2``:
        ``[0,1],[2,3],[4]``); a shorter last window or smaller last group is kept unless
        ``dataset_drop_remainder``. ``BufferInfo.probabilities`` is ``()`` there.

        Raises:
            ValueError: ``dataset_drop_remainder`` would drop all data (``sample_batch_size
                > batch_size`` or ``num_steps > max_length``).
            mmreplay.NotEnoughDataError: while iterating, adds made since the pass began
                overwrote frames it had still to read.
        """
        del num_parallel_calls  # one generator feeds the dataset
        positive("sample_batch_size", sample_batch_size, allow_none=True)
        positive("num_steps", num_steps, allow_none=True)
        if single_deterministic_pass:
            if self._drop_remainder and (
                (sample_batch_size is not None and sample_batch_size > self._batch_size)
                or (num_steps is not None and num_steps > self._max_length)
            ):
                raise ValueError(
                    "ALL data will be dropped: dataset_drop_remainder is True and "
                    f"sample_batch_size={sample_batch_size} > batch_size={self._batch_size} or "
                    f"num_steps={num_steps} > max_length={self._max_length}"
                )
            make = lambda: self._deterministic_pass(sample_batch_size, num_steps)  # noqa: E731
        else:
            make = lambda: self._random_items(sample_batch_size, num_steps)  # noqa: E731
        if importlib.util.find_spec("tensorflow") is None:
            return make()
        from . import _tensorflow  # imports TensorFlow: as_dataset is a tf.data.Dataset where it is installed

        return _tensorflow.dataset(
            self, make, BufferInfo, sample_batch_size, num_steps, single_deterministic_pass
        )

    def _random_items(
        self, sample_batch_size: int | None, num_steps: int | None
    ) -> Iterator[tuple[Any, BufferInfo]]:
        while True:
            yield self._draw(sample_batch_size, num_steps)

    def _deterministic_pass(
        self, sample_batch_size: int | None, num_steps: int | None
    ) -> Iterator[tuple[Any, BufferInfo]]:
        lo, hi = self._window()  # the frames present when the iteration starts
        if hi <= lo:
            raise _not_enough(_EMPTY)
        # the store's pass stacks a group of segments at the same window, as TF-Agents does
        for nest, steps, envs in self.store.iterate(
            batch_size=sample_batch_size,
            num_steps=num_steps,
            window_shift=None if num_steps is None else self._window_shift,
            drop_remainder=self._drop_remainder,
            window=(lo, hi),
            group_envs=True,
            return_steps=True,
        ):
            # TF-Agents' ids here are table rows: the segment's offset plus the frame id
            ids = steps - self._origin + envs * self._max_length
            yield unflatten(self._spec, flatten(nest)), BufferInfo(ids, ())

    # --- life cycle -----------------------------------------------------------------

    def _check_restored(self, saved_steps: int, saved_origin: int, saved_created: float) -> None:
        """Compare the folder with the commit a TF checkpoint recorded: another buffer or
        an older folder is an error; later adds are kept, with a warning saying so."""
        store, origin = self.store, self._origin
        steps, saved_adds = store.committed_steps, saved_steps - saved_origin
        if store.metadata.created != saved_created:
            raise BufferCheckpointError(
                f"{store.path}: the checkpoint was saved with another replay buffer (created at "
                f"{saved_created:.6f}, this one at {store.metadata.created:.6f}); create the buffer "
                "with the path it had when the checkpoint was saved"
            )
        if steps < saved_steps:
            raise BufferCheckpointError(
                f"{store.path}: the checkpoint was saved after {saved_adds} adds, the buffer folder holds "
                f"only {steps - origin}: the folder is older than the checkpoint (a copy made before "
                "it?). Restore the buffer folder saved with the checkpoint, or an older checkpoint."
            )
        if steps > saved_steps or origin != saved_origin:
            warnings.warn(
                f"{store.path}: the buffer holds {steps - saved_steps} adds made after the checkpoint was "
                f"saved{' and was cleared since' if origin != saved_origin else ''} (it was saved after "
                f"{saved_adds} adds); they are kept and sampled. Restore the newest checkpoint to resume "
                "where the buffer is, or clear() the buffer to start it over.",
                RuntimeWarning,
                stacklevel=3,
            )

    def __repr__(self) -> str:
        frames = self._frames() if not self.store.closed else "?"
        return (
            f"<mmreplay.compat.tf_agents.UniformReplayBuffer batch_size={self._batch_size} "
            f"max_length={self._max_length} num_frames={frames} path={self.store.path!r}>"
        )
