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
from support import HOST, curl

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
