"""The ``mmreplay`` commands, each run in a fresh process as a user runs it (``run_cli``:
``python -m mmreplay.cli``; ``shell``: the installed ``mmreplay`` script)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import one_line_error, run_cli
from mmreplay.cli import COMMANDS

import mmreplay as mr

DATASETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets")
VECTOR = os.path.join(DATASETS, "pointchase-zarr")
WRAPPED = os.path.join(DATASETS, "pointchase-wrapped")
PIXELS = os.path.join(DATASETS, "pointchase-pixels-hdf5")
MMREPLAY = shutil.which("mmreplay") or os.path.join(os.path.dirname(sys.executable), "mmreplay")


def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    result = run_cli(*args)
    if ok:
        assert result.returncode == 0, (result.stdout, result.stderr)
    return result


def shell(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MMREPLAY, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def test_every_command_is_registered_and_listed():
    assert {"inspect", "export", "import", "convert", "sample", "stats", "plot", "create", "demo"} <= set(
        COMMANDS
    )
    out = shell("--help")
    assert out.returncode == 0
    for name in ("inspect", "export", "import", "convert", "sample", "stats", "plot", "create", "demo"):
        assert f"  {name} " in out.stdout


# --- inspect ---------------------------------------------------------------------------------


def test_inspect_table_and_json_agree_with_the_store():
    info = json.loads(run("inspect", WRAPPED, "--json").stdout)
    with mr.open(WRAPPED) as store:
        spans = store.episode_index()
        assert info["steps"] == len(store) == 300 and info["num_envs"] == 4
        assert info["total_steps"] == store.committed_steps == 1000 and info["wrapped"] is True
        assert info["first_step"] == 700 and info["cursor"] == 1000 % 300
        assert info["episodes"]["total"] == len(spans)
        assert info["episodes"]["open"] == sum(s.status == "open" for s in spans)
        assert info["episodes"]["terminated"] == sum(s.status == "terminated" for s in spans)
        assert [leaf["path"] for leaf in info["leaves"]] == store.leaf_paths
    obs = next(leaf for leaf in info["leaves"] if leaf["path"] == "observation")
    assert obs["shape"] == [7] and obs["dtype"] == "float32" and obs["bytes_on_disk"] >= 300 * 4 * 28
    table = run("inspect", WRAPPED).stdout
    assert "300 steps x 4 envs" in table and "wrapped" in table and "cursor at slot 100" in table
    assert "observation" in table and "float32" in table


def test_inspect_shows_compression_ratio():
    info = json.loads(run("inspect", os.path.join(DATASETS, "pointchase-pixels-zstd"), "--json").stdout)
    pixels = next(leaf for leaf in info["leaves"] if leaf["path"] == "observation/pixels")
    assert pixels["compression"] == "zstd" and pixels["compression_ratio"] > 5
    assert pixels["bytes_on_disk"] * pixels["compression_ratio"] == pytest.approx(
        pixels["bytes_stored"], rel=0.02
    )


def test_inspect_while_a_writer_is_running(tmp_path):
    path = tmp_path / "live"
    code = textwrap.dedent(
        f"""
        import sys, time, mmreplay as mr
        from mmreplay.demo import collect, spec
        store = mr.create({str(path)!r}, spec(), capacity=100_000, num_envs=2, commit_every=20)
        collect(store, 100, seed=1); store.commit()
        print("ready", flush=True)
        collect(store, 100_000, seed=1, on_commit=lambda end: time.sleep(0.01))
        """
    )
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        out = shell("inspect", path, "--json")
        assert out.returncode == 0, out.stderr
        info = json.loads(out.stdout)
        assert info["steps"] >= 100 and info["rows"] == info["steps"] * 2
        assert writer.poll() is None  # still writing: inspect took no lock
        more = json.loads(shell("inspect", path, "--json").stdout)
        assert more["steps"] >= info["steps"]
    finally:
        writer.kill()
        writer.wait()



@pytest.mark.parametrize("command", [["stats", "{live}"], ["export", "{live}", "{tmp}/out.npz"]])
def test_a_command_lapped_by_a_running_writer_says_what_to_do_from_the_shell(tmp_path, command):
    """A writer lapping a 40 MiB ring in a few ms: the command's read falls behind it."""
    path = tmp_path / "live"
    code = textwrap.dedent(
        f"""
        import numpy as np, mmreplay as mr
        spec = {{"frame": mr.ArraySpec((512, 1024), "uint8"), "reward": mr.ArraySpec((), "float32")}}
        store = mr.create({str(path)!r}, spec, capacity=80, num_envs=1, commit_every=1)
        step = {{"frame": np.zeros((1, 512, 1024), np.uint8), "reward": np.zeros(1, np.float32)}}
        for i in range(80):
            store.add(step)
        print("ready", flush=True)
        while True:
            store.add(step)
        """
    )
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        args = [arg.format(live=path, tmp=tmp_path) for arg in command]
        for _ in range(5):  # each try is almost surely lapped; one is enough
            out = shell(*args)
            if out.returncode != 0:
                break
        one_line_error(out, 2, "the writer overwrote step", "before the command read it", "pause the writer")
        assert "refresh()" not in out.stderr
        assert writer.poll() is None  # the command took no lock and left the writer be
    finally:
        writer.kill()
        writer.wait()

