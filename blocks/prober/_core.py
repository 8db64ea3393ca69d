"""Load: what each replica has in flight, and what the fleet should be. Sans-IO.

No trio, no clock of its own, no network: every time is an argument
(``now``, ``taken_at``, seconds on one monotonic clock), and the trio driver
that polls workers is :mod:`blocks.prober`.

Theory of operation
-------------------
A worker knows exactly how many requests each of its replicas has in flight
(it counts them as it relays them) and how many its replicas take
(``LocalReplica(capacity=...)``). It answers ``GET /.proxyblocks/load`` with
that, and a prober in each proxy polls every worker once a ``interval``.

A snapshot is out of date the moment it is taken, and a proxy that routed by
it alone would send every request of the next interval to the replica that
looked the freest, and so would every other proxy: the "free" replica gets a
pile. So :class:`LoadEstimator` corrects each snapshot by what this proxy did
since::

    estimate = max(0, snapshot.in_flight + dispatched_since - completed_since)

where ``dispatched_since`` and ``completed_since`` count the
:meth:`~LoadEstimator.dispatched` and :meth:`~LoadEstimator.completed` calls
for that replica made after the snapshot was applied. Each proxy thus sees
its own requests at once and the other proxies' at the next snapshot.

Invariant: if a snapshot is exact when it is applied (it counts every request
then in flight at the replica), the estimate stays equal to the replica's
true in-flight count, however this proxy's dispatches and completions
interleave, until some *other* proxy changes the replica's load. The error
comes only from other proxies (bounded by what they do in one interval) and
from requests that crossed the poll's round trip (a dispatch counted here but
not yet arrived at the worker when it answered, or a completion the worker
had already seen); both vanish at the next snapshot. The estimate never goes
below 0: a completion that would take it there is one the snapshot had
already seen, and is not counted (so it cannot eat into later dispatches).

A snapshot that goes stale (its worker stopped answering) is dropped by
:meth:`~LoadEstimator.expire`, and the replica falls back to what this proxy
knows by itself: its own in-flight count as the estimate, and no free
capacity (``None``, unknown), so that :class:`ProberAware` prefers replicas
it knows have room over one it can no longer see.

The autoscale signal the prober feeds is its own core, ``_core_signal``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from blocks._common import finite

if TYPE_CHECKING:
    from blocks.http import Request
    from blocks.routing import Policy, Replica


# -- the load document ----------------------------------------------------------------------


@attrs.frozen
class ReplicaLoad:
    """One replica's line in a worker's load document. ``capacity`` 0 is unknown.

    ``sessions``, ``session_capacity`` (0: no limit) and ``session_revision``
    (the tracker's revision, which orders the worker's words) are there when
    the worker keeps sessions (:class:`~blocks.sessions.SessionTracker`);
    ``sessions`` is None otherwise.
    """

    in_flight: int
    capacity: int = 0
    sessions: int | None = None
    session_capacity: int = 0
    session_revision: int = 0


@attrs.frozen
class LoadReport:
    """A worker's answer to :data:`LOAD_PATH`."""

    worker: str
    replicas: dict[str, ReplicaLoad]


def encode_load(worker: str, replicas: Mapping[str, ReplicaLoad]) -> bytes:
    """The JSON body of a load answer::

    {"worker": "worker", "replicas": {"replica-0": {"in_flight": 3, "capacity": 8}}}

    with ``"sessions"``, ``"session_capacity"`` and ``"session_revision"``
    added to a replica's object when the worker keeps sessions.
    """
    lines: dict[str, dict[str, int]] = {}
    for name, load in replicas.items():
        line = lines[name] = {"in_flight": load.in_flight, "capacity": load.capacity}
        if load.sessions is not None:
            line["sessions"] = load.sessions
            line["session_capacity"] = load.session_capacity
            line["session_revision"] = load.session_revision
    return json.dumps({"worker": worker, "replicas": lines}, separators=(",", ":")).encode()


class _MalformedLoad(ValueError):
    pass


def _count(value: object, what: str) -> int:
    if type(value) is not int or value < 0:
        raise _MalformedLoad(f"{what} must be a non-negative integer, not {value!r}")
    return value


def parse_load(data: bytes) -> LoadReport:
    """Parse a load answer; ``ValueError`` if it is not exactly that shape."""
    document = json.loads(data)
    if not isinstance(document, dict):
        raise _MalformedLoad("a load document is a JSON object")
    worker = document.get("worker")
    replicas = document.get("replicas")
    if not isinstance(worker, str) or not isinstance(replicas, dict):
        raise _MalformedLoad("a load document has a string 'worker' and an object 'replicas'")
    parsed: dict[str, ReplicaLoad] = {}
    for name, load in replicas.items():
        if not isinstance(load, dict):
            raise _MalformedLoad(f"replica {name!r}: not an object")
        sessions = load.get("sessions")
        parsed[name] = ReplicaLoad(
            _count(load.get("in_flight"), f"replica {name!r} in_flight"),
            _count(load.get("capacity", 0), f"replica {name!r} capacity"),
            None if sessions is None else _count(sessions, f"replica {name!r} sessions"),
            _count(load.get("session_capacity", 0), f"replica {name!r} session_capacity"),
            _count(load.get("session_revision", 0), f"replica {name!r} session_revision"),
        )
    return LoadReport(worker, parsed)


