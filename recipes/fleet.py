"""A fleet: two proxy processes share their routes through one etcd, and share no fate.

What it shows: routing state that lives in etcd and in every proxy's
memory at once. Each proxy keeps a RouteCache in sync with etcd in the
background (``open_route_cache``) and routes from memory, never calling
etcd on a request. A route changed with ``routectl`` reaches both proxies
within a moment; a proxy killed with ``kill -9`` takes nothing down with it;
and if etcd itself goes away, both proxies keep routing with the last routes
they had, catching up when it is back.

Run it (it starts etcd on loopback from Debian's ``etcd-server``, a worker
with two demo replicas in this process, and two proxy processes):

    python -m recipes.fleet
    python -m recipes.fleet --etcd http://127.0.0.1:2379      # use an etcd you run

It prints the etcd URL and each proxy's URL and PID. Poke it:

    curl -H 'host: demo.example' http://127.0.0.1:PORT_A/        # hello from replica-N
    curl -H 'host: new.example' http://127.0.0.1:PORT_B/         # 503: no route for it yet
    python -m blocks.routectl --etcd ETCD_URL put-domain new.example demo
    curl -H 'host: new.example' http://127.0.0.1:PORT_A/         # now 200, on both proxies
    python -m blocks.routectl --etcd ETCD_URL list
    kill -9 PID_A; curl -H 'host: demo.example' http://127.0.0.1:PORT_B/   # B keeps serving

Ctrl-C (or SIGTERM) stops the proxies, then the rest. ``--role proxy`` is
how this script starts each proxy process; it is not meant to be run by hand
(though it can be, pointed at any etcd holding routes).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import trio

from blocks import (
    HTTPServer,
    LocalReplica,
    encode_domain,
    encode_replica,
    route_key_for_domain,
    route_key_for_replica,
    serve_demo_replica,
    serve_proxy,
    serve_worker,
)
from blocks.sources import EtcdSource, SourceUnavailable, open_route_cache

HOST = "127.0.0.1"
PROGRESS_INTERVAL = 1.0
"""The progress-notification interval of the etcd this recipe starts, in seconds: an idle
watch hears from etcd that often, and one silent for three of them is reopened."""


NO_ETCD = "no etcd binary: `apt-get install etcd-server`, or pass --etcd URL"


@attrs.define(eq=False)
class ProxyProcess:
    name: str
    port: int
    process: trio.Process

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid


@attrs.define(eq=False)
class Fleet:
    """A running fleet, as ``main`` reports it to ``task_status``."""

    etcd: str
    proxies: list[ProxyProcess]
    worker: HTTPServer
    replicas: list[HTTPServer]
    _cancel: trio.CancelScope

    def kill(self, name: str) -> None:
        """SIGKILL one proxy process by PID, as a crash would."""
        for proxy in self.proxies:
            if proxy.name == name and proxy.process.returncode is None:
                os.kill(proxy.pid, signal.SIGKILL)

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop the proxies (SIGTERM: they drain), then the worker, the replicas and etcd."""
        for proxy in self.proxies:
            if proxy.process.returncode is None:
                proxy.process.terminate()
        with trio.move_on_after(grace + 2):
            for proxy in self.proxies:
                await proxy.process.wait()
        for server in (self.worker, *self.replicas):
            await server.aclose(1.0)
        self._cancel.cancel()


# -- etcd, when the recipe runs its own ----------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


