"""The built-in demo: a small deterministic environment and the job ``mmreplay demo`` runs.

``PointChase`` is a vectorised point mass chasing a fixed target on a plane, written in
float32 numpy so that it needs no gymnasium and its whole state is its observation
``[x, y, vx, vy, target_x, target_y, t / time_limit]``. An episode ends by termination
when the point comes within ``catch_radius`` of the target, or by truncation at the time
limit. A scripted policy (a proportional controller plus noise) drives it. Resets and
noise are drawn from generators seeded by ``(seed, global step, env)``, so every step is
a function of the state and the global step id alone: a collector that resumes from the
last committed step writes exactly the rows an uninterrupted one would have.

The demo (:func:`run`) collects in a subprocess (``python -m mmreplay.demo collect``),
kills it with SIGKILL part-way, reopens the store, checks every committed row against a
fresh run of the environment, resumes collection to the end, samples a batch and exports
to Minari (loading it back when Minari is installed).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from .files import disk_usage
from .spec import ArraySpec, flatten, map_structure

if TYPE_CHECKING:
    from .store import Store

__all__ = ["PointChase", "DemoConfig", "spec", "collect", "reference", "run"]

OBS_DIM = 7
ACT_DIM = 2
IMAGE = 32  # rendered frames are IMAGE x IMAGE x 3 uint8


def spec(pixels: bool = False) -> dict[str, Any]:
    """The transition spec the demo stores (with rendered frames when ``pixels``)."""
    obs: Any = ArraySpec((OBS_DIM,), "float32")
    if pixels:
        obs = {"pixels": ArraySpec((IMAGE, IMAGE, 3), "uint8"), "state": obs}
    return {
        "observation": obs,
        "action": ArraySpec((ACT_DIM,), "float32"),
        "reward": ArraySpec((), "float32"),
        "terminated": ArraySpec((), "bool"),
        "truncated": ArraySpec((), "bool"),
        "next_observation": obs,
    }


def render(state: np.ndarray) -> np.ndarray:
    """Frames ``[n, IMAGE, IMAGE, 3]``: the point in red, the target in green, a faint grid."""
    n = len(state)
    frames = np.zeros((n, IMAGE, IMAGE, 3), np.uint8)
    frames[:, ::8, :, 2] = 40
    frames[:, :, ::8, 2] = 40
    for channel, xy in ((0, state[:, 0:2]), (1, state[:, 4:6])):
        pix = np.clip(((xy + 1.0) * 0.5 * (IMAGE - 1)).round().astype(np.int64), 1, IMAGE - 2)
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                frames[np.arange(n), pix[:, 1] + dy, pix[:, 0] + dx, channel] = 255 if dx == dy == 0 else 160
    return frames


class PointChase:
    """``num_envs`` point masses chasing their targets; float32 throughout.

    Args:
        num_envs: parallel environments.
        seed: the seed every reset and every noise draw derives from.
        time_limit: steps before an episode is truncated.
        catch_radius: distance at which an episode terminates.
    """

    def __init__(self, num_envs: int = 8, seed: int = 0, time_limit: int = 100, catch_radius: float = 0.05):
        self.num_envs = num_envs
        self.seed = seed
        self.time_limit = time_limit
        self.catch_radius = np.float32(catch_radius)
        self.state = np.zeros((num_envs, OBS_DIM), np.float32)

    def _rng(self, kind: int, step: int, env: int = 0) -> np.random.Generator:
        return np.random.default_rng([self.seed, kind, step, env])

    def reset_envs(self, envs: np.ndarray, step: int) -> None:
        """Fresh episodes for ``envs``, drawn for global step ``step``."""
        for e in np.flatnonzero(envs):
            r = self._rng(1, step, int(e))
            pos = r.uniform(-0.9, 0.9, 2).astype(np.float32)
            target = r.uniform(-0.9, 0.9, 2).astype(np.float32)
            self.state[e] = np.concatenate([pos, np.zeros(2, np.float32), target, np.zeros(1, np.float32)])

    def reset(self, step: int = 0) -> np.ndarray:
        self.reset_envs(np.ones(self.num_envs, bool), step)
        return self.state.copy()

    def policy(self, obs: np.ndarray, step: int) -> np.ndarray:
        """The scripted behaviour policy: steer to the target, damp, add noise."""
        noise = self._rng(2, step).standard_normal((self.num_envs, ACT_DIM)).astype(np.float32)
        pull = np.float32(1.5) * (obs[:, 4:6] - obs[:, 0:2]) - np.float32(0.8) * obs[:, 2:4]
        return np.clip(pull + np.float32(0.9) * noise, -1, 1).astype(np.float32)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Advance every env; returns (next_obs, reward, terminated, truncated)."""
        s = self.state
        a = np.clip(action, -1, 1).astype(np.float32)
        vel = np.float32(0.85) * s[:, 2:4] + np.float32(0.1) * a
        pos = np.clip(s[:, 0:2] + vel, -1, 1).astype(np.float32)
        t = s[:, 6:7] + np.float32(1.0 / self.time_limit)
        s = np.concatenate([pos, vel, s[:, 4:6], t], axis=1).astype(np.float32)
        dist = np.sqrt(((s[:, 4:6] - s[:, 0:2]) ** 2).sum(axis=1)).astype(np.float32)
        terminated = dist < self.catch_radius
        truncated = ~terminated & (np.rint(s[:, 6] * self.time_limit) >= self.time_limit)
        reward = (-dist + np.float32(10.0) * terminated).astype(np.float32)
        self.state = s
        return s.copy(), reward, terminated, truncated

    def restore(self, next_obs: np.ndarray, done: np.ndarray, step: int) -> None:
        """Take up the state after a stored step (``step`` is the next global step id)."""
        self.state = np.array(next_obs, np.float32)
        self.reset_envs(done, step)


