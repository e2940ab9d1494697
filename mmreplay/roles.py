"""Roles: which part of the spec is the observation, the action, the reward, the ends.

Episodes, episode-aware sampling and the exports need to know them. They are inferred
from the usual top-level names, may be given explicitly at creation, and are recorded in
the metadata. A role names a top-level key of the spec, or a ``/``-joined path to a
subtree or leaf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .errors import SpecError
from .spec import ArraySpec, is_namedtuple, leaf_paths

__all__ = ["ROLES", "infer_roles", "validate_roles", "subtree"]

#: Role name -> usual spec keys, in order of preference.
ROLES: dict[str, tuple[str, ...]] = {
    "observation": ("obs", "observation", "observations", "state", "states"),
    "next_observation": (
        "next_obs",
        "next_observation",
        "next_observations",
        "next_state",
        "next_states",
    ),
    "action": ("action", "actions", "act"),
    "reward": ("reward", "rewards", "rew"),
    "terminated": ("terminated", "terminations", "terminals", "terminal", "done", "dones"),
    "truncated": ("truncated", "truncations", "timeouts", "timeout"),
    "step_type": ("step_type",),
    "next_step_type": ("next_step_type",),
    "discount": ("discount", "discounts"),
}


def _top_keys(spec: Any) -> list[str]:
    if isinstance(spec, Mapping):
        return list(spec)
    if is_namedtuple(spec):
        return list(spec._fields)
    return []


def infer_roles(spec: Any) -> dict[str, str]:
    """Roles found among the spec's top-level names."""
    keys = _top_keys(spec)
    firsts = {role: next((name for name in names if name in keys), None) for role, names in ROLES.items()}
    return {role: name for role, name in firsts.items() if name is not None}


def subtree(spec: Any, path: str) -> Any:
    """The node of ``spec`` at a ``/``-joined path (raises KeyError when absent)."""
    node = spec
    for part in path.split("/"):
        if isinstance(node, Mapping):
            node = node[part]
        elif is_namedtuple(node) and part in node._fields:
            node = getattr(node, part)
        elif isinstance(node, (tuple, list)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise KeyError(path)
    return node


def validate_roles(spec: Any, roles: Mapping[str, str] | None) -> dict[str, str]:
    """Inferred roles overridden by the given ones, each checked against the spec."""
    out = infer_roles(spec)
    if roles is not None and not isinstance(roles, Mapping):
        raise SpecError(f"roles must map a role to a leaf path, e.g. {{'reward': 'r'}}; got {roles!r:.80}")
    for role, path in (roles or {}).items():
        if role not in ROLES:
            raise SpecError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if path is None:
            out.pop(role, None)
            continue
        if not isinstance(path, str):
            raise SpecError(f"role {role!r} must name a leaf path (a string) or None, got {path!r:.80}")
        out[role] = path
    for role, path in out.items():
        try:
            node = subtree(spec, path)
        except KeyError:
            raise SpecError(
                f"role {role!r} names {path!r}, which is not in the spec "
                f"(leaves: {', '.join(leaf_paths(spec))})"
            ) from None
        # a role found from a name the user did not mean as one: say how to keep the leaf
        hint = f" (found from its name: pass roles={{{role!r}: None}} to store it without the role)"
        hint = "" if role in (roles or {}) else hint
        if role in ("terminated", "truncated", "reward", "discount", "step_type", "next_step_type"):
            if not isinstance(node, ArraySpec) or node.shape not in ((), (1,)):
                raise SpecError(f"role {role!r} needs a scalar leaf, but {path!r} is {node!r:.80}{hint}")
            if role in ("step_type", "next_step_type") and not np.issubdtype(node.dtype, np.integer):
                raise SpecError(f"role {role!r} needs an integer leaf, {path!r} is {node.dtype}{hint}")
    return out
