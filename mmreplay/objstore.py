"""Object storage as an operation: how a store's objects are laid out there (push and
pull use it), an export written to a URL, and a store checked in place.

Reading a store in object storage is no separate path: ``mmreplay.open("s3://...")``
opens it over its prefix as a byte source (:mod:`mmreplay.io.remote`), where every
request's failure becomes an mmreplay error. A mapped leaf is kept there as a zarr v3
sharded array whose shards are C-order blocks of whole steps followed by their index
(:func:`shard_layout`), so a row is one byte range of one shard object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import tempfile
from typing import Any

import numpy as np

from .errors import BadInputError, CorruptBufferError, RemoteError, TargetError
from .io.remote import HDF5_REFUSED, ObjectPrefix, gather_bounded, split_url
from .metadata import LeafInfo, Metadata, little_endian, read_metadata
from .statefile import State

__all__ = ["UPLOADS_IN_FLIGHT", "export_to_url", "shard_key", "shard_layout", "verify_url"]

UPLOADS_IN_FLIGHT = 8


def shard_layout(prefix: ObjectPrefix, leaf: LeafInfo) -> tuple[str, int]:
    """(zarr array key, steps per shard) of a mapped leaf in object storage, from its
    ``zarr.json``: one shard of the whole leaf (a copied folder) or several (a push)."""
    key = f"data.zarr/{leaf.path}/zarr.json"
    where = prefix.where(key)
    try:
        raw = prefix.read(key, 1 << 20, "the array metadata")
    except FileNotFoundError:
        raise CorruptBufferError(f"{where}: the array metadata of leaf {leaf.path!r} is missing") from None
    try:
        doc = json.loads(raw)
        steps = int(doc["chunk_grid"]["configuration"]["chunk_shape"][0])
        codec = doc["codecs"][0]
        inner = int(codec["configuration"]["chunk_shape"][0])
        inner_codecs = [c["name"] for c in codec["configuration"]["codecs"]]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise CorruptBufferError(f"{where}: not the zarr metadata of a sharded leaf ({exc!r})") from None
    if (
        codec.get("name") != "sharding_indexed"
        or inner_codecs != ["bytes"]
        or steps % inner
        or inner != leaf.chunk_steps
    ):
        raise CorruptBufferError(
            f"{where}: leaf {leaf.path!r} expected uncompressed shards of chunks of {leaf.chunk_steps} steps, "
            f"found {codec.get('name')} with chunks of {inner} steps and codecs {inner_codecs}"
        )
    return f"data.zarr/{leaf.path}", steps


def shard_key(leaf: LeafInfo, k: int) -> str:
    """The object of shard ``k`` of a mapped leaf (the ``[capacity, num_envs, *shape]``
    array is cut along its first axis only)."""
    return f"data.zarr/{leaf.path}/c/{k}" + "/0" * (1 + len(leaf.spec.shape))


def export_to_url(write: Any, url: str, force: bool, storage_options: dict[str, Any] | None) -> Any:
    """Run ``write(local_path)`` into a temporary folder, then upload what it wrote under
    ``url``: a file to the URL's key, a folder's files below it. The result names the URL."""
    _, key = split_url(url)
    if not key:
        raise BadInputError(f"{url!r}: name the export's key below the bucket (s3://bucket/path)")
    name = key.rsplit("/", 1)[-1]
    with tempfile.TemporaryDirectory(prefix="mmreplay-export-") as tmp:
        local = os.path.join(tmp, name)
        result = write(local)
        if os.path.isfile(local):  # one file: its key is the URL
            location = ObjectPrefix(url.rstrip("/").rpartition("/")[0], storage_options)
            files = [(local, name)]
            there = {name: 0} if location.exists(name) else {}
        else:
            location = ObjectPrefix(url, storage_options)
            files = [
                (os.path.join(d, f), os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/"))
                for d, _, names in os.walk(local)
                for f in names
            ]
            there = location.list()
        if there and not force:
            raise TargetError(
                f"{url}: objects exist there already; pass force=True (--force) to replace them"
            )

        async def upload(file: tuple[str, str]) -> None:
            data = await asyncio.to_thread(pathlib.Path(file[0]).read_bytes)
            await location.put_async(file[1], data)

        location.run(gather_bounded(upload, files, UPLOADS_IN_FLIGHT))
        location.delete(sorted(set(there) - {k for _, k in files}))
    base = url.rstrip("/")

    def remote(value: Any) -> Any:  # local paths of what was written -> their URLs
        if isinstance(value, str) and (value == local or value.startswith(local + os.sep)):
            rel = os.path.relpath(value, local).replace(os.sep, "/")
            return base if rel == "." else f"{base}/{rel}"
        if isinstance(value, list):
            return [remote(v) for v in value]
        return value

    return dataclasses.replace(
        result, path=remote(result.path), info={k: remote(v) for k, v in result.info.items()}
    )


def verify_url(url: str, deep: bool = True, storage_options: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with the store at ``url`` (empty: healthy): its metadata and state,
    each mapped leaf's shard objects (present, whole, with the index zarr readers need)
    and each compressed leaf's chunk objects that hold committed steps (``deep``: they
    decode too); the same of the side ring of a store that keeps each frame once, over
    the slots written so far."""
    from . import frames_layout as frames
    from .backends import zarr_v3
    from .verify.checks import check_episode_index

    location = ObjectPrefix(url, storage_options)
    try:
        meta = read_metadata(location)
    except CorruptBufferError as exc:
        return [str(exc)]
    if meta.backend != "zarr":
        return [f"{location.url}: {HDF5_REFUSED}"]
    problems = [
        f"{location.where('/'.join(filter(None, (zarr_v3.DATA_DIR, group, 'zarr.json'))))}: "
        "zarr group metadata is missing or damaged"
        for group in zarr_v3.bad_groups(location, meta)
    ]
    problems.extend(_verify_leaves(location, meta, deep))
    check_episode_index(location, meta, deep, problems)
    if meta.frames is not None and meta.frames.side:
        side_location = location.child(frames.SIDE_DIR)
        side = frames.side_metadata(meta)
        where = f"the side ring of next frames ({side_location.url})"
        found = _verify_leaves(side_location, side.with_state(State()), False)
        if not found:
            try:
                (ref,) = zarr_v3.open_leaves(side_location, frames.only_ref(side), False)
                written = int(np.asarray(ref.read(slice(None))).reshape(-1, 2)[:, 0].max(initial=0))
            except CorruptBufferError as exc:
                found, written = [f"does not open: {exc}"], 0
            if written:
                found = _verify_leaves(side_location, side.with_state(frames.side_state(meta, written)), deep)
        problems.extend(f"{where}: {text}" for text in found)
    return problems


