"""The error hierarchy: one base class, each error also the matching built-in.

A caller can catch ``mmreplay.Error`` for everything the library raises on purpose, or
the familiar built-in (``ValueError``, ``FileNotFoundError``...) it derives from.
"""

from __future__ import annotations


class Error(Exception):
    """Base class of every error mmreplay raises on purpose."""


class SpecError(Error, TypeError):
    """A data spec that cannot be stored (not array-like, bad leaf path, bad dtype)."""


class SpecMismatchError(Error, ValueError):
    """A spec or value that does not match the buffer's spec."""


class BadInputError(Error, ValueError):
    """A value given to ``add`` / ``extend`` / ``set`` that does not fit the spec."""


class LockedError(Error, BlockingIOError):
    """Another writer holds the buffer."""


class NotABufferError(Error, FileNotFoundError):
    """The path holds no mmreplay buffer."""


class CorruptBufferError(Error, OSError):
    """The buffer's files are damaged or inconsistent with its metadata."""


class UnsupportedFormatError(Error, ValueError):
    """The buffer was written by a format version this release cannot read."""


class ReadOnlyError(Error, PermissionError):
    """A write was attempted on a buffer opened read-only."""


class ClosedError(Error, ValueError):
    """An operation on a closed store."""


class NotEnoughDataError(Error, ValueError):
    """A read that asks for more committed data than the buffer holds."""


class OverwrittenError(NotEnoughDataError):
    """Rows a reader was reading were overwritten by the writer meanwhile (the ring
    lapped the read); ``step`` is the lowest such step, ``oldest`` the oldest kept now."""

    def __init__(self, message: str, path: str, step: int, oldest: int) -> None:
        super().__init__(message)
        self.path, self.step, self.oldest = path, step, oldest

    def by(self, reader: str) -> OverwrittenError:
        """The same error told to one who did not call the read itself (``reader``: "the
        export", "the command")."""
        return OverwrittenError(
            f"{self.path}: the writer overwrote step {self.step} before {reader} read it (the "
            f"oldest step kept is now {self.oldest}); pause the writer, or give its ring more "
            "capacity, and run it again",
            self.path, self.step, self.oldest,
        )


class DiskFullError(Error, OSError):
    """The file system has no room for the buffer's files."""


class ShutdownError(Error, RuntimeError):
    """The program is ending and can no longer do the I/O asked (a thread still writes
    after the main thread returned)."""


class BufferExistsError(Error, FileExistsError):
    """``create`` found something at the path and ``exist_ok`` was not set."""


class TargetError(Error, FileExistsError):
    """A path an export, convert or import must not write: an existing file or folder that
    is not an earlier export of the same format, or a path inside (or holding) its source."""


class RemoteError(Error, OSError):
    """Object storage failed a request (an ``s3://`` store or export). The subclasses say
    what to do; this class alone is any other refusal (a bad bucket name, a bad setting)."""


class RemoteUnreachableError(RemoteError, ConnectionError):
    """The object store's endpoint cannot be reached or keeps failing: no server there, no
    such host, server errors after every retry. Worth trying again later."""


class RemoteTimeoutError(RemoteUnreachableError, TimeoutError):
    """The object store did not answer in the time allowed (``MMREPLAY_S3_TIMEOUT``)."""


class RemoteAccessError(RemoteError, PermissionError):
    """No credentials were found, the object store refused them, or they do not allow
    the request."""


class NoSuchBucketError(RemoteError, FileNotFoundError):
    """The URL's bucket does not exist at the endpoint."""


class ObjectNotFoundError(RemoteError, FileNotFoundError):
    """An object the request named does not exist (the bucket does)."""
