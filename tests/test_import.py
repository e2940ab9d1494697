"""Imports from Minari, D4RL-style HDF5 and npz; import -> export -> import is lossless."""

from __future__ import annotations

import os
import zipfile

import h5py
import numpy as np
import pytest
from conftest import one_line_error, run_cli

import mmreplay as mr
from mmreplay.formats import FORMATS, detect_format, export, import_dataset

DATASETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets")


def all_rows(store):
    return store.read_steps(np.arange(store.first_step, store.committed_steps))


def assert_same_store(a: mr.Store, b: mr.Store) -> None:
    assert mr.spec.spec_to_json(a.spec) == mr.spec.spec_to_json(b.spec)
    assert a.roles == b.roles and a.num_envs == b.num_envs and len(a) == len(b)
    for p, x, y in zip(a.leaf_paths, all_rows(a), all_rows(b)):
        assert x.dtype == y.dtype and np.array_equal(x, y), p


def minari_dataset(root, monkeypatch, images=False, jpeg=True, data_format="hdf5"):
    """A dataset written by Minari itself (create_dataset_from_buffers)."""
    minari = pytest.importorskip("minari")
    gym = pytest.importorskip("gymnasium")
    from minari.data_collector import EpisodeBuffer

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    rng = np.random.default_rng(0)
    if images:
        obs_space = gym.spaces.Box(0, 255, (32, 32, 3), np.uint8)
    else:
        obs_space = gym.spaces.Dict(
            {"pos": gym.spaces.Box(-1, 1, (3,), np.float32), "vel": gym.spaces.Box(-1, 1, (2,), np.float64)}
        )
    act_space = gym.spaces.Discrete(4)
    buffers = []
    for i, n in enumerate([5, 9, 3]):
        if images:
            obs = rng.integers(0, 255, (n + 1, 32, 32, 3)).astype(np.uint8)
        else:
            obs = {
                "pos": rng.uniform(-1, 1, (n + 1, 3)).astype(np.float32),
                "vel": rng.uniform(-1, 1, (n + 1, 2)),
            }
        term = np.zeros(n, bool)
        trunc = np.zeros(n, bool)
        (term if i != 1 else trunc)[-1] = True
        buffers.append(
            EpisodeBuffer(
                observations=obs,
                actions=rng.integers(0, 4, n),
                rewards=rng.standard_normal(n),
                terminations=term,
                truncations=trunc,
            )
        )
    minari.create_dataset_from_buffers(
        "test/made-v0",
        buffers,
        observation_space=obs_space,
        action_space=act_space,
        data_format=data_format,
        jpeg_encoding=jpeg,
    )
    return minari.load_dataset("test/made-v0"), root / "test" / "made-v0"


def test_import_a_dataset_minari_wrote(tmp_path, monkeypatch):
    ds, folder = minari_dataset(tmp_path / "root", monkeypatch)
    assert detect_format(str(folder)) == "minari" and detect_format(str(folder / "data")) == "minari"
    result = import_dataset(folder, tmp_path / "store")
    assert (result.format, result.episodes, result.steps, result.num_envs) == ("minari", 3, 17, 1)
    with mr.open(tmp_path / "store") as store:
        assert (
            store.roles["observation"] == "observation"
            and store.roles["next_observation"] == "next_observation"
        )
        eps = list(store.episodes())
        assert [e.length for e in eps] == [5, 9, 3]
        assert [e.status for e in eps] == ["terminated", "truncated", "terminated"]
        for ep, src in zip(eps, ds.iterate_episodes()):
            for key in ("pos", "vel"):
                assert np.array_equal(ep.data["observation"][key], src.observations[key][:-1])
                assert np.array_equal(ep.data["next_observation"][key], src.observations[key][1:])
                assert ep.data["observation"][key].dtype == src.observations[key].dtype
            assert np.array_equal(ep.data["action"], src.actions)
            assert np.array_equal(ep.data["reward"], src.rewards) and ep.data["reward"].dtype == np.float64



