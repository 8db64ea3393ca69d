"""Token streams through the chain: CPU per token and token delay, this tree against a baseline, side by side.

An LLM or voice replica sends many small DATA frames, a token each. This
measures what one such stream costs the chain, for two shapes of stream:

    back to back   N tokens (``--tokens``, default 100,000), each written as
                   soon as it is made: the chain falls behind and reads many
                   tokens per read (a backlog)
    spaced         M tokens (``--spaced``, default 1,000) 5 ms apart
                   (``--ms``): each token crosses the chain alone

through each target, every process of which is separate from this script:

    chain               edge -> proxy -> worker in one process, as recipes/chain.py runs them
    chain, a process per hop
                        the same three hops, each in a process of its own
    (and the same two of ``--baseline DIR``, a git worktree of main, side by side)

The replica is a process of its own (this script's ``--serve-replica``
mode): a bare h2 server that frames its DATA by hand (a 9-byte header and
``token I STAMP\\n``, STAMP the ``CLOCK_MONOTONIC`` nanoseconds at the
write), one ``send`` per token, keeping its flow-control books from the
WINDOW_UPDATEs it receives, so that its own cost per token is a few µs and
it outruns any chain. The client is this script: a plain h2 client on a
blocking socket, which checks that every token arrives once, in order and
unchanged, and notes for each the time from its write at the replica to its
arrival here (client and replica share the machine's monotonic clock).

Figures, per target and shape, as medians over the rounds (``--rounds``,
default 3; each round visits the targets in a rotated order, so a burst of
outside load lands on all alike):

    CPU µs/token   CPU time the target's processes used during the stream
                   (the sum over their threads of /proc/PID/task/*/schedstat,
                   in ns), over the tokens
    frames/token   DATA frames that reached the client, over the tokens
                   (1.0: every token crossed the chain as a frame of its own)
    delay p50/p99  µs from the replica's write to the client's read

and the ratios to the baseline, which the targets are about: CPU per token
(baseline / this tree) at least 5 back to back and at least 2 spaced, and
the spaced token delay unchanged (p50 this tree / baseline at most 1.05),
for the chain in one process (a process per hop is printed beside it). The
last line is ``verdict: PASS|FAIL ...``; any token lost, duplicated,
reordered or changed is a FAIL. Without ``--baseline`` only the figures are
printed (``verdict: FAIL``, no ratio to judge).

Run it from the repository root:

    git worktree add /tmp/tok-base main
    python bench/_scale_tokens.py --baseline /tmp/tok-base
    python bench/_scale_tokens.py --tokens 20000 --spaced 400 --rounds 2 --baseline /tmp/tok-base

``bench/scale.py`` calls it as a module (from ``bench/``, as ``_harness``
is imported): ``figures = run(tokens, spaced, ms, rounds, baseline)`` starts
and stops every process and returns one :class:`Figures` per (target,
shape); ``ok, summary = report(figures)`` prints the table and the ratios
and returns whether the targets are met and the figures for a verdict line.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _harness import HOST, ROOT, Process, Processes, free_port, load_average, percentile

CPU_TARGET_BACK_TO_BACK = 5.0  # baseline CPU per token / this tree's, at least
CPU_TARGET_SPACED = 2.0
DELAY_TARGET = 1.05  # spaced token delay p50, this tree / baseline, at most
TOKEN_PATH = b"/tokens"


# -- the replica (helper mode) ------------------------------------------------------------------


def serve_replica(port: int) -> None:
    """A bare h2c server: ``GET /tokens?n=N&ms=M`` answers 200 and N tokens, M ms apart (0: back to back)."""
    import trio

    trio.run(_replica, port)


async def _replica(port: int) -> None:
    import trio

    await trio.serve_tcp(_replica_connection, port, host=HOST)


async def _replica_connection(stream: object) -> None:
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings
    import trio

    assert isinstance(stream, trio.SocketStream)
    config = h2.config.H2Configuration(
        client_side=False, header_encoding=None, validate_inbound_headers=False, validate_outbound_headers=False
    )
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    books = _Windows()
    sock = stream.socket
    fd = sock.fileno()
    out = bytearray()  # what the socket did not take yet: every write goes behind it, whole frames in order
    draining = False

    def put(data: bytes) -> None:
        if not out:
            try:
                sent = os.write(fd, data)
            except BlockingIOError:
                sent = 0
            data = data[sent:]
        out.extend(data)

    async def drain() -> None:
        nonlocal draining
        if draining:
            return  # the other task is at it
        draining = True
        try:
            while out:
                await trio.lowlevel.wait_writable(sock)
                try:
                    sent = os.write(fd, out)
                except BlockingIOError:
                    continue
                del out[:sent]
        finally:
            draining = False

    async def write() -> None:
        data = conn.data_to_send()
        if data:
            put(data)
        await drain()

    async def tokens(sid: int, n: int, ms: int) -> None:
        conn.send_headers(sid, [(b":status", b"200"), (b"content-type", b"text/plain")])
        await write()
        books.streams[sid] = books.initial
        header = bytearray(9)
        for i in range(n):
            if ms and i:
                await trio.sleep(ms / 1000)
            payload = b"token %d %d\n" % (i, time.monotonic_ns())
            size = len(payload)
            while books.connection < size or books.streams.get(sid, 0) < size:
                if sid not in books.streams:
                    return  # reset
                await books.opened.wait()
            books.connection -= size
            books.streams[sid] -= size
            header[0:3] = size.to_bytes(3, "big")
            header[5:9] = sid.to_bytes(4, "big")
            put(bytes(header) + payload)  # one write per token, as it is made
            if out:
                await drain()
            elif not ms and i % 64 == 63:
                await trio.lowlevel.checkpoint()  # let the reader take window updates
        conn.end_stream(sid)
        await write()
        books.streams.pop(sid, None)

    await write()
    async with trio.open_nursery() as nursery:
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.RequestReceived):
                    head = dict(ev.headers)
                    path, _, query = head.get(b":path", b"").partition(b"?")
                    args = dict(part.split(b"=", 1) for part in query.split(b"&") if b"=" in part)
                    if path != TOKEN_PATH:
                        conn.send_headers(ev.stream_id, [(b":status", b"404")], end_stream=True)
                        continue
                    nursery.start_soon(tokens, ev.stream_id, int(args.get(b"n", b"10")), int(args.get(b"ms", b"0")))
                elif isinstance(ev, h2.events.WindowUpdated):
                    if ev.stream_id == 0:
                        books.connection += ev.delta
                    elif ev.stream_id in books.streams:
                        books.streams[ev.stream_id] += ev.delta
                    books.wake()
                elif isinstance(ev, h2.events.RemoteSettingsChanged):
                    changed = ev.changed_settings.get(h2.settings.SettingCodes.INITIAL_WINDOW_SIZE)
                    if changed is not None:
                        delta = changed.new_value - books.initial
                        books.initial = changed.new_value
                        for sid in books.streams:
                            books.streams[sid] += delta
                        books.wake()
                elif isinstance(ev, h2.events.StreamReset):
                    books.streams.pop(ev.stream_id, None)
            await write()
        nursery.cancel_scope.cancel()


class _Windows:
    """The replica's send windows, kept by hand (it frames DATA itself, beside h2)."""

    def __init__(self) -> None:
        import trio

        self.connection = 65535
        self.initial = 65535
        self.streams: dict[int, int] = {}
        self.opened = trio.Event()

    def wake(self) -> None:
        import trio

        self.opened.set()
        self.opened = trio.Event()


