"""An edge over several proxies, a proxy over several workers, and errors that name what failed.

The edge spreads requests over its proxies (least in flight), ejects one it
cannot reach, and sends a request that reached none to another proxy once; a
5xx a hop behind it answered is passed on and is no failure of that proxy. A
proxy whose worker is unreachable retries behind another worker. Each error
names the upstream that failed: ``next=proxy-N (host:port)`` at the edge,
``next=host:port`` at the proxy, ``replica=NAME (host:port)`` at the worker.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``;
tests wait for states (a request in flight at a replica, an ejection that
ended), never for durations. Ties between proxies are broken at random, so
where a test needs a request to go to one proxy it holds requests in flight
elsewhere: least in flight then decides.
"""

from __future__ import annotations

import collections
import functools
import os
import random
import re
import signal

import h2.events
import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from support import (
    HOST,
    RawH2Client,
    TenantReplica,
    closed_port,
    connect_websocket,
    h2_client,
    serve_tenant_replica,
    start_recipe,
    wait_for,
)

from blocks import (
    Chain,
    Edge,
    EdgeConfig,
    Exchange,
    HTTPServer,
    LocalReplica,
    Proxy,
    ProxyConfig,
    Replica,
    Request,
    Response,
    RouteTable,
    UpstreamConfig,
    open_upstreams,
    serve_chain,
    serve_edge,
    serve_websocket_app,
    text_response,
)
from blocks.errors import REASONS, RETRYABLE_REASONS
from blocks.fields import ERROR_HEADER
from blocks.hops.edge import next_hop, own_error
from blocks.observe import Metrics, RequestIds, served_hop
from blocks.routing import LeastInFlight, OutlierConfig, OutlierDetector
from blocks.testing import websocket_echo
from blocks.timing import parse_server_timing
from blocks.topology import App, ChainPlan

PROXIES = ("proxy-1", "proxy-2")


def edge_of(server: HTTPServer) -> Edge:
    edge = served_hop(server)
    assert isinstance(edge, Edge), edge
    return edge


def crossed(response: httpx.Response) -> list[str]:
    """The hops a response names in its ``server-timing``, front last."""
    return list(parse_server_timing(response.headers["server-timing"]))


def proxy_of(response: httpx.Response) -> str:
    """Which of :data:`PROXIES` the response crossed (exactly one)."""
    (proxy,) = [name for name in crossed(response) if name in PROXIES]
    return proxy


def assert_error(response: httpx.Response, status: int, field: str) -> None:
    """The status, exactly this ``proxyblocks-error``, and the one-line body saying the same."""
    assert response.status_code == status, response.text
    assert response.headers["proxyblocks-error"] == field
    assert response.text == f"{status} {response.reason_phrase}: {field}\n"


async def start_proxies(chain: Chain, n: int = 2) -> None:
    for k in range(1, n + 1):
        await chain.start_proxy(config=ProxyConfig(name=f"proxy-{k}"))


async def held_behind_proxies(nursery: trio.Nursery) -> tuple[Chain, TenantReplica]:
    """edge -> proxy-1, proxy-2 (one route cache) -> one worker -> a replica that holds ``/hold``."""
    replica, _, local = await serve_tenant_replica(nursery)

    async def build(chain: Chain) -> None:
        await chain.start_worker({"held": local})
        await start_proxies(chain)
        await chain.start_edge()

    chain: Chain = await nursery.start(serve_chain, build)
    return chain, replica


# -- spreading ---------------------------------------------------------------------------------


