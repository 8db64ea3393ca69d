"""TLS contexts: the listener's server side, the upstream pools' client side.

Production deployments bring their own certificate; demos and tests make a
self-signed one with :func:`blocks.testing.make_self_signed`.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from blocks._meta import fixup_module_metadata


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context offering ALPN ``h2`` and ``http/1.1``, TLS 1.2 or newer."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


def client_context(ca_file: Path | None = None) -> ssl.SSLContext:
    """A client context offering ALPN ``h2`` and ``http/1.1``, TLS 1.2 or newer.

    It verifies the server's chain and host name against ``ca_file`` (PEM,
    one or more CA certificates) or, without one, the system's trust store.
    Raises ``OSError`` naming the file when ``ca_file`` cannot be read or
    holds no certificate.
    """
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError as exc:
        why = f"not a PEM file of CA certificates ({(exc.reason or 'unreadable').lower().replace('_', ' ')})"
        raise OSError(f"cannot load the CA file {ca_file}: {why}") from None
    except OSError as exc:
        raise OSError(f"cannot load the CA file {ca_file}: {exc.strerror or exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2", "http/1.1"])
    return context


__all__ = [
    "client_context",
    "server_context",
]

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
