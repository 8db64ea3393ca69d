"""The sans-IO core of sticky sessions: SessionPlacer (the proxy's side) and SessionTracker (the worker's).

Synchronous tests and hypothesis properties, outside any trio run: ``now``
is a plain float passed in, and no socket is opened. The trio side (the
broker, the worker's control answers) is tested end to end elsewhere.
"""

from __future__ import annotations

import collections
import math

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from blocks import Replica, SessionConfig, WorkerSessionConfig
from blocks.errors import QueueFull, QueueTimeout, SessionLost
from blocks.sessions import SessionPlacer, SessionTicket, SessionTracker

APP = "chat"
WORKER = ("127.0.0.1", 9000)


def replica(name: str) -> Replica:
    return Replica(name=name, worker=WORKER, address=("127.0.0.1", 9100))


R0, R1, R2 = replica("r0"), replica("r1"), replica("r2")


def placer(**config: object) -> SessionPlacer:
    return SessionPlacer(SessionConfig(apps={APP, "game"}, **config))  # type: ignore[arg-type]


def known(p: SessionPlacer, **capacities: int) -> None:
    """The workers' first word (a load report): each replica hosts 0 of its capacity."""
    for name, capacity in capacities.items():
        p.observe(name, 0, capacity)


def pending(p: SessionPlacer, name: str) -> int:
    return p.statistics().replicas[name].pending


def fill(p: SessionPlacer, candidates: list[Replica]) -> None:
    """Reserve and start sessions until every place of ``candidates`` is taken."""
    while (chosen := p.reserve(APP, candidates)) is not None:
        estimate = p.statistics().replicas[chosen.name]
        p.answered(chosen.name, estimate.active + 1, estimate.capacity, started=True)


# -- configuration --------------------------------------------------------------------------


def test_session_config_converts_and_validates() -> None:
    config = SessionConfig(apps=["chat"], header="Proxyblocks-Session", cookie="SID")
    assert config.apps == frozenset({"chat"})
    assert (config.header, config.cookie) == (b"proxyblocks-session", b"sid")
    assert SessionConfig(apps=(), cookie=None).cookie is None
    defaults = SessionConfig(apps=())
    assert (defaults.max_per_replica, defaults.queue_size, defaults.set_cookie, defaults.require_auth) == (
        0,
        64,
        True,
        True,
    )
    for bad in (
        {"ttl": 0.0},
        {"ttl": math.inf},
        {"max_per_replica": -1},
        {"queue_size": -1},
        {"queue_timeout": -1.0},
        {"queue_timeout": math.nan},
        {"retry_after": -1.0},
    ):
        with pytest.raises(ValueError):
            SessionConfig(apps=(), **bad)
    for bad in ({"idle_timeout": 0.0}, {"idle_timeout": math.inf}, {"max_sessions": 0}):
        with pytest.raises(ValueError):
            WorkerSessionConfig(**bad)
    assert attrs.evolve(config, ttl=60.0).ttl == 60.0


# -- SessionPlacer: reserving a place ---------------------------------------------------------


def test_reserve_picks_the_replica_with_most_free_places() -> None:
    p = placer()
    p.observe("r0", 3, 4)  # 1 free
    p.observe("r1", 1, 4)  # 3 free
    p.observe("r2", 0, 2)  # 2 free
    assert p.reserve(APP, [R0, R1, R2]) is R1
    assert (pending(p, "r1"), p.free("r1")) == (1, 2)
    # r1 and r2 now both have 2 free; the one with fewer sessions (r2: 0 against r1's 2) wins.
    assert p.reserve(APP, [R0, R1, R2]) is R2


def test_concurrent_reserves_spread_and_never_exceed_capacity() -> None:
    p = placer()
    known(p, r0=2, r1=3)
    chosen = []
    for _ in range(5):
        most = max(p.free("r0"), p.free("r1"))
        pick = p.reserve(APP, [R0, R1])
        assert pick is not None and p.free(pick.name) == most - 1  # the freest at that moment
        chosen.append(pick.name)
    assert collections.Counter(chosen) == {"r0": 2, "r1": 3}
    assert p.reserve(APP, [R0, R1]) is None  # every place is pending: none left
    assert p.free_places([R0, R1]) == 0
    assert {name: (s.active, s.pending, s.capacity) for name, s in p.statistics().replicas.items()} == {
        "r0": (0, 2, 2),
        "r1": (0, 3, 3),
    }


def test_replicas_not_heard_of_yet_count_as_free_and_are_spread_by_pending() -> None:
    p = placer()
    assert p.free("r0") == math.inf and p.free_places([R0, R1]) == math.inf
    picks = [p.reserve(APP, [R0, R1]) for _ in range(6)]
    assert collections.Counter(r.name for r in picks if r is not None) == {"r0": 3, "r1": 3}


def test_max_per_replica_caps_a_replica_before_its_worker_speaks() -> None:
    p = placer(max_per_replica=2)
    assert p.free("r0") == 2
    assert [p.reserve(APP, [R0]) for _ in range(3)] == [R0, R0, None]


