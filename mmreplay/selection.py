"""Which rows of one env a picture of a store shows, read in bounded blocks as uint8:
shared by the pictures (:mod:`mmreplay.pictures`) and the Rerun recording (:mod:`mmreplay.rerun`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import BadInputError, NotEnoughDataError
from .read.gather import check_retained
from .spec import is_image

if TYPE_CHECKING:
    from .store import Store

Progress = Callable[[int], Any]

#: frames read per block: bounded memory for long ranges, one progress report per block
READ_BLOCK_FRAMES = 256


def to_uint8(x: np.ndarray) -> np.ndarray:
    """Pixel values as uint8: uint8 as is, bool as 0/255, floats in [0, 1] times 255,
    anything else scaled from its range to 0..255; NaN and infinite pixels (a depth
    camera's missing returns) show as the lowest finite value, the range is the rest's."""
    if x.dtype == np.uint8:
        return x
    if x.dtype == np.bool_:
        return x.astype(np.uint8) * np.uint8(255)
    if x.dtype.kind == "f":
        finite = np.isfinite(x)
        if not finite.all():
            x = np.where(finite, x, np.min(x, initial=np.inf, where=finite) if finite.any() else 0)
    if x.size == 0:
        return x.astype(np.uint8)
    lo, hi = float(np.min(x)), float(np.max(x))
    if x.dtype.kind == "f" and lo >= 0.0 and hi <= 1.0:
        return np.rint(x * 255.0).astype(np.uint8)
    if x.dtype.kind in "iu" and lo >= 0 and hi <= 255:
        return x.astype(np.uint8)
    scale = 255.0 / (hi - lo) if hi > lo else 0.0
    return np.rint((x.astype(np.float64) - lo) * scale).astype(np.uint8)


def frame_leaves(store: Store) -> list[str]:
    """Paths of the leaves whose shape is recognised as frames, observation first."""
    # the spec's leaves (frames once: rebuilt)
    out = [leaf.info.path for leaf in store.leaves if is_image(leaf.info.spec)]
    obs = store.roles.get("observation")
    return sorted(out, key=lambda p: not (obs is not None and (p == obs or p.startswith(obs + "/"))))


def pick_leaf(store: Store, leaf: str | None) -> str:
    if leaf is not None:
        if leaf not in store.leaf_paths:
            raise BadInputError(f"{store.path}: no leaf {leaf!r}; leaves are {store.leaf_paths}")
        return leaf
    found = frame_leaves(store)
    if not found:
        shapes = ", ".join(f"{leaf.info.path} {leaf.info.spec.shape}" for leaf in store.leaves)
        raise BadInputError(
            f"{store.path}: no leaf looks like frames ({shapes}); name one with leaf=/--leaf and its layout"
        )
    return found[0]


@dataclass(frozen=True)
class Selection:
    """One env's steps to show, with the episode they belong to (if one was asked for)."""

    env: int
    steps: np.ndarray  # global step ids, in order
    episode: int | None = None
    status: str | None = None  # how the episode ended


def parse_steps(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` (either side may be empty) as global step ids; ``"A"`` is one step."""
    m = re.fullmatch(r"\s*(-?\d+)?\s*(:)?\s*(-?\d+)?\s*", text)
    if not m or (m.group(1) is None and m.group(2) is None):
        raise BadInputError(
            f"steps {text!r}: expected A:B (global step ids; either may be left out, negative counts from the newest)"
        )
    a = None if m.group(1) is None else int(m.group(1))
    if m.group(2) is None:
        return a, (None if a is None else (a + 1 if a != -1 else None))
    return a, None if m.group(3) is None else int(m.group(3))


def _step_bounds(steps: Any) -> tuple[int | None, int | None]:
    if isinstance(steps, str):
        return parse_steps(steps)
    if isinstance(steps, slice) and steps.step in (None, 1):
        return steps.start, steps.stop
    raise BadInputError(f"steps must be 'A:B' or a slice of global step ids (no stride), got {steps!r}")


def select(store: Store, env: int | None, episode: int | None, steps: Any) -> Selection:
    """The steps of ``episode`` (an index into env's episodes, negative from the newest),
    or of the global step range ``steps``, or by default the newest complete episode of
    the env (the newest open one when none is complete, every retained step without
    episode ends)."""
    env = 0 if env is None else env
    if not isinstance(env, (int, np.integer)) or isinstance(env, bool) or not 0 <= env < store.num_envs:
        raise BadInputError(f"{store.path}: env must be an int in [0, {store.num_envs}), got {env!r}")
    if episode is not None and steps is not None:
        raise BadInputError("give an episode or a step range, not both")
    first, end = store.first_step, store.first_step + len(store)
    if len(store) == 0:
        raise NotEnoughDataError(f"{store.path}: no committed steps to show")
    if steps is not None:
        a, b = _step_bounds(steps)
        a = first if a is None else (end + a if a < 0 else a)
        b = end if b is None else (end + b if b < 0 else b)
        lo, hi = max(a, first), min(b, end)
        if lo >= hi:
            raise BadInputError(
                f"{store.path}: steps {a}:{b} hold no retained committed step (retained: {first}:{end})"
            )
        return Selection(int(env), np.arange(lo, hi, dtype=np.int64))
    spans = store.episode_index(env=int(env))
    if not spans:
        return Selection(int(env), np.arange(first, end, dtype=np.int64))
    if episode is None:
        complete = [i for i, s in enumerate(spans) if s.status != "open"]
        episode = complete[-1] if complete else len(spans) - 1
    if (
        not isinstance(episode, (int, np.integer))
        or isinstance(episode, bool)
        or not -len(spans) <= episode < len(spans)
    ):
        raise BadInputError(
            f"{store.path}: env {env} has {len(spans)} episodes in the retained window; "
            f"episode must be in [{-len(spans)}, {len(spans)}), got {episode!r}"
        )
    k = int(episode) % len(spans)
    s = spans[k]
    return Selection(int(env), np.arange(s.first_step, s.last_step + 1, dtype=np.int64), k, s.status)


def read_leaf(store: Store, index: int, env: int, steps: np.ndarray, progress: Progress | None) -> np.ndarray:
    leaf = store.leaves[index]
    blocks = []
    for i in range(0, len(steps), READ_BLOCK_FRAMES):
        part = steps[i : i + READ_BLOCK_FRAMES]
        blocks.append(leaf.read_rows(part % store.capacity, env))
        if progress is not None:
            progress(len(part))
    if len(steps):
        check_retained(store, int(np.min(steps)))
    return np.concatenate(blocks) if blocks else np.empty((0, *leaf.info.spec.shape), leaf.info.spec.dtype)


def step_ends(store: Store, env: int, steps: np.ndarray) -> list[str]:
    """How each shown step ended its episode ('' for none)."""
    if not len(steps):
        return []
    lo, hi = int(steps[0]), int(steps[-1])
    ends = {  # (also of an episode whose start the ring overwrote: its status is "open")
        s.last_step: s.ended
        for s in store.episode_index(env=env)
        if lo <= s.last_step <= hi and s.ended in ("terminated", "truncated")
    }
    return [ends.get(int(t), "") for t in steps]
