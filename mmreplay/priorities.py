"""The priority file: one float32 priority per row, a ring beside the leaves, mapped.

``priorities.bin`` holds a 4096-byte header (magic, version, capacity, num_envs, alpha,
the running maximum priority) and then ``[capacity, num_envs]`` float32 priorities in C
order: the priority of step ``g``, env ``e`` is at ``[g % capacity, e]``. A row's
priority is meaningful only while its step is retained and committed (the store's
state says which); a slot's global step id is its generation.

Who writes what, and why it is safe against the ring (``priorities.lock``, an
``flock``, orders the two writers):

- The store's writer gives new steps the running maximum. It writes them under the lock,
  at the commit that commits them (before the state write) or before its own draws, and
  never per add. The store raises its reservation (the state write that lets it
  overwrite old slots) before it writes a step, so when the writer writes the priority
  of step ``g`` the state already excludes step ``g - capacity``.
- A learner (any process, readers included) updates priorities under the lock: it
  re-reads the committed state, drops every update for a step older than the oldest
  retained one (those slots may hold newer steps) and applies the rest. An update that
  slips in before the writer's priority write for the slot's new step is overwritten
  by it; one that comes after sees the raised reservation and is dropped. Either way a
  new step never keeps the priority of the step it replaced.

Writes to the mapping survive a kill -9 of the process once made; with
``durability="power"`` the writer's commit also ``msync``s the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
from typing import Any

import numpy as np

from .errors import CorruptBufferError, ReadOnlyError
from .io.local import open_inside

__all__ = ["PriorityFile", "PRIORITY_FILE", "PRIORITY_LOCK"]

PRIORITY_FILE = "priorities.bin"
PRIORITY_LOCK = "priorities.lock"
MAGIC = b"MMRPRIO\0"
VERSION = 1
HEADER_BYTES = 4096
# magic, version, reserved, capacity, num_envs, alpha; the maximum lives at MAX_OFFSET
_HEADER = struct.Struct("<8sII QQ d")
MAX_OFFSET = 64


class PriorityFile:
    """The mapped priorities of one buffer and the lock that orders their writers."""

    def __init__(self, folder: str, capacity: int, num_envs: int, writable: bool):
        self.folder = folder
        self.path = os.path.join(folder, PRIORITY_FILE)
        self.capacity, self.num_envs = capacity, num_envs
        self.writable = writable
        try:
            fd = open_inside(folder, PRIORITY_FILE, os.O_RDWR if writable else os.O_RDONLY)
        except PermissionError as exc:
            raise ReadOnlyError(
                f"{self.path}: cannot open the priorities for writing ({exc.strerror})"
            ) from exc
        try:
            size = os.fstat(fd).st_size
            want = HEADER_BYTES + capacity * num_envs * 4
            if size != want:
                raise CorruptBufferError(
                    f"{self.path}: expected {want} bytes for {capacity} x {num_envs} priorities, found {size}"
                )
            self.mm = mmap.mmap(fd, want, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        magic, version, _, cap, envs, alpha = _HEADER.unpack_from(self.mm, 0)
        if magic != MAGIC or version != VERSION or (cap, envs) != (capacity, num_envs):
            self.mm.close()
            raise CorruptBufferError(
                f"{self.path}: not a priority file for {capacity} x {num_envs} rows "
                f"(magic {magic!r}, version {version}, shape {cap} x {envs})"
            )
        self.alpha = alpha
        self.values = np.ndarray((capacity, num_envs), np.float32, self.mm, HEADER_BYTES)
        self._max = np.ndarray((1,), np.float64, self.mm, MAX_OFFSET)
        self._lock_fd: int | None = None

    @staticmethod
    def create(folder: str, capacity: int, num_envs: int, alpha: float, fill: float = 1.0) -> None:
        """Write a new priority file, every row at ``fill``; replaced atomically."""
        path = os.path.join(folder, PRIORITY_FILE)
        tmp = f"{PRIORITY_FILE}.creating-{os.getpid()}"
        header = bytearray(HEADER_BYTES)
        _HEADER.pack_into(header, 0, MAGIC, VERSION, 0, capacity, num_envs, alpha)
        struct.pack_into("<d", header, MAX_OFFSET, fill)
        row = np.full(num_envs, fill, np.float32).tobytes()
        with contextlib.suppress(FileNotFoundError):  # a dead writer's, or a link placed there: never written through
            os.unlink(os.path.join(folder, tmp))
        with os.fdopen(open_inside(folder, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            f.write(header)
            block = row * max(1, min(capacity, (1 << 20) // len(row)))
            left = capacity * len(row)
            while left:
                part = block[: min(left, len(block))]
                f.write(part)
                left -= len(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(os.path.join(folder, tmp), path)

    # --- the running maximum -----------------------------------------------------------

    @property
    def max_priority(self) -> float:
        return float(self._max[0])

    def raise_max(self, value: float) -> None:
        if value > self._max[0]:
            self._max[0] = value

    # --- the lock ------------------------------------------------------------------------

    def __enter__(self) -> PriorityFile:
        if self._lock_fd is None:
            self._lock_fd = open_inside(self.folder, PRIORITY_LOCK, os.O_RDWR | os.O_CREAT)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # --- durability ------------------------------------------------------------------

    def sync(self) -> None:
        """Push every written priority to the disk (``durability="power"``)."""
        self.mm.flush()

    def close(self) -> None:
        self.values = self._max = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a view still alive elsewhere; the mapping goes with it
            self.mm.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


# --- verify and recover -----------------------------------------------------------------


def _read_problems(folder: str, meta: Any) -> tuple[list[str], float]:
    """What is wrong with the priority file of a buffer whose sampler is prioritized
    (nothing for other samplers), and the running maximum its header holds (1.0 when it
    cannot be read or is not a valid priority)."""
    if not meta.sampler or meta.sampler.get("name") != "prioritized":
        return [], 1.0
    capacity, num_envs = meta.capacity, meta.num_envs
    path = os.path.join(folder, PRIORITY_FILE)
    if not os.path.exists(path):
        return [f"{path}: missing (the buffer's sampler is prioritized)"], 1.0
    try:
        file = PriorityFile(folder, capacity, num_envs, writable=False)
    except CorruptBufferError as exc:
        return [str(exc)], 1.0
    try:
        top = file.max_priority
        problems = []
        if not (np.isfinite(top) and top > 0):
            problems.append(f"{path}: the running maximum priority in the header is {top}, expected > 0")
            top = 1.0
        end = meta.state.end
        slots = np.arange(max(meta.state.first(capacity), end - capacity), end) % capacity
        values = file.values[slots]
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            slot, env = np.argwhere(bad)[0]
            problems.append(
                f"{path}: {int(bad.sum())} priorities of committed rows are NaN, infinite or negative "
                f"(the first at slot {int(slots[slot])}, env {int(env)}: {values[slot, env]})"
            )
        return problems, top
    finally:
        file.close()


def check_priority_file(folder: str, meta: Any) -> list[str]:
    """Problems of the priority file of a buffer whose sampler is prioritized (size,
    header, committed rows finite and >= 0); nothing for other samplers."""
    return _read_problems(folder, meta)[0]


def reset_priority_file(folder: str, meta: Any) -> str | None:
    """Rewrite a damaged priority file with every row at the running maximum (1.0 when
    the header's is lost); what was done, or None when the file was sound."""
    problems, top = _read_problems(folder, meta)
    if not problems:
        return None
    alpha = float(meta.sampler.get("alpha", 0.6))
    PriorityFile.create(folder, meta.capacity, meta.num_envs, alpha, fill=top)
    return f"{PRIORITY_FILE} was damaged ({problems[0]}): every priority reset to the maximum, {top:g}"
