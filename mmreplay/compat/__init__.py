"""Replay APIs people already use, over a persistent store.

One module per framework, each imported on its own and importing its framework only
when used:

- :mod:`mmreplay.compat.tf_agents`: ``NumpyStorage`` and ``UniformReplayBuffer``
  (the behaviour of TF-Agents' ``TFUniformReplayBuffer``), numpy outputs.
- :mod:`mmreplay.compat.skrl`: skrl / rofunc ``Memory`` and ``RandomMemory``, torch outputs.
- :mod:`mmreplay.compat.gymnasium`: the transition spec of an env's spaces and a
  recorder that writes every transition of an env or a vector env into a store.
- :mod:`mmreplay.compat.torch`: a map-style ``Dataset`` of steps or sequences and an
  ``IterableDataset`` that samples, both safe with ``DataLoader(num_workers>0)``.
- :mod:`mmreplay.compat.torchrl`: a TorchRL storage (``MMReplayStorage``) for its
  ``ReplayBuffer`` with its own writers and samplers, and ``StoreSampler``, which draws
  through the store's sampler (prioritized replay whose priorities persist).

This package itself imports nothing.
"""
