"""``mmreplay import SRC PATH``: a new store from a Minari dataset, a D4RL file, an npz or an export."""

from __future__ import annotations

import time

import click

from mmreplay.codecs import compression_by_leaf
from mmreplay.files import disk_usage
from mmreplay.formats import FORMATS, import_dataset

from .inspect import human_bytes
from .options import LocalPath, backend_option, compression_option, count_option, quiet_option
from .progress import LazyBar


@click.command("import")
@click.argument("src", type=click.Path())
@click.argument("path", type=LocalPath())
@click.option("--format", "fmt", default="auto", show_default=True, help="auto, " + ", ".join(FORMATS) + ".")
@backend_option()
@compression_option
@count_option("--capacity", "Steps the store holds [the dataset's].")
@count_option("--num-envs", "Plain npz: arrays are [T, N, ...].")
@quiet_option
def command(
    src: str,
    path: str,
    fmt: str,
    backend: str | None,
    compression: tuple[str, ...],
    capacity: int | None,
    num_envs: int | None,
    quiet: bool,
) -> None:
    """Create the store PATH from the dataset SRC.

    SRC is a Minari dataset folder (HDF5 format) or a datasets root holding one, a
    D4RL-style HDF5 file, an npz of arrays, a LeRobot v3.0 folder, or any export of
    mmreplay (npz, hdf5 and zarr come back exactly, with their step ids and episode
    statuses).
    """
    t = time.perf_counter()
    with LazyBar(1, "importing", quiet) as bar:
        result = import_dataset(
            src,
            path,
            format=fmt,
            backend=backend,
            compression=(lambda spec: compression_by_leaf(compression, spec)) if compression else None,
            capacity=capacity,
            num_envs=num_envs,
            progress=bar.update,
        )
    size = disk_usage(result.path)
    episodes = f", {result.episodes:,} episodes" if result.episodes is not None else ""
    click.echo(
        f"imported {result.format} {src}: {result.steps:,} steps x {result.num_envs} envs{episodes} "
        f"into {result.path} ({result.backend}, {human_bytes(size)}, {time.perf_counter() - t:.1f} s)"
    )
