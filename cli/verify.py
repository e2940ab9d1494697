"""``mmreplay verify PATH``: check a buffer's files against its metadata.

Exit status 0 only for a healthy buffer; 1 when problems were found (each printed on
its own line); the usual error statuses when the path holds no buffer.
"""

from __future__ import annotations

import os

import click

from mmreplay.io.local import LocalFolder
from mmreplay.lock import holder_pid
from mmreplay.metadata import METADATA_FILE
from mmreplay.verify import checked, leftovers, verify

from . import buffer_folder, is_group_folder


@click.command("verify")
@click.argument("path", type=click.Path())
@click.option(
    "--quick", is_flag=True, help="Check structure and sizes only; do not decode compressed chunks."
)
def command(path: str, quick: bool) -> None:
    """Check that a buffer's data files match its metadata and decode.

    PATH may be an s3:// URL: its objects are checked in place. PATH may be a group's
    folder: each shard is checked, with a verdict per shard."""
    if path.startswith("s3://"):
        from mmreplay.objstore import verify_url

        report(path, verify_url(path, deep=not quick), f"`mmreplay push` the store again to {path}")
        return
    buffer_folder(path)
    if is_group_folder(path):
        verify_group(path, quick)
        return
    if not os.path.exists(os.path.join(path, METADATA_FILE)) and not leftovers(path):
        raise LocalFolder(path).no_store()
    pid = holder_pid(path)
    if pid is not None:
        who = f"process {pid}" if pid > 0 else "a live writer"
        click.echo(f"note: {path} is open for writing by {who}; checking its last commit", err=True)
    problems = verify(path, deep=not quick)
    for what in checked(path, deep=not quick):
        click.echo(f"checked: {what}")
    extra = leftovers(path)
    if extra:
        click.echo(
            f"note: {len(extra)} temporary file(s) left by a killed writer (harmless; `mmreplay recover` removes them)"
        )
    report(path, problems, f"`mmreplay recover {path}` repairs what it can")


def verify_group(path: str, quick: bool) -> None:
    """Every shard of a group checked as a store: a verdict per shard, then the group's;
    exit status 1 when any shard has problems."""
    from mmreplay.errors import SpecMismatchError
    from mmreplay.group import open_group, shard_folders

    shards = shard_folders(path)
    bad = 0
    for shard in shards:
        name = os.path.basename(shard)
        problems = verify(shard, deep=not quick)
        for p in problems:
            click.echo(f"problem: {name}: {p}")
        remedy = f"`mmreplay recover {shard}`" if os.path.isdir(shard) else "its folder is missing"
        click.echo(f"{shard}: " + (f"{len(problems)} problem(s); {remedy}" if problems else "ok"))
        bad += bool(problems)
    if bad:
        click.echo(f"{path}: {bad} of {len(shards)} shards have problems")
        raise SystemExit(1)
    try:  # healthy shards the group cannot open together: specs, env counts or samplers differ
        open_group(path).close()
    except SpecMismatchError as exc:
        click.echo(f"problem: {exc}")
        click.echo(f"{path}: its shards are not alike; open_group refuses it")
        raise SystemExit(1) from None
    click.echo(f"{path}: ok ({len(shards)} shards)")


def report(path: str, problems: list[str], remedy: str) -> None:
    """One line per problem and the verdict; exit status 1 when there are problems."""
    if problems:
        for p in problems:
            click.echo(f"problem: {p}")
        click.echo(f"{path}: {len(problems)} problem(s); {remedy}")
        raise SystemExit(1)
    click.echo(f"{path}: ok")
