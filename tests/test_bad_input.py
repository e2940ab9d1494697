"""Bad input: every way a value can be wrong gets a named error and changes nothing on disk."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
from conftest import LAYOUT_KWARGS, folder_digest, make_step, spread

import mmreplay as mr
from mmreplay.spec import flatten

ENVS = 3




def good(spec, t):
    return make_step(spec, ENVS, t)


def batch(spec, lo, hi):
    rows = [good(spec, t) for t in range(lo, hi)]

    def stack(sub, items):
        if isinstance(sub, dict):
            return {k: stack(sub[k], [x[k] for x in items]) for k in sub}
        return np.stack(items)

    return stack(spec, rows)


def edit(value, path: str, new):
    """A deep copy of ``value`` with the item at ``path`` (``a/b``) replaced, or deleted for ``DELETE``."""
    out = copy.deepcopy(value)
    *parents, last = path.split("/")
    node = out
    for p in parents:
        node = node[p]
    if new is DELETE:
        del node[last]
    else:
        node[last] = new(node[last]) if callable(new) else new
    return out


DELETE = object()

#: (name, function step -> bad step, words the error must contain); for add (one step, [num_envs, ...])
STEP_CASES = [
    ("missing key", lambda s: edit(s, "reward", DELETE), ["missing", "reward"]),
    ("missing nested key", lambda s: edit(s, "obs/state", DELETE), ["missing", "obs/state"]),
    ("extra key", lambda s: {**s, "value": np.zeros(ENVS)}, ["unexpected", "value"]),
    ("extra nested key", lambda s: edit(s, "obs/depth", np.zeros((ENVS, 2))), ["unexpected", "obs/depth"]),
    (
        "flat instead of nested",
        lambda s: {
            **edit(s, "obs", DELETE),
            "obs/pixels": s["obs"]["pixels"],
            "obs/state": s["obs"]["state"],
        },
        ["missing", "obs"],
    ),
    (
        "leaf where a dict belongs",
        lambda s: edit(s, "obs", lambda v: v["pixels"]),
        ["obs", "expected a dict"],
    ),
    ("dict where a leaf belongs", lambda s: edit(s, "reward", lambda v: {"r": v}), ["reward"]),
    ("step is a list", lambda s: list(s.values()), ["expected a dict"]),
    ("step is None", lambda s: None, ["expected a dict"]),
    ("step is an array", lambda s: np.zeros(3), ["expected a dict"]),
    (
        "wrong leaf shape",
        lambda s: edit(s, "obs/state", np.zeros((ENVS, 4), "float32")),
        ["obs/state", "(3, 5)", "(3, 4)"],
    ),
    (
        "env axis missing",
        lambda s: edit(s, "obs/pixels", lambda v: v[0]),
        ["obs/pixels", "leading axis is missing"],
    ),
    ("wrong num_envs", lambda s: edit(s, "action", lambda v: v[:2]), ["action", "(3, 2)", "(2, 2)"]),
    ("extra axis", lambda s: edit(s, "reward", lambda v: v[:, None]), ["reward", "(3,)", "(3, 1)"]),
    ("transposed", lambda s: edit(s, "action", lambda v: v.T), ["action", "(2, 3)"]),
    ("float into int", lambda s: edit(s, "action", lambda v: v + 0.5), ["action", "float64", "int64"]),
    ("int into bool", lambda s: edit(s, "terminated", np.zeros(ENVS, "int64")), ["terminated", "bool"]),
    ("float into bool", lambda s: edit(s, "truncated", np.zeros(ENVS)), ["truncated", "bool"]),
    (
        "complex into float",
        lambda s: edit(s, "reward", np.ones(ENVS, complex)),
        ["reward", "complex128", "float32"],
    ),
    (
        "int too big for uint8",
        lambda s: edit(s, "obs/pixels", lambda v: v.astype("int64") + 300),
        ["obs/pixels", "do not fit", "uint8"],
    ),
    (
        "negative into uint8",
        lambda s: edit(s, "obs/pixels", lambda v: v.astype("int64") - 300),
        ["obs/pixels", "do not fit"],
    ),
    (
        "uint64 too big for int64",
        lambda s: edit(s, "action", np.full((ENVS, 2), 2**63, "uint64")),
        ["action", "do not fit"],
    ),
    (
        "float64 past the float32 range",
        lambda s: edit(s, "reward", np.array([0.5, 1e39, 2.0])),
        ["reward", "1e+39", "float32", "infinity"],
    ),
    (
        "float64 past the float32 range below",
        lambda s: edit(s, "obs/state", lambda v: np.where(np.arange(5) == 4, -3.5e38, v.astype("float64"))),
        ["obs/state", "-3.5e+38", "float32"],
    ),
    ("strings", lambda s: edit(s, "reward", np.array(["1", "2", "3"])), ["reward", "<U1"]),
    ("bytes", lambda s: edit(s, "reward", b"abc"), ["reward"]),
    ("None leaf", lambda s: edit(s, "reward", None), ["reward", "None"]),
    (
        "object array",
        lambda s: edit(s, "reward", np.array([1.0, None, 2.0], dtype=object)),
        ["reward", "object"],
    ),
    (
        "object array of numbers",
        lambda s: edit(s, "reward", np.array([1.0, 2.0, 3.0], dtype=object)),
        ["reward", "object"],
    ),
    ("python scalar", lambda s: edit(s, "reward", 1.0), ["reward", "(3,)", "()"]),
    ("python int for a vector", lambda s: edit(s, "action", 1), ["action", "(3, 2)"]),
    ("python bool", lambda s: edit(s, "terminated", True), ["terminated", "(3,)"]),
    ("list of wrong length", lambda s: edit(s, "reward", [1.0, 2.0]), ["reward", "(3,)", "(2,)"]),
    ("ragged list", lambda s: edit(s, "action", [[1, 2], [3], [4, 5]]), ["action"]),
    ("list of strings", lambda s: edit(s, "action", [["a", "b"]] * ENVS), ["action"]),
    ("list with None", lambda s: edit(s, "reward", [1.0, None, 2.0]), ["reward"]),
    ("a set", lambda s: edit(s, "reward", {1.0, 2.0, 3.0}), ["reward"]),
    ("a generator", lambda s: edit(s, "reward", (x for x in range(3))), ["reward"]),
    ("a structured array", lambda s: edit(s, "reward", np.zeros(ENVS, [("a", "f4")])), ["reward"]),
    ("datetime", lambda s: edit(s, "action", np.zeros((ENVS, 2), "datetime64[s]")), ["action", "datetime64"]),
]

#: the same for extend (T steps, [T, num_envs, ...])
BATCH_CASES = [
    ("steps disagree", lambda b: edit(b, "reward", lambda v: v[:-1]), ["reward", "(4, 3)", "(3, 3)"]),
    ("first leaf a scalar", lambda b: edit(b, "action", 1), ["action", "scalar"]),
    ("a single step given", lambda b: edit(b, "obs/state", lambda v: v[0]), ["obs/state"]),
    (
        "num_envs wrong in one leaf",
        lambda b: edit(b, "terminated", lambda v: v[:, :2]),
        ["terminated", "(4, 3)", "(4, 2)"],
    ),
    ("missing key", lambda b: edit(b, "truncated", DELETE), ["missing", "truncated"]),
    ("float into int", lambda b: edit(b, "action", lambda v: v.astype("float32")), ["action", "float32"]),
    ("object array", lambda b: edit(b, "obs/state", lambda v: v.astype(object)), ["obs/state", "object"]),
    (
        "float past the float32 range in the last step only",
        lambda b: edit(b, "reward", lambda v: np.concatenate([v[:-1], np.full((1, ENVS), 1e39)])),
        ["reward", "1e+39", "float32"],
    ),
    (
        "overflow in the last step only",
        lambda b: edit(b, "obs/pixels", lambda v: np.concatenate([v[:-1], v[-1:].astype("int64") + 256])),
        ["obs/pixels", "do not fit"],
    ),
]


def _check_refused(store, path, call, words) -> None:
    before = folder_digest(path)
    total, committed = store.total_steps, store.committed_steps
    with pytest.raises(mr.BadInputError) as info:
        call()
    message = str(info.value)
    for w in words:
        assert w in message, (w, message)
    assert folder_digest(path) == before
    assert (store.total_steps, store.committed_steps) == (total, committed)


@pytest.fixture
def filled(tmp_path, layout, nested_spec):
    """A writer over a buffer whose ring has wrapped, with uncommitted steps staged."""
    path = tmp_path / "b"
    store = mr.create(path, nested_spec, capacity=8, num_envs=ENVS, chunk_steps=3, commit_every=5, **layout)
    store.extend(batch(nested_spec, 0, 10))
    store.add(good(nested_spec, 10))
    yield store, path, nested_spec
    store.close()


def _rows_are(path, spec, lo, hi) -> None:
    with mr.open(path) as reader:
        assert (reader.first_step, reader.committed_steps) == (lo, hi)
        for i, t in enumerate(range(lo, hi)):
            for got, want in zip(flatten(reader.get(i)), flatten(good(spec, t))):
                np.testing.assert_array_equal(got, want)


#: each refusal on one layout (a refusal comes before any leaf is touched), every layout in
#: turn; every pair with --long (the ``layout`` fixture, given directly)
STEPS_ON_LAYOUTS = spread({c[0]: c for c in STEP_CASES}, LAYOUT_KWARGS)


@pytest.mark.parametrize(("name", "bad", "words", "layout"), STEPS_ON_LAYOUTS)
def test_add_refuses(filled, name, bad, words):
    store, path, spec = filled
    _check_refused(store, path, lambda: store.add(bad(good(spec, 11))), words)
    store.add(good(spec, 11))  # the store goes on as if nothing happened
    store.close()
    _rows_are(path, spec, 4, 12)


@pytest.mark.parametrize(("name", "bad", "words", "layout"), STEPS_ON_LAYOUTS)
def test_set_refuses(filled, name, bad, words):
    store, path, spec = filled
    store.commit()
    _check_refused(store, path, lambda: store.set(-1, bad(good(spec, 99))), words)
    store.close()
    _rows_are(path, spec, 3, 11)


@pytest.mark.parametrize(("name", "bad", "words", "layout"), spread({c[0]: c for c in BATCH_CASES}, LAYOUT_KWARGS))
def test_extend_refuses(filled, name, bad, words):
    store, path, spec = filled
    _check_refused(store, path, lambda: store.extend(bad(batch(spec, 11, 15))), words)
    store.extend(batch(spec, 11, 15))
    store.close()
    _rows_are(path, spec, 7, 15)


def test_set_with_a_slice_refuses_a_wrong_count(filled):
    store, path, spec = filled
    store.commit()
    _check_refused(store, path, lambda: store.set(slice(0, 3), batch(spec, 0, 2)), ["(3, 3"])


def test_extend_of_more_than_the_ring_checks_every_step(filled):
    store, path, spec = filled
    bad = batch(spec, 11, 31)
    bad["reward"][0, 0] = np.nan  # NaN is data
    bad["action"] = bad["action"].astype("float64")
    bad["action"][0, 0] = 0.5  # only the first step (which the ring would drop) is wrong
    _check_refused(store, path, lambda: store.extend(bad), ["action", "float64"])


def test_nan_and_inf_are_data(tmp_path, layout, nested_spec):
    path = tmp_path / "b"
    step = good(nested_spec, 0)
    payload = np.array([0x7FC00001, 0x7F800000, 0xFF800000], "uint32").view(
        "float32"
    )  # a NaN payload, +inf, -inf
    step["reward"] = payload
    step["obs"]["state"][0, :] = np.nan
    with mr.create(path, nested_spec, capacity=4, num_envs=ENVS, **layout) as store:
        store.add(step)
    with mr.open(path) as store:
        got = store.get(0)
        assert got["reward"].tobytes() == payload.tobytes()
        assert np.isnan(got["obs"]["state"][0]).all()


def test_casts_that_are_allowed_store_the_values(tmp_path, nested_spec):
    """Allowed: safe casts, ints that fit, int to float, float64 rewards into float32."""
    path = tmp_path / "b"
    step = good(nested_spec, 0)
    step["obs"]["pixels"] = step["obs"]["pixels"].astype("int64")  # fits in uint8
    step["reward"] = [0.5, 1.5, 2.5]  # a list of Python floats
    step["action"] = step["action"].astype("int8")
    with mr.create(path, nested_spec, capacity=4, num_envs=ENVS) as store:
        store.add(step)
    with mr.open(path) as store:
        got = store.get(0)
        assert got["obs"]["pixels"].dtype == np.uint8 and got["reward"].dtype == np.float32
        np.testing.assert_array_equal(got["reward"], [0.5, 1.5, 2.5])
        np.testing.assert_array_equal(got["obs"]["pixels"], good(nested_spec, 0)["obs"]["pixels"])


def test_a_dtype_accepted_once_passes_again_but_values_are_checked_every_time(tmp_path, layout):
    """The validator remembers the dtypes it accepted (float64 into float32), yet looks at
    the values of each add where they may not fit: integer narrowings, and floats past a
    narrower float's range (which the cast would make infinite), in any position."""
    spec = {"small": mr.ArraySpec((), "int8"), "reward": mr.ArraySpec((), "float32")}
    path = tmp_path / "b"
    with mr.create(path, spec, capacity=8, num_envs=2, **layout) as store:
        for i in range(3):
            store.add({"small": np.array([i, -i], np.int64), "reward": np.array([i + 0.25, 0.5])})
        with pytest.raises(mr.BadInputError, match="small"):
            store.add({"small": np.array([1, 300], np.int64), "reward": np.zeros(2)})
        with pytest.raises(mr.BadInputError, match="reward"):
            store.add({"small": np.zeros(2, np.int8), "reward": np.array(["a", "b"])})
        for past in ([1e39, 0.0], [0.0, -1e39], [np.nan, 1e300]):
            with pytest.raises(mr.BadInputError, match=r"reward.*past the range of float32"):
                store.add({"small": np.zeros(2, np.int8), "reward": np.array(past)})
        assert store.total_steps == 3
        store.add({"small": np.zeros(2, np.int8), "reward": np.array([np.inf, np.nan])})  # data, as given
        store.add({"small": np.zeros(2, np.int8), "reward": np.array([3.4028235e38, -3.4028235e38])})
        assert store.total_steps == 5
    with mr.open(path) as store:
        np.testing.assert_array_equal(store.get(2)["small"], [2, -2])
        np.testing.assert_array_equal(store.get(2)["reward"], np.array([2.25, 0.5], np.float32))
        assert store.get(2)["reward"].dtype == np.float32
        np.testing.assert_array_equal(store.get(3)["reward"], [np.inf, np.nan])
        np.testing.assert_array_equal(store.get(4)["reward"], np.array([3.4028235e38, -3.4028235e38], np.float32))


def test_integers_into_a_float16_leaf_warn_nothing(tmp_path):
    """float16 is the one float too narrow for every integer: its values are looked at,
    without a numpy overflow warning on every add."""
    with mr.create(tmp_path / "b", {"x": mr.ArraySpec((), "float16")}, capacity=4, num_envs=2) as store:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            store.add({"x": np.array([1, 65504], np.int64)})
            with pytest.raises(mr.BadInputError, match="past the range of float16"):
                store.add({"x": np.array([1, 70000], np.int64)})
        np.testing.assert_array_equal(store.get(0)["x"], np.array([1, 65504], np.float16))
        assert store.total_steps == 1
