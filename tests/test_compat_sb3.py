"""mmreplay.compat.sb3 against Stable-Baselines3 itself: same adds, same samples."""

from __future__ import annotations

import os
import pickle
import shutil
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

from conftest import ONLY_HYPOTHESIS, no_plugins  # noqa: E402
from stable_baselines3.common import buffers as sb3_buffers  # noqa: E402
from stable_baselines3.common.logger import Logger  # noqa: E402

import mmreplay as mr  # noqa: E402
from mmreplay.compat.sb3 import DictReplayBuffer, ReplayBuffer  # noqa: E402

spaces = gym.spaces
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BOX = spaces.Box(-1.0, 1.0, (3,), np.float32)
DICT = spaces.Dict({"pos": spaces.Box(-1.0, 1.0, (2,), np.float32), "cell": spaces.Discrete(5)})
CASES = [
    (BOX, spaces.Discrete(3), 1),
    (BOX, spaces.Box(-1.0, 1.0, (2,), np.float64), 3),
    (spaces.Discrete(7), spaces.MultiDiscrete([2, 3]), 2),
    (DICT, spaces.Box(-1.0, 1.0, (2,), np.float32), 2),
]


def _random_step(rng: np.random.Generator, obs_space, action_space, n_envs: int):
    def obs():
        if isinstance(obs_space, spaces.Dict):
            return {k: np.stack([s.sample() for _ in range(n_envs)]) for k, s in obs_space.spaces.items()}
        return np.stack([obs_space.sample() for _ in range(n_envs)])

    done = rng.random(n_envs) < 0.3
    # as a VecEnv reports them: a time limit only on a step that ends an episode
    infos = [{"TimeLimit.truncated": bool(d and rng.random() < 0.5)} for d in done]
    for info, d in zip(infos, done):
        if d:
            info["terminal_observation"] = obs_space.sample()
    action = np.stack([action_space.sample() for _ in range(n_envs)])
    return obs(), obs(), action, rng.random(n_envs).astype(np.float32), done, infos


def _pair(tmp_path, obs_space, action_space, n_envs, handle_timeout=True, size=14):
    dict_obs = isinstance(obs_space, spaces.Dict)
    theirs = (sb3_buffers.DictReplayBuffer if dict_obs else sb3_buffers.ReplayBuffer)(
        size, obs_space, action_space, "cpu", n_envs=n_envs, handle_timeout_termination=handle_timeout
    )
    ours = (DictReplayBuffer if dict_obs else ReplayBuffer)(
        size,
        obs_space,
        action_space,
        "cpu",
        n_envs=n_envs,
        handle_timeout_termination=handle_timeout,
        path=tmp_path / "buf",
        commit_every=3,
    )
    return theirs, ours


def _add_both(theirs, ours, count: int, seed: int) -> None:
    """The same random steps (Box observations, Discrete(3) actions) into both buffers."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        step = _random_step(rng, BOX, spaces.Discrete(3), theirs.n_envs)
        theirs.add(*step)
        ours.add(*step)


def _without_log_folder(model):
    """``model`` logging nowhere: SB3's default logger makes an SB3-<date> folder in /tmp."""
    model.set_logger(Logger(None, []))
    return model


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    for name in a._fields:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, dict):
            assert x.keys() == y.keys()
            for k in x:
                assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (name, k)
                assert torch.equal(x[k], y[k]), (name, k)
        elif x is None:
            assert y is None, name
        else:
            assert x.dtype == y.dtype and x.shape == y.shape, (name, x.shape, y.shape)
            assert torch.equal(x, y), name


@pytest.mark.parametrize("handle_timeout", [True, False])
@pytest.mark.parametrize("obs_space,action_space,n_envs", CASES)
def test_same_adds_give_the_same_samples_as_sb3(tmp_path, obs_space, action_space, n_envs, handle_timeout):
    obs_space.seed(0)
    action_space.seed(0)
    theirs, ours = _pair(tmp_path, obs_space, action_space, n_envs, handle_timeout)
    rng = np.random.default_rng(0)
    for t in range(3 * theirs.buffer_size + 2):  # wraps the ring more than twice
        step = _random_step(rng, obs_space, action_space, n_envs)
        theirs.add(*step)
        ours.add(*step)
        assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size())
        if t % 5 == 4 or t < 3:
            inds = rng.integers(0, theirs.size(), 40)
            np.random.seed(t)
            expected = theirs._get_samples(inds)
            np.random.seed(t)
            _assert_same(expected, ours._get_samples(inds))
    np.testing.assert_array_equal(ours.dones, theirs.dones)
    np.testing.assert_array_equal(ours.timeouts, theirs.timeouts)
    np.testing.assert_array_equal(ours.rewards, theirs.rewards)
    np.testing.assert_array_equal(ours.actions, theirs.actions)
    ours.close()


