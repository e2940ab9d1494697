"""Imports flow one way, and optional frameworks are imported only when used."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mmreplay"

#: layers in import order: a module may import only from its own layer or earlier ones
LAYERS = [
    {"errors"},
    {"spec"},
    {"roles", "values", "spaces"},
    {"io"},
    {"metadata", "lock", "files", "statefile"},
    {"read"},
    {"backends"},
    {"hooks", "priorities", "sumtree"},
    {"episodes"},
    {"samplers"},
    {"store", "exits", "objstore", "joined"},
    {"convert"},
    {"formats"},
    {"snapshots", "compat", "verify", "torture", "demo", "view", "sizes", "terminal_images", "group", "ray", "rerun"},
]
#: modules whose imports inside functions are held to the layers too
WHOLLY_LAYERED = {"spaces", "formats"}
STORAGE_LIBS = {"zarr", "h5py", "hdf5plugin"}
OPTIONAL = {"torch", "gymnasium", "minari", "d3rlpy", "pyarrow", "datasets", "tensorflow", "matplotlib", "yaml", "pandas", "PIL", "imageio_ffmpeg", "torchrl", "tensordict", "ray", "av", "rerun"}


def layer_of(name: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    return None


def top_level_imports(path: pathlib.Path, inside_functions: bool = False) -> list[tuple[str, int]]:
    """(imported name, line) for imports executed when the module loads (and, with
    ``inside_functions``, those in its functions too)."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree) if inside_functions else tree.body:
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                rel = path.relative_to(PACKAGE).with_suffix("").parts[:-1]
                base = list(rel[: len(rel) - (node.level - 1)]) if node.level > 1 else list(rel)
                mod = ".".join(["mmreplay", *base, *(node.module.split(".") if node.module else [])])
                names = [mod] if node.module else [f"{mod}.{a.name}" for a in node.names]
                out += [(n, node.lineno) for n in names]
            else:
                out.append((node.module or "", node.lineno))
    return out


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield path, parts[0] if parts[0] != "__init__" else None


def test_core_modules_import_only_earlier_layers():
    problems = []
    for path, top in modules():
        here = layer_of(top) if top else None
        if here is None:
            continue
        for name, line in top_level_imports(path, inside_functions=top in WHOLLY_LAYERED):
            parts = name.split(".")
            if parts[0] != "mmreplay" or len(parts) < 2:
                continue
            there = layer_of(parts[1])
            if there is not None and there > here:
                problems.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not problems, problems


def test_only_backends_import_zarr_and_h5py_in_the_core():
    core = {"errors", "spec", "roles", "values", "metadata", "lock", "store", "read", "samplers", "episodes"}
    problems = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path, top in modules()
        if top in core
        for name, line in top_level_imports(path)
        if name.split(".")[0] in STORAGE_LIBS
    ]
    assert not problems, problems


def test_importing_mmreplay_imports_no_optional_framework():
    code = (
        "import sys, mmreplay, mmreplay.compat, mmreplay.formats, mmreplay.cli, mmreplay.view, mmreplay.rerun\n"
        "import mmreplay.formats.lerobot\n"
        f"print(sorted(m for m in {sorted(OPTIONAL)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def store_fields() -> set[str]:
    """The private attributes a Store sets on itself (``self._x = ...`` in store.py)."""
    tree = ast.parse((PACKAGE / "store.py").read_text())
    store = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Store")
    return {
        target.attr
        for node in ast.walk(store)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
        and target.attr.startswith("_")
    }


def test_no_module_outside_the_store_reaches_into_its_private_fields():
    # parts derived from a store (its read path, its episode index, a framework's view
    # of its leaves) go through store.part(), store.leaves, store.live_state()...
    fields = store_fields()
    assert {"_leaves", "_state_file"} <= fields
    problems = []
    for path, _ in modules():
        if path == PACKAGE / "store.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in fields):
                continue
            owner = node.value
            named = getattr(owner, "id", None) or getattr(owner, "attr", "")
            if named in ("store", "writer", "reader_store") or named.endswith("store"):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {named}.{node.attr}")
    assert not problems, problems
