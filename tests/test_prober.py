"""The concurrency prober: the worker's load endpoint, the load estimator, the
ProberAware policy, the autoscale signal and the prober's trio driver.

Rules: sans-IO parts are driven synchronously with explicit ``now``; the
driver and the endpoint run on real sockets on 127.0.0.1, port 0, every test
bounded by ``trio.fail_after``. Waits for the prober are liveness bounds
(``wait_for``), never speed assertions.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import random

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

import blocks
from blocks import (
    LocalReplica,
    ProberConfig,
    Replica,
    Request,
    RouteTable,
    Upstreams,
    open_upstreams,
    serve_proxy,
    serve_worker,
)
from blocks.prober import (
    LOAD_PATH,
    PROBE_HEADER,
    AutoscaleConfig,
    AutoscaleSignal,
    LoadEstimator,
    ProberAware,
    ReplicaLoad,
    encode_load,
    open_prober,
    parse_load,
)
from tests.support import HOST, assemble_local, closed_port, curl, serve_tenant_replica, wait_for

WORKER = (HOST, 1)


def replica(name: str) -> Replica:
    return Replica(name=name, worker=WORKER, address=(HOST, 2))


REQUEST = Request(b"GET", b"http", b"app.example", b"/")


# -- the load document ------------------------------------------------------------------------


def test_load_document_round_trips() -> None:
    loads = {"a": ReplicaLoad(3, 8), "b": ReplicaLoad(0)}
    data = encode_load("worker-1", loads)
    assert json.loads(data) == {
        "worker": "worker-1",
        "replicas": {"a": {"in_flight": 3, "capacity": 8}, "b": {"in_flight": 0, "capacity": 0}},
    }
    report = parse_load(data)
    assert report.worker == "worker-1"
    assert report.replicas == loads


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"worker": 1, "replicas": {}}',
        b'{"worker": "w"}',
        b'{"worker": "w", "replicas": {"a": 3}}',
        b'{"worker": "w", "replicas": {"a": {}}}',
        b'{"worker": "w", "replicas": {"a": {"in_flight": -1}}}',
        b'{"worker": "w", "replicas": {"a": {"in_flight": 1.5}}}',
        b'{"worker": "w", "replicas": {"a": {"in_flight": true}}}',
        b'{"worker": "w", "replicas": {"a": {"in_flight": 1, "capacity": "8"}}}',
    ],
)
def test_malformed_load_documents_are_value_errors(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_load(data)


def test_a_missing_capacity_is_unknown() -> None:
    assert parse_load(b'{"worker": "w", "replicas": {"a": {"in_flight": 2}}}').replicas == {"a": ReplicaLoad(2, 0)}


# -- configuration -------------------------------------------------------------------------------


def test_prober_config_defaults_and_validation() -> None:
    config = ProberConfig()
    assert (config.interval, config.timeout, config.stale_after) == (1.0, 0.5, 5.0)
    for bad in (
        {"interval": 0},
        {"timeout": -1},
        {"stale_after": math.inf},
        {"interval": 1.0, "timeout": 2.0},
        {"interval": 2.0, "timeout": 0.5, "stale_after": 1.0},
    ):
        with pytest.raises(ValueError):
            ProberConfig(**bad)


def test_autoscale_config_defaults_and_validation() -> None:
    config = AutoscaleConfig(target_concurrency=4)
    assert (config.up_window, config.down_window, config.hysteresis) == (30.0, 300.0, 0.2)
    for bad in (
        {"target_concurrency": 0},
        {"target_concurrency": math.nan},
        {"target_concurrency": 1, "up_window": 0},
        {"target_concurrency": 1, "up_window": 60, "down_window": 30},
        {"target_concurrency": 1, "hysteresis": 1.0},
        {"target_concurrency": 1, "hysteresis": -0.1},
    ):
        with pytest.raises(ValueError):
            AutoscaleConfig(**bad)  # type: ignore[arg-type]


def test_local_replica_capacity() -> None:
    assert LocalReplica((HOST, 1)).capacity == 0
    assert LocalReplica((HOST, 1), "h1", capacity=4).capacity == 4
    with pytest.raises(ValueError):
        LocalReplica((HOST, 1), capacity=-1)


# -- the estimator ----------------------------------------------------------------------------


# Loads ``blocks.prober._core`` without the package's ``__init__`` (which imports trio
# blocks), so that only what the module itself pulls in ends up in sys.modules.
def test_estimate_is_the_snapshot_corrected_by_what_this_proxy_did_since() -> None:
    estimator = LoadEstimator()
    assert estimator.estimate("a") == 0
    assert estimator.free("a") is None
    estimator.dispatched("a")
    estimator.dispatched("a")
    assert estimator.estimate("a") == 2  # no snapshot yet: local counts
    assert estimator.free("a") is None
    assert estimator.snapshot("a", 5, 8, now=10.0, taken_at=9.9)  # 2 of ours, 3 of others
    assert estimator.estimate("a") == 5
    assert estimator.free("a") == 3
    estimator.dispatched("a")
    assert (estimator.estimate("a"), estimator.free("a")) == (6, 2)
    for _ in range(3):
        estimator.completed("a")
    assert (estimator.estimate("a"), estimator.free("a")) == (3, 5)
    stats = estimator.statistics(now=11.0).replicas["a"]
    assert (stats.snapshot, stats.capacity, stats.dispatched_since, stats.completed_since) == (5, 8, 1, 3)
    assert stats.local_in_flight == 0
    assert stats.age == pytest.approx(1.1)


def test_estimate_never_goes_below_zero_and_free_may_go_negative() -> None:
    estimator = LoadEstimator()
    estimator.snapshot("a", 1, 2, now=1.0, taken_at=1.0)
    for _ in range(3):
        estimator.completed("a")  # completions the snapshot already saw
    assert estimator.estimate("a") == 0
    assert estimator.free("a") == 2
    assert estimator.statistics().replicas["a"].completed_since == 1  # the other two were already seen
    for _ in range(5):
        estimator.dispatched("a")
    assert estimator.estimate("a") == 5
    assert estimator.free("a") == -3


def test_capacity_falls_back_to_the_route_table_and_is_otherwise_unknown() -> None:
    estimator = LoadEstimator()
    estimator.snapshot("a", 1, 0, now=1.0, taken_at=1.0)
    assert estimator.free("a") is None
    assert estimator.free("a", capacity=4) == 3
    estimator.snapshot("a", 1, 2, now=2.0, taken_at=2.0)
    assert estimator.free("a", capacity=4) == 1  # the worker's own figure wins


def test_an_older_snapshot_never_replaces_a_newer_one() -> None:
    estimator = LoadEstimator()
    assert estimator.snapshot("a", 4, 8, now=2.0, taken_at=2.0)
    estimator.dispatched("a")
    assert not estimator.snapshot("a", 0, 8, now=2.5, taken_at=1.0)
    assert estimator.estimate("a") == 5
    with pytest.raises(ValueError):
        estimator.snapshot("a", 1, 1, now=1.0, taken_at=2.0)
    with pytest.raises(ValueError):
        estimator.snapshot("a", -1, 1, now=3.0, taken_at=3.0)


def test_stale_snapshots_fall_back_to_local_counts() -> None:
    estimator = LoadEstimator()
    estimator.dispatched("a")
    estimator.snapshot("a", 6, 8, now=10.0, taken_at=10.0)
    estimator.snapshot("b", 0, 8, now=10.0, taken_at=10.0)
    assert estimator.expire(now=15.0, stale_after=5.0) == []
    assert estimator.expire(now=15.5, stale_after=5.0) == ["a", "b"]
    assert estimator.estimate("a") == 1  # only what this proxy knows it sent
    assert estimator.free("a") is None and estimator.free("a", capacity=8) is None
    assert "b" not in estimator.statistics().replicas  # nothing in flight here: forgotten
    estimator.completed("a")
    assert estimator.estimate("a") == 0
    assert estimator.statistics().expired == 2
    estimator.snapshot("a", 2, 8, now=20.0, taken_at=20.0)
    assert estimator.free("a") == 6
    estimator.forget("a")
    assert estimator.estimate("a") == 0


OPS = st.lists(
    st.one_of(
        st.just(("dispatch", 0)),
        st.just(("complete", 0)),
        st.just(("snapshot", 0)),
        st.tuples(st.just("others"), st.integers(-3, 3)),
    ),
    max_size=80,
)


@given(OPS)
def test_after_an_exact_snapshot_the_estimate_tracks_the_truth(ops: list[tuple[str, int]]) -> None:
    """However this proxy's dispatches and completions interleave around snapshots,
    the estimate is the true in-flight count at the replica, but for what other
    proxies did since the last snapshot (which the next snapshot corrects)."""
    estimator = LoadEstimator()
    mine = others = 0
    others_at_snapshot: int | None = None
    now = 0.0
    for op, arg in ops:
        now += 0.25
        if op == "dispatch":
            mine += 1
            estimator.dispatched("r")
        elif op == "complete" and mine:
            mine -= 1
            estimator.completed("r")
        elif op == "snapshot":
            assert estimator.snapshot("r", mine + others, 16, now=now, taken_at=now)
            others_at_snapshot = others
        elif op == "others":
            others = max(0, others + arg)
        estimate = estimator.estimate("r")
        assert estimate >= 0
        if others_at_snapshot is None:
            assert estimate == mine  # no snapshot yet: local counts
        else:
            assert estimate == mine + others_at_snapshot
            assert estimator.free("r") == 16 - estimate
            if others == others_at_snapshot:
                assert estimate == mine + others  # the truth


@given(OPS, st.lists(st.integers(0, 10), min_size=1, max_size=20))
def test_any_snapshot_gives_a_non_negative_corrected_estimate(ops: list[tuple[str, int]], seen: list[int]) -> None:
    """Inexact snapshots (a completion seen twice, a dispatch not yet arrived) never
    make the estimate negative: it is the snapshot plus dispatches minus completions
    since, where a completion at 0 is not counted."""
    estimator = LoadEstimator()
    expected: int | None = None
    values = itertools.cycle(seen)
    for i, (op, _) in enumerate(ops):
        if op == "dispatch":
            estimator.dispatched("r")
            expected = None if expected is None else expected + 1
        elif op == "complete":
            estimator.completed("r")
            expected = None if expected is None else max(0, expected - 1)
        elif op == "snapshot":
            expected = next(values)
            estimator.snapshot("r", expected, 0, now=float(i), taken_at=float(i))
        assert estimator.estimate("r") >= 0
        if expected is not None:
            assert estimator.estimate("r") == expected


# -- the policy -------------------------------------------------------------------------------


def test_prober_aware_picks_the_most_free() -> None:
    estimator = LoadEstimator()
    a, b, c = replica("a"), replica("b"), replica("c")
    estimator.snapshot("a", 6, 8, now=1.0, taken_at=1.0)  # free 2
    estimator.snapshot("b", 1, 4, now=1.0, taken_at=1.0)  # free 3
    estimator.snapshot("c", 0, 2, now=1.0, taken_at=1.0)  # free 2
    policy = ProberAware(estimator, random.Random(1))
    assert policy.pick(REQUEST, [a, b, c], {}) is b
    estimator.dispatched("b")  # free 2: a three-way tie, broken by the proxy's in-flight
    assert policy.pick(REQUEST, [a, b, c], {"a": 1, "b": 1, "c": 0}) is c
    assert policy.pick(REQUEST, [a], {"a": 100}) is a


def test_prober_aware_tiers_room_then_unknown_then_full() -> None:
    estimator = LoadEstimator()
    roomy, unknown, full, over = replica("roomy"), replica("unknown"), replica("full"), replica("over")
    estimator.snapshot("roomy", 7, 8, now=1.0, taken_at=1.0)  # free 1
    estimator.snapshot("full", 4, 4, now=1.0, taken_at=1.0)  # free 0
    estimator.snapshot("over", 6, 4, now=1.0, taken_at=1.0)  # free -2
    policy = ProberAware(estimator, random.Random(1))
    busy = {"roomy": 50, "unknown": 0, "full": 0, "over": 0}
    assert policy.pick(REQUEST, [over, full, unknown, roomy], busy) is roomy
    estimator.dispatched("roomy")  # now full too
    assert policy.pick(REQUEST, [over, full, unknown, roomy], busy) is unknown
    assert policy.pick(REQUEST, [over, full, roomy], busy) is full  # the least over, then the least busy
    assert policy.pick(REQUEST, [over], busy) is over


def test_prober_aware_takes_the_capacity_from_the_route_table_if_the_worker_has_none() -> None:
    estimator = LoadEstimator()
    small, large = attrs.evolve(replica("small"), capacity=2), attrs.evolve(replica("large"), capacity=8)
    estimator.snapshot("small", 1, 0, now=1.0, taken_at=1.0)
    estimator.snapshot("large", 4, 0, now=1.0, taken_at=1.0)
    policy = ProberAware(estimator, random.Random(1))
    assert policy.pick(REQUEST, [small, large], {}) is large  # free 4 against 1, though busier
    assert policy.pick(REQUEST, [replica("small"), replica("large")], {"large": 1}).name == "small"


def test_prober_aware_breaks_ties_at_random() -> None:
    estimator = LoadEstimator()
    candidates = [replica(f"r{i}") for i in range(4)]
    for r in candidates:
        estimator.snapshot(r.name, 1, 4, now=1.0, taken_at=1.0)
    policy = ProberAware(estimator, random.Random(7))
    picks = {policy.pick(REQUEST, candidates, {}).name for _ in range(200)}
    assert picks == {r.name for r in candidates}


def _dispatch(policy: ProberAware, candidates: list[Replica], in_flight: dict[str, int], n: int) -> list[str]:
    """What a proxy does: pick, count in flight, tell the estimator."""
    picked = []
    for _ in range(n):
        name = policy.pick(REQUEST, candidates, in_flight).name
        in_flight[name] = in_flight.get(name, 0) + 1
        policy.estimator.dispatched(name)
        picked.append(name)
    return picked


def test_the_correction_spreads_a_burst_instead_of_piling_onto_the_free_replica() -> None:
    a, b = replica("a"), replica("b")
    corrected = ProberAware(LoadEstimator(), random.Random(1))
    for policy in (corrected,):
        policy.estimator.snapshot("a", 0, 4, now=1.0, taken_at=1.0)  # free 4
        policy.estimator.snapshot("b", 1, 4, now=1.0, taken_at=1.0)  # free 3
    assert _dispatch(corrected, [a, b], {}, 4) == ["a", "b", "a", "b"]
    # By the snapshot alone, every request of the interval would have gone to "a":
    uncorrected = ProberAware(LoadEstimator(), random.Random(1))
    uncorrected.estimator.snapshot("a", 0, 4, now=1.0, taken_at=1.0)
    uncorrected.estimator.snapshot("b", 1, 4, now=1.0, taken_at=1.0)
    assert [uncorrected.pick(REQUEST, [a, b], {}).name for _ in range(4)] == ["a"] * 4


def test_a_second_proxy_sees_the_first_ones_load_at_the_next_snapshot() -> None:
    a, b = replica("a"), replica("b")
    one, two = ProberAware(LoadEstimator(), random.Random(1)), ProberAware(LoadEstimator(), random.Random(2))
    for policy in (one, two):
        policy.estimator.snapshot("a", 0, 4, now=1.0, taken_at=1.0)
        policy.estimator.snapshot("b", 0, 4, now=1.0, taken_at=1.0)
    _dispatch(one, [a, b], {}, 3)  # two to one replica, one to the other
    heavy = max(("a", "b"), key=one.estimator.estimate)
    light = "b" if heavy == "a" else "a"
    assert (one.estimator.estimate(heavy), one.estimator.estimate(light)) == (2, 1)
    # Proxy 2 has not heard yet; the next snapshot (what the worker counts) tells it.
    for name in ("a", "b"):
        two.estimator.snapshot(name, one.estimator.estimate(name), 4, now=2.0, taken_at=2.0)
    assert _dispatch(two, [a, b], {}, 1) == [light]
    assert (two.estimator.free(heavy), two.estimator.free(light)) == (2, 2)


def test_prober_aware_satisfies_the_policy_protocol() -> None:
    pick = ProberAware.pick
    assert list(pick.__annotations__) == ["request", "candidates", "in_flight", "return"]


# -- the autoscale signal ----------------------------------------------------------------------


def test_autoscale_scales_up_on_the_short_window() -> None:
    signal = AutoscaleSignal(AutoscaleConfig(target_concurrency=2, up_window=10, down_window=100))
    for t in range(0, 21):
        signal.record("app", 4, 2, now=float(t))  # 2 per replica: at the target
    stats = signal.recommend("app", 20.0)
    assert (stats.recommendation, stats.desired_replicas, stats.avg_in_flight_per_replica) == ("hold", 2, 2.0)
    signal.record("app", 10, 2, now=21.0)  # 5 per replica from t=21
    assert signal.recommend("app", 25.0).recommendation == "up"
    # Over [15, 25]: 6 s at 4, 4 s at 10: a time-weighted total of 6.4, 3.2 per replica.
    stats = signal.recommend("app", 25.0)
    assert stats.total_avg_in_flight == pytest.approx(6.4)
    assert stats.avg_in_flight_per_replica == pytest.approx(3.2)
    assert stats.desired_replicas == math.ceil(6.4 / 2)
    assert stats.target == 2 and stats.replicas == 2


def test_a_short_spike_is_averaged_away() -> None:
    signal = AutoscaleSignal(AutoscaleConfig(target_concurrency=4, up_window=30, down_window=300))
    signal.record("app", 4, 2, now=0.0)
    signal.record("app", 40, 2, now=29.0)  # 20 per replica, for one second
    signal.record("app", 4, 2, now=30.0)
    stats = signal.recommend("app", 30.0)
    assert stats.avg_in_flight_per_replica == pytest.approx((29 * 2 + 20) / 30)
    assert stats.recommendation == "hold"


def test_autoscale_scales_down_only_after_the_long_window() -> None:
    config = AutoscaleConfig(target_concurrency=4, up_window=10, down_window=60, hysteresis=0.25)
    signal = AutoscaleSignal(config)
    for t in range(0, 60, 5):
        signal.record("app", 2, 4, now=float(t))  # 0.5 per replica, far below 4 * 0.75
    early = signal.recommend("app", 55.0)
    assert early.recommendation == "hold" and early.history == pytest.approx(55.0)
    late = signal.recommend("app", 60.0)
    assert late.recommendation == "down"
    assert late.desired_replicas == 1  # ceil(2 / 4)
    assert late.long_avg_in_flight_per_replica == pytest.approx(0.5)


def test_autoscale_hysteresis_holds_just_under_the_target() -> None:
    signal = AutoscaleSignal(AutoscaleConfig(target_concurrency=4, up_window=10, down_window=20, hysteresis=0.2))
    for t in range(0, 31):
        signal.record("app", 14, 4, now=float(t))  # 3.5 per replica: under 4, above 3.2
    assert signal.recommend("app", 30.0).recommendation == "hold"
    signal.record("app", 12, 4, now=31.0)  # 3.0 per replica from here
    assert signal.recommend("app", 40.0).recommendation == "hold"  # the long window still sees 3.5
    stats = signal.recommend("app", 51.0)  # 3.0 < 3.2 over the whole long window
    assert (stats.recommendation, stats.desired_replicas) == ("down", 3)


def test_autoscale_down_to_fewer_replicas_and_to_zero() -> None:
    signal = AutoscaleSignal(AutoscaleConfig(target_concurrency=4, up_window=10, down_window=20, hysteresis=0.2))
    for t in range(0, 21):
        signal.record("app", 10, 8, now=float(t))  # 1.25 per replica
    stats = signal.recommend("app", 20.0)
    assert (stats.recommendation, stats.desired_replicas) == ("down", 3)
    for t in range(21, 42):
        signal.record("app", 0, 3, now=float(t))
    stats = signal.recommend("app", 41.0)
    assert (stats.recommendation, stats.desired_replicas) == ("down", 0)


def test_autoscale_per_app_config_clock_and_forget() -> None:
    signal = AutoscaleSignal(
        AutoscaleConfig(target_concurrency=100), apps={"llm": AutoscaleConfig(target_concurrency=1, up_window=1)}
    )
    signal.record("llm", 3, 1, now=0.0)
    signal.record("web", 3, 1, now=0.0)
    stats = signal.statistics(now=1.0).apps
    assert stats["llm"].recommendation == "up" and stats["llm"].desired_replicas == 3
    assert stats["web"].recommendation == "hold"
    with pytest.raises(ValueError):
        signal.record("llm", 1, 1, now=-1.0)
    signal.record("llm", 0, 1, now=0.0)  # the same instant: replaces
    assert signal.recommend("llm", 1.0).recommendation == "hold"
    signal.forget("web")
    assert signal.apps == ["llm"]
    with pytest.raises(KeyError):
        signal.recommend("web", 1.0)


def test_autoscale_keeps_only_the_long_window() -> None:
    signal = AutoscaleSignal(AutoscaleConfig(target_concurrency=1, up_window=1, down_window=10))
    for t in range(1000):
        signal.record("app", 1, 1, now=float(t))
    assert len(signal._series["app"]) <= 12


# -- the worker's load endpoint (real sockets) -------------------------------------------------


async def get(
    upstreams: Upstreams, port: int, path: bytes, *headers: tuple[bytes, bytes], protocol: str = "h2"
) -> tuple[blocks.Response, bytes]:
    request = Request(b"GET", b"http", f"{HOST}:{port}".encode(), path)
    response = await upstreams.request((HOST, port), request, list(headers), protocol=protocol)
    return response, await response.body.read_all()


async def test_the_worker_answers_its_load_over_h2_and_h1(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        held, _, local = await serve_tenant_replica(nursery)
        other, _, other_local = await serve_tenant_replica(nursery, "h1")
        replicas = {"a": attrs.evolve(local, capacity=4), "b": attrs.evolve(other_local, capacity=2)}
        server, worker = await nursery.start(functools.partial(serve_worker, replicas, name="worker-7"))
        async with open_upstreams() as upstreams, trio.open_nursery() as requests:
            for name in ("a", "a", "b"):
                requests.start_soon(get, upstreams, server.port, b"/hold", (b"x-proxyblocks-replica", name.encode()))
            await wait_for(lambda: held.total_in_flight == 2 and other.total_in_flight == 1)
            expected = {
                "worker": "worker-7",
                "replicas": {"a": {"in_flight": 2, "capacity": 4}, "b": {"in_flight": 1, "capacity": 2}},
            }
            for protocol in ("h2", "h1"):
                response, body = await get(upstreams, server.port, LOAD_PATH, (PROBE_HEADER, b"1"), protocol=protocol)
                assert response.status == 200
                assert response.header(b"content-type") == b"application/json"
                assert response.header(b"cache-control") == b"no-store"
                assert json.loads(body) == expected
            # curl, the way an operator would look:
            text = await curl("-H", "x-proxyblocks-probe: 1", f"http://{HOST}:{server.port}/.proxyblocks/load")
            assert json.loads(text) == expected
            assert worker.statistics().served == {"a": 2, "b": 1}  # probes are not requests to a replica
            held.release()
            other.release()


async def test_without_the_probe_field_the_load_path_is_forwarded(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        app, _, local = await serve_tenant_replica(nursery)
        server, worker = await nursery.start(serve_worker, {"a": local, "b": local})
        async with open_upstreams() as upstreams:
            # The proxy names the replica: the app gets the path, as any other.
            response, body = await get(upstreams, server.port, LOAD_PATH, (b"x-proxyblocks-replica", b"a"))
            assert response.status == 200 and response.header(b"x-tenant-seen") is not None
            # No replica named and two on this worker: the usual 503, not the load.
            response, body = await get(upstreams, server.port, LOAD_PATH)
            assert response.status == 503 and b"replicas" not in body
        assert app.arrivals == [""]
        assert worker.statistics().served == {"a": 1, "b": 0}


async def test_a_client_cannot_reach_the_load_endpoint_through_the_edge(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        app, _, local = await serve_tenant_replica(nursery)
        chain = await assemble_local(nursery, {"a": attrs.evolve(local, capacity=4)})
        for http in ("--http1.1", "--http2-prior-knowledge"):
            text = await curl(
                http, "-i", "-H", "x-proxyblocks-probe: 1", "-H", "x-tenant: t", f"{chain.url}/.proxyblocks/load"
            )
            assert "x-tenant-seen: t" in text.lower()  # the app answered
            assert "replicas" not in text
        assert len(app.arrivals) == 2


# -- the prober (real sockets) ------------------------------------------------------------------

FAST = ProberConfig(interval=0.05, timeout=0.05, stale_after=0.3)


async def test_the_prober_sees_requests_held_at_the_replicas(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        held, _, local = await serve_tenant_replica(nursery)
        replicas = {"a": attrs.evolve(local, capacity=4), "b": attrs.evolve(local, capacity=2)}
        server, _ = await nursery.start(serve_worker, replicas)
        worker = (HOST, server.port)
        estimator = LoadEstimator()
        signal = AutoscaleSignal(AutoscaleConfig(target_concurrency=1, up_window=0.2, down_window=0.4))
        apps = {"app": [Replica(name=n, worker=worker, address=local.address) for n in replicas]}
        async with (
            open_upstreams() as upstreams,
            open_prober(upstreams, lambda: [worker], estimator, FAST, autoscale=signal, apps=lambda: apps) as prober,
            trio.open_nursery() as requests,
        ):
            await wait_for(lambda: estimator.free("a") == 4 and estimator.free("b") == 2)
            for name in ("a", "a", "a", "b"):
                requests.start_soon(get, upstreams, server.port, b"/hold", (b"x-proxyblocks-replica", name.encode()))
            await wait_for(
                lambda: (estimator.estimate("a"), estimator.estimate("b")) == (3, 1),
                lambda: repr(estimator.statistics()),
            )
            assert (estimator.free("a"), estimator.free("b")) == (1, 1)
            policy = ProberAware(estimator)
            assert policy.pick(REQUEST, apps["app"], {}).name in ("a", "b")
            await wait_for(
                lambda: signal.recommend("app", trio.current_time()).recommendation == "up",
                lambda: repr(signal.statistics(trio.current_time())),
            )
            assert signal.recommend("app", trio.current_time()).desired_replicas >= 3
            held.release()
            await wait_for(lambda: estimator.estimate("a") == 0 and estimator.estimate("b") == 0)
            stats = prober.statistics()
            assert stats.failures == 0 and stats.polls >= 3 and stats.rounds >= 3
            seen = stats.workers[worker]
            assert seen.replicas == 2 and seen.last_error is None
            assert seen.age is not None and 0 <= seen.age < 5


async def test_a_proxy_with_prober_aware_routes_around_a_busy_replica(nursery: trio.Nursery) -> None:
    """The policy in the real proxy: load the proxy never saw (sent to the worker
    directly, as another proxy would) reaches it through the prober."""
    with trio.fail_after(10):
        held, _, local = await serve_tenant_replica(nursery)
        estimator = LoadEstimator()
        replicas = {"a": attrs.evolve(local, capacity=4), "b": attrs.evolve(local, capacity=4)}
        chain = await assemble_local(nursery, replicas, policy=ProberAware(estimator))
        worker = (HOST, chain.worker_server.port)
        async with (
            open_upstreams() as upstreams,
            open_prober(upstreams, lambda: [worker], estimator, FAST),
            trio.open_nursery() as requests,
        ):
            for _ in range(3):
                requests.start_soon(get, upstreams, worker[1], b"/hold", (b"x-proxyblocks-replica", b"a"))
            await wait_for(lambda: estimator.free("a") == 1 and estimator.free("b") == 4)
            for _ in range(3):
                text = await curl("-H", "x-tenant: t", f"{chain.url}/")
                assert text == "t\n"
            assert chain.worker.statistics().served == {"a": 3, "b": 3}
            held.release()


async def test_a_failing_worker_goes_stale_and_the_others_carry_on(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        _, _, local = await serve_tenant_replica(nursery)
        dead = (HOST, closed_port())
        estimator = LoadEstimator()
        worker_scope = trio.CancelScope()
        server = await nursery.start(serve_in, worker_scope, {"a": attrs.evolve(local, capacity=4)})
        alive = (HOST, server.port)
        async with (
            open_upstreams() as upstreams,
            open_prober(upstreams, lambda: [alive, dead], estimator, FAST) as prober,
        ):
            await wait_for(lambda: estimator.free("a") == 4)
            await wait_for(lambda: prober.statistics().workers[dead].failures >= 2)
            stats = prober.statistics().workers[dead]
            assert stats.age is None and stats.last_error is not None and stats.replicas == 0
            estimator.dispatched("a")
            worker_scope.cancel()  # the worker goes away: its snapshot must go stale
            await wait_for(lambda: estimator.free("a") is None, lambda: repr(estimator.statistics()))
            assert estimator.estimate("a") == 1  # the local count is what is left
            assert prober.statistics().workers[alive].failures >= 1


async def serve_in(
    scope: trio.CancelScope,
    replicas: dict[str, LocalReplica],
    *,
    task_status: trio.TaskStatus[blocks.HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A worker that stops when ``scope`` is cancelled (its sockets close with it)."""

    async def serve(*, task_status: trio.TaskStatus[tuple[blocks.HTTPServer, blocks.Worker]]) -> None:
        await serve_worker(replicas, task_status=task_status)

    with scope:
        async with trio.open_nursery() as nursery:
            server, _ = await nursery.start(serve)
            task_status.started(server)


