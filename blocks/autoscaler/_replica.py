"""One replica's task: it owns the replica's process and its record from start to exit.

A replica's life, and what every proxy sees of it through the store:

1. ``starting``: the command runs on a free port (:mod:`._process`);
   nothing in the routes. Every ``health_interval`` it is sent
   ``GET health_path``; a status under 500 makes it ready. No answer within
   ``start_timeout``, or an exit, is a failed start, and so is a live write
   the store refuses: the process is stopped, and the app's next start
   waits a backoff (0.1 s doubling to 10 s).
2. ``ready``: its record is put in the store, ``state: live``. A drain that
   arrives while that write is in flight takes it straight to draining.
3. ``draining``: its record is put again with ``state: draining`` (or, if
   the store refuses that, deleted), and it gets ``drain_timeout`` to
   finish: it is stopped once the prober reports nothing in flight on it
   (and no session) at a poll sent at least ``settle`` after the write.
   When the time is up first, its worker is asked to end what it still has
   (``DELETE /.proxyblocks/sessions`` naming it): its sessions end, reason
   ``drained``, and its WebSockets get a Close frame; then it is stopped.
4. the end, however it comes (stopped, died, the driver leaving, a
   failure): first, without awaiting anything, the policy hears ``gone``
   (a dead replica is never counted as ready while its record is deleted);
   then its record is deleted *before* the process is signalled (proxies
   stop routing to it first); then its process group is stopped (SIGTERM,
   SIGKILL after ``stop_timeout``). A delete the store refuses is kept and
   tried again every round, and the name is not reused until it lands.

This is the driver's own half, in a module of its own for size: it reads
and calls the :class:`~blocks.autoscaler.Autoscaler`'s private state, whose
bookkeeping methods (``_ready``, ``_ended``, ``_released``,
``_failed_start``) are synchronous, so that each change of a replica's
phase reaches the policy at once.

Invariant: while a record of this replica may be in the store
(``replica.entered``), its ``finally`` deletes it or leaves the key with
the driver's pending deletes; no store failure escapes this task.
"""

from __future__ import annotations

import json
import logging
import math
from typing import TYPE_CHECKING

import attrs
import trio

from blocks._sync import one_error
from blocks.autoscaler._config import ReplicaTemplate
from blocks.autoscaler._core import Phase
from blocks.autoscaler._process import ReplicaProcess
from blocks.autoscaler._store import put
from blocks.errors import SourceError
from blocks.fields import PROBE_HEADER, REPLICA_HEADER, SESSIONS_PATH
from blocks.http import Request
from blocks.routing import Address, encode_replica, format_address, route_key_for_replica

if TYPE_CHECKING:
    from blocks.autoscaler._driver import Autoscaler

log = logging.getLogger("blocks.autoscaler")


@attrs.define(eq=False)
class Replica:
    app: str
    name: str
    address: Address
    phase: Phase = "starting"
    process: ReplicaProcess | None = None
    stop: trio.Event = attrs.field(factory=trio.Event)
    start_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    entered: bool = False  # its record may be in the store (set before the live write is sent)

    @property
    def key(self) -> str:
        return route_key_for_replica(self.app, self.name)


@attrs.define(eq=False)
class AppState:
    template: ReplicaTemplate
    replicas: set[str] = attrs.field(factory=set)  # the names of its replicas the driver runs
    starts: int = 0
    failed_starts: int = 0
    restarts: int = 0
    failures: int = 0  # failed starts in a row
    backoff: float = 0.0
    hold_until: float = -math.inf


async def run_replica(scaler: Autoscaler, replica: Replica) -> None:
    """Own ``replica``'s process from start to exit (in the driver's nursery); see the module's rules."""
    app, name = replica.app, replica.name
    template = scaler.templates[app]
    try:
        argv = template.argv(app=app, name=name, port=replica.address[1])
        try:
            replica.process = await scaler._spawner.spawn(argv)
        except OSError as exc:
            scaler._failed_start(app, f"{name}: cannot run {argv[0]!r}: {exc.strerror or exc}", replica)
            return
        with one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_reap, replica.process, nursery.cancel_scope)
                await _live(scaler, replica)
                nursery.cancel_scope.cancel()
    finally:
        process = replica.process
        scaler._ended(replica, died=process is not None and process.returncode is not None)  # no await before
        with trio.CancelScope(shield=True):
            if replica.entered:
                await scaler._pending.delete(scaler.store, replica.key)
            if process is not None:
                await process.stop(scaler.config.stop_timeout)
        scaler._released(replica)


