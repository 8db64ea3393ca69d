"""What the engine keeps of a run's replicas, apps, tenants, requests and sessions: slotted records,
changed only by :class:`~blocks.simulate._engine.Simulation`."""

from __future__ import annotations

from collections import deque
from typing import Final

from blocks.autoscaler import AutoscalePolicy
from blocks.http import Request
from blocks.routing import Replica
from blocks.scheduler import Grant
from blocks.simulate._histogram import Histogram
from blocks.simulate._result import TenantResult

# replica states
_STARTING: Final = 0
_READY_STATE: Final = 1
_DRAINING: Final = 2
_STOPPED: Final = 3


class _Replica:
    __slots__ = ("app", "busy", "created", "in_flight", "name", "queue", "route", "sessions", "state")

    def __init__(self, app: _App, route: Replica, now: float) -> None:
        self.app = app
        self.name = route.name
        self.route = route
        self.state = _STARTING
        self.busy = 0  # in service
        self.in_flight = 0  # in service or in its queue
        self.queue: deque[_Request] = deque()
        self.sessions = 0
        self.created = now


class _App:
    __slots__ = (
        "cold",
        "cold_timer",
        "in_flight",
        "live",
        "name",
        "replicas",
        "requests",
        "scaler",
        "sessioned",
        "sessions",
        "starting",
    )

    def __init__(self, name: str, sessioned: bool, scaler: AutoscalePolicy) -> None:
        self.name = name
        self.sessioned = sessioned
        self.scaler = scaler
        self.live: tuple[Replica, ...] = ()  # ready, in the routes: what the policy picks from
        self.replicas: dict[str, _Replica] = {}  # every replica not stopped
        self.starting = 0
        self.in_flight = 0
        self.sessions = 0
        self.cold: deque[tuple[float, _Request | _Session]] = deque()  # (deadline, waiter) for a first replica
        self.cold_timer = False
        self.requests: dict[str, Request] = {}  # tenant -> the Request a policy is shown


class _Tenant:
    __slots__ = ("latency", "name", "queueing", "refused", "requests", "served", "timed_out")

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests = self.served = self.refused = self.timed_out = 0
        self.queueing = Histogram()
        self.latency = Histogram()

    def result(self) -> TenantResult:
        served = self.served
        return TenantResult(
            requests=self.requests,
            served=served,
            refused=self.refused,
            timed_out=self.timed_out,
            unfinished=self.requests - served - self.refused - self.timed_out,
            queueing_p50=self.queueing.percentile(0.5),
            queueing_p99=self.queueing.percentile(0.99),
            latency_p50=self.latency.percentile(0.5),
            latency_p99=self.latency.percentile(0.99),
        )


class _Request:
    __slots__ = ("app", "arrival", "ended", "grant", "replica", "service", "session", "tenant")

    def __init__(self, arrival: float, tenant: _Tenant, app: _App, service: float) -> None:
        self.arrival = arrival
        self.tenant = tenant
        self.app = app
        self.service = service
        self.session: _Session | None = None
        self.grant: Grant | None = None
        self.replica: _Replica | None = None
        self.ended = ""


class _Session:
    __slots__ = ("app", "id", "in_flight", "last", "replica", "tenant", "timer", "waiting")

    def __init__(self, sid: str, app: _App, tenant: _Tenant, now: float) -> None:
        self.id = sid
        self.app = app
        self.tenant = tenant
        self.replica: _Replica | None = None
        self.waiting: list[_Request] = []  # requests that came before its start was placed
        self.in_flight = 0
        self.last = now
        self.timer = False
