"""The supervising parent of ``--processes N`` (what :func:`blocks.command.run_until_signal` runs).

Theory of operation: the parent binds the command's port with
``SO_REUSEPORT`` and keeps that socket bound but never listening, so the
port is its own for the whole run (``--port 0`` is picked here, once). For
each of the N slots it opens a listening socket on the port of its own
(``SO_REUSEPORT`` too: the kernel spreads new connections across the N
sockets by a hash of their addresses) and starts the same command line
with ``--port PORT`` appended and that socket passed down: the child serves
the socket it inherits instead of binding one, and runs its own
``trio.run``. Each child gets a Unix socket to the parent
(``PROXYBLOCKS_PROCESS=INDEX COUNT FD LISTENING_FD``): it reports on it
(JSON lines: started, with its pid and its private admin port; its startup
error; each reload's outcome; an operator's request to restart it) and
reads end-of-file there when the parent is gone, which drains it.

Why the parent holds the listening sockets: a listening socket's accept
queue (connections the kernel completed, that no process accepted yet) is
the socket's, and closing the last descriptor of it resets every connection
in it; the kernel hands them to another socket of the port only with
``net.ipv4.tcp_migrate_req=1`` (Linux 5.14 and later, a sysctl only root
sets). A planned restart of a slot therefore never closes its socket: the
replacement inherits the same socket, serves it beside the old process, and
only then is the old one drained (it stops accepting and closes its
descriptor; the socket and its queue live on in the parent and the
replacement). A crash, the one unplanned end, closes the slot's socket
once no process holds it (what was queued on it is reset with the process's
own connections, and new connections go to the other slots at once, never
to a queue no one accepts from while the slot restarts); the next start
gets a new one.

Rules: a child that exits before every child first served ends the whole
command (exit 2, with the child's one line: bad config does not loop); so
does one that has not served within ``--start-timeout`` (it is killed). A
child that dies later, or is killed for not serving in time after a
restart, is started again after a backoff that doubles from 0.1 s to 10 s
(back to 0.1 s once a child has served for 10 s), while the others serve
on. SIGHUP is sent to every serving child and answered once (``reloaded``,
or the first failure). SIGUSR2 restarts every child in turn, and SIGUSR2 to
one child restarts that one (:meth:`Supervisor.restart`): its replacement
is started on its socket, and once it serves, the old one is drained
(SIGTERM); one line says so (``restarted: process I pid OLD -> NEW``) or
why not (the replacement did not serve: it is stopped, the old one serves
on, and a rolling restart stops there). SIGINT or SIGTERM: SIGTERM to
every child (each drains within ``--grace``), then ``stopped`` and exit 0;
a child still running ``STOP_MARGIN`` seconds past the grace (after this
SIGTERM or a restart's) is SIGKILLed (one line on stderr says so); a second
signal SIGKILLs them all at once.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

import attrs
import trio

from blocks.command import SUPERVISED_VARIABLE, Operations
from blocks.observe import ProcessAdmin, serve_merged_admin
from blocks.transport.listener import HTTPServer

FIRST_BACKOFF = 0.1
"""Seconds before a dead child is started again, the first time (doubled each time after)."""
MAX_BACKOFF = 10.0
"""The most seconds between two starts of one child."""
HEALTHY_AFTER = 10.0
"""Seconds a child must serve for its next death to start the backoff over."""
RELOAD_TIMEOUT = 30.0
"""Seconds the parent waits for every child to say how its reload went."""
STOP_MARGIN = 5.0
"""Seconds past the drain's grace a child gets to exit after SIGTERM, before it is SIGKILLed."""


