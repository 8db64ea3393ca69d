"""Sans-IO routing: route tables and the route cache, the store layout, and the load-based policies.

Synchronous tests and hypothesis properties; no sockets, no clock (``now``
is a plain number). Affinity has its own file, tests/test_affinity.py.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks import LeastInFlight, Replica, Request, RouteCache, Routes, RouteTable
from blocks.routing import PowerOfTwo, RoundRobin
from blocks.store import (
    DEMAND_PREFIX,
    Demand,
    RouteEvent,
    decode_demand,
    decode_domain,
    decode_replica,
    demand_key,
    encode_demand,
    encode_domain,
    encode_replica,
    parse_demand_key,
    route_key_for_domain,
    route_key_for_replica,
)

WORKER = ("127.0.0.1", 1)
REQUEST = Request(b"GET", b"http", b"x", b"/")


def replicas(*names: str) -> list[Replica]:
    return [Replica(name=name, worker=WORKER, address=("127.0.0.1", 1000 + i)) for i, name in enumerate(names)]


def pool(n: int) -> tuple[Replica, ...]:
    return tuple(replicas(*(f"r{i}" for i in range(n))))


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
        assert {policy.pick(REQUEST, candidates, in_flight).name for _ in range(200)} == {expected}, in_flight


def test_least_in_flight_with_one_candidate() -> None:
    (only,) = replicas("only")
    assert LeastInFlight(random.Random(0)).pick(REQUEST, [only], {"only": 99}) is only


def test_least_in_flight_spreads_ties_evenly() -> None:
    policy = LeastInFlight(random.Random(20240601))
    candidates = replicas("a", "b", "c", "d")
    in_flight = {"a": 2, "b": 2, "c": 7, "d": 2}
    counts = collections.Counter(policy.pick(REQUEST, candidates, in_flight).name for _ in range(3000))
    assert counts["c"] == 0
    # 1000 expected each; the bounds are over six standard deviations wide.
    for name in "abd":
        assert 850 <= counts[name] <= 1150, counts


def test_least_in_flight_spreads_ties_when_nothing_is_in_flight() -> None:
    policy = LeastInFlight(random.Random(7))
    candidates = replicas("a", "b")
    counts = collections.Counter(policy.pick(REQUEST, candidates, {}).name for _ in range(2000))
    assert 880 <= counts["a"] <= 1120, counts
    assert counts["a"] + counts["b"] == 2000


def test_least_in_flight_is_reproducible_with_a_seed() -> None:
    candidates = replicas("a", "b", "c")
    policy_1, policy_2 = LeastInFlight(random.Random(5)), LeastInFlight(random.Random(5))
    run_1 = [policy_1.pick(REQUEST, candidates, {}).name for _ in range(100)]
    run_2 = [policy_2.pick(REQUEST, candidates, {}).name for _ in range(100)]
    assert run_1 == run_2
    assert len(set(run_1)) == 3


def test_least_in_flight_in_a_large_pool_spreads_over_the_idle_ones() -> None:
    # 40 candidates: the sampling path. The 10 idle ones are the only minimums; each gets ~1/10.
    candidates = pool(40)
    in_flight = {r.name: (0 if i % 4 == 0 else 1 + i % 3) for i, r in enumerate(candidates)}
    policy = LeastInFlight(random.Random(11))
    counts = collections.Counter(policy.pick(REQUEST, candidates, in_flight).name for _ in range(5000))
    assert set(counts) == {r.name for i, r in enumerate(candidates) if i % 4 == 0}
    assert min(counts.values()) >= 380 and max(counts.values()) <= 620, counts  # 500 expected each


def test_least_in_flight_in_a_large_busy_pool_still_finds_the_minimum() -> None:
    candidates = pool(100)
    in_flight = {r.name: 5 for r in candidates} | {"r37": 2, "r80": 2, "r90": 3}
    policy = LeastInFlight(random.Random(3))
    assert {policy.pick(REQUEST, candidates, in_flight).name for _ in range(300)} == {"r37", "r80"}


@given(
    loads=st.lists(st.integers(min_value=0, max_value=5) | st.none(), min_size=1, max_size=40),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_least_in_flight_always_picks_a_minimum(loads: list[int | None], seed: int) -> None:
    candidates = replicas(*(f"r{i}" for i in range(len(loads))))
    in_flight = {f"r{i}": load for i, load in enumerate(loads) if load is not None}
    picked = LeastInFlight(random.Random(seed)).pick(REQUEST, candidates, in_flight)
    assert picked in candidates
    assert in_flight.get(picked.name, 0) == min(in_flight.get(r.name, 0) for r in candidates)


# -- PowerOfTwo ---------------------------------------------------------------------------


def test_power_of_two_with_two_candidates_always_takes_the_less_loaded() -> None:
    policy = PowerOfTwo(random.Random(1))
    candidates = replicas("a", "b")
    assert {policy.pick(REQUEST, candidates, {"a": 3, "b": 2}).name for _ in range(100)} == {"b"}
    assert {policy.pick(REQUEST, candidates, {"a": 0}).name for _ in range(100)} == {"a", "b"}
    (only,) = replicas("only")
    assert policy.pick(REQUEST, [only], {}) is only


def test_power_of_two_spreads_evenly_when_idle() -> None:
    policy = PowerOfTwo(random.Random(2))
    candidates = pool(5)
    counts = collections.Counter(policy.pick(REQUEST, candidates, {}).name for _ in range(5000))
    assert len(counts) == 5 and min(counts.values()) >= 850, counts  # 1000 expected each


def test_power_of_two_prefers_the_idle_side_of_a_pool() -> None:
    # Half the pool busy: a busy replica is taken only when both draws are busy (1/4 minus the diagonal).
    policy = PowerOfTwo(random.Random(4))
    candidates = pool(20)
    in_flight = {f"r{i}": 3 for i in range(10)}
    busy = sum(policy.pick(REQUEST, candidates, in_flight).name in in_flight for _ in range(4000))
    assert 0.17 * 4000 <= busy <= 0.30 * 4000, busy  # 9/38 = 0.237 expected


@given(
    loads=st.lists(st.integers(min_value=0, max_value=6), min_size=2, max_size=30),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_power_of_two_never_picks_a_lone_maximum(loads: list[int], seed: int) -> None:
    candidates = pool(len(loads))
    in_flight = {f"r{i}": load for i, load in enumerate(loads)}
    policy = PowerOfTwo(random.Random(seed))
    top = max(loads)
    for _ in range(20):
        picked = policy.pick(REQUEST, candidates, in_flight)
        assert picked in candidates
        if loads.count(top) == 1 and len(set(loads)) > 1:
            assert in_flight[picked.name] < top


# -- RoundRobin ---------------------------------------------------------------------------


def test_round_robin_gives_each_candidate_its_turn() -> None:
    policy = RoundRobin()
    candidates = pool(7)
    picks = [policy.pick(REQUEST, candidates, {"r0": 50}).name for _ in range(7 * 30)]
    assert picks[:7] == [f"r{i}" for i in range(7)]  # in order, whatever the load
    assert collections.Counter(picks) == {f"r{i}": 30 for i in range(7)}


def test_round_robin_keeps_one_rotation_per_app() -> None:
    # Two apps of two replicas, alternating: a shared counter would send every request to index 0.
    policy = RoundRobin()
    app_a, app_b = tuple(replicas("a0", "a1")), tuple(replicas("b0", "b1"))
    picks = [policy.pick(REQUEST, app, {}).name for _ in range(10) for app in (app_a, app_b)]
    assert collections.Counter(picks) == {"a0": 5, "a1": 5, "b0": 5, "b1": 5}


@given(sizes=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=20))
def test_round_robin_is_fair_over_any_whole_number_of_rounds(sizes: list[int]) -> None:
    policy = RoundRobin()
    for n in sizes:  # the app's pool changes size between rounds; each round is still exact
        candidates = pool(n)
        counts = collections.Counter(policy.pick(REQUEST, candidates, {}).name for _ in range(3 * n))
        assert counts == {r.name: 3 for r in candidates}


# -- Replica and the store layout ---------------------------------------------------------


def test_replica_defaults_keep_old_constructor_calls_working() -> None:
    replica = Replica(name="r", worker=WORKER, address=("127.0.0.1", 2))
    assert (replica.protocol, replica.capacity, replica.state) == ("h2", 0, "live")
    for bad in [{"state": "gone"}, {"capacity": -1}, {"protocol": "h3"}]:
        with pytest.raises((ValueError, TypeError)):
            Replica(name="r", worker=WORKER, address=WORKER, **bad)  # type: ignore[arg-type]


def test_keys_and_values_round_trip() -> None:
    assert route_key_for_domain("Example.COM:8443") == "domains/example.com:8443"
    assert route_key_for_domain("*") == "domains/*"
    assert route_key_for_replica("chat", "chat-7") == "apps/chat/replicas/chat-7"
    for bad in ["", "a/b"]:
        with pytest.raises(ValueError):
            route_key_for_domain(bad)
        with pytest.raises(ValueError):
            route_key_for_replica(bad, "r")
        with pytest.raises(ValueError):
            route_key_for_replica("app", bad)
    assert decode_domain(encode_domain("chat")) == "chat"
    value = encode_replica(worker=("10.0.0.5", 9000), address="[::1]:8001", protocol="h1", capacity=8, state="draining")
    assert value == (
        b'{"address":"[::1]:8001","capacity":8,"protocol":"h1","state":"draining","worker":"10.0.0.5:9000"}'
    )
    assert decode_replica("r", value) == Replica(
        name="r", worker=("10.0.0.5", 9000), address=("::1", 8001), protocol="h1", capacity=8, state="draining"
    )
    ipv6 = encode_replica(worker=("::1", 9000), address=("127.0.0.1", 1))
    assert decode_replica("r", ipv6).worker == ("::1", 9000)


@pytest.mark.parametrize(
    "fields",
    [
        {"worker": "nohost", "address": "h:1"},
        {"worker": ("h", 0), "address": "h:1"},
        {"worker": "h:1", "address": "::1:80"},  # IPv6 without brackets
        {"worker": "h:1", "address": "h:1", "protocol": "h3"},
        {"worker": "h:1", "address": "h:1", "state": "up"},
        {"worker": "h:1", "address": "h:1", "capacity": -1},
        {"worker": "h:1", "address": "h:1", "capacity": True},
    ],
)
def test_encode_replica_refuses_what_the_cache_would_ignore(fields: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        encode_replica(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"{", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_000, "not JSON"),  # too deep for the parser: still just a bad value
        (b"[]", "not a JSON object"),
        (b'{"address": "h:1"}', "bad worker"),
        (b'{"worker": "h:1", "address": 5}', "bad address"),
        (b'{"worker": "h:1", "address": "h:1", "protocol": "h3"}', "bad protocol"),
        (b'{"worker": "h:1", "address": "h:1", "capacity": 1.5}', "bad capacity"),
        (b'{"worker": "h:1", "address": "h:1", "state": "gone"}', "bad state"),
    ],
)
def test_decode_replica_says_why(value: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=f"^{reason}$"):
        decode_replica("r", value)


def test_decode_tolerates_missing_optional_and_unknown_fields() -> None:
    replica = decode_replica("r", b'{"worker": "h:1", "address": "h:2", "zone": "eu-1"}')
    assert (replica.protocol, replica.capacity, replica.state) == ("h2", 0, "live")


# -- the read API: RouteTable and RouteCache alike ----------------------------------------


def table_routes(domains: dict[str, str], apps: dict[str, list[Replica]]) -> Routes:
    return RouteTable.build(domains, apps)


def cache_routes(domains: dict[str, str], apps: dict[str, list[Replica]]) -> Routes:
    snapshot = {route_key_for_domain(domain): encode_domain(app) for domain, app in domains.items()}
    for app, members in apps.items():
        for r in members:
            snapshot[route_key_for_replica(app, r.name)] = encode_replica(worker=r.worker, address=r.address)
    cache = RouteCache()
    cache.load(snapshot, 1, 0.0)
    return cache


MakeRoutes = Callable[[dict[str, str], dict[str, list[Replica]]], Routes]
both = pytest.mark.parametrize("make", [table_routes, cache_routes], ids=["table", "cache"])


@both
def test_app_for_exact_authority_then_host_then_wildcard(make: MakeRoutes) -> None:
    routes = make({"example.com": "site", "example.com:8443": "admin", "*": "default"}, {})
    assert routes.app_for(b"example.com:8443") == "admin"  # the authority as sent wins
    assert routes.app_for(b"example.com") == "site"
    assert routes.app_for(b"example.com:80") == "site"  # then the host without its port
    assert routes.app_for(b"other.test") == "default"  # then "*"
    assert routes.app_for(b"other.test:8443") == "default"
    assert routes.app_for(b"www.example.com") == "default"  # no suffix matching


@both
def test_app_for_without_wildcard(make: MakeRoutes) -> None:
    routes = make({"example.com": "site"}, {"site": replicas("a")})
    assert routes.app_for(b"example.com:1") == "site"
    assert routes.app_for(b"unknown.test") is None
    assert routes.app_for(b"") is None
    assert routes.app_for(b"example.com:notaport") is None  # not a port: not stripped
    assert list(routes.replicas("site")) == replicas("a")
    assert not routes.replicas("nope")


@both
def test_app_for_ipv6_literals(make: MakeRoutes) -> None:
    routes = make({"[::1]": "local", "[2001:db8::1]:8080": "pinned", "127.0.0.1": "v4"}, {})
    assert routes.app_for(b"[::1]") == "local"
    assert routes.app_for(b"[::1]:8443") == "local"  # port stripped, brackets kept
    assert routes.app_for(b"[2001:db8::1]:8080") == "pinned"
    assert routes.app_for(b"[2001:db8::1]:9090") is None
    assert routes.app_for(b"[2001:db8::1]") is None  # never mistaken for host "[2001:db8:" and port "1]"
    assert routes.app_for(b"127.0.0.1:80") == "v4"


@both
def test_domains_are_lowercased(make: MakeRoutes) -> None:
    routes = make({"Example.COM": "site"}, {})
    assert routes.app_for(b"example.com:443") == "site"


hostnames = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?(\.[a-z0-9]{1,10}){0,3}", fullmatch=True)


@given(
    host=hostnames,
    port=st.integers(min_value=0, max_value=65535),
    app=st.from_regex(r"[a-z0-9-]{1,10}", fullmatch=True),
)
def test_app_for_any_port_of_a_known_host(host: str, port: int, app: str) -> None:
    for make in (table_routes, cache_routes):
        routes = make({host: app, "*": "fallback"}, {})
        assert routes.app_for(host.encode()) == app
        assert routes.app_for(f"{host}:{port}".encode()) == app
        assert routes.app_for(f"x{host}:{port}".encode()) == "fallback"


# -- RouteCache ---------------------------------------------------------------------------


def replica_value(port: int, state: str = "live") -> bytes:
    return encode_replica(worker=("127.0.0.1", 9000), address=("127.0.0.1", port), state=state)


def put(key: str, value: bytes, revision: int) -> RouteEvent:
    return RouteEvent("put", key, value, revision)


def delete(key: str, revision: int) -> RouteEvent:
    return RouteEvent("delete", key, None, revision)


def names(routes: Sequence[Replica]) -> list[str]:
    return [r.name for r in routes]


CHAT_1, CHAT_2, CHAT_3 = (route_key_for_replica("chat", f"chat-{i}") for i in (1, 2, 3))
GAME_1 = route_key_for_replica("game", "game-1")


def loaded() -> RouteCache:
    cache = RouteCache()
    cache.load(
        {
            route_key_for_domain("chat.example"): encode_domain("chat"),
            route_key_for_domain("*"): encode_domain("game"),
            CHAT_2: replica_value(8002),
            CHAT_1: replica_value(8001),
            CHAT_3: replica_value(8003, "draining"),
            GAME_1: replica_value(8100),
        },
        revision=10,
        now=100.0,
    )
    return cache


def test_the_cache_offers_live_replicas_sorted_by_name() -> None:
    cache = loaded()
    assert cache.app_for(b"chat.example") == "chat"
    assert cache.app_for(b"other.example") == "game"
    assert names(cache.replicas("chat")) == ["chat-1", "chat-2"]  # chat-3 drains
    assert isinstance(cache.replicas("chat"), tuple)
    assert cache.replicas("unknown") == ()
    stats = cache.statistics()
    assert (stats.revision, stats.domains, stats.apps, stats.replicas, stats.live) == (10, 2, 2, 4, 3)
    assert stats.bad_values == {} and stats.staleness == 0.0
    assert repr(cache) == "<RouteCache revision=10 domains=2 apps=2 in_sync=True>"


def test_apply_changes_routes_in_order() -> None:
    cache = loaded()
    cache.apply(
        [
            put(CHAT_3, replica_value(8003, "live"), 11),  # back from draining
            delete(CHAT_1, 12),
            put(route_key_for_domain("chat.example"), encode_domain("game"), 13),
            put(route_key_for_replica("new", "new-1"), replica_value(8200), 13),  # same revision: one transaction
        ],
        now=101.0,
    )
    assert cache.revision == 13
    assert names(cache.replicas("chat")) == ["chat-2", "chat-3"]
    assert cache.app_for(b"chat.example") == "game"
    assert names(cache.replicas("new")) == ["new-1"]
    cache.apply([delete(route_key_for_replica("new", "new-1"), 14), delete("domains/never-there", 15)], 102.0)
    assert cache.replicas("new") == ()
    assert cache.statistics().apps == 2  # an app whose last replica went is forgotten
    assert cache.revision == 15


def test_apply_skips_events_already_seen() -> None:
    cache = loaded()
    cache.apply([delete(CHAT_1, 11)], 101.0)
    cache.apply(
        [
            put(CHAT_1, replica_value(8001), 11),  # a duplicate of revision 11 (as a put, even): skipped
            put(CHAT_1, replica_value(8001), 9),  # from before the snapshot: skipped
            delete(CHAT_2, 13),
            put(CHAT_2, replica_value(8002), 12),  # behind one already applied in this batch: skipped
        ],
        102.0,
    )
    assert names(cache.replicas("chat")) == []
    assert cache.revision == 13
    assert cache.statistics().ignored_events == 3
    cache.apply([], 103.0)
    assert cache.revision == 13


def test_only_the_apps_an_event_touches_are_rebuilt() -> None:
    cache = loaded()
    chat, game = cache.replicas("chat"), cache.replicas("game")
    rebuilds = cache.statistics().rebuilds
    cache.apply(
        [put(GAME_1, replica_value(8101), 11), put(route_key_for_domain("x.example"), encode_domain("chat"), 12)], 1.0
    )
    assert cache.replicas("chat") is chat
    assert cache.replicas("game") is not game and cache.replicas("game")[0].address == ("127.0.0.1", 8101)
    assert cache.statistics().rebuilds == rebuilds + 1
    # A change that leaves the live tuple equal keeps the very same object (policies key on it).
    cache.apply([put(CHAT_3, replica_value(8003, "down"), 13)], 2.0)
    assert cache.replicas("chat") is chat
    assert cache.statistics().rebuilds == rebuilds + 1
    # And so does a reload with the same contents.
    cache.load({k: v for k, v in [(CHAT_1, replica_value(8001)), (CHAT_2, replica_value(8002))]}, 20, 3.0)
    assert cache.replicas("chat") is chat
    assert cache.replicas("game") == ()


def test_load_replaces_everything() -> None:
    cache = loaded()
    cache.load({route_key_for_domain("solo.example"): encode_domain("solo")}, revision=3, now=1.0)
    assert cache.app_for(b"chat.example") is None
    assert cache.replicas("chat") == ()
    assert cache.revision == 3  # a reload sets the revision, lower or not
    stats = cache.statistics()
    assert (stats.domains, stats.apps, stats.replicas, stats.live) == (1, 0, 0, 0)


def test_bad_values_are_ignored_for_their_key_and_counted() -> None:
    cache = loaded()
    cache.apply(
        [
            put(CHAT_1, b"{not json", 11),  # a bad write drops the key's route
            put(route_key_for_domain("chat.example"), b'{"app": 7}', 12),
            put("apps/chat/replica/typo", replica_value(1), 13),
            put("elsewhere", b"{}", 14),
            put(route_key_for_replica("chat", "chat-9"), b'{"worker": "h:1"}', 15),
            RouteEvent("put", route_key_for_replica("chat", "chat-8"), None, 16),
        ],
        101.0,
    )
    assert names(cache.replicas("chat")) == ["chat-2"]
    assert cache.app_for(b"chat.example") == "game"  # falls to "*" now
    assert cache.statistics().bad_values == {
        "not JSON": 1,
        "bad app": 1,
        "unknown key": 2,
        "bad address": 1,
        "no value": 1,
    }
    cache.apply([put(CHAT_1, replica_value(8001), 17)], 102.0)  # fixed by the next write
    assert names(cache.replicas("chat")) == ["chat-1", "chat-2"]


def test_demand_records_beside_the_routes_are_no_routes_and_no_bad_values() -> None:
    """An embedded store holds what proxies publish for an autoscaler beside the routes: the cache skips it."""
    key = DEMAND_PREFIX + demand_key("chat", "proxy-1")
    cache = RouteCache()
    cache.load({key: encode_demand(Demand(requests=3)), route_key_for_domain("*"): encode_domain("chat")}, 1, 0.0)
    heard: list[frozenset[str]] = []
    cache.add_listener(heard.append)
    cache.apply([put(key, b"{not json", 2), RouteEvent("delete", key, None, 3)], 1.0)
    stats = cache.statistics()
    assert (stats.bad_values, stats.domains, stats.apps, stats.revision, heard) == ({}, 1, 0, 3, [])


def test_demand_records_round_trip_and_say_what_is_wrong() -> None:
    assert demand_key("chat", "proxy-1") == "chat/proxy-1"
    assert parse_demand_key("chat/proxy-1") == ("chat", "proxy-1")
    demand = Demand(requests=2, sessions=5)
    assert decode_demand(encode_demand(demand)) == demand
    assert demand + Demand(1, 1) == Demand(3, 6) and demand.total == 7
    assert not Demand() and Demand(sessions=1)
    assert decode_demand(b'{"sessions": 4, "newer": true}') == Demand(sessions=4)  # missing 0, unknown ignored
    for bad, reason in [(b"{", "not JSON"), (b"[]", "not a JSON object"), (b'{"requests": -1}', "bad count")]:
        with pytest.raises(ValueError, match=reason):
            decode_demand(bad)
    with pytest.raises(ValueError, match="bad count"):
        decode_demand(b'{"requests": true}')
    for key in ("chat", "chat/", "/p", "chat/p/x"):
        with pytest.raises(ValueError, match="unknown key"):
            parse_demand_key(key)
    with pytest.raises(ValueError, match="without '/'"):
        demand_key("a/b", "p")
    with pytest.raises(ValueError, match="ints >= 0"):
        encode_demand(Demand(requests=-1))


def test_uppercase_domain_keys_are_unknown() -> None:
    cache = RouteCache()
    cache.load({"domains/Example.com": encode_domain("a")}, 1, 0.0)
    assert cache.app_for(b"example.com") is None
    assert cache.statistics().bad_values == {"unknown key": 1}


def test_staleness() -> None:
    cache = RouteCache()
    assert cache.staleness(5.0) == float("inf")  # never loaded
    cache.load({}, 1, 10.0)
    assert cache.staleness(50.0) == 0.0  # in sync, however long nothing changes
    cache.unsynced(60.0)
    assert cache.staleness(70.0) == 60.0  # since the load confirmed it
    assert cache.statistics().staleness == 50.0  # at the latest now it was given
    assert cache.statistics(now=75.0).staleness == 65.0
    cache.synced(80.0)  # a progress notification after a reconnect
    assert cache.staleness(90.0) == 0.0
    cache.unsynced(95.0)
    cache.apply([], 100.0)  # an event batch confirms too
    assert cache.staleness(200.0) == 0.0


def test_route_event_kind_is_checked() -> None:
    with pytest.raises(ValueError):
        RouteEvent("update", "k", b"v", 1)  # type: ignore[arg-type]


# -- the cache against a model of the store ------------------------------------------------

DOMAINS = ["a.test", "b.test:8443", "*"]
APPS = ["app1", "app2", "app3"]
DOMAIN_KEYS = [route_key_for_domain(d) for d in DOMAINS]
REPLICA_KEYS = {route_key_for_replica(app, f"r{i}"): (app, f"r{i}") for app in APPS for i in range(3)}
KEYS = [*DOMAIN_KEYS, *REPLICA_KEYS, "junk", "apps/app1/replicas/"]
DOMAIN_VALUES = {encode_domain(app): app for app in APPS}
REPLICA_VALUES = {replica_value(8000 + i, state): (8000 + i, state) for i in range(2) for state in ("live", "down")}
VALUES = [*DOMAIN_VALUES, *REPLICA_VALUES, b"{", b"[]", b'{"app": ""}']
QUERIES = [b"a.test", b"a.test:80", b"b.test:8443", b"b.test", b"c.test"]


def expected_app(store: dict[str, bytes], authority: bytes) -> str | None:
    """The store's answer, worked out without the cache's code: exact, host, '*'."""
    domains = {
        key.removeprefix("domains/").encode(): DOMAIN_VALUES[value]
        for key, value in store.items()
        if key in DOMAIN_KEYS and value in DOMAIN_VALUES
    }
    host = authority.rsplit(b":", 1)[0]
    for candidate in (authority, host, b"*"):
        if candidate in domains:
            return domains[candidate]
    return None


def expected_replicas(store: dict[str, bytes], app: str) -> tuple[Replica, ...]:
    found = []
    for key, value in store.items():
        if key in REPLICA_KEYS and REPLICA_KEYS[key][0] == app and value in REPLICA_VALUES:
            port, state = REPLICA_VALUES[value]
            if state == "live":
                found.append(
                    Replica(name=REPLICA_KEYS[key][1], worker=("127.0.0.1", 9000), address=("127.0.0.1", port))
                )
    return tuple(sorted(found, key=lambda r: r.name))


Change = tuple[str, bytes | None, bool]  # key, value (None: delete), in the previous change's transaction
Step = tuple[str, list[Change], int]  # "batch" or "reload", its changes, how many old events to replay

change: st.SearchStrategy[Change] = st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES) | st.none(), st.booleans())
step: st.SearchStrategy[Step] = st.one_of(
    st.tuples(st.just("batch"), st.lists(change, max_size=6), st.integers(min_value=0, max_value=4)),
    st.tuples(st.just("reload"), st.just([]), st.integers(min_value=0, max_value=4)),
)


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(step, min_size=1, max_size=12), seed=st.integers(min_value=0, max_value=2**32))
def test_the_cache_equals_the_store_after_any_history(steps: list[Step], seed: int) -> None:
    rng = random.Random(seed)
    store: dict[str, bytes] = {}
    revision = 0
    history: list[RouteEvent] = []
    cache = RouteCache()
    cache.load({}, 0, 0.0)
    for now, (kind, changes, replays) in enumerate(steps, start=1):
        before = {app: cache.replicas(app) for app in APPS}
        touched: set[str] = set()
        if kind == "reload":
            cache.load(dict(store), revision, float(now))
            events = rng.sample(history, min(replays, len(history)))  # late duplicates, all stale now
            cache.apply(events, float(now))
        else:
            events = []
            for key, value, same_transaction in changes:
                if not (same_transaction and events and all(e.key != key for e in events if e.revision == revision)):
                    revision += 1
                if value is None:
                    store.pop(key, None)
                    event = RouteEvent("delete", key, None, revision)
                else:
                    store[key] = value
                    event = RouteEvent("put", key, value, revision)
                events.append(event)
                if rng.random() < 0.3:
                    events.append(event)  # delivered twice in a row
                if key in REPLICA_KEYS:
                    touched.add(REPLICA_KEYS[key][0])
            for old in rng.sample(history, min(replays, len(history))):
                events.insert(rng.randrange(len(events) + 1), old)  # replays from before this batch
            history.extend(e for e in events if e not in history)
            cache.apply(events, float(now))
            for app in set(APPS) - touched:
                assert cache.replicas(app) is before[app], f"{app} rebuilt though no event touched it"
        assert cache.revision == revision
        for authority in QUERIES:
            assert cache.app_for(authority) == expected_app(store, authority), (authority, store)
        for app in APPS:
            assert cache.replicas(app) == expected_replicas(store, app), (app, store)
        stats = cache.statistics()
        assert stats.live == sum(len(expected_replicas(store, app)) for app in APPS)
        assert stats.replicas == sum(1 for k, v in store.items() if k in REPLICA_KEYS and v in REPLICA_VALUES)
        assert stats.staleness == 0.0


def test_route_cache_listeners_hear_the_apps_whose_live_replicas_changed() -> None:
    cache = RouteCache()
    heard: list[frozenset[str]] = []
    remove = cache.add_listener(heard.append)

    def failing(apps: frozenset[str]) -> None:
        raise RuntimeError("a bug in a listener")

    cache.add_listener(failing)  # logged; the others still hear, and the cache still applies
    worker = ("127.0.0.1", 9000)
    live = encode_replica(worker=worker, address=("127.0.0.1", 8001))
    cache.load({route_key_for_replica("a", "a-0"): live}, revision=1, now=0.0)
    cache.apply([RouteEvent("put", route_key_for_domain("b.test"), encode_domain("b"), 2)], 0.0)  # no replica
    cache.apply(
        [
            RouteEvent("put", route_key_for_replica("b", "b-0"), live, 3),
            RouteEvent("put", route_key_for_replica("a", "a-0"), live, 3),  # the same: no change for a
        ],
        0.0,
    )
    draining = encode_replica(worker=worker, address=("127.0.0.1", 8001), state="draining")
    cache.apply([RouteEvent("put", route_key_for_replica("a", "a-0"), draining, 4)], 0.0)
    assert heard == [frozenset({"a"}), frozenset({"b"}), frozenset({"a"})]
    assert cache.replicas("b") and not cache.replicas("a")
    remove()
    cache.apply([RouteEvent("delete", route_key_for_replica("b", "b-0"), None, 5)], 0.0)
    assert len(heard) == 3
