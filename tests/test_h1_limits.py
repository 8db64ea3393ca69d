"""HTTP/1.1 limits at a listener: the header clock, the idle clock, the field count, the body limit,
the target's length, the stall clock of a response, and the authority of a request without Host.

- A head must be complete within ``h1_header_timeout`` of its first byte
  (of the connection's start for the first one): a slowloris gets 408.
- A kept-alive connection waits ``h1_idle_timeout`` for the next head and
  then just closes: no 408 for a quiet connection.
- More than ``max_header_count`` fields: 431.
- A body over ``max_request_body``: 413 before the handler runs when the
  length is declared; when a chunked body crosses it, the body raises
  ``PayloadTooLarge`` and nobody downstream sees more than the limit.
- A target over ``max_target``: 414 at the edge (an h2 ``:path`` too, on its
  stream alone), and a head the edge takes fits every hop behind it.
- A response write that makes no progress for ``stall_timeout``: the
  connection ends and the replica's stream is cancelled; a client that
  keeps reading, however slowly, is not cut.
- HTTP/1.0 without ``Host``: the listener's own address, or
  ``default_authority``; HTTP/1.1 without one stays 400.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``. The
clocks are real, with short timeouts; every bound set here is far above the
timeout under test, and no assertion is on speed.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import AsyncIterator

import attrs
import h2.events
import h11
import hyperframe.frame as hf
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from support import HOST, RawFrames, RawH2Client, assemble, assemble_local, wait_for
from test_smuggling import RecordingReplica, exchange, start_recording_replica

from blocks import (
    INTERNAL_LISTENER,
    BlocksError,
    Chain,
    EdgeConfig,
    HTTPServer,
    IterBody,
    ListenerConfig,
    LocalReplica,
    PayloadTooLarge,
    Request,
    Response,
    serve_edge,
    serve_http,
    text_response,
)
from blocks.transport._h1 import H1Stream
from blocks.transport._h1server import _request_from
from blocks.transport._validate import validate_request_head

LIMIT = 1024


@attrs.define(eq=False)
class Handler:
    """Reads each request's whole body, records what it got, answers ``200 <length>``."""

    paths: list[bytes] = attrs.field(factory=list)
    received: list[int] = attrs.field(factory=list)  # body bytes each request delivered
    errors: list[BaseException] = attrs.field(factory=list)

    async def __call__(self, request: Request) -> Response:
        self.paths.append(request.path)
        size = 0
        try:
            while chunk := await request.body.receive():
                size += len(chunk)
        except Exception as exc:
            self.errors.append(exc)
            raise
        finally:
            self.received.append(size)
        return text_response(200, f"{size}")


async def start(nursery: trio.Nursery, **config: float) -> tuple[Handler, HTTPServer]:
    handler = Handler()
    server = await nursery.start(functools.partial(serve_http, handler, config=ListenerConfig(**config)))
    return handler, server


async def read_to_close(stream: trio.SocketStream) -> bytes:
    received = bytearray()
    while data := await stream.receive_some(65536):
        received += data
    return bytes(received)


