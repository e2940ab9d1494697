"""A writer that resumes a store ends the episodes the last one left open: the store's
rule (after a kill or a clean close, on every layout, crash-safe), and every layer that
resumes a folder gets it through the store. ``Store.end_episodes`` is the same rule on
demand, for a reset or a restart mid-episode."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import folder_digest, verify_cli

import mmreplay as mr

HERE = os.path.dirname(os.path.abspath(__file__))

SPEC = {
    "obs": mr.ArraySpec((2,), "float32"),
    "action": mr.ArraySpec((), "int64"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}


def steps(t0: int, n: int, terminated: dict | None = None) -> dict:
    """``n`` steps of two envs from global id ``t0``; ``terminated`` maps a step to the envs it ends."""
    t = np.arange(t0, t0 + n)[:, None] + np.zeros((1, 2), int)
    ends = np.zeros((n, 2), bool)
    for step, envs in (terminated or {}).items():
        ends[step - t0, envs] = True
    return {
        "obs": np.stack([t, t + 0.5], -1).astype("float32"),
        "action": t.astype("int64"),
        "reward": np.ones((n, 2), "float32"),
        "terminated": ends,
        "truncated": np.zeros((n, 2), bool),
    }


def spans(store) -> list[tuple]:
    return [(s.env, s.first_step, s.last_step, s.status) for s in store.episode_index()]


WRITER = """
import os, signal, sys
sys.path.insert(0, {here!r})
import mmreplay as mr
from test_resume_episodes import SPEC, steps
store = mr.create({path!r}, SPEC, 50, num_envs=2, backend={backend!r}, compression={compression!r})
store.extend(steps(0, 6, {{2: [0]}}))  # env 0: episode 0..2 ended, 3..5 open; env 1: 0..5 open
store.commit()
if {kill}:
    store.extend(steps(6, 2))  # never committed: the kill loses them
    os.kill(os.getpid(), signal.SIGKILL)
