"""Regression tests, one per fixed bug: each fails if its fix is reverted.

Every test names the fix it guards in a ``# Guards:`` comment. HTTP/2
requests through a hop take the splice fast path only once that hop's pool
holds a connection with a free slot (the very first request to an upstream
takes the handler path and opens the pool), so tests of the splice path warm
the chain up with one ordinary request first, and check with
:func:`support.record_relays` that the hops under test really spliced.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``,
real clients and servers.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from support import (
    HOST,
    H2Result,
    RawH2Client,
    assemble,
    assemble_local,
    curl,
    h2_client,
    record_relays,
)

from blocks import (
    EdgeConfig,
    IterBody,
    LeastInFlight,
    ListenerConfig,
    LocalReplica,
    Replica,
    Request,
    Response,
    UpstreamConfig,
    UpstreamTimeout,
    open_upstreams,
    serve_edge,
    serve_http,
    serve_worker,
    text_response,
)
from blocks.testing import DemoApp, serve_demo_replica

TOKENS = b"".join(b"token %d\n" % i for i in range(5))


async def get(client: RawH2Client, path: bytes, *extra: tuple[bytes, bytes]) -> H2Result:
    return await client.request(client.head(b"GET", path, *extra))


# -- spliced error responses are flushed ------------------------------------------------------


async def test_spliced_504s_are_delivered_and_do_not_wedge_the_chain(nursery: trio.Nursery) -> None:
    # Guards: down.kick() in Splice._upstream_failed (the 504 is written by the timeout sweeper, outside any
    # reader's batch; without the kick it sits unsent in the worker's h2 buffer and the client hangs).
    with trio.fail_after(20):
        chain = await assemble(nursery, worker_upstream=UpstreamConfig(response_timeout=0.5))
        proxy_relays = record_relays(chain.proxy_server)
        worker_relays = record_relays(chain.worker_server)
        async with RawH2Client.open(chain.port) as client:
            warm = await get(client, b"/")
            assert warm.status == 200
            for _ in range(3):
                with trio.fail_after(5):
                    result = await get(client, b"/sleep?ms=3000")
                assert not result.connection_lost
                assert result.reset is None
                assert result.status == 504
                assert re.fullmatch(
                    rb"504 Gateway Timeout: replica_timeout; hop=worker; replica=replica-\d \(127\.0\.0\.1:\d+\)\n",
                    result.body,
                )
            result = await get(client, b"/")
            assert result.status == 200
            assert result.body == b"hello from replica-0\n"
    # The warm-up opened the pools; the three 504s and the last GET went through the splices.
    assert worker_relays.outcomes == [False, True, True, True, True]
    assert proxy_relays.outcomes == [False, True, True, True, True]
    assert chain.worker.statistics().in_flight == {"replica-0": 0}


# -- uploads through the splice path ---------------------------------------------------------


@pytest.mark.parametrize("version", ["--http1.1", "--http2-prior-knowledge"])
async def test_uploads_through_the_splice_path_are_never_cut_short(
    nursery: trio.Nursery, tmp_path: Path, version: str
) -> None:
    # Guards: `and not self.pending` in Pipe.feed (--http1.1: the edge's handler path ends an upload with an
    # empty END_STREAM DATA frame, which must not end the proxy's upstream stream while data still waits for
    # window). curl's h2 uploads end on their last DATA frame: that case keeps the all-splice path honest.
    upload = tmp_path / "upload.bin"
    data = os.urandom(5 * 1024 * 1024)
    upload.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    with trio.fail_after(60):
        chain = await assemble(nursery)
        proxy_relays = record_relays(chain.proxy_server)
        worker_relays = record_relays(chain.worker_server)
        assert (await curl(version, chain.url + "/")).startswith("hello from replica-0")
        accepted = chain.worker_server.statistics().accepted
        for i in range(3):
            echoed = tmp_path / f"echoed-{i}.bin"
            status = await curl(
                version,
                "--data-binary",
                f"@{upload}",
                "-H",
                "content-type: application/octet-stream",
                "-o",
                str(echoed),
                "-w",
                "%{http_code}",
                chain.url + "/echo",
            )
            assert status == "200"
            received = echoed.read_bytes()
            assert len(received) == len(data), f"upload {i}: {len(received)} of {len(data)} bytes echoed"
            assert hashlib.sha256(received).hexdigest() == expected
        assert (await curl(version, chain.url + "/")).startswith("hello from replica-0")
    assert proxy_relays.outcomes[1:] == [True] * 4
    assert worker_relays.outcomes[1:] == [True] * 4
    # The proxy -> worker pooled connection survived every upload.
    assert chain.worker_server.statistics().accepted == accepted == 1


# -- a response body that breaks after the head ---------------------------------------------------

GOOD = b"ok\n"
DECLARED = 100_000
SENT = b"x" * 10


async def cutting_h1_replica(stream: trio.SocketStream) -> None:
    """An h1 server whose /broken declares 100000 bytes, sends 10 and closes the socket."""
    async with stream:
        head = b""
        while b"\r\n\r\n" not in head:
            data = await stream.receive_some(65536)
            if not data:
                return
            head += data
        path = head.split(b" ", 2)[1]
        if path == b"/broken":
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (DECLARED, SENT))
        else:
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\n" + GOOD)


async def breaking_h2_app(request: Request) -> Response:
    """/broken: a head declaring 100000 bytes, 10 bytes of body, then the app fails."""
    if request.path != b"/broken":
        return text_response(200, GOOD.decode())

    async def chunks() -> AsyncIterator[bytes]:
        yield SENT
        raise RuntimeError("the app broke mid-body")

    return Response(200, [(b"content-length", b"%d" % DECLARED)], IterBody(chunks(), DECLARED))


async def start_breaking_replica(nursery: trio.Nursery, protocol: str) -> LocalReplica:
    if protocol == "h1":
        listeners: list[trio.SocketListener] = await nursery.start(
            functools.partial(trio.serve_tcp, cutting_h1_replica, 0, host=HOST)
        )
        port = listeners[0].socket.getsockname()[1]
    else:
        server = await nursery.start(serve_http, breaking_h2_app)
        port = server.port
    return LocalReplica((HOST, port), protocol)


async def check_cut_short_then_good(port: int, rounds: int) -> None:
    async with RawH2Client.open(port) as client:
        for _ in range(rounds):
            with trio.fail_after(5):
                broken = await get(client, b"/broken")
            assert not broken.connection_lost, broken.terminated
            assert broken.status == 200
            assert broken.reset is not None, f"stream ended normally after {len(broken.body)} of {DECLARED} bytes"
            assert len(broken.body) < DECLARED
            # The stream was reset, not the connection: the next request on it works.
            with trio.fail_after(5):
                good = await get(client, b"/good")
            assert good.status == 200
            assert good.body == GOOD


@pytest.mark.parametrize("protocol", ["h1", "h2"])
async def test_a_body_that_breaks_after_the_head_resets_the_stream(nursery: trio.Nursery, protocol: str) -> None:
    # Guards: the `sent` flag in H2ServerConnection._run_stream (a body that breaks after the head raised
    # StreamReset, and the stream was then "finished" locally with nothing on the wire: the client hung).
    with trio.fail_after(30):
        # Straight at a worker: the first request takes its handler path.
        replica = await start_breaking_replica(nursery, protocol)
        worker_server, _ = await nursery.start(functools.partial(serve_worker, {"broken": replica}))
        await check_cut_short_then_good(worker_server.port, rounds=2)
        # Through the whole chain: the handler path at every hop, then the splices (h2 replica).
        chain = await assemble_local(nursery, {"broken": await start_breaking_replica(nursery, protocol)})
        await check_cut_short_then_good(chain.port, rounds=3)


# -- the header-list cap --------------------------------------------------------------------------


def counted(headers: Sequence[tuple[bytes, bytes]]) -> int:
    """A header list's size as RFC 7541 4.1 counts it."""
    return sum(len(name) + len(value) + 32 for name, value in headers)


