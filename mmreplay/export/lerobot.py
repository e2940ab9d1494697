"""``lerobot``: a LeRobotDataset v3.0 folder as LeRobot 0.6 writes it, and its import.

The layout (read from LeRobot's ``src/lerobot/datasets``): ``meta/info.json``
(``codebase_version`` ``"v3.0"``, ``fps``, ``features`` with dtype / shape / names, the
path templates, chunk and file sizes), ``meta/stats.json`` (per feature min, max, mean,
std, count and the quantiles q01, q10, q50, q90, q99), ``meta/tasks.parquet``,
``meta/episodes/chunk-XXX/file-XXX.parquet`` (per episode: index, tasks, length, data
file and row range, each video's file and time range, the episode's stats),
``data/chunk-XXX/file-XXX.parquet`` (one row per frame, one row group per episode) and
``videos/{key}/chunk-XXX/file-XXX.mp4`` (episodes one after another in a file). A file
is closed once it reaches its size (``data_files_size_in_mb``, ``video_files_size_in_mb``);
``chunks_size`` files make a chunk.

What goes where: uint8 frame leaves (gray or RGB, a layout :class:`mmreplay.view.Layout`
recognises) become video features encoded with PyAV, with LeRobot's defaults (AV1 by
libsvtav1, yuv420p, GOP 2, CRF 30) or ``lossless`` (H.264 in RGB by libx264rgb at
CRF 0, bit-exact); a frame stack is written as its newest frame (LeRobot rebuilds stacks with
``delta_timestamps``, which repeat an episode's first frame; the import rebuilds them as
the store had them). Gray frames are written as RGB video, which is what LeRobot reads.
Every other leaf is a Parquet column (leaves of two or more dimensions flattened).
Roles take LeRobot's names: ``observation.state`` / ``observation.image`` (or
``observation.<key>`` / ``observation.images.<key>`` for a nested observation),
``action``, ``next.reward``, ``next.done`` (terminated) and ``next.truncated``. The next
observation is the next frame's, as in LeRobot, so next-observation leaves are left out.
Other leaves keep their path with ``.`` for ``/``. ``meta/mmreplay.json`` records the
store's spec and which feature holds which leaf, so that the import gives the store back.

An episode still open at the end of an env's stream is written truncated, or left out
with ``complete_only``. The import reads any LeRobot v3.0 folder: videos decoded with
PyAV, the tasks kept in the store's attrs (``lerobot``) and each step's ``task_index``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BadInputError, CorruptBufferError, NotEnoughDataError, UnsupportedFormatError
from ..spec import ArraySpec, flatten, leaf_paths, spec_from_json, spec_to_json
from ..view import Layout
from ._base import ExportResult, Roles, Target, Ticker, disk_usage, episode_flags, episode_total, episodes

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
#: LeRobot's RGB encoder defaults (lerobot.configs.video.VideoEncoderConfig)
DEFAULT_CODEC, DEFAULT_CRF, GOP, SVTAV1_PRESET = "libsvtav1", 30, 2, 12
LOSSLESS_CODEC = "libx264rgb"


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ImportError("the lerobot format needs pyarrow: pip install 'mmreplay[lerobot]'") from exc
    return pa, pq


def _av() -> Any:
    try:
        import av
    except ImportError as exc:
        raise ImportError("the lerobot format needs PyAV: pip install 'mmreplay[lerobot]'") from exc
    # SVT-AV1 prints its configuration to stderr for every file unless told otherwise
    os.environ.setdefault("SVT_LOG", "1")
    return av


# --- the video encoder ----------------------------------------------------------------


@dataclass(frozen=True)
class Encoder:
    """How frames become video: the PyAV codec, pixel format and codec options, and the
    ``video.*`` entries LeRobot records for them in ``info.json``."""

    codec: str
    pix_fmt: str
    options: dict[str, str]
    info: dict[str, Any]

    @classmethod
    def make(cls, codec: str | None, crf: int | None, lossless: bool) -> Encoder:
        av = _av()
        extra: dict[str, str] = {}
        if lossless:  # x265's lossless=1 in planar RGB was seen to change pixels; x264's RGB mode does not
            if codec not in (None, LOSSLESS_CODEC) or crf not in (None, 0):
                raise BadInputError(f"lerobot export: lossless video is written by {LOSSLESS_CODEC} at crf 0")
            codec, pix_fmt, crf, preset = LOSSLESS_CODEC, "rgb24", 0, None
        else:
            codec = codec or DEFAULT_CODEC
            pix_fmt = "yuv420p"
            crf = DEFAULT_CRF if crf is None else crf
            preset = SVTAV1_PRESET if codec == DEFAULT_CODEC else None
            if codec in ("hevc", "libx265"):
                extra = {"x265-params": "log-level=error"}
        try:
            av.codec.Codec(codec, "w")
        except Exception:
            hint = (
                "; the h264 encoder is the usual one everywhere (codec='h264')"
                if codec == DEFAULT_CODEC
                else ""
            )
            raise BadInputError(
                f"lerobot export: PyAV {av.__version__} has no {codec!r} video encoder{hint}"
            ) from None
        if crf is not None and (not isinstance(crf, int) or isinstance(crf, bool) or not 0 <= crf <= 63):
            raise BadInputError(f"lerobot export: crf must be an int in [0, 63], got {crf!r}")
        options = {"g": str(GOP)}
        if crf is not None:
            options["crf"] = str(crf)
        if preset is not None:
            options["preset"] = str(preset)
        if codec == DEFAULT_CODEC:
            options["svtav1-params"] = "fast-decode=0"
        options.update(extra)
        info = {
            "video.g": GOP,
            "video.crf": crf,
            "video.preset": preset,
            "video.fast_decode": 0,
            "video.video_backend": "pyav",
            "video.extra_options": extra,
        }
        return cls(codec, pix_fmt, options, info)


class VideoSink:
    """One video feature's MP4 files: episodes appended to the open file, a new file once
    it holds ``limit`` bytes."""

    def __init__(self, target: Target, key: str, fps: int, encoder: Encoder, limit: float, chunks_size: int):
        self.target, self.key, self.fps, self.encoder = target, key, fps, encoder
        self.limit, self.chunks_size = limit, chunks_size
        self.chunk, self.file = 0, -1
        self.container: Any = None
        self.stream: Any = None
        self.frames = self.written = 0
        self.first_path: str | None = None

    @property
    def path(self) -> str:
        rel = VIDEO_PATH.format(video_key=self.key, chunk_index=self.chunk, file_index=self.file)
        return self.target.path(*rel.split("/"))

    def _open(self, height: int, width: int) -> None:
        av = _av()
        self.chunk, self.file = next_file(self.chunk, self.file, self.chunks_size)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.first_path = self.first_path or self.path
        self.container = av.open(self.path, "w")
        self.stream = self.container.add_stream(
            self.encoder.codec, rate=self.fps, options=self.encoder.options
        )
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, self.encoder.pix_fmt
        self.frames = self.written = 0

    def add(self, frames: np.ndarray) -> dict[str, Any]:
        """Append one episode's frames ``[n, H, W, 3]``; its file and time range."""
        av = _av()
        if self.container is not None and self.written >= self.limit:
            self.close()
        if self.container is None:
            self._open(frames.shape[1], frames.shape[2])
        start = self.frames
        for i, frame in enumerate(frames):
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts = start + i
            if i == 0:  # every episode starts on a key frame
                picture.pict_type = av.video.frame.PictureType.I
            self._mux(self.stream.encode(picture))
        self.frames += len(frames)
        prefix = f"videos/{self.key}/"
        return {
            prefix + "chunk_index": self.chunk,
            prefix + "file_index": self.file,
            prefix + "from_timestamp": start / self.fps,
            prefix + "to_timestamp": self.frames / self.fps,
        }

    def _mux(self, packets: list[Any]) -> None:
        self.container.mux(packets)
        self.written += sum(p.size for p in packets)  # the encoder holds a few frames back

    def close(self) -> None:
        if self.container is not None:
            try:
                self._mux(self.stream.encode())
            finally:
                self.container.close()
                self.container = None

    def stream_info(self) -> dict[str, Any]:
        """LeRobot's ``video.*`` entries, read off the first file as LeRobot does."""
        av = _av()
        with av.open(self.first_path) as f:
            s = f.streams.video[0]
            fmt = av.VideoFormat(s.pix_fmt)
            found = {
                "video.height": s.height,
                "video.width": s.width,
                "video.codec": s.codec.canonical_name,
                "video.pix_fmt": s.pix_fmt,
                "video.fps": int(self.fps),
                "video.channels": len(fmt.components),
                "has_audio": False,
            }
        return {**found, **self.encoder.info, "is_depth_map": False}


