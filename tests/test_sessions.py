"""Sticky sessions end to end: edge -> proxy (sessions, proxy auth) -> worker (sessions) -> replicas.

One sessioned app, ``room`` (``room.example``), requires a proxy-auth token
and has two replicas behind one worker; a second app, ``open``, is neither
sessioned nor protected. Each replica records every request that reaches it
with its session id (``x-proxyblocks-session``), so a test can say which
replica served what.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``,
real clients (httpx over h2 and h1). Token times are wall-clock, as the
proxy reads them.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio
from support import HOST, wait_for

from blocks import (
    EdgeConfig,
    HTTPServer,
    Keyring,
    ListenerConfig,
    LocalReplica,
    ProberConfig,
    Proxy,
    ProxyAuth,
    Replica,
    Request,
    Response,
    RouteTable,
    SessionConfig,
    TokenIssuer,
    TokenKey,
    TokenVerifier,
    Worker,
    WorkerSessionConfig,
    serve_edge,
    serve_http,
    serve_proxy,
    serve_worker,
    text_response,
)
from blocks.prober import AutoscaleConfig, AutoscaleSignal

KEY = TokenKey.hmac("k1", bytes(range(32)))
ISSUER = TokenIssuer(KEY)
ROOM = "room.example"
OPEN = "open.example"
FAST_PROBER = ProberConfig(interval=0.05, timeout=0.05, stale_after=0.5)


def auth_token(app: str = "room", tenant: str = "acme") -> str:
    return ISSUER.mint(app=app, tenant=tenant, now=time.time(), ttl=300.0)


@attrs.define(eq=False)
class SessionReplica:
    """Records ``(path, session id)`` of every request; ``/hold`` waits for :meth:`release`."""

    name: str
    arrivals: list[tuple[bytes, bytes | None]] = attrs.field(factory=list)
    _gate: trio.Event = attrs.field(factory=trio.Event)

    def release(self) -> None:
        self._gate.set()
        self._gate = trio.Event()

    async def __call__(self, request: Request) -> Response:
        self.arrivals.append((request.path, request.header(b"x-proxyblocks-session")))
        if request.path == b"/hold":
            await self._gate.wait()
        return text_response(200, self.name, [(b"x-replica", self.name.encode())])


@attrs.define
class SessionChain:
    edge: HTTPServer
    proxy: Proxy
    worker: Worker
    routes: RouteTable
    replicas: dict[str, SessionReplica]
    autoscale: AutoscaleSignal

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.edge.port}"

    def served(self) -> dict[str, int]:
        return {name: len(replica.arrivals) for name, replica in self.replicas.items()}


async def assemble_sessions(
    nursery: trio.Nursery,
    *,
    max_sessions: int = 0,
    idle_timeout: float = 300.0,
    protect_pages: bool = True,
    routed: bool = False,
    **config: Any,
) -> SessionChain:
    """The chain; with ``routed``, the worker lists only ``open-0`` and reaches the room's replicas by their
    route (as it reaches those an autoscaler starts)."""
    replicas = {name: SessionReplica(name) for name in ("room-0", "room-1", "open-0")}
    local = {}
    for name, handler in replicas.items():
        server = await nursery.start(functools.partial(serve_http, handler, config=ListenerConfig()))
        local[name] = LocalReplica((HOST, server.port), "h2", max_sessions=max_sessions)
    listed = {"open-0": local["open-0"]} if routed else local
    worker_server, worker = await nursery.start(
        functools.partial(serve_worker, listed, sessions=WorkerSessionConfig(idle_timeout=idle_timeout))
    )
    worker_address = (HOST, worker_server.port)
    routes = RouteTable.build(
        {ROOM: "room", OPEN: "open"},
        {
            "room": [Replica(name=n, worker=worker_address, address=local[n].address) for n in ("room-0", "room-1")],
            "open": [Replica(name="open-0", worker=worker_address, address=local["open-0"].address)],
        },
    )
    verifier = TokenVerifier(Keyring([KEY]))
    autoscale = AutoscaleSignal(AutoscaleConfig(target_concurrency=1))
    proxy_server, proxy = await nursery.start(
        functools.partial(
            serve_proxy,
            routes,
            auth=ProxyAuth(verifier, apps={"room"}) if protect_pages else None,
            sessions=SessionConfig(apps={"room"}, **config),
            session_issuer=ISSUER,
            session_verifier=verifier,
            prober=FAST_PROBER,
            autoscale=autoscale,
        )
    )
    edge = await nursery.start(serve_edge, EdgeConfig(proxy=(HOST, proxy_server.port)))
    return SessionChain(edge, proxy, worker, routes, replicas, autoscale)


@asynccontextmanager
async def client(*, http2: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(http2=http2, http1=not http2, trust_env=False, timeout=20) as c:
        yield c


async def start_session(c: httpx.AsyncClient, chain: SessionChain, token: str | None = None) -> httpx.Response:
    response = await c.post(
        chain.url + "/.proxyblocks/sessions",
        headers={"host": ROOM, "authorization": f"Bearer {token or auth_token()}"},
    )
    c.cookies.clear()  # httpx keeps what set-cookie gave it: each test says which token it sends
    return response


def session_headers(session_token: str) -> dict[str, str]:
    return {"host": ROOM, "proxyblocks-session": session_token}


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "h1"])
async def test_every_request_of_a_session_reaches_its_replica_with_its_id(nursery: trio.Nursery, http2: bool) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery)
        async with client(http2=http2) as c:
            started = await start_session(c, chain)
            assert started.status_code == 201, started.text
            answer = started.json()
            assert set(answer) == {"session", "token", "replica", "expires_at"}
            assert answer["replica"] in ("room-0", "room-1")
            assert answer["expires_at"] > time.time() + 3000
            cookie = started.headers["set-cookie"]
            assert cookie.startswith(f"proxyblocks-session={answer['token']};")
            assert "SameSite=Strict" in cookie and "Path=/" in cookie
            assert started.headers["cache-control"] == "no-store"
            # no proxy-auth token needed now: the session token opens its app
            for i in range(20):
                response = await c.get(f"{chain.url}/r/{i}", headers=session_headers(answer["token"]))
                assert response.status_code == 200
                assert response.headers["x-replica"] == answer["replica"]
            # the cookie carries it just as well (a browser, its WebSocket)
            response = await c.get(
                chain.url + "/by-cookie",
                headers={"host": ROOM, "cookie": f"theme=dark; proxyblocks-session={answer['token']}"},
            )
            assert response.headers["x-replica"] == answer["replica"]
        replica = chain.replicas[answer["replica"]]
        session_id = answer["session"].encode()
        assert len(replica.arrivals) == 21
        assert all(sid == session_id for _, sid in replica.arrivals)
        other = "room-1" if answer["replica"] == "room-0" else "room-0"
        assert chain.replicas[other].arrivals == []
        stats = chain.worker.sessions.statistics() if chain.worker.sessions else None
        assert stats is not None and stats.active[answer["replica"]] == 1 and stats.opened == 1


async def test_starts_spread_over_the_replicas_and_need_a_proxy_auth_token(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery)
        async with client() as c:
            refused = await c.post(chain.url + "/.proxyblocks/sessions", headers={"host": ROOM})
            assert refused.status_code == 401
            wrong_app = await start_session(c, chain, auth_token("open"))
            assert wrong_app.status_code == 401
            assert chain.worker.sessions is not None and chain.worker.sessions.statistics().opened == 0
            placed = [(await start_session(c, chain)).json()["replica"] for _ in range(6)]
        assert sorted(placed) == ["room-0"] * 3 + ["room-1"] * 3
        assert chain.served() == {"room-0": 0, "room-1": 0, "open-0": 0}  # starts are the worker's business


BAD_SESSION_TOKENS = [
    pytest.param(lambda t: t[:-4] + ("AAAA" if not t.endswith("AAAA") else "BBBB"), id="forged"),
    pytest.param(lambda t: "garbage", id="garbage"),
    pytest.param(lambda t: auth_token(), id="a proxy-auth token"),
    pytest.param(
        lambda t: ISSUER.mint(app="open", now=time.time(), ttl=60, kind="session", session_id="x", replica="room-0"),
        id="another app's session",
    ),
    pytest.param(
        lambda t: ISSUER.mint(
            app="room", now=time.time() - 600, ttl=60, kind="session", session_id="x", replica="room-0"
        ),
        id="expired",
    ),
]


@pytest.mark.parametrize("tamper", BAD_SESSION_TOKENS)
async def test_a_bad_session_token_is_a_401_that_reaches_nothing(nursery: trio.Nursery, tamper: Any) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery)
        async with client() as c:
            token = (await start_session(c, chain)).json()["token"]
            response = await c.get(chain.url + "/x", headers=session_headers(tamper(token)))
            assert response.status_code == 401
            # the good one still works, and the bad one harmed nothing
            assert (await c.get(chain.url + "/y", headers=session_headers(token))).status_code == 200
        assert sum(chain.served().values()) == 1


async def test_a_session_whose_replica_left_the_routes_gets_410_never_another_replica(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery)
        async with client() as c:
            answer = (await start_session(c, chain)).json()
            name = answer["replica"]
            chain.routes.apps["room"] = [r for r in chain.routes.apps["room"] if r.name != name]
            response = await c.get(chain.url + "/after", headers=session_headers(answer["token"]))
            assert response.status_code == 410
            assert response.headers["proxyblocks-session-ended"] == "replica-gone"
            # a down replica is gone too
            chain.routes.apps["room"] = [attrs.evolve(r, state="down") for r in chain.routes.apps["room"]]
            second = (await start_session(c, chain)).status_code
            assert second == 503  # no live replica to start one on
        assert chain.served() == {"room-0": 0, "room-1": 0, "open-0": 0}
        assert chain.proxy.sessions is not None and chain.proxy.sessions.statistics().gone == 1


async def test_terminate_ends_the_session_and_frees_its_place(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery, max_sessions=1, queue_timeout=10.0)
        async with client() as c, trio.open_nursery() as waiting:
            first = (await start_session(c, chain)).json()
            second = (await start_session(c, chain)).json()
            assert {first["replica"], second["replica"]} == {"room-0", "room-1"}
            third: list[httpx.Response] = []

            async def start_third() -> None:
                third.append(await start_session(c, chain))

            waiting.start_soon(start_third)
            assert chain.proxy.sessions is not None
            await wait_for(lambda: chain.proxy.sessions.statistics().queued["room"] == 1, "the third start queued")
            unauthorized = await c.delete(chain.url + "/.proxyblocks/sessions", headers={"host": ROOM})
            assert unauthorized.status_code == 401
            ended = await c.delete(chain.url + "/.proxyblocks/sessions", headers=session_headers(first["token"]))
            assert ended.status_code == 204
            assert "Max-Age=0" in ended.headers["set-cookie"]
        assert third[0].status_code == 201
        assert third[0].json()["replica"] == first["replica"]  # the place the terminate freed
        async with client() as c:
            gone = await c.get(chain.url + "/x", headers=session_headers(first["token"]))
            assert gone.status_code == 410  # the worker no longer hosts it
            assert gone.headers["proxyblocks-session-ended"] == "not-hosted"
            ok = await c.get(chain.url + "/x", headers=session_headers(second["token"]))
            assert ok.status_code == 200
        assert chain.worker.sessions is not None
        assert chain.worker.sessions.statistics().ended["terminated"] == 1


async def test_a_full_app_queues_starts_to_a_deadline_then_503_and_a_full_queue_429(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery, max_sessions=1, queue_timeout=0.3, queue_size=1, retry_after=2.0)
        async with client() as c:
            for _ in range(2):
                assert (await start_session(c, chain)).status_code == 201
            results: list[int] = []

            async def start() -> None:
                results.append((await start_session(c, chain)).status_code)

            began = trio.current_time()
            async with trio.open_nursery() as starts:
                starts.start_soon(start)
                assert chain.proxy.sessions is not None
                await wait_for(lambda: chain.proxy.sessions.statistics().queued["room"] == 1, "one queued")
                full = await start_session(c, chain)
                assert full.status_code == 429
                assert full.headers["retry-after"] == "2"
            assert results == [503]
            assert trio.current_time() - began >= 0.3  # it did wait its deadline
        stats = chain.proxy.sessions.statistics()
        assert (stats.queue_full, stats.timed_out, stats.queued["room"]) == (1, 1, 0)


async def test_idle_sessions_end_at_the_worker_and_the_proxy_hears_of_it(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery, max_sessions=1, idle_timeout=0.3, queue_timeout=10.0)
        async with client() as c:
            first = (await start_session(c, chain)).json()
            second = (await start_session(c, chain)).json()
            # a request in flight keeps its session alive past the idle timeout
            async with trio.open_nursery() as held:
                held.start_soon(functools.partial(c.get, chain.url + "/hold", headers=session_headers(second["token"])))
                await wait_for(lambda: chain.replicas[second["replica"]].arrivals != [], "held")
                # the third start waits until the worker ends the idle first session
                third = await start_session(c, chain)
                assert third.status_code == 201
                assert third.json()["replica"] == first["replica"]
                await trio.sleep(0.5)
                assert (await c.get(chain.url + "/x", headers=session_headers(first["token"]))).status_code == 410
                chain.replicas[second["replica"]].release()
            # the held request's session lived: it goes on
            assert (await c.get(chain.url + "/y", headers=session_headers(second["token"]))).status_code == 200
        assert chain.worker.sessions is not None
        assert chain.worker.sessions.statistics().ended["idle"] >= 1


async def test_the_worker_reports_sessions_and_autoscaling_counts_them(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery, max_sessions=4)
        async with client() as c:
            for _ in range(3):
                assert (await start_session(c, chain)).status_code == 201
        loads = chain.worker.load()
        assert loads["room-0"].sessions + loads["room-1"].sessions == 3  # type: ignore[operator]
        assert loads["room-0"].session_capacity == 4
        document = json.loads(chain.worker.load_response().body.data)  # type: ignore[attr-defined]
        assert document["replicas"]["room-0"]["session_capacity"] == 4

        def counted() -> bool:
            try:
                signal = chain.autoscale.recommend("room", trio.current_time())
            except KeyError:
                return False
            # 3 sessions, a target of 1 per replica, nothing in flight: 3 replicas wanted
            return signal.recommendation == "up" and signal.desired_replicas == 3

        await wait_for(
            counted,
            lambda: f"the autoscale signal counts sessions: {chain.autoscale.recommend('room', trio.current_time())}",
        )


async def test_sessions_leave_other_apps_and_plain_requests_alone(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery)
        async with client() as c:
            # the open app: no token, no session, its own path for /.proxyblocks/sessions
            response = await c.post(chain.url + "/.proxyblocks/sessions", headers={"host": OPEN})
            assert response.status_code == 200 and response.text == "open-0"
            # the room app without a session token: routed by the policy, with its auth token
            plain = await c.get(chain.url + "/page", headers={"host": ROOM, "authorization": f"Bearer {auth_token()}"})
            assert plain.status_code == 200
            assert (
                await c.put(
                    chain.url + "/.proxyblocks/sessions",
                    headers={"host": ROOM, "authorization": f"Bearer {auth_token()}"},
                )
            ).status_code == 405
        assert chain.replicas["open-0"].arrivals == [(b"/.proxyblocks/sessions", None)]
        assert sum(len(chain.replicas[n].arrivals) for n in ("room-0", "room-1")) == 1


async def test_a_start_needs_a_proxy_auth_token_even_where_the_pages_are_public(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery, protect_pages=False)
        async with client() as c:
            page = await c.get(chain.url + "/", headers={"host": ROOM})
            assert page.status_code == 200
            refused = await c.post(chain.url + "/.proxyblocks/sessions", headers={"host": ROOM})
            assert refused.status_code == 401
            forged = await c.post(
                chain.url + "/.proxyblocks/sessions", headers={"host": ROOM, "authorization": "Bearer " + "x" * 40}
            )
            assert forged.status_code == 401
            started = await start_session(c, chain)
            assert started.status_code == 201
            session = started.json()
            # its requests still need no other token
            response = await c.get(chain.url + "/in", headers=session_headers(session["token"]))
            assert response.headers["x-replica"] == session["replica"]
        assert chain.worker.sessions is not None and chain.worker.sessions.statistics().opened == 1


async def test_a_replica_the_worker_reaches_by_its_route_keeps_sessions_like_a_listed_one(
    nursery: trio.Nursery,
) -> None:
    """One an autoscaler started: the worker does not list it, the proxy's start names where it is."""
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery, routed=True, max_per_replica=2, queue_timeout=0.2)
        assert list(chain.worker.replicas) == ["open-0"]
        async with client() as c:
            answers = [(await start_session(c, chain)).json() for _ in range(4)]
            assert sorted(a["replica"] for a in answers) == ["room-0", "room-0", "room-1", "room-1"]
            full = await start_session(c, chain)
            assert full.status_code == 503  # max_per_replica caps a replica whose own limit is unknown
            for a in answers:
                response = await c.get(chain.url + "/x", headers=session_headers(a["token"]))
                assert (response.status_code, response.headers["x-replica"]) == (200, a["replica"])
            loads = chain.worker.load()
            # the worker took each on and holds it to the proxy's max_per_replica (its own limit, reported: none)
            assert [(loads[n].sessions, loads[n].session_capacity) for n in ("room-0", "room-1")] == [(2, 0), (2, 0)]
            ended = await c.delete(chain.url + "/.proxyblocks/sessions", headers=session_headers(answers[0]["token"]))
            assert ended.status_code == 204
            gone = await c.get(chain.url + "/x", headers=session_headers(answers[0]["token"]))
            assert (gone.status_code, gone.headers["proxyblocks-session-ended"]) == (410, "not-hosted")  # the worker's
            # a session id the worker never opened there: a 410 from the worker too, never served
            forged = ISSUER.mint(
                app="room", now=time.time(), ttl=60, kind="session", session_id="nope", replica=answers[1]["replica"]
            )
            stray = await c.get(chain.url + "/x", headers=session_headers(forged))
            assert (stray.status_code, stray.headers["proxyblocks-session-ended"]) == (410, "not-hosted")
        assert chain.worker.sessions is not None
        stats = chain.worker.sessions.statistics()
        assert (stats.active, stats.opened, stats.unknown) == ({"open-0": 0, "room-0": 1, "room-1": 2}, 4, 2)
        assert sum(len(chain.replicas[n].arrivals) for n in ("room-0", "room-1")) == 4


async def test_a_session_control_request_without_a_usable_target_takes_on_nothing(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        chain = await assemble_sessions(nursery, routed=True)
        host, port = chain.routes.apps["room"][0].worker
        fields = {"x-proxyblocks-probe": "1", "x-proxyblocks-session": "s1", "x-proxyblocks-replica": "room-9"}
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", trust_env=False) as c:
            unnamed = await c.post("/.proxyblocks/sessions", headers=fields)
            assert unnamed.status_code == 404  # no target: not a replica this worker reaches
            unusable = await c.post("/.proxyblocks/sessions", headers={**fields, "x-proxyblocks-target": "h2 nowhere"})
            assert unusable.status_code == 503
            target = chain.routes.apps["room"][0].target.decode()
            opened = await c.post("/.proxyblocks/sessions", headers={**fields, "x-proxyblocks-target": target})
            assert (opened.status_code, opened.json()["active"], opened.json()["capacity"]) == (201, 1, 0)
        assert chain.worker.sessions is not None
        assert chain.worker.sessions.statistics().active == {"open-0": 0, "room-9": 1}
