"""Episodes from the role leaves, the persisted episode index, and to_arrays."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.episodes import Episode, EpisodeSpan, complete_spans, index_for
from mmreplay.episodes.index_file import HEADER_BYTES, INDEX_FILE, MAGIC, RECORD

SPEC = {
    "obs": mr.ArraySpec((2,), "float32"),
    "action": mr.ArraySpec((1,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
    "extra": mr.ArraySpec((), "int32"),
}


def steps(t0: int, n: int, num_envs: int, ends: dict) -> dict:
    """``n`` steps from global id ``t0``; ``ends[(step, env)]`` is "term" or "trunc"."""
    t = np.arange(t0, t0 + n)[:, None] + np.zeros((1, num_envs), int)
    e = np.arange(num_envs)[None] + np.zeros((n, 1), int)
    flag = lambda kind: np.vectorize(lambda a, b: ends.get((int(a), int(b))) == kind)(t, e).astype(bool)  # noqa: E731
    return {
        "obs": np.stack([t, e], -1).astype("float32"),
        "action": (t * 10 + e)[..., None].astype("float32"),
        "reward": (t + 0.5).astype("float32"),
        "terminated": flag("term"),
        "truncated": flag("trunc"),
        "extra": (t * 100 + e).astype("int32"),
    }


def make(tmp_path, capacity, num_envs, n, ends, layout=None, spec=SPEC, name="b", **kw):
    store = mr.create(tmp_path / name, spec, capacity, num_envs=num_envs, **(layout or {}), **kw)
    if n:
        store.extend(steps(0, n, num_envs, ends))
        store.commit()
    return store


def spans(store, **kw) -> list[tuple]:
    return [(s.env, s.first_step, s.last_step, s.status) for s in store.episode_index(**kw)]


ENDS = {(2, 0): "term", (5, 0): "trunc", (3, 1): "trunc", (4, 1): "term"}


def test_terminations_truncations_and_open_tails(tmp_path, layout):
    with make(tmp_path, 20, 2, 8, ENDS, layout) as store:
        want = [
            (0, 0, 2, "terminated"), (0, 3, 5, "truncated"), (0, 6, 7, "open"),
            (1, 0, 3, "truncated"), (1, 4, 4, "terminated"), (1, 5, 7, "open"),
        ]
        assert spans(store) == want
        assert spans(store, env=1) == want[3:]
        assert spans(store, complete_only=True) == [w for w in want if w[3] != "open"]
        eps = list(store.episodes())
        assert [(e.env, e.first_step, e.last_step, e.status) for e in eps] == want
        for ep in eps:
            np.testing.assert_array_equal(ep.data["obs"][:, 0], np.arange(ep.first_step, ep.last_step + 1))
            assert np.all(ep.data["obs"][:, 1] == ep.env)
            assert ep.data["action"].shape == (ep.length, 1) and ep.length == ep.last_step - ep.first_step + 1
        assert [e.length for e in store.episodes(env=0, complete_only=True)] == [3, 3]


def test_terminated_wins_when_both_flags_are_set(tmp_path):
    with make(tmp_path, 10, 1, 0, {}) as store:
        data = steps(0, 3, 1, {(1, 0): "term"})
        data["truncated"][1, 0] = True
        store.extend(data)
        store.commit()
        assert spans(store) == [(0, 0, 1, "terminated"), (0, 2, 2, "open")]


def test_episode_types_are_frozen_and_readable(tmp_path):
    with make(tmp_path, 10, 1, 4, {(1, 0): "term"}) as store:
        ep = next(store.episodes())
        span = store.episode_index()[0]
    assert span == EpisodeSpan(0, 0, 1, "terminated") and span.length == 2
    assert ep.span == span and isinstance(ep, Episode)
    assert repr(ep) == "Episode(env=0, first_step=0, last_step=1, length=2, status='terminated')"
    with pytest.raises(AttributeError):
        ep.status = "open"


def test_an_episode_cut_by_the_ring_is_open(tmp_path, layout):
    # capacity 6, 9 steps: steps 0..2 are overwritten
    ends = {(1, 0): "term", (4, 0): "term", (4, 1): "trunc", (7, 1): "term"}
    with make(tmp_path, 6, 2, 9, ends, layout) as store:
        first = store.first_step
        assert first == 3
        # env 0: step 2 was no end, so the episode 2..4 lost its start: open though it terminated
        # env 1: step 2 no end either: 3..4 open, 5..7 terminated, 8 open
        assert spans(store) == [
            (0, 3, 4, "open"), (0, 5, 8, "open"),
            (1, 3, 4, "open"), (1, 5, 7, "terminated"), (1, 8, 8, "open"),
        ]
        assert spans(store, complete_only=True) == [(1, 5, 7, "terminated")]


def test_an_episode_that_started_right_after_the_ring_cut_is_complete(tmp_path):
    ends = {(2, 0): "term", (5, 0): "term"}
    with make(tmp_path, 6, 1, 6, ends) as store:
        store.extend(steps(6, 3, 1, ends))
        store.commit()
        assert store.first_step == 3  # step 2 is overwritten, but the index kept its end
        assert spans(store) == [(0, 3, 5, "terminated"), (0, 6, 8, "open")]


def test_without_end_roles_each_env_is_one_open_episode(tmp_path, layout):
    spec = {"x": mr.ArraySpec((), "int64")}
    with mr.create(tmp_path / "b", spec, 4, num_envs=2, **layout) as store:
        assert list(store.episodes()) == []
        store.extend({"x": np.arange(12).reshape(6, 2)})
        store.commit()
        first = store.first_step
        assert spans(store) == [(0, first, 5, "open"), (1, first, 5, "open")]
        assert [e.data["x"].tolist() for e in store.episodes()] == [
            list(range(2 * first, 12, 2)), list(range(2 * first + 1, 12, 2))
        ]
        assert spans(store, complete_only=True) == []
    assert not os.path.exists(tmp_path / "b" / INDEX_FILE)


TF_SPEC = {
    "step_type": mr.ArraySpec((), "int32"),
    "observation": mr.ArraySpec((1,), "float32"),
    "action": mr.ArraySpec((), "int64"),
    "next_step_type": mr.ArraySpec((), "int32"),
    "reward": mr.ArraySpec((), "float32"),
    "discount": mr.ArraySpec((), "float32"),
}


def tf_rows(kinds: str) -> dict:
    """Trajectories from a string: F first->mid, M mid, L mid->last (terminated),
    T mid->last (truncated, discount 1), B boundary (last->first)."""
    table = {"F": (0, 1, 1.0), "M": (1, 1, 1.0), "L": (1, 2, 0.0), "T": (1, 2, 1.0), "B": (2, 0, 1.0)}
    st, nst, disc = zip(*(table[k] for k in kinds))
    n = len(kinds)
    return {
        "step_type": np.array(st, "int32")[:, None],
        "observation": np.arange(n, dtype="float32").reshape(n, 1, 1),
        "action": np.arange(n)[:, None],
        "next_step_type": np.array(nst, "int32")[:, None],
        "reward": np.ones((n, 1), "float32"),
        "discount": np.array(disc, "float32")[:, None],
    }


def test_tf_agents_trajectories_with_boundaries(tmp_path, layout):
    with mr.create(tmp_path / "b", TF_SPEC, 20, **layout) as store:
        store.extend(tf_rows("FMLBFTBFM"))
        store.commit()
        # 0..2 terminated, 3 boundary, 4..5 truncated, 6 boundary, 7..8 open
        assert spans(store) == [(0, 0, 2, "terminated"), (0, 4, 5, "truncated"), (0, 7, 8, "open")]
        arrays = store.to_arrays()
        assert arrays["actions"].tolist() == [0, 1, 2, 4, 7]  # the truncated and open ends drop their last step
        assert arrays["terminals"].tolist() == [False, False, True, False, False]
        assert arrays["timeouts"].tolist() == [False, False, False, True, True]


def test_step_type_alone_ends_episodes_at_last(tmp_path):
    spec = {"step_type": mr.ArraySpec((), "int32"), "discount": mr.ArraySpec((), "float32"), "observation": mr.ArraySpec((), "float32")}
    with mr.create(tmp_path / "b", spec, 20) as store:
        store.extend({
            "step_type": np.array([0, 1, 2, 0, 2, 0, 1], "int32")[:, None],
            "discount": np.array([1, 1, 0, 1, 1, 1, 1], "float32")[:, None],
            "observation": np.arange(7, dtype="float32")[:, None],
        })
        store.commit()
        assert spans(store) == [(0, 0, 2, "terminated"), (0, 3, 4, "truncated"), (0, 5, 6, "open")]


# --- the persisted index -------------------------------------------------------------


def read_index(path) -> tuple[int, np.ndarray]:
    raw = open(os.path.join(path, INDEX_FILE), "rb").read()
    assert raw[:8] == MAGIC
    origin = int(np.frombuffer(raw, "<i8", 1, 8)[0])
    return origin, np.frombuffer(raw, RECORD, (len(raw) - HEADER_BYTES) // 16, HEADER_BYTES)


def test_index_survives_reopen_by_readers_and_writers(tmp_path, layout):
    with make(tmp_path, 30, 2, 8, ENDS, layout) as store:
        want = spans(store)
    origin, rec = read_index(tmp_path / "b")
    assert origin == 0
    assert [tuple(r) for r in rec.tolist()] == [(2, 0, 1), (3, 1, 2), (4, 1, 1), (5, 0, 2)]
    with mr.open(tmp_path / "b", "r") as reader:
        assert spans(reader) == want
    with mr.open(tmp_path / "b", "a") as writer:
        assert spans(writer) == want
        writer.extend(steps(8, 3, 2, {(9, 1): "term"}))
        writer.commit()
        # the episodes the last writer left open end at its last step, truncated
        assert spans(writer) == [
            (0, 0, 2, "terminated"), (0, 3, 5, "truncated"), (0, 6, 7, "truncated"), (0, 8, 10, "open"),
            (1, 0, 3, "truncated"), (1, 4, 4, "terminated"), (1, 5, 7, "truncated"), (1, 8, 9, "terminated"),
            (1, 10, 10, "open"),
        ]
    assert [tuple(r) for r in read_index(tmp_path / "b")[1].tolist()][-3:] == [(7, 0, 2), (7, 1, 2), (9, 1, 1)]


def test_a_commit_scans_only_the_new_steps(tmp_path):
    with make(tmp_path, 50, 1, 10, {(3, 0): "term"}) as store:
        size = os.path.getsize(tmp_path / "b" / INDEX_FILE)
        # Flip an old committed flag behind the store's back: a commit that rescanned the
        # buffer would notice it, one that scans only its new steps does not.
        leaf = store._leaves[store.leaf_paths.index("terminated")]
        leaf.array[7, 0] = True
        store.extend(steps(10, 2, 1, {(11, 0): "trunc"}))
        store.commit()
        assert spans(store) == [(0, 0, 3, "terminated"), (0, 4, 11, "truncated")]
        assert os.path.getsize(tmp_path / "b" / INDEX_FILE) == size + 16  # one record appended


def test_records_past_the_committed_end_are_ignored_and_cut(tmp_path, layout):
    with make(tmp_path, 30, 1, 6, {(2, 0): "term"}, layout):
        pass
    # a writer killed between appending the ends of steps 6.. and committing them
    ghost = np.zeros(2, RECORD)
    ghost["step"], ghost["env"], ghost["code"] = [6, 7], 0, 1
    with open(tmp_path / "b" / INDEX_FILE, "ab") as f:
        f.write(ghost.tobytes() + b"\x01\x02\x03")  # and a torn record
    with mr.open(tmp_path / "b", "r") as reader:
        assert spans(reader) == [(0, 0, 2, "terminated"), (0, 3, 5, "open")]
    with mr.open(tmp_path / "b", "a") as writer:
        writer.extend(steps(6, 4, 1, {(8, 0): "trunc"}))
        writer.commit()
        # the episode the last writer left open ends at its last committed step
        assert spans(writer) == [
            (0, 0, 2, "terminated"), (0, 3, 5, "truncated"), (0, 6, 8, "truncated"), (0, 9, 9, "open")
        ]
    assert [tuple(r) for r in read_index(tmp_path / "b")[1].tolist()] == [(2, 0, 1), (5, 0, 2), (8, 0, 2)]


def test_a_lost_index_is_rebuilt_from_the_role_leaves(tmp_path, layout):
    with make(tmp_path, 30, 2, 8, ENDS, layout) as store:
        want = spans(store)
    os.remove(tmp_path / "b" / INDEX_FILE)
    with mr.open(tmp_path / "b", "r") as reader:
        assert spans(reader) == want
    assert not os.path.exists(tmp_path / "b" / INDEX_FILE)  # readers never write
    with mr.open(tmp_path / "b", "a") as writer:
        assert spans(writer) == want
    assert len(read_index(tmp_path / "b")[1]) == 4


def test_a_damaged_index_is_rebuilt_with_a_warning(tmp_path, caplog):
    with make(tmp_path, 30, 2, 8, ENDS) as store:
        want = spans(store)
    with open(tmp_path / "b" / INDEX_FILE, "r+b") as f:
        f.write(b"garbage!")
    with caplog.at_level(logging.WARNING, logger="mmreplay.episodes"):
        with mr.open(tmp_path / "b", "r") as reader:
            assert spans(reader) == want
    assert "not an episode index" in caplog.text


def test_set_that_changes_an_end_updates_the_index(tmp_path, layout):
    with make(tmp_path, 30, 1, 6, {(2, 0): "term"}, layout) as store:
        row = store.get(4)
        row["truncated"][:] = True
        store.set(4, row)
        assert spans(store) == [(0, 0, 2, "terminated"), (0, 3, 4, "truncated"), (0, 5, 5, "open")]
        store.commit()
    with mr.open(tmp_path / "b", "r") as reader:
        assert spans(reader) == [(0, 0, 2, "terminated"), (0, 3, 4, "truncated"), (0, 5, 5, "open")]


def test_the_index_file_stays_small_in_a_long_ring(tmp_path):
    spec = {"x": mr.ArraySpec((), "int32"), "terminated": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "b", spec, 1000, commit_every=10_000) as store:
        block = {"x": np.zeros((1000, 1), "int32"), "terminated": np.ones((1000, 1), bool)}
        for _ in range(150):  # 150k one-step episodes through a ring of 1000
            store.extend(block)
            store.commit()
        first = store.first_step
        eps = store.episode_index()
        assert len(eps) == store.state.end - first
        assert all(e.status == "terminated" for e in eps[1:])
    origin, rec = read_index(tmp_path / "b")
    assert len(rec) < 70_000 and origin > 0 and rec["step"].min() >= origin


def test_readers_see_the_episodes_of_their_committed_window(tmp_path, layout):
    with make(tmp_path, 40, 1, 5, {(2, 0): "term"}, layout) as writer:
        with mr.open(tmp_path / "b", "r") as reader:
            before = spans(reader)
            writer.extend(steps(5, 5, 1, {(6, 0): "term", (8, 0): "trunc"}))
            writer.commit()
            assert spans(reader) == before == [(0, 0, 2, "terminated"), (0, 3, 4, "open")]
            reader.refresh()
            assert spans(reader) == [
                (0, 0, 2, "terminated"), (0, 3, 6, "terminated"), (0, 7, 8, "truncated"), (0, 9, 9, "open")
            ]


def test_a_reader_reading_episodes_the_writer_overwrote_is_told(tmp_path):
    with make(tmp_path, 12, 1, 6, {(2, 0): "term"}) as writer:
        with mr.open(tmp_path / "b", "r") as reader:
            it = reader.episodes()
            writer.extend(steps(6, 12, 1, {}))
            writer.commit()
            with pytest.raises(mr.NotEnoughDataError, match="overwritten"):
                next(it)


def test_a_writer_whose_own_adds_overwrote_an_episode_before_it_was_read_is_told(tmp_path):
    """episodes() reads each episode when it is yielded: a writer that added between two
    got the second episode's rows from the steps that replaced them, without a word."""
    with make(tmp_path, 10, 2, 15, {}) as writer:  # steps [5, 15): one open episode per env
        it = writer.episodes()
        first = next(it)
        np.testing.assert_array_equal(first.data["extra"], np.arange(5, 15) * 100)
        writer.extend(steps(15, 3, 2, {}))  # steps 5..7 are overwritten
        with pytest.raises(mr.NotEnoughDataError, match="step 5 was overwritten by this writer's own adds"):
            next(it)
        assert [e.data["extra"][0] for e in writer.episodes()] == [800, 801]  # read again: the retained steps


