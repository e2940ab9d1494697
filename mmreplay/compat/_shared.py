"""What the compatibility layers share: opening or creating their store, sizing its ring.

Each layer is a thin shell over one :class:`mmreplay.Store`. These helpers decide the
store's capacity for a window of ``n`` steps, open an existing buffer after checking
that it is the one the caller describes, create a new one (or a temporary one, removed
when its owner is closed or collected), and read ``(step, env)`` rows.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import CorruptBufferError, SpecError, SpecMismatchError
from ..metadata import METADATA_FILE
from ..read import gather
from ..roles import infer_roles, validate_roles
from ..spec import flatten, is_namedtuple, leaf_paths
from ..store import Store, create, open

__all__ = [
    "StoreShell",
    "ring_capacity",
    "StoreOptions",
    "attach_store",
    "lenient_roles",
    "read_rows",
    "describe",
    "window_of",
    "check_same",
    "flatten_like",
    "read_origin",
    "write_origin",
]


def ring_capacity(n: int, commit_every: int) -> int:
    """The store capacity that keeps the newest ``n`` steps across a crash and a reopen.

    Before it overwrites old slots a writer reserves them in the committed state, up to
    ``max(1, min(commit_every, capacity // 8))`` steps ahead of what it wrote, and a
    reopened store treats reserved slots as gone. A ring of ``n`` plus that reservation
    therefore still holds ``n`` whole steps after a reopen.
    """
    capacity = n
    while capacity - max(1, min(commit_every, capacity // 8)) < n:
        capacity += 1
    return capacity


class StoreOptions:
    """How a layer's store is created: backend, compression, commit policy, durability."""

    def __init__(
        self,
        backend: str | None = None,
        compression: Any = None,
        chunk_steps: Any = None,
        commit_every: int = 1,
        durability: str = "process",
        sampler: Any = None,
        sampler_options: Mapping[str, Any] | None = None,
    ):
        self.backend = backend
        self.compression = compression
        self.chunk_steps = chunk_steps
        self.commit_every = commit_every
        self.durability = durability
        self.sampler = sampler
        self.sampler_options = dict(sampler_options or {})

    def create_kwargs(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "compression": self.compression,
            "chunk_steps": self.chunk_steps,
            "commit_every": self.commit_every,
            "durability": self.durability,
            "sampler": self.sampler,
            **self.sampler_options,
        }


def describe(spec: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """(leaf path, shape, dtype) of every leaf: what must agree for a reopen."""
    return [(p, s.shape, s.dtype.name) for p, s in zip(leaf_paths(spec), flatten(spec))]


def lenient_roles(spec: Any) -> dict[str, None]:
    """Roles to drop: the inferred ones the spec cannot hold (e.g. a vector reward).

    A framework's own spec (a TF-Agents trajectory with a multi-objective reward) must
    still be storable; such a leaf is stored without its role.
    """
    drop: dict[str, None] = {}
    inferred = infer_roles(spec)
    for role in inferred:
        others = {r: None for r in inferred if r != role}
        try:
            validate_roles(spec, others)
        except SpecError:
            drop[role] = None
    return drop


class StoreShell:
    """The life cycle every layer shares: a context manager whose ``close()`` commits
    and releases the store, deleting it when it is a temporary one. Safe twice."""

    store: Store | None

    def close(self) -> None:
        """Commit and release the store (a temporary one is deleted). Safe twice."""
        cleanup = getattr(self, "_cleanup", None)
        if cleanup is not None:
            cleanup()
        elif self.store is not None:
            self.store.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TempFolder:
    """A temporary folder holding a layer's store; :meth:`remove` closes it and deletes all.

    The layer registers ``weakref.finalize(owner, temp.remove)`` so an owner that is
    garbage-collected without ``close()`` leaves nothing behind; a layer that replaces
    its store updates :attr:`store`.
    """

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="mmreplay-")
        self.store: Store | None = None

    def remove(self) -> None:
        try:
            if self.store is not None:
                self.store.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def temporary(owner: Any) -> TempFolder:
    """A :class:`TempFolder` removed with ``owner`` (``owner._cleanup()`` removes it now)."""
    temp = TempFolder()
    owner._temp = temp
    owner._cleanup = weakref.finalize(owner, temp.remove)
    return temp


def attach_store(
    owner: Any,
    path: str | os.PathLike | None,
    spec: Any,
    window: int,
    num_envs: int,
    options: StoreOptions,
    roles: Mapping[str, Any] | None = None,
    what: str = "buffer",
    window_name: str = "capacity",
) -> tuple[Store, bool]:
    """Open the buffer at ``path`` (checking it matches) or create it; ``(store, created)``.

    The store's capacity is :func:`ring_capacity` of ``window`` steps. Without ``path``
    the store lives in a temporary folder removed when ``owner`` is closed (call
    ``owner._cleanup()``) or garbage-collected.

    Raises:
        SpecMismatchError: a buffer exists at ``path`` with other leaves, window or
            number of envs; it is left untouched.
    """
    if roles is None:
        roles = lenient_roles(spec)
    if path is None:
        temp = temporary(owner)
        capacity = ring_capacity(window, options.commit_every)
        store = create(
            os.path.join(temp.folder, "buffer"),
            spec,
            capacity,
            num_envs,
            roles=roles,
            **options.create_kwargs(),
        )
        temp.store = store
        return store, True
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, METADATA_FILE)):
        store = open(path, "a")
        check_same(store, spec, window, num_envs, what, window_name)
        return store, False
    capacity = ring_capacity(window, options.commit_every)
    store = create(path, spec, capacity, num_envs, roles=roles, **options.create_kwargs())
    return store, True


