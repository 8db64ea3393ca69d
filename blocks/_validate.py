"""Request-head validation, done once, at the edge (RFC 9113 8.2-8.3, RFC 9110).

What passes here is what every later hop trusts without looking again:
lowercase token field names, field values without NUL/CR/LF/controls or
surrounding whitespace, the four request pseudo-headers exactly once and
before any regular field, no connection-specific fields, ``te`` only as
``trailers``, one consistent ``content-length``, a ``:path`` of visible
ASCII, and one canonical lowercase authority that ``host`` (when present)
agrees with. Every failure is a :class:`~blocks.errors.BadRequest` (400)
for that request alone.
"""

from __future__ import annotations

import re

from blocks.errors import BadRequest
from blocks.http import Request

_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]|\A[ \t]|[ \t]\Z")
_PATH = re.compile(rb"[\x21-\x7e]+\Z")
_AUTHORITY = re.compile(rb"[A-Za-z0-9\-._~%!$&'()*+,;=:\[\]]+\Z")
_SCHEME = re.compile(rb"[a-z][a-z0-9+\-.]*\Z")
_METHOD = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})
_PSEUDO = {b":method": "method", b":scheme": "scheme", b":authority": "authority", b":path": "path"}


def check_header_list_size(fields: list[tuple[bytes, bytes]], max_size: int) -> None:
    size = 0
    for name, value in fields:
        size += len(name) + len(value) + 32
    if size > max_size:
        raise BadRequest(f"header list of {size} bytes is over {max_size}", status=431)


def validate_request_head(request: Request, raw: list[tuple[bytes, bytes]], max_size: int) -> int | None:
    """Fill ``request`` from an h2 header block, checking it; return the declared length.

    ``max_size`` caps the header list as RFC 7541 4.1 counts it (each field's
    name and value plus 32): past it, 431, so that no later hop, whose
    decoder holds the same cap, ever sees a head it would refuse.
    """
    check_header_list_size(raw, max_size)
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
        raise BadRequest("CONNECT is not supported", status=501)
    if not request.scheme or not _SCHEME.match(request.scheme):
        raise BadRequest("missing or bad :scheme")
    path = request.path
    if not path or not _PATH.match(path) or (path[0] != 47 and not (path == b"*" and method == b"OPTIONS")):
        raise BadRequest("missing or bad :path")
    authority = request.authority
    if not authority:
        if host is None:
            raise BadRequest("no :authority and no host")
        authority = host
    elif host is not None and host.lower() != authority.lower():
        raise BadRequest(":authority and host disagree")
    if not _AUTHORITY.match(authority):
        raise BadRequest("bad authority")
    request.authority = authority.lower()
    return length
