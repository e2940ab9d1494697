"""Crash torture: writers ended at random moments (SIGKILL, Ctrl-C, SIGTERM, a full disk, a
thread writing as the program ends) never lose a committed step nor commit a wrong one."""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
from conftest import run_cli, spread, verify_cli

import mmreplay as mr
from mmreplay.spec import flatten
from mmreplay.torture import (
    ENDINGS,
    LAYOUTS,
    SPEC,
    Expectation,
    Summary,
    TortureFailure,
    TrialConfig,
    WriterServer,
    check_store,
    run,
    run_trial,
    run_writer,
    step_values,
)
from mmreplay.verify import hdf5_status

LEAVES = flatten(SPEC)


#: the number of envs once per backend and compression; every layout runs with --long
SHORT_LAYOUTS = {str(x) for x in LAYOUTS} - {"zarr-mapped-8env", "zarr-compressed-1env", "hdf5-mapped-1env", "hdf5-compressed-8env"}


@pytest.mark.parametrize("layout", spread({str(x): x for x in LAYOUTS}, normal=SHORT_LAYOUTS))
def test_torture_trials_lose_nothing(tmp_path, layout):
    summary = run(4, root=str(tmp_path), seed=LAYOUTS.index(layout), layouts=[layout], kills_per_trial=3)
    assert summary.failures == 0, "\n".join(summary.messages)
    assert summary.trials == 4
    # A kill moment a run never reaches (a wrap in a short run, a moment after its last
    # step) lets the writer finish; on a fast machine that can be most of the twelve.
    assert summary.kills >= 1
    assert summary.steps_checked > 0


@pytest.mark.long
def test_torture_long(tmp_path):
    summary = run(400, root=str(tmp_path), seed=12345, kills_per_trial=4)
    assert summary.failures == 0, "\n".join(summary.messages)
    assert summary.kills > 800


GRACEFUL = [e for e in ENDINGS if e != "kill"]


@pytest.mark.parametrize("ending", GRACEFUL)
def test_torture_endings_commit_every_added_step_and_nothing_else(tmp_path, ending):
    """Ctrl-C, SIGTERM, a full disk, a thread writing at exit: a few trials of each, the
    layouts in turn (docs/reliability.md#crash-torture has the counts of long runs)."""
    summary = run(4, root=str(tmp_path), seed=100 + GRACEFUL.index(ending), kills_per_trial=3, endings=[ending])
    if ending == "enospc" and summary.trials == 0:
        pytest.skip(summary.notes[0])
    assert summary.failures == 0, "\n".join(summary.messages)
    assert summary.runs_by_ending[ending] == 12 and summary.steps_checked > 0
    if ending in ("sigint", "sigterm"):
        assert sum(summary.kills_by_target.values()) > 0  # signals sent, not only runs that finished first


def test_torture_sigterm_as_the_store_closes_loses_nothing(tmp_path):
    """SIGTERM aimed at the writer's close (by close(), a collection or the exit hooks):
    every step added before it is committed (the closing commit is never cut short), and a
    signal landing once the store is closed ends the program by its default action."""
    layouts = [x for x in LAYOUTS if x.num_envs == 8]  # mapped and compressed, both backends
    summary = run(4, root=str(tmp_path), seed=7, layouts=layouts, endings=["sigterm"], moments=["end"])
    assert summary.failures == 0, "\n".join(summary.messages)
    assert summary.kills_by_target["end"] == 12


@pytest.mark.long
def test_torture_endings_long(tmp_path):
    summary = run(1200, root=str(tmp_path), seed=2026, kills_per_trial=4, endings=ENDINGS)
    assert summary.failures == 0, "\n".join(summary.messages)
    assert min(summary.runs_by_ending[e] for e in ENDINGS if e != "enospc" or not summary.notes) > 600


def test_cli_torture_prints_the_summary_line(tmp_path):
    result = run_cli("torture", "--trials", "2", "--dir", tmp_path, "-q")
    assert result.returncode == 0, result.stdout + result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("trials 2, kills ") and line.endswith("failures 0")


