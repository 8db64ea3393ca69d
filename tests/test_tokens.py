"""The token verifier, its keys and cache, and proxy auth's header handling: all sans-IO.

Synchronous tests with plain float wall-clock times (``NOW``), hypothesis
properties for the format. Signatures of hand-built tokens are computed here
with the standard library (``hmac``) and ``cryptography``, independently of
the module's own signing code, so these tests pin the wire format down.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
import string
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from blocks import BlocksError, Keyring, ProxyAuth, TokenIssuer, TokenKey, TokenVerifier, Unauthorized
from blocks.errors import InvalidToken
from blocks.tokens import TokenClaims, TokenReason, TokenVerifierConfig

NOW = 1_700_000_000.0
SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(100, 132))
ED_PRIVATE = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
CONTEXTS = {"a": b"proxyblocks/v1/auth\0", "s": b"proxyblocks/v1/session\0"}
B64URL = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"  # in base64 order
TOKEN = re.compile(r"v1\.[as]\.[A-Za-z0-9_-]{1,32}\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\Z")


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hmac_key(kid: str = "k1", secret: bytes = SECRET, **kwargs: float) -> TokenKey:
    return TokenKey.hmac(kid, secret, **kwargs)


def ed_key(kid: str = "e1") -> TokenKey:
    return TokenKey.ed25519(kid, private_key=ED_PRIVATE)


def verifier(*keys: TokenKey, **config: Any) -> TokenVerifier:
    return TokenVerifier(Keyring(keys), TokenVerifierConfig(**config))


def mint(key: TokenKey, **claims: Any) -> str:
    args: dict[str, Any] = {"app": "chat", "tenant": "acme", "now": NOW, "ttl": 3600.0}
    args.update(claims)
    return TokenIssuer(key).mint(**args)


def reason(check: TokenVerifier, token: str | bytes, **kwargs: Any) -> TokenReason:
    args: dict[str, Any] = {"now": NOW, "app": "chat", "kind": "auth"}
    args.update(kwargs)
    with pytest.raises(InvalidToken) as caught:
        check.verify(token, **args)
    return caught.value.reason


def signed_by_hand(payload: str, *, kind: str = "a", kid: str = "k1", secret: bytes = SECRET) -> str:
    """A token around ``payload`` (already base64url), signed with the stdlib's HMAC."""
    signed = f"v1.{kind}.{kid}.{payload}"
    return f"{signed}.{b64(hmac.digest(secret, CONTEXTS[kind] + signed.encode(), hashlib.sha256))}"


def claims_by_hand(value: object, **kwargs: Any) -> str:
    return signed_by_hand(b64(json.dumps(value, separators=(",", ":")).encode()), **kwargs)


# -- the format ---------------------------------------------------------------------------------


def test_an_issued_auth_token_has_the_documented_shape() -> None:
    token = mint(hmac_key(), not_before=NOW - 10)
    assert TOKEN.match(token), token
    version, kind, kid, payload, signature = token.split(".")
    assert (version, kind, kid) == ("v1", "a", "k1")
    assert json.loads(base64.urlsafe_b64decode(payload + "==")) == ["chat", "acme", NOW + 3600, NOW - 10, NOW]
    assert len(signature) == 43  # 32 bytes, unpadded
    signed = token.rsplit(".", 1)[0].encode()
    assert signature == b64(hmac.digest(SECRET, CONTEXTS["a"] + signed, hashlib.sha256))


def test_an_issued_session_token_carries_session_and_replica() -> None:
    token = mint(ed_key(), kind="session", session_id="room-7", replica="replica-3")
    version, kind, kid, payload, signature = token.split(".")
    assert (version, kind, kid) == ("v1", "s", "e1")
    assert json.loads(base64.urlsafe_b64decode(payload + "==")) == [
        "chat",
        "acme",
        NOW + 3600,
        None,
        NOW,
        "room-7",
        "replica-3",
    ]
    assert len(signature) == 86  # 64 bytes, unpadded
    raw = base64.urlsafe_b64decode(signature + "==")
    ED_PRIVATE.public_key().verify(raw, CONTEXTS["s"] + token.rsplit(".", 1)[0].encode())  # raises if not


def test_hmac_keys_longer_than_a_block_are_hashed_first_as_rfc_2104_says() -> None:
    secret = bytes(range(200))
    token = mint(hmac_key(secret=secret))
    signed = token.rsplit(".", 1)[0].encode()
    assert token.rsplit(".", 1)[1] == b64(hmac.digest(secret, CONTEXTS["a"] + signed, hashlib.sha256))
    assert verifier(hmac_key(secret=secret)).verify(token, now=NOW, app="chat").app == "chat"


