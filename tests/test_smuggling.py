"""Request smuggling across the h1 <-> h2 boundary, end to end.

The chain under test::

    client --h1 or h2--> edge --h2--> proxy --h2--> worker --h1--> recording replica

The replica is a bare h11 server, not proxyblocks: a second parser, as in
real life, that records every request it parses (its head, the body bytes,
whether the message was complete) and answers ``200 ok``. For each
malformed request sent at the edge, a test checks both what the client got
(400 normally) and what the replica saw: never two requests where one was
sent, never a field the edge refused, never a body that does not add up.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``,
real clients and servers.
"""

from __future__ import annotations

import functools

import attrs
import h2.errors
import h2.exceptions
import h11
import pytest
import trio
from support import HOST, H2Result, RawH2Client, assemble_fair, assemble_local, wait_for

from blocks import Chain, LocalReplica
from blocks.errors import status_reason

Headers = list[tuple[bytes, bytes]]

# -- the recording replica --------------------------------------------------------------------


@attrs.define
class Seen:
    """One request as the replica parsed it."""

    method: bytes
    target: bytes
    headers: Headers
    body: bytes = b""
    complete: bool = False

    def values(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name]


@attrs.define(eq=False)
class RecordingReplica:
    """An h11 server that records what it receives; ``200 ok`` to every complete request."""

    seen: list[Seen] = attrs.field(factory=list)
    raw: list[bytearray] = attrs.field(factory=list)  # every connection's bytes, as received
    broken: int = 0  # connections whose bytes h11 could not parse
    cut: int = 0  # connections closed by the worker in the middle of a request
    open: int = 0

    def names(self) -> set[bytes]:
        return {name for seen in self.seen for name, _ in seen.headers}

    async def serve(self, stream: trio.SocketStream) -> None:
        raw = bytearray()
        self.raw.append(raw)
        self.open += 1
        conn = h11.Connection(h11.SERVER)
        current: Seen | None = None
        eof = False
        try:
            async with stream:
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        try:
                            data = await stream.receive_some(65536)
                        except trio.BrokenResourceError:
                            return
                        raw += data
                        eof = not data
                        conn.receive_data(data)
                        continue
                    if type(event) is h11.Request:
                        current = Seen(event.method, event.target, [(n, v) for n, v in event.headers])
                        self.seen.append(current)
                    elif type(event) is h11.Data:
                        assert current is not None
                        current.body += bytes(event.data)
                    elif type(event) is h11.EndOfMessage:
                        assert current is not None
                        current.complete = True
                        head = h11.Response(status_code=200, headers=[(b"content-length", b"2")])
                        await stream.send_all(conn.send(head) + conn.send(h11.Data(data=b"ok")) + conn.send(event))
                        if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                            return
                        conn.start_next_cycle()
                    else:
                        return  # the worker closed the connection
        except h11.RemoteProtocolError:
            if eof:
                self.cut += 1
            else:
                self.broken += 1
        finally:
            self.open -= 1


async def start_recording_replica(nursery: trio.Nursery) -> tuple[RecordingReplica, LocalReplica]:
    replica = RecordingReplica()
    listeners: list[trio.SocketListener] = await nursery.start(
        functools.partial(trio.serve_tcp, replica.serve, 0, host=HOST)
    )
    return replica, LocalReplica((HOST, listeners[0].socket.getsockname()[1]), "h1")


async def recording_chain(nursery: trio.Nursery) -> tuple[Chain, RecordingReplica]:
    replica, local = await start_recording_replica(nursery)
    chain = await assemble_local(nursery, {"r": local})
    return chain, replica


# -- a raw h1 client ----------------------------------------------------------------------------


@attrs.define
class Reply:
    status: int
    headers: Headers
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


@attrs.define
class Exchange:
    replies: list[Reply]
    after: bytes  # what the server sent after the last reply, up to its close

    @property
    def status(self) -> int:
        assert len(self.replies) == 1, self.replies
        return self.replies[0].status


