"""Groups of stores: one writer per shard (actor processes), one learner sampling them all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import folder_digest, one_line_error, run_cli

import mmreplay as mr
from mmreplay.group import GROUP_FILE

SPEC = {"obs": mr.ArraySpec((3,), "int64"), "terminated": mr.ArraySpec((), "bool")}


def steps_of(shard: int, first: int, count: int, num_envs: int) -> dict:
    """Steps whose obs row is ``(shard, global step, env)``: every row says where it lives."""
    g = np.arange(first, first + count)[:, None, None]
    env = np.arange(num_envs)[None, :, None]
    obs = np.concatenate(np.broadcast_arrays(np.full_like(g, shard), g, env), axis=-1)
    return {"obs": obs.astype(np.int64), "terminated": (g[..., 0] % 7 == 6) & (env[..., 0] >= 0)}


def fill(path, sizes: list[int], num_envs: int) -> None:
    for shard, n in enumerate(sizes):
        with mr.open_shard(path, shard) as store:
            store.extend(steps_of(shard, store.total_steps, n, num_envs))


def check_rows(batch: dict, info: mr.GroupSampleInfo) -> None:
    obs = batch["obs"]
    if obs.ndim == 3:  # sequences: the first step is what the info names
        obs = obs[:, 0]
    assert (
        (obs[:, 0] == info.shard).all() and (obs[:, 1] == info.step).all() and (obs[:, 2] == info.env).all()
    )


def test_a_group_is_a_folder_of_ordinary_stores(tmp_path):
    path = tmp_path / "g"
    with mr.create_group(path, SPEC, shards=3, capacity=20, num_envs=2) as group:
        assert group.num_shards == 3 and len(group) == 0 and group.mode == "r"
    assert json.loads((path / GROUP_FILE).read_text())["shards"] == ["shard-000", "shard-001", "shard-002"]
    fill(path, [4, 0, 5], num_envs=2)
    with mr.open(path / "shard-002") as store:  # a shard alone is a store
        assert len(store) == 5 and store.get(-1)["obs"][1].tolist() == [2, 4, 1]
    with mr.open_group(path) as group:
        assert [len(s) for s in group.shards] == [4, 0, 5] and len(group) == 9
        assert "shards=3 steps=[4, 0, 5]" in repr(group)
    assert "closed" in repr(group)
    with pytest.raises(mr.ClosedError, match="group is closed"):
        group.sample(1)
    group.close()  # safe twice


def test_create_and_open_refuse_what_is_not_a_group(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=10).close()
    with pytest.raises(mr.BufferExistsError, match="exist_ok"):
        mr.create_group(path, SPEC, shards=2, capacity=10)
    mr.create_group(path, SPEC, shards=2, capacity=10, exist_ok=True).close()
    before = folder_digest(path)
    for kwargs, match in [
        ({"shards": 3}, "shards: existing 2 vs new 3"),
        ({"capacity": 11}, "shard-000 capacity: existing 10 vs new 11"),
        ({"spec": {"other": mr.ArraySpec(())}}, "spec: existing"),
        ({"sampler": "prioritized"}, "sampler: existing {'name': 'uniform'} vs new {'name': 'prioritized'"),
    ]:
        with pytest.raises(mr.SpecMismatchError, match=match):
            mr.create_group(path, **{"spec": SPEC, "shards": 2, "capacity": 10, **kwargs}, exist_ok=True)
    assert folder_digest(path) == before
    # a shard made apart with another capacity: the group asked for is not the one there
    shutil.rmtree(path / "shard-001")
    mr.create(path / "shard-001", SPEC, 50).close()
    with pytest.raises(mr.SpecMismatchError, match="shard-001 capacity: existing 50 vs new 10"):
        mr.create_group(path, SPEC, shards=2, capacity=10, exist_ok=True)
    with pytest.raises(IndexError, match=r"shard must be an int in \[0, 2\), got 2"):
        mr.open_shard(path, 2)
    with pytest.raises(mr.NotABufferError, match=GROUP_FILE):
        mr.open_group(tmp_path)
    with pytest.raises(ValueError, match="shards must be"):
        mr.create_group(tmp_path / "h", SPEC, shards=0, capacity=10)
    with pytest.raises(mr.SpecError):  # a bad spec leaves nothing behind
        mr.create_group(tmp_path / "h", SPEC, shards=2, capacity=0)
    assert not (tmp_path / "h").exists()
    (path / GROUP_FILE).write_text('{"format": "mmreplay-group/1", "shards": ["../x"]}')
    with pytest.raises(mr.CorruptBufferError, match="shard-000"):
        mr.open_group(path)


def test_shards_that_differ_are_refused(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=10).close()
    import shutil

    shutil.rmtree(path / "shard-001")
    mr.create(path / "shard-001", {"obs": mr.ArraySpec((4,), "int64")}, 10).close()
    with pytest.raises(mr.SpecMismatchError, match="shard-001 differs from shard-000"):
        mr.open_group(path)
    # the same spec, but another leaf is its reward: exports would take shard 0's leaf
    spec = {**SPEC, "r1": mr.ArraySpec(()), "r2": mr.ArraySpec(())}
    for index, reward in enumerate(("r1", "r2")):
        shutil.rmtree(path / f"shard-00{index}")
        mr.create(path / f"shard-00{index}", spec, 10, roles={"reward": reward}).close()
    with pytest.raises(mr.SpecMismatchError, match=r"shard-001 differs .*roles: .*'r1'.* vs .*: 'r2'"):
        mr.open_group(path)
    out = run_cli("verify", str(path))
    assert out.returncode == 1 and "its shards are not alike" in out.stdout, out.stdout + out.stderr


CREATOR = textwrap.dedent(
    """
    import os, sys, time
    import mmreplay as mr
    sys.path.insert(0, {tests!r})
    from test_group import SPEC
    while not os.path.exists(sys.argv[2]):  # the start line: every process is ready to create
        time.sleep(0.001)
    with mr.create_group(sys.argv[1], SPEC, shards=4, capacity=50, num_envs=2, exist_ok=True) as group:
        print(len(group.shards))
    """
).format(tests=os.path.dirname(__file__))


def test_processes_creating_the_same_group_at_once_all_open_it(tmp_path):
    """Every actor and the learner may call create_group(exist_ok=True) as they start: one
    makes the group, the others open it; none removes what another made."""
    for attempt in range(2):
        path, go = tmp_path / f"g{attempt}", tmp_path / f"go{attempt}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", CREATOR, str(path), str(go)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(4)
        ]
        go.touch()
        outs = [proc.communicate(timeout=300) for proc in procs]
        assert [(proc.returncode, out) for proc, (out, _) in zip(procs, outs)] == [(0, "4\n")] * 4, outs
        assert run_cli("verify", str(path)).returncode == 0
        made = sorted(f"{kind}{i}" for i in range(attempt + 1) for kind in ("g", "go"))
        assert sorted(os.listdir(tmp_path)) == made  # no scratch folder left behind


def test_batches_are_split_in_proportion_to_retained_rows(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=3, capacity=40, num_envs=2).close()
    fill(path, [10, 0, 30], num_envs=2)
    with mr.open_group(path) as group:
        batch, info = group.sample(4000, rng=0, return_info=True)
        check_rows(batch, info)
        counts = np.bincount(info.shard, minlength=3)
        assert counts[1] == 0 and abs(counts[0] / 4000 - 0.25) < 0.03, counts
        np.testing.assert_allclose(info.probability, 1 / 80)  # every row of the group alike
        assert info.weight is None
        # sequences never cross a shard's edge, and the split counts valid starts
        batch, info = group.sample(64, num_steps=5, rng=1, return_info=True)
        check_rows(batch, info)
        assert (np.diff(batch["obs"][..., 1], axis=1) == 1).all()
        np.testing.assert_allclose(info.probability, 1 / ((10 - 4 + 30 - 4) * 2))
        # without replacement: distinct items, at most all of them
        batch, info = group.sample(100, replacement=False, rng=2, return_info=True)
        assert len(info.step) == 80 and len(set(zip(info.shard, info.step, info.env))) == 80


@pytest.mark.parametrize("keyword", [{"window": (0, 5)}, {"out": {}}, {"layout": "NCHW"}])
def test_a_group_refuses_what_only_one_store_can_take(tmp_path, keyword):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=40, num_envs=1).close()
    fill(path, [10, 10], num_envs=1)
    with mr.open_group(path) as group:
        with pytest.raises(TypeError, match=f"Group.sample takes no {next(iter(keyword))!r}"):
            group.sample(4, **keyword)
        assert group.sample(4, rng=0, within_episodes=True)["obs"].shape == (4, 3)  # its own keywords pass


def test_the_learner_sees_each_shards_committed_prefix(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=50, commit_every=1000).close()
    with mr.open_group(path) as group, mr.open_shard(path, 0) as actor:
        actor.extend(steps_of(0, 0, 6, 1))
        group.refresh()
        with pytest.raises(mr.NotEnoughDataError, match="no shard holds a committed step"):
            group.sample(4)
        actor.commit()
        actor.extend(steps_of(0, 6, 3, 1))  # not committed: never sampled
        assert group.refresh() and len(group) == 6
        batch, info = group.sample(500, rng=0, return_info=True)
        assert set(info.shard) == {0} and info.step.max() == 5
        check_rows(batch, info)


def test_prioritized_groups_split_by_priority_mass_and_route_updates_back(tmp_path):
    path = tmp_path / "g"
    mr.create_group(
        path, SPEC, shards=2, capacity=30, sampler="prioritized", alpha=1.0, beta=0.5, eps=0.0
    ).close()
    fill(path, [10, 10], num_envs=1)
    with mr.open_group(path) as group:
        batch, info = group.sample(8, rng=0, return_info=True)
        np.testing.assert_allclose(info.weight, 1.0)
        # shard 1's rows get priority 9: its mass is 90 against shard 0's 10
        assert (
            group.update_priorities(np.ones(10, int), np.arange(10), np.zeros(10, int), np.full(10, 9.0))
            == 10
        )
        np.testing.assert_allclose(group.shards[1].sampler.priorities(np.arange(10), 0), 9.0)
        np.testing.assert_allclose(group.shards[0].sampler.priorities(np.arange(10), 0), 1.0)
        batch, info = group.sample(4000, rng=1, return_info=True)
        check_rows(batch, info)
        assert abs(np.mean(info.shard == 1) - 0.9) < 0.02
        np.testing.assert_allclose(info.probability, np.where(info.shard == 1, 9 / 100, 1 / 100), rtol=1e-6)
        # weights over the whole group: (N P)^-beta / max, the smallest priority at 1
        np.testing.assert_allclose(info.weight, np.where(info.shard == 1, 9**-0.5, 1.0), rtol=1e-5)
        # the sample's info routes each update to its shard
        _, pick = np.unique(info.shard * 1000 + info.step, return_index=True)
        pick = pick[:3]
        group.update_priorities(info.shard[pick], info.step[pick], info.env[pick], [2.0, 3.0, 4.0])
        for s, g, p in zip(info.shard[pick], info.step[pick], [2.0, 3.0, 4.0]):
            assert group.shards[s].sampler.priorities([g], 0)[0] == p
    with mr.open_shard(path, 1, mode="r") as store:  # on disk, where a fresh process reads it
        assert (store.sampler.priorities(np.arange(10), 0) > 1.0).all()


def test_bad_priority_updates_change_nothing(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=10, sampler="prioritized").close()
    fill(path, [3, 3], num_envs=1)
    with mr.open_group(path) as group:
        with pytest.raises(mr.BadInputError, match="out of range for 2 shards"):
            group.update_priorities([0, 2], [0, 0], [0, 0], [1.0, 1.0])
        with pytest.raises(mr.BadInputError, match="expected 2 priorities"):
            group.update_priorities([0, 1], [0, 0], [0, 0], [1.0])
        with pytest.raises(mr.BadInputError, match="shard must be an integer array"):
            group.update_priorities([0.5], [0], [0], [1.0])
        with pytest.raises(mr.BadInputError, match=r"shard, step and env .* \(2,\), \(3,\) and \(2,\)"):
            group.update_priorities([0, 1], [0, 1, 2], [0, 0], [1.0, 1.0])
        assert group.update_priorities([], [], [], []) == 0  # no items (as a store takes them)
        # shard 1 refuses its part (NaN, a step not committed, an env out of range):
        # shard 0's sound part is not applied either
        for step, env, p, refusal in (
            ([0, 0], [0, 0], [5.0, np.nan], r"g: priorities must be finite .* nan at position \[1\]"),
            ([0, 0], [0, 0], [5.0, 1e39], "shard-001: priorities must be finite .*at most"),
            ([0, 9], [0, 0], [5.0, 1.0], "shard-001: step 9 is not committed yet"),
            ([0, 0], [0, 3], [5.0, 1.0], "shard-001: env index out of range"),
        ):
            with pytest.raises(mr.BadInputError, match=refusal):
                group.update_priorities([0, 1], step, env, p)
        for store in group.shards:
            np.testing.assert_allclose(store.sampler.priorities(np.arange(3), 0), 1.0)
    with mr.open_group(path, "a") as group:  # the writers check the same way
        with pytest.raises(mr.BadInputError, match="shard-001: step 3 is not committed yet"):
            group.update_priorities([0, 1], [0, 3], [0, 0], [5.0, 1.0])
        np.testing.assert_allclose(group.shards[0].sampler.priorities(np.arange(3), 0), 1.0)


def test_passes_over_a_group(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=20, num_envs=2).close()
    fill(path, [7, 3], num_envs=2)
    with mr.open_group(path) as group:
        rows = np.concatenate([b["obs"] for b in group.iterate(batch_size=4)])
        assert sorted(map(tuple, rows[:, :3].tolist())) == sorted(
            (s, g, e) for s, n in ((0, 7), (1, 3)) for g in range(n) for e in range(2)
        )
        episodes = list(group.episodes())
        assert {shard for shard, _ in episodes} == {0, 1}
        assert all((ep.data["obs"][:, 0] == shard).all() for shard, ep in episodes)
        arrays = group.to_arrays()
        assert (arrays["observations"][:, 0] == arrays["shard"]).all()


ACTOR = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import mmreplay as mr
    sys.path.insert(0, {tests!r})
    from test_group import steps_of
    path, shard = sys.argv[1], int(sys.argv[2])
    with mr.open_shard(path, shard) as store:
        print(store.total_steps, flush=True)
        while True:
            store.extend(steps_of(shard, store.total_steps, 1, 2))
            time.sleep(0.002)
    """
).format(tests=os.path.dirname(__file__))


