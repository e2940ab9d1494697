"""Regenerate the small reference stores in this folder, deterministically.

    python datasets/make_datasets.py            # rebuild every store here
    python datasets/make_datasets.py --out DIR  # build them elsewhere
    python datasets/make_datasets.py --only pointchase-wrapped

Each store holds PointChase episodes (the demo's built-in environment, ``mmreplay.demo``)
collected with a fixed seed, so their arrays are the same on every run and machine (the
metadata's timestamps are not). They are used by the README, the tests and the demo:

- ``pointchase-zarr``: vector observations, zarr, 8 envs, 1,500 of 2,000 steps filled;
- ``pointchase-pixels-hdf5``: 32x32x3 uint8 frames plus the state vector, HDF5, 4 envs;
- ``pointchase-pixels-zstd``: the same frames, zarr with zstd compression on every leaf;
- ``pointchase-wrapped``: vector, zarr, 4 envs, capacity 300 after 1,000 steps: the ring
  has wrapped, so its oldest episode was cut by the ring.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any

import mmreplay as mr
from mmreplay.demo import collect, spec

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Dataset:
    name: str
    pixels: bool
    backend: str
    num_envs: int
    capacity: int
    steps: int
    compression: Any = None
    seed: int = 0
    commit_every: int = 100
    description: str = ""


DATASETS = [
    Dataset("pointchase-zarr", False, "zarr", 8, 2_000, 1_500, seed=1, description="vector, zarr, partly filled"),
    Dataset("pointchase-pixels-hdf5", True, "hdf5", 4, 100, 100, seed=7, description="32x32x3 frames, HDF5"),
    Dataset(
        "pointchase-pixels-zstd", True, "zarr", 8, 400, 400, compression="zstd", seed=3, description="frames, zstd"
    ),
    Dataset("pointchase-wrapped", False, "zarr", 4, 300, 1_000, seed=4, description="vector, the ring has wrapped"),
]


def make(d: Dataset, folder: str, force: bool = False) -> str:
    """Build one reference store in ``folder``; returns its path."""
    path = os.path.join(folder, d.name)
    if os.path.lexists(path):
        if not force:
            raise FileExistsError(f"{path}: exists; pass --force to rebuild it")
        if not os.path.isfile(os.path.join(path, "mmreplay.json")):
            raise FileExistsError(f"{path}: exists and is not an mmreplay store; not replacing it")
        shutil.rmtree(path)
    with mr.create(
        path,
        spec(pixels=d.pixels),
        capacity=d.capacity,
        num_envs=d.num_envs,
        backend=d.backend,
        compression=d.compression,
        commit_every=d.commit_every,
    ) as store:
        collect(store, d.steps, seed=d.seed)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=HERE, help="folder to build into [this folder]")
    parser.add_argument("--only", action="append", choices=[d.name for d in DATASETS], help="build only these")
    parser.add_argument("--force", action="store_true", help="rebuild stores that exist (default when --out is here)")
    args = parser.parse_args(argv)
    force = args.force or os.path.abspath(args.out) == HERE
    os.makedirs(args.out, exist_ok=True)
    for d in DATASETS:
        if args.only and d.name not in args.only:
            continue
        try:
            path = make(d, args.out, force)
        except (FileExistsError, mr.Error) as exc:
            sys.stderr.write(f"Error: {exc}\n")
            return 2
        size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
        with mr.open(path) as store:
            sys.stdout.write(
                f"{path}: {d.description}; {len(store):,} steps x {store.num_envs} envs retained "
                f"of {store.committed_steps:,}, {size / 2**20:.2f} MiB\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