def test_step_values_differ_between_steps_envs_and_laps():
    a = step_values(LEAVES, 8, np.arange(0, 100))
    b = step_values(LEAVES, 8, np.arange(100, 200))  # the next lap of a ring of 100
    pixels = a[1]  # flatten order: action, obs/pixels, obs/state, reward, terminated
    assert pixels.shape == (100, 8, 6, 6, 3)
    assert not np.array_equal(pixels[:, 0], pixels[:, 1])
    for x, y, spec in zip(a, b, LEAVES):
        assert x.dtype == y.dtype == spec.dtype
        if spec.dtype != bool:  # a bool leaf alone carries a bit or so per row
            assert all(x[i].tobytes() != y[i].tobytes() for i in range(100)), "a stale row would pass"
    whole = [b"".join(x[i].tobytes() for x in a) for i in range(100)]
    assert len(set(whole)) == 100
    np.testing.assert_array_equal(step_values(LEAVES, 8, [5])[1][0], pixels[5])


def _filled(tmp_path, layout, steps: int):
    config = TrialConfig(
        layout,
        capacity=20,
        chunk_steps=4,
        commit_every=5,
        durability="process",
        compression="zstd" if layout.compressed else None,
        kills=0,
        seed=1,
    )
    path = str(tmp_path / "b")
    with mr.create(
        path,
        SPEC,
        capacity=20,
        num_envs=layout.num_envs,
        backend=layout.backend,
        chunk_steps=4,
        compression=config.compression,
    ) as store:
        for g in range(steps):
            store.add(mr.spec.unflatten(SPEC, [v[0] for v in step_values(LEAVES, layout.num_envs, [g])]))
    return path, config


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[3]], ids=str)
def test_check_store_catches_a_stale_row(tmp_path, layout):
    path, config = _filled(tmp_path, layout, 30)
    exp = Expectation(reported=30, announced=30)
    assert check_store(path, config, exp) == 20
    with mr.open(path, "a") as store:  # put step 15's rows where step 25 belongs
        store.set(25 - store.first_step, store.get(15 - store.first_step))
    with pytest.raises(TortureFailure, match=r"\(b\).*\[25\]"):
        check_store(path, config, Expectation(reported=30, announced=30))


def test_check_store_catches_a_lost_commit_and_rows_past_the_cursor(tmp_path):
    path, config = _filled(tmp_path, LAYOUTS[0], 12)
    with pytest.raises(TortureFailure, match=r"\(b\) committed cursor 12 is behind the reported commit 13"):
        check_store(path, config, Expectation(reported=13, announced=13))
    with pytest.raises(TortureFailure, match=r"\(c\) committed cursor 12 is past every step written \(11\)"):
        check_store(path, config, Expectation(reported=11, announced=11))
    with pytest.raises(TortureFailure, match=r"\(a\)"):
        os.remove(os.path.join(path, "mmreplay.json"))
        check_store(path, config, Expectation())


def test_a_trial_fails_when_resume_is_not_at_the_committed_cursor(tmp_path):
    """(d): the harness knows where the next writer must resume."""
    layout = LAYOUTS[0]
    config = TrialConfig(layout, 16, 4, 4, "process", None, kills=1, seed=3)
    path = str(tmp_path / "b")
    with WriterServer() as server:
        run_trial(path, config, server)  # a healthy trial passes
        exp = Expectation(checked_end=10**6)
        with pytest.raises(TortureFailure, match=r"\(d\) the next writer resumed at step"):
            run_writer(server, path, config, exp, np.random.default_rng(0), None, Summary())


# --- regressions found by the torture ---------------------------------------------------

