"""``parquet``: one row per step, episode after episode, in ``part-<k>.parquet`` files.

Columns: ``episode_index``, ``env``, ``step`` (within the episode), ``global_step`` (the
store's step id), then the roles -- ``observation`` (a nested observation as
``observation.<key>`` columns), ``next_observation.*``, ``action.*``, ``reward`` --
then ``terminated``, ``truncated`` (how the episode's last step ended; a step that both
terminated and was truncated keeps both), ``is_first``, ``is_last``, then every other leaf by
its path with ``.`` for ``/``. Scalars are plain columns and vectors fixed-size lists;
leaves of two or more dimensions (images) are fixed-size binary values, the raw
little-endian C-order bytes of each row, with ``shape`` and ``dtype`` in the field's
metadata (:func:`decode_image` turns a column back into an array). Parquet writes list
columns an element at a time, which made frames about 15 times slower to write. Loads
with ``pyarrow.parquet.read_table(out)`` and with
``datasets.load_dataset("parquet", data_files=f"{out}/*.parquet")``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadInputError, UnsupportedFormatError
from ..spec import ArraySpec, flatten, leaf_paths, spec_from_json
from .base import (
    BLOCK_BYTES,
    Episodes,
    Roles,
    Source,
    Target,
    block_steps,
    episode_flags,
    pyarrow,
    spec_json,
)

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult

COMPRESSIONS = ("snappy", "zstd", "gzip", "brotli", "lz4", "none")
#: raw bytes of data per file before the next part file starts
FILE_BYTES = 1 << 30
#: the columns before the leaves, the roles written as columns, and the flags after them
INDEX_COLUMNS = ("episode_index", "env", "step", "global_step")
ROLE_COLUMNS = ("observation", "next_observation", "action", "reward")
FLAG_COLUMNS = ("terminated", "truncated", "is_first", "is_last")


def role_columns(roles: Roles) -> list[tuple[str, str, ArraySpec]]:
    """(column name, leaf path, spec) for every stored leaf, in column order."""
    specs = dict(zip(roles.paths, flatten(roles.spec)))
    out: list[tuple[str, str, ArraySpec]] = []
    for role in ROLE_COLUMNS:
        path = roles.get(role)
        for leaf in roles.leaves_of(path) if path else []:
            rel = leaf[len(path) + 1 :].replace("/", ".")
            out.append((f"{role}.{rel}" if rel else role, leaf, specs[leaf]))
    reserved = {*INDEX_COLUMNS, *FLAG_COLUMNS, *(name for name, _, _ in out)}
    for leaf in roles.extras():
        name = leaf.replace("/", ".")
        out.append(("leaf." + name if name in reserved else name, leaf, specs[leaf]))
    for _, leaf, spec in out:
        if spec.dtype.kind == "c":
            raise BadInputError(f"parquet export: leaf {leaf!r} is {spec.dtype}; Arrow has no complex type")
    return out


def is_image(spec: ArraySpec) -> bool:
    """Leaves of two or more dimensions are stored as raw bytes per row."""
    return len(spec.shape) >= 2


def arrow_column(pa: Any, values: np.ndarray) -> Any:
    """Scalars as a plain array, vectors as fixed-size lists, images as fixed-size binary."""
    values = np.ascontiguousarray(values)
    n = len(values)
    if values.ndim >= 3:
        raw = values.astype(values.dtype.newbyteorder("<"), copy=False).reshape(n, -1).view(np.uint8)
        return pa.FixedSizeBinaryArray.from_buffers(pa.binary(raw.shape[1]), n, [None, pa.py_buffer(raw)])
    arr = pa.array(values.reshape(-1))
    return arr if values.ndim == 1 else pa.FixedSizeListArray.from_arrays(arr, values.shape[1])


def decode_image(column: Any, shape: Any, dtype: Any) -> np.ndarray:
    """The ``[rows, *shape]`` array of an image column: a pyarrow (chunked) array, the
    ``|S<n>`` array HF datasets gives with ``with_format("numpy")``, or a list of bytes."""
    dtype = np.dtype(dtype).newbyteorder("<")
    if isinstance(column, np.ndarray) and column.dtype.kind == "S":
        # the buffer holds every byte (indexing an |S array would strip trailing NULs)
        return np.ascontiguousarray(column).view(np.uint8).view(dtype).reshape(-1, *shape)
    if hasattr(column, "combine_chunks"):
        column = column.combine_chunks()
    if hasattr(column, "buffers"):
        data = np.frombuffer(column.buffers()[1], np.uint8)
        size = int(np.prod(shape)) * dtype.itemsize
        data = data[column.offset * size : (column.offset + len(column)) * size]
    else:
        data = np.frombuffer(b"".join(bytes(b) for b in column), np.uint8)
    return data.view(dtype).reshape(-1, *shape)


def _field(pa: Any, name: str, spec: ArraySpec) -> Any:
    if is_image(spec):
        typ = pa.binary(spec.nbytes)
    else:
        typ = pa.from_numpy_dtype(spec.dtype)
        if spec.shape:
            typ = pa.list_(typ, int(spec.shape[0]))
    meta = None
    if spec.shape:
        meta = {"shape": json.dumps(list(spec.shape)), "dtype": spec.dtype.name}
        if is_image(spec):
            meta["encoding"] = "raw little-endian C-order bytes"
    return pa.field(name, typ, metadata=meta)


def write(store: Exportable, out: str, options: ExportOptions, file_bytes: int = FILE_BYTES) -> ExportResult:
    name, _, level = (options.compression or "snappy").partition(":")
    pa, pq = pyarrow("the parquet format", "export")
    roles = Roles.of(store)
    columns = role_columns(roles)
    index = {p: i for i, p in enumerate(roles.paths)}
    fields = [pa.field(n, pa.int64()) for n in INDEX_COLUMNS]
    fields += [_field(pa, col, spec) for col, _, spec in columns]
    fields += [pa.field(n, pa.bool_()) for n in FLAG_COLUMNS]
    file_meta = {
        b"mmreplay": json.dumps({**spec_json(store), "columns": {c: p for c, p, _ in columns}}).encode()
    }
    schema = pa.schema(fields, metadata=file_meta)
    scalars = [
        f.name
        for f in fields
        if not (pa.types.is_fixed_size_list(f.type) or pa.types.is_fixed_size_binary(f.type))
    ]
    files: list[str] = []
    writer = None
    file_raw = 0
    pending: list[Any] = []  # record batches
    pending_bytes = 0

    target = Target(out, "folder", "parquet", store, options)

    def open_writer() -> Any:
        path = target.path(f"part-{len(files):05d}.parquet")
        files.append(path)
        return pq.ParquetWriter(
            path,
            schema,
            compression=name,
            compression_level=int(level) if level else None,
            # dictionaries and min/max statistics help scalar columns; over vectors they
            # cost most of the write time and save little
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
        writer.write_table(pa.Table.from_batches(pending, schema=schema))
        file_raw += pending_bytes
        pending, pending_bytes = [], 0

    with target:
        try:
            count = steps = 0
            for ep in Episodes(store, options):
                n = ep.length
                leaves = flatten(ep.data)
                term, trunc = episode_flags(ep, roles.get("truncated"))
                step = np.arange(n, dtype=np.int64)
                arrays = [
                    pa.array(np.full(n, count, np.int64)),
                    pa.array(np.full(n, ep.env, np.int64)),
                    pa.array(step),
                    pa.array(np.arange(ep.first_step, ep.first_step + n, dtype=np.int64)),
                ]
                arrays += [arrow_column(pa, leaves[index[p]]) for _, p, _ in columns]
                arrays += [pa.array(term), pa.array(trunc), pa.array(step == 0), pa.array(step == n - 1)]
                pending.append(pa.RecordBatch.from_arrays(arrays, schema=schema))
                pending_bytes += sum(int(np.asarray(leaves[index[p]]).nbytes) for _, p, _ in columns)
                if pending_bytes >= BLOCK_BYTES:
                    flush()
                count += 1
                steps += n
            flush()
            if writer is None:  # no episodes: still a readable (empty) dataset
                writer = open_writer()
                writer.write_table(schema.empty_table())
            writer.close()
            writer = None
            names = [os.path.join(target.out, os.path.basename(f)) for f in files]
            return target.finish(count, steps, {"files": names})
        except BaseException:
            if writer is not None:
                with contextlib.suppress(Exception):  # (a full disk fails its close too)
                    writer.close()
            raise


# --- the import ------------------------------------------------------------------------


def parquet_files(src: str) -> list[str]:
    return sorted(
        os.path.join(src, n) for n in os.listdir(src) if n.endswith(".parquet") and not n.startswith(".")
    )


def _leaf_values(column: Any, spec: ArraySpec, image: bool) -> np.ndarray:
    """The ``[rows, *shape]`` values of a leaf's column (a pyarrow array)."""
    if image:
        values = decode_image(column, spec.shape, spec.dtype)
    elif spec.shape:
        values = column.flatten().to_numpy(zero_copy_only=False)
    else:
        values = column.to_numpy(zero_copy_only=False)
    return np.asarray(values).astype(spec.dtype, copy=False).reshape(-1, *spec.shape)


