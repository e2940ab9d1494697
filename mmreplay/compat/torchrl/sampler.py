"""TorchRL's sampler protocol over the store's own sampler: :class:`StoreSampler`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torchrl.data.replay_buffers.samplers import Sampler

from ...read import SampleRequest
from ...store import Store
from .storage import MMReplayStorage, steps_of

__all__ = ["StoreSampler"]


class StoreSampler(Sampler):
    """A TorchRL sampler that draws through the store's own sampler (``store.sampler``).

    Over a storage made with ``sampler="prioritized"``: prioritized replay whose batch
    ``info`` holds ``"priority_weight"``; ``rb.update_priority(index, priority)`` writes the
    store's priority file, committed with the rows. Randomness comes from the buffer's
    generator, or torch's global one.
    """

    def __init__(self, beta: float | None = None) -> None:
        self.beta = beta

    @staticmethod
    def _store(storage: Any) -> Store:
        if not isinstance(storage, MMReplayStorage):
            raise TypeError(f"StoreSampler draws from an MMReplayStorage, got {type(storage).__name__}")
        if storage.store is None:
            raise RuntimeError(f"{storage.path}: nothing written yet")
        storage.store.check_open()
        return storage.store

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict[str, Any]]:
        store = self._store(storage)
        seed = int(torch.randint(0, 2**62, (), generator=self._rng))
        request = SampleRequest.build(batch_size, options=None if self.beta is None else {"beta": self.beta})
        request.check_options(store.sampler, store.path)
        draw = store.sampler.draw(store.window, request, batch_size, 1, np.random.default_rng(seed))
        slots = torch.from_numpy(draw.step % store.capacity)
        index = slots if storage.ndim == 1 else (slots, torch.from_numpy(draw.env))
        info = {} if draw.weight is None else {"priority_weight": torch.from_numpy(draw.weight)}
        return index, info

    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> None:
        """Priorities for the rows at ``index`` (slots, or ``[N, 2]`` slot and env pairs),
        given to the rows those slots hold now."""
        store = self._store(storage)
        index = torch.as_tensor(index).cpu().numpy().astype(np.int64)
        slots, envs = (index[..., 0], index[..., 1]) if storage.ndim == 2 else (index, np.zeros_like(index))
        steps = steps_of(store, slots.reshape(-1))
        priority = torch.as_tensor(priority).detach().reshape(-1).cpu().numpy()
        if priority.size == 1:  # one number for every index, as TorchRL's takes
            priority = np.broadcast_to(priority, steps.shape)
        store.update_priorities(steps, envs.reshape(-1), priority)

    def _empty(self) -> None:
        """The store's sampler follows the store's own clear."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: the priorities live in the store, and follow its loads."""

    def dumps(self, path: Any) -> None:
        """Nothing to write: the priorities are committed with the rows."""

    def loads(self, path: Any) -> None:
        """Nothing to read: the priorities live in the store, and follow its loads."""
