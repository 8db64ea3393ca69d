"""Request-head validation, done once, at the edge (RFC 9113 8.2-8.3, RFC 9110).

What passes here is what every later hop trusts without looking again:
lowercase token field names, field values without NUL/CR/LF/controls or
surrounding whitespace, the four request pseudo-headers exactly once and
before any regular field, no connection-specific fields, ``te`` only as
``trailers``, one consistent ``content-length``, a ``:path`` of visible
ASCII, and one canonical lowercase authority that ``host`` (when present)
agrees with. Every failure is a :class:`~blocks.errors.BadRequest` (400,
414 for a target over its cap, or 431 for a head over the size or
field-count cap) for that request alone.
A 400 means the request is malformed (RFC 9113 8.1.1): the h2 listener ends
its stream with RST_STREAM(PROTOCOL_ERROR), after the 400
(``RequestChecks.malformed``); so it does for trailers that fail
:func:`validate_trailers`.

The HTTP/1.1 side (``blocks.transport._h1server``) shares the caps and the authority
rule; h11 checks the rest of its syntax.
"""

from __future__ import annotations

import re

from blocks.errors import BadRequest
from blocks.http import Request

_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]|\A[ \t]|[ \t]\Z")
_PATH = re.compile(rb"[\x21-\x7e]+\Z")
# host [":" port], RFC 3986 3.2.2-3.2.3: a reg-name or an IP literal. No
# userinfo ("a@b"), no spaces, one port at most, so that every parser
# downstream finds the same host in it.
_AUTHORITY = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]+)(?::[0-9]{0,5})?\Z")
_SCHEME = re.compile(rb"[a-z][a-z0-9+\-.]*\Z")
_METHOD = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})
_PSEUDO = {
    b":method": "method",
    b":scheme": "scheme",
    b":authority": "authority",
    b":path": "path",
    b":protocol": "protocol",
}


def check_header_list_size(
    fields: list[tuple[bytes, bytes]], max_size: int, max_count: int | None = None, counted: int = 0
) -> None:
    """431 for a head over ``max_size`` (RFC 9113 6.5.2's count) or with more than ``max_count`` fields.

    Pseudo-headers are not fields: an h2 head and the same request over h1
    (where ``host`` is a field) meet the same count. ``counted``: what the
    head holds besides ``fields`` (an h1 target, as ``:path`` will carry it).
    """
    size = counted
    for name, value in fields:
        size += len(name) + len(value) + 32
    if size > max_size:
        raise BadRequest(f"header list of {size} bytes is over {max_size}", status=431)
    if max_count is not None and len(fields) > max_count:
        count = sum(name[:1] != b":" for name, _ in fields)
        if count > max_count:
            raise BadRequest(f"too many header fields: {count} over {max_count}", status=431)


def target_too_long(target: bytes, max_target: int) -> BadRequest:
    """414 for a request target (an h1 request line's, an h2 ``:path``) longer than ``max_target``."""
    return BadRequest(f"request target of {len(target)} bytes is over {max_target}", status=414)


def validate_trailers(fields: list[tuple[bytes, bytes]]) -> None:
    """Trailers follow the field rules of a head, and carry no pseudo-header (RFC 9113 8.1)."""
    for name, value in fields:
        if not _NAME.match(name):
            raise BadRequest(f"bad trailer name {name[:64]!r}")
        if _BAD_VALUE.search(value):
            raise BadRequest(f"bad value for trailer {name.decode()}")
        if name in _CONNECTION_SPECIFIC:
            raise BadRequest(f"connection-specific trailer {name.decode()}")


def check_authority(authority: bytes) -> bytes:
    """``authority`` in canonical form (lowercase); 400 unless it is a plain ``host[:port]``."""
    if not _AUTHORITY.match(authority):
        raise BadRequest("bad authority")
    return authority.lower()


