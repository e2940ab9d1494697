"""The metadata record (``mmreplay.json``): validated on read, replaced atomically on write.

The file holds the static description of a buffer (spec, capacity, per-leaf storage) and
its user attributes; it is written when the buffer is created and by
:meth:`mmreplay.Store.set_attrs`, never by a commit. The committed state lives in the
state file (:mod:`mmreplay.statefile`). Opening a buffer reads these two files only, so
they are validated as untrusted input: absurd sizes and paths that leave the folder are
refused before anything is allocated or mapped.

Format 1 (``"mmreplay/1"``) kept the committed state inside this file and replaced it at
every commit. Such a buffer is read as it is; a writer (``mode="a"``) migrates it to
format 2 when it opens it (:func:`migrate`).

User attributes are paired with the state that committed them: the file carries the
attributes with the generation of the state write that commits them
(``attrs_generation``), and the previously committed ones (``previous_attrs``). A crash
between writing this file and writing that state leaves a state naming the previous
generation, and the previous attributes are read.
"""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .errors import BadInputError, CorruptBufferError, Error, ObjectNotFoundError, UnsupportedFormatError
from .files import atomic_write
from .frames_layout import FramesLayout, layout_from_json
from .io import ByteSource, open_source
from .spec import ArraySpec, flatten, leaf_paths, spec_from_json, spec_to_json, validate_leaf_path
from .statefile import MAX_STEP, STATE_FILE, State, StateFile, write_fresh

__all__ = [
    "FORMAT",
    "METADATA_FILE",
    "STATE_FILE",
    "LeafInfo",
    "State",
    "Metadata",
    "json_object",
    "read_metadata",
    "read_state",
    "write_metadata",
    "write_buffer",
    "migrate",
    "open_state",
    "atomic_write",
]

FORMAT_NAME = "mmreplay"
FORMAT_VERSION = 2
FORMAT = f"{FORMAT_NAME}/{FORMAT_VERSION}"
METADATA_FILE = "mmreplay.json"

MAX_CAPACITY = 1 << 40
MAX_NUM_ENVS = 1 << 20
MAX_LEAF_BYTES = 1 << 50  # 1 PiB: larger than any disk this will meet
MAX_METADATA_BYTES = 64 << 20
#: a compressed chunk is decoded (and staged) whole in memory: one larger is refused
MAX_CHUNK_BYTES = 1 << 30
BACKENDS = ("zarr", "hdf5")
DURABILITIES = ("process", "power")
PAIR_TRIES = 8  # a reader racing set_attrs reads the two files again


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
class Metadata:
    """Everything static about a buffer, plus its committed state.

    ``attrs`` are the committed user attributes and ``attrs_generation`` the state
    generation that committed them. ``format_version`` is the version of the file read
    (1: the state is inside the JSON, and the buffer is not migrated yet).
    """

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
    attrs_generation: int = 0
    format_version: int = FORMAT_VERSION
    previous_attrs: tuple[int, dict[str, Any]] | None = None  # as read, before pairing
    sampler: dict[str, Any] | None = None  # the sampler's name and parameters; None: uniform
    frames: FramesLayout | None = None  # each frame stored once; None: as given

    def with_state(self, state: State) -> Metadata:
        return replace(self, state=state)


