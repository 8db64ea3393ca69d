"""``python -m recipes.simulate``: two configurations side by side, the plot, and bad flags.

No trio and no socket: the recipe runs in virtual time. Runs are small
(a minute of simulated clients, two apps) and finish in a second or two.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from recipes import simulate as recipe

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--seconds", "60", "--apps", "2", "--rate", "10"]


def test_it_compares_two_targets_on_the_same_clients_and_plots_them(tmp_path: Path) -> None:
    lines: list[str] = []
    png = tmp_path / "sim.png"
    results = recipe.main([*SMALL, "--target", "1,4", "--plot", str(png)], report=lines.append)
    one, four = results
    assert (one.name, four.name) == ("least-in-flight target 1", "least-in-flight target 4")
    assert one.requests == four.requests > 0  # the same clients
    assert one.served + sum(one.refused.values()) + sum(one.timed_out.values()) == one.requests
    assert one.peak_replicas > four.peak_replicas  # a lower target keeps more replicas
    text = "".join(lines)
    for row in ("replica-seconds (cost)", "cold starts", "refused", "timed out", "queueing p50 / p99", "at 0s"):
        assert row in text
    assert re.search(r"tenant default +\S+ / \S+ +\S+ / \S+", text)
    assert f"plot written to {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_it_compares_two_policies_with_a_noisy_tenant_sessions_and_a_fair_queue() -> None:
    results = recipe.main(
        [
            *SMALL,
            "--policy",
            "least-in-flight,power-of-two",
            "--target",
            "2",
            "--pattern",
            "noisy",
            "--budget",
            "16",
            "--sessions",
        ],
        report=lambda text: None,
    )
    assert [r.name for r in results] == ["least-in-flight target 2", "power-of-two target 2"]
    assert all(set(r.tenants) == {"default", "noisy"} for r in results)
    assert all(r.sessions > 0 for r in results)


def test_a_trace_runs_as_given(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("time,tenant,app,session,size\n" + "".join(f"{i / 10},t,a,,1\n" for i in range(50)))
    (result,) = recipe.main(["--trace", str(trace), "--target", "2"], report=lambda text: None)
    assert result.requests == result.served == 50
    assert result.cold_starts >= 1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--policy", "fastest"], "'fastest' is not a policy"),
        (["--target", "1,2,3"], "is one value or two"),
        (["--rate", "-1"], "--rate"),
        (["--pattern", "weekly"], "--pattern"),
        (["--trace", "/nonexistent/trace.csv"], "/nonexistent/trace.csv"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_code_2(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "recipes.simulate", *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith("proxyblocks: error: "), done.stderr
    assert message in done.stderr
