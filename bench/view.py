"""Time to draw an episode of 84x84 frames: ``mr.view(store, out)`` per frame kind and output.

One store per frame kind, one env, one episode of ``--frames`` steps: ``gray``
(uint8[84, 84] Atari-like screens), ``rgb`` (uint8[84, 84, 3], the same screens in a
palette of a few dozen colours, as game renders are), ``stack`` (uint8[4, 84, 84], the
Atari frame stack; its newest frame is drawn) and ``noise`` (uint8[84, 84, 3] of
uniform noise, the worst case: nothing for GIF's LZW or the palette to find). Each output
(GIF, PNG contact sheet, and MP4 when imageio-ffmpeg is installed) is written by
``store.view`` from the call to its return (reading, converting, encoding, writing),
after one warm-up call; the store's pages are in the page cache.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import mmreplay as mr

from .atari_like import frames as screens
from .timing import Timed, interleaved, table

SMOKE = {"frames": 20, "repeats": 1}
KINDS = {"gray": (84, 84), "rgb": (84, 84, 3), "stack": (4, 84, 84), "noise": (84, 84, 3)}
PALETTE = np.random.default_rng(7).integers(0, 256, (256, 3)).astype(np.uint8)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frames", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=5)


def frames(kind: str, n: int) -> np.ndarray:
    if kind == "noise":
        return np.random.default_rng(0).integers(0, 256, (n, *KINDS[kind]), dtype=np.uint8)
    gray = screens(n + 3)
    if kind == "gray":
        return gray[3:]
    if kind == "rgb":
        return PALETTE[gray[3:] // 6 * 6]  # a few dozen colours
    return np.stack([gray[3 - k : n + 3 - k] for k in (3, 2, 1, 0)], axis=1)


def build(folder: str, kind: str, n: int) -> str:
    path = os.path.join(folder, kind)
    spec = {
        "obs": mr.ArraySpec(KINDS[kind], "uint8"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
    }
    with mr.create(path, spec, capacity=n) as store:
        store.extend(
            {
                "obs": frames(kind, n)[:, None],
                "reward": np.ones((n, 1), "float32"),
                "terminated": np.arange(n)[:, None] == n - 1,
            }
        )
    return path


def run(args: argparse.Namespace) -> None:
    try:
        import imageio_ffmpeg  # noqa: F401

        suffixes = ["gif", "png", "mp4"]
    except ImportError:
        suffixes = ["gif", "png"]
    stores = {kind: mr.open(build(args.root, kind, args.frames)) for kind in KINDS}
    outs = {(k, x): os.path.join(args.root, f"{k}.{x}") for k in KINDS for x in suffixes}
    got = interleaved(
        {key: Timed(lambda k=key: mr.view(stores[k[0]], outs[k], force=True)) for key in outs}, args.repeats
    )
    for store in stores.values():
        store.close()
    table(
        f"store.view of a {args.frames:,}-frame episode, 84x84",
        ["frames", "output", "seconds", "MiB"],
        [[k, x, s.median, os.path.getsize(outs[(k, x)]) / 2**20] for (k, x), s in got.items()],
        [f"medians of {args.repeats}, in turns" + ("" if "mp4" in suffixes else "; imageio-ffmpeg not installed: no MP4")],
    )  # fmt: skip
