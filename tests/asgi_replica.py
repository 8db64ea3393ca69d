"""A plain ASGI app that hypercorn serves, run as a separate process: a replica that is not part of the project.

    hypercorn tests.asgi_replica:app --bind 127.0.0.1:0 --worker-class trio
                                   # logs: Running on http://127.0.0.1:PORT (CTRL + C to quit)

Hypercorn serves HTTP/1.1 and HTTP/2 with prior knowledge (h2c) on the one
port. Every answer carries ``x-served-by: hypercorn``, ``x-replica:
hypercorn-PORT`` (the port it listens on) and ``x-http-version`` (the
protocol the request reached hypercorn with):

- ``GET /`` and ``GET /hello``: 200, ``hello from hypercorn\\n``;
- ``GET /headers``: 200, the request's headers as hypercorn saw them, one ``name: value`` a line;
- ``POST /echo``: 200, the request body streamed back chunk by chunk as it arrives;
- ``GET /count?n=N``: 200, N lines ``line I`` sent one at a time;
- ``POST /digest``: reads the whole request body, then 200, ``BYTES SHA256-HEX\n`` (an upload, then an answer);
- ``POST /ignore``: never reads the body, never answers (until the client goes);
- ``GET /big-head?size=N``: 200 with a field ``x-big`` of N bytes;
- anything else: 404, ``no page PATH\\n``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import trio

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
    assert scope["type"] == "http"
    path = scope["path"]

    async def start(status: int) -> None:
        headers = [
            (b"content-type", b"text/plain"),
            (b"x-served-by", b"hypercorn"),
            (b"x-http-version", scope["http_version"].encode()),
            (b"x-replica", b"hypercorn-%d" % scope["server"][1]),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(data: bytes, more: bool = False) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": more})

    if path in ("/", "/hello"):
        await start(200)
        await body(b"hello from hypercorn\n")
    elif path == "/headers":
        await start(200)
        await body(b"".join(b"%s: %s\n" % pair for pair in scope["headers"]))
    elif path == "/echo" and scope["method"] == "POST":
        await start(200)
        while True:
            message = await receive()
            await body(message.get("body", b""), more=True)
            if not message.get("more_body"):
                break
        await body(b"")
    elif path == "/digest" and scope["method"] == "POST":
        digest = hashlib.sha256()
        size = 0
        while True:
            message = await receive()
            data = message.get("body", b"")
            digest.update(data)
            size += len(data)
            if not message.get("more_body"):
                break
        await start(200)
        await body(b"%d %s\n" % (size, digest.hexdigest().encode()))
    elif path == "/big-head":
        size = int(scope["query_string"].decode().removeprefix("size="))
        fields = [(b"x-big", b"h" * size), (b"x-served-by", b"hypercorn")]
        await send({"type": "http.response.start", "status": 200, "headers": fields})
        await body(b"big head\n")
    elif path == "/ignore":
        await trio.sleep_forever()
    elif path == "/count":
        n = int(scope["query_string"].decode().removeprefix("n="))
        await start(200)
        for i in range(n):
            await body(b"line %d\n" % i, more=True)
        await body(b"")
    else:
        await start(404)
        await body(f"no page {path}\n".encode())
