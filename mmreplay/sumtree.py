"""A sum tree with a min tree beside it, vectorised in numpy, for prioritized draws.

Leaf ``i`` holds the weight of row ``i`` (``priority ** alpha``; zero for a row that
cannot be drawn). Both trees live in flat arrays of ``2 * size`` nodes, ``size`` the
power of two at or above the number of leaves: node ``k`` has children ``2k`` and
``2k + 1``, the root is node 1 and leaf ``i`` is node ``size + i``.

Every internal node is recomputed from its two children (never adjusted by a
difference), so the sums carry no drift however many updates they see, and a batch of
``B`` updates or draws costs ``O(B log n)`` numpy work in ``log n`` vectorised steps.
The sum tree is float64: a float32 total over millions of rows would lose the small
priorities. The min tree (empty leaves hold ``inf``) gives the smallest positive weight
that importance weights are normalised by.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SumTree"]


class SumTree:
    """Weights of ``n`` leaves with their total, their minimum and prefix-sum search."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"a sum tree needs at least one leaf, got n={n}")
        self.n = int(n)
        self.size = 1 << max(0, (self.n - 1).bit_length())
        self.depth = self.size.bit_length() - 1
        self.sums = np.zeros(2 * self.size, np.float64)
        self.mins = np.full(2 * self.size, np.inf, np.float64)

    # --- reading ----------------------------------------------------------------------

    @property
    def total(self) -> float:
        return float(self.sums[1])

    @property
    def min(self) -> float:
        """The smallest positive leaf weight (``inf`` when every leaf is zero)."""
        return float(self.mins[1])

    def get(self, index: np.ndarray) -> np.ndarray:
        """Leaf weights at ``index``."""
        return self.sums[self.size + np.asarray(index, np.int64)]

    def leaves(self) -> np.ndarray:
        """A view of every leaf weight (read only by convention)."""
        return self.sums[self.size : self.size + self.n]

    def find(self, u: np.ndarray) -> np.ndarray:
        """Leaf index of each prefix sum ``u`` in ``[0, total)``: the smallest ``i`` with
        ``sum(leaves[: i + 1]) > u``. A leaf of weight zero is never returned while the
        total is positive."""
        start = np.asarray(u, np.float64)
        u = start.copy()
        node = np.ones(u.shape, np.int64)
        sums = self.sums
        for _ in range(self.depth):
            node <<= 1
            left = sums[node]
            right = u >= left
            u -= left * right
            node += right
        leaf = node - self.size
        lost = sums[node] == 0  # rounding carried u past the last leaf with weight: rare
        if lost.any():
            leaf[lost] = self._find_guarded(start[lost].copy())
        return leaf

    def _find_guarded(self, u: np.ndarray) -> np.ndarray:
        """:meth:`find` that never steps into a subtree without weight (slower)."""
        node = np.ones(u.shape, np.int64)
        sums = self.sums
        for _ in range(self.depth):
            node <<= 1
            left = sums[node]
            right = (u >= left) & (sums[node + 1] > 0)
            u -= np.where(right, left, 0.0)
            node += right
        return node - self.size

    # --- writing ----------------------------------------------------------------------

    def set(self, index: np.ndarray, weights: np.ndarray, distinct: bool = False) -> None:
        """Set leaves ``index`` to ``weights``; where an index repeats, its last weight wins
        (``distinct``: the caller knows no index repeats)."""
        index = np.asarray(index, np.int64).reshape(-1)
        weights = np.asarray(weights, np.float64)
        if weights.shape != index.shape:
            weights = np.broadcast_to(weights, index.shape).reshape(-1)
        if index.size == 0:
            return
        if index.min() < 0 or index.max() >= self.n:
            raise IndexError(f"leaf index out of range [0, {self.n})")
        if index.size > 1 and not distinct:
            # keep the last occurrence of each index (numpy's fancy assignment with
            # repeats promises no order); the survivors come out sorted
            order = np.argsort(index, kind="stable")
            index = index[order]
            last = np.empty(index.size, bool)
            last[-1] = True
            np.not_equal(index[1:], index[:-1], out=last[:-1])
            index, weights = index[last], weights[order[last]]
        node = index + self.size
        value = np.array(weights, np.float64)  # the running sums of the walk up
        least = np.where(value > 0, value, np.inf)  # and its running minima
        sums, mins = self.sums, self.mins
        sums[node] = value
        mins[node] = least
        # Below level `top` a parent is its child plus the child's sibling, both already
        # final on this level (siblings that are both in the batch give the same parent:
        # addition and minimum commute exactly); from `top` up, where a level has about
        # as many nodes as the batch, whole levels are recomputed from their children.
        top = min(self.depth, index.size.bit_length() + 1)
        for _ in range(self.depth - top):
            sibling = node ^ 1
            value += sums[sibling]
            np.minimum(least, mins[sibling], out=least)
            node >>= 1
            sums[node] = value
            mins[node] = least
        self._fix_up(1 << top, 2 << top)

    def set_range(self, lo: int, hi: int, weights: np.ndarray | float) -> None:
        """Set the contiguous leaves ``[lo, hi)``: slices all the way up, no gathers."""
        if not 0 <= lo <= hi <= self.n:
            raise IndexError(f"leaf range [{lo}, {hi}) outside [0, {self.n})")
        if lo == hi:
            return
        w = np.asarray(weights, np.float64)
        a, b = lo + self.size, hi + self.size
        self.sums[a:b] = w
        self.mins[a:b] = np.where(w > 0, w, np.inf)
        self._fix_up(a, b)

    def build(self, weights: np.ndarray) -> None:
        """Set every leaf from ``weights`` (``n`` values) in ``O(n)``."""
        w = np.asarray(weights, np.float64).reshape(-1)
        if w.shape[0] != self.n:
            raise ValueError(f"expected {self.n} leaf weights, got {w.shape[0]}")
        self.sums[self.size : self.size + self.n] = w
        self.sums[self.size + self.n :] = 0.0
        leaves = self.mins[self.size :]
        leaves[: self.n] = np.where(w > 0, w, np.inf)
        leaves[self.n :] = np.inf
        self._fix_up(self.size, 2 * self.size)

    def _fix_up(self, a: int, b: int) -> None:
        """Recompute the ancestors of the nodes ``[a, b)`` (all on one level)."""
        sums, mins = self.sums, self.mins
        while a > 1:
            a, b = a >> 1, ((b - 1) >> 1) + 1
            sums[a:b] = sums[2 * a : 2 * b : 2] + sums[2 * a + 1 : 2 * b : 2]
            np.minimum(mins[2 * a : 2 * b : 2], mins[2 * a + 1 : 2 * b : 2], out=mins[a:b])
