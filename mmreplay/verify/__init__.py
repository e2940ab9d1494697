"""Checking a buffer's files against its metadata, and bringing a damaged one back.

:func:`verify` lists every problem it finds (an empty list means healthy): metadata that
does not parse, data files missing or of the wrong size, arrays whose shape, dtype,
chunking or compression differ from the metadata, a zarr shard index that no longer
points at the mapped block, chunks of committed steps that are missing or do not decode (an HDF5 chunk that a
killed writer tore is fine while the chunk journal holds it: the next writer writes it
back), a damaged chunk journal, an HDF5 file left marked open by a writer that died, an
episode index that disagrees with the data.

:func:`recover` brings a damaged buffer back to its last consistent commit where that
is possible. Rows cannot be rebuilt, so the recovered buffer keeps the newest committed
steps whose rows are all intact and drops the older ones (a buffer's committed steps are
one contiguous window); it says which steps it dropped and why. The side ring of next
frames of a store that keeps each frame once is checked and repaired as leaves are: the
steps whose next frames were in its damaged part are dropped. Its ``ref`` leaf (each
slot's sequence number and step) is rebuilt from the rows that point into the ring, so
damage to it alone loses no step. Damaged files are moved aside (``*.damaged-<time>``),
never deleted.

Both read the buffer as untrusted input: the metadata is validated before any file is
opened, and no code in the folder is ever executed.

Each backend checks and repairs its own data files (``verify_leaves`` and ``repair`` in
:mod:`mmreplay.backends.zarr_v3` and :mod:`mmreplay.backends.hdf5`); this package holds
what is common: the checks and the order of the work (:mod:`~mmreplay.verify.checks`),
the side ring's check and repair (:mod:`~mmreplay.verify.side_ring`), and the recovery
(:mod:`~mmreplay.verify.recovery`).
"""

from ..backends.hdf5 import hdf5_status
from .checks import checked, leftovers, verify
from .recovery import Recovery, recover

__all__ = ["verify", "checked", "recover", "Recovery", "leftovers", "hdf5_status"]