def render(meta: Metadata, previous: tuple[int, dict[str, Any]] | None = None) -> bytes:
    """The format-2 file's bytes; a CRC-32 of everything before it ends the file (see
    :func:`check_checksum`). ``previous``: the attributes committed before ``meta``'s,
    with their generation, kept until a state names ``meta.attrs_generation``."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "backend": meta.backend,
        "capacity": meta.capacity,
        "num_envs": meta.num_envs,
        "spec": spec_to_json(meta.spec),
        "leaves": [leaf.to_json() for leaf in meta.leaves],
        "roles": meta.roles,
        "commit_every": meta.commit_every,
        "durability": meta.durability,
        "created": meta.created,
        "attrs": meta.attrs,
        "attrs_generation": meta.attrs_generation,
    }
    if meta.sampler is not None:
        body["sampler"] = meta.sampler
    if meta.frames is not None:
        body["frames"] = meta.frames.to_json()
    if previous is not None:
        body["previous_attrs"] = {"generation": previous[0], "attrs": previous[1]}
    text = json.dumps(body, indent=1)[:-2].encode()
    return text + b',\n "checksum": "crc32:%08x"\n}\n' % zlib.crc32(text)


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


def write_metadata(
    folder: str, meta: Metadata, fsync: bool = False, previous: tuple[int, dict[str, Any]] | None = None
) -> None:
    """Replace the JSON file (static description and attributes; the state is not in it).
    A file past what :func:`read_metadata` reads is refused unwritten: the buffer would no
    longer open."""
    data = render(meta, previous)
    if len(data) > MAX_METADATA_BYTES:
        raise BadInputError(
            f"{os.path.join(folder, METADATA_FILE)}: the attributes (new and previous) would make it {len(data)} "
            f"bytes, past the {MAX_METADATA_BYTES} a buffer's metadata may take; keep large data in a file"
        )
    atomic_write(os.path.join(folder, METADATA_FILE), data, fsync)


def write_buffer(folder: str, meta: Metadata, fsync: bool = False) -> Metadata:
    """Write a whole format-2 description: a fresh state file holding ``meta.state``, then
    the JSON file. Creation, migration and recovery use it; commits never do.

    The state file goes first: until the JSON names format 2 a format-1 file still holds
    the state, so a crash between the two leaves a buffer that reads as before.
    Returns ``meta`` as written (format 2, the state with the generation it got).
    """
    state = meta.state
    gen = max(state.generation, meta.attrs_generation + 1, 1)
    state = replace(state, generation=gen, attrs_generation=meta.attrs_generation)
    write_fresh(folder, state, fsync)
    meta = replace(meta, state=state, format_version=FORMAT_VERSION, previous_attrs=None)
    write_metadata(folder, meta, fsync)
    return meta


def migrate(folder: str, meta: Metadata, fsync: bool = False) -> Metadata:
    """Turn a format-1 buffer (``meta`` as read) into format 2, crash-safe at every point."""
    if meta.format_version != 1:
        return meta
    return write_buffer(folder, replace(meta, attrs_generation=0), fsync)


# --- reading untrusted metadata -------------------------------------------------------


def _int(obj: dict, key: str, lo: int, hi: int, where: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise CorruptBufferError(f"{where}: {key!r} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _parse_format(fmt: Any, where: str) -> int:
    name, _, version = fmt.partition("/") if isinstance(fmt, str) else ("", "", "")
    if name != FORMAT_NAME or not (version.isascii() and version.isdigit()):  # int() takes no "²"
        raise CorruptBufferError(f"{where}: expected format {FORMAT!r}, got {fmt!r:.80}")
    if int(version) > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{where}: written in format {fmt!r}, newer than {FORMAT!r} that this "
            "mmreplay reads; upgrade mmreplay to open it"
        )
    if int(version) < 1:
        raise CorruptBufferError(f"{where}: unknown format {fmt!r}")
    return int(version)


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
    too_large = chunk_too_large(compression, chunk_steps, num_envs, spec)
    if too_large:
        raise CorruptBufferError(f"{where} leaf {path!r}: {too_large}")
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


def chunk_too_large(compression: str | None, chunk_steps: int, num_envs: int, spec: ArraySpec) -> str | None:
    """Why a leaf's chunks are too large to decode in memory (None: they are not)."""
    if compression is None or compression.startswith("rows:"):
        return None  # mapped, or decoded row by row
    nbytes = chunk_steps * num_envs * spec.nbytes
    if nbytes <= MAX_CHUNK_BYTES:
        return None
    return (
        f"a compressed chunk of {chunk_steps} steps x {num_envs} envs x {spec.shape} {spec.dtype} takes "
        f"{nbytes} bytes decoded, more than the {MAX_CHUNK_BYTES} a chunk may; choose fewer chunk_steps"
    )


