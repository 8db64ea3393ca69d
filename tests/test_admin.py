"""The admin listener (blocks.observe): /healthz, /readyz through a drain, /status.json after real traffic, the page.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``;
each waits for the state it asserts.
"""

from __future__ import annotations

import functools

import httpx
import trio
from support import HOST, closed_port, h2_client, held_chain, wait_for

from blocks import Chain, HTTPServer, LocalReplica, serve_chain
from blocks.observe import Metrics, Observed, serve_admin


def admin_client(admin: HTTPServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://{HOST}:{admin.port}", trust_env=False)


async def test_healthz_and_readyz_while_the_chain_runs_then_503_from_the_moment_it_drains(
    nursery: trio.Nursery,
) -> None:
    release = trio.Event()
    with trio.fail_after(20):
        chain = await held_chain(nursery, release)
        admin = await chain.start_admin()
        # (over h1: h2 clients fail a stream in flight when a graceful GOAWAY comes)
        traffic = httpx.AsyncClient(trust_env=False)
        async with admin_client(admin) as client, traffic, trio.open_nursery() as inner:
            health = await client.get("/healthz")
            assert (health.status_code, health.text) == (200, "ok\n")
            ready = await client.get("/readyz")
            assert (ready.status_code, ready.text) == (200, "ready\n")
            held: list[httpx.Response] = []

            async def in_flight() -> None:
                held.append(await traffic.get(chain.url + "/hold"))

            inner.start_soon(in_flight)
            await wait_for(lambda: chain.worker.statistics().in_flight["slow"] == 1, "the request in flight")
            inner.start_soon(chain.shutdown)
            # The drain waits for the request in flight; the admin listener already says not ready.
            await wait_for(lambda: chain.edge.draining, "the drain started")
            ready = await client.get("/readyz")
            assert (ready.status_code, ready.text) == (503, "edge is draining\n")
            assert (await client.get("/healthz")).status_code == 200
            status = (await client.get("/status.json")).json()
            assert status["draining"] is True
            release.set()
        assert (held[0].status_code, held[0].text) == (200, "held\n")


async def test_readyz_waits_for_a_listener_and_for_routes() -> None:
    with trio.fail_after(10):
        observed = Observed()
        async with trio.open_nursery() as nursery:
            admin = await nursery.start(functools.partial(serve_admin, lambda: observed))
            async with admin_client(admin) as client:
                ready = await client.get("/readyz")
                assert (ready.status_code, ready.text) == (503, "no listener open yet\n")
                assert (await client.get("/healthz")).status_code == 200
            nursery.cancel_scope.cancel()


async def test_status_json_after_real_traffic(nursery: trio.Nursery) -> None:
    async def build(chain: Chain) -> None:
        local = {"replica-0": await chain.start_replica("replica-0")}
        local |= {"dead-0": LocalReplica((HOST, closed_port()))}
        await chain.start_worker(local, features=[Metrics()])
        await chain.start_proxy(features=[Metrics()])
        await chain.start_edge(features=[Metrics()])

    with trio.fail_after(15):
        chain: Chain = await nursery.start(serve_chain, build)
        admin = await chain.start_admin()
        sent = 0
        async with h2_client() as traffic:
            # Until the dead replica was tried (and the request retried on replica-0): it is ejected.
            while sent < 2 or not (chain.proxy.outliers and chain.proxy.outliers.statistics().ejections):
                assert (await traffic.get(chain.url + "/")).status_code == 200
                sent += 1
            response = await traffic.get(chain.url + "/status/500")
            assert response.status_code == 500
            async with admin_client(admin) as client:
                response = await client.get("/status.json")
        assert response.status_code == 200
        assert response.headers["content-type"] == "application/json"
        status = response.json()
    assert set(status) == {
        "time", "draining", "listeners", "hops", "apps", "tenants", "mirror", "routes", "last_errors",
    }  # fmt: skip
    assert status["draining"] is False
    assert [listener["part"] for listener in status["listeners"]] == ["edge", "proxy", "worker"]
    assert status["listeners"][0]["url"] == chain.edge.url
    assert status["listeners"][0]["connections"] == 1
    hops = {hop["name"]: hop for hop in status["hops"]}
    assert hops["edge"]["requests"] == {"2xx": sent, "3xx": 0, "4xx": 0, "5xx": 1}
    assert hops["edge"]["phases"]["total"]["count"] == sent + 1
    assert 0 < hops["edge"]["phases"]["total"]["p50_ms"] <= hops["edge"]["phases"]["total"]["p99_ms"]
    # The worker's 502 from the dead replica was retried on replica-0: the proxy and the edge never saw it.
    assert hops["worker"]["errors"] == {"replica_unreachable": 1}
    assert hops["proxy"]["errors"] == {}
    [demo] = status["apps"]
    assert demo["name"] == "demo"
    replicas = {replica["name"]: replica for replica in demo["replicas"]}
    assert replicas["dead-0"]["ejected"] is True
    assert replicas["dead-0"]["ejections"] == 1
    assert replicas["replica-0"] == {"name": "replica-0", "in_flight": 0, "ejected": False, "ejections": 0,
                                     "sessions": 0}  # fmt: skip
    assert status["tenants"] == [] and status["mirror"] == []
    assert status["routes"] == {"revision": chain.cache.revision, "staleness_s": 0.0, "connected": True}
    # Newest first, each once, as the hop nearest its cause saw it: the replica's own 500 (the worker
    # relayed it first), then the worker's 502s (the proxy retried one on the live replica).
    errors = [(e["hop"], e["status"], e["reason"]) for e in status["last_errors"]]
    assert errors[0] == ("worker", 500, "")
    assert set(errors[1:]) == {("worker", 502, "replica_unreachable")}
    assert status["last_errors"][0]["path"] == "/status/500" and status["last_errors"][0]["method"] == "GET"


async def test_the_page_and_what_the_admin_listener_does_not_serve(nursery: trio.Nursery) -> None:
    async def build(chain: Chain) -> None:
        local = {"replica-0": await chain.start_replica("replica-0")}
        await chain.start_worker(local)

    with trio.fail_after(10):
        chain: Chain = await nursery.start(serve_chain, build)
        admin = await chain.start_admin()
        async with admin_client(admin) as client:
            page = await client.get("/")
            assert page.status_code == 200
            assert page.headers["content-type"] == "text/html; charset=utf-8"
            assert "<" in page.text
            assert (await client.get("/nope")).status_code == 404
            assert (await client.post("/metrics")).status_code == 405
            # A worker-only chain needs no routes to be ready.
            assert (await client.get("/readyz")).status_code == 200
            status = (await client.get("/status.json")).json()
    assert status["routes"] == {}
    assert [listener["part"] for listener in status["listeners"]] == ["worker"]
    assert status["apps"] == [
        {
            "name": "worker",
            "replicas": [{"name": "replica-0", "in_flight": 0, "ejected": False, "ejections": 0, "sessions": 0}],
        }
    ]
