"""What export, convert and import may write: never the source store or anything in it,
and with --force only an earlier export of the same format. Run as a user runs them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from conftest import folder_digest, one_line_error, run_cli, spread

import mmreplay as mr
from mmreplay.convert import convert
from mmreplay.formats import FORMATS, import_dataset

DATASETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets")
VECTOR = os.path.join(DATASETS, "pointchase-zarr")
PIXELS = os.path.join(DATASETS, "pointchase-pixels-hdf5")
NEEDS = {"pt": "torch", "parquet": "pyarrow"}


def needs(fmt: str) -> None:
    if fmt in NEEDS:
        pytest.importorskip(NEEDS[fmt])


def tree(path) -> dict[str, str]:
    """Every file under ``path`` (or the file itself) with its digest, and every folder."""
    if os.path.isfile(path):
        return {"": folder_digest(os.path.dirname(path))[os.path.basename(path)]}
    out = folder_digest(path)
    out.update({os.path.relpath(r, path) + "/": "" for r, _, _ in os.walk(path)})
    return out


def export_vector(out, fmt: str) -> None:
    """An earlier export to ``out``, made in this process: the refusals after it are what the
    CLI is run for (the command line's own exports are tested in test_cli)."""
    with mr.open(VECTOR) as source:
        mr.export(source, out, format=fmt)


@pytest.fixture
def store(tmp_path):
    """A private copy of the HDF5 reference store (its files are what must survive)."""
    path = tmp_path / "store"
    shutil.copytree(PIXELS, path)
    return path


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_force_keeps_a_file_or_folder_that_is_no_export(tmp_path, fmt):
    """`echo x > t.txt; mmreplay export STORE t.txt -f npz --force` used to destroy t.txt."""
    needs(fmt)
    if FORMATS[fmt].target == "file":
        mine = tmp_path / "t.txt"
        mine.write_text("x\n")
    else:
        mine = tmp_path / "mine"
        (mine / "mmreplay" / "pointchase-zarr-v0").mkdir(parents=True)
        (mine / "mmreplay" / "pointchase-zarr-v0" / "notes.txt").write_text("x\n")
        if fmt != "minari":
            mine = mine / "mmreplay" / "pointchase-zarr-v0"
    before = sorted(os.listdir(tmp_path)), tree(mine)
    # without --force too: the message does not ask for a --force that would be refused
    for force in ([], ["--force"]):
        out = run_cli("export", VECTOR, mine, "-f", fmt, "-q", *force)
        one_line_error(out, 2, "not an earlier", f"{fmt} export", "refusing")
        assert (sorted(os.listdir(tmp_path)), tree(mine)) == before


@pytest.mark.parametrize(
    "fmt, other", [("npz", "pt"), ("hdf5", "d4rl"), ("d4rl", "d3rlpy"), ("d3rlpy", "hdf5"), ("zarr", "parquet")]
)
def test_force_keeps_an_export_of_another_format(tmp_path, fmt, other):
    needs(fmt)
    needs(other)
    out = tmp_path / "out"
    export_vector(out, fmt)
    before = tree(out)
    one_line_error(run_cli("export", VECTOR, out, "-f", other, "-q", "--force"), 2, f"not an earlier {other} export")
    assert tree(out) == before


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_force_replaces_an_earlier_export_of_the_same_format(tmp_path, fmt):
    needs(fmt)
    out = tmp_path / "out"
    export_vector(out, fmt)
    again = run_cli("export", VECTOR, out, "-f", fmt, "-q")
    one_line_error(again, 2, str(out), "--force")
    forced = run_cli("export", VECTOR, out, "-f", fmt, "-q", "--force")
    assert forced.returncode == 0, forced.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize(("where", "fmt"), spread(["data.h5", "episodes.idx", "mmreplay.json", "new-file", "."], ["hdf5", "d4rl", "npz"]))
def test_export_never_writes_into_or_over_the_source_store(store, fmt, where):
    """Exporting into STORE/data.h5 with --force used to destroy the store."""
    before = tree(store)
    target = store / where if where != "." else store
    out = run_cli("export", store, target, "-f", fmt, "-q", "--force")
    one_line_error(out, 2, "the source", str(store))
    assert tree(store) == before  # every file byte for byte: the store is as valid as before


def test_export_through_a_link_into_the_store_is_refused(store, tmp_path):
    (tmp_path / "link.h5").symlink_to(store / "data.h5")
    (tmp_path / "folder-link").symlink_to(store)
    before = tree(store)
    one_line_error(run_cli("export", store, tmp_path / "link.h5", "-f", "hdf5", "--force"), 2, "the source")
    one_line_error(run_cli("export", store, tmp_path / "folder-link" / "x.npz", "-f", "npz"), 2, "the source")
    assert tree(store) == before
    assert run_cli("verify", store).returncode == 0


def test_export_to_a_folder_that_holds_the_store_is_refused(tmp_path):
    """A minari dataset folder (or an empty-looking parquet target) must not swallow the store."""
    root = tmp_path / "root"
    src = root / "mmreplay" / "x-v0"
    src.parent.mkdir(parents=True)
    shutil.copytree(VECTOR, src)
    before = tree(root)
    out = run_cli("export", src, root, "-f", "minari", "--dataset-id", "mmreplay/x-v0", "--force", "-q")
    one_line_error(out, 2, "the source")
    out = run_cli("export", src, root / "mmreplay", "-f", "zarr", "--force", "-q")
    one_line_error(out, 2, "the source")
    assert tree(root) == before


def test_a_refused_minari_export_creates_no_namespace_folder(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "ns").mkdir()
    (tmp_path / "root" / "ns" / "x-v0").write_text("mine")
    out = run_cli("export", VECTOR, tmp_path / "root", "-f", "minari", "--dataset-id", "ns/x-v0", "--force")
    one_line_error(out, 2, "refusing")
    src = tmp_path / "src"
    shutil.copytree(VECTOR, src)
    out = run_cli("export", src, src, "-f", "minari", "--dataset-id", "deep/ns/x-v0")
    one_line_error(out, 2, "the source")
    assert sorted(os.listdir(src)) == sorted(os.listdir(VECTOR))


@pytest.mark.parametrize("where", ["copy", "data.h5/copy", "."])
def test_convert_never_writes_into_the_source_store(store, where):
    before = tree(store)
    out = run_cli("convert", store, store / where if where != "." else store, "-q")
    one_line_error(out, 2, str(store))
    assert tree(store) == before


def test_convert_and_import_through_the_api_refuse_the_same(store, tmp_path):
    before = tree(store)
    with pytest.raises(mr.TargetError, match="lies inside the source"):
        convert(store, store / "copy")
    with pytest.raises(mr.TargetError, match="lies inside the source"):
        convert(store, store / "data.h5")
    (tmp_path / "empty").mkdir()
    with pytest.raises(mr.TargetError, match="already exists"):
        convert(store, tmp_path / "empty")
    assert tree(store) == before
    export = tmp_path / "x.zarr"
    with mr.open(store) as s:
        mr.export(s, export, format="zarr")
    exported = tree(export)
    with pytest.raises(mr.TargetError, match="lies inside the source"):
        import_dataset(export, export / "new")
    assert tree(export) == exported


def test_import_never_writes_into_its_source(tmp_path):
    export = tmp_path / "x.zarr"
    export_vector(export, "zarr")
    before = tree(export)
    one_line_error(run_cli("import", export, export / "store", "-q"), 2, "the source")
    one_line_error(run_cli("import", export, export, "-q"), 2, "the source")
    assert tree(export) == before


def test_store_export_method_keeps_the_rule(store, tmp_path):
    with mr.open(store) as s:
        with pytest.raises(mr.TargetError, match="the source"):
            mr.export(s, store / "data.h5", format="hdf5", force=True)
        (tmp_path / "t.txt").write_text("x")
        with pytest.raises(mr.TargetError, match="not an earlier npz export"):
            mr.export(s, tmp_path / "t.txt", format="npz", force=True)
    assert (tmp_path / "t.txt").read_text() == "x"


def test_a_refused_pt_export_needs_no_torch(tmp_path):
    """The target is checked before PyTorch is imported: the refusal is the same without it."""
    (tmp_path / "t.txt").write_text("x\n")
    code = "import runpy, sys; sys.modules['torch'] = None; runpy.run_module('mmreplay.cli', run_name='__main__')"
    args = ["export", VECTOR, tmp_path / "t.txt", "-f", "pt", "-q", "--force"]
    out = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300)
    one_line_error(out, 2, "not an earlier", "pt export", "refusing")
    assert (tmp_path / "t.txt").read_text() == "x\n"
