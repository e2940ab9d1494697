"""``python -m mmreplay.cli``: the ``mmreplay`` command, for environments without the script."""

import sys

from . import main

sys.exit(main(prog_name="mmreplay"))
