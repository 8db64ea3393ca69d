"""The route store's layout: keys, and the JSON values under them.

Every route source (the embedded store, etcd) holds the same keys, with
JSON values, and a :class:`~blocks.routing.RouteCache` reads exactly this::

    domains/<domain>               {"app": "<app>"}
    apps/<app>/replicas/<name>     {"worker": "host:port", "address": "host:port",
                                    "protocol": "h2" | "h1" | "https", "capacity": <int, 0 = unknown>,
                                    "state": "live" | "draining" | "down"}
    apps/<app>/settings            {"mirror": {...}, ...}: one field per feature (see ``_settings``)

``<domain>`` is lowercase: a host, a host with port, or ``*``. Neither an app
nor a replica name may contain ``/``. In a replica, ``worker`` and
``address`` are required; the other fields default to ``"h2"``, ``0`` and
``"live"``, and fields this version does not know are ignored, so that a
newer writer can add some. An IPv6 host is written in brackets,
``[::1]:8080``.

Write keys and values with these helpers, never by hand. Decoding raises
:class:`ValueError` whose message is one of a few fixed reasons (``not
JSON``, ``bad worker``, ...), which is what the cache counts.
"""

from __future__ import annotations

import json
from typing import Any

from blocks.routing._table import PROTOCOLS, STATES, Replica
from blocks.transport import Address

DOMAINS_PREFIX = "domains/"
APPS_PREFIX = "apps/"
_REPLICAS = "/replicas/"


def _name(kind: str, value: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"{kind} must be non-empty and without '/', not {value!r}")
    return value


def route_key_for_domain(domain: str) -> str:
    """The key of ``domain``'s route: ``domains/<domain, lowercased>``."""
    return DOMAINS_PREFIX + _name("a domain", domain.lower())


def route_key_for_replica(app: str, name: str) -> str:
    """The key of replica ``name`` of ``app``: ``apps/<app>/replicas/<name>``."""
    return f"{APPS_PREFIX}{_name('an app', app)}{_REPLICAS}{_name('a replica name', name)}"


def _dumps(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def encode_domain(app: str) -> bytes:
    """The value of a domain's route: ``{"app": "<app>"}``."""
    return _dumps({"app": _name("an app", app)})


def format_address(address: Address | str) -> str:
    """``(host, port)`` as ``host:port`` (``[host]:port`` for IPv6); a string is checked and kept."""
    if isinstance(address, str):
        parse_address(address)
        return address
    host, port = address
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    parse_address(text)
    return text


def parse_address(text: str) -> Address:
    """``host:port`` or ``[v6]:port`` as ``(host, port)``; ValueError if it is neither."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 literal without brackets: ambiguous
    if not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(f"not host:port: {text!r}")
    return host, int(port)


def encode_replica(
    *,
    worker: Address | str,
    address: Address | str,
    protocol: str = "h2",
    capacity: int = 0,
    state: str = "live",
) -> bytes:
    """The value of a replica's route; ``worker`` and ``address`` as ``(host, port)`` or ``"host:port"``."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, not {state!r}")
    if type(capacity) is not int or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0, not {capacity!r}")
    return _dumps(
        {
            "worker": format_address(worker),
            "address": format_address(address),
            "protocol": protocol,
            "capacity": capacity,
            "state": state,
        }
    )


def json_object(value: bytes) -> dict[str, Any]:
    """A record's value as a JSON object; ValueError("not JSON" or "not a JSON object") otherwise."""
    try:
        decoded = json.loads(value)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError("not JSON") from None
    if not isinstance(decoded, dict):
        raise ValueError("not a JSON object")  # noqa: TRY004  (bad data, not a bad argument: one error type)
    return decoded


def _address_field(fields: dict[str, Any], name: str) -> Address:
    text = fields.get(name)
    if not isinstance(text, str):
        raise ValueError(f"bad {name}")  # noqa: TRY004
    try:
        return parse_address(text)
    except ValueError:
        raise ValueError(f"bad {name}") from None


def decode_domain(value: bytes) -> str:
    """The app a domain's value names; ValueError with a fixed reason if it is not one."""
    app = json_object(value).get("app")
    if not isinstance(app, str) or not app or "/" in app:
        raise ValueError("bad app")
    return app


def decode_replica(name: str, value: bytes) -> Replica:
    """Replica ``name`` from its value; ValueError with a fixed reason if the value is not one."""
    fields = json_object(value)
    worker = _address_field(fields, "worker")
    address = _address_field(fields, "address")
    protocol = fields.get("protocol", "h2")
    if protocol not in PROTOCOLS:
        raise ValueError("bad protocol")
    capacity = fields.get("capacity", 0)
    if type(capacity) is not int or capacity < 0:
        raise ValueError("bad capacity")
    state = fields.get("state", "live")
    if state not in STATES:
        raise ValueError("bad state")
    return Replica(name=name, worker=worker, address=address, protocol=protocol, capacity=capacity, state=state)


def parse_key(key: str) -> tuple[str | None, str]:
    """``(None, domain)`` for a domain's key, ``(app, name)`` for a replica's; ValueError("unknown key") otherwise."""
    if key.startswith(DOMAINS_PREFIX):
        domain = key[len(DOMAINS_PREFIX) :]
        if domain and "/" not in domain and domain == domain.lower():
            return None, domain
    elif key.startswith(APPS_PREFIX):
        app, sep, name = key[len(APPS_PREFIX) :].partition(_REPLICAS)
        if sep and app and name and "/" not in app and "/" not in name:
            return app, name
    raise ValueError("unknown key")