def _verify_leaves(location: ObjectPrefix, meta: Metadata, deep: bool) -> list[str]:
    """:func:`verify_url`'s checks of the leaves of ``meta`` under ``location``."""
    from .backends.checks import chunks_of, leaf_shape
    from .backends.row_codec import is_row_compression
    from .backends.zarr_source import chunk_key
    from .backends.zarr_v3 import shard_index

    problems: list[str] = []
    listing = location.list()
    for leaf in meta.leaves:
        where = f"leaf {leaf.path!r}"
        if leaf.mapped:
            try:
                array_key, steps = shard_layout(location, leaf)
                arr = _open_array(location, array_key, leaf, meta)
            except CorruptBufferError as exc:
                problems.append(f"{where}: {exc}")
                continue
            expected = leaf_shape(meta, leaf)
            if arr.shape != expected or arr.dtype != little_endian(leaf.spec.dtype):
                problems.append(
                    f"{where}: {location.where(array_key)}/zarr.json: expected {expected} {leaf.spec.dtype}, "
                    f"the array is {arr.shape} {arr.dtype} (zarr readers would read other values)"
                )
            m = steps // leaf.chunk_steps
            chunk_bytes = leaf.chunk_steps * meta.num_envs * leaf.spec.nbytes
            index = shard_index(m, chunk_bytes).tobytes()
            for k in range(-(-meta.capacity // steps)):
                key = shard_key(leaf, k)
                size = listing.get(key)
                if size is None:
                    problems.append(f"{where}: shard object {location.where(key)} is missing")
                elif size != m * chunk_bytes + len(index):
                    problems.append(
                        f"{where}: shard object {location.where(key)} has {size} bytes, "
                        f"expected {m * chunk_bytes + len(index)}"
                    )
                elif location.read(key, len(index), "a shard index", m * chunk_bytes, size) != index:
                    problems.append(
                        f"{where}: {location.where(key)}: the shard index does not point at its block"
                    )
            continue
        rel = f"data.zarr/{leaf.path}"
        try:
            arr = _open_array(location, rel, leaf, meta)
        except CorruptBufferError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if is_row_compression(leaf.compression):
            problems.extend(_row_leaf_problems(location, meta, leaf, listing, deep))
            continue
        for k in chunks_of(meta, leaf):
            key = f"{rel}/{chunk_key(arr, k)}"
            if key not in listing:
                problems.append(
                    f"{where}: chunk object {location.where(key)} is missing (it holds committed steps)"
                )
            elif deep:
                a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
                try:
                    np.asarray(arr[a:b])
                except RemoteError:
                    raise  # the object store failed, not the chunk
                except Exception as exc:
                    problems.append(f"{where}: chunk object {location.where(key)} does not decode ({exc})")
    return problems


def _open_array(location: ObjectPrefix, rel: str, leaf: LeafInfo, meta: Metadata) -> Any:
    """The leaf's zarr array; zarr's refusal of its metadata (gone, cut short, not JSON)
    is a :class:`CorruptBufferError` naming the object."""
    from .backends.zarr_source import open_array

    try:
        return open_array(location, rel, leaf, meta.num_envs, meta.capacity, False)
    except (CorruptBufferError, RemoteError):
        raise
    except Exception as exc:
        raise CorruptBufferError(f"{location.where(rel)}/zarr.json: zarr cannot open the array ({exc})") from None


def _row_leaf_problems(location: ObjectPrefix, meta: Metadata, leaf: LeafInfo, listing: dict[str, int], deep: bool) -> list[str]:
    """A row-frame leaf's staging object, and the shard object of each segment with
    retained committed rows outside staging (``deep``: those rows read as a reader reads
    them, each frame decoded)."""
    from .backends.row_reads import STAGING_FILE
    from .backends.zarr_v3 import STAGING_HEAD_BYTES, open_leaves, segments_outside_staging, staging_segment

    where = f"leaf {leaf.path!r}"
    key = f"data.zarr/{leaf.path}/{STAGING_FILE}"
    if key not in listing:
        return [f"{where}: staging file {location.where(key)} is missing"]
    head = location.read(key, STAGING_HEAD_BYTES, "a staging header", 0, min(listing[key], STAGING_HEAD_BYTES))
    staged, why = staging_segment(head, listing[key], location.where(key), meta, leaf)
    if why:
        return [f"{where}: {why}"]
    try:
        (reads,) = open_leaves(location, dataclasses.replace(meta, leaves=(leaf,)), False)
    except CorruptBufferError as exc:
        return [str(exc)]
    problems: list[str] = []
    for k, steps in segments_outside_staging(meta, leaf, staged):
        shard = reads.shard_key(k)
        if shard not in listing:
            problems.append(f"{where}: shard object {location.where(shard)} (segment {k}) is missing (it holds committed steps)")
        elif deep:
            rows = (k * leaf.chunk_steps + np.asarray(steps))[:, None] * meta.num_envs + np.arange(meta.num_envs)
            try:
                reads.take(rows.reshape(-1))
            except CorruptBufferError as exc:
                problems.append(str(exc))
    reads.close()
    return problems
