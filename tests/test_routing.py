"""Sans-IO routing: RouteTable lookups and the LeastInFlight policy.

Synchronous tests and hypothesis properties; no sockets, no clock.
"""

from __future__ import annotations

import collections
import random

from hypothesis import given
from hypothesis import strategies as st

from blocks import LeastInFlight, Replica, RouteTable

WORKER = ("127.0.0.1", 1)


def replicas(*names: str) -> list[Replica]:
    return [Replica(name=name, worker=WORKER, address=("127.0.0.1", 1000 + i)) for i, name in enumerate(names)]


# -- LeastInFlight ------------------------------------------------------------------------


def test_least_in_flight_picks_the_least_loaded() -> None:
    policy = LeastInFlight(random.Random(0))
    candidates = replicas("a", "b", "c", "d")
    for in_flight, expected in [
        ({"a": 3, "b": 1, "c": 2, "d": 5}, "b"),
        ({"a": 0, "b": 1, "c": 2, "d": 5}, "a"),
        ({"a": 4, "b": 4, "c": 4, "d": 3}, "d"),
        ({"a": 1, "b": 1, "d": 1}, "c"),  # absent means nothing in flight
    ]:
        assert {policy.pick(candidates, in_flight).name for _ in range(200)} == {expected}, in_flight


def test_least_in_flight_with_one_candidate() -> None:
    (only,) = replicas("only")
    assert LeastInFlight(random.Random(0)).pick([only], {"only": 99}) is only


def test_least_in_flight_spreads_ties_evenly() -> None:
    policy = LeastInFlight(random.Random(20240601))
    candidates = replicas("a", "b", "c", "d")
    in_flight = {"a": 2, "b": 2, "c": 7, "d": 2}
    counts = collections.Counter(policy.pick(candidates, in_flight).name for _ in range(3000))
    assert counts["c"] == 0
    # 1000 expected each; the bounds are over six standard deviations wide.
    for name in "abd":
        assert 850 <= counts[name] <= 1150, counts


def test_least_in_flight_spreads_ties_when_nothing_is_in_flight() -> None:
    policy = LeastInFlight(random.Random(7))
    candidates = replicas("a", "b")
    counts = collections.Counter(policy.pick(candidates, {}).name for _ in range(2000))
    assert 880 <= counts["a"] <= 1120, counts
    assert counts["a"] + counts["b"] == 2000


def test_least_in_flight_is_reproducible_with_a_seed() -> None:
    candidates = replicas("a", "b", "c")
    policy_1, policy_2 = LeastInFlight(random.Random(5)), LeastInFlight(random.Random(5))
    run_1 = [policy_1.pick(candidates, {}).name for _ in range(100)]
    run_2 = [policy_2.pick(candidates, {}).name for _ in range(100)]
    assert run_1 == run_2
    assert len(set(run_1)) == 3


@given(
    loads=st.lists(st.integers(min_value=0, max_value=5) | st.none(), min_size=1, max_size=8),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_least_in_flight_always_picks_a_minimum(loads: list[int | None], seed: int) -> None:
    candidates = replicas(*(f"r{i}" for i in range(len(loads))))
    in_flight = {f"r{i}": load for i, load in enumerate(loads) if load is not None}
    picked = LeastInFlight(random.Random(seed)).pick(candidates, in_flight)
    assert picked in candidates
    assert in_flight.get(picked.name, 0) == min(in_flight.get(r.name, 0) for r in candidates)


# -- RouteTable.app_for --------------------------------------------------------------------


def test_app_for_exact_authority_then_host_then_wildcard() -> None:
    table = RouteTable.build({"example.com": "site", "example.com:8443": "admin", "*": "default"}, {})
    assert table.app_for(b"example.com:8443") == "admin"  # the authority as sent wins
    assert table.app_for(b"example.com") == "site"
    assert table.app_for(b"example.com:80") == "site"  # then the host without its port
    assert table.app_for(b"other.test") == "default"  # then "*"
    assert table.app_for(b"other.test:8443") == "default"
    assert table.app_for(b"www.example.com") == "default"  # no suffix matching


def test_app_for_without_wildcard() -> None:
    table = RouteTable.build({"example.com": "site"}, {"site": replicas("a")})
    assert table.app_for(b"example.com:1") == "site"
    assert table.app_for(b"unknown.test") is None
    assert table.app_for(b"") is None
    assert table.app_for(b"example.com:notaport") is None  # not a port: not stripped
    assert table.replicas("site") == replicas("a")
    assert table.replicas("nope") == []


def test_app_for_ipv6_literals() -> None:
    table = RouteTable.build({"[::1]": "local", "[2001:db8::1]:8080": "pinned", "127.0.0.1": "v4"}, {})
    assert table.app_for(b"[::1]") == "local"
    assert table.app_for(b"[::1]:8443") == "local"  # port stripped, brackets kept
    assert table.app_for(b"[2001:db8::1]:8080") == "pinned"
    assert table.app_for(b"[2001:db8::1]:9090") is None
    assert table.app_for(b"[2001:db8::1]") is None  # never mistaken for host "[2001:db8:" and port "1]"
    assert table.app_for(b"127.0.0.1:80") == "v4"


def test_build_lowercases_domains() -> None:
    table = RouteTable.build({"Example.COM": "site"}, {})
    assert table.app_for(b"example.com:443") == "site"


hostnames = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9]{1,10}){0,3}", fullmatch=True)


@given(host=hostnames, port=st.integers(min_value=0, max_value=65535), app=st.text(min_size=1, max_size=10))
def test_app_for_any_port_of_a_known_host(host: str, port: int, app: str) -> None:
    table = RouteTable.build({host: app, "*": "fallback"}, {})
    assert table.app_for(host.encode()) == app
    assert table.app_for(f"{host}:{port}".encode()) == app
    assert table.app_for(f"x{host}:{port}".encode()) == "fallback"
