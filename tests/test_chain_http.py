"""The chain recipe end to end, with real clients: curl, httpx, a raw h2 client.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``. The
only timing assertions are the functional streaming bounds, which are an
order of magnitude looser than what they check.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h2.events
import httpx
import pytest
import trio
from support import HOST, RawH2Client, curl, wait_for

from blocks import parse_server_timing
from blocks.store import encode_domain, encode_replica, route_key_for_domain, route_key_for_replica
from recipes.chain import Chain, main

PHASES = {"app", "worker", "proxy-route", "proxy", "edge", "total"}


def h2_client(**kwargs: Any) -> httpx.AsyncClient:
    """A prior-knowledge h2 client (h2c), ignoring proxies from the environment."""
    return httpx.AsyncClient(http2=True, http1=False, trust_env=False, **kwargs)


def check_server_timing(value: str | None) -> None:
    """Every phase present; the hops' own times add up to no more than the total."""
    assert value is not None, "no server-timing header"
    phases = parse_server_timing(value)
    assert set(phases) >= PHASES, phases
    assert all(dur >= 0 for dur in phases.values()), phases
    own = phases["edge"] + phases["proxy"] + phases["worker"] + phases["app"]
    assert own <= phases["total"] + 0.01, phases
    assert phases["proxy-route"] <= phases["proxy"] + 0.001, phases


# -- curl ---------------------------------------------------------------------------------


def split_curl(output: str) -> tuple[str, str, str]:
    """``curl -i -w '\\n%{http_version}'`` output -> (head, body, http_version)."""
    rest, _, version = output.rpartition("\n")
    head, _, body = rest.partition("\r\n\r\n")
    return head.lower(), body, version


@pytest.mark.parametrize(("flag", "version"), [("--http1.1", "1.1"), ("--http2-prior-knowledge", "2")])
async def test_curl_cleartext(chain: Chain, flag: str, version: str) -> None:
    with trio.fail_after(20):
        output = await curl(flag, "-i", "-w", "\n%{http_version}", chain.url + "/")
    head, body, seen = split_curl(output)
    assert seen == version
    assert head.startswith(f"http/{version} 200")
    assert "x-replica: replica-" in head
    assert body.startswith("hello from replica-")
    check_server_timing(next(line.partition(":")[2] for line in head.splitlines() if line.startswith("server-timing")))