@pytest.mark.parametrize(
    ("ours", "workers", "capacity"),
    [(2, 5, 2), (5, 3, 3), (0, 3, 3), (4, 0, 4), (0, 0, 0), (3, 3, 3)],
)
def test_the_smaller_of_max_per_replica_and_the_workers_capacity_applies(
    ours: int, workers: int, capacity: int
) -> None:
    p = placer(max_per_replica=ours)
    p.observe("r0", 1, workers)
    assert p.statistics().replicas["r0"].capacity == capacity
    assert p.free("r0") == (capacity - 1 if capacity else math.inf)


def test_answers_replace_the_estimate() -> None:
    p = placer()
    known(p, r0=4)
    assert p.reserve(APP, [R0]) is R0
    assert p.reserve(APP, [R0]) is R0
    # The worker took the first: it hosts 3 (others' sessions included), 1 start still pending.
    p.answered("r0", 3, 4, started=True)
    assert attrs.astuple(p.statistics().replicas["r0"]) == (3, 1, 4)
    assert p.free("r0") == 0
    # The second is refused: the worker is full after all (another proxy filled it).
    p.answered("r0", 4, 4, started=False)
    assert attrs.astuple(p.statistics().replicas["r0"]) == (4, 0, 4)
    stats = p.statistics()
    assert (stats.started, stats.refused_by_worker) == (1, 1)
    # A load report: sessions ended meanwhile, and the worker's limit changed.
    p.observe("r0", 1, 6)
    assert attrs.astuple(p.statistics().replicas["r0"]) == (1, 0, 6)
    assert p.free("r0") == 5


def test_an_unanswered_start_releases_its_reservation() -> None:
    p = placer()
    known(p, r0=1)
    assert p.reserve(APP, [R0]) is R0
    assert p.reserve(APP, [R0]) is None
    p.unanswered("r0")
    assert pending(p, "r0") == 0
    assert p.reserve(APP, [R0]) is R0
    p.unanswered("r0")
    p.unanswered("r0")  # one too many (a driver's double release): never below 0
    assert pending(p, "r0") == 0
    assert p.statistics().started == 0


def test_forget_drops_replicas_that_left_but_not_those_with_pending_starts() -> None:
    p = placer()
    known(p, r0=2, r1=2, r2=2)
    assert p.reserve(APP, [R1]) is R1
    p.forget({"r0"})
    assert sorted(p.statistics().replicas) == ["r0", "r1"]
    p.unanswered("r1")
    p.forget({"r0"})
    assert sorted(p.statistics().replicas) == ["r0"]


def test_reserve_never_overtakes_a_waiter() -> None:
    p = placer()
    known(p, r0=1)
    fill(p, [R0])
    ticket = p.enqueue(APP, "acme", 0.0)
    p.observe("r0", 0, 1)  # the session ended: one free place, and someone waits for it
    assert p.free("r0") == 1
    assert p.reserve(APP, [R0]) is None
    assert p.reserve("game", [R0]) is R0  # another app's queue is its own
    p.unanswered("r0")
    assert p.grant(APP, [R0]) == [ticket]
    assert ticket.state == "granted" and ticket.replica is R0


# -- SessionPlacer: the queue -----------------------------------------------------------------


def test_enqueue_is_bounded_per_app_with_a_429() -> None:
    p = placer(queue_size=2, retry_after=7.0)
    first = p.enqueue(APP, "acme", 0.0)
    p.enqueue(APP, "other", 0.0)
    with pytest.raises(QueueFull) as caught:
        p.enqueue(APP, "acme", 0.0)
    error = caught.value
    assert (error.status, error.tenant, error.retry_after) == (429, "acme", 7.0)
    assert (b"retry-after", b"7") in error.headers
    assert p.enqueue("game", "acme", 0.0).app == "game"  # a bound per app
    p.cancel(first)  # a place in the queue freed
    p.enqueue(APP, "acme", 0.0)
    stats = p.statistics()
    assert (stats.queue_full, stats.queued) == (1, {APP: 2, "game": 1})


def test_a_queue_of_size_zero_never_waits() -> None:
    p = placer(queue_size=0)
    with pytest.raises(QueueFull):
        p.enqueue(APP, "acme", 0.0)
    assert p.waiting(APP) == 0


def test_grant_serves_tenants_round_robin_and_each_tenant_fifo() -> None:
    p = placer()
    known(p, r0=1)
    fill(p, [R0])
    busy = [p.enqueue(APP, "busy", 0.0) for _ in range(10)]
    quiet = p.enqueue(APP, "quiet", 1.0)
    order: list[SessionTicket] = []
    for _ in range(11):  # one place frees at a time, as sessions end
        p.observe("r0", 0, 1)
        (ticket,) = p.grant(APP, [R0])
        order.append(ticket)
        p.answered("r0", 1, 1, started=True)
    assert order[1] is quiet  # served second, not eleventh
    assert [t for t in order if t.tenant == "busy"] == busy  # FIFO within a tenant
    assert p.waiting(APP) == 0


