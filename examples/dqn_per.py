"""DQN with prioritized replay on CartPole, the replay buffer (and its priorities) on disk.

    python examples/dqn_per.py --steps 20000 --buffer runs/cartpole-per

Every transition goes into an mmreplay buffer created with ``sampler="prioritized"``;
each training batch comes with importance weights, and the new TD errors go back with
``store.update_priorities``. Killed and restarted with the same ``--buffer``, the run
resumes from the data and the priorities on disk (the network is not saved here).
Needs ``pip install 'mmreplay[torch,gymnasium]'``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import gymnasium as gym
import numpy as np
import torch
from torch import nn

import mmreplay as mr


def make_store(path: str, capacity: int) -> mr.Store:
    spec = {
        "obs": mr.ArraySpec((4,), "float32"),
        "action": mr.ArraySpec((), "int64"),
        "reward": mr.ArraySpec((), "float32"),
        "next_obs": mr.ArraySpec((4,), "float32"),
        "terminated": mr.ArraySpec((), "bool"),
        "truncated": mr.ArraySpec((), "bool"),
    }
    # reopens the buffer made by an earlier run; another capacity is refused (SpecMismatchError)
    return mr.create(
        path, spec, capacity, commit_every=50, sampler="prioritized", alpha=0.6, beta=0.4, exist_ok=True
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="environment steps")
    parser.add_argument("--buffer", default=None, help="buffer folder (default: a new temporary one)")
    parser.add_argument("--capacity", type=int, default=50_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = args.buffer or os.path.join(tempfile.mkdtemp(), "cartpole-per")
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    q = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    target = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    target.load_state_dict(q.state_dict())
    optim = torch.optim.Adam(q.parameters(), lr=1e-3)
    gamma, learn_from, explore = 0.99, min(500, args.steps // 4), max(1, args.steps // 2)

    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=args.seed)
    returns, ret = [], 0.0
    with make_store(path, args.capacity) as store:
        for t in range(args.steps):
            eps = max(0.05, 1.0 - t / explore)
            if rng.random() < eps:
                action = int(rng.integers(2))
            else:
                with torch.no_grad():
                    action = int(q(torch.as_tensor(obs[None], dtype=torch.float32)).argmax())
            next_obs, reward, terminated, truncated, _ = env.step(action)
            store.add(
                {
                    "obs": obs[None].astype(np.float32),
                    "action": np.array([action]),
                    "reward": np.array([reward], np.float32),
                    "next_obs": next_obs[None].astype(np.float32),
                    "terminated": np.array([terminated]),
                    "truncated": np.array([truncated]),
                }
            )
            ret += float(reward)
            obs = next_obs
            if terminated or truncated:
                returns.append(ret)
                ret = 0.0
                obs, _ = env.reset()

            if t >= learn_from and len(store) >= args.batch_size:
                beta = 0.4 + 0.6 * min(1.0, t / args.steps)  # annealed towards 1
                batch, info = store.sample(args.batch_size, beta=beta, return_info=True, rng=rng)
                b = {k: torch.as_tensor(v) for k, v in batch.items()}
                with torch.no_grad():
                    best = target(b["next_obs"]).max(dim=1).values
                    y = b["reward"] + gamma * (~b["terminated"]).float() * best
                pred = q(b["obs"]).gather(1, b["action"][:, None]).squeeze(1)
                td = y - pred
                weight = torch.as_tensor(info.weight)
                loss = (weight * nn.functional.smooth_l1_loss(pred, y, reduction="none")).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                store.update_priorities(info.step, info.env, td.abs().detach().numpy())
            if t % 250 == 0:
                target.load_state_dict(q.state_dict())
            if t % 2000 == 0 and returns:
                print(f"step {t}: mean return of the last 10 episodes {np.mean(returns[-10:]):.1f}")
    env.close()
    last = f"{np.mean(returns[-10:]):.1f}" if returns else "n/a"
    print(f"done: {args.steps} steps, {len(returns)} episodes, last mean return {last}, buffer {path}")


if __name__ == "__main__":
    main()
