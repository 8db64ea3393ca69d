"""A chat server of your own, as the chat recipe's replicas: a plain ASGI app (asyncio, the standard library only).

    python -m hypercorn tests.asgi_chat:app --bind 127.0.0.1:9001       # logs: Running on http://127.0.0.1:9001
    python -m recipes.chat --replica h2c://127.0.0.1:9001 --replica http://127.0.0.1:9002

Nothing here knows proxyblocks but one field: the chain routes every request
and WebSocket of a session to the replica that hosts it, and names the session
in ``x-proxyblocks-session``. This app makes that session a chat room:

- ``GET /``: a page (New room, a share link, the room's messages); it takes the
  proxy-auth token from its URL's ``#auth=TOKEN``, as ``python -m recipes.chat``
  prints it;
- ``/ws``: the room's WebSocket. It first sends ``{"type": "hello", "room",
  "replica", "http", "history"}`` (``http``: the version the WebSocket came
  in on; ``history``: the room's last :data:`HISTORY` messages), then each
  message any member sends, ``{"type": "message", "text", "replica"}``, to all
  of them. A WebSocket without a session is refused (403);
- every answer carries ``x-replica: asgi-chat-PORT``, this server's name.

Bounded everywhere: a message is at most :data:`MAX_MESSAGE` characters (a
longer one closes its sender with 1009, a binary one with 1003), a room keeps
:data:`HISTORY` messages, the server :data:`MAX_ROOMS` rooms (the least recently
used go first), and a member with :data:`OUTBOX` messages queued is closed with
1013 (too slow) rather than slowing its room. Hypercorn serves it over HTTP/1.1
(WebSockets by Upgrade) and h2c (WebSockets by extended CONNECT, RFC 8441) on
one port, with its default (asyncio) worker.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Awaitable, Callable
from typing import Any

MAX_MESSAGE = 4096  # characters of one chat message
HISTORY = 100  # messages a room keeps for those who (re)join
MAX_ROOMS = 1000  # rooms this server remembers
OUTBOX = 64  # messages queued to one member before it counts as too slow
SESSION = b"x-proxyblocks-session"

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class Member:
    """One WebSocket in a room: its bounded outbox, drained by :meth:`deliver`."""

    def __init__(self) -> None:
        self.outbox: asyncio.Queue[str | tuple[int, str]] = asyncio.Queue(OUTBOX)

    def close(self, code: int, reason: str) -> None:
        """Close this member next, dropping what it has not been sent yet."""
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.outbox.put_nowait((code, reason))

    async def deliver(self, send: Send) -> None:
        """Send the outbox's messages in order, until a close."""
        while True:
            item = await self.outbox.get()
            if isinstance(item, tuple):
                await send({"type": "websocket.close", "code": item[0], "reason": item[1]})
                return
            await send({"type": "websocket.send", "text": item})


class Room:
    def __init__(self) -> None:
        self.members: set[Member] = set()
        self.history: collections.deque[Message] = collections.deque(maxlen=HISTORY)

    def broadcast(self, message: Message) -> None:
        self.history.append(message)
        data = json.dumps(message)
        for member in list(self.members):
            try:
                member.outbox.put_nowait(data)
            except asyncio.QueueFull:  # it does not keep up: dropped, never waited for
                self.members.discard(member)
                member.close(1013, "too slow")


rooms: collections.OrderedDict[str, Room] = collections.OrderedDict()


def room(session: str) -> Room:
    found = rooms.get(session) or rooms.setdefault(session, Room())
    rooms.move_to_end(session)
    if len(rooms) > MAX_ROOMS:
        rooms.popitem(last=False)
    return found


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    replica = f"asgi-chat-{scope['server'][1]}"
    fields = [(b"x-replica", replica.encode())]
    if scope["type"] == "http":
        found = scope["path"] == "/"
        status, body = (200, PAGE.encode()) if found else (404, b"not found\n")
        kind = b"text/html; charset=utf-8" if found else b"text/plain"
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", kind), *fields]})
        await send({"type": "http.response.body", "body": body})
        return
    session = next((value.decode() for name, value in scope["headers"] if name == SESSION), None)
    await receive()  # websocket.connect
    if scope["path"] != "/ws" or session is None:
        status, body = (404, b"no such WebSocket\n") if scope["path"] != "/ws" else (403, b"join a room first\n")
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close"})  # the server answers 403
            return
        await send({"type": "websocket.http.response.start", "status": status, "headers": fields})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    await send({"type": "websocket.accept", "headers": fields})
    joined, member = room(session), Member()
    history = list(joined.history)
    hello = {"type": "hello", "room": session, "replica": replica, "http": scope["http_version"], "history": history}
    member.outbox.put_nowait(json.dumps(hello))
    joined.members.add(member)
    delivering = asyncio.ensure_future(member.deliver(send))
    try:
        while not delivering.done():
            received = asyncio.ensure_future(receive())
            await asyncio.wait([received, delivering], return_when=asyncio.FIRST_COMPLETED)
            if not received.done():  # closed as too slow
                received.cancel()
                break
            message = received.result()
            if message["type"] == "websocket.disconnect":
                break
            text = message.get("text")
            if text is None or len(text) > MAX_MESSAGE:
                joined.members.discard(member)
                member.close(1003 if text is None else 1009, f"text messages of up to {MAX_MESSAGE} characters")
                await delivering
                break
            joined.broadcast({"type": "message", "text": text, "replica": replica})
    finally:
        joined.members.discard(member)
        delivering.cancel()


PAGE = """<!doctype html>
<meta charset="utf-8">
<title>chat</title>
<p id="status">not in a room</p>
<p><button id="create">New room</button> share: <a id="share"></a></p>
<ul id="messages"></ul>
<form id="form"><input id="text" autocomplete="off" maxlength="4096"> <button id="send">Send</button></form>
<script>
const params = new URLSearchParams(location.hash.slice(1)), $ = (id) => document.getElementById(id);
let ws = null;
const token = () => (document.cookie.match(/(?:^|; )proxyblocks-session=([^;]*)/) || [])[1];
const add = (m) => { const li = document.createElement("li"); li.textContent = m.text; $("messages").append(li); };
function connect() {
  if (!token()) return;
  $("share").href = location.origin + "/#join=" + token(); $("share").textContent = "link";
  ws = new WebSocket(location.origin.replace(/^http/, "ws") + "/ws");
  ws.onmessage = (event) => {
    const m = JSON.parse(event.data);
    if (m.type !== "hello") return add(m);
    $("messages").replaceChildren(); $("status").textContent = "room " + m.room + " on " + m.replica;
    Object.assign($("status").dataset, {room: m.room, replica: m.replica});
    m.history.forEach(add);
  };
  ws.onclose = () => { $("status").textContent = "disconnected"; delete $("status").dataset.room; };
}
$("create").onclick = async () => {
  const answer = await fetch("/.proxyblocks/sessions",
    {method: "POST", headers: {authorization: "Bearer " + params.get("auth")}});
  if (answer.status !== 201) { $("status").textContent = "no room: " + answer.status; return; }
  if (ws) ws.close();
  connect();  // the answer set the session cookie
};
$("form").onsubmit = (event) => {
  event.preventDefault();
  if (ws && ws.readyState === WebSocket.OPEN && $("text").value) { ws.send($("text").value); $("text").value = ""; }
};
if (params.get("join")) {
  document.cookie = "proxyblocks-session=" + params.get("join") + "; path=/; SameSite=Strict";
  history.replaceState(null, "", location.pathname);
}
connect();
</script>
"""
