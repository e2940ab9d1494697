"""Crash torture: kill a writer with SIGKILL at random moments and check nothing committed is lost.

A writer process collects into a store where every row is a deterministic function of its
global step id and env (:func:`step_values`), and reports on a pipe each operation it is
about to do and each commit it has completed. The harness kills it with SIGKILL — at a
random time, or just as it starts a commit, a chunk write of a compressed leaf or the
write that wraps the ring — then reopens the store and checks that

(a) it opens;
(b) every step up to the last reported commit is there and bit-exact, unless the ring
    legitimately reused its slot (the writer may reserve ``_ahead`` steps past what it
    announced);
(c) no row past the committed cursor is visible, and the committed cursor never passes
    what the writer announced;
(d) the next writer resumes at the committed cursor, and its kill passes the same checks.

After each kill :func:`mmreplay.verify.verify` checks the files too (sizes, chunks that
decode, the episode index against the role leaves). Each trial is a fresh buffer with a
random layout (backend, compression, ``num_envs``, capacity, chunking, commit cadence)
killed several times, then collected to a clean close and checked once more.

Writers start from a fork server that has imported mmreplay, zarr and h5py once, so a
kill costs milliseconds, not an interpreter start.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
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
    "Layout",
    "LAYOUTS",
    "TrialConfig",
    "Summary",
    "step_values",
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

#: codec used for compressed layouts, per backend (both need no plugin)
CODECS = {"zarr": "zstd", "hdf5": "gzip"}

KILL_TARGETS = ("time", "op", "commit", "chunk", "wrap")
REPORT_TIMEOUT = 120.0  # seconds without a word from a writer before it counts as hung


@dataclass(frozen=True)
class Layout:
    """Backend, whether leaves are compressed (with ``codec``, else the backend's default
    in :data:`CODECS`; ``"rows"``: row frames, lz4 or zstd by trial), and the number of envs."""

    backend: str
    compressed: bool
    num_envs: int
    codec: str | None = None

    def __str__(self) -> str:
        kind = (self.codec or "compressed") if self.compressed else "mapped"
        return f"{self.backend}-{kind}-{self.num_envs}env"


LAYOUTS = tuple(Layout(b, c, n) for b in ("zarr", "hdf5") for c in (False, True) for n in (1, 8)) + (
    Layout("zarr", True, 3, "rows"),
)


@dataclass(frozen=True)
class TrialConfig:
    """One buffer's shape and the writer's pace, drawn at random per trial."""

    layout: Layout
    capacity: int
    chunk_steps: int
    commit_every: int
    durability: str
    compression: Any  # None, a codec, or {leaf path: codec} (only pixels compressed)
    kills: int
    seed: int

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
    messages: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self) -> str:
        return f"trials {self.trials}, kills {self.kills}, failures {self.failures}"

    def details(self) -> str:
        targets = ", ".join(f"{k} {v}" for k, v in sorted(self.kills_by_target.items()))
        layouts = ", ".join(f"{k} {v}" for k, v in sorted(self.trials_by_layout.items()))
        text = (
            f"writer runs {self.writer_runs}, steps checked bit-exact {self.steps_checked}, "
            f"{self.seconds:.1f} s\nkills by moment: {targets}\ntrials by layout: {layouts}"
        )
        if self.warnings:
            common = Counter(self.warnings).most_common(3)
            text += f"\nwriter warnings {len(self.warnings)}: " + "; ".join(f"{n} x {w}" for w, n in common)
        return text


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


# --- the writer (runs in a child process) ---------------------------------------------


def _writer(path: str, seed: int, run_steps: int, send: Callable[[str], None]) -> None:
    """Collect ``run_steps`` steps into ``path`` in random add / extend / commit calls.

    Reports through ``send``: ``O g c`` opened at step g with c committed; ``W g n flags``
    about to write steps [g, g + n) (flags: c may commit, k may write a compressed chunk,
    w wraps the ring; an explicit commit is ``W g 0 c``); ``C end`` a commit completed;
    ``D end`` closed cleanly.
    """
    from .store import open as open_store

    store = open_store(path, "a")
    leaves = flatten(store.spec)
    num_envs, capacity = store.num_envs, store.capacity
    meta = store.metadata
    compressed = [leaf.chunk_steps for leaf in meta.leaves if leaf.compression is not None]
    rng = np.random.default_rng(seed)
    g = store.total_steps
    send(f"O {g} {store.committed_steps}")
    last = store.committed_steps
    target = g + run_steps
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
        if n == 0:
            store.commit()
        elif n == 1:
            store.add(unflatten(store.spec, [v[0] for v in step_values(leaves, num_envs, [g])]))
        else:
            store.extend(unflatten(store.spec, step_values(leaves, num_envs, np.arange(g, g + n))))
        g = store.total_steps
        if store.committed_steps != last:
            last = store.committed_steps
            send(f"C {last}")
    store.close()
    send(f"D {store.committed_steps}")


def _child(request: dict) -> int:
    """A forked writer: reports go to fd 1, one line each; warnings and errors too."""

    def send(line: str) -> None:
        os.write(1, (line + "\n").encode())

    class Forward(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            send("L " + json.dumps(f"{record.name}: {record.getMessage()}"))

    logging.getLogger("mmreplay").addHandler(Forward(logging.WARNING))
    warnings.showwarning = lambda message, category, *a, **k: send(
        "L " + json.dumps(f"{category.__name__}: {message}")
    )
    try:
        send(f"S {os.getpid()}")
        _writer(request["path"], request["seed"], request["run_steps"], send)
    except BaseException:
        send("E " + json.dumps(traceback.format_exc()))
        return 1
    return 0


def serve() -> None:
    """The writer server's loop: one JSON request a line on stdin, one forked writer each.

    It imports everything a writer needs once and never opens a store itself, so each
    fork starts clean (no zarr event loop thread, no open HDF5 file). After each writer
    ends it reports ``X pid exit-status``.
    """
    from . import store  # noqa: F401 - preload
    from .backends import hdf5, zarr_v3  # noqa: F401 - preload

    for line in iter(sys.stdin.buffer.readline, b""):
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os._exit(_child(request))
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

    def start(self, path: str, seed: int, run_steps: int) -> None:
        request = json.dumps({"path": path, "seed": seed, "run_steps": run_steps})
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

    reported: int = 0  # the newest commit a writer reported complete
    announced: int = 0  # one past the newest step a writer announced it would write
    checked_end: int = 0  # the committed cursor the last check found


def check_store(path: str, config: TrialConfig, exp: Expectation) -> int:
    """Checks (a)-(c) through a reader, then :func:`~mmreplay.verify.verify` on the files;
    returns the number of steps compared bit-exact."""
    from .errors import Error
    from .store import open as open_store
    from .verify import verify

    try:
        store = open_store(path, "r")
    except Error as exc:
        raise TortureFailure(f"(a) the buffer does not open after the kill: {exc}") from None
    try:
        cap = config.capacity
        end, first = store.committed_steps, store.first_step
        if end < exp.reported:
            raise TortureFailure(f"(b) committed cursor {end} is behind the reported commit {exp.reported}")
        if end > exp.announced:
            raise TortureFailure(f"(c) committed cursor {end} is past every step written ({exp.announced})")
        must_from = max(0, exp.reported - cap, exp.announced + config.ahead - cap)
        if must_from < exp.reported and first > must_from:
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
        leaves = flatten(store.spec)
        for lo in range(0, len(steps), 256):
            ids = steps[lo : lo + 256]
            got = store.read_steps(ids)
            want = step_values(leaves, store.num_envs, ids)
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
    # (a killed HDF5 writer leaves its open-for-writing flags: the next writer clears them)
    problems = [p for p in verify(path) if "status flags" not in p]
    if problems:
        raise TortureFailure("verify found: " + "; ".join(problems))
    return len(steps)


# --- one trial --------------------------------------------------------------------------


def draw_config(rng: np.random.Generator, layout: Layout, kills: int) -> TrialConfig:
    capacity = int(rng.integers(8, 160))
    compression = None
    if layout.compressed:
        codec = layout.codec or CODECS[layout.backend]
        if codec == "rows":  # row frames: either codec
            codec = "rows:lz4" if rng.random() < 0.5 else "rows:zstd:1"
        compression = codec if rng.random() < 0.6 else {"obs/pixels": codec}
    return TrialConfig(
        layout=layout,
        capacity=capacity,
        chunk_steps=int(rng.integers(1, max(2, capacity // 3))),
        commit_every=int(rng.choice([1, 2, 5, 16, 64, 1000])),
        durability="power" if rng.random() < 0.15 else "process",
        compression=compression,
        kills=kills,
        seed=int(rng.integers(1 << 62)),
    )


def _run_writer(
    server: WriterServer,
    path: str,
    config: TrialConfig,
    exp: Expectation,
    rng: np.random.Generator,
    target: str | None,
    out: Summary,
) -> tuple[bool, str | None]:
    """One writer run, killed at ``target`` (None: let it close). Returns (killed, kill moment)."""
    run_steps = int(rng.integers(config.capacity // 2, 4 * config.capacity + 2))
    server.start(path, int(rng.integers(1 << 62)), run_steps)
    flag = {"commit": "c", "chunk": "k", "wrap": "w"}.get(target or "")
    count = int(rng.integers(1, 40 if target == "op" else 6)) if target else 0
    delay = float(rng.uniform(0, 0.002 if target != "time" else 0.03))
    killed_at: str | None = None
    opened = False
    error = None
    pid = 0
    while True:
        msg = server.line(REPORT_TIMEOUT)
        if msg is None:
            if pid:
                _kill(pid)
            raise TortureFailure(f"the writer said nothing for {REPORT_TIMEOUT:.0f} s (hung)")
        kind, _, rest = msg.partition(" ")
        if kind == "S":
            pid = int(rest)
            if target == "time":
                _sleep(delay)
                _kill(pid)
                killed_at = "time"
        elif kind == "O":
            g, committed = map(int, rest.split())
            if not opened and (g != exp.checked_end or committed != exp.checked_end):
                error = (
                    f"(d) the next writer resumed at step {g} (committed {committed}), "
                    f"expected the committed cursor {exp.checked_end}"
                )
                _kill(pid)
            opened = True
            exp.announced = max(exp.announced, g)
        elif kind == "W":
            g, n, flags = rest.split()
            exp.announced = max(exp.announced, int(g) + int(n))
            if killed_at is None and target not in (None, "time") and (flag is None or flag in flags):
                count -= 1
                if count == 0:
                    _sleep(delay)
                    _kill(pid)
                    killed_at = target
        elif kind in ("C", "D"):
            exp.reported = max(exp.reported, int(rest))
        elif kind == "L":
            out.warnings.append(json.loads(rest))
        elif kind == "E":
            error = f"the writer raised:\n{json.loads(rest)}"
        elif kind == "X":
            status = int(rest.split()[1])
            break
    if error is not None:
        raise TortureFailure(error)
    if status == -signal.SIGKILL:
        return True, killed_at
    if status != 0:
        raise TortureFailure(f"the writer exited with status {status}")
    return False, None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _sleep(seconds: float) -> None:
    """Spin for sub-millisecond delays (sleep would round them up)."""
    end = time.perf_counter() + seconds
    if seconds > 0.001:
        time.sleep(seconds - 0.001)
    while time.perf_counter() < end:
        pass


def run_trial(path: str, config: TrialConfig, server: WriterServer, out: Summary | None = None) -> Summary:
    """Create a buffer at ``path``, kill ``config.kills`` writers, then finish and verify.

    Counts into ``out`` as it goes (trials are counted by the caller) and raises
    :class:`TortureFailure` at the first failed check.
    """
    from .store import create
    from .verify import verify

    rng = np.random.default_rng(config.seed)
    out = Summary() if out is None else out
    create(
        path,
        SPEC,
        capacity=config.capacity,
        num_envs=config.layout.num_envs,
        backend=config.layout.backend,
        chunk_steps=config.chunk_steps,
        compression=config.compression,
        commit_every=config.commit_every,
        durability=config.durability,
    ).close()
    exp = Expectation()
    targets = [t for t in KILL_TARGETS if t != "chunk" or config.compression is not None]
    for _ in range(config.kills):
        target = str(rng.choice(targets))
        killed, moment = _run_writer(server, path, config, exp, rng, target, out)
        out.writer_runs += 1
        if killed:
            out.kills += 1
            out.kills_by_target[moment] += 1
        out.steps_checked += check_store(path, config, exp)
    _run_writer(server, path, config, exp, rng, None, out)
    out.writer_runs += 1
    out.steps_checked += check_store(path, config, exp)
    problems = verify(path)
    if problems:
        raise TortureFailure("verify found: " + "; ".join(problems))
    return out


def run(
    trials: int,
    root: str | None = None,
    seed: int = 0,
    layouts: Sequence[Layout] = LAYOUTS,
    kills_per_trial: int = 3,
    keep_failed: bool = False,
    seconds: float | None = None,
    on_trial: Callable[[int, Summary], None] | None = None,
) -> Summary:
    """Run ``trials`` trials, cycling through ``layouts``; a failure does not stop the run.

    Args:
        trials: buffers to create and torture.
        root: folder for the buffers (a temporary folder by default).
        seed: makes the whole run repeatable (up to where the kills land).
        layouts: the layouts to cycle through.
        kills_per_trial: writers killed per buffer before a final clean run.
        keep_failed: keep the buffers of failed trials (their paths are in the messages).
        seconds: start no trial after this many seconds (None: run them all).
        on_trial: called after each trial with its index and the summary so far.

    Example:
        >>> from mmreplay.torture import run
        >>> print(run(2).line())  # doctest: +SKIP
        trials 2, kills 6, failures 0
    """
    own_root = root is None
    root = tempfile.mkdtemp(prefix="mmreplay-torture-") if root is None else root
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    total = Summary()
    start = time.perf_counter()
    server = None
    try:
        for i in range(trials):
            if seconds is not None and time.perf_counter() - start > seconds:
                break
            if server is None:
                server = WriterServer()
            layout = layouts[i % len(layouts)]
            config = draw_config(rng, layout, kills_per_trial)
            path = os.path.join(root, f"trial-{i:05d}")
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
            if failure is None or not keep_failed:
                shutil.rmtree(path, ignore_errors=True)
            if failure is not None:
                total.failures += 1
                where = f" (kept at {path})" if keep_failed else ""
                total.messages.append(f"trial {i} [{config.describe()}]{where}: {failure}")
            total.seconds = time.perf_counter() - start
            if on_trial is not None:
                on_trial(i, total)
    finally:
        if server is not None:
            server.close()
        if own_root and not (keep_failed and total.failures):
            shutil.rmtree(root, ignore_errors=True)
    return total