@pytest.mark.parametrize("key", [hmac_key(), ed_key()], ids=["hmac", "ed25519"])
def test_round_trip(key: TokenKey) -> None:
    check = verifier(key.verifying())
    claims = check.verify(mint(key, not_before=NOW - 5), now=NOW, app="chat")
    assert claims == TokenClaims("auth", "chat", "acme", int(NOW) + 3600, int(NOW) - 5, int(NOW), key.kid)
    session = check.verify(
        mint(key, kind="session", session_id="s-1", replica="r-1"), now=NOW, app="chat", kind="session"
    )
    assert (session.kind, session.session_id, session.replica) == ("session", "s-1", "r-1")
    assert check.statistics().verified == 2


def test_times_are_whole_seconds_and_never_lengthen_a_token() -> None:
    claims = verifier(hmac_key()).verify(mint(hmac_key(), now=NOW + 0.9, ttl=10.5), now=NOW + 1, app="chat")
    assert (claims.issued_at, claims.expires_at) == (int(NOW), int(NOW) + 11)


names = st.text(max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    algorithm=st.sampled_from(["hmac-sha256", "ed25519"]),
    kind=st.sampled_from(["auth", "session"]),
    app=names,
    tenant=names,
    session_id=names,
    replica=names,
    now=st.floats(0, 4e9),
    ttl=st.floats(1, 1e7),
    nbf_offset=st.none() | st.floats(-1e6, 0),
)
def test_issued_tokens_round_trip(
    algorithm: str,
    kind: Any,
    app: str,
    tenant: str,
    session_id: str,
    replica: str,
    now: float,
    ttl: float,
    nbf_offset: float | None,
) -> None:
    key = ed_key() if algorithm == "ed25519" else hmac_key()
    sessioned = {"session_id": session_id, "replica": replica} if kind == "session" else {}
    not_before = None if nbf_offset is None else max(0.0, now + nbf_offset)
    token = TokenIssuer(key).mint(
        app=app, tenant=tenant, now=now, ttl=ttl, kind=kind, not_before=not_before, **sessioned
    )
    assert TOKEN.match(token)
    claims = verifier(key.verifying()).verify(token, now=now, app=app, kind=kind)
    assert (claims.kind, claims.app, claims.tenant, claims.kid) == (kind, app, tenant, key.kid)
    assert (claims.session_id, claims.replica) == ((session_id, replica) if kind == "session" else (None, None))
    assert claims.issued_at == int(now) and claims.expires_at == int(now + ttl)
    assert claims.not_before == (None if not_before is None else int(not_before))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300))
def test_arbitrary_input_is_rejected_with_a_reason_never_an_error(data: bytes | str) -> None:
    with pytest.raises(InvalidToken):
        verifier(hmac_key(), ed_key()).verify(data, now=NOW, app="chat")


# -- tampering ----------------------------------------------------------------------------------


def regions(token: str) -> list[str]:
    """The part each character of ``token`` belongs to."""
    names = ["version", "kind", "kid", "payload", "signature"]
    out = []
    for index, part in enumerate(token.split(".")):
        out += [names[index]] * len(part)
        if index < 4:
            out.append("dot")
    return out


EXPECTED = {
    "version": {TokenReason.MALFORMED},
    "dot": {TokenReason.MALFORMED},
    "kind": {TokenReason.MALFORMED, TokenReason.BAD_SIGNATURE},  # "s" re-labels: the context no longer matches
    "kid": {TokenReason.UNKNOWN_KEY, TokenReason.MALFORMED},
    "payload": {TokenReason.BAD_SIGNATURE, TokenReason.MALFORMED},  # MALFORMED: a "." splits the token
    "signature": {TokenReason.BAD_SIGNATURE, TokenReason.MALFORMED},
}


def test_changing_any_byte_of_an_hmac_token_to_anything_else_is_rejected() -> None:
    token = mint(hmac_key())
    check = verifier(hmac_key())
    where = regions(token)
    tried = 0
    for position, original in enumerate(token):
        for replacement in B64URL + ".=+/ \x00\xff":
            if replacement == original:
                continue
            tampered = token[:position] + replacement + token[position + 1 :]
            assert reason(check, tampered) in EXPECTED[where[position]], (position, replacement)
            tried += 1
    assert check.statistics().verified == 0
    assert sum(check.statistics().rejected.values()) == tried
    assert check.verify(token, now=NOW, app="chat").app == "chat"


def test_changing_any_byte_of_an_ed25519_token_is_rejected() -> None:
    token = mint(ed_key())
    check = verifier(ed_key().verifying(), cache_size=0)
    where = regions(token)
    for position, original in enumerate(token):
        # Every base64url character at the signature's last position: its spare bits must be zero.
        replacements = B64URL if position == len(token) - 1 else "A_.9"
        for replacement in replacements:
            if replacement != original:
                tampered = token[:position] + replacement + token[position + 1 :]
                assert reason(check, tampered) in EXPECTED[where[position]], (position, replacement)
    assert check.statistics().verified == 0


