"""``csv``: one row per (step, env), one column per element, ``name.i`` headers.

The layout skrl's ``Memory.save(format="csv")`` writes: leaves in sorted order, each
flattened over its per-step shape into columns ``<leaf path>.<i>``, rows step-major
(row ``t * num_envs + e``), here in time order. Floats are written with enough digits to
read back bit-exact, booleans as 0 / 1. ``compression="gzip"`` gzips the file.
"""

from __future__ import annotations

import gzip
import io
import math
import os
from typing import Any

import numpy as np

from ..errors import BadInputError
from ..spec import flatten
from ._base import ExportResult, StepBlocks, Target, first_line_is

COMPRESSIONS = ("gzip",)
_FLOAT_FORMAT = {2: "%.5g", 4: "%.9g", 8: "%.17g"}


def _format(dtype: np.dtype, path: str) -> str:
    if dtype.kind == "f":
        return _FLOAT_FORMAT[dtype.itemsize]
    if dtype.kind in "iub":
        return "%d"
    raise BadInputError(f"csv export: leaf {path!r} has dtype {dtype}, which CSV cannot hold")


def header(paths: list[str], specs: list[Any]) -> list[str]:
    """Column names ``<leaf path>.<i>`` in file order."""
    return [f"{p}.{i}" for p, s in zip(paths, specs) for i in range(max(1, math.prod(s.shape)))]


def write(
    store: Any,
    out: str,
    *,
    compression: str | None,
    complete_only: bool,
    force: bool,
    progress: Any,
) -> ExportResult:
    comp = compression
    specs = flatten(store.spec)
    paths = store.leaf_paths
    fmts = [_format(s.dtype, p) for p, s in zip(paths, specs)]
    target = Target(
        out, "file", force, fmt="csv", source=store.path, recognise=first_line_is(",".join(header(paths, specs)))
    )
    try:
        blocks = StepBlocks(store, block_bytes=4 << 20)
        raw = open(target.path(), "wb")
        f = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if comp else raw
        try:
            text = io.TextIOWrapper(f, encoding="ascii", newline="")
            text.write(",".join(header(paths, specs)) + "\n")
            line = (
                ",".join(fmt for fmt, s in zip(fmts, specs) for _ in range(max(1, math.prod(s.shape)))) + "\n"
            )
            for _, leaves in blocks:
                rows = len(leaves[0]) * store.num_envs
                cols: list[Any] = []
                for values, spec in zip(leaves, specs):
                    flat = values.reshape(rows, -1)
                    if spec.dtype.kind == "b":
                        flat = flat.astype(np.int8)
                    cols.extend(flat.T.tolist())
                text.write("".join(line % row for row in zip(*cols)))
                progress(rows)
            text.flush()
            text.detach()
        finally:
            if f is not raw:
                f.close()
            raw.close()
        path = target.commit()
    except BaseException:
        target.abort()
        raise
    return ExportResult("csv", path, 0, blocks.steps * store.num_envs, os.path.getsize(path))
