"""The topology kit: route records, a chain built part by part, and a command's signals.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``; the
signal tests run a real process and send it real signals, waiting for the
lines it prints, never for a duration.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from support import HOST, Lines, curl, start_python

from blocks import Chain, LocalReplica, route_records, serve_chain
from blocks.routing import AppSettings, MirrorSetting
from blocks.store import (
    decode_domain,
    decode_replica,
    decode_settings,
    route_key_for_domain,
    route_key_for_replica,
    route_key_for_settings,
)

REPO = Path(__file__).resolve().parent.parent


def test_route_records_name_every_domain_replica_and_setting() -> None:
    replicas = {"r0": LocalReplica((HOST, 9001)), "r1": LocalReplica((HOST, 9002), "h1")}
    settings = AppSettings(mirror=MirrorSetting(to="shadow"))
    records = route_records("app", replicas, worker=(HOST, 9000), domains=["a.test", "*"], settings=settings)
    assert set(records) == {
        route_key_for_domain("a.test"),
        route_key_for_domain("*"),
        route_key_for_replica("app", "r0"),
        route_key_for_replica("app", "r1"),
        route_key_for_settings("app"),
    }
    assert decode_domain(records[route_key_for_domain("*")]) == "app"
    r1 = decode_replica("r1", records[route_key_for_replica("app", "r1")])
    assert (r1.worker, r1.address, r1.protocol) == ((HOST, 9000), (HOST, 9002), "h1")
    assert decode_settings(records[route_key_for_settings("app")]) == settings
    assert route_records("app", {}, worker=(HOST, 9000)) == {}


async def test_a_chain_built_part_by_part_serves_and_drains(nursery: trio.Nursery) -> None:
    async def build(chain: Chain) -> None:
        local = {"r0": await chain.start_replica("r0"), "r1": await chain.start_replica("r1", protocol="h1")}
        await chain.start_worker(local, app="demo", domains=["demo.test"])
        await chain.start_proxy()
        await chain.start_edge()

    with trio.fail_after(15):
        chain: Chain = await nursery.start(serve_chain, build)
        assert chain.url == f"http://{HOST}:{chain.port}"
        assert sorted(chain.replicas) == ["r0", "r1"] and len(chain.workers) == 1
        assert chain.cache.app_for(b"demo.test") == "demo"
        assert (await curl("-H", "host: demo.test", chain.url + "/")).startswith("hello from r")
        assert "503" in await curl("-o", "/dev/null", "-w", "%{http_code}", "-H", "host: other.test", chain.url + "/")
        await chain.shutdown(1.0)
        assert chain.edge.statistics().draining
        with pytest.raises(OSError):
            stream = await trio.open_tcp_stream(HOST, chain.port)
            await stream.aclose()


async def test_a_part_not_started_is_a_clear_error(nursery: trio.Nursery) -> None:
    async def build(chain: Chain) -> None:
        pass

    with trio.fail_after(5):
        chain: Chain = await nursery.start(serve_chain, build)
        with pytest.raises(RuntimeError, match="edge has not started"):
            _ = chain.edge
        with pytest.raises(RuntimeError, match="no worker"):
            _ = chain.worker
        await chain.shutdown(1.0)


# -- run_until_signal, in a real process ---------------------------------------------------------

PROGRAM = """
import functools, trio
from blocks import run_until_signal, serve_chain, serve_http

async def hold(request):
    print("holding", flush=True)
    await trio.sleep_forever()

async def build(chain):
    await chain.start_worker({"r": await chain.start_replica("r", functools.partial(serve_http, hold))})
    await chain.start_proxy()
    await chain.start_edge()

run_until_signal(functools.partial(serve_chain, build, announce=True), grace=60)
"""
"""A chain whose replica holds every request: a drain waits for it (up to 60 s)."""


async def _start(nursery: trio.Nursery) -> tuple[trio.Process, Lines]:
    return await start_python(nursery, "-c", PROGRAM)


async def _stderr(process: trio.Process) -> str:
    assert process.stderr is not None
    return (await Lines(process.stderr).rest()).strip()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_the_first_signal_drains_and_exits_0(signum: signal.Signals) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            process, lines = await _start(nursery)
            port = int((await lines.until(r"^edge listening on http://127\.0\.0\.1:(\d+)$")).group(1))
            assert port > 0
            process.send_signal(signum)
            await lines.until(r"^draining\.\.\.$")
            assert (await lines.rest()).endswith("draining...\nstopped\n")
            assert await process.wait() == 0
            assert await _stderr(process) == ""


async def test_a_second_signal_stops_at_once_without_a_traceback() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            process, lines = await _start(nursery)
            port = int((await lines.until(r"^edge listening on http://127\.0\.0\.1:(\d+)$")).group(1))
            client = await trio.open_tcp_stream(HOST, port)
            async with client:
                await client.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                await lines.until(r"^holding$")  # a request in flight: the drain waits for it
                process.send_signal(signal.SIGINT)
                await lines.until(r"^draining\.\.\.$")
                process.send_signal(signal.SIGINT)
                await lines.until(r"^stopping now$")
                assert await process.wait() == 128 + signal.SIGINT
            assert "stopped\n" not in await lines.rest()
            assert "Traceback" not in await _stderr(process)


async def test_the_self_signed_key_is_removed_when_the_chain_exits() -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            process: trio.Process = await nursery.start(
                functools.partial(
                    trio.run_process,
                    [sys.executable, "-m", "recipes.chain", "--tls"],
                    stdout=subprocess.PIPE,
                    cwd=REPO,
                    check=False,
                )
            )
            assert process.stdout is not None
            lines = Lines(process.stdout)
            cert = Path((await lines.until(r"^certificate: (\S+)")).group(1))
            assert cert.exists() and len(list(cert.parent.iterdir())) == 2  # the certificate and its key
            process.send_signal(signal.SIGINT)
            await lines.until(r"^stopped$")
            assert await process.wait() == 0
    assert not cert.parent.exists()
