"""The access log, request ids and ``traceparent``, and the warnings logged once per change of state.

End to end on a real chain (edge -> proxy -> worker -> replica) with real
clients (httpx over h2, curl over HTTP/1.1); a writer that fails for real
(a pipe whose reader closed: EPIPE; ``/dev/full``: ENOSPC). Rules: loopback
only, port 0, every test bounded by ``trio.fail_after``; a test waits for
the state it asserts.
"""

from __future__ import annotations

import fcntl
import functools
import io
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import HOST, closed_port, curl, route_apps, wait_for

from blocks import (
    Chain,
    EmbeddedStore,
    Feature,
    HTTPServer,
    ListenerConfig,
    LocalReplica,
    Request,
    Response,
    serve_chain,
    serve_http,
)
from blocks.command import Operations
from blocks.hops import Exchange, Hop
from blocks.http import IterBody, json_response
from blocks.observe import (
    AccessLog,
    RequestIds,
    configure_logging,
    new_request_id,
    new_traceparent,
    open_access_log,
    valid_request_id,
    valid_traceparent,
)
from blocks.routing import OutlierConfig, OutlierDetector, Replica
from blocks.scheduler import QueueFull, SchedulerConfig, TenantPolicy, open_scheduler

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def h2_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(http2=True, http1=False, trust_env=False)


async def echo_headers(request: Request) -> Response:
    """A replica that answers with the fields it received, as JSON; ``/bytes/N``: N bytes streamed
    in chunks of up to 7000, with no length declared."""
    await request.body.read_all()
    if request.path.startswith(b"/bytes/"):
        size = int(request.path.removeprefix(b"/bytes/"))

        async def chunks() -> AsyncIterator[bytes]:
            for at in range(0, size, 7000):
                yield b"x" * min(7000, size - at)

        return Response(200, [], IterBody(chunks()))
    seen = {name.decode(): value.decode("latin-1") for name, value in request.headers}
    return json_response(200, json.dumps(seen).encode())


async def serve_echo(*, host: str, task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED) -> None:
    await serve_http(echo_headers, host=host, config=ListenerConfig(), task_status=task_status)


@asynccontextmanager
async def logged_chain(
    target: str | os.PathLike[str] | IO[bytes],
    features: Sequence[Feature] | None = None,
    **options: Any,
) -> AsyncIterator[tuple[Chain, AccessLog]]:
    """edge (``RequestIds``, the access log) -> proxy -> worker -> ``replica-0`` (echoes its fields)
    for app ``demo`` at every domain, and app ``gone`` at ``gone.test`` on a dead replica."""
    async with open_access_log(target, interval=0.01, **options) as access_log:

        async def build(chain: Chain) -> None:
            local = {
                "replica-0": await chain.start_replica("replica-0", serve_echo),
                "dead-0": LocalReplica((HOST, closed_port())),
            }
            await chain.start_worker(local, app=None)
            route_apps(
                chain, local, "demo", {"*": "demo", "gone.test": "gone"}, {"demo": ["replica-0"], "gone": ["dead-0"]}
            )
            await chain.start_proxy()
            await chain.start_edge(features=[RequestIds(), access_log] if features is None else features)

        async with trio.open_nursery() as nursery:
            chain: Chain = await nursery.start(serve_chain, build)
            try:
                yield chain, access_log
            finally:
                chain.cancel()


FIELDS = [
    "time",
    "hop",
    "request_id",
    "traceparent",
    "client",
    "method",
    "authority",
    "path",
    "http_version",
    "status",
    "reason",
    "bytes_in",
    "bytes_out",
    "tenant",
    "app",
    "replica",
    "duration_ms",
    "phases",
]


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- one line per request -----------------------------------------------------------------------


