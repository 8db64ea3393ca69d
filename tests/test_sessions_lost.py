"""Sessions wherever the chain runs: per-app limits from the route store, starts at zero replicas,
a replica lost under its sessions (``session_lost``), and sessions that may move (``on_replica_loss``).

The chain (edge -> proxy -> worker -> demo replicas) routes from its embedded store, as a fleet's
proxies route from etcd: the app ``room`` is sessioned by its settings record alone (the proxy's
``SessionConfig`` names no app), so a test changes its limits by writing that record.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after`` and waiting for states;
real clients (httpx through the edge). A replica is "killed" by cancelling the scope that serves it:
its listener and connections close, and connects to its port are refused.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import httpx
import pytest
import trio
from support import wait_for

from blocks import (
    Chain,
    Keyring,
    LocalReplica,
    SessionConfig,
    TokenIssuer,
    TokenKey,
    TokenVerifier,
    WorkerSessionConfig,
    serve_chain,
)
from blocks.routing import (
    AppSettings,
    SessionSetting,
    encode_domain,
    encode_settings,
    route_key_for_domain,
    route_key_for_settings,
)
from blocks.testing import serve_demo_replica
from blocks.topology import route_records

KEY = TokenKey.hmac("k1", bytes(range(32)))
ISSUER = TokenIssuer(KEY)
HOST_FIELD = {"host": "room.example"}


def auth() -> dict[str, str]:
    return {"authorization": "Bearer " + ISSUER.mint(app="room", tenant="acme", now=time.time(), ttl=300.0)}


@attrs.define(eq=False)
class Room:
    """The chain, its replicas by name (each killable), and a client through its edge."""

    chain: Chain
    client: httpx.AsyncClient
    scopes: dict[str, trio.CancelScope] = attrs.field(factory=dict)

    @property
    def url(self) -> str:
        return self.chain.url

    def settings(self, **limits: object) -> None:
        record = encode_settings(AppSettings(sessions=SessionSetting(**limits)))  # type: ignore[arg-type]
        self.chain.store.transact({route_key_for_settings("room"): record})

    async def add_replicas(self, *names: str, protocol: str = "h2") -> None:
        """Start ``names`` (demo replicas) and route them behind the chain's worker (over ``protocol``)."""
        local = {}
        for name in names:
            scope = self.scopes[name] = trio.CancelScope()
            server = await self.chain.start(functools.partial(_serve_killable, name, scope))
            local[name] = LocalReplica((self.chain.host, server.port), protocol)
        worker = self.chain.workers[0][0]
        self.chain.store.transact(route_records("room", local, worker=(self.chain.host, worker.port)))

    def kill(self, name: str) -> None:
        self.scopes[name].cancel()

    async def start(self) -> httpx.Response:
        return await self.client.post(self.url + "/.proxyblocks/sessions", headers=auth())

    async def get(self, token: str, path: str = "/") -> httpx.Response:
        return await self.client.get(self.url + path, headers={"proxyblocks-session": token})


async def _serve_killable(name: str, scope: trio.CancelScope, *, task_status: trio.TaskStatus[object]) -> None:
    with scope:
        await serve_demo_replica(name, host="127.0.0.1", task_status=task_status)


@asynccontextmanager
async def room_chain(config: SessionConfig | None = None, **limits: object) -> AsyncIterator[Room]:
    """The chain with no replica yet; ``room.example`` routed to ``room``, sessioned by its settings."""
    config = config or SessionConfig(apps=(), queue_timeout=5.0)

    async def build(chain: Chain) -> None:
        await chain.start_worker({}, app=None, sessions=WorkerSessionConfig())
        verifier = TokenVerifier(Keyring([KEY]))
        await chain.start_proxy(sessions=config, session_issuer=ISSUER, session_verifier=verifier)
        await chain.start_edge()

    async with trio.open_nursery() as nursery:
        chain = await nursery.start(functools.partial(serve_chain, build))
        chain.store.transact({route_key_for_domain("room.example"): encode_domain("room")})
        async with httpx.AsyncClient(trust_env=False, headers=HOST_FIELD, timeout=20) as client:
            room = Room(chain, client)
            room.settings(**limits)
            yield room
        nursery.cancel_scope.cancel()


async def test_an_app_sessioned_by_its_route_store_record_takes_its_limits_from_it() -> None:
    with trio.fail_after(30):
        async with room_chain(max_per_replica=1, queue_size=1, queue_timeout=0.3) as room:
            await room.add_replicas("room-0", "room-1")
            first, second = await room.start(), await room.start()
            assert (first.status_code, second.status_code) == (201, 201)
            assert {first.json()["replica"], second.json()["replica"]} == {"room-0", "room-1"}  # one place each
            full = await room.start()  # the record's queue_timeout, not the config's 5 s
            assert full.status_code == 503, full.text
            assert full.headers["proxyblocks-error"].startswith("overloaded")

            room.settings(max_per_replica=2, ttl=60)  # a new record: the limits change at once
            third = await room.start()
            assert third.status_code == 201, third.text
            assert 55 <= third.json()["expires_at"] - time.time() <= 61  # the record's ttl
            pinned = await room.get(third.json()["token"])
            assert pinned.status_code == 200
            assert pinned.headers["x-replica"] == third.json()["replica"]

            room.chain.store.transact(deletes=[route_key_for_settings("room")])  # no record: not sessioned
            start = await room.start()
            await wait_for(lambda: start.status_code != 201)
            plain = await room.get(third.json()["token"])  # routed as any request, its token not read
            assert plain.status_code == 200


