"""The concurrency prober: replicas' free concurrency, merged with the routing decisions made since.

The load report format, the estimator (:class:`LoadEstimator`), the
:class:`ProberAware` policy and the autoscale signal are sans-IO in
``_core.py``; the trio driver that polls every worker (:class:`Prober`,
:func:`open_prober`) is ``_driver.py``; the active health checker that
feeds an outlier detector (:class:`HealthChecker`, :func:`open_health_checker`)
is ``_health.py``. See docs/prober.md.
"""

from blocks.fields import HEALTH_PATH, LOAD_PATH, PROBE_HEADER
from blocks.prober._core import (
    LoadEstimator,
    LoadReport,
    LoadStatistics,
    ProberAware,
    ProberConfig,
    ReplicaEstimate,
    ReplicaLoad,
    encode_load,
    parse_load,
)
from blocks.prober._core_signal import AppAutoscale, AutoscaleConfig, AutoscaleSignal, AutoscaleStatistics
from blocks.prober._driver import Prober, ProberStatistics, WorkerProbeStatistics, load_response, open_prober
from blocks.prober._health import HealthChecker, HealthConfig, HealthStatistics, open_health_checker

__all__ = [
    "HEALTH_PATH",
    "LOAD_PATH",
    "PROBE_HEADER",
    "AppAutoscale",
    "AutoscaleConfig",
    "AutoscaleSignal",
    "AutoscaleStatistics",
    "LoadEstimator",
    "LoadReport",
    "LoadStatistics",
    "Prober",
    "ProberAware",
    "ProberConfig",
    "ProberStatistics",
    "ReplicaEstimate",
    "ReplicaLoad",
    "WorkerProbeStatistics",
    "HealthChecker",
    "HealthConfig",
    "HealthStatistics",
    "open_health_checker",
    "encode_load",
    "load_response",
    "open_prober",
    "parse_load",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
