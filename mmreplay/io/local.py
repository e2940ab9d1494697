"""The local store folder as a byte source, under the rules for a folder from anyone.

Every file mmreplay opens inside a store's folder is opened here (:func:`open_inside`
and the helpers built on it), because a store may come from anyone: a file of its folder
must be a regular file reached from the folder through real folders, never through a
symbolic link, and never a FIFO, a socket or a device. Anything else is refused with a
:class:`CorruptBufferError` naming it, before a byte is read or written. The folder
itself, as the caller names it, may be a link (run folders often are).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import CorruptBufferError, NotABufferError
from .base import ByteSource, Handle, Range

__all__ = [
    "GROUP_FILE",
    "LocalFolder",
    "checked_inside",
    "folder_inside",
    "open_inside",
    "open_folder",
    "partial_name",
    "read_inside",
    "replace_inside",
    "unsafe_entries",
]

NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
#: the manifest of a group of stores (:mod:`mmreplay.group`): a folder that holds it is
#: no store, and says so where a store is expected
GROUP_FILE = "mmreplay-group.json"
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | NO_FOLLOW


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same number on every Linux architecture
_RESOLVE_NO_SYMLINKS_BENEATH = 0x04 | 0x08  # no link anywhere on the path, no ".." above the folder


def _find_openat2() -> Any:
    """Linux's ``openat2`` (5.6+), which enters every folder on a path without following a
    link in one call instead of one ``open`` per folder; None where it is missing or a
    sandbox refuses it (then :func:`_walk` does the same, folder by folder)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, 0)
    fd = syscall(_SYS_OPENAT2, -100, b"/", ctypes.byref(how), ctypes.sizeof(how))  # (-100: AT_FDCWD)
    if fd < 0:
        return None
    os.close(fd)
    return syscall


_openat2 = _find_openat2()


def _open_beneath(dfd: int, rel: str, flags: int, mode: int) -> int:
    """``rel`` opened under the folder ``dfd`` with ``openat2``, refusing links and ``..``."""
    how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, _RESOLVE_NO_SYMLINKS_BENEATH)
    fd = _openat2(_SYS_OPENAT2, dfd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return fd


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _refuse(path: str, what: str) -> CorruptBufferError:
    return CorruptBufferError(
        f"{path}: is {what}; a buffer's files must be regular files inside its folder, so mmreplay does not open it"
    )


def _check_entry(st: os.stat_result, path: str, writing: bool) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(path, _kind(st.st_mode))
    if writing and st.st_nlink > 1:
        raise _refuse(path, "a file with other hard links (writing it would change them too)")


def _joined(folder: str, rel: str) -> str:
    """``folder/rel`` (``rel``: names joined by ``/``), as ``os.path.join`` would give it,
    at a fraction of its cost: every file a store opens names its path."""
    return f"{folder}/{rel}" if folder and not folder.endswith("/") else folder + rel


def _walk(folder: str, parts: list[str], create: bool) -> int:
    """A descriptor of the folder ``folder/parts...``, each part entered without
    following links (``create``: making the missing ones)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            try:
                try:
                    inner = os.open(part, _FOLDER, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    # (made only where missing: most folders are there, and a failed mkdir costs more)
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                    inner = os.open(part, _FOLDER, dir_fd=fd)
            except OSError as exc:
                where = os.path.join(folder, *parts[: i + 1])
                try:
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    st = None
                if st is not None and not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
                    raise _refuse(where, _kind(st.st_mode)) from None
                exc.filename = where
                raise
            os.close(fd)
            fd = inner
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_inside(folder: str | os.PathLike, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A file descriptor of the regular file ``folder/rel`` (``rel``: names joined by
    ``/``), opened with ``flags``; missing folders on the way are made when ``flags``
    create the file.

    Raises CorruptBufferError when it (or a folder on the way) is a link or not a regular
    file, or, opened for writing, has other hard links; FileNotFoundError and
    IsADirectoryError as ``os.open`` does. A FIFO is never opened, so it never blocks.
    """
    folder = os.fspath(folder)
    parts = rel.split("/")
    path = _joined(folder, rel)
    writing = bool(flags & (os.O_WRONLY | os.O_RDWR))
    beneath = _openat2 is not None and not flags & os.O_CREAT  # (a walk makes missing folders)
    if beneath:  # the folders on the way are entered by openat2 below, in one call
        dfd, name = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), rel
    else:
        dfd, name = _walk(folder, parts[:-1], bool(flags & os.O_CREAT)), parts[-1]
    try:
        try:  # (a stat through a linked folder is refused by the open below)
            _check_entry(os.stat(name, dir_fd=dfd, follow_symlinks=False), path, writing)
        except (FileNotFoundError, NotADirectoryError) as exc:
            if not flags & os.O_CREAT:
                raise type(exc)(exc.errno, exc.strerror, path) from None
        try:  # (non-blocking: what was checked may have been swapped for a FIFO since)
            if beneath:
                fd = _open_beneath(dfd, name, flags | NO_FOLLOW | os.O_NONBLOCK, mode)
            else:
                fd = os.open(name, flags | NO_FOLLOW | os.O_NONBLOCK, mode, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EXDEV):
                why = {errno.ELOOP: "a symbolic link", errno.ENXIO: "not a regular file"}
                raise _refuse(path, why.get(exc.errno, "outside the folder")) from None
            exc.filename = path
            raise
    finally:
        os.close(dfd)
    try:
        _check_entry(os.fstat(fd), path, writing)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_inside(folder: str | os.PathLike, rel: str, limit: int, what: str = "the file") -> bytes:
    """The bytes of the regular file ``folder/rel`` (see :func:`open_inside`), refusing
    one larger than ``limit`` bytes before reading it."""
    return LocalFolder(folder).read(rel, limit, what)


