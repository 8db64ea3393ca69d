"""A drained replica's sessions end with a clear answer, and its WebSockets with a Close frame, never a silent cut.

The worker ends a replica's sessions and WebSockets when the autoscaler
asks (``DELETE /.proxyblocks/sessions`` naming the replica, once the
replica's ``drain_timeout`` is up), and its own WebSockets when it drains:
every client gets a Close frame (1001, and a reason) between two of the
replica's frames, the tunnel ends cleanly, and a later request of a drained
session is a ``410`` that says ``drained``.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``;
real clients (trio-websocket through the edge, httpx), real replicas (the
project's WebSocket app, a raw tunnel handler that stops mid-frame, Hypercorn
in a process of its own, the demo replica as the autoscaler's process). A
test waits for the state it asserts, never for a duration.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h2.events
import httpx
import pytest
import trio
import trio_websocket
import wsproto.connection
import wsproto.events
from support import (
    HOST,
    RawH2Client,
    child_process,
    connect_websocket,
    record_relays,
    wait_books_balanced,
    wait_for,
)
from wsproto.frame_protocol import FrameProtocol

from blocks import (
    Chain,
    IterBody,
    Keyring,
    Request,
    Response,
    SessionConfig,
    TokenIssuer,
    TokenKey,
    TokenVerifier,
    Worker,
    WorkerSessionConfig,
    open_chain,
    serve_http,
    serve_websocket_app,
    text_response,
)
from blocks.autoscaler import (
    AutoscalePolicy,
    ColdStartGate,
    DriverConfig,
    ReplicaTemplate,
    ScalingConfig,
    open_autoscaler,
)
from blocks.testing import ChatApp
from blocks.topology import replica_from_url

KEY = TokenKey.hmac("k1", bytes(range(32)))
ISSUER = TokenIssuer(KEY)
VERIFIER = TokenVerifier(Keyring([KEY]))
APP = "demo"
AUTH = {"authorization": "Bearer " + ISSUER.mint(app=APP, tenant="t", now=time.time(), ttl=3600)}


def session_field(token: str) -> list[tuple[str, str]]:
    return [("proxyblocks-session", token)]


async def start_proxy_and_edge(chain: Chain, **proxy: Any) -> None:
    await chain.start_proxy(
        sessions=SessionConfig(apps={APP}), session_issuer=ISSUER, session_verifier=VERIFIER, **proxy
    )
    await chain.start_edge()


async def start_session(client: httpx.AsyncClient) -> dict[str, str]:
    response = await client.post("/.proxyblocks/sessions", headers=AUTH)
    assert response.status_code == 201, response.text
    client.cookies.clear()  # each request below names its session
    answer: dict[str, str] = response.json()
    return answer


async def drain_replica(worker_port: int, replica: str) -> dict[str, int]:
    """What the autoscaler sends a worker at a replica's ``drain_timeout``."""
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        response = await client.delete(
            f"http://{HOST}:{worker_port}/.proxyblocks/sessions",
            headers={"x-proxyblocks-probe": "1", "x-proxyblocks-replica": replica},
        )
    assert response.status_code == 200, response.text
    answer: dict[str, int] = response.json()
    return answer


async def closed_with(ws: trio_websocket.WebSocketConnection) -> tuple[int, str | None]:
    """Read until the server closes: the close code and reason the client library reports."""
    with pytest.raises(trio_websocket.ConnectionClosed) as closed:
        while True:
            await ws.get_message()
    return closed.value.reason.code, closed.value.reason.reason


# -- the worker ends a replica's sessions and WebSockets ---------------------------------------------------


