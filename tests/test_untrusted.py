"""Untrusted buffers: nothing is unpickled or executed, absurd metadata is refused before
anything is allocated, leaf paths stay inside the buffer, exports stay inside their target."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
from conftest import make_step, one_line_error, recover_cli, run_cli, spread, verify_cli

import mmreplay as mr
from mmreplay.metadata import METADATA_FILE, read_metadata

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
    "format version a superscript digit": lambda o: o.update(format="mmreplay/\u00b2"),
    "format version a non-ASCII digit": lambda o: o.update(format="mmreplay/\u0663"),
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


@pytest.mark.parametrize(("field", "leaf_path"), spread(["path", "file"], LEAF_PATHS))
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


# --- hostile folders: every command against a corpus of crafted stores ---------------------
#
# Each case is a small store with one hostile change: a file or folder replaced by a
# symbolic link out of the store (to the same file of a twin store outside, holding other
# values, or to a user's file), a link inside it, a FIFO, /dev/zero, an HDF5 link out of
# the file or a dataset stored elsewhere, absurd sizes, JSON too deep or too large. Every
# command runs against it in a process of its own with a time limit (tests/cli_forks.py)
# and must end with a one-line error or a correct answer: never a hang, a traceback, a
# write outside the store or a read of anything outside it (inotify sees each file of
# the outside folder that a command opens).

CORPUS_SPEC = {
    "obs": mr.ArraySpec((6, 6, 3), "uint8"),
    "action": mr.ArraySpec((2,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}
#: the stores the cases start from: a compressed and a mapped leaf in each
CORPUS_BASES = {
    "zarr": {"compression": {"obs": "zstd"}, "chunk_steps": 4},
    "rows": {"compression": {"obs": "rows:lz4"}, "chunk_steps": 4},
    "hdf5": {"backend": "hdf5", "compression": {"obs": "gzip"}, "chunk_steps": 4},
    "prioritized": {"sampler": "prioritized"},
    "frames": {"frames": mr.Frames()},
}
SECRET = b"top secret: AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG\n"


def _corpus_store(path, base: str, marker: int | None) -> None:
    """A base store of 12 steps (episodes of 5); ``marker``: every value is that number."""
    spec = dict(CORPUS_SPEC)
    if base == "frames":
        spec["next_obs"] = spec["obs"]
    with mr.create(path, spec, capacity=16, num_envs=2, **CORPUS_BASES[base]) as store:
        for t in range(12):
            v = t if marker is None else marker
            step = {k: np.full((2, *s.shape), v, s.dtype) for k, s in spec.items()}
            step["terminated"][:] = t % 5 == 4
            step["truncated"][:] = False
            if "next_obs" in step:
                step["next_obs"][:] = v + 1
            store.add(step)


@pytest.fixture(scope="module")
def corpus_bases(tmp_path_factory) -> dict[str, tuple[pathlib.Path, pathlib.Path]]:
    """Per base: the store, and its twin (same layout, every value 77), built once."""
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for base in CORPUS_BASES:
        _corpus_store(root / base, base, None)
        _corpus_store(root / f"{base}-twin", base, 77)
        out[base] = (root / base, root / f"{base}-twin")
    return out


def _replace(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _first_chunk(store: pathlib.Path, leaf: str) -> str:
    """The store-relative path of a leaf's first chunk (or shard) file."""
    folder = store / "data.zarr" / leaf / "c"
    first = min(p for p in folder.rglob("*") if p.is_file() and ".partial" not in p.name)
    return str(first.relative_to(store))


def _named(rel) -> Callable:
    return rel if callable(rel) else lambda store: rel


def link_out(rel, to: str = "twin") -> Callable:
    """``rel`` becomes a link to the same file of the twin store outside (or a user's file)."""
    def change(store, outside):
        name = _named(rel)(store)
        target = outside / "twin" / name if to == "twin" else outside / to
        _replace(store / name)
        (store / name).symlink_to(target)

    return change


def link_in(rel, to: str) -> Callable:
    """``rel`` becomes a relative link to another file of the same store."""
    def change(store, outside):
        name = _named(rel)(store)
        target = os.path.relpath(store / to, (store / name).parent)
        _replace(store / name)
        (store / name).symlink_to(target)

    return change