async def test_a_worker_that_answers_garbage_is_a_failure(nursery: trio.Nursery) -> None:
    async def garbage(request: Request) -> blocks.Response:
        return blocks.text_response(200, "not json")

    with trio.fail_after(10):
        server = await nursery.start(serve_worker_like, garbage)
        address = (HOST, server.port)
        estimator = LoadEstimator()
        async with (
            open_upstreams() as upstreams,
            open_prober(upstreams, lambda: [address], estimator, FAST) as prober,
        ):
            await wait_for(lambda: prober.statistics().failures >= 2)
            assert "JSONDecodeError" in (prober.statistics().workers[address].last_error or "")
            assert estimator.statistics().replicas == {}


async def serve_worker_like(handler: blocks.Handler, *, task_status: trio.TaskStatus[blocks.HTTPServer]) -> None:
    await blocks.serve_http(handler, config=blocks.INTERNAL_LISTENER, task_status=task_status)


async def test_workers_that_leave_the_list_leave_the_statistics(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        _, _, local = await serve_tenant_replica(nursery)
        server, _ = await nursery.start(serve_worker, {"a": local})
        address = (HOST, server.port)
        listed: list[tuple[str, int]] = [address]
        async with (
            open_upstreams() as upstreams,
            open_prober(upstreams, lambda: listed, LoadEstimator(), FAST) as prober,
        ):
            await prober.wait_round()
            assert list(prober.statistics().workers) == [address]
            listed.clear()
            await prober.wait_round()
            await prober.wait_round()
            assert prober.statistics().workers == {}


async def test_open_prober_raises_the_body_error_unwrapped() -> None:
    with trio.fail_after(10):
        async with open_upstreams() as upstreams:
            with pytest.raises(KeyError, match="boom"):
                async with open_prober(upstreams, list, LoadEstimator(), FAST):
                    raise KeyError("boom")


async def test_serve_proxy_with_a_prober_routes_by_load_and_counts_its_own_dispatches(nursery: trio.Nursery) -> None:
    """``serve_proxy(prober=...)``: the proxy polls the workers in its routes, picks by free
    capacity (ProberAware by default), and tells the estimator of each dispatch and completion."""
    with trio.fail_after(10):
        held, _, local = await serve_tenant_replica(nursery)
        replicas = {"a": attrs.evolve(local, capacity=4), "b": attrs.evolve(local, capacity=4)}
        worker_server, _ = await nursery.start(serve_worker, replicas)
        worker = (HOST, worker_server.port)
        table = RouteTable.build(
            {"*": "app"}, {"app": [Replica(name=n, worker=worker, address=local.address) for n in replicas]}
        )
        proxy_server, proxy = await nursery.start(functools.partial(serve_proxy, table, prober=FAST))
        estimator = proxy.load
        assert estimator is not None and isinstance(proxy.policy, ProberAware)
        async with open_upstreams() as upstreams, trio.open_nursery() as requests:
            for _ in range(3):  # load the proxy never saw, as another proxy's would be
                requests.start_soon(get, upstreams, worker[1], b"/hold", (b"x-proxyblocks-replica", b"a"))
            await wait_for(lambda: estimator.free("a") == 1 and estimator.free("b") == 4)
            for _ in range(2):  # held through this proxy: counted at once, before any poll
                requests.start_soon(get, upstreams, proxy_server.port, b"/hold")
            await wait_for(lambda: estimator.estimate("b") == 2, lambda: repr(estimator.statistics()))
            await wait_for(lambda: held.total_in_flight == 5, "all five requests held at the replica")
            held.release()
        await wait_for(lambda: (estimator.estimate("a"), estimator.estimate("b")) == (0, 0))
        assert sorted(held.arrivals) == [""] * 5
