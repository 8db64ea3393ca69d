"""The h2 pool against servers that end connections: every stream the upstream did not answer is sent
again or failed at once, and the connection lifetime knobs, as a real peer sees them on the wire.

Rules for this file: loopback only, port 0, every test bounded by ``trio.fail_after``; no test waits
for a duration, only for a state. The peers are real h2 servers (hyper-h2 on a trio socket, in this
process) scripted per connection, which record every frame they receive (parsed with hyperframe), so
the tests assert on the PINGs and GOAWAYs the pool sent. Anything with a timeout in it runs on a
``MockClock`` that jumps (the peers are in-process, so nothing waits on another process), and a
bound on virtual time says "at once": below hypercorn's 5 s keep-alive timeout, which the pool used
to wait out. The last test puts real hypercorn processes behind a chain.

How hypercorn ends a connection (read in ``hypercorn/protocol/h2.py``, seen on the wire): past
``keep_alive_max_requests`` it calls h2's ``close_connection()`` on the request that crossed it:
GOAWAY(NO_ERROR) naming the highest stream it accepted (once per request of that read, the same
id), and its h2 state machine is closed from then on: the streams it accepted are never answered
(their sends raise and are swallowed), any frame the client sends raises ProtocolError, which makes
it close the socket, and if none comes it closes at its keep-alive timeout, 5 s later. Its idle
close (``keep_alive_timeout``) sends nothing at all: the socket closes.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Callable

import attrs
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import hyperframe.frame
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blocks import Request, UpstreamConfig, UpstreamProtocolError, Upstreams, open_upstreams
from blocks.topology import replica_from_url
from tests.support import HOST, HYPERCORN, assemble_local, child_process, wait_for

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


@attrs.define(eq=False)
class Connection:
    """One connection as the peer saw it: the frames it received, the streams it held, its state."""

    index: int
    frames: list[tuple[str, int]] = attrs.field(factory=list)  # (frame type, its last stream id / stream id)
    held: list[tuple[int, bytes]] = attrs.field(factory=list)  # (stream id, path), not answered yet
    answered: list[int] = attrs.field(factory=list)
    goaway: int | None = None  # the last stream id of the GOAWAY it sent
    extra: bytes = b""  # frames written beside the codec, before what it queued
    closed: trio.Event = attrs.field(factory=trio.Event)
    _buffer: bytes = PREFACE

    def record(self, data: bytes) -> None:
        buffer = self._buffer + data
        if buffer.startswith(PREFACE):
            buffer = buffer[len(PREFACE) :]
        while len(buffer) >= 9:
            frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(buffer[:9]))
            if len(buffer) < 9 + length:
                break
            frame.parse_body(memoryview(buffer[9 : 9 + length]))
            buffer = buffer[9 + length :]
            kind = type(frame).__name__.removesuffix("Frame").upper()
            if kind == "PING" and "ACK" in frame.flags:
                kind = "PING-ACK"
            self.frames.append((kind, frame.last_stream_id if kind == "GOAWAY" else frame.stream_id))
        self._buffer = buffer

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.frames]


Script = Callable[[Connection, h2.connection.H2Connection, int, bytes], str]
"""What the peer does with a new stream (connection, its codec, stream id, path): ``answer`` now,
``hold`` it, ``keep`` (the script did what it does), ``close`` the socket now, ``close-after`` what is
queued went out, or ``deaf``: from now on read nothing into the codec (no PING acknowledged, nothing
answered, nothing closed)."""


@attrs.define(eq=False)
class Peer:
    """A real h2 server on a loopback socket (hyper-h2 in this process), scripted by ``script``."""

    script: Script
    idle_close: float | None = None  # close a connection without a held stream after this long, as hypercorn does
    port: int = 0
    connections: list[Connection] = attrs.field(factory=list)

    @property
    def address(self) -> tuple[str, int]:
        return (HOST, self.port)

    async def serve(self, *, task_status: trio.TaskStatus[Peer] = trio.TASK_STATUS_IGNORED) -> None:
        (listener,) = await trio.open_tcp_listeners(0, host=HOST)
        self.port = listener.socket.getsockname()[1]
        async with listener, trio.open_nursery() as nursery:
            task_status.started(self)
            while True:
                stream = await listener.accept()
                seen = Connection(len(self.connections))
                self.connections.append(seen)
                nursery.start_soon(self._run, stream, seen)

    async def _run(self, stream: trio.SocketStream, seen: Connection) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        deaf = False
        try:
            async with stream:
                await stream.send_all(conn.data_to_send())
                while True:
                    idle = self.idle_close if self.idle_close is not None and not seen.held else math.inf
                    data = b""
                    with trio.move_on_after(idle):
                        data = await stream.receive_some(65536)
                    if not data:
                        return  # the client's close, or our idle close: the socket, no GOAWAY
                    seen.record(data)
                    if deaf:
                        continue
                    try:
                        events = conn.receive_data(data)
                    except h2.exceptions.ProtocolError:
                        return  # (hypercorn's answer to a frame after its GOAWAY: it closes)
                    close = False
                    for event in events:
                        if isinstance(event, h2.events.RequestReceived):
                            path = dict(event.headers)[b":path"]
                            action = self.script(seen, conn, event.stream_id, path)
                            if action == "answer":
                                answer(conn, seen, event.stream_id)
                            elif action == "hold":
                                seen.held.append((event.stream_id, path))
                            elif action == "close":
                                return
                            deaf = deaf or action == "deaf"
                            close = close or action == "close-after"
                    extra, seen.extra = seen.extra, b""
                    await stream.send_all(extra + conn.data_to_send())
                    if close:
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            seen.closed.set()


def answer(conn: h2.connection.H2Connection, seen: Connection, sid: int) -> None:
    body = b"conn=%d stream=%d" % (seen.index, sid)
    conn.send_headers(sid, [(b":status", b"200"), (b"content-length", b"%d" % len(body))])
    conn.send_data(sid, body, end_stream=True)
    seen.answered.append(sid)


def goaway_frame(last: int) -> bytes:
    return hyperframe.frame.GoAwayFrame(stream_id=0, last_stream_id=last, error_code=0).serialize()


def request(method: bytes, path: bytes) -> Request:
    return Request(method, b"http", b"peer.test", path)


async def outcome(upstreams: Upstreams, peer: Peer, method: bytes, path: bytes) -> str:
    try:
        response = await upstreams.request(peer.address, request(method, path), [])
    except UpstreamProtocolError as exc:
        return str(exc.status)
    assert response.status == 200
    return (await response.body.read_all()).decode()


# -- GOAWAY, then the server's end: the invariant ------------------------------------------------------

MODES = ("graceful", "hypercorn", "deaf", "close")
"""What the first connection does after its GOAWAY(NO_ERROR, last): ``graceful`` answers the streams at
or below ``last`` and closes; ``hypercorn`` closes its h2 state machine with the GOAWAY (it answers
nothing more, and closes at the next frame it receives); ``deaf`` answers nothing, acknowledges
nothing, never closes; ``close`` closes at once."""

PING_TIMEOUT = 1.0


@given(
    streams=st.integers(1, 6),
    extra=st.integers(0, 3),
    cut=st.integers(0, 6),
    mode=st.sampled_from(MODES),
    post=st.integers(-1, 8),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_every_stream_a_goaway_leaves_unanswered_is_retried_or_failed_at_once(
    streams: int, extra: int, cut: int, mode: str, post: int
) -> None:
    """``streams`` concurrent requests reach the first connection, which then sends GOAWAY naming the
    ``cut``-th of them (0: none) and ends as ``mode`` says; ``extra`` more are sent meanwhile; request
    ``post`` (if any) is a bodyless POST. Every GET gets a 200 within a virtual second or so of the
    PING timeout; the POST too, unless the upstream may have processed it and did not answer (502)."""
    cut = min(cut, streams)
    total = streams + extra

    def script(seen: Connection, conn: h2.connection.H2Connection, sid: int, path: bytes) -> str:
        if seen.index > 0:
            return "answer"
        if seen.goaway is not None:
            return "hold"  # above its GOAWAY: never answered
        seen.held.append((sid, path))
        if len(seen.held) < streams:
            return "keep"
        last = seen.goaway = seen.held[cut - 1][0] if cut else 0
        if mode == "hypercorn":
            conn.close_connection(last_stream_id=last)
            return "keep"
        seen.extra += goaway_frame(last)
        if mode == "graceful":
            for below, _ in seen.held:
                if below <= last:
                    answer(conn, seen, below)
        return {"graceful": "close-after", "close": "close-after", "deaf": "deaf"}[mode]

    async def main() -> dict[bytes, str]:
        outcomes: dict[bytes, str] = {}
        async with trio.open_nursery() as nursery:
            peer: Peer = await nursery.start(Peer(script).serve)
            config = UpstreamConfig(h2_ping_timeout=PING_TIMEOUT)
            async with open_upstreams(config) as upstreams:

                async def one(i: int) -> None:
                    method = b"POST" if i == post else b"GET"
                    outcomes[b"/%d" % i] = await outcome(upstreams, peer, method, b"/%d" % i)

                with trio.fail_after(PING_TIMEOUT * 2 + 1):  # (virtual: well below hypercorn's 5 s)
                    async with trio.open_nursery() as requests:
                        for i in range(total):
                            requests.start_soon(one, i)
                retries = upstreams.statistics()[0].retries
            first = peer.connections[0]
            nursery.cancel_scope.cancel()
        check(first, outcomes, retries)
        return outcomes

    def check(first: Connection, outcomes: dict[bytes, str], retries: int) -> None:
        held = {path: sid for sid, path in first.held}
        last = first.goaway or 0
        for i in range(total):
            path = b"/%d" % i
            got = outcomes[path]
            sid = held.get(path)
            answered = sid is not None and sid in first.answered
            if answered:
                assert got == f"conn=0 stream={sid}", (path, got)
            elif i == post and sid is not None and sid <= last and mode != "graceful":
                assert got == "502", (path, got)  # cut, maybe processed: a POST is not sent twice
            else:
                assert re.fullmatch(r"conn=[1-9]\d* stream=\d+", got), (path, got)  # sent again, at once
        sent_again = sum(1 for got in outcomes.values() if not got.startswith("conn=0") and got != "502")
        assert retries == sent_again
        kinds = first.kinds()
        if mode in ("hypercorn", "deaf") and any(s <= last for s, _ in first.held if s not in first.answered):
            # Streams left waiting after the GOAWAY: the pool PINGed the server at once.
            assert "PING" in kinds[kinds.index("HEADERS") :], kinds

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- connection lifetime ---------------------------------------------------------------------------------


def answer_all(seen: Connection, conn: h2.connection.H2Connection, sid: int, path: bytes) -> str:
    return "answer"


async def test_an_idle_connection_is_closed_with_goaway_after_the_idle_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    peer: Peer = await nursery.start(Peer(answer_all).serve)
    config = UpstreamConfig(h2_idle_timeout=8.0, h2_ping_interval=None)
    with trio.fail_after(20):
        async with open_upstreams(config) as upstreams:
            assert await outcome(upstreams, peer, b"GET", b"/") == "conn=0 stream=1"
            done = trio.current_time()
            (seen,) = peer.connections
            await seen.closed.wait()
            idle = trio.current_time() - done
            assert config.h2_idle_timeout <= idle <= config.h2_idle_timeout + 2 * config.keepalive_tick
            assert seen.frames[-1] == ("GOAWAY", 0)  # NO_ERROR: (kind, last stream id); and nothing after it
            await wait_for(lambda: upstreams.statistics()[0].connections == 0)
            # The next request opens a new connection.
            assert await outcome(upstreams, peer, b"GET", b"/") == "conn=1 stream=1"


async def test_a_quiet_connection_is_pinged_and_one_whose_peer_stops_answering_ends_within_the_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    def script(seen: Connection, conn: h2.connection.H2Connection, sid: int, path: bytes) -> str:
        return "deaf" if path == b"/deaf" and seen.index == 0 else "answer"

    peer: Peer = await nursery.start(Peer(script).serve)
    config = UpstreamConfig(h2_idle_timeout=None, h2_ping_interval=4.0, h2_ping_timeout=2.0)
    with trio.fail_after(60):
        async with open_upstreams(config) as upstreams:
            assert await outcome(upstreams, peer, b"GET", b"/") == "conn=0 stream=1"
            (seen,) = peer.connections
            # Idle and quiet: PINGed every interval or so, each acknowledged (the peer's h2 does it).
            await wait_for(lambda: seen.kinds().count("PING") >= 3, seen.kinds, timeout=40)
            assert upstreams.statistics()[0].connections == 1
            # Now the peer holds a request and stops reading: no ACK comes.
            start = trio.current_time()
            got = await outcome(upstreams, peer, b"GET", b"/deaf")
            took = trio.current_time() - start
            assert got == "conn=1 stream=1"  # cut by the dead connection's end, sent again on a new one
            assert took <= config.h2_ping_interval + config.h2_ping_timeout + 2 * config.keepalive_tick
            assert seen.kinds()[-1] == "PING"  # the one that went unanswered
            assert upstreams.statistics()[0].retries == 1


async def test_a_connection_takes_max_requests_per_connection_streams_then_closes(nursery: trio.Nursery) -> None:
    peer: Peer = await nursery.start(Peer(answer_all).serve)
    with trio.fail_after(10):
        async with open_upstreams(UpstreamConfig(max_requests_per_connection=3)) as upstreams:
            got = [await outcome(upstreams, peer, b"GET", b"/") for _ in range(3)]
            # The third stream was the connection's last: its successor opened then, before any request needs it.
            await wait_for(lambda: len(peer.connections) == 2)
            got += [await outcome(upstreams, peer, b"GET", b"/") for _ in range(4)]
            assert got == [f"conn={i // 3} stream={2 * (i % 3) + 1}" for i in range(7)]
            for seen in peer.connections[:2]:
                await seen.closed.wait()
                assert seen.frames[-1] == ("GOAWAY", 0)  # ours, once its third stream was done
            assert upstreams.statistics()[0].connections == 1


@pytest.mark.parametrize(("method", "expected"), [(b"GET", "conn=1 stream=1"), (b"POST", "502")])
async def test_a_stream_sent_as_the_server_closes_an_idle_connection_is_sent_again_if_safe(
    nursery: trio.Nursery, method: bytes, expected: str
) -> None:
    # hypercorn's idle close sends nothing: the socket closes, here just as the second request's head
    # arrives (the race), unanswered.
    def script(seen: Connection, conn: h2.connection.H2Connection, sid: int, path: bytes) -> str:
        return "close" if seen.index == 0 and sid == 3 else "answer"

    peer: Peer = await nursery.start(Peer(script).serve)
    with trio.fail_after(10):
        async with open_upstreams() as upstreams:
            assert await outcome(upstreams, peer, b"GET", b"/") == "conn=0 stream=1"
            assert await outcome(upstreams, peer, method, b"/") == expected
            assert upstreams.statistics()[0].retries == (1 if method == b"GET" else 0)


# -- real hypercorn behind the chain --------------------------------------------------------------------


def h2load_counts(output: str) -> tuple[int, int, int]:
    """(succeeded, failed + errored + timed out, 2xx) from h2load's summary."""
    requests = re.search(r"(\d+) succeeded, (\d+) failed, (\d+) errored, (\d+) timeout", output)
    statuses = re.search(r"status codes: (\d+) 2xx", output)
    assert requests is not None and statuses is not None, output
    succeeded, failed, errored, timeout = (int(n) for n in requests.groups())
    return succeeded, failed + errored + timeout, int(statuses.group(1))