def json_object(raw: bytes, where: str) -> dict:
    """The metadata file's JSON object; every way it is not one is a one-line refusal."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptBufferError(f"{where}: metadata is not valid JSON ({exc})") from None
    except ValueError:  # Python converts numbers of at most 4,300 digits
        raise CorruptBufferError(f"{where}: metadata holds a number too long to be a buffer's") from None
    except RecursionError:
        raise CorruptBufferError(f"{where}: metadata is nested too deeply to be a buffer's") from None
    if not isinstance(obj, dict):
        raise CorruptBufferError(f"{where}: metadata must be a JSON object")
    return obj


def parse_metadata(raw: bytes, where: str) -> Metadata:
    obj = json_object(raw, where)
    version = _parse_format(obj.get("format"), where)
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
    frames = None
    if obj.get("frames") is not None:
        frames = layout_from_json(
            obj["frames"], spec, lambda leaf, slots: _parse_leaf(leaf, slots, 1, f"{where} frames"), where
        )
        expected = frames.physical(spec)
    else:
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
        # format 1 holds the state; format 2 reads it from the state file (read_metadata)
        state=parse_state(obj.get("state"), where) if version == 1 else State(),
        attrs_generation=0 if version == 1 else _int(obj, "attrs_generation", 0, MAX_STEP, where),
        format_version=version,
        previous_attrs=None if version == 1 else _previous_attrs(obj, where),
        sampler=sampler,
        frames=frames,
    )


def _previous_attrs(obj: dict, where: str) -> tuple[int, dict[str, Any]] | None:
    prev = obj.get("previous_attrs")
    if prev is None:
        return None
    if not isinstance(prev, dict) or not isinstance(prev.get("attrs"), dict):
        raise CorruptBufferError(f"{where}: 'previous_attrs' must be an object with 'generation' and 'attrs'")
    return _int(prev, "generation", 0, MAX_STEP, f"{where} previous_attrs"), prev["attrs"]


def pair_attrs(meta: Metadata, state: State) -> Metadata | None:
    """``meta`` with ``state`` and the attributes that state committed; None when the
    file holds neither (a ``set_attrs`` raced this read: read both again)."""
    if state.attrs_generation == meta.attrs_generation:
        return replace(meta, state=state, previous_attrs=None)
    prev = meta.previous_attrs
    if prev is not None and prev[0] == state.attrs_generation:
        return replace(meta, state=state, attrs=prev[1], attrs_generation=prev[0], previous_attrs=None)
    return None


def parse_state(obj: Any, where: str) -> State:
    if not isinstance(obj, dict):
        raise CorruptBufferError(f"{where}: 'state' must be an object")
    start = _int(obj, "start", 0, MAX_STEP, f"{where} state")
    end = _int(obj, "end", 0, MAX_STEP, f"{where} state")
    reserved = _int(obj, "reserved", 0, MAX_STEP, f"{where} state")
    if not start <= end <= reserved:
        raise CorruptBufferError(
            f"{where}: state must have start <= end <= reserved, got {start}, {end}, {reserved}"
        )
    commit_time = obj.get("commit_time")
    if commit_time is not None and not isinstance(commit_time, (int, float)):
        raise CorruptBufferError(f"{where}: state commit_time must be a number or null")
    commits = _int(obj, "commits", 0, MAX_STEP, f"{where} state")
    return State(start, end, reserved, commits, commit_time)


def read_metadata(where: str | os.PathLike | ByteSource) -> Metadata:
    """Read and validate a store's ``mmreplay.json`` and (format 2) its state file."""
    source = open_source(where)
    for _ in range(PAIR_TRIES):
        meta = read_static(source)
        if meta.format_version == 1:
            return meta
        state_file = StateFile(source, False)
        try:
            state = state_file.read()
        finally:
            state_file.close()
        paired = pair_attrs(meta, state)
        if paired is not None:
            return paired
    raise CorruptBufferError(
        f"{source.where(METADATA_FILE)}: its attributes (generation {meta.attrs_generation}"
        f"{'' if meta.previous_attrs is None else ', previous ' + str(meta.previous_attrs[0])}) "
        f"are not the ones the committed state names (generation {state.attrs_generation})"
    )


def _metadata_bytes(source: ByteSource) -> bytes:
    """The bytes of a store's ``mmreplay.json``; a missing one says there is no store."""
    try:
        return source.read(METADATA_FILE, MAX_METADATA_BYTES, "a buffer's metadata")
    except (FileNotFoundError, NotADirectoryError) as exc:
        if isinstance(exc, Error) and not isinstance(exc, ObjectNotFoundError):
            raise  # the object store's own answer (no bucket...)
        raise source.no_store() from None
    except IsADirectoryError:
        raise CorruptBufferError(f"{source.where(METADATA_FILE)}: is a folder, expected a JSON file") from None


def read_static(where: str | os.PathLike | ByteSource) -> Metadata:
    """Read and validate a store's ``mmreplay.json`` alone (format 2: without the state)."""
    source = open_source(where)
    return parse_metadata(_metadata_bytes(source), source.where(METADATA_FILE))


def read_state(where: str | os.PathLike | ByteSource) -> State:
    """Only the committed state (no spec validation)."""
    source = open_state(where, 1, False)
    try:
        return source.read()
    finally:
        source.close()


class JsonState:
    """The state of a format-1 buffer, read from its JSON file, for a reader opened on it.

    Once a writer migrated the buffer (the JSON names format 2 and holds no state) it
    reads the state file instead, from then on.
    """

    def __init__(self, where: str | os.PathLike | ByteSource):
        self.source = open_source(where)
        self.path = self.source.where(METADATA_FILE)
        self.file: StateFile | None = None

    def read(self) -> State:
        if self.file is not None:
            return self.file.read()
        obj = json_object(_metadata_bytes(self.source), self.path)
        if "state" not in obj and _parse_format(obj.get("format"), self.path) >= 2:
            self.file = StateFile(self.source, False)
            return self.file.read()
        return parse_state(obj.get("state"), self.path)

    def write(self, state: State, fsync: bool) -> None:
        raise CorruptBufferError(f"{self.path}: a format-1 buffer is migrated before it is written")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def open_state(where: str | os.PathLike | ByteSource, format_version: int, writable: bool) -> StateFile | JsonState:
    """Where the committed state of a buffer of this format is read (and written)."""
    if format_version == 1:
        return JsonState(where)
    return StateFile(where, writable)


def little_endian(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
