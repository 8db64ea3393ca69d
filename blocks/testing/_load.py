"""A tenant load generator: what the noisy-neighbour recipe and the fairness benchmark send.

Each request goes through an edge with the library's own pooled client
(:func:`~blocks.open_upstreams`), carrying its tenant in ``x-tenant``; a
:class:`TenantLoad` counts the statuses (0: no response at all) and the
latencies of the 200s. :func:`flood` keeps a number of requests in flight,
:func:`steady` paces them; both run until cancelled.
"""

from __future__ import annotations

import collections
import math
from time import perf_counter

import attrs
import trio
import trio.lowlevel

from blocks.errors import BlocksError
from blocks.http import Request
from blocks.routing import Address
from blocks.transport.multiplexer import Upstreams

SLEEP_20MS = b"/sleep?ms=20"
"""The demo replica's 20 ms request: what the load sends by default."""


@attrs.define(eq=False)
class TenantLoad:
    """What one tenant saw: a status per request (0: no response at all) and latencies of the 200s."""

    name: str
    statuses: collections.Counter[int] = attrs.field(factory=collections.Counter)
    latencies: list[float] = attrs.field(factory=list)

    def record(self, status: int, seconds: float) -> None:
        self.statuses[status] += 1
        if status == 200:
            self.latencies.append(seconds)

    def percentile(self, fraction: float) -> float:
        """Latency of the 200s at ``fraction`` (nearest rank), in seconds; NaN if none."""
        if not self.latencies:
            return math.nan
        ordered = sorted(self.latencies)
        return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]

    def line(self) -> str:
        statuses = " ".join(f"{code}:{n}" for code, n in sorted(self.statuses.items()))
        return (
            f"{self.name:>6}  {sum(self.statuses.values()):6d} requests  [{statuses}]  "
            f"p50 {self.percentile(0.5) * 1000:7.1f} ms  p99 {self.percentile(0.99) * 1000:7.1f} ms"
        )


async def tenant_request(upstreams: Upstreams, edge: Address, tenant: TenantLoad, path: bytes) -> None:
    """One GET of ``path`` through ``edge`` as ``tenant`` (``x-tenant``); its status and time go to ``tenant``."""
    start = perf_counter()
    try:
        response = await upstreams.request(
            edge, Request(b"GET", b"http", b"demo.local", path), [(b"x-tenant", tenant.name.encode())]
        )
        await response.body.read_all()
        status = response.status
    except BlocksError:
        status = 0  # counted: the request got no response
    tenant.record(status, perf_counter() - start)


async def flood(
    upstreams: Upstreams, edge: Address, tenant: TenantLoad, concurrency: int, path: bytes = SLEEP_20MS
) -> None:
    """Keep ``concurrency`` requests to ``path`` in flight as ``tenant``, forever."""

    async def loop() -> None:
        while True:
            await tenant_request(upstreams, edge, tenant, path)
            if tenant.statuses[200] == 0:
                await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(loop)


async def steady(
    upstreams: Upstreams, edge: Address, tenant: TenantLoad, rate: float, path: bytes = SLEEP_20MS
) -> None:
    """Start one request to ``path`` as ``tenant`` every ``1/rate`` seconds, however long each takes. Forever."""
    async with trio.open_nursery() as nursery:
        next_at = trio.current_time()
        while True:
            nursery.start_soon(tenant_request, upstreams, edge, tenant, path)
            next_at += 1 / rate
            await trio.sleep_until(next_at)
