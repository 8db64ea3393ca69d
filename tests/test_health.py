"""Health that ends ejections promptly: slow start, the panic rule, next-hop failures, health checks, the retry budget.

Sans-IO parts (the detector, the retry budget) are tested synchronously and
with hypothesis; the checker end to end on 127.0.0.1, port 0, each test
bounded by ``trio.fail_after`` and waiting for states, never durations.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any, cast

import attrs
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from blocks import (
    Exchange,
    Keyring,
    LocalReplica,
    Proxy,
    ProxyAuth,
    ProxyConfig,
    Request,
    RouteTable,
    TokenKey,
    TokenVerifier,
    Unauthorized,
    Upstreams,
    open_upstreams,
    serve_proxy,
    serve_worker,
)
from blocks.fields import ERROR_HEADER, HEALTH_PATH, PROBE_HEADER, REPLICA_HEADER, TARGET_HEADER
from blocks.observe import MetricsCollector, Observed, Part
from blocks.prober import HealthChecker, HealthConfig, ProberConfig
from blocks.routing import (
    OutlierConfig,
    OutlierDetector,
    Replica,
    RetryBudget,
    RetryBudgetConfig,
    RetryBudgetStatistics,
)
from blocks.testing import serve_demo_replica
from tests.support import HOST, closed_port, wait_for

NO_UPSTREAMS = cast(Upstreams, None)  # deciding never touches the pool

W1 = ("127.0.0.1", 1)
W2 = ("127.0.0.1", 2)
RAMP = OutlierConfig(base_ejection=1.0, slow_start_window=10.0, slow_start_min_weight=0.1)


def replicas(n: int, worker: tuple[str, int] = W1, prefix: str = "r") -> list[Replica]:
    return [Replica(name=f"{prefix}{i}", worker=worker, address=("127.0.0.1", 1000 + i)) for i in range(n)]


# -- slow start -----------------------------------------------------------------------------------


def test_a_replica_back_from_ejection_ramps_up_then_is_a_full_member() -> None:
    detector = OutlierDetector(RAMP)
    four = replicas(4)
    a = four[0]
    assert detector.record(a, False, 0.0, unreachable=True)
    assert detector.selectable(four, 0.5) == four[1:]
    # Back at 1.0: offered for about its ramped share of the calls, never more.
    offered = sum(a in detector.selectable(four, 1.0 + i * 0.01) for i in range(400))
    shares = [detector.share(a.name, 1.0 + i * 0.01) for i in range(400)]
    assert 0 < offered <= 1 + sum(share / 4 for share in shares)  # one probe at once, then the ramp
    assert detector.share(a.name, 6.0) == pytest.approx(0.5)
    # After the window: a full member, and the one-check fast path is back.
    assert detector.selectable(four, 11.0) is four
    assert detector.statistics(now=11.0).ramping == {}


def test_slow_start_never_leaves_no_full_member() -> None:
    detector = OutlierDetector(RAMP)
    two = replicas(2)
    for replica in two:
        detector.joined(replica.name, 0.0)
    assert detector.selectable(two, 0.1) is two  # all ramping: all offered
    (one,) = replicas(1, prefix="solo")
    detector.joined(one.name, 0.0)
    assert detector.selectable([one], 0.1) == [one]


def test_slow_start_off_brings_a_replica_back_at_once() -> None:
    detector = OutlierDetector(attrs.evolve(RAMP, slow_start_window=0.0))
    two = replicas(2)
    detector.record(two[0], False, 0.0, unreachable=True)
    assert detector.selectable(two, 1.0) is two


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 8),
    window=st.floats(0.5, 30),
    aggression=st.floats(0.2, 5),
    min_weight=st.floats(0.01, 1),
    steps=st.lists(st.floats(0, 2, allow_nan=False), min_size=1, max_size=300),
)
def test_a_ramping_replica_is_never_offered_more_than_its_ramp(
    n: int, window: float, aggression: float, min_weight: float, steps: list[float]
) -> None:
    config = OutlierConfig(slow_start_window=window, slow_start_aggression=aggression, slow_start_min_weight=min_weight)
    detector = OutlierDetector(config)
    candidates = replicas(n)
    new = candidates[0]
    detector.joined(new.name, 0.0)
    now = 0.0
    allowed = 0.0
    offered = 0
    for step in steps:
        now += step
        share = detector.share(new.name, now)
        assert 0 < share <= 1
        selected = detector.selectable(candidates, now)
        assert list(selected) == [r for r in candidates if r in selected]
        if now >= window:
            assert share == 1.0
            assert selected is candidates  # a full member, and nothing else ramps
            continue
        expected = max(min_weight, (now / window) ** (1 / aggression))
        assert share == pytest.approx(min(1.0, expected))
        allowed += share / n
        offered += new in selected
        assert set(selected) >= set(candidates[1:])  # the others are untouched
        assert offered <= 1 + allowed + 1e-9  # its first offer at once, then never past the ramp


# -- next hops: one connection event, one failure, of the worker -----------------------------------


def test_a_next_hop_failure_is_the_workers_and_counts_once_per_event() -> None:
    detector = OutlierDetector(attrs.evolve(RAMP, slow_start_window=0.0))
    behind_1 = replicas(2, W1, "a")
    behind_2 = replicas(2, W2, "b")
    pool = [*behind_1, *behind_2]
    # A reset cut 50 streams at once: one event, one failure, of the worker.
    for i in range(50):
        detector.record_hop(W1, False, 5.0 + i * 0.0001)
    stats = detector.statistics()
    assert stats.hop_events == 1 and stats.failures == {} and stats.by_replica == {}
    assert detector.selectable(pool, 5.01) is pool  # 5 events are needed to eject
    for event in range(1, 5):
        detector.record_hop(W1, False, 5.0 + event)
    assert detector.out(W1, 9.0)
    # Every replica behind it leaves selection; the replicas themselves were never blamed.
    assert detector.selectable(pool, 9.0) == behind_2
    assert not any(detector.ejected(r, 9.0) for r in pool)
    assert detector.statistics(now=9.0).hops == {W1: 10.0}


def test_an_unreachable_next_hop_is_ejected_at_once_and_the_edge_can_filter_hops() -> None:
    detector = OutlierDetector(attrs.evolve(RAMP, slow_start_window=0.0))
    assert detector.record_hop(W2, False, 0.0, unreachable=True)
    hops = [W1, W2]
    assert detector.selectable_hops(hops, 0.5) == [W1]
    assert detector.selectable_hops(hops, 1.0) is hops


# -- what health checks tell the detector ------------------------------------------------------------


def test_a_passing_check_ends_an_ejection_at_once_and_a_failing_one_ejects() -> None:
    detector = OutlierDetector(RAMP)
    two = replicas(2)
    a = two[0]
    assert detector.check_failed(a.name, 0.0)
    assert not detector.check_failed(a.name, 0.5)  # already out
    assert detector.selectable(two, 0.5) == two[1:]
    assert detector.out(a.name, 1000.0)  # held out while its checks fail, not for an ejection's time
    assert detector.check_passed(a.name, 0.6)  # the first check that passes ends it
    assert not detector.out(a.name, 0.6)
    assert detector.statistics(now=0.6).ramping == {"r0": 0.6}  # back under slow start
    assert not detector.check_passed(a.name, 0.7)


def test_a_member_that_leaves_the_pool_is_forgotten_and_selection_is_fast_again() -> None:
    detector = OutlierDetector(RAMP)
    two = replicas(2, W2, "b")
    detector.check_failed(W1, 0.0)  # held out until a check passes: none will, it left
    detector.joined("b0", 0.0)
    detector.forget(W1)
    detector.forget("b0")
    assert detector.selectable(two, 0.1) is two
    assert detector.statistics().hops == {} and detector.statistics().ramping == {}


def test_a_check_that_passes_while_in_selection_does_not_forgive_failing_requests() -> None:
    detector = OutlierDetector(attrs.evolve(RAMP, slow_start_window=0.0))
    for event in range(4):
        detector.record_hop(W1, False, float(event))
    assert not detector.check_passed(W1, 4.5)  # it was never out: nothing to end
    assert detector.record_hop(W1, False, 5.0)  # the fifth event in a row ejects it


def test_a_draining_member_takes_nothing_until_a_check_passes() -> None:
    detector = OutlierDetector(attrs.evolve(RAMP, slow_start_window=0.0))
    pool = [*replicas(2, W1, "a"), *replicas(2, W2, "b")]
    detector.check_draining(W1, 0.0)
    assert detector.selectable(pool, 1000.0) == pool[2:]
    assert detector.statistics(now=1000.0).hops == {W1: float("inf")}
    detector.check_passed(W1, 1000.0)
    assert detector.selectable(pool, 1000.0) is pool


# -- the proxy: a failure of its link to the worker is the worker's ------------------------------------


def proxy_table() -> RouteTable:
    return RouteTable.build(
        {"app.example": "app"},
        {"app": [*replicas(2, W1, "a"), *replicas(2, W2, "b")]},
    )


def decide(proxy: Proxy) -> Exchange:
    exchange = Exchange(proxy, Request(b"GET", b"http", b"app.example", b"/", []))
    proxy.screen(exchange)
    proxy.decide(exchange)
    return exchange


def test_streams_a_worker_connection_cut_blame_the_worker_once_not_the_replicas() -> None:
    now = [0.0]
    detector = OutlierDetector(attrs.evolve(RAMP, slow_start_window=0.0, consecutive_failures=2))
    proxy = Proxy(proxy_table(), NO_UPSTREAMS, outliers=detector, clock=lambda: now[0])
    exchanges = [decide(proxy) for _ in range(40)]
    on_w1 = [e for e in exchanges if e.forward is not None and e.forward.address == W1]
    assert len(on_w1) == 20
    # The proxy's connection to W1 was reset: every stream on it fails, at this hop (no hop= or hop=proxy).
    for i, exchange in enumerate(on_w1):
        field = b"upstream_reset" if i % 2 else b"upstream_reset; hop=proxy"
        exchange.failed(502, [(ERROR_HEADER, field)])
        exchange.closed()
    stats = detector.statistics()
    assert stats.by_replica == {} and stats.failures == {} and stats.hop_events == 1
    # A second event ejects the worker (consecutive_failures=2): both its replicas leave, nobody else.
    now[0] = 1.0
    exchange = decide(proxy)
    while exchange.forward is None or exchange.forward.address != W1:
        exchange = decide(proxy)
    exchange.failed(502, [(ERROR_HEADER, b"upstream_reset")])
    assert detector.out(W1, 1.0)
    assert {decide(proxy).replica for _ in range(8)} == {"b0", "b1"}
    assert detector.statistics().by_replica == {}


def test_a_health_check_is_answered_by_the_hop_before_auth_and_other_requests_still_need_a_token() -> None:
    auth = ProxyAuth(TokenVerifier(Keyring([TokenKey.hmac("k1", bytes(range(32)))])), apps={"app"})
    proxy = Proxy(proxy_table(), NO_UPSTREAMS, auth=auth, clock=lambda: 0.0)
    check = Exchange(proxy, Request(b"GET", b"http", b"app.example", HEALTH_PATH, [(PROBE_HEADER, b"1")]))
    proxy.screen(check)
    assert check.answer == proxy.health
    plain = Exchange(proxy, Request(b"GET", b"http", b"app.example", HEALTH_PATH, []))  # no probe field: the app's
    with pytest.raises(Unauthorized):
        proxy.screen(plain)


def test_a_replica_the_worker_could_not_reach_is_the_replicas_own_failure() -> None:
    detector = OutlierDetector(attrs.evolve(RAMP, slow_start_window=0.0))
    proxy = Proxy(proxy_table(), NO_UPSTREAMS, outliers=detector, clock=lambda: 0.0)
    exchange = decide(proxy)
    exchange.failed(502, [(ERROR_HEADER, b"replica_unreachable; hop=worker")])
    assert exchange.replica is not None and detector.statistics().ejected.keys() == {exchange.replica}
    assert detector.statistics().hops == {}


# -- the retry budget ---------------------------------------------------------------------------------


def test_retry_budget_defaults_and_validation() -> None:
    config = RetryBudgetConfig()
    assert (config.ratio, config.window, config.min_per_second) == (0.2, 10.0, 10.0)
    for bad in [{"ratio": -0.1}, {"window": 0.0}, {"min_per_second": -1.0}, {"window": math.inf}]:
        with pytest.raises(ValueError):
            RetryBudgetConfig(**bad)  # type: ignore[arg-type]


def test_retries_are_a_share_of_requests_plus_a_floor_over_the_window() -> None:
    budget = RetryBudget(RetryBudgetConfig(ratio=0.2, window=10.0, min_per_second=1.0))
    assert [budget.try_retry(0.0) for _ in range(11)] == [True] * 10 + [False]  # the floor: 1/s over 10 s
    for _ in range(100):
        budget.requests += 1
    assert [budget.try_retry(1.0) for _ in range(21)] == [True] * 20 + [False]  # plus a fifth of 100
    assert budget.statistics(1.0) == RetryBudgetStatistics(requests=100, retries=30, refused=2, available=0.0)
    # Ten seconds after the first step ended, its retries have left the window, and the requests counted
    # in it with them, while the 20 retries taken at 1.0 still count: the budget errs towards fewer.
    assert not budget.try_retry(11.5)
    assert budget.statistics(11.5).available == 0.0
    # Once their step ended ten seconds ago too, the floor is back.
    assert budget.statistics(12.0).available == pytest.approx(10.0)
    assert budget.try_retry(12.0)


def test_a_proxy_retry_the_budget_refuses_answers_the_original_error() -> None:
    config = ProxyConfig(retry_budget=RetryBudgetConfig(ratio=0.0, min_per_second=0.1, window=10.0))
    proxy = Proxy(proxy_table(), NO_UPSTREAMS, config=config, clock=lambda: 0.0)
    assert proxy.retry_budget is not None
    error = [(ERROR_HEADER, b"replica_unreachable; hop=worker")]
    assert proxy.retry(decide(proxy), 502, list(error)) is not None  # the floor: one retry in 10 s
    assert proxy.retry(decide(proxy), 502, list(error)) is None
    stats = proxy.statistics()
    assert (stats.retried, stats.retries_refused) == (1, 1)
    assert proxy.retry_budget.requests == 2  # every routed request; a retry is not a request of its own


@settings(max_examples=200, deadline=None)
@given(
    ratio=st.floats(0, 1),
    window=st.floats(0.5, 30),
    floor=st.floats(0, 20),
    script=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 10), st.floats(0, 3)), max_size=100),
)
def test_retries_never_exceed_the_budget_over_any_window(
    ratio: float, window: float, floor: float, script: list[tuple[int, int, float]]
) -> None:
    budget = RetryBudget(RetryBudgetConfig(ratio=ratio, window=window, min_per_second=floor))
    now = 0.0
    taken: list[float] = []
    requests: list[tuple[float, int]] = []
    for n_requests, n_retries, step in script:
        now += step
        budget.requests += n_requests
        requests.append((now, n_requests))
        for _ in range(n_retries):
            if budget.try_retry(now):
                taken.append(now)
        # Over the window that ends now, retries stay within a share of every request counted so far
        # plus the floor.
        recent = [t for t in taken if t > now - window]
        assert len(recent) <= ratio * budget.requests + floor * window + 1e-6
    stats = budget.statistics()
    assert stats.retries == len(taken) and stats.refused == sum(r for _, r, _ in script) - len(taken)


# -- end to end: the checker, a proxy, two workers, real sockets ------------------------------------------

SLOW_EJECTION = OutlierConfig(base_ejection=30.0, max_ejection=60.0)  # only a health check can end one early
FAST_CHECKS = HealthConfig(interval=0.2, timeout=0.2)


async def start_cancellable(
    nursery: trio.Nursery, fn: Callable[..., Awaitable[None]], **kwargs: Any
) -> tuple[trio.CancelScope, Any]:
    """Start ``fn`` under a cancel scope of its own: cancelling it is the process dying (its sockets close)."""
    scope = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await fn(task_status=task_status, **kwargs)

    return scope, await nursery.start(run)


@attrs.define
class Fleet:
    """Two workers, each with one demo replica, and a proxy with health checks in front."""

    nursery: trio.Nursery
    worker_scopes: dict[str, trio.CancelScope]
    replica_scopes: dict[str, trio.CancelScope]
    workers: dict[str, tuple[str, int]]
    replicas: dict[str, tuple[str, int]]
    proxy_port: int
    proxy: Proxy

    @property
    def detector(self) -> OutlierDetector:
        assert self.proxy.outliers is not None
        return self.proxy.outliers

    @property
    def checker(self) -> HealthChecker:
        assert self.proxy.health_checker is not None
        return self.proxy.health_checker

    async def start_worker(self, name: str, port: int = 0) -> None:
        replica = {f"{name}-r": LocalReplica(self.replicas[f"{name}-r"])} if f"{name}-r" in self.replicas else {}
        scope, (server, _) = await start_cancellable(
            self.nursery, serve_worker, replicas=replica, port=port, name="worker"
        )
        self.worker_scopes[name] = scope
        self.workers[name] = (HOST, server.port)

    async def start_replica(self, name: str, port: int = 0) -> None:
        scope, server = await start_cancellable(self.nursery, serve_demo_replica, name=name, port=port)
        self.replica_scopes[name] = scope
        self.replicas[name] = (HOST, server.port)

    async def get(self, path: bytes = b"/") -> tuple[int, bytes]:
        async with open_upstreams() as upstreams:
            request = Request(b"GET", b"http", b"app.example", path)
            response = await upstreams.request((HOST, self.proxy_port), request, [])
            await response.body.read_all()
            return response.status, response.header(b"x-replica") or b""


def metric(f: Fleet, name: str, **labels: str) -> float | None:
    """The proxy's sample of ``name`` with ``labels``, as its admin listener would render it (None: absent)."""
    assert f.proxy.server is not None
    registry = CollectorRegistry()
    registry.register(
        MetricsCollector(lambda: Observed(parts=[Part(name="proxy", server=f.proxy.server, hop=f.proxy)]))
    )
    return registry.get_sample_value(name, {"hop": "proxy", **labels})


