"""Failure semantics of the upstream pools: GOAWAY, safe retry, outlier ejection.

Rules for this file: loopback only, port 0, every async test bounded by
``trio.fail_after``. The upstreams are tiny raw h2 servers (``h2`` in server
mode on trio sockets) that refuse, reset or GOAWAY exactly the streams a test
names and record everything they receive, so each test can say what reached
the upstream, on which connection. The multiplexer is driven directly
(``open_upstreams`` and ``Upstreams.request``) and through a hop's spliced
fast path (``Upstreams.splice``). Outlier ejection is sans-IO: synchronous
tests with ``now`` passed in, and hypothesis properties.
"""

from __future__ import annotations

import functools
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import httpx
import hyperframe.frame
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks import (
    Body,
    BytesBody,
    EdgeConfig,
    Exchange,
    Feature,
    Forward,
    Hop,
    HTTPServer,
    IterBody,
    ListenerConfig,
    LocalReplica,
    OutlierConfig,
    Proxy,
    Replica,
    Request,
    RouteTable,
    StreamBody,
    UpstreamConfig,
    UpstreamProtocolError,
    Upstreams,
    open_upstreams,
    serve_edge,
    serve_http,
    serve_proxy,
    serve_worker,
)
from blocks.routing import OutlierDetector, OutlierStatistics
from blocks.timing import parse_server_timing
from tests.support import (
    HOST,
    RawH2Client,
    TenantReplica,
    closed_port,
    record_relays,
    serve_tenant_replica,
    wait_for,
)

DEFAULT = OutlierConfig()  # (stands for serve_proxy's own default)

REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
TOP = 2**31 - 1

# -- a scripted raw h2 upstream ------------------------------------------------------------


@attrs.define(eq=False)
class Seen:
    """One stream as the upstream received it."""

    conn: int  # which connection, in accept order
    sid: int
    method: bytes
    path: bytes
    body: bytes = b""
    ended: bool = False
    action: str = "answer"
    refused: bool = False
    answered: bool = False


Script = Callable[[Seen], str]
"""What the upstream does with a stream, decided when its head arrives:

- ``answer``: 200 once the request ended, body ``conn=C stream=S body=N``;
- ``hold``: the same, but only once ``RawUpstream.release()`` was called;
- ``refuse``: RST_STREAM(REFUSED_STREAM) at once; ``refuse-on-data``: when
  its first DATA arrives;
- ``goaway``: GOAWAY(NO_ERROR, last stream id = the one before it) at once;
  ``goaway-on-data``: when its first DATA arrives;
- ``reset``: RST_STREAM(INTERNAL_ERROR) at once;
- ``ignore``: nothing.

Streams above a GOAWAY's last stream id are never answered.
"""