@pytest.mark.parametrize("protocol", ["h2", "h1"])
async def test_a_drained_replicas_websockets_get_a_close_frame_and_its_sessions_a_410_drained(protocol: str) -> None:
    """A chat room (the project's WebSocket app) with two members of one session: the drain closes each
    WebSocket with 1001 and a reason that says why, the session's next request is a 410 ``drained``.
    Over h2 the first WebSocket crossed the worker on a task and the second was spliced, over h1 both
    on tasks: the two ways the Close frame is put in."""
    with trio.fail_after(30):
        async with open_chain() as chain:
            chat = ChatApp("room-0")
            replica = await chain.start_replica(
                "room-0", functools.partial(serve_websocket_app, chat.websocket, chat.page), protocol=protocol
            )
            worker_server, worker = await chain.start_worker(
                {"room-0": replica}, sessions=WorkerSessionConfig(idle_timeout=60)
            )
            relays = record_relays(worker_server)
            await start_proxy_and_edge(chain)
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=10) as client:
                session = await start_session(client)
                token = session["token"]
                async with (
                    connect_websocket(chain.edge.port, "/ws", extra_headers=session_field(token)) as first,
                    connect_websocket(chain.edge.port, "/ws", extra_headers=session_field(token)) as second,
                ):
                    for ws in (first, second):
                        assert json.loads(await ws.get_message())["room"] == session["session"]
                    await first.send_message("before the drain")
                    for ws in (first, second):
                        assert json.loads(await ws.get_message())["text"] == "before the drain"
                    assert relays.outcomes[-2:] == ([False, True] if protocol == "h2" else [False, False])
                    answer = await drain_replica(worker_server.port, "room-0")
                    assert answer == {"ended": 1, "websockets": 2, "cut": 0}
                    for ws in (first, second):
                        assert await closed_with(ws) == (1001, "session ended: drained")
                    # the replica's side of each tunnel is closed too: the room's members left
                    await wait_for(lambda: not chat.rooms[session["session"]].members, "the members gone")
                later = await client.get("/", headers={"proxyblocks-session": token})
                assert later.status_code == 410
                assert later.headers["proxyblocks-session-ended"] == "drained"
                assert later.headers["proxyblocks-error"].startswith("session_lost; hop=worker")
            stats = worker.sessions.statistics() if worker.sessions is not None else None
            assert stats is not None and stats.ended["drained"] == 1 and stats.active == {"room-0": 0}
            assert (worker.websockets.count(), worker.websockets.ended, worker.websockets.cut) == (0, 2, 0)
            chain.cancel()


@pytest.mark.parametrize("protocol", ["h2", "h1"])
async def test_a_websocket_of_no_session_on_a_drained_replica_is_closed_too(protocol: str) -> None:
    with trio.fail_after(30):
        async with open_chain() as chain:
            replica = await chain.start_replica("demo-0", protocol=protocol)  # the demo's echo
            worker_server, _worker = await chain.start_worker({"demo-0": replica}, sessions=WorkerSessionConfig())
            await start_proxy_and_edge(chain)
            async with connect_websocket(chain.edge.port, "/echo") as ws:
                await ws.send_message("ping")
                assert await ws.get_message() == "ping"
                assert await drain_replica(worker_server.port, "demo-0") == {"ended": 0, "websockets": 1, "cut": 0}
                assert await closed_with(ws) == (1001, "replica drained")
            chain.cancel()


async def test_an_h2_client_at_the_edge_gets_the_close_frame_then_the_end_of_its_stream() -> None:
    """RFC 8441 from the client too: the Close frame, then END_STREAM (then a NO_ERROR reset, since the
    client's side had not ended: RFC 9113 8.1), never a reset instead of the frame."""
    with trio.fail_after(30):
        async with open_chain() as chain:
            replica = await chain.start_replica("demo-0")
            worker_server, _ = await chain.start_worker({"demo-0": replica}, sessions=WorkerSessionConfig())
            await start_proxy_and_edge(chain)
            async with RawH2Client.open(chain.edge.port) as client:
                head = [
                    (b":method", b"CONNECT"),
                    (b":protocol", b"websocket"),
                    (b":scheme", b"http"),
                    (b":authority", client.authority),
                    (b":path", b"/echo"),
                    (b"sec-websocket-version", b"13"),
                ]
                sid = await client.start(head, end_stream=False)
                response = await client.next_event(sid)
                assert isinstance(response, h2.events.ResponseReceived)
                assert dict(response.headers)[b":status"] == b"200"
                ws = wsproto.connection.Connection(wsproto.connection.ConnectionType.CLIENT)
                await client.send(sid, ws.send(wsproto.events.TextMessage("over h2")))
                assert await drain_replica(worker_server.port, "demo-0") == {"ended": 0, "websockets": 1, "cut": 0}
                frames: list[wsproto.events.Event] = []
                while True:
                    event = await client.next_event(sid)
                    if isinstance(event, h2.events.DataReceived):
                        ws.receive_data(event.data)
                        frames += ws.events()
                    else:
                        break
                assert isinstance(event, h2.events.StreamEnded)  # ended, not reset
                *before, close = frames
                assert isinstance(close, wsproto.events.CloseConnection)
                assert (close.code, close.reason) == (1001, "replica drained")
                assert [e.data for e in before if isinstance(e, wsproto.events.TextMessage)] in ([], ["over h2"])
            chain.cancel()