def fifo(rel) -> Callable:
    def change(store, outside):
        name = _named(rel)(store)
        _replace(store / name)
        os.mkfifo(store / name)

    return change


def device(rel) -> Callable:
    """``rel`` becomes the device /dev/zero is (a link to it where devices cannot be made)."""
    def change(store, outside):
        name = _named(rel)(store)
        _replace(store / name)
        try:
            os.mknod(store / name, stat.S_IFCHR | 0o644, os.stat("/dev/zero").st_rdev)
        except PermissionError:
            (store / name).symlink_to("/dev/zero")

    return change


def unix_socket(rel) -> Callable:
    def change(store, outside):
        name = _named(rel)(store)
        _replace(store / name)
        here = os.getcwd()
        os.chdir((store / name).parent)  # a socket's path may not be long: bind it by its name
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind((store / name).name)
        finally:
            os.chdir(here)

    return change


def dev_zero(rel) -> Callable:
    def change(store, outside):
        name = _named(rel)(store)
        _replace(store / name)
        (store / name).symlink_to("/dev/zero")

    return change


def sparse(rel, size: int = 100 << 30) -> Callable:
    """``rel`` grows to ``size`` bytes (sparse: no disk), its start as it was."""
    def change(store, outside):
        os.truncate(store / _named(rel)(store), size)

    return change


def edit_metadata(change_obj: Callable) -> Callable:
    def change(store, outside):
        _edit(str(store), change_obj)

    return change


def write_text(rel, text: str) -> Callable:
    def change(store, outside):
        (store / rel).write_text(text)

    return change


def _huge_action(obj):
    obj["spec"]["dict"]["action"]["shape"] = [2**20, 2**20]
    next(leaf for leaf in obj["leaves"] if leaf["path"] == "action")["shape"] = [2**20, 2**20]


def _beta(obj):
    obj["sampler"]["beta"] = "x" * 3


def _huge_integer(store, outside):
    """A 5,000-digit number in the metadata (Python refuses to parse past 4,300)."""
    _edit(str(store), lambda o: o.update(created=123456789))
    path = store / METADATA_FILE
    path.write_text(path.read_text().replace("123456789", "9" * 5000))


def _zarr_bomb(store, outside):
    """The compressed leaf's zarr.json asks for chunks of 2**27 steps, decoded with lzma."""
    path = store / "data.zarr" / "obs" / "zarr.json"
    doc = json.loads(path.read_text())
    doc["chunk_grid"]["configuration"]["chunk_shape"][0] = 2**27
    doc["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "numcodecs.lzma", "configuration": {}}]
    path.write_text(json.dumps(doc))


def _zstd_bomb(store, outside):
    """The compressed leaf's first chunk declares 9.7 GB of content in its zstd frame
    header (zstd allocates what a frame declares), with a valid CRC-32C."""
    import google_crc32c

    path = store / _first_chunk(store, "obs")
    frame = path.read_bytes()[:-4]
    descriptor = frame[4]
    single = (descriptor >> 5) & 1
    header = 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3] + (1 if single else 0, 2, 4, 8)[descriptor >> 6]
    crafted = frame[:4] + bytes([0b11100000]) + (9_700_000_000).to_bytes(8, "little") + frame[header:]
    path.write_bytes(crafted + np.uint32(google_crc32c.value(crafted)).tobytes())


def _h5(change_file: Callable) -> Callable:
    def change(store, outside):
        import h5py

        with h5py.File(store / "data.h5", "r+", libver="latest") as f:
            change_file(f, outside / "twin" / "data.h5", outside)

    return change


def _h5_external_link(leaf: str) -> Callable:
    def change(f, twin, outside):
        import h5py

        del f[leaf]
        f[leaf] = h5py.ExternalLink(str(twin), "/" + leaf)

    return change


def _h5_journal_into_link(store, outside):
    """A chunk journal for the compressed leaf (what a writer killed mid-commit leaves),
    whose dataset is then an external link to the twin's file: replaying the journal
    through the link would write the twin."""
    import h5py

    from mmreplay.backends.h5chunks import render_journal

    with h5py.File(store / "data.h5", "r") as f:
        mask, payload = f["obs"].id.read_direct_chunk((0,) * f["obs"].ndim)
    (store / "data.h5.journal").write_bytes(render_journal({"obs": {0: (mask, payload)}}))
    _h5(_h5_external_link("obs"))(store, outside)


