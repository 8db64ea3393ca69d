"""Routing state and policies: authority -> app -> replicas -> one replica.

The routes live in memory and are read per request at dict speed, from a
static :class:`RouteTable` or a :class:`RouteCache` that a route source keeps
in step with its store (both satisfy :class:`Routes`). A :class:`Policy`
picks one replica among an app's candidates, from the request and the
in-flight counts the proxy keeps. An optional :class:`OutlierDetector` sits
between the two and takes replicas that keep failing out of the candidates
for a while.

All of it is sans-IO: no trio anywhere in this package, no clock of its own
(``now`` is an argument), no network. The modules:

- ``_table``: :class:`Replica`, :class:`Routes`, :class:`RouteTable`;
- ``_layout``: the store's keys and JSON values, and their helpers;
- ``_demand``: the demand records proxies publish (:class:`Demand`: what
  waits for an app there), which an autoscaler reads;
- ``_settings``: the per-app settings record (:class:`AppSettings`,
  :class:`MirrorSetting`);
- ``_cache``: :class:`RouteCache` and :class:`RouteEvent`;
- ``_policies`` and ``_rendezvous``: the built-in policies and the hashing
  behind :class:`AffinityHash`;
- ``_outliers``: :class:`OutlierDetector` (ejection, the panic rule, slow start);
- ``_budget``: :class:`RetryBudget`.
"""

from blocks.routing._budget import RetryBudget, RetryBudgetConfig, RetryBudgetStatistics
from blocks.routing._cache import RouteCache, RouteCacheStatistics, RouteEvent
from blocks.routing._demand import DEMAND_PREFIX, Demand, decode_demand, demand_key, encode_demand, parse_demand_key
from blocks.routing._layout import (
    decode_domain,
    decode_replica,
    encode_domain,
    encode_replica,
    format_address,
    parse_address,
    parse_key,
    route_key_for_domain,
    route_key_for_replica,
)
from blocks.routing._outliers import CONNECTION_EVENT, Member, OutlierConfig, OutlierDetector, OutlierStatistics
from blocks.routing._policies import AffinityHash, LeastInFlight, Policy, PowerOfTwo, RoundRobin
from blocks.routing._settings import (
    AppSettings,
    MirrorSetting,
    SessionSetting,
    decode_sessions,
    decode_settings,
    encode_settings,
    parse_settings_key,
    route_key_for_settings,
)
from blocks.routing._table import STATES as REPLICA_STATES
from blocks.routing._table import Replica, Routes, RouteTable, host_of
from blocks.transport import Address

__all__ = [
    # routes
    "Address",
    "Replica",
    "Routes",
    "RouteTable",
    # the route cache and the store's layout
    "RouteCache",
    "RouteCacheStatistics",
    "RouteEvent",
    "REPLICA_STATES",
    "decode_domain",
    "decode_replica",
    "encode_domain",
    "encode_replica",
    "format_address",
    "host_of",
    "parse_address",
    "parse_key",
    "parse_settings_key",
    "route_key_for_domain",
    "route_key_for_replica",
    # what waits at the proxies (demand records)
    "DEMAND_PREFIX",
    "Demand",
    "decode_demand",
    "demand_key",
    "encode_demand",
    "parse_demand_key",
    # per-app settings
    "AppSettings",
    "MirrorSetting",
    "SessionSetting",
    "decode_sessions",
    "decode_settings",
    "encode_settings",
    "route_key_for_settings",
    # policies
    "AffinityHash",
    "LeastInFlight",
    "Policy",
    "PowerOfTwo",
    "RoundRobin",
    # outlier ejection
    "OutlierConfig",
    "OutlierDetector",
    "OutlierStatistics",
    "Member",
    "CONNECTION_EVENT",
    # the retry budget
    "RetryBudget",
    "RetryBudgetConfig",
    "RetryBudgetStatistics",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
