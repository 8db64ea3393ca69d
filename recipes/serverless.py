"""Serverless: the chain in front of replicas an autoscaler starts and drains, 0 -> N -> 0.

What it shows: edge -> proxy -> worker -> replicas of the app "demo", none
running at first. Each replica is a process of its own, started from a
command template (the demo replica by default; any HTTP server that takes a
port will do), entered in the routes once it answers a health request, and
drained (out of the routes, its requests finished) before it stops. The
autoscaler aims at ``--target`` requests in flight per replica, from the
prober's figures, within ``--min-replicas`` and ``--max-replicas``. The
first request for an app at zero waits (``--cold-start-timeout``) while its
first replica starts; concurrent ones share that start. Every second it
prints the app's replicas (starting, ready, draining), its requests in
flight and the requests waiting for a cold start.

Run it:

    python -m recipes.serverless                         # prints: edge listening on http://127.0.0.1:PORT
    python -m recipes.serverless --command 'python3 -m http.server {port} --bind {host}' --protocol h1
    python -m recipes.serverless --target 2 --max-replicas 8 --down-window 30 --idle-timeout 30

Poke it:

    curl -i http://127.0.0.1:PORT/                      # the first one waits for the cold start
    h2load -n 2000 -c 20 'http://127.0.0.1:PORT/sleep?ms=200'   # load: watch the replicas grow, then go

Ctrl-C drains the chain and stops every replica process.
"""

from __future__ import annotations

import functools
import shlex
import shutil
import sys

import attrs
import trio

from blocks import Chain, CommandParser, run_until_signal, serve_chain
from blocks.autoscaler import (
    AutoscalePolicy,
    Autoscaler,
    ColdStartGate,
    DriverConfig,
    ReplicaTemplate,
    ScalingConfig,
    serve_autoscaler,
)
from blocks.command import Operations, at_least, port_number, seconds

APP = "demo"
DEMO = f"{shlex.quote(sys.executable)} -m blocks.testing.replica --port {{port}} --name {{name}}"


@attrs.define(eq=False)
class Serverless:
    """The running topology, as ``main`` reports it."""

    chain: Chain
    scaler: Autoscaler

    async def shutdown(self, grace: float = 10.0) -> None:
        await self.chain.shutdown(grace)  # the replicas stop with the chain, after it drained


def status(scaler: Autoscaler) -> str:
    """One line per app: its replicas by phase, in flight, and requests waiting for a cold start."""
    return "\n".join(
        f"{app}: {s.starting} starting, {s.ready} ready, {s.draining} draining (want {s.wanted}); "
        f"in flight {s.in_flight}, queue {s.waiting}"
        for app, s in scaler.statistics().apps.items()
    )


async def print_status(scaler: Autoscaler, every: float, *, task_status: trio.TaskStatus[None]) -> None:
    task_status.started()
    while True:
        await trio.sleep(every)
        print(status(scaler), flush=True)


async def main(
    *,
    port: int = 0,
    command: str = DEMO,
    protocol: str = "h2",
    health_path: str = "/",
    scaling: ScalingConfig | None = None,
    driver: DriverConfig | None = None,
    every: float = 1.0,
    operations: Operations | None = None,
    announce: bool = True,
    task_status: trio.TaskStatus[Serverless] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the chain and the autoscaler; report a :class:`Serverless`; serve until shut down."""
    template = ReplicaTemplate(command=command, protocol=protocol, health_path=health_path, domains=["*"])
    if shutil.which(template.argv(app=APP, name=APP, port=0)[0]) is None:
        raise ValueError(f"--command: no program {shlex.split(command)[0]!r}")
    policy = AutoscalePolicy({APP: scaling or ScalingConfig(target_concurrency=4)})
    scalers: list[Autoscaler] = []

    async def build(chain: Chain) -> None:
        worker_server, _ = await chain.start_worker({}, app=None)  # it reaches each replica its route names
        serve = functools.partial(serve_autoscaler, policy, {APP: template}, chain.store, config=driver)
        scalers.append(await chain.start(functools.partial(serve, worker=(chain.host, worker_server.port))))
        await chain.start_proxy(features=[ColdStartGate(scalers[0], chain.cache)])
        await chain.start_edge(port=port)
        await chain.start(print_status, scalers[0], every)

    async with trio.open_nursery() as nursery:
        chain = await nursery.start(functools.partial(serve_chain, build, announce=announce, operations=operations))
        task_status.started(Serverless(chain, scalers[0]))


def run() -> None:
    parser = CommandParser(prog="python -m recipes.serverless", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=port_number, default=0, help="edge port (0: any free port)")
    parser.add_argument("--command", default=DEMO, help="a replica's command: {port}, {host}, {name}, {app}")
    parser.add_argument("--protocol", choices=["h1", "h2"], default="h2", help="what the worker speaks to it")
    parser.add_argument("--health-path", default="/", help="a replica is ready once this answers under 500")
    parser.add_argument("--target", type=seconds, default=4.0, help="requests in flight per replica to aim for")
    parser.add_argument("--min-replicas", type=at_least(0), default=0, help="never fewer (0: scale to zero)")
    parser.add_argument("--max-replicas", type=at_least(1), default=5, help="never more")
    parser.add_argument("--buffer", type=at_least(0), default=0, help="spare replicas while in use")
    parser.add_argument("--up-window", type=seconds, default=2.0, help="scale up on this average")
    parser.add_argument("--down-window", type=seconds, default=10.0, help="scale down on this average")
    parser.add_argument("--idle-timeout", type=seconds, default=10.0, help="idle this long: scale to zero")
    parser.add_argument("--cold-start-timeout", type=seconds, default=30.0, help="a request's wait at zero")
    parser.add_argument("--drain-timeout", type=seconds, default=30.0, help="a draining replica's grace")
    args = parser.parse_args()
    try:
        knobs = ("min_replicas", "max_replicas", "up_window", "down_window", "idle_timeout")
        knobs_set = {name: getattr(args, name) for name in knobs}
        scaling = ScalingConfig(target_concurrency=args.target, buffer_replicas=args.buffer, **knobs_set)
        driver = DriverConfig(cold_start_timeout=args.cold_start_timeout, drain_timeout=args.drain_timeout)
        ReplicaTemplate(command=args.command, protocol=args.protocol, health_path=args.health_path)
    except ValueError as exc:
        parser.error(str(exc))
    start = functools.partial(main, port=args.port, command=args.command, protocol=args.protocol)
    start = functools.partial(start, health_path=args.health_path, scaling=scaling, driver=driver)
    run_until_signal(functools.partial(start, operations=args.operations), grace=args.drain_timeout)


if __name__ == "__main__":
    run()