async def test_the_edge_spreads_requests_over_its_proxies(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        chain, replica = await held_behind_proxies(nursery)
        edge = edge_of(chain.edge)
        assert [hop.name for hop in edge.to_proxy.next_hops()] == list(PROXIES)
        responses: list[httpx.Response] = []
        async with h2_client(timeout=10) as client:

            async def get() -> None:
                responses.append(await client.get(chain.url + "/hold"))

            async with trio.open_nursery() as requests:
                for _ in range(4):
                    requests.start_soon(get)
                await wait_for(lambda: replica.total_in_flight == 4, "4 requests held at the replica")
                # Least in flight: whichever proxy the first took, the second took the other, and so on.
                assert edge.to_proxy.in_flight == {"proxy-1": 2, "proxy-2": 2}
                assert [proxy.statistics().in_flight for _, proxy in chain.proxies] == [{"held": 2}] * 2
                replica.release()
        assert [response.status_code for response in responses] == [200] * 4
        assert collections.Counter(proxy_of(response) for response in responses) == {"proxy-1": 2, "proxy-2": 2}
        assert all(crossed(r)[-2:] == ["edge", "total"] for r in responses)
    assert edge.to_proxy.in_flight == {"proxy-1": 0, "proxy-2": 0}
    assert edge.retried == 0
    assert edge.to_proxy.outliers is not None
    assert edge.to_proxy.outliers.statistics().ejections == 0


# -- a proxy the edge cannot reach -----------------------------------------------------------------


async def test_a_dead_proxy_is_ejected_and_its_requests_go_to_the_live_one(nursery: trio.Nursery) -> None:
    """proxy-1 is a closed port, proxy-2 a live proxy: every request is answered 200. A request
    that went to proxy-1 is sent to proxy-2 (``edge.retried``), a streamed upload included,
    and proxy-1 is ejected; while it is, requests go straight to proxy-2."""
    dead = (HOST, closed_port())
    with trio.fail_after(30):
        replica, _, local = await serve_tenant_replica(nursery)

        async def build(chain: Chain) -> None:
            echo = await chain.start_replica("echo")
            server, _ = await chain.start_worker({"held": local, "echo": echo}, app=None)
            apps = {"held": App(("held.test",), {"held": local}), "demo": App(("*",), {"echo": echo})}
            chain.route(apps, worker=(HOST, server.port))
            await chain.start_proxy(config=ProxyConfig(name="proxy-2"))

        chain: Chain = await nursery.start(serve_chain, build)
        # No health checks or slow start: proxy-1's ejection ends by its time, and the next request
        # (fewer in flight there) tries it again.
        once = OutlierConfig(slow_start_window=0.0)
        config = EdgeConfig(proxies=[dead, (HOST, chain.proxy_server.port)], health=None, outliers=once)
        edge_server = await chain.start(functools.partial(serve_edge, config, host=HOST))
        edge = edge_of(edge_server)
        outliers = edge.to_proxy.outliers
        assert outliers is not None
        async with RawH2Client.open(edge_server.port) as client:
            # One request held at proxy-2 (retried there if it went to proxy-1 first), then a
            # second: if proxy-1 is not ejected yet, it has fewer in flight, so it is picked.
            hold = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"held.test"), (b":path", b"/hold")]
            held = await client.start(hold)
            await wait_for(lambda: replica.total_in_flight == 1, "the first request held")
            result = await client.request(client.head(b"GET", b"/"))
            assert result.status == 200, result
            assert result.body == b"hello from echo\n"
            assert edge.retried == 1
            assert outliers.statistics().ejections == 1
            assert list(outliers.statistics().hops) == [dead]
            assert edge.to_proxy.in_flight == {"proxy-1": 0, "proxy-2": 1}

            # Once proxy-1 is back in selection, an upload whose body comes after its head goes
            # to it (fewer in flight) and on to proxy-2, and streams through.
            await wait_for(lambda: not outliers.out(dead, trio.current_time()), "proxy-1 back in selection")
            sid = await client.start(client.head(b"POST", b"/echo"), end_stream=False)
            head = await client.next_event(sid)
            assert isinstance(head, h2.events.ResponseReceived), head
            assert (b":status", b"200") in head.headers  # answered before any of the body was sent
            assert edge.retried == 2
            chunks = [b"%d" % i * 1000 for i in range(5)]
            for chunk in chunks:
                await client.send(sid, chunk)
            await client.end(sid)
            echoed = await client.collect(sid)
            assert echoed.body == b"".join(chunks)
            assert echoed.reset is None and not echoed.connection_lost
            assert outliers.statistics().ejections == 2

            # proxy-1 is out: the next requests go straight to proxy-2.
            for _ in range(5):
                result = await client.request(client.head(b"GET", b"/"))
                assert result.status == 200
                assert "proxy-2" in parse_server_timing(result.header(b"server-timing") or b"")
            assert edge.retried == 2

            replica.release()
            answered = await client.collect(held)
            assert answered.status == 200
    assert edge.to_proxy.in_flight == {"proxy-1": 0, "proxy-2": 0}
    assert chain.proxy.statistics().retried == 0  # the retries were the edge's


