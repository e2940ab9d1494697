"""``mmreplay push STORE URL``: publish a store to object storage as a consistent snapshot."""

from __future__ import annotations

import time

import click

import mmreplay as mr

from . import buffer_folder
from .inspect import human_bytes


@click.command("push")
@click.argument("store", type=click.Path())
@click.argument("url")
def command(store: str, url: str) -> None:
    """Publish STORE to URL (s3://bucket/prefix), sending only the objects that changed
    since the last push.

    The state object is written last: readers of URL see the previous snapshot until
    this one is complete, and a push that is killed leaves it readable. STORE may be
    written meanwhile; its commit at the start is published. Read-only on STORE.
    """
    buffer_folder(store)
    t = time.perf_counter()
    report = mr.push(store, url)
    seconds = time.perf_counter() - t
    click.echo(
        f"{report.url}: {report.steps:,} steps "
        f"(total {report.state.end:,}); sent {report.uploaded} of {report.objects} objects, "
        f"{human_bytes(report.uploaded_bytes)} of {human_bytes(report.total_bytes)} in {seconds:.1f} s"
    )
