"""The autoscaler's sans-IO policy: how many replicas, which to drain, and cold starts.

Synchronous tests and hypothesis properties, outside any trio run: ``now``
is a plain float passed in, and no process is started. The trio driver
(real replica processes, the routes, cold starts through a proxy) is
tested in tests/test_autoscaler.py.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks.autoscaler import AutoscalePolicy, Decision, Phase, ScalingConfig

APP = "llm"
PHASES: tuple[Phase, ...] = ("starting", "ready", "draining")


def policy(**config: object) -> AutoscalePolicy:
    defaults: dict[str, object] = {"target_concurrency": 4.0, "up_window": 1.0, "down_window": 10.0}
    return AutoscalePolicy({APP: ScalingConfig(**{**defaults, **config})})  # type: ignore[arg-type]


class Fleet:
    """Carries out decisions the way a driver would: starts become ready at once, drains go at once."""

    def __init__(self, p: AutoscalePolicy) -> None:
        self.p = p
        self.n = 0

    def act(self, decision: Decision, now: float) -> None:
        for name in decision.drain:
            self.p.draining(APP, name, now)
            self.p.gone(APP, name, now)
        for _ in range(decision.start):
            name = f"{APP}-{self.n}"
            self.n += 1
            self.p.starting(APP, name, now)
            self.p.ready(APP, name, now)

    def step(self, now: float) -> Decision:
        decision = self.p.decide(APP, now)
        self.act(decision, now)
        return decision


def ready(p: AutoscalePolicy) -> int:
    return p.statistics(0.0).apps[APP].ready


# -- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"target_concurrency": 0}, "target_concurrency"),
        ({"target_concurrency": math.inf}, "target_concurrency"),
        ({"target_concurrency": 1, "min_replicas": 3, "max_replicas": 2}, "max_replicas"),
        ({"target_concurrency": 1, "max_replicas": 0}, "max_replicas"),
        ({"target_concurrency": 1, "up_window": 5, "down_window": 1}, "down_window"),
        ({"target_concurrency": 1, "hysteresis": 1}, "hysteresis"),
        ({"target_concurrency": 1, "idle_timeout": 0}, "idle_timeout"),
        ({"target_concurrency": 1, "unit": "bytes"}, "unit"),
        ({"target_concurrency": 1, "scale_up_factor": 0.5}, "scale_up_factor"),
        ({"target_concurrency": 1, "scale_up_step": 0}, "scale_up_step"),
    ],
)
def test_a_bad_scaling_config_says_which_field(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ScalingConfig(**config)  # type: ignore[arg-type]


def test_a_policy_needs_an_app_and_knows_only_its_own() -> None:
    with pytest.raises(ValueError, match="at least one app"):
        AutoscalePolicy({})
    with pytest.raises(KeyError):
        policy().decide("other", 0.0)
    policy().touch("other", 0.0)  # a request path call never raises for an app it does not scale
    with pytest.raises(ValueError, match="no default"):
        policy().add("other")


def test_a_policy_with_a_default_takes_on_an_app_at_its_first_mention() -> None:
    """A trace names apps as it goes: with ``default``, the first mention of one adds it."""
    default = ScalingConfig(target_concurrency=2, up_window=1, down_window=5)
    p = AutoscalePolicy(default=default)
    assert p.apps == []
    assert p.request("chat", 0.0) == "start"
    assert p.decide("chat", 0.0) == Decision("chat", 1, 1, (), "cold start")
    p.starting("chat", "chat-0", 0.0)
    p.record("new", 3, 0.5)  # a figure for an app not seen yet
    assert p.apps == ["chat", "new"] and p.config("new") is default
    assert p.signal.config_for("new").target_concurrency == 2
    p.add("own", ScalingConfig(target_concurrency=9))
    assert p.config("own").target_concurrency == 9
    with pytest.raises(ValueError, match="scaled already"):
        p.add("own")
    p.touch("never", 0.6)  # the request path adds no app
    assert "never" not in p.apps
    mixed = AutoscalePolicy({APP: ScalingConfig(target_concurrency=4)}, default=default)  # the old form, and more
    assert mixed.config(APP).target_concurrency == 4 and mixed.config("x") is default


def test_the_signal_has_the_apps_target_and_windows() -> None:
    p = policy(target_concurrency=3, up_window=2, down_window=20, hysteresis=0.1)
    config = p.signal.config_for(APP)
    assert (config.target_concurrency, config.up_window, config.down_window, config.hysteresis) == (3, 2, 20, 0.1)


# -- cold starts ----------------------------------------------------------------------------


def test_an_idle_app_starts_at_min_replicas_and_stays_there() -> None:
    assert policy().decide(APP, 0.0) == Decision(APP, 0, 0, (), "hold")
    assert policy(min_replicas=2).decide(APP, 0.0) == Decision(APP, 2, 2, (), "up")


def test_a_request_for_an_app_with_no_replica_starts_exactly_one() -> None:
    p = policy()
    assert p.request(APP, 0.0) == "start"
    decision = p.decide(APP, 0.0)
    assert decision == Decision(APP, 1, 1, (), "cold start")
    assert p.decide(APP, 0.0).start == 1  # asking again before acting: the same gap
    p.starting(APP, "llm-0", 0.0)
    for _ in range(5):  # the concurrent requests of the same cold start
        assert p.request(APP, 0.1) == "wait"
        assert p.decide(APP, 0.1).start == 0
    p.ready(APP, "llm-0", 0.5)
    assert p.request(APP, 0.6) == "ready"
    assert p.decide(APP, 0.6) == Decision(APP, 1, 0, (), "hold")


def test_a_cold_started_replica_stays_for_the_down_window_then_goes_when_idle() -> None:
    p = policy(idle_timeout=3)
    fleet = Fleet(p)
    p.request(APP, 0.0)
    fleet.step(0.0)
    for t in range(1, 10):
        p.record(APP, 0, float(t))
        assert fleet.step(float(t)).replicas == 1  # idle since 0, but a scale-up is not undone within 10 s
    decision = fleet.step(10.0)
    assert (decision.replicas, decision.reason, decision.drain) == (0, "idle", ("llm-0",))


def test_touch_keeps_an_app_serving_short_requests_from_going_idle() -> None:
    p = policy(idle_timeout=3)
    fleet = Fleet(p)
    p.request(APP, 0.0)
    fleet.step(0.0)
    for t in range(1, 30):
        p.record(APP, 0, float(t))  # the samples miss every request...
        p.touch(APP, float(t))  # ...but the proxy saw them
        assert fleet.step(float(t)).replicas == 1
    assert fleet.step(32.0).replicas == 0


# -- up and down ----------------------------------------------------------------------------


def test_scale_up_to_the_load_over_the_up_window_capped_at_max() -> None:
    p = policy(max_replicas=5)
    fleet = Fleet(p)
    p.request(APP, 0.0)
    fleet.step(0.0)
    p.record(APP, 9, 0.0)
    p.record(APP, 9, 1.0)
    decision = fleet.step(1.0)
    assert (decision.replicas, decision.start, decision.reason) == (3, 2, "up")  # ceil(9 / 4)
    p.record(APP, 100, 2.0)
    p.record(APP, 100, 3.0)
    assert fleet.step(3.0).replicas == 5


def test_a_short_spike_does_not_scale_up_a_long_up_window() -> None:
    p = policy(up_window=10, down_window=100)
    fleet = Fleet(p)
    p.request(APP, 0.0)
    fleet.step(0.0)
    for t in range(10):
        p.record(APP, 40 if t == 5 else 2, float(t))
    p.record(APP, 2, 10.0)
    assert fleet.step(10.0).replicas == 2  # the spike weighs 1/10: (9 * 2 + 40) / 10 = 5.8 -> 2


def test_scale_down_needs_a_whole_down_window_of_slack_and_keeps_the_hysteresis_band() -> None:
    p = policy(min_replicas=1)
    fleet = Fleet(p)
    for t in range(3):
        p.record(APP, 16, float(t))
        fleet.step(float(t))
    assert ready(p) == 4
    # 13 in flight: ceil(13 / 4) = 4 still, and 13 is within the band anyway
    for t in range(3, 30):
        p.record(APP, 13, float(t))
        assert fleet.step(float(t)).replicas == 4
    # 5 in flight: the 10 s average comes down step by step, and so do the replicas, to ceil(5 / 4)
    counts = {}
    for t in range(30, 50):
        p.record(APP, 5, float(t))
        decision = fleet.step(float(t))
        counts[t] = decision.replicas
        assert decision.reason in ("hold", "down")
    assert counts[31] == 4  # average 12.2: under the band (12.8), but ceil(12.2 / 4) is still 4
    assert counts[32] == 3  # average 11.4
    assert counts[49] == 2


def test_buffer_replicas_while_in_use_none_once_idle() -> None:
    p = policy(buffer_replicas=2, idle_timeout=5)
    fleet = Fleet(p)
    p.request(APP, 0.0)
    assert fleet.step(0.0).replicas == 3
    p.record(APP, 5, 0.5)
    p.record(APP, 5, 1.5)
    assert fleet.step(1.5).replicas == 4  # ceil(5 / 4) + 2
    for t in range(2, 30):
        p.record(APP, 0, float(t))
        fleet.step(float(t))
    assert ready(p) == 0


def test_a_replica_that_dies_is_replaced() -> None:
    p = policy(min_replicas=2)
    fleet = Fleet(p)
    fleet.step(0.0)
    p.gone(APP, "llm-1", 1.0)
    decision = fleet.step(1.0)
    assert (decision.replicas, decision.start, decision.reason) == (2, 1, "replace")


def test_a_backlog_scales_up_at_most_double_or_four_more_per_up_window() -> None:
    """A burst of 4,000 in flight (a backlog queued inside the replicas after a cold start) at a
    target of 4 asks for 1,000 replicas; the scale-up rate lets the count grow by steps, each
    looking at the load again, and it stops growing once the backlog is gone."""
    p = policy(max_replicas=2000, up_window=1.0, down_window=100.0)
    fleet = Fleet(p)
    p.request(APP, 0.0)
    assert fleet.step(0.0).replicas == 1
    counts = []
    for t in range(1, 6):
        p.record(APP, 4000, float(t))
        counts.append(fleet.step(float(t)).replicas)
    assert counts == [5, 10, 20, 40, 80]  # +4 while 4 is more than doubling, then doubling
    for t in range(6, 9):
        p.record(APP, 100, float(t))  # the backlog is served: 100 in flight needs 25
        counts.append(fleet.step(float(t)).replicas)
    # (the second to 6 still averages the backlog); then no more growth: the demand never ran ahead to 1,000
    assert counts[5:] == [160, 160, 160]
    unbounded = policy(max_replicas=2000, scale_up_factor=math.inf)
    Fleet(unbounded).step(0.0)
    unbounded.record(APP, 4000, 0.0)
    unbounded.record(APP, 4000, 1.0)
    assert unbounded.decide(APP, 1.0).replicas == 1000


def test_a_decision_that_drains_nothing_sorts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    p = policy(min_replicas=3)
    fleet = Fleet(p)
    fleet.step(0.0)

    def no_sort(self: AutoscalePolicy, state: object) -> list[str]:
        raise AssertionError("sorted the fleet for a decision that drains nothing")

    monkeypatch.setattr(AutoscalePolicy, "_drain_order", no_sort)
    for t in range(1, 20):
        p.record(APP, 5, float(t))
        assert fleet.step(float(t)).drain == ()


# -- which to drain -------------------------------------------------------------------------


def test_drain_order_starting_then_no_session_then_fewest_in_flight() -> None:
    p = policy(min_replicas=0, idle_timeout=1, down_window=1)
    for i, (in_flight, sessions) in enumerate([(0, 2), (5, 0), (1, 0), (0, 1)]):
        p.starting(APP, f"r{i}", 0.0)
        p.ready(APP, f"r{i}", 0.0)
        p.load(APP, f"r{i}", in_flight, sessions)
    p.starting(APP, "new", 0.0)
    assert p.decide(APP, 5.0).drain == ("new", "r2", "r1", "r3", "r0")


def test_fleet_transitions_are_checked() -> None:
    p = policy()
    p.starting(APP, "a", 0.0)
    with pytest.raises(ValueError, match="already known"):
        p.starting(APP, "a", 0.0)
    p.ready(APP, "a", 0.0)
    with pytest.raises(ValueError, match="ready, not starting"):
        p.ready(APP, "a", 0.0)
    with pytest.raises(ValueError, match="not known"):
        p.draining(APP, "b", 0.0)
    with pytest.raises(ValueError, match="negative"):
        p.load(APP, "a", -1)
    p.gone(APP, "b", 0.0)  # unknown: nothing to do


# -- properties -----------------------------------------------------------------------------

configs = st.builds(
    lambda target, lo, extra, buffer, up, down_extra, idle: ScalingConfig(
        target_concurrency=target,
        min_replicas=lo,
        max_replicas=max(lo, 1) + extra,
        buffer_replicas=buffer,
        up_window=up,
        down_window=up + down_extra,
        idle_timeout=idle,
    ),
    st.sampled_from([0.5, 1.0, 3.0, 8.0]),
    st.integers(0, 3),
    st.integers(0, 6),
    st.integers(0, 2),
    st.sampled_from([0.5, 1.0, 3.0]),
    st.sampled_from([0.0, 1.0, 5.0, 20.0]),
    st.sampled_from([0.5, 2.0, 10.0]),
)

steps = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.1, 0.5, 1.0, 4.0]),  # time passes
        st.sampled_from(["record", "record", "request", "touch", "die", "load", "wait"]),
        st.integers(0, 60),  # in flight (or sessions)
    ),
    max_size=60,
)


def act(p: AutoscalePolicy, op: str, n: int, now: float) -> None:
    """One step of a property's sequence: a figure, a request, a touch, a death, a replica's load, or what waits."""
    names = sorted(p.statistics(now).apps[APP].replicas)
    if op == "record":
        p.record(APP, n, now)
    elif op == "request":
        p.request(APP, now)
    elif op == "touch":
        p.touch(APP, now)
    elif op == "die" and names:
        p.gone(APP, names[n % len(names)], now)
    elif op == "load" and names:
        p.load(APP, names[n % len(names)], n, n % 3)
    elif op == "wait":
        p.waiting(APP, n % 3, now)


def wanted_as_of(history: list[tuple[float, int]], when: float) -> int:
    """The wanted count in force at ``when``: the last decision's at or before it (0 before any)."""
    count = 0
    for t, replicas in history:
        if t > when:
            break
        count = replicas
    return count


