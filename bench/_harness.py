"""What the benchmarks share: server processes, h2load runs and their figures, small statistics.

Not a benchmark itself, so it prints no ``verdict:`` line; each benchmark
that imports it (``bench/chain.py``, ``bench/fairness.py``,
``bench/mirror.py``, run as scripts from the repository root) ends with its own.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


def serve_role(role: str, port: int, upstream: list[int], scheduler: Any = None) -> None:
    """Run one proxyblocks server until interrupted (a benchmark's ``--serve`` mode).

    ``replica PORT | worker PORT REPLICA | proxy PORT WORKER REPLICA | edge PORT PROXY``, or
    ``chain PORT REPLICA`` (edge, proxy and worker in one process, as the chain recipe runs them);
    a role ending in ``+observed`` runs with an admin port (every hop counting its requests) and an
    access log (to ``$PROXYBLOCKS_BENCH_ACCESS_LOG``, else ``/dev/null``);
    ``scheduler`` is the proxy's ``SchedulerConfig`` (tenant: ``x-tenant``), if any.
    """
    sys.path.insert(0, str(ROOT))
    import trio

    import blocks.testing

    server: Any
    if role == "replica":
        # A reference hop opens one upstream connection and cannot reopen it: keep it
        # open however long the rounds leave it idle.
        config = blocks.ListenerConfig(h2_idle_timeout=86400.0)
        server = functools.partial(blocks.testing.serve_demo_replica, "r0", host=HOST, port=port, config=config)
    elif role.removesuffix("+observed") in ("worker", "proxy", "edge", "chain"):
        server = functools.partial(_serve_part, role, port, upstream, scheduler)
    else:
        raise SystemExit(f"unknown role {role!r}")
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(server)


async def _serve_part(role: str, port: int, upstream: list[int], scheduler: Any) -> None:
    """One part of a chain on ``port``, or edge, proxy and worker in one process (``chain``), built with
    the topology kit as ``recipes/chain.py`` builds them, in front of replica ``r0``."""
    import trio

    import blocks
    import blocks.command

    operations = None
    if role.endswith("+observed"):  # the admin listener (every hop counting) and an access log
        role = role.removesuffix("+observed")
        log = Path(os.environ.get("PROXYBLOCKS_BENCH_ACCESS_LOG", os.devnull))
        operations = blocks.command.Operations(admin_port=0, access_log=str(log))
    async with blocks.open_chain(host=HOST, operations=operations) as chain:
        replicas = {"r0": blocks.LocalReplica((HOST, upstream[-1]), "h2")}
        if role in ("worker", "chain"):
            await chain.start_worker(replicas, port=port if role == "worker" else 0)
        if role == "proxy":
            chain.store.transact(blocks.route_records("demo", replicas, worker=(HOST, upstream[0]), domains=["*"]))
        if role in ("proxy", "chain"):
            await chain.start_proxy(port=port if role == "proxy" else 0, scheduler=scheduler)
        if role in ("edge", "chain"):
            await chain.start_edge(port=port, proxy=(HOST, upstream[0]) if role == "edge" else None)
        if operations is not None:
            admin = await chain.start_admin(port=0)
            print(f"admin listening on http://{HOST}:{admin.port}", flush=True)
        await trio.sleep_forever()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Process:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        text = self.log.read_text(errors="replace").rstrip()
        return "\n".join(text.splitlines()[-lines:])


class Processes:
    """Every process this run started, killed by handle on the way out."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.all: list[Process] = []

    def _spawn(
        self, name: str, argv: list[str], stdout: int | None = None, cwd: Path = ROOT, python: bool = True
    ) -> Process:
        log = self.logdir / f"{len(self.all):02d}-{name.replace(' ', '_')}.log"
        with log.open("wb") as out:
            # own session: a Ctrl-C reaches only this script, which then kills the others itself
            popen = subprocess.Popen(
                [sys.executable, *argv] if python else argv,
                cwd=cwd,
                stdout=out if stdout is None else stdout,
                stderr=subprocess.STDOUT if stdout is None else out,
                start_new_session=True,
            )
        proc = Process(name, popen, log)
        self.all.append(proc)
        return proc

    def start(self, name: str, argv: list[str], port: int, cwd: Path = ROOT, python: bool = True) -> Process:
        """A server (``argv`` after the interpreter, or a whole command line if not ``python``),
        run in ``cwd``: returns once it listens on ``port``."""
        proc = self._spawn(name, argv, cwd=cwd, python=python)
        wait_for_port(proc, port)
        return proc

    def spawn(self, name: str, argv: list[str]) -> Process:
        """A one-shot helper running beside this script; read its stdout with ``proc.popen.communicate()``."""
        return self._spawn(name, argv, stdout=subprocess.PIPE)

    def run(self, name: str, argv: list[str], timeout: float) -> tuple[int | None, str, Process]:
        """A one-shot helper: (exit code, or None if it had to be killed; its stdout; the process)."""
        proc = self.spawn(name, argv)
        try:
            out, _ = proc.popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            out, _ = proc.popen.communicate()
            return None, out.decode(errors="replace"), proc
        return proc.popen.returncode, out.decode(errors="replace"), proc

    def stop(self, procs: list[Process]) -> None:
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.terminate()
        for proc in procs:
            try:
                proc.popen.wait(timeout=3)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()

    def stop_all(self) -> None:
        self.stop(self.all)


def wait_for_port(proc: Process, port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before listening:\n{proc.tail()}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} not listening on {port} after {timeout}s:\n{proc.tail()}") from None
            time.sleep(0.05)


def h2load(
    port: int, args: list[str], timeout: float, log_file: Path | None = None, *, path: str = "/"
) -> tuple[str, list[str]]:
    """Run h2load on ``path``; return its output and what went wrong (failed/errored/non-2xx/hang)."""
    argv = ["h2load", *args]
    if log_file is not None:
        argv.append(f"--log-file={log_file}")
    argv.append(f"http://{HOST}:{port}{path}")
    what = " ".join(argv[1:-1])
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        return out, [f"h2load {what}: no answer within {timeout:.0f}s (hang)"]
    out = run.stdout + run.stderr
    problems = []
    counts = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
        r"(\d+) failed, (\d+) errored, (\d+) timeout",
        out,
    )
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if run.returncode != 0 or counts is None or codes is None:
        problems.append(f"h2load {what}: exit {run.returncode}, unreadable output")
    else:
        total, _, done, ok, failed, errored, timed_out = map(int, counts.groups())
        non2xx = sum(map(int, codes.groups()[1:]))
        if failed or errored or timed_out or non2xx or done != total or ok != total:
            problems.append(
                f"h2load {what}: {total} total, {done} done, {ok} succeeded, {failed} failed, "
                f"{errored} errored, {timed_out} timeout, {non2xx} non-2xx"
            )
    return out, problems