class UpstreamConnection:
    def __init__(self, server: RawUpstream, stream: trio.SocketStream, index: int) -> None:
        self.server = server
        self.stream = stream
        self.index = index
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        self.last_stream_id: int | None = None  # set by our GOAWAY
        self.seen: dict[int, Seen] = {}
        self.closed = trio.Event()
        self._ping_acked = trio.Event()
        self._lock = trio.Lock()
        self._nursery: trio.Nursery | None = None

    async def flush(self, extra: bytes = b"") -> None:
        async with self._lock:
            data = self.h2.data_to_send() + extra
            if data:
                try:
                    await self.stream.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

    async def run(self) -> None:
        server = self.server
        async with self.stream, trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.index in server.hold_settings:
                await server.settings_released.wait()
            self.h2.initiate_connection()
            await self.flush()
            try:
                while data := await self.stream.receive_some(65536):
                    for event in self.h2.receive_data(data):
                        self._on_event(event)
                    await self.flush()
            except (trio.BrokenResourceError, trio.ClosedResourceError, h2.exceptions.ProtocolError):
                pass
            finally:
                self.closed.set()
                nursery.cancel_scope.cancel()

    def _on_event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            head = dict(event.headers)
            seen = Seen(self.index, event.stream_id, head[b":method"], head[b":path"])
            seen.ended = event.stream_ended is not None
            self.seen[event.stream_id] = seen
            self.server.seen.append(seen)
            seen.action = self.server.script(seen)
            if seen.action in ("refuse", "goaway", "reset"):
                self._act(seen, seen.action)
            elif seen.ended:
                self._maybe_answer(seen)
        elif isinstance(event, h2.events.DataReceived):
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            seen = self.seen[event.stream_id]
            seen.body += event.data
            if seen.action in ("refuse-on-data", "goaway-on-data") and not seen.refused:
                self._act(seen, seen.action.removesuffix("-on-data"))
        elif isinstance(event, h2.events.StreamEnded):
            seen = self.seen[event.stream_id]
            seen.ended = True
            self._maybe_answer(seen)
        elif isinstance(event, h2.events.PingAckReceived):
            self._ping_acked.set()

    def _act(self, seen: Seen, action: str) -> None:
        seen.refused = action != "reset"
        if action == "goaway":
            self._goaway_frame(seen.sid - 2)
        else:
            code = h2.errors.ErrorCodes.INTERNAL_ERROR if action == "reset" else REFUSED
            self.h2.reset_stream(seen.sid, code)

    def _goaway_frame(self, last: int, error_code: int = 0) -> bytes:
        # Written beside h2, whose state machine would refuse to answer the
        # streams below the last id once it has sent a GOAWAY itself.
        self.last_stream_id = last
        frame = hyperframe.frame.GoAwayFrame(stream_id=0, last_stream_id=max(last, 0), error_code=error_code)
        data = frame.serialize()
        if self._nursery is not None:
            self._nursery.start_soon(self.flush, data)
        return data

    def _maybe_answer(self, seen: Seen) -> None:
        if seen.action == "answer":
            self._answer(seen)
        elif seen.action == "hold":
            assert self._nursery is not None
            self._nursery.start_soon(self._answer_when_released, seen)

    async def _answer_when_released(self, seen: Seen) -> None:
        await self.server.released.wait()
        self._answer(seen)
        await self.flush()

    def _answer(self, seen: Seen) -> None:
        if seen.answered or (self.last_stream_id is not None and seen.sid > self.last_stream_id):
            return
        seen.answered = True
        body = b"conn=%d stream=%d body=%d" % (self.index, seen.sid, len(seen.body))
        try:
            self.h2.send_headers(seen.sid, [(b":status", b"200"), (b"content-length", b"%d" % len(body))])
            self.h2.send_data(seen.sid, body, end_stream=True)
        except h2.exceptions.ProtocolError:
            pass  # the client gave the stream up

    async def goaway(self, last_stream_id: int, error_code: int = 0) -> None:
        """GOAWAY, then wait until the client has read it (it acknowledges the PING sent behind it)."""
        self._ping_acked = trio.Event()
        async with self._lock:
            data = self.h2.data_to_send() + self._goaway_frame(last_stream_id, error_code)
            self.h2.ping(b"goaway!!")
            await self.stream.send_all(data + self.h2.data_to_send())
        if error_code:
            await self.closed.wait()  # an error GOAWAY closes the connection instead
        else:
            await self._ping_acked.wait()


@attrs.define(eq=False)
class RawUpstream:
    script: Script
    port: int = 0
    seen: list[Seen] = attrs.field(factory=list)
    connections: list[UpstreamConnection] = attrs.field(factory=list)
    hold_settings: set[int] = attrs.field(factory=set)  # connections that wait for settings_released
    settings_released: trio.Event = attrs.field(factory=trio.Event)
    released: trio.Event = attrs.field(factory=trio.Event)

    @property
    def address(self) -> tuple[str, int]:
        return (HOST, self.port)

    def release(self) -> None:
        """Answer every held stream."""
        self.released.set()

    def where(self) -> list[tuple[int, int, str]]:
        """(connection, stream id, what happened) for every stream, in arrival order."""
        return [(s.conn, s.sid, "answered" if s.answered else "refused" if s.refused else s.action) for s in self.seen]

    async def serve(self, *, task_status: trio.TaskStatus[RawUpstream] = trio.TASK_STATUS_IGNORED) -> None:
        (listener,) = await trio.open_tcp_listeners(0, host=HOST)
        self.port = listener.socket.getsockname()[1]
        async with listener, trio.open_nursery() as nursery:
            task_status.started(self)
            while True:
                stream = await listener.accept()
                connection = UpstreamConnection(self, stream, len(self.connections))
                self.connections.append(connection)
                nursery.start_soon(connection.run)


async def start_upstream(nursery: trio.Nursery, script: Script) -> RawUpstream:
    server: RawUpstream = await nursery.start(RawUpstream(script).serve)
    return server


def first(action: str, then: str = "answer") -> Script:
    """``action`` for the very first stream, ``then`` for the others."""
    return lambda seen: action if seen.conn == 0 and seen.sid == 1 else then


def on_first_connection(action: str, then: str = "answer") -> Script:
    return lambda seen: action if seen.conn == 0 else then


