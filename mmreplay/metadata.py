"""The metadata record (``mmreplay.json``): validated on read, replaced atomically on write.

The file holds the static description of a buffer (spec, capacity, per-leaf storage) and
the committed state. Opening a buffer reads this file only, so it is validated as
untrusted input: absurd sizes and paths that leave the folder are refused before
anything is allocated or mapped.

The committed state is three global step ids (a step id counts every step ever added):

- ``end``: steps up to here are committed;
- ``start``: steps before it were cleared;
- ``reserved``: the writer may overwrite the slots of steps before
  ``reserved - capacity`` without a further state write, so readers treat those as gone.

The retained committed steps are ``[max(start, reserved - capacity), end)``.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .errors import CorruptBufferError, DiskFullError, NotABufferError, UnsupportedFormatError
from .spec import ArraySpec, flatten, leaf_paths, spec_from_json, spec_to_json, validate_leaf_path

__all__ = [
    "FORMAT",
    "METADATA_FILE",
    "LeafInfo",
    "State",
    "Metadata",
    "read_metadata",
    "read_state",
    "write_metadata",
    "atomic_write",
]

FORMAT_NAME = "mmreplay"
FORMAT_VERSION = 1
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"
METADATA_FILE = "mmreplay.json"

MAX_CAPACITY = 1 << 40
MAX_NUM_ENVS = 1 << 20
MAX_LEAF_BYTES = 1 << 50  # 1 PiB: larger than any disk this will meet
MAX_METADATA_BYTES = 64 << 20
BACKENDS = ("zarr", "hdf5")
DURABILITIES = ("process", "power")


@dataclass(frozen=True)
class LeafInfo:
    """Where and how one leaf is stored.

    ``offset`` is the byte offset of the leaf's ``[capacity, num_envs, *shape]`` C-order
    block inside ``file`` for memory-mapped leaves, and None for chunked ones.
    """

    path: str
    spec: ArraySpec
    chunk_steps: int
    compression: str | None = None
    file: str | None = None
    offset: int | None = None

    @property
    def mapped(self) -> bool:
        return self.offset is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.spec.shape),
            "dtype": self.spec.dtype.name,
            "chunk_steps": self.chunk_steps,
            "compression": self.compression,
            "file": self.file,
            "offset": self.offset,
        }


@dataclass(frozen=True)
class State:
    """The committed state (see the module docstring)."""

    start: int = 0
    end: int = 0
    reserved: int = 0
    commits: int = 0
    commit_time: float | None = None

    def first(self, capacity: int) -> int:
        """Global id of the oldest retained committed step."""
        return min(self.end, max(self.start, self.reserved - capacity))

    def to_json(self) -> str:
        return json.dumps(
            {
                "start": self.start,
                "end": self.end,
                "reserved": self.reserved,
                "commits": self.commits,
                "commit_time": self.commit_time,
            }
        )


@dataclass(frozen=True)
class Metadata:
    """Everything static about a buffer, plus its committed state."""

    backend: str
    capacity: int
    num_envs: int
    spec: Any
    leaves: tuple[LeafInfo, ...]
    roles: dict[str, str] = field(default_factory=dict)
    commit_every: int = 1000
    durability: str = "process"
    created: float = field(default_factory=time.time)
    attrs: dict[str, Any] = field(default_factory=dict)
    state: State = field(default_factory=State)
    sampler: dict[str, Any] | None = None  # the sampler's name and parameters; None: uniform

    def static_json(self) -> str:
        """The JSON text of everything but the state, ending before the closing brace.

        Commits append the state to this prefix, so a commit serialises a few numbers.
        """
        body = {
            "format": FORMAT,
            "backend": self.backend,
            "capacity": self.capacity,
            "num_envs": self.num_envs,
            "spec": spec_to_json(self.spec),
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "roles": self.roles,
            "commit_every": self.commit_every,
            "durability": self.durability,
            "created": self.created,
            "attrs": self.attrs,
        }
        if self.sampler is not None:
            body["sampler"] = self.sampler
        return json.dumps(body, indent=1)[:-2]

    def with_state(self, state: State) -> Metadata:
        return replace(self, state=state)


def render(meta: Metadata, static_prefix: str | None = None) -> bytes:
    """The file's bytes; a CRC-32 of everything before it ends the file (see :func:`check_checksum`)."""
    prefix = static_prefix if static_prefix is not None else meta.static_json()
    body = f'{prefix},\n "state": {meta.state.to_json()}'.encode()
    return body + b',\n "checksum": "crc32:%08x"\n}\n' % zlib.crc32(body)


_CHECKSUM = re.compile(rb',\n "checksum": "crc32:([0-9a-f]{8})"\n}\n?\Z')


