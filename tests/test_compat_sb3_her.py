"""mmreplay.compat.sb3.HerReplayBuffer against SB3's own: same adds, same seed, same samples;
its episodes from the store's index across a kill and a resume."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

sb3 = pytest.importorskip(
    "stable_baselines3", reason="stable-baselines3 is not installed (pip install 'mmreplay[sb3]')"
)
gym = pytest.importorskip("gymnasium")
torch = pytest.importorskip("torch")

from stable_baselines3.common.envs import BitFlippingEnv  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv  # noqa: E402
from stable_baselines3.her.her_replay_buffer import HerReplayBuffer as SB3HerReplayBuffer  # noqa: E402

import mmreplay as mr  # noqa: E402
from mmreplay.compat.sb3 import HerReplayBuffer  # noqa: E402

spaces = gym.spaces

N_BITS = 4


def _vec_env(n_envs: int = 1) -> DummyVecEnv:
    return DummyVecEnv([lambda: BitFlippingEnv(n_bits=N_BITS, continuous=True)] * n_envs)


class GoalSteps:
    """Random goal-env steps of ``n_envs`` envs, as SB3's ``add`` takes them: episodes end
    at random (terminated, or truncated by a time limit) and after ``limit`` steps at most
    (SB3 mistakes the tail of an episode longer than its ring for a short episode)."""

    def __init__(self, n_envs: int, seed: int, limit: int = 8):
        self.rng, self.n_envs, self.limit = np.random.default_rng(seed), n_envs, limit
        self.length = np.zeros(n_envs, np.int64)

    def __call__(self):
        rng, n_envs = self.rng, self.n_envs

        def obs():
            keys = ("achieved_goal", "desired_goal", "observation")
            return {k: rng.integers(0, 2, (n_envs, N_BITS)).astype(np.int8) for k in keys}

        self.length += 1
        limited = self.length >= self.limit
        done = (rng.random(n_envs) < 0.25) | limited
        timeouts = done & (limited | (rng.random(n_envs) < 0.5))
        self.length[done] = 0
        infos = [{"TimeLimit.truncated": bool(t)} for t in timeouts]
        action = rng.uniform(-1, 1, (n_envs, N_BITS)).astype(np.float32)
        return obs(), obs(), action, -rng.integers(0, 2, n_envs).astype(np.float32), done, infos


def _her_pair(
    tmp_path, n_envs: int, size: int, strategy: str = "future", n_sampled_goal: int = 4, commit_every: int = 3, **kw
):
    env = _vec_env(n_envs)
    args = (size, env.observation_space, env.action_space, env)
    options = dict(
        device="cpu", n_envs=n_envs, goal_selection_strategy=strategy, n_sampled_goal=n_sampled_goal, **kw
    )
    theirs = SB3HerReplayBuffer(*args, **options)
    ours = HerReplayBuffer(*args, **options, path=tmp_path / "buf", commit_every=commit_every)
    return theirs, ours


def _add_both(theirs, ours, steps, n):
    """The next ``n`` steps of ``steps``, added to both buffers."""
    for _ in range(n):
        step = steps()
        theirs.add(*step)
        ours.add(*step)


def _assert_same_draws(theirs, ours) -> None:
    """SB3's episode arrays, and its batch for the same ``np.random`` seed."""
    _assert_same_episodes(theirs, ours)
    np.random.seed(0)
    expected = theirs.sample(32)
    np.random.seed(0)
    _assert_same(expected, ours.sample(32))


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    for name in a._fields:
        x, y = getattr(a, name), getattr(b, name)
        if x is None:  # discounts, set by n-step buffers only
            assert y is None, name
            continue
        pairs = [(f"{name}/{k}", x[k], y[k]) for k in x] if isinstance(x, dict) else [(name, x, y)]
        if isinstance(x, dict):
            assert x.keys() == y.keys()
        for what, u, v in pairs:
            assert u.dtype == v.dtype and u.shape == v.shape, what
            assert torch.equal(u, v), what


