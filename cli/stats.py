"""``mmreplay stats PATH``: episode return and length statistics, per-leaf value ranges."""

from __future__ import annotations

import json
from typing import Any

import click
import numpy as np

import mmreplay as mr
from mmreplay.roles import subtree

from . import open_source

#: steps read per block when scanning the leaves
BLOCK_BYTES = 32 << 20


def _summary(values: np.ndarray) -> dict[str, float | int | None]:
    if len(values) == 0:
        return {"count": 0, "mean": None, "std": None, "min": None, "median": None, "max": None}
    v = np.asarray(values, np.float64)
    return {
        "count": int(len(v)),
        "mean": float(v.mean()),
        "std": float(v.std()),
        "min": float(v.min()),
        "median": float(np.median(v)),
        "max": float(v.max()),
    }


def episode_stats(store: mr.Store) -> dict[str, Any]:
    """Return and length statistics of the complete episodes (and of all, open ones included)."""
    reward_path = store.roles.get("reward")
    returns, lengths, statuses = [], [], []
    for ep in store.episodes():
        lengths.append(ep.length)
        statuses.append(ep.status)
        if reward_path is not None:
            returns.append(float(np.sum(np.asarray(subtree(ep.data, reward_path), np.float64))))
    lengths_a, returns_a = np.array(lengths), np.array(returns)
    complete = np.array([s != "open" for s in statuses], bool)
    out: dict[str, Any] = {
        "episodes": len(lengths),
        "complete": int(complete.sum()),
        "open": int((~complete).sum()),
        "terminated": statuses.count("terminated"),
        "truncated": statuses.count("truncated"),
        "length": _summary(lengths_a[complete]) if len(lengths) else _summary(lengths_a),
    }
    if reward_path is not None:
        out["return"] = _summary(returns_a[complete]) if len(returns) else _summary(returns_a)
    return out


def leaf_stats(store: mr.Store) -> dict[str, dict[str, Any]]:
    """min / max / mean / NaN count of every leaf over the retained committed rows, in blocks."""
    paths = store.leaf_paths
    specs = [leaf.info.spec for leaf in store.leaves]
    acc = [{"min": None, "max": None, "sum": 0.0, "count": 0, "nan": 0, "inf": 0} for _ in paths]
    step_bytes = max(1, store.num_envs * sum(s.nbytes for s in specs))
    k = max(1, BLOCK_BYTES // step_bytes)
    for a in range(store.first_step, store.committed_steps, k):
        b = min(store.committed_steps, a + k)
        for i, values in enumerate(store.read_steps(np.arange(a, b))):
            s = acc[i]
            v = values.reshape(-1)
            if v.dtype.kind == "c":
                v = np.abs(v)
            if v.dtype.kind == "f":
                nan = np.isnan(v)
                s["nan"] += int(nan.sum())
                s["inf"] += int(np.isinf(v).sum())
                v = v[np.isfinite(v)]
            if v.size == 0:
                continue
            lo, hi = v.min(), v.max()
            s["min"] = lo if s["min"] is None else min(s["min"], lo)
            s["max"] = hi if s["max"] is None else max(s["max"], hi)
            s["sum"] += float(v.astype(np.float64).sum())
            s["count"] += int(v.size)
    out = {}
    for p, spec, s in zip(paths, specs, acc):
        out[p] = {
            "shape": list(spec.shape),
            "dtype": spec.dtype.name,
            "min": None if s["min"] is None else s["min"].item(),
            "max": None if s["max"] is None else s["max"].item(),
            "mean": s["sum"] / s["count"] if s["count"] else None,
            "nan": s["nan"],
            "inf": s["inf"],
        }
    return out


def _json_safe(x: Any) -> Any:
    """``x`` with NaN and infinities as null: JSON has no number for them."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) or (type(x) is int and abs(x) >= 10**10):  # (an int64's 19 digits: 1.845e+19)
        return f"{x:.4g}"
    return str(x)


def _cells(texts: Any) -> str:
    """Right-aligned columns, a space between any two however long a value is."""
    return "".join(" " + str(t).rjust(10) for t in texts)


@click.command("stats")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
def command(path: str, as_json: bool) -> None:
    """Episode return and length statistics and per-leaf min / max / mean / NaN counts.

    PATH may be a group's folder: the statistics are over all its shards."""
    # sums that overflow and the spread of infinite returns are inf and NaN, shown as such
    with open_source(path) as source, np.errstate(over="ignore", invalid="ignore"):
        shards = getattr(source, "num_shards", None)
        store = source if shards is None else source.joined()
        info = {"path": store.path, "steps": len(store), "num_envs": store.num_envs}
        if shards is not None:
            info["shards"] = shards
        info["episodes"] = episode_stats(store)
        info["leaves"] = leaf_stats(store)
    if as_json:
        click.echo(json.dumps(_json_safe(info), indent=1))
        return
    ep = info["episodes"]
    shards = f" in {info['shards']} shards" if "shards" in info else ""
    click.echo(f"{info['path']}: {info['steps']:,} steps x {info['num_envs']} envs{shards}")
    click.echo(
        f"episodes: {ep['episodes']:,} ({ep['terminated']:,} terminated, {ep['truncated']:,} truncated, "
        f"{ep['open']:,} open); statistics over the {ep['complete']:,} complete ones"
    )
    keys = ("count", "mean", "std", "min", "median", "max")
    click.echo("  " + "".ljust(8) + _cells(keys))
    for name in ("return", "length"):
        if name in ep:
            click.echo("  " + name.ljust(8) + _cells(_fmt(ep[name][k]) for k in keys))
    click.echo("leaves:")
    width = max(len(p) for p in info["leaves"])
    cols = ("dtype", "min", "max", "mean", "nan", "inf")
    click.echo("  " + "leaf".ljust(width) + _cells(cols))
    for p, s in info["leaves"].items():
        click.echo("  " + p.ljust(width) + _cells(_fmt(s[c]) for c in cols))
