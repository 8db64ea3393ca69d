"""AffinityHash: rendezvous hashing of an affinity key, with bounded load.

Synchronous tests and hypothesis properties for the policy, then one test
through a real proxy (loopback, port 0, bounded by ``trio.fail_after``) fed
by a RouteCache that changes under it.
"""

from __future__ import annotations

import collections
import functools
import math
import random
from collections.abc import Mapping, Sequence

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks import LocalReplica, Replica, Request, RouteCache, open_upstreams, serve_proxy, serve_worker
from blocks.routing import AffinityHash
from blocks.store import RouteEvent, encode_domain, encode_replica, route_key_for_domain, route_key_for_replica
from blocks.testing import serve_demo_replica

WORKER = ("127.0.0.1", 1)


def pool(n: int, prefix: str = "r") -> tuple[Replica, ...]:
    return tuple(Replica(name=f"{prefix}{i}", worker=WORKER, address=("127.0.0.1", 1000 + i)) for i in range(n))


def keyed(key: bytes, header: bytes = b"x-affinity-key") -> Request:
    return Request(b"GET", b"http", b"x", b"/", [(b"user-agent", b"t"), (header, key)])


def placement(policy: AffinityHash, candidates: Sequence[Replica], keys: list[bytes]) -> dict[bytes, str]:
    return {key: policy.pick(keyed(key), candidates, {}).name for key in keys}


KEYS = [b"session-%d" % i for i in range(4000)]


