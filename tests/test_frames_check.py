"""The per-step check of frame stacks in a store that keeps each frame once: the C
extension's one pass and the numpy path give the same flags, stored bytes and refusals.

:func:`mmreplay.frames.check_pair` runs in C where the extension is built (one pass over
memory per pair of leaves) and in numpy where it is not or ``MMREPLAY_NATIVE=0``; both
are compared here with a plain definition of what each flag means, on layouts that take
every branch of the C code (HWC stacks of 2, 4 and 8 frames of 1, 2 and 4 bytes, with
the AVX2 and SSE2 loops, pixels beyond the last whole round of 32 or 16, CHW frames of whole 16-byte runs, a stack axis in the
middle, odd sizes), and through stores written with either path.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from frames_episodes import Episodes, spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_frames import _random_case

import mmreplay as mr
from mmreplay.backends.native_rows import ENV
from mmreplay.frames import FOLLOWS, NEWEST_SAME, NEXT_FOLLOWS, check_pair


def _extension():
    try:
        return importlib.import_module("mmreplay._rowdecode").check_stacks
    except (ImportError, AttributeError):
        pytest.skip("the C extension mmreplay._rowdecode is not built: only the numpy path runs here")


def _frames(stack, axis, positions):
    return np.take(stack, list(positions), axis=axis)


def _expected(obs, nxt, kept, a, k):
    """The flags by their definition, env by env."""
    flags = np.zeros(len(obs), np.uint8)
    for e in range(len(obs)):
        o = obs[e]
        if kept is not None:
            if np.array_equal(_frames(o, a - 1, range(k - 1)), _frames(kept[e], a - 1, range(k - 1))):
                flags[e] |= FOLLOWS
            if np.array_equal(_frames(o, a - 1, [k - 1]), _frames(kept[e], a - 1, [k - 1])):
                flags[e] |= NEWEST_SAME
        if np.array_equal(_frames(nxt[e], a - 1, range(k - 1)), _frames(o, a - 1, range(1, k))):
            flags[e] |= NEXT_FOLLOWS
    return flags


#: (frame shape, stack axis, k, dtype): the branches of the C code
LAYOUTS = [
    ((84, 84), -1, 4, "uint8"),  # HWC Atari stacks: whole rounds of 32 (AVX2) and 16 pixels
    ((6, 8), -1, 4, "uint8"),  # 32 pixels with AVX2, then 16
    ((7, 10), -1, 4, "uint8"),  # 64 pixels with AVX2 (or 4 rounds of 16), then 6 as 64-bit words
    ((5, 6), -1, 4, "uint8"),  # 16 pixels, then 14 as 64-bit words
    ((3, 3), -1, 4, "uint8"),  # 36 bytes: not whole words, frames as runs
    ((4, 4), -1, 2, "uint8"),
    ((2, 4), -1, 8, "uint8"),
    ((3, 4), -1, 4, "uint16"),
    ((2, 6), -1, 2, "uint16"),
    ((2, 2), -1, 2, "int32"),
    ((6, 8), 0, 4, "uint8"),  # CHW: frames of whole 16-byte runs
    ((2, 8), 0, 3, "uint16"),
    ((5, 6), 0, 4, "uint8"),  # CHW frames of 30 bytes: runs
    ((3, 5), 1, 4, "uint8"),  # the stack axis in the middle
    ((2, 3), -1, 3, "bool"),
    ((7,), -1, 5, "int64"),
]


def _stacks(rng, ne, frame, axis, k, dtype):
    """Consecutive stacks of ``ne`` envs: obs, next (obs shifted by one new frame) and the
    stacks before obs's last frame was added (so obs equals them)."""
    if dtype == "bool":
        frames = rng.integers(0, 2, (ne, k + 1, *frame)).astype(bool)
    else:
        info = np.iinfo(dtype)
        frames = rng.integers(max(info.min, -1000), min(info.max, 1000), (ne, k + 1, *frame)).astype(dtype)
    a = (axis if axis >= 0 else len(frame) + 1 + axis) + 1

    def stack(first):
        return np.ascontiguousarray(np.moveaxis(frames[:, first : first + k], 1, a))

    return stack(0), stack(1), stack(0).copy(), a


def _change(rng, arrays, changes, dtype):
    for which, where in changes:
        flat = arrays[which].reshape(-1)
        i = int(where * len(flat)) % len(flat)
        flat[i] = ~flat[i] if dtype == "bool" else flat[i] + 1