async def test_curl_tls_alpn_h2(nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.fail_after(20):
        tls_chain: Chain = await nursery.start(functools.partial(main, tls=True, cert_dir=tmp_path))
        assert tls_chain.cert is not None
        assert tls_chain.url == f"https://localhost:{tls_chain.edge.port}"
        common = ("--cacert", str(tls_chain.cert), "--resolve", f"localhost:{tls_chain.edge.port}:127.0.0.1")
        output = await curl(*common, "-i", "-w", "\n%{http_version}", tls_chain.url + "/")
        head, body, version = split_curl(output)
        assert version == "2"  # ALPN picked h2: curl offers it over TLS by default
        assert head.startswith("http/2 200")
        assert body.startswith("hello from replica-")
        # The same port still serves HTTP/1.1 to a client that only offers it.
        output = await curl(*common, "--http1.1", "-w", "\n%{http_version}", tls_chain.url + "/")
        body, _, version = output.rpartition("\n")
        assert version == "1.1"
        assert body.startswith("hello from replica-")
        await tls_chain.shutdown(1.0)


# -- httpx --------------------------------------------------------------------------------


async def test_httpx_h2_spreads_over_both_replicas(chain: Chain) -> None:
    seen: list[str] = []
    with trio.fail_after(20):
        async with h2_client() as client:
            for _ in range(20):
                response = await client.get(chain.url + "/")
                assert response.status_code == 200
                assert response.http_version == "HTTP/2"
                replica = response.headers["x-replica"]
                assert response.text == f"hello from {replica}\n"
                seen.append(replica)
    assert set(seen) == {"replica-0", "replica-1"}, seen


async def test_200_concurrent_requests_on_one_h2_connection(chain: Chain) -> None:
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with trio.fail_after(30):
        async with h2_client(limits=limits, timeout=20) as client:

            async def one(i: int) -> None:
                response = await client.get(f"{chain.url}/status/200?i={i}")
                assert response.http_version == "HTTP/2"
                assert response.text == "status 200\n"
                statuses.append(response.status_code)

            async with trio.open_nursery() as requests:
                for i in range(200):
                    requests.start_soon(one, i)
    assert statuses == [200] * 200
    assert chain.edge.statistics().accepted == 1  # all 200 streams shared one connection


async def test_stream_first_chunk_arrives_before_the_last_is_sent(chain: Chain) -> None:
    arrivals: list[tuple[float, bytes]] = []
    with trio.fail_after(20):
        async with h2_client() as client:
            start = trio.current_time()
            async with client.stream("GET", chain.url + "/stream?n=5&ms=300") as response:
                assert response.status_code == 200
                async for chunk in response.aiter_raw():
                    arrivals.append((trio.current_time() - start, chunk))
            check_server_timing(response.headers.get("server-timing"))
    body = b"".join(chunk for _, chunk in arrivals)
    assert body == b"".join(b"token %d\n" % i for i in range(5))
    first_at, first = arrivals[0]
    last_at = arrivals[-1][0]
    assert first.startswith(b"token 0\n")
    assert b"token 4" not in first
    # The replica sleeps 4 x 300 ms between tokens; the first one must not wait for them.
    assert first_at < 1.0, arrivals
    assert last_at >= 1.2, arrivals


async def test_streamed_upload_is_echoed_while_still_uploading(chain: Chain) -> None:
    rounds = 5
    status = None
    with trio.fail_after(20):
        async with RawH2Client.open(chain.edge.port) as client:
            sid = await client.start(
                client.head(b"POST", b"/echo", (b"content-type", b"application/octet-stream")), end_stream=False
            )
            echoed = b""
            for i in range(rounds):
                chunk = b"chunk %d;" % i
                await client.send(sid, chunk)
                # The next chunk goes only once this one came back: a round trip
                # through every hop while the request body is still open.
                while not echoed.endswith(chunk):
                    event = await client.next_event(sid)
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers)[b":status"]
                        continue
                    assert isinstance(event, h2.events.DataReceived), event
                    echoed += event.data
            await client.end(sid)
            rest = await client.collect(sid)
    assert status == b"200"
    assert rest.reset is None
    assert rest.body == b""
    assert echoed == b"".join(b"chunk %d;" % i for i in range(rounds))


async def test_response_head_arrives_before_the_upload_starts(chain: Chain) -> None:
    """A bidirectional client (gRPC, a chat) may wait for the response head before it sends."""
    with trio.fail_after(20):
        async with RawH2Client.open(chain.edge.port) as client:
            sid = await client.start(client.head(b"POST", b"/echo"), end_stream=False)
            event = None
            with trio.move_on_after(5):
                event = await client.next_event(sid)
            assert isinstance(event, h2.events.ResponseReceived), "no response head while the upload is idle"
            assert dict(event.headers)[b":status"] == b"200"
            await client.send(sid, b"ping", end_stream=True)
            rest = await client.collect(sid)
    assert rest.body == b"ping"


async def test_trailers_end_to_end(chain: Chain) -> None:
    with trio.fail_after(20):
        async with RawH2Client.open(chain.edge.port) as client:
            result = await client.request(client.head(b"GET", b"/trailers", (b"te", b"trailers")))
    assert result.status == 200
    assert result.body == b"body before trailers\n"
    assert result.trailers is not None
    assert (b"grpc-status", b"0") in result.trailers
    kinds = [type(event) for event in result.events]
    assert kinds.index(h2.events.TrailersReceived) > kinds.index(h2.events.DataReceived)
    check_server_timing((result.header(b"server-timing") or b"").decode())


# -- Server-Timing ----------------------------------------------------------------------


