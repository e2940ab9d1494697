"""Episodes in the Rerun viewer: a store's steps written to an ``.rrd`` recording.

Each env is the entity ``env/<i>``, and each leaf an entity under it by its path: frame
leaves (a layout :class:`mmreplay.spec.Layout` recognises; a frame stack as its newest
frame) as images, every other leaf as scalars (one series per element). Two timelines:
``step`` (the global step id) and ``time`` (seconds at ``fps`` steps a second). Episode
starts and ends are text entries in ``env/<i>/episodes`` (how each ended, its length and
return), and ``env/<i>/episode`` is the episode index of each step. Columns are sent a
block of steps at a time, so a long store is logged in bounded memory. Needs
``rerun-sdk`` (``mmreplay[rerun]``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import BadInputError, NotEnoughDataError, TargetError
from .files import raise_named
from .selection import READ_BLOCK_FRAMES, read_leaf, select, to_uint8
from .spec import Layout

if TYPE_CHECKING:
    from .store import Store

__all__ = ["log_rerun"]


def _rerun() -> Any:
    try:
        import rerun as rr
    except ImportError:
        raise ImportError(
            "writing a Rerun recording needs rerun-sdk: pip install 'mmreplay[rerun]'"
        ) from None
    return rr


def _layouts(store: Store) -> dict[int, Layout]:
    """Leaf index -> frame layout, for the leaves logged as images."""
    out = {}
    for i, leaf in enumerate(store.leaves):
        try:
            layout = Layout.infer(leaf.info.spec.shape, leaf.info.path)
        except BadInputError:
            continue
        out[i] = layout
    return out


def _timelines(rr: Any, steps: np.ndarray, first: int, fps: float) -> list[Any]:
    """The ``step`` and ``time`` timelines of a column of global step ids."""
    return [rr.TimeColumn("step", sequence=steps), rr.TimeColumn("time", duration=(steps - first) / fps)]


def _ranges(store: Store, env: int | None, episode: int | None, steps: Any) -> list[tuple[int, np.ndarray]]:
    """(env, global step ids) to log: one env's episode or steps when asked, else every env's."""
    if episode is not None or steps is not None:
        sel = select(store, env, episode, steps)
        return [(sel.env, sel.steps)]
    first, end = store.first_step, store.first_step + len(store)
    envs = range(store.num_envs) if env is None else [select(store, env, None, slice(first, end)).env]
    return [(e, np.arange(first, end, dtype=np.int64)) for e in envs]


def log_rerun(
    store: Store,
    out: str | os.PathLike,
    env: int | None = None,
    episode: int | None = None,
    steps: Any = None,
    fps: float = 20.0,
    force: bool = False,
    progress: Callable[[int], Any] | None = None,
) -> str:
    """Write a store's steps to the Rerun recording ``out`` (``.rrd``); returns its path.

    Every retained step of every env by default; ``env`` keeps one env, ``episode`` (an
    index into that env's episodes) or ``steps`` (``"A:B"`` global step ids) one range,
    as :func:`mmreplay.view` picks them. ``progress`` is called with steps logged.
    Open it with ``rerun out.rrd``.
    """
    rr = _rerun()
    path = os.fspath(out)
    if not path.lower().endswith(".rrd"):
        raise BadInputError(f"{path}: a Rerun recording's name ends with .rrd")
    if os.path.isdir(path):
        raise TargetError(f"{path}: is a folder; a Rerun recording is a file, and force replaces only a file")
    if os.path.lexists(path) and not force:
        raise FileExistsError(f"{path}: already exists; pass force=True (--force) to overwrite it")
    if not (isinstance(fps, (int, float)) and fps > 0):
        raise BadInputError(f"fps must be a number > 0, got {fps!r}")
    if not len(store):
        raise NotEnoughDataError(f"{store.path}: no committed steps to log")
    ranges = _ranges(store, env, episode, steps)
    layouts = _layouts(store)
    name = os.path.basename(os.path.normpath(store.path)) or "store"
    tmp = f"{path}.tmp-{os.getpid()}.rrd"
    try:
        open(tmp, "wb").close()  # a place rerun cannot write: an OSError here, not rerun's RuntimeError
    except OSError as exc:
        raise_named(exc, path, "Rerun recording", tmp)
    rec = rr.RecordingStream(f"mmreplay {name}")
    rec.save(tmp)
    try:
        for e, ids in ranges:
            _log_env(rr, rec, store, e, ids, layouts, fps, progress)
        rec.disconnect()  # writes the recording's footer
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _log_env(
    rr: Any,
    rec: Any,
    store: Store,
    env: int,
    ids: np.ndarray,
    layouts: dict[int, Layout],
    fps: float,
    progress: Any,
) -> None:
    root = f"env/{env}"
    first = int(store.first_step)
    for a in range(0, len(ids), READ_BLOCK_FRAMES):
        block = ids[a : a + READ_BLOCK_FRAMES]
        times = _timelines(rr, block, first, fps)
        for i, leaf in enumerate(store.leaves):
            values = read_leaf(store, i, env, block, None)
            entity = f"{root}/{leaf.info.path}"
            if i in layouts:
                frames = to_uint8(layouts[i].normalise(values)[:, -1])  # the newest frame of a stack
                h, w, c = frames.shape[1:]
                model = "L" if c == 1 else ("RGB" if c == 3 else "RGBA")
                fmt = rr.components.ImageFormat(width=w, height=h, color_model=model, channel_datatype="U8")
                columns = rr.Image.columns(buffer=frames.reshape(len(block), -1), format=[fmt] * len(block))
            else:
                columns = rr.Scalars.columns(scalars=values.reshape(len(block), -1).astype(np.float64))
            rec.send_columns(entity, indexes=times, columns=columns)
        if progress is not None:
            progress(len(block))
    _log_episodes(rr, rec, store, env, ids, root, fps, first)


def _log_episodes(
    rr: Any, rec: Any, store: Store, env: int, ids: np.ndarray, root: str, fps: float, first: int
) -> None:
    """Episode starts and ends as text entries; each step's episode index as a series."""
    lo, hi = int(ids[0]), int(ids[-1])
    reward = store.roles.get("reward")
    marks: list[tuple[int, str, str]] = []
    index = np.full(len(ids), -1, np.int64)
    for k, span in enumerate(store.episode_index(env=env)):
        if span.last_step < lo or span.first_step > hi:
            continue
        index[(ids >= span.first_step) & (ids <= span.last_step)] = k
        if span.first_step >= lo:
            marks.append((span.first_step, "INFO", f"episode {k} starts"))
        ended = span.ended  # also for an episode whose start the ring overwrote ("open")
        if ended != "running" and span.last_step <= hi:
            ret = ""
            if reward in store.leaf_paths:
                steps = np.arange(span.first_step, span.last_step + 1)
                r = read_leaf(store, store.leaf_paths.index(reward), env, steps, None)
                ret = f", return {float(np.sum(r, dtype=np.float64)):.6g}"
            level = "WARN" if ended == "terminated" else "INFO"
            length = f"length {span.length}" if span.status != "open" else f"its last {span.length} steps"
            marks.append((span.last_step, level, f"episode {k} {ended} ({length}{ret})"))
    if marks:
        at = np.array([m[0] for m in marks], np.int64)
        rec.send_columns(
            f"{root}/episodes",
            indexes=_timelines(rr, at, first, fps),
            columns=rr.TextLog.columns(text=[m[2] for m in marks], level=[m[1] for m in marks]),
        )
    times = _timelines(rr, ids, first, fps)
    rec.send_columns(
        f"{root}/episode", indexes=times, columns=rr.Scalars.columns(scalars=index.astype(np.float64))
    )
