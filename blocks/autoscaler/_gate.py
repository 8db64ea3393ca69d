"""The proxy's side of a cold start: hold a request for a scaled app until its first replica is routed."""

from __future__ import annotations

from blocks.autoscaler._driver import Autoscaler
from blocks.hops import Exchange, Feature
from blocks.routing import RouteCache


class ColdStartGate(Feature):
    """screen: a request for an app ``scaler`` scales touches it; with no live replica, it waits for one.

    Put it in the proxy's ``features`` (``serve_proxy(routes, features=[ColdStartGate(scaler, routes)])``,
    with ``routes`` the :class:`~blocks.routing.RouteCache` the proxy routes from): it runs after the
    proxy has found the request's app. A request for an app with a live replica costs a dict read
    and one assignment (the app is not idle); one for an app with none sets ``exchange.wait``, so
    the handler awaits :meth:`Autoscaler.wait_routed` (a replica starts, the request is routed to
    it once the routes offer it; past ``cold_start_timeout``, a 503 ``cold_start_timeout``).
    A session start (``POST /.proxyblocks/sessions``, which the proxy answers itself) waits the
    same way, then is placed on that replica.
    Requests for other apps pass untouched (no replica there stays a 503 ``no_replica`` at once).
    """

    def __init__(self, scaler: Autoscaler, routes: RouteCache) -> None:
        self.scaler = scaler
        self.routes = routes
        self._apps = frozenset(scaler.apps)

    def screen(self, exchange: Exchange) -> None:
        app = exchange.app
        if app is None or app not in self._apps:
            return
        self.scaler.touch(app)
        if not self.routes.replicas(app):
            exchange.wait = self._wait

    async def _wait(self, exchange: Exchange) -> None:
        assert exchange.app is not None
        await self.scaler.wait_routed(exchange.app, self.routes)
