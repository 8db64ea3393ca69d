"""The fair scheduler: the sans-IO FairQueue, its trio driver, tenant keys.

FairQueue tests are synchronous (outside any trio run, with plain float
clocks) and hypothesis properties; Scheduler tests use ``autojump_clock`` and
are each bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import collections
import itertools
import math
import random

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blocks import SchedulerConfig, TenantPolicy, header_tenant
from blocks.errors import QueueFull, QueueTimeout
from blocks.http import Request
from blocks.scheduler import FairQueue, Grant, Scheduler, Ticket, open_scheduler

# -- helpers --------------------------------------------------------------------------------


def drain(queue: FairQueue, held: collections.deque[Grant], releases: int, now: float = 0.0) -> list[str]:
    """Release the oldest held grant ``releases`` times; the tenants granted, in order."""
    order = []
    for _ in range(releases):
        for ticket in queue.release(held.popleft(), now):
            assert ticket.grant is not None
            held.append(ticket.grant)
            order.append(ticket.tenant)
    return order


def saturate(queue: FairQueue, budget: int) -> collections.deque[Grant]:
    """Take the whole budget with a tenant that then waits for nothing."""
    held: collections.deque[Grant] = collections.deque()
    for _ in range(budget):
        grant = queue.try_acquire("filler")
        assert grant is not None
        held.append(grant)
    assert queue.try_acquire("filler") is None
    return held


# -- the sans-IO rule ---------------------------------------------------------------------


# That blocks.scheduler._core imports no trio is checked with the other sans-IO
# modules in test_api.py; here, that it also runs without one.


def test_the_core_runs_outside_trio() -> None:
    # trio.current_time() raises outside a run: none of this may call it.
    queue = FairQueue(SchedulerConfig(budget=1))
    grant = queue.try_acquire("a")
    assert grant is not None
    ticket = queue.enqueue("b", 10.0)
    assert queue.next_deadline() == 11.0
    (granted,) = queue.release(grant, 10.5)
    assert granted is ticket and ticket.grant is not None
    assert queue.expire(100.0) == []
    assert queue.release(ticket.grant, 11.0) == []
    assert queue.statistics().tenants["b"].queue_wait_p50 == 0.5


# -- configuration ----------------------------------------------------------------------------


def test_config_defaults_and_validation() -> None:
    policy = TenantPolicy()
    assert (policy.weight, policy.max_in_flight, policy.max_queued) == (1.0, None, 100)
    assert (policy.queue_timeout, policy.priority, policy.retry_after) == (1.0, 0, 1.0)
    config = SchedulerConfig(budget=8)
    assert config.default_policy == TenantPolicy() and dict(config.tenants) == {}
    assert (config.quantum, config.max_tenants) == (1.0, 10_000)
    for bad in [{"weight": 0}, {"weight": math.inf}, {"max_in_flight": 0}, {"max_queued": -1}]:
        with pytest.raises(ValueError):
            TenantPolicy(**bad)  # type: ignore[arg-type]
    for bad in [{"queue_timeout": 0}, {"queue_timeout": math.nan}, {"retry_after": -1}]:
        with pytest.raises(ValueError):
            TenantPolicy(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        SchedulerConfig(budget=0)
    with pytest.raises(TypeError):
        SchedulerConfig(budget=1, tenants={"a": 1.0})  # type: ignore[dict-item]


def test_config_tenants_are_copied_and_read_only() -> None:
    tenants = {"a": TenantPolicy(weight=2)}
    config = SchedulerConfig(budget=1, tenants=tenants)
    tenants["b"] = TenantPolicy()
    assert set(config.tenants) == {"a"}
    with pytest.raises(TypeError):
        config.tenants["c"] = TenantPolicy()  # type: ignore[index]
    assert config.policy("a").weight == 2 and config.policy("zzz") is config.default_policy
    assert attrs.evolve(config, budget=3).tenants == config.tenants


def test_effective_quantum_grants_at_least_once_per_turn() -> None:
    assert FairQueue(SchedulerConfig(budget=1)).quantum == 1.0
    assert FairQueue(SchedulerConfig(budget=1, quantum=3.0)).quantum == 3.0
    small = SchedulerConfig(budget=1, tenants={"tiny": TenantPolicy(weight=0.25)})
    assert FairQueue(small).quantum == 4.0


# -- granting ---------------------------------------------------------------------------------


def test_try_acquire_respects_budget_and_cap() -> None:
    config = SchedulerConfig(budget=3, tenants={"capped": TenantPolicy(max_in_flight=1)})
    queue = FairQueue(config)
    first = queue.try_acquire("capped")
    assert first is not None and first.tenant == "capped"
    assert queue.try_acquire("capped") is None
    assert queue.try_acquire("other") is not None
    assert queue.try_acquire("other") is not None
    assert queue.try_acquire("other") is None  # budget
    assert queue.in_flight == 3
    assert repr(queue) == "<FairQueue in_flight=3/3 queued=0 tenants=2>"


def test_release_is_idempotent() -> None:
    queue = FairQueue(SchedulerConfig(budget=1))
    grant = queue.try_acquire("a")
    assert grant is not None
    queue.enqueue("b", 0.0)
    assert [t.tenant for t in queue.release(grant, 1.0)] == ["b"]
    assert queue.release(grant, 1.0) == []
    assert queue.in_flight == 1 and repr(grant) == "<Grant 'a' released>"


def test_try_acquire_never_jumps_a_servable_queue() -> None:
    queue = FairQueue(SchedulerConfig(budget=1))
    held = saturate(queue, 1)
    ticket = queue.enqueue("a", 0.0)
    assert queue.try_acquire("b") is None
    assert drain(queue, held, 1) == ["a"]
    assert ticket.state == "granted"


def test_a_tenant_at_its_cap_does_not_block_others() -> None:
    config = SchedulerConfig(budget=4, tenants={"a": TenantPolicy(max_in_flight=2)})
    queue = FairQueue(config)
    assert queue.try_acquire("a") and queue.try_acquire("a")
    waiting = queue.enqueue("a", 0.0)
    assert waiting.state == "waiting"
    grant = queue.try_acquire("b")  # a's waiter could not use the slot anyway
    assert grant is not None


def test_enqueue_grants_at_once_when_it_can() -> None:
    queue = FairQueue(SchedulerConfig(budget=1))
    ticket = queue.enqueue("a", 5.0)
    assert ticket.state == "granted" and ticket.grant is not None
    assert queue.statistics().tenants["a"].queue_wait_p50 == 0.0


def test_weighted_order_within_a_class() -> None:
    config = SchedulerConfig(budget=1, tenants={"b": TenantPolicy(weight=2), "c": TenantPolicy(weight=3)})
    queue = FairQueue(config)
    held = saturate(queue, 1)
    for tenant in "abc":
        for _ in range(30):
            queue.enqueue(tenant, 0.0)
    assert "".join(drain(queue, held, 12)) == "abbcccabbccc"


def test_fifo_within_a_tenant() -> None:
    queue = FairQueue(SchedulerConfig(budget=1))
    held = saturate(queue, 1)
    tickets = [queue.enqueue("a", float(i)) for i in range(5)]
    granted = []
    for _ in range(5):
        for ticket in queue.release(held.popleft(), 10.0):
            assert ticket.grant is not None
            held.append(ticket.grant)
            granted.append(ticket)
    assert granted == tickets
    stats = queue.statistics().tenants["a"]
    assert (stats.queue_wait_p50, stats.queue_wait_p99, stats.queued) == (8.0, 10.0, 0)


def test_priority_classes_are_strict() -> None:
    config = SchedulerConfig(
        budget=1,
        tenants={"gold": TenantPolicy(priority=-1), "bronze": TenantPolicy(priority=5, weight=100)},
    )
    queue = FairQueue(config)
    held = saturate(queue, 1)
    for tenant in ("bronze", "default-a", "gold", "default-b"):
        for _ in range(3):
            queue.enqueue(tenant, 0.0)
    order = drain(queue, held, 12)
    assert order[:3] == ["gold"] * 3
    assert sorted(order[3:9]) == ["default-a"] * 3 + ["default-b"] * 3
    assert order[9:] == ["bronze"] * 3


def test_a_lower_class_gets_the_slots_a_capped_higher_class_cannot_use() -> None:
    config = SchedulerConfig(budget=2, tenants={"gold": TenantPolicy(priority=-1, max_in_flight=1)})
    queue = FairQueue(config)
    held = saturate(queue, 2)
    queue.enqueue("gold", 0.0)
    queue.enqueue("gold", 0.0)
    queue.enqueue("plain", 0.0)
    assert drain(queue, held, 2) == ["gold", "plain"]


def test_an_idle_tenant_keeps_no_credit() -> None:
    config = SchedulerConfig(budget=1, quantum=1.0, tenants={"b": TenantPolicy(weight=3)})
    queue = FairQueue(config)
    held = saturate(queue, 1)
    queue.enqueue("b", 0.0)
    for _ in range(50):
        queue.enqueue("a", 0.0)
    # b takes one grant of its three-grant turn, then goes idle...
    assert drain(queue, held, 1) == ["b"]
    assert drain(queue, held, 20) == ["a"] * 20
    # ...and, back, gets one fresh turn (3 grants), not the credit of its absence.
    for _ in range(10):
        queue.enqueue("b", 0.0)
    assert "".join(t[0] for t in drain(queue, held, 8)) in {"abbbabbb", "bbbabbba"}


# -- over limits --------------------------------------------------------------------------------


def test_queue_full_is_a_counted_429_with_retry_after() -> None:
    config = SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=2, retry_after=2.5))
    queue = FairQueue(config)
    saturate(queue, 1)
    queue.enqueue("a", 0.0)
    queue.enqueue("a", 0.0)
    with pytest.raises(QueueFull) as info:
        queue.enqueue("a", 0.0)
    error = info.value
    assert (error.status, error.retry_after, error.tenant) == (429, 2.5, "a")
    assert error.headers == [(b"retry-after", b"3")]
    assert queue.statistics().tenants["a"].rejected_full == 1
    assert queue.statistics().rejected_full == 1


def test_max_queued_zero_never_waits() -> None:
    config = SchedulerConfig(budget=1, tenants={"impatient": TenantPolicy(max_queued=0, retry_after=0)})
    queue = FairQueue(config)
    saturate(queue, 1)
    with pytest.raises(QueueFull) as info:
        queue.enqueue("impatient", 0.0)
    assert info.value.headers == [(b"retry-after", b"0")]


def test_expire_rejects_overdue_tickets_in_deadline_order() -> None:
    config = SchedulerConfig(budget=1, tenants={"slow": TenantPolicy(queue_timeout=5.0)})
    queue = FairQueue(config)
    held = saturate(queue, 1)
    slow = queue.enqueue("slow", 0.0)
    fast = [queue.enqueue("a", 1.0), queue.enqueue("b", 1.5)]
    assert queue.next_deadline() == 2.0
    assert queue.expire(1.99) == []
    assert queue.expire(2.5) == fast
    assert [t.state for t in fast] == ["expired", "expired"]
    assert queue.next_deadline() == 5.0
    stats = queue.statistics()
    assert stats.tenants["a"].rejected_deadline == 1 and stats.rejected_deadline == 2
    assert stats.queued == 1
    # Expired tickets are never granted; cancelling one does nothing.
    assert queue.cancel(fast[0]) is False
    assert drain(queue, held, 1) == ["slow"]
    assert slow.state == "granted" and queue.next_deadline() is None


def test_cancelled_waiters_free_their_place() -> None:
    config = SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=2))
    queue = FairQueue(config)
    held = saturate(queue, 1)
    first, second = queue.enqueue("a", 0.0), queue.enqueue("a", 0.0)
    with pytest.raises(QueueFull):
        queue.enqueue("a", 0.0)
    assert queue.cancel(first) is True
    assert queue.cancel(first) is False
    third = queue.enqueue("a", 0.0)
    assert queue.statistics().tenants["a"].queued == 2
    assert drain(queue, held, 2) == ["a", "a"]
    assert (first.state, second.state, third.state) == ("cancelled", "granted", "granted")
    assert first.grant is None and queue.statistics().rejected_full == 1


def test_cancelling_a_granted_ticket_leaves_it_to_its_owner() -> None:
    queue = FairQueue(SchedulerConfig(budget=1))
    ticket = queue.enqueue("a", 0.0)
    assert ticket.grant is not None
    assert queue.cancel(ticket) is False
    assert queue.in_flight == 1
    queue.release(ticket.grant, 0.0)
    assert queue.in_flight == 0


def test_dead_tickets_do_not_pile_up() -> None:
    config = SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=10))
    queue = FairQueue(config)
    saturate(queue, 1)
    keep = queue.enqueue("a", 0.0)  # the head stays alive: deletion behind it is lazy
    for i in range(10_000):
        queue.cancel(queue.enqueue("a", float(i)))
    state = queue._tenants["a"]
    assert len(state.queue) <= 2 * state.waiting + 17
    assert len(queue._deadlines) <= 2 * queue.queued + 65
    assert keep.state == "waiting" and queue.next_deadline() == 1.0


def test_a_flood_of_tenants_that_give_up_stays_bounded() -> None:
    queue = FairQueue(SchedulerConfig(budget=1, max_tenants=100))
    saturate(queue, 1)
    for i in range(10_000):
        queue.cancel(queue.enqueue(f"gone-{i}", 0.0))
    assert len(queue._tenants) <= 100 + 66
    assert sum(len(klass.round) for klass in queue._classes) <= 65
    assert queue.queued == 0 and queue.next_deadline() is None


def test_ten_thousand_tenants_stay_cheap() -> None:
    config = SchedulerConfig(budget=4, max_tenants=1000)
    queue = FairQueue(config)
    for i in range(20_000):
        grant = queue.try_acquire(f"tenant-{i}")
        assert grant is not None
        queue.release(grant, 0.0)
    stats = queue.statistics()
    assert len(stats.tenants) == 1000
    assert "tenant-19999" in stats.tenants and "tenant-0" not in stats.tenants
    assert stats.granted == 20_000 and stats.in_flight == 0


def test_busy_tenants_are_never_forgotten() -> None:
    config = SchedulerConfig(
        budget=2, max_tenants=2, default_policy=TenantPolicy(max_queued=0), tenants={"c": TenantPolicy()}
    )
    queue = FairQueue(config)
    held = [queue.try_acquire("a"), queue.try_acquire("b")]
    ticket = queue.enqueue("c", 0.0)
    for i in range(10):
        assert queue.try_acquire(f"flood-{i}") is None  # a full budget creates no state
        with pytest.raises(QueueFull):
            queue.enqueue(f"flood-{i}", 0.0)
    tenants = queue.statistics().tenants
    assert set(tenants) == {"a", "b", "c", "flood-9"}
    assert queue.statistics().rejected_full == 10
    grant = held[0]
    assert grant is not None
    assert queue.release(grant, 1.0) == [ticket]


def test_statistics_percentiles() -> None:
    queue = FairQueue(SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=1000)))
    held = saturate(queue, 1)
    for _ in range(100):
        queue.enqueue("a", 0.0)
    for i in range(100):
        drain(queue, held, 1, now=float(i + 1))
    tenant = queue.statistics().tenants["a"]
    assert (tenant.queue_wait_p50, tenant.queue_wait_p99) == (50.0, 99.0)
    assert (tenant.granted, tenant.in_flight, tenant.queued) == (100, 1, 0)
    assert queue.statistics().tenants["filler"].queue_wait_p50 is None


def test_wait_samples_are_a_bounded_ring() -> None:
    config = SchedulerConfig(budget=1, wait_samples=10, default_policy=TenantPolicy(max_queued=1000))
    queue = FairQueue(config)
    held = saturate(queue, 1)
    for _ in range(100):
        queue.enqueue("a", 0.0)
    for i in range(100):
        drain(queue, held, 1, now=float(i))
    waits = queue._tenants["a"].waits
    assert waits is not None and sorted(waits) == [float(i) for i in range(90, 100)]


# -- properties ------------------------------------------------------------------------------

WEIGHTS = st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 4.0])


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(WEIGHTS, min_size=2, max_size=4),
    quantum=st.sampled_from([1.0, 1.5, 2.0, 5.0]),
    budget=st.integers(1, 4),
    grants=st.integers(1, 150),
)
def test_backlogged_shares_are_within_one_quantum(
    weights: list[float], quantum: float, budget: int, grants: int
) -> None:
    names = [f"t{i}" for i in range(len(weights))]
    config = SchedulerConfig(
        budget=budget,
        quantum=quantum,
        default_policy=TenantPolicy(max_queued=1000),
        tenants={name: TenantPolicy(weight=w, max_queued=1000) for name, w in zip(names, weights, strict=True)},
    )
    queue = FairQueue(config)
    held = saturate(queue, budget)
    for name in names:  # every tenant stays backlogged: 1000 > the grants made
        for _ in range(200):
            queue.enqueue(name, 0.0)
    order = drain(queue, held, grants)
    assert len(order) == grants
    q, total = queue.quantum, sum(weights)
    # From the start of the busy interval: within one turn's credit plus one grant.
    counts = dict.fromkeys(names, 0)
    for n, tenant in enumerate(order, 1):
        counts[tenant] += 1
        for name, w in zip(names, weights, strict=True):
            assert abs(counts[name] - n * w / total) <= q * w + 1, (n, counts)
    # Over any window of it: a window is the difference of two prefixes, so within twice that.
    for start, end in itertools.combinations(range(0, grants + 1, max(1, grants // 12)), 2):
        window = collections.Counter(order[start:end])
        for name, w in zip(names, weights, strict=True):
            assert abs(window[name] - (end - start) * w / total) <= 2 * (q * w + 1), (start, end, window)
    # No starvation: between two grants of a tenant, the others take at most a turn each.
    for name, w in zip(names, weights, strict=True):
        positions = [i for i, tenant in enumerate(order) if tenant == name]
        bound = sum(q * other + 1 for other in weights) - q * w
        for before, after in itertools.pairwise([-1, *positions]):
            assert after - before - 1 <= bound, (name, positions)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), budget=st.integers(2, 6))
def test_a_flood_does_not_starve_a_quiet_tenant(seed: int, budget: int) -> None:
    rng = random.Random(seed)
    queue = FairQueue(SchedulerConfig(budget=budget, default_policy=TenantPolicy(max_queued=10_000)))
    held = saturate(queue, budget)
    for _ in range(1000):
        queue.enqueue("flood", 0.0)
    waited = []
    for _ in range(50):
        rng.shuffle(held)
        ticket = queue.enqueue("quiet", 0.0)
        releases = 0
        while ticket.state == "waiting":
            drain(queue, held, 1)
            releases += 1
        waited.append(releases)
    assert max(waited) <= 2


POLICIES = st.builds(
    TenantPolicy,
    weight=WEIGHTS,
    max_in_flight=st.none() | st.integers(1, 3),
    max_queued=st.integers(0, 4),
    queue_timeout=st.sampled_from([0.5, 1.0, 3.0]),
    priority=st.integers(0, 2),
)
TENANTS = ["a", "b", "c", "d", "e", "f"]


class FairQueueMachine(RuleBasedStateMachine):
    """Random traffic against FairQueue, checked against a plain model after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: FairQueue | None = None
        self.now = 0.0
        self.held: list[Grant] = []
        self.waiting: list[Ticket] = []
        self.resolved: set[Ticket] = set()
        self.grants = 0
        self.full = 0
        self.expired = 0
        self.waited = 0  # tickets that had to wait
        self.peak_busy = 0

    @precondition(lambda self: self.queue is None)
    @rule(
        budget=st.integers(1, 5),
        default=POLICIES,
        policies=st.dictionaries(st.sampled_from(TENANTS[:4]), POLICIES, max_size=4),
        max_tenants=st.integers(1, 8),
    )
    def configure(
        self, budget: int, default: TenantPolicy, policies: dict[str, TenantPolicy], max_tenants: int
    ) -> None:
        self.config = SchedulerConfig(budget=budget, default_policy=default, tenants=policies, max_tenants=max_tenants)
        self.queue = FairQueue(self.config)

    def _q(self) -> FairQueue:
        assert self.queue is not None
        return self.queue

    def _granted(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            assert ticket.state == "granted" and ticket.grant is not None
            assert ticket not in self.resolved
            self.resolved.add(ticket)
            self.waiting.remove(ticket)
            self.held.append(ticket.grant)
            self.grants += 1
            # Strict priority: nobody better placed and able to use the slot is left waiting.
            mine = self.config.policy(ticket.tenant).priority
            for other in self.waiting:
                if self.config.policy(other.tenant).priority < mine:
                    assert self._at_cap(other.tenant), (ticket, other)

    def _at_cap(self, tenant: str) -> bool:
        cap = self.config.policy(tenant).max_in_flight
        return cap is not None and sum(g.tenant == tenant for g in self.held) >= cap

    @precondition(lambda self: self.queue is not None)
    @rule(tenant=st.sampled_from(TENANTS))
    def try_acquire(self, tenant: str) -> None:
        queue = self._q()
        grant = queue.try_acquire(tenant)
        could = len(self.held) < self.config.budget and not self._at_cap(tenant)
        assert (grant is not None) == could
        if grant is not None:
            self.held.append(grant)
            self.grants += 1

    @precondition(lambda self: self.queue is not None)
    @rule(tenant=st.sampled_from(TENANTS))
    def enqueue(self, tenant: str) -> None:
        queue = self._q()
        mine = sum(t.tenant == tenant for t in self.waiting)
        try:
            ticket = queue.enqueue(tenant, self.now)
        except QueueFull as error:
            assert mine == self.config.policy(tenant).max_queued
            assert error.retry_after == self.config.policy(tenant).retry_after
            self.full += 1
            return
        assert mine < self.config.policy(tenant).max_queued
        self.waiting.append(ticket)
        if ticket.state == "granted":
            self._granted([ticket])
        else:
            self.waited += 1

    @precondition(lambda self: self.queue is not None and self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        grant = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self._granted(self._q().release(grant, self.now))
        assert self._q().release(grant, self.now) == []

    @precondition(lambda self: self.queue is not None and self.waiting)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ticket = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1)))
        assert self._q().cancel(ticket) is True
        assert ticket.state == "cancelled"
        self.resolved.add(ticket)

    @precondition(lambda self: self.queue is not None)
    @rule(step=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0]))
    def tick(self, step: float) -> None:
        self.now += step
        due = {id(t) for t in self.waiting if t.deadline <= self.now}
        expired = self._q().expire(self.now)
        assert {id(t) for t in expired} == due
        assert [t.deadline for t in expired] == sorted(t.deadline for t in expired)
        for ticket in expired:
            assert ticket.state == "expired"
            self.waiting.remove(ticket)
            self.resolved.add(ticket)
        self.expired += len(expired)

    @invariant()
    def consistent(self) -> None:
        if self.queue is None:
            return
        queue = self.queue
        assert queue.in_flight == len(self.held) <= self.config.budget
        assert queue.queued == len(self.waiting)
        in_flight = collections.Counter(g.tenant for g in self.held)
        queued = collections.Counter(t.tenant for t in self.waiting)
        for tenant, count in in_flight.items():
            cap = self.config.policy(tenant).max_in_flight
            assert cap is None or count <= cap
        # No idle budget while a waiter could use it.
        if len(self.held) < self.config.budget:
            assert all(self._at_cap(t.tenant) for t in self.waiting)
        stats = queue.statistics()
        assert (stats.granted, stats.rejected_full, stats.rejected_deadline, stats.waited) == (
            self.grants,
            self.full,
            self.expired,
            self.waited,
        )
        # The per-tenant counts of the tenants remembered never exceed the totals (the rest were forgotten).
        assert sum(t.waited for t in stats.tenants.values()) <= stats.waited
        for tenant in set(in_flight) | set(queued):
            assert (stats.tenants[tenant].in_flight, stats.tenants[tenant].queued) == (
                in_flight[tenant],
                queued[tenant],
            )
        # Memory: the CLOCK ring holds exactly the remembered tenants, within the bound.
        assert sorted(queue._tenants) == sorted(state.name for state in queue._ring)
        assert all(queue._tenants[name].in_flight == count for name, count in in_flight.items())
        # Tenants left in a round robin with nothing waiting are counted, and bounded.
        in_round = [state for state in queue._tenants.values() if state.in_round]
        stale = sum(not state.waiting for state in in_round)
        assert queue._stale == stale <= len(in_round) - stale + 64
        # Past max_tenants only while that many are busy: a new tenant forgets idle ones.
        pinned = set(in_flight) | set(queued) | {state.name for state in in_round}
        self.peak_busy = max(self.peak_busy, len(pinned))
        assert len(queue._tenants) <= max(self.config.max_tenants, self.peak_busy + 1)
        deadline = queue.next_deadline()
        assert deadline == (min(t.deadline for t in self.waiting) if self.waiting else None)


