"""Shard writers in Ray actors, the learner's fan-out sampler, and ray.data reads, on a
local Ray cluster (one per test session: starting one costs seconds).

One test runs in the normal run (the whole path once: actors, a kill and restart, the
sampler, ray.data); the others are long tests (``--long``): starting the cluster, each
actor's worker process and ray.data's executor take seconds each on a loaded 2-core
machine. ``ray`` is in the ``test`` extra (and the ``ray`` extra)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_group import SPEC, check_rows, fill, steps_of

import mmreplay as mr
from mmreplay.group import write_manifest


@pytest.fixture(scope="module")
def cluster():
    """``(ray, mmreplay.ray)`` with a local cluster running (imported here: importing
    ray alone takes seconds, which a run without --long should not pay)."""
    ray = pytest.importorskip("ray")
    mray = pytest.importorskip("mmreplay.ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray, mray
    ray.shutdown()


def info_of(ray, writer) -> dict:
    return ray.get(writer.info.remote())


def restarted(ray, writer, pid: int) -> dict:
    """The info of an actor Ray is restarting, once a process other than ``pid`` answers
    (``ray.kill`` returns before the old process is gone: a call right after it may still
    reach that one)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            info = info_of(ray, writer)
            if info["pid"] != pid:
                return info
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the actor was not restarted"
        time.sleep(0.2)


def test_actors_write_shards_one_killed_resumes_and_the_learner_samples_and_reads(cluster, tmp_path):
    ray, mray = cluster
    writers = mray.start_writers(str(tmp_path), SPEC, shards=2, capacity=40, commit_every=1000)
    for shard, writer in enumerate(writers):
        ray.get(writer.extend.remote(steps_of(shard, 0, 10, 1)))
        ray.get(writer.commit.remote())
    ray.get(writers[0].extend.remote(steps_of(0, 10, 3, 1)))  # the uncommitted tail
    before = info_of(ray, writers[0])
    ray.kill(writers[0], no_restart=False)  # Ray restarts it: it reopens its store
    after = restarted(ray, writers[0], before["pid"])
    assert after["pid"] != before["pid"] and after["total_steps"] == after["committed_steps"] == 10
    assert ray.get(writers[0].extend.remote(steps_of(0, 10, 5, 1))) == 15  # it resumes its shard
    ray.get(writers[0].commit.remote())
    batch, info = mray.RaySampler(writers, SPEC).sample(64, rng=0, return_info=True)
    check_rows(batch, info)
    assert set(info.shard) == {0, 1} and info.step[info.shard == 0].max() <= 14
    for writer in writers:
        ray.get(writer.close.remote())
    write_manifest(tmp_path, 2)  # the shards' folder becomes a group, read by ray.data
    rows = mray.read_store(tmp_path).take_batch(100)
    assert sorted(rows["shard"].tolist()) == [0] * 15 + [1] * 10
    assert (rows["obs"][:, 0] == rows["shard"]).all() and (rows["obs"][:, 1] == rows["global_step"]).all()


def test_a_dead_actor_misses_its_priority_updates_and_a_closed_one_says_it_is_closed(cluster, tmp_path):
    """The learner's update after a batch carries on when an actor died since (as its
    sample does); a writer closed on purpose answers with ClosedError naming its store."""
    ray, mray = cluster
    writers = mray.start_writers(
        str(tmp_path), SPEC, shards=2, capacity=30, sampler="prioritized", alpha=1.0, eps=0.0
    )
    for shard, writer in enumerate(writers):
        ray.get(writer.extend.remote(steps_of(shard, 0, 10, 1)))
        ray.get(writer.commit.remote())
    sampler = mray.RaySampler(writers, SPEC)
    ray.kill(writers[1], no_restart=True)
    deadline = time.monotonic() + 60
    while True:  # ray.kill returns before the process is gone
        try:
            info_of(ray, writers[1])
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the actor did not die"
        time.sleep(0.2)
    shard, step = np.array([0, 0, 1, 1]), np.array([1, 2, 1, 2])
    assert sampler.update_priorities(shard, step, np.zeros(4, int), np.full(4, 3.0)) == 2
    assert sampler.masses()[0].total == 14.0  # shard 0's part was applied
    ray.get(writers[0].close.remote())
    with pytest.raises(mr.ClosedError, match="shard-000: store is closed"):
        sampler.sample(4)


