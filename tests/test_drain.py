"""Graceful drain of an HTTP/2 listener, seen frame by frame by a raw client.

A draining listener sends GOAWAY(2^31-1) at once, so the client stops
opening streams; after ``drain_goaway_delay`` the final GOAWAY names the last
stream it serves. Streams opened after that are refused (REFUSED_STREAM, so a
client may retry them elsewhere); streams in flight finish; a stream still
stuck at the drain's deadline is cancelled. The edge (its streams spliced
through the chain) and a plain listener (its streams run by handler tasks)
behave alike.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import functools

import h2.errors
import hyperframe.frame as hf
import pytest
import trio

from blocks import EdgeConfig, HTTPServer, ListenerConfig, serve_edge, serve_http
from tests.support import HOST, RawFrames, TenantReplica, assemble_local, serve_tenant_replica

NO_ERROR = h2.errors.ErrorCodes.NO_ERROR
REFUSED = h2.errors.ErrorCodes.REFUSED_STREAM
CONFIG = ListenerConfig(drain_goaway_delay=0.3)


async def start(nursery: trio.Nursery, where: str) -> tuple[HTTPServer, TenantReplica]:
    """A listener whose ``/hold`` waits for ``replica.release()``: the edge of a chain, or the replica's own."""
    replica, _, local = await serve_tenant_replica(nursery)
    if where == "listener":
        server: HTTPServer = await nursery.start(functools.partial(serve_http, replica, config=CONFIG))
        return server, replica
    chain = await assemble_local(nursery, {"r0": local})
    edge: HTTPServer = await nursery.start(
        functools.partial(serve_edge, EdgeConfig(proxy=(HOST, chain.proxy_server.port)), listener=CONFIG)
    )
    return edge, replica


@pytest.mark.parametrize("where", ["edge", "listener"])
async def test_drain_two_goaways_refuse_late_streams_and_let_in_flight_ones_finish(
    nursery: trio.Nursery, where: str
) -> None:
    with trio.fail_after(15):
        server, replica = await start(nursery, where)
        async with RawFrames.open(server.port) as raw:
            await raw.send(raw.request(1, b"/hold"))
            while replica.total_in_flight < 1:
                await trio.sleep(0.01)
            server.drain()
            first = await raw.goaway()
            assert first is not None and first.error_code == NO_ERROR and first.last_stream_id == 2**31 - 1
            await raw.send(raw.request(3, b"/"))  # sent before the final GOAWAY: served
            final = await raw.goaway()
            assert final is not None and final.error_code == NO_ERROR and final.last_stream_id == 3
            await raw.send(raw.request(5, b"/"))  # after it: refused
            refused = await raw.until(lambda f: isinstance(f, hf.RstStreamFrame) and f.stream_id == 5)
            assert refused is not None and refused.error_code == REFUSED
            assert raw.status(3) == b"200"
            replica.release()
            done = await raw.until(lambda f: f.stream_id == 1 and "END_STREAM" in f.flags)
            assert done is not None and raw.status(1) == b"200"
            assert await raw.until(lambda f: False) is None  # then the connection closes
        with trio.fail_after(5):
            while server.statistics().connections:
                await trio.sleep(0.01)
        assert replica.arrivals.count("") == 2  # /hold and stream 3, never stream 5


@pytest.mark.parametrize("where", ["edge", "listener"])
async def test_a_stream_stuck_at_the_drain_deadline_is_cancelled(nursery: trio.Nursery, where: str) -> None:
    with trio.fail_after(15):
        server, replica = await start(nursery, where)
        async with RawFrames.open(server.port) as raw:
            await raw.send(raw.request(1, b"/hold"))
            while replica.total_in_flight < 1:
                await trio.sleep(0.01)
            started = trio.current_time()
            await server.aclose(grace=0.5)
            assert trio.current_time() - started >= 0.5
            end = await raw.until(lambda f: f.stream_id == 1 and ("END_STREAM" in f.flags or f.type == 0x3))
            assert end is None or isinstance(end, hf.RstStreamFrame)  # reset, or the connection closed
            assert raw.status(1) is None  # no response was ever sent
        with trio.fail_after(5):
            while replica.cancelled < 1:
                await trio.sleep(0.01)
