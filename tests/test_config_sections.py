"""The proxy's tables in a config file: ``[auth]``, ``[sessions]``, ``[mirror]``, ``[cold_start]``, an app's ``mirror``.

Each reader is tested on its own (a good table -> the exact records; a bad
one -> an error that names the key), then ``python -m recipes.chain --config
FILE`` runs as a subprocess, exactly as a user types it, and is reached with
httpx: a 401 without a token and a 200 with one minted from the same secret,
a session that sticks to its replica, and requests copied to a shadow server
this test runs (before and after a SIGHUP that adds the mirror). Loopback
only, port 0, every wait bounded and on a state (a printed line, an answer,
a request that arrived).
"""

from __future__ import annotations

import datetime
import functools
import re
import signal
import time
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1, generate_private_key
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from support import Lines, start_recipe

from blocks import (
    ColdStartConfig,
    MirrorConfig,
    ProxyConfig,
    Request,
    Response,
    SessionConfig,
    TokenIssuer,
    TokenKey,
    WorkerSessionConfig,
    serve_http,
    text_response,
)
from blocks.routing import AppSettings, MirrorSetting, SessionSetting
from blocks.tokens import InvalidToken, ProxyAuth
from blocks.topology import (
    ROUTED_COLD_START,
    App,
    AuthSettings,
    ChainPlan,
    ColdStartSettings,
    SessionSettings,
    hop_options,
    proxy_sections,
    read_apps,
    read_auth,
    read_cold_start,
    read_mirror,
    read_sessions,
    read_token_keys,
)
from recipes.chain import FAIR

SECRET = bytes(range(32))
OTHER = bytes(range(1, 33))


def mint(secret: bytes, app: str = "demo", kid: str = "k1") -> str:
    return TokenIssuer(TokenKey.hmac(kid, secret)).mint(app=app, now=time.time(), ttl=60)


# -- keys ----------------------------------------------------------------------------------------


