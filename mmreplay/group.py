"""A group of stores: many writers (one per shard), one learner that samples them all.

A group is a folder of ``N`` ordinary stores (``shard-000`` ... one per actor) and a
small manifest, ``mmreplay-group.json``, written last when the group is created. Each
actor process opens its own shard as the writer (:func:`open_shard`), with the store's
single-writer lock and commit protocol unchanged; the learner opens the group
(:func:`open_group`) and sees each shard's committed prefix as any reader does.

Sampling splits a batch between the shards in proportion to what their samplers would
draw from (:meth:`mmreplay.samplers.Sampler.mass`: the number of valid starts for the
uniform sampler, the sum of ``priority ** alpha`` for the prioritized one), so every
row of the group is drawn as if the group were one store; each shard then draws its
part through its own sampler and fetch path (readers' re-draw included). The sample
info names the shard of every item, and :meth:`Group.update_priorities` routes the new
priorities back to it (through the shard's priority-file protocol).

Nothing in a shard knows about the group: a shard can be opened, verified, recovered
or exported as a store on its own, and one actor's crash costs only that shard's
uncommitted tail.
"""

from __future__ import annotations

import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .backends.base import fsync_path
from .creation import create as create_store
from .creation import differences, requested
from .errors import (
    BadInputError,
    ClosedError,
    CorruptBufferError,
    NotABufferError,
    NotEnoughDataError,
    SpecMismatchError,
)
from .files import (
    atomic_write,
    make_folders,
    raise_named,
    remove_dead_scratch,
    remove_folders,
    rename_made,
    scratch_path,
)
from .io.local import GROUP_FILE, folder_inside, read_inside
from .opening import MODES
from .read import SampleInfo, SampleRequest
from .read import sample as sample_store
from .samplers.prioritized import priority_refusal
from .spec import flatten, spec_to_json, unflatten
from .store import BufferExistsError, Store
from .store import open as open_store

__all__ = [
    "GROUP_FILE",
    "Group",
    "GroupSampleInfo",
    "OverShards",
    "by_shard",
    "check_count",
    "create_group",
    "is_group",
    "open_group",
    "open_shard",
    "shard_folders",
    "shard_name",
    "write_manifest",
]

GROUP_FORMAT = "mmreplay-group/1"
MAX_SHARDS = 4096


def shard_name(index: int) -> str:
    """The folder of shard ``index`` inside its group."""
    return f"shard-{index:03d}"


@dataclass(frozen=True)
class GroupSampleInfo(SampleInfo):
    """Where each item of a group's batch came from: :class:`~mmreplay.read.SampleInfo`
    in its shard (``shard``, ``[B]``), with ``probability`` and ``weight`` (``(N * P(i))
    ** -beta / max_j``) over the whole group."""

    shard: np.ndarray


# --- the manifest -----------------------------------------------------------------------


def _manifest_path(path: str) -> str:
    return os.path.join(path, GROUP_FILE)


def _read_manifest(path: str) -> list[str]:
    """The shard folders a group's manifest names, validated."""
    where = _manifest_path(path)
    try:
        raw = read_inside(path, GROUP_FILE, 1 << 20, "a group manifest")
    except FileNotFoundError:
        raise NotABufferError(f"{path}: not a group of stores (no {GROUP_FILE})") from None
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise CorruptBufferError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise CorruptBufferError(f"{where}: nested too deeply to be a group manifest") from None
    if not isinstance(obj, dict) or obj.get("format") != GROUP_FORMAT:
        found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
        raise CorruptBufferError(f"{where}: expected format {GROUP_FORMAT!r}, found {found!r}")
    shards = obj.get("shards")
    if (
        not isinstance(shards, list)
        or not 1 <= len(shards) <= MAX_SHARDS
        or shards != [shard_name(i) for i in range(len(shards))]
    ):
        raise CorruptBufferError(
            f"{where}: 'shards' must list the folders shard-000, shard-001, ... in order, got {shards!r}"
        )
    return shards


