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
discount the bootstrap takes. So for every row
``target = reward + discount * (1 - terminated) * Q(next_observation)``: a window that
ended by truncation or at the newest step bootstraps.

The sums and discounts are computed as Stable-Baselines3's ``NStepReplayBuffer``
computes them (float32 ``gamma**i`` weights, summed along the window), so the two agree
bit for bit on the same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BadInputError
from ..roles import subtree
from ..spec import ArraySpec
from .request import number
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
        gamma: the discount factor, in ``[0, 1]`` (0: the one-step reward, never bootstrapped).
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
    # made once: the window's offsets, and gamma**i / gamma**k as SB3 computes them (float32)
    _offsets: np.ndarray = field(init=False, compare=False, repr=False)
    _weights: np.ndarray = field(init=False, compare=False, repr=False)
    _discounts: np.ndarray = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        n, gamma = self.n, self.gamma
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise BadInputError(f"NStep: n must be an int >= 1, got {n!r}")
        object.__setattr__(self, "n", int(n))
        object.__setattr__(self, "gamma", number("NStep: gamma", gamma, 0, 1, BadInputError))
        object.__setattr__(self, "_offsets", np.arange(self.n, dtype=np.int64))
        object.__setattr__(self, "_weights", self.gamma ** np.arange(self.n, dtype=np.float32))
        object.__setattr__(self, "_discounts", self.gamma ** np.arange(1, self.n + 1, dtype=np.float32))

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
        roles, rows = batch.store.roles, batch.rows
        step, env = batch.step, batch.env
        n, lead = self.n, step.shape
        newest = batch.window.end - 1
        window = step[..., None] + self._offsets
        np.minimum(window, newest, out=window)  # [*lead, n], never past the window
        ids = batch.row_ids(window, env[..., None])

        def column(path: str) -> np.ndarray:
            return batch.take(path, ids).reshape(*lead, n)

        end_paths = [roles[role] for role in ("terminated", "truncated") if role in roles]
        ended = window == newest  # the newest step ends it too
        for path in end_paths:
            ended |= _flags(column(path))
        ended[..., -1] = True  # or its n-th step
        last = ended.argmax(-1)  # the offset of the window's last step
        # as SB3's NStepReplayBuffer: float32 gamma**i weights, a masked sum along the window
        reward = rows[roles["reward"]]
        rewards = column(roles["reward"])
        if self.reward_map is not None:
            mapped = np.asarray(self.reward_map(rewards))
            if mapped.shape != rewards.shape or mapped.dtype.kind not in "biuf":
                raise BadInputError(
                    f"NStep: reward_map must return one number per reward it is given, "
                    f"{rewards.shape}; it returned {mapped.dtype} {mapped.shape}"
                )
            rewards = mapped
        dtype = _return_dtype(reward.dtype)
        weights = self._weights if dtype == np.float32 else self.gamma ** self._offsets.astype(dtype)
        returns = (rewards.astype(dtype, copy=False) * weights * (self._offsets <= last[..., None])).sum(-1)
        # the next observation and the ends of each window's last step
        nxt = roles["next_observation"]
        last_ids = batch.row_ids(step + last, env)
        out = {path: batch.take(path, last_ids) for path in rows if path == nxt or path.startswith(nxt + "/")}
        out.update({path: batch.take(path, last_ids) for path in end_paths})
        out[roles["reward"]] = returns.reshape(reward.shape)
        out[DISCOUNT] = self._discounts[last].reshape(reward.shape)
        return out


def _flags(column: np.ndarray) -> np.ndarray:
    """End flags as bools (a float ``done`` leaf too)."""
    return column if column.dtype == np.bool_ else column != 0


def _return_dtype(dtype: Any) -> np.dtype:
    """Returns are float: the reward's own float type, float32 for int or bool rewards."""
    dtype = np.dtype(dtype)
    return dtype if dtype.kind == "f" else np.dtype(np.float32)


def _replaced(spec: dict[str, Any], path: str, leaf: ArraySpec) -> dict[str, Any]:
    """``spec`` with the leaf at ``path`` replaced, copying the dicts on the way."""
    head, _, rest = path.partition("/")
    spec[head] = leaf if not rest else _replaced(dict(spec[head]), rest, leaf)
    return spec
