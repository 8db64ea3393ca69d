"""Every byte accounted, through the real chain: aborted streams give back their window.

The invariant (docs/design-notes.md): every DATA byte received on any h2
connection is acknowledged exactly once, whatever becomes of its stream.
A byte that is not leaks connection window for good; enough of them and a
pooled connection, shared by every tenant, stops carrying any body.

These tests abort exchanges the way real clients do (a TCP reset in the
middle of an upload or a download, an h2 RST_STREAM, a WebSocket dropped
mid-echo), then read every h2 connection's books along the chain (client
-> edge, edge -> proxy, proxy -> worker, worker -> replica): once the
streams are gone each connection must hold no unacknowledged byte, and a
1 MiB request must still get its whole body.

Loopback only, port 0, every wait bounded.
"""

from __future__ import annotations

import functools
import socket
import struct

import h2.errors
import h2.events
import httpx
import pytest
import trio
import trio_websocket
from wsproto.frame_protocol import FrameProtocol

from blocks import HTTPServer
from recipes import chain as chain_recipe
from tests.support import HOST, RawH2Client, wait_books_balanced

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

UPLOAD = 600 * 1024
ONE_MIB = 1024 * 1024


def _servers(chain: chain_recipe.Chain) -> dict[str, HTTPServer]:
    servers = {"edge": chain.edge, "proxy": chain.proxy_server, "worker": chain.worker_server}
    servers.update(chain.replicas)
    return servers


async def wait_balanced(chain: chain_recipe.Chain) -> None:
    # The hops' own links must be there to be read: an empty ledger proves nothing.
    await wait_books_balanced(_servers(chain), links=["edge -> proxy", "proxy -> worker"])


async def reset_close(stream: trio.SocketStream) -> None:
    """Close with a TCP reset, as a client that crashed or was killed."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()


async def read_at_least(stream: trio.SocketStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = await stream.receive_some(65536)
        assert chunk, f"the connection closed after {len(data)} bytes: {data[:200]!r}"
        data += chunk
    return data


async def h1_aborted_upload(port: int) -> None:
    """POST 600 KiB to /echo, read 1 KB of the echo, reset the connection."""
    stream = await trio.open_tcp_stream(HOST, port)
    head = b"POST /echo HTTP/1.1\r\nhost: demo\r\ncontent-length: %d\r\n\r\n" % UPLOAD

    async def upload() -> None:
        await stream.send_all(head)
        for _ in range(UPLOAD // 16384):
            await stream.send_all(b"u" * 16384)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(upload)
        await read_at_least(stream, 1024)
        nursery.cancel_scope.cancel()
    await reset_close(stream)


async def h1_aborted_download(port: int) -> None:
    """GET a long token stream, read 1 KB of it, reset the connection."""
    stream = await trio.open_tcp_stream(HOST, port)
    await stream.send_all(b"GET /stream?n=100000&ms=0 HTTP/1.1\r\nhost: demo\r\n\r\n")
    await read_at_least(stream, 1024)
    await reset_close(stream)


async def read_then_cancel(client: RawH2Client, sid: int) -> None:
    """Read 1 KB of the answer on ``sid``, then RST_STREAM(CANCEL) it."""
    received = 0
    while received < 1024:
        event = await client.next_event(sid)
        assert not isinstance(event, h2.events.StreamReset), event
        if isinstance(event, h2.events.DataReceived):
            received += len(event.data)
    client.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
    await client.flush()


async def h2_aborts(port: int, rounds: int = 50) -> None:
    """On one h2 connection: uploads and downloads cancelled with RST_STREAM(CANCEL) after 1 KB of answer."""
    async with RawH2Client.open(port) as client:
        for i in range(rounds):
            if i % 2:
                sid = await client.start(client.head(b"GET", b"/stream?n=100000&ms=0"))
            else:
                sid = await client.start(client.head(b"POST", b"/echo"), end_stream=False)
                for _ in range(12):  # 192 KiB: within the edge's 256 KiB stream window
                    await client.send(sid, b"u" * 16384)
            await read_then_cancel(client, sid)


async def whole_echo(url: str, *, http2: bool) -> None:
    body = bytes(range(256)) * (ONE_MIB // 256)
    async with httpx.AsyncClient(http2=http2, timeout=20, trust_env=False) as client:
        response = await client.post(f"{url}/echo", content=body)
    assert response.status_code == 200
    assert len(response.content) == len(body)
    assert response.content == body


@pytest.fixture(params=["h2", "h1"], ids=["h2-replicas", "h1-replicas"])
async def chain(request: pytest.FixtureRequest, nursery: trio.Nursery) -> chain_recipe.Chain:
    running: chain_recipe.Chain = await nursery.start(
        functools.partial(chain_recipe.main, replicas=2, replica_protocol=request.param, announce=False)
    )
    return running


async def ws_aborted_echo(port: int, message: str = "w" * (200 * 1024)) -> None:
    """Send three big messages, read one echo, reset the connection."""
    stream = await trio.open_tcp_stream(HOST, port)
    async with trio.open_nursery() as nursery:
        ws = await trio_websocket.wrap_client_stream(nursery, stream, f"{HOST}:{port}", "/echo")
        for _ in range(3):
            await ws.send_message(message)
        assert await ws.get_message() == message
        await reset_close(stream)
        nursery.cancel_scope.cancel()


async def h2_ws_aborts(port: int, rounds: int = 50) -> None:
    """On one h2 connection: WebSockets (RFC 8441) that send 192 KiB, read 1 KB of the echo, and are cancelled."""
    async with RawH2Client.open(port) as client:
        for _ in range(rounds):
            head = client.head(b"CONNECT", b"/echo", (b"sec-websocket-version", b"13"))
            head.insert(1, (b":protocol", b"websocket"))
            sid = await client.start(head, end_stream=False)
            event = await client.next_event(sid)
            assert isinstance(event, h2.events.ResponseReceived) and (b":status", b"200") in event.headers, event
            frame = bytes(FrameProtocol(client=True, extensions=[]).send_data(b"w" * (192 * 1024 - 14), fin=True))
            for offset in range(0, len(frame), 16384):
                await client.send(sid, frame[offset : offset + 16384])
            await read_then_cancel(client, sid)


ABORTS = {
    "h1 uploads reset mid-echo": (h1_aborted_upload, 200),
    "h1 downloads reset mid-stream": (h1_aborted_download, 200),
    "h2 uploads and downloads cancelled": (h2_aborts, 4),  # (50 a connection)
    "h1 WebSockets reset mid-echo": (ws_aborted_echo, 100),
    "h2 WebSockets cancelled mid-echo": (h2_ws_aborts, 2),
}


@pytest.mark.parametrize("kind", list(ABORTS))
async def test_aborted_exchanges_give_back_their_window(chain: chain_recipe.Chain, kind: str) -> None:
    """Hundreds of aborted exchanges, then every connection's books balance and 1 MiB still goes through whole."""
    abort, times = ABORTS[kind]
    with trio.fail_after(120):
        for _ in range(times):
            await abort(chain.edge.port)
        await wait_balanced(chain)
        await whole_echo(chain.url, http2=False)
        await whole_echo(chain.url, http2=True)
        await wait_balanced(chain)
