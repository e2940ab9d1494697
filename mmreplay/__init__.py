"""mmreplay: a disk-persistent, memory-mapped replay store for reinforcement learning."""

from .creation import create
from .errors import (
    BadInputError,
    ClosedError,
    CorruptBufferError,
    DiskFullError,
    Error,
    LockedError,
    NoSuchBucketError,
    NotABufferError,
    NotEnoughDataError,
    ObjectNotFoundError,
    OverwrittenError,
    ReadOnlyError,
    RemoteAccessError,
    RemoteError,
    RemoteTimeoutError,
    RemoteUnreachableError,
    ShutdownError,
    SpecError,
    SpecMismatchError,
    TargetError,
    UnsupportedFormatError,
)
from .formats import export, import_dataset
from .frames_layout import Frames
from .group import Group, GroupSampleInfo, create_group, open_group, open_shard
from .pictures import view
from .read import Hindsight, NStep
from .sizes import SizeEstimate, estimate
from .spec import ArraySpec, to_spec
from .store import BufferExistsError, Store, open

__version__ = "0.1.0"

__all__ = [
    "ArraySpec",
    "Frames",
    "Hindsight",
    "NStep",
    "Store",
    "create",
    "open",
    "export",
    "import_dataset",
    "view",
    "push",
    "pull",
    "Group",
    "GroupSampleInfo",
    "create_group",
    "open_group",
    "open_shard",
    "estimate",
    "SizeEstimate",
    "to_spec",
    "Error",
    "BadInputError",
    "BufferExistsError",
    "ClosedError",
    "CorruptBufferError",
    "DiskFullError",
    "LockedError",
    "NotABufferError",
    "NotEnoughDataError",
    "OverwrittenError",
    "ReadOnlyError",
    "RemoteError",
    "RemoteUnreachableError",
    "RemoteTimeoutError",
    "RemoteAccessError",
    "NoSuchBucketError",
    "ObjectNotFoundError",
    "SpecError",
    "ShutdownError",
    "SpecMismatchError",
    "TargetError",
    "UnsupportedFormatError",
]


def __getattr__(name: str) -> object:
    """``push`` and ``pull`` (object storage) load their module, and zarr, on first use."""
    if name in ("push", "pull"):
        from . import snapshots

        return getattr(snapshots, name)
    raise AttributeError(f"module 'mmreplay' has no attribute {name!r}")
