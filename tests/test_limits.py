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
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path

import h2.errors
import h2.events
import hpack
import hyperframe.frame as hf
import pytest
import trio
from hpack.hpack import encode_integer
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blocks import (
    HTTPServer,
    ListenerConfig,
    LocalReplica,
    Request,
    Response,
    serve_http,
    server_context,
    text_response,
)
from blocks.testing import DemoApp, make_self_signed
from blocks.transport.streams import codec_in_use
from tests.support import (
    H2_PREFACE,
    HOST,
    RawFrames,
    RawH2Client,
    assemble_local,
    h2_client,
    hypercorn_behind,
    wait_for,
)

E = h2.errors.ErrorCodes
S = hf.SettingsFrame
L = ListenerConfig().max_header_list_size  # 64 KiB
CAP = 4 * L  # the hard cap (HEADER_LIST_HARD_CAP)
Headers = list[tuple[bytes, bytes]]

# -- HPACK, byte for byte ---------------------------------------------------------------------------

HPACK_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


def huffman_code(data: bytes) -> bytes:
    """``data`` Huffman-coded (RFC 7541 5.2, Appendix B), padded with ones (what hpack's encoder does,
    in linear time)."""
    bits = "".join(format(REQUEST_CODES[byte], f"0{REQUEST_CODES_LENGTH[byte]}b") for byte in data)
    bits += "1" * (-len(bits) % 8)
    return int(bits, 2).to_bytes(len(bits) // 8) if bits else b""


def string(data: bytes, *, huffman: bool = False) -> bytes:
    """An HPACK string literal (RFC 7541 5.2)."""
    if huffman:
        data = huffman_code(data)
    length = encode_integer(len(data), 7)
    if huffman:
        length[0] |= 0x80
    return bytes(length) + data


def literal(name: bytes, value: bytes, *, huffman: bool = False, index: bool = False) -> bytes:
    """A literal field with a literal name: never indexed (0x10), or with incremental indexing (0x40)."""
    return (b"\x40" if index else b"\x10") + string(name, huffman=huffman) + string(value, huffman=huffman)


def block(fields: Sequence[tuple[bytes, bytes]], *, huffman: bool = False) -> bytes:
    return b"".join(literal(name, value, huffman=huffman) for name, value in fields)


def decoded(fields: Sequence[tuple[bytes, bytes]]) -> int:
    """The size RFC 9113 6.5.2 (SETTINGS_MAX_HEADER_LIST_SIZE) counts."""
    return sum(len(name) + len(value) + 32 for name, value in fields)


def request(path: bytes = b"/", method: bytes = b"GET") -> Headers:
    return [(b":method", method), (b":scheme", b"http"), (b":authority", b"example.test"), (b":path", path)]


def head_of(size: int, path: bytes = b"/") -> Headers:
    """A request whose header list is exactly ``size`` bytes as decoded: one big field makes it up."""
    fields = request(path)
    return [*fields, (b"x-big", b"a" * (size - decoded(fields) - len(b"x-big") - 32))]


FIELD_MAX = 60_000
"""The most encoded bytes a generated field's value takes: libnghttp2 refuses a string over 64 KiB
(docs/codec.md), and these tests are about whole blocks, not one field."""


def pad(out: bytes, size: int) -> bytes:
    """``out`` and literal ``x-pad`` fields, exactly ``size`` encoded bytes in all."""
    while len(out) < size:
        room = size - len(out)
        if room > FIELD_MAX + 20:
            out += literal(b"x-pad", b"p" * FIELD_MAX)
            continue
        assert room >= 8, "no padding field is that small"
        fits = [k for k in range(room - 11, room - 7) if k >= 0 and len(literal(b"x-pad", b"p" * k)) == room]
        out += literal(b"x-pad", b"p" * fits[0]) if fits else literal(b"x-pad", b"")
    assert len(out) == size
    return out


def wide_block(size: int) -> bytes:
    """A request block of exactly ``size`` encoded bytes that decodes to far less (but over L):
    backslashes, which Huffman codes in 19 bits, then padding."""
    out = block(request())
    wide = (size - len(out) - 64) * 8 // 19
    per_field = FIELD_MAX * 8 // 19
    while wide > 0:
        out += literal(b"x-wide", b"\\" * min(wide, per_field), huffman=True)
        wide -= per_field
    return pad(out, size)


def bomb(size: int) -> bytes:
    """A small block that decodes to exactly ``size`` bytes: a 4,000-byte field indexed once, then
    referenced (HPACK's dynamic table), then one last field to make up the size."""
    fields = request()
    entry = (b"x-bomb", b"b" * 4000)
    out = block(fields) + literal(*entry, index=True)
    total = decoded([*fields, entry])
    refs = (size - total - 37) // decoded([entry])
    out += b"\xbe" * refs  # indexed field 62: the entry just added
    total += refs * decoded([entry])
    return out + literal(b"x-end", b"e" * (size - total - 37))


def table_size_update(size: int) -> bytes:
    """A dynamic table size update (RFC 7541 6.3)."""
    update = encode_integer(size, 5)
    update[0] |= 0x20
    return bytes(update)


def frames(sid: int, data: bytes, *, end_stream: bool = True, end_headers: bool = True) -> list[hf.Frame]:
    """A header block as HEADERS and CONTINUATIONs of at most 16 KiB."""
    parts = [data[i : i + 16384] for i in range(0, len(data), 16384)] or [b""]
    out: list[hf.Frame] = [hf.HeadersFrame(sid, parts[0], flags=["END_STREAM"] if end_stream else [])]
    out += [hf.ContinuationFrame(sid, part) for part in parts[1:]]
    if end_headers:
        out[-1].flags.add("END_HEADERS")
    return out


def get(sid: int, path: bytes = b"/", *, method: bytes = b"GET", end_stream: bool = True) -> hf.HeadersFrame:
    flags = ["END_HEADERS", "END_STREAM"] if end_stream else ["END_HEADERS"]
    return hf.HeadersFrame(sid, block(request(path, method)), flags=flags)


# -- the server and the client's reading ---------------------------------------------------------------


class Gate:
    """The handler: ``/hold`` waits (its body unread) until ``release``; ``/read`` reads its body and
    answers its length; ``/close`` closes its body unread and answers; anything else (an extended
    CONNECT too) is 200."""

    def __init__(self) -> None:
        self.held = 0
        self.release = trio.Event()

    async def __call__(self, request: Request) -> Response:
        if request.path == b"/hold":
            self.held += 1
            await self.release.wait()
        if request.path == b"/close":
            await request.body.aclose()  # done with the upload before its end; the answer still goes
            return text_response(200, "closed\n")
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


async def answer(raw: Client, sid: int) -> hf.Frame | None:
    """The server's answer on ``sid``: its response head, its RST_STREAM, or a GOAWAY (None: closed)."""
    if sid in raw.answers:
        return raw.answers[sid]
    return await raw.until(
        lambda f: (
            isinstance(f, hf.GoAwayFrame) or (isinstance(f, hf.HeadersFrame | hf.RstStreamFrame) and f.stream_id == sid)
        )
    )


async def status(raw: Client, sid: int) -> bytes:
    """The ``:status`` the server answered ``sid`` with; fails on a reset or a GOAWAY."""
    frame = await answer(raw, sid)
    assert isinstance(frame, hf.HeadersFrame), f"stream {sid}: {frame!r} where a response was expected"
    result = raw.status(sid)
    assert result is not None
    return result


async def closed_with(raw: Client, code: int, last_stream_id: int | None = None) -> None:
    """A connection error: GOAWAY(``code``), and then the connection closes."""
    goaway = await raw.goaway()
    assert goaway is not None, f"closed without a GOAWAY({E(code).name})"
    assert goaway.error_code == code, f"GOAWAY({E(goaway.error_code).name}), expected {E(code).name}"
    if last_stream_id is not None:
        assert goaway.last_stream_id == last_stream_id
    while (frame := await raw.next_frame()) is not None:
        assert not isinstance(frame, hf.HeadersFrame | hf.DataFrame), f"{frame!r} after the GOAWAY"


async def body(raw: Client, sid: int) -> bytes:
    """The response body of ``sid``, to its END_STREAM."""
    data = b""
    while True:
        frame = await raw.until(lambda f: isinstance(f, hf.DataFrame) and f.stream_id == sid)
        assert isinstance(frame, hf.DataFrame)
        data += frame.data
        if "END_STREAM" in frame.flags:
            return data


async def goes_on(raw: Client, sid: int) -> None:
    """The connection still serves: a new stream ``sid`` gets its 200."""
    assert await raw.send(get(sid))
    assert await status(raw, sid) == b"200"


# -- SETTINGS: what the client reads ---------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(ListenerConfig(), id="defaults"),
        pytest.param(
            ListenerConfig(
                max_concurrent_streams=7,
                stream_window=100_000,
                connection_window=1 << 20,
                max_header_list_size=4096,
                enable_connect_protocol=False,
            ),
            id="configured",
        ),
    ],
)
async def test_the_settings_frame_advertises_what_is_enforced(nursery: trio.Nursery, config: ListenerConfig) -> None:
    with trio.fail_after(10):
        server: HTTPServer = await nursery.start(functools.partial(serve_http, Gate(), config=config))
        async with Client.open(server.port) as raw:
            first = await raw.next_frame()
            assert isinstance(first, hf.SettingsFrame) and "ACK" not in first.flags
            assert dict(first.settings) == {
                S.HEADER_TABLE_SIZE: 4096,
                S.ENABLE_PUSH: 0,
                S.MAX_CONCURRENT_STREAMS: config.max_concurrent_streams,
                S.INITIAL_WINDOW_SIZE: config.stream_window,
                S.MAX_FRAME_SIZE: 16384,
                S.MAX_HEADER_LIST_SIZE: config.max_header_list_size,
                S.ENABLE_CONNECT_PROTOCOL: int(config.enable_connect_protocol),
            }
            window = await raw.next_frame()
            assert isinstance(window, hf.WindowUpdateFrame) and window.stream_id == 0
            assert window.window_increment == config.connection_window - 65535


