"""A hostile HTTP/2 client against the listener and the chain: each abuse closes
the offender's connection (or resets its stream) and nothing else notices.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``; the
client is :class:`tests.support.RawFrames`, which sends frames exactly as
built. Each limit is tested at its configured value (just under passes, just
over is refused) and, where the issue names figures, at the defaults.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import AsyncIterator

import h2.errors
import httpx
import hyperframe.frame as hf
import pytest
import trio

from blocks import (
    Chain,
    EdgeConfig,
    HTTPServer,
    IterBody,
    ListenerConfig,
    LocalReplica,
    Request,
    Response,
    serve_edge,
    serve_http,
    text_response,
)
from blocks.transport._h2 import BACKLOG_HIGH
from tests.support import HOST, RawFrames, TenantReplica, assemble_local, serve_tenant_replica

CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
CANCEL = h2.errors.ErrorCodes.CANCEL
MB = 1024 * 1024


async def counted_chain(nursery: trio.Nursery) -> tuple[Chain, TenantReplica]:
    """edge -> proxy -> worker -> a replica that records every request that reaches it."""
    replica, _, local = await serve_tenant_replica(nursery)
    return await assemble_local(nursery, {"r0": local}), replica


async def slow_or_fast(request: Request) -> Response:
    """``/slow`` waits (a client's reset cancels it); ``/big`` streams 20 MiB; anything else is 200 at once."""
    if request.path == b"/slow":
        await trio.sleep(30)
    if request.path == b"/big":

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(320):
                yield b"x" * 65536

        return Response(200, [], IterBody(chunks()))
    return text_response(200, "ok\n")


async def listener(nursery: trio.Nursery, **config: object) -> HTTPServer:
    server: HTTPServer = await nursery.start(
        functools.partial(serve_http, slow_or_fast, config=ListenerConfig(**config))  # type: ignore[arg-type]
    )
    return server


async def still_serves(port: int) -> None:
    """Another client on the same listener gets its answer."""
    async with httpx.AsyncClient(http2=True, http1=False, trust_env=False) as client:
        response = await client.get(f"http://{HOST}:{port}/")
    assert response.status_code == 200


def ended_streams(frames: list[hf.Frame]) -> set[int]:
    return {f.stream_id for f in frames if "END_STREAM" in f.flags and f.stream_id}


# -- 1. rapid reset -------------------------------------------------------------------------


async def test_rapid_reset_is_cut_off_long_before_the_replica_sees_500(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        chain, replica = await counted_chain(nursery)
        async with RawFrames.open(chain.port) as raw:
            sid = 1
            for _ in range(20):  # 5,000 x (HEADERS+END_STREAM, RST_STREAM), 250 pairs a write
                pairs: list[hf.Frame] = []
                for _ in range(250):
                    pairs += [raw.request(sid), hf.RstStreamFrame(sid, error_code=CANCEL)]
                    sid += 2
                if not await raw.send(*pairs):
                    break
            goaway = await raw.goaway()
        assert goaway is not None and goaway.error_code == CALM
        assert goaway.last_stream_id < 2 * 1000, "served 1,000 streams or more before closing"
        await trio.sleep(0.3)  # whatever was relayed before the close lands now
        assert len(replica.arrivals) < 500
        await still_serves(chain.port)


@pytest.mark.parametrize("share", [0.1, 0.6])
async def test_resets_provoked_by_malformed_requests_count_as_the_clients(nursery: trio.Nursery, share: float) -> None:
    """ "MadeYouReset" (CVE-2025-8671): requests the edge must reset as malformed free their stream slots as the
    client's own resets would, so they count against ``max_client_resets`` the same way, by their share."""
    with trio.fail_after(20):
        server = await listener(nursery, max_client_resets=10)
        goaway: hf.GoAwayFrame | None = None
        reset: set[int] = set()
        async with RawFrames.open(server.port) as raw:
            sid = 1
            for _ in range(15):
                frames: list[hf.Frame] = []
                for i in range(20):
                    malformed = i < round(20 * share)
                    extra = [(b"connection", b"close")] if malformed else []  # connection-specific: malformed
                    frames.append(hf.HeadersFrame(sid, raw.block(b"/", *extra), flags=["END_HEADERS", "END_STREAM"]))
                    sid += 2
                if not await raw.send(*frames):
                    break
                while goaway is None:
                    frame = await raw.next_frame()
                    if frame is None or isinstance(frame, hf.GoAwayFrame):
                        goaway = frame if isinstance(frame, hf.GoAwayFrame) else None
                        break
                    if isinstance(frame, hf.RstStreamFrame):
                        assert frame.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
                        reset.add(frame.stream_id)
                    if frame.stream_id == sid - 2 and ("END_STREAM" in frame.flags or frame.stream_id in reset):
                        break  # the round's last stream is done
                if goaway is not None:
                    break
        if share > 0.5:
            assert goaway is not None and goaway.error_code == CALM
        else:
            assert goaway is None and len(reset) == 15 * 2
            await still_serves(server.port)


@pytest.mark.parametrize(("reset_share", "closed"), [(0.1, False), (0.6, True)])
async def test_resets_are_judged_by_their_share(nursery: trio.Nursery, reset_share: float, closed: bool) -> None:
    """``max_client_resets=10``: 30 resets in 300 streams is normal; 60% resets past 10 is an attack."""
    with trio.fail_after(20):
        server = await listener(nursery, max_client_resets=10)
        per_round, rounds = 20, 15
        cancel = round(per_round * reset_share)
        answered: set[int] = set()
        expected: set[int] = set()
        goaway: hf.GoAwayFrame | None = None
        async with RawFrames.open(server.port) as raw:
            sid = 1
            for _ in range(rounds):
                frames: list[hf.Frame] = []
                fast: set[int] = set()
                for i in range(per_round):
                    if i < cancel:
                        frames += [raw.request(sid, b"/slow"), hf.RstStreamFrame(sid, error_code=CANCEL)]
                    else:
                        frames.append(raw.request(sid))
                        fast.add(sid)
                    sid += 2
                expected |= fast
                if not await raw.send(*frames):
                    break
                while not fast <= answered:
                    frame = await raw.next_frame()
                    if frame is None or isinstance(frame, hf.GoAwayFrame):
                        goaway = frame if isinstance(frame, hf.GoAwayFrame) else None
                        break
                    answered |= ended_streams([frame])
                if goaway is not None:
                    break
        if closed:
            assert goaway is not None and goaway.error_code == CALM
            assert goaway.last_stream_id < 2 * per_round * 2  # within the second round
        else:
            assert goaway is None
            assert answered == expected and len(expected) == rounds * (per_round - cancel)


# -- 2. CONTINUATION flood ------------------------------------------------------------------------


async def test_continuation_flood_is_closed_once_the_block_passes_the_cap(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        chain, replica = await counted_chain(nursery)
        async with RawFrames.open(chain.port) as raw:
            frames: list[hf.Frame] = [hf.HeadersFrame(1, raw.block(), flags=["END_STREAM"])]
            frames += [hf.ContinuationFrame(1, b"\x00" * 16384) for _ in range(64)]  # 1 MiB, never ended
            await raw.send(*frames)
            goaway = await raw.goaway()
        assert goaway is not None and goaway.error_code == CALM
        assert replica.arrivals == []
        await still_serves(chain.port)


@pytest.mark.parametrize(("size", "refused"), [(4 * 16384, False), (4 * 16384 + 1, True)])
async def test_a_listener_that_does_not_validate_takes_heads_up_to_the_hard_cap(
    nursery: trio.Nursery, size: int, refused: bool
) -> None:
    """``validate=False`` (internal hops, which trust their peer): nothing counts a head under four
    times ``max_header_list_size``, which is served; one that decodes past that is a GOAWAY.
    (The validating listener's 431, and both caps exactly: tests/test_limits.py.)"""
    with trio.fail_after(10):
        server = await listener(nursery, max_header_list_size=16384, validate=False)
        async with RawFrames.open(server.port) as raw:
            pseudo = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"example.test"), (b":path", b"/")]
            counted = sum(len(name) + len(value) + 32 for name, value in pseudo) + len(b"x-big") + 32
            block = raw.block(b"/", (b"x-big", b"v" * (size - counted)))
            parts = [block[i : i + 16384] for i in range(0, len(block), 16384)]
            frames: list[hf.Frame] = [hf.HeadersFrame(1, parts[0], flags=["END_STREAM"])]
            frames += [hf.ContinuationFrame(1, part) for part in parts[1:]]
            frames[-1].flags.add("END_HEADERS")
            await raw.send(*frames)
            reply = await raw.until(lambda f: isinstance(f, hf.GoAwayFrame | hf.HeadersFrame))
        if refused:
            assert isinstance(reply, hf.GoAwayFrame) and reply.error_code == CALM
        else:
            assert isinstance(reply, hf.HeadersFrame) and raw.status(1) == b"200"


@pytest.mark.parametrize(("empty", "refused"), [(3, False), (4, True)])
async def test_empty_continuations_are_counted(nursery: trio.Nursery, empty: int, refused: bool) -> None:
    with trio.fail_after(10):
        server = await listener(nursery, max_empty_frames=3)
        async with RawFrames.open(server.port) as raw:
            block = raw.block()
            frames: list[hf.Frame] = [hf.HeadersFrame(1, block[:5], flags=["END_STREAM"])]
            frames += [hf.ContinuationFrame(1, b"") for _ in range(empty)]
            frames.append(hf.ContinuationFrame(1, block[5:], flags=["END_HEADERS"]))
            await raw.send(*frames)
            reply = await raw.until(lambda f: isinstance(f, hf.GoAwayFrame | hf.HeadersFrame))
        if refused:
            assert isinstance(reply, hf.GoAwayFrame) and reply.error_code == CALM
        else:
            assert isinstance(reply, hf.HeadersFrame) and reply.stream_id == 1


# -- 3. HPACK bomb --------------------------------------------------------------------------------


async def test_hpack_bomb_is_refused_before_any_replica(nursery: trio.Nursery) -> None:
    """8 KB on the wire that decode to 16 MB: one 4,000-byte field indexed once, then referenced 4,000 times."""
    with trio.fail_after(20):
        chain, replica = await counted_chain(nursery)
        async with RawFrames.open(chain.port) as raw:
            block = raw.block(b"/", (b"x-bomb", b"b" * 4000))  # x-bomb is now dynamic index 62
            block += b"\xbe" * 4000  # indexed field 62, 4,000 times
            assert len(block) < 8500
            await raw.send(hf.HeadersFrame(1, block, flags=["END_HEADERS", "END_STREAM"]))
            goaway = await raw.goaway()
        assert goaway is not None
        assert goaway.error_code in (CALM, h2.errors.ErrorCodes.COMPRESSION_ERROR)
        assert replica.arrivals == []
        await still_serves(chain.port)


# -- 4. floods ----------------------------------------------------------------------------------


def flood_frame(kind: str) -> hf.Frame:
    if kind == "PING":
        return hf.PingFrame(0, opaque_data=b"12345678")
    if kind == "SETTINGS":
        return hf.SettingsFrame(0)
    if kind == "PRIORITY":
        return hf.PriorityFrame(3, depends_on=0, stream_weight=16)
    if kind == "WINDOW_UPDATE":
        return hf.WindowUpdateFrame(0, window_increment=1)
    assert kind == "empty DATA"
    return hf.DataFrame(1, b"")


@pytest.mark.parametrize("kind", ["PING", "SETTINGS", "PRIORITY", "WINDOW_UPDATE", "empty DATA"])
async def test_a_flood_from_a_client_that_never_reads_is_closed(nursery: trio.Nursery, kind: str) -> None:
    """20,000 frames of one kind, nothing read: GOAWAY(ENHANCE_YOUR_CALM) well within 10 s (defaults)."""
    with trio.fail_after(10):
        server = await listener(nursery)
        async with RawFrames.open(server.port) as raw:
            if kind == "empty DATA":
                await raw.send(raw.request(1, b"/slow", end_stream=False))
            frame = flood_frame(kind).serialize()
            for _ in range(20):
                if not await raw.send(frame * 1000):
                    break
            goaway = await raw.goaway()
        assert goaway is not None and goaway.error_code == CALM
        with trio.fail_after(5):
            while server.statistics().connections:
                await trio.sleep(0.01)
        await still_serves(server.port)


async def test_flood_limit_is_the_configured_number_of_control_frames(nursery: trio.Nursery) -> None:
    """``flood_limit=50``: the client's SETTINGS and 49 PINGs are answered; the 50th PING closes."""
    with trio.fail_after(10):
        server = await listener(nursery, flood_limit=50)
        async with RawFrames.open(server.port) as raw:
            await raw.send(*[hf.PingFrame(0, opaque_data=b"%08d" % i) for i in range(49)])
            for _ in range(49):
                ack = await raw.until(lambda f: isinstance(f, hf.PingFrame | hf.GoAwayFrame))
                assert isinstance(ack, hf.PingFrame) and "ACK" in ack.flags
            await raw.send(hf.PingFrame(0, opaque_data=b"last one"))
            reply = await raw.until(lambda f: isinstance(f, hf.PingFrame | hf.GoAwayFrame))
        assert isinstance(reply, hf.GoAwayFrame) and reply.error_code == CALM


async def test_a_client_that_does_not_read_a_big_response_holds_a_bounded_backlog(nursery: trio.Nursery) -> None:
    """A 20 MiB response to a client whose windows are wide open but who does not read:
    the connection's backlog stays near BACKLOG_HIGH (back-pressure, not a close), then all of it arrives."""
    with trio.fail_after(20):
        server = await listener(nursery)
        wide = {hf.SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1}
        async with RawFrames.open(server.port, settings=wide) as raw:
            await raw.send(hf.WindowUpdateFrame(0, window_increment=2**31 - 1 - 65535), raw.request(1, b"/big"))
            await trio.sleep(1.0)
            (conn,) = server._connections
            backlog = conn.proto.backlog
            assert backlog <= BACKLOG_HIGH + 2 * 65536
            received = 0
            while True:
                frame = await raw.next_frame()
                assert frame is not None, "the server closed the connection"
                if isinstance(frame, hf.DataFrame):
                    received += len(frame.data)
                    if "END_STREAM" in frame.flags:
                        break
        assert received == 20 * MB


# -- 6. body limits -------------------------------------------------------------------------------


class BodyCounter:
    """A replica that reads every request body and records how many bytes it got."""

    def __init__(self) -> None:
        self.received: list[int] = []

    async def __call__(self, request: Request) -> Response:
        total = 0
        try:
            while chunk := await request.body.receive():
                total += len(chunk)
        finally:
            self.received.append(total)
        return text_response(200, f"{total}\n")


async def limited_edge(nursery: trio.Nursery, limit: int) -> tuple[int, BodyCounter]:
    """A chain whose edge allows ``limit`` body bytes; the replica counts what it receives."""
    counter = BodyCounter()
    replica: HTTPServer = await nursery.start(functools.partial(serve_http, counter))
    chain = await assemble_local(nursery, {"r0": LocalReplica((HOST, replica.port), "h2")})
    edge: HTTPServer = await nursery.start(
        functools.partial(
            serve_edge,
            EdgeConfig(proxy=(HOST, chain.proxy_server.port)),
            listener=ListenerConfig(max_request_body=limit),
        )
    )
    return edge.port, counter


async def test_a_declared_length_over_the_limit_is_413_before_anything_is_read(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        port, counter = await limited_edge(nursery, 1000)
        async with RawFrames.open(port) as raw:
            head = raw.block(b"/", (b"content-length", b"1001"), method=b"POST")
            await raw.send(hf.HeadersFrame(1, head, flags=["END_HEADERS"]))
            reply = await raw.until(lambda f: isinstance(f, hf.HeadersFrame | hf.GoAwayFrame))
            assert isinstance(reply, hf.HeadersFrame)
            assert raw.status(1) == b"413"
        assert counter.received == []


@pytest.mark.parametrize(("sent", "allowed"), [(1000, True), (1001, False)])
async def test_a_streamed_body_is_cut_at_the_limit(nursery: trio.Nursery, sent: int, allowed: bool) -> None:
    """No content-length: the edge counts. At the limit it passes; past it the client gets 413
    (or a reset) and the replica has seen at most the limit."""
    with trio.fail_after(10):
        port, counter = await limited_edge(nursery, 1000)
        async with RawFrames.open(port) as raw:
            head = raw.block(b"/", method=b"POST")
            await raw.send(hf.HeadersFrame(1, head, flags=["END_HEADERS"]), hf.DataFrame(1, b"a" * 600))
            await trio.sleep(0.1)  # the first part reaches the replica first
            await raw.send(hf.DataFrame(1, b"b" * (sent - 600), flags=["END_STREAM"]))
            reply = await raw.until(lambda f: isinstance(f, hf.HeadersFrame | hf.RstStreamFrame) and f.stream_id == 1)
            if allowed:
                assert isinstance(reply, hf.HeadersFrame) and raw.status(1) == b"200"
            else:
                assert isinstance(reply, hf.RstStreamFrame) or raw.status(1) == b"413"
        with trio.fail_after(5):
            while not counter.received:
                await trio.sleep(0.01)
        assert max(counter.received) <= 1000


async def test_a_streamed_body_past_the_limit_fails_the_handlers_read(nursery: trio.Nursery) -> None:
    """The task path (no splice): the handler's read raises, the client gets 413."""
    with trio.fail_after(10):
        counter = BodyCounter()
        server: HTTPServer = await nursery.start(
            functools.partial(serve_http, counter, config=ListenerConfig(max_request_body=1000))
        )
        async with RawFrames.open(server.port) as raw:
            head = raw.block(b"/", method=b"POST")
            await raw.send(
                hf.HeadersFrame(1, head, flags=["END_HEADERS"]), hf.DataFrame(1, b"a" * 1001, flags=["END_STREAM"])
            )
            reply = await raw.until(lambda f: isinstance(f, hf.HeadersFrame) and f.stream_id == 1)
            assert reply is not None and raw.status(1) == b"413"
        assert counter.received == [0]


# -- 5. timeouts ----------------------------------------------------------------------------------


class Streamer:
    """A replica streaming ``/big`` (10 MiB) that notes whether the chain cancelled it."""

    def __init__(self) -> None:
        self.cancelled = trio.Event()

    async def __call__(self, request: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                for _ in range(160):
                    yield b"x" * 65536
            except BaseException:
                self.cancelled.set()
                raise

        return Response(200, [], IterBody(chunks()))


async def test_a_zero_window_stalls_only_until_stall_timeout_and_the_replica_stream_is_cancelled(
    nursery: trio.Nursery,
) -> None:
    """Through the chain (the spliced path): a client that never opens its window is reset
    after ``stall_timeout``, the replica's stream is cancelled, and the connection lives on."""
    with trio.fail_after(15):
        streamer = Streamer()
        replica: HTTPServer = await nursery.start(functools.partial(serve_http, streamer))
        chain = await assemble_local(nursery, {"r0": LocalReplica((HOST, replica.port), "h2")})
        edge: HTTPServer = await nursery.start(
            functools.partial(
                serve_edge,
                EdgeConfig(proxy=(HOST, chain.proxy_server.port)),
                listener=ListenerConfig(stall_timeout=1.0),
            )
        )
        async with RawFrames.open(edge.port, settings={hf.SettingsFrame.INITIAL_WINDOW_SIZE: 0}) as raw:
            await raw.send(raw.request(1, b"/big"))
            started = trio.current_time()
            reset = await raw.until(lambda f: isinstance(f, hf.RstStreamFrame | hf.GoAwayFrame))
            assert isinstance(reset, hf.RstStreamFrame) and reset.stream_id == 1
            assert trio.current_time() - started >= 1.0
            await streamer.cancelled.wait()
            await raw.send(hf.PingFrame(0, opaque_data=b"stillok?"))
            pong = await raw.until(lambda f: isinstance(f, hf.PingFrame))
            assert isinstance(pong, hf.PingFrame) and pong.opaque_data == b"stillok?"


async def test_a_slow_reader_that_makes_progress_is_not_reset(nursery: trio.Nursery) -> None:
    """The stall clock restarts with every bit of progress: a reader opening 16 KiB every 0.2 s
    keeps its stream for three times ``stall_timeout``; one that stops is reset (the task path)."""
    with trio.fail_after(15):
        server = await listener(nursery, stall_timeout=0.6)
        async with RawFrames.open(server.port, settings={hf.SettingsFrame.INITIAL_WINDOW_SIZE: 16384}) as raw:
            await raw.send(raw.request(1, b"/big"))
            received = 0
            with trio.move_on_after(1.8):
                while True:
                    frame = await raw.next_frame()
                    assert not isinstance(frame, hf.RstStreamFrame | hf.GoAwayFrame) and frame is not None
                    if isinstance(frame, hf.DataFrame) and frame.data:
                        received += len(frame.data)
                        await trio.sleep(0.2)
                        await raw.send(
                            hf.WindowUpdateFrame(1, window_increment=len(frame.data)),
                            hf.WindowUpdateFrame(0, window_increment=len(frame.data)),
                        )
            assert received >= 4 * 16384
            reset = await raw.until(lambda f: isinstance(f, hf.RstStreamFrame))
            assert reset is not None and reset.stream_id == 1


async def test_a_request_body_that_trickles_past_request_body_timeout_gets_408(nursery: trio.Nursery) -> None:
    """One byte every 0.2 s with ``request_body_timeout=1``: 408, and the handler never saw the end."""
    with trio.fail_after(10):
        counter = BodyCounter()
        server: HTTPServer = await nursery.start(
            functools.partial(serve_http, counter, config=ListenerConfig(request_body_timeout=1.0))
        )
        async with RawFrames.open(server.port) as raw:
            await raw.send(hf.HeadersFrame(1, raw.block(b"/", method=b"POST"), flags=["END_HEADERS"]))
            started = trio.current_time()
            async with trio.open_nursery() as trickle:

                async def one_byte_at_a_time() -> None:
                    for _ in range(50):
                        if not await raw.send(hf.DataFrame(1, b"x")):
                            return
                        await trio.sleep(0.2)

                trickle.start_soon(one_byte_at_a_time)
                reply = await raw.until(lambda f: isinstance(f, hf.HeadersFrame | hf.RstStreamFrame))
                trickle.cancel_scope.cancel()
            assert trio.current_time() - started >= 1.0
            assert isinstance(reply, hf.HeadersFrame) and raw.status(1) == b"408"
        assert counter.received and counter.received[0] < 50


async def test_a_slow_preface_is_closed_by_first_bytes_timeout(nursery: trio.Nursery) -> None:
    """The 24-byte preface at one byte per 0.2 s, ``first_bytes_timeout=0.5``: closed mid-preface."""
    with trio.fail_after(10):
        server = await listener(nursery, first_bytes_timeout=0.5)
        sent = 0
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            with contextlib.suppress(trio.BrokenResourceError):
                for byte in b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n":
                    await stream.send_all(bytes([byte]))
                    sent += 1
                    await trio.sleep(0.2)
        assert sent < 24, "the server waited for the whole slow preface"
        assert server.statistics().connections == 0


async def test_an_idle_h2_connection_is_closed_after_h2_idle_timeout(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        server = await listener(nursery, h2_idle_timeout=0.5)
        async with RawFrames.open(server.port) as raw:
            # The server's idle time starts once its stream closed, which is after the request
            # went out (and before this client reads the answer, which a busy machine delays).
            sent = trio.current_time()
            await raw.send(raw.request(1))  # one exchange, then nothing
            await raw.until(lambda f: isinstance(f, hf.DataFrame) and "END_STREAM" in f.flags)
            goaway = await raw.goaway()
            assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.NO_ERROR
            assert goaway.last_stream_id == 1
            assert trio.current_time() - sent >= 0.5


async def test_a_connection_with_short_requests_more_often_than_h2_idle_timeout_is_not_idle(
    nursery: trio.Nursery,
) -> None:
    """Requests that each end within a watchdog's tick still make the connection busy: one every
    0.1 s for two and a half ``h2_idle_timeout`` (1 s), and no GOAWAY; then, idle, it is closed."""
    with trio.fail_after(20):
        server = await listener(nursery, h2_idle_timeout=1.0)
        async with RawFrames.open(server.port) as raw:
            for sid in range(1, 51, 2):
                await raw.send(raw.request(sid))
                frame = await raw.until(lambda f: isinstance(f, hf.GoAwayFrame) or "END_STREAM" in f.flags)
                assert not isinstance(frame, hf.GoAwayFrame), f"closed as idle after {sid // 2} requests"
                await trio.sleep(0.1)
            goaway = await raw.goaway()
            assert goaway is not None and goaway.error_code == h2.errors.ErrorCodes.NO_ERROR


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_an_allowed_200_mb_upload_streams_through_the_chain_in_bounded_memory(nursery: trio.Nursery) -> None:
    """200 MiB up through edge, proxy and worker (all in this process) to a replica that counts
    it: every byte arrives, and this process never holds 10 MiB more than before. (About 15 s on a
    quiet machine; the bound is for a hang, far above what a CPU hog beside the suite makes of it.)"""
    with trio.fail_after(600):
        port, counter = await limited_edge(nursery, 256 * MB)
        chunk = b"u" * 65536

        async def upload() -> AsyncIterator[bytes]:
            for _ in range(200 * MB // len(chunk)):
                yield chunk

        baseline = resident_bytes()
        peak = baseline

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, resident_bytes())
                await trio.sleep(0.02)

        async with trio.open_nursery() as watching:
            watching.start_soon(watch)
            async with httpx.AsyncClient(http2=True, http1=False, trust_env=False, timeout=None) as client:
                response = await client.post(f"http://{HOST}:{port}/", content=upload())
            watching.cancel_scope.cancel()
        assert response.status_code == 200 and response.text == f"{200 * MB}\n"
        assert counter.received == [200 * MB]
        assert peak - baseline < 10 * MB, f"{(peak - baseline) / MB:.1f} MiB more at the peak"
