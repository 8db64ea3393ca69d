"""The chat recipe in front of chat servers that are not the project's: ``tests/asgi_chat.py`` under Hypercorn.

Real processes: each chat server is Hypercorn (asyncio) in a process of its
own, reached over h2c (WebSockets by extended CONNECT) or HTTP/1.1 (by
Upgrade); the recipe runs in the test's loop (``main(..., task_status=)``);
the clients are httpx and trio-websocket through the edge. With ``command``,
the recipe's autoscaler starts the Hypercorn processes itself.

Rules: loopback only, port 0, every test bounded by ``trio.fail_after``, and
every wait is for a state (a queued start, an answer), never a duration.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from asgi_chat import MAX_MESSAGE
from support import chat_server, connect_websocket, wait_for
from test_startup_errors import assert_one_line_error, run_recipe

from recipes.chat import Chat, main

COMMAND = shlex.join([sys.executable, "-m", "hypercorn", "tests.asgi_chat:app", "--bind", "{host}:{port}", "-w", "0"])


async def start_room(chat: Chat) -> httpx.Response:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
        return await client.post(
            chat.url + "/.proxyblocks/sessions", headers={"authorization": "Bearer " + chat.auth_token()}
        )


async def room(chat: Chat) -> dict[str, str]:
    started = await start_room(chat)
    assert started.status_code == 201, started.text
    answer: dict[str, str] = started.json()
    return answer


@asynccontextmanager
async def member(chat: Chat, token: str) -> AsyncIterator[tuple[trio_websocket.WebSocketConnection, dict[str, Any]]]:
    """A WebSocket into the room of ``token``, through the edge: it and the server's hello."""
    fields = [("proxyblocks-session", token)]
    async with connect_websocket(chat.chain.edge.port, "/ws", extra_headers=fields) as ws:
        hello = json.loads(await ws.get_message())
        assert hello["type"] == "hello"
        yield ws, hello


async def say_and_hear(
    speaker: trio_websocket.WebSocketConnection, *everyone: trio_websocket.WebSocketConnection
) -> str:
    """``speaker`` says something; every one of ``everyone`` (the speaker too) hears it: the replica's name."""
    text = f"hello from {id(speaker)}"
    await speaker.send_message(text)
    heard = [json.loads(await ws.get_message()) for ws in everyone]
    assert [(m["type"], m["text"]) for m in heard] == [("message", text)] * len(everyone)
    assert len({m["replica"] for m in heard}) == 1
    replica: str = heard[0]["replica"]
    return replica


