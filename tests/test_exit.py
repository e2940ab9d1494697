"""A writer that is never closed still commits every step it added.

A script that ends normally, dies of an uncaught exception, is stopped by Ctrl-C in its
collection loop, or drops its last reference to the store (or to a layer holding one)
must leave on disk every step it added. Only SIGKILL or a power loss may lose the
uncommitted tail. Each case runs a real script in a fresh process, with a commit
interval far larger than what it adds, then reopens the buffer here and counts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.verify import verify

ENDINGS = ["normal", "exception", "sigint", "collected"]
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
    # Ctrl-C in the loop; the KeyboardInterrupt ends the program (the finally only reports)
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

# Python ends a program stopped by an uncaught KeyboardInterrupt by SIGINT, as a shell expects
EXIT_CODES = {"normal": 0, "exception": 1, "sigint": -signal.SIGINT, "collected": 0}


def run_script(setup: str, ending: str, path: str) -> list[int]:
    """Run the script; returns how many steps it said it added (one count per buffer)."""
    code = f"PATH = {path!r}\nPATHS = [PATH]\n" + textwrap.dedent(setup) + textwrap.dedent(ENDING[ending])
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    if ending == "sigint":
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CODES[ending], err
    if ending == "sigint":
        assert "KeyboardInterrupt" in err, err
    assert "Traceback" not in err or ending in ("exception", "sigint"), err
    assert "store left open failed" not in err, err
    added = [int(n) for n in out.strip().splitlines()[-1].split()]
    assert min(added) > 40  # the vector recorder holds back the transitions of envs ahead of the others
    return added


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize(
    ("backend", "compression"), [("zarr", None), ("zarr", "zstd"), ("hdf5", None), ("hdf5", "gzip")]
)
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
            assert store.committed_steps == steps, name


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


def test_sigkill_loses_only_the_uncommitted_tail(tmp_path):
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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert done.returncode == -signal.SIGKILL
    with mr.open(path) as store:
        assert store.committed_steps == 30
        assert os.path.exists(os.path.join(path, "mmreplay.json"))