def shard_folders(path: str | os.PathLike) -> list[str]:
    """The folders of a group's shards, in shard order, as its manifest names them."""
    path = os.fspath(path)
    return [_shard_folder(path, name) for name in _read_manifest(path)]


def _shard_folder(path: str, name: str) -> str:
    """A shard's folder: a real folder of the group's (a link out is refused)."""
    try:
        return folder_inside(path, name)
    except (FileNotFoundError, NotADirectoryError):
        return os.path.join(path, name)  # opening it says what is missing


def write_manifest(path: str | os.PathLike, shards: int, fsync: bool = False) -> None:
    """Make the folder ``path``, which holds the stores ``shard-000`` ... ``shard-<N-1>``,
    a group (replacing its manifest atomically): for shards written apart, such as by
    actors on different nodes, then brought into one folder. Shards that are no stores,
    or not alike (see :func:`open_group`), are refused and no manifest is written."""
    path = os.fspath(path)
    names = [shard_name(i) for i in range(check_count(shards))]
    missing = [name for name in names if not os.path.isdir(os.path.join(path, name))]
    if missing:
        raise NotABufferError(f"{path}: no shard folder {missing[0]} for a group of {shards} shards")
    stores: list[Store] = []
    try:  # a manifest never makes a group that open_group refuses
        for name in names:
            stores.append(open_store(_shard_folder(path, name), "r"))
        _check_alike(path, stores)
    finally:
        for store in stores:
            store.close()
    body = json.dumps({"format": GROUP_FORMAT, "shards": names}, indent=1).encode() + b"\n"
    atomic_write(_manifest_path(path), body, fsync=fsync)


def check_count(shards: Any) -> int:
    if not isinstance(shards, (int, np.integer)) or isinstance(shards, bool) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be an int in [1, {MAX_SHARDS}], got {shards!r}")
    return int(shards)


# --- create / open ----------------------------------------------------------------------


def create_group(
    path: str | os.PathLike,
    spec: Any,
    shards: int,
    capacity: int,
    num_envs: int = 1,
    exist_ok: bool = False,
    **options: Any,
) -> Group:
    """Create a group of ``shards`` stores and open it for the learner (``mode="r"``).

    Every shard is created as :func:`mmreplay.create` would with the same arguments
    (``capacity`` and ``num_envs`` are per shard; ``backend``, ``compression``,
    ``commit_every``, ``durability``, ``sampler`` and its options...). The manifest is
    written last, so a folder without one is not a group. Actors then open their shard
    with :func:`open_shard`.

    Args:
        path: the group's folder (must not exist, or be empty).
        spec: the spec of every shard.
        shards: how many shards (one per actor process).
        capacity: time steps each shard's ring holds.
        num_envs: parallel environments each actor writes per step.
        exist_ok: open the group instead if one of the same layout is there, as
            :func:`mmreplay.create` reopens a buffer.
        options: the other arguments of :func:`mmreplay.create`.

    Example:
        >>> import mmreplay as mr, tempfile
        >>> spec = {"obs": mr.ArraySpec((3,), "float32")}
        >>> with mr.create_group(tempfile.mkdtemp() + "/g", spec, shards=2, capacity=100) as group:
        ...     group.num_shards
        2
    """
    path = os.fspath(path)
    shards = check_count(shards)
    if os.path.exists(_manifest_path(path)):
        if not exist_ok:
            raise BufferExistsError(f"{path}: a group already exists there; pass exist_ok=True to open it")
        return _reopen(path, spec, shards, capacity, num_envs, options)
    if os.path.lexists(path) and not (os.path.isdir(path) and not os.listdir(path)):
        raise BufferExistsError(f"{path}: already exists and is not an empty folder")
    requested(spec, capacity, num_envs, options)  # a bad argument: refused before anything is made
    # made whole beside ``path``, then renamed into place: of processes creating the same
    # group at once, one wins and the others remove only their own scratch folder
    made = make_folders(os.path.dirname(os.path.abspath(path)))
    remove_dead_scratch(path)
    tmp = scratch_path(path, "creating")
    try:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.mkdir(tmp)
        for index in range(shards):
            create_store(os.path.join(tmp, shard_name(index)), spec, capacity, num_envs, **options).close()
        write_manifest(tmp, shards, fsync=options.get("durability") == "power")
        rename_made(tmp, path, "group")
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_folders(made)
        if exist_ok and isinstance(exc, BufferExistsError) and os.path.exists(_manifest_path(path)):
            return _reopen(path, spec, shards, capacity, num_envs, options)
        raise_named(exc, path, "group", tmp)
    if options.get("durability") == "power":
        fsync_path(os.path.dirname(os.path.abspath(path)))
    return open_group(path)


