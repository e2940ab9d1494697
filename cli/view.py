"""``mmreplay view PATH -o out.gif|out.mp4|out.png``: an episode's frames as pictures;
``--rerun out.rrd``: the steps as a Rerun recording."""

from __future__ import annotations

import os
import time

import click

import mmreplay as mr
from mmreplay.files import folders_for
from mmreplay.pictures import SHEET_MAX_FRAMES, ViewOptions, frames
from mmreplay.selection import select

from .inspect import human_bytes
from .options import LocalPath, quiet_option
from .progress import LazyBar

#: ranges shorter than this draw without a progress bar
PROGRESS_MIN_FRAMES = 500


@click.command("view")
@click.argument("path", type=click.Path())
@click.option(
    "-o", "--output", default=None, type=LocalPath(), help="out.gif, out.mp4 or out.png (contact sheet)."
)
@click.option(
    "--rerun",
    "rrd",
    default=None,
    type=LocalPath(),
    help="out.rrd: every leaf of every env (or --env, --episode, --steps) as a Rerun recording.",
)
@click.option(
    "--leaf",
    default=None,
    help="Image leaf path [the observation's frames, else the first leaf that looks like frames].",
)
@click.option("--env", type=click.IntRange(min=0), default=None, help="Which env's stream [0; --rerun: all].")
@click.option(
    "--episode",
    type=int,
    default=None,
    help="Episode index in the env's retained episodes; negative counts from the newest [newest complete].",
)
@click.option(
    "--steps",
    default=None,
    metavar="A:B",
    help="Global step ids A (inclusive) to B (exclusive), as inspect shows them; negative counts from the newest.",
)
@click.option(
    "--layout",
    default=None,
    help="Frame layout: HW, HWC, CHW, KHW, HWK, HW(KC), KHWC, KCHW [from the shape].",
)
@click.option(
    "--stack", is_flag=True, help="Lay a frame stack's k frames side by side (default: its newest frame)."
)
@click.option("--fps", type=click.FloatRange(min=0, max=100, min_open=True), default=20.0, show_default=True)
@click.option(
    "--scale", type=click.IntRange(min=1), default=None, help="Whole upscaling factor [84 px -> 2]."
)
@click.option("--columns", type=click.IntRange(min=1), default=None, help="Contact sheet columns [up to 8].")
@click.option(
    "--max-frames",
    type=click.IntRange(min=1),
    default=SHEET_MAX_FRAMES,
    show_default=True,
    help="Contact sheet frames at most (picked evenly).",
)
@click.option("--force", is_flag=True, help="Overwrite the output file.")
@quiet_option
def command(
    path: str,
    output: str | None,
    rrd: str | None,
    leaf: str | None,
    env: int | None,
    episode: int | None,
    steps: str | None,
    force: bool,
    quiet: bool,
    **options: object,
) -> None:
    """Draw one env's frames of an image leaf: an animated GIF, an MP4 (needs
    imageio-ffmpeg) or, for .png, a contact sheet with step numbers, the return and
    where the episode ended. With --rerun, a Rerun recording instead: frames as images,
    other leaves as scalars, on step and time timelines, episode ends marked (needs
    rerun-sdk). Read-only on PATH."""
    if (output is None) == (rrd is None):
        raise click.UsageError("give -o OUT (.gif, .png, .mp4) or --rerun OUT.rrd")
    if rrd is not None:
        fps = float(options["fps"])  # type: ignore[arg-type]
        return rerun_command(path, rrd, env, episode, steps, force, quiet, fps)
    suffix = os.path.splitext(output)[1].lower()
    if suffix not in (".gif", ".png", ".mp4"):
        raise click.UsageError(f"-o {output}: expected a .gif, .png (contact sheet) or .mp4 file name")
    if os.path.lexists(output) and not force:
        raise FileExistsError(f"{output}: already exists; pass --force to overwrite it")
    opts = ViewOptions(**options)  # type: ignore[arg-type]
    t = time.perf_counter()
    with mr.open(path, mode="r") as store:
        n = len(select(store, env, episode, steps).steps)
        hidden = quiet or n < PROGRESS_MIN_FRAMES
        # one unit per frame read and one per frame written
        with LazyBar(2 * n, f"drawing {n:,} frames", hidden) as bar:
            fv = frames(store, leaf, env, episode, steps, opts, bar.update)
            with folders_for(output):
                written = fv.save(output, force=force, progress=bar.update)
    seconds = time.perf_counter() - t
    h, w = fv.pictures.shape[1:3]
    click.echo(
        f"wrote {written}: {len(fv):,} frames of {h}x{w} (x{fv.scale}), steps {fv.steps[0]}-{fv.steps[-1]} "
        f"of env {env or 0}; {human_bytes(os.path.getsize(written))}, {seconds:.2f} s"
    )
    click.echo("  " + " · ".join(fv.summary()[1:]))


def rerun_command(
    path: str, out: str, env: int | None, episode: int | None, steps: str | None, force: bool, quiet: bool,
    fps: float,
) -> None:  # fmt: skip
    from mmreplay.rerun import log_rerun

    if os.path.lexists(out) and not force:
        raise FileExistsError(f"{out}: already exists; pass --force to overwrite it")
    t = time.perf_counter()
    with mr.open(path, mode="r") as store:
        envs = store.num_envs if env is None and episode is None and steps is None else 1
        with LazyBar(len(store) * envs, "logging to rerun", quiet) as bar:
            with folders_for(out):
                written = log_rerun(store, out, env, episode, steps, fps, force, bar.update)
    size, seconds = human_bytes(os.path.getsize(written)), time.perf_counter() - t
    click.echo(f"wrote {written}: {size}, {seconds:.2f} s; open it with: rerun {written}")
