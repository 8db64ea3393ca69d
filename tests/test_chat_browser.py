"""The chat recipe in a real browser: headless Chromium (Debian's) driven by Playwright.

Two browser contexts (two people, separate cookie jars) share one room: one
creates it, the other opens the share link; messages flow both ways live
over WebSockets (h1 Upgrade at the edge, extended CONNECT on the h2 hops).
A reload rejoins the same room on the same replica, with its history. The
same again with ``tests/asgi_chat.py``'s own page, the chat servers being
Hypercorn processes behind ``--replica http://``.

Rules: loopback only, port 0; the chain runs in the test's trio loop and the
browser in a worker thread (Playwright's sync API runs its own loop there);
every wait is bounded, by Playwright's timeout and ``trio.fail_after``.
Playwright drives ``/usr/bin/chromium`` (``.ci/run`` installs it); it never
downloads a browser of its own.
"""

from __future__ import annotations

import functools
from typing import Any

import trio
from playwright.sync_api import Page, sync_playwright
from support import chat_server

from recipes.chat import Chat, main

CHROMIUM = "/usr/bin/chromium"
STEP_TIMEOUT_MS = 15_000


def _room(page: Page) -> dict[str, Any]:
    """Wait until the page is in a room; its room and replica as the chat app told it."""
    page.wait_for_function("document.getElementById('status').dataset.room")
    return page.evaluate(
        "({room: document.getElementById('status').dataset.room,"
        " replica: document.getElementById('status').dataset.replica,"
        " messages: [...document.querySelectorAll('#messages li')].map(li => li.textContent)})"
    )


def _say(page: Page, text: str) -> None:
    page.fill("#text", text)
    page.click("#send")


def _browse(url: str, auth: str) -> dict[str, Any]:
    """Two people in one room, then a reload; what each page saw."""
    seen: dict[str, Any] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            alice_context, bob_context = browser.new_context(), browser.new_context()
            alice, bob = alice_context.new_page(), bob_context.new_page()
            for page in (alice, bob):
                page.set_default_timeout(STEP_TIMEOUT_MS)
            alice.goto(f"{url}/#auth={auth}")
            alice.click("#create")
            seen["alice"] = _room(alice)
            share = alice.get_attribute("#share", "href")
            assert share is not None and "#join=" in share
            bob.goto(share)
            seen["bob"] = _room(bob)
            _say(alice, "hello from alice")
            bob.wait_for_selector("#messages li:has-text('hello from alice')")
            _say(bob, "hi from bob")
            alice.wait_for_selector("#messages li:has-text('hi from bob')")
            alice.reload()
            seen["alice_reloaded"] = _room(alice)
            _say(alice, "back again")
            bob.wait_for_selector("#messages li:has-text('back again')")
            seen["bob_final"] = _room(bob)
            seen["alice_cookies"] = [c["name"] for c in alice_context.cookies()]
        finally:
            browser.close()
    return seen


async def test_two_pages_share_a_room_and_a_reload_rejoins_it_on_the_same_replica(nursery: trio.Nursery) -> None:
    with trio.fail_after(120):
        chat: Chat = await nursery.start(functools.partial(main, announce=False, replicas=2))
        seen = await trio.to_thread.run_sync(
            functools.partial(_browse, chat.url, chat.auth_token()), abandon_on_cancel=True
        )
    alice, bob, again = seen["alice"], seen["bob"], seen["alice_reloaded"]
    assert bob["room"] == alice["room"] and bob["replica"] == alice["replica"]
    assert again["room"] == alice["room"] and again["replica"] == alice["replica"]
    assert again["messages"] == ["hello from alice", "hi from bob"]  # the room's history, after the reload
    assert seen["bob_final"]["messages"] == ["hello from alice", "hi from bob", "back again"]
    assert "proxyblocks-session" in seen["alice_cookies"]
    # one room, on the replica the pages named, and nowhere else
    replica = chat.apps[alice["replica"]]
    assert list(replica.rooms) == [alice["room"]]
    assert [m["text"] for m in replica.rooms[alice["room"]].history] == [
        "hello from alice",
        "hi from bob",
        "back again",
    ]
    other = next(name for name in chat.apps if name != alice["replica"])
    assert chat.apps[other].rooms == {}
    assert chat.chain.worker.sessions is not None
    assert chat.chain.worker.sessions.statistics().active == {alice["replica"]: 1, other: 0}
    chat.stop()


async def test_the_same_with_your_chat_servers_under_hypercorn(nursery: trio.Nursery) -> None:
    """``tests/asgi_chat.py``'s own page, served by two Hypercorn processes behind ``--replica http://``."""
    with trio.fail_after(120):
        async with chat_server() as one, chat_server() as two:
            urls = [f"http://127.0.0.1:{port}" for port in (one, two)]
            chat: Chat = await nursery.start(functools.partial(main, announce=False, replica_urls=urls))
            seen = await trio.to_thread.run_sync(
                functools.partial(_browse, chat.url, chat.auth_token()), abandon_on_cancel=True
            )
            await chat.shutdown(1)
    alice, bob, again = seen["alice"], seen["bob"], seen["alice_reloaded"]
    assert alice["replica"] in (f"asgi-chat-{one}", f"asgi-chat-{two}")  # Hypercorn's app named itself
    assert bob["room"] == alice["room"] and bob["replica"] == alice["replica"]
    assert again["room"] == alice["room"] and again["replica"] == alice["replica"]
    assert again["messages"] == ["hello from alice", "hi from bob"]  # the room's history, after the reload
    assert seen["bob_final"]["messages"] == ["hello from alice", "hi from bob", "back again"]
    assert chat.chain.worker.sessions is not None
    active = chat.chain.worker.sessions.statistics().active
    assert sorted(active.values()) == [0, 1]  # one room, on one of the two
