"""Shards written by Ray actors, sampled by a learner anywhere in the cluster.

Each :class:`ShardWriter` is a Ray actor that owns one store on its node's local disk
(an ordinary store: the single-writer lock and the commit protocol are the store's).
Env runners send it steps (``writer.extend.remote(steps)``); the learner's
:class:`RaySampler` fans each batch out to the writers and gathers the parts, the way
RLlib's replay actors and TorchRL's ``RayReplayBuffer`` do, but every row is on disk:
an actor that dies (``ray.kill``, a lost node) loses only the steps it had not
committed, and an actor restarted with the same path, by Ray (``max_restarts``) or by
hand, resumes its store.

Batches are drawn from each shard's committed steps only, so the learner never trains
on a row a crash could take back. The parts are numpy arrays returned from the actors:
Ray passes arrays larger than its inline limit through the node's shared-memory object
store, and ``ray.get`` on the same node maps them without a copy; the learner then
copies each leaf once, into the batch.

:func:`read_store` reads a store (or a group) as a ``ray.data.Dataset`` of rows, in
parallel read tasks over ranges of steps.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

try:
    import ray
    from ray.data.block import BlockAccessor, BlockMetadata
    from ray.data.datasource import Datasource, ReadTask
except ImportError as exc:  # ray is an install extra
    raise ImportError("mmreplay.ray needs ray: pip install 'mmreplay[ray]'") from exc

from .creation import create
from .errors import NotEnoughDataError
from .group import (
    OverShards,
    by_shard,
    check_count,
    draw_beta,
    is_group,
    join_parts,
    open_group,
    shard_mass,
    shard_name,
    split_batch,
)
from .read import SampleInfo, SampleRequest
from .read import sample as sample_store
from .read.request import positive
from .roles import validate_roles
from .samplers import Mass
from .spec import flatten, unflatten
from .store import Store
from .store import open as open_store

log = logging.getLogger(__name__)

__all__ = ["ShardWriter", "RaySampler", "start_writers", "read_store", "StoreDatasource"]


# --- the shard actor --------------------------------------------------------------------


class ShardWriter:
    """The writer of one store, run as a Ray actor (``ray.remote(ShardWriter)``, or
    :func:`start_writers`).

    Args:
        path: the store's folder on the actor's node.
        spec: with ``capacity``, create the store if it is not there (as
            ``mmreplay.create(..., exist_ok=True)``); None to open an existing one.
        capacity: time steps the ring holds.
        create_options: the other arguments of :func:`mmreplay.create` (``num_envs``,
            ``sampler``, ``commit_every``...).
    """

    def __init__(self, path: str, spec: Any = None, capacity: int | None = None, **create_options: Any):
        if spec is None:
            self.store: Store = open_store(path, "a")
        else:
            self.store = create(path, spec, capacity, exist_ok=True, **create_options)

    # --- writes ---------------------------------------------------------------------

    def add(self, step: Any) -> int:
        """Write one step; returns the steps ever added."""
        self.store.add(step)
        return self.store.total_steps

    def extend(self, steps: Any) -> int:
        """Write ``T`` steps; returns the steps ever added."""
        self.store.extend(steps)
        return self.store.total_steps

    def commit(self) -> int:
        """Commit; returns the committed steps."""
        self.store.commit()
        return self.store.committed_steps

    def info(self) -> dict[str, Any]:
        """The store's path, node-local process id and counters."""
        store = self.store
        return {
            "path": store.path,
            "pid": os.getpid(),
            "total_steps": store.total_steps,
            "committed_steps": store.committed_steps,
            "first_step": store.first_step,
        }

    # --- reads ----------------------------------------------------------------------

    def _committed(self) -> tuple[int, int]:
        self.store.check_open()  # a closed writer says so (its sampler's files are gone)
        return self.store.first_step, self.store.committed_steps

    def mass(self, request: SampleRequest) -> tuple[float, float]:
        """The sampler's mass over the committed steps for ``request``'s items (see
        :meth:`Group.masses`)."""
        first, end = self._committed()
        return tuple(shard_mass(self.store, self.store.window._replace(first=first, end=end), request))

    def sample(
        self, request: SampleRequest
    ) -> tuple[list[np.ndarray], dict[str, np.ndarray | None], tuple[float, float], float]:
        """The items ``request`` asks for, from the committed steps: the leaves in flatten
        order, the sample info as arrays, the mass drawn from and the importance-weight
        exponent of the draw."""
        mass = self.mass(request)
        nest, info = sample_store(self.store, replace(request, window=self._committed(), return_info=True))
        fields = {name: getattr(info, name) for name in ("step", "env", "slot", "probability", "weight")}
        return flatten(nest), fields, mass, draw_beta(self.store, request)

    def update_priorities(self, step: Any, env: Any, priorities: Any) -> int:
        return self.store.update_priorities(step, env, priorities)

    def close(self) -> None:
        """Commit and close the store (the actor can be killed safely afterwards)."""
        self.store.close()


