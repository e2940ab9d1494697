"""What exports keep at the edges: terminals of ring-cut episodes, spaces, both flags,
leaves with no role, stores without a next observation, and every export importing back.
Each export is loaded by the tool it is for (minari, d3rlpy, h5py, pandas)."""

from __future__ import annotations

import collections
import gzip
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import make_step

import mmreplay as mr
from mmreplay.convert import convert
from mmreplay.demo import collect, spec
from mmreplay.formats import FORMATS, export, format_of, import_dataset

DATASETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets")
WRAPPED = os.path.join(DATASETS, "pointchase-wrapped")
MMREPLAY = shutil.which("mmreplay") or os.path.join(os.path.dirname(sys.executable), "mmreplay")
QUICK_START = {  # the README's quick start spec: no next_observation leaf
    "obs": mr.ArraySpec((17,), "float32"),
    "action": mr.ArraySpec((6,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}


def cli(*args) -> subprocess.CompletedProcess:
    out = subprocess.run([MMREPLAY, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def load_minari(root, dataset_id, monkeypatch):
    minari = pytest.importorskip("minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return minari.load_dataset(dataset_id)


def quick_start_store(path, steps=60, num_envs=8, seed=0):
    rng = np.random.default_rng(seed)
    with mr.create(path, QUICK_START, capacity=200, num_envs=num_envs) as store:
        store.extend(
            {
                "obs": rng.standard_normal((steps, num_envs, 17)).astype(np.float32),
                "action": rng.standard_normal((steps, num_envs, 6)).astype(np.float32),
                "reward": rng.standard_normal((steps, num_envs)).astype(np.float32),
                "terminated": rng.random((steps, num_envs)) < 0.08,
                "truncated": rng.random((steps, num_envs)) < 0.04,
            }
        )
    return mr.open(path)


# --- terminals of episodes whose start the ring overwrote -------------------------------------


def test_a_ring_cut_episode_that_terminated_is_terminal_in_every_episode_format(tmp_path, monkeypatch):
    d3rlpy = pytest.importorskip("d3rlpy")
    pd = pytest.importorskip("pandas")
    with mr.open(WRAPPED) as store:
        spans = store.episode_index()
        ended = [s.ended == "terminated" for s in spans]
        cut_terminal = [i for i, s in enumerate(spans) if s.status == "open" and s.ended == "terminated"]
        assert cut_terminal  # the reference store has them
        export(store, tmp_path / "m", "minari", dataset_id="cut-v0")
        export(store, tmp_path / "d4rl.h5", "d4rl")
        export(store, tmp_path / "d3.h5", "d3rlpy")
        export(store, tmp_path / "pq", "parquet")
        arrays = store.to_arrays()
    ds = load_minari(tmp_path / "m", "cut-v0", monkeypatch)
    assert [bool(e.terminations[-1]) for e in ds.iterate_episodes()] == ended
    with h5py.File(tmp_path / "d4rl.h5") as f:
        ends = np.cumsum([s.length for s in spans]) - 1
        assert f["terminals"][()][ends].tolist() == ended
        assert not np.any(f["terminals"][()] & f["timeouts"][()])
    assert int(arrays["terminals"].sum()) == sum(ended)  # what to_arrays() always kept
    with open(tmp_path / "d3.h5", "rb") as fh:
        rb = d3rlpy.dataset.ReplayBuffer.load(fh, d3rlpy.dataset.InfiniteBuffer())
    assert [bool(e.terminated) for e in rb.episodes] == ended
    table = pd.read_parquet(tmp_path / "pq")
    last = table.groupby("episode_index").tail(1)
    assert last["terminated"].tolist() == ended
    assert not (last["terminated"] & last["truncated"]).any()


# --- spaces ----------------------------------------------------------------------------------


def test_minari_keeps_the_spaces_and_env_spec_of_a_recorded_env(tmp_path, monkeypatch):
    gymnasium = pytest.importorskip("gymnasium")
    pytest.importorskip("minari")
    from mmreplay.compat.gymnasium import RecordTransitions, RecordVectorTransitions

    env = RecordTransitions(gymnasium.make("CartPole-v1"), tmp_path / "one", capacity=500)
    env.reset(seed=0)
    for _ in range(120):
        *_, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
    env.close()
    venv = RecordVectorTransitions(
        gymnasium.make_vec("CartPole-v1", num_envs=2), tmp_path / "vec", capacity=500
    )
    venv.reset(seed=0)
    for _ in range(60):
        venv.step(venv.action_space.sample())
    venv.close()
    for name in ("one", "vec"):
        with mr.open(tmp_path / name) as store:
            assert "gymnasium" in store.attrs  # kept in the metadata: it survives reopen
            export(store, tmp_path / "root", "minari", dataset_id=f"cartpole/{name}-v0")
        ds = load_minari(tmp_path / "root", f"cartpole/{name}-v0", monkeypatch)
        assert ds.action_space == gymnasium.spaces.Discrete(2)
        assert ds.observation_space == gymnasium.make("CartPole-v1").observation_space
        assert ds.spec.env_spec is not None and ds.spec.env_spec.id == "CartPole-v1"
        recovered = ds.recover_environment()
        assert recovered.action_space == ds.action_space
        assert recovered.observation_space == ds.observation_space
        for ep in ds.iterate_episodes():
            assert all(ds.action_space.contains(int(a)) for a in ep.actions)
    # a convert keeps them (attrs travel with the copy)
    mr.convert.convert(tmp_path / "one", tmp_path / "copy", backend="hdf5")
    with mr.open(tmp_path / "copy") as copy, mr.open(tmp_path / "one") as one:
        assert copy.attrs["gymnasium"] == one.attrs["gymnasium"]
    # so does an import of the Minari dataset: exported again, the spaces are the env's
    import_dataset(tmp_path / "root" / "cartpole" / "one-v0", tmp_path / "imported")
    with mr.open(tmp_path / "imported") as store:
        export(store, tmp_path / "root", "minari", dataset_id="cartpole/again-v0")
    again = load_minari(tmp_path / "root", "cartpole/again-v0", monkeypatch)
    assert again.action_space == gymnasium.spaces.Discrete(2) and again.spec.env_spec.id == "CartPole-v1"


def test_minari_spaces_of_a_plain_spec_are_the_tightest_box_its_dtypes_allow(tmp_path, monkeypatch):
    gymnasium = pytest.importorskip("gymnasium")
    s = {
        "observation": {
            "count": mr.ArraySpec((2,), "int8"),
            "flag": mr.ArraySpec((3,), "bool"),
            "x": mr.ArraySpec((), "float32"),
        },
        "action": mr.ArraySpec((), "uint8"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "next_observation": {
            "count": mr.ArraySpec((2,), "int8"),
            "flag": mr.ArraySpec((3,), "bool"),
            "x": mr.ArraySpec((), "float32"),
        },
    }
    with mr.create(tmp_path / "b", s, capacity=50) as store:
        for t in range(30):
            step = make_step(s, 1, t)
            step["terminated"][:] = t % 7 == 6
            store.add(step)
        export(store, tmp_path / "root", "minari", dataset_id="plain-v0")
    ds = load_minari(tmp_path / "root", "plain-v0", monkeypatch)
    sub = ds.observation_space.spaces
    assert (sub["count"].low.tolist(), sub["count"].high.tolist()) == ([-128, -128], [127, 127])
    assert sub["flag"].dtype == np.bool_ and sub["flag"].high.tolist() == [True] * 3
    assert ds.action_space == gymnasium.spaces.Box(0, 255, (), np.uint8)
    for ep in ds.iterate_episodes():
        for i in range(len(ep.actions) + 1):
            assert ds.observation_space.contains({k: v[i] for k, v in ep.observations.items()})


# --- both flags, leaves with no role, D4RL infos ----------------------------------------------


def test_minari_keeps_both_flags_and_puts_leaves_with_no_role_in_infos(tmp_path, monkeypatch):
    s = {
        **QUICK_START,
        "next_obs": mr.ArraySpec((17,), "float32"),
        "log_prob": mr.ArraySpec((), "float32"),
        "goal": {"xy": mr.ArraySpec((2,), "float64")},
    }
    n = 12
    rng = np.random.default_rng(1)
    data = {k: rng.standard_normal((n, 1, *v.shape)).astype(v.dtype) for k, v in s.items() if k != "goal"}
    data["goal"] = {"xy": rng.standard_normal((n, 1, 2))}
    data["terminated"] = np.zeros((n, 1), bool)
    data["truncated"] = np.zeros((n, 1), bool)
    data["terminated"][4] = data["truncated"][4] = True  # both at once
    data["truncated"][9] = True
    with mr.create(tmp_path / "b", s, capacity=n) as store:
        store.extend(data)
        store.commit()
        export(store, tmp_path / "root", "minari", dataset_id="flags-v0")
        export(store, tmp_path / "d4rl.h5", "d4rl")
    ds = load_minari(tmp_path / "root", "flags-v0", monkeypatch)
    eps = list(ds.iterate_episodes())
    assert [(bool(e.terminations[-1]), bool(e.truncations[-1])) for e in eps] == [
        (True, True),
        (False, True),
        (False, True),
    ]
    got = np.concatenate([e.infos["log_prob"] for e in eps])
    assert np.array_equal(got, data["log_prob"][:, 0])
    assert np.array_equal(np.concatenate([e.infos["goal"]["xy"] for e in eps]), data["goal"]["xy"][:, 0])
    with h5py.File(tmp_path / "d4rl.h5") as f:  # d4rl: never both set, termination wins
        assert f["terminals"][4] and not f["timeouts"][4]


def test_minari_exports_a_namedtuple_observation_by_its_fields(tmp_path, monkeypatch):
    Obs = collections.namedtuple("Obs", ["pos", "vel"])
    s = {**QUICK_START, "obs": Obs(mr.ArraySpec((2,), "float32"), mr.ArraySpec((3,), "float32"))}
    n = 6
    pos, vel = np.arange(n * 2, dtype="float32").reshape(n, 1, 2), -np.arange(n * 3, dtype="float32").reshape(n, 1, 3)
    data = {k: np.zeros((n, 1, *v.shape), v.dtype) for k, v in s.items() if k != "obs"}
    data["obs"] = Obs(pos, vel)
    data["terminated"][-1] = True
    with mr.create(tmp_path / "b", s, capacity=n) as store:
        store.extend(data)
        store.commit()
        export(store, tmp_path / "root", "minari", dataset_id="nt-v0")
    (episode,) = load_minari(tmp_path / "root", "nt-v0", monkeypatch).iterate_episodes()
    got_pos, got_vel = episode.observations["pos"], episode.observations["vel"]  # and the final next one
    assert np.array_equal(got_pos[:n], pos[:, 0]) and np.array_equal(got_vel[:n], vel[:, 0])
    assert len(got_pos) == len(got_vel) == n + 1


def test_d4rl_import_then_export_keeps_infos_at_their_path(tmp_path):
    T = 20
    rng = np.random.default_rng(2)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f["observations"] = rng.standard_normal((T, 3)).astype(np.float32)
        f["actions"] = rng.standard_normal((T, 2)).astype(np.float32)
        f["rewards"] = rng.standard_normal(T).astype(np.float32)
        f["terminals"] = np.arange(T) % 5 == 4
        f["timeouts"] = np.zeros(T, bool)
        f["infos/qpos"] = rng.standard_normal((T, 4))
    import_dataset(tmp_path / "in.h5", tmp_path / "store")
    with mr.open(tmp_path / "store") as store:
        export(store, tmp_path / "out.h5", "d4rl")
    with h5py.File(tmp_path / "out.h5") as f, h5py.File(tmp_path / "in.h5") as g:
        assert "infos/infos" not in f and list(f["infos"]) == ["qpos"]
        assert np.array_equal(f["infos/qpos"][()], g["infos/qpos"][()])


def test_minari_import_then_export_keeps_infos_at_their_path(tmp_path, monkeypatch):
    s = {**QUICK_START, "log_prob": mr.ArraySpec((), "float32")}
    with mr.create(tmp_path / "b", s, capacity=10) as store:
        store.extend({k: np.ones((10, 1, *v.shape), v.dtype) for k, v in s.items()})
        store.commit()
        export(store, tmp_path / "root", "minari", dataset_id="first-v0")
    import_dataset(tmp_path / "root", tmp_path / "store")
    with mr.open(tmp_path / "store") as store:
        assert "infos/log_prob" in store.leaf_paths
        export(store, tmp_path / "again", "minari", dataset_id="again-v0")
    ds = load_minari(tmp_path / "again", "again-v0", monkeypatch)
    assert [sorted(e.infos) for e in ds.iterate_episodes()] == [["log_prob"]] * len(ds)


# --- a store with no next_observation leaf (the quick start's) --------------------------------


def test_the_quick_start_store_exports_to_every_episode_format(tmp_path, monkeypatch):
    d3rlpy = pytest.importorskip("d3rlpy")
    pd = pytest.importorskip("pandas")
    store = quick_start_store(tmp_path / "qs")
    with store:
        spans = store.episode_index()
        export(store, tmp_path / "root", "minari", dataset_id="quick/start-v0")
        export(store, tmp_path / "d4rl.h5", "d4rl")
        export(store, tmp_path / "d3.h5", "d3rlpy")
        export(store, tmp_path / "pq", "parquet")
        episodes = list(store.episodes())
    ds = load_minari(tmp_path / "root", "quick/start-v0", monkeypatch)
    # minari: terminated episodes keep every step; others lose the last (its outcome is unknown)
    kept = [e for e in episodes if e.ended == "terminated" or e.length > 1]
    assert len(ds) == len(kept)
    for ep, got in zip(kept, ds.iterate_episodes()):
        obs = ep.data["obs"]
        if ep.ended == "terminated":  # its own observation stands in for the final one
            n, want_obs = ep.length, np.concatenate([obs, obs[-1:]])
        else:  # each next observation is the next step's observation of the same episode
            n, want_obs = ep.length - 1, obs
        assert len(got.actions) == n and np.array_equal(got.observations, want_obs)
        assert np.array_equal(got.actions, ep.data["action"][:n])
        assert bool(got.terminations[-1]) == (ep.ended == "terminated")
        assert bool(got.truncations[-1]) == (ep.ended != "terminated" or bool(ep.data["truncated"][-1]))
    with h5py.File(tmp_path / "d4rl.h5") as f:
        assert len(f["rewards"]) == sum(s.length for s in spans)
    with open(tmp_path / "d3.h5", "rb") as fh:
        rb = d3rlpy.dataset.ReplayBuffer.load(fh, d3rlpy.dataset.InfiniteBuffer())
    # d3rlpy drops an episode with no transition: one step that did not terminate
    assert len(rb.episodes) == sum(s.length > 1 or s.ended == "terminated" for s in spans)
    assert len(pd.read_parquet(tmp_path / "pq")) == sum(s.length for s in spans)


# --- every export imports back ---------------------------------------------------------------


def _episode_rows(store) -> dict[str, np.ndarray]:
    """observation / action / reward of every episode, episode after episode."""
    eps = list(store.episodes())
    r = store.roles
    return {
        key: np.concatenate([np.asarray(mr.roles.subtree(e.data, r[key])).reshape(e.length, -1) for e in eps])
        for key in ("observation", "action", "reward")
    }


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_export_imports_back(tmp_path, fmt):
    pytest.importorskip({"pt": "torch", "parquet": "pyarrow", "minari": "h5py"}.get(fmt, "numpy"))
    src = tmp_path / "src"
    with mr.create(src, spec(), capacity=400, num_envs=3, commit_every=50) as store:
        collect(store, 300, seed=7)
    out = tmp_path / ("out" if FORMATS[fmt].target == "folder" else f"out.{fmt}")
    cli("export", src, out, "-f", fmt, "-q")
    cli("import", out, tmp_path / "back", "-q")  # a minari export: OUT is the datasets root
    with mr.open(src) as a, mr.open(tmp_path / "back") as b:
        if FORMATS[fmt].kind == "steps":
            assert b.num_envs == a.num_envs and len(b) == len(a) and b.leaf_paths == a.leaf_paths
            for p, x, y in zip(
                a.leaf_paths,
                a.read_steps(np.arange(a.first_step, a.committed_steps)),
                b.read_steps(np.arange(b.first_step, b.committed_steps)),
            ):
                if fmt == "csv":  # csv keeps values, not dtypes
                    x, y = x.reshape(len(x), a.num_envs, -1), y.reshape(len(y), a.num_envs, -1)
                    assert np.array_equal(y.astype(x.dtype), x), p
                else:
                    assert x.dtype == y.dtype and np.array_equal(x, y), p
            return
        want, got = _episode_rows(a), _episode_rows(b)
        n = len(got["reward"])
        if fmt == "minari":  # with a next_observation leaf every step is kept
            assert n == len(want["reward"])
        for key in want:
            assert np.array_equal(got[key].astype(want[key].dtype), want[key][:n]), key
        assert [s.ended for s in b.episode_index()] == [
            "truncated" if s.ended == "running" else s.ended for s in a.episode_index()
        ]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_export_of_a_closed_store_says_it_is_closed_and_writes_nothing(tmp_path, fmt):
    """pt blamed the PyTorch version ("torch.save laid out 0 records") for a closed store."""
    with mr.create(tmp_path / "src", spec(), capacity=10) as store:
        collect(store, 5, seed=0)
    with pytest.raises(mr.ClosedError, match="closed"):
        export(store, tmp_path / "out", fmt)
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize("fmt", ["pt", "csv", "npz"])
def test_leaves_named_with_two_underscores_come_back(tmp_path, fmt):
    """pt and csv imports dropped every leaf whose name began with "__", saying nothing;
    an npz export wrote a leaf named __mmreplay__ beside its spec member of that name, and
    its import then failed as damaged."""
    pytest.importorskip("torch" if fmt == "pt" else "numpy")
    spec = {"__private": mr.ArraySpec((2,), "int16"), "x": mr.ArraySpec((), "int64")}
    with mr.create(tmp_path / "src", spec, capacity=5, num_envs=2) as store:
        store.extend({"__private": np.arange(12, dtype="int16").reshape(3, 2, 2), "x": np.ones((3, 2), "int64")})
    with mr.open(tmp_path / "src") as store:
        out = export(store, tmp_path / f"out.{fmt}", fmt).path
    import_dataset(out, tmp_path / "back")
    with mr.open(tmp_path / "back") as back:
        assert back.leaf_paths == ["__private", "x"]
        assert np.array_equal(back.get(slice(None))["__private"], np.arange(12).reshape(3, 2, 2))
    with mr.create(tmp_path / "clash", {"__mmreplay__": mr.ArraySpec((), "int64")}, capacity=5) as store:
        store.extend({"__mmreplay__": np.ones((2, 1), "int64")})
        with pytest.raises(mr.BadInputError, match="__mmreplay__"):
            export(store, tmp_path / "clash.npz", "npz")
    assert not (tmp_path / "clash.npz").exists()


@pytest.mark.parametrize("fmt", ["parquet", "d4rl", "npz"])
def test_an_export_of_an_empty_store_imports_back_empty(tmp_path, fmt):
    with mr.create(tmp_path / "src", spec(), capacity=10, num_envs=2) as store:
        out = export(store, tmp_path / ("out" if fmt == "parquet" else f"out.{fmt}"), fmt).path
    result = import_dataset(out, tmp_path / "back")
    assert result.steps == 0 and result.episodes in (None, 0)
    with mr.open(tmp_path / "back") as back:
        assert len(back) == 0 and back.episode_index() == []


def test_import_finds_the_dataset_in_a_minari_root_and_refuses_a_root_with_several(tmp_path):
    with mr.open(WRAPPED) as store:
        export(store, tmp_path / "root", "minari", dataset_id="ns/one-v0")
    cli("import", tmp_path / "root", tmp_path / "a", "-q")
    with mr.open(tmp_path / "a") as a:
        assert a.total_steps == 1200
    with mr.open(WRAPPED) as store:
        export(store, tmp_path / "root", "minari", dataset_id="ns/two-v0")
    out = subprocess.run(
        [MMREPLAY, "import", tmp_path / "root", tmp_path / "b"], capture_output=True, text=True
    )
    assert out.returncode != 0 and "several datasets" in out.stderr and not (tmp_path / "b").exists()


@pytest.mark.parametrize("fmt", ["npz", "hdf5", "zarr", "csv"])
def test_step_major_round_trip_keeps_each_episode_status_and_step_ids(tmp_path, fmt):
    out = tmp_path / ("x" if fmt == "zarr" else f"x.{fmt}")
    with mr.open(WRAPPED) as src:
        export(src, out, fmt)
        import_dataset(out, tmp_path / "copy")
        with mr.open(tmp_path / "copy") as copy:
            assert copy.first_step == src.first_step and copy.total_steps == src.total_steps
            want = [(s.env, s.first_step, s.last_step, s.status) for s in src.episode_index()]
            got = [(s.env, s.first_step, s.last_step, s.status) for s in copy.episode_index()]
            if fmt == "csv":  # csv records no episode starts: every first episode is open
                want = [(e, a, b, "open" if a == src.first_step else st) for e, a, b, st in want]
            assert got == want
            assert any(s[3] == "open" and s[1] == src.first_step for s in want)


# --- csv ---------------------------------------------------------------------------------------


def test_csv_gzip_is_a_csv_gz_that_pandas_reads_with_step_and_env_columns(tmp_path):
    pd = pytest.importorskip("pandas")
    with mr.open(WRAPPED) as store:
        result = export(store, tmp_path / "out.csv", "csv", compression="gzip")
        want = store.read_steps(np.arange(store.first_step, store.committed_steps))
        first, envs = store.first_step, store.num_envs
        paths = store.leaf_paths
    assert result.path == str(tmp_path / "out.csv.gz") and os.listdir(tmp_path) == ["out.csv.gz"]
    with open(result.path, "rb") as f:
        head = f.read(64)
    assert head[:2] == b"\x1f\x8b" and head[3] & 0x08  # FNAME set
    assert head[10 : 10 + len(b"out.csv") + 1] == b"out.csv\x00"
    table = pd.read_csv(result.path)
    assert list(table.columns[:2]) == ["step", "env"] and "reward" in table and "reward.0" not in table
    steps = len(want[0])
    assert table["step"].tolist() == np.repeat(np.arange(first, first + steps), envs).tolist()
    assert table["env"].tolist() == np.tile(np.arange(envs), steps).tolist()
    reward = want[paths.index("reward")]
    assert np.array_equal(table["reward"].to_numpy(np.float32), reward.reshape(-1))
    with gzip.open(result.path, "rt") as f:
        assert f.readline().startswith("step,env,")
    # the name given is honoured when it already ends in .gz
    with mr.open(WRAPPED) as store:
        again = export(store, tmp_path / "named.csv.gz", "csv", compression="gzip")
    assert again.path == str(tmp_path / "named.csv.gz")
    assert json.dumps(list(pd.read_csv(again.path).columns)) == json.dumps(list(table.columns))


def test_csv_leaves_whose_names_end_in_a_dot_and_digits_come_back_as_themselves(tmp_path):
    """A scalar leaf "a.0" beside a scalar "a" was read as the second element of a vector
    "a" (its own leaf gone), and a lone "v.1" came back as a one-element vector "v"."""
    spec = {"a": mr.ArraySpec((), "int64"), "a.0": mr.ArraySpec((), "int64"), "v.1": mr.ArraySpec((), "int64"),
            "w": mr.ArraySpec((3,), "int64")}  # fmt: skip
    with mr.create(tmp_path / "src", spec, capacity=5) as store:
        store.extend({"a": np.full((2, 1), 1), "a.0": np.full((2, 1), 2), "v.1": np.full((2, 1), 3),
                      "w": np.arange(6).reshape(2, 1, 3)})  # fmt: skip
        export(store, tmp_path / "out.csv", "csv")
    import_dataset(tmp_path / "out.csv", tmp_path / "back")
    with mr.open(tmp_path / "back") as back:
        assert {p: s.shape for p, s in zip(back.leaf_paths, mr.spec.flatten(back.spec))} == {
            "a": (), "a.0": (), "v.1": (), "w": (3,)
        }
        rows = {p: v[:, 0] for p, v in back.get(slice(None)).items()}  # (one env)
        assert rows["a"].tolist() == [1, 1] and rows["a.0"].tolist() == [2, 2] and rows["v.1"].tolist() == [3, 3]
        assert np.array_equal(rows["w"], np.arange(6).reshape(2, 3))


def test_csv_quotes_leaf_names_a_csv_reader_would_split(tmp_path):
    import csv as pycsv

    names = ["a,b", 'say "hi"', "two\nlines", "caf\u00e9"]
    s = {name: mr.ArraySpec((2,), "float32") for name in names}
    with mr.create(tmp_path / "b", s, capacity=4) as store:
        store.extend({name: np.full((3, 1, 2), i, "float32") for i, name in enumerate(names)})
        store.commit()
        export(store, tmp_path / "x.csv", "csv")
        paths = store.leaf_paths
    with open(tmp_path / "x.csv", newline="", encoding="utf-8") as f:
        header, *rows = list(pycsv.reader(f))
    assert header == ["step", "env", *(f"{n}.{i}" for n in paths for i in range(2))]
    assert len(rows) == 3 and all(len(r) == len(header) for r in rows)
    assert rows[0][2:] == [str(names.index(n)) for n in paths for _ in range(2)]
    import_dataset(tmp_path / "x.csv", tmp_path / "back")
    with mr.open(tmp_path / "back") as back:
        assert sorted(back.leaf_paths) == sorted(paths)


def test_csv_force_replaces_an_earlier_csv_export_of_another_store(tmp_path):
    for name in ("a", "b"):
        with mr.create(tmp_path / name, {name: mr.ArraySpec((), "int64")}, capacity=4) as store:
            store.add({name: np.ones(1, "int64")})
            export(store, tmp_path / "x.csv", "csv", force=True)
    assert (tmp_path / "x.csv").read_text().splitlines()[0] == "step,env,b"


@pytest.mark.parametrize(
    "name, fmt",
    [("a.npz", "npz"), ("a.NPZ", "npz"), ("a.parquet", "parquet"), ("a.csv", "csv"), ("a.csv.gz", "csv"),
     ("a.pt", "pt"), ("a.pth", "pt"), ("a.zarr", "zarr"), ("a.zarr/", "zarr"), ("datasets", "minari"),
     ("a.txt", "minari")],
)
def test_the_format_of_an_export_follows_the_name_of_out(name, fmt):
    assert format_of(name) == fmt


@pytest.mark.parametrize("name", ["a.h5", "a.hdf5", "d/A.HDF5"])
def test_an_hdf5_name_needs_the_format_named(tmp_path, name):
    with pytest.raises(mr.UnsupportedFormatError, match="d4rl, d3rlpy, hdf5"):
        format_of(name)
    store = mr.create(tmp_path / "s", {"x": mr.ArraySpec((), "float32")}, 4)
    with pytest.raises(mr.UnsupportedFormatError):
        mr.export(store, tmp_path / name)
    assert not list(tmp_path.glob("*.h*5")) and not (tmp_path / "d").exists()
    store.add({"x": np.ones(1, "float32")})
    assert mr.export(store, tmp_path / "x.npz").format == "npz"  # a writer's export, format from the name
    store.close()


# --- a writer lapping the ring under an export or a copy ----------------------------------


FRAME = {"frame": mr.ArraySpec((512, 1024), "uint8"), "reward": mr.ArraySpec((), "float32")}


def test_an_export_or_copy_lapped_by_the_writer_says_so_in_their_words(tmp_path):
    """Two 32 MiB blocks of 64 steps: the writer laps the ring once the first is read."""
    path, capacity = tmp_path / "live", 80
    with mr.create(path, FRAME, capacity=capacity, num_envs=1) as writer:
        step = {"frame": np.zeros((1, 512, 1024), np.uint8), "reward": np.zeros(1, np.float32)}

        def lap(rows):
            for _ in range(capacity):
                writer.add(step)
            writer.commit()

        lap(None)
        for name, run in {
            "the export": lambda reader: export(reader, tmp_path / "x.npz", progress=lap),
            "the copy": lambda reader: convert(path, tmp_path / "copy", progress=lap),
        }.items():
            with mr.open(path, "r") as reader:
                with pytest.raises(mr.OverwrittenError, match=f"before {name} read it") as caught:
                    run(reader)
            assert "refresh()" not in str(caught.value)
            assert caught.value.step < caught.value.oldest
        assert not (tmp_path / "x.npz").exists() and not (tmp_path / "copy").exists()


@pytest.mark.parametrize("steps", [0, 1])
def test_a_minari_export_with_no_episode_to_write_is_refused_from_the_shell(tmp_path, steps):
    """Before, it wrote a dataset of no episode (exit 0) that the import then refused."""
    from conftest import one_line_error, run_cli

    with mr.create(tmp_path / "b", QUICK_START, capacity=20, num_envs=1) as store:
        if steps:
            store.add({k: np.zeros((1, *s.shape), s.dtype) for k, s in QUICK_START.items()})
    out = run_cli("export", tmp_path / "b", tmp_path / "root", "-f", "minari", "-q")
    one_line_error(out, 2, "no episodes to export", "a Minari dataset needs at least one")
    assert not (tmp_path / "root").exists()
