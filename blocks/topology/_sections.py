"""A proxy's tables in a config file: ``[auth]``, ``[sessions]``, ``[mirror]``, ``[cold_start]``, an app's ``mirror``.

Each reader is a :class:`~blocks.command.CommandParser` section: it takes the
TOML value (and, for key files, the config file's directory as ``base``)
and returns a frozen record, or raises ``ValueError`` / ``TypeError`` whose
message starts with the key that is wrong (``keys: k1: secret_file: ...``);
the parser prefixes the file and the table. Keys are read here, once, so a
secret that cannot be used stops the command before anything listens.

The tables are read one by one, in any order, so what joins them (the key
that signs session tokens may be one of ``[[auth.keys]]``) is checked by
:func:`hop_options`, which turns the records into
:func:`~blocks.serve_proxy`'s keywords. The re-exports are in
:mod:`blocks.topology`.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import attrs
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_pem_public_key

from blocks.hops import ColdStartConfig, ProxyConfig
from blocks.mirror import MirrorConfig
from blocks.routing import AppSettings, MirrorSetting, decode_sessions
from blocks.sessions import SessionConfig, WorkerSessionConfig
from blocks.tokens import Keyring, ProxyAuth, TokenIssuer, TokenKey, TokenVerifier, TokenVerifierConfig

# What a key of a table takes, and how an error says it.
_TEXT = (str,), "a string"
_WHOLE = (int,), "a whole number"
_NUMBER = (int, float), "a number"
_SWITCH = (bool,), "true or false"
_NAMES = (list,), "a list of strings"
_TABLES = (list,), "an array of tables"
_TABLE = (dict,), "a table"
_WHEN = (int, float, datetime.datetime), "a time (seconds since the epoch, or a TOML date-time with its offset)"
Kind = tuple[tuple[type, ...], str]

_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")


def _table(value: object, kinds: Mapping[str, Kind], name: str) -> dict[str, Any]:
    """``value`` as a table whose keys ``kinds`` names, each of its kind; else what is wrong, naming the key."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} is a table, [{name}]")
    for key, item in value.items():
        if key not in kinds:
            raise ValueError(f"{key}: not a setting of [{name}] (the settings: {', '.join(kinds)})")
        types, said = kinds[key]
        if not isinstance(item, types) or (isinstance(item, bool) and bool not in types):
            raise TypeError(f"{key}: {item!r} is not {said}")
        if kinds[key] is _NAMES and not all(isinstance(one, str) and one for one in value[key]):
            raise TypeError(f"{key}: {item!r} is not {said}")
        if key in ("header", "cookie") and isinstance(item, str) and not _HEADER.fullmatch(item.lower()):
            raise ValueError(f"{key}: {item!r} is not a header or cookie name")
    return dict(value)


def _built(make: Callable[..., Any], **fields: Any) -> Any:
    """``make(**fields)``, its validators' ``ValueError`` (which name the field) passed on as they are."""
    try:
        return make(**fields)
    except TypeError as exc:  # an attrs validator's wrong type
        raise ValueError(str(exc)) from None


# -- keys ---------------------------------------------------------------------------------------

_KEY = {
    "kid": _TEXT,
    "secret": _TEXT,
    "secret_file": _TEXT,
    "private_key_file": _TEXT,
    "public_key_file": _TEXT,
    "not_after": _WHEN,
}
_MATERIAL = ("secret", "secret_file", "private_key_file", "public_key_file")


