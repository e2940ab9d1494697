"""Pixel layouts side by side: bytes, adds while the ring fills and once it is full, contiguous batches.

Atari-like frame stacks (bench/atari_like.py: walls, bricks, score digits, moving
sprites, a scrolling band; episodes of ``--episode`` steps), obs and next_obs uint8[84,
84, 4] (HWC, newest last) and terminated, ``--envs`` envs, ``--steps`` steps, stored in
each layout of ``--layouts``:

- ``numpy-stacks``: the stacks in RAM, the baseline of every ratio;
- ``store-stacks``: an uncompressed (memory-mapped) store; ``rows:lz4``, ``rows:zstd:1``,
  ``rows:zstd:1:dict``: the stacks as compressed row frames; ``zstd-chunks``: zstd-3
  chunks (a whole chunk decoded per row a batch touches);
- ``frames-once`` (HWC), ``frames-once-chw`` (a ``[4, 84, 84]`` spec, as SB3's
  ``VecTransposeImage`` gives), ``frames-once+lz4``, ``frames-once+zstd:1``:
  ``mr.Frames(frame_stack=4)``, each frame stored once (compressed in row frames);
- ``torchrl``: TorchRL's ``CompressedListStorage`` in RAM, its codec probed and named as
  it is (zlib level 3 before Python 3.14, zstd from 3.14).

Phases, each its own table: the adds while every ring fills from empty (where numpy
pays page faults too), and the adds on full rings (the steady state a collector feeding a
learner runs at), each block of ``--calls`` adds ending with ``commit()`` so that it pays
for its own encoding, with the CPU time per step of the adding thread and of the others
(encoders); ``sample(256)`` and ``sample(32, num_steps=64)``, every batch made
contiguous (what a conv net needs) before the clock stops and dropped, alike for every
system, with the rows/s of the batch as returned beside it; and with ``--cold N``,
``sample(256)`` of N batches per store read from the disk (before each, the store is
closed, its files dropped from the page cache and the store reopened, untimed).
``--python`` adds each row-frame layout encoded and decoded in Python
(``MMREPLAY_NATIVE=0``) beside the C extension. Medians of interleaved blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
from collections.abc import Iterator
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay.backends import native_rows

from .atari_like import rollout
from .cold_rows import drop_cache, files_under
from .data import contiguous, du, pixel_spec
from .timing import Timed, fill, interleaved, progress, ratio, table

SMOKE = {
    "steps": 40,
    "envs": 2,
    "calls": 10,
    "repeats": 1,
    "batches": 1,
    "cold": 1,
    "python": True,
    "seq": [4, 16],
}
BATCH = 256
FRAMES = {"frames": mr.Frames(frame_stack=4)}
#: the first bytes of a compressed buffer -> its codec (TorchRL's is named as it is)
MAGIC = {b"\x28\xb5\x2f\xfd": "zstd", b"\x78": "zlib"}


def _rows(codec: str) -> dict[str, Any]:
    return {"compression": {"obs": codec, "next_obs": codec}}


#: layout -> (CHW spec, create options); numpy and torchrl are not stores
LAYOUTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "numpy-stacks": (False, {}),
    "store-stacks": (False, {}),
    "rows:lz4": (False, _rows("rows:lz4")),
    "rows:zstd:1": (False, _rows("rows:zstd:1")),
    "rows:zstd:1:dict": (False, _rows("rows:zstd:1:dict")),
    "zstd-chunks": (False, _rows("zstd")),
    "frames-once": (False, FRAMES),
    "frames-once-chw": (True, FRAMES),
    "frames-once+lz4": (False, FRAMES | {"compression": {"obs": "rows:lz4"}}),
    "frames-once+zstd:1": (False, FRAMES | {"compression": {"obs": "rows:zstd:1"}}),
    "torchrl": (False, {}),
}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--episode", type=int, default=400, help="steps per episode")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument(
        "--python", action="store_true", help="also each row-frame layout in Python (MMREPLAY_NATIVE=0)"
    )
    p.add_argument("--calls", type=int, default=50, help="adds per timed block")
    p.add_argument("--batches", type=int, default=10, help="batches per timed block")
    p.add_argument("--repeats", type=int, default=9, help="timed blocks per system (steady adds, samples)")
    p.add_argument(
        "--cold", type=int, default=0, metavar="N", help="also N batches per store read from the disk"
    )


class System:
    """One layout: its per-step add, its batches, its bytes."""

    def __init__(self, name: str, steps: list[dict[str, np.ndarray]], capacity: int, envs: int):
        self.name, self.capacity, self.envs = name, capacity, envs
        self.next_step = itertools.cycle(steps).__next__
        self.rng = np.random.default_rng(0)

    def add(self) -> None:
        raise NotImplementedError

    def sample(self, n: int, num_steps: int | None = None) -> Any:
        raise NotImplementedError

    def settle(self) -> None:
        pass

    def bytes(self) -> tuple[int | None, int]:
        """Bytes of the layout uncompressed, bytes it takes on disk (or in RAM)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class NumpyStacks(System):
    def __init__(self, name: str, steps: list[dict[str, np.ndarray]], capacity: int, envs: int):
        super().__init__(name, steps, capacity, envs)
        self.ring = {k: np.empty((capacity, *v.shape), v.dtype) for k, v in steps[0].items()}
        self.rows = {k: a.reshape(capacity * envs, *a.shape[2:]) for k, a in self.ring.items()}
        self.slot = itertools.cycle(range(capacity)).__next__

    def add(self) -> None:
        step, slot = self.next_step(), self.slot()
        for k, a in self.ring.items():
            a[slot] = step[k]

    def sample(self, n: int, num_steps: int | None = None) -> Any:
        ids = self.rng.integers(0, self.capacity * self.envs, n)
        if num_steps is not None:
            ids = ids[:, None] + np.arange(num_steps) * self.envs
        return {k: a.take(ids, 0, mode="wrap") for k, a in self.rows.items()}

    def bytes(self) -> tuple[int | None, int]:
        raw = sum(a.nbytes for a in self.ring.values())
        return raw, raw


