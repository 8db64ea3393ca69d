"""A hop's own records in etcd for as long as it runs: how a fleet learns its workers and proxies.

A worker registers the replicas beside it (``apps/<app>/replicas/<name>``
with its own address as their ``worker``), a proxy registers itself for
the edges (:data:`PROXIES_PREFIX`). Each record is bound to an etcd lease
of ``ttl`` seconds that :func:`serve_registration` renews every third of
it, so a hop that dies (``kill -9``, a lost machine) leaves the store within
``ttl`` seconds, and one that drains leaves it at once (the lease is
revoked), before its listener closes: the proxies and edges following the
store stop sending to it. ``lasting`` records (an app's domains, which
several workers share) are written once, bound to no lease.

Nothing here is on the request path. When etcd cannot be reached the hop
serves on, says so once, and registers again (a new lease) once it can:
its records come back by themselves.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import trio

from blocks.errors import SourceUnavailable
from blocks.sources.etcd import EtcdSource

log = logging.getLogger("blocks.sources")

PROXIES_PREFIX = "proxyblocks-hops/"
"""The etcd prefix where proxies register (``apps/proxies/replicas/<name>``), apart from the routes,
so a proxy's route cache never sees them: an edge follows ``EtcdSource(url, PROXIES_PREFIX)``."""

PROXIES_APP = "proxies"
"""The app under :data:`PROXIES_PREFIX` whose replicas are the proxies (each its own ``worker``)."""

RETRY = 1.0
"""Seconds between attempts to register while etcd cannot be reached."""


async def serve_registration(
    source: EtcdSource,
    records: Mapping[str, bytes],
    *,
    ttl: float = 10.0,
    lasting: Mapping[str, bytes] | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``records`` in ``source`` under a lease of ``ttl`` seconds until cancelled, then revoke it.

    Reports started once the records are written (or, if etcd cannot be
    reached at first, after the first attempt: the hop serves without
    waiting for etcd). ``lasting`` records are put once, with no lease.
    """
    if not ttl >= 1.0 or not math.isfinite(ttl):
        raise ValueError(f"ttl must be at least 1 second, not {ttl!r}")
    lease: int | None = None
    down = False
    try:
        while True:
            try:
                if lease is None:
                    lease = await source.grant_lease(ttl)
                    for key, value in (lasting or {}).items():
                        await source.put(key, value)
                    for key, value in records.items():
                        await source.put(key, value, lease=lease)
                    if down:
                        log.warning("registered again in %s", source.url)
                        down = False
                elif await source.keep_alive(lease) <= 0:
                    lease = None  # it ended while etcd was away: its records are gone, write them again
                    continue
            except SourceUnavailable as exc:
                if not down:
                    log.warning("cannot register in %s (%s); retrying", source.url, exc)
                    down = True
                lease = None
            if task_status is not trio.TASK_STATUS_IGNORED:
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
            await trio.sleep(ttl / 3 if lease is not None else RETRY)
    finally:
        if lease is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(source.request_timeout):
                try:
                    await source.revoke_lease(lease)
                except SourceUnavailable:
                    pass  # it ends by itself within ttl


__all__ = [
    "PROXIES_APP",
    "PROXIES_PREFIX",
    "RETRY",
    "serve_registration",
]
