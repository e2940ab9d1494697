"""``csv``: one row per (step, env), one column per element.

Columns: ``step`` (the store's global step id) and ``env``, then every leaf in sorted
order, a scalar leaf as one column named by its path (``reward``), any other flattened
over its per-step shape into columns ``<leaf path>.<i>`` (skrl's ``Memory.save(format=
"csv")`` naming). Rows are step-major (row ``t * num_envs + e``) in time order. Floats
are written with enough digits to read back bit-exact, booleans as 0 / 1.
``compression="gzip"`` writes a gzip file named ``<out>.gz`` when ``out`` does not end
in ``.gz`` already (so ``pandas.read_csv`` and ``zcat`` recognise it), its gzip header
naming the ``.csv`` inside; an ``out`` ending in ``.gz`` is gzipped without it too.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gzip
import io
import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadInputError, UnsupportedFormatError
from ..spec import flatten
from .base import StepBlocks, Target, arrays_source, is_gzip

if TYPE_CHECKING:
    from collections.abc import Mapping
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult, Source

COMPRESSIONS = ("gzip",)
_FLOAT_FORMAT = {2: "%.5g", 4: "%.9g", 8: "%.17g"}
#: the columns before the leaves
INDEX_COLUMNS = ("step", "env")


def _format(dtype: np.dtype, path: str) -> str:
    if dtype.kind == "f":
        return _FLOAT_FORMAT[dtype.itemsize]
    if dtype.kind in "iub":
        return "%d"
    raise BadInputError(f"csv export: leaf {path!r} has dtype {dtype}, which CSV cannot hold")


def _width(spec: Any) -> int:
    return max(1, math.prod(spec.shape))


def header(paths: list[str], specs: list[Any]) -> list[str]:
    """Leaf column names in file order: ``<leaf path>`` for a scalar, else ``<leaf path>.<i>``."""
    return [p if not s.shape else f"{p}.{i}" for p, s in zip(paths, specs) for i in range(_width(s))]


def write(store: Exportable, out: str, options: ExportOptions) -> ExportResult:
    comp = options.compression or ("gzip" if out.endswith(".gz") else None)
    specs = flatten(store.spec)
    paths = store.leaf_paths
    names = io.StringIO()  # (quoted where a leaf name holds a comma, a quote or a line break)
    csv.writer(names, lineterminator="\n").writerow([*INDEX_COLUMNS, *header(paths, specs)])
    cells = [_format(s.dtype, p) for p, s in zip(paths, specs) for _ in range(_width(s))]
    if comp and not out.endswith(".gz"):
        out += ".gz"  # (so that pandas.read_csv and zcat recognise it)
    with Target(out, "file", "csv", store, options) as target:
        blocks = StepBlocks(store, options.progress, block_bytes=4 << 20)
        raw = open(target.path(), "wb")
        inner = os.path.basename(target.out)
        f = gzip.GzipFile(filename=inner, fileobj=raw, mode="wb", mtime=0) if comp else raw
        try:
            text = io.TextIOWrapper(f, encoding="utf-8", newline="")
            text.write(names.getvalue())
            line = ",".join(["%d", "%d", *cells]) + "\n"
            envs = np.arange(store.num_envs)
            for a, leaves in blocks:
                k = len(leaves[0])
                rows = k * store.num_envs
                cols: list[Any] = [
                    np.repeat(np.arange(a, a + k), store.num_envs).tolist(),
                    np.tile(envs, k).tolist(),
                ]
                for values, spec in zip(leaves, specs):
                    flat = values.reshape(rows, -1)
                    if spec.dtype.kind == "b":
                        flat = flat.astype(np.int8)
                    cols.extend(flat.T.tolist())
                text.write("".join(line % row for row in zip(*cols)))
            text.flush()
            text.detach()
        finally:
            if f is not raw:
                f.close()
            raw.close()
        return target.finish(0, blocks.rows)


# --- the import ------------------------------------------------------------------------


def read(src: str, files: ExitStack, spec: Mapping[str, Any] | None = None) -> Source:
    opener = gzip.open if is_gzip(src) else open
    with opener(src, "rt", newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        head = next(reader, None)
        text = np.array(list(reader), str).reshape(-1, len(head or []))
    rows = _numbers(text)
    if not head or head[:2] != ["step", "env"]:
        raise UnsupportedFormatError(f"{src}: a csv without the step and env columns mmreplay writes")
    envs = int(rows[:, 1].max()) + 1 if len(rows) else 1
    steps = len(rows) // envs
    if steps * envs != len(rows) or not np.array_equal(rows[:, 1], np.tile(np.arange(envs), steps)):
        raise BadInputError(f"{src}: rows are not one per (step, env), step-major")
    groups: dict[str, list[int]] = {}
    scalars = set(head[2:])
    for i, name in enumerate(head[2:], start=2):
        leaf, dot, idx = name.rpartition(".")
        key = leaf if dot and idx.isdigit() and leaf not in scalars else name
        groups.setdefault(key, []).append(i)
    for key, cols in list(groups.items()):  # a vector's columns are <leaf>.0, <leaf>.1, ...
        if head[cols[0]] != key and [head[c] for c in cols] != [f"{key}.{j}" for j in range(len(cols))]:
            del groups[key]
            groups.update({head[c]: [c] for c in cols})
    arrays = {}
    for name, cols in groups.items():
        values = _numbers(text[:, cols])
        if spec is not None and name in spec:  # the caller knows what the text cannot say
            arrays[name] = _as_declared(values, spec[name], name, src).reshape(steps, envs, *spec[name].shape)
            continue
        if (
            values.dtype.kind == "f"
            and np.all(np.isfinite(values))
            and np.all(values == np.round(values))
            and len(values)
        ):
            values = values.astype(np.int64)
        vector = len(cols) > 1 or head[cols[0]] != name
        arrays[name] = values.reshape(steps, envs, *((len(cols),) if vector else ()))
    first = int(rows[0, 0]) if len(rows) else 0
    fresh = None if first == 0 else []  # csv does not say which episodes start whole
    return dataclasses.replace(arrays_source(arrays, None, envs, src), first_step=first, fresh=fresh)


def _numbers(text: np.ndarray) -> np.ndarray:
    """Cells as int64 when every one is a whole number (exact beyond 2**53, where float64
    is not), else as float64."""
    for dtype in (np.int64, np.uint64):
        with contextlib.suppress(ValueError, OverflowError):
            return text.astype(dtype)
    return text.astype(np.float64)


def _as_declared(values: np.ndarray, leaf: Any, name: str, src: str) -> np.ndarray:
    """The columns of leaf ``name`` in its declared dtype; BadInputError where they do not fit it."""
    if values.shape[1] != math.prod(leaf.shape):
        raise BadInputError(f"{src}: leaf {name!r} has {values.shape[1]} columns, its declared shape {leaf.shape} "
                            f"takes {math.prod(leaf.shape)}")  # fmt: skip
    typed = values.astype(leaf.dtype)
    if leaf.dtype.kind != "f" and not np.array_equal(typed, values):
        raise BadInputError(f"{src}: leaf {name!r} holds values that are not {leaf.dtype}")
    return typed
