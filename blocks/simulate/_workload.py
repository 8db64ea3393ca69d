"""Simulated clients: arrivals from a generator (Poisson, bursts, a diurnal day, a ramp) or a CSV trace.

An :class:`Arrival` is one request: when it comes, its tenant, its app, its
session (``""``: none) and its size (service time is ``size`` times a draw
from the replica's service-time distribution). Both sources yield arrivals
in time order, lazily, so a run of a million sessions never holds them all:
the generator keeps one heap entry per session that has requests left.

A generator is a :class:`Workload` of :class:`Traffic` streams. Each stream
starts sessions as a Poisson process whose rate follows a :class:`Shape`
(by thinning: candidates at the shape's peak rate, each kept with the
probability of the rate at its time over the peak); a session sends a
geometric number of requests (mean ``requests``), spaced by exponential
think times (mean ``think``). A noisy tenant is one more stream with a
higher rate.
"""

from __future__ import annotations

import csv
import heapq
import itertools
import math
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import attrs

from blocks._common import finite


class Arrival:
    """One simulated request: ``time`` (seconds), ``tenant``, ``app``, ``session`` (``""``: none), ``size``."""

    __slots__ = ("app", "session", "size", "tenant", "time")

    def __init__(self, time: float, tenant: str, app: str, session: str = "", size: float = 1.0) -> None:
        self.time = time
        self.tenant = tenant
        self.app = app
        self.session = session
        self.size = size

    def __repr__(self) -> str:
        return f"Arrival({self.time!r}, {self.tenant!r}, {self.app!r}, {self.session!r}, {self.size!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Arrival):
            return NotImplemented
        return (self.time, self.tenant, self.app, self.session, self.size) == (
            other.time,
            other.tenant,
            other.app,
            other.session,
            other.size,
        )

    __hash__ = None  # type: ignore[assignment]


class Shape(Protocol):
    """How a stream's rate changes over time: ``at(t)`` multiplies the stream's ``rate``; ``peak`` is its maximum."""

    @property
    def peak(self) -> float: ...

    def at(self, time: float) -> float: ...


@attrs.frozen
class Steady:
    """The same rate all along."""

    @property
    def peak(self) -> float:
        return 1.0

    def at(self, time: float) -> float:
        return 1.0


@attrs.frozen(kw_only=True)
class Bursts:
    """``factor`` times the rate for ``length`` seconds at the start of every ``every`` seconds."""

    every: float = attrs.field(validator=[attrs.validators.gt(0.0), finite])
    length: float = attrs.field(validator=[attrs.validators.ge(0.0), finite])
    factor: float = attrs.field(default=10.0, validator=[attrs.validators.ge(0.0), finite])

    @property
    def peak(self) -> float:
        return max(1.0, self.factor)

    def at(self, time: float) -> float:
        return self.factor if time % self.every < self.length else 1.0


@attrs.frozen(kw_only=True)
class Diurnal:
    """A day in ``period`` seconds: from ``low`` times the rate at 0 up to the rate at ``period / 2`` and back."""

    period: float = attrs.field(validator=[attrs.validators.gt(0.0), finite])
    low: float = attrs.field(default=0.1, validator=[attrs.validators.ge(0), attrs.validators.le(1)])

    @property
    def peak(self) -> float:
        return 1.0

    def at(self, time: float) -> float:
        return self.low + (1.0 - self.low) * (1.0 - math.cos(2.0 * math.pi * time / self.period)) / 2.0