def supervise(
    operations: Operations, listen: tuple[str, int], *, grace: float, stop_margin: float = STOP_MARGIN
) -> int:
    """Run ``operations.processes`` copies of this command on ``listen``'s port until a signal stops them.

    Returns the exit status: 0 after a drain, 2 if the port cannot be held
    or a child fails before serving (or does not serve within
    ``operations.start_timeout``), 128 + the signal after a second one.
    A child still running ``grace + stop_margin`` seconds after its SIGTERM
    is SIGKILLed.
    """
    host, port = listen
    try:
        held = _hold_port(host, port)
    except OSError as exc:
        print(f"proxyblocks: error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    with held:
        port = held.getsockname()[1]
        command = [sys.executable, *sys.orig_argv[1:], "--port", str(port)]
        supervisor = Supervisor(
            command,
            operations.processes,
            host=host,
            port=port,
            admin_port=operations.admin_port,
            start_timeout=operations.start_timeout,
            stop_margin=stop_margin,
        )
        try:
            return trio.run(supervisor.run, grace)
        except KeyboardInterrupt:  # before the signal handlers were in place
            return 128 + signal.SIGINT
        finally:
            supervisor.close_sockets()


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT`` (and ``SO_REUSEADDR``), not listening yet."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _hold_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT``, not listening: the port stays this
    command's while its children and their sockets come and go, and no connection waits on it."""
    return _bound(host, port)


BACKLOG = 1024
"""The accept queue of each slot's listening socket (as the listener's own)."""


@attrs.define(eq=False)
class Child:
    """One of the supervised processes, across its restarts after a crash (a planned restart makes a new one)."""

    index: int
    pid: int | None = None
    process: trio.Process | None = None
    admin: int | None = None
    serving: bool = False
    served_at: float | None = None
    """When this start of it first served (``trio.current_time()``), else None."""
    late: bool = False
    """This start of it was killed for not serving within the start timeout."""
    error: str | None = None
    code: int | None = None
    """How its last start ended (a return code), once it has."""
    starts: int = 0
    reload_pending: bool = False
    trial: bool = False
    """A replacement not yet serving (:meth:`Supervisor.restart`): if it ends, that is the restart's
    failure, and it is not started again."""
    retired: bool = False
    """Replaced on purpose: drained, and not started again when it exits."""
    _reloads: tuple[trio.MemorySendChannel[str | None], trio.MemoryReceiveChannel[str | None]] = attrs.field(
        factory=lambda: trio.open_memory_channel[str | None](math.inf)
    )


def _one_cause(error: BaseException) -> BaseException:
    """The one error inside nested exception groups of one (what nurseries wrap), else ``error``."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def _ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"


@attrs.define(eq=False)
class Supervisor:
    """The parent's state: its children, and whether it is stopping. :meth:`run` is its ``trio.run``."""

    command: Sequence[str]
    count: int
    host: str
    port: int
    admin_port: int | None = None
    start_timeout: float = 60.0
    """Seconds each start of a child gets to serve; past it, it is killed."""
    stop_margin: float = STOP_MARGIN
    """Seconds past the grace a child gets to exit after SIGTERM; past it, it is killed."""
    children: list[Child] = attrs.Factory(lambda self: [Child(i) for i in range(self.count)], takes_self=True)
    """The child serving each slot (a replacement takes its predecessor's place once it serves)."""
    stopping: bool = False
    started: bool = False
    fatal: str | None = None
    grace: float = 10.0
    _sockets: list[socket.socket | None] = attrs.Factory(lambda self: [None] * self.count, takes_self=True)
    """Each slot's listening socket, while a process of the slot may hold it."""
    _holders: list[int] = attrs.Factory(lambda self: [0] * self.count, takes_self=True)
    """How many running processes inherited each slot's socket."""
    _running: set[Child] = attrs.Factory(set)
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _reload_lock: trio.Lock = attrs.field(factory=trio.Lock)
    _restart_lock: trio.Lock = attrs.field(factory=trio.Lock)
    _nursery: trio.Nursery | None = None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds (checked after each change of a child's state)."""
        while not condition():
            await self._changed.wait()

    def processes(self) -> list[ProcessAdmin]:
        return [ProcessAdmin(child.index, child.pid, child.admin, child.serving) for child in self.children]

    def pids(self) -> str:
        return " ".join(str(child.pid) if child.serving else "-" for child in self.children)

    def _listening(self, index: int) -> socket.socket:
        """Slot ``index``'s listening socket, opened if it has none (its first start, or after a crash)."""
        sock = self._sockets[index]
        if sock is None:
            sock = _bound(self.host, self.port)
            try:
                sock.listen(BACKLOG)
            except BaseException:
                sock.close()
                raise
            self._sockets[index] = sock
        return sock

    def _drop_socket(self, index: int) -> None:
        sock, self._sockets[index] = self._sockets[index], None
        if sock is not None:
            sock.close()

    def close_sockets(self) -> None:
        """Close the parent's descriptor of every slot's socket: each closes once its processes close
        theirs (stopping to accept), and new connections are then refused."""
        for index in range(self.count):
            self._drop_socket(index)

    async def run(self, grace: float) -> int:
        code = 0
        self.grace = grace
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR2) as signals:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                admin = None
                if self.admin_port is not None:  # bound before any child starts: taken, it is one line
                    serve = functools.partial(serve_merged_admin, self.processes, host=self.host, port=self.admin_port)
                    try:
                        admin = await nursery.start(serve)
                    except BaseException as exc:
                        cause = _one_cause(exc)  # (a nursery on the way may wrap it)
                        if not isinstance(cause, OSError):
                            raise
                        print(f"proxyblocks: error: {cause}", file=sys.stderr, flush=True)
                        return 2
                for child in self.children:
                    nursery.start_soon(self._keep, child)
                nursery.start_soon(self._announce, admin)
                async for signum in signals:
                    if self.fatal is not None:
                        break
                    if signum == signal.SIGHUP:
                        nursery.start_soon(self._reload)
                        continue
                    if signum == signal.SIGUSR2:
                        nursery.start_soon(self.restart)
                        continue
                    break
                if self.fatal is None:
                    print("draining...", flush=True)
                    self.stopping = True
                    self._notify()
                    for child in list(self._running):
                        if child.process is not None and child.process.returncode is None:
                            child.process.send_signal(signal.SIGTERM)
                    self.close_sockets()  # (each closes as its processes stop accepting)

                    async def second() -> None:
                        nonlocal code
                        async for signum in signals:
                            if signum not in (signal.SIGHUP, signal.SIGUSR2):
                                print("stopping now", flush=True)
                                code = 128 + signum
                                nursery.cancel_scope.cancel()  # (each child is killed on the way out)

                    nursery.start_soon(second)
                    with trio.move_on_after(grace + self.stop_margin):
                        await self.wait_for(lambda: not self._running)
                    for child in sorted(self._running, key=lambda child: (child.index, child.pid or 0)):
                        self._too_slow(child)  # (the cancel below SIGKILLs it)
                nursery.cancel_scope.cancel()
        if self.fatal is not None:
            print(f"proxyblocks: error: {self.fatal}", file=sys.stderr, flush=True)
            return 2
        if not code:
            print("stopped", flush=True)
        return code

    def _too_slow(self, child: Child) -> None:
        print(
            f"proxyblocks: process {child.index} (pid {child.pid}) did not stop within"
            f" {self.grace + self.stop_margin:g}s of SIGTERM; killing it",
            file=sys.stderr,
            flush=True,
        )

    async def _announce(self, admin: HTTPServer | None) -> None:
        await self.wait_for(lambda: all(child.serving for child in self.children))
        self.started = True
        print(f"processes: {self.pids()} (sharing {self.host}:{self.port})", flush=True)
        if admin is not None:
            print(f"admin listening on http://{self.host}:{admin.port}", flush=True)

    def _fail(self, reason: str) -> None:
        """End the command (exit 2, ``reason`` on one line): a child could not start."""
        if self.fatal is None:
            self.fatal = reason
            os.kill(os.getpid(), signal.SIGTERM)  # wake the signal loop, which sees ``fatal``

    async def _keep(self, child: Child) -> None:
        """Run ``child`` until the parent stops, starting it again whenever it dies (unless it was
        replaced on purpose, or is a replacement that never served)."""
        backoff = FIRST_BACKOFF
        while not self.stopping:
            code = await self._run_once(child)
            if self.stopping or child.retired or child.trial:
                return
            late = f"did not serve within {self.start_timeout:g}s" if child.late else None
            if not self.started:
                ended = late or f"{_ended(code)} before it served"
                self._fail(child.error or f"process {child.index} {ended}")
                return
            if child.served_at is not None and trio.current_time() - child.served_at > HEALTHY_AFTER:
                backoff = FIRST_BACKOFF
            why = child.error or late or _ended(code)
            print(
                f"proxyblocks: process {child.index} (pid {child.pid}) {why}; starting it again in {backoff:g}s",
                file=sys.stderr,
                flush=True,
            )
            await trio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _run_once(self, child: Child) -> int:
        index = child.index
        listening = self._listening(index)
        ours, theirs = socket.socketpair()
        try:
            env = {
                **os.environ,
                SUPERVISED_VARIABLE: f"{index} {self.count} {theirs.fileno()} {listening.fileno()}",
            }
            process = await trio.lowlevel.open_process(
                list(self.command),
                env=env,
                pass_fds=(theirs.fileno(), listening.fileno()),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C reaches the parent only, which drains each child once
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._holders[index] += 1
        self._running.add(child)
        child.process, child.pid, child.admin, child.error, child.code = process, process.pid, None, None, None
        child.served_at, child.late = None, False
        child.starts += 1
        if self.stopping:  # (it was being started as the drain began: it drains too)
            process.send_signal(signal.SIGTERM)
        link = trio.socket.from_stdlib_socket(ours)
        try:
            async with trio.open_nursery() as watching:
                watching.start_soon(self._watch_start, child, process)
                buffer = b""
                while data := await link.recv(65536):
                    *lines, buffer = (buffer + data).split(b"\n")
                    for line in lines:
                        self._heard(child, line)
                watching.cancel_scope.cancel()
            return await process.wait()
        finally:
            link.close()
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
            child.process, child.serving, child.code = None, False, process.returncode
            self._running.discard(child)
            self._holders[index] -= 1
            if not self._holders[index]:
                # No process accepts on it (a crash, a start that failed): what waits in its queue was
                # this process's, and new connections go to the other slots until the next start opens
                # a socket again. (A planned restart's replacement holds it before the old one stops.)
                self._drop_socket(index)
            if child.reload_pending:
                child._reloads[0].send_nowait(f"process {child.index} exited during the reload")
            self._notify()

    async def _watch_start(self, child: Child, process: trio.Process) -> None:
        """Kill ``process`` (this start of ``child``) if it has not served within the start timeout."""
        with trio.move_on_after(self.start_timeout):
            await self.wait_for(lambda: child.served_at is not None)
            return
        child.late = True
        process.kill()

    def _heard(self, child: Child, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return
        if not isinstance(message, dict):
            return
        if "started" in message:
            child.serving, child.admin, child.served_at = True, message.get("admin"), trio.current_time()
            if self.started and not child.trial:
                print(f"process {child.index} serving again: pid {child.pid}", flush=True)
                print(f"processes: {self.pids()} (sharing {self.host}:{self.port})", flush=True)
            self._notify()
        elif "error" in message:
            child.error = str(message["error"])
        elif "reloaded" in message:
            failed = message["reloaded"]
            child._reloads[0].send_nowait(None if failed is None else str(failed))
        elif "restart" in message and self._nursery is not None and self.children[child.index] is child:
            self._nursery.start_soon(self.restart, child.index)

    async def restart(self, index: int | None = None) -> bool:
        """Restart the child of slot ``index`` (None: every child in turn, stopping at a failure) with
        no connection lost: see :meth:`_replace`. Restarts run one at a time. True if all restarted."""
        async with self._restart_lock:
            done = True
            for slot in range(self.count) if index is None else [index]:
                if self.stopping or not (done := await self._replace(slot)):
                    break
            if self.started and not self.stopping:
                print(f"processes: {self.pids()} (sharing {self.host}:{self.port})", flush=True)
            return done

    async def _replace(self, index: int) -> bool:
        """Start a replacement for slot ``index``'s child on the slot's socket; once it serves, it
        takes the slot and the old child is drained (SIGTERM). One line says which, or why not."""
        old = self.children[index]
        if not old.serving or old.process is None or not self.started:
            print(f"proxyblocks: restart failed: process {index} is not serving", file=sys.stderr, flush=True)
            return False
        assert self._nursery is not None
        new = Child(index, trial=True)
        self._nursery.start_soon(self._keep, new)
        await self.wait_for(lambda: self.stopping or (new.starts > 0 and (new.serving or new.process is None)))
        if self.stopping:
            return False
        if not new.serving:  # (it ended: _keep does not start a replacement again)
            late = f"did not serve within {self.start_timeout:g}s" if new.late else None
            why = new.error or late or f"{_ended(new.code or 0)} before it served"
            print(
                f"proxyblocks: restart failed: process {index} (pid {new.pid}) {why}; pid {old.pid} serves on",
                file=sys.stderr,
                flush=True,
            )
            return False
        new.trial = False
        self.children[index] = new
        old.retired = True
        if old.process is not None:  # (else it ended just now: the replacement has the slot anyway)
            old.process.send_signal(signal.SIGTERM)
            self._nursery.start_soon(self._reap, old, old.process)
        print(f"restarted: process {index} pid {old.pid} -> {new.pid}", flush=True)
        self._notify()
        return True

    async def _reap(self, child: Child, process: trio.Process) -> None:
        """SIGKILL a drained child still running ``grace + stop_margin`` seconds after its SIGTERM."""
        with trio.move_on_after(self.grace + self.stop_margin):
            await self.wait_for(lambda: child.process is not process)
            return
        if child.process is process:
            self._too_slow(child)
            process.kill()

    async def _reload(self) -> None:
        """SIGHUP to every serving child; one line once all have answered (or the first failure)."""
        async with self._reload_lock:
            asked = [child for child in self.children if child.serving and child.process is not None]
            for child in asked:
                while True:  # (an answer left from a reload that timed out)
                    try:
                        child._reloads[1].receive_nowait()
                    except trio.WouldBlock:
                        break
                child.reload_pending = True
                child.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            failures: list[str] = []
            with trio.move_on_after(RELOAD_TIMEOUT) as waited:
                for child in asked:
                    answer = await child._reloads[1].receive()
                    child.reload_pending = False
                    if answer is not None:
                        failures.append(answer)
            for child in asked:
                child.reload_pending = False
            if waited.cancelled_caught:
                failures.append(f"not every process answered within {RELOAD_TIMEOUT:g}s")
            if failures:
                print(f"proxyblocks: reload failed: {failures[0]}", file=sys.stderr, flush=True)
            else:
                print("reloaded", flush=True)
