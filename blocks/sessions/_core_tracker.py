"""The sans-IO core of sticky sessions, the worker's side: what a worker tracks.

The worker knows every session it hosts: opened by the proxy's start,
touched by each request carrying the session's id, ended by an explicit
terminate, after ``idle_timeout`` with no request in flight (a WebSocket
in flight keeps its session alive however quiet it is), or all of a
replica's at once when the replica is drained past its time
(:meth:`SessionTracker.drain`; the ids are kept, at most ``max_sessions``,
so that a later request of one hears why). Memory is bounded
by the replicas' capacities and ``max_sessions``. Sessions sit in an ordered
dict by last activity, so expiry looks at the oldest only: O(1) per session
touched or ended.

The replicas are those the worker lists (given at construction, each with
its own ``max_sessions``) and those it reaches by their route (one an
autoscaler started: taken on with :meth:`SessionTracker.add` when the proxy
first opens or ends a session there, with no limit of their own). Past
``max_added`` of the latter, those hosting no session are forgotten when
another is added: the names that stay host a session each, so they are
bounded by ``max_sessions`` too.

Invariants: a replica's ``active`` count is the number of its sessions in
the dict, never above its capacity (when it has one), and the sessions in
all stay within ``max_sessions``; ``revision`` grows with every change of
the sessions hosted. Sans-IO like :mod:`blocks.sessions._core` (the proxy's
side): no trio, ``now`` passed in.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import attrs

from blocks._common import finite


@attrs.frozen(kw_only=True)
class WorkerSessionConfig:
    """How a worker keeps sessions.

    - ``idle_timeout``: a session with no request in flight for this long
      ends (its token then gets a 410).
    - ``max_sessions``: sessions the worker keeps in all (a bound on memory,
      whatever the replicas' own limits).
    """

    idle_timeout: float = attrs.field(default=300.0, validator=[attrs.validators.gt(0), finite])
    max_sessions: int = attrs.field(default=100_000, validator=attrs.validators.ge(1))


class _Session:
    __slots__ = ("in_flight", "last_active", "replica")

    def __init__(self, replica: str, now: float) -> None:
        self.replica = replica
        self.in_flight = 0
        self.last_active = now


@attrs.frozen
class TrackerStatistics:
    """``active``: sessions per replica now; ``capacity``: per replica (0: no
    limit); ``opened``; ``ended``: by reason (``idle``, ``terminated``, ``drained``);
    ``refused``: starts refused because the replica (or worker) was full;
    ``unknown``: requests naming a session the worker does not host (410s)."""

    active: dict[str, int]
    capacity: dict[str, int]
    opened: int
    ended: dict[str, int]
    refused: int
    unknown: int


class SessionTracker:
    """A worker's sessions: which replica hosts each, what is in flight, when each goes idle.

    ``capacities``: replica -> the most sessions it hosts at once (0: no
    limit but the worker's ``max_sessions``): the worker's own list.
    :meth:`add` takes on a replica the worker reaches by its route; at most
    ``max_added`` of those are kept that host no session.
    """

    def __init__(
        self, capacities: Mapping[str, int], config: WorkerSessionConfig | None = None, *, max_added: int = 4096
    ) -> None:
        self.config = config = config or WorkerSessionConfig()
        self.capacities = dict(capacities)
        self.max_added = max_added
        self._added: set[str] = set()  # replicas taken on by add(), not in the worker's own list
        self._held: dict[str, int] = {}  # the proxy's limit for a replica with none of its own (hold)
        self._active: dict[str, int] = dict.fromkeys(capacities, 0)
        self._sessions: collections.OrderedDict[str, _Session] = collections.OrderedDict()  # oldest activity first
        self._idle = config.idle_timeout
        self._opened = self._refused = self._unknown = 0
        self.revision = 0
        """Bumped by every change of the sessions hosted: what orders the worker's words to a proxy."""
        self._ended = {"idle": 0, "terminated": 0}
        self._why: collections.OrderedDict[str, str] = collections.OrderedDict()  # drained sessions -> why, bounded

    def __repr__(self) -> str:
        return f"<SessionTracker sessions={len(self._sessions)} replicas={len(self.capacities)}>"

    def active(self, replica: str) -> int:
        return self._active.get(replica, 0)

    def add(self, replica: str, capacity: int = 0) -> None:
        """Keep sessions for ``replica`` too: one its worker reaches by its route (no-op if known).

        ``capacity``: the most sessions it hosts at once (0, for a replica
        whose limit the worker is not told: none but ``max_sessions``). With
        ``max_added`` replicas added already, those hosting no session are
        forgotten first (a name comes back with its next start), so a flood
        of names cannot grow the tracker.
        """
        if replica in self.capacities:
            return
        added = self._added
        if len(added) >= self.max_added:
            active = self._active
            for name in [name for name in added if not active[name]]:
                added.discard(name)
                del self.capacities[name], active[name]
                self._held.pop(name, None)
        added.add(replica)
        self.capacities[replica] = capacity
        self._active[replica] = 0

    def hold(self, replica: str, limit: int) -> None:
        """Hold ``replica`` to ``limit`` sessions (the proxy's ``max_per_replica`` for its app, its latest
        word), unless the worker lists it with a ``max_sessions`` of its own. A known replica only.
        ``capacities`` (what the worker reports) stay the replicas' own limits: a proxy's estimate
        takes the smaller of the worker's figure and its own limit, so echoing its limit back
        would keep an old one after the proxy raised it."""
        if replica in self.capacities and not self.capacities[replica]:
            self._held[replica] = limit

    def open(self, session: str, replica: str, now: float) -> bool:
        """Host ``session`` on ``replica``; False if the replica (or the worker) is full.

        Opening a session that is already open on that replica is a no-op
        that succeeds (a start retried after a lost answer).
        """
        existing = self._sessions.get(session)
        if existing is not None:
            return existing.replica == replica
        capacity = self.capacities.get(replica)
        if capacity is None:
            raise KeyError(replica)
        capacity = capacity or self._held.get(replica, 0)
        if (capacity and self._active[replica] >= capacity) or len(self._sessions) >= self.config.max_sessions:
            self._refused += 1
            return False
        if self._why:
            self._why.pop(session, None)  # (ids are random: only a retried start of a drained one)
        self._sessions[session] = _Session(replica, now)
        self._active[replica] += 1
        self._opened += 1
        self.revision += 1
        return True

    def begin(self, session: str, replica: str, now: float) -> bool:
        """A request of ``session`` for ``replica`` starts; False if the worker does not host it there."""
        state = self._sessions.get(session)
        if state is None or state.replica != replica:
            self._unknown += 1
            return False
        state.in_flight += 1
        state.last_active = now
        self._sessions.move_to_end(session)
        return True

    def end(self, session: str, now: float) -> None:
        """A request of ``session`` ended (however it ended)."""
        state = self._sessions.get(session)
        # None: terminated meanwhile, nothing left to count. 0: the request began on an earlier
        # session of that id (terminated, then opened again); counting it would take in_flight
        # below 0, and a session with a non-zero in_flight never expires.
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1
            state.last_active = now
            self._sessions.move_to_end(session)

    def terminate(self, session: str) -> str | None:
        """End ``session`` now; the replica that hosted it, or None if there was none.

        Requests of the session already in flight run to their end; new ones
        get a 410.
        """
        state = self._sessions.pop(session, None)
        if state is None:
            return None
        self._active[state.replica] -= 1
        self._ended["terminated"] += 1
        self.revision += 1
        return state.replica

    def end_replica(self, replica: str, reason: str) -> list[str]:
        """End every session ``replica`` hosts now (it is lost, or drained), counted in ``ended[reason]``.

        The sessions ended. Their requests already in flight run to their
        end (the caller ends what it must); new ones get a 410. O(sessions
        hosted by the worker): a loss or a drain is rare.
        """
        if not self._active.get(replica):
            return []
        ended = [session for session, state in self._sessions.items() if state.replica == replica]
        for session in ended:
            del self._sessions[session]
        self._active[replica] = 0
        self._ended[reason] = self._ended.get(reason, 0) + len(ended)
        self.revision += 1
        return ended

    def drain(self, replica: str) -> list[str]:
        """:meth:`end_replica` for a replica drained past its time (reason ``drained``), remembering why.

        The worker ends their WebSockets itself; a later request of one
        gets a 410 whose reason, :meth:`why`, is ``drained``. At most
        ``max_sessions`` such ids are kept, the oldest forgotten first.
        """
        ended = self.end_replica(replica, "drained")
        why = self._why
        for session in ended:
            why[session] = "drained"
        while len(why) > self.config.max_sessions:
            why.popitem(last=False)
        return ended

    def why(self, session: str) -> str | None:
        """Why ``session``, which this worker no longer hosts, ended, if it knows: ``drained``; else None."""
        return self._why.get(session)

    def expire(self, now: float) -> list[tuple[str, str]]:
        """End the sessions idle for ``idle_timeout``: their ``(session, replica)``."""
        ended = []
        sessions = self._sessions
        limit = now - self._idle
        busy: list[str] = []
        while sessions:
            session, state = next(iter(sessions.items()))
            if state.last_active > limit:
                break
            if state.in_flight:
                busy.append(session)  # alive while a request is in flight; looked at again when it ends
                sessions.move_to_end(session)
                if len(busy) >= len(sessions):
                    break
                continue
            del sessions[session]
            self._active[state.replica] -= 1
            ended.append((session, state.replica))
        if ended:
            self._ended["idle"] += len(ended)
            self.revision += 1
        return ended

    def statistics(self) -> TrackerStatistics:
        return TrackerStatistics(
            dict(self._active),
            dict(self.capacities),
            self._opened,
            dict(self._ended),
            self._refused,
            self._unknown,
        )
