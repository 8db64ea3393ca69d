"""The autoscale signal: per-app in flight (or sessions) per replica, time-weighted, against a target. Sans-IO.

:class:`AutoscaleSignal` turns per-app totals (the prober records one per
app each round) into a time-weighted average per replica against a target,
with separate scale-up and scale-down windows, and says "up", "down" or
"hold". No trio, no clock: ``now`` is an argument. (It was part of
:mod:`blocks.prober`'s load core; it is its own object, fed by the prober.)
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from typing import Any

import attrs

from blocks._common import finite


def _up_to_down(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if value < instance.up_window:
        raise ValueError(f"down_window ({value!r}) must not be shorter than up_window ({instance.up_window!r})")


@attrs.frozen(kw_only=True)
class AutoscaleConfig:
    """What an app's replicas should carry, and how fast to react. Seconds.

    - ``target_concurrency``: requests in flight per replica to aim for.
    - ``up_window``: scale up when the average per replica over this window
      exceeds the target.
    - ``down_window``: scale down when the average per replica over this
      (longer) window is below ``target * (1 - hysteresis)``, and only once
      that much history has been recorded.
    - ``hysteresis``: the dead band under the target, so that a load right at
      the target does not flap.
    """

    target_concurrency: float = attrs.field(validator=[attrs.validators.gt(0.0), finite])
    up_window: float = attrs.field(default=30.0, validator=[attrs.validators.gt(0), finite])
    down_window: float = attrs.field(default=300.0, validator=[attrs.validators.gt(0), finite, _up_to_down])
    hysteresis: float = attrs.field(default=0.2, validator=[attrs.validators.ge(0), attrs.validators.lt(1)])


@attrs.frozen
class AppAutoscale:
    """One app's autoscale signal at one moment.

    - ``avg_in_flight_per_replica``: time-weighted over ``up_window``;
    - ``long_avg_in_flight_per_replica``: the same over ``down_window``;
    - ``total_avg_in_flight``: the app's total in flight, time-weighted over
      the window behind the recommendation (``up_window`` for "up",
      ``down_window`` otherwise);
    - ``desired_replicas``: ``ceil(total_avg_in_flight / target)`` for "up"
      and "down", ``replicas`` for "hold";
    - ``history``: seconds of samples within ``down_window``;
    - ``avg_in_flight`` and ``long_avg_in_flight``: the app's total in
      flight, time-weighted over ``up_window`` and ``down_window`` (what an
      autoscaler that keeps spare replicas needs, whatever the recommendation).
    """

    target: float
    replicas: int
    avg_in_flight_per_replica: float
    long_avg_in_flight_per_replica: float
    total_avg_in_flight: float
    desired_replicas: int
    recommendation: str
    history: float
    avg_in_flight: float = 0.0
    long_avg_in_flight: float = 0.0


@attrs.frozen
class AutoscaleStatistics:
    apps: dict[str, AppAutoscale]


def _averages(
    samples: collections.deque[tuple[float, float, int]], now: float, window: float
) -> tuple[float, float, float]:
    """Time-weighted (total, per replica, seconds covered) over ``[now - window, now]``.

    Each sample holds from its time until the next one (the last until ``now``).
    """
    start = now - window
    total = per_replica = covered = 0.0
    n = len(samples)
    for i, (t, in_flight, replicas) in enumerate(samples):
        end = samples[i + 1][0] if i + 1 < n else now
        span = min(end, now) - max(t, start)
        if span > 0:
            total += in_flight * span
            per_replica += in_flight / max(replicas, 1) * span
            covered += span
    if covered == 0:
        _, in_flight, replicas = samples[-1]
        return in_flight, in_flight / max(replicas, 1), 0.0
    return total / covered, per_replica / covered, covered


class AutoscaleSignal:
    """Per app, the time-weighted in-flight per replica against a target; "up", "down" or "hold".

    Feed it one sample per app now and then (the prober does, once a round)
    with :meth:`record`; read it with :meth:`recommend` or
    :meth:`statistics`. ``config`` is for every app but those in ``apps``.
    Samples older than the longest window are dropped as new ones come.
    """

    def __init__(self, config: AutoscaleConfig, *, apps: Mapping[str, AutoscaleConfig] | None = None) -> None:
        self.config = config
        self.overrides = dict(apps or {})
        self._series: dict[str, collections.deque[tuple[float, float, int]]] = {}

    def __repr__(self) -> str:
        return f"<AutoscaleSignal apps={sorted(self._series)}>"

    @property
    def apps(self) -> list[str]:
        """The apps with samples."""
        return list(self._series)

    def config_for(self, app: str) -> AutoscaleConfig:
        return self.overrides.get(app, self.config)

    def record(self, app: str, in_flight: float, replicas: int, now: float) -> None:
        """At ``now``, ``app`` has ``in_flight`` requests in flight over ``replicas`` replicas.

        ``now`` never goes back; a sample at the same ``now`` as the last one
        replaces it.
        """
        if in_flight < 0 or replicas < 0:
            raise ValueError(f"in_flight ({in_flight!r}) and replicas ({replicas!r}) must not be negative")
        series = self._series.get(app)
        if series is None:
            series = self._series[app] = collections.deque()
        elif now < series[-1][0]:
            raise ValueError(f"now ({now!r}) is before the last sample ({series[-1][0]!r})")
        elif now == series[-1][0]:
            series.pop()
        series.append((now, float(in_flight), replicas))
        horizon = now - self.config_for(app).down_window
        while len(series) > 1 and series[1][0] <= horizon:
            series.popleft()  # the next one covers the whole window from its start

    def forget(self, app: str) -> None:
        self._series.pop(app, None)

    def recommend(self, app: str, now: float) -> AppAutoscale:
        """``app``'s signal at ``now``; ``KeyError`` if it has no samples."""
        series = self._series[app]
        config = self.config_for(app)
        target = config.target_concurrency
        replicas = series[-1][2]
        up_total, up_per, _ = _averages(series, now, config.up_window)
        down_total, down_per, history = _averages(series, now, config.down_window)
        recommendation, total, desired = "hold", down_total, replicas
        # (1e-9: a total of exactly k * target is k replicas, binary fractions or not)
        if up_per > target:
            wanted = math.ceil(up_total / target - 1e-9)
            if wanted > replicas:
                recommendation, total, desired = "up", up_total, wanted
        elif history >= config.down_window - 1e-9 and down_per < target * (1 - config.hysteresis):
            wanted = max(0, math.ceil(down_total / target - 1e-9))
            if wanted < replicas:
                recommendation, desired = "down", wanted
        return AppAutoscale(
            target=target,
            replicas=replicas,
            avg_in_flight_per_replica=up_per,
            long_avg_in_flight_per_replica=down_per,
            total_avg_in_flight=total,
            desired_replicas=desired,
            recommendation=recommendation,
            history=history,
            avg_in_flight=up_total,
            long_avg_in_flight=down_total,
        )

    def statistics(self, now: float) -> AutoscaleStatistics:
        return AutoscaleStatistics({app: self.recommend(app, now) for app in self._series})
