"""Request ids and W3C ``traceparent``: one id per request, made at the edge, seen by every hop and the replica.

:class:`RequestIds` is an edge :class:`~blocks.hops.Feature`. In ``screen``
it keeps a client's ``x-request-id`` when it is sane (1 to 200 visible
ASCII characters) and makes one otherwise; it keeps a client's
``traceparent`` when it is valid W3C Trace Context version ``00``
(https://www.w3.org/TR/trace-context/#traceparent-header) and starts a new
trace otherwise. Both then travel upstream with the request (the edge's
:func:`~blocks.hops.forwarded_headers` copies the request's fields) and come
back on the response, in place of whatever the upstream sent.

Ids cost no syscall: a random 64-bit prefix drawn once per process (again
in a forked child) and a per-process counter. A fresh request id is 32
lowercase hex digits, and a trace this edge starts uses it as its trace-id,
so the two can be matched in any log. Both fields are sent never-indexed
(as ``server-timing`` is): a value new with every request would only churn
each connection's HPACK table, evicting the fields that repeat; every hop
behind keeps them so (the codec hands them on as it got them).
"""

from __future__ import annotations

import itertools
import os
import re

from hpack import NeverIndexedHeaderTuple

from blocks.hops import Exchange, Feature, NoteKey
from blocks.http import Headers

REQUEST_ID = b"x-request-id"
TRACEPARENT = b"traceparent"
_IDS = (REQUEST_ID, TRACEPARENT)
REQUEST_IDS: NoteKey[tuple[bytes, bytes]] = NoteKey("request-ids")
"""The request's ``(x-request-id, traceparent)``, noted by :class:`RequestIds` for the features after it."""

_SANE_ID = re.compile(rb"[\x21-\x7e]{1,200}").fullmatch
_TRACEPARENT = re.compile(rb"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}").fullmatch
_ZERO_TRACE = b"0" * 32
_ZERO_PARENT = b"0" * 16

_prefix = ""
_counter = itertools.count(1)


def _reseed() -> None:
    global _prefix, _counter
    _prefix = os.urandom(8).hex()
    _counter = itertools.count(1)


_reseed()
os.register_at_fork(after_in_child=_reseed)


def new_request_id() -> bytes:
    """A fresh request id: 32 lowercase hex digits, unique per process run (random prefix, counter)."""
    return f"{_prefix}{next(_counter) & 0xFFFFFFFFFFFFFFFF:016x}".encode()


def new_traceparent(trace_id: bytes | None = None) -> bytes:
    """A ``traceparent`` that starts a trace: version 00, ``trace_id`` (32 hex, not all zero; default
    fresh), a fresh parent-id, flags 00 (this edge records no spans of its own)."""
    if trace_id is None or len(trace_id) != 32 or trace_id == _ZERO_TRACE:
        trace_id = new_request_id()
    parent = (int(_prefix, 16) ^ next(_counter)) & 0xFFFFFFFFFFFFFFFF or 1
    return b"00-%s-%016x-00" % (trace_id, parent)


def valid_request_id(value: bytes) -> bool:
    """Whether ``value`` is kept as a request id: 1 to 200 visible ASCII characters."""
    return _SANE_ID(value) is not None


def valid_traceparent(value: bytes) -> bool:
    """Whether ``value`` is a valid W3C ``traceparent`` of version 00 (ids lowercase hex, not all zero)."""
    match = _TRACEPARENT(value)
    return match is not None and match[1] != _ZERO_TRACE and match[2] != _ZERO_PARENT


def request_ids(headers: Headers) -> tuple[bytes, bytes, bool]:
    """``(x-request-id, traceparent, changed)``: the ids a request with ``headers`` goes on with.

    Each is the request's own when valid (the first of its kind), else a
    fresh one; a fresh trace takes a fresh request id as its trace-id.
    ``changed``: ``headers`` do not already carry exactly these, once each.
    """
    rid = tp = None
    seen = 0
    for name, value in headers:
        if name == REQUEST_ID:
            seen += 1
            if rid is None:
                rid = value
        elif name == TRACEPARENT:
            seen += 1
            if tp is None:
                tp = value
    changed = seen != 2 or rid is None or tp is None
    fresh = rid is None or _SANE_ID(rid) is None
    if fresh:
        rid = new_request_id()
        changed = True
    assert rid is not None
    if tp is None or not valid_traceparent(tp):
        tp = new_traceparent(rid if fresh else None)
        changed = True
    return rid, tp, changed


def _replace(headers: Headers, rid: bytes, tp: bytes) -> None:
    """``headers`` (in place) with exactly one ``x-request-id`` and one ``traceparent``: these."""
    for name, _ in headers:
        if name in _IDS:
            headers[:] = [field for field in headers if field[0] not in _IDS]
            break
    headers.append(NeverIndexedHeaderTuple(REQUEST_ID, rid))
    headers.append(NeverIndexedHeaderTuple(TRACEPARENT, tp))


class RequestIds(Feature):
    """screen: the request's ``x-request-id`` and ``traceparent``, kept or made; response: both, on the response.

    Put it first in the edge's ``features`` (``serve_edge(..., features=[RequestIds(), ...])``) so
    every feature after it, and every hop behind, sees the ids. The
    request's fields are rewritten in ``screen`` (a request that carried
    valid ones costs one scan and no copy), so the proxy, the worker and
    the replica see them; ``blocks.observe.REQUEST_IDS.get(exchange)`` holds them,
    ``(x-request-id, traceparent)``, for the features after it. The response gets them in place
    of any the upstream sent.

    An error the edge answers itself once it sent the request (every proxy
    unreachable) carries them too: the fields the ``response`` phase adds
    to a failure's head go out with the hop's error answer.
    """

    def screen(self, exchange: Exchange) -> None:
        request = exchange.request
        headers = request.headers
        rid, tp, changed = request_ids(headers)
        if changed:
            _replace(headers, rid, tp)
        notes = exchange.notes
        if notes is None:
            exchange.notes = {REQUEST_IDS: (rid, tp)}
        else:
            notes[REQUEST_IDS] = (rid, tp)

    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        notes = exchange.notes
        ids = notes.get(REQUEST_IDS) if notes is not None else None
        if ids is not None:
            _replace(headers, *ids)


__all__ = [
    "REQUEST_ID",
    "REQUEST_IDS",
    "TRACEPARENT",
    "RequestIds",
    "new_request_id",
    "new_traceparent",
    "request_ids",
    "valid_request_id",
    "valid_traceparent",
]