async def serve_etcd(data_dir: Path, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Run one etcd member on loopback until cancelled; report its client URL once it answers."""
    binary = shutil.which("etcd")
    if binary is None:
        raise RuntimeError(NO_ETCD)
    client, peer = f"http://{HOST}:{_free_port()}", f"http://{HOST}:{_free_port()}"
    command = [
        binary,
        "--name=fleet",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=fleet={peer}",
        f"--experimental-watch-progress-notify-interval={int(PROGRESS_INTERVAL * 1000)}ms",
        "--log-level=error",
        "--logger=zap",
    ]
    with (data_dir.parent / "etcd.log").open("ab") as log:
        # Its own session, as for the proxies: Ctrl-C reaches this process only, which stops the
        # children in order (proxies first, etcd last) rather than all at once.
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    try:
        source = EtcdSource(client, request_timeout=1.0)
        with trio.fail_after(20):
            while True:
                try:
                    await source.snapshot()
                    break
                except SourceUnavailable:
                    if process.poll() is not None:
                        raise RuntimeError(f"etcd exited with {process.returncode}; see {log.name}") from None
                    await trio.sleep(0.1)
        task_status.started(client)
        await process.wait()
        raise RuntimeError(f"etcd exited with {process.returncode}; see {log.name}")
    finally:
        if process.returncode is None:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()


# -- the proxy processes --------------------------------------------------------------------------


async def run_proxy_process(
    name: str, etcd: str, progress_interval: float, *, task_status: trio.TaskStatus[ProxyProcess]
) -> None:
    """Start ``python -m recipes.fleet --role proxy``; report it once it listens; echo its output."""
    command = [sys.executable, "-m", "recipes.fleet", "--role", "proxy", "--name", name, "--etcd", etcd]
    command += ["--progress-interval", str(progress_interval)]
    process = await trio.lowlevel.open_process(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None
    try:
        buffer = b""
        started = False
        while True:
            chunk = await process.stdout.receive_some(4096)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                if not started and text.startswith(f"proxy {name} listening on "):
                    port = int(text.split()[4].rpartition(":")[2])
                    task_status.started(ProxyProcess(name, port, process))
                    started = True
                print(f"[proxy {name}] {text}", flush=True)
        await process.wait()
        if not started:
            raise RuntimeError(f"proxy {name} exited with {process.returncode} before it listened")
    finally:
        if process.returncode is None:
            process.terminate()
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await process.wait()
            if process.returncode is None:
                process.kill()


async def serve_fleet_proxy(
    etcd: str,
    *,
    name: str = "proxy",
    port: int = 0,
    progress_interval: float = 600.0,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """One proxy of the fleet (what ``--role proxy`` runs): routes from a cache that follows etcd."""
    source = EtcdSource(etcd, progress_interval=progress_interval)
    async with open_route_cache(source) as routes, trio.open_nursery() as nursery:
        server, _ = await nursery.start(functools.partial(serve_proxy, routes.cache, port=port))
        print(f"proxy {name} listening on http://{HOST}:{server.port} pid {os.getpid()}", flush=True)
        task_status.started(server)
        await trio.sleep_forever()


# -- the whole fleet ------------------------------------------------------------------------------


async def main(
    *,
    etcd: str | None = None,
    proxies: int = 2,
    replicas: int = 2,
    progress_interval: float | None = None,
    announce: bool = True,
    task_status: trio.TaskStatus[Fleet] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start etcd (unless given), the worker and replicas, the routes, then the proxy processes.

    Reports a :class:`Fleet` once every proxy listens; runs until shut down.
    """
    if not 1 <= proxies <= 26 or replicas < 1:
        raise ValueError("--proxies must be 1 to 26 and --replicas at least 1")
    async with trio.open_nursery() as nursery:
        if etcd is None:
            data_dir = Path(tempfile.mkdtemp(prefix="proxyblocks-fleet-")) / "etcd"
            etcd = await nursery.start(serve_etcd, data_dir)
            progress_interval = progress_interval or PROGRESS_INTERVAL
        servers = []
        local: dict[str, LocalReplica] = {}
        for i in range(replicas):
            server = await nursery.start(serve_demo_replica, f"replica-{i}")
            servers.append(server)
            local[f"replica-{i}"] = LocalReplica((HOST, server.port))
        worker, _ = await nursery.start(serve_worker, local)

        # The routes go to etcd, not to the proxies: they learn them from there.
        writer = EtcdSource(etcd)
        await writer.put(route_key_for_domain("demo.example"), encode_domain("demo"))
        for name, replica in local.items():
            value = encode_replica(worker=(HOST, worker.port), address=replica.address)
            await writer.put(route_key_for_replica("demo", name), value)

        started = []
        for letter in "abcdefghijklmnopqrstuvwxyz"[:proxies]:
            started.append(
                await nursery.start(functools.partial(run_proxy_process, letter, etcd, progress_interval or 600.0))
            )
        fleet = Fleet(etcd, started, worker, servers, nursery.cancel_scope)
        if announce:
            print(f"etcd at {etcd}  (python -m blocks.routectl --etcd {etcd} list)", flush=True)
            for proxy in started:
                print(f"proxy {proxy.name}: {proxy.url}  pid {proxy.pid}", flush=True)
            print(f"try: curl -H 'host: demo.example' {started[0].url}/", flush=True)
        task_status.started(fleet)


async def _run(args: argparse.Namespace) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            if args.role == "proxy":
                if args.etcd is None:
                    raise SystemExit("--role proxy needs --etcd URL")
                server: HTTPServer = await nursery.start(
                    functools.partial(
                        serve_fleet_proxy,
                        args.etcd,
                        name=args.name,
                        port=args.port,
                        progress_interval=args.progress_interval or 600.0,
                    )
                )
                async for _ in signals:
                    break
                await server.aclose(args.grace)
                nursery.cancel_scope.cancel()
                return
            fleet: Fleet = await nursery.start(
                functools.partial(
                    main,
                    etcd=args.etcd,
                    proxies=args.proxies,
                    replicas=args.replicas,
                    progress_interval=args.progress_interval,
                )
            )
            async for _ in signals:
                break
            print("stopping...", flush=True)
            await fleet.shutdown(args.grace)
    if args.role == "fleet":
        print("stopped", flush=True)


def run() -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--etcd", metavar="URL", help="use this etcd instead of starting one")
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=None,
        help="the etcd's --experimental-watch-progress-notify-interval in seconds "
        f"(default: {PROGRESS_INTERVAL:g} for the etcd this starts, else etcd's default 600)",
    )
    parser.add_argument("--proxies", type=int, default=2, help="proxy processes (default: 2)")
    parser.add_argument("--replicas", type=int, default=2, help="demo replicas behind the worker (default: 2)")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds requests in flight get on shutdown")
    parser.add_argument("--role", choices=("fleet", "proxy"), default="fleet", help=argparse.SUPPRESS)
    parser.add_argument("--name", default="proxy", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.etcd is None and shutil.which("etcd") is None:
        parser.error(NO_ETCD)
    trio.run(_run, args)


if __name__ == "__main__":
    run()
