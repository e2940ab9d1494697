"""``zarr``: a zarr v3 group, one ``[steps, num_envs, *shape]`` array per leaf path.

Groups mirror the nest, the steps are in time order, chunks run along the step axis,
and the group's ``mmreplay`` attribute holds the spec and roles. Read it with
``zarr.open_group(path)`` or ``dask.array.from_zarr``.
"""

from __future__ import annotations

from typing import Any

from ..spec import flatten
from ._base import (
    ExportResult,
    StepBlocks,
    Target,
    check_compression,
    disk_usage,
    reject_complete_only,
    spec_json,
)

COMPRESSIONS = ("zstd", "blosc", "gzip")
#: bytes per chunk aimed at (along the step axis)
CHUNK_BYTES = 4 << 20


def _codec(compression: str | None) -> Any:
    from zarr.codecs import BloscCodec, BloscShuffle, GzipCodec, ZstdCodec

    if compression is None:
        return None
    codec, _, rest = compression.partition(":")
    parts = [p for p in rest.split(":") if p]
    if codec == "zstd":
        return ZstdCodec(level=int(parts[0]) if parts else 3)
    if codec == "gzip":
        return GzipCodec(level=int(parts[0]) if parts else 5)
    cname = parts.pop(0) if parts and not parts[0].isdigit() else "zstd"
    return BloscCodec(cname=cname, clevel=int(parts[0]) if parts else 5, shuffle=BloscShuffle.shuffle)


def write(
    store: Any,
    out: str,
    *,
    compression: str | None,
    complete_only: bool,
    force: bool,
    progress: Any,
    **options: Any,
) -> ExportResult:
    if options:
        raise TypeError(f"zarr export: unexpected options {sorted(options)}")
    reject_complete_only("zarr", complete_only)
    comp = check_compression("zarr", compression, COMPRESSIONS)
    try:
        import zarr
    except ImportError as exc:
        raise ImportError("the zarr export needs zarr: pip install 'zarr>=3'") from exc
    target = Target(out, "folder", force, recognise="zarr.json")
    try:
        specs = flatten(store.spec)
        step_bytes = max(1, store.num_envs * max(s.nbytes for s in specs))
        chunk_steps = max(1, CHUNK_BYTES // step_bytes)
        blocks = StepBlocks(store, align=chunk_steps)
        root = zarr.open_group(target.path(), mode="w", zarr_format=3)
        root.attrs["mmreplay"] = spec_json(store)
        codec = _codec(comp)
        arrays = []
        for path, spec in zip(store.leaf_paths, specs):
            shape = (blocks.steps, store.num_envs, *spec.shape)
            arrays.append(
                root.create_array(
                    path,
                    shape=shape,
                    dtype=spec.dtype,
                    chunks=(max(1, min(chunk_steps, blocks.steps)), store.num_envs, *spec.shape),
                    compressors=[codec] if codec is not None else None,
                    fill_value=0,
                )
            )
        for a, leaves in blocks:
            lo = a - blocks.first
            for arr, values in zip(arrays, leaves):
                arr[lo : lo + len(values)] = values
            progress(len(leaves[0]) * store.num_envs)
        path = target.commit()
    except BaseException:
        target.abort()
        raise
    return ExportResult("zarr", path, 0, blocks.steps * store.num_envs, disk_usage(path))