# --- to_arrays ---------------------------------------------------------------------------


def test_to_arrays_exact_small_case(tmp_path, layout):
    with make(tmp_path, 20, 2, 8, ENDS, layout) as store:
        a = store.to_arrays()
    assert set(a) == {"observations", "actions", "rewards", "terminals", "timeouts", "next_observations", "infos/extra"}
    # env 0: 0..2 terminated (kept whole), 3..5 truncated (5 dropped), 6..7 open (7 dropped)
    # env 1: 0..3 truncated (3 dropped), 4 terminated (kept), 5..7 open (7 dropped)
    steps_kept = [(0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (6, 0), (0, 1), (1, 1), (2, 1), (4, 1), (5, 1), (6, 1)]
    assert a["observations"].tolist() == [[t, e] for t, e in steps_kept]
    assert a["actions"][:, 0].tolist() == [t * 10 + e for t, e in steps_kept]
    assert a["rewards"].tolist() == [t + 0.5 for t, _ in steps_kept]
    assert a["infos/extra"].tolist() == [t * 100 + e for t, e in steps_kept]
    assert np.flatnonzero(a["terminals"]).tolist() == [2, 9]
    assert np.flatnonzero(a["timeouts"]).tolist() == [4, 5, 8, 11]
    nxt = [[t + 1, e] for t, e in steps_kept]
    nxt[2], nxt[9] = [2, 0], [4, 1]  # a terminal step's next observation repeats its own
    assert a["next_observations"].tolist() == nxt


def test_to_arrays_invariants_and_a_next_observation_leaf(tmp_path):
    spec = dict(SPEC, next_obs=mr.ArraySpec((2,), "float32"))
    rng = np.random.default_rng(0)
    ends = {(int(t), int(e)): ("term" if rng.random() < 0.5 else "trunc") for t, e in rng.integers(0, 40, (12, 2)) % [40, 3]}
    with make(tmp_path, 50, 3, 0, {}, spec=spec) as store:
        data = steps(0, 40, 3, ends)
        data["next_obs"] = data["obs"] + 1
        store.extend(data)
        store.commit()
        a = store.to_arrays()
        n_eps = len(store.episode_index())
    n = len(a["observations"])
    assert n == 120  # with a next observation leaf every step is kept
    assert all(len(v) == n for v in a.values())
    assert not (a["terminals"] & a["timeouts"]).any()
    assert (a["terminals"] | a["timeouts"]).sum() == n_eps
    np.testing.assert_array_equal(a["next_observations"], a["observations"] + 1)
    assert "infos/next_obs" not in a


def test_to_arrays_next_observations_follow_inside_episodes(tmp_path):
    rng = np.random.default_rng(1)
    ends = {(int(t), int(e)): "term" if rng.random() < 0.5 else "trunc" for t, e in zip(rng.integers(0, 60, 15), rng.integers(0, 2, 15))}
    with make(tmp_path, 30, 2, 60, ends) as store:  # wrapped: the first episodes are cut
        a = store.to_arrays()
        ends_count = len(store.episode_index())
    done = a["terminals"] | a["timeouts"]
    assert done.sum() <= ends_count and done[-1]
    inside = ~done
    np.testing.assert_array_equal(a["next_observations"][inside], a["observations"][1:][inside[:-1]])
    same_env = a["next_observations"][:, 1] == a["observations"][:, 1]
    assert same_env.all()
    np.testing.assert_array_equal(a["next_observations"][:, 0] - a["observations"][:, 0], np.where(a["terminals"], 0, 1))


def test_to_arrays_of_an_empty_store(tmp_path):
    with make(tmp_path, 10, 2, 0, {}) as store:
        a = store.to_arrays()
    assert a["observations"].shape == (0, 2) and a["terminals"].shape == (0,)


KILLED_WRITER = """
import sys, numpy as np, mmreplay as mr
sys.path.insert(0, {tests!r})
from test_episodes import steps
store = mr.create({path!r}, __import__("test_episodes").SPEC, 100_000, num_envs=3, commit_every=7)
rng = np.random.default_rng({seed})
t, ready = 0, False
while True:
    n = int(rng.integers(1, 9))
    ends = {{(int(a), int(b)): ("term" if rng.random() < 0.5 else "trunc") for a, b in zip(rng.integers(t, t + n, 2), rng.integers(0, 3, 2))}}
    store.extend(steps(t, n, 3, ends))
    t += n
    if t > 40 and not ready:
        open({path!r} + ".ready", "a").close()
        ready = True
"""


@pytest.mark.parametrize("seed", [1, 2])
def test_index_after_sigkill_matches_a_rebuild_from_the_leaves(tmp_path, seed, writers):
    import shutil
    import time

    path = str(tmp_path / "b")
    proc = writers.start(KILLED_WRITER.format(tests=os.path.dirname(__file__), path=path, seed=seed), stdout=None)
    deadline = time.monotonic() + 60
    while not os.path.exists(path + ".ready"):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.05 * seed)
    writers.kill(proc)
    rebuilt = str(tmp_path / "copy")
    shutil.copytree(path, rebuilt, ignore=shutil.ignore_patterns(INDEX_FILE, ".lock"))
    with mr.open(rebuilt, "r") as reader:
        want = reader.episode_index()  # scanned from the role leaves of the committed steps
    assert len(want) > 3
    with mr.open(path, "r") as reader:
        assert reader.episode_index() == want
    with mr.open(path, "a") as writer:  # the next writer cuts what the killed one left past its commit
        assert writer.episode_index() == want
        end = writer.state.end
    _, rec = read_index(path)
    assert rec["step"].max() < end


