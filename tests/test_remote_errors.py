"""Object storage fails the way local storage does: every remote failure (endpoint down,
no answer, no bucket, no store under the prefix, credentials missing or refused, access
denied) is one line naming the URL and what to do, with its documented exit status, and
an mmreplay error from Python. Real servers on 127.0.0.1: moto's (one of them checking
credentials), a closed port, a socket that never answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid

import numpy as np
import pytest
from conftest import S3_BUCKET, one_line_error, run_cli

import mmreplay as mr

pytest.importorskip("obstore")
pytest.importorskip("moto")

#: the variables through which obstore may find credentials of its own
CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def environment(**changes: str | None) -> dict[str, str]:
    """This process's environment (the s3_server fixture's AWS_* included) with
    ``changes``; None removes a variable."""
    env = dict(os.environ)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def closed_endpoint() -> str:
    """An endpoint where nothing listens: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def silent_endpoint():
    """An endpoint that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def guarded():
    """A moto server that checks credentials, with the bucket ``locked`` and a user
    allowed nothing: (endpoint, that user's key id, its secret)."""
    boto3 = pytest.importorskip("boto3")
    from bench.s3_server import TEST_CREDENTIALS, moto_server

    with moto_server(unchecked_requests=3) as endpoint:  # the three requests below
        login = {
            "endpoint_url": endpoint,
            "region_name": "us-east-1",
            "aws_access_key_id": "testing",
            "aws_secret_access_key": "testing",
        }
        boto3.client("s3", **login).create_bucket(Bucket="locked")
        iam = boto3.client("iam", **login)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        assert TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"] != key["AccessKeyId"]
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """A small store to push."""
    path = tmp_path_factory.mktemp("remote-errors") / "buf"
    with mr.create(path, {"x": mr.ArraySpec((3,), "float32")}, capacity=16, num_envs=2) as s:
        s.extend({"x": np.ones((5, 2, 3), np.float32)})
    return str(path)


def a_url() -> str:
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:12]}/buffer"


#: how each command is run against a URL: reading it, or writing to it
READ_AND_WRITE = {
    "inspect": lambda url, local: ("inspect", url),
    "push": lambda url, local: ("push", local, url),
}
EVERY_COMMAND = {
    **READ_AND_WRITE,
    "verify": lambda url, local: ("verify", url),
    "stats": lambda url, local: ("stats", url),
    "pull": lambda url, local: ("pull", url, local + "-pulled"),
    "export": lambda url, local: ("export", local, url + "/steps.npz", "-f", "npz", "-q"),
}


def run_each(commands: dict, local: str, env: dict[str, str] | None = None, url: str | None = None) -> dict:
    """Each command against ``url`` (a new one by default), all in fresh processes side by
    side: name -> (the URL, what it printed and its exit status)."""
    urls = {name: url or a_url() for name in commands}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "mmreplay.cli", *make(urls[name], local)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, make in commands.items()
    }
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        out[name] = urls[name], subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def test_an_endpoint_that_is_down_is_one_line_exit_8(s3_server, local):
    endpoint = closed_endpoint()
    env = environment(AWS_ENDPOINT_URL=endpoint, MMREPLAY_S3_TIMEOUT="2")  # retries for 2 s at most
    for url, out in run_each(EVERY_COMMAND, local, env).values():
        one_line_error(out, 8, url, f"cannot reach {endpoint} (connection refused)", "--endpoint-url")
    assert not os.path.exists(local + "-pulled")


def test_without_an_endpoint_the_error_says_how_to_set_one(s3_server, local):
    """AWS S3 itself: unreachable here, or refusing the test credentials elsewhere."""
    url = a_url()
    out = run_cli("inspect", url, env=environment(AWS_ENDPOINT_URL=None, MMREPLAY_S3_TIMEOUT="3"))
    assert out.returncode in (6, 8), out.stderr
    line = one_line_error(out, out.returncode, url, "AWS S3")
    assert out.returncode == 6 or "AWS_ENDPOINT_URL" in line


def test_an_endpoint_that_never_answers_times_out_in_one_line(s3_server, local, silent_endpoint):
    env = environment(AWS_ENDPOINT_URL=silent_endpoint, MMREPLAY_S3_TIMEOUT="1")
    for url, out in run_each(READ_AND_WRITE, local, env).values():
        one_line_error(out, 8, url, f"no answer from {silent_endpoint}", "MMREPLAY_S3_TIMEOUT")


