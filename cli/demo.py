"""``mmreplay demo [DIR]``: the main job, end to end, on a built-in environment."""

from __future__ import annotations

import click

from mmreplay.demo import DemoConfig, run

from .options import LocalPath, backend_option


@click.command("demo")
@click.argument("folder", metavar="[DIR]", required=False, type=LocalPath())
@click.option(
    "--steps",
    type=click.IntRange(min=100),
    default=DemoConfig.steps,
    show_default=True,
    help="Steps to collect.",
)
@backend_option()
@click.option("--seed", type=int, default=0, show_default=True)
def command(folder: str | None, steps: int, backend: str | None, seed: int) -> None:
    """Collect from 8 envs in a subprocess, SIGKILL it part-way, reopen and check every
    committed step, resume, sample, and export to Minari, printing each step.

    Writes into DIR (default: a new temporary folder). Needs no download and no gymnasium.
    """
    config = DemoConfig(
        steps=steps,
        capacity=max(steps + steps // 4, 100),
        kill_after=steps * 2 // 5,
        commit_every=max(10, min(500, steps // 40)),
        backend=backend,
        seed=seed,
    )
    run(folder, config, echo=click.echo)