def next_file(chunk: int, file: int, chunks_size: int) -> tuple[int, int]:
    """The (chunk, file) after these (LeRobot's update_chunk_file_indices); (0, -1) is before the first."""
    if file == chunks_size - 1:
        return chunk + 1, 0
    return chunk, file + 1


# --- the columns: which leaf becomes which feature -------------------------------------


@dataclass
class Column:
    """One feature of the dataset and the leaf it holds."""

    name: str
    leaf: str
    spec: ArraySpec
    layout: Layout | None = None  # a video feature's frame layout
    pad: str | None = None  # a frame stack's padding before an episode's first frame

    @property
    def video(self) -> bool:
        return self.layout is not None

    @property
    def stack(self) -> int:
        return self.layout.normalise(np.empty((0, *self.spec.shape), np.uint8)).shape[1] if self.layout else 1

    @property
    def gray(self) -> bool:
        return self.layout is not None and self.layout.channels(self.spec.shape) == 1

    def feature(self) -> dict[str, Any]:
        if self.layout is not None:
            x = self.layout.normalise(np.empty((0, *self.spec.shape), np.uint8))
            h, w = x.shape[2:4]
            return {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"]}
        return {
            "dtype": self.spec.dtype.name,
            "shape": [max(1, int(np.prod(self.spec.shape)))],
            "names": None,
        }

    def record(self) -> dict[str, Any]:
        """What ``meta/mmreplay.json`` keeps of it."""
        out: dict[str, Any] = {"leaf": self.leaf}
        if self.layout is not None:
            out.update(layout=str(self.layout), gray=self.gray, stack=self.stack, pad=self.pad)
        return out


def frame_layout(spec: ArraySpec) -> Layout | None:
    """The layout of a leaf written as video: uint8 gray or RGB frames (stacked or not)."""
    if spec.dtype != np.uint8 or len(spec.shape) < 2:
        return None
    try:
        layout = Layout.infer(spec.shape)
    except BadInputError:
        return None
    return layout if layout.channels(spec.shape) in (1, 3) else None


def plan_columns(roles: Roles) -> list[Column]:
    """Every leaf's feature, in LeRobot's order: observation, action, reward, the rest."""
    specs = dict(zip(roles.paths, flatten(roles.spec)))
    skipped: set[str] = set()
    for role in ("next_observation", "terminated", "truncated"):
        path = roles.get(role)
        if path is not None:
            skipped.update(roles.leaves_of(path))
    columns: list[Column] = []

    def add(name: str, leaf: str) -> None:
        spec = specs[leaf]
        if spec.dtype.kind in "cOSUV":
            raise BadInputError(
                f"lerobot export: leaf {leaf!r} is {spec.dtype}; LeRobot features are numbers"
            )
        columns.append(Column(name, leaf, spec, frame_layout(spec)))
        skipped.add(leaf)

    obs = roles.get("observation")
    if obs is not None:
        leaves = roles.leaves_of(obs)
        if leaves == [obs]:
            add("observation.image" if frame_layout(specs[obs]) else "observation.state", obs)
        for leaf in leaves if leaves != [obs] else []:
            rel = leaf[len(obs) + 1 :].replace("/", ".")
            add(f"observation.images.{rel}" if frame_layout(specs[leaf]) else f"observation.{rel}", leaf)
    for role, name in (("action", "action"), ("reward", "next.reward")):
        path = roles.get(role)
        if path is not None:
            for leaf in roles.leaves_of(path):
                add(name if leaf == path else f"{name}.{leaf[len(path) + 1 :].replace('/', '.')}", leaf)
    taken = {c.name for c in columns} | set(DEFAULT_FEATURES) | {DONE, TRUNCATED}
    for leaf in roles.paths:
        if leaf not in skipped:
            name = leaf.replace("/", ".")
            add(f"leaf.{name}" if name in taken else name, leaf)
    names = [c.name for c in columns]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BadInputError(f"lerobot export: leaves map to the same feature names {dup}; rename them")
    return columns


# --- stats, as lerobot.datasets.compute_stats computes and aggregates them ------------------


def sample_indices(n: int) -> np.ndarray:
    """The frames LeRobot's image stats look at (compute_stats.sample_indices)."""
    count = n if n < 100 else max(100, min(int(n**0.75), 10_000))
    return np.round(np.linspace(0, n - 1, count)).astype(int)


def value_stats(x: np.ndarray, count: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """min, max, mean, std, count and quantiles of ``x`` [rows, D] per column, reshaped."""
    x = x.astype(np.float64, copy=False)
    out = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0)}
    qs = np.quantile(x, list(QUANTILES.values()), axis=0) if len(x) >= 2 else [out["mean"]] * len(QUANTILES)
    out.update(zip(QUANTILES, qs))
    stats = {k: v.reshape(shape) for k, v in out.items()}
    return {**{k: stats[k] for k in ("min", "max", "mean", "std")}, "count": np.array([count])} | {
        k: stats[k] for k in QUANTILES
    }


