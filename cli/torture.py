"""``mmreplay torture``: end writers at random moments and check nothing committed is lost.

Runs :func:`mmreplay.torture.run`: each trial creates a buffer with a random layout, ends
several writers (SIGKILL, Ctrl-C or SIGTERM at random times, at commits, at compressed
chunk writes, at the ring's wrap; a full disk; a thread still writing as the program
ends), checks after each that every committed step is there and bit-exact and that
nothing past the committed cursor is visible, then finishes the buffer and verifies it.
Prints ``trials N, kills K, failures F``; exits with status 1 if any trial failed.
"""

from __future__ import annotations

import contextlib

import click

from mmreplay.torture import ENDINGS, LAYOUTS, make_root, run

LAYOUT_NAMES = {str(layout): layout for layout in LAYOUTS}


@click.command("torture")
@click.option(
    "--trials", default=100, show_default=True, type=click.IntRange(min=1), help="Buffers to torture."
)
@click.option(
    "--kills", default=3, show_default=True, type=click.IntRange(min=0), help="Writers ended early per buffer."
)
@click.option(
    "--ending",
    "endings",
    multiple=True,
    type=click.Choice(ENDINGS),
    help="How writers end (repeatable; default: kill). enospc needs root (it mounts a tmpfs).",
)
@click.option("--table", is_flag=True, help="Also print the writer runs per layout and ending as a table.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the layouts and kill moments.")
@click.option(
    "--layout",
    "layouts",
    multiple=True,
    type=click.Choice(sorted(LAYOUT_NAMES)),
    help="Only these layouts (repeatable); default: all, in turn.",
)
@click.option(
    "--minutes", type=click.FloatRange(min=0), default=None, help="Start no trial after this many minutes."
)
@click.option(
    "--dir",
    "root",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder for the buffers (default: a temporary folder, removed after).",
)
@click.option("--keep-failed", is_flag=True, help="Keep the buffers of failed trials for inspection.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the summary line.")
def command(
    trials: int,
    kills: int,
    seed: int,
    layouts: tuple[str, ...],
    minutes: float | None,
    root: str | None,
    keep_failed: bool,
    quiet: bool,
    endings: tuple[str, ...],
    table: bool,
) -> None:
    """Crash-torture writers and check that no committed step is ever lost or wrong."""
    chosen = [LAYOUT_NAMES[name] for name in layouts] or list(LAYOUTS)
    seconds = None if minutes is None else minutes * 60
    if root is not None:  # an error first, before the progress bar prints its label
        make_root(root)
    bar = None if quiet else click.progressbar(length=trials, label="torture")
    with bar if bar is not None else contextlib.nullcontext():
        summary = run(
            trials,
            root=root,
            seed=seed,
            layouts=chosen,
            kills_per_trial=kills,
            keep_failed=keep_failed,
            seconds=seconds,
            on_trial=None if bar is None else lambda i, s: bar.update(1),
            endings=endings or ("kill",),
        )
    for message in summary.messages:
        click.echo(f"FAILED {message}", err=True)
    if not quiet:
        click.echo(summary.details())
    if table:
        click.echo(summary.table())
    click.echo(summary.line())
    if summary.failures:
        raise SystemExit(1)
