"""Sessions across a fleet of processes: any proxy routes a session by its token alone, the worker beside
its replica counts it.

The fleet (:class:`~blocks.testing.ProcessFleet` on a real etcd): an edge,
2 proxies and 2 workers, each ``python -m recipes.chain --role ...
--route-source ETCD --config FILE``; the proxies share the session key
through the file's ``[sessions]`` and ``[[sessions.keys]]`` (nothing else:
no state passes between them). The replicas are not this project's code:
``tests/asgi_replica.py`` under Hypercorn, over h2c and HTTP/1.1, each
beside one worker, which registers it in etcd (the app ``demo``, every
domain), and one more (the app ``side``, ``side.test``) that routectl puts
in etcd behind worker-2, which was not started with it: that worker learns
of it from the proxies' session starts.

A session starts through the edge with a proxy-auth token, then sends
requests and opens WebSockets carrying its token (in the header, or the
cookie); the replica answers with its own id and the ``x-proxyblocks-session``
it saw, which must be the session's replica and id, every time.

Rules: loopback only, ports picked by the kernel, every process ended by
its PID; every test bounded by ``trio.fail_after`` and waiting for states
(a proxy routing a domain, an answer), never for a duration. The fleet is
started by the ``start_fleet`` fixture with the test's ``[sessions]``
settings, so further tests (the autoscaler scaling on queued starts, a
killed replica's ``session_lost``, scale from zero) add to it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import http.cookiejar
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio_websocket
from etcd_server import open_etcd
from support import REPO, h2_client

from blocks._sync import one_error
from blocks.testing import ProcessFleet, serve_demo_replica
from blocks.timing import parse_server_timing
from blocks.tokens import TokenIssuer, TokenKey
from blocks.topology import hop_options, read_sessions
from recipes.chain import main

PY = sys.executable
HOST = "127.0.0.1"
HYPERCORN = [PY, "-m", "hypercorn", "tests.asgi_replica:app", "--bind", "127.0.0.1:{port}", "-k", "trio", "-w", "0"]
REPLICAS = {
    "h2c-1": (HYPERCORN, r"Running on", "h2c"),
    "h1-1": (HYPERCORN, r"Running on", "http"),
    "h2c-2": (HYPERCORN, r"Running on", "h2c"),
    "side": (HYPERCORN, r"Running on", "http"),  # beside no worker's flags: put in etcd by routectl
}
BESIDE = {"worker-1": ["h2c-1", "h1-1"], "worker-2": ["h2c-2"]}
SIDE = "side.test"
SECRET = "5e55107f1ee7b10c5e55107f1ee7b10c5e55107f1ee7b10c5e55107f1ee7b10c"  # a test key, nothing else
ISSUER = TokenIssuer(TokenKey.hmac("fleet", bytes.fromhex(SECRET)))
CONFIG = """\
[sessions]
apps = ["demo", "side"]
idle_timeout = 600
{settings}
[[sessions.keys]]
kid = "fleet"
secret_file = "fleet.secret"
"""


@attrs.define(eq=False)
class Session:
    """A session as its client knows it: the start's answer."""

    app: str
    id: str
    token: str
    replica: str
    cookie: bool  # it carries its token in the cookie (else the header)

    def fields(self) -> list[tuple[bytes, bytes]]:
        host = [(b"host", SIDE.encode())] if self.app == "side" else []
        if self.cookie:
            return [*host, (b"cookie", b"proxyblocks-session=" + self.token.encode())]
        return [*host, (b"proxyblocks-session", self.token.encode())]


@attrs.frozen
class Seen:
    """One exchange of a session: when it ran (trio's clock), whether it got through (``error``
    otherwise), what the replica said it is and which session it saw, and the proxies it crossed."""

    session: Session
    kind: str  # "request", "websocket" (opened: the replica's hello), "echo"
    start: float
    end: float
    error: str = ""
    replica: str = ""
    session_id: str = ""
    proxies: frozenset[str] = frozenset()
    leaked: bool = False  # the replica saw the session token itself


def proxies_in(timing: str) -> frozenset[str]:
    return frozenset(hop for hop in parse_server_timing(timing.encode()) if re.fullmatch(r"proxy-\d+", hop))


