"""The sans-IO core of sticky sessions: where a new session goes, and who waits for a place.

No trio, no clock of its own: ``now`` is passed in (any monotonic float
clock). The proxy's driver (:mod:`blocks.sessions._broker`) and the worker
(:class:`blocks.Worker`) put these on trio's clock and the network.

Placing (the proxy: :class:`SessionPlacer`)
--------------------------------------------

A replica hosts at most ``capacity`` sessions. The worker is the authority on
how many it hosts now (it opens, counts and ends them); the proxy keeps an
estimate per replica, ``active + pending``:

- ``active`` is the worker's latest word: the answer to a session start or a
  terminate, or a load report the prober fetched. Each replaces the last.
- ``pending`` counts the starts this proxy sent and has not heard back from.

A start reserves the replica with the most free places (free = capacity -
active - pending; a replica whose capacity is not known yet counts as free),
so concurrent starts never all pick the same last place. The worker still
has the last word: if its replica is full after all (another proxy filled
it), the start is refused there and the proxy tries again with what the
refusal told it.

Waiting
-------

When no replica of the app has a free place, the start waits in the app's
queue: bounded (``queue_size``; beyond it a 429), with a deadline
(``queue_timeout``; then a 503). The queue is fair between tenants: one
deque of tickets per tenant, served round robin, FIFO within a tenant, so a
tenant opening many sessions cannot push a quiet one to the back.
:meth:`SessionPlacer.grant` hands free places to waiters in that order, and
a new start never takes a place while someone of its app waits (it joins the
queue instead): nobody is overtaken.

Tracking, the worker's side, is :mod:`blocks.sessions._core_tracker`.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import attrs

from blocks._common import finite
from blocks.errors import QueueFull, QueueTimeout

if TYPE_CHECKING:
    from blocks.routing import Replica, SessionSetting


def _apps(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, (str, bytes)):
        raise TypeError("apps is a collection of app names, not one string")
    return frozenset(value)


def _lower_bytes(value: bytes | str) -> bytes:
    return (value.encode() if isinstance(value, str) else value).lower()


def _optional_bytes(value: bytes | str | None) -> bytes | None:
    return None if value is None else _lower_bytes(value)


# -- the proxy's side ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SessionConfig:
    """Which apps are sessioned, and how the proxy starts and reads their sessions.

    - ``apps``: the sessioned apps (their requests may carry a session token;
      ``POST /.proxyblocks/sessions`` on their domains starts one).
    - ``ttl``: seconds a session token is valid. A session ends before that
      if its worker ends it (idle, terminated); the token then gets a 410.
    - ``max_per_replica``: sessions per replica as the proxy caps them
      (0: only the worker's own ``max_sessions`` limit applies).
    - ``queue_size``: starts that may wait for a place, per app (429 beyond).
    - ``queue_timeout``: seconds a start waits for a place (503 after).
    - ``retry_after``: the ``retry-after`` seconds of those 429s and 503s.
    - ``header``, ``cookie``: where a client's session token is read (the
      header first, then the cookie; ``cookie=None``: no cookie).
    - ``set_cookie``: the start's answer also sets that cookie (``Path=/``,
      ``SameSite=Strict``), so a browser's page and WebSocket carry it.
    - ``require_auth``: a start needs a valid proxy-auth token for the app
      (``authorization: Bearer``), whether or not the proxy's ``auth``
      protects the app's other requests (so a sessioned app's pages may be
      public while only starts are not). A session token, once minted,
      opens its app on its own.
    - ``on_replica_loss``: what a request of a session whose replica is
      lost gets: ``"fail"``, a ``session_lost`` answer (the client starts a
      new session), or ``"restart"``: the proxy starts a new session of the
      app on another replica and sends the request there (the app's
      sessions may move; the answer carries the new token).

    An app may also be sessioned by its route store settings (a
    :class:`~blocks.routing.SessionSetting` in its ``apps/<app>/settings``
    record, or ``[apps.NAME] sessions`` in a config file), whose fields
    override ``ttl``, ``max_per_replica``, ``queue_size``, ``queue_timeout``
    and ``on_replica_loss`` for that app (:meth:`for_app`).
    """

    apps: frozenset[str] = attrs.field(converter=_apps)
    ttl: float = attrs.field(default=3600.0, validator=[attrs.validators.gt(0), finite])
    max_per_replica: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    queue_size: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    queue_timeout: float = attrs.field(default=10.0, validator=[attrs.validators.ge(0), finite])
    retry_after: float = attrs.field(default=1.0, validator=[attrs.validators.ge(0), finite])
    header: bytes = attrs.field(default=b"proxyblocks-session", converter=_lower_bytes)
    cookie: bytes | None = attrs.field(default=b"proxyblocks-session", converter=_optional_bytes)
    set_cookie: bool = True
    require_auth: bool = True
    on_replica_loss: Literal["fail", "restart"] = attrs.field(
        default="fail", validator=attrs.validators.in_(("fail", "restart"))
    )

    def for_app(self, setting: SessionSetting | None = None) -> AppSessions:
        """One app's limits: these defaults, with the fields ``setting`` (its route store record) sets."""
        if setting is None:
            return AppSessions(
                self.max_per_replica, self.queue_size, self.queue_timeout, self.ttl, self.on_replica_loss
            )
        return AppSessions(
            self.max_per_replica if setting.max_per_replica is None else setting.max_per_replica,
            self.queue_size if setting.queue_size is None else setting.queue_size,
            self.queue_timeout if setting.queue_timeout is None else setting.queue_timeout,
            self.ttl if setting.ttl is None else setting.ttl,
            self.on_replica_loss if setting.on_replica_loss is None else setting.on_replica_loss,  # type: ignore[arg-type]
        )


