"""Small file-system helpers shared by the library and the command line."""

from __future__ import annotations

import os

__all__ = ["disk_usage"]


def disk_usage(path: str | os.PathLike) -> int:
    """Bytes of a file, or of every file under a folder (apparent sizes; links not followed)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass  # removed while walking
    return total
