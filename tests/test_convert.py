"""A copy (convert, or export then import) keeps the source's history: step ids and
each episode's status, so episodes, --complete-only exports and stats agree."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.convert import convert
from mmreplay.demo import collect, spec

DATASETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets")
WRAPPED = os.path.join(DATASETS, "pointchase-wrapped")
MMREPLAY = shutil.which("mmreplay") or os.path.join(os.path.dirname(sys.executable), "mmreplay")


def cli(*args) -> subprocess.CompletedProcess:
    """The installed command in a fresh process, as a user runs it."""
    out = subprocess.run([MMREPLAY, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out


def spans(path) -> list[tuple]:
    with mr.open(path) as store:
        return [(s.env, s.first_step, s.last_step, s.status) for s in store.episode_index()]


def rows(path) -> list[np.ndarray]:
    with mr.open(path) as store:
        return mr.spec.flatten(store.get(slice(None)))


def complete_only_counts(path, out) -> tuple[int, int, int]:
    """Episodes, terminals and steps of ``path``'s --complete-only D4RL export (written to ``out``)."""
    import h5py

    cli("export", path, out, "-f", "d4rl", "--complete-only", "-q")
    with h5py.File(out) as f:
        return len(f["episode_starts"]), int(f["terminals"][()].sum()), len(f["rewards"])


@pytest.fixture(scope="module")
def wrapped_reference(tmp_path_factory) -> tuple[dict, tuple[int, int, int]]:
    """The reference store's stats and --complete-only export counts, made once for the
    copies of each backend to be compared with."""
    stats = json.loads(cli("stats", WRAPPED, "--json").stdout)["episodes"]
    return stats, complete_only_counts(WRAPPED, tmp_path_factory.mktemp("wrapped") / "a.h5")


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_convert_keeps_step_ids_and_the_open_episodes_the_ring_cut(tmp_path, backend, wrapped_reference):
    out = tmp_path / "copy"
    cli("convert", WRAPPED, out, "--capacity", "5000", "--backend", backend, "-q")
    source = spans(WRAPPED)
    cut = [s for s in source if s[3] == "open" and s[1] == source[0][1]]
    assert len(cut) >= 4  # the reference store has episodes whose start the ring overwrote
    assert spans(out) == source
    for a, b in zip(rows(WRAPPED), rows(out)):
        assert np.array_equal(a, b)
    with mr.open(WRAPPED) as a, mr.open(out) as b:
        assert (b.first_step, b.committed_steps, b.total_steps) == (
            a.first_step,
            a.committed_steps,
            a.total_steps,
        )
    stats, counts = wrapped_reference
    assert json.loads(cli("stats", out, "--json").stdout)["episodes"] == stats
    # --complete-only exports of source and copy hold the same episodes
    assert complete_only_counts(out, tmp_path / "b.h5") == counts


def test_a_smaller_capacity_cuts_the_episode_it_splits_and_keeps_the_ones_that_start_whole(tmp_path):
    src = tmp_path / "src"
    with mr.create(src, spec(), capacity=400, num_envs=3, commit_every=50) as store:
        collect(store, 300, seed=3)
    out = tmp_path / "small"
    convert(src, out, capacity=120)
    with mr.open(src) as a, mr.open(out) as b:
        first = b.first_step
        assert first == a.committed_steps - 120 and b.total_steps == a.total_steps
        want = []
        for s in a.episode_index():
            if s.last_step < first:
                continue
            status = s.status if s.first_step >= first else "open"
            want.append((s.env, max(first, s.first_step), s.last_step, status))
        got = [(s.env, s.first_step, s.last_step, s.status) for s in b.episode_index()]
        assert got == want
        assert any(s[1] == first and s[3] == "open" for s in want)  # the copy's start cut one


def test_a_copy_keeps_growing_like_the_source(tmp_path):
    out = tmp_path / "copy"
    convert(WRAPPED, out)
    before = spans(out)
    with mr.open(out, mode="a") as store:
        start = store.total_steps
        collect(store, start + 20, seed=1)
        assert store.total_steps == start + 20
    after = spans(out)
    # what was there keeps its status (unless the ring dropped it); new steps extend the tails
    kept = {s[:2]: s[3] for s in after}
    assert all(kept.get(s[:2], s[3]) == s[3] or s[3] == "open" for s in before)
    verdict = subprocess.run([MMREPLAY, "verify", str(out)], capture_output=True, text=True)
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr


