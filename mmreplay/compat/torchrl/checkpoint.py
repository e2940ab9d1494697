"""TorchRL's checkpoints of :class:`~mmreplay.compat.torchrl.MMReplayStorage`:
``state_dict`` / ``load_state_dict`` and ``dumps`` / ``loads``, in TorchRL's layouts, so
that any TorchRL storage loads what this one saves and the other way round. A load
replaces the store's rows, committed, or refuses before anything changes."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from tensordict import TensorDict, is_tensor_collection
from torch.utils import _pytree as pytree
from torchrl.data.replay_buffers.storages import TensorStorage

from ...errors import BadInputError
from ...values import StepValidator

__all__ = ["Checkpoints", "first_leaf"]

#: store attribute holding ``total_steps`` when the store was dumped into its own folder
DUMPED_ATTR = "torchrl_dumped_steps"


def first_leaf(data: Any) -> Any:
    return data if is_tensor_collection(data) or isinstance(data, torch.Tensor) else pytree.tree_leaves(data)[0]


class Checkpoints:
    """The checkpoint methods of the storage (its ``set``, ``_empty``, ``_values`` and
    ``commit`` write what a load brings)."""

    def _load(self, rows: Any, length: int) -> None:
        """Make the store hold ``rows`` (a TorchRL storage's data, ``length`` elements
        written from slot 0) and nothing else; checked before anything changes."""
        steps = 0
        if rows is not None and length:
            lead = first_leaf(rows).shape
            per_step = lead[1] if self.ndim == 2 else 1
            if lead[0] * per_step != self.max_size:
                raise BadInputError(
                    f"{self.path}: the state holds a storage of shape {list(lead[: self.ndim])}, "
                    f"this one has max_size {self.max_size} (ndim={self.ndim})"
                )
            steps = -(-int(length) // per_step)
            rows = rows[:steps] if is_tensor_collection(rows) else pytree.tree_map(lambda x: x[:steps], rows)
            if self.store is not None:
                StepValidator(self.store.spec, self.store.num_envs).batch(self._values(rows, False))
        self._empty()
        if steps:
            self.set(torch.arange(steps), rows)
            self._rephase = steps == self.store.capacity
        self.commit()

    def state_dict(self) -> dict[str, Any]:
        """TorchRL's storage state: views of the rows (saving it copies them), and the length."""
        self.commit()
        rows = self._storage
        if rows is not None and not isinstance(rows, torch.Tensor):
            if not is_tensor_collection(rows):
                raise TypeError(f"{self.path}: a storage of pytrees has no state_dict; use dumps/loads")
            rows = rows.state_dict()
        return {"_storage": {} if rows is None else rows, "initialized": self.store is not None, "_len": len(self)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a TorchRL storage's state (this one's or another's) into the store."""
        if "_storage" not in state_dict:
            raise BadInputError(f"{self.path}: not a TorchRL storage state: keys {sorted(state_dict)}")
        rows = state_dict["_storage"]
        if isinstance(rows, dict):
            rows = TensorDict().load_state_dict(rows, strict=False) if rows else None
        self._load(rows if state_dict["initialized"] else None, state_dict["_len"])

    def dumps(self, path: Any) -> None:
        """Commit, and copy every row to ``path`` in TorchRL's checkpoint layout (which any
        TorchRL storage loads); into the store's own folder, commit and note the step count."""
        self.commit()
        if os.path.realpath(path) != os.path.realpath(self.path):
            super().dumps(path)
        elif self._writes_here():
            self.store.set_attrs(**{DUMPED_ATTR: self.store.total_steps})

    def loads(self, path: Any) -> None:
        """Load a TorchRL storage checkpoint (:meth:`dumps`', or another storage's) into
        the store; its own folder loads only while it holds what was dumped there."""
        if os.path.realpath(path) == os.path.realpath(self.path):
            then, now = self.store and self.store.attrs.get(DUMPED_ATTR), self.store and self.store.total_steps
            if then is None or then != now:
                raise BadInputError(
                    f"{self.path}: the store has moved on since it was dumped here ({then} steps then, {now} "
                    "now) and keeps no older rows: reopen the folder, without loads, to resume from its newest"
                )
            return self.commit()
        try:
            with open(os.path.join(path, "storage_metadata.json")) as file:
                meta = json.load(file)
        except FileNotFoundError:
            raise BadInputError(f"{path}: not a TorchRL storage checkpoint (no storage_metadata.json)") from None
        if meta["is_pytree"]:
            if self.store is None:
                raise RuntimeError(f"{self.path}: Cannot fill a non-initialized pytree-based TensorStorage")
            scratch = TensorStorage(pytree.tree_map(torch.empty_like, self._storage))
            self.checkpointer.loads(scratch, path)  # TorchRL's reader, into RAM
            rows = scratch._storage
        else:
            rows = TensorDict.load_memmap(path)  # mapped, not read into RAM
            for hook in self.checkpointer._load_hooks:
                rows = hook(rows, out=None)
        self._load(rows, meta["len"])
