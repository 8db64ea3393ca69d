"""Isolation on shared connections: an abusive client never harms a well-behaved
client whose requests share the pooled upstream connections with its own.

Every test builds the chain with one pooled connection per hop::

    good client ─┐
                 ├─> EDGE ══1══> PROXY ══1══> WORKER ══1══> RecordingReplica
    abuser ──────┘

(``UpstreamConfig(max_connections=1)`` at the edge, the proxy and the
worker), so both clients' requests travel as streams of the same three
upstream connections. While the abuser does its worst on its own client
connection, the good client sends a steady stream of GETs on its own. Then:

- the good client saw no error: every response 200, complete, its own;
- the proxy and the worker each accepted exactly one connection, and it is
  still open: the shared connections were never closed or replaced;
- the replica's end of the shared connection saw no GOAWAY and no close, and
  nothing but ``RST_STREAM(CANCEL)``, only on the abuser's streams.

The replica is a bare ``h2`` server (:class:`RecordingReplica`) so that it
can record what a proxyblocks listener would hide: every reset code, a
GOAWAY, the peer closing, and its own send windows.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``;
abusers are :class:`tests.support.RawFrames`, which sends frames exactly as
built; counts are bounded.
"""

from __future__ import annotations

import collections
import functools
import socket
import struct
from collections.abc import Awaitable, Callable

import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import httpx
import hyperframe.frame as hf
import pytest
import trio

from blocks import (
    INTERNAL_LISTENER,
    EdgeConfig,
    HTTPServer,
    ListenerConfig,
    LocalReplica,
    Replica,
    RouteTable,
    UpstreamConfig,
    serve_edge,
    serve_proxy,
    serve_worker,
)
from blocks.transport._h2 import RECEIVE_SIZE
from tests.support import H2_PREFACE, HOST, RawFrames, RawH2Client, wait_for

CALM = h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
CANCEL = h2.errors.ErrorCodes.CANCEL
ONE = UpstreamConfig(max_connections=1)
WINDOW = ONE.stream_window  # every hop's upstream stream window (256 KiB)
DEFAULT_WINDOW = 65535
MB = 1024 * 1024


# -- the replica --------------------------------------------------------------------------


@attrs.define(eq=False)
class ReplicaConnection:
    """What one connection to the replica went through."""

    conn: h2.connection.H2Connection
    paths: dict[int, bytes] = attrs.field(factory=dict)  # every stream opened, by id
    resets: dict[int, int] = attrs.field(factory=dict)  # RST_STREAM received: stream id -> error code
    sent: dict[int, int] = attrs.field(factory=dict)  # response body bytes sent, by stream id
    goaway: int | None = None  # the error code of a GOAWAY received
    closed_by_peer: bool = False
    protocol_error: str | None = None
    uploads: dict[int, trio.Event] = attrs.field(factory=dict)  # request body ended, by stream id
    uploaded: dict[int, int] = attrs.field(factory=dict)
    scopes: dict[int, trio.CancelScope] = attrs.field(factory=dict)  # each responder's, cancelled by a reset
    window_changed: trio.Event = attrs.field(factory=trio.Event)
    outgoing: trio.Event = attrs.field(factory=trio.Event)

    def wake(self) -> None:
        self.window_changed.set()
        self.window_changed = trio.Event()

    def send_soon(self) -> None:
        self.outgoing.set()

    def abuser_streams(self) -> dict[int, bytes]:
        return {sid: path for sid, path in self.paths.items() if path.startswith(b"/abuse")}