def start_writers(
    root: str,
    spec: Any,
    shards: int,
    capacity: int,
    actor_options: dict | Sequence[dict] | None = None,
    **create_options: Any,
) -> list[Any]:
    """Start one :class:`ShardWriter` actor per shard, each with its store at
    ``root/shard-000``... on its own node (a group's shard names).

    Args:
        root: the folder, on every node, that holds the shards.
        spec: the stores' spec.
        shards: how many actors.
        capacity: time steps each store holds.
        actor_options: Ray options of every actor (``max_restarts``, ``num_cpus``,
            ``scheduling_strategy`` to pin an actor to a node...), or one dict per
            actor. Default: ``num_cpus=0``, ``max_restarts=-1`` (Ray restarts a dead
            actor, which reopens its store).
        create_options: the other arguments of :func:`mmreplay.create`.
    """
    shards = check_count(shards)
    per_actor = actor_options if isinstance(actor_options, Sequence) else [actor_options] * shards
    if len(per_actor) != shards:
        raise ValueError(f"actor_options: expected {shards} dicts (one per shard), got {len(per_actor)}")
    remote = ray.remote(ShardWriter)
    writers = []
    for index, options in enumerate(per_actor):
        chosen = {"num_cpus": 0, "max_restarts": -1, **(options or {})}
        path = os.path.join(root, shard_name(index))
        writers.append(remote.options(**chosen).remote(path, spec, capacity, **create_options))
    return writers


# --- the learner's sampler -------------------------------------------------------------

EMPTY = Mass(0.0, np.inf)