# --- export / import / convert ---------------------------------------------------------------


def test_export_with_progress_then_import_back(tmp_path):
    result = run("export", VECTOR, tmp_path / "minari", "--format", "minari", "--dataset-id", "ref/vec-v0")
    assert (
        "wrote" in result.stdout and "episodes" in result.stdout and "MINARI_DATASETS_PATH" in result.stdout
    )
    assert "exporting to minari" in result.stderr  # the progress bar
    folder = tmp_path / "minari" / "ref" / "vec-v0"
    assert (folder / "data" / "main_data.hdf5").exists()
    imported = run("import", folder, tmp_path / "store")
    assert "imported minari" in imported.stdout
    with mr.open(VECTOR) as src, mr.open(tmp_path / "store") as dst:
        assert len(dst) == len(src) * src.num_envs and dst.num_envs == 1
        first = next(iter(src.episodes()))
        got = next(iter(dst.episodes()))
        assert np.array_equal(got.data["observation"], first.data["observation"])


@pytest.mark.parametrize("fmt", ["d4rl", "d3rlpy", "parquet", "npz", "csv", "pt", "zarr", "hdf5"])
def test_export_every_format_from_the_command_line(tmp_path, fmt):
    pytest.importorskip({"pt": "torch", "parquet": "pyarrow"}.get(fmt, "numpy"))
    out = tmp_path / "out"
    result = run("export", WRAPPED, out, "-f", fmt, "-q")
    assert str(out) in result.stdout and os.path.exists(out)
    assert result.stderr == ""  # -q: no progress bar


def test_export_reports_its_time_and_speed_sensibly_for_a_small_output(tmp_path):
    """A small export said "0 MB/s"."""
    line = run("export", VECTOR, tmp_path / "x.npz", "-q").stdout.splitlines()[0]
    assert " MB/s" not in line and "0 B/s" not in line and "in 0.0 s" not in line, line
    took = re.search(r"in ([\d.]+) (ms|s)(, ([\d.]+) (B|KiB|MiB|GiB)/s)?\)$", line)
    assert took and float(took.group(1)) > 0, line
    assert took.group(4) is None or float(took.group(4)) > 0, line


def test_export_takes_the_format_from_the_name_of_out(tmp_path):
    """Without --format, an OUT named like a format's file gets that format; any other
    name is a Minari datasets root; a .h5 name, which three formats write, is refused."""
    pytest.importorskip("pyarrow")
    with mr.open(WRAPPED) as store:
        rows = len(store) * store.num_envs
    run("export", WRAPPED, tmp_path / "a.npz", "-q")
    run("export", WRAPPED, tmp_path / "named", "-f", "npz", "-q")
    with np.load(tmp_path / "a.npz") as got, np.load(tmp_path / "named") as want:
        assert sorted(got.files) == sorted(want.files) and "reward" in got.files
        assert all(np.array_equal(got[k], want[k]) for k in want.files)
    run("export", WRAPPED, tmp_path / "a.csv.gz", "-q")
    import gzip

    with gzip.open(tmp_path / "a.csv.gz", "rt") as f:  # fails on a plain file
        assert f.readline().startswith("step,env,") and len(f.readlines()) == rows
    run("export", WRAPPED, tmp_path / "a.parquet", "-q")
    assert list((tmp_path / "a.parquet").rglob("*.parquet"))
    run("export", WRAPPED, tmp_path / "a.zarr", "-q")
    assert (tmp_path / "a.zarr" / "zarr.json").exists()
    run("export", WRAPPED, tmp_path / "root", "-q")
    assert list((tmp_path / "root").rglob("main_data.hdf5"))
    before = sorted(os.listdir(tmp_path))
    one_line_error(shell("export", WRAPPED, tmp_path / "a.h5"), 4, "d4rl, d3rlpy, hdf5")
    assert sorted(os.listdir(tmp_path)) == before


