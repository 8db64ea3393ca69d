"""A one-waiter wake-up flag for the hot path, and a steady ticker for background rounds.

``trio.Event`` costs a ParkingLot and an allocation per round; the data path
wakes a task several times per request (writer flushes, body chunks, window
updates, response heads), always with exactly one waiter. :class:`Signal` is
the smallest correct primitive for that: ``set()`` from any task, ``wait()``
from the one owner, auto-reset on wake, cancellable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator

import trio


class Signal:
    """Auto-reset flag with at most one waiter.

    ``wait()`` returns at once, *without a checkpoint*, if the flag was set
    since the last wait: the callers are loops that always reach a real
    checkpoint soon after (a socket operation), and skipping the yield is what
    makes a buffered chunk cost nothing.
    """

    __slots__ = ("_flag", "_task")

    def __init__(self) -> None:
        self._flag = False
        self._task: trio.lowlevel.Task | None = None

    def set(self) -> None:
        task = self._task
        if task is not None:
            self._task = None
            trio.lowlevel.reschedule(task)
        else:
            self._flag = True

    async def wait(self) -> None:
        if self._flag:
            self._flag = False
            return
        if self._task is not None:
            raise trio.BusyResourceError("another task is already waiting on this Signal")
        self._task = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)


@contextlib.contextmanager
def one_error() -> Iterator[None]:
    """Around an ``open_*``'s nursery: hand back a lone error as itself, not in an ExceptionGroup.

    A block's own tasks raise nothing into its nursery, so a group of one is
    what the ``async with`` body raised; STYLE says an ``open_*`` never leaks
    an ExceptionGroup that wraps a single error. Its cause and context stay intact.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        error = group.exceptions[0]
        context = error.__context__
        try:
            raise error
        finally:
            error.__context__ = context


async def every(interval: float, step: Callable[[], Awaitable[object]], *, first: float = 0.0) -> None:
    """Await ``step()`` every ``interval`` seconds, the first ``first`` seconds from now, until cancelled.

    The ticks are fixed: a step that overran skips the ticks it missed,
    never bursting to catch up.
    """
    deadline = trio.current_time() + first
    await trio.sleep_until(deadline)
    while True:
        await step()
        deadline += interval
        now = trio.current_time()
        if deadline < now:
            deadline = now
        await trio.sleep_until(deadline)