def _points(value: Iterable[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    points = tuple((float(t), float(m)) for t, m in value)
    if not points:
        raise ValueError("a ramp needs at least one point")
    if any(b[0] < a[0] for a, b in itertools.pairwise(points)):
        raise ValueError("a ramp's points go forward in time")
    if any(not (math.isfinite(t) and math.isfinite(m) and m >= 0) for t, m in points):
        raise ValueError("a ramp's points are finite, with multipliers >= 0")
    return points


@attrs.frozen
class Ramp:
    """Piecewise linear between ``(time, multiplier)`` points; flat before the first and after the last.

    ``Ramp([(0, 0), (10, 1), (40, 1), (50, 0)])``: 0 -> the rate in 10 s, 30 s steady, back to 0.
    """

    points: tuple[tuple[float, float], ...] = attrs.field(converter=_points)

    @property
    def peak(self) -> float:
        return max(m for _, m in self.points)

    def at(self, time: float) -> float:
        points = self.points
        if time <= points[0][0]:
            return points[0][1]
        for (t0, m0), (t1, m1) in itertools.pairwise(points):
            if time <= t1:
                return m1 if t1 == t0 else m0 + (m1 - m0) * (time - t0) / (t1 - t0)
        return points[-1][1]


def _apps(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError("apps is a collection of app names, not one string")
    apps = tuple(value)
    if not apps:
        raise ValueError("a stream needs at least one app")
    return apps


@attrs.frozen(kw_only=True)
class Traffic:
    """One stream of sessions: ``rate`` sessions a second (times its ``shape``), of one tenant, over ``apps``.

    - ``apps``: each session goes to one of them, uniformly at random.
    - ``requests``: the mean of a session's requests (geometric, at least 1;
      1: every session is one request).
    - ``think``: mean seconds between a session's requests (exponential).
    - ``size``: each request's size (service time is proportional to it).
    - ``start``, ``stop``: sessions start only in ``[start, stop)`` (``stop``
      None: until the workload's end); their later requests may come after.
    """

    rate: float = attrs.field(validator=[attrs.validators.ge(0.0), finite])
    tenant: str = "default"
    apps: tuple[str, ...] = attrs.field(default=("app",), converter=_apps)
    shape: Shape = attrs.field(factory=Steady)
    requests: float = attrs.field(default=1.0, validator=[attrs.validators.ge(1), finite])
    think: float = attrs.field(default=1.0, validator=[attrs.validators.ge(0.0), finite])
    size: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0.0), finite])
    start: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0), finite])
    stop: float | None = None


