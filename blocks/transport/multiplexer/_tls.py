"""TLS upstreams (protocol ``"https"``): the handshake, and the pool its ALPN decides.

An ``https`` upstream is reached with TLS, its certificate checked (chain
and host name) against the :class:`~blocks.transport.multiplexer.Upstreams`'
one client context; the host name as written (``localhost``, not what it
resolves to) goes out as SNI and is what the certificate must name. ALPN
offers ``h2`` and ``http/1.1``.

The first handshake decides the pool. Until it is done the address has a
:class:`_TlsPool`, whose requests wait for it (one handshake, in the pool's
nursery, whoever asked first); then an :class:`_H2Pool` or an
:class:`_H1Pool` takes that connection and the pool's place, for the life of
the ``Upstreams``. From then on an ``https`` request costs what a cleartext
one does, and an ``https`` upstream that speaks h2 is spliced like one in
cleartext. Every later connection of the pool must negotiate the same
protocol: one that does not is refused, a 502 that says so.
"""

from __future__ import annotations

import functools
import ssl

import trio

from blocks._sync import Signal
from blocks.errors import UpstreamConnectError
from blocks.http import Headers, Request, Response
from blocks.transport import Address
from blocks.transport.multiplexer._config import PoolStatistics, UpstreamConfig
from blocks.transport.multiplexer._h1pool import _H1Pool
from blocks.transport.multiplexer._h2pool import _Attempt, _H2Pool

Pools = dict[tuple[Address, str], object]


class TlsFailure(OSError):
    """A TLS handshake that failed; its message says why, in one line."""


def _why(exc: BaseException) -> str:
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"TLS handshake failed: certificate verify failed: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError):
        if cause.reason == "WRONG_VERSION_NUMBER":
            return "TLS handshake failed: wrong version number (not a TLS server?)"
        reason = (cause.reason or str(cause)).lower().replace("_", " ")
        return f"TLS handshake failed: {reason}"
    return "TLS handshake failed: the upstream closed the connection"


async def dial(
    address: Address, context: ssl.SSLContext, expect: str | None = None
) -> trio.SSLStream[trio.SocketStream]:
    """TCP to ``address``, then the TLS handshake, SNI and host name check on its host as written.

    With ``expect``, the ALPN protocol the handshake must settle on (no
    ALPN at all counts as ``http/1.1``). Raises ``OSError``.
    """
    host, port = address
    tcp = await trio.open_tcp_stream(host, port)
    tls = trio.SSLStream(tcp, context, server_hostname=host, https_compatible=True)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(tcp)
        raise TlsFailure(_why(exc)) from exc
    except BaseException:
        await trio.aclose_forcefully(tcp)
        raise
    if expect is not None and (tls.selected_alpn_protocol() or "http/1.1") != expect:
        await trio.aclose_forcefully(tls)
        raise TlsFailure(
            f"TLS: ALPN settled on {tls.selected_alpn_protocol() or 'http/1.1'}, where this pool speaks {expect}"
        )
    return tls


class _TlsPool:
    """An ``https`` upstream before its first handshake is done (see the module docstring)."""

    def __init__(
        self,
        address: Address,
        config: UpstreamConfig,
        nursery: trio.Nursery,
        context: ssl.SSLContext,
        pools: Pools,
        watch: Signal,
    ) -> None:
        self.address = address
        self.config = config
        self.nursery = nursery
        self._context = context
        self._pools = pools
        self._watch = watch  # the sweeper's (Upstreams._sweep), for the h2 pool this may become
        self._attempt: _Attempt | None = None
        self._decided: _H2Pool | _H1Pool | None = None

    def statistics(self) -> PoolStatistics:
        return PoolStatistics(self.address, "https", 0, 0)

    def splice(self, *args: object) -> bool:
        return False  # (the handler path makes the first connection)

    def sink(self, *args: object) -> bool:
        return False

    async def request(self, request: Request, headers: Headers, timeout: float) -> Response:
        while self._decided is None:
            attempt = self._attempt
            if attempt is None:
                attempt = self._attempt = _Attempt()
                self.nursery.start_soon(self._decide, attempt)
            await attempt.done.wait()
            if attempt.error is not None:
                host, port = self.address
                raise UpstreamConnectError(f"cannot connect to {host}:{port}: {attempt.error}") from attempt.error
        response: Response = await self._decided.request(request, headers, timeout)
        return response

    async def _decide(self, attempt: _Attempt) -> None:
        """The first handshake, in the pool's nursery; its ALPN makes the pool that replaces this one."""
        address = self.address
        pool: _H2Pool | _H1Pool
        try:
            with trio.fail_after(self.config.connect_timeout):
                stream = await dial(address, self._context)
                if stream.selected_alpn_protocol() == "h2":
                    redial = functools.partial(dial, address, self._context, "h2")
                    pool = _H2Pool(address, self.config, self.nursery, dial=redial, protocol="https", watch=self._watch)
                    await pool.adopt(stream)
                else:
                    redial = functools.partial(dial, address, self._context, "http/1.1")
                    pool = _H1Pool(address, self.config, self.nursery, dial=redial, protocol="https")
                    pool.adopt(stream)
            self._decided = self._pools[(address, "https")] = pool
        except (OSError, RuntimeError) as exc:
            attempt.error = exc
        except trio.TooSlowError as exc:
            attempt.error = TlsFailure(f"no TLS connection within {self.config.connect_timeout}s")
            attempt.error.__cause__ = exc
        finally:
            self._attempt = None
            attempt.done.set()