def window_of(store: Store) -> int:
    """The steps per env a layer's store keeps: its capacity less the writer's reservation."""
    capacity = store.capacity
    return capacity - max(1, min(store.metadata.commit_every, capacity // 8))


def check_same(store: Store, spec: Any, window: int, num_envs: int, what: str, window_name: str) -> None:
    """Refuse (closing the store) a buffer other than the one the caller describes."""
    diffs = []
    have, want = describe(store.spec), describe(spec)
    if have != want:
        missing = [w for w in want if w not in have]
        extra = [h for h in have if h not in want]
        diffs.append(f"leaves differ: existing has {_fmt(extra)} where the new spec has {_fmt(missing)}")
    if store.capacity != ring_capacity(window, store.metadata.commit_every):
        diffs.append(f"{window_name}: existing {window_of(store)} vs new {window}")
    if store.num_envs != num_envs:
        diffs.append(f"num_envs: existing {store.num_envs} vs new {num_envs}")
    if diffs:
        path = store.path
        store.close()
        raise SpecMismatchError(f"{path}: a different {what} exists there ({'; '.join(diffs)})")


def _fmt(leaves: list[tuple[str, tuple[int, ...], str]]) -> str:
    if not leaves:
        return "nothing"
    return ", ".join(f"{p} {s} {d}" for p, s, d in leaves)


def flatten_like(spec: Any, value: Any) -> list[Any] | None:
    """Leaves of ``value`` walked along ``spec``'s nest (so a list *value* stays one leaf),
    or None where the structures differ (the store's validator then names the place)."""
    out: list[Any] = []

    def walk(s: Any, v: Any) -> bool:
        if isinstance(s, Mapping):
            if not isinstance(v, Mapping) or set(v) != set(s):
                return False
            return all(walk(s[k], v[k]) for k in sorted(s))
        if is_namedtuple(s) and isinstance(v, Mapping):
            if set(v) != set(s._fields):
                return False
            return all(walk(x, v[f]) for f, x in zip(s._fields, s))
        if isinstance(s, (tuple, list)):
            if not isinstance(v, (tuple, list)) or len(v) != len(s):
                return False
            return all(walk(x, y) for x, y in zip(s, v))
        out.append(v)
        return True

    return out if walk(spec, value) else None


#: the store attribute holding the global step id a layer's ids and cursor count from
ORIGIN_ATTR = "compat_origin"


def read_origin(store: Store) -> int:
    """The global step id a layer's ids and cursor count from (0 unless moved).

    ``clear`` / ``reset`` move it to the store's ``total_steps``; a migrated memory may set
    it below 0 to keep its cursor phase. It is a store attribute because the store's own
    ``state.start`` also moves when old slots are given up.
    """
    origin = store.attrs.get(ORIGIN_ATTR, 0)
    if not isinstance(origin, int) or isinstance(origin, bool) or abs(origin) > 1 << 62:
        raise CorruptBufferError(f"{store.path}: attribute {ORIGIN_ATTR!r} must be an int, got {origin!r:.40}")
    return origin


def write_origin(store: Store, origin: int) -> None:
    """Persist the origin in the store's metadata (atomically, with its state)."""
    store.set_attrs(**{ORIGIN_ATTR: int(origin)})


def read_rows(store: Store, steps: np.ndarray, envs: np.ndarray) -> list[np.ndarray]:
    """Leaf arrays (flatten order) of the rows ``(steps[i...], envs[i...])``, broadcast
    together (:func:`mmreplay.read.read_rows`; a writer reads its uncommitted rows too)."""
    return [np.asarray(x) for x in flatten(gather.read_rows(store, steps, envs))]
