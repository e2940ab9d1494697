"""``mmreplay create PATH --spec FILE``: a new, empty store from a JSON or YAML spec."""

from __future__ import annotations

import json
import os
from typing import Any

import click

import mmreplay as mr
from mmreplay.codecs import STORE_HELP
from mmreplay.errors import SpecError
from mmreplay.spec import spec_from_json

SPEC_HELP = """A spec file maps leaf names to {"shape": [...], "dtype": "..."}; nest dicts for
nested leaves, e.g. {"obs": {"shape": [17], "dtype": "float32"}, "reward": {"shape": [],
"dtype": "float32"}}. The file may also give "capacity", "num_envs", "backend",
"compression", "chunk_steps", "commit_every", "durability" and "roles" beside a "spec"
key; options on the command line win."""


def _plain_spec(obj: Any, where: str) -> Any:
    """The spec JSON mmreplay writes ({"dict": ...}) or the plain nested-dict form."""
    if isinstance(obj, dict) and (
        "dict" in obj or "tuple" in obj or "list" in obj or "namedtuple" in obj or "dtype" in obj
    ):
        return spec_from_json(obj)
    if isinstance(obj, dict):
        if not obj:
            raise SpecError(f"{where}: the spec is empty")
        return {str(k): _plain_spec(v, f"{where}/{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return tuple(_plain_spec(v, f"{where}/{i}") for i, v in enumerate(obj))
    raise SpecError(f"{where}: expected a mapping of leaf names to {{shape, dtype}}, got {obj!r:.80}")


def load_spec_file(path: str) -> dict[str, Any]:
    """The spec file's content as a dict (JSON, or YAML by extension or content)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: spec file not found")
    with open(path) as f:
        text = f.read()
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
@click.argument("path", type=click.Path())
@click.option("--spec", "spec_file", required=True, type=click.Path(), help="JSON or YAML spec file.")
@click.option("--capacity", type=click.IntRange(min=1), default=None, help="Steps the ring holds.")
@click.option("--num-envs", type=click.IntRange(min=1), default=None, help="Parallel envs per step [1].")
@click.option("--backend", type=click.Choice(["zarr", "hdf5"]), default=None, help="[zarr]")
@click.option("--compression", default=None, metavar="CODEC[:LEVEL]", help=f"Codec for every leaf. {STORE_HELP}.")
@click.option("--chunk-steps", type=click.IntRange(min=1), default=None)
@click.option("--commit-every", type=click.IntRange(min=1), default=None)
@click.option("--durability", type=click.Choice(["process", "power"]), default=None)
def command(path: str, spec_file: str, **options: Any) -> None:
    """Create an empty store at PATH from the spec in FILE."""
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
    }
    unknown = sorted(set(settings) - known)
    if unknown:
        raise mr.BadInputError(f"{spec_file}: unknown settings {unknown}; expected some of {sorted(known)}")
    settings.update({k: v for k, v in options.items() if v is not None})
    if "capacity" not in settings:
        raise click.UsageError("give --capacity (or 'capacity' in the spec file)")
    capacity = settings.pop("capacity")
    with mr.create(path, spec, capacity, **settings) as store:
        leaves = ", ".join(
            f"{p} {leaf.spec.shape} {leaf.spec.dtype}"
            for p, leaf in zip(store.leaf_paths, store.metadata.leaves)
        )
        click.echo(
            f"created {os.path.abspath(path)}: {store.backend}, capacity {store.capacity:,} x {store.num_envs} envs; "
            f"leaves {leaves}; roles {store.roles or 'none'}"
        )
