"""An export, convert or import that is stopped leaves nothing half-made.

Ctrl-C at any moment, SIGKILL, a full or a read-only file system: OUT is the complete
output or it is absent, and nothing else appears beside it (no scratch name, no empty
Minari namespace folder). What a killed run left (``.NAME.partial-PID``) goes at the next
run of the same command, or with ``mmreplay recover``, never while its process lives.
Signals, processes and file systems are real.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import one_line_error, run_cli
from test_faults import remount, tmpfs  # noqa: F401 - the fixture

import mmreplay as mr
from mmreplay.formats import FORMATS

DATASETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets")
PIXELS = os.path.join(DATASETS, "pointchase-pixels-hdf5")
OUTPUTS = [*FORMATS, "convert", "import"]
NEEDS = {"pt": "torch", "parquet": "pyarrow"}

#: Ctrl-C at random moments of the output, in one process (an interpreter start per trial
#: would spend the test's time importing); prints one JSON line per trial
INTERRUPT = textwrap.dedent(
    """
    import json, os, random, shutil, signal, sys, threading, time
    import mmreplay as mr
    from mmreplay.convert import convert
    from mmreplay.files import disk_usage
    from mmreplay.formats import import_dataset

    src, folder, what, trials, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    store = mr.open(src)
    npz = os.path.join(os.path.dirname(folder), "source.npz")
    if what == "import" and not os.path.exists(npz):
        mr.export(store, npz, format="npz")

    def run(out):
        if what == "convert":
            convert(src, out)
        elif what == "import":
            import_dataset(npz, out)
        else:
            mr.export(store, out, format=what)

    armed = False

    def interrupt(signum, frame):
        if armed:  # (a signal that comes after the run returned is not the run's)
            raise KeyboardInterrupt

    def remove(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)

    def whole(path):  # what a finished run makes: the same store, or an output of the same bytes
        if what in ("convert", "import"):
            with mr.open(path) as made:
                return (made.total_steps, made.first_step)
        return disk_usage(path)

    signal.signal(signal.SIGINT, interrupt)
    for warm in (True, False):  # the second run is timed: the first imports and warms up
        t = time.perf_counter()
        run(os.path.join(folder, "outxxx"))  # (a name as long as the others: pt records it)
        took = time.perf_counter() - t
        finished_output = whole(os.path.join(folder, "outxxx"))
        remove(os.path.join(folder, "outxxx"))
    rng = random.Random(seed)
    for trial in range(trials):
        out = os.path.join(folder, f"out{trial:03d}")
        timer = threading.Timer(rng.uniform(0, took), os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            armed = True
            run(out)
            finished = True
        except KeyboardInterrupt:
            finished = False
        finally:
            armed = False
        timer.join()
        entries = sorted(os.listdir(folder))
        complete = entries == [f"out{trial:03d}"] and whole(out) == finished_output
        print(json.dumps({"finished": finished, "entries": entries, "complete": complete}), flush=True)
        if os.path.lexists(out):
            remove(out)
    time.sleep(0.5)  # a thread of a writing library still at work would leave files now
    print(json.dumps({"finished": None, "entries": sorted(os.listdir(folder))}), flush=True)
    """
)


@pytest.fixture(scope="module")
def noise(tmp_path_factory) -> str:
    """A store of 20 MB of frames that do not compress: its outputs take a while to write
    and fill a small file system whatever the format."""
    path = str(tmp_path_factory.mktemp("noise") / "store")
    spec = {
        "observation": mr.ArraySpec((32, 32, 3), "uint8"),
        "next_observation": mr.ArraySpec((32, 32, 3), "uint8"),
        "action": mr.ArraySpec((2,), "float32"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
    }
    rng = np.random.default_rng(0)
    steps, envs = 400, 8
    with mr.create(path, spec, steps, envs) as store:
        store.extend(
            {
                "observation": rng.integers(0, 256, (steps, envs, 32, 32, 3), np.uint8),
                "next_observation": rng.integers(0, 256, (steps, envs, 32, 32, 3), np.uint8),
                "action": rng.standard_normal((steps, envs, 2)).astype(np.float32),
                "reward": rng.standard_normal((steps, envs)).astype(np.float32),
                "terminated": rng.random((steps, envs)) < 0.02,
            }
        )
    return path


def needs(what: str) -> None:
    if what in NEEDS:
        pytest.importorskip(NEEDS[what])


def interrupted_runs(tmp_path, what: str, trials: int, seed: int = 0) -> list[dict]:
    folder = tmp_path / "outputs"
    folder.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT, PIXELS, str(folder), what, str(trials), str(seed)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def check_nothing_half_made(results: list[dict]) -> None:
    *trials, last = results
    for i, r in enumerate(trials):
        if r["finished"] or r["entries"]:  # (Ctrl-C may come after the output was in place)
            assert r["complete"], (i, r)
        assert r["entries"] in ([], [f"out{i:03d}"]), (i, r)
    assert last["entries"] == [], last


@pytest.mark.parametrize("what", OUTPUTS)
def test_ctrl_c_at_random_moments_leaves_the_output_whole_or_absent(tmp_path, what):
    """Ctrl-C during `export -f minari` used to leave an empty OUT/mmreplay/ folder."""
    needs(what)
    check_nothing_half_made(interrupted_runs(tmp_path, what, trials=3))


@pytest.mark.long
@pytest.mark.parametrize("what", OUTPUTS)
def test_ctrl_c_at_many_random_moments(tmp_path, what):
    needs(what)
    check_nothing_half_made(interrupted_runs(tmp_path, what, trials=200, seed=1))


def test_ctrl_c_during_a_minari_export_from_the_command_line(tmp_path, noise):
    out = tmp_path / "datasets"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmreplay.cli", "export", noise, str(out), "-f", "minari", "-q"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    scratch = out / "mmreplay" / f".store-v0.partial-{proc.pid}"
    wait_for(scratch, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and err.strip() == "Aborted!", (proc.returncode, err)
    assert os.listdir(tmp_path) == []


def wait_for(path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``path`` exists (the run is writing its output)."""
    end = time.monotonic() + timeout
    while not os.path.lexists(path):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.005)