def _assert_same_episodes(theirs, ours) -> None:
    """SB3's episode arrays where an episode can be drawn (SB3 leaves stale starts elsewhere)."""
    np.testing.assert_array_equal(ours.ep_length, theirs.ep_length)
    valid = theirs.ep_length > 0
    np.testing.assert_array_equal(ours.ep_start[valid], theirs.ep_start[valid])


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
@pytest.mark.parametrize("n_envs", [1, 3])
def test_her_samples_equal_sb3s_for_the_same_adds_and_seed(tmp_path, strategy, n_envs):
    theirs, ours = _her_pair(tmp_path, n_envs, size=17 * n_envs, strategy=strategy)
    steps = GoalSteps(n_envs, seed=0)
    sampled = 0
    for t in range(4 * theirs.buffer_size):  # the ring wraps three times, mid-episode
        step = steps()
        theirs.add(*step)
        ours.add(*step)
        assert (ours.pos, ours.full) == (theirs.pos, theirs.full)
        if (theirs.ep_length > 0).any() and t % 3 == 0:
            _assert_same_episodes(theirs, ours)
            np.random.seed(t)
            expected = theirs.sample(64)
            np.random.seed(t)
            _assert_same(expected, ours.sample(64))
            sampled += 1
    assert sampled > 10
    ours.close()


@pytest.mark.parametrize("n_sampled_goal", [1, 2])
def test_her_ratio_timeouts_and_draws_are_sb3s(tmp_path, n_sampled_goal):
    theirs, ours = _her_pair(
        tmp_path, 2, size=40, n_sampled_goal=n_sampled_goal, handle_timeout_termination=False
    )
    steps = GoalSteps(2, seed=1)
    _add_both(theirs, ours, steps, 50)
    assert ours.her_ratio == theirs.her_ratio
    np.random.seed(3)
    expected, after = theirs.sample(33), np.random.rand()
    np.random.seed(3)
    _assert_same(expected, ours.sample(33))
    assert np.random.rand() == after  # as many np.random draws as SB3's
    ours.close()


def test_the_stores_own_relabelling_takes_an_sb3_vec_env_and_pickles(tmp_path):
    _, ours = _her_pair(tmp_path, 2, size=40)
    steps = GoalSteps(2, seed=4)
    for _ in range(30):
        ours.add(*steps())
    her = mr.Hindsight(ours.env, "episode", 1.0)
    again = pickle.loads(pickle.dumps(her))  # as a request travels to a Ray actor
    one, two = (ours.store.sample(64, rng=7, transform=t) for t in (her, again))
    for path in ("observation", "next_observation"):
        np.testing.assert_array_equal(one[path]["desired_goal"], two[path]["desired_goal"])
    np.testing.assert_array_equal(one["reward"], two["reward"])
    # the rewards are the env's for the new goals, computed as SB3 computes them
    expected = ours.env.env_method(
        "compute_reward",
        one["next_observation"]["achieved_goal"],
        one["observation"]["desired_goal"],
        [{}] * 64,
        indices=[0],
    )[0]
    np.testing.assert_array_equal(one["reward"], expected)
    ours.close()


def test_a_batch_with_nothing_to_relabel_does_not_call_compute_reward(tmp_path):
    """BitFlippingEnv's compute_reward fails on zero goals: a batch of one (no virtual
    transition at her_ratio 0.8), n_sampled_goal=0, or a draw relabelling none is the stored one."""
    _, ours = _her_pair(tmp_path, 1, size=40)
    steps = GoalSteps(1, seed=6)
    for _ in range(30):
        ours.add(*steps())
    stored = ours.store.sample(16, rng=0)
    one = ours.sample(1)
    assert one.rewards.shape == (1, 1)
    none = ours.store.sample(16, rng=0, transform=mr.Hindsight(ours.env, fraction=0.0))
    np.testing.assert_array_equal(none["reward"], stored["reward"])
    np.testing.assert_array_equal(none["observation"]["desired_goal"], stored["observation"]["desired_goal"])
    ours.close()
    _, real_only = _her_pair(tmp_path / "zero", 1, size=40, n_sampled_goal=0)
    for _ in range(30):
        real_only.add(*steps())
    assert real_only.her_ratio == 0 and real_only.sample(8).rewards.shape == (8, 1)
    real_only.close()


