"""Keeping a :class:`~blocks.routing.RouteCache` equal to a route source, in the background.

The invariant: the cache holds the source's state at ``cache.revision``,
exactly. It starts from a snapshot (all keys at one revision R) and then
applies every event after R, in order, once:

- the watch starts strictly after ``cache.revision`` (etcd's start revision
  R + 1), so no event is missed and none applied twice;
- after a break it resumes strictly after ``cache.revision`` again, which is
  the revision of the last event applied (or of the snapshot): never a
  revision a response header or a heartbeat mentioned, since events of the
  prefix up to that one may not have been delivered yet. Sources never split
  one revision's events across batches, so resuming after the last one
  applied loses nothing;
- when the source no longer has that history (:class:`Compacted`), the only
  way back is a fresh snapshot, which replaces the cache's contents whole;
  so too when a heartbeat (:class:`Progress`) says the source is at a
  revision below the cache's: it lost its history (an etcd restarted
  without its data), and a watch from the cache's revision would wait for
  events that never come.

Between those steps the cache keeps serving the last state it had: a proxy
that loses its store keeps routing, and ``staleness`` says for how long it
has not heard from the store. All of it runs in a service-lifetime task,
never on the request path: a request reads the cache, never the source.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from blocks._common import finite
from blocks._sync import one_error
from blocks.errors import Compacted, SourceUnavailable
from blocks.routing import RouteCache
from blocks.sources._base import Progress, RouteSource

log = logging.getLogger("blocks.sources")


def _not_below_min(instance: ReconcileConfig, attribute: attrs.Attribute[float], value: float) -> None:
    if value < instance.min_backoff:
        raise ValueError(f"max_backoff ({value}) must be >= min_backoff ({instance.min_backoff})")


@attrs.frozen(kw_only=True)
class ReconcileConfig:
    """How the reconciler retries a source it cannot reach.

    After the n-th failure in a row it waits ``min_backoff * 2**(n-1)``
    seconds, at most ``max_backoff``, less a random share of up to
    ``jitter`` of it (so that a fleet of proxies that lost the same store
    does not come back at the same instant). The count starts again once a
    watch delivers something.
    """

    min_backoff: float = attrs.field(default=0.1, validator=[attrs.validators.gt(0), finite])
    max_backoff: float = attrs.field(default=5.0, validator=[attrs.validators.gt(0), finite, _not_below_min])
    jitter: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])

    def backoff(self, failures: int, rng: random.Random) -> float:
        """The wait after ``failures`` (>= 1) failures in a row."""
        base = min(self.max_backoff, self.min_backoff * 2.0 ** min(failures - 1, 60))
        return base * (1.0 - self.jitter * rng.random())


@attrs.frozen
class ReconcileStatistics:
    revision: int
    """The cache's revision: the last event applied, or the snapshot's."""
    connected: bool
    """A watch is open and has delivered something since it opened."""
    staleness: float
    """0 while the watch is healthy; since a break, seconds since the source last confirmed the cache."""
    reconnects: int
    """Watches re-opened (or snapshots retried) after the source broke or could not be reached."""
    reloads: int
    """Snapshots loaded after the first one, because the history to resume from was compacted."""
    batches: int
    events: int
    progress: int
    """Heartbeats received (idle watches saying "nothing new")."""
    last_error: str | None
    """The last break, as ``ErrorType: message``; kept after recovery, for the operator."""


@attrs.define(eq=False)
class RouteReconciler:
    """A running reconciliation, as :func:`reconcile` and :func:`open_route_cache` report it.

    ``cache`` is what the proxy reads (``serve_proxy(reconciler.cache)``).
    """

    source: RouteSource
    cache: RouteCache
    config: ReconcileConfig
    _rng: random.Random
    _connected: bool = False
    _reconnects: int = 0
    _reloads: int = 0
    _batches: int = 0
    _events: int = 0
    _progress: int = 0
    _last_error: str | None = None
    _broken_since: float | None = None  # since when the source is unreachable (None: it is not)

    def __repr__(self) -> str:
        return (
            f"<RouteReconciler revision={self.cache.revision} connected={self._connected} "
            f"reconnects={self._reconnects} reloads={self._reloads}>"
        )

    def statistics(self) -> ReconcileStatistics:
        return ReconcileStatistics(
            revision=self.cache.revision,
            connected=self._connected,
            staleness=self.cache.staleness(trio.current_time()),
            reconnects=self._reconnects,
            reloads=self._reloads,
            batches=self._batches,
            events=self._events,
            progress=self._progress,
            last_error=self._last_error,
        )

    def _broke(self, loaded: bool) -> None:
        """Log the first failure of a run of them: one line when the source goes, whatever the retries."""
        if self._broken_since is None:
            self._broken_since = trio.current_time()
            serving = f"serving the routes of revision {self.cache.revision}" if loaded else "no routes yet"
            log.warning("route source %r unavailable (%s); %s, retrying", self.source, self._last_error, serving)

    def _recovered(self) -> None:
        # A warning too, not info: whoever saw the loss must see its end, with logging left unconfigured.
        if self._broken_since is not None:
            down = trio.current_time() - self._broken_since
            self._broken_since = None
            log.warning("route source %r back after %.1fs, at revision %d", self.source, down, self.cache.revision)

    async def _run(self, task_status: trio.TaskStatus[RouteReconciler]) -> None:
        source, cache = self.source, self.cache
        need_snapshot = True
        loaded = False
        failures = 0
        while True:
            try:
                if need_snapshot:
                    revision, snapshot = await source.snapshot()
                    cache.load(snapshot, revision, trio.current_time())
                    need_snapshot = False
                    self._recovered()
                    if loaded:
                        self._reloads += 1
                    else:
                        loaded = True
                        task_status.started(self)
                watch = source.watch(cache.revision)
                try:
                    async for item in watch:
                        now = trio.current_time()
                        if isinstance(item, Progress):
                            if item.revision < cache.revision:
                                # The store went back in time (restarted without its data): what
                                # the watch waits for may never come. Only a snapshot tells the truth.
                                raise Compacted(
                                    f"the source is at revision {item.revision}, behind the routes' "
                                    f"{cache.revision}: it lost its history"
                                )
                            self._progress += 1
                            cache.synced(now)
                        else:
                            cache.apply(item, now)  # confirms the cache current, too
                            self._batches += 1
                            self._events += len(item)
                        self._connected = True
                        failures = 0
                        if self._broken_since is not None:  # (a test, not a call, per batch)
                            self._recovered()
                finally:
                    aclose = getattr(watch, "aclose", None)
                    if aclose is not None:
                        with trio.CancelScope(shield=True):
                            await aclose()
                raise SourceUnavailable("the watch ended")  # sources never end one: treat it as a break
            except Compacted as exc:
                self._connected = False
                cache.unsynced(trio.current_time())
                self._last_error = f"{type(exc).__name__}: {exc}"
                need_snapshot = True
                # The first reload is at once; a source that keeps saying "compacted" is backed off.
                failures += 1
                if failures > 1:
                    await trio.sleep(self.config.backoff(failures - 1, self._rng))
                else:
                    await trio.lowlevel.checkpoint()
            except SourceUnavailable as exc:
                self._connected = False
                cache.unsynced(trio.current_time())
                self._last_error = f"{type(exc).__name__}: {exc}"
                self._broke(loaded)
                failures += 1
                await trio.sleep(self.config.backoff(failures, self._rng))
                self._reconnects += 1


async def reconcile(
    source: RouteSource,
    cache: RouteCache,
    *,
    config: ReconcileConfig | None = None,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[RouteReconciler] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``cache`` equal to ``source`` until cancelled. Start it with ``nursery.start``.

    Reports a :class:`RouteReconciler` once the first snapshot is in the
    cache. Until then it retries an unreachable source with backoff, for as
    long as the caller lets it (bound it with ``trio.fail_after``). From
    then on it never raises for the source's sake: breaks are retried with
    backoff (:class:`ReconcileConfig`) and compaction is a reload, both
    counted in ``statistics()``, while the cache keeps serving. An error
    that is not the source's (a bug) propagates.
    """
    reconciler = RouteReconciler(source, cache, config or ReconcileConfig(), rng or random.Random())
    await reconciler._run(task_status)


