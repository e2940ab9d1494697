"""Untrusted buffers: nothing is unpickled or executed, absurd metadata is refused before
anything is allocated, leaf paths stay inside the buffer, exports stay inside their target."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import make_step, verify_cli

import mmreplay as mr
from mmreplay.metadata import METADATA_FILE

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "mmreplay").rglob("*.py"), *(ROOT / "cli").rglob("*.py")])
UNSAFE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "dill",
    "cloudpickle",
    "shelve",
    "marshal",
    "joblib",
    "jsonpickle",
}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            yield owner, name, {k.arg: k.value for k in node.keywords}, node


def test_no_pickle_and_no_code_execution_anywhere():
    problems = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        where = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                problems += [
                    f"{where}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] in UNSAFE_MODULES
                ]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
                problems.append(f"{where}:{node.lineno} imports from {node.module}")
        for owner, name, kw, node in _calls(tree):
            line = f"{where}:{node.lineno}"
            if name in ("eval", "exec") and not owner:
                problems.append(f"{line} calls {name}")
            if "allow_pickle" in kw and not (
                isinstance(kw["allow_pickle"], ast.Constant) and kw["allow_pickle"].value is False
            ):
                problems.append(f"{line} passes allow_pickle other than False")
            if name == "load" and owner in ("np", "numpy") and "allow_pickle" not in kw:
                problems.append(f"{line} calls {owner}.load without allow_pickle=False")
            if name == "load" and owner == "torch":
                w = kw.get("weights_only")
                if not (isinstance(w, ast.Constant) and w.value is True):
                    problems.append(f"{line} calls torch.load without weights_only=True")
    assert not problems, problems


# --- absurd metadata ------------------------------------------------------------------


def _buffer(tmp_path, **kw) -> str:
    os.makedirs(tmp_path, exist_ok=True)
    path = str(tmp_path / "b")
    spec = {"x": mr.ArraySpec((3,), "float32"), "y": mr.ArraySpec((), "int64")}
    with mr.create(path, spec, capacity=10, **kw) as store:
        store.add({"x": np.ones((1, 3), "float32"), "y": np.ones(1, "int64")})
    return path


def _edit(path, change) -> None:
    """Hand-edit the metadata (dropping the checksum, as a deliberate edit must)."""
    meta_path = os.path.join(path, METADATA_FILE)
    with open(meta_path) as f:
        obj = json.load(f)
    obj.pop("checksum")
    change(obj)
    with open(meta_path, "w") as f:
        json.dump(obj, f)


def _leaf(obj, i=0):
    return obj["leaves"][i]


def _both(key, value):
    def change(obj):
        obj["spec"]["dict"]["x"][key] = value
        _leaf(obj)[key] = value

    return change


ABSURD = {
    "capacity 2**60": lambda o: o.update(capacity=2**60),
    "capacity 2**39 (accepted by the parser, larger than the files)": lambda o: o.update(capacity=2**39),
    "capacity 0": lambda o: o.update(capacity=0),
    "capacity -1": lambda o: o.update(capacity=-1),
    "capacity 1.5": lambda o: o.update(capacity=1.5),
    "capacity true": lambda o: o.update(capacity=True),
    "capacity '10'": lambda o: o.update(capacity="10"),
    "capacity null": lambda o: o.update(capacity=None),
    "num_envs 2**40": lambda o: o.update(num_envs=2**40),
    "num_envs 1000 (larger than the files)": lambda o: o.update(num_envs=1000),
    "num_envs 0": lambda o: o.update(num_envs=0),
    "shape [2**40, 2**40]": _both("shape", [2**40, 2**40]),
    "shape [10**6] (larger than the files)": _both("shape", [10**6]),
    "shape [-3]": _both("shape", [-3]),
    "shape 40 dims": _both("shape", [1] * 40),
    "shape not a list": _both("shape", "3"),
    "dtype object": _both("dtype", "object"),
    "dtype void": _both("dtype", "V8"),
    "dtype string": _both("dtype", "U4"),
    "dtype with code": _both("dtype", "__import__('os')"),
    "chunk_steps 0": lambda o: _leaf(o).update(chunk_steps=0),
    "chunk_steps past capacity": lambda o: _leaf(o).update(chunk_steps=11),
    "offset negative": lambda o: _leaf(o).update(offset=-1),
    "offset past the file": lambda o: _leaf(o).update(offset=2**40),
    "offset on a compressed leaf": lambda o: _leaf(o).update(compression="zstd"),
    "leaves missing": lambda o: o.pop("leaves"),
    "leaves not matching the spec": lambda o: o["leaves"].reverse(),
    "attrs_generation missing": lambda o: o.pop("attrs_generation"),
    "attrs_generation not committed": lambda o: o.update(attrs_generation=7),
    "backend unknown": lambda o: o.update(backend="pickle"),
    "format missing": lambda o: o.pop("format"),
    "format other": lambda o: o.update(format="numpy/1"),
    "roles not a dict": lambda o: o.update(roles=["obs"]),
    "metadata a list": lambda o: (o.clear(), o.update({"__list__": 1})),
}


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_absurd_metadata_is_refused_before_anything_is_allocated(tmp_path, backend):
    """Opened in a process whose address space is capped at 1 GiB: each refusal must come
    from a check, never from an allocation or a mapping of the absurd size."""
    paths = {}
    for i, (what, change) in enumerate(sorted(ABSURD.items())):
        paths[what] = _buffer(tmp_path / str(i), backend=backend)
        _edit(paths[what], change)
    sizes = _snapshot(tmp_path)
    code = textwrap.dedent("""
        import json, resource, sys
        import mmreplay as mr
        from mmreplay.verify import verify
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        out = {}
        for what, path in json.loads(sys.argv[1]).items():
            seen = []
            for mode in ("r", "a"):
                try:
                    mr.open(path, mode).close()
                    seen.append("OPENED")
                except mr.CorruptBufferError:
                    seen.append("refused")
            seen.append(len(verify(path)))
            out[what] = seen
        print(json.dumps(out))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(paths)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    wrong = {what: s for what, s in seen.items() if s[:2] != ["refused", "refused"] or s[2] == 0}
    assert not wrong, wrong
    assert _snapshot(tmp_path) == sizes


