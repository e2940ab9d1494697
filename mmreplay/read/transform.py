"""Transforms over a drawn batch: fields a sample computes from more rows than it drew.

A transform (n-step returns, goal relabelling) is asked for in the request
(:attr:`~mmreplay.read.request.SampleRequest.transform`) and run once by
:func:`mmreplay.read.gather.sample`, after the draw and its rows are final and before
the nest is packed. It sees the drawn items as a :class:`DrawnBatch`: the rows drawn,
each item's steps and env, the window drawn from, and :meth:`DrawnBatch.read` for any
other retained rows. It returns the leaves it changes or adds; everything else of the
batch is the rows drawn. Because it is part of the request it runs under every sampler,
in each shard of a group and in Ray actors, and readers check its reads as they check
the drawn rows (the seqlock of DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .draws import Draw, Window, check_steps
from .readable import Readable

__all__ = ["DrawnBatch", "Transform"]


class Transform(Protocol):
    """What a request's ``transform`` is. It must be hashable and equal to an equal
    transform (a frozen dataclass is): the read path keeps its batch spec by it, and equal
    requests share a draw made ahead."""

    def batch_spec(self, spec: Any, roles: Mapping[str, str]) -> Any:
        """The spec of the batches it returns, given the store's spec and roles.

        Called before anything is drawn: a store it cannot serve (a role missing, a leaf
        of the wrong kind) raises :class:`~mmreplay.BadInputError` here, naming what was
        expected and what the store has.
        """
        ...

    def __call__(self, batch: DrawnBatch) -> Mapping[str, np.ndarray]:
        """The leaves it changes or adds, by leaf path of :meth:`batch_spec`, each
        ``[*batch.step.shape, *leaf shape]``."""
        ...


class DrawnBatch:
    """The drawn items as a transform reads them.

    Attributes:
        store: the store drawn from (its ``spec``, ``roles``, ``capacity``, ``num_envs``).
        window: the steps the items were drawn from; :meth:`read` reads inside it only.
        step: global step id of each item's row, ``[B]`` (``[B, T]`` for sequences).
        env: env index of each item's row, shaped as ``step``.
        rows: the drawn rows by leaf path, each ``[*step.shape, *leaf shape]``.
        lowest: the oldest step read so far (readers check it was still retained).
        rng: the request's generator, for transforms that draw (goal relabelling).
    """

    def __init__(
        self,
        store: Readable,
        window: Window,
        draw: Draw,
        num_steps: int | None,
        paths: Sequence[str],
        got: Sequence[np.ndarray],
        takes: Sequence[Any],
        rng: np.random.Generator,
    ):
        self.store = store
        self.rng = rng
        self.window = window
        step, env = draw.step, draw.env
        if num_steps is not None:
            step = step[:, None] + np.arange(num_steps, dtype=np.int64)
            env = np.broadcast_to(env[:, None], step.shape)
        self.step, self.env = step, env
        self.rows = dict(zip(paths, got))
        self._takes = dict(zip(paths, takes))
        self.lowest = int(step.min()) if step.size else window.end
        # a step of the window less this is below 2 * capacity: the row ids the gathers wrap
        self._fold = window.first - window.first % window.capacity

    def read(self, path: str, step: np.ndarray, env: np.ndarray) -> np.ndarray:
        """One leaf's rows ``(step, env)``: global step ids and env indices (int arrays,
        broadcast together), ``[*shape of the ids, *leaf shape]``.

        Raises:
            NotEnoughDataError: a step lies outside :attr:`window`.
        """
        return self.take(path, self.row_ids(step, env))

    def row_ids(self, step: np.ndarray, env: np.ndarray) -> np.ndarray:
        """The ids of the rows ``(step, env)``, checked to lie in :attr:`window`, for
        :meth:`take` to read from several leaves.

        Raises:
            NotEnoughDataError: a step lies outside :attr:`window`.
        """
        step = np.asarray(step)
        lo = check_steps(step, *self.window[:2], self.store.path, "the window drawn from is")
        self.lowest = min(self.lowest, lo)
        return (step - self._fold) * self.window.num_envs + np.asarray(env)

    def take(self, path: str, row_ids: np.ndarray) -> np.ndarray:
        """One leaf's rows by :meth:`row_ids`."""
        return self._takes[path](row_ids)
