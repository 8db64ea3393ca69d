"""Reading results: runs side by side as text, and a PNG of replicas and latency over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from blocks.simulate._result import SimResult


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1.0:
        return f"{value * 1000:.1f}ms"
    return f"{value:.2f}s"


def _pair(low: float | None, high: float | None) -> str:
    return f"{_seconds(low)} / {_seconds(high)}"


def _reasons(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    if not total:
        return "0"
    return f"{total} (" + ", ".join(f"{reason} {n}" for reason, n in counts.items()) + ")"


def replicas_at(result: SimResult, time: float) -> int:
    """The replica count (starting, ready and draining) at ``time``, from ``replica_changes``."""
    count = 0
    for at, n in result.replica_changes:
        if at > time:
            break
        count = n
    return count


def format_results(results: Sequence[SimResult], *, points: int = 12) -> str:
    """The runs side by side, one column each: outcomes, cost, percentiles per tenant, replicas over time.

    Percentiles are ``p50 / p99``; queueing is from arrival to the start of
    service. ``points`` rows of the replica count over time close the table.
    """
    names = [result.name for result in results]
    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(r.requests) for r in results]),
        ("served", [str(r.served) for r in results]),
        ("refused", [_reasons(r.refused) for r in results]),
        ("timed out", [_reasons(r.timed_out) for r in results]),
    ]
    if any(r.unfinished for r in results):
        rows.append(("unfinished", [str(r.unfinished) for r in results]))
    rows += [
        ("replica-seconds (cost)", [f"{r.replica_seconds:.1f}" for r in results]),
        ("cold starts", [str(r.cold_starts) for r in results]),
        ("cold waits", [str(r.cold_waits) for r in results]),
        ("peak replicas", [str(r.peak_replicas) for r in results]),
    ]
    if any(r.sessions for r in results):
        rows.append(("sessions", [str(r.sessions) for r in results]))
    rows.append(("queueing p50 / p99", [_pair(r.queueing_p50, r.queueing_p99) for r in results]))
    tenants = sorted({tenant for r in results for tenant in r.tenants})
    for tenant in tenants:
        rows.append(
            (
                f"  tenant {tenant}",
                [
                    _pair(r.tenants[tenant].queueing_p50, r.tenants[tenant].queueing_p99)
                    if tenant in r.tenants
                    else "-"
                    for r in results
                ],
            )
        )
    rows.append(("latency p50 / p99", [_pair(r.latency_p50, r.latency_p99) for r in results]))
    end = max((r.end for r in results), default=0.0)
    if points > 0 and end > 0:
        rows.append(("replicas over time", [""] * len(results)))
        for i in range(points + 1):
            time = end * i / points
            rows.append((f"  at {time:.0f}s", [str(replicas_at(r, time)) for r in results]))
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(name), *(len(values[i]) for _, values in rows)) for i, name in enumerate(names)]
    lines = [" " * label_width + "".join(f"  {name:>{w}}" for name, w in zip(names, widths, strict=True))]
    for label, values in rows:
        lines.append(f"{label:<{label_width}}" + "".join(f"  {v:>{w}}" for v, w in zip(values, widths, strict=True)))
    return "\n".join(lines) + "\n"


def plot(results: Sequence[SimResult], path: str | Path) -> None:
    """A PNG at ``path``: replicas over time above, latency p50 and p99 over time below, a line per run.

    Needs matplotlib (the ``sim`` extra: ``pip install proxyblocks[sim]``);
    without it, ``ImportError`` says so.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - the test extra has it
        raise ImportError("plotting needs matplotlib: pip install 'proxyblocks[sim]'") from exc
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 7))
    for result in results:
        times = [t for t, _ in result.replica_changes]
        counts = [n for _, n in result.replica_changes]
        (line,) = top.step(times, counts, where="post", label=result.name)
        served = [s for s in result.timeline if s.latency_p50 is not None]
        bottom.plot(
            [s.time for s in served],
            [s.latency_p50 for s in served],
            color=line.get_color(),
            label=f"{result.name} p50",
        )
        bottom.plot(
            [s.time for s in served],
            [s.latency_p99 for s in served],
            color=line.get_color(),
            linestyle="--",
            label=f"{result.name} p99",
        )
    top.set_ylabel("replicas")
    top.set_title("replicas (starting, ready, draining) over time")
    top.legend()
    bottom.set_ylabel("latency (s)")
    bottom.set_yscale("log")
    bottom.set_xlabel("simulated time (s)")
    bottom.set_title("latency of the requests served in each sample")
    bottom.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
