"""A replica's process: a process group of its own, stopped as a group, and (on Linux) dead with the driver.

Three rules, each for a way a replica could outlive what owns it:

1. **A group of its own, signalled as a group.** A command is often a
   wrapper (``sh -c``, npm, gunicorn's master) whose children do the
   serving; signalling the leader alone leaves them listening on the port.
   Each replica starts in a session of its own (so also a process group,
   whose id is the leader's pid; a Ctrl-C at the terminal reaches only the
   driver, which stops the replicas in order), and :meth:`ReplicaProcess.stop`
   sends SIGTERM to the whole group, gives it ``timeout`` to go, leader
   and all, then SIGKILLs what is left of the group.
2. **Dead with the driver (Linux only).** A driver that is SIGKILLed runs
   no ``finally``. Each replica's leader is started with
   ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (through ctypes, in the child
   before it runs the command), so the kernel kills it when its parent
   goes. The kernel's "parent" is the *thread* that forked it, not the
   process: trio's ``open_process`` forks in a worker thread of its cache,
   which exits after ten idle seconds and would take every replica with
   it. So every replica is forked by one thread of ours, :class:`Spawner`,
   which lives as long as the driver. Elsewhere (no ``prctl``), nothing
   kills a replica whose driver was killed. Either way the kernel signals
   only the leader: a wrapper's children outlive a killed driver unless the
   wrapper ``exec``\\ s its server (``sh -c 'exec python -m app'``).
3. **Waited for without a thread.** On Linux the exit is awaited on a
   pidfd (``os.pidfd_open``, Linux 5.3+); elsewhere the process is polled
   every 50 ms.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence

import attrs
import trio

log = logging.getLogger("blocks.autoscaler")

_PR_SET_PDEATHSIG = 1
_POLL = 0.05  # seconds between looks at a process or group that cannot be awaited


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl``, or None where there is none (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return function


_PRCTL = _prctl() if hasattr(os, "pidfd_open") else None


def _die_with(parent: int, prctl: Callable[..., int]) -> Callable[[], None]:
    """The child's ``preexec_fn``: SIGKILL when its parent (thread) goes, and at once if it already went."""

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the driver died between the fork and the prctl
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


@attrs.define(eq=False)
class ReplicaProcess:
    """One replica's leader process, and its process group (``pid`` is the group's id too)."""

    popen: subprocess.Popen[bytes]
    _pidfd: int | None = None
    _lock: trio.Lock = attrs.field(factory=trio.Lock)

    def __attrs_post_init__(self) -> None:
        if _PRCTL is not None:
            try:
                self._pidfd = os.pidfd_open(self.popen.pid)
            except OSError:  # a kernel before 5.3: poll
                self._pidfd = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        """Wait for the leader to exit (any number of tasks may wait); its exit code."""
        async with self._lock:
            if self._pidfd is not None and self.popen.poll() is None:
                await trio.lowlevel.wait_readable(self._pidfd)
            while True:  # (no pidfd: polled, as nothing else wakes a task for it)
                if self.popen.poll() is not None:
                    break
                await trio.sleep(_POLL)
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.popen.returncode

    def signal_group(self, signum: int) -> bool:
        """Send ``signum`` to every process of the replica's group; False if none is left."""
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            return False
        except PermissionError:  # (a group member that changed its credentials: cannot be ours to stop)
            log.warning("replica process group %d: no permission to signal it", self.pid)
            return False
        return True

    async def stop(self, timeout: float) -> None:
        """SIGTERM to the group; ``timeout`` for the leader and the rest of the group to go; SIGKILL to what is left.

        A leader that exited by itself may have left children in its group
        (a wrapper's): they get the same. Returns once the leader is reaped.
        """
        if self.signal_group(signal.SIGTERM):
            with trio.move_on_after(timeout):
                await self.wait()
                while True:  # the group may outlive its leader: a wrapper's children, not ours to wait for
                    if not self.signal_group(0):
                        break
                    await trio.sleep(_POLL)
        self.signal_group(signal.SIGKILL)
        await self.wait()


@attrs.define(eq=False)
class Spawner:
    """Forks every replica from one thread that lives as long as the driver (see rule 2 at the top).

    Use as a context manager around the driver's life; :meth:`spawn` from trio.
    """

    _jobs: queue.SimpleQueue[tuple[Sequence[str], Callable[[object], None]] | None] = attrs.field(
        factory=queue.SimpleQueue
    )
    _thread: threading.Thread | None = None

    def __enter__(self) -> Spawner:
        self._thread = threading.Thread(target=self._serve, name="autoscaler-spawner", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # The thread exits at once. Its replicas are stopped by then: the driver stops each one
        # before its task ends, and every replica task ends before the driver's nursery does.
        self._jobs.put(None)
        self._thread = None

    def _serve(self) -> None:
        parent = os.getpid()
        preexec = _die_with(parent, _PRCTL) if _PRCTL is not None else None
        while (job := self._jobs.get()) is not None:
            argv, report = job
            outcome: object
            try:
                outcome = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=preexec,  # (ctypes prctl only: see the module's rule 2)
                )
            except BaseException as exc:  # reported to the task that asked, never lost in this thread
                outcome = exc
            report(outcome)

    async def spawn(self, argv: Sequence[str]) -> ReplicaProcess:
        """Start ``argv`` (an ``OSError`` if it cannot run). A fork in progress is not cancelled: its
        process is always handed back, for the caller's ``finally`` to stop."""
        if self._thread is None:
            raise trio.ClosedResourceError("the spawner is closed")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        outcomes: list[object] = []

        def report(outcome: object) -> None:
            outcomes.append(outcome)
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:  # nobody is left to take it
                if isinstance(outcome, subprocess.Popen):
                    outcome.kill()

        self._jobs.put((list(argv), report))
        with trio.CancelScope(shield=True):
            await done.wait()
        outcome = outcomes[0]
        if isinstance(outcome, BaseException):
            raise outcome
        assert isinstance(outcome, subprocess.Popen)
        return ReplicaProcess(outcome)