def test_the_minari_load_command_export_prints_runs_in_a_folder_with_a_space(tmp_path):
    """The datasets root went unquoted into the printed command: the shell ran the word
    after the space as the command."""
    pytest.importorskip("minari")
    root = tmp_path / "my datasets"
    out = run("export", WRAPPED, root, "-f", "minari", "--dataset-id", "ns/w-v0", "-q").stdout
    command = out.splitlines()[-1].removeprefix("load with: ").replace("python ", f"{sys.executable} ", 1)
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "MinariDataset" in done.stdout, (command, done.stderr[-2000:])


def test_export_complete_only_and_force(tmp_path):
    run("export", WRAPPED, tmp_path / "a.h5", "-f", "d4rl", "--complete-only", "-q")
    again = run("export", WRAPPED, tmp_path / "a.h5", "-f", "d4rl", "-q", ok=False)
    assert again.returncode != 0 and "--force" in again.stderr
    run("export", WRAPPED, tmp_path / "a.h5", "-f", "d4rl", "-q", "--force")
    bad = run("export", WRAPPED, tmp_path / "x.npz", "-f", "npz", "--complete-only", ok=False)
    assert bad.returncode != 0 and "--complete-only applies to minari, d4rl, d3rlpy, parquet and lerobot" in bad.stderr


def test_convert_to_hdf5_with_compression(tmp_path):
    args = ["--compression", "observation=gzip", "--compression", "next_observation=gzip:6"]
    out = run("convert", WRAPPED, tmp_path / "c", "--backend", "hdf5", *args, "-q").stdout
    assert "converted 300 steps" in out
    with mr.open(WRAPPED) as a, mr.open(tmp_path / "c") as b:
        codecs = {leaf.path: leaf.compression for leaf in b.metadata.leaves}
        assert b.backend == "hdf5" and codecs.pop("observation") == "gzip" and codecs.pop("next_observation") == "gzip:6"
        assert set(codecs.values()) == {None}
        assert b.capacity == a.capacity and len(b) == len(a) and b.roles == a.roles
        for x, y in zip(a.get(slice(None)).values(), b.get(slice(None)).values()):
            assert np.array_equal(x, y)
    run("convert", PIXELS, tmp_path / "small", "--capacity", "30", "--compression", "zstd", "-q")
    with mr.open(PIXELS) as a, mr.open(tmp_path / "small") as b:
        assert len(b) == 30 and np.array_equal(
            b.get(0)["observation"]["pixels"], a.get(70)["observation"]["pixels"]
        )


def test_convert_of_row_frames_to_hdf5_names_the_leaf_and_what_hdf5_takes(tmp_path):
    pytest.importorskip("cramjam")
    spec = {"obs": mr.ArraySpec((8, 8), "uint8"), "reward": mr.ArraySpec((), "float32")}
    with mr.create(tmp_path / "src", spec, 16, compression={"obs": "rows:lz4"}) as store:
        store.add({"obs": np.ones((1, 8, 8), "uint8"), "reward": np.zeros(1, "float32")})
    out = shell("convert", tmp_path / "src", tmp_path / "h5", "--backend", "hdf5")
    one_line_error(out, 2, "leaf 'obs', hdf5 backend: compression 'rows:lz4'", "kept from the source", "--compression")
    assert "zarr backend only" in out.stderr and not (tmp_path / "h5").exists()
    out = shell("convert", tmp_path / "src", tmp_path / "h5", "--backend", "hdf5", "--compression", "rows:zstd")
    assert "kept from the source" not in one_line_error(out, 2, "compression 'rows:zstd'")  # asked for, not kept
    run("convert", tmp_path / "src", tmp_path / "h5", "--backend", "hdf5", "--compression", "gzip", "-q")


# --- sample / stats / plot / create ----------------------------------------------------------------