def start_actor(writers, path, shard: int) -> tuple[subprocess.Popen, int]:
    proc = writers.start(ACTOR, path, shard)
    return proc, int(proc.stdout.readline())


def wait_for(group: mr.Group, shard: int, steps: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while group.shards[shard].committed_steps < steps:
        assert time.monotonic() < deadline, f"shard {shard} stuck at {group.shards[shard].committed_steps}"
        time.sleep(0.02)
        group.refresh()


def test_an_actor_killed_loses_only_its_uncommitted_tail_and_resumes_its_shard(tmp_path, writers):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=1000, num_envs=2, commit_every=10).close()
    actors = [start_actor(writers, path, shard)[0] for shard in range(2)]
    with mr.open_group(path) as group:
        wait_for(group, 0, 40)
        wait_for(group, 1, 40)
        writers.kill(actors[0])
        group.refresh()
        committed = group.shards[0].committed_steps
        seen = group.shards[1].committed_steps
        wait_for(group, 1, seen + 40)  # the other actor carries on
        assert group.shards[0].committed_steps == committed
        batch, info = group.sample(512, num_steps=4, rng=0, return_info=True)
        check_rows(batch, info)
        assert set(info.shard) == {0, 1}
        actors[0], resumed_at = start_actor(writers, path, 0)
        assert resumed_at == committed  # the shard resumes after its committed steps
        wait_for(group, 0, committed + 30)
        writers.kill(actors[0])  # and again: every committed row is whole
        group.refresh()
        shard = group.shards[0]
        rows = np.concatenate([b["obs"] for b in shard.iterate(batch_size=64)])
        expected = [(g, e) for g in range(shard.first_step, shard.committed_steps) for e in range(2)]
        assert sorted(map(tuple, rows[:, 1:].tolist())) == expected
        check_rows(*group.sample(256, rng=1, return_info=True))