@attrs.define(eq=False)
class SessionFleet:
    """The fleet and a client of it: starts sessions through the edge and keeps what each exchange saw."""

    fleet: ProcessFleet
    ids: dict[str, str]  # a replica's name in the routes (and the tokens) -> the id it answers with
    client: httpx.AsyncClient
    seen: list[Seen] = attrs.field(factory=list)
    _count: int = 0

    @property
    def url(self) -> str:
        return self.fleet.url

    def auth(self, app: str) -> str:
        return "Bearer " + ISSUER.mint(app=app, tenant="fleet", now=time.time(), ttl=600)

    async def start(self, app: str = "demo") -> httpx.Response:
        """``POST /.proxyblocks/sessions`` through the edge, with a proxy-auth token for ``app``."""
        headers = {"authorization": self.auth(app), **({"host": SIDE} if app == "side" else {})}
        return await self.client.post(self.url + "/.proxyblocks/sessions", headers=headers)

    async def session(self, app: str = "demo") -> Session:
        """A session of ``app`` started (201, or the test fails saying why)."""
        answer = await self.start(app)
        assert answer.status_code == 201, (answer.status_code, answer.headers.get("proxyblocks-error"))
        body = answer.json()
        self._count += 1
        return Session(app, body["session"], body["token"], body["replica"], cookie=self._count % 2 == 0)

    async def request(self, session: Session) -> Seen:
        """``GET /headers`` of ``session``: the replica's id (``x-replica``) and the headers it saw."""
        start = trio.current_time()
        try:
            response = await self.client.get(self.url + "/headers", headers=session.fields())
        except httpx.HTTPError as exc:
            return self._saw(Seen(session, "request", start, trio.current_time(), error=f"client: {exc!r}"))
        end = trio.current_time()
        if response.status_code != 200:
            error = f"{response.status_code} {response.headers.get('proxyblocks-error')}"
            return self._saw(Seen(session, "request", start, end, error=error))
        lines = dict(line.split(": ", 1) for line in response.text.splitlines())
        return self._saw(
            Seen(
                session,
                "request",
                start,
                end,
                replica=response.headers["x-replica"],
                session_id=lines.get("x-proxyblocks-session", ""),
                proxies=proxies_in(response.headers["server-timing"]),
                leaked="proxyblocks-session" in lines or session.token in response.text,
            )
        )

    @contextlib.asynccontextmanager
    async def websocket(self, session: Session) -> AsyncIterator[trio_websocket.WebSocketConnection]:
        """A WebSocket of ``session`` to the replica's ``/ws-echo``, its hello recorded; closed at the end."""
        start = trio.current_time()
        stream = await trio.open_tcp_stream(HOST, self.fleet.parts["edge"].port)
        host = SIDE if session.app == "side" else f"{HOST}:{self.fleet.parts['edge'].port}"
        fields = [field for field in session.fields() if field[0] != b"host"]
        with one_error():  # (a cut WebSocket's ConnectionClosed as itself)
            async with stream, trio.open_nursery() as nursery:
                ws = await trio_websocket.wrap_client_stream(nursery, stream, host, "/ws-echo", extra_headers=fields)
                try:
                    replica, _, seen = str(await ws.get_message()).partition(" ")
                    self._saw(Seen(session, "websocket", start, trio.current_time(), replica=replica, session_id=seen))
                    yield ws
                finally:
                    with trio.move_on_after(5):
                        await ws.aclose()
                    nursery.cancel_scope.cancel()

    async def echo(self, session: Session, ws: trio_websocket.WebSocketConnection) -> None:
        """One message there and back (``ConnectionClosed`` if the WebSocket was cut)."""
        start = trio.current_time()
        text = f"{session.id} {start}"
        await ws.send_message(text)
        assert await ws.get_message() == text
        self._saw(Seen(session, "echo", start, trio.current_time()))

    async def round(self, session: Session, requests: int = 2) -> None:
        """``requests`` requests, then a WebSocket: its hello, an echo, a close."""
        for _ in range(requests):
            await self.request(session)
        async with self.websocket(session) as ws:
            await self.echo(session, ws)

    def _saw(self, seen: Seen) -> Seen:
        self.seen.append(seen)
        return seen

    def wrong(self) -> list[Seen]:
        """The exchanges that got through to another replica or session than theirs, or showed the token."""
        return [
            s
            for s in self.seen
            if not s.error
            and s.kind != "echo"
            and (s.replica != self.ids[s.session.replica] or s.session_id != s.session.id or s.leaked)
        ]

    async def loads(self) -> dict[str, dict[str, Any]]:
        """Each worker's ``/.proxyblocks/load``: replica -> its figures (``sessions``, ``session_capacity``...)."""
        found = {}
        async with h2_client() as c:
            for worker in ("worker-1", "worker-2"):
                port = self.fleet.parts[worker].port
                answer = await c.get(f"http://{HOST}:{port}/.proxyblocks/load", headers={"x-proxyblocks-probe": "1"})
                found[worker] = answer.json()["replicas"]
        return found

    async def routed(self, proxy: str, host: str) -> str:
        """The replica id a plain request for ``host`` reaches through ``proxy`` (no session)."""
        async with h2_client() as c:
            answer = await c.get(f"http://{HOST}:{self.fleet.parts[proxy].port}/hello", headers={"host": host})
            return answer.headers.get("x-replica", "")


