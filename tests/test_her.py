"""Hindsight goal relabelling over a drawn batch, with episode bounds from the store's
episode index: on a wrapped ring, across a kill and a resume, for episodes still open."""

from __future__ import annotations

import os
import subprocess
import textwrap

import numpy as np
import pytest
from conftest import folder_digest, make_step

import mmreplay as mr

#: a goal-conditioned spec whose next achieved goal at step t of env e is [t, e]
GOAL = mr.ArraySpec((2,), "float32")
OBS = {"achieved_goal": GOAL, "desired_goal": GOAL, "observation": mr.ArraySpec((3,), "float32")}
SPEC = {
    "observation": OBS,
    "next_observation": OBS,
    "action": mr.ArraySpec((), "int64"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}
STORED_REWARD = 7.0


def compute_reward(achieved: np.ndarray, desired: np.ndarray, infos: list) -> np.ndarray:
    """A goal env's reward, vectorised: 0 where the goal is reached, -1 elsewhere."""
    assert len(infos) == len(achieved)
    return -(np.abs(achieved - desired).sum(-1) > 0).astype(np.float32)


def goal_step(t: int, num_envs: int, ends: np.ndarray) -> dict:
    """Step ``t``: the goals say which step and env they were achieved at; ``ends`` is
    0 (running), 1 (terminated) or 2 (truncated) per env."""
    envs = np.arange(num_envs, dtype=np.float32)

    def obs(s: int) -> dict:
        goal = np.stack([np.full(num_envs, s, np.float32), envs], 1)
        return {
            "achieved_goal": goal,
            "desired_goal": np.full((num_envs, 2), -1, np.float32),
            "observation": np.zeros((num_envs, 3), np.float32),
        }

    return {
        "observation": obs(t - 1),
        "next_observation": obs(t),
        "action": np.zeros(num_envs, np.int64),
        "reward": np.full(num_envs, STORED_REWARD, np.float32),
        "terminated": ends == 1,
        "truncated": ends == 2,
    }


def ends_at(t: int, num_envs: int) -> np.ndarray:
    """Env e's episodes last 3 + e steps; every other one is cut by a time limit."""
    length = 3 + np.arange(num_envs)
    done = (t + 1) % length == 0
    return np.where(done, np.where(((t + 1) // length) % 2 == 0, 2, 1), 0)


def fill(store, steps: range) -> None:
    for t in steps:
        store.add(goal_step(t, store.num_envs, ends_at(t, store.num_envs)))


def check_relabelled(store, batch, info, strategy: str) -> np.ndarray:
    """Every item is as stored or relabelled with a goal of its own env and episode that
    the strategy allows, with the reward ``compute_reward`` gives; returns the mask of
    relabelled items."""
    desired = batch["observation"]["desired_goal"]
    np.testing.assert_array_equal(batch["next_observation"]["desired_goal"], desired)
    relabelled = desired[:, 0] >= 0
    kept = ~relabelled
    np.testing.assert_array_equal(desired[kept], -1)
    np.testing.assert_array_equal(batch["reward"][kept], STORED_REWARD)
    goal_at = desired[relabelled, 0].astype(np.int64)
    step, env = info.step[relabelled], info.env[relabelled]
    np.testing.assert_array_equal(desired[relabelled, 1], env)
    first, last, _ = store.episode_bounds(step, env)
    low = {"future": step, "final": last, "episode": first}[strategy]
    assert (goal_at >= low).all() and (goal_at <= last).all()
    assert (goal_at >= store.first_step).all()
    np.testing.assert_array_equal(batch["reward"][relabelled], np.where(goal_at == step, 0.0, -1.0))
    return relabelled


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
def test_relabelled_goals_come_from_the_same_episode_by_the_strategy(tmp_path, strategy):
    with mr.create(tmp_path / "b", SPEC, capacity=200, num_envs=3) as store:
        fill(store, range(120))
        batch, info = store.sample(
            2000, rng=0, return_info=True, transform=mr.Hindsight(compute_reward, strategy, fraction=0.5)
        )
        relabelled = check_relabelled(store, batch, info, strategy)
        assert 0.4 < relabelled.mean() < 0.6
        # what was drawn is what a sample without the transform draws
        plain, plain_info = store.sample(2000, rng=0, return_info=True)
        np.testing.assert_array_equal(plain_info.step, info.step)
        np.testing.assert_array_equal(plain["action"], batch["action"])


def test_a_prioritized_store_relabels_the_rows_its_sampler_draws(tmp_path):
    with mr.create(tmp_path / "b", SPEC, capacity=60, num_envs=2, sampler="prioritized", alpha=1.0) as store:
        fill(store, range(40))
        batch, info = store.sample(
            500, rng=8, return_info=True, transform=mr.Hindsight(compute_reward, "future", 1.0)
        )
        assert info.weight is not None
        check_relabelled(store, batch, info, "future")


def test_the_fraction_relabels_none_or_every_transition(tmp_path):
    with mr.create(tmp_path / "b", SPEC, capacity=50, num_envs=2) as store:
        fill(store, range(30))
        none = store.sample(100, rng=1, transform=mr.Hindsight(compute_reward, fraction=0.0))
        every = store.sample(100, rng=1, transform=mr.Hindsight(compute_reward, fraction=1.0))
    assert (none["observation"]["desired_goal"] == -1).all() and (none["reward"] == STORED_REWARD).all()
    assert (every["observation"]["desired_goal"] >= 0).all() and (every["reward"] <= 0).all()


def test_a_wrapped_ring_relabels_from_retained_steps_of_the_same_episode(tmp_path):
    with mr.create(tmp_path / "b", SPEC, capacity=23, num_envs=3, commit_every=4) as store:
        fill(store, range(100))  # wrapped four times; the oldest episodes lost their start
        assert store.first_step > 70
        for strategy in ("future", "final", "episode"):
            batch, info = store.sample(
                3000, rng=2, return_info=True, transform=mr.Hindsight(compute_reward, strategy, 1.0)
            )
            check_relabelled(store, batch, info, strategy)
        # "episode" goals of an episode the ring cut come from its first retained step on
        goals = batch["observation"]["desired_goal"][:, 0]
        first, _, complete = store.episode_bounds(info.step, info.env)
        cut = ~complete & (first == store.first_step)
        assert cut.any() and (goals[cut] >= store.first_step).all()


def test_an_open_episode_relabels_with_the_goals_it_has_reached_so_far(tmp_path):
    with mr.create(tmp_path / "b", SPEC, capacity=40, num_envs=1) as store:
        fill(store, range(3))  # one episode of 3 steps (truncated), then one still running
        store.add(goal_step(3, 1, np.zeros(1)))
        store.add(goal_step(4, 1, np.zeros(1)))
        batch, info = store.sample(
            200, rng=3, return_info=True, transform=mr.Hindsight(compute_reward, "final", 1.0)
        )
        goals = batch["observation"]["desired_goal"][:, 0]
        np.testing.assert_array_equal(goals, np.where(info.step < 3, 2, 4))  # the open one's newest step
        assert store.episode_bounds(info.step, info.env)[2].tolist() == (info.step < 3).tolist()


def test_a_reader_relabels_what_the_writer_committed(tmp_path):
    with mr.create(tmp_path / "b", SPEC, capacity=30, num_envs=2, commit_every=1) as store:
        fill(store, range(20))
        reader = mr.open(tmp_path / "b")
        fill(store, range(20, 45))  # the writer moves on and wraps; the reader refreshes
        reader.refresh()
        batch, info = reader.sample(
            500, rng=4, return_info=True, transform=mr.Hindsight(compute_reward, "episode", 1.0)
        )
        check_relabelled(reader, batch, info, "episode")
        reader.close()


def test_a_group_relabels_in_each_shard(tmp_path):
    group = mr.create_group(tmp_path / "g", SPEC, shards=2, capacity=40, num_envs=2)
    for i in range(2):
        with mr.open_shard(tmp_path / "g", i) as shard:
            fill(shard, range(25 + i))
    group.refresh()
    batch, info = group.sample(
        300, rng=5, return_info=True, transform=mr.Hindsight(compute_reward, "future", 1.0)
    )
    assert set(info.shard.tolist()) == {0, 1}
    assert (batch["observation"]["desired_goal"][:, 1] == info.env).all()
    assert (batch["observation"]["desired_goal"][:, 0] >= info.step).all()
    group.close()


WRITER = textwrap.dedent(
    """
    import sys, numpy as np, mmreplay as mr
    sys.path.insert(0, {tests!r})
    from test_her import SPEC, goal_step, ends_at
    store = mr.create({path!r}, SPEC, capacity=500, num_envs=2, commit_every=1)
    for t in range(40):
        ends = ends_at(t, 2)
        if t >= 30:
            ends[:] = 0  # both envs mid-episode when killed
        store.add(goal_step(t, 2, ends))
    print("written", flush=True)
    sys.stdin.readline()
    """
)


def test_after_a_kill_and_a_resume_goals_stay_in_the_episode_the_killed_writer_left(tmp_path, writers):
    path = str(tmp_path / "b")
    proc = writers.start(WRITER.format(tests=os.path.dirname(__file__), path=path), stdin=subprocess.PIPE)
    writers.kill_when(proc, lambda line: line.strip() == "written")
    with mr.open(path, "a") as store:
        assert store.total_steps == 40
        fill(store, range(40, 60))  # the resumed writer's own episodes; the killed ones end at step 39
        spans = {(s.env, s.first_step): s for s in store.episode_index()}
        assert all(spans[(e, 30 - 30 % (3 + e))].last_step == 39 for e in (0, 1))
        batch, info = store.sample(
            3000, rng=6, return_info=True, transform=mr.Hindsight(compute_reward, "future", 1.0)
        )
        check_relabelled(store, batch, info, "future")
        goals = batch["observation"]["desired_goal"][:, 0]
        before = info.step < 40
        assert (goals[before] < 40).all() and (goals[~before] >= 40).all()


def test_bad_input_is_refused_with_one_clear_error_and_nothing_written(tmp_path):
    with pytest.raises(mr.BadInputError, match="compute_reward"):
        mr.Hindsight(object())
    with pytest.raises(mr.BadInputError, match="one of future, final, episode; got 'next'"):
        mr.Hindsight(compute_reward, "next")
    with pytest.raises(mr.BadInputError, match=r"in \[0, 1\]; got 1.5"):
        mr.Hindsight(compute_reward, fraction=1.5)
    no_goal = {**SPEC, "next_observation": {"observation": mr.ArraySpec((3,), "float32")}}
    with mr.create(tmp_path / "b", no_goal, capacity=10) as store:
        for t in range(3):
            store.add(make_step(no_goal, 1, t))
        store.commit()
        before = folder_digest(tmp_path / "b")
        with pytest.raises(
            mr.BadInputError,
            match="the spec has no 'next_observation/desired_goal', 'next_observation/achieved_goal'",
        ):
            store.sample(4, transform=mr.Hindsight(compute_reward))
        assert folder_digest(tmp_path / "b") == before
    with mr.create(tmp_path / "c", SPEC, capacity=10) as store:
        fill(store, range(5))
        with pytest.raises(mr.BadInputError, match="relabels transitions"):
            store.sample(4, num_steps=2, transform=mr.Hindsight(compute_reward))
    # an int desired goal beside a float achieved one: relabelled goals would be truncated
    int_goal = {**OBS, "desired_goal": mr.ArraySpec((2,), "int64")}
    mixed = {**SPEC, "observation": int_goal, "next_observation": int_goal}
    with mr.create(tmp_path / "d", mixed, capacity=10) as store:
        for t in range(3):
            store.add(make_step(mixed, 1, t))
        store.commit()
        with pytest.raises(mr.BadInputError, match=r"'next_observation/achieved_goal' \(float32\) into .* \(int64\)"):
            store.sample(4, transform=mr.Hindsight(compute_reward))


def test_a_reward_function_that_is_not_vectorised_or_does_not_fit_the_reward_leaf_is_refused(tmp_path):
    """compute_reward returning one number for a batch (a per-transition function), or
    rewards the reward leaf cannot hold (-1 into uint8), is refused: it used to be a bare
    numpy reshape error, or the -1 stored as 255."""

    def not_vectorised(achieved, desired, infos):
        return -float(np.abs(achieved - desired).sum() > 0)

    with mr.create(tmp_path / "b", SPEC, capacity=20) as store:
        fill(store, range(10))
        with pytest.raises(mr.BadInputError, match=r"returned float64 \(\); .* one number per transition, \(8,\)"):
            store.sample(8, rng=0, transform=mr.Hindsight(not_vectorised, fraction=1.0))
    small = {**SPEC, "reward": mr.ArraySpec((), "uint8")}
    with mr.create(tmp_path / "c", small, capacity=20) as store:
        for t in range(10):
            step = goal_step(t, 1, ends_at(t, 1))
            store.add({**step, "reward": step["reward"].astype(np.uint8)})
        with pytest.raises(mr.BadInputError, match=r"that the 'reward' leaf \(uint8\) holds"):
            store.sample(8, rng=0, transform=mr.Hindsight(compute_reward, fraction=1.0))
        batch = store.sample(8, rng=0, transform=mr.Hindsight(lambda a, d, i: (a == d).all(-1), fraction=1.0))
        assert set(np.unique(batch["reward"])) <= {0, 1}