async def _live(scaler: Autoscaler, replica: Replica) -> None:
    """Health, the live record, the wait for a drain, the draining record, the drain; returns to stop."""
    app, name = replica.app, replica.name
    config = scaler.config
    healthy = False
    with replica.start_scope:
        healthy = await _until_healthy(scaler, replica)
    if replica.stop.is_set():
        return  # drained while it started: never routed
    if not healthy:
        template = scaler.templates[app]
        scaler._failed_start(
            app, f"{name}: no answer to GET {template.health_path} within {config.start_timeout:g}s", replica
        )
        return
    replica.entered = True  # before the write: however it ends from here, the finally deletes the record
    try:
        await put(scaler.store, dict([_record(scaler, replica, "live")]))
    except SourceError as exc:
        scaler._failed_start(app, f"{name}: the route store refused its live record: {exc}", replica)
        return
    if not replica.stop.is_set():  # (a drain during the write: straight to draining)
        scaler._ready(replica)
        await replica.stop.wait()
    try:
        await put(scaler.store, dict([_record(scaler, replica, "draining")]))
    except SourceError as exc:
        log.warning("%s: %s: the route store refused its draining record (%s); deleting it instead", app, name, exc)
        await scaler._pending.delete(scaler.store, replica.key)  # out of the routes by a delete, then
    await _until_drained(scaler, replica)


def _record(scaler: Autoscaler, replica: Replica, state: str) -> tuple[str, bytes]:
    template = scaler.templates[replica.app]
    value = encode_replica(
        worker=scaler.worker,
        address=replica.address,
        protocol=template.protocol,
        capacity=template.capacity,
        state=state,
    )
    return replica.key, value


async def _reap(process: ReplicaProcess, scope: trio.CancelScope) -> None:
    """Wait for the process to exit; an exit nobody asked for ends the replica's life."""
    await process.wait()
    scope.cancel()


async def _until_healthy(scaler: Autoscaler, replica: Replica) -> bool:
    """Ask ``GET health_path`` every ``health_interval`` until a status under 500; False at the timeout."""
    template = scaler.templates[replica.app]
    config = scaler.config
    host, port = replica.address
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request_path = template.health_path.encode()
    with trio.move_on_after(config.start_timeout):
        while True:
            with trio.move_on_after(max(config.health_interval, 1.0)):
                try:
                    request = Request(b"GET", b"http", authority.encode(), request_path)
                    response = await scaler._upstreams.request(replica.address, request, [], protocol=template.protocol)
                    await response.body.aclose()
                    if response.status < 500:
                        return True
                except Exception as exc:  # not up yet: refused, reset (Cancelled is not an Exception)
                    log.debug("%s: health: %s", replica.name, exc)
            await trio.sleep(config.health_interval)
    return False


async def _until_drained(scaler: Autoscaler, replica: Replica) -> None:
    """Wait until a poll sent ``settle`` after the draining write sees nothing in flight and no session;
    at ``drain_timeout``, have the worker end what is left (:func:`_end_what_is_left`)."""
    written = trio.current_time()
    config = scaler.config
    with trio.move_on_after(config.drain_timeout):
        while True:
            await scaler._wait_round()
            if scaler._round_sent >= written + config.settle and scaler._idle(replica.name):
                return
    await _end_what_is_left(scaler, replica)


END_TIMEOUT = 5.0
"""Seconds a drain past its time waits for the worker to end the replica's sessions and WebSockets (the
worker gives each WebSocket :data:`blocks.hops.END_TIMEOUT` for its Close frame, then resets it)."""


async def _end_what_is_left(scaler: Autoscaler, replica: Replica) -> None:
    """``drain_timeout`` is up: ask the worker to end the replica's sessions (``drained``) and WebSockets.

    Its worker ends every session the replica hosts (their later requests
    get a 410 ``drained``) and closes every WebSocket to it with a Close
    frame (1001), then answers; one log line says how many. A worker that
    cannot be asked (or keeps no sessions) costs at most
    :data:`END_TIMEOUT`: the replica is stopped all the same, as before.
    """
    app, name = replica.app, replica.name
    worker = scaler.worker
    request = Request(b"DELETE", b"http", format_address(worker).encode(), SESSIONS_PATH)
    fields = [(PROBE_HEADER, b"1"), (REPLICA_HEADER, name.encode())]
    failure = "no answer"
    with trio.move_on_after(END_TIMEOUT):
        try:
            response = await scaler._upstreams.request(worker, request, fields)
            try:
                body = await response.body.read_all(64 * 1024)
            finally:
                await response.body.aclose()
            if response.status != 200:
                raise ValueError(f"status {response.status}")
            answer = json.loads(body)
            ended, closed, cut = int(answer["ended"]), int(answer["websockets"]), int(answer["cut"])
        except Exception as exc:  # (Cancelled is not an Exception: the timeout is below)
            failure = f"{type(exc).__name__}: {exc}"
        else:
            log.info(
                "%s: %s still busy after drain_timeout (%gs): its worker ended %d sessions "
                "and closed %d WebSockets (%d reset)",
                app,
                name,
                scaler.config.drain_timeout,
                ended,
                closed,
                cut,
            )
            return
    log.warning(
        "%s: %s still busy after drain_timeout (%gs); its worker did not end its sessions (%s)",
        app,
        name,
        scaler.config.drain_timeout,
        failure,
    )
