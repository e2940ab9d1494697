"""Crash torture: end writers at random moments, in every way a program ends, and check
that nothing committed is lost and nothing unwritten is committed.

A writer process collects into a store where every row is a deterministic function of its
global step id and env (:func:`step_values`; :func:`frame_values` for a store that keeps
each frame once), and reports on a pipe each operation it is about to do and each commit
it has completed. Each writer run ends one way (:data:`ENDINGS`):

- ``kill``: SIGKILL at a random time, or just as it starts a commit, a chunk write of a
  compressed leaf, the write that wraps the ring, or the store's close, or just after a
  commit (row frames go on encoding the rows it made durable, and storing a segment's
  shard, in the background);
- ``sigint`` / ``sigterm``: Ctrl-C or SIGTERM at the same moments; the writer closes the
  store in a ``finally``, leaves it to the exit hooks, or drops it (garbage collection);
- ``enospc``: its file system (a small tmpfs) fills up at whatever write comes next; the
  writer closes, frees the space and goes on, or leaves the store to the exit hooks;
- ``thread``: a thread of the writer collects while its main thread returns (a daemon
  thread, or one the interpreter waits for).

Then the harness reopens the store and checks that

(a) it opens;
(b) every step up to the last reported commit is there and bit-exact, unless the ring
    legitimately reused its slot (the writer may reserve ``_ahead`` steps past what it
    announced); after Ctrl-C or SIGTERM, every step the writer finished adding is
    committed (after SIGTERM also when it landed as the store closed: the closing commit
    is never cut short by it);
(c) no row past the committed cursor is visible, and the committed cursor never passes
    what the writer announced;
(d) the next writer resumes at the committed cursor, and its ending passes the same checks;
(e) a write refused by a full disk raises :class:`~mmreplay.DiskFullError`, one by a
    program ending :class:`~mmreplay.ClosedError` or :class:`~mmreplay.ShutdownError`.

After each run :func:`mmreplay.verify.verify` checks the files too (sizes, chunks that
decode, the episode index against the role leaves). Each trial is a fresh buffer with a
random layout (backend, compression, ``num_envs``, capacity, chunking, commit cadence)
ended several times, then collected to a clean close and checked once more.

Writers start from a fork server that has imported mmreplay, zarr and h5py once, so a
run costs milliseconds, not an interpreter start; a forked writer ends as a program does
(the interpreter's thread shutdown, then the ``atexit`` hooks).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .spec import ArraySpec, flatten, unflatten

__all__ = [
    "SPEC",
    "FRAMES_SPEC",
    "ENDINGS",
    "Layout",
    "LAYOUTS",
    "TrialConfig",
    "Summary",
    "step_values",
    "frame_values",
    "run",
    "run_trial",
    "check_store",
    "Expectation",
    "TortureFailure",
    "WriterServer",
    "serve",
]

#: the data each torture writer collects: pixels, a state vector, actions and scalars
SPEC = {
    "obs": {"pixels": ArraySpec((6, 6, 3), "uint8"), "state": ArraySpec((5,), "float32")},
    "action": ArraySpec((2,), "int64"),
    "reward": ArraySpec((), "float32"),
    "terminated": ArraySpec((), "bool"),
}

#: frame stacks of 4 and their next stacks, as the Atari wrappers make them, for the
#: layouts that keep each frame once (:func:`frame_values`)
FRAME_STACK = 4
FRAMES_SPEC = {
    "obs": ArraySpec((FRAME_STACK, 6, 6), "uint8"),
    "next_obs": ArraySpec((FRAME_STACK, 6, 6), "uint8"),
    "action": ArraySpec((2,), "int64"),
    "reward": ArraySpec((), "float32"),
    "terminated": ArraySpec((), "bool"),
    "truncated": ArraySpec((), "bool"),
}

#: codec used for compressed layouts, per backend (both need no plugin)
CODECS = {"zarr": "zstd", "hdf5": "gzip"}

#: the moments a signal is aimed at: a random time, an add, a commit, a compressed
#: chunk's write, the ring's wrap, the store's close (``end``), just after a commit
KILL_TARGETS = ("time", "op", "commit", "chunk", "wrap", "end", "committed")
#: how a writer run ends (the module docstring says each)
ENDINGS = ("kill", "sigint", "sigterm", "enospc", "thread")
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


@dataclass(frozen=True)
class Layout:
    """Backend, whether leaves are compressed (with ``codec``, else the backend's default
    in :data:`CODECS`; ``"rows"``: row frames, lz4 or zstd by trial), the number of envs,
    whether the store keeps each frame once (:data:`FRAMES_SPEC`, ``Frames(frame_stack=4)``),
    and its sampler (``"prioritized"`` keeps a priority file)."""

    backend: str
    compressed: bool
    num_envs: int
    codec: str | None = None
    frames: bool = False
    sampler: str | None = None

    def __str__(self) -> str:
        kind = (self.codec or "compressed") if self.compressed else "mapped"
        extra = ("-frames" if self.frames else "") + (f"-{self.sampler}" if self.sampler else "")
        return f"{self.backend}-{kind}-{self.num_envs}env{extra}"

    @property
    def spec(self) -> dict:
        return FRAMES_SPEC if self.frames else SPEC


LAYOUTS = tuple(Layout(b, c, n) for b in ("zarr", "hdf5") for c in (False, True) for n in (1, 8)) + (
    Layout("zarr", True, 3, "rows"),
    Layout("zarr", True, 2, "rows", frames=True),
    Layout("hdf5", False, 2, frames=True),
    Layout("zarr", False, 2, sampler="prioritized"),
)


@dataclass(frozen=True)
class TrialConfig:
    """One buffer's shape and the writer's pace, drawn at random per trial; ``endings``:
    how the ``kills`` writer runs before the last, clean one may end; ``moments``: when
    their signals may land (:data:`KILL_TARGETS`)."""

    layout: Layout
    capacity: int
    chunk_steps: int
    commit_every: int
    durability: str
    compression: Any  # None, a codec, or {leaf path: codec} (only pixels compressed)
    kills: int
    seed: int
    endings: tuple[str, ...] = ("kill",)
    moments: tuple[str, ...] = KILL_TARGETS

    @property
    def ahead(self) -> int:
        """How far past the steps it writes a writer may reserve slots (see Store)."""
        return max(1, min(self.commit_every, self.capacity // 8))

    def describe(self) -> str:
        return (
            f"{self.layout} capacity={self.capacity} chunk_steps={self.chunk_steps} "
            f"commit_every={self.commit_every} compression={self.compression} "
            f"durability={self.durability} seed={self.seed}"
        )


@dataclass
class Summary:
    """What a torture run did and found."""

    trials: int = 0
    kills: int = 0
    failures: int = 0
    writer_runs: int = 0
    steps_checked: int = 0
    kills_by_target: Counter = field(default_factory=Counter)
    trials_by_layout: Counter = field(default_factory=Counter)
    #: writer runs by how they ended (``kill``, ``sigint`` ... and ``clean``)
    runs_by_ending: Counter = field(default_factory=Counter)
    #: (layout, ending) -> writer runs
    runs_by_layout: Counter = field(default_factory=Counter)
    #: where full disks refused a write (the error's words: chunk, segment, episode ends...)
    enospc_at: Counter = field(default_factory=Counter)
    messages: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return f"trials {self.trials}, kills {self.kills}, failures {self.failures}"

    def details(self) -> str:
        targets = ", ".join(f"{k} {v}" for k, v in sorted(self.kills_by_target.items()))
        layouts = ", ".join(f"{k} {v}" for k, v in sorted(self.trials_by_layout.items()))
        endings = ", ".join(f"{k} {v}" for k, v in sorted(self.runs_by_ending.items()))
        text = (
            f"writer runs {self.writer_runs}, steps checked bit-exact {self.steps_checked}, "
            f"{self.seconds:.1f} s\nwriter runs by ending: {endings}\nsignals by moment: {targets}\n"
            f"trials by layout: {layouts}"
        )
        if self.enospc_at:
            text += "\nfull disk at: " + ", ".join(f"{k} {v}" for k, v in sorted(self.enospc_at.items()))
        for note in self.notes:
            text += f"\nnote: {note}"
        if self.warnings:
            common = Counter(self.warnings).most_common(3)
            text += f"\nwriter warnings {len(self.warnings)}: " + "; ".join(f"{n} x {w}" for w, n in common)
        return text

    def table(self) -> str:
        """Writer runs per layout and ending, as a Markdown table."""
        endings = [e for e in (*ENDINGS, "clean") if self.runs_by_ending.get(e)]
        rows = ["| layout | trials | " + " | ".join(endings) + " |", "| --- | ---: |" + " ---: |" * len(endings)]
        for layout in sorted(self.trials_by_layout):
            counts = " | ".join(str(self.runs_by_layout.get((layout, e), 0)) for e in endings)
            rows.append(f"| {layout} | {self.trials_by_layout[layout]} | {counts} |")
        return "\n".join(rows)


class TortureFailure(Exception):
    """A check failed: committed data lost, torn, or visible past the cursor."""


# --- deterministic rows ---------------------------------------------------------------


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64: a different 64-bit word for every key."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def step_values(leaves: Sequence[ArraySpec], num_envs: int, steps: Any) -> list[np.ndarray]:
    """The rows of ``steps`` (global ids), per leaf ``[*steps.shape, num_envs, *shape]``.

    Every element is a hash of (step, env, leaf, element), so a row of another step, a
    stale row from the previous lap of the ring, or a torn row differs from it.
    """
    steps = np.asarray(steps, dtype=np.int64)
    out = []
    envs = np.arange(num_envs, dtype=np.uint64)
    for i, spec in enumerate(leaves):
        size = int(np.prod(spec.shape))
        elems = np.arange(size, dtype=np.uint64)
        key = (steps.astype(np.uint64)[..., None, None] * np.uint64(num_envs) + envs[:, None]) * np.uint64(
            size
        )
        key = (key + elems) * np.uint64(len(leaves)) + np.uint64(i)
        h = _mix(key)
        kind = spec.dtype.kind
        if kind == "b":
            v = (h & np.uint64(1)).astype(bool)
        elif kind in "iu":
            v = h.astype(spec.dtype)
        else:  # floats and complex: 24-bit integers are exact in every float type but float16
            v = (h >> np.uint64(40)).astype(spec.dtype)
        out.append(v.reshape(*steps.shape, num_envs, *spec.shape))
    return out


def frame_values(num_envs: int, steps: Any) -> list[np.ndarray]:
    """The rows of ``steps`` for :data:`FRAMES_SPEC` (flatten order), as
    :func:`step_values`: each step's observation is a stack of the last
    :data:`FRAME_STACK` frames of its env's episode (an episode's first frame repeated
    before it), its next observation the stack one frame on (an ended episode's final frame
    is a frame of its own, which a store keeping each frame once puts in its side ring).
    Episodes end at about one step in eleven, terminated or truncated."""
    steps = np.asarray(steps, dtype=np.int64)
    k = FRAME_STACK
    envs = np.arange(num_envs, dtype=np.int64)
    t = steps[..., None]  # [..., num_envs] by broadcasting

    def word(at: np.ndarray, salt: int) -> np.ndarray:
        key = (at.astype(np.uint64) * np.uint64(num_envs) + envs.astype(np.uint64)) * np.uint64(7)
        return _mix(key + np.uint64(salt))

    def ends(at: np.ndarray) -> np.ndarray:
        return (at >= 0) & (word(np.maximum(at, 0), 1) % np.uint64(11) == 0)

    def frame(at: np.ndarray, salt: int = 2) -> np.ndarray:
        cells = np.arange(36, dtype=np.uint64)
        h = _mix((word(at, salt)[..., None] << np.uint64(6)) + cells)
        return (h & np.uint64(0xFF)).astype(np.uint8).reshape(*h.shape[:-1], 6, 6)

    # the first step of each env's episode, when it is one of the k - 1 steps before t (or t)
    start = np.full(t.shape[:-1] + (num_envs,), -1, np.int64)
    for back in range(k - 1, -1, -1):
        at = t - back
        begins = (at == 0) | ((at > 0) & ends(at - 1))
        start = np.where(begins & (at >= 0), at, start)
    first = np.where(start >= 0, start, t - (k - 1))

    def stack(frames_at: list[np.ndarray]) -> np.ndarray:
        return np.stack(frames_at, axis=-3)

    obs = stack([frame(np.maximum(t - (k - 1) + i, first)) for i in range(k)])
    final = np.where(ends(t)[..., None, None], frame(t + 1, 3), frame(t + 1))
    nxt = stack([frame(np.maximum(t - (k - 2) + i, first)) for i in range(k - 1)] + [final])
    ended = ends(t)
    terminated = ended & (word(t, 4) % np.uint64(2) == 0)
    action, reward = step_values([FRAMES_SPEC["action"], FRAMES_SPEC["reward"]], num_envs, steps)
    return [action, nxt, obs, reward, terminated, ended & ~terminated]


def rows_of(layout: Layout, num_envs: int, steps: Any) -> list[np.ndarray]:
    """The rows of ``steps`` in ``layout``'s spec, flatten order."""
    if layout.frames:
        return frame_values(num_envs, steps)
    return step_values(flatten(SPEC), num_envs, steps)