@settings(max_examples=300, deadline=None)
@given(configs, steps)
def test_property_within_bounds_and_no_flapping(config: ScalingConfig, ops: list[tuple[float, str, int]]) -> None:
    p = AutoscalePolicy({APP: config})
    fleet = Fleet(p)
    now = 0.0
    wanted = 0
    last_up = -math.inf
    history: list[tuple[float, int]] = []
    for dt, op, n in ops:
        now += dt
        act(p, op, n, now)
        decision = fleet.step(now)
        assert config.min_replicas <= decision.replicas <= config.max_replicas
        assert decision.start == 0 or not decision.drain
        if decision.replicas > wanted:
            last_up = now
        elif decision.replicas < wanted:
            assert now - last_up >= config.down_window - 1e-9, (now, last_up, decision)
        # the scale-up rate: from what was wanted up_window ago, at most double or four more
        base = wanted_as_of(history, now - config.up_window)
        assert decision.replicas <= max(config.min_replicas, config.scale_up_cap(base)), (base, decision)
        history.append((now, decision.replicas))
        wanted = decision.replicas
        stats = p.statistics(now).apps[APP]
        assert stats.starting + stats.ready == decision.replicas  # the fleet carried it out
        phases = [r.phase for r in stats.replicas.values()]  # the kept counts agree with a recount
        assert [stats.starting, stats.ready, stats.draining] == [phases.count(phase) for phase in PHASES]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 9)), min_size=1, max_size=12),
    st.integers(0, 12),
)
def test_property_no_session_host_drains_while_another_could_go(fleet: list[tuple[bool, int, int]], keep: int) -> None:
    """Whatever the fleet (starting or ready, sessions, in flight) and the count kept, a replica that
    hosts a session is drained only if every replica that stays hosts one too."""
    lo = min(keep, len(fleet))
    p = AutoscalePolicy({APP: ScalingConfig(target_concurrency=1, min_replicas=lo, max_replicas=max(lo, 1))})
    sessions = {}
    for i, (is_ready, n_sessions, in_flight) in enumerate(fleet):
        name = f"r{i}"
        p.starting(APP, name, float(i))
        if is_ready:
            p.ready(APP, name, float(i))
            p.load(APP, name, in_flight, n_sessions)
        sessions[name] = n_sessions if is_ready else 0
    decision = p.decide(APP, 100.0)
    drained = set(decision.drain)
    assert len(drained) == max(0, len(fleet) - decision.replicas)
    stays = set(sessions) - drained
    if any(sessions[name] for name in drained):
        assert all(sessions[name] for name in stays)
    starting = {f"r{i}" for i, (is_ready, _, _) in enumerate(fleet) if not is_ready}
    if stays & starting:
        assert drained <= starting  # a starting replica goes before any ready one


