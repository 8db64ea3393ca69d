"""Configuration and statistics of the upstream pools."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from blocks.transport import Address
from blocks.transport._h2 import H2ConnectionStatistics

log = logging.getLogger("blocks.multiplexer")

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


@attrs.frozen
class PoolStatistics:
    """One pool: its open connections (draining ones included), the streams
    on them, and how many refused requests it retried on another connection."""

    address: Address
    protocol: str
    connections: int
    active_streams: int
    retries: int = 0
    h2: tuple[H2ConnectionStatistics, ...] = ()
    """Each h2 connection's streams and inbound window (see :class:`~blocks.H2ConnectionStatistics`)."""
