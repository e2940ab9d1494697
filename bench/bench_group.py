"""Many writers, one learner: the figures of a group of stores, in one run.

Workload: the vector spec (obs float32[17], action float32[6], reward, terminated), 8
envs per step, page-cached.

- ``add``: aggregate rows/s of 1, 2, 4 actor processes, each writing its own shard of a
  group with ``add`` (one step of 8 envs per call, the default commit every 1000 steps),
  from the first actor's start to the last one's end.
- ``sample``: the learner's ``sample(256)`` from a 4-shard group (opened as readers)
  next to the same rows in one store, median microseconds per batch, and the same for
  sequences (``num_steps=8``).
- ``ray``: ``RaySampler.sample(256)`` over 4 :class:`~mmreplay.ray.ShardWriter` actors
  on this machine next to the local group's ``sample(256)``: what a batch costs through
  Ray, and one empty call to an actor (reported as skipped when ray is not installed,
  or with ``--no-ray``).

The machine's load average is recorded with the figures: on a shared machine they
move with it. Prints markdown tables whose ratios are computed from the numbers shown.
The defaults run in about a minute on a quiet 2-core machine.

Usage: ``python -m bench.bench_group [--steps N] [--rows N] [--repeats R] [--actors 1 2 4]
[--no-ray] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay.group import write_manifest

from .bench_prioritized import SPEC, median_us
from .timing import markdown_table, ratio

NUM_ENVS = 8
BATCH = 256


def steps(count: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((count, NUM_ENVS, 17), np.float32),
        "action": rng.standard_normal((count, NUM_ENVS, 6), np.float32),
        "reward": rng.standard_normal((count, NUM_ENVS), np.float32),
        "terminated": rng.random((count, NUM_ENVS)) < 0.01,
    }


# --- aggregate add rate -----------------------------------------------------------------


def _actor(path: str, shard: int, count: int, start: Any, out: Any) -> None:
    """One actor process: ``count`` adds of one step into its shard, timed."""
    data = steps(count, seed=shard)
    rows = [{k: v[i] for k, v in data.items()} for i in range(count)]
    with mr.open_shard(path, shard) as store:
        start.wait()
        t0 = time.time()
        for step in rows:
            store.add(step)
        store.commit()
        out.put((shard, t0, time.time()))


def add_rate(folder: str, actors: int, count: int) -> dict[str, float]:
    path = os.path.join(folder, f"add-{actors}")
    mr.create_group(path, SPEC, shards=actors, capacity=count, num_envs=NUM_ENVS).close()
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(actors), ctx.Queue()
    procs = [ctx.Process(target=_actor, args=(path, i, count, start, out)) for i in range(actors)]
    for proc in procs:
        proc.start()
    spans = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    wall = max(end for _, _, end in spans) - min(t0 for _, t0, _ in spans)
    each = [count * NUM_ENVS / (end - t0) for _, t0, end in spans]
    shutil.rmtree(path)
    return {"rows_per_s": actors * count * NUM_ENVS / wall, "per_actor_rows_per_s": statistics.median(each)}


# --- the learner's sample ---------------------------------------------------------------


def fill_group(path: str, shards: int, rows: int) -> None:
    per = rows // NUM_ENVS // shards
    mr.create_group(path, SPEC, shards=shards, capacity=per, num_envs=NUM_ENVS).close()
    for shard in range(shards):
        with mr.open_shard(path, shard) as store:
            store.extend(steps(per, seed=shard))


def sample_figures(folder: str, rows: int, repeats: int) -> dict[str, float]:
    group_path, store_path = os.path.join(folder, "group"), os.path.join(folder, "one")
    fill_group(group_path, 4, rows)
    with mr.create(store_path, SPEC, capacity=rows // NUM_ENVS, num_envs=NUM_ENVS) as store:
        store.extend(steps(rows // NUM_ENVS))
    out = {}
    with mr.open_group(group_path) as group, mr.open(store_path) as store:
        rng = np.random.default_rng(0)
        for _ in range(20):  # warm the page cache and the readers
            group.sample(BATCH, rng=rng), store.sample(BATCH, rng=rng)
        for _ in range(2):  # interleaved, the second round counts
            out["one_store_sample_us"] = median_us(lambda: store.sample(BATCH, rng=rng), repeats)
            out["group4_sample_us"] = median_us(lambda: group.sample(BATCH, rng=rng), repeats)
            out["one_store_seq8_us"] = median_us(
                lambda: store.sample(BATCH // 8, num_steps=8, rng=rng), repeats
            )
            out["group4_seq8_us"] = median_us(lambda: group.sample(BATCH // 8, num_steps=8, rng=rng), repeats)
    return out


# --- the Ray path -----------------------------------------------------------------------


def ray_figures(folder: str, rows: int, repeats: int) -> dict[str, float]:
    import ray

    import mmreplay.ray as mray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        root = os.path.join(folder, "ray")
        per = rows // NUM_ENVS // 4
        writers = mray.start_writers(root, SPEC, shards=4, capacity=per, num_envs=NUM_ENVS)
        ray.get([w.extend.remote(steps(per, seed=i)) for i, w in enumerate(writers)])
        ray.get([w.commit.remote() for w in writers])
        sampler = mray.RaySampler(writers, SPEC)
        rng = np.random.default_rng(0)
        for _ in range(20):
            sampler.sample(BATCH, rng=rng)
        write_manifest(root, 4)  # the actors' stores, read locally as a group
        with mr.open_group(root) as group:
            for _ in range(20):
                group.sample(BATCH, rng=rng)
            out = {}
            for _ in range(2):
                out["ray_sample_us"] = median_us(lambda: sampler.sample(BATCH, rng=rng), repeats)
                out["ray_round_trip_us"] = median_us(lambda: ray.get(writers[0].info.remote()), repeats)
                out["local_group_sample_us"] = median_us(lambda: group.sample(BATCH, rng=rng), repeats)
        ray.get([w.close.remote() for w in writers])
        return out
    finally:
        ray.shutdown()


def tables(report: dict[str, Any]) -> str:
    """The figures as markdown tables; every ratio is of the numbers as shown."""
    add = report["add"]
    one = add[min(add, key=int)]["rows_per_s"]
    out = [
        markdown_table(
            ["actor processes", "M rows/s added in all", "M rows/s per actor", f"in all / {min(add, key=int)} actor(s)"],
            [
                [n, f["rows_per_s"] / 1e6, f["per_actor_rows_per_s"] / 1e6, ratio(f["rows_per_s"] / 1e6, one / 1e6)]
                for n, f in add.items()
            ],
        )
    ]
    s = report["sample"]
    out.append(
        markdown_table(
            ["learner's batch", "one store us", "4-shard group us", "group / one store"],
            [
                ["sample(256)", s["one_store_sample_us"], s["group4_sample_us"], ratio(s["group4_sample_us"], s["one_store_sample_us"])],
                ["sample(32, num_steps=8)", s["one_store_seq8_us"], s["group4_seq8_us"], ratio(s["group4_seq8_us"], s["one_store_seq8_us"])],
            ],
        )
    )
    r = report.get("ray")
    if r:
        out.append(
            markdown_table(
                ["sample(256) over 4 shards", "us", "/ local group"],
                [
                    ["local group", r["local_group_sample_us"], "1.00"],
                    ["RaySampler (4 actors)", r["ray_sample_us"], ratio(r["ray_sample_us"], r["local_group_sample_us"])],
                    ["one empty actor call", r["ray_round_trip_us"], ratio(r["ray_round_trip_us"], r["local_group_sample_us"])],
                ],
            )
        )
    return "\n\n".join(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10_000, help="adds per actor process")
    parser.add_argument("--rows", type=int, default=1 << 18, help="rows sampled from (group and store)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"cpus": os.cpu_count(), "num_envs": NUM_ENVS, "batch": BATCH, "skipped": {}}
    report["load_average_before"] = os.getloadavg()[0]
    folder = tempfile.mkdtemp(prefix="bench-group-")
    try:
        report["add"] = {str(n): add_rate(folder, n, args.steps) for n in args.actors}
        report["sample"] = sample_figures(folder, args.rows, args.repeats)
        if args.no_ray:
            report["skipped"]["ray"] = "--no-ray"
        else:
            try:
                report["ray"] = ray_figures(folder, args.rows, args.repeats)
            except ImportError as exc:
                report["skipped"]["ray"] = str(exc)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report["load_average_after"] = os.getloadavg()[0]
    lines = [tables(report)]
    lines += [f"skipped {k}: {v}" for k, v in report["skipped"].items()]
    lines.append(
        f"load average (1 min) before and after: {report['load_average_before']:.1f}, "
        f"{report['load_average_after']:.1f} on {report['cpus']} cpus"
    )
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
