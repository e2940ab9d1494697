"""Every command ends through its own exit path, never by a crash at interpreter exit.

Threads mmreplay's I/O starts (the object-storage event loop, whose requests obstore
completes from its Rust threads; zarr's event loop) must be done before the interpreter
goes: a request that lands after it aborts the process (SIGABRT, SIGSEGV), and a loop
closed while it runs prints a traceback. Real processes, real signals, a real S3 server
(moto on 127.0.0.1), a slow link to it that keeps requests in flight and counts those a
process abandoned, and a CPU burner for load.
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
from test_object_store import CAPACITY, check_rows, make, steps

import mmreplay as mr

#: what a crash at exit or an exit hook's failure prints
CRASH_SIGNS = ("Traceback", "Exception ignored", "panicked", "Fatal Python error", "Thread did not finish")

#: the command line as ``python -m mmreplay.cli`` runs it, said ready once it can take
#: Ctrl-C (an interrupt during the interpreter's own start-up is no command's to handle)
CLI_READY = (
    "import sys, mmreplay.cli as cli; print('ready', flush=True); sys.argv[0] = 'mmreplay'; cli.main()"
)


class SlowLink:
    """A TCP proxy to an endpoint that holds the answer to each request of ``method``
    ``delay`` seconds, like a far server: those requests stay in flight that long. It
    counts the requests a client gave up on: it closed the connection while awaiting
    their answer, as a process does that exits with requests in flight."""

    def __init__(self, endpoint: str, method: str, delay: float = 0.6):
        self.upstream = urlsplit(endpoint)
        self.method = method.encode() + b" "
        self.delay = delay
        self.abandoned = 0
        self.connections = 0
        self.requests: list[str] = []  # the request line of each request of ``method``
        self.held = self.most_held = 0  # answers held now, and the most held at once
        self.lock = threading.Lock()
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.server.accept()
                far = socket.create_connection((self.upstream.hostname, self.upstream.port))
                asked: list[bytes] = []  # the request awaiting its answer (its first bytes)
                with self.lock:
                    self.connections += 1
                threading.Thread(target=self._requests, args=(client, far, asked), daemon=True).start()
                threading.Thread(target=self._answers, args=(far, client, asked), daemon=True).start()

    def _requests(self, client: socket.socket, far: socket.socket, asked: list[bytes]) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 16):
                if not asked:
                    asked.append(data[: len(self.method)])
                    if asked[0] == self.method:
                        with self.lock:
                            self.requests.append(data.split(b"\r\n", 1)[0].decode(errors="replace"))
                            self.held += 1
                            self.most_held = max(self.most_held, self.held)
                far.sendall(data)
        with self.lock:
            self.connections -= 1
            self.abandoned += bool(asked)
        _close(client, far)

    def _answers(self, far: socket.socket, client: socket.socket, asked: list[bytes]) -> None:
        with contextlib.suppress(OSError):
            while data := far.recv(1 << 16):
                if asked:  # the first bytes of an answer
                    if asked[0] == self.method:
                        time.sleep(self.delay)
                        with self.lock:
                            self.held -= 1
                    asked.clear()
                client.sendall(data)
        _close(client, far)

    def gave_up(self) -> int:
        """Requests abandoned so far, once every connection closed (a process that ended
        closed its own)."""
        deadline = time.monotonic() + 30
        while self.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.abandoned


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


@contextmanager
def slow_link(endpoint: str, method: str, delay: float = 0.6):
    link = SlowLink(endpoint, method, delay)
    try:
        yield link
    finally:
        link.server.close()


def check_whole(url: str) -> None:
    """The snapshot at ``url`` verifies, and each of its rows is one step's in every leaf."""
    from mmreplay.objstore import verify_url

    assert verify_url(url) == []
    with mr.open(url) as remote:
        if len(remote):
            g = check_rows(remote.get(slice(None)))
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


