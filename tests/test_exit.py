"""A writer that is never closed still commits every step it added, and never a step it
did not finish writing.

A script that ends normally, dies of an uncaught exception, is stopped by Ctrl-C, SIGTERM
or SIGHUP in its collection loop, or drops its last reference to the store (or to a layer
holding one) must leave on disk every step it added. Only SIGKILL or a power loss may lose
the uncommitted tail. A write cut short by a signal, or a thread still writing as the
program ends, must leave no torn step committed. Each case runs a real script in a fresh
process, with a commit interval far larger than what it adds, then reopens the buffer here
and checks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import LAYOUT_AXIS, spread

import mmreplay as mr
from mmreplay.verify import verify

ENDINGS = ["normal", "exception", "sigint", "sigterm", "sighup", "collected"]
SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM, "sighup": signal.SIGHUP}
NEVER = 10**6  # commit_every: no automatic commit while the scripts run

PLAIN = """
import mmreplay as mr, numpy as np
obj = mr.create(PATH, {{"x": mr.ArraySpec((3,), "float32"), "terminated": mr.ArraySpec((), "bool")}},
                capacity=100_000, num_envs=2, commit_every={never}, backend={backend!r},
                compression={compression!r}, chunk_steps=16)
def add(obj, t):
    obj.add({{"x": np.full((2, 3), t, "float32"), "terminated": np.array([t % 7 == 6] * 2)}})
def total(obj):
    return obj.total_steps
"""

TORCH = """
import torch, mmreplay as mr, numpy as np
from mmreplay.compat.torch import StoreDataset
obj = mr.create(PATH, {{"x": mr.ArraySpec((3,), "float32")}}, capacity=100_000, commit_every={never})
def add(obj, t):
    obj.add({{"x": np.full((1, 3), t, "float32")}})
    if t == 20:
        obj.commit()
        assert len(StoreDataset(PATH)) == 21  # a reader of the committed prefix
def total(obj):
    return obj.total_steps
"""

SKRL = """
import torch
from mmreplay.compat.skrl import RandomMemory
obj = RandomMemory(memory_size=10_000, num_envs=2, device="cpu", path=PATH, commit_every={never})
obj.create_tensor("states", 3, torch.float32)
obj.create_tensor("rewards", 1, torch.float32)
def add(obj, t):
    obj.add_samples(states=torch.full((2, 3), float(t)), rewards=torch.ones(2, 1))
    if t > 4:
        obj.sample(["states"], batch_size=4)
def total(obj):
    return obj.store.total_steps
"""

TF_AGENTS = """
import numpy as np, mmreplay as mr
from mmreplay.compat.tf_agents import UniformReplayBuffer
obj = UniformReplayBuffer({{"x": mr.ArraySpec((3,), "float32")}}, batch_size=2, max_length=10_000,
                          path=PATH, commit_every={never})
def add(obj, t):
    obj.add_batch({{"x": np.full((2, 3), t, "float32")}})
def total(obj):
    return obj.store.total_steps
"""

GYM = """
import torch, gymnasium
from mmreplay.compat.gymnasium import RecordTransitions
obj = RecordTransitions(gymnasium.make("CartPole-v1"), PATH, capacity=10_000, commit_every={never})
obj.reset(seed=0)
def add(obj, t):
    _, _, terminated, truncated, _ = obj.step(obj.action_space.sample())
    if terminated or truncated:
        obj.reset()
def total(obj):
    return obj.store.total_steps
"""

GYM_VECTOR = """
import torch, gymnasium
from mmreplay.compat.gymnasium import RecordVectorTransitions
obj = RecordVectorTransitions(gymnasium.make_vec("CartPole-v1", num_envs=2), PATH, capacity=10_000,
                              commit_every={never})
obj.reset(seed=0)
def add(obj, t):
    obj.step(obj.action_space.sample())
def total(obj):
    return obj.store.total_steps
"""

SB3 = """
import numpy as np, gymnasium
from mmreplay.compat.sb3 import ReplayBuffer
box = gymnasium.spaces.Box(-1e9, 1e9, (3,), np.float32)
obj = ReplayBuffer(10_000, box, gymnasium.spaces.Discrete(3), "cpu", n_envs=2, path=PATH, commit_every={never})
def add(obj, t):
    obs = np.full((2, 3), t, np.float32)
    obj.add(obs, obs + 1, np.array([t % 3, 1]), np.ones(2, np.float32), np.array([t % 7 == 6] * 2), [{{}}, {{}}])
def total(obj):
    return obj.store.total_steps
