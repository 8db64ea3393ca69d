"""The autoscaler's driver: real replica processes, in the routes only while healthy, drained and replaced.

Rules: loopback only, port 0 (the driver picks each replica's port free),
every test bounded by ``trio.fail_after``. Replicas are real processes
(``python -m blocks.testing.replica``); a test waits for the state it
asserts (a record in the store, a process gone), never for a duration. The
sans-IO policy is tested in tests/test_autoscaler_core.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx
import hyperframe.frame
import pytest
import trio

from blocks import (
    Chain,
    ColdStartConfig,
    EmbeddedStore,
    Keyring,
    ProxyConfig,
    SessionConfig,
    TokenIssuer,
    TokenKey,
    TokenVerifier,
    WorkerSessionConfig,
    open_chain,
)
from blocks.autoscaler import (
    AutoscalePolicy,
    Autoscaler,
    ColdStartGate,
    DriverConfig,
    ReplicaTemplate,
    ScalingConfig,
    open_autoscaler,
)
from blocks.errors import SourceUnavailable
from blocks.store import route_key_for_replica
from tests.support import RawFrames, gated, start_gets

APP = "demo"
ROOT = Path(__file__).resolve().parent.parent
DEMO = f"{sys.executable} -m blocks.testing.replica --port {{port}} --name {{name}}"
SLOW = (  # the demo replica, listening only after a second
    f'{sys.executable} -c "import sys, time, runpy; time.sleep(1.0); '
    f"sys.argv = ['replica', '--port', '{{port}}', '--name', '{{name}}']; "
    f"runpy.run_module('blocks.testing.replica', run_name='__main__')\""
)
FAST = DriverConfig(interval=0.1, health_interval=0.05, settle=0.2, drain_timeout=20, stop_timeout=5)
NOWHERE = ("127.0.0.1", 1)  # a worker nobody answers at: the prober's polls fail, the replicas run anyway
LONE = attrs.evolve(FAST, drain_timeout=1, stop_timeout=2)  # (with NOWHERE, a drain lasts its whole timeout)


async def until(predicate: Callable[[], object]) -> None:
    """Wait for a state (bounded by the test's ``fail_after``): checked every 10 ms."""
    while not predicate():
        await trio.sleep(0.01)


def record(chain: Chain, name: str) -> dict[str, object] | None:
    value = chain.store.get(route_key_for_replica(APP, name))
    return None if value is None else dict(json.loads(value))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@asynccontextmanager
async def scaled(
    config: ScalingConfig, template: ReplicaTemplate | None = None, driver: DriverConfig = FAST
) -> AsyncIterator[tuple[Chain, Autoscaler]]:
    """A chain (bare worker, proxy, edge) with ``APP`` scaled by an autoscaler writing its store."""
    async with open_chain() as chain:
        worker_server, _ = await chain.start_worker({}, app=None)
        policy = AutoscalePolicy({APP: config})
        template = template or ReplicaTemplate(command=DEMO, protocol="h2", domains=("*",))
        async with open_autoscaler(
            policy, {APP: template}, chain.store, worker=(chain.host, worker_server.port), config=driver
        ) as scaler:
            await chain.start_proxy(features=[ColdStartGate(scaler, chain.cache)])
            await chain.start_edge()
            yield chain, scaler
        chain.cancel()


def test_a_template_says_what_is_wrong_with_its_command() -> None:
    with pytest.raises(ValueError, match=r"no \{port\}"):
        ReplicaTemplate(command="python -m http.server")
    with pytest.raises(ValueError, match=r"unknown field \{pot\}"):
        ReplicaTemplate(command="python -m http.server {pot}")
    with pytest.raises(ValueError, match="No closing quotation"):
        ReplicaTemplate(command="python -c 'x {port}")
    with pytest.raises(ValueError, match="health_path"):
        ReplicaTemplate(command="x {port}", health_path="healthz")
    argv = ReplicaTemplate(command="python -m http.server {port} --bind {host}").argv(app="a", name="a-0", port=81)
    assert argv == ["python", "-m", "http.server", "81", "--bind", "127.0.0.1"]


async def test_open_autoscaler_needs_a_template_per_app() -> None:
    policy = AutoscalePolicy({APP: ScalingConfig(target_concurrency=1)})
    with pytest.raises(ValueError, match="no replica template for app 'demo'"):
        async with open_autoscaler(policy, {}, EmbeddedStore(), worker=("127.0.0.1", 1)):
            pass


async def test_min_replicas_start_enter_the_routes_when_healthy_and_serve() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=2)) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].ready == 2)
            assert record(chain, "demo-0") is not None and record(chain, "demo-1") is not None
            assert record(chain, "demo-0")["state"] == "live"  # type: ignore[index]
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                seen = {(await client.get("/")).headers["x-replica"] for _ in range(20)}
            assert seen == {"demo-0", "demo-1"}  # real processes, named by the template
            pids = list(scaler.statistics().processes.values())
            assert len(pids) == 2 and all(alive(pid) for pid in pids)
        assert not any(alive(pid) for pid in pids)  # the block stops every process it started
        assert [key for key in chain.store.items() if key.startswith("apps/")] == []