def status_of(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply
    return int(reply[9:12])


GET = b"GET / HTTP/1.1\r\nhost: a.test\r\n\r\n"


async def get_on(stream: trio.SocketStream) -> bytes:
    """One keep-alive GET on ``stream``; the response (the handler's body is its length, 1 byte)."""
    await stream.send_all(GET)
    received = b""
    while not (received.endswith(b"\r\n\r\n0") and b"content-length: 1\r\n" in received):
        data = await stream.receive_some(65536)
        assert data, received
        received += data
    return received


# -- the header clock (slowloris) and the idle clock ------------------------------------------------


async def test_a_head_dribbled_past_the_header_timeout_gets_408(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, h1_header_timeout=0.5)
        stream = await trio.open_tcp_stream(HOST, server.port)
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: a.test\r\n")
            # A byte at a time keeps the connection busy but never finishes the head.
            reply = b""
            while not reply:
                try:
                    await stream.send_all(b"x")
                except trio.BrokenResourceError:
                    break
                with trio.move_on_after(0.05):
                    reply = await stream.receive_some(65536)
            reply += await read_to_close(stream)
    assert status_of(reply) == 408
    assert b"connection: close" in reply.lower()
    assert handler.paths == []


async def test_the_first_head_is_on_the_header_clock_from_the_start(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, h1_header_timeout=0.5)
        stream = await trio.open_tcp_stream(HOST, server.port)
        async with stream:
            await stream.send_all(b"G")
            reply = await read_to_close(stream)
    assert status_of(reply) == 408
    assert handler.paths == []


async def test_a_later_head_is_on_the_header_clock_from_its_first_byte(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, h1_header_timeout=0.5, h1_idle_timeout=30.0)
        stream = await trio.open_tcp_stream(HOST, server.port)
        async with stream:
            assert status_of(await get_on(stream)) == 200
            await stream.send_all(b"GET /2 HTTP/1.1\r\nhost: a.test\r\n")
            reply = await read_to_close(stream)
    assert status_of(reply) == 408
    assert handler.paths == [b"/"]


async def test_a_keep_alive_wait_is_on_the_idle_clock_not_the_header_clock(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, h1_header_timeout=0.2, h1_idle_timeout=30.0)
        stream = await trio.open_tcp_stream(HOST, server.port)
        async with stream:
            assert status_of(await get_on(stream)) == 200
            await trio.sleep(1.0)  # five header timeouts, well within the idle one
            assert status_of(await get_on(stream)) == 200
    assert handler.paths == [b"/", b"/"]
    assert server.statistics().accepted == 1


async def test_an_idle_keep_alive_connection_closes_without_408(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, h1_header_timeout=5.0, h1_idle_timeout=0.3)
        stream = await trio.open_tcp_stream(HOST, server.port)
        async with stream:
            assert status_of(await get_on(stream)) == 200
            assert await read_to_close(stream) == b""  # closed, and nothing said
    assert handler.paths == [b"/"]


# -- the header-field count -----------------------------------------------------------------------


def fields(n: int) -> bytes:
    return b"".join(b"x-f%d: v\r\n" % i for i in range(n))


async def test_h1_more_fields_than_the_cap_get_431(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, max_header_count=10)
        at_cap = await exchange(
            server.port, b"GET /10 HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n" + fields(8) + b"\r\n"
        )
        assert at_cap.status == 200  # host, connection and 8 more: 10 fields
        over = await exchange(
            server.port, b"GET /11 HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n" + fields(9) + b"\r\n"
        )
        assert over.status == 431
        assert over.replies[0].header(b"connection") == b"close"
        assert over.replies[0].body == b"431 Request Header Fields Too Large\n"
    assert handler.paths == [b"/10"]


async def test_h1_too_many_fields_get_431_at_the_chain_edge(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery)
        head = b"GET / HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n"
        over = await exchange(chain.port, head + fields(ListenerConfig().max_header_count - 1) + b"\r\n")
        assert over.status == 431
        ok = await exchange(chain.port, head + fields(50) + b"\r\n")
        assert ok.status == 200
    assert chain.worker.statistics().served == {"replica-0": 1}


async def test_h2_too_many_fields_get_431_on_their_stream_at_the_chain_edge(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery)
        async with RawH2Client.open(chain.port) as client:
            extra = [(b"x-f%d" % i, b"v") for i in range(ListenerConfig().max_header_count + 1)]
            over = await client.request(client.head(b"GET", b"/", *extra))
            assert not over.connection_lost
            assert over.status == 431
            ok = await client.request(client.head(b"GET", b"/", *extra[:50]))
            assert ok.status == 200
    assert chain.worker.statistics().served == {"replica-0": 1}


# -- the body limit -------------------------------------------------------------------------------


def chunked(*sizes: int) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (size, b"x" * size) for size in sizes) + b"0\r\n\r\n"


POST = b"POST /up HTTP/1.1\r\nhost: a.test\r\n"


