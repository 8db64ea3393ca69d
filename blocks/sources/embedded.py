"""The embedded route store: an in-process key/value store with revisions and a watch.

The default :class:`~blocks.sources.RouteSource` for a single proxy process,
and a faithful small model of etcd's semantics for tests: every write gets
the next revision (the first write is revision 1; an empty store is at 0),
the events of one :meth:`EmbeddedStore.transact` share one revision, and
the last ``history_limit`` events are kept for watches. A watch from before
the kept history raises :class:`~blocks.sources.Compacted`, like a watch
from a compacted etcd revision.

Routes are usually written by hand in a route file (see
:mod:`blocks.sources.routefile`), loaded with :meth:`EmbeddedStore.load_file`
and followed with :meth:`EmbeddedStore.watch_file`; ``python -m
blocks.routectl --store FILE`` edits that file.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping

import attrs
import trio

from blocks.errors import Compacted, RouteFileError
from blocks.routing import RouteEvent
from blocks.sources._base import Progress
from blocks.sources.routefile import parse_route_file, read_route_file

log = logging.getLogger("blocks.sources")

_RACY_NS = 2_000_000_000
"""A file modified this recently (ns) is read and hashed even when its stat
looks unchanged: a same-size rewrite within one mtime tick would look
unchanged (git's "racy clean" problem)."""


@attrs.frozen
class EmbeddedStoreStatistics:
    revision: int
    keys: int
    history: int
    """Events kept for watches (at most ``history_limit``)."""
    compact_revision: int
    """Watches must start at or after it: the events up to it are gone."""
    watchers: int
    file_loads: int
    """Route-file loads that changed something (the first one included)."""
    file_error: str | None
    """Why the route file's latest version was not loaded; ``None`` once a good one is."""


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"a key must be a non-empty string, got {key!r}")
    return key


