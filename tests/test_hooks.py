"""Write hooks: called on add/extend, before the state write of each commit, on set and
clear; the episode index and the sampler are hooks the store does not name."""

from __future__ import annotations

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.hooks import WriteHook

SPEC = {"x": mr.ArraySpec((), "int64")}


class Recorder(WriteHook):
    def __init__(self, path):
        self.path = path
        self.calls: list[tuple] = []

    def on_add(self, first_step, count):
        self.calls.append(("add", first_step, count))

    def on_commit(self, old_end, new_end, fsync):
        with mr.open(self.path) as reader:  # the state on disk does not commit these steps yet
            self.calls.append(("commit", old_end, new_end, reader.committed_steps))

    def on_set(self, steps):
        self.calls.append(("set", np.asarray(steps).tolist()))

    def on_clear(self, end):
        self.calls.append(("clear", end))


def test_hooks_see_adds_commits_sets_and_clears_in_order(tmp_path):
    path = tmp_path / "b"
    with mr.create(path, SPEC, 100, commit_every=1000) as store:
        hook = Recorder(path)
        store.add_write_hook(hook)
        store.add({"x": np.array([1])})
        store.extend({"x": np.arange(3)[:, None]})
        store.commit()
        store.set(1, {"x": np.array([7])})
        store.clear()
        assert hook.calls == [
            ("add", 0, 1),
            ("add", 1, 3),
            ("commit", 0, 4, 0),
            ("set", [1]),
            ("clear", 4),
        ]


def test_a_hook_must_be_a_write_hook(tmp_path):
    with mr.create(tmp_path / "b", SPEC, 10) as store:
        with pytest.raises(TypeError, match="WriteHook"):
            store.add_write_hook(object())
    with pytest.raises(mr.ClosedError, match="closed"):  # it would never be called
        store.add_write_hook(mr.hooks.WriteHook())


def test_a_failing_hook_leaves_the_steps_uncommitted(tmp_path):
    class Refuses(WriteHook):
        def on_commit(self, old_end, new_end, fsync):
            raise OSError("no")

    path = tmp_path / "b"
    store = mr.create(path, SPEC, 100, commit_every=1000)
    store.extend({"x": np.arange(5)[:, None]})
    store.commit()
    store.add_write_hook(Refuses())
    store.extend({"x": np.arange(5, 8)[:, None]})
    with pytest.raises(OSError, match="no"):
        store.commit()
    with mr.open(path) as reader:
        assert reader.committed_steps == 5