# -- the estimator --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ProberConfig:
    """How often workers are polled, and when their snapshots stop counting. Seconds.

    - ``interval``: one poll of every worker per interval, all at once.
    - ``timeout``: the most one poll may take (connect, head and body); at
      most ``interval``, so that rounds never overlap.
    - ``stale_after``: a snapshot older than this is dropped, and its replica
      falls back to local counts; at least ``interval``.
    """

    interval: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    timeout: float = attrs.field(default=0.5, validator=[attrs.validators.gt(0), finite])
    stale_after: float = attrs.field(default=5.0, validator=[attrs.validators.gt(0), finite])

    def __attrs_post_init__(self) -> None:
        if self.timeout > self.interval:
            raise ValueError(f"timeout ({self.timeout!r}) must not exceed interval ({self.interval!r})")
        if self.stale_after < self.interval:
            raise ValueError(f"stale_after ({self.stale_after!r}) must be at least interval ({self.interval!r})")


@attrs.frozen
class ReplicaEstimate:
    """One replica as a :class:`LoadEstimator` sees it.

    ``snapshot``/``capacity``/``taken_at`` are the last fresh snapshot's
    (``None``/0/``None`` without one); ``age`` is ``now - taken_at`` when
    :meth:`LoadEstimator.statistics` was given ``now``; ``dispatched_since`` and
    ``completed_since`` count this proxy's calls since that snapshot;
    ``local_in_flight`` is this proxy's own count; ``estimate`` and ``free``
    are what :meth:`LoadEstimator.estimate` and :meth:`LoadEstimator.free`
    return.
    """

    snapshot: int | None
    capacity: int
    taken_at: float | None
    age: float | None
    dispatched_since: int
    completed_since: int
    local_in_flight: int
    estimate: int
    free: int | None


@attrs.frozen
class LoadStatistics:
    replicas: dict[str, ReplicaEstimate]
    snapshots: int
    expired: int


class _State:
    __slots__ = ("capacity", "completed", "dispatched", "local", "snapshot", "taken_at")

    def __init__(self) -> None:
        self.snapshot: int | None = None  # None: no fresh snapshot
        self.capacity = 0
        self.taken_at: float | None = None
        self.dispatched = 0  # since the snapshot
        self.completed = 0  # since the snapshot
        self.local = 0  # this proxy's own in-flight count


