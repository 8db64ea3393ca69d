"""Routing policies: which of an app's replicas takes a request. The extension point.

A policy is any object with a synchronous ``pick(request, candidates,
in_flight)``; there is no base class. The proxy calls it on the request path
with the app's candidates (never empty) and its own in-flight counts per
replica name, so a pick must stay cheap: each policy here is one pass over
the candidates at most, with no allocation on the common path, and
:class:`LeastInFlight`, :class:`PowerOfTwo` and :class:`RoundRobin` are
usually O(1).

Sans-IO: no trio, no clock. ``Request`` is imported for type checking only.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Protocol

from blocks.routing import _rendezvous
from blocks.routing._table import Replica

if TYPE_CHECKING:
    from blocks.http import Request


class Policy(Protocol):
    """Chooses one replica among the candidates for a request.

    - **When it runs:** on the request path, once the proxy has an app with
      at least one candidate. It may run more than once for one request.
    - ``candidates``: the app's replicas (live ones, outliers already set
      aside), never empty, in a stable order. Do not keep or mutate it.
    - ``in_flight``: this proxy's requests in flight per replica name, never
      negative; a name may be missing (read it with ``.get(name, 0)``).
    - **Returns** one of ``candidates``; the proxy does not check.
    - **Must not** await, block or do I/O.
    """

    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica: ...


_SAMPLE_FROM = 16  # LeastInFlight looks for an idle replica by sampling from this many candidates
_SAMPLES = 8


class LeastInFlight:
    """The candidate with the fewest requests in flight; ties broken uniformly at random.

    With many candidates it first draws a few at random and takes the first
    idle one (nothing in flight is a minimum; the first idle draw is uniform
    over the idle ones), so a mostly idle pool costs O(1). Otherwise one
    pass, with reservoir sampling over the ties. Pass a seeded
    ``random.Random`` for reproducible picks.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = (rng or random.Random()).random

    def __repr__(self) -> str:
        return "LeastInFlight()"

    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        n = len(candidates)
        best = candidates[0]
        if n == 1:
            return best
        get = in_flight.get
        rand = self._random
        if n >= _SAMPLE_FROM:
            for _ in range(_SAMPLES):
                replica = candidates[int(rand() * n)]
                if not get(replica.name, 0):
                    return replica
        best_load = get(best.name, 0)
        ties = 1
        for replica in islice(candidates, 1, None):
            load = get(replica.name, 0)
            if load < best_load:
                best, best_load, ties = replica, load, 1
            elif load == best_load:
                ties += 1
                if rand() * ties < 1:  # reservoir sampling: each tie equally likely
                    best = replica
        return best


class PowerOfTwo:
    """Power of two choices: two distinct candidates at random, the one with fewer in flight.

    O(1) whatever the pool's size, and nearly as good as least in-flight at
    spreading load; it never picks the most loaded candidate when that one
    is alone at the top. A tie goes to either, at random.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = (rng or random.Random()).random

    def __repr__(self) -> str:
        return "PowerOfTwo()"

    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        rand = self._random
        i = int(rand() * n)
        j = int(rand() * (n - 1))
        if j >= i:
            j += 1
        a, b = candidates[i], candidates[j]
        return b if in_flight.get(b.name, 0) < in_flight.get(a.name, 0) else a


_MAX_ROTATIONS = 4096


class RoundRobin:
    """Each candidate in turn, whatever its load; one rotation per app.

    An app is told apart by its first candidate's name (``pick`` does not
    receive the app), so each app's rotation is exact while its candidates
    stay the same. Rotations are forgotten once there are more than 4096 of
    them, which bounds memory while replicas come and go.
    """

    def __init__(self) -> None:
        self._turns: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"RoundRobin(rotations={len(self._turns)})"

    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        n = len(candidates)
        if n == 1:
            return candidates[0]
        turns = self._turns
        key = candidates[0].name
        turn = turns.get(key)
        if turn is None:
            if len(turns) >= _MAX_ROTATIONS:
                turns.clear()
            turn = 0
        elif turn >= n:
            turn %= n
        turns[key] = turn + 1
        return candidates[turn]


class _Seeds:
    """One candidates tuple's replica seeds, in its order."""

    __slots__ = ("candidates", "seeds", "serial")

    def __init__(self, candidates: Sequence[Replica], seeds: list[int], serial: int) -> None:
        self.candidates = candidates  # held, so that its id() stays its own while this lives
        self.seeds = seeds
        self.serial = serial


_MAX_TABLES = 256
_MAX_SEEDS = 65536


