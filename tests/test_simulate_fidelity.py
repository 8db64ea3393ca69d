"""Fidelity: one small configuration, simulated and run for real through ``recipes/serverless.py``, agree.

The real run: the chain and the autoscaler's driver (``recipes.serverless``)
in front of demo replica processes, started from zero, with an open-loop
ramp of requests (0 -> 40 a second -> 0 over 10 s, each ``/sleep?ms=200``)
sent at the times a seeded :class:`~blocks.simulate.Workload` gives. The
simulated run: the same arrivals, the same ``ScalingConfig``, the same
round interval, replicas that serve 0.2 s with no concurrency limit (the
demo replica sleeps without blocking), and the cold start measured in the
real run (the time from its first replica's start to its first ready one:
how long a Python process takes to boot and answer here, which the
simulator takes as a parameter, not a prediction).

Tolerances, and why:

- **Ready replicas over time**: at every quarter second from the first
  request to the end, the two counts differ by at most 1 on average, and
  their peaks by at most 1. The real count moves when the prober's answer
  lands and a process boots, each a few tens of milliseconds later than
  the simulated instant (more on a loaded 2-core machine), and a replica
  that comes up one round (0.2 s) apart is off by one for that round; a
  systematic error (a wrong signal, a missed cold start, a replica that
  never drains) is off by more than one for seconds.
- **Back to zero**: both runs end with no replica, the real one's last
  replica gone within 3 s of the simulated one's (process stops and the
  drain's settle time are not simulated).
- **p50 latency**: within 30% (and 60 ms) of each other. The simulator
  models the replica's 200 ms and the queueing (cold start waits), not the
  three hops' own CPU, a few milliseconds per request on an idle machine
  and tens when other tests load it.

Loopback only, port 0, bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import functools
import math

import httpx
import pytest
import trio

from blocks.autoscaler import DriverConfig, ScalingConfig
from blocks.simulate import Ramp, ReplicaModel, ServiceTime, SimConfig, Traffic, Workload, simulate

serverless = pytest.importorskip("recipes.serverless", reason="pending: recipes/serverless.py (the autoscaler's)")

SCALING = ScalingConfig(
    target_concurrency=2, max_replicas=4, up_window=0.5, down_window=2.0, idle_timeout=1.5, hysteresis=0.2
)
DRIVER = DriverConfig(interval=0.2, settle=0.2, drain_timeout=5.0, stop_timeout=5.0, cold_start_timeout=20.0)
WORKLOAD = Workload(
    traffic=[Traffic(rate=40, shape=Ramp([(0, 0), (2, 1), (8, 1), (10, 0)]))], duration=10, seed=3
)  # about 8 in flight at the top: 4 replicas at a target of 2
SERVICE = 0.2
STEP = 0.25


def count_at(series: list[tuple[float, int]], time: float) -> int:
    """The last count at or before ``time`` in a ``(time, count)`` series (0 before the first)."""
    count = 0
    for at, n in series:
        if at > time:
            break
        count = n
    return count


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


async def real_run() -> tuple[list[tuple[float, int]], list[float], float, float]:
    """``(ready over time, latencies, measured cold start, end)``, times from the first request's send."""
    arrivals = list(WORKLOAD.arrivals())
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            start = functools.partial(serverless.main, scaling=SCALING, driver=DRIVER, every=60, announce=False)
            running = await nursery.start(start)
            scaler = running.scaler
            t0 = trio.current_time()
            ready: list[tuple[float, int]] = []
            first_start = first_ready = math.inf

            async def watch() -> None:
                nonlocal first_start, first_ready
                while True:
                    app = scaler.statistics().apps["demo"]
                    now = trio.current_time() - t0
                    if app.starting or app.ready:
                        first_start = min(first_start, now)
                    if app.ready:
                        first_ready = min(first_ready, now)
                    ready.append((now, app.ready))
                    await trio.sleep(0.02)

            latencies: list[float] = []
            statuses: list[int] = []
            async with httpx.AsyncClient(base_url=running.chain.url, trust_env=False, timeout=30) as client:

                async def send(at: float) -> None:
                    await trio.sleep_until(t0 + at)
                    response = await client.get(f"/sleep?ms={int(SERVICE * 1000)}")
                    statuses.append(response.status_code)
                    latencies.append(trio.current_time() - t0 - at)

                nursery.start_soon(watch)
                async with trio.open_nursery() as senders:
                    for arrival in arrivals:
                        senders.start_soon(send, arrival.time)
            while scaler.statistics().apps["demo"].ready or scaler.statistics().processes:
                await trio.sleep(0.05)
            end = trio.current_time() - t0
            await running.shutdown(1.0)
            nursery.cancel_scope.cancel()
    assert statuses and set(statuses) == {200}
    assert len(latencies) == len(arrivals)
    return ready, latencies, first_ready - first_start, end


async def test_a_small_configuration_simulated_agrees_with_the_real_serverless_chain() -> None:
    ready, latencies, cold_start, end = await real_run()
    assert 0 < cold_start < 10
    config = SimConfig(
        name="simulated",
        replica=ReplicaModel(
            concurrency=1000, service=ServiceTime(mean=SERVICE, distribution="constant"), cold_start=cold_start
        ),
        scaling=SCALING,
        interval=DRIVER.interval,
        cold_start_timeout=DRIVER.cold_start_timeout,
        sample=0.05,
    )
    result = simulate(config, WORKLOAD.arrivals(), until=end + 5)
    simulated = [(sample.time, sample.ready) for sample in result.timeline]
    grid = [i * STEP for i in range(int(end / STEP) + 1)]
    real_counts = [count_at(ready, t) for t in grid]
    sim_counts = [count_at(simulated, t) for t in grid]
    gaps = [abs(a - b) for a, b in zip(real_counts, sim_counts, strict=True)]
    detail = f"real {real_counts}\nsim  {sim_counts}\ncold start {cold_start:.2f} s"
    assert sum(gaps) / len(gaps) <= 1.0, detail
    assert abs(max(real_counts) - max(sim_counts)) <= 1, detail
    assert max(real_counts) >= 3, detail  # the ramp did scale up
    sim_zero = max((t for t, n in result.replica_changes if n), default=0.0)  # its last change to 0 is after this
    sim_zero = min((t for t, n in result.replica_changes if t >= sim_zero and n == 0), default=math.inf)
    assert result.timeline[-1].replicas == 0 and end - sim_zero <= 3.0, f"real {end:.2f} s, sim {sim_zero:.2f} s"
    real_p50, sim_p50 = percentile(latencies, 0.5), result.latency_p50
    assert sim_p50 is not None
    assert abs(real_p50 - sim_p50) <= max(0.3 * sim_p50, 0.06), (real_p50, sim_p50)
