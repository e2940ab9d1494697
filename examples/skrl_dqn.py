"""skrl's DQN on CartPole with its replay memory on disk: killed with SIGKILL, resumed.

    python examples/skrl_dqn.py --demo --steps 20000        # run, kill -9 halfway, resume
    python examples/skrl_dqn.py --steps 20000 --run runs/skrl-dqn [--kill-at 10000]

skrl's own ``DQN`` agent trains from ``mmreplay.compat.skrl.RandomMemory`` (the only
change to skrl's CartPole example is the memory's import and ``path=``); the loop is
skrl's ``SequentialTrainer.train`` loop, written out so that it can start at a saved
timestep. Every ``--checkpoint-every`` steps the agent (``agent.save``) and the progress
are written atomically and the memory is committed. ``--kill-at T`` sends SIGKILL to
the process itself at step ``T``; started again with the same ``--run``, it loads the
agent, reopens the memory (its rows, ``memory_index`` and ``filled``, as of the last
commit) and carries on. ``--demo`` does both in child processes and prints the mean
return of the last episodes before the kill and at the end.
Needs ``pip install 'mmreplay[torch,gymnasium]' skrl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile

import gymnasium as gym
import numpy as np
import torch
from skrl.agents.torch.dqn import DQN, DQN_CFG
from skrl.envs.wrappers.torch import wrap_env
from skrl.models.torch import DeterministicMixin, Model
from torch import nn

from mmreplay.compat.skrl import RandomMemory


class QNetwork(DeterministicMixin, Model):
    def __init__(self, observation_space, action_space, device):
        Model.__init__(self, observation_space=observation_space, action_space=action_space, device=device)
        DeterministicMixin.__init__(self)
        self.net = nn.Sequential(
            nn.Linear(self.num_observations, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
            nn.Linear(64, action_space.n),
        )  # fmt: skip

    def compute(self, inputs, role=""):
        return self.net(inputs["observations"]), {}

    def random_act(self, inputs, *, role=""):
        # skrl 2.x draws random actions with gymnasium's batch_space(space, n).sample(),
        # which copies the space's generator without advancing it: every call would
        # return the same actions. Draw them from torch's generator instead.
        n = inputs["observations"].shape[0]
        return torch.randint(self.action_space.n, (n, 1), device=self.device), {}


def save_atomically(path: str, write) -> None:
    """Write through ``write(tmp)`` and rename, so a kill leaves the old or the new file."""
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def save_progress(path: str, progress: dict) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(progress, f)

    save_atomically(path, write)


def mean_return(returns: list[float], last: int = 10) -> float:
    return float(np.mean(returns[-last:])) if returns else float("nan")


def train(args: argparse.Namespace) -> None:
    os.makedirs(args.run, exist_ok=True)
    # progress.json names the agent file of its timestep and is replaced last: a kill
    # between the two writes resumes from the previous pair, never a mixed one
    progress_file = os.path.join(args.run, "progress.json")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a 64-unit network is fastest on one thread

    raw = gym.make("CartPole-v1")
    raw.reset(seed=args.seed)  # skrl's wrapper resets without a seed; this seeds the env's generator
    env = wrap_env(raw, wrapper="gymnasium")
    device = env.device
    memory = RandomMemory(
        memory_size=50_000, num_envs=env.num_envs, device=device, path=os.path.join(args.run, "memory"),
        commit_every=args.checkpoint_every,
    )  # fmt: skip
    models = {
        role: QNetwork(env.observation_space, env.action_space, device)
        for role in ("q_network", "target_q_network")
    }
    cfg = DQN_CFG()
    cfg.learning_starts = min(100, args.steps // 4)
    cfg.exploration_scheduler = lambda timestep, timesteps: max(math.exp(-10 * timestep / timesteps), 0.05)
    cfg.experiment.write_interval = 0  # no TensorBoard files
    cfg.experiment.checkpoint_interval = 0  # checkpoints are written below
    cfg.experiment.directory = args.run
    agent = DQN(
        models=models, memory=memory, cfg=cfg, observation_space=env.observation_space,
        state_space=env.state_space, action_space=env.action_space, device=device,
    )  # fmt: skip
    agent.init()

    start, returns = 0, []
    if os.path.exists(progress_file):
        with open(progress_file) as f:
            progress = json.load(f)
        agent.load(os.path.join(args.run, progress["agent"]))
        start, returns = progress["timestep"], progress["returns"]
        torch.manual_seed(args.seed + start)
        print(
            f"resumed at step {start}: the memory holds {len(memory)} rows "
            f"(memory_index {memory.memory_index}, filled {memory.filled}); "
            f"return before: {mean_return(returns):.1f}",
            flush=True,
        )

    agent.enable_training_mode(True)
    observations, _ = env.reset()
    states = env.state()
    episode = 0.0
    for timestep in range(start, args.steps):
        agent.pre_interaction(timestep=timestep, timesteps=args.steps)
        with torch.no_grad():
            actions, _ = agent.act(observations, states, timestep=timestep, timesteps=args.steps)
            next_observations, rewards, terminated, truncated, infos = env.step(actions)
            next_states = env.state()
            agent.record_transition(
                observations=observations, states=states, actions=actions, rewards=rewards,
                next_observations=next_observations, next_states=next_states, terminated=terminated,
                truncated=truncated, infos=infos, timestep=timestep, timesteps=args.steps,
            )  # fmt: skip
        agent.post_interaction(timestep=timestep, timesteps=args.steps)
        episode += float(rewards.sum())
        if terminated.any() or truncated.any():
            returns.append(episode)
            episode = 0.0
            with torch.no_grad():
                observations, _ = env.reset()
                states = env.state()
        else:
            observations, states = next_observations, next_states

        done = timestep + 1
        if done % args.checkpoint_every == 0:
            memory.store.commit()  # the rows of every step so far are durable
            agent_file = f"agent-{done}.pt"
            save_atomically(os.path.join(args.run, agent_file), agent.save)
            save_progress(progress_file, {"timestep": done, "returns": returns, "agent": agent_file})
            for old in os.listdir(args.run):  # the agents of earlier checkpoints
                if old.startswith("agent-") and old.endswith(".pt") and old != agent_file:
                    os.remove(os.path.join(args.run, old))
        if done == args.kill_at:
            print(f"killed at step {done}: return before: {mean_return(returns):.1f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    print(f"return after: {mean_return(returns):.1f}", flush=True)
    print(
        f"done: {args.steps} steps, {len(returns)} episodes; the memory holds {len(memory)} rows", flush=True
    )
    memory.close()


def demo(args: argparse.Namespace) -> None:
    """Run in a child process killed with SIGKILL halfway, then resume in another."""
    run = args.run or os.path.join(tempfile.mkdtemp(), "skrl-dqn")
    if os.path.exists(os.path.join(run, "progress.json")):  # the first child would resume, not be killed
        sys.exit(
            f"--demo starts a new run, but {run} holds one (progress.json): give another --run, "
            "or leave out --demo to resume it"
        )
    kill_at = args.kill_at or args.steps // 2
    command = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--run", run,
               "--seed", str(args.seed), "--checkpoint-every", str(args.checkpoint_every)]  # fmt: skip
    first = subprocess.run([*command, "--kill-at", str(kill_at)])
    if first.returncode != -signal.SIGKILL:
        sys.exit(f"expected the first run to be killed with SIGKILL, got exit code {first.returncode}")
    print("first run ended by SIGKILL; resuming", flush=True)
    second = subprocess.run(command)
    sys.exit(second.returncode)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000, help="environment steps in all")
    parser.add_argument("--run", default=None, help="run folder: memory, agent checkpoint, progress")
    parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process at this step")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--demo", action="store_true", help="run, kill -9 halfway, resume")
    args = parser.parse_args(argv)
    if args.demo:
        demo(args)
    elif args.run is None:
        parser.error("--run is required (or --demo)")
    else:
        train(args)


if __name__ == "__main__":
    main()
