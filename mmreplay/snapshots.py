"""Publish a local store to object storage as a consistent snapshot, and bring one back.

:func:`push` uploads only what changed since the previous push: every object's hash is
kept in ``mmreplay.push.json`` beside the snapshot, and an object whose bytes hash the
same is not sent again. A mapped leaf is cut into shards of a few MiB (each a C-order
block of whole steps and its zarr index), so new rows re-send the shards they fall in,
not the leaf. The order makes every moment of a push a readable snapshot:

1. a state object that leaves out the steps whose ring slots the push overwrites (the
   remote twin of the writer's ``reserved``): readers drop those rows, as a local reader
   drops rows a writer overwrites;
2. the changed data objects, then the array metadata, the manifest and ``mmreplay.json``;
3. the new state object, last: from then on readers see the new snapshot.

A push killed at any point leaves the previous snapshot readable (less the steps of
step 1), and the next push completes it. :func:`pull` downloads a snapshot into a new
folder with the local layout (one shard per mapped leaf), ready to open for writing.

The push reads the whole local store once to hash it (the cost of finding ``set`` rewrites
and priority updates as well as new rows).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from .backends import zarr_v3
from .backends.row_reads import STAGING_FILE
from .episodes import index_limit
from .errors import BadInputError, CorruptBufferError, SpecMismatchError, TargetError
from .files import AtomicOutput
from .frames_layout import side_metadata
from .io.local import unsafe_entries
from .io.remote import HDF5_REFUSED, ObjectPrefix, gather_bounded, split_url
from .metadata import MAX_METADATA_BYTES, METADATA_FILE, Metadata, parse_metadata, read_metadata, read_state
from .objstore import UPLOADS_IN_FLIGHT, shard_key, shard_layout
from .spec import spec_to_json
from .statefile import STATE_FILE, State, fresh_bytes, write_fresh
from .store import Store
from .store import open as open_store

__all__ = ["push", "pull", "PushReport"]

MANIFEST = "mmreplay.push.json"
MANIFEST_FORMAT = "mmreplay-push/1"
#: bytes of one shard object of a mapped leaf in object storage (whole chunks)
SHARD_TARGET_BYTES = 8 << 20
#: local files that are not part of a snapshot (locks, a killed writer's leftovers)
_LOCAL_ONLY = (".lock", ".partial")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PushReport:
    """What a push sent: objects and bytes uploaded, of how many, and the state published
    (``steps`` of it retained)."""

    url: str
    steps: int
    uploaded: int
    uploaded_bytes: int
    objects: int
    total_bytes: int
    state: State


def _digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def shard_chunks(leaf: Any, meta: Metadata) -> int:
    """Chunks per shard object of a mapped leaf: about :data:`SHARD_TARGET_BYTES`."""
    nchunks = -(-meta.capacity // leaf.chunk_steps)
    chunk_bytes = max(1, leaf.chunk_steps * meta.num_envs * leaf.spec.nbytes)
    return max(1, min(nchunks, SHARD_TARGET_BYTES // chunk_bytes))


def _objects(folder: str, meta: Metadata) -> Iterator[tuple[str, Any]]:
    """(key, bytes or a function making them) of every object of the snapshot but the state."""
    mapped = {leaf.file: leaf for leaf in meta.leaves if leaf.mapped}
    arrays = {f"{zarr_v3.DATA_DIR}/{leaf.path}/zarr.json": leaf for leaf in meta.leaves if leaf.mapped}
    largest = _largest_file(meta)
    for leaf in mapped.values():
        yield from _shards(folder, leaf, meta)
    for dirpath, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            key = os.path.relpath(path, folder).replace(os.sep, "/")
            if (
                key in (STATE_FILE, METADATA_FILE)
                or key in mapped
                or name.endswith(_LOCAL_ONLY)
                or ".creating-" in name
            ):
                continue
            leaf = arrays.get(key)
            if leaf is not None:  # the sharded array's metadata
                m = shard_chunks(leaf, meta)
                yield key, zarr_v3.array_metadata(leaf, meta.capacity, meta.num_envs, m)
            elif name == STAGING_FILE:
                # read before its shards are listed: a segment the writer seals later is
                # still in this copy, and one it left is in a shard the listing finds
                yield key, _bytes_of(path)
            else:
                size = os.lstat(path).st_size
                if size > largest:
                    raise CorruptBufferError(
                        f"{path}: {size} bytes, more than all this buffer can hold ({largest}); push sends nothing"
                    )
                yield key, path


def _largest_file(meta: Metadata) -> int:
    """The most bytes one file of a store can hold: all its rows (the side ring's too),
    each compressed at worst, its episode index and priorities, and room for metadata."""
    parts = [meta] + ([side_metadata(meta)] if meta.frames is not None and meta.frames.side else [])
    rows = sum(
        m.capacity * m.num_envs * (leaf.spec.nbytes + leaf.spec.nbytes // 128 + 64) for m in parts for leaf in m.leaves
    )
    return rows + index_limit(meta.capacity, meta.num_envs) + 4 * meta.capacity * meta.num_envs + (64 << 20)


def _shards(folder: str, leaf: Any, meta: Metadata) -> Iterator[tuple[str, Any]]:
    """The shard objects of a mapped leaf: its block cut into runs of whole chunks."""
    m = shard_chunks(leaf, meta)
    nchunks = -(-meta.capacity // leaf.chunk_steps)
    chunk_bytes = leaf.chunk_steps * meta.num_envs * leaf.spec.nbytes
    index = zarr_v3.shard_index(m, chunk_bytes).tobytes()
    path = os.path.join(folder, leaf.file or "")

    def shard(k: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(k * m * chunk_bytes)
            data = f.read(min(m, nchunks - k * m) * chunk_bytes)
        return data.ljust(m * chunk_bytes, b"\0") + index

    for k in range(-(-nchunks // m)):
        yield shard_key(leaf, k), (lambda k=k: shard(k))


def _static(meta: Metadata) -> Any:
    return (
        meta.backend,
        meta.capacity,
        meta.num_envs,
        json.dumps(spec_to_json(meta.spec), sort_keys=True),
        [(leaf.path, leaf.chunk_steps, leaf.compression) for leaf in meta.leaves],
    )


def _read_manifest(location: ObjectPrefix) -> dict[str, str]:
    try:
        raw = location.read(MANIFEST, 1 << 28, "a push manifest")
    except FileNotFoundError:
        return {}
    try:
        doc = json.loads(raw)
        if doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("objects"), dict):
            raise ValueError(f"format {doc.get('format')!r}")
        return {str(k): str(v) for k, v in doc["objects"].items()}
    except (ValueError, AttributeError) as exc:
        log.warning("%s: unreadable (%s); every object is sent again", location.where(MANIFEST), exc)
        return {}


def _gap_state(old: State, new: State) -> State:
    """The previous snapshot without the steps whose slots the push overwrites."""
    if new.end < old.end or new.start < old.start:  # another history: keep none of the old rows
        return old.next(start=old.end, reserved=max(old.reserved, old.end))
    return old.next(reserved=max(old.reserved, new.end, new.reserved))


def push(source: Any, url: str, storage_options: dict[str, Any] | None = None) -> PushReport:
    """Publish the committed state of ``source`` (a store folder, or an open
    :class:`mmreplay.Store`, whose writer commits first) to ``url`` (``s3://bucket/prefix``).

    Only objects whose bytes changed since the last push are sent; the state object goes
    last, so readers see the previous snapshot until the new one is complete. A store
    written by another process meanwhile is published at the commit read first, less
    the steps the writer overwrote while they were read.
    """
    split_url(url)  # a mistyped URL before anything is read or committed
    if isinstance(source, Store):
        if source.mode == "a":
            source.commit()
        folder = source.path
        if source.location is not None:
            raise TargetError(f"{folder}: is already in object storage; pull it to push it elsewhere")
    elif isinstance(source, (str, os.PathLike)):
        folder = os.fspath(source)
    else:  # (a Group: each of its shards is a store to push)
        raise BadInputError(
            f"push takes a store or its folder, got a {type(source).__name__}; push a group's shards one by one"
        )
    unsafe = unsafe_entries(folder)  # every file is read and sent: none may lead outside
    if unsafe:
        raise CorruptBufferError(f"{unsafe[0]}; push sends nothing from a folder holding such files")
    meta = read_metadata(folder)
    if meta.format_version == 1:
        raise CorruptBufferError(
            f"{folder}: a format-1 store; open it for writing once (it is migrated), then push"
        )
    if not isinstance(source, Store):  # its files must agree with its metadata, as a reader's do
        open_store(folder, "r", populate=False).close()
    if meta.backend != "zarr":
        raise CorruptBufferError(
            f"{folder}: a {meta.backend} store cannot be pushed to object storage; "
            "convert it to the zarr backend first (mmreplay convert --backend zarr)"
        )
    location = ObjectPrefix(url, storage_options)
    try:
        remote_meta_raw = location.read(METADATA_FILE, MAX_METADATA_BYTES, "a store's metadata")
    except FileNotFoundError:
        remote_meta_raw = None
    old_state: State | None = None
    if remote_meta_raw is None:  # no store there yet, or a first push cut short: nothing else may be
        ours = set(os.listdir(folder)) | {MANIFEST}
        foreign = sorted(k for k in location.list() if k.split("/", 1)[0] not in ours)
        if foreign:
            raise TargetError(
                f"{location.url}: holds objects of no mmreplay store ({location.where(foreign[0])}"
                f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); push to a new prefix"
            )
    else:
        remote = parse_metadata(remote_meta_raw, location.where(METADATA_FILE))
        if _static(remote) != _static(meta):
            raise SpecMismatchError(
                f"{location.url}: holds another store (backend, capacity, num_envs, spec or leaves differ "
                f"from {folder}); push to a new prefix"
            )
        try:
            old_state = read_state(location)
        except CorruptBufferError:
            old_state = None  # an earlier first push was cut short: nothing is readable yet
    manifest = _read_manifest(location)
    state = meta.state
    # the reservation readers of the previous snapshot see: before an object is sent, it
    # covers every step whose slot that object's bytes may have rewritten
    shown = [old_state.reserved if old_state is not None else 0]
    if old_state is not None:
        gap = _gap_state(old_state, state)
        if gap.first(meta.capacity) != old_state.first(meta.capacity):
            location.put(STATE_FILE, fresh_bytes(gap))
            shown[0] = gap.reserved
    state_lock = asyncio.Lock()

    async def reserve_for_readers() -> None:
        """A writer in another process moved on while the object was read: first hide
        the steps it may have overwritten from the previous snapshot's readers."""
        if old_state is None:
            return  # nothing published yet: no reader to protect
        now = read_state(folder)
        if now.reserved <= shown[0]:
            return
        async with state_lock:
            if now.reserved > shown[0]:
                moved = replace(state, reserved=max(state.reserved, now.reserved))
                gap = _gap_state(old_state, moved)
                await location.put_async(STATE_FILE, fresh_bytes(gap))
                shown[0] = gap.reserved

    sent = [0, 0]
    total = [0, 0]
    hashes: dict[str, str] = {}

    async def upload_changed(item: tuple[str, Any]) -> None:
        key, what = item
        data = await asyncio.to_thread(_bytes_of, what)
        digest = _digest(data)
        hashes[key] = digest
        total[0] += 1
        total[1] += len(data)
        if manifest.get(key) != digest:
            await reserve_for_readers()
            await location.put_async(key, data)
            sent[0] += 1
            sent[1] += len(data)
            log.info("%s: uploaded %s (%d bytes)", location.url, key, len(data))

    # in phases: a row-frame leaf's staging after the shards its writer sealed (readers
    # then find the rows that left staging), the arrays' metadata after their data
    items = list(_objects(folder, meta))
    for phase in (_DATA, _STAGING, _ARRAY_METADATA):
        in_phase = [item for item in items if _phase(item[0]) == phase]
        location.run(gather_bounded(upload_changed, in_phase, UPLOADS_IN_FLIGHT))
    # A writer in another process may have overwritten steps while they were read:
    # publish without them, as a local reader's seqlock check drops them.
    now = read_state(folder)
    published = replace(state, reserved=max(state.reserved, now.reserved))
    location.put(
        MANIFEST, json.dumps({"format": MANIFEST_FORMAT, "objects": hashes}, sort_keys=True).encode()
    )
    with open(os.path.join(folder, METADATA_FILE), "rb") as f:
        location.put(METADATA_FILE, f.read())
    location.put(STATE_FILE, fresh_bytes(published))
    location.delete(sorted(set(manifest) - set(hashes)))
    log.info("%s: pushed %d of %d objects (%d bytes)", location.url, sent[0], total[0], sent[1])
    steps = published.end - published.first(meta.capacity)
    return PushReport(location.url, steps, sent[0], sent[1], total[0], total[1], published)


_DATA, _STAGING, _ARRAY_METADATA = range(3)


def _phase(key: str) -> int:
    if key.endswith("zarr.json"):
        return _ARRAY_METADATA
    return _STAGING if key.rsplit("/", 1)[-1] == STAGING_FILE else _DATA


def _bytes_of(what: Any) -> bytes:
    if isinstance(what, bytes):
        return what
    if callable(what):
        return what()
    with open(what, "rb") as f:
        return f.read()


def pull(url: str, folder: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> str:
    """Download the snapshot at ``url`` into the new folder ``folder`` (local layout, ready
    for ``mmreplay.open(folder, mode="a")``); returns the folder's path."""
    folder = os.path.abspath(os.fspath(folder))
    if os.path.lexists(folder) and not (os.path.isdir(folder) and not os.listdir(folder)):
        raise TargetError(f"{folder}: already exists; pull into a new folder")
    location = ObjectPrefix(url, storage_options)
    meta = read_metadata(location)
    first = meta.state
    if meta.backend != "zarr":
        raise CorruptBufferError(f"{location.url}: {HDF5_REFUSED}")
    with AtomicOutput(folder, "folder", "pulled store") as scratch:
        tmp = scratch.tmp
        _download(location, meta, tmp)
        last = read_state(location)
        if last.end < first.end or last.start < first.start:
            raise CorruptBufferError(
                f"{location.url}: a push of another history replaced the store while it was pulled; pull again"
            )
        # steps a push overwrote or dropped while they were downloaded are left out, as a reader would
        state = replace(
            first, start=min(first.end, max(first.start, last.start)), reserved=max(first.reserved, last.reserved)
        )
        write_fresh(tmp, state, fsync=True)
        _check_opens(tmp, location)
        return scratch.commit()


def _check_opens(tmp: str, location: ObjectPrefix) -> None:
    """What a pull downloaded opens as a store, before it takes the folder's name; its
    damage is named in object storage."""
    try:
        open_store(tmp, "r", populate=False).close()
    except CorruptBufferError as exc:
        raise CorruptBufferError(f"{location.url}: the pulled copy does not open: {str(exc).replace(tmp, location.url)}") from None


def _download(location: ObjectPrefix, meta: Metadata, tmp: str) -> None:
    mapped = {f"{zarr_v3.DATA_DIR}/{leaf.path}": leaf for leaf in meta.leaves if leaf.mapped}
    keys = location.list()
    wanted = [
        k
        for k in keys
        if k not in (STATE_FILE, MANIFEST) and not any(k == a or k.startswith(a + "/") for a in mapped)
    ]

    async def fetch(key: str) -> None:
        raw, _ = await location.get_async(key)
        path = os.path.join(tmp, *key.split("/"))
        if os.path.relpath(path, tmp).startswith(".."):
            raise CorruptBufferError(f"{location.where(key)}: the key leaves the store's folder")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(bytes(raw))

    # staging first: a push sends it after the shards its writer sealed, so the shards
    # fetched next hold the rows that left the staging fetched
    staging = [k for k in wanted if _phase(k) == _STAGING]
    for keys in (staging, [k for k in wanted if k not in staging]):
        location.run(gather_bounded(fetch, keys, UPLOADS_IN_FLIGHT))
    for leaf in mapped.values():
        _assemble(location, meta, leaf, tmp)


def _assemble(location: ObjectPrefix, meta: Metadata, leaf: Any, tmp: str) -> None:
    """A mapped leaf back in the local layout: one shard file, from the shard objects."""
    array_key, steps = shard_layout(location, leaf)
    nchunks = -(-meta.capacity // leaf.chunk_steps)
    chunk_bytes = leaf.chunk_steps * meta.num_envs * leaf.spec.nbytes
    data_bytes = nchunks * chunk_bytes
    shard_bytes = (steps // leaf.chunk_steps) * chunk_bytes
    folder = os.path.join(tmp, *array_key.split("/"))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "zarr.json"), "wb") as f:
        f.write(zarr_v3.array_metadata(leaf, meta.capacity, meta.num_envs))
    path = os.path.join(tmp, *(leaf.file or "").split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        for k in range(-(-data_bytes // max(1, shard_bytes)) if data_bytes else 0):
            key = shard_key(leaf, k)
            try:
                raw = location.read(key, shard_bytes + nchunks * 16, "a shard object")
            except FileNotFoundError:
                raise CorruptBufferError(f"{location.where(key)}: shard object missing") from None
            f.write(raw[: min(shard_bytes, data_bytes - k * shard_bytes)])
        f.write(zarr_v3.shard_index(nchunks, chunk_bytes).tobytes())
    if os.path.getsize(path) != data_bytes + nchunks * 16:
        raise CorruptBufferError(
            f"{location.where(array_key)}: the shards of leaf {leaf.path!r} are cut short"
        )
