"""What the read path reads of a store and of the sampler it draws through.

The read path sits below the backends and the samplers, which hand it leaves, a store
and a sampler as values of these protocols: :class:`mmreplay.Store` is a
:class:`Readable`, every sampler a :class:`Drawing`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .draws import Draw, Window


class Drawing(Protocol):
    """A sampler as the gather uses it (the contract: :mod:`mmreplay.samplers.base`)."""

    num_steps: int | None  # the sequence length of a ``sample`` without num_steps
    options: frozenset[str]  # the names of the request's options it reads
    draw: Callable[..., Draw]  # (window, request, size, steps, rng)


class Readable(Protocol):
    """A store as the read path reads it."""

    path: str
    mode: str  # "r": a reader, which checks after reading that its rows were retained
    closed: bool
    capacity: int
    num_envs: int
    spec: Any
    roles: dict[str, str]  # role -> path in the spec (mmreplay.roles)
    leaves: list[Any]  # the leaves read, in flatten order (mmreplay.backends.base.Leaf)
    stored_leaves: list[Any]  # the leaves as kept on disk, for page-cache advice
    location: Any  # object storage: reads the ranges of every leaf together; None locally
    window: Window  # the steps retained now
    state: Any  # the committed state (mmreplay.statefile.State), new at each commit a reader sees
    total_steps: int
    sampler: Drawing

    def check_open(self) -> None: ...  # ClosedError once closed
    def live_first(self) -> int: ...  # the oldest step the writer retains now
    def refresh(self) -> bool: ...  # a reader's window moved to the newest commit
    def part(self, name: str, make: Callable[[Any], Any]) -> Any: ...  # the read state, made once
    def episode_bounds(self, steps: Any, envs: Any) -> tuple[Any, Any, Any]: ...  # (first, last, complete)
