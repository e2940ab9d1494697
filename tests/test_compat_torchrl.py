"""TorchRL storage over a store, against real TorchRL: its own writers, samplers and
storage tests (rewritten against the public interface), resume after SIGKILL, and
SliceSampler batches equal to those of TorchRL's LazyMemmapStorage."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrl")

from tensordict import TensorDict  # noqa: E402
from torchrl.data import (  # noqa: E402
    LazyMemmapStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    SliceSampler,
    TensorDictReplayBuffer,
)

import mmreplay as mr  # noqa: E402
from mmreplay.compat.torchrl import MMReplayStorage, StoreSampler  # noqa: E402


def steps(lo: int, hi: int) -> TensorDict:
    """Rows ``lo..hi-1``: ``a`` holds the row id, ``("b", "c")`` its negative, ``obs`` a vector."""
    t = torch.arange(lo, hi)
    return TensorDict({"a": t, ("b", "c"): -t, "obs": t[:, None].float().expand(-1, 3)}, [hi - lo])


# --- TorchRL's storage tests, on the public interface -------------------------------


def test_set_get_len_and_the_spec_from_the_first_tensordict(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=10)
    assert len(storage) == 0
    storage.set(range(4), steps(0, 4))
    assert len(storage) == 4
    assert storage.get(2)["a"].item() == 2
    assert storage.get([3, 1])["b", "c"].tolist() == [-3, -1]
    assert storage[:]["obs"].shape == (4, 3)
    with mr.open(tmp_path / "b") as store:  # a reader sees the spec made from the data
        assert store.leaf_paths == ["a", "b/c", "obs"]
        assert store.capacity == 10 and store.num_envs == 1


def test_storage_inplace_writing(tmp_path):
    rb = ReplayBuffer(storage=MMReplayStorage(tmp_path / "b", max_size=102))
    rb.extend(steps(0, 100))
    assert len(rb) == 100
    rb[3:4] = TensorDict(
        {"a": torch.tensor([0]), ("b", "c"): torch.tensor([0]), "obs": torch.zeros(1, 3)}, [1]
    )
    assert (rb[3:4]["a"] == 0).all()
    assert len(rb) == 100 and rb.writer._cursor == 100
    rb[10:20] = steps(0, 10).apply(torch.zeros_like)
    assert (rb[10:20]["b", "c"] == 0).all()
    rb[torch.arange(30, 40)] = steps(0, 10).apply(torch.zeros_like)
    assert (rb[30:40]["obs"] == 0).all()
    assert len(rb) == 100 and rb.writer._cursor == 100
    assert rb[40:42]["a"].tolist() == [40, 41]  # untouched rows


def test_a_partial_overwrite_keeps_the_entries_it_does_not_name(tmp_path):
    rb = TensorDictReplayBuffer(storage=MMReplayStorage(tmp_path / "b", max_size=8))
    rb.extend(steps(0, 5))  # the buffer adds an "index" entry, stored as a leaf too
    rb[2] = TensorDict({"a": torch.tensor(7)}, [])
    row = rb.storage[2]
    assert (row["a"].item(), row["b", "c"].item(), row["index"].item()) == (7, -2, 2)


def test_extend_across_the_ring_end(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=10)
    rb = ReplayBuffer(storage=storage)
    rb.extend(steps(0, 7))
    index = rb.extend(steps(7, 14))
    assert index.tolist() == [7, 8, 9, 0, 1, 2, 3]
    assert len(rb) == 10 and rb.writer._cursor == 4
    assert storage[:]["a"].tolist() == [10, 11, 12, 13, 4, 5, 6, 7, 8, 9]
    rb.add(steps(14, 15)[0])
    assert storage[4]["a"].item() == 14
    rb.extend(steps(100, 125))  # more than a ring: the newest ten survive
    assert len(rb) == 10
    assert sorted(storage[:]["a"].tolist()) == list(range(115, 125))


def test_ndim_2_stores_steps_of_envs(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=24, ndim=2)
    rb = ReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=5)
    data = TensorDict({"x": torch.arange(12).reshape(3, 4)}, [3, 4])  # [envs, time], as collectors give
    rb.extend(data)
    assert storage.shape == (4, 3) and len(storage) == 12
    assert storage[:]["x"].tolist() == data["x"].T.tolist()
    with mr.open(tmp_path / "b") as store:
        assert (store.capacity, store.num_envs) == (8, 3)
    batch = rb.sample()
    assert batch["x"].shape == (5,)
    assert set(batch["x"].tolist()) <= set(range(12))


def test_random_sampler_batches_and_info(tmp_path):
    rb = TensorDictReplayBuffer(storage=MMReplayStorage(tmp_path / "b", max_size=50), batch_size=16)
    rb.extend(steps(0, 20))
    batch = rb.sample()
    assert batch["a"].shape == (16,) and (batch["b", "c"] == -batch["a"]).all()
    assert (batch["index"] == batch["a"]).all()


def _prioritized_sampler_or_skip() -> PrioritizedSampler:
    try:
        return PrioritizedSampler(max_capacity=50, alpha=0.7, beta=0.5)
    except RuntimeError as exc:  # its segment trees are in torchrl's C++ extension
        pytest.skip(f"torchrl's PrioritizedSampler is unusable here: {exc}")


def test_prioritized_sampler(tmp_path):
    sampler = _prioritized_sampler_or_skip()
    rb = TensorDictReplayBuffer(
        storage=MMReplayStorage(tmp_path / "b", max_size=50), sampler=sampler, batch_size=8
    )
    rb.extend(steps(0, 20))
    rb.update_priority(torch.arange(20), torch.tensor([0.0] * 19 + [10.0]))
    assert (rb.sample()["a"] == 19).all()


def test_the_stores_prioritized_sampler_draws_by_priority_and_resumes_them(tmp_path):
    path = tmp_path / "b"
    storage = MMReplayStorage(path, max_size=50, sampler="prioritized", alpha=1.0, beta=0.5)
    rb = TensorDictReplayBuffer(storage=storage, sampler=StoreSampler(), batch_size=64)
    rb.extend(steps(0, 20))
    batch, info = rb.sample(return_info=True)
    assert (
        info["priority_weight"].shape == (64,) and (info["priority_weight"] == 1).all()
    )  # new rows: max priority
    rb.update_priority(torch.arange(20), torch.tensor([0.0] * 18 + [1.0, 3.0]))
    batch, info = rb.sample(return_info=True)
    assert set(batch["a"].tolist()) == {18, 19}
    weight = dict(zip(batch["a"].tolist(), info["priority_weight"].tolist()))
    assert weight[18] / weight[19] == pytest.approx(3.0**0.5)  # (P_i / P_min) ** -beta
    storage.close()
    again = MMReplayStorage(path)  # no loads: the priorities are in the folder, committed with the rows
    rb = TensorDictReplayBuffer(storage=again, sampler=StoreSampler(beta=1.0), batch_size=64)
    batch, info = rb.sample(return_info=True)
    assert set(batch["a"].tolist()) == {18, 19}
    weight = dict(zip(batch["a"].tolist(), info["priority_weight"].tolist()))
    assert weight[18] / weight[19] == pytest.approx(3.0)


def test_store_sampler_with_envs_takes_back_slot_and_env_pairs(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=40, ndim=2, sampler="prioritized", alpha=1.0)
    rb = TensorDictReplayBuffer(storage=storage, sampler=StoreSampler(), batch_size=32)
    rb.extend(TensorDict({"x": torch.arange(20).reshape(4, 5)}, [4, 5]))  # [envs, time]
    index = rb.sample(return_info=True)[1]["index"]
    assert isinstance(index, tuple) and len(index) == 2
    rb.update_priority((torch.tensor([0, 3]), torch.tensor([0, 2])), torch.tensor([0.0, 5.0]))
    rb.update_priority(
        torch.stack([torch.arange(5).repeat(4), torch.arange(4).repeat_interleave(5)], -1), torch.zeros(20)
    )
    rb.update_priority((torch.tensor([3]), torch.tensor([2])), torch.tensor([5.0]))
    assert set(rb.sample()["x"].tolist()) == {2 * 5 + 3}  # env 2, step 3


def test_a_storage_resumes_from_its_folder_without_loads(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=10)
    rb = ReplayBuffer(storage=storage)
    rb.extend(steps(0, 13))
    storage.close()
    again = MMReplayStorage(tmp_path / "b")
    rb = ReplayBuffer(storage=again)
    assert len(rb) == 10 and rb.writer._cursor == 3 and again.max_size == 10
    assert rb.extend(steps(13, 15)).tolist() == [3, 4]
    assert again[:]["a"].tolist() == [10, 11, 12, 13, 14, 5, 6, 7, 8, 9]


def test_empty_at_slot_0_drops_every_row_and_stays_dropped(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=10)
    rb = ReplayBuffer(storage=storage)
    rb.extend(steps(0, 3))
    with pytest.raises(mr.BadInputError, match="only at slot 0"):
        rb.empty()
    assert len(rb) == 3
    rb.extend(steps(3, 10))
    rb.empty()
    assert len(rb) == 0 and rb.writer._cursor == 0 and not storage._is_full
    rb.extend(steps(10, 12))
    storage.close()
    again = MMReplayStorage(tmp_path / "b")
    rb = ReplayBuffer(storage=again)
    assert len(rb) == 2 and rb.writer._cursor == 2 and again[:]["a"].tolist() == [10, 11]


def test_a_reopen_with_another_size_or_layout_says_so(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=10)
    storage.set(range(2), steps(0, 2))
    storage.close()
    with pytest.raises(mr.BadInputError, match="max_size 10, asked for 12"):
        MMReplayStorage(tmp_path / "b", max_size=12)
    with pytest.raises(mr.BadInputError, match="no store there"):
        MMReplayStorage(tmp_path / "nothing")


def test_data_that_is_not_the_stores_changes_nothing(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=10)
    rb = ReplayBuffer(storage=storage)
    rb.extend(steps(0, 3))
    with pytest.raises(mr.BadInputError, match=r"\['extra'\] are not in the store"):
        rb.extend(steps(3, 5).set("extra", torch.zeros(2)))
    with pytest.raises(mr.BadInputError, match="'obs' is missing"):
        rb.extend(steps(3, 5).exclude("obs"))
    assert len(storage) == 3 and storage.store.total_steps == 3


def test_the_trajectory_column_is_a_view_of_the_mapped_leaf(tmp_path):
    storage = MMReplayStorage(tmp_path / "b", max_size=20)
    storage.set(range(6), steps(0, 6))
    column = storage[:]["a"]
    assert column.data_ptr() == storage[:]["a"].data_ptr()  # no copy per read
    storage.set(6, steps(6, 7)[0])
    assert column.data_ptr() == storage[:7]["a"].data_ptr()


# --- resume after SIGKILL -------------------------------------------------------------


def kill_when_ready(code: str, path) -> None:
    """Run ``code`` with ``path`` in a new process and SIGKILL it once it prints "ready"."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL


WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer
    from mmreplay.compat.torchrl import MMReplayStorage
    storage = MMReplayStorage(sys.argv[1], max_size=16, commit_every=10_000)
    rb = TensorDictReplayBuffer(storage=storage)
    def rows(lo, hi):
        t = torch.arange(lo, hi)
        return TensorDict({"a": t, ("b", "c"): -t}, [hi - lo])
    rb.extend(rows(0, 20))
    storage.commit()
    rb.extend(rows(20, 23))  # never committed
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_a_replay_buffer_resumes_after_sigkill(tmp_path):
    path = tmp_path / "b"
    kill_when_ready(WRITER, path)
    storage = MMReplayStorage(path, max_size=16)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=64)
    # Steps 0..19 were committed; the ring kept the newest 16, minus those whose slots the
    # killed writer had taken for rows 20..22 (not committed): the store names the oldest.
    first = storage.store.first_step
    assert 4 < first < 20 and storage.store.total_steps == 20
    assert len(rb) == 20 - first and rb.writer._cursor == 20 % 16
    assert [storage[s % 16]["a"].item() for s in range(first, 20)] == list(range(first, 20))
    assert [storage[s % 16]["index"].item() for s in range(first, 20)] == [s % 16 for s in range(first, 20)]
    batch = rb.sample()
    assert set(batch["a"].tolist()) == set(range(first, 20)) and (batch["b", "c"] == -batch["a"]).all()
    with pytest.raises(IndexError, match="slot 4 holds no committed row"):
        rb[4] = TensorDict({"a": torch.tensor(-1)}, [])  # slot 4's step 4 was given up
    assert storage.store.total_steps == 20 and -1 not in storage[:]["a"].tolist()
    assert rb.extend(
        TensorDict({"a": torch.tensor([20]), ("b", "c"): torch.tensor([-20])}, [1])
    ).tolist() == [4]
    assert len(rb) == 20 + 1 - first


