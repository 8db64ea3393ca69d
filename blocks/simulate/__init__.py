"""The simulator: the library's own policies, fair queue, session placer and autoscaler, in virtual time.

See docs/simulator.md.
"""

from blocks.simulate._engine import Sample, SimResult, Simulation, SimulationLimit, TenantResult, simulate
from blocks.simulate._histogram import Histogram
from blocks.simulate._model import POLICIES, ReplicaModel, ServiceTime, SimConfig
from blocks.simulate._report import format_results, plot, replicas_at
from blocks.simulate._workload import (
    PATTERNS,
    TRACE_FIELDS,
    Arrival,
    Bursts,
    Diurnal,
    Ramp,
    Shape,
    Steady,
    TraceError,
    Traffic,
    Workload,
    pattern,
    read_trace,
    write_trace,
)

__all__ = [
    # running
    "SimConfig",
    "POLICIES",
    "ReplicaModel",
    "ServiceTime",
    "Simulation",
    "SimulationLimit",
    "simulate",
    # clients
    "Arrival",
    "Workload",
    "PATTERNS",
    "pattern",
    "Traffic",
    "Shape",
    "Steady",
    "Bursts",
    "Diurnal",
    "Ramp",
    "TRACE_FIELDS",
    "TraceError",
    "read_trace",
    "write_trace",
    # results
    "SimResult",
    "TenantResult",
    "Sample",
    "Histogram",
    "format_results",
    "plot",
    "replicas_at",
]