@pytest.mark.parametrize("key", [hmac_key(), ed_key()], ids=["hmac", "ed25519"])
def test_removing_or_adding_any_byte_is_rejected(key: TokenKey) -> None:
    token = mint(key)
    check = verifier(key.verifying(), cache_size=0)
    for position in range(len(token)):
        reason(check, token[:position] + token[position + 1 :])
        reason(check, token[:position] + "A" + token[position:])
    for cut in range(len(token)):
        reason(check, token[:cut])
    reason(check, token + "A")
    reason(check, token + "=")
    reason(check, token + "==")
    assert check.statistics().verified == 0


def test_a_non_canonical_signature_spelling_never_verifies() -> None:
    token = mint(hmac_key())
    signed, signature = token.rsplit(".", 1)
    last = B64URL.index(signature[-1])
    # 43 characters carry 258 bits for 256: the last one's two low bits are spare.
    twins = [B64URL[(last & ~3) | low] for low in range(4) if (last & ~3) | low != last]
    check = verifier(hmac_key())
    for twin in twins:
        assert base64.urlsafe_b64decode(signature[:-1] + twin + "=") == base64.urlsafe_b64decode(signature + "=")
        assert reason(check, f"{signed}.{signature[:-1]}{twin}") is TokenReason.BAD_SIGNATURE
    assert reason(check, f"{signed}.{signature}=") is TokenReason.BAD_SIGNATURE


# -- each check, and their order ----------------------------------------------------------------


def test_too_large_is_decided_before_anything_is_decoded() -> None:
    check = verifier(hmac_key())
    assert reason(check, "x" * 4097) is TokenReason.TOO_LARGE
    big = TokenIssuer(hmac_key(), max_size=10_000).mint(app="chat", tenant="t" * 4000, now=NOW, ttl=60)
    assert reason(check, big) is TokenReason.TOO_LARGE
    small = verifier(hmac_key(), max_size=100)
    assert reason(small, mint(hmac_key())) is TokenReason.TOO_LARGE
    assert check.statistics().rejected["too_large"] == 2


def test_a_token_just_at_the_cap_is_checked() -> None:
    token = mint(hmac_key())
    assert verifier(hmac_key(), max_size=len(token)).verify(token, now=NOW, app="chat").app == "chat"


@pytest.mark.parametrize(
    "token",
    [
        "",
        "v1",
        "v1.a.k1.payload",
        "v1.a.k1.payload.sig.extra",
        "v2.a.k1.WyJjaGF0Il0.sig",
        "V1.a.k1.WyJjaGF0Il0.sig",
        "v1.x.k1.WyJjaGF0Il0.sig",
        "v1.auth.k1.WyJjaGF0Il0.sig",
        "v1..k1.WyJjaGF0Il0.sig",
        "....",
        "v1.a.k1.WyJjaGF0Il0.sïg",
    ],
)
def test_the_wrong_shape_is_malformed(token: str) -> None:
    assert reason(verifier(hmac_key()), token) is TokenReason.MALFORMED


def test_a_bytes_token_from_a_header_is_verified_like_a_str() -> None:
    token = mint(hmac_key())
    check = verifier(hmac_key())
    assert check.verify(token.encode(), now=NOW, app="chat") == check.verify(token, now=NOW, app="chat")
    assert reason(check, token.encode() + b"\xff") is TokenReason.BAD_SIGNATURE


GOOD = ["chat", "acme", int(NOW) + 60, None, int(NOW)]


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param("!!!!", id="not base64"),
        pytest.param("WyJj", id="truncated JSON"),
        pytest.param("A", id="impossible base64 length"),
        pytest.param(b64(b"\xff\xfe"), id="not UTF-8"),
        pytest.param(b64(b'["chat","acme",1700000060,null,1700000000] '), id="trailing space"),
        pytest.param(b64(b'["chat","acme",1700000060,null,1700000000]x'), id="trailing garbage"),
        pytest.param(b64(b' ["chat","acme",1700000060,null,1700000000]'), id="leading space"),
        pytest.param(b64(b'{"a":"chat","e":1700000060}'), id="an object"),
        pytest.param(b64(b'["chat","acme",1700000060,null]'), id="too few claims"),
        pytest.param(b64(b'["chat","acme",1700000060,null,1700000000,"s","r"]'), id="session claims on auth"),
        pytest.param(b64(b'["chat","acme","1700000060",null,1700000000]'), id="exp as a string"),
        pytest.param(b64(b'["chat","acme",1700000060.5,null,1700000000]'), id="exp as a float"),
        pytest.param(b64(b'["chat","acme",true,null,1700000000]'), id="exp as a bool"),
        pytest.param(b64(b'["chat","acme",null,null,1700000000]'), id="no exp"),
        pytest.param(b64(b'["chat","acme",-1,null,1700000000]'), id="negative exp"),
        pytest.param(b64(b'["chat","acme",1700000060,"soon",1700000000]'), id="nbf as a string"),
        pytest.param(b64(b'["chat","acme",1700000060,null,1.5]'), id="iat as a float"),
        pytest.param(b64(b'[1,"acme",1700000060,null,1700000000]'), id="app as a number"),
        pytest.param(b64(b'["chat",null,1700000060,null,1700000000]'), id="tenant null"),
        pytest.param(b64(b'["chat","acme",1700000060,NaN,1700000000]'), id="NaN"),
    ],
)
def test_a_genuine_token_with_bad_claims_is_malformed(payload: str) -> None:
    check = verifier(hmac_key())
    assert reason(check, signed_by_hand(payload)) is TokenReason.MALFORMED
    assert check.statistics().rejected["malformed"] == 1


