"""The fair scheduler end to end: the proxy's admission, seen from real clients.

The core and the trio driver have unit tests (``test_scheduler.py``); these
check what a client and a replica see through edge -> proxy (scheduler) ->
worker -> replica: a flooding tenant held to its share and refused with 429
or 503, weighted shares, slots released on every path, the fast path kept.
The replica is a :class:`support.TenantReplica`, which counts each tenant's
requests in flight where it matters: at the replica.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``,
real clients and servers. Nothing here asserts on wall-clock speed (latency
figures belong in ``bench/fairness.py``); waits are polls bounded by
:func:`support.wait_for`, so a leaked slot fails a test, with the
scheduler's statistics in the message, instead of hanging it.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import attrs
import httpx
import trio
from support import (
    HOST,
    RawH2Client,
    TenantReplica,
    assemble_fair,
    closed_port,
    record_relays,
    route_apps,
    serve_tenant_replica,
    wait_for,
)

import recipes.noisy_neighbour
from blocks import Chain, LocalReplica, SchedulerConfig, TenantPolicy, UpstreamConfig, serve_chain
from blocks.scheduler import Scheduler, SchedulerStatistics
from recipes.chain import main as chain_main

SMALL = SchedulerConfig(
    budget=8,
    default_policy=TenantPolicy(max_in_flight=4, max_queued=4, queue_timeout=0.5),
)
"""8 slots, at most 4 to a tenant, 4 more may wait half a second."""


def h2_client(**kwargs: Any) -> httpx.AsyncClient:
    """A prior-knowledge h2 client (h2c), ignoring proxies from the environment."""
    return httpx.AsyncClient(http2=True, http1=False, trust_env=False, timeout=20, **kwargs)


def scheduler_of(chain: Chain | Chain) -> Scheduler:
    scheduler = chain.proxy.scheduler
    assert scheduler is not None, "this chain's proxy runs without a scheduler"
    return scheduler


async def settled(chain: Chain | Chain) -> SchedulerStatistics:
    """The scheduler's statistics once every slot is back and nobody waits.

    The client has its responses by then, but the proxy releases a slot when
    its side of the exchange closes, a moment later: wait for it (a leaked
    slot fails here, with the statistics).
    """
    scheduler = scheduler_of(chain)
    await wait_for(
        lambda: scheduler.statistics().in_flight == 0 and scheduler.statistics().queued == 0,
        lambda: f"every slot back and nobody queued: {scheduler.statistics()}",
    )
    return scheduler.statistics()


async def reset(client: RawH2Client, sid: int) -> None:
    """Give up on a stream the way a browser does: RST_STREAM (CANCEL)."""
    client.conn.reset_stream(sid, error_code=0x8)
    await client.flush()


@attrs.define
class Outcome:
    """What one client request got."""

    status: int
    retry_after: str | None


async def fetch(
    client: httpx.AsyncClient, url: str, tenant: str, results: list[Outcome], host: str | None = None
) -> None:
    """GET ``url`` as ``tenant`` (with ``host`` as the authority, if given); append what came back."""
    headers = {"x-tenant": tenant}
    if host is not None:
        headers["host"] = host
    response = await client.get(url, headers=headers)
    results.append(Outcome(response.status_code, response.headers.get("retry-after")))


async def flood_and_trickle(url: str) -> tuple[list[Outcome], list[Outcome]]:
    """Tenant ``a`` opens 30 concurrent 300 ms requests; ``b`` sends 10 short ones spread over the same time."""
    flood: list[Outcome] = []
    trickle: list[Outcome] = []
    async with h2_client() as a, h2_client() as b, trio.open_nursery() as nursery:
        for _ in range(30):
            nursery.start_soon(fetch, a, url + "/sleep?ms=300", "a", flood)
        for _ in range(10):
            nursery.start_soon(fetch, b, url + "/sleep?ms=20", "b", trickle)
            await trio.sleep(0.05)
    return flood, trickle


async def warm_up(chain: Chain) -> None:
    """One request, so the pools are open before the traffic that matters."""
    async with h2_client() as client:
        response = await client.get(chain.url + "/", headers={"x-tenant": "warm-up"})
        assert response.status_code == 200


# -- 1. a flood is held to its share ---------------------------------------------------------------


async def test_a_flooding_tenant_is_held_to_its_share_and_refused_the_rest(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        replica, _, local = await serve_tenant_replica(nursery)
        chain = await assemble_fair(nursery, {"replica-0": local}, scheduler=SMALL)
        await warm_up(chain)
        flood, trickle = await flood_and_trickle(chain.url)

        # Nothing lost: every request got a status.
        assert len(flood) == 30
        assert len(trickle) == 10
        # The quiet tenant was never refused.
        assert [o.status for o in trickle] == [200] * 10
        statuses = collections.Counter(o.status for o in flood)
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses[200] > 0, statuses
        assert statuses[429] + statuses[503] > 0, statuses
        for outcome in flood:
            if outcome.status in (429, 503):
                assert outcome.retry_after is not None, outcome
                assert outcome.retry_after.isdigit() and int(outcome.retry_after) > 0, outcome
        # The flood filled its share at the replica and never went past it.
        assert replica.peak["a"] == 4
        assert replica.peak["b"] <= 4

        stats = await settled(chain)
    a, b = stats.tenants["a"], stats.tenants["b"]
    assert (a.granted, a.rejected_full, a.rejected_deadline) == (statuses[200], statuses[429], statuses[503])
    assert (b.granted, b.rejected_full, b.rejected_deadline) == (10, 0, 0)
    assert (a.in_flight, a.queued, b.in_flight, b.queued) == (0, 0, 0, 0)
    assert replica.total_in_flight == 0
    assert chain.proxy.statistics().in_flight == {"replica-0": 0}
    assert chain.worker.statistics().in_flight == {"replica-0": 0}


# -- 2. weighted shares ----------------------------------------------------------------------------


async def test_weighted_tenants_share_the_slots_three_to_one(nursery: trio.Nursery) -> None:
    config = SchedulerConfig(
        budget=2,
        tenants={
            "gold": TenantPolicy(weight=3, max_queued=100, queue_timeout=10),
            "bronze": TenantPolicy(weight=1, max_queued=100, queue_timeout=10),
        },
    )
    skip, window = 10, 60
    with trio.fail_after(60):
        replica, _, local = await serve_tenant_replica(nursery)
        chain = await assemble_fair(nursery, {"replica-0": local}, scheduler=config)
        await warm_up(chain)
        replica.arrivals.clear()
        statuses: collections.Counter[int] = collections.Counter()

        async def keep_sending(client: httpx.AsyncClient, tenant: str) -> None:
            # Each of these keeps one request outstanding until the window is full,
            # so both tenants stay backlogged (2 slots, 20 requests each) throughout.
            while len(replica.arrivals) < skip + window:
                response = await client.get(chain.url + "/sleep?ms=10", headers={"x-tenant": tenant})
                statuses[response.status_code] += 1

        async with h2_client() as gold, h2_client() as bronze, trio.open_nursery() as clients:
            for _ in range(20):
                clients.start_soon(keep_sending, gold, "gold")
                clients.start_soon(keep_sending, bronze, "bronze")

        assert set(statuses) == {200}, statuses
        seen = collections.Counter(replica.arrivals[skip : skip + window])
        assert seen["gold"] + seen["bronze"] == window
        assert 2 <= seen["gold"] / seen["bronze"] <= 4, seen
        assert replica.peak["gold"] <= 2 and replica.peak["bronze"] <= 2
        stats = await settled(chain)
    for tenant in ("gold", "bronze"):
        assert stats.tenants[tenant].rejected_full == stats.tenants[tenant].rejected_deadline == 0


# -- 3. slots are released on every path -----------------------------------------------------------


async def assemble_every_path(nursery: trio.Nursery, scheduler: SchedulerConfig) -> tuple[Chain, TenantReplica]:
    """A chain whose routes end every way.

    ``*`` -> the replica; ``dead.test`` -> a closed port (502); ``empty.test``
    -> an app without replicas (503); ``slow.test`` -> the same replica through
    a second worker that gives up after 0.5 s (504). The proxy waits 10 s.
    """
    replica, _, local = await serve_tenant_replica(nursery)
    dead = LocalReplica((HOST, closed_port()))

    async def build(chain: Chain) -> None:
        await chain.start_worker({"replica-0": local, "dead-0": dead}, app=None)
        await chain.start_worker(
            {"slow-0": local},
            app="slow",
            domains=["slow.test"],
            name="slow-worker",
            upstream=UpstreamConfig(response_timeout=0.5),
        )
        route_apps(
            chain,
            {"replica-0": local, "dead-0": dead},
            "app",
            {"*": "app", "dead.test": "dead", "empty.test": "empty"},
            {"app": ["replica-0"], "dead": ["dead-0"], "empty": []},
        )
        await chain.start_proxy(scheduler=scheduler, upstream=UpstreamConfig(response_timeout=10))
        await chain.start_edge()

    chain: Chain = await nursery.start(serve_chain, build)
    return chain, replica


async def cancellable_get(scope: trio.CancelScope, url: str, tenant: str) -> None:
    """GET inside ``scope`` on a client of its own (a cancelled request may take its connection down)."""
    async with h2_client() as client:
        with scope:
            await client.get(url, headers={"x-tenant": tenant})
    assert scope.cancelled_caught


async def test_slots_are_released_on_every_path(nursery: trio.Nursery) -> None:
    config = SchedulerConfig(budget=2, default_policy=TenantPolicy(max_queued=100, queue_timeout=10))
    with trio.fail_after(60):
        chain, replica = await assemble_every_path(nursery, config)
        scheduler = scheduler_of(chain)
        url = chain.url

        def stats() -> str:
            return f"{scheduler.statistics()}; at the replica {dict(replica.in_flight)}"

        def in_flight() -> int:
            return scheduler.statistics().in_flight

        def queued() -> int:
            return scheduler.statistics().queued

        await warm_up(chain)
        async with h2_client() as client, trio.open_nursery() as background:
            held: list[Outcome] = []

            async def fill_the_budget() -> None:
                """Two /hold requests take both slots, at the replica, until :func:`free_the_budget`."""
                before = len(held)
                for _ in range(2):
                    background.start_soon(fetch, client, url + "/hold", "holder", held)
                await wait_for(
                    lambda: replica.in_flight["holder"] == 2, lambda: f"two holders at the replica: {stats()}"
                )
                assert (in_flight(), queued(), len(held)) == (2, 0, before)

            async def free_the_budget() -> None:
                expected = len(held) + 2
                replica.release()
                await wait_for(lambda: len(held) == expected, stats)

            async def at_once_and_queued(tenant: str, status: int, host: str, path: str = "/") -> None:
                """A request admitted at once, then one that first waits for a slot: both end with ``status``."""
                results: list[Outcome] = []
                await fetch(client, url + path, tenant, results, host)
                await fill_the_budget()
                background.start_soon(fetch, client, url + path, tenant + "-queued", results, host)
                await wait_for(lambda: queued() == 1, stats)
                await free_the_budget()
                await wait_for(lambda: len(results) == 2, stats)
                assert [o.status for o in results] == [status, status], (tenant, results)

            # (a) Cancelled by the client while queued: RST_STREAM from a raw h2 client...
            await fill_the_budget()
            async with RawH2Client.open(chain.port) as raw:
                sid = await raw.start(raw.head(b"GET", b"/", (b"x-tenant", b"queued-raw")))
                await wait_for(lambda: queued() == 1, stats)
                await reset(raw, sid)
                await wait_for(lambda: queued() == 0, stats)
            # ... and an httpx request whose cancel scope is cancelled.
            scope = trio.CancelScope()
            background.start_soon(cancellable_get, scope, url + "/", "queued-httpx")
            await wait_for(lambda: queued() == 1, stats)
            scope.cancel()
            await wait_for(lambda: queued() == 0, stats)
            assert in_flight() == 2  # the holders' slots, nothing else
            await free_the_budget()
            assert "queued-raw" not in replica.arrivals
            assert "queued-httpx" not in replica.arrivals

            # (b) Cancelled while in flight at the replica: admitted at once (the fast path)...
            async with RawH2Client.open(chain.port) as raw:
                sid = await raw.start(raw.head(b"GET", b"/hold", (b"x-tenant", b"in-flight-fast")))
                await wait_for(lambda: replica.in_flight["in-flight-fast"] == 1, stats)
                await reset(raw, sid)
                await wait_for(lambda: in_flight() == 0, stats)
            # ... and after a wait in the queue (the handler path).
            await fill_the_budget()
            async with RawH2Client.open(chain.port) as raw:
                sid = await raw.start(raw.head(b"GET", b"/hold", (b"x-tenant", b"in-flight-queued")))
                await wait_for(lambda: queued() == 1, stats)
                await free_the_budget()
                await wait_for(lambda: replica.in_flight["in-flight-queued"] == 1, stats)
                await reset(raw, sid)
                await wait_for(lambda: in_flight() == 0, stats)
            await wait_for(lambda: replica.total_in_flight == 0, stats)

            # (c) 502: the replica is down; 503: the app has no replica.
            await at_once_and_queued("down", 502, "dead.test")
            await at_once_and_queued("no-route", 503, "empty.test")
            # (d) 504: the slow worker gives up on a replica that holds the request.
            await at_once_and_queued("timeout", 504, "slow.test", "/hold")
            replica.release()  # the holds the slow worker gave up on, if the replica still has them

            snapshot = await settled(chain)
            for name, tenant in snapshot.tenants.items():
                assert (tenant.in_flight, tenant.queued) == (0, 0), name
            assert chain.proxy.statistics().in_flight == {"replica-0": 0, "dead-0": 0, "slow-0": 0}

            # No slot leaked: two new requests are at the replica at once (the budget is 2).
            final: list[Outcome] = []
            for _ in range(2):
                background.start_soon(fetch, client, url + "/hold", "final", final)
            await wait_for(lambda: replica.in_flight["final"] == 2, lambda: f"two requests at once: {stats()}")
            replica.release()
            await wait_for(lambda: len(final) == 2, stats)
        assert [o.status for o in final] == [200, 200]
        assert [o.status for o in held] == [200] * 10
        await settled(chain)


# -- 4. without a scheduler, nothing is refused ----------------------------------------------------


async def test_without_a_scheduler_the_same_flood_is_never_refused(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        replica, _, local = await serve_tenant_replica(nursery)
        chain = await assemble_fair(nursery, {"replica-0": local}, scheduler=None)
        assert chain.proxy.scheduler is None
        await warm_up(chain)
        flood, trickle = await flood_and_trickle(chain.url)
    assert [o.status for o in flood] == [200] * 30
    assert [o.status for o in trickle] == [200] * 10
    # Nothing held the flood to 4: the refusals of the test above are the scheduler's.
    assert replica.peak["a"] > 4


async def test_the_chain_recipe_without_a_scheduler_never_refuses(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        chain: Chain = await nursery.start(functools.partial(chain_main, replicas=1, scheduler=None))
        assert chain.proxy.scheduler is None
        flood, trickle = await flood_and_trickle(chain.url)
        await chain.shutdown(1.0)
    assert [o.status for o in flood] == [200] * 30
    assert [o.status for o in trickle] == [200] * 10


# -- 5. the fast path stays ------------------------------------------------------------------------


async def test_admission_keeps_the_fast_path_while_a_slot_is_free(nursery: trio.Nursery) -> None:
    config = SchedulerConfig(budget=2, default_policy=TenantPolicy(max_queued=10, queue_timeout=10))
    with trio.fail_after(20):
        replica, _, local = await serve_tenant_replica(nursery)
        chain = await assemble_fair(nursery, {"replica-0": local}, scheduler=config)
        relays = record_relays(chain.proxy_server)
        async with RawH2Client.open(chain.port) as client:
            for _ in range(6):
                result = await client.request(client.head(b"GET", b"/", (b"x-tenant", b"solo")))
                assert result.status == 200
            # The first request opened the proxy's pool (the handler path); every later one was spliced.
            assert relays.outcomes == [False] + [True] * 5

            # With both slots taken the next request is not spliced: it waits its turn in the handler.
            holds = [await client.start(client.head(b"GET", b"/hold", (b"x-tenant", b"holder"))) for _ in range(2)]
            await wait_for(lambda: replica.in_flight["holder"] == 2)
            waiting = await client.start(client.head(b"GET", b"/", (b"x-tenant", b"solo")))
            await wait_for(lambda: scheduler_of(chain).statistics().queued == 1)
            assert relays.outcomes[-3:] == [True, True, False]
            replica.release()
            for sid in (*holds, waiting):
                assert (await client.collect(sid)).status == 200
        stats = await settled(chain)
    assert stats.tenants["solo"].granted == 7
    assert stats.tenants["holder"].granted == 2


# -- 6. the noisy-neighbour recipe -----------------------------------------------------------------


async def test_noisy_neighbour_recipe_refuses_the_flood_and_serves_the_quiet_tenant() -> None:
    # The recipe's SCHEDULER holds up to max_in_flight + max_queued of one tenant's requests, so
    # only a flood larger than that is sure to be refused (429) whatever the machine's speed; a flood that fits
    # within its queue may all be served before the queue timeout (then noisy sees only 200s).
    policy = recipes.noisy_neighbour.SCHEDULER.default_policy
    assert policy.max_in_flight is not None
    flood = policy.max_in_flight + policy.max_queued + 40
    with trio.fail_after(30):
        noisy, quiet = await recipes.noisy_neighbour.main(seconds=3, flood_concurrency=flood, rate=10, report=None)
    assert sum(quiet.statuses.values()) > 0
    assert set(quiet.statuses) == {200}, quiet.statuses
    assert noisy.statuses[200] > 0, noisy.statuses
    assert noisy.statuses[429] + noisy.statuses[503] > 0, noisy.statuses
    assert set(noisy.statuses) <= {200, 429, 503}, noisy.statuses
