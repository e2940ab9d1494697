"""File-system helpers for what mmreplay writes outside a store's own files: outputs made
under a scratch name and renamed into place, target checks, folders made and removed.

Files inside a store's folder are opened under the rules of :mod:`mmreplay.io.local`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import NoReturn

from .errors import BufferExistsError, DiskFullError, Error, ReadOnlyError, TargetError
from .io.local import NO_FOLLOW

__all__ = [
    "AtomicOutput",
    "atomic_write",
    "check_target",
    "disk_usage",
    "folders_for",
    "interrupts_deferred",
    "make_folders",
    "named_error",
    "raise_named",
    "remove_dead_scratch",
    "remove_folders",
    "scratch_path",
]

def disk_usage(path: str | os.PathLike) -> int:
    """Bytes of a file, or of every file under a folder (apparent sizes; links not followed)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # removed while walking
                total += os.lstat(os.path.join(root, name)).st_size
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
    try:
        known = recognise(out)
    except Exception:  # noqa: BLE001 - whatever cannot be read is not an earlier export
        known = False
    if not known:  # said first, so that no message asks for a --force that would not help
        raise TargetError(
            f"{out}: exists and is not an earlier {what}; refusing to replace it even with --force"
        )
    if not force:
        raise TargetError(f"{out}: already exists; pass --force (force=True) to replace an earlier {what}")
    return out


def atomic_write(path: str, data: bytes, fsync: bool = False) -> None:
    """Replace ``path`` with ``data`` so a reader or a crash sees the old or the new file.

    The temporary file lives in the same folder (``os.replace`` is atomic only within a
    file system). With ``fsync`` the file and the folder entry reach the disk too.
    """
    folder = os.path.dirname(path) or "."
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(OSError):  # a dead process's (or a link placed there: never written through)
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"{path}: no space left on the file system to write it; the previous one is intact") from exc
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


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
        remove_folders(made)
        raise
    return made


def rename_made(tmp: str, path: str, what: str) -> None:
    """Rename the scratch folder ``tmp``, made whole, to ``path`` (onto an empty folder
    too): of processes making the same ``what`` at once, the first wins and the others get
    a :class:`BufferExistsError`."""
    try:
        os.rename(tmp, path)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise BufferExistsError(
            f"{path}: another process created a {what} there meanwhile; pass exist_ok=True to open it"
        ) from None


def remove_folders(made: list[str]) -> None:
    """Remove the folders :func:`make_folders` made, innermost first (those that are
    not empty any more stay)."""
    for folder in reversed(made):
        with contextlib.suppress(OSError):
            os.rmdir(folder)


@contextlib.contextmanager
def folders_for(out: str) -> Iterator[None]:
    """The missing folders of the file ``out``, made for the block and removed again if
    it fails (for writers that pick the output's type by its name, so cannot write it
    under :class:`AtomicOutput`'s scratch name)."""
    made = make_folders(os.path.dirname(os.path.abspath(out)))
    try:
        yield
    except BaseException:
        remove_folders(made)
        raise


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


def _no_room(exc: BaseException) -> str | None:
    """Why there is no room for the write, when ``exc`` says so: a full file system or a
    file size limit (libraries that write through their own code, as torch and pyarrow
    do, say it only in their message); None otherwise."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code in (errno.ENOSPC, errno.EDQUOT) or os.strerror(errno.ENOSPC) in str(exc):
        return "no space left on the file system"
    if code == errno.EFBIG or os.strerror(errno.EFBIG) in str(exc):
        return "a file reached the size limit (ulimit -f, or the file system's largest file)"
    return None


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
        what: the output, for messages (``"npz export"``). Missing parent folders are
            made (and removed again if the output fails).
    """

    def __init__(self, out: str, kind: str, what: str):
        self.out = os.path.abspath(out)
        self.kind = kind
        self.what = what
        self.tmp = scratch_path(self.out, "partial")
        self.made: list[str] = []
        self.committed = False

    def __enter__(self) -> AtomicOutput:
        parent = os.path.dirname(self.out)
        try:
            with interrupts_deferred():  # (the block's exit is not registered yet)
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
            raise_named(exc, self.out, self.what, self.tmp)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.committed:
            return
        self.abort()
        if exc is not None:
            named = named_error(exc, self.out, self.what, self.tmp)
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
                raise_named(exc, self.out, self.what, self.tmp)
            self.committed = True
        return self.out

    def abort(self) -> None:
        """Remove the scratch output and the parent folders made for it."""
        with interrupts_deferred():
            remove_tree(self.tmp)
            remove_folders(self.made)


def raise_named(exc: BaseException, out: str, what: str, tmp: str) -> NoReturn:
    """Raise :func:`named_error` of ``exc``: ``exc`` itself where it is neither."""
    named = named_error(exc, out, what, tmp)
    if named is exc:
        raise exc
    raise named from exc


def named_error(exc: BaseException, out: str, what: str, tmp: str) -> BaseException:
    """``exc`` told about ``out`` (the scratch name ``tmp`` means nothing to the user): a
    full disk is a :class:`DiskFullError`, a read-only or forbidden place a
    :class:`ReadOnlyError`; what is neither comes back as it is."""
    if not isinstance(exc, Exception):
        return exc
    if isinstance(exc, Error):  # already says what happened, maybe where in the scratch
        if len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (exc.args[0].replace(tmp, out),)
        return exc
    reason = _no_room(exc)
    if reason is not None:
        return DiskFullError(f"{out}: {reason}; the {what} stopped and left nothing behind")
    if not isinstance(exc, OSError):
        return exc
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno == errno.EROFS or isinstance(exc, PermissionError):
        return ReadOnlyError(f"{out}: cannot write the {what} there ({reason})")
    if tmp in str(exc) or exc.filename == tmp:
        return type(exc)(f"{out}: {reason} (writing the {what})")
    return exc