def read_token_keys(entries: object, *, base: Path = Path(), name: str = "keys") -> tuple[TokenKey, ...]:
    """The token keys of an array of tables (``[[auth.keys]]``), each ``kid`` and one of:

    - ``secret = "HEX"``: an HMAC-SHA256 secret, at least 32 bytes in hex
      (``openssl rand -hex 32``); it mints and verifies;
    - ``secret_file = "PATH"``: the same hex in a file (relative to ``base``,
      the config file's directory), so the secret need not sit in the config;
    - ``private_key_file = "PATH"``: an Ed25519 private key (PEM, unencrypted);
      it mints and verifies;
    - ``public_key_file = "PATH"``: an Ed25519 public key (PEM): it verifies
      only (tokens minted elsewhere);

    and optionally ``not_after``, when the key stops being accepted. A key it
    cannot use (bad hex, a short secret, a missing file, two with one kid) is
    a ``ValueError`` naming the key's ``kid``.
    """
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise TypeError(f"{name} is an array of tables, [[...{name}]], each kid = NAME and its secret")
    keys: dict[str, TokenKey] = {}
    for i, entry in enumerate(entries):
        where = f"{name}: {entry.get('kid', i)}"
        try:
            fields = _table(entry, _KEY, name)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{where}: {exc}") from None
        if "kid" not in fields:
            raise ValueError(f"{where}: a key needs its kid")
        given = [material for material in _MATERIAL if material in fields]
        if len(given) != 1:
            raise ValueError(f"{where}: a key has one of {', '.join(_MATERIAL)}")
        if fields["kid"] in keys:
            raise ValueError(f"{where}: a second key with this kid")
        expires = fields.get("not_after")
        if isinstance(expires, datetime.datetime):
            if expires.tzinfo is None:
                raise ValueError(f"{where}: not_after: {expires} needs its offset (Z, or +01:00...)")
            expires = expires.timestamp()
        try:
            keys[fields["kid"]] = _key(fields["kid"], given[0], fields[given[0]], expires, base)
        except (OSError, ValueError, UnsupportedAlgorithm) as exc:
            reason = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.strerror else exc
            raise ValueError(f"{where}: {given[0]}: {reason}") from None
    if not keys:
        raise ValueError(f"{name}: no key; [[...{name}]] tables give them")
    return tuple(keys.values())


