"""Stores in S3-compatible object storage, read in place through byte-range requests.

A store under ``s3://bucket/prefix`` holds the objects of a store folder, keyed by their
path in it (``mmreplay.json``, ``mmreplay.state``, ``data.zarr/...``). A mapped leaf is a
zarr v3 sharded array whose shards are C-order blocks of whole steps followed by their
index, so a row is one byte range of one shard object: a batch's rows are fetched with
concurrent ranged GETs, neighbours coalesced into one request (``obstore.get_ranges``),
and a sequential pass coalesces into large ranges. A leaf of compressed row frames
(``rows:lz4``, ``rows:zstd``) fetches each segment's shard index once, then only the
frames a batch needs (:class:`RemoteRowFrameLeaf`). Another compressed leaf is read
chunk by chunk, each chunk object decoded by zarr. The committed state is the ``mmreplay.state``
object, read again per batch as a local reader reads its state file, so the seqlock
check of the read path works unchanged.

Everything here needs ``obstore`` (``pip install 'mmreplay[s3]'``), imported on first use.
Credentials and the endpoint come the usual way: the ``AWS_*`` environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``...)
or ``storage_options`` (obstore's ``S3Config`` keys; ``endpoint_url`` is taken as
``endpoint``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import json
import os
import re
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from .backends.base import ChunkedLeaf
from .backends.native_rows import FrameBatch
from .errors import (
    CorruptBufferError,
    Error,
    NoSuchBucketError,
    NotABufferError,
    ObjectNotFoundError,
    ReadOnlyError,
    RemoteAccessError,
    RemoteError,
    RemoteTimeoutError,
    RemoteUnreachableError,
)
from .metadata import MAX_METADATA_BYTES, METADATA_FILE, LeafInfo, Metadata, pair_attrs, parse_metadata
from .statefile import STATE_FILE, State, decode_slot, newest

__all__ = ["Location", "Traffic", "is_url", "open_url"]

SCHEME = "s3://"
#: ranges closer than this are fetched by one request: a request's latency costs more
#: than the bytes between (obstore's default; 64 KiB made sample(256) of 84x84x4 frames
#: 5x slower against a local server)
COALESCE_BYTES = 1 << 20
STATE_TRIES = 8
UPLOADS_IN_FLIGHT = 8
#: compressed row frames closer than this are fetched by one request; a frame is a few
#: KiB, so a batch fetches about its own rows' bytes, not whole segments
FRAME_GAP_BYTES = 64 << 10
#: seconds a request may go unanswered, retries included (else obstore's own limits:
#: 30 s a try, retried for up to 3 minutes)
TIMEOUT_VARIABLE = "MMREPLAY_S3_TIMEOUT"


def is_url(path: Any) -> bool:
    """Whether ``path`` names object storage rather than a local folder."""
    return isinstance(path, str) and path.startswith(SCHEME)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> ``(bucket, prefix)`` (no slashes around the prefix)."""
    if not is_url(url):
        raise ValueError(f"{url!r}: expected an s3://bucket/prefix URL")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise ValueError(f"{url!r}: the URL names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ImportError(
            "reading or writing object storage needs obstore: pip install 'mmreplay[s3]'"
        ) from None
    return obstore


class _Loop:
    """One event loop in a daemon thread, shared by every location of the process: the
    async range requests of a batch run on it together, from any caller (a Jupyter
    kernel's running loop included).

    obstore completes a request from its own (Rust) threads, which must enter the
    interpreter to do so: a request still in flight when the interpreter exits crashes
    the process (SIGABRT, SIGSEGV). So no request is left behind: each is awaited
    through :meth:`track`, which a caller's cancellation does not cut short; a call
    interrupted while waiting (Ctrl-C) stops its coroutine and waits for the requests it
    has in flight; and at exit the loop's thread ends after every request in flight
    (:meth:`stop`)."""

    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    pid = -1
    guard = threading.Lock()
    exiting = False
    #: the requests in flight, and those of the current :meth:`run` call (the loop's thread only)
    inflight: set[asyncio.Future[Any]] = set()
    own: contextvars.ContextVar[set[asyncio.Future[Any]]] = contextvars.ContextVar("mmreplay_requests")

    @classmethod
    def running(cls) -> asyncio.AbstractEventLoop:
        with cls.guard:
            if not (cls.exiting and threading.current_thread().daemon):
                if cls.loop is None or cls.pid != os.getpid():  # none yet, or lost in a fork
                    cls.loop = asyncio.new_event_loop()
                    cls.pid = os.getpid()
                    cls.inflight = set()
                    cls.thread = threading.Thread(
                        target=cls.loop.run_forever, name="mmreplay-objstore", daemon=True
                    )
                    cls.thread.start()
                    if not cls.exiting:
                        atexit.register(cls.stop)
                return cls.loop
        # a daemon thread still reading as the interpreter exits: it may start no request
        # now (one in flight when the interpreter ends crashes the process); exit ends it
        while True:
            time.sleep(3600)

    @classmethod
    def run(cls, coro: Coroutine[Any, Any, Any]) -> Any:
        requests: set[asyncio.Future[Any]] = set()
        task: list[asyncio.Task[Any] | None] = [None]

        async def call() -> Any:
            task[0] = asyncio.current_task()
            cls.own.set(requests)  # the tasks it starts share the set
            return await coro

        loop = cls.running()
        future = asyncio.run_coroutine_threadsafe(call(), loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted: the coroutine stops at its next await
            cls.settle(loop, lambda: [t for t in task if t is not None and not t.done()] + list(requests))
            raise

    @classmethod
    async def track(cls, awaitable: Awaitable[Any]) -> Any:
        """Await one obstore request; a cancelled caller leaves it running to its end,
        counted until then."""
        future = asyncio.ensure_future(awaitable)
        owner = cls.own.get(None)
        for group in (cls.inflight, owner):
            if group is not None:
                group.add(future)
                future.add_done_callback(group.discard)
        future.add_done_callback(_retrieved)
        return await asyncio.shield(future)

    @staticmethod
    def settle(loop: asyncio.AbstractEventLoop, busy: Callable[[], list[asyncio.Future[Any]]]) -> None:
        """Wait until ``busy()`` (futures of ``loop``, read on its thread) is empty. A
        second Ctrl-C does not cut the wait short: a request ends within its timeout,
        and the process must not exit before."""

        async def quiet() -> None:
            while pending := busy():
                await asyncio.wait(pending)

        if not loop.is_running():
            return
        done = asyncio.run_coroutine_threadsafe(quiet(), loop)
        while True:
            try:
                return done.result()
            except KeyboardInterrupt:
                continue

    @classmethod
    def stop(cls) -> None:
        """At exit: every coroutine and request in flight ends, then the loop's thread."""
        with cls.guard:
            loop, thread = cls.loop, cls.thread
            if loop is None or thread is None or cls.pid != os.getpid():
                return
            cls.exiting = True
            cls.loop = cls.thread = None

        def busy() -> list[asyncio.Future[Any]]:
            me = asyncio.current_task()
            return [t for t in asyncio.all_tasks() if t is not me] + list(cls.inflight)

        cls.settle(loop, busy)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)
        if not thread.is_alive():
            loop.close()


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Read a landed request's exception: its caller may have been cancelled meanwhile,
    and an exception never read is logged when the future is collected."""
    if not future.cancelled():
        future.exception()


async def gather_all(*aws: Awaitable[Any]) -> list[Any]:
    """Every awaitable's result, in order. At the first failure (or cancellation) the
    others are cancelled and awaited before it is raised: nothing a call started goes on
    after it returns."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


