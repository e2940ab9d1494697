"""Shared fixtures: a small nested spec, each backend with and without compression."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

import mmreplay as mr


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="also run long tests (crash torture at scale, big buffers)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long test: run with --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


#: (backend, compression) pairs every storage test runs on
LAYOUTS = [("zarr", None), ("zarr", "zstd"), ("hdf5", None), ("hdf5", "gzip")]
LAYOUT_IDS = [f"{b}-{c or 'mapped'}" for b, c in LAYOUTS]


@pytest.fixture(params=LAYOUTS, ids=LAYOUT_IDS)
def layout(request: pytest.FixtureRequest) -> dict:
    backend, compression = request.param
    return {"backend": backend, "compression": compression}


@pytest.fixture
def nested_spec() -> dict:
    return {
        "obs": {"pixels": mr.ArraySpec((4, 4, 3), "uint8"), "state": mr.ArraySpec((5,), "float32")},
        "action": mr.ArraySpec((2,), "int64"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }


def make_step(spec: dict, num_envs: int, t: int) -> dict:
    """A step whose every value is a function of its global step id ``t`` (and env)."""
    def leaf(s: mr.ArraySpec, salt: int) -> np.ndarray:
        base = np.arange(num_envs).reshape((num_envs,) + (1,) * len(s.shape))
        value = (t * 7 + base * 3 + salt) + np.zeros((num_envs, *s.shape))
        if s.dtype == np.bool_:
            return (value.astype(np.int64) % 2).astype(bool)
        return value.astype(s.dtype)

    out: dict = {}
    for i, (key, sub) in enumerate(sorted(spec.items())):
        out[key] = make_step(sub, num_envs, t) if isinstance(sub, dict) else leaf(sub, i)
    return out


def folder_digest(path) -> dict[str, str]:
    """SHA-256 of every file under ``path`` but the lock: a refused write changes none."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            if name == ".lock":
                continue
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out