def test_a_missing_bucket_is_one_line_exit_3(s3_server, local):
    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    for url, out in run_each(READ_AND_WRITE, local, url=f"s3://{bucket}/x").values():
        one_line_error(out, 3, url, f"no bucket {bucket!r}", "create it")


def test_a_prefix_without_a_store_is_one_line_exit_3(s3_server, local):
    commands = {name: EVERY_COMMAND[name] for name in ("inspect", "pull")}
    for url, out in run_each(commands, local).values():
        one_line_error(out, 3, url, "not an mmreplay store", "mmreplay push")


def test_missing_credentials_are_one_line_exit_6(s3_server, local):
    # no credentials anywhere: obstore then asks the instance metadata, here a closed port
    unset = dict.fromkeys(CREDENTIAL_VARIABLES)
    env = environment(**unset, AWS_METADATA_ENDPOINT=closed_endpoint(), MMREPLAY_S3_TIMEOUT="2")
    for url, out in run_each(READ_AND_WRITE, local, env).values():
        one_line_error(out, 6, url, "no credentials", "AWS_ACCESS_KEY_ID")


def test_refused_credentials_are_one_line_exit_6(guarded, local):
    endpoint, key, secret = guarded
    for key_id, code in [("AKIAUNKNOWN000000000", "InvalidAccessKeyId"), (key, "SignatureDoesNotMatch")]:
        env = environment(
            AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=key_id, AWS_SECRET_ACCESS_KEY="not " + secret
        )
        for url, out in run_each(READ_AND_WRITE, local, env, url="s3://locked/buffer").values():
            one_line_error(out, 6, url, "refused the credentials", code, "AWS_SECRET_ACCESS_KEY")


def test_credentials_without_permission_are_one_line_exit_6(guarded, local):
    endpoint, key, secret = guarded
    env = environment(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    for url, out in run_each(READ_AND_WRITE, local, env, url="s3://locked/buffer").values():
        one_line_error(out, 6, url, "denied", "AccessDenied", "permission")


def test_a_bad_timeout_setting_is_one_line_exit_2(s3_server, local):
    out = run_cli("inspect", a_url(), env=environment(MMREPLAY_S3_TIMEOUT="soon"))
    one_line_error(out, 2, "MMREPLAY_S3_TIMEOUT", "'soon'", "seconds")


def test_python_gets_mmreplay_errors_that_are_also_the_builtins(
    s3_server, local, silent_endpoint, guarded, monkeypatch
):
    """The same failures from Python: an mmreplay error of one line, which is also the
    built-in a caller may catch (ConnectionError, TimeoutError, FileNotFoundError,
    PermissionError)."""
    cases = [
        (
            lambda: mr.open(a_url(), storage_options={"endpoint": closed_endpoint()}),
            mr.RemoteUnreachableError,
            ConnectionError,
        ),
        (
            lambda: mr.open(a_url(), storage_options={"endpoint": silent_endpoint, "timeout": 1}),
            mr.RemoteTimeoutError,
            TimeoutError,
        ),
        (
            lambda: mr.push(local, f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x"),
            mr.NoSuchBucketError,
            FileNotFoundError,
        ),
        (lambda: mr.pull(a_url(), local + "-never"), mr.NotABufferError, FileNotFoundError),
        (
            lambda: mr.open(
                "s3://locked/x",
                storage_options={
                    "endpoint": guarded[0],
                    "access_key_id": "AKIAUNKNOWN000000000",
                    "secret_access_key": "x",
                },
            ),
            mr.RemoteAccessError,
            PermissionError,
        ),
        (
            lambda: mr.push(
                local,
                "s3://locked/x",
                storage_options={
                    "endpoint": guarded[0],
                    "access_key_id": guarded[1],
                    "secret_access_key": guarded[2],
                },
            ),
            mr.RemoteAccessError,
            PermissionError,
        ),
    ]
    for call, error, builtin in cases:
        with pytest.raises(error) as caught:
            call()
        assert isinstance(caught.value, builtin) and isinstance(caught.value, mr.Error)
        text = str(caught.value)
        assert text.startswith("s3://") and "\n" not in text and len(text) < 400, text
    for name in CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", closed_endpoint())
    with pytest.raises(mr.RemoteAccessError, match="no credentials"):
        mr.open(a_url(), storage_options={"timeout": 5})
    assert not os.path.exists(local + "-never")