class AffinityHash:
    """The same affinity key to the same replica while it lives: rendezvous hashing with bounded load.

    The key is the first ``header`` field of the request. Its replica is the
    one with the highest rendezvous score (see ``_rendezvous``), unless that
    one has more in flight than ``ceil(load_factor * mean)``, the mean over
    the candidates before this request: then the next in score order that
    does not takes it. So no replica goes above that bound plus one while
    another has room, and a key stays put through a few concurrent requests
    even when the pool is nearly idle. Replicas that come or go move only
    the keys that were on them, or that they now win (about 1/N). A request
    without the key goes to ``fallback`` (default :class:`LeastInFlight`).

    ``load_factor`` (at least 1) trades stickiness for balance: 1 keeps
    loads closest to even, larger lets hot keys stay put longer.

    Costs: an unseen key scores every candidate (one multiplication each).
    The replica seeds of the last 256 candidates tuples are kept (a
    :class:`RouteCache` hands out the same tuple until the app changes), and
    so is the first choice of up to ``remember`` recent keys, by the key's
    hash (never the key itself: its size is the client's choice). A
    remembered key whose replica has at most one request in flight costs
    O(1); a busier one, a pass to sum the loads.
    """

    def __init__(
        self,
        header: bytes = b"x-affinity-key",
        load_factor: float = 1.25,
        fallback: Policy | None = None,
        *,
        remember: int = 4096,
    ) -> None:
        if not (math.isfinite(load_factor) and load_factor >= 1):
            raise ValueError(f"load_factor must be finite and at least 1, not {load_factor!r}")
        if remember < 0:
            raise ValueError(f"remember must be >= 0, not {remember!r}")
        self.header = header.lower()
        self.load_factor = load_factor
        self.fallback: Policy = fallback if fallback is not None else LeastInFlight()
        self._remember = remember
        self._tables: dict[int, _Seeds] = {}  # id(candidates tuple) -> its seeds
        self._serial = 0
        self._first: dict[int, tuple[int, int]] = {}  # key hash -> (table serial, index of its first choice)
        self._seeds: dict[str, int] = {}  # replica name -> seed

    def __repr__(self) -> str:
        return f"AffinityHash(header={self.header!r}, load_factor={self.load_factor!r}, fallback={self.fallback!r})"

    def _seed(self, name: str) -> int:
        seed = self._seeds.get(name)
        if seed is None:
            if len(self._seeds) >= _MAX_SEEDS:
                self._seeds.clear()
            seed = self._seeds[name] = _rendezvous.replica_seed(name)
        return seed

    def _table(self, candidates: Sequence[Replica]) -> _Seeds:
        table = self._tables.get(id(candidates))
        if table is None or table.candidates is not candidates:
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            self._serial += 1
            table = _Seeds(candidates, [self._seed(replica.name) for replica in candidates], self._serial)
            self._tables[id(candidates)] = table
        return table

    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        key = request.header(self.header)
        if not key:
            return self.fallback.pick(request, candidates, in_flight)
        n = len(candidates)
        if n == 1:
            return candidates[0]
        hashed = _rendezvous.key_hash(key)
        ranked: list[int] | None = None
        if type(candidates) is tuple:  # immutable: its seeds and first choices can be kept
            table = self._table(candidates)
            seeds = table.seeds
            known = self._first.get(hashed)
            if known is not None and known[0] == table.serial:
                first = known[1]
            else:
                ranked = _rendezvous.scores(hashed, seeds)
                first = ranked.index(max(ranked))
                if self._remember:
                    if len(self._first) >= self._remember:
                        self._first.clear()
                    self._first[hashed] = (table.serial, first)
        else:  # a list may change under us: nothing kept but the seeds by name
            seeds = [self._seed(replica.name) for replica in candidates]
            ranked = _rendezvous.scores(hashed, seeds)
            first = ranked.index(max(ranked))
        replica = candidates[first]
        get = in_flight.get
        if get(replica.name, 0) <= 1:
            # Within the bound whatever the others hold: with this one's request in flight the
            # mean is above 0, so the bound is at least 1. No need to sum.
            return replica
        loads = [get(r.name, 0) for r in candidates]
        bound = math.ceil(self.load_factor * sum(loads) / n)
        if loads[first] <= bound:
            return replica
        # Over the bound: the next choices in score order, usually the second or third. One pass
        # each over the scores, not a sort of them all.
        if ranked is None:
            ranked = _rendezvous.scores(hashed, seeds)
        for _ in range(n - 1):
            ranked[first] = -1
            first = ranked.index(max(ranked))
            if loads[first] <= bound:
                return candidates[first]
        # Unreachable with load_factor >= 1 and counts >= 0 (the least loaded is at most the mean); but be total.
        return candidates[loads.index(min(loads))]
