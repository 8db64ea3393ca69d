"""Memory per connection and a long run: the chain's RSS under 10,000 idle clients, and over a soak.

Two measurements, on 127.0.0.1, the chain run as ``recipes/chain.py`` runs
it one hop per process (``--role worker|proxy|edge``, the demo replica in a
process of its own), so that each process's RSS is its own:

``idle``
    N idle client connections at the edge (default 10,000): half HTTP/1.1
    kept alive after one request, half h2 with SETTINGS exchanged (both
    ways acknowledged) after one request. Prints each process's RSS before
    and after, and the edge's growth per connection (target <= 40 KiB), for
    the h2 half and the h1 half apart; and the c1 p50 of a new client
    (``h2load -c 1 -m 1``) before, while they are open, and once they are
    closed again (what the machine's own load makes of it meanwhile). The open-file
    limit is raised as far as the hard limit allows (``RLIMIT_NOFILE``,
    inherited by the chain's processes); when it caps N, it says so.

``soak``
    ``--minutes M`` (default 10) at 80% of the chain's maximum rps, measured
    first (a few seconds unthrottled, with the same mix): plain GETs over h2
    and HTTP/1.1, token streams (``/stream``), uploads (``POST /echo``, 16 KiB,
    echoed back) and WebSocket sessions (h1 Upgrade, every message echoed and
    checked). Every process's RSS is sampled every 10 s and printed as a
    table. PASS needs zero failed requests and, for every process, RSS growth
    under 5% over the last 80% of the run (after the warm-up fifth).

Run it from the repository root (needs h2load: ``apt-get install nghttp2-client``):

    python bench/_scale_memory.py                          # 10,000 connections, a 10-minute soak
    python bench/_scale_memory.py --connections 2000 --minutes 2
    python bench/_scale_memory.py --only idle              # or --only soak

It ends with one line, ``verdict: PASS|FAIL <figures vs targets>``.
``bench/scale.py`` calls :func:`measure_idle`, :func:`soak` and :func:`verdict`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import HOST, ROOT, Process, Processes, free_port, latencies, load_average, percentile

KIB_PER_CONNECTION_TARGET = 40.0
SOAK_GROWTH_TARGET = 0.05  # RSS growth over the last 80% of the soak, per process
SOAK_LOAD = 0.8  # of the measured maximum rps
SAMPLE_EVERY = 10.0  # seconds between RSS samples
UPLOAD_SIZE = 16 * 1024

if TYPE_CHECKING:
    import trio


# -- the chain, one hop per process ---------------------------------------------------------------


@dataclass
class Chain:
    """The chain's processes (edge first) and the edge's port."""

    port: int
    procs: list[Process]

    def rss_kib(self) -> dict[str, int]:
        return {proc.name: rss_kib(proc.popen.pid) for proc in self.procs}

    def dead(self) -> list[str]:
        return [f"{p.name} exited with {p.popen.returncode}" for p in self.procs if p.popen.poll() is not None]


IDLE_HOLD = 900.0
"""The idle measurement's edge keeps an idle HTTP/1.1 connection this long (``h1_idle_timeout``; 60 s by
default, which is shorter than opening 5,000 of them takes on a loaded machine)."""


def serve_edge(port: int, proxy: int) -> None:
    """The helper mode (``--serve-edge PORT PROXY_PORT``): the chain's edge as the recipe builds it
    (``Chain.start_edge``), except that it keeps idle HTTP/1.1 connections for ``IDLE_HOLD`` seconds."""
    sys.path.insert(0, str(ROOT))
    import trio

    import blocks

    async def edge() -> None:
        async with blocks.open_chain(host=HOST) as chain:
            listener = blocks.ListenerConfig(h1_idle_timeout=IDLE_HOLD)
            await chain.start_edge(port=port, proxy=(HOST, proxy), listener=listener)
            await trio.sleep_forever()

    with contextlib.suppress(KeyboardInterrupt):
        trio.run(edge)


def start_chain(procs: Processes, *, hold_idle: bool = False) -> Chain:
    """Replica, worker, proxy, edge: ``python -m recipes.chain --role ...``, each in its own process
    (``hold_idle``: the edge keeps idle HTTP/1.1 connections for ``IDLE_HOLD`` seconds)."""
    replica, worker, proxy, edge = (free_port() for _ in range(4))
    recipe = ["-m", "recipes.chain", "--log-level", "warning"]
    replicas = ["--replica", f"h2c://{HOST}:{replica}"]
    started = [
        procs.start("replica", ["bench/chain.py", "--serve", "replica", str(replica)], replica),
        procs.start("worker", [*recipe, "--role", "worker", "--port", str(worker)], worker),
        procs.start(
            "proxy",
            [*recipe, "--role", "proxy", "--port", str(proxy), "--next-hop", f"h2c://{HOST}:{worker}", *replicas],
            proxy,
        ),
        procs.start(
            "edge",
            [__file__, "--serve-edge", str(edge), str(proxy)]
            if hold_idle
            else [*recipe, "--role", "edge", "--port", str(edge), "--next-hop", f"h2c://{HOST}:{proxy}"],
            edge,
        ),
    ]
    return Chain(edge, started[::-1])


def rss_kib(pid: int) -> int:
    """The resident set of ``pid`` in KiB (0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(found.group(1)) if found else 0


def raise_open_files(wanted: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (children inherit it); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# -- idle connections ---------------------------------------------------------------------------------


def _h2_request(port: int) -> bytes:
    """Preface, an empty SETTINGS, one GET on stream 1: what every h2 idle client sends (a fresh HPACK
    encoder encodes the same first block for each)."""
    import hpack
    import hyperframe.frame as hf

    head = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", f"{HOST}:{port}".encode()), (b":path", b"/")]
    frames = [
        hf.SettingsFrame(0),
        hf.HeadersFrame(1, hpack.Encoder().encode(head), flags=["END_HEADERS", "END_STREAM"]),
    ]
    return b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"".join(f.serialize() for f in frames)


_SETTINGS_ACK = b"\x00\x00\x00\x04\x01\x00\x00\x00\x00"


async def _open_h2(port: int, request: bytes) -> trio.SocketStream:
    """One h2 connection: a GET answered 200, the server's SETTINGS acknowledged and ours acknowledged by it."""
    import hpack
    import trio

    stream = await trio.open_tcp_stream(HOST, port)
    await stream.send_all(request)
    buffer = b""
    settings = acked = ended = False
    status = None
    decoder = hpack.Decoder()
    while not (settings and acked and ended):
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("the edge closed an h2 connection during its first request")
        buffer += data
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3]):
            length, kind, flags, sid = int.from_bytes(buffer[:3]), buffer[3], buffer[4], buffer[5:9]
            payload, buffer = buffer[9 : 9 + length], buffer[9 + length :]
            if kind == 0x4:
                if flags & 0x1:
                    acked = True
                else:
                    settings = True
                    await stream.send_all(_SETTINGS_ACK)
            elif kind == 0x1 and int.from_bytes(sid) == 1:
                status = dict(decoder.decode(payload, raw=True)).get(b":status")
                ended = ended or bool(flags & 0x1)
            elif kind == 0x0 and int.from_bytes(sid) == 1:
                ended = ended or bool(flags & 0x1)
            elif kind == 0x7:
                raise ConnectionError("GOAWAY on an h2 connection during its first request")
    if status != b"200":
        raise ConnectionError(f"h2 GET answered {status!r}")
    return stream


