"""Proxy auth end to end: edge -> proxy (ProxyAuth) -> worker -> replicas, real sockets, real clients.

Two apps behind one worker: ``chat`` (``chat.example``) requires a proxy-auth
token, ``open`` (``open.example``) does not. Each replica is a
:class:`HeaderReplica`, which records every request that reaches it, with its
fields, so a test can say that a refused request reached nothing and that an
accepted one arrived without its token.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``,
real clients (httpx, h2 and h1) and servers. Token times are wall-clock, as
the proxy reads them (``time.time()``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio
from support import HOST, raw_exchange, record_relays, wait_for

from blocks import (
    EdgeConfig,
    HTTPServer,
    Keyring,
    ListenerConfig,
    LocalReplica,
    Proxy,
    ProxyAuth,
    Replica,
    Request,
    Response,
    RouteTable,
    SchedulerConfig,
    TenantKey,
    TenantPolicy,
    TokenIssuer,
    TokenKey,
    TokenVerifier,
    UpstreamConfig,
    Worker,
    parse_server_timing,
    serve_edge,
    serve_http,
    serve_proxy,
    serve_worker,
    text_response,
    token_tenant,
)

KEY = TokenKey.hmac("k1", bytes(range(32)))
ISSUER = TokenIssuer(KEY)
CHAT = "chat.example"
OPEN = "open.example"


def token(app: str = "chat", **claims: Any) -> str:
    args: dict[str, Any] = {"app": app, "tenant": "acme", "now": time.time(), "ttl": 300.0}
    args.update(claims)
    return ISSUER.mint(**args)


@attrs.define(eq=False)
class HeaderReplica:
    """Records every request that reaches it; ``/hold`` answers once :meth:`release` is called."""

    arrivals: list[tuple[bytes, list[tuple[bytes, bytes]]]] = attrs.field(factory=list)
    held: int = 0
    _gate: trio.Event = attrs.field(factory=trio.Event)

    def release(self) -> None:
        self._gate.set()
        self._gate = trio.Event()

    async def __call__(self, request: Request) -> Response:
        self.arrivals.append((request.path, list(request.headers)))
        if request.path == b"/hold":
            self.held += 1
            try:
                await self._gate.wait()
            finally:
                self.held -= 1
        return text_response(200, "ok\n")


@attrs.define
class AuthChain:
    edge: HTTPServer
    proxy_server: HTTPServer
    proxy: Proxy
    worker: Worker
    auth: ProxyAuth
    chat: HeaderReplica
    open: HeaderReplica

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.edge.port}"

    def reached_nothing(self) -> None:
        """Nothing got past the proxy: no replica picked, no worker request, no replica arrival."""
        assert self.proxy.statistics().in_flight == {}
        assert self.worker.statistics().served == {"chat-0": 0, "open-0": 0}
        assert self.chat.arrivals == [] and self.open.arrivals == []


async def assemble_auth(
    nursery: trio.Nursery,
    *,
    scheduler: SchedulerConfig | None = None,
    tenant_key: TenantKey | None = None,
    proxy_upstream: UpstreamConfig | None = None,
    **auth_options: Any,
) -> AuthChain:
    replicas = {"chat-0": HeaderReplica(), "open-0": HeaderReplica()}
    local = {}
    for name, handler in replicas.items():
        server = await nursery.start(functools.partial(serve_http, handler, config=ListenerConfig()))
        local[name] = LocalReplica((HOST, server.port), "h2")
    worker_server, worker = await nursery.start(functools.partial(serve_worker, local))
    routes = RouteTable.build(
        {CHAT: "chat", OPEN: "open"},
        {
            app: [Replica(name=name, worker=(HOST, worker_server.port), address=local[name].address)]
            for app, name in (("chat", "chat-0"), ("open", "open-0"))
        },
    )
    auth = ProxyAuth(TokenVerifier(Keyring([KEY])), apps={"chat"}, **auth_options)
    proxy_server, proxy = await nursery.start(
        functools.partial(
            serve_proxy, routes, auth=auth, scheduler=scheduler, tenant_key=tenant_key, upstream=proxy_upstream
        )
    )
    edge = await nursery.start(serve_edge, EdgeConfig(proxy=(HOST, proxy_server.port)))
    return AuthChain(edge, proxy_server, proxy, worker, auth, replicas["chat-0"], replicas["open-0"])


@asynccontextmanager
async def client(*, http2: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """An h2 (prior knowledge) or h1 client, ignoring proxies from the environment."""
    async with httpx.AsyncClient(http2=http2, http1=not http2, trust_env=False, timeout=20) as c:
        yield c


def headers_for(host: str, authorization: str | None = None, **extra: str) -> dict[str, str]:
    headers = {"host": host, **extra}
    if authorization is not None:
        headers["authorization"] = authorization
    return headers


REFUSED = [
    pytest.param(None, "missing", id="no token"),
    pytest.param("Basic dXNlcjpwYXNz", "missing", id="another scheme"),
    pytest.param("Bearer not-a-token", "malformed", id="garbage"),
    pytest.param("Bearer " + "A" * 5000, "too_large", id="oversized"),
    pytest.param(lambda: "Bearer " + token("open"), "wrong_app", id="a token for another app"),
    pytest.param(
        lambda: "Bearer " + token(kind="session", session_id="s-1", replica="chat-0"),
        "wrong_kind",
        id="a session token",
    ),
    pytest.param(lambda: "Bearer " + token(now=time.time() - 3600, ttl=60), "expired", id="expired"),
    pytest.param(lambda: "Bearer " + token()[:-4] + "AAAA", "bad_signature", id="forged"),
    pytest.param(
        lambda: "Bearer " + TokenIssuer(TokenKey.hmac("k2", bytes(32))).mint(app="chat", now=time.time(), ttl=60),
        "unknown_key",
        id="unknown key",
    ),
]


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "h1"])
@pytest.mark.parametrize(("authorization", "why"), REFUSED)
async def test_a_request_without_a_valid_token_for_its_app_is_a_401_that_reaches_nothing(
    nursery: trio.Nursery, authorization: Any, why: str, http2: bool
) -> None:
    with trio.fail_after(10):
        chain = await assemble_auth(nursery)
        value = authorization() if callable(authorization) else authorization
        async with client(http2=http2) as c:
            response = await c.get(chain.url + "/private", headers=headers_for(CHAT, value))
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert (
            response.text == "401 Unauthorized: unauthorized; hop=proxy\n"
        )  # generic: which check failed is for the operator
        assert set(parse_server_timing(response.headers["server-timing"])) == {
            "proxy",
            "edge",
            "total",
        }  # the failing hop adds its own
        chain.reached_nothing()
        stats = chain.auth.statistics()
        if why == "missing":
            assert (stats.required, stats.missing, stats.rejected) == (1, 1, 0)
        else:
            assert (stats.required, stats.missing, stats.rejected) == (1, 0, 1)
            assert chain.auth.verifier.statistics().rejected[why] == 1


async def test_a_valid_token_opens_its_app_and_the_replica_never_sees_it(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble_auth(nursery)
        async with client() as c:
            response = await c.get(
                chain.url + "/private", headers=headers_for(CHAT, "Bearer " + token(), **{"x-keep": "me"})
            )
        assert response.status_code == 200, response.text
        assert response.text == "ok\n"
        [(path, seen)] = chain.chat.arrivals
        assert path == b"/private"
        names = [name for name, _ in seen]
        assert b"authorization" not in names
        assert (b"x-keep", b"me") in seen
        assert chain.worker.statistics().served == {"chat-0": 1, "open-0": 0}
        timing = parse_server_timing(response.headers["server-timing"])
        assert {"proxy-auth", "proxy-route", "proxy", "edge", "total"} <= set(timing)
        assert timing["proxy-auth"] <= timing["proxy"]
        stats = chain.auth.statistics()
        assert (stats.required, stats.allowed, stats.missing, stats.rejected) == (1, 1, 0, 0)


async def test_an_app_that_does_not_require_auth_is_unaffected(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble_auth(nursery)
        async with client() as c:
            bare = await c.get(chain.url + "/", headers=headers_for(OPEN))
            with_credentials = await c.get(chain.url + "/", headers=headers_for(OPEN, "Bearer for-the-app"))
        assert (bare.status_code, with_credentials.status_code) == (200, 200)
        assert [path for path, _ in chain.open.arrivals] == [b"/", b"/"]
        assert (b"authorization", b"Bearer for-the-app") in chain.open.arrivals[1][1]
        assert "proxy-auth" not in parse_server_timing(bare.headers["server-timing"])
        assert chain.auth.statistics().required == 0
        assert chain.chat.arrivals == []


async def test_a_token_for_one_app_never_opens_another(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble_auth(nursery)
        chat_token = "Bearer " + token("chat")
        async with client() as c:
            opened = await c.get(chain.url + "/", headers=headers_for(CHAT, chat_token))
            # The same token on the open app passes untouched: that app does its own auth.
            elsewhere = await c.get(chain.url + "/", headers=headers_for(OPEN, chat_token))
        assert (opened.status_code, elsewhere.status_code) == (200, 200)
        assert (b"authorization", chat_token.encode()) in chain.open.arrivals[0][1]


async def test_a_cookie_token_is_accepted_and_only_that_cookie_is_stripped(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble_auth(nursery, cookie="pb_auth")
        async with client() as c:
            response = await c.get(chain.url + "/", headers=headers_for(CHAT, cookie=f"a=1; pb_auth={token()}; b=2"))
        assert response.status_code == 200
        [(_, seen)] = chain.chat.arrivals
        cookies = b"; ".join(value for name, value in seen if name == b"cookie")
        assert b"pb_auth" not in cookies and b"a=1" in cookies and b"b=2" in cookies


async def test_the_token_can_be_forwarded_when_configured(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble_auth(nursery, forward_token=True)
        value = "Bearer " + token()
        async with client() as c:
            response = await c.get(chain.url + "/", headers=headers_for(CHAT, value))
        assert response.status_code == 200
        assert (b"authorization", value.encode()) in chain.chat.arrivals[0][1]


async def test_the_proxys_handler_path_checks_too(nursery: trio.Nursery) -> None:
    """h1 straight to the proxy: no fast path, so the handler screens the request itself."""
    with trio.fail_after(10):
        chain = await assemble_auth(nursery)

        async def exchange(*fields: str) -> bytes:
            head = "\r\n".join(("GET /direct HTTP/1.0", f"host: {CHAT}", *fields, "", ""))
            return await raw_exchange(chain.proxy_server.port, head.encode())

        refused = await exchange()
        accepted = await exchange(f"authorization: Bearer {token()}")
        assert refused.startswith(b"HTTP/1.1 401 ") and b"\r\nwww-authenticate: Bearer\r\n" in refused
        assert accepted.startswith(b"HTTP/1.1 200 "), accepted
        [(path, seen)] = chain.chat.arrivals
        assert path == b"/direct" and b"authorization" not in [name for name, _ in seen]


async def test_a_401_never_takes_or_waits_for_a_scheduler_slot(nursery: trio.Nursery) -> None:
    """One slot, held by an accepted request: a refused request is answered at once, not queued.

    Were the check after admission, the refused request would wait in the
    queue for the held slot (its queue timeout is far beyond this test's
    bound) or take the slot.
    """
    one_slot = SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=10, queue_timeout=60.0))
    with trio.fail_after(10):
        chain = await assemble_auth(nursery, scheduler=one_slot)
        scheduler = chain.proxy.scheduler
        assert scheduler is not None
        results: dict[str, int] = {}
        async with client() as c:

            async def get(name: str, path: str, authorization: str | None) -> None:
                response = await c.get(chain.url + path, headers=headers_for(CHAT, authorization))
                results[name] = response.status_code

            async with trio.open_nursery() as requests:
                requests.start_soon(get, "holder", "/hold", "Bearer " + token())
                await wait_for(lambda: chain.chat.held == 1, "the holder to reach the replica")
                for i, authorization in enumerate((None, "Bearer junk", "Bearer " + token("open"))):
                    await get(f"refused-{i}", "/", authorization)
                stats = scheduler.statistics()
                assert (stats.in_flight, stats.queued, stats.granted) == (1, 0, 1)
                assert (stats.rejected_full, stats.rejected_deadline) == (0, 0)
                # An accepted request does wait its turn, and is not checked twice on the way.
                requests.start_soon(get, "waiter", "/after", "Bearer " + token())
                await wait_for(lambda: scheduler.statistics().queued == 1, "the waiter to queue")
                chain.chat.release()
        assert results == {"holder": 200, "refused-0": 401, "refused-1": 401, "refused-2": 401, "waiter": 200}
        assert [path for path, _ in chain.chat.arrivals] == [b"/hold", b"/after"]
        assert scheduler.statistics().granted == 2
        assert chain.worker.statistics().served == {"chat-0": 2, "open-0": 0}
        await wait_for(lambda: scheduler.statistics().in_flight == 0, "the slots to come back")


async def test_a_declined_fast_path_does_not_check_the_token_twice(nursery: trio.Nursery) -> None:
    """One stream to the worker: the second request is screened and decided on the fast path, declined
    (the pool is full), and carried out by the handler with that decision: checked once, token gone."""
    one_stream = UpstreamConfig(max_connections=1, max_streams_per_connection=1)
    with trio.fail_after(10):
        chain = await assemble_auth(nursery, proxy_upstream=one_stream)
        relays = record_relays(chain.proxy_server)
        statuses: list[int] = []
        async with client() as c:

            async def get(path: str) -> None:
                response = await c.get(chain.url + path, headers=headers_for(CHAT, "Bearer " + token()))
                statuses.append(response.status_code)

            await get("/warm")  # opens the pooled connection
            async with trio.open_nursery() as requests:
                requests.start_soon(get, "/hold")
                await wait_for(lambda: chain.chat.held == 1, "the first request to hold the stream")
                requests.start_soon(get, "/second")
                await wait_for(lambda: len(relays.outcomes) == 3, "the second request to reach the fast path")
                chain.chat.release()
        assert statuses == [200, 200, 200]
        assert relays.outcomes == [False, True, False]  # no connection yet; spliced; the pool is full
        stats = chain.auth.statistics()
        assert (stats.required, stats.allowed, stats.rejected, stats.missing) == (3, 3, 0, 0)
        assert all(b"authorization" not in [name for name, _ in seen] for _, seen in chain.chat.arrivals)


async def test_unknown_hosts_are_still_a_503(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        chain = await assemble_auth(nursery)
        async with client() as c:
            response = await c.get(chain.url + "/", headers=headers_for("nowhere.example"))
        assert response.status_code == 503
        assert chain.auth.statistics().required == 0
        assert chain.proxy.statistics().no_route == 1


async def test_the_scheduler_can_key_tenants_by_the_verified_token(nursery: trio.Nursery) -> None:
    """``tenant_key=token_tenant()``: a request with a token is the token's tenant, whatever
    ``x-tenant`` it claims; a request for an app without auth falls back to the header."""
    with trio.fail_after(10):
        chain = await assemble_auth(
            nursery,
            scheduler=SchedulerConfig(budget=8),
            tenant_key=token_tenant(),
        )
        async with client() as http:
            for _ in range(3):
                response = await http.get(
                    f"{chain.url}/",
                    headers={"host": CHAT, "authorization": f"Bearer {token(tenant='acme')}", "x-tenant": "spoof"},
                )
                assert response.status_code == 200
            response = await http.get(f"{chain.url}/", headers={"host": OPEN, "x-tenant": "bob"})
            assert response.status_code == 200
        scheduler = chain.proxy.scheduler
        assert scheduler is not None
        tenants = scheduler.statistics().tenants
        assert tenants["acme"].granted == 3 and tenants["bob"].granted == 1
        assert "spoof" not in tenants
