"""TF-Agents' ``NumpyStorage`` over a store (re-exported by :mod:`mmreplay.compat.tf_agents`)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import BadInputError
from ..read.request import positive
from ..spec import ArraySpec, flatten, leaf_paths, to_spec, unflatten
from ..values import StepValidator, flatten_value
from ._shared import StoreOptions, StoreShell, attach_store

__all__ = ["NumpyStorage", "broadcast_leaves"]


def _is_array_spec(x: Any) -> bool:
    """A TF-Agents ``ArraySpec`` / ``BoundedArraySpec`` (or :class:`mmreplay.ArraySpec`),
    recognised without importing TF-Agents: a shape and a *numpy* dtype, neither an array
    nor a space. A ``tf.TensorSpec`` has a ``tf.DType`` and is refused, as ``NumpyStorage``
    refuses it."""
    if isinstance(x, ArraySpec):
        return True
    if isinstance(x, (np.ndarray, np.generic)) or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return False
    if hasattr(x, "sample") and hasattr(x, "contains"):  # a gymnasium space
        return False
    return isinstance(x.dtype, np.dtype) or (isinstance(x.dtype, type) and issubclass(x.dtype, np.generic))


def broadcast_leaves(spec: Any, value: Any, lead: tuple[int, ...]) -> Any:
    """Broadcast scalar leaves of ``value`` to ``lead + leaf shape`` (as TF's scatter does)."""
    try:
        values = flatten_value(spec, value)
    except BadInputError:
        return value  # the store names the structural mismatch
    scalar = [
        v is not None and np.ndim(v) == 0 and bool(lead or s.shape) for s, v in zip(flatten(spec), values)
    ]
    if not any(scalar):
        return value
    return unflatten(spec, [
        np.broadcast_to(np.asarray(v), (*lead, *s.shape)) if b else v
        for s, v, b in zip(flatten(spec), values, scalar)
    ])  # fmt: skip


class NumpyStorage(StoreShell):
    """``tf_agents.utils.numpy_storage.NumpyStorage`` on disk: one array per leaf.

    ``get(idx)`` / ``set(idx, value)`` take and return the spec's nest; ``idx`` is a slot
    in ``[0, capacity)`` (negative wraps, slices and index arrays batch, anything else
    raises ``IndexError``); a slot never set reads as zeros. Slot ``i`` is global step
    ``i`` of a one-env store of ``capacity`` slots, appended in order as slots are first
    set (a gap is zeros), never wrapped; every ``set`` is committed when it returns.

    Args:
        data_spec: a nest of TF-Agents ``ArraySpec`` / ``BoundedArraySpec``.
        capacity: slots in the storage.
        path: the buffer folder, reopened (and checked) if it exists; ``None``: a
            temporary folder removed on ``close()``.
        backend, compression: as :func:`mmreplay.create`.

    Raises:
        ValueError: ``data_spec`` holds something that is not an array spec (named).
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
        for where, leaf in zip(leaf_paths(data_spec), flatten(data_spec)):
            if not _is_array_spec(leaf):
                raise ValueError(
                    "The data_spec parameter must be an instance or nest of array_spec.ArraySpec. "
                    f"Got: {leaf!r} at leaf {'data_spec' if leaf is data_spec else where!r}"
                )
        self._capacity = positive("capacity", capacity)
        self._data_spec = data_spec
        self._spec = to_spec(data_spec)
        self._leaf_specs: list[ArraySpec] = flatten(self._spec)
        self._validator = StepValidator(self._spec, 1)
        options = StoreOptions(backend=backend, compression=compression, commit_every=1)
        self.store = attach_store(self, path, self._spec, self._capacity, 1, options, what="NumpyStorage")

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def data_spec(self) -> Any:
        return self._data_spec

    def _slots(self, idx: Any) -> tuple[np.ndarray, bool]:
        scalar = isinstance(idx, (int, np.integer)) and not isinstance(idx, bool)
        try:
            if isinstance(idx, (bool, np.bool_)):  # numpy would read it as a new axis over every slot
                raise IndexError("a bool is not an index")
            slots = np.arange(self._capacity)[idx]
        except IndexError as exc:  # out of range, or no index at all (a float...): numpy's reason
            raise IndexError(f"index {idx!r} of a NumpyStorage of capacity {self._capacity}: {exc}") from exc
        return np.asarray(slots, np.int64), scalar

    def get(self, idx: Any) -> Any:
        """The item(s) at ``idx``: the spec's nest, leaves ``[*shape]`` or ``[k, *shape]``."""
        slots, _ = self._slots(idx)
        have = slots < self.store.total_steps
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
        # Validate everything (in the shapes of this call) before the first byte, or zero gap, is written.
        values = self._validator.leaf_values(broadcast_leaves(self._spec, value, lead))
        leaves = [
            self._validator.coerce(i, v, (*lead, *s.shape), "[*index, *shape] =").reshape(-1, 1, *s.shape)
            for i, (v, s) in enumerate(zip(values, self._leaf_specs))
        ]
        flat = slots.reshape(-1)
        store = self.store
        gap = (int(flat.max()) + 1 if flat.size else 0) - store.total_steps
        step_bytes = max(1, sum(s.nbytes for s in self._leaf_specs))
        while gap > 0:  # zero slots up to the highest one set, in blocks of about 64 MiB
            k = min(gap, max(1, (64 << 20) // step_bytes))
            store.extend(
                unflatten(self._spec, [np.zeros((k, 1, *s.shape), s.dtype) for s in self._leaf_specs])
            )
            gap -= k
        store.set(flat - store.first_step, unflatten(self._spec, leaves))
        store.commit()

    def __repr__(self) -> str:
        return f"<mmreplay.compat.tf_agents.NumpyStorage capacity={self._capacity} store={self.store!r}>"
