"""The admin listener of a supervising parent (``--processes N``): every child's answers, merged.

Each supervised process serves its own admin listener on a private loopback
port (``serve_admin``, port 0) and reports that port to the parent. The
parent's listener (:func:`serve_merged_admin`) asks every child at request
time, over loopback, concurrently, each bounded by ``timeout``: this is the
operators' path, never a request's. ``/metrics`` is every child's samples
with a ``process="INDEX"`` label added, so that ``sum without(process)``
gives what one process would have counted, plus ``proxyblocks_process_up``
per child; ``/status.json`` lists each child's document; ``/healthz`` and
``/readyz`` are 200 only when every child answers 200. A child whose answer
does not parse (Prometheus text that ``prometheus_client`` rejects, bytes
that are not UTF-8, a document that is not strict JSON) is taken as one
that did not answer: the others' data is merged as ever.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import attrs
import h11
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from blocks.http import BytesBody, Request, Response, json_response, text_response
from blocks.observe._admin import ADMIN_LISTENER, METRICS_CONTENT_TYPE
from blocks.transport.listener import HTTPServer, serve_http


@attrs.frozen
class ProcessAdmin:
    """One supervised process as the parent knows it: its index, pid, private admin port (None
    before it reported one) and whether it serves now."""

    index: int
    pid: int | None
    port: int | None
    serving: bool


async def fetch(port: int, path: str, *, timeout: float = 5.0) -> tuple[int, bytes]:
    """``GET path`` from ``127.0.0.1:port`` over HTTP/1.1 (``(status, body)``); ``OSError`` if it
    cannot be had within ``timeout`` seconds."""
    connection = h11.Connection(h11.CLIENT)
    with trio.move_on_after(timeout):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            request = h11.Request(method="GET", target=path, headers=[("host", f"127.0.0.1:{port}")])
            try:
                await stream.send_all(connection.send(request) + (connection.send(h11.EndOfMessage()) or b""))
                status, body = 0, b""
                while True:
                    event = connection.next_event()
                    if event is h11.NEED_DATA:
                        connection.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.Data):
                        body += bytes(event.data)
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        return status, body
            except (trio.BrokenResourceError, h11.ProtocolError) as exc:
                raise OSError(f"127.0.0.1:{port}: {exc}") from exc
    raise OSError(f"127.0.0.1:{port}: no answer within {timeout:g}s")


def merge_metrics(texts: Sequence[tuple[int, str | None]]) -> list[Metric]:
    """Families of every ``(index, Prometheus text or None)``, each sample labelled ``process="INDEX"``,
    families of one name merged, and ``proxyblocks_process_up`` (1 for a text, 0 for None or for a
    text that does not parse: that process is left out, as if it had not answered)."""
    families: dict[str, Metric] = {}
    up = GaugeMetricFamily("proxyblocks_process_up", "1 if the process answered this scrape", labels=["process"])
    for index, text in texts:
        parsed = _parsed(text)
        up.add_metric([str(index)], 0.0 if parsed is None else 1.0)
        for family in parsed or ():
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples += [
                sample._replace(labels={**sample.labels, "process": str(index)}) for sample in family.samples
            ]
    return [*families.values(), up]


def _parsed(text: str | None) -> list[Metric] | None:
    """The families of one process's Prometheus text, or None if there is none or it does not parse."""
    if text is None:
        return None
    try:
        return list(text_string_to_metric_families(text))  # (a generator: parsed here, all of it)
    except ValueError:
        return None


def _text(status: int, body: bytes | None) -> str | None:
    """A 200 answer's body as text, or None (no answer, another status, not UTF-8)."""
    if status != 200 or body is None:
        return None
    try:
        return body.decode()
    except UnicodeDecodeError:
        return None


def _document(status: int, body: bytes | None) -> object:
    """A 200 answer's body as strict JSON (no NaN, no Infinity), or None (no answer, another status,
    not JSON): what goes in ``/status.json`` as that process's ``status``."""
    if status != 200 or body is None:
        return None
    try:
        return json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError):  # (RecursionError: nested deeper than the parser goes)
        return None


def _not_json(constant: str) -> NoReturn:
    raise ValueError(f"{constant} is not JSON")