# -- SETTINGS_MAX_HEADER_LIST_SIZE and the hard cap --------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(head_of(L), b"200", id="at-the-limit"),
        pytest.param(head_of(L + 1), b"431", id="one-over"),
        pytest.param([*request(), (b"x-big", b"a" * 60_000), (b"x-big", b"a" * 10_000)], b"431", id="wide-fields"),
    ],
)
async def test_a_header_list_up_to_the_advertised_size_is_served_and_one_over_is_431_on_its_stream(
    nursery: trio.Nursery, fields: Headers, expected: bytes
) -> None:
    """Sent raw (no Huffman), so that the encoded block is about as large as the decoded list: a
    block over the limit is still only that stream's 431; a stream already open is answered after it."""
    with trio.fail_after(10):
        server, gate = await listen(nursery)
        async with Client.open(server.port) as raw:
            await raw.send(get(1, b"/hold"))
            await wait_for(lambda: gate.held == 1)
            await raw.send(*frames(3, block(fields)))
            assert await status(raw, 3) == expected
            await goes_on(raw, 5)
            gate.release.set()
            assert await status(raw, 1) == b"200"
        assert server.statistics().abuse == {}


async def test_one_field_over_64_kib_is_431_on_h2_and_a_compression_error_on_nghttp2(nursery: trio.Nursery) -> None:
    """The codecs' one documented difference on a request head (docs/codec.md): libnghttp2's HPACK
    decoder takes no string over 64 KiB encoded and fails that connection; hyper-h2 decodes it and the
    listener answers 431 on its stream. Either way, a stream already open on another connection is served."""
    with trio.fail_after(10):
        server, gate = await listen(nursery)
        async with Client.open(server.port) as other, Client.open(server.port) as raw:
            await other.send(get(1, b"/hold"))
            await wait_for(lambda: gate.held == 1)
            await raw.send(*frames(1, block([*request(), (b"x-big", b"a" * 70_000)])))
            if codec_in_use() == "nghttp2":
                await closed_with(raw, E.COMPRESSION_ERROR)
            else:
                assert await status(raw, 1) == b"431"
                await goes_on(raw, 3)
            gate.release.set()
            assert await status(other, 1) == b"200"