async def test_a_websocket_whose_proxy_cannot_be_reached_opens_through_another(nursery: trio.Nursery) -> None:
    """A WebSocket's h1 Upgrade that the edge sent to a dead proxy reached nothing: none of the
    tunnel was read (no 101 went out), so it goes to the live proxy and opens. (An h2 extended
    CONNECT's body is a stream no pool claimed: the same rule as any upload.)"""
    dead = (HOST, closed_port())
    with trio.fail_after(30):

        async def build(chain: Chain) -> None:
            ws = await chain.start_replica("ws", functools.partial(serve_websocket_app, websocket_echo, _hello))
            await chain.start_worker({"ws": ws})
            await chain.start_proxy(config=ProxyConfig(name="proxy-2"))

        chain: Chain = await nursery.start(serve_chain, build)
        config = EdgeConfig(proxies=[dead, (HOST, chain.proxy_server.port)], health=None)
        edge_server = await chain.start(functools.partial(serve_edge, config, host=HOST))
        edge = edge_of(edge_server)
        # Two WebSockets: whichever proxy the first went to, the second finds proxy-1 with fewer in
        # flight (or ejected, if the first was sent there): one of them was sent to it, and went on.
        async with connect_websocket(edge_server.port, "/ws") as first:
            await first.send_message("first")
            assert await first.get_message() == "first"
            async with connect_websocket(edge_server.port, "/ws") as second:
                await second.send_message("second")
                assert await second.get_message() == "second"
        assert edge.retried == 1


async def _hello(request: Request) -> Response:
    return text_response(200, "hello\n")


async def test_an_edge_whose_only_proxy_is_unreachable_answers_502_naming_it(nursery: trio.Nursery) -> None:
    port = closed_port()
    field = f"next_hop_unreachable; hop=edge; next=proxy-1 (127.0.0.1:{port})"
    with trio.fail_after(10):
        server = await nursery.start(serve_edge, EdgeConfig(proxy=(HOST, port)))
        url = f"http://{HOST}:{server.port}"
        async with h2_client() as h2c, httpx.AsyncClient(trust_env=False) as h1c:
            for client in (h2c, h1c, h2c):
                response = await client.get(url + "/")
                assert_error(response, 502, field)
                assert crossed(response) == ["edge", "total"]  # it reached no proxy
            assert_error(await h2c.post(url + "/echo", content=b"x" * 1000), 502, field)
    edge = edge_of(server)
    assert edge.retried == 0  # no other proxy to send it to
    assert edge.to_proxy.in_flight == {"proxy-1": 0}


# -- a 5xx a hop behind answered is passed on, not counted --------------------------------------------


async def test_a_proxys_own_503s_do_not_eject_it_at_the_edge(nursery: trio.Nursery) -> None:
    """Each proxy answers ``no_route`` for an unknown authority: the edge passes every 503 on
    as it came, and counts none of them against the proxy (five would eject it if it did)."""
    with trio.fail_after(20):

        async def build(chain: Chain) -> None:
            replica = await chain.start_replica("replica-0")
            await chain.start_worker({"replica-0": replica}, domains=("known.test",))
            await start_proxies(chain)
            await chain.start_edge()

        chain: Chain = await nursery.start(serve_chain, build)
        edge = edge_of(chain.edge)
        outliers = edge.to_proxy.outliers
        assert outliers is not None
        seen: collections.Counter[str] = collections.Counter()
        async with h2_client() as client:
            for _ in range(20):
                response = await client.get(chain.url + "/", headers={"host": "unknown.test"})
                proxy = proxy_of(response)
                assert_error(response, 503, f"no_route; hop={proxy}")
                seen[proxy] += 1
                assert outliers.statistics().failures == {}
            assert outliers.statistics().ejections == 0
            assert list(outliers.selectable(edge.to_proxy.next_hops(), trio.current_time())) == list(
                edge.to_proxy.next_hops()
            )
            response = await client.get(chain.url + "/", headers={"host": "known.test"})
            assert response.status_code == 200
            assert response.text == "hello from replica-0\n"
    assert edge.retried == 0
    assert {proxy.name: proxy.statistics().no_route for _, proxy in chain.proxies} == {
        name: seen[name] for name in PROXIES
    }


# -- errors name what failed -------------------------------------------------------------------------