@dataclass
class Traffic:
    """Range GETs a location's compressed-row reads made, and the bytes they returned
    (what a batch of compressed rows costs in requests and transfer)."""

    requests: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.requests += 1
        self.bytes += nbytes


def merge_spans(starts: np.ndarray, ends: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """Sorted ``[start, end)`` ranges merged where less than ``gap`` bytes lie between:
    one request then fetches them and the bytes between."""
    order = np.argsort(starts, kind="stable")
    out: list[tuple[int, int]] = []
    for a, b in zip(starts[order].tolist(), ends[order].tolist()):
        if out and a - out[-1][1] < gap:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _timeout(given: Any) -> float | None:
    """Seconds a request may take, retries included, from ``storage_options["timeout"]``
    or :data:`TIMEOUT_VARIABLE` (None: obstore's own limits)."""
    text = os.environ.get(TIMEOUT_VARIABLE) if given is None else given
    if text is None or text == "":
        return None
    try:
        seconds = float(text)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:
        raise RemoteError(f"{TIMEOUT_VARIABLE} / timeout={text!r}: expected a number of seconds above 0")
    return seconds


#: S3 error codes that refuse the credentials themselves (not what they may do)
_REFUSED_CREDENTIALS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
}
#: where obstore looks for credentials none were given: instance and container metadata,
#: a web identity token; a failure there means no credentials were found
_CREDENTIAL_SOURCES = (
    "/latest/api/token",
    "/latest/meta-data/",
    "169.254.170.2",
    "AssumeRoleWithWebIdentity",
)


