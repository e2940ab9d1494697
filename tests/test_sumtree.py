"""The sum tree against a plain numpy model: totals, minima, prefix-sum search, updates
with repeated indices (last write wins), contiguous updates and builds."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmreplay.sumtree import SumTree

weights = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, width=32)


def check(tree: SumTree, model: np.ndarray) -> None:
    np.testing.assert_allclose(tree.total, model.sum(), rtol=1e-9)
    positive = model[model > 0]
    assert tree.min == (positive.min() if positive.size else np.inf)
    np.testing.assert_array_equal(tree.leaves(), model)


def model_find(model: np.ndarray, u: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.cumsum(model), u, side="right")


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 70),
    ops=st.lists(
        st.tuples(
            st.lists(st.integers(0, 69), min_size=1, max_size=20), st.lists(weights, min_size=20, max_size=20)
        ),
        max_size=8,
    ),
)
def test_updates_match_a_plain_array(n, ops):
    tree, model = SumTree(n), np.zeros(n)
    for index, values in ops:
        index = np.array(index) % n
        values = np.array(values[: len(index)], np.float64)
        tree.set(index, values)
        for i, v in zip(index, values):  # in order: the last write wins
            model[i] = v
        check(tree, model)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), data=st.data())
def test_build_and_ranges_match_a_plain_array(n, data):
    tree = SumTree(n)
    model = np.array(data.draw(st.lists(weights, min_size=n, max_size=n)), np.float64)
    tree.build(model)
    check(tree, model)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    values = np.array(data.draw(st.lists(weights, min_size=hi - lo, max_size=hi - lo)), np.float64)
    tree.set_range(lo, hi, values)
    model[lo:hi] = values
    check(tree, model)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 70), data=st.data())
def test_find_is_the_prefix_sum_search(n, data):
    model = np.array(data.draw(st.lists(st.integers(0, 50), min_size=n, max_size=n)), np.float64)
    tree = SumTree(n)
    tree.build(model)
    if model.sum() == 0:
        return
    # integer weights: the sums are exact, so the search must agree everywhere
    u = np.array(
        data.draw(st.lists(st.integers(0, int(model.sum()) - 1), min_size=1, max_size=30)), np.float64
    )
    u += np.array(data.draw(st.lists(st.sampled_from([0.0, 0.5]), min_size=len(u), max_size=len(u))))
    found = tree.find(u)
    np.testing.assert_array_equal(found, model_find(model, u))
    assert (model[found] > 0).all()


def test_find_never_lands_on_zero_weight_at_the_total():
    model = np.array([0.1, 0.2, 0.0, 0.3, 0.0, 0.0, 0.0], np.float64)
    tree = SumTree(len(model))
    tree.build(model)
    found = tree.find(np.array([np.nextafter(tree.total, 0), tree.total, 0.0]))
    assert (model[found] > 0).all()


def test_out_of_range_index_is_refused():
    tree = SumTree(5)
    with pytest.raises(IndexError):
        tree.set(np.array([5]), np.array([1.0]))
    with pytest.raises(IndexError):
        tree.set_range(2, 6, 1.0)


# Trees whose root holds the leaves, one level of parents or two, and sizes just past
# a full level, so the padding of every level is walked. Integer weights keep every sum exact, so the
# tree must agree with the model bit for bit; duplicates in one update: the last wins.
sizes = st.sampled_from([1, 2, 15, 16, 17, 31, 255, 256, 257, 4095, 4096, 4097, 5000, 70_001])


@settings(max_examples=80, deadline=None)
@given(n=sizes, data=st.data())
def test_tree_against_cumsum_and_searchsorted(n, data):
    tree, model = SumTree(n), np.zeros(n)
    integer = st.integers(0, 20).map(float)
    for _ in range(data.draw(st.integers(1, 6))):
        if data.draw(st.booleans()):
            k = data.draw(st.integers(1, 40))
            index = np.array(data.draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k)))
            if data.draw(st.booleans()) and k > 1:
                index[-1] = index[0]  # a repeat for sure
            values = np.array(data.draw(st.lists(integer, min_size=k, max_size=k)))
            tree.set(index, values)
            for i, v in zip(index, values):
                model[i] = v
        else:
            lo = data.draw(st.integers(0, n))
            hi = data.draw(st.integers(lo, min(n, lo + 50)))
            values = np.array(data.draw(st.lists(integer, min_size=hi - lo, max_size=hi - lo)))
            tree.set_range(lo, hi, values)
            model[lo:hi] = values
        assert tree.total == model.sum()
        positive = model[model > 0]
        assert tree.min == (positive.min() if positive.size else np.inf)
        np.testing.assert_array_equal(tree.leaves(), model)
        if model.sum() == 0:
            continue
        total = model.sum()
        u = np.array(data.draw(st.lists(st.integers(0, int(total) - 1), min_size=1, max_size=20)), np.float64)
        u += data.draw(st.sampled_from([0.0, 0.25, 0.999]))
        np.testing.assert_array_equal(tree.find(u), model_find(model, u))
        # at and past the total (rounding could carry u there): the last leaf with weight
        last = np.flatnonzero(model)[-1]
        np.testing.assert_array_equal(tree.find(np.array([total, total * 2, np.nextafter(total, 0)]))[:2], last)


@pytest.mark.parametrize("n", [17, 300, 4097, 70_001])
def test_find_with_float_weights_stays_on_weight(n):
    rng = np.random.default_rng(n)
    model = rng.random(n) * (rng.random(n) < 0.3)  # mostly zeros
    model[-1] = 0.0  # the padding follows zeros
    tree = SumTree(n)
    tree.build(model)
    u = np.concatenate([rng.random(2000) * tree.total, [0.0, np.nextafter(tree.total, 0), tree.total]])
    found = tree.find(u)
    assert (found >= 0).all() and (found < n).all() and (model[found] > 0).all()
    # the draws follow the weights: agree with the model except at rounding edges
    assert (found == model_find(model, np.minimum(u, np.nextafter(model.sum(), 0)))).mean() > 0.99
