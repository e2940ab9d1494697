"""Frames as pictures: what the GIF / PNG / MP4 hold is what the store holds."""

from __future__ import annotations

import os
import pty
import shutil
import subprocess
import sys

import numpy as np
import pytest

import mmreplay as mr
from mmreplay.pictures import BACKGROUND, Layout
from mmreplay.terminal_images import image_protocol, terminal_image

Image = pytest.importorskip("PIL.Image")

DATASETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "datasets")
PIXELS = os.path.join(DATASETS, "pointchase-pixels-hdf5")
ZSTD = os.path.join(DATASETS, "pointchase-pixels-zstd")
MMREPLAY = shutil.which("mmreplay") or os.path.join(os.path.dirname(sys.executable), "mmreplay")


def shell(*args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([MMREPLAY, *map(str, args)], capture_output=True, text=True, env=env, timeout=300)


def make_store(
    path, shape, steps=40, num_envs=2, dtype="uint8", ends=(9, 24), colours=None, backend="zarr", **kw
):
    """A store of distinct synthetic frames; env 0's episodes end at ``ends`` (terminated)."""
    rng = np.random.default_rng(0)
    spec = {
        "obs": mr.ArraySpec(shape, dtype),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
    }
    if colours is None:
        frames = rng.integers(0, 256, (steps, num_envs, *shape)).astype(dtype)
    else:
        frames = colours[rng.integers(0, len(colours), (steps, num_envs, *shape[:-1]))]
    reward = rng.normal(size=(steps, num_envs)).astype("float32")
    term = np.zeros((steps, num_envs), bool)
    term[[e for e in ends if e < steps], 0] = True
    with mr.create(path, spec, capacity=steps, num_envs=num_envs, backend=backend, **kw) as store:
        store.extend({"obs": frames, "reward": reward, "terminated": term})
    return frames, reward


def gif_frames(path) -> list[np.ndarray]:
    im = Image.open(path)
    out = []
    for i in range(im.n_frames):
        im.seek(i)
        out.append(np.asarray(im.convert("RGB")))
    return out


# --- layouts ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, layout",
    [
        ((84, 84), "HW"),
        ((84, 84, 3), "HWC"),
        ((84, 84, 1), "HWC"),
        ((3, 84, 84), "CHW"),
        ((4, 84, 84), "KHW"),
        ((84, 84, 4), "HWK"),
        ((84, 84, 12), "HW(KC)"),
        ((4, 84, 84, 3), "KHWC"),
        ((4, 3, 84, 84), "KCHW"),
    ],
)
def test_layouts_are_recognised_from_the_shape(shape, layout):
    assert str(Layout.infer(shape)) == layout


@pytest.mark.parametrize(
    "shape, layout, newest",
    [
        ((4, 16, 12), "KHW", lambda x: x[-1, :, :, None]),
        ((16, 12, 4), "HWK", lambda x: x[:, :, -1:]),
        ((3, 16, 12), "CHW", lambda x: x.transpose(1, 2, 0)),
        ((16, 12, 6), "HW(KC)", lambda x: x[:, :, 3:]),
        ((2, 3, 16, 12), "KCHW", lambda x: x[-1].transpose(1, 2, 0)),
        ((2, 16, 12, 3), "KHWC", lambda x: x[-1]),
    ],
)
def test_each_layout_shows_the_newest_frame_of_a_stack(shape, layout, newest):
    x = np.random.default_rng(1).integers(0, 256, (5, *shape), dtype=np.uint8)
    got = Layout.parse(layout, shape).normalise(x)[:, -1]
    assert np.array_equal(got, np.stack([newest(f) for f in x]))


@pytest.mark.parametrize(
    "shape, text, error",
    [
        ((7,), None, "not a frame layout"),
        ((84, 84, 3), "HWX", "letters"),
        ((84, 84, 3), "HW", "axes"),
        ((84, 84, 2), "HWC", "2 channels"),
        ((84, 84, 3), "HHW", "once"),
    ],
)
def test_bad_layouts_say_what_was_expected(shape, text, error):
    with pytest.raises(mr.BadInputError, match=error):
        Layout.parse(text, shape) if text else Layout.infer(shape)