@settings(max_examples=150, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    ne=st.integers(1, 3),
    with_kept=st.booleans(),
    changes=st.lists(st.tuples(st.integers(0, 2), st.floats(0, 1, exclude_max=True)), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_native_and_numpy_checks_set_the_flags_by_their_definition(layout, ne, with_kept, changes, seed):
    native = _extension()
    frame, axis, k, dtype = layout
    rng = np.random.default_rng(seed)
    obs, nxt, kept, a = _stacks(rng, ne, frame, axis, k, dtype)
    _change(rng, [obs, nxt, kept], changes, dtype)
    if not with_kept:
        kept = None
    want = _expected(obs, nxt, kept, a, k)
    with _simd_paths() as paths:
        for impl, simd in [*((native, p) for p in paths), (None, None)]:
            if simd is not None:
                paths.use(simd)
            kept_out = np.zeros_like(nxt)
            newest = np.zeros(obs.shape[:a] + obs.shape[a + 1 :], obs.dtype)
            flags = np.full(ne, 255, np.uint8)
            check_pair(obs, nxt, kept, kept_out, newest, flags, a, k, impl)
            np.testing.assert_array_equal(flags, want, err_msg=f"native={impl is not None}, {simd}")
            np.testing.assert_array_equal(newest, np.take(obs, k - 1, axis=a))
            np.testing.assert_array_equal(kept_out, nxt)


class _simd_paths:
    """The vector loops of the one pass this CPU has (``avx2``, ``sse2``), one after the
    other; the default one again afterwards."""

    def __enter__(self):
        self.ext = importlib.import_module("mmreplay._rowdecode")
        self.default = self.ext.stack_simd()
        self.names = []
        for name in ("avx2", "sse2"):
            try:
                self.ext.stack_simd(name)
            except ValueError:
                continue
            self.names.append(name)
        self.ext.stack_simd(self.default)
        return self

    def __iter__(self):
        return iter(self.names)

    def use(self, name):
        self.ext.stack_simd(name)

    def __exit__(self, *exc):
        self.ext.stack_simd(self.default)


def test_the_native_check_refuses_buffers_of_the_wrong_size():
    native = _extension()
    obs = np.zeros((2, 8, 8, 4), np.uint8)
    flags, newest, out = np.zeros(2, np.uint8), np.zeros((2, 8, 8), np.uint8), np.zeros_like(obs)
    with pytest.raises(ValueError, match="nxt has 256 bytes, expected 512"):
        native(obs, obs[:1], None, out, newest, flags, 64, 4, 1)
    with pytest.raises(ValueError, match="newest_out"):
        native(obs, obs, None, out, newest[:1], flags, 64, 4, 1)
    with pytest.raises(ValueError, match="bad stack layout"):
        native(obs, obs, None, out, newest, flags, 64, 1, 4)
    with pytest.raises(BufferError):  # kept_out must be writable
        native(obs, obs, None, out.tobytes(), newest, flags, 64, 4, 1)


def _write(tmp_path, name, monkeypatch, native, k, axis, pad, steps, bad_at=()):
    """Random episodes into a new store with the native check on or off; at the steps in
    ``bad_at`` a broken step is tried first and its refusal recorded."""
    monkeypatch.setenv(ENV, "1" if native else "0")
    frame = (5, 6) if axis == -1 else (6, 8)
    store = mr.create(
        tmp_path / name, spec(frame, k, axis), 12, num_envs=3, frames=mr.Frames(frame_stack=k, pad=pad),
        commit_every=5,
    )
    assert (store._frames.native is not None) == native
    episodes = Episodes(3, frame, k, axis, pad, 0.2, 7)
    refusals = []
    for t in range(steps):
        step = episodes.step()
        if t in bad_at:
            for leaf, env in (("obs", t % 3), ("next_obs", (t + 1) % 3)):
                bad = dict(step, **{leaf: step[leaf].copy()})
                oldest = np.moveaxis(bad[leaf][env], axis, 0)[0]  # a view: frame 0 of the stack
                oldest.flat[t % oldest.size] += 1
                with pytest.raises(mr.BadInputError) as refused:
                    store.add(bad)
                refusals.append(str(refused.value))
        store.add(step)
    store.commit()
    return store, refusals


@pytest.mark.parametrize("k,axis,pad", [(4, -1, "repeat"), (4, 0, "zeros"), (2, -1, "zeros")])
def test_native_and_numpy_paths_store_the_same_bytes_and_refuse_the_same_steps(tmp_path, monkeypatch, k, axis, pad):
    _extension()
    bad_at = (3, 8, 17)
    fast, fast_refused = _write(tmp_path, "native", monkeypatch, True, k, axis, pad, 30, bad_at)
    slow, slow_refused = _write(tmp_path, "numpy", monkeypatch, False, k, axis, pad, 30, bad_at)
    assert len(fast_refused) == 2 * len(bad_at) and fast_refused == slow_refused
    for a, b in zip(fast.stored_leaves, slow.stored_leaves, strict=True):
        assert a.info.path == b.info.path
        np.testing.assert_array_equal(a.read(slice(None)), b.read(slice(None)), err_msg=a.info.path)
    full = mr.create(tmp_path / "full", fast.spec, 12, num_envs=3)
    episodes = Episodes(3, (5, 6) if axis == -1 else (6, 8), k, axis, pad, 0.2, 7)
    for _ in range(30):
        full.add(episodes.step())
    steps = np.arange(*fast.window[:2])
    for want, got in zip(full.read_steps(steps), fast.read_steps(steps)):
        np.testing.assert_array_equal(want, got)
    for store in (fast, slow, full):
        store.close()


def test_a_refused_step_leaves_the_kept_stacks_as_they_were(tmp_path, monkeypatch):
    """A step refused for its next stacks (the pass has copied them) or for its observation
    stacks changes nothing: the same step, corrected, is checked against the stacks before."""
    for native in (True, False):
        if native:
            _extension()
        monkeypatch.setenv(ENV, "1" if native else "0")
        with mr.create(tmp_path / f"b{native}", spec((5, 6), 4, -1), 10, num_envs=2,
                       frames=mr.Frames(frame_stack=4)) as store:
            episodes = Episodes(2, (5, 6), 4, -1, "repeat", 0.0, 1)
            store.add(episodes.step())
            step = episodes.step()
            bad = dict(step, next_obs=step["next_obs"] + 1)  # obs follows, next does not
            with pytest.raises(mr.BadInputError, match="next observation stack"):
                store.add(bad)
            store.add(step)  # checked against the first step's next stacks, not bad's
            later = episodes.step()
            store.add(later)
            np.testing.assert_array_equal(store.get(-1)["obs"], later["obs"])
            np.testing.assert_array_equal(store.get(-2)["next_obs"], step["next_obs"])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), k=st.sampled_from([2, 4]), axis=st.sampled_from([-1, 0]))
