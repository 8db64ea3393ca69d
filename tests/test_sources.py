"""The embedded route store, route files, and the reconciler that keeps a RouteCache in sync.

Rules: no sockets here (etcd has tests/test_etcd.py); time is trio's
autojump clock except where a file is polled through threads; every async
test is bounded by ``trio.fail_after``; hypothesis drives the reconciler
through arbitrary interleavings of writes, disconnects and compactions.
"""

from __future__ import annotations

import json
import os
import random
import stat
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

from blocks.routing import (
    RouteCache,
    RouteEvent,
    encode_domain,
    encode_replica,
    route_key_for_domain,
    route_key_for_replica,
)
from blocks.sources import (
    Compacted,
    EmbeddedStore,
    Progress,
    ReconcileConfig,
    RouteFileError,
    SourceUnavailable,
    open_route_cache,
    read_route_file,
    reconcile,
    write_route_file,
)
from blocks.sources.routefile import document_from_routes, dump_toml, parse_route_file
from tests.support import RecordingCache

REPLICA = encode_replica(worker="127.0.0.1:9001", address="127.0.0.1:8001")


def replica_value(port: int, state: str = "live") -> bytes:
    return encode_replica(worker="127.0.0.1:9001", address=f"127.0.0.1:{port}", state=state)


# -- helpers: sources that break on demand, a cache that checks what it is given -------------


class FlakySource:
    """An EmbeddedStore behind a switch: while ``down``, every call raises SourceUnavailable,
    and :meth:`disconnect` breaks the watch in progress (at its next item)."""

    def __init__(self, store: EmbeddedStore) -> None:
        self.store = store
        self.down = False
        self.generation = 0
        self.snapshots = 0
        self.watches: list[int] = []

    def disconnect(self) -> None:
        self.generation += 1

    async def snapshot(self) -> tuple[int, dict[str, bytes]]:
        await trio.lowlevel.checkpoint()
        if self.down:
            raise SourceUnavailable("down")
        self.snapshots += 1
        return await self.store.snapshot()

    async def watch(self, revision: int) -> AsyncIterator[list[RouteEvent] | Progress]:
        await trio.lowlevel.checkpoint()
        if self.down:
            raise SourceUnavailable("down")
        self.watches.append(revision)
        generation = self.generation
        async with aclosing(self.store.watch(revision)) as inner:
            async for item in inner:
                if self.down or self.generation != generation:
                    raise SourceUnavailable("disconnected")
                yield item


def view(cache: Any, keys: set[str]) -> tuple[dict[str, str | None], dict[str, list[Any]]]:
    """What the proxy sees of ``cache`` for the domains and apps named in ``keys``."""
    domains = {key.split("/")[1] for key in keys if key.startswith("domains/")}
    apps = {key.split("/")[1] for key in keys if key.startswith("apps/")}
    return (
        {domain: cache.app_for(domain.encode()) for domain in sorted(domains)},
        {app: sorted(cache.replicas(app), key=lambda r: r.name) for app in sorted(apps)},
    )


def same_as_store(cache: Any, store: EmbeddedStore, keys: set[str]) -> bool:
    expected = RouteCache()
    expected.load(store.items(), store.revision, 0.0)
    return cache.revision == store.revision and view(cache, keys) == view(expected, keys)


async def wait_until(predicate: Any, step: float = 0.01) -> None:
    while not predicate():
        await trio.sleep(step)


# -- the embedded store -------------------------------------------------------------------------


def test_revisions_start_at_one_and_count_writes() -> None:
    store = EmbeddedStore()
    assert store.revision == 0
    assert store.put("domains/a.example", encode_domain("a")) == 1
    assert store.put("domains/a.example", encode_domain("a")) == 2  # the same value is still a write, as in etcd
    assert store.delete("domains/a.example") == 3
    assert store.delete("domains/a.example") == 3  # nothing to delete: no change
    assert store.transact({"x": b"1", "y": b"2"}, ["nothing"]) == 4
    assert store.transact() == 4
    assert store.items() == {"x": b"1", "y": b"2"}
    assert store.get("x") == b"1"
    assert store.get("domains/a.example") is None
    with pytest.raises(ValueError, match="both put and deleted"):
        store.transact({"x": b"3"}, ["x"])
    with pytest.raises(ValueError):
        store.put("", b"")
    with pytest.raises(TypeError):
        store.put("k", "text")  # type: ignore[arg-type]