# --- the writer (runs in a child process) ---------------------------------------------


def _send(line: str) -> None:
    """A writer's report: one line on fd 1, in one ``write`` (so lines of two threads never mix)."""
    os.write(1, (line + "\n").encode())


def _writer(
    path: str,
    seed: int,
    run_steps: int,
    send: Callable[[str], None],
    layout: Layout | None = None,
    ending: str = "kill",
    request: dict | None = None,
) -> None:
    """Collect ``run_steps`` steps into ``path`` in random add / extend / commit calls.

    Reports through ``send``: ``O g c`` opened at step g with c committed; ``W g n flags``
    about to write steps [g, g + n) (flags: c may commit, k may write a compressed chunk,
    w wraps the ring; an explicit commit is ``W g 0 c``); ``C end`` a commit completed;
    ``F class message`` a write refused as the ending expects (a full disk, the program's
    end); ``Z g`` about to close, drop the store or leave it to the exit hooks, with
    ``g`` steps added; ``D end`` closed cleanly.
    ``ending`` ``sigint`` / ``sigterm`` closes in a ``finally``, keeps the store for the exit
    hooks or drops it (``request["keep"]``); ``enospc`` goes on as ``request["after"]``
    says once a write is refused.
    """
    from .errors import ClosedError, DiskFullError, ShutdownError
    from .store import open as open_store

    request = request or {}
    layout = layout or Layout("zarr", False, 1)
    refused = (DiskFullError,) if ending == "enospc" else (ClosedError, ShutdownError) if ending == "thread" else ()
    try:
        # each step's values are a function of its id: a resumed writer continues the
        # episodes it finds open, so none is marked truncated at the cut
        store = open_store(path, "a", continue_episodes=True)
    except refused as exc:  # (a thread that opens the store after the main thread returned)
        send(f"F {type(exc).__name__} {json.dumps(str(exc))}")
        return
    if request.get("keep") == "exit":
        _KEPT.append(store)  # the exit hooks close it
    num_envs, capacity = store.num_envs, store.capacity
    meta = store.metadata
    compressed = [leaf.chunk_steps for leaf in meta.leaves if leaf.compression is not None]
    rng = np.random.default_rng(seed)
    g = store.total_steps
    send(f"O {g} {store.committed_steps}")
    last = store.committed_steps
    target = g + run_steps
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
            send(f"W {g} {n} {flags or '-'}")
            try:
                if n == 0:
                    store.commit()
                elif n == 1:
                    store.add(unflatten(store.spec, [v[0] for v in rows_of(layout, num_envs, [g])]))
                else:
                    store.extend(unflatten(store.spec, rows_of(layout, num_envs, np.arange(g, g + n))))
            except refused as exc:
                send(f"F {type(exc).__name__} {json.dumps(str(exc))}")
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
                send(f"C {last}")
        if request.get("keep") in ("drop", "exit"):
            send(f"Z {g}")
            if request["keep"] == "drop":
                del store  # the last reference: the store is closed when collected
            return
    finally:
        if request.get("keep", "finally") == "finally" and not (failed and after == "exit"):
            send(f"Z {g}")
            try:
                store.close()
            except refused as exc:
                send(f"F {type(exc).__name__} {json.dumps(str(exc))}")
                return
    send(f"D {store.committed_steps}")


