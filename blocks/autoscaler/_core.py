"""The autoscaling policy: how many replicas each app should have, and which to drain. Sans-IO.

No trio, no clock of its own, no processes: every time is an argument
(``now``, seconds on one monotonic clock), and the trio driver that starts
and stops real replica processes is :mod:`blocks.autoscaler`'s
:func:`~blocks.autoscaler.open_autoscaler`.

Theory of operation
-------------------
Per app, an :class:`AutoscalePolicy` keeps three things:

- **the fleet as the driver reports it**: each replica is ``starting``
  (its process runs, it has not answered a health request yet), ``ready``
  (in the routes, serving) or ``draining`` (out of the routes, finishing
  what it has), with its latest in-flight and session counts
  (:meth:`~AutoscalePolicy.starting`, :meth:`~AutoscalePolicy.ready`,
  :meth:`~AutoscalePolicy.draining`, :meth:`~AutoscalePolicy.gone`,
  :meth:`~AutoscalePolicy.load`);
- **the load signal**: the app's in flight (requests, or sessions for a
  sessioned app), fed with :meth:`~AutoscalePolicy.record` into the
  prober's time-weighted :class:`~blocks.prober.AutoscaleSignal` (the
  windows are that signal's; this module adds no averaging of its own);
- **the demand**: how many replicas the load needs, which moves only by
  these rules, evaluated by :meth:`~AutoscalePolicy.decide`:

  1. *up*: the total in flight averaged over ``up_window``, divided by
     ``target_concurrency`` and rounded up, is above the demand: the demand
     becomes that, but at most the scale-up rate allows: with ``w`` the
     wanted count as it stood ``up_window`` ago, no more than
     ``max(ceil(w * scale_up_factor), w + scale_up_step)`` (Kubernetes HPA's
     scale-up policies: double, or four more, per period). A backlog queued
     inside the replicas after a cold start counts as in flight; the rate
     lets the fleet grow by steps, each looking at the load again, instead
     of jumping to what one averaged burst asks for;
  2. *down*: the samples cover ``down_window``, the last increase of the
     wanted count is at least ``down_window`` old, and the total averaged
     over ``down_window`` is below ``target * (1 - hysteresis)`` per
     demanded replica: the demand becomes that total over the target,
     rounded up, but at least 1;
  3. *cold start*: a request for an app with no replica
     (:meth:`~AutoscalePolicy.request`), or anything the proxies say waits
     for the app (:meth:`~AutoscalePolicy.waiting`), makes the demand at
     least 1 at once;
  4. *idle*: nothing in flight, no request (:meth:`~AutoscalePolicy.touch`)
     and nothing waiting for ``idle_timeout``, and the last increase at least ``down_window``
     old: the demand is 0 and the buffer is dropped (scale to zero, or to
     ``min_replicas``). Only this rule takes the demand to 0.

The wanted count is ``demand + buffer_replicas`` (no buffer while idle),
kept within ``[min_replicas, max_replicas]``. A decision says how many
replicas to start (wanted minus starting and ready) or which ones to
drain: starting ones first (newest first: they serve nothing yet), then
ready ones with no session before any that hosts one, fewest sessions,
then fewest in flight.

Invariants (hypothesis tests check them): a decision's count is never
below ``min_replicas`` nor above ``max_replicas``; the wanted count never
goes down within ``down_window`` of going up (no flapping); it never grows
past the scale-up rate of the count ``up_window`` before (but to reach
``min_replicas``); a replica that hosts a session is never drained while
one that hosts none stays.

Cost: the fleet's counts by phase are kept as the driver reports changes,
so a decision that drains nothing costs no scan of the app's replicas (a
simulator calls it for every app, every tick); the drain order is sorted
only when something is drained.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from blocks._common import finite
from blocks.prober._core_signal import AutoscaleConfig, AutoscaleSignal

Phase = Literal["starting", "ready", "draining"]
"""Where a replica is in its life: started, serving (in the routes), or on its way out."""

ColdStart = Literal["start", "wait", "ready"]
"""What :meth:`AutoscalePolicy.request` says about a request for an app: start a replica now, wait
for the one starting, or route it (a replica is ready)."""

_EPSILON = 1e-9  # a total of exactly k * target is k replicas, binary fractions or not


def _at_least_min(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if value < max(instance.min_replicas, 1):
        raise ValueError(
            f"max_replicas ({value!r}) must be at least 1 and at least min_replicas ({instance.min_replicas!r})"
        )


def _up_to_down(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if value < instance.up_window:
        raise ValueError(f"down_window ({value!r}) must not be shorter than up_window ({instance.up_window!r})")


@attrs.frozen(kw_only=True)
class ScalingConfig:
    """How one app scales. Seconds.

    - ``target_concurrency``: what one replica should carry: requests in
      flight, or sessions for a sessioned app (``unit``).
    - ``min_replicas`` / ``max_replicas``: the bounds, whatever the load
      (``min_replicas=0`` lets the app scale to zero).
    - ``buffer_replicas``: replicas kept beyond what the load needs while
      the app is in use, for bursts to land on warm replicas.
    - ``up_window``: scale up when the load averaged over this window needs
      more replicas than the app has.
    - ``down_window``: scale down when the load averaged over this (longer)
      window needs fewer, by more than ``hysteresis``; and never within this
      long of a scale-up.
    - ``hysteresis``: the dead band under the target (0.2: scale down only
      when replicas carry under 80% of it).
    - ``idle_timeout``: with nothing in flight for this long, the app goes to
      ``min_replicas``, its buffer too (scale to zero).
    - ``unit``: ``"requests"`` or ``"sessions"``: what ``target_concurrency``
      and the figures given to :meth:`AutoscalePolicy.record` count.
    - ``scale_up_factor`` / ``scale_up_step``: the scale-up rate. Within any
      ``up_window``, the wanted count grows from ``w`` to at most
      ``max(ceil(w * scale_up_factor), w + scale_up_step)`` (defaults: double,
      or four more, whichever is larger; ``scale_up_factor=inf`` lifts it).
    """

    target_concurrency: float = attrs.field(validator=[attrs.validators.gt(0.0), finite])
    min_replicas: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    max_replicas: int = attrs.field(default=10, validator=_at_least_min)
    buffer_replicas: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    up_window: float = attrs.field(default=30.0, validator=[attrs.validators.gt(0), finite])
    down_window: float = attrs.field(default=300.0, validator=[attrs.validators.gt(0), finite, _up_to_down])
    hysteresis: float = attrs.field(default=0.2, validator=[attrs.validators.ge(0), attrs.validators.lt(1)])
    idle_timeout: float = attrs.field(default=300.0, validator=[attrs.validators.gt(0), finite])
    unit: Literal["requests", "sessions"] = attrs.field(
        default="requests", validator=attrs.validators.in_(("requests", "sessions"))
    )
    scale_up_factor: float = attrs.field(default=2.0, validator=attrs.validators.ge(1.0))
    scale_up_step: int = attrs.field(default=4, validator=attrs.validators.ge(1))

    def scale_up_cap(self, base: int) -> float:
        """The most replicas an app may want within ``up_window`` of wanting ``base``."""
        if self.scale_up_factor == math.inf:
            return math.inf
        return max(math.ceil(base * self.scale_up_factor), base + self.scale_up_step)

    def signal_config(self) -> AutoscaleConfig:
        """The prober's :class:`~blocks.prober.AutoscaleConfig` with the same target and windows."""
        return AutoscaleConfig(
            target_concurrency=self.target_concurrency,
            up_window=self.up_window,
            down_window=self.down_window,
            hysteresis=self.hysteresis,
        )


