"""Small file-system helpers shared by the library and the command line."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable

from .errors import DiskFullError, TargetError

__all__ = ["atomic_write", "check_target", "disk_usage"]


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


def _within(path: str, folder: str) -> bool:
    return path == folder or os.path.commonpath([path, folder]) == folder


def check_target(
    out: str | os.PathLike,
    sources: Iterable[str | os.PathLike],
    *,
    what: str,
    force: bool = False,
    recognise: Callable[[str], bool] | None = None,
) -> str:
    """The absolute path of a target an export, convert or import may write, or an error.

    A target is refused when it is one of ``sources``, lies inside one, or holds one
    (real paths: symbolic links are followed, so a link into a source is refused too).
    An existing target is refused unless ``force`` is set and ``recognise(out)`` says it
    is an earlier output of the same kind (``what``); with no ``recognise``, nothing that
    exists is replaced. The check only reads, so a refusal changes nothing on disk.
    """
    out = os.path.abspath(os.fspath(out))
    real = os.path.realpath(out)
    for src in sources:
        src_real = os.path.realpath(os.fspath(src))
        if _within(real, src_real):
            where = "is" if real == src_real else "lies inside"
            raise TargetError(f"{out}: {where} the source {os.fspath(src)}; write the {what} elsewhere")
        if _within(src_real, real):
            raise TargetError(f"{out}: holds the source {os.fspath(src)}; write the {what} elsewhere")
    if not os.path.lexists(out):
        return out
    if recognise is None:
        raise TargetError(f"{out}: already exists; choose a new path for the {what}")
    if not force:
        raise TargetError(f"{out}: already exists; pass --force (force=True) to replace an earlier {what}")
    try:
        known = recognise(out)
    except Exception:  # noqa: BLE001 - whatever cannot be read is not an earlier export
        known = False
    if not known:
        raise TargetError(
            f"{out}: exists and is not an earlier {what}; refusing to replace it even with --force"
        )
    return out


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
