"""The route file: routes written by hand, in TOML or JSON, as store keys and back.

A route file is the whole routing state of one embedded store::

    # routes.toml
    [domains]
    "chat.example" = "chat"          # authority (host, or host:port) -> app
    "*" = "demo"                     # everything else

    [apps.chat.replicas.r1]
    worker = "127.0.0.1:9001"        # the worker in front of it (the proxy's upstream)
    address = "127.0.0.1:8001"       # the replica itself, as the worker sees it
    protocol = "h2"                  # optional: "h2" (default), "h1" or "https"
    capacity = 0                     # optional: 0 (default) means unknown
    state = "live"                   # optional: "live" (default)

    [apps.chat.settings.mirror]      # optional: the app's settings record (here: mirror 10 %)
    to = "chat-candidate"
    fraction = 0.1

The same in JSON: ``{"domains": {"chat.example": "chat"}, "apps": {"chat":
{"replicas": {"r1": {"worker": ..., "address": ...}}}}}``. The format is
chosen by the file's suffix: ``.json`` is JSON, anything else TOML.

Each domain becomes the key ``domains/<domain>``, each replica
``apps/<app>/replicas/<name>`` and an app's ``settings`` table
``apps/<app>/settings``, with the values :mod:`blocks.routing`
encodes, so a file and an etcd prefix hold the same keys. Anything the
format does not know (a misspelt field, a port that is not a number) is a
:class:`RouteFileError` naming the file and the place, and nothing is loaded.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from blocks.errors import RouteFileError
from blocks.routing import (
    decode_domain,
    decode_replica,
    decode_settings,
    encode_domain,
    encode_replica,
    format_address,
    parse_address,
    parse_key,
    parse_settings_key,
    route_key_for_domain,
    route_key_for_replica,
    route_key_for_settings,
)

REPLICA_FIELDS = ("worker", "address", "protocol", "capacity", "state")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _name(value: object, *, where: str, what: str) -> str:
    if not isinstance(value, str) or not value or "/" in value:
        raise RouteFileError(f"{where}: {what} must be a non-empty string without '/', got {value!r}")
    return value


def _table(value: object, *, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RouteFileError(f"{where}: expected a table, got {type(value).__name__}")
    return value


def routes_from_document(document: Mapping[str, Any], *, where: str = "routes") -> dict[str, bytes]:
    """The store keys and values of a parsed route file (a dict from TOML or JSON)."""
    document = _table(document, where=where)
    unknown = sorted(set(document) - {"domains", "apps"})
    if unknown:
        raise RouteFileError(f"{where}: unknown section(s) {unknown}; expected 'domains' and 'apps'")
    routes: dict[str, bytes] = {}
    for domain, app in _table(document.get("domains", {}), where=f"{where}: [domains]").items():
        _name(domain, where=f"{where}: [domains]", what="a domain")
        _name(app, where=f"{where}: [domains] {domain!r}", what="an app name")
        key = route_key_for_domain(domain)
        if key in routes:
            raise RouteFileError(f"{where}: [domains] {domain!r} is given twice (domains are not case-sensitive)")
        routes[key] = encode_domain(app)
    for app, table in _table(document.get("apps", {}), where=f"{where}: [apps]").items():
        _name(app, where=f"{where}: [apps]", what="an app name")
        app_where = f"{where}: [apps.{app}]"
        app_table = _table(table, where=app_where)
        unknown = sorted(set(app_table) - {"replicas", "settings"})
        if unknown:
            raise RouteFileError(f"{app_where}: unknown field(s) {unknown}; expected 'replicas' or 'settings'")
        if "settings" in app_table:
            settings_where = f"{where}: [apps.{app}.settings]"
            value = json.dumps(
                _table(app_table["settings"], where=settings_where), separators=(",", ":"), sort_keys=True
            ).encode()
            try:
                decode_settings(value)
            except ValueError as exc:
                raise RouteFileError(f"{settings_where}: {exc}") from exc
            routes[route_key_for_settings(app)] = value
        replicas_where = f"{where}: [apps.{app}.replicas]"
        for name, fields in _table(app_table.get("replicas", {}), where=replicas_where).items():
            _name(name, where=replicas_where, what="a replica name")
            replica_where = f"{where}: [apps.{app}.replicas.{name}]"
            routes[route_key_for_replica(app, name)] = _replica_value(fields, where=replica_where)
    return routes


def _replica_value(fields: object, *, where: str) -> bytes:
    table = _table(fields, where=where)
    unknown = sorted(set(table) - set(REPLICA_FIELDS))
    if unknown:
        raise RouteFileError(f"{where}: unknown field(s) {unknown}; expected some of {list(REPLICA_FIELDS)}")
    for required in ("worker", "address"):
        if required not in table:
            raise RouteFileError(f"{where}: '{required}' is required")
    capacity = table.get("capacity", 0)
    if isinstance(capacity, bool):  # TOML's true is not a capacity, though Python's bool is an int
        raise RouteFileError(f"{where}: capacity must be an integer >= 0, got {capacity!r}")
    worker = _host_port(table["worker"], where=f"{where} worker")
    address = _host_port(table["address"], where=f"{where} address")
    try:
        return encode_replica(
            worker=worker,
            address=address,
            protocol=table.get("protocol", "h2"),
            capacity=capacity,
            state=table.get("state", "live"),
        )
    except ValueError as exc:
        raise RouteFileError(f"{where}: {exc}") from exc


def _host_port(text: object, *, where: str) -> str:
    if not isinstance(text, str):
        raise RouteFileError(f"{where}: expected a 'host:port' string, got {text!r}")
    try:
        parse_address(text)
    except ValueError as exc:
        raise RouteFileError(f"{where}: expected 'host:port' ('[v6]:port' for IPv6), got {text!r}") from exc
    return text


def parse_route_file(data: bytes, *, path: str | os.PathLike[str]) -> dict[str, bytes]:
    """The store keys and values of a route file's contents (``path`` picks the format, names errors)."""
    where = os.fspath(path)
    try:
        text = data.decode("utf-8")
        document = json.loads(text) if where.endswith(".json") else tomllib.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise RouteFileError(f"{where}: {exc}") from exc
    return routes_from_document(document, where=where)