async def test_a_replica_is_not_routed_before_it_answers_its_health_request() -> None:
    """A command that listens only after a while: its record appears only once it answers."""
    template = ReplicaTemplate(command=SLOW, protocol="h2", domains=("*",))
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1), template) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].starting == 1)
            assert record(chain, "demo-0") is None
            await until(lambda: record(chain, "demo-0") is not None)
            await until(lambda: scaler.statistics().apps[APP].ready == 1)  # (told once its record is in)


async def test_a_replica_that_dies_leaves_the_routes_and_is_replaced() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1)) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            pid = scaler.statistics().processes["demo-0"]
            os.kill(pid, 9)
            await until(lambda: record(chain, "demo-0") is None)
            await until(lambda: record(chain, "demo-1") is not None)
            stats = scaler.statistics().apps[APP]
            assert (stats.ready, stats.restarts, stats.starts) == (1, 1, 2)
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                response = await client.get("/")
            assert (response.status_code, response.headers["x-replica"]) == (200, "demo-1")


async def test_a_drained_replica_finishes_its_stream_while_new_requests_go_elsewhere() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1)) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            pid = scaler.statistics().processes["demo-0"]
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:
                async with client.stream("GET", "/stream?n=30&ms=100") as stream:  # 3 s of chunks
                    assert stream.headers["x-replica"] == "demo-0"
                    await until(lambda: scaler.estimator.estimate("demo-0") == 1)  # the prober sees it
                    scaler.drain("demo-0")
                    await until(lambda: (record(chain, "demo-0") or {}).get("state") == "draining")
                    await until(lambda: record(chain, "demo-1") is not None)  # the replacement
                    other = await client.get("/")
                    assert (other.status_code, other.headers["x-replica"]) == (200, "demo-1")
                    assert alive(pid)  # still finishing the stream
                    body = b"".join([chunk async for chunk in stream.aiter_bytes()])
                assert body.count(b"\n") == 30  # every chunk, though its replica was draining
                await until(lambda: not alive(pid))
                await until(lambda: record(chain, "demo-0") is None)
            assert scaler.statistics().apps[APP].restarts == 0


async def test_a_command_that_never_becomes_healthy_is_backed_off_never_routed() -> None:
    broken = ReplicaTemplate(command=f"{sys.executable} -c 'import sys; sys.exit(3)' {{port}}", domains=("*",))
    driver = DriverConfig(interval=0.1, cold_start_timeout=30)
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1), broken, driver) as (chain, scaler):
            # each failed start in a row doubles the wait before the next one, and no start comes early
            for k in range(1, 5):
                await until(lambda k=k: scaler.statistics().apps[APP].failed_starts == k)  # type: ignore[misc]
                stats = scaler.statistics().apps[APP]
                assert stats.backoff == pytest.approx(0.1 * 2 ** (k - 1))
                assert stats.next_start > trio.current_time() - 0.05
                held_until, starts = stats.next_start, stats.starts
                await until(lambda s=starts: scaler.statistics().apps[APP].starts > s)  # type: ignore[misc]
                assert trio.current_time() >= held_until
            assert [key for key in chain.store.items() if key.startswith("apps/")] == []
            # a request while the start is backed off: a 503 that says why at once, not at the 30 s timeout
            await until(lambda: scaler.statistics().apps[APP].next_start > trio.current_time() + 0.3)
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                with trio.fail_after(5):
                    response = await client.get("/")
            assert (response.status_code, response.headers["proxyblocks-error"]) == (
                503,
                "cold_start_failed; hop=proxy",
            )
            assert int(response.headers["retry-after"]) >= 1
    missing = ReplicaTemplate(command="/nonexistent/replica --port {port}", domains=("*",))
    with trio.fail_after(30):
        async with scaled(ScalingConfig(target_concurrency=4, min_replicas=1), missing) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].failed_starts >= 2)
            assert scaler.statistics().processes == {}


# -- scale from zero --------------------------------------------------------------------------


async def test_concurrent_requests_for_an_app_at_zero_share_one_cold_start() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=100)) as (chain, scaler):
            assert scaler.statistics().apps[APP].starting == 0  # at zero, nothing runs
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:
                answers: list[httpx.Response] = []

                async def get() -> None:
                    answers.append(await client.get("/"))

                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(get)
            assert [(r.status_code, r.headers["x-replica"]) for r in answers] == [(200, "demo-0")] * 8  # none refused
            stats = scaler.statistics().apps[APP]
            assert (stats.starts, stats.ready, stats.waiting) == (1, 1, 0)


