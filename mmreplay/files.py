"""Small file-system helpers shared by the library and the command line."""

from __future__ import annotations

import errno
import os

from .errors import DiskFullError

__all__ = ["disk_usage", "atomic_write"]


def disk_usage(path: str | os.PathLike) -> int:
    """Bytes of a file, or of every file under a folder (apparent sizes; links not followed)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed while walking
    return total


def atomic_write(path: str, data: bytes, fsync: bool = False) -> None:
    """Replace ``path`` with ``data`` so a reader or a crash sees the old or the new file.

    The temporary file lives in the same folder (``os.replace`` is atomic only within a
    file system). With ``fsync`` the file and the folder entry reach the disk too.
    """
    folder = os.path.dirname(path) or "."
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException as exc:
        os.close(fd)
        _unlink_quietly(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"{path}: no space left on the file system to write it; the previous one is intact") from exc
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if fsync:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
