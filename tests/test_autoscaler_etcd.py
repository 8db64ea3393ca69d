"""The autoscaler's driver writing a real etcd that two proxies follow, as a fleet's proxies do.

Rules: loopback only, port 0 (etcd on free ports, killed by PID at the end:
tests/etcd_server.py; the driver picks each replica's port free); every test
bounded by ``trio.fail_after``. Replicas are real processes
(``python -m blocks.testing.replica``); a test waits for the state it
asserts (a record in a proxy's cache, a process gone), never for a
duration. A missing etcd binary fails, never skips. The same driver over
the embedded store: tests/test_autoscaler.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import trio

from blocks import EtcdSource, open_chain
from blocks.autoscaler import (
    AutoscalePolicy,
    ColdStartGate,
    DriverConfig,
    ReplicaTemplate,
    ScalingConfig,
    open_autoscaler,
)
from blocks.routing import RouteCache, encode_replica
from tests.etcd_server import PROGRESS_INTERVAL, EtcdServer, open_etcd

APP = "demo"
DEMO = f"{sys.executable} -m blocks.testing.replica --port {{port}} --name {{name}}"
FAST = DriverConfig(interval=0.1, health_interval=0.05, settle=0.2, drain_timeout=30, stop_timeout=5)
LEFT = encode_replica(worker=("127.0.0.1", 1), address=("127.0.0.1", 9))  # a dead replica's live record
STALE = encode_replica(worker=("127.0.0.1", 1), address=("127.0.0.1", 9), state="draining")
# Never idle, never down within the test: every start and drain is the test's (or a cold start's).
NEVER_IDLE = ScalingConfig(target_concurrency=100, up_window=1, down_window=600, idle_timeout=600)


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    # (open_etcd bounds its own start; the test's fail_after bounds the rest, and is the one that fires)
    async with open_etcd(tmp_path) as server:
        yield server


def follower(etcd: EtcdServer) -> EtcdSource:
    """A proxy's own source, told the test etcd's progress interval: silent for 4 of them is dead."""
    return EtcdSource(etcd.url, progress_interval=PROGRESS_INTERVAL, missed_progress=4)


async def until(predicate: Callable[[], object]) -> None:
    """Wait for a state (bounded by the test's ``fail_after``): checked every 10 ms."""
    while not predicate():
        await trio.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def live(cache: RouteCache) -> list[str]:
    return [replica.name for replica in cache.replicas(APP)]


def state(cache: RouteCache, name: str) -> str | None:
    replica = cache.replica(APP, name)
    return None if replica is None else replica.state


async def held_echo(client: httpx.AsyncClient, release: trio.Event, answers: list[httpx.Response]) -> None:
    """``POST /echo`` whose body ends only once ``release`` is set: a request in flight for as long as a test needs."""

    async def body() -> AsyncIterator[bytes]:
        yield b"before the drain\n"
        await release.wait()
        yield b"after it\n"

    answers.append(await client.post("/echo", content=body()))


async def test_two_proxies_following_etcd_see_every_replica_change_the_driver_writes(etcd: EtcdServer) -> None:
    policy = AutoscalePolicy({APP: NEVER_IDLE})
    template = ReplicaTemplate(command=DEMO, protocol="h2", domains=("*",))
    store = EtcdSource(etcd.url)
    pids: dict[str, int] = {}

    def note_pids() -> None:
        pids.update(scaler.statistics().processes)  # (a pid is still checked once its replica is gone)

    with trio.fail_after(60):
        # What a SIGKILLed driver left: one of its records (a replica long gone), and an operator's.
        await store.put(f"apps/{APP}/replicas/demo-7", LEFT)
        await store.put(f"apps/{APP}/replicas/static-1", STALE)
        async with open_chain() as a, open_chain() as b:  # two proxies, each its own cache following etcd
            worker_server, _ = await a.start_worker({}, app=None)  # it reaches each replica where its record says
            worker = (a.host, worker_server.port)
            async with open_autoscaler(policy, {APP: template}, store, worker=worker, config=FAST) as scaler:
                for chain in (a, b):
                    await chain.start_proxy(source=follower(etcd), features=[ColdStartGate(scaler, chain.cache)])
                    await chain.start_edge()
                    assert chain.cache.app_for(b"any.example") == APP  # the driver's domain record, through etcd
                    # Its own names are deleted on entry; not the operator's (draining: no proxy routes to it).
                    assert chain.cache.replica(APP, "demo-7") is None and live(chain.cache) == []
                    assert state(chain.cache, "static-1") == "draining"
                assert scaler.statistics().processes == {}

                # Once demo-0 runs: what each proxy's cache holds of it when it is out of the live replicas
                # there, and whether its process runs then.
                seen: dict[str, list[tuple[str | None, bool]]] = {"a": [], "b": []}

                def watcher(label: str, cache: RouteCache) -> Callable[[frozenset[str]], None]:
                    def changed(apps: frozenset[str]) -> None:
                        if APP in apps and "demo-0" in pids and "demo-0" not in live(cache):
                            seen[label].append((state(cache, "demo-0"), alive(pids["demo-0"])))

                    return changed

                a.cache.add_listener(watcher("a", a.cache))
                b.cache.add_listener(watcher("b", b.cache))

                async with (
                    httpx.AsyncClient(base_url=a.url, trust_env=False, timeout=60) as via_a,
                    httpx.AsyncClient(base_url=b.url, trust_env=False, timeout=60) as via_b,
                ):
                    # A cold request through proxy A starts one replica, and is served by it.
                    cold = await via_a.get("/")
                    assert (cold.status_code, cold.headers["x-replica"]) == (200, "demo-0")
                    note_pids()
                    # Proxy B routes to it too, from its own cache, without starting another.
                    warm = await via_b.get("/")
                    assert (warm.status_code, warm.headers["x-replica"]) == (200, "demo-0")
                    assert live(a.cache) == live(b.cache) == ["demo-0"]
                    stats = scaler.statistics().apps[APP]
                    assert (stats.starts, stats.ready, stats.starting) == (1, 1, 0)

                    # A request in flight on demo-0 (the prober sees it), then a drain.
                    release, held = trio.Event(), list[httpx.Response]()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(held_echo, via_a, release, held)
                        await until(lambda: scaler.estimator.estimate("demo-0") == 1)
                        scaler.drain("demo-0")
                        # Both proxies see `draining` (out of their live replicas) while its process runs.
                        await until(lambda: state(a.cache, "demo-0") == state(b.cache, "demo-0") == "draining")
                        assert alive(pids["demo-0"])
                        # New requests, through either proxy, go to the replacement, never to demo-0.
                        for client in (via_a, via_b, via_a, via_b):
                            response = await client.get("/")
                            assert (response.status_code, response.headers["x-replica"]) == (200, "demo-1")
                        note_pids()
                        assert alive(pids["demo-0"])  # still finishing the request it has
                        release.set()
                    assert (held[0].status_code, held[0].headers["x-replica"]) == (200, "demo-0")
                    assert held[0].content == b"before the drain\nafter it\n"  # finished, though draining

                # Then its process stops, and its record leaves etcd and both caches.
                await until(lambda: not alive(pids["demo-0"]))
                await until(lambda: state(a.cache, "demo-0") is None and state(b.cache, "demo-0") is None)
                assert await store.get(f"apps/{APP}/replicas/demo-0") is None
                # Each proxy's first sight of the drain was `draining`, its process alive: never a delete first.
                assert seen["a"][0] == seen["b"][0] == ("draining", True)
                stats = scaler.statistics().apps[APP]
                assert (stats.starts, stats.ready, stats.draining, stats.restarts) == (2, 1, 0, 0)
                assert list(scaler.statistics().processes) == ["demo-1"]

            # Leaving the driver: every replica process gone, every record it wrote deleted from etcd.
            assert set(pids) == {"demo-0", "demo-1"}
            assert not any(alive(pid) for pid in pids.values())
            _, records = await store.snapshot()
            assert records == {f"apps/{APP}/replicas/static-1": STALE}  # none of its own, no domain record either
            for chain in (a, b):
                await until(lambda c=chain: c.cache.replica(APP, "demo-1") is None)  # type: ignore[misc]
            a.cancel()
            b.cancel()
