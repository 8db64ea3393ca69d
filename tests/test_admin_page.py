"""The admin page in a real browser: headless Chromium (Debian's) driven by Playwright.

The page (``blocks/observe/admin.html``) polls ``status.json`` every second.
The test opens it, sends traffic, waits until a number on the page changes,
then checks that every section shows what the JSON it rendered says (every
``data-metric`` the page has, and no other), that the newest error comes
first, that the latency charts grow a history, and that the page says
"disconnected" (and keeps its last figures) once the listener stops. It
saves screenshots to ``tests/artifacts/admin-page.png`` (and
``admin-page-disconnected.png``) for a reviewer.

Where the project has the admin listener (``Chain.start_admin``), the page
is served by it in front of the chain recipe; until then, by a stand-in
built on ``serve_http``: a hop that counts the requests sent to it into a
``status.json`` of the shape the admin listener serves.

Rules: loopback only, port 0; the servers run in the test's trio loop and
the browser in a worker thread (Playwright's sync API runs its own loop
there), which calls back into trio for traffic and the stop; every wait is
bounded, by Playwright's timeout and ``trio.fail_after``, and waits on
state (``wait_for_function``), never for a duration. Playwright drives
``/usr/bin/chromium``; it never downloads a browser of its own.
"""

from __future__ import annotations

import functools
import importlib
import importlib.resources
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from playwright.sync_api import Page, sync_playwright

from blocks.http import Request, Response, json_response, text_response
from blocks.observe import Metrics
from blocks.topology import Chain, serve_chain
from blocks.transport.listener import HTTPServer, serve_http

CHROMIUM = "/usr/bin/chromium"
STEP_TIMEOUT_MS = 15_000
SCREENSHOT = Path(__file__).resolve().parent / "artifacts" / "admin-page.png"
DISCONNECTED = SCREENSHOT.with_name("admin-page-disconnected.png")
CLASSES = ("2xx", "3xx", "4xx", "5xx")
WATCHED = "hop:edge:2xx"  # the number the test waits on
SENT = 6  # requests answered 200 per round of traffic (the stand-in's round adds one 502)


def _page_html() -> bytes:
    return importlib.resources.files("blocks").joinpath("observe/admin.html").read_bytes()


