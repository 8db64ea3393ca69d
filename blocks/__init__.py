"""proxyblocks: composable reverse-proxy building blocks on Trio."""

from blocks.demo import DemoApp, serve_demo_replica
from blocks.errors import (
    BadRequest,
    BlocksError,
    NoRoute,
    PayloadTooLarge,
    StreamReset,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from blocks.fair_queue import (
    FairQueue,
    Grant,
    QueueFull,
    QueueTimeout,
    SchedulerConfig,
    SchedulerStatistics,
    TenantPolicy,
    TenantStatistics,
    Ticket,
)
from blocks.hops import (
    INTERNAL_LISTENER,
    Edge,
    EdgeConfig,
    Forward,
    Hop,
    LocalReplica,
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
    error_response,
    respond,
    text_response,
)
from blocks.listener import HTTPServer, ListenerConfig, serve_http
from blocks.multiplexer import UpstreamConfig, Upstreams, open_upstreams
from blocks.routing import (
    Address,
    LeastInFlight,
    OutlierConfig,
    OutlierDetector,
    OutlierStatistics,
    Policy,
    Replica,
    RouteTable,
)
from blocks.scheduler import Scheduler, TenantKey, header_tenant, open_scheduler
from blocks.timing import Timing, add_server_timing, parse_server_timing
from blocks.tls import make_self_signed, server_context

__all__ = [
    # HTTP types
    "Body",
    "BytesBody",
    "Handler",
    "Headers",
    "IterBody",
    "Request",
    "Response",
    "StreamBody",
    "error_response",
    "respond",
    "text_response",
    # errors
    "BadRequest",
    "BlocksError",
    "NoRoute",
    "PayloadTooLarge",
    "StreamReset",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
    # listener
    "HTTPServer",
    "ListenerConfig",
    "serve_http",
    # stream multiplexer (client side)
    "Address",
    "UpstreamConfig",
    "Upstreams",
    "open_upstreams",
    # routing
    "LeastInFlight",
    "OutlierConfig",
    "OutlierDetector",
    "OutlierStatistics",
    "Policy",
    "Replica",
    "RouteTable",
    # fair scheduler
    "FairQueue",
    "Grant",
    "QueueFull",
    "QueueTimeout",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStatistics",
    "TenantKey",
    "TenantPolicy",
    "TenantStatistics",
    "Ticket",
    "header_tenant",
    "open_scheduler",
    # hops
    "INTERNAL_LISTENER",
    "Edge",
    "EdgeConfig",
    "Forward",
    "Hop",
    "LocalReplica",
    "Proxy",
    "ProxyConfig",
    "Worker",
    "serve_edge",
    "serve_proxy",
    "serve_worker",
    # timing
    "Timing",
    "add_server_timing",
    "parse_server_timing",
    # TLS and demo
    "DemoApp",
    "make_self_signed",
    "serve_demo_replica",
    "server_context",
]