async def test_one_line_per_request_with_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    with trio.fail_after(20):
        async with logged_chain(path) as (chain, access_log):
            async with h2_client() as client:
                ok = await client.get(chain.url + "/hello", headers={"x-tenant": "alice"})
                failed = await client.get(chain.url + "/x", headers={"host": "gone.test", "x-tenant": "bob"})
                posted = await client.post(chain.url + "/upload", content=b"12345", headers={"x-tenant": "alice"})
            await wait_for(lambda: access_log.statistics().written == 3, "three lines")
        lines = read_lines(path)
    assert ok.status_code == 200 and posted.status_code == 200
    assert "x-proxyblocks-routed" not in ok.headers  # the proxy's report stops at the edge
    # The replica saw the ids the client got back.
    seen = ok.json()
    assert seen["x-request-id"] == ok.headers["x-request-id"]
    assert seen["traceparent"] == ok.headers["traceparent"]
    assert valid_traceparent(ok.headers["traceparent"].encode())
    assert "x-proxyblocks-report" not in seen
    # One line per request, in order, with what the client saw.
    by_path = {line["path"]: line for line in lines}
    assert sorted(by_path) == ["/hello", "/upload", "/x"]
    first, second, third = by_path["/hello"], by_path["/x"], by_path["/upload"]
    assert first["request_id"] == ok.headers["x-request-id"]
    assert first["traceparent"] == ok.headers["traceparent"]
    assert list(first) == FIELDS
    expected = {
        "hop": "edge",
        "method": "GET",
        "path": "/hello",
        "http_version": "2",
        "status": 200,
        "reason": None,
        "bytes_in": 0,
        "bytes_out": len(ok.content),
        "tenant": "alice",
        "app": "demo",
        "replica": "replica-0",
    }
    assert {key: first[key] for key in expected} == expected
    assert first["time"].endswith("Z") and first["client"].startswith("127.0.0.1")
    assert first["authority"] == f"127.0.0.1:{chain.port}"
    assert {"app", "worker", "proxy", "proxy-route", "edge", "total"} <= set(first["phases"])
    assert first["phases"]["total"] >= first["phases"]["edge"]
    # An error: its status, its reason, where it was going.
    assert failed.status_code == 502
    assert (second["status"], second["reason"]) == (502, "replica_unreachable")
    assert (second["app"], second["replica"], second["tenant"]) == ("gone", "dead-0", "bob")
    assert second["request_id"] == failed.headers["x-request-id"]
    assert (third["method"], third["bytes_in"], third["status"]) == ("POST", 5, 200)


# Each case: (HTTP version, request body bytes, response body bytes, whether the request declares its length).
_TRANSFERS = st.lists(
    st.tuples(st.sampled_from(["1.1", "2"]), st.integers(0, 150_000), st.integers(0, 150_000), st.booleans()),
    min_size=1,
    max_size=5,
)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases=_TRANSFERS)
def test_bytes_in_and_out_are_the_body_bytes_that_crossed_the_edge(
    tmp_path_factory: pytest.TempPathFactory, cases: list[tuple[str, int, int, bool]]
) -> None:
    """Invariant: a line's ``bytes_in`` and ``bytes_out`` are the body bytes the client sent and got,
    streamed or declared, over h1 or h2, on the first request of a connection (the handler path: the
    edge's connection to the proxy is still opening) and the next ones (spliced)."""
    path = tmp_path_factory.mktemp("log") / "access.log"

    async def upload(size: int) -> AsyncIterator[bytes]:
        for at in range(0, size, 5000):
            yield b"u" * min(5000, size - at)

    async def run() -> list[tuple[int, int]]:
        got = []
        with trio.fail_after(30):
            async with logged_chain(path) as (chain, access_log):
                clients = {
                    "2": h2_client(),
                    "1.1": httpx.AsyncClient(http2=False, trust_env=False),
                }
                for version, sent, size, declared in cases:
                    content = b"u" * sent if declared else upload(sent)
                    response = await clients[version].post(f"{chain.url}/bytes/{size}", content=content)
                    assert response.status_code == 200 and response.http_version == f"HTTP/{version}"
                    got.append((sent, len(response.content)))
                for client in clients.values():
                    await client.aclose()
                await wait_for(lambda: access_log.statistics().written == len(cases), lambda: repr(access_log))
        return got

    got = trio.run(run)
    logged = [(line["bytes_in"], line["bytes_out"]) for line in read_lines(path)]
    assert [size for _, _, size, _ in cases] == [out for _, out in got]
    assert sorted(logged) == sorted(got)


