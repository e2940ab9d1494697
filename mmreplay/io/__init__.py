"""Where a store's bytes come from: a local folder or an object-store prefix, behind one
small interface (:class:`ByteSource`). Everything above reads through it; a remote
failure becomes an mmreplay error here (:mod:`.remote`) and nowhere else."""

from __future__ import annotations

import os
from typing import Any

from .base import SCHEME, ByteSource, Handle, ObjectChanged, coalesce
from .local import LocalFolder

__all__ = ["ByteSource", "Handle", "LocalFolder", "ObjectChanged", "coalesce", "is_url", "open_source"]


def is_url(path: Any) -> bool:
    """Whether ``path`` names object storage rather than a local folder."""
    return isinstance(path, str) and path.startswith(SCHEME)


def open_source(where: str | os.PathLike | ByteSource, storage_options: dict[str, Any] | None = None) -> ByteSource:
    """The byte source of a store: ``where`` itself, an ``s3://bucket/prefix`` URL's
    prefix (``storage_options``: how to reach it), or a local folder."""
    if isinstance(where, ByteSource):
        return where
    if is_url(where):
        from .remote import ObjectPrefix

        return ObjectPrefix(str(where), storage_options)
    if storage_options:
        raise ValueError(f"{os.fspath(where)}: storage_options are for s3:// URLs; a local folder takes none")
    return LocalFolder(where)
