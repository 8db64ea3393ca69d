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

Ctrl-C (or SIGTERM) stops everything.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import secrets
import signal
import time

import attrs
import trio
import trio_websocket

from blocks import (
    SESSION_HEADER,
    EdgeConfig,
    HTTPServer,
    Keyring,
    LocalReplica,
    Proxy,
    Replica,
    Request,
    Response,
    RouteTable,
    SessionConfig,
    TokenIssuer,
    TokenKey,
    TokenVerifier,
    Worker,
    WorkerSessionConfig,
    serve_edge,
    serve_proxy,
    serve_websocket_app,
    serve_worker,
    text_response,
)

HOST = "127.0.0.1"
MAX_MESSAGE = 4096  # characters of one chat message
HISTORY = 100  # messages a room keeps for those who (re)join
MAX_ROOMS = 1000  # rooms a replica remembers; the least recently used go first
OUTBOX = 64  # messages queued to one member before it counts as too slow and is closed


# -- the chat app (one per replica) -------------------------------------------------------------


class Room:
    """The members' outboxes and the last messages. Bounded: HISTORY messages, OUTBOX per member."""

    def __init__(self) -> None:
        self.members: set[trio.MemorySendChannel[str]] = set()
        self.history: collections.deque[dict[str, str]] = collections.deque(maxlen=HISTORY)

    def broadcast(self, message: dict[str, str]) -> None:
        self.history.append(message)
        data = json.dumps(message)
        for outbox in list(self.members):
            try:
                outbox.send_nowait(data)
            except trio.WouldBlock:  # a member that does not keep up is dropped, not waited for
                self.members.discard(outbox)
                outbox.close()


@attrs.define(eq=False)
class ChatApp:
    """A chat replica: ``GET /`` is the page, ``/ws`` the room's WebSocket (the room is the session)."""

    name: str
    rooms: collections.OrderedDict[str, Room] = attrs.field(factory=collections.OrderedDict)

    def room(self, session: str) -> Room:
        room = self.rooms.get(session)
        if room is None:
            room = self.rooms[session] = Room()
            if len(self.rooms) > MAX_ROOMS:
                self.rooms.popitem(last=False)
        self.rooms.move_to_end(session)
        return room

    async def page(self, request: Request) -> Response:
        if request.path.split(b"?")[0] != b"/":
            return text_response(404, "not found\n")
        return text_response(
            200, PAGE, [(b"content-type", b"text/html; charset=utf-8"), (b"x-replica", self.name.encode())]
        )

    async def websocket(self, request: trio_websocket.WebSocketRequest) -> None:
        session = next((v.decode() for k, v in request.headers if k.lower() == SESSION_HEADER), None)
        if request.path != "/ws" or session is None:
            await request.reject(404 if request.path != "/ws" else 403, body=b"join a room first\n")
            return
        ws = await request.accept()
        room = self.room(session)
        await ws.send_message(
            json.dumps({"type": "hello", "room": session, "replica": self.name, "history": list(room.history)})
        )
        outbox, inbox = trio.open_memory_channel[str](OUTBOX)
        room.members.add(outbox)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_deliver, ws, inbox, nursery.cancel_scope)
                while True:
                    text = await ws.get_message()
                    if not isinstance(text, str) or len(text) > MAX_MESSAGE:
                        await ws.aclose(1009, "text messages of up to 4096 characters")
                        break
                    room.broadcast({"type": "message", "text": text, "replica": self.name})
                nursery.cancel_scope.cancel()
        except* trio_websocket.ConnectionClosed:
            pass  # the member left (or was dropped as too slow)
        finally:
            room.members.discard(outbox)
            outbox.close()


async def _deliver(
    ws: trio_websocket.WebSocketConnection, inbox: trio.MemoryReceiveChannel[str], scope: trio.CancelScope
) -> None:
    async with inbox:
        async for data in inbox:
            await ws.send_message(data)
    scope.cancel()  # dropped as too slow: the member reconnects and gets the history
    await ws.aclose(1013, "too slow")