async def test_a_proxy_that_cannot_reach_its_worker_names_it(nursery: trio.Nursery) -> None:
    dead = closed_port()
    field = f"next_hop_unreachable; hop=proxy; next=127.0.0.1:{dead}"
    with trio.fail_after(10):

        async def build(chain: Chain) -> None:
            replica = await chain.start_replica("replica-0")
            chain.route({"demo": App(("*",), {"replica-0": replica})}, worker=(HOST, dead))
            await chain.start_proxy()
            await chain.start_edge()

        chain: Chain = await nursery.start(serve_chain, build)
        async with h2_client() as client:
            for _ in range(2):
                assert_error(await client.get(chain.url + "/"), 502, field)
            assert_error(await client.post(chain.url + "/echo", content=b"x" * 1000), 502, field)
    edge = edge_of(chain.edge)
    assert edge.to_proxy.outliers is not None
    assert edge.to_proxy.outliers.statistics().failures == {}  # the proxy answered: no failure of the edge's
    assert edge.to_proxy.outliers.statistics().ejections == 0
    assert edge.retried == 0
    assert chain.proxy.statistics().retried == 0  # (no other replica to send it to)
    assert chain.proxy.statistics().in_flight == {"replica-0": 0}


@pytest.mark.parametrize("protocol", ["h2", "h1"])
async def test_a_worker_that_cannot_reach_its_replica_names_it(nursery: trio.Nursery, protocol: str) -> None:
    dead = closed_port()
    field = f"replica_unreachable; hop=worker; replica=dead-0 (127.0.0.1:{dead})"
    with trio.fail_after(10):

        async def build(chain: Chain) -> None:
            await chain.start_worker({"dead-0": LocalReplica((HOST, dead), protocol)})
            await chain.start_proxy()
            await chain.start_edge()

        chain: Chain = await nursery.start(serve_chain, build)
        async with h2_client() as client:
            for _ in range(2):
                assert_error(await client.get(chain.url + "/"), 502, field)
            assert_error(await client.post(chain.url + "/echo", content=b"x" * 1000), 502, field)
    edge = edge_of(chain.edge)
    assert edge.to_proxy.outliers is not None
    assert edge.to_proxy.outliers.statistics().failures == {}
    assert edge.retried == 0
    assert chain.worker.statistics().in_flight == {"dead-0": 0}


async def test_a_worker_whose_replica_times_out_names_it(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):

        async def build(chain: Chain) -> None:
            replica = await chain.start_replica("replica-0")
            await chain.start_worker({"replica-0": replica}, upstream=UpstreamConfig(response_timeout=0.3))
            await chain.start_proxy()
            await chain.start_edge()

        chain: Chain = await nursery.start(serve_chain, build)
        port = chain.replicas["replica-0"].port
        async with h2_client() as client:
            response = await client.get(chain.url + "/sleep?ms=5000")
            assert_error(response, 504, f"replica_timeout; hop=worker; replica=replica-0 (127.0.0.1:{port})")
    outliers = edge_of(chain.edge).to_proxy.outliers
    assert outliers is not None
    assert outliers.statistics().failures == {}


# -- a proxy over several workers --------------------------------------------------------------------


async def test_a_stopped_worker_costs_no_request(nursery: trio.Nursery) -> None:
    """Two workers each reach both replicas: four routes, ``replica-I@worker-J``. With
    worker-2 stopped, every request is answered: one the proxy sent behind worker-2 is sent
    once more, behind worker-1 (the same replica or the other)."""
    with trio.fail_after(30):
        a, _, a_local = await serve_tenant_replica(nursery)
        b, _, b_local = await serve_tenant_replica(nursery)
        local = {"replica-0": a_local, "replica-1": b_local}

        async def build(chain: Chain) -> None:
            workers = []
            for j in (1, 2):
                server, _ = await chain.start_worker(local, app=None, name=f"worker-{j}")
                workers.append((HOST, server.port))
            chain.route({"demo": App(("*",), local)}, workers=workers)
            await chain.start_proxy()
            await chain.start_edge()

        chain: Chain = await nursery.start(serve_chain, build)
        routes = {f"replica-{i}@worker-{j}" for i in (0, 1) for j in (1, 2)}
        assert {replica.name for replica in chain.cache.replicas("demo")} == routes
        proxy = chain.proxy
        async with h2_client(timeout=10) as client:
            for _ in range(8):
                assert (await client.get(chain.url + "/")).status_code == 200
            assert proxy.statistics().retried == 0

            worker_2, _ = chain.workers[1]
            gone = (HOST, worker_2.port)
            await worker_2.aclose(1.0)

            def disconnected() -> bool:
                upstreams = chain.proxy_server.upstreams
                assert upstreams is not None
                return all(pool.connections == 0 for pool in upstreams.statistics() if pool.address == gone)

            await wait_for(disconnected, "the proxy's connections to worker-2 closed")

            # Held at the replicas, four requests take four routes while none is ejected: by
            # the third, both routes behind worker-1 have one in flight, so worker-2 gets one.
            responses: list[httpx.Response] = []

            async def get() -> None:
                responses.append(await client.get(chain.url + "/hold"))

            async with trio.open_nursery() as requests:
                for _ in range(4):
                    requests.start_soon(get)
                await wait_for(lambda: a.total_in_flight + b.total_in_flight == 4, "4 requests held")
                in_flight = proxy.statistics().in_flight
                assert not any(n for name, n in in_flight.items() if name.endswith("@worker-2")), in_flight
                a.release()
                b.release()
            for _ in range(10):
                responses.append(await client.get(chain.url + "/"))
        assert [response.status_code for response in responses] == [200] * 14
        for response in responses:
            hops = crossed(response)
            assert "worker-1" in hops and "worker-2" not in hops, hops
    assert proxy.statistics().retried >= 1
    assert proxy.outliers is not None
    # The stopped worker is ejected, not the replicas behind it (they did nothing wrong).
    assert list(proxy.outliers.statistics().hops) == [gone]
    assert proxy.outliers.statistics().by_replica == {}
    assert set(proxy.statistics().in_flight.values()) == {0}
    assert edge_of(chain.edge).retried == 0