@pytest.fixture
async def start_fleet(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[SessionFleet]]]:
    """``await start_fleet(**settings)``: the fleet, its ``[sessions]`` table with ``settings`` added
    (``max_per_replica=2``...), once every proxy routes both apps. Everything stops with the test."""
    async with contextlib.AsyncExitStack() as stack, trio.open_nursery() as nursery:

        async def start(**settings: float) -> SessionFleet:
            etcd = await stack.enter_async_context(open_etcd(tmp_path))
            (tmp_path / "fleet.secret").write_text(SECRET + "\n")
            config = tmp_path / "fleet.toml"
            config.write_text(CONFIG.format(settings="".join(f"{k} = {v}\n" for k, v in settings.items())))
            fleet = ProcessFleet(
                REPLICAS, cwd=REPO, extra=["--config", str(config)], route_source=etcd.url, beside=BESIDE
            )
            await nursery.start(fleet.run)
            ids = {routed: f"hypercorn-{fleet.parts[part].port}" for part, routed in fleet.routed.items()}
            ids["side-0"] = side = f"hypercorn-{fleet.parts['side'].port}"
            # side-0: in etcd behind worker-2, as an operator puts it there (worker-2 was not started with it)
            routectl = [PY, "-m", "blocks.routectl", "--etcd", etcd.url]
            worker, address = (f"{HOST}:{fleet.parts[part].port}" for part in ("worker-2", "side"))
            put = ["put-replica", "side", "side-0", "--worker", worker, "--address", address, "--protocol", "h1"]
            await trio.run_process([*routectl, *put], capture_stdout=True)
            await trio.run_process([*routectl, "put-domain", SIDE, "side"], capture_stdout=True)
            no_jar = http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
            client = httpx.AsyncClient(
                trust_env=False, cookies=no_jar, timeout=60, limits=httpx.Limits(max_connections=64)
            )
            await stack.enter_async_context(client)
            sessions = SessionFleet(fleet, ids, client)
            for proxy in ("proxy-1", "proxy-2"):  # both follow etcd: the side app is routed
                while await sessions.routed(proxy, SIDE) != side:
                    await trio.sleep(0.05)
            return sessions

        yield start
        nursery.cancel_scope.cancel()


def described(seen: list[Seen]) -> str:
    return str(collections.Counter(f"{s.kind}: {s.error or s.replica}" for s in seen))