async def test_snapshot_then_watch_has_no_gap_and_no_duplicate(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore()
    store.put("a", b"1")
    store.put("b", b"2")
    with trio.fail_after(10):
        revision, snapshot = await store.snapshot()
        assert (revision, snapshot) == (2, {"a": b"1", "b": b"2"})
        store.delete("a")
        store.transact({"c": b"3", "d": b"4"})
        async with aclosing(store.watch(revision)) as watch:
            batch = await anext(watch)
            assert batch == [
                RouteEvent("delete", "a", None, 3),
                RouteEvent("put", "c", b"3", 4),
                RouteEvent("put", "d", b"4", 4),
            ]
            store.put("e", b"5")
            assert await anext(watch) == [RouteEvent("put", "e", b"5", 5)]
            assert store.statistics().watchers == 1
        assert store.statistics().watchers == 0


async def test_an_idle_watch_yields_progress(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore(progress_interval=2.0)
    store.put("a", b"1")
    with trio.fail_after(10):
        async with aclosing(store.watch(1)) as watch:
            start = trio.current_time()
            assert await anext(watch) == Progress(1)
            assert trio.current_time() - start == pytest.approx(2.0)


async def test_a_watch_from_the_future_waits_for_it(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore(progress_interval=100.0)
    with trio.fail_after(10):
        async with aclosing(store.watch(1)) as watch, trio.open_nursery() as nursery:
            nursery.start_soon(lambda: trio.sleep(1))
            store.put("a", b"1")
            store.put("b", b"2")
            assert await anext(watch) == [RouteEvent("put", "b", b"2", 2)]


async def test_history_is_bounded_and_older_watches_are_compacted(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore(history_limit=5)
    for i in range(10):
        store.put(f"k{i}", b"v")
    stats = store.statistics()
    assert (stats.history, stats.compact_revision) == (5, 5)
    with trio.fail_after(10):
        async with aclosing(store.watch(4)) as watch:
            with pytest.raises(Compacted) as caught:
                await anext(watch)
        assert caught.value.compact_revision == 5
        async with aclosing(store.watch(5)) as watch:
            assert [event.revision for event in await anext(watch)] == [6, 7, 8, 9, 10]


def test_history_drops_whole_revisions() -> None:
    store = EmbeddedStore(history_limit=3)
    store.transact({"a": b"1", "b": b"1"})  # revision 1: two events
    store.transact({"c": b"1", "d": b"1"})  # revision 2: two events; revision 1 must go whole
    stats = store.statistics()
    assert (stats.history, stats.compact_revision) == (2, 1)


async def test_compact(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore()
    for i in range(4):
        store.put("k", str(i).encode())
    store.compact(3)
    with pytest.raises(ValueError, match="past the current revision"):
        store.compact(5)
    with trio.fail_after(10):
        async with aclosing(store.watch(2)) as watch:
            with pytest.raises(Compacted):
                await anext(watch)
        async with aclosing(store.watch(3)) as watch:
            assert await anext(watch) == [RouteEvent("put", "k", b"3", 4)]


# -- route files --------------------------------------------------------------------------------

TOML = """
[domains]
"Chat.example" = "chat"
"*" = "demo"

[apps.chat.replicas.r1]
worker = "127.0.0.1:9001"
address = "127.0.0.1:8001"

[apps.chat.replicas.r2]
worker = "127.0.0.1:9001"
address = "[::1]:8002"
protocol = "h1"
capacity = 4
state = "draining"
"""

EXPECTED = {
    route_key_for_domain("chat.example"): encode_domain("chat"),
    route_key_for_domain("*"): encode_domain("demo"),
    route_key_for_replica("chat", "r1"): encode_replica(worker="127.0.0.1:9001", address="127.0.0.1:8001"),
    route_key_for_replica("chat", "r2"): encode_replica(
        worker="127.0.0.1:9001", address="[::1]:8002", protocol="h1", capacity=4, state="draining"
    ),
}


def test_a_toml_route_file_becomes_store_keys(tmp_path: Path) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(TOML)
    assert read_route_file(path) == EXPECTED
    assert "domains/chat.example" in EXPECTED  # domains are lowercased


def test_a_json_route_file_becomes_the_same_keys(tmp_path: Path) -> None:
    path = tmp_path / "routes.json"
    document = {
        "domains": {"chat.example": "chat", "*": "demo"},
        "apps": {
            "chat": {
                "replicas": {
                    "r1": {"worker": "127.0.0.1:9001", "address": "127.0.0.1:8001"},
                    "r2": {
                        "worker": "127.0.0.1:9001",
                        "address": "[::1]:8002",
                        "protocol": "h1",
                        "capacity": 4,
                        "state": "draining",
                    },
                }
            }
        },
    }
    path.write_text(json.dumps(document))
    assert read_route_file(path) == EXPECTED


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[domain]\n", "unknown section(s) ['domain']"),
        ('[domains]\n"a" = 3\n', "[domains] 'a': an app name must be"),
        ('[domains]\n"a/b" = "x"\n', "a domain must be"),
        ('[domains]\n"A" = "x"\n"a" = "y"\n', "given twice"),
        ("[apps.chat]\nreplica = 1\n", "[apps.chat]: unknown field(s) ['replica']"),
        ('[apps.chat.replicas.r1]\naddress = "127.0.0.1:1"\n', "[apps.chat.replicas.r1]: 'worker' is required"),
        (
            '[apps.chat.replicas.r1]\nworker = "127.0.0.1:1"\naddress = "127.0.0.1:1"\nport = 3\n',
            "unknown field(s) ['port']",
        ),
        (
            '[apps.chat.replicas.r1]\nworker = "127.0.0.1"\naddress = "127.0.0.1:1"\n',
            "[apps.chat.replicas.r1] worker: expected 'host:port'",
        ),
        ('[apps.chat.replicas.r1]\nworker = "h:1"\naddress = "h:99999"\n', "[apps.chat.replicas.r1] address: expected"),
        ('[apps.chat.replicas.r1]\nworker = "h:1"\naddress = "h:2"\nprotocol = "h3"\n', "protocol must be"),
        ('[apps.chat.replicas.r1]\nworker = "h:1"\naddress = "h:2"\ncapacity = -1\n', "capacity must be"),
        ('[apps.chat.replicas.r1]\nworker = "h:1"\naddress = "h:2"\ncapacity = true\n', "capacity must be"),
        ('[apps.chat.replicas.r1]\nworker = "h:1"\naddress = "h:2"\nstate = "asleep"\n', "state"),
        ("[domains\n", "routes.toml: "),
    ],
)
def test_a_bad_route_file_says_where(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(text)
    with pytest.raises(RouteFileError) as caught:
        read_route_file(path)
    assert message in str(caught.value)
    assert str(path) in str(caught.value)


def test_a_missing_route_file_is_a_route_file_error(tmp_path: Path) -> None:
    with pytest.raises(RouteFileError, match="No such file"):
        read_route_file(tmp_path / "nope.toml")
    with pytest.raises(RouteFileError, match=r"not JSON|Expecting"):
        parse_route_file(b"{", path="x.json")


@pytest.mark.parametrize("name", ["routes.toml", "routes.json"])
def test_route_files_round_trip(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("")
    path.chmod(0o640)
    routes = {**EXPECTED, route_key_for_replica("odd app", "r.1"): REPLICA, "domains/ünï.example": encode_domain("x")}
    write_route_file(path, routes)
    assert read_route_file(path) == routes
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temporary left behind


def test_the_toml_writer_writes_the_documented_layout() -> None:
    text = dump_toml(document_from_routes({"domains/a.example": encode_domain("a"), "apps/a/replicas/r1": REPLICA}))
    assert text.splitlines()[:3] == ["[domains]", '"a.example" = "a"', ""]
    assert "[apps.a.replicas.r1]" in text
    assert 'worker = "127.0.0.1:9001"' in text


def test_keys_a_route_file_cannot_hold_are_refused() -> None:
    with pytest.raises(RouteFileError, match="not a key a route file can hold"):
        document_from_routes({"other/thing": b"{}"})
    with pytest.raises(RouteFileError, match="not JSON"):
        document_from_routes({"domains/a": b"\xff"})


async def test_load_file_writes_only_the_difference_in_one_revision(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(TOML)
    store = EmbeddedStore()
    assert store.load_file(path) == 1
    assert store.items() == EXPECTED
    assert store.load_file(path) == 1  # unchanged: no write at all
    path.write_text(TOML.replace('"*" = "demo"\n', "").replace("8001", "8003"))
    assert store.load_file(path) == 2
    with trio.fail_after(10):
        async with aclosing(store.watch(1)) as watch:
            batch = await anext(watch)
    assert sorted((event.kind, event.key, event.revision) for event in batch) == [
        ("delete", "domains/*", 2),
        ("put", "apps/chat/replicas/r1", 2),
    ]
    path.write_text("[domains]\nbroken = 1\n")
    with pytest.raises(RouteFileError):
        store.load_file(path)
    assert store.revision == 2


def test_a_route_file_adds_to_the_stores_own_routes_and_deletes_only_its_own(tmp_path: Path) -> None:
    own = {route_key_for_domain("own.example"): encode_domain("own"), route_key_for_domain("*"): encode_domain("x")}
    path = tmp_path / "routes.toml"
    store = EmbeddedStore()
    store.transact(own)
    path.write_text(TOML)
    store.load_file(path)
    assert store.items() == {route_key_for_domain("own.example"): encode_domain("own")} | EXPECTED  # the file wins
    path.write_text(TOML.replace('"*" = "demo"\n', ""))
    store.load_file(path)
    # "*" was last written by the file, so the file dropping it deletes it; its own key stays.
    assert store.items() == {route_key_for_domain("own.example"): encode_domain("own")} | {
        key: value for key, value in EXPECTED.items() if key != route_key_for_domain("*")
    }
    path.write_text("[domains]\n")
    store.load_file(path)
    assert store.items() == {route_key_for_domain("own.example"): encode_domain("own")}


_LAYER_KEYS = st.sampled_from([f"domains/d{i}" for i in range(5)])
_LAYER_ROUTES = st.dictionaries(_LAYER_KEYS, st.sampled_from([b'"a"', b'"b"']), max_size=5)


@given(st.lists(st.tuples(st.sampled_from(["recipe", "file", None]), _LAYER_ROUTES), max_size=12))
def test_a_layer_replaces_only_what_it_wrote(loads: list[tuple[str | None, dict[str, bytes]]]) -> None:
    # After loading routes R as layer L: the store holds R; a key L named last time and not
    # now is gone; every other key is as it was. Without a layer, the store is exactly R.
    store = EmbeddedStore()
    named: dict[str, set[str]] = {}
    for layer, routes in loads:
        before = store.items()
        store.load_routes(routes, layer=layer)
        after = store.items()
        assert {key: after.get(key) for key in routes} == routes
        if layer is None:
            assert after == routes
            continue
        dropped = named.get(layer, set()) - routes.keys()
        assert dropped.isdisjoint(after)
        untouched = before.keys() - routes.keys() - dropped
        assert {key: after[key] for key in untouched} == {key: before[key] for key in untouched}
        named[layer] = set(routes)


async def test_watch_file_follows_changes_and_keeps_the_last_good_routes(tmp_path: Path) -> None:
    # Real clock: the file is read in threads, which an autojump clock would skip past.
    path = tmp_path / "routes.toml"
    path.write_text(TOML)
    store = EmbeddedStore()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: store.watch_file(path, interval=0.02, task_status=task_status))
            assert store.items() == EXPECTED
            assert store.statistics().file_loads == 1

            # An edit in place.
            path.write_text(TOML.replace("8001", "8009"))
            await wait_until(lambda: store.get("apps/chat/replicas/r1") == replica_value(8009))

            # A bad save: the routes stay, the error is reported, a fix clears it.
            path.write_text(TOML.replace("[domains]", "[domains"))
            await wait_until(lambda: store.statistics().file_error is not None)
            assert "routes.toml" in str(store.statistics().file_error)
            assert store.get("apps/chat/replicas/r1") == replica_value(8009)
            revision = store.revision
            path.write_text(TOML.replace("8001", "8009"))
            await wait_until(lambda: store.statistics().file_error is None)
            assert store.revision == revision  # back to the routes in force: nothing to write

            # Replaced by a rename (what editors and ConfigMaps do).
            replacement = tmp_path / "new.toml"
            replacement.write_text(TOML)
            os.replace(replacement, path)
            await wait_until(lambda: store.items() == EXPECTED)

            # Deleted: the routes stay; restored: error cleared.
            path.unlink()
            await wait_until(lambda: store.statistics().file_error is not None)
            assert store.items() == EXPECTED
            path.write_text(TOML)
            await wait_until(lambda: store.statistics().file_error is None)
            assert store.items() == EXPECTED
            nursery.cancel_scope.cancel()


async def test_watch_file_sees_a_same_size_rewrite_within_one_mtime_tick(tmp_path: Path) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(TOML)
    before = path.stat()
    store = EmbeddedStore()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: store.watch_file(path, interval=0.02, task_status=task_status))
            with path.open("r+") as file:  # same inode, same size, same mtime
                file.write(TOML.replace("8001", "8007"))
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
            after = path.stat()
            assert (after.st_mtime_ns, after.st_size, after.st_ino) == (
                before.st_mtime_ns,
                before.st_size,
                before.st_ino,
            )
            await wait_until(lambda: store.get("apps/chat/replicas/r1") == replica_value(8007))
            nursery.cancel_scope.cancel()


async def test_watch_file_fails_to_start_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "routes.toml"
    path.write_text("[nonsense]\n")
    store = EmbeddedStore()
    with trio.fail_after(10), pytest.raises(RouteFileError, match="unknown section"):
        await store.watch_file(path, interval=0.02)
    with pytest.raises(ValueError):
        await store.watch_file(path, interval=0)


# -- the reconciler ---------------------------------------------------------------------------


def test_backoff_doubles_up_to_the_cap_with_jitter_below() -> None:
    config = ReconcileConfig(min_backoff=0.1, max_backoff=1.0, jitter=0.0)
    rng = random.Random(1)
    assert [config.backoff(n, rng) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    jittered = ReconcileConfig(min_backoff=1.0, max_backoff=1.0, jitter=0.5)
    waits = [jittered.backoff(1, rng) for _ in range(200)]
    assert 0.5 <= min(waits) < 0.6 and 0.9 < max(waits) <= 1.0
    assert jittered.backoff(10**6, rng) <= 1.0
    with pytest.raises(ValueError):
        ReconcileConfig(min_backoff=1.0, max_backoff=0.5)
    with pytest.raises(ValueError):
        ReconcileConfig(min_backoff=0.0)
    with pytest.raises(ValueError):
        ReconcileConfig(jitter=2.0)


async def test_open_route_cache_loads_then_follows(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore()
    store.put(route_key_for_domain("chat.example"), encode_domain("chat"))
    store.put(route_key_for_replica("chat", "r1"), REPLICA)
    with trio.fail_after(10):
        async with open_route_cache(store) as routes:
            cache = routes.cache
            assert cache.revision == 2
            assert cache.app_for(b"chat.example") == "chat"
            assert [r.name for r in cache.replicas("chat")] == ["r1"]
            store.put(route_key_for_replica("chat", "r2"), replica_value(8002))
            store.delete(route_key_for_domain("chat.example"))
            await wait_until(lambda: cache.revision == 4)
            assert cache.app_for(b"chat.example") is None
            assert [r.name for r in cache.replicas("chat")] == ["r1", "r2"]
            stats = routes.statistics()
            assert (stats.revision, stats.connected, stats.reconnects, stats.reloads) == (4, True, 0, 0)
            assert stats.events == 2 and stats.last_error is None
            assert stats.staleness < 1.0
            await trio.sleep(5.0)  # idle: the store's progress heartbeats keep it synced
            assert routes.statistics().progress >= 4
            assert routes.statistics().staleness == 0.0
            assert "revision=4" in repr(routes)


async def test_a_broken_source_is_retried_with_backoff_and_resumed_without_duplicates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    store = EmbeddedStore(progress_interval=0.5)
    store.put("domains/a.example", encode_domain("a"))
    source = FlakySource(store)
    cache = RecordingCache(contiguous=True)
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            routes = await nursery.start(
                lambda task_status: reconcile(
                    source, cache, config=ReconcileConfig(min_backoff=0.1, max_backoff=1.0), task_status=task_status
                )
            )
            store.put("domains/b.example", encode_domain("b"))
            await wait_until(lambda: cache.revision == 2)

            source.down = True
            store.put("domains/c.example", encode_domain("c"))
            await wait_until(lambda: not routes.statistics().connected)
            assert cache.cache.app_for(b"a.example") == "a"  # the last good state keeps serving
            first = routes.statistics().staleness
            await trio.sleep(10)
            stats = routes.statistics()
            assert stats.staleness >= first + 10
            # Bounded exponential backoff: 0.1, 0.2, 0.4, 0.8, then 1.0 per try (less jitter).
            assert 10 <= stats.reconnects <= 25
            assert stats.last_error == "SourceUnavailable: down"

            source.down = False
            await wait_until(lambda: cache.revision == 3)
            assert routes.statistics().staleness == 0.0
            assert routes.statistics().connected
            nursery.cancel_scope.cancel()
    assert cache.loads == [1]
    assert cache.applied == [2, 3]
    assert source.watches[0] == 1
    assert set(source.watches[1:]) == {2}  # resumed after the last applied event, every time


class ScriptedSource:
    """Snapshot at 5, then a watch that yields what the test queued and then breaks."""

    def __init__(self, script: list[list[list[RouteEvent] | Progress | Exception]]) -> None:
        self.script = script
        self.watches: list[int] = []
        self.snapshots = 0

    async def snapshot(self) -> tuple[int, dict[str, bytes]]:
        await trio.lowlevel.checkpoint()
        self.snapshots += 1
        return 5, {}

    async def watch(self, revision: int) -> AsyncIterator[list[RouteEvent] | Progress]:
        await trio.lowlevel.checkpoint()
        self.watches.append(revision)
        steps = self.script.pop(0) if self.script else [SourceUnavailable("script over")]
        for step in steps:
            if isinstance(step, Exception):
                raise step
            yield step
        await trio.sleep_forever()


async def test_resume_is_from_the_last_applied_event_never_a_heartbeat_revision(
    autojump_clock: trio.testing.MockClock,
) -> None:
    source = ScriptedSource(
        [
            [[RouteEvent("put", "domains/a", encode_domain("a"), 7)], Progress(40), SourceUnavailable("cut")],
            [Progress(41), SourceUnavailable("cut again")],
        ]
    )
    with trio.fail_after(10):
        async with open_route_cache(source, config=ReconcileConfig(min_backoff=0.1, jitter=0)) as routes:
            await wait_until(lambda: len(source.watches) >= 3)
            assert source.watches[:3] == [5, 7, 7]
            assert routes.cache.revision == 7
            assert routes.statistics().progress == 2


async def test_compacted_history_reloads_a_snapshot(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore(progress_interval=0.5)
    store.put("domains/a.example", encode_domain("a"))
    source = FlakySource(store)
    cache = RecordingCache(contiguous=True)
    with trio.fail_after(100):
        async with open_route_cache(source, cache) as routes:  # type: ignore[arg-type]
            source.down = True
            await wait_until(lambda: not routes.statistics().connected)
            store.delete("domains/a.example")
            store.put("domains/b.example", encode_domain("b"))
            store.compact(store.revision)
            source.down = False
            await wait_until(lambda: cache.revision == 3)
            stats = routes.statistics()
            assert stats.reloads == 1
            assert stats.last_error is not None and stats.last_error.startswith("Compacted: ")
            assert cache.cache.app_for(b"a.example") is None
            assert cache.cache.app_for(b"b.example") == "b"
            store.put("domains/c.example", encode_domain("c"))
            await wait_until(lambda: cache.revision == 4)
    assert cache.loads == [1, 3]
    assert cache.applied == [4]


async def test_a_source_that_lost_its_history_is_reloaded_from_a_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # An etcd restarted without its data: the same address, revisions from 1 again. A watch
    # from the cache's revision would wait forever; the first heartbeat below it says so.
    before = EmbeddedStore(progress_interval=0.5)
    for name in "abcd":
        before.put(f"domains/{name}.example", encode_domain(name))
    source = FlakySource(before)
    with trio.fail_after(100):
        async with open_route_cache(source) as routes:
            assert routes.cache.revision == 4
            after = EmbeddedStore(progress_interval=0.5)
            after.put("domains/new.example", encode_domain("new"))
            source.store = after
            source.disconnect()
            before.put("domains/e.example", encode_domain("e"))  # (wakes the old watch, which then breaks)
            await wait_until(lambda: routes.cache.app_for(b"new.example") == "new")
            assert routes.cache.app_for(b"a.example") is None  # the source's state, exactly
            stats = routes.statistics()
            assert stats.reloads == 1 and stats.last_error is not None and "lost its history" in stats.last_error
            after.put("domains/later.example", encode_domain("later"))
            await wait_until(lambda: routes.cache.app_for(b"later.example") == "later")


async def test_an_unreachable_source_delays_the_start(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore()
    store.put("domains/a.example", encode_domain("a"))
    source = FlakySource(store)
    source.down = True

    async def come_back() -> None:
        await trio.sleep(3)
        source.down = False

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(come_back)
            async with open_route_cache(source, config=ReconcileConfig(jitter=0)) as routes:
                assert trio.current_time() >= 3
                assert routes.cache.app_for(b"a.example") == "a"
                assert routes.statistics().reconnects >= 3


async def test_a_bug_in_a_source_is_not_swallowed(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(10), pytest.raises(KeyError, match="bug"):
        async with open_route_cache(ScriptedSource([[KeyError("bug")]])):
            await trio.sleep_forever()


async def test_leaving_open_route_cache_stops_the_watch(autojump_clock: trio.testing.MockClock) -> None:
    store = EmbeddedStore()
    with trio.fail_after(10):
        async with open_route_cache(store):
            await wait_until(lambda: store.statistics().watchers == 1)
        assert store.statistics().watchers == 0


# -- the property: whatever happens, the cache ends equal to the store ----------------------------

DOMAIN_KEYS = [route_key_for_domain(f"d{i}.example") for i in range(3)]
REPLICA_KEYS = [route_key_for_replica(f"a{i}", f"r{j}") for i in range(2) for j in range(3)]
KEYS = DOMAIN_KEYS + REPLICA_KEYS
entries = st.one_of(
    st.tuples(st.sampled_from(DOMAIN_KEYS), st.sampled_from([encode_domain("a0"), encode_domain("a1")])),
    st.tuples(
        st.sampled_from(REPLICA_KEYS),
        st.builds(replica_value, st.integers(8000, 8002), st.sampled_from(["live", "draining"])),
    ),
)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("put"), entries),
        st.tuples(st.just("delete"), st.sampled_from(KEYS)),
        st.tuples(
            st.just("transact"),
            st.lists(entries, max_size=3).map(dict),
            st.lists(st.sampled_from(KEYS), max_size=2),
        ),
        st.tuples(st.just("disconnect")),
        st.tuples(st.just("down"), st.floats(0.0, 3.0)),
        st.tuples(st.just("compact")),
        st.tuples(st.just("sleep"), st.floats(0.0, 1.0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, history_limit=st.integers(1, 8), seed=st.integers(0, 2**32))
def test_any_interleaving_ends_with_the_cache_equal_to_the_store(
    ops: list[tuple[Any, ...]], history_limit: int, seed: int
) -> None:
    store = EmbeddedStore(history_limit=history_limit, progress_interval=0.25)
    source = FlakySource(store)
    cache = RecordingCache(contiguous=True)

    async def scenario() -> None:
        with trio.fail_after(1000):
            async with trio.open_nursery() as nursery:
                config = ReconcileConfig(min_backoff=0.05, max_backoff=0.5)
                await nursery.start(
                    lambda task_status: reconcile(
                        source, cache, config=config, rng=random.Random(seed), task_status=task_status
                    )
                )
                for op in ops:
                    if op[0] == "put":
                        store.put(*op[1])
                    elif op[0] == "delete":
                        store.delete(op[1])
                    elif op[0] == "transact":
                        store.transact(op[1], [key for key in op[2] if key not in op[1]])
                    elif op[0] == "disconnect":
                        source.disconnect()
                    elif op[0] == "down":
                        source.down = True
                        await trio.sleep(op[1])
                        source.down = False
                    elif op[0] == "compact":
                        store.compact(store.revision)
                    else:
                        await trio.sleep(op[1])
                    await trio.sleep(0)
                await wait_until(lambda: cache.revision == store.revision)
                assert same_as_store(cache.cache, store, set(KEYS))
                note_event(f"reloaded: {len(cache.loads) > 1}")
                note_event(f"resumed: {len(source.watches) > len(cache.loads)}")
                nursery.cancel_scope.cancel()

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


# -- routectl on a route file ---------------------------------------------------------------------


async def routectl(*args: str) -> tuple[int, str, str]:
    result = await trio.run_process(
        [sys.executable, "-m", "blocks.routectl", *args], capture_stdout=True, capture_stderr=True, check=False
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


@pytest.mark.parametrize("name", ["routes.toml", "routes.json"])
async def test_routectl_edits_a_route_file_that_a_store_follows(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    store = EmbeddedStore()
    with trio.fail_after(60):
        assert await routectl("--store", str(path), "put-domain", "Chat.example", "chat") == (
            0,
            "put domains/chat.example\n",
            "",
        )
        code, out, err = await routectl(
            "--store", str(path), "put-replica", "chat", "r1", "--worker", "127.0.0.1:9001",
            "--address", "127.0.0.1:8001", "--capacity", "4", "--protocol", "h1",
        )  # fmt: skip
        assert (code, out, err) == (0, "put apps/chat/replicas/r1\n", "")
        assert read_route_file(path) == {
            "domains/chat.example": encode_domain("chat"),
            "apps/chat/replicas/r1": encode_replica(
                worker="127.0.0.1:9001", address="127.0.0.1:8001", capacity=4, protocol="h1"
            ),
        }
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: store.watch_file(path, interval=0.02, task_status=task_status))
            assert store.get("domains/chat.example") == encode_domain("chat")
            code, out, err = await routectl(
                "--store", str(path), "put-replica", "chat", "r2", "--worker", "127.0.0.1:9001",
                "--address", "127.0.0.1:8002", "--state", "draining",
            )  # fmt: skip
            assert code == 0, err
            assert (await routectl("--store", str(path), "delete", "domains/chat.example"))[0] == 0
            # Two edits, and a poll may land between them: wait for the state after both.
            await wait_until(
                lambda: store.get("apps/chat/replicas/r2") is not None and store.get("domains/chat.example") is None
            )
            nursery.cancel_scope.cancel()

        code, out, err = await routectl("--store", str(path), "list")
        assert code == 0, err
        assert out.splitlines() == [
            f"# {path}",
            f"apps/chat/replicas/r1 {store.get('apps/chat/replicas/r1').decode()}",  # type: ignore[union-attr]
            f"apps/chat/replicas/r2 {store.get('apps/chat/replicas/r2').decode()}",  # type: ignore[union-attr]
        ]

        code, out, err = await routectl("--store", str(path), "delete", "domains/chat.example")
        assert (code, out) == (1, "") and "no such key domains/chat.example" in err
        code, out, err = await routectl("--store", str(tmp_path / "missing.toml"), "list")
        assert code == 1 and "missing.toml" in err
        code, out, err = await routectl(
            "--store", str(path), "put-replica", "chat", "r3", "--worker", "x", "--address", "h:1"
        )  # fmt: skip
        assert code == 2 and "expected host:port" in err
        code, out, err = await routectl("--store", str(path), "put-domain", "a/b", "chat")
        assert code == 1 and "without '/'" in err
        code, out, err = await routectl("list")
        assert code == 2 and "one of the arguments --store --etcd is required" in err
