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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ..errors import BadInputError, SpecMismatchError
from ..spec import flatten, leaf_paths

__all__ = ["STRATEGIES", "GoalLeaves", "Hindsight", "goal_leaves", "goal_steps", "relabel", "reward_function"]

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
    raise BadInputError(f"the fraction of transitions to relabel must be a number in [0, 1]; got {fraction!r}")


class GoalLeaves(NamedTuple):
    """Where the goals and the reward are among a batch's leaves (flatten order)."""

    desired: int  # observation/desired_goal
    next_desired: int  # next_observation/desired_goal
    next_achieved: int  # next_observation/achieved_goal: the goals relabelling draws from
    reward: int


def goal_leaves(spec: Any, roles: Mapping[str, str]) -> GoalLeaves:
    """The goal and reward leaves of a goal-conditioned spec, found through its roles.

    Raises:
        SpecMismatchError: a leaf is missing, or the goals differ in shape.
    """
    obs = roles.get("observation", "observation")
    nxt = roles.get("next_observation", "next_observation")
    wanted = GoalLeaves(f"{obs}/desired_goal", f"{nxt}/desired_goal", f"{nxt}/achieved_goal", roles.get("reward", "reward"))
    paths = leaf_paths(spec)
    missing = [p for p in wanted if p not in paths]
    if missing:
        raise SpecMismatchError(
            f"hindsight relabelling needs the leaves {', '.join(map(repr, wanted))} (an observation and a next "
            f"observation holding achieved_goal and desired_goal, and a reward); the spec has no "
            f"{', '.join(map(repr, missing))} (its leaves: {', '.join(paths)})"
        )
    leaves = dict(zip(paths, flatten(spec)))
    shapes = {p: leaves[p].shape for p in wanted[:3]}
    if len(set(shapes.values())) != 1:
        raise SpecMismatchError(f"hindsight relabelling needs goals of one shape; got {shapes}")
    return GoalLeaves(*(paths.index(p) for p in wanted))


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
    leaves: list[np.ndarray], goal: GoalLeaves, items: np.ndarray, goals: np.ndarray, reward_fn: RewardFunction
) -> None:
    """Give the batch's ``items`` the desired goal ``goals`` (observation and next
    observation) and the reward ``reward_fn`` computes for it, in place."""
    leaves[goal.desired][items] = goals
    leaves[goal.next_desired][items] = goals
    achieved = leaves[goal.next_achieved][items]
    rewards = np.asarray(reward_fn(achieved, goals, [{} for _ in range(len(items))]))
    target = leaves[goal.reward]
    target[items] = rewards.astype(target.dtype, copy=False).reshape((len(items), *target.shape[1:]))


@dataclass(frozen=True)
class Hindsight:
    """Relabel a fraction of each drawn batch with goals achieved later in its episodes.

    Args:
        env: what gives the rewards: a gymnasium goal env, an SB3 ``VecEnv``, or
            ``compute_reward(achieved_goal, desired_goal, infos)`` itself (vectorised).
        strategy: ``"future"`` (default), ``"final"`` or ``"episode"``.
        fraction: the share of transitions relabelled, each drawn with this probability
            (SB3's ``n_sampled_goal=4`` is 0.8, the default).

    Raises:
        BadInputError: no ``compute_reward``, an unknown strategy, a fraction outside [0, 1].
    """

    env: Any = field(compare=False)
    strategy: str = "future"
    fraction: float = 0.8
    reward_fn: RewardFunction = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", check_strategy(self.strategy))
        object.__setattr__(self, "fraction", check_fraction(self.fraction))
        object.__setattr__(self, "reward_fn", reward_function(self.env))
