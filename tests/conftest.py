"""Shared fixtures. Rules for every test here: loopback only, port 0,
every test bounded by ``trio.fail_after``, real clients and servers.

``pytest --codec nghttp2`` runs the whole suite on the libnghttp2 codec
(``h2``, hyper-h2, by default): this process uses it, and so does every
command a test starts (``PROXYBLOCKS_CODEC``). A test about one codec's
internals is marked ``codec("h2")`` and skipped under the other.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import AsyncIterator, Iterator

import pytest
import trio

from blocks.transport._codec import CODECS, use_codec
from recipes.chain import Chain, main


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--codec", choices=CODECS[:2], default="h2", help="the HTTP/2 codec of every connection the tests make"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "codec(name): the test is about that HTTP/2 codec only")
    name = config.getoption("--codec")
    use_codec(name)  # (CodecUnavailable, one line, where libnghttp2 is missing)
    os.environ["PROXYBLOCKS_CODEC"] = name
    os.environ["PYTHONUNBUFFERED"] = "1"  # every command a test starts runs as a container runs it: no stdio buffer


def pytest_report_header(config: pytest.Config) -> str:
    return f"HTTP/2 codec: {config.getoption('--codec')}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    name = config.getoption("--codec")
    for item in items:
        marker = item.get_closest_marker("codec")
        if marker is not None and marker.args[0] != name:
            item.add_marker(pytest.mark.skip(reason=f"about the {marker.args[0]} codec (this run: {name})"))


@pytest.fixture(autouse=True)
def _collect_garbage() -> Iterator[None]:
    """Collect after every test, so that a socket some block forgot to close
    raises its ResourceWarning (an error here) in the test that leaked it."""
    yield
    gc.collect()


@pytest.fixture
async def chain(nursery: trio.Nursery) -> AsyncIterator[Chain]:
    """The full chain recipe, as ``python -m recipes.chain`` runs it."""
    with trio.fail_after(10):
        started: Chain = await nursery.start(functools.partial(main, replicas=2))
    yield started
    with trio.fail_after(10):
        await started.shutdown(1.0)
