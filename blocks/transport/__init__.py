"""Bytes and protocols: the layer every block stands on, and which imports no block.

- ``listener``: one port, HTTP/1.1 and HTTP/2, cleartext or TLS (``_h1server``,
  ``_h2server``, request-head validation in ``_validate``, upgrades in
  ``_upgrade``); ``tls``: contexts and self-signed certificates.
- ``_h2``: the HTTP/2 driver both sides share (one ``h2`` connection on a trio
  stream, its writer, flow control and the books of every DATA byte);
  ``_splice``: the fast path joining a downstream stream to an upstream one;
  ``_tap``: watching an exchange go by.
- ``multiplexer``: the client side, pooled and multiplexed h2 connections and
  keep-alive h1 connections to upstream addresses.

What it may import besides itself: the shared vocabulary of every layer,
:mod:`blocks.http` (requests, responses, bodies), :mod:`blocks.errors`,
:mod:`blocks.fields` (the hops' own fields) and :mod:`blocks.timing` (the
phases a request carries). Its stream-level pieces (the h2 driver, splices,
taps, upgrades) are public in :mod:`blocks.transport.streams`.
"""

from blocks._common import Address as Address

__all__ = ["Address"]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