@pytest.mark.parametrize("kind", ["flags", "tf-agents"])
def test_a_writers_spans_after_every_step_equal_those_computed_afresh(tmp_path, kind):
    """The spans a writer derives per step (the committed ones once per commit, the ring's
    cut and the steps since the commit joined on) equal a computation over every end."""
    rng = np.random.default_rng(0)
    num_envs = 1 if kind == "tf-agents" else 3
    spec = TF_SPEC if kind == "tf-agents" else SPEC
    store = mr.create(tmp_path / "b", spec, 37, num_envs=num_envs, commit_every=5)
    index = index_for(store)
    ends = {}  # step -> its end records, read as each step is added
    for t in range(150):
        if kind == "tf-agents":
            row = tf_rows(rng.choice(list("MMMFLTB")))
            store.add({k: v[0] for k, v in row.items()})
        else:
            flags = rng.random((2, num_envs)) < 0.15
            store.add({**{k: v[0] for k, v in steps(t, 1, num_envs, {}).items()}, "terminated": flags[0], "truncated": flags[1]})
        if kind == "flags" and t % 17 == 16:  # an end rewritten by set (a committed step, or one not yet)
            back = int(rng.integers(0, min(len(store), 8)))
            step = store.get(-1 - back)
            step["truncated"] = ~step["truncated"]
            store.set(-1 - back, step)
            ends[store.total_steps - 1 - back] = index.rule.records(np.array([store.total_steps - 1 - back]))
        ends[t] = index.rule.records(np.array([t]))
        first, end = store.window[:2]
        expected = index._compute(first, end, np.concatenate([ends[s] for s in range(max(first - 1, 0), end)]))
        got = index.spans(store)
        for field in ("env", "first", "last", "code", "cut"):
            np.testing.assert_array_equal(getattr(got, field), getattr(expected, field), err_msg=f"{field} at step {t}")
    store.close()


