"""The torture's writer program: a fork server that has imported everything a writer
needs, and the writer each fork runs, collecting deterministic rows and reporting on fd 1
each operation it is about to do and each commit it has completed."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any

import numpy as np

from ..spec import unflatten
from .layouts import Layout, rows_of
from .report import TortureFailure


def _send(line: str) -> None:
    """A writer's report: one line on fd 1, in one ``write`` (so lines of two threads never mix)."""
    os.write(1, (line + "\n").encode())


def _refusal(exc: BaseException) -> str:
    """The report of a write refused as the ending expects."""
    return f"F {type(exc).__name__} {json.dumps(str(exc))}"


def _writer(request: dict) -> None:
    """Collect ``request["run_steps"]`` steps into ``request["path"]`` in random add /
    extend / commit calls.

    Reports on fd 1: ``O g c`` opened at step g with c committed; ``W g n flags``
    about to write steps [g, g + n) (flags: c may commit, k may write a compressed chunk,
    w wraps the ring; an explicit commit is ``W g 0 c``); ``C end`` a commit completed;
    ``F class message`` a write refused as the ending expects (a full disk, the program's
    end); ``Z g`` about to close, drop the store or leave it to the exit hooks, with
    ``g`` steps added; ``D end`` closed cleanly.
    Ending ``sigint`` / ``sigterm`` closes in a ``finally``, keeps the store for the exit
    hooks or drops it (``request["keep"]``); ``enospc`` goes on as ``request["after"]``
    says once a write is refused.
    """
    from ..errors import ClosedError, DiskFullError, ShutdownError
    from ..store import open as open_store

    ending = request.get("ending", "kill")
    layout = Layout(**request["layout"]) if "layout" in request else Layout("zarr", False, 1)
    refused = (DiskFullError,) if ending == "enospc" else (ClosedError, ShutdownError) if ending == "thread" else ()
    try:
        # each step's values are a function of its id: a resumed writer continues the
        # episodes it finds open, so none is marked truncated at the cut
        store = open_store(request["path"], "a", continue_episodes=True)
    except refused as exc:  # (a thread that opens the store after the main thread returned)
        _send(_refusal(exc))
        return
    if request.get("keep") == "exit":
        _KEPT.append(store)  # the exit hooks close it
    num_envs, capacity = store.num_envs, store.capacity
    meta = store.metadata
    compressed = [leaf.chunk_steps for leaf in meta.leaves if leaf.compression is not None]
    rng = np.random.default_rng(request["seed"])
    g = store.total_steps
    _send(f"O {g} {store.committed_steps}")
    last = store.committed_steps
    target = g + request["run_steps"]
    after = request.get("after", "close")
    failed = False
    try:
        while g < target:
            r = rng.random()
            if r < 0.08:
                n = 0
            elif r < 0.4:
                n = 1
            elif r < 0.97:
                n = int(rng.integers(2, max(3, capacity // 3)))
            else:
                n = int(rng.integers(capacity, 2 * capacity + 1))  # more than a ring's worth
            state = store.state
            commit = n == 0 or g + n > state.reserved or g + n - state.end >= meta.commit_every
            chunk = bool(compressed) and (
                commit or any((g + n) // cs > g // cs or (g + n) // capacity > g // capacity for cs in compressed)
            )
            # the write crosses from the ring's last slot to its first
            wrap = n > 0 and ((g + n - 1) // capacity > g // capacity or (g > 0 and g % capacity == 0))
            flags = ("c" if commit else "") + ("k" if chunk else "") + ("w" if wrap else "")
            _send(f"W {g} {n} {flags or '-'}")
            try:
                if n == 0:
                    store.commit()
                elif n == 1:
                    store.add(unflatten(store.spec, [v[0] for v in rows_of(layout, num_envs, [g])]))
                else:
                    store.extend(unflatten(store.spec, rows_of(layout, num_envs, np.arange(g, g + n))))
            except refused as exc:
                _send(_refusal(exc))
                failed = True
                if ending == "thread" or after == "exit":
                    return  # the exit hooks close it
                if after == "close":
                    break
                with contextlib.suppress(FileNotFoundError):  # "retry": room again, and go on
                    os.remove(request["filler"])
                after = "close"
            g = store.total_steps
            if store.committed_steps != last:
                last = store.committed_steps
                _send(f"C {last}")
        if request.get("keep") in ("drop", "exit"):
            _send(f"Z {g}")
            if request["keep"] == "drop":
                del store  # the last reference: the store is closed when collected
            return
    finally:
        if request.get("keep", "finally") == "finally" and not (failed and after == "exit"):
            _send(f"Z {g}")
            try:
                store.close()
            except refused as exc:
                _send(_refusal(exc))
                return
    _send(f"D {store.committed_steps}")


#: stores a writer leaves open for the exit hooks
_KEPT: list[Any] = []


def _child(request: dict) -> int:
    """A forked writer: reports go to fd 1, one line each; warnings and errors too."""

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _send("L " + json.dumps(f"{record.name}: {record.getMessage()}"))

    logging.getLogger("mmreplay").addHandler(Forward(logging.WARNING))
    warnings.showwarning = lambda message, category, *a, **k: _send(
        "L " + json.dumps(f"{category.__name__}: {message}")
    )
    faulthandler.enable()  # a crash prints every thread's stack to the server's log
    ending = request.get("ending", "kill")
    try:
        _send(f"S {os.getpid()}")
        if ending == "thread":
            thread = threading.Thread(target=_in_thread, args=(request,), daemon=request["daemon"])
            thread.start()
            time.sleep(request["main_for"])  # then the main thread returns, the thread still writing
        else:
            _writer(request)
    except BaseException as exc:
        if ending in ("sigint", "sigterm") and isinstance(exc, (KeyboardInterrupt, SystemExit)):
            _send(f"I {type(exc).__name__}")  # the ending this run was sent
            return 0
        _send(_raised())
        return 1
    return 0


def _in_thread(request: dict) -> None:
    try:
        _writer(request)
    except BaseException:
        _send(_raised())


def _raised() -> str:
    """The report of an exception the writer did not expect (the one being handled)."""
    return "E " + json.dumps(traceback.format_exc())


def _end_as_a_program(code: int) -> None:
    """End a forked writer as the interpreter ends a program (which ``os._exit`` alone
    skips): the thread shutdown (its early exit hooks, then waiting for non-daemon
    threads), then the ``atexit`` hooks."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    os._exit(code)


def serve() -> None:
    """The writer server's loop: one JSON request a line on stdin, one forked writer each.

    It imports everything a writer needs once and never opens a store itself, so each
    fork starts clean (no zarr event loop thread, no open HDF5 file). After each writer
    ends it reports ``X pid exit-status``.
    """
    from .. import store  # noqa: F401 - preload
    from ..backends import hdf5, row_frames, zarr_v3  # noqa: F401 - preload

    for line in iter(sys.stdin.buffer.readline, b""):
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            code = _child(request)
            if request.get("ending", "kill") == "kill":
                os._exit(code)
            _end_as_a_program(code)
        _, status = os.waitpid(pid, 0)
        os.write(1, f"X {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


class WriterServer:
    """Starts :func:`serve` in a fresh interpreter and talks to it over pipes."""

    def __init__(self) -> None:
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            bufsize=0,
        )
        self._buf = b""

    def start(self, path: str, seed: int, run_steps: int, **options: Any) -> None:
        """Fork a writer of ``run_steps`` steps into ``path`` (``options``: its layout,
        ending and what the ending needs, see :func:`_writer`)."""
        request = json.dumps({"path": path, "seed": seed, "run_steps": run_steps, **options})
        try:
            self.proc.stdin.write(request.encode() + b"\n")
        except BrokenPipeError:
            raise TortureFailure(f"the writer server died: {self.log_tail()}") from None

    def line(self, timeout: float) -> str | None:
        """The next report line, or None after ``timeout`` seconds of silence."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise TortureFailure(f"the writer server died: {self.log_tail()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def log_tail(self) -> str:
        """The end of the writers' stderr (a crashed writer's stacks, from faulthandler)."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.log.close()

    def __enter__(self) -> WriterServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
