"""What a caller asks of the read path, built and checked once at the top.

``Store.sample``, ``Group.sample``, the Ray sampler and the framework layers build one
:class:`SampleRequest` with :meth:`SampleRequest.build`, which refuses bad sizes and
options with one-line errors. Every layer under it reads the request as a value: a group
splits it into one per shard with :func:`dataclasses.replace`, Ray ships it to its
actors, and nothing checks it again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["SampleRequest", "as_generator", "flag", "number", "positive", "step_range"]


def positive(name: str, value: Any, allow_none: bool = False) -> Any:
    """``value`` as an int >= 1 (or None where allowed); ValueError naming ``name`` otherwise."""
    if value is None and allow_none:
        return None
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def flag(name: str, value: Any) -> bool:
    """``value`` as a bool (a numpy bool too); TypeError naming ``name`` otherwise (a string such
    as ``"no"`` would read as true)."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, (int, np.integer)) and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r:.60}")


def number(name: str, value: Any, lo: float, hi: float = math.inf, error: type[Exception] = ValueError) -> float:
    """``value`` as a finite float in ``[lo, hi]``; ``error`` naming ``name`` otherwise."""
    if (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and lo <= value <= hi
    ):
        return float(value)
    bounds = f"a number in [{lo:g}, {hi:g}]" if hi < math.inf else f"a finite number >= {lo:g}"
    raise error(f"{name} must be {bounds}, got {value!r}")


def step_range(name: str, value: Any) -> tuple[int, int]:
    """``value`` as a pair of int global step ids ``(first, end)``; ValueError naming ``name`` otherwise."""
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
    ):
        return int(value[0]), int(value[1])
    raise ValueError(f"{name} must be a pair of int global step ids (first, end), got {value!r}")


def as_generator(rng: Any) -> np.random.Generator:
    """A numpy Generator from an int seed, a Generator, or None (fresh OS entropy)."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, (int, np.integer)) and not isinstance(rng, bool)):
        return np.random.default_rng(rng)
    raise TypeError(f"rng must be an int seed, None or a numpy.random.Generator, got {type(rng).__name__}")


@dataclass(frozen=True)
class SampleRequest:
    """One random batch, as asked: the fields are :meth:`mmreplay.Store.sample`'s, with
    ``rng`` a Generator or None (the store's own, which lets a batch be drawn ahead and
    prefetched), ``options`` the sampler's own (``beta``...), and ``sampler`` one to draw
    through instead of the store's (a framework's draw rule, such as skrl's).

    ``layout`` (``"NCHW"``, ``"NHWC"``, or None: as stored) lays the picture leaves out
    as a model takes them (:mod:`mmreplay.read.layout`).

    Two requests that draw alike are equal (``rng``, ``out``, ``layout`` and ``return_info`` aside):
    a batch drawn ahead for one serves the next. ``transform`` computes fields over the
    drawn batch (n-step returns, goal relabelling: :class:`mmreplay.read.transform.Transform`);
    it runs where :func:`mmreplay.read.gather.sample` holds the final draw and its rows.
    """

    batch_size: int
    num_steps: int | None = None
    replacement: bool = True
    rng: np.random.Generator | None = field(default=None, compare=False)
    within_episodes: bool | None = None
    window: tuple[int, int] | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    sampler: Any = None
    out: Any = field(default=None, compare=False)
    return_info: bool = field(default=False, compare=False)
    layout: str | None = field(default=None, compare=False)
    transform: Any = None

    @classmethod
    def build(
        cls,
        batch_size: Any,
        num_steps: Any = None,
        replacement: bool = True,
        rng: Any = None,
        within_episodes: bool | None = None,
        return_info: bool = False,
        window: tuple[int, int] | None = None,
        out: Any = None,
        options: Mapping[str, Any] | None = None,
        sampler: Any = None,
        layout: str | None = None,
        transform: Any = None,
    ) -> SampleRequest:
        """The request, checked: ``batch_size`` and ``num_steps`` positive ints and ``window``
        a pair of ints (ValueError naming the argument), ``rng`` an int seed, a Generator
        or None (TypeError), ``layout`` one of :data:`~mmreplay.read.layout.LAYOUTS` or
        None (ValueError)."""
        if type(batch_size) is not int or batch_size < 1:  # (the common call skips the checks)
            batch_size = positive("batch_size", batch_size)
        if num_steps is not None:
            num_steps = positive("num_steps", num_steps, allow_none=True)
        if rng is not None and type(rng) is not np.random.Generator:
            rng = as_generator(rng)
        if window is not None and not (
            type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int
        ):
            window = step_range("window", window)
        if type(replacement) is not bool:
            replacement = flag("replacement", replacement)
        if within_episodes is not None and type(within_episodes) is not bool:
            within_episodes = flag("within_episodes", within_episodes)
        if transform is not None and not (callable(transform) and hasattr(transform, "batch_spec")):
            raise TypeError(
                f"transform must be a transform such as mr.NStep(n, gamma) or mr.Hindsight(env) (callable, "
                f"with batch_spec), got {type(transform).__name__} {transform!r:.60}"
            )
        if layout is not None:
            from .layout import check_layout

            layout = check_layout(layout)
        # Filled as its __init__ would, without the object.__setattr__ call per field that
        # a frozen dataclass's __init__ makes (0.5 µs instead of 1.1 µs, on every batch).
        request = object.__new__(cls)
        request.__dict__.update(
            batch_size=batch_size,
            num_steps=num_steps,
            replacement=replacement,
            rng=rng,
            within_episodes=within_episodes,
            window=window,
            options={} if options is None else options,
            sampler=sampler,
            out=out,
            return_info=return_info,
            layout=layout,
            transform=transform,
        )
        return request

    @classmethod
    def over_shards(
        cls,
        where: str,
        batch_size: Any,
        num_steps: Any,
        replacement: bool,
        rng: Any,
        within_episodes: bool | None,
        return_info: bool,
        transform: Any,
        options: dict[str, Any],
    ) -> SampleRequest:
        """The request of a sample split over shards (:meth:`mmreplay.Group.sample`, the Ray
        sampler). ``window``, ``out`` and ``layout``, which arrive among the sampler's
        ``options`` there, are refused (TypeError naming ``where``): each shard has its own
        steps and batch."""
        for name in ("window", "out", "layout", "sampler", "options"):
            if name in options:
                raise TypeError(f"{where} takes no {name!r}")
        return cls.build(
            batch_size, num_steps, replacement, rng, within_episodes, return_info, options=options, transform=transform
        )

    def check_options(self, sampler: Any, where: str) -> None:
        """Refuse (TypeError naming ``where``) an option ``sampler`` does not read, before it draws."""
        unknown = self.options.keys() - sampler.options
        if unknown:
            takes = ", ".join(map(repr, sorted(sampler.options))) or "none"
            raise TypeError(
                f"{where}: the {getattr(sampler, 'name', '') or type(sampler).__name__!r} sampler takes no option "
                f"{', '.join(map(repr, sorted(unknown)))} (its options: {takes})"
            )
