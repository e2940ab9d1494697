"""Every command ends through its own exit path, never by a crash at interpreter exit.

Threads mmreplay's I/O starts (the object-storage event loop, whose requests obstore
completes from its Rust threads; zarr's event loop) must be done before the interpreter
goes: a request that lands after it aborts the process (SIGABRT, SIGSEGV), and a loop
closed while it runs prints a traceback. Real processes, real signals, a real S3 server
(moto on 127.0.0.1) and a CPU burner for load.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from contextlib import contextmanager
from urllib.parse import urlsplit

import numpy as np
import pytest
from conftest import S3_BUCKET

import mmreplay as mr

#: what a crash at exit or an exit hook's failure prints
CRASH_SIGNS = ("Traceback", "Exception ignored", "panicked", "Fatal Python error", "Thread did not finish")

#: the interpreter's teardown made to last 0.3 s, as on a loaded machine: a request of
#: obstore's landing then crashes the process
SLOW_TEARDOWN = """
import time

class SlowTeardown:
    def __del__(self):
        time.sleep(0.3)

slow = SlowTeardown()  # cleared with the module's globals, as the interpreter finalizes
"""
#: the command line as ``python -m mmreplay.cli`` runs it, said ready once it can take
#: Ctrl-C (an interrupt during the interpreter's own start-up is no command's to handle)
CLI_READY = (
    SLOW_TEARDOWN
    + """
import sys
import mmreplay.cli as cli

print("ready", flush=True)
sys.argv[0] = "mmreplay"
cli.main()
"""
)


@contextmanager
def slow_link(endpoint: str, delay: float = 0.2):
    """A TCP proxy to ``endpoint`` that holds each answer ``delay`` seconds, like a far
    server: requests stay in flight that long. Yields its endpoint."""
    upstream = urlsplit(endpoint)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def pump(src: socket.socket, dst: socket.socket, asked: threading.Event, answer: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if answer and asked.is_set():  # the first bytes of an answer
                    time.sleep(delay)
                    asked.clear()
                elif not answer:
                    asked.set()
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = server.accept()
                far = socket.create_connection((upstream.hostname, upstream.port))
                asked = threading.Event()
                threading.Thread(target=pump, args=(client, far, asked, False), daemon=True).start()
                threading.Thread(target=pump, args=(far, client, asked, True), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


CAPACITY = 256
NUM_ENVS = 2
SPEC = {
    "step": mr.ArraySpec((), "int64"),
    "obs": mr.ArraySpec((32, 32), "uint8"),  # mapped: shard objects
    "pix": mr.ArraySpec((16, 16), "uint8"),  # zstd: one object per chunk
}


def steps(first: int, n: int) -> dict[str, np.ndarray]:
    g = np.arange(first, first + n)[:, None].repeat(NUM_ENVS, 1)
    return {
        "step": g,
        "obs": np.broadcast_to((g % 251).astype(np.uint8)[..., None, None], (n, NUM_ENVS, 32, 32)),
        "pix": np.broadcast_to((g % 253).astype(np.uint8)[..., None, None], (n, NUM_ENVS, 16, 16)),
    }


def make(path, n: int) -> str:
    with mr.create(
        path, SPEC, capacity=CAPACITY, num_envs=NUM_ENVS, chunk_steps=8, compression={"pix": "zstd"}
    ) as s:
        s.extend(steps(0, n))
    return str(path)


def check_whole(url: str) -> None:
    """The snapshot at ``url`` verifies, and each of its rows is one step's in every leaf."""
    from mmreplay.objstore import verify_url

    assert verify_url(url) == []
    with mr.open(url) as remote:
        if len(remote):
            rows = remote.get(slice(None))
            g = rows["step"]
            np.testing.assert_array_equal(rows["obs"][..., 5, 7], (g % 251).astype(np.uint8))
            np.testing.assert_array_equal(rows["pix"][..., 3, 2], (g % 253).astype(np.uint8))
            assert g.min() >= remote.first_step and g.max() < remote.total_steps


def no_crash(out: str, err: str, code: int) -> None:
    assert code not in (
        -signal.SIGABRT,
        -signal.SIGSEGV,
        -signal.SIGBUS,
        128 + signal.SIGABRT,
        128 + signal.SIGSEGV,
    ), (
        code,
        err[-3000:],
    )
    assert not any(sign in err for sign in CRASH_SIGNS), err[-3000:]


