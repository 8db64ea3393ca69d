"""The HTTP/2 pool: pooled, multiplexed connections to one upstream address (see the package docstring
of :mod:`blocks.transport.multiplexer`).

- ``_connection``: one pooled connection (:class:`H2ClientConnection`): the
  streams it opens, their response clock, and the events that answer them;
- ``_pool``: the pool of one address (``_H2Pool``): a stream slot, or a new
  connection for one; a request's stream and its body pump; the splice and
  sink fast paths; the retry of a refused stream; the sweep of overdue ones.
"""

from blocks.transport.multiplexer._h2pool._connection import H2ClientConnection
from blocks.transport.multiplexer._h2pool._pool import _Attempt, _H2Pool

__all__ = ["H2ClientConnection", "_Attempt", "_H2Pool"]
