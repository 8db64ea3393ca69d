"""The autoscaler's driver: real replica processes, in the routes only while healthy, drained and replaced.

Rules: loopback only, port 0 (the driver picks each replica's port free),
every test bounded by ``trio.fail_after``. Replicas are real processes
(``python -m blocks.testing.replica``); a test waits for the state it
asserts (a record in the store, a process gone), never for a duration. The
sans-IO policy is tested in tests/test_autoscaler_core.py.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from blocks import Chain, EmbeddedStore, open_chain
from blocks.autoscaler import (
    AutoscalePolicy,
    Autoscaler,
    ColdStartGate,
    DriverConfig,
    ReplicaTemplate,
    ScalingConfig,
    open_autoscaler,
)
from blocks.store import route_key_for_replica

APP = "demo"
DEMO = f"{sys.executable} -m blocks.testing.replica --port {{port}} --name {{name}}"
SLOW = (  # the demo replica, listening only after a second
    f'{sys.executable} -c "import sys, time, runpy; time.sleep(1.0); '
    f"sys.argv = ['replica', '--port', '{{port}}', '--name', '{{name}}']; "
    f"runpy.run_module('blocks.testing.replica', run_name='__main__')\""
)
FAST = DriverConfig(interval=0.1, health_interval=0.05, settle=0.2, drain_timeout=20, stop_timeout=5)


async def until(predicate: Callable[[], object]) -> None:
    """Wait for a state (bounded by the test's ``fail_after``): checked every 10 ms."""
    while not predicate():
        await trio.sleep(0.01)


def record(chain: Chain, name: str) -> dict[str, object] | None:
    value = chain.store.get(route_key_for_replica(APP, name))
    return None if value is None else dict(json.loads(value))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@asynccontextmanager
async def scaled(
    config: ScalingConfig, template: ReplicaTemplate | None = None, driver: DriverConfig = FAST
) -> AsyncIterator[tuple[Chain, Autoscaler]]:
    """A chain (bare worker, proxy, edge) with ``APP`` scaled by an autoscaler writing its store."""
    async with open_chain() as chain:
        worker_server, _ = await chain.start_worker({}, app=None)
        policy = AutoscalePolicy({APP: config})
        template = template or ReplicaTemplate(command=DEMO, protocol="h2", domains=("*",))
        async with open_autoscaler(
            policy, {APP: template}, chain.store, worker=(chain.host, worker_server.port), config=driver
        ) as scaler:
            await chain.start_proxy(features=[ColdStartGate(scaler, chain.cache)])
            await chain.start_edge()
            yield chain, scaler
        chain.cancel()


def test_a_template_says_what_is_wrong_with_its_command() -> None:
    with pytest.raises(ValueError, match=r"no \{port\}"):
        ReplicaTemplate(command="python -m http.server")
    with pytest.raises(ValueError, match=r"unknown field \{pot\}"):
        ReplicaTemplate(command="python -m http.server {pot}")
    with pytest.raises(ValueError, match="No closing quotation"):
        ReplicaTemplate(command="python -c 'x {port}")
    with pytest.raises(ValueError, match="health_path"):
        ReplicaTemplate(command="x {port}", health_path="healthz")
    argv = ReplicaTemplate(command="python -m http.server {port} --bind {host}").argv(app="a", name="a-0", port=81)
    assert argv == ["python", "-m", "http.server", "81", "--bind", "127.0.0.1"]


async def test_open_autoscaler_needs_a_template_per_app() -> None:
    policy = AutoscalePolicy({APP: ScalingConfig(target_concurrency=1)})
    with pytest.raises(ValueError, match="no replica template for app 'demo'"):
        async with open_autoscaler(policy, {}, EmbeddedStore(), worker=("127.0.0.1", 1)):
            pass


async def test_min_replicas_start_enter_the_routes_when_healthy_and_serve() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=2)) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].ready == 2)
            assert record(chain, "demo-0") is not None and record(chain, "demo-1") is not None
            assert record(chain, "demo-0")["state"] == "live"  # type: ignore[index]
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                seen = {(await client.get("/")).headers["x-replica"] for _ in range(20)}
            assert seen == {"demo-0", "demo-1"}  # real processes, named by the template
            pids = list(scaler.statistics().processes.values())
            assert len(pids) == 2 and all(alive(pid) for pid in pids)
        assert not any(alive(pid) for pid in pids)  # the block stops every process it started
        assert [key for key in chain.store.items() if key.startswith("apps/")] == []


async def test_a_replica_is_not_routed_before_it_answers_its_health_request() -> None:
    """A command that listens only after a while: its record appears only once it answers."""
    template = ReplicaTemplate(command=SLOW, protocol="h2", domains=("*",))
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1), template) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].starting == 1)
            assert record(chain, "demo-0") is None
            await until(lambda: record(chain, "demo-0") is not None)
            assert scaler.statistics().apps[APP].ready == 1