KILLED_WRITER = textwrap.dedent(
    """
    import pickle, sys
    sys.path.insert(0, {tests!r})
    from test_compat_sb3_her import GoalSteps, _vec_env
    from mmreplay.compat.sb3 import HerReplayBuffer
    env = _vec_env(2)
    rb = HerReplayBuffer(60, env.observation_space, env.action_space, env, "cpu", n_envs=2, path={path!r}, commit_every=1)
    with open({manifest!r}, "wb") as f:
        pickle.dump(rb, f)
    steps = GoalSteps(2, seed=5)
    for _ in range({count}):
        rb.add(*steps())
    print("written", flush=True)
    sys.stdin.readline()
    """
)


def test_a_buffer_killed_mid_episode_resumes_as_sb3s_truncated_one(tmp_path, writers):
    path, manifest, count = str(tmp_path / "buf"), str(tmp_path / "rb.pkl"), 23
    code = KILLED_WRITER.format(tests=os.path.dirname(__file__), path=path, manifest=manifest, count=count)
    writers.kill_when(writers.start(code, stdin=subprocess.PIPE), lambda line: line.strip() == "written")
    theirs = SB3HerReplayBuffer(60, *_spaces(2), _vec_env(2), "cpu", n_envs=2)
    steps = GoalSteps(2, seed=5)
    for _ in range(count):
        theirs.add(*steps())
    assert (theirs._current_ep_start != theirs.pos).all()  # both envs were mid-episode
    with open(manifest, "rb") as f:
        ours = pickle.load(f)  # what load_replay_buffer does: then set_env and truncate
    assert ours.env is None and ours.pos == count
    for rb in (theirs, ours):
        if rb is ours:
            rb.set_env(_vec_env(2))
        with pytest.warns(UserWarning, match="will be truncated"):
            rb.truncate_last_trajectory()
    _assert_same_episodes(theirs, ours)
    for t in range(30):  # the resumed run's episodes, over a wrapping ring
        step = steps()
        theirs.add(*step)
        ours.add(*step)
        _assert_same_episodes(theirs, ours)
        np.random.seed(t)
        expected = theirs.sample(32)
        np.random.seed(t)
        _assert_same(expected, ours.sample(32))
    ours.close()


def test_a_reopened_folder_draws_the_episodes_left_open_before_its_first_add(tmp_path):
    """Started again on its folder, the buffer is SB3's after load_replay_buffer: the
    episodes left open end truncated at once, so sampling (offline, or before the first
    add) draws them as SB3 does."""
    theirs, ours = _her_pair(tmp_path, 2, size=40, strategy="episode")
    steps = GoalSteps(2, seed=7, limit=30)
    _add_both(theirs, ours, steps, 9)
    ours.close()
    ours = HerReplayBuffer(
        40,
        *_spaces(2),
        _vec_env(2),
        "cpu",
        n_envs=2,
        goal_selection_strategy="episode",
        path=tmp_path / "buf",
    )
    with pytest.warns(UserWarning, match="will be truncated"):
        theirs.truncate_last_trajectory()
    _assert_same_draws(theirs, ours)
    ours.close()


def test_truncating_the_last_trajectory_mid_run_ends_the_episodes_sb3_ends(tmp_path, count=10):
    """``truncate_last_trajectory`` with steps not committed yet marks the newest step of
    the envs still in an episode there, as SB3 does: not an env whose episode ended at it."""
    theirs, ours = _her_pair(tmp_path, 3, size=40, strategy="episode", commit_every=1000)
    steps = GoalSteps(3, seed=11, limit=30)
    for t in range(count):
        obs, next_obs, action, reward, done, infos = steps()
        if t == count - 1:  # env 0's episode ends at the newest step, the others' run on
            done = np.array([True, False, False])
            infos = [{"TimeLimit.truncated": False}] * 3
        theirs.add(obs, next_obs, action, reward, done, infos)
        ours.add(obs, next_obs, action, reward, done, infos)
    assert ours.store.committed_steps < count  # the newest steps are not committed
    with pytest.warns(UserWarning, match="will be truncated"):
        theirs.truncate_last_trajectory()
    with pytest.warns(UserWarning, match="will be truncated"):
        ours.truncate_last_trajectory()
    np.testing.assert_array_equal(ours.dones[:count], theirs.dones[:count])
    np.testing.assert_array_equal(ours.timeouts[:count], theirs.timeouts[:count])
    _assert_same_draws(theirs, ours)
    ours.close()


