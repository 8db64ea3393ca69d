"""Per-app settings: one record per app in the route store, one field per feature.

The key ``apps/<app>/settings`` holds a JSON object whose top-level fields
each belong to one feature::

    {"mirror": {"to": "candidate", "fraction": 0.1, "prefixes": ["/api/"], "tenants": {"alice": 1.0},
                "key": "x-user-id", "compare": ["content-type"]}}

Today there are two fields, ``mirror`` (:class:`MirrorSetting`, read by the
mirror tee) and ``sessions`` (:class:`SessionSetting`, read by the proxy's
session broker: the app is sessioned, with these limits). A feature adds its own field by adding an attribute to
:class:`AppSettings` and a decoder here; until it does, fields this version
does not know are kept, decoded, in :attr:`AppSettings.extra`, so that a
newer writer never breaks an older proxy. A field that is present but bad
makes the whole value bad: the cache counts it and holds no settings for
that app (as for any bad value).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from blocks.routing._layout import APPS_PREFIX, format_address, parse_address
from blocks.transport import Address

SETTINGS_SUFFIX = "/settings"


def route_key_for_settings(app: str) -> str:
    """The key of ``app``'s settings record: ``apps/<app>/settings``."""
    if not app or "/" in app:
        raise ValueError(f"an app must be non-empty and without '/', not {app!r}")
    return f"{APPS_PREFIX}{app}{SETTINGS_SUFFIX}"


def parse_settings_key(key: str) -> str | None:
    """The app whose settings ``key`` holds, or None if it is not a settings key."""
    if key.startswith(APPS_PREFIX) and key.endswith(SETTINGS_SUFFIX):
        app = key[len(APPS_PREFIX) : -len(SETTINGS_SUFFIX)]
        if app and "/" not in app:
            return app
    return None


def _fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"a fraction must be a number in [0, 1], not {value!r}")
    return float(value)