async def test_server_timing_on_every_response(chain: Chain) -> None:
    with trio.fail_after(20):
        # One connection per h1 request: keep-alive has its own test.
        no_reuse = httpx.Limits(max_keepalive_connections=0)
        async with h2_client() as h2c, httpx.AsyncClient(trust_env=False, limits=no_reuse) as h1c:
            for client in (h2c, h1c):
                responses = [
                    await client.get(chain.url + "/"),
                    await client.get(chain.url + "/status/404"),
                    await client.get(chain.url + "/status/503"),
                    await client.get(chain.url + "/sleep?ms=20"),
                    await client.get(chain.url + "/stream?n=3&ms=0"),
                    await client.post(chain.url + "/echo", content=b"x" * 100_000),
                ]
                assert [r.status_code for r in responses] == [200, 404, 503, 200, 200, 200]
                assert responses[-1].content == b"x" * 100_000
                for response in responses:
                    assert len(response.headers.get_list("server-timing")) == 1
                    check_server_timing(response.headers.get("server-timing"))
    # The replica's sleep happened inside the app phase.
    assert parse_server_timing(responses[3].headers["server-timing"])["app"] >= 20


# -- h1 between worker and replica --------------------------------------------------------------


@pytest.fixture
async def h1_chain(nursery: trio.Nursery) -> AsyncIterator[Chain]:
    # One replica, so that every request reuses the worker's kept-alive h1 connections.
    with trio.fail_after(10):
        started: Chain = await nursery.start(functools.partial(main, replicas=1, replica_protocol="h1"))
    yield started
    with trio.fail_after(10):
        await started.shutdown(1.0)


async def test_h1_replica_protocol(h1_chain: Chain) -> None:
    async def upload() -> AsyncIterator[bytes]:
        for i in range(10):
            yield b"part %d\n" % i

    with trio.fail_after(20):
        async with h2_client() as client:
            for _ in range(2):
                response = await client.get(h1_chain.url + "/")
                assert response.status_code == 200
                assert response.text == "hello from replica-0\n"
                check_server_timing(response.headers.get("server-timing"))

                response = await client.post(h1_chain.url + "/echo", content=b"fixed length body")
                assert response.status_code == 200
                assert response.content == b"fixed length body"

                response = await client.post(h1_chain.url + "/echo", content=upload())  # no length: chunked to h1
                assert response.status_code == 200
                assert response.content == b"".join(b"part %d\n" % i for i in range(10))

                response = await client.get(h1_chain.url + "/stream?n=4&ms=10")
                assert response.status_code == 200
                assert response.content == b"token 0\ntoken 1\ntoken 2\ntoken 3\n"
    pools = h1_chain.worker.upstreams.statistics()
    assert pools
    assert {pool.protocol for pool in pools} == {"h1"}


# -- HTTP/1.1 keep-alive at the edge -------------------------------------------------------------


async def test_h1_keep_alive_at_the_edge(chain: Chain) -> None:
    with trio.fail_after(20):
        async with httpx.AsyncClient(trust_env=False) as client:
            for path in ("/", "/status/404", "/", "/sleep?ms=1"):
                response = await client.get(chain.url + path)
                assert response.http_version == "HTTP/1.1"
                assert "close" not in response.headers.get("connection", "")
            response = await client.post(chain.url + "/echo", content=b"after several GETs")
            assert response.content == b"after several GETs"
    assert chain.edge.statistics().accepted == 1  # one kept-alive connection for all five


async def test_the_chain_routes_from_its_store_and_follows_changes(chain: Chain) -> None:
    """The recipe's proxy reads a route cache that follows the embedded store: a domain
    put there routes within moments, a replica deleted there stops getting traffic."""
    with trio.fail_after(10):
        worker = f"{HOST}:{chain.worker_server.port}"
        replica_1 = f"{HOST}:{chain.replicas['replica-1'].port}"
        chain.store.transact(
            {
                route_key_for_domain("solo.test"): encode_domain("solo"),
                route_key_for_replica("solo", "replica-1"): encode_replica(worker=worker, address=replica_1),
            }
        )
        await wait_for(lambda: chain.cache.app_for(b"solo.test") == "solo")
        for _ in range(4):
            out = await curl(
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code} %header{x-replica}",
                "-H",
                "host: solo.test",
                f"{chain.url}/",
            )
            assert out == "200 replica-1"
        chain.store.delete(route_key_for_replica("solo", "replica-1"))
        await wait_for(lambda: not chain.cache.replicas("solo"))
        status = await curl("-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "host: solo.test", f"{chain.url}/")
        assert status == "503"
