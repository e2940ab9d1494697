"""Write hooks: observers a store calls as it writes, so that what is derived from the
rows (the episode index, a sampler's priorities) is written with them and committed by
the same commit, without the store naming any of them.

Every hook is called in the writer only, in the order it was registered, after the rows
are in the leaves:

- ``on_add(first_step, count)``: steps ``[first_step, first_step + count)`` were written
  (``add`` or ``extend``); not committed yet.
- ``on_commit(old_end, new_end, fsync)``: steps ``[old_end, new_end)`` are being
  committed; what the hook persists for them must be written (and fsynced if ``fsync``)
  before it returns, because the state write that commits them comes next.
- ``on_set(steps)``: stored steps (global ids) were overwritten in place.
- ``on_clear(end)``: every step before ``end`` was dropped.

``on_add`` is on the write hot path: the store calls it only for hooks that override it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["WriteHook", "overrides"]


class WriteHook:
    """Base class of write hooks: every hook is a no-op until overridden."""

    def on_add(self, first_step: int, count: int) -> None:
        """Steps ``[first_step, first_step + count)`` were written."""

    def on_commit(self, old_end: int, new_end: int, fsync: bool) -> None:
        """Steps ``[old_end, new_end)`` are about to be committed."""

    def on_set(self, steps: np.ndarray) -> None:
        """Stored steps were overwritten in place."""

    def on_clear(self, end: int) -> None:
        """Every step before ``end`` was dropped."""


def overrides(hook: Any, method: str) -> bool:
    """Whether ``hook`` does something in ``method`` (not the base class's no-op)."""
    return getattr(type(hook), method, None) is not getattr(WriteHook, method)
