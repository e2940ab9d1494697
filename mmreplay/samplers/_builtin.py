"""Imports the samplers shipped with mmreplay, which registers them."""

from . import slices, uniform  # noqa: F401

try:  # the prioritized sampler, where it is built
    from . import prioritized  # noqa: F401
except ImportError:
    pass