async def test_every_exchange_of_a_session_reaches_its_replica_through_any_proxy_even_across_a_proxy_crash(
    start_fleet: Callable[..., Awaitable[SessionFleet]],
) -> None:
    """200 sessions: 100 start, then hold a WebSocket open while their requests flow and proxy-1 is killed
    (``kill -9``); every session carries on through proxy-2 from its token alone; 100 more start after."""
    with trio.fail_after(360):
        fleet = await start_fleet()
        limit = trio.CapacityLimiter(16)
        first: list[Session] = []  # started before the kill
        second: list[Session] = []  # after it
        opened = trio.Event()
        killed = trio.Event()
        release = trio.Event()
        carried: set[str] = set()  # the first sessions whose WebSocket echoed after the kill
        cut: list[Session] = []  # those whose WebSocket the kill cut, and that opened it again

        async def hold(app: str) -> None:
            """A session that keeps its WebSocket open until released; one cut by the kill opens again."""
            async with limit:
                session = await fleet.session(app)
                first.append(session)
                for _ in range(2):
                    await fleet.request(session)
            while True:
                try:
                    async with fleet.websocket(session) as ws:
                        await fleet.echo(session, ws)
                        if len(first) == 100 and sum(s.kind == "echo" for s in fleet.seen) >= 100:
                            opened.set()
                        await killed.wait()
                        await fleet.echo(session, ws)
                        await fleet.request(session)
                        carried.add(session.id)
                        await release.wait()
                    return
                except trio_websocket.ConnectionClosed:
                    assert killed.is_set(), f"session {session.id}: its WebSocket was cut with no fault"
                    cut.append(session)

        steady_since = 0.0
        stop = trio.Event()

        async def steady(k: int) -> None:
            """Requests of the first sessions, back to back, while the proxy dies."""
            j = k
            while not stop.is_set():
                await fleet.request(first[j % len(first)])
                j += 8

        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(hold, "side" if i % 4 == 0 else "demo")
            await opened.wait()
            steady_since = trio.current_time()
            for k in range(8):
                nursery.start_soon(steady, k)
            while sum(s.kind == "request" and s.start >= steady_since for s in fleet.seen) < 40:
                await trio.sleep(0.01)

            fault = trio.current_time()
            fleet.fleet.kill("proxy-1")
            await fleet.fleet.wait_dead("proxy-1")
            killed.set()
            while len(carried) < 100:  # each first session: an echo (through proxy-2, or opened anew), a request
                await trio.sleep(0.01)
            stop.set()

            async def later(app: str) -> None:
                async with limit:
                    session = await fleet.session(app)
                    second.append(session)
                    await fleet.round(session)

            async with trio.open_nursery() as after:
                for i in range(100):
                    after.start_soon(later, "side" if i % 4 == 0 else "demo")
            release.set()

        sessions = first + second
        assert len({s.id for s in sessions}) == 200
        assert not fleet.wrong(), described(fleet.wrong())
        failed = [s for s in fleet.seen if s.error]
        assert all(s.start < fault < s.end for s in failed), f"failed outside the kill: {described(failed)}"
        # Before the kill, the edge spread each session's requests over both proxies, whichever minted its token;
        # after it, every session went on through proxy-2.
        before = collections.defaultdict(set)
        for s in fleet.seen:
            if s.end < fault and s.proxies:
                before[s.session.id] |= s.proxies
        assert sum(proxies == {"proxy-1", "proxy-2"} for proxies in before.values()) >= 10
        after = [s for s in fleet.seen if s.start > fault and s.proxies]
        assert all(s.proxies == {"proxy-2"} for s in after)
        assert {s.session.id for s in after} == {s.id for s in sessions}
        assert cut, "the kill cut the WebSockets through proxy-1"
        for session in cut:  # opened again on the same replica, for the same session (checked by wrong())
            assert sum(s.kind == "websocket" and s.session is session for s in fleet.seen) == 2

        # The worker beside each replica counts its sessions, side-0's too (worker-2 learned of it from a start).
        placed = collections.Counter(s.replica for s in sessions)
        loads = await fleet.loads()
        counted = {name: load["sessions"] for worker in loads.values() for name, load in worker.items()}
        assert counted == placed
        assert placed["side-0"] == 50 and "side-0" in loads["worker-2"]


QUEUE_TIMEOUT = 5.0


async def test_a_full_replica_makes_starts_wait_then_answers_503_past_the_queue_timeout(
    start_fleet: Callable[..., Awaitable[SessionFleet]],
) -> None:
    """Two places per replica (3 demo replicas, and side-0 which no worker lists): a burst through both
    proxies fills them exactly, the rest wait; a place freed goes to one of them; the others get a
    503 with ``retry-after`` no sooner than the queue timeout."""
    with trio.fail_after(240):
        fleet = await start_fleet(max_per_replica=2, queue_timeout=QUEUE_TIMEOUT)
        answers: dict[str, list[tuple[httpx.Response, float]]] = {"demo": [], "side": []}

        async def start(app: str) -> None:
            began = trio.current_time()
            answer = await fleet.start(app)
            answers[app].append((answer, trio.current_time() - began))

        def placed(app: str) -> list[str]:
            return [answer.json()["token"] for answer, _ in answers[app] if answer.status_code == 201]

        async with trio.open_nursery() as nursery:
            for app, n in (("demo", 9), ("side", 4)):
                for _ in range(n):
                    nursery.start_soon(start, app)
            while len(placed("demo")) < 6 or len(placed("side")) < 2:
                await trio.sleep(0.01)
            loads = await fleet.loads()
            figures = {
                name: (load["sessions"], load["session_capacity"]) for w in loads.values() for name, load in w.items()
            }
            # The workers hold every replica to its 2 places: a listed one by its own max_sessions (reported),
            # side-0 by the proxies' max_per_replica (reported as no limit of its own).
            expected = {name: (2, 0 if name == "side-0" else 2) for name in fleet.ids}
            assert figures == expected, "the workers hold every replica to its 2 places"
            for app in ("demo", "side"):  # one session of each ends: its place goes to a start waiting for it
                headers = {"proxyblocks-session": placed(app)[0], **({"host": SIDE} if app == "side" else {})}
                ended = await fleet.client.delete(fleet.url + "/.proxyblocks/sessions", headers=headers)
                assert ended.status_code == 204

        for app, places in (("demo", 7), ("side", 3)):
            assert len(placed(app)) == places, [a.status_code for a, _ in answers[app]]
            for answer, waited in answers[app]:
                if answer.status_code != 201:
                    assert answer.status_code == 503, answer.headers.get("proxyblocks-error")
                    assert answer.headers["proxyblocks-error"].startswith("overloaded")
                    assert answer.headers["retry-after"] == "1"
                    assert waited >= QUEUE_TIMEOUT
        loads = await fleet.loads()
        assert all(load["sessions"] == 2 for w in loads.values() for load in w.values())


