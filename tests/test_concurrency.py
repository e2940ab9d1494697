"""One writer, several reader processes: every read sees a committed prefix, bit-exact.

The writer collects rows that are a function of their global step id (and env), wrapping
a small ring many times; readers in other processes refresh, read steps by id, sample
rows and sequences, and check every row against the function. A reader may be told a
row was overwritten while it read (and retries); it must never get a wrong row, a row
past the committed cursor, or a window that moves backwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import mmreplay as mr
from mmreplay.torture import SPEC

ENVS = 2
#: reads each reader makes while the writer holds its lock, however slow the machine
OVERLAPS = 10

WRITER = """
import os, sys, time, numpy as np, mmreplay as mr
from mmreplay.spec import flatten, unflatten
from mmreplay.torture import step_values
store = mr.open({path!r}, "a")
leaves, rng = flatten(store.spec), np.random.default_rng(1)
print("ready", flush=True)
sys.stdin.readline()  # go: every reader is reading
deadline = time.monotonic() + {seconds}
g = store.total_steps
# write for at least `seconds`, and on until every reader is done (a slow machine may
# start a reader late): the readers' whole time overlaps the writer's
while time.monotonic() < deadline or not os.path.exists({stop!r}):
    n = int(rng.integers(1, 12))
    if n == 1:
        store.add(unflatten(store.spec, [v[0] for v in step_values(leaves, {envs}, [g])]))
    else:
        store.extend(unflatten(store.spec, step_values(leaves, {envs}, np.arange(g, g + n))))
    g += n
    if rng.random() < 0.2:
        store.commit()
store.close()
print(g, flush=True)
"""

READER = """
import json, time, numpy as np, mmreplay as mr
from mmreplay.lock import holder_pid
from mmreplay.spec import flatten
from mmreplay.torture import step_values
store = mr.open({path!r})
leaves, rng = flatten(store.spec), np.random.default_rng({seed})
out = dict(reads=0, samples=0, sequences=0, rows=0, retries=0, refreshes=0, overlapped=0, problems=[])
print("ready", flush=True)
last_first = last_end = 0
# read for `seconds`, and on until {overlaps} reads overlapped the writer and the ring
# wrapped twice (a loaded machine may give these processes little time), up to a limit
# that fails the test's counts instead
deadline, limit = time.monotonic() + {seconds}, time.monotonic() + {seconds} + 120
while time.monotonic() < deadline or (
    (out["overlapped"] < {overlaps} or store.committed_steps <= 2 * store.capacity) and time.monotonic() < limit
):
    out["refreshes"] += store.refresh()
    first, end = store.first_step, store.committed_steps
    # the committed cursor never moves back (the oldest step may: a writer that gives back
    # slots it reserved but never wrote, at close, retains their steps again)
    if end < last_end or end - first > store.capacity:
        out["problems"].append(f"window [{{last_first}}, {{last_end}}) -> [{{first}}, {{end}})")
    last_first, last_end = first, end
    if end - first < 8:
        continue
    r = rng.random()
    writing = holder_pid({path!r}) is not None  # the writer holds its lock before the read...
    try:
        if r < 0.4:  # steps by id, every env: [16, num_envs, *shape]
            ids = rng.integers(first, end, size=16)
            got = store.read_steps(ids)
            want = step_values(leaves, {envs}, ids)
            out["reads"] += 1
        else:  # sampled rows, or sequences of 4 steps of one env: [16, 4 or 1, *shape]
            seq = 4 if r > 0.7 else 1
            nest, info = store.sample(16, num_steps=seq if seq > 1 else None, return_info=True, rng=rng)
            steps = info.step[:, None] + np.arange(seq)
            if steps.max() >= store.committed_steps:
                out["problems"].append(f"sampled step {{steps.max()}} past the committed cursor {{store.committed_steps}}")
            got = [x if seq > 1 else x[:, None] for x in flatten(nest)]
            pick = (np.arange(16)[:, None], np.arange(seq)[None, :], info.env[:, None])
            want = [w[pick] for w in step_values(leaves, {envs}, steps)]
            out["sequences" if seq > 1 else "samples"] += 1
    except mr.NotEnoughDataError:  # overwritten while read: the reader is told, and retries
        out["retries"] += 1
        continue
    out["rows"] += got[0].shape[0] * got[0].shape[1]
    out["overlapped"] += writing and holder_pid({path!r}) is not None  # ...and after it
    for path, a, b in zip(store.leaf_paths, got, want):
        if a.tobytes() != b.tobytes():
            out["problems"].append(f"leaf {{path}}: rows not bit-exact")
store.close()
print(json.dumps(out))
"""


def _run(path, seconds: float, readers: int) -> tuple[int, list[dict]]:
    stop = path + ".readers-done"
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER.format(path=path, seconds=seconds, envs=ENVS, stop=stop))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == "ready"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                textwrap.dedent(
                    READER.format(path=path, seconds=seconds, envs=ENVS, seed=i, overlaps=OVERLAPS)
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(readers)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    writer.stdin.write("go\n")
    writer.stdin.flush()
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=seconds + 240)
            assert p.returncode == 0, err
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        open(stop, "w").close()
    out, _ = writer.communicate(timeout=120)
    assert writer.returncode == 0
    return int(out.strip().splitlines()[-1]), reports


def _check(path, seconds: float, readers: int) -> None:
    written, reports = _run(path, seconds, readers)
    for report in reports:
        assert report["problems"] == [], report["problems"][:5]
    # every reader read while the writer was writing (it held its lock before and after
    # the read), not only once it had finished
    assert all(r["overlapped"] >= OVERLAPS for r in reports), [r["overlapped"] for r in reports]
    assert sum(r["refreshes"] for r in reports) > readers  # they saw the writer's commits
    with mr.open(path) as store:
        assert store.committed_steps == written
        assert written > 2 * store.capacity  # the ring wrapped while they read


@pytest.mark.parametrize(
    ("backend", "compression", "chunk_steps"),
    [
        ("zarr", None, 4),
        ("zarr", "zstd", 4),
        ("hdf5", None, 4),
        ("hdf5", "gzip", 4),
        ("zarr", "rows:lz4", 4),
        ("zarr", "rows:zstd:1", 32),  # one segment: the head comes round to the segment it sealed
    ],
)
def test_readers_see_committed_bit_exact_rows_while_a_writer_runs(tmp_path, backend, compression, chunk_steps):
    path = str(tmp_path / "b")
    mr.create(
        path, SPEC, capacity=32, num_envs=ENVS, backend=backend, compression=compression, chunk_steps=chunk_steps
    ).close()
    _check(path, seconds=1, readers=2)


@pytest.mark.long
@pytest.mark.parametrize(
    ("backend", "compression", "chunk_steps"),
    [("zarr", "zstd", 16), ("hdf5", None, 16), ("zarr", "rows:lz4", 16), ("zarr", "rows:lz4", 256)],
)
def test_readers_long(tmp_path, backend, compression, chunk_steps):
    path = str(tmp_path / "b")
    mr.create(
        path, SPEC, capacity=256, num_envs=ENVS, backend=backend, compression=compression, chunk_steps=chunk_steps
    ).close()
    _check(path, seconds=60, readers=4)