@pytest.mark.parametrize(
    ("size", "ended", "refused"),
    [
        pytest.param(CAP, True, False, id="at-the-cap"),
        pytest.param(CAP + 1, True, True, id="one-over"),
        pytest.param(CAP + 1, False, True, id="one-over-never-ended"),
    ],
)
async def test_a_header_block_is_cut_once_its_encoded_size_passes_the_hard_cap(
    nursery: trio.Nursery, size: int, ended: bool, refused: bool
) -> None:
    """Four times the limit, counted as the block arrives, frame by frame: at the cap the block is
    decoded (over the limit: 431, and the connection goes on); one byte over, GOAWAY(ENHANCE_YOUR_CALM),
    whether the block was ever going to end or not (a CONTINUATION flood)."""
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        data = wide_block(size)
        assert L < decoded_of(data) <= CAP
        async with Client.open(server.port) as raw:
            await raw.send(*frames(1, data, end_headers=ended))
            if refused:
                await closed_with(raw, E.ENHANCE_YOUR_CALM, last_stream_id=0)
                await wait_for(lambda: server.statistics().abuse == {"header_flood": 1})
            else:
                assert await status(raw, 1) == b"431"
                await goes_on(raw, 3)


def decoded_of(data: bytes) -> int:
    """What ``data`` decodes to, as counted (a fresh HPACK context)."""
    decoder = hpack.Decoder()
    decoder.max_header_list_size = 2**30
    return decoded([(bytes(n), bytes(v)) for n, v in decoder.decode(data, raw=True)])


