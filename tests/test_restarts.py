"""Restarts of ``--processes N``: a planned one loses nothing, a crash only what was on the process.

Every case runs ``python -m recipes.chain --processes 2`` as docs/scale.md
says, with real processes, real sockets on 127.0.0.1 (port 0) and real
clients: h2load (a bounded ``-n`` per run, runs back to back while the
restart goes on) on long-lived h2 connections, and httpx on a new
connection per request (so the kernel picks a process for each). Cases
wait for printed lines and counts, each bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import attrs
import h2.events
import httpx
import pytest
import trio
from support import Lines, start_recipe
from test_goaway import Client
from test_processes import PROCESSES, _alive, stop

from blocks import HTTPServer, ListenerConfig, Request, Response, serve_http, text_response
from blocks.transport.listener import inherit_listener

RESTARTED = r"^restarted: process (\d) pid (\d+) -> (\d+)$"


@attrs.define
class Load:
    """What a client loop saw: each request's start, end (``trio.current_time()``) and outcome."""

    ok: int = 0
    failed: list[tuple[float, float, str]] = attrs.Factory(list)
    started: list[float] = attrs.Factory(list)


async def fresh_connections(url: str, load: Load, stop: trio.Event, path: str = "/") -> None:
    """Requests on a new connection each, one after another, until ``stop`` is set."""
    while not stop.is_set():
        began = trio.current_time()
        load.started.append(began)
        try:
            async with httpx.AsyncClient(trust_env=False, timeout=20) as client:
                response = await client.get(f"{url}{path}")
            outcome = None if response.status_code == 200 else f"status {response.status_code}"
        except httpx.HTTPError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        if outcome is None:
            load.ok += 1
        else:
            load.failed.append((began, trio.current_time(), outcome))


H2LOAD = re.compile(r"requests: (\d+) total, (\d+) started, \d+ done, (\d+) succeeded")


async def h2load_runs(url: str, load: Load, stop: trio.Event) -> None:
    """h2load runs (``-n 400 -c 2 -m 4``: 2 h2 connections, 4 streams each) back to back until ``stop``:
    load, and every answer a 2xx.

    Its failure counts are not the server's: it opens no new connection for one that a GOAWAY
    ended (the requests it had left for it count as failed), and a request it queued just as the
    GOAWAY arrived is refused by its own library before it is sent (it counts as started and
    failed). :func:`h2_connections` counts what was sent.
    """
    while not stop.is_set():
        began = trio.current_time()
        result = await trio.run_process(
            ["h2load", "-n", "400", "-c", "2", "-m", "4", f"{url}/"], capture_stdout=True, check=False
        )
        text = result.stdout.decode()
        found = H2LOAD.search(text)
        assert found is not None, text
        succeeded = int(found.group(3))
        load.ok += succeeded
        if f"status codes: {succeeded} 2xx" not in text:
            load.failed.append((began, trio.current_time(), text[text.index("requests:") :]))