def test_slice_groups_split_by_the_starts_inside_episodes(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=40, sampler="slices", num_steps=3).close()
    fill(path, [20, 9], num_envs=1)  # episodes end at steps 6, 13: 5 + 5 + 4 starts, and 5 + 0 + 0
    with mr.open_group(path) as group:
        assert [m.total for m in group.masses()] == [14.0, 5.0]
        batch, info = group.sample(400, rng=0, return_info=True)
        check_rows(batch, info)
        assert not batch["terminated"][:, :-1].any()  # no sequence crosses an episode's end
        np.testing.assert_allclose(info.probability, 1 / 19)


def test_a_shard_folder_that_is_a_link_is_refused_by_every_reader(tmp_path):
    """A group's shards are its own folders: one that is a link elsewhere is refused when
    the group or the shard is opened and by the CLI, as verify refuses it."""
    mr.create_group(tmp_path / "other", SPEC, shards=2, capacity=10).close()
    fill(tmp_path / "other", [3, 4], num_envs=1)
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=10).close()
    shutil.rmtree(path / "shard-001")
    os.symlink(tmp_path / "other" / "shard-001", path / "shard-001")
    for mode in ("r", "a"):
        with pytest.raises(mr.CorruptBufferError, match="shard-001: is a symbolic link"):
            mr.open_group(path, mode)
        with pytest.raises(mr.CorruptBufferError, match="shard-001: is a symbolic link"):
            mr.open_shard(path, 1, mode)
    with mr.open_shard(path, 0) as store:  # the others open
        assert len(store) == 0
    for args in (["inspect", path], ["stats", path], ["export", path, tmp_path / "out.npz"], ["verify", path]):
        one_line_error(run_cli(*args), 4, "shard-001: is a symbolic link")
    assert not (tmp_path / "out.npz").exists()


