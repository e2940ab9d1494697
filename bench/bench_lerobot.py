"""The LeRobot export on the pixel workload: MB/s, bytes against the store's, frame
quality, and decode frames/s at import.

One leaf ``obs`` of Atari-like frame stacks (uint8[84, 84, 4], :mod:`bench.atari_like`;
each stack repeats its episode's first frame, as the Atari wrappers do), ``--envs`` envs,
``--steps`` steps, episodes of ``--episode`` steps ending ``terminated``. The same data is
kept in two stores, uncompressed (raw) and ``rows:lz4``, and exported from the raw one
with each video setting: LeRobot's default (AV1 by libsvtav1, CRF 30, preset 12), the
CRFs of ``--crf`` and the presets of ``--preset``, and ``lossless`` (H.264 RGB at CRF 0).
For each: export MB/s (the store's raw bytes over wall seconds, as bench_export counts),
the export's bytes against the raw and ``rows:lz4`` stores, the PSNR of every decoded
frame against the store's newest frames, and frames/s at import
(``mmreplay.import_dataset``: PyAV decoding plus the new store's writes; each
frame stack is rebuilt from its newest frame). Medians over ``--repeats`` runs. A frame
stack goes into the dataset as its newest frame, so the export holds a quarter of the
stored pixels: the bytes column compares what each keeps.

    python -m bench.bench_lerobot                      # 2000 steps x 4 envs
    python -m bench.bench_lerobot --steps 200 --envs 2 --repeats 1   # a check that it runs
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import mmreplay as mr
from mmreplay.formats import import_dataset

from .atari_like import STACK, frames
from .bench_pixels import folder_bytes


def episode_stacks(single: np.ndarray, episode: int) -> np.ndarray:
    """Stacks [n, 84, 84, STACK] (HWC, newest last) that restart at every episode."""
    t = np.arange(len(single))
    index = t[:, None] - np.arange(STACK - 1, -1, -1)[None, :]
    index = np.maximum(index, (t - t % episode)[:, None])
    return np.ascontiguousarray(single[index].transpose(0, 2, 3, 1))


def build(root: str, steps: int, envs: int, episode: int) -> tuple[dict[str, str], np.ndarray]:
    """The raw and rows:lz4 stores of the same data; the newest frames [steps, envs, 84, 84]."""
    single = np.stack([frames(steps, seed=e, episode_length=episode) for e in range(envs)], 1)
    obs = np.stack([episode_stacks(single[:, e], episode) for e in range(envs)], 1)
    done = (np.arange(steps) % episode == episode - 1)[:, None].repeat(envs, 1)
    spec = {"obs": mr.ArraySpec(obs.shape[2:], "uint8"), "terminated": mr.ArraySpec((), "bool")}
    paths = {}
    for name, codec in (("raw", None), ("rows:lz4", "rows:lz4")):
        paths[name] = os.path.join(root, name.replace(":", "-"))
        compression = {"obs": codec} if codec else None
        with mr.create(paths[name], spec, capacity=steps, num_envs=envs, compression=compression) as s:
            for a in range(0, steps, 256):
                s.extend({"obs": obs[a : a + 256], "terminated": done[a : a + 256]})
    return paths, single


def psnr(out: str, store: mr.Store) -> float:
    """PSNR of every frame of the export's video against the store's newest frames."""
    import av

    want = np.concatenate([ep.data["obs"][..., -1] for ep in store.episodes()])
    files = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(os.path.join(out, "videos")) for f in fs if f.endswith(".mp4")
    )
    got = []
    for path in files:
        with av.open(path) as f:
            got += [x.to_ndarray(format="gray") for x in f.decode(f.streams.video[0])]
    mse = np.mean((np.stack(got).astype(np.float64) - want) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255**2 / mse))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--episode", type=int, default=400, help="steps per episode")
    p.add_argument("--crf", default="20", help="AV1 CRFs to measure beside LeRobot's 30, comma-separated")
    p.add_argument("--preset", default="8", help="SVT-AV1 presets to measure beside LeRobot's 12 (at CRF 30)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench_lerobot-")
    try:
        stores, _ = build(root, args.steps, args.envs, args.episode)
        sizes = {name: folder_bytes(path) for name, path in stores.items()}
        raw_bytes = args.steps * args.envs * (84 * 84 * STACK + 1)
        settings = {"AV1 CRF 30 (LeRobot's default)": {}}
        settings |= {f"AV1 CRF {c}": {"crf": int(c)} for c in args.crf.split(",") if c}
        settings |= {f"AV1 CRF 30, preset {k}": {"preset": int(k)} for k in args.preset.split(",") if k}
        settings["lossless (H.264 RGB, CRF 0)"] = {"lossless": True}
        rows = []
        with mr.open(stores["raw"], mode="r") as store:
            for label, options in settings.items():
                export_s, import_s = [], []
                for i in range(args.repeats):
                    out, back = os.path.join(root, f"out-{i}"), os.path.join(root, f"back-{i}")
                    t = time.perf_counter()
                    mr.export(store, out, format="lerobot", fps=15, **options)
                    export_s.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    import_dataset(out, back)
                    import_s.append(time.perf_counter() - t)
                    nbytes, quality = folder_bytes(out), psnr(out, store)
                    shutil.rmtree(out)
                    shutil.rmtree(back)
                frames_n = args.steps * args.envs
                rows.append((label, raw_bytes / statistics.median(export_s) / 1e6, nbytes, quality,
                             frames_n / statistics.median(import_s)))  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.steps} steps x {args.envs} envs of uint8[84, 84, {STACK}] Atari-like stacks, episodes of "
          f"{args.episode}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end")  # fmt: skip
    print(f"store: raw {sizes['raw']:,} bytes, rows:lz4 {sizes['rows:lz4']:,} bytes; medians of {args.repeats}")
    print("| LeRobot export | export MB/s | bytes | vs raw store | vs rows:lz4 store | PSNR dB | import frames/s |")
    print("|---|---|---|---|---|---|---|")
    for label, rate, nbytes, quality, fps in rows:
        print(f"| {label} | {rate:,.1f} | {nbytes:,} | {nbytes / sizes['raw']:.3f}× | "
              f"{nbytes / sizes['rows:lz4']:.3f}× | {quality:.1f} | {fps:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
