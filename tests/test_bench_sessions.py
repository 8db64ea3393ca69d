"""``bench/sessions.py --quick`` runs end to end and prints its figures in the form they are read in.

No figure is judged here (a benchmark prints figures; no test asserts on
wall-clock speed): the run must finish, print each measurement, and end
with one ``verdict:`` line that names every target, its exit code saying
the same as the verdict. It starts real processes on 127.0.0.1 (the chain,
demo replicas, an autoscaler's replicas) and h2load; without h2load
(``apt-get install nghttp2-client``) it is skipped. The codec is this
run's (``PROXYBLOCKS_CODEC``, which the bench's servers inherit).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

VERDICT = re.compile(
    r"verdict: (?P<verdict>PASS|FAIL) added p50 -?\d+ µs \(95% CI \[-?\d+, -?\d+\](, noise-dominated)?; "
    r"hops -?\d+ µs, in isolation -?[\d.]+ µs\) \(target <= 50\), "
    r"zero: served (?P<zero>\d+)/1000 errors (?P<zero_errors>\d+) \(target 0\), first response (nan|[\d.]+) s, "
    r"session starts at zero: served (?P<starts>\d+)/200 errors (?P<starts_errors>\d+), "
    r"capped at 50 per replica: served (?P<capped>\d+)/200 errors (?P<capped_errors>\d+) \(target 0\), "
    r"starts (nan|[\d,]+)/s, start p50 (nan|[\d.]+) ms p99 (nan|[\d.]+) ms"
)

SECTIONS = (
    "in isolation, in this process",
    "through the chain, one at a time",
    "per hop, in the chain",
    "session starts through the chain",
    "at zero, 1,000 requests",
    "at zero, 200 session starts, no cap",
    "at zero, 200 session starts, at most 50 per replica",
)


@pytest.mark.skipif(shutil.which("h2load") is None, reason="needs h2load (apt-get install nghttp2-client)")
def test_the_quick_run_prints_every_figure_and_one_verdict_line() -> None:
    done = subprocess.run(
        [sys.executable, "bench/sessions.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = done.stdout.splitlines()
    assert done.returncode in (0, 1), done.stdout[-4000:] + done.stderr[-4000:]
    assert [line for line in lines if line.startswith("verdict:")] == lines[-1:], done.stdout[-4000:]
    verdict = VERDICT.fullmatch(lines[-1])
    assert verdict is not None, lines[-1]
    assert (verdict["verdict"] == "PASS") == (done.returncode == 0)
    assert int(verdict["zero"]) + int(verdict["zero_errors"]) == 1000
    assert int(verdict["starts"]) + int(verdict["starts_errors"]) == 200
    assert int(verdict["capped"]) + int(verdict["capped_errors"]) == 200
    for section in SECTIONS:
        assert any(line.startswith(section) for line in lines), (section, done.stdout)
    assert "Traceback" not in done.stderr, done.stderr