@attrs.define(eq=False)
class EmbeddedStore:
    """An in-process route store; also a :class:`~blocks.sources.RouteSource`.

    Writes (:meth:`put`, :meth:`delete`, :meth:`transact`, :meth:`load_file`)
    are plain synchronous calls and return the store's revision after them;
    call them from any task in the trio run that watches, or before it
    starts. ``progress_interval`` is how often an idle watch yields a
    :class:`~blocks.sources.Progress`.
    """

    history_limit: int = attrs.field(default=10_000, validator=attrs.validators.ge(1), kw_only=True)
    progress_interval: float = attrs.field(default=1.0, validator=attrs.validators.gt(0), kw_only=True)
    _data: dict[str, bytes] = attrs.field(factory=dict, init=False)
    _revision: int = attrs.field(default=0, init=False)
    _history: list[RouteEvent] = attrs.field(factory=list, init=False)
    _compacted: int = attrs.field(default=0, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _watchers: int = attrs.field(default=0, init=False)
    _file_loads: int = attrs.field(default=0, init=False)
    _file_error: str | None = attrs.field(default=None, init=False)
    _layers: dict[str, set[str]] = attrs.field(factory=dict, init=False)  # what each layer wrote last

    def __repr__(self) -> str:
        return (
            f"<EmbeddedStore revision={self._revision} keys={len(self._data)} "
            f"history={len(self._history)} compacted={self._compacted}>"
        )

    @property
    def revision(self) -> int:
        """The revision of the last write, 0 before any."""
        return self._revision

    def get(self, key: str) -> bytes | None:
        return self._data.get(key)

    def items(self) -> dict[str, bytes]:
        """A copy of every key and value (what :meth:`snapshot` returns, without the await)."""
        return dict(self._data)

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> int:
        """Set ``key`` to ``value`` at a new revision (even if the value is the same, as etcd does)."""
        return self.transact(puts={key: value})

    def delete(self, key: str) -> int:
        """Remove ``key`` at a new revision; a missing key changes nothing (as in etcd)."""
        return self.transact(deletes=[key])

    def transact(self, puts: Mapping[str, bytes] | None = None, deletes: Iterable[str] = ()) -> int:
        """Apply puts and deletes at one revision: a watcher sees all of them in one batch or none.

        Deleting a missing key is no change; with no change at all the
        revision stays where it is. A key both put and deleted is a ``ValueError``.
        """
        puts = dict(puts or {})
        for key, value in puts.items():
            _check_key(key)
            if not isinstance(value, bytes):
                raise TypeError(f"{key}: a value must be bytes, got {type(value).__name__}")
        gone = [_check_key(key) for key in dict.fromkeys(deletes) if key in self._data]
        if set(gone) & puts.keys():
            raise ValueError(f"keys both put and deleted: {sorted(set(gone) & puts.keys())}")
        if not puts and not gone:
            return self._revision
        revision = self._revision + 1
        events = [RouteEvent("delete", key, None, revision) for key in gone]
        events += [RouteEvent("put", key, value, revision) for key, value in puts.items()]
        for key in gone:
            del self._data[key]
        self._data.update(puts)
        self._revision = revision
        self._history.extend(events)
        if len(self._history) > self.history_limit:
            self._forget(self._history[len(self._history) - self.history_limit - 1].revision)
        self._changed.set()
        self._changed = trio.Event()
        return revision

    def load_routes(self, routes: Mapping[str, bytes], *, layer: str | None = None) -> int:
        """Write ``routes`` in one transaction of the difference; return the revision after it.

        Without ``layer``, the store then holds exactly ``routes``. With one
        (a name: a recipe's, a route file's path), ``routes`` replace what
        the last load of that layer wrote and add to everything else: their
        keys are put where the values differ, and a key the layer wrote last
        time and no longer names is deleted. Keys written otherwise stay. (A
        key two layers name holds the value written last; either dropping
        it deletes it.)
        """
        before = self._data if layer is None else self._layers.get(layer, ())
        puts = {key: value for key, value in routes.items() if self._data.get(key) != value}
        revision = self.transact(puts, [key for key in before if key not in routes])
        if layer is not None:
            self._layers[layer] = set(routes)
        return revision

    def load_file(self, path: str | os.PathLike[str]) -> int:
        """Load the routes of a route file (TOML or JSON) as the layer named by its path (see :meth:`load_routes`).

        The file adds to what was written otherwise (a recipe's routes, say),
        and a key an earlier load of it wrote that it no longer names is
        deleted; a store fed only by the file holds exactly its routes.
        Blocking file I/O: for start-up. Raises
        :class:`~blocks.sources.routefile.RouteFileError`, and then changes nothing.
        """
        return self._take_file(path, read_route_file(path))

    def _take_file(self, path: str | os.PathLike[str], routes: Mapping[str, bytes]) -> int:
        revision = self.load_routes(routes, layer=os.fspath(path))
        self._file_loads += 1
        self._file_failed(path, None)
        return revision

    def _file_failed(self, path: str | os.PathLike[str], error: str | None) -> None:
        """Keep the route file's error (None: it loaded); a warning once per change, never per poll."""
        was, self._file_error = self._file_error, error
        if error is not None and error != was:
            log.warning("route file failed (%s); keeping the last good routes", error)
        elif error is None and was is not None:
            log.warning("route file %s loads again", os.fspath(path))

    def compact(self, revision: int) -> None:
        """Forget the history up to ``revision``: watches from before it raise ``Compacted``."""
        if revision > self._revision:
            raise ValueError(f"cannot compact to {revision}, past the current revision {self._revision}")
        self._forget(revision)
        self._changed.set()
        self._changed = trio.Event()

    def _forget(self, revision: int) -> None:
        if revision <= self._compacted:
            return
        self._compacted = revision
        # Whole revisions only: a watch never gets part of one.
        del self._history[: bisect.bisect_right(self._history, revision, key=_revision_of)]

    # -- RouteSource --------------------------------------------------------------------------

    async def snapshot(self) -> tuple[int, dict[str, bytes]]:
        await trio.lowlevel.checkpoint()
        return self._revision, dict(self._data)

    async def watch(self, revision: int) -> AsyncIterator[list[RouteEvent] | Progress]:
        """Batches of the events after ``revision``; a :class:`Progress` each idle ``progress_interval``."""
        position = revision
        self._watchers += 1
        try:
            while True:
                await trio.lowlevel.checkpoint()
                if position < self._compacted:
                    raise Compacted(
                        f"revisions up to {self._compacted} are compacted; asked for those after {position}",
                        compact_revision=self._compacted,
                    )
                history = self._history
                start = bisect.bisect_right(history, position, key=_revision_of)
                if start < len(history):
                    batch = history[start:]
                    position = batch[-1].revision
                    yield batch
                    continue
                changed = self._changed
                # The scope covers the wait only, never a yield (an async generator must not
                # yield inside a cancel scope).
                with trio.move_on_after(self.progress_interval):
                    await changed.wait()
                if not changed.is_set():
                    yield Progress(self._revision)
        finally:
            self._watchers -= 1

    # -- the route file -----------------------------------------------------------------------

    async def watch_file(
        self,
        path: str | os.PathLike[str],
        *,
        interval: float = 1.0,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Load a route file, report started, then reload it whenever it changes. Runs until cancelled.

        Each load writes over the store's own routes as :meth:`load_file` does.

        The first load raises :class:`~blocks.sources.routefile.RouteFileError`
        (start-up should fail loudly). Afterwards a file that cannot be read
        or parsed (half-saved, a typo, deleted) keeps the last good routes,
        and the reason is in ``statistics().file_error`` until a good
        version is loaded.

        Why a poll every ``interval`` seconds rather than inotify: it works
        the same on every platform and filesystem (network mounts, container
        volumes); it survives editors and tools that replace the file by a
        rename, and Kubernetes ConfigMap volumes that swap a symlink, which
        an inotify watch on the old inode would miss; and it costs one
        ``stat`` per interval. The stat's (mtime, size, inode) says when to
        read; a file changed in the last two seconds is read and hashed
        anyway, since a rewrite of the same size within one mtime tick
        leaves the stat unchanged. Only a change of content reloads, and
        only once the new content has read the same at two polls in a row
        (so a change takes one to two intervals): a tool that rewrites the
        file in place could be caught half-way through, and half a route
        file can parse, dropping routes. Write with a rename to be safe
        anyway (``routectl`` does).
        """
        if not interval > 0:
            raise ValueError("interval must be > 0")
        file = trio.Path(os.fspath(path))
        signature: tuple[int, int, int] | None = await _signature(file)
        data = await file.read_bytes()
        self._take_file(path, parse_route_file(data, path=path))
        loaded = hashlib.sha256(data).digest()  # the content whose routes are in force
        candidate: bytes | None = None  # new content seen once, waiting to be seen again
        rejected: bytes | None = None  # content that did not parse
        task_status.started()
        while True:
            await trio.sleep(interval)
            try:
                # Stat before reading: a change after the read shows up in the next stat.
                current = await _signature(file)
                settled = time.time_ns() - current[0] > _RACY_NS
                if current == signature and candidate is None and settled:
                    continue
                signature = current
                data = await file.read_bytes()
            except OSError as exc:
                signature = candidate = None
                self._file_failed(path, f"{os.fspath(path)}: {exc.strerror or exc}")
                continue
            digest = hashlib.sha256(data).digest()
            if digest == loaded:  # unchanged, or back to the routes in force after a bad save
                candidate = None
                self._file_failed(path, None)
                continue
            if digest != candidate:
                # New content must read the same at the next poll before it is loaded: a
                # tool that rewrites the file in place (truncate, then write) could
                # otherwise be caught half-way, and half a route file parses fine.
                candidate = digest
                continue
            candidate = None
            if digest == rejected:
                continue
            try:
                routes = parse_route_file(data, path=path)
            except RouteFileError as exc:
                rejected = digest
                self._file_failed(path, str(exc))
                continue
            self._take_file(path, routes)
            loaded = digest

    def statistics(self) -> EmbeddedStoreStatistics:
        return EmbeddedStoreStatistics(
            revision=self._revision,
            keys=len(self._data),
            history=len(self._history),
            compact_revision=self._compacted,
            watchers=self._watchers,
            file_loads=self._file_loads,
            file_error=self._file_error,
        )


def _revision_of(event: RouteEvent) -> int:
    return event.revision


async def _signature(file: trio.Path) -> tuple[int, int, int]:
    result = await file.stat()
    return result.st_mtime_ns, result.st_size, result.st_ino


__all__ = [
    "EmbeddedStore",
    "EmbeddedStoreStatistics",
]
