"""The driver's writes to the route store: bounded, failures named, deletes kept until they land.

Every write is bounded by :data:`STORE_TIMEOUT` and fails only with a
:class:`~blocks.errors.SourceError` (an etcd that does not answer in time is
a :class:`~blocks.errors.SourceUnavailable`), which the replica task handles:
one failed write never takes the driver, or any other replica, down.

A delete that fails is not dropped: :class:`PendingDeletes` keeps its key
and the driver tries again every round, and a replica's name is not reused
while its delete is pending (a late delete would remove the new record).

Ownership: the driver names its replicas ``<app>-<n>`` and scales each app
alone (an app has one driver), so every ``apps/<app>/replicas/<app>-<n>``
record of its apps is one a driver of that app wrote. On entry it deletes
those (:func:`owned_keys`): what a driver that was killed left behind.
Records of other names (a route file's, an operator's) are left alone.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

import attrs
import trio

from blocks.errors import SourceError, SourceUnavailable
from blocks.routing import route_key_for_replica
from blocks.sources import EmbeddedStore, EtcdSource

log = logging.getLogger("blocks.autoscaler")

STORE_TIMEOUT = 5.0
"""Seconds a store write may take before it counts as failed."""

Store = EmbeddedStore | EtcdSource


async def put(store: Store, records: Mapping[str, bytes]) -> None:
    """Put ``records``; :class:`SourceUnavailable` if the store does not answer in time."""
    with trio.move_on_after(STORE_TIMEOUT):
        if isinstance(store, EmbeddedStore):
            store.transact(records)
            await trio.lowlevel.checkpoint()
        else:
            for key, value in records.items():
                await store.put(key, value)
        return
    raise SourceUnavailable(f"the route store took over {STORE_TIMEOUT:g}s to put {sorted(records)[0]}")


async def delete(store: Store, keys: Iterable[str]) -> None:
    """Delete ``keys`` (a missing key is no error); :class:`SourceUnavailable` if the store does not answer in time."""
    keys = list(keys)
    with trio.move_on_after(STORE_TIMEOUT):
        if isinstance(store, EmbeddedStore):
            store.transact(deletes=keys)
            await trio.lowlevel.checkpoint()
        else:
            for key in keys:
                await store.delete(key)
        return
    raise SourceUnavailable(f"the route store took over {STORE_TIMEOUT:g}s to delete {keys[0]}")


def owned_name(app: str, name: str) -> bool:
    """Whether ``name`` is one the driver gives a replica of ``app`` (``<app>-<n>``)."""
    return re.fullmatch(re.escape(app) + r"-\d+", name) is not None


async def owned_keys(store: Store, apps: Iterable[str]) -> list[str]:
    """The keys of the replica records of ``apps`` that a driver wrote (see the module's ownership rule)."""
    with trio.move_on_after(STORE_TIMEOUT):
        _, records = await store.snapshot()
        keys: list[str] = []
        for app in apps:
            prefix = route_key_for_replica(app, "x")[:-1]
            keys.extend(
                key for key in sorted(records) if key.startswith(prefix) and owned_name(app, key[len(prefix) :])
            )
        return keys
    raise SourceUnavailable(f"the route store took over {STORE_TIMEOUT:g}s to list its records")


@attrs.define(eq=False)
class PendingDeletes:
    """Deletes that failed, by key, tried again by :meth:`retry` (once a round)."""

    keys: set[str] = attrs.field(factory=set)

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    async def delete(self, store: Store, key: str) -> bool:
        """Delete ``key`` now; on a failure keep it for :meth:`retry`. True if it is gone."""
        try:
            await delete(store, [key])
        except SourceError as exc:
            log.warning("route store: %s; the delete is tried again each round", exc)
            self.keys.add(key)
            return False
        self.keys.discard(key)
        return True

    async def retry(self, store: Store) -> None:
        """Try every pending delete once more; those that fail again stay."""
        for key in sorted(self.keys):
            try:
                await delete(store, [key])
            except SourceError as exc:
                log.debug("route store: %s; still pending", exc)
            else:
                self.keys.discard(key)
                log.info("route store: %s deleted (pending since a failed delete)", key)
