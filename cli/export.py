"""``mmreplay export PATH OUT --format F``: write the buffer as an offline RL dataset."""

from __future__ import annotations

import shlex
import time

import click

from mmreplay.formats import FORMATS, compressions, export, format_of
from mmreplay.formats import get as get_format

from . import open_source
from .inspect import human_bytes
from .options import quiet_option
from .progress import LazyBar


def speed(nbytes: int, seconds: float) -> str:
    """``in 2.2 s, 6.1 MiB/s``; milliseconds under a tenth of a second, and no rate for a
    run too short to time."""
    ms = seconds * 1000
    if ms < 100:
        took = f"in {ms:.1f} ms" if ms < 10 else f"in {ms:.0f} ms"
    else:
        took = f"in {seconds:.1f} s" if seconds < 10 else f"in {seconds:.0f} s"
    return took if ms < 10 else f"{took}, {human_bytes(nbytes / seconds)}/s"


def compression_help() -> str:
    """What --compression takes, format by format (formats that take the same share a line)."""
    by_codecs: dict[str, list[str]] = {}
    for name, text in compressions().items():
        by_codecs.setdefault(text, []).append(name)
    return "Per format: " + "; ".join(f"{', '.join(names)}: {text}" for text, names in by_codecs.items()) + "."


@click.command("export")
@click.argument("path", type=click.Path())
@click.argument("out", type=click.Path())
@click.option(
    "--format",
    "-f",
    "fmt",
    default=None,
    metavar="FORMAT",
    help="One of: " + ", ".join(FORMATS) + ". Default: the one OUT's name ends with (.npz, .parquet, "
    ".csv, .csv.gz, .pt, .zarr), else minari; a .h5 or .hdf5 OUT needs it (d4rl, d3rlpy and hdf5 all "
    "write one).",
)
@click.option("--compression", default=None, metavar="CODEC[:LEVEL]", help=compression_help())
@click.option(
    "--complete-only", is_flag=True, help="Leave out episodes still open at the end of each env's stream."
)
@click.option("--force", is_flag=True, help="Replace OUT if it is an earlier export of this format.")
@click.option("--dataset-id", default=None, help="Minari: the dataset id, [namespace/]name-v<N>.")
@click.option("--fps", type=int, default=None, help="LeRobot: frames per second [30].")
@click.option("--task", default=None, help="LeRobot: the task of every episode [the store's folder name].")
@click.option("--codec", default=None, help="LeRobot: the video encoder [libsvtav1, AV1].")
@click.option("--crf", type=int, default=None, help="LeRobot: video quality, lower is better [30].")
@click.option("--preset", default=None, help="LeRobot: the encoder's speed preset [libsvtav1: 12].")
@click.option("--lossless", is_flag=True, default=None, help="LeRobot: bit-exact video (H.264 in RGB).")
@quiet_option
def command(
    path: str,
    out: str,
    fmt: str | None,
    compression: str | None,
    complete_only: bool,
    force: bool,
    dataset_id: str | None,
    quiet: bool,
    **lerobot: object,
) -> None:
    """Export the buffer at PATH to OUT in an offline RL format.

    Episode formats (minari, d4rl, d3rlpy, parquet, lerobot) write episode after episode; an
    episode still open at the end of an env's stream is written as truncated unless
    --complete-only. Step-major formats (npz, csv, pt, zarr, hdf5) write every retained
    step as [steps, num_envs, ...] arrays keyed by leaf path. For minari, OUT is the
    datasets root (MINARI_DATASETS_PATH). The store is read in bounded blocks, so a
    buffer larger than RAM exports in bounded memory. Read-only on PATH.

    PATH may be a group's folder: every shard's steps are written as one dataset, shard
    after shard, episodes kept within their shard.
    """
    options = {}
    fmt = fmt or format_of(out)
    if dataset_id is not None:
        if fmt.lower() != "minari":
            raise click.UsageError("--dataset-id applies to --format minari only")
        options["dataset_id"] = dataset_id
    given = {k: v for k, v in lerobot.items() if v is not None}
    if given and fmt.lower() != "lerobot":
        raise click.UsageError(f"--{', --'.join(given)} apply to --format lerobot only")
    options.update(given)
    get_format(fmt)  # an unknown format fails before the store is opened
    t = time.perf_counter()
    with open_source(path) as store:
        rows = len(store) * store.num_envs
        with LazyBar(rows, f"exporting to {fmt}", quiet) as bar:
            result = export(
                store,
                out,
                format=fmt,
                compression=compression,
                complete_only=complete_only,
                force=force,
                progress=bar.update,
                **options,
            )
    seconds = time.perf_counter() - t
    what = (
        f"{result.episodes:,} episodes, {result.steps:,} steps"
        if result.episodes
        else f"{result.steps:,} rows"
    )
    click.echo(f"wrote {what} to {result.path} ({human_bytes(result.nbytes)} {speed(result.nbytes, seconds)})")
    if result.format == "minari":
        click.echo(
            f"load with: MINARI_DATASETS_PATH={shlex.quote(result.info['root'])} "
            f"python -c \"import minari; print(minari.load_dataset('{result.info['dataset_id']}'))\""
        )