def _h5_soft_loop(f, twin, outside):
    import h5py

    del f["obs"]
    f["obs"] = h5py.SoftLink("/loop")
    f["loop"] = h5py.SoftLink("/obs")


def _h5_virtual(f, twin, outside):
    import h5py

    shape, dtype = f["obs"].shape, f["obs"].dtype
    layout = h5py.VirtualLayout(shape, dtype)
    layout[...] = h5py.VirtualSource(str(twin), "obs", shape, dtype)
    del f["obs"]
    f.create_virtual_dataset("obs", layout)


def _h5_external_storage(leaf: str) -> Callable:
    def change(f, twin, outside):
        shape, dtype = f[leaf].shape, f[leaf].dtype
        raw = outside / f"{leaf}.raw"
        raw.write_bytes(np.full(shape, 77, dtype).tobytes())
        del f[leaf]
        f.create_dataset(leaf, shape, dtype, external=[(str(raw), 0, raw.stat().st_size)])

    return change


def _h5_root_header(store) -> int:
    """Where data.h5's root group object header starts (its version 2/3 superblock says)."""
    return int.from_bytes((store / "data.h5").read_bytes()[36:44], "little")


def _h5_flip_root_header(store, outside):
    """One byte of the root group's object header flipped: its checksum no longer matches."""
    with open(store / "data.h5", "r+b") as f:
        f.seek(_h5_root_header(store) + 8)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def _h5_cut_in_root_header(store, outside):
    os.truncate(store / "data.h5", _h5_root_header(store) + 16)


