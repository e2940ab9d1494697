"""``mmreplay recover PATH``: bring a damaged buffer back to its last consistent commit.

Says which committed steps were lost and what was changed; damaged files are moved
aside, never deleted. Exit status 0 when the buffer is healthy afterwards, 1 otherwise.
"""

from __future__ import annotations

import click

from mmreplay.verify import recover

from . import buffer_folder


@click.command("recover")
@click.argument("path", type=click.Path())
def command(path: str) -> None:
    """Repair a damaged buffer, dropping the committed steps whose rows are gone."""
    buffer_folder(path)
    report = recover(path)
    click.echo(str(report))
    if not report.ok:
        raise SystemExit(1)
    click.echo(f"{path}: ok")
