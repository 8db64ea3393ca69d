"""The fair scheduler's sans-IO core: who gets the next upstream stream slot.

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
- Memory is bounded: at most ``max_tenants`` tenant states (with their
  counters) are remembered, plus any busy beyond that; a new tenant makes room
  by forgetting an idle one, chosen by CLOCK (an approximate LRU whose hot
  path is one attribute store). Busy tenants are never forgotten. Queue waits
  are sampled in a ring of ``wait_samples`` per tenant. Cancelled tickets are
  deleted lazily, and the queues, the round robins and the deadline heap are
  compacted when dead entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import math
from array import array
from collections import deque
from types import MappingProxyType
from typing import Final, Literal

from blocks.errors import QueueFull, QueueTimeout
from blocks.scheduler._core_config import SchedulerConfig, SchedulerStatistics, TenantPolicy, TenantStatistics

__all__ = [  # the configuration, errors and snapshots are re-exported: they are the core's vocabulary
    "FairQueue",
    "Grant",
    "QueueFull",
    "QueueTimeout",
    "SchedulerConfig",
    "SchedulerStatistics",
    "TenantPolicy",
    "TenantStatistics",
    "Ticket",
    "TicketState",
]

# -- the sans-IO core -------------------------------------------------------------------------

TicketState = Literal["waiting", "granted", "cancelled", "expired"]
_WAITING: Final = "waiting"
_BUSY_SKIPS: Final = 64


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
        "used",
        "wait_next",
        "waited",
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
        self.used = True  # since the CLOCK hand last passed
        self.deficit = 0.0
        self.granted = 0
        self.rejected_full = 0
        self.rejected_deadline = 0
        self.waited = 0  # tickets that had to wait (granted at once by enqueue: not counted)
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
        self._ring: deque[_Tenant] = deque()  # every remembered tenant, in CLOCK order
        self._in_flight = 0
        self._waiting = 0
        self._in_round = 0  # tenants in some class's round robin...
        self._stale = 0  # ...of which this many have nothing left waiting (cancelled, expired)
        self._deadlines: list[tuple[float, int, Ticket]] = []  # a heap; dead entries deleted lazily
        self._sequence = 0
        self._forgotten = [0, 0, 0, 0]  # granted, rejected_full, rejected_deadline, waited of forgotten tenants

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
            if len(self._tenants) >= self.config.max_tenants:
                self._forget()
            policy = self.config.policy(name)
            state = _Tenant(name, policy, self._class_of[policy.priority])
            self._tenants[name] = state
            self._ring.append(state)
        return state

    def _forget(self) -> None:
        """Make room for one tenant by forgetting idle ones (CLOCK, an approximate LRU).

        The hand passes over the ring of tenants: a tenant used since the last
        pass gets a second chance (its ``used`` bit is cleared), a busy one (or
        one still in a round robin) is skipped, an idle unused one is forgotten and its counters go to the
        totals. Clearing a bit is paid for by the use that set it, so this is
        O(1) amortised; past ``_BUSY_SKIPS`` busy tenants in one call the
        table grows instead, and shrinks back on later calls.
        """
        tenants, ring, forgotten = self._tenants, self._ring, self._forgotten
        keep = self.config.max_tenants - 1
        skips = 0
        for _ in range(2 * len(ring)):
            if len(tenants) <= keep:
                return
            state = ring.popleft()
            if state.in_flight or state.waiting or state.in_round:
                ring.append(state)
                skips += 1
                if skips > _BUSY_SKIPS:
                    return
            elif state.used:
                state.used = False
                ring.append(state)
            else:
                del tenants[state.name]
                forgotten[0] += state.granted
                forgotten[1] += state.rejected_full
                forgotten[2] += state.rejected_deadline
                forgotten[3] += state.waited

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
        state.used = True
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
        state.used = True
        if state.waiting == 0 and state.in_round:
            self._stale -= 1
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
        if ticket.state == _WAITING:
            state.waited += 1
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
        if state.waiting and not state.in_round:
            self._join_round(state)
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
                if state.waiting == 0:  # its tickets were cancelled or expired
                    self._stale -= 1
                    self._leave_round(state, klass)
                    continue
                if state.cap is not None and state.in_flight >= state.cap:
                    self._leave_round(state, klass)  # back in when one of its grants is released
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
                if state.waiting == 0:
                    self._leave_round(state, klass)

    def _drop_stale(self) -> None:
        for klass in self._classes:
            current = klass.current
            if current is not None and current.waiting == 0:
                self._leave_round(current, klass)
            live = deque[_Tenant]()
            for state in klass.round:
                if state.waiting:
                    live.append(state)
                else:
                    state.in_round = False
                    state.deficit = 0.0
                    self._in_round -= 1
            klass.round = live
        self._stale = 0

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
        if state.waiting == 0 and state.in_round:
            # Left in its round robin until a dispatch reaches it, unless
            # such tenants pile up (a flood of distinct tenants that give up).
            self._stale += 1
            if self._stale > self._in_round - self._stale + 64:
                self._drop_stale()
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
                waited=state.waited,
                queue_wait_p50=_percentile(ordered, 0.5) if ordered else None,
                queue_wait_p99=_percentile(ordered, 0.99) if ordered else None,
            )
            totals[0] += state.granted
            totals[1] += state.rejected_full
            totals[2] += state.rejected_deadline
            totals[3] += state.waited
        return SchedulerStatistics(
            budget=self._budget,
            in_flight=self._in_flight,
            queued=self._waiting,
            granted=totals[0],
            rejected_full=totals[1],
            rejected_deadline=totals[2],
            waited=totals[3],
            tenants=MappingProxyType(tenants),
        )
