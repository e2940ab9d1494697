"""``Store.write_next``: rows of the next step written ahead of its add, on every layout."""

from __future__ import annotations

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.read import SampleRequest
from mmreplay.read import sample as sample_store
from mmreplay.samplers import Draw, Sampler

SPEC = {"x": mr.ArraySpec((2,), "float32"), "n": mr.ArraySpec((), "int64")}


def step(value: float, envs: int = 3) -> dict:
    return {"x": np.full((envs, 2), value, "float32"), "n": np.full(envs, int(value), "int64")}


class NextStep(Sampler):
    """Draws every env of the step after the window's end (the written-ahead one)."""

    name = "next-step-test"

    def draw(self, window, request, size, steps, rng):
        envs = np.arange(window.num_envs)
        start = (window.end % window.capacity) * window.num_envs + envs
        return Draw(start, window.num_envs, 1.0, flat=window.end * window.num_envs + envs)


def test_rows_written_ahead_are_read_by_the_writer_but_not_counted_or_committed(tmp_path, layout):
    path = tmp_path / "b"
    with mr.create(path, SPEC, capacity=4, num_envs=3, commit_every=1, **layout) as store:
        for t in range(2):
            store.add(step(t))
        store.write_next(step(7))
        assert (len(store), store.total_steps, store.committed_steps) == (2, 2, 2)
        n, x = store.read_steps([2])  # leaves in flatten order
        assert n.tolist() == [[7] * 3] and x.tolist() == [[[7, 7]] * 3]
        got = sample_store(store, SampleRequest.build(3, sampler=NextStep()))  # the fetch path reads them too
        assert got["n"].tolist() == [7, 7, 7]
        with mr.open(path, "r") as reader:
            assert reader.committed_steps == 2 and len(reader) == 2
        store.add(step(9))  # the step's add overwrites what was written ahead
        assert store.get(-1)["n"].tolist() == [9, 9, 9]
        store.write_next(step(5))
    with mr.open(path, "r") as store:  # close does not commit rows written ahead
        assert store.committed_steps == 3 and [int(store.get(i)["n"][0]) for i in range(3)] == [0, 1, 9]


def test_rows_written_ahead_leave_the_oldest_step_out_when_they_share_its_slot(tmp_path, layout):
    with mr.create(tmp_path / "b", SPEC, capacity=4, num_envs=3, commit_every=1, **layout) as store:
        for t in range(4):
            store.add(step(t))
        assert store.window[:2] == (0, 4)
        store.write_next(step(8))  # the slot of step 4 is step 0's
        assert store.window[:2] == (1, 4) and len(store) == 3
        assert [int(store.get(i)["n"][0]) for i in range(3)] == [1, 2, 3]
        batch = store.sample(64, rng=0)
        assert 0 not in batch["n"] and 8 not in batch["n"]
        store.add(step(4))
        assert store.window[:2] == (1, 5)
        store.write_next(step(8))
        store.clear()  # drops the rows written ahead with the rest
        assert store.window[:2] == (5, 5)


def test_a_bad_step_written_ahead_changes_nothing(tmp_path):
    with mr.create(tmp_path / "b", SPEC, capacity=4, num_envs=3) as store:
        store.add(step(1))
        store.write_next(step(6))
        with pytest.raises(mr.BadInputError, match="'x'"):
            store.write_next({"x": np.zeros((3, 5), "float32"), "n": np.zeros(3, "int64")})
        assert store.read_steps([1])[0].tolist() == [[6, 6, 6]]


def test_readers_cannot_write_ahead(tmp_path):
    with mr.create(tmp_path / "b", SPEC, capacity=4, num_envs=3) as store:
        store.add(step(1))
    with mr.open(tmp_path / "b", "r") as reader, pytest.raises(mr.ReadOnlyError):
        reader.write_next(step(2))


def test_a_close_after_rows_written_ahead_does_not_commit_the_step_whose_slot_they_took(tmp_path, layout):
    """A partial step at close (a skrl memory's, at exit): the committed window leaves
    out the oldest step, whose slot now holds the rows written ahead."""
    path = tmp_path / "b"
    with mr.create(path, SPEC, capacity=4, num_envs=3, commit_every=10**6, **layout) as store:
        for t in range(4):
            store.add(step(t))
        store.write_next(step(8))  # into the slot of step 0
    with mr.open(path) as reader:
        assert reader.window[:2] == (1, 4)
        assert [int(reader.get(i)["n"][0]) for i in range(len(reader))] == [1, 2, 3]
