"""The TensorFlow side of :mod:`mmreplay.compat.tf_agents`, imported only once TensorFlow is.

- Outputs: what TF-Agents returns as tensors (items, ids, probabilities, counts) is
  converted here, so callers that use ``.numpy()`` or ``tf.*`` ops keep working.
- Graph mode: inside a ``tf.function`` (``common.function(driver.run)``), ``add_batch``,
  ``get_next`` and ``num_frames`` run the numpy layer through ``tf.numpy_function``, so
  they happen each time the function runs, not once while it is traced.
- Checkpoints: the buffer is a ``Trackable`` whose saved value is the store's commit
  (adds, origin, creation time), not its data, which stays in the buffer folder. Saving
  commits the store first; restoring hands the values to the buffer's ``_check_restored``.
- Errors: an empty buffer raises an error that is both :class:`mmreplay.NotEnoughDataError`
  and ``tf.errors.InvalidArgumentError``, as TF-Agents raises the latter.

It imports nothing from the layer above it: the buffer class is handed in.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorflow as tf

from ..errors import NotEnoughDataError
from ..spec import flatten, is_namedtuple, unflatten

__all__ = [
    "EmptyBufferError",
    "trackable_class",
    "in_graph",
    "graph_add",
    "graph_call",
    "graph_get_next",
    "dataset",
    "as_tensors",
]


class EmptyBufferError(NotEnoughDataError, tf.errors.InvalidArgumentError):
    """The buffer holds too few frames: TF-Agents' ``InvalidArgumentError`` too."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)

    def __str__(self) -> str:
        return self.message


def in_graph() -> bool:
    """Whether the caller runs while a ``tf.function`` is traced."""
    return tf.inside_function()


def as_tensors(nest: Any) -> Any:
    """Every array of ``nest`` (lists, tuples, dicts, named tuples) as a tensor."""
    return tf.nest.map_structure(tf.convert_to_tensor, nest)


def graph_add(add: Any, items: Any) -> Any:
    """``add(items)`` as a stateful op of the function being traced."""
    flat = tf.nest.flatten(items)

    def run(*arrays: np.ndarray) -> None:
        add(tf.nest.pack_sequence_as(items, list(arrays)))

    return tf.numpy_function(run, flat, Tout=[], stateful=True, name="mmreplay_add_batch")


def graph_call(fn: Any, dtypes: list[Any], shapes: list[tuple[int | None, ...]]) -> list[Any]:
    """``fn()`` (returning a list of numpy arrays) as a stateful op of the function being
    traced: its output tensors, with the given dtypes and static shapes."""
    out = tf.numpy_function(fn, [], Tout=[tf.as_dtype(d) for d in dtypes], stateful=True)
    for tensor, shape in zip(out, shapes):
        tensor.set_shape(shape)
    return out


@functools.cache
def trackable_class(base: type) -> type:
    """``base`` (the layer's buffer class) made a ``Trackable`` for ``tf.train.Checkpoint``."""

    class TrackableBuffer(base, tf.__internal__.tracking.Trackable):  # type: ignore[misc, valid-type]
        __doc__ = base.__doc__

        def variables(self) -> tuple[()]:
            """No TF variables: the data lives in the buffer folder (TF-Agents' buffer
            returns its tables here)."""
            return ()

        def _serialize_to_tensors(self) -> dict[str, Any]:
            store = self.store
            if store.mode != "r":
                store.commit()
            return {
                "committed_steps": tf.constant(store.committed_steps, tf.int64),
                "origin": tf.constant(self._origin, tf.int64),
                "created": tf.constant(store.metadata.created, tf.float64),
            }

        def _restore_from_tensors(self, restored_tensors: dict[str, Any]) -> None:
            saved = {k: v.numpy().item() for k, v in restored_tensors.items()}
            self._check_restored(saved["committed_steps"], saved["origin"], saved["created"])

    TrackableBuffer.__name__ = TrackableBuffer.__qualname__ = base.__name__
    TrackableBuffer.__module__ = base.__module__
    return TrackableBuffer


def graph_get_next(rb: Any, sample_batch_size: int | None, num_steps: int | None) -> Any:
    """``rb.get_next(...)``, time stacked, as an op of the ``tf.function`` being traced:
    ``(items, (ids, probabilities))``, drawn by ``rb._draw`` each time the function runs."""
    outer = tuple(n for n in (sample_batch_size, num_steps) if n is not None)
    specs = flatten(rb._spec)

    def draw() -> list[np.ndarray]:
        items, info = rb._draw(sample_batch_size, num_steps)
        return [*flatten(items), info.ids, info.probabilities]

    dtypes = [s.dtype for s in specs] + [np.int64, np.float32]
    shapes = [outer + s.shape for s in specs] + [outer, outer[:1] if sample_batch_size else ()]
    out = graph_call(draw, dtypes, shapes)
    return unflatten(rb._spec, out[:-2]), (out[-2], out[-1])


def dataset(
    rb: Any, make: Any, info_type: type, batch: int | None, num_steps: int | None, deterministic: bool
) -> Any:
    """A ``tf.data.Dataset`` of the ``(items, info)`` pairs the generator ``make()`` yields
    (``info`` an ``info_type(ids, probabilities)``)."""
    free = deterministic and not rb._drop_remainder  # a last smaller window or group
    outer = tuple(None if free else n for n in (batch, num_steps) if n is not None)
    structure = _tuplify(rb._spec)
    item_sig = unflatten(
        structure, [tf.TensorSpec(outer + s.shape, tf.as_dtype(s.dtype)) for s in flatten(rb._spec)]
    )
    prob_sig = () if deterministic else tf.TensorSpec(outer[:1] if batch else (), tf.float32)

    def generate() -> Any:
        for items, info in make():
            yield unflatten(structure, flatten(items)), (info.ids, info.probabilities)

    signature = (item_sig, (tf.TensorSpec(outer, tf.int64), prob_sig))
    ds = tf.data.Dataset.from_generator(generate, output_signature=signature)
    return ds.map(lambda items, info: (items, info_type(*info)))


def _tuplify(spec: Any) -> Any:
    """The spec with lists turned into tuples: ``tf.data`` structures cannot hold lists."""
    if isinstance(spec, dict):
        return {k: _tuplify(v) for k, v in spec.items()}
    if is_namedtuple(spec):
        return type(spec)(*(_tuplify(v) for v in spec))
    if isinstance(spec, (list, tuple)):
        return tuple(_tuplify(v) for v in spec)
    return spec
