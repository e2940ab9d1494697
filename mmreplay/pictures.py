"""Frames as pictures: an episode or a step range of an image leaf as a GIF, an MP4 or a
contact sheet (a PNG grid of frames with their step numbers, the return and the end).

Pixel-RL bugs are found by looking (a wrong crop, a stack in the wrong order, a reset
frame where the last one should be, a black screen), so this reads one env's frames of
one leaf and lays them out as images. The layout of a frame (grayscale, RGB, CHW or HWC,
frame stacks) is recognised from the leaf's shape and can be named; see :class:`Layout`.
Frames are shown exactly as the store returns them. Pillow (``mmreplay[view]``) draws;
MP4 also needs ``imageio-ffmpeg`` (``mmreplay[mp4]``).
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import BadInputError, NotEnoughDataError
from .files import raise_named
from .selection import READ_BLOCK_FRAMES, frame_leaves, pick_leaf, read_leaf, select, step_ends, to_uint8
from .spec import Layout

if TYPE_CHECKING:
    from .store import Store

__all__ = [
    "Layout",
    "ViewOptions",
    "FrameView",
    "SheetGeometry",
    "frames",
    "view",
    "frame_leaves",
    "thumbnails",
    "png_bytes",
]

Progress = Callable[[int], Any]

#: frames drawn in a contact sheet at most (picked evenly, first and last included)
SHEET_MAX_FRAMES = 48
#: frames an inline (notebook) animation holds at most; longer views show their sheet
INLINE_MAX_FRAMES = 600
BACKGROUND = (48, 48, 48)
TEXT = (235, 235, 235)
END_COLOURS = {"terminated": (220, 60, 60), "truncated": (230, 190, 40)}
SUFFIXES = (".gif", ".png", ".mp4")


def _pil() -> Any:
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise ImportError("viewing frames needs pillow: pip install 'mmreplay[view]'") from None
    return Image, ImageDraw, ImageFont


def compose(x: np.ndarray, stack: bool) -> np.ndarray:
    """``[T, K, H, W, C]`` uint8 to displayable ``[T, H, W', C]`` with C 1 or 3: the
    newest (last) frame of a stack, or with ``stack`` the k frames side by side, oldest
    first, one background pixel apart."""
    if x.shape[-1] == 4:
        x = x[..., :3]  # RGBA: the colour, as RL renderers' alpha is opaque
    if not stack or x.shape[1] == 1:
        return x[:, -1]
    t, k, h, w, c = x.shape
    out = np.empty((t, h, k * w + (k - 1), c), np.uint8)
    out[...] = BACKGROUND[0] if c == 1 else np.array(BACKGROUND, np.uint8)
    for i in range(k):
        out[:, :, i * (w + 1) : i * (w + 1) + w] = x[:, i]
    return out


def upscale(x: np.ndarray, factor: int) -> np.ndarray:
    """Nearest-neighbour upscaling of ``[..., H, W, C]`` by a whole factor (lossless)."""
    if factor == 1:
        return x
    return np.repeat(np.repeat(x, factor, axis=-3), factor, axis=-2)


def auto_scale(height: int, width: int) -> int:
    """A whole factor that makes small frames big enough to see (84 -> 2, 32 -> 3)."""
    return max(1, math.ceil(96 / max(height, width)))


# --- what to show ------------------------------------------------------------------


@dataclass(frozen=True)
class ViewOptions:
    """How frames are drawn.

    Attributes:
        layout: the frame layout (:class:`Layout` letters); None recognises it from the shape.
        stack: lay a frame stack's k frames side by side instead of its newest frame.
        fps: frames per second of a GIF or MP4.
        scale: whole upscaling factor (nearest neighbour); None picks one (84 px -> 2).
        columns: contact sheet columns; None picks up to 8.
        max_frames: contact sheet frames at most, picked evenly with first and last.
    """

    layout: str | None = None
    stack: bool = False
    fps: float = 20.0
    scale: int | None = None
    columns: int | None = None
    max_frames: int = SHEET_MAX_FRAMES

    def __post_init__(self) -> None:
        if not (isinstance(self.fps, (int, float)) and 0 < self.fps <= 100):
            raise BadInputError(f"fps must be a number in (0, 100], got {self.fps!r}")
        for name in ("scale", "columns"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise BadInputError(f"{name} must be an int >= 1 or None, got {v!r}")
        if not isinstance(self.max_frames, int) or self.max_frames < 1:
            raise BadInputError(f"max_frames must be an int >= 1, got {self.max_frames!r}")


def frames(
    store: Store,
    leaf: str | None = None,
    env: int | None = None,
    episode: int | None = None,
    steps: Any = None,
    options: ViewOptions | None = None,
    progress: Progress | None = None,
) -> FrameView:
    """Read one env's frames of an image leaf as a :class:`FrameView` (see :func:`view`)."""
    options = options or ViewOptions()
    path = pick_leaf(store, leaf)
    index = store.leaf_paths.index(path)
    shape = store.leaves[index].info.spec.shape
    layout = Layout.parse(options.layout, shape, path) if options.layout else Layout.infer(shape, path)
    sel = select(store, env, episode, steps)
    raw = read_leaf(store, index, sel.env, sel.steps, progress)
    pictures = compose(layout.normalise(to_uint8(raw)), options.stack)
    reward_path = store.roles.get("reward")
    ret = None
    if reward_path is not None and reward_path in store.leaf_paths:
        r = read_leaf(store, store.leaf_paths.index(reward_path), sel.env, sel.steps, None)
        ret = float(np.sum(r.astype(np.float64)))
    name = os.path.basename(os.path.normpath(store.path))
    return FrameView(
        pictures,
        sel.steps,
        step_ends(store, sel.env, sel.steps),
        options,
        title=f"{name} · {path} ({layout}) · env {sel.env}",
        episode=sel.episode,
        status=sel.status,
        episode_return=ret,
    )


# --- drawing --------------------------------------------------------------------------


def _font() -> Any:
    _, _, ImageFont = _pil()
    return ImageFont.load_default()


def _text_height(font: Any) -> int:
    box = font.getbbox("Ag0")
    return int(box[3]) + 2


@dataclass(frozen=True)
class SheetGeometry:
    """Where a contact sheet puts each frame and its label (pixels, top-left origin)."""

    columns: int
    rows: int
    frame_height: int
    frame_width: int
    header_height: int
    label_height: int
    margin: int = 6
    gap: int = 6

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the sheet."""
        w = 2 * self.margin + self.columns * self.frame_width + (self.columns - 1) * self.gap
        h = (
            self.header_height
            + self.rows * (self.frame_height + self.label_height + self.gap)
            - self.gap
            + self.margin
        )
        return w, h

    def frame_box(self, i: int) -> tuple[int, int, int, int]:
        """(left, top, right, bottom) of frame ``i``, right and bottom exclusive."""
        r, c = divmod(i, self.columns)
        x = self.margin + c * (self.frame_width + self.gap)
        y = self.header_height + r * (self.frame_height + self.label_height + self.gap)
        return x, y, x + self.frame_width, y + self.frame_height

    def label_box(self, i: int) -> tuple[int, int, int, int]:
        x0, _, x1, y1 = self.frame_box(i)
        return x0, y1, x1, y1 + self.label_height


@dataclass(eq=False)
class FrameView:
    """One env's frames, ready to draw: ``pictures[i]`` is the frame of global step
    ``steps[i]`` as ``[H, W, C]`` uint8 (C is 1 or 3), unscaled.

    In a notebook it displays inline (an animated GIF, or the contact sheet for long
    views); :meth:`sheet` gives the contact sheet as a PIL image, :meth:`save` writes a
    ``.gif``, ``.png`` (contact sheet) or ``.mp4``.
    """

    pictures: np.ndarray
    steps: np.ndarray
    ends: list[str]
    options: ViewOptions = field(default_factory=ViewOptions)
    title: str = ""
    episode: int | None = None
    status: str | None = None
    episode_return: float | None = None

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        h, w = self.pictures.shape[1:3] if self.pictures.ndim == 4 else (0, 0)
        span = f"steps {self.steps[0]}..{self.steps[-1]}" if len(self) else "no steps"
        return f"FrameView({self.title!r}, {len(self)} frames of {h}x{w}, {span})"

    @property
    def scale(self) -> int:
        if self.options.scale is not None:
            return self.options.scale
        return auto_scale(*self.pictures.shape[1:3])

    def summary(self) -> list[str]:
        """The header lines of a contact sheet."""
        what = f"episode {self.episode}, " if self.episode is not None else ""
        span = f"steps {self.steps[0]}-{self.steps[-1]}" if len(self) else "no steps"
        line2 = []
        if self.episode_return is not None:
            line2.append(f"return {self.episode_return:.6g}")
        if self.status in ("terminated", "truncated"):
            line2.append(f"{self.status} at step {self.steps[-1]}")
        elif self.status == "open" and self.ends[-1]:
            line2.append(f"{self.ends[-1]} at step {self.steps[-1]} (its start left the ring)")
        elif self.status == "open":
            line2.append(f"open at step {self.steps[-1]} (still running, or its start left the ring)")
        else:
            ended = [f"{e} at {t}" for t, e in zip(self.steps, self.ends) if e]
            line2.append(
                "ends: " + (", ".join(ended[:4]) + (" ..." if len(ended) > 4 else "") if ended else "none")
            )
        return [self.title, f"{what}{span} ({len(self)} frames)", " · ".join(line2)]

    def sheet(self, columns: int | None = None, max_frames: int | None = None) -> Any:
        """The contact sheet as a PIL image: a header (title, steps, return and how the
        episode ended), then a grid of frames each with its global step id below it;
        frames that ended an episode are framed red (terminated) or yellow (truncated)."""
        Image, ImageDraw, _ = _pil()
        n_max = max_frames or self.options.max_frames
        pick = (
            np.arange(len(self))
            if len(self) <= n_max
            else np.unique(np.linspace(0, len(self) - 1, n_max).round().astype(int))
        )
        geo = self.geometry(len(pick), columns)
        font = _font()
        line = _text_height(font)
        img = Image.new("RGB", geo.size, BACKGROUND)
        draw = ImageDraw.Draw(img)
        lines = self.summary()
        if len(pick) < len(self):
            lines[1] += f", {len(pick)} shown"
        for j, text in enumerate(lines):
            draw.text((geo.margin, geo.margin + j * line), text, fill=TEXT, font=font)
        s = self.scale
        for i, k in enumerate(pick):
            x0, y0, x1, y1 = geo.frame_box(i)
            frame = upscale(self.pictures[k], s)
            img.paste(
                Image.fromarray(frame if frame.shape[-1] == 3 else np.repeat(frame, 3, axis=-1)), (x0, y0)
            )
            end = self.ends[k]
            if end:
                draw.rectangle((x0 - 2, y0 - 2, x1 + 1, y1 + 1), outline=END_COLOURS[end], width=2)
            label = f"{self.steps[k]}" + (f" {end}" if end else "")
            lx0, ly0, _, _ = geo.label_box(i)
            draw.text((lx0, ly0 + 1), label, fill=END_COLOURS.get(end, TEXT), font=font)
        return img

    def geometry(self, n: int | None = None, columns: int | None = None) -> SheetGeometry:
        """The contact sheet's layout for ``n`` frames (default: as many as it shows)."""
        n = min(len(self), self.options.max_frames) if n is None else n
        cols = max(1, min(n, columns or self.options.columns or 8))
        h, w = self.pictures.shape[1:3]
        line = _text_height(_font())
        return SheetGeometry(
            columns=cols,
            rows=max(1, -(-n // cols)),
            frame_height=h * self.scale,
            frame_width=w * self.scale,
            header_height=6 + 3 * line + 6,
            label_height=line + 2,
        )

    def gif(self, progress: Progress | None = None) -> bytes:
        """The frames as an animated GIF (lossless for gray frames and for colour
        frames with at most 256 colours in all; others share one adaptive palette)."""
        buf = io.BytesIO()
        self._write_gif(buf, progress)
        return buf.getvalue()

    def _write_gif(self, target: Any, progress: Progress | None) -> None:
        if not len(self):
            raise NotEnoughDataError("no frames to write")
        images = _palette_images(self.pictures, self.scale)
        first = next(images)

        def rest() -> Iterator[Any]:  # made as the encoder takes them: progress as it goes
            for i, im in enumerate(images, 2):
                yield im
                if progress is not None and i % READ_BLOCK_FRAMES == 0:
                    progress(READ_BLOCK_FRAMES)
            if progress is not None:
                progress(len(self) % READ_BLOCK_FRAMES)

        first.save(
            target,
            format="GIF",
            save_all=True,
            append_images=rest(),
            duration=max(20, round(1000 / self.options.fps)),
            loop=0,
            optimize=False,
        )

    def _write_mp4(self, path: str, progress: Progress | None) -> None:
        try:
            import imageio_ffmpeg
        except ImportError:
            raise ImportError(
                "writing .mp4 needs imageio-ffmpeg: pip install 'mmreplay[mp4]' (or write a .gif)"
            ) from None
        pictures = upscale(self.pictures, self.scale)
        t, h, w, c = pictures.shape
        ph, pw = h + h % 2, w + w % 2  # yuv420p needs even sides
        writer = imageio_ffmpeg.write_frames(
            path, (pw, ph), fps=self.options.fps, pix_fmt_in="rgb24", macro_block_size=2, quality=8
        )
        writer.send(None)
        try:
            for i in range(0, t, READ_BLOCK_FRAMES):
                block = pictures[i : i + READ_BLOCK_FRAMES]
                if c == 1:
                    block = np.repeat(block, 3, axis=-1)
                if (ph, pw) != (h, w):
                    block = np.pad(block, ((0, 0), (0, ph - h), (0, pw - w), (0, 0)))
                for frame in block:
                    writer.send(np.ascontiguousarray(frame))
                if progress is not None:
                    progress(len(block))
        finally:
            writer.close()

    def save(self, path: str | os.PathLike, force: bool = False, progress: Progress | None = None) -> str:
        """Write a ``.gif``, a ``.png`` contact sheet or an ``.mp4``; returns the path."""
        path = os.fspath(path)
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in SUFFIXES:
            raise BadInputError(f"{path}: expected a .gif, .png (contact sheet) or .mp4 file name")
        if os.path.lexists(path) and not force:
            raise FileExistsError(f"{path}: already exists; pass force=True (--force) to overwrite it")
        _pil()
        if suffix == ".png":
            self.sheet().save(path, format="PNG")
            if progress is not None:
                progress(len(self))
            return path
        tmp = f"{path}.tmp-{os.getpid()}{suffix}"
        try:
            if suffix == ".gif":
                with open(tmp, "wb") as f:
                    self._write_gif(f, progress)
            else:
                self._write_mp4(tmp, progress)
            os.replace(tmp, path)
        except OSError as exc:
            raise_named(exc, path, f"{suffix[1:]} file", tmp)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    # --- notebooks ---------------------------------------------------------------

    def _repr_png_(self) -> bytes:
        return png_bytes(self.sheet())

    def _repr_html_(self) -> str | None:
        if not len(self) or len(self) > INLINE_MAX_FRAMES:
            return None  # the notebook falls back to the contact sheet
        data = base64.b64encode(self.gif()).decode("ascii")
        caption = "<br>".join(html.escape(t, quote=False) for t in self.summary())
        return f'<figure><img src="data:image/gif;base64,{data}"/><figcaption><small>{caption}</small></figcaption></figure>'


def _palette_images(pictures: np.ndarray, scale: int) -> Iterator[Any]:
    """PIL images for a GIF, upscaled by ``scale``, made one at a time: gray frames as
    'L'; colour frames as 'P' on one palette for all, exact when all frames hold at most
    256 colours together. Colours are indexed before upscaling (scale**2 fewer pixels)."""
    Image, _, _ = _pil()
    size = (pictures.shape[2] * scale, pictures.shape[1] * scale)

    def upscaled(im: Any) -> Any:  # nearest neighbour keeps the palette and the pixels
        return im if scale == 1 else im.resize(size, Image.Resampling.NEAREST)

    if pictures.shape[-1] == 1:
        return (upscaled(Image.fromarray(p, "L")) for p in pictures[..., 0])
    packed = (
        (pictures[..., 0].astype(np.uint32) << 16)
        | (pictures[..., 1].astype(np.uint32) << 8)
        | pictures[..., 2]
    )
    present = np.zeros(1 << 24, np.bool_)
    present[packed.reshape(-1)] = True
    colours = np.flatnonzero(present)
    if len(colours) > 256:  # one adaptive palette from frames spread over the range
        picks = pictures[np.linspace(0, len(pictures) - 1, min(len(pictures), 32)).round().astype(int)]
        mosaic = Image.fromarray(np.ascontiguousarray(picks.reshape(-1, *picks.shape[2:])), "RGB")
        shared = mosaic.quantize(256, method=Image.Quantize.FASTOCTREE)
        return (
            upscaled(Image.fromarray(p, "RGB").quantize(palette=shared, dither=Image.Dither.NONE))
            for p in pictures
        )
    lut = np.zeros(1 << 24, np.uint8)
    lut[colours] = np.arange(len(colours), dtype=np.uint8)
    palette = np.zeros((256, 3), np.uint8)
    palette[: len(colours)] = np.stack([(colours >> 16) & 255, (colours >> 8) & 255, colours & 255], -1)
    raw_palette = palette.tobytes()

    def indexed(p: np.ndarray) -> Any:
        im = Image.fromarray(lut[p], "P")
        im.putpalette(raw_palette)
        return upscaled(im)

    return (indexed(p) for p in packed)


def view(
    store: Store,
    out: str | os.PathLike | None = None,
    leaf: str | None = None,
    env: int | None = None,
    episode: int | None = None,
    steps: Any = None,
    force: bool = False,
    progress: Progress | None = None,
    **options: Any,
) -> Any:
    """One env's frames of an image leaf of ``store`` as pictures (``mr.view``).

    Without ``out``, returns a :class:`FrameView`, which a notebook shows inline (an
    animated GIF) and whose ``sheet()`` is a PIL contact sheet; with ``out`` (``.gif``,
    ``.png`` contact sheet, ``.mp4``), writes it and returns the path; an ``.rrd`` out is
    a Rerun recording of every leaf, every env unless ``env`` is given
    (:func:`mmreplay.rerun.log_rerun`). ``episode`` indexes the env's episodes (negative
    from the newest; default the newest complete one); ``steps`` is ``"A:B"`` or a slice
    of global step ids. Options: :class:`ViewOptions`. Needs pillow
    (``pip install 'mmreplay[view]'``).

    Example:
        >>> import mmreplay as mr, numpy as np, tempfile
        >>> store = mr.create(tempfile.mkdtemp() + "/b", {"obs": mr.ArraySpec((16, 16), "uint8")}, 10)
        >>> store.extend({"obs": np.zeros((4, 1, 16, 16), "uint8")}); store.commit()
        >>> len(mr.view(store, steps="0:3"))
        3
    """
    opts = ViewOptions(**options)
    if out is not None and os.fspath(out).lower().endswith(".rrd"):
        from .rerun import log_rerun

        return log_rerun(store, out, env, episode, steps, opts.fps, force, progress)
    fv = frames(store, leaf, env, episode, steps, opts, progress)
    if out is None:
        return fv
    return fv.save(out, force=force, progress=progress)


def thumbnails(store: Store, count: int = 8, leaf: str | None = None) -> tuple[str, Any] | None:
    """A one-row sheet of env 0's newest ``count`` frames (leaf path, PIL image), or None
    when no leaf looks like frames or the store is empty."""
    if not len(store) or (leaf is None and not frame_leaves(store)):
        return None
    path = pick_leaf(store, leaf)
    end = store.first_step + len(store)
    fv = frames(
        store, path, 0, None, slice(max(store.first_step, end - count), end), ViewOptions(columns=count)
    )
    return path, fv.sheet()


def png_bytes(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