async def test_a_chain_logs_at_the_hops_its_operations_name(tmp_path: Path) -> None:
    """One access log, one line per request at each hop named, each with what that hop knew."""
    path = tmp_path / "access.log"
    operations = Operations(access_log=str(path), access_log_hops=frozenset({"edge", "proxy", "worker"}))

    async def build(chain: Chain) -> None:
        local = {"replica-0": await chain.start_replica("replica-0", serve_echo)}
        await chain.start_worker(local)
        await chain.start_proxy()
        await chain.start_edge()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            chain: Chain = await nursery.start(functools.partial(serve_chain, build, operations=operations))
            async with h2_client() as client:
                response = await client.post(chain.url + "/bytes/3000", content=b"abc", headers={"x-tenant": "eve"})
            await wait_for(lambda: path.exists() and len(path.read_text().splitlines()) == 3, "three lines")
            chain.cancel()
    by_hop = {line["hop"]: line for line in read_lines(path)}
    assert sorted(by_hop) == ["edge", "proxy", "worker"]
    rid = response.headers["x-request-id"]
    assert {line["request_id"] for line in by_hop.values()} == {rid}
    assert [(by_hop[hop]["bytes_in"], by_hop[hop]["bytes_out"]) for hop in by_hop] == [(3, 3000)] * 3
    assert (by_hop["edge"]["app"], by_hop["edge"]["replica"], by_hop["edge"]["tenant"]) == ("demo", "replica-0", "eve")
    assert (by_hop["proxy"]["app"], by_hop["proxy"]["replica"], by_hop["proxy"]["tenant"]) == (
        "demo",
        "replica-0",
        "eve",
    )
    assert (by_hop["worker"]["replica"], by_hop["worker"]["status"]) == ("replica-0", 200)
    assert "proxy" in by_hop["proxy"]["phases"] and "worker" in by_hop["worker"]["phases"]