def validate_request_head(
    request: Request,
    raw: list[tuple[bytes, bytes]],
    max_size: int,
    max_count: int | None = None,
    *,
    max_target: int | None = None,
    connect_protocol: bool = False,
) -> int | None:
    """Fill ``request`` from an h2 header block, checking it; return the declared length.

    ``max_size`` caps the header list as SETTINGS_MAX_HEADER_LIST_SIZE
    counts it (RFC 9113 6.5.2: each field's name and value plus 32,
    pseudo-headers included), and ``max_count`` (when given) the number of
    regular fields: past either, 431, so that no later hop (whose limit is
    higher: ``INTERNAL_LISTENER``) ever sees a head it would refuse. A
    ``:path`` longer than ``max_target`` (when given) is a 414, even in a
    head over the size cap: the more precise answer, and the one HTTP/1.1
    gets.

    With ``connect_protocol`` (the listener advertised
    ``SETTINGS_ENABLE_CONNECT_PROTOCOL``), an extended CONNECT (RFC 8441) is
    a valid request: ``:protocol`` a token, with ``:scheme``, ``:path`` and
    ``:authority`` all present; a WebSocket's must ask for
    ``sec-websocket-version: 13`` (else 426, naming the version we speak).
    A plain CONNECT stays 501, and ``:protocol`` anywhere else is a 400.
    """
    try:
        check_header_list_size(raw, max_size, max_count)
    except BadRequest:
        if max_target is not None:
            for name, value in raw:
                if name == b":path" and len(value) > max_target:
                    raise target_too_long(value, max_target) from None
        raise
    headers = request.headers
    seen: set[bytes] = set()
    regular = False
    length: int | None = None
    host: bytes | None = None
    for name, value in raw:
        if name[:1] == b":":
            attr = _PSEUDO.get(name)
            if attr is None:
                raise BadRequest(f"unknown pseudo-header {name!r}")
            if regular:
                raise BadRequest("pseudo-header after a regular field")
            if name in seen:
                raise BadRequest(f"repeated {name.decode()}")
            seen.add(name)
            setattr(request, attr, value)
            continue
        regular = True
        if not _NAME.match(name):
            raise BadRequest(f"bad field name {name[:64]!r}")
        if _BAD_VALUE.search(value):
            raise BadRequest(f"bad value for {name.decode()}")
        if name in _CONNECTION_SPECIFIC:
            raise BadRequest(f"connection-specific field {name.decode()}")
        if name == b"te":
            if value != b"trailers":
                raise BadRequest("te other than trailers")
        elif name == b"content-length":
            if not value.isdigit():
                raise BadRequest("bad content-length")
            declared = int(value)
            if length is not None and declared != length:
                raise BadRequest("conflicting content-length")
            length = declared
        elif name == b"host":
            if host is not None and value != host:
                raise BadRequest("conflicting host")
            host = value
            continue  # :authority carries it from here on
        headers.append((name, value))
    method = request.method
    if not method or not _METHOD.match(method):
        raise BadRequest("missing or bad :method")
    if method == b"CONNECT":
        _check_extended_connect(request, connect_protocol)
    elif request.protocol is not None:
        raise BadRequest(":protocol on a request other than CONNECT")
    if not request.scheme or not _SCHEME.match(request.scheme):
        raise BadRequest("missing or bad :scheme")
    path = request.path
    if max_target is not None and len(path) > max_target:
        raise target_too_long(path, max_target)
    if not path or not _PATH.match(path) or (path[0] != 47 and not (path == b"*" and method == b"OPTIONS")):
        raise BadRequest("missing or bad :path")
    authority = request.authority
    if not authority:
        if host is None:
            raise BadRequest("no :authority and no host")
        authority = host
    elif host is not None and host.lower() != authority.lower():
        raise BadRequest(":authority and host disagree")
    request.authority = check_authority(authority)
    return length


WEBSOCKET_VERSION = b"13"


def _check_extended_connect(request: Request, enabled: bool) -> None:
    """RFC 8441 4-5: what an extended CONNECT must be, beyond an ordinary head."""
    protocol = request.protocol
    if protocol is None:
        raise BadRequest("CONNECT is not supported", status=501)
    if not enabled:
        raise BadRequest(":protocol, where SETTINGS_ENABLE_CONNECT_PROTOCOL was not sent")
    if not _METHOD.match(protocol):
        raise BadRequest("bad :protocol")
    if not request.authority:
        raise BadRequest("extended CONNECT without :authority")
    if protocol == b"websocket" and request.header(b"sec-websocket-version") != WEBSOCKET_VERSION:
        raise upgrade_required()


def upgrade_required() -> BadRequest:
    """426 naming the WebSocket version we speak (RFC 6455 4.4)."""
    error = BadRequest("unsupported sec-websocket-version", status=426)
    error.headers = [(b"sec-websocket-version", WEBSOCKET_VERSION)]
    return error