TestFairQueueMachine = FairQueueMachine.TestCase
TestFairQueueMachine.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)


# -- the trio driver -------------------------------------------------------------------------


async def test_try_acquire_and_acquire_without_waiting(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(5):
        async with open_scheduler(SchedulerConfig(budget=2)) as scheduler:
            grant = scheduler.try_acquire("a")
            assert grant is not None
            start = trio.current_time()
            other = await scheduler.acquire("b")
            assert trio.current_time() == start and other.tenant == "b"
            scheduler.release(grant)
            scheduler.release(other)
            scheduler.release(other)
            stats = scheduler.statistics()
            assert (stats.in_flight, stats.granted) == (0, 2)
            assert repr(scheduler).startswith("<Scheduler <FairQueue in_flight=0/2")


async def test_a_deadline_is_a_503_at_the_right_time(autojump_clock: trio.abc.Clock) -> None:
    config = SchedulerConfig(budget=1, default_policy=TenantPolicy(queue_timeout=2.5, retry_after=4))
    with trio.fail_after(30):
        async with open_scheduler(config) as scheduler:
            held = scheduler.try_acquire("hog")
            assert held is not None
            start = trio.current_time()
            await trio.sleep(1)
            with pytest.raises(QueueTimeout) as info:
                await scheduler.acquire("a")
            assert trio.current_time() == start + 3.5
            assert (info.value.status, info.value.tenant, info.value.headers) == (503, "a", [(b"retry-after", b"4")])
            # A later, earlier-expiring waiter wakes the sweeper early enough.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_expect_timeout, scheduler, "slow-lane", start + 3.5 + 2.5)
            scheduler.release(held)
            stats = scheduler.statistics()
            assert (stats.rejected_deadline, stats.in_flight, stats.queued) == (2, 0, 0)


async def _expect_timeout(scheduler: Scheduler, tenant: str, at: float) -> None:
    with pytest.raises(QueueTimeout):
        await scheduler.acquire(tenant)
    assert trio.current_time() == at


async def test_deadlines_of_several_tenants(autojump_clock: trio.abc.Clock) -> None:
    config = SchedulerConfig(
        budget=1,
        default_policy=TenantPolicy(queue_timeout=10),
        tenants={"short": TenantPolicy(queue_timeout=1), "mid": TenantPolicy(queue_timeout=4)},
    )
    with trio.fail_after(60):
        async with open_scheduler(config) as scheduler:
            held = scheduler.try_acquire("hog")
            assert held is not None
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                # The long one first, so the sweeper must re-arm for the shorter ones.
                nursery.start_soon(_expect_timeout, scheduler, "long", start + 10)
                await trio.sleep(0.5)
                nursery.start_soon(_expect_timeout, scheduler, "mid", start + 4.5)
                nursery.start_soon(_expect_timeout, scheduler, "short", start + 1.5)
            scheduler.release(held)


async def test_queue_full_from_acquire(autojump_clock: trio.abc.Clock) -> None:
    config = SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=0, retry_after=7))
    with trio.fail_after(5):
        async with open_scheduler(config) as scheduler:
            held = scheduler.try_acquire("a")
            assert held is not None
            with pytest.raises(QueueFull) as info:
                await scheduler.acquire("b")
            assert info.value.status == 429 and info.value.headers == [(b"retry-after", b"7")]
            scheduler.release(held)