@pytest.mark.parametrize(
    ("size", "refused"), [pytest.param(CAP, False, id="at-the-cap"), pytest.param(CAP + 1, True, id="one-over")]
)
async def test_a_header_list_is_cut_once_it_decodes_past_the_hard_cap(
    nursery: trio.Nursery, size: int, refused: bool
) -> None:
    """An HPACK bomb (a few KB that reference one indexed field again and again): decoded up to four
    times the limit it is a 431 of its stream; past that, GOAWAY(ENHANCE_YOUR_CALM) while decoding."""
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        data = bomb(size)
        assert len(data) < 16384 and decoded_of(data) == size
        async with Client.open(server.port) as raw:
            await raw.send(*frames(1, data))
            if refused:
                await closed_with(raw, E.ENHANCE_YOUR_CALM)
                await wait_for(lambda: server.statistics().abuse == {"header_flood": 1})
            else:
                assert await status(raw, 1) == b"431"
                await goes_on(raw, 3)


@pytest.mark.parametrize(("parts", "refused"), [(63, False), (64, True)])
async def test_a_header_block_takes_at_most_63_continuation_frames(
    nursery: trio.Nursery, parts: int, refused: bool
) -> None:
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        data = block([*request(), (b"x-pieces", b"p" * 200)])
        cut = [len(data) * i // (parts + 1) for i in range(parts + 2)]
        pieces = [data[cut[i] : cut[i + 1]] for i in range(parts + 1)]
        assert all(pieces)
        out: list[hf.Frame] = [hf.HeadersFrame(1, pieces[0], flags=["END_STREAM"])]
        out += [hf.ContinuationFrame(1, piece) for piece in pieces[1:]]
        out[-1].flags.add("END_HEADERS")
        async with Client.open(server.port) as raw:
            await raw.send(*out)
            if refused:
                await closed_with(raw, E.ENHANCE_YOUR_CALM)
            else:
                assert await status(raw, 1) == b"200"


@pytest.mark.parametrize(("count", "expected"), [(100, b"200"), (101, b"431")])
async def test_max_header_count_counts_regular_fields(nursery: trio.Nursery, count: int, expected: bytes) -> None:
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        async with Client.open(server.port) as raw:
            await raw.send(*frames(1, block([*request(), *[(b"x-f%d" % i, b"v") for i in range(count)]])))
            assert await status(raw, 1) == expected
            await goes_on(raw, 3)


@pytest.mark.parametrize(
    ("size", "expected"), [pytest.param(L, b"200", id="at-the-limit"), pytest.param(L + 1, b"431", id="one-over")]
)
async def test_trailers_are_held_to_the_header_list_limit_on_their_stream(
    nursery: trio.Nursery, size: int, expected: bytes
) -> None:
    """Trailers are a field block like a head (RFC 9113 6.5.2): up to the limit they reach the handler;
    one byte over, the request is refused with a 431 on its stream alone, and the connection goes on."""
    trailers = [(b"x-big", b"t" * (size - len(b"x-big") - 32))]
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        async with Client.open(server.port) as raw:
            await raw.send(
                get(1, b"/read", method=b"POST", end_stream=False),
                hf.DataFrame(1, b"12345"),
                *frames(1, block(trailers)),
            )
            assert await status(raw, 1) == expected
            if expected == b"200":
                assert await body(raw, 1) == b"5\n"
            await goes_on(raw, 3)
        assert server.statistics().abuse == {}


@pytest.mark.parametrize(
    ("size", "expected"), [pytest.param(L, b"200", id="at-the-limit"), pytest.param(L + 1, b"431", id="one-over")]
)
async def test_what_the_edge_accepts_goes_through_every_hop(nursery: trio.Nursery, size: int, expected: bytes) -> None:
    """A head exactly at the edge's limit crosses edge, proxy and worker (each adds its fields) to a
    replica with room for it, and comes back 200; one byte more is the edge's own 431."""
    with trio.fail_after(20):
        roomy: HTTPServer = await nursery.start(
            functools.partial(serve_http, DemoApp("replica-0"), config=ListenerConfig(max_header_list_size=2 * L))
        )
        chain = await assemble_local(nursery, {"replica-0": LocalReplica((HOST, roomy.port))})
        async with Client.open(chain.port) as raw:
            await raw.send(*frames(1, block(head_of(size))))
            assert await status(raw, 1) == expected
            if expected == b"200":
                assert await body(raw, 1) == b"hello from replica-0\n"
            else:
                assert raw.heads[1][b"proxyblocks-error"].endswith(b"hop=edge")
            await goes_on(raw, 3)


async def test_an_upstream_response_head_over_the_limit_fails_that_response_alone(nursery: trio.Nursery) -> None:
    """The pool advertises ``max_header_list_size`` to its upstreams too: a response head over it
    (under the hard cap) is a 502 of that request, its stream reset, and the pooled connection with
    its other streams goes on; one within it passes. The replica is hypercorn, over h2c."""
    parts = [b"part %d\n" % i for i in range(3)]
    with trio.fail_after(30):
        async with hypercorn_behind(nursery, "h2c") as chain, RawH2Client.open(chain.port) as raw:
            # An exchange in flight on the worker's one connection to the replica...
            echo = await raw.start(raw.head(b"POST", b"/echo"), end_stream=False)
            echoed = b""

            async def echoes(part: bytes, *, end: bool = False) -> None:
                nonlocal echoed
                await raw.send(echo, part, end_stream=end)
                while not echoed.endswith(part):
                    event = await raw.next_event(echo)
                    if isinstance(event, h2.events.DataReceived):
                        echoed += event.data
                    else:
                        assert isinstance(event, h2.events.ResponseReceived), event

            await echoes(parts[0])
            # ... sees nothing of a response over the limit beside it.
            async with h2_client() as client:
                response = await client.get(chain.url + f"/big-head?size={L + 1000}")
                assert response.status_code == 502
                assert response.headers["proxyblocks-error"].startswith("upstream_reset; hop=worker; replica=")
                response = await client.get(chain.url + f"/big-head?size={L // 2}")
                assert response.status_code == 200
                assert len(response.headers["x-big"]) == L // 2
            await echoes(parts[1])
            await echoes(parts[2], end=True)
            assert echoed == b"".join(parts)
            (pool,) = chain.worker.upstreams.statistics()
            assert pool.connections == 1


async def test_a_handler_that_closes_its_request_body_early_still_answers(nursery: trio.Nursery) -> None:
    """RFC 9113 8.1: a server that is done with an upload answers, and only then asks the client to
    stop with RST_STREAM(NO_ERROR); closing the body never resets the stream before its answer."""
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        async with Client.open(server.port) as raw:
            await raw.send(get(1, b"/close", method=b"POST", end_stream=False), hf.DataFrame(1, b"x" * 100))
            assert await status(raw, 1) == b"200"
            assert await body(raw, 1) == b"closed\n"
            reset = await raw.until(lambda f: isinstance(f, hf.RstStreamFrame) and f.stream_id == 1)
            assert isinstance(reset, hf.RstStreamFrame) and reset.error_code == E.NO_ERROR
            await goes_on(raw, 3)


# The invariant the hard cap rests on: no encoding of a list inside the limit is longer than four times it.

_FIELD_BYTES = st.binary(min_size=0, max_size=300)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.lists(st.tuples(st.binary(min_size=1, max_size=40), _FIELD_BYTES), min_size=1, max_size=20),
    huffman=st.booleans(),
    updates=st.lists(st.integers(0, 4096), max_size=2),
)
def test_no_encoding_of_a_header_list_is_longer_than_four_times_its_counted_size(
    fields: list[tuple[bytes, bytes]], huffman: bool, updates: list[int]
) -> None:
    encoded = b"".join(table_size_update(u) for u in updates) + block(fields, huffman=huffman)
    assert len(encoded) <= 4 * decoded(fields)
    for name, value in fields:  # and the Huffman coding here is hpack's
        assert huffman_code(name + value) == HPACK_HUFFMAN.encode(name + value)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    heads=st.lists(
        st.tuples(st.integers(512, 4 * 4096 + 512), st.integers(1, 8), st.booleans()), min_size=1, max_size=6
    )
)
def test_every_head_gets_the_answer_its_size_calls_for(heads: list[tuple[int, int, bool]]) -> None:
    """Invariant (``max_header_list_size=4096``): a list that decodes within the limit is served,
    one within four times it is 431 on its stream and the connection goes on, and one past it closes
    the connection with GOAWAY(ENHANCE_YOUR_CALM); whatever the fields and the coding."""
    limit = 4096

    async def run() -> None:
        pending = list(heads)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                server, _ = await listen(nursery, max_header_list_size=limit)
                while pending:
                    async with Client.open(server.port) as raw:
                        sid = 1
                        while pending:
                            size, count, huffman = pending.pop(0)
                            fields = request()
                            share = max(0, size - decoded(fields)) // count
                            fields += [(b"x-f%d" % i, b"v" * max(0, share - 36)) for i in range(count)]
                            await raw.send(*frames(sid, block(fields, huffman=huffman)))
                            if decoded(fields) <= limit:
                                assert await status(raw, sid) == b"200"
                            elif decoded(fields) <= 4 * limit:
                                assert await status(raw, sid) == b"431"
                            else:
                                await closed_with(raw, E.ENHANCE_YOUR_CALM)
                                break
                            sid += 2
                nursery.cancel_scope.cancel()

    trio.run(run)


