"""``parquet``: one row per step, episode after episode, in ``part-<k>.parquet`` files.

Columns: ``episode_index``, ``env``, ``step`` (within the episode), ``global_step`` (the
store's step id), then the roles -- ``observation`` (a nested observation as
``observation.<key>`` columns), ``next_observation.*``, ``action.*``, ``reward`` --
then ``terminated``, ``truncated``, ``is_first``, ``is_last``, then every other leaf by
its path with ``.`` for ``/``. Scalars are plain columns and vectors fixed-size lists;
arrays of more dimensions (images) are flattened into one fixed-size list, and every
array column carries ``shape`` and ``dtype`` in its field metadata to reshape it by (a
flat list reads fast everywhere; nested lists are slow to convert in HF datasets).
Loads with ``pyarrow.parquet.read_table(out)`` and with
``datasets.load_dataset("parquet", data_files=f"{out}/*.parquet")``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ..errors import BadInputError
from ..spec import ArraySpec, flatten, leaf_paths
from ._base import (
    BLOCK_BYTES,
    ExportResult,
    Roles,
    Target,
    Ticker,
    check_compression,
    disk_usage,
    episode_flags,
    episode_total,
    episodes,
    spec_json,
)

COMPRESSIONS = ("snappy", "zstd", "gzip", "brotli", "lz4", "none")
FIRST_FILE = "part-00000.parquet"
#: raw bytes of data per file before the next part file starts
FILE_BYTES = 1 << 30


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("the parquet export needs pyarrow: pip install 'mmreplay[export]'") from exc
    return pa, pq


def role_columns(roles: Roles) -> list[tuple[str, str, ArraySpec]]:
    """(column name, leaf path, spec) for every stored leaf, in column order."""
    specs = dict(zip(roles.paths, flatten(roles.spec)))
    out: list[tuple[str, str, ArraySpec]] = []
    taken: set[str] = set()
    for role in ("observation", "next_observation", "action", "reward"):
        path = roles.get(role)
        if path is None:
            continue
        sub = roles.spec_of(path)
        for rel in leaf_paths(sub) if not isinstance(sub, ArraySpec) else [""]:
            leaf = f"{path}/{rel}" if rel else path
            out.append((role + ("." + rel.replace("/", ".") if rel else ""), leaf, specs[leaf]))
            taken.add(leaf)
    for role in ("terminated", "truncated"):
        path = roles.get(role)
        if path is not None:
            taken.update(roles.leaves_of(path))
    reserved = {
        "episode_index",
        "env",
        "step",
        "global_step",
        "terminated",
        "truncated",
        "is_first",
        "is_last",
    }
    reserved.update(name for name, _, _ in out)
    for leaf in roles.paths:
        if leaf in taken:
            continue
        name = leaf.replace("/", ".")
        if name in reserved:
            name = "leaf." + name
        out.append((name, leaf, specs[leaf]))
    for _, leaf, spec in out:
        if spec.dtype.kind == "c":
            raise BadInputError(f"parquet export: leaf {leaf!r} is {spec.dtype}; Arrow has no complex type")
    return out


def arrow_column(pa: Any, values: np.ndarray) -> Any:
    """Scalars as a plain array, anything else as one flat fixed-size list per row."""
    arr = pa.array(np.ascontiguousarray(values).reshape(-1))
    size = int(np.prod(values.shape[1:], dtype=np.int64))
    return arr if values.ndim == 1 else pa.FixedSizeListArray.from_arrays(arr, size)


def _field(pa: Any, name: str, spec: ArraySpec) -> Any:
    typ = pa.from_numpy_dtype(spec.dtype)
    if spec.shape:
        typ = pa.list_(typ, int(np.prod(spec.shape, dtype=np.int64)))
    meta = {"shape": json.dumps(list(spec.shape)), "dtype": spec.dtype.name} if spec.shape else None
    return pa.field(name, typ, metadata=meta)


def write(
    store: Any,
    out: str,
    *,
    compression: str | None,
    complete_only: bool,
    force: bool,
    progress: Any,
    file_bytes: int = FILE_BYTES,
    **options: Any,
) -> ExportResult:
    if options:
        raise TypeError(f"parquet export: unexpected options {sorted(options)}")
    codec = (
        "snappy"
        if compression is None
        else (check_compression("parquet", compression, COMPRESSIONS) or "none")
    )
    name, _, level = codec.partition(":")
    pa, pq = _pyarrow()
    roles = Roles.of(store)
    columns = role_columns(roles)
    index = {p: i for i, p in enumerate(roles.paths)}
    fields = [
        pa.field("episode_index", pa.int64()),
        pa.field("env", pa.int64()),
        pa.field("step", pa.int64()),
        pa.field("global_step", pa.int64()),
    ]
    fields += [_field(pa, col, spec) for col, _, spec in columns]
    fields += [pa.field(n, pa.bool_()) for n in ("terminated", "truncated", "is_first", "is_last")]
    file_meta = {
        b"mmreplay": json.dumps({**spec_json(store), "columns": {c: p for c, p, _ in columns}}).encode()
    }
    schema = pa.schema(fields, metadata=file_meta)
    scalars = [f.name for f in fields if not pa.types.is_fixed_size_list(f.type)]
    target = Target(out, "folder", force, recognise=FIRST_FILE)
    _, n_steps = episode_total(store, complete_only)
    ticker = Ticker(progress, len(store) * store.num_envs, max(1, n_steps))
    files: list[str] = []
    writer = None
    file_raw = 0
    pending: list[tuple[Any, int]] = []
    pending_bytes = 0

    def open_writer() -> Any:
        path = target.path(f"part-{len(files):05d}.parquet")
        files.append(path)
        return pq.ParquetWriter(
            path,
            schema,
            compression=name,
            compression_level=int(level) if level else None,
            # dictionaries and min/max statistics help scalar columns; over arrays and
            # frames they cost most of the write time and save nothing
            use_dictionary=scalars,
            write_statistics=scalars,
        )

    def flush() -> None:
        nonlocal writer, file_raw, pending, pending_bytes
        if not pending:
            return
        if writer is None or file_raw >= file_bytes:
            if writer is not None:
                writer.close()
            writer = open_writer()
            file_raw = 0
        table = pa.Table.from_batches([b for b, _ in pending], schema=schema)
        writer.write_table(table)
        file_raw += pending_bytes
        pending, pending_bytes = [], 0

    try:
        count = steps = 0
        for ep in episodes(store, complete_only):
            n = ep.length
            if n == 0:
                continue
            leaves = flatten(ep.data)
            term, trunc = episode_flags(ep)
            step = np.arange(n, dtype=np.int64)
            arrays = [
                pa.array(np.full(n, count, np.int64)),
                pa.array(np.full(n, ep.env, np.int64)),
                pa.array(step),
                pa.array(np.arange(ep.first_step, ep.first_step + n, dtype=np.int64)),
            ]
            arrays += [arrow_column(pa, leaves[index[p]]) for _, p, _ in columns]
            arrays += [pa.array(term), pa.array(trunc), pa.array(step == 0), pa.array(step == n - 1)]
            batch = pa.RecordBatch.from_arrays(arrays, schema=schema)
            nbytes = sum(int(np.asarray(leaves[index[p]]).nbytes) for _, p, _ in columns)
            pending.append((batch, nbytes))
            pending_bytes += nbytes
            if pending_bytes >= BLOCK_BYTES:
                flush()
            count += 1
            steps += n
            ticker.advance(n)
        flush()
        if writer is None:  # no episodes: still a readable (empty) dataset
            writer = open_writer()
            writer.write_table(schema.empty_table())
        writer.close()
        writer = None
        path = target.commit()
    except BaseException:
        if writer is not None:
            writer.close()
        target.abort()
        raise
    names = [os.path.join(path, os.path.basename(f)) for f in files]
    return ExportResult("parquet", path, count, steps, disk_usage(path), {"files": names})
