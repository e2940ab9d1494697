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

Modules: ``rows`` (the deterministic rows), ``layouts`` (what a trial draws), ``report``
(the summary, the failure), ``writer`` (the fork server and the writer it runs),
``checks`` ((a)-(c) and verify), ``endings`` (how each ending reaches a writer, what its
reports tell), ``trial`` (a trial, a run of many).
"""

from __future__ import annotations

from .checks import Expectation, check_store
from .endings import run_writer
from .layouts import ENDINGS, KILL_TARGETS, LAYOUTS, Layout, TrialConfig, draw_config, rows_of
from .report import Summary, TortureFailure
from .rows import FRAME_STACK, FRAMES_SPEC, SPEC, frame_values, step_values
from .trial import make_root, run, run_trial
from .writer import WriterServer, serve

__all__ = [
    "SPEC",
    "FRAMES_SPEC",
    "FRAME_STACK",
    "ENDINGS",
    "KILL_TARGETS",
    "Layout",
    "LAYOUTS",
    "TrialConfig",
    "Summary",
    "step_values",
    "frame_values",
    "rows_of",
    "draw_config",
    "make_root",
    "run",
    "run_trial",
    "run_writer",
    "check_store",
    "Expectation",
    "TortureFailure",
    "WriterServer",
    "serve",
]
