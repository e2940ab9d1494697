"""``mmreplay convert PATH OUT``: copy a store to another backend, chunking or compression."""

from __future__ import annotations

import time
from typing import Any

import click

import mmreplay as mr
from mmreplay.codecs import STORE_HELP, compression_by_leaf
from mmreplay.convert import convert
from mmreplay.files import disk_usage

from .inspect import human_bytes
from .options import LocalPath, backend_option, count_option, quiet_option
from .progress import LazyBar


@click.command("convert")
@click.argument("path", type=click.Path())
@click.argument("out", type=LocalPath())
@backend_option("[the source's]")
@click.option(
    "--compression",
    multiple=True,
    metavar="same|none|[LEAF=]CODEC[:LEVEL]",
    help="'same' (the default) keeps each leaf's codec, 'none' maps every leaf uncompressed; a codec "
    f"alone compresses the image leaves, LEAF=CODEC one leaf (repeat for several). {STORE_HELP}.",
)
@count_option("--chunk-steps", "Steps per chunk [about 4 MiB].")
@count_option("--capacity", "[the source's]; smaller keeps the newest.")
@quiet_option
def command(
    path: str,
    out: str,
    backend: str | None,
    compression: tuple[str, ...],
    chunk_steps: int | None,
    capacity: int | None,
    quiet: bool,
) -> None:
    """Copy the store at PATH into the new store OUT with another layout.

    The copy holds the retained committed steps in time order with the same spec,
    roles and envs. PATH is only read (a writer may keep running).
    """
    t = time.perf_counter()
    with mr.open(path, mode="r") as store:
        rows = min(len(store), capacity or len(store)) * store.num_envs  # a smaller ring keeps the newest
        spec = store.spec
    words = [c.lower() for c in compression]
    if len(words) > 1 and ({"same", "none", "off"} & set(words)):
        raise click.UsageError("--compression same or none stands alone")
    comp: Any = words[0] if words else "same"
    if comp in ("none", "off"):
        comp = None
    elif comp != "same":
        comp = compression_by_leaf(compression, spec)
    with LazyBar(rows, "converting", quiet) as bar:
        result = convert(
            path,
            out,
            backend=backend,
            compression=comp,
            chunk_steps=chunk_steps,
            capacity=capacity,
            progress=bar.update,
        )
    size = disk_usage(result.path)
    click.echo(
        f"converted {result.steps:,} steps into {result.path} ({result.backend}, capacity {result.capacity:,}, "
        f"{human_bytes(size)}, {time.perf_counter() - t:.1f} s)"
    )
