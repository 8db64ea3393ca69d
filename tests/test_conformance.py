"""HTTP/2 conformance of the edge (RFC 9113, RFC 7541), section by section in the manner of h2spec.

The client here is raw frames (``hyperframe``) and HPACK (``hpack``), never
``h2.H2Connection``, which refuses to send the bad frames these tests need.
Each test names the MUST it checks. Where the RFC lets the server choose
(a stream error, or a connection error of the same code: RFC 9113 5.4.1 lets
any stream error be escalated), both are accepted and the comment says which
the RFC demands, except for malformed requests (8.1.1): those must be the
stream error, RST_STREAM(PROTOCOL_ERROR), and the connection must go on
(``expect_malformed``).

A connection error is a GOAWAY with the expected code followed by the
connection closing; a connection that just closes fails, except after an
invalid preface (RFC 9113 3.4 lets the GOAWAY be omitted there).

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``,
the full chain recipe behind the edge.
"""

from __future__ import annotations

import functools
import string
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import hpack
import hypothesis
import pytest
import trio
from h2.errors import ErrorCodes
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from support import closed_port, wait_for

from blocks import EdgeConfig, Exchange, Feature, Forward, serve_edge
from recipes.chain import Chain

HOST = "127.0.0.1"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
Headers = list[tuple[bytes, bytes]]

# Frame types (RFC 9113 6) and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
UNKNOWN_TYPE = 0xFA
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# Settings identifiers (RFC 9113 6.5.2).
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 2, 3, 4, 5

MAX_WINDOW = 2**31 - 1
DEFAULT_MAX_FRAME_SIZE = 16384

E = ErrorCodes


