"""Shared fixtures: a small nested spec, each backend with and without compression,
``run_cli`` to run the command line in a fresh process as a user does, and ``writers``
to kill a writer process and reopen what it left."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

# torch trains the tests' small networks fastest on one thread (more only spin), in this
# process and in those the tests start: set before anything imports torch
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import mmreplay as mr  # noqa: E402

# A run started in the background (``pytest &`` in a script, nohup) inherits SIGINT or
# SIGHUP ignored, and so would every process the tests start and then interrupt: the tests
# run as from a terminal, with both at their default action
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def pytest_configure(config: pytest.Config) -> None:
    # With PYTHONDONTWRITEBYTECODE set, no interpreter caches bytecode, so each of the
    # hundreds of processes the tests start (the command line, writers, examples) compiles
    # this project's ~70 modules again: 0.1 s each. Compiled once here (before the workers
    # start), they read it from __pycache__ (git-ignored) as a default setup would.
    if sys.flags.dont_write_bytecode and not hasattr(config, "workerinput"):
        import compileall

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for folder in ("mmreplay", "cli", "bench", "examples"):
            compileall.compile_dir(os.path.join(root, folder), quiet=2)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help="also run long tests (crash torture at scale, big buffers)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long test: run with --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


#: (backend, compression) pairs every storage test runs on
LAYOUTS = [("zarr", None), ("zarr", "zstd"), ("hdf5", None), ("hdf5", "gzip")]
LAYOUT_IDS = [f"{b}-{c or 'mapped'}" for b, c in LAYOUTS]
#: the layouts with row-frame leaves too (tests of the leaf protocol and of visibility)
WITH_ROWS = LAYOUTS + [("zarr", "rows:lz4"), ("zarr", "rows:zstd:1")]
WITH_ROWS_IDS = [f"{b}-{c or 'mapped'}" for b, c in WITH_ROWS]
#: the layouts as a ``spread`` axis: (backend, compression), or as the ``layout`` fixture gives them
LAYOUT_AXIS = dict(zip(LAYOUT_IDS, LAYOUTS))
LAYOUT_KWARGS = {name: {"backend": b, "compression": c} for name, (b, c) in LAYOUT_AXIS.items()}


def spread(*axes: Mapping | Sequence, normal: Collection[str] | None = None) -> list:
    """Parametrize cases for the product of ``axes`` (each ``{id: value}`` or a list of
    values; a tuple value fills several argument names). The normal run takes the fewest
    cases that hold every value of every axis (or the cases whose ids are ``normal``, which
    must hold every value too when there are several axes); the other combinations run only
    with ``--long``."""
    axes = [list(a.items()) if isinstance(a, Mapping) else [(str(v), v) for v in a] for a in axes]
    diagonal = {tuple(i % len(a) for a in axes) for i in range(max(map(len, axes)))}
    out, seen = [], set()
    for index in itertools.product(*(range(len(a)) for a in axes)):
        picked = [a[i] for a, i in zip(axes, index)]
        name = "-".join(k for k, _ in picked)
        values = [x for _, v in picked for x in (v if isinstance(v, tuple) else (v,))]
        short = index in diagonal if normal is None else name in normal
        seen |= set(enumerate(index)) if short else set()
        out.append(pytest.param(*values, id=name, marks=() if short else pytest.mark.long))
    assert normal is None or set(normal) <= {p.id for p in out}, normal
    assert len(axes) == 1 or seen == {(n, i) for n, a in enumerate(axes) for i in range(len(a))}, normal
    return out


@pytest.fixture(params=LAYOUTS, ids=LAYOUT_IDS)
def layout(request: pytest.FixtureRequest) -> dict:
    backend, compression = request.param
    return {"backend": backend, "compression": compression}


@pytest.fixture
def nested_spec() -> dict:
    return {
        "obs": {"pixels": mr.ArraySpec((4, 4, 3), "uint8"), "state": mr.ArraySpec((5,), "float32")},
        "action": mr.ArraySpec((2,), "int64"),
        "reward": mr.ArraySpec((), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }


def make_step(spec: dict, num_envs: int, t: int) -> dict:
    """A step whose every value is a function of its global step id ``t`` (and env)."""
    def leaf(s: mr.ArraySpec, salt: int) -> np.ndarray:
        base = np.arange(num_envs).reshape((num_envs,) + (1,) * len(s.shape))
        value = (t * 7 + base * 3 + salt) + np.zeros((num_envs, *s.shape))
        if s.dtype == np.bool_:
            return (value.astype(np.int64) % 2).astype(bool)
        return value.astype(s.dtype)

    out: dict = {}
    for i, (key, sub) in enumerate(sorted(spec.items())):
        out[key] = make_step(sub, num_envs, t) if isinstance(sub, dict) else leaf(sub, i)
    return out


def folder_digest(path) -> dict[str, str]:
    """SHA-256 of every file under ``path`` but the lock: a refused write changes none."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            if name == ".lock":
                continue
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


S3_BUCKET = "replays"


