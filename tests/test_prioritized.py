"""Prioritized replay: draw frequencies, importance weights, updates across the ring's
wrap, priorities that survive close, reopen and kill -9, bad priorities, and a learner
process updating priorities while a writer process (killed mid-run) overwrites rows."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.errors import BadInputError

SPEC = {"x": mr.ArraySpec((), "int64")}


def filled(path, capacity=50, num_envs=2, steps=None, **options):
    store = mr.create(path, SPEC, capacity, num_envs, sampler="prioritized", **options)
    steps = capacity if steps is None else steps
    store.extend({"x": np.arange(steps * num_envs).reshape(steps, num_envs)})
    store.commit()
    return store


def all_rows(store):
    first, end = store.first_step, store.committed_steps
    step = np.repeat(np.arange(first, end), store.num_envs)
    env = np.tile(np.arange(store.num_envs), end - first)
    return step, env


def test_draw_frequencies_match_priorities_to_the_alpha(tmp_path):
    stats = pytest.importorskip("scipy.stats")
    alpha = 0.7
    store = filled(tmp_path / "b", alpha=alpha)
    step, env = all_rows(store)
    p = np.random.default_rng(1).uniform(0.05, 3.0, step.size)
    store.update_priorities(step, env, p)
    _, info = store.sample(200_000, rng=7, return_info=True)
    observed = np.bincount(info.step * store.num_envs + info.env, minlength=step.size)
    expected = (p + 1e-8) ** alpha
    expected = expected / expected.sum() * observed.sum()
    assert stats.chisquare(observed, expected).pvalue > 1e-3
    np.testing.assert_allclose(
        info.probability, expected[info.step * 2 + info.env] / observed.sum(), rtol=1e-5
    )


def test_weights_are_n_p_to_the_minus_beta_over_their_max(tmp_path):
    store = filled(tmp_path / "b", alpha=0.6)
    step, env = all_rows(store)
    p = np.random.default_rng(2).uniform(0.1, 5.0, step.size)
    store.update_priorities(step, env, p)
    _, info = store.sample(500, rng=3, beta=0.5, return_info=True)
    q = (p.astype(np.float32).astype(np.float64) + 1e-8) ** 0.6
    probability = q / q.sum()
    w_all = (step.size * probability) ** -0.5
    want = w_all[info.step * 2 + info.env] / w_all.max()
    np.testing.assert_allclose(info.weight, want, rtol=1e-5)
    np.testing.assert_allclose(info.probability, probability[info.step * 2 + info.env], rtol=1e-6)


def test_sequences_start_inside_the_window_and_take_the_r2d2_mix(tmp_path):
    store = filled(tmp_path / "b", capacity=20, steps=20, num_steps=4, sequence_priority=0.9)
    batch, info = store.sample(2000, rng=0, return_info=True)
    assert batch["x"].shape == (2000, 4)
    assert info.step.max() <= store.committed_steps - 4
    per_step = np.array([[1.0, 2.0, 3.0, 6.0]])
    store.update_priorities(info.step[:1], info.env[:1], per_step)
    want = np.float32(0.9 * 6.0 + 0.1 * 3.0 + 1e-8)
    assert store.sampler.priorities(info.step[:1], info.env[:1])[0] == want


def test_updates_after_the_wrap_land_on_the_right_rows(tmp_path):
    store = filled(tmp_path / "b", capacity=8, num_envs=3, steps=21)  # wrapped twice and more
    _, info = store.sample(64, rng=0, return_info=True)
    stored = store.get(info.step - store.first_step)["x"][np.arange(64), info.env]
    assert (stored == info.step * 3 + info.env).all()  # x holds the row's global flat id
    new = info.step * 10.0 + info.env
    store.update_priorities(info.step, info.env, new)
    got = store.sampler.priorities(info.step, info.env)
    # where a row was sampled twice, both updates carry the same value
    np.testing.assert_array_equal(got, (new + 1e-8).astype(np.float32))


def test_an_overwritten_step_never_keeps_its_old_priority(tmp_path):
    store = filled(tmp_path / "b", capacity=8, num_envs=2, steps=8)
    _, info = store.sample(16, rng=0, return_info=True)
    store.update_priorities(info.step, info.env, np.full(16, 0.001))
    store.extend({"x": np.zeros((8, 2), np.int64)})  # every slot now holds a new step
    store.commit()
    assert store.update_priorities(info.step, info.env, np.full(16, 0.002)) == 0  # dropped
    step, env = all_rows(store)
    assert (store.sampler.priorities(step, env) == np.float32(1.0)).all()  # the max, as new steps


def test_negative_or_nan_priorities_are_refused_and_change_nothing(tmp_path):
    store = filled(tmp_path / "b", capacity=8, steps=8)
    step, env = all_rows(store)
    before = store.sampler.priorities(step, env)
    for bad in (-1.0, np.nan, np.inf):
        p = np.ones(step.size)
        p[3] = bad
        with pytest.raises(BadInputError, match="finite and >= 0"):
            store.update_priorities(step, env, p)
    with pytest.raises(BadInputError, match="not committed"):
        store.update_priorities([100], [0], [1.0])
    with pytest.raises(BadInputError, match="expected 16 priorities"):
        store.update_priorities(step, env, np.ones(3))
    for bad_env in (-1, 2, np.iinfo(np.int64).min):
        with pytest.raises(BadInputError, match="env index out of range for 2 envs"):
            store.update_priorities(step[:2], [0, bad_env], [5.0, 5.0])
    with pytest.raises(BadInputError, match="env index out of range"):
        store.update_priorities(step[:1], np.array([2**64 - 1], np.uint64), [5.0])
    np.testing.assert_array_equal(store.sampler.priorities(step, env), before)


def test_a_priority_too_large_for_float32_is_refused_and_changes_nothing(tmp_path):
    # finite as a Python float, infinite once stored: it would poison the running maximum
    store = filled(tmp_path / "b", capacity=8, steps=8)
    step, env = all_rows(store)
    before = store.sampler.priorities(step, env)
    with pytest.raises(BadInputError, match=r"finite and >= 0.*the first is 1e\+39"):
        store.update_priorities(step[:2], env[:2], [1.0, 1e39])
    np.testing.assert_array_equal(store.sampler.priorities(step, env), before)
    assert store.sampler.file.max_priority == 1.0
    largest = float(np.finfo(np.float32).max)  # is fine
    store.update_priorities(step[:1], env[:1], [largest])
    _, info = store.sample(64, rng=0, return_info=True)
    assert np.isfinite(info.weight).all() and np.isfinite(info.probability).all()


@pytest.mark.parametrize("name", ["alpha", "beta", "eps"])
def test_an_infinite_alpha_beta_or_eps_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match=f"{name} must be"):
        filled(tmp_path / "b", capacity=8, steps=8, **{name: float("inf")})
    store = filled(tmp_path / "c", capacity=8, steps=8)
    with pytest.raises(ValueError, match="beta must be"):
        store.sample(4, beta=float("inf"))


def test_stored_priorities_of_an_env_out_of_range_are_refused(tmp_path):
    store = filled(tmp_path / "b", capacity=8, steps=8)
    for bad_env in (-1, 2):
        with pytest.raises(BadInputError, match="env index out of range for 2 envs"):
            store.sampler.priorities([3], [bad_env])


def test_an_empty_update_applies_nothing(tmp_path):
    store = filled(tmp_path / "b", capacity=8, steps=8)
    assert store.update_priorities([], [], []) == 0


def test_within_episodes_false_is_the_prioritized_draw_and_true_is_refused(tmp_path):
    store = filled(tmp_path / "b", capacity=8, steps=8)
    _, info = store.sample(16, num_steps=2, within_episodes=False, rng=0, return_info=True)
    _, again = store.sample(16, num_steps=2, rng=0, return_info=True)
    np.testing.assert_array_equal(info.step, again.step)
    np.testing.assert_array_equal(info.weight, again.weight)
    with pytest.raises(ValueError, match="prioritized sampler.*within_episodes=True"):
        store.sample(16, num_steps=2, within_episodes=True)


def test_priorities_survive_close_and_reopen(tmp_path):
    store = filled(tmp_path / "b", capacity=16, steps=16)
    step, env = all_rows(store)
    p = np.linspace(0.5, 9.0, step.size)
    store.update_priorities(step, env, p)
    store.close()
    for mode in ("r", "a"):
        with mr.open(tmp_path / "b", mode) as again:
            np.testing.assert_array_equal(again.sampler.priorities(step, env), (p + 1e-8).astype(np.float32))
            _, info = again.sample(100, rng=0, return_info=True)
            q = (p.astype(np.float32).astype(np.float64) + 1e-8) ** 0.6
            np.testing.assert_allclose(info.probability, (q / q.sum())[info.step * 2 + info.env], rtol=1e-6)


def test_a_kill_after_a_commit_loses_no_committed_priority(tmp_path, writers):
    path = tmp_path / "b"
    code = textwrap.dedent(
        f"""
        import os, signal, numpy as np, mmreplay as mr
        store = mr.create({str(path)!r}, {{"x": mr.ArraySpec((), "int64")}}, 32, 2,
                          sampler="prioritized", durability="power")
        store.extend({{"x": np.arange(80).reshape(40, 2)}}); store.commit()
        step = np.repeat(np.arange(8, 40), 2); env = np.tile([0, 1], 32)
        store.update_priorities(step, env, step * 2.0 + env)
        store.extend({{"x": np.zeros((3, 2), np.int64)}}); store.commit()  # steps 40..42 replace 8..10
        store.extend({{"x": np.zeros((2, 2), np.int64)}})  # not committed
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    writers.run_killed(code)
    with mr.open(path, "r") as store:
        first = store.first_step  # after 11: the writer reserves a few slots ahead
        assert store.committed_steps == 43 and 11 <= first < 40
        step = np.repeat(np.arange(first, 40), 2)
        env = np.tile([0, 1], 40 - first)
        want = (step * 2.0 + env + 1e-8).astype(np.float32)
        np.testing.assert_array_equal(store.sampler.priorities(step, env), want)
        new = store.sampler.priorities(np.repeat([40, 41, 42], 2), np.tile([0, 1], 3))
        assert (new == np.float32(store.sampler._file().max_priority)).all()


