"""The TensorFlow side of :mod:`mmreplay.compat.tf_agents`, imported only once TensorFlow is.

- Graph mode: inside a ``tf.function`` (``common.function(driver.run)``), ``add_batch``,
  ``get_next`` and ``num_frames`` run the numpy layer through ``tf.numpy_function``, so
  they happen each time the function runs, not once while it is traced.
- Checkpoints: the buffer is a ``Trackable`` whose saved value is the store's commit
  (adds, origin, creation time), not its data, which stays in the buffer folder. Saving
  commits the store first; restoring checks that the folder holds that commit.
- Errors: an empty buffer raises an error that is both :class:`mmreplay.NotEnoughDataError`
  and ``tf.errors.InvalidArgumentError``, as TF-Agents raises the latter.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import tensorflow as tf

from ..errors import NotEnoughDataError
from .tf_agents import BufferCheckpointError

__all__ = ["EmptyBufferError", "trackable_class", "in_graph", "graph_add", "graph_call"]


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
            check_restored(self, saved["committed_steps"], saved["origin"], saved["created"])

    TrackableBuffer.__name__ = TrackableBuffer.__qualname__ = base.__name__
    TrackableBuffer.__module__ = base.__module__
    return TrackableBuffer


def check_restored(rb: Any, saved_steps: int, saved_origin: int, saved_created: float) -> None:
    """Compare the buffer's folder with the commit a checkpoint recorded: another buffer
    or an older folder is an error; a folder with adds made after the checkpoint is
    kept, with a warning saying so."""
    store = rb.store
    path = store.path
    if store.metadata.created != saved_created:
        raise BufferCheckpointError(
            f"{path}: the checkpoint was saved with another replay buffer (created at "
            f"{saved_created:.6f}, this one at {store.metadata.created:.6f}); create the buffer "
            "with the path it had when the checkpoint was saved"
        )
    steps = store.committed_steps
    saved_adds = saved_steps - saved_origin
    if steps < saved_steps:
        raise BufferCheckpointError(
            f"{path}: the checkpoint was saved after {saved_adds} adds, the buffer folder holds "
            f"only {steps - rb._origin}: the folder is older than the checkpoint (a copy made "
            "before it?). Restore the buffer folder saved with the checkpoint, or an older checkpoint."
        )
    if steps > saved_steps or rb._origin != saved_origin:
        cleared = " and was cleared since" if rb._origin != saved_origin else ""
        warnings.warn(
            f"{path}: the buffer holds {steps - saved_steps} adds made after the checkpoint was "
            f"saved{cleared} (it was saved after {saved_adds} adds); they are kept and sampled. "
            "Restore the newest checkpoint to resume where the buffer is, or clear() the buffer "
            "to start it over.",
            RuntimeWarning,
            stacklevel=2,
        )
