"""TF-Agents DQN on CartPole with the replay buffer on disk, killed with SIGKILL and resumed.

    python examples/tf_agents_dqn.py --steps 2000 --dir runs/tfa-dqn

This is TF-Agents' DQN tutorial with one change: ``TFUniformReplayBuffer`` is
``mmreplay.compat.tf_agents.UniformReplayBuffer`` with a ``path``. The script runs the
training in a child process that kills itself with SIGKILL halfway (between two
checkpoints, as a crash would), then starts it again: ``common.Checkpointer`` restores
the agent and the step from the last checkpoint and checks the replay buffer, which
still holds every frame committed before the kill (more than the checkpoint saw, which
it says). The average return is printed before the kill, after the resume and at the end.
Needs TF-Agents 0.19 and TensorFlow 2.15 (docs/tf-agents.md, "Installing beside TF-Agents").
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile


def average_return(env, policy, episodes: int) -> float:
    total = 0.0
    for _ in range(episodes):
        time_step = env.reset()
        while not time_step.is_last():
            time_step = env.step(policy.action(time_step).action)
            total += float(time_step.reward.numpy()[0])
    return total / episodes


def train(args: argparse.Namespace) -> None:
    """The training process: resumes from ``args.dir`` if it holds a checkpoint."""
    import tensorflow as tf
    from tf_agents.agents.dqn import dqn_agent
    from tf_agents.drivers import dynamic_step_driver
    from tf_agents.environments import suite_gym, tf_py_environment
    from tf_agents.networks import q_network
    from tf_agents.policies import random_tf_policy
    from tf_agents.utils import common

    from mmreplay.compat.tf_agents import UniformReplayBuffer

    tf.random.set_seed(args.seed)
    env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
    eval_env = tf_py_environment.TFPyEnvironment(suite_gym.load("CartPole-v0"))
    q_net = q_network.QNetwork(env.observation_spec(), env.action_spec(), fc_layer_params=(64, 64))
    global_step = tf.Variable(0, dtype=tf.int64)
    agent = dqn_agent.DqnAgent(
        env.time_step_spec(),
        env.action_spec(),
        q_network=q_net,
        optimizer=tf.keras.optimizers.Adam(1e-3),
        td_errors_loss_fn=common.element_wise_squared_loss,
        target_update_period=50,
        train_step_counter=global_step,
    )
    agent.initialize()
    replay_buffer = UniformReplayBuffer(
        agent.collect_data_spec,
        batch_size=env.batch_size,
        max_length=100_000,
        path=os.path.join(args.dir, "replay"),
        commit_every=50,
        backend="hdf5",  # zarr-python 3 does not install beside TF-Agents 0.19
    )
    checkpointer = common.Checkpointer(  # restores the last checkpoint, if any
        ckpt_dir=os.path.join(args.dir, "checkpoint"),
        max_to_keep=1,
        agent=agent,
        policy=agent.policy,
        replay_buffer=replay_buffer,
        global_step=global_step,
    )
    step = int(global_step.numpy())
    if step:
        frames = int(replay_buffer.num_frames())
        print(f"resumed at step {step} with {frames} frames in the replay buffer", flush=True)
        print(f"return after the resume: {average_return(eval_env, agent.policy, args.eval_episodes):.1f}")
    else:
        random_policy = random_tf_policy.RandomTFPolicy(env.time_step_spec(), env.action_spec())
        dynamic_step_driver.DynamicStepDriver(
            env, random_policy, observers=[replay_buffer.add_batch], num_steps=args.initial_steps
        ).run()

    collect = common.function(
        dynamic_step_driver.DynamicStepDriver(
            env, agent.collect_policy, observers=[replay_buffer.add_batch], num_steps=1
        ).run
    )
    dataset = replay_buffer.as_dataset(sample_batch_size=64, num_steps=2).prefetch(3)
    iterator = iter(dataset)
    train_step = common.function(agent.train)
    time_step, policy_state = None, None
    while step < args.steps:
        time_step, policy_state = collect(time_step, policy_state)
        experience, _ = next(iterator)
        train_step(experience)
        step = int(global_step.numpy())
        if step % args.checkpoint_every == 0:
            checkpointer.save(global_step)
        if args.kill_at and step == args.kill_at:
            ret = average_return(eval_env, agent.policy, args.eval_episodes)
            print(f"return before the kill: {ret:.1f} at step {step}; SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"return at the end: {average_return(eval_env, agent.policy, args.eval_episodes):.1f} at step {step}")
    replay_buffer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps")
    parser.add_argument("--dir", default=None, help="run folder (default: a new temporary one)")
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--initial-steps", type=int, default=200, help="random steps collected first")
    parser.add_argument("--eval-episodes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train:
        train(args)
        return 0
    run_dir = args.dir or tempfile.mkdtemp(prefix="tfa-dqn-")
    # halfway, and not on a checkpoint: the resume starts from an older one
    every = args.checkpoint_every
    kill_at = args.steps // 2 // every * every + every // 2
    common = [sys.executable, os.path.abspath(__file__), "--train", "--dir", run_dir, "--steps", str(args.steps)]
    common += ["--checkpoint-every", str(args.checkpoint_every), "--initial-steps", str(args.initial_steps)]
    common += ["--eval-episodes", str(args.eval_episodes), "--seed", str(args.seed)]
    first = subprocess.run([*common, "--kill-at", str(kill_at)])
    if first.returncode != -signal.SIGKILL:
        print(f"the first run ended with {first.returncode}, not SIGKILL", file=sys.stderr)
        return 1
    print(f"killed with SIGKILL at step {kill_at}; starting again from {run_dir}", flush=True)
    return subprocess.run(common).returncode


if __name__ == "__main__":
    sys.exit(main())
