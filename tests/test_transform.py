"""Transforms over a drawn batch: asked in the request, run once over the final draw, their
reads kept inside the window and checked by readers as the drawn rows are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.read.transform import DrawnBatch

SPEC = {
    "step": mr.ArraySpec((), "int64"),
    "env": mr.ArraySpec((), "int32"),
    "terminated": mr.ArraySpec((), "bool"),
}


def steps_of(t0: int, n: int, num_envs: int) -> dict:
    t = np.arange(t0, t0 + n)[:, None] + np.zeros((1, num_envs), np.int64)
    return {
        "step": t,
        "env": np.broadcast_to(np.arange(num_envs, dtype=np.int32), t.shape),
        "terminated": t % 5 == 4,
    }


@dataclass(frozen=True)
class Ahead:
    """Adds ``ahead``: the ``step`` leaf ``k`` steps on, or at the window's newest step."""

    k: int
    role: str = "terminated"

    def batch_spec(self, spec, roles):
        if self.role not in roles:
            raise mr.BadInputError(f"Ahead needs a {self.role!r} role; the store has {sorted(roles)}")
        return {**spec, "ahead": spec["step"]}

    def __call__(self, batch: DrawnBatch):
        later = np.minimum(batch.step + self.k, batch.window.end - 1)
        return {"ahead": batch.read("step", later, batch.env)}


def make(tmp_path, capacity=16, num_envs=2, n=10, name="b"):
    store = mr.create(tmp_path / name, SPEC, capacity, num_envs=num_envs)
    store.extend(steps_of(0, n, num_envs))
    store.commit()
    return store


def test_a_transform_adds_its_fields_to_the_rows_drawn(tmp_path):
    with make(tmp_path) as store:
        batch, info = store.sample(64, rng=0, transform=Ahead(3), return_info=True)
        np.testing.assert_array_equal(batch["step"], info.step)
        np.testing.assert_array_equal(batch["env"], info.env)
        np.testing.assert_array_equal(batch["ahead"], np.minimum(info.step + 3, 9))
        seq = store.sample(8, num_steps=4, rng=1, transform=Ahead(2))
        assert seq["ahead"].shape == (8, 4)
        np.testing.assert_array_equal(seq["ahead"], np.minimum(seq["step"] + 2, 9))
        plain = store.sample(8, rng=1)
        assert "ahead" not in plain


def test_a_store_the_transform_cannot_serve_is_refused_before_drawing(tmp_path):
    with make(tmp_path) as store:
        with pytest.raises(mr.BadInputError, match="needs a 'reward' role"):
            store.sample(4, transform=Ahead(1, role="reward"))
        with pytest.raises(mr.BadInputError, match="transform cannot be combined with out="):
            store.sample(4, out=store.empty_batch(4), transform=Ahead(1))
        with pytest.raises(mr.BadInputError, match="or layout="):
            store.sample(4, layout="NCHW", transform=Ahead(1))


def test_reads_outside_the_window_are_refused(tmp_path):
    with make(tmp_path, capacity=8, n=12) as store:  # the window is [4, 12)
        with pytest.raises(mr.NotEnoughDataError, match=r"window drawn from is \[4, 12\)"):
            store.sample(4, transform=Ahead(-8))


def test_a_reader_draws_again_when_the_rows_a_transform_read_were_overwritten(tmp_path):
    with make(tmp_path, capacity=16, n=8) as writer, mr.open(tmp_path / "b", "r") as reader:
        writer.extend(steps_of(8, 16, 2))  # every step the reader knows is overwritten
        writer.commit()
        batch, info = reader.sample(40, rng=0, transform=Ahead(2), return_info=True)
        assert info.step.min() >= 8 and (batch["step"] == info.step).all()
        np.testing.assert_array_equal(batch["ahead"], np.minimum(info.step + 2, 23))


@dataclass(frozen=True)
class WritesWhileReading(Ahead):
    """Ahead, whose first run lets the writer overwrite every row the reader drew from."""

    writer: object = None

    def __call__(self, batch: DrawnBatch):
        out = super().__call__(batch)
        if batch.window.first == 0:
            self.writer.extend(steps_of(self.writer.total_steps, 16, 2))
            self.writer.commit()
        return out


def test_a_transform_runs_again_when_the_writer_overwrote_what_it_read(tmp_path):
    with make(tmp_path, capacity=16, n=8) as writer, mr.open(tmp_path / "b", "r") as reader:
        transform = WritesWhileReading(2, writer=writer)
        batch, info = reader.sample(40, rng=0, transform=transform, return_info=True)
        assert info.step.min() >= 8 and (batch["step"] == info.step).all()
        np.testing.assert_array_equal(batch["ahead"], np.minimum(info.step + 2, 23))


def test_each_shard_of_a_group_runs_the_transform_over_its_part(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=16, num_envs=2).close()
    for shard, n in enumerate([6, 10]):
        with mr.open_shard(path, shard) as store:
            store.extend(steps_of(0, n, 2))
    with mr.open_group(path) as group:
        batch, info = group.sample(64, rng=0, transform=Ahead(3), return_info=True)
        newest = np.where(info.shard == 0, 5, 9)
        np.testing.assert_array_equal(batch["ahead"], np.minimum(info.step + 3, newest))
