"""TF-Agents replay APIs over a persistent store: ``NumpyStorage`` and ``UniformReplayBuffer``.

Change the import, add ``path=``, and the buffer survives crashes and outgrows RAM::

    # from tf_agents.replay_buffers.tf_uniform_replay_buffer import TFUniformReplayBuffer
    from mmreplay.compat.tf_agents import UniformReplayBuffer
    rb = UniformReplayBuffer(agent.collect_data_spec, batch_size=env.batch_size,
                             max_length=100_000, path="run/replay")

Specs are TF-Agents ``ArraySpec`` / ``BoundedArraySpec`` / ``TensorSpec`` nests (a
policy's ``collect_data_spec`` / ``trajectory_spec`` included), or anything
:func:`mmreplay.to_spec` takes; TensorFlow itself is imported only by
``as_dataset`` when it is installed. Outputs are numpy arrays in the spec's nest.

How the TF-Agents model maps onto the store:

- ``batch_size`` segments are the store's envs, and one ``add_batch`` is one step
  (``store.add``). Frame ids are the global add counter since the last ``clear``
  (the store's global step id less the origin kept in the store attribute ``compat_origin``), so they
  survive a reopen.
- The store's ring is ``max_length`` plus the writer's reservation (see
  :func:`mmreplay.compat._shared.ring_capacity`), so the newest ``max_length`` frames
  are still there after a crash; the layer only ever shows those.
- Adds are committed every ``commit_every`` calls (the store's default, 1000), so a
  crash loses at most that many; ``commit_every=1`` makes each ``add_batch`` durable
  when it returns, at the cost of one atomic replace of the metadata file per add
  (0.2 to 0.8 ms on the machine the README quotes, against about 8 us for the add).
  Either way the writing process reads every frame it added, committed or not.
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
from ..reads import SampleInfo
from ..spec import ArraySpec, flatten, is_namedtuple, to_spec, unflatten
from ..store import DEFAULT_COMMIT_EVERY
from ..values import StepValidator
from ._shared import (
    StoreOptions,
    StoreShell,
    attach_store,
    flatten_like,
    read_origin,
    write_origin,
)

__all__ = ["NumpyStorage", "UniformReplayBuffer", "BufferInfo", "BufferCheckpointError"]

_EMPTY = "TFUniformReplayBuffer is empty. Make sure to add items before sampling the buffer."


def _tensorflow() -> Any:
    """The layer's TensorFlow glue (:mod:`._tensorflow`) once TensorFlow is imported, else None."""
    if "tensorflow" not in sys.modules:
        return None
    from . import _tensorflow

    return _tensorflow


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


def _is_array_spec(x: Any) -> bool:
    """A TF-Agents ``ArraySpec`` / ``BoundedArraySpec`` (or :class:`mmreplay.ArraySpec`).

    Recognised without importing TF-Agents: a shape and a *numpy* dtype, and neither an
    array value nor a space. A ``tf.TensorSpec`` has a ``tf.DType`` and is refused, as
    ``NumpyStorage`` refuses it.
    """
    if isinstance(x, ArraySpec):
        return True
    if isinstance(x, (np.ndarray, np.generic)) or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return False
    if hasattr(x, "sample") and hasattr(x, "contains"):  # a gymnasium space
        return False
    return isinstance(x.dtype, np.dtype) or (isinstance(x.dtype, type) and issubclass(x.dtype, np.generic))