WRITER = """
import sys, time
import numpy as np
import mmreplay as mr
spec = {"obs": mr.ArraySpec((64,), "float32"), "terminated": mr.ArraySpec((), "bool")}
with mr.create(sys.argv[1], spec, capacity=20_000, num_envs=4, backend=sys.argv[2], commit_every=50) as store:
    t = 0
    while True:
        store.add({"obs": np.full((4, 64), t, np.float32), "terminated": np.full(4, t % 13 == 12)})
        t += 1
        if t == 20_050:
            print("full", flush=True)
        if t > 20_050:
            time.sleep(0.0002)  # a collector: steps keep coming while the copy reads
"""


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_convert_of_a_full_ring_a_writer_keeps_filling(tmp_path, backend):
    """A running writer overwrites a full ring's oldest steps first, the ones the copy
    reads first: the copy failed (the writer overwrote step ...) however large the ring.
    It starts past the steps it lost, and holds every later committed step as written."""
    src, out = tmp_path / "src", tmp_path / "copy"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(src), backend], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "full\n"
        cli("convert", src, out, "-q")
    finally:
        writer.kill()
        writer.wait()
    with mr.open(out) as copy:
        assert copy.capacity == 20_000 and copy.total_steps >= 20_000
        ids = np.arange(copy.first_step, copy.total_steps)
        obs = copy.read_steps(ids)[0]
        assert np.array_equal(obs, np.broadcast_to(ids[:, None, None], obs.shape).astype(np.float32))
        for span in copy.episode_index():  # whole episodes end terminated, the first and last open
            whole = span.first_step % 13 == 0 and span.last_step % 13 == 12
            assert span.status == ("terminated" if whole else "open"), span
    verdict = subprocess.run([MMREPLAY, "verify", str(out)], capture_output=True, text=True)
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr


def test_convert_compression_of_an_unknown_leaf_names_the_leaves(tmp_path):
    """A nested leaf is named by its path: ``img=zstd`` for ``obs/img`` was refused
    without the paths to choose from, and nothing is made."""
    src, out = tmp_path / "src", tmp_path / "copy"
    nested = {"obs": {"img": mr.ArraySpec((8, 8, 3), "uint8")}, "reward": mr.ArraySpec((), "float32")}
    mr.create(src, nested, capacity=4).close()
    refused = subprocess.run([MMREPLAY, "convert", src, out, "--compression", "img=zstd"], capture_output=True, text=True)
    assert refused.returncode == 2
    assert "['img']" in refused.stderr and "obs/img, reward" in refused.stderr, refused.stderr
    assert not out.exists()


@pytest.mark.parametrize("option", ["capacity", "commit_every"])
def test_convert_refuses_a_zero_capacity_or_commit_every(tmp_path, option):
    """0 was taken as "the source's", silently: create refuses it, and so does a copy."""
    out = tmp_path / "copy"
    with pytest.raises(mr.SpecError, match=rf"{option} must be an int >= 1, got 0"):
        convert(WRAPPED, out, **{option: 0})
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"new_leaves": {"extra": (3,)}}, r"new_leaves \{'extra': \(3,\)\}: expected an array spec"),
        ({"sampler": {"alpha": 0.5}}, r"sampler \{'alpha': 0.5\}: expected its name and options"),
    ],
)
def test_convert_refuses_a_bad_new_leaf_or_sampler_by_name(tmp_path, option, message):
    """A new leaf given as a shape, or a sampler without its name, ended in an
    AttributeError or a KeyError from inside the copy."""
    out = tmp_path / "copy"
    with pytest.raises(mr.Error, match=message):
        convert(WRAPPED, out, **option)
    assert not out.exists() and os.listdir(tmp_path) == []


def test_convert_progress_to_a_smaller_ring_ends_at_100_percent(tmp_path):
    """The bar counted every retained row while a smaller ring copies only the newest:
    on a terminal it stopped at 16%."""
    import pty

    master, terminal = pty.openpty()
    try:
        done = subprocess.run(
            [MMREPLAY, "convert", WRAPPED, tmp_path / "copy", "--capacity", "50"],
            stderr=terminal, stdout=subprocess.PIPE, timeout=300,
        )
        os.close(terminal)
        shown = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other end is closed: all was read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(master)
    assert done.returncode == 0
    assert re.findall(rb"(\d+)%", shown)[-1] == b"100", shown[-200:]