async def test_a_cold_start_past_its_timeout_is_a_503_that_says_why_and_the_start_goes_on() -> None:
    template = ReplicaTemplate(command=SLOW, protocol="h2", domains=("*",))
    driver = DriverConfig(interval=0.1, cold_start_timeout=0.3)
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4), template, driver) as (chain, scaler):
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:
                refused = await client.get("/")
                assert refused.status_code == 503
                assert refused.headers["proxyblocks-error"] == "cold_start_timeout; hop=proxy"
                assert refused.headers["retry-after"] == "1"
                await until(lambda: scaler.statistics().apps[APP].ready == 1)  # the start went on
                again = await client.get("/")
                assert (again.status_code, again.headers["x-replica"]) == (200, "demo-0")
            assert scaler.statistics().apps[APP].starts == 1


async def test_an_app_the_autoscaler_does_not_scale_is_refused_at_once() -> None:
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4)) as (chain, scaler):
            chain.store.put("domains/other.test", b'{"app":"other"}')
            await until(lambda: chain.cache.app_for(b"other.test") == "other")
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                response = await client.get("/", headers={"host": "other.test"})
            assert (response.status_code, response.headers["proxyblocks-error"]) == (503, "no_replica; hop=proxy")
            assert scaler.statistics().apps[APP].starts == 0


async def test_a_cold_start_failure_reaches_every_waiter_at_once(tmp_path: Path) -> None:
    """A request waiting for a start that fails gets a 503 ``cold_start_failed`` when it fails, not at its timeout."""
    failing = ReplicaTemplate(
        command=f"{sys.executable} -c 'import pathlib, sys, time; "
        f'[time.sleep(0.02) for _ in iter(lambda: pathlib.Path("{tmp_path / "go"}").exists(), True)]; '
        "sys.exit(3)' {port}",
        domains=("*",),
    )
    driver = DriverConfig(interval=0.1, cold_start_timeout=30)
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4), failing, driver) as (chain, scaler):
            answers: list[httpx.Response] = []
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:

                async def get() -> None:
                    answers.append(await client.get("/"))

                async with trio.open_nursery() as nursery:
                    for _ in range(3):
                        nursery.start_soon(get)
                    await until(lambda: scaler.statistics().apps[APP].waiting == 3)
                    (tmp_path / "go").touch()  # the start fails now
                    with trio.fail_after(5):
                        await until(lambda: len(answers) == 3)
            assert [(r.status_code, r.headers["proxyblocks-error"]) for r in answers] == [
                (503, "cold_start_failed; hop=proxy")
            ] * 3
            assert scaler.statistics().apps[APP].waiting == 0


async def test_waiters_past_max_waiting_are_refused_at_once(tmp_path: Path) -> None:
    template = ReplicaTemplate(command=gated(tmp_path / "go"), protocol="h2", domains=("*",))
    driver = DriverConfig(interval=0.1, cold_start_timeout=30, max_waiting=2)
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4), template, driver) as (chain, scaler):
            answers: list[httpx.Response] = []
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:

                async def get() -> None:
                    answers.append(await client.get("/"))

                async with trio.open_nursery() as nursery:
                    for _ in range(2):
                        nursery.start_soon(get)
                    await until(lambda: scaler.statistics().apps[APP].waiting == 2)
                    refused = await client.get("/")  # the third: the queue is full
                    assert (refused.status_code, refused.headers["proxyblocks-error"]) == (
                        503,
                        "cold_start_full; hop=proxy",
                    )
                    assert refused.headers["retry-after"] == "1"
                    (tmp_path / "go").touch()
            assert [(r.status_code, r.headers["x-replica"]) for r in answers] == [(200, "demo-0")] * 2


async def test_a_waiting_request_its_client_gives_up_leaves_the_queue_and_the_start_goes_on(tmp_path: Path) -> None:
    template = ReplicaTemplate(command=gated(tmp_path / "go"), protocol="h2", domains=("*",))
    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=4), template) as (chain, scaler):
            # a bare h2 client: it resets the stream as it gives up (httpx, cancelled, sends no RST_STREAM)
            async with RawFrames.open(int(chain.url.rstrip("/").rsplit(":", 1)[1])) as raw:
                await raw.send(raw.request(1))
                await until(lambda: scaler.statistics().apps[APP].waiting == 1)
                await raw.send(hyperframe.frame.RstStreamFrame(1, error_code=8))  # CANCEL
                await until(lambda: scaler.statistics().apps[APP].waiting == 0)
            assert scaler.statistics().apps[APP].starting == 1  # the start goes on for whoever comes next
            (tmp_path / "go").touch()
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                response = await client.get("/")
            assert (response.status_code, response.headers["x-replica"]) == (200, "demo-0")
            assert scaler.statistics().apps[APP].starts == 1