def frame_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats in [0, 1] of sampled frames ``[n, H, W, 3]``, shaped (3, 1, 1)."""
    picked = frames[sample_indices(len(frames))]
    h, w = picked.shape[1:3]
    if max(h, w) >= 300:  # compute_stats.auto_downsample_height_width
        step = int(w / 150) if w > h else int(h / 150)
        picked = picked[:, ::step, ::step]
    return value_stats(picked.reshape(-1, 3) / 255.0, len(picked), (3, 1, 1))


def aggregate(stats: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """LeRobot's aggregate_feature_stats: weighted mean and variance, min of minima, max of
    maxima, and per quantile the lowest (q <= 50) or highest estimate of the episodes."""
    means = np.stack([s["mean"] for s in stats])
    variances = np.stack([s["std"] ** 2 for s in stats])
    counts = np.stack([s["count"] for s in stats]).astype(np.float64)
    total = counts.sum(axis=0)
    weights = counts.reshape(len(stats), *[1] * (means.ndim - 1))
    mean = (means * weights).sum(axis=0) / total
    variance = ((variances + (means - mean) ** 2) * weights).sum(axis=0) / total
    out = {
        "min": np.min([s["min"] for s in stats], axis=0),
        "max": np.max([s["max"] for s in stats], axis=0),
        "mean": mean,
        "std": np.sqrt(variance),
        "count": total.astype(np.int64),
    }
    for q in QUANTILES:
        values = np.stack([s[q] for s in stats])
        out[q] = values.min(axis=0) if int(q[1:]) <= 50 else values.max(axis=0)
    return out


# --- stacks ---------------------------------------------------------------------------------


def rebuild_stacks(newest: np.ndarray, k: int, pad: str) -> np.ndarray:
    """One episode's stacks ``[n, k, ...]`` (oldest first) from its newest frames ``[n, ...]``."""
    index = np.arange(len(newest))[:, None] - np.arange(k - 1, -1, -1)[None, :]
    out = newest[np.maximum(index, 0)]
    if pad == "zeros":
        out[index < 0] = 0
    return out