class Recording:
    def __init__(self) -> None:
        self.calls = 0

    def pick(self, request: Request, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        self.calls += 1
        return candidates[-1]


def test_without_a_key_the_fallback_picks() -> None:
    fallback = Recording()
    policy = AffinityHash(fallback=fallback)
    candidates = pool(5)
    assert policy.pick(Request(b"GET", b"http", b"x", b"/"), candidates, {}) is candidates[-1]
    assert policy.pick(keyed(b""), candidates, {}) is candidates[-1]  # an empty key is no key
    assert fallback.calls == 2
    policy.pick(keyed(b"k"), candidates, {})
    assert fallback.calls == 2


def test_the_default_fallback_is_least_in_flight() -> None:
    policy = AffinityHash()
    candidates = pool(4)
    in_flight = {"r0": 3, "r1": 3, "r2": 0, "r3": 3}
    assert {policy.pick(Request(b"GET", b"http", b"x", b"/"), candidates, in_flight).name for _ in range(50)} == {"r2"}
    assert "LeastInFlight" in repr(policy)


def test_a_key_goes_to_the_same_replica_every_time_and_everywhere() -> None:
    candidates = pool(10)
    first = placement(AffinityHash(), candidates, KEYS[:500])
    assert placement(AffinityHash(), candidates, KEYS[:500]) == first  # another proxy, same answer
    assert placement(AffinityHash(remember=0), list(candidates), KEYS[:500]) == first  # a list, nothing kept
    assert placement(AffinityHash(), tuple(reversed(candidates)), KEYS[:500]) == first  # order does not matter


def test_placements_are_pinned() -> None:
    # The hash is part of the contract: proxies of one fleet, and of two versions, must agree.
    candidates = pool(10)
    assert placement(AffinityHash(), candidates, [b"alice", b"bob", b"carol", b"session-42", b"\x00\xff"]) == {
        b"alice": "r4",
        b"bob": "r8",
        b"carol": "r4",
        b"session-42": "r2",
        b"\x00\xff": "r2",
    }


def test_the_header_is_configurable() -> None:
    policy = AffinityHash(header=b"X-Session")
    candidates = pool(10)
    picks = {policy.pick(keyed(b"alice", b"x-session"), candidates, {}).name for _ in range(20)}
    assert picks == {"r4"}


def test_keys_spread_evenly() -> None:
    counts = collections.Counter(placement(AffinityHash(), pool(10), KEYS).values())
    assert len(counts) == 10
    assert min(counts.values()) >= 320 and max(counts.values()) <= 480, counts  # 400 expected each


def test_removing_a_replica_moves_only_its_keys_and_spreads_them() -> None:
    candidates = pool(20)
    before = placement(AffinityHash(), candidates, KEYS)
    after = placement(AffinityHash(), candidates[:7] + candidates[8:], KEYS)
    moved = {key for key in KEYS if before[key] != after[key]}
    assert moved == {key for key in KEYS if before[key] == "r7"}
    assert 0.035 * len(KEYS) <= len(moved) <= 0.065 * len(KEYS), len(moved)  # 1/20 = 5%
    spread = collections.Counter(after[key] for key in moved)
    assert len(spread) >= 17, spread  # to their second choices, all over the pool


def test_adding_a_replica_moves_only_the_keys_it_wins() -> None:
    candidates = pool(20)
    before = placement(AffinityHash(), candidates, KEYS)
    after = placement(AffinityHash(), (*candidates, *pool(1, "new")), KEYS)
    moved = {key for key in KEYS if before[key] != after[key]}
    assert {after[key] for key in moved} == {"new0"}
    assert 0.035 * len(KEYS) <= len(moved) <= 0.06 * len(KEYS), len(moved)  # 1/21 = 4.8%


@settings(max_examples=60, deadline=None)
@given(n=st.integers(min_value=2, max_value=30), data=st.data())
def test_membership_changes_move_only_the_keys_concerned(n: int, data: st.DataObject) -> None:
    candidates = pool(n)
    keys = KEYS[:300]
    before = placement(AffinityHash(), candidates, keys)
    gone = data.draw(st.integers(min_value=0, max_value=n - 1))
    after = placement(AffinityHash(), candidates[:gone] + candidates[gone + 1 :], keys)
    assert {k for k in keys if before[k] != after[k]} == {k for k in keys if before[k] == f"r{gone}"}
    grown = placement(AffinityHash(), (*candidates, *pool(1, "new")), keys)
    assert {grown[k] for k in keys if before[k] != grown[k]} <= {"new0"}


def test_a_full_first_choice_spills_to_the_next_in_score_order() -> None:
    candidates = pool(6)
    request = keyed(b"alice")
    first = AffinityHash().pick(request, candidates, {})
    rest = tuple(r for r in candidates if r is not first)
    second = AffinityHash().pick(request, rest, {})
    policy = AffinityHash(load_factor=1.25)
    # 1 in flight, on the first choice: the bound is ceil(1.25 * 1 / 6) = 1, and 1 is not above it.
    assert policy.pick(request, candidates, {first.name: 1}) is first
    # 2 in flight there, 4 elsewhere: the bound is ceil(1.25 * 6 / 6) = 2.
    others = {r.name: 1 for r in rest[:4]}
    assert policy.pick(request, candidates, {first.name: 2} | others) is first
    # 3 there: the bound is ceil(1.25 * 7 / 6) = 2, and 3 is above it.
    assert policy.pick(request, candidates, {first.name: 3} | others) is second
    assert policy.pick(request, candidates, {first.name: 2}) is second  # ceil(1.25 * 2 / 6) = 1
    # With the second choice full too, the third.
    third = AffinityHash().pick(request, tuple(r for r in rest if r is not second), {})
    assert policy.pick(request, candidates, {first.name: 6, second.name: 6}) is third


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=12),
    load_factor=st.floats(min_value=1.0, max_value=3.0),
    ops=st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=2**16)), max_size=120),
)
def test_bounded_load_holds_whatever_the_keys(n: int, load_factor: float, ops: list[tuple[bool, int]]) -> None:
    # Hot keys (three of them, so most requests collide) and releases in any order.
    candidates = pool(n)
    policy = AffinityHash(load_factor=load_factor)
    in_flight: dict[str, int] = {}
    for is_pick, value in ops:
        busy = [name for name, load in in_flight.items() if load]
        if is_pick or not busy:
            mean = sum(in_flight.values()) / n  # before this request
            picked = policy.pick(keyed(b"hot-%d" % (value % 3)), candidates, in_flight)
            in_flight[picked.name] = in_flight.get(picked.name, 0) + 1
            assert in_flight[picked.name] <= math.ceil(load_factor * mean) + 1, (picked.name, in_flight)
        else:
            in_flight[busy[value % len(busy)]] -= 1


