"""``mmreplay create PATH --spec FILE``: a new, empty store from a JSON or YAML spec."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

import click
import numpy as np

import mmreplay as mr
from mmreplay.codecs import compression_by_leaf
from mmreplay.errors import SpecError
from mmreplay.files import disk_usage
from mmreplay.sizes import SizeEstimate, estimate
from mmreplay.spec import spec_from_json

from .inspect import human_bytes
from .options import LocalPath, backend_option, compression_option, count_option

#: steps of a --sample store read to estimate compressed leaves from (its newest)
SAMPLE_STEPS = 512

SPEC_HELP = """A spec file maps leaf names to {"shape": [...], "dtype": "..."}; nest dicts for
nested leaves, e.g. {"obs": {"shape": [17], "dtype": "float32"}, "reward": {"shape": [],
"dtype": "float32"}}. The file may also give "capacity", "num_envs", "backend",
"compression", "chunk_steps", "commit_every", "durability", "roles" and "frames" (a
mapping of mmreplay.Frames' settings) beside a "spec" key; options on the command line win. A compression codec alone applies to the image
leaves (pictures such as [84, 84, 3]); LEAF=CODEC, or a mapping in the file, names a leaf
(e.g. --compression obs/pixels=rows:lz4 --compression reward=none)."""


def _plain_spec(obj: Any, where: str) -> Any:
    """The spec JSON mmreplay writes ({"dict": ...}) or the plain nested-dict form."""
    if isinstance(obj, dict) and (isinstance(obj.get("dtype"), str) or _is_shape(obj.get("shape"))):
        missing = [key for key in ("shape", "dtype") if key not in obj]
        unknown = sorted(set(obj) - {"shape", "dtype", "name"}, key=str)
        if missing or unknown:
            raise SpecError(
                f'{where}: a leaf is {{"shape": [...], "dtype": "..."}} with an optional "name"; '
                + (f"{missing[0]!r} is missing" if missing else f"unknown keys {unknown}")
            )
        return spec_from_json(obj, where)
    if isinstance(obj, dict) and ("dict" in obj or "tuple" in obj or "list" in obj or "namedtuple" in obj):
        return spec_from_json(obj)
    if isinstance(obj, dict):
        if not obj:
            raise SpecError(f"{where}: the spec is empty")
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:  # YAML reads yes / on as True, ~ as None: a leaf named 'True' was never meant
            raise SpecError(f"{where}: leaf name {bad[0]!r} is not a string; quote it in the file")
        return {k: _plain_spec(v, f"{where}/{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return tuple(_plain_spec(v, f"{where}/{i}") for i, v in enumerate(obj))
    raise SpecError(f"{where}: expected a mapping of leaf names to {{shape, dtype}}, got {obj!r:.80}")


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(type(d) is int for d in value)


def load_spec_file(path: str) -> dict[str, Any]:
    """The spec file's content as a dict (YAML for a .yaml / .yml file, else JSON)."""
    if os.path.isdir(path):
        raise mr.BadInputError(f"{path}: is a folder; expected a spec file of JSON or YAML")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: spec file not found")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise mr.BadInputError(f"{path}: not a UTF-8 text file of JSON or YAML ({exc.reason} at byte {exc.start})") from None
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as exc:
            raise ImportError("YAML spec files need PyYAML: pip install 'mmreplay[yaml]'") from exc
        try:
            obj = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise mr.BadInputError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    else:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise mr.BadInputError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise mr.BadInputError(f"{path}: expected a JSON/YAML object at the top, got {type(obj).__name__}")
    return obj


@click.command("create", epilog=SPEC_HELP)
@click.argument("path", type=LocalPath())
@click.option("--spec", "spec_file", required=True, type=click.Path(), help="JSON or YAML spec file.")
@count_option("--capacity", "Steps the ring holds.")
@count_option("--num-envs", "Parallel envs per step [1].")
@backend_option()
@compression_option
@count_option("--chunk-steps")
@count_option("--commit-every")
@click.option("--durability", type=click.Choice(["process", "power"]), default=None)
@click.option(
    "--frames",
    multiple=True,
    metavar="KEY=VALUE",
    help="Store each frame once, with this mmreplay.Frames setting (e.g. frame_stack=4); repeat for several.",
)
@click.option(
    "--dry-run", is_flag=True, help="Only report the bytes the buffer will take when full; create nothing."
)
@click.option(
    "--sample",
    type=click.Path(exists=True),
    default=None,
    help="With --dry-run: an .npz of rows keyed by leaf path, or a store, to estimate compressed leaves from.",
)
def command(path: str, spec_file: str, dry_run: bool, sample: str | None, **options: Any) -> None:
    """Create an empty store at PATH from the spec in FILE (with --dry-run, report its
    size when full instead)."""
    obj = load_spec_file(spec_file)
    settings = {k: v for k, v in obj.items() if k != "spec"} if "spec" in obj else {}
    spec = _plain_spec(obj["spec"] if "spec" in obj else obj, "spec")
    known = {
        "capacity",
        "num_envs",
        "backend",
        "compression",
        "chunk_steps",
        "commit_every",
        "durability",
        "roles",
        "frames",
    }
    unknown = sorted(set(settings) - known)
    if unknown:
        raise mr.BadInputError(f"{spec_file}: unknown settings {unknown}; expected some of {sorted(known)}")
    given_frames = options.pop("frames")
    settings.update({k: v for k, v in options.items() if v is not None and v != ()})
    if "compression" in settings:
        settings["compression"] = compression_by_leaf(settings["compression"], spec)
    if settings.get("frames") is not None or given_frames:  # (the file's null: no frames)
        settings["frames"] = _frames(settings.get("frames") or {}, given_frames)
    if "capacity" not in settings:
        raise click.UsageError("give --capacity (or 'capacity' in the spec file)")
    capacity = settings.pop("capacity")
    if dry_run:
        size = estimate(spec, capacity, **_estimate_settings(settings), sample=load_sample(sample))
        click.echo(render_estimate(size, path))
        return
    if sample is not None:
        raise click.UsageError("--sample applies to --dry-run only")
    try:
        store = mr.create(path, spec, capacity, **settings)
    except mr.BufferExistsError:  # (the library's advice, exist_ok=True, is no option here)
        raise FileExistsError(f"{path}: already exists; choose a new path for the store") from None
    with store:
        leaves = ", ".join(
            f"{p} {leaf.spec.shape} {leaf.spec.dtype}"
            for p, leaf in zip(store.leaf_paths, (leaf.info for leaf in store.leaves))
        )
        click.echo(
            f"created {os.path.abspath(path)}: {store.backend}, capacity {store.capacity:,} x {store.num_envs} envs; "
            f"leaves {leaves}; roles {store.roles or 'none'}; {human_bytes(disk_usage(path))} preallocated"
        )


def _estimate_settings(settings: dict[str, Any]) -> dict[str, Any]:
    keys = ("num_envs", "backend", "compression", "chunk_steps", "commit_every", "roles", "frames")
    return {k: settings[k] for k in keys if k in settings}


def _frames(given: Any, items: tuple[str, ...]) -> mr.Frames:
    """The spec file's mapping with the command line's KEY=VALUE settings over it (values
    read as JSON: frame_stack=4, stack_axis=0, pad=zeros), as an mmreplay.Frames."""
    keys = [f.name for f in dataclasses.fields(mr.Frames)]
    if isinstance(given, dict):
        for text in items:
            key, eq, value = text.partition("=")
            if not eq:
                raise mr.BadInputError(f"--frames {text!r}: expected KEY=VALUE, e.g. frame_stack=4")
            given = {**given, key: _json_or_text(value)}
    if not isinstance(given, dict) or set(given) - set(keys):
        unknown = sorted(set(given) - set(keys)) if isinstance(given, dict) else given
        raise mr.BadInputError(f"frames: expected settings among {keys}, got {unknown!r}")
    return mr.Frames(**given)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def load_sample(path: str | None) -> Any:
    """Rows to estimate compressed leaves from: an .npz keyed by leaf path, or the
    newest steps of a store."""
    if path is None:
        return None
    if os.path.isdir(path):
        with mr.open(path, mode="r") as store:
            newest = store.first_step + np.arange(max(0, len(store) - SAMPLE_STEPS), len(store))
            return dict(zip(store.leaf_paths, store.read_steps(newest)))
    expected = f"{path}: expected an .npz of arrays keyed by leaf path, or a store"
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":  # (np.load reads an .npy as one array and anything else as a pickle)
        found = "an .npy of one array" if magic == b"\x93NUM" else f"a file starting {magic!r}"
        raise mr.BadInputError(f"{expected}; got {found}")
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as exc:
        raise mr.BadInputError(f"{expected} ({exc})") from None


def render_estimate(size: SizeEstimate, path: str) -> str:
    """The --dry-run report."""
    total = size.total
    head = (
        f"{path}: {size.backend}, capacity {size.capacity:,} x {size.num_envs} envs; when full "
        + (
            f"{human_bytes(total)} ({total:,} bytes" + (", exact)" if size.exact else ", estimated)")
            if total is not None
            else f"at most {human_bytes(size.upper_bound)} (compressed leaves without a sample at their worst case)"
        )
        + f"; preallocated at creation {human_bytes(size.preallocated)}"
    )
    rows = [("leaf", "compression", "raw", "on disk when full")]
    for leaf in size.leaves:
        if leaf.bytes is None:
            disk = "? (pass --sample)"
        else:
            disk = human_bytes(leaf.bytes) + ("" if leaf.exact else f" (est., {leaf.ratio:.1f}x)")
        rows.append((leaf.path, leaf.compression or "none (mapped)", human_bytes(leaf.raw_bytes), disk))
    rows.append(("metadata", "", "", human_bytes(size.overhead)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [head, ""] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(parent):
        free = shutil.disk_usage(parent).free
        verdict = "enough" if size.preallocated <= free else "too little: create would refuse"
        lines.append(f"  free space in {parent}: {human_bytes(free)} ({verdict})")
    return "\n".join(lines)