def check_stacks(column: Column, stacks: np.ndarray, ep: Any) -> None:
    """Refuses a stack leaf whose stacks are not the episode's newest frames, stacked."""
    if column.pad is None:  # the first episode tells how stacks begin
        first = stacks[0]
        column.pad = "zeros" if first[-1].any() and not first[:-1].any() else "repeat"
    if not np.array_equal(rebuild_stacks(stacks[:, -1], stacks.shape[1], column.pad), stacks):
        hint = (
            " (its start left the ring: leave such episodes out with complete_only)"
            if ep.status == "open"
            else ""
        )
        raise BadInputError(
            f"lerobot export: leaf {column.leaf!r} ({column.layout}) holds frame stacks that are not the "
            f"episode's newest frames stacked (pad {column.pad!r}) in the episode of env {ep.env} from step "
            f"{ep.first_step}{hint}; LeRobot keeps one frame per step"
        )


# --- the export -----------------------------------------------------------------------------


@dataclass
class Shards:
    """Parquet files of one kind (data or episodes), a new one once ``limit`` bytes were written."""

    target: Target
    template: str
    schema: Any
    compression: str
    limit: float
    chunks_size: int
    chunk: int = 0
    file: int = -1
    written: float = 0.0
    writer: Any = None
    paths: list[str] = field(default_factory=list)

    def where(self, nbytes: int) -> tuple[int, int]:
        """The (chunk, file) that takes ``nbytes`` more, opening a new file if needed."""
        if self.writer is not None and self.written and self.written + nbytes >= self.limit:
            self.close()
        if self.writer is None:
            _, pq = _pyarrow()
            self.chunk, self.file = next_file(self.chunk, self.file, self.chunks_size)
            rel = self.template.format(chunk_index=self.chunk, file_index=self.file)
            path = self.target.path(*rel.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.paths.append(path)
            self.writer = pq.ParquetWriter(
                path, self.schema, compression=self.compression, use_dictionary=True
            )
            self.written = 0
        return self.chunk, self.file

    def write(self, table: Any) -> None:
        self.writer.write_table(table)
        self.written += table.nbytes

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _arrow_type(pa: Any, feature: dict[str, Any]) -> Any:
    """The Arrow type LeRobot's ``datasets`` features give a non-video feature."""
    value = pa.from_numpy_dtype(np.dtype(feature["dtype"]))
    return value if feature["shape"] == [1] else pa.list_(value, feature["shape"][0])


def _arrow_column(pa: Any, values: np.ndarray, feature: dict[str, Any]) -> Any:
    n = len(values)
    flat = np.ascontiguousarray(values).reshape(n, -1)
    if feature["shape"] == [1]:
        return pa.array(flat.reshape(n))
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])


