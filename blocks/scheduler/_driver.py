"""The fair scheduler's trio driver: :class:`Scheduler` and tenant keys.

The decisions are made by the sans-IO :class:`~blocks.scheduler._core.FairQueue`
(see :mod:`blocks.scheduler._core` for the theory, the guarantees and why deficit
round robin); this module puts it on trio's clock, lets a request wait its
turn without a cancel scope per waiter, and reads tenants from requests.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, cast

import outcome
import trio

from blocks._sync import Signal, one_error
from blocks.scheduler._core import (
    FairQueue,
    Grant,
    QueueFull,
    QueueTimeout,
    SchedulerConfig,
    SchedulerStatistics,
    Ticket,
)

if TYPE_CHECKING:
    from blocks.http import Request


log = logging.getLogger("blocks.scheduler")

_QUIET = 5.0
"""Seconds without a refusal after which a tenant the scheduler refused is logged as admitted again."""


# -- the trio driver --------------------------------------------------------------------------


class Scheduler:
    """A :class:`FairQueue` on trio's clock, with waiting. Use :func:`open_scheduler`.

    The pool asks it before opening a stream::

        grant = scheduler.try_acquire(tenant)      # the hot path: sync, no wait
        if grant is None:
            grant = await scheduler.acquire(tenant)  # waits its turn, or 429/503
        try:
            ...open the stream; hand scheduler.release(grant) to call_on_close...
        except BaseException:
            scheduler.release(grant)
            raise

    Deadlines are enforced by one background task of :func:`open_scheduler`
    that sleeps until the earliest one, not by a cancel scope per waiter.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._queue = FairQueue(config)
        self._waiters: dict[Ticket, trio.lowlevel.Task] = {}
        self._wake = Signal()
        self._armed = math.inf
        self._running = False
        self._refusing: dict[str, float] = {}  # tenant -> when it was last refused (warned once)

    def __repr__(self) -> str:
        return f"<Scheduler {self._queue!r} waiters={len(self._waiters)}>"

    def try_acquire(self, tenant: str) -> Grant | None:
        """A slot now, or ``None``: a plain synchronous call, never a checkpoint."""
        grant = self._queue.try_acquire(tenant)
        if self._refusing and grant is not None:
            self._admitted(tenant)
        return grant

    async def acquire(self, tenant: str) -> Grant:
        """A slot for ``tenant``, waiting its turn if need be.

        Raises :class:`QueueFull` (429) at once when the tenant's queue is
        full, :class:`QueueTimeout` (503) when its ``queue_timeout`` passes
        first, ``trio.ClosedResourceError`` if the scheduler is closed while
        waiting. Always a checkpoint. Cancel-safe: cancelled while waiting, the
        request leaves the queue and holds nothing; once this returns, the
        caller holds the grant and must release it.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        queue = self._queue
        grant = queue.try_acquire(tenant)
        if grant is None:
            if not self._running:
                raise trio.ClosedResourceError("the scheduler is not running: use open_scheduler")
            try:
                ticket = queue.enqueue(tenant, trio.current_time())
            except QueueFull as exc:
                self._refused(tenant, exc)
                await trio.lowlevel.cancel_shielded_checkpoint()
                raise
            if ticket.grant is None:
                return await self._wait(ticket)
            grant = ticket.grant
        if self._refusing:
            self._admitted(tenant)
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()
        except BaseException:
            self.release(grant)
            raise
        return grant

    def _refused(self, tenant: str, error: BaseException) -> None:
        """A warning when ``tenant`` starts being refused; later refusals only move its quiet period."""
        if tenant not in self._refusing:
            log.warning("scheduler: refusing tenant %r (%s)", tenant, error)
        self._refusing[tenant] = trio.current_time()

    def _admitted(self, tenant: str) -> None:
        """``tenant`` got a slot: if it was refused, and not for _QUIET seconds, it is admitted again."""
        since = self._refusing.get(tenant)
        if since is not None and trio.current_time() - since >= _QUIET:
            del self._refusing[tenant]
            log.warning("scheduler: admitting tenant %r again", tenant)

    async def _wait(self, ticket: Ticket) -> Grant:
        self._waiters[ticket] = trio.lowlevel.current_task()
        if ticket.deadline < self._armed:
            self._wake.set()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._waiters.pop(ticket, None)
            if not self._queue.cancel(ticket) and ticket.grant is not None:
                # Granted but not delivered: cannot happen with this driver,
                # which grants and wakes in one step; never leak the slot.
                self.release(ticket.grant)
            return trio.lowlevel.Abort.SUCCEEDED

        return cast(Grant, await trio.lowlevel.wait_task_rescheduled(abort))

    def release(self, grant: Grant) -> None:
        """Give a slot back and wake the waiters it goes to. Sync; releasing twice is harmless."""
        queue = self._queue
        if not queue.queued:
            # Nobody waits, so nobody is granted and ``now`` is not read:
            # the hot path skips the clock.
            queue.release(grant, 0.0)
            return
        for ticket in queue.release(grant, trio.current_time()):
            task = self._waiters.pop(ticket, None)
            if task is None:  # its owner is gone (cannot happen; see _wait)
                self.release(cast(Grant, ticket.grant))
            else:
                if self._refusing:
                    self._admitted(ticket.tenant)
                trio.lowlevel.reschedule(task, outcome.Value(ticket.grant))

    def statistics(self) -> SchedulerStatistics:
        return self._queue.statistics()

    async def _expire_forever(self) -> None:
        queue = self._queue
        while True:
            deadline = queue.next_deadline()
            self._armed = math.inf if deadline is None else deadline
            with trio.move_on_at(self._armed):
                await self._wake.wait()
            for ticket in queue.expire(trio.current_time()):
                task = self._waiters.pop(ticket, None)
                if task is not None:
                    policy = ticket._state.policy
                    error = QueueTimeout(
                        f"tenant {ticket.tenant!r} waited {policy.queue_timeout}s for an upstream slot",
                        tenant=ticket.tenant,
                        retry_after=policy.retry_after,
                    )
                    self._refused(ticket.tenant, error)
                    trio.lowlevel.reschedule(task, outcome.Error(error))

    def _close(self) -> None:
        self._running = False
        waiters, self._waiters = self._waiters, {}
        for ticket, task in waiters.items():
            self._queue.cancel(ticket)
            trio.lowlevel.reschedule(task, outcome.Error(trio.ClosedResourceError("the scheduler was closed")))


@asynccontextmanager
async def open_scheduler(config: SchedulerConfig) -> AsyncIterator[Scheduler]:
    """A running :class:`Scheduler` for the ``async with`` block.

    Owns one task that expires overdue waiters. Leaving the block fails the
    requests still waiting with ``trio.ClosedResourceError``; grants held
    may still be released afterwards.
    """
    scheduler = Scheduler(config)
    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(scheduler._expire_forever)
            scheduler._running = True
            try:
                yield scheduler
            finally:
                scheduler._close()
                nursery.cancel_scope.cancel()


# -- tenant keys ------------------------------------------------------------------------------

TenantKey = Callable[["Request"], str]
"""Which tenant a request belongs to: a header, a token's tenant claim, the app..."""