class Location:
    """The objects of one store: ``s3://bucket/prefix`` and how to reach it.

    Every request to object storage goes through the methods below (the store's byte
    source), and every failure of one becomes an mmreplay error in :meth:`remote_error`:
    one line naming the URL and what to do."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        obstore = _obstore()
        from obstore.store import S3Store

        self.bucket, prefix = split_url(url)
        self.url = f"{SCHEME}{self.bucket}/{prefix}".rstrip("/")
        self.storage_options = storage_options
        config = dict(storage_options or {})
        client = dict(config.pop("client_options", None) or {})
        retry = dict(config.pop("retry_config", None) or {})
        self.timeout = _timeout(config.pop("timeout", None))
        if "endpoint_url" in config:
            config["endpoint"] = config.pop("endpoint_url")
        endpoint = (
            config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
        )
        self.endpoint = str(endpoint) if endpoint else ""
        if self.endpoint.startswith("http://"):
            client.setdefault("allow_http", True)  # a local or in-cluster server
        if self.timeout is not None:
            client.setdefault("timeout", timedelta(seconds=min(self.timeout, 30.0)))
            client.setdefault("connect_timeout", timedelta(seconds=min(self.timeout, 5.0)))
            retry.setdefault("retry_timeout", timedelta(seconds=self.timeout))
        try:
            self.store = S3Store(
                self.bucket,
                prefix=prefix or None,
                config=config or None,
                client_options=client or None,
                retry_config=retry or None,
            )
        except Exception as exc:  # obstore's refusal of a setting, or a value of the wrong type
            first = " ".join(str(exc).split("\n\nDebug source:", 1)[0].split())
            raise RemoteError(f"{self.url}: a setting of the object store is refused: {first}") from exc
        self.obstore = obstore
        self.traffic = Traffic()

    def where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def child(self, folder: str) -> Location:
        """The objects under ``folder`` (a store's subfolder, such as its side ring)."""
        return Location(self.where(folder), self.storage_options)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return _Loop.run(coro)

    # --- errors -------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, key: str = "") -> Iterator[None]:
        """Requests made inside raise mmreplay errors (:meth:`remote_error`)."""
        from obstore.exceptions import BaseError, NotModifiedError, PreconditionError

        try:
            yield
        except (Error, PreconditionError, NotModifiedError):
            raise  # ours already; a conditional request's answer (the caller decides)
        except (BaseError, FileNotFoundError) as exc:
            raise self.remote_error(exc, key) from exc

    def remote_error(self, exc: BaseException, key: str = "") -> RemoteError:
        """What an obstore error means for the user: the mmreplay error that says it."""
        text = str(exc)
        head = text.split("\n\nDebug source:", 1)[0]
        code = re.search(r"<Code>([^<]+)</Code>", text)
        code = code.group(1) if code else ""
        said = re.search(r"<Message>([^<]*)</Message>", text)
        said = f"{code}: {said.group(1)}" if said else code
        method = re.search(r"performing (GET|PUT|HEAD|POST|DELETE|LIST)", text)
        request = f"{method.group(1) if method else 'request'} {key}".rstrip()
        server = self.endpoint or "AWS S3"
        endpoint_hint = (
            "check the server and the endpoint (--endpoint-url or AWS_ENDPOINT_URL)"
            if self.endpoint
            else "no AWS_ENDPOINT_URL is set: set it (or --endpoint-url) for another S3-compatible server"
        )
        if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text or "NoSuchKey" in text:
            if code == "NoSuchBucket":
                return NoSuchBucketError(
                    f"{self.url}: no bucket {self.bucket!r} at {server}; create it or correct the URL"
                )
            return ObjectNotFoundError(f"{self.where(key)}: no such object")
        if any(source in text for source in _CREDENTIAL_SOURCES):
            return RemoteAccessError(
                f"{self.url}: no credentials for {server}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or storage_options), or AWS_SKIP_SIGNATURE=true for a public bucket"
            )
        if code in _REFUSED_CREDENTIALS:
            return RemoteAccessError(
                f"{self.url}: {server} refused the credentials ({said}); "
                "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        if code in ("AccessDenied", "AllAccessDisabled") or type(exc).__name__ in (
            "PermissionDeniedError",
            "UnauthenticatedError",
        ):
            return RemoteAccessError(
                f"{self.url}: {server} denied {request} ({said or head}); the credentials need permission to "
                "read the prefix (and to write and delete under it, to push or export)"
            )
        if "kind: Timeout" in text or "timed out" in head.lower():
            took = re.search(r" in ([0-9.]+)s", head)
            after = f" in {float(took.group(1)):.0f} s" if took else ""
            return RemoteTimeoutError(
                f"{self.url}: no answer from {server}{after} ({request}); check the server, or allow "
                f"more time with {TIMEOUT_VARIABLE}=SECONDS"
            )
        if "kind: Connect" in text or "error sending request" in head:
            why = (
                "connection refused"
                if "Connection refused" in text
                else "the host name does not resolve"
                if "dns error" in text
                else "cannot connect"
            )
            return RemoteUnreachableError(f"{self.url}: cannot reach {server} ({why}); {endpoint_hint}")
        status = re.search(r"status code: (5\d\d)", text)
        if status:
            return RemoteUnreachableError(
                f"{self.url}: {server} answered {status.group(1)} {said}".rstrip()
                + f" to {request} after every retry; try again later"
            )
        if code == "InvalidBucketName":
            return RemoteError(f"{self.url}: {self.bucket!r} is not a valid bucket name ({said})")
        first = " ".join(head.split())
        return RemoteError(f"{self.url}: {request} failed: {said or first}")

    # --- requests -----------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes, or None when there is none (``limit``: refuse a larger one,
        reading no more than one byte past it)."""
        options = None if limit is None else {"range": (0, limit + 1)}
        try:
            with self._errors(key):
                raw = bytes(self.obstore.get(self.store, key, options=options).bytes())
        except ObjectNotFoundError:
            return None
        if limit is not None and len(raw) > limit:
            raise CorruptBufferError(
                f"{self.where(key)}: more than the {limit} bytes such an object can hold"
            )
        return raw

    def exists(self, key: str) -> bool:
        try:
            with self._errors(key):
                self.obstore.head(self.store, key)
        except ObjectNotFoundError:
            return False
        return True

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self._errors(key):
            self.obstore.put(self.store, key, data)

    def delete(self, keys: list[str]) -> None:
        if keys:
            with self._errors(keys[0]):
                self.obstore.delete(self.store, keys)

    def list(self, under: str = "") -> dict[str, int]:
        """Key -> size of every object under ``under``."""
        out: dict[str, int] = {}
        with self._errors(under):
            for page in self.obstore.list(self.store, prefix=under or None):
                for obj in page:
                    out[obj["path"]] = int(obj["size"])
        return out

    async def _request(self, key: str, start: Callable[[], Awaitable[Any]]) -> Any:
        """One async request, awaited to its end (:meth:`_Loop.track`), its failure an
        mmreplay error."""
        with self._errors(key):
            return await _Loop.track(start())

    async def get_async(
        self, key: str, options: dict[str, Any] | None = None
    ) -> tuple[bytes, dict[str, Any]]:
        """An object's bytes (``options``: obstore's ``GetOptions``, a range...) and its
        metadata; :class:`ObjectNotFoundError` when there is none."""
        got = await self._request(key, lambda: self.obstore.get_async(self.store, key, options=options))
        data = await self._request(key, got.bytes_async)
        self.traffic.add(len(data))
        return bytes(data), got.meta

    async def put_async(self, key: str, data: bytes | memoryview) -> None:
        await self._request(key, lambda: self.obstore.put_async(self.store, key, data))

    async def ranges(self, key: str, starts: list[int], ends: list[int]) -> list[Any]:
        return await self._request(
            key,
            lambda: self.obstore.get_ranges_async(
                self.store, key, starts=starts, ends=ends, coalesce=COALESCE_BYTES
            ),
        )

    async def fetch(self, key: str, spans: list[tuple[int, int]], etag: str | None = None) -> list[Any]:
        """The bytes of each ``[start, end)`` span of one object, one GET each, all in
        flight together, counted in :attr:`traffic`. With ``etag`` every GET is
        conditional on it: a replaced object raises ``PreconditionError`` rather than
        mixing two versions."""

        async def one(a: int, b: int) -> bytes:
            options: dict[str, Any] = {"range": (a, b)}
            if etag is not None:
                options["if_match"] = etag
            return (await self.get_async(key, options))[0]

        return await gather_all(*(one(a, b) for a, b in spans))

    async def fetch_tail(self, key: str, nbytes: int) -> tuple[bytes, int, str | None]:
        """The last ``nbytes`` of an object, its size and its ETag (one GET)."""
        data, meta = await self.get_async(key, {"range": {"suffix": nbytes}})
        return data, int(meta["size"]), meta.get("e_tag")

    # --- the committed state ------------------------------------------------------

    def read_state(self) -> State:
        """The newest valid slot of the state object."""
        raw = b""
        for _ in range(STATE_TRIES):
            raw = self.get(STATE_FILE, limit=1 << 16) or b""
            if not raw:
                raise CorruptBufferError(f"{self.where(STATE_FILE)}: the state object is missing")
            state = newest(raw)
            if state is not None:
                return state
        why = "; ".join(f"slot {i}: {decode_slot(raw, i)}" for i in (0, 1))
        raise CorruptBufferError(f"{self.where(STATE_FILE)}: neither state slot is valid ({why})")

    def read_metadata(self) -> Metadata:
        """The static metadata with the committed state it pairs with."""
        for _ in range(STATE_TRIES):
            raw = self.get(METADATA_FILE, limit=MAX_METADATA_BYTES)
            if raw is None:
                raise NotABufferError(
                    f"{self.url}: not an mmreplay store (no {METADATA_FILE} object under the prefix); "
                    "check the URL, or publish a store there with mmreplay push"
                )
            meta = parse_metadata(raw, self.where(METADATA_FILE))
            if meta.format_version == 1:
                raise CorruptBufferError(
                    f"{self.where(METADATA_FILE)}: format 1 keeps its state inside the JSON; push the "
                    "store again with this version of mmreplay"
                )
            paired = pair_attrs(meta, self.read_state())
            if paired is not None:
                return paired
        raise CorruptBufferError(f"{self.where(METADATA_FILE)}: its attributes are not the committed state's")

    # --- what a Store needs of its location ---------------------------------------

    def open_state(self) -> RemoteState:
        return RemoteState(self)

    def open_leaves(self, meta: Metadata) -> list[Any]:
        if meta.backend != "zarr":
            raise CorruptBufferError(
                f"{self.url}: a {meta.backend} store cannot be read from object storage; "
                "pull it to a folder first"
            )
        out: list[Any] = []
        from .backends.row_frames import is_row_compression

        for leaf in meta.leaves:
            if leaf.mapped:
                out.append(RemoteMappedLeaf(self, leaf, meta.capacity, meta.num_envs))
            elif is_row_compression(leaf.compression):
                out.append(RemoteRowFrameLeaf(self, leaf, meta.capacity, meta.num_envs))
            else:
                out.append(ChunkedLeaf(leaf, meta.capacity, RemoteChunks(self, leaf, meta)))
        return out

    def take_leaves(self, leaves: list[Any], rows: np.ndarray) -> list[np.ndarray]:
        """Rows of every leaf, the range requests of all leaves in flight together."""

        async def gather() -> list[np.ndarray]:
            jobs = [
                leaf.take_async(rows)
                if isinstance(leaf, RemoteLeaf)
                else asyncio.to_thread(leaf.take, rows)
                for leaf in leaves
            ]
            return await gather_all(*jobs)

        return self.run(gather())


class RemoteState:
    """The state object, read like the local state file (no writes: a remote store is
    published by :func:`mmreplay.push`)."""

    def __init__(self, location: Location):
        self.location = location
        self.path = location.where(STATE_FILE)

    def read(self) -> State:
        return self.location.read_state()

    def write(self, state: State, fsync: bool) -> None:
        raise ReadOnlyError(f"{self.location.url}: a store in object storage is read-only; pull it to write")

    def close(self) -> None:
        pass


def shard_layout(location: Location, leaf: LeafInfo) -> tuple[str, int]:
    """(zarr array key, steps per shard) of a mapped leaf in object storage, from its
    ``zarr.json``: one shard of the whole leaf (a copied folder) or several (a push)."""
    key = f"data.zarr/{leaf.path}/zarr.json"
    raw = location.get(key, limit=1 << 20)
    where = location.where(key)
    if raw is None:
        raise CorruptBufferError(f"{where}: the array metadata of leaf {leaf.path!r} is missing")
    try:
        doc = json.loads(raw)
        steps = int(doc["chunk_grid"]["configuration"]["chunk_shape"][0])
        codec = doc["codecs"][0]
        inner = int(codec["configuration"]["chunk_shape"][0])
        inner_codecs = [c["name"] for c in codec["configuration"]["codecs"]]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise CorruptBufferError(f"{where}: not the zarr metadata of a sharded leaf ({exc!r})") from None
    if (
        codec.get("name") != "sharding_indexed"
        or inner_codecs != ["bytes"]
        or steps % inner
        or inner != leaf.chunk_steps
    ):
        raise CorruptBufferError(
            f"{where}: leaf {leaf.path!r} expected uncompressed shards of chunks of {leaf.chunk_steps} steps, "
            f"found {codec.get('name')} with chunks of {inner} steps and codecs {inner_codecs}"
        )
    return f"data.zarr/{leaf.path}", steps


def shard_key(array_key: str, ndim: int, k: int) -> str:
    return f"{array_key}/c/{k}" + "/0" * (ndim - 1)


class RemoteLeaf(ABC):
    """What every leaf in object storage shares: rows by range requests through
    ``take_async`` (all leaves' requests of a batch in flight together), read-only, no
    page cache."""

    mappable = False
    in_place = False
    atomic_replace = True  # objects are replaced whole
    ranged_read = True
    location: Location
    capacity: int
    num_envs: int

    @abstractmethod
    async def take_async(self, rows: np.ndarray) -> np.ndarray:
        """Rows (flat ids into ``[capacity * num_envs]``) fetched and decoded."""

    def take(self, rows: np.ndarray) -> np.ndarray:
        return self.location.run(self.take_async(rows))

    def read(self, slots: Any) -> np.ndarray:
        if isinstance(slots, slice):
            slots = np.arange(self.capacity)[slots]
        idx = np.asarray(slots, np.int64)
        return self.take((idx % self.capacity)[..., None] * self.num_envs + np.arange(self.num_envs))

    def read_rows(self, slots: Any, envs: Any) -> np.ndarray:
        return self.take(np.asarray(slots, np.int64) * self.num_envs + envs)

    def advise(self, pattern: str, keep: tuple[int, int] | None = None) -> None:  # noqa: B027 (nothing to do for every remote leaf)
        """No page cache to advise: every read is a range request."""

    def willneed(self, rows: np.ndarray) -> None:  # noqa: B027 (nothing to do for every remote leaf)
        """No page cache to fill ahead."""

    def write(self, start: int, values: np.ndarray) -> None:
        raise ReadOnlyError(f"{self.location.url}: a store in object storage is read-only")

    write_slots = write

    def flush(self, fsync: bool) -> None:  # noqa: B027 (nothing to do for every remote leaf)
        pass


class RemoteMappedLeaf(RemoteLeaf):
    """An uncompressed leaf in object storage: each row a byte range of a shard object."""

    def __init__(self, location: Location, info: LeafInfo, capacity: int, num_envs: int):
        self.location = location
        self.info = info
        self.capacity = capacity
        self.num_envs = num_envs
        self.dtype = info.spec.dtype.newbyteorder("<")
        self.row_bytes = info.spec.nbytes
        self.step_bytes = num_envs * self.row_bytes
        self.array_key, self.shard_steps = shard_layout(location, info)
        self.ndim = 2 + len(info.spec.shape)

    async def take_async(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        shape = rows.shape + tuple(self.info.spec.shape)
        flat = rows.reshape(-1) % (self.capacity * self.num_envs)
        if self.row_bytes == 0 or flat.size == 0:
            return np.zeros(shape, self.info.spec.dtype)
        unique, inverse = np.unique(flat, return_inverse=True)
        slots = unique // self.num_envs
        shard = slots // self.shard_steps
        offsets = (slots - shard * self.shard_steps) * self.step_bytes + (
            unique % self.num_envs
        ) * self.row_bytes
        cuts = np.flatnonzero(shard[1:] != shard[:-1]) + 1
        groups = np.split(np.arange(unique.size), cuts)
        jobs = []
        for sel in groups:
            starts = offsets[sel]
            key = shard_key(self.array_key, self.ndim, int(shard[sel[0]]))
            jobs.append(self.location.ranges(key, starts.tolist(), (starts + self.row_bytes).tolist()))
        try:
            parts = await gather_all(*jobs)
        except ObjectNotFoundError as exc:
            raise CorruptBufferError(f"leaf {self.info.path!r}: a shard object is missing ({exc})") from None
        raw = b"".join(bytes(b) for part in parts for b in part)
        if len(raw) != unique.size * self.row_bytes:
            raise CorruptBufferError(
                f"leaf {self.info.path!r}: expected {unique.size * self.row_bytes} bytes of rows from "
                f"{self.location.where(self.array_key)}, got {len(raw)} (a shard object is cut short)"
            )
        got = np.frombuffer(raw, self.dtype).reshape(unique.size, *self.info.spec.shape)
        return got[inverse.reshape(-1)].astype(self.info.spec.dtype, copy=False).reshape(shape)

    def invalidate(self, slots: Iterable[tuple[int, int]]) -> None:
        pass  # nothing is cached

    def close(self) -> None:
        pass


class RemoteRowFrameLeaf(RemoteLeaf):
    """A leaf of compressed row frames (``rows:lz4`` / ``rows:zstd``) in object storage.

    Each sealed segment is a shard object whose index (at its end) gives every row's
    frame: the index is fetched once per segment and kept with the object's ETag, then a
    batch fetches only its rows' frames, neighbours merged (:data:`FRAME_GAP_BYTES`),
    every request of every segment in flight together and conditional on the ETag (a
    segment a later push replaced is indexed again). Rows of the segment the writer was
    in come raw from the ``rows.staging`` object, checked against its header the same
    way.
    """

    def __init__(self, location: Location, info: LeafInfo, capacity: int, num_envs: int):
        from .backends import row_frames as rf

        self.rf = rf
        self.location = location
        self.info = info
        self.capacity = capacity
        self.num_envs = num_envs
        self.dtype = info.spec.dtype.newbyteorder("<")
        self.tail = tuple(info.spec.shape)
        self.row_bytes = info.spec.nbytes
        self.seg = info.chunk_steps
        self.seg_rows = self.seg * num_envs
        self.ndim = 2 + len(info.spec.shape)
        self.array_key = f"data.zarr/{info.path}"
        self.staging_key = f"{self.array_key}/{rf.STAGING_FILE}"
        self.where = f"leaf {info.path!r}"
        self.frames = rf._Frames(rf.parse_row_compression(info.compression or ""), self.row_bytes, None)
        #: segment -> (ETag, offsets, lengths) of its shard object
        self.indexes: dict[int, tuple[str | None, np.ndarray, np.ndarray]] = {}

    async def _index(self, k: int) -> tuple[str | None, np.ndarray, np.ndarray] | None:
        """Segment ``k``'s shard index (None: no shard object), fetched once."""
        if k not in self.indexes:
            key = shard_key(self.array_key, self.ndim, k)
            need = self.rf.index_bytes(self.seg_rows)
            try:
                tail, size, etag = await self.location.fetch_tail(key, need)
            except ObjectNotFoundError:
                return None
            where = f"{self.where}: {self.location.where(key)}"
            offsets, lengths = self.rf.parse_shard_index(bytes(tail), self.seg_rows, size - need, where)
            self.indexes[k] = (etag, offsets, lengths)
        return self.indexes[k]

    async def _staging(self) -> tuple[str | None, tuple[int, int, int, int]]:
        """The staging object's ETag and header (seq, segment, base, filled)."""
        rf = self.rf
        try:
            head, meta = await self.location.get_async(self.staging_key, {"range": (0, rf.HEADER_BYTES)})
            etag = meta.get("e_tag")
        except ObjectNotFoundError:
            raise CorruptBufferError(
                f"{self.where}: its staging object {self.location.where(self.staging_key)} is missing"
            ) from None
        if head[: len(rf.STAGING_MAGIC)] != rf.STAGING_MAGIC:
            raise CorruptBufferError(f"{self.location.where(self.staging_key)}: not a staging object (bad magic)")
        seq, segment, base, filled = (int(x) for x in np.frombuffer(head, "<i8", 4, len(rf.STAGING_MAGIC)))
        return etag, (seq, segment, base, filled)

    async def _dictionary(self) -> None:
        """Load the trained zstd dictionary once it is there (frames before it decode
        without it)."""
        if not self.frames.codec.dictionary or self.frames.dictionary is not None:
            return
        key = f"{self.array_key}/{self.rf.DICTIONARY_FILE}"
        try:
            raw, _ = await self.location.get_async(key)
        except ObjectNotFoundError:
            return
        self.frames._use(self.frames._zstd.ZstdCompressionDict(raw))

    async def _gather(self, flat: np.ndarray, out: np.ndarray) -> None:
        seg_of = flat // self.seg_rows
        inner = flat - seg_of * self.seg_rows
        wanted = np.unique(seg_of).tolist()
        found = await gather_all(self._staging(), self._dictionary(), *(self._index(k) for k in wanted))
        etag, (_, segment, base, filled) = found[0]
        indexes = dict(zip(wanted, found[2:]))
        step = inner // self.num_envs
        staged = (seg_of == segment) & (step >= base) & (step < filled)
        jobs = []
        if staged.any():
            pos = self.rf.HEADER_BYTES + inner[staged] * self.row_bytes
            a, b = int(pos.min()), int(pos.max()) + self.row_bytes
            jobs.append(self.location.fetch(self.staging_key, [(a, b)], etag))
        plans = []
        for k in wanted:
            sel = np.flatnonzero((seg_of == k) & ~staged)
            if not sel.size:
                continue
            index = indexes[k]
            key = shard_key(self.array_key, self.ndim, k)
            offsets = None if index is None else index[1][inner[sel]]
            if index is None or offsets is None or (offsets < 0).any():
                bad = int(flat[sel][0] if offsets is None else flat[sel][offsets < 0][0])
                raise CorruptBufferError(
                    f"{self.where}: row {bad} (slot {bad // self.num_envs}, env {bad % self.num_envs}) is not in "
                    f"shard object {self.location.where(key)}: it holds committed steps; see `mmreplay verify`"
                )
            lengths = index[2][inner[sel]]
            spans = merge_spans(offsets, offsets + lengths, FRAME_GAP_BYTES)
            plans.append((sel, offsets, lengths, spans))
            jobs.append(self._frames_of(k, key, spans, index[0]))
        parts = list(await asyncio.gather(*jobs, return_exceptions=True))  # none left running
        failed = [p for p in parts if isinstance(p, BaseException)]
        if failed:
            raise failed[0]
        if staged.any():
            (raw,) = parts.pop(0)
            rows = np.frombuffer(raw, np.uint8).reshape(-1, self.row_bytes)
            out[staged] = rows[(pos - a) // self.row_bytes]
        buffers: list[Any] = []
        which, where, at, sizes = [], [], [], []
        for (sel, offsets, lengths, spans), bufs in zip(plans, parts):
            starts = np.array([s[0] for s in spans], np.int64)
            span = np.searchsorted(starts, offsets, side="right") - 1
            which.append(span + len(buffers))
            where.append(sel)
            at.append(offsets - starts[span])
            sizes.append(lengths)
            buffers.extend(bufs)
        if buffers:
            batch = FrameBatch(
                buffers,
                np.concatenate(which).astype(np.int32),
                np.concatenate(where),
                np.concatenate(at),
                np.concatenate(sizes),
            )
            try:
                self.frames.decode(batch, out)
            except CorruptBufferError:
                raise
            except Exception as exc:
                raise CorruptBufferError(f"{self.where}: a row frame does not decode: {exc}") from exc

    async def _frames_of(self, k: int, key: str, spans: list[tuple[int, int]], etag: str | None) -> list[Any]:
        from obstore.exceptions import PreconditionError

        try:
            return await self.location.fetch(key, spans, etag)
        except PreconditionError:
            self.indexes.pop(k, None)  # a push replaced the segment since its index was read
            raise

    async def take_async(self, rows: np.ndarray) -> np.ndarray:
        from obstore.exceptions import PreconditionError

        rows = np.asarray(rows, np.int64)
        flat = rows.reshape(-1) % (self.capacity * self.num_envs)
        unique, inverse = np.unique(flat, return_inverse=True)
        out = np.empty((unique.size, self.row_bytes), np.uint8)
        if unique.size:
            for _ in range(STATE_TRIES):
                try:
                    await self._gather(unique, out)
                    break
                except PreconditionError:  # a push replaced an object while it was read: again
                    pass
            else:
                raise CorruptBufferError(f"{self.where}: its objects kept changing while read")
        return out[inverse.reshape(-1)].view(self.dtype).reshape(rows.shape + self.tail)

    def invalidate(self, slots: Iterable[tuple[int, int]]) -> None:
        """A reader's refresh: the segments with new rows may have been sealed again."""
        for a, b in slots:
            for k in range(a // self.seg, (b - 1) // self.seg + 1):
                self.indexes.pop(k, None)

    def close(self) -> None:
        self.frames.close()


class RemoteChunks:
    """Chunk I/O of a compressed leaf in object storage: each chunk object is fetched
    through the location (its requests and errors like every other), then decoded by
    zarr from memory. Which chunk objects exist is listed once, and again when the state
    moves."""

    in_place = False

    def __init__(self, location: Location, leaf: LeafInfo, meta: Metadata):
        import zarr
        from zarr.core.buffer import cpu
        from zarr.storage import MemoryStore

        self.location = location
        self.key = f"data.zarr/{leaf.path}"
        raw = location.get(f"{self.key}/zarr.json", limit=1 << 20)
        if raw is None:
            raise CorruptBufferError(
                f"{location.where(self.key)}: the array metadata of leaf {leaf.path!r} is missing"
            )
        self.buffer = cpu.Buffer.from_bytes
        #: the array's objects zarr decodes from: its metadata, and the chunk being read
        self.objects: dict[str, Any] = {"zarr.json": self.buffer(raw)}
        self.decoding = threading.Lock()  # one chunk in ``objects`` at a time
        try:
            with warnings.catch_warnings():  # row frames declare numcodecs' codecs, on purpose
                warnings.filterwarnings("ignore", "Numcodecs codecs are not in the Zarr version 3")
                self.arr = zarr.open_array(store=MemoryStore(self.objects, read_only=True), mode="r")
        except Exception as exc:
            raise CorruptBufferError(
                f"{location.where(self.key)}: cannot open the zarr array of leaf {leaf.path!r}: {exc}"
            ) from None
        expected = (meta.capacity, meta.num_envs, *leaf.spec.shape)
        if self.arr.shape != expected:
            raise CorruptBufferError(
                f"{location.where(self.key)}: leaf {leaf.path!r} expected shape {expected}, found {self.arr.shape}"
            )
        self.shape = self.arr.shape
        self.present: set[str] | None = None

    def _chunk(self, k: int) -> str:
        return self.arr.metadata.encode_chunk_key((k,) + (0,) * (self.arr.ndim - 1))

    def _key(self, k: int) -> str:
        return f"{self.key}/{self._chunk(k)}"

    def read(self, k: int, a: int, b: int) -> np.ndarray:
        raw = self.location.get(self._key(k))  # None: never written, read as the fill value
        with self.decoding:
            if raw is not None:
                self.objects[self._chunk(k)] = self.buffer(raw)
            try:
                return np.asarray(self.arr[a:b])
            finally:
                self.objects.pop(self._chunk(k), None)

    def exists(self, k: int) -> bool:
        if self.present is None:
            self.present = set(self.location.list(self.key + "/"))
        return self._key(k) in self.present

    def refresh(self) -> None:
        self.present = None

    def write(self, k: int, a: int, b: int, chunk: np.ndarray) -> None:
        raise ReadOnlyError(f"{self.location.url}: a store in object storage is read-only")

    def flush(self, fsync: bool, staged: dict[int, np.ndarray]) -> None:
        pass

    def close(self) -> None:
        pass


def open_url(url: str, mode: str = "r", storage_options: dict[str, Any] | None = None) -> Any:
    """A read-only :class:`mmreplay.Store` over the store at ``url``."""
    from .store import Store

    if mode != "r":
        raise ReadOnlyError(
            f"{url}: a store in object storage opens read-only (mode='r'); "
            "mmreplay.pull it to a folder to write, then push it back"
        )
    location = Location(url, storage_options)
    meta = location.read_metadata()
    sampler = None
    if meta.sampler is not None and meta.sampler.get("name") == "prioritized":
        from .samplers.registry import make_sampler

        warnings.warn(
            f"{location.url}: its priorities stay in the pushed folder; sampling from object storage "
            "is uniform (pull the store to sample by priority)",
            stacklevel=3,
        )
        sampler = make_sampler("uniform")
    return Store(location.url, meta, "r", None, sampler, location=location)


def export_to_url(write: Any, url: str, force: bool, storage_options: dict[str, Any] | None) -> Any:
    """Run ``write(local_path)`` into a temporary folder, then upload what it wrote under
    ``url``: a file to the URL's key, a folder's files below it. The result names the URL."""
    import dataclasses
    import tempfile

    from .errors import TargetError

    bucket, key = split_url(url)
    if not key:
        raise ValueError(f"{url!r}: name the export's key below the bucket (s3://bucket/path)")
    name = key.rsplit("/", 1)[-1]
    with tempfile.TemporaryDirectory(prefix="mmreplay-export-") as tmp:
        local = os.path.join(tmp, name)
        result = write(local)
        if os.path.isfile(local):  # one file: its key is the URL
            location = Location(url.rstrip("/").rpartition("/")[0], storage_options)
            files = [(local, name)]
            there = {name: 0} if location.exists(name) else {}
        else:
            location = Location(url, storage_options)
            files = [
                (os.path.join(d, f), os.path.relpath(os.path.join(d, f), local).replace(os.sep, "/"))
                for d, _, names in os.walk(local)
                for f in names
            ]
            there = location.list()
        if there and not force:
            raise TargetError(
                f"{url}: objects exist there already; pass force=True (--force) to replace them"
            )

        async def upload() -> None:
            limit = asyncio.Semaphore(UPLOADS_IN_FLIGHT)

            async def one(path: str, key: str) -> None:
                async with limit:
                    data = await asyncio.to_thread(_read_file, path)
                    await location.put_async(key, data)

            await gather_all(*(one(p, k) for p, k in files))

        location.run(upload())
        location.delete(sorted(set(there) - {k for _, k in files}))
    base = url.rstrip("/")

    def remote(value: Any) -> Any:  # local paths of what was written -> their URLs
        if isinstance(value, str) and (value == local or value.startswith(local + os.sep)):
            rel = os.path.relpath(value, local).replace(os.sep, "/")
            return base if rel == "." else f"{base}/{rel}"
        if isinstance(value, list):
            return [remote(v) for v in value]
        return value

    return dataclasses.replace(
        result, path=remote(result.path), info={k: remote(v) for k, v in result.info.items()}
    )


def _read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def verify_url(url: str, deep: bool = True, storage_options: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with the store at ``url`` (empty: healthy): its metadata and state,
    each mapped leaf's shard objects (present, whole, with the index zarr readers need)
    and each compressed leaf's chunk objects that hold committed steps (``deep``: they
    decode too); the same of the side ring of a store that keeps each frame once, over
    the slots written so far."""
    from . import frames_layout as frames
    from .verify import _only_ref, _side_state

    location = Location(url, storage_options)
    try:
        meta = location.read_metadata()
    except CorruptBufferError as exc:
        return [str(exc)]
    if meta.backend != "zarr":
        return [f"{location.url}: a {meta.backend} store; only zarr stores are read from object storage"]
    problems = _verify_leaves(location, meta, deep)
    if meta.frames is not None and meta.frames.side:
        side_location = location.child(frames.SIDE_DIR)
        side = frames.side_metadata(meta)
        where = f"the side ring of next frames ({side_location.url})"
        found = _verify_leaves(side_location, side.with_state(State()), False)
        if not found:
            try:
                (ref,) = side_location.open_leaves(_only_ref(side))
                written = int(np.asarray(ref.read(slice(None))).reshape(-1, 2)[:, 0].max(initial=0))
            except CorruptBufferError as exc:
                found, written = [f"does not open: {exc}"], 0
            if written:
                found = _verify_leaves(side_location, side.with_state(_side_state(meta, written)), deep)
        problems.extend(f"{where}: {text}" for text in found)
    return problems


def _verify_leaves(location: Location, meta: Metadata, deep: bool) -> list[str]:
    """:func:`verify_url`'s checks of the leaves of ``meta`` under ``location``."""
    from .backends.checks import chunks_of
    from .backends.zarr_v3 import shard_index

    problems: list[str] = []
    listing = location.list()
    for leaf in meta.leaves:
        where = f"leaf {leaf.path!r}"
        if leaf.mapped:
            try:
                array_key, steps = shard_layout(location, leaf)
            except CorruptBufferError as exc:
                problems.append(f"{where}: {exc}")
                continue
            m = steps // leaf.chunk_steps
            chunk_bytes = leaf.chunk_steps * meta.num_envs * leaf.spec.nbytes
            index = shard_index(m, chunk_bytes).tobytes()
            ndim = 2 + len(leaf.spec.shape)
            for k in range(-(-meta.capacity // steps)):
                key = shard_key(array_key, ndim, k)
                size = listing.get(key)
                if size is None:
                    problems.append(f"{where}: shard object {location.where(key)} is missing")
                elif size != m * chunk_bytes + len(index):
                    problems.append(
                        f"{where}: shard object {location.where(key)} has {size} bytes, "
                        f"expected {m * chunk_bytes + len(index)}"
                    )
                elif location.run(location.ranges(key, [m * chunk_bytes], [size]))[0] != index:
                    problems.append(
                        f"{where}: {location.where(key)}: the shard index does not point at its block"
                    )
            continue
        try:
            chunks = RemoteChunks(location, leaf, meta)
        except CorruptBufferError as exc:
            problems.append(f"{where}: {exc}")
            continue
        for k in chunks_of(meta, leaf):
            key = chunks._key(k)
            if key not in listing:
                problems.append(
                    f"{where}: chunk object {location.where(key)} is missing (it holds committed steps)"
                )
            elif deep:
                a, b = k * leaf.chunk_steps, min((k + 1) * leaf.chunk_steps, meta.capacity)
                try:
                    chunks.read(k, a, b)
                except RemoteError:
                    raise  # the object store failed, not the chunk
                except Exception as exc:
                    problems.append(f"{where}: chunk object {location.where(key)} does not decode ({exc})")
    return problems
