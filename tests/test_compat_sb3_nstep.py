"""mmreplay.compat.sb3.NStepReplayBuffer against SB3's own NStepReplayBuffer: the same adds
and seeds give the same samples field by field; a killed run resumes with its open
episodes cut where it died; SB3's own n-step tests pass against it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest

sb3 = pytest.importorskip("stable_baselines3", reason="stable-baselines3 is not installed")
gym = pytest.importorskip("gymnasium")

from conftest import run_their_tests  # noqa: E402
from stable_baselines3.common import buffers as sb3_buffers  # noqa: E402
from test_compat_sb3 import BOX, _assert_same, _random_step, _sb3_test_file, _Trajectories  # noqa: E402

import mmreplay as mr  # noqa: E402
from mmreplay.compat.sb3 import NStepReplayBuffer  # noqa: E402

spaces = gym.spaces
ACTIONS = spaces.Discrete(3)


def _pair(tmp_path, n_envs: int, n_steps: int, handle_timeout: bool = True, size: int = 14, gamma=0.9, **kw):
    common = dict(
        device="cpu", n_envs=n_envs, handle_timeout_termination=handle_timeout, n_steps=n_steps, gamma=gamma
    )
    theirs = sb3_buffers.NStepReplayBuffer(size, BOX, ACTIONS, **common)
    ours = NStepReplayBuffer(size, BOX, ACTIONS, path=tmp_path / "buf", commit_every=3, **common, **kw)
    return theirs, ours


def _seeded(seed: int, method, *args):
    """``method(*args)`` after seeding ``np.random``, which SB3 draws envs and indices from."""
    np.random.seed(seed)
    return method(*args)


@pytest.mark.parametrize("handle_timeout", [True, False])
@pytest.mark.parametrize("n_envs, n_steps, gamma", [(1, 3, 0.9), (3, 4, 0.9), (2, 1, 0.9), (2, 20, 0.9), (2, 3, 0.0)])
def test_same_adds_give_the_same_samples_as_sb3(tmp_path, n_envs, n_steps, gamma, handle_timeout):
    BOX.seed(0)
    ACTIONS.seed(0)
    theirs, ours = _pair(tmp_path, n_envs, n_steps, handle_timeout, gamma=gamma)
    rng = np.random.default_rng(n_envs)
    for t in range(3 * theirs.buffer_size + 2):  # wraps the ring more than twice
        step = _random_step(rng, BOX, ACTIONS, n_envs)
        theirs.add(*step)
        ours.add(*step)
        if t % 4 == 3 or t < 3:
            inds = rng.integers(0, theirs.size(), 60)
            _assert_same(_seeded(t, theirs._get_samples, inds), _seeded(t, ours._get_samples, inds))
            _assert_same(_seeded(t, theirs.sample, 32), _seeded(t, ours.sample, 32))
    ours.close()


def test_frames_stored_once_give_the_samples_of_sb3s_full_memory_buffer(tmp_path):
    """SB3's class refuses ``optimize_memory_usage``; the drop-in stores each observation once."""
    theirs = sb3_buffers.NStepReplayBuffer(14, BOX, ACTIONS, "cpu", n_envs=2, n_steps=3, gamma=0.9)
    ours = NStepReplayBuffer(
        14, BOX, ACTIONS, "cpu", n_envs=2, n_steps=3, gamma=0.9, optimize_memory_usage=True,
        path=tmp_path / "buf", final_slots=200,
    )  # fmt: skip
    steps = _Trajectories(2, seed=0)
    for t in range(3 * theirs.buffer_size + 2):
        step = steps.step()
        theirs.add(*step)
        ours.add(*step)
        if t % 4 == 3:
            valid = [i for i in range(theirs.size()) if not (theirs.full and i == theirs.pos)]  # SB3's rule
            inds = np.array(valid)
            _assert_same(_seeded(t, theirs._get_samples, inds), _seeded(t, ours._get_samples, inds))
    ours.close()


def test_rewards_normalized_one_by_one_before_the_sum_as_sb3_does(tmp_path):
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    venv = VecNormalize(DummyVecEnv([lambda: gym.make("CartPole-v1")]), norm_obs=False, clip_reward=0.3)
    venv.ret_rms.var = np.array(2.0)  # rewards in [0, 1) / 1.41: some are clipped at 0.3
    theirs, ours = _pair(tmp_path, 2, 4)
    rng = np.random.default_rng(0)
    for _ in range(20):
        step = _random_step(rng, BOX, ACTIONS, 2)
        theirs.add(*step)
        ours.add(*step)
    inds = np.arange(theirs.size())
    _assert_same(_seeded(0, theirs._get_samples, inds, venv), _seeded(0, ours._get_samples, inds, venv))
    ours.close()


def test_bad_n_steps_or_gamma_is_refused_before_anything_is_written(tmp_path):
    for n_steps, gamma, match in (
        (0, 0.99, "n must be an int >= 1"),
        (3, 1.01, r"gamma must be a number in \[0, 1\]"),
    ):
        with pytest.raises(mr.BadInputError, match=match):
            NStepReplayBuffer(10, BOX, ACTIONS, "cpu", n_steps=n_steps, gamma=gamma, path=tmp_path / "buf")
        assert not (tmp_path / "buf").exists()


