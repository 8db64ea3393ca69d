"""The two HTTP/2 codecs side by side: libnghttp2 (cffi, the C shim and ABI mode) against hyper-h2 as configured.

What it measures, in one run:

``pairs``   In memory, no sockets: a client codec and a server codec (the
            server as the edge's listener makes it: guarded, lengths left to
            validation), one request (a realistic head, no body) and its
            response (a head, a 64-byte body), with the DATA given back. CPU
            per pair (``time.process_time``) over many pairs, one pair at a
            time and 32 streams per flush, each codec at its best of
            ``--rounds`` alternating rounds, in the mode the codec loads in
            and, where that is the shim, in ABI mode too (a process with
            ``PROXYBLOCKS_NGHTTP2_SHIM=0``). Targets: nghttp2 >= 10x the pairs
            per CPU-second of hyper-h2 with the shim, >= 4x in ABI mode.
``hop``     One worker hop (routing to its replica, Server-Timing on) in a
            process of its own, in front of the demo replica, under h2load
            (-c 8 -m 32): requests per second with each codec (the replica
            and h2load the same for both). Target: >= 2.5x.
``chain``   The chain recipe's three hops in one process, one request at a
            time (h2load -c 1 -m 1): p50 latency with each codec. Target:
            nghttp2 <= 0.5x.
``memory``  Memory per idle h2 connection at a listener (1,000 connections
            held open): nghttp2 <= 1.5x hyper-h2.

Run it from the repository root (needs h2load, ``apt-get install nghttp2-client``,
and libnghttp2, ``libnghttp2-14``)::

    python bench/codec.py            # everything
    python bench/codec.py --quick    # fewer pairs and requests
    python bench/codec.py --only pairs

``python bench/codec.py --serve CODEC ROLE PORT [UPSTREAM_PORT...]`` is the
helper mode that starts one server process on a codec. It ends with one
line, ``verdict: PASS|FAIL <figures vs targets>``.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _harness import HOST, Processes, free_port, h2load, latencies, percentile, serve_role, throughput

from blocks.transport._codec import (
    HEADER_LIST_HARD_CAP,
    GuardedFrameBuffer,
    make_hyper_h2,
)

TARGET_PAIRS = {"shim": 10.0, "abi": 4.0}
TARGET_HOP = 2.5
TARGET_CHAIN = 0.5
TARGET_MEMORY = 1.5

REQUEST = [
    (b":method", b"GET"),
    (b":scheme", b"https"),
    (b":authority", b"api.example.com"),
    (b":path", b"/v1/chat/completions?model=small"),
    (b"user-agent", b"python-httpx/0.27.0"),
    (b"accept", b"application/json"),
    (b"accept-encoding", b"gzip, deflate"),
    (b"authorization", b"Bearer eyJhbGciOiJIUzI1NiJ9.eyJ0ZW5hbnQiOiJhY21lIn0.c2lnbmF0dXJl"),
    (b"x-request-id", b"6f1c0a6e-7d0b-4a8c-9d2b-1f6a2b3c4d5e"),
    (b"x-tenant", b"acme"),
]
RESPONSE = [
    (b":status", b"200"),
    (b"content-type", b"application/json"),
    (b"content-length", b"64"),
    (b"server-timing", b"edge;dur=0.41, proxy;dur=0.22, worker;dur=0.18"),
    (b"date", b"Wed, 02 Dec 2026 12:00:00 GMT"),
]
BODY = b"x" * 64


def _make(codec: str) -> Any:
    if codec == "h2":
        return make_hyper_h2
    from blocks.transport._nghttp2 import make_nghttp2

    return make_nghttp2


def _pair(codec: str) -> tuple[Any, Any]:
    """A client and a server codec of ``codec``, past their prefaces, as the pool and the edge make them."""
    make = _make(codec)
    guard = GuardedFrameBuffer(max_header_block=4 * 65536, max_empty=100, flood_limit=10**9, flood_window=1.0)
    server = make(
        client_side=False,
        max_concurrent_streams=1000,
        stream_window=1 << 20,
        max_header_list_size=65536,
        header_list_cap=HEADER_LIST_HARD_CAP * 65536,
        count_streams=False,
        guard=guard,
        check_lengths=False,
    )
    client = make(client_side=True, max_concurrent_streams=100, stream_window=1 << 20, max_header_list_size=65536)
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    return client, server


def _exchange(client: Any, server: Any, streams: int) -> None:
    """``streams`` requests in one flush, each answered, the answers in one flush, their DATA given back."""
    for _ in range(streams):
        client.send_headers(client.get_next_available_stream_id(), REQUEST, end_stream=True)
    for ev in server.receive_data(client.data_to_send()):
        if type(ev).__name__ == "RequestReceived":
            server.send_headers(ev.stream_id, RESPONSE)
            server.send_data(ev.stream_id, BODY, end_stream=True)
    for ev in client.receive_data(server.data_to_send()):
        size = getattr(ev, "flow_controlled_length", 0)
        if size:
            client.acknowledge_received_data(size, ev.stream_id)
    server.receive_data(client.data_to_send())


def pairs_per_second(codec: str, total: int, streams: int) -> float:
    client, server = _pair(codec)
    _exchange(client, server, streams)  # (warm)
    rounds = total // streams
    start = time.process_time()
    for i in range(rounds):
        if i and i % 2000 == 0:  # (stream ids run out past 2^30: a fresh connection now and then)
            client, server = _pair(codec)
        _exchange(client, server, streams)
    return rounds * streams / (time.process_time() - start)


def bench_pairs(quick: bool, rounds: int) -> tuple[list[str], bool]:
    """The pairs in the codec's mode here and, where that is the shim, in ABI mode (a process of its own)."""
    from blocks.transport._nghttp2 import MODE

    lines, ok = _pairs_here(MODE, quick, rounds)
    if MODE == "shim":
        command = [sys.executable, __file__, "--only", "pairs", "--rounds", str(rounds), *(["--quick"] * quick)]
        env = dict(os.environ, PROXYBLOCKS_NGHTTP2_SHIM="0")
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
        said = [line for line in done.stdout.splitlines() if line.startswith("pairs ")]
        print(*said, sep="\n", flush=True)
        ratios = [float(line.rsplit("x", 1)[1]) for line in said]
        if len(ratios) != 2:
            return [*lines, "ABI mode did not run"], False
        lines.append(f"ABI mode x{ratios[0]:.2f}/x{ratios[1]:.2f}")
        ok &= all(ratio >= TARGET_PAIRS["abi"] for ratio in ratios)
    return lines, ok


