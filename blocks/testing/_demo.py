"""The demo replica app: a real server to put behind the chain.

Answers under any authority:

- ``GET /`` -> 200; body and ``x-replica`` name the replica.
- ``POST /echo`` -> streams the request body back as it arrives.
- ``GET /stream?n=N&ms=M`` -> N chunks, one every M ms (a token stream).
- ``GET /trailers`` -> a body, then trailers (``grpc-status: 0``) over h2.
- ``GET /status/CODE`` -> that status.
- ``GET /sleep?ms=N`` -> 200 after N ms.

and WebSockets (h1 Upgrade or h2 extended CONNECT), with
:func:`websocket_echo`:

- any path: every message comes back as it was sent (text or binary); the
  first subprotocol the client proposes is accepted; the text message
  ``close CODE REASON`` makes the replica close with that code and reason;
- ``/reject/CODE``: the handshake is refused with that status;
- ``/silent``: the handshake is never answered.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from urllib.parse import parse_qs

import trio
import trio_websocket

from blocks.http import Body, BytesBody, IterBody, Request, Response, text_response
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http
from blocks.websocket import open_websocket_app

MAX_STREAM_CHUNKS = 100_000


class DemoApp:
    def __init__(self, name: str) -> None:
        self.name = name
        self._name = name.encode()
        self._hello = f"hello from {name}\n".encode()

    async def __call__(self, request: Request) -> Response:
        path, _, query = request.path.partition(b"?")
        replica = (b"x-replica", self._name)
        if path == b"/":
            return Response(
                200,
                [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(self._hello)), replica],
                BytesBody(self._hello),
            )
        if path == b"/echo":
            headers = [(b"content-type", request.header(b"content-type", b"application/octet-stream") or b""), replica]
            if request.body.length is not None:
                headers.append((b"content-length", b"%d" % request.body.length))
            return Response(200, headers, IterBody(_echo(request.body), request.body.length))
        args = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
        if path == b"/stream":
            n = _int(args.get("n"), 10, 0, MAX_STREAM_CHUNKS)
            ms = _int(args.get("ms"), 100, 0, 60_000)
            if n is None or ms is None:
                return text_response(400, f"n must be 0..{MAX_STREAM_CHUNKS}, ms 0..60000\n", [replica])
            return Response(200, [(b"content-type", b"text/plain"), replica], IterBody(_ticks(n, ms)))
        if path == b"/trailers":
            body = BytesBody(b"body before trailers\n", trailers=[(b"grpc-status", b"0")])
            return Response(200, [(b"content-type", b"text/plain"), (b"trailer", b"grpc-status"), replica], body)
        if path.startswith(b"/status/"):
            code = _int(path[8:].decode("latin-1"), 0, 200, 599)
            if code is None:
                return text_response(400, "status must be 200..599\n", [replica])
            return text_response(code, f"status {code}\n", [replica])
        if path == b"/sleep":
            ms = _int(args.get("ms"), 0, 0, 600_000)
            if ms is None:
                return text_response(400, "ms must be 0..600000\n", [replica])
            await trio.sleep(ms / 1000)
            return text_response(200, "slept\n", [replica])
        return text_response(404, "not found\n", [replica])


def _int(raw: str | None, default: int, low: int, high: int) -> int | None:
    """``raw`` as an int within ``[low, high]``; ``default`` when absent; None when bad."""
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        return None
    return value if low <= value <= high else None


async def _echo(body: Body) -> AsyncIterator[bytes]:
    while chunk := await body.receive():
        yield chunk


async def _ticks(n: int, ms: int) -> AsyncIterator[bytes]:
    for i in range(n):
        if i:
            await trio.sleep(ms / 1000)
        yield b"token %d\n" % i


async def websocket_echo(request: trio_websocket.WebSocketRequest) -> None:
    """The demo WebSocket handler, for ``trio_websocket.serve_websocket`` or :func:`~blocks.open_websocket_app`.

    Echoes every message; see the module docstring for ``close``,
    ``/reject/CODE`` and ``/silent``.
    """
    path = request.path.partition("?")[0]
    if path.startswith("/reject/"):
        code = _int(path[8:], 403, 400, 599) or 403
        await request.reject(code, body=f"refused with {code}\n".encode())
        return
    if path == "/silent":
        await trio.sleep_forever()
    proposed = request.proposed_subprotocols
    ws = await request.accept(subprotocol=proposed[0] if proposed else None)
    while True:
        try:
            message = await ws.get_message()
        except trio_websocket.ConnectionClosed:
            return
        if isinstance(message, str) and message.startswith("close "):
            close_code, _, reason = message[6:].partition(" ")
            await ws.aclose(int(close_code), reason)
            return
        await ws.send_message(message)


async def serve_demo_replica(
    name: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    config: ListenerConfig | None = None,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve :class:`DemoApp` ``name`` over h1 and h2c on one port, WebSockets (:func:`websocket_echo`) included.

    ``config``: the listener's settings (default ``ListenerConfig()``).
    """
    async with open_websocket_app(websocket_echo, DemoApp(name)) as app:
        serve = functools.partial(serve_http, app, host=host, port=port, config=config or ListenerConfig())
        await serve(task_status=task_status)