#: stores a writer leaves open for the exit hooks
_KEPT: list[Any] = []


def _child(request: dict) -> int:
    """A forked writer: reports go to fd 1, one line each; warnings and errors too."""
    send = _send

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            send("L " + json.dumps(f"{record.name}: {record.getMessage()}"))

    logging.getLogger("mmreplay").addHandler(Forward(logging.WARNING))
    warnings.showwarning = lambda message, category, *a, **k: send(
        "L " + json.dumps(f"{category.__name__}: {message}")
    )
    ending = request.get("ending", "kill")
    layout = Layout(**request["layout"]) if "layout" in request else None
    args = (request["path"], request["seed"], request["run_steps"], send, layout, ending, request)
    try:
        send(f"S {os.getpid()}")
        if ending == "thread":
            thread = threading.Thread(target=_in_thread, args=(args, send), daemon=request["daemon"])
            thread.start()
            time.sleep(request["main_for"])  # then the main thread returns, the thread still writing
        else:
            _writer(*args)
    except (KeyboardInterrupt, SystemExit) as exc:
        if ending not in ("sigint", "sigterm"):
            send("E " + json.dumps(traceback.format_exc()))
            return 1
        send(f"I {type(exc).__name__}")
    except BaseException:
        send("E " + json.dumps(traceback.format_exc()))
        return 1
    return 0