# -- what waits at the proxies ---------------------------------------------------------------


def test_waiting_at_a_proxy_starts_an_app_at_zero_and_keeps_it_from_idle() -> None:
    """What a proxy in another process holds (it calls no ``request`` here) reaches the policy once a round."""
    p = policy(idle_timeout=3, down_window=5)
    fleet = Fleet(p)
    assert fleet.step(0.0) == Decision(APP, 0, 0, (), "hold")
    p.waiting(APP, 7, 0.5)
    assert fleet.step(0.5) == Decision(APP, 1, 1, (), "cold start")  # one, for all seven
    assert p.statistics(0.5).apps[APP].waiting == 7
    for t in range(1, 30):  # nothing in flight, no request here: only what waits there, reported once
        p.record(APP, 0, float(t))
        assert fleet.step(float(t)).replicas == 1
    p.waiting(APP, 0, 30.0)
    assert fleet.step(30.0).replicas == 1  # busy until now: idle only idle_timeout after it
    decision = fleet.step(33.0)
    assert (decision.replicas, decision.reason) == (0, "idle")
    with pytest.raises(ValueError, match="negative"):
        p.waiting(APP, -1, 34.0)


def test_a_sessioned_app_scales_on_the_starts_that_wait_for_a_place() -> None:
    """The driver records a sessioned app's sessions hosted plus its starts waiting: full replicas
    with starts queued ask for more, where the sessions hosted alone (at the target) would not."""
    p = policy(target_concurrency=2, unit="sessions", up_window=1, down_window=100)
    fleet = Fleet(p)
    for t in range(3):
        p.record(APP, 4, float(t))  # two replicas, two sessions each: at the target (and at their cap)
        fleet.step(float(t))
    assert ready(p) == 2
    p.waiting(APP, 3, 3.0)
    for t in range(3, 6):
        p.record(APP, 4 + 3, float(t))
        fleet.step(float(t))
    assert ready(p) == 4  # ceil(7 / 2)


