"""What the HTTP/1.1 legs of a WebSocket tunnel share: the RFC 6455 handshake.

On h2 a WebSocket is an extended CONNECT (RFC 8441) and needs no key; on h1
it is a ``GET`` with ``Upgrade: websocket`` answered by ``101 Switching
Protocols``, whose ``Sec-WebSocket-Accept`` proves the server read this very
request. Each h1 leg makes (client side) or checks (server side) its own key,
so keys and accepts are hop-by-hop fields: they never cross a hop.

The accept token is wsproto's (:func:`wsproto.utilities.generate_accept_token`),
the same code trio-websocket's server and client use.
"""

from __future__ import annotations

import base64
import binascii
import os

from wsproto.utilities import generate_accept_token

from blocks.transport._validate import WEBSOCKET_VERSION

__all__ = ["KEY_FIELDS", "WEBSOCKET_VERSION", "accept_token", "comma_tokens", "new_key", "valid_key"]

KEY_FIELDS = frozenset({b"sec-websocket-key", b"sec-websocket-accept"})
"""The fields that tie a handshake to one h1 connection: each h1 leg writes its
own, and they never cross a hop. (``sec-websocket-version`` does cross: it
says what the client speaks.)"""


def accept_token(key: bytes) -> bytes:
    """The ``Sec-WebSocket-Accept`` that answers ``Sec-WebSocket-Key: key``."""
    token: bytes = generate_accept_token(key)
    return token


def new_key() -> bytes:
    """A fresh ``Sec-WebSocket-Key``: 16 random bytes, base64 (RFC 6455 4.1)."""
    return base64.b64encode(os.urandom(16))


def valid_key(key: bytes) -> bool:
    """Whether ``key`` is base64 of exactly 16 bytes, as RFC 6455 4.1 asks."""
    try:
        return len(base64.b64decode(key, validate=True)) == 16
    except (binascii.Error, ValueError):
        return False


def comma_tokens(headers: list[tuple[bytes, bytes]], name: bytes) -> set[bytes]:
    """Every comma-separated token of field ``name``, lowercase."""
    return {token.strip().lower() for key, value in headers if key == name for token in value.split(b",")}
