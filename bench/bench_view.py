"""Time to draw a 1,000-frame episode of 84x84 frames: ``store.view(out)``.

One store per frame kind, one env, one episode of ``--frames`` steps:

- ``gray``: uint8[84, 84], Atari-like (a dark field, a few moving blocks, a score bar);
- ``rgb``: uint8[84, 84, 3], the same scene in a few dozen colours, as game renders are;
- ``stack``: uint8[4, 84, 84], the Atari frame stack (its newest frame is drawn);
- ``noise``: uint8[84, 84, 3] of uniform noise, the worst case (16M colours, nothing for
  GIF's LZW or the palette to find).

Each output (GIF, PNG contact sheet, and MP4 when imageio-ffmpeg is installed) is written
by ``store.view`` in this process, timed from the call to its return (reading the frames,
converting, encoding, writing the file), after one warm-up call. The store's pages are in
the page cache. Medians over ``--repeats`` runs. The machine is shared (2 cores, other
jobs running), so figures are noisy: compare them within one run.

    python bench/bench_view.py                 # 1,000 frames, 5 repeats
    python bench/bench_view.py --frames 200 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

import mmreplay as mr

KINDS = {"gray": (84, 84), "rgb": (84, 84, 3), "stack": (4, 84, 84), "noise": (84, 84, 3)}
PALETTE = np.random.default_rng(7).integers(0, 256, (24, 3)).astype(np.uint8)


def scene(n: int, rng: np.random.Generator) -> np.ndarray:
    """Colour indices [n, 84, 84]: background, a score bar, three moving blocks."""
    x = np.zeros((n, 84, 84), np.uint8)
    x[:, :6] = 1 + (np.arange(n) // 50 % 5)[:, None, None]
    pos = np.cumsum(rng.integers(-2, 3, (n, 3, 2)), axis=0) % 76
    for i in range(n):
        for k, (r, c) in enumerate(pos[i]):
            x[i, 8 + r % 70 : 8 + r % 70 + 6, c : c + 6] = 10 + k
    return x


def frames(kind: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "noise":
        return rng.integers(0, 256, (n, 84, 84, 3), dtype=np.uint8)
    idx = scene(n + 3, rng)
    if kind == "gray":
        return (idx[3:] * 10).astype(np.uint8)
    if kind == "rgb":
        return PALETTE[idx[3:]]
    return np.stack([idx[3 - k : n + 3 - k] * 10 for k in (3, 2, 1, 0)], axis=1).astype(np.uint8)


def build(folder: str, kind: str, n: int) -> str:
    path = os.path.join(folder, kind)
    spec = {
        "obs": mr.ArraySpec(KINDS[kind], "uint8"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
    }
    term = np.zeros((n, 1), bool)
    term[-1] = True
    with mr.create(path, spec, capacity=n) as store:
        store.extend(
            {"obs": frames(kind, n)[:, None], "reward": np.ones((n, 1), "float32"), "terminated": term}
        )
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        import imageio_ffmpeg  # noqa: F401

        suffixes = ["gif", "png", "mp4"]
    except ImportError:
        suffixes = ["gif", "png"]
    with tempfile.TemporaryDirectory(prefix="bench-view-") as tmp:
        sys.stdout.write(f"store.view of a {args.frames:,}-frame episode, 84x84, median of {args.repeats}\n")
        sys.stdout.write(f"{'frames':8} {'output':6} {'seconds':>8} {'MiB':>8}\n")
        for kind in KINDS:
            with mr.open(build(tmp, kind, args.frames)) as store:
                for suffix in suffixes:
                    out = os.path.join(tmp, f"{kind}.{suffix}")
                    store.view(out, force=True)  # warm-up: imports, page cache
                    times = []
                    for _ in range(args.repeats):
                        t = time.perf_counter()
                        store.view(out, force=True)
                        times.append(time.perf_counter() - t)
                    size = os.path.getsize(out) / 2**20
                    sys.stdout.write(f"{kind:8} {suffix:6} {statistics.median(times):8.2f} {size:8.1f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
