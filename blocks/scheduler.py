"""The fair scheduler: who gets the next upstream stream slot.

Pooled, multiplexed upstream connections are shared by every tenant. This
block stands in front of a pool and grants its stream slots so that a tenant
that floods the proxy cannot take every slot while a quiet one waits.

Theory of operation
-------------------

:class:`FairQueue` is the sans-IO core: synchronous, no trio, time passed in
as ``now`` (any monotonic float clock). It owns a slot *budget* (the total
number of streams it may have open upstream) and, per tenant, an in-flight
count, an optional cap, and a bounded FIFO of waiting :class:`Ticket`\\ s with a
deadline each. :class:`Scheduler` is its trio driver: one per upstream (or
per pool), made by :func:`open_scheduler`.

- A request asks first with ``try_acquire(tenant)``: a slot is granted at
  once when the total is under budget and the tenant under its cap. It never
  jumps a queue: see the invariant below.
- Otherwise it ``enqueue``\\ s a ticket (429 :class:`QueueFull` when the
  tenant's queue is full) and waits. Each ``release`` of a grant hands the
  freed slot to the next eligible ticket, chosen by priority class, then by
  deficit round robin (DRR) among the tenants of that class.
- ``expire(now)`` rejects the tickets whose deadline passed (503
  :class:`QueueTimeout`); ``cancel(ticket)`` withdraws one whose owner gave up.

Priority classes (``TenantPolicy.priority``, lower first) are strict: a slot
goes to the best class that has an eligible waiter. Fairness applies within a
class. A low class can therefore be starved by a busy higher one: that is
what strict priority means, so use it for classes that must win (control
traffic, paid tiers), not for fairness.

Why deficit round robin
-----------------------

DRR keeps, per priority class, a deque of the backlogged tenants and a
*deficit* per tenant. The tenant at the head receives ``quantum * weight``
of credit when its turn starts, takes one slot per unit of credit, and goes
to the back of the deque when less than one unit is left. Every decision is
O(1) (amortised over lazily deleted tickets), plus a scan of the priority
classes, which are few and fixed by the configuration. Over any interval in
which a tenant stays backlogged, its share of the grants is within one
quantum (of its weighted credit) plus one grant of its weight share.

Virtual-time weighted fair queueing (WFQ, WF2Q) has a tighter bound but
needs a priority queue of finish tags (O(log n) per decision) and careful
virtual-clock bookkeeping when tenants come and go. Every request here costs
one slot, the unit DRR is at its best with, so the quantum-sized error is a
couple of grants: not worth the heap and the float drift.

The effective quantum is ``max(quantum, 1 / smallest configured weight)`` so
that every turn grants at least one slot: that is what keeps a decision O(1)
when weights are below one. Weight *ratios* are unchanged.

Invariants
----------

- ``in_flight <= budget`` and, per tenant, ``in_flight <= max_in_flight``.
- **No idle budget while someone eligible waits.** After every call, if the
  total is under budget, no waiting ticket belongs to a tenant under its cap:
  ``enqueue`` and ``release`` hand out free slots before they return. That is
  why ``try_acquire`` only checks the budget and the tenant's cap, and still
  never overtakes a waiter that could have been served. (A tenant at its own
  cap waits for its own grants; others may pass it.)
- A ticket is resolved exactly once: granted, cancelled or expired. A tenant
  leaves the round robin when its queue empties or it reaches its cap, and
  its deficit is reset then, so an idle tenant never hoards credit.
- Memory is bounded: a tenant with nothing in flight and nothing queued is
  kept in an LRU of at most ``max_tenants`` states (with its counters), then
  forgotten; queue waits are sampled in a ring of ``wait_samples`` per tenant.
  Cancelled tickets are deleted lazily, and the queues and the deadline heap
  are compacted when dead entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Literal, cast

import attrs
import outcome
import trio

from blocks._sync import Signal
from blocks.errors import BlocksError

if TYPE_CHECKING:
    from blocks.http import Headers, Request

# -- configuration --------------------------------------------------------------------------


def _finite(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be finite, not {value!r}")


@attrs.frozen(kw_only=True)
class TenantPolicy:
    """How one tenant (or every tenant without a policy of its own) is treated.

    - ``weight``: its share of the slots relative to the other backlogged
      tenants of its priority class.
    - ``max_in_flight``: at most this many slots at once (``None``: only the
      budget limits it).
    - ``max_queued``: at most this many requests waiting; one more is a 429
      (:class:`QueueFull`). ``0`` means never wait: no free slot is a 429.
    - ``queue_timeout``: seconds a request may wait; past it, a 503
      (:class:`QueueTimeout`).
    - ``priority``: its class; lower is served first, strictly.
    - ``retry_after``: seconds to put in ``retry-after`` on a rejection.
    """

    weight: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), _finite])
    max_in_flight: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    max_queued: int = attrs.field(default=100, validator=attrs.validators.ge(0))
    queue_timeout: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), _finite])
    priority: int = 0
    retry_after: float = attrs.field(default=1.0, validator=[attrs.validators.ge(0), _finite])


def _read_only(tenants: Mapping[str, TenantPolicy]) -> Mapping[str, TenantPolicy]:
    return MappingProxyType(dict(tenants))


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """The slots of one upstream and the policies of the tenants sharing them.

    - ``budget``: total slots (streams open upstream at once).
    - ``default_policy``: for every tenant not named in ``tenants``.
    - ``tenants``: tenant key -> its own policy (copied, read-only).
    - ``quantum``: credit per round-robin turn, in grants per unit of weight
      (raised to ``1 / smallest weight`` if lower; see the module docstring).
    - ``max_tenants``: idle tenant states kept (with their counters) before
      the least recently used are forgotten.
    - ``wait_samples``: recent queue waits kept per tenant for percentiles.
    """

    budget: int = attrs.field(validator=attrs.validators.ge(1))
    default_policy: TenantPolicy = attrs.field(
        factory=TenantPolicy, validator=attrs.validators.instance_of(TenantPolicy)
    )
    tenants: Mapping[str, TenantPolicy] = attrs.field(
        factory=dict,
        converter=_read_only,
        validator=attrs.validators.deep_mapping(
            key_validator=attrs.validators.instance_of(str),
            value_validator=attrs.validators.instance_of(TenantPolicy),
        ),
    )
    quantum: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), _finite])
    max_tenants: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    wait_samples: int = attrs.field(default=256, validator=attrs.validators.ge(1))

    def policy(self, tenant: str) -> TenantPolicy:
        """The policy that applies to ``tenant``."""
        return self.tenants.get(tenant, self.default_policy)


# -- errors -----------------------------------------------------------------------------------


def _retry_after_headers(retry_after: float) -> Headers:
    return [(b"retry-after", b"%d" % math.ceil(retry_after))]


class QueueFull(BlocksError):
    """The tenant's wait queue is full: 429, with ``retry-after``.

    ``retry_after`` is the tenant's ``TenantPolicy.retry_after`` in seconds;
    ``headers`` is the ``retry-after`` field to send with the 429 (whole
    seconds, rounded up).
    """

    status = 429

    def __init__(self, message: str, *, tenant: str, retry_after: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after = retry_after
        self.headers = _retry_after_headers(retry_after)


class QueueTimeout(BlocksError):
    """The request waited its tenant's whole ``queue_timeout`` without a slot: 503.

    Carries ``retry_after`` and ``headers`` like :class:`QueueFull`.
    """

    status = 503

    def __init__(self, message: str, *, tenant: str, retry_after: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.retry_after = retry_after
        self.headers = _retry_after_headers(retry_after)


# -- the sans-IO core -------------------------------------------------------------------------

TicketState = Literal["waiting", "granted", "cancelled", "expired"]
_WAITING: Final = "waiting"


class _Tenant:
    """One tenant's bookkeeping. Private: tickets and grants point at it."""

    __slots__ = (
        "cap",
        "deficit",
        "granted",
        "in_flight",
        "in_round",
        "klass",
        "name",
        "policy",
        "queue",
        "rejected_deadline",
        "rejected_full",
        "wait_next",
        "waiting",
        "waits",
        "weight",
    )

    def __init__(self, name: str, policy: TenantPolicy, klass: _Class) -> None:
        self.name = name
        self.policy = policy
        self.cap = policy.max_in_flight
        self.weight = policy.weight
        self.klass = klass
        self.in_flight = 0
        self.waiting = 0  # live tickets; ``queue`` may also hold dead ones
        self.queue: deque[Ticket] = deque()
        self.in_round = False
        self.deficit = 0.0
        self.granted = 0
        self.rejected_full = 0
        self.rejected_deadline = 0
        self.waits: array[float] | None = None  # allocated on the first wait
        self.wait_next = 0

    def drop_dead(self) -> None:
        """Pop cancelled and expired tickets off the front; compact if they pile up behind."""
        queue = self.queue
        while queue and queue[0].state != _WAITING:
            queue.popleft()
        if len(queue) > 2 * self.waiting + 16:
            self.queue = deque(ticket for ticket in queue if ticket.state == _WAITING)


