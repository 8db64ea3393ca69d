"""Replicas, the read API every route source shares, and the static route table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import attrs

from blocks.transport import Address

if TYPE_CHECKING:
    from blocks.routing._settings import AppSettings

PROTOCOLS = ("h2", "h1", "https")
"""What a worker may speak to a replica: cleartext HTTP/2 (prior knowledge), HTTP/1.1, or TLS with ALPN."""

STATES = ("live", "draining", "down")
"""A replica's states. Only ``live`` replicas are offered to a policy by a :class:`RouteCache`."""


@attrs.frozen(kw_only=True)
class Replica:
    """One replica of an app: where its worker is and how the worker reaches it.

    ``name`` is unique across the fleet; ``worker`` is the worker's address
    (the proxy's upstream); ``address`` is the replica's own address as the
    worker sees it; ``protocol`` is what the worker speaks to it (``h2``,
    ``h1``, or ``https``: TLS, its ALPN settling on h2 or h1). ``capacity``
    is how many requests it serves at once (``0``: unknown), for policies
    and probers that want it; ``state`` is ``live``, ``draining`` or
    ``down``.
    """

    name: str
    worker: Address
    address: Address
    protocol: str = attrs.field(default="h2", validator=attrs.validators.in_(PROTOCOLS))
    capacity: int = attrs.field(default=0, validator=[attrs.validators.instance_of(int), attrs.validators.ge(0)])
    state: str = attrs.field(default="live", validator=attrs.validators.in_(STATES))
    target: bytes = attrs.field(init=False, eq=False, repr=False)
    """How the worker reaches it, as the proxy tells the worker (``x-proxyblocks-target``):
    ``<protocol> <host:port>``, made once here so a request pays an attribute read."""

    @target.default
    def _target(self) -> bytes:
        host, port = self.address
        return f"{self.protocol} [{host}]:{port}".encode() if ":" in host else f"{self.protocol} {host}:{port}".encode()


class Routes(Protocol):
    """What the proxy reads on every request: :class:`RouteTable` and :class:`RouteCache` both are.

    Both calls are plain dict reads: no I/O, no await, no clock.
    """

    def app_for(self, authority: bytes) -> str | None:
        """The app for ``authority``: exact, then the host without port, then ``*``; None if none."""
        ...

    def replicas(self, app: str) -> Sequence[Replica]:
        """The app's replicas to choose from (possibly empty), in a stable order."""
        ...

    def app_replicas(self) -> Mapping[str, Sequence[Replica]]:
        """Every app and its replicas to choose from: for background work (a prober), never per request."""
        ...

    def settings(self, app: str) -> AppSettings | None:
        """The app's settings record (``apps/<app>/settings``), or None: a dict read.

        Read only by features that are switched on (the mirror tee), so a
        ``Routes`` of your own needs it only for those.
        """
        ...

    def replica(self, app: str, name: str) -> Replica | None:
        """``app``'s replica ``name`` in any state (a session's pinned replica), or None."""
        ...


def app_for(domains: Mapping[bytes, str], authority: bytes) -> str | None:
    """The app for ``authority`` in ``domains``: exact, then the host without its port, then ``*``."""
    app = domains.get(authority)
    if app is None:
        app = domains.get(host_of(authority))
        if app is None:
            app = domains.get(b"*")
    return app


def host_of(authority: bytes) -> bytes:
    """``authority`` without a trailing ``:port`` (all digits); IPv6 literals keep their brackets."""
    if authority.endswith(b"]"):
        return authority
    host, sep, port = authority.rpartition(b":")
    return host if sep and port.isdigit() else authority


@attrs.define(eq=False)
class RouteTable:
    """A static table of domains to apps, apps to replicas.

    ``domains`` maps a host (``example.com``), a host with port, or ``*``
    (everything else) to an app name. Lookups try the authority as sent,
    then its host without port, then ``*``. The replica lists are offered to
    the policy as they are: a table does not look at ``Replica.state``.
    ``app_settings`` maps an app to its :class:`~blocks.routing.AppSettings`
    (what it mirrors, ...). For routes that change at run time, see
    :class:`RouteCache`.
    """

    domains: dict[bytes, str] = attrs.field(factory=dict)
    apps: dict[str, list[Replica]] = attrs.field(factory=dict)
    app_settings: dict[str, AppSettings] = attrs.field(factory=dict)

    @classmethod
    def build(
        cls,
        domains: Mapping[str, str],
        apps: Mapping[str, Sequence[Replica]],
        settings: Mapping[str, AppSettings] | None = None,
    ) -> RouteTable:
        return cls(
            {domain.lower().encode(): app for domain, app in domains.items()},
            {app: list(replicas) for app, replicas in apps.items()},
            dict(settings or {}),
        )

    def app_for(self, authority: bytes) -> str | None:
        return app_for(self.domains, authority)

    def replicas(self, app: str) -> list[Replica]:
        return self.apps.get(app, [])

    def app_replicas(self) -> Mapping[str, Sequence[Replica]]:
        return self.apps

    def settings(self, app: str) -> AppSettings | None:
        return self.app_settings.get(app)

    def replica(self, app: str, name: str) -> Replica | None:
        for replica in self.apps.get(app, ()):
            if replica.name == name:
                return replica
        return None
