"""The edge: faces the clients, validates once, sends everything to the proxy."""

from __future__ import annotations

import ssl

import attrs
import trio

from blocks.hops._hop import INTERNAL_PREFIX, Forward, Hop
from blocks.http import HOP_BY_HOP, Headers, Request
from blocks.routing import Address
from blocks.transport._upgrade import KEY_FIELDS
from blocks.transport.listener import HTTPServer, ListenerConfig, serve_http
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams

_FORWARDED = frozenset({b"x-forwarded-for", b"x-forwarded-proto", b"forwarded"})


@attrs.frozen(kw_only=True)
class EdgeConfig:
    """``proxy``: where the proxy listens. ``trust_forwarded``: keep the
    client's own ``x-forwarded-*`` fields (only behind another trusted hop)."""

    proxy: Address
    name: str = "edge"
    trust_forwarded: bool = False


class Edge(Hop):
    """Faces the clients; everything goes to the proxy.

    A WebSocket (``request.protocol``, from an h1 Upgrade or an h2 extended
    CONNECT) goes on as an extended CONNECT, its ``:protocol`` carried by the
    request; its ``sec-websocket-version``, ``-protocol`` and ``-extensions``
    cross, and the fields that bind a handshake to one h1 connection
    (``sec-websocket-key``, ``-accept``) never do.
    """

    total = True

    def __init__(self, config: EdgeConfig, upstreams: Upstreams) -> None:
        super().__init__(config.name, upstreams)
        self.config = config
        self._via = config.name.encode()

    def upstream_headers(self, request: Request) -> Headers:
        """The request's fields as the proxy will see them."""
        drop_forwarded = not self.config.trust_forwarded
        connection_tokens: set[bytes] = set()
        for name, value in request.headers:
            if name == b"connection":
                connection_tokens.update(t.strip().lower() for t in value.split(b","))
        headers: Headers = []
        for name, value in request.headers:
            if (
                name in HOP_BY_HOP
                or name.startswith(INTERNAL_PREFIX)
                or (drop_forwarded and name in _FORWARDED)
                or name in connection_tokens
            ):
                if name == b"te" and value.strip().lower() == b"trailers":
                    headers.append((name, value))  # the one TE value h2 allows
                continue
            headers.append((name, value))
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
        headers.append((b"via", request.http_version.encode() + b" " + self._via))
        if request.protocol is not None:
            headers = [(name, value) for name, value in headers if name not in KEY_FIELDS]  # each h1 leg makes its own
        return headers

    def decide(self, request: Request) -> Forward:
        return Forward(self.config.proxy, self.upstream_headers(request))


async def serve_edge(
    config: EdgeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    ssl_context: ssl.SSLContext | None = None,
    listener: ListenerConfig | None = None,
    upstream: UpstreamConfig | None = None,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run an :class:`Edge` on a validating listener until cancelled or drained."""
    async with open_upstreams(upstream) as upstreams:
        edge = Edge(config, upstreams)
        await serve_http(
            edge.handle,
            host=host,
            port=port,
            ssl_context=ssl_context,
            config=listener,
            relay=edge.relay,
            upstreams=upstreams,
            task_status=task_status,
        )