WRITER = """
import sys, time, numpy as np, mmreplay as mr
path, start = sys.argv[1], int(sys.argv[2])
store = mr.open(path, "a")
g = store.total_steps
while True:
    store.add({"x": np.array([g * 2, g * 2 + 1])})
    g += 1
    time.sleep(0.001)
"""

LEARNER = """
import sys, time, numpy as np, mmreplay as mr
path, seconds = sys.argv[1], float(sys.argv[2])
store = mr.open(path, "r")
rng = np.random.default_rng(0)
applied = dropped = 0
stop = time.time() + seconds
while time.time() < stop:
    store.refresh()
    batch, info = store.sample(16, rng=rng, return_info=True)
    assert (batch["x"] == info.step * 2 + info.env).all()
    # let the writer overwrite some of them meanwhile, now and then all of them
    time.sleep(0.4 if rng.random() < 0.1 else rng.uniform(0, 0.004))
    n = store.update_priorities(info.step, info.env, 1.0 / (info.step + 2.0))
    applied += n
    dropped += 16 - n
print(applied, dropped)
"""


def check_priorities(path) -> int:
    """Under the priority lock: every committed retained row holds the max (1.0, as a new
    step) or the priority the learner gave its own step, never another step's."""
    with mr.open(path, "r") as store:
        file = store.sampler._file()
        with file:
            live = store.live_state()
            first, end = live.first(store.capacity), live.end
            step = np.repeat(np.arange(first, end), 2)
            env = np.tile([0, 1], end - first)
            got = file.values[step % store.capacity, env]
        own = (1.0 / (step + 2.0) + 1e-8).astype(np.float32)
        wrong = (got != np.float32(1.0)) & (got != own)
        assert not wrong.any(), (step[wrong][:5], got[wrong][:5])
        return int((got == own).sum())


