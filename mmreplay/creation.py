"""Creating a buffer: the layout planned from a spec and the options (:func:`plan`,
which :func:`mmreplay.estimate` also reads), and the folder made whole before it
appears (:func:`create`)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from . import backends, frames_layout
from .errors import DiskFullError, SpecError, SpecMismatchError
from .files import (
    interrupts_deferred,
    make_folders,
    raise_named,
    remove_dead_scratch,
    rename_made,
    scratch_path,
)
from .lock import WriterLock
from .metadata import (
    DURABILITIES,
    METADATA_FILE,
    LeafInfo,
    Metadata,
    chunk_too_large,
    read_metadata,
    write_buffer,
)
from .roles import validate_roles
from .samplers.base import Sampler
from .samplers.registry import make_sampler
from .spec import ArraySpec, flatten, leaf_paths, spec_to_json, to_spec
from .store import DEFAULT_COMMIT_EVERY, BufferExistsError, Store, open

__all__ = ["create", "plan"]

log = logging.getLogger(__name__)

#: the most bytes a buffer's leaves may take when full (file offsets are signed 64-bit)
MAX_BUFFER_BYTES = 2**63 - 1

#: aimed size of one chunk of a chunk-compressed leaf
CHUNK_TARGET_BYTES = 4 << 20


def _chunk_steps(leaf: ArraySpec, num_envs: int, capacity: int, given: Any, path: str) -> int:
    if isinstance(given, Mapping):
        given = given.get(path)
    if given is None:
        step_bytes = max(1, num_envs * leaf.nbytes)
        return max(1, min(capacity, CHUNK_TARGET_BYTES // step_bytes))
    return min(_check_int(f"leaf {path!r}: chunk_steps", given, 1), capacity)


def _compression_for(given: Any, path: str) -> str | None:
    if isinstance(given, Mapping):
        given = given.get(path)
    if given is None or given is False:
        return None
    if not isinstance(given, str):
        raise SpecError(f"leaf {path!r}: compression must be a string such as 'zstd', got {given!r}")
    return given.lower()


def _check_int(name: str, value: Any, lo: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < lo:
        raise SpecError(f"{name} must be an int >= {lo}, got {value!r}")
    return int(value)


def plan(
    spec: Any,
    capacity: int,
    num_envs: int = 1,
    backend: str | None = None,
    chunk_steps: int | Mapping[str, int] | None = None,
    compression: str | Mapping[str, str | None] | None = None,
    commit_every: int = DEFAULT_COMMIT_EVERY,
    durability: str = "process",
    roles: Mapping[str, str] | None = None,
    sampler: Any = None,
    frames: frames_layout.Frames | None = None,
) -> Metadata:
    """The metadata :func:`create` would write for these arguments (validated; no I/O).
    Its leaves have no files yet: the backend places them. ``sampler``: a
    :class:`mmreplay.samplers.Sampler` instance (None: uniform)."""
    spec = to_spec(spec)
    leaves_spec = flatten(spec)
    if not leaves_spec or not all(isinstance(s, ArraySpec) for s in leaves_spec):
        raise SpecError("spec must hold at least one array leaf")
    capacity = _check_int("capacity", capacity, 1)
    num_envs = _check_int("num_envs", num_envs, 1)
    commit_every = _check_int("commit_every", commit_every, 1)
    if durability not in DURABILITIES:
        raise SpecError(f"durability must be one of {DURABILITIES}, got {durability!r}")
    backend = backends.for_new_buffer(backend)
    module = backends.get(backend)
    paths = leaf_paths(spec)
    for name, given in (("compression", compression), ("chunk_steps", chunk_steps)):
        unknown = sorted(set(given) - set(paths), key=str) if isinstance(given, Mapping) else []
        if unknown:
            raise SpecError(f"{name} names leaves not in the spec: {unknown} (its leaves: {', '.join(paths)})")
    full = {p: (capacity * num_envs * s.nbytes, s) for p, s in zip(paths, leaves_spec)}
    if sum(n for n, _ in full.values()) > MAX_BUFFER_BYTES:
        big = max(full, key=lambda p: full[p][0])
        n, s = full[big]
        raise SpecError(
            f"leaf {big!r}: {capacity} steps x {num_envs} envs x {s.shape} {s.dtype} take {n} bytes, past the "
            f"{MAX_BUFFER_BYTES} a buffer's files can address; choose a smaller capacity or shape"
        )
    infos = []
    for p, s in zip(paths, leaves_spec):
        if 0 in s.shape:
            raise SpecError(f"leaf {p!r}: shape {s.shape} holds no elements")
        comp = _compression_for(compression, p)
        if comp is not None:
            try:
                module.check_compression(comp)
            except SpecError as exc:
                raise SpecError(f"leaf {p!r}, {backend} backend: {exc}") from None
        infos.append(LeafInfo(p, s, _chunk_steps(s, num_envs, capacity, chunk_steps, p), comp))
    roles_found = validate_roles(spec, roles)
    layout = None
    if frames is not None:
        layout = frames_layout.plan_layout(spec, roles_found, frames, capacity, num_envs, commit_every)
        by_path = {info.path: info for info in infos}
        infos = []
        for p, s in layout.physical(spec):
            given = by_path.get(p)
            comp = given.compression if given is not None else None
            infos.append(LeafInfo(p, s, _chunk_steps(s, num_envs, capacity, chunk_steps if given else None, p), comp))
        side = []
        for (p, s), pair in zip(layout.side_specs(spec), [*layout.pairs, None]):
            comp = by_path[pair.obs].compression if pair is not None else None
            side.append(LeafInfo(p, s, _chunk_steps(s, 1, layout.final_slots, None, p), comp))
        layout = replace(layout, side=tuple(side))
    for info in infos:
        too_large = chunk_too_large(info.compression, info.chunk_steps, num_envs, info.spec)
        if too_large:
            raise SpecError(f"leaf {info.path!r}: {too_large}")
    sampler_json = sampler.state_json() if sampler is not None else {"name": "uniform"}
    return Metadata(
        backend=backend,
        capacity=capacity,
        num_envs=num_envs,
        spec=spec,
        leaves=tuple(infos),
        roles=roles_found,
        commit_every=commit_every,
        durability=durability,
        sampler=None if sampler_json == {"name": "uniform"} else sampler_json,
        frames=layout,
    )


def create(
    path: str | os.PathLike,
    spec: Any,
    capacity: int,
    num_envs: int = 1,
    backend: str | None = None,
    chunk_steps: int | Mapping[str, int] | None = None,
    compression: str | Mapping[str, str | None] | None = None,
    commit_every: int | None = None,
    durability: str | None = None,
    roles: Mapping[str, str] | None = None,
    exist_ok: bool = False,
    sampler: str | Sampler | None = None,
    frames: frames_layout.Frames | None = None,
    **sampler_options: Any,
) -> Store:
    """Create a buffer folder and open it for writing.

    Args:
        path: the folder to create (missing parent folders are created too).
        spec: a nest of :class:`ArraySpec` or anything :func:`mmreplay.spec.to_spec` takes.
        capacity: time steps the ring holds; each step holds ``num_envs`` rows.
        num_envs: parallel environments written per step.
        backend: ``"zarr"`` (zarr v3) or ``"hdf5"``. By default zarr, or hdf5 with a
            warning where zarr-python 3 (the ``zarr`` extra) does not import; a backend
            named here is used or refused (an ImportError naming the extra, nothing made).
        chunk_steps: steps per chunk, for every leaf or per leaf path; default chunks of
            about 4 MiB.
        compression: ``None`` (memory-mapped), a codec such as ``"zstd"``, ``"zstd:5"``,
            ``"blosc"`` or ``"gzip"``, or a dict leaf path -> codec.
        commit_every: steps between automatic commits (None: 1000).
        durability: ``"process"`` (survives the process being killed; the default) or
            ``"power"`` (also syncs the data, then the state file, to the disk at each commit).
        roles: role -> leaf path, overriding the roles inferred from the names.
        exist_ok: if a buffer with the same layout exists there, open it for writing.
            Every other argument given (not None) must match the buffer's.
        sampler: what :meth:`Store.sample` draws through: ``"uniform"`` (the default),
            ``"slices"``, ``"prioritized"``, another registered name, or a
            :class:`mmreplay.samplers.Sampler`; recorded in the metadata, so
            :func:`open` restores it.
        frames: a :class:`mmreplay.Frames` to store each frame once: next observations
            derived from the next step, frame stacks rebuilt from single frames
            (``frames=mr.Frames(frame_stack=4)``); recorded in the metadata.
        sampler_options: the named sampler's parameters (``num_steps=8``, ``alpha=0.6``...).

    Example:
        >>> import mmreplay as mr, tempfile
        >>> store = mr.create(tempfile.mkdtemp() + "/b", {"x": mr.ArraySpec((), "int64")}, 100)
        >>> store.close()
    """
    path = os.fspath(path)
    settings = dict(zip(SETTINGS, (backend, chunk_steps, compression, commit_every, durability, roles, sampler)))
    meta, given, chosen = requested(spec, capacity, num_envs, {**settings, "frames": frames, **sampler_options})
    backend, durability = meta.backend, meta.durability  # hdf5 where zarr-python 3 does not import
    module = backends.get(backend)
    if os.path.lexists(path):
        if exist_ok and os.path.exists(os.path.join(path, METADATA_FILE)):
            return _reopen(path, meta, given)
        if not (os.path.isdir(path) and not os.listdir(path)):
            if exist_ok:
                raise BufferExistsError(f"{path}: already exists and is not a buffer (no {METADATA_FILE}); choose a new path")
            raise BufferExistsError(
                f"{path}: already exists; pass exist_ok=True to reopen a buffer, or choose a new path"
            )
    if any(leaf.compression for leaf in meta.leaves):
        from .backends.row_codec import chunked_picture_advice  # (not imported for mapped stores)

        for leaf in meta.leaves:
            advice = chunked_picture_advice(leaf, meta.num_envs, backend)
            if advice is not None:
                warnings.warn(advice, UserWarning, stacklevel=backends.outside_mmreplay())
    parent = os.path.dirname(os.path.abspath(path))
    need = _check_free_space(path, module, meta)
    log.info("creating %s: %s backend, preallocating %d bytes (%.2f GiB)", path, backend, need, need / 2**30)
    # made whole or not at all: a Ctrl-C waits (zarr-python writes on a thread it does not stop)
    with interrupts_deferred():
        made = make_folders(parent)
        remove_dead_scratch(path)
        tmp = scratch_path(path, "creating")
        lock = WriterLock(tmp)
        try:
            if os.path.lexists(tmp):
                shutil.rmtree(tmp)
            os.mkdir(tmp)
            lock.acquire()
            created = module.create(tmp, list(meta.leaves), meta.capacity, meta.num_envs)
            if meta.frames is not None and meta.frames.side:
                side = frames_layout.create_side(module, tmp, meta, list(meta.frames.side))
                meta = replace(meta, frames=replace(meta.frames, side=tuple(side)))
            meta = write_buffer(tmp, replace(meta, leaves=tuple(created)), fsync=durability == "power")
            rename_made(tmp, path, "buffer")
        except BaseException as exc:
            lock.release()
            shutil.rmtree(tmp, ignore_errors=True)
            for folder in reversed(made):  # a failed create leaves no folder behind
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            if exist_ok and isinstance(exc, BufferExistsError):  # reopen what the other process made
                return _reopen(path, meta, given)
            raise_named(exc, path, "buffer", tmp)
        lock.path = os.path.join(path, os.path.basename(lock.path))
    if durability == "power":
        for folder in {parent, *(os.path.dirname(m) for m in made)}:  # the new entries
            backends.base.fsync_path(folder)
    return Store(path, meta, "a", lock, chosen)


def _existing_ancestor(folder: str) -> str:
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder


def _check_free_space(path: str, module: Any, meta: Metadata) -> int:
    """The bytes creation preallocates (the backend's layout of the uncompressed
    leaves and its metadata); a DiskFullError when the file system has less free."""
    try:
        _, shards, overhead = module.planned_bytes(list(meta.leaves), meta.capacity, meta.num_envs)
    except DiskFullError as exc:  # its plan of the files hit a file size limit: so would the buffer
        raise DiskFullError(f"{path}: {exc}") from None
    parent = _existing_ancestor(os.path.dirname(os.path.abspath(path)))
    need = sum(shards.values()) + overhead
    free = shutil.disk_usage(parent).free
    if need > free:
        raise DiskFullError(
            f"{parent}: the buffer needs {need} bytes ({need / 2**30:.2f} GiB) for its uncompressed leaves, "
            f"the file system has {free} ({free / 2**30:.2f} GiB) free"
        )
    return need


#: what ``create(..., exist_ok=True)`` compares with the buffer's when the caller names it
SETTINGS = ("backend", "chunk_steps", "compression", "commit_every", "durability", "roles", "sampler")


def requested(
    spec: Any, capacity: int, num_envs: int, options: Mapping[str, Any]
) -> tuple[Metadata, set[str], Sampler]:
    """What ``create(path, spec, capacity, num_envs, **options)`` asks: the metadata it
    would write (validated; no I/O), the settings it names (not None; sampler options
    name the sampler) and the sampler."""
    options = dict(options)
    frames = options.pop("frames", None)
    settings = {name: options.pop(name, None) for name in SETTINGS}
    given = {name for name, value in settings.items() if value is not None} | ({"sampler"} if options else set())
    chosen = make_sampler(settings.pop("sampler"), **options)
    named = {name: value for name, value in settings.items() if value is not None}  # the others: plan's defaults
    return plan(spec, capacity, num_envs, sampler=chosen, frames=frames, **named), given, chosen


def differences(have: Metadata, want: Metadata, given: set[str]) -> list[str]:
    """How a buffer ``have`` differs from the one ``want`` asks: its layout, and each
    setting ``given`` (the others take the buffer's)."""
    diffs = []
    if spec_to_json(have.spec) != spec_to_json(want.spec):
        diffs.append(f"spec: existing {have.spec} vs new {want.spec}")
    for name in ("capacity", "num_envs", *SETTINGS):
        if (name in given or name in ("capacity", "num_envs")) and _setting(have, name) != _setting(want, name):
            diffs.append(f"{name}: existing {_setting(have, name)} vs new {_setting(want, name)}")
    frames_have = None if have.frames is None else {**have.frames.to_json(), "side": None}
    frames_want = None if want.frames is None else {**want.frames.to_json(), "side": None}
    if want.frames is not None and frames_have != frames_want:  # (frames not named: the buffer's)
        diffs.append(f"frames: existing {frames_have} vs new {frames_want}")
    return diffs


def named_differences(store: Store, options: Mapping[str, Any]) -> list[str]:
    """How the settings named in ``options`` (create's keywords; None: not named) differ
    from the open ``store``'s: what ``create(exist_ok=True)`` refuses, for the layers
    that reopen a buffer themselves."""
    asked, given, _ = requested(store.spec, store.capacity, store.num_envs, options)
    return differences(store.metadata, asked, given)


def _setting(meta: Metadata, name: str) -> Any:
    if name in ("compression", "chunk_steps"):  # each leaf's
        return {leaf.path: getattr(leaf, name) for leaf in meta.leaves}
    if name == "sampler":
        return meta.sampler or {"name": "uniform"}
    return getattr(meta, name)


def _reopen(path: str, meta: Metadata, given: set[str]) -> Store:
    """The buffer at ``path`` opened for writing, if it has ``meta``'s layout and the
    settings ``given`` (those a caller named; the others take the buffer's): otherwise a
    SpecMismatchError naming each difference, as a setting silently ignored would mislead.
    Compared before the writer opens it too: a writer's close commits (a dead writer's
    reservation dropped), and a refusal changes nothing on disk."""
    _refuse_differences(path, read_metadata(path), meta, given)
    store = open(path, "a")
    try:
        _refuse_differences(store.path, store.metadata, meta, given)  # (as the last writer left it)
    except SpecMismatchError:
        store.close()
        raise
    return store


def _refuse_differences(path: str, have: Metadata, want: Metadata, given: set[str]) -> None:
    diffs = differences(have, want, given)
    if diffs:
        raise SpecMismatchError(f"{path}: a different buffer exists there ({'; '.join(diffs)})")