PRIORITIZED_WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from tensordict import TensorDict
    from torchrl.data import TensorDictReplayBuffer
    from mmreplay.compat.torchrl import MMReplayStorage, StoreSampler
    storage = MMReplayStorage(sys.argv[1], max_size=32, sampler="prioritized", alpha=1.0, commit_every=10_000)
    rb = TensorDictReplayBuffer(storage=storage, sampler=StoreSampler())
    rb.extend(TensorDict({"a": torch.arange(20)}, [20]))
    storage.commit()
    rb.update_priority(torch.arange(20), (torch.arange(20) % 5 == 0).float())
    print("ready", flush=True)
    time.sleep(60)
    """
)


def test_priorities_survive_sigkill(tmp_path):
    path = tmp_path / "b"
    kill_when_ready(PRIORITIZED_WRITER, path)
    rb = TensorDictReplayBuffer(storage=MMReplayStorage(path), sampler=StoreSampler(), batch_size=256)
    assert len(rb) == 20
    assert set(rb.sample()["a"].tolist()) == {0, 5, 10, 15}


# --- SliceSampler: the same batches as over LazyMemmapStorage -------------------------


def episodes(num_envs: int, T: int) -> TensorDict:
    """``[num_envs, T]`` steps; env e's episodes are 5 + e steps long, ids unique per env."""
    t = torch.arange(T)
    episode = torch.stack([e * 1000 + t // (5 + e) for e in range(num_envs)])
    done = torch.stack([(t % (5 + e)) == (4 + e) for e in range(num_envs)])
    obs = torch.stack([t * 10 + e for e in range(num_envs)]).float()
    return TensorDict({"obs": obs, "episode": episode, ("next", "done"): done[..., None]}, [num_envs, T])


@pytest.mark.parametrize("ndim", [1, 2])
def test_slice_sampler_batches_equal_lazy_memmap_storage(tmp_path, ndim):
    num_envs = 3 if ndim == 2 else 1
    data = episodes(num_envs, 30)
    if ndim == 1:
        data = data[0]
    size = 48 if ndim == 2 else 24  # 16 or 24 steps: the 30 written wrap the ring
    buffers = []
    for storage in (
        MMReplayStorage(tmp_path / "b", max_size=size, ndim=ndim),
        LazyMemmapStorage(size, ndim=ndim),
    ):
        sampler = SliceSampler(slice_len=4, traj_key="episode", strict_length=True)
        rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=12)
        rb.extend(data[..., :20])
        rb.extend(data[..., 20:])  # wraps the ring
        buffers.append(rb)
    ours, theirs = buffers
    for seed in range(3):
        torch.manual_seed(seed)
        a = ours.sample()
        torch.manual_seed(seed)
        b = theirs.sample()
        for key in ("obs", "episode", ("next", "done"), "index"):
            assert torch.equal(a[key], b[key]), key
    assert (a["episode"].view(-1, 4) == a["episode"].view(-1, 4)[:, :1]).all()  # slices stay in one episode


# --- the benchmark runs ---------------------------------------------------------------


def test_the_torchrl_benchmark_runs_at_its_small_size():
    root = __file__.rsplit("/tests/", 1)[0]
    proc = subprocess.run(
        [sys.executable, "bench/bench_torchrl.py", "--quick"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    sections = proc.stdout.strip().split("\n\n")
    assert len(sections) == 3
    for section in sections:
        title, *lines = section.splitlines()
        assert [line.split()[0] for line in lines] == ["MMReplayStorage", "LazyMemmapStorage"], section
        assert all(float(line.split()[1]) > 0 for line in lines), section