async def _open_h1(port: int) -> trio.SocketStream:
    """One HTTP/1.1 connection, kept alive after a GET answered 200 (its whole body read)."""
    import trio

    stream = await trio.open_tcp_stream(HOST, port)
    await stream.send_all(f"GET / HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode())
    buffer = b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("the edge closed an HTTP/1.1 connection during its first request")
        buffer += data
        head, sep, body = buffer.partition(b"\r\n\r\n")
        if sep:
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            if length is None:
                raise ConnectionError("an HTTP/1.1 answer without content-length")
            if len(body) >= int(length.group(1)):
                break
    if not buffer.startswith(b"HTTP/1.1 200"):
        raise ConnectionError(f"HTTP/1.1 GET answered {buffer[:20]!r}")
    return stream


async def _open_many(port: int, count: int, kind: str, held: list[socket.socket], concurrency: int = 256) -> None:
    """``count`` connections of ``kind``, ``concurrency`` at a time; each kept in ``held`` as a plain
    socket, outliving this trio run."""
    import trio

    request = _h2_request(port)
    sem = trio.Semaphore(concurrency)  # the edge listens with a backlog of 1024

    async def one() -> None:
        async with sem:
            stream: trio.SocketStream = await (_open_h2(port, request) if kind == "h2" else _open_h1(port))
            held.append(socket.socket(fileno=stream.socket.detach()))

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)


