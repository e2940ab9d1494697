"""The markdown report of a benchmark run: medians, and mmreplay's ratios.

Every ratio reads "times better": above 1 mmreplay is faster (or smaller) than the
system it is compared with, below 1 it is slower (or larger). "best peer" is the best of
the other libraries (TorchRL, cpprb, SB3) on that figure; numpy-in-RAM is the limit.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["markdown", "FIGURES", "advantage", "targets"]

#: key -> (label, unit shown, higher is better, scale from the raw unit)
FIGURES: list[tuple[str, str, str, bool, float]] = [
    ("add", "per-step `add`, 8 envs", "k rows/s", True, 1e-3),
    ("extend", "bulk `extend`", "k rows/s", True, 1e-3),
    ("checkpoint", "commit / checkpoint, full buffer", "ms", False, 1.0),
    ("sample", "`sample(256)`", "k rows/s", True, 1e-3),
    ("sample_seq", "`sample(32, num_steps=64)`", "k rows/s", True, 1e-3),
    ("disk_bytes", "bytes on disk", "MB", False, 1e-6),
    ("reopen", "reopen / load", "ms", False, 1.0),
]

BASELINE = "numpy (RAM)"


def _is_mmreplay(name: str) -> bool:
    return name.startswith("mmreplay")


def _peers(names: list[str]) -> list[str]:
    return [n for n in names if not _is_mmreplay(n) and n != BASELINE]


def advantage(mine: float | None, other: float | None, higher_better: bool) -> float | None:
    """How many times better ``mine`` is than ``other`` (> 1: better)."""
    if mine is None or other is None or mine == 0 or other == 0:
        return None
    return mine / other if higher_better else other / mine


def _best(values: dict[str, float | None], names: list[str], higher_better: bool) -> tuple[str, float] | None:
    got = [(n, values[n]) for n in names if values.get(n) is not None]
    if not got:
        return None
    pick = max if higher_better else min
    return pick(got, key=lambda kv: kv[1])


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _ratio(x: float | None) -> str:
    """Two significant figures (``310×``, ``2.7×``, ``0.0032×``): the runs vary by more."""
    if x is None:
        return "–"
    if x <= 0 or not math.isfinite(x):
        return f"{x:g}×"
    digits = 1 - math.floor(math.log10(x))
    if digits <= 0:
        return f"{round(x, digits):,.0f}×"
    return f"{x:.{digits}f}×"


def _shown(x: float) -> float:
    """``x`` as its cell shows it, so that ratios are those of the numbers shown."""
    return float(_num(x).replace(",", ""))


Row = tuple[str, str, bool, dict[str, "float | None"], dict[str, str], dict[str, "float | None"]]


def _table(rows: list[Row], names: list[str]) -> list[str]:
    """rows: (label, unit, higher_better, system -> value in shown unit, system -> n/a
    reason, system -> median of the numpy baseline measured alongside it, in shown unit).

    An mmreplay cell gives its ratio to numpy (to the paired baseline, shown in the cell,
    where there is one; else to the numpy column) and to the best peer of the row, each
    computed from the numbers shown."""
    peers = _peers(names)
    head = ["figure"] + names
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, unit, hb, values, reasons, bases in rows:
        cells = [f"{label} ({unit}, {'higher' if hb else 'lower'} is better)"]
        shown = {n: _shown(v) for n, v in values.items() if v is not None}
        best = _best(shown, peers, hb)
        paired = any(b is not None for b in bases.values())
        for n in names:
            v = values.get(n)
            if v is None or (n == BASELINE and paired):  # (paired: numpy's figures are in the cells)
                cells.append("n/a" if n in reasons else "–")
                continue
            cell = _num(v)
            if _is_mmreplay(n):
                parts = []
                base = bases.get(n)
                if base is not None:
                    parts.append(f"{_ratio(advantage(shown[n], _shown(base), hb))} numpy's {_num(base)} beside it")
                elif BASELINE in shown:
                    parts.append(f"{_ratio(advantage(shown[n], shown[BASELINE], hb))} numpy")
                if best is not None:
                    parts.append(f"{_ratio(advantage(shown[n], best[1], hb))} best peer")
                if parts:
                    cell += " (" + "; ".join(parts) + ")"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ratios(
    name: str,
    values: dict[str, float | None],
    norms: dict[str, float | None],
    peers: list[str],
    hb: bool,
) -> tuple[float | None, float | None]:
    """mmreplay's advantage over numpy and over the best peer. Where each system was
    measured alongside its own numpy baseline, both ratios use those pairings, so a
    change of machine load between systems cancels out."""
    if norms.get(name) is not None:
        peer_norms = {p: norms.get(p) for p in peers}
        best = _best(peer_norms, peers, hb)
        r_peer = advantage(norms[name], best[1], hb) if best else None
        return advantage(norms[name], 1.0, hb), r_peer
    best = _best(values, peers, hb)
    return (
        advantage(values[name], values.get(BASELINE), hb),
        advantage(values[name], best[1], hb) if best else None,
    )


def _workload_rows(per: dict[str, Any]) -> list[Row]:
    rows = []
    for key, label, unit, hb, scale in FIGURES:
        values: dict[str, float | None] = {}
        reasons: dict[str, str] = {}
        bases: dict[str, float | None] = {}
        for name, figs in per.items():
            fig = figs.get(key, {})
            m = fig.get("median")
            values[name] = None if m is None else m * scale
            if "na" in fig:
                reasons[name] = fig["na"]
            base = fig.get("baseline")
            bases[name] = statistics.median(base) * scale if base and name != BASELINE else None
        rows.append((label, unit, hb, values, reasons, bases))
    return rows


def _normalised(fig: dict[str, Any]) -> float | None:
    """A figure over the median of the numpy baseline measured alongside it."""
    base = fig.get("baseline")
    if fig.get("median") is None or not base:
        return None
    b = statistics.median(base)
    return fig["median"] / b if b else None


def targets(results: dict[str, Any]) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for the issue's targets, from this run's figures."""
    out: list[tuple[str, str, bool | None]] = []
    work = results.get("workloads", {})
    vec = work.get("vector", {})
    names = list(vec)
    peers = _peers(names)

    def med(w: dict[str, Any], name: str, key: str) -> float | None:
        return w.get(name, {}).get(key, {}).get("median")

    for key, what, floor in (("add", "per-step add", 0.5), ("sample", "sample(256)", 0.8)):
        values = {n: med(vec, n, key) for n in names}
        norms = {n: _normalised(vec[n].get(key, {})) for n in names}
        for mm in ("mmreplay zarr", "mmreplay hdf5"):
            if mm not in vec:
                continue
            r_base, r_peer = _ratios(mm, values, norms, peers, True)
            best = _best(norms if norms.get(mm) is not None else values, peers, True)
            ok = None if r_base is None else (r_base >= floor and (r_peer is None or r_peer > 1))
            out.append(
                (
                    f"vector {what} ≥ {floor}× numpy and ahead of every peer ({mm})",
                    f"{_ratio(r_base)} numpy, {_ratio(r_peer)} best peer ({best[0] if best else '–'})",
                    ok,
                )
            )
    sizes = results.get("reopen_sizes", {})
    for mm in ("mmreplay zarr", "mmreplay hdf5"):
        if mm not in sizes:
            continue
        figs = sizes[mm]
        keys = sorted((k for k in figs if figs[k].get("samples")), key=int)
        if len(keys) < 2:
            continue
        # growth with size, from the medians (every system ran the same number of repeats)
        flat = figs[keys[-1]]["median"] / figs[keys[0]]["median"]
        mid = "1000000" if "1000000" in figs else keys[len(keys) // 2]
        others = {n: sizes[n].get(mid, {}).get("median") for n in sizes if not _is_mmreplay(n)}
        others = {n: v for n, v in others.items() if v is not None}
        mine = figs[mid]["median"]
        ahead = all(mine < v for v in others.values()) if others else None
        closest = min(others.items(), key=lambda kv: kv[1]) if others else None
        out.append(
            (
                f"reopen flat in size and ahead of every other system at {int(mid):.0e} rows ({mm})",
                f"median at {int(keys[-1]):.0e} / median at {int(keys[0]):.0e} rows: {flat:.2f}; "
                f"median {mine:.2f} ms vs " + (f"{closest[1]:.2f} ms ({closest[0]})" if closest else "–"),
                (flat < 1.5 and bool(ahead)) if ahead is not None else None,
            )
        )
    pix = work.get("pixels", {})
    if "mmreplay zarr+zstd" in pix and "mmreplay zarr" in pix:
        disk = pix["mmreplay zarr+zstd"]["disk_bytes"]
        frac = disk["median"] / disk["raw_bytes"]
        n_c, n_u = (_normalised(pix[n].get("sample", {})) for n in ("mmreplay zarr+zstd", "mmreplay zarr"))
        if n_c is not None and n_u is not None:
            r = advantage(n_c, n_u, True)
        else:
            r = advantage(med(pix, "mmreplay zarr+zstd", "sample"), med(pix, "mmreplay zarr", "sample"), True)
        out.append(("compressed pixels: bytes on disk ≤ 1/5 of raw", f"{frac:.3f} of raw", frac <= 0.2))
        out.append(
            (
                "compressed pixels: sample(256) ≥ 0.5× uncompressed",
                f"{_ratio(r)} uncompressed",
                None if r is None else r >= 0.5,
            )
        )
    return out


def markdown(results: dict[str, Any]) -> str:
    m, d = results.get("machine", {}), results.get("disk", {})
    lines = [
        "# mmreplay benchmark",
        "",
        f"Size `{results.get('size')}`, run {results.get('started')}, {results.get('seconds', 0):.0f} s. "
        f"CPU: {m.get('cpu')} ({m.get('cores')} cores), load average at start "
        f"{', '.join(f'{x:.1f}' for x in m.get('load_average_at_start', ()))}, at end "
        f"{', '.join(f'{x:.1f}' for x in results.get('load_average_at_end', ()))}. "
        f"Disk: {d.get('device', '?')} ({d.get('fstype', '?')}"
        + (", rotational" if d.get("rotational") else ", not rotational" if "rotational" in d else "")
        + ").",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items() if v) + ".",
        "",
    ]
    if results.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"{k} ({v})" for k, v in results["skipped"].items()) + ".", ""]
    lines += [
        "Medians over repeated runs. mmreplay cells also give how many times better "
        "(faster or smaller) mmreplay is than numpy-in-RAM and than the best peer of the row: "
        "above 1× is better; every ratio is computed from the numbers shown. "
        "Rates (add, extend, sample) are measured in alternate repeats with a numpy-in-RAM "
        "baseline holding the same data, whose median the mmreplay cell shows (\"numpy's N "
        "beside it\"; the numpy column of those rows is empty), so that load from other "
        "processes changing between systems cancels out. "
        "numpy samples draw the rows as mmreplay does and gather them with one "
        "`take(mode=\"wrap\")` per leaf (no modulo pass on either side); every system's sampled "
        "batches are dropped as soon as they are made.",
        "",
    ]
    sizes = results.get("sizes", {})
    for wname, per in results.get("workloads", {}).items():
        names = list(per)
        cap = sizes.get("capacity", {}).get(wname)
        lines += [f"## {wname} ({cap} steps x 8 envs)" if cap else f"## {wname}", ""]
        lines += _table(_workload_rows(per), names)
        notes = sorted(
            {f"{n}: {k} n/a ({f['na']})" for n, figs in per.items() for k, f in figs.items() if "na" in f}
            | {f"{n}: {k}: {f['note']}" for n, figs in per.items() for k, f in figs.items() if "note" in f}
        )
        if notes:
            lines += [""] + [f"- {x}" for x in notes]
        lines.append("")
    reopen = results.get("reopen_sizes")
    if reopen:
        names = list(reopen)
        all_sizes = sorted({int(k) for figs in reopen.values() for k in figs})
        lines += ["## reopen by size (vector, ms, lower is better)", ""]
        rows = []
        for rows_n in all_sizes:
            values = {n: reopen[n].get(str(rows_n), {}).get("median") for n in names}
            reasons = {
                n: reopen[n][str(rows_n)]["na"] for n in names if "na" in reopen[n].get(str(rows_n), {})
            }
            rows.append((f"{rows_n:.0e} rows", "ms", False, values, reasons, {}))
        lines += _table(rows, names)
        skipped = sorted({f"{n}: {f['na']}" for n in names for f in reopen[n].values() if "na" in f})
        if skipped:
            lines += [""] + [f"- {x}" for x in skipped]
        lines.append("")
    export = results.get("export")
    if export:
        lines += [
            "## export (MB of raw data per s, higher is better)",
            "",
            "| workload | format | MB/s | × numpy savez |",
            "|---|---|---|---|",
        ]
        for wname, figs in export.items():
            base = figs.get("numpy savez", {}).get("median")
            for k, f in figs.items():
                if not isinstance(f, dict):
                    continue
                v = f.get("median")
                cell = "n/a" if v is None else _num(v)
                ratio = _ratio(advantage(v, base, True)) if k != "numpy savez" else ""
                lines.append(f"| {wname} | {k} | {cell} | {ratio} |")
        lines.append("")
    ooc = results.get("out_of_memory")
    if ooc:
        lines += [
            f"## sample(256) with the data out of memory ({ooc['workload']}, {ooc['rows']} rows)",
            "",
            f"Method: {ooc['method']}.",
            "",
            "| store | sample (rows/s) | os.pread of the same rows (rows/s) | × pread |",
            "|---|---|---|---|",
        ]
        for k, f in ooc.items():
            if not isinstance(f, dict) or "sample" not in f:
                continue
            v = f["sample"]["median"]
            p = f.get("pread", {}).get("median")
            lines.append(
                f"| {k} | {_num(v)} | {_num(p) if p else '–'} | {_ratio(advantage(v, p, True)) if p else '–'} |"
            )
        lines.append("")
    tg = targets(results)
    if tg:
        lines += ["## targets", "", "| target | measured | met |", "|---|---|---|"]
        for t, meas, ok in tg:
            lines.append(f"| {t} | {meas} | {'yes' if ok else 'no' if ok is not None else '–'} |")
        lines.append("")
    return "\n".join(lines)