def _key(kid: str, material: str, value: str, expires: float | None, base: Path) -> TokenKey:
    """The key ``material`` (a ``_MATERIAL`` name) says."""
    expires = None if expires is None else float(expires)
    text = (base / value).read_bytes() if material.endswith("_file") else value.encode()
    if material.startswith("secret"):
        try:
            secret = bytes.fromhex(text.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise ValueError("not hex digits (openssl rand -hex 32 writes a secret)") from None
        if len(secret) < 32:
            raise ValueError(f"{len(secret)} bytes; a secret is at least 32 (openssl rand -hex 32)")
        return TokenKey.hmac(kid, secret, not_after=expires)
    if material == "private_key_file":
        private = load_pem_private_key(text, password=None)
        if not isinstance(private, Ed25519PrivateKey):
            raise ValueError("not an Ed25519 private key")
        return TokenKey.ed25519(kid, private_key=private, not_after=expires)
    public = load_pem_public_key(text)
    if not isinstance(public, Ed25519PublicKey):
        raise ValueError("not an Ed25519 public key")  # noqa: TRY004 (what the file holds, not a type)
    return TokenKey.ed25519(kid, public_key=public, not_after=expires)


# -- [auth] -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AuthSettings:
    """A config file's ``[auth]``: the proxy-auth token ``keys`` and the ``apps`` that require a token
    (:class:`~blocks.tokens.ProxyAuth`'s other knobs beside them). :func:`hop_options` makes the
    :class:`~blocks.tokens.ProxyAuth`."""

    keys: tuple[TokenKey, ...]
    apps: frozenset[str]
    header: str = "authorization"
    cookie: str | None = None
    forward_token: bool = False
    verifier: TokenVerifierConfig = attrs.field(factory=TokenVerifierConfig)


_AUTH = {
    "apps": _NAMES,
    "header": _TEXT,
    "cookie": _TEXT,
    "forward_token": _SWITCH,
    "clock_skew": _NUMBER,
    "keys": _TABLES,
}


def read_auth(table: object, *, base: Path = Path()) -> AuthSettings:
    """A config file's ``[auth]`` table: ``apps = [names]`` (those that require a proxy-auth token),
    ``header`` (``authorization``, as ``Bearer TOKEN``), ``cookie``, ``forward_token``, ``clock_skew``
    (seconds), and its ``[[auth.keys]]`` (:func:`read_token_keys`)."""
    fields = _table(table, _AUTH, "auth")
    if "keys" not in fields:
        raise ValueError("keys: [auth] needs its keys, [[auth.keys]] tables")
    keys = read_token_keys(fields.pop("keys"), base=base)
    skew = fields.pop("clock_skew", TokenVerifierConfig().clock_skew)
    verifier = _built(TokenVerifierConfig, clock_skew=float(skew))
    auth: AuthSettings = _built(
        AuthSettings, keys=keys, apps=frozenset(fields.pop("apps", ())), verifier=verifier, **fields
    )
    return auth


# -- [sessions] ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SessionSettings:
    """A config file's ``[sessions]``: the proxy's :class:`~blocks.SessionConfig`, the workers'
    :class:`~blocks.WorkerSessionConfig`, the ``kid`` that signs session tokens (None: the only key
    there is) and the table's own ``keys`` (``[[sessions.keys]]``)."""

    config: SessionConfig
    worker: WorkerSessionConfig = attrs.field(factory=WorkerSessionConfig)
    kid: str | None = None
    keys: tuple[TokenKey, ...] = ()


_SESSIONS = {
    "apps": _NAMES,
    "ttl": _NUMBER,
    "max_per_replica": _WHOLE,
    "queue_size": _WHOLE,
    "queue_timeout": _NUMBER,
    "retry_after": _NUMBER,
    "header": _TEXT,
    "cookie": ((str, bool), "a cookie's name, or false"),
    "set_cookie": _SWITCH,
    "require_auth": _SWITCH,
    "on_replica_loss": _TEXT,
    "idle_timeout": _NUMBER,
    "max_sessions": _WHOLE,
    "kid": _TEXT,
    "keys": _TABLES,
}


def read_sessions(table: object, *, base: Path = Path()) -> SessionSettings:
    """A config file's ``[sessions]`` table: :class:`~blocks.SessionConfig`'s fields (``apps``,
    ``ttl``, ``max_per_replica``, ``queue_size``, ``queue_timeout``, ``retry_after``, ``header``,
    ``cookie`` (false: none), ``set_cookie``, ``require_auth``, ``on_replica_loss``), the worker's ``idle_timeout`` and
    ``max_sessions``, ``kid`` (the key that signs session tokens) and ``[[sessions.keys]]``."""
    fields = _table(table, _SESSIONS, "sessions")
    fields.setdefault("apps", [])  # (an app may be sessioned by its own [apps.NAME] sessions, or the route store)
    if fields.get("cookie") is True:
        raise TypeError("cookie: true is not a cookie's name, or false")
    if fields.get("cookie") is False:
        fields["cookie"] = None
    keys = read_token_keys(fields.pop("keys"), base=base) if "keys" in fields else ()
    worker = {name: fields.pop(name) for name in ("idle_timeout", "max_sessions") if name in fields}
    kid = fields.pop("kid", None)
    floats = {name: float(value) for name, value in fields.items() if _SESSIONS[name] is _NUMBER}
    config = _built(SessionConfig, **(fields | floats))
    return SessionSettings(config=config, worker=_built(WorkerSessionConfig, **worker), kid=kid, keys=keys)


# -- [mirror] and an app's mirror ----------------------------------------------------------------

_MIRROR = {
    "buffer": _WHOLE,
    "total_buffer": _WHOLE,
    "max_in_flight": _WHOLE,
    "stall_timeout": _NUMBER,
    "header": _TEXT,
    "host_suffix": _TEXT,
    "sample_bytes": _WHOLE,
    "report_limit": _WHOLE,
    "report_interval": _NUMBER,
    "max_connections": _WHOLE,
    "seed": _WHOLE,
}


def read_mirror(table: object) -> MirrorConfig:
    """A config file's ``[mirror]`` table: :class:`~blocks.MirrorConfig`'s knobs (``buffer``,
    ``total_buffer``, ``max_in_flight``, ``stall_timeout``, ``header``, ``host_suffix``,
    ``sample_bytes``, ``report_limit``, ``report_interval``, ``max_connections``, ``seed``)."""
    fields = _table(table, _MIRROR, "mirror")
    floats = {name: float(value) for name, value in fields.items() if _MIRROR[name] is _NUMBER}
    config: MirrorConfig = _built(MirrorConfig, **(fields | floats))
    return config


_APP_MIRROR = {
    "to": _TEXT,
    "address": _TEXT,
    "fraction": _NUMBER,
    "prefixes": ((list, dict), "a list of paths, or a table of path -> fraction"),
    "tenants": ((dict,), "a table of tenant -> fraction"),
    "key": _TEXT,
    "compare": _NAMES,
}


def read_app_settings(value: object, sessions: object = None) -> AppSettings:
    """An app's ``mirror = {to = "APP", fraction = 0.1, prefixes = ["/"]}`` (or ``address =
    "host:port"`` instead of ``to``; ``tenants``, ``key``, ``compare``: :class:`~blocks.routing.MirrorSetting`)
    and ``sessions = {max_per_replica = 4, ...}`` (:class:`~blocks.routing.SessionSetting`; the app is
    sessioned), either None when absent, as its :class:`~blocks.routing.AppSettings`, the record the
    route store holds for the app."""
    mirror = None
    if value is not None:
        fields = _table(value, _APP_MIRROR, "mirror")
        try:
            mirror = MirrorSetting(**fields)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"mirror: {exc}") from None
    return AppSettings(mirror=mirror, sessions=None if sessions is None else decode_sessions(sessions))


