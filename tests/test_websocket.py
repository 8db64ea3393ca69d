"""WebSockets across the chain: h1 Upgrade at the edge, RFC 8441 extended CONNECT on the h2 hops.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``, real
clients (trio-websocket, a raw h2 client speaking WebSocket frames through
wsproto) and real replicas: trio-websocket's own ``serve_websocket``
(reached by the worker over an h1 Upgrade) and a blocks listener serving
``open_websocket_app`` (reached over h2 extended CONNECT). No timing
assertions: every bound is a liveness bound, far above a normal wait.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

import attrs
import h2.events
import h2.settings
import httpx
import hyperframe.frame
import pytest
import trio
import trio_websocket
import wsproto.connection
import wsproto.events
from support import (
    HOST,
    RawFrames,
    RawH2Client,
    assemble,
    assemble_local,
    raw_exchange,
    record_relays,
)
from support import (
    connect_websocket as connect,
)

from blocks import (
    INTERNAL_LISTENER,
    Chain,
    EdgeConfig,
    HTTPServer,
    ListenerConfig,
    LocalReplica,
    Replica,
    RouteTable,
    UpstreamConfig,
    WebSocketConfig,
    serve_edge,
    serve_http,
    serve_proxy,
    serve_websocket_app,
    serve_worker,
    text_response,
)
from blocks.testing import serve_demo_replica, websocket_echo
from blocks.transport._h2 import BACKLOG_HIGH, H2Driver
from blocks.websocket import open_websocket_app

MiB = 1 << 20
KEY = b"dGhlIHNhbXBsZSBub25jZQ=="  # RFC 6455's sample key
ACCEPT = b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


@attrs.define
class Closes:
    """What a replica saw of its WebSockets' ends."""

    reasons: list[trio_websocket.CloseReason] = attrs.field(factory=list)
    gone: trio.Event = attrs.field(factory=trio.Event)


def recording_echo(closes: Closes) -> Any:
    """The demo echo handler, recording how each WebSocket ended on the replica's side."""

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        connection: list[trio_websocket.WebSocketConnection] = []
        original = request.accept

        async def accept(**kwargs: Any) -> trio_websocket.WebSocketConnection:
            ws = await original(**kwargs)
            connection.append(ws)
            return ws

        request.accept = accept  # type: ignore[method-assign]
        try:
            await websocket_echo(request)
        finally:
            if connection and connection[0].closed is not None:
                closes.reasons.append(connection[0].closed)
                closes.gone.set()

    return handler


@attrs.define
class WsChain:
    chain: Chain
    kind: str  # "h1": trio-websocket's server behind an h1 Upgrade; "h2": a blocks replica behind extended CONNECT
    closes: Closes
    replica_scope: trio.CancelScope

    @property
    def port(self) -> int:
        return self.chain.port


async def _serve_trio_websocket(closes: Closes, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                functools.partial(trio_websocket.serve_websocket, recording_echo(closes), HOST, 0, ssl_context=None)
            )
            task_status.started((server.port, scope))


