"""gymnasium layer: the transition spec, and recorders on real envs and vector envs."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

gymnasium = pytest.importorskip("gymnasium")

from conftest import folder_digest  # noqa: E402

import mmreplay as mr  # noqa: E402
from mmreplay.compat.gymnasium import (  # noqa: E402
    RecordTransitions,
    RecordVectorTransitions,
    spec_from_spaces,
)

spaces = gymnasium.spaces
KEYS = ["action", "next_observation", "observation", "reward", "terminated", "truncated"]


def reference_single(env_id, seed, actions):
    """Transitions of a plain env driven the same way: reset on every episode end."""
    env = gymnasium.make(env_id)
    obs, _ = env.reset(seed=seed)
    out = []
    for a in actions:
        nxt, r, te, tr, _ = env.step(a)
        out.append((obs, a, r, te, tr, nxt))
        obs = nxt
        if te or tr:
            obs, _ = env.reset()
    env.close()
    return out


def drive_single(env, seed, actions):
    env.reset(seed=seed)
    for a in actions:
        _, _, te, tr, _ = env.step(a)
        if te or tr:
            env.reset()


def rows(store, env=0):
    """Every retained row of one env, as a dict of arrays in time order."""
    if store.mode == "a":
        store.commit()
    got = store.get(slice(None))
    return {k: np.asarray(got[k])[:, env] for k in KEYS}


def assert_rows_equal(got, ref, offset=0):
    n = len(got["reward"])
    ref = ref[offset : offset + n]
    assert len(ref) == n
    obs, act, rew, te, tr, nxt = (np.array([r[i] for r in ref]) for i in range(6))
    np.testing.assert_array_equal(got["observation"], obs)
    np.testing.assert_array_equal(got["action"], act)
    np.testing.assert_array_equal(got["reward"], rew.astype(np.float32))
    np.testing.assert_array_equal(got["terminated"], te)
    np.testing.assert_array_equal(got["truncated"], tr)
    np.testing.assert_array_equal(got["next_observation"], nxt)


# --- spec_from_spaces -----------------------------------------------------------------


def test_spec_from_spaces():
    spec, roles = spec_from_spaces(spaces.Box(-1, 1, (3,), np.float32), spaces.Discrete(4))
    assert sorted(spec) == KEYS
    assert spec["observation"] == spec["next_observation"] == mr.ArraySpec((3,), "float32")
    assert spec["action"] == mr.ArraySpec((), "int64")
    assert spec["reward"] == mr.ArraySpec((), "float32") and spec["terminated"] == mr.ArraySpec((), "bool")
    assert roles == {
        k: k for k in ["observation", "action", "reward", "terminated", "truncated", "next_observation"]
    }
    obs = spaces.Dict({"pos": spaces.Box(0, 1, (2,)), "img": spaces.Box(0, 255, (4, 4, 3), np.uint8)})
    spec, _ = spec_from_spaces(obs, spaces.MultiDiscrete([3, 5]), reward_dtype="float64")
    assert spec["observation"]["img"] == mr.ArraySpec((4, 4, 3), "uint8")
    assert spec["action"] == mr.ArraySpec((2,), "int64") and spec["reward"].dtype == np.float64
    with pytest.raises(mr.SpecError):
        spec_from_spaces(spaces.Text(5), spaces.Discrete(2))


def test_the_json_of_every_storable_space_gives_back_its_spec():
    from mmreplay.spaces import space_to_json, spec_from_space_json

    for space in [
        spaces.MultiDiscrete([[3, 4], [2, 2]]),
        spaces.MultiDiscrete([3, 4], dtype=np.int32, start=[1, -1]),
        spaces.MultiBinary((2, 3)),
        spaces.Discrete(5, start=-2),
        spaces.Discrete(5, dtype=np.int32),
        spaces.Box(np.zeros((2, 1), np.float16), np.ones((2, 1), np.float16), dtype=np.float16),
        spaces.Box(0, 1, (2,), dtype=np.bool_),
        spaces.Dict({"z": spaces.Discrete(3), "a": spaces.Tuple((spaces.Discrete(2), spaces.Box(0, 9, (), np.int16)))}),
    ]:
        assert spec_from_space_json(space_to_json(space), "obs") == mr.to_spec(space), space


def test_a_space_the_recorder_cannot_describe_is_refused_before_the_folder_is_made(tmp_path):
    class Shaped(spaces.Space):  # a fixed shape, so a spec, but no JSON for Minari
        def __init__(self):
            super().__init__((2,), np.float32)

    class OddEnv(gymnasium.Env):
        observation_space = Shaped()
        action_space = spaces.Discrete(2)

    with pytest.raises(TypeError, match="cannot describe Shaped"):
        RecordTransitions(OddEnv(), tmp_path / "b", capacity=10)
    OddEnv.observation_space = spaces.OneOf((spaces.Discrete(2), spaces.Box(0, 1, (2,))))
    with pytest.raises(mr.SpecError, match="OneOf space has no fixed shape"):
        RecordTransitions(OddEnv(), tmp_path / "b", capacity=10)
    assert not (tmp_path / "b").exists()


def test_values_the_store_refuses_are_refused_by_the_recorder_not_cast(tmp_path):
    class PixelEnv(gymnasium.Env):  # observations past its uint8 Box, as a buggy env gives
        observation_space = spaces.Box(0, 255, (2,), np.uint8)
        action_space = spaces.Discrete(3)

        def reset(self, *, seed=None, options=None):
            return np.array([0, 255]), {}

        def step(self, action):
            return np.array([300, -1]), 1.0, False, False, {}

    env = RecordTransitions(PixelEnv(), tmp_path / "b", capacity=10)
    env.reset()
    with pytest.raises(mr.BadInputError, match="leaf 'next_observation': values -1..300 do not fit uint8"):
        env.step(1)
    env.env.step = lambda action: (np.array([7, 8]), 1.0, False, False, {})
    with pytest.raises(mr.BadInputError, match="leaf 'action': casting float64 to int64 is not safe"):
        env.step(1.7)
    env.step(2)
    env.store.commit()
    got = env.store.get(slice(None))
    assert got["action"].tolist() == [[2]] and got["next_observation"].tolist() == [[[7, 8]]]
    env.close()


class CountEnv(gymnasium.Env):
    """Observations [t, t], past the uint8 Box at the steps in ``bad`` (as a buggy env gives)."""

    observation_space = spaces.Box(0, 255, (2,), np.uint8)
    action_space = spaces.Discrete(2)

    def __init__(self, bad=()):
        self.t, self.bad = 0, bad

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.array([0, 0], np.uint8), {}

    def step(self, action):
        self.t += 1
        return np.array([300 if self.t in self.bad else self.t] * 2), 1.0, False, False, {}


class CountEnvs(gymnasium.vector.VectorEnv):
    """Two CountEnvs stepped together."""

    metadata = {"autoreset_mode": gymnasium.vector.AutoresetMode.NEXT_STEP}

    def __init__(self, bad=()):
        self.envs, self.num_envs = [CountEnv(bad), CountEnv(bad)], 2
        self.single_observation_space, self.single_action_space = CountEnv.observation_space, CountEnv.action_space
        self.observation_space = gymnasium.vector.utils.batch_space(self.single_observation_space, 2)
        self.action_space = gymnasium.vector.utils.batch_space(self.single_action_space, 2)

    def reset(self, *, seed=None, options=None):
        return np.stack([e.reset()[0] for e in self.envs]), {}

    def step(self, actions):
        obs = np.stack([e.step(a)[0] for e, a in zip(self.envs, actions)])
        return obs, np.ones(2), np.zeros(2, bool), np.zeros(2, bool), {}


@pytest.mark.parametrize("vector", [False, True])
def test_a_refused_step_ends_the_episode_and_the_recorder_follows_the_env(tmp_path, vector):
    """A caller that catches the refusal and steps on records no transition joined across it."""
    recorder, made = (RecordVectorTransitions, CountEnvs) if vector else (RecordTransitions, CountEnv)
    env = recorder(made(bad=(3,)), tmp_path / "b", capacity=10)
    env.reset()
    action = [0, 0] if vector else 0
    for t in range(1, 6):
        try:
            env.step(action)
        except mr.BadInputError:
            assert t in (3, 4)  # the step to [300, 300], then the one from it
    got = rows(env.store)
    assert got["observation"][:, 0].tolist() == [0, 1, 4] and got["next_observation"][:, 0].tolist() == [1, 2, 5]
    assert got["truncated"].tolist() == [False, True, False]
    env.close()


class _TupleEnv(gymnasium.Env):
    """Tuple observations and actions; gymnasium's Tuple spaces take lists for them too."""

    observation_space = spaces.Tuple((spaces.Discrete(5), spaces.Box(-1, 1, (2,), np.float32)))
    action_space = spaces.Tuple((spaces.Discrete(3), spaces.Box(-1, 1, (2,), np.float32)))

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return [0, np.zeros(2, np.float32)], {}

    def step(self, action):
        assert self.action_space.contains(action)
        self.t += 1
        return [self.t, np.full(2, self.t / 10, np.float32)], 1.0, False, False, {}


