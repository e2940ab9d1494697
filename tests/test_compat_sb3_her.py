"""mmreplay.compat.sb3.HerReplayBuffer against SB3's own: same adds, same seed, same samples;
its episodes from the store's index across a kill and a resume."""

from __future__ import annotations

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

from mmreplay.compat.sb3 import HerReplayBuffer  # noqa: E402

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


def _her_pair(tmp_path, n_envs: int, size: int, strategy: str = "future", n_sampled_goal: int = 4, **kw):
    env = _vec_env(n_envs)
    args = (size, env.observation_space, env.action_space, env)
    options = dict(device="cpu", n_envs=n_envs, goal_selection_strategy=strategy, n_sampled_goal=n_sampled_goal, **kw)
    theirs = SB3HerReplayBuffer(*args, **options)
    ours = HerReplayBuffer(*args, **options, path=tmp_path / "buf", commit_every=3)
    return theirs, ours


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
    theirs, ours = _her_pair(tmp_path, 2, size=40, n_sampled_goal=n_sampled_goal, handle_timeout_termination=False)
    steps = GoalSteps(2, seed=1)
    for _ in range(50):
        step = steps()
        theirs.add(*step)
        ours.add(*step)
    assert ours.her_ratio == theirs.her_ratio
    np.random.seed(3)
    expected, after = theirs.sample(33), np.random.rand()
    np.random.seed(3)
    _assert_same(expected, ours.sample(33))
    assert np.random.rand() == after  # as many np.random draws as SB3's
    ours.close()
