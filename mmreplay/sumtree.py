"""A sum tree with a min tree beside it, vectorised in numpy, for prioritized draws.

Leaf ``i`` holds the weight of row ``i`` (``priority ** alpha``; zero for a row that
cannot be drawn). Every node has ``FANOUT`` children except the root, which has up to
``ROOT_FANOUT``: a million leaves sit under two levels of parents and the root, and a
batch of ``k`` updates or draws costs ``O(k * FANOUT)`` work per level in a handful of
vectorised numpy calls (a binary tree needs twenty levels of small calls, and numpy's
cost is per call). Level ``0`` is the leaves; node ``p`` of level ``l + 1`` has the
children ``p * FANOUT ... p * FANOUT + FANOUT - 1`` of level ``l``; the top level (at
most ``ROOT_FANOUT`` nodes) is summed whole into the root, and a draw finds its place
there with one ``searchsorted``. Every level is padded to whole groups of children
(padding weighs zero).

Every parent is recomputed from all its children (never adjusted by a difference), so
the sums carry no drift however many updates they see, and a parent is positive exactly
when one of its children is. The sum tree is float64: a float32 total over millions of
rows would lose the small priorities. The min tree gives the smallest positive weight
that importance weights are normalised by; it starts at the leaves' parents, which take
the minimum of their children's positive weights (``inf`` where there is none).
"""

from __future__ import annotations

import numpy as np

__all__ = ["SumTree", "FANOUT", "ROOT_FANOUT"]

FANOUT = 16  # children per node: a power of two and a multiple of 8 (see _count_rows)
ROOT_FANOUT = 4096  # children of the root at most
_SHIFT = FANOUT.bit_length() - 1
_ONES = np.ones(FANOUT)
# block @ _BEFORE gives, per child, the sum of the children before it
_BEFORE = np.triu(np.ones((FANOUT, FANOUT)), 1)
_BYTE_SUM = np.uint64(0x0101010101010101)


def _count_rows(flags: np.ndarray) -> np.ndarray:
    """How many of each row's ``FANOUT`` booleans are true: the rows are read as 64-bit
    words of 0/1 bytes, added, and one multiply gathers the byte sums into the top byte
    (numpy's ``count_nonzero(axis=1)`` costs a call per row)."""
    words = flags.view(np.uint64)
    count = words[:, 0].copy()
    for i in range(1, words.shape[1]):
        count += words[:, i]
    count *= _BYTE_SUM
    count >>= np.uint64(56)
    return count.view(np.int64)


def _min_rows(blocks: np.ndarray, positive: bool) -> np.ndarray:
    """The minimum of each row of ``[k, FANOUT]`` (``positive``: of its positive values,
    ``inf`` where it has none). Many rows are reduced down the columns of the transposed
    copy, ``FANOUT`` vectorised minima instead of numpy's call per row (and a masked
    reduction is slower than replacing the zeros first)."""
    many = blocks.shape[0] > 32
    if many:
        blocks = blocks.T.copy()
    if positive:
        blocks = np.where(blocks > 0, blocks, np.inf)
    return np.minimum.reduce(blocks, axis=0 if many else 1)