class LoadEstimator:
    """Per replica: the last snapshot, corrected by this proxy's dispatches and completions since.

    The proxy calls :meth:`dispatched` when it routes a request to a replica
    and :meth:`completed` when that exchange ends (exactly once each, on
    every path: next to its own in-flight count). The prober calls
    :meth:`snapshot` with what a worker reported, and :meth:`expire` once a
    round. Policies read :meth:`estimate` and :meth:`free`. All calls are
    synchronous and O(1) but :meth:`expire` and :meth:`statistics`.
    """

    def __init__(self) -> None:
        self._replicas: dict[str, _State] = {}
        self._snapshots = 0
        self._expired = 0

    def __repr__(self) -> str:
        fresh = sum(1 for state in self._replicas.values() if state.snapshot is not None)
        return f"<LoadEstimator replicas={len(self._replicas)} fresh={fresh}>"

    def _state(self, name: str) -> _State:
        state = self._replicas.get(name)
        if state is None:
            state = self._replicas[name] = _State()
        return state

    # -- the proxy's side: the request path ---------------------------------------------------

    def dispatched(self, name: str) -> None:
        """This proxy has just routed a request to replica ``name``."""
        state = self._state(name)
        state.dispatched += 1
        state.local += 1

    def completed(self, name: str) -> None:
        """A request this proxy routed to replica ``name`` is over (however it ended)."""
        state = self._state(name)
        if state.snapshot is None or state.snapshot + state.dispatched > state.completed:
            state.completed += 1
        # else: the estimate is 0 already, so the snapshot had seen this one
        # end; counting it would only eat into the next dispatches.
        if state.local > 0:
            state.local -= 1

    def estimate(self, name: str) -> int:
        """Requests in flight at ``name`` by the last snapshot and this proxy's calls since.

        Without a fresh snapshot, this proxy's own in-flight count.
        """
        state = self._replicas.get(name)
        if state is None:
            return 0
        if state.snapshot is None:
            return state.local
        return max(0, state.snapshot + state.dispatched - state.completed)

    def free(self, name: str, capacity: int = 0) -> int | None:
        """``capacity - estimate``, or ``None`` when unknown; negative when over capacity.

        The capacity is the fresh snapshot's, else ``capacity`` (say, the
        route table's), else unknown. Without a fresh snapshot it is unknown
        whatever ``capacity`` says: this proxy alone cannot tell how much of
        it the others use.
        """
        state = self._replicas.get(name)
        if state is None or state.snapshot is None:
            return None
        capacity = state.capacity or capacity
        if capacity <= 0:
            return None
        return capacity - max(0, state.snapshot + state.dispatched - state.completed)

    # -- the prober's side -------------------------------------------------------------------

    def snapshot(self, name: str, in_flight: int, capacity: int, now: float, taken_at: float) -> bool:
        """Apply what replica ``name``'s worker reported: ``in_flight`` and ``capacity`` (0: unknown).

        ``taken_at`` is when the poll was sent, ``now`` when its answer
        arrived. The counts since the snapshot restart from zero. A snapshot
        taken before the one already held is ignored (a slow answer overtaken
        by a newer one); the return value says whether it was applied.
        """
        if in_flight < 0 or capacity < 0:
            raise ValueError(f"in_flight ({in_flight!r}) and capacity ({capacity!r}) must not be negative")
        if taken_at > now:
            raise ValueError(f"taken_at ({taken_at!r}) is after now ({now!r})")
        state = self._state(name)
        if state.taken_at is not None and taken_at < state.taken_at:
            return False
        state.snapshot = in_flight
        state.capacity = capacity
        state.taken_at = taken_at
        state.dispatched = state.completed = 0
        self._snapshots += 1
        return True

    def expire(self, now: float, stale_after: float) -> list[str]:
        """Drop the snapshots taken more than ``stale_after`` before ``now``; their names.

        Those replicas fall back to local counts (see :meth:`estimate` and
        :meth:`free`). A replica with no snapshot and nothing in flight here
        is forgotten altogether, so that replicas that left the fleet do not
        accumulate.
        """
        expired: list[str] = []
        idle: list[str] = []
        for name, state in self._replicas.items():
            if state.snapshot is not None and state.taken_at is not None and now - state.taken_at > stale_after:
                state.snapshot = None
                state.capacity = 0
                state.dispatched = state.completed = 0
                expired.append(name)
            if state.snapshot is None and state.local == 0:
                idle.append(name)
        for name in idle:
            del self._replicas[name]
        self._expired += len(expired)
        return expired

    def forget(self, name: str) -> None:
        """Drop everything known about replica ``name``."""
        self._replicas.pop(name, None)

    def statistics(self, now: float | None = None) -> LoadStatistics:
        replicas = {}
        for name, state in self._replicas.items():
            age = None if now is None or state.taken_at is None or state.snapshot is None else now - state.taken_at
            replicas[name] = ReplicaEstimate(
                snapshot=state.snapshot,
                capacity=state.capacity,
                taken_at=state.taken_at if state.snapshot is not None else None,
                age=age,
                dispatched_since=state.dispatched,
                completed_since=state.completed,
                local_in_flight=state.local,
                estimate=self.estimate(name),
                free=self.free(name),
            )
        return LoadStatistics(replicas, self._snapshots, self._expired)


# -- the policy -----------------------------------------------------------------------------


class ProberAware:
    """The candidate with the most free capacity by a :class:`LoadEstimator`. Satisfies ``Policy``.

    Candidates are ranked in three tiers:

    1. known to have room (``free > 0``): the most free first;
    2. free capacity unknown (no fresh snapshot, or no capacity known
       anywhere): as :class:`~blocks.routing.LeastInFlight` would;
    3. known to be full or over (``free <= 0``): the least over first.

    Within a tier, equal candidates go to the one with the fewest requests in
    flight by the proxy's ``in_flight`` mapping, then at random. A replica's
    capacity is its snapshot's, else the route table's ``Replica.capacity``.
    A full fleet still gets a pick: capacity here is an estimate, and a hard
    cap is the fair scheduler's job. Reads memory only, never awaits.
    """

    def __init__(self, estimator: LoadEstimator, rng: random.Random | None = None) -> None:
        self.estimator = estimator
        self._random = (rng or random.Random()).random

    def __repr__(self) -> str:
        return f"<ProberAware {self.estimator!r}>"

    def _key(self, replica: Replica, in_flight: Mapping[str, int]) -> tuple[int, int, int]:
        name = replica.name
        free = self.estimator.free(name, replica.capacity)
        load = in_flight.get(name, 0)
        if free is None:
            return (1, 0, load)
        return (0 if free > 0 else 2, -free, load)

    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        best = candidates[0]
        if len(candidates) == 1:
            return best
        best_key = self._key(best, in_flight)
        ties = 1
        rand = self._random
        for replica in candidates[1:]:
            key = self._key(replica, in_flight)
            if key < best_key:
                best, best_key, ties = replica, key, 1
            elif key == best_key:
                ties += 1
                if rand() * ties < 1:  # reservoir sampling: each tie equally likely
                    best = replica
        return best


if TYPE_CHECKING:

    def _satisfies_policy(estimator: LoadEstimator) -> Policy:
        return ProberAware(estimator)  # mypy checks that ProberAware is a Policy