def test_an_idle_first_choice_is_always_kept() -> None:
    candidates = pool(8)
    policy = AffinityHash(load_factor=1.0)
    first = policy.pick(keyed(b"k"), candidates, {})
    loaded = {r.name: 50 for r in candidates if r is not first}
    assert policy.pick(keyed(b"k"), candidates, loaded) is first


@pytest.mark.parametrize("load_factor", [0.99, math.inf, math.nan, -1.0])
def test_load_factor_must_be_at_least_one(load_factor: float) -> None:
    with pytest.raises(ValueError):
        AffinityHash(load_factor=load_factor)


def test_remembered_choices_follow_the_cache() -> None:
    # A RouteCache hands out a new tuple when an app changes; remembered first choices never outlive it.
    cache = RouteCache()
    cache.load(
        {route_key_for_replica("app", r.name): encode_replica(worker=WORKER, address=r.address) for r in pool(10)},
        1,
        0.0,
    )
    policy = AffinityHash(remember=2)
    home = policy.pick(keyed(b"alice"), cache.replicas("app"), {}).name
    for key in KEYS[:20]:  # more keys than it remembers: it forgets, never errs
        assert (
            policy.pick(keyed(key), cache.replicas("app"), {}).name == placement(AffinityHash(), pool(10), [key])[key]
        )
    cache.apply([RouteEvent("delete", route_key_for_replica("app", home), None, 2)], 1.0)
    moved = policy.pick(keyed(b"alice"), cache.replicas("app"), {}).name
    assert moved != home
    cache.apply(
        [RouteEvent("put", route_key_for_replica("app", home), encode_replica(worker=WORKER, address=WORKER), 3)], 2.0
    )
    assert policy.pick(keyed(b"alice"), cache.replicas("app"), {}).name == home


def test_many_candidate_tuples_are_kept_bounded() -> None:
    policy = AffinityHash()
    rng = random.Random(0)
    for i in range(200):  # more tuples than it keeps seeds for
        candidates = pool(rng.randint(2, 6))
        assert policy.pick(keyed(b"k%d" % i), candidates, {}) in candidates


# -- through a proxy --------------------------------------------------------------------------


async def test_the_proxy_keeps_a_key_on_its_replica_until_the_cache_drops_it(nursery: trio.Nursery) -> None:
    with trio.fail_after(20):
        local: dict[str, LocalReplica] = {}
        for name in ("replica-0", "replica-1", "replica-2"):
            server = await nursery.start(serve_demo_replica, name)
            local[name] = LocalReplica(("127.0.0.1", server.port))
        worker_server, _ = await nursery.start(serve_worker, local)
        worker = ("127.0.0.1", worker_server.port)
        cache = RouteCache()
        snapshot = {route_key_for_domain("chat.example"): encode_domain("chat")}
        for name, replica in local.items():
            snapshot[route_key_for_replica("chat", name)] = encode_replica(worker=worker, address=replica.address)
        cache.load(snapshot, 1, trio.current_time())
        proxy_server, proxy = await nursery.start(functools.partial(serve_proxy, cache, policy=AffinityHash()))
        address = ("127.0.0.1", proxy_server.port)

        async with open_upstreams() as upstreams:

            async def replica_for(key: bytes | None) -> bytes | None:
                headers = [] if key is None else [(b"x-affinity-key", key)]
                request = Request(b"GET", b"http", b"chat.example", b"/")
                response = await upstreams.request(address, request, headers)
                await response.body.read_all()
                assert response.status == 200
                return response.header(b"x-replica")

            homes = {key: await replica_for(key) for key in (b"alice", b"bob", b"carol", b"dave")}
            for key, home in homes.items():
                for _ in range(3):
                    assert await replica_for(key) == home
            alice = homes[b"alice"]
            assert alice is not None
            delete = RouteEvent("delete", route_key_for_replica("chat", alice.decode()), None, 2)
            cache.apply([delete], trio.current_time())
            moved = await replica_for(b"alice")
            assert moved not in (None, alice)
            for key, home in homes.items():  # the others stay where they were, unless they were on it too
                if home != alice:
                    assert await replica_for(key) == home
            assert await replica_for(None) in {name.encode() for name in local} - {alice}
    assert sum(proxy.statistics().in_flight.values()) == 0