def test_lists_for_tuple_spaces_are_recorded_as_gymnasium_takes_them(tmp_path):
    env = RecordTransitions(_TupleEnv(), tmp_path / "buf", capacity=8)
    env.reset()
    env.step([2, np.array([0.5, -0.5], np.float32)])
    env.step((1, np.zeros(2, np.float32)))
    got = env.store.get(slice(None))
    assert got["action"][0].tolist() == [[2], [1]]
    assert got["action"][1][:, 0].tolist() == [[0.5, -0.5], [0.0, 0.0]]
    assert got["observation"][0].tolist() == [[0], [1]] and got["next_observation"][0].tolist() == [[1], [2]]
    env.close()


# --- a single env ---------------------------------------------------------------------


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_single_env_records_every_transition_and_wraps(tmp_path, env_id):
    probe = gymnasium.make(env_id)
    probe.action_space.seed(0)
    actions = [probe.action_space.sample() for _ in range(450)]
    ref = reference_single(env_id, 3, actions)
    env = RecordTransitions(gymnasium.make(env_id), tmp_path / "b", capacity=300)
    drive_single(env, 3, actions)
    assert env.store.roles["next_observation"] == "next_observation" and env.store.num_envs == 1
    got = rows(env.store)
    assert len(got["reward"]) == 300 and env.store.total_steps == 450  # the ring kept the newest
    assert_rows_equal(got, ref, offset=150)
    ends = got["terminated"] | got["truncated"]
    assert ends.any()
    # inside an episode the next observation is the next row's observation
    np.testing.assert_array_equal(
        got["next_observation"][:-1][~ends[:-1]], got["observation"][1:][~ends[:-1]]
    )
    if env_id == "Pendulum-v1":
        assert got["truncated"].sum() >= 1 and not got["terminated"].any()  # time limit at 200 steps
    env.close()
    assert env.store.closed