# -- HEADER_TABLE_SIZE, MAX_FRAME_SIZE ----------------------------------------------------------------


@pytest.mark.parametrize(("size", "refused"), [(4096, False), (4097, True)])
async def test_the_dynamic_table_takes_at_most_header_table_size(
    nursery: trio.Nursery, size: int, refused: bool
) -> None:
    """SETTINGS_HEADER_TABLE_SIZE 4096: a table size update up to it is taken, past it is a
    decoding error, GOAWAY(COMPRESSION_ERROR) (RFC 7541 6.3, RFC 9113 4.3)."""
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        async with Client.open(server.port) as raw:
            await raw.send(*frames(1, table_size_update(size) + block(request())))
            if refused:
                await closed_with(raw, E.COMPRESSION_ERROR)
            else:
                assert await status(raw, 1) == b"200"


@pytest.mark.parametrize("kind", ["DATA", "HEADERS"])
@pytest.mark.parametrize(("length", "refused"), [(16384, False), (16385, True)])
async def test_a_frame_is_at_most_max_frame_size(nursery: trio.Nursery, kind: str, length: int, refused: bool) -> None:
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        async with Client.open(server.port) as raw:
            if kind == "DATA":
                await raw.send(get(1, b"/read", method=b"POST", end_stream=False))
                await raw.send(hf.DataFrame(1, b"d" * length, flags=["END_STREAM"]))
            else:
                await raw.send(hf.HeadersFrame(1, pad(block(request()), length), flags=["END_HEADERS", "END_STREAM"]))
            if refused:
                await closed_with(raw, E.FRAME_SIZE_ERROR)
            else:
                assert await status(raw, 1) == b"200"
                if kind == "DATA":
                    data = await raw.until(lambda f: isinstance(f, hf.DataFrame))
                    assert isinstance(data, hf.DataFrame) and data.data == b"16384\n"


