"""The HTTP/2 pool of one upstream address (``_H2Pool``): a stream slot, or a new connection for one; a
request's stream and its body pump; the splice and sink fast paths; the retry of a refused stream; the
sweep of streams whose response or request is overdue."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import trio

from blocks._sync import Signal
from blocks.errors import StreamReset, UpstreamConnectError, UpstreamProtocolError, UpstreamTimeout
from blocks.http import Headers, Request, Response, abandon
from blocks.transport import Address
from blocks.transport._codec import ProtocolError
from blocks.transport._h2 import H2Driver, H2Stream, flush_marked, in_batch
from blocks.transport._splice import HeadFilter, Sink
from blocks.transport.multiplexer._config import Dial, PoolStatistics, UpstreamConfig
from blocks.transport.multiplexer._h2pool._connection import _CANCEL, H2ClientConnection
from blocks.transport.multiplexer._h2retry import _Refused, _Replay, _Upload

log = logging.getLogger("blocks.multiplexer")


_IDLE_MARGIN = 0.8
"""Of the longest idle close an upstream was seen to make: how long a connection to it may idle and still be used."""


class _Attempt:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class _H2Pool:
    def __init__(
        self,
        address: Address,
        config: UpstreamConfig,
        nursery: trio.Nursery,
        *,
        dial: Dial | None = None,
        protocol: str = "h2",
        watch: Signal | None = None,
    ) -> None:
        self.address = address
        # Set when a stream gets a deadline (waiting, stalled): wakes the sweeper that expires them.
        self.watch = watch if watch is not None else Signal()
        self.config = config
        self.nursery = nursery
        self.protocol = protocol  # as the statistics name it: "h2", or "https" over TLS
        self._dial: Dial = dial or functools.partial(trio.open_tcp_stream, *address)
        self.connections: list[H2ClientConnection] = []
        # Streams waiting for a response head -> their deadline. Insertion
        # order is deadline order (one timeout per pool), so the sweeper only
        # looks at the front.
        self.waiting: dict[H2Stream, tuple[float, H2ClientConnection]] = {}
        # Streams whose request waits for the upstream's window (or our writer): see expire.
        self.stalled: dict[H2Stream, H2ClientConnection] = {}
        self.retries = 0
        self._attempt: _Attempt | None = None
        self._freed = trio.Event()
        self._keeping = False  # the keepalive task runs (while the pool has connections)
        # How long the upstream lets a connection idle, as far as its idle closes showed (see closed_idle).
        self.idle_limit: float | None = None

    def statistics(self) -> PoolStatistics:
        connections = tuple(c.statistics() for c in self.connections)
        streams = sum(c.streams for c in connections)
        return PoolStatistics(self.address, self.protocol, len(connections), streams, self.retries, connections)

    def slot_freed(self) -> None:
        self._freed.set()

    def remove(self, conn: H2ClientConnection) -> None:
        if conn in self.connections:
            self.connections.remove(conn)
        self._freed.set()

    async def _connect(self, attempt: _Attempt) -> None:
        try:
            with trio.fail_after(self.config.connect_timeout):
                await self.adopt(await self._dial())
        except (OSError, trio.TooSlowError, RuntimeError) as exc:
            attempt.error = exc
        finally:
            self._attempt = None
            attempt.done.set()
            self._freed.set()

    async def adopt(self, stream: trio.abc.Stream) -> None:
        """Run an h2 connection on ``stream`` (just opened); it joins the pool once the peer's SETTINGS came."""
        conn = H2ClientConnection(stream, self)
        await self.nursery.start(conn.run)
        self.connections.append(conn)
        if not self._keeping:
            self._keeping = True
            self.nursery.start_soon(self._keepalive)

    async def _keepalive(self) -> None:
        """One look at every connection each ``keepalive_tick`` (their idle timeout, quiet time and
        PING: ``H2ClientConnection.keepalive``), while the pool has any: one task per pool, none per
        request."""
        tick = self.config.keepalive_tick
        try:
            while self.connections:
                await trio.sleep(tick)
                now = trio.current_time()
                for conn in tuple(self.connections):
                    conn.keepalive(now)
        finally:
            self._keeping = False

    def replace(self) -> None:
        """A connection took its last request (``max_requests_per_connection``): open its successor
        now, in the background, if no other connection takes new streams, so that the next request
        finds it ready instead of waiting for a connect."""
        if self._attempt is None and not any(c.accepting for c in self.connections):
            attempt = self._attempt = _Attempt()
            self.nursery.start_soon(self._connect, attempt)

    def closed_idle(self, age: float) -> None:
        """The upstream closed a connection of ours that had been idle ``age`` seconds, with no GOAWAY
        (hypercorn's and uvicorn's keep-alive timeout does so): from now on a connection idle for
        most of that long is not sent a stream (see :meth:`_stale`), so a request never races the
        next such close. The longest idle close seen counts (a shorter one may be a restart); closes
        within half a second of idling teach nothing."""
        if age >= 0.5 and (self.idle_limit is None or age * _IDLE_MARGIN > self.idle_limit):
            self.idle_limit = age * _IDLE_MARGIN
            log.info(
                "upstream %s closes connections idle for %.1fs: idle ones are closed after %.1fs",
                self.address,
                age,
                self.idle_limit,
            )

    def _stale(self, conn: H2ClientConnection) -> bool:
        """``conn`` has no stream and has been idle past :attr:`idle_limit`: it is closed, not used."""
        limit = self.idle_limit
        if limit is None or conn.streams or trio.current_time() - conn.idle_at < limit:
            return False
        conn.close()
        return True

    def _free(self, avoid: H2ClientConnection | None = None) -> H2ClientConnection | None:
        for conn in self.connections:
            if conn.has_slot and conn is not avoid and not (self.idle_limit is not None and self._stale(conn)):
                return conn
        return None

    async def acquire(self, avoid: H2ClientConnection | None = None) -> H2ClientConnection:
        """A connection with a free stream slot; waits for one if the pool is full.

        ``avoid`` (the connection that refused a stream) is taken only when no
        other connection has a slot and no new one may be opened.
        """
        while True:
            fallback = None
            for conn in tuple(self.connections):
                if conn.has_slot and not (self.idle_limit is not None and self._stale(conn)):
                    if conn is not avoid:
                        return conn
                    fallback = conn
            attempt = self._attempt
            # Draining connections (after a GOAWAY) do not count: they take no new streams.
            if attempt is None and sum(c.accepting for c in self.connections) < self.config.max_connections:
                attempt = self._attempt = _Attempt()
                self.nursery.start_soon(self._connect, attempt)
            if attempt is not None:
                await attempt.done.wait()
                if attempt.error is not None:
                    raise UpstreamConnectError(
                        f"cannot connect to {self.address[0]}:{self.address[1]}: {attempt.error}"
                    ) from attempt.error
                continue
            if fallback is not None:
                return fallback
            if self._freed.is_set():
                self._freed = trio.Event()
            await self._freed.wait()

    def expire(self, now: float) -> None:
        """Fail every stream whose response head is overdue, or whose request the upstream has
        taken no byte of for ``stall_timeout``: 504."""
        if self.stalled:
            self._expire_stalls(now)
        waiting = self.waiting
        while waiting:
            st = next(iter(waiting))
            deadline, conn = waiting[st]
            if deadline > now:
                return
            del waiting[st]
            st.error = UpstreamTimeout(f"no response from {self.address} within {self.config.response_timeout}s")
            conn.reset(st, _CANCEL)

    def _expire_stalls(self, now: float) -> None:
        limit = self.config.stall_timeout
        for st, conn in list(self.stalled.items()):
            since = st.stalled_since
            if since is None or st.closed:
                del self.stalled[st]  # it moved on, or ended
            elif now - since >= limit:
                del self.stalled[st]
                st.error = UpstreamTimeout(f"{self.address} took no byte of the request for {limit}s")
                conn.reset(st, _CANCEL)

    def splice(
        self,
        request: Request,
        headers: Headers,
        down: H2Driver,
        down_st: H2Stream,
        request_ended: bool,
        head_filter: HeadFilter | None,
        on_close: Callable[[], None] | None,
    ) -> bool:
        conn = self._free()
        if conn is None:
            return False
        try:
            conn.open_spliced(
                request, headers, down, down_st, request_ended=request_ended, head_filter=head_filter, on_close=on_close
            )
        except (ProtocolError, UpstreamProtocolError):
            return False  # the handler path tries again, and answers the error if it stands
        return True

    def sink(self, request: Request, headers: Headers, sink: Sink) -> bool:
        """Send a body-less request on a free slot, its response to ``sink``; False if no slot is free now."""
        conn = self._free()
        if conn is None:
            return False
        try:
            st = conn._send_head(request, headers, True)
        except (ProtocolError, UpstreamProtocolError):
            return False
        st.splice = sink  # type: ignore[assignment]  # duck-typed: the drivers call what a splice has
        sink.opened(conn, st)
        # Written after what the caller's batch marked before (a primary's last frames), and
        # with every other head sent to this connection in the same batch.
        conn.mark()
        if not in_batch():
            flush_marked()
        return True

    async def resplice(self, replay: _Replay, refused_by: H2Driver | None) -> None:
        """Retry a refused spliced stream on another connection (a task: it may have to open one)."""
        timeout = self.config.response_timeout
        self.retries += 1
        try:
            conn = None
            with trio.move_on_after(timeout):
                conn = await self.acquire(refused_by if isinstance(refused_by, H2ClientConnection) else None)
            if replay.splice.closed:
                return  # the downstream stream went away meanwhile
            if conn is None:
                raise UpstreamTimeout(f"no stream slot at {self.address} within {timeout}s")
            replay.resume(conn)  # (on the response clock from the request's end, as any stream)
        except (UpstreamConnectError, UpstreamTimeout, UpstreamProtocolError, ProtocolError) as exc:
            if not replay.splice.closed:
                replay.give_up(exc)
            return
        except BaseException:
            if not replay.splice.closed:
                replay.give_up(UpstreamConnectError("the upstream pool closed"))
            raise

    async def request(self, request: Request, headers: Headers, timeout: float) -> Response:
        upload: _Upload | None = None
        avoid: H2ClientConnection | None = None
        try:
            pooled = timeout == self.config.response_timeout
            for retry in (False, True):
                conn = None
                try:
                    if pooled:
                        # The pool's own timeout: the sweeper bounds the wait for the head
                        # from the request's end (local_end); no cancel scope per request.
                        conn = self._free(avoid)
                        if conn is None:
                            with trio.move_on_after(timeout):
                                conn = await self.acquire(avoid)
                            if conn is None:
                                raise UpstreamTimeout(f"no stream slot at {self.address} within {timeout}s")
                        st, upload = self._open(conn, request, headers, upload, timed=True)
                        return await conn.response(st)
                    # A timeout of its own: one deadline for the slot, the upload and the head.
                    with trio.move_on_after(timeout):
                        conn = await self.acquire(avoid)
                        st, upload = self._open(conn, request, headers, upload, timed=False)
                        return await conn.response(st)
                    raise UpstreamTimeout(f"no response from {self.address} within {timeout}s")
                except _Refused as exc:
                    # (The rules: blocks.transport.multiplexer._h2retry.)
                    if retry or (upload is not None and not upload.replayable) or not exc.retryable(request.method):
                        if retry:
                            why = "again, on another connection"
                        elif exc.maybe_processed and not exc.retryable(request.method):
                            why = f"and {request.method.decode(errors='replace')} is not sent twice"
                        else:
                            why = "after the request body started"
                        raise UpstreamProtocolError(f"{exc}, {why}", status=exc.status) from None
                    avoid = conn
                    self.retries += 1
            raise AssertionError("unreachable")
        except BaseException:
            if upload is not None:
                upload.abandon()
            raise

    def _open(
        self, conn: H2ClientConnection, request: Request, headers: Headers, upload: _Upload | None, *, timed: bool
    ) -> tuple[H2Stream, _Upload | None]:
        """Open a stream for ``request`` on ``conn``; its body goes by ``upload`` (the retry's) or a new one."""
        body = request.body
        try:
            if upload is None:
                end = body.ended and not body.trailers
                st = conn.open_stream(request, headers, end=end, timed=timed)
                if not end:
                    upload = _Upload(body, conn, st)
                    self.nursery.start_soon(self._pump, upload)
                return st, upload
            # The retry: the body is untouched, or ended with nothing sent but its end.
            finished = upload.finished
            st = conn.open_stream(request, headers, end=finished and not body.trailers, timed=timed)
            if finished and body.trailers:
                conn.h2.send_headers(st.id, body.trailers, end_stream=True)
                conn.kick()
                conn.local_end(st)
            upload.move(conn, st)
            if upload.broken:  # the body broke since the refusal: nothing will complete it
                conn.reset(st, _CANCEL)
            return st, upload
        except ProtocolError as exc:
            raise UpstreamProtocolError(f"cannot open a stream to {self.address}: {exc}") from exc

    async def _pump(self, upload: _Upload) -> None:
        """Send the request body, on the first stream or on its retry.

        The body is the pump's from its first read: what it leaves unsent when
        it stops early is discarded here (its window goes back), whoever else
        still holds the body.
        """
        body = upload.body
        try:
            with upload.scope:
                try:
                    while True:
                        chunk = await body.receive()
                        conn, st = await upload.target()
                        if not chunk:
                            if body.trailers:
                                conn.h2.send_headers(st.id, body.trailers, end_stream=True)
                            else:
                                conn.h2.end_stream(st.id)
                            conn.kick()
                            break
                        last = body.ended and not body.trailers  # the common one-chunk body: END_STREAM with it
                        upload.sent = True
                        await conn.send_data(st, chunk, end_stream=last)
                        if last:
                            break
                except (StreamReset, ProtocolError):
                    # The client's upload broke, or the upstream stream went away.
                    upload.broken = True
                    upload.conn.reset(upload.st, _CANCEL)
                    return
                except Exception:
                    log.exception("request body pump failed")
                    upload.broken = True
                    upload.conn.reset(upload.st, _CANCEL)
                    return
                upload.finished = True
                conn.local_end(st)
                if st.remote_ended:
                    conn.finish_stream(st)
            if upload.scope.cancelled_caught and not body.ended and not upload.st.remote_ended:
                # (An upstream that ended its response and then refused the rest of
                # the request, RST_STREAM(NO_ERROR) as RFC 9113 8.1 allows, did not
                # break the exchange: the body's owner refuses it once the response
                # is out, and abandoning it here would reset that response.)
                await abandon(body)
        finally:
            if not upload.finished:
                body.discard()