def test_an_actor_that_failed_to_start_is_said_once_with_its_error(cluster, tmp_path, caplog):
    """A shard actor whose store could not be made never answers (Ray does not restart a
    failed creation): the sampler said it was down, with Ray's whole traceback, at every
    batch, as if it would come back."""
    ray, mray = cluster
    (tmp_path / "shard-001").write_text("not a folder")  # where shard 1's store goes
    writers = mray.start_writers(str(tmp_path), SPEC, shards=2, capacity=30)
    ray.get(writers[0].extend.remote(steps_of(0, 0, 10, 1)))
    ray.get(writers[0].commit.remote())
    sampler = mray.RaySampler(writers, SPEC)
    caplog.set_level("WARNING", logger="mmreplay.ray")
    for seed in range(3):
        batch, info = sampler.sample(8, rng=seed, return_info=True)
        check_rows(batch, info)
        assert (info.shard == 0).all()
    assert sampler.update_priorities(np.array([1]), np.array([1]), np.array([0]), np.array([2.0])) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "mmreplay.ray"]
    assert len(said) == 1, said
    assert "failed to start" in said[0] and "shard-001: already exists and is not a buffer" in said[0]
    assert len(said[0].splitlines()) == 1


@pytest.mark.long
def test_the_ray_sampler_draws_across_shard_actors_from_their_committed_steps(cluster, tmp_path):
    ray, mray = cluster
    writers = mray.start_writers(str(tmp_path), SPEC, shards=3, capacity=50, num_envs=2, commit_every=1000)
    for shard, (writer, n) in enumerate(zip(writers, [10, 0, 30])):
        ray.get(writer.extend.remote(steps_of(shard, 0, n, 2)))
        ray.get(writer.commit.remote())
    ray.get(writers[0].extend.remote(steps_of(0, 10, 5, 2)))  # not committed: never drawn
    sampler = mray.RaySampler(writers, SPEC)
    batch, info = sampler.sample(2000, rng=0, return_info=True)
    check_rows(batch, info)
    counts = np.bincount(info.shard, minlength=3)
    assert counts[1] == 0 and abs(counts[0] / 2000 - 0.25) < 0.04, counts
    assert info.step[info.shard == 0].max() == 9
    np.testing.assert_allclose(info.probability, 1 / 80)
    batch, info = sampler.sample(64, num_steps=4, rng=1, return_info=True)
    check_rows(batch, info)
    assert (np.diff(batch["obs"][..., 1], axis=1) == 1).all()
    # the shard with no rows is asked again at each batch: once it has some, it is drawn
    ray.get(writers[1].extend.remote(steps_of(1, 0, 30, 2)))
    ray.get(writers[1].commit.remote())
    sampler.sample(8)
    _, info = sampler.sample(1000, rng=2, return_info=True)
    assert (info.shard == 1).any()
    # the stores are ordinary stores on disk, readable by the learner's node as a folder
    for writer in writers:
        ray.get(writer.close.remote())
    with mr.open(tmp_path / "shard-002") as store:
        assert len(store) == 30