async def exchange(port: int, data: bytes, *, replies: int = 1) -> Exchange:
    """Send ``data`` as it is on a new connection and parse ``replies`` responses.

    When the last one says ``connection: close``, everything the server
    sends until it closes is returned in ``after`` (a server that answered
    one request and refused to go on sends nothing more).
    """
    stream = await trio.open_tcp_stream(HOST, port)
    async with stream:
        await stream.send_all(data)
        # h11 parses responses only to requests it sent itself: give it stand-ins.
        parser = h11.Connection(h11.CLIENT)
        result = Exchange([], b"")
        while len(result.replies) < replies:
            parser.send(h11.Request(method=b"GET", target=b"/", headers=[(b"host", b"x")]))
            parser.send(h11.EndOfMessage())
            status, headers, body = 0, [], bytearray()
            while True:
                event = parser.next_event()
                if event is h11.NEED_DATA:
                    parser.receive_data(await stream.receive_some(65536))
                elif type(event) is h11.Response:
                    status, headers = event.status_code, [(n, v) for n, v in event.headers]
                elif type(event) is h11.Data:
                    body += event.data
                elif type(event) is h11.EndOfMessage:
                    break
                else:
                    raise AssertionError(f"the server closed after {len(result.replies)} replies: {event}")
            result.replies.append(Reply(status, headers, bytes(body)))
            if parser.our_state is h11.MUST_CLOSE or parser.their_state is h11.MUST_CLOSE:
                after = bytearray(parser.trailing_data[0])
                while data := await stream.receive_some(65536):
                    after += data
                result.after = bytes(after)
                break
            parser.start_next_cycle()
    return result


async def check_refused_h1(chain: Chain, replica: RecordingReplica, data: bytes, status: int) -> None:
    """``data`` gets ``status`` and a close at the edge; nothing reaches the replica; the chain goes on."""
    result = await exchange(chain.port, data)
    reply = result.replies[0]
    assert reply.status == status, reply
    assert reply.header(b"connection") == b"close"
    assert reply.header(b"proxyblocks-error") == f"{status_reason(status)}; hop=edge".encode()  # the listener's own
    assert result.after == b"", "the edge answered something after refusing the request"
    assert chain.worker.statistics().served == {"r": 0}
    await check_good_request(chain, replica, seen=1)


async def check_good_request(chain: Chain, replica: RecordingReplica, *, seen: int) -> None:
    """A well-formed request still goes through, and the replica has now seen ``seen`` requests in all."""
    ok = await exchange(chain.port, b"GET /good HTTP/1.1\r\nhost: a.test\r\nconnection: close\r\n\r\n")
    assert ok.status == 200
    assert ok.replies[0].body == b"ok"
    assert len(replica.seen) == seen, replica.seen
    assert replica.seen[-1].target == b"/good"
    assert replica.broken == 0


# -- h1: framing ----------------------------------------------------------------------------------

HEAD = b"POST / HTTP/1.1\r\nHost: a.test\r\n"
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: a.test\r\n\r\n"