def _streams(value: Iterable[Traffic]) -> tuple[Traffic, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class Workload:
    """Streams of simulated sessions over ``duration`` seconds (no arrival after it), from ``seed``.

    The same workload (same streams, same seed) yields the same arrivals, so
    two configurations compared on it see the very same clients.
    """

    traffic: tuple[Traffic, ...] = attrs.field(converter=_streams)
    duration: float = attrs.field(validator=[attrs.validators.gt(0.0), finite])
    seed: int = 0

    def arrivals(self) -> Iterator[Arrival]:
        """The arrivals in time order (ties in a fixed order), generated as they are read."""
        rng = random.Random(self.seed)
        expo, uniform = rng.expovariate, rng.random
        duration = self.duration
        # (time, seq, stream, session): session None is the stream's next session start
        heap: list[tuple[float, int, int, _Pending | None]] = []
        seq = itertools.count()
        started = [0] * len(self.traffic)

        def next_start(i: int, after: float) -> None:
            stream = self.traffic[i]
            stop = duration if stream.stop is None else min(stream.stop, duration)
            peak = stream.rate * stream.shape.peak
            if peak <= 0:
                return
            time = max(after, stream.start)
            while True:
                time += expo(peak)
                if time >= stop:
                    return
                if uniform() * peak < stream.rate * stream.shape.at(time):
                    heapq.heappush(heap, (time, next(seq), i, None))
                    return

        for i in range(len(self.traffic)):
            next_start(i, 0.0)
        while heap:
            time, _, i, session = heapq.heappop(heap)
            if time > duration:
                return
            stream = self.traffic[i]
            if session is None:
                next_start(i, time)
                started[i] += 1
                apps = stream.apps
                app = apps[int(uniform() * len(apps))] if len(apps) > 1 else apps[0]
                session = _Pending(f"{stream.tenant}-{i}.{started[i]}", app, 0)
                if stream.requests > 1:
                    p = 1.0 / stream.requests  # geometric on 1, 2, ... with mean 1/p
                    session.left = int(math.log(1.0 - uniform()) / math.log(1.0 - p))
            else:
                session.left -= 1
            if session.left:
                later = time + expo(1.0 / stream.think) if stream.think else time
                heapq.heappush(heap, (later, next(seq), i, session))
            yield Arrival(time, stream.tenant, session.app, session.id, stream.size)


class _Pending:
    """A generated session with requests still to come."""

    __slots__ = ("app", "id", "left")

    def __init__(self, sid: str, app: str, left: int) -> None:
        self.id = sid
        self.app = app
        self.left = left  # requests after the one being yielded


TRACE_FIELDS = ("time", "tenant", "app", "session", "size")
"""A trace's CSV header: arrival time (seconds), tenant, app, session (may be empty), size (may be empty: 1)."""


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file, the line and what is wrong."""


def read_trace(path: str | Path) -> Iterator[Arrival]:
    """The arrivals of a CSV trace (header :data:`TRACE_FIELDS`), read as they are needed.

    Raises :class:`TraceError` (when the bad line is reached) for a missing
    header field, a time that is not a finite number or goes back, or a size
    that is not a positive number.
    """
    path = Path(path)
    try:
        file = path.open(newline="")
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from exc
    with file:
        reader = csv.DictReader(file)
        missing = [name for name in ("time", "tenant", "app") if name not in (reader.fieldnames or ())]
        if missing:
            raise TraceError(f"{path}: the header lacks {', '.join(missing)} (it is {','.join(TRACE_FIELDS)})")
        last = -math.inf
        for row in reader:
            where = f"{path}: line {reader.line_num}"
            try:
                time = float(row["time"])
                size = float(row.get("size") or 1.0)
            except (TypeError, ValueError) as exc:
                raise TraceError(f"{where}: {exc}") from None
            if not math.isfinite(time) or time < 0:
                raise TraceError(f"{where}: time {row['time']!r} is not a finite number >= 0")
            if time < last:
                raise TraceError(f"{where}: time {time:g} goes back (the line before: {last:g})")
            if not (math.isfinite(size) and size > 0):
                raise TraceError(f"{where}: size {row.get('size')!r} is not a number > 0")
            if not row["tenant"] or not row["app"]:
                raise TraceError(f"{where}: tenant and app may not be empty")
            last = time
            yield Arrival(time, row["tenant"], row["app"], row.get("session") or "", size)


def write_trace(arrivals: Iterable[Arrival], path: str | Path) -> int:
    """Write ``arrivals`` as a CSV trace that :func:`read_trace` reads back; how many were written."""
    n = 0
    with Path(path).open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(TRACE_FIELDS)
        for arrival in arrivals:
            writer.writerow([repr(arrival.time), arrival.tenant, arrival.app, arrival.session, repr(arrival.size)])
            n += 1
    return n


PATTERNS = ("poisson", "bursts", "noisy", "diurnal", "ramp")
"""The names :func:`pattern` knows."""


def pattern(
    name: str,
    *,
    rate: float,
    duration: float,
    apps: int = 1,
    requests: float = 1.0,
    think: float = 1.0,
    seed: int = 0,
) -> Workload:
    """A ready-made workload: ``rate`` sessions a second over ``apps`` apps (``app-0`` ...), for ``duration`` s.

    - ``poisson``: steady, tenant ``default``;
    - ``bursts``: ten times the rate for a tenth of every sixth of the run;
    - ``noisy``: ``default`` steady, and tenant ``noisy`` at five times the
      rate on ``app-0`` alone;
    - ``diurnal``: a day in ``duration``, from a tenth of the rate to all of it and back;
    - ``ramp``: 0 -> the rate over the first fifth, steady, back to 0 over the last fifth.
    """
    names = tuple(f"app-{i}" for i in range(apps))
    base = Traffic(rate=rate, apps=names, requests=requests, think=think)
    streams: list[Traffic]
    if name == "poisson":
        streams = [base]
    elif name == "bursts":
        streams = [attrs.evolve(base, shape=Bursts(every=duration / 6, length=duration / 60, factor=10.0))]
    elif name == "noisy":
        streams = [base, attrs.evolve(base, tenant="noisy", rate=5 * rate, apps=names[:1])]
    elif name == "diurnal":
        streams = [attrs.evolve(base, shape=Diurnal(period=duration))]
    elif name == "ramp":
        fifth = duration / 5
        streams = [attrs.evolve(base, shape=Ramp([(0, 0), (fifth, 1), (duration - fifth, 1), (duration, 0)]))]
    else:
        raise ValueError(f"{name!r} is not a pattern (the patterns: {', '.join(PATTERNS)})")
    return Workload(traffic=streams, duration=duration, seed=seed)