# -- the client -----------------------------------------------------------------------------------


@dataclass
class Sample:
    cpu_s: float = math.nan
    frames: int = 0
    delays_us: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def stream_tokens(port: int, n: int, ms: int, timeout: float) -> Sample:
    """One token stream through the target listening on ``port``: its frames, delays and problems."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    sample = Sample()
    config = h2.config.H2Configuration(client_side=True, header_encoding=None)
    conn = h2.connection.H2Connection(config)
    conn.local_settings = h2.settings.Settings(
        client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 24}
    )
    conn.initiate_connection()
    conn.increment_flow_control_window((1 << 30) - 65535)
    expected = 0
    partial = b""
    ended = False
    deadline = time.monotonic() + timeout
    with socket.create_connection((HOST, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sid = conn.get_next_available_stream_id()
        path = b"%s?n=%d&ms=%d" % (TOKEN_PATH, n, ms)
        head = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"tokens.test"), (b":path", path)]
        conn.send_headers(sid, head, end_stream=True)
        sock.sendall(conn.data_to_send())
        while not ended:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                sample.problems.append(f"{expected} of {n} tokens within {timeout:.0f}s")
                break
            sock.settimeout(remaining)
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                continue
            now = time.monotonic_ns()
            if not data:
                sample.problems.append(f"connection closed after {expected} of {n} tokens")
                break
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.DataReceived):
                    sample.frames += bool(ev.data)
                    conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    lines = (partial + ev.data).split(b"\n")
                    partial = lines.pop()
                    for line in lines:
                        parts = line.split(b" ")
                        if len(parts) != 3:
                            sample.problems.append(f"token {expected} expected, got {line[:200]!r}")
                            return sample
                        word, index, stamp = parts
                        if word != b"token" or int(index) != expected:
                            sample.problems.append(f"token {expected} expected, got {line!r}")
                            return sample
                        expected += 1
                        sample.delays_us.append((now - int(stamp)) / 1000)
                elif isinstance(ev, h2.events.ResponseReceived):
                    status = dict(ev.headers).get(b":status")
                    if status != b"200":
                        sample.problems.append(f"status {status!r}")
                elif isinstance(ev, h2.events.StreamEnded):
                    ended = True
                elif isinstance(ev, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    sample.problems.append(f"{type(ev).__name__} after {expected} of {n} tokens")
                    ended = True
            if out := conn.data_to_send():
                sock.sendall(out)
    if not sample.problems and (expected != n or partial):
        sample.problems.append(f"{expected} of {n} tokens, {len(partial)} bytes of a partial one")
    return sample


# -- CPU of a target's processes ----------------------------------------------------------------------


def cpu_ns(procs: list[Process]) -> int:
    """CPU time used so far by every thread of ``procs`` (schedstat: ns, where /proc/PID/stat counts ticks)."""
    total = 0
    for proc in procs:
        tasks = Path(f"/proc/{proc.popen.pid}/task")
        for task in tasks.iterdir() if tasks.exists() else ():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pass
    return total


# -- the run ------------------------------------------------------------------------------------------


@dataclass
class Figures:
    """One target's figures for one shape of stream (medians over the rounds)."""

    target: str
    shape: str
    tokens: int
    cpu_us: float = math.nan
    frames: float = math.nan
    p50_us: float = math.nan
    p99_us: float = math.nan
    problems: list[str] = field(default_factory=list)


