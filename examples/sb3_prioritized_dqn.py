"""Prioritized replay for Stable-Baselines3's DQN, the buffer and its priorities on disk.

SB3 has no prioritized replay. ``PrioritizedDQN`` is SB3's ``DQN`` whose buffer is an
mmreplay store created with ``sampler="prioritized"``: each batch is drawn in proportion
to ``priority ** alpha``, its Huber loss is weighted by the importance weights the
sampler gives (``beta`` annealed from ``beta0`` to 1 over the run), and the new
``|TD error|`` goes back to the store as the rows' priorities. Everything else is SB3's
``DQN.train``. Killed and restarted with the same ``--buffer``, the run resumes from the
data and the priorities on disk.

    python examples/sb3_prioritized_dqn.py --steps 20000 --buffer runs/cartpole-per
"""

from __future__ import annotations

import argparse

import gymnasium as gym
import numpy as np
import torch as th
import torch.nn.functional as F
from stable_baselines3 import DQN
from stable_baselines3.common.logger import Logger, configure

from mmreplay.compat.sb3 import ReplayBuffer


class PrioritizedDQN(DQN):
    """SB3's DQN with prioritized replay (Schaul et al., 2016) through an mmreplay store.

    Args:
        buffer_path: the buffer's folder (None: a temporary one).
        alpha: how strongly priorities skew the draw (0 is uniform).
        beta0: the importance-weight exponent at the start, annealed to 1.
        other arguments: SB3's ``DQN``.
    """

    def __init__(self, *args, buffer_path=None, alpha=0.6, beta0=0.4, **kwargs):
        kwargs["replay_buffer_class"] = ReplayBuffer
        kwargs["replay_buffer_kwargs"] = {"path": buffer_path, "sampler": "prioritized", "alpha": alpha}
        self.beta0 = beta0
        super().__init__(*args, **kwargs)

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        beta = self.beta0 + (1.0 - self.beta0) * min(1.0, 1.0 - self._current_progress_remaining)
        losses = []
        for _ in range(gradient_steps):
            data = self.replay_buffer.sample(batch_size, env=self._vec_normalize_env, beta=beta)
            weights = th.as_tensor(self.replay_buffer.last_info.weight, dtype=th.float32, device=self.device)
            with th.no_grad():
                next_q, _ = self.q_net_target(data.next_observations).max(dim=1)
                target = data.rewards + (1 - data.dones) * self.gamma * next_q.reshape(-1, 1)
            current = th.gather(self.q_net(data.observations), dim=1, index=data.actions.long())
            loss = (weights * F.smooth_l1_loss(current, target, reduction="none").squeeze(1)).mean()
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
            td = (target - current).detach().abs().squeeze(1).cpu().numpy()
            self.replay_buffer.update_priorities(td)  # the sampler adds its own small eps
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--buffer", default=None, help="buffer folder (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=None, help="folder for SB3's progress log (default: none)")
    args = parser.parse_args(argv)
    model = PrioritizedDQN(
        "MlpPolicy",
        gym.make("CartPole-v1"),
        buffer_path=args.buffer,
        buffer_size=50_000,
        learning_starts=min(1000, args.steps // 4),
        target_update_interval=500,
        exploration_fraction=0.3,
        seed=args.seed,
    )
    # without a logger of its own, every learn() makes an empty SB3-<date> folder in /tmp
    model.set_logger(configure(args.log, ["stdout", "csv"]) if args.log else Logger(None, []))
    model.learn(args.steps)
    model.replay_buffer.close()


if __name__ == "__main__":
    main()