async def h2_connections(url: str, load: Load, stop: trio.Event) -> None:
    """HTTP/2 as RFC 9113 6.8 asks of a client, until ``stop``: up to 4 streams at a time on one
    connection (a hyper-h2 client, :class:`test_goaway.Client`); after a GOAWAY, no new stream on
    it, the open ones finish, then a new connection. A stream reset (refused included), answered
    other than 200, or cut by the connection's end is a failure."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    while not stop.is_set():
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            client = Client(stream)
            client.h2.initiate_connection()
            open_streams: dict[int, float] = {}
            goaway = False
            try:
                while True:
                    while not goaway and not stop.is_set() and len(open_streams) < 4:
                        sid = client.h2.get_next_available_stream_id()
                        client.request(sid, b"/")
                        open_streams[sid] = trio.current_time()
                        load.started.append(open_streams[sid])
                    await client.flush()
                    if not open_streams and (goaway or stop.is_set()):
                        break
                    got = await client.frame()
                    if got is None:
                        break
                    heard = len(client.events)
                    client.feed(got[1])
                    for event in client.events[heard:]:
                        if isinstance(event, h2.events.ConnectionTerminated):
                            goaway = True
                        elif isinstance(event, h2.events.DataReceived):
                            client.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                        elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                            began = open_streams.pop(event.stream_id)
                            status = client.status(event.stream_id)
                            if isinstance(event, h2.events.StreamEnded) and status == b"200":
                                load.ok += 1
                            else:
                                load.failed.append((began, trio.current_time(), f"{event} {status!r}"))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            for sid, began in open_streams.items():
                load.failed.append((began, trio.current_time(), f"stream {sid} cut by the connection's end"))


needs_h2load = pytest.mark.skipif(shutil.which("h2load") is None, reason="h2load is not installed")


@needs_h2load
async def test_a_rolling_restart_under_load_fails_no_request() -> None:
    """SIGUSR2 to the parent: each process is replaced in turn (the replacement serves, then the old
    one drains) while new HTTP/1.1 connections, h2 connections that follow GOAWAY and h2load run:
    not one request fails, and every process's pid changed."""
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--processes", "2")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            before = (await lines.next(PROCESSES)).groups()[:2]
            done = trio.Event()
            h1, h2, bench = Load(), Load(), Load()
            async with trio.open_nursery() as clients:
                for _ in range(2):
                    clients.start_soon(fresh_connections, url, h1, done)
                    clients.start_soon(h2_connections, url, h2, done)
                clients.start_soon(h2load_runs, url, bench, done)
                while h1.ok < 20 or h2.ok < 100 or bench.ok < 400:  # the load is on
                    await trio.sleep(0.05)
                process.send_signal(signal.SIGUSR2)
                restarted = [(await lines.next(RESTARTED)).groups() for _ in range(2)]
                after = (await lines.next(PROCESSES)).groups()[:2]
                served = h1.ok, h2.ok, bench.ok
                while h1.ok < served[0] + 20 or h2.ok < served[1] + 100 or bench.ok < served[2] + 400:  # and after
                    await trio.sleep(0.05)
                done.set()
            assert [row[:2] for row in restarted] == [("0", before[0]), ("1", before[1])]
            assert after == (restarted[0][2], restarted[1][2])
            assert not set(after) & set(before)
            assert h1.failed == [] and h2.failed == [] and bench.failed == []
            await stop(process, lines)
    assert not any(_alive(int(pid)) for pid in (*before, *after))


async def test_a_killed_process_loses_only_its_requests_in_flight() -> None:
    """``kill -9`` of one process: the requests that fail are among those in flight when it died
    (none started after it), and once it is started again both processes serve."""
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--processes", "2")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            first, second = (await lines.next(PROCESSES)).groups()[:2]
            done = trio.Event()
            load = Load()
            async with trio.open_nursery() as clients:
                for _ in range(4):
                    clients.start_soon(fresh_connections, url, load, done, "/sleep?ms=100")
                while load.ok < 20:
                    await trio.sleep(0.05)
                killed_at = trio.current_time()
                in_flight = len(load.started) - load.ok - len(load.failed)
                os.kill(int(first), signal.SIGKILL)
                while _alive(int(first)):
                    await trio.sleep(0.01)
                dead_at = trio.current_time()
                again = (await lines.next(PROCESSES)).groups()[:2]
                served = load.ok
                while load.ok < served + 40:
                    await trio.sleep(0.05)
                done.set()
            assert again[0] not in (first, second) and again[1] == second
            assert len(load.failed) <= in_flight, load.failed
            assert all(began <= dead_at for began, _, _ in load.failed), (killed_at, dead_at, load.failed)
            await stop(process, lines)


