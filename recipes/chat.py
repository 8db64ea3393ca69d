"""Shared chat rooms through the chain: each room is a sticky session, its messages a WebSocket.

Run it:

    python -m recipes.chat                  # prints the URL to open, with a proxy-auth token in it
    python -m recipes.chat --port 8080 --replicas 3 --rooms-per-replica 2

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
worker (keeps the sessions, ends idle ones) -> chat replicas (a page and a
trio-websocket server on one port; the worker reaches them over h2 extended
CONNECT). A replica hosts at most --rooms-per-replica rooms; when all are
full, a new room waits in the proxy's fair queue, then gets a 503.

Ctrl-C (or SIGTERM) drains the chain (open WebSockets get --grace seconds);
a second Ctrl-C stops at once.
"""

from __future__ import annotations

import functools
import secrets
import time

import attrs
import trio

from blocks import (
    Chain,
    CommandParser,
    Keyring,
    SessionConfig,
    TokenIssuer,
    TokenKey,
    TokenVerifier,
    WorkerSessionConfig,
    run_until_signal,
    serve_chain,
    serve_websocket_app,
)
from blocks.command import Operations, at_least, port_number, seconds
from blocks.testing import MAX_MESSAGE, ChatApp

__all__ = ["MAX_MESSAGE", "Chat", "main"]


@attrs.define(eq=False)
class Chat:
    """A running chat chain, as ``main`` reports it to ``task_status``: the chain and its chat apps."""

    chain: Chain
    apps: dict[str, ChatApp]
    issuer: TokenIssuer

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
    replicas: int = 2,
    rooms_per_replica: int = 8,
    idle_timeout: float = 600.0,
    operations: Operations | None = None,
    announce: bool = True,
    task_status: trio.TaskStatus[Chat] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the chat chain; report a :class:`Chat` once the edge takes traffic; run until shut down."""
    if replicas < 1 or rooms_per_replica < 1:
        raise ValueError("--replicas and --rooms-per-replica must be at least 1")
    key = TokenKey.hmac("chat-1", secrets.token_bytes(32))  # a real fleet shares its keys (docs/tokens.md)
    issuer = TokenIssuer(key)
    apps = {f"chat-{i}": ChatApp(f"chat-{i}") for i in range(replicas)}

    async def build(chain: Chain) -> None:
        local = {
            name: await chain.start_replica(
                name, functools.partial(serve_websocket_app, app.websocket, app.page), max_sessions=rooms_per_replica
            )
            for name, app in apps.items()
        }
        await chain.start_worker(local, app="chat", sessions=WorkerSessionConfig(idle_timeout=idle_timeout))
        sessions = SessionConfig(apps={"chat"}, ttl=24 * 3600)
        verifier = TokenVerifier(Keyring([key]))
        await chain.start_proxy(sessions=sessions, session_issuer=issuer, session_verifier=verifier)
        await chain.start_edge(port=port)

    async with trio.open_nursery() as nursery:
        chat = Chat(await nursery.start(functools.partial(serve_chain, build, operations=operations)), apps, issuer)
        if announce:
            print(f"chat on {chat.url}/#auth={chat.auth_token()}", flush=True)
        task_status.started(chat)


def run() -> None:
    parser = CommandParser(prog="python -m recipes.chat", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=port_number, default=0, help="edge port (0: any free port)")
    parser.add_argument("--replicas", type=at_least(1), default=2, help="chat replicas behind the worker")
    parser.add_argument("--rooms-per-replica", type=at_least(1), default=8, help="sessions (rooms) one replica hosts")
    parser.add_argument("--grace", type=seconds, default=5.0, help="seconds requests in flight get on shutdown")
    args = parser.parse_args()
    start = functools.partial(main, port=args.port, replicas=args.replicas, operations=args.operations)
    start = functools.partial(start, rooms_per_replica=args.rooms_per_replica)
    run_until_signal(start, grace=args.grace)


if __name__ == "__main__":
    run()
