"""Choosing the HTTP/2 codec: ``--codec`` on a command, and the nghttp2 codec's two ways to the library
(the C shim, and ABI mode where the shim cannot be built). Real processes, curl as the client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from support import start_recipe

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("codec", ["h2", "nghttp2"])
async def test_the_chain_runs_on_the_codec_its_flag_names_and_says_which(codec: str) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            process, lines = await start_recipe(nursery, "--codec", codec)
            url = (await lines.until(r"^edge listening on (\S+)$")).group(1)
            assert (await lines.until(r"^http/2 codec: (\S+)$")).group(1) == codec
            result = await trio.run_process(
                ["curl", "-s", "--http2-prior-knowledge", f"{url}/"], capture_stdout=True, check=False
            )
            assert result.returncode == 0 and result.stdout, result
            process.terminate()


async def test_an_unknown_codec_is_one_line_and_exit_code_2() -> None:
    with trio.fail_after(60):
        result = await trio.run_process(
            [sys.executable, "-m", "recipes.chain", "--codec", "spdy"],
            capture_stdout=True,
            capture_stderr=True,
            cwd=REPO,
            check=False,
        )
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("proxyblocks: error: "), lines


def _mode(**env: str) -> list[str]:
    """MODE and SHIM_REASON of the nghttp2 codec in a fresh interpreter with ``env`` added."""
    code = "import blocks.transport._nghttp2 as c; print(c.MODE); print(c.SHIM_REASON)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.splitlines()


def test_the_shim_can_be_turned_off() -> None:
    assert _mode(PROXYBLOCKS_NGHTTP2_SHIM="0") == ["abi", "the shim is turned off (PROXYBLOCKS_NGHTTP2_SHIM=0)"]


def test_without_a_compiler_the_codec_runs_in_abi_mode_and_says_why(tmp_path: Path) -> None:
    mode, reason = _mode(PROXYBLOCKS_CACHE=str(tmp_path), CC="false")
    assert mode == "abi"
    assert reason.startswith("the C shim could not be built ("), reason
    assert not list(tmp_path.rglob("*.so")), "nothing half-built is left to load"


def test_the_shim_builds_into_an_empty_cache_and_is_loaded_from_it(tmp_path: Path) -> None:
    assert _mode(PROXYBLOCKS_CACHE=str(tmp_path)) == ["shim", ""]
    assert len(list(tmp_path.rglob("_proxyblocks_nghttp2_shim*.so"))) == 1