def test_sample_prints_rows_readably_and_as_json():
    text = run("sample", PIXELS, "-n", "3", "--seed", "1").stdout
    assert text.count("row ") == 3 and "observation/pixels" in text and "uint8[32, 32, 3] min" in text
    rows = json.loads(run("sample", VECTOR, "-n", "2", "--json").stdout)
    assert len(rows) == 2
    with mr.open(VECTOR) as store:
        for r in rows:
            stored = store.read_steps(np.array([r["step"]]))
            obs = stored[store.leaf_paths.index("observation")][0, r["env"]]
            assert np.allclose(r["values"]["observation"], obs)


def test_sample_json_of_odd_dtypes_is_json(tmp_path):
    """A complex leaf ended `sample --json` in a traceback (complex is no JSON number)."""
    spec = {"c": mr.ArraySpec((2,), "complex64"), "h": mr.ArraySpec((2,), "float16"), "b": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "b", spec, capacity=5) as store:
        store.add({"c": [[1 + 2j, np.inf]], "h": [[np.nan, 0.5]], "b": [True]})
    (row,) = json.loads(run("sample", str(tmp_path / "b"), "-n", "1", "--json").stdout)
    assert row["values"] == {"c": [[1.0, 2.0], [None, 0.0]], "h": [None, 0.5], "b": True}


@pytest.mark.parametrize("sampler", [{"sampler": "slices", "num_steps": 8}, {"sampler": "prioritized"}], ids=str)
def test_sample_draws_rows_uniformly_whatever_the_store_samples(tmp_path, sampler):
    """A slices store's sampler draws sequences and a prioritized one by priority: the
    command printed 8-step sequences as "rows", and the top-priority row over and over."""
    spec = {"x": mr.ArraySpec((), "int64"), "terminated": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "b", spec, capacity=50, num_envs=2, **sampler) as store:
        store.extend({"x": np.arange(40).reshape(20, 2), "terminated": np.zeros((20, 2), bool)})
        if sampler["sampler"] == "prioritized":  # every row but (step 3, env 1) nearly never drawn
            store.update_priorities(np.repeat(np.arange(20), 2), np.tile([0, 1], 20), np.zeros(40))
            store.update_priorities([3], [1], [1.0])
    rows = json.loads(run("sample", str(tmp_path / "b"), "-n", "200", "--json").stdout)
    assert all(r["values"]["x"] == 2 * r["step"] + r["env"] for r in rows)  # one row each, not a sequence
    assert len({(r["step"], r["env"]) for r in rows}) > 30  # uniform over the 40 rows


@pytest.mark.parametrize(
    "args",
    [
        ["sample", PIXELS, "-n", "50"],
        ["inspect", PIXELS],
        ["stats", VECTOR],
        ["verify", VECTOR],
        ["export", VECTOR, "{tmp}/x.npz", "-q"],
        ["create", "{tmp}/new", "--spec", "{tmp}/spec.json", "--capacity", "9", "--dry-run"],
    ],
    ids=lambda a: a[0],
)
def test_a_closed_pipe_ends_quietly(tmp_path, args):
    """`mmreplay sample STORE | head -1` printed "Error: [Errno 32] Broken pipe" (exit 2)."""
    (tmp_path / "spec.json").write_text('{"x": {"shape": [], "dtype": "int64"}}')
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes
    try:
        args = [a.replace("{tmp}", str(tmp_path)) for a in args]
        out = subprocess.run([sys.executable, "-m", "mmreplay.cli", *args], stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=300)  # fmt: skip
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (141, ""), (out.returncode, out.stderr)  # 128 + SIGPIPE, as a shell says


def test_stats_agree_with_the_episodes():
    info = json.loads(run("stats", VECTOR, "--json").stdout)
    with mr.open(VECTOR) as store:
        complete = list(store.episodes(complete_only=True))
        rows = store.get(slice(None))
    returns = [float(np.sum(e.data["reward"], dtype=np.float64)) for e in complete]
    ep = info["episodes"]
    assert ep["complete"] == len(complete) and ep["length"]["count"] == len(complete)
    assert ep["return"]["mean"] == pytest.approx(np.mean(returns))
    assert ep["length"]["max"] == max(e.length for e in complete)
    reward = info["leaves"]["reward"]
    assert reward["min"] == pytest.approx(float(rows["reward"].min())) and reward["nan"] == 0
    assert reward["mean"] == pytest.approx(float(rows["reward"].astype(np.float64).mean()))
    assert "return" in run("stats", VECTOR).stdout