def test_a_hand_built_token_in_the_documented_format_verifies() -> None:
    check = verifier(hmac_key())
    assert check.verify(claims_by_hand(GOOD), now=NOW, app="chat").tenant == "acme"
    session = claims_by_hand([*GOOD, "s-1", "r-1"], kind="s")
    assert check.verify(session, now=NOW, app="chat", kind="session").replica == "r-1"
    assert reason(check, claims_by_hand([*GOOD, 1, "r-1"], kind="s"), kind="session") is TokenReason.MALFORMED
    assert reason(check, claims_by_hand(GOOD, kind="s"), kind="session") is TokenReason.MALFORMED


def test_an_unknown_kid_is_rejected_without_trying_other_keys() -> None:
    # The same secret under another id: trying every key would accept it.
    stranger = mint(hmac_key("k2", SECRET))
    check = verifier(hmac_key("k1", SECRET))
    assert reason(check, stranger) is TokenReason.UNKNOWN_KEY
    # The kid decides the key: k1's id on a token signed with another secret.
    assert reason(check, mint(hmac_key("k1", OTHER_SECRET))) is TokenReason.BAD_SIGNATURE
    assert check.statistics().rejected["unknown_key"] == 1


def test_an_hmac_key_does_not_verify_an_ed25519_token_under_its_id() -> None:
    ed_token = mint(ed_key("k1"))
    assert reason(verifier(hmac_key("k1")), ed_token) is TokenReason.BAD_SIGNATURE
    assert reason(verifier(ed_key("k1").verifying()), mint(hmac_key("k1"))) is TokenReason.BAD_SIGNATURE


def test_a_token_for_one_app_never_opens_another() -> None:
    check = verifier(hmac_key())
    token = mint(hmac_key(), app="chat")
    assert reason(check, token, app="admin") is TokenReason.WRONG_APP
    assert reason(check, token, app="Chat") is TokenReason.WRONG_APP
    assert reason(check, token, app="") is TokenReason.WRONG_APP
    assert check.verify(token, now=NOW, app="chat").app == "chat"


def test_cross_kind_replay_is_rejected_both_ways() -> None:
    check = verifier(hmac_key())
    auth = mint(hmac_key())
    session = mint(hmac_key(), kind="session", session_id="s", replica="r")
    assert reason(check, auth, kind="session") is TokenReason.WRONG_KIND
    assert reason(check, session, kind="auth") is TokenReason.WRONG_KIND
    # Re-labelled in the clear: the signature covers the kind's context string.
    assert reason(check, auth.replace("v1.a.", "v1.s.", 1), kind="session") is TokenReason.BAD_SIGNATURE
    assert reason(check, session.replace("v1.s.", "v1.a.", 1)) is TokenReason.BAD_SIGNATURE


def test_a_session_payload_signed_in_the_auth_context_is_malformed_not_a_session() -> None:
    token = claims_by_hand([*GOOD, "s-1", "r-1"], kind="a")
    check = verifier(hmac_key())
    assert reason(check, token) is TokenReason.MALFORMED
    assert reason(check, token, kind="session") is TokenReason.MALFORMED


@pytest.mark.parametrize("skew", [30.0, 0.0, 5.0])
def test_expiry_on_both_sides_of_the_skew(skew: float) -> None:
    token = mint(hmac_key(), ttl=60.0)
    check = verifier(hmac_key(), clock_skew=skew)
    expires = int(NOW) + 60
    assert check.verify(token, now=expires + skew - 0.001, app="chat").expires_at == expires
    assert reason(check, token, now=expires + skew) is TokenReason.EXPIRED
    assert reason(check, token, now=expires + skew + 3600) is TokenReason.EXPIRED
    assert check.statistics().rejected["expired"] == 2