def _recognise(path: str) -> bool:
    try:
        with open(os.path.join(path, *MARK_PATH.split("/")), "rb") as f:
            return json.loads(f.read(1 << 24)).get("format") == MARK_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _write_json(path: str, value: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=4, ensure_ascii=False)


def _plain(stats: dict[str, np.ndarray]) -> dict[str, Any]:
    return {k: v.tolist() for k, v in stats.items()}


def write(
    store: Any,
    out: str,
    *,
    compression: str | None,
    complete_only: bool,
    force: bool,
    progress: Any,
    fps: int = 30,
    task: str | None = None,
    codec: str | None = None,
    crf: int | None = None,
    lossless: bool = False,
    chunks_size: int = 1000,
    data_files_size_in_mb: float = 100,
    video_files_size_in_mb: float = 200,
) -> ExportResult:
    pa, pq = _pyarrow()
    if not isinstance(fps, int) or isinstance(fps, bool) or fps < 1:
        raise BadInputError(f"lerobot export: fps must be an int >= 1 (LeRobot's fps is whole), got {fps!r}")
    for name, value in (
        ("data_files_size_in_mb", data_files_size_in_mb),
        ("video_files_size_in_mb", video_files_size_in_mb),
        ("chunks_size", chunks_size),
    ):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise BadInputError(f"lerobot export: {name} must be a positive number, got {value!r}")
    task = os.path.basename(os.path.normpath(store.path)) if task is None else str(task)
    roles = Roles.of(store)
    columns = plan_columns(roles)
    videos = [c for c in columns if c.video]
    frames_layout = getattr(store, "frames", None)
    for c in videos:
        if c.stack > 1 and frames_layout is not None and frames_layout.stacked:
            c.pad = frames_layout.pad  # the store checked its stacks as they came
    encoder = Encoder.make(codec, crf, lossless) if videos else None
    n_episodes, n_steps = episode_total(store, complete_only)
    if not n_episodes:
        raise NotEnoughDataError(
            f"{store.path}: no episodes to export (LeRobot datasets hold whole episodes)"
        )
    features = {c.name: c.feature() for c in columns}
    features[DONE] = {"dtype": "bool", "shape": [1], "names": None}
    features[TRUNCATED] = {"dtype": "bool", "shape": [1], "names": None}
    features.update({k: {"dtype": v, "shape": [1], "names": None} for k, v in DEFAULT_FEATURES.items()})
    tabular = [k for k, f in features.items() if f["dtype"] != "video"]
    schema = pa.schema([pa.field(k, _arrow_type(pa, features[k])) for k in tabular])
    index = {p: i for i, p in enumerate(roles.paths)}
    target = Target(out, "folder", force, fmt="lerobot", source=store.path, recognise=_recognise)
    mb = float(1 << 20)
    data = Shards(target, DATA_PATH, schema, compression or "snappy", data_files_size_in_mb * mb, chunks_size)
    sinks = {
        c.name: VideoSink(target, c.name, fps, encoder, video_files_size_in_mb * mb, chunks_size)
        for c in videos
    }
    ticker = Ticker(progress, len(store) * store.num_envs, max(1, n_steps))
    rows: list[dict[str, Any]] = []
    all_stats: dict[str, list[dict[str, np.ndarray]]] = {k: [] for k in features}
    try:
        count = total = 0
        for ep in episodes(store, complete_only):
            n = ep.length
            if n == 0:
                continue
            leaves = flatten(ep.data)
            term, trunc = episode_flags(ep, roles.get("truncated"))
            frame_index = np.arange(n, dtype=np.int64)
            values: dict[str, np.ndarray] = {}
            row: dict[str, Any] = {"episode_index": count, "tasks": [task], "length": n}
            placed: dict[str, Any] = {}
            ep_stats: dict[str, dict[str, np.ndarray]] = {}
            for c in columns:
                x = np.asarray(leaves[index[c.leaf]])
                if c.layout is None:
                    values[c.name] = x
                    continue
                stacks = c.layout.normalise(x)
                if stacks.shape[1] > 1:
                    check_stacks(c, stacks, ep)
                newest = np.ascontiguousarray(stacks[:, -1])
                if newest.shape[-1] == 1:
                    newest = np.repeat(newest, 3, axis=-1)
                ep_stats[c.name] = frame_stats(newest)
                placed.update(sinks[c.name].add(newest))
            values[DONE], values[TRUNCATED] = term, trunc
            values["timestamp"] = (frame_index / fps).astype(np.float32)
            values["frame_index"] = frame_index
            values["episode_index"] = np.full(n, count, np.int64)
            values["index"] = np.arange(total, total + n, dtype=np.int64)
            values["task_index"] = np.zeros(n, np.int64)
            table = pa.Table.from_arrays(
                [_arrow_column(pa, values[k], features[k]) for k in tabular], schema=schema
            )
            chunk, file = data.where(table.nbytes)
            data.write(table)
            for k in tabular:
                shape = (features[k]["shape"][0],)
                ep_stats[k] = value_stats(values[k].reshape(n, -1), n, shape)
            row.update({"data/chunk_index": chunk, "data/file_index": file})
            row.update({"dataset_from_index": total, "dataset_to_index": total + n}, **placed)
            row.update({f"stats/{k}/{s}": v.tolist() for k in features for s, v in ep_stats[k].items()})
            rows.append(row)
            for k in features:
                all_stats[k].append(ep_stats[k])
            count += 1
            total += n
            ticker.advance(n)
        data.close()
        for sink in sinks.values():
            sink.close()
        for c in videos:
            features[c.name]["info"] = sinks[c.name].stream_info()
        _write_episodes(target, rows, data_files_size_in_mb * mb, chunks_size)
        import pandas as pd

        os.makedirs(target.path("meta"), exist_ok=True)
        pd.DataFrame({"task_index": [0]}, index=pd.Index([task], name="task")).to_parquet(
            target.path("meta", "tasks.parquet")
        )
        info = {
            "codebase_version": CODEBASE_VERSION,
            "fps": fps,
            "features": features,
            "total_episodes": count,
            "total_frames": total,
            "total_tasks": 1,
            "chunks_size": chunks_size,
            "data_files_size_in_mb": data_files_size_in_mb,
            "video_files_size_in_mb": video_files_size_in_mb,
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if videos else None,
            "robot_type": None,
            "splits": {"train": f"0:{count}"},
        }
        _write_json(target.path("meta", "info.json"), info)
        _write_json(
            target.path("meta", "stats.json"), {k: _plain(aggregate(v)) for k, v in all_stats.items()}
        )
        _write_json(
            target.path(*MARK_PATH.split("/")),
            {
                "format": MARK_FORMAT,
                "spec": spec_to_json(store.spec),
                "roles": dict(store.roles),
                "attrs": getattr(store, "attrs", {}),
                "features": {c.name: c.record() for c in columns},
            },
        )
        path = target.commit()
    except BaseException:
        data.close()
        for sink in sinks.values():
            try:
                sink.close()
            except Exception:  # an encoder that fails to flush must not hide the first error
                pass
        target.abort()
        raise
    return ExportResult("lerobot", path, count, total, disk_usage(path), {"fps": fps, "task": task})


