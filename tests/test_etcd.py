"""The etcd route source against a real etcd (tests/etcd_server.py), and routectl against it.

Rules: loopback only; each test gets its own etcd on free ports with a
temporary data dir, killed by PID at the end; kills are SIGKILL; every test
is bounded by ``trio.fail_after``. A missing etcd binary fails, never skips.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import trio

from blocks import LocalReplica, serve_proxy, serve_worker
from blocks.routing import (
    RouteEvent,
    encode_domain,
    encode_replica,
    route_key_for_domain,
    route_key_for_replica,
)
from blocks.sources import (
    Compacted,
    EtcdSource,
    Progress,
    ReconcileConfig,
    SourceUnavailable,
    open_route_cache,
)
from recipes.fleet import Fleet, ProxyProcess
from recipes.fleet import main as fleet_main
from tests.etcd_server import PROGRESS_INTERVAL, EtcdServer, open_etcd
from tests.support import HOST, RecordingCache, curl, serve_tenant_replica

RETRY = ReconcileConfig(min_backoff=0.05, max_backoff=0.5)


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    with trio.fail_after(60):
        async with open_etcd(tmp_path) as server:
            yield server


def etcd_source(etcd: EtcdServer, **kwargs: Any) -> EtcdSource:
    """A source told the test etcd's progress interval: silent for 4 of them is dead."""
    return EtcdSource(etcd.url, progress_interval=PROGRESS_INTERVAL, missed_progress=4, **kwargs)


async def wait_until(predicate: Callable[[], bool], step: float = 0.02) -> None:
    while not predicate():
        await trio.sleep(step)


def replica(port: int) -> bytes:
    return encode_replica(worker="127.0.0.1:9001", address=f"127.0.0.1:{port}")


# -- the source on its own ----------------------------------------------------------------------


async def test_snapshot_then_watch_has_no_gap_and_no_duplicate(etcd: EtcdServer) -> None:
    with trio.fail_after(30):
        source, other = etcd_source(etcd), EtcdSource(etcd.url, prefix="other/")
        await source.put("domains/a.example", encode_domain("a"))
        await source.put("apps/a/replicas/r1", replica(8001))
        await other.put("domains/a.example", b"not ours")
        await source.put("domains/b.example", b"")  # an empty value travels as no value at all
        revision, snapshot = await source.snapshot()
        assert snapshot == {
            "domains/a.example": encode_domain("a"),
            "apps/a/replicas/r1": replica(8001),
            "domains/b.example": b"",
        }
        assert await EtcdSource(etcd.url, page_size=1).snapshot() == (revision, snapshot)

        expected: list[tuple[str, str, int]] = []
        expected.append(("put", "apps/a/replicas/r2", await source.put("apps/a/replicas/r2", replica(8002))))
        await other.put("x", b"y")
        expected.append(("delete", "domains/a.example", await source.delete("domains/a.example")))
        assert await source.delete("domains/a.example") == expected[-1][2] + 0  # nothing deleted
        seen: list[tuple[str, str, int]] = []
        async with aclosing(source.watch(revision)) as watch:

            async def more() -> None:
                async for item in watch:
                    if not isinstance(item, Progress):
                        seen.extend((event.kind, event.key, event.revision) for event in item)
                        return

            while len(seen) < 2:
                await more()
            # A change made while the watch runs comes through it too.
            expected.append(("put", "domains/c.example", await source.put("domains/c.example", b"c")))
            await more()
        assert seen == expected
        assert await source.get("domains/c.example") == b"c"
        assert await source.get("domains/nope") is None


async def test_a_watch_from_a_compacted_revision_raises_compacted(etcd: EtcdServer) -> None:
    with trio.fail_after(30):
        source = etcd_source(etcd)
        for i in range(4):
            latest = await source.put("k", str(i).encode())
        await source.compact(latest)
        async with aclosing(source.watch(1)) as watch:
            with pytest.raises(Compacted) as caught:
                await anext(watch)
        assert caught.value.compact_revision == latest


async def test_progress_heartbeats_arrive_on_an_idle_watch(etcd: EtcdServer) -> None:
    with trio.fail_after(30):
        source = etcd_source(etcd)
        revision = await source.put("k", b"v")
        async with aclosing(source.watch(revision)) as watch:
            heartbeats = [await anext(watch) for _ in range(3)]
        assert heartbeats == [Progress(revision)] * 3