def _still_open(held: list[socket.socket]) -> int:
    """How many held connections the edge has not closed (a peek that sees neither EOF nor an error)."""
    alive = 0
    for sock in held:
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            alive += 1
            continue
        except OSError:
            continue
        alive += bool(data)
    return alive


@dataclass
class IdleResult:
    connections: int  # asked for
    opened: dict[str, int] = field(default_factory=dict)  # by kind
    still_open: int = 0
    nofile: int = 0
    capped: bool = False
    rss: list[tuple[str, dict[str, int]]] = field(default_factory=list)  # (moment, process -> KiB)
    kib_per_connection: dict[str, float] = field(default_factory=dict)  # the edge's, by kind and "all"
    p50_before_us: float = math.nan
    p50_during_us: float = math.nan
    p50_after_us: float = math.nan  # once they are closed again: what the machine's load alone makes of it
    problems: list[str] = field(default_factory=list)

    def passed(self) -> bool:
        return not self.problems and self.kib_per_connection.get("all", math.inf) <= KIB_PER_CONNECTION_TARGET


def _settle(chain: Chain, seconds: float = 3.0) -> dict[str, int]:
    time.sleep(seconds)
    return chain.rss_kib()


def measure_idle(connections: int = 10_000, *, tmp: Path | None = None, latency_requests: int = 1000) -> IdleResult:
    """``connections`` idle clients at the edge of a chain of its own (see the module docstring)."""
    import trio

    tmp = tmp or Path(tempfile.mkdtemp(prefix="proxyblocks-scale-"))
    result = IdleResult(connections)
    result.nofile = raise_open_files(connections + 512)
    room = result.nofile - 512  # sockets of the edge's own (upstream, listener, h2load) and ours
    if connections > room:
        print(f"RLIMIT_NOFILE is {result.nofile} (hard limit): {connections} connections capped at {room}")
        connections, result.capped = room, True
    procs = Processes(tmp)
    held: list[socket.socket] = []
    try:
        chain = start_chain(procs, hold_idle=True)
        _, problems = latencies(chain.port, 300, tmp)  # the pools are open, the code paths warm
        result.problems += problems
        before = _settle(chain)
        result.rss.append(("before", before))
        elapsed, problems = latencies(chain.port, latency_requests, tmp)
        result.problems += problems
        result.p50_before_us = percentile(sorted(elapsed), 0.5)
        half = connections // 2
        marks = [before]
        for kind, count in (("h2", connections - half), ("h1", half)):
            start = time.monotonic()
            try:
                trio.run(_open_many, chain.port, count, kind, held)
            except BaseException as exc:  # an ExceptionGroup of ConnectionErrors, or OSError
                result.problems.append(f"opening {count} {kind} connections: {exc!r}"[:300])
            result.opened[kind] = len(held) - sum(result.opened.values())
            print(f"... {result.opened[kind]} {kind} connections open in {time.monotonic() - start:.1f} s", flush=True)
            marks.append(_settle(chain))
            result.rss.append((f"+ {result.opened[kind]} {kind}", marks[-1]))
        elapsed, problems = latencies(chain.port, latency_requests, tmp)
        result.problems += problems
        result.p50_during_us = percentile(sorted(elapsed), 0.5)
        result.still_open = _still_open(held)
        if result.still_open < len(held):
            result.problems.append(f"the edge closed {len(held) - result.still_open} of the idle connections")
        edge = [m["edge"] for m in marks]
        for i, kind in enumerate(("h2", "h1")):
            if result.opened.get(kind):
                result.kib_per_connection[kind] = (edge[i + 1] - edge[i]) / result.opened[kind]
        if held:
            result.kib_per_connection["all"] = (edge[-1] - edge[0]) / len(held)
        for sock in held:
            sock.close()
        held.clear()
        time.sleep(3)  # the edge sees them close
        elapsed, problems = latencies(chain.port, latency_requests, tmp)
        result.problems += problems
        result.p50_after_us = percentile(sorted(elapsed), 0.5)
        result.problems += chain.dead()
    finally:
        for sock in held:
            sock.close()
        procs.stop_all()
    return result