def test_shards_written_apart_become_a_group(tmp_path):
    from mmreplay.group import write_manifest

    for shard in range(2):  # as actors on two nodes would, then copied into one folder
        with mr.create(tmp_path / "g" / f"shard-00{shard}", SPEC, capacity=10) as store:
            store.extend(steps_of(shard, 0, 3 + shard, 1))
    with pytest.raises(mr.NotABufferError, match="no shard folder shard-002"):
        write_manifest(tmp_path / "g", 3)
    # a shard copied in half (no metadata yet), or of another spec: no manifest is written
    (tmp_path / "g" / "shard-002").mkdir()
    with pytest.raises(mr.NotABufferError, match="shard-002"):
        write_manifest(tmp_path / "g", 3)
    mr.create(tmp_path / "g" / "shard-003", {"obs": mr.ArraySpec((4,), "int64")}, capacity=10).close()
    shutil.rmtree(tmp_path / "g" / "shard-002")
    os.rename(tmp_path / "g" / "shard-003", tmp_path / "g" / "shard-002")
    with pytest.raises(mr.SpecMismatchError, match="shard shard-002 differs from shard-000"):
        write_manifest(tmp_path / "g", 3)
    assert not (tmp_path / "g" / GROUP_FILE).exists()
    write_manifest(tmp_path / "g", 2)
    with mr.open_group(tmp_path / "g") as group:
        assert [len(s) for s in group.shards] == [3, 4]
        check_rows(*group.sample(16, rng=0, return_info=True))