# --- GIF -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["zarr", "hdf5"])
def test_gif_of_gray_frames_equals_the_store(tmp_path, backend):
    frames, _ = make_store(tmp_path / "b", (20, 16), backend=backend)
    out = mr.view(mr.open(tmp_path / "b"), tmp_path / "ep.gif", env=1, steps="5:30", scale=1)
    got = gif_frames(out)
    assert len(got) == 25
    for i, g in enumerate(got):
        assert np.array_equal(g[..., 0], frames[5 + i, 1]), i


def test_gif_of_rgb_frames_with_few_colours_is_lossless_and_upscaled(tmp_path):
    colours = np.random.default_rng(2).integers(0, 256, (200, 3)).astype(np.uint8)
    frames, _ = make_store(tmp_path / "b", (12, 10, 3), colours=colours, compression="zstd")
    out = mr.view(mr.open(tmp_path / "b"), tmp_path / "ep.gif", steps="0:40", scale=3)
    got = gif_frames(out)
    assert len(got) == 40
    for i, g in enumerate(got):
        assert g.shape == (36, 30, 3)
        assert np.array_equal(g[::3, ::3], frames[i, 0]), i
        assert np.array_equal(g, np.repeat(np.repeat(frames[i, 0], 3, 0), 3, 1))


def test_gif_of_rgb_frames_with_many_colours_is_close(tmp_path):
    frames, _ = make_store(tmp_path / "b", (12, 10, 3), steps=10)
    got = gif_frames(mr.view(mr.open(tmp_path / "b"), tmp_path / "ep.gif", steps="0:10", scale=1))
    err = np.abs(np.stack(got).astype(int) - frames[:, 0].astype(int))
    assert len(got) == 10 and err.mean() < 16


def test_a_frame_stack_is_its_newest_frame_or_side_by_side(tmp_path):
    frames, _ = make_store(tmp_path / "b", (4, 16, 12), steps=12)  # KHW: 4 gray frames
    store = mr.open(tmp_path / "b")
    newest = gif_frames(mr.view(store, tmp_path / "a.gif", steps="0:12", scale=1))
    assert np.array_equal(np.stack(newest)[..., 0], frames[:, 0, -1])
    side = gif_frames(mr.view(store, tmp_path / "s.gif", steps="0:12", scale=1, stack=True))
    assert side[0].shape == (16, 4 * 12 + 3, 3)
    for i, g in enumerate(side):
        for k in range(4):
            assert np.array_equal(g[:, k * 13 : k * 13 + 12, 0], frames[i, 0, k]), (i, k)
        assert (g[:, 12] == BACKGROUND[0]).all()  # one background pixel between frames


def test_float_frames_in_0_1_are_scaled_to_bytes(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (6, 1, 16, 16)).astype(np.float32) / 255
    with mr.create(tmp_path / "b", {"obs": mr.ArraySpec((16, 16), "float32")}, 6) as store:
        store.extend({"obs": x})
    got = gif_frames(mr.view(mr.open(tmp_path / "b"), tmp_path / "f.gif", scale=1))
    assert np.array_equal(np.stack(got)[..., 0], np.rint(x[:, 0] * 255).astype(np.uint8))


