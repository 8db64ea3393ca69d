"""The proxy's side of a cold start, with the driver in its process: the proxy's :class:`AwaitReplica`,
whose waiters ask the driver for a start."""

from __future__ import annotations

from blocks.autoscaler._driver import Autoscaler
from blocks.fields import SESSIONS_PATH
from blocks.hops import AwaitReplica, Exchange
from blocks.routing import RouteCache


class ColdStartGate(AwaitReplica):
    """screen: a request for an app ``scaler`` scales touches it; with no live replica, it waits for one.

    Put it in the proxy's ``features`` (``serve_proxy(routes, features=[ColdStartGate(scaler, routes)])``,
    with ``routes`` the :class:`~blocks.routing.RouteCache` the proxy routes from): it runs after the
    proxy has found the request's app. A request for an app with a live replica costs a dict read
    and one assignment (the app is not idle); one for an app with none waits as
    :class:`~blocks.hops.AwaitReplica` has it, in :meth:`Autoscaler.waiter` (the first waiter asks
    the driver for a start, a failed start answers every waiter at once; past
    ``cold_start_timeout``, a 503 ``cold_start_timeout``). A session start
    (``POST /.proxyblocks/sessions``, which the proxy answers itself) asks the
    driver for a start at once (:meth:`Autoscaler.demand`) and waits in its
    app's session queue, which places it on the new replica.
    Requests for other apps pass untouched (no replica there stays a 503 ``no_replica`` at once).
    A proxy in another process needs no gate: ``ProxyConfig(cold_start=...)`` holds its requests,
    and what waits there reaches the driver through the store (:mod:`blocks.sources.demand`).
    """

    def __init__(self, scaler: Autoscaler, routes: RouteCache) -> None:
        super().__init__(scaler.waiter(routes), scaler.apps)
        self.scaler = scaler
        self.routes = routes

    def screen(self, exchange: Exchange) -> None:
        app = exchange.app
        if app is None or self.apps is None or app not in self.apps:
            return
        self.scaler.touch(app)
        if app not in self._live:
            if exchange.answer is not None and exchange.request.path == SESSIONS_PATH:
                self.scaler.demand(app)  # (its session queue waits for the replica)
            else:
                self.hold(exchange)
