"""Bad input at startup: one line on stderr, ``proxyblocks: error: ...``, exit code 2, no traceback.

Each case runs a recipe as a subprocess, exactly as a user would type it.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

REPO = Path(__file__).resolve().parent.parent
KEY = f"[[auth.keys]]\nkid = 'k1'\nsecret = '{'ab' * 32}'\n"


async def run_recipe(recipe: str, *args: str) -> tuple[int, str, str]:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", f"recipes.{recipe}", *args],
            capture_stdout=True,
            capture_stderr=True,
            cwd=REPO,
            check=False,
        )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def assert_one_line_error(code: int, stdout: str, stderr: str, *names: str) -> None:
    assert code == 2, (code, stderr)
    assert "listening" not in stdout
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("proxyblocks: error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--port", "70000"], ["--port", "70000"]),
        (["--port", "-1"], ["--port"]),
        (["--replicas", "0"], ["--replicas", "0"]),
        (["--grace", "-1"], ["--grace"]),
        (["--replica-timeout", "nan"], ["--replica-timeout"]),
        (["--replica", "ftp://127.0.0.1:21"], ["--replica", "ftp://127.0.0.1:21"]),
        (["--no-such-flag"], ["--no-such-flag"]),
        (["--role", "edge"], ["--role edge", "needs --next-hop"]),
        (["--role", "proxy", "--replica", "http://127.0.0.1:1"], ["--role proxy", "--next-hop"]),
        (["--role", "router"], ["--role", "router"]),
        (["--next-hop", "https://127.0.0.1:1"], ["--next-hop", "h2c://"]),
        (["--cert", "cert.pem"], ["--cert and --key"]),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) and value[0].startswith("--") else "",
)
async def test_a_bad_flag(args: list[str], names: list[str]) -> None:
    assert_one_line_error(*await run_recipe("chain", *args), *names)


@pytest.fixture
def port_in_use() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


async def test_a_port_in_use(port_in_use: int) -> None:
    code, stdout, stderr = await run_recipe("chain", "--port", str(port_in_use))
    assert_one_line_error(code, stdout, stderr, f"127.0.0.1:{port_in_use}", "in use")


@pytest.mark.parametrize(
    ("content", "what"), [("domains = [unclosed", "Invalid"), (None, "No such file")], ids=["malformed", "missing"]
)
async def test_a_route_file_that_does_not_load(tmp_path: Path, content: str | None, what: str) -> None:
    path = tmp_path / "routes.toml"
    if content is not None:
        path.write_text(content)
    code, stdout, stderr = await run_recipe("chain", "--routes", str(path))
    assert_one_line_error(code, stdout, stderr, str(path), what)


@pytest.mark.parametrize("recipe", ["chat", "fleet", "noisy_neighbour", "shadow"])
async def test_every_recipe_says_a_bad_flag_in_one_line(recipe: str) -> None:
    assert_one_line_error(*await run_recipe(recipe, "--no-such-flag"), "--no-such-flag")


@pytest.mark.parametrize(
    ("cert", "key", "what"),
    [(None, None, "no such file"), ("not a certificate", "not a key", "not a PEM certificate")],
    ids=["missing", "not-pem"],
)
async def test_a_certificate_it_cannot_use(tmp_path: Path, cert: str | None, key: str | None, what: str) -> None:
    paths = tmp_path / "cert.pem", tmp_path / "key.pem"
    for path, text in zip(paths, (cert, key), strict=True):
        if text is not None:
            path.write_text(text)
    code, stdout, stderr = await run_recipe("chain", "--cert", str(paths[0]), "--key", str(paths[1]))
    assert_one_line_error(code, stdout, stderr, str(paths[0]), what)


@pytest.mark.parametrize(
    ("content", "names"),
    [
        (None, ["--config", "No such file"]),
        ("port = [unclosed", ["--config", "not TOML"]),
        ("prot = 8080", ["prot", "not a setting", "port"]),
        ("port = 70000", ["port", "'70000' is not a port"]),
        ("replicas = 0", ["replicas", "at least 1"]),
        ("tls = 'yes'", ["tls", "true or false"]),
        ("replica = ['ftp://127.0.0.1:1']", ["replica", "ftp://"]),
        ("replica-protocol = 'h3'", ["replica-protocol", "'h3' is not one of h2, h1"]),
        ("[apps.chat]\ndomains = 'chat.example'", ["apps", "chat: an app is"]),
        ("[apps.chat]\nreplicas = ['http://127.0.0.1']", ["apps", "host and a port"]),
        ("[scheduler]\nmax_in_flight = -1", ["scheduler", "max_in_flight"]),
        ("[scheduler]\nfairness = 1", ["scheduler", "fairness"]),
        ("[auth]\n[[auth.keys]]\nkid = 'k1'\nsecret = 'zz'", ["auth", "keys: k1: secret", "not hex"]),
        ("[auth]\n[[auth.keys]]\nkid = 'k1'\nsecret_file = 'k1.secret'", ["auth", "k1", "k1.secret", "No such file"]),
        (f"[auth]\n{KEY}{KEY}", ["auth", "keys: k1", "a second key"]),
        ("[auth]\napps = ['demo']", ["auth", "keys", "[[auth.keys]]"]),
        ("[sessions]\napps = ['demo']\nttl = 0", ["sessions", "ttl"]),
        (f"[sessions]\napps = ['demo']\nkid = 'k9'\n{KEY.replace('auth', 'sessions')}", ["sessions", "kid", "'k9'"]),
        ("[mirror]\nmax_in_flight = 0", ["mirror", "max_in_flight"]),
        ("[apps.shop]\nmirror = { to = 'candidate', fraction = 2 }", ["apps", "shop: mirror", "fraction"]),
    ],
    ids=lambda value: value.splitlines()[-1] if isinstance(value, str) else "missing" if value is None else "",
)
async def test_a_config_file_it_cannot_use(tmp_path: Path, content: str | None, names: list[str]) -> None:
    path = tmp_path / "chain.toml"
    if content is not None:
        path.write_text(content)
    code, stdout, stderr = await run_recipe("chain", "--config", str(path))
    assert_one_line_error(code, stdout, stderr, str(path), *names)
