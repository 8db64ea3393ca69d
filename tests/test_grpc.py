"""gRPC through the chain, as a user runs it: grpcio on both ends.

The replica is a plain grpcio server in a process of its own
(``tests/grpc_replica.py``), put behind ``python -m recipes.chain --replica
h2c://...`` run as a subprocess; the client is grpcio's, on an insecure
channel to the edge. Every shape of call crosses edge -> proxy -> worker:
unary, server streaming, bidirectional streaming (interleaved, and with
messages far larger than any h2 window), deadlines (``grpc-timeout``) and
cancellation (RST_STREAM) reaching the replica, a non-zero ``grpc-status``
with its message, initial and trailing metadata.

grpcio's sync API runs in a worker thread per call; every call has a
deadline, so a thread never outlives its test by more than that.
Loopback only, port 0, every wait bounded.
"""

from __future__ import annotations

import functools
import queue
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import trio
from support import chain_recipe, child_process, wait_books_balanced

from blocks.topology import replica_from_url
from recipes import chain as recipe

CALL = 10.0  # every call's deadline, so that a thread waiting on a wedged call ends
REPLICA = [sys.executable, "-u", "tests/grpc_replica.py"]
RAW = b"\x00\x01\xfe\xff"  # tests/grpc_replica.py's x-raw-bin trailer


@asynccontextmanager
async def grpc_replica() -> AsyncIterator[tuple[trio.Process, str]]:
    """tests/grpc_replica.py as a process of its own: the process and its ``h2c://`` URL."""
    async with child_process(REPLICA, r"^grpc replica listening on (h2c://\S+)$") as (process, match):
        yield process, match.group(1)


def identity(data: bytes) -> bytes:
    return data


class GrpcClient:
    """grpcio's client on an insecure channel to the edge at ``url`` (``http://host:port``); raw bytes messages."""

    def __init__(self, url: str) -> None:
        self.channel = grpc.insecure_channel(url.removeprefix("http://"), options=[("grpc.enable_http_proxy", 0)])

    def method(self, name: str, kind: str = "unary_unary") -> Any:
        """A callable for ``test.Echo/name``; ``kind`` is the channel's method (``unary_stream``, ...)."""
        make = getattr(self.channel, kind)
        return make(f"/test.Echo/{name}", request_serializer=identity, response_deserializer=identity)

    async def call(self, name: str, request: bytes, **kwargs: Any) -> Any:
        """A unary call in a worker thread: its reply (``timeout`` defaults to ``CALL``)."""
        return await in_thread(self.method(name), request, timeout=kwargs.pop("timeout", CALL), **kwargs)

    async def error(self, name: str, request: bytes, **kwargs: Any) -> grpc.RpcError:
        """A unary call that must fail: the error the client raised."""
        try:
            await self.call(name, request, **kwargs)
        except grpc.RpcError as exc:
            return exc
        raise AssertionError(f"{name} succeeded")

    async def slow_calls(self) -> tuple[int, int]:
        """The replica's ``Slow`` calls: how many wait now, how many ended."""
        waiting, ended = (await self.call("SlowCalls", b"")).split()
        return int(waiting), int(ended)

    async def wait_slow_calls(self, expected: tuple[int, int]) -> None:
        while await self.slow_calls() != expected:
            await trio.sleep(0.02)


async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(functools.partial(function, *args, **kwargs), abandon_on_cancel=True)


@asynccontextmanager
async def grpc_chain() -> AsyncIterator[tuple[GrpcClient, trio.Process]]:
    """The gRPC replica behind ``python -m recipes.chain``: a client of the edge, and the replica's process."""
    async with grpc_replica() as (replica, url), chain_recipe(url) as edge:
        client = GrpcClient(edge)
        try:
            yield client, replica
        finally:
            client.channel.close()


def converse(client: GrpcClient, messages: Iterable[bytes]) -> list[bytes]:
    """A bidirectional call: send one message, wait for its echo, then send the next."""
    outbox: queue.Queue[bytes | None] = queue.Queue()

    def requests() -> Iterator[bytes]:
        while (message := outbox.get()) is not None:
            yield message

    replies = client.method("Chat", "stream_stream")(requests(), timeout=CALL)
    heard = []
    for message in messages:
        outbox.put(message)
        heard.append(next(replies))  # before the next is sent: the chain must not wait for the request's end
    outbox.put(None)
    assert list(replies) == []
    assert replies.code() == grpc.StatusCode.OK
    return heard