@pytest.mark.parametrize("trials", [8, pytest.param(200, marks=pytest.mark.long)])
def test_ctrl_c_during_push_ends_as_aborted_and_the_snapshot_stays_whole(tmp_path, s3_server, trials):
    """Ctrl-C at random moments of pushes to a server whose uploads take 0.3 s to answer
    (uploads are in flight most of the time: a push waits for six rounds of them, and does
    about 0.3 s of its own work): always "Aborted!" (or done, when the push finished first),
    and the snapshot there verifies and holds whole rows after each."""
    local = make(tmp_path / "buf", 30)
    url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}/buffer"
    rng = random.Random(0)
    total = 30
    outcomes = {"aborted": 0, "done": 0}
    with slow_link(s3_server, "PUT", 0.3) as link:
        env = {**os.environ, "AWS_ENDPOINT_URL": link.endpoint}
        code, out, err, _ = push_cli(local, url, env, None)
        assert code == 0, err
        with mr.open(local, mode="a") as s:  # the pushes below send what 15 new steps changed:
            s.extend(steps(total, 15))  # time one such push, not the first, whole one
        total += 15
        code, out, err, took = push_cli(local, url, env, None)
        assert code == 0, err
        for _ in range(trials):
            with mr.open(local, mode="a") as s:  # new rows: the push has objects to send
                s.extend(steps(total, 15))
            total += 15
            code, out, err, _ = push_cli(local, url, env, rng.uniform(0, took))
            no_crash(out, err, code)
            if code == 1:
                assert err.strip() == "Aborted!", err
                outcomes["aborted"] += 1
            else:
                # done before the signal (or the signal came as it exited): the report is out
                assert code in (0, -signal.SIGINT) and "steps" in out, (code, out, err)
                outcomes["done"] += 1
            assert link.gave_up() == 0  # it left no request in flight
            check_whole(url)
    assert outcomes["aborted"] >= trials // 4, outcomes
    assert mr.push(local, url).steps == CAPACITY  # the next push completes it
    with mr.open(url) as remote, mr.open(local) as src:
        assert (remote.first_step, remote.total_steps) == (src.first_step, src.total_steps)
        np.testing.assert_array_equal(remote.get(slice(None))["pixels"], src.get(slice(None))["pixels"])


@contextmanager
def cpu_burner():
    """Another process spinning on a core, as on a busy machine."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("rounds", [1, pytest.param(30, marks=pytest.mark.long)])
def test_commands_exit_cleanly_under_load(tmp_path, s3_server, rounds):
    """Local and object-storage commands, several at a time beside a CPU burner: each
    exits 0 and prints no traceback at exit."""
    local = make(tmp_path / "buf", 60)
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


def test_opening_a_store_in_object_storage_reads_its_leaves_metadata_together(tmp_path, s3_server):
    """One request per leaf for its array's metadata (zarr.json: no zarr v2 objects asked
    for), all of them in flight at once: a far store opens in one round trip for its
    leaves, not one per leaf."""
    url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}/buffer"
    mr.push(make(tmp_path / "buf", 10), url)
    with slow_link(s3_server, "GET") as link:
        env = {**os.environ, "AWS_ENDPOINT_URL": link.endpoint}
        out = run_script("import sys, mmreplay as mr\nmr.open(sys.argv[1]).close()\nprint('done')", url, env=env)
        assert out.returncode == 0 and out.stdout == "done\n", out.stderr
        assert link.gave_up() == 0
    arrays = [r for r in link.requests if "/data.zarr/" in r]
    assert len(arrays) == len(steps(0, 1)), link.requests
    assert all(r.split()[1].endswith("/zarr.json") for r in arrays), link.requests
    assert link.most_held == len(arrays), (link.most_held, link.requests)


@pytest.mark.parametrize("trials", [4, pytest.param(80, marks=pytest.mark.long)])
def test_a_thread_reading_object_storage_at_exit_does_not_crash_it(tmp_path, s3_server, trials):
    """A daemon thread sampling from object storage (reads taking 0.6 s) when the
    program ends: its requests in flight land before the interpreter goes, and it starts
    no more."""
    url = f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}/buffer"
    mr.push(make(tmp_path / "buf", 60), url)
    rng = random.Random(1)
    with slow_link(s3_server, "GET") as link:
        env = {**os.environ, "AWS_ENDPOINT_URL": link.endpoint}
        for _ in range(trials):
            out = run_script(
                """
import sys, threading, time
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
            assert link.gave_up() == 0  # it left no request in flight


def test_ctrl_c_before_a_request_begins_leaves_no_coroutine_behind():
    """Ctrl-C while a request waits to reach the object-storage loop: it never begins,
    the caller sees KeyboardInterrupt, and nothing is left to warn "coroutine ... was
    never awaited" (a push interrupted there printed that before "Aborted!")."""
    out = run_script(
        """
import gc, signal, threading
from mmreplay.io.remote import _Loop

async def request():
    return 1

_Loop.running()
_Loop.guard.acquire()  # the loop is in another thread's hands: the call below waits
main = threading.main_thread().ident
threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
threading.Timer(0.5, _Loop.guard.release).start()
try:
    _Loop.run(request())
except KeyboardInterrupt:
    print("interrupted")
gc.collect()
print("done")
""",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "interrupted\ndone\n" and out.stderr == "", out.stderr
