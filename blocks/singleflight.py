"""Single-flight loads: concurrent callers that need the same thing share one load.

When a cache misses and a hundred requests want the same key at once (a
session's key, a replica's capacity, a route that just appeared), one load
should reach the store, not a hundred. :meth:`SingleFlight.load` runs the
first caller's loader and makes the others *join* it. Three rules keep the
sharing from turning into shared fate (DESIGN's second principle):

1. **Loads run in the service's nursery, never in a caller's.** The nursery
   belongs to :func:`open_single_flight`, which lives as long as the
   service. A caller that is cancelled (its client went away, its deadline
   passed) stops waiting, and the load goes on for everyone else who
   joined it; nobody is left waiting on a load that will never finish.
2. **A joiner waits a bounded time.** After ``join_timeout`` seconds
   without an answer, a joiner gives up on the slow load and starts one of
   its own, which becomes the one later callers join. The slow load is
   left to finish (or fail) for whoever still waits on it.
3. **A load's outcome reaches every caller that waits on it**, its result
   or its exception alike, and is forgotten at once: single-flight shares
   loads in progress, it is not a cache. A failed load is not retried for
   you; the next call starts a new one.

The first caller, whose load it is, waits without a join timeout (a second
load of its own would be the same load again). Bound a loader with its own
timeout, or with ``load_timeout`` for all of them.

Example::

    async with open_single_flight() as flights:
        key = await flights.load(("session-key", kid), lambda: fetch_key(kid))
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from types import TracebackType
from typing import Any, TypeVar, cast

import attrs
import trio

from blocks._sync import one_error

_T = TypeVar("_T")


@attrs.frozen
class SingleFlightStatistics:
    in_flight: int
    """Loads running now (including ones nobody joinable waits on any more)."""
    loads: int
    """Loads started: by a first caller, or by a joiner that stopped waiting."""
    joins: int
    """Calls that joined a load already in flight."""
    join_timeouts: int
    """Joiners that waited ``join_timeout`` and then loaded for themselves."""
    failures: int
    """Loads that raised (their exception went to everyone waiting on them)."""


def _closed() -> BaseException:
    return trio.ClosedResourceError("the SingleFlight was closed during the load")


@attrs.define(eq=False)
class _Flight:
    key: Hashable
    done: trio.Event = attrs.field(factory=trio.Event)
    value: Any = None
    # Until the load succeeds or fails, the outcome is "closed": what waiters
    # get if the load is cancelled by the nursery (or by a KeyboardInterrupt).
    error: BaseException | None = attrs.field(factory=_closed)
    traceback: TracebackType | None = None


@attrs.define(eq=False)
class SingleFlight:
    """Keyed single-flight loads. Use :func:`open_single_flight`.

    Keys are any hashables; one key must name one value (whoever joins a
    flight gets that flight's result, whichever loader it passed).
    """

    join_timeout: float = 1.5
    load_timeout: float | None = None
    _flights: dict[Hashable, _Flight] = attrs.field(factory=dict, init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _in_flight: int = attrs.field(default=0, init=False)
    _loads: int = attrs.field(default=0, init=False)
    _joins: int = attrs.field(default=0, init=False)
    _join_timeouts: int = attrs.field(default=0, init=False)
    _failures: int = attrs.field(default=0, init=False)

    def __repr__(self) -> str:
        return f"<SingleFlight in_flight={self._in_flight} keys={len(self._flights)}>"

    async def load(self, key: Hashable, loader: Callable[[], Awaitable[_T]]) -> _T:
        """The value ``loader()`` gives for ``key``, loaded once for all the callers in flight.

        Joins the load already in flight for ``key`` if there is one (for
        at most ``join_timeout`` seconds, then starts its own), or starts
        one. Raises whatever the load raised, ``trio.TooSlowError`` if it
        ran over ``load_timeout``, and ``trio.ClosedResourceError`` once the
        ``open_single_flight`` block is left (then also to callers still
        waiting). Cancelling a caller never cancels the load.
        """
        flight = self._flights.get(key)
        if flight is None:
            return cast(_T, await self._wait(self._start(key, loader)))
        self._joins += 1
        with trio.move_on_after(self.join_timeout):
            return cast(_T, await self._wait(flight))
        self._join_timeouts += 1
        return cast(_T, await self._wait(self._start(key, loader)))

    def _start(self, key: Hashable, loader: Callable[[], Awaitable[Any]]) -> _Flight:
        if self._nursery is None:
            raise trio.ClosedResourceError("the SingleFlight is not open: use open_single_flight")
        flight = _Flight(key)
        self._flights[key] = flight  # a newer load replaces a slow one for later callers
        self._loads += 1
        self._in_flight += 1
        self._nursery.start_soon(self._run, flight, loader)
        return flight

    async def _run(self, flight: _Flight, loader: Callable[[], Awaitable[Any]]) -> None:
        try:
            with trio.fail_after(self.load_timeout if self.load_timeout is not None else math.inf):
                value = await loader()
        except Exception as exc:
            # Into the flight, never into the nursery: one failed load must
            # not cancel everyone else's.
            self._failures += 1
            flight.error, flight.traceback = exc, exc.__traceback__
        else:
            flight.error, flight.value = None, value
        finally:
            self._in_flight -= 1
            if self._flights.get(flight.key) is flight:
                del self._flights[flight.key]
            flight.done.set()

    async def _wait(self, flight: _Flight) -> Any:
        await flight.done.wait()
        error = flight.error
        if error is not None:
            # Every waiter raises the same exception: reset its traceback to the
            # load's each time, or it would grow by the frames of every raise.
            raise error.with_traceback(flight.traceback)
        return flight.value

    def statistics(self) -> SingleFlightStatistics:
        return SingleFlightStatistics(
            in_flight=self._in_flight,
            loads=self._loads,
            joins=self._joins,
            join_timeouts=self._join_timeouts,
            failures=self._failures,
        )


@asynccontextmanager
async def open_single_flight(
    *, join_timeout: float = 1.5, load_timeout: float | None = None
) -> AsyncIterator[SingleFlight]:
    """A :class:`SingleFlight` whose loads run in this block's nursery (the service's lifetime).

    ``join_timeout``: how long a caller waits on someone else's load before
    loading for itself. ``load_timeout``: a bound on every load (``None``:
    the loader's own). Leaving the block cancels the loads still running;
    their callers get ``trio.ClosedResourceError``.
    """
    if not join_timeout >= 0 or (load_timeout is not None and not load_timeout > 0):
        raise ValueError("join_timeout must be >= 0 and load_timeout > 0")
    flights = SingleFlight(join_timeout, load_timeout)
    with one_error():
        async with trio.open_nursery() as nursery:
            flights._nursery = nursery
            try:
                yield flights
            finally:
                flights._nursery = None
                nursery.cancel_scope.cancel()


__all__ = [
    "SingleFlight",
    "SingleFlightStatistics",
    "open_single_flight",
]