class BrokenRequest(AutoscalePolicy):
    """A policy with a bug in ``request``: what a cold start's flight raises that is no 503 of its own."""

    def request(self, app: str, now: float) -> str:  # type: ignore[override]
        raise RuntimeError("a bug in the policy")


async def test_a_cold_start_flight_that_raises_is_a_503_that_says_so_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = BrokenRequest({APP: ScalingConfig(target_concurrency=4)})
    template = ReplicaTemplate(command=DEMO, protocol="h2", domains=("*",))
    with trio.fail_after(60):
        async with open_chain() as chain:
            worker_server, _ = await chain.start_worker({}, app=None)
            worker = (chain.host, worker_server.port)
            async with open_autoscaler(policy, {APP: template}, chain.store, worker=worker, config=FAST) as scaler:
                await chain.start_proxy(features=[ColdStartGate(scaler, chain.cache)])
                await chain.start_edge()
                async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                    response = await client.get("/")
            chain.cancel()
    assert (response.status_code, response.headers["proxyblocks-error"]) == (503, "cold_start_failed; hop=proxy")
    failed = [r for r in caplog.records if "the cold start failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None  # one traceback, in the log, not per request


# -- the store, and the driver's own failures --------------------------------------------------------------


def policy_of(n: int = 1, **config: object) -> AutoscalePolicy:
    return AutoscalePolicy({APP: ScalingConfig(target_concurrency=4, min_replicas=n, **config)})  # type: ignore[arg-type]


def live_name(puts: Mapping[str, bytes] | None) -> str | None:
    for key, value in (puts or {}).items():
        if key.startswith("apps/") and json.loads(value).get("state") == "live":
            return key.rsplit("/", 1)[1]
    return None


def replica_keys(store: EmbeddedStore) -> list[str]:
    return sorted(key for key in store.items() if key.startswith("apps/"))


class DrainOnLive(EmbeddedStore):
    """Drains demo-0 (an operator's drain, or a policy's) while its live write is in flight."""

    scaler: Autoscaler | None = None

    def transact(self, puts: Mapping[str, bytes] | None = None, deletes: Iterable[str] = ()) -> int:
        revision = super().transact(puts, deletes)
        if live_name(puts) == "demo-0" and self.scaler is not None:
            self.scaler.drain("demo-0")
        return revision


async def test_a_drain_during_the_live_write_goes_straight_to_draining() -> None:
    store = DrainOnLive()
    template = ReplicaTemplate(command=DEMO, protocol="h2")
    with trio.fail_after(30):
        async with open_autoscaler(policy_of(1), {APP: template}, store, worker=NOWHERE, config=LONE) as scaler:
            store.scaler = scaler
            await until(lambda: scaler.statistics().apps[APP].ready == 1)  # the replacement, demo-1
            await until(lambda: replica_keys(store) == [route_key_for_replica(APP, "demo-1")])
            await until(lambda: scaler.statistics().apps[APP].draining == 0)  # demo-0 drained and stopped
    assert replica_keys(store) == []


class CancelOnLive(EmbeddedStore):
    scope: trio.CancelScope | None = None

    def transact(self, puts: Mapping[str, bytes] | None = None, deletes: Iterable[str] = ()) -> int:
        revision = super().transact(puts, deletes)
        if live_name(puts) is not None and self.scope is not None:
            self.scope.cancel()  # the driver is stopped while the live write is in flight
        return revision


async def test_a_cancel_during_the_live_write_leaves_no_record() -> None:
    store = CancelOnLive()
    template = ReplicaTemplate(command=DEMO, protocol="h2")
    with trio.fail_after(30):
        with trio.CancelScope() as scope:
            store.scope = scope
            async with open_autoscaler(policy_of(1), {APP: template}, store, worker=NOWHERE, config=LONE):
                await trio.sleep_forever()
    assert replica_keys(store) == []


class FlakyStore(EmbeddedStore):
    """Refuses the writes a test names, as an etcd that does not answer in time."""

    refuse_states: frozenset[str] = frozenset()
    refuse_deletes = False

    def transact(self, puts: Mapping[str, bytes] | None = None, deletes: Iterable[str] = ()) -> int:
        deletes = list(deletes)
        for value in (puts or {}).values():
            if json.loads(value).get("state") in self.refuse_states:
                raise SourceUnavailable("etcd: no answer within 5s")
        if self.refuse_deletes and any(key.startswith("apps/") for key in deletes):
            raise SourceUnavailable("etcd: no answer within 5s")
        return super().transact(puts, deletes)


async def test_a_refused_draining_write_fails_one_replica_not_the_driver() -> None:
    store = FlakyStore()
    template = ReplicaTemplate(command=DEMO, protocol="h2")
    with trio.fail_after(30):
        async with open_autoscaler(policy_of(2), {APP: template}, store, worker=NOWHERE, config=LONE) as scaler:
            await until(lambda: scaler.statistics().apps[APP].ready == 2)
            pids = dict(scaler.statistics().processes)
            store.refuse_states = frozenset({"draining"})
            scaler.drain("demo-0")
            await until(lambda: route_key_for_replica(APP, "demo-0") not in store.items())  # deleted instead
            await until(lambda: scaler.statistics().apps[APP].ready == 2)  # replaced; demo-1 never stopped
            assert scaler.statistics().processes["demo-1"] == pids["demo-1"]
            await until(lambda: not alive(pids["demo-0"]))
    assert replica_keys(store) == [] and not any(alive(pid) for pid in pids.values())


async def test_a_refused_live_write_is_a_failed_start() -> None:
    store = FlakyStore()
    store.refuse_states = frozenset({"live"})
    template = ReplicaTemplate(command=DEMO, protocol="h2")
    with trio.fail_after(30):
        async with open_autoscaler(policy_of(1), {APP: template}, store, worker=NOWHERE, config=LONE) as scaler:
            await until(lambda: scaler.statistics().apps[APP].failed_starts >= 2)
            assert replica_keys(store) == []
            store.refuse_states = frozenset()
            await until(lambda: scaler.statistics().apps[APP].ready == 1)


async def test_a_refused_delete_is_retried_each_round_and_its_name_not_reused() -> None:
    store = FlakyStore()
    template = ReplicaTemplate(command=DEMO, protocol="h2")
    with trio.fail_after(30):
        async with open_autoscaler(policy_of(1), {APP: template}, store, worker=NOWHERE, config=LONE) as scaler:
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            store.refuse_deletes = True
            scaler.drain("demo-0")
            await until(lambda: scaler.statistics().pending_deletes == 1)
            await until(lambda: scaler.statistics().apps[APP].draining == 0)  # demo-0 stopped, its record stays
            assert (store.get(route_key_for_replica(APP, "demo-0")) or b"").find(b"draining") > 0
            scaler.drain("demo-1")
            await until(lambda: "demo-2" in scaler.statistics().processes)  # not demo-0: its delete is pending
            store.refuse_deletes = False
            await until(lambda: scaler.statistics().pending_deletes == 0)
            await until(lambda: route_key_for_replica(APP, "demo-0") not in store.items())
            await until(lambda: replica_keys(store) == [route_key_for_replica(APP, "demo-2")])
    assert replica_keys(store) == []


async def test_names_reuse_the_lowest_free_serial() -> None:
    store = EmbeddedStore()
    template = ReplicaTemplate(command=DEMO, protocol="h2")
    with trio.fail_after(30):
        async with open_autoscaler(policy_of(1), {APP: template}, store, worker=NOWHERE, config=LONE) as scaler:
            seen = []
            for _ in range(3):
                await until(lambda: scaler.statistics().apps[APP].ready == 1)
                await until(lambda: scaler.statistics().apps[APP].draining == 0)
                (name,) = scaler.statistics().processes
                seen.append(name)
                scaler.drain(name)
                await until(lambda n=name: n not in scaler.statistics().processes)  # type: ignore[misc]
            assert seen == ["demo-0", "demo-1", "demo-0"]  # the state kept per name stays bounded


class BrokenReady(AutoscalePolicy):
    def ready(self, app: str, name: str, now: float) -> None:
        raise RuntimeError("a bug in the policy")


async def test_a_bug_in_a_replica_task_comes_out_as_itself_not_in_a_group() -> None:
    policy = BrokenReady({APP: ScalingConfig(target_concurrency=4, min_replicas=1)})
    store = EmbeddedStore()
    with trio.fail_after(30):
        with pytest.raises(RuntimeError, match="a bug in the policy"):
            async with open_autoscaler(
                policy, {APP: ReplicaTemplate(command=DEMO, protocol="h2")}, store, worker=NOWHERE, config=LONE
            ):
                await trio.sleep_forever()
    assert replica_keys(store) == []


# -- sessions as the unit ------------------------------------------------------------------------------------


async def test_a_sessioned_app_follows_its_sessions_and_never_drains_a_replica_that_hosts_one() -> None:
    """``unit="sessions"``, two per replica: sessions opened through the chain (``POST /.proxyblocks/sessions``,
    the first one at zero) take the app up to ceil(sessions / 2) replicas; ended, it drains back to zero, the
    replicas hosting none first, whatever their age."""
    key = TokenKey.hmac("k1", bytes(range(32)))
    issuer, verifier = TokenIssuer(key), TokenVerifier(Keyring([key]))
    scaling = ScalingConfig(
        target_concurrency=2, max_replicas=5, up_window=0.3, down_window=1.0, idle_timeout=1.0, unit="sessions"
    )
    policy = AutoscalePolicy({APP: scaling})
    template = ReplicaTemplate(command=DEMO, protocol="h2", domains=("*",))
    auth = {"authorization": "Bearer " + issuer.mint(app=APP, tenant="t", now=time.time(), ttl=300)}
    hosts: dict[str, str] = {}  # token -> replica, of the sessions open now (one leaves before its DELETE is sent)
    drained_hosting: list[str] = []
    pids: set[int] = set()
    peak = 0
    with trio.fail_after(90):
        async with open_chain() as chain:
            worker_server, worker = await chain.start_worker({}, app=None, sessions=WorkerSessionConfig())
            address = (chain.host, worker_server.port)
            async with open_autoscaler(policy, {APP: template}, chain.store, worker=address, config=FAST) as scaler:
                await chain.start_proxy(
                    features=[ColdStartGate(scaler, chain.cache)],
                    sessions=SessionConfig(apps={APP}),
                    session_issuer=issuer,
                    session_verifier=verifier,
                )
                await chain.start_edge()

                def wanted() -> int:
                    return scaler.statistics().apps[APP].wanted

                async def watch() -> None:
                    nonlocal peak
                    while True:
                        replicas = policy.statistics(trio.current_time()).apps[APP].replicas
                        drained_hosting.extend(
                            name
                            for name in set(hosts.values())
                            if name not in replicas or replicas[name].phase == "draining"
                        )
                        peak = max(peak, wanted())
                        pids.update(scaler.statistics().processes.values())
                        await trio.sleep(0.005)

                async with (
                    httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client,
                    trio.open_nursery() as watching,
                ):
                    watching.start_soon(watch)

                    async def start(n: int) -> list[str]:
                        placed = []
                        for _ in range(n):
                            response = await client.post("/.proxyblocks/sessions", headers=auth)
                            assert response.status_code == 201, response.text
                            hosts[response.json()["token"]] = response.json()["replica"]
                            placed.append(response.json()["replica"])
                        client.cookies.clear()  # each request below says which session it is
                        return placed

                    async def end(replica: str) -> None:
                        for token in [t for t, r in hosts.items() if r == replica]:
                            del hosts[token]
                            response = await client.delete(
                                "/.proxyblocks/sessions", headers={"proxyblocks-session": token}
                            )
                            assert response.status_code == 204

                    def settled(n: int) -> bool:
                        stats = scaler.statistics().apps[APP]
                        return stats.ready == n == stats.wanted == len(chain.cache.replicas(APP)) and not stats.starting

                    assert await start(1) == ["demo-0"]  # at zero: the start waits for a cold start
                    assert wanted() == 1
                    assert await start(2) == ["demo-0", "demo-0"]  # 3 sessions: 2 replicas
                    await until(lambda: settled(2))
                    assert (
                        worker.load()["demo-0"].sessions == 3
                    )  # the worker counts them on a replica it reaches by route
                    assert scaler.statistics().apps[APP].sessions == 3
                    assert await start(2) == ["demo-1", "demo-1"]  # the emptiest; 5 sessions: 3 replicas
                    await until(lambda: settled(3))
                    for token, replica in hosts.items():  # every session reaches its replica, as on a listed one
                        response = await client.get("/", headers={"proxyblocks-session": token})
                        assert (response.status_code, response.headers["x-replica"]) == (200, replica)

                    # demo-0's sessions end: 2 left, on demo-1, the middle one by age. Down to 1 replica:
                    # demo-2 and demo-0 go (no session), demo-1 stays although it is newer than demo-0
                    await end("demo-0")
                    await until(lambda: settled(1))
                    await until(lambda: list(scaler.statistics().processes) == ["demo-1"])  # the others stopped
                    for token in hosts:
                        response = await client.get("/", headers={"proxyblocks-session": token})
                        assert (response.status_code, response.headers["x-replica"]) == (200, "demo-1")

                    await end("demo-1")  # none left: idle, to zero
                    await until(lambda: not scaler.statistics().processes)
                    assert wanted() == 0
                    watching.cancel_scope.cancel()
                starts = scaler.statistics().apps[APP].starts
            chain.cancel()
    assert drained_hosting == []  # never a replica hosting a session while another could go
    assert (peak, starts, len(pids)) == (3, 3, 3)
    assert not any(alive(pid) for pid in pids)
    assert [key for key in chain.store.items() if key.startswith("apps/")] == []


async def test_a_proxy_without_the_gate_reaches_the_driver_through_what_it_publishes(tmp_path: Path) -> None:
    """``ProxyConfig(cold_start=...)`` holds the requests at zero with no driver to call: what waits there
    goes into the store (as a proxy in another process would publish it), the driver reads it, starts one
    replica, and every request is served by it."""
    template = ReplicaTemplate(command=gated(tmp_path / "go"), protocol="h2", domains=("*",))
    policy = AutoscalePolicy({APP: ScalingConfig(target_concurrency=100)})
    with trio.fail_after(60):
        async with open_chain() as chain:
            worker_server, _ = await chain.start_worker({}, app=None)
            worker = (chain.host, worker_server.port)
            async with open_autoscaler(policy, {APP: template}, chain.store, worker=worker, config=FAST) as scaler:
                await chain.start_proxy(config=ProxyConfig(cold_start=ColdStartConfig()))
                await chain.start_edge()
                answers: list[httpx.Response] = []
                async with (
                    httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client,
                    trio.open_nursery() as nursery,
                ):
                    start_gets(nursery, client, 10, answers)
                    await until(lambda: scaler.statistics().apps[APP].waiting == 10)  # as published
                    assert scaler.statistics().apps[APP].starting == 1
                    (tmp_path / "go").touch()
                assert [(r.status_code, r.headers["x-replica"]) for r in answers] == [(200, "demo-0")] * 10
                await until(lambda: scaler.statistics().apps[APP].waiting == 0)
                assert scaler.statistics().apps[APP].starts == 1
            chain.cancel()


async def test_session_starts_queued_for_a_place_scale_a_sessioned_app_up() -> None:
    """Two sessions per replica, both the target and the proxy's cap: a third start finds no place and
    waits in the session queue; the proxy publishes it, the driver counts it as a session, and the
    start is granted on the replica that brings."""
    key = TokenKey.hmac("k1", bytes(range(32)))
    issuer, verifier = TokenIssuer(key), TokenVerifier(Keyring([key]))
    scaling = ScalingConfig(target_concurrency=2, up_window=0.3, down_window=60, idle_timeout=60, unit="sessions")
    policy = AutoscalePolicy({APP: scaling})
    template = ReplicaTemplate(command=DEMO, protocol="h2", domains=("*",))
    auth = {"authorization": "Bearer " + issuer.mint(app=APP, tenant="t", now=time.time(), ttl=300)}
    with trio.fail_after(60):
        async with open_chain() as chain:
            worker_server, _ = await chain.start_worker({}, app=None, sessions=WorkerSessionConfig())
            address = (chain.host, worker_server.port)
            async with open_autoscaler(policy, {APP: template}, chain.store, worker=address, config=FAST) as scaler:
                await chain.start_proxy(
                    features=[ColdStartGate(scaler, chain.cache)],
                    sessions=SessionConfig(apps={APP}, max_per_replica=2, queue_timeout=30),
                    session_issuer=issuer,
                    session_verifier=verifier,
                )
                await chain.start_edge()
                async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client:

                    async def start() -> str:
                        response = await client.post("/.proxyblocks/sessions", headers=auth)
                        assert response.status_code == 201, response.text
                        return str(response.json()["replica"])

                    assert [await start(), await start()] == ["demo-0", "demo-0"]
                    await until(lambda: scaler.statistics().apps[APP].sessions == 2)
                    assert scaler.statistics().apps[APP].wanted == 1  # at the target: no more
                    placed: list[str] = []
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(lambda: _append(placed, start()))
                        await until(lambda: scaler.statistics().apps[APP].queued == 1)  # as the proxy publishes it
                    assert placed == ["demo-1"]
                # the start left the queue; three sessions, on two replicas, and no other started
                await until(lambda: (lambda s: (s.queued, s.sessions))(scaler.statistics().apps[APP]) == (0, 3))
                stats = scaler.statistics().apps[APP]
                assert (stats.starts, stats.ready, stats.wanted) == (2, 2, 2)
            chain.cancel()


async def _append(into: list[str], value: Awaitable[str]) -> None:
    into.append(await value)


async def test_a_sessioned_app_whose_worker_keeps_no_sessions_is_warned_of_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "scale by sessions, but their worker keeps none" in r.getMessage()]

    with trio.fail_after(60):
        async with scaled(ScalingConfig(target_concurrency=2, min_replicas=1, unit="sessions")) as (chain, scaler):
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False) as client:
                assert (await client.get("/")).status_code == 200  # the worker reports demo-0 now: no sessions
            await until(warnings)
            for _ in range(3):
                await scaler._wait_round()  # (more reports, no more warnings)
    assert len(warnings()) == 1


