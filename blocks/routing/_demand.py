"""Demand records: what waits at a proxy for an app's replicas, as the proxy publishes it to the route store.

A proxy holds requests for an app with no live replica (a cold start) and
session starts in the app's session queue; an autoscaler in another process
cannot see them, so the proxy publishes its counts, one record per app and
proxy, and the autoscaler reads them each round::

    proxyblocks-demand/<app>/<proxy>     {"requests": <int>, "sessions": <int>}

The prefix is apart from the routes' (``proxyblocks/`` in etcd), so a
proxy's route watch never hears of them; in an embedded store, which holds
routes and demand side by side, a :class:`~blocks.routing.RouteCache`
ignores every key under it. A count of 0 is never written: a proxy deletes
its record instead. Neither an app nor a proxy name may contain ``/``.
"""

from __future__ import annotations

import json

import attrs

from blocks.routing._layout import json_object

DEMAND_PREFIX = "proxyblocks-demand/"


@attrs.frozen
class Demand:
    """What waits for one app at one proxy (or, summed, at every proxy).

    ``requests``: requests held for a replica (a cold start: the app has no
    live replica); ``sessions``: session starts waiting in the app's session
    queue (for a place, or for a replica). Adding two sums them.
    """

    requests: int = 0
    sessions: int = 0

    def __bool__(self) -> bool:
        return bool(self.requests or self.sessions)

    def __add__(self, other: Demand) -> Demand:
        return Demand(self.requests + other.requests, self.sessions + other.sessions)

    @property
    def total(self) -> int:
        return self.requests + self.sessions


def _name(kind: str, value: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"{kind} must be non-empty and without '/', not {value!r}")
    return value


def demand_key(app: str, proxy: str) -> str:
    """The key of ``proxy``'s demand for ``app``, relative to :data:`DEMAND_PREFIX`: ``<app>/<proxy>``."""
    return f"{_name('an app', app)}/{_name('a proxy name', proxy)}"


def parse_demand_key(key: str) -> tuple[str, str]:
    """``(app, proxy)`` of a key relative to :data:`DEMAND_PREFIX`; ValueError("unknown key") otherwise."""
    app, sep, proxy = key.partition("/")
    if not (sep and app and proxy) or "/" in proxy:
        raise ValueError("unknown key")
    return app, proxy


def encode_demand(demand: Demand) -> bytes:
    """The value of a demand record: ``{"requests": n, "sessions": m}``."""
    for count in (demand.requests, demand.sessions):
        if type(count) is not int or count < 0:
            raise ValueError(f"a demand counts with ints >= 0, not {count!r}")
    return json.dumps({"requests": demand.requests, "sessions": demand.sessions}, separators=(",", ":")).encode()


def decode_demand(value: bytes) -> Demand:
    """A demand record's value; ValueError with a fixed reason if it is not one (missing counts are 0)."""
    fields = json_object(value)
    counts = [fields.get(name, 0) for name in ("requests", "sessions")]
    if any(type(count) is not int or count < 0 for count in counts):
        raise ValueError("bad count")
    return Demand(*counts)