async def test_cancelled_while_queued_leaks_nothing(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(10):
        async with open_scheduler(SchedulerConfig(budget=1)) as scheduler:
            held = scheduler.try_acquire("hog")
            assert held is not None
            with trio.move_on_after(0.5):
                await scheduler.acquire("a")
            assert scheduler.statistics().queued == 0
            scheduler.release(held)  # nobody to hand the slot to
            stats = scheduler.statistics()
            assert (stats.in_flight, stats.queued, stats.rejected_deadline) == (0, 0, 0)
            assert stats.tenants["a"].granted == 0
            grant = scheduler.try_acquire("b")
            assert grant is not None
            scheduler.release(grant)


@pytest.mark.parametrize("release_first", [True, False])
async def test_a_grant_racing_a_cancellation_leaks_nothing(autojump_clock: trio.abc.Clock, release_first: bool) -> None:
    outcomes: list[str] = []
    with trio.fail_after(10):
        async with open_scheduler(SchedulerConfig(budget=1)) as scheduler:
            held = scheduler.try_acquire("hog")
            assert held is not None

            async def waiter(task_status: trio.TaskStatus[trio.CancelScope]) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    grant = await scheduler.acquire("a")
                    try:
                        outcomes.append("granted")
                        await trio.sleep(1)  # cancelled here
                    finally:
                        scheduler.release(grant)
                outcomes.append("cancelled" if scope.cancelled_caught else "finished")

            async with trio.open_nursery() as nursery:
                scope = await nursery.start(waiter)
                await trio.sleep(0.1)
                assert scheduler.statistics().queued == 1
                # The release and the cancel in one step, no checkpoint between them.
                if release_first:
                    scheduler.release(held)
                    scope.cancel()
                else:
                    scope.cancel()
                    scheduler.release(held)
            stats = scheduler.statistics()
            assert (stats.in_flight, stats.queued) == (0, 0)
            assert outcomes == (["granted", "cancelled"] if release_first else ["cancelled"])


async def test_weights_one_and_three_share_slots_one_to_three(autojump_clock: trio.abc.Clock) -> None:
    config = SchedulerConfig(
        budget=4,
        default_policy=TenantPolicy(queue_timeout=1000),
        tenants={
            "light": TenantPolicy(weight=1, queue_timeout=1000),
            "heavy": TenantPolicy(weight=3, queue_timeout=1000),
        },
    )
    grants: collections.Counter[str] = collections.Counter()

    async def client(scheduler: Scheduler, tenant: str) -> None:
        while True:
            grant = await scheduler.acquire(tenant)
            try:
                grants[tenant] += 1
                await trio.sleep(1)
            finally:
                scheduler.release(grant)

    with trio.fail_after(1000):
        async with open_scheduler(config) as scheduler, trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(client, scheduler, "light")
                nursery.start_soon(client, scheduler, "heavy")
            await trio.sleep(100.5)
            nursery.cancel_scope.cancel()
    assert sum(grants.values()) in range(400, 410)
    assert 2.8 <= grants["heavy"] / grants["light"] <= 3.2, grants
    assert scheduler.statistics().in_flight == 0
    assert scheduler.statistics().queued == 0


async def test_closing_fails_the_waiters(autojump_clock: trio.abc.Clock) -> None:
    errors: list[BaseException] = []

    async def wait(scheduler: Scheduler) -> None:
        try:
            await scheduler.acquire("a")
        except trio.ClosedResourceError as error:
            errors.append(error)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery, open_scheduler(SchedulerConfig(budget=1)) as scheduler:
            held = scheduler.try_acquire("hog")
            assert held is not None
            nursery.start_soon(wait, scheduler)
            await trio.sleep(0.1)
        assert len(errors) == 1
        with pytest.raises(trio.ClosedResourceError):
            await scheduler.acquire("a")
        scheduler.release(held)
        assert scheduler.statistics().in_flight == 0


async def test_open_scheduler_raises_the_bodys_error_itself() -> None:
    cause = ValueError("cause")
    with trio.fail_after(5), pytest.raises(KeyError) as info:
        async with open_scheduler(SchedulerConfig(budget=1)):
            raise KeyError("boom") from cause
    assert info.value.__cause__ is cause
    assert info.value.__context__ is None


# -- tenant keys --------------------------------------------------------------------------------


def request(*headers: tuple[bytes, bytes]) -> Request:
    return Request(b"GET", b"https", b"example.com", b"/", list(headers))


def test_header_tenant() -> None:
    key = header_tenant()
    assert key(request((b"x-tenant", b"acme"))) == "acme"
    assert key(request((b"x-other", b"x"), (b"x-tenant", b"caf\xe9"), (b"x-tenant", b"second"))) == "caf\xe9"
    assert key(request()) == "default"
    assert key(request((b"x-tenant", b""))) == "default"
    assert key(request((b"x-tenant", b"a" * 64))) == "a" * 64
    assert key(request((b"x-tenant", b"a" * 65))) == "default"
    custom = header_tenant(b"X-Org", default="anonymous", max_length=3)
    assert custom(request((b"x-org", b"abc"))) == "abc"
    assert custom(request((b"x-org", b"abcd"))) == "anonymous"
