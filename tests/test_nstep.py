"""n-step returns at sampling time: every drawn row against a step-by-step model of the
same streams, under every sampler, in groups, in readers while
a writer writes, after a kill -9 and resume; bad input refused with nothing written.
Frames stored once: tests/test_frames.py compares n-step batches with a store that keeps
every leaf."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import numpy as np
import pytest
from conftest import WITH_ROWS, WITH_ROWS_IDS, folder_digest

import mmreplay as mr

SPEC = {
    "obs": mr.ArraySpec((2,), "float32"),
    "next_obs": mr.ArraySpec((2,), "float32"),
    "action": mr.ArraySpec((), "int64"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}


def steps_of(t0: int, n: int, num_envs: int, rng: np.random.Generator, end: float = 0.2) -> dict:
    """``n`` steps from global id ``t0``: ``obs`` is ``(step, env)``, ``next_obs``
    ``(step + 1, env)``, ``action`` the step id; random rewards and episode ends."""
    t = np.arange(t0, t0 + n, dtype=np.int64)[:, None] + np.zeros((1, num_envs), np.int64)
    e = np.zeros((n, 1), np.int64) + np.arange(num_envs)
    ends = rng.random((n, num_envs)) < end
    terminated = ends & (rng.random((n, num_envs)) < 0.5)
    return {
        "obs": np.stack([t, e], -1).astype("float32"),
        "next_obs": np.stack([t + 1, e], -1).astype("float32"),
        "action": t,
        "reward": rng.standard_normal((n, num_envs)).astype("float32"),
        "terminated": terminated,
        "truncated": ends & ~terminated,
    }


def expected(store: mr.Store, step: np.ndarray, env: np.ndarray, n: int, gamma: float) -> dict:
    """The n-step fields of each row, step by step from the store's rows (the model), by role."""
    roles = store.roles
    rows = {role: store.get(slice(None))[path] for role, path in roles.items()}  # [steps, envs, ...]
    first, end = store.window[:2]
    out = {k: [] for k in ("reward", "next_observation", "terminated", "truncated", "discount")}
    for s, e in zip(step.reshape(-1), env.reshape(-1)):
        ret, k = 0.0, 0
        while True:
            i = s + k - first
            ret += np.float32(gamma) ** k * rows["reward"][i, e]
            k += 1
            ended = rows["terminated"][i, e] or rows["truncated"][i, e]
            if ended or k == n or s + k == end:
                break
        for role in ("next_observation", "terminated", "truncated"):
            out[role].append(rows[role][i, e])
        out["reward"].append(ret)
        out["discount"].append(gamma**k)
    return {key: np.array(v).reshape(step.shape + np.shape(v[0])) for key, v in out.items()}


