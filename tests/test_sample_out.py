"""``sample(..., out=batch)``: gathering into the caller's arrays, and populating the
mapping when a reader opens."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_step

import mmreplay as mr

SAMPLERS = ["uniform", "slices", "prioritized"]


def filled(path, spec, layout, sampler="uniform", steps=30, capacity=24, num_envs=3):
    """A store written past its capacity (so the ring has wrapped), committed."""
    store = mr.create(path, spec, capacity, num_envs, sampler=sampler, **layout)
    for t in range(steps):
        step = make_step(spec, num_envs, t)
        step["terminated"] = np.full(num_envs, t % 7 == 6)
        step["truncated"] = np.zeros(num_envs, bool)
        store.add(step)
    store.commit()
    return store


def leaves(nest):
    return mr.spec.flatten(nest)


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("num_steps", [None, 4])
def test_out_equals_the_allocating_sample(tmp_path, nested_spec, layout, sampler, num_steps):
    with filled(tmp_path / "b", nested_spec, layout, sampler) as store:
        want, want_info = store.sample(16, num_steps, rng=5, return_info=True)
        batch = store.empty_batch(16, num_steps)
        for _ in range(2):  # a batch reused: the second gather overwrites the first
            got, info = store.sample(16, num_steps, rng=5, return_info=True, out=batch)
            assert got is batch
            for a, b in zip(leaves(want), leaves(got)):
                assert a.dtype == b.dtype and a.shape == b.shape
                np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(want_info.step, info.step)
            np.testing.assert_array_equal(want_info.env, info.env)
            np.testing.assert_array_equal(want_info.probability, info.probability)
        # an earlier result is a batch to gather into too
        again = store.sample(16, num_steps, rng=5, out=want)
        assert again is want


def test_out_in_a_reader(tmp_path, nested_spec, layout):
    filled(tmp_path / "b", nested_spec, layout).close()
    with mr.open(tmp_path / "b") as reader:
        want = reader.sample(8, 3, rng=1)
        got = reader.sample(8, 3, rng=1, out=reader.empty_batch(8, 3))
        for a, b in zip(leaves(want), leaves(got)):
            np.testing.assert_array_equal(a, b)


def test_without_replacement_fewer_items_fill_the_first_rows(tmp_path):
    spec = {"x": mr.ArraySpec((2,), "float32")}
    with mr.create(tmp_path / "b", spec, 10, 1) as store:
        store.extend({"x": np.arange(6, dtype="float32").reshape(3, 1, 2)})
        batch = store.empty_batch(5)
        batch["x"][:] = -1
        got = store.sample(5, replacement=False, rng=0, out=batch)
        assert got["x"].shape == (3, 2)
        assert np.shares_memory(got["x"], batch["x"])
        assert sorted(got["x"][:, 0].tolist()) == [0, 2, 4]
        assert (batch["x"][3:] == -1).all()


def _bad_batches(store):
    """(what is wrong, the batch, words the error must hold)."""
    good = store.empty_batch(8)
    out = []
    wrong_shape = dict(good, reward=np.zeros(9, "float32"))
    out.append(("shape", wrong_shape, ["'reward'", "(8,)", "(9,)"]))
    wrong_dtype = dict(good, reward=np.zeros(8, "float64"))
    out.append(("dtype", wrong_dtype, ["'reward'", "float32", "float64"]))
    seq = store.empty_batch(8, 2)
    out.append(("sequences for single steps", seq, ["(8, 2)", "(8, 2, 2)"]))
    missing = {k: v for k, v in good.items() if k != "action"}
    out.append(("missing leaf", missing, ["'action'", "missing"]))
    extra = dict(good, more=np.zeros(8))
    out.append(("extra leaf", extra, ["'more'", "unexpected"]))
    nested = dict(good, obs=dict(good["obs"], pixels=np.zeros((8, 4, 4), "uint8")))
    out.append(("nested leaf shape", nested, ["'obs/pixels'", "(8, 4, 4, 3)"]))
    listed = dict(good, reward=[0.0] * 8)
    out.append(("not an array", listed, ["'reward'", "list"]))
    frozen = dict(good, reward=np.zeros(8, "float32"))
    frozen["reward"].flags.writeable = False
    out.append(("read-only", frozen, ["'reward'", "read-only"]))
    return out


def test_a_batch_that_does_not_fit_is_refused_and_left_as_it_was(tmp_path, nested_spec, layout):
    with filled(tmp_path / "b", nested_spec, layout) as store:
        for what, batch, words in _bad_batches(store):
            for leaf in leaves(batch):
                if isinstance(leaf, np.ndarray) and leaf.flags.writeable:
                    leaf[...] = 7
            before = [np.array(leaf, copy=True) for leaf in leaves(batch)]
            gen = np.random.default_rng(3)
            state = gen.bit_generator.state
            with pytest.raises(mr.BadInputError) as err:
                store.sample(8, rng=gen, out=batch)
            for word in words:
                assert word in str(err.value), (what, str(err.value))
            for a, b in zip(before, leaves(batch)):
                np.testing.assert_array_equal(a, np.asarray(b), err_msg=what)
            assert gen.bit_generator.state == state, f"{what}: the rng drew before refusing"


def test_populate_at_open(tmp_path, nested_spec, layout):
    filled(tmp_path / "b", nested_spec, layout).close()
    mapped = layout["compression"] is None
    with mr.open(tmp_path / "b", populate=True) as store:
        populator = store._populator
        assert (populator is not None) == mapped
        if mapped:
            assert populator.wait(60)
            assert populator.advice and populator.advice <= {"populate_read", "willneed"}
        batch = store.sample(4, rng=0)
        again = store.sample(4, rng=0, out=store.empty_batch(4))
        for a, b in zip(leaves(batch), leaves(again)):
            np.testing.assert_array_equal(a, b)
    # a small reader populates by default, a writer and populate=False do not
    with mr.open(tmp_path / "b") as store:
        assert (store._populator is not None) == mapped
    with mr.open(tmp_path / "b", populate=False) as store:
        assert store._populator is None
    with mr.open(tmp_path / "b", "a") as store:
        assert store._populator is None
    with pytest.raises(TypeError, match="populate"):
        mr.open(tmp_path / "b", populate="yes")


def test_closing_while_populating_stops_the_thread(tmp_path):
    spec = {"pixels": mr.ArraySpec((84, 84, 4), "uint8")}
    with mr.create(tmp_path / "b", spec, 400, 4) as store:
        store.extend({"pixels": np.ones((400, 4, 84, 84, 4), "uint8")})
    store = mr.open(tmp_path / "b", populate=True)
    thread = store._populator.thread
    store.close()
    assert not thread.is_alive()
