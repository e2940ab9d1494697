"""skrl / rofunc layer: Memory and RandomMemory against the originals' behaviour, on real torch.

The numbered comments refer to the conformance checks of the reference semantics;
"adapted" marks where mmreplay keeps the intended behaviour instead of a bug.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gymnasium = pytest.importorskip("gymnasium")

from conftest import folder_digest  # noqa: E402

import mmreplay as mr  # noqa: E402
from mmreplay.compat.skrl import Memory, MemoryEmptyError, RandomMemory  # noqa: E402


def memory(tmp_path, M, E=1, name="m", cls=RandomMemory, **kw):
    if cls is RandomMemory:
        kw.setdefault("replacement", True)  # the default follows the installed skrl (test_skrl_differential)
    return cls(M, E, device="cpu", path=tmp_path / name, **kw)


def col(t: torch.Tensor) -> list:
    return t.reshape(-1).tolist()


def add_steps(m, n, start=0, name="x"):
    """Add ``n`` steps of all envs; env e of step t holds ``t + 100 * e``."""
    E = m.num_envs
    for t in range(start, start + n):
        m.add_samples(**{name: (t + 100 * torch.arange(E, dtype=torch.float32)).view(E, 1)})


# --- cursor arithmetic ----------------------------------------------------------------


def test_single_env_adds_wrap_and_sample_all_is_physical(tmp_path):  # 27
    with memory(tmp_path, 5) as m:
        m.create_tensor("x", 1)
        for t in range(7):
            m.add_samples(x=torch.tensor([float(t)]))  # one env, one dimension
        assert (m.memory_index, m.env_index, m.filled, len(m)) == (2, 0, True, 5)
        [[x]] = m.sample_all(["x"])
        assert col(x) == [5, 6, 2, 3, 4]


def test_partial_env_adds(tmp_path):  # 28
    with memory(tmp_path, 3, 4) as m:
        m.create_tensor("x", 1)
        m.add_samples(x=torch.zeros(4, 1))
        assert (m.memory_index, m.env_index) == (1, 0)
        m.add_samples(x=torch.ones(2, 1))
        assert (m.memory_index, m.env_index, len(m)) == (1, 2, 6)
        m.add_samples(x=torch.full((2, 1), 2.0))
        assert (m.memory_index, m.env_index, len(m)) == (2, 0, 8)
        assert m.get_tensor_by_name("x")[1].reshape(-1).tolist() == [1, 1, 2, 2]
        m.add_samples(x=torch.tensor([7.0]))  # one env of the next step
        m.add_samples(x=torch.tensor([[8.0], [9.0]]))
        assert (m.memory_index, m.env_index, len(m)) == (2, 3, 11)
        with pytest.raises(RuntimeError, match="overflow"):
            m.add_samples(x=torch.zeros(2, 1))
        with pytest.raises(RuntimeError, match="staged"):
            m.add_samples(x=torch.zeros(4, 1))
        assert (m.memory_index, m.env_index, len(m)) == (2, 3, 11)  # refused adds changed nothing
        assert col(m.get_tensor_by_name("x")[2])[:3] == [7, 8, 9]
        with pytest.raises(ValueError, match="Expected shape"):
            m.add_samples(x=torch.zeros(5, 1))
        with pytest.raises(ValueError, match="No samples"):
            m.add_samples()


def test_a_partial_step_is_written_ahead_and_drawn_through_the_store(tmp_path):
    with memory(tmp_path, 4, 3) as m:
        m.create_tensor("x", 1)
        add_steps(m, 2)
        m.add_samples(x=torch.tensor([[50.0], [51.0]]))  # envs 0 and 1 of step 2
        assert m.store.total_steps == 2 and m.store.read_steps([2])[0][0, :2, 0].tolist() == [50.0, 51.0]
        torch.manual_seed(3)
        [[x]] = m.sample(["x"], 64)
        info = m.sampling_info  # the store's fetch path drew the batch
        ahead = info.step == 2
        assert ahead.any() and set(info.env[ahead].tolist()) <= {0, 1}
        assert set(x[torch.from_numpy(ahead)].flatten().tolist()) <= {50.0, 51.0}
        torch.manual_seed(3)
        assert torch.equal(m.get_sampling_indexes(), torch.randint(0, 8, (64,)))  # skrl's draw
        m.add_samples(x=torch.tensor([52.0]))  # the last env: the step is added
        assert (m.store.total_steps, m.memory_index, m.env_index) == (3, 3, 0)
        assert col(m.get_tensor_by_name("x")[2]) == [50, 51, 52]


def test_a_cursor_set_as_in_skrl_keeps_the_rows_and_survives_a_reopen(tmp_path):
    with memory(tmp_path, 4, 2) as m:
        m.create_tensor("x", 1)
        add_steps(m, 3)  # rows 0..2 hold steps 0..2
        m.filled = True  # row 3 (never written) counts; the next step goes to row 3
        m.memory_index = 1  # the next step goes to row 1: rows 1, 2, 3, 0 are oldest to newest
        m.env_index = 1  # env 0 of row 1 counts as added
        assert (m.memory_index, m.env_index, m.filled, len(m)) == (1, 1, True, 8)
        assert col(m.tensors["x"])[:6] == [0, 100, 1, 101, 2, 102]
        m.add_samples(x=torch.tensor([7.0]))  # env 1 completes row 1
        assert (m.memory_index, m.env_index) == (2, 0) and col(m.tensors_view["x"])[2:4] == [1, 7]
    with memory(tmp_path, 4, 2) as m:
        assert (m.memory_index, m.env_index, m.filled) == (2, 0, True)
        assert col(m.get_tensor_by_name("x"))[:4] == [0, 100, 1, 7]
        m.filled = False  # rows from memory_index on read unwritten
        assert len(m) == 4 and torch.isnan(m.get_tensor_by_name("x")[2:]).all()
        with pytest.raises(ValueError, match="env_index"):
            m.env_index = 2


def test_multi_row_add_for_one_env_wraps_and_fills(tmp_path):  # 29, adapted
    with memory(tmp_path, 5) as m:
        m.create_tensor("x", 1)
        m.add_samples(x=torch.tensor([[10.0], [11.0], [12.0]]))
        assert m.memory_index == 3
        m.add_samples(x=torch.tensor([[13.0], [14.0], [15.0], [16.0]]))
        assert (m.memory_index, m.filled, len(m)) == (2, True, 5)
        assert col(m.get_tensor_by_name("x")) == [15, 16, 12, 13, 14]
        m.add_samples(x=torch.arange(100.0, 112.0).view(12, 1))  # more than the memory holds
        assert (m.memory_index, len(m)) == (4, 5)
        assert col(m.get_tensor_by_name("x")) == [108, 109, 110, 111, 107]


def test_multi_row_add_writes_every_tensor_to_the_same_rows(tmp_path):  # 30, adapted
    with memory(tmp_path, 10) as m:
        m.create_tensor("x", 1)
        m.create_tensor("y", 1)
        m.add_samples(x=torch.tensor([[1.0], [2.0], [3.0]]), y=torch.tensor([[4.0], [5.0], [6.0]]))
        assert m.memory_index == 3
        x, y = col(m.get_tensor_by_name("x")), col(m.get_tensor_by_name("y"))
        assert x[:3] == [1, 2, 3] and y[:3] == [4, 5, 6]
        assert np.isnan(x[3:]).all() and np.isnan(y[3:]).all()


def test_unknown_and_none_values_are_skipped_missing_tensors_read_unwritten(tmp_path):
    with memory(tmp_path, 4, 2) as m:
        m.create_tensor("x", 1)
        m.create_tensor("n", 1, dtype=torch.int64)
        m.add_samples(x=torch.ones(2, 1), n=torch.tensor([[3], [4]]), other=torch.zeros(2, 7), y=None)
        m.add_samples(x=torch.ones(2, 1))
        assert len(m) == 4
        n = m.get_tensor_by_name("n")
        assert n.dtype == torch.int64 and n[:, :, 0].tolist() == [[3, 4], [0, 0], [0, 0], [0, 0]]
        assert torch.isnan(m.get_tensor_by_name("x")[2:]).all()
        m.add_samples(x=torch.ones(2, 1), n=torch.tensor([[2.9], [-1.9]]))  # truncated, as skrl's copy_ does
        assert m.get_tensor_by_name("n")[2, :, 0].tolist() == [2, -1]
        for bad in (float("nan"), float("inf"), 2.0**70):  # no defined integer: refused
            with pytest.raises(ValueError, match="'n'.*cannot be stored in a int64 tensor"):
                m.add_samples(x=torch.ones(2, 1), n=torch.full((2, 1), bad))
        assert len(m) == 6


# --- create_tensor --------------------------------------------------------------------


def test_create_tensor_sizes_from_ints_sequences_and_spaces(tmp_path):  # 33
    spaces = gymnasium.spaces
    with memory(tmp_path, 2) as m:
        assert m.create_tensor("a", 3) and m.create_tensor("b", (2, 3)) and m.create_tensor("c", [4])
        assert m.create_tensor("box", spaces.Box(-1, 1, (2, 3)))
        assert m.create_tensor("disc", spaces.Discrete(5))
        assert m.create_tensor("dict", spaces.Dict({"p": spaces.Box(-1, 1, (2,)), "q": spaces.Discrete(3)}))
        assert m.create_tensor("md", spaces.MultiDiscrete([3, 4]))
        assert m.create_tensor("tup", spaces.Tuple((spaces.Discrete(2), spaces.Box(0, 1, (3,)))))
        assert m.create_tensor("kept", spaces.Box(-1, 1, (2, 3)), keep_dimensions=True)
        shapes = {n: tuple(m.get_tensor_by_name(n).shape[2:]) for n in m.get_tensor_names()}
        assert shapes == {
            "a": (3,), "b": (6,), "c": (4,), "box": (6,), "disc": (1,), "dict": (3,),
            "md": (2,), "tup": (4,), "kept": (2, 3),
        }  # fmt: skip
        assert m.get_tensor_names() == sorted(shapes)
        with pytest.raises(ValueError, match="keep_dimensions"):
            m.create_tensor("d2", spaces.Dict({"p": spaces.Discrete(2)}), keep_dimensions=True)


def test_create_tensor_existing_names(tmp_path):  # 32
    with memory(tmp_path, 2) as m:
        assert m.create_tensor("x", 3, dtype=torch.float32) is True
        assert m.create_tensor("x", 3) is False
        assert m.create_tensor("x", 3, dtype=torch.float32) is False
        assert m.create_tensor("y", None) is False and "y" not in m.get_tensor_names()
        with pytest.raises(ValueError, match="Size"):
            m.create_tensor("x", 4)
        with pytest.raises(ValueError, match="Dtype"):
            m.create_tensor("x", 3, dtype=torch.int32)


def test_create_tensor_after_data_keeps_data_and_cursor(tmp_path):  # 31, adapted
    with memory(tmp_path, 4, 2) as m:
        m.create_tensor("x", 1)
        add_steps(m, 6)  # wrapped: memory_index 2
        m.add_samples(x=torch.tensor([[50.0]]))  # a staged env
        before = m.get_tensor_by_name("x").clone()
        assert m.create_tensor("y", 2, dtype=torch.int16) is True
        assert (m.memory_index, m.env_index, m.filled, len(m)) == (2, 1, True, 8)
        assert torch.equal(m.get_tensor_by_name("x"), before)
        y = m.get_tensor_by_name("y")
        assert y.dtype == torch.int16 and not y.any()
        assert m.store.leaf_paths == ["x", "y"]
        m.add_samples(x=torch.tensor([[51.0]]), y=torch.tensor([[1, 2]], dtype=torch.int16))
        assert m.memory_index == 3 and m.get_tensor_by_name("y")[2, 1].tolist() == [1, 2]
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no folder left aside
    with memory(tmp_path, 4, 2) as m:
        assert m.get_tensor_names() == ["x", "y"] and (m.memory_index, m.filled) == (3, True)
        assert col(m.get_tensor_by_name("x")) == [4, 104, 5, 105, 50, 51, 3, 103]


def test_an_interrupted_tensor_migration_is_finished_on_reopen(tmp_path):
    """Set up the folders a crash between the two renames of a migration leaves."""
    import shutil

    with memory(tmp_path, 4) as m:
        m.create_tensor("x", 1)
        add_steps(m, 3)
    shutil.copytree(tmp_path / "m", tmp_path / ".m.replaced")
    with memory(tmp_path, 4, name="new") as m:
        m.create_tensor("x", 1)
        m.create_tensor("y", 1)
        add_steps(m, 2, start=20)
    shutil.rmtree(tmp_path / "m")
    os.rename(tmp_path / "new", tmp_path / ".m.migrating")
    with memory(tmp_path, 4) as m:  # the complete new memory wins
        assert m.get_tensor_names() == ["x", "y"] and col(m.get_tensor_by_name("x"))[:2] == [20, 21]
    assert sorted(os.listdir(tmp_path)) == ["m"]
    # a crash while the copy was being built: the old memory stays, the copy goes
    shutil.copytree(tmp_path / "m", tmp_path / ".m.migrating")
    with memory(tmp_path, 4) as m:
        assert len(m) == 2
    assert sorted(os.listdir(tmp_path)) == ["m"]
    # killed earlier, while the copy was under its scratch name: a whole memory's size of disk
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    shutil.copytree(tmp_path / "m", tmp_path / f"..m.migrating.partial-{int(dead.stdout)}")
    shutil.copytree(tmp_path / "m", tmp_path / f".m.partial-{int(dead.stdout)}")  # a load's import
    with memory(tmp_path, 4) as m:
        assert len(m) == 2
    assert sorted(os.listdir(tmp_path)) == ["m"]


# --- sampling -------------------------------------------------------------------------


def test_sampling_draws_the_original_indexes_before_a_wrap(tmp_path):
    with memory(tmp_path, 10, 3) as m:
        m.create_tensor("x", 1)
        add_steps(m, 4)
        m.add_samples(x=torch.tensor([[9.0]]))
        torch.manual_seed(7)
        m.sample(["x"], 16)
        torch.manual_seed(7)
        assert torch.equal(m.get_sampling_indexes(), torch.randint(0, len(m), (16,)))
        torch.manual_seed(7)
        m.sample(["x"], 16, sequence_length=3)
        torch.manual_seed(7)
        starts = torch.randint(0, len(m) - 2 * 3, (16,))
        assert torch.equal(m.get_sampling_indexes(), (starts.view(-1, 1) + torch.tensor([0, 3, 6])).view(-1))


def test_sequences_are_one_envs_consecutive_steps(tmp_path):  # 34
    with memory(tmp_path, 10, 3) as m:
        assert m.sample_by_index(["x"], [0])[0] == [None] and m.get_sampling_indexes() is None
        m.create_tensor("x", 1)
        add_steps(m, 6)
        [[x]] = m.sample(["x"], 8, sequence_length=3)
        idx = m.get_sampling_indexes().view(8, 3)
        assert x.shape == (24, 1)
        assert ((idx[:, 1:] - idx[:, :-1]) == 3).all()
        x = x.view(8, 3)
        assert ((x[:, 1:] - x[:, :-1]) == 1).all()


def test_sequences_after_a_wrap_never_join_newest_and_oldest(tmp_path):  # adapted
    with memory(tmp_path, 5, 2) as m:
        m.create_tensor("x", 1)
        add_steps(m, 7)
        m.add_samples(x=torch.tensor([[7.0]]))  # env 0 is one step ahead
        for _ in range(20):
            [[x]] = m.sample(["x"], 32, sequence_length=3)
            x = x.view(32, 3)
            assert ((x[:, 1:] - x[:, :-1]) == 1).all()  # consecutive in time, same env
            env = (x[:, 0] >= 100).long()
            t = x[:, 0] - 100 * env
            assert ((env == 0) & (t >= 3) | (env == 1) & (t >= 2)).all()  # from each env's oldest row


def test_sampling_without_replacement_and_empty(tmp_path):  # 35
    with memory(tmp_path, 3, 2, replacement=False) as m:
        m.create_tensor("x", 1)
        add_steps(m, 3)
        [[x]] = m.sample(["x"], 10)
        assert x.shape == (6, 1) and len(set(col(x))) == 6
    with memory(tmp_path, 3, 2, name="empty") as m:
        m.create_tensor("x", 1)
        with pytest.raises(RuntimeError, match="holds 0 rows"):
            m.sample(["x"], 4)
        add_steps(m, 1)
        with pytest.raises(MemoryEmptyError):
            m.sample(["x"], 4, sequence_length=2)
        assert isinstance(MemoryEmptyError("x"), mr.NotEnoughDataError)


def test_sampling_is_uniform_over_rows(tmp_path):
    with memory(tmp_path, 4, 2) as m:
        m.create_tensor("x", 1)
        add_steps(m, 6)
        torch.manual_seed(0)
        [[x]] = m.sample(["x"], 8000)
        _, counts = np.unique(col(x), return_counts=True)
        assert len(counts) == 8
        chi2 = ((counts - 1000) ** 2 / 1000).sum()
        assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001


def test_mini_batches_drop_nothing(tmp_path):  # 36, 37 adapted
    with memory(tmp_path, 4, 3) as m:
        m.create_tensor("x", 1)
        add_steps(m, 4)
        batches = m.sample_by_index(["x", "missing"], np.array([0, 1, 2, 3, 4]), mini_batches=2)
        assert [len(b[0]) for b in batches] == [3, 2] and batches[0][1] is None
        batches = m.sample_all(["x"], mini_batches=5)
        assert [len(b[0]) for b in batches] == [3, 3, 2, 2, 2]
        assert torch.cat([b[0] for b in batches]).view(-1).tolist() == col(m.get_tensor_by_name("x"))
        [[seq]] = m.sample_all(["x"], sequence_length=2)
        assert col(seq) == [0, 1, 2, 3, 100, 101, 102, 103, 200, 201, 202, 203]
        with pytest.raises(IndexError):
            m.sample_by_index(["x"], [12])
        assert col(m.sample_by_index(["x"], torch.tensor([-1]))[0][0]) == [203]


def test_outputs_are_tensors_on_the_device_with_their_dtypes(tmp_path):
    with memory(tmp_path, 4, 2) as m:
        m.create_tensor("obs", (2, 2), keep_dimensions=True)
        m.create_tensor("done", 1, dtype=torch.bool)
        m.add_samples(obs=torch.ones(2, 2, 2), done=torch.tensor([[True], [False]]))
        m.add_samples(
            obs=torch.ones(2, 2, 2), done=torch.tensor([[1], [0]], dtype=torch.uint8)
        )  # 0 / 1 flags
        with pytest.raises(ValueError, match="'done'"):
            m.add_samples(obs=torch.ones(2, 2, 2), done=torch.tensor([[2], [0]]))
        assert m.get_tensor_by_name("done")[:2, :, 0].tolist() == [[True, False], [True, False]]
        obs, done = m.sample(["obs", "done"], 5)[0]
        assert obs.shape == (5, 2, 2) and obs.device == torch.device("cpu") and done.dtype == torch.bool
        assert m.get_tensor_by_name("obs", keepdim=False).shape == (8, 2, 2)
        with pytest.raises(KeyError):
            m.get_tensor_by_name("nope")


# --- set, reset, save, load, export ----------------------------------------------------


def test_set_tensor_by_name_rewrites_stored_and_staged_rows(tmp_path):
    with memory(tmp_path, 3, 2) as m:
        m.create_tensor("x", 1)
        m.create_tensor("returns", 1)
        add_steps(m, 2)
        m.add_samples(x=torch.tensor([[9.0]]))
        m.set_tensor_by_name("returns", torch.arange(6.0).view(3, 2, 1))
        r = m.get_tensor_by_name("returns")
        assert r[:2].reshape(-1).tolist() == [0, 1, 2, 3] and r[2, 0].item() == 4 and torch.isnan(r[2, 1])
        assert col(m.get_tensor_by_name("x"))[:5] == [0, 100, 1, 101, 9]  # other tensors untouched
    with memory(tmp_path, 3, 2) as m:  # durable; the staged env was not
        assert col(m.get_tensor_by_name("returns"))[:4] == [0, 1, 2, 3] and len(m) == 4


def test_reset_empties_the_memory_durably(tmp_path):
    with memory(tmp_path, 3) as m:
        m.create_tensor("x", 1)
        add_steps(m, 4)
        m.reset()
        assert (m.memory_index, m.env_index, m.filled, len(m)) == (0, 0, False, 0)
        add_steps(m, 1, start=50)
        assert col(m.get_tensor_by_name("x"))[0] == 50
    with memory(tmp_path, 3) as m:
        assert (m.memory_index, len(m)) == (1, 1)


def test_save_exports_the_complete_steps_oldest_first(tmp_path):  # 38, adapted: mmreplay export's layouts
    with memory(tmp_path, 3, 2) as m:
        m.create_tensor("obs", 2)
        m.create_tensor("act", 1, dtype=torch.int64)
        m.add_samples(obs=torch.ones(2, 2), act=torch.tensor([[1], [2]]))
        m.add_samples(obs=torch.full((2, 2), 2.0), act=torch.tensor([[3], [4]]))
        m.add_samples(obs=torch.tensor([5.0, 5.0]), act=torch.tensor([6]))  # staged: not saved
        pt = m.save(str(tmp_path / "out"), "pt")
        assert os.path.dirname(pt) == str(tmp_path / "out" / "memories") and pt.endswith(".pt")
        assert f"_memory_{hex(id(m))}." in os.path.basename(pt)
        data = torch.load(pt, weights_only=True)
        assert sorted(data) == ["act", "obs"] and data["obs"].shape == (2, 2, 2) and data["act"].dtype == torch.int64
        assert data["act"].flatten().tolist() == [1, 2, 3, 4]
        with np.load(m.save(str(tmp_path / "out"), "np"), allow_pickle=False) as npz:
            assert npz["act"].dtype == np.int64 and npz["obs"][:, :, 0].tolist() == [[1, 1], [2, 2]]
        lines = open(m.save(str(tmp_path / "out"), "csv")).read().splitlines()
        assert lines[0] == "step,env,act.0,obs.0,obs.1" and lines[1:] == ["0,0,1,1,1", "0,1,2,1,1", "1,0,3,2,2", "1,1,4,2,2"]
        m.add_samples(obs=torch.tensor([5.0, 5.0]), act=torch.tensor([7]))
        add_steps(m, 2, name="obs")  # wrapped: the newest 3 steps only, oldest first
        data = torch.load(m.save(str(tmp_path / "out"), "pt"), weights_only=True)
        assert data["obs"][:, :, 0].tolist() == [[5, 5], [0, 100], [1, 101]]
        with pytest.raises(ValueError, match="Unsupported format"):
            m.save(str(tmp_path / "out"), "json")


def test_load_restores_the_saved_steps(tmp_path):  # 39, adapted: mmreplay import reads the file
    with memory(tmp_path, 4, 2, name="src") as m:
        m.create_tensor("x", 1)
        m.create_tensor("k", (2, 2), dtype=torch.int32, keep_dimensions=True)
        for t in range(3):
            m.add_samples(x=torch.full((2, 1), t + 0.5), k=torch.full((2, 2, 2), t, dtype=torch.int32))
        m.add_samples(x=torch.tensor([[7.0]]), k=torch.full((1, 2, 2), 7, dtype=torch.int32))  # staged
        files = {fmt: m.save(str(tmp_path / "out"), fmt) for fmt in ("pt", "npz", "csv")}
        want_x, want_k = m.get_tensor_by_name("x"), m.get_tensor_by_name("k")
    for fmt, path in files.items():
        with memory(tmp_path, 4, 2, name=f"dst-{fmt}") as d:
            d.create_tensor("x", 1)
            d.create_tensor("other", 3)  # not in the file: reads unwritten
            add_steps(d, 5)  # replaced by the file's steps
            d.load(path)
            assert d.get_tensor_names() == ["k", "other", "x"]
            assert (d.memory_index, d.env_index, d.filled, len(d)) == (3, 0, False, 6)
            x, k = d.get_tensor_by_name("x"), d.get_tensor_by_name("k")
            assert x[:3].flatten().tolist() == want_x[:3].flatten().tolist() and torch.isnan(x[3]).all()
            assert torch.isnan(d.get_tensor_by_name("other")[:3]).all()
            if fmt == "csv":  # csv keeps no dtype or shape: integers come back int64, flat
                assert k.shape == (4, 2, 4) and k.dtype == torch.int64
                assert k[:3].tolist() == want_k[:3].reshape(3, 2, 4).tolist()
            else:
                assert k.dtype == torch.int32 and torch.equal(k[:3], want_k[:3])
            [[s]] = d.sample(["x"], 50)
            assert not torch.isnan(s).any()
        with memory(tmp_path, 4, 2, name=f"dst-{fmt}") as d:  # durable
            assert len(d) == 6 and d.get_tensor_names() == ["k", "other", "x"]
    with memory(tmp_path, 4, 3, name="wrong") as w:
        w.create_tensor("x", 1)
        with pytest.raises(ValueError, match="holds 2 envs, the memory has 3"):
            w.load(files["npz"])
        with pytest.raises(ValueError, match="Unsupported format"):
            w.load(str(tmp_path / "x.json"))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no folder left aside


def test_a_csv_load_keeps_the_declared_dtypes_and_shapes(tmp_path):
    """csv keeps no dtype: whole-number floats and flags must not turn a declared tensor int64."""
    with memory(tmp_path, 4, 2, name="src") as m:
        m.create_tensor("x", 1)
        m.create_tensor("done", 1, dtype=torch.bool)
        m.create_tensor("k", (2, 2), dtype=torch.uint8, keep_dimensions=True)
        for t in range(3):
            m.add_samples(x=torch.full((2, 1), float(t)), done=torch.full((2, 1), t == 2),
                          k=torch.full((2, 2, 2), t, dtype=torch.uint8))  # fmt: skip
        path = m.save(str(tmp_path / "out"), "csv")
        want = {n: m.get_tensor_by_name(n) for n in ("x", "done", "k")}
    with memory(tmp_path, 4, 2, name="dst") as d:
        d.create_tensor("x", 1)
        d.create_tensor("done", 1, dtype=torch.bool)
        d.create_tensor("k", (2, 2), dtype=torch.uint8, keep_dimensions=True)
        d.load(path)
        for name, value in want.items():
            got = d.get_tensor_by_name(name)
            assert (got.dtype, got.shape) == (value.dtype, value.shape), name
            assert torch.equal(got[:3], value[:3]), name
        d.add_samples(x=torch.full((2, 1), 0.5), done=torch.zeros((2, 1), dtype=torch.bool),
                      k=torch.zeros((2, 2, 2), dtype=torch.uint8))  # fmt: skip
        assert d.get_tensor_by_name("x")[3].flatten().tolist() == [0.5, 0.5]
    with memory(tmp_path, 4, 2, name="wrong") as w:
        w.create_tensor("x", 3)  # the file has 1 column of x
        with pytest.raises(ValueError, match="x"):
            w.load(path)


def test_export_when_the_memory_fills(tmp_path):  # 40
    out = tmp_path / "exports"
    with memory(tmp_path, 2, export=True, export_format="np", export_directory=str(out)) as m:
        m.create_tensor("x", 1)
        for t in range(5):
            m.add_samples(x=torch.tensor([float(t)]))
        files = sorted(os.listdir(out / "memories"))
        assert len(files) == 2 and all(f.endswith(".npz") for f in files)
        with np.load(out / "memories" / files[0], allow_pickle=False) as first:
            assert first["x"].reshape(-1).tolist() == [0, 1]
    with pytest.raises(ValueError, match="Export format not supported"):
        Memory(2, export_format="json")


# --- persistence ------------------------------------------------------------------------


def test_reopen_resumes_and_refuses_another_memory(tmp_path):
    with memory(tmp_path, 4, 2) as m:
        m.create_tensor("x", 1)
        add_steps(m, 6)
        m.add_samples(x=torch.tensor([[60.0]]))  # staged: not durable
    with memory(tmp_path, 4, 2) as m:
        assert m.create_tensor("x", 1) is False
        assert (m.memory_index, m.env_index, m.filled, len(m)) == (2, 0, True, 8)
        assert col(m.get_tensor_by_name("x")) == [4, 104, 5, 105, 2, 102, 3, 103]
    with pytest.raises(mr.SpecMismatchError, match="memory_size: existing 4 vs new 5"):
        memory(tmp_path, 5, 2)
    with pytest.raises(mr.SpecMismatchError, match="num_envs: existing 2 vs new 3"):
        memory(tmp_path, 4, 3)
    before = folder_digest(tmp_path / "m")
    with pytest.raises(mr.SpecMismatchError, match="compression: existing"):
        memory(tmp_path, 4, 2, compression="zstd")
    with pytest.raises(mr.SpecMismatchError, match="sampler: existing"):
        memory(tmp_path, 4, 2, sampler="prioritized")
    assert folder_digest(tmp_path / "m") == before


def test_without_path_the_store_is_temporary():
    m = RandomMemory(4, 2, device="cpu")
    m.create_tensor("x", 1)
    add_steps(m, 2)
    folder = os.path.dirname(m.store.path)
    assert os.path.isdir(folder)
    m.create_tensor("y", 1)  # a migration inside the temporary folder
    assert len(m) == 4
    del m
    assert not os.path.exists(folder)
    m = Memory(4)
    m.create_tensor("x", 1)
    add_steps(m, 1)
    folder = os.path.dirname(m.store.path)
    m.close()
    assert not os.path.exists(folder)
    with pytest.raises(NotImplementedError):
        Memory(2).sample(["x"], 1)


def test_ppo_style_rollouts(tmp_path):
    """Fill a rollout memory, compute returns over physical rows, train on mini-batches."""
    M, E = 8, 4
    with memory(tmp_path, M, E, cls=RandomMemory) as m:
        for name, size in (("states", 3), ("actions", 1), ("rewards", 1), ("values", 1), ("returns", 1)):
            m.create_tensor(name, size)
        m.create_tensor("terminated", 1, dtype=torch.bool)
        for _rollout in range(2):
            for _t in range(M):
                m.add_samples(
                    states=torch.randn(E, 3), actions=torch.randn(E, 1), rewards=torch.ones(E, 1),
                    values=torch.zeros(E, 1), terminated=torch.zeros(E, 1, dtype=torch.bool),
                )  # fmt: skip
            assert m.memory_index == 0 and m.filled
            rewards = m.get_tensor_by_name("rewards")
            returns = torch.flip(torch.cumsum(torch.flip(rewards, [0]), 0), [0])
            m.set_tensor_by_name("returns", returns)
            batches = m.sample_all(["states", "returns"], mini_batches=4)
            assert len(batches) == 4 and all(b[0].shape == (8, 3) for b in batches)
            got = torch.cat([b[1] for b in batches]).view(M, E)
            assert got[:, 0].tolist() == list(range(M, 0, -1))


# --- crash: SIGKILL of a real writer -------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, torch
    from mmreplay.compat.skrl import RandomMemory
    m = RandomMemory(20, 3, device="cpu", path=sys.argv[1], commit_every=1)
    m.create_tensor("observations", 2)
    m.create_tensor("terminated", 1, dtype=torch.bool)
    t = 0
    while True:
        obs = torch.stack([torch.full((2,), float(t + 1000 * e)) for e in range(3)])
        m.add_samples(observations=obs[:2], terminated=torch.tensor([[t % 2 == 0]] * 2))
        m.add_samples(observations=obs[2:], terminated=torch.tensor([[t % 2 == 0]]))
        print(t, flush=True)
        t += 1
    """
)


