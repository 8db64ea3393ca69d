"""Servers that are not part of the project behind the chain, as a user runs them: the issue's "done when".

Each server is a separate process started the way its own docs say:
hypercorn serving a plain ASGI app (``tests/asgi_replica.py``, HTTP/1.1 and
h2c on one port) and a plain grpcio server (``tests/grpc_replica.py``). Each
goes behind its own ``python -m recipes.chain --replica ...`` subprocess,
exactly as docs/recipes.md says to run it (the replicas of one chain are one
app): hypercorn as two replicas, ``http://`` and ``h2c://`` on its one port,
grpcio as ``h2c://``. Clients: curl (HTTP/1.1 and HTTP/2 with prior
knowledge), httpx (a body streamed up and down) and grpcio. The tests assert
what the servers answered, bodies and the headers the app set, not only
statuses.

Loopback only, port 0, every wait bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import grpc
import httpx
import trio
from support import HYPERCORN, chain_recipe, child_process, curl
from test_grpc import CALL, RAW, converse, grpc_chain, in_thread


@asynccontextmanager
async def hypercorn_chain() -> AsyncIterator[str]:
    """hypercorn serving tests/asgi_replica.py, behind the chain as ``http://`` and ``h2c://``: the edge's URL."""
    async with child_process(HYPERCORN, r"Running on http://(\S+) \(CTRL", stderr=True) as (_, match):
        address = match.group(1)
        async with chain_recipe(f"http://{address}", f"h2c://{address}") as edge:
            yield edge


def parse(output: str) -> tuple[str, dict[str, list[str]], str]:
    """``curl -i`` output: the version and status (``HTTP/2 200``), the headers (lower-cased names, every value),
    the body."""
    head, _, body = output.partition("\r\n\r\n")
    status_line, *lines = head.split("\r\n")
    status = " ".join(status_line.split()[:2])
    headers: dict[str, list[str]] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers.setdefault(name.lower(), []).append(value.strip())
    return status, headers, body


async def test_curl_reaches_hypercorn_through_the_chain_over_h1_and_h2() -> None:
    with trio.fail_after(60):
        async with hypercorn_chain() as edge:
            for flag, version in [("--http1.1", "HTTP/1.1"), ("--http2-prior-knowledge", "HTTP/2")]:
                await curl_hypercorn(edge, flag, version)


async def curl_hypercorn(edge: str, flag: str, version: str) -> None:
    status, headers, body = parse(await curl("-i", flag, f"{edge}/hello"))
    assert status == f"{version} 200"
    assert body == "hello from hypercorn\n"
    assert headers["x-served-by"] == ["hypercorn"] and headers["content-type"] == ["text/plain"]
    assert headers["server"][0].startswith("hypercorn-")
    assert "server-timing" in headers  # through the chain's hops

    status, headers, body = parse(
        await curl("-i", flag, "-H", "x-custom: from curl", "-H", "te: trailers", f"{edge}/headers")
    )
    assert status == f"{version} 200"
    seen = body.splitlines()
    assert "x-custom: from curl" in seen and f"host: {edge.removeprefix('http://')}" in seen
    assert "te: trailers" in seen  # what a gRPC client sends, to an h1 or an h2 replica alike

    status, headers, body = parse(await curl("-i", flag, f"{edge}/nowhere"))
    assert (status, body) == (f"{version} 404", "no page /nowhere\n")  # the app's own 404, not the chain's
    assert headers["x-served-by"] == ["hypercorn"]

    status, headers, body = parse(await curl("-i", flag, "--data-binary", "posted by curl", f"{edge}/echo"))
    assert (status, body) == (f"{version} 200", "posted by curl")


def chunks(n: int, size: int) -> Iterator[bytes]:
    for i in range(n):
        yield bytes([i % 251]) * size


async def test_httpx_streams_bodies_up_and_down_through_the_chain_to_hypercorn_over_h1_and_h2() -> None:
    with trio.fail_after(60):
        async with hypercorn_chain() as edge:
            for http2 in (False, True):
                async with httpx.AsyncClient(http1=not http2, http2=http2, trust_env=False, timeout=20) as client:
                    await stream_through(client, edge, "HTTP/2" if http2 else "HTTP/1.1")


async def stream_through(client: httpx.AsyncClient, edge: str, version: str) -> None:
    sent = b"".join(chunks(16, 16384))  # 256 KiB (four h2 windows), streamed up in 16 chunks

    async def upload() -> AsyncIterator[bytes]:
        for chunk in chunks(16, 16384):
            yield chunk

    async with client.stream("POST", f"{edge}/echo", content=upload()) as response:
        assert response.http_version == version
        assert (response.status_code, response.headers["x-served-by"]) == (200, "hypercorn")
        assert b"".join([chunk async for chunk in response.aiter_raw()]) == sent

    async with client.stream("GET", f"{edge}/count", params={"n": 300}) as response:
        assert response.status_code == 200
        assert [line async for line in response.aiter_lines()] == [f"line {i}" for i in range(300)]

    # Both replicas answer, each reached in its own protocol: http:// as HTTP/1.1, h2c:// as HTTP/2.
    versions = set()
    while versions != {"1.1", "2"}:
        response = await client.get(f"{edge}/hello")
        assert (response.status_code, response.text) == (200, "hello from hypercorn\n")
        versions.add(response.headers["x-http-version"])


async def test_grpcio_reaches_a_grpcio_server_through_the_chain() -> None:
    with trio.fail_after(60):
        async with grpc_chain() as (client, _):
            assert await client.call("Unary", b"hello") == b"HELLO"
            stream = client.method("Count", "unary_stream")
            assert await in_thread(lambda: list(stream(b"3", timeout=CALL))) == [b"0", b"1", b"2"]
            assert await in_thread(converse, client, [b"ping", b"pong"]) == [b"ping", b"pong"]
            assert (await client.error("Slow", b"", timeout=0.3)).code() == grpc.StatusCode.DEADLINE_EXCEEDED
            error = await client.error("Fail", b"carol")
            assert (error.code(), error.details()) == (grpc.StatusCode.PERMISSION_DENIED, "no entry for carol")
            reply, call = await in_thread(client.method("Metadata").with_call, b"", timeout=CALL)
            assert reply == b"ok" and ("x-initial", "hello") in call.initial_metadata()
            assert list(call.trailing_metadata()) == [("x-trailer", "bye"), ("x-raw-bin", RAW)]