class _Class:
    """A priority class: the round robin of its eligible tenants."""

    __slots__ = ("current", "priority", "round")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.round: deque[_Tenant] = deque()  # eligible tenants waiting for their turn
        self.current: _Tenant | None = None  # the tenant whose turn it is (credited)


class Grant:
    """One upstream slot held by ``tenant``. Give it back with ``release``.

    Releasing a grant twice is harmless (the second release does nothing), so
    a ``finally`` and an on-close callback may both release it.
    """

    __slots__ = ("_state", "released")

    def __init__(self, state: _Tenant) -> None:
        self._state = state
        self.released = False

    @property
    def tenant(self) -> str:
        return self._state.name

    def __repr__(self) -> str:
        return f"<Grant {self._state.name!r}{' released' if self.released else ''}>"


class Ticket:
    """A place in a tenant's queue.

    ``state`` is ``"waiting"`` until the ticket is resolved, exactly once, as
    ``"granted"`` (then ``grant`` holds the slot), ``"cancelled"`` or
    ``"expired"``. ``deadline`` is on the clock the core was given.
    """

    __slots__ = ("_state", "deadline", "enqueued_at", "grant", "state")

    def __init__(self, state: _Tenant, now: float) -> None:
        self._state = state
        self.enqueued_at = now
        self.deadline = now + state.policy.queue_timeout
        self.state: TicketState = "waiting"
        self.grant: Grant | None = None

    @property
    def tenant(self) -> str:
        return self._state.name

    def __repr__(self) -> str:
        return f"<Ticket {self._state.name!r} {self.state} deadline={self.deadline:g}>"


