"""Many writers, one learner: the figures of a group of stores.

On the vector step (obs float32[17], action float32[6], reward, terminated), 8 envs per
step, page-cached:

- ``add``: rows/s of 1, 2, 4 actor processes (``--actors``), each adding ``--steps``
  steps one at a time to its own shard (the default commit every 1000 steps): in all,
  from the moment the parent releases them until the last one is done, and per actor;
- the learner's ``sample(256)`` and ``sample(32, num_steps=8)`` from a 4-shard group
  (opened as readers) next to the same rows in one store;
- ``RaySampler.sample(256)`` over 4 ``ShardWriter`` actors on this machine next to the
  local group's, and one empty actor call (skipped without ray, or with ``--no-ray``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay.group import write_manifest

from .data import NUM_ENVS, vector_spec
from .data import steps as make_steps
from .timing import Timed, interleaved, ratio, table

SMOKE = {"steps": 200, "rows": 8192, "repeats": 10, "actors": [1, 2], "no_ray": True}
BATCH = 256
SPEC = vector_spec(truncated=False)


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=10_000, help="adds per actor process")
    p.add_argument("--rows", type=int, default=1 << 18, help="rows sampled from (group and store)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--no-ray", action="store_true")


def steps(count: int, seed: int = 0) -> dict[str, np.ndarray]:
    return make_steps(SPEC, count, seed=seed)


def _actor(path: str, shard: int, count: int, ready: Any, go: Any, out: Any) -> None:
    """One actor process: ``count`` adds of one step into its shard, timed here too."""
    data = steps(count, seed=shard)
    pool = iter([{k: v[i] for k, v in data.items()} for i in range(count)])
    with mr.open_shard(path, shard) as store:
        ready.put(shard)
        go.wait()
        mine = interleaved(
            {"a": Timed(lambda: store.add(next(pool)), count, NUM_ENVS, after=store.commit)}, 1, warmup=0
        )
        out.put(mine["a"].rate)


def add_rate(folder: str, actors: int, count: int) -> tuple[float, float]:
    """Rows/s added by ``actors`` processes in all, and the median actor's own rate."""
    path = os.path.join(folder, f"add-{actors}")
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs: list[Any] = []

    def start() -> None:
        mr.create_group(path, SPEC, shards=actors, capacity=count, num_envs=NUM_ENVS).close()
        procs[:] = [ctx.Process(target=_actor, args=(path, i, count, ready, go, out)) for i in range(actors)]
        for proc in procs:
            proc.start()
        for _ in procs:
            ready.get(timeout=600)

    def release() -> None:
        go.set()
        each.extend(out.get(timeout=600) for _ in procs)

    each: list[float] = []
    total = interleaved({"all": Timed(release, units=actors * count * NUM_ENVS, before=start)}, 1, warmup=0)[
        "all"
    ]
    for proc in procs:
        proc.join()
    shutil.rmtree(path)
    return total.rate, statistics.median(each)


def fill_group(path: str, shards: int, rows: int) -> None:
    per = rows // NUM_ENVS // shards
    mr.create_group(path, SPEC, shards=shards, capacity=per, num_envs=NUM_ENVS).close()
    for shard in range(shards):
        with mr.open_shard(path, shard) as store:
            store.extend(steps(per, seed=shard))


def sample_figures(folder: str, rows: int, repeats: int) -> None:
    group_path, store_path = os.path.join(folder, "group"), os.path.join(folder, "one")
    fill_group(group_path, 4, rows)
    with mr.create(store_path, SPEC, capacity=rows // NUM_ENVS, num_envs=NUM_ENVS) as store:
        store.extend(steps(rows // NUM_ENVS))
    rng = np.random.default_rng(0)
    with mr.open_group(group_path) as group, mr.open(store_path) as store:
        got = interleaved(
            {
                "one|flat": lambda: store.sample(BATCH, rng=rng),
                "group|flat": lambda: group.sample(BATCH, rng=rng),
                "one|seq": lambda: store.sample(BATCH // 8, num_steps=8, rng=rng),
                "group|seq": lambda: group.sample(BATCH // 8, num_steps=8, rng=rng),
            },
            repeats,
            warmup=20,
        )
    us = {k: v.median * 1e6 for k, v in got.items()}
    table(
        f"the learner's batch ({rows:,} rows)",
        ["batch", "one store µs", "4-shard group µs", "group / one store"],
        [
            [f"sample({BATCH})", us["one|flat"], us["group|flat"], ratio(us["group|flat"], us["one|flat"])],
            [
                f"sample({BATCH // 8}, num_steps=8)",
                us["one|seq"],
                us["group|seq"],
                ratio(us["group|seq"], us["one|seq"]),
            ],
        ],
        [f"medians of {repeats} calls each, taking turns"],
    )


def ray_figures(folder: str, rows: int, repeats: int) -> None:
    import ray

    import mmreplay.ray as mray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        root, per = os.path.join(folder, "ray"), rows // NUM_ENVS // 4
        writers = mray.start_writers(root, SPEC, shards=4, capacity=per, num_envs=NUM_ENVS)
        ray.get([w.extend.remote(steps(per, seed=i)) for i, w in enumerate(writers)])
        ray.get([w.commit.remote() for w in writers])
        sampler, rng = mray.RaySampler(writers, SPEC), np.random.default_rng(0)
        write_manifest(root, 4)  # the actors' stores, read locally as a group
        with mr.open_group(root) as group:
            got = interleaved(
                {
                    "local group": lambda: group.sample(BATCH, rng=rng),
                    "RaySampler (4 ShardWriter actors)": lambda: sampler.sample(BATCH, rng=rng),
                    "one empty actor call": lambda: ray.get(writers[0].info.remote()),
                },
                repeats,
                warmup=20,
            )
        ray.get([w.close.remote() for w in writers])
    finally:
        ray.shutdown()
    local = got["local group"].median * 1e6
    table(
        f"sample({BATCH}) over 4 shards",
        ["", "µs", "/ local group"],
        [[k, v.median * 1e6, ratio(v.median * 1e6, local)] for k, v in got.items()],
    )


def run(args: argparse.Namespace) -> None:
    adds = {n: add_rate(args.root, n, args.steps) for n in args.actors}
    first = min(adds)
    table(
        f"adds of actor processes, {args.steps:,} steps of {NUM_ENVS} envs each",
        [
            "actor processes",
            "M rows/s added in all",
            "M rows/s per actor (median)",
            f"in all / {first} actor(s)",
        ],
        [
            [n, total / 1e6, each / 1e6, ratio(total / 1e6, adds[first][0] / 1e6)]
            for n, (total, each) in adds.items()
        ],
    )
    sample_figures(args.root, args.rows, args.repeats)
    if args.no_ray:
        return
    try:
        ray_figures(args.root, args.rows, args.repeats)
    except ImportError as exc:
        print(f"ray skipped: {exc}")