def get(path: bytes = b"/") -> Request:
    return Request(b"GET", b"http", b"upstream.test", path)


async def text(upstreams: Upstreams, address: tuple[str, int], request: Request) -> str:
    response = await upstreams.request(address, request, [])
    assert response.status == 200
    return (await response.body.read_all()).decode()


def pool_statistics(upstreams: Upstreams) -> tuple[int, int, int]:
    (pool,) = upstreams.statistics()
    return pool.connections, pool.active_streams, pool.retries


# -- GOAWAY --------------------------------------------------------------------------------


async def test_goaway_lets_streams_at_or_below_its_last_id_finish_and_retries_those_above(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, on_first_connection("hold"))
        async with open_upstreams() as upstreams:
            bodies: dict[bytes, str] = {}

            async def fetch(path: bytes) -> None:
                bodies[path] = await text(upstreams, server.address, get(path))

            async with trio.open_nursery() as requests:
                for count, path in enumerate((b"/a", b"/b", b"/c"), 1):
                    requests.start_soon(fetch, path)
                    await wait_for(lambda count=count: len(server.seen) == count)  # streams 1, 3, 5
                await server.connections[0].goaway(3)
                server.release()
            assert bodies == {
                b"/a": "conn=0 stream=1 body=0",
                b"/b": "conn=0 stream=3 body=0",
                b"/c": "conn=1 stream=1 body=0",  # never processed: sent again, on a new connection
            }
            assert server.where() == [(0, 1, "answered"), (0, 3, "answered"), (0, 5, "hold"), (1, 1, "answered")]
            # The drained connection closes once its last stream is done; the new one stays.
            await server.connections[0].closed.wait()
            await wait_for(lambda: pool_statistics(upstreams) == (1, 0, 1), lambda: repr(upstreams.statistics()))


async def test_new_requests_after_a_goaway_open_a_fresh_connection(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, on_first_connection("hold"))
        # One connection allowed: the draining one does not count against it.
        async with open_upstreams(UpstreamConfig(max_connections=1)) as upstreams:
            held: list[str] = []

            async def fetch_held() -> None:
                held.append(await text(upstreams, server.address, get(b"/held")))

            nursery.start_soon(fetch_held)
            await wait_for(lambda: len(server.seen) == 1)
            await server.connections[0].goaway(TOP)  # graceful: nothing refused, no new stream
            assert await text(upstreams, server.address, get(b"/new")) == "conn=1 stream=1 body=0"
            assert await text(upstreams, server.address, get(b"/new")) == "conn=1 stream=3 body=0"
            assert pool_statistics(upstreams) == (2, 1, 0)
            server.release()
            await wait_for(lambda: held == ["conn=0 stream=1 body=0"])
            await server.connections[0].closed.wait()
            await wait_for(lambda: pool_statistics(upstreams) == (1, 0, 0), lambda: repr(upstreams.statistics()))
            assert server.where() == [(0, 1, "answered"), (1, 1, "answered"), (1, 3, "answered")]


async def test_an_error_goaway_cuts_the_streams_below_and_retries_those_above(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, on_first_connection("hold"))
        async with open_upstreams() as upstreams:
            outcomes: dict[bytes, str] = {}

            async def fetch(method: bytes, path: bytes) -> None:
                try:
                    outcomes[path] = await text(upstreams, server.address, Request(method, b"http", b"u.test", path))
                except UpstreamProtocolError as exc:
                    outcomes[path] = f"{exc.status}"

            async with trio.open_nursery() as requests:
                for count, (method, path) in enumerate([(b"POST", b"/p"), (b"GET", b"/a"), (b"GET", b"/b")], 1):
                    requests.start_soon(fetch, method, path)
                    await wait_for(lambda count=count: len(server.seen) == count)  # streams 1, 3, 5
                await server.connections[0].goaway(3, h2.errors.ErrorCodes.INTERNAL_ERROR)
            # Streams 1 and 3 may have been processed, and the connection's end cut them before any
            # response byte: the GET goes again, the POST fails at once. Stream 5 never was: it goes again.
            assert outcomes.pop(b"/p") == "502"
            assert sorted(outcomes.values()) == ["conn=1 stream=1 body=0", "conn=1 stream=3 body=0"]
            assert pool_statistics(upstreams) == (1, 0, 2)


# -- safe retry on the awaiting path -----------------------------------------------------------