async def test_a_replica_a_worker_cannot_reach_is_not_tried_again_behind_another(nursery: trio.Nursery) -> None:
    """Two workers reach a live and a dead server (four routes): a request whose worker says
    the dead one is unreachable goes to the live one, never to the dead one behind the other
    worker. Ejection is off, so every request picks among all four."""
    dead = LocalReplica((HOST, closed_port()))
    with trio.fail_after(30):

        async def build(chain: Chain) -> None:
            local = {"live": await chain.start_replica("live"), "dead": dead}
            workers = []
            for j in (1, 2):
                server, _ = await chain.start_worker(local, app=None, name=f"worker-{j}")
                workers.append((HOST, server.port))
            chain.route({"demo": App(("*",), local)}, workers=workers)
            await chain.start_proxy(outliers=None)
            await chain.start_edge()

        chain: Chain = await nursery.start(serve_chain, build)
        async with h2_client() as client:
            for _ in range(30):
                response = await client.get(chain.url + "/")
                assert response.status_code == 200, response.headers.get("proxyblocks-error")
                assert response.text == "hello from live\n"
    served = collections.Counter[str]()
    for _, worker in chain.workers:
        served.update(worker.statistics().served)
    # Every request that went to a dead route was sent on once (retried), to a live one.
    assert chain.proxy.statistics().retried == served["dead@worker-1"] + served["dead@worker-2"]
    assert served["live@worker-1"] + served["live@worker-2"] == 30


# -- configuration -------------------------------------------------------------------------------------


async def test_edge_config_and_the_edge_want_exactly_one_way_to_their_proxies() -> None:
    a, b = (HOST, 9001), (HOST, 9002)
    with pytest.raises(ValueError, match="not both"):
        EdgeConfig(proxy=a, proxies=[b])
    assert EdgeConfig(proxy=a).proxies == (a,)
    assert EdgeConfig(proxies=[(HOST, "9001"), b]).proxies == (a, b)  # type: ignore[list-item]
    assert EdgeConfig(proxies=[a, b]).next_hops() == (next_hop("proxy-1", a), next_hop("proxy-2", b))
    with trio.fail_after(10):
        async with open_upstreams() as upstreams:
            with pytest.raises(ValueError, match="needs a proxy"):
                Edge(EdgeConfig(), upstreams)
            assert Edge(EdgeConfig(), upstreams, next_hops=list).config.proxies == ()
            assert [hop.name for hop in Edge(EdgeConfig(proxies=[a, b]), upstreams).to_proxy.next_hops()] == [
                "proxy-1",
                "proxy-2",
            ]