def frame(type_: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """Any frame, byte for byte: nothing here checks that it makes sense."""
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", type_, flags, stream_id) + payload


def settings(*pairs: tuple[int, int], flags: int = 0, stream_id: int = 0) -> bytes:
    return frame(SETTINGS, flags, stream_id, b"".join(struct.pack(">HI", k, v) for k, v in pairs))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def priority(stream_id: int, depends_on: int = 0, weight: int = 15) -> bytes:
    return frame(PRIORITY, 0, stream_id, struct.pack(">IB", depends_on, weight))


def ping(payload: bytes = b"confrmnc", *, flags: int = 0, stream_id: int = 0) -> bytes:
    return frame(PING, flags, stream_id, payload)


def rst(stream_id: int, code: int = E.CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, struct.pack(">I", code))


# -- the raw client ---------------------------------------------------------------------------


@attrs.define
class Incoming:
    """One frame from the server; a HEADERS frame carries its whole decoded block (CONTINUATIONs folded in)."""

    frame: Any
    headers: Headers | None = None


@attrs.define
class Response:
    status: int
    headers: Headers
    body: bytes
    reset: int | None = None  # the RST_STREAM code, if the stream was reset


class Conn:
    """A raw HTTP/2 connection to the edge: bytes out, frames in, one HPACK context each way."""

    def __init__(self, stream: trio.SocketStream, port: int) -> None:
        self.stream = stream
        self.authority = f"{HOST}:{port}".encode()
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.server_settings: dict[int, int] = {}
        self._buffer = bytearray()
        self._next_stream_id = 1

    # -- sending

    async def send(self, *chunks: bytes) -> None:
        await self.stream.send_all(b"".join(chunks))

    def next_stream_id(self) -> int:
        sid = self._next_stream_id
        self._next_stream_id += 2
        return sid

    def head(self, method: bytes = b"GET", path: bytes = b"/", *extra: tuple[bytes, bytes]) -> Headers:
        return [(b":method", method), (b":scheme", b"http"), (b":authority", self.authority), (b":path", path), *extra]

    def block(self, headers: Headers, *, huffman: bool = False) -> bytes:
        return bytes(self.encoder.encode(headers, huffman=huffman))

    def headers(self, stream_id: int, headers: Headers, *, end_stream: bool = True, end_headers: bool = True) -> bytes:
        flags = (END_STREAM if end_stream else 0) | (END_HEADERS if end_headers else 0)
        return frame(HEADERS, flags, stream_id, self.block(headers))

    async def request(self, headers: Headers | None = None, *, end_stream: bool = True) -> int:
        """Open a stream with one HEADERS frame; returns its id."""
        sid = self.next_stream_id()
        await self.send(self.headers(sid, headers or self.head(), end_stream=end_stream))
        return sid

    # -- receiving

    async def _read_exactly(self, n: int) -> bytes | None:
        while len(self._buffer) < n:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                return None
            self._buffer += data
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    async def _raw_frame(self) -> Any:
        header = await self._read_exactly(9)
        if header is None:
            return None
        f, length = Frame.parse_frame_header(memoryview(header))
        body = await self._read_exactly(length)
        assert body is not None, "the connection closed in the middle of a frame"
        f.parse_body(memoryview(body))
        return f

    async def next_frame(self) -> Incoming | None:
        """The server's next frame, or None once the connection is closed."""
        f = await self._raw_frame()
        if f is None:
            return None
        if isinstance(f, SettingsFrame) and "ACK" not in f.flags:
            self.server_settings.update(f.settings)
        if not isinstance(f, HeadersFrame):
            return Incoming(f)
        block = bytes(f.data)
        while "END_HEADERS" not in f.flags:
            f = await self._raw_frame()
            assert f is not None, "the connection closed in the middle of a header block"
            block += bytes(f.data)
        return Incoming(f, list(self.decoder.decode(block, raw=True)))

    async def handshake(self) -> None:
        """Preface and SETTINGS both ways, each side's SETTINGS acknowledged (as h2spec does)."""
        await self.send(PREFACE, settings())
        seen_settings = seen_ack = False
        while not (seen_settings and seen_ack):
            incoming = await self.next_frame()
            assert incoming is not None, "the edge closed the connection during the handshake"
            f = incoming.frame
            if isinstance(f, SettingsFrame):
                if "ACK" in f.flags:
                    seen_ack = True
                else:
                    seen_settings = True
                    await self.send(settings(flags=ACK))


@asynccontextmanager
async def open_conn(chain: Chain, *, handshake: bool = True) -> AsyncIterator[Conn]:
    stream = await trio.open_tcp_stream(HOST, chain.edge.port)
    async with stream:
        conn = Conn(stream, chain.edge.port)
        if handshake:
            await conn.handshake()
        yield conn


@pytest.fixture
async def conn(chain: Chain) -> AsyncIterator[Conn]:
    """A connection to the edge, past the handshake."""
    async with open_conn(chain, handshake=False) as opened:
        with trio.fail_after(10):
            await opened.handshake()
        yield opened


# -- expectations -----------------------------------------------------------------------------


def _names(codes: tuple[int, ...]) -> str:
    return " or ".join(E(c).name for c in codes)


def _describe(f: Any) -> str:
    if isinstance(f, GoAwayFrame):
        return f"GOAWAY({_code(f.error_code)}, last_stream_id={f.last_stream_id})"
    if isinstance(f, RstStreamFrame):
        return f"RST_STREAM(stream {f.stream_id}, {_code(f.error_code)})"
    return repr(f)


def _code(code: int) -> str:
    try:
        return E(code).name
    except ValueError:
        return hex(code)


async def expect_closed(conn: Conn) -> None:
    """Read (and drop) frames until the server closes the connection."""
    while await conn.next_frame() is not None:
        pass


async def expect_goaway(conn: Conn, *codes: int) -> Any:
    """A connection error: GOAWAY with one of ``codes``, then the connection closes."""
    while True:
        incoming = await conn.next_frame()
        if incoming is None:
            pytest.fail(f"the connection closed without a GOAWAY; expected GOAWAY({_names(codes)})")
        f = incoming.frame
        if isinstance(f, GoAwayFrame):
            assert f.error_code in codes, f"got {_describe(f)}, expected GOAWAY({_names(codes)})"
            await expect_closed(conn)
            return f
        if isinstance(f, RstStreamFrame) and f.error_code in codes:
            pytest.fail(f"got {_describe(f)}, a stream error where the RFC demands GOAWAY({_names(codes)})")


async def expect_rst(conn: Conn, stream_id: int, *codes: int) -> str:
    """A stream error: RST_STREAM(one of ``codes``) on ``stream_id``, or a connection error with one of
    ``codes`` instead (RFC 9113 5.4.1). Returns ``"stream"`` or ``"connection"``."""
    while True:
        incoming = await conn.next_frame()
        if incoming is None:
            pytest.fail(f"the connection closed; expected RST_STREAM(stream {stream_id}, {_names(codes)})")
        f = incoming.frame
        if isinstance(f, RstStreamFrame) and f.stream_id == stream_id:
            assert f.error_code in codes, f"got {_describe(f)}, expected {_names(codes)}"
            return "stream"
        if isinstance(f, GoAwayFrame):
            assert f.error_code in codes, (
                f"got {_describe(f)}, expected RST_STREAM(stream {stream_id}, {_names(codes)})"
            )
            await expect_closed(conn)
            return "connection"


async def expect_response(conn: Conn, stream_id: int) -> Response:
    """The stream's response, to END_STREAM or RST_STREAM. A GOAWAY or a closed connection fails."""
    response = Response(0, [], b"")
    body = bytearray()
    while True:
        incoming = await conn.next_frame()
        if incoming is None:
            pytest.fail(f"the connection closed before stream {stream_id} ended")
        f = incoming.frame
        if isinstance(f, GoAwayFrame):
            pytest.fail(f"got {_describe(f)} while waiting for the response on stream {stream_id}")
        if f.stream_id != stream_id:
            continue
        if isinstance(f, HeadersFrame):
            assert incoming.headers is not None
            if not response.status:
                for name, value in incoming.headers:
                    if name == b":status":
                        response.status = int(value)
                    else:
                        response.headers.append((name, value))
        elif isinstance(f, DataFrame):
            body += f.data
            if f.flow_controlled_length:
                # Keep the server's windows open for whatever follows on this connection.
                await conn.send(window_update(0, f.flow_controlled_length))
        elif isinstance(f, RstStreamFrame):
            response.reset = f.error_code
            break
        if isinstance(f, HeadersFrame | DataFrame) and "END_STREAM" in f.flags:
            break
    response.body = bytes(body)
    return response


async def expect_ok(conn: Conn) -> None:
    """A good request on a new stream of the same connection gets the demo replica's 200."""
    sid = await conn.request()
    response = await expect_response(conn, sid)
    assert response.status == 200, response
    assert response.reset in (None, E.NO_ERROR), response
    assert response.body.startswith(b"hello from replica-"), response


async def expect_malformed(conn: Conn, stream_id: int) -> Response:
    """RFC 9113 8.1.1: a malformed request is a stream error of type PROTOCOL_ERROR: the stream ends with
    RST_STREAM(PROTOCOL_ERROR). A response MAY come first: here a 400 saying why, which must not end the
    stream (no END_STREAM), so that the client learns of the error. A GOAWAY fails: the connection must go
    on. Returns the 400 (status 0 if none came)."""
    response = Response(0, [], b"")
    body = bytearray()
    while True:
        incoming = await conn.next_frame()
        if incoming is None:
            pytest.fail(f"the connection closed; expected RST_STREAM(stream {stream_id}, PROTOCOL_ERROR)")
        f = incoming.frame
        if isinstance(f, GoAwayFrame):
            pytest.fail(f"got {_describe(f)}; a malformed request is an error of its stream alone")
        if f.stream_id != stream_id:
            continue
        if isinstance(f, RstStreamFrame):
            assert f.error_code == E.PROTOCOL_ERROR, f"got {_describe(f)}, expected PROTOCOL_ERROR"
            response.reset = f.error_code
            break
        assert "END_STREAM" not in f.flags, f"{f!r} ended the stream of a malformed request: RFC 9113 8.1.1"
        if isinstance(f, HeadersFrame):
            assert incoming.headers is not None and not response.status, f"a second head: {incoming.headers}"
            for name, value in incoming.headers:
                if name == b":status":
                    response.status = int(value)
                else:
                    response.headers.append((name, value))
            assert response.status == 400, f"a malformed request got {response.status}"
            assert (b"proxyblocks-error", b"bad_request; hop=edge") in response.headers, response.headers
        elif isinstance(f, DataFrame):
            assert response.status, "DATA before the head"
            body += f.data
            if f.flow_controlled_length:
                await conn.send(window_update(0, f.flow_controlled_length))
    response.body = bytes(body)
    return response


async def expect_alive(conn: Conn, payload: bytes = b"stillok?") -> None:
    """The connection still works: a PING is answered, and nothing bad came before the answer."""
    await conn.send(ping(payload))
    await expect_ping_ack(conn, payload)


async def expect_ping_ack(conn: Conn, payload: bytes) -> None:
    """The ACK of a PING carrying ``payload`` arrives, with no GOAWAY or reset before it."""
    while True:
        incoming = await conn.next_frame()
        if incoming is None:
            pytest.fail("the connection closed; expected it to be ignored and go on")
        f = incoming.frame
        if isinstance(f, GoAwayFrame | RstStreamFrame):
            pytest.fail(f"got {_describe(f)}; expected the frame to be ignored")
        if isinstance(f, PingFrame) and "ACK" in f.flags and f.opaque_data == payload:
            return


async def slow_stream(conn: Conn, ms: int = 2000) -> int:
    """A stream that stays half-closed (remote) for ``ms``: a finished request the replica answers late."""
    return await conn.request(conn.head(b"GET", b"/sleep?ms=%d" % ms))


# -- the chain answers at all ---------------------------------------------------------------------


async def test_good_request_gets_200_from_a_demo_replica(conn: Conn) -> None:
    with trio.fail_after(10):
        sid = await conn.request()
        response = await expect_response(conn, sid)
        assert response.status == 200
        assert response.body in (b"hello from replica-0\n", b"hello from replica-1\n")
        assert (b"x-replica", response.body[len(b"hello from ") : -1]) in response.headers
        await expect_ok(conn)


# -- RFC 9113 3.4: HTTP/2 connection preface -------------------------------------------------------


async def test_3_4_server_sends_settings_first(chain: Chain) -> None:
    # 3.4: the server connection preface MUST be a SETTINGS frame, the first frame it sends.
    with trio.fail_after(10):
        async with open_conn(chain, handshake=False) as c:
            await c.send(PREFACE, settings())
            first = await c.next_frame()
            assert first is not None
            assert isinstance(first.frame, SettingsFrame), first
            assert "ACK" not in first.frame.flags
            assert first.frame.stream_id == 0


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"INVALID CONNECTION PREFACE\r\n\r\n", id="not-http2"),
        pytest.param(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + settings(), id="corrupted-magic"),
        pytest.param(PREFACE + ping(b"notsttng"), id="magic-then-ping"),
        pytest.param(PREFACE + window_update(0, 1000), id="magic-then-window-update"),
    ],
)
async def test_3_4_invalid_preface_closes_the_connection(chain: Chain, data: bytes) -> None:
    # 3.4: an invalid connection preface (the magic, then a SETTINGS frame) MUST be a connection error of
    # type PROTOCOL_ERROR; the GOAWAY MAY be omitted. The edge also serves HTTP/1.1 on this port, so bytes
    # that stop matching the magic may be answered as HTTP/1.1 (an error status) before the close: also
    # accepted. A PING sent after the bad preface must never be answered.
    probe = ping(b"afterpre")
    answer = frame(PING, ACK, 0, b"afterpre")
    with trio.fail_after(10):
        async with open_conn(chain, handshake=False) as c:
            await c.send(data + probe)
            received = bytearray()
            while answer not in received:
                try:
                    chunk = await c.stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                received += chunk
    assert answer not in received, "the edge answered a PING after an invalid preface: it took the connection"
    if not received or received.startswith(b"HTTP/1.1 4"):
        return
    # HTTP/2 frames: whatever they are, a GOAWAY among them must say PROTOCOL_ERROR.
    offset = 0
    while offset + 9 <= len(received):
        f, length = Frame.parse_frame_header(memoryview(bytes(received[offset : offset + 9])))
        f.parse_body(memoryview(bytes(received[offset + 9 : offset + 9 + length])))
        offset += 9 + length
        assert not isinstance(f, GoAwayFrame) or f.error_code == E.PROTOCOL_ERROR, _describe(f)
        assert not isinstance(f, HeadersFrame | DataFrame), f"the edge served a request: {f!r}"