async def test_on_entry_the_records_a_killed_driver_left_are_deleted_and_no_others() -> None:
    store = EmbeddedStore()
    stale = {
        route_key_for_replica(APP, "demo-7"): b'{"worker":"127.0.0.1:1","address":"127.0.0.1:9","state":"live"}',
        route_key_for_replica(APP, "static-1"): b'{"worker":"127.0.0.1:1","address":"127.0.0.1:9","state":"live"}',
        route_key_for_replica("other", "other-0"): b'{"worker":"127.0.0.1:1","address":"127.0.0.1:9"}',
    }
    store.transact(stale)
    template = ReplicaTemplate(command=DEMO, protocol="h2")
    with trio.fail_after(30):
        async with open_autoscaler(policy_of(0), {APP: template}, store, worker=NOWHERE, config=LONE):
            assert replica_keys(store) == [
                route_key_for_replica(APP, "static-1"),  # not a name the driver gives
                route_key_for_replica("other", "other-0"),  # not its app
            ]


# -- processes ----------------------------------------------------------------------------------------------


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


async def test_a_wrapper_scripts_children_are_stopped_with_it() -> None:
    """``sh -c 'server; exit 0'``: the server is the shell's child, in the replica's process group."""
    command = f"sh -c '{sys.executable} -m blocks.testing.replica --port {{port}} --name {{name}}; exit 0'"
    store = EmbeddedStore()
    with trio.fail_after(30):
        template = ReplicaTemplate(command=command, protocol="h2")
        async with open_autoscaler(policy_of(1), {APP: template}, store, worker=NOWHERE, config=LONE) as scaler:
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            pid = scaler.statistics().processes["demo-0"]
            address = json.loads(store.get(route_key_for_replica(APP, "demo-0")) or b"{}")["address"]
            assert listening(address)
    try:
        assert not listening(address), "the wrapper's child still listens after open_autoscaler returned"
    finally:
        try:
            os.killpg(pid, signal.SIGKILL)  # (whatever is left, if the test failed)
        except ProcessLookupError:
            pass