def folder_inside(folder: str | os.PathLike, rel: str) -> str:
    """``folder/rel`` once it is a folder reached without links."""
    os.close(open_folder(folder, rel))
    return os.path.join(os.fspath(folder), *rel.split("/"))


def open_folder(folder: str | os.PathLike, rel: str) -> int:
    """A descriptor of the folder ``folder/rel``, reached without links (the caller closes it)."""
    return _walk(os.fspath(folder), rel.split("/"), False)


def checked_inside(folder: str | os.PathLike, rel: str) -> str:
    """``folder/rel`` once it is a regular file reached without links: for a library
    that opens files by name (h5py)."""
    os.close(open_inside(folder, rel))
    return os.path.join(os.fspath(folder), *rel.split("/"))


def partial_name(name: str) -> str:
    """The name a new file is written under before it is renamed over ``name`` (a name
    of its own: a dead writer's leftover is never in the way)."""
    return f"{name}.{uuid.uuid4().hex}.partial"


def replace_inside(folder: str | os.PathLike, rel: str, data: bytes | memoryview, exclusive: bool = False) -> None:
    """Write ``folder/rel`` whole by a new file renamed over it (``exclusive``: only
    where nothing is yet), making missing folders; no link is followed on the way."""
    parts = rel.split("/")
    dfd = _walk(os.fspath(folder), parts[:-1], True)
    try:
        tmp = partial_name(parts[-1])
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o644, dir_fd=dfd)
        try:
            try:
                view = memoryview(data).cast("B")
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            if exclusive:
                os.link(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            else:
                os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dfd)
    finally:
        os.close(dfd)


def unsafe_entries(folder: str | os.PathLike) -> list[str]:
    """What under ``folder`` mmreplay must not open: each link, FIFO, socket or device
    (one line each, naming it); folders under a link are not entered."""
    out = []
    for root, dirs, files in os.walk(os.fspath(folder)):
        for name in dirs + files:
            path = os.path.join(root, name)
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                continue  # removed while walking
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                out.append(str(_refuse(path, _kind(mode))))
    return sorted(out)


def require_readable(folder: str | os.PathLike) -> None:
    """Raise ``PermissionError`` naming the first file under ``folder`` this process may
    not read: no damage, so no check may take it for damage (recover would move it aside)."""
    for root, _, files in os.walk(os.fspath(folder)):
        for name in files:
            try:
                os.close(os.open(os.path.join(root, name), os.O_RDONLY | NO_FOLLOW | os.O_NONBLOCK))
            except PermissionError:
                raise
            except OSError:
                continue  # removed while walking, or what unsafe_entries refuses


def _advise(fd: int, offset: int, nbytes: int) -> None:
    """Ask the disk for a range now (``POSIX_FADV_WILLNEED``), where the OS has it."""
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)