@attrs.define(eq=False)
class RecordingReplica:
    """A bare h2 server that answers every stream and records what its peers do.

    - ``.../hold``: never answers (until the stream is reset);
    - ``.../stream/N``: 200 and N bytes of body, in 16 KiB frames, as its
      send windows allow;
    - a POST: reads the whole body, then 200;
    - anything else: 200 ``ok <path> 0`` at once.

    Responders only call into the state machine; one writer task per
    connection sends what they queued, so that a responder cancelled by a
    reset never cuts a write (and the framing) short.
    """

    port: int = 0
    connections: list[ReplicaConnection] = attrs.field(factory=list)

    async def serve(self, stream: trio.SocketStream) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        rc = ReplicaConnection(h2.connection.H2Connection(config))
        self.connections.append(rc)
        conn = rc.conn
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000})
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, rc, stream)
            rc.send_soon()
            try:
                while True:
                    data = await stream.receive_some(65536)
                    if not data:
                        rc.closed_by_peer = True
                        return
                    try:
                        events = conn.receive_data(data)
                    except h2.exceptions.ProtocolError as exc:
                        rc.protocol_error = repr(exc)
                        return
                    for event in events:
                        self._on_event(rc, event, nursery)
                    rc.wake()
                    rc.send_soon()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                rc.closed_by_peer = True
            finally:
                nursery.cancel_scope.cancel()

    async def _writer(self, rc: ReplicaConnection, stream: trio.SocketStream) -> None:
        while True:
            await rc.outgoing.wait()
            rc.outgoing = trio.Event()
            data = rc.conn.data_to_send()
            if data:
                await stream.send_all(data)

    def _on_event(self, rc: ReplicaConnection, event: h2.events.Event, nursery: trio.Nursery) -> None:
        if isinstance(event, h2.events.RequestReceived):
            head = dict(event.headers)
            sid = event.stream_id
            rc.paths[sid] = head[b":path"]
            if event.stream_ended is None:
                rc.uploads[sid] = trio.Event()
                rc.uploaded[sid] = 0
            rc.scopes[sid] = trio.CancelScope()
            nursery.start_soon(self._respond, rc, sid)
        elif isinstance(event, h2.events.DataReceived):
            rc.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if event.stream_id in rc.uploaded:
                rc.uploaded[event.stream_id] += len(event.data)
        elif isinstance(event, h2.events.StreamEnded):
            if event.stream_id in rc.uploads:
                rc.uploads[event.stream_id].set()
        elif isinstance(event, h2.events.StreamReset):
            rc.resets[event.stream_id] = event.error_code
            if event.stream_id in rc.scopes:
                rc.scopes[event.stream_id].cancel()
        elif isinstance(event, h2.events.ConnectionTerminated):
            rc.goaway = event.error_code

    async def _respond(self, rc: ReplicaConnection, sid: int) -> None:
        conn = rc.conn
        path = rc.paths[sid]
        with rc.scopes[sid]:
            try:
                if path.endswith(b"/hold"):
                    await trio.sleep_forever()
                if sid in rc.uploads:
                    await rc.uploads[sid].wait()
                if b"/stream/" in path:
                    size = int(path.rsplit(b"/", 1)[1])
                    conn.send_headers(sid, [(b":status", b"200"), (b"content-length", b"%d" % size)])
                    rc.sent[sid] = 0
                    while rc.sent[sid] < size:
                        rc.send_soon()
                        room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                        if room <= 0:
                            await rc.window_changed.wait()
                            continue
                        n = min(room, size - rc.sent[sid])
                        conn.send_data(sid, b"x" * n, end_stream=rc.sent[sid] + n == size)
                        rc.sent[sid] += n
                        await trio.lowlevel.checkpoint()
                else:
                    body = b"ok %s %d\n" % (path, rc.uploaded.get(sid, 0))
                    conn.send_headers(sid, [(b":status", b"200"), (b"content-length", b"%d" % len(body))])
                    conn.send_data(sid, body, end_stream=True)
                rc.send_soon()
            except h2.exceptions.ProtocolError:
                pass  # the stream went away under us


async def serve_recording_replica(*, task_status: trio.TaskStatus[RecordingReplica] = trio.TASK_STATUS_IGNORED) -> None:
    replica = RecordingReplica()
    listeners = await trio.open_tcp_listeners(0, host=HOST)
    replica.port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, replica.serve, listeners)
        task_status.started(replica)