@pytest.mark.parametrize("refusal", ["refuse", "goaway"])
async def test_a_refused_request_is_retried_once_on_another_connection(nursery: trio.Nursery, refusal: str) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, first(refusal))
        async with open_upstreams() as upstreams:
            assert await text(upstreams, server.address, get()) == "conn=1 stream=1 body=0"
            assert server.where() == [(0, 1, "refused"), (1, 1, "answered")]
            # REFUSED_STREAM leaves the first connection usable; a GOAWAY drains it.
            await wait_for(lambda: pool_statistics(upstreams) == (2 if refusal == "refuse" else 1, 0, 1))


class Upload:
    """A request body that has not arrived yet: a listener's ``StreamBody``, or an ``IterBody``
    whose generator waits for it (it must never be cancelled mid-wait, which would end it)."""

    def __init__(self, kind: str) -> None:
        self.gate = trio.Event()
        self.body: Body
        if kind == "stream":
            self.body = self.stream = StreamBody()
        else:

            async def chunks() -> AsyncIterator[bytes]:
                await self.gate.wait()
                yield b"hello, "
                yield b"world"

            self.body = IterBody(chunks())

    def arrive(self) -> None:
        if isinstance(self.body, StreamBody):
            self.body.feed(b"hello, ")
            self.body.feed(b"world")
            self.body.end()
        self.gate.set()


@pytest.mark.parametrize("kind", ["stream", "iter"])
@pytest.mark.parametrize("arrives", ["after the retry", "while the retry connects"])
@pytest.mark.parametrize("refusal", ["refuse", "goaway"])
async def test_a_refused_post_whose_body_is_unread_is_retried(
    nursery: trio.Nursery, refusal: str, arrives: str, kind: str
) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, first(refusal))
        if arrives != "after the retry":
            server.hold_settings.add(1)
        async with open_upstreams() as upstreams:
            upload = Upload(kind)
            request = Request(b"POST", b"http", b"upstream.test", b"/upload", body=upload.body)
            result: list[str] = []

            async def post() -> None:
                result.append(await text(upstreams, server.address, request))

            nursery.start_soon(post)
            if arrives == "after the retry":
                await wait_for(lambda: len(server.seen) == 2, "the retry")
                upload.arrive()
            else:
                await wait_for(lambda: len(server.connections) == 2, "the retry's connection")
                upload.arrive()  # the pump reads it and holds it for the retry
                await trio.sleep(0.01)
                server.settings_released.set()
            await wait_for(lambda: bool(result))
            assert result == ["conn=1 stream=1 body=12"]
            assert [(seen.conn, seen.body, seen.ended) for seen in server.seen] == [
                (0, b"", False),
                (1, b"hello, world", True),
            ]
            assert pool_statistics(upstreams)[2] == 1


@pytest.mark.parametrize("refusal", ["refuse-on-data", "goaway-on-data"])
async def test_no_retry_once_the_request_body_started(nursery: trio.Nursery, refusal: str) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, first(refusal))
        async with open_upstreams() as upstreams:
            request = Request(b"POST", b"http", b"upstream.test", b"/upload", body=BytesBody(b"abc"))
            with pytest.raises(UpstreamProtocolError) as info:
                await upstreams.request(server.address, request, [])
            assert info.value.status == 503
            assert server.where() == [(0, 1, "refused")]
            assert server.seen[0].body == b"abc"
            assert pool_statistics(upstreams)[2] == 0


@pytest.mark.parametrize("refusal", ["refuse", "goaway"])
async def test_a_second_refusal_is_a_503(nursery: trio.Nursery, refusal: str) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, lambda seen: refusal)
        async with open_upstreams() as upstreams:
            with pytest.raises(UpstreamProtocolError) as info:
                await upstreams.request(server.address, get(), [])
            assert info.value.status == 503
            assert server.where() == [(0, 1, "refused"), (1, 1, "refused")]
            assert pool_statistics(upstreams)[2] == 1


async def test_a_reset_with_another_code_is_not_retried(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, first("reset"))
        async with open_upstreams() as upstreams:
            with pytest.raises(UpstreamProtocolError) as info:
                await upstreams.request(server.address, get(), [])
            assert info.value.status == 502
            assert server.where() == [(0, 1, "reset")]
            assert await text(upstreams, server.address, get()) == "conn=0 stream=3 body=0"
            assert pool_statistics(upstreams) == (1, 0, 0)


# -- safe retry on the spliced fast path ------------------------------------------------------------


class ToUpstream(Feature):
    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address

    def route(self, exchange: Exchange) -> Forward:
        return Forward(self.address, exchange.request.headers)