def rollout(env: PointChase, start: int, stop: int, pixels: bool = False) -> Any:
    """Steps ``[start, stop)`` from the env's current state, as ``[T, num_envs, ...]`` arrays."""
    T, n = stop - start, env.num_envs
    obs = np.empty((T, n, OBS_DIM), np.float32)
    nxt = np.empty((T, n, OBS_DIM), np.float32)
    act = np.empty((T, n, ACT_DIM), np.float32)
    rew = np.empty((T, n), np.float32)
    term = np.empty((T, n), bool)
    trunc = np.empty((T, n), bool)
    for i, g in enumerate(range(start, stop)):
        obs[i] = env.state
        act[i] = env.policy(obs[i], g)
        nxt[i], rew[i], term[i], trunc[i] = env.step(act[i])
        env.reset_envs(term[i] | trunc[i], g + 1)
    if pixels:

        def wrap(o: np.ndarray) -> dict[str, np.ndarray]:
            return {"pixels": render(o.reshape(-1, OBS_DIM)).reshape(T, n, IMAGE, IMAGE, 3), "state": o}

        obs, nxt = wrap(obs), wrap(nxt)
    return {
        "observation": obs,
        "action": act,
        "reward": rew,
        "terminated": term,
        "truncated": trunc,
        "next_observation": nxt,
    }


def reference(steps: int, num_envs: int = 8, seed: int = 0, pixels: bool = False, **env_kw: Any) -> Any:
    """What an uninterrupted collection of ``steps`` steps stores, in memory."""
    env = PointChase(num_envs, seed, **env_kw)
    env.reset(0)
    return rollout(env, 0, steps, pixels)


def resume_env(store: Store, seed: int, **env_kw: Any) -> PointChase:
    """An env in the state after the store's last committed step."""
    env = PointChase(store.num_envs, seed, **env_kw)
    end = store.committed_steps
    if end == 0:
        env.reset(0)
        return env
    last = store.get(-1)
    nxt = last["next_observation"]
    state = nxt["state"] if isinstance(nxt, dict) else nxt
    env.restore(state, np.asarray(last["terminated"]) | np.asarray(last["truncated"]), end)
    return env


def collect(
    store: Store,
    stop: int,
    seed: int = 0,
    block: int = 50,
    on_commit: Callable[[int], Any] | None = None,
    **env_kw: Any,
) -> None:
    """Collect from the store's committed end up to global step ``stop``.

    Steps are added one at a time, as an agent would; the store commits every
    ``commit_every`` steps, and ``on_commit`` hears the committed cursor each time.
    """
    pixels = isinstance(store.spec["observation"], dict)
    env = resume_env(store, seed, **env_kw)
    g = last = store.committed_steps
    while g < stop:
        k = min(block, stop - g)
        steps = rollout(env, g, g + k, pixels)
        for i in range(k):
            store.add(map_structure(itemgetter(i), steps))
            if on_commit is not None and store.committed_steps != last:
                last = store.committed_steps
                on_commit(last)
        g += k


