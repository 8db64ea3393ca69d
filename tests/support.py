"""Test helpers: a raw HTTP/2 client, curl, and chains assembled with the topology kit.

The raw client exists because no high-level client does what some tests need:
full-duplex streaming (httpx sends the whole request body before it reads),
trailers as events, and request heads that a careful client refuses to send
(``:authority`` and ``host`` disagreeing).
"""

from __future__ import annotations

import collections
import functools
import math
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs

import attrs
import h2.config
import h2.connection
import h2.events
import hpack
import httpx
import hyperframe.frame
import trio
import trio_websocket

from blocks import (
    Chain,
    HTTPServer,
    ListenerConfig,
    LocalReplica,
    Policy,
    Request,
    Response,
    RouteCache,
    SchedulerConfig,
    UpstreamConfig,
    route_records,
    serve_chain,
    serve_http,
    text_response,
)
from blocks._sync import one_error
from blocks.fields import HEALTH_PATH
from blocks.observe import Metrics
from blocks.store import RouteEvent
from blocks.topology import replica_from_url
from blocks.transport.streams import H2ConnectionStatistics

HOST = "127.0.0.1"
REPO = Path(__file__).resolve().parent.parent
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
Headers = list[tuple[bytes, bytes]]


# -- curl -------------------------------------------------------------------------------


def h2_client(**kwargs: Any) -> httpx.AsyncClient:
    """A prior-knowledge h2 client (h2c), ignoring proxies from the environment."""
    return httpx.AsyncClient(http2=True, http1=False, trust_env=False, **kwargs)


async def curl(*args: str) -> str:
    """Run curl (never through a proxy from the environment) and return its stdout."""
    result = await trio.run_process(
        ["curl", "--silent", "--show-error", "--noproxy", "*", "--max-time", "20", *args],
        capture_stdout=True,
        capture_stderr=True,
    )
    return result.stdout.decode()


# -- a raw h2 client ----------------------------------------------------------------------