async def test_ids_a_client_sent_are_kept_and_bad_ones_replaced(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    with trio.fail_after(20):
        async with logged_chain(path) as (chain, access_log):
            # HTTP/1.1 through curl, with ids of its own: kept, end to end.
            kept = json.loads(
                await curl("-H", "x-request-id: my-id-1", "-H", f"traceparent: {TRACEPARENT}", chain.url + "/")
            )
            headers = await curl("-D", "-", "-o", "/dev/null", "-H", "x-request-id: has space", chain.url + "/")
            await wait_for(lambda: access_log.statistics().written == 2, "two lines")
        lines = read_lines(path)
    assert (kept["x-request-id"], kept["traceparent"]) == ("my-id-1", TRACEPARENT)
    fields = dict(line.split(": ", 1) for line in headers.splitlines()[1:] if ": " in line)
    assert valid_request_id(fields["x-request-id"].encode()) and fields["x-request-id"] != "has space"
    by_id = {line["request_id"]: line for line in lines}
    assert sorted(by_id) == sorted(["my-id-1", fields["x-request-id"]])
    assert (by_id["my-id-1"]["traceparent"], by_id["my-id-1"]["http_version"]) == (TRACEPARENT, "1.1")
    # A trace the edge starts takes the request id as its trace-id.
    assert fields["traceparent"].split("-")[1] == fields["x-request-id"]


@given(rid=st.binary(max_size=300), tp=st.binary(max_size=80), fresh_tp=st.booleans())
def test_an_id_in_is_kept_when_valid_and_fresh_otherwise(rid: bytes, tp: bytes, fresh_tp: bool) -> None:
    """Any field value in: out comes the same value when it is valid, else a fresh valid one."""
    if fresh_tp:
        tp = new_traceparent()
    request = Request(b"GET", b"http", b"a.test", b"/", [(b"x-request-id", rid), (b"traceparent", tp)])
    exchange = Exchange(Hop("edge", None, []), request)  # type: ignore[arg-type]
    RequestIds().screen(exchange)
    out_rid = request.header(b"x-request-id")
    out_tp = request.header(b"traceparent")
    assert out_rid is not None and out_tp is not None
    assert [name for name, _ in request.headers].count(b"x-request-id") == 1
    assert valid_request_id(out_rid) and valid_traceparent(out_tp)
    assert (out_rid == rid) == valid_request_id(rid)
    assert (out_tp == tp) == valid_traceparent(tp)
    assert valid_traceparent(tp) or not fresh_tp
    response: list[tuple[bytes, bytes]] = [(b"x-request-id", b"upstream's"), (b"content-length", b"0")]
    RequestIds().response(exchange, 200, response)
    assert response == [(b"content-length", b"0"), (b"x-request-id", out_rid), (b"traceparent", out_tp)]


def test_fresh_ids_are_unique_and_valid() -> None:
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(valid_request_id(i) and len(i) == 32 for i in ids)
    assert not valid_traceparent(b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01")
    assert not valid_traceparent(b"00-0af7651916cd43dd8448eb211c80319c-" + b"0" * 16 + b"-01")
    assert not valid_traceparent(TRACEPARENT.upper().encode())
    assert not valid_traceparent(b"01" + TRACEPARENT[2:].encode())


# -- a log that cannot keep up or cannot write never fails a request --------------------------------


async def test_a_closed_pipe_drops_and_counts_lines_and_every_request_succeeds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reader, writer = os.pipe()
    os.close(reader)
    with open(writer, "wb", buffering=0) as pipe, trio.fail_after(20):
        async with logged_chain(pipe) as (chain, access_log):
            async with h2_client() as client:
                for _ in range(20):
                    assert (await client.get(chain.url + "/")).status_code == 200
            await wait_for(lambda: access_log.statistics().dropped == 20, lambda: repr(access_log))
            stats = access_log.statistics()
    assert (stats.written, stats.failing) == (0, True)
    failures = [r for r in caplog.records if "access log: writing failed" in r.getMessage()]
    assert len(failures) == 1 and "Broken pipe" in failures[0].getMessage()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
async def test_a_full_disk_drops_and_counts_lines() -> None:
    with trio.fail_after(20):
        async with logged_chain("/dev/full") as (chain, access_log):
            async with h2_client() as client:
                for _ in range(5):
                    assert (await client.get(chain.url + "/")).status_code == 200
            await wait_for(lambda: access_log.statistics().dropped == 5, lambda: repr(access_log))


async def test_a_full_buffer_drops_the_lines_past_it_and_writes_the_rest_at_the_end() -> None:
    buffer = io.BytesIO()
    with trio.fail_after(20):
        async with open_access_log(buffer, capacity=3, interval=3600) as access_log:

            async def build(chain: Chain) -> None:
                local = {"replica-0": await chain.start_replica("replica-0", serve_echo)}
                await chain.start_worker(local)
                await chain.start_proxy()
                await chain.start_edge(features=[access_log])

            async with trio.open_nursery() as nursery:
                chain: Chain = await nursery.start(serve_chain, build)
                async with h2_client() as client:
                    for _ in range(10):
                        assert (await client.get(chain.url + "/")).status_code == 200
                await wait_for(lambda: access_log.statistics().dropped == 7, lambda: repr(access_log))
                assert access_log.statistics().buffered == 3
                chain.cancel()
    # Leaving the block wrote what was buffered.
    assert len(buffer.getvalue().splitlines()) == 3
    assert access_log.statistics().written == 3


async def test_writers_sharing_a_pipe_never_tear_each_others_lines() -> None:
    """Two access logs (as two processes of ``--processes 2 --access-log -`` are) write big batches
    to one pipe at once, each from its thread, many times what the pipe holds (read from once both
    write): every line arrives whole. (One write of a whole batch stops wherever the pipe fills, and
    the other writer's bytes get in there.)"""
    long_path = "/" + "p" * 1500  # (a line of about 1.9 KB: two to a run)
    with trio.fail_after(60):
        async with open_access_log(io.BytesIO(), interval=3600) as access_log:

            async def build(chain: Chain) -> None:
                local = {"replica-0": await chain.start_replica("replica-0", serve_echo)}
                await chain.start_worker(local)
                await chain.start_proxy()
                await chain.start_edge(features=[access_log])

            async with trio.open_nursery() as nursery:
                chain: Chain = await nursery.start(serve_chain, build)
                async with h2_client() as client:
                    assert (await client.get(chain.url + long_path)).status_code == 200
                await wait_for(lambda: access_log.statistics().buffered == 1, lambda: repr(access_log))
                records = access_log._take() * 400  # (the same real record: a batch of about 760 KB)
                chain.cancel()
        reader, writer = os.pipe()
        fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)  # (the least it holds: a big write stops and goes on often)
        ends = [_Pipe(os.dup(writer), "wb") for _ in range(2)]
        os.close(writer)
        received = bytearray()

        def read_all() -> None:
            while chunk := os.read(reader, 65536):
                received.extend(chunk)

        async def write(end: _Pipe) -> None:
            with end:  # (the last one closed, the reader sees the end)
                await trio.to_thread.run_sync(AccessLog()._write, end, records, abandon_on_cancel=True)

        try:
            async with trio.open_nursery() as nursery:
                for end in ends:
                    nursery.start_soon(write, end)
                await wait_for(lambda: all(end.writing for end in ends), lambda: "the writers are formatting")
                nursery.start_soon(functools.partial(trio.to_thread.run_sync, read_all, abandon_on_cancel=True))
        finally:
            os.close(reader)
    lines = received.decode().splitlines()
    assert len(lines) == 800
    assert all(json.loads(line)["path"] == long_path for line in lines)


class _Pipe(io.FileIO):
    """A pipe's end, which says when a writer first wrote to it (its lines formatted)."""

    writing = False

    def write(self, data: Any, /) -> int:
        self.writing = True
        return super().write(data)


# -- warnings, once per change of state ------------------------------------------------------------


def messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger and r.levelno >= logging.WARNING]


