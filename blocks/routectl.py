"""routectl: read and change routes in a route file or in etcd.

    python -m blocks.routectl --store routes.toml put-domain chat.example chat
    python -m blocks.routectl --etcd http://127.0.0.1:2379 put-replica chat r1 \\
        --worker 127.0.0.1:9001 --address 127.0.0.1:8001 [--protocol h2] [--capacity 8] [--state live]
    python -m blocks.routectl --etcd http://127.0.0.1:2379 delete apps/chat/replicas/r1
    python -m blocks.routectl --store routes.toml list

With ``--store FILE`` it edits a route file (TOML, or JSON for ``*.json``;
created by the first put), which a proxy running ``EmbeddedStore.watch_file``
picks up at its next poll. The file is rewritten whole and atomically, in the
documented layout: comments are not kept, and two routectl runs at the same
instant may lose one's change (the last rename wins). With ``--etcd URL`` it
writes keys under ``--prefix`` in etcd, which every proxy watching that
prefix sees within a moment.

``list`` prints one ``KEY VALUE`` line per key, sorted, after a ``#`` line
saying where from (and, for etcd, at which revision). Exit status: 0 done, 1
the store failed or there was no such key, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from blocks.routing import (
    REPLICA_STATES,
    encode_domain,
    encode_replica,
    parse_address,
    route_key_for_domain,
    route_key_for_replica,
)
from blocks.sources import EtcdSource, RouteFileError, SourceError, read_route_file, write_route_file


class CommandError(Exception):
    """What routectl reports on stderr before exiting 1."""


def _host_port(text: str) -> str:
    try:
        parse_address(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected host:port ([v6]:port for IPv6), got {text!r}") from None
    return text


def _capacity(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _change(args: argparse.Namespace) -> tuple[str, bytes | None]:
    """The key the command writes, and its new value (``None``: delete)."""
    try:
        if args.command == "put-domain":
            return route_key_for_domain(args.domain), encode_domain(args.app)
        if args.command == "put-replica":
            value = encode_replica(
                worker=args.worker,
                address=args.address,
                protocol=args.protocol,
                capacity=args.capacity,
                state=args.state,
            )
            return route_key_for_replica(args.app, args.name), value
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    return args.key, None


# -- the two stores -----------------------------------------------------------------------------


def _run_file(args: argparse.Namespace) -> list[str]:
    path = Path(args.store)
    if args.command == "list":
        return [f"# {path}", *(f"{key} {value.decode()}" for key, value in sorted(read_route_file(path).items()))]
    key, value = _change(args)
    routes = read_route_file(path) if path.exists() or value is None else {}
    if value is None:
        if routes.pop(key, None) is None:
            raise CommandError(f"no such key {key} in {path}")
        write_route_file(path, routes)
        return [f"deleted {key}"]
    routes[key] = value
    write_route_file(path, routes)
    return [f"put {key}"]


async def _run_etcd(args: argparse.Namespace) -> list[str]:
    etcd = EtcdSource(args.etcd, prefix=args.prefix, request_timeout=args.timeout)
    if args.command == "list":
        revision, routes = await etcd.snapshot()
        return [f"# {etcd.url} {args.prefix} revision {revision}"] + [
            f"{key} {value.decode(errors='replace')}" for key, value in sorted(routes.items())
        ]
    key, value = _change(args)
    if value is None:
        if await etcd.get(key) is None:
            raise CommandError(f"no such key {key} under {args.prefix!r}")
        return [f"deleted {key} at revision {await etcd.delete(key)}"]
    return [f"put {key} at revision {await etcd.put(key, value)}"]


# -- the command line -------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m blocks.routectl",
        description="Read and change proxyblocks routes in a route file or in etcd.",
    )
    where = top.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", metavar="FILE", help="a route file (TOML, or JSON if it ends in .json)")
    where.add_argument("--etcd", metavar="URL", help="an etcd client URL, e.g. http://127.0.0.1:2379")
    top.add_argument("--prefix", default="proxyblocks/", help="the etcd key prefix (default: proxyblocks/)")
    top.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for etcd (default: 5)")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    domain = commands.add_parser("put-domain", help="route DOMAIN (host, host:port or *) to APP")
    domain.add_argument("domain")
    domain.add_argument("app")

    replica = commands.add_parser("put-replica", help="add or change replica NAME of APP")
    replica.add_argument("app")
    replica.add_argument("name")
    replica.add_argument("--worker", required=True, type=_host_port, help="the worker in front of it, host:port")
    replica.add_argument("--address", required=True, type=_host_port, help="the replica, as the worker sees it")
    replica.add_argument(
        "--protocol", choices=("h2", "h1", "https"), default="h2", help="worker -> replica (default: h2)"
    )
    replica.add_argument("--capacity", type=_capacity, default=0, help="requests at once, 0 = unknown (default)")
    replica.add_argument("--state", choices=REPLICA_STATES, default="live", help="default: live")

    delete = commands.add_parser("delete", help="delete KEY (domains/<domain> or apps/<app>/replicas/<name>)")
    delete.add_argument("key")

    commands.add_parser("list", help="print every key and value")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parser()
    args = arguments.parse_args(argv)
    if args.etcd is not None:
        try:
            EtcdSource(args.etcd)
        except ValueError as exc:
            arguments.error(str(exc))
    try:
        lines = _run_file(args) if args.store is not None else trio.run(_run_etcd, args)
    except (CommandError, RouteFileError, SourceError) as exc:
        print(f"routectl: error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


__all__ = [
    "CommandError",
    "main",
    "parser",
]

if __name__ == "__main__":
    sys.exit(main())
