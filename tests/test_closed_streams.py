"""Closed streams: a connection remembers the last ``CLOSED_STREAMS`` of them, and late frames on one it
forgot harm nobody.

hyper-h2 remembers how each of the last 65,536 closed streams of a connection
closed (7.5 MiB on a long-lived connection); the codec keeps 256
(:data:`blocks.transport._codec.CLOSED_STREAMS`). A frame can still arrive
on a stream after it closed (RFC 9113 5.1: the peer sent it before it
learned of our RST_STREAM); on a stream the codec no longer remembers it
must be what it is on a stream we reset: DATA and HEADERS a stream error
(RST_STREAM(STREAM_CLOSED)), WINDOW_UPDATE, RST_STREAM and PRIORITY ignored,
and never a connection error that would take the connection's other
streams with it. DATA on it still counts against the connection's window
and is given back (every DATA byte received is acknowledged exactly once).

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``,
waits for the state it asserts.
"""

from __future__ import annotations

import functools

import h2.config
import h2.connection
import h2.errors
import hyperframe.frame as hf
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blocks import HTTPServer, ListenerConfig, Request, Response, serve_http, text_response
from blocks.transport._codec import CLOSED_STREAMS, make_h2
from tests.support import RawFrames

E = h2.errors.ErrorCodes
Frame = hf.Frame


async def app(request: Request) -> Response:
    """``/ignore`` answers without reading its body (the listener then resets the stream with NO_ERROR,
    RFC 9113 8.1); anything else is 200."""
    return text_response(200, "ok\n")


class Client(RawFrames):
    """A raw client that keeps the connection window's books as it sees them, and every RST_STREAM
    and GOAWAY it received."""

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__(stream)
        self.window = 65535  # what the server lets us send on the connection
        self.resets: list[hf.RstStreamFrame] = []
        self.goaway: hf.GoAwayFrame | None = None

    async def send(self, *frames: Frame | bytes) -> bool:
        for f in frames:
            if isinstance(f, hf.DataFrame):
                self.window -= len(f.data) + (f.pad_length + 1 if "PADDED" in f.flags else 0)
        return await super().send(*frames)

    async def next_frame(self) -> Frame | None:
        frame = await super().next_frame()
        if isinstance(frame, hf.WindowUpdateFrame) and frame.stream_id == 0:
            self.window += frame.window_increment
        elif isinstance(frame, hf.RstStreamFrame):
            self.resets.append(frame)
        elif isinstance(frame, hf.GoAwayFrame):
            self.goaway = frame
        return frame

    async def ended(self, *sids: int) -> None:
        """Read until each of ``sids`` has its response's END_STREAM (or its reset)."""
        waiting = set(sids)
        while waiting:
            frame = await self.next_frame()
            assert frame is not None and self.goaway is None, f"closed while waiting for {sorted(waiting)}"
            if frame.stream_id in waiting and ("END_STREAM" in frame.flags or isinstance(frame, hf.RstStreamFrame)):
                waiting.discard(frame.stream_id)

    async def ping(self) -> None:
        """A PING and its ACK: the server has taken every frame sent before it, and answered them."""
        await self.send(hf.PingFrame(0, opaque_data=b"closed!!"))
        while True:
            frame = await self.next_frame()
            assert frame is not None and self.goaway is None, f"the connection closed: {self.goaway!r}"
            if isinstance(frame, hf.PingFrame) and "ACK" in frame.flags:
                return

    def trailers(self, sid: int) -> hf.HeadersFrame:
        """Trailers that index a field (the server must decode them, or the next head is garbled)."""
        block = bytes(self.encoder.encode([(b"x-late", b"trailer %d" % sid)], huffman=False))
        return hf.HeadersFrame(sid, block, flags=["END_HEADERS", "END_STREAM"])


async def listen(nursery: trio.Nursery) -> HTTPServer:
    server: HTTPServer = await nursery.start(functools.partial(serve_http, app, config=ListenerConfig()))
    return server


RESET, ENDED = 1, 3  # stream 1: reset by the server (its body unread); stream 3: ended both ways
FIRST_FREE = 5


async def close_two_streams(raw: Client) -> None:
    """Stream 1 is answered and reset by the server while the client still sends (late DATA and
    trailers are then in flight, as RFC 9113 5.1 expects); stream 3 is a plain GET, ended both ways."""
    await raw.send(
        hf.HeadersFrame(RESET, raw.block(b"/ignore", method=b"POST"), flags=["END_HEADERS"]),
        hf.DataFrame(RESET, b"u" * 1000),
    )
    await raw.ended(RESET)
    await raw.ping()
    # (its DATA, if it came after the reset, got an RST_STREAM(STREAM_CLOSED) of its own)
    assert (raw.resets[0].stream_id, raw.resets[0].error_code) == (RESET, E.NO_ERROR)
    raw.resets.clear()
    await raw.send(raw.request(ENDED))
    await raw.ended(ENDED)