def _chain_argv(root: Path, role: str, port: int, *upstream: int) -> list[str]:
    return [str(root / "bench" / "chain.py"), "--serve", role, str(port), *map(str, upstream)]


def start_targets(
    procs: Processes, replica: int, baseline: Path | None, per_hop: bool
) -> dict[str, tuple[int, list[Process]]]:
    """Every target: the port a client connects to (its edge's), and its processes."""
    trees = [("", ROOT)] + ([("baseline ", baseline)] if baseline is not None else [])
    found: dict[str, tuple[int, list[Process]]] = {}
    for prefix, root in trees:
        port = free_port()
        chain = procs.start(f"{prefix}chain", _chain_argv(root, "chain", port, replica), port, cwd=root)
        found[f"{prefix}chain"] = (port, [chain])
        if per_hop:
            worker, proxy, edge = free_port(), free_port(), free_port()
            hops = [
                procs.start(f"{prefix}worker", _chain_argv(root, "worker", worker, replica), worker, cwd=root),
                procs.start(f"{prefix}proxy", _chain_argv(root, "proxy", proxy, worker, replica), proxy, cwd=root),
                procs.start(f"{prefix}edge", _chain_argv(root, "edge", edge, proxy), edge, cwd=root),
            ]
            found[f"{prefix}chain, a process per hop"] = (edge, hops)
    return found


def run(
    tokens: int, spaced: int, ms: int, rounds: int, baseline: Path | None, *, per_hop: bool = True
) -> list[Figures]:
    """Start the replica and the targets, measure every (target, shape) ``rounds`` times; the medians."""
    tmp = Path(tempfile.mkdtemp(prefix="proxyblocks-tokens-"))
    procs = Processes(tmp)
    shapes = [("back to back", tokens, 0), (f"spaced {ms} ms", spaced, ms)]
    print(
        f"token streams: {tokens} tokens back to back, {spaced} tokens {ms} ms apart; {rounds} interleaved rounds, "
        f"medians; {os.cpu_count()} CPUs; logs in {tmp}"
    )
    print(f"load average before: {load_average()}", flush=True)
    samples: dict[tuple[str, str], list[Sample]] = {}
    try:
        replica_port = free_port()
        helper = [str(Path(__file__).resolve()), "--serve-replica", str(replica_port)]
        replica = procs.start("replica", helper, replica_port)
        targets = start_targets(procs, replica_port, baseline, per_hop)
        labels = list(targets)
        for label in labels:  # warm up: connections pooled, code paths run once
            stream_tokens(targets[label][0], 2000, 0, timeout=60)
        for round_no in range(rounds):
            print(f"... round {round_no + 1}/{rounds}", flush=True)
            order = labels[round_no % len(labels) :] + labels[: round_no % len(labels)]
            for shape, n, gap in shapes:
                for label in order:
                    port, hops = targets[label]
                    before = cpu_ns(hops)
                    sample = stream_tokens(port, n, gap, timeout=60 + n * (gap + 1) / 1000)
                    sample.cpu_s = (cpu_ns(hops) - before) / 1e9
                    for proc in [*hops, replica]:
                        if (code := proc.popen.poll()) is not None:
                            sample.problems.append(f"{proc.name} exited with {code} during the run:\n{proc.tail()}")
                    samples.setdefault((label, shape), []).append(sample)
    finally:
        procs.stop_all()
    print(f"load average after: {load_average()}  (other processes on the machine skew the figures)")
    figures = []
    for (label, shape), runs in samples.items():
        n = next(count for name, count, _ in shapes if name == shape)
        delays = [statistics.median(sorted(r.delays_us)) for r in runs if r.delays_us]
        tails = [percentile(sorted(r.delays_us), 0.99) for r in runs if r.delays_us]
        figures.append(
            Figures(
                label,
                shape,
                n,
                cpu_us=statistics.median(r.cpu_s for r in runs) / n * 1e6,
                frames=statistics.median(r.frames for r in runs) / n,
                p50_us=statistics.median(delays) if delays else math.nan,
                p99_us=statistics.median(tails) if tails else math.nan,
                problems=[p for r in runs for p in r.problems],
            )
        )
    return figures


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) and not math.isnan(a) else math.nan


