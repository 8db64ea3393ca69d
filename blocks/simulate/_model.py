"""What a simulation runs: the replicas' model and the configuration of the real cores it drives."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from typing import Literal

import attrs

from blocks._common import finite
from blocks.autoscaler import ScalingConfig
from blocks.routing import LeastInFlight, Policy, PowerOfTwo, RoundRobin
from blocks.scheduler import SchedulerConfig
from blocks.sessions import SessionConfig

POLICIES: Mapping[str, Callable[[random.Random], Policy]] = {
    "least-in-flight": LeastInFlight,
    "power-of-two": PowerOfTwo,
    "round-robin": lambda rng: RoundRobin(),
}
"""The built-in routing policies by the names the command line uses, each a factory from a seeded ``Random``."""

Distribution = Literal["exponential", "lognormal", "constant"]


@attrs.frozen(kw_only=True)
class ServiceTime:
    """How long a replica takes to serve a request of size 1 (a request of size ``s`` takes ``s`` times that).

    ``distribution``: ``exponential`` (mean ``mean``), ``lognormal`` (mean
    ``mean``, log-space standard deviation ``sigma``: a long tail) or
    ``constant``.
    """

    mean: float = attrs.field(default=0.1, validator=[attrs.validators.gt(0), finite])
    distribution: Distribution = attrs.field(
        default="exponential", validator=attrs.validators.in_(("exponential", "lognormal", "constant"))
    )
    sigma: float = attrs.field(default=1.0, validator=[attrs.validators.ge(0), finite])

    def sampler(self, rng: random.Random) -> Callable[[], float]:
        """A function drawing one service time from ``rng``."""
        mean = self.mean
        if self.distribution == "constant":
            return lambda: mean
        if self.distribution == "exponential":
            rate = 1.0 / mean
            expo = rng.expovariate
            return lambda: expo(rate)
        sigma = self.sigma
        mu = math.log(mean) - sigma * sigma / 2.0  # so that the mean is ``mean``
        lognormal = rng.lognormvariate
        return lambda: lognormal(mu, sigma)


@attrs.frozen(kw_only=True)
class ReplicaModel:
    """A simulated replica.

    - ``concurrency``: requests it serves at once; more wait in its own FIFO
      queue (as a real server's backlog), still counted in flight.
    - ``service``: its service time (:class:`ServiceTime`).
    - ``cold_start``: seconds from its start to its first request (it enters
      the routes only then).
    - ``max_sessions``: sessions it hosts at once (0: no limit), as
      ``LocalReplica.max_sessions``.
    """

    concurrency: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    service: ServiceTime = attrs.field(factory=ServiceTime)
    cold_start: float = attrs.field(default=5.0, validator=[attrs.validators.ge(0), finite])
    max_sessions: int = attrs.field(default=0, validator=attrs.validators.ge(0))


@attrs.frozen(kw_only=True)
class SimConfig:
    """One configuration to simulate: the model of the replicas and the real cores' settings.

    - ``name``: its label in reports and plots.
    - ``policy``: makes the routing policy from a seeded ``random.Random``
      (``LeastInFlight``, ``PowerOfTwo``, ``lambda rng: RoundRobin()``, your own).
    - ``replica``: the :class:`ReplicaModel` of every app's replicas.
    - ``scaling``: the autoscaler's :class:`~blocks.autoscaler.ScalingConfig`
      for every app (target concurrency, min / max / buffer replicas,
      windows, hysteresis, idle timeout); a sessioned app's ``unit`` is
      ``"sessions"`` whatever this one says. ``apps``: an app's own, instead.
      An app is known from its first request; it then starts with
      ``min_replicas`` ready replicas.
    - ``interval``: seconds between two autoscaler rounds (the prober's interval).
    - ``cold_start_timeout``: how long a request for an app with no ready
      replica waits for the first one; then it times out (a 503).
    - ``scheduler``: the fair queue in front of every replica (its ``budget``
      is slots for the whole fleet), or None for none.
    - ``sessions``: the sessioned apps and their placement queue (the
      session placer's ``SessionConfig``), or None.
    - ``session_idle``: the worker's idle timeout: a session with nothing in
      flight for this long ends.
    - ``sample``: seconds per point of the timeline (replicas, latency).
    - ``seed``: the seed of the service times and the policy.
    """

    name: str = "sim"
    policy: Callable[[random.Random], Policy] = LeastInFlight
    replica: ReplicaModel = attrs.field(factory=ReplicaModel)
    scaling: ScalingConfig = attrs.field(
        factory=lambda: ScalingConfig(
            target_concurrency=1.0, max_replicas=1000, up_window=10.0, down_window=60.0, idle_timeout=60.0
        )
    )
    apps: Mapping[str, ScalingConfig] = attrs.field(factory=dict, converter=dict)
    interval: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    cold_start_timeout: float = attrs.field(default=30.0, validator=[attrs.validators.ge(0), finite])
    scheduler: SchedulerConfig | None = None
    sessions: SessionConfig | None = None
    session_idle: float = attrs.field(default=30.0, validator=[attrs.validators.gt(0), finite])
    sample: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    seed: int = 0

    def scaling_for(self, app: str) -> ScalingConfig:
        """``app``'s scaling: its own, else ``scaling``; in sessions when it is a sessioned app."""
        config = self.apps.get(app, self.scaling)
        if self.sessions is not None and app in self.sessions.apps and config.unit != "sessions":
            config = attrs.evolve(config, unit="sessions")
        return config