def test_reset_mid_episode_marks_it_truncated_and_reopen_resumes(tmp_path):
    env = RecordTransitions(gymnasium.make("CartPole-v1"), tmp_path / "b", capacity=100, commit_every=3)
    env.reset(seed=0)
    for _ in range(4):
        env.step(0)
    env.reset()  # cuts the episode: its last transition becomes truncated
    env.step(1)
    got = rows(env.store)
    assert got["truncated"].tolist() == [False, False, False, True, False]
    env.close()
    env = RecordTransitions(gymnasium.make("CartPole-v1"), tmp_path / "b", capacity=100)
    assert env.store.total_steps == 5
    env.reset(seed=1)  # the previous process's open episode ends here
    env.step(0)
    got = rows(env.store)
    assert got["truncated"].tolist() == [False, False, False, True, True, False]
    env.close()
    with pytest.raises(mr.SpecMismatchError, match="spec"):
        RecordTransitions(gymnasium.make("Pendulum-v1"), tmp_path / "b", capacity=100)
    with pytest.raises(mr.SpecMismatchError, match="capacity"):
        RecordTransitions(gymnasium.make("CartPole-v1"), tmp_path / "b", capacity=50)
    with pytest.raises(ValueError, match="capacity="):
        RecordTransitions(gymnasium.make("CartPole-v1"), tmp_path / "new")


@pytest.mark.parametrize("setting", [{"compression": "zstd"}, {"backend": "hdf5"}, {"commit_every": 7},
                                     {"sampler": "prioritized"}, {"durability": "power"}])  # fmt: skip