@attrs.define
class H2Result:
    """Everything one stream delivered."""

    status: int
    headers: Headers
    body: bytes
    trailers: Headers | None
    events: list[h2.events.Event]
    reset: h2.events.StreamReset | None = None
    terminated: h2.events.ConnectionTerminated | None = None
    connection_lost: bool = False

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class RawH2Client:
    """``h2`` on a trio TCP stream, prior knowledge, one reader task.

    Each stream's events go to its own channel; ``next_event`` reads them in
    order. Received data is acknowledged at once, so the server's window
    never closes on us. Outbound header validation is off so that tests can
    send what a careful client would refuse.
    """

    def __init__(self, stream: trio.SocketStream, authority: bytes) -> None:
        self.stream = stream
        self.authority = authority
        config = h2.config.H2Configuration(
            client_side=True,
            header_encoding=None,
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.conn = h2.connection.H2Connection(config)
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.closed = trio.Event()
        self._send_lock = trio.Lock()
        self._channels: dict[int, tuple[trio.MemorySendChannel[Any], trio.MemoryReceiveChannel[Any]]] = {}

    @classmethod
    @asynccontextmanager
    async def open(cls, port: int, host: str = HOST) -> AsyncIterator[RawH2Client]:
        stream = await trio.open_tcp_stream(host, port)
        client = cls(stream, f"{host}:{port}".encode())
        async with stream, trio.open_nursery() as nursery:
            client.conn.initiate_connection()
            await client.flush()
            nursery.start_soon(client._reader)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()

    async def flush(self) -> None:
        async with self._send_lock:
            data = self.conn.data_to_send()
            if data:
                await self.stream.send_all(data)

    async def _reader(self) -> None:
        try:
            while True:
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return
                for event in self.conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived) and event.flow_controlled_length:
                        self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if isinstance(event, h2.events.ConnectionTerminated):
                        self.terminated = event
                    sid = getattr(event, "stream_id", None)
                    if sid in self._channels:
                        self._channels[sid][0].send_nowait(event)
                await self.flush()
        finally:
            self.closed.set()
            for send, _ in self._channels.values():
                send.close()

    def head(self, method: bytes, path: bytes, *extra: tuple[bytes, bytes]) -> Headers:
        return [
            (b":method", method),
            (b":scheme", b"http"),
            (b":authority", self.authority),
            (b":path", path),
            *extra,
        ]

    async def start(self, headers: Headers, *, end_stream: bool = True) -> int:
        """Open a stream with ``headers``; returns its id."""
        sid: int = self.conn.get_next_available_stream_id()
        self._channels[sid] = trio.open_memory_channel(math.inf)
        self.conn.send_headers(sid, headers, end_stream=end_stream)
        await self.flush()
        return sid

    async def send(self, sid: int, data: bytes, *, end_stream: bool = False) -> None:
        assert len(data) <= self.conn.local_flow_control_window(sid), "the tests send small bodies"
        self.conn.send_data(sid, data, end_stream=end_stream)
        await self.flush()

    async def end(self, sid: int) -> None:
        self.conn.end_stream(sid)
        await self.flush()

    async def next_event(self, sid: int) -> h2.events.Event:
        """The stream's next event; ``trio.EndOfChannel`` once the connection is gone."""
        return await self._channels[sid][1].receive()

    async def collect(self, sid: int) -> H2Result:
        """Read the stream's events until it ends, is reset, or the connection goes."""
        result = H2Result(0, [], b"", None, [])
        body = bytearray()
        while True:
            try:
                event = await self.next_event(sid)
            except trio.EndOfChannel:
                result.connection_lost = True
                result.terminated = self.terminated
                break
            result.events.append(event)
            if isinstance(event, h2.events.ResponseReceived):
                for name, value in event.headers:
                    if name == b":status":
                        result.status = int(value)
                    else:
                        result.headers.append((name, value))
            elif isinstance(event, h2.events.DataReceived):
                body += event.data
            elif isinstance(event, h2.events.TrailersReceived):
                result.trailers = list(event.headers)
            elif isinstance(event, h2.events.StreamReset):
                result.reset = event
                break
            elif isinstance(event, h2.events.StreamEnded):
                break
        result.body = bytes(body)
        return result

    async def request(self, headers: Headers, body: bytes | None = None) -> H2Result:
        sid = await self.start(headers, end_stream=body is None)
        if body is not None:
            await self.send(sid, body, end_stream=True)
        return await self.collect(sid)


# -- a chain assembled from blocks -------------------------------------------------------------


