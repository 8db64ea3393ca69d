"""The discrete-event engine: simulated replicas and clients around the real sans-IO cores.

How it runs, and the invariants the tests check: the package's docstring (:mod:`blocks.simulate`).
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Final

from blocks.autoscaler import AutoscalePolicy, Decision
from blocks.errors import QueueFull
from blocks.http import Request
from blocks.routing import Replica
from blocks.scheduler import FairQueue, Ticket
from blocks.sessions import SessionPlacer, SessionTicket
from blocks.simulate._histogram import Histogram
from blocks.simulate._model import SimConfig
from blocks.simulate._result import Sample, SimResult, SimulationLimit
from blocks.simulate._state import (
    _DRAINING,
    _READY_STATE,
    _STARTING,
    _STOPPED,
    _App,
    _Replica,
    _Request,
    _Session,
    _Tenant,
)
from blocks.simulate._workload import Arrival

# event kinds
_DONE: Final = 0
_READY: Final = 1
_TICK: Final = 2
_SAMPLE: Final = 3
_FQ_EXPIRE: Final = 4
_SQ_EXPIRE: Final = 5
_COLD_EXPIRE: Final = 6
_IDLE: Final = 7

_SERVED: Final = "served"


class Simulation:
    """One configuration, run over one workload: :meth:`run` it, then read the :class:`SimResult`.

    The cores are the library's own: the configuration's routing policy, a
    :class:`~blocks.scheduler.FairQueue`, a :class:`~blocks.sessions.SessionPlacer`
    and an :class:`~blocks.autoscaler.AutoscalePolicy` for every app, called as the
    proxy and the autoscaler's driver call them, with the simulated clock's ``now``.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.now = 0.0
        self.policy = config.policy(random.Random(config.seed * 2 + 1))
        self.fair_queue = FairQueue(config.scheduler) if config.scheduler is not None else None
        self.placer = SessionPlacer(config.sessions) if config.sessions is not None else None
        self._sessioned = config.sessions.apps if config.sessions is not None else frozenset()
        self._service = config.replica.service.sampler(random.Random(config.seed * 2))
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._apps: dict[str, _App] = {}
        self._scaler = AutoscalePolicy(default=config.scaling)  # each app added at its first request
        self._tenants: dict[str, _Tenant] = {}
        self._sessions: dict[str, _Session] = {}
        self._in_flight: dict[str, int] = {}  # replica name -> requests in flight: what the policy reads
        self._waiting: dict[Ticket, _Request] = {}  # fair-queue tickets
        self._placing: dict[SessionTicket, _Session] = {}  # session placer tickets
        self._fq_timer = False
        self._sq_timer = False
        self._serial = 0
        self._revision = 0  # the simulated workers' session revision
        # counts
        self.events = 0
        self._requests = 0
        self._open = 0  # arrived and not ended
        self._refused: dict[str, int] = {}
        self._timed_out: dict[str, int] = {}
        self._cold_starts = 0
        self._cold_waits = 0
        self._sessions_started = 0
        self._starting = self._ready = self._draining = 0
        self._count = 0  # replicas not stopped
        self._peak = 0
        self._area = 0.0
        self._area_at = 0.0
        self._lifetimes = 0.0
        self._changes: list[tuple[float, int]] = [(0.0, 0)]
        self._timeline: list[Sample] = []
        self._bucket_queueing = Histogram()
        self._bucket_latency = Histogram()

    def __repr__(self) -> str:
        return (
            f"<Simulation {self.config.name!r} now={self.now:g} replicas={self._count} "
            f"in_flight={sum(self._in_flight.values())} open={self._open}>"
        )

    # -- the loop -----------------------------------------------------------------------------------

    def _push(self, time: float, kind: int, thing: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, kind, thing))

    def run(
        self, arrivals: Iterable[Arrival], *, until: float | None = None, max_events: int | None = None
    ) -> SimResult:
        """Run ``arrivals`` (in time order) to the end; the result.

        Without ``until`` the run ends when the last request has ended; with
        it, the run goes on to ``until`` (to watch the fleet scale down) and
        no further (requests still open then are counted ``unfinished``).
        ``max_events`` bounds the events processed (:class:`SimulationLimit`
        past it).
        """
        config = self.config
        heap = self._heap
        pop = heapq.heappop
        source: Iterator[Arrival] = iter(arrivals)
        nxt = next(source, None)
        self._push(config.interval, _TICK, None)
        self._push(config.sample, _SAMPLE, None)
        limit = until if until is not None else float("inf")
        budget = max_events if max_events is not None else -1
        arrive, done = self._arrive, self._done
        events = self.events
        last = 0.0
        while True:
            if nxt is not None and (not heap or nxt.time <= heap[0][0]):
                time = nxt.time
                if time > limit:
                    nxt = None
                    continue
                if time < last:
                    raise ValueError(f"arrivals go back in time: {time!r} after {last!r}")
                self.now = last = time
                arrive(nxt)
                nxt = next(source, None)
            else:
                if not heap:
                    break
                time = heap[0][0]
                if time > limit:
                    break
                if nxt is None and until is None and not self._open:
                    break  # everything has ended; only the periodic rounds are left
                _, _, kind, thing = pop(heap)
                self.now = last = time
                if kind == _DONE:
                    done(thing)  # type: ignore[arg-type]
                else:
                    self._other(kind, thing)
            events += 1
            if events == budget:
                self.events = events
                raise SimulationLimit(f"{events} events by {self.now:g} s")
        if until is not None:
            self.now = max(self.now, until)
        self.events = events
        return self._result()

    def _other(self, kind: int, thing: object) -> None:
        if kind == _READY:
            self._ready_replica(thing)  # type: ignore[arg-type]
        elif kind == _IDLE:
            self._idle(thing)  # type: ignore[arg-type]
        elif kind == _TICK:
            self._tick()
            self._push(self.now + self.config.interval, _TICK, None)
        elif kind == _SAMPLE:
            self._sample()
            self._push(self.now + self.config.sample, _SAMPLE, None)
        elif kind == _FQ_EXPIRE:
            self._fq_expire()
        elif kind == _SQ_EXPIRE:
            self._sq_expire()
        elif kind == _COLD_EXPIRE:
            self._cold_expire(thing)  # type: ignore[arg-type]

    # -- a request's path ---------------------------------------------------------------------------

    def _app(self, name: str) -> _App:
        scaler = self._scaler
        scaler.add(name, self.config.scaling_for(name))
        app = self._apps[name] = _App(name, name in self._sessioned, scaler)
        for _ in range(scaler.decide(name, self.now).start):  # min_replicas, ready from the start
            self._ready_replica(self._start_replica(app, cold=False))
        return app

    def _arrive(self, arrival: Arrival) -> None:
        tenant = self._tenants.get(arrival.tenant)
        if tenant is None:
            tenant = self._tenants[arrival.tenant] = _Tenant(arrival.tenant)
        app = self._apps.get(arrival.app)
        if app is None:
            app = self._app(arrival.app)
        request = _Request(self.now, tenant, app, arrival.size * self._service())
        app.scaler.touch(app.name, self.now)
        tenant.requests += 1
        self._requests += 1
        self._open += 1
        if app.sessioned and arrival.session:
            session = self._sessions.get(arrival.session)
            if session is None:
                session = self._sessions[arrival.session] = _Session(arrival.session, app, tenant, self.now)
                session.waiting.append(request)
                self._place(session)
            elif session.replica is None:
                session.waiting.append(request)  # its start is still waiting for a place
            else:
                request.session = session
                session.in_flight += 1
                self._admit(request)
        elif not app.live:
            self._cold_wait(app, request)
        else:
            self._admit(request)

    def _cold_wait(self, app: _App, waiter: _Request | _Session) -> None:
        self._cold_waits += len(waiter.waiting) if isinstance(waiter, _Session) else 1
        app.cold.append((self.now + self.config.cold_start_timeout, waiter))
        if not app.cold_timer:
            app.cold_timer = True
            self._push(self.now + self.config.cold_start_timeout, _COLD_EXPIRE, app)
        if app.scaler.request(app.name, self.now) == "start":  # one start for every waiter (single flight)
            self._apply(app, app.scaler.decide(app.name, self.now))

    def _place(self, session: _Session) -> None:
        placer = self.placer
        assert placer is not None
        app = session.app
        while True:
            if not app.live:
                self._cold_wait(app, session)
                return
            route = placer.reserve(app.name, app.live)
            if route is None:
                try:
                    ticket = placer.enqueue(app.name, session.tenant.name, self.now)
                except QueueFull:
                    self._fail_session(session, "session-queue-full", refused=True)
                    return
                self._placing[ticket] = session
                if not self._sq_timer:
                    self._sq_timer = True
                    self._push(ticket.deadline, _SQ_EXPIRE, None)
                return
            if self._open_session(session, app.replicas[route.name]):
                return

    def _open_session(self, session: _Session, replica: _Replica) -> bool:
        """The simulated worker's answer to a start placed on ``replica``: open it, unless full."""
        placer = self.placer
        assert placer is not None
        capacity = self.config.replica.max_sessions
        if replica.state != _READY_STATE or (capacity and replica.sessions >= capacity):
            placer.answered(replica.name, replica.sessions, capacity, started=False, at=self._revision)
            return False
        self._revision += 1
        replica.sessions += 1
        replica.app.sessions += 1
        placer.answered(replica.name, replica.sessions, capacity, started=True, at=self._revision)
        self._sessions_started += 1
        session.replica = replica
        waiting, session.waiting = session.waiting, []
        session.in_flight += len(waiting)
        for request in waiting:
            request.session = session
            self._admit(request)
        return True

    def _fail_session(self, session: _Session, reason: str, *, refused: bool) -> None:
        waiting, session.waiting = session.waiting, []
        del self._sessions[session.id]
        for request in waiting:
            self._end(request, reason, refused=refused)

    def _admit(self, request: _Request) -> None:
        queue = self.fair_queue
        if queue is None:
            self._route(request)
            return
        tenant = request.tenant.name
        grant = queue.try_acquire(tenant)
        if grant is None:
            try:
                ticket = queue.enqueue(tenant, self.now)
            except QueueFull:
                self._end(request, "queue-full", refused=True)
                return
            if ticket.grant is None:
                self._waiting[ticket] = request
                if not self._fq_timer:
                    self._fq_timer = True
                    self._push(ticket.deadline, _FQ_EXPIRE, None)
                return
            grant = ticket.grant
        request.grant = grant
        self._route(request)

    def _route(self, request: _Request) -> None:
        session = request.session
        if session is not None:
            replica = session.replica
            assert replica is not None
        else:
            app = request.app
            live = app.live
            if not live:  # every replica left between admission and now: wait for a new one
                self._release(request)
                self._cold_wait(app, request)
                return
            policy_request = app.requests.get(request.tenant.name)
            if policy_request is None:
                policy_request = app.requests[request.tenant.name] = Request(
                    method=b"GET",
                    scheme=b"https",
                    authority=app.name.encode(),
                    path=b"/",
                    headers=[(b"x-tenant", request.tenant.name.encode())],
                )
            replica = app.replicas[self.policy.pick(policy_request, live, self._in_flight).name]
        request.replica = replica
        name = replica.name
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        replica.in_flight += 1
        replica.app.in_flight += 1
        if replica.busy < self.config.replica.concurrency:
            self._serve(request, replica)
        else:
            replica.queue.append(request)

    def _serve(self, request: _Request, replica: _Replica) -> None:
        replica.busy += 1
        if replica.busy > self.config.replica.concurrency or replica.state == _STARTING or replica.state == _STOPPED:
            raise AssertionError(f"{replica.name} serves {replica.busy} at once in state {replica.state}")
        now = self.now
        wait = now - request.arrival
        request.tenant.queueing.add_both(self._bucket_queueing, wait)
        self._seq += 1
        heapq.heappush(self._heap, (now + request.service, self._seq, _DONE, request))

    def _done(self, request: _Request) -> None:
        replica = request.replica
        assert replica is not None
        replica.busy -= 1
        replica.in_flight -= 1
        replica.app.in_flight -= 1
        self._in_flight[replica.name] -= 1
        latency = self.now - request.arrival
        request.tenant.latency.add_both(self._bucket_latency, latency)
        self._end(request, _SERVED)
        if replica.queue:
            self._serve(replica.queue.popleft(), replica)
        self._release(request)
        if replica.state == _DRAINING and not replica.in_flight and not replica.sessions:
            self._stop(replica)

    def _release(self, request: _Request) -> None:
        grant = request.grant
        if grant is None:
            return
        request.grant = None
        assert self.fair_queue is not None
        for ticket in self.fair_queue.release(grant, self.now):
            waiter = self._waiting.pop(ticket)
            waiter.grant = ticket.grant
            self._route(waiter)

    def _end(self, request: _Request, outcome: str, *, refused: bool = False) -> None:
        if request.ended:
            raise AssertionError(f"a request ended twice: {request.ended} then {outcome}")
        request.ended = outcome
        self._open -= 1
        session = request.session
        if session is not None:
            session.in_flight -= 1
            session.last = self.now
            if not session.in_flight and not session.timer:
                session.timer = True
                self._push(self.now + self.config.session_idle, _IDLE, session)
        tenant = request.tenant
        if outcome is _SERVED:
            tenant.served += 1
        elif refused:
            tenant.refused += 1
            self._refused[outcome] = self._refused.get(outcome, 0) + 1
        else:
            tenant.timed_out += 1
            self._timed_out[outcome] = self._timed_out.get(outcome, 0) + 1

    # -- deadlines and idle sessions ------------------------------------------------------------------

    def _fq_expire(self) -> None:
        queue = self.fair_queue
        assert queue is not None
        for ticket in queue.expire(self.now):
            self._end(self._waiting.pop(ticket), "queue-timeout")
        deadline = queue.next_deadline()
        self._fq_timer = deadline is not None
        if deadline is not None:
            self._push(deadline, _FQ_EXPIRE, None)

    def _sq_expire(self) -> None:
        placer = self.placer
        assert placer is not None
        for ticket in placer.expire(self.now):
            self._fail_session(self._placing.pop(ticket), "session-timeout", refused=False)
        deadline = placer.next_deadline()
        self._sq_timer = deadline is not None
        if deadline is not None:
            self._push(deadline, _SQ_EXPIRE, None)

    def _cold_expire(self, app: _App) -> None:
        cold, now = app.cold, self.now
        while cold and cold[0][0] <= now:
            waiter = cold.popleft()[1]
            if isinstance(waiter, _Session):
                self._fail_session(waiter, "cold-start", refused=False)
            else:
                self._end(waiter, "cold-start")
        app.cold_timer = bool(cold)
        if cold:
            self._push(cold[0][0], _COLD_EXPIRE, app)

    def _idle(self, session: _Session) -> None:
        idle = self.config.session_idle
        if session.in_flight:
            session.timer = False  # re-armed when its last request ends
            return
        if session.last + idle > self.now:
            self._push(session.last + idle, _IDLE, session)
            return
        session.timer = False
        replica = session.replica
        assert replica is not None and self.placer is not None
        del self._sessions[session.id]
        self._revision += 1
        replica.sessions -= 1
        replica.app.sessions -= 1
        self.placer.observe(replica.name, replica.sessions, self.config.replica.max_sessions, at=self._revision)
        if replica.state == _DRAINING:
            if not replica.in_flight and not replica.sessions:
                self._stop(replica)
        else:
            self._grant_places(replica.app)

    def _grant_places(self, app: _App) -> None:
        placer = self.placer
        if placer is None or not app.live:
            return
        for ticket in placer.grant(app.name, app.live):
            session = self._placing.pop(ticket)
            assert ticket.replica is not None
            if not self._open_session(session, app.replicas[ticket.replica.name]):
                placer.requeue(ticket)
                self._placing[ticket] = session

    # -- replicas -----------------------------------------------------------------------------------

    def _recount(self, delta: int) -> None:
        now = self.now
        self._area += self._count * (now - self._area_at)
        self._area_at = now
        self._count += delta
        self._changes.append((now, self._count))
        if self._count > self._peak:
            self._peak = self._count

    def _start_replica(self, app: _App, *, cold: bool = True) -> _Replica:
        self._serial += 1
        name = f"{app.name}-{self._serial}"
        route = Replica(
            name=name, worker=("sim", 0), address=("sim", self._serial), capacity=self.config.replica.concurrency
        )
        replica = app.replicas[name] = _Replica(app, route, self.now)
        app.scaler.starting(app.name, name, self.now)
        app.starting += 1
        self._starting += 1
        self._recount(+1)
        if cold:
            self._cold_starts += 1
            self._push(self.now + self.config.replica.cold_start, _READY, replica)
        return replica

    def _ready_replica(self, replica: _Replica) -> None:
        if replica.state != _STARTING:
            return
        app = replica.app
        app.scaler.ready(app.name, replica.name, self.now)
        replica.state = _READY_STATE
        app.starting -= 1
        self._starting -= 1
        self._ready += 1
        app.live = (*app.live, replica.route)
        if self.placer is not None and app.sessioned:
            self.placer.observe(replica.name, 0, self.config.replica.max_sessions, at=self._revision)
        cold, app.cold = app.cold, deque()
        for _, waiter in cold:
            if isinstance(waiter, _Session):
                self._place(waiter)
            else:
                self._admit(waiter)
        self._grant_places(app)

    def _drain(self, replica: _Replica) -> None:
        app = replica.app
        if replica.state == _STARTING:  # it serves nothing yet: it simply stops
            self._stop(replica)
            return
        app.scaler.draining(app.name, replica.name, self.now)
        replica.state = _DRAINING
        self._ready -= 1
        self._draining += 1
        app.live = tuple(route for route in app.live if route is not replica.route)
        if not replica.in_flight and not replica.sessions:
            self._stop(replica)

    def _stop(self, replica: _Replica) -> None:
        app = replica.app
        if replica.state == _DRAINING:
            self._draining -= 1
        elif replica.state == _STARTING:
            self._starting -= 1
            app.starting -= 1
        replica.state = _STOPPED
        app.scaler.gone(app.name, replica.name, self.now)
        del app.replicas[replica.name]
        self._in_flight.pop(replica.name, None)
        self._lifetimes += self.now - replica.created
        self._recount(-1)

    # -- the autoscaler round and the timeline -------------------------------------------------------

    def _tick(self) -> None:
        now = self.now
        for app in self._apps.values():
            scaler = app.scaler
            scaler.record(app.name, app.sessions if app.sessioned else app.in_flight, now)
            decision = scaler.decide(app.name, now)
            if decision.drain:
                # The drain choice reads each replica's figures: tell them only when it drains (a
                # decision asked again before it is acted on is the same, with fresh figures).
                for replica in app.replicas.values():
                    scaler.load(app.name, replica.name, replica.in_flight, replica.sessions)
                decision = scaler.decide(app.name, now)
            self._apply(app, decision)

    def _apply(self, app: _App, decision: Decision) -> None:
        for _ in range(decision.start):
            self._start_replica(app)
        for name in decision.drain:
            self._drain(app.replicas[name])

    def _sample(self) -> None:
        latency, queueing = self._bucket_latency, self._bucket_queueing
        self._timeline.append(
            Sample(
                time=self.now,
                replicas=self._count,
                ready=self._ready,
                starting=self._starting,
                draining=self._draining,
                in_flight=sum(app.in_flight for app in self._apps.values()),
                served=latency.count,
                queueing_p50=queueing.percentile(0.5),
                latency_p50=latency.percentile(0.5),
                latency_p99=latency.percentile(0.99),
            )
        )
        self._bucket_latency, self._bucket_queueing = Histogram(), Histogram()

    def _result(self) -> SimResult:
        self._recount(0)
        end = self.now
        lifetimes = self._lifetimes + sum(
            end - replica.created for app in self._apps.values() for replica in app.replicas.values()
        )
        tenants = {name: t.result() for name, t in sorted(self._tenants.items())}
        queueing, latency = Histogram(), Histogram()
        for t in self._tenants.values():
            queueing.merge(t.queueing)
            latency.merge(t.latency)
        return SimResult(
            name=self.config.name,
            end=end,
            events=self.events,
            requests=self._requests,
            served=sum(t.served for t in tenants.values()),
            refused=dict(sorted(self._refused.items())),
            timed_out=dict(sorted(self._timed_out.items())),
            unfinished=self._open,
            tenants=tenants,
            queueing_p50=queueing.percentile(0.5),
            queueing_p99=queueing.percentile(0.99),
            latency_p50=latency.percentile(0.5),
            latency_p99=latency.percentile(0.99),
            replica_seconds=self._area,
            lifetimes=lifetimes,
            cold_starts=self._cold_starts,
            cold_waits=self._cold_waits,
            peak_replicas=self._peak,
            sessions=self._sessions_started,
            timeline=tuple(self._timeline),
            replica_changes=tuple(self._changes),
        )


def simulate(config: SimConfig, arrivals: Iterable[Arrival], *, until: float | None = None) -> SimResult:
    """Run ``config`` over ``arrivals``: ``Simulation(config).run(arrivals, until=until)``."""
    return Simulation(config).run(arrivals, until=until)
