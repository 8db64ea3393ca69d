"""A draining h2 listener's GOAWAYs on the wire, as RFC 9113 6.8 describes graceful shutdown.

A real hyper-h2 client on a loopback socket: GOAWAY(2^31-1) and a PING
right behind it; a stream the client sent before it read them (the race)
is served, because the client's PING ACK comes after it on the same byte
stream and the final GOAWAY, sent once the ACK is in, names it; a stream
after the final GOAWAY is refused; the stream in flight finishes. The
final GOAWAY follows the ACK, not a timer: ``drain_goaway_delay`` is set
far beyond the test's bound (a client that never answers the PING is
``tests/test_drain.py``'s raw client).

hyper-h2 closes its state machine on a GOAWAY it receives and then refuses
every frame after it (the responses of the very streams the GOAWAY lets
finish, the PING), python-hyper/h2#1181; the client here feeds it one
frame at a time and puts its state back after a GOAWAY, as proxyblocks' own
pool does and RFC 9113 6.8 asks of a client.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import hyperframe.frame as hf
import trio

from blocks import ListenerConfig, Request, Response, open_upstreams, serve_http, text_response

HOST = "127.0.0.1"
LAST = 2**31 - 1


class Client:
    """A hyper-h2 client connection whose frames the test reads before h2 does."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.buffer = bytearray()
        self.events: list[h2.events.Event] = []
        self.seen: list[hf.Frame] = []

    async def flush(self) -> None:
        await self.stream.send_all(self.h2.data_to_send())

    async def frame(self) -> tuple[hf.Frame, bytes] | None:
        """The next frame from the server (parsed, and its bytes), not yet given to h2; None at the end."""
        while True:
            if len(self.buffer) >= 9:
                frame, length = hf.Frame.parse_frame_header(memoryview(self.buffer[:9]))
                if len(self.buffer) >= 9 + length:
                    raw = bytes(self.buffer[: 9 + length])
                    frame.parse_body(memoryview(raw[9:]))
                    del self.buffer[: 9 + length]
                    return frame, raw
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.buffer += data

    def feed(self, raw: bytes) -> None:
        """One frame to h2; after a GOAWAY its state goes back to open (see the module's docstring)."""
        events = self.h2.receive_data(raw)
        if any(isinstance(event, h2.events.ConnectionTerminated) for event in events):
            self.h2.state_machine.state = h2.connection.ConnectionState.CLIENT_OPEN
        self.events += events

    async def until(self, condition: Callable[[], bool]) -> None:
        """Read, giving each frame to h2 (and keeping it in :attr:`seen`), until ``condition()`` holds."""
        while not condition():
            got = await self.frame()
            assert got is not None, "closed before the condition held"
            frame, raw = got
            self.feed(raw)
            self.seen.append(frame)

    def last(self, kind: type[hf.Frame], sid: int = 0) -> hf.Frame | None:
        """The last frame of ``kind`` seen on stream ``sid``."""
        found = [frame for frame in self.seen if isinstance(frame, kind) and frame.stream_id == sid]
        return found[-1] if found else None

    def request(self, sid: int, path: bytes) -> None:
        head = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"example.test"), (b":path", path)]
        self.h2.send_headers(sid, head, end_stream=True)

    def status(self, sid: int) -> bytes | None:
        for event in self.events:
            if isinstance(event, h2.events.ResponseReceived) and event.stream_id == sid:
                return dict(event.headers)[b":status"]
        return None


async def test_the_final_goaway_follows_the_ping_ack_and_names_the_race_stream(nursery: trio.Nursery) -> None:
    held, release = trio.Event(), trio.Event()
    arrivals: list[bytes] = []

    async def handler(request: Request) -> Response:
        arrivals.append(request.path)
        if request.path == b"/hold":
            held.set()
            await release.wait()
        return text_response(200, "ok\n")

    config = ListenerConfig(drain_goaway_delay=3600)  # only the ACK can bring the final GOAWAY in time
    with trio.fail_after(10):
        server = await nursery.start(functools.partial(serve_http, handler, config=config))
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            client = Client(stream)
            client.h2.initiate_connection()
            client.request(1, b"/hold")
            await client.flush()
            await held.wait()
            server.drain()

            # GOAWAY(NO_ERROR, 2^31-1), then a PING: read, but not given to h2 yet.
            frames = []
            while not any(isinstance(frame, hf.PingFrame) for frame, _ in frames):
                got = await client.frame()
                assert got is not None
                frames.append(got)
            goaways = [frame for frame, _ in frames if isinstance(frame, hf.GoAwayFrame)]
            assert [(g.last_stream_id, g.error_code) for g in goaways] == [(LAST, h2.errors.ErrorCodes.NO_ERROR)]
            assert isinstance(frames[-2][0], hf.GoAwayFrame)  # the PING is right behind it
            ping = frames[-1][0]
            assert "ACK" not in ping.flags

            # The race: stream 3 leaves before the client reads them; then h2 reads them and ACKs.
            client.request(3, b"/")
            await client.flush()
            for _, raw in frames:
                client.feed(raw)
            assert any(isinstance(event, h2.events.PingReceived) for event in client.events)
            await client.flush()  # the ACK, after stream 3's HEADERS

            await client.until(lambda: client.last(hf.GoAwayFrame) is not None and client.status(3) is not None)
            final = client.last(hf.GoAwayFrame)
            assert final is not None
            assert (final.last_stream_id, final.error_code) == (3, h2.errors.ErrorCodes.NO_ERROR)
            assert client.status(3) == b"200"

            client.request(5, b"/")  # after the final GOAWAY: refused, never handled
            await client.flush()
            await client.until(lambda: client.last(hf.RstStreamFrame, 5) is not None)
            refused = client.last(hf.RstStreamFrame, 5)
            assert refused is not None and refused.error_code == h2.errors.ErrorCodes.REFUSED_STREAM

            release.set()  # the stream in flight finishes, then the connection closes
            await client.until(lambda: client.status(1) is not None)
            assert client.status(1) == b"200"
            while await client.frame() is not None:
                pass
        assert arrivals == [b"/hold", b"/"]


async def test_the_pool_in_front_finishes_its_stream_across_the_goaway_and_the_ping(nursery: trio.Nursery) -> None:
    """The hop in front of a draining hop is proxyblocks' own pool (``open_upstreams``, what every
    hop sends with): its stream in flight across the GOAWAY and the PING finishes (200, whole), and
    the connection ends once that stream is done, not ``drain_goaway_delay`` later (set far beyond
    the test's bound)."""
    held, release = trio.Event(), trio.Event()

    async def handler(request: Request) -> Response:
        if request.path == b"/hold":
            held.set()
            await release.wait()
        return text_response(200, "ok\n")

    config = ListenerConfig(drain_goaway_delay=3600)
    with trio.fail_after(10):
        server = await nursery.start(functools.partial(serve_http, handler, config=config))
        async with open_upstreams() as upstreams, trio.open_nursery() as inner:
            answers: list[tuple[int, bytes]] = []

            async def hold() -> None:
                response = await upstreams.request((HOST, server.port), Request(b"GET", b"http", b"x", b"/hold"), [])
                answers.append((response.status, await response.body.read_all()))

            inner.start_soon(hold)
            await held.wait()
            server.drain()
            release.set()
        assert answers == [(200, b"ok\n")]
        while server.statistics().connections:  # (closed once its last stream was done)
            await trio.sleep(0.01)