def test_numpy_path_reads_the_same_as_a_store_that_keeps_everything(tmp_path_factory, monkeypatch, seed, k, axis):
    """The differential test of test_frames.py, forced onto the numpy path."""
    monkeypatch.setenv(ENV, "0")
    _random_case(
        tmp_path_factory, num_envs=3, k=k, axis=axis, pad="repeat", end=0.1, capacity=9, steps=30,
        commits={5, 20}, small_side=False, seed=seed,
    )


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("given", ["int16", "int16 obs only", "fortran"])
def test_stacks_of_another_dtype_or_memory_order_read_the_same(tmp_path, given, axis):
    """Stacks the one pass does not take (int16 values for a uint8 leaf, which cast
    without loss, for both leaves or for the observations only; Fortran-ordered arrays)
    are checked and stored in numpy alike."""
    frame = (5, 6) if axis == -1 else (6, 8)
    sp = spec(frame, 4, axis)
    full = mr.create(tmp_path / "full", sp, 12, num_envs=3)
    once = mr.create(tmp_path / "once", sp, 12, num_envs=3, frames=mr.Frames(frame_stack=4))
    episodes = Episodes(3, frame, 4, axis, "repeat", 0.2, 3)
    convert = np.asfortranarray if given == "fortran" else (lambda a: a.astype(np.int16))
    for _ in range(30):
        step = episodes.step()
        full.add(step)
        nxt = step["next_obs"] if given == "int16 obs only" else convert(step["next_obs"])
        once.add(dict(step, obs=convert(step["obs"]), next_obs=nxt))
    steps = np.arange(*once.window[:2])
    for want, got in zip(full.read_steps(steps), once.read_steps(steps)):
        np.testing.assert_array_equal(want, got)
    full.close()
    once.close()


def test_big_endian_stacks_are_checked_by_value_not_by_their_bytes(tmp_path):
    """Stacks given in the other byte order than the leaf's are checked by value, not by
    the one pass (which compares bytes): a step whose bytes are those of the stacks before
    it while its values are not is refused (here after the writer is reopened), and
    the steps read back as added."""
    _extension()
    pytest.importorskip("zstandard")
    pytest.importorskip("cramjam")
    sp = {"obs": mr.ArraySpec((3, 4, 4), ">u2"), "next_obs": mr.ArraySpec((3, 4, 4), ">u2")}
    rng = np.random.default_rng(5)
    frames = rng.integers(1, 2**16, (9, 2, 3, 4)).astype(">u2")

    def step(t):  # stacks of frames t-3..t (t-3 < 0: the first frame repeated), and the next
        stack = np.stack([frames[max(0, s)] for s in range(t - 3, t + 1)], -1)
        nxt = np.stack([frames[max(0, s)] for s in range(t - 2, t + 2)], -1)
        return {"obs": stack.astype(">u2"), "next_obs": nxt.astype(">u2")}

    path = tmp_path / "b"
    with mr.create(path, sp, 16, num_envs=2, backend="zarr", compression={"obs": "rows:lz4"},
                   frames=mr.Frames(frame_stack=4)) as store:
        for t in range(4):
            store.add(step(t))
    with mr.open(path, "a") as store:
        for t in range(4, 7):  # each checked against the one before
            store.add(step(t))
        kept = step(6)["next_obs"]
        swapped = kept.astype("<u2").view(">u2")  # the bytes of little-endian stacks, other values
        assert not np.array_equal(swapped, kept)
        # a next stack of native values whose bytes are the shifted bytes of ``swapped``
        nxt = np.concatenate([kept[..., 1:], kept[..., -1:]], -1).astype("<u2")
        with pytest.raises(mr.BadInputError, match="a frame stack must be the previous step's stack"):
            store.add({"obs": swapped, "next_obs": nxt})
        store.add(step(7))
        for t in range(4, 8):
            np.testing.assert_array_equal(store.get(t - 8)["obs"], step(t)["obs"])
            np.testing.assert_array_equal(store.get(t - 8)["next_obs"], step(t)["next_obs"])