# -- the shared chain -----------------------------------------------------------------------


@attrs.define
class Shared:
    """A chain with one pooled connection per hop, and its recording replica."""

    edge: HTTPServer
    proxy: HTTPServer
    worker: HTTPServer
    replica: RecordingReplica

    @property
    def port(self) -> int:
        return self.edge.port

    def upstream(self) -> ReplicaConnection:
        """The replica's end of the one worker -> replica connection."""
        assert len(self.replica.connections) == 1, f"{len(self.replica.connections)} connections to the replica"
        return self.replica.connections[0]


async def shared_chain(
    nursery: trio.Nursery, listener: ListenerConfig | None = None, *, internal: ListenerConfig = INTERNAL_LISTENER
) -> Shared:
    """edge (``listener``) -> proxy -> worker (both ``internal``) -> a recording replica, one connection per hop.

    (``assemble_local`` takes no listener settings for the internal hops, hence this.)
    """
    replica: RecordingReplica = await nursery.start(serve_recording_replica)
    local = LocalReplica((HOST, replica.port), "h2")
    worker, _ = await nursery.start(functools.partial(serve_worker, {"r0": local}, listener=internal, upstream=ONE))
    route = Replica(name="r0", worker=(HOST, worker.port), address=local.address, protocol=local.protocol)
    table = RouteTable.build({"*": "app"}, {"app": [route]})
    proxy, _ = await nursery.start(functools.partial(serve_proxy, table, listener=internal, upstream=ONE))
    edge: HTTPServer = await nursery.start(
        functools.partial(serve_edge, EdgeConfig(proxy=(HOST, proxy.port)), listener=listener, upstream=ONE)
    )
    return Shared(edge, proxy, worker, replica)


@attrs.define
class GoodLog:
    ok: int = 0
    errors: list[str] = attrs.field(factory=list)


async def good_client(port: int, done: trio.Event, log: GoodLog, *, lanes: int = 3, after: int = 10) -> None:
    """Sequential GETs on ``lanes`` concurrent streams of one h2 connection, until
    ``done`` is set and each lane has made ``after`` more; every answer is checked."""
    async with httpx.AsyncClient(http2=True, http1=False, trust_env=False, timeout=10.0) as client:
        counter = iter(range(10**6))

        async def lane() -> None:
            extra = 0
            for _ in range(400):
                if done.is_set():
                    extra += 1
                    if extra > after:
                        return
                path = f"/good/{next(counter)}"
                try:
                    response = await client.get(f"http://{HOST}:{port}{path}")
                except httpx.HTTPError as exc:
                    log.errors.append(f"{path}: {exc!r}")
                    continue
                if response.status_code != 200 or response.content != b"ok %s 0\n" % path.encode():
                    log.errors.append(f"{path}: {response.status_code} {response.content[:100]!r}")
                elif response.http_version != "HTTP/2":
                    log.errors.append(f"{path}: {response.http_version}")
                else:
                    log.ok += 1

        async with trio.open_nursery() as nursery:
            for _ in range(lanes):
                nursery.start_soon(lane)


async def beside_good_client(shared: Shared, abuse: Callable[[], Awaitable[None]]) -> GoodLog:
    """Run ``abuse`` while a good client goes on through the same chain; the good client's log."""
    log = GoodLog()
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(good_client, shared.port, done, log)
        await wait_for(lambda: log.ok >= 10 or bool(log.errors), "the good client's first answers")
        before = log.ok
        try:
            await abuse()
        finally:
            done.set()
    assert log.errors == []
    assert log.ok - before >= 30, "the good client did not go on beside and after the abuse"
    return log


