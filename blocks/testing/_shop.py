"""The shop demo app, in two builds that differ on some paths: what a mirror tee compares.

``shop_app(1)`` is the primary, ``shop_app(2)`` a candidate build: v2 rounds
a price of .xx5 down where v1 rounds it up (``/price?item=N``, so every
fourth item differs) and searches ten times more slowly (``/search?q=...``);
``/`` and ``/about`` are the same. :func:`send_shop_traffic` sends it
requests over :data:`SHOP_PATHS`, as ``recipes/shadow.py`` does.
"""

from __future__ import annotations

from urllib.parse import parse_qs

import trio

from blocks.http import Handler, Request, Response, text_response
from blocks.routing import Address
from blocks.transport.multiplexer import open_upstreams

SHOP_PATHS = ["/", "/price?item={i}", "/search?q=item{i}", "/price?item={i}", "/about"]
"""The paths :func:`send_shop_traffic` cycles over, each formatted with ``i``, the request's number."""


def shop_app(version: int) -> Handler:
    """The shop app's handler, build ``version`` (1 or 2)."""

    async def handler(request: Request) -> Response:
        path, _, query = request.path.partition(b"?")
        args = {k: v[-1] for k, v in parse_qs(query.decode("latin-1")).items()}
        if path == b"/price":
            item = int(args.get("item", "0") or 0)
            cents = item * 1105  # tenths of a cent: 11.05 per unit
            price = (cents + 5) // 10 if version == 1 or item % 4 != 1 else cents // 10
            return text_response(200, f"item {item}: {price // 100}.{price % 100:02d}\n")
        if path == b"/search":
            await trio.sleep(0.02 if version == 2 else 0.002)
            return text_response(200, f"results for {args.get('q', '')!s}\n")
        if path == b"/about":
            return text_response(200, "the shop\n")
        if path == b"/":
            return text_response(200, "welcome\n")
        return text_response(404, "not found\n")

    return handler


async def send_shop_traffic(edge: Address, requests: int, *, concurrency: int = 8) -> None:
    """``requests`` GETs (host ``shop.example``) through ``edge``, cycling over :data:`SHOP_PATHS`.

    ``concurrency`` clients send their share one after the other, on one
    pooled connection; returns once every answer has been read. A request
    that fails raises.
    """
    paths = [SHOP_PATHS[i % len(SHOP_PATHS)].format(i=i).encode() for i in range(requests)]
    async with open_upstreams() as client, trio.open_nursery() as nursery:

        async def send(mine: list[bytes]) -> None:
            for path in mine:
                response = await client.request(edge, Request(b"GET", b"http", b"shop.example", path), [])
                await response.body.read_all()

        for k in range(concurrency):
            nursery.start_soon(send, paths[k::concurrency])