async def test_an_oversized_frame_is_refused_from_its_header_before_its_payload(nursery: trio.Nursery) -> None:
    """A frame header announcing 16 MiB, and nothing after it: GOAWAY(FRAME_SIZE_ERROR) at once,
    where waiting for the payload would hold 16 MiB per connection."""
    with trio.fail_after(10):
        server, _ = await listen(nursery)
        async with Client.open(server.port) as raw:
            await raw.send(get(1, b"/hold", method=b"POST", end_stream=False))
            await raw.send((2**24 - 1).to_bytes(3) + b"\x00\x00\x00\x00\x00\x01")  # DATA on stream 1
            await closed_with(raw, E.FRAME_SIZE_ERROR)


# -- MAX_CONCURRENT_STREAMS --------------------------------------------------------------------------


async def test_a_stream_past_max_concurrent_streams_is_refused_alone(nursery: trio.Nursery) -> None:
    """``max_concurrent_streams=4``: four held streams are served; a fifth is RST_STREAM(REFUSED_STREAM)
    (RFC 9113 5.1.2: a stream error), the four are answered, and the connection opens more."""
    with trio.fail_after(10):
        server, gate = await listen(nursery, max_concurrent_streams=4)
        async with Client.open(server.port) as raw:
            await raw.send(*[get(sid, b"/hold") for sid in (1, 3, 5, 7)])
            await wait_for(lambda: gate.held == 4)
            await raw.send(get(9))
            reset = await answer(raw, 9)
            assert isinstance(reset, hf.RstStreamFrame) and reset.error_code == E.REFUSED_STREAM
            gate.release.set()
            for sid in (1, 3, 5, 7):
                assert await status(raw, sid) == b"200"
            await goes_on(raw, 11)


# -- INITIAL_WINDOW_SIZE and the connection window -------------------------------------------------------


def data_frames(sid: int, size: int) -> list[hf.Frame]:
    return [hf.DataFrame(sid, b"x" * min(16384, size - at)) for at in range(0, size, 16384)]


async def acknowledge_settings(raw: Client) -> None:
    """Read the server's SETTINGS and acknowledge them, as every client must before relying on them."""
    while not isinstance(frame := await raw.next_frame(), hf.SettingsFrame) or "ACK" in frame.flags:
        assert frame is not None, "the server closed the connection"
    await raw.send(hf.SettingsFrame(0, flags=["ACK"]))


