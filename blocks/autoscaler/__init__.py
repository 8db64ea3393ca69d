"""The autoscaler: replicas started and drained from the load, 0 -> N -> 0.

The policy is sans-IO in ``_core.py`` (:class:`AutoscalePolicy`,
:class:`ScalingConfig`, :class:`Decision`). See docs/autoscaler.md.
"""

from blocks.autoscaler._core import (
    AppScalingStatistics,
    AutoscalePolicy,
    AutoscalerStatistics,
    ColdStart,
    Decision,
    Phase,
    ReplicaStatistics,
    ScalingConfig,
)

__all__ = [
    "AppScalingStatistics",
    "AutoscalePolicy",
    "AutoscalerStatistics",
    "ColdStart",
    "Decision",
    "Phase",
    "ReplicaStatistics",
    "ScalingConfig",
]
