"""``mmreplay pull URL DIR``: bring a store from object storage back to a local folder."""

from __future__ import annotations

import click

import mmreplay as mr

from .options import LocalPath


@click.command("pull")
@click.argument("url")
@click.argument("folder", type=LocalPath())
def command(url: str, folder: str) -> None:
    """Download the snapshot at URL (s3://bucket/prefix) into the new FOLDER, in the
    local layout: open it for writing, and push it back when done."""
    path = mr.pull(url, folder)
    with mr.open(path) as store:
        click.echo(f"{path}: {len(store):,} steps (total {store.total_steps:,}) from {url}")
