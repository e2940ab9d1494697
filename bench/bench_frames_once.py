"""Each frame stored once vs frame stacks kept whole, on Atari-like screens.

Atari-like frames (:mod:`atari_like`, episodes of 400 steps, ``--envs`` envs) as frame
stacks of four, with ``obs`` and ``next_obs`` leaves, written to:

- ``numpy stacks``: obs + next_obs stacks in RAM (the naive layout), gathered with
  ``np.take`` (the fastest equivalent numpy gather);
- ``store stacks``: the same layout in an uncompressed (memory-mapped) store;
- ``frames once HWC``: ``mr.Frames(frame_stack=4)`` on the ``[84, 84, 4]`` spec (stacks
  returned as strided views of one gather);
- ``frames once CHW``: the same on a ``[4, 84, 84]`` spec (stacks first, as SB3's
  ``VecTransposeImage`` and the Atari CNNs take them);
- ``frames once lz4`` / ``frames once zstd-1``: ``mr.Frames(frame_stack=4)`` on the HWC
  spec with the frames in compressed row-frame leaves (``rows:lz4``, ``rows:zstd:1``;
  needs ``mmreplay[pixels]``, left out without it), rows encoded on a background thread
  (the CPU time of the other threads is printed beside the adding thread's).

Figures: raw bytes of the data (leaves and side ring) and bytes on disk (blocks allocated
under the store's folder after it is closed) vs the naive layout; ``sample(256)`` rows/s
(batches dropped after each call, alike for every system; ratios to ``numpy stacks``, a
``take`` of the same number of rows from the stacks in RAM, computed from the figures
shown); per-step add vs numpy's assignment of the stacked layout, each block of adds
ending once its rows are encoded (:func:`settle`). Medians over interleaved blocks.

Usage: ``python bench/bench_frames_once.py [--quick] [--steps 5000] [--envs 8] [--calls 200]
[--blocks 7]`` (more, shorter blocks share more of the machine's swings between systems).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import atari_like  # noqa: E402
from bench_compat import interleaved  # noqa: E402

import mmreplay as mr  # noqa: E402

BATCH = 256
EPISODE = 400


def episodes(steps: int, envs: int) -> list[dict[str, np.ndarray]]:
    """Steps of ``envs`` envs: HWC stacks (newest last), episodes of ``EPISODE`` steps, the
    final observation of each ended episode in ``next_obs``."""
    single = np.stack([atari_like.frames(steps + 1, seed=e, episode_length=EPISODE) for e in range(envs)], 1)
    out = []
    stack = np.repeat(single[0][..., None], 4, axis=-1)
    for t in range(steps):
        nxt = np.concatenate([stack[..., 1:], single[t + 1][..., None]], axis=-1)
        done = np.full(envs, (t + 1) % EPISODE == 0)
        out.append({"obs": stack, "next_obs": nxt, "terminated": done})
        stack = np.where(done[:, None, None, None], np.repeat(single[t + 1][..., None], 4, axis=-1), nxt)
    return out


def spec(chw: bool) -> dict:
    shape = (4, 84, 84) if chw else (84, 84, 4)
    return {
        "obs": mr.ArraySpec(shape, "uint8"),
        "next_obs": mr.ArraySpec(shape, "uint8"),
        "terminated": mr.ArraySpec((), "bool"),
    }


def chw(step: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.ascontiguousarray(np.moveaxis(v, -1, 1)) if v.ndim == 4 else v for k, v in step.items()}


def stored_bytes(store: mr.Store) -> int:
    meta = store.metadata
    total = sum(meta.capacity * meta.num_envs * leaf.spec.nbytes for leaf in meta.leaves)
    if meta.frames is not None:
        total += sum(meta.frames.final_slots * leaf.spec.nbytes for leaf in meta.frames.side)
    return total


def disk_bytes(folder: str) -> int:
    """Bytes of the blocks allocated under ``folder``."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            total += os.stat(os.path.join(root, name)).st_blocks * 512
    return total


def row_codecs() -> list[str]:
    """The row-frame codecs this machine can use (the ``pixels`` extra)."""
    try:
        import cramjam  # noqa: F401
        import zarr  # noqa: F401
        import zstandard  # noqa: F401
    except ImportError:
        return []
    return ["lz4", "zstd:1"]


