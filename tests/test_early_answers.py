"""An answer that ends before its request arrives whole, through the chain.

RFC 9113 8.1: a server may answer before it has read the whole request,
end its response with END_STREAM and then reset the stream with
RST_STREAM(NO_ERROR); a client MUST NOT discard the response because of
that reset. Every hop must deliver everything the upstream sent before the
reset, then end the stream downstream, even when it still holds part of the
response while it waits for the downstream window (a client with the
default 64 KiB window, reading as it goes).

Replicas here are proxyblocks' own listener, which answers exactly so when
a handler does not read its request body, tunnels (WebSockets) included. Loopback only, every wait bounded.
"""

from __future__ import annotations

import functools

import h2.errors
import h2.events
import h2.exceptions
import h11
import pytest
import trio
import trio_websocket
from wsproto.frame_protocol import FrameProtocol

from blocks import LocalReplica, Request, Response, serve_http
from blocks.http import BytesBody
from tests.support import HOST, RawH2Client, assemble_local, wait_for

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ANSWER = bytes(range(256)) * (600 * 1024 // 256)  # 600 KiB
UPLOAD = 3 * 1024 * 1024


async def early_answer(request: Request) -> Response:
    """Answers 600 KiB without reading a byte of the request body."""
    return Response(413, [(b"content-length", b"%d" % len(ANSWER))], BytesBody(ANSWER))


async def h2_upload_with_early_answer(port: int) -> tuple[int, bytes, list[h2.events.Event]]:
    """Upload 3 MB as the windows allow while reading the answer; the answer and the stream's events."""
    async with RawH2Client.open(port) as client:
        sid = await client.start(client.head(b"POST", b"/upload"), end_stream=False)
        sent = 0
        status = 0
        body = bytearray()
        events: list[h2.events.Event] = []
        sending = True
        while True:
            # Send what the windows take (the replica reads nothing: they close soon),
            # until the stream ends our side (the answer's reset).
            try:
                while sending and sent < UPLOAD and client.conn.local_flow_control_window(sid) >= 16384:
                    await client.send(sid, b"u" * 16384)
                    sent += 16384
            except h2.exceptions.StreamClosedError:
                sending = False
            event = await client.next_event(sid)
            events.append(event)
            if isinstance(event, h2.events.ResponseReceived):
                status = int(dict(event.headers)[b":status"])
            elif isinstance(event, h2.events.DataReceived):
                body += event.data
            elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                break
        # A reset with NO_ERROR may follow the end (RFC 9113 8.1); nothing else may.
        with trio.move_on_after(0.5):
            events.append(await client.next_event(sid))
        return status, bytes(body), events


async def read_h1_response(stream: trio.SocketStream) -> tuple[int, bytes]:
    """Read one HTTP/1.1 response (h11 parses it): its status and whole body."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "demo")]))  # (the state h11 expects)
    status = 0
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return status, bytes(body)


async def h1_upload(stream: trio.SocketStream) -> None:
    await stream.send_all(b"POST /upload HTTP/1.1\r\nhost: demo\r\ncontent-length: %d\r\n\r\n" % UPLOAD)
    for _ in range(UPLOAD // 65536):
        await stream.send_all(b"u" * 65536)


@pytest.fixture(params=["h2", "h1"], ids=["h2-replica", "h1-replica"])
async def early_chain(request: pytest.FixtureRequest, nursery: trio.Nursery) -> int:
    replica = await nursery.start(serve_http, early_answer)
    assembled = await assemble_local(nursery, {"early": LocalReplica((HOST, replica.port), request.param)})
    return assembled.port


async def test_an_early_answer_reaches_an_h2_client_whole(early_chain: int) -> None:
    with trio.fail_after(60):
        for _ in range(6):
            status, body, events = await h2_upload_with_early_answer(early_chain)
            assert status == 413
            assert len(body) == len(ANSWER)
            assert body == ANSWER
            assert any(isinstance(e, h2.events.StreamEnded) for e in events), events
            resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
            assert all(e.error_code == h2.errors.ErrorCodes.NO_ERROR for e in resets), resets


async def test_an_early_answer_reaches_an_h1_client_whole(early_chain: int) -> None:
    with trio.fail_after(60):
        for _ in range(6):
            stream = await trio.open_tcp_stream(HOST, early_chain)
            async with stream, trio.open_nursery() as nursery:
                nursery.start_soon(h1_upload, stream)
                status, body = await read_h1_response(stream)
                nursery.cancel_scope.cancel()
            assert status == 413
            assert len(body) == len(ANSWER)
            assert body == ANSWER


MESSAGE = "m" * 262_144  # with its frame head, more than the 256 KiB stream window of a hop


async def says_its_piece(request: Request) -> Response:
    """A WebSocket server that sends a message and its close at once, reading nothing."""
    assert request.protocol == b"websocket"
    frames = FrameProtocol(client=False, extensions=[])
    data = frames.send_data(MESSAGE, fin=True) + frames.close(4000, "done")
    return Response(200, [], BytesBody(data))


@pytest.mark.parametrize("protocol", ["h2", "h1"])
async def test_a_websocket_closed_first_by_its_server_delivers_the_message_and_the_close(
    nursery: trio.Nursery, protocol: str
) -> None:
    replica = await nursery.start(serve_http, says_its_piece)
    assembled = await assemble_local(nursery, {"ws": LocalReplica((HOST, replica.port), protocol)})
    with trio.fail_after(60):
        for _ in range(20):
            stream = await trio.open_tcp_stream(HOST, assembled.port)
            async with stream, trio.open_nursery() as client:
                ws = await trio_websocket.wrap_client_stream(client, stream, f"{HOST}:{assembled.port}", "/say")
                assert await ws.get_message() == MESSAGE
                with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                    await ws.get_message()
                assert closed.value.reason.code == 4000
                assert closed.value.reason.reason == "done"
                client.cancel_scope.cancel()
        await wait_for(lambda: not any(assembled.worker.statistics().in_flight.values()), "the worker's tunnels to end")


async def test_a_handler_that_ignores_the_upload_answers_directly_in_full(nursery: trio.Nursery) -> None:
    """The same exchange without the chain: what the hops must reproduce."""
    replica = await nursery.start(functools.partial(serve_http, early_answer))
    with trio.fail_after(30):
        status, body, events = await h2_upload_with_early_answer(replica.port)
    assert status == 413 and body == ANSWER
    assert any(isinstance(e, h2.events.StreamReset) and e.error_code == 0 for e in events), events
