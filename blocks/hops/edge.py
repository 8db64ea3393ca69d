"""The edge: faces the clients, validates once, sends everything to the proxy."""

from __future__ import annotations

import ssl
from collections.abc import Sequence

import attrs
import trio

from blocks.fields import INTERNAL_PREFIX
from blocks.hops._hop import Exchange, Feature, Forward, Hop, hop_listener
from blocks.http import Headers, Request, strip_hop_by_hop
from blocks.transport import Address
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams
from blocks.transport.streams import KEY_FIELDS

_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"forwarded"})


def forwarded_headers(request: Request, via: bytes, *, trust_forwarded: bool = False) -> Headers:
    """A client's request fields as the next hop should see them: the edge's header hygiene.

    Drops hop-by-hop fields and those ``connection`` names
    (:func:`~blocks.http.strip_hop_by_hop`, keeping ``te: trailers``) and
    every ``x-proxyblocks-*`` field (a client never picks a replica).
    Unless ``trust_forwarded``, the client's ``x-forwarded-for``,
    ``x-forwarded-proto`` and ``forwarded`` are replaced by the edge's own;
    with it, the peer's address is appended to the ``x-forwarded-for``
    chain. Appends ``via: <client's HTTP version> <via>``. A WebSocket
    (``request.protocol`` set) loses ``sec-websocket-key`` and
    ``-accept``: each h1 leg makes its own.
    """
    drop_forwarded = not trust_forwarded
    headers: Headers = [  # the fields themselves (a never-indexed one stays so)
        field
        for field in strip_hop_by_hop(request.headers, te_trailers=True)
        if not (field[0].startswith(INTERNAL_PREFIX) or (drop_forwarded and field[0] in _FORWARDED))
    ]
    client = request.client.encode()
    if drop_forwarded:
        headers.append((b"x-forwarded-for", client))
        headers.append((b"x-forwarded-proto", request.scheme))
    else:
        # Behind a trusted hop: append ourselves to the chain it started.
        for i, (name, value) in enumerate(headers):
            if name == b"x-forwarded-for":
                headers[i] = (name, value + b", " + client)
                break
        else:
            headers.append((b"x-forwarded-for", client))
    headers.append((b"via", request.http_version.encode() + b" " + via))
    if request.protocol is not None:
        headers = [field for field in headers if field[0] not in KEY_FIELDS]
    return headers


@attrs.frozen(kw_only=True)
class EdgeConfig:
    """``proxy``: where the proxy listens. ``trust_forwarded``: keep the
    client's own ``x-forwarded-*`` fields (only behind another trusted hop)."""

    proxy: Address
    name: str = "edge"
    trust_forwarded: bool = False


class ToProxy(Feature):
    """route: everything goes to the proxy, with :func:`forwarded_headers`."""

    def __init__(self, config: EdgeConfig) -> None:
        self.config = config
        self._via = config.name.encode()

    def route(self, exchange: Exchange) -> Forward:
        config = self.config
        return Forward(
            config.proxy, forwarded_headers(exchange.request, self._via, trust_forwarded=config.trust_forwarded)
        )


class Edge(Hop):
    """Faces the clients; everything goes to the proxy.

    Its stack: the caller's ``features``, then :class:`ToProxy`. A WebSocket
    (``request.protocol``, from an h1 Upgrade or an h2 extended CONNECT)
    goes on as an extended CONNECT, its ``:protocol`` carried by the
    request; its ``sec-websocket-version``, ``-protocol`` and
    ``-extensions`` cross, and the fields that bind a handshake to one h1
    connection (``sec-websocket-key``, ``-accept``) never do.
    """

    total = True

    def __init__(self, config: EdgeConfig, upstreams: Upstreams, *, features: Sequence[Feature] = ()) -> None:
        super().__init__(config.name, upstreams, [*features, ToProxy(config)])
        self.config = config

    def upstream_headers(self, request: Request) -> Headers:
        """The request's fields as the proxy will see them (:func:`forwarded_headers`)."""
        return forwarded_headers(request, self.config.name.encode(), trust_forwarded=self.config.trust_forwarded)


async def serve_edge(
    config: EdgeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    listener: ListenerConfig | None = None,
    upstream: UpstreamConfig | None = None,
    features: Sequence[Feature] = (),
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an :class:`Edge` on a validating listener until cancelled or drained."""
    async with open_upstreams(upstream) as upstreams:
        edge = Edge(config, upstreams, features=features)
        await serve_http(
            edge.handle,
            host=host,
            port=port,
            ssl_context=ssl_context,
            config=hop_listener(listener, edge),
            relay=edge.relay,
            upstreams=upstreams,
            task_status=task_status,
        )
