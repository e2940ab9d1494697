"""Options several commands share, declared once."""

from __future__ import annotations

from typing import Any

import click

from mmreplay.codecs import STORE_HELP


class LocalPath(click.Path):
    """A path the command writes on this machine: an s3:// URL there would be a folder
    ``s3:`` in the working directory, so it is refused (export and push publish)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if str(value).startswith("s3://"):
            self.fail(f"{value}: expected a local path (export and push write to object storage)", param, ctx)
        return super().convert(value, param, ctx)


#: --quiet of the commands with a progress bar
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bar.")


def count_option(name: str, help: str | None = None) -> Any:
    """An option taking an int >= 1, None when not given (the default is decided later)."""
    return click.option(name, type=click.IntRange(min=1), default=None, help=help)


def backend_option(help: str = "[zarr]") -> Any:
    """--backend of the commands that make a store."""
    return click.option("--backend", type=click.Choice(["zarr", "hdf5"]), default=None, help=help)


#: --compression of the commands that make a store (create, import)
compression_option = click.option(
    "--compression",
    multiple=True,
    metavar="[LEAF=]CODEC[:LEVEL]",
    help=f"Codec of the image leaves, or of LEAF; repeat for several leaves. {STORE_HELP}.",
)
