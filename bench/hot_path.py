"""The hot path alone: per-step add and uniform sample(256) of the installed mmreplay.

Meant for before/after comparisons of two checkouts on one machine: run it once with
each installed, interleaved, and compare the medians. The store is a 5-leaf vector
buffer of 8 envs, page-cached; numpy's assignment and ``take`` on in-RAM arrays of the
same shape are timed in the same run as the baseline.

Run: ``python -m bench.hot_path [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

import mmreplay as mr

SPEC = {
    "obs": mr.ArraySpec((17,), "float32"),
    "action": mr.ArraySpec((6,), "float32"),
    "reward": mr.ArraySpec((), "float32"),
    "terminated": mr.ArraySpec((), "bool"),
    "truncated": mr.ArraySpec((), "bool"),
}
ENVS, CAPACITY, ADDS, SAMPLES = 8, 100_000, 20_000, 2_000


def _step(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: rng.random((ENVS, *s.shape)).astype(s.dtype) for k, s in SPEC.items()}


def _median_us(fn, n: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(n)
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    pool = [_step(rng) for _ in range(64)]
    arrays = {k: np.zeros((CAPACITY, ENVS, *s.shape), s.dtype) for k, s in SPEC.items()}
    flat = {k: a.reshape(CAPACITY * ENVS, *a.shape[2:]) for k, a in arrays.items()}

    def numpy_add(n: int) -> None:
        for t in range(n):
            step = pool[t % 64]
            slot = t % CAPACITY
            for k, a in arrays.items():
                a[slot] = step[k]

    with tempfile.TemporaryDirectory() as tmp:
        store = mr.create(f"{tmp}/b", SPEC, CAPACITY, ENVS)
        for t in range(CAPACITY):  # fill once: no first-touch faults in the timed runs
            store.add(pool[t % 64])
        store.commit()

        def store_add(n: int) -> None:
            for t in range(n):
                store.add(pool[t % 64])

        gen = np.random.default_rng(1)

        def store_sample(n: int) -> None:
            for _ in range(n):
                store.sample(256, rng=gen)

        def numpy_take(n: int) -> None:
            for _ in range(n):
                rows = gen.integers(0, CAPACITY * ENVS, 256)
                for a in flat.values():
                    a.take(rows, axis=0)

        figures = {
            "numpy add (us/step)": _median_us(numpy_add, ADDS, args.repeats),
            "store add (us/step)": _median_us(store_add, ADDS, args.repeats),
            "numpy take 256 (us/batch)": _median_us(numpy_take, SAMPLES, args.repeats),
            "store sample 256 (us/batch)": _median_us(store_sample, SAMPLES, args.repeats),
        }
        store.close()
    print(f"mmreplay {mr.__version__} from {mr.__file__}")
    for name, value in figures.items():
        print(f"{name:30s} {value:8.2f}")
    print(f"store add / numpy add          {figures['store add (us/step)'] / figures['numpy add (us/step)']:8.2f}")
    print(
        f"store sample / numpy take      "
        f"{figures['store sample 256 (us/batch)'] / figures['numpy take 256 (us/batch)']:8.2f}"
    )


if __name__ == "__main__":
    main()
