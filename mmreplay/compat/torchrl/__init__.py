"""A TorchRL storage whose rows live in a store.

:class:`MMReplayStorage` is a ``TensorStorage`` whose tensors are zero-copy views over
the store's memory-mapped leaves, so TorchRL's writers and samplers read it as they read
a ``LazyMemmapStorage``; every write goes through the store (appends with ``extend``,
overwrites with ``set``), whose commits keep the cursor and the rows durable, and
reopening the folder resumes. :class:`StoreSampler` draws through the store's sampler
(``sampler="prioritized"``: priorities that live in the folder).

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from torchrl.data import TensorDictReplayBuffer
    >>> from mmreplay.compat.torchrl import MMReplayStorage
    >>> path = tempfile.mkdtemp() + "/buf"
    >>> rb = TensorDictReplayBuffer(storage=MMReplayStorage(path, max_size=100), batch_size=4)
    >>> _ = rb.extend(TensorDict({"obs": torch.ones(10, 3)}, batch_size=[10]))
    >>> rb.sample()["obs"].shape
    torch.Size([4, 3])
"""

try:
    import tensordict  # noqa: F401
    import torchrl  # noqa: F401
except ImportError as exc:  # torchrl is an install extra
    raise ImportError("mmreplay.compat.torchrl needs torchrl: pip install 'mmreplay[torchrl]'") from exc

from .sampler import StoreSampler
from .storage import MMReplayStorage

__all__ = ["MMReplayStorage", "StoreSampler"]