@attrs.frozen
class Decision:
    """What an app should have now, and what to do about it.

    - ``replicas``: how many replicas (starting or ready) the app should have;
    - ``start``: how many to start now (0 or more);
    - ``drain``: which replicas to take out of the routes and stop now, by
      name (starting ones are simply stopped);
    - ``reason``: why the wanted count is what it is: ``"up"``, ``"down"``,
      ``"idle"``, ``"cold start"``, ``"replace"`` (a replica went away and
      the count holds), or ``"hold"``.
    """

    app: str
    replicas: int
    start: int
    drain: tuple[str, ...]
    reason: str


@attrs.frozen
class ReplicaStatistics:
    phase: Phase
    since: float
    """When it entered this phase."""
    in_flight: int
    sessions: int


@attrs.frozen
class AppScalingStatistics:
    """One app at one moment: the wanted count, the demand behind it, and the fleet by phase."""

    wanted: int
    demand: int
    starting: int
    ready: int
    draining: int
    in_flight: int
    """The ready replicas' latest in-flight figures, summed."""
    sessions: int
    idle_for: float
    """Seconds since something was last in flight or requested (``inf``: never)."""
    last_up: float
    last_down: float
    replicas: dict[str, ReplicaStatistics]
    waiting: int = 0
    """Requests and session starts waiting for the app at its proxies, as last told
    (:meth:`AutoscalePolicy.waiting`)."""


