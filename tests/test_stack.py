"""A hop's feature stack, without sockets and without trio: the phases, their order, and what closed gives back.

The hop's clock is injected, so time-dependent decisions (outlier
ejection) are driven by a plain variable. The invariant under test, by
hypothesis over random stacks that raise at random phases: for every
feature, ``closed`` runs exactly once for every exchange its
``dispatched`` completed, never for one it did not, in reverse stack order;
and the scheduler-free hop's own counts return to zero.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from blocks import (
    BlocksError,
    Exchange,
    Feature,
    Forward,
    Headers,
    Hop,
    NoRoute,
    NoteKey,
    OutlierConfig,
    Proxy,
    Replica,
    Request,
    RouteTable,
    Upstreams,
)
from blocks.fields import REPLICA_HEADER
from blocks.routing import OutlierDetector

NO_UPSTREAMS = cast(Upstreams, None)  # deciding never touches the pool


def table() -> RouteTable:
    return RouteTable.build(
        {"app.example": "app"},
        {
            "app": [
                Replica(name="r0", worker=("127.0.0.1", 1), address=("127.0.0.1", 10)),
                Replica(name="r1", worker=("127.0.0.1", 2), address=("127.0.0.1", 11)),
            ]
        },
    )


def request(path: bytes = b"/", authority: bytes = b"app.example") -> Request:
    return Request(b"GET", b"http", authority, path, [(b"accept", b"*/*")])


def decide(hop: Hop, path: bytes = b"/", authority: bytes = b"app.example") -> Exchange:
    exchange = Exchange(hop, request(path, authority))
    hop.screen(exchange)
    hop.decide(exchange)
    return exchange


def test_the_proxy_routes_and_counts_until_closed() -> None:
    proxy = Proxy(table(), NO_UPSTREAMS, clock=lambda: 0.0)
    first, second = decide(proxy), decide(proxy)
    assert first.request.exchange is first
    assert first.app == "app" and {first.replica, second.replica} == {"r0", "r1"}  # least in flight
    assert first.forward is not None and first.forward.headers[-1] == (REPLICA_HEADER, first.replica.encode())
    assert proxy.statistics().in_flight == {"r0": 1, "r1": 1}
    first.closed()
    first.closed()  # idempotent: what was taken is given back once
    assert proxy.statistics().in_flight == {first.replica: 0, second.replica: 1}
    with pytest.raises(NoRoute):
        decide(proxy, authority=b"other.example")
    assert proxy.statistics().no_route == 1


def test_outlier_ejection_follows_the_injected_clock() -> None:
    now = [0.0]
    config = OutlierConfig(consecutive_failures=2, base_ejection=10.0, panic_threshold=0.5)
    proxy = Proxy(table(), NO_UPSTREAMS, outliers=OutlierDetector(config), clock=lambda: now[0])
    for _ in range(2):
        exchange = decide(proxy)
        while exchange.replica != "r0":  # (least in flight alternates; keep the r1 one open)
            exchange = decide(proxy)
        exchange.failed(502)
        exchange.closed()
    assert {decide(proxy).replica for _ in range(4)} == {"r1"}  # r0 is ejected at t=0
    now[0] = 11.0
    assert "r0" in {decide(proxy).replica for _ in range(4)}  # and back once its ejection is over


class Recorder(Feature):
    """Records its phases into a shared log; raises in the phase ``boom`` names."""

    def __init__(self, index: int, log: list[tuple[str, int]], boom: str | None) -> None:
        self.index = index
        self.log = log
        self.boom = boom

    def _run(self, phase: str) -> None:
        self.log.append((phase, self.index))
        if self.boom == phase:
            raise (BlocksError if self.index % 2 else KeyError)(f"{phase} of {self.index}")

    def screen(self, exchange: Exchange) -> None:
        self._run("screen")

    def route(self, exchange: Exchange) -> Forward | None:
        self._run("route")
        return None

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        self._run("dispatched")

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        self._run("response")

    def closed(self, exchange: Exchange) -> None:
        self._run("closed")


class Fixed(Feature):
    def route(self, exchange: Exchange) -> Forward:
        return Forward(("127.0.0.1", 1), exchange.request.headers)


PHASES = [None, "screen", "route", "dispatched", "response", "closed"]


@given(booms=st.lists(st.sampled_from(PHASES), min_size=1, max_size=6), answered=st.booleans())
def test_closed_gives_back_exactly_what_dispatched_took(booms: list[str | None], answered: bool) -> None:
    log: list[tuple[str, int]] = []
    features: list[Feature] = [Recorder(i, log, boom) for i, boom in enumerate(booms)]
    hop = Hop("hop", NO_UPSTREAMS, [*features, Fixed()], clock=lambda: 0.0)
    exchange = Exchange(hop, request())
    raised: Any = None
    try:
        hop.screen(exchange)
        hop.decide(exchange)
        if answered:
            exchange.head(200, [])
        else:
            exchange.failed(502)
    except (BlocksError, KeyError) as exc:
        raised = exc
    try:
        exchange.closed()
    except (BlocksError, KeyError) as exc:
        raised = raised or exc
    exchange.closed()  # a second close gives nothing back twice
    dispatched = [i for phase, i in log if phase == "dispatched" and booms[i] != "dispatched"]
    closed = [i for phase, i in log if phase == "closed"]
    assert closed == dispatched[::-1]  # once each, in reverse stack order, only for what dispatched completed
    screens = [i for phase, i in log if phase == "screen"]
    assert screens == list(range(len(screens)))  # in stack order, stopping at the first that raised
    first_boom = next((phase for phase in booms if phase is not None), None)
    if first_boom is None:
        assert raised is None and len(closed) == len(booms)


def test_a_note_key_keeps_one_typed_value_per_exchange_and_keys_never_collide() -> None:

    first: NoteKey[int] = NoteKey("attempts")
    second: NoteKey[int] = NoteKey("attempts")  # the same name: another key
    exchange = Exchange(Hop("hop", NO_UPSTREAMS, []), Request(b"GET", b"http", b"a.example", b"/"))
    assert (first.get(exchange), first.get(exchange, 0), exchange.notes) == (None, 0, None)
    first.set(exchange, 1)
    second.set(exchange, 2)
    first.set(exchange, first.get(exchange, 0) + 10)
    assert (first.get(exchange), second.get(exchange)) == (11, 2)
    assert repr(first) == "<NoteKey attempts>"