async def test_restarting_one_process_and_a_restart_that_fails(tmp_path: Path) -> None:
    """SIGUSR2 to one process restarts that one only. A replacement that cannot start (the config
    file, read anew by each new process, now names a route file that is not there) is one line, and
    the old process serves on."""
    config = tmp_path / "chain.toml"
    routes = tmp_path / "routes.toml"
    routes.write_text("[domains]\n")
    config.write_text('routes = "routes.toml"\n')
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--processes", "2", "--config", str(config))
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            first, second = (await lines.next(PROCESSES)).groups()[:2]
            os.kill(int(second), signal.SIGUSR2)
            assert (await lines.next(RESTARTED)).groups()[:2] == ("1", second)
            now = (await lines.next(PROCESSES)).groups()[:2]
            assert now[0] == first and now[1] != second
            config.write_text('routes = "missing.toml"\n')  # (the processes serving keep theirs)
            process.send_signal(signal.SIGUSR2)
            assert process.stderr is not None
            said = (await Lines(process.stderr).until(r"^proxyblocks: restart failed: .*$")).group(0)
            assert said.startswith("proxyblocks: restart failed: process 0 (pid ")
            assert said.endswith(f"; pid {first} serves on") and "missing.toml" in said, said
            assert (await lines.next(PROCESSES)).groups()[:2] == now  # the roll stopped at the failure
            for _ in range(6):
                async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                    assert (await client.get(f"{url}/")).status_code == 200
            assert "restarted" not in lines.text[lines.seen :]
            await stop(process, lines)


async def test_sigusr2_to_one_process_alone_is_one_line() -> None:
    """Without ``--processes``, SIGUSR2 restarts nothing (no other process would take the traffic):
    one line says so, and the command serves on."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery)
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            await lines.until(r"^replica replica-1 listening")
            process.send_signal(signal.SIGUSR2)
            assert process.stderr is not None
            said = (await Lines(process.stderr).until(r"^proxyblocks: SIGUSR2 .*$")).group(0)
            assert said == "proxyblocks: SIGUSR2 restarts a process of --processes N; this command runs one: ignored"
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                assert (await client.get(f"{url}/")).status_code == 200
            process.send_signal(signal.SIGTERM)
            assert (await lines.rest()).endswith("draining...\nstopped\n")
            assert await process.wait() == 0


async def test_connections_queued_on_a_shared_socket_wait_for_the_next_listener(nursery: trio.Nursery) -> None:
    """The mechanism under a planned restart, in one process: a listening socket held elsewhere (here
    by the test, as the parent holds each child's) and handed to a listener with ``inherit_listener``.
    The listener drains and stops accepting; the socket stays open, connections queue on it, and
    the next listener given the socket answers every one of them: none is reset or refused."""
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    held.bind(("127.0.0.1", 0))
    held.listen(64)
    port = held.getsockname()[1]
    config = ListenerConfig(reuse_port=True)

    async def hello(request: Request) -> Response:
        return text_response(200, "hello\n")

    async def ask(stream: trio.SocketStream) -> bytes:
        async with stream:
            await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            reply = b""
            while data := await stream.receive_some():
                reply += data
        return reply

    with held, trio.fail_after(20):
        inherit_listener(held.dup())
        first: HTTPServer = await nursery.start(functools.partial(serve_http, hello, port=port, config=config))
        assert (await ask(await trio.open_tcp_stream("127.0.0.1", port))).startswith(b"HTTP/1.1 200")
        await first.aclose()
        queued = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(8)]  # no one accepts yet
        inherit_listener(held.dup())
        second: HTTPServer = await nursery.start(functools.partial(serve_http, hello, port=port, config=config))
        replies = [await ask(stream) for stream in queued]
        assert all(reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hello\n") for reply in replies)
        assert second.statistics().accepted == 8
        await second.aclose()


async def test_a_draining_listener_answers_what_waits_in_its_queue(nursery: trio.Nursery) -> None:
    """Closing a listening socket resets the connections in its accept queue: the drain accepts them
    first, and answers each one's request with ``connection: close``. The connections here are made
    and sent on without a checkpoint, so the listener's accept loop cannot take them before the
    drain does."""

    async def hello(request: Request) -> Response:
        return text_response(200, "hello\n")

    with trio.fail_after(20):
        server: HTTPServer = await nursery.start(functools.partial(serve_http, hello))
        waiting = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(5)]
        for sock in waiting:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        server.drain()
        for sock in waiting:
            async with trio.SocketStream(trio.socket.from_stdlib_socket(sock)) as stream:
                reply = b""
                while data := await stream.receive_some():
                    reply += data
            assert reply.startswith(b"HTTP/1.1 200") and b"connection: close" in reply.lower(), reply
            assert reply.endswith(b"hello\n")
        assert server.statistics().accepted == 5