async def stream_tokens(port: int, results: list[H2Result], started: trio.Event) -> None:
    async with RawH2Client.open(port) as client:
        sid = await client.start(client.head(b"GET", b"/stream?n=5&ms=200"))
        started.set()
        results.append(await client.collect(sid))


async def alongside_a_stream(started: trio.Event) -> None:
    """Until the token stream from another client is under way."""
    await started.wait()
    await trio.sleep(0.1)


async def test_h2_header_list_over_the_edge_cap_gets_431_on_its_stream(nursery: trio.Nursery) -> None:
    # Guards: check_header_list_size in validate_request_head, and the h2 listener's decoder cap at four times
    # the 431 cap (at the cap itself h2's decoder fails the whole connection before validation runs).
    streamed: list[H2Result] = []
    started = trio.Event()
    with trio.fail_after(20):
        chain = await assemble(nursery)
        async with RawH2Client.open(chain.port) as client:
            assert (await get(client, b"/")).status == 200
            async with trio.open_nursery() as inner:
                inner.start_soon(stream_tokens, chain.port, streamed, started)
                await alongside_a_stream(started)
                big = await get(client, b"/", (b"x-big", b"a" * 70_000))
                assert not big.connection_lost, f"the connection died instead of a 431: {big.terminated}"
                assert big.status == 431
                assert big.body == b"431 Request Header Fields Too Large: bad_request; hop=edge\n"
                after = await get(client, b"/")
                assert after.status == 200
                assert after.body == b"hello from replica-0\n"
    assert streamed[0].status == 200
    assert streamed[0].reset is None
    assert streamed[0].body == TOKENS
    # The warm-up, the token stream and the GET after: the oversized head never got past the edge.
    assert chain.worker.statistics().served == {"replica-0": 3}