# -- RFC 9113 4.1, 4.2: frame format and frame size ---------------------------------------------------


async def test_4_1_unknown_frame_type_is_ignored(conn: Conn) -> None:
    # 4.1: implementations MUST ignore and discard frames of unknown types.
    with trio.fail_after(10):
        await conn.send(frame(UNKNOWN_TYPE, 0, 0, b"ignore me"), frame(UNKNOWN_TYPE, 0xFF, 1, b"and me"))
        await expect_alive(conn)
        await expect_ok(conn)


async def test_4_1_undefined_flags_are_ignored(conn: Conn) -> None:
    # 4.1: flags with no defined meaning for a frame type MUST be ignored.
    with trio.fail_after(10):
        await conn.send(ping(b"undefflg", flags=0x16))
        await expect_ping_ack(conn, b"undefflg")


async def test_4_1_reserved_bit_is_ignored(conn: Conn) -> None:
    # 4.1: the reserved bit of the stream identifier MUST remain unset when sending and MUST be ignored
    # when receiving: a PING on "stream 0 with R set" is a PING on stream 0.
    with trio.fail_after(10):
        await conn.send(ping(b"reserved", stream_id=0x80000000))
        await expect_ping_ack(conn, b"reserved")


async def test_4_2_data_frame_over_max_frame_size(conn: Conn) -> None:
    # 4.2: a frame over SETTINGS_MAX_FRAME_SIZE MUST be a FRAME_SIZE_ERROR; for DATA a stream error
    # suffices, a connection error is also allowed.
    with trio.fail_after(10):
        sid = await conn.request(conn.head(b"POST", b"/echo"), end_stream=False)
        await conn.send(frame(DATA, END_STREAM, sid, b"x" * (DEFAULT_MAX_FRAME_SIZE + 1)))
        await expect_rst(conn, sid, E.FRAME_SIZE_ERROR)


async def test_4_2_headers_frame_over_max_frame_size(conn: Conn) -> None:
    # 4.2: a frame carrying a field block that is too large MUST be a connection error FRAME_SIZE_ERROR.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        block = conn.block(conn.head(b"GET", b"/", (b"x-big", b"a" * DEFAULT_MAX_FRAME_SIZE)))
        await conn.send(frame(HEADERS, END_STREAM | END_HEADERS, sid, block))
        await expect_goaway(conn, E.FRAME_SIZE_ERROR)


# -- RFC 9113 5.1: stream states ---------------------------------------------------------------------


async def test_5_1_data_on_idle_stream(conn: Conn) -> None:
    # 5.1 idle: any frame but HEADERS or PRIORITY MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(frame(DATA, END_STREAM, 1, b"hello"))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_5_1_window_update_on_idle_stream(conn: Conn) -> None:
    # 5.1 idle: same rule, for WINDOW_UPDATE.
    with trio.fail_after(10):
        await conn.send(window_update(1, 100))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_5_1_headers_on_half_closed_remote_stream(conn: Conn) -> None:
    # 5.1 half-closed (remote): frames other than WINDOW_UPDATE, PRIORITY or RST_STREAM MUST be a stream
    # error of type STREAM_CLOSED (a connection error of that type is allowed too).
    with trio.fail_after(10):
        sid = await slow_stream(conn)
        await conn.send(conn.headers(sid, [(b"x-trailer", b"late")]))
        await expect_rst(conn, sid, E.STREAM_CLOSED)


async def test_5_1_data_on_half_closed_remote_stream(conn: Conn) -> None:
    # 5.1 half-closed (remote): as above, for DATA.
    with trio.fail_after(10):
        sid = await slow_stream(conn)
        await conn.send(frame(DATA, END_STREAM, sid, b"late"))
        await expect_rst(conn, sid, E.STREAM_CLOSED)


@pytest.mark.parametrize("late", ["empty DATA", "DATA", "trailers"])
async def test_5_1_half_closed_remote_is_a_stream_error_and_the_connection_goes_on(conn: Conn, late: str) -> None:
    # 5.1 half-closed (remote): DATA (empty or not) or trailers after the client's END_STREAM are a stream
    # error STREAM_CLOSED: the stream is reset, the connection and its other streams go on.
    with trio.fail_after(10):
        sid = await slow_stream(conn)
        if late == "trailers":
            await conn.send(conn.headers(sid, [(b"x-trailer", b"late")]))
        else:
            await conn.send(frame(DATA, 0, sid, b"" if late == "empty DATA" else b"late"))
        assert await expect_rst(conn, sid, E.STREAM_CLOSED) == "stream"
        await expect_ok(conn)


async def test_6_5_3_a_settings_ack_with_none_due_is_ignored(conn: Conn) -> None:
    # 6.5.3 defines the ACK of a SETTINGS frame; an ACK with no SETTINGS to acknowledge is no error there:
    # the connection goes on (libnghttp2 alone would fail it).
    with trio.fail_after(10):
        await conn.send(settings(flags=ACK), ping(b"afterack"))
        await expect_ping_ack(conn, b"afterack")
        await expect_ok(conn)


async def test_5_1_data_after_rst_stream(conn: Conn) -> None:
    # 5.1 closed: any frame but PRIORITY after the peer's RST_STREAM MUST be a stream error STREAM_CLOSED
    # (or a connection error of that type).
    with trio.fail_after(10):
        sid = await conn.request(conn.head(b"POST", b"/echo"), end_stream=False)
        await conn.send(rst(sid), frame(DATA, END_STREAM, sid, b"late"))
        await expect_rst(conn, sid, E.STREAM_CLOSED)


async def test_5_1_1_even_stream_id(conn: Conn) -> None:
    # 5.1.1: client streams MUST be odd; an unexpected stream identifier MUST be a connection error
    # of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(conn.headers(2, conn.head()))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_5_1_1_stream_id_lower_than_a_previous_one(conn: Conn) -> None:
    # 5.1.1: a new stream id MUST be greater than all the ones the client opened; otherwise a connection
    # error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(conn.headers(5, conn.head()))
        response = await expect_response(conn, 5)
        assert response.status == 200
        await conn.send(conn.headers(3, conn.head()))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


# -- RFC 9113 5.1.2: stream concurrency -------------------------------------------------------------


async def test_5_1_2_over_max_concurrent_streams(conn: Conn) -> None:
    # 5.1.2: a HEADERS frame past the advertised SETTINGS_MAX_CONCURRENT_STREAMS MUST be a stream error
    # of type PROTOCOL_ERROR or REFUSED_STREAM (5.4.1 lets it become a connection error as well).
    with trio.fail_after(10):
        limit = conn.server_settings[MAX_CONCURRENT_STREAMS]
        assert limit <= 1000, "the test opens this many streams"
        frames = [conn.headers(conn.next_stream_id(), conn.head(b"GET", b"/sleep?ms=3000")) for _ in range(limit)]
        extra = conn.next_stream_id()
        frames.append(conn.headers(extra, conn.head()))
        await conn.send(*frames)
        await expect_rst(conn, extra, E.REFUSED_STREAM, E.PROTOCOL_ERROR)


# -- RFC 9113 5.3.1: stream dependencies --------------------------------------------------------------


async def test_5_3_1_headers_depending_on_itself(conn: Conn) -> None:
    # 5.3.1: a stream cannot depend on itself; MUST be a stream error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        payload = struct.pack(">IB", sid, 15) + conn.block(conn.head())
        await conn.send(frame(HEADERS, END_STREAM | END_HEADERS | PRIORITY_FLAG, sid, payload))
        await expect_rst(conn, sid, E.PROTOCOL_ERROR)


async def test_5_3_1_priority_depending_on_itself(conn: Conn) -> None:
    # 5.3.1: as above, for a PRIORITY frame.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        await conn.send(priority(sid, depends_on=sid))
        await expect_rst(conn, sid, E.PROTOCOL_ERROR)


# -- RFC 9113 5.4: error handling ----------------------------------------------------------------------


