"""Hindsight goal relabelling (HER) of a drawn batch of transitions.

A goal-conditioned spec has an observation and a next observation that are dicts holding
``achieved_goal`` and ``desired_goal`` (and usually ``observation``), as gymnasium-robotics'
environments and SB3's ``BitFlippingEnv`` return. A fraction of the drawn transitions
get a new desired goal, in the observation and the next observation: the goal achieved
(``next_observation/achieved_goal``) at a step of the same env and episode picked by the
strategy, and the reward the environment's ``compute_reward(achieved_goal, desired_goal,
info)`` gives the transition for it, called once per batch on arrays (vectorised, with
an empty info dict per transition), as SB3 calls it.

Strategies (SB3's and the HER paper's): ``"future"`` a step from this one to the
episode's last (this one included, as in SB3), ``"final"`` the episode's last step,
``"episode"`` any step of the episode. The episode bounds come from the store's episode
index: they hold after a crash and a resume (the resumed writer ends the episodes left
open), and on a wrapped ring (an episode whose start the ring overwrote starts at its
oldest retained step). An episode still running at the newest step ends, for the goals,
at that step: its transitions are relabelled with goals it has achieved so far.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..errors import BadInputError
from ..spec import flatten, leaf_paths
from .transform import DrawnBatch

__all__ = [
    "STRATEGIES",
    "GoalLeaves",
    "Hindsight",
    "check_strategy",
    "goal_leaves",
    "goal_paths",
    "goal_steps",
    "relabel",
    "reward_function",
]

STRATEGIES = ("future", "final", "episode")

#: what ``compute_reward`` is called with, as SB3 calls it: (achieved, desired, infos) -> rewards
RewardFunction = Callable[[np.ndarray, np.ndarray, list], Any]


def reward_function(env: Any) -> RewardFunction:
    """The vectorised ``compute_reward`` of ``env``: a gymnasium goal env (wrapped or not),
    an SB3 ``VecEnv`` of them (its first env's, through ``env_method`` as SB3 calls it),
    or the function itself.

    Raises:
        BadInputError: ``env`` has no ``compute_reward``.
    """
    if hasattr(env, "env_method") and hasattr(env, "has_attr"):  # an SB3 VecEnv
        if env.has_attr("compute_reward"):
            return lambda achieved, desired, infos: env.env_method(
                "compute_reward", achieved, desired, infos, indices=[0]
            )[0]
    else:
        get = getattr(env, "get_wrapper_attr", None)  # gymnasium wrappers do not forward attributes
        try:
            fn = get("compute_reward") if get is not None else getattr(env, "compute_reward", None)
        except AttributeError:
            fn = None
        if fn is None and callable(env) and not hasattr(env, "step"):
            fn = env
        if callable(fn):
            return fn
    raise BadInputError(
        "hindsight relabelling needs an env with compute_reward(achieved_goal, desired_goal, info) "
        f"(a gymnasium goal env, an SB3 VecEnv of them) or that function; got {type(env).__name__}, "
        "which has no compute_reward"
    )


def check_strategy(strategy: Any) -> str:
    """``strategy`` as one of :data:`STRATEGIES` (any case; an SB3 ``GoalSelectionStrategy`` too)."""
    name = getattr(strategy, "name", strategy)
    if isinstance(name, str) and name.lower() in STRATEGIES:
        return name.lower()
    raise BadInputError(f"goal selection strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")


def check_fraction(fraction: Any) -> float:
    """``fraction`` as a float in [0, 1]."""
    if isinstance(fraction, (int, float, np.integer, np.floating)) and not isinstance(fraction, bool):
        if 0.0 <= float(fraction) <= 1.0:
            return float(fraction)
    raise BadInputError(
        f"the fraction of transitions to relabel must be a number in [0, 1]; got {fraction!r}"
    )


class GoalLeaves(NamedTuple):
    """The leaf paths relabelling reads and writes."""

    desired: str  # observation/desired_goal
    next_desired: str  # next_observation/desired_goal
    next_achieved: str  # next_observation/achieved_goal: the goals relabelling draws from
    reward: str


def goal_paths(roles: Mapping[str, str]) -> GoalLeaves:
    """Where a goal-conditioned spec with these roles keeps its goals and reward."""
    obs = roles.get("observation", "observation")
    nxt = roles.get("next_observation", "next_observation")
    return GoalLeaves(
        f"{obs}/desired_goal", f"{nxt}/desired_goal", f"{nxt}/achieved_goal", roles.get("reward", "reward")
    )


def goal_leaves(spec: Any, roles: Mapping[str, str]) -> GoalLeaves:
    """The goal and reward leaves of a goal-conditioned spec, found through its roles.

    Raises:
        BadInputError: a leaf is missing, the goals differ in shape, or an achieved goal
            would not fit a desired goal's dtype (a float goal cast to ints, truncated).
    """
    goal = goal_paths(roles)
    paths = leaf_paths(spec)
    missing = [p for p in goal if p not in paths]
    if missing:
        raise BadInputError(
            f"hindsight relabelling needs the leaves {', '.join(map(repr, goal))} (an observation and a next "
            f"observation holding achieved_goal and desired_goal, and a reward); the spec has no "
            f"{', '.join(map(repr, missing))} (its leaves: {', '.join(paths)})"
        )
    leaves = dict(zip(paths, flatten(spec)))
    shapes = {p: leaves[p].shape for p in goal[:3]}
    if len(set(shapes.values())) != 1:
        raise BadInputError(f"hindsight relabelling needs goals of one shape; got {shapes}")
    achieved = leaves[goal[2]].dtype
    for desired in goal[:2]:
        if not np.can_cast(achieved, leaves[desired].dtype, "same_kind"):
            raise BadInputError(
                f"hindsight relabelling writes {goal[2]!r} ({achieved}) into {desired!r} "
                f"({leaves[desired].dtype}), which would change its values; give both goals one dtype"
            )
    return goal


def goal_steps(
    strategy: str, steps: np.ndarray, first: np.ndarray, last: np.ndarray, integers: Callable[..., np.ndarray]
) -> np.ndarray:
    """The step whose achieved goal each transition is relabelled with, drawn with
    ``integers(low, high)`` (``Generator.integers``, or ``np.random.randint`` as SB3 draws).

    The draws are SB3's, call for call: ``future`` one ``integers(step - first, length)``,
    ``episode`` one ``integers(0, length)``, ``final`` none.
    """
    if strategy == "final":
        return last.copy()
    length = last - first + 1
    if strategy == "future":
        return first + integers(steps - first, length)
    return first + integers(0, length)


def relabel(
    leaves: Mapping[str, np.ndarray],
    goal: GoalLeaves,
    items: np.ndarray,
    goals: np.ndarray,
    reward_fn: RewardFunction,
) -> None:
    """Give the batch's ``items`` the desired goal ``goals`` (observation and next
    observation) and the reward ``reward_fn`` computes for it, in place; ``reward_fn`` is
    not called for no items (goal envs such as SB3's ``BitFlippingEnv`` fail on zero goals)."""
    if not len(items):
        return
    leaves[goal.desired][items] = goals
    leaves[goal.next_desired][items] = goals
    achieved = leaves[goal.next_achieved][items]
    got = reward_fn(achieved, goals, [{} for _ in range(len(items))])
    rewards = np.asarray(got)
    target = leaves[goal.reward]
    shape = (len(items), *target.shape[1:])
    cast = rewards.astype(target.dtype, copy=False) if rewards.dtype.kind in "biuf" else None
    lossy = cast is not None and target.dtype.kind != "f" and not np.array_equal(cast, rewards)
    if cast is None or cast.size != math.prod(shape) or lossy:  # (an int or bool reward leaf: exactly)
        what = f"{rewards.dtype} {rewards.shape}" if rewards.dtype != object else type(got).__name__
        raise BadInputError(
            f"compute_reward(achieved_goal {achieved.shape}, desired_goal {goals.shape}, infos) returned {what}; "
            f"hindsight relabelling calls it on a batch and needs one number per transition, {shape}, that "
            f"the {goal.reward!r} leaf ({target.dtype}) holds"
        )
    target[items] = cast.reshape(shape)


@dataclass(frozen=True)
class Hindsight:
    """Goal relabelling over a sample: ``store.sample(256, transform=mr.Hindsight(env))``.

    Each drawn transition is relabelled with probability ``fraction``: its desired goal
    (observation and next observation) becomes the goal achieved at a step of its episode
    picked by ``strategy``, its reward what ``compute_reward`` gives for it. The others
    are the stored transitions.

    Args:
        env: what gives the rewards: a gymnasium goal env (wrapped or not), an SB3
            ``VecEnv`` of them, or ``compute_reward(achieved_goal, desired_goal, infos)``
            itself (vectorised).
        strategy: ``"future"`` (the default), ``"final"`` or ``"episode"``.
        fraction: the probability that a transition is relabelled, in [0, 1] (0.8, SB3's
            ``n_sampled_goal=4``, by default).

    Raises:
        BadInputError: no ``compute_reward``, an unknown strategy, a fraction outside
            [0, 1]; at sampling, a spec without the goal leaves, or sequences
            (``num_steps``): it relabels transitions.
    """

    env: Any = field(compare=False)
    strategy: str = "future"
    fraction: float = 0.8
    reward_fn: RewardFunction = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", check_strategy(self.strategy))
        object.__setattr__(self, "fraction", check_fraction(self.fraction))
        object.__setattr__(self, "reward_fn", reward_function(self.env))

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to Ray actors, say) without the bound reward function, found again on load."""
        return {"env": self.env, "strategy": self.strategy, "fraction": self.fraction}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "reward_fn", reward_function(self.env))

    def batch_spec(self, spec: Any, roles: Mapping[str, str]) -> Any:
        """The store's spec (relabelling changes values, not leaves), once its goal leaves are checked."""
        goal_leaves(spec, roles)
        return spec

    def __call__(self, batch: DrawnBatch) -> dict[str, np.ndarray]:
        step, env = batch.step, batch.env
        if step.ndim != 1:
            raise BadInputError("hindsight relabelling relabels transitions: sample without num_steps")
        goal = goal_paths(batch.store.roles)  # checked by batch_spec
        # the drawn rows stay as drawn (a reader may run this again over them)
        leaves = {path: batch.rows[path].copy() for path in (goal.desired, goal.next_desired, goal.reward)}
        leaves[goal.next_achieved] = batch.rows[goal.next_achieved]
        items = np.flatnonzero(batch.rng.random(len(step)) < self.fraction)
        steps, envs = step[items], env[items]
        first, last, _ = batch.store.episode_bounds(steps, envs)
        first = np.maximum(first, batch.window.first)  # a caller's narrower window
        last = np.minimum(last, batch.window.end - 1)
        goal_at = goal_steps(self.strategy, steps, first, last, batch.rng.integers)
        relabel(leaves, goal, items, batch.read(goal.next_achieved, goal_at, envs), self.reward_fn)
        del leaves[goal.next_achieved]
        return leaves