async def test_an_edge_reads_its_proxies_from_next_hops_on_every_request(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):

        async def build(chain: Chain) -> None:
            replica = await chain.start_replica("replica-0")
            await chain.start_worker({"replica-0": replica})
            await start_proxies(chain)

        chain: Chain = await nursery.start(serve_chain, build)
        hops: list[Replica] = []
        server = await nursery.start(functools.partial(serve_edge, EdgeConfig(), next_hops=lambda: hops))
        url = f"http://{HOST}:{server.port}/"
        async with h2_client() as client:
            assert_error(await client.get(url), 503, "no_next_hop; hop=edge")
            for k, (proxy_server, _) in enumerate(chain.proxies, 1):
                hops[:] = [next_hop(f"found-{k}", (HOST, proxy_server.port))]
                response = await client.get(url)
                assert response.status_code == 200
                assert proxy_of(response) == f"proxy-{k}"
            hops[:] = [next_hop("found-9", (HOST, port := closed_port()))]
            assert_error(await client.get(url), 502, f"next_hop_unreachable; hop=edge; next=found-9 (127.0.0.1:{port})")


# -- the edge's own errors, and only those, are its proxy's failures ---------------------------------

HOP_NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,14}", fullmatch=True)
UPSTREAM = st.one_of(
    st.just(""),
    st.builds(lambda n, p: f"; next=127.0.0.1:{p}", HOP_NAMES, st.integers(1, 65535)),
    st.builds(lambda n, p: f"; next={n} (127.0.0.1:{p})", HOP_NAMES, st.integers(1, 65535)),
    st.builds(lambda n, p: f"; replica={n} (127.0.0.1:{p})", HOP_NAMES, st.integers(1, 65535)),
)
OTHER_FIELDS = st.lists(
    st.tuples(st.sampled_from([b"content-type", b"server-timing", b"x-replica"]), st.binary(max_size=20)), max_size=3
)


@given(reason=st.sampled_from(sorted(REASONS)), hop=HOP_NAMES, upstream=UPSTREAM, before=OTHER_FIELDS)
def test_own_error_is_the_reason_only_when_the_field_names_this_hop_or_none(
    reason: str, hop: str, upstream: str, before: list[tuple[bytes, bytes]]
) -> None:
    field = f"{reason}; hop={hop}{upstream}".encode()
    headers = [*before, (ERROR_HEADER, field), (ERROR_HEADER, f"{reason}; hop=edge".encode())]
    assert own_error(headers, hop) == reason.encode()
    if hop != "edge":
        assert own_error(headers, "edge") is None  # a field naming another hop is never the edge's own
    assert own_error([*before, (ERROR_HEADER, reason.encode())], "edge") == reason.encode()  # (no hop named)
    assert own_error(before, hop) is None


@given(reason=st.sampled_from(sorted(REASONS)), hop=st.one_of(st.just("edge"), HOP_NAMES), upstream=UPSTREAM)
async def test_the_edge_retries_only_its_own_failure_to_reach_a_proxy(reason: str, hop: str, upstream: str) -> None:
    field = (ERROR_HEADER, f"{reason}; hop={hop}{upstream}".encode())
    with trio.fail_after(10):
        await retry_once(field, hop == "edge" and reason.encode() in RETRYABLE_REASONS)


async def retry_once(field: tuple[bytes, bytes], own: bool) -> None:
    """An edge over two proxies hears ``field`` from the one it picked: another, if ``own``."""
    a, b = (HOST, 9001), (HOST, 9002)
    async with open_upstreams() as upstreams:
        edge = Edge(EdgeConfig(proxies=[a, b]), upstreams)
        exchange = Exchange(edge, Request(b"POST", b"http", b"a.test", b"/", []))
        edge.decide(exchange)
        first = exchange.picked
        assert first is not None
        forward = edge.retry(exchange, 502, [field])
        if own:
            assert forward is not None
            assert exchange.picked is not None and exchange.picked != first
            assert forward.address == exchange.picked.address
            assert edge.to_proxy.in_flight == {first.name: 0, exchange.picked.name: 1}
            assert edge.retried == 1
            assert edge.retry(exchange, 502, [field]) is None  # once
        else:
            assert forward is None
            assert exchange.picked == first
            assert edge.retried == 0
        exchange.closed()
        assert set(edge.to_proxy.in_flight.values()) == {0}