def test_learner_process_updates_while_a_writer_process_wraps_and_dies(tmp_path):
    path = str(tmp_path / "b")
    mr.create(path, SPEC, 200, 2, commit_every=4, sampler="prioritized").close()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, path, "0"])
    try:
        deadline = time.time() + 60
        while mr.open(path).committed_steps < 200 and time.time() < deadline:
            time.sleep(0.05)
        learner = subprocess.Popen(
            [sys.executable, "-c", LEARNER, path, "6"], stdout=subprocess.PIPE, text=True
        )
        for i in range(30):
            check_priorities(path)
            time.sleep(0.1)
            if i == 12:  # kill the writer mid-run, and start a new one on the same buffer
                writer.send_signal(signal.SIGKILL)
                writer.wait()
                writer = subprocess.Popen([sys.executable, "-c", WRITER, path, "0"])
        out, _ = learner.communicate(timeout=120)
        assert learner.returncode == 0
        applied, dropped = map(int, out.split())
        assert applied > 0 and dropped > 0  # some landed, some came too late
    finally:
        writer.kill()
        writer.wait()
    check_priorities(path)
    # with the writer gone, a learner's updates stay: they did land in the shared file
    learner = subprocess.run(
        [sys.executable, "-c", LEARNER, path, "1"], capture_output=True, text=True, timeout=120
    )
    assert learner.returncode == 0, learner.stderr
    assert check_priorities(path) > 0


