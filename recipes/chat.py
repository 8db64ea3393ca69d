"""Shared chat rooms through the chain: each room is a sticky session, its messages a WebSocket.

Run it:

    python -m recipes.chat                  # prints the URL to open, with a proxy-auth token in it
    python -m recipes.chat --port 8080 --replicas 3 --rooms-per-replica 2

In front of your own chat servers instead of the demo ones (any HTTP server
that takes WebSockets; a room is the ``x-proxyblocks-session`` field of each
request; ``tests/asgi_chat.py`` is one, a plain ASGI app):

    python -m hypercorn tests.asgi_chat:app --bind 127.0.0.1:9001 &
    python -m hypercorn tests.asgi_chat:app --bind 127.0.0.1:9002 &
    python -m recipes.chat --replica http://127.0.0.1:9001 --replica http://127.0.0.1:9002

or started by the autoscaler as the rooms need them, none before the first:

    python -m recipes.chat --command 'python -m hypercorn tests.asgi_chat:app --bind {host}:{port} -w 0'

Poke it:

    open the printed http://127.0.0.1:PORT/#auth=TOKEN in a browser, press
    "New room", open the "share" link in another browser (or a private
    window): both are in one room, on one replica, and see each other's
    messages live. Reload either page: it rejoins the same room on the same
    replica, with the room's history.

    curl -i -X POST -H "authorization: Bearer TOKEN" http://127.0.0.1:PORT/.proxyblocks/sessions
    curl -i -H "proxyblocks-session: SESSION_TOKEN" http://127.0.0.1:PORT/       # the room's replica answers

The topology: edge (h1 and h2; WebSockets arrive as h1 Upgrade) -> proxy
(sessions for the ``chat`` app: a start needs the proxy-auth token, a session
token then routes every request and WebSocket of the room to its replica) ->
worker (keeps the sessions, ends idle ones) -> chat replicas (the demo's: a
page and a trio-websocket server on one port, reached over h2 extended
CONNECT; yours: as their URL says, ``http://`` by Upgrade). A replica hosts
at most --rooms-per-replica rooms; when all are full, a new room waits in
the proxy's fair queue, then gets a 503. With --command, the autoscaler
keeps rooms / --rooms-per-replica replicas (rounded up) and one spare while
any room is open, within --min-replicas and --max-replicas; a room started
with none waits for the first.

Ctrl-C (or SIGTERM) drains the chain (open WebSockets get --grace seconds);
a second Ctrl-C stops at once.
"""

from __future__ import annotations

import argparse
import functools
import secrets
import time
from collections.abc import Sequence

import attrs
import trio

from blocks import Chain, CommandParser, UpstreamConfig, run_until_signal, serve_chain, serve_websocket_app
from blocks.autoscaler import AutoscalePolicy, Autoscaler, ColdStartGate, ReplicaTemplate, ScalingConfig
from blocks.command import Operations, at_least, port_number, seconds
from blocks.sessions import SessionConfig, WorkerSessionConfig
from blocks.testing import MAX_MESSAGE, ChatApp
from blocks.tokens import Keyring, TokenIssuer, TokenKey, TokenVerifier
from blocks.topology import replica_from_url, replica_url

__all__ = ["MAX_MESSAGE", "Chat", "main"]


@attrs.define(eq=False)
class Chat:
    """A running chat chain, as ``main`` reports it to ``task_status``: the chain, its demo chat apps
    (none with your servers) and, with a ``command``, the autoscaler that runs them."""

    chain: Chain
    apps: dict[str, ChatApp]
    issuer: TokenIssuer
    scaler: Autoscaler | None = None

    @property
    def url(self) -> str:
        return self.chain.url

    def auth_token(self, tenant: str = "demo", ttl: float = 24 * 3600) -> str:
        """A proxy-auth token for the chat app: what a login service would hand out."""
        return self.issuer.mint(app="chat", tenant=tenant, now=time.time(), ttl=ttl)

    async def shutdown(self, grace: float) -> None:
        await self.chain.shutdown(grace)

    def stop(self) -> None:
        self.chain.cancel()