@pytest.mark.long
def test_priorities_go_back_to_the_actor_of_each_item(cluster, tmp_path):
    ray, mray = cluster
    writers = mray.start_writers(
        str(tmp_path), SPEC, shards=2, capacity=30, sampler="prioritized", alpha=1.0, beta=0.5, eps=0.0
    )
    for shard, writer in enumerate(writers):
        ray.get(writer.extend.remote(steps_of(shard, 0, 10, 1)))
        ray.get(writer.commit.remote())
    sampler = mray.RaySampler(writers, SPEC)
    assert (
        sampler.update_priorities(np.ones(10, int), np.arange(10), np.zeros(10, int), np.full(10, 9.0)) == 10
    )
    assert [m.total for m in sampler.masses()] == [10.0, 90.0]
    _, info = sampler.sample(2000, rng=0, return_info=True)
    assert abs(np.mean(info.shard == 1) - 0.9) < 0.03
    np.testing.assert_allclose(info.weight, np.where(info.shard == 1, 9**-0.5, 1.0), rtol=1e-5)
    # a shard index that names no actor (-1 is not the last one), or is not an integer,
    # is refused before any actor is sent its part, as a group refuses it
    steps, envs = np.arange(4), np.zeros(4, int)
    for shard in (np.array([0, 0, 1, -1]), np.array([0, 0, 1, 2]), np.array([0.0, 0.0, 1.0, 1.0])):
        with pytest.raises(mr.BadInputError, match="shard"):
            sampler.update_priorities(shard, steps, envs, np.full(4, 50.0))
    assert [m.total for m in sampler.masses()] == [10.0, 90.0]


@pytest.mark.long
def test_nan_priorities_reach_no_actor(cluster, tmp_path):
    """A learner's NaN TD errors for a few items: the update is refused before it is sent,
    so no actor applies its sound part while another refuses its own."""
    ray, mray = cluster
    writers = mray.start_writers(str(tmp_path), SPEC, shards=2, capacity=20, sampler="prioritized")
    for shard, writer in enumerate(writers):
        ray.get(writer.extend.remote(steps_of(shard, 0, 5, 1)))
        ray.get(writer.commit.remote())
    sampler = mray.RaySampler(writers, SPEC)
    with pytest.raises(mr.BadInputError, match=r"priorities must be finite .* nan at position \[1\]"):
        sampler.update_priorities([0, 1], [0, 0], [0, 0], [5.0, np.nan])
    for writer in writers:
        ray.get(writer.close.remote())
    for shard in range(2):
        with mr.open(tmp_path / f"shard-00{shard}") as store:
            np.testing.assert_allclose(store.sampler.priorities(np.arange(5), 0), 1.0)


@pytest.mark.long
def test_a_killed_actor_loses_its_uncommitted_tail_and_resumes_its_store(cluster, tmp_path):
    ray, mray = cluster
    writers = mray.start_writers(str(tmp_path), SPEC, shards=2, capacity=100, num_envs=2, commit_every=1000)
    for shard, writer in enumerate(writers):
        ray.get(writer.extend.remote(steps_of(shard, 0, 20, 2)))
        ray.get(writer.commit.remote())
        ray.get(writer.extend.remote(steps_of(shard, 20, 5, 2)))  # the uncommitted tail
    before = info_of(ray, writers[0])
    sampler = mray.RaySampler(writers, SPEC)
    sampler.sample(8)
    ray.kill(writers[0], no_restart=False)  # Ray restarts it (max_restarts=-1): it reopens its store
    batch, info = sampler.sample(64, rng=3, return_info=True)  # the learner carries on
    check_rows(batch, info)
    assert len(info.shard) == 64
    assert ray.get(writers[1].extend.remote(steps_of(1, 25, 1, 2))) == 26  # the other carries on
    after = restarted(ray, writers[0], before["pid"])
    assert after["pid"] != before["pid"] and after["total_steps"] == after["committed_steps"] == 20
    ray.get(writers[0].extend.remote(steps_of(0, 20, 10, 2)))
    ray.get(writers[0].commit.remote())
    # killed for good, then started again by hand on the same folder
    ray.kill(writers[0], no_restart=True)
    writers[0] = ray.remote(mray.ShardWriter).options(num_cpus=0).remote(str(tmp_path / "shard-000"))
    assert info_of(ray, writers[0])["total_steps"] == 30
    batch, info = mray.RaySampler(writers, SPEC).sample(500, num_steps=3, rng=0, return_info=True)
    check_rows(batch, info)
    assert set(info.shard) == {0, 1}