def expected_leaves(store) -> np.ndarray:
    """priority ** alpha for the rows of the store's window, zero elsewhere."""
    sampler = store.sampler
    values = sampler._file().values.astype(np.float64) ** sampler.alpha
    keep = np.zeros(store.capacity, bool)
    window = store.window  # a writer's ends at its last step, a reader's at the committed end
    keep[np.arange(window.first, window.end) % store.capacity] = True
    values[~keep] = 0.0
    return values.reshape(-1)


@pytest.mark.parametrize("who", ["writer", "reader"])
def test_the_tree_follows_the_window_through_adds_wraps_clears_and_updates(tmp_path, who):
    rng = np.random.default_rng(5)
    writer = filled(tmp_path / "b", capacity=16, num_envs=2, steps=3, alpha=0.5, commit_every=4)
    reader = mr.open(tmp_path / "b", "r")
    learner = writer if who == "writer" else reader
    try:
        for _ in range(200):
            r = rng.random()
            if r < 0.35:
                k = int(rng.integers(1, 12))
                writer.extend({"x": np.zeros((k, 2), np.int64)})
            elif r < 0.4:
                writer.commit()
            elif r < 0.42:
                writer.clear()
            elif r < 0.45 and len(writer):
                writer.set(0, {"x": np.ones(2, np.int64)})
            reader.refresh()
            if len(learner) < 2:
                continue
            _, info = learner.sample(8, rng=rng, return_info=True, num_steps=2 if r > 0.9 else None)
            learner.update_priorities(info.step, info.env, rng.uniform(0.1, 4.0, 8))
            learner.sample(1, rng=rng)  # the tree is in step with the window after a draw
            np.testing.assert_allclose(learner.sampler.tree.leaves(), expected_leaves(learner), rtol=1e-6)
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize("num_steps", [None, 3])
def test_a_window_ending_before_the_last_draws_draws_only_inside_it(tmp_path, num_steps):
    """After a draw over every step, window=(first, end) with an earlier end left the
    steps from end on in the tree: items came from outside the window asked for."""
    store = filled(tmp_path / "b", capacity=30, num_envs=2, steps=77, alpha=1.0, eps=0.0)
    step, env = all_rows(store)  # steps [47, 77)
    p = (step - 46.0) * (env + 1)
    store.update_priorities(step, env, p)
    store.sample(4, num_steps=num_steps, rng=0)  # the tree holds [47, 77)
    n = num_steps or 1
    for window in [(40, 55), (47, 60), (0, 52)]:
        lo, hi = max(47, window[0]), window[1]
        _, info = store.sample(4000, num_steps=num_steps, window=window, rng=1, return_info=True)
        assert lo <= info.step.min() and info.step.max() + n <= hi, window
        inside = (step >= lo) & (step + n <= hi)
        expected = np.where(inside, p, 0) / p[inside].sum()
        np.testing.assert_allclose(info.probability, expected[(info.step - 47) * 2 + info.env], rtol=1e-6)
    _, info = store.sample(4000, num_steps=num_steps, rng=2, return_info=True)  # the whole window again
    assert info.step.max() + n == 77