def print_idle(result: IdleResult) -> None:
    print()
    print(
        f"idle connections: {sum(result.opened.values())} of {result.connections} asked for "
        f"({result.opened}), {result.still_open} still open at the end; RLIMIT_NOFILE {result.nofile}"
        + (" (it capped the test)" if result.capped else "")
    )
    names = list(result.rss[0][1]) if result.rss else []
    print(f"{'RSS MiB':<16}" + "".join(f"{n:>10}" for n in names))
    for moment, rss in result.rss:
        print(f"{moment:<16}" + "".join(f"{rss[n] / 1024:>10.1f}" for n in names))
    for kind, kib in result.kib_per_connection.items():
        print(f"edge growth per {kind} connection: {kib:.1f} KiB")
    print(
        f"new client c1 p50: {result.p50_before_us:.0f} µs before, {result.p50_during_us:.0f} µs with them open, "
        f"{result.p50_after_us:.0f} µs once they closed"
    )
    for problem in result.problems:
        print(f"PROBLEM (idle): {problem}")


# -- the soak -----------------------------------------------------------------------------------------------


def _h2load_counts(out: str) -> tuple[int, int, str]:
    """(succeeded, bad, what) from an h2load run: bad is failed + errored + timed out + non-2xx."""
    counts = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored, "
        r"(\d+) timeout",
        out,
    )
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if counts is None or codes is None:
        return 0, 1, "unreadable h2load output: " + out[-300:]
    _, _, _, ok, failed, errored, timed_out = map(int, counts.groups())
    non2xx = sum(map(int, codes.groups()[1:]))
    bad = failed + errored + timed_out + non2xx
    return ok, bad, f"{ok} succeeded, {failed} failed, {errored} errored, {timed_out} timeout, {non2xx} non-2xx"


@dataclass
class Load:
    """One h2load run in the background: ``name``, its argv, its process."""

    name: str
    argv: list[str]
    popen: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.popen = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(self, timeout: float) -> tuple[int, int, str]:
        assert self.popen is not None
        try:
            out, _ = self.popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            out, _ = self.popen.communicate()
            return 0, 1, f"no end within {timeout:.0f} s (hang)"
        return _h2load_counts(out)


def _mix(port: int, seconds: float, tmp: Path, rps: float | None) -> list[Load]:
    """The soak's h2load runs for ``seconds``: ``rps`` in all (None: as fast as they go), shared out as
    70% h2 GETs (one in eight a ``/stream``), 20% HTTP/1.1 GETs, 10% uploads."""
    uris = tmp / "uris.txt"
    url = f"http://{HOST}:{port}"
    uris.write_text("".join(f"{url}/\n" for _ in range(7)) + f"{url}/stream?n=4&ms=5\n")
    upload = tmp / "upload.bin"
    upload.write_bytes(os.urandom(UPLOAD_SIZE))
    runs = [  # name, share, clients, streams per client, extra arguments
        ("h2 GET+stream", 0.7, 4, 8, ["-i", str(uris)]),
        ("h1 GET", 0.2, 4, 1, ["--h1", f"{url}/"]),
        ("h2 upload", 0.1, 2, 4, ["-d", str(upload), f"{url}/echo"]),
    ]
    loads = []
    for name, share, clients, streams, extra in runs:
        argv = ["h2load", "-D", f"{seconds:.0f}", "-c", str(clients), "-m", str(streams), *extra]
        if rps is not None:
            argv[1:1] = ["--rps", str(max(1, round(rps * share / clients)))]
        loads.append(Load(name, argv))
    return loads