def assert_isolated(shared: Shared) -> ReplicaConnection:
    """Every shared connection survived; the replica saw only CANCELs, only on the abuser's streams."""
    for server in (shared.proxy, shared.worker):
        stats = server.statistics()
        assert (stats.accepted, stats.connections) == (1, 1), f"the shared connection was replaced: {stats}"
    rc = shared.upstream()
    assert rc.goaway is None, f"the replica got GOAWAY({rc.goaway!r})"
    assert not rc.closed_by_peer, "the replica's shared connection was closed"
    assert rc.protocol_error is None
    assert set(rc.resets.values()) <= {CANCEL}, rc.resets
    assert set(rc.resets) <= set(rc.abuser_streams()), "a good client's stream was reset"
    return rc


async def open_held_streams(raw: RawFrames, shared: Shared, count: int, first: int = 1) -> list[int]:
    """Open ``count`` streams that the replica holds, and wait until all reach it."""
    sids = list(range(first, first + 2 * count, 2))
    # Counted before the send: the send yields, and in that time the chain
    # may carry some or all of the new streams to the replica already.
    have = len(shared.upstream().abuser_streams()) if shared.replica.connections else 0
    await raw.send(*[raw.request(sid, b"/abuse/hold") for sid in sids])
    await wait_for(lambda: len(shared.upstream().abuser_streams()) >= have + count, "the held streams at the replica")
    return sids


async def held_streams_are_cancelled(shared: Shared, count: int) -> None:
    """The abuser's held streams were each cancelled upstream (and only cancelled)."""
    rc = shared.upstream()
    held = {sid for sid, path in rc.abuser_streams().items() if path.endswith(b"/hold")}
    assert len(held) == count
    await wait_for(lambda: held <= set(rc.resets), lambda: f"resets at the replica: {rc.resets}")


# -- 1. abuse beside a good client --------------------------------------------------------------


# A hop's upstream peer is another hop, whose streams are every client's: each
# client's reset reaches the next hop as a RST_STREAM(CANCEL) on the shared
# connection. Were internal hops to count them as the edge does (rapid reset),
# they would close the shared connection; INTERNAL_LISTENER turns the
# per-client limits off.