@attrs.define(eq=False)
class StandIn:
    """A hop that counts what is sent to it, and the ``status.json`` it would have.

    ``/ok`` answers 200, ``/fail`` a 502 (``replica_unreachable``); the
    ``x-tenant`` header names the tenant, ``/session`` opens a session on
    the replica it lands on. Its mirror has no pairs until the first
    ``/fail``, so the page first shows that section empty.
    """

    url: str = ""
    requests: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(CLASSES, 0))
    errors: dict[str, int] = attrs.field(factory=dict)
    durations: list[float] = attrs.field(factory=list)
    tenants: dict[str, dict[str, int]] = attrs.field(factory=dict)
    sessions: dict[str, int] = attrs.field(factory=lambda: {"replica-0": 0, "replica-1": 0})
    last_errors: list[dict[str, Any]] = attrs.field(factory=list)
    served: int = 0

    async def hop(self, request: Request) -> Response:
        started = time.perf_counter()
        replica = f"replica-{self.served % 2}"
        self.served += 1
        tenant = (request.header(b"x-tenant") or b"anonymous").decode()
        counts = self.tenants.setdefault(
            tenant, {"admitted": 0, "queued": 0, "refused_429": 0, "refused_503": 0, "waiting": 0}
        )
        counts["admitted"] += 1
        if request.path == b"/session":
            self.sessions[replica] += 1
        if request.path == b"/fail":
            self.requests["5xx"] += 1
            self.errors["replica_unreachable"] = self.errors.get("replica_unreachable", 0) + 1
            error: dict[str, Any] = {"time": time.time(), "hop": "edge", "status": 502, "reason": "replica_unreachable"}
            error |= {"method": request.method.decode(), "authority": request.authority.decode()}
            self.last_errors.insert(0, error | {"path": f"/fail#{len(self.last_errors)}"})
            del self.last_errors[20:]
            response = text_response(502, "502 Bad Gateway: replica_unreachable; hop=edge")
        else:
            self.requests["2xx"] += 1
            response = text_response(200, "ok")
        self.durations.append((time.perf_counter() - started) * 1000)
        return response

    def status(self) -> dict[str, Any]:
        ordered = sorted(self.durations)

        def quantile(q: float) -> float:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) if ordered else 0.0

        phase = {"count": len(ordered), "p50_ms": quantile(0.5), "p99_ms": quantile(0.99)}
        failed = self.requests["5xx"]
        return {
            "time": time.time(),
            "draining": False,
            "listeners": [{"part": "edge", "url": self.url, "connections": 1 if self.served else 0, "streams": 0}],
            "hops": [
                {
                    "name": "edge",
                    "requests": dict(self.requests),
                    "errors": dict(self.errors),
                    "phases": {"edge": phase, "total": {**phase, "p99_ms": phase["p99_ms"] * 2}},
                }
            ],
            "apps": [
                {
                    "name": "demo",
                    "replicas": [
                        {"name": name, "in_flight": 0, "ejected": False, "ejections": 0, "sessions": sessions}
                        for name, sessions in self.sessions.items()
                    ],
                }
            ],
            "tenants": [{"name": name, **counts} for name, counts in self.tenants.items()],
            "mirror": [{"app": "demo", "route": "/", "pairs": 2 * failed, "matches": failed, "mismatches": failed}]
            if failed
            else [],
            "routes": {"revision": 3 + self.served, "staleness_s": 0.0, "connected": True},
            "last_errors": list(self.last_errors),
        }

    async def admin(self, request: Request) -> Response:
        path = request.path.split(b"?", 1)[0]
        if path == b"/":
            return text_response(200, _page_html().decode(), [(b"content-type", b"text/html; charset=utf-8")])
        if path == b"/status.json":
            return json_response(200, json.dumps(self.status()).encode())
        return text_response(404, "not found")


@attrs.frozen
class Site:
    """What the browser's side needs: the page's URL, a round of traffic, and a way to stop the admin listener."""

    url: str
    traffic: Callable[[], Awaitable[None]]
    stop: Callable[[], Awaitable[None]]
    stand_in: StandIn | None = None


async def _send(urls: list[tuple[str, str]]) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as client:
        for url, tenant in urls:
            await client.get(url, headers={"x-tenant": tenant})


