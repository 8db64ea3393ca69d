"""A bug in a user's code costs that one stream: never the shared connection, never another stream.

Each hop (edge, proxy, worker) gets code that raises the way a user's would:
a hook that raises ``KeyError`` when it decides ``/boom`` (a routing policy
at the proxy, a feature's ``screen`` at the edge and the worker), and an
observer (a feature's ``exchange.tee``) that raises in the middle of a
response asked with ``boom=1``.
Beside them, 100 concurrent streams on the same h2 connection, and an h1
keep-alive connection:

- the 100 complete with 200;
- ``/boom`` gets a 500, and one log record carries the traceback;
- that response is reset (h2) or its connection closed (h1, which has no
  other way to say a response is cut);
- the connection stays open and serves the next request.

Loopback only, port 0, every wait bounded.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence

import h2.errors
import h2.events
import httpx
import pytest
import trio

from blocks import (
    INTERNAL_LISTENER,
    Edge,
    EdgeConfig,
    Exchange,
    Feature,
    Forward,
    Headers,
    HTTPServer,
    LeastInFlight,
    ListenerConfig,
    LocalReplica,
    Proxy,
    Replica,
    Request,
    RouteTable,
    Upstreams,
    Worker,
    open_upstreams,
    serve_http,
)
from blocks.testing import serve_demo_replica
from tests.support import HOST, H2Result, RawH2Client, wait_books_balanced

HOPS = ["edge", "proxy", "worker"]


class BoomTee:
    """An exchange observer that raises on the third chunk of the response, as a buggy one would."""

    def __init__(self) -> None:
        self.chunks = 0

    def request(self, data: bytes, end: bool, trailers: Headers | None) -> None:
        pass

    def response(self, data: bytes, end: bool, trailers: Headers | None) -> None:
        self.chunks += 1
        if self.chunks == 3:
            raise KeyError("a bug in the tee")

    def head(self, status: int, headers: Headers) -> None:
        pass

    def abort(self) -> None:
        pass

    def closed(self) -> None:
        pass


class Boom(Feature):
    """A user's feature with two bugs: ``screen`` raises on ``/boom`` (when ``raising``), and its tee mid-response."""

    def __init__(self, *, raising: bool) -> None:
        self.raising = raising

    def screen(self, exchange: Exchange) -> None:
        if self.raising and exchange.request.path == b"/boom":
            raise KeyError("a bug in the hook")

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        if exchange.request.path.endswith(b"&boom=1"):
            exchange.tee = BoomTee()


class BoomPolicy(LeastInFlight):
    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        if request.path == b"/boom":
            raise KeyError("a bug in the policy")
        return super().pick(request, candidates, in_flight)


def features_at(where: str, hop: str) -> list[Feature]:
    """The buggy feature, at the hop ``where`` names; at the proxy its screen is sound (its policy is not)."""
    return [Boom(raising=hop != "proxy")] if where == hop else []


