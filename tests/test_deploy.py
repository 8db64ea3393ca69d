"""The chain as it is deployed: one role per process, a config file, your certificate, SIGHUP reloads.

Every case runs ``python -m recipes.chain`` as a subprocess, exactly as the
docs say, in front of servers that are not part of the project (Python's
own ``http.server``), and talks to it with httpx. Loopback only, port 0,
every wait bounded and on a state (a printed line, an answer).
"""

from __future__ import annotations

import json
import re
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import h11
import httpx
import pytest
import trio
import trustme
from support import REPO, Lines, http_server, start_recipe

ERROR = b"proxyblocks: "


async def get(url: str, *, host: str | None = None, verify: ssl.SSLContext | bool = False) -> httpx.Response:
    headers = {"host": host} if host else {}
    async with httpx.AsyncClient(trust_env=False, timeout=10, verify=verify) as client:
        return await client.get(url, headers=headers)


async def stop(process: trio.Process, lines: Lines) -> str:
    """SIGINT, then the rest of stdout; asserts the drain's lines and exit status 0."""
    process.send_signal(signal.SIGINT)
    output = await lines.rest()
    assert output.endswith("draining...\nstopped\n"), output
    assert await process.wait() == 0
    return output


async def test_each_role_in_a_process_of_its_own_fronts_your_server(tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with http_server(tmp_path) as (host, port), trio.open_nursery() as nursery:
            logs = {role: tmp_path / f"{role}.jsonl" for role in ("proxy", "worker")}
            worker, worker_lines = await start_recipe(nursery, "--role", "worker", "--access-log", str(logs["worker"]))
            at = (await worker_lines.until(r"^worker listening on (h2c://127\.0\.0\.1:\d+)$")).group(1)
            replica = f"http://{host}:{port}"
            proxy, proxy_lines = await start_recipe(
                nursery, "--role", "proxy", "--next-hop", at, "--replica", replica, "--access-log", str(logs["proxy"])
            )
            at = (await proxy_lines.until(r"^proxy listening on h2c://(127\.0\.0\.1:\d+)$")).group(1)
            edge, edge_lines = await start_recipe(nursery, "--role", "edge", "--next-hop", at)  # host:port works too
            url = (await edge_lines.until(r"^edge listening on (\S+)$")).group(1)
            response = await get(f"{url}/hello.txt")
            assert (response.status_code, response.text) == (200, "served by python's own http.server\n")
            hops = [entry.split(";")[0].strip() for entry in response.headers["server-timing"].split(",")]
            assert {"worker", "proxy", "edge"} <= set(hops), hops
            outputs = [await stop(process, lines) for process, lines in [(edge, edge_lines), (proxy, proxy_lines)]]
            outputs.append(await stop(worker, worker_lines))
            # Each process runs its role only, and says where it listens.
            for output, role in zip(outputs, ["edge", "proxy", "worker"], strict=True):
                assert [line.split()[0] for line in output.splitlines() if "listening on" in line] == [role]
    # A process of one role writes its access log at its hop: what that hop knew of the request.
    lines = {role: [json.loads(line) for line in log.read_text().splitlines()] for role, log in logs.items()}
    rid = response.headers["x-request-id"]
    proxy_line, worker_line = lines["proxy"], lines["worker"]
    assert [(line["hop"], line["request_id"], line["app"], line["replica"]) for line in proxy_line] == [
        ("proxy", rid, "demo", "replica-0")
    ]
    assert [(line["hop"], line["request_id"], line["replica"], line["status"]) for line in worker_line] == [
        ("worker", rid, "replica-0", 200)
    ]
    assert proxy_line[0]["bytes_out"] == worker_line[0]["bytes_out"] == len(response.content)


async def test_a_config_file_says_what_the_flags_say_and_a_flag_overrides_it(tmp_path: Path) -> None:
    config = tmp_path / "conf" / "chain.toml"
    config.parent.mkdir()
    with trio.fail_after(90):
        async with (
            http_server(tmp_path / "a", b"A\n") as a,
            http_server(tmp_path / "b", b"B\n") as b,
            http_server(tmp_path / "c", b"C\n") as c,
            trio.open_nursery() as nursery,
        ):
            config.write_text(
                f'replica = ["http://{a[0]}:{a[1]}"]\n'
                "replica-timeout = 5\n"
                "no-scheduler = true\n"
                "routes = 'routes.toml'\n"  # relative to the config file
                "[apps.other]\n"
                f'domains = ["other.example"]\nreplicas = ["http://{b[0]}:{b[1]}"]\n'
            )
            (config.parent / "routes.toml").write_text("[domains]\n")
            process, lines = await start_recipe(nursery, "--config", str(config))
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            assert (await get(f"{url}/hello.txt")).text == "A\n"
            assert (await get(f"{url}/hello.txt", host="other.example")).text == "B\n"
            await stop(process, lines)

            process, lines = await start_recipe(nursery, "--config", str(config), "--replica", f"http://{c[0]}:{c[1]}")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            assert (await get(f"{url}/hello.txt")).text == "C\n"  # the flag's list replaces the file's
            assert (await get(f"{url}/hello.txt", host="other.example")).text == "B\n"  # the rest of the file holds
            await stop(process, lines)


async def test_sighup_reloads_the_config_file_without_dropping_a_connection(tmp_path: Path) -> None:
    config = tmp_path / "chain.toml"
    with trio.fail_after(90):
        async with (
            http_server(tmp_path / "a", b"A\n") as a,
            http_server(tmp_path / "b", b"B\n") as b,
            trio.open_nursery() as nursery,
        ):
            config.write_text(f'replica = ["http://{a[0]}:{a[1]}"]\n')
            process, lines = await start_recipe(nursery, "--config", str(config))
            url = (await lines.until(r"^edge listening on http://(\S+)$")).group(1)
            connection = await KeptAlive.open(url)
            assert await connection.get("/hello.txt") == b"A\n"

            config.write_text(f'replica = ["http://{b[0]}:{b[1]}"]\n')
            process.send_signal(signal.SIGHUP)
            await lines.next(r"^reloaded$")
            assert await connection.get("/hello.txt") == b"B\n"  # the same connection, the new routes

            config.write_text("replica = ['ftp://nowhere']\n")
            process.send_signal(signal.SIGHUP)
            assert process.stderr is not None
            failed = await Lines(process.stderr).until(r"^proxyblocks: reload failed: (.*)$")
            assert str(config) in failed.group(1) and "ftp://nowhere" in failed.group(1)
            assert await connection.get("/hello.txt") == b"B\n"  # what was in force stays
            await connection.close()
            await stop(process, lines)


async def test_your_certificate_and_its_renewal_on_sighup(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    old, new = trustme.CA(), trustme.CA()

    def issue(ca: trustme.CA) -> ssl.SSLContext:
        served = ca.issue_cert("localhost")
        served.private_key_pem.write_to_path(str(key))
        served.cert_chain_pems[0].write_to_path(str(cert))
        trusting = ssl.create_default_context()
        ca.configure_trust(trusting)
        return trusting

    trusts_old = issue(old)
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--cert", str(cert), "--key", str(key))
            port = (await lines.until(r"^edge listening on https://127\.0\.0\.1:(\d+)$")).group(1)
            url = f"https://localhost:{port}/"
            async with httpx.AsyncClient(trust_env=False, verify=trusts_old, http2=True, timeout=10) as kept:
                response = await kept.get(url)
                assert (response.status_code, response.http_version) == (200, "HTTP/2")
                trusts_new = issue(new)
                process.send_signal(signal.SIGHUP)
                await lines.next(r"^reloaded$")
                response = await get(url, verify=trusts_new)  # a new connection: the renewed certificate
                assert response.status_code == 200
                # The connection made before the renewal was not dropped: a new one could not verify.
                assert (await kept.get(url)).status_code == 200
                with pytest.raises(httpx.ConnectError) as failed:
                    await get(url, verify=trusts_old)
                causes = [failed.value]
                while causes[-1].__context__ is not None:
                    causes.append(causes[-1].__context__)
                assert any(isinstance(cause, ssl.SSLCertVerificationError) for cause in causes), causes
            await stop(process, lines)


async def test_a_route_file_adds_to_the_recipes_routes(tmp_path: Path) -> None:
    routes = tmp_path / "routes.toml"
    routes.write_text("[domains]\n")
    with trio.fail_after(90):
        async with http_server(tmp_path / "b", b"B\n") as b, trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--routes", str(routes))
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            worker = (await lines.until(r"^worker listening on h2c://(\S+)$")).group(1)
            temporary = tmp_path / "routes.new"
            temporary.write_text(
                '[domains]\n"other.example" = "other"\n'
                f'[apps.other.replicas.b]\nworker = "{worker}"\naddress = "{b[0]}:{b[1]}"\nprotocol = "h1"\n'
            )
            temporary.replace(routes)
            while (response := await get(f"{url}/hello.txt", host="other.example")).status_code != 200:
                await trio.sleep(0.1)  # the file is polled: wait for the state, bounded above
            assert response.text == "B\n"
            demo = await get(f"{url}/")  # the recipe's own route (* -> demo) is still there
            assert demo.status_code == 200 and demo.headers["x-replica"].startswith("replica-")
            await stop(process, lines)


class KeptAlive:
    """One HTTP/1.1 keep-alive connection (h11 over a trio stream): a connection dropped fails :meth:`get`."""

    def __init__(self, stream: trio.SocketStream, authority: str) -> None:
        self.stream = stream
        self.authority = authority
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, authority: str) -> KeptAlive:
        host, port = authority.rsplit(":", 1)
        return cls(await trio.open_tcp_stream(host, int(port)), authority)

    async def get(self, path: str) -> bytes:
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        request = h11.Request(method="GET", target=path, headers=[("host", self.authority)])
        await self.stream.send_all(self.h11.send(request) + self.h11.send(h11.EndOfMessage()))
        body = b""
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                data = await self.stream.receive_some()
                assert data, "the connection was dropped"
                self.h11.receive_data(data)
            elif isinstance(event, h11.Response):
                assert event.status_code == 200, event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return body

    async def close(self) -> None:
        await self.stream.aclose()


@pytest.mark.parametrize("recipe", ["chain", "chat", "fleet", "noisy_neighbour", "serverless", "shadow"])
def test_the_docs_list_every_flag_of_every_recipe(recipe: str) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", f"recipes.{recipe}", "--help"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    # The flags are where argparse lists options, two spaces in (a default's text may mention others).
    flags = set(re.findall(r"^  (?:-\w, )?(--[a-z][\w-]*)", shown, re.MULTILINE)) - {"--help"}
    docs = (REPO / "docs" / "recipes.md").read_text()
    section = docs[docs.index(f"## `recipes/{recipe}.py`") :]
    section = section[: section.find("\n## ", 1)]
    assert "(default:" in shown or "default" in shown  # --help shows the defaults
    missing = sorted(flag for flag in flags if f"`{flag}" not in section)
    assert not missing, f"the {recipe} section of docs/recipes.md does not list {missing}"


async def test_the_recipe_opens_an_admin_port_and_writes_an_access_log(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--admin-port", "0", "--access-log", str(log))
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            admin = (await lines.until(r"^admin listening on (\S+)$")).group(1)
            answers = [await get(f"{url}/") for _ in range(3)]
            assert [answer.status_code for answer in answers] == [200, 200, 200]
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                assert (await client.get(f"{admin}/readyz")).status_code == 200
                metrics = (await client.get(f"{admin}/metrics")).text
            counted = [line for line in metrics.splitlines() if line.startswith("proxyblocks_requests_total{")]
            edge = [line for line in counted if 'hop="edge"' in line and 'status_class="2xx"' in line]
            assert [line.rpartition(" ")[2] for line in edge] == ["3.0"], counted
            await stop(process, lines)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [record["request_id"] for record in records] == [answer.headers["x-request-id"] for answer in answers]
    assert {(record["status"], record["app"]) for record in records} == {(200, "demo")}
