"""The committed state of a buffer: ``mmreplay.state``, two checksummed slots written in place.

A commit must cost a few microseconds and a reader must see the committed state with one
``pread``, so the state does not live in the JSON metadata (rewritten and renamed per
commit, parsed per read) but in a file of two fixed-size slots, as LMDB keeps its two
meta pages:

- each slot holds one :class:`State` with its ``generation`` (counted up by every state
  write) and a CRC-32 of its bytes; generation ``g`` lives in slot ``g % 2``;
- a commit writes the slot of the *older* generation with one ``pwrite`` (followed by
  ``fdatasync`` under ``durability="power"``, after the data reached the disk), so the
  slot of the committed state is never touched while the next one is written;
- a reader reads both slots with one ``pread`` and takes the newest valid one. A slot
  torn by a crash (or caught half-written by a reader) fails its checksum and the other
  slot, the previous commit, is the committed state.

Each slot sits in its own 512-byte sector, so a torn sector write reaches one slot only.
The file is written whole only when a buffer is created, migrated or rebuilt (a
temporary file renamed over it); afterwards only ever in place, so a reader's open
descriptor always names the live file.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from dataclasses import dataclass, replace

from .errors import CorruptBufferError
from .files import atomic_write
from .io import ByteSource, is_url, open_source
from .io.local import open_inside

__all__ = ["STATE_FILE", "State", "StateFile", "decode_slot", "encode_slot", "fresh_bytes", "newest", "oldest_retained", "reserved_ahead", "salvage", "slot_ranges", "write_fresh"]

STATE_FILE = "mmreplay.state"
SLOT_BYTES = 512  # one sector per slot: a torn sector write damages one slot only
FILE_BYTES = 2 * SLOT_BYTES
MAX_STEP = 1 << 62
READ_TRIES = 8  # a reader racing two commits in one pread tries again

_MAGIC = b"MMRSTAT2"
# magic, generation, start, end, reserved, commits, commit time (NaN: none), attrs generation
_SLOT = struct.Struct("<8sQQQQQdQ")
_CRC = struct.Struct("<I")
# After the slot's CRC, in the same sector: the generation again, ``rewrites`` and their
# CRC-32. Versions without it write the slot alone and leave an older generation's bytes
# here, which read as unknown (None).
_REWRITES = struct.Struct("<QQ")


@dataclass(frozen=True)
class State:
    """The committed state: three global step ids and bookkeeping.

    - ``end``: steps up to here are committed;
    - ``start``: steps before it were cleared;
    - ``reserved``: the writer may overwrite the slots of steps before
      ``reserved - capacity`` without a further state write, so readers treat those as gone;
    - ``generation``: counts state writes (it picks the newest slot);
    - ``attrs_generation``: the generation at which the user attributes in the metadata
      that belong to this state were written (see :meth:`mmreplay.Store.set_attrs`);
    - ``rewrites``: counts the commits that rewrote committed rows (``set``, an episode
      end marked on resume), so a reader knows when a cached copy of any row may be stale
      (None: written by a version that did not count them).

    The retained committed steps are ``[max(start, reserved - capacity), end)``.
    """

    start: int = 0
    end: int = 0
    reserved: int = 0
    commits: int = 0
    commit_time: float | None = None
    generation: int = 0
    attrs_generation: int = 0
    rewrites: int | None = 0

    def first(self, capacity: int) -> int:
        """Global id of the oldest retained committed step."""
        return oldest_retained(max(self.start, self.reserved - capacity), self.end, capacity)

    def next(self, **changes: int | float | None) -> State:
        """This state with ``changes``, one generation later."""
        return State(**{**self.__dict__, **changes, "generation": self.generation + 1})


def oldest_retained(floor: int, end: int, capacity: int) -> int:
    """Global id of the oldest step a ring of ``capacity`` slots retains when its steps
    end at ``end`` and those before ``floor`` are gone (cleared, or their slots reserved
    for overwriting): the one rule behind every window of committed or written steps."""
    return min(end, max(floor, end - capacity))


def reserved_ahead(capacity: int, commit_every: int) -> int:
    """How many slots past the steps it wrote a writer may reserve (overwrite) before its
    next commit: ``commit_every``, at most an eighth of the ring, at least one."""
    return max(1, min(commit_every, capacity // 8))


def slot_ranges(a: int, b: int, capacity: int) -> list[tuple[int, int]]:
    """Ring slot ranges ``[x, y)`` holding global steps ``[a, b)`` (at most two)."""
    if b <= a:
        return []
    if b - a >= capacity:
        return [(0, capacity)]
    x, y = a % capacity, b % capacity
    if x < y:
        return [(x, y)]
    return [(x, capacity)] + ([(0, y)] if y else [])


def encode_slot(state: State) -> bytes:
    """The bytes of ``state``'s slot (without the sector's padding)."""
    t = math.nan if state.commit_time is None else float(state.commit_time)
    body = _SLOT.pack(
        _MAGIC,
        state.generation,
        state.start,
        state.end,
        state.reserved,
        state.commits,
        t,
        state.attrs_generation,
    )
    extra = _REWRITES.pack(state.generation, state.rewrites or 0)
    return body + _CRC.pack(zlib.crc32(body)) + extra + _CRC.pack(zlib.crc32(extra))


def _rewrites(raw: bytes, at: int, generation: int) -> int | None:
    """The ``rewrites`` written with the slot at ``at`` of generation ``generation``, or None."""
    at += _SLOT.size + _CRC.size
    if len(raw) < at + _REWRITES.size + _CRC.size:
        return None
    gen, rewrites = _REWRITES.unpack_from(raw, at)
    crc = _CRC.unpack_from(raw, at + _REWRITES.size)[0]
    if gen != generation or zlib.crc32(raw[at : at + _REWRITES.size]) != crc:
        return None
    return rewrites


def _fields(raw: bytes, index: int) -> tuple | str:
    """The unpacked fields of slot ``index`` of the file's bytes, or why it is not valid."""
    at = index * SLOT_BYTES
    if len(raw) < at + _SLOT.size + _CRC.size:
        return "cut short"
    body = raw[at : at + _SLOT.size]
    if zlib.crc32(body) != _CRC.unpack_from(raw, at + _SLOT.size)[0]:
        return "checksum mismatch" if body[:8] == _MAGIC else "not a state slot (bad magic or checksum)"
    fields = _SLOT.unpack(body)
    magic, gen, start, end, reserved, _, _, attrs_gen = fields
    if magic != _MAGIC:
        return "not a state slot (bad magic)"
    if gen % 2 != index:
        return f"generation {gen} in slot {index}"
    if not start <= end <= reserved < MAX_STEP or attrs_gen > gen:
        return f"impossible numbers (start {start}, end {end}, reserved {reserved})"
    return fields