def test_grant_hands_out_every_free_place_at_once_in_round_robin() -> None:
    p = placer()
    known(p, r0=1, r1=1)
    fill(p, [R0, R1])
    tickets = {tenant: [p.enqueue(APP, tenant, 0.0) for _ in range(3)] for tenant in ("a", "b", "c")}
    p.observe("r0", 0, 3)  # r0 now has 3 free places, r1 none
    granted = p.grant(APP, [R0, R1])
    assert granted == [tickets["a"][0], tickets["b"][0], tickets["c"][0]]
    assert all(t.state == "granted" and t.replica is R0 for t in granted)
    assert (pending(p, "r0"), p.free("r0")) == (3, 0)
    assert p.grant(APP, [R0, R1]) == []  # no place left: the others wait
    assert p.waiting(APP) == 6
    p.observe("r1", 0, 2)
    assert p.grant(APP, [R0, R1]) == [tickets["a"][1], tickets["b"][1]]


def test_expire_answers_at_the_deadline_and_not_before() -> None:
    p = placer(queue_timeout=10.0, retry_after=2.0)
    first = p.enqueue(APP, "acme", 0.0)
    second = p.enqueue(APP, "other", 4.0)
    assert p.next_deadline() == 10.0
    assert p.expire(9.999) == []
    assert (first.state, p.waiting(APP)) == ("waiting", 2)
    assert p.expire(10.0) == [first]
    assert first.state == "expired" and first.replica is None
    assert (p.waiting(APP), p.next_deadline()) == (1, 14.0)
    error = p.timeout_error(first)
    assert isinstance(error, QueueTimeout)
    assert (error.status, error.tenant, error.retry_after) == (503, "acme", 2.0)
    assert p.expire(100.0) == [second]
    assert p.expire(200.0) == []
    assert (p.next_deadline(), p.statistics().timed_out) == (None, 2)
    # An expired ticket is never granted.
    assert p.grant(APP, [R0]) == []


def test_cancel_a_waiting_ticket() -> None:
    p = placer(queue_timeout=5.0)
    known(p, r0=1)
    fill(p, [R0])
    gone = p.enqueue(APP, "acme", 0.0)
    stays = p.enqueue(APP, "acme", 1.0)
    p.cancel(gone)
    assert gone.state == "cancelled" and p.waiting(APP) == 1
    assert p.next_deadline() == 6.0
    p.observe("r0", 0, 1)
    assert p.grant(APP, [R0]) == [stays]
    assert p.expire(100.0) == []  # a cancelled ticket does not time out either
    assert p.statistics().timed_out == 0


def test_cancel_a_granted_ticket_releases_its_reservation() -> None:
    p = placer()
    known(p, r0=1)
    fill(p, [R0])
    first = p.enqueue(APP, "acme", 0.0)
    second = p.enqueue(APP, "acme", 0.0)
    p.observe("r0", 0, 1)
    assert p.grant(APP, [R0]) == [first]
    assert pending(p, "r0") == 1
    p.cancel(first)  # its client went away before the worker was asked
    assert first.state == "cancelled" and pending(p, "r0") == 0
    assert p.grant(APP, [R0]) == [second]  # the place goes to the next waiter
    p.cancel(first)  # twice: nothing more is released
    assert pending(p, "r0") == 1


def test_a_word_at_an_older_revision_is_ignored() -> None:
    """A load poll the worker answered before a start may arrive after the start's answer."""
    p = placer()
    assert p.reserve(APP, [R0]) is R0
    p.answered("r0", 2, 4, started=True, at=7)
    p.observe("r0", 1, 4, at=6)  # the overtaken poll: says less than the answer did
    assert attrs.astuple(p.statistics().replicas["r0"]) == (2, 0, 4)
    p.observe("r0", 0, 4, at=8)  # a newer word: a session ended
    assert attrs.astuple(p.statistics().replicas["r0"]) == (0, 0, 4)


def test_a_refusal_holds_until_the_worker_says_something_newer() -> None:
    """A worker full overall refuses with a replica's counts that look free: the place counts as full."""
    p = placer()
    assert p.reserve(APP, [R0]) is R0
    p.answered("r0", 0, 0, started=False, at=5)
    assert p.free("r0") == 0
    assert p.reserve(APP, [R0]) is None
    p.observe("r0", 0, 0, at=5)  # a poll at the same revision: nothing changed, still full
    assert p.free("r0") == 0
    p.observe("r0", 0, 0, at=6)  # something changed at the worker: try again
    assert p.free("r0") == math.inf


