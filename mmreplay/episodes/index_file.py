"""The episode index file, ``episodes.idx``: its format, read, written and appended.

The index is a list of end records ``(step, env, code)`` in step order. The file is
plain binary, never pickled:

- a 32-byte header: magic ``b"MMREPIX1"``, ``origin`` (int64 LE: records are complete
  for steps ``>= origin``), a random int64 generation (changes when the file is
  rewritten), 8 zero bytes;
- 16-byte records: step int64 LE, env int32 LE, code uint8 (1 terminated, 2 truncated,
  3 boundary), 3 zero bytes.

A writer appends the records of the steps each commit adds before the state that
commits them is written, so the file always covers every committed step. Records past
the committed end (a writer killed between the append and the state write) and a torn
last record are ignored by readers and cut off by the next writer. The file is
rewritten (atomically, temp file + rename) only to drop records the ring has
overwritten, and after ``set`` changes an end.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends.base import disk_full_as
from ..files import atomic_write

INDEX_FILE = "episodes.idx"
MAGIC = b"MMREPIX1"
HEADER_BYTES = 32
RECORD = np.dtype(
    {"names": ["step", "env", "code"], "formats": ["<i8", "<i4", "u1"], "offsets": [0, 8, 12], "itemsize": 16}
)
TERMINATED, TRUNCATED, BOUNDARY = 1, 2, 3
COMPACT_MIN_RECORDS = 1 << 16  # a writer compacts the file once it holds more records than this


@dataclass(frozen=True)
class IndexFile:
    """An index file as read: ``nbytes`` is the header and the whole records parsed (a
    torn last record is not)."""

    origin: int
    generation: bytes
    records: np.ndarray
    nbytes: int


def parse_index(raw: bytes) -> IndexFile | None:
    """The file's header and records; None when the header is not an index's."""
    if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
        return None
    origin = int(np.frombuffer(raw, "<i8", 1, 8)[0])
    count = (len(raw) - HEADER_BYTES) // RECORD.itemsize
    rec = np.frombuffer(raw, RECORD, count, HEADER_BYTES).copy()
    return IndexFile(origin, raw[16:24], rec, HEADER_BYTES + count * RECORD.itemsize)


def index_problems(origin: int, rec: np.ndarray, num_envs: int) -> list[str]:
    """What makes these records no index of a store of ``num_envs`` envs ([]: none)."""
    steps = rec["step"]
    bad = []
    if origin < 0:
        bad.append(f"origin {origin} is negative")
    if len(rec) and (np.any(steps[1:] < steps[:-1]) or steps[0] < origin - 1):
        bad.append("records are out of step order")
    if np.any((rec["env"] < 0) | (rec["env"] >= num_envs)):
        bad.append(f"records name envs outside [0, {num_envs})")
    if np.any((rec["code"] < TERMINATED) | (rec["code"] > BOUNDARY)):
        bad.append("records hold unknown end codes")
    return bad


def index_limit(capacity: int, num_envs: int) -> int:
    """The largest an episode index file can be: a writer compacts it once it holds twice
    the records of a full ring, and a commit appends at most a ring's worth."""
    return HEADER_BYTES + RECORD.itemsize * (COMPACT_MIN_RECORDS + 4 * capacity * num_envs)


def cat_records(parts: Iterable[np.ndarray]) -> np.ndarray:
    """Concatenate record arrays keeping the padded 16-byte layout (np.concatenate packs it)."""
    parts = list(parts)
    out = np.zeros(sum(len(p) for p in parts), RECORD)
    i = 0
    for p in parts:
        out[i : i + len(p)] = p
        i += len(p)
    return out


def same_records(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and all(np.array_equal(a[k], b[k]) for k in RECORD.names)


def write_index(path: str, origin: int, rec: np.ndarray, fsync: bool) -> bytes:
    """Replace the index file atomically; returns its new generation."""
    generation = secrets.token_bytes(8)
    header = MAGIC + np.int64(origin).astype("<i8").tobytes() + generation + bytes(8)
    atomic_write(path, header + cat_records([rec]).tobytes(), fsync)
    return generation


def append_records(fd: int, rec: np.ndarray, path: str) -> None:
    """Append every byte (a torn last record is cut by the next writer)."""
    view = memoryview(rec.tobytes())
    with disk_full_as(f"{path}: no space left to record episode ends; nothing was committed"):
        while view:
            view = view[os.write(fd, view) :]


def continue_index(folder: str, first_step: int, fresh: Any, fsync: bool = False) -> None:
    """Start the episode index of an empty store whose steps begin at ``first_step``.

    The index records a boundary at ``first_step - 1`` for each env in ``fresh`` (that
    step is not in the store), so those envs' first episodes are whole; the others'
    began before ``first_step`` and are ``"open"``, as in the store they were copied from.
    """
    envs = np.unique(np.asarray(list(fresh), np.int64))
    path = os.path.join(folder, INDEX_FILE)
    if first_step <= 0:
        write_index(path, 0, np.zeros(0, RECORD), fsync)
        return
    rec = np.zeros(len(envs), RECORD)
    rec["step"], rec["env"], rec["code"] = first_step - 1, envs, BOUNDARY
    write_index(path, first_step - 1, rec, fsync)
