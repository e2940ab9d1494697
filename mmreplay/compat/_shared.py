"""What the compatibility layers share: their store's life cycle, ring size and reopen check.

Each layer is an adapter over one :class:`mmreplay.Store`; these helpers create it (in a
temporary folder removed with its owner, if no path is given) with a ring that keeps the
layer's window across a crash, refuse to reopen another buffer, and keep the origin a
layer's own cursor counts from.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..creation import create, named_differences
from ..errors import CorruptBufferError, SpecError, SpecMismatchError
from ..metadata import METADATA_FILE
from ..roles import infer_roles, validate_roles
from ..spec import flatten, leaf_paths
from ..statefile import reserved_ahead
from ..store import Store, open

__all__ = [
    "StoreShell",
    "StoreOptions",
    "ring_capacity",
    "create_store",
    "attach_store",
    "check_same",
    "temporary",
    "lenient_roles",
    "describe",
    "read_origin",
    "write_origin",
    "clear_steps",
]


def ring_capacity(n: int, commit_every: int) -> int:
    """The capacity that keeps the newest ``n`` steps across a crash and a reopen: a writer
    reserves slots ahead of what it wrote (:func:`~mmreplay.statefile.reserved_ahead`),
    and a reopened store counts reserved slots as gone."""
    capacity = n
    while _window(capacity, commit_every) < n:
        capacity += 1
    return capacity


def _window(capacity: int, commit_every: int) -> int:
    return capacity - reserved_ahead(capacity, commit_every)


@dataclass
class StoreOptions:
    """How a layer's store is created: :func:`mmreplay.create`'s options, and the sampler's."""

    backend: str | None = None
    compression: Any = None
    chunk_steps: Any = None
    commit_every: int = 1
    durability: str | None = None
    sampler: Any = None
    sampler_options: Mapping[str, Any] = field(default_factory=dict)

    def create_kwargs(self) -> dict[str, Any]:
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "sampler_options"}
        return {**kwargs, **self.sampler_options}


def describe(spec: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """(leaf path, shape, dtype) of every leaf: what must agree for a reopen."""
    return [(p, s.shape, s.dtype.name) for p, s in zip(leaf_paths(spec), flatten(spec))]


def lenient_roles(spec: Any) -> dict[str, None]:
    """Roles to drop: the inferred ones the spec cannot hold (e.g. a vector reward), so
    that a framework's own spec (a multi-objective reward) is still storable."""
    drop: dict[str, None] = {}
    inferred = infer_roles(spec)
    for role in inferred:
        try:
            validate_roles(spec, {r: None for r in inferred if r != role})
        except SpecError:
            drop[role] = None
    return drop


class StoreShell:
    """The life cycle every layer shares: a context manager whose ``close()`` commits
    and releases the store, deleting it when it is a temporary one. Safe twice."""

    store: Store | None

    def close(self) -> None:
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
    """A temporary folder holding a layer's store (a layer that replaces its store sets
    :attr:`store`); :meth:`remove` closes the store and deletes the folder."""

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
    """A :class:`TempFolder` removed with ``owner``: at ``owner._cleanup()`` (what
    :meth:`StoreShell.close` calls) or when ``owner`` is garbage-collected."""
    temp = TempFolder()
    owner._temp = temp
    owner._cleanup = weakref.finalize(owner, temp.remove)
    return temp


def create_store(path: str, spec: Any, window: int, num_envs: int, options: StoreOptions) -> Store:
    """A store for a layer that shows ``window`` steps per env (:func:`ring_capacity`)."""
    capacity = ring_capacity(window, options.commit_every)
    return create(path, spec, capacity, num_envs, roles=lenient_roles(spec), **options.create_kwargs())


def attach_store(
    owner: Any,
    path: str | os.PathLike | None,
    spec: Any,
    window: int,
    num_envs: int,
    options: StoreOptions,
    what: str = "buffer",
    window_name: str = "capacity",
) -> Store:
    """Open the buffer at ``path`` (refusing another, :func:`check_same`) or create it;
    without ``path``, in a temporary folder removed with ``owner`` (:func:`temporary`)."""
    if path is None:
        temp = temporary(owner)
        temp.store = create_store(os.path.join(temp.folder, "buffer"), spec, window, num_envs, options)
        return temp.store
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, METADATA_FILE)):
        return create_store(path, spec, window, num_envs, options)
    store = open(path, "a")
    check_same(store, spec, window, num_envs, what, window_name, options)
    return store


def check_same(store: Store, spec: Any, window: int, num_envs: int, what: str, window_name: str,
               options: StoreOptions | None = None) -> None:  # fmt: skip
    """Refuse (closing the store, leaving its folder as it is) a buffer other than the one
    the caller describes (``spec`` None: any leaves), or than ``options`` name: the store's
    own commit policy (the layers size their ring by theirs) always passes."""
    diffs = []
    if options is not None:
        named = {k: v for k, v in options.create_kwargs().items() if k != "commit_every"}
        diffs += named_differences(store, named)
    if spec is not None and (have := describe(store.spec)) != (want := describe(spec)):
        missing = ", ".join(f"{p} {s} {d}" for p, s, d in want if (p, s, d) not in have) or "nothing"
        extra = ", ".join(f"{p} {s} {d}" for p, s, d in have if (p, s, d) not in want) or "nothing"
        diffs.append(f"leaves differ: existing has {extra} where the new spec has {missing}")
    if store.capacity != ring_capacity(window, store.metadata.commit_every):
        diffs.append(f"{window_name}: existing {_window(store.capacity, store.metadata.commit_every)} vs new {window}")
    if store.num_envs != num_envs:
        diffs.append(f"num_envs: existing {store.num_envs} vs new {num_envs}")
    if diffs:
        path = store.path
        store.close()
        raise SpecMismatchError(f"{path}: a different {what} exists there ({'; '.join(diffs)})")


#: the store attribute holding the global step id a layer's own cursor counts from
ORIGIN_ATTR = "compat_origin"


def read_origin(store: Store) -> int:
    """The global step id a layer's cursor counts from (0 unless moved): a store attribute,
    as the store's own oldest step also moves when old slots are given up. ``reset``
    moves it to ``total_steps``; a cursor set by hand may put it below 0."""
    origin = store.attrs.get(ORIGIN_ATTR, 0)
    if not isinstance(origin, int) or isinstance(origin, bool) or abs(origin) > 1 << 62:
        raise CorruptBufferError(f"{store.path}: attribute {ORIGIN_ATTR!r} must be an int, got {origin!r:.40}")
    return origin


def write_origin(store: Store, origin: int) -> None:
    """Persist the origin in the store's metadata (atomically, with its state)."""
    store.set_attrs(**{ORIGIN_ATTR: int(origin)})


def clear_steps(store: Store) -> int:
    """Drop every step, the origin moving to the store's step count: it is written first,
    so a crash before the clear still shows no steps. Returns the new origin."""
    store.commit()
    origin = store.total_steps
    write_origin(store, origin)
    store.clear()
    return origin