def report(figures: list[Figures]) -> tuple[bool, str]:
    """Print the table and the ratios; (targets met, the figures for a verdict line)."""
    print()
    print(f"{'target':<38} {'stream':<14} {'CPU µs/token':>12} {'frames/token':>12} {'delay p50 µs':>12} {'p99 µs':>9}")
    for f in figures:
        print(f"{f.target:<38} {f.shape:<14} {f.cpu_us:>12.1f} {f.frames:>12.3f} {f.p50_us:>12.0f} {f.p99_us:>9.0f}")
    problems = [(f.target, f.shape, p) for f in figures for p in f.problems]
    if problems:
        print("\nPROBLEMS:")
        for target, shape, problem in problems:
            print(f"[{target}, {shape}] {problem}")
    by = {(f.target, f.shape.split()[0]): f for f in figures}
    print()
    parts = []
    ok = not problems
    for target in ("chain", "chain, a process per hop"):
        if (f"baseline {target}", "back") not in by or (target, "back") not in by:
            continue
        b2b = _ratio(by[(f"baseline {target}", "back")].cpu_us, by[(target, "back")].cpu_us)
        spaced = _ratio(by[(f"baseline {target}", "spaced")].cpu_us, by[(target, "spaced")].cpu_us)
        delay = _ratio(by[(target, "spaced")].p50_us, by[(f"baseline {target}", "spaced")].p50_us)
        print(
            f"{target}: CPU per token, baseline / this tree: back to back {b2b:.2f} "
            f"(target >= {CPU_TARGET_BACK_TO_BACK}), "
            f"spaced {spaced:.2f} (target >= {CPU_TARGET_SPACED}); spaced delay p50, this tree / baseline "
            f"{delay:.2f} (target <= {DELAY_TARGET})"
        )
        if target == "chain":
            ok = ok and b2b >= CPU_TARGET_BACK_TO_BACK and spaced >= CPU_TARGET_SPACED and delay <= DELAY_TARGET
        parts.append(f"{target}: CPU/token x{b2b:.2f} back to back, x{spaced:.2f} spaced, delay p50 {delay:.2f}")
    if not parts:
        ok = False
        parts.append("no baseline to compare with (--baseline DIR)")
    else:
        parts[0] += (
            f" (targets: x{CPU_TARGET_BACK_TO_BACK:g} back to back, x{CPU_TARGET_SPACED:g} spaced, "
            f"delay <= {DELAY_TARGET})"
        )
    if problems:
        parts.append(f"lost, reordered or failed tokens in: {', '.join(sorted({t for t, _, _ in problems}))}")
    return ok, "; ".join(parts)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-replica":
        serve_replica(int(sys.argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000, help="tokens back to back (default 100000)")
    parser.add_argument("--spaced", type=int, default=1000, help="tokens spaced --ms apart (default 1000)")
    parser.add_argument("--ms", type=int, default=5, help="ms between spaced tokens (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians (default 3)")
    parser.add_argument("--no-per-hop", action="store_true", help="skip the chain with a process per hop")
    parser.add_argument("--baseline", type=Path, metavar="DIR", help="another checkout (git worktree add DIR main)")
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "bench" / "chain.py").exists():
        parser.error(f"--baseline {args.baseline}: no bench/chain.py there")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    baseline = args.baseline.resolve() if args.baseline is not None else None
    try:
        figures = run(args.tokens, args.spaced, args.ms, max(1, args.rounds), baseline, per_hop=not args.no_per_hop)
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    ok, summary = report(figures)
    print(f"verdict: {'PASS' if ok else 'FAIL'} {summary}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