def check(store: mr.Store, batch: dict, step: np.ndarray, env: np.ndarray, n: int, gamma: float) -> None:
    want = expected(store, step, env, n, gamma)
    np.testing.assert_array_equal(batch["obs"][..., 0], step)  # the start is the row drawn
    np.testing.assert_array_equal(batch["action"], step)
    np.testing.assert_array_equal(batch["next_obs"], want["next_observation"])
    np.testing.assert_array_equal(batch["terminated"], want["terminated"])
    np.testing.assert_array_equal(batch["truncated"], want["truncated"])
    np.testing.assert_allclose(batch["reward"], want["reward"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batch["discount"], want["discount"], rtol=1e-6)
    assert batch["reward"].dtype == np.float32 and batch["discount"].dtype == np.float32


def make(
    tmp_path, capacity: int, num_envs: int, steps: int, seed: int = 0, name: str = "b", **kw
) -> mr.Store:
    store = mr.create(tmp_path / name, SPEC, capacity, num_envs=num_envs, **kw)
    store.extend(steps_of(0, steps, num_envs, np.random.default_rng(seed)))
    return store


@pytest.mark.parametrize(
    "capacity, num_envs, steps, n",
    [(50, 1, 30, 3), (16, 3, 40, 4), (8, 2, 21, 5), (30, 2, 30, 1), (12, 1, 12, 12)],
    ids=["one-env", "wrapped", "ring-shorter-than-n-twice", "n=1", "n=capacity"],
)
def test_each_row_holds_the_discounted_sum_up_to_an_end_or_the_newest_step(
    tmp_path, capacity, num_envs, steps, n
):
    with make(tmp_path, capacity, num_envs, steps, seed=steps) as store:
        batch, info = store.sample(300, rng=1, transform=mr.NStep(n, gamma=0.9), return_info=True)
        check(store, batch, info.step, info.env, n, 0.9)
        store.commit()
        with mr.open(tmp_path / "b", "r") as reader:  # a reader: the same over the committed window
            batch, info = reader.sample(300, rng=2, transform=mr.NStep(n, gamma=0.9), return_info=True)
            check(reader, batch, info.step, info.env, n, 0.9)


@pytest.mark.parametrize("backend, compression", WITH_ROWS, ids=WITH_ROWS_IDS)
def test_every_backend_and_compression_reads_the_same_windows(tmp_path, backend, compression):
    with make(tmp_path, 16, 2, 40, seed=11, backend=backend, compression=compression) as store:  # wrapped
        batch, info = store.sample(200, rng=0, transform=mr.NStep(4, gamma=0.9), return_info=True)
        check(store, batch, info.step, info.env, 4, 0.9)


def test_termination_is_done_truncation_and_the_newest_step_bootstrap(tmp_path):
    spec = {k: SPEC[k] for k in SPEC}
    with mr.create(tmp_path / "b", spec, 20) as store:
        rows = steps_of(0, 10, 1, np.random.default_rng(0), end=0.0)
        rows["reward"][:] = 1.0
        rows["terminated"][2, 0] = True  # episode [0, 2] terminated
        rows["truncated"][5, 0] = True  # episode [3, 5] truncated, then [6, 9] open
        store.extend(rows)
        step = np.array([0, 1, 2, 3, 4, 6, 8, 9])
        batch = mr.read.read_rows(store, step, 0)
        assert batch["obs"][:, 0].tolist() == step.tolist()
        got, info = store.sample(200, rng=0, transform=mr.NStep(3, gamma=0.5), return_info=True)
        by_start = {int(s): i for i, s in enumerate(info.step)}
        table = {  # start: (return, next obs step, terminated, truncated, discount)
            0: (1.75, 3, True, False, 0.125),
            1: (1.5, 3, True, False, 0.25),
            2: (1.0, 3, True, False, 0.5),
            3: (1.75, 6, False, True, 0.125),
            5: (1.0, 6, False, True, 0.5),
            6: (1.75, 9, False, False, 0.125),
            8: (1.5, 10, False, False, 0.25),  # the newest step (9) ends the window: bootstrap
            9: (1.0, 10, False, False, 0.5),
        }
        for start, (ret, nxt, term, trunc, disc) in table.items():
            i = by_start[start]
            assert (got["reward"][i], got["next_obs"][i, 0], got["terminated"][i], got["truncated"][i]) == (
                ret,
                nxt,
                term,
                trunc,
            )
            assert got["discount"][i] == disc


def test_rewards_of_shape_one_give_returns_and_discounts_of_that_shape(tmp_path):
    """As skrl's memories store them: ``[1]`` rewards and ends."""
    shaped = {**SPEC, **{k: mr.ArraySpec((1,), SPEC[k].dtype) for k in ("reward", "terminated", "truncated")}}
    rows = steps_of(0, 30, 2, np.random.default_rng(9))
    with make(tmp_path, 40, 2, 0) as flat, mr.create(tmp_path / "shaped", shaped, 40, num_envs=2) as store:
        flat.extend(rows)
        store.extend(
            {k: v[..., None] if k in ("reward", "terminated", "truncated") else v for k, v in rows.items()}
        )
        a = flat.sample(50, rng=0, transform=mr.NStep(3, 0.9))
        b = store.sample(50, rng=0, transform=mr.NStep(3, 0.9))
        for key in a:
            assert b[key].shape == a[key].shape + (
                (1,) if key in ("reward", "terminated", "truncated", "discount") else ()
            )
            np.testing.assert_array_equal(b[key].reshape(a[key].shape), a[key], err_msg=key)


@pytest.mark.parametrize("dtype", ["int8", "int32", "int64", "uint16", "bool"])
def test_int_or_bool_rewards_give_float32_returns_as_the_batch_spec_says(tmp_path, dtype):
    """Int rewards (an Atari score, a success flag) sum to float32 returns, the dtype of
    the discount and of SB3's rewards: int32 and int64 rewards gave float64 returns, which
    a float32 Q target then mixes with."""
    ints = {**SPEC, "reward": mr.ArraySpec((), dtype)}
    rows = steps_of(0, 30, 2, np.random.default_rng(4))
    rows["reward"] = (rows["reward"] > 0).astype(dtype)
    with mr.create(tmp_path / "b", ints, 40, num_envs=2) as store:
        store.extend(rows)
        batch, info = store.sample(100, rng=0, transform=mr.NStep(3, 0.9), return_info=True)
        assert batch["reward"].dtype == np.float32 == batch["discount"].dtype
        check(store, batch, info.step, info.env, 3, 0.9)


def test_a_wrapped_ring_is_never_read_across_its_write_cursor(tmp_path):
    with make(tmp_path, 10, 1, 25, seed=3) as store:  # slots hold steps 15..24; 24 is next to 15
        store.extend({**steps_of(25, 1, 1, np.random.default_rng(4), end=0.0)})
        batch, info = store.sample(200, rng=0, transform=mr.NStep(4, 0.9), return_info=True)
        assert store.window[:2] == (16, 26)
        assert batch["next_obs"][:, 0].max() <= 26  # nothing past the newest step (25)
        assert (batch["next_obs"][:, 0] - info.step <= 4).all()
        check(store, batch, info.step, info.env, 4, 0.9)


def test_every_sampler(tmp_path):
    n, gamma = 3, 0.95
    with make(tmp_path, 30, 2, 40, seed=5, name="p", sampler="prioritized", alpha=1.0) as store:
        store.update_priorities(np.arange(10, 40), 0, np.arange(30) + 1.0)
        batch, info = store.sample(100, rng=0, transform=mr.NStep(n, gamma), return_info=True)
        assert info.weight is not None  # the draw is the prioritized one, the priority the start's
        check(store, batch, info.step, info.env, n, gamma)
    with make(tmp_path, 30, 2, 40, seed=6, name="s", sampler="slices", num_steps=4) as store:
        batch, info = store.sample(20, rng=0, transform=mr.NStep(n, gamma), return_info=True)
        assert batch["reward"].shape == (20, 4) and batch["discount"].shape == (20, 4)
        step = info.step[:, None] + np.arange(4)
        check(store, batch, step, np.broadcast_to(info.env[:, None], step.shape), n, gamma)
    with make(tmp_path, 30, 2, 40, seed=7, name="u") as store:  # sequences of the uniform sampler
        batch, info = store.sample(
            20, num_steps=5, within_episodes=True, rng=0, transform=mr.NStep(n, gamma), return_info=True
        )
        step = info.step[:, None] + np.arange(5)
        check(store, batch, step, np.broadcast_to(info.env[:, None], step.shape), n, gamma)


def test_transforms_made_afresh_for_each_batch_are_not_kept(tmp_path):
    """A reward_map made per batch (a lambda over the current scale) makes each call's
    transform a new one: the store must not keep them all."""
    with make(tmp_path, 20, 1, 10) as store:
        made = []
        for scale in range(50):
            nstep = mr.NStep(3, 0.9, reward_map=lambda r, scale=scale: r * scale)
            batch, info = store.sample(8, rng=scale, transform=nstep, return_info=True)
            made.append(weakref.ref(nstep))
            del nstep
        check(store, {**batch, "reward": batch["reward"] / 49}, info.step, info.env, 3, 0.9)
        gc.collect()
        assert sum(ref() is not None for ref in made) <= 10


def test_each_shard_of_a_group_keeps_its_own_episodes(tmp_path):
    path = tmp_path / "g"
    mr.create_group(path, SPEC, shards=2, capacity=20, num_envs=2).close()
    for shard in range(2):
        with mr.open_shard(path, shard) as store:
            store.extend(steps_of(0, 15 + 5 * shard, 2, np.random.default_rng(shard)))
    with mr.open_group(path) as group:
        batch, info = group.sample(200, rng=0, transform=mr.NStep(3, 0.9), return_info=True)
        assert set(batch) == set(SPEC) | {"discount"}
        for shard, store in enumerate(group.shards):
            mine = info.shard == shard
            check(store, {k: v[mine] for k, v in batch.items()}, info.step[mine], info.env[mine], 3, 0.9)


WRITER = textwrap.dedent(
    """
    import sys, time, numpy as np, mmreplay as mr
    sys.path.insert(0, {tests!r})
    from test_nstep import SPEC, steps_of
    store = mr.create({path!r}, SPEC, 32, num_envs=2, commit_every=3)
    rng, t = np.random.default_rng(0), 0
    while True:
        rows = steps_of(t, 2, 2, rng)
        rows["reward"][:] = rows["action"]  # the reward says which step it is
        store.extend(rows)
        time.sleep(0.001)
        t += 2
        if t == 40:
            store.commit()
            open({path!r} + ".ready", "w").close()
    """
)


def wait_for(path: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)


def test_a_reader_process_never_reads_past_its_window_while_a_writer_wraps_the_ring(tmp_path):
    path = str(tmp_path / "b")
    tests = os.path.dirname(__file__)
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(tests=tests, path=path)])
    try:
        wait_for(path + ".ready", proc)
        gamma = 0.5
        with mr.open(path, "r") as reader:
            while reader.window.first < 200:  # the ring wrapped several times under the reader
                reader.refresh()
                batch, info = reader.sample(64, transform=mr.NStep(4, gamma), return_info=True)
                k = np.rint(np.log(batch["discount"]) / np.log(gamma)).astype(int)
                last = info.step + k - 1
                assert (batch["next_obs"][:, 0] == last + 1).all()  # the bootstrap row is the last kept one's
                # the rewards summed are the rows of those steps, not of a step the writer wrote over them
                want = [sum(gamma**i * (s + i) for i in range(j)) for s, j in zip(info.step, k)]
                np.testing.assert_allclose(batch["reward"], want, rtol=1e-6)
                ended = batch["terminated"] | batch["truncated"]
                assert ((k == 4) | ended | (last == reader.window.end - 1)).all()
    finally:
        proc.kill()
        proc.wait()


