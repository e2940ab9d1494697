"""``python -m bench``: the comparative benchmark (see bench/run.py)."""

from .run import main

raise SystemExit(main())
