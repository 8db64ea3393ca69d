"""Every limit a listener advertises or documents (docs/limits.md, HTTP/2 and Both), on the wire.

For each: the SETTINGS value the client reads is the one enforced; just under
it is served, just over it is refused exactly as documented (a status or an
RST_STREAM of that stream while the connection's other streams go on, or a
GOAWAY with its code and then the close). Header blocks are built byte for
byte here (HPACK literals that never touch the dynamic table, unless a test
says so), so that sizes are exact: encoded, as the bytes that arrive, and
decoded, as RFC 9113 6.5.2 counts them (name + value + 32 per field,
pseudo-headers included).

Covered in tests/test_h2_abuse.py at their configured values, and not
repeated here: ``stall_timeout``, ``request_body_timeout``,
``h2_idle_timeout``, a streamed body past ``max_request_body``.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``,
waits for the state it asserts.
"""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

import h2.errors
import hyperframe.frame as hf
import pytest
import trio

from blocks import (
    HTTPServer,
    ListenerConfig,
    Request,
    Response,
    serve_http,
    server_context,
    text_response,
)
from blocks.testing import make_self_signed
from tests.support import H2_PREFACE, HOST, RawFrames, wait_for

E = h2.errors.ErrorCodes

# -- the server and the client's reading ---------------------------------------------------------------


class Gate:
    """The handler: ``/hold`` waits (its body unread) until ``release``; ``/read`` reads its body and
    answers its length; anything else (an extended CONNECT too) is 200."""

    def __init__(self) -> None:
        self.held = 0
        self.release = trio.Event()

    async def __call__(self, request: Request) -> Response:
        if request.path == b"/hold":
            self.held += 1
            await self.release.wait()
        if request.path == b"/read":
            return text_response(200, f"{len(await request.body.read_all())}\n")
        return text_response(200, "ok\n")


