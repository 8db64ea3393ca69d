"""The concurrency prober's trio driver: polls workers' load, feeds a :class:`LoadEstimator`.

The decisions are sans-IO, in :mod:`blocks.prober._core`; this module only puts them
on trio's clock and the network. :func:`open_prober` runs one task in a
nursery of its own (service lifetime, never a request's): once an
``interval`` it sends ``GET /.proxyblocks/load`` to every worker at once over
the proxy's pooled connections, applies each answer with
:meth:`LoadEstimator.snapshot`, expires the snapshots of workers that stopped
answering, and records each app's in-flight total in an optional
:class:`AutoscaleSignal`. Nothing here is on the request path: a policy
reads the estimator's memory.

A poll is bounded by a cancel scope of ``timeout`` (connect, head and body
alike), not by ``Upstreams.request(timeout=...)``: the pool's deadline sweeper
expires streams in insertion order, so a short per-call timeout on a pool
whose requests use ``response_timeout`` could fire late. Cancelled while it
waits for the head, the stream is reset and its slot freed at once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import trio

from blocks._sync import every, one_error
from blocks.fields import LOAD_PATH, PROBE_HEADER
from blocks.http import Request, Response, json_response
from blocks.prober._core import (
    LoadEstimator,
    LoadReport,
    ProberConfig,
    ReplicaLoad,
    encode_load,
    parse_load,
)
from blocks.prober._core_signal import AutoscaleSignal

if TYPE_CHECKING:
    from blocks.routing import Address, Replica
    from blocks.transport.multiplexer import Upstreams

log = logging.getLogger("blocks.prober")

_MAX_LOAD_BODY = 1024 * 1024  # a worker with thousands of replicas stays well under this


@attrs.frozen
class WorkerProbeStatistics:
    """One worker as the prober saw it.

    ``age``: seconds since the poll behind its last applied answer was sent
    (``None`` if it never answered); ``last_error``: why the latest failed
    poll failed (``None`` once a poll succeeds again); ``replicas``: how many
    replicas its last answer listed.
    """

    polls: int
    failures: int
    age: float | None
    last_error: str | None
    replicas: int


@attrs.frozen
class ProberStatistics:
    rounds: int
    polls: int
    failures: int
    workers: dict[Address, WorkerProbeStatistics]


@attrs.define(eq=False)
class _Worker:
    polls: int = 0
    failures: int = 0
    last_success: float | None = None
    last_error: str | None = None
    replicas: int = 0
    seen: float = 0.0  # the last round it was listed in


def _authority(address: Address) -> bytes:
    host, port = address
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()


class Prober:
    """Polls workers for their replicas' load. Use :func:`open_prober`."""

    def __init__(
        self,
        upstreams: Upstreams,
        workers: Callable[[], Iterable[Address]],
        estimator: LoadEstimator,
        config: ProberConfig,
        *,
        autoscale: AutoscaleSignal | None = None,
        apps: Callable[[], Mapping[str, Sequence[Replica]]] | None = None,
        on_report: Callable[[LoadReport, float], None] | None = None,
        session_apps: Collection[str] = (),
        on_poll: Callable[[Address, int | None], None] | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.on_poll = on_poll
        self.workers = workers
        self.estimator = estimator
        self.config = config
        self.autoscale = autoscale
        self.apps = apps
        self.on_report = on_report
        self.session_apps = session_apps
        self._sessions: dict[str, int] = {}  # replica -> active sessions, from its worker's last answer
        self._workers: dict[Address, _Worker] = {}
        self._rounds = 0
        self._round_done = trio.Event()

    def __repr__(self) -> str:
        return f"<Prober workers={len(self._workers)} rounds={self._rounds}>"

    def statistics(self) -> ProberStatistics:
        now = trio.current_time()
        workers = {
            address: WorkerProbeStatistics(
                polls=state.polls,
                failures=state.failures,
                age=None if state.last_success is None else now - state.last_success,
                last_error=state.last_error,
                replicas=state.replicas,
            )
            for address, state in self._workers.items()
        }
        return ProberStatistics(
            rounds=self._rounds,
            polls=sum(state.polls for state in self._workers.values()),
            failures=sum(state.failures for state in self._workers.values()),
            workers=workers,
        )

    async def wait_round(self) -> None:
        """Wait until the round that is running (or the next one) has finished."""
        await self._round_done.wait()

    async def poll(self, address: Address) -> None:
        """Poll one worker now and apply its answer; failures are counted, never raised."""
        state = self._workers.get(address)
        if state is None:
            state = self._workers[address] = _Worker()
        state.polls += 1
        taken_at = trio.current_time()
        error: str | None = "timed out"
        status: int | None = None
        with trio.move_on_after(self.config.timeout):
            try:
                request = Request(b"GET", b"http", _authority(address), LOAD_PATH)
                response = await self.upstreams.request(address, request, [(PROBE_HEADER, b"1")])
                status = response.status
                try:
                    body = await response.body.read_all(_MAX_LOAD_BODY)
                finally:
                    # Abandoned mid-body (the timeout, a reset): the stream is
                    # reset and its slot freed. A no-op once the body has ended;
                    # an h2 body's aclose never waits, the shield only says so.
                    with trio.CancelScope(shield=True):
                        await response.body.aclose()
                if response.status != 200:
                    raise ValueError(f"status {response.status}")
                report = parse_load(body)
            except Exception as exc:
                # A worker's failure is counted and its snapshots go stale;
                # the prober itself carries on. (Cancelled is not an Exception.)
                error = f"{type(exc).__name__}: {exc}"
            else:
                error = None
        if self.on_poll is not None:
            self.on_poll(address, status if error is None or status == 503 else None)
        if error is not None:
            state.failures += 1
            state.last_error = error
            log.debug("load poll of %r failed: %s", address, error)
            return
        now = trio.current_time()
        for name, load in report.replicas.items():
            self.estimator.snapshot(name, load.in_flight, load.capacity, now, taken_at)
            if load.sessions is not None:
                self._sessions[name] = load.sessions
        if self.on_report is not None:
            self.on_report(report, taken_at)
        state.last_success = taken_at
        state.last_error = None
        state.replicas = len(report.replicas)

    async def run_round(self) -> None:
        """One round: poll every worker at once, expire stale snapshots, feed the autoscale signal."""
        started = trio.current_time()
        addresses = set(self.workers())
        async with trio.open_nursery() as nursery:
            for address in addresses:
                nursery.start_soon(self.poll, address)
        for address in addresses:
            self._workers[address].seen = started
        for address in [a for a, state in self._workers.items() if state.seen < started]:
            del self._workers[address]  # no longer listed
        now = trio.current_time()
        self.estimator.expire(now, self.config.stale_after)
        if self.autoscale is not None and self.apps is not None:
            apps = self.apps()
            estimate = self.estimator.estimate
            sessions = self._sessions
            for app, replicas in apps.items():
                if app in self.session_apps:  # sessions are a sessioned app's unit of concurrency
                    used = sum(sessions.get(r.name, 0) for r in replicas)
                else:
                    used = sum(estimate(r.name) for r in replicas)
                self.autoscale.record(app, used, len(replicas), now)
            for app in self.autoscale.apps:
                if app not in apps:
                    self.autoscale.forget(app)
        self._rounds += 1
        done, self._round_done = self._round_done, trio.Event()
        done.set()

    async def _run_forever(self) -> None:
        await every(self.config.interval, self.run_round)


@asynccontextmanager
async def open_prober(
    upstreams: Upstreams,
    workers: Callable[[], Iterable[Address]],
    estimator: LoadEstimator,
    config: ProberConfig | None = None,
    *,
    autoscale: AutoscaleSignal | None = None,
    apps: Callable[[], Mapping[str, Sequence[Replica]]] | None = None,
    on_report: Callable[[LoadReport, float], None] | None = None,
    session_apps: Collection[str] = (),
    on_poll: Callable[[Address, int | None], None] | None = None,
) -> AsyncIterator[Prober]:
    """A running :class:`Prober` for the ``async with`` block.

    ``workers()`` is read at the start of each round: the addresses to poll
    (for a proxy, the ``worker`` of every replica in its route table).
    ``upstreams`` is normally the proxy's own, so that polls ride the pooled
    h2 connections requests use. With ``autoscale`` and ``apps`` (app ->
    its replicas, read each round), each round records every app's estimated
    in-flight total, or for the ``session_apps``, their active sessions
    (a sessioned app scales by sessions). ``on_report`` hears every worker's
    parsed answer and when its poll was sent (the session broker's
    estimate). ``on_poll(address, status)`` hears how every poll went: 200,
    503 (the worker drains), or None (no usable answer): the health
    checker's view of the workers, so that it sends no second poll
    (:meth:`HealthChecker.observe`). The first round starts at once. Leaving
    the block stops the prober; errors from the body come out as they are,
    not wrapped.
    """
    prober = Prober(
        upstreams,
        workers,
        estimator,
        config or ProberConfig(),
        autoscale=autoscale,
        apps=apps,
        on_report=on_report,
        session_apps=session_apps,
        on_poll=on_poll,
    )
    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prober._run_forever)
            try:
                yield prober
            finally:
                nursery.cancel_scope.cancel()


def load_response(worker: str, replicas: Mapping[str, ReplicaLoad], *, status: int = 200) -> Response:
    """A worker's answer to a load probe: :func:`encode_load` as JSON, never cached (``status`` 503: draining)."""
    return json_response(status, encode_load(worker, replicas))
