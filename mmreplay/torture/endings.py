"""How each ending reaches a writer: a signal aimed at a moment the writer announces, a
full tmpfs, or a thread left writing; and what the harness learns from the writer's
reports of one run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .checks import Expectation
from .layouts import TrialConfig
from .report import Summary, TortureFailure
from .writer import WriterServer

SIGNALS = {"kill": signal.SIGKILL, "sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
#: the exit status of a writer the signal ended as Python ends a program (an uncaught
#: KeyboardInterrupt, the stop signals' SystemExit): besides 0, when the signal lands
#: after the writer's last report
ENDED_BY = {"sigint": -signal.SIGINT, "sigterm": 128 + signal.SIGTERM}
REPORT_TIMEOUT = 120.0  # seconds without a word from a writer before it counts as hung
#: the tmpfs the ``enospc`` ending fills (its trials' buffers live on it)
TMPFS_BYTES = 256 << 20
#: free bytes left on it for an ``enospc`` run, at most
ENOSPC_ROOM = 96 << 10


@dataclass
class _Run:
    """What the harness saw of one writer run."""

    pid: int = 0
    opened: bool = False
    signalled: bool = False
    closing: bool = False  # the writer began closing before the signal came
    closed: bool = False  # the writer began closing, before or after the signal
    added: int = 0  # steps added when the writer began closing
    done_before: int = 0  # every step before this one was added (the newest op's start)
    status: int | None = None
    error: str | None = None


def run_writer(
    server: WriterServer,
    path: str,
    config: TrialConfig,
    exp: Expectation,
    rng: np.random.Generator,
    target: str | None,
    out: Summary,
    ending: str = "kill",
    filler: str | None = None,
) -> tuple[bool, str | None]:
    """One writer run, ended by ``ending`` (a signal at ``target``; None: let it finish and
    close). Returns (killed by SIGKILL, the moment the signal was aimed at)."""
    run_steps = int(rng.integers(config.capacity // 2, 4 * config.capacity + 2))
    layout = config.layout
    options: dict[str, Any] = {"ending": ending, "layout": layout.__dict__}
    if ending in ("sigint", "sigterm"):
        options["keep"] = str(rng.choice(["finally", "exit", "drop"]))
    elif ending == "enospc":
        options.update(after=str(rng.choice(["close", "retry", "exit"])), filler=filler)
    elif ending == "thread":
        options.update(daemon=bool(rng.random() < 0.6), main_for=float(rng.uniform(0, 0.02)))
    server.start(path, int(rng.integers(1 << 62)), run_steps, **options)
    send_signal = SIGNALS.get(ending) if target else None
    flag = {"commit": "c", "chunk": "k", "wrap": "w"}.get(target or "")
    on_write = target not in (None, "time", "end", "committed")  # a signal set off by an announced write
    count = int(rng.integers(1, 40 if target == "op" else 6)) if target else 0
    delay = float(rng.uniform(0, 0.002 if target != "time" else 0.03))
    aimed: str | None = None
    seen = _Run()
    how = f"ending {ending}" + (f", signal at {target}" if target else "") + (
        f", store kept for {options['keep']}" if "keep" in options else ""
    )

    def signal_now() -> None:
        nonlocal aimed
        _sleep(delay)
        _kill(seen.pid, send_signal)
        aimed, seen.signalled = target, True

    while True:
        msg = server.line(REPORT_TIMEOUT)
        if msg is None:
            if seen.pid:
                _kill(seen.pid, signal.SIGABRT)  # its faulthandler prints every thread's stack
                time.sleep(1)
                _kill(seen.pid, signal.SIGKILL)
            raise TortureFailure(
                f"the writer said nothing for {REPORT_TIMEOUT:.0f} s (hung; {how}); its stderr ends:\n{server.log_tail()}"
            )
        kind, _, rest = msg.partition(" ")
        if kind == "S":
            seen.pid = int(rest)
            if target == "time":
                signal_now()
        elif kind == "O":
            g, committed = map(int, rest.split())
            if not seen.opened and (g != exp.checked_end or committed != exp.checked_end):
                seen.error = (
                    f"(d) the next writer resumed at step {g} (committed {committed}), "
                    f"expected the committed cursor {exp.checked_end}"
                )
                _kill(seen.pid, signal.SIGKILL)
            seen.opened = True
            exp.announced = max(exp.announced, g)
            seen.done_before = g
        elif kind == "W":
            g, n, flags = rest.split()
            exp.announced = max(exp.announced, int(g) + int(n))
            if not seen.signalled:
                seen.done_before = int(g)
            if aimed is None and on_write and (flag is None or flag in flags):
                count -= 1
                if count == 0:
                    signal_now()
        elif kind in ("C", "D"):
            exp.reported = max(exp.reported, int(rest))
            if kind == "C" and target == "committed" and aimed is None:
                count -= 1
                if count == 0:
                    signal_now()
        elif kind == "Z":
            seen.closing = seen.closing or not seen.signalled
            seen.closed, seen.added = True, int(rest)
            if target == "end" and aimed is None:
                signal_now()
        elif kind == "F":
            message = rest.partition(" ")[2]
            if ending == "enospc":
                out.enospc_at[_where_refused(json.loads(message))] += 1
        elif kind == "L":
            out.warnings.append(json.loads(rest))
            exp.dropped_early = exp.dropped_early or "side ring of next frames" in out.warnings[-1]
        elif kind == "E":
            seen.error = f"the writer raised:\n{json.loads(rest)}"
        elif kind == "X":
            seen.status = int(rest.split()[1])
            break
    if seen.error is not None:
        raise TortureFailure(seen.error)
    killed = seen.status == -signal.SIGKILL
    if seen.status not in (0, ENDED_BY.get(ending)) and not killed:
        # SIGTERM before the store handled it, or once it began to close (when close(),
        # a collection or the exit hooks are done, the default action is back)
        if not (seen.status == -signal.SIGTERM and ending == "sigterm" and (not seen.opened or seen.closed)):
            raise TortureFailure(
                f"the writer exited with status {seen.status} ({how}); its stderr ends:\n{server.log_tail()}"
            )
    if ending in ("sigint", "sigterm") and seen.opened and seen.signalled and not seen.closing and not killed:
        exp.reported = max(exp.reported, seen.done_before)  # Ctrl-C and SIGTERM lose no added step
    if ending == "sigterm" and seen.closed and not killed:
        exp.reported = max(exp.reported, seen.added)  # nor does SIGTERM as the store closes
    return killed and ending == "kill", aimed


#: where a full disk refused a write, by words of the DiskFullError's message
_REFUSED_AT = (
    ("episode ends", "episode index (append)"),
    ("episodes.idx", "episode index (rewrite)"),
    ("journal", "HDF5 chunk journal"),
    ("segment", "row-frame segment"),
    ("for a flush", "chunk at a commit"),
    ("for chunk", "chunk the head left"),
    ("compressed chunks", "HDF5 chunks at a commit"),
    ("extend", "HDF5 file end at open"),
)


def _where_refused(message: str) -> str:
    """Where a full disk refused a write, in a few words, from the error's message."""
    return next((label for words, label in _REFUSED_AT if words in message), message[:60])


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _sleep(seconds: float) -> None:
    """Spin for sub-millisecond delays (sleep would round them up)."""
    end = time.perf_counter() + seconds
    if seconds > 0.001:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < end:
        pass


def fill(folder: str, room: int) -> str:
    """Fill the file system of ``folder`` but ``room`` bytes; returns the filler's path."""
    filler = os.path.join(folder, "filler")
    st = os.statvfs(folder)
    size = max(0, st.f_bavail * st.f_frsize - room)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return filler


def mount_tmpfs(folder: str, size: int = TMPFS_BYTES) -> str | None:
    """Mount a tmpfs of ``size`` bytes on ``folder`` (made if missing); None once mounted,
    else why it cannot be here (it needs root, or CAP_SYS_ADMIN)."""
    os.makedirs(folder, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder], capture_output=True, text=True
    )
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited with {done.returncode}")


def unmount(folder: str) -> None:
    subprocess.run(["umount", "-l", folder], capture_output=True)
