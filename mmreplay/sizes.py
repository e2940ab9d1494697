"""What a buffer will take on disk when full, before it is created.

Uncompressed leaves are exact: the bytes come from the layout the backend would make
(zarr: each leaf's shard with its chunk padding and index; HDF5: the file's own
metadata), without allocating it. Compressed leaves are estimated from a sample of
values the caller passes, encoded in a small trial buffer of the same backend, codec
and chunking; with no sample the estimate is unknown and their worst case (values
that do not compress) is the upper bound. A row-frame leaf's files of a fixed size
(its raw staging segment, a zstd dictionary) are counted once, not scaled with the rows.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from . import backends
from .creation import create, plan
from .errors import BadInputError
from .files import disk_usage
from .frames_layout import SIDE_DIR, Frames, side_metadata
from .metadata import Metadata, render
from .spec import ArraySpec, flatten, leaf_paths
from .statefile import FILE_BYTES as STATE_BYTES
from .store import DEFAULT_COMMIT_EVERY

__all__ = ["LeafSize", "SizeEstimate", "estimate"]


@dataclass(frozen=True)
class LeafSize:
    """One leaf when the buffer is full.

    Attributes:
        path: the leaf path.
        raw_bytes: ``capacity * num_envs`` rows of the leaf, uncompressed.
        bytes: on disk when full: exact for an uncompressed leaf (its padding included),
            an estimate from the sample for a compressed one, None without a sample.
        compression: the codec, or None (memory-mapped, preallocated at creation).
        ratio: raw / stored for a compressed leaf with a sample.
        most_bytes: the most a compressed leaf can take when full, whatever its values
            (values that do not compress); None for an uncompressed one (``bytes`` is exact).
        staging_bytes: a row-frame leaf's raw staging segment, allocated at creation
            (counted in ``bytes`` and ``most_bytes``).
    """

    path: str
    raw_bytes: int
    bytes: int | None
    compression: str | None
    ratio: float | None = None
    most_bytes: int | None = None
    staging_bytes: int = 0

    @property
    def exact(self) -> bool:
        return self.compression is None


@dataclass(frozen=True)
class SizeEstimate:
    """A buffer's size on disk when full, leaf by leaf.

    ``preallocated`` is what :func:`mmreplay.create` allocates at once (the uncompressed
    leaves, the row-frame leaves' staging segments and the metadata files); ``total`` is the size when full (None when a
    compressed leaf has no sample); ``exact`` says whether ``total`` is exact. The
    episode index (16 bytes per episode end) is not counted.
    """

    backend: str
    capacity: int
    num_envs: int
    leaves: tuple[LeafSize, ...]
    data_metadata: int  # zarr.json files / the HDF5 file's own metadata
    metadata_file: int  # mmreplay.json (its timestamps' digits may differ by a few bytes) and mmreplay.state

    @property
    def overhead(self) -> int:
        """Bytes besides the leaves' data: the metadata files."""
        return self.data_metadata + self.metadata_file

    @property
    def data_bytes(self) -> int | None:
        """The data folder or file when full (``data.zarr`` / ``data.h5``, and a frames
        store's side ring, ``frames/``)."""
        total = self.total
        return None if total is None else total - self.metadata_file

    @property
    def preallocated(self) -> int:
        return self.overhead + sum(
            leaf.bytes or 0 if leaf.compression is None else leaf.staging_bytes for leaf in self.leaves
        )

    @property
    def total(self) -> int | None:
        sizes = [leaf.bytes for leaf in self.leaves]
        return None if any(b is None for b in sizes) else self.overhead + sum(b or 0 for b in sizes)

    @property
    def upper_bound(self) -> int:
        """``total`` with every unknown compressed leaf at its worst case."""
        return self.overhead + sum(leaf.most_bytes if leaf.bytes is None else leaf.bytes for leaf in self.leaves)  # type: ignore[misc]

    @property
    def exact(self) -> bool:
        return all(leaf.exact for leaf in self.leaves)

    @property
    def bytes_per_step(self) -> float | None:
        """Bytes of data per step (all envs) when full."""
        total = self.total
        return None if total is None else (total - self.overhead) / self.capacity

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "capacity": self.capacity,
            "num_envs": self.num_envs,
            "total_bytes": self.total,
            "upper_bound_bytes": self.upper_bound,
            "preallocated_bytes": self.preallocated,
            "metadata_bytes": self.overhead,
            "data_bytes": self.data_bytes,
            "bytes_per_step": self.bytes_per_step,
            "exact": self.exact,
            "leaves": [{**asdict(leaf), "exact": leaf.exact} for leaf in self.leaves],
        }


