"""What SB3's ``save_replay_buffer`` writes of a :class:`~mmreplay.compat.sb3.ReplayBuffer`:
pickling gives a manifest naming its folder, never its rows. Loading reopens the folder
as it is now; in the process that saved it, the open folder is taken over from the
buffer holding it (the writer lock is that buffer's)."""

from __future__ import annotations

import os
import warnings
import weakref
from typing import Any

from ...errors import BadInputError, NotABufferError
from ...metadata import METADATA_FILE
from ...store import Store

__all__ = ["MANIFEST_KIND", "Manifested"]

#: ``kind`` of the manifest that pickling a buffer writes
MANIFEST_KIND = "mmreplay.compat.sb3"

# the open buffer of each folder in this process
_open_buffers: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

#: what ReplayBuffer._step_layout() sets: not pickled, rebuilt when a manifest is loaded
_LAYOUT = ("_obs_step_shape", "_obs_keys", "_action_shape", "_reward_shape", "_no_ends", "_no_ends_bytes")

#: what a buffer handing its open store to a loaded manifest must share with it
_SAME_LAYOUT = (
    "buffer_size", "n_envs", "optimize_memory_usage", "_frame_stack", "_frame_pad", "observation_space", "action_space",
)


class Manifested:
    """The pickling of the SB3 buffers, and the hand-over of a folder between two buffers
    of one process (the buffer's ``_live``, ``_create``, ``_check_spaces``, ``_attach``
    and ``_step_layout`` do the rest)."""

    store: Store | None

    def _register(self, store: Store) -> None:
        _open_buffers[store.path] = self

    def _take_over(self, folder: str, keep: bool = False) -> Store | None:
        """Take ``folder`` from the buffer of this process that holds it. With ``keep`` (a
        manifest loaded) and the same layout: its open store, whose envs go on with their
        episodes as in SB3's buffer, and its temporary folder, now removed with this
        buffer. Else it is closed (committing it), to be reopened."""
        other = _open_buffers.get(folder)
        if other is None or other is self or other.store is None or other.store.closed:
            return None
        store, other.store = other.store, None
        if keep and all(getattr(other, k) == getattr(self, k) for k in _SAME_LAYOUT):
            temp = getattr(other, "_temp", None)
            if temp is not None:
                other._cleanup.detach()
                other._temp = other._cleanup = None
                self._temp, self._cleanup = temp, weakref.finalize(self, temp.remove)
            return store
        store.close()
        return None

    def __getstate__(self) -> dict[str, Any]:
        """Commit, then describe the buffer without its rows: what ``save_replay_buffer`` writes."""
        store = self._live()
        store.commit()
        if getattr(self, "_temp", None) is not None:
            warnings.warn(
                f"{store.path}: this replay buffer lives in a temporary folder removed with it, so the saved "
                "manifest names a folder that will be gone; pass replay_buffer_kwargs={'path': ...} to keep it",
                stacklevel=2,
            )
        skip = ("store", "_temp", "_cleanup", "_leaves", "_rng", "last_info", *_LAYOUT)
        state = {k: v for k, v in self.__dict__.items() if k not in skip}
        state["kind"] = MANIFEST_KIND
        state["path"] = store.path
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Reopen the folder a manifest names (taking it over from this process's buffer), as
        it is now: not a snapshot of when it was saved."""
        if state.get("kind") != MANIFEST_KIND:
            raise BadInputError(f"expected a manifest of kind {MANIFEST_KIND!r}, got {state.get('kind')!r}")
        state = dict(state)
        path = state.pop("path")
        del state["kind"]
        self.__dict__.update(state)
        self.__dict__.setdefault("_filled", False)  # a manifest written before SB3's full could be set
        self._step_layout()
        self.store, self._rng, self.last_info = None, None, None
        if not os.path.exists(os.path.join(path, METADATA_FILE)):  # not an empty buffer made in its place
            raise NotABufferError(f"{path}: the replay buffer folder this manifest names is gone")
        store = self._take_over(path, keep=True) or self._create(path)
        self._check_spaces(store)
        self._attach(store)
