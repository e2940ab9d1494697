"""Compression settings as users write them: ``CODEC[:LEVEL]`` or ``blosc[:CNAME][:LEVEL]``.

One parser for the store backends and every export format, so that a bad setting is
refused before anything is written, with the codecs and levels that place accepts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import BadInputError, SpecError
from .spec import flatten, is_image, leaf_paths

__all__ = ["BLOSC_CNAMES", "LEVELS", "STORE_HELP", "Compression", "compression_by_leaf", "describe", "parse"]

#: codec -> (lowest, highest) level it takes after a colon, or None when it takes none
LEVELS: dict[str, tuple[int, int] | None] = {
    "zstd": (1, 22),
    "blosc": (0, 9),
    "gzip": (0, 9),
    "brotli": (0, 11),
    "lzf": None,
    "snappy": None,
    "lz4": None,
    "deflate": None,
    "zip": None,
}
BLOSC_CNAMES = ("zstd", "lz4", "lz4hc", "blosclz", "zlib")


@dataclass(frozen=True)
class Compression:
    """A parsed compression setting: ``"zstd"``, ``"zstd:5"``, ``"blosc"``,
    ``"blosc:lz4:5"``, ``"gzip:4"`` or ``"lzf"``."""

    codec: str
    level: int | None = None
    cname: str | None = None

    def __str__(self) -> str:
        return ":".join(str(part) for part in (self.codec, self.cname, self.level) if part is not None)


def describe(accepted: Mapping[str, tuple[int, int] | None]) -> str:
    """The accepted settings as a user writes them: ``gzip[:0-9], lzf``."""
    if not accepted:
        return "none (this format is not compressed)"
    out = []
    for codec, levels in accepted.items():
        name = f"{codec}[:{'|'.join(BLOSC_CNAMES)}]" if codec == "blosc" else codec
        out.append(name if levels is None else f"{name}[:{levels[0]}-{levels[1]}]")
    return ", ".join(out)


def parse(
    text: str, accepted: Mapping[str, tuple[int, int] | None], where: str, error: type[Exception] = SpecError
) -> Compression:
    """A setting checked against the codecs ``where`` accepts (codec -> level range)."""
    parts = str(text).lower().split(":")
    codec, rest = parts[0], parts[1:]

    def refuse(why: str) -> Exception:
        return error(f"{where}: compression {text!r} {why}; accepted: {describe(accepted)}")

    if codec not in accepted:
        raise refuse("is not supported")
    cname = None
    if codec == "blosc":
        cname = "zstd"
        if rest and not rest[0].lstrip("-").isdigit():
            cname = rest.pop(0)
            if cname not in BLOSC_CNAMES:
                raise refuse(f"names no blosc compressor ({', '.join(BLOSC_CNAMES)})")
    levels = accepted[codec]
    level = None
    if rest:
        if levels is None:
            raise refuse(f"gives a level, and {codec} takes none")
        if len(rest) > 1 or not rest[0].lstrip("-").isdigit():
            raise refuse(f"has no integer level (expected {codec}:{levels[0]}..{levels[1]})")
        level = int(rest[0])
        if not levels[0] <= level <= levels[1]:
            raise refuse(f"has a level outside {levels[0]}..{levels[1]}")
    return Compression(codec, level, cname)


def compression_by_leaf(given: Any, spec: Any) -> Any:
    """The command line's compression settings as leaf path -> codec: a codec alone is the
    image leaves' (:func:`mmreplay.spec.is_image`; small leaves grow when compressed one
    row at a time and gain little in chunks), ``LEAF=CODEC`` one leaf's whatever the
    order, ``none`` no codec. A mapping is taken as it is."""
    if given is None or isinstance(given, Mapping):
        return given
    settings = [given] if isinstance(given, str) else given
    if not isinstance(settings, (list, tuple)) or not all(isinstance(text, str) for text in settings):
        raise BadInputError(
            f"compression {given!r}: expected a codec such as 'zstd', LEAF=CODEC, a list of them, "
            "or a mapping of leaf path to codec"
        )
    named = [text.partition("=")[::2] for text in settings if "=" in text]
    bare = [text for text in settings if "=" not in text]
    paths = leaf_paths(spec)
    images = [p for p, s in zip(paths, flatten(spec)) if is_image(s)]
    out: dict[str, str | None] = {}
    for codec in bare:
        if not images:
            raise BadInputError(
                f"compression {codec!r}: the spec has no image leaves (pictures such as [84, 84, 3]), "
                f"which a codec alone applies to; name a leaf: --compression LEAF={codec} "
                f"(leaves: {', '.join(paths)})"
            )
        out.update(dict.fromkeys(images, codec))
    out.update(dict(named))
    return {p: None if str(c).lower() in ("", "none") else c for p, c in out.items()}


#: what a store's leaves take, for the command line's help
STORE_HELP = (
    f"zarr: {describe({c: LEVELS[c] for c in ('zstd', 'blosc', 'gzip')})}; "
    f"hdf5: {describe({'gzip': LEVELS['gzip']})}, zstd and blosc with the hdf5plugin extra; "
    "zarr row frames (pixels sampled at random, the pixels extra): rows:lz4, rows:zstd[:1-22][:dict]"
)
