"""Token streams: many small DATA frames, each relayed as soon as it is here, coalesced only when already here.

A replica that streams tokens (an LLM's, a voice agent's) sends a small DATA
frame per token. The codec takes a run of DATA frames in a row on one stream,
within one read, as one event (``H2Codec.receive_data``), so what one read
brought of a stream leaves a hop as one frame; it never waits for more. And a
plain DATA frame is framed without h2's machinery, both ways.

Rules, as in every test here: loopback only, port 0, real sockets and real
h2 peers; every test is bounded by ``trio.fail_after`` and waits for states
(a frame seen, a book balanced), never for a duration. Nothing here measures
speed: ``bench/_scale_tokens.py`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks import Chain, HTTPServer, LocalReplica, UpstreamConfig
from blocks.transport._codec import EventKind, make_h2
from blocks.transport._h2 import H2Driver, _driver
from tests.support import HOST, RawH2Client, assemble_local, wait_books_balanced

GET = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"tokens.test"), (b":path", b"/")]


def token(i: int) -> bytes:
    return b"token %d\n" % i


# -- the codec, sans-IO: h2 on the other end -----------------------------------------------------------


def _h2_peer(*, client_side: bool) -> h2.connection.H2Connection:
    config = h2.config.H2Configuration(client_side=client_side, header_encoding=None)
    conn = h2.connection.H2Connection(config)
    conn.local_settings = h2.settings.Settings(
        client=client_side, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20}
    )
    return conn


def _is(codec: Any, ev: object, kind: EventKind) -> bool:
    """Whether ``ev``, an event of ``codec`` (either codec's: see the contract), is of ``kind``."""
    return codec.event_kinds.get(type(ev)) is kind


def _connected(streams: int) -> tuple[Any, h2.connection.H2Connection]:
    """Our client codec and a plain h2 server, ``streams`` requests open (ids 1, 3, ...), each answered 200."""
    ours = make_h2(client_side=True, max_concurrent_streams=100, stream_window=1 << 20, max_header_list_size=65536)
    ours.initiate_connection()
    ours.increment_flow_control_window((1 << 24) - 65535)
    theirs = _h2_peer(client_side=False)
    theirs.initiate_connection()
    theirs.receive_data(ours.data_to_send())
    ours.receive_data(theirs.data_to_send())
    theirs.receive_data(ours.data_to_send())
    for i in range(streams):
        ours.send_headers(2 * i + 1, GET, end_stream=True)
    theirs.receive_data(ours.data_to_send())
    for i in range(streams):
        theirs.send_headers(2 * i + 1, [(b":status", b"200")])
    ours.receive_data(theirs.data_to_send())
    return ours, theirs


# What the peer sends, frame by frame: (stream index, payload, padding), then whether each stream ends.
frames_strategy = st.lists(
    st.tuples(st.integers(0, 2), st.binary(min_size=0, max_size=40), st.sampled_from([None, None, None, 0, 7])),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(frames=frames_strategy, ends=st.lists(st.booleans(), min_size=3, max_size=3), cuts=st.data())
def test_a_read_of_data_frames_is_taken_whole_in_order_and_on_the_books(
    frames: list[tuple[int, bytes, int | None]], ends: list[bool], cuts: st.DataObject
) -> None:
    """Whatever frames come, however the reads cut them: each stream's bytes come whole and in order, its
    end where it was, every flow-controlled byte on the books exactly once, and never more events than frames."""
    ours, theirs = _connected(3)
    sent = [bytearray(), bytearray(), bytearray()]
    for index, payload, padding in frames:
        theirs.send_data(2 * index + 1, payload, pad_length=padding)
        sent[index] += payload
    for index, end in enumerate(ends):
        if end:
            theirs.end_stream(2 * index + 1)
    wire = theirs.data_to_send()
    points = sorted(cuts.draw(st.lists(st.integers(0, len(wire)), max_size=6)))
    received = [bytearray(), bytearray(), bytearray()]
    ended = [False, False, False]
    flow = [0, 0, 0]
    data_events = 0
    _, held_before = ours.inbound_books()
    for start, stop in zip([0, *points], [*points, len(wire)], strict=True):
        for ev in ours.receive_data(wire[start:stop]):
            index = (ev.stream_id - 1) // 2 if getattr(ev, "stream_id", 0) else -1
            if _is(ours, ev, EventKind.DATA):
                assert not ended[index], "DATA after the end of its stream"
                received[index] += ev.data
                flow[index] += ev.flow_controlled_length
                data_events += 1
            elif _is(ours, ev, EventKind.STREAM_ENDED):
                ended[index] = True
    assert received == sent
    assert ended == ends
    assert data_events <= len(frames) + sum(ends)
    padded = [0, 0, 0]
    for index, payload, padding in frames:
        padded[index] += len(payload) + (padding + 1 if padding is not None else 0)
    assert flow == padded, "every flow-controlled byte is in exactly one event, on its stream"
    assert ours.inbound_books()[1] == held_before + sum(padded)
    # Given back as the drivers do (acknowledge, per stream), the books balance.
    for index, size in enumerate(flow):
        if size:
            ours.acknowledge_received_data(size, 2 * index + 1)
    assert ours.inbound_books()[1] == held_before


# (H2Codec's fast path keeping h2's content-length check: the nghttp2 codec checks no response's
# content-length between hops, docs/codec.md "What differs")
@pytest.mark.codec("h2")
@settings(max_examples=150, deadline=None)
@given(declared=st.integers(0, 120), sizes=st.lists(st.integers(1, 40), max_size=8), end=st.booleans())
def test_a_run_of_data_is_held_to_the_declared_content_length(declared: int, sizes: list[int], end: bool) -> None:
    """A response's ``content-length`` holds on the fast path as on h2's: more DATA than declared, or an
    end short of it, is a protocol error (RFC 9113 8.1.1), whichever frames of a read bring it."""
    ours, theirs = _connected(0)
    ours.send_headers(1, GET, end_stream=True)
    theirs.receive_data(ours.data_to_send())
    theirs.send_headers(1, [(b":status", b"200"), (b"content-length", b"%d" % declared)])
    ours.receive_data(theirs.data_to_send())
    for size in sizes:
        theirs.send_data(1, b"x" * size)
    if end:
        theirs.end_stream(1)
    total = sum(sizes)
    wrong = total > declared or (end and total != declared)
    try:
        events = ours.receive_data(theirs.data_to_send())
    except h2.exceptions.ProtocolError:
        assert wrong, f"{total} bytes of {declared} declared{' and the end' if end else ''} are fine"
    else:
        assert not wrong, f"{total} bytes of {declared} declared{' and the end' if end else ''} went through"
        assert sum(len(ev.data) for ev in events if _is(ours, ev, EventKind.DATA)) == total


def test_a_run_of_frames_in_one_read_is_one_event() -> None:
    ours, theirs = _connected(1)
    for i in range(500):
        theirs.send_data(1, token(i))
    events = ours.receive_data(theirs.data_to_send())
    data = [ev for ev in events if _is(ours, ev, EventKind.DATA)]
    assert len(data) == 1
    assert data[0].data == b"".join(token(i) for i in range(500))


def test_frames_of_streams_in_turn_are_joined_per_stream_in_order() -> None:
    """Streams sharing a connection interleave their tokens: each stream's still arrive as one event."""
    ours, theirs = _connected(2)
    for i in range(10):
        theirs.send_data(1 + 2 * (i % 2), token(i))
    events = [ev for ev in ours.receive_data(theirs.data_to_send()) if _is(ours, ev, EventKind.DATA)]
    assert [(ev.stream_id, ev.data) for ev in events] == [
        (1, b"".join(token(i) for i in range(0, 10, 2))),
        (3, b"".join(token(i) for i in range(1, 10, 2))),
    ]


def test_a_streams_reset_or_end_stays_after_its_bytes_and_before_later_ones() -> None:
    ours, theirs = _connected(3)
    theirs.send_data(1, token(0))
    theirs.send_data(3, token(1))
    theirs.send_data(5, token(2))
    theirs.reset_stream(3)
    theirs.send_data(1, token(3))
    theirs.send_headers(5, [(b"grpc-status", b"0")], end_stream=True)
    theirs.send_data(1, token(4))
    events = ours.receive_data(theirs.data_to_send())
    seen = [(type(ev).__name__, ev.stream_id, getattr(ev, "data", None)) for ev in events]
    assert seen == [
        ("DataReceived", 1, token(0) + token(3) + token(4)),
        ("DataReceived", 3, token(1)),
        ("DataReceived", 5, token(2)),
        ("StreamReset", 3, None),
        ("TrailersReceived", 5, None),
        ("StreamEnded", 5, None),
    ]


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(1, 20000), max_size=30))
def test_data_framed_by_the_fast_path_is_what_h2_would_send(sizes: list[int]) -> None:
    """The DATA our codec frames itself parses as h2's own, and leaves the same windows behind."""
    # Our server codec answers a plain h2 client.
    server = make_h2(client_side=False, max_concurrent_streams=10, stream_window=65535, max_header_list_size=65536)
    server.initiate_connection()
    client = _h2_peer(client_side=True)
    client.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    client.send_headers(1, GET, end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(b":status", b"200")])
    client.receive_data(server.data_to_send())
    body = bytearray()
    sent = bytearray()
    for i, size in enumerate(sizes):
        room = min(server.local_flow_control_window(1), server.max_outbound_frame_size)
        payload = bytes([i % 256]) * min(size, room)
        if not payload:
            break
        before = server.local_flow_control_window(1)
        server.send_data(1, payload)
        sent += payload
        assert server.local_flow_control_window(1) == before - len(payload)
        for ev in client.receive_data(server.data_to_send()):
            if isinstance(ev, h2.events.DataReceived):
                body += ev.data
                client.acknowledge_received_data(ev.flow_controlled_length, 1)
        server.receive_data(client.data_to_send())
    assert body == sent
    # h2's own view of the windows, from the other end, agrees with ours.
    assert server.local_flow_control_window(1) == min(
        client._get_stream_by_id(1)._inbound_window_manager.current_window_size,
        client._inbound_flow_control_window_manager.current_window_size,
    )


