"""SB3's DQN with hindsight experience replay on bit flipping, its buffer a folder on disk.

The agent flips one bit per step until the bits match a goal; the only reward is for
reaching it, which a random policy rarely does with many bits: HER relabels stored
transitions with goals they did reach. The buffer is ``mmreplay.compat.sb3.HerReplayBuffer``
in ``RUN/buffer``; every ``--every`` steps the run saves the model and the buffer's
manifest (``RUN/model.zip``, ``RUN/buffer.pkl``, about 1 kB) and prints the greedy
policy's success rate. Kill it (even with ``kill -9``) and start it again with the same
``RUN``: it reloads the model, reopens the buffer with every step it committed (more
than the last checkpoint saw; the episodes cut by the kill end there, truncated) and
carries on learning.

    python examples/sb3_her_bitflip.py --run runs/bitflip --steps 20000
"""

from __future__ import annotations

import argparse
import os

from stable_baselines3 import DQN
from stable_baselines3.common.envs import BitFlippingEnv
from stable_baselines3.common.logger import Logger

from mmreplay.compat.sb3 import HerReplayBuffer


def success_rate(model: DQN, n_bits: int, episodes: int, seed: int) -> float:
    """The share of episodes the greedy policy ends at the goal."""
    env = BitFlippingEnv(n_bits=n_bits)
    env.reset(seed=seed)
    reached = 0
    for _ in range(episodes):
        obs, _ = env.reset()
        done = False
        while not done:
            action, _ = model.predict(obs, deterministic=True)
            obs, _, terminated, truncated, _ = env.step(int(action))
            done = terminated or truncated
        reached += int(terminated)
    return reached / episodes


def make_or_resume(run: str, n_bits: int, seed: int) -> DQN:
    """The checkpointed model and its buffer if ``run`` holds them, else a new model whose
    buffer is (or resumes) the store in ``run/buffer``."""
    env = BitFlippingEnv(n_bits=n_bits)
    if os.path.exists(os.path.join(run, "model.zip")):
        model = DQN.load(os.path.join(run, "model.zip"), env=env)
        # reopens run/buffer as it is now: the steps added after the checkpoint too
        model.load_replay_buffer(os.path.join(run, "buffer.pkl"))
    else:
        model = DQN(
            "MultiInputPolicy",
            env,
            replay_buffer_class=HerReplayBuffer,
            # commit_every: a kill loses at most the last 100 steps
            replay_buffer_kwargs={
                "n_sampled_goal": 4,
                "goal_selection_strategy": "future",
                "path": os.path.join(run, "buffer"),
                "commit_every": 100,
            },
            buffer_size=100_000,
            learning_starts=2 * n_bits,
            learning_rate=1e-3,
            gamma=0.95,
            exploration_fraction=0.3,
            exploration_final_eps=0.05,
            target_update_interval=200,
            train_freq=1,
            batch_size=64,
            policy_kwargs={"net_arch": [64, 64]},
            seed=seed,
        )
    model.set_logger(Logger(None, []))  # SB3's default logger makes an SB3-<date> folder in /tmp
    return model


def checkpoint(model: DQN, run: str) -> None:
    """Save the model and the buffer's manifest under temporary names, then rename them
    into place: a kill while SB3 writes them leaves the previous checkpoint whole."""
    for name, save in (("model.zip", model.save), ("buffer.pkl", model.save_replay_buffer)):
        stem, suffix = os.path.splitext(name)
        tmp = os.path.join(run, f"{stem}.tmp{suffix}")  # SB3 adds the suffix a name lacks
        save(tmp)
        os.replace(tmp, os.path.join(run, name))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="folder of the model, the buffer and its manifest")
    parser.add_argument(
        "--steps", type=int, default=20_000, help="environment steps in all, over every resume"
    )
    parser.add_argument("--every", type=int, default=2_000, help="steps between checkpoints")
    parser.add_argument("--bits", type=int, default=10)
    parser.add_argument("--eval-episodes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.makedirs(args.run, exist_ok=True)
    model = make_or_resume(args.run, args.bits, args.seed)
    rate = success_rate(model, args.bits, args.eval_episodes, seed=args.seed)
    print(
        f"start: step {model.num_timesteps}, buffer {model.replay_buffer.store.total_steps} steps, success {rate:.2f}",
        flush=True,
    )
    while model.num_timesteps < args.steps:
        model.learn(min(args.every, args.steps - model.num_timesteps), reset_num_timesteps=False)
        checkpoint(model, args.run)
        rate = success_rate(model, args.bits, args.eval_episodes, seed=args.seed)
        print(f"checkpoint: step {model.num_timesteps}, success {rate:.2f}", flush=True)
    model.replay_buffer.close()


if __name__ == "__main__":
    main()