def test_a_manifest_loaded_without_truncating_goes_on_with_the_episodes_as_sb3s(tmp_path):
    """``load_replay_buffer(..., truncate_last_traj=False)`` in the process that saved it,
    mid-episode: the episodes go on, as in SB3's buffer."""
    theirs, ours = _her_pair(tmp_path, 2, size=40, strategy="future")
    steps = GoalSteps(2, seed=3, limit=30)
    _add_both(theirs, ours, steps, 9)
    ours = pickle.loads(pickle.dumps(ours))
    ours.set_env(_vec_env(2))
    _add_both(theirs, ours, steps, 12)
    _assert_same_draws(theirs, ours)
    ours.close()


def _spaces(n_envs: int):
    env = _vec_env(n_envs)
    return env.observation_space, env.action_space


def test_save_replay_buffer_writes_a_small_manifest_without_the_env(tmp_path):
    env = _vec_env(1)
    rb = HerReplayBuffer(100_000, *_spaces(1), env, "cpu", path=tmp_path / "buf")
    steps = GoalSteps(1, seed=2)
    for _ in range(50):
        rb.add(*steps())
    blob = pickle.dumps(rb)
    assert len(blob) < 4_000 and b"BitFlipping" not in blob
    restored = pickle.loads(blob)
    with pytest.raises(mr.BadInputError, match="set_env"):
        restored.sample(8)
    restored.set_env(env)
    assert restored.sample(8).rewards.shape == (8, 1)
    with pytest.raises(ValueError, match="already initialized"):
        restored.set_env(env)
    restored.close()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(goal_selection_strategy="next"), "one of future, final, episode; got 'next'"),
        (dict(n_sampled_goal=-1), "n_sampled_goal must be an int >= 0"),
        (dict(copy_info_dict=True), "copy_info_dict=True"),
        (dict(env=gym.make("CartPole-v1")), "has no compute_reward"),
        (dict(observation_space=spaces.Box(0, 1, (3,))), "'achieved_goal' and 'desired_goal'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_created(tmp_path, kwargs, match):
    obs, action = _spaces(1)
    args = {**dict(observation_space=obs, action_space=action, env=_vec_env(1)), **kwargs}
    with pytest.raises(mr.BadInputError, match=match):
        HerReplayBuffer(10, **args, path=tmp_path / "buf")
    assert not (tmp_path / "buf").exists()


EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "sb3_her_bitflip.py"
)
#: the example run as a script, its arguments after the code
RUN_EXAMPLE = (
    f"import runpy, sys; sys.argv[0] = {EXAMPLE!r}; runpy.run_path({EXAMPLE!r}, run_name='__main__')"
)


def test_the_bitflip_example_learns_is_killed_resumes_and_keeps_learning(tmp_path, writers):
    run = tmp_path / "run"
    args = ["--run", run, "--steps", 900, "--every", 300, "--bits", 5, "--eval-episodes", 20]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torch's threads only slow a small net down
    proc = writers.start(RUN_EXAMPLE, *args, env=env)
    untrained = float(proc.stdout.readline().split("success")[1])
    writers.kill_when(proc, lambda line: line.startswith("checkpoint: step 300"))  # as it learns on
    with mr.open(run / "buffer") as store:
        committed = store.committed_steps
    out = subprocess.run(
        [sys.executable, "-c", RUN_EXAMPLE, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"start: step 300, buffer {committed} steps") and committed >= 300
    assert (
        lines[-1].startswith("checkpoint: step 900")
        and float(lines[-1].split("success")[1]) >= 0.9 > untrained
    )
    with mr.open(run / "buffer") as store:
        assert store.total_steps >= committed + 600
        killed = [s for s in store.episode_index() if s.first_step < committed <= s.last_step + 1]
        assert [(s.last_step, s.status) for s in killed] in (
            [(committed - 1, "truncated")],
            [(committed - 1, "terminated")],
        )