WARMUP = ["-n", "500", "-c", "8", "-m", "32"]


@dataclass
class Result:
    """One target's figures: rps at ``-c 8 -m 32``, and p50/p99 in µs at ``-c 1 -m 1``."""

    name: str
    rps: float = math.nan
    p50_us: float = math.nan
    p99_us: float = math.nan
    problems: list[str] = field(default_factory=list)


def measure(
    name: str,
    port: int,
    n: int,
    m: int,
    tmp: Path,
    *,
    warm: bool,
    between: Callable[[], None] | None = None,
    verbose: bool = False,
) -> Result:
    """Throughput (h2load -n N -c 8 -m 32), then ``between()``, then one-at-a-time latency (-n M -c 1 -m 1)."""
    result = Result(name)
    if warm:
        _, problems = h2load(port, WARMUP, timeout=60)
        result.problems += problems
    result.rps, problems = throughput(port, n, verbose=verbose)
    result.problems += problems
    if between is not None:
        between()
    elapsed, problems = latencies(port, m, tmp, verbose=verbose)
    result.problems += problems
    elapsed.sort()
    result.p50_us = percentile(elapsed, 0.50)
    result.p99_us = percentile(elapsed, 0.99)
    return result


def throughput(port: int, n: int, *, verbose: bool = False) -> tuple[float, list[str]]:
    """Requests per second over ``h2load -n N -c 8 -m 32``, and what went wrong."""
    out, problems = h2load(port, ["-n", str(n), "-c", "8", "-m", "32"], timeout=60 + n / 100)
    if verbose:
        print(out)
    finished = re.search(r"finished in \S+, ([\d.]+) req/s", out)
    return (float(finished.group(1)) if finished else math.nan), problems


def latencies(port: int, m: int, tmp: Path, *, verbose: bool = False) -> tuple[list[int], list[str]]:
    """Each 2xx request's time in µs over ``h2load -n M -c 1 -m 1`` (from its --log-file), and what went wrong."""
    log_file = tmp / f"c1-{port}.tsv"
    log_file.unlink(missing_ok=True)
    out, problems = h2load(port, ["-n", str(m), "-c", "1", "-m", "1"], timeout=60 + m / 50, log_file=log_file)
    if verbose:
        print(out)
    elapsed = []
    if log_file.exists():
        for line in log_file.read_text().splitlines():
            cols = line.split("\t")
            if len(cols) >= 3 and cols[1].isdigit() and 200 <= int(cols[1]) < 300:
                elapsed.append(int(cols[2]))
    return elapsed, problems


def cpu_seconds(proc: Process) -> float:
    """The CPU time (user + system) ``proc`` has used so far; NaN once it is gone."""
    try:
        fields = Path(f"/proc/{proc.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(sorted_values: list[float] | list[int], q: float) -> float:
    """Nearest-rank percentile; NaN when empty."""
    if not sorted_values:
        return math.nan
    return float(sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)])


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