class DeleteSeesTerm(EmbeddedStore):
    """Notes, at each delete of a replica record, whether the replica had been sent SIGTERM yet."""

    marker: Path | None = None
    seen: list[bool]

    def transact(self, puts: Mapping[str, bytes] | None = None, deletes: Iterable[str] = ()) -> int:
        deletes = list(deletes)
        if self.marker is not None and any(key.startswith("apps/") for key in deletes):
            self.seen.append(self.marker.exists())
        return super().transact(puts, deletes)


async def test_on_exit_a_ready_replica_leaves_the_routes_before_it_is_signalled(tmp_path: Path) -> None:
    marker = tmp_path / "term"
    command = (
        f'sh -c \'trap "touch {marker}; exit 0" TERM; '
        f"{sys.executable} -m blocks.testing.replica --port {{port}} --name {{name}} & wait'"
    )
    store = DeleteSeesTerm()
    store.seen = []
    with trio.fail_after(30):
        template = ReplicaTemplate(command=command, protocol="h2")
        async with open_autoscaler(policy_of(1), {APP: template}, store, worker=NOWHERE, config=LONE) as scaler:
            await until(lambda: scaler.statistics().apps[APP].ready == 1)
            store.marker = marker
    assert store.seen == [False]  # the record went first
    assert marker.exists()  # then the SIGTERM