def test_the_default_skew_is_thirty_seconds() -> None:
    token = mint(hmac_key(), ttl=60.0)
    check = TokenVerifier(Keyring([hmac_key()]))
    assert check.config.clock_skew == 30.0
    assert check.verify(token, now=NOW + 89.999, app="chat")
    assert reason(check, token, now=NOW + 90) is TokenReason.EXPIRED


@pytest.mark.parametrize("skew", [30.0, 0.0])
def test_not_before_on_both_sides_of_the_skew(skew: float) -> None:
    token = mint(hmac_key(), not_before=NOW + 100)
    check = verifier(hmac_key(), clock_skew=skew)
    assert reason(check, token, now=NOW + 100 - skew - 0.001) is TokenReason.NOT_YET_VALID
    assert reason(check, token, now=NOW) is TokenReason.NOT_YET_VALID
    assert check.verify(token, now=NOW + 100 - skew, app="chat").not_before == int(NOW) + 100


def test_checks_run_in_the_documented_order() -> None:
    check = verifier(hmac_key(), max_size=200)
    good = mint(hmac_key())
    expired_elsewhere = mint(hmac_key(), app="admin", kind="session", session_id="s", replica="r", ttl=1)
    later = NOW + 3600
    # too large beats malformed
    assert reason(check, "!" * 201) is TokenReason.TOO_LARGE
    # malformed (shape) beats an unknown key
    assert reason(check, "v9.a.nope.x.y") is TokenReason.MALFORMED
    # an unknown key beats a bad signature
    assert reason(check, mint(hmac_key("k9", OTHER_SECRET))) is TokenReason.UNKNOWN_KEY
    # a bad signature beats every claim
    forged = expired_elsewhere[:-2] + ("AA" if not expired_elsewhere.endswith("AA") else "AQ")
    assert reason(check, forged, now=later) is TokenReason.BAD_SIGNATURE
    # then kind, app, expiry
    assert reason(check, expired_elsewhere, now=later) is TokenReason.WRONG_KIND
    assert reason(check, expired_elsewhere, now=later, kind="session") is TokenReason.WRONG_APP
    assert reason(check, expired_elsewhere, now=later, kind="session", app="admin") is TokenReason.EXPIRED
    assert check.verify(good, now=NOW, app="chat")


def test_reasons_are_counted_logged_at_debug_and_never_carry_the_token(caplog: pytest.LogCaptureFixture) -> None:
    check = verifier(hmac_key())
    token = mint(hmac_key())
    with caplog.at_level(logging.DEBUG, logger="blocks.tokens"):
        for app in ("admin", "admin", "chat"):
            try:
                check.verify(token, now=NOW, app=app)
            except InvalidToken as exc:
                assert token not in str(exc)
                assert str(exc) == "token rejected: wrong_app"
    stats = check.statistics()
    assert stats.verified == 1
    assert stats.rejected == {reason.value: (2 if reason is TokenReason.WRONG_APP else 0) for reason in TokenReason}
    messages = [record.getMessage() for record in caplog.records if record.name == "blocks.tokens"]
    assert len(messages) == 2 and all("wrong_app" in m and "k1" in m for m in messages)
    assert not any(token in m or token.split(".")[3] in m for m in messages)


def test_an_invalid_token_is_a_401_with_a_bearer_challenge() -> None:
    with pytest.raises(InvalidToken) as caught:
        verifier(hmac_key()).verify("nope", now=NOW, app="chat")
    error = caught.value
    assert isinstance(error, Unauthorized) and isinstance(error, BlocksError)
    assert error.status == 401
    assert error.headers == [(b"www-authenticate", b"Bearer")]
    assert error.reason is TokenReason.MALFORMED


def key_of(keyring: Keyring, kid: str) -> TokenKey:
    key = keyring.get(kid)
    assert key is not None
    return key


# -- keys and rotation --------------------------------------------------------------------------


def test_rotation_keeps_old_and_new_keys_valid_through_the_overlap() -> None:
    keyring = Keyring([hmac_key("old")])
    check = TokenVerifier(keyring)
    old_token = mint(hmac_key("old"), ttl=7200.0)
    keyring.rotate(hmac_key("new", OTHER_SECRET), now=NOW, overlap=600.0)
    new_token = mint(hmac_key("new", OTHER_SECRET), ttl=7200.0)
    assert key_of(keyring, "old").not_after == NOW + 600
    assert key_of(keyring, "new").not_after is None
    for now in (NOW, NOW + 599.999):
        assert check.verify(old_token, now=now, app="chat").kid == "old"
        assert check.verify(new_token, now=now, app="chat").kid == "new"
    # The window closed: the old key is out of service, whatever its tokens' expiry.
    assert reason(check, old_token, now=NOW + 600) is TokenReason.UNKNOWN_KEY
    assert check.verify(new_token, now=NOW + 600, app="chat").kid == "new"