def test_a_group_exports_as_one_dataset_shard_after_shard(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=3, capacity=30, num_envs=2).close()
    fill(path, [12, 0, 40], num_envs=2)  # shard 2's ring wrapped: its steps 10..39 are retained
    with mr.open_group(path) as group:
        result = group.export(tmp_path / "all.npz", format="npz")
        episodes = sum(1 for _ in group.episodes())
        parquet = mr.export(group, tmp_path / "pq", format="parquet")
    assert result.steps == (12 + 30) * 2
    with np.load(tmp_path / "all.npz") as f:
        obs = f["obs"]
        meta = json.loads(bytes(f["__mmreplay__"]))
    assert obs.shape == (42, 2, 3)
    np.testing.assert_array_equal(obs[:, :, 0], [[0, 0]] * 12 + [[2, 2]] * 30)  # shard after shard
    np.testing.assert_array_equal(obs[:, 0, 1], list(range(12)) + list(range(10, 40)))
    assert [(s["shard"], s["first_step"], s["steps"], s["source_first_step"]) for s in meta["shards"]] == [
        (0, 0, 12, 0),
        (1, 12, 0, 0),
        (2, 12, 30, 10),
    ]
    # episode formats: every shard's episodes, none joined across a shard's end
    assert parquet.episodes == episodes
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "pq").to_pydict()
    obs = np.array(table["observation"])
    ids = np.array(table["episode_index"])
    assert len(np.unique(ids)) == episodes
    for episode in np.unique(ids):
        assert len(set(obs[ids == episode, 0])) == 1  # one shard per episode