@given(servers=st.integers(1, 3), workers=st.integers(1, 3), worker_failed=st.booleans(), data=st.data())
def test_the_proxys_retry_leaves_the_failed_worker_or_the_failed_server(
    servers: int, workers: int, worker_failed: bool, data: st.DataObject
) -> None:
    """Every server behind every worker (``sI@worker-J``): a request whose worker was unreachable
    goes behind another worker, one whose worker could not reach its server to another server,
    while one is left; to another route in any case, once."""
    routes = [
        Replica(name=f"s{i}@worker-{j}", worker=(HOST, 9000 + j), address=(HOST, 8000 + i))
        for i in range(servers)
        for j in range(1, workers + 1)
    ]
    table = RouteTable.build({"*": "demo"}, {"demo": routes})
    policy = LeastInFlight(random.Random(0))  # (ties broken the same way every run)
    proxy = Proxy(table, None, policy=policy, outliers=OutlierDetector(), clock=lambda: 0.0)  # type: ignore[arg-type]
    failed = data.draw(st.sampled_from(routes))
    exchange = Exchange(proxy, Request(b"GET", b"http", b"a.test", b"/", []))
    proxy.screen(exchange)
    exchange.dispatch(proxy.router.forward(exchange, failed))
    if worker_failed:  # the proxy's own failure with the worker: named, or as its pool reports it
        named = f"next_hop_unreachable; hop=proxy; next=127.0.0.1:{failed.worker[1]}"
        field = data.draw(st.sampled_from([named, "replica_unreachable", "replica_refused", "upstream_reset"]))
    else:  # the worker's answer
        field = f"replica_unreachable; hop=worker; replica={failed.name} (127.0.0.1:{failed.address[1]})"
    forward = proxy.retry(exchange, 502, [(ERROR_HEADER, field.encode())])
    others = [route for route in routes if route != failed]
    if not others:
        assert forward is None
        assert proxy.statistics().retried == 0
        return
    picked = exchange.picked
    assert forward is not None and picked is not None and picked in others
    assert forward.address == picked.worker
    if worker_failed and workers > 1:
        assert picked.worker != failed.worker
    if not worker_failed and servers > 1:
        assert picked.address != failed.address
    assert proxy.statistics().retried == 1
    assert proxy.statistics().in_flight == {failed.name: 0, picked.name: 1}
    assert proxy.retry(exchange, 502, [(ERROR_HEADER, field.encode())]) is None  # once


# -- the recipe ------------------------------------------------------------------------------------------


async def test_the_chain_recipe_with_two_proxies_and_two_workers() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--proxies", "2", "--workers", "2")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            for part in ("proxy-1", "proxy-2", "worker-1", "worker-2"):
                await lines.until(rf"^{part} listening on h2c://127\.0\.0\.1:\d+$")
            replicas: set[str] = set()
            proxies: set[str] = set()
            async with h2_client(timeout=10) as client:
                while {r.partition("@")[2] for r in replicas} != {"worker-1", "worker-2"} or len(proxies) < 2:
                    response = await client.get(url + "/")
                    assert response.status_code == 200
                    replica = response.headers["x-replica"]
                    assert re.fullmatch(r"replica-[01]@worker-[12]", replica), replica
                    assert response.text == f"hello from {replica}\n"
                    replicas.add(replica)
                    proxies.add(proxy_of(response))
            assert proxies == set(PROXIES)
            os.kill(process.pid, signal.SIGTERM)
            output = await lines.rest()
            assert output.endswith("stopped\n"), output
            assert await process.wait() == 0


async def test_the_edge_s_own_error_answer_carries_the_request_ids(nursery: trio.Nursery) -> None:
    # An operator matches a client's 502 to the access log by its x-request-id: the edge's own
    # answer (no proxy reachable) carries the ids its RequestIds feature kept or made.
    with trio.fail_after(10):
        edge = await nursery.start(
            functools.partial(
                serve_edge, EdgeConfig(proxies=[(HOST, closed_port())]), features=[RequestIds()], host=HOST
            )
        )
        async with h2_client() as client:
            response = await client.get(f"http://{HOST}:{edge.port}/", headers={"x-request-id": "abc-123"})
        assert response.status_code == 502
        assert response.headers["proxyblocks-error"].startswith("next_hop_unreachable; hop=edge; next=proxy-1 (")
        assert response.headers["x-request-id"] == "abc-123"
        assert response.headers["traceparent"].startswith("00-")


