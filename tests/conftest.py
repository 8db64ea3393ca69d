"""Shared fixtures. Rules for every test here: loopback only, port 0,
every test bounded by ``trio.fail_after``, real clients and servers."""

from __future__ import annotations

import functools
import gc
from collections.abc import AsyncIterator, Iterator

import pytest
import trio

from recipes.chain import Chain, main


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
