"""The benchmarks keep working: every one runs at its smallest size from the one entry
point, in a fresh process, and prints its tables with the command, date and load beside
each. No timing is asserted; the timing helper and the data are checked for what they
promise (turns, full rings, ratios of the numbers shown, realistic frames)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import spread

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import BENCHMARKS, timing  # noqa: E402
from bench.atari_like import rollout  # noqa: E402

#: what each benchmark's output must hold besides its tables
EXPECTED = {
    "peers": ["### machine", "### vector (", "### pixels (", "### nested (", "### reopen by size"],
    "hot-path": ["per-step add and sample(256)", "live_state", "open() + close()"],
    "sampling": ["sample(256) page-cached", "| mmreplay hdf5 reader |"],
    "cold-rows": ["evicted before each batch", "os.pread", "page cache warm", "page cache cold"],
    "pixels": [
        "while the rings fill from empty",
        "on full rings (steady state)",
        "stacks contiguous in NCHW",
        "collector and learner in one process",
        "| add, rows:lz4 | ≥ 0.5× numpy-stacks |",
        "read from the disk",
        "(python)",
    ],
    "mapping-budget": ["mapped, none kept open"],
    "prioritized": ["update_priorities(256)", "by sampler"],
    "group": ["actor processes", "the learner's batch"],
    "object-store": ["| pixels-rows |", "whole chunks"],
    "export": ["`cp -r` (pixels store)", "numpy savez", "| npz |", "| minari |", "| csv |"],
    "lerobot": ["LeRobot's default", "lossless"],
    "view": ["| noise | gif |"],
    "compat": ["TF-Agents add_batch", "skrl RandomMemory.sample"],
    "sb3": ["save_replay_buffer"],
    "her": ["HER sample(256)", "`add` then `sample(256)`", "`model.learn`"],
    "torchrl": ["SliceSampler"],
    "nstep": ["n-step `sample(256)`", "| mmreplay store.sample |", "SB3 DQN on CartPole"],
}


def _cold_batches_prefetch_by_the_default(tables: list[dict]) -> None:
    """Every evicted batch of a store in its default mode is sent to the prefetch by the
    per-batch decision (the first batch after each switch to it at least)."""
    evicted = next(t for t in tables if "evicted" in t["title"])
    sent = {row[0]: row[-1] for row in evicted["rows"]}
    assert all(int(v.split(" of ")[0]) >= 1 for k, v in sent.items() if k.endswith(", default")), sent
    assert all(v == "" for k, v in sent.items() if not k.endswith(", default")), sent


#: further checks of a benchmark's printed tables
CHECKS = {"cold-rows": _cold_batches_prefetch_by_the_default}


def run_bench(*args: str, cwd: str = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "RL_WARNINGS": "0"},
    )


def test_every_benchmark_is_expected_here() -> None:
    assert set(EXPECTED) == set(BENCHMARKS)


#: the benchmarks whose smallest size takes seconds, and cold-rows, whose tables check the
#: prefetch decision (CHECKS); the others run with --long
QUICK = ["hot-path", "cold-rows", "mapping-budget", "lerobot", "view"]


@pytest.mark.parametrize("name", spread(list(BENCHMARKS), normal=QUICK))
def test_each_benchmark_runs_at_its_smallest_size_and_prints_its_conditions(name: str, tmp_path) -> None:
    out = tmp_path / "tables.json"
    proc = run_bench(name, "--smoke", "--dir", str(tmp_path), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = json.loads(out.read_text())
    assert tables and proc.stdout.count("### ") == len(tables)
    for t in tables:
        assert (
            f"`python -m bench {name} --smoke --dir " in t["conditions"] and "load average" in t["conditions"]
        )
        assert f"### {t['title']}\n\n{t['conditions']}\n\n| " in proc.stdout  # printed beside its table
        assert t["rows"] and all(len(row) == len(t["head"]) for row in t["rows"]), t["title"]
    for text in EXPECTED[name]:
        assert text in proc.stdout, text
    if name in CHECKS:
        CHECKS[name](tables)
    assert os.listdir(tmp_path) == ["tables.json"]  # the buffers are removed


def test_the_listing_names_every_benchmark_and_an_unknown_name_is_refused() -> None:
    listed = run_bench()
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()[2:]] == list(BENCHMARKS)
    wrong = run_bench("no-such")
    assert wrong.returncode == 2 and "no benchmark named 'no-such'" in wrong.stderr


def test_torchrl_codec_is_named_as_probed() -> None:
    """TorchRL's CompressedListStorage compresses with zlib before Python 3.14."""
    pytest.importorskip("torchrl")
    from bench.pixels import TorchRL

    step = {"obs": np.zeros((2, 84, 84, 4), np.uint8)}
    name = TorchRL("torchrl", [step], capacity=4, envs=2).name
    assert ("zstd level 3" if sys.version_info >= (3, 14) else "zlib level 3") in name