@attrs.frozen
class AppSessions:
    """One sessioned app's limits, resolved (:meth:`SessionConfig.for_app`)."""

    max_per_replica: int
    queue_size: int
    queue_timeout: float
    ttl: float
    on_replica_loss: Literal["fail", "restart"] = "fail"


TicketState = Literal["waiting", "granted", "cancelled", "expired"]


class SessionTicket:
    """A session start waiting for a place. ``replica`` is set once granted."""

    __slots__ = ("app", "deadline", "replica", "state", "tenant")

    def __init__(self, app: str, tenant: str, deadline: float) -> None:
        self.app = app
        self.tenant = tenant
        self.deadline = deadline
        self.state: TicketState = "waiting"
        self.replica: Replica | None = None

    def __repr__(self) -> str:
        return f"<SessionTicket {self.app}/{self.tenant} {self.state}>"


class _Place:
    """What the proxy believes of one replica's sessions."""

    __slots__ = ("active", "capacity", "full", "pending", "said_at")

    def __init__(self) -> None:
        self.active = 0
        self.capacity = 0  # the worker's max_sessions as it reported it; 0: not known, or no limit
        self.pending = 0
        self.said_at = -math.inf  # the worker's revision behind ``active``
        self.full = False  # the worker refused a start here, whatever the counts say (it is full overall)

    def said(self, active: int, capacity: int, at: float | None, *, full: bool = False) -> None:
        """The worker's word, unless a newer one (a higher revision) was applied already."""
        if at is not None:
            if at < self.said_at:
                return
            if at == self.said_at:
                full = full or self.full  # nothing changed since the worker refused a start here
            self.said_at = at
        self.active = active
        self.capacity = capacity
        self.full = full  # a later word: a refusal may no longer hold


