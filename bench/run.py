"""The comparative benchmark: mmreplay beside the replay buffers people would use instead.

``python -m bench`` runs every system that is installed (peers come from
``pip install -e '.[bench]'``; the benchmark installs nothing and names the peers it
skipped), on the same data, on this machine, in this run, and writes a markdown table of
medians (``--out``, default ``bench/results/``) and a JSON file of every raw figure, the
machine's CPU and disk, and the version of every peer. ``--size small`` is the size CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import mmreplay as mr
from mmreplay import read

from . import report
from .systems import SYSTEMS, NumpyRAM, System, Unsupported, available, du, version
from .timing import repeat_seconds
from .workloads import WORKLOADS, Workload, nest_from_flat

__all__ = ["Sizes", "SIZES", "run", "main"]


@dataclass(frozen=True)
class Sizes:
    """How much each figure measures. Capacities and counts are in steps (``num_envs`` rows)."""

    capacity: dict[str, int]
    add_steps: dict[str, int]  # most add calls per repeat
    extend_block: dict[str, int]  # steps per extend call
    extend_blocks: dict[str, int]  # most extend calls per repeat
    sample_batches: dict[str, int]  # most sample(256) calls per repeat
    seq_batches: int  # most sample(32, num_steps) calls per repeat
    num_steps: int
    repeats: int  # of checkpoint, reopen and export
    rate_repeats: int  # of add, extend and sample rates, alternating with the baseline
    budget_s: float  # a repeat of a rate stops after this long
    slow_budget_s: float  # repeats of a checkpoint / reopen / export stop after this long
    reopen_rows: tuple[int, ...]  # vector buffer sizes for the reopen figure
    reopen_repeats: int
    reopen_budget_s: float  # a peer whose checkpoint took longer skips the larger sizes
    ooc_steps: int  # pixel buffer for the out-of-memory sampling figure
    ooc_batches: int
    export_formats: tuple[str, ...] = ("npz", "minari")
    workloads: tuple[str, ...] = ("vector", "pixels", "nested")


SIZES = {
    "full": Sizes(
        capacity={"vector": 100_000, "pixels": 2_000, "nested": 20_000},
        add_steps={"vector": 100_000, "pixels": 2_000, "nested": 20_000},
        extend_block={"vector": 1_000, "pixels": 32, "nested": 250},
        extend_blocks={"vector": 100, "pixels": 60, "nested": 80},
        sample_batches={"vector": 1_000, "pixels": 200, "nested": 500},
        seq_batches=100,
        num_steps=64,
        repeats=3,
        rate_repeats=5,
        budget_s=0.08,
        slow_budget_s=3.0,
        reopen_rows=(10**5, 10**6, 10**7),
        reopen_repeats=5,
        reopen_budget_s=5.0,
        ooc_steps=2_000,
        ooc_batches=8,
    ),
    "small": Sizes(
        capacity={"vector": 400, "pixels": 40, "nested": 200},
        add_steps={"vector": 50, "pixels": 10, "nested": 30},
        extend_block={"vector": 50, "pixels": 8, "nested": 25},
        extend_blocks={"vector": 2, "pixels": 2, "nested": 2},
        sample_batches={"vector": 2, "pixels": 2, "nested": 2},
        seq_batches=2,
        num_steps=16,
        repeats=2,
        rate_repeats=2,
        budget_s=0.05,
        slow_budget_s=0.5,
        reopen_rows=(10**3, 4 * 10**3),
        reopen_repeats=2,
        reopen_budget_s=20.0,
        ooc_steps=40,
        ooc_batches=2,
    ),
}

BATCH = 256
SEQ_BATCH = 32


def log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


@dataclass
class Context:
    root: str
    sizes: Sizes
    systems: list[type[System]]
    results: dict[str, Any] = field(default_factory=dict)

    def folder(self, name: str) -> str:
        path = os.path.join(self.root, name.replace(" ", "_").replace("/", "_").replace("+", "_"))
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _figure(samples: list[float], unit: str, **extra: Any) -> dict[str, Any]:
    return {"median": _median(samples), "unit": unit, "samples": samples, **extra}


def _na(reason: str) -> dict[str, Any]:
    return {"median": None, "na": reason}


def _rate(call: Callable[[int], Any], units: float, max_calls: int, budget_s: float) -> float:
    """Units per second over up to ``max_calls`` calls of ``call(i)``, stopping early once
    ``budget_s`` has passed (a slow system is measured on fewer calls, not for longer)."""
    clock = time.perf_counter
    t0 = clock()
    i = 0
    while i < max_calls:
        call(i)
        i += 1
        if not i & 15 and clock() - t0 > budget_s:
            break
    return i * units / (clock() - t0)


def _paired(
    system: System,
    base: System | None,
    make: Callable[[System], tuple[Callable[[int], Any], float, int]],
    s: Sizes,
) -> dict[str, Any]:
    """A rate measured in alternate repeats on ``system`` and on the numpy baseline, so
    that both see the same machine load; the baseline's samples go in ``baseline``."""
    ours, theirs = [], []
    calls = [make(system)] + ([make(base)] if base is not None else [])
    for fn, units, n in calls:  # warm-up: first touches, caches
        _rate(fn, units, min(n, 16), s.budget_s)
    for _ in range(s.rate_repeats):
        ours.append(_rate(*calls[0], s.budget_s))
        if base is not None:
            theirs.append(_rate(*calls[1], s.budget_s))
    fig = _figure(ours, "rows/s")
    if base is not None:
        fig["baseline"] = theirs
    return fig


