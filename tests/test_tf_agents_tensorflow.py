"""The TF-Agents layer under real TensorFlow and TF-Agents: ``tf.function`` drivers,
datasets feeding a ``tf.function`` train step, ``common.Checkpointer`` and TF's error type.

TF-Agents 0.19 needs TensorFlow 2.15 and ``typing-extensions==4.5.0``, so these run in a
venv built as docs/tf-agents.md says (test_tf_agents_install.py builds one), and skip
where TF-Agents is not installed.
"""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tf_agents")

from tf_agents.drivers import dynamic_step_driver  # noqa: E402
from tf_agents.environments import random_py_environment, tf_py_environment  # noqa: E402
from tf_agents.policies import random_tf_policy  # noqa: E402
from tf_agents.replay_buffers import table, tf_uniform_replay_buffer  # noqa: E402
from tf_agents.specs import array_spec  # noqa: E402
from tf_agents.utils import common  # noqa: E402

import mmreplay as mr  # noqa: E402
from mmreplay.compat.tf_agents import UniformReplayBuffer  # noqa: E402


def make_env(batch_size: int = 2, seed: int = 0):
    obs = array_spec.BoundedArraySpec((3,), np.float32, -1.0, 1.0)
    act = array_spec.BoundedArraySpec((), np.int32, 0, 2)
    py_env = random_py_environment.RandomPyEnvironment(
        obs, act, batch_size=batch_size, seed=seed, min_duration=3, max_duration=6
    )
    return tf_py_environment.TFPyEnvironment(py_env)


def collect(env, observers, steps: int = 12):
    policy = random_tf_policy.RandomTFPolicy(env.time_step_spec(), env.action_spec())
    driver = dynamic_step_driver.DynamicStepDriver(env, policy, observers=observers, num_steps=steps)
    return common.function(driver.run), policy


def test_tf_function_driver_adds_what_tf_agents_buffer_gets(tmp_path):
    env = make_env()
    _, policy = collect(env, [])
    spec = policy.trajectory_spec
    ours = UniformReplayBuffer(spec, batch_size=2, max_length=50, path=tmp_path / "rb")
    theirs = tf_uniform_replay_buffer.TFUniformReplayBuffer(spec, batch_size=2, max_length=50)
    run, _ = collect(env, [ours.add_batch, theirs.add_batch])
    state = run()
    run(*state)  # the traced function runs again: the adds happen each time
    assert int(ours.num_frames()) == int(theirs.num_frames()) > 2
    got, want = ours.gather_all(), theirs.gather_all()
    for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        np.testing.assert_array_equal(a, b.numpy())
    ours.close()


def test_dataset_feeds_a_tf_function_train_step_and_get_next_runs_in_graph(tmp_path):
    spec = {"x": tf.TensorSpec((), tf.int64)}
    with UniformReplayBuffer(spec, batch_size=2, max_length=20, path=tmp_path / "rb", seed=1) as rb:
        for t in range(10):
            rb.add_batch({"x": np.array([t, 100 + t])})
        it = iter(rb.as_dataset(sample_batch_size=8, num_steps=2).prefetch(2))

        @common.function
        def train_step():
            items, info = next(it)
            return items["x"][:, 1] - items["x"][:, 0], info.ids

        diffs = [train_step() for _ in range(3)]
        assert all((d.numpy() == 1).all() and ids.shape == (8, 2) for d, ids in diffs)

        @tf.function
        def draw():
            (items, info), frames = rb.get_next(sample_batch_size=64), rb.num_frames()
            return items["x"], info.ids, info.probabilities, frames

        @common.function
        def train_on_everything():  # PPO's and REINFORCE's train step
            return rb.gather_all()["x"]

        assert train_on_everything().numpy()[:, -1].tolist() == [9, 109]
        first = draw()
        rb.add_batch({"x": np.array([10, 110])})
        second = draw()  # the same trace draws again and sees the new frames
        assert int(first[3]) == 20 and int(second[3]) == 22
        assert first[2].shape == (64,) and first[2].numpy()[0] == pytest.approx(1 / 20)
        assert second[2].numpy()[0] == pytest.approx(1 / 22)
        assert not np.array_equal(first[0].numpy(), second[0].numpy())
        assert train_on_everything().numpy()[:, -1].tolist() == [10, 110]
        assert 10 in second[1].numpy() or 10 in (second[0].numpy() % 100)


def test_keywords_num_frames_tensor_and_empty_error(tmp_path):
    spec = tf.TensorSpec((), tf.int64)
    rb = UniformReplayBuffer(
        spec, 2, 5, path=tmp_path / "rb", scope="rb", device="cpu:*", table_fn=table.Table, stateful_dataset=True
    )
    frames = rb.num_frames()
    assert isinstance(frames, tf.Tensor) and frames.dtype == tf.int64 and int(frames) == 0
    assert rb.variables() == ()
    with pytest.raises(tf.errors.InvalidArgumentError, match="is empty") as caught:
        rb.get_next()
    assert isinstance(caught.value, mr.NotEnoughDataError)
    with pytest.raises(tf.errors.InvalidArgumentError):  # through tf.data as well
        next(iter(rb.as_dataset(single_deterministic_pass=True)))
    rb.close()
    with pytest.warns(RuntimeWarning, match="table_fn=.* is ignored"):
        UniformReplayBuffer(spec, 2, 5, path=tmp_path / "rb", table_fn=lambda *a, **k: None).close()


def add_frames(rb, n: int, start: int = 0) -> None:
    for t in range(start, start + n):
        rb.add_batch(np.array([t, 100 + t]))


def test_checkpointer_commits_and_restore_checks_the_folder(tmp_path):
    spec = tf.TensorSpec((), tf.int64)
    step = tf.Variable(0, dtype=tf.int64)
    path, ckpt = tmp_path / "rb", str(tmp_path / "ckpt")
    rb = UniformReplayBuffer(spec, 2, 50, path=path, commit_every=1000)
    add_frames(rb, 7)
    before = tmp_path / "rb-before"
    rb.store.commit()
    shutil.copytree(path, before)  # a copy of the folder from before the checkpoint
    add_frames(rb, 3, start=7)
    assert rb.store.committed_steps == 7
    common.Checkpointer(ckpt, max_to_keep=2, replay_buffer=rb, global_step=step).save(step)
    assert rb.store.committed_steps == 10  # saving committed the store
    rb.close()

    rb = UniformReplayBuffer(spec, 2, 50, path=path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the folder holds the checkpoint's commit: no warning
        common.Checkpointer(ckpt, max_to_keep=2, replay_buffer=rb, global_step=step)
    add_frames(rb, 2, start=10)
    rb.close()
    rb = UniformReplayBuffer(spec, 2, 50, path=path)
    with pytest.warns(RuntimeWarning, match="holds 2 adds made after the checkpoint"):
        common.Checkpointer(ckpt, max_to_keep=2, replay_buffer=rb, global_step=step)
    assert rb.gather_all()[0].numpy().tolist() == list(range(12))  # kept and sampled
    rb.close()

    old = UniformReplayBuffer(spec, 2, 50, path=before)
    with pytest.raises(ValueError, match="older than the checkpoint"):
        common.Checkpointer(ckpt, max_to_keep=2, replay_buffer=old, global_step=step)
    old.close()
    other = UniformReplayBuffer(spec, 2, 50, path=tmp_path / "other")
    add_frames(other, 10)
    with pytest.raises(ValueError, match="saved with another replay buffer"):
        common.Checkpointer(ckpt, max_to_keep=2, replay_buffer=other, global_step=step)
    other.close()