RESUMED = textwrap.dedent(
    """
    import os, sys, numpy as np, mmreplay as mr
    sys.path.insert(0, {tests!r})
    from test_nstep import SPEC, steps_of
    store = mr.create({path!r}, SPEC, 100, commit_every=1)
    rows = steps_of(0, 10, 1, np.random.default_rng(0), end=0.0)
    store.extend(rows)
    store.commit()
    open({path!r} + ".ready", "w").close()
    import time
    time.sleep(60)
    """
)


def test_windows_stop_where_a_killed_writer_left_its_episode(tmp_path):
    path = str(tmp_path / "b")
    proc = subprocess.Popen(
        [sys.executable, "-c", RESUMED.format(tests=os.path.dirname(__file__), path=path)]
    )
    try:
        wait_for(path + ".ready", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with mr.open(path, "a") as store:  # resumes: the episode left open at step 9 was cut short
        store.extend(steps_of(10, 10, 1, np.random.default_rng(1), end=0.0))
        batch, info = store.sample(200, rng=0, transform=mr.NStep(5, 0.9), return_info=True)
        before = info.step <= 9
        assert before.any() and (batch["next_obs"][before, 0] <= 10).all()
        assert batch["truncated"][info.step == 9].all() and not batch["terminated"][before].any()
        check(store, batch, info.step, info.env, 5, 0.9)


@pytest.mark.parametrize(
    "n, gamma, match",
    [
        (0, 0.9, "n must be an int >= 1, got 0"),
        (2.0, 0.9, "n must be an int >= 1, got 2.0"),
        (True, 0.9, "n must be an int >= 1"),
        (3, -0.1, r"gamma must be a number in \[0, 1\], got -0.1"),
        (3, 1.5, "gamma must be a number in"),
        (3, float("nan"), "gamma must be a number in"),
        (3, "0.9", "gamma must be a number in"),
    ],
)
def test_bad_n_or_gamma_is_refused(n, gamma, match):
    with pytest.raises(mr.BadInputError, match=match):
        mr.NStep(n, gamma)


@pytest.mark.parametrize(
    "spec, roles, match",
    [
        (
            {"obs": SPEC["obs"], "next_obs": SPEC["obs"], "terminated": SPEC["terminated"]},
            None,
            "need the 'reward' role",
        ),
        (
            {"obs": SPEC["obs"], "reward": SPEC["reward"], "terminated": SPEC["terminated"]},
            None,
            "'next_observation'",
        ),
        ({**SPEC, "discount": SPEC["reward"]}, None, "a 'discount' field; the store's spec has one already"),
        (SPEC, {"terminated": None}, "need the 'terminated' role"),
    ],
    ids=["no-reward", "no-next-obs", "has-discount", "no-terminated"],
)
def test_a_store_without_what_n_step_needs_is_refused_before_drawing(tmp_path, spec, roles, match):
    store = mr.create(tmp_path / "b", spec, 10, roles=roles)
    store.extend({k: np.zeros((3, 1, *s.shape), s.dtype) for k, s in spec.items()})
    store.close()
    before = folder_digest(tmp_path / "b")
    with mr.open(tmp_path / "b", "a") as store, pytest.raises(mr.BadInputError, match=match):
        store.sample(4, transform=mr.NStep(2, 0.9))
    assert folder_digest(tmp_path / "b") == before


def test_a_reward_map_that_does_not_keep_one_number_per_reward_is_refused(tmp_path):
    with make(tmp_path, 20, 1, 10) as store:
        for bad, shown in [(lambda r: r.sum(-1), r"float32 \(8,\)"), (lambda r: r.astype(str), r"<U32 \(8, 3\)")]:
            with pytest.raises(mr.BadInputError, match=r"reward_map must return one number per reward .*\(8, 3\); it returned " + shown):
                store.sample(8, rng=0, transform=mr.NStep(3, 0.9, reward_map=bad))