#: name -> (base store, change(store, outside))
HOSTILE: dict[str, tuple[str, Callable]] = {
    # links out of the store, for each kind of file (and folder) it holds
    "metadata -> twin": ("zarr", link_out(METADATA_FILE)),
    "state -> twin": ("zarr", link_out("mmreplay.state")),
    "lock -> user file": ("zarr", link_out(".lock", "victim.txt")),
    "lock -> missing file outside": ("zarr", link_out(".lock", "new.txt")),
    "mapped shard -> twin": ("zarr", link_out(lambda s: _first_chunk(s, "action"))),
    "mapped shard -> small user file": ("zarr", link_out(lambda s: _first_chunk(s, "action"), "victim.txt")),
    "chunk -> twin": ("zarr", link_out(lambda s: _first_chunk(s, "obs"))),
    "array zarr.json -> twin": ("zarr", link_out("data.zarr/obs/zarr.json")),
    "group zarr.json -> twin": ("zarr", link_out("data.zarr/zarr.json")),
    "data.zarr -> twin": ("zarr", link_out("data.zarr")),
    "leaf folder -> twin": ("zarr", link_out("data.zarr/obs")),
    "chunk folder -> twin": ("zarr", link_out("data.zarr/obs/c")),
    "episode index -> twin": ("zarr", link_out("episodes.idx")),
    "data.h5 -> twin": ("hdf5", link_out("data.h5")),
    "data.h5 -> small user file": ("hdf5", link_out("data.h5", "victim.txt")),
    "chunk journal -> twin": ("hdf5", link_out("data.h5.journal")),
    "staging -> twin": ("rows", link_out("data.zarr/obs/staging.bin")),
    "row shard -> twin": ("rows", link_out(lambda s: _first_chunk(s, "obs"))),
    "priorities -> twin": ("prioritized", link_out("priorities.bin")),
    "priorities lock -> user file": ("prioritized", link_out("priorities.lock", "victim.txt")),
    "side ring folder -> twin": ("frames", link_out("frames")),
    "side ring shard -> twin": ("frames", link_out("frames/data.zarr/ref/c/0/0/0")),
    # links inside the store
    "chunk -> another chunk": ("zarr", link_in("data.zarr/obs/c/1/0/0/0/0", "data.zarr/obs/c/0/0/0/0/0")),
    "metadata -> a copy inside": ("zarr", lambda s, o: (shutil.copy(s / METADATA_FILE, s / "copy.json"), link_in(METADATA_FILE, "copy.json")(s, o))),
    # FIFOs and devices
    "metadata FIFO": ("zarr", fifo(METADATA_FILE)),
    "state FIFO": ("zarr", fifo("mmreplay.state")),
    "lock FIFO": ("zarr", fifo(".lock")),
    "chunk FIFO": ("zarr", fifo(lambda s: _first_chunk(s, "obs"))),
    "mapped shard FIFO": ("zarr", fifo(lambda s: _first_chunk(s, "action"))),
    "array zarr.json FIFO": ("zarr", fifo("data.zarr/obs/zarr.json")),
    "episode index FIFO": ("zarr", fifo("episodes.idx")),
    "data.h5 FIFO": ("hdf5", fifo("data.h5")),
    "chunk journal FIFO": ("hdf5", fifo("data.h5.journal")),
    "staging FIFO": ("rows", fifo("data.zarr/obs/staging.bin")),
    "row shard FIFO": ("rows", fifo(lambda s: _first_chunk(s, "obs"))),
    "priorities FIFO": ("prioritized", fifo("priorities.bin")),
    "chunk -> /dev/zero": ("zarr", dev_zero(lambda s: _first_chunk(s, "obs"))),
    "chunk is a device": ("zarr", device(lambda s: _first_chunk(s, "obs"))),
    "metadata is a device": ("zarr", device(METADATA_FILE)),
    "state is a socket": ("zarr", unix_socket("mmreplay.state")),
    "chunk is a socket": ("zarr", unix_socket(lambda s: _first_chunk(s, "obs"))),
    "mapped shard -> /dev/zero": ("zarr", dev_zero(lambda s: _first_chunk(s, "action"))),
    "metadata -> /dev/zero": ("zarr", dev_zero(METADATA_FILE)),
    "row shard -> /dev/zero": ("rows", dev_zero(lambda s: _first_chunk(s, "obs"))),
    # files far larger than they can be (sparse)
    "chunk of 100 GB": ("zarr", sparse(lambda s: _first_chunk(s, "obs"))),
    "mapped shard of 100 GB": ("zarr", sparse(lambda s: _first_chunk(s, "action"))),
    "array zarr.json of 100 GB": ("zarr", sparse("data.zarr/obs/zarr.json")),
    "episode index of 100 GB": ("zarr", sparse("episodes.idx")),
    "row shard of 100 GB": ("rows", sparse(lambda s: _first_chunk(s, "obs"))),
    "chunk journal of 100 GB": ("hdf5", sparse("data.h5.journal")),
    # HDF5 links and storage out of the file
    "hdf5 external link (compressed leaf)": ("hdf5", _h5(_h5_external_link("obs"))),
    "hdf5 external link (mapped leaf)": ("hdf5", _h5(_h5_external_link("action"))),
    "hdf5 external link, chunk journal to replay": ("hdf5", _h5_journal_into_link),
    "hdf5 soft-link loop": ("hdf5", _h5(_h5_soft_loop)),
    "hdf5 virtual dataset": ("hdf5", _h5(_h5_virtual)),
    "hdf5 external storage (compressed leaf)": ("hdf5", _h5(_h5_external_storage("obs"))),
    "hdf5 external storage (mapped leaf)": ("hdf5", _h5(_h5_external_storage("action"))),
    # HDF5 metadata whose checksum fails: a reader gives up instead of re-reading forever
    "data.h5 root header byte flipped": ("hdf5", _h5_flip_root_header),
    "data.h5 cut inside its root header": ("hdf5", _h5_cut_in_root_header),
    # sizes and numbers
    "capacity 2**40": ("zarr", edit_metadata(lambda o: o.update(capacity=2**40))),
    "hdf5 capacity 2**40": ("hdf5", edit_metadata(lambda o: o.update(capacity=2**40))),
    "zarr.json chunks of 2**27 steps, lzma": ("zarr", _zarr_bomb),
    "chunk declaring 9.7 GB (zstd)": ("zarr", _zstd_bomb),
    "shape [2**20, 2**20]": ("zarr", edit_metadata(_huge_action)),
    "5000-digit integer": ("zarr", _huge_integer),
    "metadata nested 100000 deep": ("zarr", write_text(METADATA_FILE, '{"a":' * 100_000 + "1" + "}" * 100_000)),
    "group zarr.json nested deep": ("zarr", write_text("data.zarr/zarr.json", "[" * 100_000 + "]" * 100_000)),
    "array zarr.json 5000-digit integer": ("zarr", write_text("data.zarr/obs/zarr.json", '{"zarr_format": ' + "3" * 5000 + "}")),
    "unknown sampler": ("zarr", edit_metadata(lambda o: o.update(sampler={"name": "no-such-sampler"}))),
    "bad beta": ("prioritized", edit_metadata(_beta)),
    "negative beta": ("prioritized", edit_metadata(lambda o: o["sampler"].update(beta=-1))),
}