async def test_5_4_1_connection_error_sends_goaway_then_closes(conn: Conn) -> None:
    # 5.4.1: after a connection error the endpoint SHOULD send GOAWAY, then MUST close the TCP
    # connection; the GOAWAY names the last stream the server processed.
    with trio.fail_after(10):
        await expect_ok(conn)
        await conn.send(ping(b"x" * 6))
        goaway = await expect_goaway(conn, E.FRAME_SIZE_ERROR)
        assert goaway.last_stream_id == 1


# -- RFC 9113 5.5: extending HTTP/2 ---------------------------------------------------------------------


async def test_5_5_unknown_extension_frame_is_ignored(conn: Conn) -> None:
    # 5.5: implementations MUST ignore unknown or unsupported values in all extensible fields.
    with trio.fail_after(10):
        sid = await slow_stream(conn, 200)
        await conn.send(frame(UNKNOWN_TYPE, 0, sid, b"ext"), frame(UNKNOWN_TYPE, 0, 0, b"ext"))
        await expect_alive(conn)
        response = await expect_response(conn, sid)
        assert response.status == 200


async def test_5_5_unknown_setting_is_ignored(conn: Conn) -> None:
    # 5.5 and 6.5.2: an unknown setting MUST be ignored; the SETTINGS frame is still acknowledged.
    with trio.fail_after(10):
        await conn.send(settings((0xFF, 1), (0xABC, 0xFFFFFFFF)))
        await _expect_settings_ack(conn)
        await expect_ok(conn)


async def test_5_5_unknown_frame_inside_a_header_block(conn: Conn) -> None:
    # 5.5: an extension frame in the middle of a field block MUST be a connection error PROTOCOL_ERROR.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        block = conn.block(conn.head())
        await conn.send(
            frame(HEADERS, END_STREAM, sid, block[:5]),
            frame(UNKNOWN_TYPE, 0, sid, b"ext"),
            frame(CONTINUATION, END_HEADERS, sid, block[5:]),
        )
        await expect_goaway(conn, E.PROTOCOL_ERROR)


# -- RFC 9113 6.1: DATA ----------------------------------------------------------------------------------


async def test_6_1_data_on_stream_0(conn: Conn) -> None:
    # 6.1: DATA on stream 0 MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(frame(DATA, END_STREAM, 0, b"hello"))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_1_data_with_bad_padding(conn: Conn) -> None:
    # 6.1: padding as long as the payload or longer MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        sid = await conn.request(conn.head(b"POST", b"/echo"), end_stream=False)
        await conn.send(frame(DATA, END_STREAM | PADDED, sid, bytes([6]) + b"abcd"))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


# -- RFC 9113 6.2: HEADERS -------------------------------------------------------------------------------


async def test_6_2_headers_on_stream_0(conn: Conn) -> None:
    # 6.2: HEADERS on stream 0 MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(conn.headers(0, conn.head()))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_2_headers_with_bad_padding(conn: Conn) -> None:
    # 6.2: padding as long as the remaining payload or longer MUST be a connection error PROTOCOL_ERROR.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        block = conn.block(conn.head())
        await conn.send(frame(HEADERS, END_STREAM | END_HEADERS | PADDED, sid, bytes([len(block) + 1]) + block))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_2_headers_with_continuation(conn: Conn) -> None:
    # 6.2 and 6.10: a field block split over HEADERS and CONTINUATION frames is one request.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        block = conn.block(conn.head())
        await conn.send(
            frame(HEADERS, END_STREAM, sid, block[:3]),
            frame(CONTINUATION, 0, sid, block[3:6]),
            frame(CONTINUATION, END_HEADERS, sid, block[6:]),
        )
        response = await expect_response(conn, sid)
        assert response.status == 200


# -- RFC 9113 6.3: PRIORITY -------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [4, 6])
async def test_6_3_priority_with_wrong_length(conn: Conn, length: int) -> None:
    # 6.3: a PRIORITY frame with a length other than 5 MUST be a stream error of type FRAME_SIZE_ERROR
    # (a connection error of that type is allowed too).
    with trio.fail_after(10):
        sid = await slow_stream(conn)
        await conn.send(frame(PRIORITY, 0, sid, b"\x00" * length))
        await expect_rst(conn, sid, E.FRAME_SIZE_ERROR)


async def test_6_3_priority_on_idle_stream_is_allowed(conn: Conn) -> None:
    # 6.3 and 5.1: PRIORITY may be sent on a stream in any state, idle included.
    with trio.fail_after(10):
        await conn.send(priority(99), priority(1, depends_on=99))
        await expect_alive(conn)
        await expect_ok(conn)


# -- RFC 9113 6.4: RST_STREAM -----------------------------------------------------------------------------


async def test_6_4_rst_stream_on_stream_0(conn: Conn) -> None:
    # 6.4: RST_STREAM on stream 0 MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(rst(0))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_4_rst_stream_on_idle_stream(conn: Conn) -> None:
    # 6.4: RST_STREAM on an idle stream MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(rst(1))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


@pytest.mark.parametrize("length", [3, 5])
async def test_6_4_rst_stream_with_wrong_length(conn: Conn, length: int) -> None:
    # 6.4: a RST_STREAM frame with a length other than 4 MUST be a connection error FRAME_SIZE_ERROR.
    with trio.fail_after(10):
        sid = await slow_stream(conn)
        await conn.send(frame(RST_STREAM, 0, sid, b"\x00" * length))
        await expect_goaway(conn, E.FRAME_SIZE_ERROR)


# -- RFC 9113 6.5: SETTINGS -------------------------------------------------------------------------------


async def _expect_settings_ack(conn: Conn) -> None:
    while True:
        incoming = await conn.next_frame()
        assert incoming is not None, "the connection closed; expected a SETTINGS ACK"
        f = incoming.frame
        assert not isinstance(f, GoAwayFrame), _describe(f)
        if isinstance(f, SettingsFrame) and "ACK" in f.flags:
            assert f.settings == {} and f.stream_id == 0
            return


async def test_6_5_3_settings_are_acknowledged(conn: Conn) -> None:
    # 6.5.3: on a SETTINGS frame, the recipient MUST apply it and send SETTINGS with ACK.
    with trio.fail_after(10):
        await conn.send(settings((INITIAL_WINDOW_SIZE, 100_000), (MAX_FRAME_SIZE, 20_000)))
        await _expect_settings_ack(conn)
        await expect_ok(conn)


async def test_6_5_settings_ack_with_payload(conn: Conn) -> None:
    # 6.5: SETTINGS with ACK and a payload MUST be a connection error of type FRAME_SIZE_ERROR.
    with trio.fail_after(10):
        await conn.send(settings((INITIAL_WINDOW_SIZE, 100_000), flags=ACK))
        await expect_goaway(conn, E.FRAME_SIZE_ERROR)


async def test_6_5_settings_on_a_stream(conn: Conn) -> None:
    # 6.5: SETTINGS with a stream id other than 0 MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(settings((INITIAL_WINDOW_SIZE, 100_000), stream_id=1))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_5_settings_length_not_a_multiple_of_6(conn: Conn) -> None:
    # 6.5: a SETTINGS length that is not a multiple of 6 MUST be a connection error FRAME_SIZE_ERROR.
    with trio.fail_after(10):
        await conn.send(frame(SETTINGS, 0, 0, struct.pack(">HI", INITIAL_WINDOW_SIZE, 100_000)[:5]))
        await expect_goaway(conn, E.FRAME_SIZE_ERROR)


async def test_6_5_2_enable_push_not_0_or_1(conn: Conn) -> None:
    # 6.5.2: SETTINGS_ENABLE_PUSH other than 0 or 1 MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(settings((ENABLE_PUSH, 2)))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_5_2_initial_window_size_over_maximum(conn: Conn) -> None:
    # 6.5.2: SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1 MUST be a connection error FLOW_CONTROL_ERROR.
    with trio.fail_after(10):
        await conn.send(settings((INITIAL_WINDOW_SIZE, MAX_WINDOW + 1)))
        await expect_goaway(conn, E.FLOW_CONTROL_ERROR)


@pytest.mark.parametrize("value", [DEFAULT_MAX_FRAME_SIZE - 1, 2**24])
async def test_6_5_2_max_frame_size_out_of_range(conn: Conn, value: int) -> None:
    # 6.5.2: SETTINGS_MAX_FRAME_SIZE outside 2^14 .. 2^24-1 MUST be a connection error PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(settings((MAX_FRAME_SIZE, value)))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