# -- a frame half-sent goes out whole, then the Close ------------------------------------------------------


def server_frame(text: str) -> bytes:
    return bytes(FrameProtocol(client=False, extensions=[]).send_data(text))


@attrs.define(eq=False)
class HalfFrame:
    """A WebSocket replica as a raw tunnel handler: frame one whole, frame two up to ``split`` bytes, and,
    once released, the rest of frame two with a frame three behind it in the same write."""

    split: int
    released: trio.Event = attrs.field(factory=trio.Event)
    one: bytes = server_frame("one")
    two: bytes = server_frame("two" * 100)  # 300 bytes: a 4-byte header (126, then the length)
    three: bytes = server_frame("three")

    async def __call__(self, request: Request) -> Response:
        if request.protocol != b"websocket":
            return text_response(404, "WebSockets only\n")

        async def frames() -> AsyncIterator[bytes]:
            yield self.one
            yield self.two[: self.split]
            await self.released.wait()
            yield self.two[self.split :] + self.three
            await trio.sleep_forever()

        return Response(200, [], IterBody(frames()))


@pytest.mark.parametrize("split", [1, 3, 150], ids=["in-the-header", "in-the-length", "in-the-payload"])
@pytest.mark.parametrize("protocol", ["h2", "h1"])
async def test_a_frame_half_sent_when_the_drain_comes_goes_out_whole_then_the_close(protocol: str, split: int) -> None:
    """Over h2 the WebSocket is spliced (the worker's pool is warm); over h1 it crosses on a task."""
    with trio.fail_after(30):
        async with open_chain() as chain:
            replica_app = HalfFrame(split)
            replica = await chain.start_replica(
                "half-0", functools.partial(_serve_handler, replica_app), protocol=protocol
            )
            worker_server, worker = await chain.start_worker({"half-0": replica})
            relays = record_relays(worker_server)
            await chain.start_proxy()
            await chain.start_edge()
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=10) as client:
                assert (await client.get("/")).status_code == 404  # the worker's connection to the replica is up
            async with connect_websocket(chain.edge.port, "/half") as ws:
                assert await ws.get_message() == "one"
                assert relays.outcomes[-1] is (protocol == "h2")
                (tunnel,) = worker.websockets.open["half-0"]
                await wait_for(lambda: not tunnel.frames.at_boundary, "frame two half-relayed")
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(functools.partial(worker.websockets.end, "half-0", "drained"))
                    await wait_for(lambda: tunnel.ending)
                    replica_app.released.set()
                assert await ws.get_message() == "two" * 100  # whole
                assert await closed_with(ws) == (1001, "drained")  # and never "three"
            assert (worker.websockets.ended, worker.websockets.cut) == (1, 0)
            await balanced(chain, protocol)  # what was not relayed (frame three) was given back
            chain.cancel()


async def balanced(chain: Chain, protocol: str) -> None:
    """Every h2 connection of the chain is back to no stream and no byte held (each acknowledged once)."""
    servers = {"edge": chain.edge, "proxy": chain.proxy_server, "worker": chain.worker_server, **chain.replicas}
    replica = next(iter(chain.replicas))
    links = ["edge -> proxy", "proxy -> worker"] + ([f"worker -> {replica}"] if protocol == "h2" else [])
    await wait_books_balanced(servers, links)


