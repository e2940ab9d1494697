"""Beyond Linux: the fallbacks for calls only Linux has, tried on Linux with the call taken away.

macOS has no ``posix_fallocate`` and no ``/proc``; some systems have no ``madvise``
advice. A fresh process deletes them before mmreplay is imported, then creates,
writes, reopens and samples a store, and fills a disk at creation. An optional extra
that is missing names the command that installs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

#: run first in the child: take the Linux-only calls away
NO_LINUX = """
import builtins, mmap, os
del os.posix_fallocate
for name in [n for n in dir(mmap) if n.startswith("MADV_")]:
    delattr(mmap, name)
_open = builtins.open
def no_proc(file, *args, **kwargs):
    if str(file).startswith("/proc/"):
        raise FileNotFoundError(2, "No such file or directory", str(file))
    return _open(file, *args, **kwargs)
builtins.open = no_proc
"""

ROUND_TRIP = """
import json, os, numpy as np, mmreplay as mr
from mmreplay.read.advice import memory_available
spec = {{"obs": mr.ArraySpec((64,), "float32"), "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool")}}
path = {path!r}
with mr.create(path, spec, capacity=3000, num_envs=2, backend={backend!r}, compression={compression!r}) as store:
    for t in range(500):
        store.add({{"obs": np.full((2, 64), t, "float32"), "reward": np.full(2, t, "float32"),
                    "terminated": np.array([t % 50 == 49] * 2)}})
with mr.open(path) as store:
    batch = store.sample(256, rng=0)
    seqs = store.sample(8, num_steps=20, rng=1)
    ok = bool((batch["obs"][:, 0] == batch["reward"]).all()) and bool(
        (np.diff(seqs["reward"], axis=1) == 1).all())
    out = {{"len": len(store), "ok": ok, "episodes": len(store.episode_index(complete_only=True)),
           "memory": memory_available()}}
files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
# every byte of every data file is allocated: no hole left for a SIGBUS to come from
out["holes"] = [f for f in files if os.stat(f).st_blocks * 512 < os.stat(f).st_size]
print(json.dumps(out))
"""


def run(*parts: str) -> subprocess.CompletedProcess:
    code = "\n".join(textwrap.dedent(p) for p in parts)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("backend", "compression"), [("zarr", None), ("zarr", "zstd"), ("hdf5", None), ("hdf5", "gzip")]
)
def test_a_store_works_without_fallocate_madvise_or_proc(tmp_path, backend, compression):
    path = str(tmp_path / "b")
    done = run(NO_LINUX, ROUND_TRIP.format(path=path, backend=backend, compression=compression))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out == {"len": 500, "ok": True, "episodes": 20, "memory": out["memory"], "holes": []}
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert out["memory"] == physical  # /proc unread: the machine's memory, not "unlimited"


FULL_AT_CREATION = """
import mmreplay as mr, os
try:
    mr.create({path!r}, {{"x": mr.ArraySpec((1024,), "uint8")}}, capacity={capacity}, backend={backend!r})
except mr.DiskFullError as exc:
    print(exc)
print(sorted(os.listdir(os.path.dirname({path!r}))))
"""


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_without_fallocate_a_file_size_limit_is_found_at_creation(tmp_path, backend):
    path = str(tmp_path / "b")
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))"
    done = run(NO_LINUX, limit, FULL_AT_CREATION.format(path=path, capacity=4096, backend=backend))
    assert done.returncode == 0, done.stderr
    message, listing = done.stdout.strip().splitlines()
    assert "needs" in message and "ulimit -f" in message
    assert listing == "[]"


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_without_fallocate_a_full_disk_is_found_at_creation(tmp_path, backend):
    """The free-space check passes (the leaf alone fits) but the files do not: writing
    every block finds the full disk at creation, as ``posix_fallocate`` does."""
    point = tmp_path / "fs"
    point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {mounted.stderr.decode().strip()}")
    try:
        import shutil

        capacity = shutil.disk_usage(point).free // 1024 - 1
        path = str(point / "b")
        done = run(NO_LINUX, FULL_AT_CREATION.format(path=path, capacity=capacity, backend=backend))
        assert done.returncode == 0, done.stderr
        message, listing = done.stdout.strip().splitlines()
        assert "needs" in message and "free" in message
        assert listing == "[]"
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


@pytest.mark.parametrize(
    ("module", "extra"),
    [("mmreplay.compat.torch", "torch"), ("mmreplay.compat.skrl", "torch"), ("mmreplay.compat.gymnasium", "gymnasium")],
)
def test_a_missing_extra_names_its_install_command(module, extra):
    done = run(f"import sys; sys.modules[{extra!r}] = None", f"import {module}")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"ImportError: {module} needs {extra}: pip install 'mmreplay[{extra}]'", done.stderr