#: outputs of the export formats (a .h5 target needs its format named)
EXPORT_NAMES = {"minari": "root", "d4rl": "d4rl.h5", "d3rlpy": "d3rlpy.h5", "hdf5": "plain.h5"}
#: exit statuses of a refusal (cli/__init__.py)
REFUSALS = {2, 3, 4, 5, 6, 7}
#: seconds a command may take on a tiny store before it counts as hung
CORPUS_TIMEOUT = 60


def corpus_commands(store: pathlib.Path, out: pathlib.Path, push_url: str | None) -> list[tuple[str, list[str]]]:
    """Every command that reads a store, as a user runs it; recover (which writes) last."""
    s = str(store)
    runs = [("inspect", ["inspect", s]), ("verify", ["verify", s]), ("stats", ["stats", s]),
            ("sample", ["sample", s, "-n", "3"])]
    for fmt in sorted(FORMATS):
        if importlib.util.find_spec(FORMATS[fmt]) is not None:
            target = out / EXPORT_NAMES.get(fmt, f"out.{fmt}")
            runs.append((f"export {fmt}", ["export", s, str(target), "-f", fmt, "-q"]))
    runs += [("convert", ["convert", s, str(out / "converted"), "-q"]),
             ("view", ["view", s, "-o", str(out / "view.gif"), "-q"]),
             ("plot", ["plot", s, "-o", str(out / "plot.png")])]
    if push_url is not None:
        runs.append(("push", ["push", s, push_url]))
    runs.append(("recover", ["recover", s]))
    return runs


def build_case(bases, name: str, where: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """The hostile store ``name`` in ``where``, and its folder ``outside`` (a user's file,
    and the twin store the links point into)."""
    base, change = HOSTILE[name]
    store, outside = where / "store", where / "outside"
    shutil.copytree(bases[base][0], store)
    outside.mkdir()
    (outside / "victim.txt").write_bytes(SECRET)
    shutil.copytree(bases[base][1], outside / "twin")
    (where / "out").mkdir()
    change(store, outside)
    return store, outside


def judge(command: str, result: dict) -> str | None:
    """What is wrong with one command's run on a hostile store (None: nothing)."""
    code, err = result["code"], result["stderr"].strip()
    if code is None:
        return "hung: killed at the time limit"
    if "Traceback" in err or "Fatal Python error" in err:
        return "traceback: " + err.splitlines()[-1][:300]
    if "MemoryError" in err or "Unable to allocate" in err:
        return "allocated what a crafted file asks for: " + err[-300:]
    if result["touched"]:
        return f"used files outside the store: {result['touched'][:4]}"
    if command == "verify" and code == 0:
        return "verify said ok"
    if code == 0 or (command in ("verify", "recover") and code == 1 and not err):
        return None  # an answer (verify and recover: a report of what is wrong)
    lines = err.splitlines()  # (warnings may come first: a damaged episode index is rebuilt)
    if code not in REFUSALS or not lines or not lines[-1].startswith("Error: ") or "Error: " in err[: -len(lines[-1])]:
        return f"exit {code} without a one-line error: {err[-300:]!r}"
    return None


def run_corpus(bases, cases: dict[str, set[str] | None], tmp: pathlib.Path, push: str | None = None) -> list[str]:
    """Run each case (name -> the commands to run, None: all) in one batch of processes;
    returns what went wrong, one line each."""
    runs, labels, outsides = [], [], {}
    for i, (name, commands) in enumerate(cases.items()):
        where = tmp / f"case{i}"
        where.mkdir(parents=True)
        store, outside = build_case(bases, name, where)
        outsides[name] = (outside, _tree_digest(outside))
        url = None if push is None else f"{push}/case{i}"
        for command, argv in corpus_commands(store, where / "out", url):
            if commands is None or command in commands:
                runs.append({"argv": argv, "cwd": str(where), "timeout": CORPUS_TIMEOUT, "watch": [str(outside)]})
                labels.append((name, command))
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "cli_forks.py")],
        input=json.dumps({"runs": runs}), capture_output=True, text=True,
        timeout=120 + CORPUS_TIMEOUT * len(runs),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(runs), done.stderr[-3000:]
    problems = []
    for (name, command), result in zip(labels, results):
        why = judge(command, result)
        if why is not None:
            problems.append(f"{name} | {command}: {why}")
    for name, (outside, before) in outsides.items():
        if _tree_digest(outside) != before:
            problems.append(f"{name}: files outside the store changed")
    return problems


