"""Batches in the layout a model takes: pictures channels first or last, contiguous.

A conv net takes ``[N, C, H, W]`` (PyTorch) or ``[N, H, W, C]`` (TensorFlow, JAX)
stacks in contiguous memory. Transposing a returned batch costs a second pass over it,
more than the sample itself; with ``layout=`` every leaf's gather writes each row
already transposed into the batch (:func:`gather_rows`:
the memory map's rows, a row frame as it is decoded, a frames-once stack from its
frames), one pass.

Which leaves: the 3-D pictures of :func:`mmreplay.spec.frame_layout` (``HWC``, ``HWK``
frame stacks, ``HW(KC)``, and their channels-first forms). Every other leaf comes as
stored, contiguous.
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..spec import frame_layout

__all__ = ["LAYOUTS", "LeafPlan", "check_layout", "gather_rows", "plans", "shape_in"]

#: what ``layout=`` takes: ``N`` the batch's items (and steps), ``C`` channels or stacked frames
LAYOUTS = ("NCHW", "NHWC")


def check_layout(layout: Any) -> str | None:
    """``layout`` if it is one of :data:`LAYOUTS` or None; ValueError otherwise."""
    if layout is None or layout in LAYOUTS:
        return layout
    raise ValueError(f"layout must be one of {LAYOUTS} or None (as stored), got {layout!r}")


def shape_in(shape: tuple[int, ...], layout: str) -> tuple[tuple[int, ...], tuple[int, int]]:
    """A leaf row of ``shape`` as ``layout`` asks: its shape, and ``(a, b)`` such that the
    row is written as the transpose of its ``[a, b]`` matrix of values (``a == 1``: as
    it is)."""
    found = frame_layout(shape) if len(shape) == 3 else None
    if found is not None:
        last = found.startswith("HW")
        if layout == "NCHW" and last:
            return (shape[2], shape[0], shape[1]), (shape[0] * shape[1], shape[2])
        if layout == "NHWC" and not last:
            return (shape[1], shape[2], shape[0]), (shape[0], shape[1] * shape[2])
    return shape, (1, math.prod(shape))


@dataclass
class LeafPlan:
    """How one leaf's rows are gathered in a layout: the row shape, and ``into(rows,
    out)`` that writes rows (flat ids) into ``out`` (uint8 ``[len(rows), row bytes]``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    into: Any

    def take(self, rows: np.ndarray) -> np.ndarray:
        """A new array ``[*rows.shape, *shape]`` of the rows."""
        out = np.empty(rows.shape + self.shape, self.dtype)
        self.fill(rows, out)
        return out

    def fill(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Write the rows (flat ids, any shape) into ``out`` (C-contiguous, ``[*rows.shape, *shape]``)."""
        if rows.size:
            self.into(rows.reshape(-1), out.view(np.uint8).reshape(rows.size, -1))


def plans(leaves: list[Any], layout: str) -> list[LeafPlan]:
    """Each leaf's :class:`LeafPlan` for ``layout``."""
    out = []
    for leaf in leaves:
        spec = leaf.info.spec
        shape, (a, b) = shape_in(tuple(spec.shape), layout)
        item = spec.dtype.itemsize
        out.append(LeafPlan(shape, np.dtype(spec.dtype), _into(leaf, a, b, item)))
    return out


def _into(leaf: Any, a: int, b: int, item: int) -> Any:
    row_bytes = a * b * item
    if leaf.mappable:  # from the memory map, each row straight to its place
        flat = leaf.flat
        total = len(flat)

        def mapped(rows: np.ndarray, out: np.ndarray) -> None:
            gather_rows(flat, row_bytes, 0, np.remainder(rows, total), out, a, b, item)

        return mapped
    if hasattr(leaf, "take_into"):  # row frames and frames once: written as they are decoded or gathered
        return lambda rows, out: leaf.take_into(rows, out, (a, b, item))

    def decoded(rows: np.ndarray, out: np.ndarray) -> None:  # other compressed leaves: decoded, then laid out
        got = np.ascontiguousarray(leaf.take(rows))
        gather_rows(got, row_bytes, 0, np.arange(len(rows), dtype=np.int64), out, a, b, item)

    return decoded


def _extension() -> Any:
    """The C extension ``mmreplay._rowdecode``, or None where it is not built or
    ``MMREPLAY_NATIVE=0`` is set (as for decoding)."""
    if os.environ.get("MMREPLAY_NATIVE", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        return importlib.import_module("mmreplay._rowdecode")
    except ImportError:
        return None


def gather_rows(
    src: Any, stride: int, offset: int, rows: np.ndarray, out: np.ndarray, a: int, b: int, item: int
) -> None:
    """Row ``i`` of ``out`` (uint8 ``[len(rows), a * b * item]``, C-contiguous) = the
    ``[a, b]`` matrix of ``item``-byte values at byte ``offset + rows[i] * stride`` of
    ``src``, transposed (``a == 1``: as it is): HWC -> CHW is ``a = H * W, b = C``. One
    pass without the GIL in the C extension, else numpy."""
    rows = np.ascontiguousarray(rows, np.int64)
    ext = _extension()
    if ext is not None and hasattr(ext, "gather_rows"):
        ext.gather_rows(src, stride, offset, rows, out, a, b, item)
        return
    data = np.frombuffer(src, np.uint8)
    count = (len(data) - offset - a * b * item) // stride + 1 if stride else 1
    matrices = np.ndarray((count, a, b, item), np.uint8, data, offset, (stride, b * item, item, 1))
    np.copyto(out.reshape(len(rows), b, a, item), matrices[rows].transpose(0, 2, 1, 3))