def _header(value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    if not data or data != data.strip() or b":" in data[:1]:
        raise ValueError(f"not a header name: {value!r}")
    return data.lower()


def _headers(names: Sequence[str | bytes]) -> tuple[bytes, ...]:
    if isinstance(names, (str, bytes)):
        raise ValueError("compare must be a list of header names")  # noqa: TRY004
    return tuple(_header(name) for name in names)


def _prefixes(value: Mapping[str, float | None] | Sequence[str]) -> tuple[tuple[bytes, float | None], ...]:
    if isinstance(value, (str, bytes)):
        raise ValueError("prefixes must be a list or a table, not a string")  # noqa: TRY004
    items = value.items() if isinstance(value, Mapping) else ((prefix, None) for prefix in value)
    found = []
    for prefix, fraction in items:
        if not isinstance(prefix, str) or not prefix.startswith("/"):
            raise ValueError(f"a prefix must be a path starting with '/', not {prefix!r}")
        found.append((prefix.encode(), None if fraction is None else _fraction(fraction)))
    found.sort(key=lambda item: -len(item[0]))  # the longest match wins
    return tuple(found)


def _tenants(value: Mapping[str, float]) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise ValueError("tenants must be a table of tenant -> fraction")  # noqa: TRY004
    return {_tenant(tenant): _fraction(fraction) for tenant, fraction in value.items()}


def _tenant(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"a tenant must be a non-empty string, not {value!r}")
    return value


def _target(value: str | None) -> str | None:
    if value is not None and (not isinstance(value, str) or not value or "/" in value):
        raise ValueError(f"'to' must be an app name (non-empty, without '/'), not {value!r}")
    return value


def _address(value: Address | str | None) -> Address | None:
    if value is None:
        return None
    return parse_address(value) if isinstance(value, str) else parse_address(format_address(value))


@attrs.frozen(kw_only=True)
class MirrorSetting:
    """What one app mirrors, and where (read by :class:`~blocks.Mirror`).

    - ``to``: the shadow app, routed like any app of the table (its replicas,
      its workers); or ``address``: a ``(host, port)`` (or ``"host:port"``)
      that speaks h2, for a shadow outside the table. Exactly one of them.
    - ``fraction``: the share of the app's requests to copy, 0 to 1.
    - ``prefixes``: if given, only paths under one of them are mirrored; a
      list (each at ``fraction``) or a table prefix -> its own fraction
      (``None``, JSON ``null``: the app's ``fraction``). The
      longest matching prefix wins, and names the route in the comparison.
    - ``tenants``: tenant -> fraction, overriding the path's for that tenant
      (the tenant is the proxy's ``tenant_key``, the ``x-tenant`` header by
      default).
    - ``key``: a header whose value decides instead of a coin: the same
      value gets the same decision on every proxy (and a key sampled at 10 %
      is also sampled at 20 %). A request without it is sampled at random.
    - ``compare``: the response header fields compared between the primary
      and the shadow (besides the status, the body length and its hash).
    """

    to: str | None = attrs.field(default=None, converter=_target)
    address: Address | None = attrs.field(default=None, converter=_address)
    fraction: float = attrs.field(default=1.0, converter=_fraction)
    prefixes: tuple[tuple[bytes, float | None], ...] = attrs.field(default=(), converter=_prefixes)
    tenants: dict[str, float] = attrs.field(factory=dict, converter=_tenants)
    key: bytes | None = attrs.field(default=None, converter=attrs.converters.optional(_header))
    compare: tuple[bytes, ...] = attrs.field(default=(b"content-type",), converter=_headers)

    def __attrs_post_init__(self) -> None:
        if (self.to is None) == (self.address is None):
            raise ValueError("a mirror needs exactly one of 'to' (an app) or 'address'")

    def to_json(self) -> dict[str, Any]:
        """The JSON object :func:`decode_settings` reads back as this setting."""
        fields: dict[str, Any] = {"fraction": self.fraction}
        if self.to is not None:
            fields["to"] = self.to
        if self.address is not None:
            fields["address"] = format_address(self.address)
        if self.prefixes:
            if all(fraction is None for _, fraction in self.prefixes):
                fields["prefixes"] = [prefix.decode() for prefix, _ in self.prefixes]
            else:
                # null: the app's fraction
                fields["prefixes"] = {prefix.decode(): fraction for prefix, fraction in self.prefixes}
        if self.tenants:
            fields["tenants"] = dict(self.tenants)
        if self.key is not None:
            fields["key"] = self.key.decode()
        fields["compare"] = [name.decode() for name in self.compare]
        return fields


ON_REPLICA_LOSS = ("fail", "restart")
"""What a session whose replica is lost gets: ``fail`` (``session_lost``; the client starts a
new session) or ``restart`` (a new session on another replica, the same request sent there)."""


def _optional_count(value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"a count must be a whole number >= 0, not {value!r}")
    return value


def _optional_seconds(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"seconds must be a finite number >= 0, not {value!r}")
    return float(value)


def _optional_ttl(value: object) -> float | None:
    seconds = _optional_seconds(value)
    if seconds == 0:
        raise ValueError("ttl must be > 0")
    return seconds


def _on_replica_loss(value: object) -> str | None:
    if value is not None and value not in ON_REPLICA_LOSS:
        raise ValueError(f"on_replica_loss must be one of {', '.join(ON_REPLICA_LOSS)}, not {value!r}")
    return value


@attrs.frozen(kw_only=True)
class SessionSetting:
    """One app's sticky sessions (read by the proxy's :class:`~blocks.sessions.SessionBroker`).

    Its presence makes the app sessioned, as if it were in the proxy's
    ``SessionConfig.apps``. Each field left ``None`` takes the proxy's
    :class:`~blocks.SessionConfig` value: ``max_per_replica``,
    ``queue_size``, ``queue_timeout``, ``ttl`` (seconds) and
    ``on_replica_loss`` (:data:`ON_REPLICA_LOSS`).
    """

    max_per_replica: int | None = attrs.field(default=None, converter=_optional_count)
    queue_size: int | None = attrs.field(default=None, converter=_optional_count)
    queue_timeout: float | None = attrs.field(default=None, converter=_optional_seconds)
    ttl: float | None = attrs.field(default=None, converter=_optional_ttl)
    on_replica_loss: str | None = attrs.field(default=None, converter=_on_replica_loss)

    def to_json(self) -> dict[str, Any]:
        """The JSON object :func:`decode_settings` reads back as this setting (its fields set)."""
        return {name: value for name, value in attrs.asdict(self).items() if value is not None}


_SESSION_FIELDS: dict[str, Callable[[object], object]] = {
    "max_per_replica": _optional_count,
    "queue_size": _optional_count,
    "queue_timeout": _optional_seconds,
    "ttl": _optional_ttl,
    "on_replica_loss": _on_replica_loss,
}


def decode_sessions(fields: object) -> SessionSetting:
    """A :class:`SessionSetting` from its JSON object (or TOML table); ValueError naming what is wrong."""
    if not isinstance(fields, Mapping):
        raise ValueError("sessions must be a table of max_per_replica, queue_size, queue_timeout, ttl, on_replica_loss")  # noqa: TRY004
    unknown = sorted(set(fields) - set(_SESSION_FIELDS))
    if unknown:
        raise ValueError(f"sessions: unknown field {unknown[0]!r} (known: {', '.join(_SESSION_FIELDS)})")
    for name, value in fields.items():
        try:
            _SESSION_FIELDS[name](value)
        except ValueError as exc:
            raise ValueError(f"sessions: {name}: {exc}") from None
    return SessionSetting(**fields)


@attrs.frozen(kw_only=True)
class AppSettings:
    """One app's settings record (``apps/<app>/settings``).

    ``mirror``: what the app mirrors (:class:`MirrorSetting`), or None.
    ``sessions``: the app's sticky sessions (:class:`SessionSetting`), or None.
    ``extra``: the record's fields this version does not know, as decoded
    JSON: a newer writer's, or a feature's that has no attribute yet.
    """

    mirror: MirrorSetting | None = None
    sessions: SessionSetting | None = None
    extra: Mapping[str, Any] = attrs.field(factory=dict, eq=True, hash=False)


_KNOWN = ("mirror", "sessions")


def encode_settings(settings: AppSettings) -> bytes:
    """The value of an app's settings record."""
    fields: dict[str, Any] = {name: value for name, value in settings.extra.items() if name not in _KNOWN}
    if settings.mirror is not None:
        fields["mirror"] = settings.mirror.to_json()
    if settings.sessions is not None:
        fields["sessions"] = settings.sessions.to_json()
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


def decode_mirror(fields: object) -> MirrorSetting:
    """A :class:`MirrorSetting` from its JSON object; ValueError("bad mirror") if it is not one."""
    if not isinstance(fields, dict):
        raise ValueError("bad mirror")  # noqa: TRY004
    known = ("to", "address", "fraction", "prefixes", "tenants", "key", "compare")
    try:
        kwargs = {name: fields[name] for name in known if name in fields}
        if "fraction" in kwargs and isinstance(kwargs["fraction"], float) and not math.isfinite(kwargs["fraction"]):
            raise ValueError("bad fraction")
        return MirrorSetting(**kwargs)
    except (ValueError, TypeError, AttributeError):
        raise ValueError("bad mirror") from None


def decode_settings(value: bytes) -> AppSettings:
    """An app's settings from the record's value; ValueError with a fixed reason if it is not one."""
    try:
        fields = json.loads(value)
    except (ValueError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(fields, dict):
        raise ValueError("not a JSON object")  # noqa: TRY004
    mirror = decode_mirror(fields["mirror"]) if fields.get("mirror") is not None else None
    sessions = None
    if fields.get("sessions") is not None:
        try:
            sessions = decode_sessions(fields["sessions"])
        except ValueError:
            raise ValueError("bad sessions") from None
    extra = {name: v for name, v in fields.items() if name not in _KNOWN}
    return AppSettings(mirror=mirror, sessions=sessions, extra=extra)