async def test_rooms_on_your_hypercorn_chat_servers_over_h2c_and_h1_then_a_full_fleet_queues_then_503(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(60):
        async with chat_server() as h2c, chat_server() as h1:
            urls = [f"h2c://127.0.0.1:{h2c}", f"http://127.0.0.1:{h1}"]
            start = functools.partial(main, replica_urls=urls, rooms_per_replica=1, announce=False)
            chat: Chat = await nursery.start(start)
            assert chat.apps == {} and chat.scaler is None  # no demo replica: your servers only
            servers = {"chat-0": f"asgi-chat-{h2c}", "chat-1": f"asgi-chat-{h1}"}

            first, second = await room(chat), await room(chat)
            assert {first["replica"], second["replica"]} == set(servers)  # one room per server
            for one in (first, second):
                async with member(chat, one["token"]) as (ws, hello), member(chat, one["token"]) as (other, again):
                    assert hello["room"] == again["room"] == one["session"]
                    assert hello["replica"] == again["replica"] == servers[one["replica"]]
                    assert hello["history"] == []
                    assert hello["http"] == ("2" if one["replica"] == "chat-0" else "1.1")  # h2c: extended CONNECT
                    assert await say_and_hear(ws, ws, other) == servers[one["replica"]]
                    assert await say_and_hear(other, ws, other) == servers[one["replica"]]
                async with member(chat, one["token"]) as (_, rejoined):  # the room's history, replayed
                    assert [m["text"] for m in rejoined["history"]] == [
                        f"hello from {id(ws)}",
                        f"hello from {id(other)}",
                    ]

            async with httpx.AsyncClient(trust_env=False, timeout=10) as client:  # the room's page is its server's
                page = await client.get(chat.url + "/", headers={"proxyblocks-session": first["token"]})
            assert page.status_code == 200 and page.headers["x-replica"] == servers[first["replica"]]
            assert page.headers["content-type"] == "text/html; charset=utf-8"

            answers: list[httpx.Response] = []
            nursery.start_soon(lambda: _append(answers, start_room(chat)))
            await wait_for(lambda: chat.chain.proxy.sessions.statistics().queued["chat"] == 1, "the start queued")
            assert answers == []
            await wait_for(lambda: bool(answers), "the queued start's answer", timeout=30)
            assert answers[0].status_code == 503 and answers[0].headers["retry-after"]
            await chat.shutdown(1)


async def _append(answers: list[httpx.Response], answer: Any) -> None:
    answers.append(await answer)


async def test_a_websocket_without_a_room_is_refused_by_your_server(nursery: trio.Nursery) -> None:
    with trio.fail_after(30):
        async with chat_server() as port:
            chat: Chat = await nursery.start(
                functools.partial(main, replica_urls=[f"h2c://127.0.0.1:{port}"], announce=False)
            )
            with pytest.raises(trio_websocket.ConnectionRejected) as refused:
                async with connect_websocket(chat.chain.edge.port, "/ws"):
                    pass
            assert refused.value.status_code == 403  # Hypercorn's app said so: no session, no room
            await chat.shutdown(1)


async def test_a_member_who_leaves_or_says_too_much_takes_no_one_with_them(nursery: trio.Nursery) -> None:
    """Over ``http://`` each WebSocket has a connection of its own to Hypercorn. (Over h2c they share
    one, and Hypercorn 0.18 drops it, every member on it, when one member's stream ends after its
    close: pgjones/hypercorn#329. So the docs send Hypercorn's WebSockets over http://.) The server
    closes a message over 4,096 characters with 1009, a binary one with 1003: its sender only."""
    with trio.fail_after(30):
        async with chat_server() as port:
            start = functools.partial(main, replica_urls=[f"http://127.0.0.1:{port}"], announce=False)
            chat: Chat = await nursery.start(start)
            token = (await room(chat))["token"]
            async with member(chat, token) as (ws, _), member(chat, token) as (other, _):
                async with member(chat, token) as (leaving, _):
                    await say_and_hear(leaving, ws, other, leaving)
                await say_and_hear(ws, ws, other)
                for message, code in (("x" * (MAX_MESSAGE + 1), 1009), (b"binary", 1003)):
                    async with member(chat, token) as (loud, _):
                        await loud.send_message(message)
                        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                            await loud.get_message()
                        assert closed.value.reason.code == code
                await say_and_hear(other, ws, other)
            async with member(chat, token) as (_, hello):  # what the room kept
                assert [m["text"] for m in hello["history"]] == [f"hello from {id(x)}" for x in (leaving, ws, other)]
            await chat.shutdown(1)


async def test_the_autoscaler_starts_your_chat_server_for_the_first_room(nursery: trio.Nursery) -> None:
    with trio.fail_after(90):
        start = functools.partial(main, command=COMMAND, rooms_per_replica=1, announce=False)
        chat: Chat = await nursery.start(start)
        assert chat.scaler is not None
        assert chat.scaler.statistics().apps["chat"].ready == 0  # nothing runs before the first room
        first = await room(chat)  # it waited for a cold start
        assert first["replica"].startswith("chat-")  # a replica the autoscaler started, APP-N
        async with member(chat, first["token"]) as (ws, hello), member(chat, first["token"]) as (other, _):
            assert hello["replica"].startswith("asgi-chat-")
            assert await say_and_hear(ws, ws, other) == await say_and_hear(other, ws, other) == hello["replica"]
        pids = chat.scaler.statistics().processes.values()
        assert pids
        await chat.shutdown(1)
        await wait_for(lambda: not any(map(running, pids)), "the chat servers' processes stopped with the chain")


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--replica", "http://127.0.0.1:1", "--command", "x {port}"], ["--replica", "--command"]),
        (["--replicas", "3", "--replica", "http://127.0.0.1:1"], ["--replicas", "--replica"]),
        (["--min-replicas", "1"], ["--min-replicas", "--command"]),
        (["--protocol", "h2", "--replica", "http://127.0.0.1:1"], ["--protocol", "--command"]),
        (["--replica", "ftp://127.0.0.1:21"], ["--replica", "ftp://127.0.0.1:21"]),
        (["--command", "python3 -m hypercorn app:app"], ["{port}"]),
        (["--command", "no-such-program-here {port}"], ["no-such-program-here"]),
        (["--command", "python3 {port}", "--min-replicas", "3", "--max-replicas", "2"], ["max_replicas"]),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) and value[0].startswith("--") else "",
)
async def test_a_bad_mix_of_flags_is_one_line(args: list[str], names: list[str]) -> None:
    assert_one_line_error(*await run_recipe("chat", *args), *names)
