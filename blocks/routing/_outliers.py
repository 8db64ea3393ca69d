"""Outlier ejection: replicas that keep failing leave selection for a while.

Sans-IO: the detector takes ``now`` (any monotonic clock in seconds) as an
argument and never reads a clock. The proxy filters an app's candidates
through :meth:`OutlierDetector.selectable` before its policy picks, so every
policy skips ejected replicas without knowing about them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import attrs

from blocks._common import finite
from blocks.routing._table import Replica

log = logging.getLogger("blocks.routing")


def _not_below_base(instance: OutlierConfig, attribute: attrs.Attribute[float], value: float) -> None:
    if value < instance.base_ejection:
        raise ValueError(f"max_ejection ({value!r}) must not be below base_ejection ({instance.base_ejection!r})")


@attrs.frozen(kw_only=True)
class OutlierConfig:
    """When a replica is taken out of selection, and for how long. Durations in seconds.

    - ``consecutive_failures``: failures in a row (5xx responses and
      unreachable alike; any success resets the count) that eject a replica.
    - ``consecutive_unreachable``: the same count when the failure that
      reaches it is one where the replica could not be reached at all
      (``replica_unreachable``, ``replica_refused``): by default the first
      one ejects it, so a dead replica, which fails fast and so always has
      the fewest requests in flight, is not picked again and again.
    - ``base_ejection``: how long its first ejection lasts (1 s). Each
      further ejection lasts twice as long as the one before, up to
      ``max_ejection`` (10 s): a replica that answers again is back within
      seconds. One that stays in selection for ``max_ejection`` after an
      ejection ended starts again from the base.
    - ``max_ejected_share``: the most of an app's replicas that may be out
      of selection at once (rounded down); at least one always stays in.
    """

    consecutive_failures: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    consecutive_unreachable: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    base_ejection: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    max_ejection: float = attrs.field(default=10.0, validator=[attrs.validators.gt(0), finite, _not_below_base])
    max_ejected_share: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0), attrs.validators.le(1)])


@attrs.frozen
class OutlierStatistics:
    """``ejected``: replica name -> when its ejection ends (the detector's clock);
    ``failures``: replica name -> consecutive failures counted so far (non-zero
    only); ``ejections``: ejections since the detector was made;
    ``by_replica``: those per replica name."""

    ejected: dict[str, float]
    failures: dict[str, int]
    ejections: int
    by_replica: dict[str, int] = attrs.field(factory=dict)


class OutlierDetector:
    """Takes replicas that keep failing out of selection for a while. Sans-IO.

    The proxy tells it how each exchange with a replica went
    (:meth:`record`: a connect failure or a 5xx response head is a failure,
    anything else a success), and filters an app's candidates through
    :meth:`selectable` before its policy picks, so that every policy skips
    ejected replicas. ``now`` is any monotonic clock in seconds, the same
    one for every call.

    Outcomes recorded while a replica is ejected (requests that were in
    flight when it was ejected) are ignored. The share rule is applied per
    call to :meth:`selectable`, so it holds for whatever replicas an app has
    at that moment: when more are ejected than the share allows, those whose
    ejection ends first stay in selection.
    """

    def __init__(self, config: OutlierConfig | None = None) -> None:
        self.config = config or OutlierConfig()
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}  # ejected (possibly expired) -> end of the ejection
        self._history: dict[str, tuple[int, float]] = {}  # -> (ejections in a row, end of the last)
        self._ejections = 0
        self._by_replica: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<OutlierDetector ejected={sorted(self._until)} ejections={self._ejections}>"

    def record(self, replica: Replica, ok: bool, now: float, *, unreachable: bool = False) -> bool:
        """Count one exchange with ``replica``; True if this failure ejected it.

        ``unreachable``: the failure is one where the replica was not reached
        (``consecutive_unreachable`` then decides).
        """
        name = replica.name
        until = self._until.get(name)
        if until is not None:
            if now < until:
                return False
            del self._until[name]  # back in selection, counting from zero
            log.warning("replica %r back in selection", name)
        if ok:
            if self._failures:
                self._failures.pop(name, None)
            return False
        failures = self._failures.get(name, 0) + 1
        config = self.config
        if failures < (config.consecutive_unreachable if unreachable else config.consecutive_failures):
            self._failures[name] = failures
            return False
        self._failures.pop(name, None)
        streak, last_end = self._history.get(name, (0, -math.inf))
        if now - last_end >= config.max_ejection:
            streak = 0
        streak = min(streak + 1, 64)
        end = now + min(config.base_ejection * 2.0 ** (streak - 1), config.max_ejection)
        self._until[name] = end
        self._history[name] = (streak, end)
        self._ejections += 1
        self._by_replica[name] = self._by_replica.get(name, 0) + 1
        self._forget_history(now)
        log.warning(
            "replica %r %s: ejected for %.1fs",
            name,
            "unreachable" if unreachable else f"failed {failures} times in a row",
            end - now,
        )
        return True

    def _forget_history(self, now: float) -> None:
        # Ejections are rare, so this scan is too; it bounds the history by
        # the replicas ejected within the last max_ejection or so.
        horizon = self.config.max_ejection
        stale = [name for name, (_, end) in self._history.items() if now - end >= horizon]
        for name in stale:
            del self._history[name]

    def ejected(self, replica: Replica, now: float) -> bool:
        """True while ``replica``'s ejection lasts (whether or not the share rule keeps it in)."""
        until = self._until.get(replica.name)
        return until is not None and now < until

    def selectable(self, candidates: Sequence[Replica], now: float) -> Sequence[Replica]:
        """``candidates`` without the ejected ones, in order, within the share rule.

        Returns ``candidates`` itself when nothing is to be left out (the
        common case costs one dict check). Never returns an empty list for a
        non-empty ``candidates``.
        """
        until = self._until
        if not until:
            return candidates
        for name in [name for name, end in until.items() if end <= now]:
            del until[name]  # over: back to the one-check fast path once none is left
            log.warning("replica %r back in selection", name)
        out: list[tuple[float, int]] = []
        for i, replica in enumerate(candidates):
            ends = until.get(replica.name)
            if ends is not None:
                out.append((ends, i))
        if not out:
            return candidates
        n = len(candidates)
        # Rounded down, with a little slack for binary fractions (0.29 * 100).
        allowed = min(math.floor(n * self.config.max_ejected_share + 1e-9), n - 1)
        if allowed <= 0:
            return candidates
        if len(out) > allowed:
            out.sort()
            out = out[len(out) - allowed :]  # those back soonest stay in
        skip = {i for _, i in out}
        return [replica for i, replica in enumerate(candidates) if i not in skip]

    def statistics(self, now: float | None = None) -> OutlierStatistics:
        """A snapshot; with ``now``, only the ejections still in force then."""
        ejected = {name: end for name, end in self._until.items() if now is None or now < end}
        return OutlierStatistics(ejected, dict(self._failures), self._ejections, dict(self._by_replica))
