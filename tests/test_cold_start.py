"""A proxy holds a request for an app with no live replica until its routes offer one (``ProxyConfig.cold_start``).

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``;
real clients, a real worker and demo replica; the routes change by a write
to the chain's embedded store, which the proxy's cache follows. A test
waits for the state it asserts (requests waiting, a record published),
never for a duration. The same feature across processes, with etcd and an
autoscaler: tests/test_scale_from_zero.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import hyperframe.frame
import pytest
import trio

from blocks import Chain, ColdStartConfig, ProxyConfig, RouteTable, open_chain, serve_proxy
from blocks.fields import HEALTH_PATH, PROBE_HEADER
from blocks.hops import ReplicaWait
from blocks.routing import Demand
from blocks.sources.demand import read_demand
from blocks.store import DEMAND_PREFIX, encode_domain, encode_replica, route_key_for_domain, route_key_for_replica
from tests.support import RawFrames, h2_client, start_gets

APP = "demo"


async def until(predicate: Callable[[], object]) -> None:
    """Wait for a state (bounded by the test's ``fail_after``): checked every 10 ms."""
    while not predicate():
        await trio.sleep(0.01)


@asynccontextmanager
async def at_zero(cold_start: ColdStartConfig | None) -> AsyncIterator[tuple[Chain, Callable[[], None]]]:
    """A chain whose app has a domain and no replica; the callable routes its one replica (demo-0)."""
    async with open_chain() as chain:
        replica = await chain.start_replica("demo-0")
        worker_server, _ = await chain.start_worker({}, app=None)
        chain.store.transact({route_key_for_domain("*"): encode_domain(APP)})
        await chain.start_proxy(config=ProxyConfig(cold_start=cold_start))
        await chain.start_edge()

        def route() -> None:
            record = encode_replica(worker=(chain.host, worker_server.port), address=replica.address)
            chain.store.put(route_key_for_replica(APP, "demo-0"), record)

        yield chain, route
        chain.cancel()


@asynccontextmanager
async def held(chain: Chain, n: int) -> AsyncIterator[tuple[httpx.AsyncClient, list[httpx.Response], ReplicaWait]]:
    """``n`` requests through the chain, once all of them wait at the proxy; their answers once the block ends."""
    wait = chain.proxy.cold_start
    assert wait is not None
    answers: list[httpx.Response] = []
    async with (
        httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client,
        trio.open_nursery() as nursery,
    ):
        start_gets(nursery, client, n, answers)
        await until(lambda: wait.waiting(APP) == n)
        yield client, answers, wait


async def test_requests_at_zero_wait_and_are_all_served_by_the_first_replica_routed() -> None:
    with trio.fail_after(30):
        async with at_zero(ColdStartConfig()) as (chain, route):
            async with held(chain, 20) as (_, answers, wait):
                assert answers == []  # none refused, none answered: they wait
                # ... and the proxy publishes that, off the request path, for an autoscaler to read
                while await read_demand(chain.store) != {APP: Demand(requests=20)}:
                    await trio.sleep(0.01)
                assert DEMAND_PREFIX + f"{APP}/proxy" in chain.store.items()
                route()
            assert [(r.status_code, r.headers["x-replica"]) for r in answers] == [(200, "demo-0")] * 20
            assert wait.statistics().served == 20 and wait.counts() == {}
            await until(lambda: not [key for key in chain.store.items() if key.startswith(DEMAND_PREFIX)])
            assert chain.cache.statistics().bad_values == {}  # the demand records are no routes

            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                warm = await client.get("/")  # a replica: no wait at all
            assert (warm.status_code, wait.statistics().served) == (200, 20)


async def test_past_max_waiting_a_request_is_refused_at_once_with_retry_after() -> None:
    with trio.fail_after(30):
        async with at_zero(ColdStartConfig(max_waiting=2, retry_after=2.5)) as (chain, route):
            async with held(chain, 2) as (client, answers, wait):
                refused = await client.get("/")
                assert refused.status_code == 503
                assert refused.headers["proxyblocks-error"] == "cold_start_full; hop=proxy"
                assert refused.headers["retry-after"] == "3"
                route()
            assert [r.status_code for r in answers] == [200, 200]
            assert wait.statistics().full == 1


async def test_past_its_timeout_a_request_is_a_503_that_says_why() -> None:
    with trio.fail_after(30):
        async with at_zero(ColdStartConfig(timeout=0.2, retry_after=4)) as (chain, route):
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:
                refused = await client.get("/")
                assert refused.status_code == 503
                assert refused.headers["proxyblocks-error"] == "cold_start_timeout; hop=proxy"
                assert refused.headers["retry-after"] == "4"
                route()
                await until(lambda: chain.cache.replicas(APP))
                served = await client.get("/")
            assert (served.status_code, served.headers["x-replica"]) == (200, "demo-0")
            assert chain.proxy.cold_start is not None and chain.proxy.cold_start.statistics().timed_out == 1


async def test_a_client_that_gives_up_stops_waiting_and_counting() -> None:
    with trio.fail_after(30):
        async with at_zero(ColdStartConfig()) as (chain, _):
            wait = chain.proxy.cold_start
            assert wait is not None
            async with RawFrames.open(chain.edge.port) as raw:
                await raw.send(raw.request(1))
                await until(lambda: wait.waiting(APP) == 1)
                await raw.send(hyperframe.frame.RstStreamFrame(1, error_code=8))  # CANCEL
                await until(lambda: wait.waiting(APP) == 0)
            assert wait.statistics().served == 0


async def test_what_the_proxy_answers_itself_is_not_held() -> None:
    """A health check for an app at zero is answered at once (a session start waits in its session
    queue instead: tests/test_scale_from_zero.py)."""
    with trio.fail_after(30):
        async with at_zero(ColdStartConfig()) as (chain, _):
            async with h2_client() as client:
                url = f"http://{chain.host}:{chain.proxy_server.port}{HEALTH_PATH.decode()}"
                answer = await client.get(url, headers={PROBE_HEADER.decode(): "1"})
            assert (answer.status_code, answer.text) == (200, "ok\n")
            assert chain.proxy.cold_start is not None and chain.proxy.cold_start.statistics().served == 0


async def test_an_app_the_config_leaves_out_is_a_503_at_once_and_without_the_feature_too() -> None:
    with trio.fail_after(30):
        for config in (ColdStartConfig(apps=["other"]), None):
            async with at_zero(config) as (chain, _):
                async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                    refused = await client.get("/")
                assert (refused.status_code, refused.headers["proxyblocks-error"]) == (503, "no_replica; hop=proxy")


async def test_a_cold_start_needs_routes_that_change() -> None:
    with trio.fail_after(10), pytest.raises(ValueError, match="RouteCache"):
        await serve_proxy(RouteTable.build({}, {}), config=ProxyConfig(cold_start=ColdStartConfig()))


def test_the_config_says_what_is_wrong() -> None:
    for bad in ({"timeout": 0}, {"timeout": float("inf")}, {"max_waiting": 0}, {"retry_after": -1}):
        with pytest.raises(ValueError):
            ColdStartConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not the string"):
        ColdStartConfig(apps="chat")
    assert ColdStartConfig(apps=["chat", "chat"]).apps == frozenset({"chat"})
