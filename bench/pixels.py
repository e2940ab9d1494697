"""Pixel layouts side by side: bytes, adds while the ring fills and once it is full, batches in the model's layout.

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

Phases, each its own table, each printed with the machine's load:

- the adds while every ring fills from empty (where numpy pays page faults too), and the
  adds on full rings (the steady state a collector feeding a learner runs at), each block
  of ``--calls`` adds ending with ``commit()`` and a wait for the encoding left in the
  background, so that it pays for its own encoding, with the CPU time per step of the
  adding thread and of the others (encoders), and the adding thread's minor page faults
  per step (a mapped file's pages written back by the kernel fault again when next
  written);
- ``sample(256)`` and ``sample(32, num_steps=64)`` as a model takes them: every system's
  stacks made contiguous in the model's layout (``--model-layout``, NCHW as PyTorch's
  convolutions take, or NHWC) before the clock stops, and dropped; the rows/s of the
  batch as returned beside it;
- the collector and learner in one process: each step adds one step of every env and
  samples one batch of 256 in the model's layout;
- with ``--cold N``, ``sample(256)`` of N batches per store read from the disk (before
  each, the store is closed, its files dropped from the page cache and the store
  reopened, untimed);
- the targets the write and read paths are held to, each met or missed with its numbers.

``--python`` adds each row-frame layout encoded and decoded in Python
(``MMREPLAY_NATIVE=0``) beside the C extension. Medians of interleaved blocks. ``--quick``
runs fewer steps and blocks (a few minutes; figures to check a change, not to quote).
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
from mmreplay.backends import native_rows, row_frames

from .atari_like import rollout
from .cold_rows import drop_cache, files_under
from .data import contiguous, du, pixel_spec
from .timing import Sample, Timed, fill, interleaved, progress, ratio, table

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
#: ``--quick``: what it sets of the options left at their defaults
QUICK = {"steps": 1000, "calls": 25, "batches": 5, "repeats": 5}
BATCH = 256
#: the stacks' leaves
STACKS = ("obs", "next_obs")
#: what the pixel paths are held to, steady state, set before any was measured:
#: (what, table, system, baseline system, least ratio)
TARGETS = [
    ("add, uncompressed", "add", "store-stacks", "numpy-stacks", 0.9),
    ("add, rows:lz4", "add", "rows:lz4", "numpy-stacks", 0.5),
    ("add, rows:zstd:1", "add", "rows:zstd:1", "numpy-stacks", 0.3),
    ("add, frames once + lz4", "add", "frames-once+lz4", "numpy-stacks", 0.8),
    (f"contiguous sample({BATCH}), frames once (HWC)", "sample", "frames-once", "numpy-stacks", 0.8),
    (f"contiguous sample({BATCH}), frames once (CHW)", "sample", "frames-once-chw", "numpy-stacks", 0.8),
    (f"contiguous sample({BATCH}), rows:lz4", "sample", "rows:lz4", "store-stacks", 0.9),
    (f"contiguous sample({BATCH}), rows:zstd:1", "sample", "rows:zstd:1", "store-stacks", 0.5),
]
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
    p.add_argument(
        "--model-layout",
        choices=["NCHW", "NHWC"],
        default="NCHW",
        help="the layout every batch's stacks are made contiguous in (NCHW: PyTorch's convolutions)",
    )
    p.add_argument("--quick", action="store_true", help=f"fewer steps and blocks: {QUICK}")
    p.set_defaults(seq=[32, 64])


def in_layout(batch: Any, chw: bool, layout: str) -> dict[str, Any]:
    """``batch`` as a model takes it: the stacks (stored CHW or HWC) contiguous in
    ``layout``, every other leaf contiguous; numpy arrays or torch tensors."""
    out = {}
    for key in list(batch.keys()):
        x = batch[key]
        if key in STACKS and (layout == "NCHW") != chw:
            lead = x.ndim - 3
            h, w, c = (lead + 1, lead + 2, lead) if chw else (lead, lead + 1, lead + 2)
            axes = (*range(lead), c, h, w) if layout == "NCHW" else (*range(lead), h, w, c)
            x = x.transpose(axes) if isinstance(x, np.ndarray) else x.permute(axes)
        out[key] = contiguous(x)
    return out


class System:
    """One layout: its per-step add, its batches, its bytes."""

    #: the stacks are stored CHW; the layout batches are made contiguous in
    chw, layout = False, "NCHW"

    def __init__(self, name: str, steps: list[dict[str, np.ndarray]], capacity: int, envs: int):
        self.name, self.capacity, self.envs = name, capacity, envs
        self.next_step = itertools.cycle(steps).__next__
        self.rng = np.random.default_rng(0)

    def add(self) -> None:
        raise NotImplementedError

    def sample(self, n: int, num_steps: int | None = None) -> Any:
        raise NotImplementedError

    def model_batch(self, n: int, num_steps: int | None = None) -> dict[str, Any]:
        """A batch as the model takes it: contiguous, stacks in :attr:`layout`."""
        return in_layout(self.sample(n, num_steps), self.chw, self.layout)

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
        self.chw, options = LAYOUTS[name.removesuffix(" (python)")]
        chw = self.chw
        self.path, self.python = path, python
        with native_env(python):
            self.store = mr.create(path, pixel_spec(chw, small_leaves=False), capacity, envs, **options)

    def add(self) -> None:
        self.store.add(self.next_step())

    def sample(self, n: int, num_steps: int | None = None) -> Any:
        return self.store.sample(n, num_steps=num_steps, rng=self.rng)

    def model_batch(self, n: int, num_steps: int | None = None) -> dict[str, Any]:
        """The store writes each row in the model's layout as it gathers it."""
        return self.store.sample(n, num_steps=num_steps, rng=self.rng, layout=self.layout)

    def settle(self) -> None:
        """Commit, then wait for the encoding the adds left in the background (a commit
        does not): the block pays for its own work, not the next system's block."""
        self.store.commit()
        row_frames.wait_background(self.store.stored_leaves)

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
                    system: System = NumpyStacks(label, source, args.steps, args.envs)
                elif name == "torchrl":
                    system = TorchRL(label, source, args.steps, args.envs)
                else:
                    path = os.path.join(args.root, label.replace(" ", "-").replace(":", "-"))
                    system = Store(label, source, args.steps, args.envs, path, python)
            except ImportError as exc:  # an extra that is not installed
                notes.append(f"{label} skipped: {exc}")
                continue
            system.layout = args.model_layout
            out.append(system)
    return out