async def _stand_in_site(nursery: trio.Nursery) -> Site:
    stand_in = StandIn()
    hop: HTTPServer = await nursery.start(serve_http, stand_in.hop)
    admin: HTTPServer = await nursery.start(serve_http, stand_in.admin)
    base = f"http://127.0.0.1:{hop.port}"
    stand_in.url = base

    async def traffic() -> None:
        urls = [(f"{base}/ok", "alice"), (f"{base}/session", "bob")] * (SENT // 2)
        await _send([*urls, (f"{base}/fail", "<i>eve</i>")])

    async def stop() -> None:
        await admin.aclose(0)
        hop.drain()

    return Site(f"http://127.0.0.1:{admin.port}/", traffic, stop, stand_in)


async def _admin_site(nursery: trio.Nursery) -> Site:
    """The real admin listener over a chain whose hops count with the ``Metrics`` feature."""

    async def build(chain: Chain) -> None:
        replicas = {name: await chain.start_replica(name) for name in ("replica-0", "replica-1")}
        await chain.start_worker(replicas, features=[Metrics()])
        await chain.start_proxy(features=[Metrics()])
        await chain.start_edge(features=[Metrics()])

    chain: Chain = await nursery.start(serve_chain, build)
    admin = await chain.start_admin(port=0)

    async def traffic() -> None:
        await _send([(f"{chain.url}/", "alice")] * SENT + [(f"{chain.url}/status/500", "alice")])

    async def stop() -> None:
        await admin.aclose(0)

    return Site(f"http://127.0.0.1:{admin.port}/", traffic, stop)


SNAPSHOT = """() => ({
  status: window.adminStatus,
  metrics: Object.fromEntries([...document.querySelectorAll('[data-metric]')]
    .map(node => [node.dataset.metric, node.dataset.value])),
  empty: [...document.querySelectorAll('main section')]
    .filter(section => section.querySelector('.body > .none')).map(section => section.id),
  errors: [...document.querySelectorAll('#errors tbody tr')].map(row => row.textContent),
  charts: Object.fromEntries([...document.querySelectorAll('[data-chart]')]
    .map(node => [node.dataset.chart, Number(node.dataset.points)])),
  markup: document.querySelectorAll('main i').length,
  conn: document.getElementById('conn').dataset.state,
  connText: document.getElementById('conn').textContent,
})"""


AT_LEAST = """([key, least]) => Number(document.querySelector(`[data-metric='${key}']`)?.dataset.value) >= least"""
CHARTS_MOVED = "() => [...document.querySelectorAll('[data-chart]')].some(chart => chart.dataset.points >= 3)"


def _value(page: Page, key: str) -> float:
    page.wait_for_selector(f'[data-metric="{key}"]')
    return float(page.get_attribute(f'[data-metric="{key}"]', "data-value") or "nan")


def _browse(site: Site) -> dict[str, Any]:
    """Open the page, send traffic, watch it change, stop the listener; what the page showed at each step."""
    seen: dict[str, Any] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(STEP_TIMEOUT_MS)
            page.goto(site.url)
            page.wait_for_selector('#conn[data-state="live"]')
            before = _value(page, WATCHED)
            seen["before"] = page.evaluate(SNAPSHOT)
            trio.from_thread.run(site.traffic)
            page.wait_for_function(AT_LEAST, arg=[WATCHED, before + SENT])
            trio.from_thread.run(site.traffic)  # a second round, so the charts have a history that moves
            page.wait_for_function(AT_LEAST, arg=[WATCHED, before + 2 * SENT])
            page.wait_for_function(CHARTS_MOVED)
            seen["after"] = page.evaluate(SNAPSHOT)
            SCREENSHOT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=True, animations="disabled")
            print(f"admin page screenshot: {SCREENSHOT}")
            trio.from_thread.run(site.stop)
            page.wait_for_selector('#conn[data-state="disconnected"]')
            seen["stopped"] = page.evaluate(SNAPSHOT)
            page.screenshot(path=str(DISCONNECTED), full_page=True, animations="disabled")
            print(f"admin page screenshot, disconnected: {DISCONNECTED}")
        finally:
            browser.close()
    return seen


def _expected_metrics(status: dict[str, Any]) -> dict[str, object]:
    """Every ``data-metric`` the page should show for ``status``, with its value (``""`` for none)."""
    expected: dict[str, object] = {}
    for listener in status["listeners"]:
        for field in ("connections", "streams"):
            expected[f"listener:{listener['url']}:{field}"] = listener[field]
    for hop in status["hops"]:
        for cls in CLASSES:
            expected[f"hop:{hop['name']}:{cls}"] = hop["requests"].get(cls, 0)
        for reason, count in hop["errors"].items():
            expected[f"hop:{hop['name']}:error:{reason}"] = count
        for phase, figures in hop["phases"].items():
            for field in ("p50_ms", "p99_ms", "count"):
                expected[f"phase:{hop['name']}:{phase}:{field}"] = figures[field]
    for app in status["apps"]:
        for replica in app["replicas"]:
            for field in ("in_flight", "ejected", "ejections", "sessions"):
                expected[f"replica:{app['name']}:{replica['name']}:{field}"] = replica[field]
    for tenant in status["tenants"]:
        for field in ("admitted", "queued", "refused_429", "refused_503", "waiting"):
            expected[f"tenant:{tenant['name']}:{field}"] = tenant[field]
    for pair in status["mirror"]:
        key = f"mirror:{pair['app']}:{pair['route']}"
        for field in ("pairs", "matches", "mismatches"):
            expected[f"{key}:{field}"] = pair[field]
        expected[f"{key}:rate"] = round(100 * pair["matches"] / pair["pairs"], 1) if pair["pairs"] else ""
    if status["routes"]:
        for field in ("revision", "staleness_s", "connected"):
            expected[f"routes:{field}"] = status["routes"][field]
    return {key: "" if value is None else value for key, value in expected.items()}


