"""Single-flight loads: one rule per test. Time is trio's autojump clock throughout:
the sleeps below are virtual and every test is bounded by ``trio.fail_after``."""

from __future__ import annotations

import traceback

import pytest
import trio
import trio.testing

from blocks.singleflight import SingleFlight, SingleFlightStatistics, open_single_flight


class Loader:
    """A loader that counts its calls and takes ``delay`` seconds (of the autojump clock)."""

    def __init__(self, value: object = "loaded", delay: float = 1.0, error: Exception | None = None) -> None:
        self.value = value
        self.delay = delay
        self.error = error
        self.calls = 0
        self.finished = 0

    async def __call__(self) -> object:
        self.calls += 1
        await trio.sleep(self.delay)
        self.finished += 1
        if self.error is not None:
            raise self.error
        return self.value


async def test_concurrent_callers_share_one_load(autojump_clock: trio.testing.MockClock) -> None:
    loader = Loader(delay=1.0)
    results: list[object] = []
    with trio.fail_after(10):
        async with open_single_flight() as flights, trio.open_nursery() as nursery:

            async def call() -> None:
                results.append(await flights.load("k", loader))

            for _ in range(10):
                nursery.start_soon(call)
            await trio.sleep(0.5)
            assert flights.statistics().in_flight == 1
    assert results == ["loaded"] * 10
    assert loader.calls == 1
    assert flights.statistics() == SingleFlightStatistics(in_flight=0, loads=1, joins=9, join_timeouts=0, failures=0)


async def test_different_keys_load_separately(autojump_clock: trio.testing.MockClock) -> None:
    a, b = Loader("a"), Loader("b")
    with trio.fail_after(10):
        async with open_single_flight() as flights, trio.open_nursery() as nursery:
            nursery.start_soon(flights.load, "a", a)
            nursery.start_soon(flights.load, "b", b)
    assert (a.calls, b.calls) == (1, 1)


async def test_a_joiner_waits_join_timeout_then_loads_for_itself(autojump_clock: trio.testing.MockClock) -> None:
    stuck = Loader("stuck", delay=1000.0)
    fresh = Loader("fresh", delay=0.25)
    later = Loader("later", delay=0.25)
    with trio.fail_after(2000):
        async with open_single_flight(join_timeout=1.5) as flights, trio.open_nursery() as nursery:
            nursery.start_soon(flights.load, "k", stuck)
            await trio.sleep(0.1)
            start = trio.current_time()

            async def later_caller() -> None:
                # Arrives while the joiner's own load runs: joins that one, not the stuck one.
                await trio.sleep(1.6)
                assert await flights.load("k", later) == "fresh"

            nursery.start_soon(later_caller)
            assert await flights.load("k", fresh) == "fresh"
            assert trio.current_time() - start == pytest.approx(1.75)
            stats = flights.statistics()
            assert (stats.loads, stats.joins, stats.join_timeouts) == (2, 2, 1)
            assert stats.in_flight == 1  # the stuck load goes on for its own caller
            nursery.cancel_scope.cancel()
    assert later.calls == 0
    assert stuck.finished == 0


async def test_the_first_caller_waits_for_its_own_load_past_join_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow = Loader("slow", delay=10.0)
    with trio.fail_after(20):
        async with open_single_flight(join_timeout=1.5) as flights:
            assert await flights.load("k", slow) == "slow"
    assert slow.calls == 1
    assert flights.statistics().join_timeouts == 0


async def test_a_cancelled_caller_never_cancels_the_load(autojump_clock: trio.testing.MockClock) -> None:
    loader = Loader("value", delay=1.0)
    with trio.fail_after(10):
        async with open_single_flight() as flights:
            with trio.move_on_after(0.3) as scope:
                await flights.load("k", loader)  # starts the load, then its client goes away
            assert scope.cancelled_caught
            assert flights.statistics().in_flight == 1
            # Someone asking for the same key later joins the load still running.
            assert await flights.load("k", Loader("never")) == "value"
            assert trio.current_time() == pytest.approx(1.0)
    assert (loader.calls, loader.finished) == (1, 1)
    assert flights.statistics().loads == 1


