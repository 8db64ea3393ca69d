"""etcd as a route source, for a fleet of proxies that share one routing state.

It speaks etcd v3's JSON gateway (``/v3/...``, served on the client URL by
every etcd 3.4 and later) over plain HTTP/1.1 (h11), so it needs no etcd
client library: keys and values travel base64-encoded, 64-bit numbers as strings.

- **Keys.** Everything lives under one prefix (``proxyblocks/`` by
  default): ``proxyblocks/domains/chat.example``,
  ``proxyblocks/apps/chat/replicas/r1``. The source strips the prefix, so
  its keys are those of :mod:`blocks.routing` and of a route file.
- **Snapshot.** ``POST /v3/kv/range`` over the prefix (``range_end`` is the
  prefix with its last byte plus one), in pages of ``page_size`` keys, all
  pages pinned to the first page's revision so that they form one
  consistent snapshot.
- **Watch.** ``POST /v3/watch`` with a ``create_request`` whose
  ``start_revision`` is the revision asked for plus one, and
  ``progress_notify``. The response is a stream of newline-delimited JSON
  messages: first ``created``, then one message per batch of events (etcd
  never splits one revision's events across two messages), and, while
  idle, progress notifications (a header and nothing else), which become
  :class:`~blocks.sources.Progress`. A watch whose start revision is
  compacted is cancelled with ``compact_revision``: :class:`Compacted`.
  Any other cancel, error message, HTTP error, or end of stream is
  :class:`SourceUnavailable`.
- **Heartbeats.** etcd sends progress notifications to an idle watch every
  ``--experimental-watch-progress-notify-interval`` (10 minutes unless set;
  a few seconds is a good value for a fleet). Give the same interval as
  ``progress_interval``: a watch that says nothing for ``missed_progress``
  intervals is taken for dead (a half-open TCP connection, a hung
  gateway) and is :class:`SourceUnavailable`, so the reconciler opens a
  new one. An interval shorter than the server's makes idle watches
  reconnect for nothing (correct, but noisy in ``reconnects``).
"""

from __future__ import annotations

import base64
import copy
import json
import math
import ssl
from collections.abc import AsyncIterator, Sequence
from typing import Any

import trio

from blocks.errors import Compacted, SourceUnavailable
from blocks.routing import RouteEvent
from blocks.sources._base import Progress
from blocks.sources._http import Endpoint, Exchange, post_json


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # an empty (or all-0xff) prefix: every key


