"""store.iterate: one deterministic pass, the exact windows of the TF-Agents semantics,
shift and drop combinations, batching, shuffling, wraps, and readers behind a writer."""

from __future__ import annotations

import numpy as np
import pytest
from test_sampling import make, steps_of

import mmreplay as mr


def windows(store, **kw) -> list:
    return [b["step"].tolist() for b in store.iterate(**kw)]


def test_windows_of_two_over_five_steps(tmp_path, layout):
    with make(tmp_path, 5, 1, 5, layout) as store:
        assert windows(store, num_steps=2) == [[0, 1], [2, 3], [4]]
        assert windows(store, num_steps=2, drop_remainder=True) == [[0, 1], [2, 3]]
        assert windows(store, num_steps=2, window_shift=1) == [[0, 1], [1, 2], [2, 3], [3, 4], [4]]
        assert windows(store, num_steps=2, window_shift=1, drop_remainder=True) == [[0, 1], [1, 2], [2, 3], [3, 4]]


def test_shift_larger_than_the_window_skips_rows(tmp_path):
    with make(tmp_path, 10, 1, 7) as store:
        assert windows(store, num_steps=2, window_shift=3) == [[0, 1], [3, 4], [6]]
        assert windows(store, num_steps=3, window_shift=1) == [
            [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6], [5, 6], [6]
        ]


def test_after_a_wrap_the_pass_starts_at_the_oldest_retained_step(tmp_path, layout):
    with make(tmp_path, 5, 1, 7, layout) as store:
        assert [b["step"].item() for b in store.iterate()] == [2, 3, 4, 5, 6]
        assert windows(store, num_steps=2) == [[2, 3], [4, 5], [6]]
        assert windows(store, num_steps=5) == [[2, 3, 4, 5, 6]]
        assert windows(store, num_steps=6) == [[2, 3, 4, 5, 6]]  # kept: only one shorter window
        with pytest.raises(mr.NotEnoughDataError, match="all data would be dropped"):
            windows(store, num_steps=6, drop_remainder=True)


def test_rows_go_env_by_env_in_time_order(tmp_path, layout):
    with make(tmp_path, 10, 3, 4, layout) as store:
        rows = [(b["step"].item(), b["env"].item()) for b in store.iterate()]
        assert rows == [(s, e) for e in range(3) for s in range(4)]
        assert store.iterate().__next__()["obs"].shape == (3,)
        batches = [(b["step"].tolist(), b["env"].tolist()) for b in store.iterate(batch_size=5)]
        assert batches == [
            ([0, 1, 2, 3, 0], [0, 0, 0, 0, 1]),
            ([1, 2, 3, 0, 1], [1, 1, 1, 2, 2]),
            ([2, 3], [2, 2]),
        ]
        assert len(list(store.iterate(batch_size=5, drop_remainder=True))) == 2


def test_batches_of_windows_keep_each_env_stream_apart(tmp_path, layout):
    # 2 envs, 5 steps, windows of 2: full [0,1],[2,3] per env, then the [4] of each env
    with make(tmp_path, 8, 2, 5, layout) as store:
        out = [(b["step"].tolist(), b["env"][:, 0].tolist()) for b in store.iterate(batch_size=3, num_steps=2)]
        assert out == [
            ([[0, 1], [2, 3], [0, 1]], [0, 0, 1]),
            ([[2, 3]], [1]),
            ([[4], [4]], [0, 1]),
        ]
        dropped = [b["step"].tolist() for b in store.iterate(batch_size=3, num_steps=2, drop_remainder=True)]
        assert dropped == [[[0, 1], [2, 3], [0, 1]]]
        assert all(b["obs"].shape[:2] == (2, 2) for b in store.iterate(batch_size=2, num_steps=2, drop_remainder=True))


def test_every_row_is_visited_once(tmp_path):
    with make(tmp_path, 30, 4, 23) as store:
        seen = np.concatenate([b["step"] * 4 + b["env"] for b in store.iterate(batch_size=7)])
        assert sorted(seen.tolist()) == list(range(92))


def test_shuffle_is_a_seeded_permutation_of_the_same_windows(tmp_path, layout):
    with make(tmp_path, 40, 2, 30, layout) as store:
        plain = windows(store, batch_size=4, num_steps=3)
        a = windows(store, batch_size=4, num_steps=3, shuffle=True, rng=1)
        b = windows(store, batch_size=4, num_steps=3, shuffle=True, rng=1)
        c = windows(store, batch_size=4, num_steps=3, shuffle=True, rng=2)
        assert a == b and a != c and a != plain
        flat = lambda bs: sorted(tuple(w) for batch in bs for w in batch)  # noqa: E731
        assert flat(a) == flat(plain) == flat(c)
        assert sorted(windows(store, shuffle=True, rng=0)) == sorted(windows(store))