def test_sample_draws_over_every_added_step_committed_or_not(tmp_path):
    theirs, ours = _pair(tmp_path, BOX, spaces.Discrete(3), 2, size=1000)
    rng = np.random.default_rng(1)
    for _ in range(5):  # 3 are committed by commit_every, 2 are not yet
        ours.add(*_random_step(rng, BOX, spaces.Discrete(3), 2))
    batch = ours.sample(256)
    assert (
        batch.observations.shape == (256, 3)
        and batch.dones.shape == (256, 1)
        and batch.rewards.shape == (256, 1)
    )
    assert ours.store.committed_steps == 3  # the writer draws from the steps not committed yet too
    stored = ours.store.get(slice(None))["observation"].reshape(-1, 3)
    drawn = {tuple(r) for r in batch.observations.numpy()}
    assert drawn <= {tuple(r) for r in stored} and len(drawn) == 10  # each of the 5 x 2 rows, no other
    ours.close()


def test_episodes_and_roles_see_what_sb3_collected(tmp_path):
    _, ours = _pair(tmp_path, BOX, spaces.Discrete(3), 1, size=100)
    obs = np.zeros((1, 3), np.float32)
    for t in range(6):
        done = np.array([t in (2, 5)])
        infos = [{"TimeLimit.truncated": t == 5}]
        ours.add(obs + t, obs + t + 1, np.array([1]), np.array([1.0]), done, infos)
    ours.close()
    store = mr.open(tmp_path / "buf")
    episodes = list(store.episodes())
    assert [(e.length, e.ended) for e in episodes] == [(3, "terminated"), (3, "truncated")]
    np.testing.assert_array_equal(episodes[1].data["next_observation"][:, 0], [4, 5, 6])
    store.close()


def test_reopening_the_folder_resumes_and_a_different_buffer_is_refused(tmp_path):
    theirs, ours = _pair(tmp_path, BOX, spaces.Discrete(3), 2)
    _add_both(theirs, ours, 9, seed=2)
    ours.close()
    again = ReplayBuffer(14, BOX, spaces.Discrete(3), "cpu", n_envs=2, path=tmp_path / "buf")
    assert (again.pos, again.full) == (theirs.pos, theirs.full)
    np.random.seed(0)
    expected = theirs._get_samples(np.arange(7))
    np.random.seed(0)
    _assert_same(expected, again._get_samples(np.arange(7)))
    again.close()
    with pytest.raises(mr.SpecMismatchError):
        ReplayBuffer(14, BOX, spaces.Discrete(4), "cpu", n_envs=2, path=tmp_path / "buf")


def test_reset_forgets_every_step_as_sb3_does(tmp_path):
    theirs, ours = _pair(tmp_path, BOX, spaces.Discrete(3), 2)
    _add_both(theirs, ours, 17, seed=3)
    theirs.reset()
    ours.reset()
    assert (ours.pos, ours.full, ours.size()) == (0, False, 0)
    _add_both(theirs, ours, 3, seed=4)
    ours.close()
    again = ReplayBuffer(14, BOX, spaces.Discrete(3), "cpu", n_envs=2, path=tmp_path / "buf")
    assert (again.pos, again.full) == (theirs.pos, theirs.full) == (3, False)
    np.random.seed(4)
    expected = theirs._get_samples(np.array([0, 1, 2, 2]))
    np.random.seed(4)
    _assert_same(expected, again._get_samples(np.array([0, 1, 2, 2])))
    assert len(again.store) == 3
    again.close()



def test_a_closed_buffer_says_it_is_closed_when_read(tmp_path):
    ours = ReplayBuffer(14, BOX, spaces.Discrete(3), "cpu", path=tmp_path / "buf")
    _add_both(sb3_buffers.ReplayBuffer(14, BOX, spaces.Discrete(3), "cpu"), ours, 5, seed=1)
    ours.close()
    for read in (lambda: ours.sample(2), lambda: ours.observations, lambda: ours.dones, ours.size):
        with pytest.raises(mr.ClosedError, match="buf: store is closed"):
            read()
    ours.close()  # a second close is still fine


def test_pos_and_full_set_by_hand_as_sb3_code_does(tmp_path):
    theirs, ours = _pair(tmp_path, BOX, spaces.Discrete(3), 1, size=10)
    _add_both(theirs, ours, 4, seed=6)
    for buffer in (theirs, ours):
        buffer.full = True  # every index counts: those never written are zeros
    assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size()) == (4, True, 10)
    _assert_same_rows(theirs, ours, np.arange(10), seed=1)
    np.testing.assert_array_equal(ours.observations, theirs.observations)
    with pytest.raises(ValueError, match="read-only"):
        ours.observations[0, 0] = 1.0
    for buffer in (theirs, ours):
        buffer.full, buffer.pos = False, 0  # forget every step, as SB3 code resets a buffer
    assert ours.size() == theirs.size() == 0
    _add_both(theirs, ours, 3, seed=7)
    assert (ours.pos, ours.full, ours.size()) == (theirs.pos, theirs.full, theirs.size()) == (3, False, 3)
    _assert_same_rows(theirs, ours, np.arange(3), seed=2)
    ours.close()