def test_a_resume_with_another_store_setting_is_refused_and_changes_nothing(tmp_path, setting):
    path = tmp_path / "b"
    env = RecordTransitions(gymnasium.make("CartPole-v1"), path, capacity=100, commit_every=3)
    env.reset(seed=0)
    env.step(0)
    env.close()
    before = folder_digest(path)
    with pytest.raises(mr.SpecMismatchError, match=f"{next(iter(setting))}: existing"):
        RecordTransitions(gymnasium.make("CartPole-v1"), path, capacity=100, **setting)
    assert folder_digest(path) == before
    env = RecordTransitions(gymnasium.make("CartPole-v1"), path, commit_every=3)  # the buffer's own: resumed
    assert env.store.total_steps == 1
    env.close()


class DictEnv(gymnasium.Env):
    """A tiny deterministic env with a Dict observation and a Box action."""

    observation_space = spaces.Dict({"pos": spaces.Box(-10, 10, (2,), np.float32), "t": spaces.Discrete(100)})
    action_space = spaces.Box(-1, 1, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.pos, self.t = np.zeros(2, np.float32), 0
        return {"pos": self.pos.copy(), "t": self.t}, {}

    def step(self, action):
        self.pos = self.pos + action
        self.t += 1
        return {"pos": self.pos.copy(), "t": self.t}, float(self.t), self.t == 3, False, {}


def test_dict_observations_into_a_given_store(tmp_path):
    spec, roles = spec_from_spaces(DictEnv.observation_space, DictEnv.action_space)
    store = mr.create(tmp_path / "b", spec, capacity=20, roles=roles)
    env = RecordTransitions(DictEnv(), store)
    env.reset()
    for _ in range(3):
        env.step(np.ones(2, np.float32))
    env.close()
    assert not store.closed  # the caller's store stays open
    got = store.get(slice(None))
    assert got["observation"]["t"][:, 0].tolist() == [0, 1, 2] and got["next_observation"]["t"][
        :, 0
    ].tolist() == [1, 2, 3]
    assert got["next_observation"]["pos"][-1, 0].tolist() == [3, 3] and got["terminated"][:, 0].tolist() == [
        0,
        0,
        1,
    ]
    store.close()


# --- vector envs ----------------------------------------------------------------------


def reference_vector(n, seed, actions):
    """Per-env transitions of a plain next-step vector env, skipping autoreset steps."""
    env = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * n)
    obs, _ = env.reset(seed=seed)
    autoreset = np.zeros(n, bool)
    out = [[] for _ in range(n)]
    for a in actions:
        nxt, r, te, tr, _ = env.step(a)
        for i in range(n):
            if not autoreset[i]:
                out[i].append((obs[i], a[i], r[i], te[i], tr[i], nxt[i]))
        obs, autoreset = nxt, te | tr
    env.close()
    return out


def test_vector_env_final_observations_under_next_step_autoreset(tmp_path):
    n, steps = 3, 300
    rng = np.random.default_rng(5)
    actions = [rng.integers(0, 2, n) for _ in range(steps)]
    ref = reference_vector(n, 11, actions)
    venv = gymnasium.vector.SyncVectorEnv([lambda: gymnasium.make("CartPole-v1")] * n)
    assert "autoreset_mode" not in venv.metadata or "next" in str(venv.metadata["autoreset_mode"]).lower()
    venv = RecordVectorTransitions(venv, tmp_path / "v", capacity=1000)
    assert venv.autoreset_mode == "nextstep"
    venv.reset(seed=11)
    for a in actions:
        venv.step(a)
    written = venv.store.total_steps
    assert written == min(len(r) for r in ref)
    assert venv.waiting == sum(len(r) - written for r in ref) > 0
    for i in range(n):
        got = rows(venv.store, i)
        assert_rows_equal(got, ref[i])
        eps = list(venv.store.episodes(env=i))
        assert [ep.status for ep in eps[:-1]] == ["terminated"] * (len(eps) - 1)
        assert sum(ep.last_step - ep.first_step + 1 for ep in eps) == written
        assert len([ep for ep in eps if ep.status == "terminated"]) == int(got["terminated"].sum())
        ends = got["terminated"] | got["truncated"]
        assert ends.sum() >= 3
        # the row after an episode end starts from the reset observation, not the final one
        after = np.flatnonzero(ends[:-1]) + 1
        assert not (got["observation"][after] == got["next_observation"][after - 1]).all(axis=1).any()
    venv.close()