def test_keys_from_hex_a_secret_file_and_ed25519_pem_files(tmp_path: Path) -> None:
    (tmp_path / "k2.secret").write_text(OTHER.hex() + "\n")  # what openssl rand -hex 32 > FILE writes
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    (tmp_path / "k3.pem").write_bytes(pem)
    (tmp_path / "k4.pub").write_bytes(
        private.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    when = datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    keys = read_token_keys(
        [
            {"kid": "k1", "secret": SECRET.hex(), "not_after": 1_900_000_000},
            {"kid": "k2", "secret_file": "k2.secret"},
            {"kid": "k3", "private_key_file": "k3.pem", "not_after": when},
            {"kid": "k4", "public_key_file": str(tmp_path / "k4.pub")},
        ],
        base=tmp_path,
    )
    summary = [(key.kid, key.algorithm, key.secret, key.can_mint, key.not_after) for key in keys]
    assert summary == [
        ("k1", "hmac-sha256", SECRET, True, 1_900_000_000.0),
        ("k2", "hmac-sha256", OTHER, True, None),
        ("k3", "ed25519", None, True, when.timestamp()),
        ("k4", "ed25519", None, False, None),
    ]
    raw = Encoding.Raw, PublicFormat.Raw
    assert keys[3].public_key is not None and keys[3].public_key.public_bytes(
        *raw
    ) == private.public_key().public_bytes(*raw)


@pytest.mark.parametrize(
    ("entries", "names"),
    [
        ({"kid": "k1"}, ["array of tables"]),
        ([], ["no key"]),
        ([{"secret": SECRET.hex()}], ["keys: 0", "needs its kid"]),
        ([{"kid": "k1", "secret": "zz" * 32}], ["keys: k1: secret", "not hex"]),
        ([{"kid": "k1", "secret": "ab" * 16}], ["keys: k1: secret", "16 bytes", "at least 32"]),
        ([{"kid": "k1", "secret_file": "missing.secret"}], ["keys: k1: secret_file", "missing.secret", "No such file"]),
        ([{"kid": "k1", "secret": SECRET.hex(), "secret_file": "x"}], ["keys: k1", "one of"]),
        ([{"kid": "k1"}], ["keys: k1", "one of"]),
        ([{"kid": "k1", "secret": SECRET.hex()}, {"kid": "k1", "secret": OTHER.hex()}], ["keys: k1", "second key"]),
        ([{"kid": "k1", "secret": SECRET.hex(), "algo": "x"}], ["keys: k1: algo", "not a setting"]),
        ([{"kid": "k1", "secret": 12}], ["keys: k1: secret", "not a string"]),
        ([{"kid": "k/1", "secret": SECRET.hex()}], ["keys: k/1"]),
        ([{"kid": "k1", "public_key_file": "ec.pub"}], ["keys: k1: public_key_file", "not an Ed25519 public key"]),
        ([{"kid": "k1", "public_key_file": "k1.secret"}], ["keys: k1: public_key_file"]),
        (
            [{"kid": "k1", "secret": SECRET.hex(), "not_after": datetime.datetime(2030, 1, 1)}],
            ["keys: k1: not_after", "offset"],
        ),
    ],
)
def test_a_key_it_cannot_use_is_an_error_naming_it(tmp_path: Path, entries: object, names: list[str]) -> None:
    ec = generate_private_key(SECP256R1()).public_key()
    (tmp_path / "ec.pub").write_bytes(ec.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    (tmp_path / "k1.secret").write_text(SECRET.hex())
    with pytest.raises((ValueError, TypeError)) as raised:
        read_token_keys(entries, base=tmp_path)
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


# -- [auth] --------------------------------------------------------------------------------------


def test_auth_reads_its_apps_carriers_and_keys_into_a_proxy_auth() -> None:
    table = {
        "apps": ["chat", "admin"],
        "cookie": "Auth",
        "forward_token": True,
        "clock_skew": 5,
        "keys": [{"kid": "k1", "secret": SECRET.hex()}],
    }
    auth = read_auth(table)
    assert isinstance(auth, AuthSettings)
    assert (auth.apps, auth.header, auth.cookie, auth.forward_token) == (
        frozenset({"chat", "admin"}),
        "authorization",
        "Auth",
        True,
    )
    assert auth.verifier.clock_skew == 5.0 and [key.kid for key in auth.keys] == ["k1"]

    proxy = hop_options({"auth": auth})["proxy"]["auth"]
    assert isinstance(proxy, ProxyAuth)
    assert (proxy.header, proxy.cookie, proxy.forward_token) == (b"authorization", b"Auth", True)
    assert proxy.required("chat") and not proxy.required("demo")
    assert proxy.verifier.verify(mint(SECRET, "chat"), now=time.time(), app="chat", kind="auth").app == "chat"
    with pytest.raises(InvalidToken):
        proxy.verifier.verify(mint(OTHER, "chat"), now=time.time(), app="chat", kind="auth")


@pytest.mark.parametrize(
    ("table", "names"),
    [
        (["k1"], ["auth is a table"]),
        ({"apps": ["chat"]}, ["keys", "[[auth.keys]]"]),
        ({"apps": "chat", "keys": []}, ["apps", "a list of strings"]),
        ({"apps": [""], "keys": []}, ["apps", "a list of strings"]),
        ({"header": "bad header", "keys": []}, ["header", "not a header"]),
        ({"forward_token": "yes", "keys": []}, ["forward_token", "true or false"]),
        ({"clock_skew": -1, "keys": [{"kid": "k1", "secret": SECRET.hex()}]}, ["clock_skew"]),
        ({"require": ["chat"]}, ["require", "not a setting of [auth]", "apps"]),
        ({"keys": [{"kid": "k1", "secret": "nothex"}]}, ["keys: k1: secret", "not hex"]),
    ],
)
def test_a_bad_auth_table_names_the_key(table: object, names: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        read_auth(table)
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


# -- [sessions] ----------------------------------------------------------------------------------


def test_sessions_reads_the_session_config_the_workers_and_its_key() -> None:
    table = {
        "apps": ["room"],
        "ttl": 600,
        "max_per_replica": 4,
        "queue_size": 8,
        "queue_timeout": 2,
        "retry_after": 0.5,
        "header": "X-Room",
        "cookie": False,
        "set_cookie": False,
        "require_auth": False,
        "idle_timeout": 30,
        "max_sessions": 1000,
    }
    assert read_sessions(table) == SessionSettings(
        config=SessionConfig(
            apps={"room"},
            ttl=600.0,
            max_per_replica=4,
            queue_size=8,
            queue_timeout=2.0,
            retry_after=0.5,
            header=b"x-room",
            cookie=None,
            set_cookie=False,
            require_auth=False,
        ),
        worker=WorkerSessionConfig(idle_timeout=30.0, max_sessions=1000),
    )
    assert read_sessions({"apps": ["room"]}) == SessionSettings(config=SessionConfig(apps={"room"}))


def test_the_session_key_is_its_own_or_one_of_auth_and_the_verifier_holds_both() -> None:
    auth = read_auth({"apps": [], "keys": [{"kid": "a1", "secret": SECRET.hex()}]})
    own = read_sessions({"apps": ["room"], "keys": [{"kid": "s1", "secret": OTHER.hex()}]})
    options = hop_options({"auth": auth, "sessions": own})
    assert options["worker"] == {"sessions": WorkerSessionConfig()}
    proxy = options["proxy"]
    assert proxy["sessions"] == SessionConfig(apps={"room"})
    assert proxy["session_issuer"].key.kid == "s1"  # the only key of [[sessions.keys]]
    assert sorted(proxy["session_verifier"].keyring.kids()) == ["a1", "s1"]  # a start's auth token verifies too

    shared = read_sessions({"apps": ["room"], "kid": "a1"})
    assert hop_options({"auth": auth, "sessions": shared})["proxy"]["session_issuer"].key.kid == "a1"
    only = read_sessions({"apps": ["room"]})  # no kid: the only key there is
    assert hop_options({"auth": auth, "sessions": only})["proxy"]["session_issuer"].key.kid == "a1"


@pytest.mark.parametrize(
    ("table", "names"),
    [
        ("room", ["sessions is a table"]),
        ({"apps": ["room"], "ttl": 0}, ["ttl"]),
        ({"apps": ["room"], "ttl": "1h"}, ["ttl", "not a number"]),
        ({"apps": ["room"], "queue_size": 1.5}, ["queue_size", "whole number"]),
        ({"apps": ["room"], "max_per_replica": -1}, ["max_per_replica"]),
        ({"apps": ["room"], "idle_timeout": 0}, ["idle_timeout"]),
        ({"apps": ["room"], "cookie": True}, ["cookie", "false"]),
        ({"apps": ["room"], "sticky": True}, ["sticky", "not a setting of [sessions]"]),
        ({"apps": ["room"], "keys": [{"kid": "s1", "secret": "ab"}]}, ["keys: s1: secret"]),
    ],
)
def test_a_bad_sessions_table_names_the_key(table: object, names: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        read_sessions(table)
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


@pytest.mark.parametrize(
    ("auth", "sessions", "names"),
    [
        (None, {"apps": ["room"]}, ["sessions: kid", "which key"]),
        ([("a1", SECRET), ("a2", OTHER)], {"apps": ["room"]}, ["sessions: kid", "which key"]),
        ([("a1", SECRET)], {"apps": ["room"], "kid": "s9"}, ["sessions: kid", "'s9'", "not a key"]),
        (
            [("a1", SECRET)],
            {"apps": ["room"], "keys": [{"kid": "a1", "secret": OTHER.hex()}]},
            ["sessions: keys: a1", "too"],
        ),
    ],
)
def test_tables_that_disagree_are_one_line_naming_the_file(
    auth: list[tuple[str, bytes]] | None, sessions: dict[str, Any], names: list[str]
) -> None:
    settings: dict[str, Any] = {"config": Path("chain.toml"), "sessions": read_sessions(sessions)}
    if auth is not None:
        keys = [{"kid": kid, "secret": secret.hex()} for kid, secret in auth]
        settings["auth"] = read_auth({"keys": keys})
    errors: list[str] = []

    def error(message: str) -> Any:
        errors.append(message)
        raise SystemExit(2)

    with pytest.raises(SystemExit):
        hop_options(settings, error=error)
    assert errors[0].startswith("chain.toml: ")
    for name in names:
        assert name in errors[0], (name, errors[0])
    with pytest.raises(ValueError, match=r"chain\.toml: sessions: "):
        hop_options(settings)


def test_a_public_key_cannot_sign_session_tokens(tmp_path: Path) -> None:
    public = Ed25519PrivateKey.generate().public_key()
    (tmp_path / "s1.pub").write_bytes(public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo))
    sessions = read_sessions({"apps": ["room"], "keys": [{"kid": "s1", "public_key_file": "s1.pub"}]}, base=tmp_path)
    with pytest.raises(ValueError, match="'s1' cannot sign"):
        hop_options({"sessions": sessions})


# -- [cold_start] --------------------------------------------------------------------------------


def test_cold_start_reads_its_knobs_into_the_proxys_config() -> None:
    table = {"timeout": 5, "max_waiting": 20, "retry_after": 2, "apps": ["chat"]}
    settings = read_cold_start(table)
    config = ColdStartConfig(timeout=5.0, max_waiting=20, retry_after=2.0, apps=["chat"])
    assert settings == ColdStartSettings(config=config)
    assert read_cold_start({}) == ColdStartSettings(config=ColdStartConfig())
    assert read_cold_start({"enabled": False, "timeout": 5}) == ColdStartSettings(config=None)
    assert hop_options({"cold_start": settings})["proxy"] == {"config": ProxyConfig(cold_start=config)}
    assert hop_options({"cold_start": read_cold_start({"enabled": False})})["proxy"] == {"config": ProxyConfig()}
    assert "config" not in hop_options({})["proxy"]


@pytest.mark.parametrize(
    ("table", "names"),
    [
        ([], ["cold_start is a table"]),
        ({"timeout": 0}, ["timeout"]),
        ({"timeout": "soon"}, ["timeout", "not a number"]),
        ({"max_waiting": 0}, ["max_waiting"]),
        ({"apps": "chat"}, ["apps", "not a list of strings"]),
        ({"enabled": "no"}, ["enabled", "not true or false"]),
        ({"wait": 3}, ["wait", "not a setting of [cold_start]"]),
    ],
)
def test_a_bad_cold_start_table_names_the_key(table: object, names: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        read_cold_start(table)
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


def test_a_proxy_that_routes_from_etcd_waits_for_a_replica_unless_its_file_says_not() -> None:
    """The plan's proxy: the cold-start wait on with --route-source, off without, as ``[cold_start]`` says
    when the file has it (the process test: tests/test_scale_from_zero.py)."""
    etcd = "http://127.0.0.1:2379"
    off = hop_options({"cold_start": read_cold_start({"enabled": False})})
    tuned = hop_options({"cold_start": read_cold_start({"timeout": 3})})
    cases = [
        (ChainPlan(), None),
        (ChainPlan(route_source=etcd), ROUTED_COLD_START),
        (ChainPlan(route_source=etcd, options=off), None),
        (ChainPlan(options=tuned), ColdStartConfig(timeout=3.0)),
        (ChainPlan(role="proxy", name="p7", route_source=etcd), ROUTED_COLD_START),
    ]
    for plan, expected in cases:
        config = plan.proxy_options()["config"]
        assert config.cold_start == expected
        assert config.name == (plan.name or "proxy")
    assert ChainPlan(proxies=2, route_source=etcd).proxy_options(2)["config"].name == "proxy-2"


# -- [mirror] and an app's mirror ----------------------------------------------------------------


def test_mirror_reads_the_mirrors_knobs() -> None:
    table = {"max_in_flight": 10, "stall_timeout": 2, "header": "X-Shadow", "host_suffix": "", "seed": 7}
    assert read_mirror(table) == MirrorConfig(
        max_in_flight=10, stall_timeout=2.0, header=b"x-shadow", host_suffix="", seed=7
    )
    assert read_mirror({}) == MirrorConfig()


@pytest.mark.parametrize(
    ("table", "names"),
    [
        ([], ["mirror is a table"]),
        ({"max_in_flight": 0}, ["max_in_flight"]),
        ({"stall_timeout": "5s"}, ["stall_timeout", "not a number"]),
        ({"on_mismatch": "print"}, ["on_mismatch", "not a setting of [mirror]"]),
    ],
)
def test_a_bad_mirror_table_names_the_key(table: object, names: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        read_mirror(table)
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


def test_an_apps_mirror_is_its_settings_record_and_turns_the_proxys_mirror_on() -> None:
    apps = read_apps(
        {
            "shop": {
                "domains": ["shop.example"],
                "replicas": ["http://127.0.0.1:8000"],
                "mirror": {"to": "candidate", "fraction": 0.1, "prefixes": ["/api/"]},
            },
            "candidate": {"replicas": ["http://127.0.0.1:8001"]},
        }
    )
    mirror = MirrorSetting(to="candidate", fraction=0.1, prefixes=["/api/"])
    assert apps["shop"].settings == AppSettings(mirror=mirror)
    assert apps["candidate"] == App((), apps["candidate"].replicas)
    assert hop_options({"apps": apps})["proxy"] == {"mirror": MirrorConfig()}
    assert hop_options({"apps": {"candidate": apps["candidate"]}})["proxy"] == {}
    knobs = MirrorConfig(max_in_flight=3)
    assert hop_options({"apps": {}, "mirror": knobs})["proxy"] == {"mirror": knobs}


@pytest.mark.parametrize(
    ("mirror", "names"),
    [
        ({"to": "candidate", "fraction": 2}, ["shop: mirror", "fraction"]),
        ({"to": "candidate", "ratio": 0.1}, ["shop: ratio", "not a setting of [mirror]"]),
        ({"fraction": 0.1}, ["shop: mirror"]),
        ({"to": "candidate", "address": "127.0.0.1:1"}, ["shop: mirror"]),
        ({"to": "candidate", "prefixes": ["api"]}, ["shop: mirror", "prefix"]),
        ("candidate", ["shop", "mirror is a table"]),
    ],
)
def test_a_bad_app_mirror_names_the_app_and_the_key(mirror: object, names: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        read_apps({"shop": {"replicas": ["http://127.0.0.1:8000"], "mirror": mirror}})
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


def test_an_apps_sessions_are_its_settings_record_and_give_the_proxy_a_broker() -> None:
    auth = read_auth({"apps": [], "keys": [{"kid": "a1", "secret": SECRET.hex()}]})
    apps = read_apps(
        {
            "room": {
                "replicas": ["http://127.0.0.1:8000"],
                "sessions": {"max_per_replica": 2, "queue_timeout": 1, "on_replica_loss": "restart"},
            },
            "plain": {"replicas": ["http://127.0.0.1:8001"]},
        }
    )
    setting = SessionSetting(max_per_replica=2, queue_timeout=1.0, on_replica_loss="restart")
    assert apps["room"].settings == AppSettings(sessions=setting)
    assert apps["plain"].settings is None
    options = hop_options({"apps": apps, "auth": auth})
    assert options["proxy"]["sessions"] == SessionConfig(apps=())  # sessioned by its record, with these defaults
    assert options["proxy"]["session_issuer"].key.kid == "a1"
    assert "mirror" not in options["proxy"]  # (a settings record without a mirror mirrors nothing)
    assert options["worker"] == {"sessions": WorkerSessionConfig()}
    limits = SessionConfig(apps=(), ttl=60).for_app(setting)
    assert (limits.max_per_replica, limits.queue_timeout, limits.ttl, limits.on_replica_loss) == (2, 1.0, 60, "restart")
    assert read_sessions({"on_replica_loss": "restart"}).config == SessionConfig(apps=(), on_replica_loss="restart")


@pytest.mark.parametrize(
    ("sessions", "names"),
    [
        ({"max_per_replica": -1}, ["room: sessions", "max_per_replica"]),
        ({"on_replica_loss": "move"}, ["room: sessions", "on_replica_loss", "fail, restart"]),
        ({"ttl": 0}, ["room: sessions", "ttl"]),
        ({"queue_size": 2.5}, ["room: sessions", "whole number"]),
        ({"sticky": True}, ["room: sessions", "unknown field 'sticky'"]),
        ("yes", ["room: sessions", "a table"]),
    ],
)
def test_a_bad_app_sessions_table_names_the_app_and_the_key(sessions: object, names: list[str]) -> None:
    with pytest.raises((ValueError, TypeError)) as raised:
        read_apps({"room": {"replicas": ["http://127.0.0.1:8000"], "sessions": sessions}})
    for name in names:
        assert name in str(raised.value), (name, str(raised.value))


# -- the chain recipe, as a user runs it ---------------------------------------------------------


async def stop(process: trio.Process, lines: Lines) -> None:
    process.send_signal(signal.SIGINT)
    assert (await lines.rest()).endswith("stopped\n")
    assert await process.wait() == 0


async def test_auth_in_the_config_file_guards_its_apps(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "k1.secret").write_text(SECRET.hex() + "\n")
    config = tmp_path / "chain.toml"
    config.write_text('[auth]\napps = ["demo"]\n[[auth.keys]]\nkid = "k1"\nsecret_file = "keys/k1.secret"\n')
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery, httpx.AsyncClient(trust_env=False, timeout=10) as client:
            process, lines = await start_recipe(nursery, "--config", str(config))
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            refused = await client.get(url + "/")
            assert refused.status_code == 401
            assert refused.headers["proxyblocks-error"] == "unauthorized; hop=proxy"
            forged = await client.get(url + "/", headers={"authorization": f"Bearer {mint(OTHER)}"})
            assert forged.status_code == 401
            allowed = await client.get(url + "/", headers={"authorization": f"Bearer {mint(SECRET)}"})
            assert allowed.status_code == 200 and allowed.headers["x-replica"].startswith("replica-")
            await stop(process, lines)


async def test_sessions_in_the_config_file_stick_to_one_replica(tmp_path: Path) -> None:
    config = tmp_path / "chain.toml"
    config.write_text(
        f'[auth]\napps = []\n[[auth.keys]]\nkid = "k1"\nsecret = "{SECRET.hex()}"\n'
        '[sessions]\napps = ["demo"]\nkid = "k1"\nttl = 600\n'
    )
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery, httpx.AsyncClient(trust_env=False, timeout=10) as client:
            process, lines = await start_recipe(nursery, "--config", str(config), "--replicas", "3")
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            assert (await client.post(url + "/.proxyblocks/sessions")).status_code == 401  # require_auth
            started = await client.post(
                url + "/.proxyblocks/sessions", headers={"authorization": f"Bearer {mint(SECRET)}"}
            )
            assert started.status_code == 201, started.text
            answer = started.json()
            client.cookies.clear()  # the header alone carries it
            replicas = set()
            for _ in range(6):
                response = await client.get(url + "/", headers={"proxyblocks-session": answer["token"]})
                assert response.status_code == 200
                replicas.add(response.headers["x-replica"])
            assert replicas == {answer["replica"]}
            await stop(process, lines)


class Shadow:
    """A server of this test's: counts the mirrored requests (``x-proxyblocks-mirror``) that reach it."""

    def __init__(self) -> None:
        self.copies: list[bytes] = []
        self.copied = trio.Event()

    async def handle(self, request: Request) -> Response:
        if request.header(b"x-proxyblocks-mirror") is not None:
            self.copies.append(request.path)
            self.copied.set()
        return text_response(200, "shadow\n")


async def primary(request: Request) -> Response:
    return text_response(200, "primary\n")


@asynccontextmanager
async def servers() -> AsyncIterator[tuple[Shadow, int, int]]:
    shadow = Shadow()
    async with trio.open_nursery() as nursery:
        first = await nursery.start(functools.partial(serve_http, primary))
        second = await nursery.start(functools.partial(serve_http, shadow.handle))
        yield shadow, first.port, second.port
        nursery.cancel_scope.cancel()


def apps_toml(primary_port: int, shadow_port: int, mirror: str) -> str:
    return (
        f'[apps.shop]\ndomains = ["shop.example"]\nreplicas = ["http://127.0.0.1:{primary_port}"]\n{mirror}'
        f'[apps.candidate]\ndomains = ["candidate.example"]\nreplicas = ["http://127.0.0.1:{shadow_port}"]\n'
    )


async def test_an_apps_mirror_in_the_config_file_copies_its_requests(tmp_path: Path) -> None:
    config = tmp_path / "chain.toml"
    with trio.fail_after(60):
        async with servers() as (shadow, first, second), trio.open_nursery() as nursery:
            mirror = 'mirror = { to = "candidate", fraction = 1.0, prefixes = ["/copied/"] }\n'
            config.write_text(apps_toml(first, second, mirror))
            process, lines = await start_recipe(nursery, "--config", str(config))
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            async with httpx.AsyncClient(trust_env=False, timeout=10, headers={"host": "shop.example"}) as client:
                assert (await client.get(url + "/copied/1")).text == "primary\n"
                await shadow.copied.wait()
                assert shadow.copies == [b"/copied/1"]
            await stop(process, lines)


async def test_sighup_picks_up_an_apps_new_mirror(tmp_path: Path) -> None:
    config = tmp_path / "chain.toml"
    with trio.fail_after(60):
        async with servers() as (shadow, first, second), trio.open_nursery() as nursery:
            config.write_text("[mirror]\nmax_in_flight = 8\n" + apps_toml(first, second, ""))
            process, lines = await start_recipe(nursery, "--config", str(config))
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            async with httpx.AsyncClient(trust_env=False, timeout=10, headers={"host": "shop.example"}) as client:
                assert (await client.get(url + "/before")).text == "primary\n"
                mirror = 'mirror = { to = "candidate", fraction = 1.0 }\n'
                config.write_text("[mirror]\nmax_in_flight = 8\n" + apps_toml(first, second, mirror))
                process.send_signal(signal.SIGHUP)
                await lines.next(r"^reloaded$")
                assert (await client.get(url + "/after")).text == "primary\n"
                await shadow.copied.wait()
                assert shadow.copies == [b"/after"]
            await stop(process, lines)


def test_the_docs_example_reads(tmp_path: Path) -> None:
    """docs/recipes.md's chain.toml: each table through its reader, joined, with the key files it names."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "recipes.md").read_text()
    example = next(
        block for block in re.findall(r"^```toml\n(.*?)^```", page, re.DOTALL | re.MULTILINE) if "[auth]" in block
    )
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "k1.secret").write_text(SECRET.hex() + "\n")
    public = Ed25519PrivateKey.generate().public_key()
    (tmp_path / "keys" / "partner.pub").write_bytes(
        public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    )
    document = tomllib.loads(example)
    settings: dict[str, Any] = {"config": tmp_path / "chain.toml"}
    for name, read in proxy_sections(FAIR).items():
        based = {"base": tmp_path} if name in ("auth", "sessions") else {}
        settings[name] = read(document[name], **based)
    options = hop_options(settings)
    assert options["proxy"]["auth"].required("chat") and not options["proxy"]["auth"].required("shop")
    assert options["proxy"]["session_issuer"].key.kid == "k1"
    assert options["proxy"]["mirror"] == MirrorConfig(max_in_flight=64, stall_timeout=2.0)
    assert settings["apps"]["shop"].settings.mirror.to == "shop-next"
    assert options["worker"] == {"sessions": WorkerSessionConfig(idle_timeout=300.0)}