async def test_rapid_reset_beside_a_good_client(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        shared = await shared_chain(nursery)
        goaway: list[hf.GoAwayFrame | None] = []

        async def abuse() -> None:
            async with RawFrames.open(shared.port) as raw:
                sid = 1
                for _ in range(20):  # up to 5,000 x (HEADERS+END_STREAM, RST_STREAM), 250 pairs a write
                    pairs: list[hf.Frame] = []
                    for _ in range(250):
                        pairs += [raw.request(sid, b"/abuse/hold"), hf.RstStreamFrame(sid, error_code=CANCEL)]
                        sid += 2
                    if not await raw.send(*pairs):
                        break
                goaway.append(await raw.goaway())
            await trio.sleep(0.3)  # what was relayed before the close lands upstream
            assert goaway[0] is not None and goaway[0].error_code == CALM
            rc = shared.upstream()
            assert rc.abuser_streams(), "no reset stream reached the replica: the test proves nothing"
            await wait_for(lambda: set(rc.abuser_streams()) <= set(rc.resets), "every abusive stream cancelled")

        await beside_good_client(shared, abuse)
        assert_isolated(shared)


async def test_cancels_spread_over_connections_beside_a_good_client(nursery: trio.Nursery) -> None:
    """Four connections, each opening 160 requests in rounds of 40 and cancelling each round once
    the replica has it: every connection stays well under the edge's limit (no GOAWAY for the
    abuser), but upstream all 640 resets land on the one shared connection."""
    with trio.fail_after(20):
        shared = await shared_chain(nursery)

        async def abuse() -> None:
            for _ in range(4):
                async with RawFrames.open(shared.port) as raw:
                    for first in range(1, 2 * 160, 2 * 40):
                        sids = await open_held_streams(raw, shared, 40, first)
                        await raw.send(*[hf.RstStreamFrame(sid, error_code=CANCEL) for sid in sids])
                    await raw.send(hf.PingFrame(0, opaque_data=b"all sent"))
                    reply = await raw.until(lambda f: isinstance(f, hf.GoAwayFrame | hf.PingFrame))
                    assert isinstance(reply, hf.PingFrame), f"the abuser was closed: {reply!r}"
            rc = shared.upstream()
            assert len(rc.abuser_streams()) == 4 * 160
            await wait_for(lambda: set(rc.abuser_streams()) <= set(rc.resets), "every abusive stream cancelled")

        await beside_good_client(shared, abuse)
        assert_isolated(shared)


async def test_continuation_flood_beside_a_good_client(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        shared = await shared_chain(nursery)
        goaway: list[hf.GoAwayFrame | None] = []

        async def abuse() -> None:
            async with RawFrames.open(shared.port) as raw:
                await open_held_streams(raw, shared, 5)
                frames: list[hf.Frame] = [hf.HeadersFrame(11, raw.block(b"/abuse/flood"), flags=["END_STREAM"])]
                frames += [hf.ContinuationFrame(11, b"\x00" * 16384) for _ in range(64)]  # 1 MiB, never ended
                await raw.send(*frames)
                goaway.append(await raw.goaway())
            await held_streams_are_cancelled(shared, 5)

        await beside_good_client(shared, abuse)
        assert goaway[0] is not None and goaway[0].error_code == CALM
        rc = assert_isolated(shared)
        assert b"/abuse/flood" not in rc.paths.values()


async def test_hpack_bomb_beside_a_good_client(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        shared = await shared_chain(nursery)
        goaway: list[hf.GoAwayFrame | None] = []

        async def abuse() -> None:
            async with RawFrames.open(shared.port) as raw:
                await open_held_streams(raw, shared, 5)
                block = raw.block(b"/abuse/bomb", (b"x-bomb", b"b" * 4000))  # x-bomb: the newest dynamic entry
                block += b"\xbe" * 4000  # indexed field 62, 4,000 times: 16 MB decoded
                await raw.send(hf.HeadersFrame(11, block, flags=["END_HEADERS", "END_STREAM"]))
                goaway.append(await raw.goaway())
            await held_streams_are_cancelled(shared, 5)

        await beside_good_client(shared, abuse)
        assert goaway[0] is not None
        assert goaway[0].error_code in (CALM, h2.errors.ErrorCodes.COMPRESSION_ERROR)
        rc = assert_isolated(shared)
        assert b"/abuse/bomb" not in rc.paths.values()


async def test_ping_flood_beside_a_good_client(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        shared = await shared_chain(nursery)
        goaway: list[hf.GoAwayFrame | None] = []

        async def abuse() -> None:
            async with RawFrames.open(shared.port) as raw:
                await open_held_streams(raw, shared, 5)
                ping = hf.PingFrame(0, opaque_data=b"12345678").serialize()
                for _ in range(20):  # 20,000 PINGs, nothing read
                    if not await raw.send(ping * 1000):
                        break
                goaway.append(await raw.goaway())
            await held_streams_are_cancelled(shared, 5)

        await beside_good_client(shared, abuse)
        assert goaway[0] is not None and goaway[0].error_code == CALM
        assert_isolated(shared)


async def test_streams_reset_mid_response_beside_a_good_client(nursery: trio.Nursery) -> None:
    """30 streams reset after their first DATA: each is cancelled upstream, nothing else is."""
    with trio.fail_after(20):
        shared = await shared_chain(nursery)

        async def abuse() -> None:
            async with RawFrames.open(shared.port) as raw:
                # The connection window wide open, so every stream gets its first DATA; stream windows stay shut.
                await raw.send(hf.WindowUpdateFrame(0, window_increment=16 * MB))
                sid = 1
                for _ in range(3):
                    sids = list(range(sid, sid + 20, 2))
                    sid += 20
                    await raw.send(*[raw.request(s, b"/abuse/stream/%d" % (4 * MB)) for s in sids])
                    started: set[int] = set()  # (DATA the last round's streams sent before their reset may come too)
                    while not set(sids) <= started:
                        frame = await raw.next_frame()
                        assert frame is not None and not isinstance(frame, hf.GoAwayFrame | hf.RstStreamFrame)
                        if isinstance(frame, hf.DataFrame) and frame.data:
                            started.add(frame.stream_id)
                    await raw.send(*[hf.RstStreamFrame(s, error_code=CANCEL) for s in sids])
                await raw.send(raw.request(sid, b"/abuse/after"))  # the abuser's own connection goes on too
                frame = await raw.until(lambda f: "END_STREAM" in f.flags and f.stream_id == sid)
                assert frame is not None and raw.status(sid) == b"200"
            rc = shared.upstream()
            streamed = {s for s, path in rc.abuser_streams().items() if b"/stream/" in path}
            assert len(streamed) == 30
            await wait_for(lambda: streamed <= set(rc.resets), lambda: f"resets at the replica: {rc.resets}")

        await beside_good_client(shared, abuse)
        rc = assert_isolated(shared)
        streamed = [s for s, path in rc.abuser_streams().items() if b"/stream/" in path]
        assert all(rc.sent[s] < 4 * MB for s in streamed)  # cut short, not sent in full


MALFORMED: list[tuple[tuple[bytes, bytes], ...]] = [
    ((b"X-Upper", b"1"),),  # an uppercase field name
    ((b"connection", b"keep-alive"),),  # a connection-specific field
    ((b"te", b"gzip"),),
    ((b"host", b"elsewhere.test"),),  # disagrees with :authority
    ((b"x-bad", b"a\x00b"),),  # a NUL in a value
    ((b":method", b"GET"),),  # a repeated pseudo-header
]


async def test_malformed_requests_beside_a_good_client(nursery: trio.Nursery) -> None:
    """30 malformed heads: each is a 400 on its stream, then RST_STREAM(PROTOCOL_ERROR); none leaves the edge."""
    with trio.fail_after(20):
        shared = await shared_chain(nursery)

        async def abuse() -> None:
            async with RawFrames.open(shared.port) as raw:
                sids = list(range(1, 61, 2))
                frames = [
                    hf.HeadersFrame(
                        sid,
                        raw.block(b"/abuse/malformed", *MALFORMED[i % len(MALFORMED)]),
                        flags=["END_HEADERS", "END_STREAM"],
                    )
                    for i, sid in enumerate(sids)
                ]
                await raw.send(*frames)
                reset: set[int] = set()
                while reset != set(sids):
                    frame = await raw.next_frame()
                    assert frame is not None and not isinstance(frame, hf.GoAwayFrame)
                    assert "END_STREAM" not in frame.flags, f"a malformed request's 400 ended its stream: {frame}"
                    if isinstance(frame, hf.RstStreamFrame):
                        assert frame.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR, frame
                        assert raw.status(frame.stream_id) == b"400", "the reset came before the 400"
                        reset.add(frame.stream_id)

        await beside_good_client(shared, abuse)
        rc = assert_isolated(shared)
        assert rc.abuser_streams() == {}


async def test_request_bodies_over_the_limit_beside_a_good_client(nursery: trio.Nursery) -> None:
    """``max_request_body=1000`` at the edge: declared lengths over it are 413 before anything goes
    upstream; streamed bodies that cross it are cut, and their upstream streams cancelled."""
    with trio.fail_after(20):
        shared = await shared_chain(nursery, ListenerConfig(max_request_body=1000))

        async def abuse() -> None:
            async with RawFrames.open(shared.port) as raw:
                # (a header block changes the HPACK tables: one block per stream)
                declared = list(range(1, 21, 2))
                length = (b"content-length", b"1001")
                frames: list[hf.Frame] = [
                    hf.HeadersFrame(sid, raw.block(b"/abuse/declared", length, method=b"POST"), flags=["END_HEADERS"])
                    for sid in declared
                ]
                streamed = list(range(21, 41, 2))
                for sid in streamed:
                    head = raw.block(b"/abuse/streamed", method=b"POST")
                    frames += [hf.HeadersFrame(sid, head, flags=["END_HEADERS"]), hf.DataFrame(sid, b"a" * 600)]
                await raw.send(*frames)
                rc = shared.upstream()
                await wait_for(lambda: sum(n == 600 for n in rc.uploaded.values()) == len(streamed), "600 bytes each")
                await raw.send(*[hf.DataFrame(sid, b"b" * 401, flags=["END_STREAM"]) for sid in streamed])
                answered: set[int] = set()
                while answered != set(declared + streamed):
                    frame = await raw.next_frame()
                    assert frame is not None and not isinstance(frame, hf.GoAwayFrame)
                    if isinstance(frame, hf.HeadersFrame | hf.RstStreamFrame):
                        answered.add(frame.stream_id)
                assert {raw.status(sid) for sid in declared} == {b"413"}
                assert {raw.status(sid) for sid in streamed} <= {b"413", None}  # None: reset
            cut = {sid for sid, path in rc.abuser_streams().items() if path == b"/abuse/streamed"}
            assert len(cut) == len(streamed)
            await wait_for(lambda: cut <= set(rc.resets), lambda: f"resets at the replica: {rc.resets}")
            assert max(rc.uploaded[sid] for sid in cut) <= 1000

        await beside_good_client(shared, abuse)
        rc = assert_isolated(shared)
        assert b"/abuse/declared" not in rc.paths.values()


@pytest.mark.parametrize("close", ["FIN", "RST"])
async def test_client_gone_with_20_requests_in_flight_beside_a_good_client(nursery: trio.Nursery, close: str) -> None:
    """A client drops its connection (a clean close, or a TCP reset) with 20 requests in flight."""
    with trio.fail_after(20):
        shared = await shared_chain(nursery)

        async def abuse() -> None:
            async with RawFrames.open(shared.port) as raw:
                await open_held_streams(raw, shared, 20)
                if close == "RST":
                    raw.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await held_streams_are_cancelled(shared, 20)

        await beside_good_client(shared, abuse)
        assert_isolated(shared)


# -- 2. flow control: a stalled reader beside 100 streaming streams ----------------------------


async def test_a_stalled_reader_holds_only_its_own_windows(nursery: trio.Nursery) -> None:
    """One client never reads a 4 MiB response (its stream window stays at 65,535); 100 streams
    of 256 KiB each go through the same pooled connections meanwhile, and all complete in full.
    The replica's sending for the stalled stream stops once the windows on its way are full:
    the client's 65,535 bytes plus one upstream stream window per hop, plus the chunk the edge's
    body pump took (and so gave back: the consumer of a body acknowledges what it reads) and
    holds until the client's window takes it: at most one read's DATA (``RECEIVE_SIZE``)."""
    with trio.fail_after(20):
        shared = await shared_chain(nursery)
        bound = DEFAULT_WINDOW + 3 * WINDOW + RECEIVE_SIZE
        async with RawFrames.open(shared.port) as stalled:
            await stalled.send(stalled.request(1, b"/abuse/stall/stream/%d" % (4 * MB)))
            received = 0
            while received < DEFAULT_WINDOW:
                frame = await stalled.next_frame()
                assert frame is not None and not isinstance(frame, hf.GoAwayFrame | hf.RstStreamFrame)
                if isinstance(frame, hf.DataFrame):
                    received += len(frame.data)
            assert received == DEFAULT_WINDOW
            rc = shared.upstream()
            (sid,) = rc.abuser_streams()
            await wait_for(lambda: rc.conn.local_flow_control_window(sid) == 0, "the replica to run out of window")
            held = rc.sent[sid]
            assert DEFAULT_WINDOW < held <= bound

            size = 256 * 1024
            results: list[tuple[int, int, int | None, bool]] = []  # status, body size, reset code, lost

            async def streams(count: int) -> None:
                async with RawH2Client.open(shared.port) as client:

                    async def one() -> None:
                        result = await client.request(client.head(b"GET", b"/good/stream/%d" % size))
                        reset = None if result.reset is None else result.reset.error_code
                        results.append((result.status, len(result.body), reset, result.connection_lost))

                    async with trio.open_nursery() as batch:
                        for _ in range(count):
                            batch.start_soon(one)

            async with trio.open_nursery() as clients:
                for _ in range(4):
                    clients.start_soon(streams, 25)
            assert collections.Counter(results) == {(200, size, None, False): 100}

            # The stalled stream is still there, as stalled as before, and nothing more reached its client.
            assert rc.sent[sid] == held and rc.conn.local_flow_control_window(sid) == 0
            assert sid not in rc.resets
            with trio.move_on_after(0.2):
                frame = await stalled.next_frame()
                raise AssertionError(f"the stalled client received {frame!r}")
        assert_isolated(shared)


# A splice woken by a window (or by its connection's writer draining) pushes
# what it holds into the destination's state machine. Were the backlog check
# blind to what splices pushed in the same batch, every splice that waited
# would push its whole window at once when a hop's writer drains, past
# max_outbound_buffer, and the listener would close the shared connection as
# a peer that does not read.


async def test_a_hop_that_reads_late_keeps_its_shared_connection(nursery: trio.Nursery) -> None:
    """The proxy's side of a shared connection, its peer a stand-in for the edge's pool (windows
    wide open, a small receive buffer) that stops reading for half a second while 24 responses of
    1 MiB stream to it. Back-pressure holds the data in the splices; once the peer reads again
    every response arrives in full on the same connection."""
    with trio.fail_after(20):
        shared = await shared_chain(nursery)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        await sock.connect((HOST, shared.proxy.port))
        size, count = MB, 24
        async with trio.SocketStream(sock) as stream:
            raw = RawFrames(stream)
            wide = {hf.SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1}
            await raw.send(
                H2_PREFACE,
                hf.SettingsFrame(0, settings=wide),
                hf.WindowUpdateFrame(0, window_increment=2**31 - 1 - DEFAULT_WINDOW),
            )
            # A first request opens the pooled connections behind, so that the others are spliced.
            await raw.send(raw.request(1, b"/warm"))
            assert await raw.until(lambda f: f.stream_id == 1 and "END_STREAM" in f.flags) is not None
            sids = list(range(3, 3 + 2 * count, 2))
            await raw.send(*[raw.request(sid, b"/abuse/stream/%d" % size) for sid in sids])
            await trio.sleep(0.5)  # not reading
            # Then reading: slowly at first, so that the socket buffers stay nearly full when the
            # proxy's writer drains and wakes the splices that waited; then at full speed.
            received = dict.fromkeys(sids, 0)
            ended: set[int] = set()
            buffer = bytearray()
            total = 0
            while ended != set(sids):
                chunk = await stream.receive_some(16384 if total < MB else 65536)
                total += len(chunk)
                assert chunk, f"the connection was closed; {len(ended)} of {count} responses complete"
                buffer += chunk
                while len(buffer) >= 9:
                    frame, length = hf.Frame.parse_frame_header(memoryview(buffer[:9]))
                    if len(buffer) < 9 + length:
                        break
                    assert not isinstance(frame, hf.GoAwayFrame | hf.RstStreamFrame), frame
                    if isinstance(frame, hf.DataFrame):
                        received[frame.stream_id] += length  # (no padding from a proxyblocks hop)
                    if "END_STREAM" in frame.flags:
                        ended.add(frame.stream_id)
                    del buffer[: 9 + length]
                if total < MB:
                    await trio.sleep(0.002)
            assert received == dict.fromkeys(sids, size)
        assert shared.proxy.statistics().accepted == 1
