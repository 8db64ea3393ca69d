"""proxyblocks: composable reverse-proxy building blocks on Trio.

This namespace holds what a proxy author types (about 80 names). Each
block's whole API is in its own package: :mod:`blocks.hops` (the built-in
features), :mod:`blocks.routing`, :mod:`blocks.scheduler`,
:mod:`blocks.prober`, :mod:`blocks.sessions`, :mod:`blocks.mirror`,
:mod:`blocks.tokens`, :mod:`blocks.sources`, :mod:`blocks.singleflight`,
:mod:`blocks.websocket`, :mod:`blocks.timing`; the transport's in
:mod:`blocks.transport.listener`, :mod:`blocks.transport.multiplexer` and
:mod:`blocks.transport.streams` (the h2 driver, splices, taps, the codec
seam). Every error is in :mod:`blocks.errors`, every internal field and
path in :mod:`blocks.fields`, the route store's keys, codecs and events in
:mod:`blocks.store`, the demo apps and test helpers in :mod:`blocks.testing`.
"""

from blocks.command import CommandParser, run_until_signal
from blocks.errors import (
    BadRequest,
    BlocksError,
    HopFailed,
    NoRoute,
    PayloadTooLarge,
    StreamReset,
    Unauthorized,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from blocks.hops import (
    INTERNAL_LISTENER,
    ColdStartConfig,
    Edge,
    EdgeConfig,
    Exchange,
    Feature,
    Forward,
    Hop,
    LocalReplica,
    NoteKey,
    Proxy,
    ProxyConfig,
    Worker,
    serve_edge,
    serve_proxy,
    serve_worker,
)
from blocks.http import (
    Body,
    BytesBody,
    Handler,
    Headers,
    IterBody,
    Request,
    Response,
    StreamBody,
    abandon,
    error_response,
    respond,
    strip_hop_by_hop,
    text_response,
)
from blocks.mirror import (
    MirrorConfig,
)
from blocks.prober import (
    HealthConfig,
    ProberConfig,
)
from blocks.routing import (
    Address,
    LeastInFlight,
    OutlierConfig,
    Policy,
    Replica,
    RetryBudgetConfig,
    RouteCache,
    Routes,
    RouteTable,
)
from blocks.scheduler import (
    SchedulerConfig,
    TenantKey,
    TenantPolicy,
    header_tenant,
    token_tenant,
)
from blocks.sessions import (
    AppSessions,
    SessionConfig,
    WorkerSessionConfig,
)
from blocks.sources import (
    EmbeddedStore,
    EtcdSource,
    RouteSource,
    open_route_cache,
)
from blocks.timing import (
    parse_server_timing,
)
from blocks.tokens import (
    Keyring,
    ProxyAuth,
    TokenIssuer,
    TokenKey,
    TokenVerifier,
)
from blocks.topology import (
    Chain,
    open_chain,
    route_records,
    serve_chain,
)
from blocks.transport.listener import (
    HTTPServer,
    ListenerConfig,
    serve_http,
)
from blocks.transport.multiplexer import (
    UpstreamConfig,
    Upstreams,
    open_upstreams,
)
from blocks.transport.tls import (
    server_context,
)
from blocks.websocket import (
    WebSocketConfig,
    serve_websocket_app,
)

__all__ = [
    # HTTP types
    "Request",
    "Response",
    "Body",
    "BytesBody",
    "IterBody",
    "StreamBody",
    "Headers",
    "Handler",
    "error_response",
    "text_response",
    "respond",
    "abandon",
    "strip_hop_by_hop",
    # errors (every error class, with its status, is in blocks.errors)
    "BlocksError",
    "BadRequest",
    "HopFailed",
    "NoRoute",
    "PayloadTooLarge",
    "StreamReset",
    "Unauthorized",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
    # listener
    "serve_http",
    "HTTPServer",
    "ListenerConfig",
    # stream multiplexer (client side)
    "open_upstreams",
    "Upstreams",
    "UpstreamConfig",
    # routing
    "Address",
    "Replica",
    "Routes",
    "RouteTable",
    "RouteCache",
    "Policy",
    "LeastInFlight",
    "OutlierConfig",
    "RetryBudgetConfig",
    # hops and their features
    "Hop",
    "Feature",
    "Exchange",
    "Forward",
    "NoteKey",
    "Edge",
    "EdgeConfig",
    "Proxy",
    "ProxyConfig",
    "ColdStartConfig",
    "Worker",
    "LocalReplica",
    "serve_edge",
    "serve_proxy",
    "serve_worker",
    "INTERNAL_LISTENER",
    # fair scheduler
    "SchedulerConfig",
    "TenantPolicy",
    "TenantKey",
    "header_tenant",
    "token_tenant",
    # prober
    "ProberConfig",
    "HealthConfig",
    # sticky sessions
    "AppSessions",
    "SessionConfig",
    "WorkerSessionConfig",
    # mirror tee
    "MirrorConfig",
    # tokens
    "ProxyAuth",
    "TokenIssuer",
    "TokenVerifier",
    "Keyring",
    "TokenKey",
    # route sources
    "EmbeddedStore",
    "EtcdSource",
    "RouteSource",
    "open_route_cache",
    # timing
    "parse_server_timing",
    # TLS
    "server_context",
    # WebSockets
    "serve_websocket_app",
    "WebSocketConfig",
    # topology kit
    "Chain",
    "CommandParser",
    "open_chain",
    "serve_chain",
    "route_records",
    "run_until_signal",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
