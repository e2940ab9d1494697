"""TF-Agents layer: NumpyStorage and UniformReplayBuffer against TFUniformReplayBuffer's behaviour.

TensorFlow is not needed: the specs are spec-like objects shaped as TF-Agents' own
(``ArraySpec`` / ``BoundedArraySpec`` with numpy dtypes, ``TensorSpec`` with a DType that
has ``as_numpy_dtype``) and the ``Trajectory`` namedtuple. Real-TF checks skip without it.
The numbered comments refer to the conformance checks of the reference semantics.
"""

from __future__ import annotations

import collections
import os
import sys
import textwrap

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.compat.tf_agents import BufferInfo, NumpyStorage, UniformReplayBuffer

# --- spec-like objects, as TF-Agents and TensorFlow define them ------------------------


class ArraySpec:
    def __init__(self, shape, dtype, name=None):
        self.shape, self.dtype, self.name = tuple(shape), np.dtype(dtype), name


class BoundedArraySpec(ArraySpec):
    def __init__(self, shape, dtype, minimum=0, maximum=1, name=None):
        super().__init__(shape, dtype, name)
        self.minimum, self.maximum = minimum, maximum


class DType:
    """Mimics ``tf.DType``: not a numpy dtype, but convertible through ``as_numpy_dtype``."""

    def __init__(self, dtype):
        self.as_numpy_dtype = np.dtype(dtype).type


class TensorSpec:
    def __init__(self, shape, dtype, name=None):
        self.shape, self.dtype, self.name = tuple(shape), DType(dtype), name


Trajectory = collections.namedtuple(
    "Trajectory",
    ["step_type", "observation", "action", "policy_info", "next_step_type", "reward", "discount"],
)

FIRST, MID, LAST = 0, 1, 2


def trajectory_spec(obs_dim=3, tensor=False):
    S = TensorSpec if tensor else ArraySpec
    return Trajectory(
        step_type=S((), np.int32, "step_type"),
        observation=S((obs_dim,), np.float32, "observation"),
        action=(BoundedArraySpec((), np.int64, 0, 1, "action") if not tensor else S((), np.int64, "action")),
        policy_info=(),
        next_step_type=S((), np.int32, "step_type"),
        reward=S((), np.float32, "reward"),
        discount=(
            BoundedArraySpec((), np.float32, 0, 1, "discount")
            if not tensor
            else S((), np.float32, "discount")
        ),
    )


def make_rb(tmp_path, batch_size=2, max_length=5, name="rb", **kw):
    return UniformReplayBuffer(
        ArraySpec((), np.int64), batch_size, max_length, path=tmp_path / name, seed=0, **kw
    )


