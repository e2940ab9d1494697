"""skrl's own tests of ``Memory`` pass against ``mmreplay.compat.skrl.Memory``.

``tests/memories/torch/test_base.py`` of skrl (2.0) is run with one change, the import of
``Memory``. skrl's distributions on PyPI do not ship it (its sdists hold only
``tests/test_*_config.py``), so the file comes from ``MMREPLAY_SKRL_TESTS`` (a skrl source
checkout, or the file itself); without it the test skips, saying so. The test left failing is the
layer's documented limit (docs/skrl.md); test_compat_skrl.py checks the same behaviours
in every run.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
from conftest import run_their_tests

pytest.importorskip("torch")
pytest.importorskip("skrl")
pytest.importorskip("hypothesis")

TEST_FILE = "tests/memories/torch/test_base.py"
IMPORT = "from skrl.memories.torch import Memory\n"
SUBSTITUTE = "from mmreplay.compat.skrl import Memory\n"
#: rows that hold no step are not storage: a memory holding none stores nothing (docs/skrl.md)
LIMITS = {"test_set_tensor_by_name"}


def their_test_file() -> str:
    given = os.environ.get("MMREPLAY_SKRL_TESTS")
    if not given:
        pytest.skip(
            f"skrl's PyPI distributions do not ship {TEST_FILE} (the {importlib.metadata.version('skrl')} sdist "
            "holds tests/test_*_config.py only): set MMREPLAY_SKRL_TESTS to a skrl checkout to run it"
        )
    path = Path(given)
    return (path / TEST_FILE if path.is_dir() else path).read_text()


def test_skrl_memory_tests_pass_against_ours(tmp_path):
    source = their_test_file()
    assert source.count(IMPORT) == 1, "the test no longer imports Memory as expected"
    test = tmp_path / "test_base.py"
    test.write_text(source.replace(IMPORT, SUBSTITUTE))
    failed, passed, output = run_their_tests(test)
    assert failed == LIMITS, output
    assert len(passed) == 7, output