def test_rotate_keeps_an_earlier_not_after() -> None:
    keyring = Keyring([hmac_key("a", not_after=NOW + 10)])
    keyring.rotate(hmac_key("b"), now=NOW, overlap=600)
    assert key_of(keyring, "a").not_after == NOW + 10


def test_removing_a_key_revokes_its_tokens_at_once() -> None:
    keyring = Keyring([hmac_key("old"), hmac_key("new", OTHER_SECRET)])
    check = TokenVerifier(keyring)
    old_token = mint(hmac_key("old"))
    assert check.verify(old_token, now=NOW, app="chat")
    revision = keyring.revision
    assert keyring.remove("old").kid == "old"
    assert keyring.revision > revision
    assert reason(check, old_token) is TokenReason.UNKNOWN_KEY
    assert check.verify(mint(hmac_key("new", OTHER_SECRET)), now=NOW, app="chat")
    with pytest.raises(KeyError):
        keyring.remove("old")


def test_a_key_id_is_never_reused_for_other_material() -> None:
    keyring = Keyring([hmac_key("k1")])
    with pytest.raises(ValueError, match="already"):
        keyring.add(hmac_key("k1", OTHER_SECRET))
    assert "k1" in keyring and "k2" not in keyring and len(keyring) == 1
    assert keyring.kids() == ["k1"] and [key.kid for key in keyring] == ["k1"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: TokenKey.hmac("k1", b"short"),
        lambda: TokenKey.hmac("bad.kid", SECRET),
        lambda: TokenKey.hmac("", SECRET),
        lambda: TokenKey.hmac("k" * 33, SECRET),
        lambda: TokenKey.hmac("kïd", SECRET),
        lambda: TokenKey(kid="k1", algorithm="ed25519", secret=SECRET),
        lambda: TokenKey(kid="k1", algorithm="ed25519"),
        lambda: TokenKey(kid="k1", algorithm="hmac-sha256", secret=SECRET, private_key=ED_PRIVATE),
        lambda: TokenKey(kid="k1", algorithm="rsa", secret=SECRET),  # type: ignore[arg-type]
    ],
)
def test_bad_keys_are_refused(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_key_material_stays_out_of_reprs() -> None:
    key = hmac_key()
    assert SECRET.hex() not in repr(key) and repr(SECRET) not in repr(key)
    assert "secret" not in repr(key) and "private" not in repr(ed_key())
    assert "k1" in repr(Keyring([key])) and "k1" in repr(TokenIssuer(key))


def test_a_verifying_key_cannot_mint() -> None:
    public = ed_key().verifying()
    assert public.private_key is None and public.public_key is not None and not public.can_mint
    assert hmac_key().verifying() is not None and hmac_key().can_mint
    with pytest.raises(ValueError, match="cannot mint"):
        TokenIssuer(public)
    assert TokenKey.generate("g1").algorithm == "hmac-sha256"
    assert TokenKey.generate("g2", "ed25519").can_mint


@pytest.mark.parametrize(
    "claims",
    [
        {"kind": "session"},
        {"kind": "session", "session_id": "s"},
        {"session_id": "s"},
        {"replica": "r"},
        {"kind": "other"},
        {"ttl": 0.0},
        {"ttl": float("inf")},
        {"now": float("nan")},
        {"now": -1.0},
        {"not_before": float("inf")},
        {"app": "a" * 5000},
    ],
)
def test_the_issuer_refuses_what_it_cannot_mint(claims: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        mint(hmac_key(), **claims)


# -- the verified-token cache -------------------------------------------------------------------


def test_ed25519_tokens_are_cached_and_hits_skip_the_signature() -> None:
    check = verifier(ed_key().verifying())
    token = mint(ed_key())
    first = check.verify(token, now=NOW, app="chat")
    assert check.statistics().cache_entries == 1 and check.statistics().cache_hits == 0
    assert check.verify(token, now=NOW + 1, app="chat") is first
    assert check.verify(token.encode(), now=NOW + 2, app="chat") is first
    stats = check.statistics()
    assert (stats.cache_hits, stats.cache_entries, stats.verified) == (2, 1, 3)


def test_hmac_tokens_are_not_cached() -> None:
    check = verifier(hmac_key())
    token = mint(hmac_key())
    check.verify(token, now=NOW, app="chat")
    check.verify(token, now=NOW, app="chat")
    assert (check.statistics().cache_hits, check.statistics().cache_entries) == (0, 0)


def test_a_cached_token_still_gets_every_claim_check() -> None:
    check = verifier(ed_key().verifying())
    token = mint(ed_key(), not_before=NOW + 100)
    assert reason(check, token) is TokenReason.NOT_YET_VALID  # genuine: cached all the same
    assert check.statistics().cache_entries == 1
    assert reason(check, token, now=NOW + 100, app="admin") is TokenReason.WRONG_APP
    assert reason(check, token, now=NOW + 100, kind="session") is TokenReason.WRONG_KIND
    assert check.verify(token, now=NOW + 100, app="chat")
    assert check.statistics().cache_hits == 3


def test_a_cache_entry_never_outlives_its_token() -> None:
    check = verifier(ed_key().verifying(), clock_skew=10.0)
    token = mint(ed_key(), ttl=60.0)
    check.verify(token, now=NOW, app="chat")
    assert check.verify(token, now=NOW + 69.999, app="chat")
    assert check.statistics().cache_hits == 1
    assert reason(check, token, now=NOW + 70) is TokenReason.EXPIRED
    assert check.statistics().cache_hits == 1  # not served from the cache
    assert check.statistics().cache_entries == 0  # and dropped
    assert reason(check, token, now=NOW + 70) is TokenReason.EXPIRED
    assert check.statistics().cache_entries == 0  # an expired token is not cached again


def test_removing_a_key_drops_its_cached_tokens() -> None:
    keyring = Keyring([ed_key("e1").verifying(), ed_key("e2").verifying()])
    check = TokenVerifier(keyring)
    gone, kept = mint(ed_key("e1")), mint(ed_key("e2"))
    check.verify(gone, now=NOW, app="chat")
    check.verify(kept, now=NOW, app="chat")
    assert check.statistics().cache_entries == 2
    keyring.remove("e1")
    assert reason(check, gone) is TokenReason.UNKNOWN_KEY
    assert check.statistics().cache_entries == 1
    assert check.verify(kept, now=NOW, app="chat")
    assert check.statistics().cache_hits == 1


def test_a_cache_entry_never_outlives_its_keys_not_after() -> None:
    keyring = Keyring([ed_key().verifying()])
    check = TokenVerifier(keyring)
    token = mint(ed_key(), ttl=3600.0)
    check.verify(token, now=NOW, app="chat")
    keyring.retire("e1", NOW + 10)  # the key is replaced: its entries go
    check.verify(token, now=NOW + 1, app="chat")  # verified again, cached until the key's end
    assert check.statistics().cache_hits == 0
    assert check.verify(token, now=NOW + 9.999, app="chat")
    assert check.statistics().cache_hits == 1
    assert reason(check, token, now=NOW + 10) is TokenReason.UNKNOWN_KEY
    assert check.statistics().cache_entries == 0


def test_the_cache_is_bounded_oldest_out_first() -> None:
    check = verifier(ed_key().verifying(), cache_size=3)
    tokens = [mint(ed_key(), tenant=f"t{i}") for i in range(5)]
    for token in tokens:
        check.verify(token, now=NOW, app="chat")
    assert check.statistics().cache_entries == 3
    for token in tokens[2:]:
        check.verify(token, now=NOW, app="chat")
    assert check.statistics().cache_hits == 3
    check.verify(tokens[0], now=NOW, app="chat")  # evicted: verified in full, and it evicts tokens[2]
    assert check.statistics().cache_hits == 3
    assert check.statistics().cache_entries == 3


def test_forgeries_never_enter_the_cache() -> None:
    check = verifier(ed_key().verifying())
    token = mint(ed_key())
    forged = token[:-3] + ("AAA" if not token.endswith("AAA") else "AQA")
    for _ in range(3):
        assert reason(check, forged) is TokenReason.BAD_SIGNATURE
    assert check.statistics().cache_entries == 0


def test_the_cache_can_be_turned_off() -> None:
    check = verifier(ed_key().verifying(), cache_size=0)
    token = mint(ed_key())
    check.verify(token, now=NOW, app="chat")
    check.verify(token, now=NOW, app="chat")
    assert (check.statistics().cache_hits, check.statistics().cache_entries) == (0, 0)


# -- ProxyAuth, without sockets -----------------------------------------------------------------


def proxy_auth(**kwargs: Any) -> ProxyAuth:
    args: dict[str, Any] = {"apps": {"chat"}}
    args.update(kwargs)
    return ProxyAuth(verifier(hmac_key()), **args)


def bearer(token: str, scheme: bytes = b"Bearer") -> tuple[bytes, bytes]:
    return (b"authorization", scheme + b" " + token.encode())


def test_proxy_auth_strips_the_token_it_accepted() -> None:
    auth = proxy_auth()
    headers = [(b"accept", b"*/*"), bearer(mint(hmac_key())), (b"x-other", b"1")]
    claims, forwarded = auth.authorize("chat", headers, NOW)
    assert claims is not None and claims.tenant == "acme"
    assert forwarded == [(b"accept", b"*/*"), (b"x-other", b"1")]
    assert auth.statistics().allowed == 1


@pytest.mark.parametrize("scheme", [b"Bearer", b"bearer", b"BEARER"])
def test_the_bearer_scheme_is_case_insensitive(scheme: bytes) -> None:
    claims, _ = proxy_auth().authorize("chat", [bearer(mint(hmac_key()), scheme)], NOW)
    assert claims is not None


def test_proxy_auth_can_forward_the_token() -> None:
    headers = [bearer(mint(hmac_key()))]
    _, forwarded = proxy_auth(forward_token=True).authorize("chat", headers, NOW)
    assert forwarded == headers


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [(b"authorization", b"Basic dXNlcjpwYXNz")],
        [(b"authorization", b"Bearer")],
        [(b"authorization", b"Bearer   ")],
        [(b"x-token", b"v1.a.k1.x.y")],
        [(b"cookie", b"token=v1.a.k1.x.y")],
    ],
)
def test_no_token_is_a_401_counted_as_missing(headers: list[tuple[bytes, bytes]]) -> None:
    auth = proxy_auth()
    with pytest.raises(Unauthorized) as caught:
        auth.authorize("chat", headers, NOW)
    assert not isinstance(caught.value, InvalidToken)
    assert caught.value.status == 401 and caught.value.headers == [(b"www-authenticate", b"Bearer")]
    assert auth.statistics().missing == 1 and auth.statistics().rejected == 0


