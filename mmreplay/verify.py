"""Checking a buffer's files against its metadata, and bringing a damaged one back.

:func:`verify` lists every problem it finds (an empty list means healthy): metadata that
does not parse, data files missing or of the wrong size, arrays whose shape, dtype,
chunking or compression differ from the metadata, a zarr shard index that no longer
points at the mapped block, chunks of committed steps that are missing or do not decode (an HDF5 chunk that a
killed writer tore is fine while the chunk journal holds it: the next writer writes it
back), a damaged chunk journal, an HDF5 file left marked open by a writer that died, an
episode index that disagrees with the data.

:func:`recover` brings a damaged buffer back to its last consistent commit where that
is possible. Rows cannot be rebuilt, so the recovered buffer keeps the newest committed
steps whose rows are all intact and drops the older ones (a buffer's committed steps are
one contiguous window); it says which steps it dropped and why. Damaged files are moved
aside (``*.damaged-<time>``), never deleted.

Both read the buffer as untrusted input: the metadata is validated before any file is
opened, and no code in the folder is ever executed.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass, field, replace

import numpy as np

from .errors import CorruptBufferError, Error, NotABufferError, UnsupportedFormatError
from .lock import WriterLock, holder_pid
from .metadata import (
    METADATA_FILE,
    STATE_FILE,
    LeafInfo,
    Metadata,
    State,
    migrate,
    parse_metadata,
    read_metadata,
    read_static,
    write_buffer,
    write_metadata,
)
from .statefile import FILE_BYTES, StateFile, decode_slot, salvage

__all__ = ["verify", "recover", "Recovery", "leftovers"]

EPISODE_BLOCK = 1 << 16  # steps of role leaves read at a time by the episode index check
ZARR_DIR = "data.zarr"
HDF5_FILE = "data.h5"
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


# --- verify -------------------------------------------------------------------------


def verify(path: str | os.PathLike, deep: bool = True) -> list[str]:
    """Problems found in the buffer at ``path``; an empty list means it is healthy.

    Args:
        path: the buffer folder.
        deep: also decode every stored chunk of the committed steps (reads the
            compressed data once); without it only structure and sizes are checked.

    Raises:
        ImportError: a codec the data needs is missing (chunks that cannot be decoded
            for that reason are not damage), naming the extra to install.

    Example:
        >>> import mmreplay as mr, tempfile
        >>> from mmreplay.verify import verify
        >>> p = tempfile.mkdtemp() + "/b"
        >>> mr.create(p, {"x": mr.ArraySpec((), "int64")}, 10).close()
        >>> verify(p)
        []
    """
    folder = os.fspath(path)
    try:
        meta = read_metadata(folder)
    except NotABufferError as exc:
        return [str(exc)]
    except Error as exc:
        return [str(exc)]
    problems: list[str] = []
    _check_state_file(folder, meta, problems)
    if meta.backend == "zarr":
        _check_zarr(folder, meta, deep, problems)
    else:
        _check_hdf5(folder, meta, deep, problems)
    _check_episodes(folder, meta, deep, problems)
    if not problems:
        problems.extend(_check_opens(folder))
    return problems


def _check_state_file(folder: str, meta: Metadata, problems: list[str]) -> None:
    """Both slots of a format-2 state file must be valid (one may be torn only by a crash
    of the machine mid-commit: the other then holds the committed state)."""
    if meta.format_version < 2:
        return
    path = os.path.join(folder, STATE_FILE)
    with open(path, "rb") as f:
        raw = f.read(FILE_BYTES + 1)
    if len(raw) != FILE_BYTES:
        problems.append(f"{path}: {len(raw)} bytes, a state file has {FILE_BYTES}")
    for index in (0, 1):
        slot = decode_slot(raw, index)
        if isinstance(slot, str):
            problems.append(
                f"{path}: state slot {index} is damaged ({slot}); the other slot holds the committed "
                "state, and the next commit or `mmreplay recover` rewrites this one"
            )


def _check_opens(folder: str) -> list[str]:
    """Whatever the structural checks missed, the store itself must open for reading."""
    from .store import open as open_store

    try:
        open_store(folder, "r").close()
    except Error as exc:
        return [f"the buffer does not open: {exc}"]
    return []


def retained_ranges(meta: Metadata) -> list[tuple[int, int]]:
    """Slot ranges ``[a, b)`` holding the retained committed steps (at most two)."""
    first, end, cap = meta.state.first(meta.capacity), meta.state.end, meta.capacity
    if end <= first:
        return []
    if end - first >= cap:
        return [(0, cap)]
    a, b = first % cap, end % cap
    if a < b:
        return [(a, b)]
    return [(a, cap)] + ([(0, b)] if b else [])


def newest_in_slots(first: int, end: int, capacity: int, a: int, b: int) -> int | None:
    """The newest step of ``[first, end)`` whose slot is in ``[a, b)``, or None."""
    if end <= first or a >= b:
        return None
    top = (end - 1 - a) // capacity
    for lap in (top, top - 1):
        lo, hi = max(first, lap * capacity + a), min(end, lap * capacity + b)
        if lap >= 0 and lo < hi:
            return hi - 1
    return None


def _leaf_bytes(meta: Metadata, leaf: LeafInfo) -> int:
    return meta.capacity * meta.num_envs * leaf.spec.nbytes


def _shape(meta: Metadata, leaf: LeafInfo) -> tuple[int, ...]:
    return (meta.capacity, meta.num_envs, *leaf.spec.shape)


def _le(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


def _chunks_of(meta: Metadata, leaf: LeafInfo) -> list[int]:
    """Chunk numbers along the step axis that hold retained committed steps."""
    cs = leaf.chunk_steps
    return sorted({k for a, b in retained_ranges(meta) for k in range(a // cs, (b - 1) // cs + 1)})


# --- zarr -----------------------------------------------------------------------------


@dataclass
class _ZarrLeafState:
    """What the zarr checks found wrong with one leaf (recover acts on it)."""

    unusable: str | None = None  # the array cannot be used at all
    meta_bad: bool = False  # because its zarr.json is missing or unreadable
    shard_short: int | None = None  # a mapped shard file shorter than this many bytes
    bad_index: bool = False
    bad_chunks: dict[int, str] = field(default_factory=dict)  # chunk -> why


def _shard_layout(meta: Metadata, leaf: LeafInfo) -> tuple[int, int, np.ndarray]:
    """(data bytes, file bytes, expected index) of a mapped leaf's shard file."""
    nchunks = -(-meta.capacity // leaf.chunk_steps)
    chunk_bytes = leaf.chunk_steps * meta.num_envs * leaf.spec.nbytes
    index = np.empty((nchunks, 2), "<u8")
    index[:, 0] = np.arange(nchunks, dtype="<u8") * chunk_bytes
    index[:, 1] = chunk_bytes
    data = nchunks * chunk_bytes
    return data, data + index.nbytes, index


def _zarr_leaf(
    folder: str, meta: Metadata, leaf: LeafInfo, deep: bool, problems: list[str]
) -> _ZarrLeafState:
    import zarr

    found = _ZarrLeafState()
    where = f"leaf {leaf.path!r}"
    arr_dir = os.path.join(folder, ZARR_DIR, leaf.path)

    def problem(text: str) -> None:
        problems.append(f"{where}: {text}")

    if not os.path.isfile(os.path.join(arr_dir, "zarr.json")):
        found.unusable = f"{arr_dir}/zarr.json is missing"
        found.meta_bad = True
        problem(found.unusable)
        return found
    try:
        arr = zarr.open_array(store=zarr.storage.LocalStore(arr_dir, read_only=True), mode="r")
    except Exception as exc:
        found.unusable = f"zarr cannot open {arr_dir}: {exc}"
        found.meta_bad = True
        problem(found.unusable)
        return found
    expected = _shape(meta, leaf)
    if arr.shape != expected or arr.dtype != _le(leaf.spec.dtype):
        found.unusable = (
            f"{arr_dir}: expected {expected} {leaf.spec.dtype}, the array is {arr.shape} {arr.dtype}"
        )
        problem(found.unusable)
        return found
    if leaf.mapped:
        nchunks = -(-meta.capacity // leaf.chunk_steps)
        key = arr.metadata.encode_chunk_key((0,) * arr.ndim)
        want_file = f"{ZARR_DIR}/{leaf.path}/{key}"
        if arr.shards != (nchunks * leaf.chunk_steps, *expected[1:]) or arr.chunks != (
            leaf.chunk_steps,
            *expected[1:],
        ):
            found.unusable = f"{arr_dir}: expected one shard of chunks of {leaf.chunk_steps} steps, found shards {arr.shards} chunks {arr.chunks}"
            problem(found.unusable)
            return found
        if arr.compressors:
            found.unusable = f"{arr_dir}: a mapped leaf must be uncompressed, the array has {arr.compressors}"
            problem(found.unusable)
            return found
        if leaf.file != want_file or leaf.offset != 0:
            found.unusable = f"metadata says file {leaf.file!r} offset {leaf.offset}, the array stores {want_file!r} offset 0"
            problem(found.unusable)
            return found
        shard = os.path.join(folder, want_file)
        data_bytes, file_bytes, index = _shard_layout(meta, leaf)
        if os.path.lexists(shard) and not os.path.isfile(shard):
            found.shard_short = 0
            problem(f"data file {shard} is not a regular file")
            return found
        try:
            size = os.path.getsize(shard)
        except FileNotFoundError:
            found.shard_short = 0
            problem(f"data file {shard} is missing")
            return found
        if size != file_bytes:
            if size < file_bytes:
                found.shard_short = size
            problem(f"data file {shard} has {size} bytes, expected {file_bytes}")
            if size < file_bytes:
                return found
        with open(shard, "rb") as f:
            f.seek(data_bytes)
            raw = f.read(index.nbytes)
        if raw != index.tobytes():
            found.bad_index = True
            problem(
                f"{shard}: the shard index does not point at the mapped block (zarr readers would see other rows)"
            )
        elif deep and meta.state.end > meta.state.first(meta.capacity):
            try:
                np.asarray(arr[(meta.state.end - 1) % meta.capacity])
            except Exception as exc:
                found.bad_index = True
                problem(f"zarr cannot read {shard}: {exc}")
        return found
    if arr.chunks != (leaf.chunk_steps, *expected[1:]) or arr.shards is not None:
        found.unusable = f"{arr_dir}: expected chunks of {leaf.chunk_steps} steps, the array has {arr.chunks}"
        problem(found.unusable)
        return found
    if not arr.compressors:
        found.unusable = f"{arr_dir}: metadata says compression {leaf.compression!r}, the array has none"
        problem(found.unusable)
        return found
    for k in _chunks_of(meta, leaf):
        chunk = os.path.join(arr_dir, arr.metadata.encode_chunk_key((k,) + (0,) * (arr.ndim - 1)))
        if not os.path.isfile(chunk):
            found.bad_chunks[k] = f"chunk file {chunk} is missing"
            continue
        if deep:
            a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
            try:
                np.asarray(arr[a:b])
            except Exception as exc:
                found.bad_chunks[k] = f"chunk file {chunk} does not decode ({type(exc).__name__}: {exc})"
    for why in found.bad_chunks.values():
        problem(f"{why} (it holds committed steps)")
    return found


def _groups(meta: Metadata) -> list[str]:
    """The zarr groups of the nest, root first ("" is the root)."""
    out = {""}
    for leaf in meta.leaves:
        parts = leaf.path.split("/")[:-1]
        out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(out, key=lambda g: (g.count("/"), g))


def _bad_groups(folder: str, meta: Metadata) -> list[str]:
    """Groups whose zarr.json is missing or not a zarr v3 group (zarr readers need them)."""
    bad = []
    for group in _groups(meta):
        path = os.path.join(folder, ZARR_DIR, group, "zarr.json")
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read(1 << 20))
            ok = isinstance(doc, dict) and doc.get("node_type") == "group" and doc.get("zarr_format") == 3
        except (OSError, ValueError):
            ok = False
        if not ok:
            bad.append(group)
    return bad


def _check_zarr(folder: str, meta: Metadata, deep: bool, problems: list[str]) -> dict[str, _ZarrLeafState]:
    root = os.path.join(folder, ZARR_DIR)
    if not os.path.isdir(root):
        problems.append(f"{root}: the data folder is missing")
        return {leaf.path: _ZarrLeafState(unusable="data folder missing") for leaf in meta.leaves}
    for group in _bad_groups(folder, meta):
        problems.append(
            f"{os.path.join(root, group, 'zarr.json')}: zarr group metadata is missing or damaged"
        )
    return {leaf.path: _zarr_leaf(folder, meta, leaf, deep, problems) for leaf in meta.leaves}


# --- hdf5 ------------------------------------------------------------------------------


def hdf5_status(path: str) -> tuple[int, int] | None:
    """(status flags, end-of-file address) of a version 2/3 superblock, or None."""
    try:
        with open(path, "rb") as f:
            head = f.read(48)
    except OSError:
        return None
    if len(head) < 48 or head[:8] != _HDF5_SIGNATURE or head[8] not in (2, 3) or head[9] != 8:
        return None
    (eof,) = struct.unpack("<Q", head[28:36])
    return head[11], eof


@dataclass
class _Hdf5State:
    unusable: str | None = None
    flags_set: bool = False
    short: int | None = None  # the file is shorter than HDF5's end-of-file address
    bad_chunks: dict[str, dict[int, str]] = field(default_factory=dict)
    journal: dict = field(default_factory=dict)  # leaf path -> chunk -> (mask, bytes)
    bad_journal: bool = False


def _check_hdf5(folder: str, meta: Metadata, deep: bool, problems: list[str]) -> _Hdf5State:
    import h5py

    found = _Hdf5State()
    path = os.path.join(folder, HDF5_FILE)
    if not os.path.isfile(path):
        found.unusable = f"data file {path} is missing"
        problems.append(found.unusable)
        return found
    size = os.path.getsize(path)
    status = hdf5_status(path)
    if status is None:
        found.unusable = f"{path}: not an HDF5 file with a version 2/3 superblock"
        problems.append(found.unusable)
        return found
    flags, eof = status
    if size < eof:
        found.short = size
        problems.append(f"data file {path} is truncated: {size} bytes, HDF5 expects {eof}")
    need = max((leaf.offset + _leaf_bytes(meta, leaf) for leaf in meta.leaves if leaf.mapped), default=0)
    if size < need:
        found.short = size if found.short is None else min(found.short, size)
        problems.append(f"data file {path} has {size} bytes, the mapped leaves need {need}")
    if flags and holder_pid(folder) is None:
        found.flags_set = True
        problems.append(
            f"{path}: marked open for writing by a writer that died (HDF5 status flags); "
            "plain h5py cannot open it until `mmreplay recover` or the next writer clears them"
        )
    if found.short is not None:
        return found
    from .backends.h5chunks import Journal, journal_limits, require_filters

    journal = Journal(path, journal_limits(meta))
    try:
        found.journal = journal.load()
    except CorruptBufferError as exc:
        found.bad_journal = True
        problems.append(f"{exc}; the chunks it protects are unprotected until the next commit")
    try:
        f = h5py.File(path, "r", libver="latest", swmr=True)
    except Exception as exc:
        found.unusable = f"h5py cannot open {path}: {exc}"
        problems.append(found.unusable)
        return found
    with f:
        for leaf in meta.leaves:
            where = f"leaf {leaf.path!r}"
            dset = f.get(leaf.path)
            expected = _shape(meta, leaf)
            if not isinstance(dset, h5py.Dataset):
                found.unusable = f"{path}: {where}: no dataset {leaf.path!r}"
                problems.append(found.unusable)
                continue
            if dset.shape != expected or dset.dtype != leaf.spec.dtype:
                found.unusable = (
                    f"{path}: {where}: expected {expected} {leaf.spec.dtype}, found {dset.shape} {dset.dtype}"
                )
                problems.append(found.unusable)
                continue
            if leaf.mapped:
                offset = dset.id.get_offset()
                if dset.chunks is not None or offset is None or int(offset) != leaf.offset:
                    found.unusable = (
                        f"{path}: {where}: metadata maps offset {leaf.offset}, the dataset is "
                        f"{'chunked' if dset.chunks else 'at offset ' + str(offset)}"
                    )
                    problems.append(found.unusable)
                continue
            if (
                dset.chunks != (leaf.chunk_steps, *expected[1:])
                or dset.id.get_create_plist().get_nfilters() == 0
            ):
                found.unusable = f"{path}: {where}: expected compressed chunks of {leaf.chunk_steps} steps, found {dset.chunks}"
                problems.append(found.unusable)
                continue
            if not deep:
                continue
            require_filters(dset, f"{path}: {where}")  # a missing codec is no damage: ImportError
            for k in _chunks_of(meta, leaf):
                a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
                try:
                    np.asarray(dset[a:b])
                except Exception as exc:
                    if _journal_decodes(dset, found.journal.get(leaf.path, {}).get(k), f"{path}: {where}"):
                        continue
                    found.bad_chunks.setdefault(leaf.path, {})[k] = str(exc)
                    problems.append(
                        f"{path}: {where}: chunk {k} (steps in slots {a}..{b - 1}) does not decode: {exc}"
                    )
    return found


def _journal_decodes(dset, record, where: str) -> bool:
    """Whether the journal's copy of a chunk decodes (then readers use it, and the next
    writer writes it back)."""
    if record is None:
        return False
    from .backends.h5chunks import Codec

    try:
        codec = Codec(dset, where)
    except Exception:
        return False
    try:
        codec.decode(*record)
        return True
    except Exception:
        return False
    finally:
        codec.close()


# --- episodes ------------------------------------------------------------------------------


def _check_episodes(folder: str, meta: Metadata, deep: bool, problems: list[str]) -> None:
    """The episode index file, where there is one, must be well formed and (``deep``)
    hold exactly the episode ends the role leaves give for the committed steps it covers.

    Records at or past the committed cursor are a killed writer's and are ignored (the
    next writer cuts them off); a damaged index is rebuilt from the role leaves once it
    is removed, which :func:`recover` does.
    """
    from .episodes import HEADER_BYTES, INDEX_FILE, MAGIC, RECORD

    path = os.path.join(folder, INDEX_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return
    where = f"episode index {path}"
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        problems.append(f"{where}: not an episode index (bad header)")
        return
    origin = int(np.frombuffer(raw, "<i8", 1, 8)[0])
    rec = np.frombuffer(raw, RECORD, (len(raw) - HEADER_BYTES) // RECORD.itemsize, HEADER_BYTES)
    rec = rec[rec["step"] < meta.state.end]
    steps = rec["step"]
    bad = []
    if origin < 0:
        bad.append(f"origin {origin} is negative")
    if len(rec) and (np.any(steps[1:] < steps[:-1]) or steps[0] < origin - 1):
        bad.append("records are out of step order")
    if np.any((rec["env"] < 0) | (rec["env"] >= meta.num_envs)):
        bad.append(f"records name envs outside [0, {meta.num_envs})")
    if np.any((rec["code"] < 1) | (rec["code"] > 3)):
        bad.append("records hold unknown end codes")
    if bad:
        problems.append(f"{where}: " + "; ".join(bad))
        return
    if not deep or problems or holder_pid(folder) not in (None, os.getpid()):
        return  # (a live writer may overwrite the rows being compared)
    from .episodes import EndRule
    from .store import open as open_store

    try:
        store = open_store(folder, "r")
    except Error:
        return  # the other checks say why
    try:
        rule = EndRule(store)
        lo = max(origin, store.first_step)
        hi = min(store.committed_steps, meta.state.end)
        if rule.kind is None or hi <= lo:
            return
        mine = rec[(rec["step"] >= lo) & (rec["step"] < hi)]
        mine = mine[np.lexsort((mine["env"], mine["step"]))]
        done = 0  # records of mine compared so far
        for a in range(lo, hi, EPISODE_BLOCK):  # bounded memory however long the window
            ids = np.arange(a, min(hi, a + EPISODE_BLOCK), dtype=np.int64)
            codes = rule.codes(ids % store.capacity, store.num_envs)
            t, e = np.nonzero(codes)
            part = mine[done : done + len(t)]
            done += len(t)
            if not (
                len(part) == len(t)
                and np.array_equal(part["step"], ids[t])
                and np.array_equal(part["env"], e)
                and np.array_equal(part["code"], codes[t, e])
            ):
                problems.append(
                    f"{where}: its episode ends for steps [{lo}, {hi}) disagree with the role leaves"
                )
                return
        if done != len(mine):
            problems.append(f"{where}: it holds episode ends the role leaves do not give in [{lo}, {hi})")
    except Error as exc:
        problems.append(f"{where}: the role leaves cannot be read to check it: {exc}")
    finally:
        store.close()


# --- leftovers -----------------------------------------------------------------------------


def leftovers(path: str | os.PathLike) -> list[str]:
    """Files a killed writer may leave behind, harmless but untidy (temp state, zarr partials)."""
    folder = os.fspath(path)
    out = glob.glob(os.path.join(glob.escape(folder), METADATA_FILE + ".*.tmp"))
    out += glob.glob(os.path.join(glob.escape(folder), STATE_FILE + ".*.tmp"))
    out += glob.glob(os.path.join(glob.escape(folder), "episodes.idx.*.tmp"))
    out += glob.glob(os.path.join(glob.escape(folder), HDF5_FILE + ".journal.*.tmp"))
    zroot = os.path.join(folder, ZARR_DIR)
    if os.path.isdir(zroot):
        for dirpath, _, files in os.walk(zroot):
            out.extend(os.path.join(dirpath, name) for name in files if name.endswith(".partial"))
    return sorted(out)


# --- recover -------------------------------------------------------------------------------


@dataclass
class Recovery:
    """What :func:`recover` did.

    ``lost`` is the committed window it dropped ``(first, end)`` (None when nothing was
    lost); ``kept`` the committed window the buffer holds now; ``actions`` each change
    made, in order; ``problems`` what :func:`verify` still finds afterwards.
    """

    path: str
    actions: list[str] = field(default_factory=list)
    lost: tuple[int, int] | None = None
    kept: tuple[int, int] | None = None
    reasons: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        lines = []
        if self.lost is not None:
            a, b = self.lost
            lines.append(f"lost committed steps [{a}, {b}) ({b - a} steps): " + "; ".join(self.reasons))
        else:
            lines.append("no committed step was lost")
        if self.kept is not None:
            a, b = self.kept
            lines.append(f"kept committed steps [{a}, {b}) ({b - a} steps)")
        lines.extend(f"- {a}" for a in self.actions)
        if self.problems:
            lines.append("still damaged:")
            lines.extend(f"- {p}" for p in self.problems)
        return "\n".join(lines)


def recover(path: str | os.PathLike) -> Recovery:
    """Bring a damaged buffer back to its last consistent commit, where that is possible.

    Holds the writer lock while it works, so it refuses a buffer a live writer holds.
    It clears the HDF5 "open for writing" flags a dead writer left, rewrites a damaged
    zarr shard index, restores missing or truncated data files and undecodable chunks
    (as zeros), drops from the committed window every step whose rows were damaged (and
    the older ones, so the window stays contiguous), removes a killed writer's temporary
    files, and rebuilds damaged metadata from a killed commit's complete temporary copy,
    else from the damaged file itself when it still parses and agrees with the data
    files; the committed window of either cannot be trusted, so all its steps are
    dropped and the buffer goes on empty with the same layout.

    Raises:
        NotABufferError: nothing at ``path`` looks like a buffer.
        LockedError: a live writer holds the buffer.
        ReadOnlyError: the buffer is on a read-only file system.
        UnsupportedFormatError: a newer mmreplay wrote it (it is left alone).
        CorruptBufferError: the metadata is damaged and nothing trustworthy is left to
            rebuild it from (the files are left as they are).
        ImportError: a codec the data needs is missing (``pip install
            'mmreplay[hdf5plugin]'``); nothing was changed.

    Example:
        >>> import mmreplay as mr, tempfile
        >>> from mmreplay.verify import recover
        >>> p = tempfile.mkdtemp() + "/b"
        >>> mr.create(p, {"x": mr.ArraySpec((), "int64")}, 10).close()
        >>> print(recover(p))
        no committed step was lost
        kept committed steps [0, 0) (0 steps)
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise NotABufferError(f"{folder}: no such folder")
    if not os.path.exists(os.path.join(folder, METADATA_FILE)) and not _tmp_copies(folder):
        raise NotABufferError(f"{folder}: not an mmreplay buffer (no {METADATA_FILE})")
    lock = WriterLock(folder)
    lock.acquire()
    try:
        return _recover(folder)
    finally:
        lock.release()


def _tmp_copies(folder: str) -> list[str]:
    return glob.glob(os.path.join(glob.escape(folder), METADATA_FILE + ".*.tmp"))


def _recover(folder: str) -> Recovery:
    out = Recovery(folder)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if os.path.isfile(os.path.join(folder, HDF5_FILE)):
        from .backends.h5chunks import require_file_filters

        # chunks that do not decode for want of a codec are no damage: stop before any change
        require_file_filters(os.path.join(folder, HDF5_FILE))
    meta: Metadata | None = None
    try:
        meta = read_metadata(folder)
    except UnsupportedFormatError:
        raise  # a newer mmreplay wrote it: leave it alone
    except NotABufferError:
        why = f"{METADATA_FILE} is missing"
    except Error as exc:
        why = str(exc)
        try:
            static = read_static(folder)
        except Error:
            static = None
        if static is not None and static.format_version >= 2:  # the JSON is sound: the state is not
            meta = _rebuild_state(folder, static, out, why, stamp)
    if meta is None:
        meta = _rebuild_metadata(folder, out, why, stamp)
    if meta.format_version == 1:  # recover writes as a writer does: in format 2
        meta = migrate(folder, meta, fsync=True)
        out.actions.append(f"upgraded the buffer to format 2 (the committed state moved to {STATE_FILE})")
    else:
        meta = _rewrite_damaged_slot(folder, meta, out)
    first, end = meta.state.first(meta.capacity), meta.state.end
    drop_before = first  # every step before this is dropped
    damaged_slots: list[tuple[int, int, str]] = []  # slot ranges [a, b) whose rows are gone

    if meta.backend == "zarr":
        meta, damaged_slots = _repair_zarr(folder, meta, out, stamp)
    else:
        meta, damaged_slots = _repair_hdf5(folder, meta, out, stamp)

    for a, b, why in damaged_slots:
        hit = newest_in_slots(first, end, meta.capacity, a, b)
        if hit is not None:
            drop_before = max(drop_before, hit + 1)
            out.reasons.append(why)
    if drop_before > first:
        out.lost = (first, drop_before)
        state = meta.state
        meta = meta.with_state(
            state.next(start=max(state.start, drop_before), commits=state.commits + 1, commit_time=time.time())
        )
        _write_state(folder, meta.state)
        out.actions.append(f"committed state now starts at step {drop_before}")
    out.kept = (meta.state.first(meta.capacity), meta.state.end)
    episode_problems: list[str] = []
    _check_episodes(folder, meta, True, episode_problems)
    if episode_problems:
        from .episodes import INDEX_FILE

        _move_aside(os.path.join(folder, INDEX_FILE), stamp, out, folder)
        out.actions.append("the episode index is rebuilt from the role leaves when the buffer is next opened")
    for extra in leftovers(folder):
        os.unlink(extra)
        out.actions.append(f"removed {os.path.relpath(extra, folder)} (left by a killed writer)")
    out.problems = verify(folder)
    return out


def _write_state(folder: str, state: State) -> None:
    """Commit ``state`` as a writer does (its slot, then to the disk)."""
    state_file = StateFile(folder, True)
    try:
        state_file.write(state, fsync=True)
    finally:
        state_file.close()


def _rewrite_damaged_slot(folder: str, meta: Metadata, out: Recovery) -> Metadata:
    """A state slot that fails its check while the other holds the committed state gets
    that state again, one generation on: nothing is lost."""
    with open(os.path.join(folder, STATE_FILE), "rb") as f:
        raw = f.read(FILE_BYTES)
    bad = [i for i in (0, 1) if isinstance(decode_slot(raw, i), str)]
    if not bad:
        return meta
    meta = meta.with_state(meta.state.next())
    _write_state(folder, meta.state)
    out.actions.append(f"rewrote the damaged slot {bad[0]} of {STATE_FILE} with the committed state")
    return meta


def _rebuild_state(folder: str, static: Metadata, out: Recovery, why: str, stamp: str) -> Metadata:
    """A state file that cannot be read next to sound metadata: a fresh one with an empty
    committed window (the window cannot be trusted), or, when the state reads and only
    the attributes disagree with it, the same state with the metadata's attributes."""
    try:
        state_file = StateFile(folder, False)
        try:
            state = state_file.read()
        finally:
            state_file.close()
    except Error:
        state = None
    if state is not None:
        meta = write_buffer(folder, static.with_state(state), fsync=True)
        out.actions.append(f"paired the attributes in {METADATA_FILE} with the committed state ({why})")
        return meta
    first, end = salvage(os.path.join(folder, STATE_FILE))
    _move_aside(os.path.join(folder, STATE_FILE), stamp, out, folder)
    meta = write_buffer(folder, static.with_state(State(end, end, end)), fsync=True)
    out.actions.append(f"rebuilt {STATE_FILE} with no committed step")
    out.lost = (first, end)
    out.reasons.append(
        f"the committed state could not be read ({why})"
        + ("" if end else "; how many steps were committed is unknown")
    )
    return meta


def _ignoring_checksum(raw: bytes, where: str) -> Metadata:
    """Parse metadata whose checksum failed: the JSON without its checksum member."""
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise CorruptBufferError(f"{where}: metadata must be a JSON object")
    obj.pop("checksum", None)
    return parse_metadata(json.dumps(obj).encode(), where)


def _rebuild_metadata(folder: str, out: Recovery, why: str, stamp: str) -> Metadata:
    """Metadata with an empty committed window, from the best description left.

    That is a killed commit's complete temporary copy, else the damaged file itself when
    it still parses once its checksum is ignored (the data files' structure is checked
    against it afterwards). Either way its committed window cannot be trusted (a later
    writer may have reused the copy's slots; the damaged file's numbers may be the
    damage), so every step is dropped; the buffer keeps its layout and its step count.
    """
    main = os.path.join(folder, METADATA_FILE)
    found: list[tuple[Metadata, str]] = []
    for tmp in _tmp_copies(folder):
        try:
            with open(tmp, "rb") as f:
                found.append((parse_metadata(f.read(), tmp), tmp))
        except (OSError, ValueError, Error):
            continue
    if found:
        meta, source = max(found, key=lambda c: (c[0].state.commits, c[0].state.end, c[0].attrs_generation))
        what = f"a killed commit's copy {os.path.basename(source)}"
    else:
        try:
            with open(main, "rb") as f:
                meta = _ignoring_checksum(f.read(), main)
        except (OSError, ValueError, Error):
            raise CorruptBufferError(
                f"{folder}: {why}; no readable copy of the metadata is left to rebuild it from, "
                f"so it is not rebuilt: restore {METADATA_FILE} from a backup (the data files are untouched)"
            ) from None
        source, what = main, f"the damaged {METADATA_FILE} itself (checksum ignored)"
        disagree = _structure_problems(folder, meta)
        if disagree:
            raise CorruptBufferError(
                f"{folder}: {why}; what it still says disagrees with the data files ({disagree[0]}), "
                f"so it is not rebuilt: restore {METADATA_FILE} from a backup, or correct it by hand "
                'and delete its "checksum" line'
            )
    if meta.format_version >= 2:  # the window is in the state file (read if it still reads)
        try:
            state_file = StateFile(folder, False)
            try:
                meta = meta.with_state(state_file.read())
            finally:
                state_file.close()
        except Error:
            first, end = salvage(os.path.join(folder, STATE_FILE))
            meta = meta.with_state(State(first, end, end))
    if os.path.exists(main):
        os.replace(main, f"{main}.damaged-{stamp}")
        out.actions.append(f"moved the damaged {METADATA_FILE} aside to {METADATA_FILE}.damaged-{stamp}")
    end = max(meta.state.reserved, meta.state.end)
    first = meta.state.first(meta.capacity)
    state = State(end, end, end, meta.state.commits + 1, time.time(), meta.state.generation + 1)
    meta = write_buffer(folder, meta.with_state(state), fsync=True)
    if source != main:
        os.unlink(source)
    out.actions.append(f"rebuilt {METADATA_FILE} from {what}, with no committed step")
    out.lost = (first, end)
    out.reasons.append(f"the committed state could not be trusted ({why})")
    return meta


def _structure_problems(folder: str, meta: Metadata) -> list[str]:
    """Where the data files disagree with ``meta``'s description (its state aside)."""
    empty = meta.with_state(State())
    problems: list[str] = []
    if meta.backend == "zarr":
        _check_zarr(folder, empty, False, problems)
    else:
        _check_hdf5(folder, empty, False, problems)
    return [p for p in problems if "status flags" not in p]


def _move_aside(path: str, stamp: str, out: Recovery, folder: str) -> None:
    if os.path.lexists(path):
        dest = f"{path}.damaged-{stamp}"
        os.replace(path, dest)
        out.actions.append(f"moved {os.path.relpath(path, folder)} aside to {os.path.relpath(dest, folder)}")


def _fresh_layout(folder: str, meta: Metadata) -> tuple[str, list[LeafInfo]]:
    """A fresh, empty copy of the data files in a temporary folder inside ``folder``."""
    from . import backends

    tmp = os.path.join(folder, f".recover-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    bare = [replace(leaf, file=None, offset=None) for leaf in meta.leaves]
    infos = backends.get(meta.backend).create(tmp, bare, meta.capacity, meta.num_envs)
    return tmp, infos


def _all_slots(meta: Metadata) -> tuple[int, int]:
    return 0, meta.capacity


def _repair_zarr(folder: str, meta: Metadata, out: Recovery, stamp: str) -> tuple[Metadata, list]:
    import zarr

    problems: list[str] = []
    found = _check_zarr(folder, meta, True, problems)
    damaged: list[tuple[int, int, str]] = []
    fresh: str | None = None
    try:
        if any(s.unusable for s in found.values()) and not os.path.isdir(os.path.join(folder, ZARR_DIR)):
            fresh, infos = _fresh_layout(folder, meta)
            os.replace(os.path.join(fresh, ZARR_DIR), os.path.join(folder, ZARR_DIR))
            out.actions.append(f"recreated the missing {ZARR_DIR} folder, empty")
            damaged.append((*_all_slots(meta), f"{ZARR_DIR} was missing"))
            return meta, damaged
        bad_groups = _bad_groups(folder, meta)
        if bad_groups or any(s.meta_bad for s in found.values()):
            fresh, _ = _fresh_layout(folder, meta)
        for group in bad_groups:  # the same layout makes the same group metadata
            target = os.path.join(folder, ZARR_DIR, group, "zarr.json")
            _move_aside(target, stamp, out, folder)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(os.path.join(fresh, ZARR_DIR, group, "zarr.json"), target)
            out.actions.append(f"rewrote {os.path.relpath(target, folder)}")
        for leaf in meta.leaves:
            s = found[leaf.path]
            arr_dir = os.path.join(folder, ZARR_DIR, leaf.path)
            if s.meta_bad and os.path.isdir(arr_dir):  # the data may be intact: restore the array metadata
                target = os.path.join(arr_dir, "zarr.json")
                _move_aside(target, stamp, out, folder)
                shutil.copyfile(os.path.join(fresh, ZARR_DIR, leaf.path, "zarr.json"), target)
                out.actions.append(f"leaf {leaf.path!r}: rewrote {os.path.relpath(target, folder)}")
                s = found[leaf.path] = _zarr_leaf(folder, meta, leaf, True, [])
            if s.unusable:
                if fresh is None:
                    fresh, _ = _fresh_layout(folder, meta)
                _move_aside(arr_dir, stamp, out, folder)
                os.makedirs(os.path.dirname(arr_dir), exist_ok=True)
                os.replace(os.path.join(fresh, ZARR_DIR, leaf.path), arr_dir)
                out.actions.append(f"recreated leaf {leaf.path!r}, empty")
                damaged.append((*_all_slots(meta), f"leaf {leaf.path!r}: {s.unusable}"))
                continue
            if leaf.mapped and (s.shard_short is not None or s.bad_index):
                shard = os.path.join(folder, leaf.file or "")
                data_bytes, file_bytes, index = _shard_layout(meta, leaf)
                short = s.shard_short
                if os.path.lexists(shard) and not os.path.isfile(shard):
                    _move_aside(shard, stamp, out, folder)
                os.makedirs(os.path.dirname(shard), exist_ok=True)
                fd = os.open(shard, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    if short is not None:
                        os.ftruncate(fd, file_bytes)
                    os.pwrite(fd, index.tobytes(), data_bytes)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                if short is not None:
                    step_bytes = meta.num_envs * leaf.spec.nbytes
                    lo = min(meta.capacity, short // max(1, step_bytes))
                    what = "missing" if short == 0 else f"truncated to {short} bytes"
                    out.actions.append(
                        f"leaf {leaf.path!r}: restored its data file ({what}) to {file_bytes} bytes"
                    )
                    damaged.append((lo, meta.capacity, f"leaf {leaf.path!r}: its data file was {what}"))
                else:
                    out.actions.append(f"leaf {leaf.path!r}: rewrote the shard index")
            if s.bad_chunks:
                arr = zarr.open_array(store=zarr.storage.LocalStore(arr_dir), mode="r+").with_config(
                    {"write_empty_chunks": True}
                )
                for k, why in sorted(s.bad_chunks.items()):
                    a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
                    chunk = os.path.join(arr_dir, arr.metadata.encode_chunk_key((k,) + (0,) * (arr.ndim - 1)))
                    _move_aside(chunk, stamp, out, folder)
                    arr[a:b] = np.zeros((b - a, *arr.shape[1:]), arr.dtype)
                    out.actions.append(f"leaf {leaf.path!r}: rewrote chunk {k} (slots {a}..{b - 1}) as zeros")
                    damaged.append((a, b, f"leaf {leaf.path!r}: {why}"))
    finally:
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
    return meta, damaged


def _repair_hdf5(folder: str, meta: Metadata, out: Recovery, stamp: str) -> tuple[Metadata, list]:
    from .backends.h5chunks import Journal, journal_limits, journal_path, replay
    from .backends.hdf5 import clear_status_flags

    path = os.path.join(folder, HDF5_FILE)
    problems: list[str] = []
    found = _check_hdf5(folder, meta, True, problems)
    damaged: list[tuple[int, int, str]] = []
    if found.short is not None and found.unusable is None:
        status = hdf5_status(path)
        need = max(
            [status[1] if status else 0]
            + [leaf.offset + _leaf_bytes(meta, leaf) for leaf in meta.leaves if leaf.mapped]
        )
        short = found.short
        with open(path, "r+b") as f:
            f.truncate(need)
            os.fsync(f.fileno())
        out.actions.append(f"extended the truncated {HDF5_FILE} from {short} to {need} bytes")
        for leaf in meta.leaves:
            if leaf.mapped:
                step_bytes = meta.num_envs * leaf.spec.nbytes
                if leaf.offset + _leaf_bytes(meta, leaf) > short:
                    lo = max(0, (short - leaf.offset) // max(1, step_bytes))
                    damaged.append(
                        (
                            min(lo, meta.capacity),
                            meta.capacity,
                            f"leaf {leaf.path!r}: {HDF5_FILE} was truncated",
                        )
                    )
            else:
                damaged.append(
                    (
                        *_all_slots(meta),
                        f"leaf {leaf.path!r}: {HDF5_FILE} was truncated (its chunks may be gone)",
                    )
                )
        problems = []
        found = _check_hdf5(folder, meta, True, problems)
    if found.flags_set:
        clear_status_flags(path)
        out.actions.append(f"cleared the HDF5 status flags a dead writer left in {HDF5_FILE}")
    if found.bad_journal:
        _move_aside(journal_path(path), stamp, out, folder)
    elif found.journal and found.unusable is None:
        import h5py

        with h5py.File(path, "r+", libver="latest") as f:
            count = sum(len(c) for c in replay(f, Journal(path, journal_limits(meta))).values())
        out.actions.append(f"wrote {count} chunks back from the chunk journal into {HDF5_FILE}")
        problems = []
        found = _check_hdf5(folder, meta, True, problems)
    if found.unusable is not None or found.bad_chunks:
        why = found.unusable or "; ".join(
            f"leaf {p!r} chunks {sorted(c)} do not decode" for p, c in found.bad_chunks.items()
        )
        fresh, infos = _fresh_layout(folder, meta)
        try:
            _move_aside(path, stamp, out, folder)
            _move_aside(journal_path(path), stamp, out, folder)  # its chunks belong to the old file
            os.replace(os.path.join(fresh, HDF5_FILE), path)
        finally:
            shutil.rmtree(fresh, ignore_errors=True)
        meta = replace(
            meta,
            leaves=tuple(
                replace(old, file=new.file, offset=new.offset) for old, new in zip(meta.leaves, infos)
            ),
        )
        write_metadata(folder, meta, fsync=True)
        out.actions.append(f"recreated {HDF5_FILE} with the same layout, empty")
        damaged.append((*_all_slots(meta), f"{HDF5_FILE}: {why}"))
    return meta, damaged
