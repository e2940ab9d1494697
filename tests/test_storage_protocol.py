"""Every backend's leaves follow the leaf protocol and state their capabilities."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import WITH_ROWS, WITH_ROWS_IDS

import mmreplay as mr
from mmreplay.backends.base import Leaf

FLAGS = {  # (mappable, in_place, atomic_replace, ranged_read)
    ("zarr", None): (True, True, False, True),
    ("zarr", "zstd"): (False, False, True, False),
    ("zarr", "rows:lz4"): (False, True, True, True),
    ("zarr", "rows:zstd:1"): (False, True, True, True),
    ("hdf5", None): (True, True, False, True),
    ("hdf5", "gzip"): (False, True, False, False),
}


@pytest.mark.parametrize("layout", WITH_ROWS, ids=WITH_ROWS_IDS)
def test_leaves_state_their_capabilities_and_serve_the_protocol(tmp_path, layout):
    backend, compression = layout
    spec = {"x": mr.ArraySpec((3,), "float32")}
    with mr.create(tmp_path / "b", spec, 8, num_envs=2, backend=backend, compression=compression) as store:
        store.extend({"x": np.arange(30, dtype="float32").reshape(5, 2, 3)})
        store.commit()
        (leaf,) = store.leaves
        assert (leaf.mappable, leaf.in_place, leaf.atomic_replace, leaf.ranged_read) == FLAGS[layout]
        for name in Leaf.__annotations__.keys() | {n for n in vars(Leaf) if not n.startswith("_")}:
            assert hasattr(leaf, name), name
        rows = np.array([0, 3, 9])  # (slot, env) = (0, 0), (1, 1), (4, 1)
        assert leaf.take(rows).tolist() == np.arange(30).reshape(10, 3)[rows].tolist()
        assert leaf.read_rows(np.array([1, 4]), np.array([1, 1])).tolist() == np.arange(30).reshape(10, 3)[[3, 9]].tolist()
        leaf.advise("random")
        leaf.willneed(rows)