def test_memory_survives_sigkill(tmp_path, writers):
    path = tmp_path / "m"
    writers.kill_when(writers.start(WRITER, path), lambda line: int(line) >= 45)
    with RandomMemory(20, 3, device="cpu", path=path) as m:
        assert m.filled and len(m) == 60 and m.env_index == 0
        obs = m.get_tensor_by_name("observations")
        t = obs[:, 0, 0]
        steps = m.store.total_steps
        assert steps >= 46 and m.memory_index == steps % 20
        newest = (m.memory_index - 1) % 20
        assert t[newest].item() == steps - 1
        expected = [steps - 1 - ((steps - 1 - r) % 20) for r in range(20)]
        assert t.tolist() == expected
        assert (obs[:, 1, 0] == t + 1000).all() and (obs[:, 2, 0] == t + 2000).all()
        assert (m.get_tensor_by_name("terminated")[:, :, 0] == (t % 2 == 0)[:, None]).all()
        m.add_samples(observations=torch.zeros(3, 2), terminated=torch.zeros(3, 1, dtype=torch.bool))
        assert m.memory_index == (steps + 1) % 20


@pytest.mark.parametrize("created", [False, True], ids=["no-store-yet", "reset"])
def test_an_empty_memory_samples_empty_batches_as_skrl_does(tmp_path, created):
    """skrl: ``randperm(0)[:n]`` without replacement and ``sample_by_index([])`` give
    tensors of zero rows (with replacement an empty memory raises RuntimeError)."""
    m = RandomMemory(10, 2, device="cpu", replacement=False, path=tmp_path / "m")
    m.create_tensor("states", 3, torch.float32)
    if created:
        m.add_samples(states=torch.ones(2, 3))
        m.reset()
    assert len(m) == 0
    for batches in (m.sample(["states"], batch_size=4), m.sample_by_index(["states"], [])):
        assert [[t.shape for t in batch] for batch in batches] == [[torch.Size([0, 3])]]
    with pytest.raises(RuntimeError):
        RandomMemory(10, 2, device="cpu", replacement=True).sample(["states"], batch_size=4)
    m.close()


