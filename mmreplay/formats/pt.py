"""``pt``: ``torch.save`` of a dict leaf path -> ``[steps, num_envs, *shape]`` tensor.

The layout skrl's ``Memory.save(format="pt")`` writes, steps in time order, plain
tensors only, so ``torch.load(path, weights_only=True)`` (and ``mmap=True``) reads it.

To stay in bounded memory (PyTorch 2.5 or later), the file is first written by ``torch.save`` under
``torch.serialization.skip_data`` (which writes the archive with room for every
tensor's bytes but not the bytes), then each tensor's record is filled in place, block
by block, from the store. The tensors handed to ``torch.save`` live on an unreserved
anonymous mapping that is never touched, so they cost no memory.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import zipfile
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadInputError, CorruptBufferError
from ..spec import flatten
from .base import EXPORT_MARK, Source, StepBlocks, Target, arrays_source, need

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult


def _placeholder(torch: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, Any]:
    """A tensor of this shape whose memory is mapped but never touched."""
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20) | getattr(mmap, "MAP_NORESERVE", 0x4000)
    mm = mmap.mmap(-1, nbytes, flags=flags)
    arr = np.frombuffer(mm, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape)
    return torch.from_numpy(arr), mm


def _record_offsets(path: str) -> dict[str, tuple[int, int]]:
    """Zip record name -> (offset of its data in the file, size)."""
    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            f.seek(info.header_offset)
            head = f.read(30)
            if head[:4] != b"PK\x03\x04":
                raise CorruptBufferError(f"{path}: unexpected zip layout from torch.save")
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            out[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return out


COMPRESSIONS: tuple[str, ...] = ()  # torch.save writes an uncompressed zip


def write(store: Exportable, out: str, options: ExportOptions) -> ExportResult:
    with Target(out, "file", "pt", store, options) as target:  # a refusal needs no torch
        torch = need("torch", "the pt format", "torch")
        blocks = StepBlocks(store, options.progress)
        specs = flatten(store.spec)
        if hasattr(torch.serialization, "skip_data"):
            _save_in_place(torch, store, blocks, specs, target)
        else:  # PyTorch before 2.5
            _save_in_memory(torch, store, blocks, specs, target.path())
        _mark(target.path())
        return target.finish(0, blocks.rows)


def _save_in_place(
    torch: Any, store: Exportable, blocks: StepBlocks, specs: list[Any], target: Target
) -> None:
    """``torch.save`` under ``skip_data``, then each tensor's record filled in from the store."""
    path = target.path()
    keep = []
    try:
        tensors = {}
        for leaf, spec in zip(store.leaf_paths, specs):
            shape = (blocks.steps, store.num_envs, *spec.shape)
            t, mm = _placeholder(torch, shape, spec.dtype.newbyteorder("="))
            tensors[leaf] = t
            keep.append(mm)
        sizes = [blocks.rows * s.nbytes for s in specs]
        # past a file size limit torch says only "iostream error": meet the limit at a write of ours
        with open(path, "r+b") as f:
            os.pwrite(f.fileno(), b"\0", sum(sizes))
        with torch.serialization.skip_data():
            torch.save(tensors, path)
        del tensors
        # torch.save numbers storages in the order it meets them: dict order here
        data = sorted(
            (int(name.rsplit("/", 1)[1]), off, size)
            for name, (off, size) in _record_offsets(path).items()
            if "/data/" in name and name.rsplit("/", 1)[1].isdigit()
        )
        if len(data) != len(specs) or any(size != n for (_, _, size), n in zip(data, sizes)):
            raise CorruptBufferError(
                f"{target.out}: torch.save laid out {len(data)} records, expected one per leaf "
                f"({len(specs)}); this PyTorch version is not supported by the pt export"
            )
        fd = os.open(path, os.O_WRONLY)
        try:
            for a, leaves in blocks:
                lo = a - blocks.first
                for (_, offset, _), spec, values in zip(data, specs, leaves):
                    native = spec.dtype.newbyteorder("=")
                    buf = np.ascontiguousarray(values, dtype=native).reshape(-1).view(np.uint8)
                    _pwrite_all(fd, buf, offset + lo * store.num_envs * spec.nbytes)
        finally:
            os.close(fd)
    finally:
        for mm in keep:
            with contextlib.suppress(BufferError):
                mm.close()


def _save_in_memory(torch: Any, store: Exportable, blocks: StepBlocks, specs: list[Any], path: str) -> None:
    """Without ``skip_data`` the tensors are assembled in memory, then saved."""
    arrays = [np.empty((blocks.steps, store.num_envs, *s.shape), s.dtype.newbyteorder("=")) for s in specs]
    blocks.fill(arrays)
    torch.save({p: torch.from_numpy(arr) for p, arr in zip(store.leaf_paths, arrays)}, path)


def _mark(path: str) -> None:
    """A member naming the format beside torch's records, which ``torch.load`` ignores;
    ``--force`` replaces only a file that has it."""
    with zipfile.ZipFile(path, "a") as zf:
        prefix = zf.namelist()[0].split("/", 1)[0]
        zf.writestr(f"{prefix}/{EXPORT_MARK}", "pt")


def _pwrite_all(fd: int, buf: np.ndarray, offset: int) -> None:
    view = memoryview(buf)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


# --- the import ------------------------------------------------------------------------


def read(src: str, files: ExitStack) -> Source:
    torch = need("torch", "the pt format", "torch")
    try:
        data = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch's restricted loader refuses anything but tensors
        # its message spans lines around the reason (and advises weights_only=False)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(exc).__name__)
        raise BadInputError(
            f"{src}: not tensors that torch.load(weights_only=True) reads: {reason}"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise BadInputError(f"{src}: expected a dict of leaf path -> [steps, num_envs, ...] tensors")
    arrays = {k: v.numpy() for k, v in data.items()}
    shapes = {k: a.shape for k, a in arrays.items()}
    if not arrays or any(len(s) < 2 for s in shapes.values()):
        raise BadInputError(f"{src}: expected [steps, num_envs, ...] tensors, got shapes {shapes}")
    envs = {s[1] for s in shapes.values()}
    if len(envs) != 1:
        raise BadInputError(f"{src}: tensors differ in num_envs: {shapes}")
    return arrays_source(arrays, None, envs.pop(), src)