def test_empty_store_gives_an_empty_pass(tmp_path, layout):
    with make(tmp_path, 5, 2, 0, layout) as store:
        assert list(store.iterate()) == []
        assert list(store.iterate(batch_size=2, num_steps=2, drop_remainder=True)) == []


def test_the_window_is_read_when_the_pass_is_made(tmp_path):
    with make(tmp_path, 20, 1, 4) as store:
        it = store.iterate(num_steps=2)
        store.extend(steps_of(4, 4, 1))
        store.commit()
        assert [b["step"].tolist() for b in it] == [[0, 1], [2, 3]]


def test_bad_arguments(tmp_path):
    with make(tmp_path, 5, 2, 5) as store:
        with pytest.raises(ValueError, match="window_shift needs num_steps"):
            store.iterate(window_shift=2)
        with pytest.raises(ValueError, match="batch_size"):
            store.iterate(batch_size=0)
        with pytest.raises(mr.NotEnoughDataError, match="batch_size=11"):
            store.iterate(batch_size=11, drop_remainder=True)
        with pytest.raises(TypeError, match="rng"):
            store.iterate(shuffle=True, rng=1.5)


def test_a_reader_pass_overtaken_by_the_writer_says_so(tmp_path, layout):
    with make(tmp_path, 16, 1, 8, layout) as writer:
        with mr.open(tmp_path / "b", "r") as reader:
            it = reader.iterate(num_steps=2)
            assert next(it)["step"].tolist() == [0, 1]
            writer.extend(steps_of(8, 16, 1))
            writer.commit()
            with pytest.raises(mr.NotEnoughDataError, match="overwritten by the writer during the pass"):
                next(it)


@pytest.mark.parametrize("commit", [True, False])
def test_a_writer_pass_overtaken_by_its_own_adds_says_so(tmp_path, layout, commit):
    with make(tmp_path, 8, 1, 8, layout) as store:
        it = store.iterate(num_steps=2)
        assert next(it)["step"].tolist() == [0, 1]
        store.extend(steps_of(8, 5, 1))  # steps 2..4 now hold 8..12
        if commit:
            store.commit()
        with pytest.raises(mr.NotEnoughDataError, match="step 2 was overwritten by the writer during the pass"):
            next(it)


def test_pass_in_prefetch_mode_is_the_same(tmp_path, layout):
    from mmreplay import read

    with make(tmp_path, 40, 2, 30, layout) as store:
        want = windows(store, batch_size=4, num_steps=3, shuffle=True, rng=5)
        read.set_prefetch(store, True)
        assert windows(store, batch_size=4, num_steps=3, shuffle=True, rng=5) == want
        assert sorted(b["step"].item() * 2 + b["env"].item() for b in store.iterate(shuffle=True, rng=1)) == list(range(60))



def test_env_groups_a_narrower_window_and_step_ids(tmp_path):
    store = mr.create(tmp_path / "b", {"x": mr.ArraySpec((), "int64")}, 10, num_envs=3)
    for t in range(6):
        store.add({"x": np.array([t, 100 + t, 200 + t])})
    got = [
        (b["x"].tolist(), steps.tolist(), envs.tolist())
        for b, steps, envs in store.iterate(
            batch_size=2, num_steps=2, window=(1, 6), group_envs=True, return_steps=True
        )
    ]
    # the same window of envs 0 and 1, then of env 2 alone; a shorter last window is kept
    assert got == [
        ([[1, 2], [101, 102]], [[1, 2], [1, 2]], [[0, 0], [1, 1]]),
        ([[3, 4], [103, 104]], [[3, 4], [3, 4]], [[0, 0], [1, 1]]),
        ([[5], [105]], [[5], [5]], [[0], [1]]),
        ([[201, 202]], [[1, 2]], [[2, 2]]),
        ([[203, 204]], [[3, 4]], [[2, 2]]),
        ([[205]], [[5]], [[2]]),
    ]
    dropped = store.iterate(batch_size=2, num_steps=2, window=(1, 6), group_envs=True, drop_remainder=True)
    assert [b["x"].tolist() for b in dropped] == [[[1, 2], [101, 102]], [[3, 4], [103, 104]]]
    assert list(store.iterate(num_steps=4, window=(4, 6), group_envs=True, drop_remainder=True)) == []
    with pytest.raises(ValueError, match="cannot be shuffled"):
        store.iterate(batch_size=2, group_envs=True, shuffle=True)
    store.close()
