"""Episodes: where each env's episodes end, kept up to date at every commit.

- :mod:`~mmreplay.episodes.ends`: where an episode ends, read from the role leaves, and
  the ends a writer that resumes a store marks;
- :mod:`~mmreplay.episodes.index_file`: the ``episodes.idx`` file of end records;
- :mod:`~mmreplay.episodes.index`: the index of one store, written at each commit
  and followed by readers;
- :mod:`~mmreplay.episodes.spans`: episode spans as arrays, along a moving window;
- :mod:`~mmreplay.episodes.queries`: spans, episodes with their data, bounds and flat
  arrays, as readers ask for them.
"""

from .ends import open_ends
from .index import EpisodeHook, EpisodeIndex, index_for
from .index_file import INDEX_FILE, continue_index, index_limit
from .queries import (
    Episode,
    EpisodeSpan,
    complete_spans,
    episode_bounds,
    episode_index,
    episodes,
    fresh_envs,
    to_arrays,
)

__all__ = [
    "Episode",
    "EpisodeSpan",
    "EpisodeIndex",
    "EpisodeHook",
    "INDEX_FILE",
    "index_for",
    "index_limit",
    "episode_bounds",
    "complete_spans",
    "episode_index",
    "episodes",
    "to_arrays",
    "continue_index",
    "fresh_envs",
    "open_ends",
]
