"""Stable-Baselines3 (and CleanRL): SB3's replay buffers over a persistent store (docs/sb3.md).

:class:`ReplayBuffer` and :class:`DictReplayBuffer` subclass SB3's own and translate
SB3's API to the store's: ``add`` writes one store step of ``n_envs`` rows (leaves
``observation``, ``next_observation``, ``action``, ``reward``, ``terminated``,
``truncated``), ``sample`` draws SB3's indices with ``np.random`` exactly as SB3 does.
SB3 index ``i`` is store slot ``(origin + i) % buffer_size``: ``pos`` and ``full`` follow
from the store's step count and the origin, a store attribute that ``reset()`` moves.
"""

from .buffers import DictReplayBuffer, ReplayBuffer
from .her import HerReplayBuffer
from .manifest import MANIFEST_KIND
from .nstep import NStepReplayBuffer

__all__ = ["ReplayBuffer", "DictReplayBuffer", "NStepReplayBuffer", "HerReplayBuffer", "MANIFEST_KIND"]