def read_route_file(path: str | os.PathLike[str]) -> dict[str, bytes]:
    """Read and parse a route file; a missing file is :class:`RouteFileError` too."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise RouteFileError(f"{os.fspath(path)}: {exc.strerror or exc}") from exc
    return parse_route_file(data, path=path)


# -- and back: keys to a document, a document to text -----------------------------------------


def document_from_routes(routes: Mapping[str, bytes]) -> dict[str, Any]:
    """The route-file document that :func:`routes_from_document` turns into ``routes``.

    Raises :class:`RouteFileError` for a key the format cannot hold (a
    store may hold keys of other tools under the same prefix).
    """
    domains: dict[str, str] = {}
    apps: dict[str, dict[str, dict[str, Any]]] = {}
    for key, value in sorted(routes.items()):
        owner = parse_settings_key(key)
        if owner is not None:
            try:
                decode_settings(value)
            except ValueError as exc:
                raise RouteFileError(f"{key}: {exc}: {value[:80]!r}") from exc
            apps.setdefault(owner, {"replicas": {}})["settings"] = json.loads(value)
            continue
        try:
            app, name = parse_key(key)
        except ValueError:
            raise RouteFileError(f"{key}: not a key a route file can hold") from None
        try:
            if app is None:
                domains[name] = decode_domain(value)
                continue
            replica = decode_replica(name, value)
        except ValueError as exc:
            raise RouteFileError(f"{key}: {exc}: {value[:80]!r}") from exc
        fields: dict[str, Any] = {"worker": format_address(replica.worker), "address": format_address(replica.address)}
        if replica.protocol != "h2":
            fields["protocol"] = replica.protocol
        if replica.capacity:
            fields["capacity"] = replica.capacity
        if replica.state != "live":
            fields["state"] = replica.state
        apps.setdefault(app, {"replicas": {}})["replicas"][name] = fields
    return {"domains": domains, "apps": apps}


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # A JSON string without ASCII escaping is a TOML basic string: same
    # escapes for quotes, backslashes and control characters.
    return json.dumps(text, ensure_ascii=False)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        raise RouteFileError("null (a prefix at the app's fraction) cannot be written in TOML: use JSON")
    return _toml_string(str(value))


def dump_toml(document: Mapping[str, Any]) -> str:
    """A route-file document as TOML, in the layout of this module's docstring."""
    lines = ["[domains]"]
    lines += [f"{_toml_key(domain)} = {_toml_string(app)}" for domain, app in document.get("domains", {}).items()]
    for app, table in document.get("apps", {}).items():
        for name, fields in table.get("replicas", {}).items():
            lines += ["", f"[apps.{_toml_key(app)}.replicas.{_toml_key(name)}]"]
            lines += [f"{field} = {_toml_value(value)}" for field, value in fields.items()]
        if "settings" in table:
            lines += ["", f"[apps.{_toml_key(app)}.settings]"]
            lines += [f"{_toml_key(field)} = {_toml_value(value)}" for field, value in table["settings"].items()]
    return "\n".join(lines) + "\n"


def write_route_file(path: str | os.PathLike[str], routes: Mapping[str, bytes]) -> None:
    """Write ``routes`` as a route file, atomically (a temporary file, then a rename).

    A reader (``watch_file``) sees the old file or the new one, never half
    of one. Comments in the file are not kept.
    """
    target = Path(path)
    document = document_from_routes(routes)
    if target.suffix == ".json":
        text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    else:
        text = dump_toml(document)
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = 0o644
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


__all__ = [
    "REPLICA_FIELDS",
    "document_from_routes",
    "dump_toml",
    "parse_route_file",
    "read_route_file",
    "routes_from_document",
    "write_route_file",
]