@attrs.frozen
class TenantStatistics:
    """One tenant's counters.

    ``granted`` counts every grant, immediate or after a wait;
    ``rejected_full`` the 429s, ``rejected_deadline`` the 503s. The wait
    percentiles (seconds, nearest rank) are over the most recent grants that
    had to queue (``None`` if none did); an immediate grant waits no time and
    is not sampled.
    """

    in_flight: int
    queued: int
    granted: int
    rejected_full: int
    rejected_deadline: int
    queue_wait_p50: float | None
    queue_wait_p99: float | None


@attrs.frozen
class SchedulerStatistics:
    """A snapshot of a :class:`FairQueue` (or :class:`Scheduler`).

    The totals include tenants whose idle state was forgotten; ``tenants``
    holds the ones still remembered.
    """

    budget: int
    in_flight: int
    queued: int
    granted: int
    rejected_full: int
    rejected_deadline: int
    tenants: Mapping[str, TenantStatistics]


def _percentile(ordered: list[float], fraction: float) -> float:
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


class FairQueue:
    """The sans-IO slot scheduler. See the module docstring for the rules.

    Not thread-safe; every method is synchronous and never blocks. ``now`` is
    any monotonic clock in seconds, the same for every call.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._budget = config.budget
        weights = [config.default_policy.weight, *(policy.weight for policy in config.tenants.values())]
        self.quantum: float = max(config.quantum, 1.0 / min(weights))
        """The effective quantum (see the module docstring)."""
        priorities = {config.default_policy.priority, *(policy.priority for policy in config.tenants.values())}
        self._classes = [_Class(priority) for priority in sorted(priorities)]
        self._class_of = {klass.priority: klass for klass in self._classes}
        self._tenants: dict[str, _Tenant] = {}
        self._idle: OrderedDict[str, _Tenant] = OrderedDict()  # LRU of idle tenant states
        self._in_flight = 0
        self._waiting = 0
        self._in_round = 0  # tenants in some class's round robin (some may be stale)
        self._deadlines: list[tuple[float, int, Ticket]] = []  # a heap; dead entries deleted lazily
        self._sequence = 0
        self._forgotten = [0, 0, 0]  # granted, rejected_full, rejected_deadline of forgotten tenants

    def __repr__(self) -> str:
        return (
            f"<FairQueue in_flight={self._in_flight}/{self._budget} queued={self._waiting} "
            f"tenants={len(self._tenants)}>"
        )

    @property
    def in_flight(self) -> int:
        """Slots granted and not yet released."""
        return self._in_flight

    @property
    def queued(self) -> int:
        """Tickets waiting."""
        return self._waiting

    def _state(self, name: str) -> _Tenant:
        state = self._tenants.get(name)
        if state is None:
            self._forget(self.config.max_tenants - 1)
            policy = self.config.policy(name)
            state = _Tenant(name, policy, self._class_of[policy.priority])
            self._tenants[name] = state
            self._idle[name] = state
        return state

    def _became_idle(self, state: _Tenant) -> None:
        # A state evicted while a stale round-robin entry still pointed at it
        # is no longer registered: leave the newer one alone.
        if self._tenants.get(state.name) is state:
            self._idle[state.name] = state
            if len(self._tenants) > self.config.max_tenants:
                self._forget(self.config.max_tenants)

    def _forget(self, keep: int) -> None:
        """Forget the least recently used idle tenants until at most ``keep`` remain (or none is idle)."""
        tenants, idle, forgotten = self._tenants, self._idle, self._forgotten
        while len(tenants) > keep and idle:
            name, state = idle.popitem(last=False)
            del tenants[name]
            forgotten[0] += state.granted
            forgotten[1] += state.rejected_full
            forgotten[2] += state.rejected_deadline

    # -- granting ----------------------------------------------------------------------------

    def try_acquire(self, tenant: str) -> Grant | None:
        """A slot for ``tenant`` now, or ``None`` if it would have to wait.

        Granted when the total is under budget and the tenant under its cap.
        By the invariant of this module that also means nobody who could be
        served is waiting, so this never jumps a queue. It takes no ``now``:
        the decision does not depend on time, and the hot path saves a clock
        read. It neither counts nor creates a tenant when the budget is full.
        """
        if self._in_flight >= self._budget:
            return None
        state = self._tenants.get(tenant)
        if state is None:
            state = self._state(tenant)
        elif state.cap is not None and state.in_flight >= state.cap:
            return None
        if state.in_flight == 0 and state.waiting == 0:
            del self._idle[tenant]
        state.in_flight += 1
        state.granted += 1
        self._in_flight += 1
        return Grant(state)

    def enqueue(self, tenant: str, now: float) -> Ticket:
        """A place in ``tenant``'s queue, with a deadline ``queue_timeout`` after ``now``.

        Raises :class:`QueueFull` (429, counted) when the tenant already has
        ``max_queued`` tickets waiting. If a slot can be granted at once (the
        caller did not try :meth:`try_acquire` first), the returned ticket is
        already ``"granted"``: check ``ticket.grant``.
        """
        state = self._state(tenant)
        policy = state.policy
        if state.waiting >= policy.max_queued:
            state.rejected_full += 1
            raise QueueFull(
                f"tenant {tenant!r} already has {state.waiting} requests waiting for an upstream slot",
                tenant=tenant,
                retry_after=policy.retry_after,
            )
        if state.in_flight == 0 and state.waiting == 0:
            del self._idle[tenant]
        ticket = Ticket(state, now)
        state.queue.append(ticket)
        state.waiting += 1
        self._waiting += 1
        self._sequence += 1
        heapq.heappush(self._deadlines, (ticket.deadline, self._sequence, ticket))
        if not state.in_round and (state.cap is None or state.in_flight < state.cap):
            self._join_round(state)
        if self._in_flight < self._budget:
            # By the invariant, the only eligible waiter is this new ticket.
            self._dispatch(now, [])
        return ticket

    def release(self, grant: Grant, now: float) -> list[Ticket]:
        """Give ``grant``'s slot back; returns the tickets granted by it, in grant order.

        Each returned ticket is ``"granted"`` with its ``grant`` set: wake
        their owners. ``now`` timestamps their waits. Releasing a grant that
        was already released does nothing and returns ``[]``.
        """
        if grant.released:
            return []
        grant.released = True
        state = grant._state
        state.in_flight -= 1
        self._in_flight -= 1
        if state.waiting:
            if not state.in_round:
                self._join_round(state)
        elif state.in_flight == 0:
            self._became_idle(state)
        granted: list[Ticket] = []
        if self._in_round:
            self._dispatch(now, granted)
        return granted

    def _join_round(self, state: _Tenant) -> None:
        state.in_round = True
        state.klass.round.append(state)
        self._in_round += 1

    def _leave_round(self, state: _Tenant, klass: _Class) -> None:
        state.in_round = False
        state.deficit = 0.0
        klass.current = None
        self._in_round -= 1
        if state.waiting == 0 and state.in_flight == 0:
            self._became_idle(state)

    def _dispatch(self, now: float, granted: list[Ticket]) -> None:
        """Grant free slots to eligible waiters: best class first, DRR within it."""
        budget = self._budget
        quantum = self.quantum
        for klass in self._classes:
            while True:
                if self._in_flight >= budget:
                    return
                state = klass.current
                if state is None:
                    if not klass.round:
                        break  # nobody eligible in this class: try the next one
                    state = klass.round.popleft()
                    state.deficit += quantum * state.weight  # its turn starts
                    klass.current = state
                if state.waiting == 0 or (state.cap is not None and state.in_flight >= state.cap):
                    self._leave_round(state, klass)
                    continue
                if state.deficit < 1.0:  # its turn is over
                    klass.round.append(state)
                    klass.current = None
                    continue
                state.deficit -= 1.0
                state.drop_dead()
                ticket = state.queue.popleft()
                state.waiting -= 1
                self._waiting -= 1
                state.in_flight += 1
                state.granted += 1
                self._in_flight += 1
                ticket.state = "granted"
                ticket.grant = Grant(state)
                self._record_wait(state, now - ticket.enqueued_at)
                granted.append(ticket)

    def _record_wait(self, state: _Tenant, wait: float) -> None:
        waits = state.waits
        if waits is None:
            waits = state.waits = array("d")
        if len(waits) < self.config.wait_samples:
            waits.append(wait)
        else:
            waits[state.wait_next] = wait
            state.wait_next = (state.wait_next + 1) % len(waits)

    # -- giving up -------------------------------------------------------------------------------

    def cancel(self, ticket: Ticket) -> bool:
        """Withdraw a waiting ticket; True if it was waiting.

        Its place is freed at once (lazily deleted from the queue). A ticket
        that was already granted is left alone: its owner must release
        ``ticket.grant`` instead. Cancelling is not counted as a rejection.
        """
        if ticket.state != _WAITING:
            return False
        ticket.state = "cancelled"
        self._withdraw(ticket._state)
        return True

    def _withdraw(self, state: _Tenant) -> None:
        state.waiting -= 1
        self._waiting -= 1
        state.drop_dead()
        if state.waiting == 0 and state.in_flight == 0:
            self._became_idle(state)
        deadlines = self._deadlines
        if len(deadlines) > 2 * self._waiting + 64:
            self._deadlines = [entry for entry in deadlines if entry[2].state == _WAITING]
            heapq.heapify(self._deadlines)

    def expire(self, now: float) -> list[Ticket]:
        """Reject (as ``"expired"``, counted) every waiting ticket whose deadline is ``<= now``.

        Returns them in deadline order: answer each with :class:`QueueTimeout`
        (503). A ticket is only expired here: a release that comes first
        grants it, even if its deadline has just passed.
        """
        expired: list[Ticket] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            ticket = heapq.heappop(deadlines)[2]
            if ticket.state == _WAITING:
                ticket.state = "expired"
                ticket._state.rejected_deadline += 1
                self._withdraw(ticket._state)
                deadlines = self._deadlines  # _withdraw may have compacted it
                expired.append(ticket)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting ticket, or ``None``: when to call :meth:`expire`."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][2].state != _WAITING:
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    # -- observing -------------------------------------------------------------------------------

    def statistics(self) -> SchedulerStatistics:
        tenants: dict[str, TenantStatistics] = {}
        totals = list(self._forgotten)
        for name, state in self._tenants.items():
            ordered = sorted(state.waits) if state.waits else []
            tenants[name] = TenantStatistics(
                in_flight=state.in_flight,
                queued=state.waiting,
                granted=state.granted,
                rejected_full=state.rejected_full,
                rejected_deadline=state.rejected_deadline,
                queue_wait_p50=_percentile(ordered, 0.5) if ordered else None,
                queue_wait_p99=_percentile(ordered, 0.99) if ordered else None,
            )
            totals[0] += state.granted
            totals[1] += state.rejected_full
            totals[2] += state.rejected_deadline
        return SchedulerStatistics(
            budget=self._budget,
            in_flight=self._in_flight,
            queued=self._waiting,
            granted=totals[0],
            rejected_full=totals[1],
            rejected_deadline=totals[2],
            tenants=MappingProxyType(tenants),
        )


# -- the trio driver --------------------------------------------------------------------------


class Scheduler:
    """A :class:`FairQueue` on trio's clock, with waiting. Use :func:`open_scheduler`.

    The pool asks it before opening a stream::

        grant = scheduler.try_acquire(tenant)      # the hot path: sync, no wait
        if grant is None:
            grant = await scheduler.acquire(tenant)  # waits its turn, or 429/503
        try:
            ...open the stream; hand scheduler.release(grant) to call_on_close...
        except BaseException:
            scheduler.release(grant)
            raise

    Deadlines are enforced by one background task of :func:`open_scheduler`
    that sleeps until the earliest one, not by a cancel scope per waiter.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._queue = FairQueue(config)
        self._waiters: dict[Ticket, trio.lowlevel.Task] = {}
        self._wake = Signal()
        self._armed = math.inf
        self._running = False

    def __repr__(self) -> str:
        return f"<Scheduler {self._queue!r} waiters={len(self._waiters)}>"

    def try_acquire(self, tenant: str) -> Grant | None:
        """A slot now, or ``None``: a plain synchronous call, never a checkpoint."""
        return self._queue.try_acquire(tenant)

    async def acquire(self, tenant: str) -> Grant:
        """A slot for ``tenant``, waiting its turn if need be.

        Raises :class:`QueueFull` (429) at once when the tenant's queue is
        full, :class:`QueueTimeout` (503) when its ``queue_timeout`` passes
        first, ``trio.ClosedResourceError`` if the scheduler is closed while
        waiting. Always a checkpoint. Cancel-safe: cancelled while waiting, the
        request leaves the queue and holds nothing; once this returns, the
        caller holds the grant and must release it.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        queue = self._queue
        grant = queue.try_acquire(tenant)
        if grant is None:
            if not self._running:
                raise trio.ClosedResourceError("the scheduler is not running: use open_scheduler")
            try:
                ticket = queue.enqueue(tenant, trio.current_time())
            except QueueFull:
                await trio.lowlevel.cancel_shielded_checkpoint()
                raise
            if ticket.grant is None:
                return await self._wait(ticket)
            grant = ticket.grant
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()
        except BaseException:
            self.release(grant)
            raise
        return grant

    async def _wait(self, ticket: Ticket) -> Grant:
        self._waiters[ticket] = trio.lowlevel.current_task()
        if ticket.deadline < self._armed:
            self._wake.set()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._waiters.pop(ticket, None)
            if not self._queue.cancel(ticket) and ticket.grant is not None:
                # Granted but not delivered: cannot happen with this driver,
                # which grants and wakes in one step; never leak the slot.
                self.release(ticket.grant)
            return trio.lowlevel.Abort.SUCCEEDED

        return cast(Grant, await trio.lowlevel.wait_task_rescheduled(abort))

    def release(self, grant: Grant) -> None:
        """Give a slot back and wake the waiters it goes to. Sync; releasing twice is harmless."""
        queue = self._queue
        if not queue.queued:
            # Nobody waits, so nobody is granted and ``now`` is not read:
            # the hot path skips the clock.
            queue.release(grant, 0.0)
            return
        for ticket in queue.release(grant, trio.current_time()):
            task = self._waiters.pop(ticket, None)
            if task is None:  # its owner is gone (cannot happen; see _wait)
                self.release(cast(Grant, ticket.grant))
            else:
                trio.lowlevel.reschedule(task, outcome.Value(ticket.grant))

    def statistics(self) -> SchedulerStatistics:
        return self._queue.statistics()

    async def _expire_forever(self) -> None:
        queue = self._queue
        while True:
            deadline = queue.next_deadline()
            self._armed = math.inf if deadline is None else deadline
            with trio.move_on_at(self._armed):
                await self._wake.wait()
            for ticket in queue.expire(trio.current_time()):
                task = self._waiters.pop(ticket, None)
                if task is not None:
                    policy = ticket._state.policy
                    error = QueueTimeout(
                        f"tenant {ticket.tenant!r} waited {policy.queue_timeout}s for an upstream slot",
                        tenant=ticket.tenant,
                        retry_after=policy.retry_after,
                    )
                    trio.lowlevel.reschedule(task, outcome.Error(error))

    def _close(self) -> None:
        self._running = False
        waiters, self._waiters = self._waiters, {}
        for ticket, task in waiters.items():
            self._queue.cancel(ticket)
            trio.lowlevel.reschedule(task, outcome.Error(trio.ClosedResourceError("the scheduler was closed")))


@asynccontextmanager
async def open_scheduler(config: SchedulerConfig) -> AsyncIterator[Scheduler]:
    """A running :class:`Scheduler` for the ``async with`` block.

    Owns one task that expires overdue waiters. Leaving the block fails the
    requests still waiting with ``trio.ClosedResourceError``; grants held
    may still be released afterwards.
    """
    scheduler = Scheduler(config)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler._expire_forever)
            scheduler._running = True
            try:
                yield scheduler
            finally:
                scheduler._close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The nursery wraps what the body raised; hand back the error itself.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


# -- tenant keys ------------------------------------------------------------------------------

TenantKey = Callable[["Request"], str]
"""Which tenant a request belongs to: a header, a token's tenant claim, the app..."""


def header_tenant(name: bytes = b"x-tenant", default: str = "default", *, max_length: int = 64) -> TenantKey:
    """A :data:`TenantKey` that reads header ``name`` (latin-1).

    An absent, empty or longer than ``max_length`` value gives ``default``,
    so that a client cannot grow the tenant table with huge keys. Trust the
    header only if a hop you run sets it (or strips it from clients): anyone
    who can pick their tenant can pick many and take many shares.
    """
    name = name.lower()

    def key(request: Request) -> str:
        for field, value in request.headers:
            if field == name:
                if 0 < len(value) <= max_length:
                    return value.decode("latin-1")
                return default
        return default

    return key