def _write_episodes(target: Target, rows: list[dict[str, Any]], limit: float, chunks_size: int) -> None:
    """``meta/episodes`` files, their own chunk and file index added to each row as LeRobot does."""
    pa, _ = _pyarrow()
    table = pa.Table.from_pylist(rows)
    schema = table.schema.append(pa.field("meta/episodes/chunk_index", pa.int64()))
    schema = schema.append(pa.field("meta/episodes/file_index", pa.int64()))
    shards = Shards(target, EPISODES_PATH, schema, "snappy", limit, chunks_size)
    per_row = max(1, table.nbytes // max(1, len(rows)))
    step = max(1, int(limit // per_row))
    for a in range(0, len(rows), step):
        part = table.slice(a, step)
        chunk, file = shards.where(part.nbytes)
        k = len(part)
        part = part.append_column(schema.field(len(schema) - 2), pa.array(np.full(k, chunk, np.int64)))
        shards.write(part.append_column(schema.field(len(schema) - 1), pa.array(np.full(k, file, np.int64))))
    shards.close()


# --- the import -----------------------------------------------------------------------------

#: LeRobot feature names that take a role's usual name in the store
ROLE_NAMES = {"next.reward": "reward", DONE: "terminated", TRUNCATED: "truncated"}


def is_dataset(src: str) -> bool:
    return os.path.isfile(os.path.join(src, "meta", "info.json"))


def _read_json(path: str, where: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(1 << 26))
    except ValueError as exc:
        raise CorruptBufferError(f"{where}: {os.path.basename(path)} is no JSON: {exc}") from None


def _episode_rows(src: str) -> list[dict[str, Any]]:
    """Every episode's metadata row (stats left out), in episode order."""
    pa, pq = _pyarrow()
    folder = os.path.join(src, "meta", "episodes")
    files = sorted(
        os.path.join(folder, c, f)
        for c in (os.listdir(folder) if os.path.isdir(folder) else [])
        if os.path.isdir(os.path.join(folder, c))
        for f in os.listdir(os.path.join(folder, c))
        if f.endswith(".parquet")
    )
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
    name = next((n for n in ("task", "__index_level_0__") if n in table.column_names), None)
    if name is None or "task_index" not in table.column_names:
        raise CorruptBufferError(f"{path}: expected the columns task and task_index")
    pairs = sorted(zip(table.column("task_index").to_pylist(), table.column(name).to_pylist()))
    return [t for _, t in pairs]


class VideoSource:
    """One video feature's frames, decoded with PyAV file by file as the episodes ask for them."""

    def __init__(self, src: str, template: str, key: str, fps: int):
        self.src, self.template, self.key, self.fps = src, template, key, fps
        self.where: tuple[int, int] | None = None
        self.container: Any = None
        self.decoded: Iterator[tuple[float, Any]] = iter(())
        self.pending: tuple[float, Any] | None = None
        self.rgb = True

    def _open(self, where: tuple[int, int]) -> None:
        av = _av()
        self.close()
        rel = self.template.format(video_key=self.key, chunk_index=where[0], file_index=where[1])
        path = os.path.join(self.src, *rel.split("/"))
        if not os.path.isfile(path):
            raise CorruptBufferError(f"{self.src}: video {rel} of feature {self.key!r} is missing")
        self.container = av.open(path)
        stream = self.container.streams.video[0]
        self.rgb = stream.pix_fmt.startswith(("gbr", "rgb", "bgr"))
        self.decoded = (
            (float(f.pts * stream.time_base), f) for f in self.container.decode(stream) if f.pts is not None
        )
        self.where, self.pending = where, None

    def frames(self, where: tuple[int, int], start: float, n: int, gray: bool) -> np.ndarray:
        """The ``n`` frames from time ``start`` of a file: ``[n, H, W, 3]`` or ``[n, H, W, 1]`` (gray)."""
        half = 0.5 / self.fps
        if where != self.where or (self.pending is not None and self.pending[0] > start + half):
            self._open(where)
        out = []
        while len(out) < n:
            item = self.pending or next(self.decoded, None)
            self.pending = None
            if item is None:
                raise CorruptBufferError(
                    f"{self.src}: video of {self.key!r} ({where}) ends before the {n} frames from {start:.3f} s"
                )
            t, frame = item
            if t < start - half:
                continue
            if gray:
                x = (
                    frame.to_ndarray(format="rgb24")[..., :1]
                    if self.rgb
                    else frame.to_ndarray(format="gray")[..., None]
                )
            else:
                x = frame.to_ndarray(format="rgb24")
            out.append(x)
        return np.stack(out)

    def close(self) -> None:
        if self.container is not None:
            self.container.close()
            self.container = None


def _without(spec: Any, path: str) -> Any:
    """``spec`` with the subtree at ``path`` left out (dict nests)."""
    head, _, rest = path.partition("/")
    if not isinstance(spec, dict) or head not in spec:
        raise UnsupportedFormatError(
            f"cannot leave the next observation {path!r} out of a {type(spec).__name__} spec"
        )
    out = dict(spec)
    if rest:
        out[head] = _without(spec[head], rest)
    else:
        del out[head]
    return out


@dataclass
class Plan:
    """The store an import makes: its spec and roles, and where each leaf comes from."""

    spec: Any
    roles: dict[str, str]
    sources: dict[str, tuple[str, dict[str, Any]]]  # leaf -> (feature name, how it was written)


def _plan_marked(mark: dict[str, Any], features: dict[str, Any]) -> Plan:
    spec = spec_from_json(mark["spec"])
    roles = dict(mark.get("roles") or {})
    nxt = roles.pop("next_observation", None)
    if nxt is not None:
        spec = _without(spec, nxt)
    sources = {r["leaf"]: (name, r) for name, r in mark["features"].items() if name in features}
    for role, name in (("terminated", DONE), ("truncated", TRUNCATED)):
        path = roles.get(role)
        if path is None and isinstance(spec, dict) and role not in spec:
            spec, path = {**spec, role: ArraySpec((), "bool")}, role
            roles[role] = role
        if path is not None:
            sources[path] = (name, {"leaf": path})
    return Plan(spec, roles, sources)


def _plan_foreign(features: dict[str, Any], where: str) -> Plan:
    from ..importers import _nest

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
    spec = _nest(paths, specs)
    roles = {r: r for r in ("observation", "action", "reward", "terminated", "truncated") if r in spec}
    return Plan(spec, roles, sources)


def _column(table: Any, name: str, spec: ArraySpec, image: bool) -> np.ndarray:
    n = table.num_rows
    column = table.column(name).combine_chunks()
    if image:  # LeRobot's "image" features: PNG bytes in a {bytes, path} struct
        import io

        from PIL import Image

        return np.stack(
            [np.asarray(Image.open(io.BytesIO(v["bytes"])).convert("RGB")) for v in column.to_pylist()]
        )
    pa, _ = _pyarrow()
    if pa.types.is_fixed_size_list(column.type) or pa.types.is_list(column.type):
        column = column.flatten()
    return np.array(column.to_numpy(zero_copy_only=False), dtype=spec.dtype).reshape(n, *spec.shape)


def read_source(src: str) -> tuple[Any, Any]:
    """The importer's source over a LeRobot v3.0 folder: one env, episode after episode."""
    from ..importers import _episodes_source

    pa, pq = _pyarrow()
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
    plan = (
        _plan_marked(mark, features)
        if isinstance(mark, dict) and mark.get("format") == MARK_FORMAT
        else _plan_foreign(features, src)
    )
    rows = _episode_rows(src)
    tasks = _tasks(src)
    paths, specs = leaf_paths(plan.spec), flatten(plan.spec)
    for p in paths:
        if p not in plan.sources:
            raise CorruptBufferError(f"{src}: no feature holds the leaf {p!r}")
    videos = {
        name: VideoSource(src, info.get("video_path") or VIDEO_PATH, name, fps)
        for name, _ in plan.sources.values()
        if features.get(name, {}).get("dtype") == "video"
    }
    data: dict[str, Any] = {"where": None, "table": None}

    def load(row: dict[str, Any]) -> list[np.ndarray]:
        where = (row["data/chunk_index"], row["data/file_index"])
        if data["where"] != where:
            rel = (info.get("data_path") or DATA_PATH).format(chunk_index=where[0], file_index=where[1])
            data["table"], data["where"] = pq.read_table(os.path.join(src, *rel.split("/"))), where
        table = data["table"]
        e, n = row["episode_index"], row["length"]
        mask = table.column("episode_index").to_numpy() == e
        part = table.filter(pa.array(mask))
        if part.num_rows != n:
            raise CorruptBufferError(
                f"{src}: episode {e} has {part.num_rows} rows in its data file, {n} in meta"
            )
        out = []
        for path, spec in zip(paths, specs):
            name, how = plan.sources[path]
            if name in videos:
                key = f"videos/{name}/"
                frames = videos[name].frames(
                    (row[key + "chunk_index"], row[key + "file_index"]),
                    row[key + "from_timestamp"],
                    n,
                    how.get("gray", False),
                )
                if "layout" in how:
                    layout = Layout.parse(how["layout"], spec.shape, path)
                    stacks = rebuild_stacks(frames, int(how.get("stack", 1)), how.get("pad") or "repeat")
                    frames = layout.denormalise(stacks, spec.shape)
                out.append(frames.reshape(n, *spec.shape))
            elif name:
                out.append(_column(part, name, spec, how.get("image", False)))
            else:  # an episode end flag the dataset does not hold
                out.append(np.zeros(n, bool))
        ends = {r: paths.index(plan.roles[r]) for r in ("terminated", "truncated") if r in plan.roles}
        if len(ends) == 2 and n:  # the episode ends: terminated, or else truncated
            term, trunc = out[ends["terminated"]].reshape(n), out[ends["truncated"]].reshape(n)
            trunc[-1] = trunc[-1] or not term[-1]
        return out

    def close() -> None:
        for v in videos.values():
            v.close()

    source = _episodes_source(plan.spec, [(r, int(r["length"])) for r in rows], load)
    source.roles = plan.roles
    attrs = dict(mark.get("attrs") or {}) if isinstance(mark, dict) else {}
    attrs["lerobot"] = {
        "fps": fps,
        "tasks": tasks,
        "robot_type": info.get("robot_type"),
        "codebase_version": version,
    }
    source.attrs = attrs
    return source, close