store.close()
"""

LEFT = [(0, 0, 2, "terminated"), (0, 3, 5, "open"), (1, 0, 5, "open")]
RESUMED = [
    (0, 0, 2, "terminated"), (0, 3, 5, "truncated"), (0, 6, 6, "open"),
    (1, 0, 5, "truncated"), (1, 6, 6, "open"),
]


@pytest.mark.parametrize("ending", ["close", "sigkill"])
def test_a_resumed_writer_ends_the_episodes_left_open(tmp_path, layout, ending, writers):
    path = str(tmp_path / "b")
    script = WRITER.format(here=HERE, path=path, kill=ending == "sigkill", **layout)
    if ending == "sigkill":
        writers.run_killed(script)
    else:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    with mr.open(path, "a") as writer:
        assert writer.total_steps == 6
        assert spans(writer) == LEFT  # nothing changes before the writer writes
        writer.add({k: v[0] for k, v in steps(6, 1).items()})  # the new run's first step
        assert spans(writer) == RESUMED
    with mr.open(path) as reader:  # what readers and exports see: the index on disk agrees
        assert spans(reader) == RESUMED
        assert reader.get(5)["truncated"].tolist() == [True, True]
        mr.export(reader, tmp_path / "d4rl.hdf5", format="d4rl")
    with h5py.File(tmp_path / "d4rl.hdf5", "r") as f:
        # env 0's rows then env 1's: each episode ends on its own row, none runs into the next
        assert np.flatnonzero(f["terminals"][:]).tolist() == [2]
        assert np.flatnonzero(f["timeouts"][:]).tolist() == [5, 6, 12, 13]


def test_a_reader_that_asked_before_the_first_commit_sees_the_resumed_writers_ends(tmp_path):
    """The episode index file appears at the first commit: a reader that asked for
    episodes before it must still follow the file, which records the ends a resumed
    writer marks on committed steps."""
    path = str(tmp_path / "b")
    with mr.create(path, SPEC, 50, num_envs=2) as store, mr.open(path) as reader:
        assert spans(reader) == []  # asked while the store is empty
        store.extend(steps(0, 6, {2: [0]}))
        store.commit()
        reader.refresh()
        assert spans(reader) == LEFT
        store.close()
        done = subprocess.run(  # a writer that resumes in another process
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); import mmreplay as mr; "
             f"from test_resume_episodes import steps; w = mr.open({path!r}, 'a'); "
             "w.add({k: v[0] for k, v in steps(6, 1).items()}); w.close()"],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert reader.refresh()
        assert reader.get(5)["truncated"].tolist() == [True, True]
        assert spans(reader) == RESUMED


def test_a_writer_that_writes_nothing_changes_nothing(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 50, num_envs=2) as store:
        store.extend(steps(0, 4))
    before = folder_digest(tmp_path / "b")
    with mr.open(tmp_path / "b", "a") as writer:
        with pytest.raises(mr.BadInputError, match="obs"):
            writer.add({**{k: v[0] for k, v in steps(4, 1).items()}, "obs": np.zeros((2, 3), "float32")})
        assert spans(writer) == [(0, 0, 3, "open"), (1, 0, 3, "open")]
    assert folder_digest(tmp_path / "b") == before  # a clean close leaves the episodes open


def test_a_writer_that_continues_the_episodes_marks_nothing(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 50, num_envs=2) as store:
        store.extend(steps(0, 6, {2: [0]}))
    with mr.open(tmp_path / "b", "a", continue_episodes=True) as writer:  # its envs restored from the store
        writer.add({k: v[0] for k, v in steps(6, 1).items()})
        assert spans(writer) == [(0, 0, 2, "terminated"), (0, 3, 6, "open"), (1, 0, 6, "open")]


def test_a_store_without_a_truncated_leaf_continues_the_open_episode(tmp_path, caplog):
    spec = {"obs": mr.ArraySpec((), "float32"), "done": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "b", spec, 20) as store:
        store.extend({"obs": np.arange(4, dtype="float32")[:, None], "done": np.zeros((4, 1), bool)})
    with caplog.at_level(logging.INFO, logger="mmreplay.episodes"), mr.open(tmp_path / "b", "a") as writer:
        writer.add({"obs": np.zeros(1, "float32"), "done": np.zeros(1, bool)})
        assert spans(writer) == [(0, 0, 4, "open")]  # marking it terminated would invent an end
    assert "cannot mark truncated" in caplog.text


def test_an_end_marked_but_not_yet_indexed_is_indexed_by_the_next_writer(tmp_path):
    """A writer killed after committing its mark but before rewriting the episode index."""
    with mr.create(tmp_path / "b", SPEC, 50, num_envs=2) as store:
        store.extend(steps(0, 6, {2: [0]}))
        store.commit()
        assert spans(store) == LEFT
        truncated = store.leaves[store.leaf_paths.index("truncated")]
        truncated.write_slots(np.array([5]), np.ones((1, 2), bool))  # the rows only, as the mark writes them
    with mr.open(tmp_path / "b", "a") as writer:
        assert spans(writer) == [(0, 0, 2, "terminated"), (0, 3, 5, "truncated"), (1, 0, 5, "truncated")]
    with mr.open(tmp_path / "b") as reader:
        assert spans(reader)[-1] == (1, 0, 5, "truncated")


def test_a_writer_killed_after_its_mark_but_before_its_commit_leaves_a_healthy_store(tmp_path, writers):
    """A resumed writer marks the open episodes truncated in place, then commits and
    indexes the mark: SIGKILL in between leaves a store `verify` passes, whose next writer
    indexes the mark."""
    path = str(tmp_path / "b")
    with mr.create(path, SPEC, 50, num_envs=2) as store:
        store.extend(steps(0, 6, {2: [0]}))
    writers.run_killed(
        "import os, signal, numpy as np, mmreplay as mr\n"
        f"w = mr.open({path!r}, 'a')\n"
        "w.leaves[w.leaf_paths.index('truncated')].write_slots(np.array([5]), np.ones((1, 2), bool))  # as the mark\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert verify_cli(path) == (0, [])
    with mr.open(path, "a") as writer:
        writer.add({k: v[0] for k, v in steps(6, 1).items()})
        assert spans(writer) == RESUMED
    assert verify_cli(path) == (0, [])


def test_end_episodes_marks_the_newest_step_of_the_envs_still_in_an_episode(tmp_path, layout):
    path = tmp_path / "b"
    with mr.create(path, SPEC, 50, num_envs=2, commit_every=1000, **layout) as store:
        store.extend(steps(0, 6, {5: [0]}))  # env 0's episode ends at the newest step, env 1's runs on
        rewrites = store.state.rewrites
        assert store.end_episodes().tolist() == [1]
        assert store.committed_steps == 6  # with the mark
        assert store.state.rewrites == rewrites  # the step was not committed: nothing was rewritten
        assert store.end_episodes().tolist() == []  # every episode has ended there now
        with mr.open(path) as reader:
            assert reader.get(5)["truncated"].tolist() == [False, True]
            assert spans(reader) == [(0, 0, 5, "terminated"), (1, 0, 5, "truncated")]
        store.extend(steps(6, 2))
        store.commit()
        with mr.open(path) as reader:
            assert store.end_episodes([0]).tolist() == [0]  # a committed step: rewritten, counted
            assert store.state.rewrites == rewrites + 1
            reader.refresh()
            assert reader.get(7)["truncated"].tolist() == [True, False]
            assert spans(reader) == [(0, 0, 5, "terminated"), (0, 6, 7, "truncated"), (1, 0, 5, "truncated"),
                                     (1, 6, 7, "open")]  # fmt: skip
    with mr.open(path) as reader:
        with pytest.raises(mr.ReadOnlyError):
            reader.end_episodes()


def test_end_episodes_of_a_reopened_writer_ends_every_episode_left_open(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 50, num_envs=2) as store:
        store.extend(steps(0, 6, {2: [0]}))
    with mr.open(tmp_path / "b", "a") as writer:  # its envs are new: env 1's episode cannot go on either
        assert writer.end_episodes([0]).tolist() == [0, 1]
        assert spans(writer) == [(0, 0, 2, "terminated"), (0, 3, 5, "truncated"), (1, 0, 5, "truncated")]
    with mr.open(tmp_path / "b", "a", continue_episodes=True) as writer:
        writer.extend(steps(6, 2))
        assert writer.end_episodes([1]).tolist() == [1]
        assert spans(writer)[2:] == [(0, 6, 7, "open"), (1, 0, 5, "truncated"), (1, 6, 7, "truncated")]


# --- every layer that resumes a folder ---------------------------------------------------


def _resumed(path) -> list[tuple]:
    with mr.open(path) as reader:
        return spans(reader)


@pytest.mark.parametrize("optimize_memory_usage", [False, True])
def test_sb3_replay_buffer(tmp_path, optimize_memory_usage):
    pytest.importorskip("stable_baselines3")
    gym = pytest.importorskip("gymnasium")
    from mmreplay.compat.sb3 import ReplayBuffer

    box = gym.spaces.Box(-10.0, 10.0, (2,), np.float32)

    def run(steps_: range):
        rb = ReplayBuffer(
            100, box, gym.spaces.Discrete(2), "cpu", path=tmp_path / "b", optimize_memory_usage=optimize_memory_usage
        )
        for t in steps_:
            obs = np.full((1, 2), t, np.float32)
            rb.add(obs, obs + 1, np.array([0]), np.array([1.0]), np.array([t == 1]), [{}])
        rb.close()

    run(range(4))  # an episode ended at step 1, the next one runs when the run stops
    run(range(7, 9))  # the resumed run's envs start afresh
    assert _resumed(tmp_path / "b") == [(0, 0, 1, "terminated"), (0, 2, 3, "truncated"), (0, 4, 5, "open")]
    with mr.open(tmp_path / "b") as reader:  # each step keeps its own next observation
        np.testing.assert_array_equal(reader.get(slice(None))["next_observation"][:, 0, 0], [1, 2, 3, 4, 8, 9])


def test_torchrl_storage(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchrl")
    from tensordict import TensorDict
    from torchrl.data import ReplayBuffer

    from mmreplay.compat.torchrl import MMReplayStorage

    def extend(storage, t0: int, n: int) -> None:
        t = torch.arange(t0, t0 + n)
        data = {"obs": t.float(), "terminated": t == 1, "truncated": torch.zeros(n, dtype=torch.bool)}
        ReplayBuffer(storage=storage).extend(TensorDict(data, batch_size=[n]))
        storage.close()

    extend(MMReplayStorage(tmp_path / "b", max_size=20), 0, 4)
    extend(MMReplayStorage(tmp_path / "b"), 4, 2)
    assert _resumed(tmp_path / "b") == [(0, 0, 1, "terminated"), (0, 2, 3, "truncated"), (0, 4, 5, "open")]


def test_skrl_memory(tmp_path):
    torch = pytest.importorskip("torch")
    from mmreplay.compat.skrl import RandomMemory

    def run(t0: int, n: int) -> None:
        m = RandomMemory(20, 2, device="cpu", path=tmp_path / "m", replacement=True)
        m.create_tensor("states", 1)
        m.create_tensor("terminated", 1, torch.bool)
        m.create_tensor("truncated", 1, torch.bool)
        for t in range(t0, t0 + n):
            ends = torch.tensor([[t == 1], [False]])
            m.add_samples(states=torch.full((2, 1), float(t)), terminated=ends, truncated=torch.zeros(2, 1, dtype=torch.bool))
        m.close()

    run(0, 4)
    run(4, 2)
    assert _resumed(tmp_path / "m") == [
        (0, 0, 1, "terminated"), (0, 2, 3, "truncated"), (0, 4, 5, "open"), (1, 0, 3, "truncated"), (1, 4, 5, "open"),
    ]


def test_tf_agents_trajectories(tmp_path):
    from mmreplay.compat.tf_agents import UniformReplayBuffer

    spec = {
        "step_type": mr.ArraySpec((), "int32"),
        "observation": mr.ArraySpec((), "float32"),
        "action": mr.ArraySpec((), "int64"),
        "next_step_type": mr.ArraySpec((), "int32"),
        "reward": mr.ArraySpec((), "float32"),
        "discount": mr.ArraySpec((), "float32"),
    }
    first, mid, last = 0, 1, 2

    def run(kinds: list[tuple[int, int]]) -> None:
        with UniformReplayBuffer(spec, 1, 20, path=tmp_path / "rb") as rb:
            for step_type, next_step_type in kinds:
                rb.add_batch({
                    "step_type": np.array([step_type], "int32"), "observation": np.zeros(1, "float32"),
                    "action": np.zeros(1, "int64"), "next_step_type": np.array([next_step_type], "int32"),
                    "reward": np.zeros(1, "float32"), "discount": np.ones(1, "float32"),
                })

    run([(first, mid), (mid, mid)])  # the run stops mid-episode
    run([(first, mid), (mid, last)])
    assert _resumed(tmp_path / "rb") == [(0, 0, 1, "truncated"), (0, 2, 3, "truncated")]
    with mr.open(tmp_path / "rb") as reader:
        assert reader.get(slice(None))["next_step_type"][:, 0].tolist() == [mid, last, mid, last]


def test_gymnasium_recorder(tmp_path):
    gymnasium = pytest.importorskip("gymnasium")
    from mmreplay.compat.gymnasium import RecordTransitions

    for seed in (0, 1):
        env = RecordTransitions(gymnasium.make("CartPole-v1"), tmp_path / "b", capacity=100)
        env.reset(seed=seed)
        for _ in range(3):
            env.step(0)
        env.close()  # mid-episode
    assert _resumed(tmp_path / "b") == [(0, 0, 2, "truncated"), (0, 3, 5, "open")]