# -- RFC 9113 6.7: PING ------------------------------------------------------------------------------------


async def test_6_7_ping_is_answered_with_the_same_payload(conn: Conn) -> None:
    # 6.7: a PING without ACK MUST be answered with a PING with ACK and an identical payload.
    with trio.fail_after(10):
        await expect_alive(conn, b"\x00\x01\x02\x03\xfc\xfd\xfe\xff")


async def test_6_7_ping_ack_is_not_answered(conn: Conn) -> None:
    # 6.7: an endpoint MUST NOT respond to PING frames containing ACK.
    with trio.fail_after(10):
        await conn.send(ping(b"unasked!", flags=ACK))
        await conn.send(ping(b"secondpg"))
        while True:
            incoming = await conn.next_frame()
            assert incoming is not None
            f = incoming.frame
            if isinstance(f, PingFrame):
                assert f.opaque_data == b"secondpg", "the edge answered a PING ACK"
                break


async def test_6_7_ping_on_a_stream(conn: Conn) -> None:
    # 6.7: PING with a stream id other than 0 MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(ping(stream_id=1))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


@pytest.mark.parametrize("length", [6, 9])
async def test_6_7_ping_with_wrong_length(conn: Conn, length: int) -> None:
    # 6.7: a PING length other than 8 MUST be a connection error of type FRAME_SIZE_ERROR.
    with trio.fail_after(10):
        await conn.send(ping(b"x" * length))
        await expect_goaway(conn, E.FRAME_SIZE_ERROR)


# -- RFC 9113 6.8: GOAWAY ----------------------------------------------------------------------------------


async def test_6_8_goaway_on_a_stream(conn: Conn) -> None:
    # 6.8: GOAWAY with a stream id other than 0 MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(frame(GOAWAY, 0, 1, struct.pack(">II", 0, E.NO_ERROR)))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


# -- RFC 9113 6.9: WINDOW_UPDATE ---------------------------------------------------------------------------


async def test_6_9_zero_increment_on_the_connection(conn: Conn) -> None:
    # 6.9: a 0 increment on the connection window MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(window_update(0, 0))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_9_zero_increment_on_a_stream(conn: Conn) -> None:
    # 6.9: a 0 increment on a stream MUST be a stream error of type PROTOCOL_ERROR (a connection error
    # of that type is allowed too).
    with trio.fail_after(10):
        sid = await slow_stream(conn)
        await conn.send(window_update(sid, 0))
        await expect_rst(conn, sid, E.PROTOCOL_ERROR)


@pytest.mark.parametrize("length", [3, 5])
async def test_6_9_window_update_with_wrong_length(conn: Conn, length: int) -> None:
    # 6.9: a WINDOW_UPDATE length other than 4 MUST be a connection error of type FRAME_SIZE_ERROR.
    with trio.fail_after(10):
        await conn.send(frame(WINDOW_UPDATE, 0, 0, b"\x00" * (length - 1) + b"\x01"))
        await expect_goaway(conn, E.FRAME_SIZE_ERROR)


async def test_6_9_1_connection_window_overflow(conn: Conn) -> None:
    # 6.9.1: a connection window above 2^31-1 MUST end the connection: GOAWAY FLOW_CONTROL_ERROR.
    with trio.fail_after(10):
        await conn.send(window_update(0, MAX_WINDOW))
        await expect_goaway(conn, E.FLOW_CONTROL_ERROR)


async def test_6_9_1_stream_window_overflow(conn: Conn) -> None:
    # 6.9.1: a stream window above 2^31-1 MUST end the stream: RST_STREAM FLOW_CONTROL_ERROR
    # (a connection error of that type is allowed too).
    with trio.fail_after(10):
        sid = await slow_stream(conn)
        await conn.send(window_update(sid, MAX_WINDOW))
        await expect_rst(conn, sid, E.FLOW_CONTROL_ERROR)


async def test_6_9_2_initial_window_size_overflows_a_stream_window(conn: Conn) -> None:
    # 6.9.2: a SETTINGS_INITIAL_WINDOW_SIZE change that takes any window above 2^31-1 MUST be a
    # connection error of type FLOW_CONTROL_ERROR.
    with trio.fail_after(10):
        sid = await slow_stream(conn)
        await conn.send(window_update(sid, MAX_WINDOW - 65535))
        await conn.send(settings((INITIAL_WINDOW_SIZE, 65536)))
        await expect_goaway(conn, E.FLOW_CONTROL_ERROR)


# -- RFC 9113 6.10: CONTINUATION ---------------------------------------------------------------------------


INTERLEAVED: dict[str, Callable[[Conn, int], bytes]] = {
    "ping": lambda conn, sid: ping(),
    "priority-same-stream": lambda conn, sid: priority(sid),
    "data-same-stream": lambda conn, sid: frame(DATA, 0, sid, b"x"),
    "headers-other-stream": lambda conn, sid: frame(HEADERS, END_STREAM | END_HEADERS, sid + 2, b"\x82"),
}


@pytest.mark.parametrize("between", list(INTERLEAVED))
async def test_6_10_frame_interleaved_in_a_header_block(conn: Conn, between: str) -> None:
    # 6.10 (and 4.3): a field block MUST be followed by CONTINUATION frames of the same stream only;
    # any other frame MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        block = conn.block(conn.head())
        await conn.send(
            frame(HEADERS, END_STREAM, sid, block[:5]),
            INTERLEAVED[between](conn, sid),
            frame(CONTINUATION, END_HEADERS, sid, block[5:]),
        )
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_10_continuation_on_another_stream(conn: Conn) -> None:
    # 6.10: a CONTINUATION for a different stream than the open field block MUST be PROTOCOL_ERROR.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        block = conn.block(conn.head())
        await conn.send(
            frame(HEADERS, END_STREAM, sid, block[:5]),
            frame(CONTINUATION, END_HEADERS, sid + 2, block[5:]),
        )
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_10_continuation_without_headers(conn: Conn) -> None:
    # 6.10: a CONTINUATION not preceded by HEADERS, PUSH_PROMISE or CONTINUATION without END_HEADERS
    # MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(frame(CONTINUATION, END_HEADERS, 1, conn.block(conn.head())))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_10_continuation_after_end_headers(conn: Conn) -> None:
    # 6.10: same rule, after a HEADERS frame that already carried END_HEADERS.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        await conn.send(
            conn.headers(sid, conn.head(b"POST", b"/echo"), end_stream=False),
            frame(CONTINUATION, END_HEADERS, sid, conn.block([(b"x-more", b"1")])),
        )
        await expect_goaway(conn, E.PROTOCOL_ERROR)


async def test_6_10_continuation_on_stream_0(conn: Conn) -> None:
    # 6.10: CONTINUATION on stream 0 MUST be a connection error of type PROTOCOL_ERROR.
    with trio.fail_after(10):
        await conn.send(frame(CONTINUATION, END_HEADERS, 0, b"\x82"))
        await expect_goaway(conn, E.PROTOCOL_ERROR)


# -- RFC 9113 8.1, 8.2, 8.3: HTTP message semantics ------------------------------------------------------
# A malformed request MUST be treated as a stream error of type PROTOCOL_ERROR (8.1.1): its stream ends with
# RST_STREAM(PROTOCOL_ERROR), which a 400 saying why may precede, without END_STREAM (expect_malformed). A
# connection error fails here: the connection goes on, and so do its other streams. Nothing of a malformed
# request stays behind the edge: what went up before the edge found it malformed is cancelled.

Edit = Callable[[Headers], Headers]
SLOW = b"/sleep?ms=60000"  # the replica would answer in a minute: nothing comes back before the edge's own answer
LISTENER_400 = b"400 Bad Request: bad_request; hop=edge\n"
PATHS = ["handler", "spliced"]


def _without(name: bytes) -> Edit:
    return lambda head: [(n, v) for n, v in head if n != name]


def _replace(name: bytes, value: bytes) -> Edit:
    return lambda head: [(n, value if n == name else v) for n, v in head]


