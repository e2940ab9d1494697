"""Imports flow one way (module level and inside functions), every module has a layer,
and optional frameworks are imported only when used."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys
import tomllib
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mmreplay"

#: every module and package of mmreplay, lowest first: a module imports only from its own
#: layer or earlier ones, and no import chain runs in a circle (docs/architecture.md)
LAYERS = [
    {"errors"},
    {"io"},
    {"spec", "files", "exits", "hooks", "sumtree"},
    {"roles", "values", "spaces", "codecs", "statefile", "lock", "priorities"},
    {"frames_layout"},
    {"metadata"},
    {"read"},
    {"backends"},
    {"episodes", "frames"},
    {"samplers", "joined"},
    {"opening", "ring"},
    {"store"},
    {"creation"},
    {"convert", "verify", "sizes", "torture", "rerun", "selection"},
    {"objstore", "pictures"},
    {"snapshots", "formats"},
    {"group", "demo", "compat", "terminal_images"},
    {"ray"},
]
STORAGE_LIBS = {"zarr", "h5py", "hdf5plugin"}
OPTIONAL = {"torch", "gymnasium", "minari", "d3rlpy", "pyarrow", "datasets", "tensorflow", "matplotlib", "yaml", "pandas", "PIL", "imageio_ffmpeg", "torchrl", "tensordict", "ray", "av", "rerun"}


def layer_of(name: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    return None


def module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path, package: pathlib.Path, inside_functions: bool = True) -> list[tuple[str, int]]:
    """(imported mmreplay module, line) for each import of the file, those inside functions
    too unless told otherwise; ``from .x import name`` counts as ``x.name`` when that is a
    module, else as ``x``."""
    here = module_name(path, package).split(".")
    is_package = path.name == "__init__.py"
    known = {module_name(p, package) for p in package.rglob("*.py")}
    out = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if inside_functions else tree.body:
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == package.name]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and node.module.split(".")[0] == package.name:
                target = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in known else target, node.lineno))
    return out


def top_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(package: pathlib.Path = PACKAGE) -> list[str]:
    """Each import of a later layer, and each module no layer names."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        top = top_of(module_name(path, package))
        if top is None:  # the package's __init__ re-exports from every layer
            continue
        here = layer_of(top)
        if here is None:
            problems.append(f"{path.relative_to(package.parent)}: {top!r} is in no layer of LAYERS")
            continue
        for name, line in imports(path, package):
            there = layer_of(top_of(name) or "")
            if there is not None and there > here:
                problems.append(f"{path.relative_to(package.parent)}:{line} imports {name} (a later layer)")
    return problems


def import_cycles(package: pathlib.Path = PACKAGE) -> list[list[str]]:
    """Circles of modules importing each other (inside functions too), found by Tarjan's
    strongly connected components over the module graph."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in package.rglob("*.py"):
        me = module_name(path, package)
        if me == package.name:
            continue
        for name, _ in imports(path, package):
            if name != me and name != package.name and not me.startswith(name + "."):
                graph[me].add(name)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return cycles


def test_every_module_imports_only_its_layer_or_earlier_ones_even_inside_functions():
    assert not upward_imports(), upward_imports()


def test_no_import_cycles():
    assert not import_cycles(), import_cycles()


def test_the_checks_find_an_upward_import_inside_a_function(tmp_path):
    copy = tmp_path / "mmreplay"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    with open(copy / "spec.py", "a") as f:
        f.write("\n\ndef _late():\n    from .store import Store\n\n    return Store\n")
    assert any("spec.py" in p and "mmreplay.store" in p for p in upward_imports(copy))
    assert any("mmreplay.spec" in c and "mmreplay.store" in c for c in import_cycles(copy))
    (copy / "newcomer.py").write_text("from . import spec\n")
    assert any("'newcomer' is in no layer" in p for p in upward_imports(copy))


def test_every_package_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {module_name(p, PACKAGE) for p in PACKAGE.rglob("__init__.py")} | {"mmreplay.cli"}
    assert found == listed, (found - listed, listed - found)


def external_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level:
        return [node.module or ""]
    return []


def test_only_backends_import_zarr_and_h5py_in_the_core():
    core = {"errors", "spec", "roles", "values", "metadata", "lock", "store", "read", "samplers", "episodes"}
    problems = [
        f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
        for path in PACKAGE.rglob("*.py")
        if top_of(module_name(path, PACKAGE)) in core
        for node in ast.parse(path.read_text()).body
        for name in external_names(node)
        if name.split(".")[0] in STORAGE_LIBS
    ]
    assert not problems, problems


def test_importing_mmreplay_imports_no_optional_framework():
    code = (
        "import sys, mmreplay, mmreplay.compat, mmreplay.formats, mmreplay.cli, mmreplay.pictures, mmreplay.rerun\n"
        "import mmreplay.formats.lerobot\n"
        f"print(sorted(m for m in {sorted(OPTIONAL)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


#: the modules of the Store class: the store and the ring it is (its cursor, writes, commits)
STORE_MODULES = {"store.py": "Store", "ring.py": "Ring"}


def store_fields() -> set[str]:
    """The private attributes a Store sets on itself (``self._x = ...`` in its classes)."""
    fields = set()
    for module, name in STORE_MODULES.items():
        tree = ast.parse((PACKAGE / module).read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        fields |= {
            target.attr
            for node in ast.walk(cls)
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
            and target.attr.startswith("_")
        }
    return fields


def test_no_module_outside_the_store_reaches_into_its_private_fields():
    # parts derived from a store (its read path, its episode index, a framework's view
    # of its leaves) go through store.part(), store.leaves, store.live_state()...
    fields = store_fields()
    assert {"_leaves", "_state_file", "_written", "_floor"} <= fields
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.name in STORE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in fields):
                continue
            owner = node.value
            named = getattr(owner, "id", None) or getattr(owner, "attr", "")
            if named in ("store", "writer", "reader_store") or named.endswith("store"):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {named}.{node.attr}")
    assert not problems, problems
