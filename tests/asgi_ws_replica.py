"""A plain ASGI app with a WebSocket route, run by hypercorn as a separate process: a replica not of the project.

    hypercorn tests.asgi_ws_replica:app --bind 127.0.0.1:0 --worker-class trio

Over an h1 Upgrade or h2's extended CONNECT (RFC 8441), ``/ws`` is
accepted: its first message is ``hello from hypercorn-PORT`` (the port it
listens on), then every message comes back as it was sent (text or bytes)
until the client closes. Any other WebSocket path is refused (403); plain
HTTP requests get a 404. (``tests/asgi_replica.py`` is the HTTP one.)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]


async def app(
    scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"WebSockets only, on /ws\n"})
        return
    if (await receive())["type"] != "websocket.connect":
        return
    if scope["path"] != "/ws":
        await send({"type": "websocket.close", "code": 1008})  # before the accept: a 403
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": f"hello from hypercorn-{scope['server'][1]}"})
    while True:
        message = await receive()
        if message["type"] != "websocket.receive":
            return  # websocket.disconnect
        if message.get("text") is not None:
            await send({"type": "websocket.send", "text": message["text"]})
        else:
            await send({"type": "websocket.send", "bytes": message.get("bytes") or b""})
