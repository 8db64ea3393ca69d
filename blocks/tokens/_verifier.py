"""The verifier: the checks in order, the counters, the verified-token cache."""

from __future__ import annotations

import logging
from collections import OrderedDict

import attrs

from blocks._common import finite
from blocks.errors import InvalidToken
from blocks.tokens._format import DEFAULT_MAX_SIZE, KINDS, VERSION, TokenClaims, TokenKind, TokenReason, decode_claims
from blocks.tokens._keys import Compiled, Keyring

log = logging.getLogger("blocks.tokens")


@attrs.frozen(kw_only=True)
class TokenVerifierConfig:
    """How strict a :class:`TokenVerifier` is.

    - ``max_size``: tokens longer than this (bytes) are ``too_large``,
      before anything is decoded.
    - ``clock_skew``: seconds of allowance on ``exp`` and ``nbf`` for clocks
      that disagree between the issuer and the verifier.
    - ``cache_size``: verified Ed25519 tokens remembered (0: no cache).
    """

    max_size: int = attrs.field(default=DEFAULT_MAX_SIZE, validator=attrs.validators.ge(64))
    clock_skew: float = attrs.field(default=30.0, validator=[attrs.validators.ge(0), finite])
    cache_size: int = attrs.field(default=10_000, validator=attrs.validators.ge(0))


@attrs.frozen
class TokenVerifierStatistics:
    """``verified``: tokens accepted (cache hits included); ``rejected``: reason -> count
    (every :class:`TokenReason` value, zeros included); ``cache_hits``; ``cache_entries`` now."""

    verified: int
    rejected: dict[str, int]
    cache_hits: int
    cache_entries: int


# A cache entry: the claims of a genuine token, the time from which the entry is
# no longer used (its token's exp + skew, or its key's not_after if sooner), and
# the key that signed it (to drop the entry when that key leaves the keyring).
_Entry = tuple[TokenClaims, float, Compiled]


class TokenVerifier:
    """Verifies tokens against a :class:`Keyring`; sans-IO, ``now`` is wall-clock seconds::

        verifier = TokenVerifier(Keyring([TokenKey.hmac("k1", secret)]))
        claims = verifier.verify(token, now=time.time(), app="chat")   # or raises InvalidToken
        claims.tenant

    The checks and their order are in the package docstring. Several
    verifiers may share a keyring; each keeps its own cache and counters.
    """

    def __init__(self, keyring: Keyring, config: TokenVerifierConfig | None = None) -> None:
        self.keyring = keyring
        self.config = config = config or TokenVerifierConfig()
        self._max_size = config.max_size
        self._skew = config.clock_skew
        self._cache_size = config.cache_size
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._revision = keyring.revision
        self._keys = keyring._compiled  # the keyring's own dict (never rebound): one attribute hop less
        self._verified = 0
        self._hits = 0
        self._rejected = dict.fromkeys(TokenReason, 0)

    def __repr__(self) -> str:
        return f"<TokenVerifier {self.keyring!r} cache={len(self._cache)}/{self._cache_size}>"

    def statistics(self) -> TokenVerifierStatistics:
        return TokenVerifierStatistics(
            self._verified,
            {reason.value: count for reason, count in self._rejected.items()},
            self._hits,
            len(self._cache),
        )

    def _reject(self, reason: TokenReason, kid: bytes | str = b"") -> InvalidToken:
        self._rejected[reason] += 1
        log.debug("token rejected: %s (kid %r)", reason.value, kid[:40])
        return InvalidToken(reason)

    def _resync(self) -> None:
        """The keyring changed: forget entries whose key is gone or was replaced (retired)."""
        self._revision = self.keyring.revision
        keys = self._keys
        cache = self._cache
        for token in [token for token, (_, _, key) in cache.items() if keys.get(key.kid.encode()) is not key]:
            del cache[token]

    def verify(self, token: bytes | str, *, now: float, app: str, kind: TokenKind = "auth") -> TokenClaims:
        """The claims of ``token`` if it is genuine, for ``app`` and ``kind``, and valid at ``now``.

        Raises :class:`InvalidToken` (a 401) with the first failed check's
        :class:`TokenReason`. Never reads a clock, never does I/O.
        """
        if len(token) > self._max_size:
            raise self._reject(TokenReason.TOO_LARGE)
        if isinstance(token, str):
            try:
                token = token.encode("ascii")
            except UnicodeEncodeError:
                raise self._reject(TokenReason.MALFORMED) from None
        if self.keyring.revision != self._revision:
            self._resync()
        claims: TokenClaims | None = None
        cache = self._cache
        if cache:
            entry = cache.get(token)
            if entry is not None:
                if now < entry[1]:
                    claims = entry[0]  # genuine: only the claims are left to check
                    self._hits += 1
                else:
                    del cache[token]  # past its token's expiry or its key's not_after
        if claims is None:
            # Checks 2 to 5, inline: this is the hot path of every HMAC verify.
            parts = token.split(b".")
            token_kind = KINDS.get(parts[1]) if len(parts) == 5 and parts[0] == VERSION else None
            if token_kind is None:
                raise self._reject(TokenReason.MALFORMED)
            _, code, kid, payload, signature = parts
            key = self._keys.get(kid)
            if key is None or (key.not_after is not None and now >= key.not_after):
                raise self._reject(TokenReason.UNKNOWN_KEY, kid)
            if not key.verify(code, token[: len(token) - len(signature) - 1], signature):
                raise self._reject(TokenReason.BAD_SIGNATURE, kid)
            claims = decode_claims(payload, token_kind, key.kid)
            if claims is None:
                raise self._reject(TokenReason.MALFORMED, kid)
            if key.ed25519 is not None and self._cache_size:
                self._remember(token, claims, key, now)
        skew = self._skew
        if claims.kind != kind:
            raise self._reject(TokenReason.WRONG_KIND, claims.kid)
        if claims.app != app:
            raise self._reject(TokenReason.WRONG_APP, claims.kid)
        if now >= claims.expires_at + skew:
            raise self._reject(TokenReason.EXPIRED, claims.kid)
        if claims.not_before is not None and now < claims.not_before - skew:
            raise self._reject(TokenReason.NOT_YET_VALID, claims.kid)
        self._verified += 1
        return claims

    def _remember(self, token: bytes, claims: TokenClaims, key: Compiled, now: float) -> None:
        """Cache a genuine token until its expiry (plus skew) or its key's ``not_after``, whichever is first."""
        valid_until = claims.expires_at + self._skew
        if key.not_after is not None:
            valid_until = min(valid_until, key.not_after)
        if now < valid_until:
            cache = self._cache
            if len(cache) >= self._cache_size:
                cache.popitem(last=False)
            cache[token] = (claims, valid_until, key)