waits = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.5, 1.0, 4.0, 20.0]),
        st.sampled_from(["record", "touch", "die", "wait", "wait"]),
        st.integers(0, 20),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(configs, waits)
def test_property_while_anything_waits_the_app_keeps_a_replica(
    config: ScalingConfig, ops: list[tuple[float, str, int]]
) -> None:
    """Told that requests or session starts wait, every decision wants a replica and none is idle."""
    p = AutoscalePolicy({APP: config})
    fleet = Fleet(p)
    now = 0.0
    waiting = 0
    for dt, op, n in ops:
        now += dt
        act(p, op, n, now)
        if op == "wait":
            waiting = n % 3
        decision = fleet.step(now)
        if waiting:
            assert decision.replicas >= 1 and decision.reason != "idle", decision


@settings(max_examples=300, deadline=None)
@given(configs, steps)
def test_property_nothing_waiting_changes_no_decision(config: ScalingConfig, ops: list[tuple[float, str, int]]) -> None:
    """``waiting(app, 0)`` each round (what the driver says when no proxy holds anything) is no input."""
    told, untold = AutoscalePolicy({APP: config}), AutoscalePolicy({APP: config})
    fleets = Fleet(told), Fleet(untold)
    now = 0.0
    for dt, op, n in ops:
        now += dt
        for p in (told, untold):
            if op != "wait":
                act(p, op, n, now)
        told.waiting(APP, 0, now)
        assert fleets[0].step(now) == fleets[1].step(now)


def test_decisions_are_frozen() -> None:
    decision = policy().decide(APP, 0.0)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        decision.start = 3  # type: ignore[misc]


def test_the_docs_policy_example_prints_what_the_page_shows() -> None:
    """docs/autoscaler.md's policy example is sans-IO (no ``trio.run``, so test_docs skips it): run here."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "autoscaler.md").read_text()
    section = page[page.index("### Example") :]
    code, shown = re.findall(r"^```(?:python)?\n(.*?)^```\n", section, re.DOTALL | re.MULTILINE)[:2]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split("\n") == shown.split("\n")
