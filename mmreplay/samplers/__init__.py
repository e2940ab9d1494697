"""Samplers: the objects a store draws its random batches through (see :mod:`.base`)."""

from .base import Draw, Mass, Sampler, Window
from .registry import make_sampler, register_sampler, sampler_from_json
from .uniform import SliceSampler, UniformSampler

__all__ = [
    "Draw",
    "Mass",
    "Sampler",
    "SliceSampler",
    "UniformSampler",
    "Window",
    "make_sampler",
    "register_sampler",
    "sampler_from_json",
]