@asynccontextmanager
async def hop_to(server: RawUpstream) -> AsyncIterator[tuple[RawH2Client, Upstreams, list[bool]]]:
    """A hop in front of ``server``, a raw client connected to it, and its fast path's decisions.

    One request is answered first, on the handler path, so that the pool
    has a connection and later requests are spliced.
    """
    async with open_upstreams() as upstreams, trio.open_nursery() as nursery:
        hop = Hop("hop", upstreams, [ToUpstream(server.address)])
        listener = await nursery.start(
            functools.partial(serve_http, hop.handle, relay=hop.relay, config=ListenerConfig())
        )
        relays = record_relays(listener)
        async with RawH2Client.open(listener.port) as client:
            warm = await client.request(client.head(b"GET", b"/warm"))
            assert (warm.status, warm.body) == (200, b"conn=0 stream=1 body=0")
            yield client, upstreams, relays.outcomes
        nursery.cancel_scope.cancel()


def warm_then(action: str, then: str = "answer") -> Script:
    """Answer the warm-up stream, ``action`` the next one on that connection, ``then`` the rest."""
    return lambda seen: "answer" if seen.sid == 1 and seen.conn == 0 else action if seen.conn == 0 else then


@pytest.mark.parametrize("refusal", ["refuse", "goaway"])
async def test_a_refused_spliced_request_is_retried(nursery: trio.Nursery, refusal: str) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, warm_then(refusal))
        async with hop_to(server) as (client, upstreams, relays):
            result = await client.request(client.head(b"GET", b"/"))
            assert (result.status, result.body, result.reset) == (200, b"conn=1 stream=1 body=0", None)
            assert relays == [False, True]  # the warm-up took the handler path, this one was spliced
            assert server.where() == [(0, 1, "answered"), (0, 3, "refused"), (1, 1, "answered")]
            assert pool_statistics(upstreams)[2] == 1


async def test_a_refused_spliced_upload_is_replayed_on_the_new_stream(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, warm_then("refuse"))
        server.hold_settings.add(1)  # the retry's connection is not ready until the body has come
        async with hop_to(server) as (client, upstreams, relays):
            assert pool_statistics(upstreams)[2] == 0
            sid = await client.start(client.head(b"POST", b"/upload"), end_stream=False)
            await wait_for(lambda: len(server.seen) == 2 and server.seen[1].refused)
            await wait_for(lambda: len(server.connections) == 2, "the hop connects again")
            await client.send(sid, b"hello", end_stream=True)  # reaches the hop while its retry waits
            await trio.sleep(0.05)  # (only so that it usually does: the result is the same either way)
            server.settings_released.set()
            result = await client.collect(sid)
            assert (result.status, result.body) == (200, b"conn=1 stream=1 body=5")
            assert [(seen.conn, seen.body, seen.ended) for seen in server.seen[1:]] == [
                (0, b"", False),
                (1, b"hello", True),
            ]
            assert relays == [False, True]


async def test_a_spliced_upload_that_started_is_not_retried(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, warm_then("refuse-on-data"))
        async with hop_to(server) as (client, upstreams, relays):
            result = await client.request(client.head(b"POST", b"/upload"), b"abc")
            assert result.status == 503  # refused, as on the awaiting path
            assert server.where() == [(0, 1, "answered"), (0, 3, "refused")]
            assert relays == [False, True]
            assert pool_statistics(upstreams)[2] == 0


