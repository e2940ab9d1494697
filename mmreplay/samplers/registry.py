"""Samplers by name: what ``create(sampler=...)`` and a store's metadata name.

The samplers shipped with mmreplay are imported at the first lookup of a name not
registered yet; a custom sampler is registered with :func:`register_sampler` before
the store that names it is created or opened.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..errors import SpecError
from .base import Sampler

__all__ = ["make_sampler", "register_sampler", "sampler_from_json"]

_REGISTRY: dict[str, type[Sampler]] = {}


def register_sampler(cls: type[Sampler]) -> type[Sampler]:
    """Make a sampler class known by its ``name`` (usable as a class decorator), so
    ``create(sampler=name)`` and reopening a store that recorded it find it."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a class attribute 'name' to be registered")
    _REGISTRY[cls.name] = cls
    return cls


def _shipped() -> list[type[Sampler]]:
    from .prioritized import PrioritizedSampler
    from .uniform import SliceSampler, UniformSampler

    return [UniformSampler, SliceSampler, PrioritizedSampler]


def _lookup(name: str) -> type[Sampler]:
    if name not in _REGISTRY:
        for cls in _shipped():
            _REGISTRY.setdefault(cls.name, cls)
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(
            f"unknown sampler {name!r}; known: {known} (a custom sampler must be registered "
            "with mmreplay.samplers.register_sampler before the store is opened)"
        ) from None


def sampler_from_json(obj: Any, where: str = "metadata") -> Sampler:
    """The sampler a store recorded (``None``: uniform)."""
    if obj is None:
        return _lookup("uniform")()
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError(f"{where}: 'sampler' must be an object with a string 'name', got {obj!r}")
    return _lookup(obj["name"]).from_json(obj)


def make_sampler(sampler: str | Sampler | None, **options: Any) -> Sampler:
    """A sampler from ``create``'s arguments: a registered name with its options, or an
    instance (then no options)."""
    if sampler is None:
        sampler = "uniform"
    if isinstance(sampler, Sampler):
        if options:
            raise TypeError(f"sampler options {sorted(options)} given with a sampler instance")
        return sampler
    if isinstance(sampler, str):
        cls = _lookup(sampler)
        params = inspect.signature(cls).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):  # a misspelt keyword of create lands here
            takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            unknown = sorted(set(options) - set(takes))
            if unknown:
                raise SpecError(
                    f"unexpected keyword arguments {unknown}: not create's, nor options of the {sampler!r} "
                    f"sampler ({', '.join(takes) if takes else 'it takes none'})"
                )
        return cls.from_json({"name": sampler, **options})
    raise TypeError(f"sampler must be a name or a mmreplay.samplers.Sampler, got {type(sampler).__name__}")
