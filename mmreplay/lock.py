"""The single-writer lock: an OS ``flock`` on ``.lock``, so a dead holder never blocks.

The file keeps the holder's pid for error messages only; whether the lock is held is
decided by the kernel, which drops it when the holder's process ends however it ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import weakref

try:
    import fcntl  # POSIX: Linux and macOS
except ImportError as exc:  # Windows
    raise ImportError("mmreplay needs POSIX file locks (Linux or macOS); on Windows, run it under WSL") from exc

from .errors import LockedError, ReadOnlyError
from .io.local import open_inside

LOCK_FILE = ".lock"

#: seconds a writer retries a held lock before it says another process writes: the lock
#: is also held for an instant by :func:`holder_pid`'s probe (``verify``, an HDF5 open),
#: and by a child process of a writer between its fork and its exec
LOCK_WAIT_S = 0.25

#: the locks this process holds: a forked child closes its copies (see _forget_in_child)
_held: weakref.WeakSet[WriterLock] = weakref.WeakSet()


class WriterLock:
    def __init__(self, folder: str):
        self.path = os.path.join(folder, LOCK_FILE)
        self.fd: int | None = None

    def acquire(self, instead: str = "open it with mode='r' to read") -> None:
        """Take the lock, or say what the caller can do ``instead`` of writing."""
        try:  # (never through a link: the file is truncated below)
            fd = open_inside(os.path.dirname(self.path), LOCK_FILE, os.O_RDWR | os.O_CREAT)
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise ReadOnlyError(
                f"{os.path.dirname(self.path)}: cannot open for writing ({exc.strerror}); {instead}"
            ) from exc
        deadline, pause = time.monotonic() + LOCK_WAIT_S, 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(pause)
                    pause = min(2 * pause, 0.02)
                    continue
                holder = _read_pid(fd)
                os.close(fd)
                who = f"process {holder}" if holder else "another writer"
                raise LockedError(
                    f"{os.path.dirname(self.path)}: buffer is open for writing by {who}; "
                    f"{instead}, or stop that writer first"
                ) from None
        with contextlib.suppress(OSError):  # the pid is for messages only: a full disk does not stop a writer
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        _held.add(self)

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing drops the flock


def _forget_in_child() -> None:
    """A forked child (multiprocessing's fork, ``os.fork``) shares its parent's lock: its
    copy would keep the buffer locked after the parent ends (a killed writer's successor
    would be refused, naming the dead parent). The child closes its copies, leaving the
    lock with the parent."""
    for lock in list(_held):
        if lock.fd is not None:
            fd, lock.fd = lock.fd, None
            with contextlib.suppress(OSError):
                os.close(fd)  # (another descriptor of the locked file: the parent keeps the lock)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def holder_pid(folder: str) -> int | None:
    """The pid of the live writer of ``folder``, or None when no writer holds it."""
    try:
        fd = open_inside(folder, LOCK_FILE)
    except OSError:  # (a link or a FIFO too: no writer holds that)
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text.isdigit() else None
    except (OSError, UnicodeDecodeError):
        return None
