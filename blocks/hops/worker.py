"""The worker: relays each stream to the local replica the proxy named, counting in flight."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping

import attrs
import trio

from blocks.errors import NoRoute
from blocks.hops._hop import INTERNAL_LISTENER, Forward, Hop
from blocks.http import BytesBody, Headers, Request, Response
from blocks.prober._core import (
    LOAD_PATH,
    PROBE_HEADER,
    REPLICA_HEADER,
    ReplicaLoad,
    encode_load,
)
from blocks.routing import Address
from blocks.sessions import (
    SESSION_HEADER,
    SESSIONS_PATH,
    SessionGone,
    SessionTracker,
    WorkerSessionConfig,
)
from blocks.sessions._broker import json_response
from blocks.transport._h2 import H2Driver, H2Stream
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams

log = logging.getLogger("blocks.hops")


@attrs.frozen
class LocalReplica:
    """A replica as its worker reaches it.

    ``capacity``: how many requests it takes at once, as the worker's load
    endpoint reports it (0, the default: unknown). ``max_sessions``: how
    many sessions it hosts at once, when its worker keeps sessions (0: no
    limit but the worker's own ``max_sessions``).
    """

    address: Address
    protocol: str = attrs.field(default="h2", validator=attrs.validators.in_(("h2", "h1")))
    capacity: int = attrs.field(default=0, kw_only=True, validator=attrs.validators.ge(0))
    max_sessions: int = attrs.field(default=0, kw_only=True, validator=attrs.validators.ge(0))


@attrs.frozen
class WorkerStatistics:
    in_flight: dict[str, int]
    served: dict[str, int]


class Worker(Hop):
    """Relays each stream to the replica the proxy named, counting in-flight per replica.

    It answers the proxy's control requests itself, those carrying
    ``x-proxyblocks-probe`` (:data:`~blocks.prober._core.PROBE_HEADER`):
    ``GET /.proxyblocks/load`` gets :meth:`load` as JSON, for the prober
    (:mod:`blocks.prober`), and with ``sessions`` (a
    :class:`~blocks.sessions.WorkerSessionConfig`), ``POST`` and ``DELETE
    /.proxyblocks/sessions`` open and end sessions. The edge drops
    ``x-proxyblocks-*`` from clients, so a client's request for those paths
    reaches its app like any other. Normal requests pay two path
    comparisons for it.

    With ``sessions``, a request the proxy sent for a session (its id in
    ``x-proxyblocks-session``, which the replica sees too) counts in its
    session's in-flight, and gets a 410 if this worker does not host that
    session on that replica (ended idle, terminated, or a worker restart).
    """

    upstream_name = "app"

    def __init__(
        self,
        replicas: Mapping[str, LocalReplica],
        upstreams: Upstreams,
        *,
        name: str = "worker",
        sessions: WorkerSessionConfig | None = None,
    ) -> None:
        super().__init__(name, upstreams)
        self.sessions = (
            None
            if sessions is None
            else SessionTracker({key: replica.max_sessions for key, replica in replicas.items()}, sessions)
        )
        self.replicas = {key.encode(): value for key, value in replicas.items()}
        self.in_flight: dict[str, int] = dict.fromkeys(replicas, 0)
        self.served: dict[str, int] = dict.fromkeys(replicas, 0)
        self._via = (b"via", b"2 " + name.encode())

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(dict(self.in_flight), dict(self.served))

    def load(self) -> dict[str, ReplicaLoad]:
        """Per local replica: requests in flight now, and its configured capacity."""
        loads = {}
        tracker = self.sessions
        for key, replica in self.replicas.items():
            name = key.decode()
            if tracker is None:
                loads[name] = ReplicaLoad(self.in_flight[name], replica.capacity)
            else:
                loads[name] = ReplicaLoad(
                    self.in_flight[name], replica.capacity, tracker.active(name), replica.max_sessions, tracker.revision
                )
        return loads

    def load_response(self) -> Response:
        """The answer to a load probe: :meth:`load` as JSON, never cached."""
        data = encode_load(self.name, self.load())
        headers: Headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(data)),
            (b"cache-control", b"no-store"),
        ]
        return Response(200, headers, BytesBody(data))

    def session_response(self, request: Request) -> Response:
        """The answer to the proxy's session start (``POST``) or terminate (``DELETE``).

        ``{"active": n, "capacity": c, "revision": r}`` of the replica either way, with
        201 (opened) or 409 (the replica, or the worker, is full) for a
        start, 200 (ended) or 404 (no such session) for a terminate.
        """
        tracker = self.sessions
        session = request.header(SESSION_HEADER)
        replica = (request.header(REPLICA_HEADER) or b"").decode("ascii", "replace")
        if tracker is None or session is None or replica not in tracker.capacities:
            return json_response(404, {"error": "no such replica, or this worker keeps no sessions"})
        name = session.decode("ascii", "replace")
        if request.method == b"POST":
            status = 201 if tracker.open(name, replica, trio.current_time()) else 409
        elif request.method == b"DELETE":
            status = 200 if tracker.terminate(name) is not None else 404
        else:
            return json_response(405, {"error": "POST or DELETE"})
        active = tracker.active(replica)
        capacity = tracker.capacities[replica]
        return json_response(status, {"active": active, "capacity": capacity, "revision": tracker.revision})

    def relay(self, request: Request, down: H2Driver, st: H2Stream, ended: bool) -> bool:
        path = request.path
        if path == LOAD_PATH or path == SESSIONS_PATH:  # noqa: SIM109  (two compares beat building a tuple per request)
            return False  # the handler answers the proxy (or forwards a client's request for this path)
        return super().relay(request, down, st, ended)

    async def handle(self, request: Request) -> Response:
        # A declined fast path left its decision: only an undecided request can be a probe.
        if request.decision is None and request.header(PROBE_HEADER) is not None:
            if request.path == LOAD_PATH:
                return self.load_response()
            if request.path == SESSIONS_PATH:
                return self.session_response(request)
        return await super().handle(request)

    def decide(self, request: Request) -> Forward:
        """The replica the proxy named, and the fields to send it; counts it in flight."""
        headers = request.headers
        if headers and headers[-1][0] == REPLICA_HEADER:  # where the proxy puts it
            key = headers[-1][1]
            headers = headers[:-1]
        else:
            found = [v for n, v in headers if n == REPLICA_HEADER]
            key = found[0] if found else b""
            headers = [(n, v) for n, v in headers if n != REPLICA_HEADER]
        target = self.replicas.get(key)
        if target is None:
            if key or len(self.replicas) != 1:
                raise NoRoute(f"replica {key!r} is not on this worker")
            key, target = next(iter(self.replicas.items()))
        headers.append(self._via)
        name = key.decode()
        tracker = self.sessions
        if tracker is not None and len(headers) > 1 and headers[-2][0] == SESSION_HEADER:  # the proxy puts it there
            session = headers[-2][1].decode("ascii", "replace")
            if not tracker.begin(session, name, trio.current_time()):
                raise SessionGone(f"this worker hosts no session {session!r} on replica {name!r}", reason="not-hosted")
            self.in_flight[name] += 1
            self.served[name] += 1
            return Forward(
                target.address,
                headers,
                protocol=target.protocol,
                on_close=functools.partial(self._session_done, name, session),
            )
        self.in_flight[name] += 1
        self.served[name] += 1
        return Forward(target.address, headers, protocol=target.protocol, on_close=_decrement(self.in_flight, name))

    def _session_done(self, name: str, session: str) -> None:
        self.in_flight[name] -= 1
        if self.sessions is not None:
            self.sessions.end(session, trio.current_time())


async def serve_worker(
    replicas: Mapping[str, LocalReplica],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    name: str = "worker",
    sessions: WorkerSessionConfig | None = None,
    listener: ListenerConfig = INTERNAL_LISTENER,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[tuple[HTTPServer, Worker]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a :class:`Worker` for ``replicas``; ``task_status`` gets ``(server, worker)``.

    With ``sessions``, the worker keeps its replicas' sessions (each
    replica's ``max_sessions``) and ends the idle ones.
    """
    async with open_upstreams(upstream) as upstreams, trio.open_nursery() as nursery:
        worker = Worker(replicas, upstreams, name=name, sessions=sessions)
        if worker.sessions is not None:
            nursery.start_soon(_expire_sessions, worker.sessions)
        serve = functools.partial(
            serve_http, worker.handle, host=host, port=port, config=listener, relay=worker.relay, upstreams=upstreams
        )
        server = await nursery.start(serve)
        task_status.started((server, worker))


async def _expire_sessions(tracker: SessionTracker) -> None:
    """End idle sessions, looking a few times per ``idle_timeout`` (at least once a second)."""
    interval = min(tracker.config.idle_timeout / 4, 1.0)
    while True:
        await trio.sleep(interval)
        for session, replica in tracker.expire(trio.current_time()):
            log.debug("session %s on %s ended: idle", session, replica)


def _decrement(counts: dict[str, int], key: str) -> Callable[[], None]:
    def done() -> None:
        counts[key] -= 1

    return done