class LocalHandle(Handle):
    """A file of the folder, open: its descriptor holds the file it opened."""

    scarce = True
    mappable = True

    def __init__(self, key: str, path: str, fd: int):
        self.key, self.path, self.fd = key, path, fd
        st = os.fstat(fd)
        self.size = st.st_size
        self.version = (st.st_ino, st.st_size, st.st_mtime_ns)

    def map(self) -> mmap.mmap | bytes:
        return mmap.mmap(self._fd(), 0, access=mmap.ACCESS_READ) if self.size else b""

    def read_at(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self._fd(), nbytes, offset)

    def write_at(self, offset: int, data: bytes, sync: bool = False) -> None:
        if os.pwrite(self._fd(), data, offset) != len(data):
            raise OSError(f"{self.path}: a short write")
        if sync:
            os.fdatasync(self._fd())

    def _fd(self) -> int:
        if self.fd < 0:
            raise ValueError(f"{self.path}: the file is closed")
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class LocalFolder(ByteSource):
    """A store's folder on this machine: its files by key, under the rules above."""

    local = True
    #: frames of one file fewer bytes apart than this are read in one ``pread``, with the
    #: bytes between (copying a few pages from the page cache costs less than a call)
    gap_bytes = 16 << 10

    def __init__(self, path: str | os.PathLike):
        self.path = self.url = os.fspath(path)

    def where(self, key: str) -> str:
        return _joined(self.path, key) if key else self.path

    def child(self, folder: str) -> LocalFolder:
        return LocalFolder(folder_inside(self.path, folder))

    def read(self, key: str, limit: int, what: str = "the file", start: int = 0, end: int | None = None) -> bytes:
        fd = open_inside(self.path, key)
        try:
            size = os.fstat(fd).st_size
            if start == 0 and end is None:  # whole: a file that grew since is read on, up to the limit
                if size <= limit:
                    parts, total = [], 0
                    while total <= limit:
                        part = os.read(fd, min(limit + 1 - total, max(size + 1 - total, 1 << 16)))
                        if not part:
                            return b"".join(parts)
                        parts.append(part)
                        total += len(part)
                    size = total
            else:
                a = max(0, size + start) if start < 0 else start
                b = size if end is None else min(size, end)
                if b - a <= limit:
                    return os.pread(fd, max(0, b - a), a)
            raise CorruptBufferError(f"{self.where(key)}: {size} bytes, larger than {what} can be (at most {limit})")
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return os.path.exists(self.where(key))

    def replace(self, key: str, data: bytes | memoryview, exclusive: bool = False) -> None:
        replace_inside(self.path, key, data, exclusive)

    def no_store(self) -> Exception:
        if not os.path.exists(self.path):
            return NotABufferError(f"{self.path}: no such folder")
        if not os.path.isdir(self.path):
            return NotABufferError(f"{self.path}: not a folder")
        if os.path.isfile(os.path.join(self.path, GROUP_FILE)):
            return NotABufferError(
                f"{self.path}: a group of stores ({GROUP_FILE}), not one store: open it with "
                f"mmreplay.open_group, or name one of its stores ({os.path.join(self.path, 'shard-000')}); "
                "the commands inspect, stats, export and verify take a group's folder"
            )
        return NotABufferError(f"{self.path}: not an mmreplay buffer (no mmreplay.json)")

    def handle(self, key: str, writable: bool = False) -> LocalHandle:
        fd = open_inside(self.path, key, os.O_RDWR if writable else os.O_RDONLY)
        try:
            return LocalHandle(key, self.where(key), fd)
        except BaseException:
            os.close(fd)
            raise

    def map(self, key: str, writable: bool, need: int = 0, what: str = "data file") -> mmap.mmap | None:
        path = self.where(key)
        try:
            fd = open_inside(self.path, key, os.O_RDWR if writable else os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise CorruptBufferError(f"{path}: {what} is missing") from None
        except IsADirectoryError:
            raise CorruptBufferError(f"{path}: expected a {what}, found a folder") from None
        try:
            size = os.fstat(fd).st_size
            if size < need:
                raise CorruptBufferError(f"{path}: {what} is truncated: expected at least {need} bytes, found {size}")
            if size == 0:
                return None
            return mmap.mmap(fd, 0, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)

    async def read_ranges(self, ranges: Sequence[Range], into: np.ndarray, advise: bool = False) -> list[int | None]:
        spans = []
        at = 0
        for h, a, b in ranges:
            assert isinstance(h, LocalHandle)
            asked = -a if a < 0 else b - a
            if a < 0:
                a, b = max(0, h.size + a), h.size
            spans.append((h.fd, a, b, at))
            at += asked
        if advise and len(spans) > 1:  # every range asked for before any is read
            for fd, a, b, _ in spans:
                _advise(fd, a, b - a)
        view = memoryview(into.reshape(-1))
        return [os.preadv(fd, [view[at : at + b - a]], a) for fd, a, b, at in spans]