# --- the collector process -----------------------------------------------------------------


def _collector_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mmreplay.demo collect")
    parser.add_argument("path")
    parser.add_argument("--stop", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step (an env's cost)")
    args = parser.parse_args(argv)
    from .store import open as open_store

    def report(end: int) -> None:
        sys.stdout.write(f"committed {end}\n")
        sys.stdout.flush()
        if args.pace:
            time.sleep(args.pace)

    with open_store(args.path, mode="a", continue_episodes=True) as store:  # collect restores the envs
        collect(store, args.stop, seed=args.seed, on_commit=report)
    sys.stdout.write("done\n")
    return 0


# --- the demo driver -----------------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of the demo run."""

    num_envs: int = 8
    steps: int = 20_000
    capacity: int = 25_000
    commit_every: int = 500
    kill_after: int = 8_000  # SIGKILL once a commit at or past this step is reported
    seed: int = 0
    backend: str | None = None  # zarr, else hdf5 where zarr-python is not installed


def _mb(path: str) -> float:
    return disk_usage(path) / 2**20


def _equal(got: Any, ref: Any, first: int, end: int) -> bool:
    """Whether ``got`` holds exactly steps ``[first, end)`` of the reference run ``ref``."""
    return all(np.array_equal(a, b[first:end]) for a, b in zip(flatten(got), flatten(ref), strict=True))


def run(
    folder: str | None = None, config: DemoConfig = DemoConfig(), echo: Callable[[str], Any] | None = None
) -> dict:
    """Run the demo in ``folder`` (a new temporary one by default) and report each step.

    ``echo`` receives each line of the report (``mmreplay demo`` passes ``click.echo``;
    by default the lines go to this module's logger). Returns the figures it reported,
    for scripts and tests.
    """
    if echo is None:
        echo = logging.getLogger(__name__).info
    from .creation import create
    from .formats import export
    from .store import open as open_store

    own = folder is None
    folder = tempfile.mkdtemp(prefix="mmreplay-demo-") if own else os.path.abspath(folder)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise FileExistsError(f"{folder}: exists and is not a folder; give the demo an empty or new folder")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "buffer")
    if os.path.exists(path):
        raise FileExistsError(f"{path}: already exists; give the demo an empty or new folder")
    c = config
    figures: dict[str, Any] = {"folder": folder}
    t_all = time.perf_counter()

    echo(f"mmreplay demo in {folder}")
    echo(f"  environment: PointChase, {c.num_envs} envs, deterministic (seed {c.seed}), no gymnasium needed")
    t = time.perf_counter()
    with create(
        path, spec(), capacity=c.capacity, num_envs=c.num_envs, backend=c.backend, commit_every=c.commit_every
    ) as made:
        backend = made.backend  # hdf5 where zarr-python is not installed
    echo(
        f"1. created {path}: {backend}, capacity {c.capacity:,} steps x {c.num_envs} envs, "
        f"commit every {c.commit_every} steps ({(time.perf_counter() - t) * 1e3:.0f} ms, {_mb(path):.1f} MB on disk)"
    )

    # 2. a collector process, killed part-way
    t = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable,
        "-m",
        "mmreplay.demo",
        "collect",
        path,
        "--stop",
        str(c.steps),
        "--seed",
        str(c.seed),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    reported = 0
    for line in proc.stdout or ():
        if line.startswith("committed "):
            reported = int(line.split()[1])
            if reported >= c.kill_after:
                proc.kill()
                break
    proc.wait()
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(
            f"the collector ended with status {proc.returncode} before it was killed: {err.strip()}"
        )
    killed_s = time.perf_counter() - t
    echo(
        f"2. collector pid {proc.pid} added steps one at a time; SIGKILL after it reported the commit "
        f"at step {reported:,} ({killed_s:.1f} s)"
    )

    # 3. reopen: every committed step survived, bit-exact
    t = time.perf_counter()
    store = open_store(path, mode="r")
    open_ms = (time.perf_counter() - t) * 1e3
    end = store.committed_steps
    ref = reference(c.steps, c.num_envs, c.seed)
    exact = _equal(store.get(slice(None)), ref, store.first_step, end)
    store.close()
    if end < reported or not exact:
        raise RuntimeError(f"committed data lost or changed: reported {reported}, found {end}, exact={exact}")
    echo(
        f"3. reopened in {open_ms:.1f} ms: {end:,} committed steps ({end * c.num_envs:,} rows) survived, "
        f"{store.state.commits} commits; all {end * c.num_envs:,} rows equal a fresh run bit for bit "
        f"(steps written after the last commit were lost, as promised)"
    )

    # 4. resume to the end
    t = time.perf_counter()
    with open_store(path, mode="a", continue_episodes=True) as store:  # collect restores the envs
        collect(store, c.steps, seed=c.seed)
    resume_s = time.perf_counter() - t
    with open_store(path, mode="r") as store:
        exact = _equal(store.get(slice(None)), ref, store.first_step, store.committed_steps)
        total, commits = store.committed_steps, store.state.commits
        if not exact:
            raise RuntimeError("the resumed store differs from an uninterrupted run")
        echo(
            f"4. resumed from step {end:,} to {total:,} in {resume_s:.1f} s ({commits} commits in all); "
            f"the store equals an uninterrupted run; {_mb(path):.1f} MB on disk"
        )

        # 5. sample
        t = time.perf_counter()
        batch = store.sample(256, rng=0)
        sample_ms = (time.perf_counter() - t) * 1e3
        shapes = ", ".join(f"{k} {tuple(np.shape(v))}" for k, v in batch.items())
        spans = store.episode_index()
        done = [s for s in spans if s.status != "open"]
        echo(f"5. sampled 256 transitions in {sample_ms:.1f} ms: {shapes}")
        echo(
            f"   {len(spans):,} episodes: {sum(s.status == 'terminated' for s in spans):,} terminated, "
            f"{sum(s.status == 'truncated' for s in spans):,} truncated, "
            f"{len(spans) - len(done)} still open at the end"
        )

        # 6. export to Minari, and load it back
        t = time.perf_counter()
        out = os.path.join(folder, "minari")
        result = export(store, out, format="minari", dataset_id="mmreplay/pointchase-v0")
        export_s = time.perf_counter() - t
        echo(
            f"6. exported to Minari in {export_s:.1f} s: {result.episodes:,} episodes, {result.steps:,} steps, "
            f"{result.nbytes / 2**20:.1f} MB at {result.path}"
        )
        figures["loaded"] = _check_minari(out, result, store, echo)
    figures.update(
        reported=reported,
        survived=end,
        steps=total,
        commits=commits,
        episodes=len(spans),
        exported=result.episodes,
        seconds=time.perf_counter() - t_all,
    )
    echo(f"done in {figures['seconds']:.1f} s; the store is at {path}")
    if own:
        echo(f"(remove it with: rm -r {folder})")
    return figures


def _check_minari(root: str, result: Any, store: Store, echo: Callable[[str], Any]) -> bool:
    try:
        import minari
    except ImportError:
        echo("   minari is not installed: skipped loading the export back (pip install 'mmreplay[export]')")
        return False
    t = time.perf_counter()
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = root
    try:
        ds = minari.load_dataset(result.info["dataset_id"])
        mismatched = 0
        for ep, span in zip(ds.iterate_episodes(), store.episodes()):
            d = span.data
            obs = np.concatenate([d["observation"], d["next_observation"][-1:]])
            if not (np.array_equal(ep.observations, obs) and np.array_equal(ep.actions, d["action"])):
                mismatched += 1
        n = ds.total_episodes
    finally:
        if old is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = old
    if mismatched:
        raise RuntimeError(f"{mismatched} Minari episodes differ from the store")
    echo(
        f"   minari.load_dataset({result.info['dataset_id']!r}): {n:,} episodes, {ds.total_steps:,} steps, "
        f"every episode equal to the store ({time.perf_counter() - t:.1f} s)"
    )
    return True


def _main(argv: list[str]) -> int:
    if argv[:1] == ["collect"]:
        return _collector_main(argv[1:])
    sys.stderr.write("usage: python -m mmreplay.demo collect PATH --stop N [--seed S]\n")
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