@pytest.mark.skipif(shutil.which("h2load") is None, reason="needs h2load (nghttp2-client)")
async def test_20000_requests_through_the_chain_to_hypercorn_over_h2c_and_h1_all_succeed(
    nursery: trio.Nursery,
) -> None:
    """hypercorn (its defaults: 1,000 requests per connection, then a GOAWAY it does not honour; 5 s
    keep-alive) as two replicas of one app, ``h2c://`` and ``http://`` on its one port, behind a
    one-process chain; h2load sends 20,000 GETs, 16 at a time. None fails, no replica is ejected."""
    with trio.fail_after(240):
        async with child_process(HYPERCORN, r"Running on http://(\S+) \(CTRL", stderr=True) as (_, match):
            address = match.group(1)
            replicas = {"hc-h2c": replica_from_url(f"h2c://{address}"), "hc-h1": replica_from_url(f"http://{address}")}
            chain = await assemble_local(nursery, replicas)
            url = f"http://{HOST}:{chain.port}/hello"
            done = await trio.run_process(
                ["h2load", "-n", "20000", "-c", "4", "-m", "4", url], capture_stdout=True, capture_stderr=True
            )
            output = done.stdout.decode()
            assert h2load_counts(output) == (20000, 0, 20000), output
            outliers = chain.proxy.outliers
            assert outliers is not None
            statistics = outliers.statistics()
            assert (statistics.ejections, statistics.failures) == (0, {}), statistics
            # Both replicas served: the worker has an h2 pool and an h1 pool to hypercorn.
            (_, worker), *_ = chain.workers
            assert {pool.protocol for pool in worker.upstreams.statistics()} == {"h2", "h1"}