def _tree_digest(root: pathlib.Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, and where each link points."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


#: cases run through every command in the normal run: one of each kind of hazard
REPRESENTATIVE = [
    "lock -> user file",
    "mapped shard -> small user file",
    "chunk -> twin",
    "data.zarr -> twin",
    "metadata FIFO",
    "hdf5 external link, chunk journal to replay",
    "chunk declaring 9.7 GB (zstd)",
    "capacity 2**40",
    "bad beta",
]
#: the commands every other case runs through in the normal run: those that read every
#: file (verify, an export) and the one that writes (recover)
CORE_COMMANDS = {"verify", "export npz", "recover"}


@pytest.fixture(scope="module")
def push_prefix():
    """An S3 prefix on a local moto server for ``push`` (None where moto is not here)."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("obstore") is None:
        yield None
        return
    sys.path.insert(0, str(ROOT))
    from bench.s3_server import local_s3_server

    with local_s3_server("hostile"):
        yield "s3://hostile/pushes"


def test_hostile_folders_end_in_one_line(corpus_bases, tmp_path, push_prefix):
    """Every command on one case of each kind, the core commands on every other case."""
    cases = {name: None if name in REPRESENTATIVE else CORE_COMMANDS for name in HOSTILE}
    problems = run_corpus(corpus_bases, cases, tmp_path, push=push_prefix)
    assert not problems, "\n".join(problems)


@pytest.mark.long
def test_hostile_folders_every_command_on_every_case(corpus_bases, tmp_path, push_prefix):
    problems = run_corpus(corpus_bases, dict.fromkeys(HOSTILE), tmp_path, push=push_prefix)
    assert not problems, "\n".join(problems)


# --- the same hazards through the library, one by one ----------------------------------


def test_a_lock_linked_to_a_users_file_is_never_truncated(tmp_path):
    path = _buffer(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(SECRET)
    os.unlink(os.path.join(path, ".lock"))
    os.symlink(victim, os.path.join(path, ".lock"))
    with pytest.raises(mr.CorruptBufferError, match=r"\.lock: is a symbolic link"):
        mr.open(path, "a")
    one_line_error(run_cli("recover", path), 4, ".lock", "symbolic link")
    assert victim.read_bytes() == SECRET
    with mr.open(path) as store:  # a reader takes no lock: it reads as before
        assert len(store) == 1


def test_a_data_file_with_another_hard_link_is_read_but_never_written(tmp_path):
    path = _buffer(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    os.link(os.path.join(path, read_metadata(path).leaves[0].file), elsewhere)
    before = elsewhere.read_bytes()
    with mr.open(path) as store:  # a regular file of the folder
        assert len(store) == 1
    with pytest.raises(mr.CorruptBufferError, match="other hard links"):
        mr.open(path, "a")
    assert elsewhere.read_bytes() == before


def test_a_store_folder_may_itself_be_a_link(tmp_path):
    """Run folders are often links (``runs/latest``): the folder named may be one; what
    is inside it may not."""
    path = _buffer(tmp_path)
    link = tmp_path / "latest"
    link.symlink_to(path, target_is_directory=True)
    with mr.open(link, "a") as store:
        store.add({"x": np.ones((1, 3), "float32"), "y": np.ones(1, "int64")})
    with mr.open(link) as store:
        assert len(store) == 2
    assert verify_cli(link) == (0, [])
    assert recover_cli(link).ok


READ_ALL = """
import resource, sys, mmreplay as mr
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
try:
    with mr.open(sys.argv[1]) as store:
        store.to_arrays()
    print("read")
except mr.Error as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("chunk -> /dev/zero", ["c/0/0/0/0/0", "symbolic link"]),
        ("chunk FIFO", ["c/0/0/0/0/0", "a FIFO"]),
        ("chunk -> twin", ["c/0/0/0/0/0", "symbolic link"]),
        ("chunk folder -> twin", ["obs/c", "symbolic link"]),
        ("chunk declaring 9.7 GB (zstd)", ["c/0/0/0/0/0", "declares 9700000000 bytes"]),
        ("zarr.json chunks of 2**27 steps, lzma", ["numcodecs.lzma", "never writes"]),
        ("row shard -> /dev/zero", ["c/0/0/0/0/0", "symbolic link"]),
    ],
)
def test_reading_what_a_chunk_must_not_be_is_refused_before_it_is_read(corpus_bases, tmp_path, case, words):
    """Each refusal names the file and why, from a check (the process may map 1 GiB)."""
    store, outside = build_case(corpus_bases, case, tmp_path)
    done = subprocess.run([sys.executable, "-c", READ_ALL, str(store)], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("CorruptBufferError"), done.stdout + done.stderr[-2000:]
    for word in words:
        assert word in done.stdout, (word, done.stdout)


@pytest.mark.parametrize("way", ["openat2", "folder by folder"])
def test_open_inside_refuses_the_same_in_one_call_or_folder_by_folder(tmp_path, monkeypatch, way):
    """Where Linux has ``openat2`` a path is entered in one call; elsewhere (or in a
    sandbox that refuses it) folder by folder. Both refuse the same paths."""
    from mmreplay.io import local

    if way == "openat2" and local._openat2 is None:
        pytest.skip("openat2 is not available here")
    if way != "openat2":
        monkeypatch.setattr(local, "_openat2", None)
    store, outside = tmp_path / "store", tmp_path / "outside"
    (store / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "file").write_bytes(b"outside")
    (store / "sub" / "file").write_bytes(b"inside")
    (store / "sub" / "link").symlink_to(outside, target_is_directory=True)
    (store / "sub" / "file-link").symlink_to(outside / "file")
    os.mkfifo(store / "sub" / "fifo")
    fd = local.open_inside(store, "sub/file")
    try:
        assert os.read(fd, 16) == b"inside"
    finally:
        os.close(fd)
    for rel, why in [("sub/link/file", "symbolic link"), ("sub/file-link", "symbolic link"), ("sub/fifo", "FIFO")]:
        with pytest.raises(mr.CorruptBufferError, match=why):
            local.open_inside(store, rel)
    with pytest.raises(FileNotFoundError) as missing:
        local.open_inside(store, "sub/missing/file")
    assert missing.value.filename.startswith(str(store / "sub" / "missing"))  # (the folder, or the file in it)


def _read_calls() -> int:
    """read(2) calls of this process so far (Linux counts them in /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscr:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads through /proc/self/io (Linux)")
def test_a_root_group_that_does_not_read_is_read_once_not_once_per_leaf(corpus_bases, tmp_path):
    """Damaged HDF5 metadata is read METADATA_READ_ATTEMPTS times (a SWMR writer may be
    writing it) before it counts as damaged: verify reads the root group's links once,
    and each leaf below it is reported with that one failure."""
    from mmreplay.backends.h5chunks import METADATA_READ_ATTEMPTS
    from mmreplay.verify import verify

    store, _ = build_case(corpus_bases, "data.h5 root header byte flipped", tmp_path / "damaged")
    verify(str(store))  # (imports what verify imports on first use)
    before = _read_calls()
    problems = verify(str(store))
    reads = _read_calls() - before
    leaves = [leaf.path for leaf in read_metadata(str(store)).leaves]
    assert len(leaves) > 2
    for leaf in leaves:
        assert any(f"the HDF5 metadata of {leaf!r} does not read" in p for p in problems), (leaf, problems)
    assert reads < 2 * METADATA_READ_ATTEMPTS, f"{reads} reads for {len(leaves)} leaves below one damaged group"