class SumTree:
    """Weights of ``n`` leaves with their total, their minimum and prefix-sum search."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"a sum tree needs at least one leaf, got n={n}")
        self.n = int(n)
        sizes, count = [], self.n
        while True:
            groups = -(-count // FANOUT)
            sizes.append(groups * FANOUT)
            if count <= ROOT_FANOUT:
                break
            count = groups
        # levels 0 (the leaves) .. top, then the root; sums[l] and mins[l] are level l
        self.sums = [np.zeros(size, np.float64) for size in sizes] + [np.zeros(1)]
        # the minima start one level up: a leaf's is its weight where positive, so the
        # leaves' parents take theirs from the sums (one array less to write and gather)
        self.mins = [np.empty(0)] + [np.full(size, np.inf, np.float64) for size in sizes[1:]] + [np.full(1, np.inf)]
        # each level below the top seen as [parents, FANOUT] groups of siblings
        self._sum_groups = [level.reshape(-1, FANOUT) for level in self.sums[:-2]]
        self._min_groups = [level.reshape(-1, FANOUT) for level in self.mins[:-2]]

    # --- reading ----------------------------------------------------------------------

    @property
    def total(self) -> float:
        return float(self.sums[-1][0])

    @property
    def min(self) -> float:
        """The smallest positive leaf weight (``inf`` when every leaf is zero)."""
        return float(self.mins[-1][0])

    def get(self, index: np.ndarray) -> np.ndarray:
        """Leaf weights at ``index``."""
        return self.sums[0][np.asarray(index, np.int64)]

    def leaves(self) -> np.ndarray:
        """A view of every leaf weight (read only by convention)."""
        return self.sums[0][: self.n]

    def find(self, u: np.ndarray) -> np.ndarray:
        """Leaf index of each prefix sum ``u`` in ``[0, total)``: the smallest ``i`` with
        ``sum(leaves[: i + 1]) > u``. A leaf of weight zero is never returned while the
        total is positive."""
        shape = np.shape(u)
        start = np.array(u, np.float64).reshape(-1)
        leaf, rest = self._walk(start.copy(), guarded=False)
        # a walk ends inside its leaf (0 <= rest < weight) unless rounding carried u past
        # the last child with weight of some node, which is rare: those walk again
        weight = self.sums[0].take(leaf, mode="clip")
        lost = ~((rest >= 0) & (rest < weight)) | (leaf >= self.n) | (leaf < 0)
        if lost.any():
            leaf[lost] = self._walk(start[lost], guarded=True)[0]
        return leaf.reshape(shape)

    def _walk(self, u: np.ndarray, guarded: bool) -> tuple[np.ndarray, np.ndarray]:
        """Descend from the root, at each level to the child whose running sum first
        passes ``u`` (children of weight zero before it are stepped over); the leaves
        reached and what is left of ``u`` in them. ``guarded``: where rounding would step
        onto a child of weight zero (``u`` at or past its parent's sum), take the last
        child with weight instead, and the last one at every level below."""
        top = self.sums[-2]
        edges = np.zeros(top.size + 1)
        np.cumsum(top, out=edges[1:])
        node = np.searchsorted(edges, u, side="right") - 1
        np.clip(node, 0, top.size - 1, out=node)
        if guarded:
            lost = ~(top[node] > 0)
            node[lost] = np.flatnonzero(top)[-1] if top.any() else 0
            u[lost] = np.inf
        u -= edges[node]
        row = np.arange(u.size) * FANOUT
        for groups in reversed(self._sum_groups):
            # the unguarded walk may step onto padding past a level's last group when
            # rounding carries it; "clip" keeps the gather in bounds and find() redoes it
            children = groups.take(node, axis=0, mode="clip")
            before = children @ _BEFORE
            pick = _count_rows(before <= u[:, None]) - 1
            if guarded:
                np.maximum(pick, 0, out=pick)
                lost = ~(children.reshape(-1)[row + pick] > 0)
                pick[lost] = FANOUT - 1 - np.argmax(children[lost, ::-1] > 0, axis=1)
                u[lost] = np.inf
            u -= before.reshape(-1)[row + pick]
            node <<= _SHIFT
            node += pick
        return node, u

    # --- writing ----------------------------------------------------------------------

    def set(self, index: np.ndarray, weights: np.ndarray, ascending: bool = False) -> None:
        """Set leaves ``index`` to ``weights``; where an index repeats, its last weight wins
        (``ascending``: the caller knows the indices are strictly ascending)."""
        index = np.asarray(index, np.int64).reshape(-1)
        weights = np.asarray(weights, np.float64)
        if weights.shape != index.shape:
            weights = np.broadcast_to(weights, index.shape).reshape(-1)
        if index.size == 0:
            return
        lo, hi = (index[0], index[-1]) if ascending else (index.min(), index.max())
        if lo < 0 or hi >= self.n:
            raise IndexError(f"leaf index out of range [0, {self.n})")
        if index.size > 1 and not ascending:
            # keep the last occurrence of each index (numpy's fancy assignment with
            # repeats promises no order)
            order = np.argsort(index, kind="stable")
            index = index[order]
            last = np.empty(index.size, bool)
            last[-1] = True
            np.not_equal(index[1:], index[:-1], out=last[:-1])
            index, weights = index[last], weights[order[last]]
        self.sums[0][index] = weights
        node = index
        for level in range(len(self._sum_groups)):
            if self.sums[level + 1].size <= 2 * node.size:
                # about as many parents as updates: recompute the levels above whole
                self._fix_up(level, 0, self.sums[level].size)
                return
            # parents named twice get the same value twice: no need to deduplicate
            node = node >> _SHIFT
            self._recompute(level, node)
        self._recompute_root()

    def set_range(self, lo: int, hi: int, weights: np.ndarray | float) -> None:
        """Set the contiguous leaves ``[lo, hi)``: slices all the way up, no gathers."""
        if not 0 <= lo <= hi <= self.n:
            raise IndexError(f"leaf range [{lo}, {hi}) outside [0, {self.n})")
        if lo == hi:
            return
        w = np.asarray(weights, np.float64)
        self.sums[0][lo:hi] = w
        self._fix_up(0, lo, hi)

    def build(self, weights: np.ndarray) -> None:
        """Set every leaf from ``weights`` (``n`` values) in ``O(n)``."""
        w = np.asarray(weights, np.float64).reshape(-1)
        if w.shape[0] != self.n:
            raise ValueError(f"expected {self.n} leaf weights, got {w.shape[0]}")
        self.sums[0][: self.n] = w
        self._fix_up(0, 0, self.n)

    def _fix_up(self, level: int, a: int, b: int) -> None:
        """Recompute the ancestors of the nodes ``[a, b)`` of ``level``."""
        while level < len(self._sum_groups):
            a, b = a >> _SHIFT, ((b - 1) >> _SHIFT) + 1
            self._recompute(level, slice(a, b))
            level += 1
        self._recompute_root()

    def _recompute(self, level: int, parents: np.ndarray | slice) -> None:
        """The sums and minima of ``parents`` (nodes of ``level + 1``) from their children."""
        if isinstance(parents, slice):
            children = self._sum_groups[level][parents]
        else:
            children = self._sum_groups[level].take(parents, axis=0)
        self.sums[level + 1][parents] = children @ _ONES
        if level:  # the leaves' minima are their positive weights
            if isinstance(parents, slice):
                children = self._min_groups[level][parents]
            else:
                children = self._min_groups[level].take(parents, axis=0)
        self.mins[level + 1][parents] = _min_rows(children, positive=not level)

    def _recompute_root(self) -> None:
        top = self.sums[-2]
        self.sums[-1][0] = top.sum()
        if len(self.sums) > 2:
            self.mins[-1][0] = self.mins[-2].min()
        else:  # the top level is the leaves
            self.mins[-1][0] = np.min(top, initial=np.inf, where=top > 0)