async def test_an_unreachable_etcd_is_source_unavailable(etcd: EtcdServer) -> None:
    with trio.fail_after(30):
        await etcd.kill()
        source = etcd_source(etcd)
        with pytest.raises(SourceUnavailable, match=r"all attempts to connect .* \(ConnectionRefusedError"):
            await source.snapshot()
        async with aclosing(source.watch(0)) as watch:
            with pytest.raises(SourceUnavailable):
                await anext(watch)


async def _silent_watch_server(stream: trio.SocketStream) -> None:
    """Answers a watch like etcd's gateway (created), then never says another word."""
    async with stream:
        while b"\r\n\r\n" not in (await stream.receive_some(65536)):
            pass
        created = json.dumps({"result": {"header": {"revision": "1"}, "created": True}}).encode() + b"\n"
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{len(created):x}\r\n".encode()
            + created
            + b"\r\n"
        )
        await trio.sleep_forever()


async def test_a_watch_that_goes_silent_is_taken_for_dead(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        listeners = await nursery.start(functools.partial(trio.serve_tcp, _silent_watch_server, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        source = EtcdSource(f"http://127.0.0.1:{port}", progress_interval=0.2, missed_progress=2)
        start = trio.current_time()
        async with aclosing(source.watch(0)) as watch:
            with pytest.raises(SourceUnavailable, match=r"said nothing for 0\.4s"):
                await anext(watch)
        assert trio.current_time() - start >= 0.4
    nursery.cancel_scope.cancel()


# -- the reconciler over etcd -------------------------------------------------------------------


async def test_the_cache_follows_etcd_without_gap_or_duplicate(etcd: EtcdServer) -> None:
    cache = RecordingCache()
    with trio.fail_after(30):
        writer = etcd_source(etcd)
        first = await writer.put(route_key_for_domain("chat.example"), encode_domain("chat"))
        async with open_route_cache(etcd_source(etcd), cache, config=RETRY) as routes:  # type: ignore[arg-type]
            assert cache.loads == [first]
            expected = []
            for i in range(20):
                key = route_key_for_replica("chat", f"r{i % 3}")
                if i % 4 == 3:  # always a key put earlier in the loop
                    expected.append(("delete", key, await writer.delete(key)))
                else:
                    expected.append(("put", key, await writer.put(key, replica(8000 + i))))
            await wait_until(lambda: cache.revision == expected[-1][2])
            stats = routes.statistics()
            assert (stats.reconnects, stats.reloads, stats.connected) == (0, 0, True)
            assert stats.events == 20
    assert cache.events == expected
    assert cache.cache.app_for(b"chat.example") == "chat"
    assert sorted(r.name for r in cache.cache.replicas("chat")) == ["r0", "r2"]


async def test_kill_9_mid_watch_then_restart_catches_up(etcd: EtcdServer) -> None:
    cache = RecordingCache()
    writer = etcd_source(etcd)
    with trio.fail_after(60):
        async with open_route_cache(etcd_source(etcd), cache, config=RETRY) as routes:  # type: ignore[arg-type]
            await writer.put(route_key_for_domain("chat.example"), encode_domain("chat"))
            await writer.put(route_key_for_replica("chat", "r1"), replica(8001))
            await wait_until(lambda: [r.name for r in cache.cache.replicas("chat")] == ["r1"])
            assert routes.statistics().staleness == 0.0

            await etcd.kill()
            await wait_until(lambda: not routes.statistics().connected)
            # The last good state keeps serving while etcd is gone, and its staleness grows.
            assert cache.cache.app_for(b"chat.example") == "chat"
            before = routes.statistics().staleness
            await trio.sleep(1.0)
            during = routes.statistics()
            assert during.staleness >= before + 1.0
            assert during.last_error is not None and during.last_error.startswith("SourceUnavailable")

            await etcd.restart()
            second_client = etcd_source(etcd)  # someone else changes routes meanwhile
            await second_client.put(route_key_for_replica("chat", "r2"), replica(8002))
            await second_client.delete(route_key_for_replica("chat", "r1"))
            last = await second_client.put(route_key_for_domain("new.example"), encode_domain("chat"))
            await wait_until(lambda: cache.revision == last)
            after = routes.statistics()
            assert [r.name for r in cache.cache.replicas("chat")] == ["r2"]
            assert cache.cache.app_for(b"new.example") == "chat"
            assert after.reconnects >= 1 and after.reloads == 0
            assert after.staleness == 0.0
    # Resumed, not reloaded: one snapshot, and every event once, in order.
    assert len(cache.loads) == 1
    revisions = [event[2] for event in cache.events]
    assert revisions == sorted(set(revisions))
    assert [event[:2] for event in cache.events[-3:]] == [
        ("put", "apps/chat/replicas/r2"),
        ("delete", "apps/chat/replicas/r1"),
        ("put", "domains/new.example"),
    ]


class GatedSource:
    """An EtcdSource whose calls wait while ``open`` is not set: the test decides when it reconnects."""

    def __init__(self, source: EtcdSource) -> None:
        self.source = source
        self.open = trio.Event()
        self.open.set()

    async def snapshot(self) -> tuple[int, dict[str, bytes]]:
        await self.open.wait()
        return await self.source.snapshot()

    async def watch(self, revision: int) -> AsyncIterator[list[RouteEvent] | Progress]:
        await self.open.wait()
        async with aclosing(self.source.watch(revision)) as watch:
            async for item in watch:
                yield item


async def test_compaction_while_disconnected_reloads_a_snapshot(etcd: EtcdServer) -> None:
    cache = RecordingCache()
    gated = GatedSource(etcd_source(etcd))
    writer = etcd_source(etcd)
    with trio.fail_after(60):
        async with open_route_cache(gated, cache, config=RETRY) as routes:  # type: ignore[arg-type]
            await writer.put(route_key_for_domain("old.example"), encode_domain("old"))
            await wait_until(lambda: cache.cache.app_for(b"old.example") == "old")

            gated.open = trio.Event()
            await etcd.kill()
            await wait_until(lambda: not routes.statistics().connected)
            await etcd.restart()
            await writer.delete(route_key_for_domain("old.example"))
            await writer.put(route_key_for_domain("new.example"), encode_domain("new"))
            latest = await writer.put(route_key_for_replica("new", "r1"), replica(8001))
            await writer.compact(latest)
            gated.open.set()

            await wait_until(lambda: cache.revision == latest)
            stats = routes.statistics()
            assert stats.reloads == 1
            assert stats.last_error is not None and stats.last_error.startswith("Compacted")
            assert cache.cache.app_for(b"old.example") is None
            assert cache.cache.app_for(b"new.example") == "new"
            assert [r.name for r in cache.cache.replicas("new")] == ["r1"]
            assert cache.loads[-1] == latest

            # And it follows from there.
            later = await writer.put(route_key_for_domain("later.example"), encode_domain("new"))
            await wait_until(lambda: cache.revision == later)


async def test_progress_heartbeats_keep_an_idle_watch_alive(etcd: EtcdServer) -> None:
    with trio.fail_after(30):
        # Dead after 4 silent progress intervals (2 s); idle for 8 s.
        async with open_route_cache(etcd_source(etcd), config=RETRY) as routes:
            await trio.sleep(16 * PROGRESS_INTERVAL)
            stats = routes.statistics()
            assert (stats.reconnects, stats.last_error, stats.connected) == (0, None, True)
            assert stats.progress >= 8
            assert stats.staleness == 0.0


# -- routectl against etcd ----------------------------------------------------------------------


async def routectl(*args: str) -> tuple[int, str, str]:
    # A generous etcd timeout (the default is 5 s): a CPU hog beside the suite slows etcd and the
    # command's own start, and the test asserts what routectl does, not how fast.
    result = await trio.run_process(
        [sys.executable, "-m", "blocks.routectl", "--timeout", "60", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_routectl_against_etcd(etcd: EtcdServer) -> None:
    with trio.fail_after(300):  # eight commands, each a Python process of its own
        code, out, err = await routectl("--etcd", etcd.url, "put-domain", "Chat.example", "chat")
        assert (code, err) == (0, "")
        assert out.startswith("put domains/chat.example at revision ")
        code, out, err = await routectl(
            "--etcd", etcd.url, "put-replica", "chat", "r1", "--worker", "127.0.0.1:9001", "--address", "127.0.0.1:8001"
        )
        assert code == 0, err
        code, out, err = await routectl(
            "--etcd", etcd.url, "--prefix", "proxyblocks/", "put-replica", "chat", "r2",
            "--worker", "127.0.0.1:9001", "--address", "127.0.0.1:8002", "--capacity", "4", "--state", "draining",
        )  # fmt: skip
        assert code == 0, err
        source = etcd_source(etcd)
        _, routes = await source.snapshot()
        assert routes == {
            "domains/chat.example": encode_domain("chat"),
            "apps/chat/replicas/r1": encode_replica(worker="127.0.0.1:9001", address="127.0.0.1:8001"),
            "apps/chat/replicas/r2": encode_replica(
                worker="127.0.0.1:9001", address="127.0.0.1:8002", capacity=4, state="draining"
            ),
        }
        code, out, err = await routectl("--etcd", etcd.url, "list")
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].startswith(f"# {etcd.url} proxyblocks/ revision ")
        assert lines[1:] == [f"{key} {value.decode()}" for key, value in sorted(routes.items())]

        code, out, err = await routectl("--etcd", etcd.url, "delete", "apps/chat/replicas/r1")
        assert code == 0, err
        code, out, err = await routectl("--etcd", etcd.url, "delete", "apps/chat/replicas/r1")
        assert code == 1 and "no such key" in err

        code, out, err = await routectl(
            "--etcd", etcd.url, "put-replica", "chat", "r3", "--worker", "nope", "--address", "h:1"
        )
        assert code == 2 and "host:port" in err

        await etcd.kill()
        code, out, err = await routectl("--etcd", etcd.url, "list")
        assert code == 1 and err.startswith(f"routectl: error: {etcd.url}") and "Connection refused" in err


# -- the fleet recipe ---------------------------------------------------------------------------


async def test_the_fleet_recipe_shares_routes_and_no_fate(nursery: trio.Nursery) -> None:
    with trio.fail_after(60):
        fleet: Fleet = await nursery.start(functools.partial(fleet_main, announce=False))
        try:
            a, b = fleet.proxies
            # curl, as the recipe says: a proxy trusts the edge before it to have dropped
            # hop-by-hop fields, and curl sends none (httpx sends "connection: keep-alive").

            async def status(proxy: ProxyProcess, host: str) -> int:
                return int(await curl("-o", "/dev/null", "-w", "%{http_code}", "-H", f"host: {host}", proxy.url + "/"))

            assert [await status(a, "demo.example"), await status(b, "demo.example")] == [200, 200]
            assert await status(b, "new.example") == 503

            code, _, err = await routectl("--etcd", fleet.etcd, "put-domain", "new.example", "demo")
            assert code == 0, err
            for proxy in (a, b):
                while await status(proxy, "new.example") != 200:
                    await trio.sleep(0.05)

            a.process.kill()  # a crash
            await a.process.wait()
            assert [await status(b, "demo.example") for _ in range(3)] == [200] * 3
            # Through the edge, which found both proxies in etcd: every request served, by b.
            edge = f"{fleet.chain.url}/"
            for _ in range(6):
                assert await curl("-o", "/dev/null", "-w", "%{http_code}", "-H", "host: demo.example", edge) == "200"
        finally:
            await fleet.shutdown(1.0)


async def test_requests_route_from_memory_while_etcd_hangs(etcd: EtcdServer, nursery: trio.Nursery) -> None:
    """No network call on the request path: with etcd frozen (SIGSTOP: its connections hang,
    nothing fails) the proxy goes on routing every request from its cache, at once."""
    with trio.fail_after(30):
        replica_handler, _, local = await serve_tenant_replica(nursery)
        worker_server, _ = await nursery.start(functools.partial(serve_worker, {"r1": LocalReplica(local.address)}))
        writer = etcd_source(etcd)
        await writer.put(route_key_for_domain("chat.example"), encode_domain("chat"))
        await writer.put(
            route_key_for_replica("chat", "r1"),
            encode_replica(worker=(HOST, worker_server.port), address=local.address),
        )
        async with open_route_cache(etcd_source(etcd), config=RETRY) as routes:
            proxy_server, _ = await nursery.start(functools.partial(serve_proxy, routes.cache))
            url = f"http://{HOST}:{proxy_server.port}/"
            assert await curl("-H", "host: chat.example", "-H", "x-tenant: before", url) == "before\n"
            assert etcd.pid is not None
            os.kill(etcd.pid, signal.SIGSTOP)
            try:
                with trio.fail_after(5):  # a liveness bound: a request that waited on etcd would hang here
                    for i in range(20):
                        tenant = f"frozen-{i}"
                        assert await curl("-H", "host: chat.example", "-H", f"x-tenant: {tenant}", url) == f"{tenant}\n"
            finally:
                os.kill(etcd.pid, signal.SIGCONT)
        assert replica_handler.arrivals[-1] == "frozen-19"