def _reopen(path: str, spec: Any, shards: int, capacity: int, num_envs: int, options: dict) -> Group:
    """The group at ``path`` opened, if it is the one ``create_group`` was asked for."""
    group = open_group(path)
    want, given, _ = requested(spec, capacity, num_envs, options)
    diffs = [] if group.num_shards == shards else [f"shards: existing {group.num_shards} vs new {shards}"]
    for store in group.shards:  # each shard as create(exist_ok=True) would check it
        diffs += [f"{os.path.basename(store.path)} {d}" for d in differences(store.metadata, want, given)]
        if diffs:
            break
    if diffs:
        group.close()
        raise SpecMismatchError(f"{path}: a different group exists there ({'; '.join(diffs)})")
    return group


def open_group(path: str | os.PathLike, mode: str = "r") -> Group:
    """Open a group: ``mode="r"`` for the learner (every shard as a reader), ``"a"`` to
    hold every shard's writer lock in this one process (a single process feeding all
    shards, or maintenance). An actor that owns one shard uses :func:`open_shard`."""
    path = os.fspath(path)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    names = _read_manifest(path)
    stores: list[Store] = []
    try:
        for name in names:
            stores.append(open_store(_shard_folder(path, name), mode))
        _check_alike(path, stores)
    except BaseException:
        for store in stores:
            store.close()
        raise
    return Group(path, stores, mode)


def open_shard(path: str | os.PathLike, shard: int, mode: str = "a") -> Store:
    """Open one shard of a group as an ordinary store: ``mode="a"`` for the actor that
    owns it (resuming after its committed steps), ``"r"`` to read it alone."""
    path = os.fspath(path)
    names = _read_manifest(path)
    if not isinstance(shard, (int, np.integer)) or isinstance(shard, bool) or not 0 <= shard < len(names):
        raise IndexError(f"{path}: shard must be an int in [0, {len(names)}), got {shard!r}")
    return open_store(_shard_folder(path, names[int(shard)]), mode)


def _check_alike(path: str, stores: list[Store]) -> None:
    """Every shard has the first one's spec, env count, roles and sampler (a shard with
    other roles would be read, sampled and exported by the first one's)."""
    first = stores[0]
    for store in stores[1:]:
        diffs = [
            f"{name}: {a!r} vs {b!r}"
            for name, a, b in (
                ("spec", spec_to_json(first.spec), spec_to_json(store.spec)),
                ("num_envs", first.num_envs, store.num_envs),
                ("roles", first.roles, store.roles),
                ("sampler", first.sampler.state_json(), store.sampler.state_json()),
            )
            if a != b
        ]
        if diffs:
            raise SpecMismatchError(
                f"{path}: shard {os.path.basename(store.path)} differs from {os.path.basename(first.path)} "
                f"({'; '.join(diffs)})"
            )


# --- one batch from many shards ------------------------------------------------------


def shard_mass(store: Store, window: Any, request: SampleRequest) -> Any:
    """The :class:`~mmreplay.samplers.Mass` of ``store``'s sampler over ``window`` for
    ``request``'s items, its options checked first: what a batch is split by."""
    sampler = store.sampler
    request.check_options(sampler, store.path)
    return sampler.mass(window, request, request.num_steps or sampler.num_steps or 1)