MALFORMED_HEADS: dict[str, Edit] = {
    # 8.2.1: field names MUST be lowercase.
    "uppercase-field-name": lambda head: [*head, (b"X-Upper", b"1")],
    # 8.3: pseudo-header fields MUST come before regular fields.
    "pseudo-header-after-regular": lambda head: [*head[:3], (b"x-regular", b"1"), head[3]],
    # 8.3: pseudo-headers not defined for requests MUST NOT appear; h2 would take a 1xx :status among the
    # pseudo-headers for an informational response (a connection error there).
    "unknown-pseudo-header": lambda head: [*head, (b":unknown", b"x")],
    "response-pseudo-header": lambda head: [*head, (b":status", b"200")],
    "informational-status-first": lambda head: [(b":status", b"100"), *head],
    "informational-status-among-pseudo": lambda head: [*head, (b":status", b"103")],
    # 8.3.1: :method, :scheme and :path MUST be present (non-CONNECT), exactly once; :path not empty.
    "missing-method": _without(b":method"),
    "missing-scheme": _without(b":scheme"),
    "missing-path": _without(b":path"),
    "empty-path": _replace(b":path", b""),
    "duplicated-path": lambda head: [*head, (b":path", b"/")],
    "duplicated-method": lambda head: [head[0], *head],
    "duplicated-scheme": lambda head: [*head[:2], (b":scheme", b"https"), *head[2:]],
    # 8.2.2: connection-specific fields MUST NOT appear.
    "connection": lambda head: [*head, (b"connection", b"keep-alive")],
    "keep-alive": lambda head: [*head, (b"keep-alive", b"timeout=5")],
    "transfer-encoding": lambda head: [*head, (b"transfer-encoding", b"chunked")],
    "upgrade": lambda head: [*head, (b"upgrade", b"h2c")],
    "proxy-connection": lambda head: [*head, (b"proxy-connection", b"keep-alive")],
    # 8.2.2: te, if present, MUST be "trailers".
    "te-gzip": lambda head: [*head, (b"te", b"gzip")],
    # 8.1.1: a content-length that no DATA can match (the head ends the stream).
    "content-length-not-a-number": lambda head: [*head, (b"content-length", b"+0")],
    "content-length-without-a-body": lambda head: [*head, (b"content-length", b"5")],
}


@pytest.mark.parametrize("case", list(MALFORMED_HEADS))
async def test_8_malformed_request_head(conn: Conn, case: str) -> None:
    with trio.fail_after(10):
        sid = await conn.request(MALFORMED_HEADS[case](conn.head()))
        response = await expect_malformed(conn, sid)
        assert response.body == LISTENER_400, response
        await expect_ok(conn)


async def test_8_2_te_trailers_is_allowed(conn: Conn) -> None:
    # 8.2.2: te: trailers is the one value allowed.
    with trio.fail_after(10):
        sid = await conn.request(conn.head(b"GET", b"/", (b"te", b"trailers")))
        response = await expect_response(conn, sid)
        assert response.status == 200


async def take_path(conn: Conn, path: str) -> None:
    """Make the edge take the next request on ``path``: ``handler`` while it has no pooled connection to
    the proxy (the chain's first request), ``spliced`` once it has one (after a request)."""
    if path == "spliced":
        await expect_ok(conn)


def spliced(response: Response) -> bool:
    """Whether the edge's 400 came from a splice (the fast path) rather than from its listener (the handler
    path): a splice's answer passes the edge hop's head filter, which adds its Server-Timing."""
    return any(name == b"server-timing" for name, _ in response.headers)


# content-length, and the DATA payloads (the last one ends the stream)
LENGTH_MISMATCHES: dict[str, tuple[int, list[bytes]]] = {
    "shorter-in-one-frame": (10, [b"x" * 3]),
    "longer-in-one-frame": (3, [b"x" * 10]),
    "shorter-over-several-frames": (10, [b"x" * 3, b"x" * 3, b"x" * 3]),
    "longer-over-several-frames": (5, [b"x" * 3, b"x" * 3, b"x" * 3]),  # the second frame crosses it
    "zero-with-data": (0, [b"x"]),
    "ended-by-empty-data": (5, [b""]),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(LENGTH_MISMATCHES))
async def test_8_1_1_content_length_not_matching_data(conn: Conn, case: str, path: str) -> None:
    # 8.1.1: DATA that does not add up to content-length makes the request malformed: in the frame that
    # crosses the length, or at an end short of it.
    with trio.fail_after(10):
        await take_path(conn, path)
        declared, payloads = LENGTH_MISMATCHES[case]
        sid = conn.next_stream_id()
        last = len(payloads) - 1
        await conn.send(
            conn.headers(sid, conn.head(b"POST", SLOW, (b"content-length", b"%d" % declared)), end_stream=False),
            *(frame(DATA, END_STREAM if i == last else 0, sid, data) for i, data in enumerate(payloads)),
        )
        response = await expect_malformed(conn, sid)
        assert response.status == 400 and spliced(response) == (path == "spliced"), response
        await expect_ok(conn)


# trailers, and whether their HEADERS frame ends the stream
MALFORMED_TRAILERS: dict[str, tuple[Headers, bool]] = {
    # 8.1: trailers MUST NOT include pseudo-header fields; h2 takes a 1xx :status for an informational response.
    "pseudo-header": ([(b":method", b"POST"), (b"x-trailer", b"1")], True),
    "informational-status": ([(b":status", b"100")], True),
    # 8.2.1, 8.2.2: the field rules of a head apply to trailers too.
    "uppercase-name": ([(b"X-Trailer", b"1")], True),
    "connection-specific": ([(b"connection", b"close")], True),
    # 8.1: a HEADERS frame after the head MUST end the stream.
    "informational-without-end-stream": ([(b":status", b"103")], False),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(MALFORMED_TRAILERS))
async def test_8_1_malformed_trailers(conn: Conn, case: str, path: str) -> None:
    with trio.fail_after(10):
        await take_path(conn, path)
        trailers, end = MALFORMED_TRAILERS[case]
        sid = conn.next_stream_id()
        await conn.send(
            conn.headers(sid, conn.head(b"POST", SLOW), end_stream=False),
            frame(DATA, 0, sid, b"body"),
            conn.headers(sid, trailers, end_stream=end),
        )
        response = await expect_malformed(conn, sid)
        assert response.status == 400 and spliced(response) == (path == "spliced"), response
        await expect_ok(conn)


@pytest.mark.parametrize("path", PATHS)
async def test_8_1_trailers_without_end_stream(conn: Conn, path: str) -> None:
    # 8.1: a HEADERS frame after the request head that does not carry END_STREAM makes the request
    # malformed: a stream error, where h2's stream state machine would fail the connection.
    with trio.fail_after(10):
        await take_path(conn, path)
        sid = conn.next_stream_id()
        await conn.send(
            conn.headers(sid, conn.head(b"POST", SLOW), end_stream=False),
            frame(DATA, 0, sid, b"body"),
            conn.headers(sid, [(b"x-trailer", b"1")], end_stream=False),
        )
        response = await expect_malformed(conn, sid)
        assert response.status == 400 and spliced(response) == (path == "spliced"), response
        await expect_ok(conn)


def streams_behind_the_edge(chain: Chain) -> int:
    """The streams open on the listeners behind the edge: the proxy's, the worker's, the replicas'."""
    servers = [chain.proxy_server, chain.worker_server, *chain.replicas.values()]
    return sum(connection.streams for server in servers for connection in server.statistics().h2)


