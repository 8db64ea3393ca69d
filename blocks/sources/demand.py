"""What waits at a proxy, carried to an autoscaler in another process: :func:`serve_demand`, :func:`read_demand`.

A proxy holds requests for an app at zero replicas (``ProxyConfig.cold_start``)
and session starts in its session queues; an autoscaler beside a worker,
in another process or on another machine, sees neither. So each proxy
publishes its counts per app (:class:`~blocks.routing.Demand`) in the
route store under :data:`~blocks.routing.DEMAND_PREFIX`, one record per
app and proxy (``proxyblocks-demand/<app>/<proxy>``), and the autoscaler
sums them each round (:func:`read_demand`).

- **Off the request path.** A request only changes a count in memory.
  :func:`serve_demand` looks at the counts once per ``interval`` (and at
  once when an app gets its first waiter), and writes only what changed,
  at most once per ``interval``: a count that went to 0 is a delete.
- **Gone with the proxy.** In etcd the records are bound to a lease of
  ``ttl`` seconds, renewed while any is held and revoked once none is (or
  the proxy stops), so a proxy that dies (``kill -9``) leaves no demand
  behind for longer than ``ttl``. In an embedded store (one process) the
  records are deleted when the publisher stops.
- **A store that does not answer** costs nothing but freshness: the proxy
  says so once, and writes again once it can.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Mapping

import trio

from blocks.errors import SourceError
from blocks.routing import DEMAND_PREFIX, Demand, decode_demand, demand_key, encode_demand, parse_demand_key
from blocks.sources.embedded import EmbeddedStore
from blocks.sources.etcd import EtcdSource

log = logging.getLogger("blocks.sources")

DemandStore = EmbeddedStore | EtcdSource
"""Where demand goes: the route store, embedded (one process) or etcd (a fleet)."""


async def serve_demand(
    store: DemandStore,
    name: str,
    counts: Callable[[], Mapping[str, Demand]],
    *,
    interval: float = 0.25,
    ttl: float = 10.0,
    arrival: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep proxy ``name``'s demand (``counts()``: per app) in ``store`` until cancelled, then take it out.

    ``counts`` is read once per ``interval``, and as soon as ``arrival()``
    returns (a proxy's :meth:`~blocks.hops.ReplicaWait.wait_arrival`: an
    app got its first waiter); what changed is written, at most once per
    ``interval``. ``ttl``: the etcd lease's seconds. Reports started at once.
    """
    if not interval > 0 or not math.isfinite(interval) or not ttl >= 1.0 or not math.isfinite(ttl):
        raise ValueError(f"interval must be > 0 and ttl at least 1 second, not {interval!r}, {ttl!r}")
    board = _Board(store, name)
    published: dict[str, Demand] = {}
    down = False
    task_status.started()
    try:
        while True:
            with trio.move_on_after(interval):
                await (arrival or trio.sleep_forever)()
            current = {app: demand for app, demand in counts().items() if demand}
            try:
                if current != published:
                    await board.write(current, published, ttl)
                    await trio.sleep(interval)  # (what changes meanwhile waits for the next write)
                await board.renew(published, ttl)
            except SourceError as exc:
                board.lease = None  # (its records end with it, within ttl: write them all again)
                published.clear()
                if not down:
                    log.warning("%s: cannot publish its demand in %r (%s); retrying", name, store, exc)
                    down = True
                continue
            if down:
                log.warning("%s: publishing its demand again", name)
                down = False
    finally:
        with trio.CancelScope(shield=True):
            await board.clear(published)


async def read_demand(store: DemandStore) -> dict[str, Demand]:
    """Every proxy's demand in ``store``, summed per app (records that do not decode are left out).

    Raises :class:`~blocks.sources.SourceUnavailable` when etcd does not answer.
    """
    if isinstance(store, EtcdSource):
        _, records = await store.under(DEMAND_PREFIX).snapshot()
    else:
        await trio.lowlevel.checkpoint()
        n = len(DEMAND_PREFIX)
        records = {key[n:]: value for key, value in store.items().items() if key.startswith(DEMAND_PREFIX)}
    total: dict[str, Demand] = {}
    for key, value in records.items():
        try:
            app, _ = parse_demand_key(key)
            demand = decode_demand(value)
        except ValueError as exc:
            log.debug("demand record %s: %s", key, exc)
            continue
        total[app] = total.get(app, Demand()) + demand
    return total


class _Board:
    """One proxy's demand records in a store: writes, and in etcd the lease they are bound to."""

    def __init__(self, store: DemandStore, name: str) -> None:
        self.name = name
        self.etcd = store.under(DEMAND_PREFIX) if isinstance(store, EtcdSource) else None
        self.embedded = store if isinstance(store, EmbeddedStore) else None
        self.lease: int | None = None
        self.renewed = -math.inf

    def key(self, app: str) -> str:
        key = demand_key(app, self.name)
        return key if self.etcd is not None else DEMAND_PREFIX + key

    async def write(self, current: dict[str, Demand], published: dict[str, Demand], ttl: float) -> None:
        """Make the store hold ``current``; ``published`` (what it holds) follows each write that lands."""
        gone = [app for app in published if app not in current]
        if self.embedded is not None:
            changed = {self.key(app): encode_demand(d) for app, d in current.items() if published.get(app) != d}
            self.embedded.transact(changed, [self.key(app) for app in gone])
            published.clear()
            published.update(current)
            await trio.lowlevel.checkpoint()
            return
        etcd = self.etcd
        assert etcd is not None
        if not current:
            await self.release()  # every record goes with its lease
            published.clear()
            return
        if self.lease is None:
            self.lease = await etcd.grant_lease(ttl)
            self.renewed = trio.current_time()
        for app, demand in current.items():
            if published.get(app) != demand:
                await etcd.put(self.key(app), encode_demand(demand), lease=self.lease)
                published[app] = demand
        for app in gone:
            await etcd.delete(self.key(app))
            del published[app]

    async def renew(self, published: dict[str, Demand], ttl: float) -> None:
        """Keep the lease alive every third of ``ttl``; if it had ended, its records are gone: write them again."""
        if self.etcd is None or self.lease is None or trio.current_time() - self.renewed < ttl / 3:
            return
        self.renewed = trio.current_time()
        if await self.etcd.keep_alive(self.lease) <= 0:
            self.lease = None
            published.clear()

    async def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None and self.etcd is not None:
            await self.etcd.revoke_lease(lease)

    async def clear(self, published: dict[str, Demand]) -> None:
        """On the way out: no record of this proxy stays (bounded; a lease that cannot be revoked ends by itself)."""
        try:
            if self.embedded is not None:
                self.embedded.transact(deletes=[self.key(app) for app in published])
            elif self.etcd is not None:
                with trio.move_on_after(self.etcd.request_timeout):
                    await self.release()
        except SourceError:
            pass


__all__ = [
    "DemandStore",
    "read_demand",
    "serve_demand",
]
