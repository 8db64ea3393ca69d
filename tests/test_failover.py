"""No single point of failure, as deployed: a process per hop, several of each, faults in the middle of load.

The fleet (:class:`~blocks.testing.ProcessFleet`): an edge in front of
2 proxies, each routing every replica behind each of 2 workers; the
replicas are 2 Hypercorn h2c servers (not this project's code) and 2 demo
replicas, each a process. A pooled HTTP/2 client sends a steady load through
the edge and keeps every request's start, end and status. Faults: ``kill -9``
of a proxy, a worker, a Hypercorn replica and a demo replica, each started
again on its port once traffic flowed without it; then a planned restart
(SIGTERM, a drain, a start) of a proxy and of a worker.

What must hold: no request fails with no fault (Hypercorn included); a
kill costs at most the requests in flight at that moment (every failure
started before it) and none after; the part takes traffic again once it
listens; a planned restart costs nothing. Loopback only; every wait is for
a state, bounded by the test's ``fail_after``.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable

import trio
from support import REPO

from blocks.testing import Outcome, PacedLoad, ProcessFleet

PY = sys.executable
HYPERCORN = [PY, "-m", "hypercorn", "tests.asgi_replica:app", "--bind", "127.0.0.1:{port}", "-k", "trio", "-w", "0"]
DEMO = [PY, "-m", "blocks.testing.replica", "--port", "{port}", "--name", "{name}"]
REPLICAS = {
    "hyper-0": (HYPERCORN, r"Running on", "h2c"),
    "hyper-1": (HYPERCORN, r"Running on", "h2c"),
    "demo-0": (DEMO, r"listening on", "h2c"),
    "demo-1": (DEMO, r"listening on", "h2c"),
}
RATE = 60.0
"""Requests per second: moderate, so that the test means the same on a loaded machine."""


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await trio.sleep(0.01)


def describe(failed: list[Outcome]) -> str:
    return str(collections.Counter(o.error or str(o.status) for o in failed))


async def test_a_fleet_with_no_single_point_of_failure(nursery: trio.Nursery) -> None:
    with trio.fail_after(240):
        fleet: ProcessFleet = await nursery.start(ProcessFleet(REPLICAS, cwd=REPO).run)
        load = PacedLoad(fleet.parts["edge"].address, RATE)
        await nursery.start(load.run)

        def tag(part: str) -> str:
            return f"hypercorn-{fleet.parts[part].port}" if part.startswith("hyper") else part

        async def served(more: int) -> None:
            n = len(load.outcomes)
            await until(lambda: len(load.outcomes) >= n + more)

        await served(int(RATE * 2))
        quiet = load.failed_between(0.0)
        assert not quiet, f"with no fault: {describe(quiet)}"
        for part in ("hyper-0", "hyper-1", "demo-0", "demo-1", "worker-1", "worker-2", "proxy-1", "proxy-2"):
            await until(lambda part=part: load.first_through(tag(part), 0.0) is not None)  # every part serves

        for part in ("proxy-1", "worker-1", "hyper-0", "demo-0"):
            fault = trio.current_time()
            fleet.kill(part)
            await fleet.wait_dead(part)
            await served(int(RATE))  # the fleet serves without it
            await fleet.start(part)
            listening = trio.current_time()
            await until(lambda part=part, since=listening: load.first_through(tag(part), since) is not None)
            await served(int(RATE / 2))
            failed = load.failed_between(fault - 1.0)
            late = [o for o in failed if o.start > fault]
            assert not late, f"kill -9 {part}: requests that started after the kill failed: {describe(late)}"

        for part in ("proxy-1", "worker-1"):
            planned = trio.current_time()
            await fleet.stop(part)
            await fleet.start(part)
            listening = trio.current_time()
            await until(lambda part=part, since=listening: load.first_through(tag(part), since) is not None)
            await served(int(RATE / 2))
            failed = load.failed_between(planned - 0.5)
            assert not failed, f"planned restart of {part}: {describe(failed)}"