@pytest.fixture(scope="session")
def s3_server():
    """One moto S3 server on 127.0.0.1 for the session, with the bucket ``replays`` and
    the ``AWS_*`` variables set for this process and its children (bench/s3_server.py)."""
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.s3_server import local_s3_server

    with local_s3_server(S3_BUCKET) as endpoint:
        yield endpoint


def run_cli(*args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``mmreplay ARGS...`` in a fresh interpreter (nothing imported or registered by the
    test process leaks in), with its exit status, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "mmreplay.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def one_line_error(out: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Check a refusal: exit status ``code``, one ``Error: ...`` line on stderr holding each
    needle, no traceback, nothing on stdout. Returns the line."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, (out.returncode, out.stderr)
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert out.stdout == "", out.stdout
    return lines[0]


def verify_cli(path) -> tuple[int, list[str]]:
    """``mmreplay verify PATH`` in a fresh process: its exit status and the problems it printed."""
    out = run_cli("verify", path)
    assert "Traceback" not in out.stderr, out.stderr
    problems = [line[len("problem: ") :] for line in out.stdout.splitlines() if line.startswith("problem: ")]
    assert (out.returncode == 1) == bool(problems), (out.returncode, out.stdout, out.stderr)
    return out.returncode, problems


@dataclass
class CliRecovery:
    """What ``mmreplay recover PATH`` printed in a fresh process, read back."""

    code: int
    text: str
    lost: tuple[int, int] | None
    actions: list[str]

    @property
    def ok(self) -> bool:
        return self.code == 0

    def __str__(self) -> str:
        return self.text


def recover_cli(path) -> CliRecovery:
    """``mmreplay recover PATH`` in a fresh process; a refusal fails the test (use run_cli)."""
    out = run_cli("recover", path)
    assert out.returncode in (0, 1) and "Traceback" not in out.stderr, (out.returncode, out.stderr)
    found = re.search(r"^lost committed steps \[(\d+), (\d+)\)", out.stdout, re.M)
    body = out.stdout.split("still damaged:")[0]
    actions = [line[2:] for line in body.splitlines() if line.startswith("- ")]
    lost = (int(found[1]), int(found[2])) if found else None
    return CliRecovery(out.returncode, out.stdout, lost, actions)


#: pytest's options to load, of the plugins installed here, only hypothesis' (add them to a
#: run with :func:`no_plugins`' environment): zarr's takes ~1 s to load, and no other
#: project's tests use it, xdist's or anyio's
ONLY_HYPOTHESIS = ["-p", "_hypothesis_pytestplugin"]


def no_plugins(env: dict | None = None) -> dict:
    """``env`` (else this process's) for a pytest run that loads no installed plugin unless named."""
    return {**(os.environ if env is None else env), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def run_their_tests(test, env: dict | None = None) -> tuple[set[str], set[str], str]:
    """Run another project's test file with pytest in a fresh process: (names failed,
    names passed, the output's tail), read from its JUnit report."""
    import xml.etree.ElementTree as ET

    report = test.parent / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *ONLY_HYPOTHESIS, f"--junitxml={report}", str(test)],
        cwd=test.parent, capture_output=True, text=True, timeout=1800, env=no_plugins(env),
    )  # fmt: skip
    outcome = {c.get("name"): {e.tag for e in c} for c in ET.parse(report).getroot().iter("testcase")}
    failed = {name for name, tags in outcome.items() if tags & {"failure", "error"}}
    passed = {name for name, tags in outcome.items() if not tags & {"failure", "error", "skipped"}}
    return failed, passed, run.stdout[-6000:]


class Writers:
    """Writer processes in fresh interpreters, ended by SIGKILL: the kill-and-reopen
    scenario of every crash test. A process a test started and did not end is killed
    when the test ends, whatever happened."""

    def __init__(self) -> None:
        self._started: list[subprocess.Popen] = []

    def start(self, code: str, *args: object, **popen) -> subprocess.Popen:
        """``python -c CODE ARGS...`` with its stdout as a text pipe."""
        popen.setdefault("stdout", subprocess.PIPE)
        proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], text=True, **popen)
        self._started.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL ``proc`` and check that the kill is what ended it."""
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, proc.returncode

    def kill_when(self, proc: subprocess.Popen, ready: Callable[[str], bool]) -> str:
        """Read the lines ``proc`` prints until ``ready(line)``, then SIGKILL it; the line."""
        for line in proc.stdout:
            if ready(line):
                self.kill(proc)
                return line
        raise AssertionError(f"the writer ended (status {proc.wait()}) before it was ready")

    def run_killed(self, code: str, *args: object, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run code that kills itself with SIGKILL where it means to crash, and check that
        it died so (stderr in the message otherwise)."""
        done = subprocess.run(
            [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-3000:])
        return done

    def close(self) -> None:
        for proc in self._started:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


@pytest.fixture
def writers() -> Iterator[Writers]:
    """Start writers, kill them, and know none outlives the test (:class:`Writers`)."""
    started = Writers()
    try:
        yield started
    finally:
        started.close()