@pytest.mark.parametrize("fmt", ["npz", "hdf5", "zarr"])
def test_a_group_export_imports_back_with_no_episode_running_from_one_shard_into_the_next(tmp_path, fmt):
    spec = {**SPEC, "truncated": mr.ArraySpec((), "bool")}
    path = tmp_path / "g"
    mr.create_group(path, spec, shards=3, capacity=30, num_envs=2).close()
    for shard, n in enumerate([12, 0, 40]):  # shard 0 ends mid-episode (steps 7..11)
        with mr.open_shard(path, shard) as store:
            store.extend({**steps_of(shard, store.total_steps, n, 2), "truncated": np.zeros((n, 2), bool)})
    out = tmp_path / f"all.{fmt}"
    with mr.open_group(path) as group:
        group.export(out, format=fmt)
        want = [(e.env, e.first_step, e.last_step) for e in group.joined().episodes()]
    mr.import_dataset(out, tmp_path / "back")
    with mr.open(tmp_path / "back") as back:
        got = sorted((e.env, e.first_step, e.last_step) for e in back.episodes())
        obs = back.get(slice(None))["obs"]
    assert got == sorted(want)
    assert (0, 7, 11) in got  # shard 0's open episode ends with its shard, now truncated
    np.testing.assert_array_equal(obs[:, 0, 0], [0] * 12 + [2] * 30)