def test_an_invalid_token_is_a_401_counted_as_rejected() -> None:
    auth = proxy_auth(apps={"chat", "admin"})
    for app, token in (("chat", "v1.a.k1.x.y"), ("admin", mint(hmac_key(), app="chat"))):
        with pytest.raises(InvalidToken):
            auth.authorize(app, [bearer(token)], NOW)
    stats = auth.statistics()
    assert (stats.required, stats.allowed, stats.missing, stats.rejected) == (2, 0, 0, 2)
    assert auth.verifier.statistics().rejected["wrong_app"] == 1


def test_apps_that_do_not_require_auth_are_left_alone() -> None:
    auth = proxy_auth()
    headers = [bearer("anything at all"), (b"cookie", b"a=1")]
    claims, forwarded = auth.authorize("open", headers, NOW)
    assert claims is None and forwarded is headers
    assert auth.statistics().required == 0


def test_apps_may_be_a_predicate() -> None:
    auth = proxy_auth(apps=lambda app: app.startswith("private-"))
    assert auth.authorize("public", [], NOW) == (None, [])
    with pytest.raises(Unauthorized):
        auth.authorize("private-chat", [], NOW)
    with pytest.raises(TypeError):
        ProxyAuth(verifier(hmac_key()), apps="chat")


def test_a_custom_header_carries_the_bare_token() -> None:
    auth = proxy_auth(header="X-Proxy-Token")
    token = mint(hmac_key())
    claims, forwarded = auth.authorize("chat", [(b"x-proxy-token", token.encode()), bearer("for-the-app")], NOW)
    assert claims is not None
    assert forwarded == [bearer("for-the-app")]  # not ours: the app's own credentials pass