def _nest_leaves(nest: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a raw spec nest, before conversion (dict keys sorted)."""
    if isinstance(nest, dict):
        for key in sorted(nest):
            yield from _nest_leaves(nest[key], f"{prefix}/{key}" if prefix else str(key))
    elif is_namedtuple(nest):
        for field, value in zip(nest._fields, nest):
            yield from _nest_leaves(value, f"{prefix}/{field}" if prefix else field)
    elif isinstance(nest, (tuple, list)):
        for i, value in enumerate(nest):
            yield from _nest_leaves(value, f"{prefix}/{i}" if prefix else str(i))
    else:
        yield prefix or "data_spec", nest


def _broadcast_leaves(spec: Any, value: Any, lead: tuple[int, ...]) -> Any:
    """Broadcast scalar leaves of ``value`` to ``lead + leaf shape`` (as TF's scatter does)."""
    values = flatten_like(spec, value)
    if values is None:
        return value  # the store names the structural mismatch
    out = []
    changed = False
    for s, v in zip(flatten(spec), values):
        if v is not None and np.ndim(v) == 0 and (lead or s.shape):
            v = np.broadcast_to(np.asarray(v), (*lead, *s.shape))
            changed = True
        out.append(v)
    return unflatten(spec, out) if changed else value


# --- NumpyStorage --------------------------------------------------------------------


class NumpyStorage(StoreShell):
    """``tf_agents.utils.numpy_storage.NumpyStorage`` on disk: one array per leaf.

    ``get(idx)`` / ``set(idx, value)`` take and return the spec's nest; ``idx`` is a
    slot in ``[0, capacity)`` (negative wraps, slices and index arrays batch, anything
    else out of range raises ``IndexError``), and a slot never set reads as zeros.

    Layout: a store with one env and ``capacity + 1`` slots, where slot ``i`` is global
    step ``i``. Slots are appended in order as they are first set (a gap is filled with
    zeros), the ring never wraps, and every ``set`` is committed when it returns.

    Deliberate differences from TF-Agents: ``get`` returns copies, not views; ``set``
    checks the value's structure against the spec (TF-Agents assigns leaves by
    position, so a dict missing a key shifts the others) and refuses unsafe casts
    (TF-Agents stores ``300`` in a ``uint8`` leaf as ``44``); scalars still broadcast.

    Args:
        data_spec: a nest of TF-Agents ``ArraySpec`` / ``BoundedArraySpec``.
        capacity: slots in the storage.
        path: the buffer folder; reopened (and checked) if it exists. ``None`` keeps
            the data in a temporary folder removed on ``close()``.
        backend, compression: as :func:`mmreplay.create`.

    Raises:
        ValueError: ``data_spec`` holds something that is not an array spec (the error
            names the leaf).
        mmreplay.SpecMismatchError: a different buffer exists at ``path``.

    Example:
        >>> import numpy as np, mmreplay as mr, tempfile
        >>> spec = {"foo": mr.ArraySpec((4,), "uint8"), "bar": mr.ArraySpec((3, 7), "float32")}
        >>> storage = NumpyStorage(spec, capacity=5, path=tempfile.mkdtemp() + "/s")
        >>> storage.set(2, {"foo": np.arange(4), "bar": np.ones((3, 7))})
        >>> storage.get(2)["foo"], storage.get(0)["foo"]
        (array([0, 1, 2, 3], dtype=uint8), array([0, 0, 0, 0], dtype=uint8))
        >>> storage.close()
    """

    def __init__(
        self,
        data_spec: Any,
        capacity: int,
        path: str | os.PathLike | None = None,
        *,
        backend: str | None = None,
        compression: Any = None,
    ):
        for where, leaf in _nest_leaves(data_spec):
            if not _is_array_spec(leaf):
                raise ValueError(
                    "The data_spec parameter must be an instance or nest of array_spec.ArraySpec. "
                    f"Got: {leaf!r} at leaf {where!r}"
                )
        if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self._data_spec = data_spec
        self._spec = to_spec(data_spec)
        self._capacity = int(capacity)
        self._leaf_specs: list[ArraySpec] = flatten(self._spec)
        self._store_spec = self._spec
        self._validator = StepValidator(self._store_spec, 1)
        options = StoreOptions(backend=backend, compression=compression, commit_every=1)
        self.store, _ = attach_store(
            self, path, self._spec, self._capacity, 1, options, what="NumpyStorage", window_name="capacity"
        )

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def data_spec(self) -> Any:
        return self._data_spec

    def _slots(self, idx: Any) -> tuple[np.ndarray, bool]:
        scalar = isinstance(idx, (int, np.integer)) and not isinstance(idx, bool)
        try:
            slots = np.arange(self._capacity)[idx]
        except IndexError as exc:
            raise IndexError(
                f"index {idx!r} is out of range for a NumpyStorage of capacity {self._capacity}"
            ) from exc
        return np.asarray(slots, np.int64), scalar

    def get(self, idx: Any) -> Any:
        """The item(s) at ``idx``: the spec's nest, leaves ``[*shape]`` or ``[k, *shape]``."""
        slots, _ = self._slots(idx)
        written = self.store.total_steps
        have = slots < written
        env0 = (slice(None),) * slots.ndim + (0,)
        if have.all():
            leaves = [leaf[env0] for leaf in self.store.read_steps(slots)]
        else:
            read = self.store.read_steps(slots[have]) if have.any() else None
            leaves = []
            for i, s in enumerate(self._leaf_specs):
                out = np.zeros((*slots.shape, *s.shape), s.dtype)
                if read is not None:
                    out[have] = read[i][:, 0]
                leaves.append(out)
        return unflatten(self._spec, leaves)

    def set(self, idx: Any, value: Any) -> None:
        """Store ``value`` (the spec's nest; ``[k, ...]`` leaves for a slice or index array)."""
        slots, scalar = self._slots(idx)
        lead = () if scalar else slots.shape
        value = _broadcast_leaves(self._spec, value, lead)
        store = self.store
        # Validate everything before the first byte (or zero gap) is written.
        if scalar:
            leaves = self._validator.step(_add_env_axis(self._spec, value, 0))
            leaves = [v[None] for v in leaves]
            flat_slots = slots.reshape(1)
        else:
            _, leaves = self._validator.batch(
                _add_env_axis(self._spec, value, len(lead)), lead=lead
            )
            flat_slots = slots.reshape(-1)
            leaves = [v.reshape(-1, *v.shape[len(lead) :]) for v in leaves]
        top = int(flat_slots.max()) + 1 if flat_slots.size else 0
        if top > store.total_steps:
            self._append_zeros(top - store.total_steps)
        store.set(flat_slots - store.first_step, unflatten(self._store_spec, leaves))
        store.commit()

    def _append_zeros(self, n: int) -> None:
        """Append ``n`` zero slots, in blocks of at most about 64 MiB."""
        step_bytes = max(1, sum(s.nbytes for s in self._leaf_specs))
        block = max(1, min(n, (64 << 20) // step_bytes))
        while n > 0:
            k = min(block, n)
            self.store.extend(
                unflatten(self._store_spec, [np.zeros((k, 1, *s.shape), s.dtype) for s in self._leaf_specs])
            )
            n -= k

    def __repr__(self) -> str:
        return f"<mmreplay.compat.tf_agents.NumpyStorage capacity={self._capacity} store={self.store!r}>"


def _add_env_axis(spec: Any, value: Any, axis: int) -> Any:
    """Insert the store's env axis (one env) into every leaf of ``value`` at ``axis``."""
    values = flatten_like(spec, value)
    if values is None:
        return value
    return unflatten(spec, [v if v is None else np.expand_dims(np.asarray(v), axis) for v in values])


# --- UniformReplayBuffer -----------------------------------------------------------


class UniformReplayBuffer(StoreShell):
    """``TFUniformReplayBuffer`` on disk: batched adds, uniform sampling, numpy outputs.

    Args:
        data_spec: the item spec (a nest of ``TensorSpec`` / ``ArraySpec``, e.g. a
            policy's ``collect_data_spec``). Its roles (observation, action, reward,
            ``step_type`` / ``next_step_type``, discount) are recorded in the store, so
            episodes end where ``next_step_type`` is LAST.
        batch_size: items per ``add_batch`` (the leading dimension of every leaf).
        max_length: frames kept per batch segment.
        path: the buffer folder; if it exists it is reopened (ids, frames and the
            cursor resume). ``None`` keeps the data in a temporary folder.
        dataset_drop_remainder, dataset_window_shift: as TF-Agents, for the
            deterministic pass of :meth:`as_dataset`.
        commit_every: ``add_batch`` calls per commit (1: each add is durable when it
            returns); a reopened buffer keeps the value it was created with.
        backend, compression, durability: as :func:`mmreplay.create`.
        seed: seed of the sampling rng (``None``: fresh entropy).
        sampler, alpha: ``sampler="prioritized"`` (with its ``alpha``) makes
            :meth:`get_next` draw by priority (``BufferInfo.probabilities`` are the
            items' probabilities; ``last_sample.weight`` their importance weights);
            new priorities go in with :meth:`update_priorities`. Recorded in the store,
            so a reopened buffer keeps them.

    Deliberate differences from TF-Agents (its behaviour in brackets):

    - An ``add_batch`` with the wrong structure or batch size raises
      :class:`mmreplay.BadInputError` (a ``ValueError``) and uses up no id [the id is
      consumed and its slot later serves stale data].
    - Sampling an empty or too short buffer raises :class:`mmreplay.NotEnoughDataError`
      (a ``ValueError``) with TF-Agents' message, also a ``tf.errors.InvalidArgumentError``
      once TensorFlow is imported [only the latter].
    - ``scope``, ``device``, ``table_fn`` and ``stateful_dataset`` are keyword-only and
      have no effect (no TF variables or tables hold the data) [positional].
    - A ``tf.train.Checkpoint`` of the buffer records the store's commit, not the
      frames, which stay in the folder; restoring checks the folder holds that commit
      (:class:`BufferCheckpointError` if it is older or another buffer, a warning if it
      holds later adds) [the frames are in the checkpoint].
    - The deterministic pass reads frame ids, not raw table rows, so it is right after
      the ring wraps for any ``batch_size`` [for ``batch_size > 1`` it reads the next
      segment]; with ``sample_batch_size`` its windows stay inside each segment group
      [they span groups when ``max_length % num_steps != 0``]; a last smaller group of
      segments or shorter window is yielded unless dropped [an error]. Its
      ``BufferInfo.ids`` are those frame ids [``segment * max_length + frame``].
    - ``as_dataset`` accepts specs holding lists [``ValueError``]; ``num_parallel_calls``
      is accepted and has no effect.
    - ``gather_all`` is not deprecated: it is how one reads everything back.

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
        durability: str = "process",
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
        for name, value in (("batch_size", batch_size), ("max_length", max_length)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if dataset_window_shift is not None and (
            not isinstance(dataset_window_shift, (int, np.integer)) or dataset_window_shift < 1
        ):
            raise ValueError(
                f"dataset_window_shift must be a positive int or None, got {dataset_window_shift!r}"
            )
        self._data_spec = data_spec
        self._spec = to_spec(data_spec)
        self._leaf_specs: list[ArraySpec] = flatten(self._spec)
        self._batch_size = int(batch_size)
        self._max_length = int(max_length)
        self._drop_remainder = bool(dataset_drop_remainder)
        self._window_shift = None if dataset_window_shift is None else int(dataset_window_shift)
        self._rng = np.random.default_rng(seed)
        options = StoreOptions(
            backend=backend,
            compression=compression,
            commit_every=commit_every,
            durability=durability,
            sampler=sampler,
            sampler_options=None if alpha is None else {"alpha": alpha},
        )
        self.last_sample: SampleInfo | None = None  # the store's info of the last get_next
        self.store, _ = attach_store(
            self,
            path,
            self._spec,
            self._max_length,
            self._batch_size,
            options,
            what="UniformReplayBuffer",
            window_name="max_length",
        )
        self._origin = read_origin(self.store)

    # --- description -----------------------------------------------------------------

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

    def num_frames(self) -> Any:
        """``min(adds * batch_size, batch_size * max_length)``: an int64 tensor once
        TensorFlow is imported (as TF-Agents returns), else an int."""
        tf_glue = _tensorflow()
        if tf_glue is None:
            return self._num_frames()
        if tf_glue.in_graph():
            return tf_glue.graph_call(lambda: [np.int64(self._num_frames())], [np.int64], [()])[0]
        return sys.modules["tensorflow"].constant(self._num_frames(), sys.modules["tensorflow"].int64)

    def _num_frames(self) -> int:
        lo, hi = self._window()
        return (hi - lo) * self._batch_size

    # --- writes ---------------------------------------------------------------------

    def add_batch(self, items: Any) -> None:
        """Add one item per segment: every leaf ``[batch_size, *shape]`` (a scalar leaf
        given as one scalar is broadcast). Works as a driver observer.

        Raises:
            mmreplay.BadInputError: wrong structure, batch size, shape or dtype; nothing
                is written and no id is used.
        """
        try:
            self.store.add(items)
        except BadInputError:
            tf_glue = _tensorflow()
            if tf_glue is not None and tf_glue.in_graph():  # symbolic tensors: add when the graph runs
                return tf_glue.graph_add(self.add_batch, items)
            # A scalar for a leaf TF-Agents broadcasts to the batch; else the first error.
            broadcast = _broadcast_leaves(self._spec, items, (self._batch_size,))
            if broadcast is items:
                raise
            self.store.add(broadcast)

    def clear(self) -> None:
        """Drop every frame; ids restart at 0 (the store keeps counting global steps)."""
        self.store.commit()
        origin = self.store.total_steps
        write_origin(self.store, origin)  # first: a crash before the clear still shows no frames
        self._origin = origin
        self.store.clear()

    # --- reads ----------------------------------------------------------------------

    def _ids(self, steps: np.ndarray) -> np.ndarray:
        return steps - self._origin

    def get_next(
        self, sample_batch_size: int | None = None, num_steps: int | None = None, time_stacked: bool = True
    ) -> tuple[Any, BufferInfo]:
        """One uniform sample: ``(items, BufferInfo(ids, probabilities))``.

        Shapes: ``[D]``, ``[S, D]``, ``[T, D]``, ``[S, T, D]``; with ``time_stacked=False``
        and ``num_steps`` a tuple of ``T`` items (``[D]`` or ``[S, D]``), ids likewise.
        Start frame and segment are drawn independently and uniformly, with
        replacement; sequences never cross the cursor or the oldest frame.
        ``probabilities`` is ``1 / (valid starts * batch_size)``, of shape ``[]`` or
        ``[S]``. A buffer created with ``sampler="prioritized"`` draws (start, segment)
        pairs by priority instead, and ``probabilities`` are theirs.

        Inside a ``tf.function`` the draw is an op that runs each time the function does,
        and the outputs are tensors.

        Raises:
            mmreplay.NotEnoughDataError: the buffer is empty or shorter than ``num_steps``
                (also ``tf.errors.InvalidArgumentError`` once TensorFlow is imported).
        """
        tf_glue = _tensorflow()
        if tf_glue is not None and tf_glue.in_graph():
            return self._graph_get_next(tf_glue, sample_batch_size, num_steps, time_stacked)
        lo, hi = self._window()
        T = 1 if num_steps is None else _positive("num_steps", num_steps)
        S = 1 if sample_batch_size is None else _positive("sample_batch_size", sample_batch_size)
        n_starts = hi - lo - T + 1
        if n_starts <= 0:
            if hi == lo:
                raise _not_enough(_EMPTY)
            raise _not_enough(
                f"{_EMPTY} It holds {hi - lo} frames per segment, too short for num_steps={T}."
            )
        # the store's sampler draws (uniform over (start, segment)), its fetch path reads
        nest, info = self.store.sample(S, num_steps=T, rng=self._rng, window=(lo, hi), return_info=True)
        self.last_sample = info
        leaves = flatten(nest)  # [S, T, ...]
        ids = self._ids(info.step[:, None] + np.arange(T))
        prob = info.probability.astype(np.float32)
        # [S, T, ...] -> the requested layout
        if num_steps is None:
            leaves = [x[:, 0] for x in leaves]
            ids = ids[:, 0]
        if sample_batch_size is None:
            leaves = [x[0] for x in leaves]
            ids = ids[0]
            prob = prob[0]
        items = unflatten(self._spec, leaves)
        if num_steps is not None and not time_stacked:
            axis = 0 if sample_batch_size is None else 1
            items = tuple(unflatten(self._spec, [np.take(x, t, axis=axis) for x in leaves]) for t in range(T))
            ids = tuple(np.take(ids, t, axis=axis) for t in range(T))
        return items, BufferInfo(ids, prob)

    def _graph_get_next(
        self, tf_glue: Any, sample_batch_size: int | None, num_steps: int | None, time_stacked: bool
    ) -> tuple[Any, BufferInfo]:
        """:meth:`get_next` as an op of the ``tf.function`` being traced."""
        outer = tuple(n for n in (sample_batch_size, num_steps) if n is not None)

        def draw() -> list[np.ndarray]:
            items, info = self.get_next(sample_batch_size, num_steps, time_stacked=True)
            return [*flatten(items), info.ids, info.probabilities]

        dtypes = [s.dtype for s in self._leaf_specs] + [np.int64, np.float32]
        shapes = [outer + s.shape for s in self._leaf_specs] + [outer, outer[:1] if sample_batch_size else ()]
        out = tf_glue.graph_call(draw, dtypes, shapes)
        leaves, ids, prob = out[:-2], out[-2], out[-1]
        if num_steps is not None and not time_stacked:
            tf = sys.modules["tensorflow"]
            axis = 0 if sample_batch_size is None else 1
            per_step = [tf.unstack(x, num_steps, axis=axis) for x in leaves]
            items = tuple(unflatten(self._spec, [x[t] for x in per_step]) for t in range(num_steps))
            return items, BufferInfo(tuple(tf.unstack(ids, num_steps, axis=axis)), prob)
        return unflatten(self._spec, leaves), BufferInfo(ids, prob)

    def update_priorities(self, ids: Any, segments: Any, priorities: Any) -> int:
        """New priorities for sampled items, for a buffer created with
        ``sampler="prioritized"``: ``ids`` the frame id of each item's first frame
        (``info.ids``, or ``info.ids[:, 0]`` for sequences), ``segments`` its segment
        (``last_sample.env`` after :meth:`get_next`), ``priorities`` ``[S]`` (or ``[S, T]``
        for sequences). Items the ring has dropped since they were sampled are skipped;
        returns how many were applied."""
        steps = np.asarray(ids, np.int64) + self._origin
        return self.store.update_priorities(steps, segments, np.asarray(priorities))

    def gather_all(self) -> Any:
        """Every frame: leaves ``[batch_size, n, *shape]``, each segment in time order
        (inside a ``tf.function``, as PPO's and REINFORCE's train steps call it, an op
        that reads when the function runs)."""
        tf_glue = _tensorflow()
        if tf_glue is not None and tf_glue.in_graph():
            shapes = [(self._batch_size, None, *s.shape) for s in self._leaf_specs]
            dtypes = [s.dtype for s in self._leaf_specs]
            return unflatten(self._spec, tf_glue.graph_call(self._gather_leaves, dtypes, shapes))
        return unflatten(self._spec, self._gather_leaves())

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
        ``single_deterministic_pass=True`` every frame is visited once, reading the
        frames present when the pass is created: segment by segment (or, with
        ``sample_batch_size``, group of segments by group, each item stacking the group),
        each in time order, in windows of ``num_steps`` that step by
        ``dataset_window_shift`` (default ``num_steps``); a shorter last window or
        smaller last group is kept unless ``dataset_drop_remainder``. For
        ``max_length=5`` and ``num_steps=2``: ``[0,1],[2,3],[4]``; with shift 1,
        ``[0,1],[1,2],[2,3],[3,4],[4]``. ``BufferInfo.probabilities`` is ``()`` there.

        Raises:
            ValueError: ``dataset_drop_remainder`` would drop all data (``sample_batch_size
                > batch_size`` or ``num_steps > max_length``).
        """
        if sample_batch_size is not None:
            _positive("sample_batch_size", sample_batch_size)
        if num_steps is not None:
            _positive("num_steps", num_steps)
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
            window = self._window()  # the frames present now, as TF-Agents reads its range once
            make = lambda: self._deterministic_pass(sample_batch_size, num_steps, window)  # noqa: E731
        else:
            make = lambda: self._random_items(sample_batch_size, num_steps)  # noqa: E731
        if importlib.util.find_spec("tensorflow") is None:
            return make()
        return self._tf_dataset(make, sample_batch_size, num_steps, single_deterministic_pass)

    def _random_items(
        self, sample_batch_size: int | None, num_steps: int | None
    ) -> Iterator[tuple[Any, BufferInfo]]:
        while True:
            yield self.get_next(sample_batch_size, num_steps, time_stacked=True)

    def _deterministic_pass(
        self, sample_batch_size: int | None, num_steps: int | None, window: tuple[int, int]
    ) -> Iterator[tuple[Any, BufferInfo]]:
        # the store's pass stacks a group of segments at the same window, as TF-Agents does
        lo, hi = window
        batches = self.store.iterate(
            batch_size=sample_batch_size,
            num_steps=num_steps,
            window_shift=None if num_steps is None else self._window_shift,
            drop_remainder=self._drop_remainder,
            window=(lo, hi),
            group_envs=True,
            return_steps=True,
        )
        return self._pass(batches, hi <= lo)

    def _pass(self, batches: Iterator[tuple[Any, np.ndarray]], empty: bool) -> Iterator[tuple[Any, BufferInfo]]:
        if empty:
            raise _not_enough(_EMPTY)
        for nest, steps in batches:
            yield unflatten(self._spec, flatten(nest)), BufferInfo(self._ids(steps), ())

    def _tf_dataset(
        self, make: Any, sample_batch_size: int | None, num_steps: int | None, deterministic: bool
    ) -> Any:
        import tensorflow as tf  # only here: the iterator path needs no TensorFlow

        outer: tuple[int | None, ...] = ()
        if sample_batch_size is not None:
            outer += (None if deterministic and not self._drop_remainder else sample_batch_size,)
        if num_steps is not None:
            outer += (None if deterministic and not self._drop_remainder else num_steps,)
        structure = _tuplify(self._spec)
        item_sig = unflatten(
            structure, [tf.TensorSpec(outer + s.shape, tf.as_dtype(s.dtype)) for s in self._leaf_specs]
        )
        ids_sig = tf.TensorSpec(outer, tf.int64)
        prob_sig = (
            ()
            if deterministic
            else tf.TensorSpec(outer[:1] if sample_batch_size is not None else (), tf.float32)
        )

        def generate() -> Iterator[Any]:
            for items, info in make():
                yield unflatten(structure, flatten(items)), (info.ids, info.probabilities)

        ds = tf.data.Dataset.from_generator(generate, output_signature=(item_sig, (ids_sig, prob_sig)))
        return ds.map(lambda items, info: (items, BufferInfo(*info)))

    # --- life cycle -----------------------------------------------------------------

    def __repr__(self) -> str:
        return (
            f"<mmreplay.compat.tf_agents.UniformReplayBuffer batch_size={self._batch_size} "
            f"max_length={self._max_length} num_frames={self._num_frames() if not self.store.closed else '?'} "
            f"path={self.store.path!r}>"
        )


def _positive(name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return int(value)


def _tuplify(spec: Any) -> Any:
    """The spec with lists turned into tuples: ``tf.data`` structures cannot hold lists."""
    if isinstance(spec, dict):
        return {k: _tuplify(v) for k, v in spec.items()}
    if is_namedtuple(spec):
        return type(spec)(*(_tuplify(v) for v in spec))
    if isinstance(spec, (list, tuple)):
        return tuple(_tuplify(v) for v in spec)
    return spec
