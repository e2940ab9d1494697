"""CleanRL's dqn.py, with its replay buffer on disk.

CleanRL constructs Stable-Baselines3's ``ReplayBuffer`` by hand, then calls
``rb.add(...)`` and ``rb.sample(...)``. With ``mmreplay.compat.sb3.ReplayBuffer`` the
buffer is a folder: kill the run and start it again with the same ``--buffer-path``,
and it resumes with every committed step. Besides the import, the loop does what
gymnasium >= 1.0 asks of it (docs/sb3.md, "CleanRL"): it skips the step that only
resets an env after its episode ended, and gives the buffer the time limits, so the
folder holds episodes as they were. (The trimmed script keeps CleanRL's training loop;
its logging and video capture are left out.)

    python examples/cleanrl_dqn.py --total-timesteps 20000 --buffer-path runs/cleanrl-buf
"""

import argparse
import random

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# from stable_baselines3.common.buffers import ReplayBuffer
from mmreplay.compat.sb3 import ReplayBuffer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--env-id", default="CartPole-v1")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=20_000)
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--num-envs", type=int, default=1)
    p.add_argument("--buffer-size", type=int, default=10_000)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--tau", type=float, default=1.0)
    p.add_argument("--target-network-frequency", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--start-e", type=float, default=1.0)
    p.add_argument("--end-e", type=float, default=0.05)
    p.add_argument("--exploration-fraction", type=float, default=0.5)
    p.add_argument("--learning-starts", type=int, default=10_000)
    p.add_argument("--train-frequency", type=int, default=10)
    p.add_argument("--buffer-path", default="runs/cleanrl-dqn-buffer")
    return p.parse_args()


class QNetwork(nn.Module):
    def __init__(self, env):
        super().__init__()
        self.network = nn.Sequential(
            nn.Linear(np.array(env.single_observation_space.shape).prod(), 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, env.single_action_space.n),
        )

    def forward(self, x):
        return self.network(x)


def linear_schedule(start_e: float, end_e: float, duration: int, t: int):
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


def main():
    args = parse_args()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cpu")

    # one env, as CleanRL's dqn.py: the buffer takes a step of every env at once, and under
    # next-step autoreset an env that ended an episode makes no transition on the next step
    assert args.num_envs == 1, "vectorized envs are not supported"
    envs = gym.vector.SyncVectorEnv([lambda: gym.make(args.env_id) for _ in range(args.num_envs)])
    q_network = QNetwork(envs).to(device)
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    target_network = QNetwork(envs).to(device)
    target_network.load_state_dict(q_network.state_dict())

    rb = ReplayBuffer(
        args.buffer_size,
        envs.single_observation_space,
        envs.single_action_space,
        device,
        handle_timeout_termination=True,  # CleanRL's False, with dones = terminations: the same batches
        path=args.buffer_path,  # the argument CleanRL's call does not have
    )

    obs, _ = envs.reset(seed=args.seed)
    autoreset = np.zeros(envs.num_envs, bool)
    for global_step in range(args.total_timesteps):
        epsilon = linear_schedule(
            args.start_e, args.end_e, args.exploration_fraction * args.total_timesteps, global_step
        )
        if random.random() < epsilon:
            actions = np.array([envs.single_action_space.sample() for _ in range(envs.num_envs)])
        else:
            q_values = q_network(torch.Tensor(obs).to(device))
            actions = torch.argmax(q_values, dim=1).cpu().numpy()

        next_obs, rewards, terminations, truncations, infos = envs.step(actions)

        # Next-step autoreset (gymnasium >= 1.0): the step after an episode ended only
        # resets the env (its action is ignored, reward 0): no transition, not stored.
        # The episode's last step already returned its final observation as next_obs.
        if not autoreset.any():
            # a time limit as SB3's VecEnvs report it: done, with TimeLimit.truncated
            timeouts = [{"TimeLimit.truncated": bool(tr and not te)} for te, tr in zip(terminations, truncations)]
            rb.add(obs, next_obs, actions, rewards, terminations | truncations, timeouts)
        autoreset = terminations | truncations
        obs = next_obs

        if global_step > args.learning_starts:
            if global_step % args.train_frequency == 0:
                data = rb.sample(args.batch_size)
                with torch.no_grad():
                    target_max, _ = target_network(data.next_observations).max(dim=1)
                    td_target = data.rewards.flatten() + args.gamma * target_max * (1 - data.dones.flatten())
                old_val = q_network(data.observations).gather(1, data.actions).squeeze()
                loss = F.mse_loss(td_target, old_val)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

            if global_step % args.target_network_frequency == 0:
                for target_param, q_param in zip(target_network.parameters(), q_network.parameters()):
                    target_param.data.copy_(args.tau * q_param.data + (1.0 - args.tau) * target_param.data)

    envs.close()
    rb.close()  # commits; a run that ends without it commits at exit all the same


if __name__ == "__main__":
    main()