class _Merged:
    def __init__(self, processes: Callable[[], Sequence[ProcessAdmin]], timeout: float) -> None:
        self.processes = processes
        self.timeout = timeout

    async def gather(self, path: str) -> list[tuple[ProcessAdmin, int, bytes | None]]:
        """Every process's answer to ``path``: (process, status, body), status 0 and body None for none."""
        known = list(self.processes())
        answers: list[tuple[ProcessAdmin, int, bytes | None]] = [(process, 0, None) for process in known]

        async def ask(i: int, process: ProcessAdmin) -> None:
            if process.port is None or not process.serving:
                return
            try:
                status, body = await fetch(process.port, path, timeout=self.timeout)
            except OSError:
                return
            answers[i] = (process, status, body)

        async with trio.open_nursery() as nursery:
            for i, process in enumerate(known):
                nursery.start_soon(ask, i, process)
        return answers

    async def handle(self, request: Request) -> Response:
        path = request.path.partition(b"?")[0]
        if request.method not in (b"GET", b"HEAD"):
            return text_response(405, "the admin listener answers GET only\n", [(b"allow", b"GET, HEAD")])
        if path == b"/metrics":
            answers = await self.gather("/metrics")
            texts = [(p.index, _text(status, body)) for p, status, body in answers]
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Families(merge_metrics(texts)))
            rendered = generate_latest(registry)
            headers = [(b"content-type", METRICS_CONTENT_TYPE), (b"content-length", b"%d" % len(rendered))]
            return Response(200, headers, BytesBody(rendered))
        if path in (b"/healthz", b"/readyz"):
            answers = await self.gather(path.decode())
            down = [
                f"process {p.index}: " + (body.decode(errors="replace").strip() if body is not None else "no answer")
                for p, status, body in answers
                if status != 200
            ]
            if down:
                return text_response(503, "; ".join(down) + "\n", [(b"cache-control", b"no-store")])
            return text_response(
                200, ("ok" if path == b"/healthz" else "ready") + "\n", [(b"cache-control", b"no-store")]
            )
        if path == b"/status.json":
            answers = await self.gather("/status.json")
            rows: list[dict[str, Any]] = []
            for process, status, body in answers:
                own = _document(status, body)
                rows.append(
                    {
                        "process": process.index,
                        "pid": process.pid,
                        "serving": process.serving,
                        "admin": None if process.port is None else f"http://127.0.0.1:{process.port}",
                        "status": own,
                    }
                )
            draining = any(isinstance(row["status"], dict) and row["status"].get("draining") for row in rows)
            document = {"time": time.time(), "draining": draining, "processes": rows}
            return json_response(200, json.dumps(document, allow_nan=False).encode())
        if path in (b"/", b"/index.html"):
            known = self.processes()
            lines = [f"proxyblocks: {len(known)} processes; each one's admin page (loopback):\n"]
            lines += [f"process {p.index} pid {p.pid}: http://127.0.0.1:{p.port}/\n" for p in known if p.port]
            return text_response(200, "".join(lines))
        return text_response(404, "not found: try /metrics, /healthz, /readyz, /status.json or /\n")


class _Families:
    """A collector of families read elsewhere (``prometheus_client`` renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


async def serve_merged_admin(
    processes: Callable[[], Sequence[ProcessAdmin]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float = 5.0,
    task_status: trio.TaskStatus[HTTPServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin endpoints of every process ``processes()`` names (called on every request),
    each read from its own admin listener within ``timeout`` seconds, on ``host:port``.

    ``/metrics``: every process's samples labelled ``process="INDEX"``, and
    ``proxyblocks_process_up{process}``; ``/healthz``, ``/readyz``: 200
    when every process answers 200, else 503 naming those that do not;
    ``/status.json``: ``{"time", "draining", "processes": [{"process",
    "pid", "serving", "admin", "status"}]}``, ``status`` being that process's
    own document (null if it did not answer); ``/``: where each process's
    admin page is. An answer that does not parse counts as no answer (up 0,
    status null). Reports its :class:`HTTPServer`; runs until cancelled.
    """
    merged = _Merged(processes, timeout)
    await serve_http(merged.handle, host=host, port=port, config=ADMIN_LISTENER, task_status=task_status)
