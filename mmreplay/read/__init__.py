"""The read path: ``request`` (what is asked, built once) · ``draws`` (index math) ·
``gather`` (random batches) · ``advice`` (page cache) · ``passes`` (deterministic
passes) · ``readable`` (what it reads of a store and of a sampler) · ``transform``
(fields computed over a drawn batch) · ``nstep`` (n-step returns) · ``hindsight``
(goal relabelling)."""

from .gather import SampleInfo, empty_batch, read_rows, sample, set_prefetch, set_rng
from .hindsight import Hindsight
from .nstep import NStep
from .passes import iterate
from .request import SampleRequest

__all__ = [
    "Hindsight",
    "NStep",
    "SampleInfo",
    "SampleRequest",
    "empty_batch",
    "iterate",
    "read_rows",
    "sample",
    "set_prefetch",
    "set_rng",
]
