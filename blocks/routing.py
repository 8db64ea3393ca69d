"""Routing state and policies: authority -> app -> replicas -> one replica.

The route table lives in memory and is read per request at dict speed; a
policy picks one replica among an app's candidates from the in-flight
counts the proxy keeps. Both are sans-IO: no trio, no clock.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

Address = tuple[str, int]
"""A ``(host, port)`` to connect to."""


@attrs.frozen(kw_only=True)
class Replica:
    """One replica of an app: where its worker is and how the worker reaches it.

    ``name`` is unique across the fleet; ``worker`` is the worker's address
    (the proxy's upstream); ``address`` is the replica's own address as the
    worker sees it; ``protocol`` is what the worker speaks to it (``h2`` or
    ``h1``).
    """

    name: str
    worker: Address
    address: Address
    protocol: str = attrs.field(default="h2", validator=attrs.validators.in_(("h2", "h1")))


def _host_of(authority: bytes) -> bytes:
    if authority.endswith(b"]"):
        return authority
    host, sep, port = authority.rpartition(b":")
    return host if sep and port.isdigit() else authority


@attrs.define(eq=False)
class RouteTable:
    """Domains to apps, apps to replicas.

    ``domains`` maps a host (``example.com``), a host with port, or ``*``
    (everything else) to an app name. Lookups try the authority as sent,
    then its host without port, then ``*``.
    """

    domains: dict[bytes, str] = attrs.field(factory=dict)
    apps: dict[str, list[Replica]] = attrs.field(factory=dict)

    @classmethod
    def build(cls, domains: Mapping[str, str], apps: Mapping[str, Sequence[Replica]]) -> RouteTable:
        return cls(
            {domain.lower().encode(): app for domain, app in domains.items()},
            {app: list(replicas) for app, replicas in apps.items()},
        )

    def app_for(self, authority: bytes) -> str | None:
        domains = self.domains
        app = domains.get(authority)
        if app is None:
            app = domains.get(_host_of(authority))
            if app is None:
                app = domains.get(b"*")
        return app

    def replicas(self, app: str) -> list[Replica]:
        return self.apps.get(app, [])


class Policy(Protocol):
    """Chooses one replica among the candidates (never empty)."""

    def pick(self, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica: ...


class LeastInFlight:
    """The candidate with the fewest requests in flight; ties broken at random."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._random = (rng or random.Random()).random

    def pick(self, candidates: Sequence[Replica], in_flight: Mapping[str, int]) -> Replica:
        best = candidates[0]
        if len(candidates) == 1:
            return best
        best_load = in_flight.get(best.name, 0)
        ties = 1
        rand = self._random
        for replica in candidates[1:]:
            load = in_flight.get(replica.name, 0)
            if load < best_load:
                best, best_load, ties = replica, load, 1
            elif load == best_load:
                ties += 1
                if rand() * ties < 1:  # reservoir sampling: each tie equally likely
                    best = replica
        return best