def _state(fields: tuple, raw: bytes, index: int) -> State:
    _, gen, start, end, reserved, commits, t, attrs_gen = fields
    rewrites = _rewrites(raw, index * SLOT_BYTES, gen)
    return State(start, end, reserved, commits, None if math.isnan(t) else t, gen, attrs_gen, rewrites)


def decode_slot(raw: bytes, index: int) -> State | str:
    """Slot ``index`` of the file's bytes ``raw``: its state, or why it is not valid."""
    fields = _fields(raw, index)
    return fields if isinstance(fields, str) else _state(fields, raw, index)


def newest(raw: bytes) -> State | None:
    """The newest valid state of the file's bytes, or None when neither slot is valid."""
    a, b = _fields(raw, 0), _fields(raw, 1)
    if isinstance(a, str):
        return None if isinstance(b, str) else _state(b, raw, 1)
    if isinstance(b, str) or a[1] > b[1]:
        return _state(a, raw, 0)
    return _state(b, raw, 1)


def salvage(path: str) -> tuple[int, int]:
    """Best guess of the committed window ``(first, end)`` of a state file whose slots
    fail their checks, for a report only: the numbers of a slot that still has its magic
    and plausible values, else ``(0, 0)``. Nothing is ever committed from it."""
    try:
        fd = open_inside(os.path.dirname(path), os.path.basename(path))
    except OSError:  # (a link or a FIFO too: nothing is read from it)
        return 0, 0
    try:
        raw = os.pread(fd, FILE_BYTES, 0)
    finally:
        os.close(fd)
    best = (0, 0)
    for index in (0, 1):
        at = index * SLOT_BYTES
        if len(raw) < at + _SLOT.size:
            continue
        magic, _, start, end, reserved, *_ = _SLOT.unpack_from(raw, at)
        if magic == _MAGIC and start <= end <= reserved < MAX_STEP and end > best[1]:
            best = (start, end)
    return best


def fresh_bytes(state: State) -> bytes:
    """A whole state file holding ``state`` as its newest slot and the same numbers, one
    generation older, in the other (so both slots are valid from the start). The
    generation is raised past ``attrs_generation`` where needed, so both slots name it."""
    gen = max(state.generation, state.attrs_generation + 1)
    state = replace(state, generation=gen)
    older = replace(state, generation=gen - 1)
    slots = [b"", b""]
    for s in (state, older):
        slots[s.generation % 2] = encode_slot(s).ljust(SLOT_BYTES, b"\0")
    return b"".join(slots)


def write_fresh(folder: str, state: State, fsync: bool) -> None:
    """Replace the folder's state file with a fresh one holding ``state`` (atomically)."""
    atomic_write(os.path.join(folder, STATE_FILE), fresh_bytes(state), fsync)


class StateFile:
    """The state file of a store's byte source: :meth:`read` the newest valid state,
    :meth:`write` the next (a local folder opened for writing)."""

    def __init__(self, where: str | os.PathLike | ByteSource, writable: bool):
        source = open_source(where)
        self.path = source.where(STATE_FILE)
        try:
            self.handle = source.handle(STATE_FILE, writable)
        except FileNotFoundError:
            if source.local and not os.path.isdir(source.url):
                raise source.no_store() from None
            raise CorruptBufferError(f"{self.path}: the state file is missing") from None
        except IsADirectoryError:
            raise CorruptBufferError(f"{self.path}: is a folder, expected the state file") from None

    def read(self) -> State:
        """The newest valid slot's state (one ``pread``)."""
        for _ in range(READ_TRIES):
            try:
                raw = self.handle.read_at(0, FILE_BYTES)
            except FileNotFoundError:  # an object store's, found at its first read
                raise CorruptBufferError(f"{self.path}: the state file is missing") from None
            state = newest(raw)
            if state is not None:
                return state
        why = "; ".join(f"slot {i}: {decode_slot(raw, i)}" for i in (0, 1))
        fix = "push the store there again" if is_url(self.path) else "see `mmreplay recover`"
        raise CorruptBufferError(f"{self.path}: neither state slot is valid ({why}); {fix}")

    def write(self, state: State, fsync: bool) -> None:
        """Write ``state`` into its slot (``generation % 2``): the slot of the older state."""
        self.handle.write_at((state.generation % 2) * SLOT_BYTES, encode_slot(state), fsync)

    def close(self) -> None:
        self.handle.close()
