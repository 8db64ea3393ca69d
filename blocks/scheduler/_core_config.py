"""The fair scheduler's knobs, errors and snapshots: the data its sans-IO core reads and returns.

:class:`TenantPolicy` and :class:`SchedulerConfig` say what the core
(:mod:`blocks.scheduler._core`) must enforce; :class:`QueueFull` (429) and
:class:`QueueTimeout` (503) are what it answers when it cannot;
:class:`TenantStatistics` and :class:`SchedulerStatistics` are the frozen
snapshots its ``statistics()`` returns.

Invariants: every value here is immutable once made (frozen attrs classes,
a read-only copy of the tenant map), and validated where it is made, so the
core never checks a number it was given. Like the core, this module is
sans-IO: no trio, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import attrs

from blocks._common import finite

if TYPE_CHECKING:
    pass

# -- configuration --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TenantPolicy:
    """How one tenant (or every tenant without a policy of its own) is treated.

    - ``weight``: its share of the slots relative to the other backlogged
      tenants of its priority class.
    - ``max_in_flight``: at most this many slots at once (``None``: only the
      budget limits it).
    - ``max_queued``: at most this many requests waiting; one more is a 429
      (:class:`QueueFull`). ``0`` means never wait: no free slot is a 429.
    - ``queue_timeout``: seconds a request may wait; past it, a 503
      (:class:`QueueTimeout`).
    - ``priority``: its class; lower is served first, strictly.
    - ``retry_after``: seconds to put in ``retry-after`` on a rejection.
    """

    weight: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    max_in_flight: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(1)))
    max_queued: int = attrs.field(default=100, validator=attrs.validators.ge(0))
    queue_timeout: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    priority: int = 0
    retry_after: float = attrs.field(default=1.0, validator=[attrs.validators.ge(0), finite])


def _read_only(tenants: Mapping[str, TenantPolicy]) -> Mapping[str, TenantPolicy]:
    return MappingProxyType(dict(tenants))


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """The slots of one upstream and the policies of the tenants sharing them.

    - ``budget``: total slots (streams open upstream at once).
    - ``default_policy``: for every tenant not named in ``tenants``.
    - ``tenants``: tenant key -> its own policy (copied, read-only).
    - ``quantum``: credit per round-robin turn, in grants per unit of weight
      (raised to ``1 / smallest weight`` if lower; see the module docstring).
    - ``max_tenants``: tenant states remembered (with their counters); past
      it, a new tenant replaces an idle one not used recently.
    - ``wait_samples``: recent queue waits kept per tenant for percentiles.
    """

    budget: int = attrs.field(validator=attrs.validators.ge(1))
    default_policy: TenantPolicy = attrs.field(
        factory=TenantPolicy, validator=attrs.validators.instance_of(TenantPolicy)
    )
    tenants: Mapping[str, TenantPolicy] = attrs.field(
        factory=dict,
        converter=_read_only,
        validator=attrs.validators.deep_mapping(
            key_validator=attrs.validators.instance_of(str),
            value_validator=attrs.validators.instance_of(TenantPolicy),
        ),
    )
    quantum: float = attrs.field(default=1.0, validator=[attrs.validators.gt(0), finite])
    max_tenants: int = attrs.field(default=10_000, validator=attrs.validators.ge(1))
    wait_samples: int = attrs.field(default=256, validator=attrs.validators.ge(1))

    def policy(self, tenant: str) -> TenantPolicy:
        """The policy that applies to ``tenant``."""
        return self.tenants.get(tenant, self.default_policy)

    def split(self, processes: int, index: int) -> SchedulerConfig:
        """Process ``index``'s share of this config, one of ``processes`` processes serving the same
        port (``--processes N``), so that together they admit what one process did.

        The budget and every policy's ``max_in_flight`` and ``max_queued``
        are divided among the processes: each gets ``cap // processes``, and
        the first ``cap % processes`` of them one more, so the shares add up
        to ``cap`` (5 over 2: 3 and 2). A share is at least 1, so with more
        processes than a cap they admit one each (``processes`` in all); a
        ``max_queued`` of 0 (never wait) stays 0, and no ``max_in_flight``
        stays none. Weights, timeouts and priorities are kept.
        ``split(1, 0)`` is this config.
        """
        if processes < 1:
            raise ValueError(f"processes must be at least 1, not {processes}")
        if not 0 <= index < processes:
            raise ValueError(f"index must be from 0 to {processes - 1}, not {index}")
        if processes == 1:
            return self

        def share(cap: int) -> int:
            return max(1, cap // processes + (index < cap % processes))

        def policy_share(policy: TenantPolicy) -> TenantPolicy:
            cap = policy.max_in_flight
            return attrs.evolve(
                policy,
                max_in_flight=None if cap is None else share(cap),
                max_queued=policy.max_queued and share(policy.max_queued),
            )

        return attrs.evolve(
            self,
            budget=share(self.budget),
            default_policy=policy_share(self.default_policy),
            tenants={name: policy_share(policy) for name, policy in self.tenants.items()},
        )


# -- statistics -------------------------------------------------------------------------------


@attrs.frozen
class TenantStatistics:
    """One tenant's counters.

    ``queued`` is the tickets waiting now; ``granted`` counts every grant,
    immediate or after a wait; ``waited`` the requests that had to wait in
    the queue (however their wait ended); ``rejected_full`` the 429s,
    ``rejected_deadline`` the 503s. The wait
    percentiles (seconds, nearest rank) are over the most recent grants that
    had to queue (``None`` if none did); an immediate grant waits no time and
    is not sampled.
    """

    in_flight: int
    queued: int
    granted: int
    rejected_full: int
    rejected_deadline: int
    waited: int
    queue_wait_p50: float | None
    queue_wait_p99: float | None


@attrs.frozen
class SchedulerStatistics:
    """A snapshot of a :class:`FairQueue` (or :class:`Scheduler`).

    The totals include tenants whose idle state was forgotten; ``tenants``
    holds the ones still remembered.
    """

    budget: int
    in_flight: int
    queued: int
    granted: int
    rejected_full: int
    rejected_deadline: int
    waited: int
    tenants: Mapping[str, TenantStatistics]
