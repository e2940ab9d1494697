"""A pytest plugin that runs TorchRL's own replay-buffer tests over a chosen storage.

Loaded with ``-p torchrl_suite`` (this folder on ``PYTHONPATH``) in a run of TorchRL's
``test/rb/`` files. ``MMREPLAY_TORCHRL_STORAGE=mmreplay`` puts a ``LazyMemmapStorage``
subclass of :class:`MMReplayStorage` where the tests import ``LazyMemmapStorage`` (a
fresh folder each, only ``max_size`` / ``ndim`` passed on); ``lazymemmap`` keeps
TorchRL's own class. Either way, the outcome of every test and whether it built that
storage are written as JSON to ``MMREPLAY_TORCHRL_REPORT``.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest
import torchrl.data
import torchrl.data.replay_buffers
import torchrl.data.replay_buffers.storages as storages

from mmreplay.compat.torchrl import MMReplayStorage

_built = [False]


class LazyMemmapStorage(MMReplayStorage):
    """What the tests get for ``LazyMemmapStorage``: a store in a fresh folder."""

    def __init__(self, max_size: int, *, ndim: int = 1, **ignored: Any) -> None:
        _built[0] = True
        folder = tempfile.mkdtemp(prefix="rb-", dir=os.environ.get("MMREPLAY_TORCHRL_SCRATCH"))
        super().__init__(os.path.join(folder, "buf"), max_size=max_size, ndim=ndim)


def _substitute() -> None:
    if os.environ.get("MMREPLAY_TORCHRL_STORAGE") == "mmreplay":
        for module in (torchrl.data, torchrl.data.replay_buffers, storages):
            module.LazyMemmapStorage = LazyMemmapStorage
        return
    original = storages.LazyMemmapStorage.__init__

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        _built[0] = True
        original(self, *args, **kwargs)

    storages.LazyMemmapStorage.__init__ = recording_init


_substitute()  # before the test modules import the name
_outcomes: dict[str, dict[str, Any]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _built[0] = False
    yield
    _outcomes.setdefault(item.nodeid, {"outcome": "passed", "message": ""})["built"] = _built[0]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.outcome == "skipped" and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    elif report.failed and entry["outcome"] != "failed":
        entry["outcome"] = "failed"
        crash = getattr(report.longrepr, "reprcrash", None)
        entry["message"] = crash.message if crash is not None else str(report.longrepr)[-500:]


def pytest_sessionfinish(session: pytest.Session) -> None:
    with open(os.environ["MMREPLAY_TORCHRL_REPORT"], "w") as f:
        json.dump(_outcomes, f, indent=0)
