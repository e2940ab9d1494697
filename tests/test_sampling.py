"""store.sample: shapes, edges (empty, wrap, cursor, T at and past the stored length),
uniformity, reproducibility on every backend, readers re-sampling overwritten rows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import LAYOUT_IDS, LAYOUTS, make_step, run_cli, spread

import mmreplay as mr
from mmreplay import read
from mmreplay.read import draws, gather, request

SPEC = {
    "obs": mr.ArraySpec((3,), "float32"),
    "step": mr.ArraySpec((), "int64"),
    "env": mr.ArraySpec((), "int32"),
    "terminated": mr.ArraySpec((), "bool"),
}

#: chi-square critical values at p = 0.001 (a fixed-seed test that fails means a real bias)
CHI2_CRIT_001 = {11: 31.264, 23: 49.728, 29: 58.301, 41: 76.084}


def steps_of(t0: int, n: int, num_envs: int, ends: set[tuple[int, int]] = frozenset()) -> dict:
    """``n`` steps from global id ``t0``: every row says which (step, env) it is."""
    t = np.arange(t0, t0 + n)[:, None] + np.zeros((1, num_envs), np.int64)
    e = np.zeros((n, 1), np.int64) + np.arange(num_envs)[None]
    return {
        "obs": np.stack([t, e, t * 10 + e], -1).astype("float32"),
        "step": t.astype("int64"),
        "env": e.astype("int32"),
        "terminated": np.array([[(int(a), int(b)) in ends for b in range(num_envs)] for a in t[:, 0]], bool).reshape(n, num_envs),
    }


def make(tmp_path, capacity, num_envs, n, layout=None, ends=frozenset(), name="b", **kw):
    store = mr.create(tmp_path / name, SPEC, capacity, num_envs=num_envs, **(layout or {}), **kw)
    if n:
        store.extend(steps_of(0, n, num_envs, ends))
        store.commit()
    return store


def check_rows(batch: dict, step: np.ndarray, env: np.ndarray) -> None:
    """The data of each item is the row its (step, env) names."""
    np.testing.assert_array_equal(batch["step"], step)
    np.testing.assert_array_equal(batch["env"], env)
    np.testing.assert_array_equal(batch["obs"][..., 2], step * 10 + env)


def chi2(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


# --- pure index math ---------------------------------------------------------------


def test_draw_uniform_covers_exactly_the_valid_starts():
    gen = np.random.default_rng(0)
    window = draws.Window(first=3, end=10, num_envs=2, capacity=7)
    d = draws.draw_uniform(window, batch_size=5000, num_steps=3, replacement=True, gen=gen)
    assert set(zip(d.step.tolist(), d.env.tolist())) == {(s, e) for s in range(3, 8) for e in range(2)}
    assert np.all(d.probability == 1 / 10)
    # start rows are slot * num_envs + env, before folding into the ring of 7 * 2 rows
    assert np.array_equal(d.start % 14, (d.step % 7) * 2 + d.env) and d.start.max() < 28


def test_rows_of_steps_by_num_envs_and_wraps_in_the_gather():
    start = np.array([4 * 2 + 1, 6 * 2 + 0])  # (slot 4, env 1) and (slot 6, env 0) in a ring of 5
    rows = draws.rows_of(start, 3, num_envs=2)
    assert rows.tolist() == [[9, 11, 13], [12, 14, 16]]
    # folded into the ring of 5 slots: slots 4,0,1 and 1,2,3
    assert (rows % 10).tolist() == [[9, 1, 3], [2, 4, 6]]
    assert draws.rows_of(start, None, 2) is start


def test_as_generator_accepts_seed_generator_none_only():
    g = np.random.default_rng(1)
    assert request.as_generator(g) is g
    assert request.as_generator(3).integers(1 << 30) == np.random.default_rng(3).integers(1 << 30)
    assert isinstance(request.as_generator(None), np.random.Generator)
    with pytest.raises(TypeError, match="rng must be"):
        request.as_generator("seed")


def test_draw_in_spans_stays_in_spans():
    gen = np.random.default_rng(0)
    env, first, length = np.array([0, 0, 1]), np.array([0, 4, 2]), np.array([4, 2, 5])
    d = draws.draw_in_spans(env, first, length, draws.Window(0, 10, 2, 10), 4000, 3, True, gen)
    got = set(zip(d.step.tolist(), d.env.tolist()))
    assert got == {(0, 0), (1, 0), (2, 1), (3, 1), (4, 1)}  # the span of 2 holds no window of 3
    assert np.all(d.probability == 1 / 5)
    with pytest.raises(mr.NotEnoughDataError, match="longest retained episode has 5 steps"):
        draws.draw_in_spans(env, first, length, draws.Window(0, 10, 2, 10), 1, 6, True, gen)


# --- shapes and values --------------------------------------------------------------


def test_sample_shapes_and_rows_on_every_layout(tmp_path, layout):
    with make(tmp_path, 20, 3, 12, layout) as store:
        batch, info = store.sample(64, rng=0, return_info=True)
        assert batch["obs"].shape == (64, 3) and batch["step"].shape == (64,)
        check_rows(batch, info.step, info.env)
        assert np.all(info.slot == info.step % 20)
        seq, info = store.sample(16, num_steps=5, rng=1, return_info=True)
        assert seq["obs"].shape == (16, 5, 3)
        check_rows(seq, info.step[:, None] + np.arange(5), info.env[:, None] + np.zeros(5, int))
        one = store.sample(4, num_steps=1, rng=2)
        assert one["obs"].shape == (4, 1, 3)


def test_nested_spec_keeps_its_nest(tmp_path, nested_spec, layout):
    with mr.create(tmp_path / "n", nested_spec, 8, num_envs=2, **layout) as store:
        for t in range(5):
            store.add(make_step(nested_spec, 2, t))
        store.commit()
        batch, info = store.sample(6, num_steps=2, rng=0, return_info=True)
        assert set(batch) == {"obs", "action", "reward", "terminated", "truncated"}
        assert batch["obs"]["pixels"].shape == (6, 2, 4, 4, 3)
        for i in range(6):
            want = make_step(nested_spec, 2, int(info.step[i]) + 1)
            np.testing.assert_array_equal(batch["obs"]["state"][i, 1], want["obs"]["state"][info.env[i]])


def test_same_seed_gives_identical_batches_on_every_backend(tmp_path):
    batches = []
    for i, (backend, compression) in enumerate(LAYOUTS):
        with make(tmp_path, 16, 2, 23, {"backend": backend, "compression": compression}, name=f"b{i}") as store:
            plain = store.sample(40, rng=7)
            seq = store.sample(10, num_steps=4, rng=np.random.default_rng(8))
            unique = store.sample(30, replacement=False, rng=9)
            batches.append((plain, seq, unique))
    for other in batches[1:]:
        for a, b in zip(batches[0], other):
            for key in SPEC:
                np.testing.assert_array_equal(a[key], b[key])


def test_seed_reproduces_and_generator_advances(tmp_path):
    with make(tmp_path, 50, 2, 40) as store:
        a = store.sample(32, rng=5)["step"]
        assert np.array_equal(a, store.sample(32, rng=5)["step"])
        gen = np.random.default_rng(5)
        b, c = store.sample(32, rng=gen)["step"], store.sample(32, rng=gen)["step"]
        assert np.array_equal(a, b) and not np.array_equal(b, c)
        # each call draws from the generator it is given, never from an earlier call's
        assert np.array_equal(a, store.sample(32, rng=np.random.default_rng(5))["step"])
        state = gen.bit_generator.state
        store.sample(32)  # the store's own generator
        assert gen.bit_generator.state == state


# --- edges ----------------------------------------------------------------------------


def test_empty_store_says_empty(tmp_path, layout):
    with make(tmp_path, 10, 2, 0, layout) as store:
        with pytest.raises(mr.NotEnoughDataError, match="empty"):
            store.sample(4)
        with pytest.raises(mr.NotEnoughDataError, match="empty"):
            store.sample(4, num_steps=2, within_episodes=True)


def test_too_little_data_names_the_store(tmp_path):
    """The draws' errors said "cannot sample: ..." without the store: a learner over
    several stores (or `mmreplay sample`) could not tell which one was short."""
    with make(tmp_path, 10, 2, 0, name="empty") as empty, make(tmp_path, 10, 2, 4, name="short") as short:
        asks = [{"num_steps": 5}, {"num_steps": 5, "within_episodes": True}, {"num_steps": 5, "window": (0, 9)}]
        for store, kw in [(empty, {}), *((short, ask) for ask in asks)]:
            with pytest.raises(mr.NotEnoughDataError) as err:
                store.sample(4, **kw)
            assert str(err.value).startswith(f"{store.path}: cannot sample"), kw
    out = run_cli("sample", str(tmp_path / "empty"))
    said = f"Error: {tmp_path / 'empty'}: cannot sample: the store holds no committed steps (it is empty)"
    assert (out.returncode, out.stderr.strip()) == (2, said)


def test_a_writer_samples_its_uncommitted_steps(tmp_path):
    with make(tmp_path, 10, 1, 0, commit_every=100) as store:
        store.extend(steps_of(0, 3, 1))
        assert store.committed_steps == 0
        assert set(store.sample(200, rng=0)["step"].tolist()) == {0, 1, 2}


def test_num_steps_equal_to_stored_length_and_one_more(tmp_path, layout):
    with make(tmp_path, 5, 2, 5, layout) as store:
        batch, info = store.sample(8, num_steps=5, rng=0, return_info=True)
        assert np.all(info.step == 0)
        assert batch["step"].tolist() == [[0, 1, 2, 3, 4]] * 8
        with pytest.raises(mr.NotEnoughDataError, match="num_steps=6.*5 committed steps.*too short"):
            store.sample(1, num_steps=6)


def test_sequences_never_cross_the_cursor_or_the_oldest_step_after_a_wrap(tmp_path, layout):
    # capacity 5, 7 steps: retained 2..6; windows of 3 start at 2, 3 or 4 only
    with make(tmp_path, 5, 2, 7, layout) as store:
        assert store.first_step == 2
        batch, info = store.sample(600, num_steps=3, rng=0, return_info=True)
        assert set(info.step.tolist()) == {2, 3, 4}
        assert np.all(np.diff(batch["step"], axis=1) == 1)  # time order, one env
        assert np.all(batch["env"] == info.env[:, None])
        check_rows(batch, info.step[:, None] + np.arange(3), info.env[:, None] + np.zeros(3, int))
        assert set(store.sample(600, rng=1)["step"].tolist()) == {2, 3, 4, 5, 6}


def test_without_replacement_gives_unique_rows_at_most_all(tmp_path, layout):
    with make(tmp_path, 10, 3, 4, layout) as store:
        batch, info = store.sample(8, replacement=False, rng=0, return_info=True)
        pairs = set(zip(info.step.tolist(), info.env.tolist()))
        assert len(pairs) == 8
        check_rows(batch, info.step, info.env)
        everything, info = store.sample(100, replacement=False, rng=1, return_info=True)
        assert len(everything["step"]) == 12
        assert set(zip(info.step.tolist(), info.env.tolist())) == {(s, e) for s in range(4) for e in range(3)}
        seqs, info = store.sample(100, num_steps=3, replacement=False, rng=2, return_info=True)
        assert len(info.step) == 6 and len(set(zip(info.step.tolist(), info.env.tolist()))) == 6


def test_return_info_probability_is_one_over_the_valid_starts(tmp_path):
    with make(tmp_path, 10, 3, 7) as store:
        _, info = store.sample(5, rng=0, return_info=True)
        assert np.allclose(info.probability, 1 / 21)
        _, info = store.sample(5, num_steps=4, rng=0, return_info=True)
        assert np.allclose(info.probability, 1 / 12)
        assert set(vars(info)) == {"step", "env", "slot", "probability", "weight"} and info.weight is None


def test_bad_arguments_are_refused(tmp_path):
    with make(tmp_path, 10, 1, 4) as store:
        for bad in (0, -1, 2.0, None, True):
            with pytest.raises(ValueError, match="batch_size"):
                store.sample(bad)
        with pytest.raises(ValueError, match="num_steps"):
            store.sample(2, num_steps=0)
        with pytest.raises(TypeError, match="rng"):
            store.sample(2, rng="x")
    with pytest.raises(mr.ClosedError):
        store.sample(1)


def test_a_flag_or_transform_of_the_wrong_kind_is_refused_by_name(tmp_path):
    """replacement="no" read as true (repeated rows), within_episodes="no" as true, a
    transform that is not one failed with AttributeError deep in the read path, and a
    float batch size was told it may be None."""
    with make(tmp_path, 10, 1, 4) as store:
        for name in ("replacement", "within_episodes"):
            with pytest.raises(TypeError, match=f"{name} must be True or False, got str 'no'"):
                store.sample(2, **{name: "no"})
        with pytest.raises(TypeError, match="transform must be a transform such as mr.NStep.* got str 'nstep'"):
            store.sample(2, transform="nstep")
        with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 2.0$"):
            store.sample(2.0)
        _, info = store.sample(4, replacement=np.False_, within_episodes=0, num_steps=1, return_info=True, rng=0)
        assert sorted(info.step) == [0, 1, 2, 3]  # numpy bools and 0 / 1 still count


def test_a_window_must_be_two_step_ids_and_one_outside_the_retained_steps_says_so(tmp_path):
    with make(tmp_path, 10, 2, 14) as store:  # steps 4-13 retained
        for bad in ((5,), (4.5, 9), ("a", 9), (4, 9, 1), 7, (True, 9)):
            with pytest.raises(ValueError, match=r"window must be a pair of int global step ids \(first, end\), got"):
                store.sample(4, window=bad)
            with pytest.raises(ValueError, match="window must be a pair"):
                next(store.iterate(window=bad))
        batch, info = store.sample(64, window=(np.int64(5), np.int64(7)), return_info=True, rng=0)
        assert set(info.step.tolist()) == {5, 6}
        check_rows(batch, info.step, info.env)
        for outside in ((0, 4), (20, 30), (9, 9)):
            with pytest.raises(mr.NotEnoughDataError, match=rf"window={re.escape(str(outside))} holds none of the steps retained, \[4, 14\)"):
                store.sample(4, window=outside)


# --- episodes -------------------------------------------------------------------------


def test_within_episodes_never_crosses_an_end(tmp_path, layout):
    # env 0 ends at 2 and 5; env 1 ends at 6. Windows of 3 inside episodes:
    # env 0: [0..2] -> start 0; [3..5] -> 3; [6..9] -> 6, 7.  env 1: [0..6] -> 0..4; [7..9] -> 7
    ends = {(2, 0), (5, 0), (6, 1)}
    with make(tmp_path, 12, 2, 10, layout, ends=ends) as store:
        batch, info = store.sample(3000, num_steps=3, within_episodes=True, rng=0, return_info=True)
        got = set(zip(info.step.tolist(), info.env.tolist()))
        assert got == {(0, 0), (3, 0), (6, 0), (7, 0), (0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (7, 1)}
        assert not batch["terminated"][:, :-1].any()  # an end only ever at a window's last step
        check_rows(batch, info.step[:, None] + np.arange(3), info.env[:, None] + np.zeros(3, int))
        counts = np.unique(info.step * 2 + info.env, return_counts=True)[1]
        assert chi2(counts) < 27.877  # df 9, p = 0.001
        with pytest.raises(mr.NotEnoughDataError, match="longest retained episode has 7 steps"):
            store.sample(1, num_steps=8, within_episodes=True)


def test_within_episodes_draws_only_inside_a_narrower_window(tmp_path):
    # env 0 ends at 2 and 5: episodes [0..2], [3..5], [6..9]; window (4, 8) cuts the first two
    with make(tmp_path, 12, 1, 10, ends={(2, 0), (5, 0)}) as store:
        batch, info = store.sample(
            500, num_steps=2, within_episodes=True, window=(4, 8), rng=0, return_info=True
        )
        assert set(info.step.tolist()) == {4, 6}  # [4, 5] and [6, 7]: every 2-step start in both
        check_rows(batch, info.step[:, None] + np.arange(2), np.repeat(info.env[:, None], 2, 1))
        np.testing.assert_allclose(info.probability, 1 / 2)
        _, info = store.sample(200, within_episodes=True, window=(4, 8), rng=1, return_info=True)
        assert set(info.step.tolist()) == {4, 5, 6, 7}


# --- uniformity -----------------------------------------------------------------------


def test_uniform_rows_pass_chi_square(tmp_path):
    with make(tmp_path, 10, 3, 14) as store:  # wrapped: steps 4..13, 30 rows
        _, info = store.sample(6000, rng=12345, return_info=True)
        cells = (info.step - 4) * 3 + info.env
        counts = np.bincount(cells, minlength=30)
        assert counts.size == 30 and counts.min() > 0
        assert chi2(counts) < CHI2_CRIT_001[29]


def test_uniform_sequences_pass_chi_square(tmp_path):
    with make(tmp_path, 20, 2, 15) as store:  # windows of 4: starts 0..11 per env, 24 cells
        _, info = store.sample(4800, num_steps=4, rng=999, return_info=True)
        counts = np.bincount(info.step * 2 + info.env, minlength=24)
        assert counts.size == 24
        assert chi2(counts) < CHI2_CRIT_001[23]


def test_chi_square_check_has_power():
    """The statistic is not vacuous: one cell drawn twice as often fails it."""
    gen = np.random.default_rng(0)
    p = np.ones(30)
    p[0] = 2
    biased = np.bincount(gen.choice(30, 6000, p=p / p.sum()), minlength=30)
    assert chi2(biased) > CHI2_CRIT_001[29]


# --- prefetch mode ---------------------------------------------------------------------


def test_prefetch_mode_returns_the_same_rows(tmp_path, layout):
    with make(tmp_path, 64, 4, 100, layout) as store:
        plain = store.sample(50, rng=3)
        seq = store.sample(10, num_steps=8, rng=4)
        read.set_prefetch(store, True)
        np.testing.assert_array_equal(store.sample(50, rng=3)["obs"], plain["obs"])
        np.testing.assert_array_equal(store.sample(10, num_steps=8, rng=4)["obs"], seq["obs"])
        for _ in range(5):  # the store's own rng: the next batch is drawn ahead and prefetched
            batch, info = store.sample(32, return_info=True)
            check_rows(batch, info.step, info.env)
        if store._leaves[0].__class__.__name__ == "MappedLeaf":
            assert {leaf.advice for leaf in store._leaves} == {"random"}
            # the writer keeps the slots ahead of its cursor on readahead
            assert {leaf.advice_keep[0] for leaf in store._leaves} == {100 % 64}
            store.sample(4, num_steps=2)
            assert {leaf.advice for leaf in store._leaves} == {"normal"}
        read.set_prefetch(store, False)
        np.testing.assert_array_equal(store.sample(50, rng=3)["obs"], plain["obs"])
    assert store._parts == {}  # the read path and its prefetch thread were closed with the store


def test_the_store_generator_can_be_seeded_and_prefetches_the_next_batch(tmp_path, layout):
    with make(tmp_path, 64, 4, 100, layout) as store:
        read.set_rng(store, 11)
        plain = [store.sample(16)["step"] for _ in range(3)]
        read.set_prefetch(store, True)
        read.set_rng(store, 11)
        ahead = [store.sample(16)["step"] for _ in range(3)]
        assert all(np.array_equal(a, b) for a, b in zip(plain, ahead))
        reader = gather.reader_for(store)
        assert (reader.pending is not None) == bool(reader.mapped)  # the next batch, drawn and prefetched


@pytest.mark.parametrize("who", ["writer", "reader"])
def test_a_batch_drawn_ahead_is_drawn_again_once_set_moved_an_episode_end(tmp_path, who):
    with make(tmp_path, 64, 2, 40) as writer:  # one episode per env, 40 steps long
        store = writer if who == "writer" else mr.open(tmp_path / "b")
        read.set_prefetch(store, True)
        read.set_rng(store, 0)
        store.sample(16, num_steps=4, within_episodes=True)  # and the next batch, drawn ahead
        ends = steps_of(0, 40, 2, {(t, e) for t in range(1, 40, 4) for e in range(2)})
        writer.set(slice(None), ends)  # episodes of 4 steps: 2-5, 6-9...
        if store is not writer:  # (the writer samples what it set before any commit)
            writer.commit()
            store.refresh()
        batch, info = store.sample(16, num_steps=4, within_episodes=True, return_info=True)
        steps = info.step[:, None] + np.arange(4)
        check_rows(batch, steps, np.broadcast_to(info.env[:, None], steps.shape))
        assert not batch["terminated"][:, :-1].any()  # no sequence runs past an episode's end
        if store is not writer:
            store.close()


def test_page_advice_defaults(tmp_path):
    with make(tmp_path, 64, 4, 100) as writer:
        writer.sample(8, rng=0)
        assert {leaf.advice for leaf in writer._leaves} == {None}  # a writer whose ring fits in memory
        with mr.open(tmp_path / "b", "r") as reader:
            reader.sample(8, rng=0)
            assert {leaf.advice for leaf in reader._leaves} == {"random"}
            assert {leaf.advice_keep for leaf in reader._leaves} == {None}
            next(reader.iterate(num_steps=4))
            assert {leaf.advice for leaf in reader._leaves} == {"normal"}
            read.set_prefetch(reader, False, advise=False)
            reader.sample(8, rng=0)
            assert {leaf.advice for leaf in reader._leaves} == {"normal"}


def test_read_rows_reads_named_rows_and_refuses_others(tmp_path, layout):
    with make(tmp_path, 6, 2, 9, layout) as store:  # retained 3..8
        out = read.read_rows(store, np.array([[3, 8], [5, 6]]), np.array([[1, 0], [0, 1]]))
        check_rows(out, np.array([[3, 8], [5, 6]]), np.array([[1, 0], [0, 1]]))
        with pytest.raises(mr.NotEnoughDataError, match=r"retained are \[3, 9\)"):
            read.read_rows(store, [2], [0])
        with pytest.raises(mr.NotEnoughDataError):
            read.read_rows(store, [9], [0])


# --- readers --------------------------------------------------------------------------


def test_reader_resamples_rows_overwritten_while_it_read(tmp_path, layout):
    with make(tmp_path, 16, 2, 8, layout) as writer:
        reader = mr.open(tmp_path / "b", "r")
        try:
            assert (reader.first_step, reader.state.end) == (0, 8)
            writer.extend(steps_of(8, 16, 2))  # every step the reader knows is overwritten
            writer.commit()
            batch, info = reader.sample(40, rng=0, return_info=True)
            assert info.step.min() >= 8  # every overwritten item was drawn again
            check_rows(batch, info.step, info.env)
            seq, info = reader.sample(5, num_steps=3, rng=1, return_info=True)
            check_rows(seq, info.step[:, None] + np.arange(3), info.env[:, None] + np.zeros(3, int))
        finally:
            reader.close()


WRITER = textwrap.dedent(
    """
    import sys, numpy as np, mmreplay as mr
    sys.path.insert(0, {tests!r})
    from test_sampling import SPEC, steps_of
    store = mr.create({path!r}, SPEC, {capacity}, num_envs=2, commit_every=3, **{layout!r})
    t = 0
    while t < {total}:
        store.extend(steps_of(t, 5, 2))
        t += 5
        if t == 20:
            store.commit()
            open({path!r} + ".ready", "w").close()
    store.close()
    """
)


# test_concurrency.py reads beside a writer process on every layout
@pytest.mark.parametrize("layout_index", spread(dict(zip(LAYOUT_IDS, range(len(LAYOUTS)))), normal=["zarr-zstd", "hdf5-mapped"]))
def test_reader_process_samples_while_a_writer_process_writes(tmp_path, layout_index):
    backend, compression = LAYOUTS[layout_index]
    path = str(tmp_path / "live")
    script = WRITER.format(
        tests=os.path.dirname(__file__), path=path, capacity=24, total=1000,
        layout={"backend": backend, "compression": compression},
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path + ".ready"):
            assert proc.poll() is None or os.path.exists(path + ".ready"), "writer died"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reader = mr.open(path, "r")
        seen = set()
        batches = 0
        try:
            while proc.poll() is None or batches < 5:
                reader.refresh()
                try:
                    batch, info = reader.sample(16, num_steps=3, return_info=True)
                except mr.NotEnoughDataError as exc:  # overwritten 16 times in a row: rare, allowed
                    assert "overwrote" in str(exc)
                    continue
                check_rows(batch, info.step[:, None] + np.arange(3), info.env[:, None] + np.zeros(3, int))
                seen.update(info.step.tolist())
                batches += 1
        finally:
            reader.close()
        assert proc.wait(timeout=60) == 0
        assert batches >= 5 and max(seen) > 20  # it really read while the writer moved on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