def _add_table(title: str, got: dict[str, Sample], notes: list[str]) -> None:
    base = got["numpy-stacks"].rate if "numpy-stacks" in got else None
    body = [
        [
            name,
            s.rate,
            ratio(s.rate, base),
            statistics.median(s.cpu) * 1e6,
            statistics.median(s.other_cpu) * 1e6,
            statistics.median(s.faults),
        ]
        for name, s in got.items()
    ]
    head = ["system", "steps/s", "× numpy", "CPU µs/step: adding thread", "other threads", "page faults/step"]
    table(title, head, body, notes)


def _targets(rates: dict[str, dict[str, float]]) -> None:
    """Each target met or missed, with the numbers it is judged on."""
    body = []
    for what, phase, name, baseline, least in TARGETS:
        got, base = rates[phase].get(name), rates[phase].get(baseline)
        shown_ratio = ratio(got, base)
        if shown_ratio == "–":
            verdict = "not measured"
        else:
            verdict = "met" if float(shown_ratio.rstrip("×").replace(",", "")) >= least else "missed"
        body.append([what, f"≥ {least:g}× {baseline}", got, base, shown_ratio, verdict])
    table(
        "targets of the pixel write and read paths (steady state)",
        ["target", "wanted", "rows/s or steps/s", "baseline, same run", "ratio", "verdict"],
        body,
        [
            "adds: steps/s on full rings; samples: rows/s of batches contiguous in the model's layout",
            "a target is judged on this machine's run: quote verdicts from a quiet machine only",
        ],
    )


