"""Replicas over TLS: ``https://host:port`` replica URLs, the worker a verifying TLS client.

The replicas are real TLS servers with certificates from a trustme CA for
``localhost``: the project's own listener (ALPN ``h2`` and ``http/1.1``), and
Python's ``http.server`` wrapped in ``ssl`` in a child process (ALPN
``http/1.1`` only). Each answers with the protocol it heard, so the
negotiated protocol is asserted where it was negotiated. The replica URL
names ``localhost``, which the certificate must name and the SNI carry.

Loopback only, port 0, every wait bounded.
"""

from __future__ import annotations

import functools
import logging
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio
import trustme
from support import HOST, start_recipe

from blocks import (
    Chain,
    HTTPServer,
    LocalReplica,
    Request,
    Response,
    UpstreamConfig,
    UpstreamConnectError,
    open_chain,
    open_upstreams,
    route_records,
    serve_http,
    text_response,
)
from blocks.http import IterBody
from blocks.testing import run_child_process
from blocks.topology import App, replica_from_url
from blocks.transport.tls import client_context

CHUNKS = 64
CHUNK = b"x" * 1000 + b"\n"  # (what H1_ONLY_SERVER sends too)

# Python's http.server behind ssl, ALPN http/1.1 only: a TLS replica that never speaks h2.
H1_ONLY_SERVER = """
import http.server, ssl, sys

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for _ in range(int(sys.argv[2])):
                data = b"x" * 1000 + b"\\n"
                self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
            self.wfile.write(b"0\\r\\n\\r\\n")
            return
        alpn = self.connection.selected_alpn_protocol()
        body = f"h1-only over {self.request_version}, alpn {alpn}, sni {self.server.sni}\\n".encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

def remember_sni(sock, name, context):
    server.sni = name

context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(sys.argv[1])
context.set_alpn_protocols(["http/1.1"])
context.sni_callback = remember_sni
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.sni = None
server.socket = context.wrap_socket(server.socket, server_side=True)
print("listening", server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_file(ca: trustme.CA, tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


def server_context_for(ca: trustme.CA, name: str = "localhost") -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    return context


async def h2_replica(
    nursery: trio.Nursery,
    ca: trustme.CA,
    name: str = "localhost",
    release: trio.Event | None = None,
    context: ssl.SSLContext | None = None,
) -> HTTPServer:
    """The project's listener over TLS (ALPN h2 and http/1.1), saying which HTTP version it heard.

    ``/stream`` sends :data:`CHUNKS` chunks, the last one only once ``release`` is set.
    """

    async def handler(request: Request) -> Response:
        if request.path == b"/stream":

            async def chunks() -> AsyncIterator[bytes]:
                for i in range(CHUNKS):
                    if i == CHUNKS - 1 and release is not None:
                        await release.wait()
                    yield CHUNK

            return Response(200, [(b"x-heard", request.http_version.encode())], IterBody(chunks()))
        return text_response(200, f"h2-capable over HTTP/{request.http_version}\n")

    context = context or server_context_for(ca, name)
    server: HTTPServer = await nursery.start(functools.partial(serve_http, handler, host=HOST, ssl_context=context))
    return server


@asynccontextmanager
async def h1_only_replica(ca: trustme.CA, tmp_path: Path) -> AsyncIterator[int]:
    """:data:`H1_ONLY_SERVER` in a child process: its port."""
    pem = tmp_path / "h1-only.pem"
    ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(str(pem))
    async with trio.open_nursery() as nursery:
        command = [sys.executable, "-u", "-c", H1_ONLY_SERVER, str(pem), str(CHUNKS)]
        _, line = await nursery.start(run_child_process, command, "listening", "h1-only")
        yield int(line.split()[1])
        nursery.cancel_scope.cancel()  # run_child_process stops the child it started


async def start_trusting(chain: Chain, replicas: dict[str, LocalReplica], ca_file: Path) -> None:
    """A worker trusting ``ca_file`` in front of ``replicas``, each its own app at ``NAME.test``; a proxy, an edge."""
    await chain.start_worker(replicas, app=None, upstream=UpstreamConfig(ca_file=ca_file))
    apps = {name: App((f"{name}.test",), {name: replica}) for name, replica in replicas.items()}
    chain.route(apps, worker=(HOST, chain.worker_server.port))
    await chain.start_proxy()
    await chain.start_edge()


async def get(url: str, host: str | None = None) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        return await client.get(url, headers={"host": host} if host else None)


# -- replica URLs -----------------------------------------------------------------------------


def test_an_https_replica_url_keeps_its_host_name() -> None:
    assert replica_from_url("https://localhost:8443") == LocalReplica(("localhost", 8443), "https")
    assert replica_from_url("HTTPS://[::1]:8443/") == LocalReplica(("::1", 8443), "https")
    with pytest.raises(ValueError, match="https://host:port"):
        replica_from_url("ftp://localhost:21")
    with pytest.raises(ValueError, match="a host and a port"):
        replica_from_url("https://localhost")


def test_a_ca_file_that_does_not_load_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty.pem").write_text("")
    for path in (tmp_path / "missing.pem", tmp_path / "empty.pem"):
        with pytest.raises(OSError, match=f"cannot load the CA file {path}: ") as info:
            client_context(path)
        assert "\n" not in str(info.value)


# -- the multiplexer --------------------------------------------------------------------------


async def test_the_pool_speaks_what_alpn_settled_on_and_splices_h2(
    nursery: trio.Nursery, ca: trustme.CA, ca_file: Path, tmp_path: Path
) -> None:
    with trio.fail_after(20):
        h2 = await h2_replica(nursery, ca)
        async with h1_only_replica(ca, tmp_path) as h1_port, open_upstreams(UpstreamConfig(ca_file=ca_file)) as ups:

            async def fetch(port: int) -> bytes:
                request = Request(b"GET", b"https", b"localhost", b"/")
                response = await ups.request(("localhost", port), request, [], protocol="https")
                assert response.status == 200
                return await response.body.read_all()

            async with trio.open_nursery() as batch:  # both wait for the first handshake
                for _ in range(3):
                    batch.start_soon(fetch, h2.port)
            assert await fetch(h2.port) == b"h2-capable over HTTP/2\n"
            assert await fetch(h1_port) == b"h1-only over HTTP/1.1, alpn http/1.1, sni localhost\n"
            stats = {s.address[1]: s for s in ups.statistics()}
            assert (stats[h2.port].protocol, stats[h2.port].connections, len(stats[h2.port].h2)) == ("https", 1, 1)
            assert (stats[h1_port].protocol, stats[h1_port].connections, stats[h1_port].h2) == ("https", 1, ())


@pytest.mark.parametrize(
    ("issuer", "name", "why"),
    [
        ("another CA", "localhost", "certificate verify failed: unable to get local issuer certificate"),
        ("the CA", "other.example", "certificate verify failed: Hostname mismatch"),
    ],
)
async def test_a_certificate_that_does_not_verify_is_a_502_that_says_why(
    nursery: trio.Nursery, ca: trustme.CA, ca_file: Path, issuer: str, name: str, why: str
) -> None:
    with trio.fail_after(20):
        bad = await h2_replica(nursery, trustme.CA() if issuer == "another CA" else ca, name)
        async with open_upstreams(UpstreamConfig(ca_file=ca_file)) as ups:
            request = Request(b"GET", b"https", b"localhost", b"/")
            with pytest.raises(UpstreamConnectError) as info:
                await ups.request(("localhost", bad.port), request, [], protocol="https")
            message = str(info.value)
            assert message.startswith(f"cannot connect to localhost:{bad.port}: TLS handshake failed: {why}")
            assert "\n" not in message and info.value.status == 502


async def test_a_cleartext_server_named_https_is_a_502_that_says_so(nursery: trio.Nursery, ca_file: Path) -> None:
    async def hello(request: Request) -> Response:
        return text_response(200, "cleartext\n")

    with trio.fail_after(20):
        server: HTTPServer = await nursery.start(functools.partial(serve_http, hello, host=HOST))
        async with open_upstreams(UpstreamConfig(ca_file=ca_file)) as ups:
            request = Request(b"GET", b"https", b"localhost", b"/")
            with pytest.raises(UpstreamConnectError, match="TLS handshake failed: wrong version number"):
                await ups.request(("localhost", server.port), request, [], protocol="https")


async def test_a_later_connection_that_settles_on_another_protocol_is_refused(
    nursery: trio.Nursery, ca: trustme.CA, ca_file: Path
) -> None:
    with trio.fail_after(20):
        release = trio.Event()
        context = server_context_for(ca)
        replica = await h2_replica(nursery, ca, release=release, context=context)
        config = UpstreamConfig(ca_file=ca_file, max_streams_per_connection=1)
        async with open_upstreams(config) as ups:
            address = ("localhost", replica.port)
            first = await ups.request(
                address, Request(b"GET", b"https", b"localhost", b"/stream"), [], protocol="https"
            )
            context.set_alpn_protocols(["http/1.1"])  # the replica, replaced by one that speaks only HTTP/1.1
            with pytest.raises(UpstreamConnectError, match=r"ALPN settled on http/1\.1, where this pool speaks h2"):
                await ups.request(address, Request(b"GET", b"https", b"localhost", b"/"), [], protocol="https")
            release.set()
            assert await first.body.read_all() == CHUNK * CHUNKS  # the connection it had is untouched


# -- through the chain -----------------------------------------------------------------------


async def test_https_replicas_behind_the_chain(
    nursery: trio.Nursery, ca: trustme.CA, ca_file: Path, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        h2 = await h2_replica(nursery, ca)
        async with h1_only_replica(ca, tmp_path) as h1_port, open_chain(host=HOST) as chain:
            replicas = {
                "h2-capable": replica_from_url(f"https://localhost:{h2.port}"),
                "h1-only": replica_from_url(f"https://localhost:{h1_port}"),
            }
            await start_trusting(chain, replicas, ca_file)

            for _ in range(2):  # the second h2 one takes the fast path: a pooled connection is there
                response = await get(chain.url + "/", "h2-capable.test")
                assert (response.status_code, response.text) == (200, "h2-capable over HTTP/2\n")
            response = await get(chain.url + "/", "h1-only.test")
            assert response.status_code == 200
            assert response.text == "h1-only over HTTP/1.1, alpn http/1.1, sni localhost\n"
            for host in ("h2-capable.test", "h1-only.test"):
                response = await get(chain.url + "/stream", host)
                assert (response.status_code, response.content) == (200, CHUNK * CHUNKS)
            assert chain.worker.statistics().served == {"h2-capable": 3, "h1-only": 2}
            await chain.shutdown(5)


async def test_a_route_entry_naming_an_https_replica_reaches_it_through_a_worker_that_never_heard_of_it(
    nursery: trio.Nursery, ca: trustme.CA, ca_file: Path
) -> None:
    with trio.fail_after(30):
        h2 = await h2_replica(nursery, ca)
        async with open_chain(host=HOST) as chain:
            await chain.start_worker({}, app=None, upstream=UpstreamConfig(ca_file=ca_file))
            yours = {"yours": LocalReplica(("localhost", h2.port), "https")}
            chain.store.transact(route_records("yours", yours, worker=(HOST, chain.worker_server.port), domains=["*"]))
            await chain.start_proxy()
            await chain.start_edge()
            response = await get(chain.url + "/")
            assert (response.status_code, response.text) == (200, "h2-capable over HTTP/2\n")
            assert chain.worker.statistics().served == {"yours": 1}
            await chain.shutdown(5)


async def test_a_replica_that_fails_verification_is_a_502_and_spares_a_concurrent_good_request(
    nursery: trio.Nursery, ca: trustme.CA, ca_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="blocks")
    with trio.fail_after(30):
        release = trio.Event()
        good = await h2_replica(nursery, ca, release=release)
        bad = await h2_replica(nursery, trustme.CA())  # for localhost, by a CA the worker does not trust
        async with open_chain(host=HOST) as chain:
            replicas = {
                "good": replica_from_url(f"https://localhost:{good.port}"),
                "bad": replica_from_url(f"https://localhost:{bad.port}"),
            }
            await start_trusting(chain, replicas, ca_file)
            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
                request = client.build_request("GET", chain.url + "/stream", headers={"host": "good.test"})
                streaming = await client.send(request, stream=True)
                assert streaming.status_code == 200
                chunks = streaming.aiter_raw()
                received = await chunks.__anext__()  # the good exchange is under way

                for _ in range(2):
                    response = await client.get(chain.url + "/", headers={"host": "bad.test"})
                    assert response.status_code == 502

                release.set()
                async for chunk in chunks:
                    received += chunk
                assert received == CHUNK * CHUNKS
                await streaming.aclose()
            reasons = [r.getMessage() for r in caplog.records if "certificate verify failed" in r.getMessage()]
            assert reasons, [r.getMessage() for r in caplog.records]
            assert (
                f"cannot connect to localhost:{bad.port}: TLS handshake failed: certificate verify failed"
                in (reasons[0])
            )
            assert not [r for r in caplog.records if r.exc_info is not None]
            await chain.shutdown(5)


async def test_the_chain_recipe_trusts_what_replica_ca_names(
    nursery: trio.Nursery, ca: trustme.CA, ca_file: Path
) -> None:
    replica = await h2_replica(nursery, ca)
    url = f"https://localhost:{replica.port}"
    with trio.fail_after(60):
        for args, status in (["--replica-ca", str(ca_file)], 200), ([], 502):  # without it: the system's CAs
            async with trio.open_nursery() as inner:
                process, lines = await start_recipe(inner, "--replica", url, *args)
                edge = (await lines.until(r"^edge listening on (\S+)$")).group(1)
                response = await get(f"{edge}/")
                assert response.status_code == status, response.text
                if status == 200:
                    assert response.text == "h2-capable over HTTP/2\n"
                process.send_signal(signal.SIGINT)
                assert await process.wait() == 0
