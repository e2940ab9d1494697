"""PyTorch datasets over a store, without an export.

- :class:`StoreDataset`: map-style, one item per step row (``num_steps=None``) or per
  sequence of ``num_steps`` consecutive steps of one env, optionally only those inside
  one episode; items are nests of tensors. ``DataLoader(..., shuffle=True)`` gives
  epochs over the committed window.
- :class:`SampleDataset`: iterable, yields random batches from ``store.sample``
  forever (or ``num_batches``), picking up the writer's newer commits between batches,
  for a learner reading a store that is still being collected. Use it with
  ``DataLoader(..., batch_size=None)``.

Both hold only the buffer's (absolute) path, the ``storage_options`` of an ``s3://`` store
opened with them, and the window they were made for: every process (each ``DataLoader``
worker, with fork or spawn; spawn for ``s3://``) opens its own read-only store on first use.

Example:
    >>> import mmreplay as mr, numpy as np, tempfile, torch
    >>> from mmreplay.compat.torch import StoreDataset
    >>> path = tempfile.mkdtemp() + "/b"
    >>> with mr.create(path, {"x": mr.ArraySpec((2,), "float32")}, 100, num_envs=2) as s:
    ...     s.extend({"x": np.ones((10, 2, 2), "float32")})
    >>> loader = torch.utils.data.DataLoader(StoreDataset(path, num_steps=4), batch_size=8, shuffle=True)
    >>> next(iter(loader))["x"].shape
    torch.Size([8, 4, 2])
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

try:
    import torch
    from torch.utils.data import Dataset, IterableDataset, get_worker_info
except ImportError as exc:  # torch is an install extra
    raise ImportError("mmreplay.compat.torch needs torch: pip install 'mmreplay[torch]'") from exc

from ..episodes import index_for
from ..errors import OverwrittenError
from ..io import is_url
from ..read import SampleRequest, read_rows, sample, set_rng
from ..read.request import positive
from ..spec import map_structure
from ..store import Store
from ..store import open as open_store

__all__ = ["StoreDataset", "SampleDataset"]


def _tensors(nest: Any) -> Any:
    return map_structure(lambda x: torch.from_numpy(np.asarray(x)), nest)


class _Opened:
    """A read-only store opened lazily in the process that uses it (never pickled)."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None):
        self.path, self.storage_options = path, storage_options
        self.store: Store | None = None
        self.pid: int | None = None

    def get(self) -> Store:
        if self.store is None or self.pid != os.getpid():
            self.store = open_store(self.path, "r", storage_options=self.storage_options)
            self.pid = os.getpid()
        return self.store

    def close(self) -> None:
        if self.store is not None and self.pid == os.getpid():
            self.store.close()
        self.store = None

    def __getstate__(self) -> dict:
        return {"path": self.path, "storage_options": self.storage_options}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["storage_options"])


def _opened(store: str | os.PathLike | Store) -> _Opened:
    """The buffer's path as every process finds it, whatever its working directory then,
    and the storage_options an ``s3://`` store was opened with."""
    path = store.path if isinstance(store, Store) else os.fspath(store)
    location = store.location if isinstance(store, Store) else None
    return _Opened(path if is_url(path) else os.path.abspath(path), location and location.storage_options)


