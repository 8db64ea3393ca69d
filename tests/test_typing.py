"""A user's script type-checks against the installed package: ``mypy --strict`` finds ``blocks`` and its types.

The script lives outside the repository (a user's own project), and mypy
runs from there, so it can only find ``blocks`` through the installation
(the "compat" editable install of ``.ci/venv.sh``, or a wheel).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
from __future__ import annotations

import trio

from blocks import Chain, Exchange, Feature, Headers, UpstreamConfig, serve_chain


class Tag(Feature):
    def response(self, exchange: Exchange, status: int, headers: Headers) -> None:
        headers.append((b"x-tag", b"1"))


async def build(chain: Chain) -> None:
    await chain.start_worker({"r": await chain.start_replica("r")})
    await chain.start_proxy(features=[Tag()], upstream=UpstreamConfig(response_timeout=5.0))
    await chain.start_edge()


def port(chain: Chain) -> int:
    return chain.port


async def main() -> None:
    async with trio.open_nursery() as nursery:
        chain: Chain = await nursery.start(serve_chain, build)
        chain.cancel()
"""


def mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "user.py").write_text(source)
    command = [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "user.py"]
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)


def test_a_users_script_type_checks_against_blocks(tmp_path: Path) -> None:
    result = mypy(tmp_path, SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr
    # ... and the types are the package's, not Any: a wrong one is an error.
    result = mypy(tmp_path, SCRIPT.replace("-> int:\n    return chain.port", "-> str:\n    return chain.port"))
    assert result.returncode == 1 and 'Incompatible return value type (got "int", expected "str")' in result.stdout