def token_tenant(fallback: TenantKey | None = None) -> TenantKey:
    """A :data:`TenantKey` that reads the ``tenant`` claim of the request's verified token.

    A proxy with :class:`~blocks.tokens.ProxyAuth` checks the token before
    admission, so the scheduler sees a tenant the client cannot choose. A
    request without verified claims (an app that needs no token) is keyed
    by ``fallback`` (default: :func:`header_tenant`).
    """
    other = fallback or header_tenant()

    def key(request: Request) -> str:
        exchange = request.exchange
        claims = exchange.claims if exchange is not None else None
        if claims is not None and claims.tenant:
            tenant: str = claims.tenant
            return tenant
        return other(request)

    return key


def header_tenant(name: bytes = b"x-tenant", default: str = "default", *, max_length: int = 64) -> TenantKey:
    """A :data:`TenantKey` that reads header ``name`` (latin-1).

    An absent, empty or longer than ``max_length`` value gives ``default``,
    so that a client cannot grow the tenant table with huge keys. Trust the
    header only if a hop you run sets it (or strips it from clients): anyone
    who can pick their tenant can pick many and take many shares.
    """
    name = name.lower()

    def key(request: Request) -> str:
        for field, value in request.headers:
            if field == name:
                if 0 < len(value) <= max_length:
                    return value.decode("latin-1")
                return default
        return default

    return key
