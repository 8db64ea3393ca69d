"""Errors end to end, on chains assembled from blocks: 400, 502, 503, 504.

Every error reaches the client as a plain status page, never a traceback,
and one failing stream leaves the others on its connection alone.
Rules: loopback only, port 0, every test bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import re

import httpx
import pytest
import trio
from support import RawH2Client, assemble, h2_client, raw_exchange

from blocks import Chain, Hop, Request, UpstreamConfig, open_upstreams
from blocks.errors import (
    REASONS,
    BadRequest,
    BlocksError,
    HopFailed,
    InvalidToken,
    NoRoute,
    PayloadTooLarge,
    QueueFull,
    QueueTimeout,
    SessionLost,
    StreamReset,
    Unauthorized,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from blocks.timing import parse_server_timing
from blocks.tokens import TokenReason


def assert_error_page(response: httpx.Response, status: int, reason: str, hop: str) -> None:
    """The status, ``proxyblocks-error: REASON; hop=HOP`` (and, for a failure of the hop's upstream,
    which one: ``; replica=NAME (host:port)``), and a one-line body saying the same."""
    assert response.status_code == status
    assert "Traceback" not in response.text
    field = response.headers["proxyblocks-error"]
    assert re.fullmatch(
        rf"{reason}; hop={hop}(; (replica|next)=[\w@.-]+ \(127\.0\.0\.1:\d+\)|; next=127\.0\.0\.1:\d+)?", field
    )
    assert response.text == f"{status} {response.reason_phrase}: {field}\n"


async def wait_in_flight(chain: Chain) -> None:
    """Until the worker relays at least one request."""
    while not any(chain.worker.statistics().in_flight.values()):
        await trio.sleep(0.005)


# -- 503 --------------------------------------------------------------------------------------


async def test_503_for_an_unknown_authority(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery, domains={"known.test": "demo"})
        async with h2_client() as client:
            response = await client.get(chain.url + "/", headers={"host": "unknown.test"})
            assert_error_page(response, 503, "no_route", "proxy")
            # The same table routes what it knows, with or without a port, in any case.
            for host in ("known.test", "known.test:8080", "KNOWN.test"):
                response = await client.get(chain.url + "/", headers={"host": host})
                assert response.status_code == 200, host
                assert response.text == "hello from replica-0\n"
    assert chain.proxy.statistics().no_route == 1
    assert chain.worker_server.statistics().accepted >= 1


async def test_503_for_an_app_without_replicas(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        # replica-0 runs, but no route leads to it; the worker's 30 s timeout never matters.
        chain = await assemble(nursery, domains={"*": "empty"}, apps={"empty": []})
        async with h2_client() as h2c, httpx.AsyncClient(trust_env=False) as h1c:
            assert_error_page(await h2c.get(chain.url + "/"), 503, "no_replica", "proxy")
            assert_error_page(await h1c.get(chain.url + "/"), 503, "no_replica", "proxy")
    assert chain.proxy.statistics().no_route == 2
    assert chain.worker_server.statistics().accepted == 0  # decided in the proxy's memory


# -- 502 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["h2", "h1"])
async def test_502_when_the_replica_refuses_connections(nursery: trio.Nursery, protocol: str) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery, replicas=(), dead=("dead-0",), protocol=protocol)
        async with h2_client() as client:
            for _ in range(2):
                assert_error_page(await client.get(chain.url + "/"), 502, "replica_unreachable", "worker")
            response = await client.post(chain.url + "/echo", content=b"x" * 1000)
            assert_error_page(response, 502, "replica_unreachable", "worker")
    assert chain.worker.statistics().in_flight == {"dead-0": 0}
    assert chain.proxy.statistics().in_flight == {"dead-0": 0}


# -- 504 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["h2", "h1"])
async def test_504_when_the_replica_is_slower_than_the_worker_timeout(nursery: trio.Nursery, protocol: str) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery, worker_upstream=UpstreamConfig(response_timeout=0.3), protocol=protocol)
        async with h2_client() as client:
            assert_error_page(await client.get(chain.url + "/sleep?ms=2000"), 504, "replica_timeout", "worker")
            # Within the timeout the same path answers.
            response = await client.get(chain.url + "/sleep?ms=1")
            assert response.status_code == 200
            assert response.text == "slept\n"
    assert chain.worker.statistics().in_flight == {"replica-0": 0}


# -- 400 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: a.test\r\nthis line is not a header\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a.test\r\nbad name: x\r\n\r\n",
        b"NOT HTTP AT ALL\r\n\r\n",
    ],
)
async def test_400_for_malformed_h1(nursery: trio.Nursery, garbage: bytes) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery)
        reply = await raw_exchange(chain.port, garbage)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), reply
    assert b"connection: close" in head.lower()
    assert b"Traceback" not in reply
    assert body == b"400 Bad Request: bad_request; hop=edge\n"  # the edge listener's own answer, naming it
    assert chain.proxy_server.statistics().accepted == 0  # rejected at the edge


async def test_400_when_h2_authority_and_host_disagree(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble(nursery)
        async with RawH2Client.open(chain.port) as client:
            bad = [
                (b":method", b"GET"),
                (b":scheme", b"http"),
                (b":authority", b"a.test"),
                (b":path", b"/"),
                (b"host", b"b.test"),
            ]
            result = await client.request(bad)
            assert not result.connection_lost, f"connection dropped instead of a 400: {result.terminated}"
            assert result.status == 400
            assert b"Traceback" not in result.body
            assert result.body == b"400 Bad Request: bad_request; hop=edge\n"
            # A malformed request is a stream error: the connection goes on.
            good = await client.request(client.head(b"GET", b"/"))
            assert good.status == 200
            assert good.body == b"hello from replica-0\n"
    assert chain.worker.statistics().served == {"replica-0": 1}  # only the good one got past the edge


# -- isolation --------------------------------------------------------------------------------


async def test_a_failing_stream_leaves_its_connection_alone(nursery: trio.Nursery) -> None:
    statuses: list[int] = []
    slow: list[httpx.Response] = []
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with trio.fail_after(20):
        # A 1 s timeout leaves the fast requests ample room even on a loaded machine.
        chain = await assemble(nursery, worker_upstream=UpstreamConfig(response_timeout=1.0))
        async with h2_client(limits=limits) as client:

            async def fast(i: int) -> None:
                response = await client.get(f"{chain.url}/?i={i}")
                assert response.text == "hello from replica-0\n"
                statuses.append(response.status_code)

            async def sleeper() -> None:
                slow.append(await client.get(chain.url + "/sleep?ms=3000"))

            async with trio.open_nursery() as requests:
                requests.start_soon(sleeper)
                await wait_in_flight(chain)  # the slow one is on the connection
                for i in range(10):
                    requests.start_soon(fast, i)
            # After the 504, the same connection serves ten more.
            async with trio.open_nursery() as requests:
                for i in range(10, 20):
                    requests.start_soon(fast, i)
    assert_error_page(slow[0], 504, "replica_timeout", "worker")
    assert statuses == [200] * 20
    assert chain.edge.statistics().accepted == 1


# -- every error class: its reason, the hop, a one-line body ------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "reason"),
    [
        (BadRequest("x"), 400, "bad_request"),
        (Unauthorized("x"), 401, "unauthorized"),
        (InvalidToken(TokenReason.EXPIRED), 401, "unauthorized"),
        (BlocksError("x", status=405), 405, "not_allowed"),
        (SessionLost("x", reason="replica-gone"), 410, "session_lost"),
        (PayloadTooLarge("x"), 413, "too_large"),
        (QueueFull("x", tenant="t", retry_after=1.0), 429, "overloaded"),
        (QueueTimeout("x", tenant="t", retry_after=1.0), 503, "overloaded"),
        (NoRoute("x"), 503, "no_route"),
        (NoRoute("x", error_reason="no_replica"), 503, "no_replica"),
        (UpstreamConnectError("x"), 502, "replica_unreachable"),
        (UpstreamProtocolError("x", status=503), 503, "replica_refused"),
        (UpstreamTimeout("x"), 504, "replica_timeout"),
        (UpstreamProtocolError("x"), 502, "upstream_reset"),
        (StreamReset("x"), 502, "upstream_reset"),
        (HopFailed("x"), 500, "internal"),
    ],
)
async def test_every_error_class_answers_its_reason_and_hop(error: BlocksError, status: int, reason: str) -> None:
    assert reason in REASONS
    async with open_upstreams() as upstreams:
        hop = Hop("somehop", upstreams, [])
        request = Request(b"GET", b"http", b"a.test", b"/", [])
        response = hop.error_answer(request, error)
    assert response.status == status
    fields = dict(response.headers)
    assert fields[b"proxyblocks-error"] == f"{reason}; hop=somehop".encode()
    assert list(parse_server_timing(fields[b"server-timing"])) == ["somehop"]
    for name, value in error.headers:  # retry-after, www-authenticate, proxyblocks-session-ended
        assert fields[name] == value
    body = await response.body.read_all()
    assert body.count(b"\n") == 1 and body.endswith(f": {reason}; hop=somehop\n".encode())
    assert body.startswith(b"%d " % status)
