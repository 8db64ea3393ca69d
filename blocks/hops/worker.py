"""The worker: relays each stream to the local replica the proxy named, counting in flight."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping, Sequence

import attrs
import trio

from blocks.errors import NoRoute, UpstreamConnectError, parse_error_field
from blocks.fields import (
    ENDED_HEADER,
    ERROR_HEADER,
    LOAD_PATH,
    PROBE_HEADER,
    REPLICA_HEADER,
    SESSION_HEADER,
    SESSION_LIMIT_HEADER,
    SESSIONS_PATH,
    TARGET_HEADER,
)
from blocks.hops._hop import INTERNAL_LISTENER, Exchange, Feature, Forward, Hop, hop_listener
from blocks.hops._websockets import WebSockets
from blocks.hops.proxy import InFlight
from blocks.http import Headers, Request, Response, json_response, text_response
from blocks.prober import ReplicaLoad, load_response
from blocks.routing import parse_address
from blocks.sessions import SessionLost, SessionTracker, WorkerSessionConfig, session_control_response
from blocks.transport import Address
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams

log = logging.getLogger("blocks.hops")


@attrs.frozen
class LocalReplica:
    """A replica as its worker reaches it.

    ``capacity``: how many requests it takes at once, as the worker's load
    endpoint reports it (0, the default: unknown). ``max_sessions``: how
    many sessions it hosts at once, when its worker keeps sessions (0: no
    limit but the worker's own ``max_sessions``). ``protocol``: ``"h2"``
    (cleartext, prior knowledge), ``"h1"``, or ``"https"`` (TLS, ALPN ``h2``
    else ``http/1.1``; the certificate must name ``address``'s host).
    """

    address: Address
    protocol: str = attrs.field(default="h2", validator=attrs.validators.in_(("h2", "h1", "https")))
    capacity: int = attrs.field(default=0, kw_only=True, validator=attrs.validators.ge(0))
    max_sessions: int = attrs.field(default=0, kw_only=True, validator=attrs.validators.ge(0))


@attrs.frozen
class WorkerStatistics:
    in_flight: dict[str, int]
    served: dict[str, int]


class Probes(Feature):
    """screen: the proxy's control requests (with ``x-proxyblocks-probe``) are answered by the worker.

    ``GET /.proxyblocks/load``: the replicas' load, for the prober; ``POST``
    / ``DELETE /.proxyblocks/sessions``: open or end a session, when the
    worker keeps sessions; ``DELETE /.proxyblocks/sessions`` naming a
    replica and no session: the autoscaler ends that replica's sessions and
    WebSockets (:meth:`Worker.drain_replica`). Without the field, a request
    for those paths reaches its app like any other. Other requests pay two
    path comparisons.
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def screen(self, exchange: Exchange) -> None:
        request = exchange.request
        path = request.path
        # (two compares beat building a tuple per request)
        if (path == LOAD_PATH or path == SESSIONS_PATH) and request.header(PROBE_HEADER) is not None:  # noqa: SIM109
            exchange.answer = self._load if path == LOAD_PATH else self._session

    async def _load(self, exchange: Exchange) -> Response:
        return self.worker.load_response()

    async def _session(self, exchange: Exchange) -> Response:
        worker = self.worker
        request = exchange.request
        if request.method == b"DELETE" and request.header(SESSION_HEADER) is None:
            return await worker.drain_replica(request)
        reachable = True
        if worker.sessions is not None:
            worker.take_on(request)
            if request.method == b"POST":  # (a start, never a request of a session: the network is fine)
                target = worker.target(request)
                reachable = target is not None and await _reachable(worker.upstreams, target.address)
        return session_control_response(worker.sessions, request, exchange.hop.clock(), reachable=reachable)


class LocalRoute(Feature):
    """route: the replica ``x-proxyblocks-replica`` names (read by name, and removed).

    A replica this worker is configured with is reached as configured.
    Another is reached where the proxy's ``x-proxyblocks-target`` says (its
    route entry's address and protocol), so a route file or an etcd entry
    naming any server works. A name with neither is a
    :class:`~blocks.errors.NoRoute` (503); without the field, a worker with
    exactly one replica uses it (so it can be called directly).
    ``x-proxyblocks-session``, when the proxy sent one, becomes
    ``exchange.session`` and goes on to the replica.
    """

    def __init__(self, replicas: Mapping[str, LocalReplica], name: str) -> None:
        self.replicas = {key.encode(): value for key, value in replicas.items()}
        self._targets: dict[bytes, LocalReplica] = {}  # parsed x-proxyblocks-target values, bounded
        self._via = (b"via", b"2 " + name.encode())

    def route(self, exchange: Exchange) -> Forward:
        headers = exchange.request.headers
        fields = dict(headers)  # by name; the proxy writes each of its fields once
        key = fields.get(REPLICA_HEADER)
        wire = fields.get(TARGET_HEADER)
        if key is None and wire is None:
            headers = headers.copy()
        elif len(headers) > 1 and headers[-1][0] == REPLICA_HEADER and headers[-2][0] == TARGET_HEADER:
            headers = headers[:-2]  # where the proxy puts them: drop them without a scan
        else:
            headers = [field for field in headers if field[0] != REPLICA_HEADER and field[0] != TARGET_HEADER]
        name = key or b""
        target = self.replicas.get(name)
        if target is None:
            if wire is not None and key:
                target = self.target(wire)
            elif key or len(self.replicas) != 1:
                raise NoRoute(f"replica {key!r} is not on this worker")
            else:
                name, target = next(iter(self.replicas.items()))
        headers.append(self._via)
        exchange.replica = name.decode()
        session = fields.get(SESSION_HEADER)
        if session is not None:
            exchange.session = session.decode("ascii", "replace")
        return Forward(target.address, headers, protocol=target.protocol)

    def target(self, wire: bytes) -> LocalReplica:
        """The replica a proxy's ``x-proxyblocks-target`` value names (parsed once, kept bounded); a value
        naming nothing reachable is a :class:`~blocks.errors.NoRoute`."""
        target = self._targets.get(wire)
        if target is None:
            protocol, _, address = wire.decode("latin-1").partition(" ")
            try:
                target = LocalReplica(parse_address(address), protocol)
            except ValueError as exc:
                raise NoRoute(f"the proxy named an unusable replica target {wire!r}") from exc
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()  # a fleet's replicas come back at once; a flood of names cannot grow it
            self._targets[wire] = target
        return target


_MAX_TARGETS = 4096


class SessionCount(Feature):
    """dispatched: a session's request counts in its session (a 410 if this worker does not host it there).

    response: a session's request whose replica this worker could not reach
    (its own ``replica_unreachable``) is answered ``503 session_lost``
    (``proxyblocks-session-ended: replica-unreachable``) instead, never sent
    elsewhere: the replica is gone with the session's state, so every
    session it hosted ends (counted ``ended["lost"]``), and their next
    requests get a 410 ``not-hosted``. One answer says the loss per session.
    """

    def __init__(self, tracker: SessionTracker) -> None:
        self.tracker = tracker

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        if exchange.session is None or status < 500 or exchange.answer_status is not None:
            return
        for i, (name, value) in enumerate(headers):
            if name == ERROR_HEADER:
                reason, at = parse_error_field(value)
                hop = exchange.hop
                if reason == b"replica_unreachable" and (not at or at == hop.name.encode()):
                    replica = exchange.replica or ""
                    ended = self.tracker.end_replica(replica, "lost")
                    log.warning("replica %s unreachable: its %d sessions are lost", replica, len(ended))
                    headers[i] = hop.error_field("session_lost", exchange)
                    headers.append((ENDED_HEADER, b"replica-unreachable"))
                    exchange.answer_status = 503
                return

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        session = exchange.session
        if session is not None:
            replica = exchange.replica or ""
            tracker = self.tracker
            if not tracker.begin(session, replica, exchange.hop.clock()):
                raise SessionLost(
                    f"this worker hosts no session {session!r} on replica {replica!r}",
                    reason=tracker.why(session) or "not-hosted",
                )

    def closed(self, exchange: Exchange) -> None:
        if exchange.session is not None:
            self.tracker.end(exchange.session, exchange.hop.clock())


class Worker(Hop):
    """Relays each stream to the replica the proxy named, counting in-flight per replica.

    Its stack: :class:`Probes` (the proxy's load and session requests), the
    caller's ``features``, :class:`LocalRoute`, :class:`SessionCount` (with
    ``sessions``), :class:`~blocks.hops.proxy.InFlight` (``in_flight`` and
    ``served`` per replica), :class:`~blocks.hops.WebSockets` (the
    WebSockets it relays, ``websockets``: a drain ends them with a Close
    frame).

    With ``sessions`` (a :class:`~blocks.sessions.WorkerSessionConfig`), a
    request the proxy sent for a session (its id in
    ``x-proxyblocks-session``, which the replica sees too) counts in its
    session's in-flight, and gets a 410 if this worker does not host that
    session on that replica (ended idle, terminated, or a worker restart).
    That holds for a replica reached by its route too (one an autoscaler
    started): the proxy's session start names its ``x-proxyblocks-target``,
    and the worker keeps its sessions from then on (:meth:`take_on`).
    """

    upstream_name = "app"
    upstream_kind = "replica"

    def upstream_label(self, exchange: Exchange) -> str:
        """A replica in this worker's error fields: ``NAME (host:port)``."""
        return f"{exchange.replica or '-'} ({super().upstream_label(exchange)})"

    def __init__(
        self,
        replicas: Mapping[str, LocalReplica],
        upstreams: Upstreams,
        *,
        name: str = "worker",
        sessions: WorkerSessionConfig | None = None,
        features: Sequence[Feature] = (),
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.replicas = dict(replicas)
        self.sessions = (
            None
            if sessions is None
            else SessionTracker(
                {key: replica.max_sessions for key, replica in replicas.items()}, sessions, max_added=_MAX_TARGETS
            )
        )
        self.served: dict[str, int] = dict.fromkeys(replicas, 0)
        accounting = InFlight(served=self.served)
        accounting.counts.update(dict.fromkeys(replicas, 0))
        self.in_flight = accounting.counts
        self._route = LocalRoute(replicas, name)
        stack: list[Feature] = [Probes(self), *features, self._route]
        if self.sessions is not None:
            stack.append(SessionCount(self.sessions))
        self.websockets = WebSockets()
        stack += [accounting, self.websockets]
        super().__init__(name, upstreams, stack, clock=clock)

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(dict(self.in_flight), dict(self.served))

    def take_on(self, request: Request) -> None:
        """Keep sessions for the replica a session start or end names, if it is reached by its route.

        The proxy's control request names the replica
        (``x-proxyblocks-replica``) and, for one the worker does not list,
        where it is (``x-proxyblocks-target``, as its requests carry it):
        the tracker takes it on. A replica with no session limit of its own
        here (taken on so, or listed without ``max_sessions``) is held to
        the one the proxy names (``x-proxyblocks-session-limit``, its
        ``max_per_replica``, its latest word: the app's settings may change it),
        whatever proxy starts there next; without one, only the worker's
        ``max_sessions`` bounds it. A target the worker could not
        reach is a :class:`~blocks.errors.NoRoute` (503), as its requests
        would be. Without a target, nothing is taken on: the answer is a 404.
        """
        tracker = self.sessions
        key = request.header(REPLICA_HEADER)
        wire = request.header(TARGET_HEADER)
        if tracker is None or not key or wire is None:
            return
        name = key.decode("ascii", "replace")
        limit = request.header(SESSION_LIMIT_HEADER) or b""
        if name not in tracker.capacities:
            self._route.target(wire)
            tracker.add(name)
        if limit.isdigit():
            tracker.hold(name, int(limit))

    async def drain_replica(self, request: Request) -> Response:
        """The answer to the autoscaler's ``DELETE /.proxyblocks/sessions`` naming a replica and no session.

        The replica is going (drained past its ``drain_timeout``): every
        session it hosts ends now (reason ``drained``: their later requests
        get a 410 that says so), and every WebSocket to it, of a session or
        not, is ended with a Close frame (1001, ``session ended: drained``,
        or ``replica drained``), each given :data:`~blocks.hops.END_TIMEOUT`
        to send it before it is reset. Answers ``200 {"ended": sessions,
        "websockets": closed, "cut": reset}`` once they are all over; a
        ``400`` without ``x-proxyblocks-replica``.
        """
        key = request.header(REPLICA_HEADER)
        if not key:
            return json_response(400, b'{"error":"name the replica: x-proxyblocks-replica"}')
        name = key.decode("ascii", "replace")
        ended = self.sessions.drain(name) if self.sessions is not None else []
        closed, cut = await self.websockets.end(name, "replica drained", session_reason="session ended: drained")
        log.info(
            "%s: replica %s drained: %d sessions ended, %d WebSockets closed, %d reset",
            self.name,
            name,
            len(ended),
            closed,
            cut,
        )
        answer = {"ended": len(ended), "websockets": closed, "cut": cut}
        return json_response(200, json.dumps(answer, separators=(",", ":")).encode())

    def load(self) -> dict[str, ReplicaLoad]:
        """Per replica: requests in flight now, its configured capacity, and its sessions when it keeps them.

        Every local replica, and every replica reached where the proxy's
        ``x-proxyblocks-target`` said (one an autoscaler started, say) that
        this worker has relayed a request to, or keeps sessions for (its
        capacities unknown, 0). Past :data:`_MAX_TARGETS` such names, the
        idle ones are forgotten (the tracker's too, those hosting no session).
        """
        loads = {}
        tracker = self.sessions
        in_flight = self.in_flight
        for name, replica in self.replicas.items():
            if tracker is None:
                loads[name] = ReplicaLoad(in_flight[name], replica.capacity)
            else:
                loads[name] = ReplicaLoad(
                    in_flight[name], replica.capacity, tracker.active(name), tracker.capacities[name], tracker.revision
                )
        if len(in_flight) > len(self.replicas):
            others = [name for name in in_flight if name not in self.replicas]
            if len(others) > _MAX_TARGETS:
                for name in others:
                    if in_flight[name] == 0:
                        del in_flight[name]  # (InFlight adds a name back on its next request)
            for name in others:
                count = in_flight.get(name)
                if count is not None:
                    loads[name] = self._routed_load(name, count)
        if tracker is not None and len(tracker.capacities) > len(self.replicas):
            for name in tracker.capacities:
                if name not in loads:
                    loads[name] = self._routed_load(name, 0)
        return loads

    def _routed_load(self, name: str, in_flight: int) -> ReplicaLoad:
        tracker = self.sessions
        if tracker is None:
            return ReplicaLoad(in_flight, 0)
        return ReplicaLoad(in_flight, 0, tracker.active(name), tracker.capacities.get(name, 0), tracker.revision)

    def load_response(self) -> Response:
        """The answer to a load probe: :meth:`load` as JSON, never cached; 503 once the worker drains
        (the prober's poll then tells the health checker, :func:`~blocks.prober.open_health_checker`)."""
        return load_response(self.name, self.load(), status=503 if self.draining else 200)

    def target(self, request: Request) -> LocalReplica | None:
        """Where the replica a control request names is (``x-proxyblocks-replica``; for one reached
        by its route, ``x-proxyblocks-target``), or None if it names none this worker could reach."""
        key = request.header(REPLICA_HEADER)
        if key is None:
            return None
        target = self.replicas.get(key.decode("latin-1"))
        if target is None:
            wire = request.header(TARGET_HEADER)
            if wire is None:
                return None
            target = self._route.target(wire)
        return target

    async def health(self, exchange: Exchange) -> Response:
        """A health check: the hop's own (200, or 503 once draining), or, when it names a replica
        (``x-proxyblocks-replica``, and ``x-proxyblocks-target`` for one reached by its route),
        whether the worker can reach that replica now: a pooled connection to it, else a fresh
        connect within :data:`HEALTH_CONNECT_TIMEOUT` (200, else 502 ``replica_unreachable``)."""
        request = exchange.request
        key = request.header(REPLICA_HEADER)
        if key is None or self.draining:
            return await super().health(exchange)
        target = self.target(request)
        if target is None:
            raise NoRoute(f"replica {key!r} is not on this worker")
        if not await _reachable(self.upstreams, target.address):
            raise UpstreamConnectError(f"cannot reach replica {key.decode('latin-1')!r} at {target.address}")
        return text_response(200, "ok\n")


async def serve_worker(
    replicas: Mapping[str, LocalReplica],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    name: str = "worker",
    sessions: WorkerSessionConfig | None = None,
    features: Sequence[Feature] = (),
    listener: ListenerConfig = INTERNAL_LISTENER,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[tuple[HTTPServer, Worker]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a :class:`Worker` for ``replicas``; ``task_status`` gets ``(server, worker)``.

    With ``sessions``, the worker keeps its replicas' sessions (each
    replica's ``max_sessions``) and ends the idle ones.
    """
    async with open_upstreams(upstream) as upstreams, trio.open_nursery() as nursery:
        worker = Worker(replicas, upstreams, name=name, sessions=sessions, features=features)
        if worker.sessions is not None:
            nursery.start_soon(_expire_sessions, worker.sessions)
        serve = functools.partial(
            serve_http,
            worker.handle,
            host=host,
            port=port,
            config=hop_listener(listener, worker),
            relay=worker.relay,
            upstreams=upstreams,
        )
        server = await nursery.start(serve)
        worker.server = server
        nursery.start_soon(_end_websockets_on_drain, server, worker)
        task_status.started((server, worker))


HEALTH_CONNECT_TIMEOUT = 1.0
"""Seconds a worker's replica health check waits for a fresh connect."""


async def _reachable(upstreams: Upstreams, address: Address) -> bool:
    """A pooled connection to ``address`` is open, or a fresh TCP connect succeeds (closed at once)."""
    if any(pool.address == address and pool.connections for pool in upstreams.statistics()):
        return True
    with trio.move_on_after(HEALTH_CONNECT_TIMEOUT):
        try:
            stream = await trio.open_tcp_stream(*address)
        except OSError:
            return False
        await stream.aclose()
        return True
    return False


async def _end_websockets_on_drain(server: HTTPServer, worker: Worker) -> None:
    """Once the worker drains, end its WebSockets with a Close frame (1001, ``worker draining``).

    A WebSocket does not end by itself within a drain's grace: at its end
    it would be cut (code 1006 at the client). Ended at the drain's start,
    its client can reconnect at once (to another worker, through the proxy).
    A second look once the final GOAWAY went (``drain_goaway_delay``) ends
    those a client opened in the race with the first one.
    """
    await server.wait_draining()
    for delay in (0.0, server.config.drain_goaway_delay):
        await trio.sleep(delay)
        closed, cut = await worker.websockets.end(None, "worker draining")
        if closed or cut:
            log.info("%s draining: %d WebSockets closed, %d reset", worker.name, closed, cut)


async def _expire_sessions(tracker: SessionTracker) -> None:
    """End idle sessions, looking a few times per ``idle_timeout`` (at least once a second)."""
    interval = min(tracker.config.idle_timeout / 4, 1.0)
    while True:
        await trio.sleep(interval)
        for session, replica in tracker.expire(trio.current_time()):
            log.debug("session %s on %s ended: idle", session, replica)


__all__ = [
    "HEALTH_CONNECT_TIMEOUT",
    "LocalReplica",
    "LocalRoute",
    "Probes",
    "SessionCount",
    "Worker",
    "WorkerStatistics",
    "serve_worker",
]