async def fleet(nursery: trio.Nursery, **proxy: Any) -> Fleet:
    f = Fleet(nursery, {}, {}, {}, {}, 0, cast(Proxy, None))
    for name in ("w1", "w2"):
        await f.start_replica(f"{name}-r")
        await f.start_worker(name)
    table = RouteTable.build(
        {"app.example": "app"},
        {"app": [Replica(name=f"{w}-r", worker=f.workers[w], address=f.replicas[f"{w}-r"]) for w in ("w1", "w2")]},
    )
    options: dict[str, Any] = {"outliers": SLOW_EJECTION, "health": FAST_CHECKS, **proxy}
    server, f.proxy = await nursery.start(functools.partial(serve_proxy, table, **options))
    f.proxy_port = server.port
    if f.proxy.health_checker is not None:
        await f.checker.wait_round()
    return f


async def test_every_hop_answers_its_health_check_and_a_worker_whether_it_reaches_a_replica(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(10):
        f = await fleet(nursery)
        w1 = f.workers["w1"]
        async with open_upstreams() as upstreams:

            async def check(address: tuple[str, int], *fields: tuple[bytes, bytes]) -> int:
                request = Request(b"GET", b"http", b"x", HEALTH_PATH)
                response = await upstreams.request(address, request, [(PROBE_HEADER, b"1"), *fields])
                await response.body.read_all()
                return response.status

            assert await check((HOST, f.proxy_port)) == 200
            assert await check(w1) == 200
            replica = (REPLICA_HEADER, b"w1-r")
            assert await check(w1, replica) == 200
            target = (TARGET_HEADER, f"h2 {HOST}:{closed_port()}".encode())
            assert await check(w1, (REPLICA_HEADER, b"elsewhere"), target) == 502
            # The moment a drain starts (what HTTPServer.drain sets first), the hop answers 503.
            assert f.proxy.server is not None
            f.proxy.server.draining = True
            assert await check((HOST, f.proxy_port)) == 503
            f.proxy.server.draining = False
        nursery.cancel_scope.cancel()


async def test_a_dead_worker_is_ejected_before_requests_find_it_and_back_within_a_check_when_it_returns(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(15):
        f = await fleet(nursery)
        w1 = f.workers["w1"]
        assert {(await f.get())[0] for _ in range(4)} == {200}
        f.worker_scopes["w1"].cancel()
        await wait_for(lambda: f.detector.out(w1, trio.current_time()), "the checker ejects the dead worker")
        # Ejected by its check: no request finds it dead, and its replica was never blamed.
        answers = [await f.get() for _ in range(6)]
        assert answers == [(200, b"w2-r")] * 6
        stats = f.detector.statistics()
        assert stats.by_replica == {} and "w1-r" not in stats.failures
        assert metric(f, "proxyblocks_outlier_next_hop_ejected", next_hop=f"{HOST}:{w1[1]}") == 1.0
        assert (metric(f, "proxyblocks_health_check_failures_total") or 0) >= 1
        # It comes back on the same port: its ejection (30 s) ends at the next check, under slow start.
        await f.start_worker("w1", port=w1[1])
        back_at = f.checker.statistics().rounds
        await wait_for(lambda: not f.detector.out(w1, trio.current_time()), "the worker is back")
        assert f.checker.statistics().rounds - back_at <= 2  # within one interval (plus the round under way)
        assert w1 in f.detector.statistics(now=trio.current_time()).ramping
        await wait_for(lambda: not f.detector.statistics(now=trio.current_time()).ramping, "a full member again")
        assert {(await f.get())[1] for _ in range(8)} == {b"w1-r", b"w2-r"}
        nursery.cancel_scope.cancel()


async def test_streams_cut_by_a_workers_death_do_not_eject_the_replicas_behind_it(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        f = await fleet(nursery, health=None, outliers=OutlierConfig(base_ejection=30.0, max_ejection=60.0))
        statuses: list[int] = []

        async def held() -> None:
            statuses.append((await f.get(b"/sleep?ms=20000"))[0])

        async with trio.open_nursery() as requests:
            for _ in range(8):
                requests.start_soon(held)
            await wait_for(lambda: sum(f.proxy.in_flight.values()) == 8)
            assert f.proxy.in_flight["w1-r"] == 4
            f.worker_scopes["w1"].cancel()
            # Each cut stream either fails (502) or, never processed (a GOAWAY's refused stream), is retried.
            await wait_for(lambda: f.proxy.in_flight["w1-r"] == 0, "the streams on the dead worker end")
            requests.cancel_scope.cancel()
        assert set(statuses) <= {502}
        stats = f.detector.statistics()
        # Four streams, one connection event, counted against the worker, never its (healthy) replica.
        assert stats.hop_events == 1 and stats.by_replica == {} and stats.failures == {}
        nursery.cancel_scope.cancel()


async def test_an_ejected_replica_that_answers_again_is_back_within_a_check(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        f = await fleet(nursery)
        port = f.replicas["w1-r"][1]
        f.replica_scopes["w1-r"].cancel()
        # Requests find it unreachable (the worker says so): ejected for 30 s, the request retried elsewhere.
        while not f.detector.statistics(now=trio.current_time()).ejected:
            assert await f.get() == (200, b"w2-r")
        assert f.detector.statistics().ejected.keys() == {"w1-r"}
        assert f.detector.statistics().hops == {}  # its worker is fine
        await f.start_replica("w1-r", port=port)
        back_at = f.checker.statistics().rounds
        await wait_for(lambda: not f.detector.statistics(now=trio.current_time()).ejected, "the replica is back")
        assert f.checker.statistics().rounds - back_at <= 2
        assert "w1-r" in f.detector.statistics(now=trio.current_time()).ramping
        share = metric(f, "proxyblocks_outlier_slow_start_share", member="w1-r")
        assert share is not None and 0 < share < 1
        nursery.cancel_scope.cancel()


async def test_with_a_prober_its_load_polls_are_the_workers_checks(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        f = await fleet(nursery, prober=ProberConfig(interval=0.2, timeout=0.2, stale_after=1.0))
        assert f.checker.polled
        w2 = f.workers["w2"]
        f.worker_scopes["w2"].cancel()
        await wait_for(lambda: f.detector.out(w2, trio.current_time()), "the prober's failed poll ejects it")
        assert f.checker.statistics().checks == 0  # no second poller
        assert f.checker.statistics().last[w2] is None
        nursery.cancel_scope.cancel()