def test_depth_frames_with_nan_and_inf_pixels_show_the_finite_ones_scaled(tmp_path):
    """A depth camera's missing returns (NaN, inf) once made every pixel of the clip 0."""
    import warnings

    metres = np.linspace(0.5, 4.0, 16, dtype=np.float32)
    depth = np.stack([np.tile(np.roll(metres, t), (1, 16, 1)) for t in range(6)])  # [T, 1, H, W]
    depth[:, 0, 3, 3], depth[:, 0, 5, 5] = np.nan, np.inf
    with mr.create(tmp_path / "b", {"obs": mr.ArraySpec((16, 16), "float32")}, 6) as store:
        store.extend({"obs": depth})
    with warnings.catch_warnings(), mr.open(tmp_path / "b") as reader:
        warnings.simplefilter("error")
        got = np.stack(gif_frames(mr.view(reader, tmp_path / "d.gif", scale=1)))[..., 0]
    shown = np.where(np.isfinite(depth[:, 0]), depth[:, 0], 0.5)  # as the lowest finite value
    want = np.rint((shown.astype(np.float64) - 0.5) * 255 / 3.5).astype(np.uint8)
    assert np.array_equal(got, want)


# --- contact sheet -----------------------------------------------------------------------


def test_contact_sheet_puts_frames_and_labels_on_the_grid(tmp_path):
    frames, reward = make_store(tmp_path / "b", (16, 20, 3), steps=40, ends=(9, 24))
    store = mr.open(tmp_path / "b")
    fv = mr.view(store, episode=1, scale=2, columns=4)  # env 0's second episode: steps 10..24
    assert list(fv.steps) == list(range(10, 25)) and fv.status == "terminated"
    out = fv.save(tmp_path / "sheet.png")
    sheet = np.asarray(Image.open(out).convert("RGB"))
    geo = fv.geometry()
    assert (geo.columns, geo.rows) == (4, 4)
    assert sheet.shape == (geo.size[1], geo.size[0], 3)
    for i, step in enumerate(range(10, 25)):
        x0, y0, x1, y1 = geo.frame_box(i)
        assert (x0, y0) == (
            geo.margin + (i % 4) * (40 + geo.gap),
            geo.header_height + (i // 4) * (32 + geo.label_height + geo.gap),
        )
        want = np.repeat(np.repeat(frames[step, 0], 2, 0), 2, 1)
        assert np.array_equal(sheet[y0:y1, x0:x1], want), i
        lx0, ly0, lx1, ly1 = geo.label_box(i)
        assert (sheet[ly0:ly1, lx0:lx1] != BACKGROUND).any(), f"label {i} is empty"
    # the header names the episode, its return and where it ended, in drawn pixels
    assert (sheet[: geo.header_height - 2, :] != BACKGROUND).any()
    assert (
        fv.summary()[2]
        == f"return {float(np.sum(reward[10:25, 0].astype(np.float64))):.6g} · terminated at step 24"
    )
    # the last frame ended the episode: it is framed in the end colour
    x0, y0, x1, y1 = geo.frame_box(14)
    assert tuple(sheet[y0 - 1, x0 + 3]) == (220, 60, 60)
    # nothing is drawn in the gaps between cells
    gx = geo.frame_box(0)[2] + geo.gap // 2
    assert (sheet[geo.header_height :, gx] == BACKGROUND).all()


def test_a_long_range_sheet_shows_first_and_last_frames(tmp_path):
    frames, _ = make_store(tmp_path / "b", (8, 8), steps=100, ends=())
    fv = mr.view(mr.open(tmp_path / "b"), steps="0:100", max_frames=10, scale=1)
    img = np.asarray(fv.sheet().convert("L"))
    geo = fv.geometry()
    assert geo.columns * geo.rows >= 10 and len(fv) == 100
    x0, y0, x1, y1 = geo.frame_box(0)
    assert np.array_equal(img[y0:y1, x0:x1], frames[0, 0])
    x0, y0, x1, y1 = geo.frame_box(9)
    assert np.array_equal(img[y0:y1, x0:x1], frames[99, 0])


def test_notebook_display_is_an_animated_gif_or_the_sheet(tmp_path):
    make_store(tmp_path / "b", (8, 8), steps=20)
    fv = mr.view(mr.open(tmp_path / "b"), steps="0:20")
    html = fv._repr_html_()
    assert html.startswith('<figure><img src="data:image/gif;base64,')
    assert fv._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"


# --- which steps ---------------------------------------------------------------------------


def test_default_is_the_newest_complete_episode_and_bad_choices_are_errors(tmp_path):
    make_store(tmp_path / "b", (8, 8), steps=40, ends=(9, 24))
    store = mr.open(tmp_path / "b")
    fv = mr.view(store)
    assert (fv.steps[0], fv.steps[-1], fv.episode, fv.status) == (10, 24, 1, "terminated")
    assert list(mr.view(store, episode=-1).steps) == list(range(25, 40))
    assert list(mr.view(store, steps="-5:").steps) == list(range(35, 40))
    with pytest.raises(mr.BadInputError, match="episode must be in"):
        mr.view(store, episode=3)
    with pytest.raises(mr.BadInputError, match="not both"):
        mr.view(store, episode=0, steps="0:3")
    with pytest.raises(mr.BadInputError, match="no retained"):
        mr.view(store, steps="50:60")
    with pytest.raises(mr.BadInputError, match="env must be"):
        mr.view(store, env=2)
    with pytest.raises(mr.BadInputError, match="no leaf 'nope'"):
        mr.view(store, leaf="nope")
    with pytest.raises(mr.BadInputError, match="not a frame layout"):
        mr.view(store, leaf="reward")


def test_frames_of_a_store_the_ring_wrapped_come_from_their_slots(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.integers(0, 256, (30, 1, 8, 8), dtype=np.uint8)
    with mr.create(tmp_path / "b", {"obs": mr.ArraySpec((8, 8), "uint8")}, capacity=12) as store:
        store.extend({"obs": x})
    fv = mr.view(mr.open(tmp_path / "b"), scale=1)
    assert list(fv.steps) == list(range(18, 30))
    assert np.array_equal(fv.pictures[..., 0], x[18:, 0])


def test_an_episode_whose_start_the_ring_overwrote_shows_how_it_ended(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (30, 1, 8, 8), dtype=np.uint8)
    term = np.zeros((30, 1), bool)
    term[[5, 20], 0] = True  # retained 18..29: the episode ending at 20 lost its start
    spec = {"obs": mr.ArraySpec((8, 8), "uint8"), "terminated": mr.ArraySpec((), "bool")}
    with mr.create(tmp_path / "b", spec, capacity=12) as store:
        store.extend({"obs": x, "terminated": term})
    store = mr.open(tmp_path / "b")
    fv = mr.view(store, steps="18:30", scale=1)
    assert fv.ends[2] == "terminated" and not any(fv.ends[:2] + fv.ends[3:])
    first = mr.view(store, episode=0, scale=1)
    assert list(first.steps) == [18, 19, 20] and first.ends == ["", "", "terminated"]
    assert first.summary()[2] == "terminated at step 20 (its start left the ring)"
    sheet = np.asarray(first.sheet().convert("RGB"))
    x0, y0, _, _ = first.geometry().frame_box(2)
    assert tuple(sheet[y0 - 1, x0 + 3]) == (220, 60, 60)  # framed as an end


# --- command line ----------------------------------------------------------------------------


def test_view_command_writes_a_gif_equal_to_the_reference_store(tmp_path):
    out = tmp_path / "ep.gif"
    r = shell("view", PIXELS, "-o", out, "--env", "2", "--episode", "0", "--scale", "1")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "return" in r.stdout
    with mr.open(PIXELS) as store:
        span = store.episode_index(env=2)[0]
        want = store.get(slice(span.first_step - store.first_step, span.last_step + 1 - store.first_step))
    got = gif_frames(out)
    pixels = want["observation"]["pixels"][:, 2]
    distinct = [0] + [i for i in range(1, len(pixels)) if not np.array_equal(pixels[i], pixels[i - 1])]
    assert len(got) == len(distinct)  # GIF merges repeated frames into one longer frame
    for g, i in zip(got, distinct):
        assert np.array_equal(g, pixels[i])
    again = shell("view", PIXELS, "-o", out)
    assert again.returncode == 2 and "already exists" in again.stderr


def test_view_command_contact_sheet_and_errors(tmp_path):
    r = shell("view", ZSTD, "-o", tmp_path / "s.png", "--env", "1", "--steps", "10:60")
    assert r.returncode == 0, r.stderr
    assert Image.open(tmp_path / "s.png").format == "PNG"
    bad = shell("view", ZSTD, "-o", tmp_path / "s.bmp")
    assert bad.returncode == 2 and ".gif, .png" in bad.stderr
    bad = shell("view", ZSTD, "-o", tmp_path / "t.png", "--layout", "CHW")
    assert bad.returncode == 2 and "layout" in bad.stderr and not (tmp_path / "t.png").exists()


def test_mp4_without_imageio_ffmpeg_names_the_extra_and_writes_nothing(tmp_path):
    make_store(tmp_path / "b", (16, 16, 3), steps=20)
    code = (
        "import sys; sys.modules['imageio_ffmpeg'] = None\n"  # as if it were not installed
        "import mmreplay as mr\n"
        f"mr.view(mr.open({str(tmp_path / 'b')!r}), {str(tmp_path / 'ep.mp4')!r})\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "pip install 'mmreplay[mp4]'" in r.stderr
    assert os.listdir(tmp_path) == ["b"]


def test_mp4_has_every_frame(tmp_path):
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
    make_store(tmp_path / "b", (16, 16, 3), steps=20)
    out = mr.view(mr.open(tmp_path / "b"), tmp_path / "ep.mp4", steps="0:20", scale=3)
    reader = imageio_ffmpeg.read_frames(out)
    meta = next(reader)
    assert tuple(meta["size"]) == (48, 48)  # 16 px frames upscaled 3x
    assert sum(1 for _ in reader) == 20


# --- terminals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "environ, tty, want",
    [
        ({"KITTY_WINDOW_ID": "1"}, True, "kitty"),
        ({"TERM": "xterm-kitty"}, True, "kitty"),
        ({"TERM_PROGRAM": "iTerm.app"}, True, "iterm2"),
        ({"TERM_PROGRAM": "WezTerm"}, True, "iterm2"),
        ({"TERM": "xterm-256color"}, True, None),
        ({"KITTY_WINDOW_ID": "1"}, False, None),
        ({"KITTY_WINDOW_ID": "1", "TMUX": "/tmp/t"}, True, None),
    ],
)
def test_image_protocol_from_the_environment(environ, tty, want):
    assert image_protocol(environ, tty) == want


def test_kitty_images_are_sent_in_chunks():
    png = bytes(range(256)) * 40
    seq = terminal_image(png, "kitty")
    parts = seq.rstrip("\n").split("\x1b\\")[:-1]
    assert parts[0].startswith("\x1b_Gf=100,a=T,m=1;") and parts[-1].startswith("\x1b_Gm=0;")
    import base64

    assert base64.b64decode("".join(p.split(";", 1)[1] for p in parts)) == png
    assert terminal_image(png, "iterm2").startswith("\x1b]1337;File=inline=1;size=10240")


def test_inspect_shows_thumbnails_only_in_an_image_terminal():
    env = {**os.environ, "KITTY_WINDOW_ID": "1"}
    env.pop("TMUX", None)
    piped = shell("inspect", PIXELS, env=env)
    assert piped.returncode == 0 and "\x1b" not in piped.stdout
    assert "mmreplay view" in piped.stdout and "observation/pixels" in piped.stdout
    main, side = pty.openpty()
    proc = subprocess.Popen([MMREPLAY, "inspect", PIXELS], stdout=side, stderr=subprocess.DEVNULL, env=env)
    os.close(side)
    out = b""
    while True:  # read while it writes: a full terminal buffer would block it
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # EIO: the child closed its side
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=300) == 0, out[-500:]
    assert b"\x1b_Gf=100,a=T" in out and b"newest frames of env 0" in out
