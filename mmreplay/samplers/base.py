"""The sampler protocol: how a store turns a sample request, a window and an rng into rows.

A store draws every random batch through one sampler object (``store.sampler``); the
fetch path in :mod:`mmreplay.read.gather` then gathers the rows, advises the page cache,
prefetches and, in readers, re-draws items the writer overwrote. A sampler never reads
or writes leaf data itself. The registry that names samplers is
:mod:`mmreplay.samplers.registry`.

Contract
--------
``draw(window, request, size, steps, rng) -> Draw``
    Return ``size`` items (without replacement, ``request.replacement`` False: at most
    the number of valid items) whose ``steps`` consecutive steps all lie in
    ``[window.first, window.end)`` of one env. ``request`` is the caller's
    :class:`~mmreplay.read.request.SampleRequest`: a sampler reads what it understands
    (``within_episodes``, its own ``options`` such as ``beta``, which it names in
    ``options``) and refuses with ``ValueError`` what it cannot draw; ``size`` and
    ``steps`` are the request's batch size and resolved sequence length, except that
    ``draw`` may be called again for a subset of a batch (a reader's re-draw), with the
    window moved forward. The :class:`~mmreplay.read.draws.Draw` holds the row id of
    each item's first step (``start``: ``slot * num_envs + env``, possibly not folded
    into the ring, ``< 2 * capacity * num_envs``), its global flat id (``flat``:
    ``step * num_envs + env``, hence ``step`` and ``env``) and the probability of
    drawing it in one draw (``probability``). All randomness comes from ``rng`` (a
    ``numpy.random.Generator``), so a seeded rng and an unchanged window give the same
    draw. Raise :class:`~mmreplay.NotEnoughDataError` when nothing can be drawn.

``options``
    The names of the ``request.options`` the sampler reads; the read path refuses any
    other with ``TypeError`` before it draws.

``window``
    A :class:`Window`: ``first`` (oldest retained global step id), ``end`` (one past
    the newest step this store sees: in a writer every step it added, in a reader the
    committed end), ``num_envs``, ``capacity``.

Write hooks (no-op defaults, see :class:`mmreplay.hooks.WriteHook`)
    ``on_add(first_step, count)`` after steps ``[first_step, first_step + count)`` are
    written (not yet committed); ``on_commit(old_end, new_end, fsync)`` before the state
    write that commits steps ``[old_end, new_end)``: whatever the sampler persists for
    them must be on disk (fsynced with ``fsync``) when it returns; ``on_set(steps)``
    after stored steps are overwritten in place; ``on_clear(end)`` after every step
    before ``end`` is dropped. Hooks run in the writer only.

``attach(store)``
    Called once when the store opens (writer or reader), before any other call; the
    sampler keeps the store (:class:`Host`: ``path``, ``capacity``, ``num_envs``,
    ``mode``, ``window``...) as ``self.store`` until ``close()``, when the store closes.

``mass(window, request, steps) -> Mass``
    The total draw weight of the window's valid starts and the smallest weight of one
    (uniform: their count, and 1), for the items ``draw`` would draw for ``request``,
    so that a group of stores can split a batch between them in proportion and
    renormalise importance weights over all of them.

``update_priorities(step, env, priorities)``
    Samplers that keep priorities accept the learner's new priorities for items by
    global step id and env; the default raises ``TypeError``.

``state_json() -> dict`` / ``from_json(obj) -> Sampler``
    The sampler's name and parameters as JSON values (no arrays: data a sampler keeps
    per row goes into its own files under the store's folder). The store records
    ``state_json()`` in its metadata at create and rebuilds the sampler with
    :func:`sampler_from_json` at open. ``name`` picks the class from the registry
    (:func:`~mmreplay.samplers.registry.register_sampler`).

``num_steps``
    The sequence length a ``sample`` without ``num_steps`` returns (None: single steps).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np
from numpy.random import Generator

from ..hooks import WriteHook
from ..read.draws import Draw, Window
from ..read.request import SampleRequest

__all__ = ["Draw", "Host", "Mass", "Sampler", "Window"]


class Host(Protocol):
    """What a sampler reads of the store it is attached to."""

    path: str
    mode: str
    capacity: int
    num_envs: int
    window: Window
    first_step: int
    total_steps: int
    committed_steps: int

    def live_first(self) -> int: ...  # the oldest step the writer retains now
    def part(self, name: str, make: Callable[[Any], Any]) -> Any: ...  # (the episode index)


class Mass(NamedTuple):
    """What a sampler would draw from: the total weight of the valid starts and the
    smallest positive weight of one (0 and inf when there is none)."""

    total: float
    smallest: float


class Sampler(WriteHook, ABC):
    """Base class of samplers: the hooks are no-ops, ``draw`` must be given."""

    name: ClassVar[str] = ""
    options: ClassVar[frozenset[str]] = frozenset()
    num_steps: int | None = None
    store: Host | None = None

    def attach(self, store: Host) -> None:
        """Called when the store opens; see the module docstring."""
        self.store = store

    def close(self) -> None:
        """Called when the store closes."""
        self.store = None

    @abstractmethod
    def draw(self, window: Window, request: SampleRequest, size: int, steps: int, rng: Generator) -> Draw:
        """Where the batch's items start (see the module docstring)."""

    def mass(self, window: Window, request: SampleRequest, steps: int) -> Mass:
        """Every start whose ``steps`` steps lie in the window weighs 1."""
        count = max(0, window.steps - steps + 1) * window.num_envs
        return Mass(float(count), 1.0 if count else np.inf)

    def update_priorities(self, step: Any, env: Any, priorities: Any) -> None:
        raise TypeError(f"the {self.name or type(self).__name__!r} sampler keeps no priorities")

    def check_update(self, step: Any, env: Any, priorities: Any) -> Any:
        """Raise for what :meth:`update_priorities` would refuse, writing nothing: how a
        group checks every shard's part of an update before it applies any."""

    def state_json(self) -> dict[str, Any]:
        """``{"name": ..., **parameters}``: what :meth:`from_json` takes back."""
        return {"name": self.name}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Sampler:
        params = {k: v for k, v in obj.items() if k != "name"}
        return cls(**params)
