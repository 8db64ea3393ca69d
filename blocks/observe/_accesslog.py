"""The access log: one JSON line per request, written off the event loop, never in a request's way.

:class:`AccessLog` is a hop :class:`~blocks.hops.Feature`. Its ``response``
phase notes the status and the head (one small tuple), its ``closed`` phase
appends one record (a tuple of references) to an in-memory buffer: no
formatting, no I/O and no await on the request path. The service-lifetime
task of :func:`open_access_log` takes the buffer every ``interval`` seconds
and hands it to a worker thread (``trio.to_thread.run_sync``), which turns
each record into a JSON line and writes them in one go, so a slow disk or a
stalled pipe never blocks the event loop. To anything but a regular file (a
pipe: standard output under a supervisor, or ``| tee``), it writes them in
runs of whole lines of at most ``PIPE_BUF`` (4096) bytes each, a size the
kernel writes to a pipe whole, so that the lines of several processes
sharing the pipe (``--processes N``) never tear each other; a single line
longer than that goes alone, and may.

The invariant: a request never fails, waits or slows down because of its
log line. When the buffer holds ``capacity`` records, a new one is dropped;
when a write fails (a full disk: ``ENOSPC``; a closed pipe: ``EPIPE``) its
lines are dropped. Both are counted (``statistics().dropped``), and a
warning is logged once when writing starts failing and once when it works
again.

Fields of a line (null when unknown; docs/observability.md):
``time`` (the request head's arrival, RFC 3339 UTC), ``hop``,
``request_id``, ``traceparent``, ``client``, ``method``, ``authority``,
``path``, ``http_version``, ``status``, ``reason`` (a ``proxyblocks-error``
reason), ``bytes_in``, ``bytes_out`` (body bytes received from the client and
sent to it, as the listener counted them: :class:`~blocks.http.Wire`), ``tenant``,
``app``, ``replica``, ``duration_ms`` (to the exchange's end) and
``phases`` (the Server-Timing phases, in ms).

At the edge, the app, the replica and the tenant are the proxy's: the
edge's access log asks for them with an internal request field
(:data:`~blocks.fields.REPORT_HEADER`, the request's last) and the proxy
answers with :data:`~blocks.fields.ROUTED_HEADER`, which the edge removes
from the response head before it goes on.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import stat
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from time import perf_counter, time
from typing import IO, Any, TypeAlias

import attrs
import trio

from blocks._sync import one_error
from blocks.fields import ERROR_HEADER, REPORT_HEADER, ROUTED_HEADER
from blocks.hops import Exchange, Feature, Forward, Hop, NoteKey
from blocks.http import Headers, Request
from blocks.observe._ids import REQUEST_ID, TRACEPARENT
from blocks.scheduler import TenantKey
from blocks.timing import SERVER_TIMING, parse_server_timing

log = logging.getLogger("blocks.accesslog")

_REPORT = (REPORT_HEADER, b"1")

# (status, response head as the hop saw it, perf_counter at the head, the proxy's report)
_Head: TypeAlias = tuple[int, Headers, float, bytes | None]
# (wall time at close, perf_counter at close, hop, request, app, replica, exchange.start, head,
#  body bytes received, sent: None without a listener's count)
_Record: TypeAlias = tuple[
    float, float, Hop, Request, str | None, str | None, float, _Head | None, int | None, int | None
]


@attrs.frozen
class AccessLogStatistics:
    """``written``: lines written; ``dropped``: lines lost (the buffer was full, or their write
    failed); ``buffered``: records waiting for the writer; ``failing``: the last write failed."""

    written: int
    dropped: int
    buffered: int
    failing: bool


class AccessLog(Feature):
    """One access-log line per exchange at this hop; run it with :func:`open_access_log`.

    response: notes the status, the head, and (at the edge) the proxy's
    report of the app, the replica and the tenant, removing that internal
    field. dispatched: at the edge (the outermost hop), asks the proxy for
    that report (``report=True``, the default). closed: buffers one record,
    or drops and counts it when ``capacity`` records already wait.

    ``tenant_key``: the tenant of a request nobody reported one for (a
    request the proxy answered itself); None: the hop's own
    (``hop.tenant_key``: the proxy's), else null.

    Add it to a hop's ``features``: for the edge,
    ``serve_edge(config, features=[RequestIds(), log])``, the ids first so
    the line carries them. One access log may serve several hops (each line
    names its ``hop``): the proxy's line has its app, replica and tenant,
    the worker's its replica.
    """

    def __init__(self, *, capacity: int = 65536, tenant_key: TenantKey | None = None, report: bool = True) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._note: NoteKey[tuple[int, Headers, float, bytes | None]] = NoteKey("access-log")  # its head, per hop
        self.tenant_key = tenant_key
        self.report = report
        self._records: list[_Record] = []
        self._dropped = 0  # by the event loop (a full buffer)
        self._lost = 0  # by the writer thread (a failed write, a record it could not format)
        self._written = 0  # by the writer thread
        self._failing = False
        self._writing = threading.Lock()  # one writer thread at a time, in order (one abandoned included)

    def __repr__(self) -> str:
        return f"<AccessLog buffered={len(self._records)} written={self._written} dropped={self._dropped + self._lost}>"

    def statistics(self) -> AccessLogStatistics:
        return AccessLogStatistics(
            written=self._written,
            dropped=self._dropped + self._lost,
            buffered=len(self._records),
            failing=self._failing,
        )

    # -- the request path: references only -----------------------------------------------

    def dispatched(self, exchange: Exchange, forward: Forward) -> None:
        if self.report and exchange.hop.total:
            forward.headers.append(_REPORT)  # the last field: the proxy looks there, and only there

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        routed = None
        if self.report and exchange.hop.total:  # the edge asked: the proxy's report sits near the end
            n = len(headers)
            for i in range(n - 1, max(n - 5, -1), -1):
                if headers[i][0] == ROUTED_HEADER:
                    routed = headers.pop(i)[1]
                    break
        notes = exchange.notes
        if notes is None:
            exchange.notes = {self._note: (status, headers, perf_counter(), routed)}
        else:
            notes[self._note] = (status, headers, perf_counter(), routed)

    def closed(self, exchange: Exchange) -> None:
        records = self._records
        if len(records) >= self.capacity:
            self._dropped += 1
            return
        notes = exchange.notes
        request = exchange.request
        wire = request.wire  # read now: the counts as the exchange ends
        records.append(
            (
                time(),
                perf_counter(),
                exchange.hop,
                request,
                exchange.app,
                exchange.replica,
                exchange.start,
                notes.get(self._note) if notes is not None else None,
                wire.received if wire is not None else None,
                wire.sent if wire is not None else None,
            )
        )

    # -- the writer ---------------------------------------------------------------------

    def _take(self) -> list[_Record]:
        records, self._records = self._records, []
        return records

    def _write(self, file: IO[bytes], records: list[_Record]) -> None:
        """In a worker thread: format ``records`` and write them; count what is lost.

        Writes are serialized: a write its task stopped waiting for (the
        block was left meanwhile) still runs, and the last flush waits for it.
        """
        with self._writing:
            self._write_now(file, records)

    def _write_now(self, file: IO[bytes], records: list[_Record]) -> None:
        lines = []
        for record in records:
            try:
                lines.append(self._line(record))
            except Exception:
                self._lost += 1
                log.exception("access log: a record could not be formatted")
        if not lines:
            return
        runs = _runs(lines, PIPE_BUF) if _shared_pipe(file) else [("".join(lines).encode(), len(lines))]
        written = 0
        try:
            for run, count in runs:
                data = memoryview(run)
                while data:
                    n = file.write(data)  # an unbuffered file may take part of it
                    if n is None:  # a non-blocking file that would block
                        raise BlockingIOError("the file would block")
                    data = data[n:]
                written += count
            file.flush()
        except (OSError, ValueError) as exc:  # ValueError: the file was closed under us
            self._written += written
            self._lost += len(lines) - written
            if not self._failing:
                self._failing = True
                log.warning("access log: writing failed (%s); dropping lines until it works again", exc)
            return
        self._written += len(lines)
        if self._failing:
            self._failing = False
            log.warning("access log: writing works again (%d lines dropped so far)", self._dropped + self._lost)

    def _line(self, record: _Record) -> str:
        """One record as its JSON line (with the newline)."""
        closed_at, end, hop, request, app, replica, start, head, bytes_in, bytes_out = record
        status = reason = routed = None
        server_timing: list[bytes] = []
        phases: dict[str, float] = {}
        if head is not None:
            status, headers, at_head, routed = head
            for name, value in headers:
                if name == ERROR_HEADER:
                    reason = value.partition(b";")[0].strip().decode("latin-1")
                elif name == SERVER_TIMING:
                    server_timing.append(value)
            if server_timing:
                phases = parse_server_timing(b", ".join(server_timing))
        timing = request.timing
        began = timing.start if timing is not None else end
        if head is not None and timing is not None:
            total = at_head - began
            waited = at_head - start if start > 0.0 else 0.0
            if hop.upstream_name is not None:
                phases[hop.upstream_name] = round(waited * 1000, 3)
            phases[hop.name] = round((total - waited) * 1000, 3)
            if hop.total:
                phases["total"] = round(total * 1000, 3)
        tenant = None
        if routed is not None:
            app, replica, tenant = _report(routed)
        tenant_key = self.tenant_key or hop.tenant_key
        if tenant is None and tenant_key is not None:
            try:
                tenant = tenant_key(request)
            except Exception:
                tenant = None
        request_id = traceparent = None
        for name, value in request.headers:
            if name == REQUEST_ID:
                request_id = request_id or value.decode("latin-1")
            elif name == TRACEPARENT:
                traceparent = traceparent or value.decode("latin-1")
        started = closed_at - (end - began)
        entry: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(started, datetime.UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "hop": hop.name,
            "request_id": request_id,
            "traceparent": traceparent,
            "client": request.client or None,
            "method": request.method.decode("latin-1"),
            "authority": request.authority.decode("latin-1"),
            "path": request.path.decode("latin-1"),
            "http_version": request.http_version,
            "status": status,
            "reason": reason,
            "bytes_in": bytes_in,
            "bytes_out": bytes_out,
            "tenant": tenant,
            "app": app,
            "replica": replica,
            "duration_ms": round((end - began) * 1000, 3),
            "phases": phases,
        }
        return json.dumps(entry, separators=(",", ":")) + "\n"


PIPE_BUF = 4096
"""The most bytes POSIX has a write to a pipe put in whole, never mixed with another writer's (Linux: 4096)."""


def _shared_pipe(file: IO[bytes]) -> bool:
    """Whether ``file`` may be a pipe other processes write to: it is not a regular file (where
    ``O_APPEND`` keeps each write whole, whatever its size) nor a file object without a descriptor."""
    try:
        return not stat.S_ISREG(os.fstat(file.fileno()).st_mode)
    except (OSError, ValueError):  # (io.UnsupportedOperation is both: a BytesIO)
        return False


def _runs(lines: list[str], most: int) -> list[tuple[bytes, int]]:
    """``lines`` encoded and joined into runs of whole lines of at most ``most`` bytes each (a
    longer line is a run of its own): ``(bytes, how many lines)``."""
    runs: list[tuple[bytes, int]] = []
    run: list[bytes] = []
    size = 0
    for line in lines:
        data = line.encode()
        if run and size + len(data) > most:
            runs.append((b"".join(run), len(run)))
            run, size = [], 0
        run.append(data)
        size += len(data)
    if run:
        runs.append((b"".join(run), len(run)))
    return runs


def _report(value: bytes) -> tuple[str | None, str | None, str | None]:
    """The proxy's ``ROUTED_HEADER`` value: ``APP REPLICA TENANT``, ``-`` for unknown."""
    parts = value.decode("latin-1").split(" ", 2)
    parts += ["-"] * (3 - len(parts))
    app, replica, tenant = (None if part == "-" else part for part in parts)
    return app, replica, tenant


@asynccontextmanager
async def open_access_log(
    target: str | os.PathLike[str] | IO[bytes],
    *,
    capacity: int = 65536,
    interval: float = 0.2,
    tenant_key: TenantKey | None = None,
    report: bool = True,
) -> AsyncIterator[AccessLog]:
    """An :class:`AccessLog` writing to ``target`` for the ``async with`` block.

    ``target``: a file path (opened for appending), ``"-"`` (standard
    output), or a binary file object you own (it is flushed, never closed).
    Owns one task: every ``interval`` seconds it hands what was buffered to
    a worker thread, which formats and writes it. Leaving the block writes
    what is left (for at most a second), then closes a file it opened.
    ``capacity``, ``tenant_key``, ``report``: see :class:`AccessLog`.
    A path that cannot be opened raises ``OSError`` here, at start-up.
    """
    if not interval > 0:
        raise ValueError("interval must be > 0")
    access_log = AccessLog(capacity=capacity, tenant_key=tenant_key, report=report)
    owned = False
    file: IO[bytes]
    # Unbuffered: each batch is one write, and a write that failed leaves nothing behind in a buffer
    # (to fail again at every later flush, and at the close).
    if isinstance(target, (str, os.PathLike)):
        if os.fspath(target) == "-":
            file = open(sys.stdout.fileno(), "wb", buffering=0, closefd=False)  # noqa: SIM115, ASYNC230 (no I/O)
        else:
            file = await trio.to_thread.run_sync(_open, os.fspath(target))
        owned = True
    else:
        file = target

    async def flush(last: bool = False) -> None:
        records = access_log._take()
        if records or last:  # (the last flush also waits for a write abandoned before it)
            await trio.to_thread.run_sync(access_log._write, file, records, abandon_on_cancel=True)

    async def flush_forever() -> None:
        while True:
            await trio.sleep(interval)
            await flush()

    try:
        with one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(flush_forever)
                try:
                    yield access_log
                finally:
                    nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            await flush(last=True)
            if owned:
                await trio.to_thread.run_sync(_close, file, abandon_on_cancel=True)


def _open(path: str) -> IO[bytes]:
    return open(path, "ab", buffering=0)  # closed by open_access_log


def _close(file: IO[bytes]) -> None:
    try:
        file.close()
    except OSError:
        pass


__all__ = [
    "AccessLog",
    "AccessLogStatistics",
    "open_access_log",
]