async def test_a_replica_that_dies_leaves_the_routes_and_is_replaced() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1)) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            pid = scaler.statistics().processes["demo-0"]
            os.kill(pid, 9)
            await until(lambda: record(chain, "demo-0") is None)
            await until(lambda: record(chain, "demo-1") is not None)
            stats = scaler.statistics().apps[APP]
            assert (stats.ready, stats.restarts, stats.starts) == (1, 1, 2)
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                response = await client.get("/")
            assert (response.status_code, response.headers["x-replica"]) == (200, "demo-1")


async def test_a_drained_replica_finishes_its_stream_while_new_requests_go_elsewhere() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1)) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            pid = scaler.statistics().processes["demo-0"]
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:
                async with client.stream("GET", "/stream?n=30&ms=100") as stream:  # 3 s of chunks
                    assert stream.headers["x-replica"] == "demo-0"
                    await until(lambda: scaler.estimator.estimate("demo-0") == 1)  # the prober sees it
                    scaler.drain("demo-0")
                    await until(lambda: (record(chain, "demo-0") or {}).get("state") == "draining")
                    await until(lambda: record(chain, "demo-1") is not None)  # the replacement
                    other = await client.get("/")
                    assert (other.status_code, other.headers["x-replica"]) == (200, "demo-1")
                    assert alive(pid)  # still finishing the stream
                    body = b"".join([chunk async for chunk in stream.aiter_bytes()])
                assert body.count(b"\n") == 30  # every chunk, though its replica was draining
                await until(lambda: not alive(pid))
                await until(lambda: record(chain, "demo-0") is None)
            assert scaler.statistics().apps[APP].restarts == 0


async def test_a_command_that_never_becomes_healthy_is_backed_off_never_routed() -> None:
    broken = ReplicaTemplate(command=f"{sys.executable} -c 'import sys; sys.exit(3)' {{port}}", domains=("*",))
    driver = DriverConfig(interval=0.1, cold_start_timeout=0.5)
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1), broken, driver) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].failed_starts >= 3)
            assert [key for key in chain.store.items() if key.startswith("apps/")] == []
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                response = await client.get("/")
            assert (response.status_code, response.headers["proxyblocks-error"]) == (
                503,
                "cold_start_timeout; hop=proxy",
            )
    missing = ReplicaTemplate(command="/nonexistent/replica --port {port}", domains=("*",))
    with trio.fail_after(30):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1), missing) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].failed_starts >= 2)
            assert scaler.statistics().processes == {}


# -- scale from zero --------------------------------------------------------------------------


async def test_concurrent_requests_for_an_app_at_zero_share_one_cold_start() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=100)) as (chain, scaler):
            assert scaler.statistics().apps[APP].starting == 0  # at zero, nothing runs
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:
                answers: list[httpx.Response] = []

                async def get() -> None:
                    answers.append(await client.get("/"))

                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(get)
                    await until(lambda: scaler.statistics().apps[APP].waiting == 8)  # all held, none refused
            assert [(r.status_code, r.headers["x-replica"]) for r in answers] == [(200, "demo-0")] * 8
            stats = scaler.statistics().apps[APP]
            assert (stats.starts, stats.ready, stats.waiting) == (1, 1, 0)


async def test_a_cold_start_past_its_timeout_is_a_503_that_says_why_and_the_start_goes_on() -> None:
    template = ReplicaTemplate(command=SLOW, protocol="h2", domains=("*",))
    driver = DriverConfig(interval=0.1, cold_start_timeout=0.3)
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4), template, driver) as (chain, scaler):
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:
                refused = await client.get("/")
                assert refused.status_code == 503
                assert refused.headers["proxyblocks-error"] == "cold_start_timeout; hop=proxy"
                assert refused.headers["retry-after"] == "1"
                await until(lambda: scaler.statistics().apps[APP].ready == 1)  # the start went on
                again = await client.get("/")
                assert (again.status_code, again.headers["x-replica"]) == (200, "demo-0")
            assert scaler.statistics().apps[APP].starts == 1


async def test_an_app_the_autoscaler_does_not_scale_is_refused_at_once() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4)) as (chain, scaler):
            chain.store.put("domains/other.test", b'{"app":"other"}')
            await until(lambda: chain.cache.app_for(b"other.test") == "other")
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                response = await client.get("/", headers={"host": "other.test"})
            assert (response.status_code, response.headers["proxyblocks-error"]) == (503, "no_replica; hop=proxy")
            assert scaler.statistics().apps[APP].starts == 0
