"""Demo apps and test helpers: what recipes, tests and benchmarks put behind a chain.

Not for production: a self-signed certificate, the demo replica app
(:class:`DemoApp`, :func:`serve_demo_replica`, :func:`websocket_echo`), the
chat rooms app (:class:`ChatApp`), the shop app in two builds
(:func:`shop_app`), a tenant load generator (:class:`TenantLoad`,
:func:`flood`, :func:`steady`), an etcd member on loopback
(:func:`serve_etcd`), child processes (:func:`run_child_process`,
:func:`start_process`), and a chain of processes with several of each hop
under a steady load (:class:`ProcessFleet`, :class:`PacedLoad`: what the
failover test and benchmark run). A proxy author's API is ``blocks``.
"""

from blocks.testing._chat import HISTORY, MAX_MESSAGE, MAX_ROOMS, OUTBOX, PAGE, ChatApp, Room
from blocks.testing._demo import DemoApp, serve_demo_replica, websocket_echo
from blocks.testing._etcd import serve_etcd
from blocks.testing._fleet import Outcome, PacedLoad, ProcessFleet, free_ports, start_process
from blocks.testing._load import SLEEP_20MS, TenantLoad, flood, steady, tenant_request
from blocks.testing._process import run_child_process
from blocks.testing._shop import SHOP_PATHS, send_shop_traffic, shop_app
from blocks.testing._tls import make_self_signed

__all__ = [
    # the demo replica
    "DemoApp",
    "serve_demo_replica",
    "websocket_echo",
    # the chat rooms app
    "HISTORY",
    "MAX_MESSAGE",
    "MAX_ROOMS",
    "OUTBOX",
    "PAGE",
    "ChatApp",
    "Room",
    # a tenant load generator
    "SLEEP_20MS",
    "TenantLoad",
    "flood",
    "steady",
    "tenant_request",
    # the shop app, two builds for a mirror to compare
    "SHOP_PATHS",
    "send_shop_traffic",
    "shop_app",
    # processes: an etcd member, a child that says when it is ready
    "Outcome",
    "PacedLoad",
    "ProcessFleet",
    "free_ports",
    "start_process",
    "run_child_process",
    "serve_etcd",
    # TLS
    "make_self_signed",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