def check_checksum(raw: bytes, obj: dict, where: str) -> None:
    """Refuse a file whose checksum does not match, so a damaged digit (a capacity, a
    cursor, an offset) is an error, never a silently different buffer.

    A file with no checksum at all (written by hand or by another tool) is accepted.
    """
    if "checksum" not in obj and b'"crc32:' not in raw:
        return
    found = _CHECKSUM.search(raw)
    if found is None or zlib.crc32(raw[: found.start()]) != int(found.group(1), 16):
        raise CorruptBufferError(
            f"{where}: metadata checksum mismatch: the file was damaged (or edited: "
            'to keep a deliberate edit, delete the "checksum" line)'
        )


def atomic_write(path: str, data: bytes, fsync: bool = False) -> None:
    """Replace ``path`` with ``data`` so a reader or a crash sees the old or the new file.

    The temporary file lives in the same folder (``os.replace`` is atomic only within a
    file system). With ``fsync`` the file and the folder entry reach the disk too.
    """
    folder = os.path.dirname(path) or "."
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException as exc:
        os.close(fd)
        _unlink_quietly(tmp)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"{path}: no space left on the file system to write it; the previous one is intact") from exc
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if fsync:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_metadata(folder: str, meta: Metadata, fsync: bool = False) -> None:
    atomic_write(os.path.join(folder, METADATA_FILE), render(meta), fsync)


# --- reading untrusted metadata -------------------------------------------------------


