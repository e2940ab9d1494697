"""``mmreplay sample PATH -n N``: a few random rows, printed readably."""

from __future__ import annotations

import json
from typing import Any

import click
import numpy as np

import mmreplay as mr
from mmreplay.read.gather import sample
from mmreplay.read.request import SampleRequest
from mmreplay.samplers.uniform import UniformSampler
from mmreplay.spec import flatten

#: arrays with more elements than this are summarised (shape, dtype, min, max, mean)
MAX_ELEMENTS = 16


def show(value: np.ndarray) -> str:
    """A short, readable rendering of one leaf value."""
    a = np.asarray(value)
    if a.size > MAX_ELEMENTS:
        if a.dtype.kind in "biuf":
            finite = a[np.isfinite(a)] if a.dtype.kind == "f" else a
            stats = (
                f" min {finite.min():.4g} max {finite.max():.4g} mean {finite.astype(np.float64).mean():.4g}"
                if finite.size
                else " no finite values"
            )
        else:
            stats = ""
        return f"{a.dtype}{list(a.shape)}{stats}"
    if a.ndim == 0:
        return str(a.item() if a.dtype.kind != "f" else np.format_float_positional(a, precision=6, trim="-"))
    return np.array2string(a, precision=4, separator=", ", suppress_small=True, max_line_width=200)


def _plain(value: np.ndarray) -> Any:
    a = np.asarray(value)
    if a.dtype.kind == "c":  # JSON has no complex number: [real, imag] pairs
        a = np.stack([a.real, a.imag], axis=-1)
    if a.dtype.kind == "f":
        a = np.where(np.isfinite(a), a, np.nan).astype(np.float64)
        return json.loads(json.dumps(a.tolist()).replace("NaN", "null"))
    return a.tolist()


@click.command("sample")
@click.argument("path", type=click.Path())
@click.option("-n", "count", type=click.IntRange(min=1), default=4, show_default=True, help="Rows to draw.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (full values; complex ones as [real, imag]) for scripts.")
def command(path: str, count: int, seed: int, as_json: bool) -> None:
    """Print N rows drawn uniformly from the committed rows of the buffer at PATH."""
    with mr.open(path, mode="r") as store:
        # rows, uniformly: not the store's sampler's sequences (slices) or priorities
        request = SampleRequest.build(count, rng=seed, return_info=True, sampler=UniformSampler())
        batch, info = sample(store, request)
        paths = store.leaf_paths
        leaves = flatten(batch)
    rows = []
    for i in range(count):
        rows.append(
            {
                "step": int(info.step[i]),
                "env": int(info.env[i]),
                "values": {p: leaves[j][i] for j, p in enumerate(paths)},
            }
        )
    if as_json:
        out = [{**r, "values": {p: _plain(v) for p, v in r["values"].items()}} for r in rows]
        click.echo(json.dumps(out, indent=1))
        return
    width = max(len(p) for p in paths)
    for i, r in enumerate(rows):
        click.echo(f"row {i}: step {r['step']:,}, env {r['env']}")
        for p, v in r["values"].items():
            click.echo(f"  {p.ljust(width)}  {show(v)}")