# --- killed runs ---------------------------------------------------------------------------


def export_args(src: str, out, what: str) -> list[str]:
    if what == "convert":
        return ["convert", src, str(out), "-q"]
    return ["export", src, str(out), "-f", what, "-q"]


@pytest.mark.parametrize("what", ["hdf5", "zarr", "convert"])
def test_the_next_run_removes_what_a_killed_run_left(tmp_path, noise, what):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "mmreplay.cli", *export_args(noise, out, what)])
    scratch = tmp_path / f".out.partial-{proc.pid}"
    wait_for(scratch, proc)
    proc.kill()
    proc.wait()
    assert os.path.lexists(scratch)  # what SIGKILL leaves
    again = run_cli(*export_args(noise, out, what))
    assert again.returncode == 0, again.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"]


def dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def test_leftovers_of_a_live_process_are_kept(tmp_path):
    live = subprocess.Popen(["sleep", "600"])
    try:
        mine = tmp_path / f".out.partial-{live.pid}"
        mine.mkdir()
        dead = tmp_path / f".out.partial-{dead_pid()}"
        dead.mkdir()
        (dead / "part-00000.parquet").write_bytes(b"half")
        other = tmp_path / f".other.partial-{dead_pid()}"  # another output's: not this run's
        other.write_bytes(b"")
        done = run_cli(*export_args(PIXELS, tmp_path / "out", "npz"))
        assert done.returncode == 0, done.stderr
        assert sorted(os.listdir(tmp_path)) == sorted(["out", mine.name, other.name])
    finally:
        live.kill()
        live.wait()


def test_recover_removes_a_killed_creates_leftover(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"x": {"shape": [], "dtype": "int64"}}))
    made = run_cli("create", tmp_path / "b", "--spec", spec, "--capacity", "10")
    assert made.returncode == 0, made.stderr
    shutil.copytree(tmp_path / "b", tmp_path / f".b.creating-{dead_pid()}")  # a killed create's half
    shutil.copytree(tmp_path / "b", tmp_path / f".c.creating-{dead_pid()}")
    done = run_cli("recover", tmp_path / "b")
    assert done.returncode == 0 and "removed" in done.stdout and ".b.creating-" in done.stdout, done
    alone = run_cli("recover", tmp_path / "c")  # nothing at c but what a killed create left
    assert alone.returncode == 0 and ".c.creating-" in alone.stdout, alone
    assert sorted(os.listdir(tmp_path)) == ["b", "spec.json"]


# --- full and read-only file systems ---------------------------------------------------------


#: every output to a small file system, in one process: the error and what is left
FILL = textwrap.dedent(
    """
    import json, os, sys
    import mmreplay as mr
    from mmreplay.convert import convert

    src, folder = sys.argv[1], sys.argv[2]
    for what in sys.argv[3:]:
        out = os.path.join(folder, "out")
        try:
            convert(src, out) if what == "convert" else mr.export(mr.open(src), out, format=what)
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        print(json.dumps({"what": what, "error": error, "entries": sorted(os.listdir(folder))}), flush=True)
    """
)


def outputs_into(src: str, folder: str, whats: list[str]) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", FILL, src, folder, *whats], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    return [json.loads(line) for line in done.stdout.splitlines()]


