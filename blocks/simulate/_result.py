"""What a simulation run reports: :class:`SimResult`, a :class:`TenantResult` per tenant, a :class:`Sample`
of the timeline; and :class:`SimulationLimit`, a run cut at its bound of events."""

from __future__ import annotations

import attrs


class SimulationLimit(RuntimeError):
    """A run processed ``max_events`` events before it was done: a bound for tests and runaway configurations."""


@attrs.frozen
class TenantResult:
    """One tenant's requests: how they ended, and percentiles in seconds (None when none was served).

    ``queueing`` is from arrival to the start of service (cold start, session
    placement, the fair queue and the replica's own queue); ``latency`` is
    from arrival to the end of service.
    """

    requests: int
    served: int
    refused: int
    timed_out: int
    unfinished: int
    queueing_p50: float | None
    queueing_p99: float | None
    latency_p50: float | None
    latency_p99: float | None


@attrs.frozen
class Sample:
    """The fleet at one point of the timeline, and the requests served in the ``sample`` seconds before it."""

    time: float
    replicas: int
    ready: int
    starting: int
    draining: int
    in_flight: int
    served: int
    queueing_p50: float | None
    latency_p50: float | None
    latency_p99: float | None


@attrs.frozen
class SimResult:
    """What a run did. Counts are of requests unless named otherwise; durations in seconds.

    - ``refused`` and ``timed_out`` map a reason to its count: ``queue-full``
      (the fair queue's 429), ``session-queue-full`` (the session placer's
      429); ``queue-timeout``, ``session-timeout`` and ``cold-start`` (no
      replica within ``cold_start_timeout``), the 503s.
    - ``replica_seconds``: the integral of the replica count (starting, ready
      and draining) over the run; ``lifetimes``: the same summed replica by
      replica, a cross-check; ``replica_changes``: ``(time, count)`` at every
      change of that count.
    - ``cold_starts``: replicas started; ``cold_waits``: requests that waited
      for a first replica; ``peak_replicas``: the most at once.
    - ``sessions``: sessions started; ``events``: events processed.
    """

    name: str
    end: float
    events: int
    requests: int
    served: int
    refused: dict[str, int]
    timed_out: dict[str, int]
    unfinished: int
    tenants: dict[str, TenantResult]
    queueing_p50: float | None
    queueing_p99: float | None
    latency_p50: float | None
    latency_p99: float | None
    replica_seconds: float
    lifetimes: float
    cold_starts: int
    cold_waits: int
    peak_replicas: int
    sessions: int
    timeline: tuple[Sample, ...]
    replica_changes: tuple[tuple[float, int], ...]