async def _serve_blocks_replica(
    closes: Closes, listener: ListenerConfig | None = None, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            server: HTTPServer = await nursery.start(
                functools.partial(
                    serve_websocket_app, recording_echo(closes), _hello, listener=listener or ListenerConfig()
                )
            )
            task_status.started((server.port, scope))


async def _hello(request: Any) -> Any:
    return text_response(200, f"hello {request.path.decode()}\n")


async def ws_chain(
    nursery: trio.Nursery, kind: str, *, worker_upstream: UpstreamConfig | None = None, listener: Any = None
) -> WsChain:
    closes = Closes()
    if kind == "h1":
        port, scope = await nursery.start(_serve_trio_websocket, closes)
    else:
        port, scope = await nursery.start(_serve_blocks_replica, closes, listener)
    chain = await assemble_local(
        nursery, {"replica": LocalReplica((HOST, port), kind)}, worker_upstream=worker_upstream
    )
    return WsChain(chain, kind, closes, scope)


@pytest.fixture(params=["h1", "h2"])
async def wsc(request: pytest.FixtureRequest, nursery: trio.Nursery) -> AsyncIterator[WsChain]:
    with trio.fail_after(10):
        started = await ws_chain(nursery, request.param)
    yield started
    nursery.cancel_scope.cancel()


# -- messages, subprotocols, closes --------------------------------------------------------------


async def test_text_and_binary_messages_both_ways(wsc: WsChain) -> None:
    with trio.fail_after(20):
        async with connect(wsc.port) as ws:
            for message in ["hello", b"\x00\x01binary\xff", "ünïcode ✓", b""]:
                await ws.send_message(message)
                assert await ws.get_message() == message
            big = bytes(range(256)) * (MiB // 256)  # 1 MiB, the default message cap
            await ws.send_message(big)
            assert await ws.get_message() == big
            text = "x" * MiB
            await ws.send_message(text)
            assert await ws.get_message() == text


async def test_subprotocol_negotiation_passes_through(wsc: WsChain) -> None:
    with trio.fail_after(10):
        async with connect(wsc.port, subprotocols=["chat.v2", "chat.v1"]) as ws:
            assert ws.subprotocol == "chat.v2"  # the replica takes the first one proposed
            await ws.send_message("x")
            assert await ws.get_message() == "x"
        async with connect(wsc.port) as ws:
            assert ws.subprotocol is None


async def test_the_replica_closes_with_a_code_and_reason(wsc: WsChain) -> None:
    with trio.fail_after(10):
        async with connect(wsc.port) as ws:
            await ws.send_message("close 4001 going away now")
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()
        assert closed.value.reason.code == 4001
        assert closed.value.reason.reason == "going away now"
        await wsc.closes.gone.wait()
        assert wsc.closes.reasons[0].code == 4001


async def test_the_client_closes_with_a_code_and_reason(wsc: WsChain) -> None:
    with trio.fail_after(10):
        async with connect(wsc.port) as ws:
            await ws.send_message("ping")
            assert await ws.get_message() == "ping"
            await ws.aclose(4002, "client says bye")
        await wsc.closes.gone.wait()
    reason = wsc.closes.reasons[0]
    assert (reason.code, reason.reason) == (4002, "client says bye")


# -- refusals and failures -------------------------------------------------------------------------


async def test_a_refusing_replica_gives_its_status(wsc: WsChain) -> None:
    with trio.fail_after(10):
        with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
            async with connect(wsc.port, "/reject/403"):
                pass
        assert rejected.value.status_code == 403
        assert rejected.value.body == b"refused with 403\n"
        # The chain is fine: the next WebSocket is accepted.
        async with connect(wsc.port) as ws:
            await ws.send_message("after")
            assert await ws.get_message() == "after"


@pytest.mark.parametrize("kind", ["h1", "h2"])
async def test_a_replica_that_never_answers_the_upgrade_is_a_504(nursery: trio.Nursery, kind: str) -> None:
    with trio.fail_after(10):
        wsc = await ws_chain(nursery, kind, worker_upstream=UpstreamConfig(response_timeout=0.5))
        with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
            async with connect(wsc.port, "/silent"):
                pass
        assert rejected.value.status_code == 504
        async with connect(wsc.port) as ws:
            await ws.send_message("still fine")
            assert await ws.get_message() == "still fine"
    nursery.cancel_scope.cancel()


async def test_a_replica_that_dies_mid_connection_closes_the_client(wsc: WsChain) -> None:
    with trio.fail_after(10):
        async with connect(wsc.port) as ws:
            await ws.send_message("alive")
            assert await ws.get_message() == "alive"
            wsc.replica_scope.cancel()  # the replica's process goes away: its sockets close
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                while True:
                    await ws.get_message()
        assert closed.value.reason.code == 1006  # abnormal: no close frame, the connection just ended
        # Ordinary requests through the same edge still work (to a replica that is gone: a clean 502).
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.get(f"http://{HOST}:{wsc.port}/")
        assert response.status_code == 502


async def test_an_h2_replica_without_extended_connect_is_a_502(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        wsc = await ws_chain(nursery, "h2", listener=ListenerConfig(enable_connect_protocol=False))
        with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
            async with connect(wsc.port):
                pass
        assert rejected.value.status_code == 502
        async with httpx.AsyncClient(trust_env=False) as client:
            response = await client.get(f"http://{HOST}:{wsc.port}/page")
        assert response.text == "hello /page\n"  # the same replica serves its pages
    nursery.cancel_scope.cancel()


# -- bad handshakes at the edge ------------------------------------------------------------------


def upgrade(method: str = "GET", version: str = "13", key: bytes = KEY, extra: str = "") -> bytes:
    return (
        f"{method} /chat HTTP/1.1\r\nhost: app.test\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        f"sec-websocket-version: {version}\r\nsec-websocket-key: {key.decode()}\r\n{extra}\r\n"
    ).encode()


async def test_an_h1_upgrade_gets_101_with_the_right_accept(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        wsc = await ws_chain(nursery, "h2")
        stream = await trio.open_tcp_stream(HOST, wsc.port)
        async with stream:
            await stream.send_all(upgrade(extra="sec-websocket-protocol: p1, p2\r\n"))
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some(65536)
        lines = head.split(b"\r\n\r\n")[0].split(b"\r\n")
        assert lines[0] == b"HTTP/1.1 101 Switching Protocols"
        fields = {name.lower(): value.strip() for name, _, value in (line.partition(b":") for line in lines[1:])}
        assert fields[b"sec-websocket-accept"] == ACCEPT
        assert fields[b"upgrade"].lower() == b"websocket"
        assert fields[b"sec-websocket-protocol"] == b"p1"
        assert b"server-timing" in fields
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        pytest.param(upgrade(version="8"), b"426", id="wrong-version"),
        pytest.param(upgrade(version=""), b"426", id="no-version"),
        pytest.param(upgrade(key=b"not base64!"), b"400", id="bad-key"),
        pytest.param(upgrade(key=b"c2hvcnQ="), b"400", id="short-key"),
        pytest.param(upgrade(method="POST"), b"400", id="post"),
        pytest.param(upgrade(method="POST", extra="content-length: 0\r\n"), b"400", id="post-empty-body"),
        pytest.param(upgrade().replace(b"connection: Upgrade", b"connection: keep-alive"), b"400", id="no-connection"),
        pytest.param(upgrade().replace(b"HTTP/1.1", b"HTTP/1.0"), b"400", id="http-1.0"),
    ],
)
async def test_bad_h1_handshakes_at_the_edge(nursery: trio.Nursery, request_bytes: bytes, status: bytes) -> None:
    with trio.fail_after(10):
        wsc = await ws_chain(nursery, "h2")
        async with connect(wsc.port) as good:  # a WebSocket beside them never notices
            reply = await raw_exchange(wsc.port, request_bytes)
            assert reply.split(b"\r\n")[0].split(b" ")[1] == status, reply
            if status == b"426":
                assert b"sec-websocket-version: 13\r\n" in reply
            assert wsc.chain.worker.statistics().served == {"replica": 1}  # only the good one got through
            await good.send_message("unharmed")
            assert await good.get_message() == "unharmed"
    nursery.cancel_scope.cancel()


async def test_other_upgrades_are_ordinary_requests_then_a_websocket_upgrades(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        wsc = await ws_chain(nursery, "h2")
        h2c = b"GET /x HTTP/1.1\r\nhost: a\r\nupgrade: h2c\r\nconnection: Upgrade, HTTP2-Settings\r\n\r\n"
        stream = await trio.open_tcp_stream(HOST, wsc.port)
        async with stream:
            await stream.send_all(h2c + b"GET /y HTTP/1.1\r\nhost: a\r\n\r\n" + upgrade())
            reply = b""
            while b"HTTP/1.1 101 " not in reply:
                reply += await stream.receive_some(65536)
            # The WebSocket speaks at once on the kept-alive connection.
            ws = wsproto.connection.Connection(wsproto.connection.ConnectionType.CLIENT)
            await stream.send_all(ws.send(wsproto.events.TextMessage("third")))
            while not (events := list(ws.events())):
                ws.receive_data(await stream.receive_some(65536))
        assert reply.count(b"HTTP/1.1 200 OK") == 2, reply
        assert b"hello /x\n" in reply and b"hello /y\n" in reply
        assert isinstance(events[0], wsproto.events.TextMessage) and events[0].data == "third"
    nursery.cancel_scope.cancel()


# -- h2 clients: extended CONNECT straight to the edge --------------------------------------------


class H2WebSocket:
    """A WebSocket over one extended CONNECT stream of a RawH2Client, framed by wsproto."""

    def __init__(self, client: RawH2Client, sid: int) -> None:
        self.client = client
        self.sid = sid
        self.ws = wsproto.connection.Connection(wsproto.connection.ConnectionType.CLIENT)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    @classmethod
    async def open(cls, client: RawH2Client, path: bytes = b"/chat", *extra: tuple[bytes, bytes]) -> H2WebSocket:
        head = [
            (b":method", b"CONNECT"),
            (b":protocol", b"websocket"),
            (b":scheme", b"http"),
            (b":authority", client.authority),
            (b":path", path),
            (b"sec-websocket-version", b"13"),
            *extra,
        ]
        sid = await client.start(head, end_stream=False)
        self = cls(client, sid)
        event = await client.next_event(sid)
        assert isinstance(event, h2.events.ResponseReceived), event
        for name, value in event.headers:
            if name == b":status":
                self.status = int(value)
            else:
                self.headers.append((name, value))
        return self

    async def send(self, message: str | bytes) -> None:
        event: Any = (
            wsproto.events.TextMessage(message) if isinstance(message, str) else wsproto.events.BytesMessage(message)
        )
        data = self.ws.send(event)
        for i in range(0, len(data), 16384):  # one DATA frame each (the tests stay within the windows)
            await self.client.send(self.sid, data[i : i + 16384])

    async def receive(self) -> Any:
        while True:
            for event in self.ws.events():
                return event
            h2_event = await self.client.next_event(self.sid)
            if isinstance(h2_event, h2.events.DataReceived):
                if h2_event.data:  # (an empty DATA can carry the END_STREAM after the close)
                    self.ws.receive_data(h2_event.data)
            elif isinstance(h2_event, h2.events.StreamEnded | h2.events.StreamReset):
                return h2_event


async def test_extended_connect_straight_to_the_edge_spliced_on_every_hop(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        wsc = await ws_chain(nursery, "h2")
        relays = [record_relays(server) for server in (wsc.chain.edge, wsc.chain.proxy_server, wsc.chain.worker_server)]
        async with RawH2Client.open(wsc.port) as client:
            warm = await client.request(client.head(b"GET", b"/warm"))  # opens the pooled connections
            assert warm.status == 200
            assert client.conn.remote_settings.enable_connect_protocol == 1  # the edge's SETTINGS said so
            ws = await H2WebSocket.open(client, b"/chat", (b"sec-websocket-protocol", b"v9"))
            assert ws.status == 200
            assert (b"sec-websocket-protocol", b"v9") in ws.headers
            await ws.send("over h2")
            event = await ws.receive()
            assert isinstance(event, wsproto.events.TextMessage) and event.data == "over h2"
            await ws.send(b"\x00" * 100_000)  # more than one frame, and more than one window's worth per hop
            got = b""
            while len(got) < 100_000:
                event = await ws.receive()
                assert isinstance(event, wsproto.events.BytesMessage)
                got += event.data
            assert got == b"\x00" * 100_000
            await client.send(ws.sid, ws.ws.send(wsproto.events.CloseConnection(code=4003, reason="h2 bye")))
            event = await ws.receive()
            assert isinstance(event, wsproto.events.CloseConnection) and event.code == 4003
            assert isinstance(await ws.receive(), h2.events.StreamEnded)
        await wsc.closes.gone.wait()
        assert wsc.closes.reasons[0].code == 4003
        # Each hop's fast path carried the extended CONNECT as it is (the warm-up request went first).
        assert [log.outcomes[-1] for log in relays] == [True, True, True]
    nursery.cancel_scope.cancel()


async def test_bad_extended_connects_are_errors_of_their_stream_alone(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        wsc = await ws_chain(nursery, "h2", worker_upstream=UpstreamConfig(response_timeout=0.5))
        async with RawH2Client.open(wsc.port) as client:
            good = await H2WebSocket.open(client)
            assert good.status == 200
            connect = [(b":method", b"CONNECT"), (b":scheme", b"http"), (b":authority", client.authority)]
            cases = [
                ([*connect, (b":path", b"/c"), (b":protocol", b"websocket"), (b"sec-websocket-version", b"8")], 426),
                ([*connect, (b":path", b"/c"), (b":protocol", b"websocket")], 426),  # no version
                ([(b":method", b"CONNECT"), (b":authority", client.authority)], 501),  # plain CONNECT
                (
                    [
                        (b":method", b"CONNECT"),
                        (b":scheme", b"http"),
                        (b":path", b"/c"),
                        (b":protocol", b"websocket"),
                        (b"host", b"a"),
                        (b"sec-websocket-version", b"13"),
                    ],
                    400,
                ),  # no :authority
                ([*connect, (b":protocol", b"websocket"), (b"sec-websocket-version", b"13")], 400),  # no :path
                ([*client.head(b"GET", b"/")[:4], (b":protocol", b"websocket")], 400),  # :protocol on a GET
                ([*connect, (b":path", b"/c"), (b":protocol", b"a b"), (b"sec-websocket-version", b"13")], 400),
            ]
            for head, status in cases:
                result = await client.request(head)
                assert result.status == status, (head, result)
                if status == 426:
                    assert result.header(b"sec-websocket-version") == b"13"
            refused = await H2WebSocket.open(client, b"/reject/403")
            assert refused.status == 403
            silent = await H2WebSocket.open(client, b"/silent")
            assert silent.status == 504
            page = await client.request(client.head(b"GET", b"/page"))
            assert page.status == 200 and page.body == b"hello /page\n"
            await good.send("still here")
            event = await good.receive()
            assert isinstance(event, wsproto.events.TextMessage) and event.data == "still here"
            assert client.terminated is None
    nursery.cancel_scope.cancel()


# -- many at once, beside ordinary requests --------------------------------------------------------


async def test_50_websockets_beside_ordinary_requests_on_pooled_connections(wsc: WsChain) -> None:
    done: list[int] = []

    async def one(i: int) -> None:
        async with connect(wsc.port, f"/ws/{i}") as ws:
            for j in range(5):
                await ws.send_message(f"{i}:{j}")
                assert await ws.get_message() == f"{i}:{j}"
                await trio.sleep(0.01)
            await ws.send_message(bytes([i]) * 50_000)
            assert await ws.get_message() == bytes([i]) * 50_000
        done.append(i)

    async def requests(client: httpx.AsyncClient) -> None:
        for i in range(40):
            response = await client.get(f"http://{HOST}:{wsc.port}/page/{i}")
            if wsc.kind == "h2":
                assert response.text == f"hello /page/{i}\n"
            else:  # trio-websocket's own server: a page request is its 400, from across the chain
                assert response.status_code == 400
                assert "server-timing" in response.headers

    with trio.fail_after(30):
        async with (
            httpx.AsyncClient(http2=True, http1=False, trust_env=False) as client,
            trio.open_nursery() as inner,
        ):
            for i in range(50):
                inner.start_soon(one, i)
            inner.start_soon(requests, client)
    assert sorted(done) == list(range(50))
    # The edge's 50 clients shared a few pooled h2 connections to the proxy, and so on down.
    assert wsc.chain.proxy_server.statistics().accepted <= 3
    assert wsc.chain.worker_server.statistics().accepted <= 3
    assert wsc.chain.worker.statistics().in_flight == {"replica": 0}


# -- timeouts and flow control ----------------------------------------------------------------------


QUICK = {"stall_timeout": 0.3, "h2_idle_timeout": 0.3, "drain_goaway_delay": 0.01}


async def quick_chain(nursery: trio.Nursery) -> tuple[int, Closes]:
    """edge -> proxy -> worker -> blocks replica, every h2 listener with 0.3 s stall and idle timeouts."""
    closes = Closes()
    port, _ = await nursery.start(_serve_blocks_replica, closes, ListenerConfig(**QUICK))
    internal = attrs.evolve(INTERNAL_LISTENER, **QUICK)
    worker_server, _ = await nursery.start(
        functools.partial(serve_worker, {"r": LocalReplica((HOST, port))}, listener=internal)
    )
    replica = Replica(name="r", worker=(HOST, worker_server.port), address=(HOST, port))
    table = RouteTable.build({"*": "app"}, {"app": [replica]})
    proxy_server, _ = await nursery.start(functools.partial(serve_proxy, table, listener=internal))
    edge = await nursery.start(
        functools.partial(serve_edge, EdgeConfig(proxy=(HOST, proxy_server.port)), listener=ListenerConfig(**QUICK))
    )
    return edge.port, closes


async def test_a_quiet_websocket_outlives_the_idle_and_stall_timeouts(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        port, _ = await quick_chain(nursery)
        async with connect(port) as h1_ws, RawH2Client.open(port) as client:
            h2_ws = await H2WebSocket.open(client)
            await trio.sleep(1.5)  # five times every timeout, with nothing sent anywhere
            await h1_ws.send_message("still open")
            assert await h1_ws.get_message() == "still open"
            await h2_ws.send("still open")
            event = await h2_ws.receive()
            assert isinstance(event, wsproto.events.TextMessage) and event.data == "still open"
    nursery.cancel_scope.cancel()


async def test_a_websocket_whose_window_stays_shut_is_reset_by_the_stall_timeout(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        port, _ = await quick_chain(nursery)
        window = h2.settings.SettingCodes.INITIAL_WINDOW_SIZE
        async with RawFrames.open(port, settings={window: 0}) as raw:
            head = raw.block(
                b"/chat", (b":protocol", b"websocket"), (b"sec-websocket-version", b"13"), method=b"CONNECT"
            )
            ws = wsproto.connection.Connection(wsproto.connection.ConnectionType.CLIENT)
            await raw.send(
                hyperframe.frame.HeadersFrame(1, head, flags=["END_HEADERS"]),
                hyperframe.frame.DataFrame(1, ws.send(wsproto.events.TextMessage("echo me"))),
            )
            # The echo cannot come back (our window is 0): the edge resets the stream once stalled.
            reset = await raw.until(lambda f: isinstance(f, hyperframe.frame.RstStreamFrame) and f.stream_id == 1)
            assert reset is not None
            assert raw.status(1) == b"200"
            # The connection itself is fine: another stream gets its head.
            await raw.send(raw.request(3, b"/page"))
            await raw.until(lambda f: isinstance(f, hyperframe.frame.HeadersFrame) and f.stream_id == 3)
            assert raw.status(3) == b"200"
    nursery.cancel_scope.cancel()


def _h2_buffered(server: HTTPServer) -> tuple[int, int]:
    """Bytes an h2 hop holds for its streams: (the most any spliced pipe holds, the most any writer holds)."""
    pipes = backlog = 0
    for connection in server._connections:
        driver = connection.proto
        if not isinstance(driver, H2Driver):
            continue
        backlog = max(backlog, driver.backlog)
        for st in driver.streams.values():
            splice = st.splice
            if splice is not None and hasattr(splice, "request"):
                for pipe in (splice.request, splice.response):
                    pipes = max(pipes, sum(map(len, pipe.pending)))
                backlog = max(backlog, splice.up.backlog)
    return pipes, backlog


async def test_a_client_that_stops_reading_holds_bounded_memory(nursery: trio.Nursery) -> None:
    """Back-pressure end to end: the replica's echo fills the way back, then the way in closes."""
    with trio.fail_after(30):
        wsc = await ws_chain(nursery, "h2")
        async with connect(wsc.port) as warm:  # opens every pooled connection: the next WebSocket is spliced
            await warm.send_message("warm")
            assert await warm.get_message() == "warm"
        stream = await trio.open_tcp_stream(HOST, wsc.port)
        async with stream:
            await stream.send_all(upgrade())
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some(1)
            assert head.startswith(b"HTTP/1.1 101 ")
            ws = wsproto.connection.Connection(wsproto.connection.ConnectionType.CLIENT)
            frame = ws.send(wsproto.events.BytesMessage(b"\xab" * 65536))
            sent = 0
            cap = 512 * MiB
            while sent < cap:  # send until sending blocks for a second: everything is full
                with trio.move_on_after(1.0) as blocked:
                    await stream.send_all(frame)
                if blocked.cancelled_caught:
                    break
                sent += 65536
            assert sent < cap, "nothing ever pushed back"
            for hop in (wsc.chain.edge, wsc.chain.proxy_server, wsc.chain.worker_server):
                pipes, backlog = _h2_buffered(hop)
                assert pipes <= 256 * 1024, (hop, pipes)  # at most one stream window per direction
                assert backlog <= BACKLOG_HIGH + 256 * 1024, (hop, backlog)
            # Reading again, every byte comes back: nothing was dropped on the way.
            received = 0
            reader = wsproto.connection.Connection(wsproto.connection.ConnectionType.CLIENT)
            while received < sent:
                reader.receive_data(await stream.receive_some(65536))
                for event in reader.events():
                    if isinstance(event, wsproto.events.BytesMessage):
                        received += len(event.data)
            assert received >= sent  # (the frame cut by the blocked send may have gone too)
    nursery.cancel_scope.cancel()


# -- the app block alone ---------------------------------------------------------------------------------


async def test_one_port_serves_pages_and_websockets_over_h1_and_h2(nursery: trio.Nursery) -> None:
    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        if request.path == "/boom":
            raise RuntimeError("a bug in the app")
        if request.path == "/nothing":
            return  # neither accepts nor rejects
        ws = await request.accept()
        await ws.send_message(f"{request.path} {dict(request.headers).get(b'x-seen', b'-').decode()}")

    with trio.fail_after(10):
        async with open_websocket_app(handler, _hello, config=WebSocketConfig(send_buffer=1024)) as app:
            server = await nursery.start(functools.partial(serve_http, app))
            async with connect(server.port, "/a", extra_headers=[(b"x-seen", b"yes")]) as ws:
                assert await ws.get_message() == "/a yes"
            async with RawH2Client.open(server.port) as client:
                h2_ws = await H2WebSocket.open(client, b"/b")
                event = await h2_ws.receive()
                assert isinstance(event, wsproto.events.TextMessage) and event.data == "/b -"
                page = await client.request(client.head(b"GET", b"/page"))
                assert page.body == b"hello /page\n"
                for path in (b"/boom", b"/nothing"):
                    failed = await H2WebSocket.open(client, path)
                    assert failed.status == 500
            for path in ("/boom", "/nothing"):
                with pytest.raises(trio_websocket.ConnectionRejected) as rejected:
                    async with connect(server.port, path):
                        pass
                assert rejected.value.status_code == 500
            async with connect(server.port, "/c") as ws:  # the app's server outlived its handler's bug
                assert await ws.get_message() == "/c -"
            stats = app.statistics()
            assert (stats.accepted, stats.refused) == (3, 4)  # /a, /b, /c; /boom and /nothing twice
        nursery.cancel_scope.cancel()


async def test_the_demo_replica_serves_websockets_through_the_chain(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery)
        async with connect(chain.port, subprotocols=["demo"]) as ws:
            assert ws.subprotocol == "demo"
            await ws.send_message("demo")
            assert await ws.get_message() == "demo"
        response = await raw_exchange(chain.port, b"GET / HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n")
        assert b"hello from replica-0" in response
    nursery.cancel_scope.cancel()


async def test_the_demo_replica_itself_is_reachable_over_h1_upgrade(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        server = await nursery.start(serve_demo_replica, "r")
        async with connect(server.port) as ws:
            await ws.send_message(b"direct")
            assert await ws.get_message() == b"direct"
    nursery.cancel_scope.cancel()