def estimate(
    spec: Any,
    capacity: int,
    num_envs: int = 1,
    *,
    backend: str | None = None,
    compression: str | Mapping[str, str | None] | None = None,
    chunk_steps: int | Mapping[str, int] | None = None,
    commit_every: int | None = None,
    roles: Mapping[str, str] | None = None,
    frames: Frames | None = None,
    sample: Any = None,
) -> SizeEstimate:
    """The bytes a buffer made by ``mmreplay.create`` with these arguments takes on disk
    when full.

    Args:
        spec, capacity, num_envs, backend, compression, chunk_steps, commit_every, roles, frames:
            as for :func:`mmreplay.create` (a frames store's side ring is counted as
            ``frames/...`` leaves).
        sample: values of the compressed leaves to estimate their ratio from: the spec's
            nest (or a dict leaf path -> array) of rows ``[n, *shape]`` or
            ``[n, num_envs, *shape]``, e.g. a few hundred steps of real observations.
            Encoded in a small trial buffer with the same backend, codec and chunking;
            the more (and more typical) rows, the better the estimate.

    Example:
        >>> import mmreplay as mr
        >>> size = mr.estimate({"obs": mr.ArraySpec((84, 84), "uint8")}, capacity=1000, num_envs=2)
        >>> size.leaves[0].bytes >= 1000 * 2 * 84 * 84
        True
    """
    every = DEFAULT_COMMIT_EVERY if commit_every is None else commit_every
    meta = plan(spec, capacity, num_envs, backend, chunk_steps, compression, every, roles=roles, frames=frames)
    samples = _sample_by_path(meta, sample)
    out, placed, data_meta = _leaf_sizes(meta, samples)
    if meta.frames is not None and meta.frames.side:  # the side ring: its own folder, one env
        side_samples = {f"frame{i}": samples[p.obs] for i, p in enumerate(meta.frames.pairs) if p.obs in samples}
        side, side_placed, side_meta = _leaf_sizes(side_metadata(meta), side_samples)
        out += [replace(leaf, path=f"{SIDE_DIR}/{leaf.path}") for leaf in side]
        data_meta += side_meta
        meta = replace(meta, frames=replace(meta.frames, side=tuple(side_placed)))
    metadata_file = len(render(replace(meta, leaves=tuple(placed)))) + STATE_BYTES
    return SizeEstimate(meta.backend, meta.capacity, meta.num_envs, tuple(out), data_meta, metadata_file)


def _leaf_sizes(meta: Metadata, samples: dict[str, np.ndarray]) -> tuple[list[LeafSize], list[Any], int]:
    """Each leaf's size when full, the leaves as the backend places them, and the bytes
    of the backend's own metadata."""
    module = backends.get(meta.backend)
    placed, shards, data_meta = module.planned_bytes(list(meta.leaves), meta.capacity, meta.num_envs)
    out = []
    for leaf in meta.leaves:
        raw = meta.capacity * meta.num_envs * leaf.spec.nbytes
        if leaf.compression is None:
            out.append(LeafSize(leaf.path, raw, shards[leaf.path], None))
            continue
        staging = shards.get(leaf.path, 0)  # (row frames: the staging file)
        most = _most_bytes(meta, leaf) + staging
        rows = samples.get(leaf.path)
        if rows is None:
            out.append(LeafSize(leaf.path, raw, None, leaf.compression, None, most, staging))
            continue
        ratio, fixed = _trial_ratio(meta, leaf, rows)
        stored = int(round(raw / ratio)) + fixed + staging
        out.append(LeafSize(leaf.path, raw, stored, leaf.compression, round(raw / stored, 3), most, staging))
    return out, placed, data_meta