def bench_workload(
    ctx: Context, cls: type[System], workload: Workload, data: dict[str, np.ndarray]
) -> dict[str, Any]:
    """Every per-workload figure of one system (rates paired with a numpy baseline)."""
    s = ctx.sizes
    name = workload.name
    cap, e = s.capacity[name], workload.num_envs
    block = s.extend_block[name]
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {}
    system = base = None
    try:
        system = cls(ctx.folder(f"{name}-{cls.name}"), workload, cap)
        if cls is not NumpyRAM:
            base = NumpyRAM(ctx.folder(f"{name}-baseline"), workload, cap)
        for sys_ in filter(None, (system, base)):
            for a in range(0, cap, block):  # fill the ring once: every page touched, every file grown
                sys_.extend(sys_.native_block(data, a, min(cap, a + block)))
            sys_.checkpoint()

        def adds(x: System) -> tuple[Callable[[int], Any], float, int]:
            pool = [x.native_step(data, t) for t in range(min(cap, 64))]
            return (lambda i: x.add(pool[i % len(pool)])), e, s.add_steps[name]

        out["add"] = _paired(system, base, adds, s)

        def extends(x: System) -> tuple[Callable[[int], Any], float, int]:
            blocks = [
                x.native_block(data, a, a + block) for a in range(0, min(cap, 2 * block) - block + 1, block)
            ]
            return (lambda i: x.extend(blocks[i % len(blocks)])), block * e, s.extend_blocks[name]

        out["extend"] = _paired(system, base, extends, s)
        out["extend"]["block_steps"] = block
        if "extend" in cls.notes:
            out["extend"]["note"] = cls.notes["extend"]

        def samples(x: System) -> tuple[Callable[[int], Any], float, int]:
            return (lambda i: x.sample(BATCH, rng)), BATCH, s.sample_batches[name]

        def seqs(x: System) -> tuple[Callable[[int], Any], float, int]:
            return (
                (lambda i: x.sample_sequences(SEQ_BATCH, s.num_steps, rng)),
                SEQ_BATCH * s.num_steps,
                s.seq_batches,
            )

        for key, make in (("sample", samples), ("sample_seq", seqs)):
            try:
                out[key] = _paired(system, base, make, s)
            except Unsupported as exc:
                out[key] = _na(str(exc))
        out["sample_seq"]["num_steps"] = s.num_steps
        if base is not None:
            base.close()
            base = None

        pool = [system.native_step(data, t) for t in range(min(cap, 64))]
        ckpt_steps = min(100, cap)

        def some_adds() -> None:
            for t in range(ckpt_steps):
                system.add(pool[t % len(pool)])

        out["checkpoint"] = _figure(
            [x * 1e3 for x in _repeat(system.checkpoint, s, setup=some_adds)], "ms", after_steps=ckpt_steps
        )
        system.checkpoint()
        out["disk_bytes"] = {
            "median": system.disk_bytes(),
            "unit": "bytes",
            "raw_bytes": cap * e * workload.row_bytes,
        }
        out["reopen"] = _figure(
            [x * 1e3 for x in _repeat(system.reopen, s, setup=system.drop)], "ms", rows=cap * e
        )
        out["reopen"]["rows_after"] = system.rows()
    finally:
        for sys_ in (system, base):
            if sys_ is not None:
                sys_.close()
                shutil.rmtree(sys_.folder, ignore_errors=True)
    return out


