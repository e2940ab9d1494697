"""mmreplay's skrl memories against the real ``skrl.memories.torch.RandomMemory``.

Each case drives both memories with the same seeded random sequence of operations
(create_tensor, add_samples of every shape skrl takes, sample, sample_by_index,
sample_all, get/set_tensor_by_name, reset, the cursor assignments, and adds that wrap
the ring) and, after each operation, compares the cursor (``memory_index``,
``env_index``, ``filled``, ``len``), every output tensor (dtype, shape, values, NaN
where skrl has NaN), the sampling indexes, and the exception class when skrl raises.
Sampling draws from torch's global generator in both, seeded alike before each call.

What is not compared, because skrl gets it wrong or because mmreplay keeps data skrl
only pretends to have (each also listed in ``mmreplay.compat.skrl``'s docstring):

- Rows that are not live (not written since the last ``reset`` or cursor move) but
  were touched before: skrl leaves stale data there that its own docs call
  unreachable ("access through the available methods will not be guaranteed");
  mmreplay drops them, so they read NaN / zero. Live rows and rows never touched are
  compared.
- Sequences (``sequence_length > 1``) from a filled memory: skrl's sequences start at
  flat row ``k`` of the physical order and run across the write cursor, joining the
  newest row with the oldest; mmreplay's follow each env's stream from its oldest row.
  Only their shapes are compared; before a wrap the indexes and values are.
- A multi-row add (one env, ``n > 1`` rows) that wraps, or one that gives more than one
  tensor: skrl moves ``memory_index`` inside its per-tensor loop (a second tensor lands
  on shifted rows) and does not set ``filled`` when it wraps. Multi-row adds are made
  on a one-tensor memory and never cross the end of the ring.
- ``sample_all(mini_batches=k)`` when ``k`` does not divide ``memory_size * num_envs``:
  skrl drops the remainder rows, mmreplay splits them in.
- Adds skrl does not check (an add of all envs while a partial step is staged, a partial
  add past ``num_envs``): mmreplay refuses them; they are not generated.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
skrl_memories = pytest.importorskip("skrl.memories.torch")

from mmreplay.compat.skrl import RandomMemory  # noqa: E402

DTYPES = {"float32": torch.float32, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}


class Pair:
    """Both memories, and the rows of skrl's that are comparable."""

    def __init__(self, M: int, E: int, replacement: bool):
        self.ref = skrl_memories.RandomMemory(
            memory_size=M, num_envs=E, device="cpu", replacement=replacement
        )
        self.ours = RandomMemory(memory_size=M, num_envs=E, device="cpu", replacement=replacement)
        self.M, self.E = M, E
        self.touched = np.zeros(M * E, bool)  # flat rows skrl ever wrote
        self.stale = np.zeros(M * E, bool)  # rows where skrl keeps data mmreplay dropped
        self.sizes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}

    def close(self) -> None:
        self.ours.close()

    # --- comparisons ------------------------------------------------------------------

    def live(self) -> np.ndarray:
        n = len(self.ref)
        mask = np.zeros(self.M * self.E, bool)
        mask[:n] = True
        return mask

    def comparable(self) -> np.ndarray:
        return ~self.stale

    def settle(self) -> None:
        """After each operation: rows skrl wrote that are not live are dropped by mmreplay
        (a reset, a cursor moved back); they stay out of the comparison until rewritten."""
        self.stale |= self.touched & ~self.live()

    def check_cursor(self, what: str) -> None:
        ref, ours = self.ref, self.ours
        got = (ours.memory_index, ours.env_index, ours.filled, len(ours))
        want = (ref.memory_index, ref.env_index, ref.filled, len(ref))
        assert got == want, f"{what}: cursor {got} vs skrl {want}"

    def check_rows(self, what: str, ours: torch.Tensor | None, ref: torch.Tensor | None, flat=None) -> None:
        """Equal tensors; ``flat``: the flat physical row of each output row (masked)."""
        if ref is None:
            assert ours is None, f"{what}: skrl gives None"
            return
        assert ours is not None, f"{what}: skrl gives a tensor"
        assert ours.dtype == ref.dtype and ours.shape == ref.shape, (
            f"{what}: {ours.dtype} {tuple(ours.shape)} vs skrl {ref.dtype} {tuple(ref.shape)}"
        )
        if flat is not None:
            keep = torch.from_numpy(self.comparable()[np.asarray(flat, np.int64) % (self.M * self.E)])
            ours, ref = ours[keep], ref[keep]
        same = torch.equal(ours, ref)
        if ref.dtype.is_floating_point:  # NaN where skrl has NaN, equal values elsewhere
            same = torch.equal(ours.isnan(), ref.isnan()) and torch.equal(
                ours.nan_to_num(0), ref.nan_to_num(0)
            )
        assert same, f"{what}: {ours.tolist()} vs skrl {ref.tolist()}"

    def both(self, what: str, call):
        """Run ``call(memory)`` on both; the same outcome or the same kind of exception."""
        try:
            want = call(self.ref)
        except (RuntimeError, ValueError, IndexError) as exc:
            with pytest.raises(type(exc)):
                call(self.ours)
            return None, None
        return call(self.ours), want

    # --- operations -------------------------------------------------------------------

    def create(self, name: str, size, dtype: torch.dtype | None, keep: bool = False) -> None:
        got, want = self.both(
            f"create_tensor({name})",
            lambda m: m.create_tensor(name, size=size, dtype=dtype, keep_dimensions=keep),
        )
        assert got == want, f"create_tensor({name}): {got} vs skrl {want}"
        if want:
            shape = tuple(size) if keep else (int(np.prod(size)),)
            self.sizes[name] = (shape, dtype or torch.get_default_dtype())

    def values(self, rng: np.random.Generator, lead: tuple[int, ...], name: str) -> torch.Tensor:
        shape, dtype = self.sizes[name]
        full = (*lead, *shape)
        if dtype == torch.bool:
            return torch.from_numpy(rng.random(full) < 0.5)
        if dtype.is_floating_point:
            return torch.from_numpy(rng.normal(size=full).astype(np.float32))
        if rng.random() < 0.3:  # floats into an integer tensor: truncated, as copy_ does
            return torch.from_numpy((rng.normal(size=full) * 5).astype(np.float32))
        return torch.from_numpy(rng.integers(-50, 50, full)).to(dtype)

    def add(self, rng: np.random.Generator, lead: tuple[int, ...], names=None) -> None:
        names = list(self.sizes) if names is None else names
        samples = {n: self.values(rng, lead, n) for n in names}
        if rng.random() < 0.2:
            samples["unknown"] = torch.zeros(*lead, 2)  # skipped by both
        start = self.ref.memory_index * self.E + self.ref.env_index
        count = lead[0] if lead else 1  # all envs, some envs, or rows of the one env
        self.both("add_samples", lambda m: m.add_samples(**samples))
        rows = (start + np.arange(count)) % (self.M * self.E)
        self.touched[rows] = True
        self.stale[rows] = False

    def sample(self, rng: np.random.Generator, names: list[str]) -> None:
        batch = int(rng.integers(1, 2 * self.M * self.E + 2))
        minis = int(rng.integers(1, 4))
        seq = int(rng.integers(2, 4)) if rng.random() < 0.3 else 1
        seed = int(rng.integers(1 << 30))

        def call(m):
            torch.manual_seed(seed)
            return m.sample(names, batch_size=batch, mini_batches=minis, sequence_length=seq)

        what = f"sample(batch={batch}, mini_batches={minis}, sequence_length={seq})"
        got, want = self.both(what, call)
        if want is None:
            return
        assert len(got) == len(want), what
        if seq > 1 and self.ref.filled:  # skrl's sequences cross the cursor: shapes only
            for g, w in zip(got, want):
                assert [None if t is None else t.shape for t in g] == [
                    None if t is None else t.shape for t in w
                ]
            return
        ref_idx = self.ref.get_sampling_indexes()
        assert torch.equal(self.ours.get_sampling_indexes().to(torch.long), ref_idx.to(torch.long)), what
        parts = np.array_split(ref_idx.numpy(), minis) if minis > 1 else [ref_idx.numpy()]
        for part, g, w in zip(parts, got, want):
            for name, a, b in zip(names, g, w):
                self.check_rows(f"{what} {name}", a, b, part)

    def sample_by_index(self, rng: np.random.Generator, names: list[str]) -> None:
        n = self.M * self.E
        idx = rng.integers(0, n, int(rng.integers(0, 2 * n)))
        as_tensor = torch.from_numpy(idx) if rng.random() < 0.5 else idx
        minis = int(rng.integers(1, 4))
        got, want = self.both(
            "sample_by_index", lambda m: m.sample_by_index(names, indexes=as_tensor, mini_batches=minis)
        )
        parts = np.array_split(idx, minis) if minis > 1 else [idx]
        for part, g, w in zip(parts, got, want):
            for name, a, b in zip(names, g, w):
                self.check_rows(f"sample_by_index {name}", a, b, part)

    def sample_all(self, rng: np.random.Generator, names: list[str]) -> None:
        n = self.M * self.E
        seq = 2 if rng.random() < 0.3 else 1
        divisors = [k for k in (1, 2, 3, 4) if n % k == 0 or seq > 1]
        minis = int(rng.choice(divisors))
        got, want = self.both(
            "sample_all", lambda m: m.sample_all(names, mini_batches=minis, sequence_length=seq)
        )
        order = self.ref.all_sequence_indexes if seq > 1 else np.arange(n)
        parts = np.array_split(order, minis) if minis > 1 else [order]
        assert len(got) == len(want)
        for part, g, w in zip(parts, got, want):
            for name, a, b in zip(names, g, w):
                self.check_rows(f"sample_all(seq={seq}, minis={minis}) {name}", a, b, part)

    def get_tensors(self) -> None:
        flat = np.arange(self.M * self.E)
        for name in self.sizes:
            ref = self.ref.get_tensor_by_name(name)
            self.check_rows(f"get_tensor_by_name({name})", self.ours.get_tensor_by_name(name).flatten(0, 1),
                            ref.flatten(0, 1), flat)  # fmt: skip
            self.check_rows(
                f"tensors[{name}]", self.ours.tensors[name].flatten(0, 1), ref.flatten(0, 1), flat
            )
            self.check_rows(
                f"tensors_view[{name}]", self.ours.tensors_view[name], self.ref.tensors_view[name], flat
            )
        assert sorted(self.ours.tensors) == sorted(self.ref.tensors) == self.ours.get_tensor_names()

    def set_tensor(self, rng: np.random.Generator) -> None:
        name = str(rng.choice(sorted(self.sizes)))
        value = self.values(rng, (self.M, self.E), name)
        self.both(f"set_tensor_by_name({name})", lambda m: m.set_tensor_by_name(name, value))
        self.touched[:] = True  # skrl sets every row, mmreplay the live ones
        self.stale = ~self.live()

    def reset(self) -> None:
        self.both("reset", lambda m: m.reset())

    def move_cursor(self, rng: np.random.Generator) -> None:
        what = str(rng.choice(["memory_index", "filled", "env_index"]))
        if what == "memory_index":
            value = int(rng.integers(0, self.M))
        elif what == "filled":
            value = bool(rng.random() < 0.5)
        else:
            value = int(rng.integers(0, self.E))
        for m in (self.ref, self.ours):
            setattr(m, what, value)