"""

TORCHRL = """
import torch
from tensordict import TensorDict
from torchrl.data import TensorDictReplayBuffer
from mmreplay.compat.torchrl import MMReplayStorage
obj = TensorDictReplayBuffer(storage=MMReplayStorage(PATH, max_size=10_000, commit_every={never}))
def add(obj, t):
    obj.extend(TensorDict({{"x": torch.full((1, 3), float(t))}}, [1]))
def total(obj):
    return obj.storage.store.total_steps
"""

ENDING = {
    # the script just ends: no close()
    "normal": """
        for t in range(50):
            add(obj, t)
        print(total(obj), flush=True)
    """,
    "exception": """
        for t in range(50):
            add(obj, t)
        print(total(obj), flush=True)
        raise RuntimeError("the training loop failed")
    """,
    # Ctrl-C (or SIGTERM, SIGHUP) in the loop; the KeyboardInterrupt (SystemExit) ends the
    # program (the finally only reports)
    "sigint": """
        import time
        t = 0
        try:
            while True:
                add(obj, t)
                t += 1
                if t == 50:
                    print("ready", flush=True)
                time.sleep(0.001)
        finally:
            print(total(obj), flush=True)
    """,
    # the last reference goes; os._exit then skips every exit hook, so only the
    # collection can have committed, and the writer lock must be free again
    "collected": """
        import gc, os, weakref
        for t in range(50):
            add(obj, t)
        print(total(obj), flush=True)
        gone = weakref.ref(obj)
        del obj
        gc.collect()
        assert gone() is None
        import mmreplay as mr
        for path in PATHS:
            mr.open(path, "a").close()
        os._exit(0)
    """,
}

ENDING["sigterm"] = ENDING["sighup"] = ENDING["sigint"]

# Python ends a program stopped by an uncaught KeyboardInterrupt by SIGINT, as a shell expects;
# SIGTERM and SIGHUP end it with the status a shell reports for them, 128 + the signal
EXIT_CODES = {
    "normal": 0,
    "exception": 1,
    "sigint": -signal.SIGINT,
    "sigterm": 128 + signal.SIGTERM,
    "sighup": 128 + signal.SIGHUP,
    "collected": 0,
}


def run_script(setup: str, ending: str, path: str) -> list[int]:
    """Run the script; returns how many steps it said it added (one count per buffer)."""
    code = f"PATH = {path!r}\nPATHS = [PATH]\n" + textwrap.dedent(setup) + textwrap.dedent(ENDING[ending])
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if ending in SIGNALS:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(SIGNALS[ending])
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()  # (a no-op once it has ended) no writer outlives its test
    assert proc.returncode == EXIT_CODES[ending], err
    if ending == "sigint":
        assert "KeyboardInterrupt" in err, err
    if ending in ("sigterm", "sighup"):
        assert f"{ending.upper()}: ending the program" in err, err
    assert "Traceback" not in err or ending in ("exception", "sigint"), err
    assert "store left open failed" not in err, err
    added = [int(n) for n in out.strip().splitlines()[-1].split()]
    assert min(added) > 40  # the vector recorder holds back the transitions of envs ahead of the others
    return added


@pytest.mark.parametrize(("backend", "compression", "ending"), spread(LAYOUT_AXIS, ENDINGS))
def test_a_store_left_open_commits_every_step(tmp_path, ending, backend, compression):
    path = str(tmp_path / "b")
    setup = PLAIN.format(never=NEVER, backend=backend, compression=compression)
    (added,) = run_script(setup, ending, path)
    with mr.open(path) as store:
        assert store.committed_steps == added
        assert store.get(slice(None))["x"][:, 0, 0].tolist() == list(range(added))
        assert [ep.last_step for ep in store.episode_index(env=0)][:2] == [6, 13]
    assert verify(path) == []


LAYERS = {"torch": TORCH, "skrl": SKRL, "tf_agents": TF_AGENTS, "gymnasium": GYM, "gymnasium-vector": GYM_VECTOR}
#: the leaf whose env 0 holds ``t`` at step ``t`` (the gymnasium recorders are checked by their chain)
STEP_LEAF = {"torch": "x", "skrl": "states", "tf_agents": "x", "sb3": "observation", "torchrl": "x"}


def check_every_step(store: mr.Store, name: str, steps: int) -> None:
    """The reopened buffer holds the ``steps`` steps the layer added, each one in place."""
    assert (store.first_step, store.committed_steps) == (0, steps), name
    got = store.get(slice(None))
    if name in STEP_LEAF:
        values = got[STEP_LEAF[name]].reshape(steps, store.num_envs, -1)[:, 0, 0]
        assert values.tolist() == list(range(steps)), name
        return
    # a transition's next observation is the next one's observation unless an episode ended
    ended = got["terminated"] | got["truncated"]
    same = (got["next_observation"][:-1] == got["observation"][1:]).all(axis=-1)
    assert (same | ended[:-1]).all(), name

# Every layer open at once in one script, each in its own namespace and folder, so that one
# process per ending shows each of them committing (and all of them side by side).
ALL_LAYERS = """
import gc
LAYER_CODE = {code!r}
PATHS = [PATH + "-" + name for name in LAYER_CODE]
class Layers:
    def __init__(self):
        self.parts = []
        for (name, code), path in zip(LAYER_CODE.items(), PATHS):
            space = {{"PATH": path}}
            exec(code, space)
            self.parts.append(space)