async def main(
    *,
    port: int = 0,
    replicas: int | None = None,
    replica_urls: Sequence[str] = (),
    command: str | None = None,
    protocol: str | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    rooms_per_replica: int = 8,
    idle_timeout: float = 600.0,
    operations: Operations | None = None,
    announce: bool = True,
    task_status: trio.TaskStatus[Chat] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the chat chain; report a :class:`Chat` once the edge takes traffic; run until shut down.
    Each setting is the flag of its name; a mix of them that says two things is a ``ValueError``."""
    if sum(map(bool, (replicas, replica_urls, command))) > 1:
        raise ValueError("one of --replicas (demo servers), --replica (your servers) or --command (the autoscaler's)")
    if not command and (protocol, min_replicas, max_replicas) != (None, None, None):
        raise ValueError("--protocol, --min-replicas and --max-replicas go with --command")
    key = TokenKey.hmac("chat-1", secrets.token_bytes(32))  # a real fleet shares its keys (docs/tokens.md)
    issuer, verifier = TokenIssuer(key), TokenVerifier(Keyring([key]))
    apps = {} if replica_urls or command else {f"chat-{i}": ChatApp(f"chat-{i}") for i in range(replicas or 2)}
    local = {f"chat-{i}": replica_from_url(url, max_sessions=rooms_per_replica) for i, url in enumerate(replica_urls)}
    template = ReplicaTemplate(command=command, protocol=protocol or "h1", domains=["*"]) if command else None
    limits = {"min_replicas": min_replicas or 0, "max_replicas": max_replicas or 5, "buffer_replicas": 1}
    scaling = ScalingConfig(target_concurrency=rooms_per_replica, unit="sessions", up_window=2.0, **limits)
    scalers: list[Autoscaler] = []

    async def build(chain: Chain) -> None:
        for name, app in apps.items():
            serve = functools.partial(serve_websocket_app, app.websocket, app.page)
            local[name] = await chain.start_replica(name, serve, max_sessions=rooms_per_replica)
        sessions = WorkerSessionConfig(idle_timeout=idle_timeout)
        upstream = UpstreamConfig(h2_idle_timeout=4.0)  # idle out before Hypercorn's and uvicorn's 5 s keep-alive
        await chain.start_worker(local, app=None if template else "chat", sessions=sessions, upstream=upstream)
        if template:
            scalers.append(await chain.start_autoscaler(AutoscalePolicy({"chat": scaling}), {"chat": template}))
        config = SessionConfig(apps={"chat"}, ttl=24 * 3600, max_per_replica=rooms_per_replica)
        features = [ColdStartGate(scaler, chain.cache) for scaler in scalers]
        await chain.start_proxy(features=features, sessions=config, session_issuer=issuer, session_verifier=verifier)
        await chain.start_edge(port=port)

    async with trio.open_nursery() as nursery:
        chain = await nursery.start(functools.partial(serve_chain, build, operations=operations))
        chat = Chat(chain, apps, issuer, *scalers)
        if announce:
            print(f"chat on {chat.url}/#auth={chat.auth_token()}", flush=True)
        task_status.started(chat)


def run() -> None:
    parser = CommandParser(prog="python -m recipes.chat", description=__doc__.splitlines()[0])
    flag = functools.partial(parser.add_argument, default=argparse.SUPPRESS)  # (not given: main's default)
    flag("--port", type=port_number, help="edge port (default: 0, any free port)")
    flag("--replicas", type=at_least(1), help="demo chat replicas behind the worker (default: 2)")
    flag("--replica", dest="replica_urls", action="append", type=replica_url, metavar="URL", help="your chat server")
    flag("--command", help="a chat server's command line, the autoscaler's: {port}, {host}, {name}, {app}")
    flag("--protocol", choices=["h1", "h2"], help="what the worker speaks to --command's servers (default: h1)")
    flag("--min-replicas", type=at_least(0), help="--command: never fewer (default: 0, scale to zero)")
    flag("--max-replicas", type=at_least(1), help="--command: never more (default: 5)")
    flag("--rooms-per-replica", type=at_least(1), help="sessions (rooms) one replica hosts (default: 8)")
    parser.add_argument("--grace", type=seconds, default=5.0, help="seconds requests in flight get on shutdown")
    settings = vars(parser.parse_args())
    grace, *_ = (settings.pop(name) for name in ("grace", "config", "log_level"))
    run_until_signal(functools.partial(main, **settings), grace=grace)


if __name__ == "__main__":
    run()