async def test_a_second_spliced_refusal_is_answered(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        server = await start_upstream(nursery, warm_then("refuse", then="refuse"))
        async with hop_to(server) as (client, upstreams, relays):
            result = await client.request(client.head(b"GET", b"/"))
            assert result.status == 503
            assert relays == [False, True]
            assert server.where() == [(0, 1, "answered"), (0, 3, "refused"), (1, 1, "refused")]
            assert pool_statistics(upstreams)[2] == 1
            # The same again: the hop and its pool are unharmed.
            again = await client.request(client.head(b"GET", b"/"))
            assert again.status == 503
            assert server.where()[3:] == [(0, 5, "refused"), (1, 3, "refused")]


# -- outlier ejection (sans-IO) ------------------------------------------------------------------

WORKER = ("127.0.0.1", 1)


def replicas(n: int) -> list[Replica]:
    return [Replica(name=f"r{i}", worker=WORKER, address=("127.0.0.1", 1000 + i)) for i in range(n)]


def fail(detector: OutlierDetector, replica: Replica, now: float, times: int) -> list[bool]:
    return [detector.record(replica, False, now) for _ in range(times)]


def test_outlier_config_defaults_and_validation() -> None:
    config = OutlierConfig()
    assert (
        config.consecutive_failures,
        config.consecutive_unreachable,
        config.base_ejection,
        config.max_ejection,
        config.panic_threshold,
        config.slow_start_window,
    ) == (5, 1, 1.0, 10.0, 0.5, 2.0)
    for bad in [
        {"consecutive_failures": 0},
        {"consecutive_unreachable": 0},
        {"base_ejection": 0},
        {"base_ejection": math.inf},
        {"max_ejection": math.nan},
        {"base_ejection": 60.0, "max_ejection": 30.0},
        {"panic_threshold": -0.1},
        {"panic_threshold": 1.5},
        {"slow_start_window": -1.0},
        {"slow_start_aggression": 0.0},
        {"slow_start_min_weight": 0.0},
    ]:
        with pytest.raises(ValueError):
            OutlierConfig(**bad)  # type: ignore[arg-type]


SLOW = OutlierConfig(base_ejection=30.0, max_ejection=300.0, slow_start_window=0.0)  # round numbers for the mechanics


def test_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    detector = OutlierDetector(SLOW)
    a, b, c = replicas(3)
    assert fail(detector, a, 0.0, 4) == [False] * 4
    assert detector.record(a, True, 1.0) is False  # a success: counting starts over
    assert fail(detector, a, 2.0, 4) == [False] * 4
    assert not detector.ejected(a, 2.0)
    assert detector.record(a, False, 2.0) is True  # the fifth in a row
    assert detector.ejected(a, 2.0) and detector.ejected(a, 31.9) and not detector.ejected(a, 32.0)
    assert detector.selectable([a, b, c], 10.0) == [b, c]
    assert detector.statistics() == OutlierStatistics(
        ejected={"r0": 32.0}, failures={}, ejections=1, by_replica={"r0": 1}
    )


def test_selection_is_untouched_while_nothing_is_ejected() -> None:
    detector = OutlierDetector(SLOW)
    candidates = replicas(3)
    assert detector.selectable(candidates, 0.0) is candidates
    fail(detector, candidates[0], 0.0, 4)
    assert detector.selectable(candidates, 0.0) is candidates
    fail(detector, candidates[0], 0.0, 1)
    assert detector.selectable(candidates, 1.0) == candidates[1:]
    # Once the ejection is over, the one-check fast path is back.
    assert detector.selectable(candidates, 30.0) is candidates


def test_outcomes_while_ejected_are_ignored() -> None:
    detector = OutlierDetector(attrs.evolve(SLOW, consecutive_failures=2))
    (a,) = replicas(1)
    fail(detector, a, 0.0, 2)
    # Requests that were in flight when it was ejected: neither extend nor end it.
    assert fail(detector, a, 1.0, 10) == [False] * 10
    assert detector.record(a, True, 2.0) is False
    assert detector.ejected(a, 29.0)
    assert detector.statistics(now=29.0).ejected == {"r0": 30.0}
    assert detector.statistics(now=30.0).ejected == {}
    # Back in selection, counting from zero.
    assert detector.record(a, False, 30.0) is False
    assert detector.record(a, False, 30.0) is True


def test_one_unreachable_failure_ejects_at_once_and_5xx_need_their_count() -> None:
    """A dead replica fails fast, so least in-flight would keep picking it: its first
    connect failure takes it out; a replica answering 5xx needs consecutive_failures."""
    detector = OutlierDetector(OutlierConfig(slow_start_window=0.0))
    a, b = replicas(2)
    for _ in range(4):
        assert detector.record(a, False, 0.0) is False
    assert detector.record(b, False, 0.0, unreachable=True) is True
    assert detector.selectable([a, b], 0.5) == [a]
    assert detector.selectable([a, b], 1.0) == [a, b]  # back after base_ejection: 1 s


def test_repeated_ejections_double_up_to_the_cap_then_start_over() -> None:
    config = OutlierConfig(consecutive_failures=1, base_ejection=30.0, max_ejection=300.0, slow_start_window=0.0)
    detector = OutlierDetector(config)
    (a,) = replicas(1)
    now = 0.0
    lengths = []
    for _ in range(6):
        assert detector.record(a, False, now) is True
        end = detector.statistics().ejected["r0"]
        lengths.append(end - now)
        now = end  # fails again as soon as it is back
    assert lengths == [30.0, 60.0, 120.0, 240.0, 300.0, 300.0]
    # In selection for max_ejection after the last one ended: the next starts from the base again.
    assert detector.record(a, False, now + 300.0) is True
    assert detector.statistics().ejected["r0"] == now + 300.0 + 30.0
    assert detector.statistics().ejections == 7


def test_below_the_panic_threshold_every_replica_is_selectable() -> None:
    detector = OutlierDetector(attrs.evolve(SLOW, consecutive_failures=1))
    four = replicas(4)
    for i, replica in enumerate(four):
        detector.record(replica, False, float(i))  # ejected until 30, 31, 32, 33
    assert all(detector.ejected(replica, 10.0) for replica in four)
    # All four out: fewer than half would be left, so the pool panics and offers all of them.
    assert detector.selectable(four, 10.0) is four
    assert detector.selectable(four[:1], 10.0) == four[:1]  # an app of one never loses it
    # As ejections end, the rest comes back; ejection applies again once half are healthy.
    assert detector.selectable(four, 30.5) is four  # one healthy of four: panic
    assert detector.selectable(four, 31.5) == four[:2]  # two of four: r2 and r3 out
    assert detector.selectable(four, 32.5) == four[:3]
    assert detector.selectable(four, 33.0) is four
    assert detector.statistics().panics == 3


def test_panic_threshold_at_the_edges() -> None:
    four = replicas(4)
    never = OutlierDetector(attrs.evolve(SLOW, consecutive_failures=1, panic_threshold=0.0))
    always = OutlierDetector(attrs.evolve(SLOW, consecutive_failures=1, panic_threshold=1.0))
    for detector in (never, always):
        for replica in four[1:]:
            detector.record(replica, False, 0.0)
    assert never.selectable(four, 1.0) == four[:1]  # 0: ejection holds while one is left
    assert always.selectable(four, 1.0) is four  # 1: any ejection panics
    never.record(four[0], False, 0.0)
    assert never.selectable(four, 1.0) is four  # none left: every one is offered


events = st.lists(
    st.tuples(st.integers(0, 7), st.booleans(), st.floats(0, 120, allow_nan=False)),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 8),
    threshold_share=st.floats(0, 1),
    threshold=st.integers(1, 4),
    base=st.floats(0.5, 60),
    script=events,
)
def test_selection_ejects_only_above_the_panic_threshold_and_keeps_one(
    n: int, threshold_share: float, threshold: int, base: float, script: list[tuple[int, bool, float]]
) -> None:
    config = OutlierConfig(
        consecutive_failures=threshold,
        base_ejection=base,
        max_ejection=base * 8,
        panic_threshold=threshold_share,
        slow_start_window=0.0,
    )
    detector = OutlierDetector(config)
    candidates = replicas(n)
    now = 0.0
    for index, ok, step in script:
        now += step
        detector.record(candidates[index % n], ok, now)
        selected = list(detector.selectable(candidates, now))
        left_out = [replica for replica in candidates if replica not in selected]
        assert selected, "at least one replica stays selectable"
        assert selected == [replica for replica in candidates if replica in selected]  # table order
        ejected = [replica for replica in candidates if detector.ejected(replica, now)]
        healthy = n - len(ejected)
        if healthy == 0 or healthy < threshold_share * n - 1e-9:
            assert left_out == []  # panic
        else:
            assert left_out == ejected


