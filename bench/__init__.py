"""Benchmarks of mmreplay, one entry point: ``python -m bench`` lists them,
``python -m bench NAME [options]`` runs one (``--help`` for its options, ``--smoke`` for
its smallest size, which checks that it runs and measures nothing worth quoting).

Every table is printed with the command, the date and the machine's load average
(bench/timing.py); quote figures from a quiet machine only.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from types import ModuleType

from . import timing

#: name -> module of bench/ (each has ``SMOKE``, ``options(parser)`` and ``run(args)``)
BENCHMARKS = {
    "peers": "peers",
    "hot-path": "hot_path",
    "sampling": "sampling",
    "cold-rows": "cold_rows",
    "pixels": "pixels",
    "mapping-budget": "mapping_budget",
    "prioritized": "prioritized",
    "group": "group",
    "object-store": "object_store",
    "export": "export",
    "lerobot": "export_lerobot",
    "view": "view",
    "compat": "compat",
    "sb3": "compat_sb3",
    "her": "her",
    "torchrl": "compat_torchrl",
    "nstep": "nstep",
}


def module(name: str) -> ModuleType:
    return importlib.import_module(f"bench.{BENCHMARKS[name]}")


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [
        "python -m bench NAME [--smoke] [--json OUT] [--dir DIR] [options]; NAME --help for its options",
        "",
    ]
    lines += [f"  {name:{width}}  {module(name).__doc__.splitlines()[0]}" for name in BENCHMARKS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"no benchmark named {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    bench = module(name)
    parser = argparse.ArgumentParser(
        prog=f"python -m bench {name}",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--smoke", action="store_true", help=f"the smallest size: {bench.SMOKE}")
    parser.add_argument("--json", metavar="OUT", help="also write the printed tables to this file")
    parser.add_argument("--dir", help="folder for the buffers (default: a temporary folder)")
    bench.options(parser)
    if "--smoke" in rest:  # options given on the command line still win
        parser.set_defaults(**bench.SMOKE)
    args = parser.parse_args(rest)
    with tempfile.TemporaryDirectory(prefix=f"mmreplay-bench-{name}-", dir=args.dir) as root:
        args.root = root
        bench.run(args)
    if args.json:
        timing.write_json(args.json)
    return 0