def test_a_prioritized_sample_gives_the_returns_of_the_rows_it_drew(tmp_path):
    from test_nstep import expected

    rb = NStepReplayBuffer(
        40, BOX, ACTIONS, "cpu", n_envs=2, n_steps=3, gamma=0.9, path=tmp_path / "buf", sampler="prioritized"
    )
    rng = np.random.default_rng(1)
    for _ in range(15):
        rb.add(*_random_step(rng, BOX, ACTIONS, 2))
    batch = rb.sample(50, beta=0.4)
    info = rb.last_info
    want = expected(rb.store, info.step, info.env, 3, 0.9)
    np.testing.assert_allclose(batch.rewards.numpy()[:, 0], want["reward"], rtol=1e-6)
    np.testing.assert_array_equal(batch.next_observations.numpy(), want["next_observation"])
    np.testing.assert_array_equal(batch.dones.numpy()[:, 0], want["terminated"])
    np.testing.assert_allclose(batch.discounts.numpy()[:, 0], want["discount"], rtol=1e-6)
    assert rb.update_priorities(np.ones(50)) == 50
    rb.close()


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    from test_compat_sb3 import _random_step
    from test_compat_sb3_nstep import ACTIONS, BOX
    from mmreplay.compat.sb3 import NStepReplayBuffer
    BOX.seed(0); ACTIONS.seed(0)
    rb = NStepReplayBuffer(100, BOX, ACTIONS, "cpu", n_envs=2, n_steps=3, gamma=0.9, path={path!r}, commit_every=4)
    rng = np.random.default_rng(5)
    for t in range(30):
        rb.add(*_random_step(rng, BOX, ACTIONS, 2))
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def test_a_run_killed_with_sigkill_resumes_with_its_open_episodes_cut_where_it_died(tmp_path):
    path = str(tmp_path / "buf")
    code = WRITER.format(tests=os.path.dirname(__file__), path=path)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ours = NStepReplayBuffer(100, BOX, ACTIONS, "cpu", n_envs=2, n_steps=3, gamma=0.9, path=path)
    committed = ours.store.committed_steps
    assert 0 < committed < 30  # the dead run's uncommitted steps are lost
    # SB3's buffer told what the store knows: the committed steps, each env's open episode
    # ended by a time limit at the last of them, then the resumed run's steps
    BOX.seed(0)
    ACTIONS.seed(0)
    theirs = sb3_buffers.NStepReplayBuffer(100, BOX, ACTIONS, "cpu", n_envs=2, n_steps=3, gamma=0.9)
    rng = np.random.default_rng(5)
    for t in range(committed):
        obs, nxt, action, reward, done, infos = _random_step(rng, BOX, ACTIONS, 2)
        if t == committed - 1:
            infos = [info if d else {"TimeLimit.truncated": True} for info, d in zip(infos, done)]
            done = np.ones(2, bool)
        theirs.add(obs, nxt, action, reward, done, infos)
    for _ in range(10):
        step = _random_step(rng, BOX, ACTIONS, 2)
        theirs.add(*step)
        ours.add(*step)
    np.testing.assert_array_equal(ours.dones, theirs.dones)
    np.testing.assert_array_equal(ours.timeouts, theirs.timeouts)
    inds = np.arange(theirs.size())
    _assert_same(_seeded(0, theirs._get_samples, inds), _seeded(0, ours._get_samples, inds))
    ours.close()


def test_sb3s_own_n_step_tests_pass_against_the_drop_in(tmp_path):
    source = _sb3_test_file(
        os.path.join(tempfile.gettempdir(), "mmreplay-sb3-sdist"),
        "tests/test_n_step_replay.py",
        "NStepReplayBuffer, ReplayBuffer",
    )
    # test_run trains with the buffer SB3 makes by itself (its own class), then asserts it
    # is the one imported: not collected
    (tmp_path / "test_n_step_replay.py").write_text(
        source.replace("def test_run(", "def _trains_sb3s_own_class(")
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's configuration
    failed, passed, out = run_their_tests(tmp_path / "test_n_step_replay.py")
    # test_nstep_no_terminations writes into SB3's ``dones`` array, which the
    # drop-in shows as a read-only copy of the store's leaves; test_nstep_early_truncation
    # adds a time limit on a step that does not end its episode, which no VecEnv reports
    # and the drop-in records only on a step that ends one (so its window runs on past it)
    assert failed == {
        "test_nstep_no_terminations[3]",
        "test_nstep_no_terminations[5]",
        "test_nstep_early_truncation[0-5-1]",
        "test_nstep_early_truncation[0-5-2]",
        "test_nstep_early_truncation[1-2-1]",
        "test_nstep_early_truncation[1-5-1]",
        "test_nstep_early_truncation[1-5-2]",
    }, out
    assert len(passed) == 18, out