async def _websockets(port: int, seconds: float, rate: float, counts: dict[str, int], errors: list[str]) -> None:
    """WebSocket sessions (h1 Upgrade) at ``rate`` per second for ``seconds``: each sends 5 messages,
    checks their echoes, and closes."""
    import trio
    import trio_websocket

    async def session(n: int) -> None:
        try:
            async with trio_websocket.open_websocket_url(f"ws://{HOST}:{port}/ws/{n}") as ws:
                for i in range(5):
                    message = f"message {i} of session {n}"
                    await ws.send_message(message)
                    if await ws.get_message() != message:
                        raise ValueError("an echo that is not the message")
            counts["ok"] += 1
        except Exception as exc:
            counts["failed"] += 1
            errors.append(repr(exc)[:200])

    async with trio.open_nursery() as nursery:
        deadline = trio.current_time() + seconds
        n = 0
        while trio.current_time() < deadline:
            nursery.start_soon(session, n)
            n += 1
            await trio.sleep(1 / rate)


@dataclass
class SoakResult:
    minutes: float
    max_rps: float = math.nan
    target_rps: float = math.nan
    done_rps: float = math.nan
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (seconds, process -> KiB)
    growth: dict[str, float] = field(default_factory=dict)  # over the last 80%, by process
    succeeded: int = 0
    failed: int = 0
    lines: list[str] = field(default_factory=list)  # what each load did
    problems: list[str] = field(default_factory=list)

    def passed(self) -> bool:
        return (
            not self.problems
            and self.failed == 0
            and bool(self.growth)
            and max(self.growth.values()) < SOAK_GROWTH_TARGET
        )


def _run_mix(
    chain: Chain,
    seconds: float,
    tmp: Path,
    rps: float | None,
    ws_rate: float,
    sample: Callable[[float], None] | None = None,
) -> tuple[int, int, list[str]]:
    """Run the mix for ``seconds``; (succeeded, failed, a line per load). ``sample(t)`` every SAMPLE_EVERY s."""
    import threading

    import trio

    loads = _mix(chain.port, seconds, tmp, rps)
    for load in loads:
        load.start()
    ws: dict[str, int] = {"ok": 0, "failed": 0}
    errors: list[str] = []
    thread = threading.Thread(target=trio.run, args=(_websockets, chain.port, seconds, ws_rate, ws, errors))
    thread.start()
    start = time.monotonic()
    if sample is not None:
        while (now := time.monotonic() - start) < seconds:
            sample(now)
            time.sleep(max(0.0, SAMPLE_EVERY - (time.monotonic() - start - now)))
    thread.join(timeout=seconds + 60)
    ok, bad, lines = ws["ok"], ws["failed"], []
    lines.append(
        f"websocket sessions: {ws['ok']} ok, {ws['failed']} failed" + (f" (first: {errors[0]})" if errors else "")
    )
    for load in loads:
        good, failed, what = load.finish(timeout=seconds + 120)
        ok, bad = ok + good, bad + failed
        lines.append(f"{load.name}: {what}")
    if sample is not None:
        sample(time.monotonic() - start)
    return ok, bad, lines