def test_requeue_keeps_the_deadline_and_goes_first_of_its_tenant() -> None:
    p = placer(queue_timeout=10.0)
    known(p, r0=1)
    fill(p, [R0])
    first = p.enqueue(APP, "acme", 0.0)
    later = p.enqueue(APP, "acme", 3.0)
    p.observe("r0", 0, 1)
    assert p.grant(APP, [R0]) == [first]
    # While it is granted, the deadline keeper runs: the granted ticket is not its concern.
    assert p.next_deadline() == 13.0
    assert p.expire(5.0) == []
    # Its worker was full after all (another proxy took the place).
    p.answered("r0", 1, 1, started=False)
    p.requeue(first)
    assert first.state == "waiting" and first.replica is None and p.waiting(APP) == 2
    assert p.next_deadline() == 10.0  # its own deadline, not a new one
    p.observe("r0", 0, 1)
    assert p.grant(APP, [R0]) == [first]  # ahead of the tenant's other waiter
    p.answered("r0", 1, 1, started=False)
    p.requeue(first)
    assert p.expire(9.5) == []
    assert p.expire(10.0) == [first]  # it times out at its first deadline
    assert p.expire(13.0) == [later]
    assert p.statistics().refused_by_worker == 2


def _held(p: SessionPlacer) -> tuple[int, int]:
    """Tickets the app's queue holds (its deques), and entries of the deadline keeper."""
    return sum(len(tickets) for tickets in p._queues[APP].tenants.values()), len(p._deadlines)


def test_resolved_tickets_do_not_pile_up_while_nothing_is_granted() -> None:
    # Every replica stays full for a long time; clients keep starting and giving up
    # (or timing out). The queue's memory stays bounded by its size, not by the traffic.
    p = placer(queue_size=4, queue_timeout=0.025)
    known(p, r0=1)
    fill(p, [R0])
    now = 0.0
    for i in range(2000):
        now += 0.01
        ticket = p.enqueue(APP, f"t{i % 3}", now)  # at most 2 others wait: never a 429
        if i % 2:
            p.cancel(ticket)
        p.expire(now)
        assert max(_held(p)) <= 2 * 4 + 17
    assert p.statistics().timed_out > 0


def test_cancelled_tickets_behind_a_long_wait_do_not_pile_up() -> None:
    # One start waits its whole 10 s; thousands come and go behind it meanwhile.
    p = placer(queue_size=4, queue_timeout=10.0)
    known(p, r0=1)
    fill(p, [R0])
    first = p.enqueue(APP, "patient", 0.0)
    now = 0.0
    for i in range(2000):
        now += 0.001
        p.cancel(p.enqueue(APP, f"t{i % 3}", now))
        assert p.expire(now) == []
        assert max(_held(p)) <= 2 * 2 + 17  # (two live while one is enqueued)
    assert p.expire(10.0) == [first]
    assert (p.next_deadline(), p.waiting(APP)) == (None, 0)


def test_statistics_and_repr() -> None:
    p = placer()
    known(p, r0=1)
    fill(p, [R0])
    p.enqueue(APP, "acme", 0.0)
    p.count_gone()
    p.count_terminated()
    p.count_terminated()
    stats = p.statistics()
    assert (stats.started, stats.gone, stats.terminated, stats.queued) == (1, 1, 2, {APP: 1, "game": 0})
    assert attrs.astuple(stats.replicas["r0"]) == (1, 0, 1)
    assert repr(p) == "<SessionPlacer apps=['chat', 'game'] queued=1>"
    assert repr(p.enqueue("game", "acme", 0.0)) == "<SessionTicket game/acme waiting>"


# -- SessionPlacer: random sequences ----------------------------------------------------------

TENANTS = ["a", "b", "c"]
NAMES = ["r0", "r1", "r2"]
CANDIDATES = [R0, R1, R2]


