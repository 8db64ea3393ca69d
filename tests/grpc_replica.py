"""A plain grpcio server, run as a separate process: a replica that is not part of the project.

    python tests/grpc_replica.py     # prints: grpc replica listening on h2c://127.0.0.1:PORT

No generated code: generic handlers with raw bytes in and out, so a message
is its bytes. The service ``test.Echo``:

- ``Unary``: the request, upper-cased;
- ``Count``: the request is a number N (ASCII); N messages ``0``, ``1``, ... ``N-1``;
- ``Chat``: each request echoed as it arrives (bidirectional);
- ``Remaining``: the seconds left before the call's deadline (ASCII), ``none`` without one;
- ``Slow``: waits until the call ends, cancelled or past its deadline (at most 60 s);
- ``SlowCalls``: ``WAITING ENDED``, how many ``Slow`` calls wait now and how many ended (ASCII);
- ``Fail``: aborts with ``PERMISSION_DENIED`` and the details ``no entry for <request>``;
- ``Metadata``: initial metadata (``x-initial: hello``, and every ``x-echo-*`` the client
  sent), the reply ``ok``, then trailing metadata (``x-trailer: bye``, ``x-raw-bin`` with
  bytes).

SIGTERM stops it at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc

SERVICE = "test.Echo"
RAW = b"\x00\x01\xfe\xff"
waiting = 0
ended = 0
lock = threading.Lock()


def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request.upper()


def count(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for i in range(int(request)):
        yield str(i).encode()


def chat(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from requests


def remaining(request: bytes, context: grpc.ServicerContext) -> bytes:
    left = context.time_remaining()
    return b"none" if left is None else f"{left:.3f}".encode()


def slow(request: bytes, context: grpc.ServicerContext) -> bytes:
    global waiting, ended
    done = threading.Event()
    if not context.add_callback(done.set):  # it runs when the RPC ends: cancelled or past its deadline
        done.set()  # it has ended already
    with lock:
        waiting += 1
    done.wait(60)
    with lock:
        waiting -= 1
        ended += 1
    return b"too late"


def slow_calls(request: bytes, context: grpc.ServicerContext) -> bytes:
    with lock:
        return f"{waiting} {ended}".encode()


def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode.PERMISSION_DENIED, f"no entry for {request.decode()}")
    raise AssertionError("abort raises")


def metadata(request: bytes, context: grpc.ServicerContext) -> bytes:
    echoed = [(key, value) for key, value in context.invocation_metadata() if key.startswith("x-echo-")]
    context.send_initial_metadata([("x-initial", "hello"), *echoed])
    context.set_trailing_metadata([("x-trailer", "bye"), ("x-raw-bin", RAW)])
    return b"ok"


def identity(data: bytes) -> bytes:
    return data


def handlers() -> grpc.GenericRpcHandler:
    def raw(kind: Callable[..., grpc.RpcMethodHandler], behaviour: Callable[..., Any]) -> grpc.RpcMethodHandler:
        return kind(behaviour, request_deserializer=identity, response_serializer=identity)

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": raw(grpc.unary_unary_rpc_method_handler, unary),
            "Count": raw(grpc.unary_stream_rpc_method_handler, count),
            "Chat": raw(grpc.stream_stream_rpc_method_handler, chat),
            "Remaining": raw(grpc.unary_unary_rpc_method_handler, remaining),
            "Slow": raw(grpc.unary_unary_rpc_method_handler, slow),
            "SlowCalls": raw(grpc.unary_unary_rpc_method_handler, slow_calls),
            "Fail": raw(grpc.unary_unary_rpc_method_handler, fail),
            "Metadata": raw(grpc.unary_unary_rpc_method_handler, metadata),
        },
    )


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((handlers(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    signal.signal(signal.SIGTERM, lambda *_: server.stop(0))
    print(f"grpc replica listening on h2c://127.0.0.1:{port}", flush=True)
    server.wait_for_termination()
    sys.exit(0)


if __name__ == "__main__":
    main()