def _shown(value: str) -> object:
    """A ``data-value`` as the JSON had it: a boolean, a number, or ``""``."""
    if value in ("true", "false"):
        return value == "true"
    return float(value) if value else ""


def _check_sections(snapshot: dict[str, Any]) -> None:
    """Every number the page shows is the one in the JSON it rendered, and it shows every one."""
    status = snapshot["status"]
    expected = _expected_metrics(status)
    shown = {key: _shown(value) for key, value in snapshot["metrics"].items()}
    assert shown.keys() == expected.keys()
    for key, value in expected.items():
        assert shown[key] == value, (key, shown[key], value)
    newest_first = sorted(status["last_errors"], key=lambda e: e["time"], reverse=True)
    assert len(snapshot["errors"]) == len(newest_first)
    for row, error in zip(snapshot["errors"], newest_first, strict=True):
        for field in ("hop", "reason", "path", "method"):
            assert str(error[field]) in row
        assert str(error["status"]) in row


@pytest.mark.parametrize("server", ["admin", "stand-in"])
async def test_the_admin_page_shows_every_section_updates_with_traffic_and_says_when_it_is_disconnected(
    nursery: trio.Nursery, server: str
) -> None:
    # "admin": the real admin listener over a chain; "stand-in": a status.json with every section filled.
    with trio.fail_after(120):
        site = await (_admin_site(nursery) if server == "admin" else _stand_in_site(nursery))
        seen = await trio.to_thread.run_sync(functools.partial(_browse, site), abandon_on_cancel=True)
    before, after, stopped = seen["before"], seen["after"], seen["stopped"]
    for snapshot in (before, after):
        assert snapshot["conn"] == "live"
        _check_sections(snapshot)
    assert after["metrics"][WATCHED] != before["metrics"][WATCHED]
    assert max(after["charts"].values()) >= 3
    assert SCREENSHOT.stat().st_size > 0
    # stopped: says so, and keeps the last figures it had
    assert stopped["conn"] == "disconnected" and "disconnected" in stopped["connText"]
    assert stopped["metrics"].keys() == after["metrics"].keys()
    assert float(stopped["metrics"][WATCHED]) >= float(after["metrics"][WATCHED])
    if site.stand_in is not None:
        stand_in = site.stand_in
        assert "mirror" in before["empty"] and "mirror" not in after["empty"]  # an empty section says none
        assert after["metrics"]["mirror:demo:/:rate"] == "50.0"
        # what the page last rendered is what the stand-in serves, now that the traffic has stopped
        last = stopped["status"]
        assert {k: v for k, v in last.items() if k != "time"} == {
            k: v for k, v in stand_in.status().items() if k != "time"
        }
        assert last["hops"][0]["requests"] == {"2xx": 2 * SENT, "3xx": 0, "4xx": 0, "5xx": 2}
        assert last["hops"][0]["errors"] == {"replica_unreachable": 2}
        assert [row["name"] for row in last["tenants"]] == ["alice", "bob", "<i>eve</i>"]
        assert after["markup"] == 0  # a tenant named like markup is text, not an element
        assert after["errors"][0].endswith(f"/fail#{len(stand_in.last_errors) - 1}")  # newest first