def test_bad_counts_are_refused_before_any_actor_starts_or_any_row_is_read(tmp_path):
    """A count below one is refused by name: no dataset that silently holds no row, no
    empty list of writers (no cluster needed: nothing is started)."""
    mray = pytest.importorskip("mmreplay.ray")
    with mr.create(tmp_path / "b", SPEC, capacity=8) as store:
        store.extend(steps_of(0, 0, 5, 1))
    for bad in (-1, 0, 2.5, True):
        with pytest.raises(ValueError, match=f"steps_per_task must be a positive int or None, got {bad!r}"):
            mray.StoreDatasource(tmp_path / "b", steps_per_task=bad)
    tasks = mray.StoreDatasource(tmp_path / "b", steps_per_task=2).get_read_tasks(1)
    assert sum(task.metadata.num_rows for task in tasks) == 5
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"shards must be an int in \\[1, 4096\\], got {bad}"):
            mray.start_writers(str(tmp_path / "w"), SPEC, shards=bad, capacity=10)
    assert not (tmp_path / "w").exists()


def test_a_leaf_named_as_a_row_index_column_does_not_replace_it(tmp_path):
    """Leaves named ``env`` or ``shard`` are read as ``leaf.env``, ``leaf.shard``: each row
    still says which env (and shard) it is (read tasks run here, without a cluster)."""
    mray = pytest.importorskip("mmreplay.ray")
    spec = {"env": mr.ArraySpec((), "int64"), "obs": {"shard": mr.ArraySpec((), "int64")}}
    path = tmp_path / "g"
    mr.create_group(path, spec, shards=2, capacity=10, num_envs=2).close()
    with mr.open_shard(path, 1) as store:
        store.extend({"env": np.full((3, 2), 7), "obs": {"shard": np.full((3, 2), 9)}})
    (task,) = mray.StoreDatasource(path).get_read_tasks(1)
    rows = next(iter(task())).to_pydict()
    assert rows["env"] == [0, 1] * 3 and rows["shard"] == [1] * 6 and rows["global_step"] == [0, 0, 1, 1, 2, 2]
    assert rows["leaf.env"] == [7] * 6 and rows["obs.shard"] == [9] * 6


@pytest.mark.long
def test_read_store_gives_a_dataset_of_rows(cluster, tmp_path):
    ray, mray = cluster
    with mr.create(tmp_path / "b", SPEC, capacity=8, num_envs=2) as store:
        store.extend(steps_of(0, 0, 11, 2))  # the ring wrapped: steps 3..10 are retained
    ds = mray.read_store(tmp_path / "b", steps_per_task=3)
    rows = ds.take_all()
    assert len(rows) == 16 and set(ds.schema().names) == {"global_step", "env", "obs", "terminated"}
    for row in rows:
        assert row["obs"].tolist() == [0, row["global_step"], row["env"]]
    assert sorted(row["global_step"] for row in rows) == sorted(list(range(3, 11)) * 2)
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=20).close()
    fill(path, [3, 4], num_envs=1)
    batch = mray.read_store(path).take_batch(100)
    assert sorted(batch["shard"].tolist()) == [0, 0, 0, 1, 1, 1, 1]
    assert (batch["obs"][:, 0] == batch["shard"]).all() and (batch["obs"][:, 1] == batch["global_step"]).all()


@pytest.mark.long
def test_each_actor_computes_the_n_step_returns_of_its_part(cluster, tmp_path):
    from test_nstep import SPEC as NSTEP_SPEC
    from test_nstep import check
    from test_nstep import steps_of as nstep_steps

    ray, mray = cluster
    writers = mray.start_writers(str(tmp_path), NSTEP_SPEC, shards=2, capacity=30, num_envs=2)
    for shard, writer in enumerate(writers):
        ray.get(writer.extend.remote(nstep_steps(0, 20 + 5 * shard, 2, np.random.default_rng(shard))))
        ray.get(writer.commit.remote())
    batch, info = mray.RaySampler(writers, NSTEP_SPEC).sample(100, rng=0, transform=mr.NStep(3, 0.9), return_info=True)
    for writer in writers:
        ray.get(writer.close.remote())
    for shard in range(2):
        mine = info.shard == shard
        with mr.open(tmp_path / f"shard-00{shard}") as store:
            check(store, {k: v[mine] for k, v in batch.items()}, info.step[mine], info.env[mine], 3, 0.9)
