"""Specs: conversion from spec-like objects, flatten order, leaf paths, JSON round trip."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.spec import (
    flatten,
    leaf_paths,
    spec_from_json,
    spec_to_json,
    to_spec,
    unflatten,
    validate_leaf_path,
)


class TFLikeSpec:
    """What tf_agents ArraySpec / BoundedArraySpec / tf.TensorSpec expose."""

    def __init__(self, shape, dtype, name=None):
        self.shape, self.dtype, self.name = shape, dtype, name


class TFDType:
    """A tf.DType stand-in: numpy dtype behind ``as_numpy_dtype``."""

    def __init__(self, np_dtype):
        self.as_numpy_dtype = np_dtype


def test_array_spec_normalises_shape_and_dtype():
    s = mr.ArraySpec([84, 84, 4], np.uint8, name="pixels")
    assert s.shape == (84, 84, 4) and s.dtype == np.dtype("uint8") and s.name == "pixels"
    assert s.nbytes == 84 * 84 * 4
    assert mr.ArraySpec((), "bool").shape == ()
    assert "ArraySpec(shape=(84, 84, 4), dtype=uint8" in repr(s)


@pytest.mark.parametrize("bad", [(-1,), (None, 3), (1.5,), ("a",)])
def test_array_spec_refuses_bad_shapes(bad):
    with pytest.raises(mr.SpecError, match="shape"):
        mr.ArraySpec(bad, "float32")


@pytest.mark.parametrize("bad", ["object", "U8", "S3", "datetime64[s]", "V4"])
def test_array_spec_refuses_unstorable_dtypes(bad):
    with pytest.raises(mr.SpecError, match="dtype"):
        mr.ArraySpec((2,), bad)


def test_flatten_order_sorts_dict_keys_like_tf_nest():
    spec = {"foo": mr.ArraySpec((4,)), "bar": mr.ArraySpec((3, 7)), "baz": (mr.ArraySpec(()), mr.ArraySpec((2,)))}
    assert leaf_paths(spec) == ["bar", "baz/0", "baz/1", "foo"]
    assert [s.shape for s in flatten(spec)] == [(3, 7), (), (2,), (4,)]
    packed = unflatten(spec, [1, 2, 3, 4])
    assert packed == {"bar": 1, "baz": (2, 3), "foo": 4}


def test_namedtuple_and_list_nests_keep_their_type():
    Traj = collections.namedtuple("Traj", ["step_type", "observation", "reward"])
    spec = Traj(mr.ArraySpec((), "int32"), [mr.ArraySpec((2,)), mr.ArraySpec((3,))], mr.ArraySpec(()))
    assert leaf_paths(spec) == ["step_type", "observation/0", "observation/1", "reward"]
    back = unflatten(spec, ["a", "b", "c", "d"])
    assert isinstance(back, Traj) and back.observation == ["b", "c"]


def test_to_spec_from_tf_like_objects_without_tensorflow():
    spec = to_spec(
        {
            "obs": TFLikeSpec((17,), np.float32, "observation"),
            "step_type": TFLikeSpec([], TFDType(np.int32)),
            "discount": TFLikeSpec((), "float32"),
        }
    )
    assert spec["obs"] == mr.ArraySpec((17,), "float32", "observation")
    assert spec["step_type"].dtype == np.int32 and spec["step_type"].shape == ()


def test_to_spec_refuses_unknown_shape():
    with pytest.raises(mr.SpecError, match="shape is unknown"):
        to_spec({"obs": TFLikeSpec(None, np.float32)})


def test_to_spec_from_gymnasium_spaces():
    gym = pytest.importorskip("gymnasium")
    spaces = gym.spaces
    space = spaces.Dict(
        {
            "box": spaces.Box(-1, 1, (3, 2), np.float32),
            "disc": spaces.Discrete(5),
            "multi": spaces.MultiDiscrete([3, 4]),
            "bin": spaces.MultiBinary(6),
            "tup": spaces.Tuple((spaces.Discrete(2), spaces.Box(0, 255, (4,), np.uint8))),
        }
    )
    spec = to_spec(space)
    assert spec["box"] == mr.ArraySpec((3, 2), "float32")
    assert spec["disc"] == mr.ArraySpec((), "int64")
    assert spec["multi"] == mr.ArraySpec((2,), "int64")
    assert spec["bin"] == mr.ArraySpec((6,), "int8")
    assert spec["tup"] == (mr.ArraySpec((), "int64"), mr.ArraySpec((4,), "uint8"))


@pytest.mark.parametrize("kind", ["OneOf", "Text", "Sequence", "Graph"])
def test_to_spec_refuses_spaces_without_a_fixed_shape_naming_the_space(kind):
    gym = pytest.importorskip("gymnasium")
    spaces = gym.spaces
    space = {
        "OneOf": spaces.OneOf((spaces.Discrete(3), spaces.Discrete(4))),  # samples are (index, value)
        "Text": spaces.Text(5),
        "Sequence": spaces.Sequence(spaces.Discrete(3)),
        "Graph": spaces.Graph(spaces.Box(0, 1, (2,)), spaces.Discrete(3)),
    }[kind]
    with pytest.raises(mr.SpecError, match=f"^obs/0: a gymnasium {kind} space .*Box") as err:
        to_spec({"obs": spaces.Tuple((space,))})
    assert "\n" not in str(err.value)


def test_to_spec_from_example_values():
    spec = to_spec({"obs": np.zeros((3,), np.float16), "done": False, "n": 3, "r": 0.5, "img": np.zeros((2, 2), np.uint8)})
    assert spec == {
        "done": mr.ArraySpec((), "bool"),
        "img": mr.ArraySpec((2, 2), "uint8"),
        "n": mr.ArraySpec((), "int64"),
        "obs": mr.ArraySpec((3,), "float16"),
        "r": mr.ArraySpec((), "float64"),
    }


def test_to_spec_from_torch_tensors():
    torch = pytest.importorskip("torch")
    spec = to_spec({"x": torch.zeros(2, 3, dtype=torch.float16)})
    assert spec["x"] == mr.ArraySpec((2, 3), "float16")


@pytest.mark.parametrize("key", ["", ".", "..", "a/b", "a\\b", "nul\x00"])
def test_keys_that_would_make_bad_leaf_paths_are_refused(key):
    with pytest.raises(mr.SpecError, match="key"):
        to_spec({key: mr.ArraySpec(())})


def test_non_string_keys_are_refused():
    with pytest.raises(mr.SpecError, match="strings"):
        to_spec({1: mr.ArraySpec(())})


@pytest.mark.parametrize("option", ["compression", "chunk_steps"])
def test_per_leaf_options_naming_no_leaf_are_refused_whatever_their_keys(tmp_path, option):
    path = tmp_path / "b"
    # keys of mixed types: named in the error, not a failure to sort them
    with pytest.raises(mr.SpecError, match=rf"{option} names leaves not in the spec: \[1, None\]"):
        mr.create(path, {"x": mr.ArraySpec(())}, 4, **{option: {None: 2, 1: 2}})
    assert not path.exists()


def test_to_spec_refuses_non_spec_leaves():
    with pytest.raises(mr.SpecError, match="obs/x.*object"):
        to_spec({"obs": {"x": object()}})


@pytest.mark.parametrize("path", ["../x", "/abs", "a//b", "a/./b", "", "a\\b"])
def test_validate_leaf_path_refuses_escapes(path):
    with pytest.raises(mr.SpecError):
        validate_leaf_path(path)


def test_json_round_trip_keeps_nest_types_and_names():
    Traj = collections.namedtuple("Trajectory", ["step_type", "observation", "policy_info"])
    spec = {
        "t": Traj(mr.ArraySpec((), "int32", "step_type"), {"pix": mr.ArraySpec((2, 2), "uint8")}, ()),
        "l": [mr.ArraySpec((1,), "complex64")],
    }
    back = spec_from_json(spec_to_json(spec))
    assert leaf_paths(back) == leaf_paths(spec)
    assert flatten(back) == flatten(spec)
    assert type(back["t"]).__name__ == "Trajectory" and back["t"]._fields == Traj._fields
    assert isinstance(back["l"], list)


@pytest.mark.parametrize(
    "bad",
    [
        {"namedtuple": "os.system", "fields": {}},
        {"namedtuple": "T", "fields": {"__class__": {"shape": [], "dtype": "bool"}}},
        {"shape": [1], "dtype": "object"},
        {"shape": "abc", "dtype": "float32"},
        {"dict": {"..": {"shape": [], "dtype": "bool"}}},
        {"weird": 1},
        [],
    ],
)
def test_spec_from_json_refuses_untrusted_descriptions(bad):
    with pytest.raises(mr.SpecError):
        spec_from_json(bad)


def test_a_bare_leaf_spec_has_one_named_leaf():
    spec = mr.ArraySpec((3,), "float32")
    assert leaf_paths(spec) == ["value"] and flatten(spec) == [spec]
    assert unflatten(spec, ["x"]) == "x"


ODD_NAMES = ["with space", "a.b", "ünï€ode", "_lead", ".hidden", "0", "x" * 200, "c", "mmreplay.json", "*?:"]


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_unusual_leaf_names_round_trip_and_the_unstorable_are_refused_by_leaf(tmp_path, backend):
    spec = {name: mr.ArraySpec((), "int16") for name in ODD_NAMES}
    with mr.create(tmp_path / "b", {**spec, "obs": spec}, 4, backend=backend) as store:
        store.add({**{n: [i] for i, n in enumerate(ODD_NAMES)}, "obs": {n: [-i] for i, n in enumerate(ODD_NAMES)}})
    with mr.open(tmp_path / "b") as store:
        got = store.get(0)
        assert [int(got[n][0]) for n in ODD_NAMES] == list(range(len(ODD_NAMES)))
        assert [int(got["obs"][n][0]) for n in ODD_NAMES] == [-i for i in range(len(ODD_NAMES))]
    if backend == "zarr":  # each name is a folder beside its group's zarr.json
        for bad in ({"obs": {"zarr.json": mr.ArraySpec(())}}, {"obs": {"y" * 256: mr.ArraySpec(())}}):
            with pytest.raises(mr.SpecError, match=r"leaf 'obs/(zarr\.json|y+)'"):
                mr.create(tmp_path / "bad", bad, 4, backend=backend)
            assert sorted(os.listdir(tmp_path)) == ["b"]