async def test_a_worker_process_keeps_sessions_with_no_sessions_table_of_its_own(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A worker configured apart from the proxies (no ``[sessions]``) hosts the sessions they start,
    holding each replica to the proxies' ``max_per_replica``."""
    with trio.fail_after(30):
        replica = await nursery.start(functools.partial(serve_demo_replica, "mine"))
        worker = await nursery.start(functools.partial(main, role="worker", announce=False))
        (tmp_path / "k.secret").write_text(SECRET)
        table = {"apps": ["demo"], "max_per_replica": 1, "queue_timeout": 0.2}
        sessions = read_sessions({**table, "keys": [{"kid": "fleet", "secret_file": "k.secret"}]}, base=tmp_path)
        proxy = await nursery.start(
            functools.partial(
                main,
                role="proxy",
                next_hops=[(HOST, worker.worker_server.port)],
                replica_urls=[f"h2c://{HOST}:{replica.port}"],
                options=hop_options({"sessions": sessions}),
                announce=False,
            )
        )
        url = f"http://{HOST}:{proxy.proxy_server.port}"
        auth = {"authorization": "Bearer " + ISSUER.mint(app="demo", now=time.time(), ttl=60)}
        async with h2_client() as c:
            started = await c.post(url + "/.proxyblocks/sessions", headers=auth)
            assert started.status_code == 201, started.headers.get("proxyblocks-error")
            token = started.json()["token"]
            served = await c.get(url + "/", headers={"proxyblocks-session": token})
            assert (served.status_code, served.headers["x-replica"]) == (200, "mine")
            full = await c.post(url + "/.proxyblocks/sessions", headers=auth)
            assert full.status_code == 503
        assert worker.worker.sessions is not None
        stats = worker.worker.sessions.statistics()
        # held to the proxy's max_per_replica of 1 (the 503 above); its own limit, reported, is none
        assert (stats.active, stats.capacity) == ({"replica-0": 1}, {"replica-0": 0})
        assert worker.worker.load()["replica-0"].sessions == 1


async def test_a_killed_replica_gives_each_of_its_sessions_session_lost_once(
    start_fleet: Callable[..., Awaitable[SessionFleet]],
) -> None:
    """``kill -9`` of one Hypercorn replica: the first request of its sessions that finds it gone gets
    ``503 session_lost`` (``replica-unreachable``) from the worker beside it, which ends every session
    it hosted there: the others hear ``410 session_lost`` (``not-hosted``). None is sent to another
    replica; the other replicas' sessions do not notice; a new start works."""
    with trio.fail_after(120):
        fleet = await start_fleet()
        dead = fleet.fleet.routed["h1-1"]  # (its name in the routes and the tokens)
        sessions: list[Session] = []
        while sum(session.replica == dead for session in sessions) < 3:
            sessions.append(await fleet.session())
        fleet.fleet.kill("h1-1")
        await fleet.fleet.wait_dead("h1-1")  # (a request sent as it died may be cut: a 502, not this test's)
        lost = [session for session in sessions if session.replica == dead]
        answers = []
        for session in lost:
            response = await fleet.client.get(fleet.url + "/headers", headers=session.fields())
            answers.append(
                (
                    response.status_code,
                    response.headers.get("proxyblocks-error"),
                    response.headers.get("proxyblocks-session-ended"),
                )
            )
        assert answers == [
            (503, "session_lost; hop=worker-1", "replica-unreachable"),
            *[(410, "session_lost; hop=worker-1", "not-hosted")] * (len(lost) - 1),
        ]
        for session in sessions:
            if session.replica != dead:
                assert not (await fleet.request(session)).error
        assert fleet.wrong() == []
        fresh = await fleet.session()
        assert fresh.replica != dead
        assert not (await fleet.request(fresh)).error