def test_a_cookie_carries_the_token_and_only_that_cookie_is_removed() -> None:
    auth = proxy_auth(cookie="pb_auth")
    token = mint(hmac_key())
    headers = [
        (b"cookie", b"theme=dark; pb_auth=" + token.encode() + b"; lang=en"),
        (b"cookie", b"pb_auth=" + token.encode()),  # h2 may split cookies into several fields
        (b"accept", b"*/*"),
    ]
    claims, forwarded = auth.authorize("chat", headers, NOW)
    assert claims is not None
    assert forwarded == [(b"cookie", b"theme=dark; lang=en"), (b"accept", b"*/*")]


def test_a_quoted_cookie_value_is_unquoted() -> None:
    token = mint(hmac_key())
    claims, _ = proxy_auth(cookie="pb_auth").authorize("chat", [(b"cookie", b'pb_auth="' + token.encode() + b'"')], NOW)
    assert claims is not None


def test_the_header_wins_over_the_cookie_and_both_are_stripped() -> None:
    auth = proxy_auth(cookie="pb_auth")
    headers = [(b"cookie", b"pb_auth=v1.a.k1.bad.token; a=1"), bearer(mint(hmac_key()))]
    claims, forwarded = auth.authorize("chat", headers, NOW)
    assert claims is not None
    assert forwarded == [(b"cookie", b"a=1")]


def test_every_bearer_field_is_stripped_and_the_first_one_counts() -> None:
    auth = proxy_auth()
    good, bad = mint(hmac_key()), "v1.a.k1.bad.token"
    claims, forwarded = auth.authorize("chat", [bearer(good), bearer(bad)], NOW)
    assert claims is not None and forwarded == []
    with pytest.raises(InvalidToken):
        auth.authorize("chat", [bearer(bad), bearer(good)], NOW)