async def test_a_pool_learns_the_upstreams_idle_close_and_never_sends_into_the_next_one(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # hypercorn's keep-alive timeout (5 s) closes an idle connection without a word. The first such
    # close teaches the pool; from then on a connection idle for most of that long is closed (our
    # GOAWAY) instead of being sent a request that could race the server's close: a POST too.
    peer: Peer = await nursery.start(Peer(answer_all, idle_close=5.0).serve)
    config = UpstreamConfig(h2_idle_timeout=None, h2_ping_interval=None)
    with trio.fail_after(60):
        async with open_upstreams(config) as upstreams:
            assert await outcome(upstreams, peer, b"GET", b"/") == "conn=0 stream=1"
            await peer.connections[0].closed.wait()
            await wait_for(lambda: upstreams.statistics()[0].connections == 0)
            assert await outcome(upstreams, peer, b"POST", b"/") == "conn=1 stream=1"
            await trio.sleep(4.5)  # (virtual) idle past 0.8 of the close it saw, short of the server's
            assert await outcome(upstreams, peer, b"POST", b"/") == "conn=2 stream=1"
            assert peer.connections[1].frames[-1] == ("GOAWAY", 0)  # ours, before the server's close
            await trio.sleep(3.0)  # under the limit: the connection is used
            assert await outcome(upstreams, peer, b"POST", b"/") == "conn=2 stream=3"


def test_lifetime_knobs_defaults_and_validation() -> None:
    config = UpstreamConfig()
    assert (config.max_requests_per_connection, config.h2_idle_timeout) == (1000, 60.0)
    assert (config.h2_ping_interval, config.h2_ping_timeout, config.keepalive_tick) == (30.0, 10.0, 2.5)
    off = UpstreamConfig(max_requests_per_connection=None, h2_idle_timeout=None, h2_ping_interval=None)
    assert off.keepalive_tick == off.h2_ping_timeout / 4  # (still watches the PING a GOAWAY sends)
    for bad in ({"max_requests_per_connection": 0}, {"h2_idle_timeout": 0}, {"h2_ping_interval": -1.0}):
        with pytest.raises(ValueError):
            UpstreamConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError)):
        UpstreamConfig(h2_ping_timeout=None)  # type: ignore[arg-type]