def draw_beta(store: Store, request: SampleRequest) -> float:
    """The importance-weight exponent of a draw: the request's ``beta``, else the sampler's."""
    return float(request.options.get("beta", getattr(store.sampler, "beta", 0.0)))


def split_batch(
    batch_size: int, totals: np.ndarray, replacement: bool, gen: np.random.Generator
) -> np.ndarray:
    """How many items each shard draws: multinomial in proportion to ``totals`` (with
    replacement), or a multivariate hypergeometric over the shards' valid starts
    (distinct items, at most all of them)."""
    if replacement:
        return gen.multinomial(batch_size, totals / totals.sum())
    counts = totals.astype(np.int64)
    return gen.multivariate_hypergeometric(counts, min(batch_size, int(counts.sum())))


def join_parts(
    spec: Any,
    parts: dict[int, tuple[Any, Any]],
    shares: np.ndarray,
    masses: list[Any],
    beta: float,
    gen: np.random.Generator,
    return_info: bool,
) -> Any:
    """One batch, in random order, from each shard's ``(nest, info)`` part.

    ``shares[s]`` is the probability that one item is drawn from shard ``s`` and
    ``masses[s]`` the shard's :class:`~mmreplay.samplers.Mass` at its draw: an item's
    probability in the group is ``shares[s] * p``, and importance weights are
    ``(P(i) / P_min) ** -beta`` with ``P_min`` the smallest over the group, as one
    store's prioritized sampler gives them.
    """
    shard_ids = [np.full(len(info.step), index, np.int64) for index, (_, info) in parts.items()]
    order = gen.permutation(sum(len(ids) for ids in shard_ids))
    leaves = [np.concatenate(arrays)[order] for arrays in zip(*(flatten(nest) for nest, _ in parts.values()))]
    nest = unflatten(spec, leaves)
    if not return_info:
        return nest
    infos = [info for _, info in parts.values()]

    def joined(name: str) -> np.ndarray:
        return np.concatenate([np.asarray(getattr(info, name)) for info in infos])[order]

    probability = np.concatenate(
        [shares[index] * np.asarray(info.probability) for index, (_, info) in parts.items()]
    )
    probability = probability[order]
    weight = None
    if all(info.weight is not None for info in infos):
        smallest = min(
            share * m.smallest / m.total for share, m in zip(shares, masses) if m.total > 0 and share > 0
        )
        weight = np.power(probability / smallest, -beta).astype(np.float32)
    info = GroupSampleInfo(
        joined("step"), joined("env"), joined("slot"), probability, weight, np.concatenate(shard_ids)[order]
    )
    return nest, info


# --- the group ------------------------------------------------------------------------