@attrs.frozen
class AutoscalerStatistics:
    apps: dict[str, AppScalingStatistics]


@attrs.define(eq=False)
class _Replica:
    phase: Phase
    since: float
    in_flight: int = 0
    sessions: int = 0


@attrs.define(eq=False)
class _App:
    config: ScalingConfig
    replicas: dict[str, _Replica] = attrs.field(factory=dict)
    counts: dict[Phase, int] = attrs.field(factory=lambda: {"starting": 0, "ready": 0, "draining": 0})
    demand: int = 0
    wanted: int = 0
    last_up: float = -math.inf
    last_down: float = -math.inf
    last_busy: float = -math.inf
    cold: bool = False  # a cold start raised the demand since the last decision
    waiting: int = 0  # requests and session starts waiting at the proxies, as last told
    # the increases of the wanted count within the last up_window: (when, the count before it)
    ups: collections.deque[tuple[float, int]] = attrs.field(factory=collections.deque)

    def count(self, phase: Phase) -> int:
        return self.counts[phase]

    def active(self) -> int:
        """Starting and ready: what counts against the wanted count."""
        return self.counts["starting"] + self.counts["ready"]


class AutoscalePolicy:
    """Per app: how many replicas, which to drain, and what a request for an app with none does.

    ``apps`` maps each app this policy scales to its :class:`ScalingConfig`.
    With ``default``, an app it has not seen (an app a trace names as it
    goes) is taken on at its first mention, with that config (:meth:`add`
    takes one on with a config of its own); without, an app it does not
    scale is a ``KeyError``.
    Feed it the fleet (:meth:`starting`, :meth:`ready`, :meth:`draining`,
    :meth:`gone`, :meth:`load`) and the load (:meth:`record`); ask it
    :meth:`decide` (as often as you like: a decision describes the gap
    between what is and what should be, so asking again before acting on
    it gives the same one) and :meth:`request` (a request found no ready
    replica). ``signal`` is the :class:`~blocks.prober.AutoscaleSignal`
    behind it. Every call is synchronous; ``now`` never goes back.

    Example::

        policy = AutoscalePolicy({"llm": ScalingConfig(target_concurrency=4, up_window=1, down_window=10)})
        policy.request("llm", now=0.0)             # 'start': the first request of an idle app
        decision = policy.decide("llm", now=0.0)   # Decision(app='llm', replicas=1, start=1, drain=(), ...)
        policy.starting("llm", "llm-0", now=0.0)   # the driver started it
        policy.ready("llm", "llm-0", now=0.5)      # it answered its health request: in the routes
        policy.record("llm", in_flight=9, now=1.0) # the prober's figure for the app
    """

    def __init__(
        self, apps: Mapping[str, ScalingConfig] | None = None, *, default: ScalingConfig | None = None
    ) -> None:
        apps = apps or {}
        if not apps and default is None:
            raise ValueError("an autoscaler needs at least one app, or a default config")
        self.default = default
        self._apps = {app: _App(config) for app, config in apps.items()}
        first = default if default is not None else next(iter(apps.values()))
        self.signal = AutoscaleSignal(
            first.signal_config(), apps={app: config.signal_config() for app, config in apps.items()}
        )

    def __repr__(self) -> str:
        apps = ", ".join(f"{app}={state.wanted}" for app, state in self._apps.items())
        return f"<AutoscalePolicy {apps}>"

    @property
    def apps(self) -> list[str]:
        return list(self._apps)

    def config(self, app: str) -> ScalingConfig:
        return self._app(app).config

    def add(self, app: str, config: ScalingConfig | None = None) -> None:
        """Scale ``app`` from now on, with ``config`` (or the default). ``ValueError`` if it is known already."""
        if app in self._apps:
            raise ValueError(f"app {app!r} is scaled already")
        config = config or self.default
        if config is None:
            raise ValueError(f"app {app!r}: no config given, and the policy has no default")
        self._apps[app] = _App(config)
        self.signal.overrides[app] = config.signal_config()

    def _app(self, app: str) -> _App:
        state = self._apps.get(app)
        if state is None:
            if self.default is None:
                raise KeyError(app)
            self.add(app)
            state = self._apps[app]
        return state

    # -- the fleet, as the driver reports it ---------------------------------------------------

    def starting(self, app: str, name: str, now: float) -> None:
        """Replica ``name`` of ``app`` was started (its process runs; not in the routes yet)."""
        state = self._app(app)
        if name in state.replicas:
            raise ValueError(f"replica {name!r} of {app!r} is already known")
        state.replicas[name] = _Replica("starting", now)
        state.counts["starting"] += 1

    def ready(self, app: str, name: str, now: float) -> None:
        """Replica ``name`` answered its health request and is in the routes."""
        self._move(app, name, "ready", now, frm="starting")

    def draining(self, app: str, name: str, now: float) -> None:
        """Replica ``name`` is out of the routes, finishing what it has (a starting one may be drained too)."""
        self._move(app, name, "draining", now, frm=None)

    def gone(self, app: str, name: str, now: float) -> None:
        """Replica ``name`` is no more: stopped, or it died. Unknown names are ignored."""
        state = self._app(app)
        replica = state.replicas.pop(name, None)
        if replica is not None:
            state.counts[replica.phase] -= 1

    def load(self, app: str, name: str, in_flight: int, sessions: int = 0) -> None:
        """Replica ``name``'s latest figures (what the drain choice reads). Unknown names are ignored."""
        if in_flight < 0 or sessions < 0:
            raise ValueError(f"in_flight ({in_flight!r}) and sessions ({sessions!r}) must not be negative")
        replica = self._app(app).replicas.get(name)
        if replica is not None:
            replica.in_flight = in_flight
            replica.sessions = sessions

    def _move(self, app: str, name: str, phase: Phase, now: float, *, frm: Phase | None) -> None:
        state = self._app(app)
        replica = state.replicas.get(name)
        if replica is None:
            raise ValueError(f"replica {name!r} of {app!r} is not known")
        if frm is not None and replica.phase != frm:
            raise ValueError(f"replica {name!r} of {app!r} is {replica.phase}, not {frm}")
        state.counts[replica.phase] -= 1
        state.counts[phase] += 1
        replica.phase = phase
        replica.since = now

    # -- the load ------------------------------------------------------------------------------

    def record(self, app: str, in_flight: float, now: float) -> None:
        """At ``now``, ``app``'s ready replicas carry ``in_flight`` (requests, or sessions: its ``unit``)."""
        state = self._app(app)
        self.signal.record(app, in_flight, state.count("ready"), now)
        if in_flight > 0:
            state.last_busy = now

    def touch(self, app: str, now: float) -> None:
        """A request for ``app`` arrived: it is not idle (one assignment, for the request path).

        Sampled in-flight figures miss short requests; whoever routes them
        (the :class:`~blocks.autoscaler.ColdStartGate`) touches the app so that an
        app serving them is never taken for idle. Unknown apps are ignored
        (even with a default config: the request path does not add apps).
        """
        state = self._apps.get(app)
        if state is not None and now > state.last_busy:
            state.last_busy = now

    def request(self, app: str, now: float) -> ColdStart:
        """A request for ``app`` found no ready replica in the routes (or wants to know if it would).

        ``"ready"``: a replica is ready (the routes will show it); ``"wait"``:
        one is starting, wait for it; ``"start"``: none is starting either,
        so start one now (the next :meth:`decide` says so). Either way the
        app counts as busy from ``now`` and its demand is at least 1. Raises
        ``KeyError`` for an app this policy does not scale (and has no default for).
        """
        state = self._app(app)
        state.last_busy = max(state.last_busy, now)
        if state.demand < 1:
            state.demand = 1
            state.cold = True
        if state.count("ready"):
            return "ready"
        if state.count("starting"):
            return "wait"
        return "start"

    def waiting(self, app: str, waiting: int, now: float) -> None:
        """``waiting`` requests and session starts wait for ``app`` at its proxies now: their latest word, summed.

        What waits is demand however the proxies hold it: requests held for
        the app's first replica (in another process, where :meth:`request`
        is not called), session starts in a session queue. While the figure
        is above 0 the app is busy at every decision (never idle) and its
        demand is at least 1, so an app at zero starts a replica at the next
        :meth:`decide` (``"cold start"``); 0 (what it says until told
        otherwise) changes no decision. A sessioned app's waiting starts are
        load as well: the driver records them with the sessions hosted
        (:meth:`record`). ``ValueError`` for a negative figure.
        """
        if waiting < 0:
            raise ValueError(f"waiting ({waiting!r}) must not be negative")
        state = self._app(app)
        state.waiting = waiting
        if waiting:
            state.last_busy = max(state.last_busy, now)
            if state.demand < 1:
                state.demand = 1
                state.cold = True

    # -- the decision --------------------------------------------------------------------------

    def decide(self, app: str, now: float) -> Decision:
        """How many replicas ``app`` should have at ``now``, what to start and what to drain."""
        state = self._app(app)
        config = state.config
        target = config.target_concurrency
        ups = state.ups
        while ups and ups[0][0] <= now - config.up_window:
            ups.popleft()
        cap = config.scale_up_cap(ups[0][1] if ups else state.wanted)
        if state.waiting:  # (told once a round; busy at every decision in between)
            state.last_busy = max(state.last_busy, now)
        reason = "cold start" if state.cold else "hold"
        state.cold = False
        settled = now - state.last_up >= config.down_window - _EPSILON  # no decrease within the window
        if app in self.signal.apps:
            signal = self.signal.recommend(app, now)
            up = min(math.ceil(signal.avg_in_flight / target - _EPSILON), cap)
            if up > state.demand:
                state.demand, reason = int(up), "up"
            elif (
                settled
                and signal.history >= config.down_window - _EPSILON
                and signal.long_avg_in_flight < target * (1 - config.hysteresis) * state.demand
            ):
                # (at least 1: going to zero is the idle rule's, which also sees the requests touched)
                down = max(1, math.ceil(signal.long_avg_in_flight / target - _EPSILON))
                if down < state.demand:
                    state.demand, reason = down, "down"
        idle = settled and now - state.last_busy >= config.idle_timeout
        if idle and state.demand > 0:
            state.demand, reason = 0, "idle"
        buffer = 0 if idle else config.buffer_replicas
        wanted = int(max(config.min_replicas, min(config.max_replicas, cap, state.demand + buffer)))
        if wanted > state.wanted:
            ups.append((now, state.wanted))
            state.last_up = now
            if reason == "hold":
                reason = "up"
        elif wanted < state.wanted:
            state.last_down = now
            if reason == "hold":
                reason = "idle" if idle else "down"
        state.wanted = wanted
        active = state.active()
        start = max(0, wanted - active)
        if start and reason == "hold":
            reason = "replace"
        drain = tuple(self._drain_order(state)[: active - wanted]) if active > wanted else ()
        return Decision(app, wanted, start, drain, reason)

    def _drain_order(self, state: _App) -> list[str]:
        """Starting replicas, newest first; then ready ones: no session first, fewest sessions, fewest in flight."""
        starting = sorted(
            (name for name, r in state.replicas.items() if r.phase == "starting"),
            key=lambda name: (-state.replicas[name].since, name),
        )
        ready = sorted(
            (name for name, r in state.replicas.items() if r.phase == "ready"),
            key=lambda name: (
                state.replicas[name].sessions > 0,
                state.replicas[name].sessions,
                state.replicas[name].in_flight,
                -state.replicas[name].since,
                name,
            ),
        )
        return starting + ready

    def statistics(self, now: float) -> AutoscalerStatistics:
        apps = {}
        for app, state in self._apps.items():
            ready = [r for r in state.replicas.values() if r.phase == "ready"]
            apps[app] = AppScalingStatistics(
                wanted=state.wanted,
                demand=state.demand,
                starting=state.count("starting"),
                ready=len(ready),
                draining=state.count("draining"),
                in_flight=sum(r.in_flight for r in ready),
                sessions=sum(r.sessions for r in ready),
                idle_for=now - state.last_busy,
                last_up=state.last_up,
                last_down=state.last_down,
                replicas={
                    name: ReplicaStatistics(r.phase, r.since, r.in_flight, r.sessions)
                    for name, r in sorted(state.replicas.items())
                },
                waiting=state.waiting,
            )
        return AutoscalerStatistics(apps)