def test_stats_counts_nans(tmp_path):
    with mr.create(tmp_path / "n", {"x": mr.ArraySpec((2,), "float32")}, 10) as store:
        store.extend({"x": np.array([[[np.nan, 1.0]], [[2.0, np.inf]], [[-3.0, np.nan]]], np.float32)})
    leaf = json.loads(run("stats", tmp_path / "n", "--json").stdout)["leaves"]["x"]
    assert (leaf["nan"], leaf["inf"], leaf["min"], leaf["max"]) == (2, 1, -3.0, 2.0)


def test_stats_table_keeps_its_columns_apart_for_large_integers(tmp_path):
    """An int64 leaf's 19 digits ran into the next column: "int6446116860184273879044611686018427387904"."""
    spec = {"i": mr.ArraySpec((), "int64"), "u": mr.ArraySpec((), "uint64"), "x": mr.ArraySpec((), "float64")}
    with mr.create(tmp_path / "b", spec, 10) as store:
        i, u = np.array([[-(2**62)], [2**62]]), np.array([[2**64 - 1], [0]], np.uint64)
        store.extend({"i": i, "u": u, "x": np.array([[-1.5e308], [1e-300]])})
    lines = run("stats", tmp_path / "b").stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in lines[lines.index("leaves:") + 1 :]}
    assert rows["i"] == ["i", "int64", "-4.612e+18", "4.612e+18", "0", "0", "0"]
    assert rows["u"][:4] == ["u", "uint64", "0", "1.845e+19"]
    assert rows["x"][:4] == ["x", "float64", "-1.5e+308", "1e-300"]


def test_stats_json_stays_json_when_returns_are_not_finite(tmp_path):
    spec = {"reward": mr.ArraySpec((), "float64"), "terminated": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "r", spec, 10, num_envs=2) as store:  # env 0: return inf, env 1: nan
        store.extend({"reward": np.array([[np.inf, np.nan], [1e308, 1e308], [1e308, 1e308]]),
                      "terminated": np.array([[False, False], [False, False], [True, True]])})
    out = run("stats", tmp_path / "r", "--json")
    assert out.stderr == ""  # no numpy warning about the infinite return
    info = json.loads(out.stdout, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert info["episodes"]["return"]["count"] == 2 and info["episodes"]["return"]["max"] is None
    assert info["leaves"]["reward"]["mean"] is None and info["leaves"]["reward"]["max"] == 1e308


def test_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    assert "complete episodes" in run("plot", VECTOR, "-o", out).stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    exists = run("plot", VECTOR, "-o", out, ok=False)
    assert exists.returncode != 0 and "--force" in exists.stderr


@pytest.mark.parametrize("args", [["plot", VECTOR], ["view", PIXELS]], ids=lambda args: args[0])
def test_plot_and_view_make_the_folders_of_their_output_as_export_does(tmp_path, args):
    pytest.importorskip("matplotlib" if args[0] == "plot" else "PIL")
    out = tmp_path / "figures" / "run" / "out.png"
    run(*args, "-o", out, "-q" if args[0] == "view" else "--force")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(out.parent) == ["out.png"]  # no scratch file left beside it
    missing = run_cli(args[0], tmp_path / "nothing", "-o", tmp_path / "more" / "out.png")
    one_line_error(missing, 3, "nothing: no such folder")
    assert not (tmp_path / "more").exists()  # a failed command makes no folder


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "block"))
    out = shell("plot", VECTOR, "-o", tmp_path / "p.png", env=env)
    assert out.returncode != 0 and "mmreplay[plot]" in out.stderr and "Traceback" not in out.stderr


def test_create_from_json_and_yaml(tmp_path):
    (tmp_path / "spec.json").write_text(
        json.dumps(
            {
                "spec": {
                    "obs": {"shape": [3], "dtype": "float32"},
                    "reward": {"shape": [], "dtype": "float32"},
                },
                "num_envs": 2,
                "compression": {"obs": "zstd", "reward": "zstd"},
            }
        )
    )
    out = run("create", tmp_path / "a", "--spec", tmp_path / "spec.json", "--capacity", "50").stdout
    assert "created" in out
    with mr.open(tmp_path / "a") as store:
        assert store.capacity == 50 and store.num_envs == 2 and store.spec["obs"].shape == (3,)
        assert store.roles == {"observation": "obs", "reward": "reward"}
        assert all(leaf.compression == "zstd" for leaf in store.metadata.leaves)
    pytest.importorskip("yaml")
    (tmp_path / "spec.yaml").write_text(
        "capacity: 20\nbackend: hdf5\ncompression: gzip\nspec:\n  obs:\n    pixels: {shape: [8, 8, 3], dtype: uint8}\n"
        "  action: {shape: [], dtype: int64}\n"
    )
    run("create", tmp_path / "b", "--spec", tmp_path / "spec.yaml")
    # YAML reads an unquoted yes as True: refused, not stored as a leaf named 'True'
    (tmp_path / "yes.yaml").write_text("capacity: 20\nspec:\n  yes: {shape: [], dtype: bool}\n")
    one_line_error(run_cli("create", tmp_path / "c", "--spec", tmp_path / "yes.yaml"), 2, "True", "quote it")
    assert not (tmp_path / "c").exists()
    with mr.open(tmp_path / "b") as store:
        assert store.backend == "hdf5" and store.spec["obs"]["pixels"].shape == (8, 8, 3)
        codecs = {leaf.path: leaf.compression for leaf in store.metadata.leaves}
        assert codecs == {"action": None, "obs/pixels": "gzip"}  # a codec alone: the image leaves


