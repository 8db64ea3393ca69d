"""The simulator: the library's own policies, fair queue, session placer and autoscaler, in virtual time.

See docs/simulator.md. The engine is :class:`Simulation`.

Theory of operation
-------------------

Virtual time is a heap of ``(time, seq, kind, thing)`` events; the
workload's arrivals are read one at a time beside it (never pushed), so the
heap holds only what is in flight: service completions, cold starts,
deadlines, idle sessions and the two periodic rounds. Each event runs to
completion at its instant; ``seq`` makes ties run in the order they were
scheduled, so a run is a function of its configuration, workload and seed.

A request's path is the chain's, with the same objects deciding:

1. **Scale from zero.** An app with no ready replica: the request (or its
   session's start) waits, up to ``cold_start_timeout``, for the first
   replica, whose start is shared by every waiter (single flight).
2. **Session start** (a sessioned app's first request of a session): the
   :class:`~blocks.sessions.SessionPlacer` reserves a place, or the start
   waits in its fair, bounded queue. The simulated worker opens the session
   at once and answers with its counts, as a real worker's 201.
3. **Admission**: the :class:`~blocks.scheduler.FairQueue` grants a slot at
   once (``try_acquire``) or queues the request (``enqueue``; 429 when
   full, 503 at its deadline). The slot is held until the response is done.
4. **Routing**: a session's request goes to its replica; any other to the
   policy's ``pick`` among the app's ready replicas, given the in-flight
   counts per replica, as the proxy's.
5. **The replica** serves ``concurrency`` requests at once; others wait in
   its FIFO, in flight all the same (as a real server's backlog).

The autoscaler is the library's :class:`~blocks.autoscaler.AutoscalePolicy`,
told of every replica's life as the real driver tells it (``starting``,
``ready``, ``draining``, ``gone``), touched by every request, asked by a
request that finds no ready replica (``request``: start one, or wait for
the one starting), and every ``interval`` given each app's in-flight total
(sessions hosted, for a sessioned app: ``record``) and asked to ``decide``:
the replicas it says to start start (each a cold start), those it says to
drain leave the routes at once, finish what they hold, and stop when they
hold nothing (a starting one stops at once). One policy serves every app:
the simulator adds an app at its first request (a trace names its apps as
it goes), with its config.

Invariants (the tests check them): every arrival ends exactly once, as
served, refused or timed out (or is left unfinished by a run cut short at
``until``); a replica never serves more than ``concurrency`` at once; a
replica is billed from its start (cold start included) to its stop, so
replica-seconds are the integral of the replica count over time.
"""

from blocks.simulate._engine import Simulation, simulate
from blocks.simulate._histogram import Histogram
from blocks.simulate._model import POLICIES, ReplicaModel, ServiceTime, SimConfig
from blocks.simulate._report import format_results, plot, replicas_at
from blocks.simulate._result import Sample, SimResult, SimulationLimit, TenantResult
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

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
