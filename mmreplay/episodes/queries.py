"""What readers ask of the episode index: spans, episodes with their data, bounds, and
flat D4RL-style arrays over every episode.

Each answer covers the store's committed window (a writer's: its steps added so far),
env by env, each env's episodes in time order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..read.gather import check_retained
from ..roles import subtree
from ..spec import leaf_paths, unflatten
from .ends import EpisodeSource
from .index import index_for
from .index_file import TERMINATED
from .spans import Spans


@dataclass(frozen=True)
class EpisodeSpan:
    """Where one episode lies: its env, first and last global step id (inclusive) and how
    it ended: ``"terminated"``, ``"truncated"`` or ``"open"`` (still running at the
    cursor, or its start was overwritten by the ring). ``ended`` is how its last step
    ended whether or not its start is retained: ``"terminated"``, ``"truncated"`` or
    ``"running"``."""

    env: int
    first_step: int
    last_step: int
    status: str
    ended: str = field(default="", compare=False)

    @property
    def length(self) -> int:
        return self.last_step - self.first_step + 1


@dataclass(frozen=True, eq=False)
class Episode:
    """One episode of one env with its data: a nest shaped like ``store.spec`` whose
    leaves are ``[length, *shape]`` arrays. ``ended`` is how its last step ended
    (``"terminated"``, ``"truncated"`` or ``"running"``), also when the ring overwrote its
    start (``status`` is then ``"open"``)."""

    env: int
    first_step: int
    last_step: int
    status: str
    data: Any = field(repr=False)
    ended: str = ""

    @property
    def length(self) -> int:
        return self.last_step - self.first_step + 1

    @property
    def span(self) -> EpisodeSpan:
        return EpisodeSpan(self.env, self.first_step, self.last_step, self.status, self.ended)

    def __repr__(self) -> str:
        return (
            f"Episode(env={self.env}, first_step={self.first_step}, last_step={self.last_step}, "
            f"length={self.length}, status={self.status!r})"
        )


def select_spans(store: EpisodeSource, env: int | None, complete_only: bool) -> Spans:
    """The spans of the window, of one env (checked) or all, complete ones only or all."""
    store.check_open()
    spans = index_for(store).spans(store)
    if env is not None:
        if not isinstance(env, (int, np.integer)) or isinstance(env, bool) or not 0 <= env < store.num_envs:
            raise ValueError(f"env must be an int in [0, {store.num_envs}), got {env!r}")
        spans = spans.select(spans.env == env)
    if complete_only:
        spans = spans.select(spans.complete)
    return spans


def episode_index(store: EpisodeSource, env: int | None = None, complete_only: bool = False) -> list[EpisodeSpan]:
    """The :class:`EpisodeSpan` of each episode, as :func:`episodes` orders them, from
    the episode index alone (no data is read)."""
    spans = select_spans(store, env, complete_only)
    return [
        EpisodeSpan(
            int(spans.env[i]), int(spans.first[i]), int(spans.last[i]), spans.status(i), spans.ended(i)
        )
        for i in range(len(spans))
    ]


def episode_bounds(store: EpisodeSource, steps: np.ndarray, envs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first, last, complete)`` of the episode each row ``(steps[i], envs[i])`` of the
    window lies in: its first and last retained step, and whether it ended and its start
    is retained. A row in no episode (a TF-Agents boundary row) is its own one-step
    episode, not complete."""
    spans = index_for(store).spans(store)
    steps = np.asarray(steps, np.int64)
    envs = np.asarray(envs, np.int64)
    if not len(spans):
        return steps.copy(), steps.copy(), np.zeros(steps.shape, bool)
    blocks = np.searchsorted(spans.env, np.arange(store.num_envs + 1))  # env e's spans: blocks[e]:blocks[e + 1]
    i = np.full(steps.shape, -1, np.int64)
    for env in np.unique(envs).tolist():
        rows = envs == env
        a, b = blocks[env], blocks[env + 1]
        found = np.searchsorted(spans.first[a:b], steps[rows], side="right") - 1
        i[rows] = np.where(found >= 0, a + found, -1)
    j = np.maximum(i, 0)
    inside = (i >= 0) & (spans.last[j] >= steps)
    first = np.where(inside, spans.first[j], steps)
    last = np.where(inside, spans.last[j], steps)
    return first, last, inside & (spans.code[j] > 0) & ~spans.cut[j]


