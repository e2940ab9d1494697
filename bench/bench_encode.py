"""Per-step adds into compressed row-frame leaves, rows encoded natively vs in Python.

Atari-like frame stacks (:mod:`bench_frames_once`'s episodes, ``--envs`` envs), added one
step at a time to:

- ``numpy stacks``: obs + next_obs stacks assigned into a ring in RAM (the naive layout);
- ``frames once lz4`` / ``frames once zstd-1``: ``mr.Frames(frame_stack=4)`` with the
  frames in ``rows:lz4`` / ``rows:zstd:1`` leaves (``bench_frames_once``'s stores);
- ``stacks lz4`` / ``stacks zstd-1``: obs and next_obs kept as ``rows:lz4`` /
  ``rows:zstd:1`` stacks (two compressed leaves sharing the writer's encoding thread);

each row-frame store twice: encoded by the C extension's thread (``native``) and by a
Python thread, one codec call per row (``python``, made with ``MMREPLAY_NATIVE=0``), in
the same process. Every store is filled once (ring overwrite, as in training), then timed
in blocks of ``--calls`` adds and one commit (the commit waits for the rows handed to the
encoder, so each block pays for its own encoding), blocks interleaved (order reversed
every other round); medians of ``--blocks`` blocks. ``caller CPU`` is the CPU time of the
adding thread per step (``time.thread_time``): what the writer spends itself, without
waits. Ratios are computed from the figures shown.

Usage: ``python -m bench.bench_encode [--steps 1500] [--envs 8] [--calls 150] [--blocks 9]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_frames_once import episodes, spec  # noqa: E402

import mmreplay as mr  # noqa: E402
from mmreplay.backends import native_rows  # noqa: E402


def create(path: str, steps: int, envs: int, way: str, **kwargs) -> mr.Store:
    """A store whose row-frame leaves encode natively or in Python (chosen at creation)."""
    if way == "python":
        os.environ[native_rows.ENV] = "0"
    try:
        return mr.create(path, spec(False), steps, envs, backend="zarr", **kwargs)
    finally:
        os.environ.pop(native_rows.ENV, None)


def timed(variants: dict[str, tuple[Callable[[], None], Callable[[], None]]], calls: int, blocks: int):
    """Median (wall seconds, caller CPU seconds) per call of each variant: blocks of
    ``calls`` calls then its finishing call, interleaved."""
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants.items())
    for block in range(blocks):
        for name, (call, finish) in order if block % 2 == 0 else order[::-1]:
            t, c = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                call()
            finish()
            wall[name].append((time.perf_counter() - t) / calls)
            cpu[name].append((time.thread_time() - c) / calls)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--calls", type=int, default=150)
    parser.add_argument("--blocks", type=int, default=9)
    args = parser.parse_args()
    steps, envs = args.steps, args.envs
    data = episodes(steps, envs)
    with tempfile.TemporaryDirectory() as folder:
        stores: dict[str, mr.Store] = {}
        for way in ("native", "python"):
            for codec in ("lz4", "zstd:1"):
                name = f"frames once {codec.replace(':', '-')} ({way})"
                stores[name] = create(
                    f"{folder}/{name.replace(' ', '-')}", steps, envs, way,
                    compression={"obs": f"rows:{codec}"}, frames=mr.Frames(frame_stack=4), commit_every=10**9,
                )
            for codec in ("lz4", "zstd:1"):
                stores[f"stacks {codec.replace(':', '-')} ({way})"] = create(
                    f"{folder}/stacks-{codec.replace(':', '-')}-{way}", steps, envs, way,
                    compression={"obs": f"rows:{codec}", "next_obs": f"rows:{codec}"}, commit_every=10**9,
                )
        ram = {k: np.empty((steps, envs, *v.shape[1:]), v.dtype) for k, v in data[0].items()}
        cursor = [0]

        def numpy_add() -> None:
            step = data[cursor[0] % steps]
            for k, a in ram.items():
                a[cursor[0] % steps] = step[k]
            cursor[0] += 1

        def adder(store: mr.Store) -> Callable[[], None]:
            count = [0]

            def add() -> None:
                store.add(data[count[0] % steps])
                count[0] += 1

            return add

        adders = {name: adder(store) for name, store in stores.items()}
        for _ in range(steps):  # fill once: the timed adds overwrite the ring, as in training
            numpy_add()
            for add in adders.values():
                add()
        variants = {"numpy stacks": (numpy_add, lambda: None)}
        variants.update({name: (adders[name], store.commit) for name, store in stores.items()})
        got = timed(variants, args.calls, args.blocks)
        for store in stores.values():
            store.close()
    print(
        f"encode with: lz4 {native_rows.encoding_status('lz4')}, zstd {native_rows.encoding_status('zstd')}; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end"
    )
    print(f"Atari-like frame stacks, {steps} steps x {envs} envs; medians of {args.blocks} blocks of {args.calls} adds")
    print(f"\n{'add (one step)':28s} {'steps/s':>9s} {'x numpy':>8s} {'caller CPU us':>14s} {'native/python':>14s}")
    base = got["numpy stacks"][0]
    for name, (sec, cpu) in got.items():
        pair = ""
        if name.endswith("(native)"):
            other = got[name.replace("(native)", "(python)")][0]
            pair = f"{other / sec:.2f}"
        print(f"{name:28s} {1 / sec:9,.0f} {base / sec:8.2f} {cpu * 1e6:14,.0f} {pair:>14s}")


if __name__ == "__main__":
    main()
