"""A local S3 server (moto's server mode) on 127.0.0.1, for the object storage tests and
figures: a real S3 API over HTTP, started as its own process on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["local_s3_server", "moto_server"]

#: the credentials moto accepts until it is asked to check them
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


@contextmanager
def moto_server(timeout: float = 30.0, unchecked_requests: int | None = None) -> Iterator[str]:
    """Start moto's server; yields its endpoint URL, ends it on exit. With
    ``unchecked_requests`` it checks credentials (moto's IAM) after that many requests,
    which can create the bucket, users and keys."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    if unchecked_requests is not None:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(unchecked_requests)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:  # a connection, not a request: requests count against unchecked_requests
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the moto S3 server on port {port} did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def local_s3_server(bucket: str, timeout: float = 30.0) -> Iterator[str]:
    """Start the server, make ``bucket`` and set the ``AWS_*`` variables for this process
    and its children, as a user would; yields the endpoint URL. Everything is undone on exit."""
    with moto_server(timeout) as endpoint:
        env = {"AWS_ENDPOINT_URL": endpoint, **TEST_CREDENTIALS}
        saved = {k: os.environ.get(k) for k in env}
        try:
            urllib.request.urlopen(
                urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=timeout
            )
            os.environ.update(env)
            yield endpoint
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
