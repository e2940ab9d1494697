"""Small file-system helpers shared by the library and the command line.

Every file mmreplay opens inside a buffer's folder is opened here (:func:`open_inside`
and the helpers built on it), because a buffer may come from anyone: a file of its
folder must be a regular file reached from the folder through real folders, never
through a symbolic link, and never a FIFO, a socket or a device. Anything else is
refused with a :class:`CorruptBufferError` naming it, before a byte is read or written.
The folder itself, as the caller names it, may be a link (run folders often are).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import stat
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType

from .errors import CorruptBufferError, DiskFullError, Error, ReadOnlyError, TargetError

__all__ = [
    "AtomicOutput",
    "atomic_write",
    "check_target",
    "checked_inside",
    "disk_usage",
    "folder_inside",
    "interrupts_deferred",
    "make_folders",
    "open_inside",
    "read_inside",
    "remove_dead_scratch",
    "replace_inside",
    "scratch_path",
    "unsafe_entries",
]

_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW


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


def _walk(folder: str, parts: list[str], create: bool) -> int:
    """A descriptor of the folder ``folder/parts...``, each part entered without
    following links (``create``: making the missing ones)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
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
    path = os.path.join(folder, *parts)
    writing = bool(flags & (os.O_WRONLY | os.O_RDWR))
    dfd = _walk(folder, parts[:-1], bool(flags & os.O_CREAT))
    try:
        try:
            _check_entry(os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False), path, writing)
        except FileNotFoundError:
            if not flags & os.O_CREAT:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
        try:  # (non-blocking: what was checked may have been swapped for a FIFO since)
            fd = os.open(parts[-1], flags | _NO_FOLLOW | os.O_NONBLOCK, mode, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):
                raise _refuse(path, "a symbolic link" if exc.errno == errno.ELOOP else "not a regular file") from None
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
    fd = open_inside(folder, rel)
    try:
        size = os.fstat(fd).st_size
        if size <= limit:
            parts, total = [], 0
            while total <= limit:  # (a file that grew since fstat is read on, up to the limit)
                part = os.read(fd, min(limit + 1 - total, max(size + 1 - total, 1 << 16)))
                if not part:
                    return b"".join(parts)
                parts.append(part)
                total += len(part)
            size = total
        path = os.path.join(os.fspath(folder), *rel.split("/"))
        raise CorruptBufferError(f"{path}: {size} bytes, larger than {what} can be (at most {limit})")
    finally:
        os.close(fd)


def folder_inside(folder: str | os.PathLike, rel: str) -> str:
    """``folder/rel`` once it is a folder reached without links."""
    os.close(_walk(os.fspath(folder), rel.split("/"), False))
    return os.path.join(os.fspath(folder), *rel.split("/"))


def checked_inside(folder: str | os.PathLike, rel: str) -> str:
    """``folder/rel`` once it is a regular file reached without links: for a library
    that opens files by name (h5py)."""
    os.close(open_inside(folder, rel))
    return os.path.join(os.fspath(folder), *rel.split("/"))


def replace_inside(folder: str | os.PathLike, rel: str, data: bytes | memoryview, exclusive: bool = False) -> None:
    """Write ``folder/rel`` whole by a new file renamed over it (``exclusive``: only
    where nothing is yet), making missing folders; no link is followed on the way."""
    parts = rel.split("/")
    dfd = _walk(os.fspath(folder), parts[:-1], True)
    try:
        tmp = f"{parts[-1]}.{uuid.uuid4().hex}.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o644, dir_fd=dfd)
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
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
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
    _unlink_quietly(tmp)  # a dead process's (or a link placed there: never written through)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o644)
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


# --- outputs made under a scratch name ------------------------------------------------------

#: what a run leaves beside its output while it works: ``.NAME.partial-PID`` (an export,
#: a convert, an import), ``.NAME.creating-PID`` (a store being made), ``.NAME.replaced-PID``
#: (the earlier output while the new one is renamed into place)
SCRATCH_KINDS = ("partial", "creating", "replaced")