@pytest.mark.parametrize("expect", [b"", b"expect: 100-continue\r\n"])
async def test_a_declared_body_over_the_limit_gets_413_before_the_handler(nursery: trio.Nursery, expect: bytes) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, max_request_body=LIMIT)
        stream = await trio.open_tcp_stream(HOST, server.port)
        async with stream:
            await stream.send_all(POST + expect + b"content-length: %d\r\n\r\n" % (LIMIT + 1))
            reply = await read_to_close(stream)
    assert status_of(reply) == 413  # first: no "100 Continue" before it
    assert b"connection: close" in reply.lower()
    assert reply.count(b"HTTP/1.1 ") == 1
    assert handler.paths == []


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"content-length: %d\r\n\r\n%s" % (LIMIT, b"x" * LIMIT), id="declared"),
        pytest.param(b"transfer-encoding: chunked\r\n\r\n" + chunked(LIMIT // 2, LIMIT // 2), id="chunked"),
    ],
)
async def test_a_body_exactly_at_the_limit_passes(nursery: trio.Nursery, body: bytes) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, max_request_body=LIMIT)
        result = await exchange(server.port, POST + b"connection: close\r\n" + body)
        assert result.status == 200
        assert result.replies[0].body == b"%d" % LIMIT
    assert handler.received == [LIMIT]
    assert handler.errors == []