# -- outlier ejection, wired into the proxy ---------------------------------------------------------


async def two_replica_chain(
    nursery: trio.Nursery, local: dict[str, LocalReplica], outliers: OutlierConfig | None = DEFAULT
) -> tuple[HTTPServer, Proxy]:
    """edge -> proxy (``outliers``: serve_proxy's default unless given) -> one worker -> ``local``, all under ``*``."""
    worker_server, _ = await nursery.start(functools.partial(serve_worker, local))
    worker = (HOST, worker_server.port)
    table = RouteTable.build(
        {"*": "app"}, {"app": [Replica(name=n, worker=worker, address=r.address) for n, r in local.items()]}
    )
    options = {} if outliers is DEFAULT else {"outliers": outliers}
    proxy_server, proxy = await nursery.start(functools.partial(serve_proxy, table, **options))
    edge = await nursery.start(serve_edge, EdgeConfig(proxy=(HOST, proxy_server.port)))
    return edge, proxy


@pytest.mark.parametrize("ejection", ["default", "off"])
async def test_a_request_that_reached_no_replica_goes_to_another_once(nursery: trio.Nursery, ejection: str) -> None:
    """One of two replicas refuses connections: every request succeeds on the other (the
    proxy sends it again once). With ejection (the default), the dead one is out after its
    first failure; without, least in-flight keeps picking it and every pick is retried."""
    with trio.fail_after(20):
        live, _, live_local = await serve_tenant_replica(nursery)
        local = {"live": live_local, "dead": LocalReplica((HOST, closed_port()), "h2")}
        edge, proxy = await two_replica_chain(nursery, local, DEFAULT if ejection == "default" else None)
        async with httpx.AsyncClient(http2=True, http1=False, trust_env=False) as client:
            statuses = [(await client.get(f"http://{HOST}:{edge.port}/")).status_code for _ in range(30)]
        assert statuses == [200] * 30
        assert len(live.arrivals) == 30
        retried = proxy.statistics().retried
        assert retried >= 1
        if ejection == "default":
            assert proxy.outliers is not None and proxy.outliers.statistics().ejections >= 1
        else:
            assert proxy.outliers is None
        assert proxy.statistics().in_flight == {"live": 0, "dead": 0}


