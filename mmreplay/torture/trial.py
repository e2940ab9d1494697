"""A torture trial (a fresh buffer, writers ended one after another, a clean last run,
checks after each) and a run of many, whose failures are reported, not raised."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence

import numpy as np

from .checks import Expectation, check_store
from .endings import ENOSPC_ROOM, SIGNALS, fill, mount_tmpfs, run_writer, unmount
from .layouts import ENDINGS, KILL_TARGETS, LAYOUTS, Layout, TrialConfig, draw_config
from .report import Summary, TortureFailure
from .rows import FRAME_STACK
from .writer import WriterServer


def run_trial(path: str, config: TrialConfig, server: WriterServer, out: Summary | None = None) -> Summary:
    """Create a buffer at ``path``, end ``config.kills`` writers (each by one of
    ``config.endings``), then finish and verify.

    Counts into ``out`` as it goes (trials are counted by the caller) and raises
    :class:`TortureFailure` at the first failed check. The ``enospc`` ending needs ``path``
    on a file system of its own (:func:`run` mounts a tmpfs).
    """
    from ..creation import create
    from ..frames_layout import Frames
    from ..verify import verify

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
            filler = fill(os.path.dirname(os.path.abspath(path)), int(rng.integers(0, ENOSPC_ROOM // 4096)) * 4096)
        try:
            killed, moment = run_writer(server, path, config, exp, rng, target, out, ending, filler)
        finally:
            if filler is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(filler)
        out.count_run(str(layout), ending, killed, moment)
        out.steps_checked += check_store(path, config, exp)
    run_writer(server, path, config, exp, rng, None, out)
    out.count_run(str(layout), "clean")
    out.steps_checked += check_store(path, config, exp)
    problems = verify(path)
    if problems:
        raise TortureFailure("verify found: " + "; ".join(problems))
    return out


def make_root(root: str) -> None:
    """Make the folder of the buffers and check a trial can write there: a place none
    can is one error, raised before anything starts, not a failure in every trial."""
    from ..files import raise_named

    try:
        os.makedirs(root, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=root))
    except OSError as exc:
        raise_named(exc, root, "torture's buffers", root)


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
    make_root(root)
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
            keep = failure is not None and keep_failed and mounted is None
            if failure is not None:  # the server may be out of step: start a new one
                server.close()
                server = None
                total.failures += 1
                kept = f" (kept at {path})" if keep else ""
                total.messages.append(f"trial {i} [{config.describe()}]{kept}: {failure}")
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
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
