"""``mmreplay recover PATH``: bring a damaged buffer back to its last consistent commit.

Says which committed steps were lost and what was changed; damaged files are moved
aside, never deleted. Exit status 0 when the buffer is healthy afterwards, 1 otherwise.
What killed runs left beside PATH (``.NAME.partial-PID``, ``.NAME.creating-PID``) goes too.
"""

from __future__ import annotations

import os

import click

from mmreplay.files import remove_dead_scratch
from mmreplay.verify import recover

from . import buffer_folder
from .options import LocalPath


@click.command("recover")
@click.argument("path", type=LocalPath())
def command(path: str) -> None:
    """Repair a damaged buffer, dropping the committed steps whose rows are gone."""
    cleared = remove_dead_scratch(path)  # what killed runs of create, export, convert, import left
    for line in cleared:
        click.echo(line)
    if cleared and not os.path.lexists(path):
        return
    buffer_folder(path)
    report = recover(path)
    click.echo(str(report))
    if not report.ok:
        raise SystemExit(1)
    click.echo(f"{path}: ok")