def as_numpy(x):
    """Outputs as numpy: tensors once TensorFlow is imported (as TF-Agents returns), else arrays."""
    if isinstance(x, dict):
        return {k: as_numpy(v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(as_numpy(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(as_numpy(v) for v in x)
    return x.numpy() if hasattr(x, "numpy") else x


def add_counter(rb, n, start=0):
    """Add ``n`` batches; segment b of add t holds ``100 * b + t``."""
    for t in range(start, start + n):
        rb.add_batch(100 * np.arange(rb.batch_size) + t)


# --- NumpyStorage ---------------------------------------------------------------------


def test_numpy_storage_refuses_tensor_specs_naming_the_leaf(tmp_path):  # 1
    spec = {"obs": ArraySpec((2,), np.float32), "act": TensorSpec((), np.int64)}
    with pytest.raises(ValueError, match="array_spec.ArraySpec") as err:
        NumpyStorage(spec, 5, path=tmp_path / "s")
    assert "'act'" in str(err.value)
    assert not (tmp_path / "s").exists()


def test_numpy_storage_one_leaf_per_array_sorted_zeros_before_set(tmp_path):  # 2
    spec = {"foo": ArraySpec((4,), np.uint8), "bar": ArraySpec((3, 7), np.float32)}
    with NumpyStorage(spec, 5, path=tmp_path / "s") as s:
        assert s.store.leaf_paths == ["bar", "foo"]
        item = s.get(0)
        assert item["foo"].dtype == np.uint8 and item["foo"].shape == (4,) and not item["foo"].any()
        assert item["bar"].dtype == np.float32 and item["bar"].shape == (3, 7) and not item["bar"].any()
        assert s.store.total_steps == 0  # reading wrote nothing


def test_numpy_storage_indexing_like_numpy(tmp_path):  # 3
    spec = {"x": ArraySpec((2,), np.int32)}
    with NumpyStorage(spec, 5, path=tmp_path / "s") as s:
        with pytest.raises(IndexError):
            s.get(5)
        with pytest.raises(IndexError):
            s.get(-6)
        s.set(4, {"x": [8, 9]})
        assert s.get(-1)["x"].tolist() == [8, 9]
        s.set(slice(0, 2), {"x": [[1, 2], [3, 4]]})
        s.set(np.array([3]), {"x": [[5, 6]]})
        assert s.get(slice(None))["x"].tolist() == [[1, 2], [3, 4], [0, 0], [5, 6], [8, 9]]
        assert s.get(np.array([[4, 0]]))["x"].shape == (1, 2, 2)
        with pytest.raises(IndexError):
            s.set(7, {"x": [1, 1]})


def test_numpy_storage_says_why_an_index_is_refused(tmp_path):
    with NumpyStorage({"x": ArraySpec((2,), np.int32)}, 5, path=tmp_path / "s") as s:
        with pytest.raises(IndexError, match=r"index 7 of a NumpyStorage of capacity 5: .*out of bounds"):
            s.get(7)
        for idx in (1.0, "1", np.array([0.5])):  # no index at all: numpy's reason, not "out of range"
            with pytest.raises(IndexError, match=r"capacity 5: (only integers|arrays used as indices)") as refused:
                s.set(idx, {"x": [1, 1]})
            assert "out of" not in str(refused.value)
        assert s.store.total_steps == 0

def test_numpy_storage_set_broadcasts_scalars_and_checks_structure(tmp_path):
    spec = {"a": ArraySpec((3,), np.uint8), "b": ArraySpec((), np.float32)}
    with NumpyStorage(spec, 4, path=tmp_path / "s") as s:
        s.set(1, {"a": 7, "b": 0.5})
        assert s.get(1)["a"].tolist() == [7, 7, 7] and s.get(1)["b"] == np.float32(0.5)
        before = s.store.total_steps
        with pytest.raises(mr.BadInputError, match="missing 'b'"):
            s.set(3, {"a": [1, 2, 3]})  # TF-Agents would shift leaves by position
        with pytest.raises(mr.BadInputError, match="uint8"):
            s.set(3, {"a": [300, 0, 0], "b": 1.0})  # TF-Agents would store 44
        assert s.store.total_steps == before  # nothing written, not even the zero gap
        assert not s.get(3)["a"].any()


def test_numpy_storage_shape_errors_name_the_shapes_of_the_call_and_bools_are_no_index(tmp_path):
    with NumpyStorage({"a": ArraySpec((4,), np.uint8)}, 5, path=tmp_path / "s") as s:
        with pytest.raises(mr.BadInputError, match=r"leaf 'a': expected .*\(4,\), got shape \(3,\)$"):
            s.set(0, {"a": np.ones(3, np.uint8)})
        with pytest.raises(mr.BadInputError, match=r"leaf 'a': expected .*\(2, 4\), got shape \(2, 3\)$"):
            s.set(slice(0, 2), {"a": np.ones((2, 3), np.uint8)})
        for flag in (True, np.True_):  # numpy reads a bool as a new axis over every slot
            with pytest.raises(IndexError, match="capacity 5"):
                s.get(flag)
            with pytest.raises(IndexError, match="capacity 5"):
                s.set(flag, {"a": np.ones((1, 5, 4), np.uint8)})
        assert s.store.total_steps == 0


def test_deterministic_pass_overtaken_by_adds_raises_instead_of_yielding_newer_frames(tmp_path):
    rb = UniformReplayBuffer(ArraySpec((), np.int64), batch_size=1, max_length=5, path=tmp_path / "rb")
    for t in range(5):
        rb.add_batch(np.array([t]))
    passed = rb.as_dataset(num_steps=2, single_deterministic_pass=True)
    passed = iter(passed)  # a tf.data.Dataset where TensorFlow is installed
    assert np.asarray(next(passed)[0]).tolist() == [0, 1]
    for t in range(5, 12):  # the ring wraps over frames 2..4 of the pass
        rb.add_batch(np.array([t]))
    tf = sys.modules.get("tensorflow")  # whose dataset wraps the error in its own
    with pytest.raises((mr.NotEnoughDataError, *([tf.errors.InvalidArgumentError] if tf else [])), match="overwritten"):
        next(passed)
    rb.close()


def test_numpy_storage_tuple_and_single_leaf_specs(tmp_path):
    with NumpyStorage(ArraySpec((2,), np.float64), 3, path=tmp_path / "one") as s:
        s.set(2, np.array([1.5, 2.5]))
        assert s.get(2).tolist() == [1.5, 2.5]
        assert s.get(0).tolist() == [0.0, 0.0]
    with NumpyStorage((ArraySpec((), np.int64), ArraySpec((2,), np.int8)), 3, path=tmp_path / "tup") as s:
        s.set(0, (5, [1, 2]))
        first, second = s.get(0)
        assert first == 5 and second.tolist() == [1, 2]


def test_numpy_storage_reopens_with_its_data_and_refuses_another_spec(tmp_path):
    spec = {"x": ArraySpec((2,), np.float32)}
    with NumpyStorage(spec, 6, path=tmp_path / "s") as s:
        for i in range(6):
            s.set(i, {"x": [i, -i]})
        s.set(2, {"x": [20, 20]})
    with NumpyStorage(spec, 6, path=tmp_path / "s") as s:
        assert s.get(slice(None))["x"][:, 0].tolist() == [0, 1, 20, 3, 4, 5]
    with pytest.raises(mr.SpecMismatchError, match="x"):
        NumpyStorage({"x": ArraySpec((3,), np.float32)}, 6, path=tmp_path / "s")
    with pytest.raises(mr.SpecMismatchError, match="capacity: existing 6 vs new 7"):
        NumpyStorage(spec, 7, path=tmp_path / "s")
    with NumpyStorage(spec, 6, path=tmp_path / "s") as s:  # refusals changed nothing
        assert s.get(5)["x"].tolist() == [5, -5]


def test_numpy_storage_without_path_is_temporary():
    s = NumpyStorage({"x": ArraySpec((), np.int16)}, 3)
    folder = s.store.path
    s.set(1, {"x": 4})
    assert s.get(1)["x"] == 4 and os.path.isdir(folder)
    s.close()
    assert not os.path.exists(folder)
    s.close()  # safe twice
    t = NumpyStorage({"x": ArraySpec((), np.int16)}, 3)
    folder = t.store.path
    del t
    assert not os.path.exists(folder)


# --- UniformReplayBuffer: adds, frames, gather_all -----------------------------------


def test_counters_and_gather_all_after_wrap(tmp_path):  # 8, 9
    with make_rb(tmp_path) as rb:
        assert rb.last_id == -1 and rb.num_frames() == 0
        assert as_numpy(rb.gather_all()).shape == (2, 0)
        add_counter(rb, 3)
        assert rb.num_frames() == 6
        assert as_numpy(rb.gather_all()).tolist() == [[0, 1, 2], [100, 101, 102]]
        add_counter(rb, 4, start=3)
        assert rb.last_id == 6 and rb.num_frames() == 10 and rb.capacity == 10
        assert as_numpy(rb.gather_all()).tolist() == [[2, 3, 4, 5, 6], [102, 103, 104, 105, 106]]


def test_add_batch_wrong_batch_or_structure_consumes_nothing(tmp_path):  # 15, adapted
    spec = {"obs": ArraySpec((2,), np.float32), "reward": ArraySpec((), np.float32)}
    with UniformReplayBuffer(spec, batch_size=3, max_length=4, path=tmp_path / "rb") as rb:
        rb.add_batch({"obs": np.zeros((3, 2)), "reward": np.zeros(3)})
        with pytest.raises(mr.BadInputError, match="obs"):
            rb.add_batch({"obs": np.zeros((2, 2)), "reward": np.zeros(2)})
        with pytest.raises(ValueError, match="missing 'reward'"):
            rb.add_batch({"obs": np.zeros((3, 2))})
        assert rb.last_id == 0 and rb.num_frames() == 3
        rb.add_batch({"obs": np.ones((3, 2)), "reward": 2.0})  # a scalar broadcasts to the batch
        items = as_numpy(rb.gather_all())
        assert items["reward"].tolist() == [[0, 2]] * 3 and rb.last_id == 1


def test_ring_wrap_matches_a_plain_model(tmp_path):
    B, L = 3, 7
    spec = {"obs": ArraySpec((2,), np.int64), "t": ArraySpec((), np.int64)}
    with UniformReplayBuffer(spec, batch_size=B, max_length=L, path=tmp_path / "rb", seed=1) as rb:
        model = []
        for t in range(40):
            obs = np.stack([[t, b] for b in range(B)])
            rb.add_batch({"obs": obs, "t": np.full(B, t)})
            model.append(obs)
            kept = model[-L:]
            got = as_numpy(rb.gather_all())
            assert got["obs"].tolist() == np.stack(kept, axis=1).tolist()
            assert rb.num_frames() == B * len(kept)
            items, info = as_numpy(rb.get_next(sample_batch_size=16, num_steps=min(3, len(kept))))
            T = items["t"].shape[1]
            assert (np.diff(items["t"], axis=1) == 1).all()  # consecutive, never across the cursor
            assert (items["t"] >= t - len(kept) + 1).all() and (items["t"] <= t).all()
            assert (info.ids == items["t"]).all()
            assert (items["obs"][..., 0] == items["t"]).all()
            assert np.allclose(info.probabilities, 1 / ((len(kept) - T + 1) * B))


# --- get_next -------------------------------------------------------------------------


def test_get_next_shapes_ids_and_probabilities(tmp_path):  # 10, 14
    with make_rb(tmp_path) as rb:
        add_counter(rb, 7)
        items, info = as_numpy(rb.get_next(sample_batch_size=4, num_steps=3))
        assert items.shape == (4, 3) and info.ids.shape == (4, 3)
        assert np.allclose(info.probabilities, 1 / 6) and info.probabilities.shape == (4,)
        assert info.probabilities.dtype == np.float32
        assert (items % 100 == info.ids).all()
        item, info = as_numpy(rb.get_next())
        assert np.shape(item) == () and np.shape(info.ids) == () and np.isclose(info.probabilities, 0.1)
        items, info = as_numpy(rb.get_next(sample_batch_size=5))
        assert items.shape == (5,) and info.ids.shape == (5,)
        items, info = as_numpy(rb.get_next(num_steps=2))
        assert items.shape == (2,) and info.ids.shape == (2,) and np.shape(info.probabilities) == ()
        items, info = as_numpy(rb.get_next(sample_batch_size=2, num_steps=3, time_stacked=False))
        assert isinstance(items, tuple) and len(items) == 3 and all(x.shape == (2,) for x in items)
        assert isinstance(info.ids, tuple) and len(info.ids) == 3 and info.probabilities.shape == (2,)
        assert ((items[1] - items[0]) == 1).all()
        items, _ = as_numpy(rb.get_next(num_steps=3, time_stacked=False))
        assert len(items) == 3 and all(np.shape(x) == () for x in items)


def test_get_next_never_crosses_the_cursor_or_the_oldest_frame(tmp_path):  # 11
    with make_rb(tmp_path) as rb:
        add_counter(rb, 7)
        seen = set()
        for _ in range(300):
            items, info = as_numpy(rb.get_next(num_steps=3))
            seen.add(tuple(int(x) for x in items))
            assert (items % 100 == info.ids).all()
        allowed = {(2, 3, 4), (3, 4, 5), (4, 5, 6)}
        allowed |= {tuple(100 + x for x in w) for w in allowed}
        assert seen == allowed


def test_get_next_says_empty_or_too_short(tmp_path):  # 12, 13
    with make_rb(tmp_path) as rb:
        with pytest.raises(mr.NotEnoughDataError, match="is empty"):
            as_numpy(rb.get_next())
        add_counter(rb, 2)
        with pytest.raises(mr.NotEnoughDataError, match="too short for num_steps=3"):
            as_numpy(rb.get_next(num_steps=3))
        items, info = as_numpy(rb.get_next(num_steps=2))
        assert items.tolist() in ([0, 1], [100, 101]) and info.ids.tolist() == [0, 1]
        add_counter(rb, 3, start=2)
        for _ in range(20):
            items, _ = as_numpy(rb.get_next(num_steps=5))
            assert items.tolist() in ([0, 1, 2, 3, 4], [100, 101, 102, 103, 104])
        with pytest.raises(mr.NotEnoughDataError):
            as_numpy(rb.get_next(num_steps=6))


def test_sampling_is_uniform_over_starts_and_segments(tmp_path):
    with make_rb(tmp_path, batch_size=2, max_length=5) as rb:
        add_counter(rb, 7)
        items, _ = as_numpy(rb.get_next(sample_batch_size=6000, num_steps=2))
        _, counts = np.unique(items[:, 0], return_counts=True)
        assert len(counts) == 8  # 4 starts (2..5) x 2 segments
        expected = 6000 / 8
        chi2 = ((counts - expected) ** 2 / expected).sum()
        assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001


# --- deterministic pass ---------------------------------------------------------------


def numpy_items(dataset):
    return (as_numpy(pair) for pair in dataset)


def empty_errors():
    """What sampling an empty buffer raises: also TF's error, once TensorFlow is imported."""
    tf = sys.modules.get("tensorflow")
    return (mr.NotEnoughDataError,) + (() if tf is None else (tf.errors.InvalidArgumentError,))


def windows(rb, **kw):
    return [items.tolist() for items, _ in numpy_items(rb.as_dataset(single_deterministic_pass=True, **kw))]


def test_deterministic_pass_windows_shift_and_drop(tmp_path):  # 16, 17
    for shift, drop, expected in [
        (None, False, [[0, 1], [2, 3], [4]]),
        (None, True, [[0, 1], [2, 3]]),
        (1, False, [[0, 1], [1, 2], [2, 3], [3, 4], [4]]),
        (1, True, [[0, 1], [1, 2], [2, 3], [3, 4]]),
    ]:
        name = f"rb-{shift}-{drop}"
        with make_rb(tmp_path, 1, 5, name, dataset_window_shift=shift, dataset_drop_remainder=drop) as rb:
            add_counter(rb, 5)
            assert windows(rb, num_steps=2) == expected


def test_deterministic_pass_after_wrap_for_any_batch_size(tmp_path):  # 18, bug (a) fixed
    with make_rb(tmp_path, 1, 5, "b1") as rb:
        add_counter(rb, 7)
        assert windows(rb) == [2, 3, 4, 5, 6]
        assert windows(rb, num_steps=2) == [[2, 3], [4, 5], [6]]
    with make_rb(tmp_path, 2, 5, "b2") as rb:
        add_counter(rb, 7)
        assert windows(rb) == [2, 3, 4, 5, 6, 102, 103, 104, 105, 106]
        assert windows(rb, num_steps=2) == [[2, 3], [4, 5], [6], [102, 103], [104, 105], [106]]


def test_deterministic_pass_with_sample_batch_size(tmp_path):  # 19, bugs (b) and (c) fixed
    with make_rb(tmp_path, 5, 3, "s5") as rb:
        add_counter(rb, 3)
        assert windows(rb, sample_batch_size=5) == [
            [0, 100, 200, 300, 400],
            [1, 101, 201, 301, 401],
            [2, 102, 202, 302, 402],
        ]
    with make_rb(tmp_path, 4, 3, "s4") as rb:
        add_counter(rb, 3)
        got = windows(rb, sample_batch_size=3)
        assert got[:3] == [[0, 100, 200], [1, 101, 201], [2, 102, 202]] and got[3:] == [[300], [301], [302]]
    with make_rb(tmp_path, 4, 5, "st") as rb:
        add_counter(rb, 5)
        got = windows(rb, sample_batch_size=2, num_steps=2)
        # windows stay inside each group of segments, in time order
        assert got == [
            [[0, 1], [100, 101]], [[2, 3], [102, 103]], [[4], [104]],
            [[200, 201], [300, 301]], [[202, 203], [302, 303]], [[204], [304]],
        ]  # fmt: skip
    with make_rb(tmp_path, 3, 4, "st3") as rb:
        add_counter(rb, 4)
        got = windows(rb, sample_batch_size=2, num_steps=2)
        assert got[-2:] == [[[200, 201]], [[202, 203]]]  # the smaller last group is kept
    with make_rb(tmp_path, 3, 4, "st3d", dataset_drop_remainder=True) as rb:
        add_counter(rb, 4)
        assert windows(rb, sample_batch_size=2, num_steps=2) == [[[0, 1], [100, 101]], [[2, 3], [102, 103]]]


def test_deterministic_pass_buffer_info_and_errors(tmp_path):  # 20, 21
    with make_rb(tmp_path, 2, 5, dataset_drop_remainder=True) as rb:
        with pytest.raises(ValueError, match="ALL data will be dropped"):
            rb.as_dataset(sample_batch_size=3, single_deterministic_pass=True)
        with pytest.raises(ValueError, match="ALL data will be dropped"):
            rb.as_dataset(num_steps=6, single_deterministic_pass=True)
        empty = rb.as_dataset(single_deterministic_pass=True)
        with pytest.raises(empty_errors(), match="is empty"):
            next(iter(empty))
        add_counter(rb, 7)
        passed = rb.as_dataset(sample_batch_size=2, num_steps=2, single_deterministic_pass=True)
        for items, info in numpy_items(passed):
            assert info.probabilities == ()
            # table rows: the segment (items // 100) times max_length, plus the frame id
            assert (info.ids == items // 100 * 5 + items % 100).all() and info.ids.shape == (2, 2)


def test_deterministic_pass_reads_the_frames_present_when_its_iteration_starts(tmp_path):
    """As TF-Agents: a pass made before the adds sees them; adds made during it do not."""
    with make_rb(tmp_path, 1, 10) as rb:
        add_counter(rb, 3)
        it = iter(rb.as_dataset(single_deterministic_pass=True))
        add_counter(rb, 2, start=3)
        first = next(it)
        add_counter(rb, 2, start=5)
        assert [int(x) for x, _ in [first, *it]] == [0, 1, 2, 3, 4]


def test_random_dataset_repeats_get_next(tmp_path):
    with make_rb(tmp_path) as rb:
        add_counter(rb, 7)
        it = numpy_items(rb.as_dataset(sample_batch_size=3, num_steps=2, num_parallel_calls=4))
        for _ in range(5):
            items, info = next(it)
            assert isinstance(info, BufferInfo) and items.shape == (3, 2) and info.probabilities.shape == (3,)
            assert ((items[:, 1] - items[:, 0]) == 1).all()


# --- clear, lists, reopen, specs ------------------------------------------------------


def test_clear_restarts_ids(tmp_path):  # 22
    with make_rb(tmp_path) as rb:
        add_counter(rb, 7)
        rb.clear()
        assert rb.num_frames() == 0 and rb.last_id == -1
        with pytest.raises(mr.NotEnoughDataError):
            as_numpy(rb.get_next())
        rb.add_batch(np.array([50, 150]))
        item, info = as_numpy(rb.get_next())
        assert int(info.ids) == 0 and int(item) in (50, 150)
        assert as_numpy(rb.gather_all()).tolist() == [[50], [150]]


def test_reopen_resumes_ids_frames_and_refuses_another_spec(tmp_path):  # 23, adapted
    with make_rb(tmp_path) as rb:
        add_counter(rb, 7)
        rb.clear()
        add_counter(rb, 3, start=10)
    with make_rb(tmp_path) as rb:
        assert rb.last_id == 2 and rb.num_frames() == 6
        assert as_numpy(rb.gather_all()).tolist() == [[10, 11, 12], [110, 111, 112]]
        add_counter(rb, 4, start=13)
        assert rb.last_id == 6 and rb.num_frames() == 10
        assert as_numpy(rb.gather_all()).tolist() == [[12, 13, 14, 15, 16], [112, 113, 114, 115, 116]]
    with make_rb(tmp_path, commit_every=50) as rb:  # the store's own commit policy wins on reopen
        assert as_numpy(rb.gather_all()).tolist() == [[12, 13, 14, 15, 16], [112, 113, 114, 115, 116]]
    with pytest.raises(mr.SpecMismatchError, match="num_envs: existing 2 vs new 3"):
        make_rb(tmp_path, batch_size=3)
    with pytest.raises(mr.SpecMismatchError, match="max_length: existing 5 vs new 6"):
        make_rb(tmp_path, max_length=6)
    with pytest.raises(mr.SpecMismatchError, match="compression: existing"):
        make_rb(tmp_path, compression="zstd")
    with pytest.raises(mr.SpecMismatchError, match="leaves differ"):
        UniformReplayBuffer(ArraySpec((), np.float32), 2, 5, path=tmp_path / "rb")
    with make_rb(tmp_path) as rb:
        assert rb.last_id == 6


def test_full_window_survives_reopen_for_any_commit_every(tmp_path):
    for ce in (1, 3, 100, 1000):
        with make_rb(tmp_path, 2, 20, f"rb{ce}", commit_every=ce) as rb:
            add_counter(rb, 47)
            assert rb.num_frames() == 40  # the writer sees uncommitted adds too
        with make_rb(tmp_path, 2, 20, f"rb{ce}") as rb:
            assert rb.num_frames() == 40
            assert as_numpy(rb.gather_all())[0].tolist() == list(range(27, 47))


def test_spec_with_lists_samples_and_iterates(tmp_path):  # 24, adapted: as_dataset works too
    spec = [ArraySpec((), np.int64), ArraySpec((2,), np.float32)]
    with UniformReplayBuffer(spec, 1, 4, path=tmp_path / "rb") as rb:
        for t in range(3):
            rb.add_batch([np.array([t]), np.full((1, 2), t)])
        items, _ = as_numpy(rb.get_next(sample_batch_size=2))
        assert isinstance(items, list) and items[1].shape == (2, 2)
        got = [items[0].tolist() for items, _ in numpy_items(rb.as_dataset(single_deterministic_pass=True))]
        assert got == [0, 1, 2]


def test_trajectory_spec_roles_and_driver_observer(tmp_path):  # 25, 26
    spec = trajectory_spec()
    rb = UniformReplayBuffer(spec, batch_size=1, max_length=32, path=tmp_path / "rb")
    assert rb.store.roles == {
        "observation": "observation",
        "action": "action",
        "reward": "reward",
        "step_type": "step_type",
        "next_step_type": "next_step_type",
        "discount": "discount",
    }

    def episode(n, base):
        """Trajectory.from_episode-like steps, then the driver's boundary step."""
        steps = []
        for i in range(n):
            st = FIRST if i == 0 else MID
            nst = LAST if i == n - 1 else MID
            steps.append(
                Trajectory(
                    st, np.full(3, base + i, np.float32), base + i, (), nst, 1.0, 1.0 if i < n - 1 else 0.0
                )
            )
        steps.append(Trajectory(LAST, np.zeros(3, np.float32), 0, (), FIRST, 0.0, 1.0))
        return steps

    observers = [rb.add_batch]  # a driver calls each observer with the batched trajectory
    for traj in episode(4, 10) + episode(2, 20):
        batched = Trajectory(*(() if isinstance(x, tuple) else np.asarray(x)[None] for x in traj))
        for observer in observers:
            observer(batched)
    got = as_numpy(rb.gather_all())
    assert isinstance(got, Trajectory)
    assert got.step_type[0].tolist() == [0, 1, 1, 1, 2, 0, 1, 2]
    assert got.next_step_type[0].tolist() == [1, 1, 1, 2, 0, 1, 2, 0]
    assert got.action[0].tolist() == [10, 11, 12, 13, 0, 20, 21, 0]
    assert got.policy_info == ()
    items, _ = as_numpy(rb.get_next(sample_batch_size=4, num_steps=2))
    assert isinstance(items, Trajectory) and items.observation.shape == (4, 2, 3)
    # episodes end where next_step_type is LAST; the boundary rows belong to none
    rb.store.commit()
    eps = [(ep.first_step, ep.last_step, ep.status) for ep in rb.store.episodes()]
    assert eps == [(0, 3, "terminated"), (5, 6, "terminated")]
    rb.close()
    with UniformReplayBuffer(trajectory_spec(), batch_size=1, max_length=32, path=tmp_path / "rb") as rb:
        assert rb.num_frames() == 8


def test_tensor_specs_and_a_vector_reward(tmp_path):
    spec = trajectory_spec(tensor=True)._replace(reward=TensorSpec((2,), np.float32, "reward"))
    with UniformReplayBuffer(spec, 2, 3, path=tmp_path / "rb") as rb:
        assert "reward" not in rb.store.roles and rb.store.roles["step_type"] == "step_type"
        step = Trajectory(
            np.zeros(2, np.int32), np.ones((2, 3), np.float32), np.array([0, 1]), (),
            np.ones(2, np.int32), np.ones((2, 2), np.float32), np.ones(2, np.float32),
        )  # fmt: skip
        rb.add_batch(step)
        assert as_numpy(rb.gather_all()).reward.shape == (2, 1, 2)


# --- crash: SIGKILL of a real writer -------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from mmreplay.compat.tf_agents import UniformReplayBuffer, NumpyStorage
    import mmreplay as mr
    path, kind = sys.argv[1], sys.argv[2]
    if kind == "rb":
        rb = UniformReplayBuffer({"t": mr.ArraySpec((), "int64"), "obs": mr.ArraySpec((3,), "float32")},
                                 batch_size=2, max_length=50, path=path, commit_every=1)
        t = rb.last_id + 1
        while True:
            rb.add_batch({"t": np.array([t, t]), "obs": np.stack([np.full(3, t), np.full(3, -t)]).astype("float32")})
            print(t, flush=True)
            t += 1
    else:
        s = NumpyStorage({"x": mr.ArraySpec((2,), "int64")}, 64, path=path)
        i = 0
        while True:
            s.set(i % 64, {"x": [i, i % 64]})
            print(i, flush=True)
            i += 1
    """
)


def run_and_kill(writers, path, kind, at_least):
    """Start a writer, wait until it reports ``at_least`` operations, SIGKILL it."""
    proc = writers.start(WRITER, path, kind)
    return int(writers.kill_when(proc, lambda line: int(line) >= at_least))


def test_uniform_replay_buffer_survives_sigkill(tmp_path, writers):
    path = tmp_path / "rb"
    done = run_and_kill(writers, path, "rb", 120)
    spec = {"t": mr.ArraySpec((), "int64"), "obs": mr.ArraySpec((3,), "float32")}
    with UniformReplayBuffer(spec, batch_size=2, max_length=50, path=path) as rb:
        assert rb.last_id >= done  # every reported add was committed before it was reported
        got = as_numpy(rb.gather_all())
        assert rb.num_frames() == 100
        assert got["t"][0].tolist() == list(range(rb.last_id - 49, rb.last_id + 1))
        assert (got["obs"][0] == got["t"][0][:, None]).all() and (
            got["obs"][1] == -got["t"][1][:, None]
        ).all()
        resumed = rb.last_id + 1
        rb.add_batch({"t": np.array([resumed] * 2), "obs": np.zeros((2, 3), "float32")})
        assert rb.last_id == resumed


def test_numpy_storage_survives_sigkill(tmp_path, writers):
    path = tmp_path / "s"
    done = run_and_kill(writers, path, "ns", 150)
    with NumpyStorage({"x": mr.ArraySpec((2,), "int64")}, 64, path=path) as s:
        x = s.get(slice(None))["x"]
        assert (x[:, 1] == np.arange(64)).all()
        assert (x[:, 0] % 64 == np.arange(64)).all()
        assert int(x[:, 0].max()) >= done


# --- real TensorFlow (skipped when it is not installed) ------------------------------


def test_as_dataset_is_a_tf_dataset_with_tensorflow(tmp_path):
    tf = pytest.importorskip("tensorflow")
    with UniformReplayBuffer(tf.TensorSpec([], tf.int64), 2, 5, path=tmp_path / "rb") as rb:
        add_counter(rb, 7)
        ds = rb.as_dataset(sample_batch_size=3, num_steps=2)
        assert isinstance(ds, tf.data.Dataset)
        items, info = next(iter(ds))
        assert items.shape == (3, 2) and info.ids.shape == (3, 2)
        passes = [x.numpy().tolist() for x, _ in rb.as_dataset(num_steps=2, single_deterministic_pass=True)]
        assert passes == [[2, 3], [4, 5], [6], [102, 103], [104, 105], [106]]


def test_real_tf_agents_specs(tmp_path):
    tf = pytest.importorskip("tensorflow")
    array_spec = pytest.importorskip("tf_agents.specs.array_spec")
    spec = {
        "obs": array_spec.BoundedArraySpec((2,), np.float32, -1, 1),
        "act": array_spec.ArraySpec((), np.int32),
    }
    with NumpyStorage(spec, 3, path=tmp_path / "s") as s:
        s.set(1, {"obs": [0.5, -0.5], "act": 2})
        assert s.get(1)["act"] == 2
    with pytest.raises(ValueError, match="array_spec.ArraySpec"):
        NumpyStorage({"obs": tf.TensorSpec((2,), tf.float32)}, 3, path=tmp_path / "t")


# --- prioritized replay through the layer -----------------------------------------------


def test_prioritized_buffer_draws_by_priority_and_updates_land(tmp_path):
    with make_rb(tmp_path, 2, 4, "per", sampler="prioritized", alpha=1.0, commit_every=1) as rb:
        add_counter(rb, 6)  # frames 2..5 of each segment are shown
        assert rb.store.sampler.name == "prioritized"
        ids = np.array([2, 3, 4, 5, 2, 3, 4, 5])
        segments = np.array([0, 0, 0, 0, 1, 1, 1, 1])
        assert rb.update_priorities(ids, segments, [0, 0, 0, 0, 0, 1.0, 0, 0]) == 8
        items, info = as_numpy(rb.get_next(sample_batch_size=64))
        assert set(items.tolist()) == {103}  # frame 3 of segment 1
        assert set(info.ids.tolist()) == {3} and set(rb.last_sample.env.tolist()) == {1}
        assert info.probabilities == pytest.approx(np.ones(64), rel=1e-6)
        assert rb.last_sample.weight.shape == (64,)
        # the update lands on the item the sample gave
        rb.update_priorities(info.ids[:1], rb.last_sample.env[:1], [0.0])
        rb.update_priorities([4], [0], [3.0])
        items, _ = as_numpy(rb.get_next(sample_batch_size=32, num_steps=2))
        assert items.tolist() == [[4, 5]] * 32
    with make_rb(tmp_path, 2, 4, "per") as rb:  # reopened: sampler and priorities are back
        assert rb.store.sampler.name == "prioritized"
        got = rb.store.sampler.priorities(np.array([4, 3]), np.array([0, 1]))
        assert got == pytest.approx([3.0, 0.0], abs=1e-6)


def test_uniform_buffer_has_no_priorities(tmp_path):
    with make_rb(tmp_path, 2, 4) as rb:
        add_counter(rb, 2)
        with pytest.raises(TypeError, match="keeps no priorities"):
            rb.update_priorities([0], [0], [1.0])