def soak(minutes: float = 10.0, *, tmp: Path | None = None) -> SoakResult:
    """The mix at 80% of the chain's measured maximum for ``minutes``, RSS sampled (see the module docstring)."""
    tmp = tmp or Path(tempfile.mkdtemp(prefix="proxyblocks-scale-"))
    result = SoakResult(minutes)
    raise_open_files(4096)
    procs = Processes(tmp)
    try:
        chain = start_chain(procs)
        probe = 10.0
        ok, bad, lines = _run_mix(chain, probe, tmp, None, ws_rate=5)
        result.max_rps = ok / probe
        if bad:
            result.problems.append(f"while measuring the maximum: {bad} bad requests: " + "; ".join(lines))
        result.target_rps = SOAK_LOAD * result.max_rps
        print(
            f"... maximum {result.max_rps:.0f} rps (the mix, unthrottled, {probe:.0f} s); "
            f"soaking at {result.target_rps:.0f} rps for {minutes:g} min",
            flush=True,
        )
        seconds = minutes * 60

        def sample(t: float) -> None:
            result.samples.append((t, chain.rss_kib()))

        ws_rate = max(1.0, 0.02 * result.target_rps)
        result.succeeded, result.failed, result.lines = _run_mix(
            chain, seconds, tmp, result.target_rps, ws_rate, sample
        )
        result.done_rps = result.succeeded / seconds
        window = [s for t, s in result.samples if t >= 0.2 * seconds]
        if len(window) >= 2:
            for name in window[0]:
                result.growth[name] = (window[-1][name] - window[0][name]) / max(1, window[0][name])
        else:
            result.problems.append("too short a run for two samples after the warm-up")
        result.problems += chain.dead()
    finally:
        procs.stop_all()
    return result


def print_soak(result: SoakResult) -> None:
    print()
    print(
        f"soak: {result.minutes:g} min at {result.target_rps:.0f} rps asked ({SOAK_LOAD:.0%} of the measured "
        f"maximum {result.max_rps:.0f}), {result.done_rps:.0f} rps answered"
    )
    for line in result.lines:
        print(f"  {line}")
    names = list(result.samples[0][1]) if result.samples else []
    print(f"{'t (s)':>7}" + "".join(f"{n + ' MiB':>14}" for n in names))
    for t, rss in result.samples:
        print(f"{t:>7.0f}" + "".join(f"{rss[n] / 1024:>14.1f}" for n in names))
    print("growth over the last 80%: " + ", ".join(f"{n} {g:+.1%}" for n, g in result.growth.items()))
    for problem in result.problems:
        print(f"PROBLEM (soak): {problem}")


# -- the verdict ---------------------------------------------------------------------------------------------


def verdict(idle: IdleResult | None, soaked: SoakResult | None) -> tuple[bool, str]:
    """PASS or FAIL and the figures against their targets, for the one ``verdict:`` line."""
    ok, figures = True, []
    if idle is not None:
        kib = idle.kib_per_connection.get("all", math.nan)
        ok = ok and idle.passed()
        figures.append(
            f"{kib:.1f} KiB per idle connection over {sum(idle.opened.values())} (target <= "
            f"{KIB_PER_CONNECTION_TARGET:.0f}), c1 p50 {idle.p50_before_us:.0f} -> {idle.p50_during_us:.0f} "
            f"-> {idle.p50_after_us:.0f} µs (before, with them open, after)"
            + (f", {len(idle.problems)} problems (target: none)" if idle.problems else "")
        )
    if soaked is not None:
        worst = max(soaked.growth.items(), key=lambda kv: kv[1], default=("none", math.nan))
        ok = ok and soaked.passed()
        figures.append(
            f"soak {soaked.minutes:g} min at {soaked.target_rps:.0f} rps: {soaked.failed} failed of "
            f"{soaked.succeeded + soaked.failed} (target 0), worst RSS growth {worst[1]:+.1%} ({worst[0]}; "
            f"target < {SOAK_GROWTH_TARGET:.0%})" + (f", {len(soaked.problems)} problems" if soaked.problems else "")
        )
    return ok, "; ".join(figures)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-edge":
        serve_edge(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=10_000, help="idle connections (default 10000)")
    parser.add_argument("--minutes", type=float, default=10.0, help="the soak's length (default 10)")
    parser.add_argument("--only", choices=("idle", "soak"), help="one of the two measurements")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so every server is stopped
    os.chdir(ROOT)
    print(f"{os.cpu_count()} CPUs; load average before: {load_average()}", flush=True)
    idle = soaked = None
    try:
        if args.only in (None, "idle"):
            idle = measure_idle(args.connections)
            print_idle(idle)
        if args.only in (None, "soak"):
            soaked = soak(args.minutes)
            print_soak(soaked)
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    print(f"load average after: {load_average()}  (other processes on the machine skew the figures)")
    ok, figures = verdict(idle, soaked)
    print(f"verdict: {'PASS' if ok else 'FAIL'} {figures}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
