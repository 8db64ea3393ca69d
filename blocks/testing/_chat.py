"""The chat demo app: shared rooms over WebSockets, one room per sticky session.

:class:`ChatApp` is a replica's app: ``GET /`` serves a page, ``/ws`` the
room's WebSocket, where the room is the session the proxy routed the
connection by (``x-proxyblocks-session``). Serve it with
``serve_websocket_app(app.websocket, app.page)``; ``recipes/chat.py`` puts it
behind the chain. Bounded everywhere: a message is at most
:data:`MAX_MESSAGE` characters, a room keeps :data:`HISTORY` messages, a
replica :data:`MAX_ROOMS` rooms, and a member that does not keep up with
:data:`OUTBOX` queued messages is dropped rather than slowing the room.
"""

from __future__ import annotations

import collections
import json

import attrs
import trio
import trio_websocket

from blocks.http import Request, Response, text_response
from blocks.sessions import SESSION_HEADER

MAX_MESSAGE = 4096  # characters of one chat message
HISTORY = 100  # messages a room keeps for those who (re)join
MAX_ROOMS = 1000  # rooms a replica remembers; the least recently used go first
OUTBOX = 64  # messages queued to one member before it counts as too slow and is closed


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
