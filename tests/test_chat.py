"""The chat recipe's edges, with trio-websocket clients through the whole chain (the browser test has the happy path).

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import functools
import json

import httpx
import pytest
import trio
import trio_websocket
from support import connect_websocket

from recipes.chat import MAX_MESSAGE, Chat, main


async def start_room(chat: Chat) -> dict[str, str]:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        response = await client.post(
            chat.url + "/.proxyblocks/sessions", headers={"authorization": "Bearer " + chat.auth_token()}
        )
    assert response.status_code == 201
    answer: dict[str, str] = response.json()
    return answer


async def test_a_websocket_without_a_room_is_refused_by_the_app(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        chat: Chat = await nursery.start(functools.partial(main, announce=False))
        with pytest.raises(trio_websocket.ConnectionRejected) as refused:
            async with connect_websocket(chat.chain.edge.port, "/ws"):
                pass
        assert refused.value.status_code == 403  # the chat app's own answer: no session, no room
        chat.stop()


async def test_the_page_is_html_with_one_content_type(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        chat: Chat = await nursery.start(functools.partial(main, announce=False))
        async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
            response = await client.get(chat.url + "/")
        assert response.status_code == 200
        assert response.headers.get_list("content-type") == ["text/html; charset=utf-8"]
        chat.stop()


async def test_a_forged_session_cookie_is_a_401_at_the_proxy(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        chat: Chat = await nursery.start(functools.partial(main, announce=False))
        token = (await start_room(chat))["token"]
        forged = token[:-6] + ("AAAAAA" if not token.endswith("AAAAAA") else "BBBBBB")
        with pytest.raises(trio_websocket.ConnectionRejected) as refused:
            async with connect_websocket(
                chat.chain.edge.port, "/ws", extra_headers=[("cookie", f"proxyblocks-session={forged}")]
            ):
                pass
        assert refused.value.status_code == 401
        assert all(app.rooms == {} for app in chat.apps.values())  # no replica saw it
        chat.stop()


async def test_an_oversized_message_closes_only_its_sender(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        chat: Chat = await nursery.start(functools.partial(main, announce=False))
        room = await start_room(chat)
        cookie = [("cookie", f"proxyblocks-session={room['token']}")]
        async with (
            connect_websocket(chat.chain.edge.port, "/ws", extra_headers=cookie) as loud,
            connect_websocket(chat.chain.edge.port, "/ws", extra_headers=cookie) as quiet,
        ):
            for ws in (loud, quiet):
                hello = json.loads(await ws.get_message())
                assert (hello["type"], hello["room"], hello["replica"]) == ("hello", room["session"], room["replica"])
            await loud.send_message("x" * (MAX_MESSAGE + 1))
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await loud.get_message()
            assert closed.value.reason.code == 1009
            # the room goes on for the others
            await quiet.send_message("still here")
            assert json.loads(await quiet.get_message())["text"] == "still here"
        assert [m["text"] for m in chat.apps[room["replica"]].rooms[room["session"]].history] == ["still here"]
        chat.stop()