class StoreDataset(Dataset):
    """Map-style dataset over the committed window of a store, as it was when made.

    Items are numbered env by env, each env in time order. An item is the spec's nest of
    tensors ``[*shape]`` (one step) or ``[num_steps, *shape]`` (a sequence that stays in
    one env's stream and, with ``within_episodes``, in one episode).

    Args:
        store: a buffer path or an open :class:`mmreplay.Store`; the dataset opens its
            own read-only store and uses the committed window it sees.
        num_steps: steps per item; None for single steps.
        within_episodes: only sequences that do not cross an episode end.

    Reading a step the writer has overwritten since raises
    :class:`~mmreplay.OverwrittenError`; for a store still being written, prefer
    :class:`SampleDataset`.
    """

    def __init__(
        self, store: str | os.PathLike | Store, num_steps: int | None = None, within_episodes: bool = False
    ):
        self.num_steps = positive("num_steps", num_steps, allow_none=True)
        self._opened = _opened(store)
        # The window as a reader sees it: a writer may count steps whose slots it has
        # already reserved for overwriting, which a reader must treat as gone.
        src = self._opened.get()
        steps = 1 if num_steps is None else num_steps
        self.first, self.end = src.window[:2]
        self.num_envs = src.num_envs
        if within_episodes:
            spans = index_for(src).spans(src)
            starts = np.maximum(spans.length - (steps - 1), 0)
            keep = starts > 0
            self._span_env = spans.env[keep]
            self._span_first = spans.first[keep]
            self._cum = np.cumsum(starts[keep])
            self._len = int(self._cum[-1]) if len(self._cum) else 0
        else:
            self._cum = None
            self._per_env = max(0, self.end - self.first - steps + 1)
            self._len = self._per_env * self.num_envs

    def __len__(self) -> int:
        return self._len

    def locate(self, index: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(first step, env)`` of the items at ``index`` (an int or an int array)."""
        i = np.asarray(index, np.int64)
        if i.size and (i.min() < -self._len or i.max() >= self._len):
            raise IndexError(f"index out of range for a dataset of {self._len} items")
        i = i % max(self._len, 1)
        if self._cum is None:
            env = i // max(self._per_env, 1)
            return self.first + i - env * self._per_env, env
        span = np.searchsorted(self._cum, i, side="right")
        before = np.where(span > 0, self._cum[np.maximum(span - 1, 0)], 0)
        return self._span_first[span] + (i - before), self._span_env[span]

    def _read(self, index: Any) -> Any:
        step, env = self.locate(index)
        if self.num_steps is not None:
            step = step[..., None] + np.arange(self.num_steps, dtype=np.int64)
            env = env[..., None]
        try:
            return read_rows(self._opened.get(), step, env)
        except OverwrittenError as exc:  # a refresh() would not help: the window is the dataset's
            raise OverwrittenError(
                f"{exc.path}: the writer overwrote step {exc.step} of this StoreDataset, made over steps "
                f"{self.first}..{self.end - 1} (the oldest kept is now {exc.oldest}); make the dataset "
                "again, or use SampleDataset for a store still being written",
                exc.path, exc.step, exc.oldest,
            ) from None

    def __getitem__(self, index: int) -> Any:
        return _tensors(self._read(int(index)))

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A whole batch in one read per leaf (the DataLoader's batched fetch)."""
        batch = _tensors(self._read(np.asarray(indices, np.int64)))
        if isinstance(batch, torch.Tensor):
            return list(batch)
        return [map_structure(lambda t, k=k: t[k], batch) for k in range(len(indices))]

    def close(self) -> None:
        self._opened.close()


class SampleDataset(IterableDataset):
    """Random batches from a store: ``store.sample(batch_size, num_steps, ...)`` as tensors.

    Each DataLoader worker opens its own reader and draws from its own generator, seeded
    from ``seed`` and the worker id (or, when ``seed`` is None, from torch's generator
    at each pass: ``torch.manual_seed`` and ``DataLoader(generator=...)`` make runs
    repeatable, and every epoch draws new batches). Before each batch the
    reader picks up the writer's newer commits (``refresh``), unless ``refresh=False``.

    Args:
        store: a buffer path or an open :class:`mmreplay.Store`.
        batch_size: items per batch.
        num_steps: steps per item; None for single steps.
        within_episodes: sequences never cross an episode end.
        num_batches: batches per pass, shared among the workers; None for no end.
        seed: base seed.
        refresh: pick up new commits before each batch.
    """

    def __init__(
        self,
        store: str | os.PathLike | Store,
        batch_size: int,
        num_steps: int | None = None,
        within_episodes: bool = False,
        num_batches: int | None = None,
        seed: int | None = None,
        refresh: bool = True,
    ):
        self.request = SampleRequest.build(batch_size, num_steps, within_episodes=within_episodes)
        if num_batches is not None and (not isinstance(num_batches, int) or num_batches < 0):
            raise ValueError(f"num_batches must be a non-negative int or None, got {num_batches!r}")
        self._opened = _opened(store)
        self.num_batches = num_batches
        self.seed = seed
        self.refresh = refresh

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        # unseeded: a draw of torch's generator (a worker's is seeded apart), so each pass
        # over the dataset in one process (an epoch, a persistent worker) has new batches
        seed = int(torch.randint(1 << 62, ())) if self.seed is None else [self.seed, worker]
        if self.num_batches is None:
            batches: Iterable[int] = itertools.count()
        else:  # this worker's share
            batches = range(self.num_batches // workers + (1 if worker < self.num_batches % workers else 0))
        store = self._opened.get()
        set_rng(store, np.random.default_rng(seed))  # the store's own generator: the next batch is prefetched
        for _ in batches:
            if self.refresh:
                store.refresh()
            yield _tensors(sample(store, self.request))

    def close(self) -> None:
        self._opened.close()