def scratch_path(out: str, kind: str) -> str:
    """The name this process works under beside ``out`` (``kind`` from :data:`SCRATCH_KINDS`)."""
    parent, base = os.path.split(os.path.abspath(out))
    return os.path.join(parent, f".{base}.{kind}-{os.getpid()}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_dead_scratch(out: str) -> list[str]:
    """Remove what runs that were killed left beside ``out`` (their scratch names, see
    :data:`SCRATCH_KINDS`), and nothing of a process that is still running. An earlier
    output that a killed run had moved aside is put back when ``out`` is missing.
    Returns what was done, a line each."""
    out = os.path.abspath(out)
    parent, base = os.path.split(out)
    pattern = re.compile(re.escape(f".{base}.") + rf"({'|'.join(SCRATCH_KINDS)})-(\d+)")
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    done = []
    for name in sorted(names):
        found = pattern.fullmatch(name)
        if found is None or _alive(int(found.group(2))):
            continue
        path = os.path.join(parent, name)
        done += remove_dead_scratch(path)  # a store a killed convert was creating in its scratch
        if found.group(1) == "replaced" and not os.path.lexists(out):
            os.rename(path, out)
            done.append(f"put back {out} (process {found.group(2)} had moved it aside)")
        else:
            remove_tree(path)
            done.append(f"removed {path} (left by process {found.group(2)}, which is gone)")
    return done


def remove_tree(path: str) -> None:
    """Remove a file or a folder with what it holds (a link itself, not what it names)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def make_folders(folder: str) -> list[str]:
    """Create ``folder`` and its missing parents; returns those created, outermost first."""
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise NotADirectoryError(f"{folder}: expected a folder, found a file")
    made: list[str] = []
    try:
        for folder in reversed(missing):
            try:
                os.mkdir(folder)
            except FileExistsError:  # another process made it meanwhile: not ours to remove
                continue
            made.append(folder)
    except BaseException:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise
    return made


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the block ends, so that a few renames or removals
    happen whole. Only the main thread sets signal handlers; elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # ignored, or the default action: nothing to hold back
        yield
        return
    caught: list[object] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(signal.SIGINT, caught[0])


def _disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the file system is full (libraries that write through their
    own code, as torch and pyarrow do, say it only in their message)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return os.strerror(errno.ENOSPC) in str(exc)


class AtomicOutput:
    """A file or folder made under a scratch name beside ``out`` (``.NAME.partial-PID``)
    and renamed into place once complete, so an interrupted run never leaves a file that
    looks finished. Entering the context makes the scratch (after removing what killed
    runs left beside ``out``); call :meth:`commit` at the end of the block; leaving the
    block any other way (an error, Ctrl-C) removes the scratch and the parent folders made.

    An error of the file system names ``out``, not the scratch name: a full disk is a
    :class:`DiskFullError`, a read-only or forbidden place a :class:`ReadOnlyError`.

    Args:
        out: the final path; an existing one is replaced at :meth:`commit`.
        kind: ``"file"`` (the scratch file is created empty) or ``"folder"``.
        what: the output, for messages (``"npz export"``).
        parents: create missing parent folders (removed again if the output fails).
    """

    def __init__(self, out: str, kind: str, what: str, parents: bool = False):
        self.out = os.path.abspath(out)
        self.kind = kind
        self.what = what
        self.parents = parents
        self.tmp = scratch_path(self.out, "partial")
        self.made: list[str] = []
        self.committed = False

    def __enter__(self) -> AtomicOutput:
        parent = os.path.dirname(self.out)
        try:
            with interrupts_deferred():  # (the block's exit is not registered yet)
                if self.parents:
                    self.made = make_folders(parent)
                if not os.path.isdir(parent):
                    raise FileNotFoundError(f"{parent}: folder does not exist (where the {self.what} goes)")
                remove_dead_scratch(self.out)
                remove_tree(self.tmp)
                if self.kind == "folder":
                    os.mkdir(self.tmp)
                else:
                    os.close(os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except BaseException as exc:
            self.abort()
            named = self.named(exc)
            if named is exc:
                raise
            raise named from exc
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.committed:
            return
        self.abort()
        if exc is not None:
            named = self.named(exc)
            if named is not exc:
                raise named from exc

    def commit(self) -> str:
        """Move the finished output into place (replacing an earlier one); returns its path."""
        with interrupts_deferred():
            try:
                if os.path.lexists(self.out):
                    old = scratch_path(self.out, "replaced")
                    os.rename(self.out, old)
                    try:
                        os.rename(self.tmp, self.out)
                    except BaseException:
                        os.rename(old, self.out)
                        raise
                    remove_tree(old)
                else:
                    os.rename(self.tmp, self.out)
            except OSError as exc:
                named = self.named(exc)
                if named is exc:
                    raise
                raise named from exc
            self.committed = True
        return self.out

    def abort(self) -> None:
        """Remove the scratch output and the parent folders made for it."""
        with interrupts_deferred():
            remove_tree(self.tmp)
            for folder in reversed(self.made):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)

    def named(self, exc: BaseException) -> BaseException:
        """``exc`` told about ``out`` (the scratch name means nothing to the user)."""
        if isinstance(exc, Error) or not isinstance(exc, Exception):
            return exc
        if _disk_full(exc):
            return DiskFullError(
                f"{self.out}: no space left on the file system; the {self.what} stopped and left nothing behind"
            )
        if not isinstance(exc, OSError):
            return exc
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        if exc.errno == errno.EROFS or isinstance(exc, PermissionError):
            return ReadOnlyError(f"{self.out}: cannot write the {self.what} there ({reason})")
        if self.tmp in str(exc) or exc.filename == self.tmp:
            return type(exc)(f"{self.out}: {reason} (writing the {self.what})")
        return exc