def _gather(refs: list[Any], failed: set[str]) -> list[Any]:
    """Each call's result, or None for an actor that is down. An actor whose creation
    failed never answers: said once (its id added to ``failed``), with the error it raised."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayActorError as exc:
            if not exc.actor_init_failed:
                log.warning("a shard actor is down; it draws and updates nothing until it answers again: %s", exc)
            elif exc.actor_id not in failed:
                failed.add(exc.actor_id)
                cause = str(exc).strip().splitlines()[-1]  # the traceback's last line: the error raised
                log.warning("shard actor %s failed to start; it draws and updates nothing: %s", exc.actor_id, cause)
            out.append(None)
    return out


class RaySampler(OverShards):
    """Batches drawn across :class:`ShardWriter` actors, as :meth:`mmreplay.Group.sample`
    draws across a group's shards.

    Each batch costs one round trip to every actor that draws a part: the split uses
    each shard's mass as of its previous reply (asked of every actor at the first
    batch), and the probabilities and importance weights in the sample info are those
    of the split actually used.

    Args:
        writers: the actor handles, by shard index.
        spec: the stores' spec (the nest batches are packed in).
        roles: the stores' roles, if given at their creation (for a ``transform``).
    """

    def __init__(self, writers: Sequence[Any], spec: Any, roles: dict[str, str] | None = None):
        if not writers:
            raise ValueError("RaySampler needs at least one ShardWriter actor")
        self.writers = list(writers)
        self.spec = spec
        self.roles = validate_roles(spec, roles)
        self._masses: list[Mass] | None = None
        self._key: tuple | None = None
        self._gen = np.random.default_rng()
        self._failed: set[str] = set()  # the actors whose creation failed, said once

    def masses(self, num_steps: int | None = None, **options: Any) -> list[Mass]:
        """Ask every actor for its mass now (an actor that is down counts as empty)."""
        within = options.pop("within_episodes", None)
        return self._masses_of(SampleRequest.build(1, num_steps, within_episodes=within, options=options))

    def _masses_of(self, request: SampleRequest) -> list[Mass]:
        replies = _gather([w.mass.remote(request) for w in self.writers], self._failed)
        return [Mass(*m) if m is not None else EMPTY for m in replies]

    def _sample(self, request: SampleRequest) -> Any:
        """An actor that is down (killed, being restarted) counts as empty until it
        answers again: the batch is drawn again from the others, so one actor's crash
        does not stop the learner."""
        gen = self._gen if request.rng is None else request.rng
        key = (request.num_steps, request.within_episodes, dict(request.options))  # what the masses depend on
        if self._masses is None or self._key != key:
            self._masses, self._key = self._masses_of(request), key
        for _ in range(len(self.writers)):  # each retry drops at least one actor that is down
            batch = self._draw(request, gen)
            if batch is not None:
                return batch
        raise NotEnoughDataError("cannot sample: every shard actor with committed steps is down")

    def _draw(self, request: SampleRequest, gen: np.random.Generator) -> Any:
        """One round trip: the batch, or None when an actor that was to draw a part is
        down (its mass is then zero, for the retry)."""
        used = self._masses
        spec = self.spec if request.transform is None else request.transform.batch_spec(self.spec, self.roles)
        totals = np.array([m.total for m in used], np.float64)
        if not totals.sum() > 0:
            self._masses = None  # ask every actor again next time
            raise NotEnoughDataError("cannot sample: no shard actor holds a committed step to draw")
        counts = split_batch(request.batch_size, totals, request.replacement, gen)
        chosen, idle = np.flatnonzero(counts), np.flatnonzero(counts == 0)
        rngs = [None] * len(chosen)
        if request.rng is not None:  # then each actor draws with a generator seeded from it
            rngs = [np.random.default_rng(seed) for seed in gen.integers(0, 2**63, len(chosen))]
        refs = [
            self.writers[i].sample.remote(replace(request, batch_size=int(counts[i]), rng=rng))
            for i, rng in zip(chosen, rngs)
        ]
        # the actors that draw nothing are asked their mass in the same round trip
        replies = _gather(refs + [self.writers[i].mass.remote(request) for i in idle], self._failed)
        masses, parts, beta = list(used), {}, 0.0
        for index, reply in zip(chosen, replies):
            if reply is None:
                masses[index] = EMPTY
                continue
            leaves, fields, mass, beta = reply
            masses[index] = Mass(*mass)
            parts[int(index)] = (unflatten(spec, leaves), SampleInfo(**fields))
        for index, mass in zip(idle, replies[len(refs) :]):
            masses[index] = Mass(*mass) if mass is not None else EMPTY
        self._masses = masses  # the next batch splits by what the actors just reported
        if len(parts) < len(chosen):
            return None
        return join_parts(spec, parts, totals / totals.sum(), used, beta, gen, request.return_info)

    def update_priorities(self, shard: Any, step: Any, env: Any, priorities: Any) -> int:
        """Send new priorities to the actors of their shards (``info.shard``...); returns
        how many were applied. An actor that is down (killed, being restarted) misses its
        part, as a ring that dropped the steps would: the learner carries on."""
        parts = by_shard("RaySampler.update_priorities", len(self.writers), shard, step, env, priorities)
        applied = _gather(
            [self.writers[index].update_priorities.remote(*part) for index, part in parts], self._failed
        )
        return sum(int(n) for n in applied if n is not None)


# --- offline reads -------------------------------------------------------------------


class StoreDatasource(Datasource):
    """A store's (or a group's) committed rows for ``ray.data``: one row per (step,
    env) with columns ``global_step``, ``env`` (and ``shard`` for a group), then every
    leaf by its path with ``.`` for ``/`` (``leaf.env`` for a leaf named as one of those
    three, as the parquet export names it). The committed window is taken when the
    datasource is made; each read task opens the store itself and reads a range of
    steps (a task fails if the writer overwrote its rows meanwhile)."""

    def __init__(self, path: str | os.PathLike, steps_per_task: int | None = None):
        super().__init__()
        self.path = os.fspath(path)
        self.steps_per_task = positive("steps_per_task", steps_per_task, allow_none=True)
        # (store path, shard index or None, first step, end step, num_envs, bytes per row)
        self.parts: list[tuple[str, int | None, int, int, int, int]] = []
        if is_group(self.path):
            with open_group(self.path) as group:
                for index, store in enumerate(group.shards):
                    self._add(store, index)
        else:
            with open_store(self.path) as store:
                self._add(store, None)

    def _add(self, store: Store, shard: int | None) -> None:
        row_bytes = sum(leaf.info.spec.nbytes for leaf in store.leaves) + 16
        self.parts.append(
            (store.path, shard, store.first_step, store.committed_steps, store.num_envs, row_bytes)
        )

    def estimate_inmemory_data_size(self) -> int:
        return sum((end - first) * envs * row for _, _, first, end, envs, row in self.parts)

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ):
        total = sum(end - first for _, _, first, end, _, _ in self.parts)
        size = self.steps_per_task or max(1, -(-total // max(1, parallelism)))
        tasks = []
        for path, shard, first, end, envs, row in self.parts:
            for a in range(first, end, size):
                b = min(end, a + size)
                meta = BlockMetadata(
                    num_rows=(b - a) * envs, size_bytes=(b - a) * envs * row, exec_stats=None
                )
                tasks.append(
                    ReadTask(
                        lambda path=path, shard=shard, a=a, b=b: [_read_block(path, shard, a, b)],
                        meta,
                        per_task_row_limit=per_task_row_limit,
                    )
                )
        return tasks


INDEX_COLUMNS = ("global_step", "env", "shard")


def _read_block(path: str, shard: int | None, first: int, end: int) -> Any:
    with open_store(path) as store:
        steps = np.arange(first, end)
        leaves = store.read_steps(steps)
        envs = store.num_envs
        batch: dict[str, np.ndarray] = {
            "global_step": np.repeat(steps, envs),
            "env": np.tile(np.arange(envs), len(steps)),
        }
        if shard is not None:
            batch["shard"] = np.full(len(steps) * envs, shard, np.int64)
        for name, leaf in zip(store.leaf_paths, leaves):
            name = name.replace("/", ".")
            name = f"leaf.{name}" if name in INDEX_COLUMNS else name  # the row's place stays
            batch[name] = leaf.reshape(len(steps) * envs, *leaf.shape[2:])
    return BlockAccessor.batch_to_block(batch)


def read_store(path: str | os.PathLike, steps_per_task: int | None = None, **read_options: Any) -> Any:
    """A store or a group as a ``ray.data.Dataset`` of rows (see :class:`StoreDatasource`).

    ``read_options`` go to ``ray.data.read_datasource`` (``override_num_blocks``,
    ``concurrency``...). Example::

        ds = mmreplay.ray.read_store("run/buffer")
        for batch in ds.iter_batches(batch_size=4096): ...
    """
    return ray.data.read_datasource(StoreDatasource(path, steps_per_task), **read_options)
