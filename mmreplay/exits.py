"""How the writers still open end with the program: they commit what they added, and
never a step that was not wholly written.

What each ending of a program keeps is said once, in docs/reliability.md. Here:

- Each writer registers a ``weakref.finalize`` that holds the store's parts, not the
  store, so the store can still be garbage-collected (and is then closed); ``close()``
  unregisters it (:func:`closing`).
- When the program ends (normally, by an uncaught exception, Ctrl-C, or a stop signal)
  the finalizers run from a hook the interpreter calls before it stops its thread pools
  (zarr's codecs need them to write a compressed chunk), or from ``atexit`` when a
  non-daemon thread of the program may still be writing (after the interpreter has waited
  for it). A daemon thread may still be writing then: the hook lets no write of that
  store start and waits for the one under way (:data:`WRITER_WAIT` seconds at most), so
  the commit covers whole steps only; it waits as well for a writer such a thread is
  opening (:func:`opening`), and a ``close()`` from that thread waits for the hook's.
- SIGTERM and SIGHUP (what ``kill``, docker, Kubernetes and Slurm send to stop a
  program, and a closed terminal) end the program as Ctrl-C does while a writer is open:
  an exception in the main thread (``SystemExit(128 + signal)``), so ``finally`` blocks
  run and then the exit hooks commit. Only where the program left the signal at its
  default action, set from the main thread; the program's own handlers are never
  replaced, and the default comes back when the last writer closes: after its last
  commit, so that a stop signal never cuts that commit short. One that lands while the
  main thread closes a writer waits for the commit (:func:`closing`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from .errors import ClosedError, Error

__all__ = ["WRITER_WAIT", "STOP_SIGNALS", "close_when_dropped", "closing", "opening", "open_writers"]

log = logging.getLogger("mmreplay.store")

#: seconds the exit hook waits for a write under way in another thread before it gives
#: up on that store (it then commits nothing more: never a half-written step)
WRITER_WAIT = 60.0
#: signals that ask a program to stop, handled as Ctrl-C while a writer is open
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

#: finalizers of the writers not closed yet; each holds its store's parts, not the store
_open_writers: set[weakref.finalize] = set()
_atexit_registered = False
_exiting = False  # the exit hooks are closing the writers
_closing = 0  # writers the main thread is closing: a stop signal waits for their commit
_deferred: int | None = None  # the stop signal that landed meanwhile
_collecting = False  # the main thread closes a dropped writer, in its finalizer
_opening: list[object] = []  # a token per writer being opened (exits.opening): the exit hooks wait for it


def open_writers() -> int:
    """Writers of this process not closed yet."""
    return len(_open_writers)


def close_when_dropped(store: object, at_exit: bool) -> weakref.finalize:
    """Close a store that is garbage-collected, and (``at_exit``: a writer, which must
    commit) one still open when the program ends.

    The finalizer holds the store's attributes, not the store: at its call a bare store
    over the same attributes runs ``close()``. Nothing among the attributes may refer back
    to the store, or it would never be collected.
    """
    finalizer = weakref.finalize(store, _close_parts, type(store), store.__dict__)
    finalizer.atexit = False  # writers: the exit hooks below run it, in their order
    if at_exit:
        _open_writers.add(finalizer)
        _register_exit_hooks()
        _swap_stop_handlers(signal.SIG_DFL, _stop)
    return finalizer


@contextlib.contextmanager
def opening(path: str, lock: Any) -> Iterator[None]:
    """A writer being opened (its files, until its finalizer is registered): the exit
    hooks wait for it, then close it. One a daemon thread starts once the program is
    ending is refused (releasing ``lock``): its open must not go on into the file
    libraries past the program's end, where h5py's own exit hook tears its state down
    under it. The interpreter waits for the other threads before that, so theirs open."""
    token = object()
    _opening.append(token)
    try:
        ending = not _register_exit_hooks() or _exiting
        if ending and threading.current_thread().daemon:
            if lock is not None:
                lock.release()
            raise ClosedError(
                f"{path}: the program is ending, and no store opens for writing now; a thread that writes "
                "must be joined before the program ends"
            )
        yield
    finally:
        _opening.remove(token)


@contextlib.contextmanager
def closing(finalizer: weakref.finalize) -> Iterator[None]:
    """A store closes (its commit and release run inside): its finalizer will not run.

    A writer's stop signals stay handled until it is closed, and go back to their default
    action once no writer is open. A stop signal that lands while the main thread closes a
    writer lets the commit finish, then ends the program as it would have a moment later:
    by ``SystemExit`` from ``close()``; by the signal's default action from a collection
    (whose exceptions Python ignores); not at all from the exit hooks (the program is
    ending already).
    """
    global _closing
    waits = threading.current_thread() is threading.main_thread() and finalizer in _open_writers
    _closing += waits  # first: a signal before it ends the program with the writer still open
    try:
        finalizer.detach()
        yield
    finally:
        _open_writers.discard(finalizer)
        if not _open_writers:
            _swap_stop_handlers(_stop, signal.SIG_DFL)
        _closing -= waits  # last: a signal handled before this still waits for the check below
        if waits and not _closing and not _collecting:
            _end_if_stopped(collected=False)


def _end_if_stopped(collected: bool) -> None:
    """End the program for the stop signal that waited for a close, if one did."""
    global _deferred
    if _deferred is None or _exiting:
        return
    signum, _deferred = _deferred, None
    if collected:
        os.kill(os.getpid(), signum)
    else:
        raise SystemExit(128 + signum)


def _close_parts(cls: type, parts: dict[str, Any]) -> None:
    global _collecting
    shell = cls.__new__(cls)
    shell.__dict__ = parts
    main = threading.current_thread() is threading.main_thread()
    collecting, _collecting = _collecting, main and not _exiting
    try:
        shell.close()
    except Exception as exc:
        log.error(
            "%s: closing the store left open failed (%s); steps added since its last commit are lost",
            parts.get("path"),
            exc,
            exc_info=not isinstance(exc, Error),  # an Error says what happened (a full disk...)
        )
    finally:
        _collecting = collecting
        if main and not collecting and not _closing:
            _end_if_stopped(collected=True)


def _close_open_writers(before_threads_end: bool = False) -> None:
    """Close every writer still open as the program ends.

    The first call comes before the interpreter stops its thread pools; it leaves the
    writers to the ``atexit`` call when a non-daemon thread of the program is still
    running (and may still be writing): the interpreter waits for those in between.
    """
    global _exiting
    if before_threads_end and any(
        t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()
    ):
        return
    _exiting = True
    deadline = time.monotonic() + WRITER_WAIT
    while _opening and time.monotonic() < deadline:  # a writer another thread is opening
        time.sleep(0.001)
    for finalizer in list(_open_writers):
        got = finalizer.peek()
        if got is None:
            continue
        parts = got[2][1]  # (store, _close_parts, (cls, parts), {})
        if not _stop_writes(parts, WRITER_WAIT):
            log.error(
                "%s: a thread was still writing to the store %.0f s after the program ended; it is not "
                "committed again, and the steps added since its last commit are lost (join the thread, or "
                "close the store, before the program ends)",
                parts.get("path"),
                WRITER_WAIT,
            )
            continue
        finalizer()


def _stop_writes(parts: dict[str, Any], timeout: float) -> bool:
    """Let no write of this store start, and wait for the one under way in another thread;
    False if it is still under way after ``timeout`` seconds.

    A writer marks itself busy before it checks that it may write (``Store.add_leaves``),
    and this marks it not writable before it checks that it is not busy: the interpreter
    runs one thread at a time, so one of the two sees the other's mark.
    """
    parts["_exiting"] = True
    parts["_writable"] = False
    deadline = time.monotonic() + timeout
    while parts.get("_busy"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def _forget_writers_in_child() -> None:
    """A forked child (multiprocessing's fork, ``os.fork``) holds copies of its parent's
    writers, a snapshot of their cursors over the parent's files: a commit from it would
    write that older state over the parent's newer commits. Its copies are left
    unwritable, and neither its exit hooks nor a collection nor ``close()`` commit them."""
    for finalizer in list(_open_writers):
        got = finalizer.detach()
        if got is not None:
            parts = got[2][1]  # (store, _close_parts, (cls, parts), {})
            parts["_writable"] = False
            parts["_forked"] = True
    _open_writers.clear()
    _opening.clear()  # (opens under way in the parent's other threads)


os.register_at_fork(after_in_child=_forget_writers_in_child)


def _register_exit_hooks() -> bool:
    """Register the exit hooks; False if the interpreter is already exiting (too late
    for the early one). Exit hooks run last registered first, and the early one
    must run before the thread pools stop: it is registered again whenever a library
    imported since (``concurrent.futures`` with zarr) registered its own after it."""
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_close_open_writers)
        _atexit_registered = True
    early = getattr(threading, "_threading_atexits", None)
    if early is not None and not (early and getattr(early[-1], "func", None) is _close_before_threads_end):
        try:
            threading._register_atexit(_close_before_threads_end)  # type: ignore[attr-defined]
        except RuntimeError:  # the interpreter is already exiting
            return False
    return True


def _close_before_threads_end() -> None:
    _close_open_writers(before_threads_end=True)


# --- the stop signals ---------------------------------------------------------------------


def _swap_stop_handlers(old: Any, new: Any) -> None:
    """Set ``new`` for each stop signal whose handler is ``old``: a writer handles SIGTERM
    and SIGHUP as Ctrl-C only where the program left them at their default action, and
    gives them back the default as the last writer closes. From the main thread (the only
    one that may; elsewhere :func:`_stop` acts as the default once no writer is open)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) is old:
                signal.signal(sig, new)