def test_deeply_nested_metadata_is_refused(tmp_path):
    path = _buffer(tmp_path)
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        f.write('{"a":' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(mr.CorruptBufferError, match="nested too deeply"):
        mr.open(path)


def test_oversized_metadata_is_refused_without_reading_it_all(tmp_path):
    path = _buffer(tmp_path)
    with open(os.path.join(path, METADATA_FILE), "wb") as f:
        f.truncate(65 << 20)  # sparse: costs no disk
    with pytest.raises(mr.CorruptBufferError, match="larger than"):
        mr.open(path)


def test_spec_names_never_run_code(tmp_path):
    path = _buffer(tmp_path)
    marker = tmp_path / "ran"

    def change(obj):
        obj["spec"] = {
            "namedtuple": f"__import__('os').system('touch {marker}')",
            "fields": obj["spec"]["dict"],
        }

    _edit(path, change)
    with pytest.raises(mr.CorruptBufferError, match="not a valid identifier"):
        mr.open(path)
    assert not marker.exists()


# --- leaf paths -----------------------------------------------------------------------

BAD_KEYS = ["..", ".", "", "a/b", "/etc", "a\\b", "nul\x00", "../../x"]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_leaf_names_that_could_leave_the_folder_are_refused_at_create(tmp_path, key):
    with pytest.raises(mr.SpecError):
        mr.create(tmp_path / "b", {key: mr.ArraySpec((), "int64")}, capacity=4)
    with pytest.raises(mr.SpecError):
        mr.create(tmp_path / "b", {"obs": {key: mr.ArraySpec((), "int64")}}, capacity=4)
    assert os.listdir(tmp_path) == []


LEAF_PATHS = ["../x", "x/../../y", "/abs", "x//y", "a\\b", "./x", "x/", ""]


@pytest.mark.parametrize("leaf_path", LEAF_PATHS)
@pytest.mark.parametrize("field", ["path", "file"])
def test_leaf_paths_in_metadata_that_leave_the_folder_are_refused(tmp_path, leaf_path, field):
    path = _buffer(tmp_path)
    _edit(path, lambda o: _leaf(o).update({field: leaf_path}))
    with pytest.raises(mr.CorruptBufferError):
        mr.open(path)
    assert verify_finds(path)


def verify_finds(path) -> bool:
    """``mmreplay verify`` in a fresh process calls the buffer damaged (exit status 1 or 4)."""
    return verify_cli(path)[0] != 0


def test_spec_keys_in_metadata_that_leave_the_folder_are_refused(tmp_path):
    path = _buffer(tmp_path)

    def change(obj):
        obj["spec"]["dict"]["../y"] = obj["spec"]["dict"].pop("y")
        _leaf(obj, 1)["path"] = "../y"

    _edit(path, change)
    with pytest.raises(mr.CorruptBufferError, match=r"\.\./y"):
        mr.open(path)


# --- exports stay inside their target ----------------------------------------------------

FORMATS = {
    "minari": "minari",
    "d4rl": "h5py",
    "d3rlpy": "d3rlpy",
    "parquet": "pyarrow",
    "npz": "numpy",
    "csv": "numpy",
    "pt": "torch",
    "zarr": "zarr",
    "hdf5": "h5py",
    "lerobot": "av",
}


def _snapshot(root) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(r, f), root): os.path.getsize(os.path.join(r, f))
        for r, _, fs in os.walk(root)
        for f in fs
    }


