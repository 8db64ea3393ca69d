"""recipes/serverless.py: a load ramp 0 -> steady -> 0 sees 0 -> N -> 0 replica processes.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``;
replicas are real processes (the demo replica); short windows so that a
ramp takes seconds. A test waits for the state it asserts (a replica count,
a process gone), never for a duration.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import httpx
import trio
import trio.testing

from blocks.autoscaler import DriverConfig, ScalingConfig
from recipes import serverless

REPO = Path(__file__).resolve().parent.parent
SCALING = ScalingConfig(
    target_concurrency=2, max_replicas=4, up_window=0.5, down_window=2.0, idle_timeout=1.5, hysteresis=0.2
)
DRIVER = DriverConfig(interval=0.2, settle=0.2, drain_timeout=5.0, stop_timeout=5.0, cold_start_timeout=20.0)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_load_ramp_scales_from_zero_to_n_and_back_to_zero_without_a_failed_request() -> None:
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            start = functools.partial(serverless.main, scaling=SCALING, driver=DRIVER, every=0.5, announce=False)
            running: serverless.Serverless = await nursery.start(start)
            scaler = running.scaler
            ready: list[int] = []
            pids: set[int] = set()

            async def watch() -> None:
                while True:
                    stats = scaler.statistics()
                    ready.append(stats.apps["demo"].ready)
                    pids.update(stats.processes.values())
                    await trio.sleep(0.02)

            nursery.start_soon(watch)
            await trio.testing.wait_all_tasks_blocked()
            assert scaler.statistics().apps["demo"].ready == 0 and not scaler.statistics().processes

            statuses: list[int] = []
            stop = trio.Event()
            async with httpx.AsyncClient(base_url=running.chain.url, trust_env=False, timeout=30) as client:

                async def user() -> None:
                    while not stop.is_set():
                        statuses.append((await client.get("/sleep?ms=200")).status_code)

                async with trio.open_nursery() as users:
                    for _ in range(8):  # about 8 in flight: 4 replicas at a target of 2
                        users.start_soon(user)
                    while scaler.statistics().apps["demo"].ready < 3:  # steady load: up to N
                        await trio.sleep(0.05)
                    stop.set()
            peak = max(ready)
            while scaler.statistics().apps["demo"].ready or scaler.statistics().processes:  # idle: back to 0
                await trio.sleep(0.05)
            assert statuses and set(statuses) == {200}  # the cold start waited, nothing failed
            assert ready[0] == 0 and peak >= 3 and ready[-1] == 0
            assert scaler.statistics().apps["demo"].restarts == 0
            await running.shutdown(1.0)
            nursery.cancel_scope.cancel()  # (the watch)
        assert pids and not any(alive(pid) for pid in pids)  # every replica process is gone


async def test_shutdown_stops_every_replica_process() -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            scaling = ScalingConfig(target_concurrency=2, min_replicas=2, max_replicas=2)
            start = functools.partial(serverless.main, scaling=scaling, driver=DRIVER, announce=False)
            running: serverless.Serverless = await nursery.start(start)
            while running.scaler.statistics().apps["demo"].ready < 2:
                await trio.sleep(0.05)
            pids = list(running.scaler.statistics().processes.values())
            await running.shutdown(1.0)
        assert len(pids) == 2 and not any(alive(pid) for pid in pids)


def test_bad_flags_are_one_line_and_exit_code_2() -> None:
    for flags, message in [
        (["--command", "python3 -m http.server"], "no {port}"),
        (["--command", "no-such-program-here {port}"], "no program 'no-such-program-here'"),
        (["--target", "0"], "target_concurrency"),
        (["--min-replicas", "3", "--max-replicas", "2"], "max_replicas"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "recipes.serverless", *flags],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
        )
        assert result.returncode == 2, (flags, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("proxyblocks: error:") and message in lines[0], lines
