"""The fair scheduler: stream slots on pooled connections, shared out per tenant.

Its decision logic, :class:`FairQueue` (weighted deficit round robin, per-tenant
caps, bounded queues with deadlines), is sans-IO in ``_core.py``; the trio
driver, :class:`Scheduler` and :func:`open_scheduler`, waits and wakes in
``_driver.py``. See docs/scheduler.md.
"""

from blocks.scheduler._core import (
    FairQueue,
    Grant,
    QueueFull,
    QueueTimeout,
    SchedulerConfig,
    SchedulerStatistics,
    TenantPolicy,
    TenantStatistics,
    Ticket,
)
from blocks.scheduler._driver import Scheduler, TenantKey, header_tenant, open_scheduler, token_tenant

__all__ = [
    "FairQueue",
    "Grant",
    "QueueFull",
    "QueueTimeout",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStatistics",
    "TenantKey",
    "TenantPolicy",
    "TenantStatistics",
    "Ticket",
    "header_tenant",
    "open_scheduler",
    "token_tenant",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
