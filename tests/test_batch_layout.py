"""``sample(..., layout="NCHW" | "NHWC")``: picture leaves come contiguous in the model's
layout, bit for bit numpy's transposed-then-contiguous batch, for every kind of leaf
(memory-mapped, row frames, chunks, each frame stored once), natively and in Python,
into a new batch, into the caller's arrays or CPU torch tensors, and in a reader whose
items the writer overwrote."""

from __future__ import annotations

import os

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.backends import native_rows

H, W, K, ENVS, EPISODE = 12, 10, 4, 2, 9

KINDS = {
    "mapped": {},
    "rows:lz4": {"compression": {"obs": "rows:lz4", "next_obs": "rows:lz4", "rgb": "rows:lz4"}},
    "rows:zstd:1": {"compression": {"obs": "rows:zstd:1", "next_obs": "rows:zstd:1"}},
    "zstd chunks": {"compression": {"obs": "zstd", "rgb": "zstd"}},
    "frames once": {"frames": mr.Frames(frame_stack=K)},
    "frames once + lz4": {"frames": mr.Frames(frame_stack=K), "compression": {"obs": "rows:lz4"}},
}


def steps(n: int, chw: bool) -> list[dict[str, np.ndarray]]:
    """Frame stacks of episodes of ``EPISODE`` steps (the first stack repeats its frame),
    stacked on the last axis or (``chw``) the first, and an RGB float leaf."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (n + 1, ENVS, H, W), np.uint8)
    out = []
    for t in range(n):
        start = t - t % EPISODE
        stack = lambda u, start=start: np.stack([frames[max(u - b, start)] for b in range(K - 1, -1, -1)], 1)  # noqa: E731
        obs, nxt = stack(t), stack(t + 1)  # [envs, K, H, W]
        if not chw:
            obs, nxt = (
                np.ascontiguousarray(np.moveaxis(obs, 1, -1)),
                np.ascontiguousarray(np.moveaxis(nxt, 1, -1)),
            )
        rgb = rng.random((ENVS, 16, 16, 3), np.float32)
        out.append(
            {"obs": obs, "next_obs": nxt, "rgb": rgb, "terminated": np.full(ENVS, t % EPISODE == EPISODE - 1)}
        )
    return out


def make(path, kind: str, chw: bool, n: int = 40, capacity: int = 32) -> mr.Store:
    shape = (K, H, W) if chw else (H, W, K)
    spec = {
        "obs": mr.ArraySpec(shape, "uint8"),
        "next_obs": mr.ArraySpec(shape, "uint8"),
        "rgb": mr.ArraySpec((16, 16, 3), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
    }
    store = mr.create(path, spec, capacity, ENVS, chunk_steps=8, **KINDS[kind])
    for step in steps(n, chw):
        store.add(step)
    return store


def in_numpy(batch: dict[str, np.ndarray], layout: str, lead: int) -> dict[str, np.ndarray]:
    """What a model's code does: each picture transposed to ``layout``, then made contiguous."""
    out = {}
    for key, v in batch.items():
        if v.ndim - lead == 3:
            last = v.shape[-1] in (3, K) and v.shape[-3] >= 8
            if layout == "NCHW" and last:
                v = np.moveaxis(v, -1, lead)
            elif layout == "NHWC" and not last:
                v = np.moveaxis(v, lead, -1)
        out[key] = np.ascontiguousarray(v)
    return out


def same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        g = np.asarray(got[key])
        assert g.flags.c_contiguous and g.shape == want[key].shape and g.dtype == want[key].dtype, key
        assert g.tobytes() == want[key].tobytes(), key


@pytest.fixture(params=["native", "python"])
def way(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setenv(native_rows.ENV, "0")  # leaves choose when made; gathers at each call
    elif native_rows.extension() is None:
        pytest.skip("the C extension is not built here")
    return request.param


@pytest.mark.filterwarnings("ignore:leaf .* compresses chunks")
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chw", [False, True], ids=["hwc", "chw"])
def test_a_batch_in_a_layout_is_numpys_transposed_contiguous_batch(tmp_path, way, kind, chw):
    if "rows" in kind or "lz4" in kind:
        pytest.importorskip("cramjam")
        pytest.importorskip("zstandard")
    with make(tmp_path / "b", kind, chw) as store:
        for num_steps in (None, 3):
            lead = 1 if num_steps is None else 2
            for layout in ("NCHW", "NHWC"):
                want = in_numpy(store.sample(48, num_steps, rng=2), layout, lead)
                same(store.sample(48, num_steps, rng=2, layout=layout), want)
                batch = store.empty_batch(48, num_steps, layout=layout)
                assert store.sample(48, num_steps, rng=2, layout=layout, out=batch) is batch
                same(batch, want)


def test_torch_tensors_are_filled_in_place(tmp_path):
    torch = pytest.importorskip("torch")
    with make(tmp_path / "b", "frames once", chw=False) as store:
        want = in_numpy(store.sample(16, rng=3), "NCHW", 1)
        batch = {k: torch.from_numpy(v) for k, v in store.empty_batch(16, layout="NCHW").items()}
        if torch.cuda.is_available():
            batch = {k: v.pin_memory() for k, v in batch.items()}
        got = store.sample(16, rng=3, layout="NCHW", out=batch)
        assert got is batch and batch["obs"].shape == (16, K, H, W)
        same({k: v.numpy() for k, v in batch.items()}, want)


def test_a_reader_rereads_overwritten_items_in_the_layout(tmp_path):
    pytest.importorskip("cramjam")
    make(tmp_path / "b", "rows:lz4", chw=False).close()
    writer = mr.open(tmp_path / "b", "a")
    reader = mr.open(tmp_path / "b", "r")
    plain = mr.open(tmp_path / "b", "r")
    try:
        for step in steps(20, chw=False):  # the readers' oldest steps are overwritten
            writer.add(step)
        writer.commit()
        want = in_numpy(plain.sample(64, rng=4), "NHWC", 1)
        same(reader.sample(64, rng=4, layout="NHWC"), want)
    finally:
        for s in (plain, reader, writer):
            s.close()


def test_a_bad_layout_or_batch_is_refused_before_anything_is_drawn(tmp_path):
    with make(tmp_path / "b", "mapped", chw=False) as store:
        with pytest.raises(ValueError, match=r"layout must be one of \('NCHW', 'NHWC'\)"):
            store.sample(4, layout="CHW")
        stored = store.empty_batch(4)  # [4, H, W, K]: not the layout's shape
        with pytest.raises(
            mr.BadInputError, match=rf"out leaf 'next_obs': expected .* shape \(4, {K}, {H}, {W}\)"
        ):
            store.sample(4, layout="NCHW", out=stored)
        strided = {k: np.moveaxis(v, -1, 1) if v.ndim == 4 else v for k, v in stored.items()}
        with pytest.raises(
            mr.BadInputError, match="out leaf 'next_obs': a batch in a layout is written in contiguous"
        ):
            store.sample(4, layout="NCHW", out=strided)
    assert os.path.isdir(tmp_path / "b")