def _most_bytes(meta: Metadata, leaf: Any) -> int:
    """The most a compressed leaf's chunks or frames take when full, whatever the values:
    a row frame's bound is the one its shards are read with (the lz4 and zstd bounds),
    plus a trained dictionary; a chunk's is above zstd's, blosc's and gzip's, plus its
    entry in the shard index. HDF5 never frees a chunk's slot that grew (a reader may
    still read it) and grows it by half each time, so a chunk takes up to three times its
    largest slot, and one more for the journal of the chunks the head is in."""
    from .backends.row_codec import DICTIONARY_BYTES, is_row_compression, parse_row_compression
    from .backends.row_reads import shard_limit  # (not imported with mmreplay)

    chunks = -(-meta.capacity // leaf.chunk_steps)
    rows = leaf.chunk_steps * meta.num_envs
    if is_row_compression(leaf.compression):
        dictionary = DICTIONARY_BYTES if parse_row_compression(leaf.compression).dictionary else 0
        return chunks * shard_limit(rows, leaf.spec.nbytes) + dictionary
    raw = rows * leaf.spec.nbytes
    chunk = raw + raw // 128 + 128
    return chunks * chunk if meta.backend == "zarr" else (3 * chunks + 1) * chunk


def _sample_by_path(meta: Metadata, sample: Any) -> dict[str, np.ndarray]:
    """Rows ``[n, *shape]`` of each sampled leaf as stored (a frames store's newest
    frame of each observation stack; its derived next observations are not stored)."""
    if sample is None:
        return {}
    paths = leaf_paths(meta.spec)
    by_path = dict(zip(leaf_paths(sample), flatten(sample)))  # a nest, or a dict keyed by leaf path
    stored = {leaf.path for leaf in meta.leaves}
    stacks = {p.obs: p.axis for p in meta.frames.pairs if p.axis is not None} if meta.frames else {}
    out = {}
    for path, spec in zip(paths, flatten(meta.spec)):
        if path not in stored or by_path.get(path) is None:
            continue
        x = np.asarray(by_path[path])
        shape = spec.shape
        if x.shape[x.ndim - len(shape) :] != shape or x.ndim - len(shape) not in (1, 2):
            dims = "".join(f", {n}" for n in shape)
            raise BadInputError(
                f"sample for leaf {path!r}: expected rows shaped (n{dims}) or (n, num_envs{dims}), got {x.shape}"
            )
        if not np.can_cast(x.dtype, spec.dtype, "same_kind"):
            raise BadInputError(f"sample for leaf {path!r}: dtype {x.dtype} does not cast to {spec.dtype}")
        rows = x.reshape(-1, *shape).astype(spec.dtype, copy=False)
        if not len(rows):
            raise BadInputError(f"sample for leaf {path!r} holds no rows")
        out[path] = np.take(rows, -1, axis=1 + stacks[path]) if path in stacks else rows
    unknown = sorted(set(by_path) - set(paths))
    if unknown:
        raise BadInputError(f"sample names leaves not in the spec: {unknown}")
    return out


def _trial_ratio(meta: Metadata, leaf: Any, rows: np.ndarray) -> tuple[float, int]:
    """raw / stored bytes of ``rows`` written to a trial buffer of one leaf with the same
    backend, codec and chunk shape (fewer steps per chunk when the sample is short), and
    the bytes of the leaf's files whose size does not grow with its rows (a row-frame
    leaf's zstd dictionary; its staging file is sized from the layout instead)."""
    from .backends.row_codec import DICTIONARY_FILE
    from .backends.row_reads import STAGING_FILE  # (not imported with mmreplay)

    envs = min(meta.num_envs, len(rows))
    steps = len(rows) // envs
    chunk = min(leaf.chunk_steps, steps)
    steps = (steps // chunk) * chunk  # whole chunks only: a padded chunk compresses too well
    values = rows[: steps * envs].reshape(steps, envs, *leaf.spec.shape)
    spec = {"x": ArraySpec(leaf.spec.shape, leaf.spec.dtype)}
    with tempfile.TemporaryDirectory(prefix="mmreplay-estimate-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (advice on the layout is for the caller's create)
        path = os.path.join(tmp, "trial")
        with create(
            path, spec, steps, envs, backend=meta.backend, compression=leaf.compression, chunk_steps=chunk
        ) as trial:
            trial.extend({"x": values})
            leaves = list(trial.metadata.leaves)
        _, _, empty = backends.get(meta.backend).planned_bytes(leaves, steps, envs)
        data = os.path.join(path, "data.zarr" if meta.backend == "zarr" else "data.h5")
        fixed = {name: _size(os.path.join(data, "x", name)) for name in (STAGING_FILE, DICTIONARY_FILE)}
        stored = disk_usage(data) - empty - sum(fixed.values())  # the encoded rows or chunks, their index
    return values.nbytes / max(1, stored), fixed[DICTIONARY_FILE]


def _size(path: str) -> int:
    return os.path.getsize(path) if os.path.isfile(path) else 0