@pytest.mark.parametrize("kind", ["flags", "tf-agents"])
def test_episode_bounds_and_complete_spans_read_the_spans(tmp_path, kind):
    """Each row's episode (or none, for a boundary row) and each env's complete episodes,
    on a wrapped ring, against a walk over the spans."""
    rng = np.random.default_rng(1)
    num_envs = 3
    store = mr.create(tmp_path / "b", TF_SPEC if kind == "tf-agents" else SPEC, 29, num_envs=num_envs, commit_every=4)
    for t in range(90):
        if kind == "tf-agents":
            rows = [tf_rows(rng.choice(list("MMFLTB"))) for _ in range(num_envs)]
            store.add({k: np.concatenate([r[k][0] for r in rows]) for k in rows[0]})
        else:
            flags = rng.random((2, num_envs)) < 0.2
            store.add({**{k: v[0] for k, v in steps(t, 1, num_envs, {}).items()}, "terminated": flags[0], "truncated": flags[1]})
        if t % 7:
            continue
        found = store.episode_index()
        first, end = store.window[:2]
        s, e = np.meshgrid(np.arange(first, end), np.arange(num_envs), indexing="ij")
        got = store.episode_bounds(s.ravel(), e.ravel())
        for k, (step, env) in enumerate(zip(s.ravel().tolist(), e.ravel().tolist())):
            span = [x for x in found if x.env == env and x.first_step <= step <= x.last_step]
            want = (span[0].first_step, span[0].last_step, span[0].status != "open") if span else (step, step, False)
            assert (got[0][k], got[1][k], got[2][k]) == want, (t, step, env)
        envs, lo, hi = complete_spans(store)
        for env in range(num_envs):
            done = [x for x in found if x.env == env and x.status != "open"]
            assert (env in envs.tolist()) == bool(done)
            if done:
                i = envs.tolist().index(env)
                assert (lo[i], hi[i]) == (done[0].first_step, done[-1].last_step)
    store.close()
