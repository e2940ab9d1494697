"""``mmreplay plot PATH -o FILE.png``: episode returns over collection order, length histogram."""

from __future__ import annotations

import os
from typing import Any

import click
import numpy as np

import mmreplay as mr
from mmreplay.errors import BadInputError
from mmreplay.files import AtomicOutput
from mmreplay.roles import subtree

from .options import LocalPath


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("mmreplay plot needs matplotlib: pip install 'mmreplay[plot]'") from exc
    return plt


def check_image_type(plt: Any, output: str) -> None:
    """Refuse an image type matplotlib cannot write before any work is done."""
    kinds = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    ext = os.path.splitext(output)[1].lstrip(".").lower()
    if ext not in kinds:
        what = f"a .{ext} image" if ext else "an image to a name without an extension"
        raise BadInputError(
            f"{output}: matplotlib cannot write {what}; end the name with one of: "
            + ", ".join("." + k for k in sorted(kinds))
        )


@click.command("plot")
@click.argument("path", type=click.Path())
@click.option(
    "-o", "--output", required=True, type=LocalPath(), help="Image file to write (.png, .svg, .pdf)."
)
@click.option("--force", is_flag=True, help="Overwrite the output file.")
def command(path: str, output: str, force: bool) -> None:
    """Plot the return of each complete episode in the order episodes ended, and a
    histogram of episode lengths."""
    if os.path.lexists(output) and not force:
        raise FileExistsError(f"{output}: already exists; pass --force to overwrite it")
    plt = _pyplot()
    check_image_type(plt, output)
    with mr.open(path, mode="r") as store:
        reward_path = store.roles.get("reward")
        ends, returns, lengths = [], [], []
        for ep in store.episodes(complete_only=True):
            ends.append(ep.last_step)
            lengths.append(ep.length)
            if reward_path is not None:
                returns.append(float(np.sum(np.asarray(subtree(ep.data, reward_path), np.float64))))
        name = os.path.basename(os.path.normpath(store.path))
    order = np.argsort(np.asarray(ends), kind="stable")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if returns:
        r = np.asarray(returns)[order]
        ax1.plot(np.arange(len(r)), r, ".", ms=3, alpha=0.5, label="episode")
        w = max(1, len(r) // 50)
        if len(r) >= w > 1:
            ax1.plot(
                np.arange(w - 1, len(r)), np.convolve(r, np.ones(w) / w, "valid"), "-", label=f"mean of {w}"
            )
        ax1.legend()
    else:
        ax1.text(0.5, 0.5, "no reward leaf" if reward_path is None else "no complete episodes", ha="center")
    ax1.set(title=f"{name}: episode return", xlabel="episode (in the order they ended)", ylabel="return")
    if lengths:
        ax2.hist(lengths, bins=min(50, max(1, len(set(lengths)))))
    ax2.set(title="episode length", xlabel="steps", ylabel="episodes")
    fig.tight_layout()
    # under a scratch name, its folders made, as an export is written
    with AtomicOutput(output, "file", "plot") as scratch:
        fig.savefig(scratch.tmp, dpi=100, format=os.path.splitext(output)[1][1:].lower())
        scratch.commit()
    plt.close(fig)
    click.echo(f"wrote {output}: {len(lengths):,} complete episodes")