class EtcdSource:
    """Routes under ``prefix`` in the etcd at ``url``: a :class:`~blocks.sources.RouteSource`.

    ``url`` is one member's client URL, ``http://`` or ``https://`` (then
    ``ssl_context`` carries the CA and any client certificate; the default
    context checks the server against the system's CAs). ``headers`` are
    added to every request (``[("authorization", token)]`` for etcd's
    auth). ``request_timeout`` bounds every call but the watch;
    ``progress_interval`` and ``missed_progress``: see the module's
    docstring. Each call opens its own connection, and a watch holds one
    for as long as it runs; the object itself holds nothing and needs no
    closing. Besides the protocol, :meth:`get`, :meth:`put`, :meth:`delete`
    and :meth:`compact` are for tools (the ``routectl`` CLI) and tests,
    never for the request path.
    """

    def __init__(
        self,
        url: str,
        prefix: str = "proxyblocks/",
        *,
        ssl_context: ssl.SSLContext | None = None,
        headers: Sequence[tuple[str, str]] = (),
        progress_interval: float = 600.0,
        missed_progress: int = 3,
        request_timeout: float = 5.0,
        page_size: int = 1000,
    ) -> None:
        if not progress_interval > 0 or missed_progress < 1 or not request_timeout > 0 or page_size < 1:
            raise ValueError("progress_interval and request_timeout must be > 0; missed_progress, page_size >= 1")
        self.endpoint = Endpoint.parse(url, ssl_context=ssl_context, headers=headers)
        self.prefix = prefix
        self.progress_interval = progress_interval
        self.missed_progress = missed_progress
        self.request_timeout = request_timeout
        self.page_size = page_size

    def __repr__(self) -> str:
        return f"<EtcdSource {self.endpoint.url} prefix={self.prefix!r}>"

    @property
    def url(self) -> str:
        return self.endpoint.url

    def under(self, prefix: str) -> EtcdSource:
        """The same etcd (its URL, TLS, headers and timeouts) under another ``prefix``."""
        other = copy.copy(self)
        other.prefix = prefix
        return other

    @property
    def _prefix(self) -> bytes:
        return self.prefix.encode("utf-8")

    @property
    def _range_end(self) -> bytes:
        return prefix_range_end(self._prefix)

    # -- plumbing -----------------------------------------------------------------------------

    def _full_key(self, key: str) -> bytes:
        if not key:
            raise ValueError("a key must be a non-empty string")
        return self._prefix + key.encode("utf-8")

    def _key_of(self, raw: str) -> str | None:
        full = _unb64(raw)
        if not full.startswith(self._prefix):
            return None
        return full[len(self._prefix) :].decode("utf-8", errors="replace")

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = await post_json(self.endpoint, path, body, timeout=self.request_timeout)
        if "header" not in answer:
            raise SourceUnavailable(f"{self.url}{path}: unexpected answer {json.dumps(answer)[:200]}")
        return answer

    # -- RouteSource --------------------------------------------------------------------------

    async def snapshot(self) -> tuple[int, dict[str, bytes]]:
        routes: dict[str, bytes] = {}
        revision = 0
        start = self._prefix
        while True:
            body: dict[str, Any] = {"key": _b64(start), "range_end": _b64(self._range_end), "limit": self.page_size}
            if revision:
                body["revision"] = str(revision)
            data = await self._call("/v3/kv/range", body)
            try:
                if not revision:
                    revision = int(data["header"]["revision"])
                kvs = data.get("kvs", [])
                for kv in kvs:
                    key = self._key_of(kv["key"])
                    if key is not None:
                        routes[key] = _unb64(kv.get("value", ""))
            except (KeyError, TypeError, ValueError) as exc:
                raise SourceUnavailable(f"{self.url}/v3/kv/range: unexpected answer: {exc!r}") from exc
            if not data.get("more") or not kvs:
                return revision, routes
            start = _unb64(kvs[-1]["key"]) + b"\0"

    async def watch(self, revision: int) -> AsyncIterator[list[RouteEvent] | Progress]:
        request = {
            "create_request": {
                "key": _b64(self._prefix),
                "range_end": _b64(self._range_end),
                "start_revision": str(revision + 1),
                "progress_notify": True,
            }
        }
        silence = self.progress_interval * self.missed_progress
        where = f"etcd watch at {self.url}"
        async with Exchange(self.endpoint, "/v3/watch", request, timeout=self.request_timeout) as exchange:
            with trio.move_on_after(self.request_timeout) as heading:
                status = await exchange.status()
                body = b"" if status == 200 else await exchange.read_all()
            if heading.cancelled_caught:
                raise SourceUnavailable(f"{where}: no response within {self.request_timeout:g}s")
            if status != 200:
                raise SourceUnavailable(f"{where}: HTTP {status}: {body[:200].decode(errors='replace')}")
            while True:
                # The cancel scope covers the read only, never a yield: an async
                # generator must not yield inside one.
                with trio.move_on_after(silence) as reading:
                    line = await exchange.next_line()
                if reading.cancelled_caught:
                    raise SourceUnavailable(
                        f"{where} said nothing for {silence:g}s ({self.missed_progress} progress intervals)"
                    )
                if line is None:
                    raise SourceUnavailable(f"{where}: the stream ended")
                if not line.strip():
                    continue
                try:
                    item = self._parse_watch_message(line)
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    raise SourceUnavailable(f"{where}: unexpected message {line[:200]!r}") from exc
                if item is not None:
                    yield item

    def _parse_watch_message(self, line: bytes) -> list[RouteEvent] | Progress | None:
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise SourceUnavailable(f"etcd watch: not JSON: {line[:200]!r}") from exc
        if not isinstance(message, dict) or "result" not in message:
            raise SourceUnavailable(f"etcd watch: {line[:200]!r}")
        result = message["result"]
        compact_revision = int(result.get("compact_revision", 0))
        if compact_revision:
            raise Compacted(f"etcd compacted revisions up to {compact_revision}", compact_revision=compact_revision)
        if result.get("canceled"):
            raise SourceUnavailable(f"etcd cancelled the watch: {result.get('cancel_reason') or 'no reason given'}")
        events = result.get("events")
        if events:
            batch = []
            for event in events:
                kv = event["kv"]
                key = self._key_of(kv["key"])
                if key is None:
                    continue
                revision = int(kv["mod_revision"])
                if event.get("type") == "DELETE":
                    batch.append(RouteEvent("delete", key, None, revision))
                else:
                    batch.append(RouteEvent("put", key, _unb64(kv.get("value", "")), revision))
            return batch or None
        if result.get("created"):
            return None
        return Progress(int(result.get("header", {}).get("revision", 0)))

    # -- for tools and tests ------------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        data = await self._call("/v3/kv/range", {"key": _b64(self._full_key(key))})
        kvs = data.get("kvs", [])
        return _unb64(kvs[0].get("value", "")) if kvs else None

    async def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        """Set ``prefix + key`` (bound to ``lease``: deleted when it ends); returns the revision of the write."""
        body: dict[str, Any] = {"key": _b64(self._full_key(key)), "value": _b64(value)}
        if lease is not None:
            body["lease"] = str(lease)
        data = await self._call("/v3/kv/put", body)
        return int(data["header"]["revision"])

    async def grant_lease(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (rounded up to whole seconds, at least 1): its id."""
        data = await self._call("/v3/lease/grant", {"TTL": str(max(1, math.ceil(ttl)))})
        try:
            return int(data["ID"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SourceUnavailable(f"{self.url}/v3/lease/grant: unexpected answer: {exc!r}") from exc

    async def keep_alive(self, lease: int) -> float:
        """Renew ``lease``; the seconds it now has left (0: it had ended, and its keys with it)."""
        answer = await post_json(self.endpoint, "/v3/lease/keepalive", {"ID": str(lease)}, timeout=self.request_timeout)
        result = answer.get("result", answer)
        try:
            return float(result.get("TTL", 0)) if isinstance(result, dict) else 0.0
        except (TypeError, ValueError) as exc:
            raise SourceUnavailable(f"{self.url}/v3/lease/keepalive: unexpected answer: {exc!r}") from exc

    async def revoke_lease(self, lease: int) -> None:
        """End ``lease`` now: every key bound to it is deleted."""
        await self._call("/v3/lease/revoke", {"ID": str(lease)})

    async def delete(self, key: str) -> int:
        """Delete ``prefix + key``; returns the store's revision after (unchanged if there was no such key)."""
        data = await self._call("/v3/kv/deleterange", {"key": _b64(self._full_key(key))})
        return int(data["header"]["revision"])

    async def compact(self, revision: int) -> None:
        """Compact the whole store's history up to ``revision`` (physically, before returning)."""
        await self._call("/v3/kv/compaction", {"revision": str(revision), "physical": True})


__all__ = [
    "EtcdSource",
    "prefix_range_end",
]
