"""An object-store prefix as a byte source: ``s3://bucket/prefix`` read through obstore.

Every request to object storage goes through :class:`ObjectPrefix`, and every failure of
one becomes an mmreplay error in :meth:`ObjectPrefix.remote_error` (one line naming the
URL and what to do), here and nowhere else. The ranged reads of a batch run together on
one event loop (:class:`_Loop`), each handle's reads conditional on the ETag its first
read found, so a push that replaces an object never mixes two versions of it.

Everything here needs ``obstore`` (``pip install 'mmreplay[s3]'``), imported on first use.
Credentials and the endpoint come the usual way: the ``AWS_*`` environment variables
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``...)
or ``storage_options`` (obstore's ``S3Config`` keys; ``endpoint_url`` is taken as
``endpoint``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from .. import errors
from .base import SCHEME, ByteSource, Handle, ObjectChanged, Range

__all__ = ["ObjectPrefix", "Traffic", "gather_all", "gather_bounded", "split_url"]

#: seconds a request may go unanswered, retries included (else obstore's own limits:
#: 30 s a try, retried for up to 3 minutes)
TIMEOUT_VARIABLE = "MMREPLAY_S3_TIMEOUT"
#: why a store of the hdf5 backend found in object storage is neither read nor pulled
HDF5_REFUSED = (
    "an hdf5 store is not read from object storage: copy its folder to a local disk, "
    "where `mmreplay convert --backend zarr` makes a store that push can publish"
)


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> ``(bucket, prefix)`` (no slashes around the prefix)."""
    if not url.startswith(SCHEME):
        raise errors.BadInputError(f"{url!r}: expected an s3://bucket/prefix URL")
    bucket, _, prefix = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise errors.BadInputError(f"{url!r}: the URL names no bucket (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ImportError(
            "reading or writing object storage needs obstore: pip install 'mmreplay[s3]'"
        ) from None
    return obstore


class _EventLoop(asyncio.SelectorEventLoop):
    """An event loop that counts the threads inside :meth:`call_soon_threadsafe`.

    obstore lands a request by calling it from one of its own threads, which writes a
    byte to the loop's self-pipe with the GIL released. The loop may run the landed
    callback before that write returns: the request is done, and yet its thread has
    still to take the GIL back. Were the interpreter to end then, that thread would be
    made to exit inside Rust frames, which aborts the process (SIGABRT). :meth:`_Loop.stop`
    waits for the count to fall to zero."""

    def __init__(self) -> None:
        super().__init__()
        self.callers = 0
        self.counting = threading.Lock()

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:
        with self.counting:
            self.callers += 1
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            with self.counting:
                self.callers -= 1

    def wait_for_callers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.callers and time.monotonic() < deadline:
            time.sleep(0.001)


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

    loop: _EventLoop | None = None
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
                if cls.loop is not None and cls.pid != os.getpid():  # a fork of a process that made requests
                    raise errors.RemoteError(
                        f"process {os.getpid()} was forked from one that used object storage, whose client "
                        "(obstore's runtime) does not survive a fork: its requests would wait forever; start "
                        "such processes with spawn or forkserver (DataLoader(multiprocessing_context='spawn'))"
                    )
                if cls.loop is None:
                    cls.loop = _EventLoop()
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

        future = None
        try:
            loop = cls.running()
            future = asyncio.run_coroutine_threadsafe(call(), loop)
            result = future.result()
            if cls.exiting:  # after stop(), from an exit hook: the loop is not stopped again
                loop.wait_for_callers(60)
            return result
        except BaseException:
            if future is not None:
                future.cancel()  # interrupted: the coroutine stops at its next await
                cls.settle(loop, lambda: [t for t in task if t is not None and not t.done()] + list(requests))
            coro.close()  # interrupted before it began: not left to warn "never awaited"
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
        loop.wait_for_callers(60)
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


async def gather_bounded(job: Callable[[Any], Awaitable[Any]], items: Iterable[Any], limit: int) -> list[Any]:
    """``job(item)`` for every item, at most ``limit`` running at once, as :func:`gather_all`
    runs them: a transfer of many objects keeps a bounded number of requests in flight."""
    slots = asyncio.Semaphore(limit)

    async def one(item: Any) -> Any:
        async with slots:
            return await job(item)

    return await gather_all(*(one(item) for item in items))


@dataclass
class Traffic:
    """The GETs of batches a prefix made, and the bytes they returned (what a batch
    costs in requests and transfer)."""

    requests: int = 0
    bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.requests += 1
        self.bytes += nbytes


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
        raise errors.RemoteError(
            f"{TIMEOUT_VARIABLE} / timeout={text!r}: expected a number of seconds above 0"
        )
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