@asynccontextmanager
async def open_route_cache(
    source: RouteSource,
    cache: RouteCache | None = None,
    *,
    config: ReconcileConfig | None = None,
    rng: random.Random | None = None,
) -> AsyncIterator[RouteReconciler]:
    """A :class:`RouteReconciler` keeping a cache in sync with ``source`` for the ``async with`` block.

    Enters once the first snapshot is loaded (see :func:`reconcile`); the
    cache is a new :class:`~blocks.routing.RouteCache` unless one is given.
    The reconciler runs in this block's own nursery, which outlives every
    request served from the cache::

        async with open_route_cache(EtcdSource("http://127.0.0.1:2379")) as routes:
            await serve_proxy(routes.cache, ...)
    """
    reconciler_cache = cache if cache is not None else RouteCache()
    with one_error():
        async with trio.open_nursery() as nursery:
            reconciler: RouteReconciler = await nursery.start(
                _reconcile_for_open, source, reconciler_cache, config, rng
            )
            try:
                yield reconciler
            finally:
                nursery.cancel_scope.cancel()


async def _reconcile_for_open(
    source: RouteSource,
    cache: RouteCache,
    config: ReconcileConfig | None,
    rng: random.Random | None,
    task_status: trio.TaskStatus[RouteReconciler] = trio.TASK_STATUS_IGNORED,
) -> None:
    await reconcile(source, cache, config=config, rng=rng, task_status=task_status)


__all__ = [
    "ReconcileConfig",
    "ReconcileStatistics",
    "RouteReconciler",
    "open_route_cache",
    "reconcile",
]
