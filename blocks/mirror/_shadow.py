"""One copied request of the mirror tee, as the primary's path sees it (:class:`_Shadow`).

A :class:`_Shadow` is two things at once: the tee
(:class:`~blocks.transport._tap.Tee`) that watches the primary exchange go by,
and the state the shadow that sends the copy reads (the copy's body and its
bounded buffer, the primary's observation to compare with). The mirror
(:mod:`blocks.mirror._driver`) makes one per copied request and starts its
shadow, a task or a sink.

Invariants:

- The primary's side (``request``, ``response``, ``head``, ``abort``,
  ``closed``) only records and signals: it never blocks, never raises, and
  never waits for the shadow. A body chunk the buffer cannot take abandons
  the copy, never holds up the primary.
- The shadow is launched exactly once (``pending``): with the first request
  body byte, or once the primary is over, or when it is stopped (then it is
  counted, and nothing goes).
- ``outcome`` is set at most once, by the first reason to stop; ``over`` is
  set, and ``done`` woken, once the primary completed or broke.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from blocks.mirror._core import BodyDigest, Observation, TeeBuffer, select_headers

if TYPE_CHECKING:
    from blocks.http import Headers, Request, StreamBody
    from blocks.mirror._driver import Mirror
    from blocks.routing import Address


class _Shadow:
    """One copied request: the tee on the primary's path, and the state its shadow reads.

    The primary side (``request``, ``response``, ``head``, ``abort``,
    ``closed``) only records and signals: it never blocks or raises. What
    only a shadow task needs (the copy's body and buffer, a cancel scope, an
    event to wait on) is made when one starts: a copy without a body, read
    by a sink, never needs them.
    """

    __slots__ = (
        "address",
        "app",
        "body",
        "buffer",
        "compare_names",
        "copy_headers",
        "digest",
        "done",
        "fed",
        "headers",
        "mirror",
        "original",
        "outcome",
        "over",
        "pending",
        "primary",
        "request_ended",
        "route",
        "scope",
        "sent",
        "start",
        "status",
        "target",
        "trailers",
    )

    def __init__(
        self,
        mirror: Mirror,
        app: str,
        route: str,
        request: Request,
        address: Address,
        copy_headers: Headers,
        target: str,
        compare_names: tuple[bytes, ...],
    ) -> None:
        self.mirror = mirror
        self.app = app
        self.route = route
        self.original = request  # the primary's: the copy's head is made from it when it goes
        self.address = address
        self.copy_headers = copy_headers  # the fields the copy goes with
        self.target = target  # the shadow replica, for the in-flight count
        self.compare_names = compare_names
        self.start = self.sent = trio.current_time()  # ``sent``: when the copy went
        self.digest = BodyDigest(mirror.config.sample_bytes)
        self.status = 0
        self.headers: tuple[tuple[bytes, bytes | None], ...] = ()
        self.primary: Observation | None = None
        self.request_ended = False
        self.trailers: Headers | None = None
        self.fed = False  # a request body byte came
        self.over = False  # the primary completed, or broke
        self.pending = True  # not gone yet: it goes with the first body byte, or once the primary is over
        self.outcome: str | None = None  # why the shadow was stopped from the primary's side
        self.body: StreamBody | None = None  # the task path's: the copy's body,
        self.buffer: TeeBuffer | None = None  # what of it the shadow has not taken,
        self.scope: trio.CancelScope | None = None  # its task's scope,
        self.done: trio.Event | None = None  # set when ``over``, if the task waits for it

    def _launch(self) -> None:
        if self.pending:
            self.pending = False
            self.mirror._start(self)

    def _over(self) -> None:
        self.over = True
        if self.done is not None:
            self.done.set()

    # -- the primary's side (blocks.transport._tap.Tee) ----------------------------------------------

    def request(self, data: bytes, end: bool, trailers: Headers | None) -> None:
        if self.request_ended or self.outcome is not None:
            return
        if data:
            self.fed = True
            self._launch()  # a body: the copy streams with it (a task, with its body and buffer)
            buffer, body = self.buffer, self.body
            if buffer is None or body is None:
                return  # the mirror is closing: no task
            if not buffer.push(len(data)):
                self._stop("abandoned")
                return
            body.feed(data)
        if end:
            self.request_ended = True
            self.trailers = trailers
            if self.body is not None:
                self.body.end(trailers)

    def head(self, status: int, headers: Headers) -> None:
        self.status = status
        self.headers = select_headers(headers, self.compare_names)

    def response(self, data: bytes, end: bool, trailers: Headers | None) -> None:
        if self.primary is not None:
            return
        if data:
            self.digest.update(data)
        if end:
            digest = self.digest
            self.primary = Observation(
                self.status,
                self.headers,
                digest.length,
                digest.hexdigest(),
                trio.current_time() - self.start,
                digest.sample,
            )
            self._over()

    def abort(self) -> None:
        self._stop("aborted")

    def closed(self) -> None:
        if self.primary is None or not self.request_ended:
            self._stop("aborted")  # the primary broke (or was cut short): the copy goes with it
        self._over()
        # A request without a body is copied once the primary's exchange is over: the
        # shadow's work never competes with the primary's, on its way there or back.
        self._launch()

    def _stop(self, outcome: str) -> None:
        scope = self.scope
        if self.outcome is None and (scope is None or not scope.cancelled_caught):
            self.outcome = outcome
            if scope is not None:
                scope.cancel()
            if self.buffer is not None:
                self.buffer.close()
            self._over()
            self._launch()  # never sent: it is counted, and nothing goes