class Store(System):
    def __init__(
        self, name: str, steps: list[dict[str, np.ndarray]], capacity: int, envs: int, path: str, python: bool
    ):
        super().__init__(name, steps, capacity, envs)
        chw, options = LAYOUTS[name.removesuffix(" (python)")]
        self.path, self.python = path, python
        with native_env(python):
            self.store = mr.create(path, pixel_spec(chw, small_leaves=False), capacity, envs, **options)

    def add(self) -> None:
        self.store.add(self.next_step())

    def sample(self, n: int, num_steps: int | None = None) -> Any:
        return self.store.sample(n, num_steps=num_steps, rng=self.rng)

    def settle(self) -> None:
        self.store.commit()

    def bytes(self) -> tuple[int | None, int]:
        meta = self.store.metadata
        raw = sum(meta.capacity * meta.num_envs * leaf.spec.nbytes for leaf in meta.leaves)
        if meta.frames is not None:
            raw += sum(meta.frames.final_slots * leaf.spec.nbytes for leaf in meta.frames.side)
        return raw, du(self.path)

    def reopen(self) -> None:
        """Close, drop the page cache of every file, open again (the cold batches' setup)."""
        self.store.close()
        drop_cache(files_under(self.path))
        with native_env(self.python):
            self.store = mr.open(self.path, "a")

    def close(self) -> None:
        self.store.close()


class TorchRL(System):
    """``ReplayBuffer(storage=CompressedListStorage)`` in RAM, fed a TensorDict a step."""

    def __init__(self, name: str, steps: list[dict[str, np.ndarray]], capacity: int, envs: int):
        import torch
        from tensordict import TensorDict
        from torchrl.data import CompressedListStorage, ReplayBuffer

        super().__init__(name, [], capacity, envs)
        torch.manual_seed(0)
        tds = [TensorDict({k: torch.from_numpy(v) for k, v in s.items()}, batch_size=[envs]) for s in steps]
        self.next_step = itertools.cycle(tds).__next__
        self.storage = CompressedListStorage(max_size=capacity * envs)
        self.rb = ReplayBuffer(storage=self.storage)
        probe = bytes(self.storage.compression_fn(torch.zeros(64, dtype=torch.uint8)).numpy())
        codec = next(
            (c for magic, c in MAGIC.items() if probe.startswith(magic)), f"unknown ({probe[:4].hex()})"
        )
        self.name = f"TorchRL CompressedListStorage ({codec} level {self.storage.compression_level}, RAM)"

    def add(self) -> None:
        self.rb.extend(self.next_step())

    def sample(self, n: int, num_steps: int | None = None) -> Any:
        if num_steps is not None:
            raise NotImplementedError
        return self.rb.sample(n)

    def bytes(self) -> tuple[int | None, int]:
        return None, sum(
            t.numel() for item in self.storage._storage for t in item.values() if hasattr(t, "numel")
        )


@contextlib.contextmanager
def native_env(python: bool) -> Iterator[None]:
    """``MMREPLAY_NATIVE=0`` while a store is made or opened (its leaves choose then)."""
    if python:
        os.environ[native_rows.ENV] = "0"
    try:
        yield
    finally:
        if python:
            os.environ.pop(native_rows.ENV, None)


def systems(args: argparse.Namespace, steps_hwc: list, steps_chw: list, notes: list[str]) -> list[System]:
    out: list[System] = []
    for name in args.layouts:
        ways = (
            [False, True]
            if args.python and ("rows:" in name or name.endswith(("lz4", "zstd:1")))
            else [False]
        )
        for python in ways:
            label = name + (" (python)" if python else "")
            source = steps_chw if LAYOUTS[name][0] else steps_hwc
            try:
                if name == "numpy-stacks":
                    out.append(NumpyStacks(label, source, args.steps, args.envs))
                elif name == "torchrl":
                    out.append(TorchRL(label, source, args.steps, args.envs))
                else:
                    path = os.path.join(args.root, label.replace(" ", "-").replace(":", "-"))
                    out.append(Store(label, source, args.steps, args.envs, path, python))
            except ImportError as exc:  # an extra that is not installed
                notes.append(f"{label} skipped: {exc}")
    return out