class _Trajectories:
    """Steps whose next observation is the next step's observation, as a VecEnv makes them:
    an env that ends an episode reports its terminal observation in ``next_obs`` and
    starts the next episode from a reset observation."""

    def __init__(self, n_envs: int, seed: int, shape=(3,), dtype=np.float32, end=0.3):
        self.rng = np.random.default_rng(seed)
        self.n_envs, self.shape, self.dtype, self.end = n_envs, shape, dtype, end
        self.obs = self._draw()

    def _draw(self):
        if self.dtype == np.uint8:
            return self.rng.integers(0, 255, (self.n_envs, *self.shape), dtype=np.uint8)
        return self.rng.uniform(-1, 1, (self.n_envs, *self.shape)).astype(self.dtype)

    def step(self):
        obs, next_obs = self.obs, self._draw()
        done = self.rng.random(self.n_envs) < self.end
        infos = [{"TimeLimit.truncated": bool(d and self.rng.random() < 0.5)} for d in done]
        self.obs = np.where(done.reshape(-1, *[1] * len(self.shape)), self._draw(), next_obs)
        action = self.rng.integers(0, 3, (self.n_envs,))
        return obs, next_obs, action, self.rng.random(self.n_envs).astype(np.float32), done, infos


@pytest.mark.parametrize("handle_timeout", [False, True])
@pytest.mark.parametrize("n_envs", [1, 3])
def test_optimize_memory_usage_stores_each_observation_once_and_keeps_timeouts_right(
    tmp_path, n_envs, handle_timeout
):
    """Against SB3's full-memory buffer: equal in every field, terminal observations and
    timeouts included. Against SB3's own memory-saving buffer (which refuses timeouts):
    equal except the next observation of a step that ended an episode, which SB3's
    overwrites with the next episode's reset observation."""
    size = 14
    kw = dict(device="cpu", n_envs=n_envs)
    full = sb3_buffers.ReplayBuffer(size, BOX, spaces.Discrete(3), handle_timeout_termination=handle_timeout, **kw)
    saving = sb3_buffers.ReplayBuffer(
        size, BOX, spaces.Discrete(3), optimize_memory_usage=True, handle_timeout_termination=False, **kw
    )
    ours = ReplayBuffer(
        size, BOX, spaces.Discrete(3), optimize_memory_usage=True, handle_timeout_termination=handle_timeout,
        path=tmp_path / "buf", commit_every=4, final_slots=200, **kw,
    )
    assert "next_observation" not in [leaf.path for leaf in ours.store.metadata.leaves]
    steps = _Trajectories(n_envs, seed=n_envs)
    rng = np.random.default_rng(0)
    for t in range(3 * full.buffer_size + 2):  # wraps the ring more than twice
        step = steps.step()
        for buffer in (full, saving, ours):
            buffer.add(*step)
        assert (ours.pos, ours.full, ours.size()) == (full.pos, full.full, full.size())
        if t % 4 == 3 or t < 3:
            valid = [i for i in range(full.size()) if not (full.full and i == full.pos)]  # SB3's rule
            inds = rng.choice(valid, 40)
            np.random.seed(t)
            expected = full._get_samples(inds)
            np.random.seed(t)
            got = ours._get_samples(inds)
            _assert_same(expected, got)
            if not handle_timeout:
                np.random.seed(t)
                theirs = saving._get_samples(inds)
                ended = theirs.dones.numpy()[:, 0] > 0
                for name in ("observations", "actions", "dones", "rewards"):
                    assert torch.equal(getattr(theirs, name), getattr(got, name)), name
                assert torch.equal(theirs.next_observations[~ended], got.next_observations[~ended])
    ours.close()
    again = ReplayBuffer(  # resumed: the newest step's next observation too
        size, BOX, spaces.Discrete(3), optimize_memory_usage=True, handle_timeout_termination=handle_timeout,
        path=tmp_path / "buf", final_slots=200, **kw,
    )
    _assert_same_rows(full, again, np.arange(full.size()), seed=1)
    again.close()


def test_optimize_memory_usage_keeps_every_step_when_committing_often(tmp_path, caplog):
    """Each commit keeps the newest step's next observations in the side ring: the default
    ``final_slots`` makes room for those of a ring's worth of commits, so few episode
    ends drop no step, and the folder reopens with another ``commit_every``."""
    full = sb3_buffers.ReplayBuffer(64, BOX, spaces.Discrete(3), "cpu", n_envs=2)
    kw = dict(device="cpu", n_envs=2, optimize_memory_usage=True, path=tmp_path / "buf")
    ours = ReplayBuffer(64, BOX, spaces.Discrete(3), commit_every=1, **kw)
    steps = _Trajectories(2, seed=3, end=0.02)
    with caplog.at_level("WARNING", logger="mmreplay"):
        for _ in range(100):
            step = steps.step()
            full.add(*step)
            ours.add(*step)
        ours.sample(4)
    assert not [r for r in caplog.records if "side ring" in r.getMessage()]
    assert (ours.pos, ours.full, ours.size()) == (full.pos, full.full, full.size())
    _assert_same_rows(full, ours, np.arange(full.size()), seed=1)
    ours.close()
    again = ReplayBuffer(64, BOX, spaces.Discrete(3), **kw)
    _assert_same_rows(full, again, np.arange(full.size()), seed=2)
    again.close()