def complete_spans(store: EpisodeSource) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(envs, first, last)``: for each env with complete episodes, the first step of its
    first complete one and the last step of its last. They are consecutive: only an env's
    first episode may have lost its start, only its last be still running (TF-Agents
    boundary rows between them belong to none)."""
    spans = index_for(store).spans(store)
    blocks = np.searchsorted(spans.env, np.arange(store.num_envs + 1))
    a, b = blocks[:-1], blocks[1:] - 1  # each env's first and last span (a > b: none)
    has = a <= b
    a, b = np.where(has, a, 0), np.where(has, b, 0)
    if len(spans):
        a = a + ~((spans.code[a] > 0) & ~spans.cut[a])  # its first span, unless cut or running
        b = b - (spans.code[b] == 0)  # its last, unless running
    has &= a <= b
    envs = np.flatnonzero(has)
    return envs, spans.first[a[has]], spans.last[b[has]]


def episodes(store: EpisodeSource, env: int | None = None, complete_only: bool = False) -> Iterator[Episode]:
    """Each episode of the committed window with its data, env by env, in time order.

    Yields :class:`mmreplay.episodes.Episode` (env, first and last global step id,
    status ``"terminated"``, ``"truncated"`` or ``"open"``, and ``data``: the spec's
    nest of ``[length, *shape]`` arrays). ``complete_only`` skips open episodes.

    Example:
        >>> import mmreplay as mr, numpy as np, tempfile
        >>> spec = {"x": mr.ArraySpec((), "int64"), "terminated": mr.ArraySpec((), "bool")}
        >>> store = mr.create(tempfile.mkdtemp() + "/b", spec, 10)
        >>> store.extend({"x": np.arange(5)[:, None], "terminated": np.array([[0], [1], [0], [0], [0]], bool)})
        >>> store.commit()
        >>> [(ep.first_step, ep.last_step, ep.status) for ep in store.episodes()]
        [(0, 1, 'terminated'), (2, 4, 'open')]
    """
    spans = select_spans(store, env, complete_only)
    capacity, num_envs = store.capacity, store.num_envs

    def gen() -> Iterator[Episode]:
        for i in range(len(spans)):
            a, b, e = int(spans.first[i]), int(spans.last[i]), int(spans.env[i])
            rows = (np.arange(a, b + 1, dtype=np.int64) % capacity) * num_envs + e
            store.check_open()
            data = [leaf.take(rows) for leaf in store.leaves]
            check_retained(store, a, own_adds=True)  # the writer may have added since the spans
            yield Episode(e, a, b, spans.status(i), unflatten(store.spec, data), spans.ended(i))

    return gen()


def fresh_envs(store: EpisodeSource, step: int) -> list[int]:
    """The envs whose episode at global step ``step`` starts there, whole.

    A copy that begins at ``step`` passes these to :func:`~mmreplay.episodes.index_file.continue_index`; in every
    other env the copy's first episode began earlier, so it stays ``"open"``.
    """
    if step <= 0:
        return list(range(store.num_envs))
    spans = select_spans(store, None, False)
    whole = (spans.first == step) & ~spans.cut
    return sorted({int(e) for e in spans.env[whole]})


# --- offline arrays ---------------------------------------------------------------

_ROLE_KEYS = {"observation": "observations", "action": "actions", "reward": "rewards"}
_END_ROLES = ("terminated", "truncated", "step_type", "next_step_type", "discount")


def _rows(first: np.ndarray, last: np.ndarray, env: np.ndarray, capacity: int, num_envs: int) -> np.ndarray:
    """Flat row ids of every step of the spans, concatenated."""
    lengths = last - first + 1
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    steps = np.repeat(first, lengths) + offsets
    return (steps % capacity) * num_envs + np.repeat(env, lengths)


def _role_leaves(store: EpisodeSource, role: str) -> tuple[Any, list[int]] | None:
    """The spec node and leaf numbers of a role (a leaf or a subtree)."""
    path = store.roles.get(role)
    if path is None:
        return None
    paths = store.leaf_paths
    idx = [i for i, p in enumerate(paths) if p == path or p.startswith(path + "/")]
    return subtree(store.spec, path), idx


def to_arrays(store: EpisodeSource) -> dict[str, Any]:
    """Every committed episode as flat D4RL-style arrays, env by env, episode by episode.

    Keys: ``observations``, ``actions``, ``rewards`` (from the roles present),
    ``terminals`` and ``timeouts`` (bool, never both set: a terminated episode ends
    with ``terminals``, a truncated or still open one with ``timeouts``),
    ``next_observations``, and ``infos/<leaf path>`` for leaves with no role. With a
    ``next_observation`` leaf every step is kept; otherwise a step's next observation
    is the next step's observation in the episode, and the last step of an episode
    that did not terminate is dropped (its next observation is not stored; the step
    before it carries the episode's ``timeouts``). A terminal step's
    ``next_observations`` row repeats its own observation (no TD target uses it).
    """
    spans = select_spans(store, None, False)
    capacity, num_envs = store.capacity, store.num_envs
    length = spans.length
    terminated = (spans.code == TERMINATED) & (length > 0)
    obs_role = _role_leaves(store, "observation")
    next_role = _role_leaves(store, "next_observation")
    # Without a next_observation leaf, a step's next observation is the next step's
    # observation; the last step of an episode has none stored, so it is dropped unless
    # the episode terminated (its next observation never enters a TD target).
    keep_len = (
        length if next_role is not None or obs_role is None else np.where(terminated, length, length - 1)
    )
    keep = keep_len > 0
    first, env, keep_len, term = spans.first[keep], spans.env[keep], keep_len[keep], terminated[keep]
    rows = _rows(first, first + keep_len - 1, env, capacity, num_envs)
    ends = np.cumsum(keep_len) - 1
    n = len(rows)
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    terminals[ends[term]] = True
    timeouts[ends[~term]] = True
    out: dict[str, Any] = {}
    used: set[int] = set()
    leaves = store.leaves

    def gather(role_info: tuple[Any, list[int]], r: np.ndarray) -> Any:
        node, idx = role_info
        return unflatten(node, [leaves[i].take(r) for i in idx])

    for role, key in _ROLE_KEYS.items():
        info = _role_leaves(store, role)
        if info is None:
            continue
        used.update(info[1])
        value = gather(info, rows)
        if role == "reward" and isinstance(value, np.ndarray) and value.ndim == 2 and value.shape[1] == 1:
            value = value.reshape(-1)
        out[key] = value
    out["terminals"] = terminals
    out["timeouts"] = timeouts
    if next_role is not None:
        used.update(next_role[1])
        out["next_observations"] = gather(next_role, rows)
    elif obs_role is not None:
        steps_next = rows // num_envs + 1  # slot of the next step (mod capacity below)
        next_rows = (steps_next % capacity) * num_envs + rows % num_envs
        next_rows[ends[term]] = rows[ends[term]]  # a terminal step's own observation, never used
        out["next_observations"] = gather(obs_role, next_rows)
    for role in _END_ROLES:
        info = _role_leaves(store, role)
        if info is not None:
            used.update(info[1])
    for i, path in enumerate(leaf_paths(store.spec)):
        if i not in used:
            out[f"infos/{path}"] = leaves[i].take(rows)
    if len(first):
        check_retained(store, int(first.min()))
    return out