def run_sequence(seed: int, steps: int = 30) -> None:
    rng = np.random.default_rng(seed)
    single = seed % 4 == 0  # one env, one tensor: multi-row adds
    M = int(rng.integers(2, 6))
    E = 1 if single else int(rng.integers(1, 4))
    pair = Pair(M, E, replacement=bool(rng.random() < 0.5))
    try:
        if single:
            pair.create("observations", int(rng.integers(1, 3)), torch.float32)
        else:
            pair.create("observations", int(rng.integers(1, 4)), None)
            pair.create("actions", 1, DTYPES[str(rng.choice(["int64", "int32", "float32"]))])
            pair.create("terminated", 1, torch.bool)
            pair.create("grid", (2, 2), torch.float32, keep=True)
            pair.create("observations", 7, None)  # another size: ValueError in both
        names_pool = [*pair.sizes, "missing"]
        for step in range(steps):
            op = rng.random()
            ref = pair.ref
            if op < 0.45:
                room = E - ref.env_index
                kind = rng.random()
                if single and kind < 0.4 and M - ref.memory_index > 1:
                    n = int(rng.integers(2, M - ref.memory_index + 1))  # rows that do not cross the end
                    pair.add(rng, (n,))
                elif ref.env_index == 0 and kind < 0.7:
                    pair.add(rng, (E,))  # a step of all envs
                elif room > 1 and kind < 0.85:
                    pair.add(rng, (int(rng.integers(1, room)),))  # some envs of the step
                else:
                    pair.add(rng, ())  # one env
            elif op < 0.6:
                names = list(rng.choice(names_pool, int(rng.integers(1, len(names_pool) + 1)), replace=False))
                pair.sample(rng, names)
            elif op < 0.7:
                pair.sample_by_index(rng, list(pair.sizes))
            elif op < 0.78:
                pair.sample_all(rng, list(rng.permutation(names_pool)))
            elif op < 0.84:
                pair.get_tensors()
            elif op < 0.89:
                pair.set_tensor(rng)
            elif op < 0.92:
                pair.reset()
            elif op < 0.96:
                pair.move_cursor(rng)
            elif not single:
                name = f"late{step}"
                pair.create(name, int(rng.integers(1, 3)), DTYPES[str(rng.choice(list(DTYPES)))])
            pair.check_cursor(f"seed {seed} step {step}")
            pair.settle()
        pair.get_tensors()
    finally:
        pair.close()


@pytest.mark.parametrize("seed", range(24))
def test_same_operations_same_results_as_skrl(seed):
    run_sequence(seed)


def test_float_values_into_integer_tensors_are_truncated_as_in_skrl():
    pair = Pair(3, 2, replacement=True)
    try:
        pair.create("actions", 1, torch.int64)
        value = torch.tensor([[2.7], [-1.9]])
        pair.both("add", lambda m: m.add_samples(actions=value))
        assert pair.ours.get_tensor_by_name("actions")[0].flatten().tolist() == [2, -1]
        pair.get_tensors()
        with pytest.raises(ValueError, match="cannot be stored"):
            pair.ours.add_samples(actions=torch.tensor([[float("nan")], [1.0]]))
    finally:
        pair.close()


def test_replacement_default_follows_the_installed_skrl():
    from mmreplay.compat.skrl import skrl_replacement_default

    ref = skrl_memories.RandomMemory(memory_size=2)
    with RandomMemory(2, device="cpu") as ours:
        assert ours._replacement is ref._replacement is skrl_replacement_default()