def test_vector_reset_marks_open_episodes_and_resume(tmp_path):
    n = 2
    venv = RecordVectorTransitions(gymnasium.make_vec("CartPole-v1", num_envs=n), tmp_path / "v", capacity=50)
    venv.reset(seed=0)
    for _ in range(3):
        venv.step(np.zeros(n, np.int64))
    venv.reset()
    venv.step(np.zeros(n, np.int64))
    venv.store.commit()
    got = venv.store.get(slice(None))
    assert got["truncated"].tolist() == [[False, False], [False, False], [True, True], [False, False]]
    venv.close()
    with pytest.raises(mr.SpecMismatchError, match="num_envs"):
        RecordVectorTransitions(gymnasium.make_vec("CartPole-v1", num_envs=3), tmp_path / "v")
    venv = RecordVectorTransitions(gymnasium.make_vec("CartPole-v1", num_envs=n), tmp_path / "v")
    venv.reset(seed=1)
    venv.step(np.ones(n, np.int64))
    venv.store.commit()
    got = venv.store.get(slice(None))
    assert got["truncated"][:, 0].tolist() == [False, False, True, True, False]
    venv.close()


def test_same_step_autoreset_takes_final_obs_from_info(tmp_path):
    mode = getattr(gymnasium.vector, "AutoresetMode", None)
    if mode is None:
        pytest.skip("gymnasium < 1.1 has only next-step autoreset")
    n = 2
    make = lambda: gymnasium.vector.SyncVectorEnv(  # noqa: E731
        [lambda: gymnasium.make("CartPole-v1")] * n, autoreset_mode=mode.SAME_STEP
    )
    venv = RecordVectorTransitions(make(), tmp_path / "v", capacity=500)
    assert venv.autoreset_mode == "samestep"
    venv.reset(seed=2)
    finals = []
    for _ in range(120):
        obs, _, te, tr, info = venv.step(np.zeros(n, np.int64))
        for i in np.flatnonzero(te | tr):
            finals.append((i, info["final_obs"][i]))
    assert finals and venv.waiting == 0
    venv.store.commit()
    got = venv.store.get(slice(None))
    ends = got["terminated"] | got["truncated"]
    for i in range(n):
        want = [f for j, f in finals if j == i]
        np.testing.assert_array_equal(got["next_observation"][ends[:, i], i], np.array(want))
    venv.close()


class CartPoles(gymnasium.vector.VectorEnv):
    """CartPoles stepped in a loop, with gymnasium 1.1's same-step or disabled autoreset."""

    def __init__(self, n, mode):
        self.metadata = {"autoreset_mode": mode}
        self.envs = [gymnasium.make("CartPole-v1") for _ in range(n)]
        self.num_envs = n
        self.single_observation_space = self.envs[0].observation_space
        self.single_action_space = self.envs[0].action_space
        self.observation_space = gymnasium.vector.utils.batch_space(self.single_observation_space, n)
        self.action_space = gymnasium.vector.utils.batch_space(self.single_action_space, n)
        self.obs = np.zeros((n, 4), np.float32)

    def reset(self, *, seed=None, options=None):
        mask = np.ones(self.num_envs, bool) if not options else np.asarray(options["reset_mask"])
        for i in np.flatnonzero(mask):
            self.obs[i], _ = self.envs[i].reset(seed=None if seed is None else int(seed + i))
        return self.obs.copy(), {}

    def step(self, actions):
        n = self.num_envs
        rew, te, tr = np.zeros(n), np.zeros(n, bool), np.zeros(n, bool)
        final, infos = np.full(n, None, object), {}
        for i, env in enumerate(self.envs):
            self.obs[i], rew[i], te[i], tr[i], _ = env.step(int(actions[i]))
            if (te[i] or tr[i]) and self.metadata["autoreset_mode"] == "SameStep":
                final[i] = self.obs[i].copy()
                self.obs[i], _ = env.reset()
        mask = np.array([f is not None for f in final])
        if mask.any():
            infos = {"final_obs": final, "_final_obs": mask}
        return self.obs.copy(), rew, te, tr, infos