def push_cli(
    local: str, url: str, env: dict[str, str], interrupt: float | None
) -> tuple[int, str, str, float]:
    """``mmreplay push LOCAL URL``, with Ctrl-C (SIGINT) ``interrupt`` seconds after it is
    ready; its exit status, output and seconds from ready to exit."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CLI_READY, "push", local, url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline() == "ready\n"
    t = time.monotonic()
    if interrupt is not None:
        time.sleep(interrupt)
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err, time.monotonic() - t


@pytest.mark.parametrize("trials", [16, pytest.param(200, marks=pytest.mark.long)])
def test_ctrl_c_during_push_ends_as_aborted_and_the_snapshot_stays_whole(tmp_path, s3_server, trials):
    """Ctrl-C at random moments of pushes to a server whose answers take 0.2 s (requests
    are in flight most of the time): always "Aborted!" (or done, when the push finished
    first), and the snapshot there verifies and holds whole rows after each."""
    local = make(tmp_path / "buf", 100)
    url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}/buffer"
    rng = random.Random(0)
    total = 100
    outcomes = {"aborted": 0, "done": 0}
    with slow_link(s3_server) as endpoint:
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
        code, out, err, took = push_cli(local, url, env, None)
        assert code == 0, err
        for _ in range(trials):
            with mr.open(local, mode="a") as s:  # new rows: the push has objects to send
                s.extend(steps(total, 90))
            total += 90
            code, out, err, _ = push_cli(local, url, env, rng.uniform(0, took))
            no_crash(out, err, code)
            if code == 1:
                assert err.strip() == "Aborted!", err
                outcomes["aborted"] += 1
            else:
                # done before the signal (or the signal came as it exited): the report is out
                assert code in (0, -signal.SIGINT) and "steps" in out, (code, out, err)
                outcomes["done"] += 1
            check_whole(url)
    assert outcomes["aborted"] >= trials // 4, outcomes
    assert mr.push(local, url).steps == CAPACITY  # the next push completes it
    with mr.open(url) as remote, mr.open(local) as src:
        assert (remote.first_step, remote.total_steps) == (src.first_step, src.total_steps)
        np.testing.assert_array_equal(remote.get(slice(None))["pix"], src.get(slice(None))["pix"])


@contextmanager
def cpu_burner():
    """Another process spinning on a core, as on a busy machine."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("rounds", [2, pytest.param(30, marks=pytest.mark.long)])
def test_commands_exit_cleanly_under_load(tmp_path, s3_server, rounds):
    """Local and object-storage commands, several at a time beside a CPU burner: each
    exits 0 and prints no traceback at exit."""
    local = make(tmp_path / "buf", 300)
    url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}/buffer"
    assert mr.push(local, url).steps == CAPACITY
    commands = [
        ("inspect", local),
        ("verify", local),
        ("sample", local, "-n", "3"),
        ("stats", local),
        ("push", local, url),
        ("inspect", url),
        ("verify", url),
        ("sample", url, "-n", "3"),
        ("stats", url),
    ]
    runs = 0
    with cpu_burner():
        for r in range(rounds):
            batch = commands + [("pull", url, str(tmp_path / f"pulled-{r}"))]
            for i in range(0, len(batch), 3):  # three at a time
                procs = [
                    (
                        args,
                        subprocess.Popen(
                            [sys.executable, "-m", "mmreplay.cli", *args],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True,
                        ),
                    )
                    for args in batch[i : i + 3]
                ]
                for args, proc in procs:
                    out, err = proc.communicate(timeout=300)
                    no_crash(out, err, proc.returncode)
                    assert proc.returncode == 0, (args, proc.returncode, err)
                    runs += 1
    assert runs == rounds * (len(commands) + 1)


def run_script(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_zarr_loop_still_busy_at_exit_ends_before_the_interpreter(tmp_path):
    """zarr's own exit hook gives its event-loop thread 0.2 s, then closes the loop under
    it. Here that thread is held 0.6 s at exit, as a busy machine may leave it unscheduled
    that long."""
    path = make(tmp_path / "buf", 40)
    out = run_script(
        """
        import sys, time
        import mmreplay as mr
        import zarr.core.sync as zarr_sync

        with mr.open(sys.argv[1]) as s:
            s.sample(8)  # compressed rows: zarr's loop decodes them
        zarr_sync.loop[0].call_soon_threadsafe(time.sleep, 0.6)
        print("done")
        """,
        path,
    )
    no_crash(out.stdout, out.stderr, out.returncode)
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr


@pytest.mark.parametrize("trials", [4, pytest.param(80, marks=pytest.mark.long)])
def test_a_thread_reading_object_storage_at_exit_does_not_crash_it(tmp_path, s3_server, trials):
    """A daemon thread sampling from object storage (answers taking 0.2 s) when the
    program ends: its requests in flight land before the interpreter goes, and it starts
    no more."""
    url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}/buffer"
    mr.push(make(tmp_path / "buf", 300), url)
    rng = random.Random(1)
    with slow_link(s3_server) as endpoint:
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
        for _ in range(trials):
            out = run_script(
                SLOW_TEARDOWN
                + """
import sys, threading
import mmreplay as mr

store = mr.open(sys.argv[1])
started = threading.Event()

def read():
    while True:
        started.set()
        store.sample(64, num_steps=4)

threading.Thread(target=read, daemon=True).start()
started.wait()
time.sleep(float(sys.argv[2]))
print("done")
""",
                url,
                str(rng.uniform(0, 0.4)),
                env=env,
            )
            no_crash(out.stdout, out.stderr, out.returncode)
            assert out.returncode == 0 and out.stdout == "done\n", out.stderr
