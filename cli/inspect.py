"""``mmreplay inspect PATH``: what is in a buffer, how full, how stored.

Opens the buffer read-only (no lock), so it works while a writer is running; it shows
the last committed state.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
from typing import Any

import click

import mmreplay as mr
from mmreplay.files import disk_usage
from mmreplay.metadata import FORMAT_NAME
from mmreplay.pictures import png_bytes, thumbnails
from mmreplay.roles import subtree
from mmreplay.selection import frame_leaves
from mmreplay.terminal_images import image_protocol, terminal_image

from . import is_group_folder


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _hdf5_storage(folder: str, leaves: list[Any]) -> dict[str, int]:
    """Bytes each compressed HDF5 leaf takes in the file (read-only, SWMR-safe)."""
    paths = [leaf.path for leaf in leaves if not leaf.mapped]
    if not paths:
        return {}
    try:
        from mmreplay.backends.h5chunks import open_swmr_reader
        from mmreplay.backends.hdf5 import DATA_FILE, leaf_dataset
        from mmreplay.io.local import checked_inside

        path = checked_inside(folder, DATA_FILE)
        with open_swmr_reader(path) as f:
            return {p: int(leaf_dataset(f, p, path).id.get_storage_size()) for p in paths}
    except Exception:
        return {}


def object_sizes(store: mr.Store) -> dict[str, int] | None:
    """Key -> bytes of every object of a store in object storage (None: a local store)."""
    location = store.location
    return None if location is None else location.list()


def _bytes_under(sizes: dict[str, int], prefix: str) -> int:
    return sum(n for key, n in sizes.items() if key.startswith(prefix))


def leaf_bytes(store: mr.Store, sizes: dict[str, int] | None = None) -> dict[str, int | None]:
    """Bytes on disk (or in object storage, given its ``sizes``) per leaf path."""
    meta = store.metadata
    out: dict[str, int | None] = {}
    if sizes is not None:
        return {leaf.path: _bytes_under(sizes, f"data.zarr/{leaf.path}/") for leaf in meta.leaves}
    h5 = _hdf5_storage(store.path, list(meta.leaves)) if meta.backend == "hdf5" else {}
    for leaf in meta.leaves:
        if meta.backend == "zarr":
            out[leaf.path] = disk_usage(os.path.join(store.path, "data.zarr", leaf.path))
        elif leaf.mapped:
            out[leaf.path] = meta.capacity * meta.num_envs * leaf.spec.nbytes
        else:
            out[leaf.path] = h5.get(leaf.path)
    return out


def describe(store: mr.Store) -> dict[str, Any]:
    """Everything ``inspect`` shows, as JSON-able data."""
    meta = store.metadata
    state = store.state
    n = len(store)
    spans = store.episode_index()
    statuses = [s.status for s in spans]
    sizes = object_sizes(store)
    on_disk = leaf_bytes(store, sizes)
    leaves = []
    # slots holding rows: in a frames store (whose steps start at 0) more than the steps
    # retained where its side ring dropped steps (or its oldest stacks lost earlier frames)
    written = min(state.end, meta.capacity) if meta.frames is not None else n
    for leaf in meta.leaves:
        raw = written * meta.num_envs * leaf.spec.nbytes
        disk = on_disk.get(leaf.path)
        ratio = None
        if leaf.compression is not None and disk and raw:
            ratio = round(raw / disk, 2)
        fixed = _fixed_bytes(store, leaf) if sizes is None else sizes.get(f"data.zarr/{leaf.path}/zarr.json", 0)
        per_step, when_full = _projection(leaf, meta, disk, written, fixed)
        leaves.append(
            {
                "path": leaf.path,
                "shape": list(leaf.spec.shape),
                "dtype": leaf.spec.dtype.name,
                "chunk_steps": leaf.chunk_steps,
                "chunks": [leaf.chunk_steps, meta.num_envs, *leaf.spec.shape],
                "compression": leaf.compression,
                "mapped": leaf.mapped,
                "bytes_on_disk": disk,
                "bytes_stored": raw,
                "compression_ratio": ratio,
                "bytes_per_step": per_step,
                "projected_bytes_when_full": when_full,
            }
        )
    known = [leaf["projected_bytes_when_full"] for leaf in leaves]
    total = disk_usage(store.path) if sizes is None else _bytes_under(sizes, "")
    other = total - sum(d or 0 for d in on_disk.values())  # metadata, episode index, journal
    return {
        "path": os.path.abspath(store.path) if sizes is None else store.path,
        "format": f"{FORMAT_NAME}/{meta.format_version}",
        "backend": meta.backend,
        "capacity": meta.capacity,
        "num_envs": meta.num_envs,
        "steps": n,
        "rows": n * meta.num_envs,
        "fill": n / meta.capacity,
        "first_step": store.first_step,
        "cursor": state.end % meta.capacity,
        "total_steps": state.end,
        "wrapped": state.end > meta.capacity,
        "commits": state.commits,
        "last_commit": state.commit_time,
        "commit_every": meta.commit_every,
        "durability": meta.durability,
        "roles": dict(meta.roles),
        "episodes": {
            "total": len(spans),
            "complete": sum(s != "open" for s in statuses),
            "open": statuses.count("open"),
            "terminated": statuses.count("terminated"),
            "truncated": statuses.count("truncated"),
        },
        "leaves": leaves,
        "bytes_on_disk": total,
        "bytes_per_step": None if None in known else sum(leaf["bytes_per_step"] for leaf in leaves),
        "projected_bytes_when_full": None if None in known else sum(known) + other,
        "frame_leaves": frame_leaves(store),
        "frames": _frames_layout(store),
        "decode_threads": _decode_threads(store, meta),
    }


def _frames_layout(store: mr.Store) -> dict[str, Any] | None:
    """How a store that keeps each frame once keeps its observations (None: as given),
    each observation leaf with the shape it is read with."""
    layout = store.metadata.frames
    if layout is None:
        return None
    out = {k: v for k, v in layout.to_json().items() if k != "side"}
    for pair in out["pairs"]:
        pair["shape"] = list(subtree(store.spec, pair["observation"]).shape)
    return out


def _frames_text(f: dict[str, Any]) -> str:
    texts = []
    for p in f["pairs"]:
        text = f"{p['observation']} {tuple(p['shape'])}"
        if f["frame_stack"] > 1:
            text += (
                f": a stack of {f['frame_stack']} frames (axis {p['stack_axis']}, {f['pad']} padding) "
                "of which each row stores the newest"
            )
        if p["next_observation"] is not None:
            text += "; " if f["frame_stack"] > 1 else ": "
            text += p["next_observation"] + (
                f" derived from the next step, final ones in a side ring of {f['final_slots']} frames"
                if f["next_observation"] == "derived"
                else " stored"
            )
        texts.append(text)
    return "; ".join(texts)


def _decode_threads(store: mr.Store, meta: Any) -> dict[str, Any] | None:
    """The threads a batch of the row-frame leaves decodes on in this process, and why
    (None: no row-frame leaf)."""
    if not any((leaf.compression or "").startswith("rows:") for leaf in meta.leaves):
        return None
    chosen = store.decode_threads
    return {**chosen._asdict(), "text": str(chosen)}


def _projection(
    leaf: Any, meta: Any, disk: int | None, steps: int, fixed: int
) -> tuple[float | None, int | None]:
    """Bytes per step (all envs) and the leaf's bytes when full: a mapped leaf is
    allocated whole; a compressed one keeps the bytes per step it has so far (its
    metadata, ``fixed``, counted once)."""
    if leaf.compression is None:  # its layout's padding and index included
        return (meta.num_envs * leaf.spec.nbytes if disk is None else disk / meta.capacity), disk
    if disk is None or not steps:
        return None, None
    per_step = max(0, disk - fixed) / steps
    return per_step, fixed + round(per_step * meta.capacity)


def _fixed_bytes(store: mr.Store, leaf: Any) -> int:
    """Bytes of a zarr leaf's own metadata file, which does not grow with its steps."""
    if store.metadata.backend != "zarr":
        return 0
    try:
        return os.path.getsize(os.path.join(store.path, "data.zarr", leaf.path, "zarr.json"))
    except OSError:
        return 0


