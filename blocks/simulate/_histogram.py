"""A log-bucketed histogram of durations: fixed memory whatever the count, percentiles within 1%.

A million requests' latencies kept as floats cost tens of megabytes and a
sort; a histogram of buckets one percent wide costs a few hundred dict
entries and one ``log`` per sample. Durations below a microsecond (a request
that never waited) share one bucket, reported as 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

_FLOOR = 1e-6  # seconds: anything shorter is "no wait"
_GROWTH = 1.01  # each bucket is 1% wider than the last
_SCALE = 1.0 / math.log(_GROWTH)
_PER_FLOOR = 1.0 / _FLOOR


class Histogram:
    """Counts of durations in buckets 1% wide; ``percentile`` answers within 1% of the exact value.

    A bucket ``i >= 0`` holds ``[FLOOR * 1.01**i, FLOOR * 1.01**(i+1))``; a
    percentile reports its bucket's geometric middle, so the error is at most
    half a bucket (0.5%). Bucket ``-1`` holds everything below ``FLOOR`` and
    reports 0.
    """

    __slots__ = ("buckets", "count", "total")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}
        self.count = 0
        self.total = 0.0

    def __repr__(self) -> str:
        return f"<Histogram count={self.count} p50={self.percentile(0.5)} p99={self.percentile(0.99)}>"

    def add(self, seconds: float) -> None:
        index = int(math.log(seconds * _PER_FLOOR) * _SCALE) if seconds >= _FLOOR else -1
        buckets = self.buckets
        buckets[index] = buckets.get(index, 0) + 1
        self.count += 1
        self.total += seconds

    def merge(self, other: Histogram) -> None:
        buckets = self.buckets
        for index, n in other.buckets.items():
            buckets[index] = buckets.get(index, 0) + n
        self.count += other.count
        self.total += other.total

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def percentile(self, fraction: float) -> float | None:
        """The nearest-rank percentile (``fraction`` in [0, 1]), or None when empty."""
        if not self.count:
            return None
        rank = max(1, math.ceil(fraction * self.count))
        seen = 0
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if seen >= rank:
                return 0.0 if index < 0 else _FLOOR * _GROWTH ** (index + 0.5)
        raise AssertionError("unreachable: the buckets add up to count")  # pragma: no cover

    def add_both(self, other: Histogram, seconds: float) -> None:
        """``add(seconds)`` here and to ``other``, with one ``log`` (the engine's hot path)."""
        index = int(math.log(seconds * _PER_FLOOR) * _SCALE) if seconds >= _FLOOR else -1
        buckets = self.buckets
        buckets[index] = buckets.get(index, 0) + 1
        self.count += 1
        self.total += seconds
        buckets = other.buckets
        buckets[index] = buckets.get(index, 0) + 1
        other.count += 1
        other.total += seconds

    @classmethod
    def of(cls, samples: Iterable[float]) -> Histogram:
        histogram = cls()
        for sample in samples:
            histogram.add(sample)
        return histogram