def _stop(signum: int, frame: Any) -> None:
    """SIGTERM / SIGHUP: end the program by ``SystemExit(128 + signum)`` (the status a
    shell reports for a program that signal ended), so the writers commit on the way
    out; once the commit under way finishes if the main thread is closing a writer. A
    second one ends it at once, by the default action."""
    global _deferred
    signal.signal(signum, signal.SIG_DFL)
    if not _open_writers:  # nothing to commit: what the default action would have done
        os.kill(os.getpid(), signum)
        return
    if _exiting:  # the program is ending already, and committing
        return
    log.warning(
        "%s: ending the program; %d open store(s) commit first",
        signal.Signals(signum).name,
        len(_open_writers),
    )
    if _closing or _in_collection(frame):
        _deferred = signum
        return
    raise SystemExit(128 + signum)


_FINALIZER_CALL = weakref.finalize.__call__.__code__


def _in_collection(frame: Any) -> bool:
    """Whether the main thread was stopped inside the close of a dropped writer, which
    Python runs in a finalizer and whose exceptions it ignores: one raised there would
    lose both the close and the signal."""
    while frame is not None:
        code = frame.f_code
        if code is _close_parts.__code__ or (code is _FINALIZER_CALL and frame.f_locals.get("self") in _open_writers):
            return True
        frame = frame.f_back
    return False