def _pairs_here(mode: str, quick: bool, rounds: int) -> tuple[list[str], bool]:
    lines = []
    ok = True
    total = 20000 if quick else 100000
    ratios = []
    for streams in (1, 32):
        best = {"h2": 0.0, "nghttp2": 0.0}
        for _ in range(rounds):
            for codec in ("h2", "nghttp2"):
                best[codec] = max(best[codec], pairs_per_second(codec, total, streams))
        ratio = best["nghttp2"] / best["h2"]
        ratios.append(ratio)
        ok &= ratio >= TARGET_PAIRS[mode]
        label = "one pair at a time" if streams == 1 else "32 streams per flush"
        print(
            f"pairs  {label:22}  h2 {best['h2']:8.0f}/s ({1e6 / best['h2']:5.1f} µs)"
            f"   nghttp2 {mode:4} {best['nghttp2']:8.0f}/s ({1e6 / best['nghttp2']:5.1f} µs)   x{ratio:.2f}",
            flush=True,
        )
    lines.append(f"pairs ({mode}) x{ratios[0]:.2f} one at a time, x{ratios[1]:.2f} 32 per flush")
    return lines, ok


def _serve(procs: Processes, codec: str, role: str, upstream: list[int]) -> int:
    port = free_port()
    procs.start(f"{role}-{codec}", [__file__, "--serve", codec, role, str(port), *map(str, upstream)], port)
    return port