@pytest.mark.parametrize(("sent", "refused"), [(256 * 1024, False), (256 * 1024 + 1, True)])
async def test_a_stream_takes_its_window_and_no_more(nursery: trio.Nursery, sent: int, refused: bool) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE (``stream_window``, 256 KiB): a request body nobody reads fills
    the stream's window; one byte more is GOAWAY(FLOW_CONTROL_ERROR)."""
    with trio.fail_after(10):
        server, gate = await listen(nursery)
        async with Client.open(server.port) as raw:
            await acknowledge_settings(raw)  # (the window is ours once the client has taken it: RFC 9113 6.5.3)
            await raw.send(get(1, b"/hold", method=b"POST", end_stream=False), *data_frames(1, sent))
            if refused:
                await closed_with(raw, E.FLOW_CONTROL_ERROR)
            else:
                await wait_for(lambda: gate.held == 1)
                await goes_on(raw, 3)


@pytest.mark.parametrize(("extra", "refused"), [(0, False), (1, True)])
async def test_a_connection_takes_its_window_and_no_more(nursery: trio.Nursery, extra: int, refused: bool) -> None:
    """``connection_window`` (the WINDOW_UPDATE at start): two unread bodies fill 131,070 bytes; one
    byte more, on a third stream, is GOAWAY(FLOW_CONTROL_ERROR)."""
    with trio.fail_after(10):
        server, gate = await listen(nursery, stream_window=65535, connection_window=2 * 65535)
        async with Client.open(server.port) as raw:
            for sid in (1, 3):
                await raw.send(get(sid, b"/hold", method=b"POST", end_stream=False), *data_frames(sid, 65535))
            await raw.send(get(5, b"/hold", method=b"POST", end_stream=False))
            await wait_for(lambda: gate.held == 3)
            if extra:
                await raw.send(hf.DataFrame(5, b"x" * extra))
                await closed_with(raw, E.FLOW_CONTROL_ERROR)
            else:
                await goes_on(raw, 7)


# -- ENABLE_CONNECT_PROTOCOL -----------------------------------------------------------------------


@pytest.mark.parametrize(("enabled", "expected"), [(True, b"200"), (False, b"400")])
async def test_extended_connect_is_taken_only_where_advertised(
    nursery: trio.Nursery, enabled: bool, expected: bytes
) -> None:
    with trio.fail_after(10):
        server, _ = await listen(nursery, enable_connect_protocol=enabled)
        head = [
            (b":method", b"CONNECT"),
            (b":protocol", b"websocket"),
            (b":scheme", b"http"),
            (b":authority", b"example.test"),
            (b":path", b"/chat"),
            (b"sec-websocket-version", b"13"),
        ]
        async with Client.open(server.port) as raw:
            first = await raw.next_frame()
            assert isinstance(first, hf.SettingsFrame)
            assert first.settings[S.ENABLE_CONNECT_PROTOCOL] == int(enabled)
            await raw.send(*frames(1, block(head), end_stream=False))
            assert await status(raw, 1) == expected
            await goes_on(raw, 3)


# -- the per-client limits ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answered", "reset", "closed"),
    [
        pytest.param(0, 10, False, id="10-resets-of-10"),
        pytest.param(0, 11, True, id="11-resets-of-11"),
        pytest.param(11, 11, False, id="11-resets-of-22"),
        pytest.param(10, 11, True, id="11-resets-of-21"),
    ],
)
async def test_max_client_resets_is_a_count_and_a_share(
    nursery: trio.Nursery, answered: int, reset: int, closed: bool
) -> None:
    """``max_client_resets=10``: a client is closed once it has reset more than 10 streams it opened
    before they were answered, and more than half of them; the request behind the last reset tells."""
    with trio.fail_after(10):
        server, gate = await listen(nursery, max_client_resets=10)
        async with Client.open(server.port) as raw:
            sids = list(range(1, 2 * answered, 2))
            await raw.send(*[get(sid) for sid in sids])
            for sid in sids:
                assert await status(raw, sid) == b"200"
            held = list(range(2 * answered + 1, 2 * (answered + reset), 2))
            await raw.send(*[get(sid, b"/hold") for sid in held])
            await wait_for(lambda: gate.held == reset)
            probe = held[-1] + 2
            await raw.send(*[hf.RstStreamFrame(sid, error_code=E.CANCEL) for sid in held], get(probe))
            if closed:
                await closed_with(raw, E.ENHANCE_YOUR_CALM, last_stream_id=held[-1])
            else:
                assert await status(raw, probe) == b"200"


@pytest.mark.parametrize("kind", ["DATA", "CONTINUATION"])
@pytest.mark.parametrize(("empty", "closed"), [(3, False), (4, True)])
async def test_max_empty_frames_in_a_row(nursery: trio.Nursery, kind: str, empty: int, closed: bool) -> None:
    with trio.fail_after(10):
        server, _ = await listen(nursery, max_empty_frames=3)
        async with Client.open(server.port) as raw:
            if kind == "DATA":
                await raw.send(get(1, b"/read", method=b"POST", end_stream=False))
                await raw.send(
                    *[hf.DataFrame(1, b"") for _ in range(empty)], hf.DataFrame(1, b"x", flags=["END_STREAM"])
                )
            else:
                data = block(request())
                await raw.send(
                    hf.HeadersFrame(1, data[:5], flags=["END_STREAM"]),
                    *[hf.ContinuationFrame(1, b"") for _ in range(empty)],
                    hf.ContinuationFrame(1, data[5:], flags=["END_HEADERS"]),
                )
            if closed:
                await closed_with(raw, E.ENHANCE_YOUR_CALM)
            else:
                assert await status(raw, 1) == b"200"


