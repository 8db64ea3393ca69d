"""The driver's configuration and statistics: :class:`ReplicaTemplate`, :class:`DriverConfig`, the snapshots."""

from __future__ import annotations

import shlex
import string
from collections.abc import Iterable

import attrs

from blocks._common import finite

_FIELDS = frozenset({"port", "host", "name", "app"})


def _check_command(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        argv = shlex.split(value)
    except ValueError as exc:
        raise ValueError(f"command {value!r}: {exc}") from None
    if not argv:
        raise ValueError("command: empty")
    unknown = fields - _FIELDS
    if unknown:
        raise ValueError(
            f"command {value!r}: unknown field {{{sorted(unknown)[0]}}} (fields: {{port}}, {{host}}, {{name}}, {{app}})"
        )
    if "port" not in fields:
        raise ValueError(f"command {value!r}: no {{port}}: each replica needs a port of its own")


def _strings(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(f"domains: a list of domains, not the string {value!r}")
    return tuple(value)


@attrs.frozen(kw_only=True)
class ReplicaTemplate:
    """How to start one app's replicas, and where the routes send its requests.

    - ``command``: a command line, split like a shell's (no shell runs it),
      with ``{port}`` (a free port, picked per replica), and optionally
      ``{host}``, ``{name}`` (the replica's name, ``APP-N``) and ``{app}``:
      ``"python -m blocks.testing.replica --port {port} --name {name}"``.
    - ``protocol``: what the worker speaks to it, ``"h1"`` or ``"h2"`` (h2c
      with prior knowledge).
    - ``health_path``: the request that says it is up (any status under 500).
    - ``domains``: the authorities routed to the app (``"*"``: every other).
    - ``host``: where the replica listens, as the worker reaches it.
    - ``capacity``: requests one replica takes at once, for the routes (0: unknown).
    """

    command: str = attrs.field(validator=_check_command)
    protocol: str = attrs.field(default="h1", validator=attrs.validators.in_(("h1", "h2")))
    health_path: str = attrs.field(default="/")
    domains: tuple[str, ...] = attrs.field(default=(), converter=_strings)
    host: str = "127.0.0.1"
    capacity: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    @health_path.validator
    def _check_path(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not value.startswith("/"):
            raise ValueError(f"health_path {value!r} must start with '/'")

    def argv(self, *, app: str, name: str, port: int) -> list[str]:
        """The command line of replica ``name`` on ``port``."""
        fields = {"port": port, "host": self.host, "name": name, "app": app}
        return [part.format(**fields) for part in shlex.split(self.command)]


@attrs.frozen(kw_only=True)
class DriverConfig:
    """How the driver watches and handles replicas. Seconds.

    - ``interval``: one prober round, and one decision per app, per interval.
    - ``start_timeout``: a replica must answer its health request within this.
    - ``health_interval``: how often a starting replica is asked.
    - ``settle``: a draining replica is stopped only on a poll sent at least
      this long after its draining write reached the store.
    - ``drain_timeout``: the maximum drain time: the most a draining replica
      is given for its requests to finish and its sessions to end. Past it,
      its worker ends what is left (its sessions, reason ``drained``; a
      Close frame, 1001, to each of its WebSockets), then it is stopped.
    - ``stop_timeout``: SIGTERM, then SIGKILL after this.
    - ``cold_start_timeout``: how long a request for an app with no replica
      waits for its first one (see :meth:`Autoscaler.wait_routed`).
    - ``max_waiting``: how many requests per app may wait for a cold start;
      past it, a 503 ``cold_start_full`` at once.
    """

    interval: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    start_timeout: float = attrs.field(default=30.0, validator=[attrs.validators.gt(0), finite])
    health_interval: float = attrs.field(default=0.05, validator=[attrs.validators.gt(0), finite])
    settle: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0), finite])
    drain_timeout: float = attrs.field(default=30.0, validator=[attrs.validators.ge(0), finite])
    stop_timeout: float = attrs.field(default=5.0, validator=[attrs.validators.ge(0), finite])
    cold_start_timeout: float = attrs.field(default=30.0, validator=[attrs.validators.gt(0), finite])
    max_waiting: int = attrs.field(default=1000, validator=attrs.validators.ge(1))


@attrs.frozen
class AppDriverStatistics:
    """One app as the driver runs it.

    ``starting``, ``ready``, ``draining``: its replica processes by phase;
    ``in_flight``: what the prober last saw on the ready ones; ``sessions``:
    the sessions they host, as their worker reports them (what an app with
    ``unit="sessions"`` scales by; 0 when the worker keeps none); ``waiting``:
    requests waiting for a cold start (at the gates in this process, and at
    the proxies that publish their demand); ``queued``: session starts
    waiting in the proxies' session queues, as they publish them (a
    sessioned app counts them as sessions); ``starts``: processes started;
    ``failed_starts``: that exited or never answered before they were ready;
    ``restarts``: ready replicas that died and were replaced; ``backoff``:
    the wait after the last failed start (seconds: 0.1 doubling to 10 per
    failure in a row, 0 once a replica is ready); ``next_start``: the time
    (``trio.current_time()``) before which none of the app's replicas
    starts (``-inf``: now).
    """

    wanted: int
    starting: int
    ready: int
    draining: int
    in_flight: int
    sessions: int
    waiting: int
    queued: int
    starts: int
    failed_starts: int
    restarts: int
    backoff: float
    next_start: float


@attrs.frozen
class DriverStatistics:
    apps: dict[str, AppDriverStatistics]
    processes: dict[str, int]
    """Replica name -> the pid of its process, for every process running now."""
    pending_deletes: int = 0
    """Replica records whose delete failed (the store did not answer): tried again every round."""
