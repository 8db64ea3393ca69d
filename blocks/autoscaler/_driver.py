"""The autoscaler's trio driver: real replica processes, started and drained as the policy says.

The decisions are sans-IO, in :mod:`blocks.autoscaler._core`; this module
puts them on trio's clock, on processes and on the route store.
:func:`open_autoscaler` runs, in a nursery of its own (the service's
lifetime, never a request's):

- a prober (:func:`~blocks.prober.open_prober`) polling the worker in front
  of the replicas, whose in-flight figures (or session counts, for an app
  with ``unit="sessions"``) feed the policy each round;
- the decision loop: once a round, or at once when something changes (a
  cold start, a replica that died or came up), it asks the policy and
  carries out the decision; each round it also retries the store deletes
  that failed;
- the demand reader: once a round, what waits at the proxies of other
  processes (requests held for a cold start, session starts in a session
  queue), as they publish it in the store (:mod:`blocks.sources.demand`):
  an app at zero with something waiting starts a replica, and a sessioned
  app counts its waiting starts as sessions;
- one task per replica (:mod:`._replica`), which owns its process
  (:mod:`._process`) and its record (:mod:`._store`) from start to exit.

What holds, however the driver ends:

- a replica's record is written only once its process has answered a
  health request, and deleted before its process is signalled;
- every process the driver started (each replica's process group) is
  stopped when :func:`open_autoscaler` returns, or, if the driver is
  SIGKILLed, killed by the kernel (Linux: each replica's leader process;
  see :mod:`._process` for a wrapper's children);
- every record it wrote is deleted when :func:`open_autoscaler` returns,
  but for those whose delete the store refused (it did not answer within
  5 s, tried again every round and once more on the way out):
  ``statistics().pending_deletes`` counts them, a warning names each, and
  the next driver of the app deletes them on entry (:mod:`._store`'s
  ownership rule). A driver that was SIGKILLed leaves its records until
  then too.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import attrs
import trio

from blocks._sync import one_error
from blocks.autoscaler._config import AppDriverStatistics, DriverConfig, DriverStatistics, ReplicaTemplate
from blocks.autoscaler._core import AutoscalePolicy
from blocks.autoscaler._process import Spawner
from blocks.autoscaler._replica import AppState, Replica, run_replica
from blocks.autoscaler._store import STORE_TIMEOUT, PendingDeletes, Store, delete, owned_keys, put
from blocks.errors import BlocksError, ColdStartFailed, NoRoute, SourceError
from blocks.hops import ColdStartConfig, ReplicaWait
from blocks.prober import LoadEstimator, LoadReport, Prober, ProberConfig, open_prober
from blocks.routing import (
    Address,
    Demand,
    RouteCache,
    encode_domain,
    format_address,
    route_key_for_domain,
    route_key_for_replica,
)
from blocks.sources.demand import read_demand
from blocks.transport.multiplexer import Upstreams, open_upstreams

log = logging.getLogger("blocks.autoscaler")

_MAX_BACKOFF = 10.0  # seconds between failed starts of one app, at most


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


@attrs.define(eq=False)
class Autoscaler:
    """Runs the replica processes of the apps an :class:`AutoscalePolicy` scales. Use :func:`open_autoscaler`.

    ``policy``, ``templates`` (app -> :class:`ReplicaTemplate`, one per app
    it runs), ``store``, ``worker``, ``config`` and ``estimator`` (its
    prober's :class:`~blocks.prober.LoadEstimator`) are what it was opened with.
    """

    policy: AutoscalePolicy
    templates: Mapping[str, ReplicaTemplate]
    store: Store
    worker: Address
    config: DriverConfig
    _upstreams: Upstreams
    estimator: LoadEstimator = attrs.field(factory=LoadEstimator)
    _apps: dict[str, AppState] = attrs.field(init=False)
    _spawner: Spawner = attrs.field(init=False, factory=Spawner)
    _replicas: dict[str, Replica] = attrs.field(init=False, factory=dict)
    _sessions: dict[str, int] = attrs.field(init=False, factory=dict)
    _waits: dict[RouteCache, ReplicaWait] = attrs.field(init=False, factory=dict)  # the gates' waiters, per cache
    _remote: dict[str, Demand] = attrs.field(init=False, factory=dict)  # what the proxies publish, per app
    _pending: PendingDeletes = attrs.field(init=False, factory=PendingDeletes)
    _nursery: trio.Nursery | None = attrs.field(init=False, default=None)
    _wake: trio.Event = attrs.field(init=False, factory=trio.Event)
    _round_done: trio.Event = attrs.field(init=False, factory=trio.Event)
    _round_sent: float = attrs.field(init=False, default=-math.inf)  # when the poll behind the last round was sent
    _open: bool = attrs.field(init=False, default=False)
    _by_sessions: frozenset[str] = attrs.field(init=False)  # the apps with unit="sessions"
    _warned: bool = attrs.field(init=False, default=False)  # that their worker keeps no sessions

    def __attrs_post_init__(self) -> None:
        self._apps = {app: AppState(template) for app, template in self.templates.items()}
        self._by_sessions = frozenset(app for app in self.templates if self.policy.config(app).unit == "sessions")

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

    def waiter(self, routes: RouteCache) -> ReplicaWait:
        """The requests waiting for a cold start of one of its apps in ``routes`` (a proxy's cache): one per cache.

        Bounded by ``config.cold_start_timeout`` and ``config.max_waiting``;
        an app's first waiter asks for a start (:meth:`demand`), and a failed
        start (or a driver that stops) answers every waiter at once.
        """
        wait = self._waits.get(routes)
        if wait is None:
            config = ColdStartConfig(timeout=self.config.cold_start_timeout, max_waiting=self.config.max_waiting)
            wait = self._waits[routes] = ReplicaWait(routes, config, start=self._start_cold, check=self._refuse)
        return wait

    async def wait_routed(self, app: str, routes: RouteCache) -> None:
        """Return once ``routes`` offers ``app`` a live replica, starting one if none is; a cold start.

        Waits on memory only: ``routes`` (the proxy's cache) tells its
        listeners when the app's replicas change, and the start runs in the
        driver's nursery: a caller that gives up never cancels it. One start
        serves every caller (the policy starts one replica for all). Each a 503:

        - :class:`~blocks.errors.ColdStartTimeout` after ``config.cold_start_timeout``;
        - :class:`~blocks.errors.ColdStartFull` at once with ``config.max_waiting``
          requests for the app waiting already;
        - :class:`~blocks.errors.ColdStartFailed` at once while the app's starts
          are backed off after a failure, and to every waiter when a start fails
          (or asking for the start raised: logged once).

        ``KeyError`` for an app it does not scale.
        """
        if app not in self._apps:
            raise KeyError(app)
        await self.waiter(routes).wait(app)

    def _start_cold(self, app: str) -> None:
        """An app's first waiter: ask for a start now; a bug in that is logged once and a 503 for the waiter."""
        try:
            self.demand(app)
        except BlocksError:
            raise
        except Exception as exc:
            log.exception("%s: the cold start failed", app)
            raise ColdStartFailed(f"{app}: the cold start failed: {exc!r}", app=app) from exc

    def _refuse(self, app: str) -> None:
        """Before a request waits, and when its waiters are woken: a 503 if no start is coming."""
        if not self._open:
            raise NoRoute(f"{app}: the autoscaler stopped", error_reason="no_replica")
        self._refuse_if_backed_off(app)

    def _refuse_if_backed_off(self, app: str) -> None:
        """``ColdStartFailed`` while ``app``'s starts are backed off and none of its replicas runs."""
        state = self._apps[app]
        wait = state.hold_until - trio.current_time()
        if wait > 0 and all(self._replicas[name].phase == "draining" for name in state.replicas):
            raise ColdStartFailed(
                f"{app}: its last start failed; the next one in {wait:.1f}s", app=app, retry_after=wait
            )

    def drain(self, name: str) -> None:
        """Drain replica ``name`` now, whatever the policy says (an operator's move off a host, say).

        It leaves the routes and stops once idle or at ``drain_timeout``, as
        for the policy's own drains; if the app's count needs it, the policy
        starts a replacement at once. ``KeyError`` for a name not running;
        a replica already draining (or stopping) is left as it is.
        """
        replica = self._replicas[name]
        if replica.phase == "draining":
            return
        self._stop(replica, trio.current_time())
        log.info("%s: draining %s (asked)", replica.app, name)
        self._decide(replica.app)

    # -- statistics ----------------------------------------------------------------------------

    def statistics(self) -> DriverStatistics:
        now = trio.current_time()
        policy = self.policy.statistics(now).apps
        apps = {}
        for app, state in self._apps.items():
            phases = [self._replicas[name].phase for name in state.replicas]
            remote = self._remote.get(app, Demand())
            apps[app] = AppDriverStatistics(
                wanted=policy[app].wanted,
                starting=phases.count("starting"),
                ready=phases.count("ready"),
                draining=phases.count("draining"),
                in_flight=policy[app].in_flight,
                sessions=policy[app].sessions,
                waiting=self._waiting(app) + remote.requests,
                queued=remote.sessions,
                starts=state.starts,
                failed_starts=state.failed_starts,
                restarts=state.restarts,
                backoff=state.backoff,
                next_start=state.hold_until if state.hold_until > now else -math.inf,
            )
        processes = {
            name: r.process.pid
            for name, r in sorted(self._replicas.items())
            if r.process is not None and r.process.returncode is None
        }
        return DriverStatistics(apps, processes, len(self._pending))

    # -- the decision loop -------------------------------------------------------------------

    def _on_report(self, report: LoadReport, taken_at: float) -> None:
        # The one worker's word on every replica it keeps sessions for (those it reached by
        # their route included): a replica it no longer lists hosts none.
        self._sessions = {name: load.sessions for name, load in report.replicas.items() if load.sessions}
        if not self._warned and self._by_sessions and any(load.sessions is None for load in report.replicas.values()):
            self._warned = True
            log.warning(
                "apps %s scale by sessions, but their worker keeps none (serve_worker(sessions=...)): "
                "they scale on requests waiting for a cold start and on idleness only",
                sorted(self._by_sessions),
            )
        self._round_sent = max(self._round_sent, taken_at)

    def _waiting(self, app: str) -> int:
        """Requests for ``app`` waiting for a cold start at the gates in this process."""
        return sum(wait.waiting(app) for wait in self._waits.values())

    def _feed(self, now: float) -> None:
        """The prober's figures into the policy: per replica, and per app (requests, or sessions: its unit),
        with what waits for the app here and at the proxies that publish it (a sessioned app's waiting
        starts count as sessions)."""
        for app, state in self._apps.items():
            remote = self._remote.get(app, Demand())
            self.policy.waiting(app, self._waiting(app) + remote.total, now)
            requests = sessions = 0
            for name in state.replicas:
                phase = self._replicas[name].phase
                if phase == "starting":
                    continue
                in_flight = self.estimator.estimate(name)
                hosted = self._sessions.get(name, 0)
                self.policy.load(app, name, in_flight, hosted)
                if phase == "ready":
                    requests += in_flight
                    sessions += hosted
            if app in self._by_sessions:
                if requests:
                    self.policy.touch(app, now)  # requests in flight: not idle, whatever the sessions
                self.policy.record(app, sessions + remote.sessions, now)
            else:
                self.policy.record(app, requests, now)

    def _decide(self, app: str) -> None:
        """Ask the policy about ``app`` and carry the decision out (synchronously: tasks do the I/O)."""
        now = trio.current_time()
        decision = self.policy.decide(app, now)
        for name in decision.drain:
            self._stop(self._replicas[name], now)
            log.info("%s: draining %s (%s)", app, name, decision.reason)
        state = self._apps[app]
        if not decision.start or now < state.hold_until or self._nursery is None:
            return  # (a start failed lately: the next round tries again)
        template = state.template
        serial = 0
        for _ in range(decision.start):
            while (name := f"{app}-{serial}") in self._replicas or route_key_for_replica(app, name) in self._pending:
                serial += 1  # the lowest free one: names (and the state kept per name) do not grow without end
            try:
                address = (template.host, _free_port(template.host))
            except OSError as exc:
                self._failed_start(app, f"{name}: no free port on {template.host}: {exc.strerror or exc}")
                return
            replica = self._replicas[name] = Replica(app, name, address)
            state.replicas.add(name)
            self.policy.starting(app, name, now)
            state.starts += 1
            log.info("%s: starting %s on %s (%s)", app, name, format_address(address), decision.reason)
            self._nursery.start_soon(run_replica, self, replica)

    def _stop(self, replica: Replica, now: float) -> None:
        self.policy.draining(replica.app, replica.name, now)
        was, replica.phase = replica.phase, "draining"
        replica.stop.set()
        if was == "starting":
            replica.start_scope.cancel()

    def _wake_soon(self) -> None:
        self._wake.set()

    async def _decide_forever(self) -> None:
        while True:
            with trio.move_on_after(self.config.interval):
                await self._wake.wait()
            self._wake = trio.Event()
            self._feed(trio.current_time())
            for app in self._apps:
                self._decide(app)

    async def _delete_pending_forever(self) -> None:
        while True:
            await trio.sleep(self.config.interval)
            if self._pending:
                await self._pending.retry(self.store)
                self._wake_soon()  # a name may be free again

    async def _read_demand_forever(self) -> None:
        """Each round: what the proxies publish waits for its apps; the decision loop hears a change at once."""
        down = False
        while True:
            try:
                with trio.fail_after(STORE_TIMEOUT):
                    found = await read_demand(self.store)
            except (SourceError, trio.TooSlowError) as exc:
                if not down:
                    log.warning("cannot read the proxies' demand from the route store (%s); retrying", exc)
                    down = True
            else:
                down = False
                found = {app: demand for app, demand in found.items() if app in self._apps}
                if found != self._remote:
                    self._remote = found
                    self._wake_soon()
            await trio.sleep(self.config.interval)

    async def _rounds_forever(self, prober: Prober) -> None:
        """After each prober round: wake the decision loop and whoever waits for a round (a drain)."""
        while True:
            await prober.wait_round()
            done, self._round_done = self._round_done, trio.Event()
            done.set()
            self._wake_soon()

    async def _wait_round(self) -> None:
        await self._round_done.wait()

    def _idle(self, name: str) -> bool:
        return self.estimator.estimate(name) == 0 and self._sessions.get(name, 0) == 0

    # -- what the replica tasks report (synchronous: the policy hears each change at once) -------

    def _ready(self, replica: Replica) -> None:
        replica.phase = "ready"
        self.policy.ready(replica.app, replica.name, trio.current_time())
        state = self._apps[replica.app]
        state.failures, state.backoff, state.hold_until = 0, 0.0, -math.inf
        log.info("%s: %s ready", replica.app, replica.name)

    def _ended(self, replica: Replica, *, died: bool) -> None:
        """The replica's task is ending: it is out of the policy's fleet before anything is awaited."""
        app, name = replica.app, replica.name
        was, replica.phase = replica.phase, "draining"
        self.policy.gone(app, name, trio.current_time())
        self._sessions.pop(name, None)
        self.estimator.forget(name)
        if died and not replica.stop.is_set():
            code = replica.process.returncode if replica.process is not None else None
            if was == "ready":
                self._apps[app].restarts += 1
                log.warning("%s: %s exited with %s; replacing it", app, name, code)
            else:
                self._failed_start(app, f"{name}: exited with {code} before it was ready", replica)
        self._wake_soon()

    def _released(self, replica: Replica) -> None:
        """Its process is gone and its record deleted (or pending): the name is free unless pending."""
        del self._replicas[replica.name]
        self._apps[replica.app].replicas.discard(replica.name)
        self._wake_soon()

    def _failed_start(self, app: str, why: str, replica: Replica | None = None) -> None:
        if replica is not None:
            replica.phase = "draining"  # on its way out: no cold start waits for it
        state = self._apps[app]
        state.failed_starts += 1
        state.failures += 1
        state.backoff = min(0.1 * 2 ** (state.failures - 1), _MAX_BACKOFF)
        state.hold_until = trio.current_time() + state.backoff
        log.warning("replica failed to start: %s; next start in %.1fs", why, state.backoff)
        for wait in self._waits.values():  # the requests waiting on it fail now, not at their timeout
            wait.wake(app)

    # -- the driver's life -------------------------------------------------------------------------

    async def _serve(self, prober: ProberConfig, *, task_status: trio.TaskStatus[None]) -> None:
        """Clean up, write the domains, run the loops and the replicas; on the way out, clean up again."""
        domains = {
            route_key_for_domain(domain): encode_domain(app)
            for app, template in self.templates.items()
            for domain in template.domains
        }
        try:
            with one_error(), self._spawner:  # (the spawning thread outlives every replica task)
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    stale = await owned_keys(self.store, self.apps)
                    if stale:
                        log.warning("deleting %d replica records a driver left behind: %s", len(stale), stale)
                        await delete(self.store, stale)
                    if domains:
                        await put(self.store, domains)
                    async with open_prober(
                        self._upstreams, lambda: [self.worker], self.estimator, prober, on_report=self._on_report
                    ) as running:
                        nursery.start_soon(self._rounds_forever, running)
                        nursery.start_soon(self._decide_forever)
                        nursery.start_soon(self._delete_pending_forever)
                        nursery.start_soon(self._read_demand_forever)
                        self._open = True
                        self._feed(trio.current_time())
                        for app in self.apps:
                            self._decide(app)
                        task_status.started()
                        await trio.sleep_forever()
        finally:
            self._open = False
            self._nursery = None
            for wait in self._waits.values():  # every waiter hears it: no start is coming
                wait.wake_all()
            with trio.CancelScope(shield=True):  # every replica task has ended: their deletes are done or pending
                if self._pending:
                    await self._pending.retry(self.store)
                for key in sorted(self._pending.keys):
                    log.warning("route store: %s could not be deleted; the next driver of its app deletes it", key)
                if domains:
                    try:
                        await delete(self.store, domains)
                    except SourceError as exc:
                        log.warning("route store: the domain records could not be deleted: %s", exc)


@asynccontextmanager
async def open_autoscaler(
    policy: AutoscalePolicy,
    templates: Mapping[str, ReplicaTemplate],
    store: Store,
    *,
    worker: Address,
    config: DriverConfig | None = None,
    prober: ProberConfig | None = None,
) -> AsyncIterator[Autoscaler]:
    """An :class:`Autoscaler` running the replicas of ``policy``'s apps for the ``async with`` block.

    ``templates`` says how to start each app's replicas (every app of the
    policy needs one; with a policy that has a default config, every app
    of ``templates`` is scaled, the others with the default); ``store`` is
    where their records go (the embedded store, or etcd for a fleet of
    proxies); ``worker`` is the worker in front of them, which every record
    names and the prober polls (``prober``: its interval and timeouts; by
    default one round per ``config.interval``). On entry, the replica
    records of its apps that a driver left behind (``<app>-<n>``) are
    deleted and the apps' domain records written. Apps at
    ``min_replicas=0`` start with no replica. Leaving the block stops every
    replica process and deletes every record it wrote (see the module's
    guarantees for a store that does not answer).

    An app with ``unit="sessions"`` scales by the sessions its ready
    replicas host, as the worker reports them: give the worker
    ``sessions=WorkerSessionConfig(...)`` and the proxy ``sessions=``
    (the worker keeps the sessions of the replicas it reaches by their
    route, :meth:`blocks.Worker.take_on`).
    """
    apps = list(policy.apps)
    if policy.default is not None:
        apps += [app for app in templates if app not in apps]
    missing = [app for app in apps if app not in templates]
    if missing:
        raise ValueError(f"no replica template for app {missing[0]!r}")
    config = config or DriverConfig()
    prober = prober or ProberConfig(interval=config.interval, timeout=min(0.5, config.interval))
    # (one_error at both ends: open_upstreams adds a group of its own around what crosses it)
    with one_error():
        async with open_upstreams() as upstreams:
            scaled = {app: templates[app] for app in apps}
            scaler = Autoscaler(policy, scaled, store, worker, config, upstreams=upstreams)
            with one_error():
                async with trio.open_nursery() as nursery:
                    await nursery.start(scaler._serve, prober)
                    try:
                        yield scaler
                    finally:
                        nursery.cancel_scope.cancel()


async def serve_autoscaler(
    policy: AutoscalePolicy,
    templates: Mapping[str, ReplicaTemplate],
    store: Store,
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