def read(src: str, files: ExitStack) -> Source:
    _, pq = pyarrow("the parquet format", "export")
    parts = [files.enter_context(pq.ParquetFile(p)) for p in parquet_files(src)]
    if not parts:
        raise UnsupportedFormatError(f"{src}: no .parquet files in the folder")
    raw = (parts[0].schema_arrow.metadata or {}).get(b"mmreplay")
    if raw is None:
        raise UnsupportedFormatError(f"{src}: parquet files without mmreplay's metadata (not its export)")
    meta = json.loads(raw)
    spec = spec_from_json(meta["spec"])
    roles = dict(meta.get("roles") or {})
    for role in ("terminated", "truncated"):  # the flag columns keep where each episode ended
        if role not in roles and isinstance(spec, dict) and role not in spec:
            spec, roles[role] = {**spec, role: ArraySpec((), "bool")}, role
    columns = {p: c for c, p in meta["columns"].items()}
    flags = {roles.get("terminated"): "terminated", roles.get("truncated"): "truncated"}
    paths = leaf_paths(spec)
    specs = flatten(spec)
    missing = [p for p in paths if p not in columns and p not in flags]
    if missing:
        raise UnsupportedFormatError(f"{src}: no column holds the leaves {missing}")
    names = [columns.get(p, flags.get(p)) for p in paths]
    images = [p in columns and is_image(s) for p, s in zip(paths, specs)]

    def row_groups(*wanted: str) -> Iterator[Any]:
        # a row group at a time: what the writer wrote at once (iter_batches reads ahead
        # through the whole file)
        for part in parts:
            for i in range(part.metadata.num_row_groups):
                yield part.read_row_group(i, columns=list(wanted))

    episodes, last = 0, None
    for group in row_groups("episode_index"):  # rows are episode after episode
        index = group.column(0).to_numpy()
        if len(index):
            episodes += int(np.count_nonzero(index[1:] != index[:-1])) + int(index[0] != last)
            last = index[-1]

    def blocks() -> Iterator[list[np.ndarray]]:
        k = block_steps(sum(s.nbytes for s in specs), BLOCK_BYTES)
        for group in row_groups(*names):
            for a in range(0, group.num_rows, k):
                rows = group.slice(a, k)
                yield [
                    _leaf_values(rows.column(name).combine_chunks(), s, image).reshape(-1, 1, *s.shape)
                    for name, s, image in zip(names, specs, images)
                ]

    steps = sum(part.metadata.num_rows for part in parts)
    return Source(spec, 1, steps, blocks, roles, episodes)
