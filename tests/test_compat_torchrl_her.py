"""TorchRL's own HERReplayBuffer over MMReplayStorage: the batches it gives over
LazyTensorStorage, the same after the folder is reopened."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchrl")

from tensordict import TensorDict  # noqa: E402
from torchrl.data import HERReplayBuffer, LazyTensorStorage  # noqa: E402

from mmreplay.compat.torchrl import MMReplayStorage  # noqa: E402


def goal_rows(lo: int, hi: int) -> TensorDict:
    """Rows ``lo..hi-1`` of a goal env: the achieved goal is the row id; episodes of 5
    steps, each second one cut by a time limit."""
    t = torch.arange(lo, hi, dtype=torch.float32)[:, None]
    end = (torch.arange(lo, hi) + 1) % 5 == 0
    truncated = end & ((torch.arange(lo, hi) // 5) % 2 == 1)
    return TensorDict(
        {
            "observation": t.expand(-1, 3),
            "achieved_goal": t,
            "desired_goal": torch.full_like(t, -1),
            "action": torch.zeros(hi - lo, 2),
            "next": {
                "observation": (t + 1).expand(-1, 3),
                "achieved_goal": t + 1,
                "desired_goal": torch.full_like(t, -1),
                "reward": torch.full_like(t, 7.0),
                "done": end[:, None],
                "terminated": (end & ~truncated)[:, None],
                "truncated": truncated[:, None],
            },
        },
        [hi - lo],
    )


def reward_fn(td: TensorDict) -> torch.Tensor:
    return -(td["next", "achieved_goal"] != td["desired_goal"]).any(-1, keepdim=True).float()


def her(storage, strategy: str) -> HERReplayBuffer:
    return HERReplayBuffer(reward_fn, storage=storage, strategy=strategy, her_ratio=0.5, batch_size=64)


def add_rows(rb: HERReplayBuffer, lo: int, hi: int) -> None:
    """One ``add`` per row, as TorchRL's HER example writes: after an ``extend``, TorchRL
    0.14.1's HERReplayBuffer cannot sample (its cache key holds the tensor of cursors),
    over its own storages too."""
    for row in goal_rows(lo, hi):
        rb.add(row)


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
def test_her_over_the_store_gives_the_batches_it_gives_over_lazy_tensor_storage(tmp_path, strategy):
    theirs = her(LazyTensorStorage(40), strategy)
    ours = her(MMReplayStorage(tmp_path / "buf", max_size=40), strategy)
    for lo in range(0, 130, 13):  # the ring wraps three times
        add_rows(theirs, lo, lo + 13)
        add_rows(ours, lo, lo + 13)
        torch.manual_seed(lo)
        expected = theirs.sample()
        torch.manual_seed(lo)
        got = ours.sample()
        assert (expected == got).all(), lo
    relabelled = got["desired_goal"][:, 0] >= 0
    assert relabelled.sum() == 32 and (got["next", "reward"][~relabelled] == 7).all()
    ours._storage.close()


def test_a_reopened_folder_relabels_from_the_episodes_on_disk(tmp_path):
    first = her(MMReplayStorage(tmp_path / "buf", max_size=60), "future")
    add_rows(first, 0, 45)
    torch.manual_seed(0)
    before = first.sample()
    first._storage.close()
    again = her(MMReplayStorage(tmp_path / "buf"), "future")
    assert len(again) == 45
    torch.manual_seed(0)
    assert (again.sample() == before).all()
    again._storage.close()