async def test_unary_server_streaming_and_bidirectional_calls_cross_the_chain() -> None:
    with trio.fail_after(60):
        async with grpc_chain() as (client, _):
            reply, call = await in_thread(client.method("Unary").with_call, b"hello", timeout=CALL)
            assert reply == b"HELLO"
            assert call.code() == grpc.StatusCode.OK
            assert "server-timing" in dict(call.initial_metadata())  # it went through the chain's hops

            stream = client.method("Count", "unary_stream")
            assert await in_thread(lambda: list(stream(b"1000", timeout=CALL))) == [b"%d" % i for i in range(1000)]

            words = [b"one", b"two", b"three", b"four"]
            assert await in_thread(converse, client, words) == words
            # Messages far larger than an h2 window, both ways, on every hop.
            big = [bytes([n]) * (1 << 20) + bytes(range(256)) for n in range(3)]
            assert await in_thread(converse, client, big) == big
            assert await client.call("Unary", big[0]) == big[0].upper()


async def test_a_deadline_reaches_the_replica_and_expires_as_deadline_exceeded_without_wedging_the_chain() -> None:
    with trio.fail_after(60):
        async with grpc_chain() as (client, _):
            left = await client.call("Remaining", b"", timeout=5)
            assert left != b"none" and 1 < float(left) < 6  # grpc-timeout arrived
            error = await client.error("Slow", b"", timeout=0.5)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await client.wait_slow_calls((0, 1))  # the replica's call ended too
            assert await client.call("Unary", b"after") == b"AFTER"

            # A call with no deadline that the client cancels: only the chain's RST_STREAM tells the replica.
            future = client.method("Slow").future(b"")
            await client.wait_slow_calls((1, 1))
            assert future.cancel()
            await client.wait_slow_calls((0, 2))
            assert await client.call("Unary", b"still") == b"STILL"


async def test_a_non_zero_status_and_its_message_arrive_intact() -> None:
    with trio.fail_after(60):
        async with grpc_chain() as (client, _):
            for who in ("alice", "zoë, 100% sure"):  # grpc-message is percent-encoded UTF-8
                error = await client.error("Fail", who.encode())
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED
                assert error.details() == f"no entry for {who}"
            assert await client.call("Unary", b"next") == b"NEXT"


async def test_initial_and_trailing_metadata_arrive_intact() -> None:
    with trio.fail_after(60):
        async with grpc_chain() as (client, _):
            reply, call = await in_thread(
                client.method("Metadata").with_call, b"", timeout=CALL, metadata=[("x-echo-tenant", "alice")]
            )
            assert reply == b"ok"
            chain = {"server-timing", "x-request-id", "traceparent"}  # what the chain adds on the way back
            initial = [(key, value) for key, value in call.initial_metadata() if key not in chain]
            assert initial == [("x-initial", "hello"), ("x-echo-tenant", "alice")]
            assert list(call.trailing_metadata()) == [("x-trailer", "bye"), ("x-raw-bin", RAW)]
            assert call.code() == grpc.StatusCode.OK


async def test_a_replica_that_is_gone_is_unavailable_at_once() -> None:
    with trio.fail_after(60):
        async with grpc_chain() as (client, replica):
            assert await client.call("Unary", b"up") == b"UP"
            replica.terminate()
            await replica.wait()
            error = await client.error("Unary", b"down")
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error


async def test_calls_that_end_early_leave_no_stream_or_byte_behind_on_any_hop(nursery: trio.Nursery) -> None:
    """The recipe's chain in this process, to read every h2 connection's books once the calls are over."""
    with trio.fail_after(60):
        async with grpc_replica() as (_, url):
            chain: recipe.Chain = await nursery.start(
                functools.partial(recipe.main, replica_urls=[url], announce=False)
            )
            client = GrpcClient(chain.url)
            try:
                error = await client.error("Slow", b"", timeout=0.3)
                assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                future = client.method("Slow").future(b"")
                await client.wait_slow_calls((1, 1))
                future.cancel()
                await client.wait_slow_calls((0, 2))
                assert (await client.error("Fail", b"bob")).code() == grpc.StatusCode.PERMISSION_DENIED
                big = [bytes(1 << 20)] * 2
                assert await in_thread(converse, client, big) == big
            finally:
                client.channel.close()
            servers = {"edge": chain.edge, "proxy": chain.proxy_server, "worker": chain.worker_server}
            replica = f"worker -> {replica_from_url(url).address}"
            await wait_books_balanced(servers, links=["edge -> proxy", "proxy -> worker", replica])
            await chain.shutdown(5)