async def test_a_chunked_body_crossing_the_limit_raises_in_the_handler_and_gets_413(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        handler, server = await start(nursery, max_request_body=LIMIT)
        body = b"transfer-encoding: chunked\r\n\r\n" + chunked(600, 600, 600)
        result = await exchange(server.port, POST + body)
        assert result.status == 413
        assert result.replies[0].header(b"connection") == b"close"
        assert result.after == b""
    assert handler.received[0] <= LIMIT
    assert [type(error) for error in handler.errors] == [type(handler.errors[0])]
    assert isinstance(handler.errors[0], PayloadTooLarge)
    assert handler.errors[0].status == 413


# -- the body limit at a chain's edge, with an h1 replica behind it ----------------------------------


async def limited_chain(nursery: trio.Nursery) -> tuple[Chain, int, RecordingReplica]:
    """A recording h1 replica behind a chain, plus a second edge with ``max_request_body=LIMIT``; its port."""
    replica, local = await start_recording_replica(nursery)
    chain = await assemble_local(nursery, {"r": local})
    edge = await nursery.start(
        functools.partial(
            serve_edge,
            EdgeConfig(proxy=(HOST, chain.proxy_server.port)),
            listener=ListenerConfig(max_request_body=LIMIT),
        )
    )
    return chain, edge.port, replica


async def test_the_replica_never_sees_more_than_the_edge_limit(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain, port, replica = await limited_chain(nursery)
        declared = await exchange(port, POST + b"content-length: %d\r\n\r\n" % (LIMIT + 1))
        assert declared.status == 413
        assert chain.worker.statistics().served == {"r": 0}  # refused before anything went upstream

        streamed = await exchange(port, POST + b"transfer-encoding: chunked\r\n\r\n" + chunked(600, 600, 600))
        assert streamed.status == 413
        assert streamed.replies[0].header(b"connection") == b"close"

        exact = await exchange(
            port, POST + b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + chunked(LIMIT // 2, LIMIT // 2)
        )
        assert exact.status == 200
    # The cut upload's head may or may not have reached the replica before its reset did.
    cut = [seen for seen in replica.seen if not seen.complete]
    assert len(cut) <= 1
    assert all(len(seen.body) <= LIMIT for seen in cut)
    assert [seen.body for seen in replica.seen if seen.complete] == [b"x" * LIMIT]
    assert replica.broken == 0


async def test_a_body_that_trickles_past_request_body_timeout_gets_408(nursery: trio.Nursery) -> None:
    """One byte every 0.2 s of a declared 100 with ``request_body_timeout=1``: 408 and a close;
    the handler saw fewer than the 100 bytes and no end."""
    with trio.fail_after(10):
        handler, server = await start(nursery, request_body_timeout=1.0)
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            await stream.send_all(b"POST / HTTP/1.1\r\nhost: a.test\r\ncontent-length: 100\r\n\r\n")
            started = trio.current_time()
            async with trio.open_nursery() as trickle:

                async def one_byte_at_a_time() -> None:
                    for _ in range(100):
                        try:
                            await stream.send_all(b"x")
                        except trio.BrokenResourceError:
                            return
                        await trio.sleep(0.2)

                trickle.start_soon(one_byte_at_a_time)
                reply = await read_to_close(stream)
                trickle.cancel_scope.cancel()
        assert status_of(reply) == 408
        assert trio.current_time() - started >= 1.0
        assert handler.received and handler.received[0] < 100


# -- the target's length ---------------------------------------------------------------------------

MAX_TARGET = ListenerConfig().max_target


def h1_get(target: bytes, *more: bytes) -> bytes:
    return b"GET %s HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n%s\r\n" % (target, b"".join(more))


def long_target(length: int) -> bytes:
    """A target of ``length`` bytes that the demo replica answers (its path is ``/``)."""
    return b"/?q=" + b"a" * (length - 4)


async def stream_tokens(port: int, done: list[bytes], *, task_status: trio.TaskStatus[None]) -> None:
    """Another client's token stream on the chain (h2), started once its head came; its body, once it ended."""
    async with RawH2Client.open(port) as client:
        sid = await client.start(client.head(b"GET", b"/stream?n=4&ms=150"))
        assert isinstance(await client.next_event(sid), h2.events.ResponseReceived)
        task_status.started()
        result = await client.collect(sid)
        assert result.reset is None and not result.connection_lost, result
        done.append(result.body)


@pytest.mark.parametrize(
    "length",
    [
        pytest.param(MAX_TARGET + 1, id="one-over"),
        pytest.param(100_000, id="100KB"),  # past h11's buffer only in parts: the 503 it got further on
        pytest.param(300_000, id="300KB"),  # h11 gives up inside the request line
    ],
)
async def test_an_h1_target_over_max_target_gets_414_at_the_chain_edge(nursery: trio.Nursery, length: int) -> None:
    with trio.fail_after(15):
        chain = await assemble(nursery)
        tokens: list[bytes] = []
        async with trio.open_nursery() as others:
            await others.start(stream_tokens, chain.port, tokens)
            over = await exchange(chain.port, h1_get(long_target(length)))
            assert over.status == 414
            assert over.replies[0].header(b"connection") == b"close"
            assert over.replies[0].header(b"proxyblocks-error") == b"bad_request; hop=edge"
            at_limit = await exchange(chain.port, h1_get(long_target(MAX_TARGET)))
            assert at_limit.status == 200
            assert at_limit.replies[0].body == b"hello from replica-0\n"
    assert tokens and tokens[0].count(b"token") == 4, tokens  # the other client noticed nothing
    assert chain.worker.statistics().served == {"replica-0": 2}  # the tokens and the one at the limit


async def test_an_h2_path_over_max_target_gets_414_on_its_stream_and_the_connection_goes_on(
    nursery: trio.Nursery,
) -> None:
    """RFC 9113 leaves the answer to a request the server will not take to HTTP: a 414 on that
    stream, no RST_STREAM and no GOAWAY; the same connection's next streams are served."""
    with trio.fail_after(15):
        chain = await assemble(nursery)
        async with RawFrames.open(chain.port) as raw:

            def request(sid: int, path: bytes) -> list[hf.Frame]:
                block = raw.block(path)  # over one frame (16 KiB): HEADERS, then CONTINUATION
                return [
                    hf.HeadersFrame(sid, block[:16000], flags=["END_STREAM"]),
                    hf.ContinuationFrame(sid, block[16000:], flags=["END_HEADERS"]),
                ]

            frames: list[hf.Frame] = []

            async def until_ended(sid: int) -> None:
                def ended(frame: hf.Frame) -> bool:
                    frames.append(frame)
                    return "END_STREAM" in frame.flags and frame.stream_id == sid

                assert await raw.until(ended) is not None, f"the connection closed before stream {sid} ended"

            await raw.send(*request(1, long_target(MAX_TARGET + 1)), *request(3, long_target(MAX_TARGET)))
            await until_ended(1)
            await until_ended(3)
            await raw.send(raw.request(5, b"/"))
            await until_ended(5)
            assert not [f for f in frames if isinstance(f, hf.RstStreamFrame | hf.GoAwayFrame)], frames
            assert raw.status(1) == b"414"
            assert raw.heads[1][b"proxyblocks-error"] == b"bad_request; hop=edge"
            assert raw.status(3) == b"200"
            assert raw.status(5) == b"200"
    assert chain.worker.statistics().served == {"replica-0": 2}


def h1_event(data: bytes, config: ListenerConfig) -> tuple[h11.Request, H1Stream]:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=config.max_header_list_size)
    conn.receive_data(data)
    event = conn.next_event()
    assert type(event) is h11.Request
    return event, H1Stream(None, conn)  # type: ignore[arg-type]  # (a bodiless request reads nothing)


def as_h2_counts(request: Request) -> int:
    """The request's head as the edge sends it on over h2, counted as RFC 7541 does."""
    pseudo = [(b":method", request.method), (b":scheme", request.scheme), (b":authority", request.authority)]
    return sum(len(n) + len(v) + 32 for n, v in [*pseudo, (b":path", request.path), *request.headers])


CONFIG = ListenerConfig(max_header_list_size=4096, max_target=2048)
sizes = st.integers(min_value=1, max_value=3 * CONFIG.max_target)
value_sizes = st.lists(st.integers(min_value=0, max_value=CONFIG.max_header_list_size), max_size=4)


@settings(max_examples=300, deadline=None)
@given(target=sizes, values=value_sizes)
def test_h1_a_target_is_414_past_max_target_and_what_passes_fits_the_hops(target: int, values: list[int]) -> None:
    """Whatever the target's and the fields' sizes: 414 exactly when the target is over
    ``max_target``; a head taken fits, as h2 carries it on, within the edge's header-list cap
    (and the pseudo-headers' few bytes), so within ``INTERNAL_LISTENER``'s by far."""
    path = long_target(target) if target >= 4 else b"/" * target
    data = h1_get(path, *(b"x-f%d: %s\r\n" % (i, b"v" * n) for i, n in enumerate(values)))
    try:
        request = _request_from(*h1_event(data, CONFIG), "c", b"http", CONFIG)
    except BlocksError as exc:
        assert (exc.status == 414) == (target > CONFIG.max_target), exc
        assert exc.status in (414, 431)
        return
    assert target <= CONFIG.max_target
    assert as_h2_counts(request) <= CONFIG.max_header_list_size + 128
    assert CONFIG.max_header_list_size + 128 + 4096 < INTERNAL_LISTENER.max_header_list_size


@settings(max_examples=300, deadline=None)
@given(target=sizes, values=value_sizes)
def test_h2_a_path_is_414_past_max_target_whatever_else_is_over(target: int, values: list[int]) -> None:
    """On h2 too, and even in a head over the size cap: the answer names the target."""
    path = long_target(target) if target >= 4 else b"/" * target
    raw = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"a.test"), (b":path", path)]
    raw += [(b"x-f%d" % i, b"v" * n) for i, n in enumerate(values)]
    request = Request(b"", b"", b"", b"")
    try:
        validate_request_head(
            request, raw, CONFIG.max_header_list_size, CONFIG.max_header_count, max_target=CONFIG.max_target
        )
    except BlocksError as exc:
        assert (exc.status == 414) == (target > CONFIG.max_target), exc
        assert exc.status in (414, 431)
        return
    assert target <= CONFIG.max_target
    assert request.path == path