@pytest.mark.parametrize("protocol", ["h2", "h1"])
async def test_a_frame_that_never_ends_is_reset_once_the_end_timeout_is_up(protocol: str) -> None:
    """The bounded fallback: with no frame boundary in sight, the tunnel is reset, as it was before."""
    with trio.fail_after(30):
        async with open_chain() as chain:
            replica = await chain.start_replica(
                "half-0", functools.partial(_serve_handler, HalfFrame(150)), protocol=protocol
            )
            worker_server, worker = await chain.start_worker({"half-0": replica})
            relays = record_relays(worker_server)
            await chain.start_proxy()
            await chain.start_edge()
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=10) as client:
                assert (await client.get("/")).status_code == 404  # warm: over h2 the WebSocket is spliced
            async with connect_websocket(chain.edge.port, "/half") as ws:
                assert await ws.get_message() == "one"
                assert relays.outcomes[-1] is (protocol == "h2")
                (tunnel,) = worker.websockets.open["half-0"]
                await wait_for(lambda: not tunnel.frames.at_boundary, "frame two half-relayed")
                assert await worker.websockets.end("half-0", "drained", timeout=0.2) == (0, 1)
                assert (await closed_with(ws))[0] == 1006  # no Close frame could go: a cut, as before
            await wait_for(lambda: worker.websockets.count() == 0)
            await balanced(chain, protocol)
            chain.cancel()


async def _serve_handler(handler: HalfFrame, *, host: str, task_status: Any) -> None:
    await serve_http(handler, host=host, port=0, task_status=task_status)


# -- the worker draining itself ------------------------------------------------------------------------------


async def test_the_worker_draining_ends_its_websockets_with_a_close_frame_not_a_cut() -> None:
    with trio.fail_after(30):
        async with open_chain() as chain:
            replica = await chain.start_replica("demo-0")
            worker_server, worker = await chain.start_worker({"demo-0": replica})
            await chain.start_proxy()
            await chain.start_edge()
            async with (
                connect_websocket(chain.edge.port, "/a") as a,
                connect_websocket(chain.edge.port, "/b") as b,
            ):
                for ws in (a, b):
                    await ws.send_message("hi")
                    assert await ws.get_message() == "hi"
                worker_server.drain()
                for ws in (a, b):
                    assert await closed_with(ws) == (1001, "worker draining")
            await wait_for(lambda: worker.websockets.ended == 2)
            chain.cancel()


HYPERCORN_WS = [sys.executable, "-m", "hypercorn", "tests.asgi_replica:app", "--bind", "127.0.0.1:0", "-k", "trio"]
"""hypercorn serving ``tests/asgi_replica.py`` (HTTP/1.1 and h2c on one port; its WebSocket is ``/ws-echo``)."""


# -- a replica that is not the project's: Hypercorn ------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["h2c", "http"])
async def test_a_hypercorn_replicas_websocket_gets_the_close_frame(scheme: str) -> None:
    """Hypercorn (an ASGI app with a WebSocket route, ``tests/asgi_replica.py``) in a process of its own,
    reached over h2 (RFC 8441) or h1 (Upgrade)."""
    with trio.fail_after(30):
        async with (
            child_process(HYPERCORN_WS, r"Running on http://(\S+) \(CTRL", stderr=True) as (_, match),
            open_chain() as chain,
        ):
            replica = replica_from_url(f"{scheme}://{match.group(1)}")
            worker_server, _ = await chain.start_worker({"hypercorn": replica}, sessions=WorkerSessionConfig())
            await start_proxy_and_edge(chain)
            async with httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=10) as client:
                session = await start_session(client)
                async with connect_websocket(
                    chain.edge.port, "/ws-echo", extra_headers=session_field(session["token"])
                ) as ws:
                    assert await ws.get_message() == f"hypercorn-{replica.address[1]} {session['session']}"
                    await ws.send_message("echo me")
                    assert await ws.get_message() == "echo me"
                    assert await drain_replica(worker_server.port, "hypercorn") == {
                        "ended": 1,
                        "websockets": 1,
                        "cut": 0,
                    }
                    assert await closed_with(ws) == (1001, "session ended: drained")
                later = await client.get("/hello", headers={"proxyblocks-session": session["token"]})
                assert (later.status_code, later.headers["proxyblocks-session-ended"]) == (410, "drained")
            chain.cancel()


# -- the autoscaler's drain ------------------------------------------------------------------------------------

DEMO = f"{sys.executable} -m blocks.testing.replica --port {{port}} --name {{name}}"