async def test_a_start_at_zero_replicas_waits_for_the_first_one() -> None:
    with trio.fail_after(30):
        async with room_chain(max_per_replica=4) as room:
            answers: list[httpx.Response] = []

            async def start() -> None:
                answers.append(await room.start())

            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(start)
                proxy = room.chain.proxies[0][1]
                assert proxy.sessions is not None
                await wait_for(lambda: proxy.sessions.statistics().queued.get("room") == 3)
                assert answers == []
                await room.add_replicas("room-0")
            assert [answer.status_code for answer in answers] == [201, 201, 201]
            assert {answer.json()["replica"] for answer in answers} == {"room-0"}


async def test_a_start_at_zero_replicas_gets_a_503_past_the_queue_timeout() -> None:
    with trio.fail_after(30):
        async with room_chain(queue_timeout=0.2) as room:
            answer = await room.start()
            assert answer.status_code == 503
            assert "retry-after" in answer.headers
        async with room_chain(queue_size=0) as room:
            answer = await room.start()  # no queue: no wait for a replica either
            assert answer.status_code == 503
            assert answer.headers["proxyblocks-error"].startswith("no_replica")


@pytest.mark.parametrize("protocol", ["h2", "h1"])  # (spliced, and the worker's handler path)
async def test_a_killed_replica_loses_its_sessions_once_and_never_sends_them_elsewhere(protocol: str) -> None:
    with trio.fail_after(30):
        async with room_chain(max_per_replica=8) as room:
            await room.add_replicas("room-0", "room-1", protocol=protocol)
            tokens = {}
            while set(tokens) != {"room-0", "room-1"} or len(tokens.get("room-0", [])) < 2:
                started = (await room.start()).json()
                tokens.setdefault(started["replica"], []).append(started["token"])
            room.kill("room-0")
            worker = room.chain.workers[0][1]
            answers = [await room.get(token) for token in tokens["room-0"]]
            assert [(lost.status_code, lost.headers["proxyblocks-session-ended"]) for lost in answers] == [
                (503, "replica-unreachable"),  # the first finds out; the worker ends them all
                *[(410, "not-hosted")] * (len(answers) - 1),
            ]
            for lost in answers:
                assert lost.headers["proxyblocks-error"] == "session_lost; hop=worker", lost.headers
            assert worker.sessions is not None
            statistics = worker.sessions.statistics()
            assert statistics.ended.get("lost") == len(tokens["room-0"])  # all at the first loss, once
            assert statistics.active["room-0"] == 0
            again = await room.get(tokens["room-0"][0])
            assert (again.status_code, again.headers["proxyblocks-session-ended"]) == (410, "not-hosted")
            for token in tokens["room-1"]:  # the other replica's sessions did not notice
                assert (await room.get(token)).headers["x-replica"] == "room-1"
            fresh = await room.start()
            assert fresh.status_code == 201
            assert fresh.json()["replica"] == "room-1"  # the worker refuses a start on a replica it cannot reach


async def test_sessions_that_may_move_restart_on_another_replica_with_a_new_token() -> None:
    with trio.fail_after(30):
        async with room_chain(max_per_replica=8, on_replica_loss="restart") as room:
            await room.add_replicas("room-0", "room-1")
            started = (await room.start()).json()
            gone, other = started["replica"], ({"room-0", "room-1"} - {started["replica"]}).pop()
            room.chain.store.transact(deletes=[f"apps/room/replicas/{gone}"])  # it left the routes
            moved = await room.get(started["token"])
            assert moved.status_code == 200, moved.text
            assert moved.headers["x-replica"] == other
            token = moved.headers["proxyblocks-session-token"]
            assert f"proxyblocks-session={token}" in moved.headers["set-cookie"]
            again = await room.get(token)
            assert again.status_code == 200
            assert again.headers["x-replica"] == other
            assert "proxyblocks-session-token" not in again.headers  # moved once
            proxy = room.chain.proxies[0][1]
            assert proxy.sessions is not None
            assert proxy.sessions.statistics().restarted == 1


async def test_sessions_that_may_move_restart_after_their_worker_lost_the_replica() -> None:
    with trio.fail_after(30):
        async with room_chain(max_per_replica=8, on_replica_loss="restart") as room:
            await room.add_replicas("room-0", "room-1")
            started = (await room.start()).json()
            gone = started["replica"]
            room.kill(gone)
            lost = await room.get(started["token"])  # the loss is heard on this answer
            assert lost.status_code == 503
            assert lost.headers["proxyblocks-session-ended"] == "replica-unreachable"
            moved = await room.get(started["token"])  # and the next request of the session moves
            assert moved.status_code == 200, moved.text
            assert moved.headers["x-replica"] != gone
            token = moved.headers["proxyblocks-session-token"]
            claims = TokenVerifier(Keyring([KEY])).verify(token, now=time.time(), app="room", kind="session")
            assert claims.replica == moved.headers["x-replica"]
