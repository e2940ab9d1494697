"""sample(256) of a compressed leaf with more segments than the process keeps mapped.

A row-frame leaf maps each sealed segment's shard file when first read and keeps at most
``MAPPED_SHARDS`` mapped (a quarter of ``vm.max_map_count``); it reads the frames of the
other shards with ``pread``, from files it keeps open up to ``OPEN_SHARDS`` (a quarter of
``ulimit -n``), else opened for the batch. At the default segment size a leaf passes the
first budget above ~64 GiB raw, so the benchmark lowers the budgets instead: one leaf
``obs`` of Atari-like stacks (uint8[84, 84, 4], ``--envs`` envs, ``--steps`` steps, the
default segment of 4 MiB raw) sampled with every segment mapped, with a quarter mapped
and the rest kept open, and with a quarter mapped and none kept open. The settings take
turns in one process, each block after one untimed batch; the shard files stay in the
page cache.
"""

from __future__ import annotations

import argparse
import os

import mmreplay as mr
from mmreplay.backends import native_rows, row_reads

from .atari_like import rollout
from .timing import Timed, interleaved, ratio, table

SMOKE = {"steps": 200, "envs": 2, "repeats": 1, "batches": 2}
#: distinct steps of frames rendered per env; the steps after repeat them (each row is
#: its own compressed frame, so a repeated row compresses as the first did)
DISTINCT_STEPS = 600


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec", default="rows:lz4")
    p.add_argument("--steps", type=int, default=7_200)
    p.add_argument("--envs", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--batches", type=int, default=40)


def run(args: argparse.Namespace) -> None:
    obs = rollout(min(args.steps, DISTINCT_STEPS), args.envs)["obs"]
    path = os.path.join(args.root, "b")
    spec = {"obs": mr.ArraySpec(obs.shape[2:], "uint8")}
    with mr.create(
        path, spec, capacity=args.steps, num_envs=args.envs, compression=args.codec, commit_every=64
    ) as store:
        for step in range(args.steps):
            store.add({"obs": obs[step % len(obs)]})
    budgets = row_reads.MAPPED_SHARDS, row_reads.OPEN_SHARDS
    try:
        with mr.open(path) as store:
            segments = store.leaves[0].nseg
            quarter = max(1, segments // 4)
            settings = {
                "all mapped": (segments, segments),
                f"{quarter:,} mapped, the rest kept open": (quarter, segments),
                f"{quarter:,} mapped, none kept open": (quarter, 0),
            }

            def setting(mapped: int, kept_open: int) -> Timed:
                def switch() -> None:
                    row_reads.MAPPED_SHARDS, row_reads.OPEN_SHARDS = mapped, kept_open
                    store.sample(256)  # untimed: the mappings of the setting before are let go here

                return Timed(lambda: store.sample(256), args.batches, 256, before=switch)

            got = interleaved({name: setting(*b) for name, b in settings.items()}, args.repeats)
            seg = store.leaves[0].seg
    finally:
        row_reads.MAPPED_SHARDS, row_reads.OPEN_SHARDS = budgets
    first = next(iter(got.values())).rate
    table(
        f"{args.codec} sample(256), {args.steps:,} steps x {args.envs} envs of uint8[84, 84, 4], {segments:,} segments of {seg} steps",
        ["setting", "rows/s", "× all mapped"],
        [[name, s.rate, ratio(s.rate, first)] for name, s in got.items()],
        [
            f"decode {native_rows.status(args.codec.split(':')[1])}; medians of {args.repeats} blocks of {args.batches} batches, taking turns"
        ],
    )