def many_fields(n: int) -> list[str]:
    """curl arguments for ``n`` small fields: a head h11 takes (few raw bytes), over the cap as counted."""
    args: list[str] = []
    for i in range(n):
        args += ["-H", f"x-h{i}: v"]
    return args


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param(["-H", "x-big: " + "a" * 70_000], id="one-large-field"),
        # ~26 KB on the wire (under h11's limit), ~78 KB as RFC 7541 counts it.
        pytest.param(many_fields(2000), id="many-small-fields"),
    ],
)
async def test_h1_header_list_over_the_edge_cap_gets_431(nursery: trio.Nursery, fields: list[str]) -> None:
    # Guards: check_header_list_size in _h1server._request_from (h11's own limit counts raw bytes and only
    # while a head is incomplete: both heads can get past it, and without the check they go up the chain).
    streamed: list[H2Result] = []
    started = trio.Event()
    with trio.fail_after(30):
        chain = await assemble(nursery)
        assert (await curl("--http2-prior-knowledge", chain.url + "/")).startswith("hello from replica-0")
        async with trio.open_nursery() as inner:
            inner.start_soon(stream_tokens, chain.port, streamed, started)
            await alongside_a_stream(started)
            status = await curl("--http1.1", "-o", os.devnull, "-w", "%{http_code}", *fields, chain.url + "/")
        assert status == "431"
        assert (await curl("--http1.1", chain.url + "/")).startswith("hello from replica-0")
    assert streamed[0].status == 200
    assert streamed[0].reset is None
    assert streamed[0].body == TOKENS
    # The warm-up, the token stream and the GET after: the 431 came from the edge, not from a later hop.
    assert chain.worker.statistics().served == {"replica-0": 3}


async def send_just_under_the_edge_cap(port: int) -> H2Result:
    """An h2 request 100 bytes under the edge's 64 KiB cap: the edge accepts it, then every hop adds fields."""
    async with RawH2Client.open(port) as client:
        head = client.head(b"GET", b"/", (b"x-big", b""))
        value = b"a" * (ListenerConfig().max_header_list_size - 100 - counted(head))
        return await get(client, b"/", (b"x-big", value))