# -- [cold_start] --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ColdStartSettings:
    """A config file's ``[cold_start]``: the proxy's :class:`~blocks.ColdStartConfig`, or None
    (``enabled = false``: a request for an app with no live replica is a 503 at once)."""

    config: ColdStartConfig | None


_COLD_START = {
    "enabled": _SWITCH,
    "timeout": _NUMBER,
    "max_waiting": _WHOLE,
    "retry_after": _NUMBER,
    "apps": _NAMES,
}


def read_cold_start(table: object) -> ColdStartSettings:
    """A config file's ``[cold_start]`` table: :class:`~blocks.ColdStartConfig`'s knobs (``timeout``,
    ``max_waiting``, ``retry_after``, ``apps``: the apps whose requests wait, every app by default),
    and ``enabled`` (true by default; false turns the wait off)."""
    fields = _table(table, _COLD_START, "cold_start")
    if not fields.pop("enabled", True):
        return ColdStartSettings(config=None)
    floats = {name: float(value) for name, value in fields.items() if _COLD_START[name] is _NUMBER}
    return ColdStartSettings(config=_built(ColdStartConfig, **(fields | floats)))


# -- joining the tables -------------------------------------------------------------------------


def hop_options(
    settings: Mapping[str, Any], *, error: Callable[[str], NoReturn] | None = None
) -> dict[str, dict[str, Any]]:
    """Each hop's keywords from what a command's config file said: ``{"proxy": ..., "worker": ...,
    "replica": ...}``.

    ``settings`` holds the namespace of a parser whose sections include
    :func:`proxy_sections`' (``auth``, ``sessions``, ``mirror``, ``apps``;
    ``config``: the file, for errors). The worker's (for
    :func:`~blocks.serve_worker`) has ``sessions`` (a
    :class:`~blocks.WorkerSessionConfig`) with ``[sessions]``; ``replica``
    holds the :class:`~blocks.LocalReplica` fields of the servers a worker
    runs beside (``--replica``): ``max_sessions``, the ``[sessions]
    max_per_replica``, so that the worker, which has the last word, holds
    each replica to it whatever the proxies' estimates. The
    proxy's (for :func:`~blocks.serve_proxy`) has ``auth`` (a
    :class:`~blocks.tokens.ProxyAuth`), ``sessions`` with
    ``session_issuer`` (the ``[sessions] kid`` key, from
    ``[[sessions.keys]]`` or ``[[auth.keys]]``; without ``kid``, the only
    key there is) and ``session_verifier`` (every key of both tables: a
    session start's proxy-auth token is checked by it too), and ``mirror``
    (with ``[mirror]``, or once an app mirrors), and ``config``, a
    :class:`~blocks.ProxyConfig` whose ``cold_start`` ``[cold_start]`` says
    (with that table). Tables that disagree (a
    ``kid`` no table has, one kid in both) are ``error("FILE: sessions:
    kid: ...")``, or a ``ValueError`` without ``error``.
    """
    auth: AuthSettings | None = settings.get("auth")
    sessions: SessionSettings | None = settings.get("sessions")
    mirror: MirrorConfig | None = settings.get("mirror")
    apps = settings.get("apps") or {}
    app_settings = [app.settings for app in apps.values() if getattr(app, "settings", None) is not None]
    if sessions is None and any(own.sessions is not None for own in app_settings):
        sessions = SessionSettings(config=SessionConfig(apps=()))  # an app's sessions = {...}: [sessions]' defaults
    options: dict[str, Any] = {}
    worker = {} if sessions is None else {"sessions": sessions.worker}
    replica = {"max_sessions": sessions.config.max_per_replica} if sessions is not None else {}
    if auth is not None:
        verifier = TokenVerifier(Keyring(auth.keys), auth.verifier)
        options["auth"] = ProxyAuth(
            verifier, apps=auth.apps, header=auth.header, cookie=auth.cookie, forward_token=auth.forward_token
        )
    if sessions is not None:
        try:
            options |= _sessions(sessions, auth.keys if auth is not None else ())
        except ValueError as exc:
            message = f"{settings.get('config') or 'config'}: sessions: {exc}"
            if error is None:
                raise ValueError(message) from None
            error(message)
    if mirror is not None or any(own.mirror is not None for own in app_settings):
        options["mirror"] = mirror or MirrorConfig()
    cold_start: ColdStartSettings | None = settings.get("cold_start")
    if cold_start is not None:
        options["config"] = ProxyConfig(cold_start=cold_start.config)
    return {"proxy": options, "worker": worker, "replica": replica}


