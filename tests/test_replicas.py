"""Your own servers behind the chain: servers that are not part of the project, as replicas.

The replica here is Python's own ``http.server`` (HTTP/1.x), run as a
separate process serving a file. Two ways to put it behind the chain:

- a route entry naming it, behind a worker that was never configured with
  it: the proxy tells the worker where the replica is
  (``x-proxyblocks-target``, from the route entry), so a route file or an
  etcd entry naming any server works;
- ``python -m recipes.chain --replica http://host:port``, run exactly as
  the docs say, as a subprocess.

Loopback only, port 0, every wait bounded.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
import pytest
import trio
from support import BODY, HOST, http_server, start_recipe

from blocks import LocalReplica, open_chain, route_records

REPO = Path(__file__).resolve().parent.parent


async def get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        return await client.get(url)


async def test_a_route_entry_naming_any_server_reaches_it_through_a_worker_that_never_heard_of_it(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with http_server(tmp_path) as address, open_chain(host=HOST) as chain:
            await chain.start_worker({}, app=None)  # configured with no replica at all
            yours = {"yours-0": LocalReplica(address, "h1")}
            chain.store.transact(route_records("yours", yours, worker=(HOST, chain.worker_server.port), domains=["*"]))
            await chain.start_proxy()
            await chain.start_edge()
            response = await get(f"{chain.url}/hello.txt")
            assert (response.status_code, response.content) == (200, BODY)
            assert chain.worker.replicas == {}
            assert chain.worker.statistics().served == {"yours-0": 1}
            await chain.shutdown(5)


async def test_a_bad_target_is_a_503_not_a_connection_anywhere(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_chain(host=HOST) as chain:
            await chain.start_worker({}, app=None)
            worker = (HOST, chain.worker_server.port)
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                for target in (b"h3 127.0.0.1:1", b"h1 nowhere", b"h2 [::1"):
                    response = await client.get(
                        f"http://{worker[0]}:{worker[1]}/",
                        headers={"x-proxyblocks-target": target.decode(), "x-proxyblocks-replica": "elsewhere"},
                    )
                    assert response.status_code == 503, target
            assert chain.worker.statistics().served == {}
            await chain.shutdown(5)


async def test_the_chain_recipe_fronts_your_server(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with http_server(tmp_path) as (host, port), trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--replica", f"http://{host}:{port}")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            await lines.until(r"^proxy listening on h2c://127\.0\.0\.1:\d+$")  # every address it listens on
            await lines.until(r"^worker listening on h2c://127\.0\.0\.1:\d+$")
            response = await get(f"{url}/hello.txt")
            assert (response.status_code, response.content) == (200, BODY)
            assert "server-timing" in response.headers  # it went through the chain's hops
            process.send_signal(signal.SIGINT)
            output = await lines.rest()
            assert output.endswith("draining...\nstopped\n")
            assert "replica " not in output  # no demo replica started: yours is the replica
            assert await process.wait() == 0


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:21", "http://127.0.0.1", "h2c://127.0.0.1:9000/api", "127.0.0.1:80"])
async def test_a_replica_url_it_cannot_use_is_a_one_line_error_and_exit_code_2(url: str) -> None:
    with trio.fail_after(30):
        result = await trio.run_process(
            [sys.executable, "-m", "recipes.chain", "--replica", url],
            capture_stdout=True,
            capture_stderr=True,
            cwd=REPO,
            check=False,
        )
    assert result.returncode == 2
    last = result.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("proxyblocks: error: argument --replica: ") and url in last
    assert b"Traceback" not in result.stderr and result.stdout == b""
