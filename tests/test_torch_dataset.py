"""mmreplay.compat.torch: the map-style and the sampling datasets, with DataLoader workers."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import LAYOUT_KWARGS, spread

torch = pytest.importorskip("torch")
from test_sampling import make, steps_of  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import mmreplay as mr  # noqa: E402
from mmreplay.compat.torch import SampleDataset, StoreDataset  # noqa: E402


def test_steps_and_sequences_as_tensors(tmp_path, layout):
    with make(tmp_path, 10, 3, 13, layout) as store:  # wrapped
        ds = StoreDataset(store)
        first = ds.first
        with mr.open(store.path) as reader:
            assert first == reader.first_step >= 3
        assert len(ds) == 3 * (13 - first)
        item = ds[0]
        assert isinstance(item["obs"], torch.Tensor) and item["obs"].shape == (3,)
        assert (item["step"].item(), item["env"].item()) == (first, 0)
        assert (ds[-1]["step"].item(), ds[-1]["env"].item()) == (12, 2)
        seq = StoreDataset(store, num_steps=4)
        assert len(seq) == 3 * (13 - first - 3)
        assert seq[1]["step"].tolist() == [first + 1 + i for i in range(4)]
        assert seq[1]["obs"].shape == (4, 3)
        with pytest.raises(IndexError):
            ds[len(ds)]


def test_sequences_within_episodes(tmp_path):
    ends = {(2, 0), (6, 0), (4, 1)}
    with make(tmp_path, 20, 2, 9, ends=ends) as store:
        ds = StoreDataset(store.path, num_steps=3, within_episodes=True)
        got = sorted((ds[i]["step"][0].item(), ds[i]["env"][0].item()) for i in range(len(ds)))
        # env 0: [0..2] -> 0; [3..6] -> 3, 4; [7..8] none.  env 1: [0..4] -> 0, 1, 2; [5..8] -> 5, 6
        assert got == sorted([(0, 0), (3, 0), (4, 0), (0, 1), (1, 1), (2, 1), (5, 1), (6, 1)])
        for i in range(len(ds)):
            assert not ds[i]["terminated"][:-1].any()


# the layouts in turn across the two tests with workers (which open the folder themselves)
@pytest.mark.parametrize("layout", spread(LAYOUT_KWARGS, normal=["zarr-mapped", "hdf5-gzip"]))
def test_dataloader_with_two_workers_covers_every_row_once(tmp_path, layout):
    with make(tmp_path, 64, 4, 50, layout):
        pass
    ds = StoreDataset(tmp_path / "b")
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(0))
    seen = []
    for batch in loader:
        assert batch["obs"].dtype == torch.float32 and batch["obs"].shape[1:] == (3,)
        np.testing.assert_array_equal(batch["obs"][:, 2].numpy(), (batch["step"] * 10 + batch["env"]).numpy())
        seen += (batch["step"] * 4 + batch["env"]).tolist()
    assert sorted(seen) == list(range(200))


def test_dataloader_with_two_workers_reads_sequences(tmp_path):
    with make(tmp_path, 64, 2, 40):
        pass
    loader = DataLoader(StoreDataset(tmp_path / "b", num_steps=5), batch_size=8, num_workers=2)
    batches = list(loader)
    assert sum(len(b["step"]) for b in batches) == 2 * 36
    for b in batches:
        assert b["step"].shape[1] == 5
        assert torch.all(b["step"][:, 1:] - b["step"][:, :-1] == 1)


@pytest.mark.parametrize("layout", spread(LAYOUT_KWARGS, normal=["zarr-zstd", "hdf5-mapped"]))
def test_sample_dataset_with_two_workers(tmp_path, layout):
    with make(tmp_path, 32, 2, 20, layout):
        pass
    ds = SampleDataset(tmp_path / "b", batch_size=8, num_steps=3, num_batches=7, seed=1)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(batches) == 7
    for b in batches:
        assert b["obs"].shape == (8, 3, 3)
        assert torch.all(b["step"][:, 1:] - b["step"][:, :-1] == 1)
        assert torch.all(b["obs"][..., 2] == b["step"] * 10 + b["env"])
    # the two workers draw from different streams
    first_two = {tuple(b["step"][:, 0].tolist()) for b in batches[:2]}
    assert len(first_two) == 2
    again = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert all(torch.equal(a["step"], b["step"]) for a, b in zip(batches, again))


@pytest.mark.parametrize("workers", [0, 1])
def test_unseeded_sample_dataset_draws_new_batches_each_epoch(tmp_path, workers):
    with make(tmp_path, 400, 1, 400):
        pass
    ds = SampleDataset(tmp_path / "b", batch_size=16, num_batches=2)
    # the same process iterates again: the main one, or a persistent worker
    loader = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=workers > 0)
    first, second = ([b["step"].tolist() for b in loader] for _ in range(2))
    assert first != second
    torch.manual_seed(3)
    again = [b["step"].tolist() for b in DataLoader(ds, batch_size=None)]
    torch.manual_seed(3)
    assert [b["step"].tolist() for b in DataLoader(ds, batch_size=None)] == again  # torch's seed repeats a run


def test_sample_dataset_over_a_prioritized_store_in_a_worker(tmp_path):
    with make(tmp_path, 32, 2, 20, sampler="prioritized") as store:
        store.update_priorities([19], [1], [1e6])  # nearly every draw
    ds = SampleDataset(tmp_path / "b", batch_size=8, num_batches=2, seed=0)
    for b in DataLoader(ds, batch_size=None, num_workers=1):
        assert b["obs"].shape == (8, 3)
        assert (b["step"] == 19).sum() > 4


def test_sample_dataset_picks_up_new_commits(tmp_path):
    with make(tmp_path, 100, 1, 4) as writer:
        it = iter(SampleDataset(writer.path, batch_size=64, seed=0))
        assert int(next(it)["step"].max()) == 3
        writer.extend(steps_of(4, 50, 1))
        writer.commit()
        assert int(next(it)["step"].max()) > 3


def test_dataset_needs_data(tmp_path):
    with make(tmp_path, 10, 1, 0) as store:
        assert len(StoreDataset(store)) == 0
        with pytest.raises(mr.NotEnoughDataError, match="empty"):
            next(iter(SampleDataset(store, batch_size=2)))
    with pytest.raises(ValueError, match="num_steps"):
        StoreDataset(tmp_path / "b", num_steps=0)



@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_send_back_the_items_of_a_namedtuple_spec(tmp_path, context):
    # the namedtuple class is rebuilt from the folder's JSON, so no module holds it: its
    # values still pickle, or a worker's batch never reaches the main process
    import collections

    Step = collections.namedtuple("Step", ["obs", "act"])
    with mr.create(tmp_path / "b", Step(mr.ArraySpec((2,), "float32"), (mr.ArraySpec((), "int64"),)), 20) as w:
        w.extend(Step(np.arange(24, dtype=np.float32).reshape(12, 1, 2), (np.arange(12).reshape(12, 1),)))
    for ds, kwargs in [(StoreDataset(tmp_path / "b", num_steps=2), {"batch_size": 4}),
                       (SampleDataset(tmp_path / "b", 4, num_batches=2, seed=0), {"batch_size": None})]:  # fmt: skip
        batches = list(DataLoader(ds, num_workers=2, multiprocessing_context=context, timeout=60, **kwargs))
        assert len(batches) == (3 if kwargs["batch_size"] else 2)
        for b in batches:
            assert type(b).__name__ == "Step" and b._fields == ("obs", "act")
            np.testing.assert_array_equal(b.obs[..., 0].numpy(), 2 * b.act[0].numpy())


def test_a_step_overwritten_since_the_dataset_was_made_says_to_make_it_again(tmp_path):
    with make(tmp_path, 10, 2, 10) as writer:
        ds = StoreDataset(writer.path)
        first = ds.first
        writer.extend(steps_of(10, 3, 2))
        writer.commit()
        with mr.open(writer.path) as reader:
            oldest = reader.first_step
        for index in (0, len(ds) // 2):  # env 0's and env 1's first step
            with pytest.raises(mr.OverwrittenError, match=f"step {first} of this StoreDataset.*make the dataset again"):
                ds[index]
        assert ds[oldest - first]["step"].item() == oldest  # steps still kept read as before


def test_workers_find_a_relative_path_after_the_working_directory_changed(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path)
    with make(tmp_path, 20, 1, 6):
        pass
    datasets = [StoreDataset("b"), SampleDataset("b", batch_size=4, num_batches=1, seed=0)]
    monkeypatch.chdir(tmp_path / "run")  # as a launcher moves into a run folder
    steps, samples = (list(DataLoader(ds, batch_size=bs, num_workers=1)) for ds, bs in zip(datasets, [6, None]))
    assert steps[0]["step"].tolist() == list(range(6))
    assert samples[0]["step"].shape == (4,) and torch.all(samples[0]["obs"][:, 2] == samples[0]["step"] * 10)


def test_workers_reach_an_object_store_with_the_storage_options_it_was_opened_with(
    tmp_path, s3_server, monkeypatch
):
    """The datasets reopened an s3:// store by its URL alone: in the DataLoader's workers
    (and in the dataset itself) the storage_options it was opened with were lost. (Workers
    are spawned: object storage is not reachable from a fork of a process that used it.)"""
    import socket
    import uuid

    with make(tmp_path, 64, 4, 50):
        pass
    url = f"s3://replays/{uuid.uuid4().hex[:12]}/b"
    mr.push(str(tmp_path / "b"), url)
    with socket.socket() as s:  # the environment's endpoint refuses: only the options reach the store
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
    with mr.open(url, storage_options={"endpoint": s3_server, "timeout": 20}) as store:
        ds = StoreDataset(store)
        loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2, multiprocessing_context="spawn")
        seen = [s for batch in loader for s in (batch["step"] * 4 + batch["env"]).tolist()]
        assert sorted(seen) == list(range(200))
        sampled = DataLoader(
            SampleDataset(store, 8, num_batches=4, seed=0), batch_size=None, num_workers=2, multiprocessing_context="spawn"
        )
        batches = list(sampled)
        assert len(batches) == 4
        for batch in batches:
            np.testing.assert_array_equal(batch["obs"][:, 2].numpy(), (batch["step"] * 10 + batch["env"]).numpy())


def test_forked_workers_of_an_object_store_say_to_spawn_them_instead_of_waiting_forever(tmp_path, s3_server):
    """obstore's runtime does not survive a fork: a forked DataLoader worker (Linux's
    default) waited forever for its first request to an s3:// store."""
    import uuid

    with make(tmp_path, 64, 4, 50):
        pass
    url = f"s3://replays/{uuid.uuid4().hex[:12]}/b"
    mr.push(str(tmp_path / "b"), url)
    loader = DataLoader(StoreDataset(url), batch_size=16, num_workers=1, multiprocessing_context="fork", timeout=120)
    with pytest.raises(mr.RemoteError, match="forked.*spawn"):
        next(iter(loader))
