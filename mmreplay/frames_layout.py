"""What a store that keeps each frame once records on disk: the :class:`Frames` option,
the :class:`FramesLayout` in its metadata, and the side ring's folder and metadata.

No behaviour lives here (that is :mod:`mmreplay.frames`), so the metadata that records
a layout can read it without importing the writer and the gathers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .errors import CorruptBufferError, SpecError
from .io import ByteSource
from .roles import subtree
from .spec import ArraySpec, flatten, leaf_paths, spec_to_json
from .statefile import State, reserved_ahead

__all__ = ["Frames", "FramesLayout", "Pair", "SIDE_DIR", "PREFIX", "NEXT_LEAF", "DEPTH_LEAF"]

#: the folder (inside the buffer) of the side ring of next frames
SIDE_DIR = "frames"
#: the prefix of the per-row leaves this layout adds
PREFIX = "_frames"
NEXT_LEAF = f"{PREFIX}/next"
DEPTH_LEAF = f"{PREFIX}/depth"
PADS = ("repeat", "zeros")
NEXT_OBSERVATIONS = ("derived", "stored")


@dataclass(frozen=True)
class Frames:
    """How a store keeps observations: pass as ``mmreplay.create(..., frames=Frames(...))``.

    Args:
        next_observation: ``"derived"`` (the next step's observation; each frame stored
            once) or ``"stored"`` (kept as given).
        frame_stack: frames per observation stack; above 1, only the newest frame of each
            stack is stored and the stack is rebuilt when read.
        stack_axis: the axis of the observation leaves that holds the stack (None: the
            last axis if its size is ``frame_stack``, else the first).
        pad: what a stack shows before an episode's first frame: ``"repeat"`` (that
            frame, as the Atari wrappers do) or ``"zeros"`` (as SB3's ``VecFrameStack``).
        final_slots: next frames the side ring keeps (final observations of ended
            episodes, and one per env at each commit); None: one per 64 rows plus one
            per env for each commit a ring's worth of steps makes.

    Example:
        >>> import mmreplay as mr, numpy as np, tempfile
        >>> spec = {"obs": mr.ArraySpec((4, 8, 8), "uint8"), "next_obs": mr.ArraySpec((4, 8, 8), "uint8"),
        ...         "terminated": mr.ArraySpec((), "bool")}
        >>> store = mr.create(tempfile.mkdtemp() + "/b", spec, 100, frames=mr.Frames(frame_stack=4))
        >>> [leaf.path for leaf in store.metadata.leaves]
        ['obs', 'terminated', '_frames/next', '_frames/depth']
        >>> store.metadata.leaves[0].spec.shape, store.spec["obs"].shape
        ((8, 8), (4, 8, 8))
    """

    next_observation: str = "derived"
    frame_stack: int = 1
    stack_axis: int | None = None
    pad: str = "repeat"
    final_slots: int | None = None


@dataclass(frozen=True)
class Pair:
    """One observation leaf and the next-observation leaf paired with it."""

    obs: str
    next: str | None
    axis: int | None  # the stack axis in the observation's shape (None: not stacked)


@dataclass(frozen=True)
class FramesLayout:
    """The frames-once layout of a buffer, as recorded in ``mmreplay.json`` (``"frames"``)."""

    derived: bool
    frame_stack: int
    pad: str
    final_slots: int
    pairs: tuple[Pair, ...]
    side: tuple[Any, ...] = ()  # the side ring's LeafInfo, placed by the backend

    @property
    def stacked(self) -> bool:
        return self.frame_stack > 1

    @property
    def shrink(self) -> int:
        """Steps after the oldest retained one that cannot be read once steps were dropped."""
        return self.frame_stack - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "next_observation": "derived" if self.derived else "stored",
            "frame_stack": self.frame_stack,
            "pad": self.pad,
            "final_slots": self.final_slots,
            "pairs": [
                {"observation": p.obs, "next_observation": p.next, "stack_axis": p.axis} for p in self.pairs
            ],
            "side": [leaf.to_json() for leaf in self.side],
        }

    def frame_spec(self, spec: ArraySpec, pair: Pair) -> ArraySpec:
        if pair.axis is None:
            return spec
        shape = spec.shape[: pair.axis] + spec.shape[pair.axis + 1 :]
        return ArraySpec(shape, spec.dtype)

    def physical(self, spec: Any) -> list[tuple[str, ArraySpec]]:
        """The leaves stored for ``spec`` (path, spec), in order: the spec's leaves with
        each observation leaf as one frame and derived next observations left out, then
        the per-row leaves of the layout."""
        by_obs = {p.obs: p for p in self.pairs}
        nexts = {p.next for p in self.pairs if p.next is not None} if self.derived else set()
        out = []
        for path, s in zip(leaf_paths(spec), flatten(spec)):
            if path in nexts:
                continue
            out.append((path, self.frame_spec(s, by_obs[path]) if path in by_obs else s))
        if self.derived:
            out.append((NEXT_LEAF, ArraySpec((), "int64")))
        if self.stacked:
            out.append((DEPTH_LEAF, ArraySpec((), "uint8")))
        return out

    def side_specs(self, spec: Any) -> list[tuple[str, ArraySpec]]:
        """The side ring's leaves: one next frame per observation leaf, and ``ref``
        (sequence number + 1, and the step of the row that needs it)."""
        if not self.derived:
            return []
        out = []
        for i, pair in enumerate(self.pairs):
            out.append((f"frame{i}", self.frame_spec(subtree(spec, pair.obs), pair)))
        out.append(("ref", ArraySpec((2,), "int64")))
        return out


def commit_slots(capacity: int, num_envs: int, commit_every: int) -> int:
    """Side-ring slots the commits of a ring's worth of steps take: one per env each."""
    return num_envs * -(-capacity // reserved_ahead(capacity, commit_every))


def plan_layout(
    spec: Any, roles: dict[str, str], frames: Frames, capacity: int, num_envs: int, commit_every: int
) -> FramesLayout:
    """The layout for a spec and its roles (validated; no I/O)."""
    if not isinstance(frames, Frames):
        raise SpecError(f"frames must be a mmreplay.Frames, got {type(frames).__name__}")
    if frames.next_observation not in NEXT_OBSERVATIONS:
        raise SpecError(
            f"frames.next_observation must be one of {NEXT_OBSERVATIONS}, got {frames.next_observation!r}"
        )
    k = frames.frame_stack
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 1 <= k <= 255:
        raise SpecError(f"frames.frame_stack must be an int in [1, 255], got {k!r}")
    if frames.pad not in PADS:
        raise SpecError(f"frames.pad must be one of {PADS}, got {frames.pad!r}")
    paths = leaf_paths(spec)
    if any(p == PREFIX or p.startswith(PREFIX + "/") for p in paths):
        raise SpecError(f"spec leaves under {PREFIX!r} clash with the frames layout's own leaves")
    if "observation" not in roles:
        raise SpecError(f"frames: the spec has no observation role (leaves: {', '.join(paths)}); pass roles=")
    derived = frames.next_observation == "derived"
    if derived and "next_observation" not in roles:
        raise SpecError("frames.next_observation='derived' needs a next_observation role (a leaf to derive)")
    if k > 1 and not derived and "next_observation" in roles:
        raise SpecError(
            "frames.frame_stack > 1 with a next_observation leaf needs next_observation='derived'"
        )
    obs_root, next_root = roles["observation"], roles.get("next_observation")
    obs_node = subtree(spec, obs_root)
    obs_paths = _under(paths, obs_root)
    next_paths: list[str | None] = [None] * len(obs_paths)
    if derived:
        next_node = subtree(spec, next_root)
        if spec_to_json(obs_node) != spec_to_json(next_node):
            raise SpecError(
                f"frames: next_observation {next_root!r} must have the observation's structure and leaves; "
                f"got {next_node} vs {obs_node}"
            )
        next_paths = list(_under(paths, next_root))
    pairs = []
    for obs_path, next_path in zip(obs_paths, next_paths):
        s = subtree(spec, obs_path)
        axis = _stack_axis(s, k, frames.stack_axis, obs_path) if k > 1 else None
        pairs.append(Pair(obs_path, next_path, axis))
    if k > capacity:
        raise SpecError(f"frames.frame_stack={k} needs a capacity of at least {k} steps, got {capacity}")
    slots = frames.final_slots
    if slots is None:  # each commit takes one slot per env, each episode end one
        slots = commit_slots(capacity, num_envs, commit_every) + num_envs * 4 + capacity * num_envs // 64
    if not isinstance(slots, (int, np.integer)) or isinstance(slots, bool) or slots < 2 * num_envs:
        raise SpecError(f"frames.final_slots must be an int >= 2 * num_envs = {2 * num_envs}, got {slots!r}")
    return FramesLayout(derived, int(k), frames.pad, int(slots) if derived else 0, tuple(pairs))


def _under(paths: list[str], root: str) -> list[str]:
    return [p for p in paths if p == root or p.startswith(root + "/")]


def _stack_axis(spec: ArraySpec, k: int, given: int | None, path: str) -> int:
    nd = len(spec.shape)
    if given is None:
        if nd and spec.shape[-1] == k:
            return nd - 1
        if nd and spec.shape[0] == k:
            return 0
        raise SpecError(f"frames: observation leaf {path!r} {spec.shape} has no axis of frame_stack={k}")
    axis = given + nd if given < 0 else given
    if not 0 <= axis < nd or spec.shape[axis] != k:
        raise SpecError(f"frames: observation leaf {path!r} {spec.shape} has no stack of {k} at axis {given}")
    return axis


def layout_from_json(obj: Any, spec: Any, parse_leaf: Any, where: str) -> FramesLayout:
    """The layout recorded in a buffer's metadata, validated against its spec."""
    try:
        if not isinstance(obj, dict):
            raise ValueError("expected an object")
        k = obj["frame_stack"]
        slots = obj["final_slots"]
        if not isinstance(k, int) or not 1 <= k <= 255 or not isinstance(slots, int) or slots < 0:
            raise ValueError("bad frame_stack or final_slots")
        if obj["pad"] not in PADS or obj["next_observation"] not in NEXT_OBSERVATIONS:
            raise ValueError("bad pad or next_observation")
        pairs = []
        paths = set(leaf_paths(spec))
        for p in obj["pairs"]:
            obs, nxt, axis = p["observation"], p["next_observation"], p["stack_axis"]
            if obs not in paths or (nxt is not None and nxt not in paths):
                raise ValueError(f"pair {obs!r}, {nxt!r} names leaves not in the spec")
            if axis is not None:
                _stack_axis(subtree(spec, obs), k, axis, obs)
            elif k > 1:
                raise ValueError(f"pair {obs!r} has no stack axis")
            pairs.append(Pair(obs, nxt, axis))
        derived = obj["next_observation"] == "derived"
        layout = FramesLayout(derived, k, obj["pad"], slots, tuple(pairs))
        side = tuple(parse_leaf(leaf, max(slots, 1)) for leaf in obj["side"])
        want = [(p, s.shape, s.dtype) for p, s in layout.side_specs(spec)]
        if [(leaf.path, leaf.spec.shape, leaf.spec.dtype) for leaf in side] != want:
            raise ValueError("the side ring's leaves do not match the spec")
        return replace(layout, side=side)
    except (KeyError, TypeError, ValueError, SpecError) as exc:
        raise CorruptBufferError(f"{where}: 'frames' is not a valid frames layout: {exc}") from None


def side_metadata(meta: Any) -> Any:
    """A metadata record for the side ring (capacity ``final_slots``, one env), for the backend."""
    layout = meta.frames
    spec = {leaf.path: leaf.spec for leaf in layout.side}
    return replace(
        meta, capacity=layout.final_slots, num_envs=1, spec=spec, leaves=tuple(layout.side), frames=None
    )


def only_ref(side: Any) -> Any:
    """The side ring's metadata with its ``ref`` leaf alone (always uncompressed, mapped)."""
    return replace(side, leaves=tuple(leaf for leaf in side.leaves if leaf.path == "ref"))


def side_state(meta: Any, written: int) -> State:
    """The side ring's slots written so far, as a committed window of the side ring."""
    slots = meta.frames.final_slots
    return State(start=max(0, written - slots), end=written, reserved=written)


def side_source(source: ByteSource) -> ByteSource:
    """The side ring's objects in a store's (a local one: a real folder of it, never a link)."""
    try:
        return source.child(SIDE_DIR)
    except (FileNotFoundError, NotADirectoryError):
        raise CorruptBufferError(f"{source.where(SIDE_DIR)}: the side ring's folder is missing") from None


def create_side(module: Any, folder: str, meta: Any, side_infos: list[Any]) -> list[Any]:
    """Create the side ring's files in ``folder/frames`` with the buffer's backend."""
    side_folder = os.path.join(folder, SIDE_DIR)
    os.mkdir(side_folder)
    return module.create(side_folder, side_infos, meta.frames.final_slots, 1)
