from __future__ import annotations

import httpx
import trio

from blocks import parse_server_timing
from recipes.chain import Chain


async def test_get_through_the_chain_over_h2(chain: Chain) -> None:
    with trio.fail_after(10):
        async with httpx.AsyncClient(http2=True, http1=False) as client:
            response = await client.get(chain.url + "/")
    assert response.status_code == 200
    assert response.http_version == "HTTP/2"
    assert response.text.startswith("hello from replica-")
    phases = parse_server_timing(response.headers["server-timing"])
    assert {"app", "worker", "proxy-route", "proxy", "edge", "total"} <= set(phases)