class Client(RawFrames):
    """A raw client that remembers each stream's first answer (a head or a reset), so that answers
    can be awaited in any order."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        super().__init__(stream)  # type: ignore[arg-type]
        self.answers: dict[int, hf.Frame] = {}

    async def next_frame(self) -> hf.Frame | None:
        frame = await super().next_frame()
        if isinstance(frame, hf.HeadersFrame | hf.RstStreamFrame):
            self.answers.setdefault(frame.stream_id, frame)
        return frame


async def listen(nursery: trio.Nursery, **config: object) -> tuple[HTTPServer, Gate]:
    gate = Gate()
    server: HTTPServer = await nursery.start(
        functools.partial(serve_http, gate, config=ListenerConfig(**config))  # type: ignore[arg-type]
    )
    return server, gate


async def closed_with(raw: Client, code: int, last_stream_id: int | None = None) -> None:
    """A connection error: GOAWAY(``code``), and then the connection closes."""
    goaway = await raw.goaway()
    assert goaway is not None, f"closed without a GOAWAY({E(code).name})"
    assert goaway.error_code == code, f"GOAWAY({E(goaway.error_code).name}), expected {E(code).name}"
    if last_stream_id is not None:
        assert goaway.last_stream_id == last_stream_id
    while (frame := await raw.next_frame()) is not None:
        assert not isinstance(frame, hf.HeadersFrame | hf.DataFrame), f"{frame!r} after the GOAWAY"


# -- Both: the preface, TLS, closing ------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", id="corrupted-magic"),
        pytest.param(b"PRI * HTTP/2.0\r\nhost: example.test\r\n\r\n", id="request-line-then-a-head"),
        pytest.param(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\rX", id="last-byte-wrong"),
        pytest.param(b"PRI * HTTP/1.1\r\n\r\n", id="pri-over-http-1.1"),
        pytest.param(b"PRI *x", id="pri-star-then-garbage"),
    ],
)
async def test_a_broken_preface_is_goaway_protocol_error(nursery: trio.Nursery, data: bytes) -> None:
    """Bytes that begin like the preface (``PRI *``) and leave it: an HTTP/2 connection error
    (RFC 9113 3.4), GOAWAY(PROTOCOL_ERROR) after the server's SETTINGS, then the close; never an
    HTTP/1.1 answer."""
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            raw = Client(stream)
            await raw.send(data)
            await closed_with(raw, E.PROTOCOL_ERROR, last_stream_id=0)


@pytest.mark.parametrize(
    ("data", "first_line"),
    [
        (b"GET / HTTP/1.1\r\nhost: example.test\r\n\r\n", b"HTTP/1.1 200 OK"),
        (b"PRI / HTTP/1.1\r\nhost: example.test\r\n\r\n", b"HTTP/1.1 200 OK"),
        (b"POST / HTTP/1.1\r\nhost: example.test\r\ncontent-length: 0\r\n\r\n", b"HTTP/1.1 200 OK"),
    ],
)
async def test_http_1_1_that_only_shares_a_prefix_with_the_preface_stays_http_1_1(
    nursery: trio.Nursery, data: bytes, first_line: bytes
) -> None:
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            await stream.send_all(data)
            received = b""
            while b"\r\n" not in received:
                received += await stream.receive_some(65536)
            assert received.split(b"\r\n")[0] == first_line


async def tls_client(port: int, cert: Path, alpn: str) -> trio.SSLStream[trio.SocketStream]:
    context = ssl.create_default_context(cafile=str(cert))
    context.set_alpn_protocols([alpn])
    stream = trio.SSLStream(await trio.open_tcp_stream(HOST, port), context, server_hostname="localhost")
    await stream.do_handshake()
    assert stream.selected_alpn_protocol() == alpn
    return stream


async def test_a_broken_preface_over_tls_is_goaway_protocol_error(nursery: trio.Nursery, tmp_path: Path) -> None:
    with trio.fail_after(10):
        cert, key = make_self_signed(tmp_path)
        server: HTTPServer = await nursery.start(
            functools.partial(serve_http, Gate(), ssl_context=server_context(cert, key))
        )
        stream = await tls_client(server.port, cert, "h2")
        async with stream:
            raw = Client(stream)
            await raw.send(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
            await closed_with(raw, E.PROTOCOL_ERROR, last_stream_id=0)


@pytest.mark.parametrize("complete", [True, False])
async def test_first_bytes_timeout_closes_an_unfinished_preface_silently(nursery: trio.Nursery, complete: bool) -> None:
    """``first_bytes_timeout=0.5``: the whole preface in time is HTTP/2 (the server's SETTINGS); a
    matching prefix that stops there is closed at the timeout, without a byte."""
    with trio.fail_after(10):
        server, _ = await listen(nursery, first_bytes_timeout=0.5)
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            await stream.send_all(H2_PREFACE if complete else H2_PREFACE[:16])
            started = trio.current_time()
            raw = Client(stream)
            if complete:
                await stream.send_all(hf.SettingsFrame(0).serialize())
                first = await raw.next_frame()
                assert isinstance(first, hf.SettingsFrame)
            else:
                assert await stream.receive_some(65536) == b""
                assert trio.current_time() - started >= 0.5 * 0.9


@pytest.mark.parametrize("handshakes", [True, False])
async def test_tls_handshake_timeout_closes_a_silent_client(
    nursery: trio.Nursery, tmp_path: Path, handshakes: bool
) -> None:
    with trio.fail_after(10):
        cert, key = make_self_signed(tmp_path)
        server: HTTPServer = await nursery.start(
            functools.partial(
                serve_http,
                Gate(),
                ssl_context=server_context(cert, key),
                config=ListenerConfig(tls_handshake_timeout=0.5),
            )
        )
        if handshakes:
            stream = await tls_client(server.port, cert, "http/1.1")
            async with stream:
                await stream.send_all(b"GET / HTTP/1.1\r\nhost: localhost\r\n\r\n")
                assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200 OK")
        else:
            async with await trio.open_tcp_stream(HOST, server.port) as plain:
                started = trio.current_time()
                assert await plain.receive_some(65536) == b""
                assert trio.current_time() - started >= 0.5 * 0.9


@pytest.mark.parametrize(("client_closes", "close_timeout"), [(True, 5.0), (False, 0.5)])
async def test_close_timeout_bounds_a_closing_connection(
    nursery: trio.Nursery, client_closes: bool, close_timeout: float
) -> None:
    """After its GOAWAY the server half-closes and waits for the client to close: one that does is
    gone at once (well within a ``close_timeout`` of 5 s), one that stays is dropped at the timeout."""
    with trio.fail_after(10):
        server, _ = await listen(nursery, close_timeout=close_timeout)
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            raw = Client(stream)
            await raw.send(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
            await closed_with(raw, E.PROTOCOL_ERROR)  # up to the server's half-close
            started = trio.current_time()
            if client_closes:
                await stream.aclose()
            await wait_for(lambda: server.statistics().connections == 0)
            elapsed = trio.current_time() - started
        if client_closes:
            assert elapsed < close_timeout
        else:
            assert elapsed >= close_timeout * 0.9
