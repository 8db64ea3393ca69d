"""Scale from zero in the topology users deploy: a proxy process of its own, etcd, and the autoscaler elsewhere.

Real processes: etcd, a proxy (``python -m recipes.chain --role proxy
--route-source ETCD``, the cold-start wait on by default there, tuned by
its config file's ``[cold_start]``), and the autoscaler's replicas (``python
-m blocks.testing.replica``); the autoscaler itself runs in the test's
process beside a worker, writing etcd, as it runs beside a worker on its
machine. Nothing but etcd carries a cold start from the proxy to it: the
proxy publishes what waits there, the driver reads it each round. Loopback
only, every process ended by its PID; each test bounded by
``trio.fail_after`` and waiting for the state it asserts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import trio
from etcd_server import open_etcd
from support import REPO, gated, h2_client, start_gets

from blocks import EtcdSource, WorkerSessionConfig, open_chain
from blocks.autoscaler import AutoscalePolicy, DriverConfig, ReplicaTemplate, ScalingConfig, open_autoscaler
from blocks.routing import Demand
from blocks.sources.demand import read_demand
from blocks.testing import free_ports, start_process

APP = "demo"
PY = sys.executable
FAST = DriverConfig(interval=0.1, health_interval=0.05, settle=0.2, drain_timeout=10, stop_timeout=5)
SECRET = bytes(range(32)).hex()
CONNECTIONS = 4
DEMO = f"{PY} -m blocks.testing.replica --port {{port}} --name {{name}}"


async def until(predicate: Callable[[], object]) -> None:
    while not predicate():
        await trio.sleep(0.01)


async def start_proxy(nursery: trio.Nursery, etcd: str, config: Path) -> str:
    """``recipes.chain --role proxy`` following ``etcd``, with ``config``; its URL once it listens."""
    port = free_ports(1)[0]
    command = [PY, "-m", "recipes.chain", "--role", "proxy", "--route-source", etcd, "--name", "proxy-1"]
    command += ["--port", str(port), "--config", str(config)]
    await start_process(nursery, command, "proxy-1 listening on", cwd=REPO)
    return f"http://127.0.0.1:{port}"


async def test_requests_at_zero_at_a_proxy_process_are_all_served_and_past_the_bound_refused(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """200 requests at once, on 4 connections, for an app at zero: all wait (the bound), the proxy
    publishes them, the driver starts one replica, and every one is served by it; one more is refused."""
    n = CONNECTIONS * 50
    config = tmp_path / "proxy.toml"
    config.write_text(f"[cold_start]\nmax_waiting = {n}\ntimeout = 60\nretry_after = 2\n")
    policy = AutoscalePolicy({APP: ScalingConfig(target_concurrency=1000, up_window=1, down_window=600)})
    template = ReplicaTemplate(command=gated(tmp_path / "go"), protocol="h2", domains=("*",))
    with trio.fail_after(120):
        async with open_etcd(tmp_path) as etcd, open_chain() as chain:
            store = EtcdSource(etcd.url)
            worker_server, _ = await chain.start_worker({}, app=None)
            worker = (chain.host, worker_server.port)
            async with open_autoscaler(policy, {APP: template}, store, worker=worker, config=FAST) as scaler:
                url = await start_proxy(nursery, etcd.url, config)
                answers: list[httpx.Response] = []
                async with contextlib.AsyncExitStack() as clients, trio.open_nursery() as requests:
                    for _ in range(CONNECTIONS):  # (httpx queues past 50 streams on one connection)
                        client = await clients.enter_async_context(h2_client(base_url=url, timeout=60))
                        start_gets(requests, client, n // CONNECTIONS, answers)
                    # the proxy process holds them, and says so through etcd: the driver starts one replica
                    await until(lambda: scaler.statistics().apps[APP].waiting == n)
                    assert scaler.statistics().apps[APP].starting == 1
                    assert await read_demand(store) == {APP: Demand(requests=n)}
                    with trio.fail_after(5):  # one more than the bound: at once
                        async with h2_client(base_url=url) as other:
                            refused = await other.get("/")
                    assert refused.status_code == 503
                    assert refused.headers["proxyblocks-error"] == "cold_start_full; hop=proxy-1"
                    assert refused.headers["retry-after"] == "2"
                    assert answers == []
                    (tmp_path / "go").touch()  # the replica comes up; its record reaches the proxy
                assert [(r.status_code, r.headers["x-replica"]) for r in answers] == [(200, "demo-0")] * n
                stats = scaler.statistics().apps[APP]
                assert (stats.starts, stats.ready, stats.failed_starts) == (1, 1, 0)
                while await read_demand(store):  # nothing waits: the proxy's record is gone
                    await trio.sleep(0.05)
                await until(lambda: scaler.statistics().apps[APP].waiting == 0)
            chain.cancel()
        nursery.cancel_scope.cancel()


async def test_session_starts_queued_at_a_proxy_process_scale_a_sessioned_app_up(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """Two sessions per replica (the target and the proxy's cap): the third start waits in the proxy's
    session queue, which only etcd tells the driver of; a replica starts for it and the start lands there."""
    config = tmp_path / "proxy.toml"
    config.write_text(
        "[sessions]\n"
        f'apps = ["{APP}"]\nmax_per_replica = 2\nqueue_timeout = 60\nrequire_auth = false\nset_cookie = false\n'
        f'[[sessions.keys]]\nkid = "k1"\nsecret = "{SECRET}"\n'
    )
    scaling = ScalingConfig(target_concurrency=2, up_window=0.3, down_window=600, idle_timeout=600, unit="sessions")
    policy = AutoscalePolicy({APP: scaling})
    template = ReplicaTemplate(command=DEMO, protocol="h2", domains=("*",))
    with trio.fail_after(120):
        async with open_etcd(tmp_path) as etcd, open_chain() as chain:
            store = EtcdSource(etcd.url)
            worker_server, _ = await chain.start_worker({}, app=None, sessions=WorkerSessionConfig())
            worker = (chain.host, worker_server.port)
            async with open_autoscaler(policy, {APP: template}, store, worker=worker, config=FAST) as scaler:
                url = await start_proxy(nursery, etcd.url, config)
                async with h2_client(base_url=url, timeout=60) as client:

                    async def start() -> str:
                        response = await client.post("/.proxyblocks/sessions")
                        assert response.status_code == 201, response.text
                        return str(response.json()["replica"])

                    assert [await start(), await start()] == ["demo-0", "demo-0"]  # the first at zero
                    await until(lambda: scaler.statistics().apps[APP].sessions == 2)
                    assert scaler.statistics().apps[APP].wanted == 1
                    placed: list[str] = []

                    async def third() -> None:
                        placed.append(await start())

                    async with trio.open_nursery() as starting:
                        starting.start_soon(third)
                        await until(lambda: scaler.statistics().apps[APP].queued == 1)  # as etcd says
                    assert placed == ["demo-1"]
                stats = scaler.statistics().apps[APP]
                assert (stats.starts, stats.failed_starts) == (2, 0)
            chain.cancel()
        nursery.cancel_scope.cancel()