# what makes a request malformed once its head and 3 of its 5 declared body bytes went up
LATE: dict[str, Callable[[Conn, int], bytes]] = {
    "data-past-the-length": lambda conn, sid: frame(DATA, 0, sid, b"xyz"),
    "an-end-short-of-the-length": lambda conn, sid: frame(DATA, END_STREAM, sid, b""),
    "trailers-short-of-the-length": lambda conn, sid: conn.headers(sid, [(b"x-trailer", b"1")]),
    "trailers-with-a-pseudo-header": lambda conn, sid: conn.headers(sid, [(b":path", b"/")]),
    "trailers-without-end-stream": lambda conn, sid: conn.headers(sid, [(b"x-trailer", b"1")], end_stream=False),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("late", list(LATE))
async def test_8_1_1_malformed_after_it_went_upstream(chain: Chain, conn: Conn, late: str, path: str) -> None:
    # 8.1.1: a request can turn out malformed after its head and part of its body reached the replica: its
    # stream still ends with RST_STREAM(PROTOCOL_ERROR), and what went up is cancelled at every hop.
    with trio.fail_after(10):
        await take_path(conn, path)
        sid = conn.next_stream_id()
        head = conn.head(b"POST", SLOW, (b"content-length", b"5"))
        await conn.send(conn.headers(sid, head, end_stream=False), frame(DATA, 0, sid, b"abc"))
        await wait_for(lambda: streams_behind_the_edge(chain) == 3, "the request to reach the replica")
        await conn.send(LATE[late](conn, sid))
        response = await expect_malformed(conn, sid)
        assert response.status == 400 and spliced(response) == (path == "spliced"), response
        await wait_for(lambda: streams_behind_the_edge(chain) == 0, "the upstream streams to be cancelled")
        await expect_ok(conn)


async def read_into(conn: Conn, stream_id: int, response: Response, size: int) -> None:
    """Read ``stream_id``'s head and body into ``response`` until its body holds ``size`` bytes."""
    while len(response.body) < size:
        incoming = await conn.next_frame()
        assert incoming is not None, "the connection closed"
        f = incoming.frame
        assert not isinstance(f, GoAwayFrame | RstStreamFrame) or f.stream_id not in (0, stream_id), _describe(f)
        if f.stream_id != stream_id:
            continue
        if isinstance(f, HeadersFrame):
            assert incoming.headers is not None
            response.status = int(dict(incoming.headers)[b":status"])
        elif isinstance(f, DataFrame):
            response.body += f.data


# a malformed request on a stream of its own (each returns the frames that make it)
MALFORMED_BESIDE: dict[str, Callable[[Conn, int], list[bytes]]] = {
    "head": lambda conn, sid: [conn.headers(sid, [*conn.head(), (b"X-Upper", b"1")])],
    "length": lambda conn, sid: [
        conn.headers(sid, conn.head(b"POST", SLOW, (b"content-length", b"1")), end_stream=False),
        frame(DATA, END_STREAM, sid, b"too long"),
    ],
    "trailers-without-end-stream": lambda conn, sid: [
        conn.headers(sid, conn.head(b"POST", SLOW), end_stream=False),
        conn.headers(sid, [(b"x-trailer", b"1")], end_stream=False),
    ],
}


@pytest.mark.parametrize("malformed", list(MALFORMED_BESIDE))
async def test_8_1_1_a_malformed_request_leaves_the_streams_in_flight_alone(conn: Conn, malformed: str) -> None:
    # 8.1.1: a stream error is that stream's alone: an upload in flight on the same connection goes on.
    with trio.fail_after(10):
        echo = conn.next_stream_id()
        await conn.send(conn.headers(echo, conn.head(b"POST", b"/echo"), end_stream=False))
        await conn.send(frame(DATA, 0, echo, b"before "))
        response = Response(0, [], b"")
        await read_into(conn, echo, response, len(b"before "))  # the echo is under way
        sid = conn.next_stream_id()
        await conn.send(*MALFORMED_BESIDE[malformed](conn, sid))
        await expect_malformed(conn, sid)
        await conn.send(frame(DATA, END_STREAM, echo, b"after"))
        rest = await expect_response(conn, echo)
        assert (response.status, response.body + rest.body, rest.reset) == (200, b"before after", None)
        await expect_ok(conn)


class Books(Feature):
    """Counts the exchanges its hop dispatched, and those it closed."""

    def __init__(self) -> None:
        self.counts = {"dispatched": 0, "closed": 0}

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        self.counts["dispatched"] += 1

    def closed(self, exchange: Exchange) -> None:
        self.counts["closed"] += 1


# a request the edge decides on its fast path, then ended in the same read (each returns the frames)
ENDED_BEFORE_ITS_HANDLER: dict[str, Callable[[Conn, int], list[bytes]]] = {
    "reset-by-the-client": lambda conn, sid: [conn.headers(sid, conn.head(b"POST", b"/"), end_stream=False), rst(sid)],
    "malformed": lambda conn, sid: [
        conn.headers(sid, conn.head(b"POST", b"/", (b"content-length", b"1")), end_stream=False),
        frame(DATA, END_STREAM, sid, b"too long"),
    ],
}


@pytest.mark.parametrize("how", list(ENDED_BEFORE_ITS_HANDLER))
async def test_a_request_ended_before_its_handler_ran_is_closed_at_its_hop(nursery: trio.Nursery, how: str) -> None:
    # A request the edge decided on its fast path and left to a handler (it has no connection to the proxy
    # yet), then ended in the same read, before the handler task ran: the hop gives back what it took for it.
    books = Books()
    config = EdgeConfig(proxy=(HOST, closed_port()))
    with trio.fail_after(10):
        edge = await nursery.start(functools.partial(serve_edge, config, features=[books]))
        async with await trio.open_tcp_stream(HOST, edge.port) as stream:
            conn = Conn(stream, edge.port)
            await conn.handshake()
            sid = conn.next_stream_id()
            await conn.send(*ENDED_BEFORE_ITS_HANDLER[how](conn, sid))
            if how == "malformed":
                await expect_malformed(conn, sid)
            await wait_for(lambda: books.counts == {"dispatched": 1, "closed": 1}, lambda: repr(books.counts))
        await edge.aclose()


# -- 8.1.1, every way: a well-formed request with one thing made wrong ---------------------------------------

_TOKEN = st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=10).map(str.encode)
_VALUE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=16).map(str.encode)
_CONNECTION_SPECIFIC = [b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"]
_SPECIAL = {*_CONNECTION_SPECIFIC, b"te", b"host", b"content-length"}
_FIELDS = st.lists(st.tuples(_TOKEN.filter(lambda name: name not in _SPECIAL), _VALUE), max_size=5)
_REQUEST_PSEUDO = {b"method", b"scheme", b"authority", b"path", b"protocol"}


@attrs.frozen
class Malformed:
    """A request made malformed one way (``kind``), as frames: its head, and if it has one, its body (the
    last DATA ends the stream, unless trailers follow) and trailers (ending it if ``trailers_end``)."""

    kind: str
    head: Headers
    data: tuple[bytes, ...] | None = None  # None: the head ends the stream
    trailers: Headers | None = None
    trailers_end: bool = True

    def frames(self, conn: Conn, sid: int) -> list[bytes]:
        if self.data is None:
            return [conn.headers(sid, self.head)]
        frames = [conn.headers(sid, self.head, end_stream=False)]
        last = len(self.data) - 1 if self.trailers is None else -1
        frames += [frame(DATA, END_STREAM if i == last else 0, sid, data) for i, data in enumerate(self.data)]
        if self.trailers is not None:
            frames.append(conn.headers(sid, self.trailers, end_stream=self.trailers_end))
        return frames


@st.composite
def good_heads(draw: st.DrawFn, path: bytes | None = None) -> Headers:
    """A well-formed request head: the four pseudo-headers in any order, then a few ordinary fields."""
    pseudo = [
        (b":method", draw(st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"]))),
        (b":scheme", draw(st.sampled_from([b"http", b"https"]))),
        (b":authority", b"example.test"),
        (b":path", path or b"/" + draw(st.text("abcxyz0189-._~/?=&%", max_size=16)).encode()),
    ]
    return [*draw(st.permutations(pseudo)), *draw(_FIELDS)]


HEAD_CORRUPTIONS = [
    "uppercase-field-name",
    "unknown-pseudo-header",
    "response-pseudo-header",
    "pseudo-header-after-regular",
    "connection-specific",
    "te-not-trailers",
    "empty-path",
    "missing-pseudo-header",
    "repeated-pseudo-header",
]
BODY_CORRUPTIONS = ["content-length-mismatch", "malformed-trailers", "trailers-without-end-stream"]


@st.composite
def malformed_heads(draw: st.DrawFn, kind: str) -> Malformed:
    """A well-formed head made malformed as ``kind`` (one of :data:`HEAD_CORRUPTIONS`) says."""
    head = draw(good_heads())

    def insert(field: tuple[bytes, bytes], low: int, high: int) -> Headers:
        at = draw(st.integers(low, high))
        return [*head[:at], field, *head[at:]]

    regular = (4, len(head))  # where a regular field may go; a pseudo-header goes in 0..4
    if kind == "uppercase-field-name":
        name = draw(_TOKEN)
        at = draw(st.integers(0, len(name)))
        name = name[:at] + draw(st.sampled_from(string.ascii_uppercase)).encode() + name[at:]
        head = insert((name, draw(_VALUE)), *regular)
    elif kind == "unknown-pseudo-header":
        name = draw(_TOKEN.filter(lambda name: name not in _REQUEST_PSEUDO))
        head = insert((b":" + name, draw(_VALUE)), 0, 4)
    elif kind == "response-pseudo-header":  # a 1xx among the pseudo-headers included
        head = insert((b":status", b"%d" % draw(st.integers(100, 599))), 0, 4)
    elif kind == "pseudo-header-after-regular":
        if len(head) == 4:
            head.append((b"x-regular", b"1"))
        pseudo = head.pop(draw(st.integers(0, 3)))
        head = insert(pseudo, 4, len(head))
    elif kind == "connection-specific":
        head = insert((draw(st.sampled_from(_CONNECTION_SPECIFIC)), draw(_VALUE)), *regular)
    elif kind == "te-not-trailers":
        head = insert((b"te", draw(_VALUE.filter(lambda value: value != b"trailers"))), *regular)
    elif kind == "empty-path":
        head = [(name, b"" if name == b":path" else value) for name, value in head]
    else:
        name = draw(st.sampled_from([b":method", b":scheme", b":path"]))
        if kind == "missing-pseudo-header":
            head = [field for field in head if field[0] != name]
        else:
            value = draw(st.one_of(st.just(dict(head)[name]), _VALUE))
            head = insert((name, value), 0, 4)
    return Malformed(kind, head)


@st.composite
def malformed_bodies(draw: st.DrawFn, kind: str) -> Malformed:
    """A well-formed head (to a replica that would answer late: nothing comes back before the edge's answer),
    then a body that disagrees with its content-length, malformed trailers, or trailers that do not end it
    (``kind``, one of :data:`BODY_CORRUPTIONS`)."""
    head = draw(good_heads(SLOW))
    if kind == "content-length-mismatch":
        sizes = draw(st.lists(st.integers(0, 20), max_size=3))
        declared = draw(st.integers(0, 40).filter(lambda n: n != sum(sizes)))
        data = tuple(b"x" * size for size in sizes) or None  # none: the head ends the stream
        return Malformed(kind, [*head, (b"content-length", b"%d" % declared)], data)
    data = tuple(b"x" * size for size in draw(st.lists(st.integers(0, 20), max_size=3)))
    if draw(st.booleans()):
        head = [*head, (b"content-length", b"%d" % sum(map(len, data)))]
    if kind == "trailers-without-end-stream":
        return Malformed(kind, head, data, draw(_FIELDS), trailers_end=False)
    bad = draw(
        st.sampled_from(
            [
                (b":" + draw(_TOKEN), draw(_VALUE)),
                (b":status", b"1%02d" % draw(st.integers(0, 99))),
                (b"X-" + draw(_TOKEN), draw(_VALUE)),
                (draw(st.sampled_from(_CONNECTION_SPECIFIC)), draw(_VALUE)),
            ]
        )
    )
    trailers = draw(_FIELDS)
    at = draw(st.integers(0, len(trailers)))
    return Malformed(kind, head, data, [*trailers[:at], bad, *trailers[at:]])


async def test_8_1_1_every_malformed_request_is_reset_and_the_connection_goes_on(chain: Chain) -> None:
    """Invariant: a well-formed request made malformed in any one of the ways RFC 9113 8.1-8.3 name (its head,
    its body against its content-length, its trailers) ends its stream with RST_STREAM(PROTOCOL_ERROR), a
    400 without END_STREAM first, and the next request on the same connection gets the replica's 200.

    A few examples of each way (hypothesis alone spreads 25 examples unevenly over a dozen ways), on one
    chain, each on a connection of its own."""
    seen: list[str] = []

    async def check(case: Malformed) -> None:
        with trio.fail_after(10):
            async with open_conn(chain) as c:
                sid = c.next_stream_id()
                await c.send(*case.frames(c, sid))
                response = await expect_malformed(c, sid)
                assert response.status == 400, response
                await expect_ok(c)
        seen.append(case.kind)

    def every_way(kind: str, strategy: st.SearchStrategy[Malformed]) -> Callable[[], None]:
        def malformed(case: Malformed) -> None:
            trio.from_thread.run(check, case)

        malformed.__name__ = malformed.__qualname__ = f"malformed_{kind.replace('-', '_')}"  # (its examples' key)
        settings = hypothesis.settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        return settings(given(case=strategy)(malformed))

    ways = {kind: malformed_heads(kind) for kind in HEAD_CORRUPTIONS}
    ways.update({kind: malformed_bodies(kind) for kind in BODY_CORRUPTIONS})
    # Hypothesis runs in a thread; each example's exchanges run here. Each example is bounded, and so is the
    # whole, shrinking included (the thread is then left to end on its own).
    with trio.fail_after(300):
        for kind, strategy in ways.items():
            await trio.to_thread.run_sync(every_way(kind, strategy), abandon_on_cancel=True)
    assert set(seen) == set(ways)


# -- RFC 7541: HPACK ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block",
    [
        pytest.param(b"\x80", id="index-0"),
        pytest.param(b"\xbe", id="index-62-empty-dynamic-table"),
        pytest.param(b"\xff\x80\x80\x80\x80\x08", id="index-huge"),
    ],
)
async def test_rfc7541_index_out_of_range(conn: Conn, block: bytes) -> None:
    # RFC 7541 2.3.3 and 6.1: an index outside both tables (or 0) MUST be a decoding error; RFC 9113 4.3:
    # a decoding error MUST be a connection error of type COMPRESSION_ERROR.
    with trio.fail_after(10):
        await conn.send(frame(HEADERS, END_STREAM | END_HEADERS, conn.next_stream_id(), block))
        await expect_goaway(conn, E.COMPRESSION_ERROR)


async def test_rfc7541_table_size_update_over_the_setting(conn: Conn) -> None:
    # RFC 7541 4.2 and 6.3: a dynamic table size update above SETTINGS_HEADER_TABLE_SIZE (4096 here)
    # MUST be a decoding error: a connection error of type COMPRESSION_ERROR (RFC 9113 4.3).
    with trio.fail_after(10):
        limit = conn.server_settings.get(HEADER_TABLE_SIZE, 4096)
        assert limit == 4096
        update = b"\x3f\xe2\x1f"  # size update to 4097: 31 + 4066 as an HPACK integer
        block = update + conn.block(conn.head())
        await conn.send(frame(HEADERS, END_STREAM | END_HEADERS, conn.next_stream_id(), block))
        await expect_goaway(conn, E.COMPRESSION_ERROR)


async def test_rfc7541_table_size_update_after_a_field(conn: Conn) -> None:
    # RFC 7541 4.2: a dynamic table size update MUST come at the start of a field block; one after a
    # field MUST be a decoding error (COMPRESSION_ERROR).
    with trio.fail_after(10):
        block = conn.block(conn.head()) + b"\x20"  # size update to 0, after the fields
        await conn.send(frame(HEADERS, END_STREAM | END_HEADERS, conn.next_stream_id(), block))
        await expect_goaway(conn, E.COMPRESSION_ERROR)


async def test_rfc7541_huffman_strings_are_accepted(conn: Conn) -> None:
    # RFC 7541 5.2: string literals may be Huffman coded; a decoder MUST accept them.
    with trio.fail_after(10):
        sid = conn.next_stream_id()
        block = conn.block(conn.head(b"GET", b"/", (b"x-huffman-header", b"some huffman coded value")), huffman=True)
        assert b"huffman" not in block, "the encoder did not Huffman-code the literals"
        await conn.send(frame(HEADERS, END_STREAM | END_HEADERS, sid, block))
        response = await expect_response(conn, sid)
        assert response.status == 200
        assert response.body.startswith(b"hello from replica-")
        await expect_ok(conn)