@pytest.mark.parametrize(("pings", "closed"), [(49, False), (50, True)])
async def test_flood_limit_counts_control_frames(nursery: trio.Nursery, pings: int, closed: bool) -> None:
    """``flood_limit=50``: the client's SETTINGS and 49 PINGs are 50 control frames; one more closes."""
    with trio.fail_after(10):
        server, _ = await listen(nursery, flood_limit=50)
        async with Client.open(server.port) as raw:
            await raw.send(*[hf.PingFrame(0, opaque_data=b"%08d" % i) for i in range(pings)], get(1))
            if closed:
                await closed_with(raw, E.ENHANCE_YOUR_CALM)
            else:
                assert await status(raw, 1) == b"200"


@pytest.mark.parametrize(("declared", "expected"), [(1000, b"200"), (1001, b"413")])
async def test_a_declared_length_up_to_max_request_body_is_read(
    nursery: trio.Nursery, declared: int, expected: bytes
) -> None:
    with trio.fail_after(10):
        server, _ = await listen(nursery, max_request_body=1000)
        async with Client.open(server.port) as raw:
            head = [*request(b"/read", b"POST"), (b"content-length", b"%d" % declared)]
            await raw.send(
                *frames(1, block(head), end_stream=False), hf.DataFrame(1, b"b" * declared, flags=["END_STREAM"])
            )
            assert await status(raw, 1) == expected
            await goes_on(raw, 3)


BATCHES = 60  # of 1,000 PINGs: a megabyte of answers, well past the socket buffers and 64 KiB


@pytest.mark.parametrize("reads", [True, False])
async def test_max_outbound_buffer_closes_only_a_client_that_does_not_read(nursery: trio.Nursery, reads: bool) -> None:
    """PINGs (the flood limit off), each answered: a client that reads its answers is served
    throughout; one that does not is closed once ``max_outbound_buffer`` bytes of answers wait."""
    with trio.fail_after(30):
        server, _ = await listen(nursery, flood_limit=None, max_outbound_buffer=64 * 1024)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect((HOST, server.port))
        async with trio.SocketStream(sock) as stream:
            raw = Client(stream)
            await raw.send(H2_PREFACE, hf.SettingsFrame(0))
            batch = hf.PingFrame(0, opaque_data=b"pingping").serialize() * 1000
            acks = 0
            sent = 0
            while sent < BATCHES:
                if not await raw.send(batch):
                    break
                sent += 1
                while reads and acks < 1000 * sent:
                    frame = await raw.next_frame()
                    assert frame is not None and not isinstance(frame, hf.GoAwayFrame)
                    acks += isinstance(frame, hf.PingFrame)
                if not reads and not server.statistics().connections:
                    break
            if reads:
                assert sent == BATCHES
                await goes_on(raw, 1)
            else:
                await wait_for(lambda: server.statistics().connections == 0)
                assert sent < BATCHES


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
            started = trio.current_time()  # before the server's timer can start
            async with await trio.open_tcp_stream(HOST, server.port) as plain:
                assert await plain.receive_some(65536) == b""
                assert trio.current_time() - started >= 0.5  # not dropped before its timeout


@pytest.mark.parametrize(("client_closes", "close_timeout"), [(True, 3600.0), (False, 0.5)])
async def test_close_timeout_bounds_a_closing_connection(
    nursery: trio.Nursery, client_closes: bool, close_timeout: float
) -> None:
    """After its GOAWAY the server half-closes and waits for the client to close: one that does is
    gone without waiting out the timeout (an hour here: the test's own bound is ten seconds), one that
    stays is dropped at the timeout, not before."""
    with trio.fail_after(10):
        server, _ = await listen(nursery, close_timeout=close_timeout)
        started = trio.current_time()  # before the server's timer can start
        async with await trio.open_tcp_stream(HOST, server.port) as stream:
            raw = Client(stream)
            await raw.send(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
            await closed_with(raw, E.PROTOCOL_ERROR)  # up to the server's half-close
            if client_closes:
                await stream.aclose()
            await wait_for(lambda: server.statistics().connections == 0)
        if not client_closes:
            assert trio.current_time() - started >= close_timeout