def by_shard(
    where: str, num_shards: int, shard: Any, step: Any, env: Any, priorities: Any
) -> list[tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """Priority updates (``info.shard``, ``info.step``, ``info.env`` of a batch drawn over
    shards) as ``(shard, (step, env, priorities))`` per shard, checked before any is sent."""
    shard = np.asarray(shard)
    if shard.dtype.kind not in "iu" and shard.size:  # [] is float to numpy
        raise BadInputError(f"{where}: shard must be an integer array, got {shard.dtype}")
    try:
        shard, step, env = np.broadcast_arrays(shard, np.asarray(step), np.asarray(env))
    except ValueError:
        raise BadInputError(
            f"{where}: shard, step and env must have one shape (one item each), got "
            f"{np.shape(shard)}, {np.shape(step)} and {np.shape(env)}"
        ) from None
    shard, step, env = shard.reshape(-1), step.reshape(-1), env.reshape(-1)
    p = np.asarray(priorities)
    if p.shape[:1] != shard.shape:
        raise BadInputError(
            f"{where}: expected {shard.size} priorities (one per item, or [items, num_steps]), got shape {p.shape}"
        )
    if shard.size and (shard.min() < 0 or shard.max() >= num_shards):
        raise BadInputError(
            f"{where}: shard index out of range for {num_shards} shards (got {shard.min()}..{shard.max()})"
        )
    bad = ~(p >= 0) | ~np.isfinite(p) if p.dtype.kind in "iuf" else np.zeros(p.shape, bool)
    if bad.any():  # NaN TD errors: refused here, or shard actors would apply their sound parts
        raise priority_refusal(where, p, bad)
    return [(int(i), (step[shard == i], env[shard == i], p[shard == i])) for i in np.unique(shard)]


class OverShards(ABC):
    """A batch split over shards (:class:`Group`, :class:`mmreplay.ray.RaySampler`): the
    one ``sample`` signature, its request built and checked once; ``_sample`` splits it."""

    def sample(
        self,
        batch_size: int,
        num_steps: int | None = None,
        replacement: bool = True,
        rng: Any = None,
        within_episodes: bool | None = None,
        return_info: bool = False,
        transform: Any = None,
        **options: Any,
    ) -> Any:
        """A random batch from every shard, as :meth:`mmreplay.Store.sample` draws from
        one store (but without ``window``, ``out`` and ``layout``): each shard gets a part
        of the batch in proportion to its sampler's mass (retained rows, or priority
        mass), then draws it through its own sampler (and runs ``transform`` over its
        part). Items come in random order. With ``return_info``, also a
        :class:`GroupSampleInfo` (shard, step, env, probability, weight of each item).
        """
        where = f"{type(self).__name__}.sample"
        request = SampleRequest.over_shards(
            where, batch_size, num_steps, replacement, rng, within_episodes, return_info, transform, options
        )
        return self._sample(request)

    @abstractmethod
    def _sample(self, request: SampleRequest) -> Any:
        """The batch of a checked request."""


class Group(OverShards):
    """The shards of a group, opened together. Make one with :func:`create_group` or
    :func:`open_group`.

    ``len(group)`` counts retained steps over all shards (each holds ``num_envs`` rows).
    A learner calls :meth:`refresh` to pick up the actors' newer commits, as a reader
    of one store does.
    """

    def __init__(self, path: str, shards: list[Store], mode: str):
        self.path = path
        self.mode = mode
        self._shards = tuple(shards)
        self._gen = np.random.default_rng()
        self._closed = False

    # --- description ---------------------------------------------------------------

    @property
    def shards(self) -> tuple[Store, ...]:
        """The shard stores, by index."""
        return self._shards

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def spec(self) -> Any:
        return self._shards[0].spec

    @property
    def num_envs(self) -> int:
        return self._shards[0].num_envs

    @property
    def total_steps(self) -> int:
        """Steps ever added over all shards (as this process sees them)."""
        return sum(store.total_steps for store in self._shards)

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return sum(len(store) for store in self._shards)

    def __repr__(self) -> str:
        if self._closed:
            return f"<closed mmreplay.Group {self.path!r}>"
        sizes = ", ".join(str(len(store)) for store in self._shards)
        return f"<mmreplay.Group {self.path!r} mode={self.mode!r} shards={self.num_shards} steps=[{sizes}]>"

    # --- life cycle --------------------------------------------------------------------

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close every shard (writers commit). Safe twice."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for store in self._shards:
            try:
                store.close()
            except Exception as exc:  # close the others all the same
                errors.append(exc)
        if errors:
            raise errors[0]

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self.path}: group is closed")

    def refresh(self) -> bool:
        """Pick up every shard's newer commits (readers); True if any changed."""
        self._check_open()
        return any([store.refresh() for store in self._shards])

    def commit(self) -> None:
        """Commit every shard (a group opened with ``mode="a"``)."""
        for store in self._shards:
            store.commit()

    # --- sampling ----------------------------------------------------------------------

    def masses(self, num_steps: int | None = None, **options: Any) -> list[Any]:
        """Each shard's :class:`mmreplay.samplers.Mass` for ``num_steps`` sequences:
        the weights :meth:`sample` splits a batch by."""
        self._check_open()
        within = options.pop("within_episodes", None)
        options = {k: v for k, v in options.items() if v is not None}
        return self._masses(SampleRequest.build(1, num_steps, within_episodes=within, options=options))

    def _masses(self, request: SampleRequest) -> list[Any]:
        return [shard_mass(store, store.window, request) for store in self._shards]

    def _sample(self, request: SampleRequest) -> Any:
        self._check_open()
        transform = request.transform
        spec = self.spec if transform is None else transform.batch_spec(self.spec, self._shards[0].roles)
        gen = self._gen if request.rng is None else request.rng
        masses = self._masses(request)
        totals = np.array([m.total for m in masses], np.float64)
        if not totals.sum() > 0:
            steps = request.num_steps or self._shards[0].sampler.num_steps or 1
            raise NotEnoughDataError(
                f"{self.path}: cannot sample: no shard holds a committed step to draw "
                f"({steps}-step items; call refresh() to see newer commits)"
            )
        counts = split_batch(request.batch_size, totals, request.replacement, gen)
        parts = {
            int(i): sample_store(self._shards[i], replace(request, batch_size=int(counts[i]), rng=gen, return_info=True))
            for i in np.flatnonzero(counts)
        }
        beta = draw_beta(self._shards[0], request)
        return join_parts(spec, parts, totals / totals.sum(), masses, beta, gen, request.return_info)

    def update_priorities(self, shard: Any, step: Any, env: Any, priorities: Any) -> int:
        """New priorities for sampled items (``info.shard``, ``info.step``, ``info.env``
        of :meth:`sample`), each sent to its shard's priority file; returns how many were
        applied (updates for steps a shard's ring has dropped since are skipped)."""
        self._check_open()
        parts = by_shard(self.path, self.num_shards, shard, step, env, priorities)
        for index, part in parts:  # a part one shard refuses changes no other shard
            self._shards[index].sampler.check_update(*part)
        return sum(self._shards[index].update_priorities(*part) for index, part in parts)

    # --- passes -----------------------------------------------------------------------

    def iterate(
        self, batch_size: int | None = None, num_steps: int | None = None, **options: Any
    ) -> Iterator[Any]:
        """One pass over every shard in turn (:meth:`mmreplay.Store.iterate` on each):
        items never span two shards, and each shard's last batch may be smaller."""
        self._check_open()
        for store in self._shards:
            yield from store.iterate(batch_size, num_steps, **options)

    def episodes(self, complete_only: bool = False) -> Iterator[tuple[int, Any]]:
        """``(shard, episode)`` for every episode of every shard, shard by shard."""
        self._check_open()
        for index, store in enumerate(self._shards):
            for episode in store.episodes(complete_only=complete_only):
                yield index, episode

    def joined(self) -> Any:
        """The shards read one after another as one store
        (:class:`mmreplay.joined.JoinedShards`): shard 0's retained steps, then shard
        1's..., episodes kept within their shard; what :meth:`export` writes."""
        from .joined import JoinedShards

        self._check_open()
        return JoinedShards(self)

    def export(self, out: str | os.PathLike, format: str | None = None, **options: Any) -> Any:  # noqa: A002
        """Export every shard's retained committed steps as one dataset
        (:func:`mmreplay.export` of :meth:`joined`; the same options)."""
        from .formats import export

        return export(self.joined(), out, format=format, **options)

    def to_arrays(self) -> dict[str, Any]:
        """:meth:`mmreplay.Store.to_arrays` of every shard, joined shard by shard; the
        key ``shard`` says which shard each row came from."""
        self._check_open()
        parts = [store.to_arrays() for store in self._shards]
        out = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
        rows = [len(part["terminals"]) for part in parts]
        out["shard"] = np.repeat(np.arange(self.num_shards), rows)
        return out


def is_group(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a group's manifest."""
    return os.path.exists(_manifest_path(os.fspath(path)))