async def close_more(raw: Client, first: int, count: int) -> int:
    """``count`` more GETs, 64 at a time, each to its end; the next free stream id."""
    sid = first
    while count:
        batch = list(range(sid, sid + 2 * min(64, count), 2))
        await raw.send(*[raw.request(s) for s in batch])
        await raw.ended(*batch)
        count -= len(batch)
        sid = batch[-1] + 2
    return sid


def one_connection(server: HTTPServer) -> tuple[int, int]:
    """``(inbound_window, unacknowledged)`` of the server's only h2 connection."""
    (conn,) = server.statistics().h2
    return conn.inbound_window, conn.unacknowledged


async def books_balance(raw: Client, server: HTTPServer) -> None:
    """Every DATA byte the server received was given back exactly once: it holds none unacknowledged,
    and the window it keeps is the one the client counts from the wire."""
    await raw.ping()
    assert one_connection(server) == (raw.window, 0)


def late(raw: Client, kind: str, sid: int) -> Frame:
    if kind == "DATA":
        return hf.DataFrame(sid, b"d" * 5000, flags=["END_STREAM"])
    if kind == "HEADERS":
        return raw.trailers(sid)
    if kind == "WINDOW_UPDATE":
        return hf.WindowUpdateFrame(sid, window_increment=1000)
    if kind == "RST_STREAM":
        return hf.RstStreamFrame(sid, error_code=E.CANCEL)
    assert kind == "PRIORITY"
    return hf.PriorityFrame(sid, depends_on=0, stream_weight=15)


KINDS = ["DATA", "HEADERS", "WINDOW_UPDATE", "RST_STREAM", "PRIORITY"]
ANSWERED = {"DATA", "HEADERS"}  # with RST_STREAM(STREAM_CLOSED); the others are ignored


@pytest.mark.parametrize("sid", [RESET, ENDED], ids=["reset", "ended"])
@pytest.mark.parametrize("kind", KINDS)
async def test_a_late_frame_on_a_forgotten_stream_is_its_error_alone(
    nursery: trio.Nursery, kind: str, sid: int
) -> None:
    """Once ``CLOSED_STREAMS`` later streams closed, a late frame on stream 1 (reset by the server) or
    3 (ended both ways): RST_STREAM(STREAM_CLOSED) for DATA and HEADERS, nothing for the others; the
    connection serves on, its HPACK state intact, and the DATA was counted and given back."""
    with trio.fail_after(30):
        server = await listen(nursery)
        async with Client.open(server.port) as raw:
            await close_two_streams(raw)
            next_sid = await close_more(raw, FIRST_FREE, CLOSED_STREAMS + 8)
            await raw.send(late(raw, kind, sid))
            await raw.ping()
            expected = [(sid, E.STREAM_CLOSED)] if kind in ANSWERED else []
            assert [(r.stream_id, r.error_code) for r in raw.resets] == expected
            await close_more(raw, next_sid, 1)
            await books_balance(raw, server)


@pytest.mark.parametrize("sid", [RESET, ENDED], ids=["reset", "ended"])
@pytest.mark.parametrize("kind", KINDS)
async def test_a_late_frame_on_a_remembered_stream_is_answered_as_h2_answers_it(
    nursery: trio.Nursery, kind: str, sid: int
) -> None:
    """Within the last ``CLOSED_STREAMS`` closes, h2 knows how a stream closed: HEADERS on one the
    client had ended (3) is GOAWAY(STREAM_CLOSED) (RFC 9113 5.1: a frame after END_STREAM is a
    connection error), on one the server reset (1) RST_STREAM(STREAM_CLOSED); DATA is a stream error
    on either, the others are ignored. What the bound trades is only that strictness."""
    with trio.fail_after(30):
        server = await listen(nursery)
        async with Client.open(server.port) as raw:
            await close_two_streams(raw)
            next_sid = await close_more(raw, FIRST_FREE, CLOSED_STREAMS - 8)
            await raw.send(late(raw, kind, sid))
            if kind == "HEADERS" and sid == ENDED:
                while await raw.next_frame() is not None:
                    pass
                assert raw.goaway is not None and raw.goaway.error_code == E.STREAM_CLOSED
                return
            await raw.ping()
            expected = [(sid, E.STREAM_CLOSED)] if kind in ANSWERED else []
            assert [(r.stream_id, r.error_code) for r in raw.resets] == expected
            await close_more(raw, next_sid, 1)
            await books_balance(raw, server)


