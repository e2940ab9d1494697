"""A hypothesis state machine against a plain model of what a buffer must hold.

The writer lives in a forked child process driven over a pipe, so a crash is real: the
child is killed with SIGKILL between operations or in the middle of one. Every row is a
function of its global step id and env (:func:`mmreplay.torture.step_values`), so the
model is just a few numbers: steps written, the committed cursor, where ``clear`` started
the window, and how far the ring may have been reserved. After every rule a reader in
this process checks the committed window and every row in it, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import traceback

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import mmreplay as mr
from mmreplay.spec import flatten, unflatten
from mmreplay.torture import step_values

SPEC = {"x": mr.ArraySpec((2,), "int64"), "r": mr.ArraySpec((), "float32"), "done": mr.ArraySpec((), "bool")}
LEAVES = flatten(SPEC)
LAYOUTS = [("zarr", None), ("zarr", "zstd"), ("zarr", "rows:lz4"), ("hdf5", None), ("hdf5", "gzip")]


def _rows(lo: int, n: int, num_envs: int):
    return unflatten(SPEC, step_values(LEAVES, num_envs, np.arange(lo, lo + n)))


def _exact(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(a.tobytes() == b.tobytes() for a, b in zip(got, want))


# --- the writer child ------------------------------------------------------------------


def _serve(path: str, commands: int, replies: int) -> None:
    """The child: apply each JSON command to a writer and reply with its view."""
    inp = os.fdopen(commands, "r")

    def reply(obj: dict) -> None:
        os.write(replies, (json.dumps(obj) + "\n").encode())

    store = mr.open(path, "a")
    num_envs = store.num_envs
    reply({"total": store.total_steps, "end": store.committed_steps})
    for line in inp:
        cmd = json.loads(line)
        op = cmd["op"]
        out: dict = {}
        if op == "add":
            store.add(unflatten(SPEC, [v[0] for v in step_values(LEAVES, num_envs, [store.total_steps])]))
        elif op == "extend":
            store.extend(_rows(store.total_steps, cmd["n"], num_envs))
        elif op == "commit":
            store.commit()
        elif op == "clear":
            store.clear()
        elif op == "sample":  # the writer samples every step it added
            try:
                nest, info = store.sample(cmd["k"], return_info=True, rng=cmd["seed"])
            except mr.NotEnoughDataError:
                out["empty"] = True
            else:
                want = [w[np.arange(cmd["k"]), info.env] for w in step_values(LEAVES, num_envs, info.step)]
                out["exact"] = _exact(flatten(nest), want)
                out["steps"] = [int(info.step.min()), int(info.step.max())]
        elif op == "close":
            store.close()
            reply({"closed": True})
            return
        reply({"total": store.total_steps, "end": store.committed_steps, "first": store.first_step, **out})


class Writer:
    """A forked child holding the store open for writing."""

    def __init__(self, path: str):
        cr, cw = os.pipe()
        rr, rw = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                os.close(cw)
                os.close(rr)
                _serve(path, cr, rw)
                code = 0
            except BaseException:
                os.write(rw, (json.dumps({"error": traceback.format_exc()}) + "\n").encode())
            finally:
                os._exit(code)
        os.close(cr)
        os.close(rw)
        self.pid = pid
        self.out = os.fdopen(cw, "w", buffering=1)
        self.inp = os.fdopen(rr, "r")
        self.first = self._read()

    def _read(self) -> dict:
        line = self.inp.readline()
        assert line, "the writer died"
        reply = json.loads(line)
        assert "error" not in reply, reply["error"]
        return reply

    def send(self, op: str, **args) -> None:
        self.out.write(json.dumps({"op": op, **args}) + "\n")

    def call(self, op: str, **args) -> dict:
        self.send(op, **args)
        return self._read()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self._reap(-signal.SIGKILL)

    def close(self) -> None:
        assert self.call("close") == {"closed": True}
        self._reap(0)

    def _reap(self, expected: int) -> None:
        _, status = os.waitpid(self.pid, 0)
        assert os.waitstatus_to_exitcode(status) == expected
        self.out.close()
        self.inp.close()


# --- the model -------------------------------------------------------------------------


#: how a buffer is made, besides its layout
SHAPES = dict(
    capacity=st.integers(2, 20),
    num_envs=st.sampled_from([1, 3]),
    commit_every=st.sampled_from([1, 3, 7, 1000]),
    chunk_steps=st.integers(1, 6),
)


class BufferModel(RuleBasedStateMachine):
    """written / end / start / high: the whole truth about a buffer of deterministic rows."""

    @initialize(layout=st.sampled_from(LAYOUTS), **SHAPES)
    def create(self, layout, capacity, num_envs, commit_every, chunk_steps):
        self.dir = tempfile.mkdtemp(prefix="mmreplay-model-")
        self.path = os.path.join(self.dir, "b")
        backend, compression = layout
        mr.create(
            self.path,
            SPEC,
            capacity,
            num_envs,
            backend=backend,
            compression=compression,
            chunk_steps=chunk_steps,
            commit_every=commit_every,
        ).close()
        self.capacity, self.num_envs, self.backend = capacity, num_envs, backend
        self.ahead = max(1, min(commit_every, capacity // 8))
        self.written = self.end = self.start = 0
        self.high = 0  # the furthest any writer may have written or reserved (ring slots reused)
        self.writer: Writer | None = Writer(self.path)

    def teardown(self):
        if getattr(self, "writer", None) is not None:
            self.writer.kill()
        if getattr(self, "dir", None):
            shutil.rmtree(self.dir, ignore_errors=True)

    # --- operations ----------------------------------------------------------------

    def _after(self, reply: dict, committed: bool = False) -> None:
        assert reply["total"] == self.written, (reply, self.written)
        assert self.end <= reply["end"] <= self.written
        if committed:
            assert reply["end"] == self.written
        self.end = reply["end"]

    @rule()
    def add(self):
        self.written += 1
        self.high = max(self.high, self.written + self.ahead)
        self._after(self.writer.call("add"))

    @rule(n=st.integers(1, 45))
    def extend(self, n):
        self.written += n
        self.high = max(self.high, self.written + self.ahead)
        self._after(self.writer.call("extend", n=n))

    @rule()
    def commit(self):
        self._after(self.writer.call("commit"), committed=True)

    @rule()
    def clear(self):
        reply = self.writer.call("clear")
        self._after(reply, committed=True)
        self.start = self.written
        assert reply["first"] == reply["end"] == self.written

    @rule(k=st.integers(1, 20), seed=st.integers(0, 2**32 - 1))
    def sample_in_the_writer(self, k, seed):
        reply = self.writer.call("sample", k=k, seed=seed)
        self._after(reply)
        # the writer samples every step it added, committed or not, that the ring retains
        low = min(self.written, max(self.start, self.written - self.capacity))
        assert low <= reply["first"] <= min(self.written, max(self._must_from(), self.written - self.capacity))
        if reply["first"] == self.written:
            assert reply.get("empty")
        else:
            assert reply["exact"] and reply["first"] <= reply["steps"][0] and reply["steps"][1] < self.written

    def _reopen(self, via_create: bool) -> None:
        """A new writer (no writer is running): it resumes at the committed cursor."""
        self.a_reader_sees_exactly_the_committed_window()
        if via_create:  # create(exist_ok=True) on an existing buffer resumes it
            mr.create(
                self.path, SPEC, self.capacity, self.num_envs, backend=self.backend, exist_ok=True
            ).close()
        self.writer = Writer(self.path)
        assert self.writer.first == {"total": self.end, "end": self.end}
        self.written = self.end

    @rule(via_create=st.booleans())
    def close_and_reopen(self, via_create):
        self.writer.close()
        self.writer = None
        self.end = self.written
        self._reopen(via_create)

    @rule()
    def crash_between_operations(self):
        self.writer.kill()
        self.writer = None
        self.written = self.end  # what was not committed is gone
        self._reopen(False)

    @rule(n=st.integers(1, 60), delay=st.floats(0, 0.003))
    def crash_during_extend(self, n, delay):
        self.writer.send("extend", n=n)
        self.high = max(self.high, self.written + n + self.ahead)
        time.sleep(delay)
        self.writer.kill()
        self.writer = None
        with mr.open(self.path) as reader:  # a commit inside the extend may have made it
            end = reader.committed_steps
        assert self.end <= end <= self.written + n
        self.end = self.written = end
        self._reopen(False)

    # --- what must hold ---------------------------------------------------------------

    def _must_from(self) -> int:
        """Steps from here to ``end`` must be retained (the ring may not have taken them)."""
        return min(self.end, max(self.start, self.high - self.capacity))

    def _may_from(self) -> int:
        """No step before here may be retained (their slots were cleared or overwritten)."""
        return min(self.end, max(self.start, self.end - self.capacity))

    @invariant()
    def a_reader_sees_exactly_the_committed_window(self):
        if not hasattr(self, "path"):
            return
        with mr.open(self.path) as reader:
            first, end = reader.first_step, reader.committed_steps
            assert end == self.end
            assert self._may_from() <= first <= self._must_from(), (
                first,
                self._may_from(),
                self._must_from(),
            )
            assert len(reader) == end - first and reader.total_steps == end
            ids = np.arange(first, end)
            assert _exact(reader.read_steps(ids), step_values(LEAVES, self.num_envs, ids))
            try:
                reader.get(len(reader))
            except IndexError:
                pass
            else:
                raise AssertionError("a row past the committed cursor")
            if len(reader):
                nest, info = reader.sample(8, num_steps=1, return_info=True, rng=0)
                assert first <= info.step.min() and info.step.max() < end
            else:
                try:
                    reader.sample(1)
                except mr.NotEnoughDataError:
                    pass
                else:
                    raise AssertionError("sampled an empty buffer")


def model_of(layout: tuple) -> type[BufferModel]:
    """The model on one layout: the normal run gives each layout its own few examples."""

    class OneLayout(BufferModel):
        @initialize(layout=st.just(layout), **SHAPES)
        def create(self, **args):
            BufferModel.create(self, **args)

    OneLayout.__name__ = OneLayout.__qualname__ = f"BufferModel_{layout_name(layout)}"
    OneLayout.TestCase.settings = settings(
        max_examples=4, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    return OneLayout


def layout_name(layout: tuple) -> str:
    backend, compression = layout
    return f"{backend}_{(compression or 'mapped').replace(':', '_')}"


for _layout in LAYOUTS:
    globals()[f"test_buffer_model_{layout_name(_layout)}"] = model_of(_layout).TestCase


class LongBufferModel(BufferModel):
    pass


LongBufferModel.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_buffer_model_long = pytest.mark.long(LongBufferModel.TestCase)