def _repeat(fn: Callable[[], Any], s: Sizes, setup: Callable[[], Any] | None = None) -> list[float]:
    """Seconds per call: up to ``repeats`` calls, fewer once ``slow_budget_s`` is spent."""
    out: list[float] = []
    spent = 0.0
    while len(out) < s.repeats and (not out or spent < s.slow_budget_s):
        out.extend(repeat_seconds(fn, 1, setup=setup))
        spent += out[-1]
    return out


def _fill(system: System, steps: int, block: dict[str, np.ndarray], chunk: int) -> None:
    """Extend ``system`` by ``steps`` steps, cycling through ``block``."""
    n = len(block["obs"])
    natives = [
        (system.native_block(block, a, min(n, a + chunk)), min(n, a + chunk) - a) for a in range(0, n, chunk)
    ]
    done = i = 0
    while done < steps:
        nat, k = natives[i % len(natives)]
        if done + k > steps:
            k = steps - done
            nat = system.native_block(block, 0, k)
        system.extend(nat)
        done += k
        i += 1


def bench_reopen_sizes(ctx: Context) -> dict[str, Any]:
    """Checkpoint then reopen of vector buffers of each size (rows = steps x 8 envs)."""
    s = ctx.sizes
    workload = WORKLOADS["vector"]
    block = workload.steps(min(20_000, max(s.reopen_rows) // workload.num_envs), seed=3)
    out: dict[str, Any] = {}
    for cls in ctx.systems:
        res: dict[str, Any] = {}
        skip_reason = None
        for rows in s.reopen_rows:
            if skip_reason:
                res[str(rows)] = _na(skip_reason)
                continue
            steps = rows // workload.num_envs
            folder = ctx.folder(f"reopen-{cls.name}")
            system = cls(folder, workload, steps)
            try:
                t0 = time.perf_counter()
                _fill(system, steps, block, 2_000)
                fill_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                system.checkpoint()
                ckpt_s = time.perf_counter() - t0
                times = repeat_seconds(system.reopen, s.reopen_repeats, setup=system.drop)
                res[str(rows)] = _figure(
                    [x * 1e3 for x in times],
                    "ms",
                    checkpoint_ms=ckpt_s * 1e3,
                    fill_s=fill_s,
                    disk_bytes=system.disk_bytes(),
                    rows_after=system.rows(),
                )
                log(
                    f"  reopen {cls.name} {rows} rows: {statistics.median(times) * 1e3:.2f} ms (checkpoint {ckpt_s:.2f} s)"
                )
                if ckpt_s + statistics.median(times) > s.reopen_budget_s:
                    skip_reason = f"skipped: checkpoint + reopen at {rows} rows already took {ckpt_s:.0f} s"
            finally:
                system.close()
                system = None  # type: ignore[assignment]
                shutil.rmtree(folder, ignore_errors=True)
        out[cls.name] = res
    return out


# --- export ---------------------------------------------------------------------------


def bench_export(ctx: Context, workload: Workload, data: dict[str, np.ndarray]) -> dict[str, Any]:
    """MB/s of raw data written: mmreplay exports, and numpy's ``savez`` of RAM arrays."""
    from mmreplay import export as mr_export

    s = ctx.sizes
    cap = s.capacity[workload.name]
    raw = cap * workload.num_envs * workload.row_bytes
    folder = ctx.folder(f"export-{workload.name}")
    out: dict[str, Any] = {"raw_bytes": raw}
    try:
        arrays = {p.replace("/", "__"): v[:cap] for p, v in data.items()}

        def savez() -> None:
            np.savez(os.path.join(folder, "numpy.npz"), **arrays)

        out["numpy savez"] = _figure([raw / 1e6 / x for x in _repeat(savez, s)], "MB/s")
        path = os.path.join(folder, "buffer")
        with mr.create(path, workload.spec, cap, workload.num_envs) as store:
            store.extend({k: v for k, v in _nest(data, cap).items()})
        with mr.open(path) as store:
            for fmt in s.export_formats:
                target = os.path.join(folder, f"out-{fmt}")

                def export(fmt: str = fmt, target: str = target, store: Any = store) -> None:
                    mr_export.export(store, target, format=fmt, force=True, **_export_options(fmt))

                try:
                    times = _repeat(export, s, setup=lambda target=target: _rm(target))
                    out[f"mmreplay {fmt}"] = _figure([raw / 1e6 / x for x in times], "MB/s")
                except Exception as exc:  # a format the workload cannot be written in
                    out[f"mmreplay {fmt}"] = _na(f"{type(exc).__name__}: {exc}"[:200])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _export_options(fmt: str) -> dict[str, Any]:
    return {"dataset_id": "bench/vector-v0"} if fmt == "minari" else {}


def _rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def _nest(data: dict[str, np.ndarray], n: int) -> dict[str, Any]:
    return nest_from_flat({p: v[:n] for p, v in data.items()})


# --- sampling data larger than memory -----------------------------------------------------


def _drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _resident_bytes(paths: list[str]) -> int | None:
    """Page-cache bytes of the files (util-linux ``fincore``), or None without it."""
    if shutil.which("fincore") is None:
        return None
    total = 0
    for p in paths:
        res = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", p], capture_output=True, text=True
        )
        if res.returncode != 0 or not res.stdout.strip():
            return None
        total += int(res.stdout.split()[0])
    return total


def _data_files(path: str) -> list[str]:
    with mr.open(path, populate=False) as store:
        meta = store.metadata
    files = sorted({os.path.join(path, leaf.file) for leaf in meta.leaves if leaf.file})
    out = []
    for f in files:
        if os.path.isdir(f):
            out.extend(os.path.join(d, x) for d, _, xs in os.walk(f) for x in xs)
        else:
            out.append(f)
    return out


def bench_out_of_memory(ctx: Context) -> dict[str, Any]:
    """sample(256) with none of the data in the page cache, against os.pread of the same rows.

    Before each batch the store is closed, the page cache of its data files is dropped
    with ``posix_fadvise(DONTNEED)``, and the store is reopened (none of this is timed).
    The buffer fits in RAM, so the store's page prefetch for larger-than-memory buffers
    (``MADV_RANDOM`` plus ``MADV_WILLNEED`` of the batch's pages) is switched on as it
    would be by itself for a buffer that does not fit.
    """
    s = ctx.sizes
    workload = WORKLOADS["pixels"]
    steps = s.ooc_steps
    data = workload.steps(min(steps, 500), seed=5)
    n = len(data["obs"])
    out: dict[str, Any] = {
        "method": "page cache of the data files dropped with posix_fadvise(POSIX_FADV_DONTNEED) before each "
        "batch (no memory cgroup: this machine's memory cgroup belongs to the environment that runs it); "
        "the store's larger-than-memory page prefetch switched on",
        "workload": "pixels",
        "rows": steps * workload.num_envs,
        "batch": BATCH,
    }
    variants = [
        ("mmreplay zarr", "zarr", None),
        ("mmreplay hdf5", "hdf5", None),
        ("mmreplay zarr+zstd", "zarr", "zstd"),
    ]
    rng = np.random.default_rng(11)
    for label, backend, comp in variants:
        folder = ctx.folder(f"ooc-{label}")
        path = os.path.join(folder, "buffer")
        try:
            with mr.create(
                path, workload.spec, steps, workload.num_envs, backend=backend, compression=comp
            ) as store:
                done = 0
                while done < steps:
                    k = min(n, steps - done)
                    store.extend(_nest(data, k))
                    done += k
            files = _data_files(path)
            for f in files:  # dirty pages cannot be dropped: write them back first
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            times, pread_times, resident = [], [], []
            for _ in range(s.ooc_batches):
                _drop_cache(files)
                resident.append(_resident_bytes(files))
                # what the store does by itself once its leaves exceed the memory it may use:
                # per-batch prefetch, and no populating at open
                with mr.open(path, populate=False) as store:
                    read.set_prefetch(store, True)
                    t0 = time.perf_counter()
                    _, info = store.sample(BATCH, rng=rng, return_info=True)
                    times.append(time.perf_counter() - t0)
                    leaves = store.metadata.leaves
                if comp is None:
                    _drop_cache(files)
                    pread_times.append(
                        _pread_rows(path, leaves, info.slot, info.env, workload.num_envs, steps)
                    )
            entry = {
                "sample": _figure([BATCH / x for x in times], "rows/s"),
                "page_cache_bytes_after_drop": resident,
                "disk_bytes": du(path),
            }
            if pread_times:
                entry["pread"] = _figure([BATCH / x for x in pread_times], "rows/s")
            out[label] = entry
            log(f"  out-of-memory {label}: {entry['sample']['median']:.0f} rows/s")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def _pread_rows(
    path: str, leaves: Any, slots: np.ndarray, envs: np.ndarray, num_envs: int, capacity: int
) -> float:
    """Seconds to read the given rows of every leaf with one os.pread each (mapped leaves)."""
    fds = {}
    plan = []
    for leaf in leaves:
        f = os.path.join(path, leaf.file)
        if f not in fds:
            fds[f] = os.open(f, os.O_RDONLY)
        plan.append((fds[f], leaf.offset or 0, leaf.spec.nbytes))
    try:
        t0 = time.perf_counter()
        for fd, offset, nbytes in plan:
            for slot, env in zip(slots.tolist(), envs.tolist()):
                os.pread(fd, nbytes, offset + (slot * num_envs + env) * nbytes)
        return time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)