@asynccontextmanager
async def sessioned_fleet(drain_timeout: float) -> AsyncIterator[tuple[Chain, Worker, Any]]:
    """Two demo replicas (processes) of a sessioned app, an autoscaler that drains with ``drain_timeout``."""
    policy = AutoscalePolicy({APP: ScalingConfig(target_concurrency=4, min_replicas=2, unit="sessions")})
    template = ReplicaTemplate(command=DEMO, protocol="h2", domains=("*",))
    driver = DriverConfig(interval=0.1, settle=0.2, drain_timeout=drain_timeout, stop_timeout=5)
    async with open_chain() as chain:
        worker_server, worker = await chain.start_worker({}, app=None, sessions=WorkerSessionConfig())
        address = (chain.host, worker_server.port)
        async with open_autoscaler(policy, {APP: template}, chain.store, worker=address, config=driver) as scaler:
            await start_proxy_and_edge(chain, features=[ColdStartGate(scaler, chain.cache)])
            await wait_for(lambda: len(chain.cache.replicas(APP)) == 2, "two replicas routed", timeout=30)
            yield chain, worker, scaler
        chain.cancel()


async def test_the_autoscaler_ends_a_drained_replicas_sessions_past_drain_timeout_with_a_close_frame(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="blocks.autoscaler")
    with trio.fail_after(60):
        async with (
            sessioned_fleet(drain_timeout=1.0) as (chain, worker, scaler),
            httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client,
        ):
            session = await start_session(client)
            name = session["replica"]
            pid = scaler.statistics().processes[name]
            async with connect_websocket(chain.edge.port, "/ws", extra_headers=session_field(session["token"])) as ws:
                await ws.send_message("still here")
                assert await ws.get_message() == "still here"
                await wait_for(lambda: scaler.statistics().apps[APP].sessions == 1, "the session counted")
                scaler.drain(name)
                assert await closed_with(ws) == (1001, "session ended: drained")
            later = await client.get("/", headers={"proxyblocks-session": session["token"]})
            assert later.status_code == 410  # drained (its worker), or replica-gone once the record left
            assert later.headers["proxyblocks-session-ended"] in ("drained", "replica-gone")
            again = await start_session(client)
            assert again["replica"] != name  # a new start lands on a replica that is not going
            await wait_for(lambda: pid not in scaler.statistics().processes.values(), "the drained one stopped")
            lines = [r.getMessage() for r in caplog.records if r.name == "blocks.autoscaler" and name in r.getMessage()]
            assert any(
                "still busy after drain_timeout (1s): its worker ended 1 sessions and closed 1 WebSockets (0 reset)"
                in line
                for line in lines
            ), lines
            assert worker.sessions is not None and worker.sessions.statistics().ended["drained"] == 1


async def test_a_session_that_ends_within_drain_timeout_is_not_cut(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="blocks.autoscaler")
    with trio.fail_after(60):
        async with (
            sessioned_fleet(drain_timeout=30.0) as (chain, worker, scaler),
            httpx.AsyncClient(base_url=chain.url, trust_env=False, timeout=30) as client,
        ):
            session = await start_session(client)
            name = session["replica"]
            pid = scaler.statistics().processes[name]
            async with connect_websocket(chain.edge.port, "/ws", extra_headers=session_field(session["token"])) as ws:
                await wait_for(lambda: scaler.statistics().apps[APP].sessions == 1, "the session counted")
                scaler.drain(name)
                await wait_for(lambda: scaler.statistics().apps[APP].draining == 1)
                await ws.send_message("still served while draining")
                assert await ws.get_message() == "still served while draining"
                await ws.aclose(1000, "done")  # the client's own end
                assert ws.closed is not None and ws.closed.code == 1000
            ended = await client.delete("/.proxyblocks/sessions", headers={"proxyblocks-session": session["token"]})
            assert ended.status_code == 204
            # the replica goes once idle, long before its drain_timeout, and nobody was cut
            await wait_for(lambda: pid not in scaler.statistics().processes.values(), "stopped once idle")
            assert worker.sessions is not None and worker.sessions.statistics().ended.get("drained", 0) == 0
            assert (worker.websockets.ended, worker.websockets.cut) == (0, 0)
            assert not [r for r in caplog.records if "after drain_timeout" in r.getMessage()]
