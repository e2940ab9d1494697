"""n-step returns, computed at sampling time from the stored one-step transitions.

For each drawn row ``(t, env)`` the window is the up to ``n`` steps ``t .. t+k-1`` of
the same env that stay in one episode and in the window drawn from: it ends at the
first step that terminated or was truncated, at the newest retained step, or after
``n`` steps. The batch then holds, in place of the row's own:

- ``reward``: ``sum(gamma**i * reward[t+i] for i < k)``;
- ``next_observation``: the next observation of step ``t+k-1``, the one to bootstrap from;
- ``terminated``: whether the window ended by termination (no bootstrap);
- ``truncated``: whether it ended by truncation;

and one field more, ``discount``: ``gamma**k`` (float32, shaped as the reward), the
discount the bootstrap takes. So ``target = reward + discount * (1 - terminated) * Q(next_observation)`` holds
for every row: a window that ended by truncation or at the newest step bootstraps.

The sums and discounts are computed as Stable-Baselines3's ``NStepReplayBuffer``
computes them (float32 ``gamma**i`` weights, summed along the window), so the two agree
bit for bit on the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import BadInputError
from ..roles import subtree
from ..spec import ArraySpec, leaf_paths
from .transform import DrawnBatch

__all__ = ["NStep"]

#: the field an n-step batch adds
DISCOUNT = "discount"
_NEEDED = ("reward", "terminated", "next_observation")


@dataclass(frozen=True)
class NStep:
    """n-step returns over a sample: ``store.sample(256, transform=mr.NStep(3, gamma=0.99))``.

    Args:
        n: steps summed at most, ``>= 1`` (1 gives the stored transitions, with ``discount``
            ``gamma``).
        gamma: the discount factor, in ``(0, 1]``.
        reward_map: applied to the rewards of each window before they are summed (such as
            a ``VecNormalize``'s ``normalize_reward``); None: the stored rewards.

    Raises:
        BadInputError: ``n`` or ``gamma`` out of range; at sampling, a store without the
            ``reward``, ``terminated`` and ``next_observation`` roles, or whose spec is
            not a dict or already has a ``discount`` field.
    """

    n: int
    gamma: float
    reward_map: Callable[[np.ndarray], np.ndarray] | None = None

    def __post_init__(self) -> None:
        n, gamma = self.n, self.gamma
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise BadInputError(f"NStep: n must be an int >= 1, got {n!r}")
        if (
            not isinstance(gamma, (int, float, np.floating, np.integer))
            or isinstance(gamma, bool)
            or not 0 < gamma <= 1
            or not math.isfinite(gamma)
        ):
            raise BadInputError(f"NStep: gamma must be a number in (0, 1], got {gamma!r}")
        object.__setattr__(self, "n", int(n))
        object.__setattr__(self, "gamma", float(gamma))

    def batch_spec(self, spec: Any, roles: Mapping[str, str]) -> Any:
        """The store's spec with ``discount`` added and the reward as a float."""
        missing = [role for role in _NEEDED if role not in roles]
        if missing:
            raise BadInputError(
                f"n-step returns need the {', '.join(map(repr, missing))} role(s); the store has "
                f"{', '.join(map(repr, sorted(roles))) or 'no roles'} (give roles= at create)"
            )
        if not isinstance(spec, Mapping):
            raise BadInputError(
                f"n-step returns add a {DISCOUNT!r} field to a dict spec; the store's spec is a "
                f"{type(spec).__name__}"
            )
        if DISCOUNT in spec:
            raise BadInputError(f"n-step returns add a {DISCOUNT!r} field; the store's spec has one already")
        reward = subtree(spec, roles["reward"])
        out = _replaced(dict(spec), roles["reward"], ArraySpec(reward.shape, _return_dtype(reward.dtype)))
        out[DISCOUNT] = ArraySpec(reward.shape, "float32")  # () or (1,), as the reward: they broadcast alike
        return out

    def __call__(self, batch: DrawnBatch) -> dict[str, np.ndarray]:
        roles = batch.store.roles
        step, env = batch.step, batch.env
        n, lead = self.n, step.shape
        offsets = np.arange(n, dtype=np.int64)
        newest = batch.window.end - 1
        window = np.minimum(step[..., None] + offsets, newest)  # [*lead, n], never past the window
        envs = env[..., None]

        def column(role: str) -> np.ndarray:
            return batch.read(roles[role], window, envs).reshape(*lead, n)

        terminated = column("terminated") != 0
        ended = terminated | (window == newest)  # the newest step ends the window as a truncation
        truncated_path = roles.get("truncated")
        if truncated_path is not None:
            truncated = column("truncated") != 0
            ended |= truncated
        last = np.where(ended.any(-1), ended.argmax(-1), n - 1)  # the window's last offset
        kept = offsets <= last[..., None]
        # as SB3's NStepReplayBuffer: float32 gamma**i weights, a masked sum along the window
        rewards = column("reward")
        if self.reward_map is not None:
            rewards = np.asarray(self.reward_map(rewards))
        dtype = _return_dtype(batch.rows[roles["reward"]].dtype)
        weights = self.gamma ** np.arange(n, dtype=dtype)
        returns = (rewards.astype(dtype, copy=False) * weights * kept).sum(-1)
        last_step = step + last
        pick = last[..., None]
        rows = batch.rows
        out = {
            path: batch.read(path, last_step, env)
            for path in _leaves_under(batch.store.spec, roles["next_observation"])
        }
        out |= {
            roles["reward"]: returns.reshape(rows[roles["reward"]].shape),
            roles["terminated"]: _like(np.take_along_axis(terminated, pick, -1), rows[roles["terminated"]]),
            DISCOUNT: (self.gamma ** (last + 1).astype(np.float32)).reshape(rows[roles["reward"]].shape),
        }
        if truncated_path is not None:
            out[truncated_path] = _like(np.take_along_axis(truncated, pick, -1), rows[truncated_path])
        return out


def _return_dtype(dtype: Any) -> np.dtype:
    """Returns are float: the reward's own float type, float32 for int or bool rewards."""
    dtype = np.dtype(dtype)
    return dtype if dtype.kind == "f" else np.dtype(np.result_type(dtype, np.float32))


def _leaves_under(spec: Any, path: str) -> list[str]:
    """The leaf paths of the role at ``path`` (a leaf, or a subtree such as a dict observation)."""
    node = subtree(spec, path)
    return [path] if isinstance(node, ArraySpec) else [f"{path}/{p}" for p in leaf_paths(node)]


def _like(flags: np.ndarray, drawn: np.ndarray) -> np.ndarray:
    """End flags in the drawn leaf's dtype and shape."""
    return flags.astype(drawn.dtype).reshape(drawn.shape)


def _replaced(spec: dict[str, Any], path: str, leaf: ArraySpec) -> dict[str, Any]:
    """``spec`` with the leaf at ``path`` replaced, copying the dicts on the way."""
    head, _, rest = path.partition("/")
    spec[head] = leaf if not rest else _replaced(dict(spec[head]), rest, leaf)
    return spec
