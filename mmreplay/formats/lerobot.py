"""``lerobot``: a LeRobotDataset v3.0 folder as LeRobot 0.6 writes it, and its import.

The layout is read from LeRobot's ``src/lerobot/datasets``: ``meta/`` (info.json,
stats.json, tasks.parquet, episodes/), ``data/`` Parquet and ``videos/`` MP4 files in
``chunk-XXX/file-XXX`` folders. uint8 gray or RGB frame leaves become RGB video encoded
with PyAV, a frame stack as its newest frame; other leaves are Parquet columns under
LeRobot's names. ``meta/mmreplay.json`` records the spec and which feature holds which
leaf, so the import gives the store back; any other v3.0 folder imports by its feature
names. What is kept and how: docs/offline-datasets.md.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import BadInputError, CorruptBufferError, NotEnoughDataError, UnsupportedFormatError
from ..spec import ArraySpec, Layout, flatten, leaf_paths, spec_from_json, spec_to_json
from .base import Episodes, Roles, Source, Target, episode_flags, episodes_source, need, nest, pyarrow

if TYPE_CHECKING:
    from contextlib import ExitStack

    from .base import Exportable, ExportOptions, ExportResult

COMPRESSIONS = ("snappy", "zstd", "gzip", "none")
CODEBASE_VERSION = "v3.0"
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"
DATA_PATH = "data/" + CHUNK_FILE + ".parquet"
VIDEO_PATH = "videos/{video_key}/" + CHUNK_FILE + ".mp4"
EPISODES_PATH = "meta/episodes/" + CHUNK_FILE + ".parquet"
#: what mmreplay adds beside LeRobot's files, to import the store back
MARK_PATH = "meta/mmreplay.json"
MARK_FORMAT = "mmreplay-lerobot/1"
#: the columns LeRobot adds to every dataset (lerobot.utils.constants.DEFAULT_FEATURES)
DEFAULT_FEATURES = {
    "timestamp": "float32",
    "frame_index": "int64",
    "episode_index": "int64",
    "index": "int64",
    "task_index": "int64",
}
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
DONE, TRUNCATED = "next.done", "next.truncated"
VIDEO_COLUMNS = ("chunk_index", "file_index", "from_timestamp", "to_timestamp")
#: LeRobot's RGB encoder defaults (lerobot.configs.video.VideoEncoderConfig)
DEFAULT_CODEC, DEFAULT_CRF, GOP, SVTAV1_PRESET = "libsvtav1", 30, 2, 12
#: x265's lossless=1 in planar RGB was seen to change pixels here; x264's RGB mode at CRF 0 does not
LOSSLESS_CODEC = "libx264rgb"


def _pyarrow() -> tuple[Any, Any]:
    return pyarrow("the lerobot format", "lerobot")


def _av() -> Any:
    os.environ.setdefault("SVT_LOG", "1")  # else SVT-AV1 prints its settings for every file
    return need("av", "the lerobot format", "lerobot")


# --- files that roll over: chunk-XXX/file-XXX ------------------------------------------------


class Rolling:
    """Files of one kind, a new one once ``limit`` bytes went into the open one, and a new
    chunk folder every ``chunks_size`` files (LeRobot's update_chunk_file_indices)."""

    def __init__(self, target: Target, template: str, limit: float, chunks_size: int, **names: str):
        self.target, self.template, self.names = target, template, names
        self.limit, self.chunks_size = limit, chunks_size
        self.chunk, self.file, self.written = 0, -1, 0
        self.handle: Any = None

    def roll(self, nbytes: int) -> str | None:
        """Closes the open file if ``nbytes`` more would fill it; the path of a file to open, if none is."""
        if self.handle is not None and self.written and self.written + nbytes >= self.limit:
            self.close()
        if self.handle is not None:
            return None
        last = self.file == self.chunks_size - 1
        self.chunk, self.file, self.written = self.chunk + last, 0 if last else self.file + 1, 0
        rel = self.template.format(chunk_index=self.chunk, file_index=self.file, **self.names)
        path = self.target.path(*rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def close(self) -> None:
        handle, self.handle = self.handle, None
        if handle is not None:
            self.finish(handle)

    def finish(self, handle: Any) -> None:
        handle.close()


class ParquetFiles(Rolling):
    def __init__(self, target: Target, template: str, schema: Any, codec: str, limit: float, chunks: int):
        super().__init__(target, template, limit, chunks)
        self.schema, self.codec = schema, codec

    def place(self, nbytes: int) -> tuple[int, int]:
        """The (chunk, file) the next ``nbytes`` go to, opened if need be."""
        path = self.roll(nbytes)
        if path is not None:
            pq = _pyarrow()[1]
            self.handle = pq.ParquetWriter(path, self.schema, compression=self.codec, use_dictionary=True)
        return self.chunk, self.file

    def write(self, table: Any) -> None:
        """Writes ``table`` as one row group."""
        self.handle.write_table(table)
        self.written += table.nbytes


@dataclass(frozen=True)
class Encoder:
    """The PyAV codec, pixel format and options, and the ``video.*`` entries LeRobot records."""

    codec: str
    pix_fmt: str
    options: dict[str, str]
    info: dict[str, Any]


def video_encoder(codec: str | None, crf: int | None, preset: int | str | None, lossless: bool) -> Encoder:
    av = _av()
    extra: dict[str, str] = {}
    if lossless:
        if codec not in (None, LOSSLESS_CODEC) or crf not in (None, 0):
            raise BadInputError(f"lerobot export: lossless video is written by {LOSSLESS_CODEC} at crf 0")
        codec, pix_fmt, crf = LOSSLESS_CODEC, "rgb24", 0
    else:
        codec, pix_fmt = codec or DEFAULT_CODEC, "yuv420p"
        crf = DEFAULT_CRF if crf is None else crf
        preset = SVTAV1_PRESET if preset is None and codec == DEFAULT_CODEC else preset
        extra = {"x265-params": "log-level=error"} if codec in ("hevc", "libx265") else {}
    preset = int(preset) if isinstance(preset, str) and preset.lstrip("-").isdigit() else preset
    if not isinstance(crf, int) or isinstance(crf, bool) or not 0 <= crf <= 63:
        raise BadInputError(f"lerobot export: crf must be an int in [0, 63], got {crf!r}")
    options = {"g": str(GOP), "crf": str(crf), **({"preset": str(preset)} if preset is not None else {})}
    if codec == DEFAULT_CODEC:
        options["svtav1-params"] = "fast-decode=0"
    level = av.logging.get_level()
    av.logging.set_level(av.logging.ERROR)  # FFmpeg's reason goes into the exception, not on stderr
    try:  # an encoder PyAV lacks, or options it refuses, are found before any file is written
        context = av.codec.CodecContext.create(codec, "w")
        context.width, context.height, context.pix_fmt = 64, 64, pix_fmt
        context.time_base, context.options = Fraction(1, 30), {**options, **extra}
        with av.logging.Capture():
            context.open()
    except Exception as exc:
        msg = f"PyAV {av.__version__} cannot open the {codec!r} encoder with {options}: {exc}"
        raise BadInputError(f"lerobot export: {msg}") from None
    finally:
        av.logging.set_level(level)
    info = {"video.g": GOP, "video.crf": crf, "video.preset": preset, "video.fast_decode": 0}
    info.update({"video.video_backend": "pyav", "video.extra_options": extra})
    return Encoder(codec, pix_fmt, {**options, **extra}, info)


class VideoFiles(Rolling):
    """One video feature's MP4 files: each episode's frames appended to the open file."""

    def __init__(self, target: Target, key: str, fps: int, encoder: Encoder, limit: float, chunks_size: int):
        super().__init__(target, VIDEO_PATH, limit, chunks_size, video_key=key)
        self.key, self.fps, self.encoder = key, fps, encoder
        self.frames = 0
        self.first: str | None = None

    def add(self, frames: np.ndarray) -> dict[str, Any]:
        """Appends one episode's frames ``[n, H, W, 3]``; its file and time range."""
        av = _av()
        path = self.roll(0)
        if path is not None:
            self.first = self.first or path
            self.handle = av.open(path, "w")
            self.stream = self.handle.add_stream(self.encoder.codec, self.fps, options=self.encoder.options)
            self.stream.height, self.stream.width = frames.shape[1:3]
            self.stream.pix_fmt = self.encoder.pix_fmt
            self.frames = 0
        start = self.frames
        for i, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts = start + i
            if i == 0:  # every episode starts on a key frame
                picture.pict_type = av.video.frame.PictureType.I
            self._mux(self.stream.encode(picture))
        self.frames += len(frames)
        names = [f"videos/{self.key}/{k}" for k in VIDEO_COLUMNS]
        return dict(zip(names, (self.chunk, self.file, start / self.fps, self.frames / self.fps)))

    def _mux(self, packets: list[Any], handle: Any = None) -> None:
        (handle or self.handle).mux(packets)
        self.written += sum(p.size for p in packets)  # behind by the frames the encoder holds

    def finish(self, handle: Any) -> None:
        try:
            self._mux(self.stream.encode(), handle)
        finally:
            handle.close()

    def stream_info(self) -> dict[str, Any]:
        """LeRobot's ``video.*`` entries, read off the first file as LeRobot does."""
        av = _av()
        with av.open(self.first) as f:
            s = f.streams.video[0]
            found = {"video.height": s.height, "video.width": s.width, "video.codec": s.codec.canonical_name}
            found.update({"video.pix_fmt": s.pix_fmt, "video.fps": int(self.fps)})
            found.update({"video.channels": len(av.VideoFormat(s.pix_fmt).components), "has_audio": False})
        return {**found, **self.encoder.info, "is_depth_map": False}


# --- the features: which leaf becomes which -----------------------------------------------------


@dataclass
class Column:
    """One feature and the leaf it holds; a video feature has the leaf's frame layout."""

    name: str
    leaf: str
    spec: ArraySpec
    layout: Layout | None = None
    pad: str | None = None  # how a frame stack begins an episode: "repeat" or "zeros"

    @property
    def stacks(self) -> tuple[int, ...]:
        """(k, H, W, C) of the leaf's frame stacks (k = 1: no stack)."""
        return self.layout.normalise(np.empty((0, *self.spec.shape), np.uint8)).shape[1:]

    def feature(self) -> dict[str, Any]:
        if self.layout is not None:
            h, w = self.stacks[1:3]
            return {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"]}
        size = max(1, int(np.prod(self.spec.shape)))
        return {"dtype": self.spec.dtype.name, "shape": [size], "names": None}

    def record(self) -> dict[str, Any]:
        """What ``meta/mmreplay.json`` keeps of it."""
        if self.layout is None:
            return {"leaf": self.leaf}
        k, _, _, c = self.stacks
        return {"leaf": self.leaf, "layout": str(self.layout), "gray": c == 1, "stack": k, "pad": self.pad}


def frame_layout(spec: ArraySpec) -> Layout | None:
    """The layout of a leaf written as video: uint8 gray or RGB frames (stacked or not)."""
    if spec.dtype != np.uint8 or len(spec.shape) < 2:
        return None
    with contextlib.suppress(BadInputError):
        layout = Layout.infer(spec.shape)
        return layout if layout.channels(spec.shape) in (1, 3) else None
    return None


def plan_columns(roles: Roles) -> list[Column]:
    """Every leaf's feature, in LeRobot's order: observation, action, reward, the rest."""
    specs = dict(zip(roles.paths, flatten(roles.spec)))
    columns: list[Column] = []

    def add(name: str, leaf: str, image_name: str | None = None) -> None:
        spec = specs[leaf]
        if spec.dtype.kind not in "biuf":
            raise BadInputError(f"lerobot export: leaf {leaf!r} is {spec.dtype}; LeRobot takes numbers")
        layout = frame_layout(spec)
        columns.append(Column(image_name if layout and image_name else name, leaf, spec, layout))

    for role, name, images in (
        ("observation", "observation", "observation.images"),
        ("action", "action", None),
        ("reward", "next.reward", None),
    ):
        path = roles.get(role)
        for leaf in roles.leaves_of(path) if path else []:
            if leaf == path:  # a single leaf: LeRobot's observation.state or observation.image
                obs = role == "observation"
                add("observation.state" if obs else name, leaf, "observation.image" if obs else None)
            else:
                rel = leaf[len(path) + 1 :].replace("/", ".")
                add(f"{name}.{rel}", leaf, images and f"{images}.{rel}")
    taken = {c.name for c in columns} | set(DEFAULT_FEATURES) | {DONE, TRUNCATED}
    for leaf in roles.extras():
        name = leaf.replace("/", ".")
        add(f"leaf.{name}" if name in taken else name, leaf)
    names = [c.name for c in columns]
    if len(set(names)) < len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise BadInputError(f"lerobot export: leaves map to the same feature names {dup}; rename them")
    return columns


# --- stats, as lerobot.datasets.compute_stats makes and aggregates them ---------------------


def value_stats(x: np.ndarray, count: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """min, max, mean, std, count and the quantiles of ``x`` [rows, D] per column."""
    x = x.astype(np.float64, copy=False)
    out = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0)}
    qs = np.quantile(x, list(QUANTILES.values()), axis=0) if len(x) >= 2 else [out["mean"]] * len(QUANTILES)
    out = {k: v.reshape(shape) for k, v in out.items()} | {"count": np.array([count])}
    return out | {q: v.reshape(shape) for q, v in zip(QUANTILES, qs)}


def frame_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats in [0, 1] of the frames LeRobot samples (compute_stats.sample_images)."""
    n = len(frames)
    count = n if n < 100 else max(100, min(int(n**0.75), 10_000))
    picked = frames[np.round(np.linspace(0, n - 1, count)).astype(int)]
    h, w = picked.shape[1:3]
    if max(h, w) >= 300:  # auto_downsample_height_width
        step = int(w / 150) if w > h else int(h / 150)
        picked = picked[:, ::step, ::step]
    return value_stats(picked.reshape(-1, 3) / 255.0, len(picked), (3, 1, 1))


def aggregate(stats: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """aggregate_feature_stats: weighted mean and variance, the extremes, and per quantile
    the lowest (q <= 50) or highest of the episodes' estimates; as JSON lists."""
    means = np.stack([s["mean"] for s in stats])
    counts = np.stack([s["count"] for s in stats]).astype(np.float64)
    total = counts.sum(axis=0)
    weights = counts.reshape(len(stats), *[1] * (means.ndim - 1))
    mean = (means * weights).sum(axis=0) / total
    variances = np.stack([s["std"] ** 2 for s in stats])
    variance = ((variances + (means - mean) ** 2) * weights).sum(axis=0) / total
    out = {"min": np.min([s["min"] for s in stats], axis=0), "max": np.max([s["max"] for s in stats], axis=0)}
    out |= {"mean": mean, "std": np.sqrt(variance), "count": total.astype(np.int64)}
    for q in QUANTILES:
        values = np.stack([s[q] for s in stats])
        out[q] = values.min(axis=0) if int(q[1:]) <= 50 else values.max(axis=0)
    return {k: v.tolist() for k, v in out.items()}


# --- stacks ---------------------------------------------------------------------------------


def rebuild_stacks(newest: np.ndarray, k: int, pad: str) -> np.ndarray:
    """One episode's stacks ``[n, k, ...]`` (oldest first) from its newest frames ``[n, ...]``."""
    index = np.arange(len(newest))[:, None] - np.arange(k - 1, -1, -1)[None, :]
    out = newest[np.maximum(index, 0)]
    if pad == "zeros":
        out[index < 0] = 0
    return out


def check_stacks(column: Column, stacks: np.ndarray, ep: Any) -> None:
    """Refuses stacks that are not the episode's newest frames stacked (those would be lost)."""
    if column.pad is None:  # the first episode tells how stacks begin
        column.pad = "zeros" if stacks[0, -1].any() and not stacks[0, :-1].any() else "repeat"
    if not np.array_equal(rebuild_stacks(stacks[:, -1], stacks.shape[1], column.pad), stacks):
        hint = " (its start left the ring: leave it out with complete_only)" * (ep.status == "open")
        raise BadInputError(
            f"lerobot export: leaf {column.leaf!r} ({column.layout}) holds frame stacks that are not the "
            f"episode's newest frames stacked (pad {column.pad!r}) in the episode of env {ep.env} from step "
            f"{ep.first_step}{hint}; LeRobot keeps one frame per step"
        )


# --- the export -----------------------------------------------------------------------------


def _arrow_column(pa: Any, values: np.ndarray, feature: dict[str, Any]) -> Any:
    """A non-video feature as the Arrow type LeRobot's ``datasets`` features give it."""
    flat = np.ascontiguousarray(values).reshape(len(values), feature["shape"][0])
    if feature["shape"] == [1]:
        return pa.array(flat.reshape(-1))
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def _recognise(path: str) -> bool:
    """(:func:`mmreplay.files.check_target` takes a mark it cannot read for no earlier export.)"""
    return _read_json(os.path.join(path, *MARK_PATH.split("/")), path).get("format") == MARK_FORMAT


def _write_json(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=4, ensure_ascii=False)


def _positive(**values: Any) -> None:
    for name, value in values.items():
        whole = name in ("fps", "chunks_size")  # LeRobot's fps is whole
        if not isinstance(value, int if whole else (int, float)) or isinstance(value, bool) or value <= 0:
            raise BadInputError(
                f"lerobot export: {name} must be {'an int' if whole else 'a number'} > 0, got {value!r}"
            )


def write(
    store: Exportable,
    out: str,
    options: ExportOptions,
    fps: int = 30,
    task: str | None = None,
    codec: str | None = None,
    crf: int | None = None,
    preset: int | str | None = None,
    lossless: bool = False,
    chunks_size: int = 1000,
    data_files_size_in_mb: float = 100,
    video_files_size_in_mb: float = 200,
) -> ExportResult:
    pa, _ = _pyarrow()
    sizes = {"data_files_size_in_mb": data_files_size_in_mb, "video_files_size_in_mb": video_files_size_in_mb}
    _positive(fps=fps, chunks_size=chunks_size, **sizes)
    task = os.path.basename(os.path.normpath(store.path)) if task is None else str(task)
    roles = Roles.of(store)
    columns = plan_columns(roles)
    videos = [c for c in columns if c.layout is not None]
    layout = getattr(store, "frames", None)
    for c in videos:
        if c.stacks[0] > 1 and layout is not None and layout.stacked:
            c.pad = layout.pad  # the store checked its stacks as they came
    encoder = video_encoder(codec, crf, preset, lossless) if videos else None
    for c in videos:  # SVT-AV1 (PyAV 15.1's) kills the process with SIGFPE on these widths
        if encoder.codec == "libsvtav1" and 8 <= c.stacks[2] <= 24:  # (videos: an encoder was made)
            raise BadInputError(
                f"lerobot export: leaf {c.leaf!r} has frames {c.stacks[2]} px wide, on which the AV1 encoder "
                "(libsvtav1) crashes (widths 8 to 24); give --codec libx264 (codec=) or --lossless"
            )
    episodes = Episodes(store, options)
    if not episodes.count:
        raise NotEnoughDataError(f"{store.path}: no episodes to export (a LeRobot dataset holds episodes)")
    flag = {"dtype": "bool", "shape": [1], "names": None}
    features = {c.name: c.feature() for c in columns} | {DONE: flag, TRUNCATED: dict(flag)}
    features |= {k: {"dtype": v, "shape": [1], "names": None} for k, v in DEFAULT_FEATURES.items()}
    tabular = [k for k, f in features.items() if f["dtype"] != "video"]
    empty = {k: np.zeros((0, *features[k]["shape"]), features[k]["dtype"]) for k in tabular}
    schema = pa.schema([(k, _arrow_column(pa, empty[k], features[k]).type) for k in tabular])
    index = {p: i for i, p in enumerate(roles.paths)}
    target = Target(out, "folder", "lerobot", store, options, recognise=_recognise)
    mb = float(1 << 20)
    data = ParquetFiles(
        target, DATA_PATH, schema, options.compression or "snappy", data_files_size_in_mb * mb, chunks_size
    )
    sinks = {
        c.name: VideoFiles(target, c.name, fps, encoder, video_files_size_in_mb * mb, chunks_size)
        for c in videos
    }
    rows: list[dict[str, Any]] = []
    stats: dict[str, list[dict[str, np.ndarray]]] = {k: [] for k in features}
    count = total = 0
    with target:
        try:
            for ep in episodes:
                n = ep.length
                leaves = flatten(ep.data)
                values: dict[str, np.ndarray] = {}
                placed: dict[str, Any] = {}
                for c in columns:
                    x = np.asarray(leaves[index[c.leaf]])
                    if c.layout is None:
                        values[c.name] = x
                        continue
                    stacks = c.layout.normalise(x)
                    if stacks.shape[1] > 1:
                        check_stacks(c, stacks, ep)
                    newest = np.ascontiguousarray(np.broadcast_to(stacks[:, -1], (n, *stacks.shape[2:4], 3)))
                    stats[c.name].append(frame_stats(newest))
                    placed.update(sinks[c.name].add(newest))
                values[DONE], values[TRUNCATED] = episode_flags(ep, roles.get("truncated"))
                values["frame_index"] = np.arange(n, dtype=np.int64)
                values["timestamp"] = (values["frame_index"] / fps).astype(np.float32)
                values["episode_index"] = np.full(n, count, np.int64)
                values["index"] = np.arange(total, total + n, dtype=np.int64)
                values["task_index"] = np.zeros(n, np.int64)
                table = pa.Table.from_arrays(
                    [_arrow_column(pa, values[k], features[k]) for k in tabular], schema=schema
                )
                chunk, file = data.place(table.nbytes)
                data.write(table)
                for k in tabular:
                    stats[k].append(value_stats(values[k].reshape(n, -1), n, (features[k]["shape"][0],)))
                row = {"episode_index": count, "tasks": [task], "length": n, "data/chunk_index": chunk}
                row |= {"data/file_index": file, "dataset_from_index": total, "dataset_to_index": total + n}
                row |= placed | {f"stats/{k}/{s}": v.tolist() for k in features for s, v in stats[k][-1].items()}
                rows.append(row)
                count, total = count + 1, total + n
            for files in [data, *sinks.values()]:
                files.close()
            for c in videos:
                features[c.name]["info"] = sinks[c.name].stream_info()
            _write_meta(target, store, columns, rows, stats, task, (data_files_size_in_mb * mb, chunks_size))
            info = {"codebase_version": CODEBASE_VERSION, "fps": fps, "features": features}
            info |= {"total_episodes": count, "total_frames": total, "total_tasks": 1, "chunks_size": chunks_size}
            info |= {**sizes, "data_path": DATA_PATH, "video_path": VIDEO_PATH if videos else None}
            info |= {"robot_type": None, "splits": {"train": f"0:{count}"}}
            _write_json(target.path("meta", "info.json"), info)
            return target.finish(count, total, {"fps": fps, "task": task})
        except BaseException:
            for files in [data, *sinks.values()]:
                with contextlib.suppress(Exception):  # a failing flush must not hide the first error
                    files.close()
            raise


def _write_meta(
    target: Target, store: Exportable, columns: list[Column], rows: list, stats: dict, task: str, sizes: tuple
) -> None:
    """``meta/episodes`` (each row with its own file's chunk and file index, as LeRobot
    writes them), ``stats.json``, ``tasks.parquet`` and mmreplay's record."""
    import pandas as pd

    pa, _ = _pyarrow()
    table = pa.Table.from_pylist(rows)
    extra = [pa.field(f"meta/episodes/{k}_index", pa.int64()) for k in ("chunk", "file")]
    files = ParquetFiles(target, EPISODES_PATH, pa.schema([*table.schema, *extra]), "snappy", *sizes)
    step = max(1, int(sizes[0] // max(1, table.nbytes // len(table))))
    for a in range(0, len(table), step):
        part = table.slice(a, step)
        at = files.place(part.nbytes)
        indices = [pa.array(np.full(len(part), i, np.int64)) for i in at]
        files.write(pa.Table.from_arrays([*part.columns, *indices], schema=files.schema))
    files.close()
    _write_json(target.path("meta", "stats.json"), {k: aggregate(v) for k, v in stats.items()})
    tasks = pd.DataFrame({"task_index": [0]}, index=pd.Index([task], name="task"))
    tasks.to_parquet(target.path("meta", "tasks.parquet"))
    record = {"format": MARK_FORMAT, "spec": spec_to_json(store.spec), "roles": dict(store.roles)}
    record |= {"attrs": getattr(store, "attrs", {}), "features": {c.name: c.record() for c in columns}}
    _write_json(target.path(*MARK_PATH.split("/")), record)


# --- the import -----------------------------------------------------------------------------

#: LeRobot feature names that take a role's usual name in the store
ROLE_NAMES = {"next.reward": "reward", DONE: "terminated", TRUNCATED: "truncated"}


def _read_json(path: str, where: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(1 << 26))
    except ValueError as exc:
        raise CorruptBufferError(f"{where}: {os.path.basename(path)} is no JSON: {exc}") from None


def _episode_rows(src: str) -> list[dict[str, Any]]:
    """Every episode's metadata row (stats left out), in episode order."""
    pa, pq = _pyarrow()
    files = sorted(glob.glob(os.path.join(glob.escape(src), "meta", "episodes", "*", "*.parquet")))
    if not files:
        raise CorruptBufferError(f"{src}: no meta/episodes/chunk-*/file-*.parquet")
    rows = []
    for path in files:
        names = [n for n in pq.read_schema(path).names if not n.startswith("stats/")]
        rows += pq.read_table(path, columns=names).to_pylist()
    return sorted(rows, key=lambda r: r["episode_index"])


def _tasks(src: str) -> list[str]:
    """The task strings by task index (``meta/tasks.parquet``: the ``task`` index, ``task_index``)."""
    _, pq = _pyarrow()
    path = os.path.join(src, "meta", "tasks.parquet")
    if not os.path.isfile(path):
        return []
    table = pq.read_table(path)
    if not {"task", "task_index"} <= set(table.column_names):
        raise CorruptBufferError(f"{path}: expected the columns task and task_index")
    by_index = zip(table.column("task_index").to_pylist(), table.column("task").to_pylist())
    return [t for _, t in sorted(by_index)]


class VideoSource:
    """One video feature's frames, decoded with PyAV file by file as the episodes ask for them."""

    def __init__(self, src: str, key: str, fps: int):
        self.src, self.key, self.fps = src, key, fps
        self.where: tuple[int, int] | None = None
        self.container: Any = None
        self.decoded: Iterator[tuple[float, Any]] = iter(())
        self.rgb = True

    def _open(self, where: tuple[int, int]) -> None:
        av = _av()
        self.close()
        rel = VIDEO_PATH.format(video_key=self.key, chunk_index=where[0], file_index=where[1])
        path = os.path.join(self.src, *rel.split("/"))
        if not os.path.isfile(path):
            raise CorruptBufferError(f"{self.src}: video {rel} of feature {self.key!r} is missing")
        self.container = av.open(path)
        stream = self.container.streams.video[0]
        self.rgb = stream.pix_fmt.startswith(("gbr", "rgb", "bgr"))
        frames = self.container.decode(stream)
        self.decoded = ((float(f.pts * stream.time_base), f) for f in frames if f.pts is not None)
        self.where = where

    def frames(self, where: tuple[int, int], start: float, n: int, gray: bool) -> np.ndarray:
        """The ``n`` frames from time ``start`` of a file: ``[n, H, W, 3]`` or ``[n, H, W, 1]`` (gray)."""
        half, out = 0.5 / self.fps, []
        if where != self.where:
            self._open(where)
        for t, frame in self.decoded:  # episodes come in the order of their frames
            if t < start - half:
                continue
            if t > start + half and not out:
                raise CorruptBufferError(f"{self.src}: video {self.key!r} {where}: no frame at {start:.3f} s")
            x = frame.to_ndarray(format="gray" if gray and not self.rgb else "rgb24")
            out.append(x[..., None] if x.ndim == 2 else x[..., :1] if gray else x)
            if len(out) == n:
                return np.stack(out)
        end = start + n / self.fps
        raise CorruptBufferError(f"{self.src}: video {self.key!r} {where} ends before {end:.3f} s")

    def close(self) -> None:
        if self.container is not None:
            self.container.close()
            self.container = None


def _without(spec: Any, path: str) -> Any:
    """``spec`` with the subtree at ``path`` left out (dict nests)."""
    head, _, rest = path.partition("/")
    if not isinstance(spec, dict) or head not in spec:
        raise UnsupportedFormatError(f"cannot leave next observation {path!r} out of a {type(spec).__name__}")
    out = dict(spec)
    if rest:
        out[head] = _without(spec[head], rest)
    else:
        del out[head]
    return out


#: the store an import makes: its spec, its roles, and leaf -> (feature name, how it was written)
Plan = tuple[Any, dict[str, str], dict[str, tuple[str, dict[str, Any]]]]


def _plan_marked(mark: dict[str, Any], features: dict[str, Any]) -> Plan:
    spec = spec_from_json(mark["spec"])
    roles = dict(mark.get("roles") or {})
    nxt = roles.pop("next_observation", None)
    if nxt is not None:
        spec = _without(spec, nxt)
    sources = {r["leaf"]: (name, r) for name, r in mark["features"].items() if name in features}
    for role, name in (("terminated", DONE), ("truncated", TRUNCATED)):
        if role not in roles and isinstance(spec, dict) and role not in spec:
            spec, roles[role] = {**spec, role: ArraySpec((), "bool")}, role
        if role in roles:
            sources[roles[role]] = (name, {"leaf": roles[role]})
    return spec, roles, sources


def _plan_foreign(features: dict[str, Any], where: str) -> Plan:
    paths, specs, sources = [], [], {}
    for name, ft in features.items():
        dtype = ft.get("dtype")
        if name in DEFAULT_FEATURES and name != "task_index" or dtype in ("string", "language"):
            continue
        shape = tuple(int(n) for n in ft.get("shape") or ())
        if dtype in ("video", "image"):
            names = ft.get("names") or []
            hw = shape[1:] if names[:1] in (["channels"], ["channel"]) else shape[:2]
            spec = ArraySpec((*hw, 3), "uint8")
        else:
            try:
                spec = ArraySpec(() if shape == (1,) else shape, np.dtype(dtype))
            except TypeError:
                raise UnsupportedFormatError(f"{where}: feature {name!r} has dtype {dtype!r}") from None
        path = ROLE_NAMES.get(name) or name.replace(".", "/")
        paths.append(path)
        specs.append(spec)
        sources[path] = (name, {"leaf": path, "image": dtype == "image"})
    for role in ("terminated", "truncated"):
        if role not in paths:
            paths.append(role)
            specs.append(ArraySpec((), "bool"))
            sources[role] = ("", {"leaf": role})
    spec = nest(paths, specs)
    roles = {r: r for r in ("observation", "action", "reward", "terminated", "truncated") if r in spec}
    return spec, roles, sources


def _column(table: Any, name: str, spec: ArraySpec, image: bool) -> np.ndarray:
    n = table.num_rows
    column = table.column(name).combine_chunks()
    if image:  # LeRobot's "image" features: PNG bytes in a {bytes, path} struct
        import io

        from PIL import Image

        pictures = [Image.open(io.BytesIO(v["bytes"])).convert("RGB") for v in column.to_pylist()]
        return np.stack([np.asarray(p) for p in pictures])
    pa, _ = _pyarrow()
    if pa.types.is_fixed_size_list(column.type) or pa.types.is_list(column.type):
        column = column.flatten()
    return np.array(column.to_numpy(zero_copy_only=False), dtype=spec.dtype).reshape(n, *spec.shape)


def read(src: str, files: ExitStack) -> Source:
    """The importer's source over a LeRobot v3.0 folder: one env, episode after episode."""
    pa, pq = _pyarrow()
    if not os.path.isfile(os.path.join(src, "meta", "info.json")):
        raise UnsupportedFormatError(f"{src}: no meta/info.json; not a LeRobot dataset folder")
    info = _read_json(os.path.join(src, "meta", "info.json"), src)
    version = str(info.get("codebase_version"))
    if not version.startswith("v3."):
        raise UnsupportedFormatError(
            f"{src}: a LeRobot {version} dataset; mmreplay imports the v3.0 layout (LeRobot >= 0.4): "
            "convert it with LeRobot's convert_dataset_v21_to_v30 first"
        )
    fps = int(info["fps"])
    features = info["features"]
    mark_path = os.path.join(src, *MARK_PATH.split("/"))
    mark = _read_json(mark_path, src) if os.path.isfile(mark_path) else None
    marked = isinstance(mark, dict) and mark.get("format") == MARK_FORMAT
    spec, roles, sources = _plan_marked(mark, features) if marked else _plan_foreign(features, src)
    rows = _episode_rows(src)
    tasks = _tasks(src)
    paths, specs = leaf_paths(spec), flatten(spec)
    for p in paths:
        if p not in sources:
            raise CorruptBufferError(f"{src}: no feature holds the leaf {p!r}")
    video_keys = [n for n, _ in sources.values() if features.get(n, {}).get("dtype") == "video"]
    videos = {n: VideoSource(src, n, fps) for n in video_keys}
    for video in videos.values():
        files.callback(video.close)
    if any("/" in n or n.startswith(".") for n in videos):  # LeRobot's feature names have no "/"
        raise CorruptBufferError(f"{src}: a video feature name that is no folder name: {sorted(videos)}")

    @functools.lru_cache(maxsize=1)  # episodes come file by file
    def data_file(chunk: int, file: int) -> Any:
        return pq.read_table(os.path.join(src, DATA_PATH.format(chunk_index=chunk, file_index=file)))

    def load(row: dict[str, Any]) -> list[np.ndarray]:
        table = data_file(row["data/chunk_index"], row["data/file_index"])
        e, n = row["episode_index"], row["length"]
        part = table.filter(pa.array(table.column("episode_index").to_numpy() == e))
        if part.num_rows != n:
            raise CorruptBufferError(f"{src}: episode {e} has {part.num_rows} rows of data, meta says {n}")
        out = []
        for path, spec in zip(paths, specs):
            name, how = sources[path]
            if name in videos:
                key = f"videos/{name}/"
                at = (row[key + "chunk_index"], row[key + "file_index"])
                frames = videos[name].frames(at, row[key + "from_timestamp"], n, how.get("gray", False))
                if "layout" in how:
                    layout = Layout.parse(how["layout"], spec.shape, path)
                    stacks = rebuild_stacks(frames, int(how.get("stack", 1)), how.get("pad") or "repeat")
                    frames = layout.denormalise(stacks, spec.shape)
                out.append(frames.reshape(n, *spec.shape))
            elif name:
                out.append(_column(part, name, spec, how.get("image", False)))
            else:  # an episode end flag the dataset does not hold
                out.append(np.zeros(n, bool))
        ends = {r: paths.index(roles[r]) for r in ("terminated", "truncated") if r in roles}
        if len(ends) == 2 and n:  # the episode ends: terminated, or else truncated
            term, trunc = out[ends["terminated"]].reshape(n), out[ends["truncated"]].reshape(n)
            trunc[-1] = trunc[-1] or not term[-1]
        return out

    attrs = dict(mark.get("attrs") or {}) if isinstance(mark, dict) else {}
    attrs |= {"lerobot": {"fps": fps, "tasks": tasks, "codebase_version": version}}
    return episodes_source(spec, [(r, int(r["length"])) for r in rows], load, roles, attrs)
