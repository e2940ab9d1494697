"""The checks after each writer run: the buffer opens, every committed step the ring
still holds reads bit-exact, nothing past the committed cursor is visible, and the files
verify."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layouts import TrialConfig, rows_of
from .report import TortureFailure
from .rows import FRAME_STACK


@dataclass
class Expectation:
    """What the harness knows from the writers' reports in one trial."""

    reported: int = 0  # the newest commit a writer reported complete (or must have made)
    announced: int = 0  # one past the newest step a writer announced it would write
    checked_end: int = 0  # the committed cursor the last check found
    dropped_early: bool = False  # a full side ring of next frames dropped steps (frames once)


#: what verify says of a compressed HDF5 file after a refused chunk write, which the next
#: writer or ``recover`` repairs losing nothing (tests/test_faults.py), and of the flags a
#: killed HDF5 writer leaves
_NOT_DAMAGE = ("status flags", "before the end HDF5 recorded")


def check_store(path: str, config: TrialConfig, exp: Expectation) -> int:
    """Checks (a)-(c) through a reader, then :func:`~mmreplay.verify.verify` on the files;
    returns the number of steps compared bit-exact."""
    from ..errors import Error
    from ..store import open as open_store
    from ..verify import verify

    try:
        store = open_store(path, "r")
    except Error as exc:
        raise TortureFailure(f"(a) the buffer does not open after the ending: {exc}") from None
    try:
        cap = config.capacity
        end, first = store.committed_steps, store.first_step
        if end < exp.reported:
            raise TortureFailure(f"(b) committed cursor {end} is behind the reported commit {exp.reported}")
        if end > exp.announced:
            raise TortureFailure(f"(c) committed cursor {end} is past every step written ({exp.announced})")
        shrink = FRAME_STACK - 1 if config.layout.frames else 0  # stacks need the frames before them
        must_from = max(0, exp.reported - cap, exp.announced + config.ahead - cap) + shrink
        if must_from < exp.reported and first > must_from and not exp.dropped_early:
            raise TortureFailure(
                f"(b) steps [{must_from}, {first}) were committed and not overwritten by the ring, "
                f"but the store keeps only [{first}, {end})"
            )
        if store.total_steps != end or len(store) != end - first:
            raise TortureFailure(
                f"(c) a reader sees total_steps {store.total_steps}, len {len(store)} for committed [{first}, {end})"
            )
        try:
            store.get(len(store))
        except IndexError:
            pass
        else:
            raise TortureFailure(f"(c) get({len(store)}) returned a row past the committed cursor {end}")
        steps = np.arange(first, end)
        for lo in range(0, len(steps), 256):
            ids = steps[lo : lo + 256]
            got = store.read_steps(ids)
            want = rows_of(config.layout, store.num_envs, ids)
            for path_, a, b in zip(store.leaf_paths, got, want):
                if a.tobytes() != b.tobytes():
                    bad = [int(s) for s, x, y in zip(ids, a, b) if x.tobytes() != y.tobytes()]
                    raise TortureFailure(
                        f"(b) leaf {path_!r}: committed steps {bad[:8]}{'...' if len(bad) > 8 else ''} "
                        f"are not bit-exact (committed [{first}, {end}))"
                    )
        exp.checked_end = end
    finally:
        store.close()
    # the files too: sizes, chunks that decode, the episode index against the role leaves
    problems = [p for p in verify(path) if not any(words in p for words in _NOT_DAMAGE)]
    if problems:
        raise TortureFailure("verify found: " + "; ".join(problems))
    return len(steps)
