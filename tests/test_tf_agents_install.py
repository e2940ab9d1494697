"""mmreplay installs beside TF-Agents 0.19 with one pip command (docs/tf-agents.md).

TF-Agents 0.19 pins ``typing-extensions==4.5.0`` and TensorFlow 2.15 needs ``numpy<2``;
zarr 3 needs ``typing-extensions>=4.9``. So zarr-python is the ``zarr`` extra, and where
it does not import (absent, or the zarr 2 such environments carry) a new buffer gets the
hdf5 backend, memory-mapped the same way, with a warning that says so.

The normal run checks that fallback in a fresh process that imports a zarr 2 lookalike.
With ``--long`` and ``MMREPLAY_TF_WHEELS`` naming a folder holding the TensorFlow 2.15.1
wheel (``pip download -d DIR tensorflow==2.15.1 tf-agents==0.19.0``), a venv is built
with the documented command and the TensorFlow tests run in it.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest
from conftest import one_line_error

import mmreplay as mr

ROOT = Path(__file__).resolve().parents[1]

#: the command docs/tf-agents.md gives, with mmreplay from this checkout
INSTALL = ["tensorflow==2.15.1", "tf-agents==0.19.0"]


def test_zarr_is_an_extra_not_a_requirement():
    requires = importlib.metadata.requires("mmreplay") or []
    zarr = [r for r in requires if r.startswith("zarr")]
    assert zarr and all('extra == "zarr"' in r for r in zarr), requires


def zarr2_lookalike(folder: Path) -> dict:
    """An environment whose ``zarr`` is a 2.x without ``zarr.codecs.BloscCodec``."""
    pkg = folder / "zarr"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "2.18.7"\n')
    (pkg / "codecs.py").write_text("")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}


def test_without_zarr3_buffers_are_hdf5_with_a_warning(tmp_path):
    zarr_buffer = tmp_path / "made-with-zarr"
    mr.create(zarr_buffer, {"x": mr.ArraySpec((), "int64")}, 10).close()
    env = zarr2_lookalike(tmp_path / "site")
    script = textwrap.dedent(
        """
        import sys, warnings
        import numpy as np, mmreplay as mr
        from mmreplay.compat.tf_agents import UniformReplayBuffer
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rb = UniformReplayBuffer(mr.ArraySpec((), "int64"), 2, 5, path=sys.argv[1], seed=0)
        print(rb.store.backend, "|", "; ".join(str(w.message) for w in caught))
        for t in range(7):
            rb.add_batch(np.array([t, 100 + t]))
        rb.close()
        with UniformReplayBuffer(mr.ArraySpec((), "int64"), 2, 5, path=sys.argv[1]) as rb:
            print(rb.gather_all().tolist())
        try:
            mr.open(sys.argv[2])
        except ImportError as exc:
            print("ImportError:", exc)
        """
    )
    path = tmp_path / "rb"
    out = subprocess.run(
        [sys.executable, "-c", script, str(path), str(zarr_buffer)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    made, gathered, refused = out.stdout.splitlines()
    backend, message = made.split(" | ")
    assert backend == "hdf5" and "zarr-python 3 does not import here" in message
    assert re.search(r"does not import here \(.*zarr.*\)", message) and "pip install 'mmreplay[zarr]'" in message
    assert gathered == str([[2, 3, 4, 5, 6], [102, 103, 104, 105, 106]])
    assert refused.startswith("ImportError: the zarr backend needs zarr-python 3 (pip install 'mmreplay[zarr]')")
    verify = subprocess.run(
        [sys.executable, "-m", "mmreplay.cli", "verify", str(path)], env=env, capture_output=True, text=True
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


#: zarr made unimportable (as if it were not installed), then a script or the CLI
NO_ZARR = "import sys; sys.modules['zarr'] = None\n"


def test_a_backend_named_is_used_or_refused_and_only_the_default_falls_back(tmp_path):
    """mr.create(..., backend="zarr") without zarr-python made an hdf5 buffer, with a warning."""
    script = NO_ZARR + textwrap.dedent(
        """
        import os, warnings
        import mmreplay as mr
        spec = {"x": mr.ArraySpec((), "int64")}
        try:
            mr.create(sys.argv[1], spec, 10, backend="zarr")
        except ImportError as exc:
            print("refused:", exc)
        print("made:", os.path.exists(os.path.dirname(sys.argv[1])))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with mr.create(sys.argv[2], spec, 10) as store:
                print("default:", store.backend, len(caught))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "new" / "z"), str(tmp_path / "d")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    refused, made, default = out.stdout.splitlines()
    assert refused.startswith("refused: the zarr backend needs zarr-python 3 (pip install 'mmreplay[zarr]')")
    assert made == "made: False" and default == "default: hdf5 1"
    (tmp_path / "spec.json").write_text('{"x": {"shape": [], "dtype": "int64"}}')
    cli = [sys.executable, "-c", NO_ZARR + "from mmreplay.cli import main; main(sys.argv[1:], prog_name='mmreplay')"]
    args = ["create", str(tmp_path / "c"), "--spec", str(tmp_path / "spec.json"), "--capacity", "10"]
    named = subprocess.run([*cli, *args, "--backend", "zarr"], capture_output=True, text=True, timeout=120)
    one_line_error(named, 7, "pip install 'mmreplay[zarr]'")
    assert not (tmp_path / "c").exists()
    fallback = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
    assert fallback.returncode == 0 and "created" in fallback.stdout and ": hdf5," in fallback.stdout
    assert fallback.stderr.startswith("Warning: zarr-python 3 does not import here") and fallback.stderr.count("\n") == 1


def tf_wheels() -> str:
    folder = os.environ.get("MMREPLAY_TF_WHEELS")
    if not folder or not glob.glob(os.path.join(folder, "tensorflow-2.15.1-*.whl")):
        pytest.skip("no local TensorFlow 2.15.1 wheel: set MMREPLAY_TF_WHEELS to a folder holding one")
    return folder


@pytest.mark.long
def test_one_pip_command_installs_beside_tf_agents_and_tf_tests_pass(tmp_path):
    wheels = tf_wheels()
    home = tmp_path / "venv"
    venv.create(home, with_pip=True)
    python = str(home / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--find-links", wheels]
    done = subprocess.run([*pip, *INSTALL, str(ROOT)], capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    subprocess.run([*pip, "pytest"], check=True, timeout=600)
    tests = [
        "tests/test_tf_agents_tensorflow.py", "tests/test_compat_tf_agents.py", "tests/test_tf_agents_recorded.py",
        "tests/test_tf_agents_own_tests.py",
    ]  # fmt: skip
    run = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-5000:]
    assert " skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_the_fallback_warning_points_at_the_callers_create(tmp_path):
    """The warning names the user's line, not a line inside mmreplay."""
    env = zarr2_lookalike(tmp_path / "site")
    script = tmp_path / "collect.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import warnings, mmreplay as mr
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mr.create({str(tmp_path / "b")!r}, {{"x": mr.ArraySpec((), "int64")}}, 10).close()
            print(caught[0].filename, caught[0].lineno)
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(script), "5"]
