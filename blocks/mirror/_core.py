"""The mirror tee's decisions and bookkeeping. Sans-IO: no trio, no clock, no network.

The trio driver (:mod:`blocks.mirror`) asks this module three things:

- **whether to copy a request** (:class:`Sampler`): the app's
  :class:`~blocks.routing.MirrorSetting` gives a fraction by path prefix and
  tenant; with a sampling key the decision is a hash of the key, so the
  same key gets the same decision on every proxy, at every run;
- **whether a body chunk may still be buffered for the shadow**
  (:class:`TeeBuffer` within a :class:`TeeBudget`): one mirrored request
  holds at most its own cap, and all of them together at most the global
  cap. A chunk that does not fit abandons that request's copy: the primary
  is never asked to wait;
- **how the two responses compare** (:class:`BodyDigest`, :class:`Observation`,
  :func:`compare`, :class:`ComparisonBook`): status, selected header fields,
  body length and hash, latency; counts per route, and a bounded stream of
  mismatching pairs for a callback.

Invariants: a :class:`TeeBudget`'s ``used`` is the sum of its live buffers'
``buffered`` (a buffer gives everything back when it is abandoned or
closed, exactly once); :class:`ComparisonBook` holds one entry per route it
has seen (routes come from the settings, so their number is bounded by the
route store) and nothing per request.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import attrs

from blocks._common import Headers
from blocks.routing import MirrorSetting

_SPAN = float(2**64)


def key_point(value: bytes) -> float:
    """Where a sampling key falls in [0, 1): stable across processes and versions (``blake2b``)."""
    return int.from_bytes(hashlib.blake2b(value, digest_size=8).digest(), "big") / _SPAN


class Sampler:
    """Decides which requests are copied, from an app's :class:`~blocks.routing.MirrorSetting`.

    ``rng`` draws for requests without a sampling key (seed it for
    reproducible runs).
    """

    __slots__ = ("_random",)

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = (rng or random.Random()).random

    def decide(self, setting: MirrorSetting, path: bytes, tenant: str | None, key: bytes | None) -> bytes | None:
        """The route the request falls under if it is to be copied, else None.

        The route is the longest of ``setting.prefixes`` that ``path`` starts
        with (``b""`` when the setting has none); a path under none of them is
        never copied. The fraction is the tenant's when ``tenant`` is listed
        in ``setting.tenants``, else the prefix's, else the app's. With a
        ``key`` (the value of the setting's key header), the decision is
        ``key_point(key) < fraction``; without, a random draw.
        """
        fraction = setting.fraction
        route = b""
        if setting.prefixes:
            for prefix, share in setting.prefixes:
                if path.startswith(prefix):
                    route = prefix
                    if share is not None:
                        fraction = share
                    break
            else:
                return None
        if tenant is not None and setting.tenants:
            fraction = setting.tenants.get(tenant, fraction)
        if fraction <= 0.0:
            return None
        if fraction >= 1.0:
            return route
        point = key_point(key) if key is not None else self._random()
        return route if point < fraction else None


# -- buffers ---------------------------------------------------------------------------------


class TeeBudget:
    """The global cap: bytes buffered for all shadows together."""

    __slots__ = ("capacity", "used")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.used = 0


class TeeBuffer:
    """One mirrored request's body copy: what was fed and not yet taken by the shadow.

    :meth:`push` accounts for a chunk before it is buffered; False means it
    does not fit (over ``cap``, or over the budget): the copy is abandoned,
    and everything it held is given back to the budget. :meth:`take` gives
    back what the shadow consumed; :meth:`close` gives back the rest.
    """

    __slots__ = ("abandoned", "budget", "buffered", "cap", "closed", "total")

    def __init__(self, budget: TeeBudget, cap: int) -> None:
        self.budget = budget
        self.cap = cap
        self.buffered = 0
        self.total = 0  # bytes pushed in all
        self.abandoned = False
        self.closed = False

    def push(self, size: int) -> bool:
        if self.closed:
            return False
        budget = self.budget
        if self.buffered + size > self.cap or budget.used + size > budget.capacity:
            self.abandoned = True
            self.close()
            return False
        self.buffered += size
        self.total += size
        budget.used += size
        return True

    def take(self, size: int) -> None:
        if self.closed:
            return
        size = min(size, self.buffered)
        self.buffered -= size
        self.budget.used -= size

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.budget.used -= self.buffered
            self.buffered = 0


# -- comparison ------------------------------------------------------------------------------


class BodyDigest:
    """A body's length, hash (``blake2b``, 128 bits) and first ``sample`` bytes, fed chunk by chunk."""

    __slots__ = ("_hash", "_sample", "length", "sample")

    def __init__(self, sample: int = 0) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self._sample = sample
        self.length = 0
        self.sample = b""

    def update(self, data: bytes) -> None:
        self._hash.update(data)
        self.length += len(data)
        if len(self.sample) < self._sample:
            self.sample += data[: self._sample - len(self.sample)]

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


@attrs.frozen
class Observation:
    """One side of a mirrored pair: what came back, and how long it took.

    ``headers``: the compared fields, in the setting's order (a missing
    field is ``None``); ``latency``: seconds from the decision to the end of
    the response body; ``sample``: the body's first bytes (for inspection).
    """

    status: int
    headers: tuple[tuple[bytes, bytes | None], ...]
    length: int
    digest: str
    latency: float
    sample: bytes = b""


def select_headers(headers: Headers, names: Sequence[bytes]) -> tuple[tuple[bytes, bytes | None], ...]:
    """``names`` with their first value in ``headers`` (or None), in the order of ``names``."""
    if not names:
        return ()
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in names and name not in found:
            found[name] = value
    return tuple((name, found.get(name)) for name in names)


def compare(primary: Observation, shadow: Observation) -> tuple[str, ...]:
    """What differs between the two responses: ``status``, ``header <name>``, ``length``, ``body``; () if nothing."""
    differences = []
    if primary.status != shadow.status:
        differences.append("status")
    for (name, value), (_, other) in zip(primary.headers, shadow.headers, strict=False):
        if value != other:
            differences.append(f"header {name.decode('latin-1')}")
    if primary.length != shadow.length:
        differences.append("length")
    if primary.digest != shadow.digest:
        differences.append("body")
    return tuple(differences)


@attrs.frozen
class MirrorPair:
    """A primary response and its shadow's, compared: what an ``on_mismatch`` callback receives."""

    app: str
    route: str
    method: bytes
    path: bytes
    primary: Observation
    shadow: Observation
    differences: tuple[str, ...]

    @property
    def matched(self) -> bool:
        return not self.differences


@attrs.frozen
class RouteComparison:
    """The comparisons of one route (``app`` or ``app /prefix``): counts and latency totals.

    ``latency_ratio`` is the shadow's mean latency over the primary's (1.0:
    as fast; above 1: the shadow is slower), over the compared pairs.
    """

    pairs: int
    matches: int
    mismatches: int
    primary_latency: float
    shadow_latency: float

    @property
    def latency_ratio(self) -> float:
        return self.shadow_latency / self.primary_latency if self.primary_latency > 0 else float("nan")


class ComparisonBook:
    """Counts compared pairs per route, and says which mismatches to report.

    At most ``report_limit`` mismatching pairs are reported per
    ``report_interval`` seconds (a token bucket); the rest are only counted
    (``unreported``), so an inspection callback can never be flooded.
    """

    __slots__ = ("_limit", "_rate", "_routes", "_stamp", "_tokens", "reported", "unreported")

    def __init__(self, *, report_limit: int = 10, report_interval: float = 1.0) -> None:
        if report_limit < 0 or report_interval <= 0:
            raise ValueError("report_limit must be >= 0 and report_interval > 0")
        self._routes: dict[str, list[float]] = {}  # route -> [pairs, matches, primary s, shadow s]
        self._limit = float(report_limit)
        self._rate = report_limit / report_interval
        self._tokens = float(report_limit)
        self._stamp: float | None = None
        self.reported = 0
        self.unreported = 0

    def record(self, pair: MirrorPair, now: float) -> bool:
        """Count ``pair``; True if it is a mismatch to report now."""
        entry = self._routes.get(pair.route)
        if entry is None:
            entry = self._routes[pair.route] = [0, 0, 0.0, 0.0]
        entry[0] += 1
        entry[2] += pair.primary.latency
        entry[3] += pair.shadow.latency
        if pair.matched:
            entry[1] += 1
            return False
        if self._stamp is not None:
            self._tokens = min(self._limit, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self.reported += 1
            return True
        self.unreported += 1
        return False

    def routes(self) -> dict[str, RouteComparison]:
        return {
            route: RouteComparison(int(p), int(m), int(p) - int(m), primary, shadow)
            for route, (p, m, primary, shadow) in self._routes.items()
        }


def route_name(app: str, route: bytes) -> str:
    """How a route is named in the statistics: the app, then the matched prefix if any."""
    return f"{app} {route.decode('latin-1')}" if route else app


__all__ = [
    "BodyDigest",
    "ComparisonBook",
    "MirrorPair",
    "Observation",
    "RouteComparison",
    "Sampler",
    "TeeBudget",
    "TeeBuffer",
    "compare",
    "key_point",
    "route_name",
    "select_headers",
]
