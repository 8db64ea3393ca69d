"""The autoscaler: replicas started and drained from the load, 0 -> N -> 0.

The policy is sans-IO in ``_core.py`` (:class:`AutoscalePolicy`,
:class:`ScalingConfig`, :class:`Decision`); the trio driver that starts and
drains real replica processes and writes them into the routes is
``_driver.py`` (:func:`open_autoscaler`, :class:`ReplicaTemplate`,
:class:`DriverConfig`). See docs/autoscaler.md.
"""

from blocks.autoscaler._config import AppDriverStatistics, DriverConfig, DriverStatistics, ReplicaTemplate
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
from blocks.autoscaler._driver import Autoscaler, open_autoscaler, serve_autoscaler
from blocks.autoscaler._gate import ColdStartGate

__all__ = [
    # the policy (sans-IO)
    "AppScalingStatistics",
    "AutoscalePolicy",
    "AutoscalerStatistics",
    "ColdStart",
    "Decision",
    "Phase",
    "ReplicaStatistics",
    "ScalingConfig",
    # the driver
    "AppDriverStatistics",
    "Autoscaler",
    "DriverConfig",
    "DriverStatistics",
    "ReplicaTemplate",
    "open_autoscaler",
    "serve_autoscaler",
    # the proxy's side of a cold start
    "ColdStartGate",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
