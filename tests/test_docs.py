"""Every runnable block of README.md and docs/*.md runs, so the documentation cannot rot.

A fenced block is runnable when its info string is ``python run`` or ``bash run``
(renderers read only the first word, the language). A block whose info string holds
``file=NAME`` (``python file=train.py``) is written to that file in the working folder,
for the blocks after it to run. ``needs=torch,gymnasium`` names optional packages: a
file with a block whose packages are missing is skipped with that reason. A fenced
block with the info string ``text output`` right after a runnable block is what that
block prints (``...`` matches anything, as in doctest); the test compares them.

The blocks of one file run in order in one fresh process (Python blocks share their
names, as in a notebook), in a temporary working folder holding a copy of
``datasets/``. Bash blocks run with ``bash -euo pipefail`` in the same folder, with the
installed ``mmreplay`` command on PATH.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")


@dataclass
class Block:
    language: str  # python, bash, or file (written to ``name``)
    source: str
    line: int  # of the block's first source line in the file
    needs: tuple[str, ...] = ()
    output: str | None = None
    name: str | None = None


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(info string, source, first source line) of every fenced block."""
    out = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info, start = m["fence"], m["info"].strip(), i + 1
        j = start
        while j < len(lines) and not re.match(rf"^ *{fence[0]}{{{len(fence)},}} *$", lines[j]):
            j += 1
        out.append((info, "\n".join(lines[start:j]) + "\n", start + 1))
        i = j + 1
    return out


def runnable_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    previous_runnable = False
    for info, source, line in fenced_blocks(text):
        words = info.split()
        if words[:2] == ["text", "output"] and previous_runnable:
            blocks[-1].output = source
            previous_runnable = False
            continue
        options = dict(word.split("=", 1) for word in words[1:] if "=" in word)
        needs = tuple(n for n in options.get("needs", "").split(",") if n)
        previous_runnable = len(words) >= 2 and words[0] in ("python", "bash") and words[1] == "run"
        if previous_runnable:
            blocks.append(Block(words[0], source, line, needs))
        elif "file" in options:
            blocks.append(Block("file", source, line, needs, name=options["file"]))
    return blocks


#: run in the child: each block in turn, Python in one shared namespace
DRIVER = r'''
import contextlib, doctest, io, json, os, subprocess, sys
path, blocks = sys.argv[1], json.load(sys.stdin)
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
namespace = {"__name__": "__main__"}
checker = doctest.OutputChecker()
for block in blocks:
    where = f"{path}:{block['line']}"
    if block["language"] == "file":
        with open(block["name"], "w") as f:
            f.write(block["source"])
        continue
    if block["language"] == "python":
        code = compile("\n" * (block["line"] - 1) + block["source"], path, "exec")
        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured):
                exec(code, namespace)
        finally:
            sys.stdout.write(captured.getvalue())
        got = captured.getvalue()
    else:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block["source"]],
                              capture_output=True, text=True)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        if done.returncode != 0:
            sys.exit(f"{where}: the bash block exited with status {done.returncode}")
        got = done.stdout
    want = block["output"]
    if want is not None and not checker.check_output(want, got, doctest.ELLIPSIS):
        sys.exit(f"{where}: the block printed\n{got}\nwhere its output block says\n{want}")
'''


def run_blocks(doc: pathlib.Path, blocks: list[Block], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Run ``blocks`` of ``doc`` in order in a fresh Python process working in ``cwd``."""
    return subprocess.run(
        [sys.executable, "-c", DRIVER, str(doc)],
        input=json.dumps([asdict(b) for b in blocks]),
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def missing(needs: tuple[str, ...]) -> list[str]:
    return [name for name in needs if importlib.util.find_spec(name) is None]


@pytest.mark.parametrize("doc", DOC_FILES, ids=[str(p.relative_to(ROOT)) for p in DOC_FILES])
def test_runnable_blocks(doc: pathlib.Path, tmp_path: pathlib.Path) -> None:
    blocks = runnable_blocks(doc.read_text())
    if not blocks:
        pytest.skip(f"{doc.name} has no runnable block")
    lacking = sorted({name for block in blocks for name in missing(block.needs)})
    if lacking:
        pytest.skip(f"{doc.name} needs {', '.join(lacking)}")
    shutil.copytree(ROOT / "datasets", tmp_path / "datasets")
    done = run_blocks(doc, blocks, tmp_path)
    assert done.returncode == 0, f"{doc.relative_to(ROOT)}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def test_blocks_are_found_with_their_lines_and_outputs() -> None:
    text = "\n".join([
        "intro",
        "```python run needs=torch",
        "print(1)",
        "```",
        "```text output",
        "1",
        "```",
        "```python",
        "not run",
        "```",
        "````bash run",
        "echo ```",
        "````",
        "```python file=train.py needs=torch",
        "import torch",
        "```",
    ])
    blocks = runnable_blocks(text)
    assert [(b.language, b.line, b.needs, b.output, b.name) for b in blocks] == [
        ("python", 3, ("torch",), "1\n", None),
        ("bash", 12, (), None, None),
        ("file", 15, ("torch",), None, "train.py"),
    ]
    assert blocks[1].source == "echo ```\n"


@pytest.mark.parametrize(
    "text, says",
    [
        ("x\n\n```python run\nx = 1\nraise ValueError('boom')\n```\n", 'File "{doc}", line 5'),
        ("```python run\nprint('a')\n```\n```text output\nb\n```\n", "{doc}:2: the block printed"),
        ("```bash run\nfalse\n```\n", "{doc}:2: the bash block exited with status 1"),
    ],
    ids=["raises", "wrong-output", "bash-fails"],
)
def test_a_broken_block_fails_and_says_where(tmp_path: pathlib.Path, text: str, says: str) -> None:
    doc = tmp_path / "broken.md"
    doc.write_text(text)
    done = run_blocks(doc, runnable_blocks(text), tmp_path)
    assert done.returncode != 0
    assert says.format(doc=doc) in done.stderr


def test_the_cli_reference_names_every_command_and_option() -> None:
    """docs/cli.md has a section per command and mentions each of its options."""
    import click
    from mmreplay.cli import COMMANDS, main

    text = (ROOT / "docs" / "cli.md").read_text()
    ctx = click.Context(main)
    missing_parts = []
    for name in COMMANDS:
        if f"\n## {name}\n" not in text:
            missing_parts.append(f"section '## {name}'")
        command = main.get_command(ctx, name)
        for param in command.params:
            if isinstance(param, click.Option):
                for opt in param.opts + param.secondary_opts:
                    if opt.startswith("--") and opt not in text:
                        missing_parts.append(f"{name} {opt}")
    assert not missing_parts, f"docs/cli.md does not mention: {', '.join(missing_parts)}"


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for heading in re.findall(r"^#+ +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_links_between_the_docs_lead_somewhere() -> None:
    broken = []
    for doc in DOC_FILES:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and anchor not in anchors(path.read_text()):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