def test_optimize_memory_usage_with_frame_stacks_stores_one_frame_per_step(tmp_path):
    """VecFrameStack's stacks (channels first, zeros before an episode's first frame)."""
    pixels = spaces.Box(0, 255, (4, 6, 5), np.uint8)
    full = sb3_buffers.ReplayBuffer(20, pixels, spaces.Discrete(3), "cpu", n_envs=2)
    ours = ReplayBuffer(
        20, pixels, spaces.Discrete(3), "cpu", n_envs=2, optimize_memory_usage=True, frame_stack=4,
        path=tmp_path / "buf", final_slots=100,
    )
    frames = _Trajectories(2, seed=5, shape=(6, 5), dtype=np.uint8)
    stacks = np.zeros((2, 4, 6, 5), np.uint8)
    stacks[:, -1] = frames.obs
    for _ in range(25):
        _, frame, action, reward, done, infos = frames.step()
        next_stacks = np.concatenate([stacks[:, 1:], frame[:, None]], axis=1)
        for buffer in (full, ours):
            buffer.add(stacks, next_stacks, action, reward, done, infos)
        stacks = next_stacks.copy()
        stacks[done] = 0
        stacks[done, -1] = frames.obs[done]
    assert [leaf.spec.shape for leaf in ours.store.metadata.leaves if leaf.path == "observation"] == [(6, 5)]
    first, end = ours.store.window[:2]
    _assert_same_rows(full, ours, (np.arange(first, end) - ours._origin) % ours.buffer_size, seed=2)
    ours.close()


def test_resuming_with_another_optimize_memory_usage_or_frame_stack_is_refused(tmp_path):
    """docs/sb3.md: both ways, and the folder is left as it was (without optimize_memory_usage the
    store took the folder's frames layout, its dropped steps included, as if asked for)."""
    pixels = spaces.Box(0, 255, (4, 6, 5), np.uint8)
    kw = dict(device="cpu", n_envs=2, path=tmp_path / "buf")
    ReplayBuffer(20, pixels, spaces.Discrete(3), optimize_memory_usage=True, frame_stack=4, **kw).close()
    before = _tree(tmp_path / "buf")
    with pytest.raises(mr.SpecMismatchError, match="optimize_memory_usage=True .*frame_stack=4"):
        ReplayBuffer(20, pixels, spaces.Discrete(3), **kw)
    with pytest.raises(mr.SpecMismatchError, match="frame_stack"):
        ReplayBuffer(20, pixels, spaces.Discrete(3), optimize_memory_usage=True, **kw)
    assert _tree(tmp_path / "buf") == before
    ReplayBuffer(20, pixels, spaces.Discrete(3), optimize_memory_usage=True, frame_stack=4, **kw).close()
    ReplayBuffer(20, pixels, spaces.Discrete(3), path=tmp_path / "plain", device="cpu", n_envs=2).close()
    with pytest.raises(mr.SpecMismatchError, match="frames: existing None"):
        ReplayBuffer(20, pixels, spaces.Discrete(3), optimize_memory_usage=True, path=tmp_path / "plain", n_envs=2)


def _tree(folder) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _assert_same_rows(theirs, ours, inds, seed: int) -> None:
    """``_get_samples(inds)`` of both, with the same envs drawn."""
    np.random.seed(seed)
    expected = theirs._get_samples(inds)
    np.random.seed(seed)
    _assert_same(expected, ours._get_samples(inds))


def test_dqn_trains_saves_a_small_manifest_and_loads_it(tmp_path):
    from stable_baselines3 import DQN

    env = gym.make("CartPole-v1")
    kwargs = {"path": tmp_path / "buf", "commit_every": 50}
    model = DQN(
        "MlpPolicy",
        env,
        buffer_size=100_000,
        learning_starts=200,
        train_freq=4,
        seed=0,
        replay_buffer_class=ReplayBuffer,
        replay_buffer_kwargs=kwargs,
    )
    _without_log_folder(model).learn(1500)
    assert model.replay_buffer.pos == 1500 and model.replay_buffer.store.committed_steps >= 1450
    model.save_replay_buffer(tmp_path / "rb.pkl")
    assert os.path.getsize(tmp_path / "rb.pkl") < 1_000_000
    assert model.replay_buffer.store.committed_steps == 1500
    saved = model.replay_buffer.store.get(slice(None))
    model.load_replay_buffer(tmp_path / "rb.pkl")
    assert isinstance(model.replay_buffer, ReplayBuffer) and model.replay_buffer.pos == 1500
    np.testing.assert_array_equal(
        model.replay_buffer.store.get(slice(None))["observation"], saved["observation"]
    )
    model.learn(300, reset_num_timesteps=False)
    assert model.replay_buffer.pos == 1800
    store = mr.open(tmp_path / "buf")  # a reader beside the writer
    assert len(list(store.episodes())) > 10
    store.close()
    model.replay_buffer.close()


