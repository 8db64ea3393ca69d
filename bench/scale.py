"""Scale: the chain with processes per hop, its memory per connection and over a long run, token streams.

One benchmark for the three measurements of ``docs/scale.md``, each a
module of its own that also runs alone (see their docstrings for what and
how they measure):

``processes``  ``_scale_processes.py``: the chain recipe with ``--processes 2``
               against one process, side by side (rps >= 1.8x, c1 p50 <= 1.05x),
               and a route change reaching every process.
``memory``     ``_scale_memory.py``: 10,000 idle client connections at the edge
               (<= 40 KiB each), then a soak at 80% of the measured maximum rps
               (no failed request, every process's RSS growth < 5%).
``tokens``     ``_scale_tokens.py``: CPU per token through the chain against a
               baseline checkout, side by side (5x less back to back, 2x less
               spaced 5 ms apart, the spaced token delay unchanged).

The token streams' baseline is the code before them: ``--baseline DIR`` (a
checkout, e.g. ``git worktree add --detach /tmp/tok-base REV``), or by
default a temporary worktree of :data:`TOKENS_BASELINE_REV`, made and removed
here (this needs the repository's git history).

Run it from the repository root (needs h2load: ``apt-get install nghttp2-client``)::

    python bench/scale.py                       # everything at full size (about 30 minutes)
    python bench/scale.py --quick               # shorter runs, 2,000 idle connections, a 2-minute soak
    python bench/scale.py --only tokens,memory  # some of them

It ends with one line, ``verdict: PASS|FAIL <figures vs targets>``: PASS when
every measurement run met its targets.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _scale_memory
import _scale_processes
import _scale_tokens
from _harness import ROOT, load_average

TOKENS_BASELINE_REV = "bf432fe"
"""The last commit of main before token streams: what ``tokens`` compares with by default."""
PARTS = ("processes", "memory", "tokens")


@contextlib.contextmanager
def _baseline(given: Path | None, rev: str) -> Iterator[Path]:
    """``given``, or a temporary git worktree of ``rev`` for the length of the block."""
    if given is not None:
        yield given.resolve()
        return
    where = Path(tempfile.mkdtemp(prefix="proxyblocks-scale-baseline-")) / "tree"
    git = ["git", "-C", str(ROOT)]
    subprocess.run([*git, "worktree", "add", "--detach", str(where), rev], check=True, capture_output=True)
    try:
        yield where
    finally:
        subprocess.run([*git, "worktree", "remove", "--force", str(where)], check=False, capture_output=True)
        shutil.rmtree(where.parent, ignore_errors=True)


def _processes(args: argparse.Namespace) -> tuple[bool, str]:
    quick = args.quick
    report = _scale_processes.run_scale_processes(
        duration=4.0 if quick else 10.0, m=1000 if quick else 2000, rounds=2 if quick else 3
    )
    print("\n".join(report.lines()))
    return report.ok, report.verdict().removeprefix("verdict: ").split(" ", 1)[1]


def _memory(args: argparse.Namespace) -> tuple[bool, str]:
    idle = _scale_memory.measure_idle(2000 if args.quick else 10_000)
    _scale_memory.print_idle(idle)
    soaked = _scale_memory.soak(2.0 if args.quick else 10.0)
    _scale_memory.print_soak(soaked)
    return _scale_memory.verdict(idle, soaked)


def _tokens(args: argparse.Namespace) -> tuple[bool, str]:
    with _baseline(args.baseline, args.baseline_rev) as baseline:
        figures = _scale_tokens.run(
            20_000 if args.quick else 100_000, 300 if args.quick else 1000, 5, 1 if args.quick else 3, baseline
        )
    return _scale_tokens.report(figures)


RUN: dict[str, Callable[[argparse.Namespace], tuple[bool, str]]] = {
    "processes": _processes,
    "memory": _memory,
    "tokens": _tokens,
}


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(PARTS)}")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=_parts, default=list(PARTS), help=f"some of {','.join(PARTS)} (default all)")
    parser.add_argument("--quick", action="store_true", help="shorter runs, fewer connections, a 2-minute soak")
    parser.add_argument("--baseline", type=Path, metavar="DIR", help="the token streams' baseline checkout")
    parser.add_argument(
        "--baseline-rev", default=TOKENS_BASELINE_REV, help=f"else a worktree of this (default {TOKENS_BASELINE_REV})"
    )
    args = parser.parse_args(argv)
    if shutil.which("h2load") is None:
        print("h2load not found: install it with `apt-get install nghttp2-client`", file=sys.stderr)
        return 2
    if args.baseline is not None and not (args.baseline / "bench" / "chain.py").exists():
        parser.error(f"--baseline {args.baseline}: no bench/chain.py there")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so every server is stopped
    os.chdir(ROOT)
    print(f"{os.cpu_count()} CPUs; load average before: {load_average()}", flush=True)
    results: list[tuple[str, bool, str]] = []
    try:
        for part in args.only:
            print(f"\n== {part}", flush=True)
            ok, figures = RUN[part](args)
            print(f"{part}: {'PASS' if ok else 'FAIL'} {figures}", flush=True)
            results.append((part, ok, figures))
    except KeyboardInterrupt:
        print("interrupted; servers stopped", file=sys.stderr)
        return 130
    print(f"\nload average after: {load_average()}  (other processes on the machine skew the figures)")
    ok = all(passed for _, passed, _ in results)
    print(f"verdict: {'PASS' if ok else 'FAIL'} " + "; ".join(f"{part}: {figures}" for part, _, figures in results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