@pytest.fixture
def odd_store(tmp_path, nested_spec):
    """A buffer whose leaf names look like paths and shell words, but are valid names."""
    spec = dict(nested_spec)
    spec["obs"] = {
        **nested_spec["obs"],
        "...": mr.ArraySpec((2,), "float32"),
        "~ $HOME; rm -rf": mr.ArraySpec((), "int8"),
    }
    path = tmp_path / "buffers" / "b"
    path.parent.mkdir()
    with mr.create(path, spec, capacity=20, num_envs=2) as store:
        for t in range(12):
            step = make_step(spec, 2, t)
            step["terminated"][:] = t % 5 == 4
            store.add(step)
    return mr.open(path)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_exports_write_only_inside_their_target(tmp_path, odd_store, fmt):
    pytest.importorskip(FORMATS[fmt])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    target = tmp_path / "exports" / f"out.{fmt}"
    target.parent.mkdir()
    before = _snapshot(tmp_path)
    try:
        mr.export(odd_store, target, format=fmt)
    except mr.Error:
        pass  # a format may refuse these names; it must still write nothing outside
    after = _snapshot(tmp_path)
    changed = {p for p in set(before) | set(after) if before.get(p) != after.get(p)}
    prefix = os.path.relpath(target, tmp_path)
    assert all(p == prefix or p.startswith(prefix + os.sep) for p in changed), sorted(changed)


@pytest.mark.parametrize("fmt", ["minari", "parquet", "zarr", "npz"])
def test_exports_do_not_follow_a_symlinked_target(tmp_path, odd_store, fmt):
    pytest.importorskip(FORMATS[fmt])
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    target = tmp_path / "out"
    target.symlink_to(victim, target_is_directory=True)
    for force in (False, True):
        try:
            mr.export(odd_store, target, format=fmt, force=force)
        except (mr.Error, OSError):
            pass
        assert _snapshot(victim) == {"precious.txt": 4}


@pytest.mark.parametrize(
    "dataset_id",
    ["../../evil-v0", "/tmp/evil-v0", "ns/../../evil-v0", "ns/..-v0", "ns/.evil-v0", "ns\\..\\evil-v0"],
)
def test_minari_dataset_ids_cannot_leave_the_target(tmp_path, odd_store, dataset_id):
    pytest.importorskip("minari")
    before = _snapshot(tmp_path)
    with pytest.raises(mr.BadInputError, match="dataset id"):
        mr.export(odd_store, tmp_path / "root", format="minari", dataset_id=dataset_id)
    assert _snapshot(tmp_path) == before
    # the same store exports under a good id: the id check is what refused
    mr.export(odd_store, tmp_path / "root", format="minari", dataset_id="ns/good-v0")
    assert os.path.isfile(tmp_path / "root" / "ns" / "good-v0" / "data" / "metadata.json")


def test_minari_nested_namespaces_stay_inside_the_root_and_links_out_are_refused(tmp_path, odd_store):
    minari = pytest.importorskip("minari")
    root = tmp_path / "root"
    mr.export(odd_store, root, format="minari", dataset_id="a/b/c/fine-v0")
    assert os.path.isfile(root / "a" / "b" / "c" / "fine-v0" / "data" / "main_data.hdf5")
    assert minari.MinariDataset(str(root / "a" / "b" / "c" / "fine-v0" / "data")).total_episodes > 0
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(mr.BadInputError, match="outside the datasets root"):
        mr.export(odd_store, root, format="minari", dataset_id="link/evil-v0")
    assert os.listdir(outside) == []
