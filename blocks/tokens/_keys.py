"""Keys, the keyring, and minting.

HMAC keys are compiled once into two hash states per kind (RFC 2104 with the
padded key, and on the inner side the kind's context, already absorbed), so
that a verify hashes only the token.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import json
import math
import re
import secrets
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import attrs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from blocks.tokens._format import (
    CODES,
    CONTEXTS,
    DEFAULT_MAX_SIZE,
    TO_URLSAFE,
    VERSION,
    TokenKind,
    b64decode,
    b64encode,
)

Algorithm = Literal["hmac-sha256", "ed25519"]
_KID = re.compile(r"[A-Za-z0-9_-]{1,32}\Z")
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


# -- keys ---------------------------------------------------------------------------------------


def _check_kid(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not _KID.match(value):
        raise ValueError(f"kid must be 1-32 characters of [A-Za-z0-9_-], not {value!r}")


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _public_of(key: TokenKey) -> Ed25519PublicKey | None:
    return key.private_key.public_key() if key.private_key is not None else None


@attrs.frozen(kw_only=True, eq=False)
class TokenKey:
    """One key: its id, its algorithm, its material, and when it stops being accepted.

    - ``hmac-sha256``: ``secret`` (at least 32 bytes) both mints and verifies,
      so every verifier can also mint. The default: a verify costs a few µs.
    - ``ed25519``: ``private_key`` mints, ``public_key`` verifies (derived from
      the private key when not given). For deployments where verifiers must
      not be able to mint; verifies cost ~100 µs (the verifier caches them).

    ``not_after`` (wall-clock seconds, optional) ends the key's service: from
    then on its tokens are ``unknown_key``, whatever their own expiry. See
    :meth:`Keyring.rotate`. The secret and the private key never appear in
    the ``repr``. Keys compare by identity.
    """

    kid: str = attrs.field(validator=_check_kid)
    algorithm: Algorithm = attrs.field(validator=attrs.validators.in_(("hmac-sha256", "ed25519")))
    secret: bytes | None = attrs.field(default=None, repr=False)
    private_key: Ed25519PrivateKey | None = attrs.field(default=None, repr=False)
    public_key: Ed25519PublicKey | None = attrs.field(default=attrs.Factory(_public_of, takes_self=True), repr=False)
    not_after: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.algorithm == "hmac-sha256":
            if not isinstance(self.secret, bytes) or len(self.secret) < 32:
                raise ValueError("an hmac-sha256 key needs a secret of at least 32 bytes")
            if self.private_key is not None or self.public_key is not None:
                raise ValueError("an hmac-sha256 key takes a secret, not Ed25519 keys")
        else:
            if self.secret is not None:
                raise ValueError("an ed25519 key takes private_key and/or public_key, not a secret")
            if self.public_key is None:
                raise ValueError("an ed25519 key needs a private_key or a public_key")
            if self.private_key is not None and _raw(self.private_key.public_key()) != _raw(self.public_key):
                raise ValueError("the ed25519 public_key is not the private_key's")

    @classmethod
    def hmac(cls, kid: str, secret: bytes, *, not_after: float | None = None) -> TokenKey:
        """An HMAC-SHA256 key with ``secret`` (at least 32 random bytes)."""
        return cls(kid=kid, algorithm="hmac-sha256", secret=secret, not_after=not_after)

    @classmethod
    def ed25519(
        cls,
        kid: str,
        *,
        private_key: Ed25519PrivateKey | None = None,
        public_key: Ed25519PublicKey | None = None,
        not_after: float | None = None,
    ) -> TokenKey:
        """An Ed25519 key: ``private_key`` to mint (and verify), or only ``public_key`` to verify."""
        if public_key is None and private_key is not None:
            public_key = private_key.public_key()
        return cls(kid=kid, algorithm="ed25519", private_key=private_key, public_key=public_key, not_after=not_after)

    @classmethod
    def generate(cls, kid: str, algorithm: Algorithm = "hmac-sha256") -> TokenKey:
        """A fresh random key (32 bytes from ``secrets`` for HMAC, a new Ed25519 key pair)."""
        if algorithm == "ed25519":
            return cls.ed25519(kid, private_key=Ed25519PrivateKey.generate())
        return cls.hmac(kid, secrets.token_bytes(32))

    @property
    def can_mint(self) -> bool:
        return self.secret is not None or self.private_key is not None

    def verifying(self) -> TokenKey:
        """This key as a verifier needs it: an Ed25519 key without its private half (HMAC keys are unchanged)."""
        if self.algorithm == "ed25519" and self.private_key is not None:
            return attrs.evolve(self, private_key=None)
        return self


class Compiled:
    """A key ready for the hot path: HMAC pads hashed once (one per kind, context included)."""

    __slots__ = ("ed25519", "inner", "key", "kid", "not_after", "outer")

    def __init__(self, key: TokenKey) -> None:
        self.key = key
        self.kid = key.kid
        self.not_after = key.not_after
        self.ed25519 = key.public_key
        self.inner: dict[bytes, Any] = {}
        self.outer: Any = None
        if key.secret is not None:
            # HMAC (RFC 2104) from two hash states that already absorbed the padded
            # key and, on the inner side, the kind's context: a verify then hashes
            # only the token, and never pays OpenSSL's per-call HMAC setup (which
            # costs more than the hashing at this size).
            secret = key.secret if len(key.secret) <= 64 else hashlib.sha256(key.secret).digest()
            block = secret.ljust(64, b"\0")
            inner = hashlib.sha256(block.translate(_IPAD))
            self.outer = hashlib.sha256(block.translate(_OPAD))
            for code, context in CONTEXTS.items():
                state = inner.copy()
                state.update(context)
                self.inner[code] = state

    def hmac(self, code: bytes, signed: bytes) -> bytes:
        inner = self.inner[code].copy()
        inner.update(signed)
        outer = self.outer.copy()
        outer.update(inner.digest())
        digest: bytes = outer.digest()
        return digest

    def sign(self, code: bytes, signed: bytes) -> bytes:
        if self.outer is not None:
            return self.hmac(code, signed)
        private = self.key.private_key
        if private is None:
            raise ValueError(f"key {self.kid!r} cannot mint: it has no private key")
        return private.sign(CONTEXTS[code] + signed)

    def verify(self, code: bytes, signed: bytes, signature: bytes) -> bool:
        if self.outer is not None:  # HMAC, inlined: this is the hot path
            inner = self.inner[code].copy()
            inner.update(signed)
            outer = self.outer.copy()
            outer.update(inner.digest())
            # Compared as text: the one canonical spelling matches, no other (no padding, no spare bits).
            expected = binascii.b2a_base64(outer.digest(), newline=False)[:43].translate(TO_URLSAFE)
            return hmac.compare_digest(expected, signature)
        assert self.ed25519 is not None
        try:
            raw = b64decode(signature)
        except ValueError:
            return False
        # Only the canonical spelling: the last character's spare bits must be zero.
        if len(raw) != 64 or not hmac.compare_digest(b64encode(raw), signature):
            return False
        try:
            self.ed25519.verify(raw, CONTEXTS[code] + signed)
        except InvalidSignature:
            return False
        return True


class Keyring:
    """The keys a verifier accepts, by key id. Several are valid at once.

    Rotation without a hard cut: add the new key everywhere that verifies,
    then switch the issuers to it, and give the old key a ``not_after`` at
    least one token lifetime (plus the clock skew) ahead, so that tokens it
    already signed live out their time; :meth:`rotate` does the first and the
    last step in one call. :meth:`remove` revokes at once: every token of
    that key is ``unknown_key`` from the next verify on, cached or not.

    ``revision`` grows on every change (verifiers use it to drop cache
    entries of keys that changed or left).
    """

    def __init__(self, keys: Iterable[TokenKey] = ()) -> None:
        self.revision = 0
        self._compiled: dict[bytes, Compiled] = {}
        for key in keys:
            self.add(key)

    def __repr__(self) -> str:
        return f"<Keyring {sorted(self.kids())} revision={self.revision}>"

    def __len__(self) -> int:
        return len(self._compiled)

    def __contains__(self, kid: object) -> bool:
        return isinstance(kid, str) and kid.encode() in self._compiled

    def __iter__(self) -> Iterator[TokenKey]:
        return (compiled.key for compiled in list(self._compiled.values()))

    def kids(self) -> list[str]:
        return [compiled.kid for compiled in self._compiled.values()]

    def get(self, kid: str) -> TokenKey | None:
        compiled = self._compiled.get(kid.encode())
        return None if compiled is None else compiled.key

    def add(self, key: TokenKey) -> None:
        """Accept ``key`` from now on. A key id is never reused for other material: ``ValueError``."""
        kid = key.kid.encode()
        if kid in self._compiled:
            raise ValueError(f"key id {key.kid!r} is already in the keyring; remove it first, or use a new id")
        self._compiled[kid] = Compiled(key)
        self.revision += 1

    def remove(self, kid: str) -> TokenKey:
        """Stop accepting ``kid`` now: its tokens are revoked. ``KeyError`` if it is not here."""
        compiled = self._compiled.pop(kid.encode())
        self.revision += 1
        return compiled.key

    def retire(self, kid: str, not_after: float) -> None:
        """Accept ``kid`` until ``not_after`` (wall-clock seconds) only. ``KeyError`` if it is not here."""
        encoded = kid.encode()
        key = self._compiled[encoded].key
        self._compiled[encoded] = Compiled(attrs.evolve(key, not_after=not_after))
        self.revision += 1

    def rotate(self, new: TokenKey, *, now: float, overlap: float) -> None:
        """Add ``new`` and retire every other key at ``now + overlap`` (an earlier ``not_after`` stays).

        Make ``overlap`` at least the longest token lifetime plus the clock
        skew, so that no token signed by an old key dies before its expiry.
        """
        self.add(new)
        until = now + overlap
        for key in list(self):
            if key.kid != new.kid and (key.not_after is None or key.not_after > until):
                self.retire(key.kid, until)


# -- minting ------------------------------------------------------------------------------------


class TokenIssuer:
    """Mints tokens with one key (HMAC secret or Ed25519 private key)::

        issuer = TokenIssuer(TokenKey.hmac("k1", secret))
        token = issuer.mint(app="chat", tenant="acme", now=time.time(), ttl=3600)
        request_headers.append((b"authorization", b"Bearer " + token.encode()))

    Times are written as whole seconds: ``iat`` is ``floor(now)``, ``exp`` is
    ``floor(now + ttl)`` (a token never lives longer than ``ttl``), ``nbf``
    is ``floor(not_before)`` when given.
    """

    def __init__(self, key: TokenKey, *, max_size: int = DEFAULT_MAX_SIZE) -> None:
        if not key.can_mint:
            raise ValueError(f"key {key.kid!r} cannot mint: it has no secret or private key")
        self.key = key
        self.max_size = max_size
        self._compiled = Compiled(key)
        self._kid = key.kid.encode()

    def __repr__(self) -> str:
        return f"<TokenIssuer kid={self.key.kid!r} {self.key.algorithm}>"

    def mint(
        self,
        *,
        app: str,
        now: float,
        ttl: float,
        kind: TokenKind = "auth",
        tenant: str = "",
        not_before: float | None = None,
        session_id: str | None = None,
        replica: str | None = None,
    ) -> str:
        """A signed token for ``app``, valid from ``not_before`` (or at once) for ``ttl`` seconds from ``now``.

        Session tokens (``kind="session"``) need ``session_id`` and
        ``replica``; proxy-auth tokens take neither. ``ValueError`` if the
        token would be over ``max_size``.
        """
        if not all(isinstance(value, str) for value in (app, tenant, session_id or "", replica or "")):
            raise TypeError("app, tenant, session_id and replica are strings")
        if not (0 <= now < math.inf and 0 < ttl < math.inf):
            raise ValueError(f"now must be finite and not negative, ttl finite and positive: {now!r}, {ttl!r}")
        if not_before is not None and not 0 <= not_before < math.inf:
            raise ValueError(f"not_before must be finite and not negative, not {not_before!r}")
        claims: list[object] = [
            app,
            tenant,
            math.floor(now + ttl),
            None if not_before is None else math.floor(not_before),
            math.floor(now),
        ]
        if kind == "session":
            if session_id is None or replica is None:
                raise ValueError("a session token needs a session_id and a replica")
            claims += (session_id, replica)
        elif kind == "auth":
            if session_id is not None or replica is not None:
                raise ValueError("a proxy-auth token carries no session_id or replica")
        else:
            raise ValueError(f"kind must be 'auth' or 'session', not {kind!r}")
        code = CODES[kind]
        payload = b64encode(json.dumps(claims, separators=(",", ":")).encode())
        signed = b".".join((VERSION, code, self._kid, payload))
        token = signed + b"." + b64encode(self._compiled.sign(code, signed))
        if len(token) > self.max_size:
            raise ValueError(f"the token would be {len(token)} bytes, over {self.max_size}")
        return token.decode()