# -- through the chain: a replica that writes frames as the test says ---------------------------------------


class ScriptedReplica:
    """A bare h2 server (plain h2, no proxyblocks) whose responses the test writes, frame by frame.

    Each request waits in ``opened`` (its stream id) until the test answers it
    with :meth:`write`, which takes a function that queues frames on the h2
    connection and sends them all in one write.
    """

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.paths: dict[bytes, int] = {}  # each request's path -> its stream id
        self.changed = trio.Event()
        self.conn: h2.connection.H2Connection | None = None
        self.stream: trio.SocketStream | None = None
        self.connections = 0

    async def serve(self, stream: trio.SocketStream) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        conn = self.conn = h2.connection.H2Connection(config)
        self.stream = stream
        self.connections += 1
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        while data := await stream.receive_some(65536):
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    self.opened.append(ev.stream_id)
                    self.paths[dict(ev.headers)[b":path"]] = ev.stream_id
                    self._wake()
                elif isinstance(ev, h2.events.DataReceived):
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            if out := conn.data_to_send():
                await stream.send_all(out)

    def _wake(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_opened(self, count: int) -> list[int]:
        while len(self.opened) < count:
            await self.changed.wait()
        return self.opened[:count]

    async def write(self, queue: Callable[[h2.connection.H2Connection], None]) -> None:
        """Queue frames (``queue(conn)``) and send them in one write."""
        assert self.conn is not None and self.stream is not None
        queue(self.conn)
        await self.stream.send_all(self.conn.data_to_send())


@pytest.fixture
async def scripted(nursery: trio.Nursery) -> tuple[ScriptedReplica, Chain]:
    replica = ScriptedReplica()
    listeners = await nursery.start(functools.partial(trio.serve_tcp, replica.serve, 0, host=HOST))
    port = listeners[0].socket.getsockname()[1]
    chain = await assemble_local(nursery, {"scripted": LocalReplica((HOST, port), "h2")})
    return replica, chain


def _servers(chain: Chain) -> dict[str, HTTPServer]:
    return {"edge": chain.edge, "proxy": chain.proxy_server, "worker": chain.worker_server}


async def test_a_burst_of_tokens_arrives_whole_in_order_and_in_fewer_frames(
    scripted: tuple[ScriptedReplica, Chain],
) -> None:
    replica, chain = scripted
    with trio.fail_after(20):
        async with RawH2Client.open(chain.port) as client:
            sid = await client.start(client.head(b"GET", b"/tokens"))
            (up,) = await replica.wait_opened(1)

            def burst(conn: h2.connection.H2Connection) -> None:
                conn.send_headers(up, [(b":status", b"200")])
                for i in range(2000):
                    conn.send_data(up, token(i))
                conn.send_headers(up, [(b"grpc-status", b"0")], end_stream=True)

            await replica.write(burst)
            result = await client.collect(sid)
        assert result.status == 200
        assert result.body == b"".join(token(i) for i in range(2000))
        frames = [ev for ev in result.events if isinstance(ev, h2.events.DataReceived)]
        assert len(frames) < 2000 // 10, f"{len(frames)} DATA frames for 2000 tokens sent in one write"
        assert result.trailers == [(b"grpc-status", b"0")]
        assert isinstance(result.events[-1], h2.events.StreamEnded)
        await wait_books_balanced(_servers(chain), links=["edge -> proxy", "proxy -> worker"])


async def test_a_spaced_token_is_relayed_before_the_next_one_is_sent(
    scripted: tuple[ScriptedReplica, Chain], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing waits for more: the replica sends token i+1 only once the client holds token i, alone.

    The chain's hops share this process: a hop's reader takes what the hop before it just wrote at once
    (``H2Driver._take_local``), with no wake-up of its own.
    """
    replica, chain = scripted
    taken: list[object] = []
    take_local = H2Driver._take_local

    def counted(self: H2Driver) -> None:
        taken.append(self)
        take_local(self)

    monkeypatch.setattr(H2Driver, "_take_local", counted)
    with trio.fail_after(20):
        async with RawH2Client.open(chain.port) as client:
            sid = await client.start(client.head(b"GET", b"/tokens"))
            (up,) = await replica.wait_opened(1)
            await replica.write(lambda conn: conn.send_headers(up, [(b":status", b"200")]))
            assert isinstance(await client.next_event(sid), h2.events.ResponseReceived)
            for i in range(20):
                await replica.write(lambda conn, i=i: conn.send_data(up, token(i)))
                event = await client.next_event(sid)
                assert isinstance(event, h2.events.DataReceived)
                assert event.data == token(i), "each token arrives alone, as its own frame, before the next is sent"
            await replica.write(lambda conn: conn.end_stream(up))
            rest = await client.collect(sid)
            assert rest.body == b""
            assert isinstance(rest.events[-1], h2.events.StreamEnded)
        assert taken, "hops of one process hand their bytes on in the writer's batch"
        await wait_books_balanced(_servers(chain), links=["edge -> proxy", "proxy -> worker"])


async def test_a_hop_hands_its_bytes_to_the_connection_at_the_other_end_of_its_socket(
    nursery: trio.Nursery,
) -> None:
    """Every connection of this process is found by its peer, and only by its peer: a listener's
    connections all share its address, so the registry of local connections (``_local``) is keyed by
    the pair of addresses. Two streams between proxy and worker, one per connection, make two
    connections to the worker's listener; each proxy connection's peer is its own worker connection."""
    replica = ScriptedReplica()
    listeners = await nursery.start(functools.partial(trio.serve_tcp, replica.serve, 0, host=HOST))
    port = listeners[0].socket.getsockname()[1]
    one_stream = UpstreamConfig(max_streams_per_connection=1)
    chain = await assemble_local(nursery, {"scripted": LocalReplica((HOST, port), "h2")}, proxy_upstream=one_stream)
    with trio.fail_after(20):
        async with RawH2Client.open(chain.port) as client:
            sids = [await client.start(client.head(b"GET", b"/tokens/%d" % i)) for i in range(2)]
            ups = await replica.wait_opened(2)
            for up in ups:
                await replica.write(lambda conn, up=up: conn.send_headers(up, [(b":status", b"200")]))
                await replica.write(lambda conn, up=up: conn.send_data(up, token(up)))
            for sid in sids:
                assert isinstance(await client.next_event(sid), h2.events.ResponseReceived)
                assert isinstance(await client.next_event(sid), h2.events.DataReceived)
            worker = chain.worker_server.port
            at_worker = [key for key in _driver._local if key[0][1] == worker]
            assert len(at_worker) == 2, "both of the worker's connections are registered, apart"
            for key, driver in list(_driver._local.items()):
                peer = _driver._local.get(driver._peer_key)
                if peer is not None:
                    assert peer._peer_key == key, "a connection's peer is the connection at its socket's other end"
            for key in at_worker:
                assert _driver._local[key]._peer_key in _driver._local, "each is found by its proxy connection"
            for up in ups:
                await replica.write(lambda conn, up=up: conn.end_stream(up))
            for sid in sids:
                await client.collect(sid)


async def test_a_reset_in_the_middle_of_a_read_loses_none_of_another_streams_bytes(
    scripted: tuple[ScriptedReplica, Chain],
) -> None:
    replica, chain = scripted
    with trio.fail_after(20):
        async with RawH2Client.open(chain.port) as client:
            doomed = await client.start(client.head(b"GET", b"/doomed"))
            kept = await client.start(client.head(b"GET", b"/kept"))
            await replica.wait_opened(2)  # (in either order: the hops may take them apart)
            a, b = replica.paths[b"/doomed"], replica.paths[b"/kept"]

            def interleaved(conn: h2.connection.H2Connection) -> None:
                conn.send_headers(a, [(b":status", b"200")])
                conn.send_headers(b, [(b":status", b"200")])
                for i in range(300):
                    conn.send_data(a, b"a" + token(i))
                for i in range(300):
                    conn.send_data(b, token(i))
                conn.reset_stream(a, h2.errors.ErrorCodes.INTERNAL_ERROR)
                for i in range(300, 600):
                    conn.send_data(b, token(i))
                conn.end_stream(b)

            assert replica.connections == 1, "both streams share the replica's one connection: one write has both"
            await replica.write(interleaved)
            kept_result = await client.collect(kept)
            doomed_result = await client.collect(doomed)
        assert kept_result.status == 200
        assert kept_result.body == b"".join(token(i) for i in range(600))
        assert isinstance(kept_result.events[-1], h2.events.StreamEnded)
        assert doomed_result.reset is not None
        assert b"".join(b"a" + token(i) for i in range(300)).startswith(doomed_result.body)
        await wait_books_balanced(_servers(chain), links=["edge -> proxy", "proxy -> worker"])


def test_hyperframe_agrees_on_the_frames_the_fast_path_writes() -> None:
    server = make_h2(client_side=False, max_concurrent_streams=10, stream_window=65535, max_header_list_size=65536)
    server.initiate_connection()
    client = _h2_peer(client_side=True)
    client.initiate_connection()
    server.receive_data(client.data_to_send())
    server.data_to_send()
    client.send_headers(1, GET, end_stream=True)
    server.receive_data(client.data_to_send())
    server.send_headers(1, [(b":status", b"200")])
    server.data_to_send()
    server.send_data(1, b"token 1\n")
    server.acknowledge_received_data(0, 1)
    wire = server.data_to_send()
    frame, length = hyperframe.frame.Frame.parse_frame_header(memoryview(wire[:9]))
    frame.parse_body(memoryview(wire[9 : 9 + length]))
    assert isinstance(frame, hyperframe.frame.DataFrame)
    assert (frame.stream_id, frame.data, frame.flags) == (1, b"token 1\n", set())
