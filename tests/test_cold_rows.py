"""Random rows whose pages are out of memory: each batch prefetches its pages when the
process read from the disk since the previous one (``advice.DiskReads``), and the rows
it returns are those of a store that never prefetches."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

import mmreplay as mr
from mmreplay import read
from mmreplay.read import advice, gather

NUM_ENVS = 4
STEPS = 64
SPEC = {
    "frame": mr.ArraySpec((3, 4096), "uint8"),  # 12 KiB a row: three pages
    "step": mr.ArraySpec((), "int64"),
}


def frames_of(steps: np.ndarray) -> np.ndarray:
    """Row contents that differ on every page: what a misplaced page would show."""
    return (steps[..., None, None] * 7 + np.arange(3)[:, None] * 13 + np.arange(4096) % 251).astype(np.uint8)


@pytest.fixture(params=["zarr", "hdf5"])
def store_path(request, tmp_path):
    path = tmp_path / "b"
    steps = np.arange(STEPS)[:, None] + np.zeros((1, NUM_ENVS), np.int64)
    with mr.create(path, SPEC, STEPS, num_envs=NUM_ENVS, backend=request.param) as store:
        store.extend({"frame": frames_of(steps), "step": steps})
    return path


def data_files(path) -> list[str]:
    return [
        os.path.join(d, f)
        for d, _, fs in os.walk(path)
        for f in fs
        if f not in ("mmreplay.json", "mmreplay.state")
    ]


def drop_pages(store) -> None:
    """Out of memory: the store's pages unmapped (``MADV_DONTNEED``) and dropped from the
    page cache (``POSIX_FADV_DONTNEED`` on each data file, written back first)."""
    for leaf in store._leaves:
        if leaf.mappable:
            leaf.mm.madvise(mmap.MADV_DONTNEED)
    for f in data_files(store.path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (the store was just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_steps(store, n: int) -> None:
    """Read the first ``n`` steps of every env (their pages then cached and mapped)."""
    read.read_rows(store, np.arange(n)[:, None], np.arange(NUM_ENVS)[None])


def reads_from_disk(store) -> bool:
    """Whether dropping the pages makes reading them read the disk here (not on tmpfs)."""
    drop_pages(store)
    before = advice.disk_bytes_read()
    read_steps(store, 4)
    return advice.disk_bytes_read() > before


def check(batch: dict, info) -> None:
    np.testing.assert_array_equal(batch["step"], info.step)
    np.testing.assert_array_equal(batch["frame"], frames_of(info.step))


def test_cold_batches_return_the_rows_of_a_store_that_never_prefetches(store_path):
    with mr.open(store_path, "r", populate=False) as plain, mr.open(store_path, "r", populate=False) as store:
        read.set_prefetch(plain, False)
        for i in range(6):
            drop_pages(plain)
            drop_pages(store)
            want, info = plain.sample(32, rng=i, return_info=True)
            check(want, info)
            got = store.sample(32, rng=i)
            for key in SPEC:
                np.testing.assert_array_equal(got[key], want[key])
        shuffled = list(store.iterate(batch_size=16, shuffle=True, rng=5, return_steps=True))
        assert sorted(int(s) for _, steps, _ in shuffled for s in steps) == sorted(
            int(s) for s in np.repeat(np.arange(STEPS), NUM_ENVS)
        )
        for batch, steps, _ in shuffled:
            np.testing.assert_array_equal(batch["frame"], frames_of(steps))
        assert gather.reader_for(plain).disk_reads is None  # set_prefetch(False): never
        assert gather.reader_for(store).disk_reads.prefetched >= 1


def test_a_batch_prefetches_after_disk_reads_and_not_on_cached_pages(store_path):
    with mr.open(store_path, "r", populate=False) as store:
        reader = gather.reader_for(store)
        decide = reader.disk_reads
        store.sample(32, rng=0)
        assert decide.prefetched == 1  # the first batch: nothing known yet
        read_steps(store, STEPS)  # every page cached and mapped
        before = decide.prefetched
        for i in range(3 * advice.WARM_CHECK):
            store.sample(32, rng=i)
        assert decide.prefetched == before
        if not reads_from_disk(store):
            pytest.skip("this file system keeps its pages in memory (tmpfs): nothing to read from disk")
        # Pages dropped while batches run: a batch that faults from the disk sends the
        # next checked batches to the prefetch, which stays on while they read the disk.
        for i in range(2 * advice.WARM_CHECK):
            drop_pages(store)
            batch, info = store.sample(32, rng=100 + i, return_info=True)
            check(batch, info)
        assert decide.prefetched >= before + advice.WARM_CHECK
        # Cached again: the checks go back to one in WARM_CHECK batches, none prefetching.
        read_steps(store, STEPS)
        store.sample(32, rng=0)  # reads nothing; the reads since the last check may still count
        settled = decide.prefetched
        for i in range(3 * advice.WARM_CHECK):
            store.sample(32, rng=i)
        assert decide.prefetched == settled


def test_the_decision_reads_the_process_disk_reads(tmp_path):
    decide = advice.DiskReads(1)
    assert decide.cold(1)  # the first batch
    assert not decide.cold(1)  # nothing read since
    for _ in range(advice.WARM_CHECK - 1):
        assert not decide.cold(1)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = advice.disk_bytes_read()
        os.pread(fd, 1 << 20, 0)
        if advice.disk_bytes_read() == before:
            pytest.skip("this file system keeps its pages in memory (tmpfs): nothing to read from disk")
    finally:
        os.close(fd)
    assert decide.cold(1) and decide.prefetched == 2


def test_set_prefetch_chooses_between_always_never_and_per_batch(store_path):
    with mr.open(store_path, "r", populate=False) as store:
        reader = gather.reader_for(store)
        assert reader.disk_reads is not None and not reader.prefetch  # fits in memory: per batch
        read.set_prefetch(store, True)
        assert reader.prefetch and reader.disk_reads is None
        read.set_prefetch(store, False)
        assert not reader.prefetch and reader.disk_reads is None
        read.set_prefetch(store, None)
        assert not reader.prefetch and reader.disk_reads.prefetched == 0
        store.sample(8, num_steps=4, rng=0)  # sequences keep the readahead: no decision
        assert reader.disk_reads.prefetched == 0
        store.sample(8, rng=0)
        assert reader.disk_reads.prefetched == 1
