"""Outlier ejection: replicas (and next hops) that keep failing leave selection for a while.

Sans-IO: the detector takes ``now`` (any monotonic clock in seconds) as an
argument and never reads a clock. The proxy filters an app's candidates
through :meth:`OutlierDetector.selectable` before its policy picks, so every
policy skips ejected replicas without knowing about them.

Three rules shape what :meth:`~OutlierDetector.selectable` offers, in order:
a candidate is out while its replica or its worker is ejected or draining;
when that leaves fewer than ``panic_threshold`` of the candidates (or none),
the pool panics and every candidate is offered; a candidate back from
ejection (or new) is offered for no more than its slow-start share. Active
health checks (:mod:`blocks.prober`) end ejections early and take draining
or dead members out before requests find them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import attrs

from blocks._common import finite
from blocks.routing._table import Replica
from blocks.transport import Address

log = logging.getLogger("blocks.routing")


def _not_below_base(instance: OutlierConfig, attribute: attrs.Attribute[float], value: float) -> None:
    if value < instance.base_ejection:
        raise ValueError(f"max_ejection ({value!r}) must not be below base_ejection ({instance.base_ejection!r})")


@attrs.frozen(kw_only=True)
class OutlierConfig:
    """When a member is taken out of selection, for how long, and how it comes back. Durations in seconds.

    A member is a replica (by name) or a next hop (by address: the proxy's
    worker in front of a replica, the edge's proxy).

    - ``consecutive_failures``: failures in a row (5xx responses and
      unreachable alike; any success resets the count) that eject a member.
    - ``consecutive_unreachable``: the same count when the failure that
      reaches it is one where the member could not be reached at all
      (``replica_unreachable``, ``replica_refused``): by default the first
      one ejects it, so a dead replica, which fails fast and so always has
      the fewest requests in flight, is not picked again and again.
    - ``base_ejection``: how long its first ejection lasts (1 s). Each
      further ejection lasts twice as long as the one before, up to
      ``max_ejection`` (10 s). One that stays in selection for
      ``max_ejection`` after an ejection ended starts again from the base.
      An active health check that passes ends an ejection at once.
    - ``panic_threshold``: the one rule that keeps a pool usable. When
      ejection would leave fewer than this share of a call's candidates
      selectable (Envoy's healthy panic threshold, 50 %), or none, the pool
      panics: ejection is ignored and every candidate is selectable, rather
      than sending everything to the few left. 0: panic only when none is left.
    - ``slow_start_window``: a member back from ejection (or new, as the
      health checker reports it) gets a share that ramps up over this
      window (2 s; 0 turns slow start off): at ``elapsed`` seconds, at most
      ``max(slow_start_min_weight, (elapsed / window) ** (1 / slow_start_aggression))``
      of a full member's share (Envoy's ``slow_start_window``, ``aggression``
      and ``min_weight_percent``). After the window it is a full member.
    """

    consecutive_failures: int = attrs.field(default=5, validator=attrs.validators.ge(1))
    consecutive_unreachable: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    base_ejection: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    max_ejection: float = attrs.field(default=10.0, validator=[attrs.validators.gt(0), finite, _not_below_base])
    panic_threshold: float = attrs.field(default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    slow_start_window: float = attrs.field(default=2.0, validator=[attrs.validators.ge(0), finite])
    slow_start_aggression: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    slow_start_min_weight: float = attrs.field(default=0.1, validator=[attrs.validators.gt(0), attrs.validators.le(1)])


Member = str | Address
"""What the detector tracks: a replica's name, or a next hop's address."""


@attrs.frozen
class OutlierStatistics:
    """``ejected``: replica name -> when its ejection ends (the detector's clock);
    ``failures``: replica name -> consecutive failures counted so far (non-zero
    only); ``ejections``: ejections since the detector was made;
    ``by_replica``: those per replica name; ``hops``: next hop -> when its
    ejection ends (``inf`` while a health check holds it out: draining or
    failing); ``ramping``: member -> when its slow start began (its share
    now: :meth:`~OutlierDetector.share`); ``panics``: :meth:`~OutlierDetector.selectable` calls
    that ignored ejection (the panic threshold); ``hop_events``: next-hop
    connection failures counted (one per event)."""

    ejected: dict[str, float]
    failures: dict[str, int]
    ejections: int
    by_replica: dict[str, int] = attrs.field(factory=dict)
    hops: dict[Address, float] = attrs.field(factory=dict)
    ramping: dict[Member, float] = attrs.field(factory=dict)
    panics: int = 0
    hop_events: int = 0


CONNECTION_EVENT = 0.1
"""Seconds: next-hop failures of one address this close to the last one counted are the same event
(every stream a reset or a GOAWAY cut fails within one reader batch), counted once."""


class OutlierDetector:
    """Takes members that keep failing out of selection for a while, and ramps them back. Sans-IO.

    The proxy tells it how each exchange went (:meth:`record` for the
    replica; :meth:`record_hop` when the proxy's own connection to the
    worker failed, so the replicas behind it are not blamed), a health
    checker tells it what its checks found (:meth:`check_passed`,
    :meth:`check_failed`, :meth:`check_draining`, :meth:`joined`), and the
    proxy filters an app's candidates through :meth:`selectable` before its
    policy picks, so every policy skips ejected members and holds ramping
    ones to their share. ``now`` is any monotonic clock in seconds, the same
    one for every call.

    Outcomes recorded while a member is ejected (requests that were in
    flight when it was ejected) are ignored. The panic rule is applied per
    call to :meth:`selectable`, so it holds for whatever replicas an app has
    at that moment.

    Slow start is a credit per ramping replica: each :meth:`selectable` call
    adds ``share / len(candidates)`` (its fair share of this request, scaled
    by the ramp), and the replica is offered to the policy only when a whole
    credit is there, which it then spends. So however the policy favours it
    (least in flight favours an empty replica), it is picked for no more
    than its ramped share of the calls, and for exactly that under a
    policy that always picks it when offered. A ramping replica is never
    left out when it would leave no full member to pick.
    """

    def __init__(self, config: OutlierConfig | None = None) -> None:
        self.config = config or OutlierConfig()
        self._failures: dict[Member, int] = {}
        self._until: dict[Member, float] = {}  # ejected (possibly expired) -> end of the ejection
        self._history: dict[Member, tuple[int, float]] = {}  # -> (ejections in a row, end of the last)
        self._ramp: dict[Member, float] = {}  # ramping -> when its ramp started
        self._credit: dict[str, float] = {}  # ramping replica name -> its slow-start credit
        self._events: dict[Address, float] = {}  # next hop -> when its last connection event was counted
        self._ejections = 0
        self._by_replica: dict[str, int] = {}
        self._panics = 0
        self._hop_events = 0

    def __repr__(self) -> str:
        return (
            f"<OutlierDetector ejected={sorted(map(str, self._until))} ramping={len(self._ramp)}"
            f" ejections={self._ejections}>"
        )

    # -- what the proxy saw ----------------------------------------------------------------------

    def record(self, replica: Replica, ok: bool, now: float, *, unreachable: bool = False) -> bool:
        """Count one exchange with ``replica``; True if this failure ejected it.

        ``unreachable``: the failure is one where the replica was not reached
        (``consecutive_unreachable`` then decides).
        """
        return self._record(replica.name, ok, now, unreachable)

    def record_hop(self, address: Address, ok: bool, now: float, *, unreachable: bool = False) -> bool:
        """Count a failure (or success) of the connection to the next hop at ``address``; True if it ejected it.

        One connection event (a reset or a GOAWAY that cut many streams at
        once, each of them a failure) counts once: failures within
        :data:`CONNECTION_EVENT` seconds of the last one counted for this
        address are the same event. While it is ejected, every replica
        behind it is out of selection too (within the panic rule).
        """
        if not ok:
            last = self._events.get(address)
            if last is not None and now - last < CONNECTION_EVENT:
                return False
            self._events[address] = now
            if len(self._events) > 4096:
                self._events = {a: t for a, t in self._events.items() if now - t < CONNECTION_EVENT}
            self._hop_events += 1
        return self._record(address, ok, now, unreachable)

    def _record(self, key: Member, ok: bool, now: float, unreachable: bool) -> bool:
        until = self._until.get(key)
        if until is not None:
            if now < until:
                return False
            del self._until[key]  # back in selection, counting from zero
            self._back(key, until)
        if ok:
            if self._failures:
                self._failures.pop(key, None)
            return False
        failures = self._failures.get(key, 0) + 1
        config = self.config
        if failures < (config.consecutive_unreachable if unreachable else config.consecutive_failures):
            self._failures[key] = failures
            return False
        self._eject(key, now, "unreachable" if unreachable else f"failed {failures} times in a row")
        return True

    def _eject(self, key: Member, now: float, why: str) -> None:
        config = self.config
        self._failures.pop(key, None)
        self._ramp.pop(key, None)
        streak, last_end = self._history.get(key, (0, -math.inf))
        if now - last_end >= config.max_ejection:
            streak = 0
        streak = min(streak + 1, 64)
        end = now + min(config.base_ejection * 2.0 ** (streak - 1), config.max_ejection)
        self._until[key] = end
        self._history[key] = (streak, end)
        self._ejections += 1
        if isinstance(key, str):
            self._by_replica[key] = self._by_replica.get(key, 0) + 1
        self._forget_history(now)
        log.warning("%s %s: ejected for %.1fs", _label(key), why, end - now)

    def _back(self, key: Member, since: float) -> None:
        log.warning("%s back in selection", _label(key))
        if self.config.slow_start_window > 0:
            self._ramp[key] = since

    def _forget_history(self, now: float) -> None:
        # Ejections are rare, so this scan is too; it bounds the history by
        # the members ejected within the last max_ejection or so.
        horizon = self.config.max_ejection
        stale = [key for key, (_, end) in self._history.items() if now - end >= horizon]
        for key in stale:
            del self._history[key]

    # -- what the health checker saw -----------------------------------------------------------

    def check_passed(self, key: Member, now: float) -> bool:
        """An active health check of ``key`` passed: its ejection (or drain) ends now; True if it was out.

        It comes back under slow start, counting from zero. (A check that
        passes while the member is in selection changes nothing: requests
        that fail still count, as Envoy's outlier detection counts them.)
        """
        until = self._until.pop(key, None)
        if until is None:
            return False
        self._failures.pop(key, None)
        self._back(key, min(now, until))
        return True

    def check_failed(self, key: Member, now: float) -> bool:
        """An active health check of ``key`` failed (no answer, or not 200 nor 503): it is out of selection
        now, before requests find it dead, and stays out until a check passes (as Envoy's active health
        checking holds an unhealthy host). True if this took it out (it counts as an ejection)."""
        if self._until.get(key) == math.inf:
            return False
        self._until[key] = math.inf
        self._failures.pop(key, None)
        self._ramp.pop(key, None)
        self._ejections += 1
        if isinstance(key, str):
            self._by_replica[key] = self._by_replica.get(key, 0) + 1
        log.warning("%s failed its health check: out until a check passes", _label(key))
        return True

    def check_draining(self, key: Member, now: float) -> None:
        """``key`` answered its health check 503 (it drains): it takes no new requests until a check passes."""
        if self._until.get(key) != math.inf:
            self._until[key] = math.inf
            self._ramp.pop(key, None)
            log.warning("%s draining: out of selection", _label(key))

    def joined(self, key: Member, now: float) -> None:
        """``key`` is new to the pool (the health checker saw it appear): it starts under slow start."""
        if self.config.slow_start_window > 0 and key not in self._until:
            self._ramp[key] = now

    def forget(self, key: Member) -> None:
        """``key`` left the pool (the health checker no longer lists it): drop everything kept about it,
        so a member held out by its checks does not keep :meth:`selectable` off its fast path."""
        self._until.pop(key, None)
        self._ramp.pop(key, None)
        self._failures.pop(key, None)
        if isinstance(key, str):
            self._credit.pop(key, None)

    def ejected(self, replica: Replica, now: float) -> bool:
        """True while ``replica``'s ejection lasts (whether or not the panic rule keeps it in)."""
        until = self._until.get(replica.name)
        return until is not None and now < until

    def out(self, key: Member, now: float) -> bool:
        """True while ``key`` (a replica's name or a next hop's address) is ejected or draining."""
        until = self._until.get(key)
        return until is not None and now < until

    def share(self, key: Member, now: float) -> float:
        """The share of a full member's traffic ``key`` may take now: 1.0, or less while it ramps up."""
        start = self._ramp.get(key)
        return 1.0 if start is None else self._factor(now - start)

    def _factor(self, elapsed: float) -> float:
        config = self.config
        window = config.slow_start_window
        if elapsed >= window:
            return 1.0
        ramp: float = (max(elapsed, 0.0) / window) ** (1.0 / config.slow_start_aggression)
        return max(config.slow_start_min_weight, ramp)

    # -- selection ------------------------------------------------------------------------

    def selectable(self, candidates: Sequence[Replica], now: float) -> Sequence[Replica]:
        """``candidates`` without the ejected ones (a replica's or its worker's ejection), in order,
        within the panic rule, and with ramping ones held to their share.

        Returns ``candidates`` itself when nothing is to be left out (the
        common case, nothing ejected or ramping, costs one dict check).
        Never returns an empty list for a non-empty ``candidates``.
        """
        if not self._until and not self._ramp:
            return candidates
        keep = self._keep([(r.name, r.worker) for r in candidates], now)
        if keep is None:
            return candidates
        return [candidates[i] for i in keep]

    def selectable_hops(self, hops: Sequence[Address], now: float) -> Sequence[Address]:
        """:meth:`selectable` for next hops by address (the edge's proxies): the same rules."""
        if not self._until and not self._ramp:
            return hops
        keep = self._keep([(hop,) for hop in hops], now)
        if keep is None:
            return hops
        return [hops[i] for i in keep]

    def _keep(self, keys: list[tuple[Member, ...]], now: float) -> list[int] | None:
        """The indices of ``keys`` (each candidate's members) to offer, or None for all of them."""
        until = self._until
        if until:
            for key, end in [(key, end) for key, end in until.items() if end <= now]:
                del until[key]  # over: back to the one-check fast path once none is left
                self._back(key, end)
        n = len(keys)
        if until:
            keep = [i for i, members in enumerate(keys) if not any(member in until for member in members)]
            if len(keep) < n and (not keep or len(keep) < self.config.panic_threshold * n - 1e-9):
                self._panics += 1
                return None  # panic: every candidate, ejected or not, ramping or not
        else:
            keep = list(range(n))
        ramp = self._ramp
        if not ramp:
            return keep if len(keep) < n else None
        window = self.config.slow_start_window
        for member in [member for member, start in ramp.items() if now - start >= window]:
            del ramp[member]  # a full member now: back to the one-check fast path once none is left
        if not ramp:
            self._credit.clear()
            return keep if len(keep) < n else None
        ramping: list[tuple[int, float]] = []
        for i in keep:
            starts = [ramp[member] for member in keys[i] if member in ramp]
            if starts:
                ramping.append((i, self._factor(now - max(starts))))
        if not ramping or len(ramping) == len(keep):
            return keep if len(keep) < n else None  # nobody ramps, or nobody full: all of them are offered
        credit = self._credit
        held = set()
        for i, factor in ramping:
            name = str(keys[i][0])
            have = credit.get(name, 1.0) + factor / n  # its first offer at once: traffic finds it back
            if have >= 1.0:
                credit[name] = have - 1.0
            else:
                credit[name] = have
                held.add(i)
        if not held:
            return keep if len(keep) < n else None
        return [i for i in keep if i not in held]

    def statistics(self, now: float | None = None) -> OutlierStatistics:
        """A snapshot; with ``now``, only the ejections and ramps still in force then."""
        ejected: dict[str, float] = {}
        hops: dict[Address, float] = {}
        for key, end in self._until.items():
            if now is None or now < end:
                if isinstance(key, str):
                    ejected[key] = end
                else:
                    hops[key] = end
        failures = {key: n for key, n in self._failures.items() if isinstance(key, str)}
        window = self.config.slow_start_window
        ramping = {key: start for key, start in self._ramp.items() if now is None or now - start < window}
        return OutlierStatistics(
            ejected,
            failures,
            self._ejections,
            dict(self._by_replica),
            hops,
            ramping,
            self._panics,
            self._hop_events,
        )


def _label(key: Member) -> str:
    return f"replica {key!r}" if isinstance(key, str) else f"next hop {key[0]}:{key[1]}"
