"""Run many ``mmreplay`` commands, each in a process of its own with a time limit, and
report which files in watched folders each one used.

``python cli_forks.py < plan.json`` prints one JSON result per run (``code``: the exit
status, None when killed at the time limit; ``stdout``; ``stderr``; ``touched``). The
plan: ``{"memory": bytes, "runs": [{"argv": [...], "cwd": folder, "timeout": seconds,
"watch": [folder, ...]}, ...]}``.

A new interpreter costs about two seconds on a loaded machine before it runs anything
(numpy, zarr, h5py, and torch or minari for some exports), far more than a command on a
small store. So this interpreter imports the command line and the libraries its
commands load, once, and forks a child per command: the child is a new process that has
run nothing of mmreplay before, as ``python -m mmreplay.cli`` would be, at a tenth of
the cost. It may use ``memory`` bytes of address space more than it starts with, so a
command that allocates what a crafted file asks for fails instead of swapping.

The watched folders are watched with inotify (Linux): every file or folder in them that
a command opens, reads, writes, creates or removes is reported in ``touched``.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import resource
import select
import signal
import struct
import sys
import tempfile
import time
import traceback

#: inotify events that mean a file or folder was used
_IN_ACCESS, _IN_MODIFY, _IN_ATTRIB, _IN_CLOSE_WRITE, _IN_OPEN = 0x1, 0x2, 0x4, 0x8, 0x20
_IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x40, 0x80, 0x100, 0x200
_WATCHED = (
    _IN_ACCESS | _IN_MODIFY | _IN_ATTRIB | _IN_CLOSE_WRITE | _IN_OPEN
    | _IN_MOVED_FROM | _IN_MOVED_TO | _IN_CREATE | _IN_DELETE
)
_EVENT = struct.Struct("iIII")

#: optional libraries the commands import when they run: loaded once, before forking
_PRELOAD = ["h5py", "zarr", "numcodecs", "hdf5plugin", "cramjam", "zstandard", "pyarrow", "pyarrow.parquet",
            "PIL.Image", "matplotlib.pyplot", "torch", "minari", "d3rlpy"]


class Watch:
    """inotify watches on every folder under some roots (new folders are not added)."""

    def __init__(self, roots: list[str]):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.names: dict[int, str] = {}
        for root in roots:
            for folder, _, _ in os.walk(root):
                wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), _WATCHED)
                if wd < 0:
                    raise OSError(ctypes.get_errno(), f"inotify_add_watch {folder}")
                self.names[wd] = folder

    def events(self) -> list[str]:
        """The paths used since the last call (a folder itself: its path with a slash)."""
        out = []
        while True:
            try:
                raw = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            pos = 0
            while pos < len(raw):
                wd, mask, _, length = _EVENT.unpack_from(raw, pos)
                name = raw[pos + _EVENT.size : pos + _EVENT.size + length].rstrip(b"\0").decode()
                pos += _EVENT.size + length
                if wd in self.names and mask & _WATCHED:
                    out.append(os.path.join(self.names[wd], name) if name else self.names[wd] + os.sep)

    def close(self) -> None:
        os.close(self.fd)


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def _child(argv: list[str], cwd: str, out: str, err: str, memory: int) -> None:
    """In the forked child: run the command line as ``python -m mmreplay.cli`` would."""
    code = 1
    try:
        os.chdir(cwd)
        for fd, path in ((1, out), (2, err)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        limit = _address_space() + memory
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from mmreplay.cli import main

        try:
            main(args=argv, prog_name="mmreplay")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    """The child's exit status, or None when it ran out of time (then it is killed)."""
    deadline = time.monotonic() + timeout
    pidfd = os.pidfd_open(pid)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pidfd], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
    finally:
        os.close(pidfd)


def _forked(run: dict, memory: int, scratch: str) -> tuple[int | None, str, str]:
    out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
    pid = os.fork()
    if pid == 0:
        _child(run["argv"], run["cwd"], out, err, memory)
    code = _wait(pid, run["timeout"])
    with open(out, errors="replace") as f, open(err, errors="replace") as g:
        return code, f.read(), g.read()


def main() -> None:
    plan = json.load(sys.stdin)
    for name in ["mmreplay.cli", *(f"mmreplay.cli.{m}" for m, _ in _commands()), *_PRELOAD]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional library that is not here
            pass
    with tempfile.TemporaryDirectory() as scratch:
        for run in plan["runs"]:
            watch = Watch(run.get("watch", []))
            try:
                watch.events()
                code, out, err = _forked(run, plan.get("memory", 2 << 30), scratch)
                touched = sorted(set(watch.events()))
            finally:
                watch.close()
            print(json.dumps({"code": code, "stdout": out, "stderr": err, "touched": touched}), flush=True)


def _commands() -> list[tuple[str, str]]:
    from mmreplay.cli import COMMANDS

    return list(COMMANDS.values())


if __name__ == "__main__":
    main()