def test_variants_take_turns_in_alternating_order_and_pay_before_untimed() -> None:
    calls: list[str] = []
    variants = {
        k: timing.Timed(
            lambda k=k: calls.append(k),
            2,
            before=lambda k=k: calls.append(f"{k}:before"),
            after=lambda k=k: calls.append(f"{k}:after"),
        )
        for k in "ab"
    }
    got = timing.interleaved(variants, repeats=2, warmup=1)
    block = ["{}:before", "{}", "{}", "{}:after"]
    expected = [x.format(k) for k in "ab" for x in block]  # warm-up
    expected += [x.format(k) for k in "ab" for x in block] + [x.format(k) for k in "ba" for x in block]
    assert calls == expected
    assert all(len(s.wall) == len(s.cpu) == len(s.faults) == 2 for s in got.values())


def test_fill_adds_exactly_a_ring_of_steps_to_every_system() -> None:
    counts = {"a": 0, "b": 0}

    def adder(k: str):
        def add() -> None:
            counts[k] += 1

        return add

    got = timing.fill({k: adder(k) for k in counts}, steps=23, block=5)
    assert counts == {"a": 23, "b": 23}
    assert all(len(s.wall) == 4 for s in got.values())  # the fill phase's whole blocks


def test_ratios_are_of_the_numbers_as_printed() -> None:
    assert timing.cell(1234.5) == "1,230" and timing.cell(0.012345) == "0.0123"
    assert timing.ratio(1234.5, 617.4) == "2×"  # 1,230 / 617
    assert timing.ratio(310.4, 1.0) == "310×"
    assert timing.ratio(1.0, 0) == "–" and timing.ratio(None, 1.0) == "–"


def test_pixel_steps_are_atari_like_stacks_with_episodes() -> None:
    a, b = rollout(30, 2, episode=10, seed=3), rollout(30, 2, episode=10, seed=3)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    obs, nxt, done = a["obs"], a["next_obs"], a["terminated"]
    assert obs.shape == (30, 2, 84, 84, 4) and obs.dtype == np.uint8
    assert done[:, 0].nonzero()[0].tolist() == [9, 19, 29]
    np.testing.assert_array_equal(nxt[:9], obs[1:10])  # within an episode, next_obs is the next stack
    assert (nxt[9] != obs[10]).any()  # the final observation is not the next episode's first stack
    np.testing.assert_array_equal(obs[1, ..., :3], obs[0, ..., 1:])  # a stack of 4 frames, newest last
    assert (obs[10, ..., 0] == obs[10, ..., 3]).all()  # an episode's first stack repeats its first frame
    assert 0 < np.unique(obs[5, 0]).size < 64  # screens, neither blank nor noise


def test_pixel_batches_are_timed_in_the_models_layout_contiguous() -> None:
    """Every system's stacks are made contiguous in the model's layout, whichever they
    are stored in; the other leaves are made contiguous."""
    from bench.pixels import in_layout

    hwc = np.arange(2 * 3 * 84 * 84 * 4, dtype=np.uint32).reshape(2, 3, 84, 84, 4)  # a sequence batch
    chw = np.ascontiguousarray(hwc.transpose(0, 1, 4, 2, 3))
    done = np.zeros((6, 2), bool)[::2]
    for stored, chw_stored in ((hwc, False), (chw, True), (hwc[:, 0], False), (chw[:, 0], True)):
        lead = stored.ndim - 3
        for layout, want in (("NCHW", chw), ("NHWC", hwc)):
            got = in_layout({"obs": stored, "terminated": done}, chw_stored, layout)
            expected = want if lead == 2 else want[:, 0]
            assert got["obs"].flags.c_contiguous and got["terminated"].flags.c_contiguous
            np.testing.assert_array_equal(got["obs"], expected)