def _int(obj: dict, key: str, lo: int, hi: int, where: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptBufferError(f"{where}: {key!r} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _parse_format(fmt: Any, where: str) -> None:
    if not isinstance(fmt, str) or not fmt.startswith(FORMAT_NAME + "/"):
        raise CorruptBufferError(f"{where}: expected format {FORMAT!r}, got {fmt!r:.80}")
    version = fmt.split("/", 1)[1]
    if not version.isdigit():
        raise CorruptBufferError(f"{where}: expected format {FORMAT!r}, got {fmt!r:.80}")
    if int(version) > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{where}: written in format {fmt!r}, newer than {FORMAT!r} that this "
            "mmreplay reads; upgrade mmreplay to open it"
        )
    if int(version) < 1:
        raise CorruptBufferError(f"{where}: unknown format {fmt!r}")


def _parse_leaf(obj: Any, capacity: int, num_envs: int, where: str) -> LeafInfo:
    if not isinstance(obj, dict):
        raise CorruptBufferError(f"{where}: leaf entry must be an object, got {obj!r:.80}")
    path = obj.get("path")
    try:
        validate_leaf_path(path)
        spec = spec_from_json({"shape": obj.get("shape"), "dtype": obj.get("dtype")}, str(path))
    except Exception as exc:
        raise CorruptBufferError(f"{where}: {exc}") from None
    leaf_bytes = capacity * num_envs * spec.nbytes
    if leaf_bytes > MAX_LEAF_BYTES:
        raise CorruptBufferError(
            f"{where}: leaf {path!r} would take {leaf_bytes} bytes "
            f"({capacity} x {num_envs} x {spec.shape} {spec.dtype}); refusing sizes over {MAX_LEAF_BYTES}"
        )
    chunk_steps = _int(obj, "chunk_steps", 1, capacity, f"{where} leaf {path!r}")
    compression = obj.get("compression")
    if compression is not None and not isinstance(compression, str):
        raise CorruptBufferError(f"{where} leaf {path!r}: compression must be a string or null")
    file = obj.get("file")
    if file is not None:
        try:  # a relative path of plain names: it cannot leave (or be) the buffer folder
            validate_leaf_path(file)
        except Exception:
            raise CorruptBufferError(f"{where} leaf {path!r}: file {file!r:.80} is not a path inside the buffer folder") from None
    offset = obj.get("offset")
    if offset is not None:
        offset = _int(obj, "offset", 0, MAX_LEAF_BYTES, f"{where} leaf {path!r}")
        if file is None:
            raise CorruptBufferError(f"{where} leaf {path!r}: a mapped leaf needs a file")
        if compression is not None:
            raise CorruptBufferError(f"{where} leaf {path!r}: a mapped leaf (with an offset) cannot be compressed")
    return LeafInfo(path, spec, chunk_steps, compression, file, offset)


def parse_metadata(raw: bytes, where: str) -> Metadata:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptBufferError(f"{where}: metadata is not valid JSON ({exc})") from None
    except RecursionError:
        raise CorruptBufferError(f"{where}: metadata is nested too deeply to be a buffer's") from None
    if not isinstance(obj, dict):
        raise CorruptBufferError(f"{where}: metadata must be a JSON object")
    _parse_format(obj.get("format"), where)
    check_checksum(raw, obj, where)
    backend = obj.get("backend")
    if backend not in BACKENDS:
        raise CorruptBufferError(f"{where}: backend must be one of {BACKENDS}, got {backend!r:.80}")
    capacity = _int(obj, "capacity", 1, MAX_CAPACITY, where)
    num_envs = _int(obj, "num_envs", 1, MAX_NUM_ENVS, where)
    try:
        spec = spec_from_json(obj.get("spec"))
    except Exception as exc:
        raise CorruptBufferError(f"{where}: {exc}") from None
    raw_leaves = obj.get("leaves")
    if not isinstance(raw_leaves, list):
        raise CorruptBufferError(f"{where}: 'leaves' must be a list")
    leaves = tuple(_parse_leaf(leaf, capacity, num_envs, where) for leaf in raw_leaves)
    expected = list(zip(leaf_paths(spec), flatten(spec)))
    # names aside (the leaves carry none): both sides hold normalised shapes and dtypes
    found = [(leaf.path, leaf.spec.shape, leaf.spec.dtype) for leaf in leaves]
    if [(p, s.shape, s.dtype) for p, s in expected] != found:
        raise CorruptBufferError(f"{where}: the leaves do not match the spec")
    leaves = tuple(replace(leaf, spec=s) for leaf, (_, s) in zip(leaves, expected))
    roles = obj.get("roles", {})
    if not isinstance(roles, dict) or not all(isinstance(v, str) for v in roles.values()):
        raise CorruptBufferError(f"{where}: 'roles' must map role names to leaf paths")
    attrs = obj.get("attrs", {})
    if not isinstance(attrs, dict):
        raise CorruptBufferError(f"{where}: 'attrs' must be an object")
    durability = obj.get("durability", "process")
    if durability not in DURABILITIES:
        raise CorruptBufferError(f"{where}: durability must be one of {DURABILITIES}")
    created = obj.get("created", 0.0)
    if not isinstance(created, (int, float)):
        raise CorruptBufferError(f"{where}: 'created' must be a number")
    sampler = obj.get("sampler")
    if sampler is not None and not (isinstance(sampler, dict) and isinstance(sampler.get("name"), str)):
        raise CorruptBufferError(f"{where}: 'sampler' must be an object with a string 'name'")
    return Metadata(
        backend=backend,
        capacity=capacity,
        num_envs=num_envs,
        spec=spec,
        leaves=leaves,
        roles=dict(roles),
        commit_every=_int(obj, "commit_every", 1, MAX_CAPACITY, where),
        durability=durability,
        created=float(created),
        attrs=attrs,
        state=parse_state(obj.get("state"), where),
        sampler=sampler,
    )


def parse_state(obj: Any, where: str) -> State:
    if not isinstance(obj, dict):
        raise CorruptBufferError(f"{where}: 'state' must be an object")
    hi = 1 << 62
    start = _int(obj, "start", 0, hi, f"{where} state")
    end = _int(obj, "end", 0, hi, f"{where} state")
    reserved = _int(obj, "reserved", 0, hi, f"{where} state")
    if not start <= end <= reserved:
        raise CorruptBufferError(
            f"{where}: state must have start <= end <= reserved, got {start}, {end}, {reserved}"
        )
    commit_time = obj.get("commit_time")
    if commit_time is not None and not isinstance(commit_time, (int, float)):
        raise CorruptBufferError(f"{where}: state commit_time must be a number or null")
    commits = _int(obj, "commits", 0, hi, f"{where} state")
    return State(start, end, reserved, commits, commit_time)


def _read_bounded(path: str) -> bytes:
    """The file's bytes, refusing one larger than any real metadata before reading it."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_METADATA_BYTES:
            raise CorruptBufferError(f"{path}: {size} bytes, larger than metadata can be ({MAX_METADATA_BYTES})")
        return f.read(size + 1)  # +1: a file that grew since fstat still ends the read


def read_metadata(folder: str) -> Metadata:
    """Read and validate ``folder/mmreplay.json``."""
    path = os.path.join(folder, METADATA_FILE)
    try:
        raw = _read_bounded(path)
    except FileNotFoundError:
        if not os.path.exists(folder):
            raise NotABufferError(f"{folder}: no such folder") from None
        raise NotABufferError(f"{folder}: not an mmreplay buffer (no {METADATA_FILE})") from None
    except IsADirectoryError:
        raise CorruptBufferError(f"{path}: is a folder, expected a JSON file") from None
    except NotADirectoryError:
        raise NotABufferError(f"{folder}: not a folder") from None
    return parse_metadata(raw, path)


def read_state(folder: str) -> State:
    """Only the committed state, for readers polling a live writer (no spec validation)."""
    path = os.path.join(folder, METADATA_FILE)
    try:
        obj = json.loads(_read_bounded(path))
    except FileNotFoundError:
        raise NotABufferError(f"{folder}: not an mmreplay buffer (no {METADATA_FILE})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptBufferError(f"{path}: metadata is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise CorruptBufferError(f"{path}: metadata must be a JSON object")
    return parse_state(obj.get("state"), path)


def step_nbytes(meta: Metadata) -> int:
    """Bytes of one step (every leaf, every env)."""
    return sum(math.prod(leaf.spec.shape) * leaf.spec.dtype.itemsize for leaf in meta.leaves) * meta.num_envs


def little_endian(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
