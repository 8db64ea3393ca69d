"""What every route source promises: the :class:`RouteSource` protocol, :class:`Progress`, the errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from blocks.routing import RouteEvent


@attrs.frozen
class Progress:
    """A watch's heartbeat: nothing under the prefix changed up to ``revision``.

    A source yields one when its watch is idle, so that a quiet watch is told
    apart from a dead one and the cache can be marked synced. ``revision`` is
    the store's revision when it was sent (the whole store's, not the last
    change under the prefix): it is for statistics and logs, never a place to
    resume from.
    """

    revision: int


class RouteSource(Protocol):
    """Where routes come from: a key/value store with revisions and a change stream.

    Keys are relative to the source's prefix (``domains/chat.example``,
    ``apps/chat/replicas/r1``); values are bytes, as :mod:`blocks.routing`
    encodes them. Revisions are positive integers that grow with every
    change; all the events of one revision (one transaction) share it.
    """

    async def snapshot(self) -> tuple[int, dict[str, bytes]]:
        """Every key under the prefix, at one revision: ``(revision, {key: value})``.

        Raises :class:`SourceUnavailable`.
        """
        ...

    def watch(self, revision: int) -> AsyncIterator[list[RouteEvent] | Progress]:
        """The changes strictly after ``revision``, in order, then as they happen.

        Yields non-empty batches of events, in revision order, no revision
        twice, and never splits one revision's events across two batches (so
        resuming from the last event's revision loses nothing); and, when
        idle, :class:`Progress` heartbeats. It never ends by itself: it
        raises :class:`Compacted` when that history is gone and
        :class:`SourceUnavailable` when the source cannot be reached or the
        watch broke or went silent. The caller closes it (``aclose``) when done.
        """
        ...
