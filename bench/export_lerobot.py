"""The LeRobot export of pixels: MB/s, bytes against the store's, frame quality, import frames/s.

One leaf ``obs`` of Atari-like frame stacks (uint8[84, 84, 4]; each episode's first stack
repeats its first frame) and ``terminated``, ``--envs`` envs, ``--steps`` steps, episodes
of ``--episode`` steps, kept in two stores, uncompressed (raw) and ``rows:lz4``, and
exported from the raw one with each video setting: LeRobot's default (AV1 by libsvtav1,
CRF 30, preset 12), the CRFs of ``--crf``, the presets of ``--preset`` and ``lossless``
(H.264 RGB at CRF 0). For each: export MB/s (the store's raw bytes over wall seconds),
the export's bytes against both stores, the PSNR of every decoded frame against the
store's newest frames, and frames/s at import (PyAV decoding plus the new store's
writes). A stack goes into the dataset as its newest frame, so the export holds a quarter
of the stored pixels: the bytes columns compare what each keeps.
"""

from __future__ import annotations

import argparse
import os
import shutil

import numpy as np

import mmreplay as mr

from .atari_like import STACK, rollout
from .data import du
from .timing import Timed, interleaved, ratio, table

SMOKE = {"steps": 40, "envs": 2, "episode": 20, "repeats": 1, "crf": [], "preset": []}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--episode", type=int, default=400, help="steps per episode")
    p.add_argument("--crf", type=int, nargs="*", default=[20], help="AV1 CRFs to measure beside LeRobot's 30")
    p.add_argument(
        "--preset", type=int, nargs="*", default=[8], help="SVT-AV1 presets beside LeRobot's 12 (at CRF 30)"
    )
    p.add_argument("--repeats", type=int, default=3)


def psnr(out: str, store: mr.Store) -> float:
    """PSNR of every frame of the export's videos against the store's newest frames."""
    import av

    want = np.concatenate([ep.data["obs"][..., -1] for ep in store.episodes()])
    files = sorted(
        os.path.join(d, f)
        for d, _, fs in os.walk(os.path.join(out, "videos"))
        for f in fs
        if f.endswith(".mp4")
    )
    got = []
    for path in files:
        with av.open(path) as f:
            got += [x.to_ndarray(format="gray") for x in f.decode(f.streams.video[0])]
    mse = np.mean((np.stack(got).astype(np.float64) - want) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255**2 / mse))


def run(args: argparse.Namespace) -> None:
    from mmreplay import import_dataset

    data = rollout(args.steps, args.envs, args.episode)
    spec = {"obs": mr.ArraySpec(data["obs"].shape[2:], "uint8"), "terminated": mr.ArraySpec((), "bool")}
    stores = {}
    for name, codec in (("raw", None), ("rows:lz4", "rows:lz4")):
        stores[name] = os.path.join(args.root, name.replace(":", "-"))
        with mr.create(
            stores[name], spec, capacity=args.steps, num_envs=args.envs, compression=codec and {"obs": codec}
        ) as s:
            s.extend({"obs": data["obs"], "terminated": data["terminated"]})
    sizes = {name: du(path) for name, path in stores.items()}
    raw_bytes = args.steps * args.envs * (84 * 84 * STACK + 1)
    settings = {"AV1 CRF 30 (LeRobot's default)": {}}
    settings |= {f"AV1 CRF {c}": {"crf": c} for c in args.crf}
    settings |= {f"AV1 CRF 30, preset {k}": {"preset": k} for k in args.preset}
    settings["lossless (H.264 RGB, CRF 0)"] = {"lossless": True}
    out, back = os.path.join(args.root, "out"), os.path.join(args.root, "back")
    body = []
    with mr.open(stores["raw"], mode="r") as store:
        for label, options in settings.items():

            def clear() -> None:
                for path in (out, back):
                    shutil.rmtree(path, ignore_errors=True)

            exported = interleaved(
                {
                    "x": Timed(
                        lambda o=options: mr.export(store, out, format="lerobot", fps=15, **o), before=clear
                    )
                },
                args.repeats,
                warmup=0,
            )["x"]
            nbytes, quality = du(out), psnr(out, store)
            imported = interleaved(
                {
                    "i": Timed(
                        lambda: import_dataset(out, back),
                        before=lambda: shutil.rmtree(back, ignore_errors=True),
                    )
                },
                args.repeats,
                warmup=0,
            )["i"]
            body.append(
                [
                    label,
                    raw_bytes / exported.median / 1e6,
                    nbytes,
                    ratio(nbytes, sizes["raw"]),
                    ratio(nbytes, sizes["rows:lz4"]),
                    quality,
                    args.steps * args.envs * imported.rate,
                ]
            )
            clear()
    table(
        f"LeRobot export of {args.steps:,} steps x {args.envs} envs of uint8[84, 84, {STACK}] Atari-like stacks, episodes of {args.episode}",
        ["LeRobot export", "export MB/s", "bytes", "× raw store", "× rows:lz4 store", "PSNR dB", "import frames/s"],
        body,
        [f"stores: raw {sizes['raw']:,} bytes, rows:lz4 {sizes['rows:lz4']:,} bytes; medians of {args.repeats}"],
    )  # fmt: skip