def run(args: argparse.Namespace) -> None:
    data = rollout(args.steps, args.envs, args.episode)
    steps_hwc = [{k: v[t] for k, v in data.items()} for t in range(args.steps)]
    steps_chw = []
    if "frames-once-chw" in args.layouts:  # made beforehand: the conversion is not the store's to pay
        chw = {k: np.ascontiguousarray(np.moveaxis(v, -1, 2)) if v.ndim == 5 else v for k, v in data.items()}
        steps_chw = [{k: v[t] for k, v in chw.items()} for t in range(args.steps)]
    notes = [
        f"row frames decode with lz4 {native_rows.status('lz4')}, zstd {native_rows.status('zstd')}; "
        f"encode with lz4 {native_rows.encoding_status('lz4')}, zstd {native_rows.encoding_status('zstd')}"
    ]
    chosen = systems(args, steps_hwc, steps_chw, notes)
    what = f"{args.steps:,} steps x {args.envs} envs, obs + next_obs uint8[84, 84, 4] and terminated"

    progress("fill")
    adds = {s.name: Timed(s.add, args.calls, after=s.settle) for s in chosen}
    filled = fill(adds, args.steps, args.calls)
    progress("steady adds")
    steady = interleaved(adds, args.repeats)
    for phase, got in (("while the rings fill from empty", filled), ("on full rings (steady state)", steady)):
        base = got["numpy-stacks"].rate if "numpy-stacks" in got else None
        body = [
            [
                name,
                s.rate,
                ratio(s.rate, base),
                statistics.median(s.cpu) * 1e6,
                statistics.median(s.other_cpu) * 1e6,
            ]
            for name, s in got.items()
        ]
        table(
            f"add one step {phase}, {what}",
            ["system", "steps/s", "× numpy", "CPU µs/step: adding thread", "other threads"],
            body,
            notes
            + [
                f"medians of {'the fill' if got is filled else args.repeats} blocks of {args.calls} adds, each ending with commit()"
            ],
        )
    sizes = {s.name: s.bytes() for s in chosen}
    naive = sizes.get("numpy-stacks", (None,))[0]
    table(
        f"bytes, {what}",
        [
            "system",
            "raw bytes of the layout",
            "× numpy-stacks",
            "bytes stored (disk, or RAM)",
            "× numpy-stacks",
        ],
        [[n, raw, ratio(raw, naive), stored, ratio(stored, naive)] for n, (raw, stored) in sizes.items()],
    )

    progress("samples")
    variants: dict[str, Timed] = {}
    for s in chosen:
        variants[f"{s.name}|contiguous"] = Timed(lambda s=s: contiguous(s.sample(BATCH)), args.batches, BATCH)
        variants[f"{s.name}|as returned"] = Timed(lambda s=s: s.sample(BATCH), args.batches, BATCH)
        if not isinstance(s, TorchRL):
            variants[f"{s.name}|seq"] = Timed(
                lambda s=s: contiguous(s.sample(*args.seq)),
                max(1, args.batches // 5),
                args.seq[0] * args.seq[1],
            )
    got = interleaved(variants, args.repeats)
    rate = {k: v.rate for k, v in got.items()}
    base, base_seq = rate.get("numpy-stacks|contiguous"), rate.get("numpy-stacks|seq")
    body = []
    for s in chosen:
        c, a, q = (rate.get(f"{s.name}|{w}") for w in ("contiguous", "as returned", "seq"))
        body.append([s.name, c, ratio(c, base), a, q, ratio(q, base_seq)])
    table(
        f"sample({BATCH}) and sample({args.seq[0]}, num_steps={args.seq[1]}), page-cached, {what}",
        [
            "system",
            f"sample({BATCH}) contiguous rows/s",
            "× numpy",
            "as returned rows/s",
            f"sample({args.seq[0]}, {args.seq[1]}) contiguous rows/s",
            "× numpy",
        ],
        body,
        [
            f"medians of {args.repeats} interleaved blocks of {args.batches} batches; every batch dropped at once",
            f"native decoding uses up to {native_rows.idle_cores()} thread(s) at this load (one per idle core)",
        ],
    )
    if args.cold:
        stores = [s for s in chosen if isinstance(s, Store)]
        cold = interleaved(
            {
                s.name: Timed(lambda s=s: contiguous(s.sample(BATCH)), 1, BATCH, before=s.reopen)
                for s in stores
            },
            args.cold,
            warmup=0,
        )
        mapped = cold["store-stacks"].rate if "store-stacks" in cold else None
        table(
            f"sample({BATCH}) read from the disk (page cache dropped before each batch), {what}",
            ["system", "rows/s", "× store-stacks"],
            [[n, s.rate, ratio(s.rate, mapped)] for n, s in cold.items()],
            [f"medians of {args.cold} batches per store, taking turns"],
        )
    for s in chosen:
        s.close()
