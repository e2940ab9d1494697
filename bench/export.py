"""Export throughput and peak memory, next to ``cp -r`` of the store and numpy's ``savez``.

A full pixel store of about ``--gb`` GB (Atari-like obs and next_obs uint8[84, 84, 4]
stacks, action, reward, terminated, truncated; 8 envs; episodes of 400 steps) is
written, and a vector store (obs and next_obs float32[17], action float32[6], reward,
done flags) for the formats of tables (``csv``). Then, in turns, ``--repeats`` times:

- ``cp -r`` of the store folder (the bytes the OS moves for a copy, no format);
- ``numpy.savez`` of the same arrays from RAM (a format written with no store to read);
- each format of ``--formats`` exported by a fresh process (``store.export``), timed
  there from the call to its return; the process reports its peak memory from
  ``/proc/self/status``: ``VmHWM`` (peak resident set, which also counts the page cache
  of the mapped store it reads) and the peak of ``RssAnon`` (its own memory, sampled
  every 5 ms), which a buffer larger than RAM must keep bounded.

Throughput is the store's data bytes (retained rows x row bytes) over wall seconds, the
same number for every format, ``cp`` and ``savez``; the store's pages stay in the page
cache and nothing is fsynced (neither does ``cp``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

import mmreplay as mr

from .data import NUM_ENVS, du, pixel_spec, steps, vector_spec
from .timing import Timed, interleaved, ratio, table

SMOKE = {"gb": 0.01, "repeats": 1, "formats": ["npz", "minari", "csv"]}
FORMATS = ["npz", "hdf5", "zarr", "pt", "d4rl", "d3rlpy", "minari", "parquet", "csv"]
TABLES = {"csv"}  # formats measured on the vector store


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gb", type=float, default=2.0, help="size of the pixel store (the work folder needs about 3x)"
    )
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=FORMATS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", nargs=3, metavar=("FORMAT", "STORE", "OUT"), help=argparse.SUPPRESS)


def build(path: str, spec: dict[str, Any], steps_total: int, block: int) -> int:
    """A full store of ``steps_total`` steps written in blocks; its data bytes."""
    with mr.create(path, spec, capacity=steps_total, num_envs=NUM_ENVS, commit_every=block) as store:
        for a in range(0, steps_total, block):
            store.extend(steps(spec, min(block, steps_total - a), seed=a))
    return steps_total * NUM_ENVS * sum(s.nbytes for s in spec.values())


def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {
            k: int(v.split()[0]) * 1024
            for k, _, v in (line.partition(":") for line in f)
            if k in ("VmHWM", "RssAnon")
        }


def child(fmt: str, path: str, out: str) -> None:
    """Export in this fresh process and print its figures as JSON (libraries are imported
    before the clock starts: their import is a constant, not throughput)."""
    import h5py  # noqa: F401
    import zarr  # noqa: F401

    if fmt == "pt":
        import torch  # noqa: F401
    if fmt == "parquet":
        import pyarrow.parquet  # noqa: F401
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _status()["RssAnon"])
            time.sleep(0.005)

    with mr.open(path) as store:
        before = _status()["RssAnon"]
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        got = interleaved({"export": lambda: mr.export(store, out, format=fmt)}, 1, warmup=0)["export"]
        stop.set()
        watcher.join()
    end = _status()
    print(
        json.dumps(
            {
                "seconds": got.median,
                "vm_hwm": end["VmHWM"],
                "peak_anon": max(peak[0], end["RssAnon"]),
                "anon_before": before,
            }
        )
    )


def run(args: argparse.Namespace) -> None:
    if args.child:
        return child(*args.child)
    pixels, vector = os.path.join(args.root, "pixels"), os.path.join(args.root, "vector")
    pix_spec, vec_spec = pixel_spec(), vector_spec(next_obs=True)
    row = sum(s.nbytes for s in pix_spec.values()) * NUM_ENVS
    nbytes = {"pixels": build(pixels, pix_spec, max(50, int(args.gb * 2**30 / row)), 400)}
    vec_row = sum(s.nbytes for s in vec_spec.values()) * NUM_ENVS
    if TABLES & set(args.formats):
        nbytes["vector"] = build(
            vector, vec_spec, max(100, int(min(args.gb, 0.25) * 2**30 / vec_row)), 50_000
        )
    paths = {"pixels": pixels, "vector": vector}
    copy, dump = os.path.join(args.root, "copy"), os.path.join(args.root, "numpy.npz")
    variants: dict[str, Timed] = {}
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for kind in nbytes:
        with mr.open(paths[kind]) as store:
            held = store.read_steps(np.arange(store.first_step, store.committed_steps))
            arrays[kind] = {p.replace("/", "__"): v for p, v in zip(store.leaf_paths, held)}
        variants[f"cp -r|{kind}"] = Timed(
            lambda k=kind: subprocess.run(["cp", "-r", paths[k], copy], check=True),
            before=lambda: shutil.rmtree(copy, ignore_errors=True),
        )
        variants[f"numpy savez|{kind}"] = Timed(lambda k=kind: np.savez(dump, **arrays[k]))
    reports: dict[str, list[dict[str, Any]]] = {fmt: [] for fmt in args.formats}
    sizes: dict[str, int] = {}

    def export(fmt: str) -> None:
        out = os.path.join(args.root, f"out-{fmt}")
        proc = subprocess.run(
            [sys.executable, "-m", "bench", "export", "--dir", args.root, "--child", fmt, paths["vector" if fmt in TABLES else "pixels"], out],
            capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"{fmt} export failed: {proc.stderr.strip()[-2000:]}")
        reports[fmt].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        sizes[fmt] = du(out)
        if os.path.isdir(out):
            shutil.rmtree(out)
        else:
            os.unlink(out)

    for fmt in args.formats:
        variants[fmt] = Timed(lambda f=fmt: export(f))
    got = interleaved(variants, args.repeats, warmup=0)
    body = []
    for kind in nbytes:
        cp, savez = (nbytes[kind] / 2**20 * got[f"{name}|{kind}"].rate for name in ("cp -r", "numpy savez"))
        body.append(
            [f"`cp -r` ({kind} store)", nbytes[kind] / 2**30, cp, "1×", ratio(cp, savez), "–", "–", "–"]
        )
        body.append(
            [
                f"numpy savez ({kind} arrays in RAM)",
                nbytes[kind] / 2**30,
                savez,
                ratio(savez, cp),
                "1×",
                "–",
                "–",
                "–",
            ]
        )
        for fmt in (f for f in args.formats if (f in TABLES) == (kind == "vector")):
            rs = reports[fmt]
            rate = nbytes[kind] / 2**20 / statistics.median(r["seconds"] for r in rs)
            mib = {k: statistics.median(r[k] for r in rs) / 2**20 for k in ("vm_hwm", "peak_anon")}
            grew = statistics.median(r["peak_anon"] - r["anon_before"] for r in rs) / 2**20
            body.append(
                [
                    fmt,
                    nbytes[kind] / 2**30,
                    rate,
                    ratio(rate, cp),
                    ratio(rate, savez),
                    sizes[fmt] / 2**20,
                    mib["vm_hwm"],
                    f"{mib['peak_anon']:,.0f} (+{grew:,.0f})",
                ]
            )
    table(
        "export: MiB of store data per second, and the exporting process's peak memory",
        ["export", "store data GiB", "MiB/s", "× cp -r", "× numpy savez", "output MiB", "peak RSS (VmHWM) MiB", "peak own memory (RssAnon) MiB, + during"],
        body,
        [f"medians of {args.repeats} runs in turns; the page cache warm; ratios to cp -r and savez of the same store's data in this run"],
    )  # fmt: skip