class RemoteHandle(Handle):
    """An object under the prefix: found at its first read, which pins its ETag."""

    def __init__(self, source: ObjectPrefix, key: str):
        self.source, self.key = source, key

    def read_at(self, offset: int, nbytes: int) -> bytes:
        """The bytes as the object is now (not pinned: the state object, replaced by each push)."""
        return self.source.read(self.key, nbytes, start=offset, end=offset + nbytes)


class ObjectPrefix(ByteSource):
    """The objects of one store: ``s3://bucket/prefix`` and how to reach it."""

    local = False
    #: ranges closer than this are fetched by one request: a request's latency costs more
    #: than the bytes between; a frame is a few KiB, so a batch of compressed rows fetches
    #: about its own rows' bytes, not whole segments
    gap_bytes = 64 << 10

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
            raise errors.RemoteError(
                f"{self.url}: a setting of the object store is refused: {first}"
            ) from exc
        self.obstore = obstore
        self.traffic = Traffic()

    def child(self, folder: str) -> ObjectPrefix:
        return ObjectPrefix(self.where(folder), self.storage_options)

    # --- errors -------------------------------------------------------------------

    def remote_error(self, exc: BaseException, key: str = "") -> errors.Error:
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
                return errors.NoSuchBucketError(
                    f"{self.url}: no bucket {self.bucket!r} at {server}; create it or correct the URL"
                )
            return errors.ObjectNotFoundError(f"{self.where(key)}: no such object")
        if any(source in text for source in _CREDENTIAL_SOURCES):
            return errors.RemoteAccessError(
                f"{self.url}: no credentials for {server}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or storage_options), or AWS_SKIP_SIGNATURE=true for a public bucket"
            )
        if code in _REFUSED_CREDENTIALS:
            return errors.RemoteAccessError(
                f"{self.url}: {server} refused the credentials ({said}); "
                "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            )
        if code in ("AccessDenied", "AllAccessDisabled") or type(exc).__name__ in (
            "PermissionDeniedError",
            "UnauthenticatedError",
        ):
            return errors.RemoteAccessError(
                f"{self.url}: {server} denied {request} ({said or head}); the credentials need permission to "
                "read the prefix (and to write and delete under it, to push or export)"
            )
        if "kind: Timeout" in text or "timed out" in head.lower():
            took = re.search(r" in ([0-9.]+)s", head)
            after = f" in {float(took.group(1)):.0f} s" if took else ""
            return errors.RemoteTimeoutError(
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
            return errors.RemoteUnreachableError(
                f"{self.url}: cannot reach {server} ({why}); {endpoint_hint}"
            )
        status = re.search(r"status code: (5\d\d)", text)
        if status:
            return errors.RemoteUnreachableError(
                f"{self.url}: {server} answered {status.group(1)} {said}".rstrip()
                + f" to {request} after every retry; try again later"
            )
        if code == "InvalidRange":  # a read that begins past the object's end: it is cut short
            size = re.search(r"<ActualObjectSize>(\d+)<", text)
            start = re.search(r"<RangeRequested>bytes=(\d+)", text)
            found = f" ({size.group(1)} bytes, read from byte {start.group(1)})" if size and start else ""
            return errors.CorruptBufferError(f"{self.where(key)}: the object is cut short{found}; see `mmreplay verify`")
        if code == "InvalidBucketName":
            return errors.RemoteError(f"{self.url}: {self.bucket!r} is not a valid bucket name ({said})")
        first = " ".join(head.split())
        return errors.RemoteError(f"{self.url}: {request} failed: {said or first}")

    # --- whole objects --------------------------------------------------------------

    def read(
        self, key: str, limit: int, what: str = "the object", start: int = 0, end: int | None = None
    ) -> bytes:
        if start < 0:
            asked, options = -start, {"range": {"suffix": -start}}
        elif end is None:  # to the end: no more than one byte past the limit
            asked, options = None, {"range": (start, start + limit + 1)}
        else:
            asked, options = end - start, {"range": (start, end)}
        if asked is not None and asked > limit:
            raise errors.CorruptBufferError(
                f"{self.where(key)}: {asked} bytes, larger than {what} can be (at most {limit})"
            )
        raw, _ = self.run(self._get(key, options))
        if len(raw) > limit:
            raise errors.CorruptBufferError(f"{self.where(key)}: more than the {limit} bytes {what} can be")
        return raw

    def get(self, key: str) -> bytes | None:
        """The whole object, or None when there is none (no size limit: for what mmreplay
        itself wrote there)."""
        try:
            return self.run(self._get(key))[0]
        except errors.ObjectNotFoundError:
            return None

    def exists(self, key: str) -> bool:
        try:
            self.run(self._request(key, lambda: self.obstore.head_async(self.store, key)))
        except errors.ObjectNotFoundError:
            return False
        return True

    def replace(self, key: str, data: bytes | memoryview, exclusive: bool = False) -> None:
        mode = "create" if exclusive else "overwrite"
        self.run(self._request(key, lambda: self.obstore.put_async(self.store, key, data, mode=mode)))

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.replace(key, data)

    def delete(self, keys: list[str]) -> None:
        if keys:
            self.run(self._request(keys[0], lambda: self.obstore.delete_async(self.store, keys)))

    def list(self, under: str = "") -> dict[str, int]:
        """Key -> size of every object under ``under``."""
        listing = self.obstore.list(self.store, prefix=under or None)
        found = self.run(self._request(under, listing.collect_async))
        return {obj["path"]: int(obj["size"]) for obj in found}

    def no_store(self) -> Exception:
        return errors.NotABufferError(
            f"{self.url}: not an mmreplay store (no mmreplay.json object under the prefix); "
            "check the URL, or publish a store there with mmreplay push"
        )

    # --- ranged reads -----------------------------------------------------------------

    def handle(self, key: str, writable: bool = False) -> RemoteHandle:
        if writable:
            raise errors.ReadOnlyError(
                f"{self.url}: a store in object storage is read-only; pull it to write"
            )
        return RemoteHandle(self, key)

    async def read_ranges(
        self, ranges: Sequence[Range], into: np.ndarray, advise: bool = False
    ) -> list[int | None]:
        view = memoryview(into.reshape(-1))
        jobs, at = [], 0
        for h, a, b in ranges:
            asked = -a if a < 0 else b - a
            jobs.append(self._read_range(h, a, b, view[at : at + asked]))
            at += asked
        got = await asyncio.gather(*jobs, return_exceptions=True)  # every request ends first
        failed = [g for g in got if isinstance(g, BaseException)]
        if failed:
            raise failed[0]
        return got

    async def _read_range(self, h: Handle, a: int, b: int, into: memoryview) -> int | None:
        from obstore.exceptions import PreconditionError

        options: dict[str, Any] = {"range": {"suffix": -a} if a < 0 else (a, b)}
        if h.version is not None:
            options["if_match"] = h.version
        try:
            data, meta = await self.get_async(h.key, options)
        except errors.ObjectNotFoundError:
            return None
        except PreconditionError:
            raise ObjectChanged(h) from None
        h.size, h.version = int(meta["size"]), meta.get("e_tag")
        n = min(len(data), len(into))
        into[:n] = data[:n]
        return n

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Every request, blocking ones too, is made on the loop: a thread left inside a
        blocking obstore call as the interpreter ends aborts the process."""
        return _Loop.run(coro)

    def take_leaves(self, leaves: list[Any], rows: np.ndarray) -> list[np.ndarray]:
        """Rows of every leaf of a batch, the requests of all leaves in flight together."""

        async def gather() -> list[np.ndarray]:
            jobs = [
                leaf.take_async(rows) if hasattr(leaf, "take_async") else asyncio.to_thread(leaf.take, rows)
                for leaf in leaves
            ]
            return await gather_all(*jobs)

        return self.run(gather())

    # --- requests -------------------------------------------------------------------

    async def _request(self, key: str, start: Callable[[], Awaitable[Any]]) -> Any:
        """One async request, awaited to its end (:meth:`_Loop.track`), its failure an
        mmreplay error (:meth:`remote_error`)."""
        from obstore.exceptions import BaseError, NotModifiedError, PreconditionError

        try:
            return await _Loop.track(start())
        except (errors.Error, PreconditionError, NotModifiedError):
            raise  # ours already; a conditional request's answer (the caller decides)
        except (BaseError, FileNotFoundError) as exc:
            raise self.remote_error(exc, key) from exc

    async def _get(self, key: str, options: dict[str, Any] | None = None) -> tuple[bytes, dict[str, Any]]:
        got = await self._request(key, lambda: self.obstore.get_async(self.store, key, options=options))
        return bytes(await self._request(key, got.bytes_async)), got.meta

    async def get_async(
        self, key: str, options: dict[str, Any] | None = None
    ) -> tuple[bytes, dict[str, Any]]:
        """An object's bytes (``options``: obstore's ``GetOptions``, a range...) and its
        metadata, counted in :attr:`traffic`; :class:`ObjectNotFoundError` when there is none."""
        data, meta = await self._get(key, options)
        self.traffic.add(len(data))
        return data, meta

    async def put_async(self, key: str, data: bytes | memoryview) -> None:
        await self._request(key, lambda: self.obstore.put_async(self.store, key, data))
