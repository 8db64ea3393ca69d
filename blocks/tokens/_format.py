"""The wire format: versions, kinds, context strings, claims, reasons. See the package docstring."""

from __future__ import annotations

import binascii
import json
from typing import Final, Literal, NamedTuple

from blocks.errors import TokenReason as TokenReason  # (it lives with the other reasons; re-exported here)

TokenKind = Literal["auth", "session"]
"""``auth``: a proxy-auth token (opens one app). ``session``: a session token (names a session and its replica)."""

VERSION: Final = b"v1"
DEFAULT_MAX_SIZE: Final = 4096
"""Tokens longer than this (bytes) are ``too_large`` before anything is decoded."""

CODES: Final[dict[str, bytes]] = {"auth": b"a", "session": b"s"}
KINDS: Final[dict[bytes, TokenKind]] = {b"a": "auth", b"s": "session"}
CONTEXTS: Final[dict[bytes, bytes]] = {b"a": b"proxyblocks/v1/auth\0", b"s": b"proxyblocks/v1/session\0"}
TO_STANDARD = bytes.maketrans(b"-_", b"+/")
TO_URLSAFE = bytes.maketrans(b"+/", b"-_")
DECODER = json.JSONDecoder()


def b64encode(data: bytes) -> bytes:
    """Unpadded base64url."""
    return binascii.b2a_base64(data, newline=False).rstrip(b"=").translate(TO_URLSAFE)


def b64decode(text: bytes) -> bytes:
    """Unpadded base64url, strictly (raises ``binascii.Error`` on any stray character)."""
    return binascii.a2b_base64(text.translate(TO_STANDARD) + b"=" * (-len(text) % 4), strict_mode=True)


# -- reasons and errors --------------------------------------------------------------------------


# -- claims -----------------------------------------------------------------------------------


class TokenClaims(NamedTuple):
    """What a verified token says. Times are whole seconds since the epoch.

    ``session_id`` and ``replica`` are set on session tokens only. A
    NamedTuple rather than an attrs class: one is built on every verify that
    misses the cache, and it is the cheapest immutable record to build.
    """

    kind: TokenKind
    app: str
    tenant: str
    expires_at: int
    not_before: int | None
    issued_at: int | None
    kid: str
    session_id: str | None = None
    replica: str | None = None


new_claims = tuple.__new__  # what TokenClaims(...) calls, without its Python-level __new__ frame


def decode_claims(payload: bytes, kind: TokenKind, kid: str) -> TokenClaims | None:
    """The claims in ``payload`` (already authenticated); None if they are malformed."""
    try:
        text = binascii.a2b_base64(
            payload.translate(TO_STANDARD) + b"=" * (-len(payload) % 4), strict_mode=True
        ).decode()
        data, end = DECODER.raw_decode(text)
    except ValueError:  # binascii.Error, UnicodeDecodeError and JSONDecodeError all are
        return None
    if end != len(text) or type(data) is not list:
        return None
    session_id = replica = None
    if kind == "auth":
        if len(data) != 5:
            return None
        app, tenant, expires, nbf, iat = data
    else:
        if len(data) != 7:
            return None
        app, tenant, expires, nbf, iat, session_id, replica = data
        if type(session_id) is not str or type(replica) is not str:
            return None
    if (
        type(app) is not str
        or type(tenant) is not str
        or type(expires) is not int  # a bool is not an int here, nor is a float
        or expires < 0
        or (nbf is not None and (type(nbf) is not int or nbf < 0))
        or (iat is not None and (type(iat) is not int or iat < 0))
    ):
        return None
    return new_claims(TokenClaims, (kind, app, tenant, expires, nbf, iat, kid, session_id, replica))