def bench_hops(quick: bool, rounds: int, only: set[str]) -> tuple[list[str], bool]:
    lines = []
    ok = True
    n, m = (5000, 500) if quick else (20000, 2000)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        procs = Processes(tmp)
        try:
            replica = _serve(procs, "nghttp2", "replica", [])
            ports = {}
            for codec in ("h2", "nghttp2"):
                if "hop" in only:
                    ports[("hop", codec)] = _serve(procs, codec, "worker", [replica])
                if "chain" in only:
                    ports[("chain", codec)] = _serve(procs, codec, "chain", [replica])
            rps: dict[str, list[float]] = {"h2": [], "nghttp2": []}
            p50: dict[str, list[float]] = {"h2": [], "nghttp2": []}
            problems: list[str] = []
            for i in range(rounds):
                order = ["h2", "nghttp2"] if i % 2 == 0 else ["nghttp2", "h2"]
                for codec in order:
                    if "hop" in only:
                        port = ports[("hop", codec)]
                        if i == 0:
                            h2load(port, ["-n", "500", "-c", "8", "-m", "32"], timeout=60)
                        value, trouble = throughput(port, n)
                        rps[codec].append(value)
                        problems += trouble
                    if "chain" in only:
                        port = ports[("chain", codec)]
                        elapsed, trouble = latencies(port, m, tmp)
                        elapsed.sort()
                        p50[codec].append(percentile(elapsed, 0.5))
                        problems += trouble
            if "hop" in only:
                a, b = statistics.median(rps["h2"]), statistics.median(rps["nghttp2"])
                ratio = b / a
                ok &= ratio >= TARGET_HOP and not problems
                print(f"hop    worker hop rps (h2load -c 8 -m 32)      h2 {a:8.0f}   nghttp2 {b:8.0f}   x{ratio:.2f}")
                lines.append(f"1 hop rps x{ratio:.2f}")
            if "chain" in only:
                a, b = statistics.median(p50["h2"]), statistics.median(p50["nghttp2"])
                ratio = b / a
                ok &= ratio <= TARGET_CHAIN and not problems
                print(f"chain  c1 p50 µs (h2load -c 1 -m 1)            h2 {a:8.0f}   nghttp2 {b:8.0f}   x{ratio:.2f}")
                lines.append(f"chain c1 p50 x{ratio:.2f}")
            if problems:
                print("problems:", *sorted(set(problems))[:5], sep="\n  ")
                lines.append(f"{len(problems)} problems")
        finally:
            procs.stop_all()
    return lines, ok


def bench_memory(quick: bool) -> tuple[list[str], bool]:
    count = 300 if quick else 1000
    per: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        procs = Processes(Path(tmpdir))
        try:
            for codec in ("h2", "nghttp2"):
                port = _serve(procs, codec, "replica", [])
                proc = procs.all[-1]
                before = _rss(proc.popen.pid)
                socks = []
                for _ in range(count):
                    sock = socket.create_connection((HOST, port))
                    sock.sendall(_PREFACE)
                    socks.append(sock)
                for sock in socks:
                    sock.settimeout(10)
                    sock.recv(65536)  # (its SETTINGS: the connection is set up)
                time.sleep(0.5)
                per[codec] = (_rss(proc.popen.pid) - before) / count
                for sock in socks:
                    sock.close()
        finally:
            procs.stop_all()
    ratio = per["nghttp2"] / per["h2"]
    print(
        f"memory per idle connection ({count})              h2 {per['h2'] / 1024:6.1f} KiB"
        f"   nghttp2 {per['nghttp2'] / 1024:6.1f} KiB   x{ratio:.2f}"
    )
    return [f"memory x{ratio:.2f}"], ratio <= TARGET_MEMORY


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # and an empty SETTINGS


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="pairs,hop,chain,memory")
    parser.add_argument("--serve", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        codec, role, port, *upstream = args.serve
        from blocks.transport.streams import use_codec

        use_codec(codec)
        serve_role(role, int(port), [int(p) for p in upstream])
        return 0
    only = set(args.only.split(","))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft[1], soft[1]))
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs", flush=True)
    lines: list[str] = []
    ok = True
    if "pairs" in only:
        more, good = bench_pairs(args.quick, args.rounds)
        lines += more
        ok &= good
    if only & {"hop", "chain"}:
        more, good = bench_hops(args.quick, args.rounds, only)
        lines += more
        ok &= good
    if "memory" in only:
        more, good = bench_memory(args.quick)
        lines += more
        ok &= good
    pairs = f"pairs x{TARGET_PAIRS['shim']:g} (shim), x{TARGET_PAIRS['abi']:g} (ABI mode)"
    targets = f"targets: {pairs}, hop x{TARGET_HOP:g}, chain p50 x{TARGET_CHAIN:g}"
    targets += f", memory x{TARGET_MEMORY:g}"
    print(f"verdict: {'PASS' if ok else 'FAIL'} {', '.join(lines)} ({targets})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
