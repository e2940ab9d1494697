"""Faults: full and read-only file systems, damaged files, newer formats, rival and dead writers.

Each fault ends in a clear error or a documented recovery (``mmreplay recover``), never in
silently wrong data, and ``mmreplay verify`` finds every damage made here.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable

import h5py
import numpy as np
import pytest
from conftest import (
    LAYOUT_AXIS,
    LAYOUT_IDS,
    LAYOUTS,
    folder_digest,
    one_line_error,
    recover_cli,
    run_cli,
    spread,
    verify_cli,
)

import mmreplay as mr
from mmreplay.metadata import METADATA_FILE, STATE_FILE, read_metadata
from mmreplay.spec import flatten, unflatten
from mmreplay.torture import SPEC, step_values
from mmreplay.verify import hdf5_status, leftovers

LEAVES = flatten(SPEC)
ENVS = 2


def steps(lo: int, hi: int, num_envs: int = ENVS):
    return unflatten(SPEC, step_values(LEAVES, num_envs, np.arange(lo, hi)))


def fill(path, n: int, backend="zarr", compression=None, capacity=40, chunk_steps=4, **kw) -> str:
    path = str(path)
    with mr.create(
        path,
        SPEC,
        capacity=capacity,
        num_envs=ENVS,
        backend=backend,
        compression=compression,
        chunk_steps=chunk_steps,
        **kw,
    ) as store:
        store.extend(steps(0, n))
    return path


def assert_exact(path) -> tuple[int, int]:
    """Every committed step of the buffer is bit-exact; returns its window."""
    with mr.open(path) as store:
        first, end = store.first_step, store.committed_steps
        ids = np.arange(first, end)
        for path_, got, want in zip(store.leaf_paths, store.read_steps(ids), step_values(LEAVES, ENVS, ids)):
            assert got.tobytes() == want.tobytes(), path_
    return first, end


def assert_detected(path, *words: str) -> list[str]:
    """``mmreplay verify`` (a fresh process, as a user runs it) finds damage naming ``words``."""
    code, problems = verify_cli(path)
    assert code == 1 and problems, "verify found nothing"
    text = "\n".join(problems)
    for w in words:
        assert w in text, text
    return problems


def assert_healthy(path) -> None:
    assert verify_cli(path) == (0, [])


def files_of(folder) -> set[str]:
    return {os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs}


# --- small file systems -----------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a small tmpfs; yields a function size -> mount point. Skips where not allowed."""
    mounts = []

    def make(size: str) -> str:
        point = tmp_path / f"fs{len(mounts)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True
        )
        if done.returncode != 0:
            pytest.skip(
                f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {done.stderr.decode().strip()}"
            )
        mounts.append(point)
        return str(point)

    yield make
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def remount(point: str, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", point], check=True)


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_disk_full_at_creation_is_an_error_and_leaves_nothing(tmpfs, backend):
    fs = tmpfs("1m")
    with pytest.raises(mr.DiskFullError, match="needs"):
        mr.create(
            os.path.join(fs, "b"), {"x": mr.ArraySpec((1024,), "uint8")}, capacity=4096, backend=backend
        )
    assert os.listdir(fs) == []


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_disk_full_while_preallocating_is_an_error_and_leaves_nothing(tmpfs, backend):
    """The free-space check passes (the leaf alone fits) but the files with their
    metadata do not: preallocation fails with a clear error, not a SIGBUS later."""
    fs = tmpfs("1m")
    free = shutil.disk_usage(fs).free
    capacity = free // 1024 - 1
    with pytest.raises(mr.DiskFullError, match="free"):
        mr.create(
            os.path.join(fs, "b"), {"x": mr.ArraySpec((1024,), "uint8")}, capacity=capacity, backend=backend
        )
    assert os.listdir(fs) == []


#: a writer that collects until a write is refused (``error``), committing every 12 steps
FILL_LOOP = """
import json, os, sys, numpy as np, mmreplay as mr
from mmreplay.spec import flatten, unflatten
from mmreplay.torture import SPEC, step_values
store = mr.open({path!r}, "a")
g, error = store.total_steps, None
try:
    while True:
        store.extend(unflatten(SPEC, step_values(flatten(SPEC), {envs}, np.arange(g, g + 3))))
        g += 3
        if g % 12 == 0:
            store.commit()
except Exception as exc:
    error = exc
"""

FILL_UNTIL_FULL = FILL_LOOP + """
print(json.dumps({{"committed": store.committed_steps, "error": type(error).__name__, "message": str(error),
                  "mro": [c.__name__ for c in type(error).__mro__]}}))
"""


@pytest.mark.parametrize(("backend", "codec"), [("zarr", "zstd"), ("hdf5", "gzip")])
def test_disk_full_during_chunk_writes_keeps_every_commit(tmpfs, backend, codec):
    fs = tmpfs("1m")
    path = os.path.join(fs, "b")
    mr.create(
        path, SPEC, capacity=5000, num_envs=ENVS, backend=backend, compression=codec, chunk_steps=4
    ).close()
    with open(os.path.join(fs, "filler"), "wb") as f:
        f.write(b"\0" * (600 << 10))
    code = textwrap.dedent(FILL_UNTIL_FULL.format(path=path, envs=ENVS))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "DiskFullError" in report["mro"] or "no space" in report["message"].lower(), report
    assert report["committed"] > 0
    first, end = assert_exact(path)  # every commit made before the disk filled is intact
    assert end >= report["committed"]
    assert_healthy_or_only_flags(path)
    os.remove(os.path.join(fs, "filler"))  # room again: the next writer resumes
    with mr.open(path, "a") as store:
        assert store.total_steps == end
        store.extend(steps(end, end + 8))
    assert assert_exact(path)[1] == end + 8
    assert_healthy(path)


def assert_healthy_or_only_flags(path) -> None:
    """A writer that ran out of space may leave HDF5's open-for-writing flags (and nothing else)."""
    for problem in verify_cli(path)[1]:
        assert "status flags" in problem, problem


def fill_disk(fs: str) -> str:
    """Write a file until the file system is full; returns its path."""
    filler = os.path.join(fs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_a_commit_needs_no_free_space(tmpfs):
    """The state file is written in place: a full disk does not stop a commit of rows
    that are in their preallocated files already."""
    fs = tmpfs("1m")
    path = os.path.join(fs, "b")
    spec = {"obs": mr.ArraySpec((4,), "float32"), "action": mr.ArraySpec((), "int64")}
    store = mr.create(path, spec, capacity=50, commit_every=10**6)
    store.add({"obs": np.ones((1, 4), "float32"), "action": np.ones(1, "int64")})
    store.commit()
    filler = fill_disk(fs)
    store.add({"obs": np.full((1, 4), 2, "float32"), "action": np.full(1, 2, "int64")})
    store.commit()
    assert leftovers(path) == []
    with mr.open(path) as reader:
        assert len(reader) == 2 and reader.get(1)["action"][0] == 2
    os.remove(filler)
    store.close()


def test_full_disk_while_recording_episode_ends_keeps_the_previous_state(tmpfs):
    fs = tmpfs("1m")
    path = os.path.join(fs, "b")
    spec = {"obs": mr.ArraySpec((), "float32"), "terminated": mr.ArraySpec((), "bool")}
    store = mr.create(path, spec, capacity=4000, commit_every=10**6)
    store.add({"obs": np.ones(1, "float32"), "terminated": np.ones(1, bool)})
    store.commit()
    # every step ends an episode: the commit appends 2,000 records (32 KB) to episodes.idx
    store.extend({"obs": np.full((2000, 1), 2, "float32"), "terminated": np.ones((2000, 1), bool)})
    before = open(os.path.join(path, STATE_FILE), "rb").read()
    filler = fill_disk(fs)
    with pytest.raises(mr.DiskFullError, match="episode ends"):
        store.commit()
    assert open(os.path.join(path, STATE_FILE), "rb").read() == before
    assert leftovers(path) == []
    os.remove(filler)
    store.commit()
    store.close()
    with mr.open(path) as reader:
        assert len(reader) == 2001 and len(reader.episode_index()) == 2001
    assert_healthy(path)


@pytest.mark.parametrize(("backend", "compression"), spread(LAYOUT_AXIS, normal=["zarr-mapped", "hdf5-gzip"]))
def test_read_only_file_system(tmpfs, backend, compression):
    fs = tmpfs("8m")
    path = fill(os.path.join(fs, "b"), 30, backend, compression)
    before = files_of(path)
    remount(fs, "ro")
    try:
        assert assert_exact(path) == (0, 30)  # readers work
        with pytest.raises(mr.ReadOnlyError, match="Read-only file system"):
            mr.open(path, "a")
        with pytest.raises(OSError, match="Read-only file system"):
            mr.create(os.path.join(fs, "other"), SPEC, capacity=10)
        assert_healthy(path)  # verify only reads
        one_line_error(run_cli("recover", path), 6, "Read-only")
        assert files_of(path) == before
    finally:
        remount(fs, "rw")


# --- the same faults without root: a file size limit, a read-only bind mount -----------------


def run_with_file_limit(code: str, limit: int) -> subprocess.CompletedProcess:
    """Run ``code`` in a process whose files may not grow past ``limit`` bytes (``ulimit
    -f``): a write past it fails with EFBIG, as on a full disk it fails with ENOSPC
    (SIGXFSZ is ignored, so the write fails instead of killing the process)."""

    def limit_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_files,
    )


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_file_size_limit_at_creation_is_an_error_and_leaves_nothing(tmp_path, backend):
    code = f"""
    import mmreplay as mr
    try:
        mr.create({str(tmp_path / "b")!r}, {{"x": mr.ArraySpec((1024,), "uint8")}}, capacity=4096, backend={backend!r})
    except mr.DiskFullError as exc:
        print(exc)
    """
    done = run_with_file_limit(code, 1 << 20)
    assert "needs" in done.stdout and "ulimit -f" in done.stdout, done.stdout + done.stderr
    assert os.listdir(tmp_path) == []


#: the child's own file size limit, set and lifted around one commit (SIGXFSZ ignored)
FILE_LIMIT = """
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

def file_limit(limit):
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard if limit is None else limit, hard))
"""

#: under the limit the state file (1,024 bytes, two slots) can still be written in place
STATE_ROOM = 1024

COMMIT_AT_THE_LIMIT = FILE_LIMIT + """
import json, sys, numpy as np, mmreplay as mr
sys.path.insert(0, {tests!r})
from conftest import folder_digest
path = {path!r}
store = mr.open(path, "a")
store.add({{"obs": np.full((1, 4), 2, "float32"), "action": np.full(1, 2, "int64")}})
before = folder_digest(path)
file_limit({limit})  # from here no file is written past byte {limit}
store.commit()
file_limit(None)
after = folder_digest(path)
store.close()
print(json.dumps({{"before": before, "after": after}}))
"""


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_a_commit_needs_no_free_space_under_a_file_size_limit(tmp_path, backend):
    """The tmpfs test above without root: during the commit no file may be written past
    its first 1,024 bytes (the state file's size), and the commit must change no file but
    the state file (a small file rewritten by rename would need new blocks on a full
    disk). The data files are far larger: the rows are in them through their mappings."""
    path = str(tmp_path / "b")
    spec = {"obs": mr.ArraySpec((4,), "float32"), "action": mr.ArraySpec((), "int64")}
    with mr.create(path, spec, capacity=1000, backend=backend, commit_every=10**6) as store:
        store.add({"obs": np.ones((1, 4), "float32"), "action": np.ones(1, "int64")})
    data = [f for f in files_of(path) if f not in (STATE_FILE, ".lock") and not f.endswith(".json")]
    assert data and all(os.path.getsize(os.path.join(path, f)) > STATE_ROOM for f in data), data
    tests = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(COMMIT_AT_THE_LIMIT.format(path=path, limit=STATE_ROOM, tests=tests))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = report["before"], report["after"]
    changed = {f for f in before.keys() | after.keys() if before.get(f) != after.get(f)}
    assert changed == {STATE_FILE}, changed
    assert leftovers(path) == []
    with mr.open(path) as reader:
        assert len(reader) == 2 and reader.get(1)["action"][0] == 2
    assert_healthy(path)


EPISODE_ENDS_AT_THE_LIMIT = FILE_LIMIT + """
import json, os, numpy as np, mmreplay as mr
from mmreplay.verify import leftovers
path = {path!r}
state = os.path.join(path, {state!r})
store = mr.open(path, "a")
# every step ends an episode: the commit appends 2,000 records (32 KB) to episodes.idx
store.extend({{"obs": np.full((2000, 1), 2, "float32"), "terminated": np.ones((2000, 1), bool)}})
before = open(state, "rb").read()
file_limit({limit})  # the state slot could still be written; the records cannot
try:
    store.commit()
    error = None
except mr.DiskFullError as exc:
    error = str(exc)
file_limit(None)
report = {{"error": error, "state_kept": open(state, "rb").read() == before, "leftovers": leftovers(path)}}
store.commit()  # room again
store.close()
print(json.dumps(report))
"""


def test_episode_ends_past_a_file_size_limit_keep_the_previous_state(tmp_path):
    """The tmpfs test above without root: the episode index cannot grow past 1,024
    bytes, which leaves the state file writable, so only the commit's order keeps its
    state from naming steps whose episode ends are not recorded."""
    path = str(tmp_path / "b")
    spec = {"obs": mr.ArraySpec((), "float32"), "terminated": mr.ArraySpec((), "bool")}
    with mr.create(path, spec, capacity=4000, commit_every=10**6) as store:
        store.add({"obs": np.ones(1, "float32"), "terminated": np.ones(1, bool)})
    assert os.path.getsize(os.path.join(path, STATE_FILE)) == STATE_ROOM
    assert os.path.getsize(os.path.join(path, "episodes.idx")) < STATE_ROOM
    code = textwrap.dedent(EPISODE_ENDS_AT_THE_LIMIT.format(path=path, state=STATE_FILE, limit=STATE_ROOM))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["error"] and "episode ends" in report["error"] and "ulimit -f" in report["error"], report
    assert report["state_kept"] and report["leftovers"] == [], report
    with mr.open(path) as reader:
        assert len(reader) == 2001 and len(reader.episode_index()) == 2001
    assert_healthy(path)


def fill_past_file_limit(path: str) -> dict:
    """A compressed HDF5 store written in a process whose files may not grow past
    512 KiB more than the store's: the file grows with each chunk until one is refused."""
    mr.create(path, SPEC, capacity=5000, num_envs=ENVS, backend="hdf5", compression="gzip", chunk_steps=4).close()
    limit = os.path.getsize(os.path.join(path, "data.h5")) + (512 << 10)
    done = run_with_file_limit(FILL_UNTIL_FULL.format(path=path, envs=ENVS), limit)
    # the script ends with its writer open: the commit at exit fails too, and says so
    assert "closing the store left open failed" in done.stderr, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def past_file_limit(tmp_path_factory) -> Callable[[str], dict]:
    """A copy at PATH of one store filled until the file size limit refused a chunk (made
    once: filling takes a while); returns the filling writer's report."""
    made = str(tmp_path_factory.mktemp("limit") / "b")
    report = fill_past_file_limit(made)

    def copy(path: str) -> dict:
        shutil.copytree(made, path)
        return report

    return copy


def cli_with_file_limit(limit: int, *args) -> subprocess.CompletedProcess:
    """``mmreplay ARGS...`` in a fresh process under a file size limit (SIGXFSZ ignored)."""
    code = f"import sys; sys.argv = ['mmreplay', *{list(map(str, args))!r}]; from mmreplay.cli import main; main()"
    return run_with_file_limit(code, limit)


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_outputs_past_a_file_size_limit_name_the_output(tmp_path, backend):
    """A create or convert past the limit named its scratch folder (``..OUT.partial-PID.
    creating-PID/...``) or, for hdf5, a temporary file of its own in /tmp; an npz export
    said ``[Errno 27] File too large`` and no file, a pt export a traceback."""
    src = str(tmp_path / "src")
    with mr.create(src, {"x": mr.ArraySpec((256,), "float32")}, 2000, backend=backend) as store:
        store.extend({"x": np.ones((2000, 1, 256), "float32")})
    (tmp_path / "spec.json").write_text('{"x": {"shape": [256], "dtype": "float32"}}')
    runs = {
        "copy": ["convert", src, "{out}", "--compression", "none"],
        "made": ["create", "{out}", "--spec", tmp_path / "spec.json", "--capacity", "2000", "--backend", backend],
        "out.npz": ["export", src, "{out}", "-q"],
        "out.pt": ["export", src, "{out}", "-q"],  # torch itself says only "iostream error"
    }
    for name, args in runs.items():
        out = str(tmp_path / name)
        done = cli_with_file_limit(1 << 20, *[out if a == "{out}" else a for a in args])
        line = one_line_error(done, 2, f"Error: {out}", "ulimit -f")
        assert ".partial" not in line and ".creating" not in line and "[Errno" not in line, line
        assert sorted(os.listdir(tmp_path)) == ["spec.json", "src"]


def test_file_size_limit_during_chunk_writes_keeps_every_commit(tmp_path, past_file_limit):
    path = str(tmp_path / "b")
    report = past_file_limit(path)
    assert "DiskFullError" in report["mro"] and "ulimit -f" in report["message"], report
    assert report["committed"] > 0
    first, end = assert_exact(path)  # every commit made before the limit is intact
    assert end == report["committed"]


def test_a_writer_resumes_after_the_file_size_limit(tmp_path, past_file_limit):
    """The refused chunk's space is past the file's end but inside the end HDF5 recorded
    (its close could not extend the file past the limit): nothing committed lies there,
    so the next writer extends the file and goes on with every committed row."""
    path = str(tmp_path / "b")
    past_file_limit(path)
    data = os.path.join(path, "data.h5")
    assert os.path.getsize(data) < hdf5_status(data)[1]  # the fault this is about
    end = assert_exact(path)[1]
    assert_detected(path, "before the end HDF5 recorded", "no committed chunk")
    size = os.path.getsize(data)
    still_limited = f'''
    import mmreplay as mr
    try:
        mr.open({path!r}, "a")
    except mr.DiskFullError as exc:
        print(exc)
    '''
    done = run_with_file_limit(still_limited, size)  # the limit still there: no room to extend
    assert "no room to extend" in done.stdout and "ulimit -f" in done.stdout, done.stdout + done.stderr
    assert os.path.getsize(data) == size
    with mr.open(path, "a") as store:  # no limit here: the next writer resumes
        assert store.total_steps == end
        store.extend(steps(end, end + 8))
    assert assert_exact(path)[1] == end + 8
    assert_healthy(path)


def test_recover_after_the_file_size_limit_loses_nothing(tmp_path, past_file_limit):
    path = str(tmp_path / "b")
    past_file_limit(path)
    window = assert_exact(path)
    report = recover_cli(path)
    assert report.ok and report.lost is None, str(report)
    assert any("extended data.h5" in a for a in report.actions), str(report)
    assert assert_exact(path) == window
    assert_healthy(path)


def test_a_file_cut_through_a_chunk_is_not_extended(tmp_path):
    """Only a tail that nothing references is restored: a file cut short through a chunk
    is refused for writing, and left as it is for ``mmreplay recover``."""
    path = fill(tmp_path / "b", 30, "hdf5", "gzip")
    data = os.path.join(path, "data.h5")
    with h5py.File(data, "r") as f:
        ends: list[int] = []
        f["obs/pixels"].id.chunk_iter(lambda info: ends.append(info.byte_offset + info.size))
    cut = max(ends) - 1
    _truncate(data, cut)
    with pytest.raises(mr.CorruptBufferError, match="truncated.*chunks of 'obs/pixels' end past it"):
        mr.open(path, "a")
    assert os.path.getsize(data) == cut
    assert_detected(path, "truncated")


READ_ONLY = """
import os, numpy as np, pytest, mmreplay as mr
from mmreplay.spec import flatten
from mmreplay.torture import SPEC, step_values
from mmreplay.verify import recover, verify
path = {path!r}
with mr.open(path) as store:  # readers work
    ids = np.arange(store.first_step, store.committed_steps)
    assert len(ids) == 30
    for got, want in zip(store.read_steps(ids), step_values(flatten(SPEC), {envs}, ids)):
        assert got.tobytes() == want.tobytes()
with pytest.raises(mr.ReadOnlyError, match="Read-only file system"):
    mr.open(path, "a")
with pytest.raises(OSError, match="Read-only file system"):
    mr.create(os.path.join(os.path.dirname(path), "other"), SPEC, capacity=10)
assert verify(path) == []  # verify only reads
with pytest.raises(mr.ReadOnlyError):
    recover(path)
print("ok")
"""


@pytest.mark.parametrize(("backend", "compression"), spread(LAYOUT_AXIS, normal=["zarr-zstd", "hdf5-mapped"]))
def test_read_only_bind_mount(tmp_path, backend, compression):
    """A read-only folder that root cannot write either: a read-only bind mount in a
    private mount namespace (``unshare -rm``, no root needed)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    folder = tmp_path / "ro"
    folder.mkdir()
    path = fill(folder / "b", 30, backend, compression)
    before = folder_digest(path)
    mount_ro = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" "$1" && exec "$2" -c "$3"'
    code = textwrap.dedent(READ_ONLY.format(path=path, envs=ENVS))
    done = subprocess.run(
        [unshare, "-rm", "sh", "-c", mount_ro, "sh", str(folder), sys.executable, code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 and "ok" not in done.stdout and "Traceback" not in done.stderr:
        pytest.skip(f"no private read-only mount here (user namespaces disabled?): {done.stderr.strip()}")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert folder_digest(path) == before


# --- damaged metadata --------------------------------------------------------------------


@pytest.mark.parametrize(("keep", "backend", "compression"), spread([0, 1, 40, 0.5, -2, -40], LAYOUT_AXIS))
def test_truncated_metadata_is_refused(tmp_path, backend, compression, keep):
    path = fill(tmp_path / "b", 12, backend, compression)
    meta_path = os.path.join(path, METADATA_FILE)
    raw = open(meta_path, "rb").read()
    cut = int(len(raw) * keep) if isinstance(keep, float) else keep % len(raw)
    with open(meta_path, "wb") as f:
        f.write(raw[:cut])
    for mode in ("r", "a"):
        with pytest.raises(mr.CorruptBufferError):
            mr.open(path, mode)
    assert_detected(path, METADATA_FILE)
    # nothing to rebuild from: it says so and touches nothing
    one_line_error(run_cli("recover", path), 4, "no readable copy")
    assert open(meta_path, "rb").read() == raw[:cut]


def _garble(path, find: bytes, replace: bytes) -> None:
    meta_path = os.path.join(path, METADATA_FILE)
    raw = open(meta_path, "rb").read()
    assert raw.count(find) >= 1, find
    with open(meta_path, "wb") as f:
        f.write(raw.replace(find, replace, 1))


GARBLES = {
    "attrs": (b'"attrs": {}', b'"attrs": {"a": 1}'),
    "capacity": (b'"capacity": 40', b'"capacity": 20'),
    "chunking": (b'"chunk_steps": 4', b'"chunk_steps": 2'),
    "shape": (b'"shape": [\n    5\n   ]', b'"shape": [\n    4\n   ]'),
    "role": (b'"reward": "reward"', b'"reward": "action"'),
    "noise": (b'"format"', b'"fo\x00mat"'),
}


#: garbles after which the damaged file no longer describes the data: recover refuses
REFUSED = {"capacity", "shape", "noise"}


#: each garble once, and chunking where it is refused and where it is not
GARBLED = ["attrs-zarr-mapped", "capacity-zarr-zstd", "chunking-hdf5-mapped", "chunking-zarr-zstd", "noise-hdf5-gzip"]
GARBLED += ["role-zarr-mapped", "shape-hdf5-gzip"]


@pytest.mark.parametrize(("what", "backend", "compression"), spread(sorted(GARBLES), LAYOUT_AXIS, normal=GARBLED))
def test_garbled_metadata_is_refused_then_recovered_empty(tmp_path, backend, compression, what):
    path = fill(tmp_path / "b", 30, backend, compression)
    _garble(path, *GARBLES[what])
    for mode in ("r", "a"):
        with pytest.raises(mr.CorruptBufferError):
            mr.open(path, mode)
    assert_detected(path, METADATA_FILE)
    # chunking only describes how the data is laid out when chunks are stored
    refused = what in REFUSED or (what == "chunking" and (backend, compression) != ("hdf5", None))
    if refused:
        before = {f: open(os.path.join(path, f), "rb").read() for f in files_of(path)}
        one_line_error(run_cli("recover", path), 4, "backup")
        assert {f: open(os.path.join(path, f), "rb").read() for f in files_of(path)} == before
        return
    report = recover_cli(path)
    assert report.ok, str(report)
    assert report.lost is not None and "lost committed steps" in str(report)
    assert_healthy(path)
    with mr.open(path, "a") as store:  # a usable, empty buffer with the same layout
        assert len(store) == 0 and store.capacity == 40
        g = store.total_steps
        store.extend(steps(g, g + 5))
    with mr.open(path) as store:
        ids = np.arange(store.first_step, store.committed_steps)
        assert len(ids) == 5
        assert all(
            a.tobytes() == b.tobytes() for a, b in zip(store.read_steps(ids), step_values(LEAVES, ENVS, ids))
        )


def test_garbled_metadata_rebuilt_from_a_killed_commits_copy(tmp_path):
    path = fill(tmp_path / "b", 30)
    raw = open(os.path.join(path, METADATA_FILE), "rb").read()
    with open(os.path.join(path, f"{METADATA_FILE}.4242.tmp"), "wb") as f:
        f.write(raw)  # a complete copy a killed commit left behind
    with open(os.path.join(path, f"{METADATA_FILE}.4243.tmp"), "wb") as f:
        f.write(raw[:100])  # and a torn one
    _garble(path, b'"commit_every": 1000', b'"commit_every": 1001')
    report = recover_cli(path)
    assert report.ok and report.lost == (0, 30)
    assert any("4242.tmp" in a for a in report.actions)
    assert leftovers(path) == []
    assert read_metadata(path).state.end == 30  # the step count goes on


@pytest.mark.parametrize(("backend", "compression"), LAYOUTS, ids=LAYOUT_IDS)
def test_format_from_the_future_is_refused_and_left_alone(tmp_path, backend, compression):
    path = fill(tmp_path / "b", 5, backend, compression)
    _garble(path, b'"format": "mmreplay/2"', b'"format": "mmreplay/3"')
    raw = open(os.path.join(path, METADATA_FILE), "rb").read()
    for mode in ("r", "a"):
        with pytest.raises(mr.UnsupportedFormatError, match="newer.*upgrade mmreplay"):
            mr.open(path, mode)
    # no damage: verify refuses as recover does, not "problems; recover repairs them"
    one_line_error(run_cli("verify", path), 4, "upgrade mmreplay")
    one_line_error(run_cli("recover", path), 4, "upgrade mmreplay")
    assert open(os.path.join(path, METADATA_FILE), "rb").read() == raw
    one_line_error(run_cli("inspect", path), 4, "upgrade mmreplay")


# --- damaged data files --------------------------------------------------------------------


def _truncate(file: str, size: int) -> None:
    with open(file, "r+b") as f:
        f.truncate(size)


def _zarr_shard(path, leaf: str) -> str:
    meta = read_metadata(path)
    info = next(x for x in meta.leaves if x.path == leaf)
    return os.path.join(path, info.file)


def _zarr_chunk(path, leaf: str, k: int) -> str:
    ndim = 2 + len(next(s for p, s in zip(mr.spec.leaf_paths(SPEC), LEAVES) if p == leaf).shape)
    return os.path.join(path, "data.zarr", leaf, "c", str(k), *["0"] * (ndim - 1))


def _recovered_keeps_the_rest(path, lost_through: int, end: int = 30) -> None:
    report = recover_cli(path)
    assert report.ok, str(report)
    assert report.lost is not None and report.lost[1] >= lost_through, str(report)
    assert "lost committed steps" in str(report)
    first, new_end = assert_exact(path)
    assert new_end == end and first == report.lost[1]
    assert_healthy(path)
    with mr.open(path, "a") as store:  # and collection goes on
        store.extend(steps(end, end + 3))
    assert assert_exact(path)[1] == end + 3


def test_zarr_mapped_leaf_truncated(tmp_path):
    path = fill(tmp_path / "b", 30)
    shard = _zarr_shard(path, "obs/pixels")
    _truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(mr.CorruptBufferError, match="truncated"):
        mr.open(path)
    assert_detected(path, "obs/pixels")
    _recovered_keeps_the_rest(path, lost_through=20)


def test_zarr_mapped_leaf_missing(tmp_path):
    path = fill(tmp_path / "b", 30)
    os.remove(_zarr_shard(path, "action"))
    with pytest.raises(mr.CorruptBufferError, match="missing"):
        mr.open(path)
    assert_detected(path, "missing")
    report = recover_cli(path)
    assert report.ok and report.lost == (0, 30)
    assert assert_exact(path) == (30, 30)


def test_zarr_data_folder_missing_is_recreated_empty(tmp_path):
    path = fill(tmp_path / "b", 30, compression={"obs/pixels": "zstd"})
    shutil.rmtree(os.path.join(path, "data.zarr"))
    assert_detected(path, "data folder is missing")
    report = recover_cli(path)
    assert report.ok and report.lost == (0, 30), str(report)
    assert assert_exact(path) == (30, 30)
    assert_healthy(path)
    with mr.open(path, "a") as store:
        store.extend(steps(30, 33))
    assert assert_exact(path) == (30, 33)


def test_zarr_shard_index_damaged(tmp_path):
    """The mapped rows are intact but zarr readers would read garbage through the index."""
    path = fill(tmp_path / "b", 30)
    shard = _zarr_shard(path, "reward")
    with open(shard, "r+b") as f:
        f.seek(-16, 2)
        f.write(b"\xff" * 16)
    assert_detected(path, "shard index")
    report = recover_cli(path)
    assert report.ok and report.lost is None  # nothing lost
    assert assert_exact(path) == (0, 30)


@pytest.mark.parametrize("leaf", ["action", "obs/pixels"])
def test_zarr_array_metadata_lost_is_restored_without_loss(tmp_path, leaf):
    path = fill(tmp_path / "b", 30, compression={"obs/pixels": "zstd"})
    os.remove(os.path.join(path, "data.zarr", leaf, "zarr.json"))
    os.remove(os.path.join(path, "data.zarr", "zarr.json"))
    assert_detected(path, "zarr.json")
    report = recover_cli(path)
    assert report.ok and report.lost is None, str(report)
    assert assert_exact(path) == (0, 30)


@pytest.mark.parametrize("damage", ["missing", "garbled", "truncated"])
def test_zarr_compressed_chunk_damaged(tmp_path, damage):
    path = fill(tmp_path / "b", 30, compression="zstd")
    chunk = _zarr_chunk(path, "obs/state", 2)  # steps 8..11
    if damage == "missing":
        os.remove(chunk)
    elif damage == "garbled":
        raw = bytearray(open(chunk, "rb").read())
        raw[len(raw) // 2 :] = bytes(len(raw) - len(raw) // 2)
        open(chunk, "wb").write(bytes(raw))
    else:
        _truncate(chunk, 5)
    with mr.open(path) as store:  # opens, but reading those rows is an error, not zeros
        store.get(20)
        with pytest.raises(mr.CorruptBufferError, match="chunk 2"):
            store.get(9)
    # the one line says which file holds the chunk
    one_line_error(run_cli("export", path, str(tmp_path / "out.npz"), "-f", "npz", "-q"), 4, chunk, "chunk 2")
    assert_detected(path, "obs/state")
    _recovered_keeps_the_rest(path, lost_through=12)


def test_hdf5_compressed_chunk_garbled_names_its_file(tmp_path):
    path = fill(tmp_path / "b", 30, "hdf5", "gzip")
    data = os.path.join(path, "data.h5")
    with h5py.File(data, "r") as f:
        info = f["obs/state"].id.get_chunk_info_by_coord((8,) + (0,) * (f["obs/state"].ndim - 1))  # steps 8..11
    with open(data, "r+b") as f:
        f.seek(info.byte_offset)
        f.write(bytes(info.size))
    one_line_error(run_cli("export", path, str(tmp_path / "out.npz"), "-f", "npz", "-q"), 4, data, "chunk 2")


def test_hdf5_mapped_file_truncated(tmp_path):
    path = fill(tmp_path / "b", 30, "hdf5")
    data = os.path.join(path, "data.h5")
    meta = read_metadata(path)
    last = max(meta.leaves, key=lambda x: x.offset)  # cut into the last leaf, at step 25's slot
    _truncate(data, last.offset + 25 * ENVS * last.spec.nbytes)
    with pytest.raises(mr.CorruptBufferError, match="truncated"):
        mr.open(path)
    assert_detected(path, "truncated")
    _recovered_keeps_the_rest(path, lost_through=26)


@pytest.mark.parametrize("damage", ["truncated", "cut-at-objects", "cut-at-index", "missing", "garbled"])
def test_hdf5_compressed_file_damaged(tmp_path, damage):
    path = fill(tmp_path / "b", 30, "hdf5", "gzip")
    with mr.open(path, "a") as store:  # a later commit: the chunk journal holds only its chunks
        store.extend(steps(30, 32))
    data = os.path.join(path, "data.h5")
    if damage == "truncated":
        _truncate(data, os.path.getsize(data) * 2 // 3)
    elif damage.startswith("cut-at"):  # recover extends it: zeros where checksummed metadata was
        _truncate(data, os.path.getsize(data) // (40 if damage == "cut-at-objects" else 8))
    elif damage == "missing":
        os.remove(data)
    else:
        with open(data, "r+b") as f:
            f.seek(0)
            f.write(b"\x00" * 64)  # the superblock
    with pytest.raises(mr.CorruptBufferError):  # at open, or at the latest when the lost rows are read
        with mr.open(path) as store:
            store.get(slice(None))
    assert_detected(path, "data.h5")
    report = recover_cli(path)  # the chunk index cannot be trusted: a fresh, empty file
    assert report.ok and report.lost == (0, 32), str(report)
    assert assert_exact(path) == (32, 32)
    with mr.open(path, "a") as store:
        store.extend(steps(32, 36))
    assert assert_exact(path) == (32, 36)


# --- writers ------------------------------------------------------------------------------

HOLD = """
import sys, time, numpy as np, mmreplay as mr
from mmreplay.spec import flatten, unflatten
from mmreplay.torture import SPEC, step_values
store = mr.open({path!r}, "a")
store.extend(unflatten(SPEC, step_values(flatten(SPEC), {envs}, np.arange(store.total_steps, store.total_steps + 5))))
store.commit()
store.extend(unflatten(SPEC, step_values(flatten(SPEC), {envs}, np.arange(store.total_steps, store.total_steps + 2))))
print("ready", flush=True)
{then}
"""


def _writer(writers, path, then: str) -> subprocess.Popen:
    proc = writers.start(textwrap.dedent(HOLD.format(path=path, envs=ENVS, then=then)))
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize(("backend", "compression"), spread(LAYOUT_AXIS, normal=["zarr-zstd", "hdf5-mapped"]))
def test_second_writer_is_refused(tmp_path, writers, backend, compression):
    path = fill(tmp_path / "b", 10, backend, compression)
    proc = _writer(writers, path, "time.sleep(60)")
    with pytest.raises(mr.LockedError, match=f"process {proc.pid}"):
        mr.open(path, "a")
    with pytest.raises(mr.LockedError):
        mr.create(path, SPEC, capacity=40, num_envs=ENVS, backend=backend, compression=compression, exist_ok=True)
    assert assert_exact(path) == (0, 15)  # readers are welcome
    result = run_cli("verify", path)
    assert result.returncode == 0 and f"process {proc.pid}" in result.stderr
    one_line_error(run_cli("recover", path), 5, f"process {proc.pid}")


def test_second_writer_in_the_same_process_is_refused(tmp_path):
    path = fill(tmp_path / "b", 3)
    with mr.open(path, "a"):
        with pytest.raises(mr.LockedError, match=f"process {os.getpid()}"):
            mr.open(path, "a")


@pytest.mark.parametrize(("backend", "compression"), spread(LAYOUT_AXIS, normal=["zarr-mapped", "hdf5-gzip"]))
def test_dead_writers_lock_is_released_by_the_os(tmp_path, writers, backend, compression):
    path = fill(tmp_path / "b", 10, backend, compression)
    proc = _writer(writers, path, "time.sleep(60)")
    writers.kill(proc)
    lock = os.path.join(path, ".lock")
    assert os.path.exists(lock) and open(lock).read().strip() == str(proc.pid)  # a stale file, no lock
    assert assert_exact(path) == (0, 15)  # the commit survived, the uncommitted steps did not show
    with mr.open(path, "a") as store:
        assert store.total_steps == 15
        store.extend(steps(15, 20))
    assert assert_exact(path) == (0, 20)
    assert_healthy(path)


def test_recover_after_a_killed_hdf5_writer_clears_its_flags(tmp_path, writers):
    """recover holds the lock itself: the flags are a dead writer's, though a live holder shows."""
    path = fill(tmp_path / "b", 10, "hdf5", "gzip")
    writers.kill(_writer(writers, path, "time.sleep(60)"))
    assert any("writer that died" in p for p in verify_cli(path)[1])
    report = recover_cli(path)
    assert report.ok and report.lost is None, str(report)
    assert verify_cli(path) == (0, [])
    assert assert_exact(path) == (0, 15)


# --- the episode index ---------------------------------------------------------------------

EPISODE_DAMAGE = {
    "header": lambda raw: b"NOTANIDX" + raw[8:],
    "an end code": lambda raw: (
        raw[: 32 + 16 * 2 + 12] + bytes([raw[32 + 16 * 2 + 12] % 2 + 1]) + raw[32 + 16 * 2 + 13 :]
    ),
    "an env": lambda raw: raw[: 32 + 16 * 2 + 8] + (77).to_bytes(4, "little") + raw[32 + 16 * 2 + 12 :],
    "order": lambda raw: raw[:32] + raw[48:64] + raw[32:48] + raw[64:],
    "a lost record": lambda raw: raw[:32] + raw[48:],
}


@pytest.mark.parametrize("damage", sorted(EPISODE_DAMAGE))
def test_damaged_episode_index_is_found_and_rebuilt(tmp_path, damage):
    path = fill(tmp_path / "b", 30)
    with mr.open(path) as store:
        episodes = store.episode_index()
    index = os.path.join(path, "episodes.idx")
    raw = open(index, "rb").read()
    assert len(raw) > 32 + 16 * 4
    with open(index, "wb") as f:
        f.write(EPISODE_DAMAGE[damage](raw))
    assert_detected(path, "episode index")
    report = recover_cli(path)
    assert report.ok and report.lost is None, str(report)
    with mr.open(path, "a") as store:  # rebuilt from the role leaves
        assert store.episode_index() == episodes
    assert_healthy(path)


def test_a_torn_last_episode_record_is_not_damage(tmp_path):
    """A writer killed while appending leaves part of a record: readers ignore it and the
    next writer cuts it off."""
    path = fill(tmp_path / "b", 30)
    with open(os.path.join(path, "episodes.idx"), "ab") as f:
        f.write(b"\x01\x02\x03")
    assert_healthy(path)
    with mr.open(path, "a") as store:
        store.extend(steps(30, 33))
    assert_healthy(path)


def test_cli_recover_says_what_was_lost(tmp_path):
    path = fill(tmp_path / "b", 30, compression="zstd")
    os.remove(_zarr_chunk(path, "reward", 1))  # steps 4..7
    result = run_cli("recover", path)
    assert result.returncode == 0, result.stderr
    assert (
        "lost committed steps [0, 8) (8 steps)" in result.stdout
        and "kept committed steps [8, 30)" in result.stdout
    )
    assert result.stdout.strip().endswith(": ok")
    assert_healthy(path)


def test_cli_recover_refuses_what_it_cannot_rebuild(tmp_path):
    path = fill(tmp_path / "b", 3)
    with open(os.path.join(path, METADATA_FILE), "wb") as f:
        f.write(b"{")
    one_line_error(run_cli("recover", path), 4, "backup")


@pytest.mark.parametrize("mode", ["r", "a"])
def test_a_data_file_replaced_by_a_folder_is_an_error(tmp_path, mode):
    path = fill(tmp_path / "b", 5)
    shard = _zarr_shard(path, "reward")
    os.remove(shard)
    os.mkdir(shard)
    with pytest.raises(mr.CorruptBufferError, match="expected a data file"):
        mr.open(path, mode)
    assert_detected(path, "not a regular file")
    report = recover_cli(path)
    assert report.ok and report.lost == (0, 5), str(report)


def unprivileged(*args) -> subprocess.CompletedProcess:
    """``mmreplay ARGS...`` in a fresh process that file permissions apply to (as root:
    without the capabilities that override them)."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: file permissions cannot be made to apply")
        caps = "-dac_override,-dac_read_search"
        prefix = ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}"]
    cmd = [*prefix, sys.executable, "-m", "mmreplay.cli", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("backend", "compression"), [("hdf5", "gzip"), ("zarr", "zstd")])
def test_a_file_that_may_not_be_read_is_no_damage(tmp_path, backend, compression):
    """verify called an unreadable data.h5 or chunk damage, and recover dropped every
    committed step, moving the file aside and writing an empty one, then said ok."""
    path = fill(str(tmp_path / "b"), 30, backend=backend, compression=compression)
    window = assert_exact(path)
    data = os.path.join(path, "data.h5") if backend == "hdf5" else _zarr_chunk(path, "obs/state", 0)
    before = files_of(path)
    os.chmod(data, 0)
    try:
        for command in ("verify", "recover"):
            one_line_error(unprivileged(command, path), 6, data, "Permission denied")
            assert files_of(path) == before
    finally:
        os.chmod(data, 0o644)
    assert assert_exact(path) == window
    assert_healthy(path)


def test_cli_verify_on_a_folder_that_is_no_buffer(tmp_path):
    one_line_error(run_cli("verify", tmp_path), 3, "not an mmreplay buffer")


# --- after a full disk, a commit covers only rows that reached the files ---------------------

FULL_THEN_ROOM = FILL_LOOP + """
report = {{"error": type(error).__name__, "message": str(error), "committed": store.committed_steps}}
os.remove({filler!r})  # room again
if {close!r}:
    try:
        store.close()
    except mr.Error as exc:
        report["close"] = type(exc).__name__
print(json.dumps(report), flush=True)
"""


@pytest.mark.parametrize(
    ("backend", "codec", "close"),
    spread({"zarr-zstd": ("zarr", "zstd"), "hdf5-gzip": ("hdf5", "gzip"), "zarr-rows:lz4": ("zarr", "rows:lz4")},
           {"close": True, "exit-hook": False}),
)  # fmt: skip
def test_disk_full_then_room_again_commits_only_rows_that_reached_the_files(tmpfs, backend, codec, close):
    """A chunk (or segment) write refused by a full disk; then the space comes back and the
    store is closed, by hand or by the exit hooks: whatever that commits is bit-exact (the
    refused chunk's rows were not dropped on the way), the refusal is a DiskFullError, and
    the next writer goes on."""
    fs = tmpfs("1m")
    path = os.path.join(fs, "b")
    mr.create(path, SPEC, capacity=5000, num_envs=ENVS, backend=backend, compression=codec, chunk_steps=4).close()
    filler = os.path.join(fs, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * (600 << 10))
    code = textwrap.dedent(FULL_THEN_ROOM.format(path=path, envs=ENVS, filler=filler, close=close))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["error"] == "DiskFullError" and "no space" in report["message"], report
    assert report.get("close") in (None, "DiskFullError"), report  # a sealing refused stays refused
    first, end = assert_exact(path)
    assert end >= report["committed"] > 0
    assert_healthy_or_only_flags(path)
    with mr.open(path, "a") as store:
        assert store.total_steps == end
        store.extend(steps(end, end + 8))
    assert assert_exact(path)[1] == end + 8
    assert_healthy(path)


def test_verify_finds_a_committed_hdf5_chunk_that_was_never_stored(tmp_path):
    """h5py reads a chunk that was never stored as zeros; verify must not take that for
    data (the store's readers refuse it), and recover drops the steps it held."""
    from mmreplay.statefile import StateFile

    path = str(tmp_path / "b")
    with mr.create(path, {"x": mr.ArraySpec((3,), "float32")}, 40, backend="hdf5", compression="gzip", chunk_steps=4) as store:
        store.extend({"x": np.ones((8, 1, 3), "float32")})
    with mr.open(path) as store:  # a state that commits steps whose chunks were never stored
        StateFile(path, True).write(store.state.next(end=20, reserved=20), fsync=False)
        store.refresh()
        with pytest.raises(mr.CorruptBufferError, match="chunk 2 .* missing"):
            store.get(slice(None))
    problems = assert_detected(path, "chunk 2 (slots 8..11) holds committed steps but was never stored")
    assert len(problems) == 3  # chunks 2, 3 and 4
    report = recover_cli(path)
    assert report.ok and report.lost == (0, 20), str(report)
    assert_healthy(path)


def test_verify_says_what_it_checked_and_what_it_cannot(tmp_path):
    path = fill(tmp_path / "b", 10, compression={"obs/pixels": "zstd"})
    out = run_cli("verify", path)
    assert out.returncode == 0 and out.stdout.strip().endswith(": ok"), out.stdout + out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("checked: ")]
    text = "\n".join(lines)
    assert "chunk-compressed leaves 'obs/pixels': every chunk holding committed steps was stored" in text, text
    assert "memory-mapped leaves 'action', 'obs/state', 'reward', 'terminated'" in text, text
    assert "a row holding another step's bytes is not found" in text, text


def test_an_extend_refused_by_a_full_disk_leaves_an_episode_index_verify_accepts(tmpfs):
    """An extend cut short gives up the steps whose slots it may have reached; the next
    commit records the ends of retained steps only (it once recorded the given-up steps'
    ends below the index's origin, and verify called the index out of order)."""
    fs = tmpfs("2m")
    path = os.path.join(fs, "b")
    spec = {"x": mr.ArraySpec((4096,), "uint8"), "terminated": mr.ArraySpec((), "bool")}
    rng = np.random.default_rng(0)

    def steps(lo: int, n: int) -> dict:
        return {
            "x": rng.integers(0, 256, (n, 1, 4096), dtype=np.uint8),  # incompressible: chunks take room
            "terminated": (np.arange(lo, lo + n) % 3 == 2).reshape(n, 1),
        }

    store = mr.create(path, spec, 150, compression="zstd", chunk_steps=41, commit_every=10**6)
    filler = os.path.join(fs, "filler")
    with open(filler, "wb") as f:
        f.write(b"\0" * (shutil.disk_usage(fs).free - 300 * 1024))
    with pytest.raises(mr.DiskFullError):
        store.extend(steps(0, 185))
    os.remove(filler)
    g = store.total_steps
    store.extend(steps(g, 60))
    store.close()
    assert_healthy(path)
    with mr.open(path) as reader:
        ends = [(e.first_step, e.last_step) for e in reader.episodes(0)]
        assert len(ends) > 5 and all(last % 3 == 2 for _, last in ends[:-1])


def test_an_episode_index_left_by_a_commit_that_never_happened_is_rebuilt(tmp_path):
    """A commit refused by a full disk after the episode index was written (here: an index
    file made for a window starting at step 120, over a store with nothing committed)
    leaves the next writer an index whose origin is past its committed window; it once
    appended the ends of steps 0.. under that origin, and verify called the index out of
    order."""
    from mmreplay.episodes.index_file import INDEX_FILE, RECORD, write_index

    path = str(tmp_path / "b")
    spec = {"x": mr.ArraySpec((2,), "int64"), "terminated": mr.ArraySpec((), "bool")}
    mr.create(path, spec, 143, num_envs=8, commit_every=5).close()
    write_index(os.path.join(path, INDEX_FILE), 120, np.zeros(0, RECORD), False)
    with mr.open(path, "a") as store:
        for t in range(36):
            store.add({"x": np.full((8, 2), t), "terminated": np.full(8, t % 7 == 6)})
    assert_healthy(path)
    with mr.open(path) as reader:
        assert [e.last_step for e in reader.episodes(0)][:3] == [6, 13, 20]