async def test_a_stream_id_never_opened_and_above_every_forgotten_one_is_still_a_connection_error(
    nursery: trio.Nursery,
) -> None:
    """HEADERS on an id the client skipped, above any id forgotten, opens nothing: GOAWAY(PROTOCOL_ERROR)
    (RFC 9113 5.1.1), as h2 answers it."""
    with trio.fail_after(30):
        server = await listen(nursery)
        async with Client.open(server.port) as raw:
            await close_more(raw, 1, 2)  # 1, 3
            await close_more(raw, 9, 1)  # 5 and 7 are never opened
            await raw.send(raw.request(7))
            while await raw.next_frame() is not None:
                pass
            assert raw.goaway is not None and raw.goaway.error_code == E.PROTOCOL_ERROR


late_frames = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.sampled_from([RESET, ENDED]),
        st.integers(0, 16384 - 256),  # DATA: its length (with the padding, within MAX_FRAME_SIZE)
        st.none() | st.integers(0, 255),  # DATA: its padding (and its length byte)
    ),
    min_size=1,
    max_size=24,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=late_frames)
def test_the_connection_window_balances_whatever_late_frames_come(
    frames: list[tuple[str, int, int, int | None]],
) -> None:
    """Invariant, over any sequence of late frames on forgotten streams (any kind, any DATA length and
    padding): each DATA and HEADERS frame gets its RST_STREAM(STREAM_CLOSED), the connection serves
    on, and every DATA byte is acknowledged exactly once at the connection level (the server holds
    none, and its window is the one the client counts)."""

    async def run() -> None:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                server = await listen(nursery)
                async with Client.open(server.port) as raw:
                    await close_two_streams(raw)
                    next_sid = await close_more(raw, FIRST_FREE, CLOSED_STREAMS + 8)
                    out: list[Frame] = []
                    for kind, sid, length, padding in frames:
                        if kind == "DATA":
                            flags = ["PADDED"] if padding is not None else []
                            out.append(hf.DataFrame(sid, b"d" * length, pad_length=padding or 0, flags=flags))
                        else:
                            out.append(late(raw, kind, sid))
                    await raw.send(*out)
                    await raw.ping()
                    answered = [f.stream_id for f in out if isinstance(f, hf.DataFrame | hf.HeadersFrame)]
                    assert [(r.stream_id, r.error_code) for r in raw.resets] == [
                        (sid, E.STREAM_CLOSED) for sid in answered
                    ]
                    await close_more(raw, next_sid, 1)
                    await books_balance(raw, server)
                nursery.cancel_scope.cancel()

    trio.run(run)


def test_a_pooled_connection_forgets_too_and_takes_late_frames_on_what_it_forgot() -> None:
    """The client side (the pool's connections) keeps the same bound: a late response (HEADERS) and
    DATA from a real h2 server on a stream the client reset, once forgotten, are RST_STREAM(STREAM_CLOSED),
    the DATA acknowledged once, and the next response decodes."""
    client = make_h2(client_side=True, max_concurrent_streams=100, stream_window=65535, max_header_list_size=65536)
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    head = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"x"), (b":path", b"/")]

    def exchange(sid: int) -> None:
        client.send_headers(sid, head, end_stream=True)
        server.receive_data(client.data_to_send())
        server.send_headers(sid, [(b":status", b"200")], end_stream=True)
        client.receive_data(server.data_to_send())

    client.send_headers(1, head)
    server.receive_data(client.data_to_send())
    client.reset_stream(1, E.CANCEL)
    client.data_to_send()  # the reset never reaches the server: its response is in flight
    for sid in range(3, 3 + 2 * (CLOSED_STREAMS + 8), 2):
        exchange(sid)
    assert len(client._closed_streams) <= CLOSED_STREAMS and 1 not in client._closed_streams
    server.send_headers(1, [(b":status", b"200"), (b"x-late", b"indexed")])
    server.send_data(1, b"late" * 1000, end_stream=True)
    events = client.receive_data(server.data_to_send())
    assert events == []
    frames = [hf.Frame.parse_frame_header(memoryview(chunk[:9]))[0] for chunk in _frames(client.data_to_send())]
    assert [(type(f).__name__, f.stream_id) for f in frames] == [("RstStreamFrame", 1)] * 2
    assert client.inbound_books()[1] == 0
    exchange(3 + 2 * (CLOSED_STREAMS + 8))  # the dynamic table is still in step


def _frames(data: bytes) -> list[bytes]:
    out = []
    while data:
        length = int.from_bytes(data[:3])
        out.append(data[: 9 + length])
        data = data[9 + length :]
    return out
