"""LeRobot's own ``LeRobotDataset`` loads a lerobot export (``--long``).

LeRobot does not install beside this project's test environment (0.6 needs Python >= 3.12
and torch < 2.12; on Python 3.11 pip finds 0.4.4, which needs torch < 2.11). So the long
run builds a separate venv with ``pip install lerobot==0.4.4`` (PyPI's torch 2.10 is a
CUDA build: several GB; set ``MMREPLAY_LEROBOT_VENV`` to a venv that has it to reuse one),
exports a store here, and loads the export there with both of LeRobot's decoders (PyAV,
and torchcodec where the system's FFmpeg libraries are installed): every frame, and
frame stacks made by ``delta_timestamps``, against the store's.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import venv

import numpy as np
import pytest
from test_lerobot import FPS, fill

import mmreplay as mr

LEROBOT = "lerobot==0.4.4"

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root, want = sys.argv[1], np.load(sys.argv[2])
    report = {}
    for backend in ("pyav", "torchcodec"):
        try:
            stacked = {"observation.images.stack": [-3 / %(fps)d, -2 / %(fps)d, -1 / %(fps)d, 0.0]}
            ds = LeRobotDataset("mmreplay/export", root=root, video_backend=backend, delta_timestamps=stacked)
            items = [ds[i] for i in range(len(ds))]
        except Exception as exc:  # torchcodec without the system's FFmpeg libraries
            report[backend] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            continue
        camera = np.stack([(it["observation.images.camera"].numpy() * 255).round() for it in items])
        stacks = np.stack([(it["observation.images.stack"][:, 0].numpy() * 255).round() for it in items])
        mse = lambda a, b: float(np.mean((a.astype(np.float64) - b) ** 2))
        report[backend] = {
            "frames": len(ds), "episodes": ds.num_episodes, "tasks": sorted({it["task"] for it in items}),
            "camera_mse": mse(camera.transpose(0, 2, 3, 1), want["camera"]),
            "stack_mse": mse(stacks, want["stack"]),
            "reward": bool(np.array_equal(np.stack([it["next.reward"].numpy() for it in items]), want["reward"])),
        }
    print(json.dumps(report))
    """
) % {"fps": FPS}


def lerobot_python(tmp_path) -> str:
    home = os.environ.get("MMREPLAY_LEROBOT_VENV")
    if not home:
        home = str(tmp_path / "lerobot-venv")
        venv.create(home, with_pip=True)
        done = subprocess.run(
            [os.path.join(home, "bin", "pip"), "install", "--quiet", LEROBOT], capture_output=True, text=True, timeout=5400
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return os.path.join(home, "bin", "python")


@pytest.mark.long
@pytest.mark.parametrize("lossless", [False, True], ids=["av1", "lossless"])
def test_lerobot_dataset_loads_the_export(tmp_path, lossless):
    python = lerobot_python(tmp_path)
    with fill(tmp_path / "store") as store:
        mr.export(store, tmp_path / "out", format="lerobot", fps=FPS, task="play", lossless=lossless)
        episodes = list(store.episodes())
    want = {
        "camera": np.concatenate([ep.data["obs"]["camera"] for ep in episodes]),
        "stack": np.concatenate([ep.data["obs"]["stack"] for ep in episodes]),  # [n, 4, H, W] oldest first
        "reward": np.concatenate([ep.data["reward"] for ep in episodes]),
    }
    np.savez(tmp_path / "want.npz", **want)
    out = subprocess.run(
        [python, "-c", SCRIPT, str(tmp_path / "out"), str(tmp_path / "want.npz")],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))  # what ran and what it showed (pytest -s)
    assert "error" not in report["pyav"], report
    for backend, got in report.items():
        if "error" in got:
            continue
        assert (got["frames"], got["episodes"], got["tasks"]) == (len(want["reward"]), len(episodes), ["play"])
        assert got["reward"], backend
        limit = 0.0 if lossless else 255**2 / 10 ** (35 / 10)  # bit-exact, or a PSNR of 35 dB
        assert got["camera_mse"] <= limit and got["stack_mse"] <= limit, (backend, got)
