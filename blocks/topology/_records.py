"""The topology kit's vocabulary: replica and hop URLs, route records, and the config tables of a chain."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable, Mapping

import attrs

from blocks.command import Section
from blocks.hops import LocalReplica
from blocks.routing import (
    Address,
    AppSettings,
    encode_domain,
    encode_replica,
    encode_settings,
    parse_address,
    route_key_for_domain,
    route_key_for_replica,
    route_key_for_settings,
)
from blocks.scheduler import SchedulerConfig
from blocks.topology._sections import (
    read_app_settings,
    read_auth,
    read_cold_start,
    read_mirror,
    read_sessions,
)

LOOPBACK = "127.0.0.1"

REPLICA_SCHEMES = {"http": "h1", "h2c": "h2", "https": "https"}
"""The schemes :func:`replica_from_url` takes, and the protocol the worker speaks for each."""


def replica_from_url(url: str, *, max_sessions: int = 0) -> LocalReplica:
    """A server of yours as a replica: ``http://host:port`` (HTTP/1.1), ``h2c://host:port``
    (HTTP/2, prior knowledge) or ``https://host:port`` (TLS, ALPN ``h2`` else ``http/1.1``),
    hosting at most ``max_sessions`` sessions (:attr:`LocalReplica.max_sessions`; 0: no limit of its own).

    An ``https`` replica's certificate must name ``host`` as written (it is
    the SNI too): a name stays a name, never the address it resolves to.
    The worker verifies it against the system's trust store, or
    ``UpstreamConfig(ca_file=...)``. Raises ``ValueError`` saying what is
    wrong: another scheme, a path, or a missing or bad port.
    """
    scheme, sep, rest = url.partition("://")
    protocol = REPLICA_SCHEMES.get(scheme.lower())
    if not sep or protocol is None:
        raise ValueError(f"{url!r}: a replica URL is http://host:port, h2c://host:port or https://host:port")
    if rest.rstrip("/").count("/"):
        raise ValueError(f"{url!r}: a replica URL names a server, not a path")
    try:
        address = parse_address(rest.rstrip("/"))
    except ValueError:
        raise ValueError(f"{url!r}: a replica URL needs a host and a port (1-65535)") from None
    return LocalReplica(address, protocol, max_sessions=max_sessions)


def route_records(
    app: str,
    replicas: Mapping[str, LocalReplica],
    *,
    worker: Address,
    domains: Iterable[str] = (),
    settings: AppSettings | None = None,
) -> dict[str, bytes]:
    """The route store records of one app: ``domains`` -> ``app`` -> ``replicas`` behind ``worker``.

    One ``domains/<domain>`` record per domain (``"*"`` is the catch-all),
    one ``apps/<app>/replicas/<name>`` per replica with its address and
    protocol as the worker reaches it, and ``apps/<app>/settings`` when
    ``settings`` is given. Write them with ``EmbeddedStore.transact`` (one
    revision, so a route cache never sees half an app) or ``EtcdSource.put``.
    """
    records = {route_key_for_domain(domain): encode_domain(app) for domain in domains}
    for name, replica in replicas.items():
        value = encode_replica(worker=worker, address=replica.address, protocol=replica.protocol)
        records[route_key_for_replica(app, name)] = value
    if settings is not None:
        records[route_key_for_settings(app)] = encode_settings(settings)
    return records


def hop_from_url(url: str) -> Address:
    """The address of a hop behind (an edge's proxy, a proxy's worker): ``h2c://host:port`` or ``host:port``.

    Raises ``argparse.ArgumentTypeError`` (so it serves as a flag's ``type``) saying what is wrong.
    """
    try:
        replica = replica_from_url(url if "://" in url else f"h2c://{url}")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("a replica URL", "a hop's URL")) from None
    if replica.protocol != "h2":
        raise argparse.ArgumentTypeError(f"{url!r}: the hops speak cleartext HTTP/2, h2c://host:port")
    return replica.address


@attrs.frozen
class App:
    """An app and where it runs: the ``domains`` routed to it (``"*"``: every other), its ``replicas``
    by name, and its ``settings`` record (what it mirrors, its sessions), if any."""

    domains: tuple[str, ...]
    replicas: Mapping[str, LocalReplica]
    settings: AppSettings | None = None


def read_apps(table: object) -> dict[str, App]:
    """The apps of a config file's ``[apps.NAME]`` tables, each ``domains = [names]`` and ``replicas = [URLs]``,
    and optionally ``mirror = {to = "APP", fraction = 0.1, prefixes = ["/"]}`` and ``sessions =
    {max_per_replica = 4, queue_size = 16, queue_timeout = 5, ttl = 600, on_replica_loss = "restart"}``
    (:func:`read_app_settings`).

    The replicas are named ``NAME-0``, ``NAME-1``... A command's config
    section (:class:`~blocks.command.CommandParser`): anything else is a
    ``ValueError`` or ``TypeError`` saying what is wrong.
    """
    if not isinstance(table, dict):
        raise TypeError("apps is a table of tables, [apps.NAME]")
    apps: dict[str, App] = {}
    for name, app in table.items():
        tables = {"mirror", "sessions"}
        lists = [items for key, items in app.items() if key not in tables] if isinstance(app, dict) else [None]
        if (
            not isinstance(app, dict)
            or not app.keys() <= {"domains", "replicas", *tables}
            or not all(isinstance(items, list) and all(isinstance(item, str) for item in items) for items in lists)
        ):
            raise ValueError(
                f"{name}: an app is domains = [names], replicas = [URLs], and optional mirror and sessions tables"
            )
        try:
            settings = read_app_settings(app.get("mirror"), app.get("sessions")) if app.keys() & tables else None
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{name}: {exc}") from None
        replicas = {f"{name}-{i}": replica_from_url(url) for i, url in enumerate(app.get("replicas", []))}
        apps[name] = App(tuple(app.get("domains", [])), replicas, settings)
    return apps


def read_scheduler(table: object, default: SchedulerConfig) -> SchedulerConfig:
    """A config file's ``[scheduler]`` table: ``budget``, and each tenant's ``max_in_flight``,
    ``max_queued`` and ``queue_timeout`` (``default``'s where it says nothing); a
    ``ValueError`` or ``TypeError`` says what is wrong."""
    if not isinstance(table, dict):
        raise TypeError("scheduler is a table, [scheduler]")
    policy = dict(table)
    budget = policy.pop("budget", default.budget)
    return SchedulerConfig(budget=budget, default_policy=attrs.evolve(default.default_policy, **policy))


def proxy_sections(scheduler: SchedulerConfig) -> dict[str, Section]:
    """The tables of a proxy's config file, for ``CommandParser(sections=...)``: ``apps``
    (:func:`read_apps`), ``scheduler`` (:func:`read_scheduler` over ``scheduler``), ``auth``
    (:func:`read_auth`), ``sessions`` (:func:`read_sessions`), ``mirror`` (:func:`read_mirror`) and
    ``cold_start`` (:func:`read_cold_start`).
    :func:`hop_options` turns what they read into :func:`~blocks.serve_proxy`'s keywords."""
    return {
        "apps": read_apps,
        "scheduler": functools.partial(read_scheduler, default=scheduler),
        "auth": read_auth,
        "sessions": read_sessions,
        "mirror": read_mirror,
        "cold_start": read_cold_start,
    }


def replica_url(url: str) -> str:
    """A flag's ``type``: ``url`` if :func:`replica_from_url` takes it, else an
    ``argparse.ArgumentTypeError`` saying why."""
    try:
        replica_from_url(url)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return url