async def test_the_edge_checks_its_proxies_ejecting_a_dead_one_and_taking_it_back_when_it_answers(
    nursery: trio.Nursery,
) -> None:
    # With no request in between, the edge's health checks take a stopped proxy out, and put it
    # back (slow start) once a proxy listens on its address again.
    with trio.fail_after(30):
        chain: Chain = await nursery.start(serve_chain, ChainPlan(proxies=2, replicas=1, scheduler=None).build)
        edge = edge_of(chain.edge)
        outliers = edge.to_proxy.outliers
        assert outliers is not None
        server, _ = chain.proxies[1]
        address = (HOST, server.port)
        await server.aclose(1.0)
        await wait_for(lambda: outliers.out(address, trio.current_time()), "the stopped proxy-2 taken out")
        assert edge.retried == 0  # no request found it dead
        await chain.start_proxy(port=address[1], config=ProxyConfig(name="proxy-2"))
        await wait_for(lambda: not outliers.out(address, trio.current_time()), "proxy-2 back")
        assert address in outliers.statistics().ramping  # it comes back under slow start
        async with h2_client() as client:
            for _ in range(10):
                assert (await client.get(chain.url + "/")).status_code == 200


async def _dying_proxy(listeners: list[trio.SocketListener], seen: list[int]) -> None:
    """An h2 server that answers its connection's first request 200, then, on the second, closes the
    connection and its listener at once: a proxy killed as a request reached it (kill -9)."""
    import h2.config
    import h2.connection

    listener = listeners[0]
    stream = await listener.accept()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    await stream.send_all(conn.data_to_send())
    while True:
        data = await stream.receive_some()
        assert data, "the edge closed its connection first"
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                seen.append(event.stream_id)
                if len(seen) == 2:
                    await listener.aclose()  # no reconnect: the port is closed
                    await stream.aclose()
                    return
                conn.send_headers(event.stream_id, [(b":status", b"200"), (b"x-served-by", b"dying")], end_stream=True)
        await stream.send_all(conn.data_to_send())


async def test_a_request_cut_as_its_proxy_dies_goes_to_another_when_the_first_cannot_be_reached(
    nursery: trio.Nursery,
) -> None:
    # The edge's pool resends a safe request its proxy's connection cut before any answer; when that
    # proxy cannot be reached either (it died), the edge sends the request to another proxy.
    with trio.fail_after(20):
        listeners = await trio.open_tcp_listeners(0, host=HOST)
        dying = listeners[0].socket.getsockname()[:2]
        seen: list[int] = []
        nursery.start_soon(_dying_proxy, listeners, seen)

        async def build(chain: Chain) -> None:
            local = {"replica-0": await chain.start_replica("replica-0")}
            server, _ = await chain.start_worker(local, app=None)
            chain.route({"demo": App(("*",), local)}, worker=(HOST, server.port))
            await chain.start_proxy(config=ProxyConfig(name="proxy-2"))

        chain: Chain = await nursery.start(serve_chain, build)
        config = EdgeConfig(proxies=[dying, (HOST, chain.proxy_server.port)], health=None)
        edge_server = await chain.start(functools.partial(serve_edge, config, host=HOST))
        edge = edge_of(edge_server)
        async with RawH2Client.open(edge_server.port) as client:
            served = collections.Counter[bytes]()
            while len(seen) < 2:  # ties go either way: until the dying proxy got its second request
                result = await client.request(client.head(b"GET", b"/"))
                assert result.status == 200, result
                served[result.header(b"x-served-by") or b"proxy-2"] += 1
        assert served[b"dying"] == 1  # its first, answered; its second was cut and went to proxy-2
        assert edge.retried == 1


async def test_the_edge_s_retries_and_its_view_of_its_proxies_are_metrics(nursery: trio.Nursery) -> None:
    # An operator sees the edge's retries and the proxy it holds out on /metrics, labelled hop=edge.
    with trio.fail_after(20):
        dead = (HOST, closed_port())

        async def build(chain: Chain) -> None:
            local = {"replica-0": await chain.start_replica("replica-0")}
            server, _ = await chain.start_worker(local, app=None)
            chain.route({"demo": App(("*",), local)}, worker=(HOST, server.port))
            await chain.start_proxy()
            await chain.start_edge(proxies=[dead, (HOST, chain.proxy_server.port)], features=[Metrics()])

        chain: Chain = await nursery.start(serve_chain, build)
        admin = await chain.start_admin()
        edge = edge_of(chain.edge)
        async with h2_client() as client:
            while edge.retried == 0:  # ties go either way: until one request went to the dead proxy first
                assert (await client.get(chain.url + "/")).status_code == 200
            text = (await client.get(f"http://{HOST}:{admin.port}/metrics")).text
        assert 'proxyblocks_proxy_retried_total{hop="edge"} 1.0' in text
        assert f'proxyblocks_outlier_next_hop_ejected{{hop="edge",next_hop="127.0.0.1:{dead[1]}"}} 1.0' in text