obj = Layers()
def add(obj, t):
    for space in obj.parts:
        space["add"](space["obj"], t)
def total(obj):
    return " ".join(str(space["total"](space["obj"])) for space in obj.parts)
"""


@pytest.mark.parametrize("ending", ENDINGS)
def test_every_layer_left_open_commits_every_step(tmp_path, ending):
    pytest.importorskip("torch")
    pytest.importorskip("gymnasium")
    code = {name: textwrap.dedent(setup).format(never=NEVER) for name, setup in LAYERS.items()}
    path = str(tmp_path / "b")
    added = run_script(ALL_LAYERS.format(code=code), ending, path)
    assert len(added) == len(LAYERS)
    for name, steps in zip(LAYERS, added):
        with mr.open(f"{path}-{name}") as store:
            check_every_step(store, name, steps)


def test_sb3_and_torchrl_left_open_commit_every_step_at_a_normal_end(tmp_path):
    """Apart from the other layers, and only to a normal end: importing torchrl (and the ray
    it imports when installed) takes seconds, and ray ends a program that Ctrl-C stopped
    with status 1 instead of by SIGINT."""
    pytest.importorskip("stable_baselines3")
    pytest.importorskip("torchrl")
    code = {name: textwrap.dedent(setup).format(never=NEVER) for name, setup in (("sb3", SB3), ("torchrl", TORCHRL))}
    path = str(tmp_path / "b")
    added = run_script(ALL_LAYERS.format(code=code), "normal", path)
    for name, steps in zip(code, added):
        with mr.open(f"{path}-{name}") as store:
            check_every_step(store, name, steps)


def test_closed_writers_leave_no_exit_hooks_behind(tmp_path):
    """A store closed by hand drops its finalizer: a thousand opens hold nothing."""
    path = str(tmp_path / "b")
    code = textwrap.dedent(
        f"""
        import atexit, threading, numpy as np, mmreplay as mr
        mr.create({path!r}, {{"x": mr.ArraySpec((), "int64")}}, capacity=10).close()
        before = atexit._ncallbacks(), len(threading._threading_atexits)
        for _ in range(1000):
            store = mr.open({path!r}, "a")
            store.add({{"x": np.ones(1, "int64")}})
            store.close()
        after = atexit._ncallbacks(), len(threading._threading_atexits)
        print(before == after, mr.exits.open_writers())
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "0"]