def test_an_ejection_and_a_return_are_one_warning_each(caplog: pytest.LogCaptureFixture) -> None:
    detector = OutlierDetector(OutlierConfig(base_ejection=1.0, slow_start_window=0.0))
    replica = Replica(name="r1", worker=("127.0.0.1", 1), address=("127.0.0.1", 2))
    others = [Replica(name=f"r{i}", worker=("127.0.0.1", 1), address=("127.0.0.1", 2)) for i in range(2, 5)]
    assert detector.record(replica, False, 0.0, unreachable=True)
    for t in (0.1, 0.2, 0.3):  # in flight when it was ejected: ignored, and quiet
        detector.record(replica, False, t)
        detector.selectable([replica, *others], t)
    assert messages(caplog, "blocks.routing") == ["replica 'r1' unreachable: ejected for 1.0s"]
    for t in (1.5, 1.6):
        assert replica in detector.selectable([replica, *others], t)
        detector.record(replica, True, t)
    assert messages(caplog, "blocks.routing")[1:] == ["replica 'r1' back in selection"]


async def test_a_broken_route_file_is_one_warning_and_its_fix_another(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "routes.toml"
    good = '[domains]\n"a.test" = "demo"\n\n[apps.demo.replicas.r1]\nworker = "127.0.0.1:9"\naddress = "127.0.0.1:8"\n'
    path.write_text(good)
    store = EmbeddedStore()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(functools.partial(store.watch_file, path, interval=0.01))
            path.write_text("[domains\n")
            await wait_for(lambda: store.statistics().file_error is not None, "the file's error")
            path.unlink()
            await wait_for(lambda: "No such file" in str(store.statistics().file_error), "the missing file")
            loads = store.statistics().file_loads
            path.write_text(good.replace("r1", "r2"))
            await wait_for(lambda: store.statistics().file_loads > loads, "the fixed file loaded")
            nursery.cancel_scope.cancel()
    warnings = messages(caplog, "blocks.sources")
    assert len(warnings) == 3, warnings
    assert "routes.toml" in warnings[0] and "No such file" in warnings[1]
    assert warnings[2] == f"route file {path} loads again"


async def test_a_refused_tenant_is_one_warning_and_its_return_another(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    config = SchedulerConfig(budget=1, default_policy=TenantPolicy(max_queued=0))
    async with open_scheduler(config) as scheduler:
        held = await scheduler.acquire("alice")
        for _ in range(3):
            with pytest.raises(QueueFull):
                await scheduler.acquire("bob")
        scheduler.release(held)
        assert messages(caplog, "blocks.scheduler") == [
            "scheduler: refusing tenant 'bob' (tenant 'bob' already has 0 requests waiting for an upstream slot)"
        ]
        scheduler.release(await scheduler.acquire("bob"))  # too soon after the refusals: still quiet
        assert len(messages(caplog, "blocks.scheduler")) == 1
        await trio.sleep(10)
        grant = scheduler.try_acquire("bob")
        assert grant is not None
        scheduler.release(grant)
        scheduler.release(await scheduler.acquire("bob"))
    assert messages(caplog, "blocks.scheduler")[1:] == ["scheduler: admitting tenant 'bob' again"]


# -- logging setup ---------------------------------------------------------------------------------


async def test_configure_logging_and_one_line_per_listener() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        configure_logging("INFO", stream=stream)
        configure_logging("info", stream=stream)  # again: one handler, not two
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                server: HTTPServer = await nursery.start(functools.partial(serve_http, echo_headers))
                nursery.cancel_scope.cancel()
        logging.getLogger("blocks.test").debug("not at info")
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(f" INFO blocks.listener: server listening on http://127.0.0.1:{server.port}")
    with pytest.raises(ValueError, match="log level 'loud': expected one of debug, info, warning, error"):
        configure_logging("loud")