# --- prioritized replay through the layer -----------------------------------------------


def test_prioritized_memory_draws_by_priority_and_updates_land(tmp_path):
    with memory(tmp_path, 4, 2, sampler="prioritized", alpha=1.0, commit_every=1, replacement=None) as m:
        m.create_tensor("x", 1)
        add_steps(m, 6)  # wrapped: physical rows 0, 1 hold steps 4, 5
        assert m.store.sampler.name == "prioritized"
        # physical row 1, env 1 (flat index 3) holds step 5 of env 1: value 105
        assert m.update_priorities(torch.arange(8), torch.tensor([0, 0, 0, 1, 0, 0, 0, 0.0])) == 8
        prio = m.store.sampler.priorities(np.array([2, 3, 4, 5]), np.array([1, 1, 1, 1]))
        assert prio[3] == pytest.approx(1.0) and prio[:3].max() < 1e-6
        [[x]] = m.sample(["x"], 64)
        assert set(col(x)) == {105.0}
        assert m.get_sampling_indexes().tolist() == [3] * 64
        assert m.sampling_info.weight.shape == (64,)
        m.update_priorities(torch.tensor([3, 6]), torch.tensor([0.0, 5.0]))  # row 3, env 0: step 3
        [[x]] = m.sample(["x"], 64, sequence_length=2)
        assert col(x) == [3.0, 4.0] * 64  # the sequence starting at step 3 of env 0
        assert m.get_sampling_indexes().tolist() == [6, 0] * 64
    with memory(tmp_path, 4, 2) as m:  # reopened: the sampler and its priorities are back
        assert m.store.sampler.name == "prioritized"
        assert m.store.sampler.priorities(np.array([3]), np.array([0]))[0] == pytest.approx(5.0)
        m.create_tensor("y", 1)  # rebuilds the store: the sampler stays prioritized
        assert m.store.sampler.state_json()["name"] == "prioritized"
        assert m.store.sampler.state_json()["alpha"] == 1.0