async def test_a_cancelled_leader_leaves_the_load_running_for_joiners(autojump_clock: trio.testing.MockClock) -> None:
    loader = Loader("value", delay=1.0)
    results: list[object] = []
    with trio.fail_after(10):
        async with open_single_flight() as flights, trio.open_nursery() as nursery:
            leader = trio.CancelScope()

            async def lead() -> None:
                with leader:
                    await flights.load("k", loader)

            async def join() -> None:
                results.append(await flights.load("k", Loader("never")))

            nursery.start_soon(lead)
            await trio.sleep(0.1)
            nursery.start_soon(join)
            await trio.sleep(0.1)
            leader.cancel()
    assert leader.cancelled_caught
    assert results == ["value"]
    assert (loader.calls, loader.finished) == (1, 1)


async def test_a_load_error_reaches_every_joiner(autojump_clock: trio.testing.MockClock) -> None:
    error = ValueError("the store said no")
    loader = Loader(delay=1.0, error=error)
    caught: list[BaseException] = []
    with trio.fail_after(10):
        async with open_single_flight() as flights:
            async with trio.open_nursery() as nursery:

                async def call() -> None:
                    try:
                        await flights.load("k", loader)
                    except ValueError as exc:
                        caught.append(exc)

                for _ in range(5):
                    nursery.start_soon(call)
            assert caught == [error] * 5
            assert loader.calls == 1
            # Frames from the five raises do not pile up on the shared exception.
            assert len(traceback.extract_tb(error.__traceback__)) < 8
            # Forgotten at once: the next call loads again, and the service is unharmed.
            assert await flights.load("k", Loader("again")) == "again"
    stats = flights.statistics()
    assert (stats.loads, stats.failures) == (2, 1)


async def test_a_failing_load_does_not_disturb_other_keys(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(10):
        async with open_single_flight() as flights, trio.open_nursery() as nursery:
            ok = Loader("ok", delay=2.0)
            result: list[object] = []

            async def good() -> None:
                result.append(await flights.load("good", ok))

            nursery.start_soon(good)
            with pytest.raises(RuntimeError):
                await flights.load("bad", Loader(delay=0.5, error=RuntimeError("boom")))
    assert result == ["ok"]


async def test_load_timeout_fails_every_waiter(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(10):
        async with open_single_flight(join_timeout=10.0, load_timeout=2.0) as flights, trio.open_nursery() as nursery:
            errors: list[BaseException] = []

            async def call() -> None:
                try:
                    await flights.load("k", Loader(delay=100.0))
                except trio.TooSlowError as exc:
                    errors.append(exc)

            for _ in range(3):
                nursery.start_soon(call)
    assert len(errors) == 3
    assert trio.current_time() == pytest.approx(2.0)
    assert flights.statistics().in_flight == 0


async def test_closing_fails_waiters_and_later_calls(autojump_clock: trio.testing.MockClock) -> None:
    errors: list[BaseException] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, open_single_flight() as flights:

            async def call() -> None:
                try:
                    await flights.load("k", Loader(delay=100.0))
                except trio.ClosedResourceError as exc:
                    errors.append(exc)

            nursery.start_soon(call)
            nursery.start_soon(call)
            await trio.sleep(1.0)
    assert len(errors) == 2
    with pytest.raises(trio.ClosedResourceError):
        await flights.load("k", Loader())
    assert flights.statistics().in_flight == 0


async def test_open_single_flight_hands_back_the_body_error_unwrapped() -> None:
    with trio.fail_after(5), pytest.raises(KeyError):
        async with open_single_flight():
            raise KeyError("body")


def test_the_repr_says_what_is_in_flight() -> None:
    assert repr(SingleFlight()) == "<SingleFlight in_flight=0 keys=0>"


async def test_bad_settings_are_refused() -> None:
    with trio.fail_after(5):
        with pytest.raises(ValueError):
            async with open_single_flight(join_timeout=-1):
                pass
        with pytest.raises(ValueError):
            async with open_single_flight(load_timeout=0):
                pass