# --- verify and recover ---------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mmreplay.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize("damage", ["nan", "negative", "truncated", "header"])
def test_verify_finds_a_damaged_priority_file_and_recover_resets_it(tmp_path, damage):
    from mmreplay.priorities import HEADER_BYTES, PRIORITY_FILE

    path = tmp_path / "b"
    store = mr.create(path, {"x": mr.ArraySpec((), "float32")}, 8, 2, sampler="prioritized", alpha=0.6)
    store.extend({"x": np.zeros((5, 2), np.float32)})
    store.commit()
    store.update_priorities(np.array([1, 2]), np.array([0, 1]), np.array([3.0, 0.5]))
    store.close()
    assert _cli("verify", str(path)).returncode == 0
    file = path / PRIORITY_FILE
    raw = bytearray(file.read_bytes())
    if damage in ("nan", "negative"):
        value = np.float32("nan" if damage == "nan" else -1.0)
        at = HEADER_BYTES + 4 * (3 * 2 + 1)  # step 3, env 1: committed
        raw[at : at + 4] = value.tobytes()
        expect = "NaN, infinite or negative"
    elif damage == "truncated":
        raw = raw[:-4]
        expect = "expected"
    else:
        raw[:8] = b"garbage!"
        expect = "not a priority file"
    file.write_bytes(bytes(raw))
    found = _cli("verify", str(path))
    assert found.returncode != 0 and expect in found.stdout + found.stderr
    fixed = _cli("recover", str(path))
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "every priority reset to the maximum" in fixed.stdout
    assert _cli("verify", str(path)).returncode == 0
    top = 3.0 if damage in ("nan", "negative") else 1.0  # the header's running max, when readable
    with mr.open(path, "r") as store:
        got = store.sampler.priorities(np.arange(5).repeat(2), np.tile([0, 1], 5))
    assert got == pytest.approx(np.full(10, top))


def test_a_never_committed_row_may_hold_any_priority(tmp_path):
    from mmreplay.priorities import HEADER_BYTES, PRIORITY_FILE

    path = tmp_path / "b"
    store = mr.create(path, {"x": mr.ArraySpec((), "float32")}, 8, 1, sampler="prioritized")
    store.extend({"x": np.zeros((3, 1), np.float32)})
    store.commit()
    store.close()
    raw = bytearray((path / PRIORITY_FILE).read_bytes())
    raw[HEADER_BYTES + 4 * 6 : HEADER_BYTES + 4 * 7] = np.float32("nan").tobytes()  # slot 6: no step
    (path / PRIORITY_FILE).write_bytes(bytes(raw))
    assert _cli("verify", str(path)).returncode == 0