class RawFrames:
    """A bare HTTP/2 connection: frames go out exactly as built, frames come in parsed, nothing checked.

    For what no HTTP/2 library will send: floods, broken header blocks,
    frames on the wrong stream. Build frames with ``hyperframe.frame`` and
    header blocks with :meth:`block`; read with :meth:`next_frame` or
    :meth:`until`. Received frames are never acknowledged or answered.
    """

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.heads: dict[int, dict[bytes, bytes]] = {}  # each stream's last header block, decoded
        self._buffer = bytearray()

    @classmethod
    @asynccontextmanager
    async def open(cls, port: int, *, settings: Mapping[int, int] | None = None) -> AsyncIterator[Self]:
        """Connect, send the preface and a SETTINGS frame (``settings``, empty by default)."""
        stream = await trio.open_tcp_stream(HOST, port)
        async with stream:
            raw = cls(stream)
            await raw.send(H2_PREFACE, hyperframe.frame.SettingsFrame(0, settings=dict(settings or {})))
            yield raw

    def block(self, path: bytes = b"/", *extra: tuple[bytes, bytes], method: bytes = b"GET") -> bytes:
        """An HPACK header block for a request (``:authority`` example.test), literals without Huffman."""
        fields = [(b":method", method), (b":scheme", b"http"), (b":authority", b"example.test"), (b":path", path)]
        return bytes(self.encoder.encode([*fields, *extra], huffman=False))

    def request(self, sid: int, path: bytes = b"/", *, end_stream: bool = True) -> hyperframe.frame.HeadersFrame:
        flags = ["END_HEADERS", "END_STREAM"] if end_stream else ["END_HEADERS"]
        return hyperframe.frame.HeadersFrame(sid, self.block(path), flags=flags)

    async def send(self, *frames: hyperframe.frame.Frame | bytes) -> bool:
        """Write ``frames`` in one go; False if the server has closed the connection."""
        data = b"".join(f if isinstance(f, bytes) else f.serialize() for f in frames)
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def next_frame(self) -> hyperframe.frame.Frame | None:
        """The next frame from the server, or None once it has closed the connection."""
        while True:
            if len(self._buffer) >= 9:
                frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(self._buffer[:9]))
                if len(self._buffer) >= 9 + length:
                    frame.parse_body(memoryview(self._buffer[9 : 9 + length]))
                    del self._buffer[: 9 + length]
                    if isinstance(frame, hyperframe.frame.HeadersFrame):  # (the server sends no CONTINUATION)
                        fields = self.decoder.decode(frame.data, raw=True)
                        self.heads[frame.stream_id] = {bytes(n): bytes(v) for n, v in fields}
                    return frame
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if not data:
                return None
            self._buffer += data

    async def until(self, predicate: Callable[[hyperframe.frame.Frame], bool]) -> hyperframe.frame.Frame | None:
        """Read until a frame satisfies ``predicate``; None if the connection closes first."""
        while (frame := await self.next_frame()) is not None:
            if predicate(frame):
                return frame
        return None

    def status(self, sid: int) -> bytes | None:
        """The ``:status`` of the last head received on ``sid``."""
        return self.heads.get(sid, {}).get(b":status")

    async def goaway(self) -> hyperframe.frame.GoAwayFrame | None:
        """Read up to the server's GOAWAY (None if it closed without one)."""
        frame = await self.until(lambda f: isinstance(f, hyperframe.frame.GoAwayFrame))
        assert frame is None or isinstance(frame, hyperframe.frame.GoAwayFrame)
        return frame


def closed_port() -> int:
    """A loopback port that nothing listens on: bound once, never listened on, closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
    return port


def route_apps(
    chain: Chain,
    local: Mapping[str, LocalReplica],
    app: str,
    domains: Mapping[str, str] | None,
    apps: Mapping[str, Sequence[str]] | None,
) -> None:
    """Write ``domains`` (domain -> app) and ``apps`` (app -> names in ``local``) behind the chain's first worker.

    ``domains`` defaults to ``{"*": app}`` and ``apps`` to every replica under ``app``.
    """
    domains = domains if domains is not None else {"*": app}
    apps = apps if apps is not None else {app: list(local)}
    worker = (HOST, chain.worker_server.port)
    records: dict[str, bytes] = {}
    for app in {*apps, *domains.values()}:
        named = {name: local[name] for name in apps.get(app, ())}
        records |= route_records(app, named, worker=worker, domains=[d for d, a in domains.items() if a == app])
    chain.store.transact(records)


async def assemble(
    nursery: trio.Nursery,
    *,
    replicas: Sequence[str] = ("replica-0",),
    dead: Sequence[str] = (),
    domains: Mapping[str, str] | None = None,
    apps: Mapping[str, Sequence[str]] | None = None,
    worker_upstream: UpstreamConfig | None = None,
    protocol: str = "h2",
) -> Chain:
    """edge -> proxy -> one worker -> demo ``replicas`` (and ``dead`` ones on closed ports).

    ``domains`` defaults to ``{"*": "demo"}`` and ``apps`` to every replica,
    dead ones included, under ``demo``.
    """

    async def build(chain: Chain) -> None:
        local = {name: await chain.start_replica(name, protocol=protocol) for name in replicas}
        local |= {name: LocalReplica((HOST, closed_port()), protocol) for name in dead}
        await chain.start_worker(local, app=None, upstream=worker_upstream)
        route_apps(chain, local, "demo", domains, apps)
        await chain.start_proxy()
        await chain.start_edge()

    chain: Chain = await nursery.start(serve_chain, build)
    return chain


async def raw_exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    stream = await trio.open_tcp_stream(HOST, port)
    async with stream:
        await stream.send_all(data)
        received = bytearray()
        while chunk := await stream.receive_some(65536):
            received += chunk
    return bytes(received)


# -- regression helpers --------------------------------------------------------------------


@attrs.define
class RelayLog:
    """What a hop's fast path did, in order: True for a spliced stream, False for a declined one."""

    outcomes: list[bool] = attrs.field(factory=list)

    @property
    def spliced(self) -> int:
        return sum(self.outcomes)

    @property
    def declined(self) -> int:
        return len(self.outcomes) - self.spliced


