"""A chain of processes, one per hop, several of each: what the failover and sessions tests and benchmark run.

:class:`ProcessFleet` starts ``python -m recipes.chain --role worker|proxy|edge``
processes (and replica processes from command templates) on fixed loopback
ports picked once, so that a part killed or stopped can be started again on
the same address, as an operator's service manager would. The hops find each
other by their flags (``--next-hop``), or, given the fleet's etcd, there: each
worker registers the replicas beside it, each proxy itself, and the edge
follows the proxies. Each part is
addressed by its name (``replica-0``, ``worker-1``, ``proxy-2``, ``edge``);
:meth:`ProcessFleet.kill` sends SIGKILL, :meth:`ProcessFleet.stop` SIGTERM
(a drain) and waits for the exit, :meth:`ProcessFleet.start` starts it again
and returns once it prints that it listens.

:class:`PacedLoad` sends requests through the edge at a steady rate from one
pooled HTTP/2 client and keeps each request's start, end and status, so that
a test can tell the requests that were in flight at a moment (a fault) from
those that started after it.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import trio

from blocks.errors import BlocksError
from blocks.fields import ERROR_HEADER
from blocks.http import Request
from blocks.routing import Address
from blocks.timing import parse_server_timing
from blocks.transport.multiplexer import UpstreamConfig, Upstreams, open_upstreams

HOST = "127.0.0.1"


def free_ports(n: int) -> list[int]:
    """``n`` different loopback ports that were free a moment ago (the kernel's picks for port 0, held together)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@attrs.define(eq=False)
class Part:
    """One process of the fleet: its command (``{port}`` filled in), its port, and its process."""

    name: str
    command: list[str]
    port: int
    ready: str
    process: trio.Process | None = None
    starts: int = 0

    @property
    def address(self) -> Address:
        return (HOST, self.port)


@attrs.define(eq=False)
class ProcessFleet:
    """``workers`` workers, ``proxies`` proxies and an edge, each a process, in front of ``replicas``.

    ``replicas``: name -> ``(command, ready, url scheme)``: a command template
    with ``{port}`` (a server not of this project: Hypercorn, ``python -m
    http.server``...), the regular expression its output matches once it
    listens, and how the workers reach it (``h2c``, ``http``). Every replica
    is reachable through every worker (the proxies route each replica behind
    each worker), so a dead worker takes out only the routes through it.

    ``route_source``: the fleet's etcd (a client URL). Every hop then finds
    the others there (``--route-source``): each replica sits beside one
    worker, which registers it (``beside``: worker name -> its replicas'
    names; default: dealt in turn), the proxies route from etcd and register
    themselves, the edge follows them. :attr:`routed` names each replica as
    the routes do (``replica-0@worker-1``).

    ``codec``: the HTTP/2 codec of the hops (default: ``$PROXYBLOCKS_CODEC``, else ``auto``).
    ``extra``: more flags for every hop (``--config FILE``, say).
    """

    replicas: dict[str, tuple[Sequence[str], str, str]]
    workers: int = 2
    proxies: int = 2
    codec: str | None = None
    cwd: Path | None = None
    extra: Sequence[str] = ()
    route_source: str | None = None
    beside: Mapping[str, Sequence[str]] | None = None
    parts: dict[str, Part] = attrs.field(factory=dict)
    routed: dict[str, str] = attrs.field(factory=dict)
    """With ``route_source``: each replica's name in the routes (and in the session tokens), by its part's name."""
    _nursery: trio.Nursery | None = None

    def _plan(self) -> None:
        codec = ["--codec", self.codec] if self.codec else []
        hop = [sys.executable, "-m", "recipes.chain", *codec, "--port", "{port}", *self.extra]
        listening = r"listening on h2c://"
        ports = iter(free_ports(len(self.replicas) + self.workers + self.proxies + 1))
        free_port = ports.__next__
        for name, (command, ready, _) in self.replicas.items():
            self.parts[name] = Part(name, [arg.replace("{name}", name) for arg in command], free_port(), ready)
        urls = {name: f"{scheme}://{HOST}:{self.parts[name].port}" for name, (_, _, scheme) in self.replicas.items()}
        workers = [f"worker-{j}" for j in range(1, self.workers + 1)]
        proxies = [f"proxy-{k}" for k in range(1, self.proxies + 1)]
        if self.route_source is not None:  # the hops find each other in etcd
            fleet = ["--route-source", self.route_source]
            beside = self.beside or {name: list(urls)[j :: len(workers)] for j, name in enumerate(workers)}
            for name in workers:
                yours = [arg for replica in beside.get(name, ()) for arg in ("--replica", urls[replica])]
                self.routed |= {replica: f"replica-{i}@{name}" for i, replica in enumerate(beside.get(name, ()))}
                command = [*hop, "--role", "worker", "--name", name, *fleet, *yours]
                self.parts[name] = Part(name, command, free_port(), listening)
            for name in proxies:
                self.parts[name] = Part(name, [*hop, "--role", "proxy", "--name", name, *fleet], free_port(), listening)
            front = fleet
        else:  # each proxy routes every replica behind each worker
            for name in workers:
                self.parts[name] = Part(name, [*hop, "--role", "worker", "--name", name], free_port(), listening)
            next_hops = [arg for name in workers for arg in ("--next-hop", f"h2c://{HOST}:{self.parts[name].port}")]
            replicas = [arg for url in urls.values() for arg in ("--replica", url)]
            for name in proxies:
                command = [*hop, "--role", "proxy", "--name", name, *next_hops, *replicas]
                self.parts[name] = Part(name, command, free_port(), listening)
            front = [arg for name in proxies for arg in ("--next-hop", f"h2c://{HOST}:{self.parts[name].port}")]
        self.parts["edge"] = Part("edge", [*hop, "--role", "edge", *front], free_port(), r"^edge listening on ")

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.parts['edge'].port}"

    async def run(self, task_status: trio.TaskStatus[ProcessFleet] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every part, back to front; report the fleet; on cancellation, SIGKILL what still runs."""
        self._plan()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for name in self.parts:
                    await self.start(name)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            for part in self.parts.values():
                if part.process is not None:
                    _signal_group(part.process, signal.SIGKILL)

    async def start(self, name: str) -> None:
        """Start part ``name`` (again) on its port; return once it says it listens."""
        part = self.parts[name]
        assert self._nursery is not None
        command = [arg.replace("{port}", str(part.port)) for arg in part.command]
        part.process = await start_process(self._nursery, command, part.ready, cwd=self.cwd)
        part.starts += 1

    def kill(self, name: str) -> None:
        """SIGKILL part ``name`` and its process group (a crash)."""
        process = self.parts[name].process
        assert process is not None
        _signal_group(process, signal.SIGKILL)

    async def stop(self, name: str) -> None:
        """SIGTERM part ``name`` (a planned stop: it drains) and wait for it to exit."""
        process = self.parts[name].process
        assert process is not None
        process.send_signal(signal.SIGTERM)
        await process.wait()

    async def wait_dead(self, name: str) -> None:
        process = self.parts[name].process
        assert process is not None
        await process.wait()


def _signal_group(process: trio.Process, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


async def start_process(
    nursery: trio.Nursery, command: Sequence[str], ready: str, *, cwd: Path | None = None
) -> trio.Process:
    """Start ``command`` in ``nursery``, in a process group of its own; return once its output
    (stdout and stderr) matches ``ready``, a regular expression. Its output is read on after that
    (a full pipe would block it); a process that exits first is a ``RuntimeError`` with its last words."""
    process: trio.Process = await nursery.start(
        functools.partial(
            trio.run_process,
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            check=False,
            start_new_session=True,  # its own process group: a kill reaches a server's own children too
        )
    )
    assert process.stdout is not None
    pattern = re.compile(ready, re.MULTILINE)
    seen = b""
    while True:
        chunk = await process.stdout.receive_some()
        if not chunk:
            raise RuntimeError(f"{command} exited before it listened: {seen.decode(errors='replace')[-2000:]}")
        seen += chunk
        if pattern.search(seen.decode(errors="replace")):
            break
    nursery.start_soon(_drain, process.stdout)
    return process


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some():
        pass


@attrs.frozen
class Outcome:
    """One request of a :class:`PacedLoad`: when it started and ended (trio's clock), its status
    (0: no response at all), its ``proxyblocks-error`` if any, and the names its ``server-timing``
    lists (which hops it crossed: ``proxy-2``, ``worker-1``...) and its ``x-replica``."""

    start: float
    end: float
    status: int
    error: str = ""
    hops: frozenset[str] = frozenset()
    replica: str = ""


@attrs.define(eq=False)
class PacedLoad:
    """``rate`` requests per second of ``GET path`` to ``edge``, from one pooled HTTP/2 client, until cancelled."""

    edge: Address
    rate: float
    path: bytes = b"/"
    outcomes: list[Outcome] = attrs.field(factory=list)
    in_flight: dict[int, float] = attrs.field(factory=dict)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        config = UpstreamConfig(response_timeout=30.0, max_connections=4)
        async with open_upstreams(config) as upstreams, trio.open_nursery() as nursery:
            task_status.started()
            interval = 1.0 / self.rate
            due = trio.current_time()
            for n in range(1 << 62):
                nursery.start_soon(self._one, upstreams, n)
                due += interval
                await trio.sleep_until(due)

    async def _one(self, upstreams: Upstreams, n: int) -> None:
        start = trio.current_time()
        self.in_flight[n] = start
        status, error, hops, replica = 0, "", frozenset[str](), ""
        try:
            request = Request(b"GET", b"http", b"demo.local", self.path)
            response = await upstreams.request(self.edge, request, [])
            await response.body.read_all()
            status = response.status
            for name, value in response.headers:
                if name == ERROR_HEADER:
                    error = value.decode("latin-1")
                elif name == b"server-timing":
                    hops = frozenset(parse_server_timing(value))
                elif name == b"x-replica":
                    replica = value.decode("latin-1")
        except BlocksError as exc:
            error = f"client: {exc.error_reason}"
        finally:
            del self.in_flight[n]
            self.outcomes.append(Outcome(start, trio.current_time(), status, error, hops, replica))

    def failed_between(self, start: float, end: float = math.inf) -> list[Outcome]:
        """The requests that failed and started in ``[start, end)``."""
        return [o for o in self.outcomes if o.status != 200 and start <= o.start < end]

    def first_through(self, hop: str, since: float) -> float | None:
        """When the first request that started at ``since`` or later and crossed ``hop`` (a hop's name, or a
        replica's ``x-replica``) ended; None if none yet."""
        ends = [o.end for o in self.outcomes if o.start >= since and (hop in o.hops or hop == o.replica)]
        return min(ends) if ends else None

    def in_flight_at(self, moment: float) -> int:
        """How many requests had started and not ended at ``moment`` (those ended already, and those still going)."""
        done = sum(1 for o in self.outcomes if o.start <= moment < o.end)
        return done + sum(1 for start in self.in_flight.values() if start <= moment)