class PlacerMachine(RuleBasedStateMachine):
    """One proxy's placer against a model of the workers (and other proxies that fill them).

    The driver's moves are the rules: reserve, grant, answer a start (the
    worker takes it if it has room; a refused ticket is requeued), lose an
    answer, cancel, let time pass, hear a load report.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.worker_active = dict.fromkeys(NAMES, 0)
        self.reservations: list[tuple[str, SessionTicket | None]] = []  # starts sent, not answered
        self.waiting: dict[str, list[SessionTicket]] = {t: [] for t in TENANTS}  # in the order owed
        self.resolved: set[SessionTicket] = set()  # kept alive: ids are reused
        self.said: dict[str, tuple[int, int]] = {}  # the worker's latest word, per replica
        self.counts = collections.Counter[str]()

    @initialize(
        capacities=st.lists(st.integers(0, 3), min_size=3, max_size=3),
        max_per_replica=st.integers(0, 3),
        queue_size=st.integers(0, 4),
        queue_timeout=st.sampled_from([0.0, 1.0, 2.5]),
        report=st.booleans(),
    )
    def configure(
        self, capacities: list[int], max_per_replica: int, queue_size: int, queue_timeout: float, report: bool
    ) -> None:
        self.capacity = dict(zip(NAMES, capacities, strict=True))
        self.config = SessionConfig(
            apps={APP}, max_per_replica=max_per_replica, queue_size=queue_size, queue_timeout=queue_timeout
        )
        self.placer = SessionPlacer(self.config)
        if report:
            self.load_report()

    def _waiters(self) -> list[SessionTicket]:
        return [t for tickets in self.waiting.values() for t in tickets]

    def _take_place(self, name: str, free: dict[str, float]) -> None:
        assert free[name] > 0, f"{name} reserved with no free place"
        free[name] -= 1

    @rule()
    def reserve(self) -> None:
        free = {name: self.placer.free(name) for name in NAMES}
        chosen = self.placer.reserve(APP, CANDIDATES)
        if self._waiters():
            assert chosen is None  # never overtakes a waiter
            return
        if chosen is None:
            assert all(f == 0 for f in free.values())
            return
        assert free[chosen.name] == max(free.values())
        self._take_place(chosen.name, free)
        self.reservations.append((chosen.name, None))

    @rule()
    def grant(self) -> None:
        free = {name: self.placer.free(name) for name in NAMES}
        granted = self.placer.grant(APP, CANDIDATES)
        for ticket in granted:
            tickets = self.waiting[ticket.tenant]
            assert tickets and tickets[0] is ticket  # FIFO within its tenant, requeued ones first
            assert ticket not in self.resolved
            tickets.pop(0)
            assert ticket.state == "granted" and ticket.replica is not None
            self._take_place(ticket.replica.name, free)
            self.reservations.append((ticket.replica.name, ticket))
        # No idle place while someone waits.
        assert not self._waiters() or all(self.placer.free(name) == 0 for name in NAMES)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def answer(self, data: st.DataObject) -> None:
        name, ticket = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        capacity = self.capacity[name]
        started = not capacity or self.worker_active[name] < capacity
        self.worker_active[name] += started
        self.placer.answered(name, self.worker_active[name], capacity, started=started)
        self.said[name] = (self.worker_active[name], capacity)
        self.counts["started" if started else "refused"] += 1
        if ticket is not None:
            if started:
                self.resolved.add(ticket)
            else:
                self.placer.requeue(ticket)
                self.waiting[ticket.tenant].insert(0, ticket)

    @precondition(lambda self: self.reservations)
    @rule(data=st.data())
    def lose_answer(self, data: st.DataObject) -> None:
        name, ticket = self.reservations.pop(data.draw(st.integers(0, len(self.reservations) - 1)))
        if ticket is None:
            self.placer.unanswered(name)
        else:
            self.placer.cancel(ticket)  # its client gave up while the worker was asked
            assert ticket.state == "cancelled"
            self.resolved.add(ticket)

    @rule(tenant=st.sampled_from(TENANTS))
    def enqueue(self, tenant: str) -> None:
        try:
            ticket = self.placer.enqueue(APP, tenant, self.now)
        except QueueFull:
            assert len(self._waiters()) >= self.config.queue_size
            self.counts["full"] += 1
            return
        assert len(self._waiters()) < self.config.queue_size
        assert ticket.deadline == self.now + self.config.queue_timeout
        self.waiting[tenant].append(ticket)

    @precondition(lambda self: any(self.waiting.values()))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self._waiters()))
        self.placer.cancel(ticket)
        assert ticket.state == "cancelled"
        self.waiting[ticket.tenant].remove(ticket)
        self.resolved.add(ticket)

    @rule(step=st.sampled_from([0.0, 0.5, 1.0, 3.0]))
    def tick(self, step: float) -> None:
        self.now += step
        due = {t for t in self._waiters() if t.deadline <= self.now}
        expired = self.placer.expire(self.now)
        assert set(expired) == due and len(expired) == len(due)
        assert [t.deadline for t in expired] == sorted(t.deadline for t in expired)
        for ticket in expired:
            assert ticket.state == "expired" and ticket not in self.resolved
            self.resolved.add(ticket)
            self.waiting[ticket.tenant].remove(ticket)
        self.counts["expired"] += len(expired)

    @rule(name=st.sampled_from(NAMES), others=st.integers(-1, 2))
    def sessions_change(self, name: str, others: int) -> None:
        """Sessions end at the worker (-1), or other proxies start some (+n), unseen by this one."""
        capacity = self.capacity[name]
        active = max(0, self.worker_active[name] + others)
        self.worker_active[name] = min(active, capacity) if capacity else active

    @rule()
    def load_report(self) -> None:
        for name in NAMES:
            self.placer.observe(name, self.worker_active[name], self.capacity[name])
            self.said[name] = (self.worker_active[name], self.capacity[name])

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "placer"):
            return
        placer, waiters = self.placer, self._waiters()
        stats = placer.statistics()
        assert placer.waiting(APP) == len(waiters) == stats.queued[APP]
        assert all(t.state == "waiting" and t.replica is None for t in waiters)
        reserved = collections.Counter(name for name, _ in self.reservations)
        for name in NAMES:
            estimate = stats.replicas.get(name)
            if estimate is None:
                assert not reserved[name] and name not in self.said
                continue
            assert estimate.pending == reserved[name] >= 0
            active, capacity = self.said.get(name, (0, 0))
            ours = self.config.max_per_replica
            assert estimate.active == active
            assert estimate.capacity == (min(ours, capacity) if ours and capacity else ours or capacity)
        for name, ticket in self.reservations:
            if ticket is not None:  # a granted ticket has a replica, with its reservation counted
                assert ticket.state == "granted" and ticket.replica is not None and ticket.replica.name == name
        deadline = placer.next_deadline()
        assert deadline == (min(t.deadline for t in waiters) if waiters else None)
        counts = self.counts
        assert (stats.started, stats.refused_by_worker, stats.queue_full, stats.timed_out) == (
            counts["started"],
            counts["refused"],
            counts["full"],
            counts["expired"],
        )
        queue = placer._queues[APP]
        assert queue.dead == sum(t.state != "waiting" for d in queue.tenants.values() for t in d)


TestPlacerMachine = PlacerMachine.TestCase
TestPlacerMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


# -- SessionTracker ---------------------------------------------------------------------------


def tracker(idle: float = 10.0, max_sessions: int = 100, **capacities: int) -> SessionTracker:
    return SessionTracker(capacities, WorkerSessionConfig(idle_timeout=idle, max_sessions=max_sessions))


def test_open_up_to_the_replicas_capacity() -> None:
    t = tracker(r0=2, r1=1)
    assert [t.open(s, "r0", 0.0) for s in ("a", "b", "c")] == [True, True, False]
    assert t.open("d", "r1", 0.0)
    assert (t.active("r0"), t.active("r1"), t.active("elsewhere")) == (2, 1, 0)
    stats = t.statistics()
    assert (stats.opened, stats.refused, stats.capacity) == (3, 1, {"r0": 2, "r1": 1})
    t.terminate("a")
    assert t.open("c", "r0", 1.0)  # a place freed


def test_capacity_zero_is_unlimited_but_bounded_by_max_sessions() -> None:
    t = tracker(max_sessions=3, r0=0, r1=0)
    assert [t.open(s, "r0", 0.0) for s in ("a", "b")] == [True, True]
    assert t.open("c", "r1", 0.0)
    assert not t.open("d", "r1", 0.0)  # the worker as a whole is full
    assert not t.open("e", "r0", 0.0)
    assert t.statistics().refused == 2
    # max_sessions bounds a replica with room of its own too.
    t = tracker(max_sessions=2, r0=5, r1=5)
    assert [t.open(s, "r0", 0.0) for s in ("a", "b", "c")] == [True, True, False]
    assert t.open("a", "r0", 0.0)  # an open session's re-open is not a new one


def test_reopen_is_idempotent_and_never_moves_a_session() -> None:
    t = tracker(r0=1, r1=1)
    assert t.open("a", "r0", 0.0)
    assert t.open("a", "r0", 1.0)  # a start retried after a lost answer
    assert (t.active("r0"), t.statistics().opened, t.statistics().refused) == (1, 1, 0)
    assert not t.open("a", "r1", 1.0)
    assert t.active("r1") == 0
    with pytest.raises(KeyError):
        t.open("b", "nowhere", 0.0)


def test_begin_and_end_count_requests_in_flight() -> None:
    t = tracker(idle=10.0, r0=1)
    t.open("a", "r0", 0.0)
    assert t.begin("a", "r0", 1.0)
    assert t.begin("a", "r0", 2.0)
    t.end("a", 3.0)
    assert t.expire(100.0) == []  # one request still in flight
    t.end("a", 100.0)
    assert t.expire(109.0) == []
    assert t.expire(110.0) == [("a", "r0")]


def test_begin_on_an_unknown_session_or_another_replica_fails_and_is_counted() -> None:
    t = tracker(idle=10.0, r0=1, r1=1)
    t.open("a", "r0", 0.0)
    assert not t.begin("nope", "r0", 1.0)
    assert not t.begin("a", "r1", 1.0)  # a session is on one replica only
    assert t.statistics().unknown == 2
    # Neither counted in flight for "a": it expires on time.
    assert t.expire(10.0) == [("a", "r0")]


def test_terminate_ends_a_session_at_once() -> None:
    t = tracker(r0=2)
    t.open("a", "r0", 0.0)
    t.open("b", "r0", 0.0)
    assert t.begin("a", "r0", 1.0)
    assert t.terminate("a") == "r0"  # its request in flight runs on
    assert t.active("r0") == 1
    assert not t.begin("a", "r0", 2.0)  # a new request of it: 410
    t.end("a", 3.0)  # the one in flight ends: nothing left to count
    assert t.terminate("a") is None
    assert t.terminate("nope") is None
    stats = t.statistics()
    assert (stats.ended, stats.active, stats.unknown) == ({"idle": 0, "terminated": 1}, {"r0": 1}, 1)


def test_drain_ends_every_session_of_one_replica_and_remembers_why() -> None:
    t = tracker(r0=3, r1=3)
    for session, replica in [("a", "r0"), ("b", "r1"), ("c", "r0")]:
        t.open(session, replica, 0.0)
    assert t.begin("a", "r0", 1.0)  # in flight (a WebSocket): it ends all the same; its end is ignored
    revision = t.revision
    assert sorted(t.drain("r0")) == ["a", "c"]
    assert (t.revision, t.active("r0"), t.active("r1")) == (revision + 1, 0, 1)
    assert (t.why("a"), t.why("c"), t.why("b"), t.why("nope")) == ("drained", "drained", None, None)
    assert not t.begin("c", "r0", 2.0)
    t.end("a", 3.0)
    assert t.drain("r0") == [] and t.revision == revision + 1  # nothing left: no change
    assert t.statistics().ended == {"idle": 0, "terminated": 0, "drained": 2}
    assert t.open("a", "r0", 4.0) and t.why("a") is None  # (a start retried with a drained id)


def test_the_drained_ids_kept_for_why_are_bounded_by_max_sessions() -> None:
    t = tracker(max_sessions=3, r0=0)
    for n in range(4):
        for session in (f"s{n}a", f"s{n}b"):
            assert t.open(session, "r0", float(n))
        assert len(t.drain("r0")) == 2
    assert [t.why(f"s{n}{x}") for n in range(4) for x in "ab"] == [None] * 5 + ["drained"] * 3  # the oldest go


def test_expire_after_idle_timeout_and_not_before() -> None:
    t = tracker(idle=10.0, r0=3)
    t.open("a", "r0", 0.0)
    t.open("b", "r0", 4.0)
    assert t.expire(9.999) == []
    assert t.expire(10.0) == [("a", "r0")]
    assert t.active("r0") == 1
    assert not t.begin("a", "r0", 11.0)
    assert t.expire(14.0) == [("b", "r0")]
    assert t.statistics().ended == {"idle": 2, "terminated": 0}
    assert t.active("r0") == 0


def test_a_request_keeps_its_session_fresh() -> None:
    t = tracker(idle=10.0, r0=1)
    t.open("a", "r0", 0.0)
    assert t.begin("a", "r0", 5.0)
    t.end("a", 6.0)
    assert t.expire(15.9) == []
    assert t.expire(16.0) == [("a", "r0")]


def test_a_busy_session_survives_however_long_and_does_not_hold_up_the_others() -> None:
    t = tracker(idle=10.0, r0=3)
    t.open("socket", "r0", 0.0)
    assert t.begin("socket", "r0", 0.0)  # a WebSocket: in flight for an hour
    t.open("idle", "r0", 1.0)
    t.open("fresh", "r0", 50.0)
    assert t.expire(55.0) == [("idle", "r0")]  # behind the busy one, still found
    assert t.expire(3600.0) == [("fresh", "r0")]
    assert t.expire(3600.0) == []
    t.end("socket", 3600.0)
    assert t.expire(3609.0) == []
    assert t.expire(3610.0) == [("socket", "r0")]


def test_a_request_of_an_earlier_session_of_the_same_id_does_not_make_the_new_one_immortal() -> None:
    t = tracker(idle=10.0, r0=1)
    t.open("a", "r0", 0.0)
    assert t.begin("a", "r0", 0.0)
    t.terminate("a")
    assert t.open("a", "r0", 1.0)  # the same id opened again
    t.end("a", 2.0)  # the first session's request ends
    assert t.expire(12.0) == [("a", "r0")]


def test_tracker_statistics_and_repr() -> None:
    t = tracker(r0=2, r1=0)
    t.open("a", "r0", 0.0)
    t.open("b", "r1", 0.0)
    t.begin("x", "r0", 0.0)
    stats = t.statistics()
    assert (stats.active, stats.capacity, stats.opened, stats.refused, stats.unknown) == (
        {"r0": 1, "r1": 1},
        {"r0": 2, "r1": 0},
        2,
        0,
        1,
    )
    assert repr(t) == "<SessionTracker sessions=2 replicas=2>"
    assert SessionLost("gone", reason="not-hosted").status == 410


def test_a_replica_reached_by_its_route_is_added_with_no_limit_of_its_own() -> None:
    t = tracker(max_sessions=3, r0=1)
    with pytest.raises(KeyError):
        t.open("a", "auto-0", 0.0)  # not added yet
    t.add("auto-0")
    t.add("auto-0")  # known: nothing changes
    t.add("r0", 7)  # listed: its own capacity stays
    assert [t.open(s, "auto-0", 0.0) for s in ("a", "b", "c", "d")] == [True, True, True, False]  # max_sessions
    assert t.begin("a", "auto-0", 1.0) and not t.begin("a", "r0", 1.0)  # hosted there, and only there
    stats = t.statistics()
    assert (stats.active, stats.capacity) == ({"r0": 0, "auto-0": 3}, {"r0": 1, "auto-0": 0})


def test_past_max_added_the_added_replicas_that_host_no_session_are_forgotten() -> None:
    t = SessionTracker({"r0": 0}, WorkerSessionConfig(), max_added=3)
    for name in ("a-0", "a-1", "a-2"):
        t.add(name)
    assert t.open("s", "a-1", 0.0)
    t.add("a-3")  # a fourth: a-0 and a-2 host nothing and go; a-1 hosts a session and stays
    assert sorted(t.capacities) == ["a-1", "a-3", "r0"]
    assert t.begin("s", "a-1", 1.0)
    for n in range(100):  # a flood of names never grows it past the bound (and the names that host a session)
        t.add(f"flood-{n}")
    assert len(t.capacities) <= 1 + 3
    assert t.active("a-1") == 1 and "r0" in t.capacities  # a listed replica is never forgotten


@attrs.define
class _Model:
    replica: str
    in_flight: int
    last_active: float


SESSIONS = ["s0", "s1", "s2", "s3", "s4", "s5"]
REPLICAS = ["r0", "r1"]


class TrackerMachine(RuleBasedStateMachine):
    """Random opens, requests, terminates and expiries against a plain model of the sessions."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.model: dict[str, _Model] = {}

    @initialize(
        capacities=st.lists(st.integers(0, 3), min_size=2, max_size=2),
        max_sessions=st.integers(1, 5),
        idle=st.sampled_from([0.5, 1.0, 3.0]),
    )
    def configure(self, capacities: list[int], max_sessions: int, idle: float) -> None:
        self.capacity = dict(zip(REPLICAS, capacities, strict=True))
        self.config = WorkerSessionConfig(idle_timeout=idle, max_sessions=max_sessions)
        self.tracker = SessionTracker(self.capacity, self.config)

    def _on(self, replica: str) -> int:
        return sum(s.replica == replica for s in self.model.values())

    @rule(session=st.sampled_from(SESSIONS), replica=st.sampled_from(REPLICAS))
    def open(self, session: str, replica: str) -> None:
        opened = self.tracker.open(session, replica, self.now)
        if session in self.model:
            assert opened == (self.model[session].replica == replica)
            return
        capacity = self.capacity[replica]
        room = (not capacity or self._on(replica) < capacity) and len(self.model) < self.config.max_sessions
        assert opened == room
        if opened:
            self.model[session] = _Model(replica, 0, self.now)

    @rule(session=st.sampled_from(SESSIONS), replica=st.sampled_from(REPLICAS))
    def begin(self, session: str, replica: str) -> None:
        began = self.tracker.begin(session, replica, self.now)
        state = self.model.get(session)
        assert began == (state is not None and state.replica == replica)
        if state is not None and began:
            state.in_flight += 1
            state.last_active = self.now

    @rule(session=st.sampled_from(SESSIONS))
    def end(self, session: str) -> None:
        self.tracker.end(session, self.now)
        state = self.model.get(session)
        if state is not None and state.in_flight:  # a stray end (no request in flight) changes nothing
            state.in_flight -= 1
            state.last_active = self.now

    @rule(session=st.sampled_from(SESSIONS))
    def terminate(self, session: str) -> None:
        state = self.model.pop(session, None)
        assert self.tracker.terminate(session) == (state.replica if state is not None else None)

    @rule(replica=st.sampled_from(REPLICAS))
    def drain(self, replica: str) -> None:
        due = {s for s, m in self.model.items() if m.replica == replica}
        revision = self.tracker.revision
        ended = self.tracker.drain(replica)
        assert len(ended) == len(due) and set(ended) == due
        assert self.tracker.revision == revision + bool(due)
        for session in ended:
            del self.model[session]
            assert self.tracker.why(session) == "drained"
            assert not self.tracker.begin(session, replica, self.now)  # a 410 that says why

    @rule(step=st.sampled_from([0.0, 0.25, 1.0, 2.0]))
    def tick(self, step: float) -> None:
        self.now += step
        limit = self.now - self.config.idle_timeout
        due = {(s, m.replica) for s, m in self.model.items() if not m.in_flight and m.last_active <= limit}
        ended = self.tracker.expire(self.now)
        assert len(ended) == len(due) and set(ended) == due
        for session, _ in ended:
            del self.model[session]

    @invariant()
    def active_is_the_open_sessions(self) -> None:
        if not hasattr(self, "tracker"):
            return
        stats = self.tracker.statistics()
        for replica in REPLICAS:
            assert self.tracker.active(replica) == stats.active[replica] == self._on(replica)
            capacity = self.capacity[replica]
            assert not capacity or self._on(replica) <= capacity
        assert sum(stats.active.values()) == len(self.model) <= self.config.max_sessions
        assert stats.opened - sum(stats.ended.values()) == len(self.model)


TestTrackerMachine = TrackerMachine.TestCase
TestTrackerMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
