"""Signed tokens: proxy-auth tokens and session tokens, minted and verified locally.

Sans-IO: no trio, no network, no clock of its own. ``now`` is wall-clock
seconds (``time.time()``), passed in, because a token's times are written by
one machine and read by another.

The format
----------

One compact, URL-safe format for both kinds of token::

    v1.<kind>.<kid>.<payload>.<signature>

- ``v1``: the format version. Anything else is ``malformed``.
- ``<kind>``: ``a`` (proxy auth) or ``s`` (session).
- ``<kid>``: the key id, 1-32 characters of ``[A-Za-z0-9_-]``. The key decides
  the algorithm: the token has no algorithm field, so it cannot ask for a
  weaker one (the ``alg: none`` family of attacks has nothing to hold on to).
- ``<payload>``: the claims, compact JSON in unpadded base64url.
- ``<signature>``: unpadded base64url of HMAC-SHA256 (32 bytes) or Ed25519
  (64 bytes) over ``context(kind) + "v1.<kind>.<kid>.<payload>"``, where the
  context is ``proxyblocks/v1/auth\\0`` or ``proxyblocks/v1/session\\0``.

The kind sits in the clear so that a verifier can report ``wrong_kind`` for a
genuine token of the other kind, and it is bound twice: by the context string
the signature covers (a session token re-labelled ``a`` no longer verifies)
and by the check against the kind the caller expects. Either alone stops a
session token from opening the proxy, or a proxy-auth token from naming a
replica.

The payload is a JSON array, its fields fixed by the version: ``[app,
tenant, exp, nbf, iat]``, and for session tokens ``[..., session_id,
replica]``; times are whole seconds since the epoch, ``null`` when absent.
JSON because the standard library parses it in C with no schema compiler
and an operator reads it with ``base64 -d``; an array rather than an object
with short keys because it is smaller still and about a third cheaper to
parse and check (the claims are half the cost of an HMAC verify), and
because a verifier must not skip claims it does not know anyway (a new claim
may restrict a token): new claims come with a new version.

Checks, in order
----------------

:meth:`TokenVerifier.verify` stops at the first failure and raises
:class:`InvalidToken` with its :class:`TokenReason`:

1. size, before any decoding (``too_large``; 4 KiB by default);
2. shape: five parts, version ``v1``, a known kind (``malformed``);
3. the key id: a key in the :class:`Keyring`, not past its ``not_after``
   (``unknown_key``; no other key is ever tried);
4. the signature, in constant time (``hmac.compare_digest`` on the encoded
   signature, so a non-canonical base64 spelling never verifies; Ed25519
   through ``cryptography``) (``bad_signature``);
5. the payload: base64url, a JSON array, the kind's number of claims, their
   types (``malformed``);
6. the claims: kind (``wrong_kind``), app (``wrong_app``), expiry
   (``expired``: ``now >= exp + skew``) and not-before (``not_yet_valid``:
   ``now < nbf - skew``), with ``clock_skew`` (30 s by default) of allowance.
   ``iat`` is carried for the operator, not checked.

Every rejection is counted by reason in :meth:`TokenVerifier.statistics` and
logged at debug (reason and key id, never the token). The reason is for the
operator: the 401 a client gets says nothing more than ``401 Unauthorized``.

The verified-token cache
------------------------

Ed25519 verifies cost ~100 µs, HMAC-SHA256 ones a few; a cache hit is well
under a microsecond. The verifier caches tokens signed by Ed25519 keys only:
that is where a hit pays, and a bounded cache shared with cheap HMAC tokens
would spend its room on entries that save little while evicting the costly
ones. Invariants:

- **Only genuine tokens enter**: a token is cached after its signature and
  payload checked out, so forgeries can neither fill nor poison the cache.
- **No entry outlives its token or its key**: an entry is used only while
  ``now < min(exp + skew, key.not_after)``, and when the keyring changes
  (a key added, retired or removed) every entry whose key is no longer the
  keyring's key for that id is dropped before the next lookup.
- **Claims are checked on every hit**: the cache skips the signature, never
  the kind, app and time checks.
- **Bounded**: at most ``cache_size`` entries; the oldest goes first.

The modules
-----------

- ``_format``: the version, kinds and contexts, :class:`TokenClaims` and
  their decoding, :class:`TokenReason` and :class:`InvalidToken`;
- ``_keys``: :class:`TokenKey`, :class:`Keyring`, :class:`TokenIssuer`;
- ``_verifier``: :class:`TokenVerifier` and its cache;
- ``_proxy_auth``: :class:`ProxyAuth`, what the proxy runs per request.
"""

from blocks.errors import InvalidToken
from blocks.tokens._format import DEFAULT_MAX_SIZE, VERSION, TokenClaims, TokenKind, TokenReason
from blocks.tokens._keys import Algorithm, Keyring, TokenIssuer, TokenKey
from blocks.tokens._proxy_auth import ProxyAuth, ProxyAuthStatistics, take_token
from blocks.tokens._verifier import TokenVerifier, TokenVerifierConfig, TokenVerifierStatistics

__all__ = [
    # the format
    "DEFAULT_MAX_SIZE",
    "VERSION",
    "InvalidToken",
    "TokenClaims",
    "TokenKind",
    "TokenReason",
    # keys and minting
    "Algorithm",
    "Keyring",
    "TokenIssuer",
    "TokenKey",
    # verifying
    "TokenVerifier",
    "TokenVerifierConfig",
    "TokenVerifierStatistics",
    # proxy auth
    "ProxyAuth",
    "ProxyAuthStatistics",
    "take_token",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