def test_uniform_memory_has_no_priorities(tmp_path):
    with memory(tmp_path, 4) as m:
        m.create_tensor("x", 1)
        add_steps(m, 2)
        with pytest.raises(TypeError, match="keeps no priorities"):
            m.update_priorities([0], [1.0])


# --- what skrl's own Memory tests check (tests/test_skrl_own_tests.py runs them) --------


def test_any_leaf_name_is_a_tensor_name_as_in_skrl(tmp_path):
    with memory(tmp_path, 3, 2, cls=Memory) as m:
        for name in ("0", "A1", "x", "é"):
            assert m.create_tensor(name, size=1)
        m.add_samples(**{"0": torch.ones(2, 1), "x": torch.zeros(2, 1)})
        assert m.get_tensor_names() == ["0", "A1", "x", "é"] and m.get_tensor_by_name("0")[0].flatten().tolist() == [1, 1]
        for bad in ("", "..", "a/b"):
            with pytest.raises(ValueError, match="cannot name a leaf"):
                m.create_tensor(bad, size=1)
    with memory(tmp_path, 3, 2, cls=Memory) as m:
        assert m.get_tensor_names() == ["0", "A1", "x", "é"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a CPU-only torch")
def test_a_device_torch_cannot_use_falls_back_to_the_default_as_in_skrl(caplog):
    for asked in ("cuda:0", "cuda", "nonsense:7"):
        m = Memory(memory_size=2, device=asked)
        m.create_tensor("buffer", size=1)
        assert m.device == torch.device("cpu") and m.get_tensor_by_name("buffer").device == torch.device("cpu")
        m.close()
    assert "Invalid device specification (cuda:0)" in caplog.text
    assert Memory(memory_size=2).device == Memory(memory_size=2, device="cpu").device == torch.device("cpu")


def test_set_tensor_by_name_sets_rows_holding_steps_only(tmp_path):
    """A documented limit: rows holding no step are not storage (skrl keeps the values)."""
    with memory(tmp_path, 3, 2, cls=Memory) as m:
        m.create_tensor("x", 1)
        m.set_tensor_by_name("x", torch.arange(6.0).view(3, 2, 1))
        assert torch.isnan(m.get_tensor_by_name("x")).all()
        add_steps(m, 1)
        m.set_tensor_by_name("x", torch.arange(6.0).view(3, 2, 1))
        x = m.get_tensor_by_name("x")
        assert x[0].flatten().tolist() == [0, 1] and torch.isnan(x[1:]).all()


def test_the_store_under_a_memory_gives_n_step_returns_of_skrls_tensors(tmp_path):
    from test_nstep import expected

    m = memory(tmp_path, 40, 2)
    names = {"states": 3, "next_states": 3, "actions": 1, "rewards": 1, "terminated": 1, "truncated": 1}
    for name, size in names.items():
        m.create_tensor(name, size=size, dtype=torch.bool if name in ("terminated", "truncated") else torch.float32)
    gen = torch.Generator().manual_seed(0)
    for t in range(30):
        ended = torch.rand(2, 1, generator=gen) < 0.2
        m.add_samples(
            states=torch.full((2, 3), float(t)), next_states=torch.full((2, 3), t + 1.0), actions=torch.zeros(2, 1),
            rewards=torch.rand(2, 1, generator=gen), terminated=ended & (t % 2 == 0), truncated=ended & (t % 2 == 1),
        )  # fmt: skip
    batch, info = m.store.sample(64, rng=0, transform=mr.NStep(3, gamma=0.9), return_info=True)
    want = expected(m.store, info.step, info.env, 3, 0.9)
    np.testing.assert_allclose(batch["rewards"], want["reward"], rtol=1e-6)
    np.testing.assert_array_equal(batch["next_states"], want["next_observation"])
    np.testing.assert_array_equal(batch["terminated"], want["terminated"])
    np.testing.assert_allclose(batch["discount"], want["discount"][:, None], rtol=1e-6)
    m.close()