def test_same_step_autoreset_takes_the_final_observation_from_info(tmp_path):
    venv = RecordVectorTransitions(CartPoles(2, "SameStep"), tmp_path / "v", capacity=500)
    assert venv.autoreset_mode == "samestep"
    venv.reset(seed=2)
    finals = {0: [], 1: []}
    for _ in range(100):
        obs, _, te, tr, info = venv.step(np.zeros(2, np.int64))
        for i in np.flatnonzero(te | tr):
            finals[i].append(info["final_obs"][i])
            assert not np.array_equal(obs[i], info["final_obs"][i])
    assert venv.waiting == 0 and venv.store.total_steps == 100  # every step is a transition of every env
    venv.store.commit()
    got = venv.store.get(slice(None))
    for i in range(2):
        ends = got["terminated"][:, i] | got["truncated"][:, i]
        assert ends.sum() == len(finals[i]) >= 5
        np.testing.assert_array_equal(got["next_observation"][ends, i], np.array(finals[i]))
        cont = ~ends[:-1]
        np.testing.assert_array_equal(got["next_observation"][:-1, i][cont], got["observation"][1:, i][cont])
    venv.close()


def _disabled_sync_cartpoles(n):
    """gymnasium's own SyncVectorEnv, whose reset pops ``reset_mask`` out of the options."""
    mode = getattr(gymnasium.vector, "AutoresetMode", None)
    if mode is None:
        pytest.skip("gymnasium < 1.1 has next-step autoreset only")
    return gymnasium.vector.SyncVectorEnv(
        [lambda: gymnasium.make("CartPole-v1")] * n, autoreset_mode=mode.DISABLED
    )


@pytest.mark.parametrize("make", [lambda n: CartPoles(n, "Disabled"), _disabled_sync_cartpoles])
def test_disabled_autoreset_takes_reset_observations_from_a_masked_reset(tmp_path, make):
    venv = RecordVectorTransitions(make(2), tmp_path / "v", capacity=500)
    assert venv.autoreset_mode == "disabled"
    obs, _ = venv.reset(seed=4)
    resets = 0
    for _ in range(80):
        obs, _, te, tr, _ = venv.step(np.ones(2, np.int64))
        if (te | tr).any():
            obs, _ = venv.reset(options={"reset_mask": te | tr})
            resets += 1
    assert resets >= 2 and venv.store.total_steps == 80
    venv.store.commit()
    got = venv.store.get(slice(None))
    for i in range(2):
        ends = got["terminated"][:, i] | got["truncated"][:, i]
        cont = ~ends[:-1]
        np.testing.assert_array_equal(got["next_observation"][:-1, i][cont], got["observation"][1:, i][cont])
        after = np.flatnonzero(ends[:-1]) + 1
        assert (np.abs(got["observation"][after, i]) < 0.05).all()  # a fresh CartPole state
    assert not got["truncated"].any()  # the masked resets cut no open episode
    venv.close()


# --- crash: SIGKILL of a real recording process --------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, numpy as np, gymnasium
    from mmreplay.compat.gymnasium import RecordVectorTransitions
    venv = RecordVectorTransitions(gymnasium.make_vec("CartPole-v1", num_envs=4), sys.argv[1],
                                   capacity=200, commit_every=5)
    venv.reset(seed=0)
    rng = np.random.default_rng(0)
    while True:
        venv.step(rng.integers(0, 2, 4))
        print(venv.store.committed_steps, flush=True)
    """
)


def test_recorder_survives_sigkill_and_resumes(tmp_path, writers):
    path = tmp_path / "v"
    committed = int(writers.kill_when(writers.start(WRITER, path), lambda line: int(line) >= 260))
    store = mr.open(path)
    assert store.committed_steps >= committed and len(store) > 0
    got = store.get(slice(None))
    for i in range(4):
        ends = got["terminated"][:, i] | got["truncated"][:, i]
        cont = ~ends[:-1]
        np.testing.assert_array_equal(got["next_observation"][:-1, i][cont], got["observation"][1:, i][cont])
    open_before = ~(got["terminated"][-1] | got["truncated"][-1])
    total = store.total_steps
    store.close()
    venv = RecordVectorTransitions(gymnasium.make_vec("CartPole-v1", num_envs=4), path)
    venv.reset(seed=9)
    venv.step(np.zeros(4, np.int64))
    assert venv.store.total_steps == total + 1
    venv.store.commit()
    last = venv.store.get(total - 1 - venv.store.first_step)
    assert (last["truncated"][open_before]).all()  # the cut episodes end where the crash cut them
    venv.close()