# -- the stall clock of a response ------------------------------------------------------------------

STALL = 1.0
CHUNK = b"x" * 65536
CHUNKS = 1024  # 64 MiB: far more than every buffer between the replica and the client holds


@attrs.define(eq=False)
class Streamer:
    """A replica: ``/big`` streams 64 MiB and notes whether the chain cancelled it; anything else is ``ok``."""

    cancelled: trio.Event = attrs.field(factory=trio.Event)
    yielded: int = 0

    async def __call__(self, request: Request) -> Response:
        if request.path != b"/big":
            return text_response(200, "ok\n")

        async def chunks() -> AsyncIterator[bytes]:
            try:
                for _ in range(CHUNKS):
                    yield CHUNK
                    self.yielded += 1
            except BaseException:
                self.cancelled.set()
                raise

        return Response(200, [], IterBody(chunks()))


async def stalling_edge(nursery: trio.Nursery) -> tuple[Streamer, HTTPServer]:
    """A :class:`Streamer` behind a chain, and an edge in front of it with ``stall_timeout=STALL``."""
    streamer = Streamer()
    replica = await nursery.start(functools.partial(serve_http, streamer))
    chain = await assemble_local(nursery, {"r0": LocalReplica((HOST, replica.port), "h2")})
    edge: HTTPServer = await nursery.start(
        functools.partial(
            serve_edge,
            EdgeConfig(proxy=(HOST, chain.proxy_server.port)),
            listener=ListenerConfig(stall_timeout=STALL),
        )
    )
    return streamer, edge


