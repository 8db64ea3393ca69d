"""What a route store holds and how it changes: the keys, the record codecs, the events.

A proxy author rarely types these: a route file, ``python -m
blocks.routectl`` or the topology kit's :func:`~blocks.topology.route_records`
writes the records. A tool that writes a store itself (an autoscaler, a
deploy script) or a :class:`~blocks.sources.RouteSource` of its own reads
and writes them with the codecs here.

- keys: ``domains/<domain>`` (:func:`route_key_for_domain`),
  ``apps/<app>/replicas/<name>`` (:func:`route_key_for_replica`),
  ``apps/<app>/settings`` (:func:`route_key_for_settings`), and
  :func:`parse_key` / :func:`parse_settings_key` to read one back;
- values: :func:`encode_domain` / :func:`decode_domain`,
  :func:`encode_replica` / :func:`decode_replica` (a replica's ``state``
  is one of :data:`REPLICA_STATES`), :func:`encode_settings` /
  :func:`decode_settings`; addresses as ``host:port``
  (:func:`format_address`, :func:`parse_address`);
- demand: what waits for an app at a proxy (:class:`Demand`), which a
  proxy publishes under :data:`DEMAND_PREFIX` (:func:`demand_key`,
  :func:`encode_demand`, :func:`decode_demand`, :func:`parse_demand_key`)
  and an autoscaler reads;
- events: :class:`RouteEvent` (a put or a delete at a revision), and the
  watch heartbeat :class:`Progress`.

Every codec is sans-IO and strict: a record that does not decode raises
``ValueError`` with what is wrong.
"""

from blocks.routing import (
    DEMAND_PREFIX,
    REPLICA_STATES,
    Demand,
    RouteEvent,
    decode_demand,
    decode_domain,
    decode_replica,
    decode_settings,
    demand_key,
    encode_demand,
    encode_domain,
    encode_replica,
    encode_settings,
    format_address,
    parse_address,
    parse_demand_key,
    parse_key,
    parse_settings_key,
    route_key_for_domain,
    route_key_for_replica,
    route_key_for_settings,
)
from blocks.sources import Progress

__all__ = [
    "DEMAND_PREFIX",
    "REPLICA_STATES",
    "Demand",
    "Progress",
    "RouteEvent",
    "decode_demand",
    "decode_domain",
    "decode_replica",
    "decode_settings",
    "demand_key",
    "encode_demand",
    "encode_domain",
    "encode_replica",
    "encode_settings",
    "format_address",
    "parse_address",
    "parse_demand_key",
    "parse_key",
    "parse_settings_key",
    "route_key_for_domain",
    "route_key_for_replica",
    "route_key_for_settings",
]