def record_relays(server: HTTPServer) -> RelayLog:
    """Record every decision of ``server``'s fast path (``relay``).

    A connection takes the server's relay when it is accepted, so call this
    before the first connection that matters reaches ``server``. Health
    checks (``/.proxyblocks/health``, answered by the hop) are not recorded.
    """
    relay = server.relay
    assert relay is not None, "this server has no fast path"
    log = RelayLog()

    def recording(request: Any, driver: Any, st: Any, ended: bool) -> bool:
        spliced = relay(request, driver, st, ended)
        if request.path != HEALTH_PATH:  # (health checks come on the checker's clock, not the test's)
            log.outcomes.append(spliced)
        return spliced

    server.relay = recording
    return log


async def assemble_local(
    nursery: trio.Nursery,
    local: Mapping[str, LocalReplica],
    *,
    worker_upstream: UpstreamConfig | None = None,
    proxy_upstream: UpstreamConfig | None = None,
    policy: Policy | None = None,
) -> Chain:
    """edge -> proxy -> one worker -> the given replicas (any server, already running), all under ``*``."""
    return await assemble_fair(
        nursery, local, scheduler=None, worker_upstream=worker_upstream, proxy_upstream=proxy_upstream, policy=policy
    )


# -- fair scheduler helpers ------------------------------------------------------------------


@attrs.define(eq=False)
class TenantReplica:
    """A replica handler that watches tenants (``x-tenant``) arrive.

    - ``/sleep?ms=N``: 200 after N ms;
    - ``/hold``: 200 once :meth:`release` is called (every hold waiting then);
    - anything else: 200 at once.

    It records the tenant of every arrival in order, each tenant's requests in
    flight here and the most it ever had at once, and how many requests were
    cancelled while in flight (the chain gave up on them).
    """

    arrivals: list[str] = attrs.field(factory=list)
    in_flight: collections.Counter[str] = attrs.field(factory=collections.Counter)
    peak: collections.Counter[str] = attrs.field(factory=collections.Counter)
    cancelled: int = 0
    _gate: trio.Event = attrs.field(factory=trio.Event)

    @property
    def total_in_flight(self) -> int:
        return sum(self.in_flight.values())

    def release(self) -> None:
        """Answer every ``/hold`` waiting now."""
        self._gate.set()
        self._gate = trio.Event()

    async def __call__(self, request: Request) -> Response:
        tenant = (request.header(b"x-tenant") or b"").decode("latin-1")
        path, _, query = request.path.partition(b"?")
        self.arrivals.append(tenant)
        self.in_flight[tenant] += 1
        self.peak[tenant] = max(self.peak[tenant], self.in_flight[tenant])
        try:
            if path == b"/sleep":
                await trio.sleep(int(parse_qs(query.decode())["ms"][0]) / 1000)
            elif path == b"/hold":
                await self._gate.wait()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        finally:
            self.in_flight[tenant] -= 1
        return text_response(200, f"{tenant}\n", [(b"x-tenant-seen", tenant.encode())])


async def serve_tenant_replica(
    nursery: trio.Nursery, protocol: str = "h2"
) -> tuple[TenantReplica, HTTPServer, LocalReplica]:
    """Start a :class:`TenantReplica` on loopback (h1 and h2c on one port)."""
    replica = TenantReplica()
    server: HTTPServer = await nursery.start(functools.partial(serve_http, replica, config=ListenerConfig()))
    return replica, server, LocalReplica((HOST, server.port), protocol)


