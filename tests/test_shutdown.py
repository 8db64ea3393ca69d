"""Graceful shutdown: requests in flight finish, new connections are refused,
and the recipe's command exits 0 on Ctrl-C.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing
from support import HOST, Lines, curl, start_recipe

from recipes.chain import Chain, main

REPO = Path(__file__).resolve().parent.parent


async def in_flight(chain: Chain) -> int:
    return sum(chain.worker.statistics().in_flight.values())


@pytest.mark.parametrize("client", ["h1-httpx", "h2-curl"])
async def test_shutdown_lets_the_request_in_flight_finish(nursery: trio.Nursery, client: str) -> None:
    outcome: dict[str, str] = {}

    async def slow_request(url: str) -> None:
        if client == "h1-httpx":
            async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
                response = await http.get(url)
            outcome.update(status=str(response.status_code), version=response.http_version, body=response.text)
        else:
            output = await curl("--http2-prior-knowledge", "-w", "%{http_code} %{http_version}", url)  # body ends in \n
            body, _, tail = output.rpartition("\n")
            status, version = tail.split()
            outcome.update(status=status, version=version, body=body + "\n")

    with trio.fail_after(20):
        chain: Chain = await nursery.start(main)
        port = chain.edge.port
        async with trio.open_nursery() as inner:
            inner.start_soon(slow_request, chain.url + "/sleep?ms=800")
            while not await in_flight(chain):
                await trio.sleep(0.005)
            inner.start_soon(chain.shutdown, 5.0)
            while not chain.edge.statistics().draining:
                await trio.sleep(0)
            await trio.testing.wait_all_tasks_blocked()  # the accept loop has seen its cancellation
            with pytest.raises(OSError):
                stream = await trio.open_tcp_stream(HOST, port)
                await stream.aclose()
            assert await in_flight(chain) == 1  # refused while the old request is still being served
    assert outcome == {
        "status": "200",
        "version": "HTTP/1.1" if client == "h1-httpx" else "2",
        "body": "slept\n",
    }


async def test_recipe_command_exits_0_on_sigint() -> None:
    output = b""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                lambda task_status: trio.run_process(
                    [sys.executable, "-m", "recipes.chain", "--port", "0"],
                    stdout=subprocess.PIPE,
                    cwd=REPO,
                    check=False,
                    task_status=task_status,
                )
            )
            assert process.stdout is not None
            match = None
            while match is None:
                chunk = await process.stdout.receive_some()
                assert chunk, f"the recipe exited early: {output!r}"
                output += chunk
                match = re.search(rb"edge listening on http://127\.0\.0\.1:(\d+)\n", output)
            port = int(match.group(1))
            assert port > 0
            body = await curl(f"http://127.0.0.1:{port}/")
            assert body.startswith("hello from replica-")
            process.send_signal(signal.SIGINT)
            while chunk := await process.stdout.receive_some():
                output += chunk
            assert await process.wait() == 0, output
    assert b"draining..." in output
    assert output.endswith(b"stopped\n")


# -- every recipe, as a command --------------------------------------------------------------------

RECIPES = {
    # recipe: (its arguments, the line that names where to send a request, the path, what its answer ends with)
    "chain": (["--port", "0"], r"^edge listening on http://127\.0\.0\.1:(\d+)$", "/echo", b"cd"),
    "chat": ([], r"^chat on http://127\.0\.0\.1:(\d+)/", "/", b"</script>\n"),
    "fleet": ([], r"^\[a\] proxy a listening on http://127\.0\.0\.1:(\d+) ", "/echo", b"cd"),
    "noisy_neighbour": (
        ["--seconds", "600", "--flood", "0", "--rate", "1"],
        r"^edge listening on http://127\.0\.0\.1:(\d+)$",
        "/echo",
        b"cd",
    ),
    "shadow": (["--serve", "--requests", "0"], r"^edge listening on http://127\.0\.0\.1:(\d+)$", "/search?q=x", b"x\n"),
}
"""An echo (the demo replicas) returns the body as it comes, the shop answers once it has all come: either
way the request is in flight until the test sends the rest. (The chat page answers at once, unread body
and all: its case has nothing in flight.)"""
HELD = {"chain", "fleet", "noisy_neighbour", "shadow"}


async def start_held(nursery: trio.Nursery, recipe: str) -> tuple[trio.Process, Lines, trio.SocketStream]:
    """Start ``recipe``; return it with a request in flight on the stream: its head and half its body sent."""
    args, ready, path, _ = RECIPES[recipe]
    process, lines = await start_recipe(nursery, *args, recipe=recipe)
    port = int((await lines.until(ready)).group(1))
    stream = await trio.open_tcp_stream(HOST, port)
    head = f"POST {path} HTTP/1.1\r\nhost: demo.example\r\ncontent-length: 4\r\n\r\nab"
    await stream.send_all(head.encode())
    return process, lines, stream


async def read_until(stream: trio.SocketStream, received: bytes, end: bytes) -> bytes:
    while end not in received:
        chunk = await stream.receive_some()
        assert chunk, f"the connection closed before {end!r}: {received!r}"
        received += chunk
    return received


async def stderr_of(process: trio.Process) -> str:
    assert process.stderr is not None
    return await Lines(process.stderr).rest()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
async def test_every_recipe_drains_on_a_signal(recipe: str, signum: signal.Signals) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process, lines, stream = await start_held(nursery, recipe)
            async with stream:
                received = await read_until(stream, b"", b"\r\n\r\n")  # the replica has it: in flight
                assert received.startswith(b"HTTP/1.1 200 "), received
                if recipe not in HELD:
                    received = await read_until(stream, received, RECIPES[recipe][3])
                process.send_signal(signum)
                await lines.until(r"^draining\.\.\.$")
                if recipe in HELD:
                    await stream.send_all(b"cd")  # the rest of its body, after the drain began
                    await read_until(stream, received, RECIPES[recipe][3])
            assert await process.wait() == 0, lines.text
            assert (await lines.rest()).endswith("stopped\n")
            assert "Traceback" not in await stderr_of(process)


@pytest.mark.parametrize("recipe", sorted(HELD))  # (with nothing in flight, the drain may end before the second)
async def test_every_recipe_stops_at_once_on_a_second_signal(recipe: str) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process, lines, stream = await start_held(nursery, recipe)
            async with stream:
                await read_until(stream, b"", b"\r\n\r\n")  # in flight: the drain would wait for it
                process.send_signal(signal.SIGTERM)
                await lines.until(r"^draining\.\.\.$")
                process.send_signal(signal.SIGTERM)
                await lines.until(r"^stopping now$")
                assert await process.wait() == 128 + signal.SIGTERM
            assert not re.search(r"^stopped$", await lines.rest(), re.MULTILINE)
            assert "Traceback" not in await stderr_of(process)