def test_a_reader_left_open_releases_its_files_when_collected(tmp_path):
    path = str(tmp_path / "b")
    with mr.create(path, {"x": mr.ArraySpec((), "int64")}, capacity=100) as store:
        store.extend({"x": np.arange(50).reshape(50, 1)})
    code = textwrap.dedent(
        f"""
        import gc, os, mmreplay as mr
        mr.open({path!r}).close()  # imports and thread pools settle before counting
        gc.collect()
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            reader = mr.open({path!r})
            reader.sample(8)
            reader.refresh()
            del reader
            gc.collect()
        print(fds, len(os.listdir("/proc/self/fd")))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.split()
    assert after == before


def test_sigkill_loses_only_the_uncommitted_tail(tmp_path, writers):
    """The one ending no hook can see: what was committed survives, the rest is gone."""
    path = str(tmp_path / "b")
    code = textwrap.dedent(
        f"""
        import os, signal, numpy as np, mmreplay as mr
        store = mr.create({path!r}, {{"x": mr.ArraySpec((), "int64")}}, capacity=1000, commit_every={NEVER})
        store.extend({{"x": np.arange(30).reshape(30, 1)}})
        store.commit()
        store.extend({{"x": np.arange(30, 40).reshape(10, 1)}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    writers.run_killed(code)
    with mr.open(path) as store:
        assert store.committed_steps == 30
        assert os.path.exists(os.path.join(path, "mmreplay.json"))


# --- stop signals: the program's own handlers come first ------------------------------------

HANDLERS = """
import signal, threading, numpy as np, mmreplay as mr
spec = {{"x": mr.ArraySpec((), "int64")}}
mine = lambda signum, frame: print("mine", signum, flush=True)
signal.signal(signal.SIGHUP, mine)  # the program's own: kept, and still called
store = mr.create({path!r} + "/a", spec, capacity=100, commit_every=10**6)
print(signal.getsignal(signal.SIGHUP) is mine, signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL, flush=True)
store.close()  # the last writer: the default action again
print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: left ignored
made = []
thread = threading.Thread(target=lambda: made.append(mr.create({path!r} + "/b", spec, capacity=100)))
thread.start(); thread.join()  # a writer opened in another thread sets no handler
print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, flush=True)
made[0].close()
store = mr.open({path!r} + "/a", "a")
store.add({{"x": np.arange(1)}})
print("ready", flush=True)
import time
while True:
    time.sleep(0.01)
"""


def test_stop_signals_leave_the_programs_own_handlers_alone(tmp_path):
    """SIGTERM is handled only while writers are open and only where the program left the
    default action; a handler of the program's own (SIGHUP here) or SIG_IGN stays, and
    the default action is back once the last writer closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HANDLERS.format(path=str(tmp_path)))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = [proc.stdout.readline().split() for _ in range(4)]
        assert lines == [["True", "True"], ["True"], ["True", "True"], ["ready"]], lines
        proc.send_signal(signal.SIGHUP)  # ignored by the program's choice
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    with mr.open(str(tmp_path / "a")) as store:
        assert store.committed_steps == 1


# SIGTERM lands as the store closes: in its last commit, or as a collection of the store
# begins (as the finalizer takes its entry, or enters the function that closes the store)
STOP_AS_IT_CLOSES = """
import os, signal, sys, numpy as np, mmreplay as mr
store = mr.create({path!r}, {{"x": mr.ArraySpec((), "int64")}}, capacity=1000, commit_every=10**6)
store.extend({{"x": np.arange(40).reshape(40, 1)}})
def stop(frame, event, arg):
    if (event, frame.f_code.co_name, getattr(arg, "__name__", None)) == {at!r}:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGTERM)
sys.setprofile(stop)
"""
IN_THE_COMMIT = ("call", "on_commit", None)  # the write hooks' call, before the state write
CLOSINGS = {
    "close": ("store.close()", IN_THE_COMMIT, 128 + signal.SIGTERM),  # SystemExit once closed
    # a collection cannot raise: the signal's default action once the store is closed
    "collected": ("del store", IN_THE_COMMIT, -signal.SIGTERM),
    "collected, finalizer starts": ("del store", ("c_return", "__call__", "pop"), -signal.SIGTERM),
    "collected, close starts": ("del store", ("call", "_close_parts", None), -signal.SIGTERM),
    "exit hooks": ("", IN_THE_COMMIT, 0),  # the program is ending already
}


@pytest.mark.parametrize("closing", list(CLOSINGS))
def test_sigterm_as_a_store_closes_waits_for_its_commit(tmp_path, closing):
    """A SIGTERM that lands as a store closes (by close(), a collection or the exit hooks)
    ends the program only after its last commit: the steps are kept."""
    path = str(tmp_path / "b")
    tail, at, status = CLOSINGS[closing]
    code = textwrap.dedent(STOP_AS_IT_CLOSES.format(path=path, at=at)) + tail + "\nprint('not reached')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (status, "not reached\n" if status == 0 else ""), done.stderr
    assert status == 0 or "SIGTERM: ending the program" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    with mr.open(path) as store:
        assert store.committed_steps == 40
    assert verify(path) == []


# --- a write cut short by a signal --------------------------------------------------------

CUT_SHORT = """
import os, signal, sys, numpy as np, mmreplay as mr
from mmreplay.spec import unflatten
from mmreplay.torture import FRAME_STACK, Layout, rows_of
layout = Layout(**{layout!r})
store = mr.create({path!r}, layout.spec, capacity=80, num_envs=2, backend=layout.backend,
                  compression={compression!r}, chunk_steps=8, commit_every=10**6,
                  frames=mr.Frames(frame_stack=FRAME_STACK) if layout.frames else None)
def put(g, n):
    store.extend(unflatten(store.spec, rows_of(layout, 2, np.arange(g, g + n))))
put(0, 98)  # the ring has wrapped
store.commit()
put(98, 2)  # added since the last commit, in the chunk the next write leaves (slots 16..23)
(arm, arm_at), (hit, hit_at) = {arm!r}, {hit!r}
calls = {{arm: 0, hit: 0}}
def interrupt(frame, event, arg):
    name = frame.f_code.co_qualname
    if event != "call" or name not in calls or (name == hit and calls[arm] < arm_at):
        return
    calls[name] += 1
    if name == hit and calls[arm] >= arm_at and calls[hit] >= hit_at:
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, landing in this call
sys.setprofile(interrupt)
try:
    put(100, 6)  # the slots of the oldest committed steps, within the reservation of the last commit
finally:
    sys.setprofile(None)
    print(store.total_steps, flush=True)
    store.close()
"""

#: where Ctrl-C lands in `extend(100..106)`: in the (arm_at-th call of arm, then the)
#: hit_at-th call of hit
CUTS = {
    "zarr-mapped": ({"backend": "zarr", "compressed": False, "num_envs": 2}, None, ("MappedLeaf.write", 0), ("MappedLeaf.write", 2)),
    "hdf5-mapped": ({"backend": "hdf5", "compressed": False, "num_envs": 2}, None, ("MappedLeaf.write", 0), ("MappedLeaf.write", 2)),
    # the chunk the head leaves, as it is being written
    "zarr-zstd": ({"backend": "zarr", "compressed": True, "num_envs": 2}, "zstd", ("ZarrChunks.write", 0), ("ZarrChunks.write", 1)),
    "hdf5-gzip": ({"backend": "hdf5", "compressed": True, "num_envs": 2}, "gzip", ("H5Chunks.write", 0), ("H5Chunks.write", 1)),
    "rows-lz4": ({"backend": "zarr", "compressed": True, "num_envs": 2}, "rows:lz4", ("RowFrameLeaf.write", 0), ("RowFrameLeaf.write", 2)),
    "rows-zstd": ({"backend": "zarr", "compressed": True, "num_envs": 2}, "rows:zstd:1", ("RowFrameLeaf.write", 0), ("RowFrameLeaf.write", 2)),
    # frames once: after the third step took its frames, before its rows are all written
    "frames-lz4": (
        {"backend": "zarr", "compressed": True, "num_envs": 2, "frames": True},
        "rows:lz4",
        ("FrameWriter.apply", 3),
        ("_step_writer.<locals>.write", 2),
    ),
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_ctrl_c_in_the_middle_of_a_write_commits_no_torn_step(tmp_path, cut):
    """Ctrl-C lands inside a write on a wrapped ring (after some leaves' rows, or a chunk
    the head leaves, are written), then `finally: store.close()`: every committed step is
    bit-exact and none the script added is lost."""
    from conftest import verify_cli

    from mmreplay.torture import Layout, rows_of

    layout, compression, arm, hit = CUTS[cut]
    path = str(tmp_path / "b")
    code = CUT_SHORT.format(layout=layout, path=path, compression=compression, arm=arm, hit=hit)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGINT and "KeyboardInterrupt" in done.stderr, done.stderr
    added = int(done.stdout.split()[-1])
    assert 100 <= added < 106  # the extend was cut short
    with mr.open(path) as store:
        assert store.committed_steps == added
        ids = np.arange(store.first_step, store.committed_steps)
        assert len(ids) > 20
        got = store.read_steps(ids)
        for leaf, a, b in zip(store.leaf_paths, got, rows_of(Layout(**layout), 2, ids)):
            bad = [int(s) for s, x, y in zip(ids, a, b) if x.tobytes() != y.tobytes()]
            assert not bad, f"leaf {leaf!r}: committed steps {bad} are not theirs (window {ids[0]}..{ids[-1]})"
    assert verify_cli(path) == (0, [])


CTRL_C_IN_EXTEND = """
import os, signal, numpy as np, mmreplay as mr
from mmreplay.hooks import WriteHook
class CtrlC(WriteHook):
    def on_add(self, first_step, count):
        if first_step == 13:  # a frames-once store adds an extend's steps one by one
            os.kill(os.getpid(), signal.SIGINT)
spec = {{"obs": mr.ArraySpec((4, 4, 2), "uint8"), "next_obs": mr.ArraySpec((4, 4, 2), "uint8"),
        "terminated": mr.ArraySpec((), "bool"), "truncated": mr.ArraySpec((), "bool")}}
store = mr.create({path!r}, spec, 200, frames=mr.Frames(frame_stack=2))
store.add_write_hook(CtrlC())
def steps(t0, n):  # frame t at step t; the episode starts at step 0 (repeat padding)
    t = np.arange(t0, t0 + n)
    frame = lambda x: np.broadcast_to(x.astype("uint8")[:, None, None, None, None], (n, 1, 4, 4, 1))
    return {{"obs": np.concatenate([frame(np.maximum(t - 1, 0)), frame(t)], -1),
            "next_obs": np.concatenate([frame(t), frame(t + 1)], -1),
            "terminated": np.zeros((n, 1), bool), "truncated": np.zeros((n, 1), bool)}}
store.extend(steps(0, 10))
store.extend(steps(10, 40))
"""


def test_ctrl_c_in_an_extend_of_a_frames_once_store_commits_the_steps_it_added(tmp_path):
    """docs/reliability.md: Ctrl-C in an `extend` commits none of its steps, but in a
    store keeping each frame once, which adds them one by one, those added before it."""
    path = str(tmp_path / "b")
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_EXTEND.format(path=path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGINT and "KeyboardInterrupt" in done.stderr, done.stderr
    with mr.open(path) as store:
        assert store.committed_steps == 14
        newest = store.get(slice(None))["obs"][:, 0, 0, 0, -1]
        assert newest.tolist() == list(range(store.first_step, 14))


# SIGTERM lands in a commit just after the episode index appended its ends (before the
# index took note of them); the commit is cut short and close() commits again
STOP_AFTER_INDEX_APPEND = """
import os, signal, sys, numpy as np, mmreplay as mr
store = mr.create({path!r}, {{"x": mr.ArraySpec((), "int64"), "terminated": mr.ArraySpec((), "bool")}},
                  capacity=100, commit_every=10**6)
def put(lo, hi):
    steps = np.arange(lo, hi).reshape(-1, 1)
    store.extend({{"x": steps, "terminated": steps % 5 == 4}})
put(0, 20)
store.commit()
put(20, 40)
def stop(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "_append_memory":
        sys.setprofile(None)
        os.kill(os.getpid(), signal.SIGTERM)
sys.setprofile(stop)
try:
    store.commit()
finally:
    sys.setprofile(None)
    store.close()
"""


def test_a_commit_cut_short_after_the_episode_index_append_leaves_no_ends_twice(tmp_path):
    path = str(tmp_path / "b")
    code = textwrap.dedent(STOP_AFTER_INDEX_APPEND.format(path=path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert verify(path) == []
    with mr.open(path) as store:
        assert store.committed_steps == 40
        assert [ep.last_step for ep in store.episode_index()] == list(range(4, 40, 5))


# --- a thread still writing as the program ends -----------------------------------------

THREAD_AT_EXIT = """
import os, sys, threading, time, numpy as np, mmreplay as mr
from mmreplay.spec import flatten, unflatten
from mmreplay.torture import SPEC, step_values
store = mr.create({path!r}, SPEC, capacity=64, num_envs=2, backend={backend!r}, compression={compression!r},
                  chunk_steps=4, commit_every=10**6)
leaves = flatten(SPEC)
midway = threading.Event()
writes = [0]
def pause(frame, event, arg):  # in the thread's 300th step, after its first leaf's rows
    if event == "call" and frame.f_code.co_qualname.endswith("Leaf.write"):
        writes[0] += 1
        if writes[0] == 2:
            sys.setprofile(None)
            midway.set()
            time.sleep(0.3)  # the main thread returns meanwhile
def collect():
    g = 0
    try:
        while True:
            if g == 300:
                sys.setprofile(pause)
            store.extend(unflatten(SPEC, step_values(leaves, 2, np.arange(g, g + 5))))
            g += 5
    except mr.ClosedError as exc:  # closed by the exit hooks
        os.write(1, f"closed: {{exc}}\\n".encode())  # one write: the interpreter may stop the thread any time
threading.Thread(target=collect, daemon=True).start()
midway.wait()  # then the main thread returns, the thread in the middle of an extend
"""


@pytest.mark.parametrize(
    ("backend", "compression"), [("zarr", None), ("zarr", "zstd"), ("hdf5", "gzip"), ("zarr", "rows:lz4")]
)
def test_a_daemon_thread_still_adding_at_exit_leaves_only_whole_steps_committed(tmp_path, backend, compression):
    """The exit hooks wait for the write under way (the thread is in the middle of an
    extend as the main thread returns), commit, and close the store: the thread's next
    write is refused, so nothing it writes after the commit is in it."""
    from conftest import verify_cli

    from mmreplay.spec import flatten
    from mmreplay.torture import SPEC, step_values

    path = str(tmp_path / "b")
    code = THREAD_AT_EXIT.format(path=path, backend=backend, compression=compression)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    with mr.open(path) as store:
        assert store.committed_steps >= 300
        ids = np.arange(store.first_step, store.committed_steps)
        for leaf, a, b in zip(store.leaf_paths, store.read_steps(ids), step_values(flatten(SPEC), 2, ids)):
            bad = [int(s) for s, x, y in zip(ids, a, b) if x.tobytes() != y.tobytes()]
            assert not bad, f"leaf {leaf!r}: committed steps {bad} hold other data"
    assert verify_cli(path) == (0, [])
    assert "Traceback" not in done.stderr and "left open failed" not in done.stderr, done.stderr
    assert "the program is ending" in done.stdout, done.stdout  # what the thread was told


THREAD_CLOSES_AT_EXIT = """
import os, threading, time, numpy as np, mmreplay as mr
from mmreplay.hooks import WriteHook
store = mr.create({path!r}, {{"x": mr.ArraySpec((3,), "float32"), "terminated": mr.ArraySpec((), "bool")}},
                  capacity=1000, commit_every=10**6, backend={backend!r}, compression={compression!r})
running = threading.Event()
class SlowExitCommit(WriteHook):
    def on_commit(self, old_end, new_end, fsync):
        if threading.current_thread() is threading.main_thread():  # the exit hooks' commit
            time.sleep(0.3)  # the thread's next add is refused meanwhile, and it closes the store
store.add_write_hook(SlowExitCommit())
def collect():
    try:
        with store:
            for t in range(10**6):
                store.add({{"x": np.full((1, 3), t, "float32"), "terminated": np.array([t % 7 == 6])}})
                if t >= 100:
                    running.set()
                    time.sleep(0.01)  # between steps: the program ends while the thread waits here
    except mr.ClosedError as exc:
        os.write(1, f"closed: {{exc}}\\n".encode())
threading.Thread(target=collect, daemon=True).start()
running.wait()
"""


@pytest.mark.parametrize(("backend", "compression"), [("zarr", None), ("hdf5", "gzip"), ("zarr", "rows:lz4")])
def test_a_thread_closing_its_store_as_the_exit_hooks_close_it_waits_for_them(tmp_path, backend, compression):
    """A daemon thread told the program is ending closes its store (``with store:``)
    while the exit hooks commit it: its close waits for theirs instead of closing the
    files under that commit (which then failed, or crashed in HDF5)."""
    from conftest import verify_cli

    path = str(tmp_path / "b")
    code = THREAD_CLOSES_AT_EXIT.format(path=path, backend=backend, compression=compression)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "left open failed" not in done.stderr, done.stderr
    with mr.open(path) as store:
        assert store.committed_steps >= 101
        np.testing.assert_array_equal(store.get(slice(None))["x"][:, 0, 0], np.arange(store.committed_steps))
    assert verify_cli(path) == (0, [])


THREAD_OPENS_AT_EXIT = """
import atexit, os, sys, threading, time, numpy as np, mmreplay as mr
from mmreplay.backends import hdf5  # noqa: F401 - imported before the program ends, as a program has
stores, told, opening = [], threading.Event(), threading.Event()
def report():  # an exit hook of the program's, run after mmreplay's (and before h5py's)
    told.wait(5)
    print("told", told.is_set(), "closed", [s.closed for s in stores], flush=True)
atexit.register(report)
def pause(frame, event, arg):  # the thread stops inside the store's open, before its data files
    if event == "call" and frame.f_code.co_name == "open_contents":
        sys.setprofile(None)
        opening.set()
        time.sleep(0.3)  # the main thread returns meanwhile
def collect():
    sys.setprofile(pause)
    stores.append(mr.open({path!r}, "a"))
    try:
        for t in range(10**6):
            stores[0].add({{"x": np.full((1, 16), t, "float32")}})
    except mr.ClosedError:
        told.set()
threading.Thread(target=collect, daemon=True).start()
opening.wait()
"""


def test_a_writer_a_daemon_thread_is_opening_as_the_program_ends_is_closed_by_the_exit_hooks(tmp_path):
    """The exit hooks wait for a writer another thread is opening, then close it: the
    thread's open must not go on into h5py past the program's end (whose own exit hook
    tears its state down: the thread crashed there), and its next add is refused."""
    path = str(tmp_path / "b")
    mr.create(path, {"x": mr.ArraySpec((16,), "float32")}, capacity=64, backend="hdf5", compression="gzip",
              chunk_steps=4, commit_every=10**6).close()
    code = THREAD_OPENS_AT_EXIT.format(path=path)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["told", "True", "closed", "[True]"], (done.stdout, done.stderr)
    with mr.open(path) as store:
        assert store.committed_steps == store.total_steps


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_a_non_daemon_thread_opens_and_writes_after_the_main_thread_returns(tmp_path, backend):
    """The interpreter waits for a non-daemon thread before its exit hooks: its writer
    opens, writes and commits as at any other time, also where a library registered its
    own thread-end hook after mmreplay's (which then cannot register its own again)."""
    path = str(tmp_path / "b")
    code = f"""
    import threading, time, numpy as np, mmreplay as mr
    mr.create({path!r}, {{"x": mr.ArraySpec((), "int64")}}, capacity=100, backend={backend!r}).close()
    threading._register_atexit(lambda: None)  # a library's thread-end hook, after mmreplay's
    def collect():
        time.sleep(0.3)  # the main thread has returned
        with mr.open({path!r}, "a") as store:
            for t in range(10):
                store.add({{"x": np.array([t])}})
    threading.Thread(target=collect).start()
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stderr, done.stderr
    with mr.open(path) as store:
        assert store.get(slice(None))["x"][:, 0].tolist() == list(range(10))


def test_a_thread_writing_zarr_chunks_after_main_returns_is_told_the_program_is_ending(tmp_path):
    """zarr cannot write once the interpreter stopped its thread pools: the thread's add
    says so (ShutdownError), not that the buffer is damaged, and nothing unwritten is
    committed."""
    from conftest import verify_cli

    path = str(tmp_path / "b")
    code = f"""
    import threading, numpy as np, mmreplay as mr
    store = mr.create({path!r}, {{"x": mr.ArraySpec((64,), "float32")}}, capacity=64, compression="zstd",
                      chunk_steps=4, commit_every=10**6)
    def work():
        for t in range(100_000):
            store.add({{"x": np.full((1, 64), t, "float32")}})
    threading.Thread(target=work).start()  # non-daemon: the interpreter waits for it
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert "mmreplay.errors.ShutdownError" in done.stderr and "the program is ending" in done.stderr, done.stderr
    assert "errors.CorruptBufferError" not in done.stderr, done.stderr
    with mr.open(path) as store:
        x = store.get(slice(None))["x"][:, 0, 0] if len(store) else np.zeros(0)
        np.testing.assert_array_equal(x, np.arange(store.first_step, store.committed_steps))
    assert verify_cli(path) == (0, [])


FORKED_CHILD = """
import os, signal, sys, numpy as np, mmreplay as mr
store = mr.create({path!r}, {{"x": mr.ArraySpec((), "int64")}}, capacity=100, commit_every=10**6,
                  backend={backend!r}, compression={compression!r})
store.extend({{"x": np.arange(10).reshape(10, 1)}})
store.commit()
go, ready = os.pipe()
if os.fork() == 0:  # a forked helper: it ends normally, closing what it holds
    os.read(go, 1)  # once the parent has committed more
    try:
        store.add({{"x": np.array([-1])}})
    except mr.ClosedError as exc:
        print("child:", exc, flush=True)
    store.close()
    sys.exit(0)
store.add({{"x": np.array([10])}})
store.commit()
os.write(ready, b"x")
os.wait()
store.add({{"x": np.array([11])}})
store.commit()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize(("backend", "compression"), [("zarr", None), ("zarr", "zstd"), ("hdf5", None)])
def test_a_forked_child_never_commits_its_parents_writer(tmp_path, writers, backend, compression):
    """A forked process (``os.fork``, multiprocessing's fork) holds a copy of the writer as
    it was at the fork: its close and its exit hooks must not write that older state over
    the commits the parent made since, nor may it write."""
    path = str(tmp_path / "b")
    done = writers.run_killed(textwrap.dedent(FORKED_CHILD.format(path=path, backend=backend, compression=compression)))
    with mr.open(path) as store:
        assert store.committed_steps == 12
        np.testing.assert_array_equal(store.get(slice(None))["x"][:, 0], np.arange(12))
    assert verify(path) == []
    assert "forked from" in done.stdout, done.stdout + done.stderr  # what the child was told
