"""The response clock: ``response_timeout`` is the upstream's time to answer a whole request.

It starts when the request's end has gone upstream, at every hop and on
every path (an h1 or an h2 upstream pool; a connection's first request,
which a hop handles, and later ones, which it splices), so an upload that
takes longer than the timeout is never cut for it. An upstream that takes
no byte of the request for ``stall_timeout`` is still cut: 504.

The replica is hypercorn serving ``tests/asgi_replica.py``, a separate
process: ``/digest`` reads the whole body before it answers, ``/ignore``
never reads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import h2.events
import httpx
import pytest
import trio
from h2.errors import ErrorCodes
from support import RawH2Client, curl, h2_client, hypercorn_behind

from blocks import UpstreamConfig

WORKER = UpstreamConfig(response_timeout=1.0)
PROXY = UpstreamConfig(response_timeout=2.0)  # longer toward the client, as docs/hops.md advises
GAPS = 4  # the upload's pauses, each under either timeout, together well over both
GAP = 0.6


@pytest.mark.parametrize("scheme", ["http", "h2c"])
async def test_an_upload_longer_than_the_response_timeout_is_answered(nursery: trio.Nursery, scheme: str) -> None:
    parts = [b"part %d " % i * 1000 for i in range(GAPS + 1)]
    whole = b"".join(parts)
    expected = b"%d %s\n" % (len(whole), hashlib.sha256(whole).hexdigest().encode())

    async def upload() -> AsyncIterator[bytes]:
        for i, part in enumerate(parts):
            if i:
                await trio.sleep(GAP)  # the client is slow: no upstream's fault
            yield part

    with trio.fail_after(60):
        async with hypercorn_behind(nursery, scheme, WORKER, PROXY) as chain:
            async with h2_client() as client:
                # The first request of a connection takes each hop's handler path, the second its splice.
                for _ in range(2):
                    started = trio.current_time()
                    response = await client.post(chain.url + "/digest", content=upload())
                    assert trio.current_time() - started > PROXY.response_timeout  # the upload alone took longer
                    assert response.status_code == 200, response.text
                    assert response.content == expected
                    assert response.headers["x-served-by"] == "hypercorn"
            # Once whole, the request is on the clock as before: a replica that never answers is a 504.
            async with httpx.AsyncClient(trust_env=False) as client:
                response = await client.post(chain.url + "/ignore", content=b"small")
            assert response.status_code == 504
            assert response.headers["proxyblocks-error"].startswith("replica_timeout; hop=worker; replica=")


async def h2_upload_until_answered(port: int, path: bytes) -> RawResult:
    """POST to ``path`` over h2, sending DATA as fast as the windows allow, until the stream ends: the
    answer's head and how the stream ended (the reset's code, if it was reset)."""
    async with RawH2Client.open(port) as client:
        sid = await client.start(client.head(b"POST", path), end_stream=False)
        stream = client.conn.streams[sid]

        async def send() -> None:
            while not stream.closed:
                room = min(client.conn.local_flow_control_window(sid), client.conn.max_outbound_frame_size)
                if room:
                    await client.send(sid, bytes(room))
                else:
                    await trio.sleep(0.01)  # (the reader task applies WINDOW_UPDATEs meanwhile)

        async with trio.open_nursery() as sender:
            sender.start_soon(send)
            result = await client.collect(sid)
            reset = result.reset
            if reset is None and not result.connection_lost:
                # Ended; a reset may follow, for the rest of the upload.
                event = await client.next_event(sid)
                reset = event if isinstance(event, h2.events.StreamReset) else None
            sender.cancel_scope.cancel()
    return RawResult(result.status, dict(result.headers), None if reset is None else reset.error_code)


@attrs.frozen
class RawResult:
    status: int
    headers: dict[bytes, bytes]
    reset: int | None


@pytest.mark.parametrize("scheme", ["http", "h2c"])
async def test_an_upstream_that_stops_reading_an_upload_is_cut_after_stall_timeout(
    nursery: trio.Nursery, scheme: str, tmp_path: Path
) -> None:
    # Far more than every buffer and window between the client and hypercorn's unread queue.
    big = tmp_path / "upload.bin"
    with big.open("wb") as file:
        file.truncate(256 * 1024 * 1024)
    # No response clock runs (the request never ends); the worker's stall clock cuts it, the proxy's is longer.
    worker = UpstreamConfig(response_timeout=3600.0, stall_timeout=1.0)
    proxy = UpstreamConfig(response_timeout=3600.0, stall_timeout=5.0)
    with trio.fail_after(60):
        async with hypercorn_behind(nursery, scheme, worker, proxy) as chain:
            # HTTP/2: the 504, then RST_STREAM(NO_ERROR) for the rest of the upload (RFC 9113 8.1).
            answer = await h2_upload_until_answered(chain.port, b"/ignore")
            assert answer.status == 504
            assert answer.headers[b"proxyblocks-error"].startswith(b"replica_timeout; hop=worker; replica=")
            assert answer.reset == ErrorCodes.NO_ERROR
            # HTTP/1.1, with curl: the 504 before the upload ends.
            output = await curl(
                "--http1.1", "--data-binary", f"@{big}", "-o", "/dev/null", "-D", "-", chain.url + "/ignore"
            )
            head = output.lower()
            assert head.split("\r\n\r\n")[-2].split(None, 2)[1] == "504", output  # (after the 100 Continue)
            assert "proxyblocks-error: replica_timeout; hop=worker; replica=" in head, output
