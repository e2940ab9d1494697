"""``npz``: one ``[steps, num_envs, *shape]`` array per leaf, keyed by leaf path.

This is the layout skrl's ``Memory.save(format="npz")`` writes (arrays keyed by name,
dtypes kept), with the steps in time order. Each array is streamed into its zip member
block by block, so no leaf is ever held whole in memory. ``__mmreplay__`` holds the
spec and roles as a JSON string (a plain unicode array, never a pickle), which lets
``mmreplay import`` rebuild the store exactly. Load with ``numpy.load(path)``.
"""

from __future__ import annotations

import json
import zipfile
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadInputError, UnsupportedFormatError
from ..spec import flatten
from .base import Source, StepBlocks, Target, Ticker, arrays_source, spec_json

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult

META_KEY = "__mmreplay__"
COMPRESSIONS = ("deflate", "zip")


def write(store: Exportable, out: str, options: ExportOptions) -> ExportResult:
    method = zipfile.ZIP_DEFLATED if options.compression is not None else zipfile.ZIP_STORED
    specs = flatten(store.spec)
    if META_KEY in store.leaf_paths:
        raise BadInputError(f"npz export: leaf {META_KEY!r} has the name of the member holding the spec; rename it")
    with Target(out, "file", "npz", store, options) as target:
        rows = StepBlocks(store).rows
        ticker = Ticker(options.progress, rows, sum(rows * s.nbytes for s in specs))
        with zipfile.ZipFile(target.path(), "w", compression=method, allowZip64=True) as zf:
            meta = np.array(json.dumps(spec_json(store)))
            with zf.open(META_KEY + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, meta, allow_pickle=False)
            # one member at a time (zip members cannot interleave): a pass over the store per
            # leaf, in blocks sized for that leaf alone
            for i, (name, spec) in enumerate(zip(store.leaf_paths, specs)):
                blocks = StepBlocks(store, leaves=[i])
                dtype = spec.dtype.newbyteorder("<") if spec.dtype.itemsize > 1 else spec.dtype
                with zf.open(name + ".npy", "w", force_zip64=True) as f:
                    f.write(_header((blocks.steps, store.num_envs, *spec.shape), dtype))
                    for _, (values,) in blocks:
                        f.write(np.ascontiguousarray(values, dtype=dtype).reshape(-1).view(np.uint8))
                        ticker.advance(len(values) * store.num_envs * spec.nbytes)
        return target.finish(0, rows, {"keys": store.leaf_paths})


def _header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The ``.npy`` header for a C-order array of this shape and dtype (format 2.0 when large)."""
    import io

    buf = io.BytesIO()
    d = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    try:
        np.lib.format.write_array_header_1_0(buf, d)
    except ValueError:
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, d)
    return buf.getvalue()


# --- the import ------------------------------------------------------------------------


class _NpyMember:
    """One ``.npy`` member of an npz, sliced along its first axis by streaming reads."""

    def __init__(self, zf: zipfile.ZipFile, name: str):
        self.zf, self.name = zf, name
        with zf.open(name) as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
            self.offset = f.tell()
        if dtype.hasobject:
            raise BadInputError(f"npz member {name!r} holds Python objects; refusing to unpickle")
        self.shape, self.dtype = tuple(shape), dtype
        # a Fortran-ordered array (np.savez of a transposed one) has no rows to stream: read whole
        self._whole = None
        if fortran and len(shape) > 1:
            with zf.open(name) as f:
                self._whole = np.ascontiguousarray(np.lib.format.read_array(f, allow_pickle=False))
        self.row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        self._f: Any = None
        self._pos = 0

    def __getitem__(self, sl: slice) -> np.ndarray:
        a, b, _ = sl.indices(self.shape[0])
        if self._whole is not None:
            return self._whole[a:b]
        if self._f is None or a < self._pos:
            if self._f is not None:
                self._f.close()
            self._f = self.zf.open(self.name)
            self._f.read(self.offset)
            self._pos = 0
        if a > self._pos:
            self._f.read((a - self._pos) * self.row)
        data = self._f.read((b - a) * self.row)
        self._pos = b
        return np.frombuffer(data, self.dtype).reshape(b - a, *self.shape[1:])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def read(src: str, files: ExitStack, num_envs: int | None = None) -> Source:
    if not zipfile.is_zipfile(src):
        raise UnsupportedFormatError(f"{src}: not an npz file (a zip of .npy arrays)")
    zf = files.enter_context(zipfile.ZipFile(src))
    members = {}
    meta = None
    for name in zf.namelist():
        if not name.endswith(".npy"):
            continue
        key = name[:-4]
        if key == META_KEY:
            arr = np.load(zf.open(name), allow_pickle=False)
            meta = json.loads(str(arr))
            continue
        members[key] = _NpyMember(zf, name)
        files.callback(members[key].close)
    return arrays_source(members, meta, num_envs, src)