async def open_small_window(port: int) -> trio.SocketStream:
    """A client connection with a small receive buffer (4 KiB, set before connecting)."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((HOST, port))
    return trio.SocketStream(sock)


BIG = b"GET /big HTTP/1.1\r\nhost: a.test\r\n\r\n"


async def test_an_h1_client_that_stops_reading_is_cut_and_the_replica_stream_cancelled(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(20):
        streamer, edge = await stalling_edge(nursery)
        async with await open_small_window(edge.port) as stream:
            await stream.send_all(BIG)
            asked = trio.current_time()
            await streamer.cancelled.wait()  # through edge, proxy and worker: the replica's stream
            assert trio.current_time() - asked >= STALL
            await wait_for(lambda: edge.statistics().connections == 0, "the edge still holds the connection")
            reply = await read_to_close(stream)  # what the buffers held, then the end
        assert status_of(reply) == 200
        assert not reply.endswith(b"\r\n0\r\n\r\n"), "the body was cut: no last chunk"
        assert streamer.yielded < CHUNKS
        ok = await exchange(edge.port, b"GET / HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n\r\n")
        assert ok.status == 200  # nothing else noticed


async def test_an_h1_client_that_keeps_reading_is_not_cut(nursery: trio.Nursery) -> None:
    """A reader that takes its response in small bites for three times ``stall_timeout`` keeps it;
    once it stops, it is cut."""
    with trio.fail_after(30):
        streamer, edge = await stalling_edge(nursery)
        async with await trio.open_tcp_stream(HOST, edge.port) as stream:
            await stream.send_all(BIG)
            reading = trio.current_time()
            received = 0
            while trio.current_time() - reading < 3 * STALL:
                data = await stream.receive_some(65536)
                assert data, f"cut after {received} bytes"
                received += len(data)
                await trio.sleep(0.02)  # the pace of a slow reader
            assert not streamer.cancelled.is_set()
            assert edge.statistics().connections == 1
            await streamer.cancelled.wait()  # it stopped reading: now it is cut
            await wait_for(lambda: edge.statistics().connections == 0, "the edge still holds the connection")
        assert streamer.yielded < CHUNKS


async def big_answer(request: Request) -> Response:
    return text_response(200, "x" * (16 * 1024 * 1024))  # one write, far more than the buffers hold


async def test_a_client_that_does_not_read_a_big_answer_is_cut(nursery: trio.Nursery) -> None:
    """The first write stalls (the deadline keeps its time; a long stream's is a watchdog's, above)."""
    with trio.fail_after(20):
        server: HTTPServer = await nursery.start(
            functools.partial(serve_http, big_answer, config=ListenerConfig(stall_timeout=STALL))
        )
        async with await open_small_window(server.port) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: a.test\r\n\r\n")
            asked = trio.current_time()
            await wait_for(lambda: server.statistics().accepted == 1, "the listener never took the connection")
            await wait_for(lambda: server.statistics().connections == 0, "the listener still holds the connection")
            assert trio.current_time() - asked >= STALL
            reply = await read_to_close(stream)
        assert status_of(reply) == 200
        assert len(reply) < 16 * 1024 * 1024


@attrs.define(eq=False)
class Quiet:
    """Streams ``first``, then nothing until ``go`` is set, then ``last``."""

    go: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first\n"
            await self.go.wait()
            yield b"last\n"

        return Response(200, [], IterBody(chunks()))


async def test_a_response_that_is_quiet_for_longer_than_stall_timeout_is_not_cut(nursery: trio.Nursery) -> None:
    """The stall clock runs only while a write waits: a body with nothing to send (an event
    stream between events) keeps its connection however long it is quiet."""
    with trio.fail_after(10):
        quiet = Quiet()
        server: HTTPServer = await nursery.start(
            functools.partial(serve_http, quiet, config=ListenerConfig(stall_timeout=0.2))
        )
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n\r\n")
            reply = b""
            while b"first" not in reply:
                reply += await stream.receive_some(65536)
            await trio.sleep(1.0)  # five stall timeouts without a byte to send
            quiet.go.set()
            reply += await read_to_close(stream)
        assert reply.endswith(b"first\n\r\n5\r\nlast\n\r\n0\r\n\r\n")


# -- HTTP/1.0 without Host ---------------------------------------------------------------------------


@attrs.define(eq=False)
class Authorities:
    """Answers ``200`` with the request's authority, and keeps them."""

    seen: list[bytes] = attrs.field(factory=list)

    async def __call__(self, request: Request) -> Response:
        self.seen.append(request.authority)
        return text_response(200, request.authority.decode())


