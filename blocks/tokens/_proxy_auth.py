"""Proxy auth: which apps require a token, where it is read, and stripping it before forwarding."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import attrs

from blocks.errors import InvalidToken, Unauthorized
from blocks.tokens._format import TokenClaims
from blocks.tokens._verifier import TokenVerifier

if TYPE_CHECKING:
    from blocks.http import Headers


@attrs.frozen
class ProxyAuthStatistics:
    """``required``: requests for apps that require a token; ``allowed``: those
    with a valid one; ``missing``: those without any; ``rejected``: those with
    an invalid one (reasons in the verifier's statistics)."""

    required: int
    allowed: int
    missing: int
    rejected: int


class ProxyAuth:
    """Which apps require a proxy-auth token, where the proxy reads it, and whether it is forwarded.

    ``apps`` is a collection of app names, or a predicate ``app -> bool``.
    The token is read from ``header`` (``authorization`` by default, as
    ``Bearer <token>``; any other header carries the bare token), then, if
    ``cookie`` names one, from that cookie. A request for an app that
    requires auth and carries no valid proxy-auth token for *that* app is
    refused with :class:`~blocks.errors.Unauthorized` (401,
    ``www-authenticate: Bearer``). Unless ``forward_token`` is set, every
    carrier of a token (the header fields, the cookie) is removed from the
    fields forwarded, so the replica never sees it. Requests for other apps
    pass untouched, their headers included.

    Wire it into a proxy with ``serve_proxy(..., auth=ProxyAuth(...))``: the
    proxy checks before the request is admitted by the scheduler, routed or
    sent anywhere.
    """

    def __init__(
        self,
        verifier: TokenVerifier,
        *,
        apps: Collection[str] | Callable[[str], bool],
        header: bytes | str = b"authorization",
        cookie: bytes | str | None = None,
        forward_token: bool = False,
    ) -> None:
        if isinstance(apps, (str, bytes)):
            raise TypeError("apps is a collection of app names or a predicate, not one string")
        self.verifier = verifier
        self.required: Callable[[str], bool] = apps if callable(apps) else frozenset(apps).__contains__
        self.header = (header.encode() if isinstance(header, str) else header).lower()
        self.cookie = cookie.encode() if isinstance(cookie, str) else cookie
        self.forward_token = forward_token
        self._bearer = self.header == b"authorization"
        self._required = self._allowed = self._missing = self._rejected = 0

    def __repr__(self) -> str:
        return f"<ProxyAuth header={self.header!r} cookie={self.cookie!r} {self.verifier!r}>"

    def statistics(self) -> ProxyAuthStatistics:
        return ProxyAuthStatistics(self._required, self._allowed, self._missing, self._rejected)

    def authorize(self, app: str, headers: Headers, now: float) -> tuple[TokenClaims | None, Headers]:
        """``(claims, headers to forward)`` for a request for ``app``; raises a 401 if refused.

        ``claims`` is None for an app that does not require auth (then
        ``headers`` comes back as it is). ``now``: wall-clock seconds.
        """
        if not self.required(app):
            return None, headers
        self._required += 1
        token, stripped = take_token(headers, self.header, self.cookie, bearer=self._bearer)
        if token is None:
            self._missing += 1
            raise Unauthorized(f"no proxy-auth token for app {app!r}")
        try:
            claims = self.verifier.verify(token, now=now, app=app, kind="auth")
        except InvalidToken:
            self._rejected += 1
            raise
        self._allowed += 1
        return claims, (headers if self.forward_token else stripped)

    def strip(self, app: str, headers: Headers) -> Headers:
        """``headers`` without this auth's token carriers when ``app`` requires auth (and tokens are not forwarded).

        For a request let in by other means (a session token) that also
        carries a proxy-auth token: the replica never sees one either way.
        """
        if self.forward_token or not self.required(app):
            return headers
        return take_token(headers, self.header, self.cookie, bearer=self._bearer)[1]


def take_token(
    headers: Headers, header: bytes, cookie: bytes | None = None, *, bearer: bool = False
) -> tuple[bytes | None, Headers]:
    """The first token in ``headers`` (field ``header`` first, then ``cookie``) and the fields without any carrier.

    With ``bearer``, the field's value is ``Bearer <token>``; a field of
    another scheme is not a carrier and is kept. Every carrier of a token is
    removed, not just the first, so none reaches the upstream.
    """
    from_header: bytes | None = None
    from_cookie: bytes | None = None
    kept: Headers = []
    for field in headers:
        name = field[0]
        if name == header:
            token = _from_header(field[1], bearer)
            if token is not None:
                if from_header is None:
                    from_header = token
                continue
        elif cookie is not None and name == b"cookie":
            value, rest = _take_cookie(field[1], cookie)
            if value is not None:
                if from_cookie is None:
                    from_cookie = value
                if rest:
                    kept.append((name, rest))
                continue
        kept.append(field)
    return (from_header if from_header is not None else from_cookie), kept


def _from_header(value: bytes, bearer: bool) -> bytes | None:
    if not bearer:
        return value.strip() or None
    scheme, _, rest = value.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None  # another scheme: not ours, left for the app
    return rest.strip() or None


def _take_cookie(value: bytes, name: bytes) -> tuple[bytes | None, bytes]:
    """``(the cookie's value or None, the field's value without it)``."""
    found: bytes | None = None
    rest: list[bytes] = []
    for pair in value.split(b";"):
        pair = pair.strip()
        key, eq, cookie_value = pair.partition(b"=")
        if eq and key.strip() == name:
            if found is None:
                cookie_value = cookie_value.strip()
                if len(cookie_value) >= 2 and cookie_value[:1] == cookie_value[-1:] == b'"':
                    cookie_value = cookie_value[1:-1]
                found = cookie_value or None
            continue
        if pair:
            rest.append(pair)
    return found, b"; ".join(rest)
