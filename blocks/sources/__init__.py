"""Route sources: where the proxy's routing state comes from, and how it stays in sync.

A route source is a key/value store with revisions and a change stream
(:class:`RouteSource`): the in-process :class:`EmbeddedStore` (fed by a route
file) for one proxy, :class:`EtcdSource` for a fleet. :func:`open_route_cache`
keeps a :class:`~blocks.routing.RouteCache` equal to one, in the background,
without gaps or duplicates; the proxy reads the cache, never the source.
See ``docs/sources.md``.
"""

from blocks.errors import Compacted, RouteFileError, SourceError, SourceUnavailable
from blocks.sources._base import Progress, RouteSource
from blocks.sources.embedded import EmbeddedStore, EmbeddedStoreStatistics
from blocks.sources.etcd import EtcdSource
from blocks.sources.reconcile import (
    ReconcileConfig,
    ReconcileStatistics,
    RouteReconciler,
    open_route_cache,
    reconcile,
)
from blocks.sources.routefile import read_route_file, write_route_file

__all__ = [
    # the protocol
    "Compacted",
    "Progress",
    "RouteSource",
    "SourceError",
    "SourceUnavailable",
    # reconciliation
    "ReconcileConfig",
    "ReconcileStatistics",
    "RouteReconciler",
    "open_route_cache",
    "reconcile",
    # sources
    "EmbeddedStore",
    "EmbeddedStoreStatistics",
    "EtcdSource",
    # route files
    "RouteFileError",
    "read_route_file",
    "write_route_file",
]

from blocks._meta import fixup_module_metadata  # (last: after every name is bound)

fixup_module_metadata(__name__, globals())
del fixup_module_metadata