async def assemble_fair(
    nursery: trio.Nursery,
    local: Mapping[str, LocalReplica],
    *,
    scheduler: SchedulerConfig | None,
    domains: Mapping[str, str] | None = None,
    apps: Mapping[str, Sequence[str]] | None = None,
    worker_upstream: UpstreamConfig | None = None,
    proxy_upstream: UpstreamConfig | None = None,
    policy: Policy | None = None,
) -> Chain:
    """edge -> proxy (with ``scheduler``) -> one worker -> the given replicas (running or not).

    ``domains`` defaults to ``{"*": "app"}`` and ``apps`` to every replica under ``app``.
    """

    async def build(chain: Chain) -> None:
        await chain.start_worker(local, app=None, upstream=worker_upstream)
        route_apps(chain, local, "app", domains, apps)
        await chain.start_proxy(scheduler=scheduler, upstream=proxy_upstream, policy=policy)
        await chain.start_edge()

    chain: Chain = await nursery.start(serve_chain, build)
    return chain


async def wait_for(predicate: Callable[[], bool], what: str | Callable[[], str] = "", *, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail with ``what`` (or what it returns) if not within ``timeout`` seconds.

    The timeout is a liveness bound (a leak or a hang fails here, with a
    message), never a speed assertion: keep it far above any normal wait.
    """
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.005)
        return
    raise AssertionError(f"still waiting after {timeout} s: {what() if callable(what) else what or predicate}")


def books(servers: Mapping[str, HTTPServer]) -> Iterator[tuple[str, H2ConnectionStatistics]]:
    """Every h2 connection of these servers, on both ends of each hop: ``("edge -> proxy", its books)``."""
    names = {server.port: name for name, server in servers.items()}
    for name, server in servers.items():
        for conn in server.statistics().h2:
            yield f"{name}'s listener", conn
        if server.upstreams is not None:
            for pool in server.upstreams.statistics():
                for conn in pool.h2:
                    yield f"{name} -> {names.get(pool.address[1], pool.address)}", conn


async def wait_books_balanced(servers: Mapping[str, HTTPServer], links: Sequence[str] = ()) -> None:
    """Wait until no h2 connection of ``servers`` has a stream or holds an unacknowledged byte.

    ``links`` (``"edge -> proxy"``) must be among the connections read: a ledger without them
    would balance by having nothing in it.
    """

    def balanced() -> bool:
        return all(conn.streams == 0 and conn.unacknowledged == 0 for _, conn in books(servers))

    def ledger() -> str:
        held = [f"{name}: {conn}" for name, conn in books(servers) if conn.streams or conn.unacknowledged]
        return "connections still hold bytes: " + "; ".join(held)

    await wait_for(balanced, ledger, timeout=20)
    seen = {name for name, _ in books(servers)}
    assert set(links) <= seen, f"no connection {sorted(set(links) - seen)} to read the books of, in {sorted(seen)}"


class RecordingCache:
    """A RouteCache that records what a reconciler does to it: the revisions it is loaded at,
    the events it is handed (kind, key, revision) and, per batch, the revisions applied.

    With ``contiguous``, it also asserts the reconciler's promise for a store whose
    revisions have no holes (the embedded store): after a load at R, the events are
    exactly R+1, R+2, ..., each once. (etcd's revisions count every key, so they skip.)
    """

    def __init__(self, *, contiguous: bool = False) -> None:
        self.cache = RouteCache()
        self.contiguous = contiguous
        self.loads: list[int] = []
        self.events: list[tuple[str, str, int]] = []
        self.applied: list[int] = []

    @property
    def revision(self) -> int:
        return self.cache.revision

    def load(self, snapshot: dict[str, bytes], revision: int, now: float) -> None:
        self.loads.append(revision)
        self.cache.load(snapshot, revision, now)

    def apply(self, events: Sequence[RouteEvent], now: float) -> None:
        assert events, "an empty batch"
        if self.contiguous:
            last = self.cache.revision
            assert events[0].revision == last + 1, f"after {last}: {events[0]}"
            for event in events:
                assert event.revision in (last, last + 1), f"after {last}: {event}"
                last = event.revision
        self.events += [(event.kind, event.key, event.revision) for event in events]
        self.applied.extend(sorted({event.revision for event in events}))
        self.cache.apply(events, now)

    def synced(self, now: float) -> None:
        self.cache.synced(now)

    def unsynced(self, now: float) -> None:
        self.cache.unsynced(now)

    def staleness(self, now: float) -> float:
        return self.cache.staleness(now)


@asynccontextmanager
async def connect_websocket(
    port: int, path: str = "/chat", **kwargs: Any
) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """trio-websocket's client, on a TCP stream the test owns and closes.

    (``open_websocket`` leaves its socket open when the server closes first:
    its ``aclose`` returns early once a close reason is set.) A rejection is
    raised as ``ConnectionRejected`` itself.
    """
    stream = await trio.open_tcp_stream(HOST, port)
    with one_error():
        async with stream, trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(nursery, stream, f"{HOST}:{port}", path, **kwargs)
            try:
                yield ws
            finally:
                with trio.move_on_after(5):
                    await ws.aclose()
                nursery.cancel_scope.cancel()


class Lines:
    """A process's stdout, read up to the line we wait for."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.text = ""
        self.seen = 0  # where :meth:`next` looks from

    async def until(self, pattern: str, *, start: int = 0) -> re.Match[str]:
        """The first match of ``pattern`` in the output from ``start`` (default: all of it), read as far as needed."""
        compiled = re.compile(pattern, re.MULTILINE)
        while (match := compiled.search(self.text, start)) is None:
            chunk = await self.stream.receive_some()
            assert chunk, f"the process ended before printing {pattern!r}: {self.text!r}"
            self.text += chunk.decode()
        return match

    async def next(self, pattern: str) -> re.Match[str]:
        """The next match of ``pattern`` after the last :meth:`next` returned (a line printed again counts again)."""
        match = await self.until(pattern, start=self.seen)
        self.seen = match.end()
        return match

    async def rest(self) -> str:
        while chunk := await self.stream.receive_some():
            self.text += chunk.decode()
        return self.text


# -- servers that are not part of the project, and recipes, as separate processes ---------------


@asynccontextmanager
async def child_process(
    command: Sequence[str], ready: str, *, stderr: bool = False
) -> AsyncIterator[tuple[trio.Process, re.Match[str]]]:
    """Run ``command`` in the repository as a process of its own until the block ends (SIGTERM, by its PID).

    Yields the process and the match of ``ready`` (a regular expression) in
    its stdout, once printed; with ``stderr``, in its stdout and stderr (for
    a server that logs where it listens). Its output is read on after that,
    so it never blocks on a full pipe.
    """
    with one_error():
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                functools.partial(
                    trio.run_process,
                    list(command),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT if stderr else None,
                    cwd=REPO,
                    check=False,
                )
            )
            assert process.stdout is not None
            try:
                match = await Lines(process.stdout).until(ready)
                nursery.start_soon(drain, process.stdout)
                yield process, match
            finally:
                process.terminate()


async def drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some():
        pass


@asynccontextmanager
async def chain_recipe(*replicas: str) -> AsyncIterator[str]:
    """``python -m recipes.chain --replica URL ...``, run as docs/recipes.md says: the edge's URL once it listens."""
    command = [sys.executable, "-m", "recipes.chain", *(arg for url in replicas for arg in ("--replica", url))]
    async with child_process(command, r"^edge listening on (\S+)$") as (_, match):
        yield match.group(1)


HYPERCORN = [sys.executable, "-m", "hypercorn", "tests.asgi_replica:app", "--bind", "127.0.0.1:0", "-k", "trio"]
"""hypercorn serving ``tests/asgi_replica.py`` (HTTP/1.1 and h2c on one port): a replica not of the project."""


@asynccontextmanager
async def hypercorn_behind(
    nursery: trio.Nursery, scheme: str, worker: UpstreamConfig | None = None, proxy: UpstreamConfig | None = None
) -> AsyncIterator[Chain]:
    """hypercorn as the one replica (``scheme``: ``http`` for the worker's h1 pool, ``h2c`` for its h2
    pool) of a chain whose worker and proxy use these upstream configs."""
    async with child_process(HYPERCORN, r"Running on http://(\S+) \(CTRL", stderr=True) as (_, match):
        replica = replica_from_url(f"{scheme}://{match.group(1)}")
        yield await assemble_local(nursery, {"hypercorn": replica}, worker_upstream=worker, proxy_upstream=proxy)


HYPERCORN_CHAT = [sys.executable, "-m", "hypercorn", "tests.asgi_chat:app", "--bind", "127.0.0.1:0", "-w", "0"]
"""A chat server of one's own: ``tests/asgi_chat.py`` under Hypercorn (its asyncio worker, in this one process)."""


@asynccontextmanager
async def chat_server() -> AsyncIterator[int]:
    """A Hypercorn process serving the ASGI chat app (HTTP/1.1 and h2c on one port): its port."""
    async with child_process(HYPERCORN_CHAT, r"Running on http://127\.0\.0\.1:(\d+) ", stderr=True) as (_, match):
        yield int(match.group(1))


BODY = b"served by python's own http.server\n"


@asynccontextmanager
async def http_server(directory: Path, body: bytes = BODY) -> AsyncIterator[tuple[str, int]]:
    """``python -m http.server`` on a free loopback port, serving ``directory`` with ``hello.txt``
    holding ``body``: its address."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "hello.txt").write_bytes(body)
    command = [sys.executable, "-u", "-m", "http.server", "--bind", HOST, "--directory", str(directory), "0"]
    async with child_process(command, r"Serving HTTP on \S+ port (\d+)") as (_, match):
        yield HOST, int(match.group(1))


async def start_recipe(nursery: trio.Nursery, *args: str, recipe: str = "chain") -> tuple[trio.Process, Lines]:
    """``python -m recipes.RECIPE ARGS`` from the repository's root, started in ``nursery``:
    the process (stderr piped too) and its stdout's :class:`Lines`."""
    return await start_python(nursery, "-m", f"recipes.{recipe}", *args)


async def start_python(nursery: trio.Nursery, *args: str) -> tuple[trio.Process, Lines]:
    """``python ARGS`` from the repository's root, started in ``nursery``: the process (stderr
    piped too) and its stdout's :class:`Lines`."""
    process: trio.Process = await nursery.start(
        functools.partial(
            trio.run_process,
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
            check=False,
        )
    )
    assert process.stdout is not None
    return process, Lines(process.stdout)


async def held_chain(nursery: trio.Nursery, release: trio.Event, *, metered: bool = False, **proxy: Any) -> Chain:
    """A chain (replica ``slow`` -> worker -> proxy -> edge) whose replica answers ``/hold`` once
    ``release`` is set and anything else at once; ``metered``: every hop counts (``Metrics``);
    ``proxy``: the proxy's options (``scheduler=``...)."""

    async def hold(request: Request) -> Response:
        if request.path == b"/hold":
            await release.wait()
        return text_response(200, "held\n")

    def features() -> list[Any]:
        return [Metrics()] if metered else []

    async def build(chain: Chain) -> None:
        local = {"slow": await chain.start_replica("slow", functools.partial(serve_http, hold))}
        await chain.start_worker(local, features=features())
        await chain.start_proxy(features=features(), **proxy)
        await chain.start_edge(features=features())

    chain: Chain = await nursery.start(serve_chain, build)
    return chain


def start_gets(nursery: trio.Nursery, client: httpx.AsyncClient, n: int, into: list[httpx.Response]) -> None:
    """``n`` concurrent ``GET /`` through ``client`` in ``nursery``, each response appended to ``into``."""

    async def get() -> None:
        into.append(await client.get("/"))

    for _ in range(n):
        nursery.start_soon(get)


def gated(path: Path) -> str:
    """An autoscaler's command for the demo replica, started only once ``path`` exists (a test holds a
    cold start for as long as it needs)."""
    return (
        f'{sys.executable} -c "import pathlib, runpy, sys, time\n'
        f"while not pathlib.Path('{path}').exists(): time.sleep(0.02)\n"
        f"sys.argv = ['replica', '--port', '{{port}}', '--name', '{{name}}']\n"
        f"runpy.run_module('blocks.testing.replica', run_name='__main__')\""
    )
