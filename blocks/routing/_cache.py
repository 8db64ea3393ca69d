"""The route cache: the route store's contents in memory, read at dict speed.

Theory of operation
-------------------

A route source (the embedded store, etcd) owns the truth: keys and JSON
values in the layout of :mod:`blocks.routing._layout`, each change stamped
with the store's revision. The source feeds this cache a snapshot
(:meth:`RouteCache.load`) and then the change stream
(:meth:`RouteCache.apply`); the proxy reads it on every request with
:meth:`~RouteCache.app_for` and :meth:`~RouteCache.replicas`, two dict reads.
The cache never does I/O and never reads a clock: ``now`` comes in.

Invariants
----------

- **The cache is a function of the store's contents.** After ``load(S, r)``
  and any ``apply`` calls, the cache holds what the store held at the last
  revision applied, whatever the duplicates and replays on the way. A key
  whose value is bad (not JSON, a missing field, a key that fits no layout)
  counts as absent: a bad write drops that key's previous route. The reason
  is counted in ``statistics().bad_values``.
- **No duplicates.** ``apply`` skips an event whose revision is not above
  the cache's revision when the call began, or below one already applied
  in the call. Several events with one revision (one etcd transaction) are
  all applied, so they must arrive in one call. Gaps are the source's
  business: a source that lost events reloads.
- **Reads are precomputed.** ``replicas(app)`` returns a tuple of the app's
  ``live`` replicas sorted by name, built when a change touches that app and
  only then; an app whose tuple comes out equal keeps the same object, so
  policies can key their own precomputation on it (see ``AffinityHash``).
- **Memory is bounded by the store.** One entry per valid key, one tuple
  per app with a live replica, a counter per bad-value reason (a fixed set).
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter
from typing import Literal

import attrs

from blocks.routing._demand import DEMAND_PREFIX
from blocks.routing._layout import decode_domain, decode_replica, parse_key
from blocks.routing._settings import AppSettings, decode_settings, parse_settings_key
from blocks.routing._table import Replica, app_for

log = logging.getLogger("blocks.routing")

_by_name = attrgetter("name")


@attrs.frozen
class RouteEvent:
    """One change from a route source's stream: a ``put`` of ``value`` at ``key``, or a ``delete``.

    ``revision`` is the store's revision of the change; it only grows.
    """

    kind: Literal["put", "delete"] = attrs.field(validator=attrs.validators.in_(("put", "delete")))
    key: str
    value: bytes | None
    revision: int


@attrs.frozen
class RouteCacheStatistics:
    """A snapshot of a :class:`RouteCache`.

    ``revision``: the store revision it reflects; ``domains``, ``apps`` and
    ``replicas``: routes held (apps with at least one replica, replicas in
    any state); ``live``: replicas offered to policies; ``staleness``:
    seconds since the source last confirmed the cache current (0 while in
    sync, ``inf`` before the first load); ``bad_values``: reason -> keys
    ignored for it, since the cache was made; ``ignored_events``: events
    skipped as already seen; ``rebuilds``: app tuples rebuilt; ``settings``:
    apps with a settings record.
    """

    revision: int
    domains: int
    apps: int
    replicas: int
    live: int
    staleness: float
    bad_values: dict[str, int]
    ignored_events: int
    rebuilds: int
    settings: int = 0


class RouteCache:
    """The route store's contents in memory: domain -> app -> live replicas. Sans-IO.

    A route source calls :meth:`load` with a snapshot, then :meth:`apply`
    with each batch of its change stream, :meth:`synced` when the store
    confirms the cache is current without a change (a progress
    notification), and :meth:`unsynced` when it loses the stream. The proxy
    reads :meth:`app_for` and :meth:`replicas` (the :class:`Routes` API).
    ``now`` is any monotonic clock in seconds, the same for every call::

        cache = RouteCache()
        cache.load({route_key_for_domain("app.example"): encode_domain("app"),
                    route_key_for_replica("app", "r1"): encode_replica(worker=("10.0.0.5", 9000),
                                                                       address=("127.0.0.1", 8001))},
                   revision=7, now=now)
        cache.app_for(b"app.example:443")   # 'app'
        cache.replicas("app")               # (Replica(name='r1', ...),)
        cache.apply([RouteEvent("delete", route_key_for_replica("app", "r1"), None, 8)], now)
        cache.replicas("app")               # ()
    """

    def __init__(self) -> None:
        self.revision = 0
        self._domains: dict[bytes, str] = {}
        self._apps: dict[str, dict[str, Replica]] = {}  # app -> name -> replica, any state
        self._live: dict[str, tuple[Replica, ...]] = {}  # app -> its live replicas by name; never empty
        self._settings: dict[str, AppSettings] = {}  # app -> its settings record
        self._confirmed = -math.inf  # when the source last confirmed the cache current
        self._in_sync = False
        self._now = -math.inf
        self._bad: dict[str, int] = {}
        self._ignored = 0
        self._rebuilds = 0
        self._listeners: list[Callable[[frozenset[str]], None]] = []
        self._changed: set[str] = set()  # apps whose live replicas or settings changed in this load or apply

    def __repr__(self) -> str:
        return (
            f"<RouteCache revision={self.revision} domains={len(self._domains)} apps={len(self._apps)} "
            f"in_sync={self._in_sync}>"
        )

    # -- the read API (Routes) --------------------------------------------------------------

    def app_for(self, authority: bytes) -> str | None:
        """The app for ``authority``: exact, then the host without its port, then ``*``."""
        return app_for(self._domains, authority)

    def replicas(self, app: str) -> Sequence[Replica]:
        """``app``'s live replicas, sorted by name; ``()`` if none. The same tuple until a change touches it."""
        return self._live.get(app, ())

    def app_replicas(self) -> Mapping[str, Sequence[Replica]]:
        """Every app with live replicas, and them (a read-only view)."""
        return types.MappingProxyType(self._live)

    def settings(self, app: str) -> AppSettings | None:
        """``app``'s settings record (``apps/<app>/settings``), or None."""
        return self._settings.get(app)

    @property
    def app_settings(self) -> Mapping[str, AppSettings]:
        """Every app's settings record (a read-only view), as :attr:`RouteTable.app_settings`."""
        return types.MappingProxyType(self._settings)

    def replica(self, app: str, name: str) -> Replica | None:
        """``app``'s replica ``name`` whatever its state (a session's pinned replica), or None."""
        entries = self._apps.get(app)
        return entries.get(name) if entries is not None else None

    def add_listener(self, listener: Callable[[frozenset[str]], None]) -> Callable[[], None]:
        """Call ``listener`` with the apps whose live replicas or settings changed, after each load or apply
        that changed any.

        What waits on the routes (a cold start waiting for its app's first
        replica) listens instead of polling. The call is synchronous, inside
        the route source's task, once the whole change is applied: a listener
        must not block; one that raises is logged and the others still run.
        Returns the function that removes it.
        """
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    def _notify(self) -> None:
        if not self._changed:
            return
        changed, self._changed = frozenset(self._changed), set()
        for listener in list(self._listeners):
            try:
                listener(changed)
            except Exception:
                log.exception("route cache listener %r failed", listener)

    # -- feeding it -------------------------------------------------------------------------

    def load(self, snapshot: Mapping[str, bytes], revision: int, now: float) -> None:
        """Replace everything with ``snapshot``, the store's contents at ``revision``."""
        domains: dict[bytes, str] = {}
        apps: dict[str, dict[str, Replica]] = {}
        settings, self._settings = self._settings, {}
        try:
            for key, value in snapshot.items():
                self._put(domains, apps, key, value)
        except BaseException:
            self._settings = settings
            raise
        self._changed.update(settings.keys() - self._settings.keys())  # settings gone with the snapshot
        old_apps = self._apps
        self._domains, self._apps = domains, apps
        self.revision = revision
        for app in old_apps.keys() | apps.keys():
            self._rebuild(app)
        self.synced(now)
        self._notify()

    def apply(self, events: Sequence[RouteEvent], now: float) -> None:
        """Apply a batch of changes in order, skipping those already seen; confirms the cache current."""
        start = high = self.revision
        domains, apps = self._domains, self._apps
        touched: set[str] = set()
        try:
            for event in events:
                revision = event.revision
                if revision <= start or revision < high:
                    self._ignored += 1
                    continue
                if event.kind == "put":
                    app = self._put(domains, apps, event.key, event.value)
                else:
                    app = self._delete(domains, apps, event.key)
                high = revision
                if app is not None:
                    touched.add(app)
        finally:  # whatever an event held, what was applied is read consistently
            self.revision = high
            for app in touched:
                self._rebuild(app)
        self.synced(now)
        self._notify()

    def synced(self, now: float) -> None:
        """The source confirms the cache is current (an event, a progress notification): staleness is 0."""
        self._confirmed = now
        self._in_sync = True
        self._now = max(self._now, now)

    def unsynced(self, now: float) -> None:
        """The source lost its stream: staleness grows from the last confirmation until the next one."""
        self._in_sync = False
        self._now = max(self._now, now)

    def staleness(self, now: float) -> float:
        """Seconds since the source last confirmed the cache current; 0 while in sync, inf if never."""
        if self._in_sync:
            return 0.0
        return max(0.0, now - self._confirmed)

    def statistics(self, now: float | None = None) -> RouteCacheStatistics:
        """A snapshot; ``staleness`` at ``now``, or at the latest ``now`` the cache was given."""
        return RouteCacheStatistics(
            revision=self.revision,
            domains=len(self._domains),
            apps=len(self._apps),
            replicas=sum(map(len, self._apps.values())),
            live=sum(map(len, self._live.values())),
            staleness=self.staleness(self._now if now is None else now),
            bad_values=dict(self._bad),
            ignored_events=self._ignored,
            rebuilds=self._rebuilds,
            settings=len(self._settings),
        )

    # -- internals --------------------------------------------------------------------------

    def _bad_value(self, reason: str) -> None:
        self._bad[reason] = self._bad.get(reason, 0) + 1

    def _put(
        self, domains: dict[bytes, str], apps: dict[str, dict[str, Replica]], key: str, value: bytes | None
    ) -> str | None:
        """Store ``key``'s value (or, if it is bad, drop its route); the app whose replicas changed, if any."""
        if key.startswith(DEMAND_PREFIX):
            return None
        owner = parse_settings_key(key)
        if owner is not None:
            # Settings never change the replica tuples: nothing to rebuild; the listeners hear of it.
            self._changed.add(owner)
            try:
                if value is None:
                    raise ValueError("no value")
                self._settings[owner] = decode_settings(value)
            except ValueError as exc:
                self._bad_value(str(exc))
                self._settings.pop(owner, None)
            return None
        try:
            app, name = parse_key(key)
        except ValueError as exc:
            self._bad_value(str(exc))
            return None
        try:
            if value is None:
                raise ValueError("no value")
            if app is None:
                domains[name.encode()] = decode_domain(value)
                return None
            replica = decode_replica(name, value)
        except ValueError as exc:
            self._bad_value(str(exc))
            return self._delete(domains, apps, key)
        entries = apps.get(app)
        if entries is None:
            entries = apps[app] = {}
        entries[name] = replica
        return app

    def _delete(self, domains: dict[bytes, str], apps: dict[str, dict[str, Replica]], key: str) -> str | None:
        if key.startswith(DEMAND_PREFIX):
            return None
        owner = parse_settings_key(key)
        if owner is not None:
            if self._settings.pop(owner, None) is not None:
                self._changed.add(owner)
            return None
        try:
            app, name = parse_key(key)
        except ValueError:
            return None  # never held
        if app is None:
            domains.pop(name.encode(), None)
            return None
        entries = apps.get(app)
        if entries is None or entries.pop(name, None) is None:
            return None
        if not entries:
            del apps[app]
        return app

    def _rebuild(self, app: str) -> None:
        entries = self._apps.get(app)
        live = tuple(sorted((r for r in entries.values() if r.state == "live"), key=_by_name)) if entries else ()
        old = self._live.get(app)
        if live:
            if old != live:
                self._live[app] = live
                self._rebuilds += 1
                self._changed.add(app)
        elif old is not None:
            del self._live[app]
            self._changed.add(app)
            self._rebuilds += 1
