"""Scale from zero at the proxy: a request for an app with no live replica waits for one, bounded.

Theory of operation. The proxy routes from a :class:`~blocks.routing.RouteCache`
that a route source keeps current; an app an autoscaler scaled to zero has
a domain but no live replica. Without this feature such a request is a
``503 no_replica`` at once. With it (``ProxyConfig(cold_start=ColdStartConfig())``),
:class:`AwaitReplica` holds the request in the proxy's screen phase, and
:class:`ReplicaWait` lets it go as soon as the cache offers the app a
replica, which the autoscaler wrote to the store (in this process, or in
another one, reading what this proxy publishes:
:func:`~blocks.sources.demand.serve_demand`). Then it is routed as usual.

Rules:

- **Nothing on the hot path.** A request for an app with a live replica
  costs one dict lookup (``app in live``, the cache's own view).
- **No polling.** Waiters wait on one event per app, set by the cache's
  listener (:meth:`~blocks.routing.RouteCache.add_listener`) when the app's
  live replicas change; the listener is on the cache only while something
  waits.
- **Bounded.** At most ``max_waiting`` requests per app wait (the next is
  a ``503 cold_start_full`` at once), each for at most ``timeout`` seconds
  (then a ``503 cold_start_timeout``), both with ``retry-after``. A client
  that goes away stops waiting and counting.
- **Hooks for an autoscaler in this process** (:class:`~blocks.autoscaler.ColdStartGate`):
  ``start(app)`` runs when an app's first waiter arrives (ask for a start),
  ``check(app)`` before a request waits and each time it is woken
  (:meth:`ReplicaWait.wake`: a start failed), raising a
  :class:`~blocks.errors.BlocksError` to refuse it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import trio

from blocks._common import finite
from blocks.errors import ColdStartFull, ColdStartTimeout
from blocks.hops._hop import Exchange, Feature
from blocks.routing import RouteCache


def _apps(value: Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(f"apps: a collection of app names, not the string {value!r}")
    return frozenset(value)


@attrs.frozen(kw_only=True)
class ColdStartConfig:
    """How a proxy holds a request for an app with no live replica (:class:`AwaitReplica`). Seconds.

    - ``timeout``: the most a request waits for a replica; then a ``503 cold_start_timeout``.
    - ``max_waiting``: requests per app that may wait at once; the next is a
      ``503 cold_start_full`` at once.
    - ``retry_after``: the ``retry-after`` of those 503s (whole seconds, rounded up).
    - ``apps``: the apps whose requests wait; None: every app the routes
      name (a request whose authority maps to no app is a ``503 no_route``
      at once, whatever this says).
    """

    timeout: float = attrs.field(default=30.0, validator=[attrs.validators.gt(0), finite])
    max_waiting: int = attrs.field(default=1000, validator=attrs.validators.ge(1))
    retry_after: float = attrs.field(default=1.0, validator=[attrs.validators.ge(0), finite])
    apps: frozenset[str] | None = attrs.field(default=None, converter=_apps)


@attrs.frozen
class ColdStartStatistics:
    """``waiting``: per app, requests waiting now; ``served``: requests that waited and got a replica;
    ``timed_out``, ``full``: the 503s ``cold_start_timeout`` and ``cold_start_full``; ``refused``:
    requests a ``check`` refused (an autoscaler's failed start)."""

    waiting: dict[str, int]
    served: int = 0
    timed_out: int = 0
    full: int = 0
    refused: int = 0


class ReplicaWait:
    """Requests waiting for their app's first live replica in ``routes``: bounded in count and time.

    :meth:`wait` returns once ``routes`` offers the app a live replica
    (at once if it does), or raises a 503 (see the module's rules).
    ``start`` and ``check`` are an autoscaler's hooks (None: none).
    """

    def __init__(
        self,
        routes: RouteCache,
        config: ColdStartConfig | None = None,
        *,
        start: Callable[[str], None] | None = None,
        check: Callable[[str], None] | None = None,
    ) -> None:
        self.routes = routes
        self.config = config or ColdStartConfig()
        self.start = start
        self.check = check
        self._live = routes.app_replicas()  # a live view: `app in` it is the whole test
        self._waiting: dict[str, int] = {}
        self._events: dict[str, trio.Event] = {}
        self._remove: Callable[[], None] | None = None
        self._arrival = trio.Event()
        self._served = self._timed_out = self._full = self._refused = 0

    def __repr__(self) -> str:
        return f"<ReplicaWait waiting={self._waiting}>"

    def waiting(self, app: str) -> int:
        """Requests for ``app`` waiting now."""
        return self._waiting.get(app, 0)

    def counts(self) -> dict[str, int]:
        """Requests waiting now, per app that has some."""
        return dict(self._waiting)

    def statistics(self) -> ColdStartStatistics:
        return ColdStartStatistics(self.counts(), self._served, self._timed_out, self._full, self._refused)

    def wake(self, app: str) -> None:
        """Have ``app``'s waiters look again now: ``check`` runs for each (a start failed, say)."""
        event = self._events.pop(app, None)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for app in list(self._events):
            self.wake(app)

    async def wait_arrival(self) -> None:
        """Return when an app gets its first waiter (what a demand publisher waits on besides its interval)."""
        await self._arrival.wait()

    async def wait(self, app: str) -> None:
        """Return once ``routes`` offers ``app`` a live replica; ``ColdStartFull`` / ``ColdStartTimeout`` else."""
        if app in self._live:
            return
        config = self.config
        waiting = self._waiting.get(app, 0)
        if waiting >= config.max_waiting:
            self._full += 1
            raise ColdStartFull(
                f"{app}: {waiting} requests wait for a replica already", app=app, retry_after=config.retry_after
            )
        self._check(app)
        if not waiting and self.start is not None:
            self._refusing(self.start, app)
        self._waiting[app] = waiting + 1
        if not waiting:
            self._arrival.set()
            self._arrival = trio.Event()
        if self._remove is None:
            self._remove = self.routes.add_listener(self._changed)
        try:
            with trio.move_on_after(config.timeout):
                while app not in self._live:
                    event = self._events.get(app)
                    if event is None:
                        event = self._events[app] = trio.Event()
                    await event.wait()
                    if app not in self._live:
                        self._check(app)
                self._served += 1
                return
        finally:
            self._left(app)
        self._timed_out += 1
        timeout = config.timeout
        raise ColdStartTimeout(f"{app}: no replica within {timeout:g}s", app=app, retry_after=config.retry_after)

    def _check(self, app: str) -> None:
        if self.check is not None:
            self._refusing(self.check, app)

    def _refusing(self, hook: Callable[[str], None], app: str) -> None:
        try:
            hook(app)
        except BaseException:
            self._refused += 1
            raise

    def _left(self, app: str) -> None:
        left = self._waiting[app] - 1
        if left:
            self._waiting[app] = left
            return
        del self._waiting[app]
        self._events.pop(app, None)
        if not self._waiting and self._remove is not None:
            self._remove()
            self._remove = None

    def _changed(self, apps: frozenset[str]) -> None:
        """The cache's listener: the apps whose live replicas changed (synchronous, in the source's task)."""
        for app in apps:
            if app in self._live:
                self.wake(app)


class AwaitReplica(Feature):
    """screen: a request for an app with no live replica waits for one (:class:`ReplicaWait`), then is routed.

    ``ProxyConfig(cold_start=ColdStartConfig(...))`` puts it in the proxy's
    stack, after auth and the caller's features. A request for an app with
    a live replica costs one dict lookup and goes on; a request whose
    authority maps to no app, or to an app ``apps`` leaves out, goes on
    too (a 503 at once). Otherwise it sets ``exchange.wait`` (unless a
    feature before it did): the handler awaits :meth:`ReplicaWait.wait`
    before admission. A request the proxy answers itself never waits here:
    a health check, and a session start (``POST /.proxyblocks/sessions``),
    which waits in its app's session queue for a replica (bounded by the
    queue's own ``queue_size`` and ``queue_timeout``); nor does a request of
    a session (its token names its replica): it is pinned, and a gone
    replica is its ``410``.
    """

    def __init__(self, wait: ReplicaWait, apps: Iterable[str] | None = None) -> None:
        self.wait = wait
        self.apps = _apps(apps if apps is not None else wait.config.apps)
        self._live = wait.routes.app_replicas()

    def screen(self, exchange: Exchange) -> None:
        app = exchange.app
        if app is None or app in self._live:
            return
        if self.apps is None or app in self.apps:
            self.hold(exchange)

    def hold(self, exchange: Exchange) -> None:
        """Make ``exchange`` wait for its app's replica (not one answered here, a session's, nor one held)."""
        claims = exchange.claims
        if exchange.wait is None and exchange.answer is None and (claims is None or claims.kind != "session"):
            exchange.wait = self._wait

    async def _wait(self, exchange: Exchange) -> None:
        app = exchange.app
        assert app is not None
        await self.wait.wait(app)


__all__ = ["AwaitReplica", "ColdStartConfig", "ColdStartStatistics", "ReplicaWait"]