def test_a_minari_dataset_in_the_arrow_format_is_refused_naming_its_format(tmp_path, monkeypatch):
    """The import looked for main_data.hdf5 only, so it said the folder was no Minari
    dataset, whether its format was given or not."""
    pytest.importorskip("pyarrow")
    _, folder = minari_dataset(tmp_path / "root", monkeypatch, data_format="arrow")
    for fmt in ("auto", "minari"):
        with pytest.raises(mr.UnsupportedFormatError, match="Minari data_format 'arrow'; only 'hdf5' imports"):
            import_dataset(folder, tmp_path / "store", format=fmt)
    assert not (tmp_path / "store").exists()

def test_import_minari_jpeg_images_as_minari_decodes_them(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    ds, folder = minari_dataset(tmp_path / "root", monkeypatch, images=True, jpeg=True)
    import_dataset(folder, tmp_path / "store")
    with mr.open(tmp_path / "store") as store:
        for ep, src in zip(store.episodes(), ds.iterate_episodes()):
            assert np.array_equal(ep.data["observation"], src.observations[:-1])
            assert ep.data["observation"].dtype == np.uint8


def test_import_d4rl_file(tmp_path):
    rng = np.random.default_rng(1)
    T = 40
    term = np.zeros(T, bool)
    term[[9, 30]] = True
    timeouts = np.zeros(T, bool)
    timeouts[19] = True
    with h5py.File(tmp_path / "d4rl.hdf5", "w") as f:
        f["observations"] = rng.standard_normal((T, 11)).astype(np.float32)
        f["actions"] = rng.uniform(-1, 1, (T, 3)).astype(np.float32)
        f["rewards"] = rng.standard_normal(T).astype(np.float32)
        f["terminals"] = term
        f["timeouts"] = timeouts
        f["infos/qpos"] = rng.standard_normal((T, 6))
        f["metadata/algorithm"] = "SAC"
        f["metadata/policy/fc0/weight"] = np.zeros((4, 4))
    assert detect_format(str(tmp_path / "d4rl.hdf5")) == "d4rl"
    result = import_dataset(tmp_path / "d4rl.hdf5", tmp_path / "store", backend="hdf5")
    assert result.steps == T and result.format == "d4rl"
    with mr.open(tmp_path / "store") as store:
        assert store.backend == "hdf5"
        assert set(store.leaf_paths) == {
            "actions",
            "infos/qpos",
            "observations",
            "rewards",
            "terminals",
            "timeouts",
        }
        assert store.roles == {
            "observation": "observations",
            "action": "actions",
            "reward": "rewards",
            "terminated": "terminals",
            "truncated": "timeouts",
        }
        spans = store.episode_index()
        assert [(s.first_step, s.last_step, s.status) for s in spans] == [
            (0, 9, "terminated"),
            (10, 19, "truncated"),
            (20, 30, "terminated"),
            (31, 39, "open"),
        ]
        with h5py.File(tmp_path / "d4rl.hdf5") as f:
            assert np.array_equal(store.get(slice(None))["infos"]["qpos"][:, 0], f["infos/qpos"][()])



def test_a_d4rl_field_with_another_row_count_than_observations_is_refused(tmp_path):
    """The import skipped it with a log line: the store came without actions."""
    with h5py.File(tmp_path / "d4rl.hdf5", "w") as f:
        f["observations"] = np.zeros((10, 3), np.float32)
        f["actions"] = np.zeros((9, 2), np.float32)
        f["rewards"] = np.zeros(10, np.float32)
        f["terminals"] = np.zeros(10, bool)
        f["infos/goal"] = np.zeros(2)  # not per step: skipped
    with pytest.raises(mr.BadInputError, match=r"d4rl.hdf5: 'actions' has 9 rows, 'observations' 10"):
        import_dataset(tmp_path / "d4rl.hdf5", tmp_path / "store")
    assert not (tmp_path / "store").exists()

def test_import_plain_npz_with_and_without_envs(tmp_path):
    x = np.arange(60, dtype=np.int16).reshape(10, 2, 3)
    np.savez(
        tmp_path / "a.npz", obs=x, reward=np.ones((10, 2), np.float32), **{"extra/deep": np.zeros((10, 2))}
    )
    with pytest.raises(mr.SpecError, match="scalar"):  # read as one env, 'reward' would be a vector
        import_dataset(tmp_path / "a.npz", tmp_path / "one")
    assert not (tmp_path / "one").exists()
    np.savez(tmp_path / "a.npz", obs=x, **{"extra/deep": np.zeros((10, 2))})
    import_dataset(tmp_path / "a.npz", tmp_path / "one")
    with mr.open(tmp_path / "one") as store:
        assert (
            store.num_envs == 1
            and store.spec["obs"].shape == (2, 3)
            and store.spec["extra"]["deep"].shape == (2,)
        )
        assert np.array_equal(store.get(slice(None))["obs"][:, 0], x)
    import_dataset(tmp_path / "a.npz", tmp_path / "two", num_envs=2, capacity=4)
    with mr.open(tmp_path / "two") as store:
        assert store.num_envs == 2 and store.spec["obs"].shape == (3,) and len(store) == 4
        assert np.array_equal(store.get(slice(None))["obs"], x[-4:])  # the newest steps


def test_num_envs_that_contradicts_an_npz_export_is_refused(tmp_path):
    """--num-envs 2 on an export of 3 envs was ignored: the store came with 3, silently."""
    with mr.create(tmp_path / "s", {"x": mr.ArraySpec((), "int64")}, 5, num_envs=3) as store:
        store.extend({"x": np.arange(12).reshape(4, 3)})
    export(mr.open(tmp_path / "s"), tmp_path / "s.npz")
    out = run_cli("import", tmp_path / "s.npz", tmp_path / "two", "--num-envs", "2")
    one_line_error(out, 2, str(tmp_path / "s.npz"), "export of 3 envs", "num_envs=2")
    assert not (tmp_path / "two").exists()
    import_dataset(tmp_path / "s.npz", tmp_path / "three", num_envs=3)  # what it records is fine
    with mr.open(tmp_path / "three") as store:
        assert store.num_envs == 3 and np.array_equal(store.get(slice(None))["x"], np.arange(12).reshape(4, 3))


@pytest.mark.parametrize("fmt", ["zarr", "lerobot"])
def test_import_format_named_for_a_folder_of_another_format_says_what_it_is_not(tmp_path, fmt):
    """zarr's own "No group found in store" and a bare "meta/info.json: No such file or
    directory" (exit 3, as for a missing SRC) came instead."""
    pytest.importorskip("pyarrow")
    with mr.create(tmp_path / "s", {"x": mr.ArraySpec((), "int64"), "terminated": mr.ArraySpec((), "bool")}, 5) as s:
        s.extend({"x": np.arange(4)[:, None], "terminated": np.array([[0], [1], [0], [1]], bool)})
    export(mr.open(tmp_path / "s"), tmp_path / "pq", "parquet")
    out = run_cli("import", tmp_path / "pq", tmp_path / "back", "--format", fmt)
    one_line_error(out, 4, str(tmp_path / "pq"), f"not a {'zarr export' if fmt == 'zarr' else 'LeRobot dataset'}")
    assert not (tmp_path / "back").exists()


def test_plain_npz_of_a_transposed_array_imports_and_one_of_strings_names_its_array(tmp_path):
    """np.savez keeps a transposed array Fortran-ordered, and the import refused it; an
    array of strings failed with "ArraySpec: dtype <U1 cannot be stored", naming neither
    the array nor the file."""
    obs = np.arange(60.0).reshape(6, 10).T  # [10 steps, 6]
    np.savez(tmp_path / "a.npz", obs=obs, act=np.arange(10))
    import_dataset(tmp_path / "a.npz", tmp_path / "one")
    with mr.open(tmp_path / "one") as store:
        assert store.spec["obs"].shape == (6,) and np.array_equal(store.get(slice(None))["obs"][:, 0], obs)
    np.savez(tmp_path / "s.npz", obs=obs, name=np.array(list("abcdefghij")))
    out = run_cli("import", tmp_path / "s.npz", tmp_path / "two")
    one_line_error(out, 2, f"{tmp_path / 's.npz'}: array 'name'", "<U1")
    assert not (tmp_path / "two").exists()


def test_npz_with_objects_is_refused_without_unpickling(tmp_path):
    np.savez(tmp_path / "evil.npz", obs=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(mr.BadInputError, match="unpickle"):
        import_dataset(tmp_path / "evil.npz", tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_import_errors(tmp_path):
    with pytest.raises(mr.NotABufferError):
        import_dataset(tmp_path / "nothing", tmp_path / "s")
    (tmp_path / "folder").mkdir()
    with pytest.raises(mr.UnsupportedFormatError, match="neither"):
        import_dataset(tmp_path / "folder", tmp_path / "s")
    (tmp_path / "text.txt").write_text("hello")
    with pytest.raises(mr.UnsupportedFormatError):
        import_dataset(tmp_path / "text.txt", tmp_path / "s")
    np.savez(tmp_path / "ragged.npz", a=np.zeros(3), b=np.zeros(4))
    with pytest.raises(mr.BadInputError, match="differ in length"):
        import_dataset(tmp_path / "ragged.npz", tmp_path / "s")
    np.savez(tmp_path / "ok.npz", a=np.zeros(3))
    import_dataset(tmp_path / "ok.npz", tmp_path / "s")
    with pytest.raises(FileExistsError):
        import_dataset(tmp_path / "ok.npz", tmp_path / "s")
    assert not any(n.startswith(".") for n in os.listdir(tmp_path))


def test_import_of_a_folder_with_no_parquet_files_as_parquet_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    out = run_cli("import", tmp_path / "empty", tmp_path / "s", "--format", "parquet")
    one_line_error(out, 4, "no .parquet files")
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_import_of_a_store_names_convert(tmp_path):
    """A store given to import said it was neither a Minari dataset, a zarr export nor
    parquet files, whatever the --format."""
    for backend in ("zarr", "hdf5"):
        src = tmp_path / backend
        with mr.create(src, {"x": mr.ArraySpec((), "int64")}, 10, backend=backend) as store:
            store.add({"x": np.array([1])})
        for fmt in ("auto", "zarr", "hdf5", "minari"):
            out = run_cli("import", src, tmp_path / "s", "--format", fmt)
            one_line_error(out, 4, f"{src}: an mmreplay store", f"mmreplay convert {src} {tmp_path / 's'}")
    assert sorted(os.listdir(tmp_path)) == ["hdf5", "zarr"]


def test_import_of_a_folder_as_a_file_format_or_a_file_as_a_folder_format_is_one_line(tmp_path):
    """h5py's error (two lines, with a time stamp) for a folder given as hdf5 / d4rl /
    d3rlpy, zarr's "No group found" or Python's errno text for the others."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("hello")
    for fmt, info in FORMATS.items():
        src = tmp_path / ("folder" if info.target == "file" else "file")
        out = run_cli("import", src, tmp_path / "s", "--format", fmt)
        one_line_error(out, 4, f"{src}: ", f"the {fmt} import reads a {info.target}")
    assert sorted(os.listdir(tmp_path)) == ["file", "folder"]


def test_import_of_a_file_in_another_format_is_one_line(tmp_path):
    """--format npz of a file that is no zip ended in BadZipFile's traceback, hdf5 and
    d3rlpy of an HDF5 file without their datasets in a KeyError's, and the HDF5 formats of
    a file that is no HDF5 in h5py's "file signature not found", naming no file."""
    (tmp_path / "text").write_text("hello")
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["a"] = np.zeros(3)
    for src, fmt, needle in [
        ("text", "npz", "not an npz"),
        ("text", "hdf5", "not an HDF5 file"),
        ("text", "d4rl", "not an HDF5 file"),
        ("text", "d3rlpy", "not an HDF5 file"),
        ("plain.h5", "hdf5", "not an hdf5 export of mmreplay"),
        ("plain.h5", "d3rlpy", "not a d3rlpy file"),
    ]:
        out = run_cli("import", tmp_path / src, tmp_path / "s", "--format", fmt)
        one_line_error(out, 4, f"{tmp_path / src}: ", needle)
    assert sorted(os.listdir(tmp_path)) == ["plain.h5", "text"]


# --- import -> export -> import ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["minari", "d4rl", "npz", "hdf5", "zarr"])
def test_import_export_import_is_lossless(tmp_path, monkeypatch, fmt):
    """A store made by an import exports and imports back to the same store."""
    # start from a Minari dataset: complete episodes, nested observations, int actions
    _, folder = minari_dataset(tmp_path / "root", monkeypatch)
    if fmt in ("minari", "npz", "hdf5", "zarr"):
        import_dataset(folder, tmp_path / "a")
    else:  # a D4RL store: its own key names and roles
        export_target = tmp_path / "seed.hdf5"
        import_dataset(folder, tmp_path / "m")
        with mr.open(tmp_path / "m") as m:
            export(m, export_target, "d4rl")
        import_dataset(export_target, tmp_path / "a")
    out = tmp_path / ("out" if fmt in ("minari", "zarr") else f"out.{fmt}")
    with mr.open(tmp_path / "a") as a:
        result = export(a, out, fmt, **({"dataset_id": "rt/again-v0"} if fmt == "minari" else {}))
    src = out / "rt" / "again-v0" if fmt == "minari" else out
    import_dataset(src, tmp_path / "b")
    with mr.open(tmp_path / "a") as a, mr.open(tmp_path / "b") as b:
        assert_same_store(a, b)
        assert [s.status for s in a.episode_index()] == [s.status for s in b.episode_index()]
    assert result.steps == 17


@pytest.mark.parametrize("name", ["pointchase-zarr", "pointchase-pixels-zstd", "pointchase-wrapped"])
@pytest.mark.parametrize("fmt", ["npz", "hdf5", "zarr"])
def test_step_major_export_imports_back_exactly(tmp_path, name, fmt):
    out = tmp_path / ("x" if fmt == "zarr" else f"x.{fmt}")
    with mr.open(os.path.join(DATASETS, name)) as src:
        export(src, out, fmt)
        import_dataset(
            out,
            tmp_path / "copy",
            compression={p: "zstd" for p in src.leaf_paths} if "zstd" in name else None,
        )
        with mr.open(tmp_path / "copy") as copy:
            assert_same_store(src, copy)
            # the same step ids, and an episode whose start the ring overwrote stays open
            assert copy.first_step == src.first_step
            assert copy.episode_index() == src.episode_index()
            assert [s.status for s in copy.episode_index()] == [s.status for s in src.episode_index()]


@pytest.mark.parametrize("roles", [{"terminated": "flag"}, None])
def test_a_parquet_export_imports_back_with_its_episode_ends(tmp_path, roles):
    """Episodes end where the export's flag columns say, also for a store whose spec has no
    truncated (or no terminated) leaf: an open episode, written truncated, does not run on
    into the next env's."""
    spec = {"x": mr.ArraySpec((2,), "float32"), "flag": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "s", spec, capacity=10, num_envs=2, roles=roles) as s:
        for t in range(14):
            s.add({"x": np.full((2, 2), t, np.float32), "flag": np.array([t == 5, t == 8])})
    with mr.open(tmp_path / "s") as s:
        export(s, tmp_path / "x.parquet", "parquet")
        want = [(e.length, e.status) for e in s.episodes()]
    import_dataset(tmp_path / "x.parquet", tmp_path / "b")
    with mr.open(tmp_path / "b") as b:
        got = [(e.length, e.status) for e in b.episodes()]
    # every episode back, each of the same length: those that ended terminated (also when
    # the ring overwrote their start), the ones still open truncated
    assert [n for n, _ in got] == [n for n, _ in want] == ([2, 8, 5, 5] if roles else [10, 10])
    assert [st for _, st in got] == (["terminated", "truncated"] * 2 if roles else ["truncated"] * 2)


def test_npz_export_is_a_plain_zip_of_npy_members(tmp_path):
    with mr.open(os.path.join(DATASETS, "pointchase-wrapped")) as src:
        export(src, tmp_path / "x.npz", "npz")
    with zipfile.ZipFile(tmp_path / "x.npz") as zf:
        names = sorted(zf.namelist())
    assert names == sorted(
        [
            "__mmreplay__.npy",
            "action.npy",
            "next_observation.npy",
            "observation.npy",
            "reward.npy",
            "terminated.npy",
            "truncated.npy",
        ]
    )


def test_a_csv_import_keeps_whole_numbers_beyond_float64s_exact_range(tmp_path):
    """Cells were parsed as float64: an int64 id of 2**53 + 1 came back as 2**53."""
    big = np.array([2**53 + 1, -(2**62) - 3, 2**63 - 1], np.int64)
    spec = {"id": mr.ArraySpec((), "int64"), "x": mr.ArraySpec((), "float64")}
    with mr.create(tmp_path / "s", spec, 5, num_envs=3) as store:
        store.add({"id": big, "x": np.array([0.1, 1e300, -2.5])})
        export(store, tmp_path / "s.csv", format="csv")
    import_dataset(tmp_path / "s.csv", tmp_path / "b")
    with mr.open(tmp_path / "b") as b:
        got = b.get(slice(None))
    assert got["id"].dtype == np.int64 and got["id"][0].tolist() == big.tolist()
    assert got["x"][0].tolist() == [0.1, 1e300, -2.5]


def test_a_csv_import_takes_the_dtypes_and_shapes_it_is_given(tmp_path):
    """csv keeps no dtype: whole numbers would come back int64 and flags as numbers."""
    spec = {"x": mr.ArraySpec((), "float32"), "done": mr.ArraySpec((), "bool"), "k": mr.ArraySpec((2, 2), "uint8")}
    with mr.create(tmp_path / "s", spec, 5, num_envs=2) as store:
        for t in range(3):
            store.add({"x": np.full(2, t, "float32"), "done": np.full(2, t == 2), "k": np.full((2, 2, 2), t, "uint8")})
        export(store, tmp_path / "s.csv", format="csv")
    guessed = import_dataset(tmp_path / "s.csv", tmp_path / "guessed")
    with mr.open(guessed.path) as found:
        assert {p: (s.shape, s.dtype.name) for p, s in found.spec.items()} == {
            "x": ((), "int64"), "done": ((), "int64"), "k": ((4,), "int64")
        }
    typed = import_dataset(tmp_path / "s.csv", tmp_path / "typed", spec=spec)
    with mr.open(typed.path) as found, mr.open(tmp_path / "s") as source:
        assert found.spec == source.spec
        for leaf, want in source.get(slice(None)).items():
            np.testing.assert_array_equal(found.get(slice(None))[leaf], want)
    with pytest.raises(mr.BadInputError, match="leaf 'k' has 4 columns, its declared shape \\(3,\\) takes 3"):
        import_dataset(tmp_path / "s.csv", tmp_path / "wrong", spec={"k": mr.ArraySpec((3,), "uint8")})
    with pytest.raises(mr.BadInputError, match="leaf 'x' holds values that are not bool"):
        import_dataset(tmp_path / "s.csv", tmp_path / "wrong", spec={"x": mr.ArraySpec((), "bool")})
    with pytest.raises(mr.BadInputError, match="spec applies to the csv import, not to npz"):
        import_dataset(tmp_path / "s.csv", tmp_path / "wrong", format="npz", spec=spec)
    assert not (tmp_path / "wrong").exists()


def _damaged_files(tmp_path) -> list[tuple[str, str]]:
    """(file, format) pairs: an export of each kind cut short or with a bad value inside."""
    spec = {"obs": mr.ArraySpec((3,), "float32"), "reward": mr.ArraySpec((), "float32")}
    with mr.create(tmp_path / "s", spec, 50) as store:
        store.extend({"obs": np.ones((40, 1, 3), "float32"), "reward": np.zeros((40, 1), "float32")})
        for name, fmt in [("x.npz", "npz"), ("x.csv", "csv"), ("x.csv.gz", "csv"), ("x.h5", "hdf5"), ("x.pq", "parquet")]:
            export(store, tmp_path / name, format=fmt, **({"compression": "gzip"} if name.endswith("gz") else {}))
    cases = []
    whole = (tmp_path / "x.npz").read_bytes()
    (tmp_path / "cut.npz").write_bytes(whole[: len(whole) // 2])  # its zip directory is gone
    cases.append(("cut.npz", "auto"))
    with zipfile.ZipFile(tmp_path / "x.npz") as src, zipfile.ZipFile(tmp_path / "short.npz", "w") as dst:
        for name in src.namelist():  # a member shorter than its header says
            data = src.read(name)
            dst.writestr(name, data if name.startswith("__") else data[:-40])
    cases.append(("short.npz", "auto"))
    with zipfile.ZipFile(tmp_path / "badmeta.npz", "w") as zf:
        zf.writestr("__mmreplay__.npy", b"\x93NUMPY not an array header")
    cases.append(("badmeta.npz", "npz"))
    text = (tmp_path / "x.csv").read_text().splitlines()
    (tmp_path / "word.csv").write_text("\n".join([*text[:3], text[3].replace("1", "one", 1), *text[4:]]))
    cases.append(("word.csv", "auto"))
    (tmp_path / "cut.csv.gz").write_bytes((tmp_path / "x.csv.gz").read_bytes()[:-20])
    cases.append(("cut.csv.gz", "auto"))
    whole = (tmp_path / "x.h5").read_bytes()
    (tmp_path / "cut.h5").write_bytes(whole[:64] + bytes(len(whole) - 64))
    cases.append(("cut.h5", "auto"))
    (tmp_path / "pq").mkdir()
    part = sorted(p for p in os.listdir(tmp_path / "x.pq") if p.endswith(".parquet"))[0]
    (tmp_path / "pq" / part).write_bytes(b"PAR1" + (tmp_path / "x.pq" / part).read_bytes()[-100:])
    cases.append(("pq", "parquet"))
    return cases


def test_a_damaged_file_of_each_format_is_an_error_naming_it(tmp_path):
    """A cut npz or pt ended in BadZipFile's traceback, a member shorter than its header in
    numpy's reshape error, a word in a csv in float()'s, a cut csv.gz in EOFError (click's
    "Aborted!" from the command line), a damaged parquet in pyarrow's ArrowInvalid, and an
    HDF5 file with damaged metadata in h5py's message naming no file."""
    for name, fmt in _damaged_files(tmp_path):
        with pytest.raises(mr.CorruptBufferError, match=f"{tmp_path / name}: "):
            import_dataset(tmp_path / name, tmp_path / "store", format=fmt)
        assert not (tmp_path / "store").exists()


def test_a_damaged_file_is_one_line_from_the_command_line(tmp_path):
    cases = dict(_damaged_files(tmp_path))
    for name in ("cut.npz", "cut.csv.gz"):
        out = run_cli("import", tmp_path / name, tmp_path / "store", "--format", cases[name])
        one_line_error(out, 4, f"{tmp_path / name}: ")
    assert not (tmp_path / "store").exists()


class _RunsOnLoad:
    """Unpickling it would create the file ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pt_file_holding_python_objects_is_refused_in_one_line_without_unpickling(tmp_path):
    """torch's refusal spans six lines and advises to load it with weights_only=False."""
    torch = pytest.importorskip("torch")
    torch.save({"obs": torch.zeros(3, 1), "x": _RunsOnLoad(tmp_path / "ran")}, tmp_path / "evil.pt")
    out = run_cli("import", tmp_path / "evil.pt", tmp_path / "store")
    line = one_line_error(out, 2, f"{tmp_path / 'evil.pt'}: ", "GLOBAL")
    assert "weights_only` set to `False`" not in line
    assert sorted(os.listdir(tmp_path)) == ["evil.pt"]