@pytest.mark.parametrize(
    ("default", "expected"),
    [pytest.param(None, None, id="its-address"), pytest.param("Site.Test:8080", b"site.test:8080", id="configured")],
)
async def test_http10_without_host_gets_the_default_authority(
    nursery: trio.Nursery, default: str | None, expected: bytes | None
) -> None:
    with trio.fail_after(10):
        handler = Authorities()
        server: HTTPServer = await nursery.start(
            functools.partial(serve_http, handler, config=ListenerConfig(default_authority=default))
        )
        expected = expected or f"{HOST}:{server.port}".encode()
        reply = await exchange(server.port, b"GET / HTTP/1.0\r\n\r\n")
        assert reply.status == 200
        assert reply.replies[0].body == expected
        named = await exchange(server.port, b"GET / HTTP/1.0\r\nhost: named.test\r\n\r\n")
        assert named.replies[0].body == b"named.test"  # a Host, when there is one, wins
        for refused in [
            b"GET / HTTP/1.1\r\n\r\n",  # HTTP/1.1 must send Host (RFC 9112 3.2)
            b"GET / HTTP/1.1\r\nhost:\r\n\r\n",
            b"GET http:///x HTTP/1.0\r\n\r\n",  # an http URI with an empty host (RFC 9110 4.2.1)
        ]:
            result = await exchange(server.port, refused)
            assert result.status == 400, refused
            assert result.replies[0].header(b"connection") == b"close"
    assert handler.seen == [expected, b"named.test"]


def test_default_authority_must_be_a_plain_authority() -> None:
    assert ListenerConfig(default_authority="a.test").default_authority == "a.test"
    for bad in ["user@a.test", "a.test/x", "a b", "a.test:1:2", "", "é.test"]:
        with pytest.raises(ValueError, match="default_authority"):
            ListenerConfig(default_authority=bad)


async def test_http10_without_host_is_routed_through_the_chain(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery)  # routes "*": any authority, the edge's own address too
        reply = await exchange(chain.port, b"GET / HTTP/1.0\r\n\r\n")
        assert reply.status == 200
        assert reply.replies[0].body == b"hello from replica-0\n"
        assert (await exchange(chain.port, b"GET / HTTP/1.1\r\n\r\n")).status == 400
    assert chain.worker.statistics().served == {"replica-0": 1}
