"""Episode spans as arrays, made from end records and carried along a moving window.

The episode index (:mod:`mmreplay.episodes.index`) asks for the spans of its store's
window after every step a writer adds; these functions let it compute them once per
commit and move them along as the window grows and the ring drops old steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .index_file import BOUNDARY, TERMINATED, TRUNCATED

STATUS = {TERMINATED: "terminated", TRUNCATED: "truncated"}


@dataclass(frozen=True)
class Spans:
    """Episode spans as arrays, env by env, each env's in time order.

    ``code`` is how the span really ended (0 still running); ``cut`` marks a first span
    whose beginning the ring overwrote. Both make the status ``"open"`` when set/zero.
    """

    env: np.ndarray
    first: np.ndarray
    last: np.ndarray
    code: np.ndarray
    cut: np.ndarray

    def __len__(self) -> int:
        return len(self.env)

    @property
    def length(self) -> np.ndarray:
        return self.last - self.first + 1

    @property
    def complete(self) -> np.ndarray:
        return (self.code > 0) & ~self.cut

    def status(self, i: int) -> str:
        return STATUS[int(self.code[i])] if self.code[i] and not self.cut[i] else "open"

    def ended(self, i: int) -> str:
        return STATUS[int(self.code[i])] if self.code[i] else "running"

    def select(self, mask: np.ndarray) -> Spans:
        return Spans(self.env[mask], self.first[mask], self.last[mask], self.code[mask], self.cut[mask])


def empty_spans() -> Spans:
    z = np.zeros(0, np.int64)
    return Spans(z, z, z, np.zeros(0, np.uint8), np.zeros(0, bool))


def open_streams(first: int, end: int, num_envs: int) -> Spans:
    """The spans of a store without end roles: each env's retained stream is one open episode."""
    if end <= first:
        return empty_spans()
    zeros = np.zeros(num_envs, np.int64)
    return Spans(np.arange(num_envs, dtype=np.int64), zeros + first, zeros + end - 1, np.zeros(num_envs, np.uint8), np.zeros(num_envs, bool))


def from_records(rec: np.ndarray, first: int, end: int, num_envs: int, origin: int | None) -> Spans:
    """The spans of the window ``[first, end)`` from its end records (those of the step
    before it too, if known: records are complete for steps ``>= origin``)."""
    E = num_envs
    if end <= first:
        return empty_spans()
    envs_all = np.arange(E, dtype=np.int64)
    steps = rec["step"]
    lo, mid, hi = np.searchsorted(steps, [first - 1, first, end], side="left")
    # Did the step before the window end an episode? Then the window starts a fresh one.
    fresh = np.zeros(E, bool)
    if first == 0:
        fresh[:] = True
    elif origin is not None and origin <= first - 1:
        fresh[rec["env"][lo:mid]] = True
    inside = rec[mid:hi]
    order = np.lexsort((inside["step"], inside["env"]))
    st = inside["step"][order].astype(np.int64)
    ev = inside["env"][order].astype(np.int64)
    cd = inside["code"][order]
    new_env = np.ones(len(st), bool)
    new_env[1:] = ev[1:] != ev[:-1]
    prev = np.empty(len(st), np.int64)
    prev[0:1] = first
    prev[1:] = st[:-1] + 1
    starts = np.where(new_env, first, prev)
    cut = new_env & ~fresh[ev]
    # The open tail of each env: after its last end, or the whole stream without ends.
    last_end = np.full(E, first - 1, np.int64)
    has_end = np.zeros(E, bool)
    if len(st):
        tails_idx = np.r_[np.flatnonzero(new_env)[1:] - 1, len(st) - 1]
        last_end[ev[tails_idx]] = st[tails_idx]
        has_end[ev[tails_idx]] = True
    tail = last_end + 1 <= end - 1
    t_env = envs_all[tail]
    env = np.r_[ev, t_env]
    first_a = np.r_[starts, last_end[tail] + 1]
    last_a = np.r_[st, np.full(len(t_env), end - 1, np.int64)]
    code = np.r_[cd, np.zeros(len(t_env), np.uint8)].astype(np.uint8)
    cut_a = np.r_[cut, ~has_end[tail] & ~fresh[tail]]
    # Boundary rows belong to no episode: drop them from the span they close.
    boundary = code == BOUNDARY
    keep = slice(None)
    if boundary.any():
        last_a = np.where(boundary, last_a - 1, last_a)
        code = np.where(boundary, TRUNCATED, code).astype(np.uint8)
        keep = last_a >= first_a
    spans = Spans(env, first_a, last_a, code, cut_a).select(keep)
    return spans.select(np.lexsort((spans.first, spans.env)))