KILLED_WRITER = """
import os, signal, numpy as np, mmreplay as mr
s = mr.open({path!r}, "a")
rng = np.random.default_rng(0)
for i in range({steps}):
    s.add({{"x": rng.random((1, 64)).astype("float32")}})
    if i % 3 == 2:
        s.commit()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _kill_a_writer(writers, path: str, steps: int) -> None:
    writers.run_killed(textwrap.dedent(KILLED_WRITER.format(path=path, steps=steps)))


def test_sigkill_in_an_extend_loses_all_of_it_and_nothing_committed_before(tmp_path, writers):
    """docs/reliability.md: a SIGKILL loses at most ``commit_every`` steps, and all of an
    ``extend`` under way, however many more steps it holds."""
    path = str(tmp_path / "b")
    writers.run_killed(textwrap.dedent(f"""
        import os, signal, numpy as np, mmreplay as mr
        from mmreplay.hooks import WriteHook
        class Kill(WriteHook):
            def on_add(self, first_step, count):
                if count > 1:  # every row of the extend written, none committed
                    os.kill(os.getpid(), signal.SIGKILL)
        s = mr.create({path!r}, {{"x": mr.ArraySpec((), "int64")}}, 100, commit_every=5)
        s.add_write_hook(Kill())
        for i in range(7):
            s.add({{"x": np.array([i])}})
        s.extend({{"x": np.arange(7, 47).reshape(40, 1)}})
    """))
    with mr.open(path) as reader:
        assert reader.committed_steps == 7  # the steps before the extend: committed as it began
        assert reader.get(slice(None))["x"][:, 0].tolist() == list(range(7))
    assert verify_cli(path) == (0, [])


def test_hdf5_next_writer_keeps_what_a_dead_writer_wrote_past_its_recorded_end(tmp_path, writers):
    """A writer killed mid-flush can leave chunks (and an index pointing at them) past the
    end-of-file address in its superblock; HDF5 would cut them off at the next flush."""
    path = str(tmp_path / "b")
    mr.create(
        path, {"x": mr.ArraySpec((64,), "float32")}, 64, backend="hdf5", compression="gzip", chunk_steps=4
    ).close()
    _kill_a_writer(writers, path, 20)
    data = os.path.join(path, "data.h5")
    flags, eof = hdf5_status(data)
    assert flags != 0  # left open for SWMR writing
    marker = b"written by the dead writer past its recorded end" * 64
    with open(data, "ab") as f:
        f.write(marker)
    at = eof
    with mr.open(path, "a") as store:
        store.add({"x": np.ones((1, 64), "float32")})
        store.commit()
    with open(data, "rb") as f:
        f.seek(at)
        assert f.read(len(marker)) == marker
    assert verify_cli(path) == (0, [])


def test_hdf5_killed_writer_leaves_the_file_open_for_readers(tmp_path, writers):
    path = str(tmp_path / "b")
    mr.create(
        path, {"x": mr.ArraySpec((64,), "float32")}, 64, backend="hdf5", compression="gzip", chunk_steps=4
    ).close()
    _kill_a_writer(writers, path, 7)
    flags, _ = hdf5_status(os.path.join(path, "data.h5"))
    assert flags & 4, "flags of a SWMR writer (readers may open the file)"
    with mr.open(path) as reader:
        assert len(reader) == 6
        reader.get(slice(None))


def test_zarr_all_zero_chunks_are_stored_so_a_lost_chunk_is_found(tmp_path):
    path = str(tmp_path / "b")
    spec = {"x": mr.ArraySpec((3,), "float32"), "done": mr.ArraySpec((), "bool")}
    with mr.create(path, spec, 12, compression="zstd", chunk_steps=4) as store:
        for _ in range(6):
            store.add({"x": np.zeros((1, 3), "float32"), "done": np.zeros(1, bool)})
    for key in ("x/c/0/0/0", "x/c/1/0/0", "done/c/0/0", "done/c/1/0"):
        assert os.path.isfile(os.path.join(path, "data.zarr", key)), key
    assert verify_cli(path) == (0, [])
    os.remove(os.path.join(path, "data.zarr", "done", "c", "1", "0"))
    code, problems = verify_cli(path)
    assert code == 1 and any("chunk file" in p and "missing" in p for p in problems)