PAGE = """<!doctype html>
<meta charset="utf-8">
<title>proxyblocks chat</title>
<style>
body { font: 16px system-ui; margin: 2em; max-width: 40em }
#messages { min-height: 10em; border: 1px solid #ccc; padding: .5em }
</style>
<h1>proxyblocks chat</h1>
<p id="status">not in a room</p>
<p><button id="create">New room</button> share: <a id="share"></a></p>
<ul id="messages"></ul>
<form id="form"><input id="text" autocomplete="off" maxlength="4096"> <button id="send">Send</button></form>
<script>
const COOKIE = "proxyblocks-session";
const params = new URLSearchParams(location.hash.slice(1));
const auth = params.get("auth");
const $ = (id) => document.getElementById(id);
let ws = null;

function token() {
  const match = document.cookie.match(new RegExp("(?:^|; )" + COOKIE + "=([^;]*)"));
  return match ? match[1] : null;
}
function add(message) {
  const item = document.createElement("li");
  item.textContent = message.text;
  $("messages").append(item);
}
function connect() {
  const current = token();
  if (!current) return;
  $("share").href = location.origin + "/#join=" + current;
  $("share").textContent = "link";
  ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/ws");
  ws.onmessage = (event) => {
    const message = JSON.parse(event.data);
    if (message.type === "hello") {
      $("messages").replaceChildren();
      $("status").textContent = "room " + message.room + " on " + message.replica;
      $("status").dataset.room = message.room;
      $("status").dataset.replica = message.replica;
      message.history.forEach(add);
    } else {
      add(message);
    }
  };
  ws.onclose = () => { $("status").textContent = "disconnected"; delete $("status").dataset.room; };
}
$("create").onclick = async () => {
  const response = await fetch("/.proxyblocks/sessions", {method: "POST", headers: {authorization: "Bearer " + auth}});
  if (response.status !== 201) { $("status").textContent = "no room: " + response.status; return; }
  if (ws) ws.close();
  connect();  // the answer set the session cookie
};
$("form").onsubmit = (event) => {
  event.preventDefault();
  if (ws && ws.readyState === WebSocket.OPEN && $("text").value) { ws.send($("text").value); $("text").value = ""; }
};
if (params.get("join")) {
  document.cookie = COOKIE + "=" + params.get("join") + "; path=/; SameSite=Strict";
  history.replaceState(null, "", location.pathname);
}
connect();
</script>
"""


# -- the topology -------------------------------------------------------------------------------


@attrs.define(eq=False)
class Chat:
    """A running chat chain, as ``main`` reports it to ``task_status``."""

    edge: HTTPServer
    proxy: Proxy
    worker: Worker
    apps: dict[str, ChatApp]
    routes: RouteTable
    issuer: TokenIssuer
    _cancel: trio.CancelScope

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.edge.port}"

    def auth_token(self, tenant: str = "demo", ttl: float = 24 * 3600) -> str:
        """A proxy-auth token for the chat app: what a login service would hand out."""
        return self.issuer.mint(app="chat", tenant=tenant, now=time.time(), ttl=ttl)

    def stop(self) -> None:
        self._cancel.cancel()


async def main(
    *,
    port: int = 0,
    replicas: int = 2,
    rooms_per_replica: int = 8,
    idle_timeout: float = 600.0,
    announce: bool = True,
    task_status: trio.TaskStatus[Chat] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the chat chain; report a :class:`Chat` once the edge takes traffic; run until cancelled."""
    if replicas < 1 or rooms_per_replica < 1:
        raise ValueError("--replicas and --rooms-per-replica must be at least 1")
    key = TokenKey.hmac("chat-1", secrets.token_bytes(32))  # a real fleet shares its keys (docs/tokens.md)
    issuer = TokenIssuer(key)
    async with trio.open_nursery() as nursery:
        apps: dict[str, ChatApp] = {}
        local: dict[str, LocalReplica] = {}
        for i in range(replicas):
            name = f"chat-{i}"
            app = apps[name] = ChatApp(name)
            server = await nursery.start(functools.partial(serve_websocket_app, app.websocket, app.page))
            local[name] = LocalReplica((HOST, server.port), "h2", max_sessions=rooms_per_replica)
        worker_server, worker = await nursery.start(
            functools.partial(serve_worker, local, sessions=WorkerSessionConfig(idle_timeout=idle_timeout))
        )
        routes = RouteTable.build(
            {"*": "chat"},
            {
                "chat": [
                    Replica(name=name, worker=(HOST, worker_server.port), address=r.address)
                    for name, r in local.items()
                ]
            },
        )
        proxy_server, proxy = await nursery.start(
            functools.partial(
                serve_proxy,
                routes,
                sessions=SessionConfig(apps={"chat"}, ttl=24 * 3600),
                session_issuer=issuer,
                session_verifier=TokenVerifier(Keyring([key])),
            )
        )
        edge = await nursery.start(
            functools.partial(serve_edge, EdgeConfig(proxy=(HOST, proxy_server.port)), port=port)
        )
        chat = Chat(edge, proxy, worker, apps, routes, issuer, nursery.cancel_scope)
        if announce:
            print(f"chat on {chat.url}/#auth={chat.auth_token()}", flush=True)
        task_status.started(chat)


async def _run(args: argparse.Namespace) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            chat: Chat = await nursery.start(
                functools.partial(
                    main, port=args.port, replicas=args.replicas, rooms_per_replica=args.rooms_per_replica
                )
            )
            async for _ in signals:
                break
            chat.stop()
    print("stopped", flush=True)


def run() -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.chat", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="edge port (0: any free port)")
    parser.add_argument("--replicas", type=int, default=2, help="chat replicas behind the worker")
    parser.add_argument("--rooms-per-replica", type=int, default=8, help="sessions (rooms) one replica hosts")
    trio.run(_run, parser.parse_args())


if __name__ == "__main__":
    run()
