"""``python -m bench``: list the benchmarks, or run one (see bench/__init__.py)."""

from . import main

raise SystemExit(main())
