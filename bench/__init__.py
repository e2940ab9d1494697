"""Benchmarks of mmreplay: the store's own figures and a comparison with other replay buffers.

``python -m bench`` runs the comparison (``python -m bench --help`` for sizes);
``python -m bench.store_figures`` measures the store's add / commit / open costs.
"""