class _Queue:
    """One app's waiting starts: a FIFO per tenant, tenants served round robin.

    A ticket resolved while it waits (cancelled, expired) leaves ``size`` at
    once and its deque lazily; ``dead`` counts those, and the deques are
    compacted when they outnumber the live ones, so memory stays bounded by
    ``queue_size`` even when nothing is granted for a long time.
    """

    __slots__ = ("dead", "order", "size", "tenants")

    def __init__(self) -> None:
        self.tenants: dict[str, collections.deque[SessionTicket]] = {}
        self.order: collections.deque[str] = collections.deque()  # tenants with waiters, next first
        self.size = 0
        self.dead = 0

    def push(self, ticket: SessionTicket, *, front: bool = False) -> None:
        queue = self.tenants.get(ticket.tenant)
        if queue is None:
            queue = self.tenants[ticket.tenant] = collections.deque()
            self.order.append(ticket.tenant)
        if front:
            queue.appendleft(ticket)
        else:
            queue.append(ticket)
        self.size += 1

    def pop(self) -> SessionTicket | None:
        """The next waiting ticket in round-robin order (resolved ones are dropped on the way)."""
        order, tenants = self.order, self.tenants
        while order:
            tenant = order.popleft()
            queue = tenants[tenant]
            while queue:
                ticket = queue.popleft()
                if ticket.state == "waiting":
                    self.size -= 1
                    if queue:
                        order.append(tenant)  # its next turn comes after every other tenant's
                    else:
                        del tenants[tenant]
                    return ticket
                self.dead -= 1
            del tenants[tenant]
        return None

    def drop(self) -> None:
        """A ticket in a deque was resolved (cancelled, expired; its state already says so)."""
        self.size -= 1
        self.dead += 1
        if self.dead > max(self.size, 16):
            tenants = self.tenants
            for tenant in self.order:
                tenants[tenant] = collections.deque(t for t in tenants[tenant] if t.state == "waiting")
            self.order = collections.deque(tenant for tenant in self.order if tenants[tenant])
            for tenant in [tenant for tenant, queue in tenants.items() if not queue]:
                del tenants[tenant]
            self.dead = 0


@attrs.frozen
class ReplicaSessions:
    """One replica's sessions as the proxy estimates them: ``active`` (the worker's
    latest word), ``pending`` starts not answered yet, ``capacity`` (0: no limit known)."""

    active: int
    pending: int
    capacity: int


@attrs.frozen
class SessionStatistics:
    """``started``: sessions started; ``queued``: starts waiting now, per app;
    ``queue_full`` (429s), ``timed_out`` (503s), ``refused_by_worker`` (a worker
    was full after all), ``gone`` (410s), ``terminated``; ``replicas``: the
    estimate per replica; ``restarted``: sessions moved to a new replica
    (``on_replica_loss = "restart"``)."""

    started: int
    queued: dict[str, int]
    queue_full: int
    timed_out: int
    refused_by_worker: int
    gone: int
    terminated: int
    replicas: dict[str, ReplicaSessions]
    restarted: int = 0