def run(args: argparse.Namespace) -> None:
    if args.quick:  # the options left at their defaults
        for key, value in QUICK.items():
            if getattr(args, key) == options_defaults()[key]:
                setattr(args, key, value)
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
    layout = f"stacks contiguous in {args.model_layout}"

    progress("fill")
    adds = {s.name: Timed(s.add, args.calls, after=s.settle) for s in chosen}
    filled = fill(adds, args.steps, args.calls)
    progress("steady adds")
    steady = interleaved(adds, args.repeats)
    blocks = f"blocks of {args.calls} adds, each ending with commit() and a wait for the background encoding"
    _add_table(
        f"add one step while the rings fill from empty, {what}",
        filled,
        [*notes, f"medians of the fill's {blocks}"],
    )
    _add_table(
        f"add one step on full rings (steady state), {what}",
        steady,
        [*notes, f"medians of {args.repeats} {blocks}"],
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
        variants[f"{s.name}|contiguous"] = Timed(lambda s=s: s.model_batch(BATCH), args.batches, BATCH)
        variants[f"{s.name}|as returned"] = Timed(lambda s=s: s.sample(BATCH), args.batches, BATCH)
        if not isinstance(s, TorchRL):
            variants[f"{s.name}|seq"] = Timed(
                lambda s=s: s.model_batch(*args.seq),
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
    stores = [s for s in chosen if isinstance(s, Store)]
    table(
        f"sample({BATCH}) and sample({args.seq[0]}, num_steps={args.seq[1]}) as the model takes them "
        f"({layout}), page-cached, {what}",
        [
            "system",
            f"sample({BATCH}) {args.model_layout} rows/s",
            "× numpy",
            "as returned rows/s",
            f"sample({args.seq[0]}, {args.seq[1]}) {args.model_layout} rows/s",
            "× numpy",
        ],
        body,
        [
            f"medians of {args.repeats} interleaved blocks of {args.batches} batches; every batch made "
            f"contiguous in the model's layout ({args.model_layout}) before the clock stops, and dropped",
            *([f"row frames decode on {stores[0].store.decode_threads}"] if stores else []),
        ],
    )

    progress("collector and learner")
    loop = {
        s.name: Timed(lambda s=s: (s.add(), s.model_batch(BATCH)), args.calls, after=s.settle) for s in chosen
    }
    _add_table(
        f"collector and learner in one process: add a step of {args.envs} envs, then sample({BATCH}) "
        f"({layout}), on full rings, {what}",
        interleaved(loop, args.repeats),
        [f"medians of {args.repeats} blocks of {args.calls} steps, each ending as the blocks of adds do"],
    )
    _targets(
        {
            "add": {name: s.rate for name, s in steady.items()},
            "sample": {s.name: rate.get(f"{s.name}|contiguous") for s in chosen},
        }
    )
    if args.cold:
        cold = interleaved(
            {s.name: Timed(lambda s=s: s.model_batch(BATCH), 1, BATCH, before=s.reopen) for s in stores},
            args.cold,
            warmup=0,
        )
        mapped = cold["store-stacks"].rate if "store-stacks" in cold else None
        table(
            f"sample({BATCH}) read from the disk (page cache dropped before each batch), {layout}, {what}",
            ["system", "rows/s", "× store-stacks"],
            [[n, s.rate, ratio(s.rate, mapped)] for n, s in cold.items()],
            [f"medians of {args.cold} batches per store, taking turns"],
        )
    for s in chosen:
        s.close()


def options_defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    options(parser)
    return vars(parser.parse_args([]))