async def test_two_unreachable_replicas_are_one_retry_then_a_502(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        local = {name: LocalReplica((HOST, closed_port()), "h2") for name in ("dead-a", "dead-b")}
        edge, proxy = await two_replica_chain(nursery, local, None)
        async with httpx.AsyncClient(http2=True, http1=False, trust_env=False) as client:
            for n in range(1, 4):
                response = await client.get(f"http://{HOST}:{edge.port}/")
                assert response.status_code == 502
                assert response.headers["proxyblocks-error"].startswith("replica_unreachable; hop=worker; replica=")
                assert list(parse_server_timing(response.headers["server-timing"])) == [
                    "app",
                    "worker",
                    "proxy-route",
                    "proxy",
                    "edge",
                    "total",
                ]
                assert proxy.statistics().retried == n  # one retry each, never a loop
        assert proxy.statistics().in_flight == {"dead-a": 0, "dead-b": 0}


async def test_killing_one_of_two_replicas_mid_load_fails_only_what_was_in_flight(nursery: trio.Nursery) -> None:
    """400 requests, 8 at a time; replica b is killed (its listener and connections gone)
    a quarter of the way and started again on its port halfway. Only requests in flight
    on b at the kill may fail; once back, b gets traffic again within seconds."""
    concurrency, total = 8, 400
    b = TenantReplica()

    async def run_b(port: int, task_status: trio.TaskStatus[tuple[trio.CancelScope, HTTPServer]]) -> None:
        with trio.CancelScope() as scope:
            await serve_http(
                b, host=HOST, port=port, config=ListenerConfig(), task_status=_Reporting(scope, task_status)
            )

    with trio.fail_after(60):
        _, _, a_local = await serve_tenant_replica(nursery)
        scope, b_server = await nursery.start(run_b, 0)
        port = b_server.port
        edge, proxy = await two_replica_chain(nursery, {"a": a_local, "b": LocalReplica((HOST, port), "h2")})
        statuses: list[int] = []
        done = 0
        killed = trio.Event()
        restarted = trio.Event()
        async with httpx.AsyncClient(http2=True, http1=False, trust_env=False) as client:

            async def load(tasks: list[int]) -> None:
                nonlocal done
                for _ in tasks:
                    statuses.append((await client.get(f"http://{HOST}:{edge.port}/")).status_code)
                    done += 1
                    if done == total // 4:
                        killed.set()
                    if done == total // 2:
                        restarted.set()

            async def chaos() -> None:
                await killed.wait()
                scope.cancel()
                await restarted.wait()
                await nursery.start(run_b, port)

            async with trio.open_nursery() as clients:
                clients.start_soon(chaos)
                for k in range(concurrency):
                    clients.start_soon(load, list(range(k, total, concurrency)))
            assert len(statuses) == total
            errors = total - statuses.count(200)
            assert errors <= concurrency, statuses
            # Back in service: b answers again, within a few seconds of ejection.
            before = len(b.arrivals)
            while len(b.arrivals) == before:
                assert (await client.get(f"http://{HOST}:{edge.port}/")).status_code == 200
        assert proxy.outliers is not None and proxy.outliers.statistics().ejections >= 1


class _Reporting:
    """A task_status that reports ``(scope, server)``: the scope kills the replica."""

    def __init__(self, scope: trio.CancelScope, status: trio.TaskStatus[tuple[trio.CancelScope, HTTPServer]]) -> None:
        self.scope = scope
        self.status = status

    def started(self, server: HTTPServer) -> None:
        self.status.started((self.scope, server))