class SessionPlacer:
    """The proxy's bookkeeping of session places and the queue for them (see the module docstring)."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self._default = config.for_app()
        self._limits: dict[str, AppSessions] = {}  # an app's own, where its settings give them
        self._places: dict[str, _Place] = {}
        self._queues: dict[str, _Queue] = {app: _Queue() for app in config.apps}
        # (deadline, seq, ticket), resolved ones dropped lazily. A heap, not a FIFO: a requeued
        # ticket keeps its deadline, which is earlier than those of the tickets enqueued since.
        self._deadlines: list[tuple[float, int, SessionTicket]] = []
        self._seq = itertools.count()
        self._started = self._queue_full = self._timed_out = self._refused = self._gone = self._terminated = 0
        self._restarted = 0

    def __repr__(self) -> str:
        return f"<SessionPlacer apps={sorted(self.config.apps)} queued={sum(q.size for q in self._queues.values())}>"

    def _place(self, name: str) -> _Place:
        place = self._places.get(name)
        if place is None:
            place = self._places[name] = _Place()
        return place

    def limits(self, app: str) -> AppSessions:
        """``app``'s limits: its own (:meth:`configure`), else the config's."""
        return self._limits.get(app, self._default)

    def configure(self, app: str, limits: AppSessions | None) -> None:
        """``app`` is sessioned with ``limits`` (None: the config's); its queue is made on first use."""
        if limits is None or limits == self._default:
            self._limits.pop(app, None)
        else:
            self._limits[app] = limits

    def _queue(self, app: str) -> _Queue:
        queue = self._queues.get(app)
        if queue is None:
            queue = self._queues[app] = _Queue()
        return queue

    def _capacity(self, place: _Place, ours: int | None = None) -> int:
        cap = place.capacity
        if ours is None:
            ours = self._default.max_per_replica
        if ours and (not cap or ours < cap):
            return ours
        return cap

    def free(self, name: str, max_per_replica: int | None = None) -> float:
        """Free places on replica ``name`` as estimated now (``inf`` when no limit is known), under
        ``max_per_replica`` (None: the config's)."""
        place = self._places.get(name)
        if place is None:
            ours = self._default.max_per_replica if max_per_replica is None else max_per_replica
            return ours or math.inf
        if place.full:
            return 0
        capacity = self._capacity(place, max_per_replica)
        if not capacity:
            return math.inf
        return max(0, capacity - place.active - place.pending)

    def free_places(self, candidates: Iterable[Replica], max_per_replica: int | None = None) -> float:
        return sum(self.free(replica.name, max_per_replica) for replica in candidates)

    def _reserve(self, app: str, candidates: Sequence[Replica]) -> Replica | None:
        ours = self.limits(app).max_per_replica
        best: Replica | None = None
        best_key = (0.0, 0)
        for replica in candidates:
            free = self.free(replica.name, ours)
            if free <= 0:
                continue
            place = self._places.get(replica.name)
            key = (free, -(place.active + place.pending) if place is not None else 0)
            if best is None or key > best_key:
                best, best_key = replica, key
        if best is not None:
            self._place(best.name).pending += 1
        return best

    def reserve(self, app: str, candidates: Sequence[Replica]) -> Replica | None:
        """A replica of ``app`` with a free place, reserved (one ``pending`` start); None if all are full.

        Never overtakes a waiter: None while anyone waits for ``app``.
        """
        queue = self._queues.get(app)
        if queue is not None and queue.size:
            return None
        return self._reserve(app, candidates)

    def answered(self, name: str, active: int, capacity: int, *, started: bool, at: float | None = None) -> None:
        """The worker answered a start on ``name``: it now hosts ``active`` of ``capacity``.

        ``started``: whether it took the session (False: it was full).
        ``at``: the worker's :attr:`SessionTracker.revision` with that word;
        a word older than the last one applied is stale and ignored (None: apply).
        """
        place = self._place(name)
        place.pending = max(0, place.pending - 1)
        place.said(active, capacity, at, full=not started)
        if started:
            self._started += 1
        else:
            self._refused += 1

    def unanswered(self, name: str) -> None:
        """A start on ``name`` got no answer (connection failed, timeout): its reservation is dropped."""
        place = self._place(name)
        place.pending = max(0, place.pending - 1)

    def observe(self, name: str, active: int, capacity: int, *, at: float | None = None) -> None:
        """The worker's word on ``name`` from a load report or a terminate's answer, at its revision ``at``.

        Answers and polls overtake each other on the way back (a poll the
        worker answered before a start may arrive after the start's answer):
        a word at an older revision than the last applied is ignored.
        """
        self._place(name).said(active, capacity, at)

    def forget(self, keep: Collection[str]) -> None:
        """Drop the estimates of replicas not in ``keep`` (they left the route table); pending ones stay."""
        for name in [name for name, place in self._places.items() if name not in keep and not place.pending]:
            del self._places[name]

    def enqueue(self, app: str, tenant: str, now: float) -> SessionTicket:
        """Wait for a place: a ticket with its deadline; :class:`QueueFull` (429) if the app's queue is full."""
        queue = self._queue(app)
        limits = self.limits(app)
        if queue.size >= limits.queue_size:
            self._queue_full += 1
            raise QueueFull(
                f"{queue.size} session starts already wait for app {app!r}",
                tenant=tenant,
                retry_after=self.config.retry_after,
            )
        ticket = SessionTicket(app, tenant, now + limits.queue_timeout)
        queue.push(ticket)
        self._watch(ticket)
        return ticket

    def _watch(self, ticket: SessionTicket) -> None:
        deadlines = self._deadlines
        if len(deadlines) > 2 * sum(queue.size for queue in self._queues.values()) + 16:
            # Mostly resolved entries (granted, cancelled, duplicates of requeued ones): rebuild.
            seen: set[int] = set()
            live = []
            for entry in deadlines:
                if entry[2].state == "waiting" and id(entry[2]) not in seen:
                    seen.add(id(entry[2]))
                    live.append(entry)
            heapq.heapify(live)
            self._deadlines = deadlines = live
        heapq.heappush(deadlines, (ticket.deadline, next(self._seq), ticket))

    def grant(self, app: str, candidates: Sequence[Replica]) -> list[SessionTicket]:
        """Hand free places of ``app`` to its waiters, round robin by tenant; the tickets granted."""
        queue = self._queues.get(app)
        granted: list[SessionTicket] = []
        if queue is None:
            return granted
        while queue.size:
            replica = self._reserve(app, candidates)
            if replica is None:
                break
            ticket = queue.pop()
            if ticket is None:  # only resolved tickets were left
                self._place(replica.name).pending -= 1
                break
            ticket.state = "granted"
            ticket.replica = replica
            granted.append(ticket)
        return granted

    def requeue(self, ticket: SessionTicket) -> None:
        """A granted ticket whose worker was full after all waits again, first of its tenant, same deadline."""
        ticket.state = "waiting"
        ticket.replica = None
        self._queue(ticket.app).push(ticket, front=True)
        # Its deadline entry may be gone (expire and next_deadline drop a granted ticket's):
        # a second one for the same ticket is harmless, it is resolved once.
        self._watch(ticket)

    def cancel(self, ticket: SessionTicket) -> None:
        """Its owner gave up (the client went away). A granted ticket's reservation is released."""
        state, ticket.state = ticket.state, "cancelled"  # resolved before drop() may compact its deque
        if state == "waiting":
            self._queues[ticket.app].drop()
        elif state == "granted" and ticket.replica is not None:
            self.unanswered(ticket.replica.name)

    def expire(self, now: float) -> list[SessionTicket]:
        """Tickets whose deadline passed: resolved ``expired`` (the driver answers them 503)."""
        expired = []
        deadlines = self._deadlines
        while deadlines and (deadlines[0][2].state != "waiting" or deadlines[0][0] <= now):
            ticket = heapq.heappop(deadlines)[2]
            if ticket.state == "waiting":
                ticket.state = "expired"
                self._queues[ticket.app].drop()
                self._timed_out += 1
                expired.append(ticket)
        return expired

    def timeout_error(self, ticket: SessionTicket) -> QueueTimeout:
        return QueueTimeout(
            f"no session place for app {ticket.app!r} within {self.limits(ticket.app).queue_timeout:g} s",
            tenant=ticket.tenant,
            retry_after=self.config.retry_after,
        )

    def next_deadline(self) -> float | None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].state != "waiting":
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def waiting(self, app: str) -> int:
        queue = self._queues.get(app)
        return queue.size if queue is not None else 0

    def count_gone(self) -> None:
        self._gone += 1

    def count_restarted(self) -> None:
        self._restarted += 1

    def count_terminated(self) -> None:
        self._terminated += 1

    def statistics(self) -> SessionStatistics:
        return SessionStatistics(
            self._started,
            {app: queue.size for app, queue in self._queues.items()},
            self._queue_full,
            self._timed_out,
            self._refused,
            self._gone,
            self._terminated,
            {name: ReplicaSessions(p.active, p.pending, self._capacity(p)) for name, p in self._places.items()},
            self._restarted,
        )
