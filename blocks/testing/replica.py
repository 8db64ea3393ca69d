"""The demo replica as a process of its own: what an autoscaler starts from a command template.

    python -m blocks.testing.replica --port 8001 --name demo-0
                                   # prints: replica demo-0 listening on http://127.0.0.1:8001

It serves :class:`~blocks.testing.DemoApp` over HTTP/1.1 and h2c on one
port (``GET /``, ``GET /sleep?ms=N``, ``GET /stream?n=N&ms=M``, ... see
:mod:`blocks.testing`). SIGTERM or SIGINT stops it at once, exit code 0;
a port in use is one line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import signal

import trio

from blocks._sync import one_error
from blocks.command import CommandParser, port_number
from blocks.testing._demo import serve_demo_replica


async def main(name: str, host: str, port: int) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals, one_error():
        async with trio.open_nursery() as nursery:
            server = await nursery.start(functools.partial(serve_demo_replica, name, host=host, port=port))
            print(f"replica {name} listening on {server.url}", flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def run() -> None:
    parser = CommandParser(prog="python -m blocks.testing.replica")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=port_number, default=0, help="the port (0: any free one)")
    parser.add_argument("--name", default="replica", help="the name it answers with (x-replica)")
    args = parser.parse_args()
    try:
        trio.run(main, args.name, args.host, args.port)
    except OSError as exc:
        parser.exit(2, f"proxyblocks: error: {exc}\n")


__all__ = [
    "main",
    "run",
]

if __name__ == "__main__":
    run()
