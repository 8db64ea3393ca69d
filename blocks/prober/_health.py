"""Active health checks: next hops and ejected replicas, checked in the background, feeding an outlier detector.

Theory of operation. Outlier ejection (:class:`~blocks.routing.OutlierDetector`)
learns from requests, so on its own it learns late twice: a dead next hop is
found by the requests sent to it, and an ejected member comes back only when
its ejection times out, however long ago it recovered. :func:`open_health_checker`
runs one task in a nursery of its own (service lifetime, never a request's)
that, once an ``interval``, checks every target at once over the hop's pooled
connections and tells the detector:

- a next hop (``targets()``: the proxy's workers, the edge's proxies) gets
  ``GET /.proxyblocks/health`` with ``x-proxyblocks-probe``, which every hop
  answers itself (:data:`~blocks.fields.HEALTH_PATH`). 200 ends its ejection
  at once (:meth:`~blocks.routing.OutlierDetector.check_passed`: it is back
  within one interval, under slow start); 503 (it drains) takes it out until
  a check passes (``check_draining``); no answer within ``timeout``, or any
  other status, takes it out until a check passes, before requests find it dead (``check_failed``).
- a replica that is ejected (``replicas()``, read each round, filtered by
  the detector) is checked through its worker: the same request with
  ``x-proxyblocks-replica`` and ``x-proxyblocks-target``, which the worker
  answers 200 if it can reach that replica now (a pooled connection, or a
  fresh connect). 200 ends the ejection; anything else leaves it be.
- a target or replica that was not there the round before (after the
  first round) joins under slow start (``joined``); one that is no longer
  there is forgotten (``forget``).

Where another poller already asks every next hop something each interval
(the proxy's prober and its load poll), the checker sends no second request:
``polled=True`` and the poller reports each answer through
:meth:`HealthChecker.observe` (200, 503, or None for no usable answer).

A check is bounded by a cancel scope of ``timeout``, as the prober's polls
are (see :mod:`blocks.prober._driver` for why not the pool's own timeout).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import trio

from blocks._common import finite
from blocks._sync import every, one_error
from blocks.fields import HEALTH_PATH, PROBE_HEADER, REPLICA_HEADER, TARGET_HEADER
from blocks.http import Headers, Request

if TYPE_CHECKING:
    from blocks.routing import Address, OutlierDetector, Replica
    from blocks.transport.multiplexer import Upstreams

log = logging.getLogger("blocks.prober")


def _not_above_interval(instance: HealthConfig, attribute: attrs.Attribute[float], value: float) -> None:
    if value > instance.interval:
        raise ValueError(f"timeout ({value!r}) must not exceed interval ({instance.interval!r})")


@attrs.frozen(kw_only=True)
class HealthConfig:
    """How often the health checker checks, and how long a check may take. Seconds.

    - ``interval``: one check of every target (and every ejected replica)
      per interval, all at once (0.5 s): an ejected member that answers again
      is back within one interval.
    - ``timeout``: the most one check may take, connect included (0.25 s);
      at most ``interval``, so rounds never overlap. Past it the check failed.
    - ``replicas``: whether ejected replicas are checked through their
      worker (True).
    """

    interval: float = attrs.field(default=0.5, validator=[attrs.validators.gt(0), finite])
    timeout: float = attrs.field(default=0.25, validator=[attrs.validators.gt(0), finite, _not_above_interval])
    replicas: bool = True


@attrs.frozen
class HealthStatistics:
    """``rounds``: rounds run; ``checks``: checks sent (next hops and replicas); ``failed``: checks
    that found no usable answer; ``draining``: next hops whose last answer was 503; ``last``: next hop
    -> the status of its last check or poll (None: no usable answer)."""

    rounds: int
    checks: int
    failed: int
    draining: frozenset[Address]
    last: dict[Address, int | None]


def _authority(address: Address) -> bytes:
    host, port = address
    return (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()


class HealthChecker:
    """Checks next hops (and ejected replicas) once an interval; feeds the detector. Use :func:`open_health_checker`."""

    def __init__(
        self,
        upstreams: Upstreams,
        targets: Callable[[], Iterable[Address]],
        detector: OutlierDetector,
        config: HealthConfig,
        *,
        replicas: Callable[[], Iterable[Replica]] | None = None,
        polled: bool = False,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.upstreams = upstreams
        self.targets = targets
        self.detector = detector
        self.config = config
        self.replicas = replicas
        self.polled = polled
        self.clock = clock
        self._last: dict[Address, int | None] = {}
        self._seen: set[Address | str] | None = None  # members of the last round (None before the first)
        self._rounds = 0
        self._checks = 0
        self._failed = 0
        self._round_done = trio.Event()

    def __repr__(self) -> str:
        return f"<HealthChecker targets={len(self._last)} rounds={self._rounds} polled={self.polled}>"

    def statistics(self) -> HealthStatistics:
        draining = frozenset(address for address, status in self._last.items() if status == 503)
        return HealthStatistics(self._rounds, self._checks, self._failed, draining, dict(self._last))

    async def wait_round(self) -> None:
        """Wait until the round that is running (or the next one) has finished."""
        await self._round_done.wait()

    def observe(self, address: Address, status: int | None) -> None:
        """One answer about the next hop at ``address``, from this checker or another poller: 200 (serving),
        503 (draining) or None / any other status (no usable answer), applied to the detector now."""
        now = self.clock()
        self._last[address] = status
        detector = self.detector
        if status == 200:
            if detector.check_passed(address, now):
                log.info("next hop %s:%d answers its health check again", *address)
        elif status == 503:
            detector.check_draining(address, now)
        else:
            self._failed += 1
            detector.check_failed(address, now)

    async def _get(self, address: Address, headers: Headers) -> int | None:
        """The status of one health request to ``address`` (None: no answer within the timeout)."""
        self._checks += 1
        status: int | None = None
        with trio.move_on_after(self.config.timeout):
            try:
                request = Request(b"GET", b"http", _authority(address), HEALTH_PATH)
                response = await self.upstreams.request(address, request, [(PROBE_HEADER, b"1"), *headers])
                try:
                    await response.body.read_all(4096)
                finally:
                    with trio.CancelScope(shield=True):  # (an h2 body's aclose never waits)
                        await response.body.aclose()
                status = response.status
            except Exception as exc:  # counted; the checker carries on. (Cancelled is not an Exception.)
                log.debug("health check of %r failed: %s: %s", address, type(exc).__name__, exc)
        return status

    async def check(self, address: Address) -> None:
        """Check the next hop at ``address`` now and apply its answer."""
        self.observe(address, await self._get(address, []))

    async def check_replica(self, replica: Replica) -> None:
        """Check an ejected ``replica`` through its worker now; a 200 ends its ejection."""
        status = await self._get(
            replica.worker, [(REPLICA_HEADER, replica.name.encode()), (TARGET_HEADER, replica.target)]
        )
        if status == 200:
            if self.detector.check_passed(replica.name, self.clock()):
                log.info("replica %r answers its health check again", replica.name)
        else:
            self._failed += 1

    async def run_round(self) -> None:
        """One round: check every next hop (unless polled elsewhere) and every ejected replica, at once."""
        now = self.clock()
        targets = set(self.targets())
        replicas = list(self.replicas()) if self.replicas is not None else []
        detector = self.detector
        members: set[Address | str] = {*targets, *(replica.name for replica in replicas)}
        if self._seen is not None:
            for member in members - self._seen:
                detector.joined(member, now)
            for member in self._seen - members:
                detector.forget(member)  # (held out by its checks, it would keep selection off its fast path)
        self._seen = members
        for address in [address for address in self._last if address not in targets]:
            del self._last[address]  # no longer listed
        async with trio.open_nursery() as nursery:
            if not self.polled:
                for address in targets:
                    nursery.start_soon(self.check, address)
            if self.config.replicas:
                for replica in {r.name: r for r in replicas if detector.out(r.name, now)}.values():
                    nursery.start_soon(self.check_replica, replica)
        self._rounds += 1
        done, self._round_done = self._round_done, trio.Event()
        done.set()

    async def _run_forever(self) -> None:
        # (first a tick later: a hop just started has its first requests open its pools)
        await every(self.config.interval, self.run_round, first=self.config.interval)


@asynccontextmanager
async def open_health_checker(
    upstreams: Upstreams,
    targets: Callable[[], Iterable[Address]],
    detector: OutlierDetector,
    config: HealthConfig | None = None,
    *,
    replicas: Callable[[], Iterable[Replica]] | None = None,
    polled: bool = False,
) -> AsyncIterator[HealthChecker]:
    """A running :class:`HealthChecker` for the ``async with`` block.

    ``targets()`` is read at the start of each round: the next hops to check
    (the proxy's workers; the edge's proxies), each over ``upstreams`` (the
    hop's own pools, so checks ride the connections requests use).
    ``detector`` is the one the hop selects with: it hears every answer.
    ``replicas()`` (optional, read each round) lists the replicas behind the
    targets; those the detector has ejected are checked through their
    worker. With ``polled``, another poller reports the targets'
    answers through :meth:`HealthChecker.observe` (the proxy's prober) and
    the checker sends them nothing itself. The first round starts one
    ``interval`` after the block does (so a hop's first requests, not its
    checks, open its pools); leaving the block stops the checker; errors from the body come out as
    they are, not wrapped.
    """
    checker = HealthChecker(upstreams, targets, detector, config or HealthConfig(), replicas=replicas, polled=polled)
    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(checker._run_forever)
            try:
                yield checker
            finally:
                nursery.cancel_scope.cancel()
