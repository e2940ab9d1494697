"""``durability="power"`` really syncs, in the commit protocol's order; ``"process"`` never does.

A real commit runs under ``strace``, which records each ``fsync`` / ``fdatasync`` (with
the path of its file) and ``msync`` of the process. Two ``umask`` calls, which nothing
else makes, mark where the commit begins and ends. Skipped where strace is not
installed or may not trace (``apt-get install strace``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

STRACE = shutil.which("strace")


def _strace_works() -> str | None:
    if STRACE is None:
        return "strace is not installed (apt-get install strace)"
    done = subprocess.run([STRACE, "-f", "-qq", "-e", "trace=umask", "true"], capture_output=True, text=True)
    if done.returncode != 0:
        return f"strace cannot trace here: {done.stderr.strip()}"
    return None


pytestmark = pytest.mark.skipif(_strace_works() is not None, reason=str(_strace_works()))

COMMIT = """
import os, numpy as np, mmreplay as mr
spec = {{"obs": mr.ArraySpec((8,), "float32"), "terminated": mr.ArraySpec((), "bool")}}
store = mr.create({path!r}, spec, capacity=100, num_envs=2, backend={backend!r}, compression={compression!r},
                  durability={durability!r}, commit_every=10**6, chunk_steps=8)
store.extend({{"obs": np.ones((5, 2, 8), "float32"), "terminated": np.array([[0, 0], [1, 0], [0, 0], [0, 1], [0, 0]], bool)}})
os.umask(0o027)
store.commit()
os.umask(0o022)
store.close()
"""

SYNC = re.compile(r"\b(fsync|fdatasync|msync)\((?:\d+<([^>]*)>)?")


def commit_syncs(path: str, backend: str, compression: str | None, durability: str) -> list[tuple[str, str | None]]:
    """(call, file path or None for msync) of each sync the commit made, in order."""
    code = textwrap.dedent(
        COMMIT.format(path=path, backend=backend, compression=compression, durability=durability)
    )
    done = subprocess.run(
        [STRACE, "-f", "-y", "-qq", "-e", "trace=fsync,fdatasync,msync,umask", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    begin = next(i for i, line in enumerate(lines) if "umask(027)" in line)
    end = next(i for i, line in enumerate(lines) if "umask(022)" in line)
    return [(m[1], m[2]) for line in lines[begin:end] if (m := SYNC.search(line))]


LAYOUTS = [("zarr", None), ("zarr", "zstd"), ("hdf5", None), ("hdf5", "gzip")]


@pytest.mark.parametrize(("backend", "compression"), LAYOUTS, ids=[f"{b}-{c or 'mapped'}" for b, c in LAYOUTS])
def test_power_durability_syncs_the_data_then_the_state(tmp_path, backend, compression):
    path = str(tmp_path / "b")
    syncs = commit_syncs(path, backend, compression, "power")
    folder = os.path.realpath(path)
    data = os.path.join(folder, "data.zarr" if backend == "zarr" else "data.h5")

    def is_data(call: str, file: str | None) -> bool:
        return call == "msync" or (file is not None and file.startswith(data) and not file.endswith(".tmp"))

    data_syncs = [i for i, s in enumerate(syncs) if is_data(*s)]
    state_syncs = [i for i, (call, file) in enumerate(syncs) if file and file != folder and not is_data(call, file)]
    assert data_syncs, syncs  # the rows reach the disk...
    if compression is None:  # each mapped file once: one per zarr leaf, one data.h5 for both hdf5 leaves
        assert sum(call == "msync" for call, _ in syncs) == (2 if backend == "zarr" else 1), syncs
    elif backend == "zarr":  # every compressed leaf's chunk files
        for leaf in ("obs", "terminated"):
            assert any(f and f.startswith(os.path.join(data, leaf) + "/") for _, f in syncs), (leaf, syncs)
    assert state_syncs and max(data_syncs) < max(state_syncs), syncs  # ...before the state says so
    assert any(file == folder for _, file in syncs), syncs  # and the folder's entries


@pytest.mark.parametrize(("backend", "compression"), LAYOUTS, ids=[f"{b}-{c or 'mapped'}" for b, c in LAYOUTS])
def test_process_durability_never_syncs(tmp_path, backend, compression):
    assert commit_syncs(str(tmp_path / "b"), backend, compression, "process") == []