# --- errors: one line on stderr, a non-zero status, no traceback --------------------------------


@pytest.mark.parametrize(
    "args, needle, code",
    [
        (["inspect", "{tmp}/missing"], "no such folder", 3),
        (["inspect", "{tmp}"], "not an mmreplay buffer", 3),
        (["export", WRAPPED, "{tmp}/x", "--format", "tfrecord"], "unknown export format", 4),
        (["export", "{tmp}/missing", "{tmp}/x", "--format", "npz"], "no such folder", 3),
        (["export", WRAPPED, "{tmp}/exists", "--format", "npz"], "exists and is not an earlier npz export", 2),
        (["import", "{tmp}/missing.npz", "{tmp}/new"], "no such file", 3),
        (["import", WRAPPED + "/mmreplay.json", "{tmp}/new"], "not a Minari dataset", 4),
        (["convert", WRAPPED, "{tmp}/exists"], "already exists", 2),
        (
            ["create", "{tmp}/new", "--spec", "{tmp}/missing.json", "--capacity", "5"],
            "spec file not found",
            3,
        ),
        (["create", "{tmp}/new", "--spec", "{tmp}/bad.json", "--capacity", "5"], "not valid JSON", 2),
        (["create", "{tmp}/new", "--spec", "{tmp}", "--capacity", "5"], "is a folder; expected a spec file", 2),
        (["sample", "{tmp}/missing"], "no such folder", 3),
        (["stats", "{tmp}"], "not an mmreplay buffer", 3),
        # a missing path, or a file where a buffer folder goes, is "no buffer there" (3)
        (["verify", "{tmp}/typo"], "no such folder", 3),
        (["verify", "{tmp}/exists"], "not a folder", 3),
        (["recover", "{tmp}/typo"], "no such folder", 3),
        (["recover", "{tmp}/exists"], "not a folder", 3),
        (["inspect", "{tmp}/exists"], "not a folder", 3),
        (["export", "{tmp}/exists", "{tmp}/x.npz", "-f", "npz"], "not a folder", 3),
        (["convert", "{tmp}/missing", "{tmp}/new"], "no such folder", 3),
        (["plot", "{tmp}/missing", "-o", "{tmp}/p.png"], "no such folder", 3),
        # compression settings a format does not take: what it accepts, in one line
        (["export", WRAPPED, "{tmp}/x.h5", "-f", "hdf5", "--compression", "lzf:5"], "gzip[:0-9], lzf", 2),
        (["export", WRAPPED, "{tmp}/x.h5", "-f", "d4rl", "--compression", "gzip:abc"], "no integer level", 2),
        (["export", WRAPPED, "{tmp}/x", "-f", "zarr", "--compression", "zstd:x"], "zstd[:1-22]", 2),
        (["export", WRAPPED, "{tmp}/x.h5", "-f", "hdf5", "--compression", "gzip:99"], "outside 0..9", 2),
        (["export", WRAPPED, "{tmp}/x", "-f", "parquet", "--compression", "lzf"], "snappy", 2),
        (["export", WRAPPED, "{tmp}/x.csv", "-f", "csv", "--compression", "gzip:5"], "takes none", 2),
        (["export", WRAPPED, "{tmp}/x.pt", "-f", "pt", "--compression", "gzip"], "not compressed", 2),
        (["convert", WRAPPED, "{tmp}/new", "--compression", "observation=lzf:5"], "lzf takes none", 2),
        (["convert", WRAPPED, "{tmp}/new", "--compression", "observation=gzip:abc"], "no integer level", 2),
        (["convert", WRAPPED, "{tmp}/new", "--compression", "observation=zstd:x"], "zstd[:1-22]", 2),
        (["convert", WRAPPED, "{tmp}/new", "--compression", "observation=gzip:99"], "outside 0..9", 2),
        (["convert", WRAPPED, "{tmp}/new", "--compression", "observation=blosc:nope"], "blosc compressor", 2),
        (["create", "{tmp}/new", "--spec", "{tmp}/ok.json", "--capacity", "5", "--compression", "x=zstd:50"],
         "outside 1..22", 2),
        (["create", "{tmp}/new", "--spec", "{tmp}/ok.json", "--capacity", "5", "--compression", "zstd"],
         "no image leaves", 2),
        # bad options and arguments: click's message, on one line
        (["plot", VECTOR, "-o", "{tmp}/x.bmpx"], "cannot write a .bmpx image", 2),
        (["demo", "--steps", "5"], "--steps", 2),
        (["demo", "--steps", "abc"], "--steps", 2),
        (["demo", "{tmp}/exists"], "not a folder", 2),
        (["sample", VECTOR, "-n", "0"], "'-n'", 2),
        (["export", WRAPPED], "Missing argument 'OUT'", 2),
        (["export", WRAPPED, "{tmp}/x.npz", "-f", "npz", "--dataset-id", "a-v0"], "minari only", 2),
        (["export", WRAPPED, "{tmp}/x", "--dataset-id", "a b"], "dataset id", 2),
        (["create", "{tmp}/new", "--spec", "{tmp}/ok.json"], "--capacity", 2),
        (["create", "{tmp}/new", "--spec", "{tmp}/badleaf.json", "--capacity", "5"], "cannot name a leaf", 2),
        (["torture", "--layout", "nope"], "--layout", 2),
        # an object-storage URL that names no bucket, or a path where a URL goes
        (["push", VECTOR, "{tmp}/pushed"], "expected an s3://bucket/prefix URL", 2),
        (["pull", "s3://", "{tmp}/new"], "names no bucket", 2),
        (["inspect", "s3:///prefix"], "names no bucket", 2),
        (["inspect"], "Missing argument 'PATH'", 2),
        (["no-such-command"], "No such command", 2),
    ],
)
def test_user_mistakes_are_one_line_errors(tmp_path, args, needle, code):
    (tmp_path / "exists").write_text("")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "ok.json").write_text('{"x": {"shape": [], "dtype": "int64"}}')
    (tmp_path / "badleaf.json").write_text('{"../x": {"shape": [], "dtype": "int64"}}')
    before = sorted(os.listdir(tmp_path))
    out = shell(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    one_line_error(out, code, needle)
    assert sorted(os.listdir(tmp_path)) == before  # a refusal writes nothing


@pytest.mark.parametrize("target", ["store", "file", "folder"])
def test_create_over_an_existing_path_gives_advice_the_command_line_can_follow(tmp_path, target):
    """It said "pass exist_ok=True to reopen a buffer": a Python argument no option gives."""
    spec = tmp_path / "spec.json"
    spec.write_text('{"x": {"shape": [], "dtype": "int64"}}')
    path = tmp_path / target
    if target == "store":
        mr.create(path, {"x": mr.ArraySpec((), "int64")}, 3).close()
    else:
        path.write_text("") if target == "file" else path.mkdir()  # (an empty folder becomes the store)
        if target == "folder":
            (path / "notes.txt").write_text("")
    before = sorted(os.listdir(tmp_path))
    out = shell("create", path, "--spec", spec, "--capacity", "5")
    one_line_error(out, 2, f"{path}: already exists; choose a new path")
    assert "exist_ok" not in out.stderr and sorted(os.listdir(tmp_path)) == before


LEAF = {"shape": [3], "dtype": "float32"}
HUGE = {"shape": [2**40, 2**40], "dtype": "float32"}


@pytest.mark.parametrize(
    "content, needle",
    [
        ({"capacity": 5, "compression": 5, "spec": {"obs": LEAF}}, "compression"),
        ({"capacity": 5, "roles": {"observation": 3}, "spec": {"obs": LEAF}}, "role 'observation'"),
        ({"capacity": 5, "roles": ["observation"], "spec": {"obs": LEAF}}, "roles"),
        ({"capacity": 5, "spec": {"obs": {**LEAF, "shpe": [4]}}}, "'shpe'"),
        ({"capacity": 5, "spec": {"obs": {"shape": [3]}}}, "'dtype' is missing"),
        ({"capacity": 5, "spec": {"obs": HUGE}}, "leaf 'obs'"),
        ({"capacity": 5, "backend": "hdf5", "spec": {"obs": HUGE}}, "leaf 'obs'"),
        (b"\xff\xfe{}", "spec.json"),
    ],
    ids=["compression-int", "role-int", "roles-list", "leaf-typo", "no-dtype", "huge", "huge-hdf5", "binary"],
)
def test_bad_spec_files_are_one_line_errors_and_create_nothing(tmp_path, content, needle):
    spec_file = tmp_path / "spec.json"
    spec_file.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    out = run_cli("create", tmp_path / "new", "--spec", spec_file)
    one_line_error(out, 2, needle)
    assert os.listdir(tmp_path) == ["spec.json"]


@pytest.mark.parametrize(
    "args",
    [
        ["convert", VECTOR, "s3://bucket/copy"],
        ["import", VECTOR, "s3://bucket/copy"],
        ["create", "s3://bucket/new", "--spec", "spec.json", "--capacity", "5"],
        ["pull", "s3://bucket/store", "s3://bucket/copy"],
        ["plot", VECTOR, "-o", "s3://bucket/plot.png"],
        ["view", PIXELS, "-o", "s3://bucket/view.gif"],
        ["view", PIXELS, "--rerun", "s3://bucket/view.rrd"],
        ["demo", "s3://bucket/demo"],
        ["recover", "s3://bucket/store"],
    ],
    ids=lambda args: f"{args[0]} {args[-1] if args[-1].startswith('s3') else args[1]}",
)
def test_an_s3_url_where_a_command_writes_local_files_is_refused(tmp_path, args):
    """Only export writes to object storage: elsewhere s3://bucket/x would be a local
    folder s3: in the working directory, and the user would think it was published."""
    out = subprocess.run(
        [sys.executable, "-m", "mmreplay.cli", *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    one_line_error(out, 2, "s3://bucket/", "a local path")
    assert os.listdir(tmp_path) == []


def test_compression_help_lists_only_what_each_format_takes():
    """csv takes gzip alone, pt nothing; each line of the help matches what export accepts."""
    text = " ".join(run("export", "--help").stdout.split())
    assert "csv: gzip;" in text and "pt: none" in text and "npz: deflate" in text
    assert "minari, d4rl, d3rlpy, hdf5: gzip[:0-9], lzf;" in text
    for command in ("convert", "import", "create"):
        text = " ".join(run(command, "--help").stdout.split())
        assert "zarr: zstd[:1-22]" in text and "hdf5: gzip[:0-9]" in text, command


def test_import_and_convert_refuse_an_existing_target_and_change_nothing(tmp_path):
    (tmp_path / "store").mkdir()
    before = os.listdir(tmp_path / "store")
    out = run("import", os.path.join(DATASETS, "pointchase-zarr"), tmp_path / "store", ok=False)
    assert out.returncode != 0 and os.listdir(tmp_path / "store") == before


def test_the_installed_command_runs_a_full_session(tmp_path):
    """inspect -> export -> import -> stats -> sample, as a user types them."""
    assert shell("inspect", PIXELS).returncode == 0
    out = shell("export", PIXELS, tmp_path / "px.npz", "--format", "npz", "--compression", "deflate")
    assert out.returncode == 0 and "wrote" in out.stdout
    assert shell("import", tmp_path / "px.npz", tmp_path / "copy").returncode == 0
    stats = json.loads(shell("stats", tmp_path / "copy", "--json").stdout)
    assert stats["leaves"]["observation/pixels"]["max"] == 255
    sample = shell("sample", tmp_path / "copy", "-n", "1")
    assert sample.returncode == 0 and sample.stdout.startswith("row 0: step ")


def test_recover_of_a_buffer_a_live_writer_holds_says_what_works_from_the_shell(tmp_path):
    with mr.create(tmp_path / "b", {"x": mr.ArraySpec((), "int64")}, 10) as store:
        store.add({"x": np.array([1])})
        store.commit()
        line = one_line_error(run_cli("recover", tmp_path / "b"), 5, f"by process {os.getpid()}", "verify checks it")
    assert "mode=" not in line  # the API's advice means nothing on the command line
