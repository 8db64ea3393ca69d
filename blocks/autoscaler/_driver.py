"""The autoscaler's trio driver: real replica processes, started and drained as the policy says.

The decisions are sans-IO, in :mod:`blocks.autoscaler._core`; this module
puts them on trio's clock, on processes and on the route store.
:func:`open_autoscaler` runs, in a nursery of its own (the service's
lifetime, never a request's):

- a prober (:func:`~blocks.prober.open_prober`) polling the worker in front
  of the replicas, whose in-flight figures feed the policy each round;
- the decision loop: once a round, or at once when something changes (a
  cold start, a replica that died or came up), it asks the policy and
  carries out the decision;
- one task per replica, which owns its process from start to exit.

A replica's life, and what every proxy sees of it through the store:

1. ``starting``: the command runs on a free port; nothing in the routes.
   Every ``health_interval`` it is sent ``GET health_path``; a status
   under 500 makes it ready. No answer within ``start_timeout``, or an
   exit, is a failed start: the process is stopped, and the app's next
   start waits a backoff (0.1 s doubling to 10 s) so that a broken command
   is not restarted in a tight loop.
2. ``ready``: its record is put in the store, ``state: live``.
3. ``draining``: its record is put again with ``state: draining`` (every
   proxy's cache then stops offering it), and it gets ``drain_timeout`` to
   finish what it has: it is stopped once the prober reports nothing in
   flight on it at a poll sent at least ``settle`` after the draining write
   (so that a request a proxy routed just before it saw the write is
   counted), or when the time is up.
4. stopped: SIGTERM, SIGKILL after ``stop_timeout``; then its record is
   deleted. A ready replica whose process exits by itself is deleted from
   the store at once and replaced (counted in ``restarts``).

Invariant: a replica's record is in the store only while its process runs
and has answered a health request, and every process this driver started is
gone when :func:`open_autoscaler` returns, however it ends (each replica
task stops its process in a shielded ``finally``).
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import subprocess
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager

import attrs
import trio

from blocks._sync import one_error
from blocks.autoscaler._config import AppDriverStatistics, DriverConfig, DriverStatistics, ReplicaTemplate
from blocks.autoscaler._core import AutoscalePolicy, Phase
from blocks.errors import ColdStartTimeout, NoRoute
from blocks.http import Request
from blocks.prober import LoadEstimator, LoadReport, Prober, ProberConfig, open_prober
from blocks.routing import (
    Address,
    RouteCache,
    encode_domain,
    encode_replica,
    format_address,
    route_key_for_domain,
    route_key_for_replica,
)
from blocks.singleflight import SingleFlight, open_single_flight
from blocks.sources import EmbeddedStore, EtcdSource
from blocks.transport.multiplexer import Upstreams, open_upstreams

log = logging.getLogger("blocks.autoscaler")

_MAX_BACKOFF = 10.0  # seconds between failed starts of one app, at most


@attrs.define(eq=False)
class _Replica:
    app: str
    name: str
    address: Address
    phase: Phase = "starting"
    process: trio.Process | None = None
    stop: trio.Event = attrs.field(factory=trio.Event)
    start_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)


@attrs.define(eq=False)
class _AppState:
    template: ReplicaTemplate
    serial: int = 0
    starts: int = 0
    failed_starts: int = 0
    restarts: int = 0
    failures: int = 0  # failed starts in a row
    hold_until: float = -math.inf
    waiting: int = 0
    ready: trio.Event = attrs.field(factory=trio.Event)  # set while a replica is ready, renewed when none is


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


class Autoscaler:
    """Runs the replica processes of the apps an :class:`AutoscalePolicy` scales. Use :func:`open_autoscaler`."""

    def __init__(
        self,
        policy: AutoscalePolicy,
        templates: Mapping[str, ReplicaTemplate],
        store: EmbeddedStore | EtcdSource,
        worker: Address,
        config: DriverConfig,
        upstreams: Upstreams,
        nursery: trio.Nursery,
    ) -> None:
        self.policy = policy
        self.store = store
        self.worker = worker
        self.config = config
        self.estimator = LoadEstimator()
        self._upstreams = upstreams
        self._nursery = nursery
        self._apps = {app: _AppState(template) for app, template in templates.items()}
        self._replicas: dict[str, _Replica] = {}
        self._sessions: dict[str, int] = {}
        self._wake = trio.Event()
        self._round = 0
        self._round_done = trio.Event()
        self._round_sent = -math.inf  # when the poll behind the last round was sent
        self._flights: SingleFlight | None = None

    def __repr__(self) -> str:
        return f"<Autoscaler worker={format_address(self.worker)} replicas={len(self._replicas)}>"

    @property
    def apps(self) -> list[str]:
        return list(self._apps)

    # -- what the proxy calls ----------------------------------------------------------------

    def touch(self, app: str) -> None:
        """A request for ``app`` arrived (the request path: one assignment)."""
        self.policy.touch(app, trio.current_time())

    def demand(self, app: str) -> None:
        """A request for ``app`` found no ready replica: start one now unless one is starting."""
        if self.policy.request(app, trio.current_time()) != "ready":
            self._decide(app)

    async def wait_routed(self, app: str, routes: RouteCache) -> None:
        """Return once ``routes`` offers ``app`` a live replica, starting one if none is; a cold start.

        Waits on memory only: ``routes`` (the proxy's cache) tells its
        listeners when the app's replicas change, and the start runs in the
        driver's nursery. Concurrent callers for the same app share one wait
        (single-flight), and the policy starts one replica for all of them.
        Raises :class:`~blocks.errors.ColdStartTimeout` (503) after
        ``config.cold_start_timeout``; a caller that gives up never cancels
        the start.
        """
        if routes.replicas(app):
            return
        state = self._apps[app]
        flights = self._flights
        if flights is None:
            raise NoRoute(f"{app}: the autoscaler stopped", error_reason="no_replica")
        key = ("cold start", app, id(routes))
        timeout = self.config.cold_start_timeout
        state.waiting += 1
        try:
            with trio.move_on_after(timeout):
                while not routes.replicas(app):
                    try:
                        await flights.load(key, functools.partial(self._cold_start, app, routes))
                    except trio.TooSlowError:
                        continue  # that flight ran its course; this caller's own time is not up
                    except trio.ClosedResourceError as exc:  # the autoscaler is stopping
                        raise NoRoute(f"{app}: the autoscaler stopped", error_reason="no_replica") from exc
                return
        finally:
            state.waiting -= 1
        raise ColdStartTimeout(f"{app}: no replica ready within {timeout:g}s of a cold start", app=app)

    async def _cold_start(self, app: str, routes: RouteCache) -> None:
        """Ask for a replica, then wait until ``routes`` offers one (a single-flight load)."""
        ready = trio.Event()

        def changed(apps: frozenset[str]) -> None:
            if app in apps and routes.replicas(app):
                ready.set()

        remove = routes.add_listener(changed)
        try:
            self.demand(app)
            if not routes.replicas(app):
                await ready.wait()
        finally:
            remove()

    def drain(self, name: str) -> None:
        """Drain replica ``name`` now, whatever the policy says (an operator's move off a host, say).

        It leaves the routes and stops once idle or at ``drain_timeout``, as
        for the policy's own drains; if the app's count needs it, the policy
        starts a replacement at once. ``KeyError`` for a name not running;
        a replica already draining is left as it is.
        """
        replica = self._replicas[name]
        if replica.phase == "draining":
            return
        self._stop(replica, trio.current_time())
        log.info("%s: draining %s (asked)", replica.app, name)
        self._decide(replica.app)

    def ready_event(self, app: str) -> trio.Event:
        """An event set while ``app`` has a ready replica in the store (renewed when it has none)."""
        return self._apps[app].ready

    # -- statistics ----------------------------------------------------------------------------

    def statistics(self) -> DriverStatistics:
        now = trio.current_time()
        policy = self.policy.statistics(now)
        apps = {}
        for app, state in self._apps.items():
            phases = [r.phase for r in self._replicas.values() if r.app == app]
            apps[app] = AppDriverStatistics(
                wanted=policy.apps[app].wanted,
                starting=phases.count("starting"),
                ready=phases.count("ready"),
                draining=phases.count("draining"),
                in_flight=policy.apps[app].in_flight,
                waiting=state.waiting,
                starts=state.starts,
                failed_starts=state.failed_starts,
                restarts=state.restarts,
            )
        processes = {
            name: r.process.pid
            for name, r in sorted(self._replicas.items())
            if r.process is not None and r.process.returncode is None
        }
        return DriverStatistics(apps, processes)

    # -- the decision loop -------------------------------------------------------------------

    def _on_report(self, report: LoadReport, taken_at: float) -> None:
        for name, load in report.replicas.items():
            if load.sessions is not None:
                self._sessions[name] = load.sessions
        self._round_sent = max(self._round_sent, taken_at)

    def _feed(self, now: float) -> None:
        """The prober's figures into the policy: per replica, and per app."""
        for app, app_state in self._apps.items():
            if app_state.waiting:
                self.policy.touch(app, now)  # requests wait for a replica: the app is anything but idle
            unit = self.policy.config(app).unit
            total = 0
            for r in self._replicas.values():
                if r.app != app or r.phase == "starting":
                    continue
                in_flight = self.estimator.estimate(r.name)
                sessions = self._sessions.get(r.name, 0)
                self.policy.load(app, r.name, in_flight, sessions)
                if r.phase == "ready":
                    total += sessions if unit == "sessions" else in_flight
            self.policy.record(app, total, now)

    def _decide(self, app: str) -> None:
        """Ask the policy about ``app`` and carry the decision out (synchronously: tasks do the I/O)."""
        now = trio.current_time()
        decision = self.policy.decide(app, now)
        for name in decision.drain:
            self._stop(self._replicas[name], now)
            log.info("%s: draining %s (%s)", app, name, decision.reason)
        state = self._apps[app]
        if decision.start and now < state.hold_until:
            return  # a start failed lately: the next round tries again
        for _ in range(decision.start):
            name = f"{app}-{state.serial}"
            state.serial += 1
            address = (state.template.host, _free_port(state.template.host))
            replica = self._replicas[name] = _Replica(app, name, address)
            self.policy.starting(app, name, now)
            state.starts += 1
            log.info("%s: starting %s on %s (%s)", app, name, format_address(address), decision.reason)
            self._nursery.start_soon(self._run, replica)

    def _stop(self, replica: _Replica, now: float) -> None:
        self.policy.draining(replica.app, replica.name, now)
        was, replica.phase = replica.phase, "draining"
        replica.stop.set()
        if was == "starting":
            replica.start_scope.cancel()
        self._ready_changed(replica.app)

    def wake(self) -> None:
        self._wake.set()

    async def _decide_forever(self) -> None:
        while True:
            with trio.move_on_after(self.config.interval):
                await self._wake.wait()
            self._wake = trio.Event()
            self._feed(trio.current_time())
            for app in self._apps:
                self._decide(app)

    # -- one replica -------------------------------------------------------------------------

    async def _run(self, replica: _Replica) -> None:
        """Own ``replica``'s process from start to exit; its record is in the store only while it is ready."""
        app, name = replica.app, replica.name
        state = self._apps[app]
        template = state.template
        entered = False
        try:
            argv = template.argv(app=app, name=name, port=replica.address[1])
            try:
                replica.process = await trio.lowlevel.open_process(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
                )
            except OSError as exc:
                self._failed_start(state, f"{name}: cannot run {argv[0]!r}: {exc.strerror or exc}")
                return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._reap, replica, nursery.cancel_scope)
                healthy = False
                with replica.start_scope:
                    healthy = await self._until_healthy(replica)
                if not healthy:
                    if not replica.stop.is_set():
                        self._failed_start(
                            state,
                            f"{name}: no answer to GET {template.health_path} within {self.config.start_timeout:g}s",
                        )
                    nursery.cancel_scope.cancel()
                    return
                await self._write(replica, "live")
                entered = True
                replica.phase = "ready"
                self.policy.ready(app, name, trio.current_time())
                state.failures = 0
                self._ready_changed(app)
                log.info("%s: %s ready", app, name)
                await replica.stop.wait()
                await self._write(replica, "draining")
                await self._until_drained(replica)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                died = replica.process is not None and replica.process.returncode is not None
                await self._stop_process(replica)
                if entered:
                    with trio.move_on_after(5):
                        await self._delete(replica)
                del self._replicas[name]
                self._sessions.pop(name, None)
                self.estimator.forget(name)
                self.policy.gone(app, name, trio.current_time())
                self._ready_changed(app)
                if died and not replica.stop.is_set():
                    code = replica.process.returncode if replica.process is not None else None
                    if entered:
                        state.restarts += 1
                        log.warning("%s: %s exited with %s; replacing it", app, name, code)
                    else:
                        self._failed_start(state, f"{name}: exited with {code} before it was ready")
                self.wake()

    def _ready_changed(self, app: str) -> None:
        """Keep the app's ready event set exactly while one of its replicas is ready."""
        state = self._apps[app]
        if any(r.app == app and r.phase == "ready" for r in self._replicas.values()):
            state.ready.set()
        elif state.ready.is_set():
            state.ready = trio.Event()

    def _failed_start(self, state: _AppState, why: str) -> None:
        state.failed_starts += 1
        state.failures += 1
        backoff = min(0.1 * 2 ** (state.failures - 1), _MAX_BACKOFF)
        state.hold_until = trio.current_time() + backoff
        log.warning("replica failed to start: %s; next start in %.1fs", why, backoff)

    async def _reap(self, replica: _Replica, scope: trio.CancelScope) -> None:
        """Wait for the process to exit; an exit nobody asked for ends the replica's task."""
        assert replica.process is not None
        await replica.process.wait()
        scope.cancel()

    async def _until_healthy(self, replica: _Replica) -> bool:
        """Ask ``GET health_path`` every ``health_interval`` until a status under 500; False at the timeout."""
        template = self._apps[replica.app].template
        host, port = replica.address
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        request_path = template.health_path.encode()
        with trio.move_on_after(self.config.start_timeout):
            while True:
                with trio.move_on_after(max(self.config.health_interval, 1.0)):
                    try:
                        request = Request(b"GET", b"http", authority.encode(), request_path)
                        response = await self._upstreams.request(
                            replica.address, request, [], protocol=template.protocol
                        )
                        await response.body.aclose()
                        if response.status < 500:
                            return True
                    except Exception as exc:  # not up yet: refused, reset (Cancelled is not an Exception)
                        log.debug("%s: health: %s", replica.name, exc)
                await trio.sleep(self.config.health_interval)
        return False

    async def _until_drained(self, replica: _Replica) -> None:
        """Wait until a poll sent ``settle`` after the draining write sees nothing in flight (or the timeout)."""
        written = trio.current_time()
        with trio.move_on_after(self.config.drain_timeout):
            while True:
                await self._round_event()
                if self._round_sent >= written + self.config.settle and self._idle(replica.name):
                    return

    def _idle(self, name: str) -> bool:
        return self.estimator.estimate(name) == 0 and self._sessions.get(name, 0) == 0

    async def _round_event(self) -> None:
        await self._round_done.wait()

    def _prober_round_done(self) -> None:
        done, self._round_done = self._round_done, trio.Event()
        done.set()

    async def _stop_process(self, replica: _Replica) -> None:
        process = replica.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        with trio.move_on_after(self.config.stop_timeout):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()

    # -- the store -----------------------------------------------------------------------------

    def _record(self, replica: _Replica, state: str) -> tuple[str, bytes]:
        template = self._apps[replica.app].template
        value = encode_replica(
            worker=self.worker,
            address=replica.address,
            protocol=template.protocol,
            capacity=template.capacity,
            state=state,
        )
        return route_key_for_replica(replica.app, replica.name), value

    async def _write(self, replica: _Replica, state: str) -> None:
        key, value = self._record(replica, state)
        await _put(self.store, {key: value})

    async def _delete(self, replica: _Replica) -> None:
        await _delete(self.store, [route_key_for_replica(replica.app, replica.name)])


async def _put(store: EmbeddedStore | EtcdSource, records: Mapping[str, bytes]) -> None:
    if isinstance(store, EmbeddedStore):
        store.transact(records)
        await trio.lowlevel.checkpoint()
    else:
        for key, value in records.items():
            await store.put(key, value)


async def _delete(store: EmbeddedStore | EtcdSource, keys: Iterable[str]) -> None:
    if isinstance(store, EmbeddedStore):
        store.transact(deletes=keys)
        await trio.lowlevel.checkpoint()
    else:
        for key in keys:
            await store.delete(key)


async def _rounds(prober: Prober, scaler: Autoscaler) -> None:
    """After each prober round: wake the decision loop and whoever waits for a round (a drain)."""
    while True:
        await prober.wait_round()
        scaler._prober_round_done()
        scaler.wake()


def _domain_records(templates: Mapping[str, ReplicaTemplate]) -> dict[str, bytes]:
    return {
        route_key_for_domain(domain): encode_domain(app)
        for app, template in templates.items()
        for domain in template.domains
    }


@asynccontextmanager
async def open_autoscaler(
    policy: AutoscalePolicy,
    templates: Mapping[str, ReplicaTemplate],
    store: EmbeddedStore | EtcdSource,
    *,
    worker: Address,
    config: DriverConfig | None = None,
    prober: ProberConfig | None = None,
) -> AsyncIterator[Autoscaler]:
    """An :class:`Autoscaler` running the replicas of ``policy``'s apps for the ``async with`` block.

    ``templates`` says how to start each app's replicas (every app of the
    policy needs one); ``store`` is where their records go (the embedded
    store, or etcd for a fleet of proxies); ``worker`` is the worker in
    front of them, which every record names and the prober polls
    (``prober``: its interval and timeouts; by default one round per
    ``config.interval``). The apps' domain records are written on entry.
    Apps at ``min_replicas=0`` start with no replica. Leaving the block
    stops every replica process and deletes every record it wrote.
    """
    missing = set(policy.apps) - set(templates)
    if missing:
        raise ValueError(f"no replica template for app {sorted(missing)[0]!r}")
    config = config or DriverConfig()
    prober = prober or ProberConfig(interval=config.interval, timeout=min(0.5, config.interval))
    templates = {app: templates[app] for app in policy.apps}
    domains = _domain_records(templates)
    with one_error():
        async with (
            open_upstreams() as upstreams,
            open_single_flight(join_timeout=math.inf, load_timeout=config.cold_start_timeout) as flights,
            trio.open_nursery() as nursery,
        ):
            scaler = Autoscaler(policy, templates, store, worker, config, upstreams, nursery)
            scaler._flights = flights

            def on_report(report: LoadReport, taken_at: float) -> None:
                scaler._on_report(report, taken_at)

            try:
                if domains:
                    await _put(store, domains)
                async with open_prober(
                    upstreams, lambda: [worker], scaler.estimator, prober, on_report=on_report
                ) as running:
                    nursery.start_soon(_rounds, running, scaler)
                    nursery.start_soon(scaler._decide_forever)
                    scaler._feed(trio.current_time())
                    for app in scaler.apps:
                        scaler._decide(app)
                    yield scaler
            finally:
                scaler._flights = None
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    if domains:
                        await _delete(store, domains)


async def serve_autoscaler(
    policy: AutoscalePolicy,
    templates: Mapping[str, ReplicaTemplate],
    store: EmbeddedStore | EtcdSource,
    *,
    worker: Address,
    config: DriverConfig | None = None,
    prober: ProberConfig | None = None,
    task_status: trio.TaskStatus[Autoscaler] = trio.TASK_STATUS_IGNORED,
) -> None:
    """:func:`open_autoscaler` until cancelled, for ``nursery.start`` or ``Chain.start``: reports the Autoscaler."""
    async with open_autoscaler(policy, templates, store, worker=worker, config=config, prober=prober) as scaler:
        task_status.started(scaler)
        await trio.sleep_forever()