def test_sac_trains_with_a_dict_observation(tmp_path):
    from stable_baselines3 import SAC

    class GoalPendulum(gym.ObservationWrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = spaces.Dict(
                {"state": env.observation_space, "goal": spaces.Box(-1, 1, (1,))}
            )

        def observation(self, obs):
            return {"state": obs, "goal": np.zeros(1, np.float32)}

    env = GoalPendulum(gym.make("Pendulum-v1"))
    model = SAC(
        "MultiInputPolicy",
        env,
        buffer_size=5000,
        learning_starts=200,
        batch_size=32,
        train_freq=8,
        seed=0,
        policy_kwargs={"net_arch": [32, 32]},
        replay_buffer_class=DictReplayBuffer,
        replay_buffer_kwargs={"path": tmp_path / "buf"},
    )
    _without_log_folder(model).learn(1000)
    assert model.replay_buffer.pos == 1000
    model.replay_buffer.close()
    store = mr.open(tmp_path / "buf")
    assert store.committed_steps == 1000 and store.roles["truncated"] == "truncated"
    assert store.get(slice(None))["truncated"].sum() == 5  # Pendulum's 200-step time limit
    store.close()


WRITER = textwrap.dedent(
    """
    import os, sys, numpy as np, gymnasium as gym
    from mmreplay.compat.sb3 import ReplayBuffer
    box = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    rb = ReplayBuffer(40, box, gym.spaces.Discrete(3), "cpu", n_envs=2, path=sys.argv[1], commit_every=7)
    start = rb.store.total_steps
    for t in range(start, start + 1_000_000):
        obs = np.full((2, 3), t, np.float32)
        rb.add(obs, obs + 1, np.array([t % 3, 1]), np.array([t, t]), np.array([t % 9 == 8] * 2), [{}, {}])
        if t == start + 50:
            print("ready", flush=True)
    """
)


def test_a_run_killed_with_sigkill_resumes_with_every_committed_step(tmp_path, writers):
    path = str(tmp_path / "buf")
    writers.kill_when(writers.start(WRITER, path), lambda line: line.strip() == "ready")
    reader = mr.open(path)
    committed = reader.committed_steps
    retained = reader.get(slice(None))
    first = reader.first_step
    reader.close()
    rb = ReplayBuffer(40, BOX, spaces.Discrete(3), "cpu", n_envs=2, path=path)
    assert rb.store.total_steps == committed and committed - first < 20  # the dead run's reserved slots are lost
    # SB3's indices cover the steps retained, the oldest at index 0: no index names a lost one
    assert (rb.pos, rb.full, rb.size()) == (committed - first, False, committed - first)
    got = rb.store.get(slice(None))
    for key in retained:
        np.testing.assert_array_equal(got[key], retained[key])
    np.random.seed(0)
    batch = rb._get_samples(np.arange(rb.size()))
    np.testing.assert_array_equal(batch.observations[:, 0].numpy(), np.arange(first, committed))
    assert set(rb.sample(500).observations[:, 0].tolist()) == set(range(first, committed))
    rb.close()


def test_pickle_names_the_folder_and_stays_small_for_any_size(tmp_path):
    pixels = spaces.Box(0, 255, (84, 84, 4), np.uint8)
    rb = ReplayBuffer(40_000, pixels, spaces.Discrete(4), "cpu", path=tmp_path / "big")
    frame = np.zeros((1, 84, 84, 4), np.uint8)
    for _ in range(10):
        rb.add(frame, frame + 1, np.array([2]), np.array([0.5]), np.array([False]), [{}])
    blob = pickle.dumps(rb)
    assert len(blob) < 1_000_000 and b"mmreplay.compat.sb3" in blob
    restored = pickle.loads(blob)  # takes the folder over from rb
    assert rb.store is None and restored.pos == 10 and restored.store.committed_steps == 10
    with pytest.raises(mr.BadInputError, match="closed"):
        rb.add(frame, frame, np.array([2]), np.array([0.5]), np.array([False]), [{}])
    restored.close()


def test_a_manifest_loaded_in_the_process_that_saved_it_goes_on_with_its_episodes(tmp_path):
    """As SB3's ``load_replay_buffer`` mid-run: the episodes the envs are in go on, no time
    limit is marked where the manifest was saved (a false episode end in the batches)."""
    theirs, ours = _pair(tmp_path, BOX, spaces.Discrete(3), 2, handle_timeout=False)
    rng = np.random.default_rng(0)
    for _ in range(5):
        obs, nxt, action, reward, _, infos = _random_step(rng, BOX, spaces.Discrete(3), 2)
        theirs.add(obs, nxt, action, reward, np.zeros(2, bool), [{}, {}])
        ours.add(obs, nxt, action, reward, np.zeros(2, bool), [{}, {}])
    ours = pickle.loads(pickle.dumps(ours))
    _add_both(theirs, ours, 3, seed=1)
    np.testing.assert_array_equal(ours.dones, theirs.dones)
    np.random.seed(0)
    expected = theirs._get_samples(np.arange(7))
    np.random.seed(0)
    _assert_same(expected, ours._get_samples(np.arange(7)))
    ours.close()


def test_a_temporary_buffer_loaded_in_the_process_that_saved_it_keeps_its_folder(tmp_path):
    import gc

    rb = ReplayBuffer(10, BOX, spaces.Discrete(3), "cpu")
    _add_both(sb3_buffers.ReplayBuffer(10, BOX, spaces.Discrete(3), "cpu"), rb, 4, seed=0)
    with pytest.warns(UserWarning, match="temporary folder"):
        blob = pickle.dumps(rb)
    loaded = pickle.loads(blob)
    folder = os.path.dirname(loaded.store.path)
    del rb  # as load_replay_buffer drops the buffer it replaces
    gc.collect()
    _add_both(sb3_buffers.ReplayBuffer(10, BOX, spaces.Discrete(3), "cpu"), loaded, 2, seed=1)
    loaded.store.commit()
    assert loaded.size() == 6
    loaded.close()
    assert not os.path.exists(folder)  # removed with the buffer that holds it now


def test_a_manifest_loaded_after_its_buffer_was_closed_reopens_the_folder(tmp_path):
    # save_replay_buffer, close the buffer, load_replay_buffer in the same process: the closed
    # buffer still named the folder, and its closed store was taken over (ClosedError)
    rb = ReplayBuffer(10, BOX, spaces.Discrete(3), "cpu", path=tmp_path / "buf")
    theirs = sb3_buffers.ReplayBuffer(10, BOX, spaces.Discrete(3), "cpu")
    _add_both(theirs, rb, 4, seed=0)
    blob = pickle.dumps(rb)
    rb.close()
    with pickle.loads(blob) as loaded:
        assert (loaded.size(), loaded.pos) == (4, 4)
        np.testing.assert_array_equal(loaded.observations[:4], theirs.observations[:4])
        _add_both(theirs, loaded, 2, seed=1)
        assert loaded.size() == 6


def test_a_manifest_whose_folder_is_gone_is_refused_and_nothing_is_made(tmp_path):
    rb = ReplayBuffer(10, BOX, spaces.Discrete(3), "cpu", path=tmp_path / "buf")
    _add_both(sb3_buffers.ReplayBuffer(10, BOX, spaces.Discrete(3), "cpu"), rb, 4, seed=0)
    blob = pickle.dumps(rb)
    rb.close()
    os.rename(tmp_path / "buf", tmp_path / "moved")  # the run folder moved, or another machine
    with pytest.raises(mr.NotABufferError, match="buf"):
        pickle.loads(blob)  # not an empty buffer that SB3 would train on
    assert sorted(os.listdir(tmp_path)) == ["moved"]


def test_a_manifest_over_a_folder_of_other_spaces_is_refused(tmp_path):
    rb = ReplayBuffer(10, BOX, spaces.Discrete(3), "cpu", path=tmp_path / "buf")
    blob = pickle.dumps(rb)
    rb.close()
    shutil.rmtree(tmp_path / "buf")  # the folder made again for Discrete(4) actions: the same leaves
    ReplayBuffer(10, BOX, spaces.Discrete(4), "cpu", path=tmp_path / "buf").close()
    with pytest.raises(mr.SpecMismatchError, match="Discrete"):
        pickle.loads(blob)


def test_a_prioritized_sample_follows_the_priorities_sent_back(tmp_path):
    rb = ReplayBuffer(
        100, BOX, spaces.Discrete(3), "cpu", n_envs=2, path=tmp_path / "buf", sampler="prioritized", alpha=1.0
    )
    _add_both(sb3_buffers.ReplayBuffer(100, BOX, spaces.Discrete(3), "cpu", n_envs=2), rb, 10, seed=5)
    batch = rb.sample(64, beta=0.5)
    info = rb.last_info
    assert batch.observations.shape == (64, 3) and info.weight.shape == (64,)
    stored = rb.store.get(slice(None))["observation"]
    np.testing.assert_array_equal(batch.observations.numpy(), stored[info.step, info.env])
    priorities = np.where((info.step == 7) & (info.env == 1), 1000.0, 1e-3)
    assert rb.update_priorities(priorities) == 64
    if not ((info.step == 7) & (info.env == 1)).any():  # (7, 1) was not drawn: set it alone
        rb.store.update_priorities(np.array([7]), np.array([1]), np.array([1000.0]))
    rb.sample(256)
    hot = (rb.last_info.step == 7) & (rb.last_info.env == 1)
    assert hot.mean() > 0.5  # the others weigh at most 19 x 1 (new rows) against 1000
    rb.close()
    again = ReplayBuffer(100, BOX, spaces.Discrete(3), "cpu", n_envs=2, path=tmp_path / "buf")
    assert again.store.sampler.name == "prioritized"  # priorities and sampler come back with the folder
    assert again.store.sampler.priorities(np.array([7]), np.array([1]))[0] >= 1000.0
    again.close()


def test_the_prioritized_dqn_example_trains_and_keeps_its_priorities(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        from sb3_prioritized_dqn import PrioritizedDQN
    finally:
        sys.path.pop(0)
    model = PrioritizedDQN(
        "MlpPolicy",
        gym.make("CartPole-v1"),
        buffer_path=tmp_path / "buf",
        buffer_size=10_000,
        learning_starts=200,
        train_freq=4,
        seed=0,
    )
    _without_log_folder(model).learn(1000)
    rb = model.replay_buffer
    assert rb.pos == 1000 and rb.last_info.weight is not None
    values = rb.store.sampler.priorities(np.arange(1000), np.zeros(1000, np.int64))
    assert len(np.unique(values)) > 100  # TD errors came back for the rows drawn
    rb.close()


def _run_in_own_tmp(args: list[str], tmp: str):
    """Run ``args`` with ``tmp`` as its temporary folder, and return it listed before and after."""
    os.makedirs(tmp, exist_ok=True)
    before = sorted(os.listdir(tmp))
    # torch keeps one compile cache per user in <temporary folder>/torchinductor_<user>,
    # reused by every run: kept out of the listing (this checks per-run folders)
    env = {**os.environ, "TMPDIR": tmp, "TORCHINDUCTOR_CACHE_DIR": tmp + "-torch-cache"}
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return before, sorted(os.listdir(tmp))


def test_the_prioritized_dqn_example_leaves_nothing_in_the_temporary_folder(tmp_path):
    example = os.path.join(ROOT, "examples", "sb3_prioritized_dqn.py")
    # both runs in one process (torch's and SB3's imports take most of a run): with a
    # buffer folder, then with none ([] keeps the buffer in a temporary folder); the
    # folder is listed after the process ended, so whatever either run left is seen
    runs = [["--steps", "300", "--buffer", str(tmp_path / "buf")], ["--steps", "300"]]
    code = f"import runpy; main = runpy.run_path({example!r})['main']\nfor argv in {runs!r}: main(argv)"
    before, after = _run_in_own_tmp([sys.executable, "-c", code], str(tmp_path / "tmp"))
    assert after == before == []
    store = mr.open(tmp_path / "buf")
    assert store.committed_steps == 300
    store.close()


def test_the_cleanrl_example_stores_every_transition_and_no_reset_step(tmp_path):
    before, after = _run_in_own_tmp(
        [
            sys.executable,
            os.path.join(ROOT, "examples", "cleanrl_dqn.py"),
            "--total-timesteps",
            "600",
            "--learning-starts",
            "100",
            "--buffer-path",
            str(tmp_path / "buf"),
        ],
        str(tmp_path / "tmp"),
    )
    assert after == before == []
    store = mr.open(tmp_path / "buf")
    rows = {k: v[:, 0] for k, v in store.get(slice(None)).items()}
    episodes = store.episode_index()
    store.close()
    ends = rows["terminated"] | rows["truncated"]
    # each of the 600 env steps is stored but the resets after an episode ended (after the
    # last stored row too, when its episode ended before the 600th step)
    assert 600 - ends.sum() <= len(rows["reward"]) <= 600 - ends[:-1].sum() and len(episodes) >= 5
    assert (rows["reward"] == 1.0).all()  # CartPole's reward: a reset step would store 0
    following = rows["observation"][1:] == rows["next_observation"][:-1]
    # a transition's next observation is the next one's observation, except across an
    # episode end, where the next transition starts from the reset observation
    np.testing.assert_array_equal(following.all(axis=1), ~ends[:-1])
    assert all(e.ended != "running" for e in episodes[:-1])

# --- seeding: the drop-in draws what SB3's buffer draws --------------------------------


@pytest.mark.parametrize("optimize_memory_usage", [False, True])
@pytest.mark.parametrize("n_envs,adds", [(1, 9), (1, 31), (2, 17)])  # before and after the ring fills
def test_sample_draws_what_sb3s_buffer_draws_for_the_same_seed(tmp_path, optimize_memory_usage, n_envs, adds):
    kw = dict(device="cpu", n_envs=n_envs, optimize_memory_usage=optimize_memory_usage, handle_timeout_termination=False)
    theirs = sb3_buffers.ReplayBuffer(20 * n_envs, BOX, spaces.Discrete(3), **kw)
    ours = ReplayBuffer(20 * n_envs, BOX, spaces.Discrete(3), path=tmp_path / "buf", final_slots=200, **kw)
    rng = np.random.default_rng(adds)
    obs = rng.uniform(-1, 1, (n_envs, 3)).astype(np.float32)
    for _ in range(adds):  # no episode ends: SB3's memory-saving buffer loses terminal observations
        nxt = rng.uniform(-1, 1, (n_envs, 3)).astype(np.float32)
        step = obs, nxt, rng.integers(0, 3, n_envs), rng.random(n_envs).astype(np.float32), np.zeros(n_envs, bool)
        theirs.add(*step, [{}] * n_envs)
        ours.add(*step, [{}] * n_envs)
        obs = nxt
    for seed in range(3):
        np.random.seed(seed)
        expected, after_theirs = theirs.sample(64), np.random.randint(1 << 30)
        np.random.seed(seed)
        got, after_ours = ours.sample(64), np.random.randint(1 << 30)
        _assert_same(expected, got)
        assert after_ours == after_theirs  # the same draws from np.random, no more
    ours.close()


def _dqn(tmp_path, name: str, buffer_class=None, **kw):
    from stable_baselines3 import DQN

    options = {} if buffer_class is None else {
        "replay_buffer_class": buffer_class, "replay_buffer_kwargs": {"path": tmp_path / name},
    }
    model = DQN(
        "MlpPolicy", gym.make("CartPole-v1"), buffer_size=5000, learning_starts=100, train_freq=4,
        target_update_interval=100, policy_kwargs={"net_arch": [16]}, seed=0, **options, **kw,
    )
    return _without_log_folder(model)


def _weights(model) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.policy.parameters()]


def test_seeded_dqn_runs_train_the_same_weights_as_with_sb3s_buffer(tmp_path):
    runs = []
    for name, buffer_class in (("a", ReplayBuffer), ("b", ReplayBuffer), ("sb3", None)):
        model = _dqn(tmp_path, name, buffer_class)
        model.learn(400)
        runs.append(_weights(model))
        if buffer_class is not None:
            model.replay_buffer.close()
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            np.testing.assert_array_equal(x, y)


def test_two_runs_resumed_from_the_same_folder_and_seed_train_the_same_weights(tmp_path):
    from stable_baselines3 import DQN

    model = _dqn(tmp_path, "buf", ReplayBuffer)
    model.learn(300)
    model.save(tmp_path / "model.zip")
    model.replay_buffer.close()
    runs = []
    for copy in ("one", "two"):
        shutil.copytree(tmp_path / "buf", tmp_path / copy)
        resumed = DQN.load(
            tmp_path / "model.zip", env=gym.make("CartPole-v1"), seed=0,
            custom_objects={"replay_buffer_kwargs": {"path": tmp_path / copy}},
        )
        assert resumed.replay_buffer.size() == 300
        _without_log_folder(resumed).learn(300, reset_num_timesteps=False)
        runs.append(_weights(resumed))
        resumed.replay_buffer.close()
    for x, y in zip(*runs):
        np.testing.assert_array_equal(x, y)


# --- SB3's own buffer tests, run against the drop-in -----------------------------------

SB3_TESTS = "tests/test_buffers.py"


def _sb3_test_file(cache: str, test: str = SB3_TESTS, drop_ins: str = "DictReplayBuffer, ReplayBuffer") -> str:
    """SB3's ``test`` (``tests/test_buffers.py``) from the installed version's sdist on PyPI
    (downloaded once into ``cache``), with the buffers ``drop_ins`` imported from the
    drop-in instead: the one change."""
    import importlib.metadata
    import tarfile
    import tempfile

    version = importlib.metadata.version("stable_baselines3")
    os.makedirs(cache, exist_ok=True)
    sdist = [f for f in os.listdir(cache) if f.endswith(".tar.gz") and version in f]
    if not sdist:
        # into a folder of its own, then renamed in whole: runs beside this one (test
        # workers) share the cache and must never open a half-downloaded file
        with tempfile.TemporaryDirectory(dir=cache) as part:
            got = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                 f"stable-baselines3=={version}", "-d", part],
                capture_output=True, text=True, timeout=300,
            )
            for name in os.listdir(part):
                os.replace(os.path.join(part, name), os.path.join(cache, name))
        sdist = [f for f in os.listdir(cache) if f.endswith(".tar.gz") and version in f]
        if got.returncode != 0 or not sdist:
            pytest.skip(f"cannot download the stable-baselines3 {version} sdist from PyPI: {got.stderr[-300:]}")
    with tarfile.open(os.path.join(cache, sdist[0])) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + test))
        source = tar.extractfile(member).read().decode()
    line = next(x for x in source.splitlines() if x.startswith("from stable_baselines3.common.buffers import"))
    return source.replace(line, line + f"\nfrom mmreplay.compat.sb3 import {drop_ins}", 1)


def test_sb3s_own_buffer_tests_pass_against_the_drop_in(tmp_path):
    import tempfile
    import xml.etree.ElementTree as ET

    (tmp_path / "test_buffers.py").write_text(_sb3_test_file(os.path.join(tempfile.gettempdir(), "mmreplay-sb3-sdist")))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's configuration
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ONLY_HYPOTHESIS, "--junitxml=report.xml", "test_buffers.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=no_plugins(),
    )
    suite = ET.parse(tmp_path / "report.xml").getroot().find("testsuite")
    counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
    cuda = 4 if torch.cuda.is_available() else 0  # SB3's tests on the "cuda" device
    assert counts == {"tests": 83, "failures": 0, "errors": 0, "skipped": 4 - cuda}, out.stdout[-3000:]