def _when(t: float | None) -> str:
    if t is None:
        return "never"
    stamp = datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")
    ago = time.time() - t
    if ago < 120:
        rel = f"{ago:.0f} s ago"
    elif ago < 7200:
        rel = f"{ago / 60:.0f} min ago"
    elif ago < 172800:
        rel = f"{ago / 3600:.0f} h ago"
    else:
        rel = f"{ago / 86400:.0f} days ago"
    return f"{stamp} ({rel})"


def render(info: dict[str, Any]) -> str:
    """The human-readable table."""
    ep = info["episodes"]
    lines = [
        f"{info['path']}",
        f"  format        {info['format']}, backend {info['backend']}, durability {info['durability']}",
        f"  capacity      {info['capacity']:,} steps x {info['num_envs']} envs",
        f"  committed     {info['steps']:,} steps ({info['rows']:,} rows), {info['fill']:.1%} full"
        + (", wrapped" if info["wrapped"] else ""),
        "  steps         "
        + (
            f"{info['first_step']:,} .. {info['total_steps'] - 1:,} retained; "
            if info["steps"]
            else "none retained; "
        )
        + f"{info['total_steps']:,} added in all; cursor at slot {info['cursor']:,}",
        f"  commits       {info['commits']:,}, last {_when(info['last_commit'])}; every {info['commit_every']:,} steps",
        f"  episodes      {ep['total']:,}: {ep['complete']:,} complete ({ep['terminated']:,} terminated, "
        f"{ep['truncated']:,} truncated), {ep['open']:,} open",
        "  roles         " + (", ".join(f"{r}={p}" for r, p in info["roles"].items()) or "none"),
        f"  on disk       {human_bytes(info['bytes_on_disk'])}; when full "
        + (
            f"{human_bytes(info['projected_bytes_when_full'])} ({human_bytes(info['bytes_per_step'])} per step)"
            if info["projected_bytes_when_full"] is not None
            else "? (no compressed data yet)"
        ),
    ]
    if info["frames"] is not None:
        lines.append(f"  frames once   {_frames_text(info['frames'])}")
    if info["decode_threads"] is not None:
        lines.append(f"  decoding      row frames on {info['decode_threads']['text']}")
    lines.append("")
    head = ("leaf", "shape", "dtype", "chunks", "compression", "on disk", "ratio", "per step", "when full")
    rows = [
        (
            leaf["path"],
            "(" + ", ".join(map(str, leaf["shape"])) + ("," if len(leaf["shape"]) == 1 else "") + ")",
            leaf["dtype"],
            "x".join(map(str, leaf["chunks"])),
            leaf["compression"] or "none (mapped)",
            human_bytes(leaf["bytes_on_disk"]),
            "-" if leaf["compression_ratio"] is None else f"{leaf['compression_ratio']:.1f}x",
            human_bytes(leaf["bytes_per_step"]),
            human_bytes(leaf["projected_bytes_when_full"]),
        )
        for leaf in info["leaves"]
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


@click.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.option(
    "--images/--no-images",
    default=True,
    help="Thumbnails of the newest frames in kitty / iTerm2 terminals [on].",
)
def command(path: str, as_json: bool, images: bool) -> None:
    """Show what is in the buffer at PATH: size, fill, episodes, leaves and storage.

    Read-only; safe while a writer is running (shows its last commit). In a terminal
    that shows images (kitty, iTerm2, WezTerm), also the newest frames of env 0.

    PATH may be a group's folder: each shard is shown in turn.
    """
    if is_group_folder(path):
        with mr.open_group(path) as group:
            shards = [describe(store) for store in group.shards]
            if as_json:
                doc = {"group": path, "num_shards": group.num_shards, "steps": len(group), "shards": shards}
                click.echo(json.dumps(doc, indent=1, default=_json_default))
                return
            click.echo(f"group {path}: {group.num_shards} shards, {len(group):,} steps x {group.num_envs} envs")
            for store, info in zip(group.shards, shards):
                click.echo(render({**info, "path": store.path}))
        return
    with mr.open(path, mode="r") as store:
        info = describe(store)
        if as_json:
            click.echo(json.dumps(info, indent=1, default=_json_default))
            return
        click.echo(render({**info, "path": path}))
        if info["frame_leaves"]:
            click.echo(_frames_line(store, path, info["frame_leaves"][0], images))


def _frames_line(store: mr.Store, path: str, leaf: str, images: bool) -> str:
    """Thumbnails of the newest frames where the terminal shows images, else where to
    find them."""
    hint = (
        f"  frames        {leaf}: see them with `mmreplay view {path} -o episode.gif` (.png: a contact sheet)"
    )
    protocol = image_protocol(os.environ, sys.stdout.isatty()) if images else None
    if protocol is None or not len(store):
        return hint
    try:
        found = thumbnails(store, leaf=leaf)
    except ImportError:
        return hint + "; pip install 'mmreplay[view]' for thumbnails here"
    if found is None:
        return hint
    return f"  newest frames of env 0, {leaf}:\n" + terminal_image(png_bytes(found[1]), protocol).rstrip("\n")


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    raise TypeError(f"not JSON-able: {type(x).__name__}")