def moved_start(spans: Spans, was: int, first: int, heads: np.ndarray | None = None) -> Spans:
    """The spans of a window that starts at ``first`` instead of ``was`` (later): those that
    ended before it are gone, and the one each env is in at ``first`` lost its start (cut),
    unless it starts there. ``heads``: where each env's first span is, if known."""
    if first == was or not len(spans):
        return spans
    if heads is None:
        heads = np.flatnonzero(np.concatenate(([True], spans.env[1:] != spans.env[:-1])))
    if (spans.last[heads] < first).any():  # some are gone: a prefix of each env's spans
        ends = np.append(heads[1:], len(spans))
        kept = [(h + int(np.searchsorted(spans.last[h:e], first)), e) for h, e in zip(heads.tolist(), ends.tolist())]
        kept = [(a, e) for a, e in kept if a < e]
        if len(kept) == 1:  # one env's spans: views, not copies
            spans = spans.select(slice(*kept[0]))
        else:
            spans = spans.select(np.concatenate([np.arange(a, e) for a, e in kept] or [np.zeros(0, np.int64)]))
        heads = np.cumsum([0] + [e - a for a, e in kept[:-1]])
    starts, cut = spans.first.copy(), spans.cut.copy()
    cut[heads] |= starts[heads] < first
    starts[heads] = np.maximum(starts[heads], first)
    return Spans(spans.env, starts, spans.last, spans.code, cut)


def running_tails(spans: Spans, num_envs: int, end: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Where each env's first and last span are, if every env has spans and its last one
    is still running at ``end - 1``."""
    if not len(spans):
        return None
    change = spans.env[1:] != spans.env[:-1]
    tails = np.flatnonzero(np.append(change, True))
    if len(tails) != num_envs or (spans.code[tails] != 0).any() or (spans.last[tails] != end - 1).any():
        return None
    return np.flatnonzero(np.concatenate(([True], change))), tails


def advanced(spans: Spans, was: tuple[int, int], now: tuple[int, int], ends: tuple[np.ndarray, np.ndarray]) -> Spans:
    """The spans of window ``now`` from those of the earlier window ``was``, when no step
    added since ended an episode and each env's last episode was running (``ends``: each
    env's first and last span): the running ones reach the newest step."""
    heads, tails = ends
    if now[1] != was[1]:
        last = spans.last.copy()
        last[tails] = now[1] - 1
        spans = Spans(spans.env, spans.first, last, spans.code, spans.cut)
    return moved_start(spans, was[0], now[0], heads)


def joined(spans: Spans, tail: Spans, closed: np.ndarray) -> Spans:
    """``spans`` (of the steps before ``lo``) with ``tail``, the spans of the steps from
    ``lo`` on: each env's first tail span that continues an episode running at ``lo - 1``
    is joined to it. ``closed``: the envs whose step ``lo`` is a boundary row, which ends
    the episode running at ``lo - 1`` and belongs to none."""
    # each env's first tail span that continues an episode running at lo - 1
    starts = np.r_[True, tail.env[1:] != tail.env[:-1]] & tail.cut if len(tail) else np.zeros(0, bool)
    last_of = np.searchsorted(spans.env, tail.env, side="right") - 1  # that env's last span before lo
    joins = starts & (last_of >= 0)
    joins[joins] = (spans.env[last_of[joins]] == tail.env[joins]) & (spans.code[last_of[joins]] == 0)
    code, last = spans.code.copy(), spans.last.copy()
    code[last_of[joins]], last[last_of[joins]] = tail.code[joins], tail.last[joins]
    at_lo = np.searchsorted(spans.env, closed, side="right") - 1
    closed, at_lo = closed[at_lo >= 0], at_lo[at_lo >= 0]
    at_lo = at_lo[spans.env[at_lo] == closed]
    code[at_lo[code[at_lo] == 0]] = TRUNCATED
    rest = tail.select(~joins)
    if not len(rest):
        return Spans(spans.env, spans.first, last, code, spans.cut)
    # the new spans go after their env's last one: one placement for every field
    new = np.searchsorted(spans.env, rest.env, side="right") + np.arange(len(rest))
    old = np.ones(len(spans) + len(rest), bool)
    old[new] = False

    def placed(kept: np.ndarray, added: np.ndarray) -> np.ndarray:
        out = np.empty(len(old), kept.dtype)
        out[old], out[new] = kept, added
        return out

    return Spans(
        placed(spans.env, rest.env),
        placed(spans.first, rest.first),
        placed(last, rest.last),
        placed(code, rest.code),
        placed(spans.cut, rest.cut),
    )