def available(whats) -> list[str]:
    out = []
    for what in whats:
        try:
            needs(what)
        except pytest.skip.Exception:
            continue
        out.append(what)
    return out


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmpfs, noise):  # noqa: F811
    """`export -f hdf5` onto a full disk died of SIGSEGV after two tracebacks."""
    fs = tmpfs("4m")
    for fmt in ("hdf5", "minari"):
        out = run_cli("export", noise, os.path.join(fs, "out"), "-f", fmt, "-q")
        one_line_error(out, 2, os.path.join(fs, "out"), "no space left", f"{fmt} export")
        assert ".partial" not in out.stderr and os.listdir(fs) == []
    # lerobot encodes the frames as lossy video, a fraction of their size: a smaller disk
    lossless = available([f for f in FORMATS if f != "lerobot"] + ["convert"])
    for folder, whats in ((fs, lossless), (tmpfs("256k"), available(["lerobot"]))):
        for r in outputs_into(noise, folder, whats):
            assert r["error"] and r["error"].startswith("DiskFullError: " + folder), r  # (convert: before it begins)
            assert ".partial" not in r["error"] and r["entries"] == [], r


def test_minari_export_of_many_short_episodes_onto_a_full_disk_is_one_line(tmpfs, tmp_path):  # noqa: F811
    """Many small episodes fill the disk inside libhdf5's own writes (objects released,
    the final flush), which Python only printed, and the export died of SIGSEGV."""
    spec = {"obs": mr.ArraySpec((3,), "float32"), "action": mr.ArraySpec((), "float32"),
            "reward": mr.ArraySpec((), "float32"), "terminated": mr.ArraySpec((), "bool")}  # fmt: skip
    with mr.create(tmp_path / "short", spec, capacity=5000, num_envs=2) as store:
        store.extend({"obs": np.ones((5000, 2, 3), "float32"), "action": np.zeros((5000, 2), "float32"),
                      "reward": np.zeros((5000, 2), "float32"),
                      "terminated": np.arange(10000).reshape(5000, 2) % 7 == 6})  # fmt: skip
    fs = tmpfs("300k")
    out = run_cli("export", tmp_path / "short", os.path.join(fs, "out"), "-f", "minari", "-q")
    one_line_error(out, 2, os.path.join(fs, "out"), "no space left", "minari export")
    assert os.listdir(fs) == []


def test_export_to_a_read_only_place_names_the_target(tmpfs):  # noqa: F811
    """The error named the scratch file (.out.partial-PID) instead of OUT."""
    fs = tmpfs("4m")
    remount(fs, "ro")
    out = run_cli("export", PIXELS, os.path.join(fs, "out"), "-f", "npz")
    one_line_error(out, 6, f"{os.path.join(fs, 'out')}: cannot write the npz export there", "Read-only")
    for r in outputs_into(PIXELS, fs, available([*FORMATS, "convert"])):
        assert r["error"] and r["error"].startswith("ReadOnlyError: " + os.path.join(fs, "out")), r
        assert ".partial" not in r["error"], r


def test_every_command_writing_to_a_read_only_place_is_one_line_exit_6(tmpfs, tmp_path):  # noqa: F811
    """create named its scratch folder (.NAME.creating-PID) and exited 2, as plot, view and
    demo did with Python's errno text; view --rerun ended in rerun's traceback."""
    fs = tmpfs("4m")
    remount(fs, "ro")
    (tmp_path / "spec.json").write_text('{"x": {"shape": [], "dtype": "int64"}}')
    runs = {
        "create": ["create", "{out}", "--spec", tmp_path / "spec.json", "--capacity", "5"],
        "plot.png": ["plot", PIXELS, "-o", "{out}"],
        "view.gif": ["view", PIXELS, "-o", "{out}", "-q"],
        "view.rrd": ["view", PIXELS, "--rerun", "{out}", "-q"],
        "demo": ["demo", "{out}", "--steps", "100"],
    }
    for name, args in runs.items():
        if name == "view.rrd":
            pytest.importorskip("rerun")
        target = os.path.join(fs, name)
        out = run_cli(*[target if a == "{out}" else a for a in args])
        line = one_line_error(out, 6, target, "Read-only file system")
        assert ".creating-" not in line and "[Errno" not in line, line
    # torture printed its progress header first (a folder to make), or failed each trial
    # with a traceback and exit status 1 (a folder there)
    for target in (os.path.join(fs, "torture"), fs):
        out = run_cli("torture", "--dir", target, "--trials", "2", "--kills", "1")
        one_line_error(out, 6, f"{target}: cannot write", "Read-only file system")