DRIVER = textwrap.dedent(
    """
    import sys, trio
    from blocks import EmbeddedStore
    from blocks.autoscaler import AutoscalePolicy, DriverConfig, ReplicaTemplate, ScalingConfig, open_autoscaler

    async def main():
        policy = AutoscalePolicy({"demo": ScalingConfig(target_concurrency=4, min_replicas=1)})
        template = ReplicaTemplate(command=sys.argv[1], protocol="h2")
        config = DriverConfig(interval=0.1)
        store, worker = EmbeddedStore(), ("127.0.0.1", 1)
        async with open_autoscaler(policy, {"demo": template}, store, worker=worker, config=config) as scaler:
            while not scaler.statistics().apps["demo"].ready:
                await trio.sleep(0.02)
            print(scaler.statistics().processes["demo-0"], flush=True)
            await trio.sleep_forever()

    trio.run(main)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
async def test_a_sigkilled_driver_takes_its_replicas_with_it() -> None:
    with trio.fail_after(60):
        driver = await trio.lowlevel.open_process(
            [sys.executable, "-c", DRIVER, DEMO], stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        try:
            assert driver.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                line += await driver.stdout.receive_some(64)
            pid = int(line)
            assert alive(pid)
            driver.kill()  # SIGKILL: no finally runs in the driver
            await driver.wait()
            await until(lambda: not alive(pid))  # the kernel killed the replica
        finally:
            if driver.returncode is None:
                driver.kill()
                await driver.wait()
