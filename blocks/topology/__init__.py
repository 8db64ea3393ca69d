"""The topology kit: route records and a chain in one process, started part by part.

Recipes, tests and benchmarks build their chains with these, so that the
shape ``replicas -> worker -> proxy -> edge`` is written once:

- :func:`route_records`: the route store records that send ``domains`` to
  an app whose replicas sit behind one worker (nobody hand-writes keys);
- :func:`open_chain` / :func:`serve_chain`: a :class:`Chain` owning one
  nursery, started part by part (:meth:`Chain.start_replica`,
  :meth:`Chain.start_worker`, :meth:`Chain.start_proxy`,
  :meth:`Chain.start_edge`), the proxy routing from a :class:`RouteCache`
  that follows the chain's :class:`EmbeddedStore`; :meth:`Chain.shutdown`
  drains front to back, :meth:`Chain.reload` reloads what it loaded from
  files.

:mod:`blocks.command` runs a chain as a command: flags, a config file, signals;
the readers of a proxy's config tables are here (:func:`proxy_sections`:
``[apps.NAME]``, ``[scheduler]``, ``[auth]``, ``[sessions]``, ``[mirror]``,
``[cold_start]``),
and :func:`hop_options` turns what they read into each hop's keywords.

Each part is started on its own, so a process that runs one role (only a
worker, only a proxy) uses the same steps as a chain in one process;
:class:`ChainPlan` is what one process of the chain recipe runs (its
role, several proxies and workers, the fleet's etcd), checked up front.
"""

from blocks.topology._chain import BuildChain, Chain, ServeReplica, behind_workers, open_chain, serve_chain
from blocks.topology._plan import ROLES, ROUTED_COLD_START, ChainPlan
from blocks.topology._records import (
    LOOPBACK,
    REPLICA_SCHEMES,
    App,
    hop_from_url,
    proxy_sections,
    read_apps,
    read_scheduler,
    replica_from_url,
    replica_url,
    route_records,
)
from blocks.topology._sections import (
    AuthSettings,
    ColdStartSettings,
    SessionSettings,
    hop_options,
    read_app_settings,
    read_auth,
    read_cold_start,
    read_mirror,
    read_sessions,
    read_token_keys,
)

__all__ = [
    "ROLES",
    "ROUTED_COLD_START",
    "ChainPlan",
    "behind_workers",
    "LOOPBACK",
    "REPLICA_SCHEMES",
    "App",
    "AuthSettings",
    "BuildChain",
    "Chain",
    "ColdStartSettings",
    "ServeReplica",
    "SessionSettings",
    "hop_from_url",
    "hop_options",
    "open_chain",
    "proxy_sections",
    "read_app_settings",
    "read_apps",
    "read_auth",
    "read_cold_start",
    "read_mirror",
    "read_scheduler",
    "read_sessions",
    "read_token_keys",
    "replica_from_url",
    "replica_url",
    "route_records",
    "serve_chain",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