def settle(store: mr.Store) -> None:
    """Wait until every row added is encoded and its segment sealed (the background work
    of row-frame leaves), so that a block of adds pays for its own encoding rather than
    leave it to run while the next system is timed."""
    for leaf in store._storage:
        if hasattr(leaf, "_check_encoder"):
            leaf._promote(wait=True)
            leaf._check_encoder(wait=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200, help="calls per timed block")
    parser.add_argument("--blocks", type=int, default=7, help="timed blocks per system, interleaved")
    args = parser.parse_args()
    steps, envs = (400, 2) if args.quick else (args.steps, args.envs)
    calls, blocks = (20, 3) if args.quick else (args.calls, args.blocks)
    data = episodes(steps, envs)
    data_chw = [chw(s) for s in data]
    with tempfile.TemporaryDirectory() as folder:
        stores = {
            "store stacks": mr.create(f"{folder}/stacks", spec(False), steps, envs),
            "frames once HWC": mr.create(
                f"{folder}/hwc", spec(False), steps, envs, frames=mr.Frames(frame_stack=4)
            ),
            "frames once CHW": mr.create(
                f"{folder}/chw", spec(True), steps, envs, frames=mr.Frames(frame_stack=4)
            ),
        }
        for codec in row_codecs():
            stores[f"frames once {codec.replace(':', '-')}"] = mr.create(
                f"{folder}/rows-{codec.replace(':', '-')}",
                spec(False),
                steps,
                envs,
                backend="zarr",
                compression={"obs": f"rows:{codec}"},
                frames=mr.Frames(frame_stack=4),
            )
        ram = {k: np.empty((steps, envs, *v.shape[1:]), v.dtype) for k, v in data[0].items()}
        cursor = [0]

        def numpy_add() -> None:
            step = data[cursor[0] % steps]
            i = cursor[0] % steps
            for k, a in ram.items():
                a[i] = step[k]
            cursor[0] += 1

        counters = {name: [0] for name in stores}
        cpu = {name: [0.0, 0.0] for name in stores}  # CPU seconds of timed adds: this thread, the others

        def store_add(name: str):
            store, source, count = stores[name], data_chw if "CHW" in name else data, counters[name]
            timed, started = [0], [0.0, 0.0]

            def add() -> None:
                if timed[0] % calls == 0:
                    started[:] = time.thread_time(), time.process_time()
                store.add(source[count[0] % steps])
                count[0] += 1
                timed[0] += 1
                if timed[0] % calls == 0:  # the last call of a block waits for its encoding
                    settle(store)
                    mine = time.thread_time() - started[0]
                    cpu[name][0] += mine
                    cpu[name][1] += time.process_time() - started[1] - mine

            return add

        # fill every system once, then time adds on top (ring overwrite, as in training)
        for t in range(steps):
            numpy_add()
            for name, store in stores.items():
                store.add((data_chw if "CHW" in name else data)[t])
                counters[name][0] += 1
        adds = interleaved({"numpy stacks": numpy_add, **{n: store_add(n) for n in stores}}, calls, blocks)
        for store in stores.values():
            store.commit()
        flat = {k: a.reshape(steps * envs, *a.shape[2:]) for k, a in ram.items()}
        rng = np.random.default_rng(0)

        def numpy_sample() -> None:
            rows = rng.integers(0, steps * envs, BATCH)
            for a in flat.values():
                np.take(a, rows, axis=0)

        samples = interleaved(
            {"numpy stacks": numpy_sample, **{n: (lambda s=s: s.sample(BATCH)) for n, s in stores.items()}},
            calls,
            blocks,
        )
        raw = {name: stored_bytes(store) for name, store in stores.items()}
        for store in stores.values():
            store.close()
        disk = {name: disk_bytes(store.path) for name, store in stores.items()}
        naive = steps * envs * 2 * 84 * 84 * 4
        print(f"Atari-like frame stacks, {steps} steps x {envs} envs, obs + next_obs [84, 84, 4] uint8")
        print(f"\n{'system':20s} {'raw bytes':>14s} {'of naive':>9s} {'on disk':>14s} {'of naive':>9s}")
        print(f"{'numpy stacks':20s} {naive:14,d} {'1/1.0':>9s} {'':>14s} {'':>9s}")
        for name in stores:
            print(
                f"{name:20s} {raw[name]:14,d} {'1/' + format(naive / raw[name], '.2f'):>9s} "
                f"{disk[name]:14,d} {'1/' + format(naive / disk[name], '.1f'):>9s}"
            )
        base = samples["numpy stacks"]
        print(f"\n{'sample(256)':20s} {'rows/s':>10s} {'x numpy':>8s}")
        for name, sec in samples.items():
            print(f"{name:20s} {BATCH / sec:10,.0f} {base / sec:8.2f}")
        base = adds["numpy stacks"]
        timed = calls * blocks
        print(f"\n{'add (one step)':20s} {'steps/s':>10s} {'x numpy':>8s} {'us/step':>8s} {'CPU us/step: adding':>20s} {'others':>7s}")
        for name, sec in adds.items():
            line = f"{name:20s} {1 / sec:10,.0f} {base / sec:8.2f} {sec * 1e6:8.1f}"
            if name in cpu:
                mine, others = cpu[name]
                line += f" {mine / timed * 1e6:20.1f} {others / timed * 1e6:7.1f}"
            print(line)


if __name__ == "__main__":
    main()