# --- machine ----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["memory_total_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info


def disk_of(path: str) -> dict[str, Any]:
    st = os.statvfs(path)
    out: dict[str, Any] = {"path": path, "free_bytes": st.f_bavail * st.f_frsize}
    res = subprocess.run(["df", "--output=source,fstype", path], capture_output=True, text=True)
    if res.returncode == 0:
        lines = res.stdout.split("\n")
        if len(lines) > 1 and lines[1].split():
            out["device"], out["fstype"] = lines[1].split()[:2]
            dev = os.path.basename(out["device"])
            rot = f"/sys/block/{dev}/queue/rotational"
            if os.path.exists(rot):
                with open(rot) as f:
                    out["rotational"] = f.read().strip() == "1"
    return out


def versions(systems: list[type[System]]) -> dict[str, str | None]:
    pkgs = {"mmreplay", "numpy", "zarr", "h5py"}
    for cls in SYSTEMS:
        pkgs.update(cls.packages)
    return {p: version(p) for p in sorted(pkgs)}


# --- the run ---------------------------------------------------------------------------------


def run(
    root: str, size: str = "full", only: list[str] | None = None, parts: tuple[str, ...] = ()
) -> dict[str, Any]:
    sizes = SIZES[size]
    chosen, skipped = [], {}
    for cls in SYSTEMS:
        if only and not any(o.lower() in cls.name.lower() for o in only) and cls is not NumpyRAM:
            continue
        missing = available(cls)
        if missing:
            skipped[cls.name] = f"not installed: {', '.join(missing)} (pip install -e '.[bench]')"
        else:
            chosen.append(cls)
    for name, why in skipped.items():
        log(f"skipping {name}: {why}")
    ctx = Context(root, sizes, chosen)
    parts = parts or ("workloads", "reopen", "export", "out_of_memory")
    results: dict[str, Any] = {
        "size": size,
        "sizes": asdict(sizes),
        "machine": machine(),
        "disk": disk_of(root),
        "versions": versions(chosen),
        "systems": [c.name for c in chosen],
        "skipped": skipped,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    t_start = time.perf_counter()
    if "workloads" in parts:
        results["workloads"] = {}
        for wname in sizes.workloads:
            workload = WORKLOADS[wname]
            data = workload.steps(sizes.capacity[wname], seed=0)
            per: dict[str, Any] = {}
            for cls in chosen:
                log(f"{wname}: {cls.name}")
                per[cls.name] = bench_workload(ctx, cls, workload, data)
            results["workloads"][wname] = per
            if "export" in parts and wname in ("vector", "pixels"):
                log(f"{wname}: export")
                results.setdefault("export", {})[wname] = bench_export(ctx, workload, data)
            del data
    if "reopen" in parts:
        log("reopen by size")
        results["reopen_sizes"] = bench_reopen_sizes(ctx)
    if "out_of_memory" in parts:
        log("sampling with the data out of memory")
        results["out_of_memory"] = bench_out_of_memory(ctx)
    results["seconds"] = time.perf_counter() - t_start
    results["load_average_at_end"] = os.getloadavg()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--dir", help="folder for the buffers (default: a temporary folder in TMPDIR)")
    parser.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "results"),
        help="folder for bench.md and bench.json",
    )
    parser.add_argument(
        "--only", action="append", help="run only systems whose name contains this (repeatable)"
    )
    parser.add_argument(
        "--part",
        action="append",
        choices=["workloads", "reopen", "export", "out_of_memory"],
        help="run only these parts (repeatable)",
    )
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="mmreplay-bench-", dir=args.dir)
    try:
        results = run(root, args.size, args.only, tuple(args.part or ()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    stem = "bench" if args.size == "full" else f"bench-{args.size}"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    text = report.markdown(results)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(text)
    sys.stdout.write(text)
    return 0


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return str(obj)


if __name__ == "__main__":
    raise SystemExit(main())
