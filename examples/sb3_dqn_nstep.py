"""n-step returns for Stable-Baselines3's DQN on CartPole, the buffer in a folder on disk.

The buffer is ``mmreplay.compat.sb3.NStepReplayBuffer``: SB3 adds one-step transitions
as ever, and each batch comes with the discounted sum of up to ``n_steps`` rewards, the
observation to bootstrap from and the discount SB3's DQN applies (``discounts``). The
greedy policy's mean return is printed before and after training. Run again with the
same ``--buffer`` and the run resumes from the transitions on disk.

    python examples/sb3_dqn_nstep.py --steps 30000 --buffer runs/cartpole-nstep
"""

from __future__ import annotations

import argparse

import gymnasium as gym
import numpy as np
from stable_baselines3 import DQN
from stable_baselines3.common.logger import Logger, configure

from mmreplay.compat.sb3 import NStepReplayBuffer


def greedy_return(model: DQN, episodes: int, seed: int) -> float:
    """The mean return of the greedy policy over ``episodes`` CartPole episodes."""
    env = gym.make("CartPole-v1")
    returns = []
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, reward, terminated, truncated, _ = env.step(int(action))
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
    return float(np.mean(returns))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30_000)
    parser.add_argument("--n-steps", type=int, default=3, help="rewards summed per transition at most")
    parser.add_argument("--buffer", default=None, help="buffer folder (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=10, help="greedy episodes evaluated")
    parser.add_argument("--log", default=None, help="folder for SB3's progress log (default: none)")
    args = parser.parse_args(argv)
    gamma = 0.99
    model = DQN(
        "MlpPolicy",
        gym.make("CartPole-v1"),
        gamma=gamma,
        replay_buffer_class=NStepReplayBuffer,
        replay_buffer_kwargs={"n_steps": args.n_steps, "gamma": gamma, "path": args.buffer},
        # RL Zoo's CartPole DQN settings
        learning_rate=2.3e-3,
        batch_size=64,
        buffer_size=100_000,
        learning_starts=min(1000, args.steps // 2),
        target_update_interval=10,
        train_freq=256,
        gradient_steps=128,
        exploration_fraction=0.16,
        exploration_final_eps=0.04,
        policy_kwargs={"net_arch": [256, 256]},
        seed=args.seed,
    )
    # without a logger of its own, every learn() makes an empty SB3-<date> folder in /tmp
    model.set_logger(configure(args.log, ["stdout", "csv"]) if args.log else Logger(None, []))
    before = greedy_return(model, args.episodes, seed=10_000)
    model.learn(args.steps)
    after = greedy_return(model, args.episodes, seed=10_000)
    print(
        f"greedy return over {args.episodes} episodes: {before:.1f} before, {after:.1f} after "
        f"{args.steps} steps with {args.n_steps}-step returns"
    )
    model.replay_buffer.close()


if __name__ == "__main__":
    main()
