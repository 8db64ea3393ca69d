"""Simulate: two configurations of the library's own policies, side by side, on the same clients.

Run it:

    python -m recipes.simulate                                   # target concurrency 1 vs 4, a ramp of load
    python -m recipes.simulate --policy least-in-flight,power-of-two --target 2 --pattern noisy --rate 5
    python -m recipes.simulate --trace trace.csv --plot out.png  # your own arrivals (time,tenant,app,session,size)

Nothing listens and nothing is sent: the routing policies, the fair queue,
the session placer and the autoscaler are the very objects the chain uses,
driven in virtual time (``blocks.simulate``) by simulated clients and
replicas (a service-time distribution, a concurrency limit, a cold start).
It prints, for each configuration, how requests ended (served, refused,
timed out, by reason), p50/p99 queueing per tenant, replica-seconds (the
cost), cold starts and the replica count over time; ``--plot FILE`` writes
a PNG of replicas and latency over time (matplotlib: the ``sim`` extra).

``--policy`` and ``--target`` take one value or two (comma-separated): two
of either make the two configurations (two of both pair them up). A flag it
cannot use is one line and exit code 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence

import attrs

from blocks import CommandParser, SchedulerConfig, SessionConfig, TenantPolicy
from blocks.autoscaler import ScalingConfig
from blocks.command import at_least, between, seconds
from blocks.simulate import (
    PATTERNS,
    POLICIES,
    Arrival,
    ReplicaModel,
    ServiceTime,
    SimConfig,
    SimResult,
    TraceError,
    format_results,
    pattern,
    plot,
    read_trace,
    simulate,
)


def listed(parse: Callable[[str], object]) -> Callable[[str], list[object]]:
    def parse_list(text: str) -> list[object]:
        values = [parse(part) for part in text.split(",")]
        if not 1 <= len(values) <= 2:
            raise argparse.ArgumentTypeError(f"{text!r} is one value or two, comma-separated")
        return values

    return parse_list


def policy_name(text: str) -> str:
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a policy ({', '.join(POLICIES)})")
    return text


def configs(args: argparse.Namespace) -> list[SimConfig]:
    """The configurations the flags describe: one per pair of ``--policy`` and ``--target``."""
    n = max(len(args.policy), len(args.target))
    policies, targets = args.policy * (n // len(args.policy)), args.target * (n // len(args.target))
    replica = ReplicaModel(
        concurrency=args.concurrency,
        service=ServiceTime(mean=args.service, distribution=args.distribution),
        cold_start=args.cold_start,
        max_sessions=args.max_sessions,
    )
    scheduler = None
    if args.budget:
        scheduler = SchedulerConfig(budget=args.budget, default_policy=TenantPolicy(max_queued=1000, queue_timeout=5))
    sessions = SessionConfig(apps={"app-0"}, queue_timeout=10.0) if args.sessions else None
    scaling = ScalingConfig(
        target_concurrency=1.0, max_replicas=args.max_replicas, up_window=10, down_window=60, idle_timeout=60
    )
    return [
        SimConfig(
            name=f"{policy} target {target:g}",
            policy=POLICIES[policy],
            replica=replica,
            scaling=attrs.evolve(scaling, target_concurrency=target),
            scheduler=scheduler,
            sessions=sessions,
            seed=args.seed,
        )
        for policy, target in zip(policies, targets, strict=True)
    ]


def main(argv: Sequence[str] | None = None, *, report: Callable[[str], None] = print) -> list[SimResult]:
    """Parse ``argv``, run each configuration over the same arrivals, report them side by side."""
    parser = CommandParser(prog="python -m recipes.simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", metavar="FILE", help="arrivals from this CSV instead of --pattern")
    parser.add_argument("--pattern", choices=PATTERNS, default="ramp", help="the clients, when no --trace")
    parser.add_argument("--rate", type=between(0.001, 1e6), default=10.0, help="sessions per second (--pattern)")
    parser.add_argument("--seconds", type=seconds, default=600.0, help="how long clients arrive (--pattern)")
    parser.add_argument("--apps", type=at_least(1), default=4, help="apps app-0 ... (--pattern)")
    parser.add_argument("--requests", type=between(1, 1e6), default=3.0, help="mean requests per session")
    parser.add_argument("--policy", type=listed(policy_name), default=["least-in-flight"], help="routing policy")
    parser.add_argument("--target", type=listed(between(0.01, 1e6)), default=[1.0, 4.0], help="target per replica")
    parser.add_argument("--concurrency", type=at_least(1), default=4, help="requests a replica serves at once")
    parser.add_argument("--service", type=between(1e-6, 1e6), default=0.1, help="mean service time, seconds")
    parser.add_argument("--distribution", choices=("exponential", "lognormal", "constant"), default="lognormal")
    parser.add_argument("--cold-start", type=seconds, default=5.0, help="seconds before a new replica serves")
    parser.add_argument("--max-replicas", type=at_least(1), default=1000, help="per app")
    parser.add_argument("--budget", type=at_least(0), default=0, help="fair-queue slots for the fleet (0: none)")
    parser.add_argument("--sessions", action="store_true", help="app-0 is a sessioned app (sticky sessions)")
    parser.add_argument("--max-sessions", type=at_least(0), default=4, help="sessions per replica (--sessions)")
    parser.add_argument("--seed", type=at_least(0), default=0, help="the seed of clients and service times")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of replicas and latency over time")
    args = parser.parse_args(argv)

    def arrivals() -> Iterable[Arrival]:
        if args.trace:
            return read_trace(args.trace)
        return pattern(
            args.pattern, rate=args.rate, duration=args.seconds, apps=args.apps, requests=args.requests, seed=args.seed
        ).arrivals()

    try:
        results = [simulate(config, arrivals()) for config in configs(args)]
        if args.plot:
            plot(results, args.plot)
    except (TraceError, ImportError, OSError) as exc:
        parser.error(str(exc))
    report(format_results(results))
    if args.plot:
        report(f"plot written to {args.plot}")
    return results


if __name__ == "__main__":
    main()  # (argparse reads sys.argv)