async def test_a_head_the_edge_accepts_passes_every_internal_hop(nursery: trio.Nursery) -> None:
    # Guards: make_h2 giving h2's decoder the configured header-list cap (h2 applies SETTINGS to its decoder
    # only on a change acknowledged later, so internal hops kept its 64 KiB default whatever INTERNAL_LISTENER
    # said; the fields the edge adds then tip the head over, and the proxy's decoder kills the shared
    # edge -> proxy connection), and INTERNAL_LISTENER's cap above the edge's.
    streamed: list[H2Result] = []
    started = trio.Event()
    with trio.fail_after(20):
        # A replica with room to spare, so that only the internal hops' caps matter here.
        roomy = await nursery.start(
            functools.partial(serve_http, DemoApp("replica-0"), config=ListenerConfig(max_header_list_size=256 * 1024))
        )
        chain = await assemble_local(nursery, {"replica-0": LocalReplica((HOST, roomy.port))})
        async with RawH2Client.open(chain.port) as client:
            assert (await get(client, b"/")).status == 200
        async with trio.open_nursery() as inner:
            inner.start_soon(stream_tokens, chain.port, streamed, started)
            await alongside_a_stream(started)
            big = await send_just_under_the_edge_cap(chain.port)
    assert big.status == 200
    assert big.body == b"hello from replica-0\n"
    assert streamed[0].status == 200
    assert streamed[0].reset is None
    assert streamed[0].body == TOKENS


async def test_a_head_the_edge_accepts_never_kills_a_pooled_replica_connection(nursery: trio.Nursery) -> None:
    # Guards: the h2 listener's decoder cap at four times the 431 cap, at the replica (a head under the edge's cap,
    # grown by the hops' fields, gets a 431 from the replica instead of killing the worker's pooled connection
    # to it, which another client's stream shares).
    streamed: list[H2Result] = []
    started = trio.Event()
    with trio.fail_after(20):
        chain = await assemble(nursery)
        async with RawH2Client.open(chain.port) as client:
            assert (await get(client, b"/")).status == 200
        async with trio.open_nursery() as inner:
            inner.start_soon(stream_tokens, chain.port, streamed, started)
            await alongside_a_stream(started)
            big = await send_just_under_the_edge_cap(chain.port)
    assert not big.connection_lost
    assert big.reset is None
    assert big.status in (200, 431)
    assert streamed[0].status == 200
    assert streamed[0].reset is None, "another client's stream died with the replica connection"
    assert streamed[0].body == TOKENS


# -- drain and idle h1 connections --------------------------------------------------------------


async def test_drain_closes_idle_h1_keep_alive_connections_at_once(nursery: trio.Nursery) -> None:
    # Guards: _H1Drain.idle_scope (without it, a connection idling between requests waits out
    # h1_idle_timeout, and aclose() its whole grace).
    async def hello(request: Request) -> Response:
        return text_response(200, "hi\n")

    with trio.fail_after(10):
        server = await nursery.start(serve_http, hello)
        stream = await trio.open_tcp_stream(HOST, server.port)
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: a.test\r\n\r\n")
            received = b""
            while not received.endswith(b"\r\n\r\nhi\n"):
                data = await stream.receive_some(65536)
                assert data, received
                received += data
            assert received.startswith(b"HTTP/1.1 200 ")
            assert b"connection: close" not in received.lower()  # kept alive
            await trio.testing.wait_all_tasks_blocked()  # and now idle: the server waits for the next head
            with trio.fail_after(2):
                await server.aclose(grace=30)
            with trio.fail_after(2):
                assert await stream.receive_some(65536) == b""
    assert server.statistics().connections == 0


# -- x-forwarded-for and internal fields at the edge ------------------------------------------------


async def echo_forwarding_fields(request: Request) -> Response:
    """Stands in for the proxy: tells what the edge sent it."""
    forwarded = request.header(b"x-forwarded-for", b"-") or b""
    internal = [name for name, _ in request.headers if name.startswith(b"x-proxyblocks-")]
    return text_response(200, f"{forwarded.decode()}|{b','.join(internal).decode()}")