@pytest.mark.parametrize(
    ("data", "status"),
    [
        # CL.TE and TE.CL: the classic smuggling shapes (RFC 9112 6.1).
        pytest.param(
            HEAD + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED, 400, id="cl-te"
        ),
        pytest.param(
            HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: 45\r\n\r\n0\r\n\r\n" + SMUGGLED, 400, id="te-cl"
        ),
        pytest.param(HEAD + b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400, id="cl-cl-differing"),
        pytest.param(HEAD + b"Content-Length: 5, 6\r\n\r\nhello!", 400, id="cl-list-differing"),
        pytest.param(HEAD + b"Content-Length: +5\r\n\r\nhello", 400, id="cl-plus"),
        pytest.param(HEAD + b"Content-Length: -5\r\n\r\nhello", 400, id="cl-minus"),
        pytest.param(HEAD + b"Content-Length: 5 5\r\n\r\nhello", 400, id="cl-inner-space"),
        pytest.param(HEAD + b"Content-Length: 0x5\r\n\r\nhello", 400, id="cl-hex"),
        pytest.param(HEAD + b"Content-Length: 5a\r\n\r\nhello", 400, id="cl-non-digit"),
        # Codings h11 does not implement: 501, as RFC 9112 6.1 asks.
        pytest.param(HEAD + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", 501, id="te-chunked-identity"),
        pytest.param(HEAD + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 501, id="te-gzip-chunked"),
        pytest.param(HEAD + b"Transfer-Encoding: identity\r\n\r\n", 501, id="te-identity"),
        pytest.param(
            HEAD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 501, id="te-twice"
        ),
        pytest.param(HEAD + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", 400, id="te-space-before-colon"),
        pytest.param(HEAD + b"Transfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n", 400, id="te-obs-fold"),
        pytest.param(HEAD + b"Content-Length: 0\r\nX-A: b\r\n\tc\r\n\r\n", 400, id="obs-fold"),
        pytest.param(
            b"POST / HTTP/1.0\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, id="te-in-http-1.0"
        ),
    ],
)
async def test_ambiguous_h1_framing_is_refused_at_the_edge(nursery: trio.Nursery, data: bytes, status: int) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        await check_refused_h1(chain, replica, data, status)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(HEAD + b"X-A: a\x00b\r\n\r\n", id="nul-in-value"),
        pytest.param(HEAD + b"X-A: a\rb\r\n\r\n", id="cr-in-value"),
        pytest.param(HEAD + b"X\rA: b\r\n\r\n", id="cr-in-name"),
        pytest.param(HEAD + b"X-\x00A: b\r\n\r\n", id="nul-in-name"),
        pytest.param(HEAD + b"X A: b\r\n\r\n", id="space-in-name"),
        pytest.param(HEAD + b"X-A\n: b\r\n\r\n", id="lf-in-name"),
        pytest.param(b"GET foo HTTP/1.1\r\nHost: a.test\r\n\r\n", id="path-no-slash"),
        pytest.param(b"GET /a b HTTP/1.1\r\nHost: a.test\r\n\r\n", id="path-space"),
        pytest.param(b"GET  HTTP/1.1\r\nHost: a.test\r\n\r\n", id="path-empty"),
        pytest.param(b"GET * HTTP/1.1\r\nHost: a.test\r\n\r\n", id="asterisk-not-options"),
        pytest.param(b"G@T / HTTP/1.1\r\nHost: a.test\r\n\r\n", id="bad-method"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: user@a.test\r\n\r\n", id="host-userinfo"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: a.test b.test\r\n\r\n", id="host-space"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: a.test:80:81\r\n\r\n", id="host-two-ports"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: a.test/x\r\n\r\n", id="host-with-path"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n", id="host-twice"),
        pytest.param(b"GET / HTTP/1.1\r\nHost:\r\n\r\n", id="host-empty"),
        pytest.param(b"GET http://user@a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n", id="absolute-userinfo"),
        pytest.param(b"GET http:///x HTTP/1.1\r\nHost: a.test\r\n\r\n", id="absolute-no-authority"),
        pytest.param(b"GET ftp://a.test/x HTTP/1.1\r\nHost: a.test\r\n\r\n", id="absolute-other-scheme"),
    ],
)
async def test_malformed_h1_heads_are_refused_at_the_edge(nursery: trio.Nursery, data: bytes) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        await check_refused_h1(chain, replica, data, 400)


async def test_h1_connect_is_not_supported(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        await check_refused_h1(chain, replica, b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n", 501)


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param(b"zz\r\nhello\r\n0\r\n\r\n", id="not-hex"),
        pytest.param(b"-5\r\nhello\r\n0\r\n\r\n", id="negative"),
        pytest.param(b"5\r\nhello world\r\n0\r\n\r\n", id="longer-than-its-size"),
        pytest.param(b"5 5\r\nhello\r\n0\r\n\r\n", id="two-sizes"),
    ],
)
async def test_a_bad_chunk_size_is_a_400_and_never_a_complete_request_upstream(
    nursery: trio.Nursery, chunks: bytes
) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        # The head is valid, so the edge forwards it before the body goes wrong.
        result = await exchange(chain.port, HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + SMUGGLED)
        reply = result.replies[0]
        assert reply.status == 400, reply
        assert reply.header(b"connection") == b"close"
        assert result.after == b""
        await wait_for(lambda: replica.open == 0, "the replica's connection for the broken upload to close")
        assert len(replica.seen) <= 1
        assert not any(seen.complete for seen in replica.seen), replica.seen
        assert all(seen.target == b"/" for seen in replica.seen)
        await check_good_request(chain, replica, seen=len(replica.seen) + 1)


# -- h1: what is accepted, and what the replica sees of it ----------------------------------------


async def test_h1_pipelined_requests_arrive_as_exactly_as_many(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        data = (
            b"GET /1 HTTP/1.1\r\nHost: a.test\r\n\r\n"
            b"POST /2 HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\nhello"
            b"POST /3 HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"6\r\nGET /x\r\n0\r\n\r\n"
            b"GET /4 HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
        )
        result = await exchange(chain.port, data, replies=4)
        assert [reply.status for reply in result.replies] == [200] * 4
        assert result.after == b""
    assert [(seen.method, seen.target, seen.body, seen.complete) for seen in replica.seen] == [
        (b"GET", b"/1", b"", True),
        (b"POST", b"/2", b"hello", True),
        (b"POST", b"/3", b"GET /x", True),
        (b"GET", b"/4", b"", True),
    ]


async def test_h1_upgrade_h2c_is_not_honoured(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        upgrade = (
            b"GET /1 HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"
        )
        # The second request, in the same write, would be h2 to a server that switched.
        result = await exchange(chain.port, upgrade + b"GET /2 HTTP/1.1\r\nHost: a.test\r\n\r\n", replies=2)
        assert [reply.status for reply in result.replies] == [200, 200]
        assert all(reply.header(b"upgrade") is None for reply in result.replies)
    assert [seen.target for seen in replica.seen] == [b"/1", b"/2"]
    assert not replica.names() & {b"upgrade", b"http2-settings", b"connection"}


def assert_te_only_as_trailers(seen: Seen, sent: bytes) -> None:
    """The one TE that goes on is ``trailers`` (what gRPC sends), named in Connection (RFC 9110 10.1.4)."""
    if sent.strip().lower() == b"trailers":
        assert seen.values(b"te") == [b"trailers"] and seen.values(b"connection") == [b"te"]
    else:
        assert seen.values(b"te") == [] and seen.values(b"connection") == []


@pytest.mark.parametrize("te", [b"gzip", b"trailers", b"trailers, deflate"])
async def test_h1_te_reaches_the_replica_only_as_trailers(nursery: trio.Nursery, te: bytes) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        result = await exchange(
            chain.port, b"GET / HTTP/1.1\r\nHost: a.test\r\nTE: " + te + b"\r\nConnection: close\r\n\r\n"
        )
        assert result.status == 200
    assert len(replica.seen) == 1
    assert_te_only_as_trailers(replica.seen[0], te)


async def test_h1_identical_content_length_list_is_one_length(nursery: trio.Nursery) -> None:
    # RFC 9110 8.6 lets a recipient take "5, 5" as 5; what goes on is a single, plain value.
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        result = await exchange(chain.port, HEAD + b"Content-Length: 5, 5\r\nConnection: close\r\n\r\nhello")
        assert result.status == 200
    assert len(replica.seen) == 1
    assert replica.seen[0].values(b"content-length") == [b"5"]
    assert replica.seen[0].body == b"hello"


async def test_h1_absolute_form_wins_over_host(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        replica, local = await start_recording_replica(nursery)
        # Only a.example is routed: the route must come from the target, not from Host.
        chain = await assemble_fair(nursery, {"r": local}, scheduler=None, domains={"a.example": "app"})
        result = await exchange(
            chain.port,
            b"GET https://A.Example:8080/x?y=1 HTTP/1.1\r\nHost: b.example\r\nConnection: close\r\n\r\n",
        )
        assert result.status == 200
        result = await exchange(
            chain.port, b"GET http://A.EXAMPLE?q HTTP/1.1\r\nHost: b.example\r\nConnection: close\r\n\r\n"
        )
        assert result.status == 200
        refused = await exchange(chain.port, b"GET /x HTTP/1.1\r\nHost: b.example\r\nConnection: close\r\n\r\n")
        assert refused.status == 503  # b.example has no route: Host alone is what routes here
    first, second = replica.seen
    assert first.target == b"/x?y=1"
    assert first.values(b"host") == [b"a.example:8080"]
    # The scheme in the target does not say how the client connected.
    assert first.values(b"x-forwarded-proto") == [b"http"]
    assert second.target == b"/?q"
    assert second.values(b"host") == [b"a.example"]


# -- h2 at the edge ------------------------------------------------------------------------------


async def h2_request(chain: Chain, headers: Headers, body: bytes | None = None) -> H2Result:
    """One request on a new h2 connection, followed by a good one on the same connection."""
    async with RawH2Client.open(chain.port) as client:
        result = await client.request(headers, body)
        if not result.connection_lost:
            good = await client.request(client.head(b"GET", b"/good"))
            assert good.status == 200, "a malformed stream broke its connection"
    return result


def h2_head(*extra: tuple[bytes, bytes], method: bytes = b"GET", path: bytes = b"/") -> Headers:
    return [(b":method", method), (b":scheme", b"http"), (b":authority", b"a.test"), (b":path", path), *extra]


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param([(b"x-a", b"a\r\nb")], id="crlf-in-value"),
        pytest.param([(b"x-a", b"a\rb")], id="cr-in-value"),
        pytest.param([(b"x-a", b"a\nb")], id="lf-in-value"),
        pytest.param([(b"x-a", b"a\x00b")], id="nul-in-value"),
        pytest.param([(b"x-a\r\nx-b", b"c")], id="crlf-in-name"),
        pytest.param([(b"x\x00a", b"b")], id="nul-in-name"),
        pytest.param([(b"x-a:", b"b")], id="colon-in-name"),
        pytest.param([(b"X-A", b"b")], id="uppercase-name"),
        pytest.param([(b"x-a", b" b")], id="leading-space"),
        pytest.param([(b"connection", b"close")], id="connection"),
        pytest.param([(b"keep-alive", b"5")], id="keep-alive"),
        pytest.param([(b"proxy-connection", b"close")], id="proxy-connection"),
        pytest.param([(b"transfer-encoding", b"chunked")], id="transfer-encoding"),
        pytest.param([(b"upgrade", b"h2c")], id="upgrade"),
        pytest.param([(b"te", b"gzip")], id="te-gzip"),
        pytest.param([(b"te", b"trailers, gzip")], id="te-trailers-gzip"),
        pytest.param([(b"host", b"b.test")], id="authority-host-mismatch"),
    ],
)
async def test_malformed_h2_fields_are_a_400_on_their_stream(nursery: trio.Nursery, extra: Headers) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        result = await h2_request(chain, h2_head(*extra))
        assert not result.connection_lost
        assert result.status == 400
        assert result.header(b"proxyblocks-error") == b"bad_request; hop=edge"
    assert [seen.target for seen in replica.seen] == [b"/good"]
    assert chain.worker.statistics().served == {"r": 1}


@pytest.mark.parametrize(
    ("method", "path", "authority"),
    [
        pytest.param(b"GET", b"/a b", b"a.test", id="path-space"),
        pytest.param(b"GET", b"", b"a.test", id="path-empty"),
        pytest.param(b"GET", b"a", b"a.test", id="path-no-slash"),
        pytest.param(b"GET", b"http://b.test/", b"a.test", id="path-absolute"),
        pytest.param(b"GET", b"*", b"a.test", id="path-asterisk-not-options"),
        pytest.param(b"G T", b"/", b"a.test", id="method-space"),
        pytest.param(b"", b"/", b"a.test", id="method-empty"),
        pytest.param(b"GET", b"/", b"user@a.test", id="authority-userinfo"),
        pytest.param(b"GET", b"/", b"a.test b.test", id="authority-space"),
        pytest.param(b"GET", b"/", b"a.test:80:81", id="authority-two-ports"),
        pytest.param(b"GET", b"/", b"a.test/x", id="authority-path"),
    ],
)
async def test_bad_h2_pseudo_headers_are_a_400_on_their_stream(
    nursery: trio.Nursery, method: bytes, path: bytes, authority: bytes
) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        head = [(b":method", method), (b":scheme", b"http"), (b":authority", authority), (b":path", path)]
        result = await h2_request(chain, head)
        assert not result.connection_lost
        assert result.status == 400
    assert [seen.target for seen in replica.seen] == [b"/good"]


async def test_h2_authority_is_one_canonical_lowercase_host(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        head = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"A.Test:8080"), (b":path", b"/x")]
        result = await h2_request(chain, [*head, (b"host", b"a.TEST:8080"), (b"te", b"trailers")])
        assert result.status == 200
    first = replica.seen[0]
    assert first.target == b"/x"
    assert first.values(b"host") == [b"a.test:8080"]
    assert_te_only_as_trailers(first, b"trailers")


# -- h2: content-length against the DATA ----------------------------------------------------------

# (content-length fields, DATA frames; the last one ends the stream)
BODY_MISMATCHES = [
    pytest.param([b"0"], [b"hello"], id="cl-0-with-data"),
    pytest.param([b"5"], [b"hello world"], id="data-longer"),
    pytest.param([b"5"], [b"hel", b"lo world"], id="data-longer-later"),
    pytest.param([b"11"], [b"hello"], id="data-shorter"),
    pytest.param([b"5"], [b""], id="no-data"),
    pytest.param([b"+5"], [b"hello"], id="cl-plus"),
    pytest.param([b"5, 5"], [b"hello"], id="cl-list"),
    pytest.param([b"5", b"6"], [b"hello"], id="cl-twice-differing"),
]


async def send_mismatched(client: RawH2Client, lengths: list[bytes], frames: list[bytes]) -> H2Result:
    head = client.head(b"POST", b"/bad", *[(b"content-length", length) for length in lengths])
    sid = await client.start(head, end_stream=False)
    for i, data in enumerate(frames):
        try:
            await client.send(sid, data, end_stream=i == len(frames) - 1)
        except h2.exceptions.StreamClosedError:
            break  # the edge reset the stream at the frame that made it malformed: what collect reads
    return await client.collect(sid)


@pytest.mark.parametrize(("lengths", "frames"), BODY_MISMATCHES)
async def test_h2_body_not_matching_content_length_never_reaches_the_replica_whole(
    nursery: trio.Nursery, lengths: list[bytes], frames: list[bytes]
) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        for _ in range(2):  # cold (the handler path), then warm (the splice path)
            async with RawH2Client.open(chain.port) as client:
                result = await send_mismatched(client, lengths, frames)
            assert result.status != 200, result
            async with RawH2Client.open(chain.port) as client:
                assert (await client.request(client.head(b"GET", b"/good"))).status == 200
        await wait_for(lambda: replica.open <= 1, "the replica's connections for the broken uploads to close")
    for seen in replica.seen:
        if seen.target == b"/bad":
            # Either a head whose body never completes, or (content-length 0) a complete
            # empty request: never a body that disagrees with its length.
            declared = seen.values(b"content-length")
            assert declared == lengths[:1]
            assert len(seen.body) <= int(declared[0])
            assert not seen.complete or (declared == [b"0"] and seen.body == b"")
    assert [seen.target for seen in replica.seen if seen.target != b"/bad"] == [b"/good", b"/good"]
    assert replica.broken == 0


@pytest.mark.parametrize(("lengths", "frames"), BODY_MISMATCHES)
async def test_h2_body_not_matching_content_length_is_a_stream_error(
    nursery: trio.Nursery, lengths: list[bytes], frames: list[bytes]
) -> None:
    with trio.fail_after(10):
        chain, _ = await recording_chain(nursery)
        async with RawH2Client.open(chain.port) as client:
            result = await send_mismatched(client, lengths, frames)
            assert not result.connection_lost, f"the connection died: {result.terminated}"
            assert result.status == 400 or (
                result.reset is not None and result.reset.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR
            )
            assert (await client.request(client.head(b"GET", b"/good"))).status == 200


async def test_h2_content_length_zero_with_data_sends_no_body_bytes_upstream(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain, replica = await recording_chain(nursery)
        async with RawH2Client.open(chain.port) as client:
            head = client.head(b"POST", b"/bad", (b"content-length", b"0"))
            sid = await client.start(head, end_stream=False)
            await client.send(sid, b"GET /smuggled HTTP/1.1\r\nHost: a.test\r\n\r\n", end_stream=True)
            await client.collect(sid)
        await wait_for(lambda: replica.open == 0, "the replica's connection to close")
    assert [seen.target for seen in replica.seen] in ([], [b"/bad"])
    assert all(seen.body == b"" for seen in replica.seen)
    assert all(b"smuggled" not in raw for raw in replica.raw)
