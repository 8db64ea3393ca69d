"""The simulator: its clients, its histogram, and the engine around the library's real cores.

Synchronous tests and hypothesis properties: no trio, no socket. Every run
is bounded in simulated time (``until`` or a workload's ``duration``) and in
events (``max_events``), so a bug that loops fails the test instead of
hanging it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks import SchedulerConfig, SessionConfig, TenantPolicy
from blocks.autoscaler import ScalingConfig
from blocks.routing import LeastInFlight, Policy, PowerOfTwo, RoundRobin
from blocks.simulate import (
    Arrival,
    Bursts,
    Diurnal,
    Histogram,
    Ramp,
    ReplicaModel,
    ServiceTime,
    SimConfig,
    SimResult,
    Simulation,
    SimulationLimit,
    TraceError,
    Traffic,
    Workload,
    pattern,
    read_trace,
    simulate,
    write_trace,
)

EVENTS = 2_000_000  # a bound on every run here: far above what they need


def run(config: SimConfig, arrivals: object, *, until: float | None = None) -> SimResult:
    return Simulation(config).run(arrivals, until=until, max_events=EVENTS)  # type: ignore[arg-type]


def fixed(n: int, **model: object) -> SimConfig:
    """``n`` replicas from the start, never more nor fewer."""
    scaling = ScalingConfig(target_concurrency=1, min_replicas=n, max_replicas=n)
    return SimConfig(scaling=scaling, replica=ReplicaModel(**model))  # type: ignore[arg-type]


def integral(changes: tuple[tuple[float, int], ...], end: float) -> float:
    """The integral of the step function ``changes`` from 0 to ``end``."""
    total = 0.0
    for (t0, n), (t1, _) in zip(changes, (*changes[1:], (end, 0)), strict=True):
        total += n * (t1 - t0)
    return total


# -- the histogram --------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    samples=st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), min_size=1, max_size=300),
    fraction=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]),
)
def test_a_histogram_percentile_is_within_one_percent_of_the_exact_one(samples: list[float], fraction: float) -> None:
    ordered = sorted(samples)
    exact = ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]
    got = Histogram.of(samples).percentile(fraction)
    assert got is not None
    if exact < 1e-6:
        assert got == 0.0
    else:
        assert abs(got - exact) <= 0.01 * exact


def test_an_empty_histogram_has_no_percentile_and_merging_adds_counts() -> None:
    assert Histogram().percentile(0.5) is None
    a, b = Histogram.of([1.0, 2.0]), Histogram.of([3.0])
    a.merge(b)
    assert a.count == 3
    assert a.mean == pytest.approx(2.0)
    assert a.percentile(1.0) == pytest.approx(3.0, rel=0.01)


# -- clients ----------------------------------------------------------------------------------------


def test_a_workload_is_the_same_for_the_same_seed_and_in_time_order() -> None:
    workload = pattern("noisy", rate=20, duration=30, apps=3, requests=3, think=0.5, seed=7)
    first, second = list(workload.arrivals()), list(workload.arrivals())
    assert first == second
    assert [a.time for a in first] == sorted(a.time for a in first)
    assert all(0 <= a.time <= 30 for a in first)
    assert {a.tenant for a in first} == {"default", "noisy"}
    assert {a.app for a in first if a.tenant == "noisy"} == {"app-0"}
    assert first != list(attrs.evolve(workload, seed=8).arrivals())


def test_poisson_sessions_come_at_their_rate_with_their_mean_of_requests() -> None:
    workload = Workload(traffic=[Traffic(rate=100, requests=4, think=0.01)], duration=200, seed=1)
    arrivals = list(workload.arrivals())
    sessions = {a.session for a in arrivals}
    # 20,000 sessions expected; a Poisson count's standard deviation is its root (141): 5 of them
    assert abs(len(sessions) - 20_000) < 5 * 141
    assert len(arrivals) / len(sessions) == pytest.approx(4, rel=0.05)


def test_shapes_shape_the_rate() -> None:
    bursts = Workload(traffic=[Traffic(rate=50, shape=Bursts(every=10, length=2, factor=10))], duration=100, seed=2)
    inside = sum(1 for a in bursts.arrivals() if a.time % 10 < 2)
    outside = sum(1 for a in bursts.arrivals() if a.time % 10 >= 2)
    assert inside / 2 > 5 * outside / 8  # ten times the rate in the bursts (by rate per second: > 5x)
    day = Workload(traffic=[Traffic(rate=50, shape=Diurnal(period=100, low=0.0))], duration=100, seed=3)
    times = [a.time for a in day.arrivals()]
    assert sum(1 for t in times if 40 <= t < 60) > 5 * sum(1 for t in times if t < 10 or t >= 90)
    ramp = Ramp([(0, 0), (10, 1), (20, 1), (30, 0)])
    assert [ramp.at(t) for t in (-1, 0, 5, 15, 25, 30, 40)] == [0, 0, 0.5, 1, 0.5, 0, 0]
    with pytest.raises(ValueError, match="forward in time"):
        Ramp([(10, 1), (0, 0)])


def test_a_trace_reads_back_what_was_written(tmp_path: Path) -> None:
    arrivals = list(pattern("bursts", rate=5, duration=20, apps=2, requests=2, seed=4).arrivals())
    path = tmp_path / "trace.csv"
    assert write_trace(arrivals, path) == len(arrivals)
    assert list(read_trace(path)) == arrivals
    minimal = tmp_path / "minimal.csv"
    minimal.write_text("time,tenant,app\n0.5,t,a\n")
    assert list(read_trace(minimal)) == [Arrival(0.5, "t", "a", "", 1.0)]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("when,tenant,app\n", "the header lacks time"),
        ("time,tenant,app\nsoon,t,a\n", "line 2: could not convert"),
        ("time,tenant,app\n2,t,a\n1,t,a\n", "line 3: time 1 goes back"),
        ("time,tenant,app,session,size\n1,t,a,s,-1\n", "line 2: size '-1'"),
        ("time,tenant,app\n1,,a\n", "line 2: tenant and app may not be empty"),
        ("time,tenant,app\ninf,t,a\n", "line 2: time 'inf'"),
    ],
)
def test_a_bad_trace_says_which_line_and_why(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(TraceError, match=error):
        list(read_trace(path))
    with pytest.raises(TraceError, match="No such file"):
        list(read_trace(tmp_path / "missing.csv"))


# -- the engine: invariants -------------------------------------------------------------------------


POLICY_FACTORIES: list[Callable[[random.Random], Policy]] = [LeastInFlight, PowerOfTwo, lambda rng: RoundRobin()]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SimConfig, Workload, float | None]:
    sessioned = draw(st.booleans())
    scheduler = draw(
        st.none()
        | st.builds(
            lambda budget, queued, timeout: SchedulerConfig(
                budget=budget, default_policy=TenantPolicy(max_queued=queued, queue_timeout=timeout)
            ),
            st.integers(1, 6),
            st.integers(0, 5),
            st.floats(0.05, 2.0),
        )
    )
    config = SimConfig(
        policy=draw(st.sampled_from(POLICY_FACTORIES)),
        replica=ReplicaModel(
            concurrency=draw(st.integers(1, 3)),
            service=ServiceTime(
                mean=draw(st.floats(0.01, 0.5)), distribution=draw(st.sampled_from(["exponential", "lognormal"]))
            ),
            cold_start=draw(st.floats(0, 3)),
            max_sessions=draw(st.integers(0, 3)),
        ),
        scaling=ScalingConfig(
            target_concurrency=draw(st.floats(0.5, 4)),
            min_replicas=draw(st.integers(0, 1)),
            max_replicas=draw(st.integers(1, 5)),
            buffer_replicas=draw(st.integers(0, 1)),
            up_window=2,
            down_window=5,
            idle_timeout=draw(st.floats(0.5, 5)),
        ),
        cold_start_timeout=draw(st.floats(0, 5)),
        scheduler=scheduler,
        sessions=SessionConfig(apps={"app-0"}, queue_size=draw(st.integers(0, 4)), queue_timeout=1.0)
        if sessioned
        else None,
        session_idle=draw(st.floats(0.1, 3)),
        seed=draw(st.integers(0, 3)),
    )
    workload = Workload(
        traffic=[
            Traffic(rate=draw(st.floats(0.5, 20)), apps=("app-0", "app-1"), requests=draw(st.floats(1, 4)), think=0.3),
            Traffic(rate=draw(st.floats(0, 40)), tenant="noisy", apps=("app-0",), shape=Bursts(every=5, length=1)),
        ],
        duration=draw(st.floats(1, 15)),
        seed=draw(st.integers(0, 1000)),
    )
    until = draw(st.none() | st.floats(1, 30))
    return config, workload, until


@settings(max_examples=60, deadline=None)
@given(scenario=scenarios())
def test_every_request_ends_exactly_once_and_cost_is_the_integral_of_replicas(
    scenario: tuple[SimConfig, Workload, float | None],
) -> None:
    config, workload, until = scenario
    result = run(config, workload.arrivals(), until=until)
    expected = sum(1 for a in workload.arrivals() if until is None or a.time <= until)
    # (the engine raises if a request ends twice; here: none is lost, none counted twice)
    assert result.requests == expected
    ended = result.served + sum(result.refused.values()) + sum(result.timed_out.values())
    assert ended + result.unfinished == result.requests
    if until is None:
        assert result.unfinished == 0
    for name in ("requests", "served", "unfinished"):
        assert sum(getattr(t, name) for t in result.tenants.values()) == getattr(result, name)
    assert sum(t.refused for t in result.tenants.values()) == sum(result.refused.values())
    assert sum(t.timed_out for t in result.tenants.values()) == sum(result.timed_out.values())
    # replica-seconds three ways: the engine's running area, each replica's lifetime, the timeline's steps
    assert result.replica_seconds == pytest.approx(result.lifetimes, rel=1e-9, abs=1e-6)
    assert result.replica_seconds == pytest.approx(integral(result.replica_changes, result.end), rel=1e-9, abs=1e-6)


def test_a_run_is_a_function_of_its_config_workload_and_seed() -> None:
    workload = pattern("noisy", rate=10, duration=20, apps=2, requests=3, think=0.2, seed=5)
    config = SimConfig(policy=PowerOfTwo, replica=ReplicaModel(concurrency=2, cold_start=1))
    assert run(config, workload.arrivals()) == run(config, workload.arrivals())
    assert run(config, workload.arrivals()) != run(attrs.evolve(config, seed=1), workload.arrivals())


def test_a_run_is_bounded_in_events() -> None:
    with pytest.raises(SimulationLimit, match="100 events"):
        Simulation(fixed(1)).run(pattern("poisson", rate=50, duration=10).arrivals(), max_events=100)


def test_arrivals_that_go_back_in_time_are_an_error() -> None:
    with pytest.raises(ValueError, match="back in time"):
        run(fixed(1), [Arrival(1.0, "t", "a"), Arrival(0.5, "t", "a")])


# -- the engine: what the replicas and the cores do ---------------------------------------------------


def test_a_replica_serves_concurrency_requests_at_once_and_queues_the_rest() -> None:
    config = fixed(1, concurrency=2, service=ServiceTime(mean=1.0, distribution="constant"))
    result = run(config, [Arrival(0.0, "t", "a") for _ in range(6)])
    # two at a time, each 1 s: waits of 0, 0, 1, 1, 2, 2 and latencies of 1, 1, 2, 2, 3, 3
    assert result.served == 6
    assert result.queueing_p50 == pytest.approx(1.0, rel=0.01)
    assert result.queueing_p99 == pytest.approx(2.0, rel=0.01)
    assert result.latency_p99 == pytest.approx(3.0, rel=0.01)
    assert result.end == pytest.approx(3.0)
    assert result.replica_seconds == pytest.approx(3.0)


def test_an_idle_app_starts_one_replica_for_every_waiting_request_and_serves_them_after_the_cold_start() -> None:
    config = SimConfig(
        replica=ReplicaModel(concurrency=8, cold_start=5.0, service=ServiceTime(mean=0.1, distribution="constant")),
        cold_start_timeout=10.0,
    )
    result = run(config, [Arrival(t, "t", "a") for t in (0.0, 1.0, 2.0)])
    assert result.served == 3
    assert result.cold_starts == 1  # one start, shared (single flight)
    assert result.cold_waits == 3
    assert result.tenants["t"].queueing_p99 == pytest.approx(5.0, rel=0.01)  # the first waited the whole start
    assert result.tenants["t"].queueing_p50 == pytest.approx(4.0, rel=0.01)


def test_a_request_that_waits_past_the_cold_start_timeout_times_out() -> None:
    config = SimConfig(replica=ReplicaModel(cold_start=5.0), cold_start_timeout=2.0)
    result = run(config, [Arrival(0.0, "t", "a"), Arrival(4.0, "t", "a")])
    assert result.timed_out == {"cold-start": 1}
    assert result.served == 1  # the second came at 4 s and waited 1 s


def test_the_fair_queue_keeps_a_quiet_tenant_fast_under_a_flood() -> None:
    """One replica slot shared by a tenant sending 50 a second and one sending 1; each request takes 0.1 s.

    Without a scheduler the quiet tenant waits behind the flood in the
    replica's queue; with the fair queue (one slot, deficit round robin) it
    waits for the request in service and at most one more (the flood's turn
    already begun), 0.2 s.
    """
    flood = [Arrival(i / 50, "noisy", "a") for i in range(500)]
    quiet = [Arrival(0.05 + i, "quiet", "a") for i in range(10)]
    arrivals = sorted(flood + quiet, key=lambda a: a.time)
    model = {"concurrency": 1, "service": ServiceTime(mean=0.1, distribution="constant")}
    unfair = run(fixed(1, **model), arrivals)
    fair_config = attrs.evolve(
        fixed(1, **model),
        scheduler=SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=1000, queue_timeout=100)),
    )
    fair = run(fair_config, arrivals)
    assert unfair.tenants["quiet"].queueing_p50 is not None and unfair.tenants["quiet"].queueing_p50 > 10
    assert fair.tenants["quiet"].queueing_p99 is not None and fair.tenants["quiet"].queueing_p99 <= 0.2 + 1e-6
    assert fair.tenants["noisy"].queueing_p99 is not None and fair.tenants["noisy"].queueing_p99 > 10


def test_the_fair_queue_refuses_past_its_queue_and_times_out_past_its_deadline() -> None:
    config = attrs.evolve(
        fixed(1, service=ServiceTime(mean=1.0, distribution="constant")),
        scheduler=SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=2, queue_timeout=1.5)),
    )
    result = run(config, [Arrival(0.0, "t", "a") for _ in range(5)])
    # one served at once, two queued (the first of them granted at 1 s, the other expires at 1.5 s), two refused
    assert result.served == 2
    assert result.refused == {"queue-full": 2}
    assert result.timed_out == {"queue-timeout": 1}


def test_sessions_are_placed_by_the_session_placer_and_wait_for_a_place() -> None:
    """One replica with two places; three sessions of two requests each. The third waits until one ends idle."""
    config = attrs.evolve(
        fixed(1, concurrency=10, max_sessions=2, service=ServiceTime(mean=0.1, distribution="constant")),
        sessions=SessionConfig(apps={"chat"}, queue_size=4, queue_timeout=5.0),
        session_idle=1.0,
    )
    arrivals = [Arrival(0.0, "t", "chat", s) for s in ("s1", "s2", "s3")] + [
        Arrival(0.5, "t", "chat", s) for s in ("s1", "s2", "s3")
    ]
    result = run(config, sorted(arrivals, key=lambda a: a.time))
    assert result.served == 6
    assert result.sessions == 3
    # s1 and s2 end 1 s after their last request (done at 0.6 s): s3's requests start at 1.6 s
    assert result.tenants["t"].queueing_p99 == pytest.approx(1.6, rel=0.01)
    shorter = run(attrs.evolve(config, sessions=SessionConfig(apps={"chat"}, queue_timeout=1.0)), arrivals)
    assert shorter.timed_out == {"session-timeout": 2}  # both of s3's requests


def test_least_in_flight_beats_round_robin_on_a_long_tail() -> None:
    """Ten replicas, one request each at a time, lognormal service times: picking by in-flight avoids the slow ones."""
    model = {"concurrency": 1, "service": ServiceTime(mean=0.1, distribution="lognormal", sigma=1.5)}
    rng = random.Random(0)
    arrivals, t = [], 0.0
    for _ in range(20_000):
        t += rng.expovariate(80)  # 80% of the fleet's capacity
        arrivals.append(Arrival(t, "t", "a"))
    results = {
        name: run(attrs.evolve(fixed(10, **model), policy=policy), arrivals)
        for name, policy in zip(("lif", "p2", "rr"), POLICY_FACTORIES, strict=True)
    }
    p99 = {name: r.queueing_p99 for name, r in results.items()}
    assert all(value is not None for value in p99.values())
    assert p99["lif"] < p99["p2"] < p99["rr"], p99  # type: ignore[operator]


def test_the_autoscaler_follows_a_ramp_up_and_back_to_zero() -> None:
    """0 -> 40 requests a second -> 0, each 0.5 s at one per replica at once: about 20 replicas at the top."""
    ramp = Ramp([(0, 0), (20, 1), (60, 1), (80, 0)])
    workload = Workload(traffic=[Traffic(rate=40, shape=ramp)], duration=80, seed=1)
    config = SimConfig(
        replica=ReplicaModel(concurrency=1, cold_start=1.0, service=ServiceTime(mean=0.5)),
        scaling=ScalingConfig(target_concurrency=1, max_replicas=100, up_window=3, down_window=10, idle_timeout=10),
    )
    result = run(config, workload.arrivals(), until=200)
    steady = [s.replicas for s in result.timeline if 40 <= s.time <= 60]
    assert min(steady) >= 15 and max(steady) <= 45, steady
    assert result.timeline[-1].replicas == 0
    assert result.unfinished == 0
    assert simulate(config, workload.arrivals(), until=200) == result