@pytest.mark.parametrize("trust_forwarded", [True, False])
async def test_x_forwarded_for_at_the_edge(nursery: trio.Nursery, trust_forwarded: bool) -> None:
    # Guards: the trust_forwarded branch of Edge.upstream_headers (the client's value must gain ours, not
    # pass unchanged), and the internal x-proxyblocks-* fields never pass the edge.
    expected = "203.0.113.7, 127.0.0.1|" if trust_forwarded else "127.0.0.1|"
    headers = {"x-forwarded-for": "203.0.113.7", "x-proxyblocks-replica": "replica-9"}
    with trio.fail_after(20):
        upstream = await nursery.start(serve_http, echo_forwarding_fields)
        config = EdgeConfig(proxy=(HOST, upstream.port), trust_forwarded=trust_forwarded)
        edge = await nursery.start(serve_edge, config)
        url = f"http://{HOST}:{edge.port}/"
        async with h2_client() as h2c, httpx.AsyncClient(trust_env=False) as h1c:
            # h2: the handler path, then (pool open) the splice; h1: always the handler path.
            for client in (h2c, h2c, h1c):
                response = await client.get(url, headers=headers)
                assert response.status_code == 200
                assert response.text == expected
            # Without a value of its own, the client's address starts the chain either way.
            response = await h2c.get(url)
            assert response.text == "127.0.0.1|"


# -- per-call timeouts ----------------------------------------------------------------------------


async def test_a_per_call_timeout_is_honoured_behind_a_longer_wait(nursery: trio.Nursery) -> None:
    # Guards: the per-call branch of _H2Pool.request (a timeout of its own gets its own deadline; in the
    # sweeper's deadline-ordered queue it would wait behind an earlier request's 10 s).
    with trio.fail_after(20):
        replica = await nursery.start(serve_demo_replica, "replica-0")
        address = (HOST, replica.port)

        def sleep(ms: int) -> Request:
            return Request(b"GET", b"http", b"x", b"/sleep?ms=%d" % ms)

        async with open_upstreams(UpstreamConfig(response_timeout=10)) as upstreams:
            response = await upstreams.request(address, Request(b"GET", b"http", b"x", b"/"), [])
            assert response.status == 200
            await response.body.read_all()
            async with trio.open_nursery() as inner:
                inner.start_soon(functools.partial(upstreams.request, address, sleep(8000), []))
                while not any(pool.active_streams for pool in upstreams.statistics()):
                    await trio.sleep(0.005)
                with trio.fail_after(2), pytest.raises(UpstreamTimeout):
                    await upstreams.request(address, sleep(3000), [], timeout=0.3)
                # And alone in the pool, too.
                inner.cancel_scope.cancel()
            with trio.fail_after(2), pytest.raises(UpstreamTimeout):
                await upstreams.request(address, sleep(3000), [], timeout=0.3)


# -- fast-path decisions ------------------------------------------------------------------------


class CountingPolicy(LeastInFlight):
    def __init__(self) -> None:
        super().__init__()
        self.picks = 0

    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        self.picks += 1
        return super().pick(request, candidates, in_flight)


async def test_a_declined_fast_path_decision_is_not_taken_again(nursery: trio.Nursery) -> None:
    # Guards: Request.decision reuse in Hop.relay/handle (a declined splice leaves its route for the handler;
    # routing again picked twice, counted twice and added a second proxy-route timing entry).
    policy = CountingPolicy()
    responses: list[httpx.Response] = []
    with trio.fail_after(20):
        replica = await nursery.start(serve_demo_replica, "replica-0")
        chain = await assemble_local(
            nursery,
            {"replica-0": LocalReplica((HOST, replica.port))},
            proxy_upstream=UpstreamConfig(max_connections=1, max_streams_per_connection=1),
            policy=policy,
        )
        proxy_relays = record_relays(chain.proxy_server)
        async with h2_client() as client:
            # The pool's first request takes the handler path: decided in relay, carried out by handle.
            responses.append(await client.get(chain.url + "/"))

            async def slow() -> None:
                responses.append(await client.get(chain.url + "/sleep?ms=300"))

            # One slot to the worker: the first takes it (spliced), the second is declined and waits.
            async with trio.open_nursery() as inner:
                inner.start_soon(slow)
                inner.start_soon(slow)
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert sorted(proxy_relays.outcomes) == [False, False, True]
    assert policy.picks == 3
    for response in responses:
        timing = response.headers["server-timing"]
        assert timing.count("proxy-route;") == 1, timing
    assert chain.proxy.statistics().in_flight == {"replica-0": 0}
