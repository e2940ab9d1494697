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