async def serve_hop(
    make: Callable[[Upstreams], Edge | Proxy | Worker],
    listener: ListenerConfig,
    *,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with open_upstreams() as upstreams:
        hop = make(upstreams)
        await serve_http(hop.handle, config=listener, relay=hop.relay, upstreams=upstreams, task_status=task_status)


async def chain_with_a_bug_at(nursery: trio.Nursery, where: str) -> dict[str, HTTPServer]:
    """edge -> proxy -> worker -> a demo replica, with the buggy code at ``where``; the servers by name."""
    replica = await nursery.start(serve_demo_replica, "replica-0")
    local = {"replica-0": LocalReplica((HOST, replica.port))}
    worker = await nursery.start(
        functools.partial(
            serve_hop, lambda ups: Worker(local, ups, features=features_at(where, "worker")), INTERNAL_LISTENER
        )
    )
    table = RouteTable.build(
        {"*": "app"},
        {"app": [Replica(name="replica-0", worker=(HOST, worker.port), address=local["replica-0"].address)]},
    )
    policy = BoomPolicy() if where == "proxy" else LeastInFlight()  # the proxy's bug is in its policy
    make_proxy = lambda ups: Proxy(table, ups, policy=policy, features=features_at(where, "proxy"))  # noqa: E731
    proxy = await nursery.start(functools.partial(serve_hop, make_proxy, INTERNAL_LISTENER))
    config = EdgeConfig(proxy=(HOST, proxy.port))
    edge: HTTPServer = await nursery.start(
        functools.partial(
            serve_hop, lambda ups: Edge(config, ups, features=features_at(where, "edge")), ListenerConfig()
        )
    )
    return {"edge": edge, "proxy": proxy, "worker": worker, "replica": replica}


async def beside_100(client: RawH2Client, path: bytes, boom_path: bytes) -> tuple[list[H2Result], H2Result]:
    """``boom_path`` amid 100 concurrent streams of ``path`` on one connection: their results, and its."""
    sids = [await client.start(client.head(b"GET", path)) for _ in range(50)]
    boom = await client.start(client.head(b"GET", boom_path))
    sids += [await client.start(client.head(b"GET", path)) for _ in range(50)]
    results: dict[int, H2Result] = {}

    async def collect(sid: int) -> None:
        results[sid] = await client.collect(sid)

    async with trio.open_nursery() as waiting:
        for sid in [*sids, boom]:
            waiting.start_soon(collect, sid)
    return [results[sid] for sid in sids], results[boom]


def tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info is not None and isinstance(r.exc_info[1], KeyError)]


@pytest.mark.parametrize("where", HOPS)
async def test_a_bug_deciding_one_h2_stream_costs_that_stream_alone(
    nursery: trio.Nursery, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    servers = await chain_with_a_bug_at(nursery, where)
    port = servers["edge"].port
    with trio.fail_after(30):
        async with RawH2Client.open(port) as client:
            others, boom = await beside_100(client, b"/sleep?ms=100", b"/boom")
            assert [result.status for result in others] == [200] * 100
            assert boom.status == 500
            assert boom.reset is None  # an answer, not a reset
            # The same connection goes on.
            after = await client.request(client.head(b"GET", b"/"))
            assert after.status == 200 and after.body.startswith(b"hello from")
            assert client.terminated is None
    assert len(tracebacks(caplog)) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("where", HOPS)
async def test_a_bug_deciding_an_h1_request_keeps_the_connection(
    nursery: trio.Nursery, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    servers = await chain_with_a_bug_at(nursery, where)
    port = servers["edge"].port
    with trio.fail_after(30):
        transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1))
        async with httpx.AsyncClient(transport=transport, timeout=10, trust_env=False) as client:
            url = f"http://{HOST}:{port}"
            statuses = [(await client.get(url + path)).status_code for path in ("/", "/boom", "/", "/boom", "/")]
            sockets = {(await client.get(url + "/")).extensions["network_stream"].get_extra_info("socket")}
    assert statuses == [200, 500, 200, 500, 200]
    assert len(sockets) == 1
    assert len(tracebacks(caplog)) == 2


@pytest.mark.parametrize("where", HOPS)
async def test_a_bug_while_a_response_streams_resets_that_stream_alone(
    nursery: trio.Nursery, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    servers = await chain_with_a_bug_at(nursery, where)
    port = servers["edge"].port
    with trio.fail_after(30):
        async with RawH2Client.open(port) as client:
            others, boom = await beside_100(client, b"/stream?n=20&ms=5", b"/stream?n=20&ms=5&boom=1")
            expected = b"".join(b"token %d\n" % i for i in range(20))
            assert all(result.status == 200 and result.body == expected for result in others)
            reset = boom.reset
            assert isinstance(reset, h2.events.StreamReset), boom
            assert reset.error_code in (h2.errors.ErrorCodes.CANCEL, h2.errors.ErrorCodes.INTERNAL_ERROR)
            after = await client.request(client.head(b"GET", b"/"))
            assert after.status == 200
            assert client.terminated is None
            # What the cut stream had received is given back on every hop's connections.
            await wait_books_balanced(servers, links=["edge -> proxy", "proxy -> worker", "worker -> replica"])
    assert len(tracebacks(caplog)) == 1, [r.getMessage() for r in caplog.records]