def _sessions(sessions: SessionSettings, shared: tuple[TokenKey, ...]) -> dict[str, Any]:
    keys = {key.kid: key for key in shared}
    for key in sessions.keys:
        if key.kid in keys:
            raise ValueError(f"keys: {key.kid}: [[auth.keys]] has this kid too; give one of them another")
        keys[key.kid] = key
    kid = sessions.kid
    if kid is None:
        own = sessions.keys or shared
        if len(own) != 1:
            raise ValueError("kid: which key signs session tokens? kid = NAME, from [[sessions.keys]] or [[auth.keys]]")
        kid = own[0].kid
    if kid not in keys:
        raise ValueError(f"kid: {kid!r} is not a key of [[sessions.keys]] or [[auth.keys]]")
    if not keys[kid].can_mint:
        raise ValueError(f"kid: {kid!r} cannot sign session tokens (a public key verifies only)")
    verifier = TokenVerifier(Keyring(key.verifying() for key in keys.values()))
    return {"sessions": sessions.config, "session_issuer": TokenIssuer(keys[kid]), "session_verifier": verifier}


__all__ = [
    "AuthSettings",
    "ColdStartSettings",
    "SessionSettings",
    "hop_options",
    "read_app_settings",
    "read_auth",
    "read_cold_start",
    "read_mirror",
    "read_sessions",
    "read_token_keys",
]
