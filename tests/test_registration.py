"""A fleet on etcd learns its workers and proxies without restarts: each hop registers itself.

Real processes (``recipes.chain --role ... --route-source ETCD``) and a real
etcd: two workers register the replica beside each (a demo replica
process) with their own address, two proxies register themselves, and the
edge follows the proxies. Under a steady load: requests reach both replicas
through both proxies; a worker killed (``kill -9``) costs no request that
started after the kill, and its records leave etcd when its lease ends; a
third worker, started later, gets traffic with nothing restarted; a proxy
stopped with SIGTERM leaves etcd at once and costs no request. Loopback
only, every process ended by its PID.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from pathlib import Path

import trio
from etcd_server import open_etcd
from support import REPO

from blocks.sources import EtcdSource
from blocks.sources.register import PROXIES_PREFIX
from blocks.testing import PacedLoad, free_ports, start_process

PY = sys.executable


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await trio.sleep(0.01)


async def test_workers_and_proxies_register_and_leave(nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.fail_after(120):
        async with open_etcd(tmp_path) as etcd:
            ports = free_ports(4)
            for i in range(3):
                replica = ["-m", "blocks.testing.replica", "--port", str(ports[i]), "--name", f"r{i}"]
                await start_process(nursery, [PY, *replica], "listening on", cwd=REPO)
            chain = [PY, "-m", "recipes.chain", "--route-source", etcd.url]

            async def worker(i: int) -> trio.Process:
                command = [
                    *chain,
                    "--role",
                    "worker",
                    "--name",
                    f"worker-{i}",
                    "--replica",
                    f"h2c://127.0.0.1:{ports[i]}",
                ]
                return await start_process(nursery, command, "listening on h2c", cwd=REPO)

            workers = [await worker(0), await worker(1)]
            proxies = [
                await start_process(nursery, [*chain, "--role", "proxy", "--name", f"proxy-{k}"], "listening", cwd=REPO)
                for k in (1, 2)
            ]
            await start_process(
                nursery, [*chain, "--role", "edge", "--port", str(ports[3])], "edge listening", cwd=REPO
            )
            load = PacedLoad(("127.0.0.1", ports[3]), 80)
            await nursery.start(load.run)

            def seen(since: float) -> collections.Counter[str]:
                names = collections.Counter[str]()
                for o in load.outcomes:
                    if o.start >= since:
                        names.update([o.replica, *(hop for hop in o.hops if hop in ("proxy-1", "proxy-2"))])
                return names

            await until(lambda: {"r0", "r1", "proxy-1", "proxy-2"} <= seen(0.0).keys())

            fault = trio.current_time()
            workers[0].kill()
            await workers[0].wait()
            n = len(load.outcomes)
            await until(lambda: len(load.outcomes) >= n + 80)
            late = [o for o in load.failed_between(fault) if o.start > fault]
            assert not late, collections.Counter(o.error for o in late)
            routes = EtcdSource(etcd.url)
            while any("@worker-0" in key for key in (await routes.snapshot())[1]):
                await trio.sleep(0.2)  # its lease ends: its replica's record leaves the store

            added = trio.current_time()
            await worker(2)
            await until(lambda: seen(added)["r2"] > 0)  # no proxy restarted

            stopped = trio.current_time()
            proxies[1].terminate()
            await proxies[1].wait()
            registered = (await EtcdSource(etcd.url, PROXIES_PREFIX).snapshot())[1]
            assert list(registered) == ["apps/proxies/replicas/proxy-1"]
            n = len(load.outcomes)
            await until(lambda: len(load.outcomes) >= n + 80)
            assert not load.failed_between(stopped - 0.5), collections.Counter(
                o.error for o in load.failed_between(stopped - 0.5)
            )
            assert seen(trio.current_time() - 0.5)["proxy-2"] == 0
            nursery.cancel_scope.cancel()
