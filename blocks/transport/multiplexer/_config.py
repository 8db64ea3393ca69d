"""Configuration and statistics of the upstream pools."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from blocks.transport import Address
from blocks.transport._h2 import H2ConnectionStatistics

log = logging.getLogger("blocks.multiplexer")


def _optional(validator: Any) -> Any:  # (None, or what ``validator`` takes; typed Any as listener's are)
    return attrs.validators.optional(validator)


Dial = Callable[[], Awaitable[trio.abc.Stream]]
"""How a pool opens a connection to its address: TCP (the default), or TCP and a TLS handshake."""


@attrs.frozen(kw_only=True)
class UpstreamConfig:
    """Knobs of the upstream pools. Durations in seconds.

    ``response_timeout`` is the upstream's time to answer a whole request:
    it bounds the wait for a response head from the moment the request's end
    went upstream (an extended CONNECT's: from its head), 504 past it,
    checked every ``timeout_resolution`` seconds; an upload, however long,
    and a streaming body after the head are not on it. ``stall_timeout``
    bounds how long the upstream may take no byte of a request (an h2
    window that stays shut, an h1 write that makes no progress): 504, or
    in an h1 tunnel (a WebSocket to an h1 upstream) both sides closed.

    ``ca_file`` (PEM) is what ``https`` upstreams' certificates are verified
    against, instead of the system's trust store.

    h2 connections' lifetime: ``max_requests_per_connection`` streams at
    most, then the connection takes no new one and closes once its last
    stream is done (below a server's own limit, whose GOAWAY would race the
    streams in flight); ``h2_idle_timeout``, a connection without a stream
    that long is closed with GOAWAY(NO_ERROR); ``h2_ping_interval``, a
    connection the upstream has sent nothing on that long gets a PING, and
    one whose PING is not acknowledged within ``h2_ping_timeout`` is dead:
    its streams fail (or are retried) at once, and it takes no new one.
    ``None`` turns the first three off.
    """

    connect_timeout: float = attrs.field(default=5.0, validator=attrs.validators.gt(0))
    response_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    max_connections: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    max_streams_per_connection: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    max_idle_h1: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    stream_window: int = attrs.field(default=256 * 1024, validator=attrs.validators.ge(65535))
    connection_window: int = attrs.field(default=16 * 1024 * 1024, validator=attrs.validators.ge(65535))
    max_header_list_size: int = attrs.field(default=64 * 1024, validator=attrs.validators.ge(1024))
    timeout_resolution: float = attrs.field(default=0.05, validator=attrs.validators.gt(0))
    stall_timeout: float = attrs.field(default=30.0, validator=attrs.validators.gt(0))
    ca_file: Path | None = attrs.field(default=None, converter=attrs.converters.optional(Path))
    max_requests_per_connection: int | None = attrs.field(default=1000, validator=_optional(attrs.validators.ge(1)))
    h2_idle_timeout: float | None = attrs.field(default=60.0, validator=_optional(attrs.validators.gt(0)))
    h2_ping_interval: float | None = attrs.field(default=30.0, validator=_optional(attrs.validators.gt(0)))
    h2_ping_timeout: float = attrs.field(default=10.0, validator=attrs.validators.gt(0))

    @property
    def keepalive_tick(self) -> float:
        """How often a pool looks at its h2 connections' idle time, quiet time and PING: a quarter of
        the shortest of ``h2_idle_timeout``, ``h2_ping_interval`` and ``h2_ping_timeout``."""
        return min(t for t in (self.h2_idle_timeout, self.h2_ping_interval, self.h2_ping_timeout) if t) / 4


@attrs.frozen
class PoolStatistics:
    """One pool: its open connections (draining ones included), the streams
    on them, and how many requests it sent again on another connection (refused, or cut before any
    response byte: see docs/multiplexer.md, GOAWAY and safe retry)."""

    address: Address
    protocol: str
    connections: int
    active_streams: int
    retries: int = 0
    h2: tuple[H2ConnectionStatistics, ...] = ()
    """Each h2 connection's streams and inbound window (see :class:`~blocks.H2ConnectionStatistics`)."""