def _in_thread(args: tuple, send: Callable[[str], None]) -> None:
    try:
        _writer(*args)
    except BaseException:
        send("E " + json.dumps(traceback.format_exc()))


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
    from . import store  # noqa: F401 - preload
    from .backends import hdf5, row_frames, zarr_v3  # noqa: F401 - preload

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
            raise TortureFailure(f"the writer server died: {self._log_tail()}") from None

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
                raise TortureFailure(f"the writer server died: {self._log_tail()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

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


# --- checks -------------------------------------------------------------------------


@dataclass
class Expectation:
    """What the harness knows from the writers' reports in one trial."""

    reported: int = 0  # the newest commit a writer reported complete (or must have made)
    announced: int = 0  # one past the newest step a writer announced it would write
    checked_end: int = 0  # the committed cursor the last check found
    dropped_early: bool = False  # a full side ring of next frames dropped steps (frames once)


#: what verify says of a compressed HDF5 file after a refused chunk write, which the next
#: writer or ``recover`` repairs losing nothing (tests/test_faults.py), and of the flags a
#: killed HDF5 writer leaves
_NOT_DAMAGE = ("status flags", "before the end HDF5 recorded")


def check_store(path: str, config: TrialConfig, exp: Expectation) -> int:
    """Checks (a)-(c) through a reader, then :func:`~mmreplay.verify.verify` on the files;
    returns the number of steps compared bit-exact."""
    from .errors import Error
    from .store import open as open_store
    from .verify import verify

    try:
        store = open_store(path, "r")
    except Error as exc:
        raise TortureFailure(f"(a) the buffer does not open after the ending: {exc}") from None
    try:
        cap = config.capacity
        end, first = store.committed_steps, store.first_step
        if end < exp.reported:
            raise TortureFailure(f"(b) committed cursor {end} is behind the reported commit {exp.reported}")
        if end > exp.announced:
            raise TortureFailure(f"(c) committed cursor {end} is past every step written ({exp.announced})")
        shrink = FRAME_STACK - 1 if config.layout.frames else 0  # stacks need the frames before them
        must_from = max(0, exp.reported - cap, exp.announced + config.ahead - cap) + shrink
        if must_from < exp.reported and first > must_from and not exp.dropped_early:
            raise TortureFailure(
                f"(b) steps [{must_from}, {first}) were committed and not overwritten by the ring, "
                f"but the store keeps only [{first}, {end})"
            )
        if store.total_steps != end or len(store) != end - first:
            raise TortureFailure(
                f"(c) a reader sees total_steps {store.total_steps}, len {len(store)} for committed [{first}, {end})"
            )
        try:
            store.get(len(store))
        except IndexError:
            pass
        else:
            raise TortureFailure(f"(c) get({len(store)}) returned a row past the committed cursor {end}")
        steps = np.arange(first, end)
        for lo in range(0, len(steps), 256):
            ids = steps[lo : lo + 256]
            got = store.read_steps(ids)
            want = rows_of(config.layout, store.num_envs, ids)
            for path_, a, b in zip(store.leaf_paths, got, want):
                if a.tobytes() != b.tobytes():
                    bad = [int(s) for s, x, y in zip(ids, a, b) if x.tobytes() != y.tobytes()]
                    raise TortureFailure(
                        f"(b) leaf {path_!r}: committed steps {bad[:8]}{'...' if len(bad) > 8 else ''} "
                        f"are not bit-exact (committed [{first}, {end}))"
                    )
        exp.checked_end = end
    finally:
        store.close()
    # the files too: sizes, chunks that decode, the episode index against the role leaves
    problems = [p for p in verify(path) if not any(words in p for words in _NOT_DAMAGE)]
    if problems:
        raise TortureFailure("verify found: " + "; ".join(problems))
    return len(steps)


# --- one trial --------------------------------------------------------------------------


def draw_config(
    rng: np.random.Generator,
    layout: Layout,
    kills: int,
    endings: Sequence[str] = ("kill",),
    moments: Sequence[str] = KILL_TARGETS,
) -> TrialConfig:
    capacity = int(rng.integers(8, 160))
    compression = None
    if layout.compressed:
        codec = layout.codec or CODECS[layout.backend]
        if codec == "rows":  # row frames: either codec
            codec = "rows:lz4" if rng.random() < 0.5 else "rows:zstd:1"
        pixels = "obs" if layout.frames else "obs/pixels"
        compression = codec if rng.random() < 0.6 else {pixels: codec}
    return TrialConfig(
        layout=layout,
        capacity=capacity,
        chunk_steps=int(rng.integers(1, max(2, capacity // 3))),
        commit_every=int(rng.choice([1, 2, 5, 16, 64, 1000])),
        durability="power" if rng.random() < 0.15 else "process",
        compression=compression,
        kills=kills,
        seed=int(rng.integers(1 << 62)),
        endings=tuple(endings),
        moments=tuple(moments),
    )


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
    refused: list[str] = field(default_factory=list)


def _run_writer(
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
                _kill(seen.pid, signal.SIGKILL)
            raise TortureFailure(f"the writer said nothing for {REPORT_TIMEOUT:.0f} s (hung; {how})")
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
            name, _, message = rest.partition(" ")
            seen.refused.append(name)
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
            raise TortureFailure(f"the writer exited with status {seen.status} ({how})")
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
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _sleep(seconds: float) -> None:
    """Spin for sub-millisecond delays (sleep would round them up)."""
    end = time.perf_counter() + seconds
    if seconds > 0.001:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < end:
        pass


def _fill(folder: str, room: int) -> str:
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


def run_trial(path: str, config: TrialConfig, server: WriterServer, out: Summary | None = None) -> Summary:
    """Create a buffer at ``path``, end ``config.kills`` writers (each by one of
    ``config.endings``), then finish and verify.

    Counts into ``out`` as it goes (trials are counted by the caller) and raises
    :class:`TortureFailure` at the first failed check. The ``enospc`` ending needs ``path``
    on a file system of its own (:func:`run` mounts a tmpfs).
    """
    from .creation import create
    from .frames_layout import Frames
    from .verify import verify

    rng = np.random.default_rng(config.seed)
    out = Summary() if out is None else out
    layout = config.layout
    create(
        path,
        layout.spec,
        capacity=config.capacity,
        num_envs=layout.num_envs,
        backend=layout.backend,
        chunk_steps=config.chunk_steps,
        compression=config.compression,
        commit_every=config.commit_every,
        durability=config.durability,
        frames=Frames(frame_stack=FRAME_STACK) if layout.frames else None,
        sampler=layout.sampler,
    ).close()
    exp = Expectation()
    targets = [t for t in config.moments if t != "chunk" or config.compression is not None] or list(config.moments)
    for _ in range(config.kills):
        ending = str(rng.choice(config.endings))
        target = str(rng.choice(targets)) if ending in SIGNALS else None
        filler = None
        if ending == "enospc":
            filler = _fill(os.path.dirname(os.path.abspath(path)), int(rng.integers(0, ENOSPC_ROOM // 4096)) * 4096)
        try:
            killed, moment = _run_writer(server, path, config, exp, rng, target, out, ending, filler)
        finally:
            if filler is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(filler)
        out.writer_runs += 1
        out.runs_by_ending[ending] += 1
        out.runs_by_layout[(str(layout), ending)] += 1
        if killed:
            out.kills += 1
        if moment is not None:
            out.kills_by_target[moment] += 1
        out.steps_checked += check_store(path, config, exp)
    _run_writer(server, path, config, exp, rng, None, out)
    out.writer_runs += 1
    out.runs_by_ending["clean"] += 1
    out.runs_by_layout[(str(layout), "clean")] += 1
    out.steps_checked += check_store(path, config, exp)
    problems = verify(path)
    if problems:
        raise TortureFailure("verify found: " + "; ".join(problems))
    return out


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


def run(
    trials: int,
    root: str | None = None,
    seed: int = 0,
    layouts: Sequence[Layout] = LAYOUTS,
    kills_per_trial: int = 3,
    keep_failed: bool = False,
    seconds: float | None = None,
    on_trial: Callable[[int, Summary], None] | None = None,
    endings: Sequence[str] = ("kill",),
    moments: Sequence[str] = KILL_TARGETS,
) -> Summary:
    """Run ``trials`` trials, cycling through ``layouts``; a failure does not stop the run.

    Args:
        trials: buffers to create and torture.
        root: folder for the buffers (a temporary folder by default).
        seed: makes the whole run repeatable (up to where the signals land).
        layouts: the layouts to cycle through.
        kills_per_trial: writer runs ended early per buffer before a final clean run.
        keep_failed: keep the buffers of failed trials (their paths are in the messages;
            not with ``enospc``, whose tmpfs is unmounted at the end).
        seconds: start no trial after this many seconds (None: run them all).
        on_trial: called after each trial with its index and the summary so far.
        endings: how writer runs end (:data:`ENDINGS`), drawn per run. ``enospc`` mounts a
            tmpfs for the buffers (root only; left out, with a note, where it cannot).
        moments: the moments signals are aimed at (:data:`KILL_TARGETS`), drawn per run.

    Example:
        >>> from mmreplay.torture import run
        >>> print(run(2).line())  # doctest: +SKIP
        trials 2, kills 6, failures 0
    """
    for name, given, known in (("endings", endings, ENDINGS), ("moments", moments, KILL_TARGETS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{name} must be among {known}, got {unknown}")
    own_root = root is None
    root = tempfile.mkdtemp(prefix="mmreplay-torture-") if root is None else root
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    total = Summary()
    endings = list(endings)
    where = root
    mounted = None
    if "enospc" in endings:
        mounted = os.path.join(root, "tmpfs")
        why = mount_tmpfs(mounted)
        if why is None:
            where = mounted
        else:
            endings.remove("enospc")
            total.notes.append(f"no enospc ending: cannot mount a tmpfs here ({why})")
            mounted = None
    start = time.perf_counter()
    server = None
    try:
        for i in range(trials):
            if not endings or (seconds is not None and time.perf_counter() - start > seconds):
                break
            if server is None:
                server = WriterServer()
            layout = layouts[i % len(layouts)]
            config = draw_config(rng, layout, kills_per_trial, endings, moments)
            path = os.path.join(where, f"trial-{i:05d}")
            total.trials_by_layout[str(layout)] += 1
            failure = None
            total.trials += 1
            try:
                run_trial(path, config, server, total)
            except TortureFailure as exc:
                failure = str(exc)
            except Exception:
                failure = traceback.format_exc()
            if failure is not None:  # the server may be out of step: start a new one
                server.close()
                server = None
            if failure is None or not keep_failed or mounted is not None:
                shutil.rmtree(path, ignore_errors=True)
            if failure is not None:
                total.failures += 1
                kept = f" (kept at {path})" if keep_failed and mounted is None else ""
                total.messages.append(f"trial {i} [{config.describe()}]{kept}: {failure}")
            total.seconds = time.perf_counter() - start
            if on_trial is not None:
                on_trial(i, total)
    finally:
        if server is not None:
            server.close()
        if mounted is not None:
            unmount(mounted)
        if own_root and not (keep_failed and total.failures):
            shutil.rmtree(root, ignore_errors=True)
    return total
