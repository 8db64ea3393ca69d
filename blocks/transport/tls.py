"""TLS server contexts.

Production deployments bring their own certificate; demos and tests make a
self-signed one with :func:`blocks.testing.make_self_signed`.
"""

from __future__ import annotations

import ssl
from pathlib import Path


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context offering ALPN ``h2`` and ``http/1.1``, TLS 1.2 or newer."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


__all__ = [
    "server_context",
]