def test_the_cli_inspects_verifies_summarises_and_exports_a_group(tmp_path):
    pytest.importorskip("zarr")
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=20, backend="zarr").close()
    fill(path, [5, 8], num_envs=1)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "mmreplay.cli", *args], capture_output=True, text=True, timeout=300
        )

    out = cli("inspect", "--json", str(path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["num_shards"] == 2 and doc["steps"] == 13 and len(doc["shards"]) == 2
    out = cli("stats", "--json", str(path))
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["shards"] == 2 and stats["steps"] == 13 and stats["leaves"]["obs"]["max"] == 7
    out = cli("export", "-q", "-f", "npz", str(path), str(tmp_path / "g.npz"))
    assert out.returncode == 0, out.stderr
    with np.load(tmp_path / "g.npz") as f:
        np.testing.assert_array_equal(f["obs"][:, 0, 0], [0] * 5 + [1] * 8)
    out = cli("verify", str(path))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok (2 shards)"), out.stdout + out.stderr
    # a damaged shard: its verdict names it, the group's says how many, exit status 1
    victim = path / "shard-001" / "data.zarr" / "obs" / "c" / "0" / "0" / "0"  # the mapped leaf's shard
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    out = cli("verify", str(path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "problem: shard-001:" in out.stdout and f"{path / 'shard-000'}: ok" in out.stdout
    assert "1 of 2 shards have problems" in out.stdout


def test_verify_fails_a_group_whose_shards_differ_or_are_missing(tmp_path):
    """Each shard is a sound store, but open_group refuses them together: verify says so;
    a missing shard is not sent to recover."""
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=20).close()
    shutil.rmtree(path / "shard-001")
    mr.create(path / "shard-001", {"obs": mr.ArraySpec((4,), "int64")}, 20).close()
    out = run_cli("verify", str(path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "shard shard-001 differs from shard-000" in out.stdout and "ok (2 shards)" not in out.stdout
    shutil.rmtree(path / "shard-001")  # a missing shard: recover cannot bring it back, so it is not offered
    out = run_cli("verify", str(path))
    assert out.returncode == 1 and "shard-001: 1 problem(s); its folder is missing" in out.stdout, out.stdout
    assert "recover" not in out.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["sample", "{g}"],
        ["recover", "{g}"],
        ["convert", "{g}", "{out}"],
        ["plot", "{g}", "-o", "{out}.png"],
        ["view", "{g}", "-o", "{out}.gif"],
        ["push", "{g}", "s3://bucket/run"],
    ],
    ids=lambda args: args[0],
)
def test_a_command_that_takes_one_store_names_a_groups_folder_as_such(tmp_path, args):
    """A group's folder where one store is expected: one line that says it is a group and
    what takes it, not that no buffer is there; nothing is written."""
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=20).close()
    before = sorted(os.listdir(tmp_path))
    out = run_cli(*(a.format(g=path, out=tmp_path / "out") for a in args))
    one_line_error(out, 3, f"{path}: a group of stores", "mmreplay.open_group", str(path / "shard-000"), "inspect")
    assert sorted(os.listdir(tmp_path)) == before


def test_open_names_a_groups_folder_as_such(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=20).close()
    for mode in ("r", "a"):
        with pytest.raises(mr.NotABufferError, match="a group of stores .* mmreplay.open_group"):
            mr.open(path, mode)
    with mr.open(path / "shard-000") as store:  # what the message names opens
        assert len(store) == 0


def test_minari_export_of_a_group_never_ends_an_episode_with_the_next_shards_row(tmp_path, monkeypatch):
    minari = pytest.importorskip("minari")
    from test_export import TF_AGENTS_SPEC as spec

    path = tmp_path / "g"
    mr.create_group(path, spec, shards=2, capacity=20, num_envs=1).close()
    # shard 0: an episode still open at its end; shard 1 starts with a boundary row (LAST)
    for shard, st, nst in ((0, [0, 1, 1], [1, 1, 1]), (1, [2, 0, 1, 1, 2], [0, 1, 1, 2, 0])):
        t = len(st)
        with mr.open_shard(path, shard) as store:
            store.extend(
                {
                    "step_type": np.array(st, np.int32)[:, None],
                    "observation": np.full((t, 1, 3), 100 * shard, np.float32) + np.arange(t)[:, None, None],
                    "action": np.arange(t)[:, None] + 100 * shard,
                    "next_step_type": np.array(nst, np.int32)[:, None],
                    "reward": np.ones((t, 1), np.float32),
                    "discount": np.where(np.array(nst)[:, None] == 2, 0, 1).astype(np.float32),
                }
            )
    from mmreplay.formats import export

    with mr.open_group(path) as group:
        export(group, tmp_path / "m", "minari", dataset_id="group-v0")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "m"))
    first = next(iter(minari.load_dataset("group-v0").iterate_episodes()))
    # shard 0's open episode has no final observation: its last step is left out, it ends truncated
    assert first.observations[:, 0].tolist() == [0, 1, 2] and first.actions.tolist() == [0, 1]
    assert first.truncations.tolist() == [False, True] and not first.terminations.any()
